"""Exact power-of-two scale arithmetic and the +-1 Hadamard matrix, shared by the quantize pass,
the K-major copies and the backward kernels (one definition each; this module imports nothing
from flamia.ops, so every kernel module can use it without an import cycle)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..quant import hadamard


@triton.jit
def pow2_scale_bits(amax, bad):
    """(scale, 1/scale) with scale = 2^ceil(log2(amax / 448)), exponent clamped to [-126, 127].

    Integer arithmetic on the quotient's bits gives the exact ceil(log2) that the reference's
    torch.log2/ceil computes (quant.pow2_scale). amax == 0 -> (0, 0); non-finite rows (bad) ->
    (NaN, 0).
    """
    ratio = tl.math.div_rn(amax, 448.0)
    bits = ratio.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 127)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)   # exact; e <= 120 for 16-bit inputs
    zero = amax == 0.0
    scale = tl.where(zero, 0.0, scale)
    inv = tl.where(zero | bad, 0.0, inv)
    scale = tl.where(bad, float("nan"), scale)
    return scale, inv


@triton.jit
def log2_pow2(s):
    """log2 of a power of two (or 0, NaN) from its exponent bits: exact, like torch.log2 of
    one; 0 -> -inf, NaN stays NaN (the pow2 scales are normal floats, 0 or NaN)."""
    e = ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    lg = tl.where(s > 0, e.to(tl.float32), float("-inf"))
    return tl.where(s == s, lg, s)


_HAD_CACHE: dict = {}


def hadamard_signs(D: int, dtype, device) -> torch.Tensor:
    """The Sylvester Hadamard matrix of size D with entries exactly +-1 (quant.hadamard times
    sqrt(D)), in `dtype` on `device`, memoized."""
    key = (D, dtype, str(device))
    if key not in _HAD_CACHE:
        signs = hadamard(D, torch.float64) * math.sqrt(D)          # exactly ±1
        _HAD_CACHE[key] = signs.round().to(dtype=dtype, device=device).contiguous()
    return _HAD_CACHE[key]
