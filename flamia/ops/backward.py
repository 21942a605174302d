"""Backward kernels: dQ, dK, dV from the forward's quantized operands and LSE (issue 6).

Numerics: `flamia.reference.backward` (module docstring, point 4), recipes fp8, fp8_mixed, bf16.
Three launches, deterministic by construction (no atomics), so `deterministic=True` costs nothing:

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
Experimental (BwdConfig.dq_atomic with deterministic=False): dQ accumulated by fp32 atomics in
the dK/dV kernel (no S/dP recompute) into a (T, Hq, D) fp32 buffer, then `_dq_finalize`.

Tiles are aligned to document starts (cu_seqlens): no tile ever reads another document's
tokens (P2 by construction); rows past a document's end load lse = +inf so their P is exactly 0.

Under the Triton interpreter (CPU tests) two things differ from the GPU and are handled here:
float casts go through flamia.ops.interpreter (torch rounding, as the hardware does), and bf16
tl.dot (the interpreter multiplies bf16 as raw uint16) runs on bf16-valued fp32 operands.

Memory beyond what the forward saved: do8 + doT8 (2 bytes per element of dO), qT8 + kT8 (fp8
only), sdo and Delta (Hq, T) fp32. No fp32 dQ accumulator (except the dq_atomic option).
"""
from __future__ import annotations

import os

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from . import interpreting, is_sm90
from .kmajor import (kmajor_copies, kmajor_copies_and_rows, kmajor_copy, kmajor_layout,
                     padded_columns)
from .layout import QuantizedQKV
from .schedule import per_cu_seqlens

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:   # pragma: no cover - older triton
    TensorDescriptor = None

if interpreting():
    from . import interpreter
    interpreter.install()

