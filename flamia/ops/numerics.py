"""Exact power-of-two scale arithmetic, the +-1 Hadamard matrix and its in-register transform
(fwht), log2 e, shared by the quantize pass and the kernels (one definition each; importing only
flamia.ops' package and its interpreter shim, so no import cycle). Importing it under the Triton
interpreter installs flamia.ops.interpreter."""
from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from . import interpreting
from ..quant import hadamard

if interpreting():   # every kernel module imports this one: the GPU's float casts on the CPU
    from . import interpreter
    interpreter.install()

LOG2E = 1.4426950408889634

# 2^f for f in [-1/2, 1/2] by a cubic c0 + c1 f + c2 f^2 + c3 f^3 (fp32 coefficients of a minimax
# fit in relative error: 7.5e-5 in exact arithmetic, 1.1e-4 in fp32), for the kernels' exp2 on
# the FMA pipe (EXP2_FMA_PTX).
EXP2_CUBIC = (0.9999280571937561, 0.6932609677314758, 0.2426111251115799, 0.0551716648042202)
EXP2_SHIFT = 12582912.0      # 1.5 * 2^23: t + shift - shift = rint(t) for |t| < 2^22
EXP2_FLOOR = -126.0          # t is clamped here: j's exponent bits stay in range (the result
                             # below 2^-125 there, subnormal bits where p(f) < 1)


def _ptx_f32(x: float) -> str:
    """x as a PTX fp32 literal (0fXXXXXXXX, the bits of its fp32 rounding)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


# The body of an inline-asm exp2 on the FMA pipe: $OUT = 2^$IN in 8 instructions instead of one
# MUFU ex2 (8 cycles a warp on the MUFU pipe). t = max(x, -126) (max.NaN: a NaN stays NaN),
# j = rint(t) by the shift, f = t - j, p = the cubic at f by Horner FMAs, and 2^j added to p's
# exponent bits (tt's low bits hold j). Relative error 1.1e-4 (ex2.approx: 2^-22) from t = -125
# on; near and below -126 the result is below 2^-125 (a subnormal's bits where p(f) < 1, which
# FTZ arithmetic reads as 0). exp2_fma_host is the same arithmetic in torch.
EXP2_FMA_PTX = (
    "{{ .reg .f32 t, tt, j, f, p; .reg .b32 jb; "
    "max.NaN.f32 t, $IN, {floor}; "
    "add.rn.f32 tt, t, {shift}; sub.rn.f32 j, tt, {shift}; sub.rn.f32 f, t, j; "
    "fma.rn.f32 p, f, {c3}, {c2}; fma.rn.f32 p, p, f, {c1}; fma.rn.f32 p, p, f, {c0}; "
    "mov.b32 jb, tt; shl.b32 jb, jb, 23; mov.b32 $OUT, p; add.s32 $OUT, $OUT, jb; }}"
).format(floor=_ptx_f32(EXP2_FLOOR), shift=_ptx_f32(EXP2_SHIFT),
         **{f"c{k}": _ptx_f32(c) for k, c in enumerate(EXP2_CUBIC)})


def exp2_fma_host(x: torch.Tensor) -> torch.Tensor:
    """EXP2_FMA_PTX's arithmetic on fp32 tensors (each FMA as one rounding of the exact product
    and sum, through float64): the reference the tests hold the PTX constants to."""
    x = x.to(torch.float32)
    t = torch.maximum(x, torch.tensor(EXP2_FLOOR))
    tt = t + EXP2_SHIFT
    f = t - (tt - EXP2_SHIFT)
    c0, c1, c2, c3 = (torch.tensor(c, dtype=torch.float32).double() for c in EXP2_CUBIC)
    fd = f.double()
    p = (fd * c3 + c2).float().double()
    p = (p * fd + c1).float().double()
    p = (p * fd + c0).float()
    bits = p.view(torch.int32) + (tt.view(torch.int32) << 23)
    return bits.view(torch.float32)


@triton.jit
def pow2_scale_bits(amax, bad):
    """(scale, 1/scale) with scale = 2^ceil(log2(amax / 448)), exponent clamped to [-126, 127], by
    integer arithmetic on the quotient's bits (the exact ceil(log2) of quant.pow2_scale's
    torch.log2/ceil); amax == 0 -> (0, 0), non-finite rows (bad) -> (NaN, 0)."""
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


@triton.jit
def _butterfly(x, M: tl.constexpr, HI: tl.constexpr, LO: tl.constexpr):
    """One stage of fwht: columns c and c + LO of every 2 LO-column group -> (a + b, a - b)."""
    y = tl.permute(tl.reshape(x, (M, HI, 2, LO)), (0, 1, 3, 2))
    a, b = tl.split(y)
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(y, (M, HI * 2 * LO))


@triton.jit
def fwht(x, M: tl.constexpr, D: tl.constexpr):
    """x (M, D) fp32 @ H_D, H_D the +-1 Sylvester Hadamard matrix (hadamard_signs), D a power
    of two in [16, 256], by log2 D butterfly stages in registers: every product is exact, the
    sums are fp32 (each output a sum of D terms in a fixed tree order), no matrix to load."""
    return fwht_stages(x, M, D, D)


@triton.jit
def fwht_stages(x, M: tl.constexpr, D: tl.constexpr, LO_END: tl.constexpr):
    """fwht's first stages, those pairing columns c and c + LO for LO < LO_END (a power of two
    <= D): the rest of fwht where the columns c + LO sit in other lanes (quantize's Gluon q
    kernel, which finishes by shuffles). Also callable from Gluon kernels."""
    for k in tl.static_range(8):      # LO = 2^k: columns c and c + LO of each 2 LO group
        if (1 << k) < LO_END:
            x = _butterfly(x, M, D // (2 << k), 1 << k)
    return x


def sylvester_parity_host(i, j):
    """Parity of popcount(i & j) for 0 <= i, j < 256, so that the Sylvester Hadamard matrix is
    H[i, j] = 1 - 2 parity (hadamard_signs). Plain operators: the same function serves torch
    tensors and ints here and kernel tensors (backward_sm90 builds H with it)."""
    m = i & j
    m = m ^ (m >> 4)
    m = m ^ (m >> 2)
    m = m ^ (m >> 1)
    return m & 1


_HAD_CACHE: dict = {}


def hadamard_signs(D: int, dtype, device) -> torch.Tensor:
    """The Sylvester Hadamard matrix of size D with entries exactly +-1 (quant.hadamard times
    sqrt(D)), in `dtype` on `device`, memoized."""
    key = (D, dtype, str(device))
    if key not in _HAD_CACHE:
        signs = hadamard(D, torch.float64) * math.sqrt(D)          # exactly ±1
        _HAD_CACHE[key] = signs.round().to(dtype=dtype, device=device).contiguous()
    return _HAD_CACHE[key]
