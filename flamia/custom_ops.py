"""The kernel path as two torch.library custom ops, for torch.compile: flamia::fwd, flamia::bwd.

Eager calls run the kernels through interface's autograd.Function: the leanest host path (a
short-document call is bound by its host). Under torch.compile a flamia call is instead one
opaque node per direction, built from the same functions (kernel_path.kernel_forward /
kernel_backward), so compiled results are bitwise the eager ones. The compiler sees each op's
output shapes (the fake implementations below), not Triton launches and host code that reads
cu_seqlens, so `torch.compile(model, fullgraph=True)` traces a model through flamia attention. (The ops themselves have no autograd
registration: _OpAttention, an autograd.Function that dynamo traces, is their autograd.)

What the forward keeps for the backward travels as op outputs, as a custom op requires:
out, lse and the quantized operands (fp8: q8, k8, v8 with their scales sq, sk, sv, vcap, the
per-token diagonal copies k8_diag, v8_diag, sk_diag, sv_diag (causal), vnorm and the forward's
row max). A field a recipe does not have travels as an empty
placeholder. The bf16 recipe's operands are q, k, v themselves (the op's inputs: an output may
not alias them), so its forward returns placeholders and the backward gets q, k, v.

The value checks of flamia.validate (cu_seqlens against T and max_seqlen, NaN / Inf) read
tensor values; under torch.compile they run inside the forward op (check_values), where
reading values does not break the graph.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .kernel_path import dense_cu_seqlens, kernel_backward, kernel_forward
from .ops.layout import QuantizedQKV
from .recipes import get_recipe
from .validate import check_values

# fp8's fields: always present, and the diagonal copies (causal only; empty placeholders else)
_FP8_SAVED = ("q8", "k8", "v8", "sq", "sk", "sv", "vcap", "vnorm", "row_max")
_DIAG_SAVED = ("k8_diag", "v8_diag", "sk_diag", "sv_diag")
_SAVED = _FP8_SAVED + _DIAG_SAVED


def resolve_cu_seqlens(cu_seqlens, q, seqlen: int):
    """cu_seqlens, or for a dense call (None) the memoized [0, S, 2S, ..] of the eager path
    (kernel_path.dense_cu_seqlens). Built here, not in the compiled graph: a traced arange would
    be a new tensor at every call, and the kernels' metadata is memoized on the tensor
    (flamia.ops.schedule.per_cu_seqlens)."""
    if cu_seqlens is not None:
        return cu_seqlens
    return dense_cu_seqlens(q.shape[0] // seqlen, seqlen, q.device)


# Not for torch.compile's own CUDA graphs (mode="reduce-overhead"): they copy each input into a
# static buffer, so the metadata the kernels memoize on cu_seqlens (flamia.ops.schedule) would
# be rebuilt inside the graph's memory pool and outlive the capture ("tensors in the cudagraph
# pool not tracked as outputs", seen on the H200). Tagged, inductor runs
# the ops outside its graphs instead. (torch.cuda.graph around whole calls works:
# tests/gpu/test_cuda_graphs_gpu.py.)
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("flamia::fwd", mutates_args=(), tags=_TAGS)
def fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None, cu_seqlens_k: Tensor | None,
        max_seqlen_q: int, max_seqlen_k: int, recipe: str, causal: bool, softmax_scale: float,
        deterministic: bool, check_content: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(out, lse, [the _SAVED fields]) of the kernel forward. cu_seqlens None: a dense
    call of documents of max_seqlen_q tokens (see resolve_cu_seqlens); cu_seqlens_k: checked
    against cu_seqlens (None: the same tensor; autograd.Function.apply under dynamo refuses one tensor
    passed twice); deterministic: for the backward (every launch is deterministic by default);
    check_content: check_finite."""
    check_values(q, k, v, softmax_scale, check_content, cu_seqlens,
                 cu_seqlens if cu_seqlens_k is None else cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out, lse, qkv = kernel_forward(q, k, v, resolve_cu_seqlens(cu_seqlens, q, max_seqlen_q),
                                   max(max_seqlen_q, max_seqlen_k), recipe, causal, softmax_scale)
    saved = [None] * len(_SAVED) if recipe == "bf16" else [getattr(qkv, n) for n in _SAVED]
    return out, lse, [q.new_empty(0, dtype=torch.float32) if x is None else x for x in saved]


@fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen_q, max_seqlen_k, recipe, causal,
              softmax_scale, deterministic, check_content):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    f8, f32 = torch.float8_e4m3fn, torch.float32
    shapes = {}          # field -> (shape, dtype); the rest are placeholders
    if recipe != "bf16":
        shapes.update(q8=((T, Hq, D), f8), k8=((T, Hkv, D), f8), v8=((T, Hkv, D), f8),
                      sq=((Hq, T), f32), sk=((Hkv, T), f32), sv=((Hkv, T), f32),
                      vcap=((Hkv, T), f32), vnorm=((Hkv, T), f32), row_max=((Hq, T), f32))
        if causal:
            shapes.update(k8_diag=((T, Hkv, D), f8), v8_diag=((T, Hkv, D), f8),
                          sk_diag=((Hkv, T), f32), sv_diag=((Hkv, T), f32))
    saved = [q.new_empty(shapes[n][0], dtype=shapes[n][1]) if n in shapes
             else q.new_empty(0, dtype=f32)
             for n in _SAVED]
    return q.new_empty(q.shape), q.new_empty((Hq, T), dtype=f32), saved