RECIPE_IDS = {"fp8": 0, "fp8_mixed": 1, "bf16": 2}
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
def _kmajor_tile(src, row0, tok0, offs_tok, mask_tok, Tp, D: tl.constexpr, BLK: tl.constexpr,
                 END: tl.constexpr, USE_TMA: tl.constexpr):
    """(BLK, D) tile of a K-major copy xT8 (heads, D, Tp): tokens tok0 + [0, BLK) (absolute) of
    the head whose D rows start at row0 = head * D; zero where mask_tok is False.

    USE_TMA: `src` is a TMA descriptor over xT8 seen as (heads * D, Tp) with block (D, BLK): the
    tile lands in shared memory by TMA, K-major, and feeds the fp8 wgmma directly (pipelined).
    Only END tiles (the ones that may reach past the document's end) are masked, in registers.
    Otherwise `src` is a pointer: per-byte loads (tokens are the contiguous axis and the mask
    varies along it), not pipelined -- the slow fallback (config.use_tma=False). tok0 is a column
    of the padded layout (pcu[doc] + block offset), a multiple of 16."""
    if USE_TMA:
        x = src.load([row0, tok0]).T
        if END:   # tokens past the document's end belong to the next one: never let a NaN in
            x = tl.where(mask_tok[:, None], x, 0.0)
    else:
        offs_d = tl.arange(0, D)
        x = tl.load(src + row0 * Tp + offs_d[None, :] * Tp + (tok0 + offs_tok)[:, None],
                    mask=mask_tok[:, None], other=0.0)
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
    if RECIPE != 2:
        amax = tl.max(tl.abs(do), axis=1)
        s, inv = _pow2_scale_div(amax)
        d8 = (do * inv[:, None]).to(tl.float8e4nv)
        tl.store(do8 + offs_t[:, None] * (HQ * D) + h * D + offs_d[None, :], d8, mask=m2)
        tl.store(sdo + h * T + offs_t, s, mask=mask_t)
        if RECIPE == 0:
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
    acc_dk, acc_dv, k, v, rowf, sv_j, sk_j, kq, offs_n,
    q8, qT8, dout, do8, doT8, sq, sdo, lse, delta, dq_acc,
    h, start, pstart, L, i0, T, Tp, stride_qt, stride_dot, sm_scale,
    HQ: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
    RECIPE: tl.constexpr, MASK: tl.constexpr, DQ_ATOMIC: tl.constexpr, INTERP: tl.constexpr,
    END: tl.constexpr, USE_TMA: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr,
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
    if RECIPE == 2:
        q = _bf16_op(q, INTERP)
        p_t = tl.math.exp2(_mm(k, tl.trans(q), INTERP) * rowf - lse2[None, :])
    else:
        sq_i = tl.load(sq + h * T + tok_m, mask=mask_m, other=0.0)
        s_t = _mm(k, tl.trans(q), INTERP) * rowf[:, None]
        p_t = tl.math.exp2(s_t * sq_i[None, :] - lse2[None, :])
    if MASK:
        p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)

    if RECIPE == 2:
        do_b = _bf16_op(tl.load(dout + tok_m[:, None] * stride_dot + h * D + offs_d[None, :],
                                mask=m2, other=0.0), INTERP)
        if DO_DV:
            acc_dv += _mm(_bf16_op(p_t, INTERP), do_b, INTERP)       # dV_j += bf16(P^T) dO_i
        if DO_DK:
            ds_t = p_t * (_mm(v, tl.trans(do_b), INTERP) - di[None, :])
            acc_dk += _mm(_bf16_op(ds_t, INTERP), q, INTERP)         # dK_j += bf16(dS^T) Q_i
            if DQ_ATOMIC:
                part = _mm(tl.trans(_bf16_op(ds_t, INTERP)), kq, INTERP) * sm_scale
                tl.atomic_add(dq_acc + tok_m[:, None] * (HQ * D) + h * D + offs_d[None, :], part,
                              mask=m2, sem="relaxed")
    else:
        sdo_i = tl.load(sdo + h * T + tok_m, mask=mask_m, other=0.0)
        a = p_t * sdo_i[None, :]
        if DO_DV:
            # dV_j += c_j * e4m3(P^T sdo_i / c_j) @ do8_i  (c_j: power of two over the tile's row j)
            c, inv = _pow2_scale(tl.max(tl.abs(a), axis=1), 8)
            doT = _kmajor_tile(doT8, h * D, pstart + i0, tl.arange(0, BM), mask_m, Tp, D, BM, END,
                               USE_TMA)
            acc_dv += _mm((a * inv[:, None]).to(tl.float8e4nv), doT, INTERP) * c[:, None]
        if DO_DK:
            if RECIPE == 0:
                # dP^T = (v8 do8^T) sv_j sdo_i; Delta is stored in units of sdo_i, so
                # dS^T = P^T (dP^T - Delta) = (P^T sdo_i) (dot sv_j - Delta / sdo_i)   exactly.
                do_q = tl.load(do8 + tok_m[:, None] * (HQ * D) + h * D + offs_d[None, :], mask=m2,
                               other=0.0)
                t = _mm(v, tl.trans(do_q), INTERP) * sv_j[:, None] - di[None, :]
                b = a * t * sq_i[None, :]                              # dS^T * sq_i
                c2, inv2 = _pow2_scale(tl.max(tl.abs(b), axis=1), 8)
                qT = _kmajor_tile(qT8, h * D, pstart + i0, tl.arange(0, BM), mask_m, Tp, D, BM,
                                  END, USE_TMA)
                acc_dk += _mm((b * inv2[:, None]).to(tl.float8e4nv), qT, INTERP) * c2[:, None]
                if DQ_ATOMIC:
                    # dQ_i += (dS K_j) with a scale per query row i over the tile's keys (axis 0)
                    bq = p_t * t * sk_j[:, None]                       # dS^T * sk_j / sdo_i
                    cq, invq = _pow2_scale(tl.max(tl.abs(bq), axis=0), 8)
                    part = _mm(tl.trans((bq * invq[None, :]).to(tl.float8e4nv)), kq, INTERP)
                    part = part * (cq * sdo_i * sm_scale)[:, None]
                    tl.atomic_add(dq_acc + tok_m[:, None] * (HQ * D) + h * D + offs_d[None, :],
                                  part, mask=m2, sem="relaxed")
            else:
                # dP in bf16 from bf16 dO and V's e4m3 values (exact in bf16), V's scale outside
                do_b = _bf16_op(tl.load(dout + tok_m[:, None] * stride_dot + h * D
                                        + offs_d[None, :], mask=m2, other=0.0), INTERP)
                ds_t = p_t * (_mm(v, tl.trans(do_b), INTERP) * sv_j[:, None] - di[None, :])
                # bf16(dS) * sq_i == bf16(dS * sq_i) (power of two); Q's e4m3 values exact in bf16
                acc_dk += _mm(_bf16_op(ds_t * sq_i[None, :], INTERP), _bf16_op(q, INTERP), INTERP)
                if DQ_ATOMIC:
                    part = _mm(tl.trans(_bf16_op(ds_t * sk_j[:, None], INTERP)), kq,
                               INTERP) * sm_scale
                    tl.atomic_add(dq_acc + tok_m[:, None] * (HQ * D) + h * D + offs_d[None, :],
                                  part, mask=m2, sem="relaxed")
    return acc_dk, acc_dv


