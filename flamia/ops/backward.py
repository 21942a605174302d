"""The split backward: dQ, dK, dV from the forward's quantized operands and LSE.

Numerics: `flamia.reference.backward` (module docstring, point 4), recipes fp8, fp8_mixed, bf16.
attention_backward runs, per config.backward_config, the one-pass Hopper kernel (backward_sm90:
the bf16 and fp8_block recipes on sm_90), fp8_block's reference backward elsewhere, or the three
launches here (fp8, fp8_mixed; bf16 off sm_90), deterministic by
construction (no atomics), so `deterministic=True` costs nothing. On sm_90 the dK/dV and dQ
launches of the fp8 recipes are backward_gluon's Gluon kernels; elsewhere (other GPUs, the CPU
interpreter, fp16 inputs of the bf16 recipe) the Triton kernels below:

1. `_bwd_preprocess`, one pass over dO and O, grid (token blocks, Hq):
   - dO quantized per (token, head) to e4m3 with a power-of-two scale: do8 (T, Hq, D) and
     sdo (Hq, T). Not for bf16.
   - Delta_i = rowsum(dO_used_i * O_i) with the dO the dP GEMM uses: the dequantized e4m3 dO for
     fp8, bf16 dO for fp8_mixed / bf16 (reference.backward explains why this choice matters).
     For fp8 it is stored in units of sdo_i (rowsum(do8_i * O_i), exactly Delta_i / sdo_i).
   Then `flamia.ops.kmajor.kmajor_copy` makes the K-major copies (Hopper fp8 wgmma takes only
   K-major operands): doT8 (Hq, D, Tp) for dV = P^T dO, and for fp8 qT8 (Hq, D, Tp) and kT8
   (Hkv, D, Tp) for dK = dS^T Q and dQ = dS K (transposed bytes of do8 and of the forward's
   q8 / k8, nothing re-quantized), in a padded token layout: document d starts at column pcu[d]
   = sum_{e<d} ceil16(len_e), pad columns are zero, so TMA (16-byte aligned token coordinates)
   can read every tile of every document whatever cu_seqlens is.
2. `_bwd_dkdv`, FA2 style, one program per (document, kv head, kv block j); it loops over the
   query heads of its GQA group and over the query blocks i >= j of its document (only tiles
   inside the causal triangle are visited; only the diagonal blocks are masked).
   Per tile (fp8): S^T = K_j Q_i^T with the scales folded, P^T = exp2(S^T - lse_i),
       A    = P^T sdo_i
       dV_j += c_j e4m3(A / c_j) @ do8_i                    c_j: power of two over the tile's row j
       t    = (v8_j do8_i^T) sv_j - Delta_i / sdo_i         (dS^T = A t exactly)
       dK_j += c'_j e4m3(A t sq_i / c'_j) @ q8_i
   fp8_mixed: dP and dK in bf16 (bf16 dO; V's and Q's e4m3 values are exact in bf16 and their
   power-of-two scales move outside the GEMM). bf16: the same with bf16 operands.
   The per-row scale of an in-kernel operand is taken over the tile (a subset of the
   reference's whole row): leak-free for the same reason (exact zeros never move a maximum), and
   e4m3 rounding is scale-invariant except in the subnormal range, so the kernel matches the
   reference to ~1e-6 relative (by the FlashAttention rule in the tests, not bitwise).
   Each tile's fp8 GEMM result is scaled and added to the accumulator in fp32 by the CUDA
   cores, not accumulated in place by the tensor core: Hopper's FP8 wgmma keeps fewer
   accumulator bits than fp32, and chaining it over a long document's query blocks cost up to
   1.5e-2 (max, relative) in dV at 32k tokens on the H200 (benchmarks/NOTES.md).
   BwdConfig.split_dkdv: dK and dV from two launches of the same kernel (DO_DK / DO_DV), each
   recomputing S^T and holding one accumulator (the fp8_mixed default at D=128).
3. `_bwd_dq`, one program per (document, query head, query block i), loop over kv blocks
   j <= i: recomputes S and dP; dQ_i += c_i e4m3(P t sk_j / c_i) @ k8_j, and sdo_i (constant
   along the row) is applied once in the epilogue.
Epilogues multiply by softmax_scale, rotate dQ and dK back from the Hadamard space (tl.dot with
the +-1 Sylvester matrix on a hi/lo bf16 split of the fp32 value, then 1/sqrt(D)), and cast to
the caller's dtype.

Tiles are aligned to document starts (cu_seqlens): no tile ever reads another document's
tokens (P2 by construction); rows past a document's end load lse = +inf so their P is exactly 0.

Under the Triton interpreter (CPU tests) two things differ from the GPU and are handled here:
float casts go through flamia.ops.interpreter (torch rounding, as the hardware does), and bf16
tl.dot (the interpreter multiplies bf16 as raw uint16) runs on bf16-valued fp32 operands.

Memory beyond what the forward saved: do8 + doT8 (2 bytes per element of dO), qT8 + kT8 (fp8
only), sdo and Delta (Hq, T) fp32. No fp32 dQ accumulator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import interpreting
from .config import (RECIPE_IDS, BwdConfig, GluonDkdvConfig, GluonDqConfig, MixedDkdvConfig,
                     MixedDqConfig, ReferenceBwdConfig, backward_config, split_backward_config,
                     uses_gluon_backward)
from .kmajor import kmajor_copies, kmajor_copies_and_rows, kmajor_layout, padded_columns
from .layout import QuantizedQKV, reference_saved
from .schedule import per_cu_seqlens

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:   # pragma: no cover - older triton
    TensorDescriptor = None

if interpreting():
    from . import interpreter
    interpreter.install()

# the kernels' RECIPE constexpr by name (constexpr globals: the jit code reads them)
FP8, FP8_MIXED, BF16 = (tl.constexpr(RECIPE_IDS[r]) for r in ("fp8", "fp8_mixed", "bf16"))
LOG2E = 1.4426950408889634

# Test hook: fill every buffer this module allocates with NaN before the kernels run, so a test
# can check that every element it reads back was written.
POISON = False


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------

@triton.jit
def _pow2_scale(amax, FMT_EXP: tl.constexpr):
    """(scale, 1/scale): the smallest power of two s with amax / s <= 1.75 * 2^FMT_EXP
    (448 = e4m3's max for FMT_EXP=8), clamped to 2^-126; 0 for amax == 0; NaN for Inf/NaN.

    Exact integer arithmetic on the float's bits: amax = m 2^e with m in [1, 2) gives
    ceil(log2(amax / (1.75 2^F))) = e - F + (m > 1.75). Same as quant.pow2_scale.
    """
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e_new = e - FMT_EXP + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e_new = tl.minimum(tl.maximum(e_new, 1), 254)
    scale = (e_new << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e_new) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(amax > 0, scale, 0.0)
    inv = tl.where(amax > 0, inv, 0.0)
    bad = amax != amax
    bad = bad | (amax == float("inf"))
    scale = tl.where(bad, float("nan"), scale)
    inv = tl.where(bad, float("nan"), inv)
    return scale, inv


@triton.jit
def _pow2_scale_div(amax):
    """As _pow2_scale for e4m3, but from the IEEE quotient amax / 448 like quant.pow2_scale
    (ceil(log2(fl(amax / 448)))): bitwise the reference's scale for the stored dO, also where
    the quotient rounds down onto a power of two (the value then saturates at 448 there too)."""
    ratio = tl.math.div_rn(amax, 448.0)
    bits = ratio.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 126)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(amax > 0, scale, 0.0)
    inv = tl.where(amax > 0, inv, 0.0)
    bad = amax != amax
    bad = bad | (amax == float("inf"))
    scale = tl.where(bad, float("nan"), scale)
    inv = tl.where(bad, float("nan"), inv)
    return scale, inv


@triton.jit
def _bf16_op(x, INTERP: tl.constexpr):
    """An operand of a bf16 GEMM (rounded to nearest even). In the interpreter, bf16-valued fp32
    (its tl.dot would multiply bf16's raw uint16 storage)."""
    if INTERP:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _mm(a, b, INTERP: tl.constexpr):
    """fp32-accumulating tile GEMM of two e4m3 or two _bf16_op operands."""
    if INTERP:
        return tl.dot(a, b, out_dtype=tl.float32, input_precision="ieee")
    else:
        return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def _rotate(x, hmat, D: tl.constexpr, INTERP: tl.constexpr):
    """x (M, D) fp32 @ H, H the +-1 Sylvester matrix in bf16 (exact): two bf16 GEMMs on the
    split x = hi + lo (hi = bf16(x), lo = bf16(x - hi)), relative error <= 2^-17."""
    offs_d = tl.arange(0, D)
    h = _bf16_op(tl.load(hmat + offs_d[:, None] * D + offs_d[None, :]), INTERP)
    hi = _bf16_op(x, INTERP)
    lo = _bf16_op(x - hi.to(tl.float32), INTERP)
    return _mm(hi, h, INTERP) + _mm(lo, h, INTERP)


@triton.jit
def _kmajor_tile(src, row0, tok0, mask_tok, END: tl.constexpr):
    """(BLK, D) tile of a K-major copy xT8 (heads, D, Tp): tokens tok0 + [0, BLK) (a column of
    the padded layout: pcu[doc] + block offset, a multiple of 16) of the head whose D rows
    start at row0 = head * D, by TMA (`src` a descriptor over xT8 seen as (heads * D, Tp) with
    block (D, BLK)): the tile lands in shared memory K-major and feeds the fp8 wgmma directly.
    END tiles (the ones that may reach past the document's end) are masked in registers: those
    tokens belong to the next document, never let a NaN in."""
    x = src.load([row0, tok0]).T
    if END:
        x = tl.where(mask_tok[:, None], x, 0.0)
    return x


# ----------------------------------------------------------------------------------------------
# 1. Preprocess: dO quantization, Delta, K-major copies
# ----------------------------------------------------------------------------------------------

@triton.jit
def _bwd_preprocess(
    dout, out, do8, sdo, delta, T, stride_dot, stride_ot,
    HQ: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, RECIPE: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    mask_t = offs_t < T
    m2 = mask_t[:, None]
    do = tl.load(dout + offs_t[:, None] * stride_dot + h * D + offs_d[None, :], mask=m2, other=0.0)
    do = do.to(tl.float32)
    o = tl.load(out + offs_t[:, None] * stride_ot + h * D + offs_d[None, :], mask=m2, other=0.0)
    o = o.to(tl.float32)
    if RECIPE != BF16:
        amax = tl.max(tl.abs(do), axis=1)
        s, inv = _pow2_scale_div(amax)
        d8 = (do * inv[:, None]).to(tl.float8e4nv)
        tl.store(do8 + offs_t[:, None] * (HQ * D) + h * D + offs_d[None, :], d8, mask=m2)
        tl.store(sdo + h * T + offs_t, s, mask=mask_t)
        if RECIPE == FP8:
            # Delta in units of sdo: rowsum(do8 * O) = rowsum(dO_used * O) / sdo exactly
            # (sdo is a power of two); the kernels fold sdo into P / the dQ epilogue.
            do_used = d8.to(tl.float32)
        else:
            do_used = do.to(tl.bfloat16).to(tl.float32)
    else:
        do_used = do.to(tl.bfloat16).to(tl.float32)
    tl.store(delta + h * T + offs_t, tl.sum(do_used * o, axis=1), mask=mask_t)


# ----------------------------------------------------------------------------------------------
# 2. dK, dV
# ----------------------------------------------------------------------------------------------

@triton.jit
def _dkdv_tile(
    acc_dk, acc_dv, k, v, rowf, sv_j, offs_n,
    q8, qT8, dout, do8, doT8, sq, sdo, lse, delta,
    h, start, pstart, L, i0, T, stride_qt, stride_dot,
    HQ: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
    RECIPE: tl.constexpr, MASK: tl.constexpr, INTERP: tl.constexpr,
    END: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr,
):
    offs_m = i0 + tl.arange(0, BM)             # document-relative query positions
    offs_d = tl.arange(0, D)
    mask_m = offs_m < L
    tok_m = start + offs_m
    m2 = mask_m[:, None]
    q = tl.load(q8 + tok_m[:, None] * stride_qt + h * D + offs_d[None, :], mask=m2, other=0.0)
    lse2 = tl.load(lse + h * T + tok_m, mask=mask_m, other=float("inf")) * 1.4426950408889634
    di = tl.load(delta + h * T + tok_m, mask=mask_m, other=0.0)

    # S^T (BN, BM) in log2 units, P^T = exp2(S^T - lse_i)
    if RECIPE == BF16:
        q = _bf16_op(q, INTERP)
        p_t = tl.math.exp2(_mm(k, tl.trans(q), INTERP) * rowf - lse2[None, :])
    else:
        sq_i = tl.load(sq + h * T + tok_m, mask=mask_m, other=0.0)
        s_t = _mm(k, tl.trans(q), INTERP) * rowf[:, None]
        p_t = tl.math.exp2(s_t * sq_i[None, :] - lse2[None, :])
    if MASK:
        p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)

    if RECIPE == BF16:
        do_b = _bf16_op(tl.load(dout + tok_m[:, None] * stride_dot + h * D + offs_d[None, :],
                                mask=m2, other=0.0), INTERP)
        if DO_DV:
            acc_dv += _mm(_bf16_op(p_t, INTERP), do_b, INTERP)       # dV_j += bf16(P^T) dO_i
        if DO_DK:
            ds_t = p_t * (_mm(v, tl.trans(do_b), INTERP) - di[None, :])
            acc_dk += _mm(_bf16_op(ds_t, INTERP), q, INTERP)         # dK_j += bf16(dS^T) Q_i
    else:
        sdo_i = tl.load(sdo + h * T + tok_m, mask=mask_m, other=0.0)
        a = p_t * sdo_i[None, :]
        if DO_DV:
            # dV_j += c_j * e4m3(P^T sdo_i / c_j) @ do8_i  (c_j: power of two over the tile's row j)
            c, inv = _pow2_scale(tl.max(tl.abs(a), axis=1), 8)
            doT = _kmajor_tile(doT8, h * D, pstart + i0, mask_m, END)
            acc_dv += _mm((a * inv[:, None]).to(tl.float8e4nv), doT, INTERP) * c[:, None]
        if DO_DK:
            if RECIPE == FP8:
                # dP^T = (v8 do8^T) sv_j sdo_i; Delta is stored in units of sdo_i, so
                # dS^T = P^T (dP^T - Delta) = (P^T sdo_i) (dot sv_j - Delta / sdo_i)   exactly.
                do_q = tl.load(do8 + tok_m[:, None] * (HQ * D) + h * D + offs_d[None, :], mask=m2,
                               other=0.0)
                t = _mm(v, tl.trans(do_q), INTERP) * sv_j[:, None] - di[None, :]
                b = a * t * sq_i[None, :]                              # dS^T * sq_i
                c2, inv2 = _pow2_scale(tl.max(tl.abs(b), axis=1), 8)
                qT = _kmajor_tile(qT8, h * D, pstart + i0, mask_m, END)
                acc_dk += _mm((b * inv2[:, None]).to(tl.float8e4nv), qT, INTERP) * c2[:, None]
            else:
                # dP in bf16 from bf16 dO and V's e4m3 values (exact in bf16), V's scale outside
                do_b = _bf16_op(tl.load(dout + tok_m[:, None] * stride_dot + h * D
                                        + offs_d[None, :], mask=m2, other=0.0), INTERP)
                ds_t = p_t * (_mm(v, tl.trans(do_b), INTERP) * sv_j[:, None] - di[None, :])
                # bf16(dS) * sq_i == bf16(dS * sq_i) (power of two); Q's e4m3 values exact in bf16
                acc_dk += _mm(_bf16_op(ds_t * sq_i[None, :], INTERP), _bf16_op(q, INTERP), INTERP)
    return acc_dk, acc_dv


@triton.jit
def _bwd_dkdv(
    q8, k8, v8, qT8, dout, do8, doT8, sq, sk, sv, sdo, lse, delta, dk, dv, hmat, cu, pcu,
    T, stride_qt, stride_kt, stride_dot, stride_dkt,
    sm_scale, qk_scale2, out_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    RECIPE: tl.constexpr, CAUSAL: tl.constexpr, ROTATE: tl.constexpr,
    INTERP: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr,
):
    GROUP: tl.constexpr = HQ // HKV
    pid = tl.program_id(0)
    jb = tl.program_id(1)
    doc = pid // HKV
    hk = pid % HKV
    start = tl.load(cu + doc)
    L = tl.load(cu + doc + 1) - start
    pstart = tl.load(pcu + doc)    # the document's first column in the K-major copies (16 | it)
    n0 = jb * BN
    if n0 >= L:
        return
    offs_n = n0 + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    mask_n = offs_n < L
    tok_n = start + offs_n
    n2 = mask_n[:, None]
    k = tl.load(k8 + tok_n[:, None] * stride_kt + hk * D + offs_d[None, :], mask=n2, other=0.0)
    v = tl.load(v8 + tok_n[:, None] * stride_kt + hk * D + offs_d[None, :], mask=n2, other=0.0)
    if RECIPE == BF16:
        k = _bf16_op(k, INTERP)
        v = _bf16_op(v, INTERP)
        rowf = qk_scale2
        sv_j = qk_scale2   # unused
    else:
        sk_j = tl.load(sk + hk * T + tok_n, mask=mask_n, other=0.0)
        rowf = sk_j * qk_scale2
        sv_j = tl.load(sv + hk * T + tok_n, mask=mask_n, other=0.0)
        if RECIPE == FP8_MIXED:
            v = _bf16_op(v, INTERP)   # dP in bf16: V's e4m3 values are exact in bf16
    acc_dk = tl.zeros([BN, D], dtype=tl.float32)
    acc_dv = tl.zeros([BN, D], dtype=tl.float32)
    if CAUSAL:
        diag_end = tl.minimum(n0 + BN, L)
        lo = n0
    else:
        diag_end = 0
        lo = 0
    full_end = (L // BM) * BM
    tail_lo = tl.maximum(diag_end, full_end)
    for g in range(GROUP):
        h = hk * GROUP + g
        # query blocks i0 (multiples of BM from the document start) in three runs: 0 the
        # diagonal blocks (causal MASK), 1 the full blocks strictly below the diagonal, 2 the
        # block that reaches past the document's end (END: its K-major tiles are masked)
        for run in tl.static_range(3):
            if run == 0:
                i_lo, i_hi = lo, diag_end
            elif run == 1:
                i_lo, i_hi = diag_end, full_end
            else:
                i_lo, i_hi = tail_lo, L
            for i0 in range(i_lo, i_hi, BM):
                acc_dk, acc_dv = _dkdv_tile(
                    acc_dk, acc_dv, k, v, rowf, sv_j, offs_n, q8, qT8, dout, do8, doT8, sq, sdo,
                    lse, delta, h, start, pstart, L, i0, T, stride_qt, stride_dot,
                    HQ, D, BM, RECIPE, run == 0, INTERP, run != 1, DO_DK, DO_DV)
    ptr = tok_n[:, None] * stride_dkt + hk * D + offs_d[None, :]
    if DO_DK:
        acc_dk = acc_dk * sm_scale
        if ROTATE:
            acc_dk = _rotate(acc_dk, hmat, D, INTERP) * out_scale
        tl.store(dk + ptr, acc_dk.to(dk.dtype.element_ty), mask=n2)
    if DO_DV:
        tl.store(dv + ptr, acc_dv.to(dv.dtype.element_ty), mask=n2)


# ----------------------------------------------------------------------------------------------
# 3. dQ
# ----------------------------------------------------------------------------------------------

@triton.jit
def _dq_tile(
    acc, q, do_i, rowf, lse2, di, offs_m,
    k8, v8, kT8, sk, sv, hk, start, pstart, L, j0, T, stride_kt,
    D: tl.constexpr, BN: tl.constexpr, RECIPE: tl.constexpr, MASK: tl.constexpr,
    CAUSAL: tl.constexpr, INTERP: tl.constexpr,
):
    offs_n = j0 + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    mask_n = offs_n < L
    tok_n = start + offs_n
    n2 = mask_n[:, None]
    k = tl.load(k8 + tok_n[:, None] * stride_kt + hk * D + offs_d[None, :], mask=n2, other=0.0)
    v = tl.load(v8 + tok_n[:, None] * stride_kt + hk * D + offs_d[None, :], mask=n2, other=0.0)
    if RECIPE == BF16:
        k = _bf16_op(k, INTERP)
        p = tl.math.exp2(_mm(q, tl.trans(k), INTERP) * rowf - lse2[:, None])
    else:
        sk_j = tl.load(sk + hk * T + tok_n, mask=mask_n, other=0.0)
        s = _mm(q, tl.trans(k), INTERP) * sk_j[None, :]
        p = tl.math.exp2(s * rowf[:, None] - lse2[:, None])
    if MASK:
        if CAUSAL:
            p = tl.where((offs_n[None, :] <= offs_m[:, None]) & mask_n[None, :], p, 0.0)
        else:
            p = tl.where(mask_n[None, :], p, 0.0)
    if RECIPE == FP8:
        # dS sk_j / sdo_i = P (dot sv_j - Delta/sdo_i) sk_j: sdo_i, a power of two constant along
        # the row, moves out of the row's quantization scale into the epilogue (exact).
        sv_j = tl.load(sv + hk * T + tok_n, mask=mask_n, other=0.0)
        t = _mm(do_i, tl.trans(v), INTERP) * sv_j[None, :] - di[:, None]
        b = p * t * sk_j[None, :]
        c, inv = _pow2_scale(tl.max(tl.abs(b), axis=1), 8)
        kT = _kmajor_tile(kT8, hk * D, pstart + j0, mask_n, MASK)
        acc += _mm((b * inv[:, None]).to(tl.float8e4nv), kT, INTERP) * c[:, None]
    elif RECIPE == FP8_MIXED:
        sv_j = tl.load(sv + hk * T + tok_n, mask=mask_n, other=0.0)
        ds = p * (_mm(do_i, tl.trans(_bf16_op(v, INTERP)), INTERP) * sv_j[None, :] - di[:, None])
        acc += _mm(_bf16_op(ds * sk_j[None, :], INTERP), _bf16_op(k, INTERP), INTERP)
    else:
        ds = p * (_mm(do_i, tl.trans(_bf16_op(v, INTERP)), INTERP) - di[:, None])
        acc += _mm(_bf16_op(ds, INTERP), k, INTERP)
    return acc


@triton.jit
def _bwd_dq(
    q8, k8, v8, kT8, dout, do8, sq, sk, sv, sdo, lse, delta, dq, hmat, cu, pcu,
    T, stride_qt, stride_kt, stride_dot, stride_dqt,
    sm_scale, qk_scale2, out_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    RECIPE: tl.constexpr, CAUSAL: tl.constexpr, ROTATE: tl.constexpr, INTERP: tl.constexpr,
):
    GROUP: tl.constexpr = HQ // HKV
    pid = tl.program_id(0)
    doc = pid // HQ
    h = pid % HQ
    hk = h // GROUP
    start = tl.load(cu + doc)
    L = tl.load(cu + doc + 1) - start
    pstart = tl.load(pcu + doc)    # the document's first column in kT8 (a multiple of 16)
    # Largest blocks first: program 0 of the second grid axis takes the document's last block.
    ib = tl.cdiv(L, BM) - 1 - tl.program_id(1)
    if ib < 0:
        return
    m0 = ib * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < L
    tok_m = start + offs_m
    m2 = mask_m[:, None]
    q = tl.load(q8 + tok_m[:, None] * stride_qt + h * D + offs_d[None, :], mask=m2, other=0.0)
    lse2 = tl.load(lse + h * T + tok_m, mask=mask_m, other=float("inf")) * 1.4426950408889634
    di = tl.load(delta + h * T + tok_m, mask=mask_m, other=0.0)
    if RECIPE == FP8:
        do_i = tl.load(do8 + tok_m[:, None] * (HQ * D) + h * D + offs_d[None, :], mask=m2,
                       other=0.0)
    else:
        do_i = _bf16_op(tl.load(dout + tok_m[:, None] * stride_dot + h * D + offs_d[None, :],
                                mask=m2, other=0.0), INTERP)
    if RECIPE == BF16:
        q = _bf16_op(q, INTERP)
        rowf = qk_scale2
    else:
        rowf = tl.load(sq + h * T + tok_m, mask=mask_m, other=0.0) * qk_scale2
    acc = tl.zeros([BM, D], dtype=tl.float32)
    if CAUSAL:
        full_end = m0          # kv blocks entirely at or before the block's first row
        hi = tl.minimum(m0 + BM, L)
    else:
        full_end = (L // BN) * BN
        hi = L
    for j0 in range(0, full_end, BN):
        acc = _dq_tile(acc, q, do_i, rowf, lse2, di, offs_m, k8, v8, kT8, sk, sv, hk,
                       start, pstart, L, j0, T, stride_kt, D, BN, RECIPE, False, CAUSAL,
                       INTERP)
    for j0 in range(full_end, hi, BN):
        acc = _dq_tile(acc, q, do_i, rowf, lse2, di, offs_m, k8, v8, kT8, sk, sv, hk,
                       start, pstart, L, j0, T, stride_kt, D, BN, RECIPE, True, CAUSAL,
                       INTERP)
    if RECIPE == FP8:
        acc = acc * (tl.load(sdo + h * T + tok_m, mask=mask_m, other=0.0) * sm_scale)[:, None]
    else:
        acc = acc * sm_scale
    if ROTATE:
        acc = _rotate(acc, hmat, D, INTERP) * out_scale
    tl.store(dq + tok_m[:, None] * stride_dqt + h * D + offs_d[None, :],
             acc.to(dq.dtype.element_ty), mask=m2)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

def _hadamard_pm1(D: int, device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device=device, dtype=torch.bfloat16).contiguous()


_HMAT: dict = {}


def _hmat(D: int, device) -> torch.Tensor:
    key = (D, str(device))
    if key not in _HMAT:
        _HMAT[key] = _hadamard_pm1(D, device)
    return _HMAT[key]


def _empty(shape, dtype, device):
    if POISON:
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(dtype)
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass
class BwdState:
    """Everything the backward launches share: inputs, outputs, preprocess buffers."""
    recipe: int
    T: int
    Hq: int
    Hkv: int
    D: int
    Tp: int
    n_docs: int
    max_seqlen: int
    causal: bool
    sm_scale: float
    interp: bool
    cfg: BwdConfig
    dout: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    sq: torch.Tensor
    sk: torch.Tensor
    sv: torch.Tensor
    cu: torch.Tensor
    rotate: bool
    hmat: torch.Tensor
    delta: torch.Tensor           # (Hq, T) fp32
    do8: torch.Tensor             # (T, Hq, D) e4m3 (fp8 recipes)
    doT8: torch.Tensor            # (Hq, D, Tp) e4m3 (fp8 recipes)
    sdo: torch.Tensor             # (Hq, T) fp32 (fp8 recipes)
    qT8: torch.Tensor             # (Hq, D, Tp) e4m3 (fp8)
    kT8: torch.Tensor             # (Hkv, D, Tp) e4m3 (fp8)
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    # Padded token layout of the K-major copies (flamia.ops.kmajor): document d starts at
    # column pcu[d] (a multiple of 16); column c holds token tok_of_col[c] (-1: a zero pad).
    # None for bf16. qT8 / doT8 hold each 16-column group in wgmma key order
    # (kmajor.mma_order16) where cfg.dkdv says so (GluonDkdvConfig.key_order_dk / dv).
    pcu: torch.Tensor | None = None       # (n_docs + 1,) int32
    tok_of_col: torch.Tensor | None = None    # (Tp,) int32
    # fp8 on the Gluon kernels: the dK/dV kernel's packed query vectors and the dQ kernel's
    # padded (sk, sv), gathered by launch_preprocess (backward_gluon.vector_gathers)
    query_vecs: torch.Tensor | None = None
    kv_vecs: tuple | None = None
    # fp8_mixed on the Gluon kernels: bf16 dO, V, K (backward_gluon.mixed_operands), built
    # once for the dK/dV and the dQ launch
    mixed_ops: tuple | None = None


def make_state(dout, out, lse, qkv: QuantizedQKV, cu_seqlens, max_seqlen, causal=True,
               softmax_scale=None, config: BwdConfig | None = None,
               grad_dtype=None) -> BwdState:
    """Validate, allocate outputs and preprocess buffers (nothing launched). config: the split
    backward's kernels and tiles, by default config.split_backward_config for this device."""
    recipe = qkv.recipe
    if recipe not in RECIPE_IDS:
        raise ValueError(f"backward kernels implement {sorted(RECIPE_IDS)}, not {recipe!r}")
    rid = RECIPE_IDS[recipe]
    T, Hq, Hkv, D = qkv.shape
    if Hq % Hkv:
        raise ValueError(f"Hkv={Hkv} must divide Hq={Hq}")
    if D not in (16, 32, 64, 128):
        raise ValueError(f"head dim {D} not supported by the backward kernels")
    if dout.shape != (T, Hq, D) or out.shape != (T, Hq, D) or lse.shape != (Hq, T):
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)}, lse {tuple(lse.shape)}"
                         f" do not match q8 {(T, Hq, D)}")
    n_docs = cu_seqlens.numel() - 1
    Tp = padded_columns(T, n_docs)
    if max(T * Hq * D, Hq * D * Tp) >= 2 ** 31:
        raise ValueError("the backward kernels index with int32: T * Hq * D must stay below 2^31")
    device = dout.device
    cfg = config or split_backward_config(D, recipe, int(max_seqlen),
                                          gluon=uses_gluon_backward(D, recipe, device))
    if cfg.kv_bn % cfg.kv_bm or cfg.q_bm % cfg.q_bn or (cfg.split_dkdv and cfg.kv_bn % cfg.kv_bm_dv):
        raise ValueError(f"bad block config {cfg}")
    if TensorDescriptor is None:   # pragma: no cover - older triton
        raise RuntimeError("the backward kernels read the K-major copies by TMA: triton >= 3.4")
    fp8 = torch.float8_e4m3fn
    scaled = bool(rid != BF16)
    cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    pcu = tok_of_col = None
    if scaled:
        pcu, tok_of_col, Tp2 = per_cu_seqlens(cu, ("kmajor", T), lambda: kmajor_layout(cu, T))
        assert Tp2 == Tp
    delta = _empty((Hq, T), torch.float32, device)
    if scaled:
        do8 = _empty((T, Hq, D), fp8, device)
        doT8 = _empty((Hq, D, Tp), fp8, device)
        sdo = _empty((Hq, T), torch.float32, device)
        sq, sk, sv = qkv.sq.contiguous(), qkv.sk.contiguous(), qkv.sv.contiguous()
    else:
        do8 = doT8 = sdo = sq = sk = sv = delta   # placeholders, never read
    q8 = qkv.q8.contiguous()
    if rid == FP8:
        qT8 = _empty((Hq, D, Tp), fp8, device)
        kT8 = _empty((Hkv, D, Tp), fp8, device)
    else:
        qT8 = kT8 = q8                            # placeholders, never read
    rotate = bool(qkv.rotated)
    grad_dtype = grad_dtype or dout.dtype
    return BwdState(
        recipe=rid, T=T, Hq=Hq, Hkv=Hkv, D=D, Tp=Tp, n_docs=n_docs,
        max_seqlen=int(max_seqlen), causal=bool(causal),
        sm_scale=D ** -0.5 if softmax_scale is None else float(softmax_scale),
        interp=device.type == "cpu", cfg=cfg, dout=dout.contiguous(), out=out.contiguous(),
        lse=lse.contiguous().float(), q8=q8, k8=qkv.k8.contiguous(), v8=qkv.v8.contiguous(),
        sq=sq, sk=sk, sv=sv, cu=cu,
        rotate=rotate, hmat=_hmat(D, device) if rotate else delta, delta=delta, do8=do8,
        doT8=doT8, sdo=sdo, qT8=qT8, kT8=kT8,
        dq=_empty((T, Hq, D), grad_dtype, device), dk=_empty((T, Hkv, D), grad_dtype, device),
        dv=_empty((T, Hkv, D), grad_dtype, device), pcu=pcu, tok_of_col=tok_of_col)


def launch_preprocess(st: BwdState) -> None:
    """dO's e4m3 copy and scales, Delta, and the K-major copies: dO's from the bytes just
    stored, and for fp8 the forward's q8 / k8 (transposed, nothing re-quantized), qT8 / doT8 in
    the column order of the dK/dV kernel that will read them. Every column written, pads zero;
    the copies in one launch (with the Gluon fp8 kernels' padded per-token vectors as well:
    one launch less per call)."""
    cfg = st.cfg
    grid = (triton.cdiv(st.T, cfg.pre_bt), st.Hq)
    _bwd_preprocess[grid](
        st.dout, st.out, st.do8, st.sdo, st.delta, st.T, st.dout.stride(0), st.out.stride(0),
        HQ=st.Hq, D=st.D, BLOCK_T=cfg.pre_bt, RECIPE=st.recipe, INTERP=st.interp,
        num_warps=cfg.pre_warps)
    if st.recipe == BF16:
        return
    gluon = isinstance(cfg.dkdv, GluonDkdvConfig)
    copies = [(st.do8, st.doT8, gluon and cfg.dkdv.key_order_dv)]
    if st.recipe == FP8:
        copies += [(st.q8, st.qT8, gluon and cfg.dkdv.key_order_dk), (st.k8, st.kT8, False)]
    if gluon:
        from .backward_gluon import vector_gathers
        st.query_vecs, st.kv_vecs = kmajor_copies_and_rows(copies, *vector_gathers(st),
                                                           st.tok_of_col, st.Tp)
    else:
        kmajor_copies(copies, st.tok_of_col)


def _kmajor_desc(xT8: torch.Tensor, block_tokens: int):
    """TMA descriptor over a K-major copy (heads, D, Tp) seen as (heads * D, Tp), block
    (D, block_tokens); tokens past Tp read as zeros. The copies' padded layout (flamia.ops.kmajor)
    starts every document at a multiple of 16 and every tile at a multiple of BM / BN from
    there: the 16-byte aligned token offsets TMA needs, for any cu_seqlens."""
    H, D, Tp = xT8.shape
    return TensorDescriptor(xT8, [H * D, Tp], [Tp, 1], [D, block_tokens])


def launch_dkdv(st: BwdState) -> None:
    cfg = st.cfg
    if isinstance(cfg.dkdv, GluonDkdvConfig):
        from .backward_gluon import launch_dkdv_gluon
        launch_dkdv_gluon(st)
    elif isinstance(cfg.dkdv, MixedDkdvConfig):
        # dK bitwise the Triton kernel's; dV by the FA rule (BM 64 vs 32 tile scales)
        from .backward_gluon import launch_dkdv_gluon_mixed
        launch_dkdv_gluon_mixed(st)
    elif cfg.split_dkdv:
        _launch_dkdv(st, cfg.kv_bm, True, False)
        _launch_dkdv(st, cfg.kv_bm_dv, False, True)
    else:
        _launch_dkdv(st, cfg.kv_bm, True, True)


def _launch_dkdv(st: BwdState, bm: int, do_dk: bool, do_dv: bool) -> None:
    cfg = st.cfg
    scaled = bool(st.recipe != BF16)
    doT8 = _kmajor_desc(st.doT8, bm) if scaled else st.doT8
    qT8 = _kmajor_desc(st.qT8, bm) if st.recipe == FP8 else st.qT8
    grid = (st.n_docs * st.Hkv, triton.cdiv(st.max_seqlen, cfg.kv_bn))
    _bwd_dkdv[grid](
        st.q8, st.k8, st.v8, qT8, st.dout, st.do8, doT8, st.sq, st.sk, st.sv,
        st.sdo, st.lse, st.delta, st.dk, st.dv, st.hmat, st.cu,
        st.pcu if st.pcu is not None else st.cu, st.T, st.q8.stride(0), st.k8.stride(0),
        st.dout.stride(0), st.dk.stride(0),
        st.sm_scale, st.sm_scale * LOG2E, st.D ** -0.5,
        HQ=st.Hq, HKV=st.Hkv, D=st.D, BM=bm, BN=cfg.kv_bn, RECIPE=st.recipe,
        CAUSAL=st.causal, ROTATE=st.rotate, INTERP=st.interp, DO_DK=do_dk, DO_DV=do_dv,
        num_warps=cfg.kv_warps, num_stages=cfg.kv_stages)


def launch_dq(st: BwdState) -> None:
    cfg = st.cfg
    # the Gluon kernels: bitwise the Triton kernels' dQ (same tiles, same scales)
    if isinstance(cfg.dq, GluonDqConfig):
        from .backward_gluon import launch_dq_gluon
        launch_dq_gluon(st)
        return
    if isinstance(cfg.dq, MixedDqConfig):
        from .backward_gluon import launch_dq_gluon_mixed
        launch_dq_gluon_mixed(st)
        return
    grid = (st.n_docs * st.Hq, triton.cdiv(st.max_seqlen, cfg.q_bm))
    fp8 = bool(st.recipe == FP8)
    _bwd_dq[grid](
        st.q8, st.k8, st.v8, _kmajor_desc(st.kT8, cfg.q_bn) if fp8 else st.kT8, st.dout, st.do8,
        st.sq, st.sk, st.sv, st.sdo, st.lse, st.delta, st.dq, st.hmat, st.cu,
        st.pcu if st.pcu is not None else st.cu, st.T, st.q8.stride(0), st.k8.stride(0),
        st.dout.stride(0), st.dq.stride(0),
        st.sm_scale, st.sm_scale * LOG2E, st.D ** -0.5,
        HQ=st.Hq, HKV=st.Hkv, D=st.D, BM=cfg.q_bm, BN=cfg.q_bn, RECIPE=st.recipe,
        CAUSAL=st.causal, ROTATE=st.rotate, INTERP=st.interp,
        num_warps=cfg.q_warps, num_stages=cfg.q_stages)


def run_state(st: BwdState):
    if st.T == 0 or st.n_docs == 0 or st.max_seqlen == 0:
        return st.dq.zero_(), st.dk.zero_(), st.dv.zero_()
    launch_preprocess(st)
    launch_dkdv(st)
    launch_dq(st)
    return st.dq, st.dk, st.dv


def attention_backward(dout, out, lse, qkv: QuantizedQKV, cu_seqlens, max_seqlen, causal=True,
                       softmax_scale=None, deterministic=False, config=None, grad_dtype=None):
    """(dq (T, Hq, D), dk, dv (T, Hkv, D)) in grad_dtype (default dout's dtype), dq and dk rotated
    back to the input space. dout, out (T, Hq, D); lse (Hq, T) fp32 from the forward.

    config: config.backward_config(D, recipe, device, max_seqlen, dtype) by default; a
    backward_sm90.Sm90BwdConfig runs the one-pass Hopper kernel (its dQ adds are unordered
    unless deterministic=True; qkv.row_max is required for fp8_block), a BwdConfig the split
    kernels here (deterministic either way), ReferenceBwdConfig flamia.reference.backward on
    qkv's operands (fp8_block off sm_90).
    cu_seqlens[-1] must be T (no padding tokens).
    """
    D = qkv.shape[3]
    cfg = config or backward_config(D, qkv.recipe, dout.device, max_seqlen, qkv.q8.dtype)
    if isinstance(cfg, ReferenceBwdConfig):
        from ..reference import backward
        dq, dk, dv = backward(dout, out, lse, reference_saved(qkv, causal), cu_seqlens,
                              qkv.recipe, causal, softmax_scale)
        dt = grad_dtype or dout.dtype
        return dq.to(dt), dk.to(dt), dv.to(dt)
    if not isinstance(cfg, BwdConfig):
        from .backward_sm90 import attention_backward_sm90, attention_backward_sm90_fp8
        if qkv.kvblock:
            return attention_backward_sm90_fp8(dout, out, lse, qkv.row_max, qkv, cu_seqlens,
                                               causal, softmax_scale, grad_dtype, deterministic,
                                               config=cfg)
        return attention_backward_sm90(dout, out, lse, qkv.q8, qkv.k8, qkv.v8, cu_seqlens, causal,
                                       softmax_scale, grad_dtype, deterministic, config=cfg)
    st = make_state(dout, out, lse, qkv, cu_seqlens, max_seqlen, causal, softmax_scale, cfg,
                    grad_dtype)
    return run_state(st)
