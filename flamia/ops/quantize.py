"""Quantize q, k, v once for every GEMM of forward and backward: the fp8 recipe's token-block
scaling (reference.py "Token-block scaling"; layout.QuantizedQKV has the layout).

Three launches. _quantize_q_kernel quantizes q per (token, head):
  q8 = e4m3(rotate(q) / s),  s = 2^ceil(log2(amax / 448))  (0 if amax == 0).
_quantize_kv_kernel takes each document-local 128-token K or V block of one head (the blocks of
build_schedule's non-causal 128-row list) as one tile: from the same registers it writes the
per-token copies (causal only: the diagonal pairs' bytes and scales, computed as q's) and the V
token norms, then the block copy with the block's scale (pow2 of the block's amax over its tokens,
one head, as reference.quantize_token_blocks; broadcast to its tokens) and the block copy's V norms;
a kernel of its own, so that it runs at its own warps (config.QuantizeConfig). _kvblock_cols_kernel
writes the K-major V copies (block and, causal, token: the forward's PV GEMM reduces over tokens,
flamia.ops.kmajor) in its padded column layout, the scales in the same columns (scale_cols, for the
Gluon forward's TMA) and, per K/V block, the visible maxima vcap and vnorm (reference._visible_max).

On sm_90 at D=64 / 128, q and K / V run as Gluon kernels instead (_quantize_q_gluon,
_quantize_kv_gluon; config.QuantizeConfig's q_gluon_* and kv_gluon_warps): a token per 1-4
adjacent lanes, the rotation as numerics.fwht's butterflies in registers and shuffles across the
token's lanes (no +-1 matrix); the same outputs as the Triton kernels (V's K-major copies stay
with _kvblock_cols_kernel: made from the K / V kernel's registers they cost more than the re-read).

Numerics follow flamia.reference exactly: the rotation is (x @ sign(H)) * (1/sqrt(D)) with x in its
own 16-bit dtype and the ±1 Hadamard signs, so every product is exact and only the fp32 summation
order differs from the reference's fp32 `x @ H` (an fp32 ulp, which changes an e4m3 value only when
it sits on a rounding boundary: a few in a million). Scales are computed with integer exponent
arithmetic on the IEEE quotient amax / 448, which is what quant.pow2_scale computes with log2/ceil.
Non-finite tokens get scale NaN and values x * 0 (NaN where x is not finite), as the reference's
safe_reciprocal gives.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import config, interpreting, is_sm90
from .gluon_common import HAVE_GLUON
from .kmajor import ORDER_MMA_A, check_copy, copy_columns, kmajor_layout
from .launch import launch_kernel
from .layout import KV_BLOCK, QuantizedQKV, new_tensor
from .numerics import fwht_stages, hadamard_signs, pow2_scale_bits
from .schedule import per_cu_seqlens, work_list
from ..recipes import Recipe, get_recipe

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl


@triton.jit
def _load_rows_f32(X, stride_xt, offs_t, tmask, had, rot_scale, D: tl.constexpr,
                   ROTATE: tl.constexpr):
    """Tokens offs_t (rows, masked by tmask: zeros) of one head as fp32, Hadamard-rotated when
    ROTATE (had: the +-1 matrix; exact products, fp32 sums)."""
    offs_d = tl.arange(0, D)
    x = tl.load(X + offs_t.to(tl.int64)[:, None] * stride_xt + offs_d[None, :],
                mask=tmask[:, None], other=0.0)
    if ROTATE:
        xf = tl.dot(x, had) * rot_scale
    else:
        xf = x.to(tl.float32)
    return xf


@triton.jit
def _row_scales(xf):
    """Per row of xf: (scale, 1/scale) of its amax (quant.pow2_scale), the amax and whether
    the row holds a NaN / Inf (a NaN comparison is false; tl.max may drop NaNs)."""
    ax = tl.abs(xf)
    amax = tl.max(ax, axis=1)
    bad = tl.min((ax < float("inf")).to(tl.int32), axis=1) == 0
    scale, inv = pow2_scale_bits(amax, bad)
    return scale, inv, amax, bad


@triton.jit
def _load_had(HAD, rot_scale, D: tl.constexpr, ROTATE: tl.constexpr):
    """The +-1 matrix (D x D, 16-bit) when ROTATE, else a placeholder."""
    offs_d = tl.arange(0, D)
    if ROTATE:
        had = tl.load(HAD + offs_d[:, None] * D + offs_d[None, :])
    else:
        had = rot_scale                          # (unused without the rotation)
    return had


@triton.jit
def _quantize_q_kernel(Q, Q8, SQ, HAD, stride_qt, stride_qh, T, HQ, rot_scale,
                       D: tl.constexpr, BLOCK_T: tl.constexpr, ROTATE: tl.constexpr):
    """BLOCK_T tokens (axis 1) of one q head (axis 0): rotate, scale per token, cast, store."""
    h = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    tmask = offs_t < T
    had = _load_had(HAD, rot_scale, D, ROTATE)
    xf = _load_rows_f32(Q + h * stride_qh, stride_qt, offs_t, tmask, had, rot_scale, D, ROTATE)
    scale, inv, _, _ = _row_scales(xf)
    y = (xf * inv[:, None]).to(tl.float8e4nv)    # RNE, satfinite on sm_90
    tl.store(Q8 + offs_t.to(tl.int64)[:, None] * (HQ * D) + h * D + offs_d[None, :], y,
             mask=tmask[:, None])
    tl.store(SQ + h * T + offs_t, scale, mask=tmask)


@triton.jit
def _quantize_block(X, stride_xt, YB, YT, SB, ST, NB, NT, HAD, rot_scale, lo, hi, HKV,
                    D: tl.constexpr, KVB: tl.constexpr, ROTATE: tl.constexpr,
                    TOKEN_COPY: tl.constexpr, NORMS: tl.constexpr):
    """Tokens [lo, hi) of one head (one document-local block, hi - lo <= KVB) as one tile: the
    per-token copy YT / ST (TOKEN_COPY; q's values) and, from the same registers, the block copy
    YB / SB, and with NORMS the 2-norms over D of the dequantized copies (NT, NB). X, Y*
    ((T, HKV, D)), S*, N* ((T,) rows) point at the head's first token."""
    offs_d = tl.arange(0, D)
    offs_t = lo + tl.arange(0, KVB)
    tmask = offs_t < hi
    had = _load_had(HAD, rot_scale, D, ROTATE)
    xf = _load_rows_f32(X, stride_xt, offs_t, tmask, had, rot_scale, D, ROTATE)
    scale, inv, amax, bad = _row_scales(xf)       # masked rows: zeros, amax 0, not bad
    yoffs = offs_t.to(tl.int64)[:, None] * (HKV * D) + offs_d[None, :]
    if TOKEN_COPY:
        y = (xf * inv[:, None]).to(tl.float8e4nv)
        tl.store(YT + yoffs, y, mask=tmask[:, None])
        tl.store(ST + offs_t, scale, mask=tmask)
        if NORMS:
            yd = y.to(tl.float32) * scale[:, None]
            tl.store(NT + offs_t, tl.sqrt(tl.sum(yd * yd, axis=1)), mask=tmask)
    # pow2 is monotone: the block's scale is also the max of its tokens' scales
    sb, invb = pow2_scale_bits(tl.max(amax, axis=0), tl.max(bad.to(tl.int32), axis=0) != 0)
    y = (xf * invb).to(tl.float8e4nv)
    tl.store(YB + yoffs, y, mask=tmask[:, None])
    tl.store(SB + offs_t, tl.zeros([KVB], tl.float32) + sb, mask=tmask)
    if NORMS:
        yd = y.to(tl.float32) * sb
        tl.store(NB + offs_t, tl.sqrt(tl.sum(yd * yd, axis=1)), mask=tmask)


@triton.jit
def _kv_block_tokens(ITEMS, N_ITEMS, j, KVB: tl.constexpr):
    """(doc, lo, hi) of K/V block j of the work list ITEMS: its tokens [lo, hi); doc < 0: a list
    slot with no block. Also called from the Gluon K / V kernel."""
    doc = tl.load(ITEMS + j)
    blk = tl.load(ITEMS + N_ITEMS + j)
    start = tl.load(ITEMS + 2 * N_ITEMS + j)
    L = tl.load(ITEMS + 3 * N_ITEMS + j)
    return doc, start + blk * KVB, start + tl.minimum((blk + 1) * KVB, L)


@triton.jit(do_not_specialize=["N_ITEMS"])   # (follows cu_seqlens: one build for every split)
def _quantize_kv_kernel(K, V, K8, V8, K8D, V8D, SK, SV, SKD, SVD, NORMS, HAD, ITEMS, N_ITEMS,
                        stride_kt, stride_kh, stride_vt, stride_vh, T, HKV, rot_scale,
                        D: tl.constexpr, KVB: tl.constexpr, ROTATE: tl.constexpr,
                        CAUSAL: tl.constexpr):
    """Axis 0: k heads, then v heads; axis 1: the document-local KVB-token blocks of the work list
    ITEMS (_quantize_block). NORMS (2, HKV, T): the block copy's and token copy's V norms."""
    row = tl.program_id(0)
    doc, lo, hi = _kv_block_tokens(ITEMS, N_ITEMS, tl.program_id(1), KVB)
    if doc >= 0:
        if row < HKV:
            h = row
            _quantize_block(K + h * stride_kh, stride_kt, K8 + h * D, K8D + h * D, SK + h * T,
                            SKD + h * T, NORMS, NORMS, HAD, rot_scale, lo, hi, HKV, D, KVB,
                            ROTATE, CAUSAL, False)
        else:
            h = row - HKV
            _quantize_block(V + h * stride_vh, stride_vt, V8 + h * D, V8D + h * D, SV + h * T,
                            SVD + h * T, NORMS + h * T, NORMS + (HKV + h) * T, HAD, rot_scale,
                            lo, hi, HKV, D, KVB, False, CAUSAL, True)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) with unit stride over D (a copy only when that is not already so)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def _visible_max_block(OFF, DIAG, OUT, start, lo, hi, end, CAUSAL: tl.constexpr,
                       KVB: tl.constexpr, CHUNK: tl.constexpr):
    """reference._visible_max on the rows [lo, hi) of one KVB-token block of the document
    [start, end) of (T,) rows: causal, per row the max of OFF over the document's tokens before the
    block and of DIAG over the block up to the row; otherwise the document's max of OFF. The blocks
    of a document are independent programs: the carry is a max over the tokens before the block in
    CHUNK-wide loads, not a scan through the document."""
    carry = tl.max(tl.zeros([CHUNK], tl.float32), axis=0)        # the quantities are >= 0
    lim = lo if CAUSAL else end
    for t0 in range(start, lim, CHUNK):
        offs = t0 + tl.arange(0, CHUNK)
        carry = tl.maximum(carry, tl.max(tl.load(OFF + offs, mask=offs < lim, other=0.0), axis=0))
    offs = lo + tl.arange(0, KVB)
    m = offs < hi
    if CAUSAL:
        d = tl.load(DIAG + offs, mask=m, other=0.0)
        tl.store(OUT + offs, tl.maximum(tl.associative_scan(d, 0, _max_combine), carry), mask=m)
    else:
        tl.store(OUT + offs, tl.zeros([KVB], tl.float32) + carry, mask=m)


