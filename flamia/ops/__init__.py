"""The kernels. The contract between the public API (flamia/interface.py) and the kernels.

Numerics: exactly flamia/reference.py (the kernels match it by the FlashAttention rule,
|out - ref64| <= 2 |reference - ref64| + atol, and satisfy P1/P2 bitwise). Recipes with kernels:
bf16 and fp8 (token-block scaling, reference.py "Token-block scaling"). Tokens are packed (the dense
API reshapes (B, S, H, D) to (B*S, H, D) with cu_seqlens = [0, S, 2S, ...]). Entry points (config.py
says which kernel runs where):
  quantize.quantize_qkv(q, k, v, cu_seqlens, recipe, causal) -> layout.QuantizedQKV
  forward.attention_forward(qkv, cu_seqlens, max_seqlen, causal, softmax_scale, out_dtype)
      -> out (T, Hq, D), lse (Hq, T) fp32 (natural log) [, row_max (fp8's backward)]
  backward.attention_backward(dout, out, lse, qkv, cu_seqlens, max_seqlen, causal,
      softmax_scale, deterministic) -> (dq, dk, dv), rotated back to the input space
"""
from __future__ import annotations

import functools
import os

# Recipes the kernels implement; anything else runs on the reference (flamia/reference.py).
KERNEL_RECIPES = ("bf16", "fp8")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_available(x, recipe_name: str) -> bool:
    """True when a call on tensor x with this recipe should run the Triton kernels: on CUDA always
    (for KERNEL_RECIPES); on the CPU only under the Triton interpreter and when FLAMIA_KERNELS=1,
    which is how CI tests the real kernels without a GPU."""
    if recipe_name not in KERNEL_RECIPES:
        return False
    if os.environ.get("FLAMIA_KERNELS", "") == "0":
        return False
    if x.is_cuda:
        return True
    return interpreting() and os.environ.get("FLAMIA_KERNELS", "") == "1"


def is_sm90(device) -> bool:
    """Is `device` a CUDA device of compute capability 9.0 (Hopper, the Gluon kernels' target)?
    Memoized per device: the launchers ask at every call (host time at short documents)."""
    import torch
    dev = torch.device(device)
    return dev.type == "cuda" and _properties(dev.index)[0] == (9, 0)


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device, memoized per device."""
    import torch
    return _properties(torch.device(device).index)[1]


def device_name(device) -> str:
    """A CUDA device's name (e.g. "NVIDIA H200"), memoized per device."""
    import torch
    return _properties(torch.device(device).index)[2]


@functools.lru_cache(maxsize=None)
def _properties(index: int | None) -> tuple:
    """((major, minor), SM count, name) of a CUDA device (None: the current one)."""
    import torch
    p = torch.cuda.get_device_properties(index)
    return (p.major, p.minor), p.multi_processor_count, p.name
