"""Quantization primitives in plain PyTorch: the value-level definition of every format.

Everything here is exact emulation on float tensors (float32 or float64): a quantized tensor is
represented by its *values* (the numbers the tensor core multiplies) and its *scale*, both as
floats. Kernels must reproduce these numerics; tests compare them against these functions.

Conventions
- Scales are powers of two (or exactly zero for an all-zero block). A power-of-two scale makes
  quantize -> dequantize exact in bf16 and fp32, so a scale can be folded into another operand
  without any extra rounding, and the dequantized FP8 operand is exactly representable in bf16
  (the `fp8_mixed` recipe relies on that).
- A scale is chosen so that the block's absolute maximum lands at or below the format's largest
  finite value: nothing saturates, nothing overflows.
"""
from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FORMAT_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX, "e2m1": E2M1_MAX}


def pow2_scale(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= fmt_max; exactly 0 where amax == 0.

    The exponent is clamped to float32's normal range so the scale and its reciprocal are both
    representable. Non-finite amax propagates as NaN (callers validate inputs first).
    """
    amax = amax.float() if amax.dtype not in (torch.float32, torch.float64) else amax
    exp = torch.ceil(torch.log2(amax / fmt_max)).clamp(-126, 127)
    # log2 of a rounded quotient can be off by one near a power of two; fix it with exact
    # comparisons (fmt_max * 2^k is exact in floating point).
    exp = torch.where(amax > fmt_max * torch.exp2(exp), exp + 1, exp)
    exp = torch.where((exp > -126) & (amax <= fmt_max * torch.exp2(exp - 1)), exp - 1, exp)
    scale = torch.exp2(exp)
    scale = torch.where(amax > 0, scale, torch.zeros_like(scale))
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def safe_reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, with 0 for a zero scale (an all-zero block quantizes to zeros)."""
    return torch.where(scale > 0, 1.0 / scale.clamp_min(torch.finfo(scale.dtype).tiny), torch.zeros_like(scale))


def round_to_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round values already in range to the nearest representable value (ties to even).

    Values beyond the format's maximum saturate to it (the scales above make this unreachable
    for stored operands; it is the hardware's `satfinite` behaviour for in-kernel casts).
    """
    if fmt == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    if fmt == "fp16":
        return x.to(torch.float16).to(x.dtype)
    if fmt in FP8_DTYPES:
        fmax = FORMAT_MAX[fmt]
        # float64 -> fp8 would double-round through float32 only for values that are not
        # float32-representable; the cast below goes float64 -> float32 first, which is exact for
        # every product of two fp8 values and a power of two (what we ever quantize twice).
        xf = x.float().clamp(-fmax, fmax)
        return xf.to(FP8_DTYPES[fmt]).to(x.dtype)
    if fmt == "e2m1":
        return _round_e2m1(x)
    raise ValueError(f"unknown number format {fmt!r}")


# e2m1 (FP4) grid and the decision boundaries between neighbours. A value exactly on a boundary
# rounds to the neighbour with an even mantissa: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
# 3.5->4, 5->4. `bucketize(right=False)` sends a tie to the lower neighbour, so the boundaries whose
# tie goes up are nudged one ulp down.
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=x.dtype, device=x.device)
    up = torch.tensor(_E2M1_TIE_UP, device=x.device)
    bounds = torch.where(up, torch.nextafter(bounds, torch.zeros_like(bounds)), bounds)
    grid = torch.tensor(_E2M1_GRID, dtype=x.dtype, device=x.device)
    mag = x.abs().clamp(max=E2M1_MAX)
    idx = torch.bucketize(mag, bounds, right=False)
    return torch.sign(x) * grid[idx]


def quantize_lastdim(x: torch.Tensor, fmt: str, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dim with one power-of-two scale per `block` elements.

    block=None: one scale for the whole last dim (per token when the last dim is the head dim).
    Returns (values, scale) with scale broadcastable to values' shape after `expand_scale`.
    """
    fmax = FORMAT_MAX[fmt]
    if block is None:
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = pow2_scale(amax, fmax).to(x.dtype)
        values = round_to_format(x * safe_reciprocal(scale), fmt)
        return values, scale
    n = x.shape[-1]
    pad = (-n) % block
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    xb = xp.reshape(*xp.shape[:-1], -1, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    scale = pow2_scale(amax, fmax).to(x.dtype)
    values = round_to_format(xb * safe_reciprocal(scale), fmt)
    values = values.reshape(*xp.shape)[..., :n]
    scale = scale.expand_as(xb).reshape(*xp.shape)[..., :n]
    return values, scale


def quantize_nvfp4_lastdim(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 emulation along the last dim: e2m1 values, an e4m3 scale per 16 elements, and a
    float32 second-level scale. Returns the dequantized tensor.

    The second-level scale is per token (over the last dim), not per tensor: a tensor-wide scale
    is a function of every token, including future ones and other documents, so it would leak.
    """
    amax_tok = x.abs().amax(dim=-1, keepdim=True)
    # Map the token's largest block scale (amax/6) to the top of e4m3's range.
    global_scale = torch.where(amax_tok > 0, amax_tok / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax_tok))
    n = x.shape[-1]
    pad = (-n) % 16
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    xb = xp.reshape(*xp.shape[:-1], -1, 16)
    gb = global_scale.unsqueeze(-1)
    amax_blk = xb.abs().amax(dim=-1, keepdim=True)
    block_scale = round_to_format(amax_blk / E2M1_MAX / gb, "e4m3")
    eff = block_scale * gb
    values = round_to_format(xb * safe_reciprocal(eff), "e2m1")
    return (values * eff).reshape(*xp.shape)[..., :n]


def hadamard(n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of size n (a power of two): H @ H.T == I, H == H.T."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head dim, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)
