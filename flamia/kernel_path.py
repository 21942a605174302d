"""The kernel path of one attention call: quantize once, forward, and a backward from the same
quantized operands and LSE (P3). Shared by the eager autograd.Function (interface) and the
torch.compile custom ops (custom_ops), so compiled results are bitwise the eager ones."""
from __future__ import annotations

import dataclasses
import functools

import torch

_ENTRY_POINTS = []


def kernel_entry_points():
    """((quantize_qkv, attention_forward, attention_backward), None), or (None, why) while the
    kernel modules cannot be imported (then every call runs the reference). Memoized in a
    module list, not functools.lru_cache: torch.compile traces interface.backend() and would
    warn about (and step through) the cache wrapper."""
    if not _ENTRY_POINTS:
        try:
            from .ops.backward import attention_backward
            from .ops.forward import attention_forward
            from .ops.quantize import quantize_qkv
            _ENTRY_POINTS.append(((quantize_qkv, attention_forward, attention_backward), None))
        except ImportError as e:
            _ENTRY_POINTS.append((None, f"{type(e).__name__}: {e}"))
    return _ENTRY_POINTS[0]


def kernel_forward(q, k, v, cu_seqlens, max_seqlen, recipe: str, causal, softmax_scale):
    """(out, lse, qkv): quantize once and run the forward kernel; qkv is what the backward
    needs of the quantization (P3: nothing is quantized twice)."""
    quantize_qkv, attention_forward, _ = kernel_entry_points()[0]
    qkv = quantize_qkv(q, k, v, cu_seqlens, recipe, causal)
    if qkv.kvblock:   # the token-block backward bounds P^T with the forward's row max
        out, lse, row_max = attention_forward(qkv, cu_seqlens, max_seqlen, causal, softmax_scale,
                                              q.dtype, return_row_max=True)
        return out, lse, dataclasses.replace(qkv, vt8=None, vt8_diag=None, scale_cols=None,
                                             kv_pcu=None, row_max=row_max)
    out, lse = attention_forward(qkv, cu_seqlens, max_seqlen, causal, softmax_scale, q.dtype)
    # vt8 (the PV GEMM's K-major V) is the forward's alone: the backward reads v8. Not kept,
    # so what waits for the backward is Hkv * D bytes per token smaller (token-block scaling:
    # vt8_diag and the padded scale columns too).
    return out, lse, dataclasses.replace(qkv, vt8=None)


def kernel_backward(dout, out, lse, qkv, cu_seqlens, max_seqlen, causal, softmax_scale,
                    deterministic):
    """(dq, dk, dv) from the forward's out, lse and qkv (kernel_forward)."""
    attention_backward = kernel_entry_points()[0][2]
    return attention_backward(dout, out, lse, qkv, cu_seqlens, max_seqlen, causal, softmax_scale,
                              deterministic)


def dense_offsets(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """[0, S, 2S, ..., BS]: the cu_seqlens of a dense batch (one document per row)."""
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen


# One tensor per shape, so the metadata the kernels memoize on it
# (flamia.ops.schedule.per_cu_seqlens) is built once, not at every layer and step. Never
# modified (the kernels only read cu_seqlens).
dense_cu_seqlens = functools.lru_cache(maxsize=64)(dense_offsets)