@triton.jit
def _bwd_dkdv(
    q8, k8, v8, qT8, kT8p, dout, do8, doT8, sq, sk, sv, sdo, lse, delta, dk, dv, dq_acc, hmat, cu,
    pcu, T, Tp, stride_qt, stride_kt, stride_dot, stride_dkt,
    sm_scale, qk_scale2, out_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    RECIPE: tl.constexpr, CAUSAL: tl.constexpr, ROTATE: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    INTERP: tl.constexpr, USE_TMA: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr,
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
    if RECIPE == 2:
        k = _bf16_op(k, INTERP)
        v = _bf16_op(v, INTERP)
        rowf = qk_scale2
        sv_j = qk_scale2   # unused
        sk_j = qk_scale2   # unused
        kq = k             # dQ GEMM operand (DQ_ATOMIC)
    else:
        sk_j = tl.load(sk + hk * T + tok_n, mask=mask_n, other=0.0)
        rowf = sk_j * qk_scale2
        sv_j = tl.load(sv + hk * T + tok_n, mask=mask_n, other=0.0)
        if RECIPE == 1:
            v = _bf16_op(v, INTERP)   # dP in bf16: V's e4m3 values are exact in bf16
            kq = _bf16_op(k, INTERP)
        elif DQ_ATOMIC:
            kq = tl.load(kT8p + hk * D * Tp + offs_d[None, :] * Tp + (pstart + offs_n)[:, None],
                         mask=n2, other=0.0)
        else:
            kq = k
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
                    acc_dk, acc_dv, k, v, rowf, sv_j, sk_j, kq, offs_n, q8, qT8, dout, do8, doT8,
                    sq, sdo, lse, delta, dq_acc, h, start, pstart, L, i0, T, Tp, stride_qt,
                    stride_dot, sm_scale,
                    HQ, D, BM, RECIPE, run == 0, DQ_ATOMIC, INTERP, run != 1, USE_TMA, DO_DK, DO_DV)
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
    k8, v8, kT8, sk, sv, hk, start, pstart, L, j0, T, Tp, stride_kt,
    D: tl.constexpr, BN: tl.constexpr, RECIPE: tl.constexpr, MASK: tl.constexpr,
    CAUSAL: tl.constexpr, INTERP: tl.constexpr, USE_TMA: tl.constexpr,
):
    offs_n = j0 + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    mask_n = offs_n < L
    tok_n = start + offs_n
    n2 = mask_n[:, None]
    k = tl.load(k8 + tok_n[:, None] * stride_kt + hk * D + offs_d[None, :], mask=n2, other=0.0)
    v = tl.load(v8 + tok_n[:, None] * stride_kt + hk * D + offs_d[None, :], mask=n2, other=0.0)
    if RECIPE == 2:
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
    if RECIPE == 0:
        # dS sk_j / sdo_i = P (dot sv_j - Delta/sdo_i) sk_j: sdo_i, a power of two constant along
        # the row, moves out of the row's quantization scale into the epilogue (exact).
        sv_j = tl.load(sv + hk * T + tok_n, mask=mask_n, other=0.0)
        t = _mm(do_i, tl.trans(v), INTERP) * sv_j[None, :] - di[:, None]
        b = p * t * sk_j[None, :]
        c, inv = _pow2_scale(tl.max(tl.abs(b), axis=1), 8)
        kT = _kmajor_tile(kT8, hk * D, pstart + j0, tl.arange(0, BN), mask_n, Tp, D, BN, MASK,
                          USE_TMA)
        acc += _mm((b * inv[:, None]).to(tl.float8e4nv), kT, INTERP) * c[:, None]
    elif RECIPE == 1:
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
    T, Tp, stride_qt, stride_kt, stride_dot, stride_dqt,
    sm_scale, qk_scale2, out_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    RECIPE: tl.constexpr, CAUSAL: tl.constexpr, ROTATE: tl.constexpr, INTERP: tl.constexpr,
    USE_TMA: tl.constexpr,
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
    if RECIPE == 0:
        do_i = tl.load(do8 + tok_m[:, None] * (HQ * D) + h * D + offs_d[None, :], mask=m2,
                       other=0.0)
    else:
        do_i = _bf16_op(tl.load(dout + tok_m[:, None] * stride_dot + h * D + offs_d[None, :],
                                mask=m2, other=0.0), INTERP)
    if RECIPE == 2:
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
                       start, pstart, L, j0, T, Tp, stride_kt, D, BN, RECIPE, False, CAUSAL,
                       INTERP, USE_TMA)
    for j0 in range(full_end, hi, BN):
        acc = _dq_tile(acc, q, do_i, rowf, lse2, di, offs_m, k8, v8, kT8, sk, sv, hk,
                       start, pstart, L, j0, T, Tp, stride_kt, D, BN, RECIPE, True, CAUSAL,
                       INTERP, USE_TMA)
    if RECIPE == 0:
        acc = acc * (tl.load(sdo + h * T + tok_m, mask=mask_m, other=0.0) * sm_scale)[:, None]
    else:
        acc = acc * sm_scale
    if ROTATE:
        acc = _rotate(acc, hmat, D, INTERP) * out_scale
    tl.store(dq + tok_m[:, None] * stride_dqt + h * D + offs_d[None, :],
             acc.to(dq.dtype.element_ty), mask=m2)


