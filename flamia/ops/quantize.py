"""Quantize q, k, v once for every GEMM of forward and backward (ops/__init__.py has the layout).

One launch reads q, k and v once and writes, per (token, head):
  q8, k8 = e4m3(rotate(x) / s),  v8 = e4m3(v / s),  s = 2^ceil(log2(amax / 448))  (0 if amax == 0)
and, for V, a K-major copy vt8 (Hkv, D, T_pad) made from v8's bytes by flamia.ops.kmajor
(Hopper's FP8 wgmma takes its B operand K-major only, and the forward's PV GEMM reduces over
tokens). A third tiny launch turns V's scales into vcap, the causal prefix max of sv inside each
document (reference.py, point 3).

Numerics follow flamia.reference exactly: the rotation is (x @ sign(H)) * (1/sqrt(D)) with x in
its own 16-bit dtype and the ±1 Hadamard signs, so every product is exact and only the fp32
summation order differs from the reference's fp32 `x @ H` (an fp32 ulp, which changes an e4m3
value only when it sits on a rounding boundary: a few in a million). Scales are computed with
integer exponent arithmetic on the IEEE quotient amax / 448, which is what quant.pow2_scale
computes with log2/ceil. Non-finite tokens get scale NaN and values x * 0 (NaN where x is not
finite), as the reference's safe_reciprocal gives.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import config, interpreting
from .kmajor import check_copy, copy_columns
from .layout import QuantizedQKV
from ..quant import hadamard
from ..recipes import Recipe, get_recipe

if interpreting():
    from . import interpreter
    interpreter.install()

E4M3_MAX = 448.0
T_ALIGN = 16          # vt8's token stride is a multiple of 16 bytes (TMA descriptor rule)


@triton.jit
def _pow2_scale(amax, bad):
    """(scale, 1/scale) with scale = 2^ceil(log2(amax / 448)), exponent clamped to [-126, 127].

    Integer arithmetic on the quotient's bits gives the exact ceil(log2) that the reference's
    torch.log2/ceil computes. amax == 0 -> (0, 0); non-finite rows (bad) -> (NaN, 0).
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
def _quantize_rows(X, stride_xt, Y, stride_yt, S, HAD, rot_scale, T, t_base,
                   D: tl.constexpr, BLOCK_T: tl.constexpr, SUB: tl.constexpr,
                   ROTATE: tl.constexpr):
    """SUB consecutive blocks of BLOCK_T tokens of one head: (rotate), scale, cast, store."""
    offs_d = tl.arange(0, D)
    if ROTATE:
        # Loaded once per program and reused for SUB token blocks (it is D*D*2 bytes of L2 traffic).
        had = tl.load(HAD + offs_d[:, None] * D + offs_d[None, :])
    for i in tl.static_range(SUB):
        offs_t = t_base + i * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = offs_t < T
        rows = offs_t.to(tl.int64)
        x = tl.load(X + rows[:, None] * stride_xt + offs_d[None, :], mask=tmask[:, None], other=0.0)
        if ROTATE:
            xf = tl.dot(x, had) * rot_scale      # ±1 entries: exact products, fp32 sums
        else:
            xf = x.to(tl.float32)
        ax = tl.abs(xf)
        amax = tl.max(ax, axis=1)
        # NaN/Inf anywhere in the row (a NaN comparison is false); tl.max may drop NaNs.
        bad = tl.min((ax < float("inf")).to(tl.int32), axis=1) == 0
        scale, inv = _pow2_scale(amax, bad)
        y = (xf * inv[:, None]).to(tl.float8e4nv)    # RNE, satfinite on sm_90
        tl.store(Y + rows[:, None] * stride_yt + offs_d[None, :], y, mask=tmask[:, None])
        tl.store(S + offs_t, scale, mask=tmask)