@torch.library.custom_op("flamia::bwd", mutates_args=(), tags=_TAGS)
def bwd(dout: Tensor, out: Tensor, lse: Tensor, saved: list[Tensor], cu_seqlens: Tensor | None,
        max_seqlen: int, recipe: str, causal: bool, softmax_scale: float, deterministic: bool
        ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in dout's dtype from flamia::fwd's saved list. bf16: its first three entries
    are the forward's q, k, v and the rest placeholders."""
    if recipe == "bf16":
        qkv = QuantizedQKV("bf16", *(x.to(torch.bfloat16) for x in saved[:3]), None, None,
                           None, None, rotated=False)
    else:
        fields = {n: (x if x.numel() or n in _FP8_SAVED else None) for n, x in zip(_SAVED, saved)}
        qkv = QuantizedQKV(recipe, rotated=bool(get_recipe(recipe).rotate_qk), **fields)
    return kernel_backward(dout, out, lse, qkv, resolve_cu_seqlens(cu_seqlens, dout, max_seqlen),
                           max_seqlen, causal, softmax_scale, deterministic)


@bwd.register_fake
def _bwd_fake(dout, out, lse, saved, cu_seqlens, max_seqlen, recipe, causal, softmax_scale,
              deterministic):
    k8 = saved[1]
    return (dout.new_empty(dout.shape), dout.new_empty(k8.shape, dtype=dout.dtype),
            dout.new_empty(k8.shape, dtype=dout.dtype))


class _OpAttention(torch.autograd.Function):
    """flamia::fwd with flamia::bwd as its backward. An autograd.Function that torch.compile
    traces (both directions are single ops), rather than the ops' own autograd registration:
    AOT autograd then places flamia::bwd in the compiled backward graph itself, without the
    registration's Python wrapper around every call."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, cu_seqlens_k, max_q, max_k, recipe, causal,
                softmax_scale, deterministic, check_content):
        out, lse, saved = fwd(q, k, v, cu_seqlens, cu_seqlens_k, max_q, max_k, recipe, causal,
                              softmax_scale, deterministic, check_content)
        if recipe == "bf16":
            saved = (q, k, v, *saved[3:])
        ctx.save_for_backward(out, lse, *saved)
        ctx.cu_seqlens = cu_seqlens   # (may be None: not a saved tensor then)
        ctx.cfg = (max(max_q, max_k), recipe, causal, softmax_scale, deterministic)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:          # nothing reached out (grads are not materialized)
            return (None,) * 12
        out, lse, *saved = ctx.saved_tensors
        max_seqlen, recipe, causal, softmax_scale, deterministic = ctx.cfg
        dq, dk, dv = bwd(dout.contiguous(), out, lse, list(saved), ctx.cu_seqlens, max_seqlen,
                         recipe, causal, softmax_scale, deterministic)
        return (dq, dk, dv) + (None,) * 9


def attention(q, k, v, cu_seqlens, max_seqlen_q, max_seqlen_k, recipe: str, causal: bool,
              softmax_scale: float, deterministic: bool, cu_seqlens_k=None,
              check_content: bool = False):
    """(out, lse) through the custom ops; differentiable in q, k, v."""
    if cu_seqlens_k is cu_seqlens:
        cu_seqlens_k = None
    return _OpAttention.apply(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              recipe, causal, softmax_scale, deterministic, check_content)