@triton.jit
def _scale_columns(S0, S1, S2, S3, DST, TOK_OF_COL, T, Tp, HKV, h, c0, NS: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """DST[s, h, c] = S_s[h, tok(c)] (0 on pad columns) for the NS (2 or 4) scale vectors, over
    the padded columns [c0, c0 + BLOCK_C)."""
    c = c0 + tl.arange(0, BLOCK_C)
    c_ok = c < Tp
    tok = tl.load(TOK_OF_COL + c, mask=c_ok, other=-1)
    ok = tok >= 0
    src = h * T + tok
    out = DST + h * Tp + c
    plane = HKV * Tp
    tl.store(out, tl.load(S0 + src, mask=ok, other=0.0), mask=c_ok)
    tl.store(out + plane, tl.load(S1 + src, mask=ok, other=0.0), mask=c_ok)
    if NS > 2:
        tl.store(out + 2 * plane, tl.load(S2 + src, mask=ok, other=0.0), mask=c_ok)
        tl.store(out + 3 * plane, tl.load(S3 + src, mask=ok, other=0.0), mask=c_ok)


@triton.jit(do_not_specialize=["N_ITEMS", "N_COL_BLOCKS"])   # (as _quantize_kv_kernel)
def _kvblock_cols_kernel(V8, VT8, V8D, VT8D, SK, SV, SKD, SVD, SCOLS, NORMS, VCAP, VNORM,
                         TOK_OF_COL, ITEMS, N_ITEMS, T, Tp, stride_t, HKV, N_COL_BLOCKS,
                         D: tl.constexpr, BLOCK_C: tl.constexpr,
                         CAUSAL: tl.constexpr, KVB: tl.constexpr, CHUNK: tl.constexpr):
    """After _quantize_kv_kernel, one launch of 3 HKV programs per column block / K/V block i
    (program i * 3 HKV + j, so that the programs running together read every head's bytes of
    the same tokens, whole 128-byte lines at D=64): j < HKV copies the block copy of V into its
    K-major padded copy VT8 and gathers the scales into SCOLS (i: column blocks); HKV <= j < 2 HKV
    copies the token copy (causal); the rest computes vcap and vnorm of the K/V block i of the
    work list ITEMS (_visible_max_block)."""
    pid = tl.program_id(0)
    j = pid % (3 * HKV)
    i = pid // (3 * HKV)
    if j < HKV:
        if i < N_COL_BLOCKS:
            copy_columns(V8, VT8, TOK_OF_COL, Tp, stride_t, j, i * BLOCK_C, D, BLOCK_C,
                         1)   # ORDER_MMA_A
            _scale_columns(SK, SV, SKD, SVD, SCOLS, TOK_OF_COL, T, Tp, HKV, j, i * BLOCK_C,
                           4 if CAUSAL else 2, BLOCK_C)
    elif j < 2 * HKV:
        if CAUSAL:
            if i < N_COL_BLOCKS:
                copy_columns(V8D, VT8D, TOK_OF_COL, Tp, stride_t, j - HKV, i * BLOCK_C, D,
                             BLOCK_C, 1)
    elif i < N_ITEMS:
        if tl.load(ITEMS + i) >= 0:
            h = (j - 2 * HKV).to(tl.int64)
            blk = tl.load(ITEMS + N_ITEMS + i)
            start = tl.load(ITEMS + 2 * N_ITEMS + i)
            end = start + tl.load(ITEMS + 3 * N_ITEMS + i)
            lo = start + blk * KVB
            hi = tl.minimum(lo + KVB, end)
            _visible_max_block(SV + h * T, SVD + h * T, VCAP + h * T, start, lo, hi, end, CAUSAL,
                               KVB, CHUNK)
            _visible_max_block(NORMS + h * T, NORMS + (HKV + h) * T, VNORM + h * T, start, lo, hi,
                               end, CAUSAL, KVB, CHUNK)


if HAVE_GLUON:

    @gluon.jit
    def _rows_f32(X, stride_xt, lo, hi, D: gl.constexpr, BT: gl.constexpr, TPR: gl.constexpr,
                  num_warps: gl.constexpr):
        """Tokens [lo, lo + BT) of one head (zeros from hi on) as fp32, a row per TPR (1, 2 or
        4) adjacent lanes, each holding D / TPR adjacent columns: loaded 16 bytes per thread, moved
        to the rows' threads once through shared memory."""
        LD: gl.constexpr = D // 8
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LD, LD], [num_warps, 1], [1, 0])
        row_l: gl.constexpr = gl.BlockedLayout([1, D // TPR], [32 // TPR, TPR], [num_warps, 1],
                                               [1, 0])
        t = lo + gl.arange(0, BT, layout=gl.SliceLayout(1, ld_l))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_l))
        x = gl.load(X + t.to(gl.int64)[:, None] * stride_xt + d[None, :], mask=(t < hi)[:, None],
                    other=0.0)
        return gl.convert_layout(x, row_l).to(gl.float32)

    @gluon.jit
    def _store_rows8(Y, y, lo, hi, row_stride, D: gl.constexpr, BT: gl.constexpr,
                     num_warps: gl.constexpr):
        """Y[t * row_stride + d] = y (BT, D) fp8 for the tokens t = lo + i < hi, 16 bytes per
        thread."""
        ST: gl.constexpr = D // 16
        st_l: gl.constexpr = gl.BlockedLayout([1, 16], [32 // ST, ST], [num_warps, 1], [1, 0])
        y = gl.convert_layout(y, st_l)
        t = lo + gl.arange(0, BT, layout=gl.SliceLayout(1, st_l))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, st_l))
        gl.store(Y + t.to(gl.int64)[:, None] * row_stride + d[None, :], y,
                 mask=(t < hi)[:, None])

    @gluon.jit
    def _store_per_token(S, v, lo, hi, BT: gl.constexpr, num_warps: gl.constexpr):
        """S[t] = v (a value per row) for the tokens t = lo + i < hi."""
        sc_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        t = lo + gl.arange(0, BT, layout=sc_l)
        gl.store(S + t, gl.convert_layout(v, sc_l), mask=t < hi)

    @gluon.jit
    def _lane_butterfly(x, LO: gl.constexpr, XOR: gl.constexpr):
        """The fwht stage of columns c, c + LO held by lanes l, l ^ XOR: one shuffle per value."""
        if XOR == 1:
            other = gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 1, 0x1f, 0xffffffff;",
                                              "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)
        else:
            other = gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 2, 0x1f, 0xffffffff;",
                                              "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)
        c = gl.arange(0, x.type.shape[1], layout=gl.SliceLayout(0, x.type.layout))
        upper = gl.expand_dims((c & LO) != 0, 0)
        return gl.where(upper, other - x, x + other)

    @gluon.jit
    def _fwht_lanes(x, M: gl.constexpr, D: gl.constexpr, TPR: gl.constexpr):
        """numerics.fwht (the same stages in the same order, so the same fp32 sums) on rows
        split over TPR (1, 2 or 4) adjacent lanes of D / TPR columns each (_rows_f32): the
        stages inside a thread's columns there, the others by butterfly shuffles."""
        H: gl.constexpr = D // TPR
        x = fwht_stages(x, M, D, H)
        if TPR >= 2:
            x = _lane_butterfly(x, H, 1)
        if TPR == 4:
            x = _lane_butterfly(x, 2 * H, 2)
        return x

    @gluon.jit
    def _max_nan(a, b):
        """max that returns NaN where either operand is NaN (a NaN row gets scale NaN)."""
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _rows_amax(X, stride_xt, lo, hi, rot_scale, D: gl.constexpr, BT: gl.constexpr,
                   TPR: gl.constexpr, ROTATE: gl.constexpr, num_warps: gl.constexpr):
        """(_rows_f32's rows, rotated by butterflies when ROTATE, and their amax): the amax a
        NaN-propagating max, so a NaN / inf row is the Triton kernels' `bad` row."""
        xf = _rows_f32(X, stride_xt, lo, hi, D, BT, TPR, num_warps)
        if ROTATE:
            xf = _fwht_lanes(xf, BT, D, TPR) * rot_scale
        return xf, gl.reduce(gl.abs(xf), 1, _max_nan)

    @gluon.jit
    def _token_rows8(xf, amax, Y, S, lo, hi, row_stride, D: gl.constexpr, BT: gl.constexpr,
                     num_warps: gl.constexpr):
        """Per-token scaling of the rows xf (amax: _rows_amax's): the e4m3 rows to Y, the
        scales to S (tokens lo + i < hi); returns (the e4m3 rows, the scales)."""
        scale, inv = pow2_scale_bits(amax, ~(amax < float("inf")))
        y = (xf * gl.expand_dims(inv, 1)).to(gl.float8e4nv)
        _store_rows8(Y, y, lo, hi, row_stride, D, BT, num_warps)
        _store_per_token(S, scale, lo, hi, BT, num_warps)
        return y, scale

    @gluon.jit
    def _norms_rows(y, s):
        """2-norms over D of the dequantized rows y * s (over the row's lanes)."""
        yd = y.to(gl.float32) * s
        return gl.sqrt(gl.sum(yd * yd, axis=1))

    @gluon.jit
    def _quantize_block_gluon(X, stride_xt, YB, YT, SB, ST, NB, NT, rot_scale, lo, hi, HKV,
                              D: gl.constexpr, KVB: gl.constexpr, ROTATE: gl.constexpr,
                              TOKEN_COPY: gl.constexpr, NORMS: gl.constexpr,
                              num_warps: gl.constexpr):
        """_quantize_block with a token per 32 num_warps / KVB adjacent lanes: K rotated by
        butterflies (no +-1 matrix), the row amax a NaN-propagating max (a NaN / inf row is the
        Triton kernel's `bad` row); the same outputs (the copies' rows, scales, V's norms; V's
        K-major copies stay with _kvblock_cols_kernel)."""
        TPR: gl.constexpr = 32 * num_warps // KVB
        xf, amax = _rows_amax(X, stride_xt, lo, hi, rot_scale, D, KVB, TPR, ROTATE, num_warps)
        bad = ~(amax < float("inf"))
        row_stride = HKV * D
        if TOKEN_COPY:
            yt, scale = _token_rows8(xf, amax, YT, ST, lo, hi, row_stride, D, KVB, num_warps)
            if NORMS:
                _store_per_token(NT, _norms_rows(yt, gl.expand_dims(scale, 1)), lo, hi, KVB,
                                 num_warps)
        # pow2 is monotone: the block's scale is also the max of its tokens' scales
        sb, invb = pow2_scale_bits(gl.max(amax, axis=0), gl.max(bad.to(gl.int32), axis=0) != 0)
        yb = (xf * invb).to(gl.float8e4nv)
        _store_rows8(YB, yb, lo, hi, row_stride, D, KVB, num_warps)
        _store_per_token(SB, gl.zeros_like(amax) + sb, lo, hi, KVB, num_warps)
        if NORMS:
            _store_per_token(NB, _norms_rows(yb, sb), lo, hi, KVB, num_warps)

    @gluon.jit(do_not_specialize=["N_ITEMS"])
    def _quantize_kv_gluon(K, V, K8, V8, K8D, V8D, SK, SV, SKD, SVD, NORMS, ITEMS, N_ITEMS,
                           stride_kt, stride_kh, stride_vt, stride_vh, T, HKV, rot_scale,
                           D: gl.constexpr, KVB: gl.constexpr, ROTATE: gl.constexpr,
                           CAUSAL: gl.constexpr, num_warps: gl.constexpr):
        """_quantize_kv_kernel's grid and outputs by _quantize_block_gluon."""
        row = gl.program_id(0)
        doc, lo, hi = _kv_block_tokens(ITEMS, N_ITEMS, gl.program_id(1), KVB)
        if doc >= 0:
            if row < HKV:
                h = row
                _quantize_block_gluon(K + h * stride_kh, stride_kt, K8 + h * D, K8D + h * D,
                                      SK + h * T, SKD + h * T, NORMS, NORMS, rot_scale, lo, hi,
                                      HKV, D, KVB, ROTATE, CAUSAL, False, num_warps)
            else:
                h = row - HKV
                _quantize_block_gluon(V + h * stride_vh, stride_vt, V8 + h * D, V8D + h * D,
                                      SV + h * T, SVD + h * T, NORMS + h * T,
                                      NORMS + (HKV + h) * T, rot_scale, lo, hi, HKV, D, KVB,
                                      False, CAUSAL, True, num_warps)

    @gluon.jit
    def _quantize_q_gluon(Q, Q8, SQ, stride_qt, stride_qh, T, HQ, rot_scale,
                          D: gl.constexpr, TPR: gl.constexpr, ROTATE: gl.constexpr,
                          num_warps: gl.constexpr):
        """_quantize_q_kernel with a token per TPR (1, 2 or 4) adjacent lanes (32 num_warps /
        TPR tokens of one head per program): the rows are loaded 16 bytes per thread and moved
        to their lanes once through shared memory, rotated there by butterflies (in the thread,
        then by shuffles across the row's lanes; no +-1 matrix), their amax a NaN-propagating
        max (NaN / inf rows are the Triton kernel's `bad` rows), then stored 16 bytes per
        thread."""
        BT: gl.constexpr = 32 * num_warps // TPR
        h = gl.program_id(0)
        t0 = gl.program_id(1) * BT
        xf, amax = _rows_amax(Q + h * stride_qh, stride_qt, t0, T, rot_scale, D, BT, TPR, ROTATE,
                              num_warps)
        _token_rows8(xf, amax, Q8 + h * D, SQ + h * T, t0, T, HQ * D, D, BT, num_warps)