@triton.jit
def _quantize_qkv_kernel(Q, K, V, Q8, K8, V8, SQ, SK, SV, HAD,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         T, HQ, HKV, rot_scale,
                         D: tl.constexpr, BLOCK_T: tl.constexpr, SUB: tl.constexpr,
                         ROTATE: tl.constexpr):
    # Axis 0 walks the heads of one token chunk, so programs in flight read neighbouring memory.
    row = tl.program_id(0)
    t_base = tl.program_id(1) * (BLOCK_T * SUB)
    if row < HQ:
        _quantize_rows(Q + row * stride_qh, stride_qt, Q8 + row * D, HQ * D, SQ + row * T,
                       HAD, rot_scale, T, t_base, D, BLOCK_T, SUB, ROTATE)
    elif row < HQ + HKV:
        h = row - HQ
        _quantize_rows(K + h * stride_kh, stride_kt, K8 + h * D, HKV * D, SK + h * T,
                       HAD, rot_scale, T, t_base, D, BLOCK_T, SUB, ROTATE)
    else:
        h = row - HQ - HKV
        _quantize_rows(V + h * stride_vh, stride_vt, V8 + h * D, HKV * D, SV + h * T,
                       HAD, rot_scale, T, t_base, D, BLOCK_T, SUB, False)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _vt_vcap_kernel(V8, VT8, SV, VCAP, CU, T, Tp, stride_t, HKV, N_COL_BLOCKS, N_DOCS,
                    D: tl.constexpr, BLOCK_C: tl.constexpr, MMA_ORDER: tl.constexpr,
                    CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """The forward's two passes after quantization in one launch (one launch less per call:
    host time at short documents): grid axis 1 < HKV copies v8 into the K-major vt8 (plain
    layout, kmajor.copy_columns), the rest computes vcap (_vcap_doc); axis 0 is the column
    block of a copy program and the document of a vcap program."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    if j < HKV:
        if i < N_COL_BLOCKS:
            copy_columns(V8, VT8, VT8, T, Tp, stride_t, j, D, BLOCK_C, True, MMA_ORDER)
    elif i < N_DOCS:
        _vcap_doc(SV, VCAP, CU, T, i, j - HKV, CAUSAL, BLOCK)


@triton.jit
def _vcap_doc(SV, VCAP, CU, T, doc, h, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.load(CU + doc)
    end = tl.load(CU + doc + 1)
    src = SV + h.to(tl.int64) * T
    dst = VCAP + h.to(tl.int64) * T
    carry = tl.max(tl.zeros([BLOCK], tl.float32), axis=0)      # scales are >= 0
    if CAUSAL:
        for t0 in range(start, end, BLOCK):
            offs = t0 + tl.arange(0, BLOCK)
            m = offs < end
            s = tl.load(src + offs, mask=m, other=0.0)
            c = tl.maximum(tl.associative_scan(s, 0, _max_combine), carry)
            tl.store(dst + offs, c, mask=m)
            carry = tl.maximum(carry, tl.max(s, axis=0))
    else:
        for t0 in range(start, end, BLOCK):
            offs = t0 + tl.arange(0, BLOCK)
            s = tl.load(src + offs, mask=offs < end, other=0.0)
            carry = tl.maximum(carry, tl.max(s, axis=0))
        for t0 in range(start, end, BLOCK):
            offs = t0 + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.zeros([BLOCK], tl.float32) + carry, mask=offs < end)


_HAD_CACHE: dict = {}


def _hadamard_signs(D: int, dtype, device) -> torch.Tensor:
    key = (D, dtype, str(device))
    if key not in _HAD_CACHE:
        signs = hadamard(D, torch.float64) * math.sqrt(D)          # exactly ±1
        _HAD_CACHE[key] = signs.round().to(dtype=dtype, device=device).contiguous()
    return _HAD_CACHE[key]


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) with unit stride over D (a copy only when that is not already so)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def quantize_qkv(q, k, v, cu_seqlens, recipe, causal, *, vt_mma_order: bool | None = None,
                 block_t: int | None = None, sub: int | None = None, num_warps: int = 4,
                 poison: bool = False) -> QuantizedQKV:
    """Quantize packed q (T, Hq, D), k, v (T, Hkv, D) as `recipe` says -> QuantizedQKV.

    fp8 / fp8_mixed: rotated, per-(token, head) e4m3 values and fp32 power-of-two scales, vt8
    and vcap. vt8's columns are in wgmma key order within 16-token groups (flamia.ops.kmajor)
    or in token order (vt_mma_order=False); None: the order of the forward kernel this device
    runs (config.vt_mma_order). bf16: the inputs themselves (bf16; fp16 inputs are rounded to
    bf16 as the reference does), no scales. block_t / sub / num_warps: launch tiling (tokens per
    block, blocks per program; the values do not depend on them). poison=True fills outputs
    with NaN first (tests: every element written).
    """
    rec: Recipe = get_recipe(recipe)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if rec.name == "bf16":
        q8, k8, v8 = (x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16) for x in (q, k, v))
        return QuantizedQKV("bf16", q8, k8, v8, None, None, None, None, rotated=False, vt8=None)
    if rec.name not in ("fp8", "fp8_mixed"):
        raise ValueError(f"quantize_qkv implements fp8, fp8_mixed and bf16, not {rec.name!r}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"q, k, v must be bf16 or fp16, got {q.dtype}")
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"head dim {D} not supported by the quantize kernel")
    q, k, v = _rows_view(q), _rows_view(k), _rows_view(v)
    dev = q.device
    if vt_mma_order is None:
        vt_mma_order = config.vt_mma_order(D, rec.name, dev)
    fill = (lambda shape, dt: torch.full(shape, float("nan"), dtype=dt, device=dev)) if poison else \
        (lambda shape, dt: torch.empty(shape, dtype=dt, device=dev))
    f8 = torch.float8_e4m3fn
    q8, k8, v8 = fill((T, Hq, D), f8), fill((T, Hkv, D), f8), fill((T, Hkv, D), f8)
    sq, sk, sv = fill((Hq, T), torch.float32), fill((Hkv, T), torch.float32), fill((Hkv, T), torch.float32)
    vcap = fill((Hkv, T), torch.float32)
    t_pad = triton.cdiv(max(T, 1), T_ALIGN) * T_ALIGN
    vt8 = fill((Hkv, D, t_pad), f8)    # the copy writes every column (zeros past T)
    if T == 0:
        return QuantizedQKV(rec.name, q8, k8, v8, sq, sk, sv, vcap, rotated=rec.rotate_qk, vt8=vt8,
                            vt8_mma_order=vt_mma_order)
    rotate = bool(rec.rotate_qk)
    had = _hadamard_signs(D, q.dtype, dev) if rotate else q   # placeholder pointer when unused
    if block_t is None:
        block_t = 32 if interpreting() else 64
    if sub is None:
        sub = 1 if interpreting() else 4
    tokens_per_prog = block_t * sub
    grid = (Hq + 2 * Hkv, triton.cdiv(T, tokens_per_prog))
    _quantize_qkv_kernel[grid](
        q, k, v, q8, k8, v8, sq, sk, sv, had,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        T, Hq, Hkv, 1.0 / math.sqrt(D),
        D=D, BLOCK_T=block_t, SUB=sub, ROTATE=rotate, num_warps=num_warps)
    # The K-major V copy, from the bytes just stored (an in-kernel transposed store of freshly
    # converted fp8 values is miscompiled by Triton 3.6 on sm_90; see flamia.ops.kmajor), with
    # vcap in the same launch
    _vt_and_vcap(v8, vt8, sv, vcap, cu_seqlens, causal, vt_mma_order)
    return QuantizedQKV(rec.name, q8, k8, v8, sq, sk, sv, vcap, rotated=rotate, vt8=vt8,
                        vt8_mma_order=vt_mma_order)


def _vt_and_vcap(v8, vt8, sv, vcap, cu_seqlens, causal: bool, mma_order: bool,
                 block_c: int = 64) -> None:
    """vt8 = kmajor_copy(v8, mma_order=mma_order) and vcap = the causal (or whole-document)
    prefix max of sv inside each document, in one launch."""
    check_copy(v8, vt8, mma_order)
    T, Hkv, D = v8.shape
    Tp = vt8.shape[2]
    n_docs = cu_seqlens.numel() - 1
    n_cols = triton.cdiv(Tp, block_c)
    if Hkv == 0 or max(n_cols, n_docs) == 0:
        return
    _vt_vcap_kernel[(max(n_cols, n_docs), 2 * Hkv)](
        v8.view(torch.uint8), vt8.view(torch.uint8), sv, vcap, cu_seqlens, T, Tp, v8.stride(0),
        Hkv, n_cols, n_docs, D=D, BLOCK_C=block_c, MMA_ORDER=bool(mma_order),
        CAUSAL=bool(causal), BLOCK=_vcap_block(), num_warps=4)


def _vcap_block() -> int:
    """Tokens per step of vcap's scan (_vcap_doc)."""
    return 64 if interpreting() else 1024