@triton.jit
def _dq_finalize(dq_acc, dq, hmat, T, stride_dqt, out_scale,
                 HQ: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, ROTATE: tl.constexpr,
                 INTERP: tl.constexpr):
    """DQ_ATOMIC path: the fp32 accumulator (softmax scale folded in) -> rotate back, cast."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    offs_d = tl.arange(0, D)
    m2 = (offs_t < T)[:, None]
    x = tl.load(dq_acc + offs_t[:, None] * (HQ * D) + h * D + offs_d[None, :], mask=m2, other=0.0)
    if ROTATE:
        x = _rotate(x, hmat, D, INTERP) * out_scale
    tl.store(dq + offs_t[:, None] * stride_dqt + h * D + offs_d[None, :], x.to(dq.dtype.element_ty),
             mask=m2)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BwdConfig:
    """Tile shapes and launch parameters. dK/dV: BN kv rows per program, BM query rows per step
    (BN % BM == 0); dQ: BM query rows per program, BN kv rows per step (BM % BN == 0)."""
    kv_bn: int = 128
    kv_bm: int = 64
    kv_warps: int = 8
    kv_stages: int = 2
    q_bm: int = 128
    q_bn: int = 64
    q_warps: int = 8
    q_stages: int = 2
    pre_bt: int = 64
    pre_warps: int = 4
    # fp8 recipes: read the K-major copies doT8 / qT8 / kT8 through TMA descriptors (pipelined,
    # straight into shared memory), for any cu_seqlens (padded, 16-aligned layout of the copies).
    # False: masked pointer loads, one byte per load, not pipelined (the pre-2026-12 kernels;
    # ~3x slower dK/dV on the H200).
    use_tma: bool = True
    # deterministic=False only: dQ accumulated with fp32 atomics from the dK/dV kernel (no S/dP
    # recompute, one fp32 (T, Hq, D) buffer, a finalize launch) instead of the dQ kernel.
    dq_atomic: bool = False
    # dK and dV in two launches (each recomputes S^T; half the accumulator registers each, so
    # larger query steps fit): kv_bm for the dK launch, kv_bm_dv for the dV launch.
    split_dkdv: bool = False
    kv_bm_dv: int = 64
    # on sm_90: dK / dV and dQ of fp8 and fp8_mixed by the Gluon kernels (see
    # _gluon_applies); kv_* / q_* then unused
    gluon_dkdv: bool = True
    gluon_dq: bool = True


# Longest document from which fp8_mixed splits the dK/dV launch (see default_config).
SPLIT_DKDV_MIN_SEQLEN = 4096


def default_config(head_dim: int, recipe: str, max_seqlen: int | None = None) -> BwdConfig:
    """Block shapes from the sm_90a compile analysis (benchmarks/bwd_compile.py) and the H200 A/B
    runs (benchmarks/bwd_ab.py; benchmarks/NOTES.md). The dK/dV kernel keeps dK and dV (BN x D
    fp32) live plus ~6 (BN x BM) temporaries; at D=128 BM=32 spills least (fp8 ~0.4 KB). fp8_mixed
    at D=128 runs dK and dV as two launches with BM=64 (each holds one accumulator; 1.2 KB of
    spills fused, ~0.1-0.5 KB split): 112 -> 90 ms at doc32k and 29 -> 24 ms at doc8k_x4 on the
    H200 despite recomputing S^T, but slower on short documents (the full bench, fwd+bwd vs cuDNN:
    doc2k_x16 0.30x -> 0.29x, doc512_x64 0.32x -> 0.27x), so only when the longest document has
    at least SPLIT_DKDV_MIN_SEQLEN tokens. fp8 loses with the split (76 -> 86 ms at doc32k)."""
    if head_dim <= 64:
        return BwdConfig(kv_bn=128, kv_bm=64, kv_warps=8, q_bm=128, q_bn=64, q_warps=8)
    if recipe == "fp8_mixed" and (max_seqlen or 0) >= SPLIT_DKDV_MIN_SEQLEN:
        return BwdConfig(kv_bn=128, kv_bm=64, kv_warps=8, kv_stages=2, split_dkdv=True,
                         kv_bm_dv=64)
    if recipe in ("fp8", "fp8_mixed"):
        return BwdConfig(kv_bn=128, kv_bm=32, kv_warps=8, kv_stages=2)
    return BwdConfig()


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
    dq_atomic: bool = False
    dq_acc: torch.Tensor | None = None    # (T, Hq, D) fp32, dq_atomic only
    kmajor_tma: bool = False      # TMA loads of doT8 / qT8 / kT8 (see _use_tma)
    # Padded token layout of the K-major copies (flamia.ops.kmajor): document d starts at
    # column pcu[d] (a multiple of 16); column c holds token tok_of_col[c] (-1: a zero pad).
    # None for bf16.
    pcu: torch.Tensor | None = None       # (n_docs + 1,) int32
    tok_of_col: torch.Tensor | None = None    # (Tp,) int32
    # qT8 / doT8 with each 16-column group in wgmma key order (kmajor.mma_order16), as the
    # Gluon dK/dV kernel with GluonDkdvConfig.key_order_dk / key_order_dv reads them; set by
    # launch_preprocess when that kernel will run (fp8, D=64 default), never for Triton's
    qT8_key_order: bool = False
    doT8_key_order: bool = False
    # copies of qT8 / doT8 in the other column order, made on demand (qT_doT_in_order)
    kmajor_reordered: dict = field(default_factory=dict)
    # fp8_mixed on the Gluon kernels: bf16 dO, V, K (backward_gluon_mixed.mixed_operands), built
    # once for the dK/dV and the dQ launch
    mixed_ops: tuple | None = None
    # the dQ kernel's padded (sk, sv), when the dK/dV launch gathered them with its own vectors
    kv_vecs: tuple | None = None
    # (fold_sdo, the dK/dV kernel's packed query vectors) when launch_preprocess gathered them
    query_vecs: tuple | None = None


def make_state(dout, out, lse, qkv: QuantizedQKV, cu_seqlens, max_seqlen, causal=True,
               softmax_scale=None, config: BwdConfig | None = None, grad_dtype=None,
               deterministic=True) -> BwdState:
    """Validate, allocate outputs and preprocess buffers (nothing launched)."""
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
    cfg = config or default_config(D, recipe, int(max_seqlen))
    if cfg.kv_bn % cfg.kv_bm or cfg.q_bm % cfg.q_bn or (cfg.split_dkdv and cfg.kv_bn % cfg.kv_bm_dv):
        raise ValueError(f"bad block config {cfg}")
    fp8 = torch.float8_e4m3fn
    scaled = rid != 2
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
    dq_atomic = bool(cfg.dq_atomic and not deterministic)
    if rid == 0:
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
        dv=_empty((T, Hkv, D), grad_dtype, device), dq_atomic=dq_atomic,
        dq_acc=torch.zeros((T, Hq, D), dtype=torch.float32, device=device) if dq_atomic else None,
        kmajor_tma=bool(scaled and cfg.use_tma and TensorDescriptor is not None
                        and os.environ.get("FLAMIA_BWD_TMA", "1") != "0" and T > 0),
        pcu=pcu, tok_of_col=tok_of_col)


def launch_preprocess(st: BwdState) -> None:
    cfg = st.cfg
    grid = (triton.cdiv(st.T, cfg.pre_bt), st.Hq)
    _bwd_preprocess[grid](
        st.dout, st.out, st.do8, st.sdo, st.delta, st.T, st.dout.stride(0), st.out.stride(0),
        HQ=st.Hq, D=st.D, BLOCK_T=cfg.pre_bt, RECIPE=st.recipe, INTERP=st.interp,
        num_warps=cfg.pre_warps)
    if st.recipe != 2:
        # K-major copies (every column written, pads zero): dO's from the bytes just stored,
        # and for fp8 the forward's q8 / k8 (transposed, nothing re-quantized); qT8 / doT8 in
        # the key order of the dK/dV kernel that will read them; all in one launch
        gcfg = _gluon_fp8_dkdv_config(st)
        st.qT8_key_order, st.doT8_key_order = ((gcfg.key_order_dk, gcfg.key_order_dv)
                                               if gcfg is not None else (False, False))
        copies = [(st.do8, st.doT8, st.doT8_key_order)]
        if st.recipe == 0:
            copies += [(st.q8, st.qT8, st.qT8_key_order), (st.k8, st.kT8, False)]
        if gcfg is None or not (gcfg.pack_vecs and gcfg.vec_tma):
            kmajor_copies(copies, st.tok_of_col)
        else:
            # and the Gluon kernels' padded per-token vectors in the same launch (one launch
            # less per call; the dK/dV and dQ launchers take them from the state)
            from .backward_gluon import vector_gathers
            packed, st.kv_vecs = kmajor_copies_and_rows(
                copies, *vector_gathers(st, gcfg.fold_sdo), st.tok_of_col, st.Tp)
            st.query_vecs = (gcfg.fold_sdo, packed)


def _gluon_fp8_dkdv_config(st: BwdState):
    """The GluonDkdvConfig of the fp8 dK/dV kernel launch_dkdv will run (its default), or None
    when it runs another kernel: what launch_preprocess prepares for it (the K-major copies'
    column order, the packed per-token vectors)."""
    if st.recipe != RECIPE_IDS["fp8"] or not _gluon_applies(st, st.cfg.gluon_dkdv):
        return None
    from .backward_gluon import default_gluon_config
    return default_gluon_config(st.D)


def _use_tma(st: BwdState) -> bool:
    """TMA tiles of the K-major copies need 16-byte aligned token offsets (Triton's descriptor
    rule, asserted by the interpreter). The copies' padded layout (flamia.ops.kmajor) starts every
    document at a multiple of 16 and every tile at a multiple of BM / BN from there, so TMA works
    for any cu_seqlens; off only with config.use_tma=False or FLAMIA_BWD_TMA=0 (pointer path:
    same padded layout, same values, byte-wise masked loads, slow)."""
    return st.kmajor_tma


def _kmajor_desc(xT8: torch.Tensor, block_tokens: int):
    """TMA descriptor over a K-major copy (heads, D, Tp) seen as (heads * D, Tp), block
    (D, block_tokens); tokens past Tp read as zeros."""
    H, D, Tp = xT8.shape
    return TensorDescriptor(xT8, [H * D, Tp], [Tp, 1], [D, block_tokens])


# the recipes with Gluon kernels (dK/dV and dQ each)
GLUON_RECIPES = (RECIPE_IDS["fp8"], RECIPE_IDS["fp8_mixed"])


def _gluon_applies(st: BwdState, enabled: bool) -> bool:
    """The Gluon kernels (flamia/ops/backward_gluon.py, backward_gluon_mixed.py: TMA rings,
    async wgmma; on the H200 dK/dV 1.6-1.9x and dQ 1.4-1.8x the Triton kernels,
    benchmarks/NOTES.md) run GLUON_RECIPES on sm_90 GPUs. enabled: BwdConfig.gluon_dkdv / gluon_dq;
    False or FLAMIA_GLUON=0 keep the Triton kernels (the ones CPU CI tests under the interpreter;
    the GPU tests check both)."""
    if not (enabled and st.recipe in GLUON_RECIPES and not st.dq_atomic and not st.interp
            and st.dk.is_cuda and os.environ.get("FLAMIA_GLUON", "1") != "0"):
        return False
    if not is_sm90(st.dk.device):
        return False
    from . import backward_gluon
    return backward_gluon.HAVE_GLUON and st.D in (64, 128)


def _mixed_operands(st: BwdState) -> tuple:
    """fp8_mixed's bf16 GEMM operands, converted once per backward call (dK/dV and dQ share
    dO and V; K's copy is made with them, for the dQ launch)."""
    if st.mixed_ops is None:
        from .backward_gluon_mixed import mixed_operands
        st.mixed_ops = mixed_operands(st)
    return st.mixed_ops


