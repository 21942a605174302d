"""Quantize q, k, v once for every GEMM of forward and backward: the fp8 recipe's token-block
scaling (reference.py "Token-block scaling"; ops/__init__.py and layout.QuantizedQKV have the
layout).

Two launches. The first (_quantize_kvblock_kernel) quantizes q per (token, head):
  q8 = e4m3(rotate(q) / s),  s = 2^ceil(log2(amax / 448))  (0 if amax == 0)
and walks K and V one document-local 128-token block per program (the blocks of
build_schedule's non-causal 128-row list): it writes the per-token copies (causal only: the
diagonal pairs' bytes and scales, computed as q's) and the V token norms while it takes the
block's amax, then re-reads the block and writes the block copy with the block's scale
(broadcast to its tokens) and the block copy's V norms. The block scale is pow2(max amax) over
the block's tokens and heads' values, as reference.quantize_token_blocks. The second
(_kvblock_cols_kernel) writes the K-major V copies (block and, causal, token; Hopper's FP8 wgmma
takes its B operand K-major only, and the forward's PV GEMM reduces over tokens) in kmajor's
padded column layout, the scales in the same columns (scale_cols, for the Gluon forward's TMA)
and, per K/V block, the visible maxima vcap and vnorm (reference._visible_max).

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
from .kmajor import check_copy, copy_columns, kmajor_layout
from .layout import KV_BLOCK, QuantizedQKV
from .numerics import hadamard_signs, pow2_scale_bits
from .schedule import per_cu_seqlens, work_list
from ..recipes import Recipe, get_recipe

if interpreting():
    from . import interpreter
    interpreter.install()

E4M3_MAX = 448.0


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
def _quantize_rows(X, stride_xt, Y, stride_yt, S, HAD, rot_scale, T, t_base,
                   D: tl.constexpr, BLOCK_T: tl.constexpr, SUB: tl.constexpr,
                   ROTATE: tl.constexpr):
    """SUB consecutive blocks of BLOCK_T tokens of one head: (rotate), scale, cast, store."""
    offs_d = tl.arange(0, D)
    if ROTATE:
        # Loaded once per program and reused for SUB token blocks (it is D*D*2 bytes of L2 traffic).
        had = tl.load(HAD + offs_d[:, None] * D + offs_d[None, :])
    else:
        had = rot_scale                          # (unused without the rotation)
    for i in tl.static_range(SUB):
        offs_t = t_base + i * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = offs_t < T
        rows = offs_t.to(tl.int64)
        xf = _load_rows_f32(X, stride_xt, offs_t, tmask, had, rot_scale, D, ROTATE)
        ax = tl.abs(xf)
        amax = tl.max(ax, axis=1)
        # NaN/Inf anywhere in the row (a NaN comparison is false); tl.max may drop NaNs.
        bad = tl.min((ax < float("inf")).to(tl.int32), axis=1) == 0
        scale, inv = pow2_scale_bits(amax, bad)
        y = (xf * inv[:, None]).to(tl.float8e4nv)    # RNE, satfinite on sm_90
        tl.store(Y + rows[:, None] * stride_yt + offs_d[None, :], y, mask=tmask[:, None])
        tl.store(S + offs_t, scale, mask=tmask)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) with unit stride over D (a copy only when that is not already so)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def _quantize_block(X, stride_xt, YB, YT, stride_yt, SB, ST, NB, NT, HAD, rot_scale, lo, hi,
                    D: tl.constexpr, BLOCK_T: tl.constexpr, KVB: tl.constexpr,
                    ROTATE: tl.constexpr, TOKEN_COPY: tl.constexpr, NORMS: tl.constexpr):
    """Tokens [lo, hi) of one head (one document-local block, hi - lo <= KVB): the per-token
    copy YT / ST (TOKEN_COPY; _quantize_rows' values) and the block copy YB / SB, and with
    NORMS the 2-norms over D of the dequantized copies (NT, NB). X, Y*, S*, N* point at the
    head's first token (S*, N*: (T,) rows)."""
    offs_d = tl.arange(0, D)
    if ROTATE:
        had = tl.load(HAD + offs_d[:, None] * D + offs_d[None, :])
    else:
        had = rot_scale                          # (unused without the rotation)
    blk_amax = tl.max(tl.zeros([BLOCK_T], tl.float32), axis=0)
    blk_bad = tl.max(tl.zeros([BLOCK_T], tl.int32), axis=0)
    for i in tl.static_range(KVB // BLOCK_T):
        offs_t = lo + i * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = offs_t < hi
        rows = offs_t.to(tl.int64)
        xf = _load_rows_f32(X, stride_xt, offs_t, tmask, had, rot_scale, D, ROTATE)
        ax = tl.abs(xf)
        amax = tl.max(ax, axis=1)
        bad = tl.min((ax < float("inf")).to(tl.int32), axis=1) == 0
        if TOKEN_COPY:
            scale, inv = pow2_scale_bits(amax, bad)
            y = (xf * inv[:, None]).to(tl.float8e4nv)
            tl.store(YT + rows[:, None] * stride_yt + offs_d[None, :], y, mask=tmask[:, None])
            tl.store(ST + offs_t, scale, mask=tmask)
            if NORMS:
                yd = y.to(tl.float32) * scale[:, None]
                tl.store(NT + offs_t, tl.sqrt(tl.sum(yd * yd, axis=1)), mask=tmask)
        # masked rows loaded as zeros: amax 0, not bad
        blk_amax = tl.maximum(blk_amax, tl.max(amax, axis=0))
        blk_bad = tl.maximum(blk_bad, tl.max(bad.to(tl.int32), axis=0))
    # pow2 is monotone: the block's scale is also the max of its tokens' scales
    sb, invb = pow2_scale_bits(blk_amax, blk_bad != 0)
    for i in tl.static_range(KVB // BLOCK_T):
        offs_t = lo + i * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = offs_t < hi
        rows = offs_t.to(tl.int64)
        xf = _load_rows_f32(X, stride_xt, offs_t, tmask, had, rot_scale, D, ROTATE)
        y = (xf * invb).to(tl.float8e4nv)
        tl.store(YB + rows[:, None] * stride_yt + offs_d[None, :], y, mask=tmask[:, None])
        tl.store(SB + offs_t, tl.zeros([BLOCK_T], tl.float32) + sb, mask=tmask)
        if NORMS:
            yd = y.to(tl.float32) * sb
            tl.store(NB + offs_t, tl.sqrt(tl.sum(yd * yd, axis=1)), mask=tmask)


@triton.jit
def _quantize_kvblock_kernel(Q, K, V, Q8, K8, V8, K8D, V8D, SQ, SK, SV, SKD, SVD, NORMS, HAD,
                             ITEMS, N_ITEMS, stride_qt, stride_qh, stride_kt, stride_kh,
                             stride_vt, stride_vh, T, HQ, HKV, rot_scale,
                             D: tl.constexpr, BLOCK_T: tl.constexpr, SUB: tl.constexpr,
                             KVB: tl.constexpr, ROTATE: tl.constexpr, CAUSAL: tl.constexpr):
    """Axis 0: q heads (token chunks of BLOCK_T * SUB along axis 1, _quantize_rows), then k
    heads, then v heads (axis 1: the document-local KVB-token blocks of the work list ITEMS,
    _quantize_block). NORMS (2, HKV, T): the block copy's and the token copy's V norms."""
    row = tl.program_id(0)
    j = tl.program_id(1)
    if row < HQ:
        t_base = j * (BLOCK_T * SUB)
        if t_base < T:
            _quantize_rows(Q + row * stride_qh, stride_qt, Q8 + row * D, HQ * D, SQ + row * T,
                           HAD, rot_scale, T, t_base, D, BLOCK_T, SUB, ROTATE)
    elif j < N_ITEMS:
        doc = tl.load(ITEMS + j)
        if doc >= 0:
            blk = tl.load(ITEMS + N_ITEMS + j)
            start = tl.load(ITEMS + 2 * N_ITEMS + j)
            L = tl.load(ITEMS + 3 * N_ITEMS + j)
            lo = start + blk * KVB
            hi = start + tl.minimum((blk + 1) * KVB, L)
            if row < HQ + HKV:
                h = row - HQ
                _quantize_block(K + h * stride_kh, stride_kt, K8 + h * D, K8D + h * D, HKV * D,
                                SK + h * T, SKD + h * T, NORMS, NORMS, HAD, rot_scale, lo, hi,
                                D, BLOCK_T, KVB, ROTATE, CAUSAL, False)
            else:
                h = row - HQ - HKV
                _quantize_block(V + h * stride_vh, stride_vt, V8 + h * D, V8D + h * D, HKV * D,
                                SV + h * T, SVD + h * T, NORMS + h * T, NORMS + (HKV + h) * T,
                                HAD, rot_scale, lo, hi, D, BLOCK_T, KVB, False, CAUSAL, True)


@triton.jit
def _visible_max_block(OFF, DIAG, OUT, start, lo, hi, end, CAUSAL: tl.constexpr,
                       KVB: tl.constexpr, CHUNK: tl.constexpr):
    """reference._visible_max on the rows [lo, hi) of one KVB-token block of the document
    [start, end) of (T,) rows: causal, per row the max of OFF over the document's tokens before
    the block and of DIAG over the block up to the row; otherwise the document's max of OFF.
    The blocks of a document are independent programs: the carry is a max over the tokens
    before the block in CHUNK-wide loads, not a scan through the document."""
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
def _scale_columns(S0, S1, S2, S3, DST, TOK_OF_COL, T, Tp, HKV, h, NS: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """DST[s, h, c] = S_s[h, tok(c)] (0 on pad columns) for the NS (2 or 4) scale vectors, over
    the padded columns of program_id(0)'s block."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
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


@triton.jit
def _kvblock_cols_kernel(V8, VT8, V8D, VT8D, SK, SV, SKD, SVD, SCOLS, NORMS, VCAP, VNORM,
                         TOK_OF_COL, ITEMS, N_ITEMS, T, Tp, stride_t, HKV, N_COL_BLOCKS,
                         D: tl.constexpr, BLOCK_C: tl.constexpr, MMA_ORDER: tl.constexpr,
                         CAUSAL: tl.constexpr, KVB: tl.constexpr, CHUNK: tl.constexpr):
    """After _quantize_kvblock_kernel, one launch: grid axis 1 < HKV copies the block copy of V
    into its K-major padded copy VT8 and gathers the scales into SCOLS (axis 0: column blocks);
    HKV <= axis 1 < 2 HKV copies the token copy (causal); the rest computes vcap and vnorm of
    the K/V block axis 0 of the work list ITEMS (_visible_max_block)."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    if j < HKV:
        if i < N_COL_BLOCKS:
            copy_columns(V8, VT8, TOK_OF_COL, T, Tp, stride_t, j, D, BLOCK_C, False, MMA_ORDER)
            _scale_columns(SK, SV, SKD, SVD, SCOLS, TOK_OF_COL, T, Tp, HKV, j,
                           4 if CAUSAL else 2, BLOCK_C)
    elif j < 2 * HKV:
        if CAUSAL:
            if i < N_COL_BLOCKS:
                copy_columns(V8D, VT8D, TOK_OF_COL, T, Tp, stride_t, j - HKV, D, BLOCK_C, False,
                             MMA_ORDER)
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


def quantize_qkv(q, k, v, cu_seqlens, recipe, causal, *, vt_mma_order: bool | None = None,
                 block_t: int | None = None, sub: int | None = None,
                 num_warps: int | None = None, poison: bool = False) -> QuantizedQKV:
    """Quantize packed q (T, Hq, D), k, v (T, Hkv, D) as `recipe` says -> QuantizedQKV.

    fp8 (token-block scaling, module docstring): q rotated, per-(token, head) e4m3 values and
    fp32 power-of-two scales; k8 / v8 / sk / sv the block copies (a scale per document-local
    128-token block and head, broadcast to its tokens); causal, the per-token copies k8_diag /
    v8_diag / sk_diag / sv_diag; vcap and vnorm the visible maxima (reference._visible_max);
    vt8 (and vt8_diag) in kmajor's padded column layout (kv_pcu), scale_cols the scales in
    those columns. vt8's columns are in wgmma key order within 16-token groups
    (flamia.ops.kmajor) or in token order (vt_mma_order=False); None: the order of the forward
    kernel this device runs (config.vt_mma_order). bf16: the inputs themselves (bf16; fp16
    inputs are rounded to bf16 as the reference does), no scales. block_t / sub / num_warps:
    launch tiling of the q rows (tokens per block dividing 128, blocks per program; the values
    do not depend on them). poison=True fills outputs with NaN first (tests: every element
    written).
    """
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
    if vt_mma_order is None:
        vt_mma_order = config.vt_mma_order(D, rec.name, q.device)
    launch = config.quantize_config()
    block_t = launch.block_t if block_t is None else block_t
    sub = launch.sub if sub is None else sub
    num_warps = launch.num_warps if num_warps is None else num_warps
    fill = (lambda shape, dt: torch.full(shape, float("nan"), dtype=dt, device=q.device)) \
        if poison else (lambda shape, dt: torch.empty(shape, dtype=dt, device=q.device))
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
    if causal:
        k8d, v8d = fill((T, Hkv, D), f8), fill((T, Hkv, D), f8)
        skd, svd = fill((Hkv, T), f32), fill((Hkv, T), f32)
        vt8d = fill((Hkv, D, Tp), f8)
    else:
        k8d = v8d = skd = svd = vt8d = None
    out = QuantizedQKV(rec.name, q8, k8, v8, sq, sk, sv, vcap, rotated=bool(rec.rotate_qk),
                       vt8=vt8, vt8_mma_order=bool(vt_mma_order), k8_diag=k8d, v8_diag=v8d,
                       sk_diag=skd, sv_diag=svd, vnorm=vnorm, kv_pcu=pcu,
                       vt8_diag=vt8d, scale_cols=scale_cols)
    if T == 0:
        return out
    rotate = bool(rec.rotate_qk)
    had = hadamard_signs(D, q.dtype, dev) if rotate else q
    if KV_BLOCK % block_t:
        raise ValueError(f"block_t={block_t} must divide the K/V block of {KV_BLOCK} tokens")
    items = work_list(cu_seqlens, T, KV_BLOCK, KV_BLOCK, False).items    # the K/V blocks
    n_items = items.shape[1]
    # non-causal: the token-copy pointers are placeholders of the right type (never written)
    k8d_, v8d_, skd_, svd_ = (k8d, v8d, skd, svd) if causal else (k8, v8, sk, sv)
    grid = (Hq + 2 * Hkv, max(triton.cdiv(T, block_t * sub), n_items))
    _quantize_kvblock_kernel[grid](
        q, k, v, q8, k8, v8, k8d_, v8d_, sq, sk, sv, skd_, svd_, norms, had, items, n_items,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        T, Hq, Hkv, 1.0 / math.sqrt(D),
        D=D, BLOCK_T=block_t, SUB=sub, KVB=KV_BLOCK, ROTATE=rotate, CAUSAL=bool(causal),
        num_warps=num_warps)
    check_copy(v8, vt8, vt_mma_order)
    block_c = 64
    n_cols = triton.cdiv(Tp, block_c)
    _kvblock_cols_kernel[(max(n_cols, n_items), 3 * Hkv)](
        v8.view(torch.uint8), vt8.view(torch.uint8), v8d_.view(torch.uint8),
        (vt8d if causal else vt8).view(torch.uint8), sk, sv, skd_, svd_, scale_cols, norms, vcap,
        vnorm, tok_of_col, items, n_items, T, Tp, v8.stride(0), Hkv, n_cols, D=D,
        BLOCK_C=block_c, MMA_ORDER=bool(vt_mma_order), CAUSAL=bool(causal), KVB=KV_BLOCK,
        CHUNK=KV_BLOCK if interpreting() else 2048, num_warps=4)
    return out