def quantize_qkv(q, k, v, cu_seqlens, recipe, causal, *,
                 launch: config.QuantizeConfig | None = None,
                 poison: bool = False) -> QuantizedQKV:
    """Quantize packed q (T, Hq, D), k, v (T, Hkv, D) as `recipe` says -> QuantizedQKV.

    fp8 (token-block scaling, module docstring): the fields of layout.QuantizedQKV, vt8 and vt8_diag
    in wgmma key order (flamia.ops.kmajor), which both forward kernels read. bf16: the inputs
    themselves (fp16 rounded to bf16 as the reference does), no scales. launch: the kernels' tiles
    and warps (config.quantize_config(D) by default; the values do not depend on it). poison=True
    fills outputs with NaN first (tests: every element written)."""
    rec: Recipe = get_recipe(recipe)
    if rec.name == "bf16":
        q8, k8, v8 = (x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16) for x in (q, k, v))
        return QuantizedQKV("bf16", q8, k8, v8, None, None, None, None, rotated=False, vt8=None)
    if rec.name != "fp8":
        raise ValueError(f"quantize_qkv implements fp8 and bf16, not {rec.name!r}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"q, k, v must be bf16 or fp16, got {q.dtype}")
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"head dim {D} not supported by the quantize kernel")
    q, k, v = _rows_view(q), _rows_view(k), _rows_view(v)
    launch = launch or config.quantize_config(D)
    fill = functools.partial(new_tensor, device=q.device, fill=float("nan") if poison else None)
    dev = q.device
    f8, f32 = torch.float8_e4m3fn, torch.float32
    pcu, tok_of_col, Tp = per_cu_seqlens(cu_seqlens, ("kmajor", T),
                                         lambda: kmajor_layout(cu_seqlens, T))
    q8, k8, v8 = fill((T, Hq, D), f8), fill((T, Hkv, D), f8), fill((T, Hkv, D), f8)
    sq, sk, sv = fill((Hq, T), f32), fill((Hkv, T), f32), fill((Hkv, T), f32)
    vcap, vnorm = fill((Hkv, T), f32), fill((Hkv, T), f32)
    vt8 = fill((Hkv, D, Tp), f8)
    scale_cols = fill((4 if causal else 2, Hkv, Tp), f32)
    norms = torch.empty((2, Hkv, T), dtype=f32, device=dev)   # block copy's, token copy's
    k8d, v8d, skd, svd, vt8d = (
        fill((T, Hkv, D), f8), fill((T, Hkv, D), f8), fill((Hkv, T), f32), fill((Hkv, T), f32),
        fill((Hkv, D, Tp), f8)) if causal else (None,) * 5
    out = QuantizedQKV(rec.name, q8, k8, v8, sq, sk, sv, vcap, rotated=bool(rec.rotate_qk),
                       vt8=vt8, k8_diag=k8d, v8_diag=v8d,
                       sk_diag=skd, sv_diag=svd, vnorm=vnorm, kv_pcu=pcu,
                       vt8_diag=vt8d, scale_cols=scale_cols)
    if T == 0:
        return out
    rotate = bool(rec.rotate_qk)
    had = hadamard_signs(D, q.dtype, dev) if rotate else q
    items = work_list(cu_seqlens, T, KV_BLOCK, KV_BLOCK, False)    # the K/V blocks
    n_items = items.shape[1]
    # non-causal: the token-copy pointers are placeholders of the right type (never written)
    k8d_, v8d_, skd_, svd_ = (k8d, v8d, skd, svd) if causal else (k8, v8, sk, sv)
    rot_scale = 1.0 / math.sqrt(D)
    # q, K / V: the Gluon kernels at the attention kernels' head dims on sm_90, Triton's elsewhere
    gluon_ok = D in (64, 128) and HAVE_GLUON and not interpreting() and is_sm90(dev)
    if gluon_ok:
        q_rows = 32 * launch.q_gluon_warps // launch.q_gluon_tpr
        launch_kernel(_quantize_q_gluon, (Hq, triton.cdiv(T, q_rows)),
            q, q8, sq, q.stride(0), q.stride(1), T, Hq, rot_scale, D=D, TPR=launch.q_gluon_tpr,
            ROTATE=rotate, num_warps=launch.q_gluon_warps)
    else:
        launch_kernel(_quantize_q_kernel, (Hq, triton.cdiv(T, launch.block_t)),
            q, q8, sq, had, q.stride(0), q.stride(1), T, Hq, rot_scale, D=D,
            BLOCK_T=launch.block_t, ROTATE=rotate, num_warps=launch.q_warps)
    if gluon_ok:
        launch_kernel(_quantize_kv_gluon, (2 * Hkv, n_items),
            k, v, k8, v8, k8d_, v8d_, sk, sv, skd_, svd_, norms, items, n_items, k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), T, Hkv, rot_scale, D=D, KVB=KV_BLOCK,
            ROTATE=rotate, CAUSAL=bool(causal), num_warps=launch.kv_gluon_warps)
    else:
        launch_kernel(_quantize_kv_kernel, (2 * Hkv, n_items),
            k, v, k8, v8, k8d_, v8d_, sk, sv, skd_, svd_, norms, had, items, n_items,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), T, Hkv, rot_scale, D=D,
            KVB=KV_BLOCK, ROTATE=rotate, CAUSAL=bool(causal), num_warps=launch.kv_warps)
    check_copy(v8, vt8, ORDER_MMA_A)
    block_c = launch.cols_block
    n_cols = triton.cdiv(Tp, block_c)
    launch_kernel(_kvblock_cols_kernel, (max(n_cols, n_items) * 3 * Hkv,),
        v8.view(torch.uint8), vt8.view(torch.uint8), v8d_.view(torch.uint8),
        (vt8d if causal else vt8).view(torch.uint8), sk, sv, skd_, svd_, scale_cols, norms, vcap,
        vnorm, tok_of_col, items, n_items, T, Tp, v8.stride(0), Hkv, n_cols, D=D,
        BLOCK_C=block_c, CAUSAL=bool(causal), KVB=KV_BLOCK,
        CHUNK=KV_BLOCK if interpreting() else 2048, num_warps=launch.cols_warps)
    return out