def launch_dkdv(st: BwdState) -> None:
    cfg = st.cfg
    if _gluon_applies(st, cfg.gluon_dkdv):
        if st.recipe == RECIPE_IDS["fp8"]:
            from .backward_gluon import launch_dkdv_gluon
            launch_dkdv_gluon(st)
        else:   # dK bitwise the Triton kernel's; dV by the FA rule (BM 64 vs 32 tile scales)
            from .backward_gluon_mixed import launch_dkdv_gluon_mixed
            launch_dkdv_gluon_mixed(st, ops=_mixed_operands(st))
        return
    if cfg.split_dkdv:
        _launch_dkdv(st, cfg.kv_bm, True, False)
        _launch_dkdv(st, cfg.kv_bm_dv, False, True)
    else:
        _launch_dkdv(st, cfg.kv_bm, True, True)


def qT_doT_in_order(st: BwdState, q_key_order: bool, do_key_order: bool):
    """(qT8, doT8), each with its columns in token order (False: the Triton dK/dV kernel) or in
    wgmma key order (the Gluon kernel with GluonDkdvConfig.key_order_dk / key_order_dv): the
    state's own when launch_preprocess wrote it in that order, else a copy in it (kmajor_copy
    of q8 / do8) made once per state and kept on it (A/Bs of kernels on one state)."""
    return (_kmajor_in_order(st, "qT8", st.q8, q_key_order),
            _kmajor_in_order(st, "doT8", st.do8, do_key_order))


def _kmajor_in_order(st: BwdState, name: str, src: torch.Tensor, key_order: bool):
    own, own_order = (st.qT8, st.qT8_key_order) if name == "qT8" else (st.doT8, st.doT8_key_order)
    if key_order == own_order or (name == "qT8" and st.recipe != 0):
        return own           # (qT8 is a placeholder outside the fp8 recipe)
    copy = st.kmajor_reordered.get(name)
    if copy is None:
        copy = torch.empty_like(own)
        if own.is_cuda or interpreting():   # (compile-only CPU states launch nothing)
            kmajor_copy(src, copy, st.tok_of_col, mma_order=key_order)
        st.kmajor_reordered[name] = copy
    return copy


def _launch_dkdv(st: BwdState, bm: int, do_dk: bool, do_dv: bool) -> None:
    cfg = st.cfg
    tma = _use_tma(st)
    qT8, doT8 = qT_doT_in_order(st, False, False)
    doT8 = _kmajor_desc(doT8, bm) if tma else doT8
    qT8 = _kmajor_desc(qT8, bm) if tma and st.recipe == 0 else qT8
    grid = (st.n_docs * st.Hkv, triton.cdiv(st.max_seqlen, cfg.kv_bn))
    _bwd_dkdv[grid](
        st.q8, st.k8, st.v8, qT8, st.kT8, st.dout, st.do8, doT8, st.sq, st.sk, st.sv,
        st.sdo, st.lse, st.delta, st.dk, st.dv,
        st.dq_acc if st.dq_atomic else st.delta, st.hmat, st.cu,
        st.pcu if st.pcu is not None else st.cu, st.T, st.Tp, st.q8.stride(0), st.k8.stride(0),
        st.dout.stride(0), st.dk.stride(0),
        st.sm_scale, st.sm_scale * LOG2E, st.D ** -0.5,
        HQ=st.Hq, HKV=st.Hkv, D=st.D, BM=bm, BN=cfg.kv_bn, RECIPE=st.recipe,
        CAUSAL=st.causal, ROTATE=st.rotate, DQ_ATOMIC=st.dq_atomic and do_dk, INTERP=st.interp,
        USE_TMA=tma, DO_DK=do_dk, DO_DV=do_dv, num_warps=cfg.kv_warps,
        num_stages=cfg.kv_stages)


def launch_dq(st: BwdState) -> None:
    cfg = st.cfg
    if _gluon_applies(st, cfg.gluon_dq):
        # bitwise the Triton kernels' dQ (same tiles, same scales)
        if st.recipe == RECIPE_IDS["fp8"]:
            from .backward_gluon import launch_dq_gluon
            launch_dq_gluon(st)
        else:
            from .backward_gluon_mixed import launch_dq_gluon_mixed
            launch_dq_gluon_mixed(st, ops=_mixed_operands(st))
        return
    if st.dq_atomic:     # the dK/dV launch accumulated dq_acc
        _dq_finalize[(triton.cdiv(st.T, cfg.pre_bt), st.Hq)](
            st.dq_acc, st.dq, st.hmat, st.T, st.dq.stride(0), st.D ** -0.5,
            HQ=st.Hq, D=st.D, BLOCK_T=cfg.pre_bt, ROTATE=st.rotate, INTERP=st.interp,
            num_warps=cfg.pre_warps)
        return
    grid = (st.n_docs * st.Hq, triton.cdiv(st.max_seqlen, cfg.q_bm))
    tma = _use_tma(st) and st.recipe == 0
    _bwd_dq[grid](
        st.q8, st.k8, st.v8, _kmajor_desc(st.kT8, cfg.q_bn) if tma else st.kT8, st.dout, st.do8,
        st.sq, st.sk, st.sv, st.sdo, st.lse, st.delta, st.dq, st.hmat, st.cu,
        st.pcu if st.pcu is not None else st.cu, st.T, st.Tp, st.q8.stride(0), st.k8.stride(0),
        st.dout.stride(0), st.dq.stride(0),
        st.sm_scale, st.sm_scale * LOG2E, st.D ** -0.5,
        HQ=st.Hq, HKV=st.Hkv, D=st.D, BM=cfg.q_bm, BN=cfg.q_bn, RECIPE=st.recipe,
        CAUSAL=st.causal, ROTATE=st.rotate, INTERP=st.interp, USE_TMA=tma,
        num_warps=cfg.q_warps, num_stages=cfg.q_stages)


def run_state(st: BwdState):
    if st.T == 0 or st.n_docs == 0 or st.max_seqlen == 0:
        return st.dq.zero_(), st.dk.zero_(), st.dv.zero_()
    launch_preprocess(st)
    launch_dkdv(st)
    launch_dq(st)
    return st.dq, st.dk, st.dv


def attention_backward(dout, out, lse, qkv: QuantizedQKV, cu_seqlens, max_seqlen, causal=True,
                       softmax_scale=None, deterministic=False, config: BwdConfig | None = None,
                       grad_dtype=None):
    """(dq (T, Hq, D), dk, dv (T, Hkv, D)) in grad_dtype (default dout's dtype), dq and dk rotated
    back to the input space. dout, out (T, Hq, D); lse (Hq, T) fp32 from the forward.

    The bf16 recipe on an sm_90 GPU runs the one-pass Hopper kernel (uses_sm90_backward): its dQ
    adds are unordered unless deterministic=True. The split kernels here are deterministic
    either way (with deterministic=False and config.dq_atomic=True, dQ is accumulated with fp32
    atomics in the dK/dV kernel instead). cu_seqlens[-1] must be T (no padding tokens).
    """
    if uses_sm90_backward(qkv, dout.device) and config is None:
        from .backward_sm90 import attention_backward_sm90
        return attention_backward_sm90(dout, out, lse, qkv.q8, qkv.k8, qkv.v8, cu_seqlens, causal,
                                       softmax_scale, grad_dtype, deterministic)
    st = make_state(dout, out, lse, qkv, cu_seqlens, max_seqlen, causal, softmax_scale, config,
                    grad_dtype, deterministic)
    return run_state(st)


def uses_sm90_backward(qkv: QuantizedQKV, device) -> bool:
    """Does the bf16 recipe's backward run the one-pass Hopper kernel (flamia.ops.backward_sm90)
    here? On an sm_90 GPU at head dims 64 and 128, for bf16 inputs (fp16 inputs keep the split
    kernels until the one-pass kernel is tested with them on the GPU)."""
    return (qkv.recipe == "bf16" and qkv.q8.dtype == torch.bfloat16
            and qkv.q8.shape[-1] in (64, 128) and device.type == "cuda" and is_sm90(device))


# ----------------------------------------------------------------------------------------------
# Test / benchmark helper: QuantizedQKV from the reference forward's saved operands
# ----------------------------------------------------------------------------------------------

def quantized_qkv_from_reference(saved, recipe: str, cu_seqlens,
                                 causal: bool = True) -> QuantizedQKV:
    """The kernel layout of reference.forward(...)'s Saved operands (same bytes and scales that
    flamia.ops.quantize.quantize_qkv produces)."""
    if recipe == "bf16":
        return QuantizedQKV("bf16", saved.q.values.to(torch.bfloat16).contiguous(),
                            saved.k.values.to(torch.bfloat16).contiguous(),
                            saved.v.values.to(torch.bfloat16).contiguous(),
                            None, None, None, None, rotated=False)
    fp8 = torch.float8_e4m3fn

    def sc(op):
        return op.scale[..., 0].transpose(0, 1).float().contiguous()

    sv = sc(saved.v)
    vcap = torch.empty_like(sv)
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            vcap[:, a:b] = torch.cummax(sv[:, a:b], dim=1).values if causal else \
                sv[:, a:b].amax(1, keepdim=True).expand(-1, b - a)
    return QuantizedQKV(recipe, saved.q.values.to(fp8).contiguous(),
                        saved.k.values.to(fp8).contiguous(), saved.v.values.to(fp8).contiguous(),
                        sc(saved.q), sc(saved.k), sv, vcap, rotated=saved.rotation is not None)
