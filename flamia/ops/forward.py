"""FlashAttention-style forward over packed documents on the quantized operands (QuantizedQKV).

Per (query head, work item = one query block of one document) the program keeps its Q tile and
walks the KV tiles of its document only: first the tiles entirely left of the diagonal without
any mask, then the diagonal / document-end tiles with the mask. Fully masked tiles are never
visited and no tile crosses into another document's rows unmasked.

FP8 numerics (flamia/reference.py, "Token-block scaling"): with scores S_ij = sq_i sk_j
(q8_i . k8_j) * scale, sk_j / sv_j the scales of the pair's K / V copy,
    x_ij = dot(q8, k8^T)_ij * sk_j * (sq_i * scale * log2 e)          (log2 units)
    p'_ij = exp2(x_ij - m_i + lr_i),  lr_i = log2(256 / cap_i)           (= p_ij * 256 / cap_i)
    A_ij  = e4m3(p'_ij * sv_j)                                          (= p_ij sv_j/cap_i 256)
    acc_i = sum_j A_ij v8_j,   l'_i = sum_j p'_ij,   O_i = acc_i / l'_i
cap_i = vcap (the visible max of the pairs' V scales). Folding 256/cap_i into the exponent costs
nothing per element (it shifts the row's max), and it cancels in acc / l'. With the online max the
rounding of A happens at the running max instead of the final one (rescaled by alpha afterwards), as
in every FlashAttention FP8 kernel: the result matches the reference emulation by the FlashAttention
rule, not bitwise. lr_i is capped at 100 so l' cannot overflow; that only matters for V whose amax
is below ~1e-26 (cap < 2^-92).
The key-tile grid sits at document-local multiples of BLOCK_N (BLOCK_M and BLOCK_N divide the
128-token K/V block): the tiles of the query block's own 128-block (causal) read the per-token
copies k8_diag / vt8_diag with their per-token scales, every other tile the block copies k8 / vt8
(one K and one V scale per tile, folded into per-row constants: _attn_inner's TILE_SCALES). vt8 is
in kmajor's padded column layout (document d from column kv_pcu[d], a multiple of 16), so every
tile's V^T box starts at a 16-aligned column; K tiles are read at any token row. return_row_max also
stores the row max m (natural log), which the backward's bound needs (Saved.row_max).

bf16 recipe: the same kernel with bf16 operands, no scales, P rounded to bf16; its KV tiles
start at absolute token rows that are multiples of 16 (a head tile, masked, may hold keys of
the previous document).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from .config import FWD_KV_CHUNK, FwdConfig, PersistentFwdConfig, forward_config
from .kmajor import mma_key_order, mma_order16
from .launch import launch_kernel
from .layout import QuantizedQKV, check_kvblock_tiles, new_tensor
from .numerics import LOG2E, log2_pow2
from .schedule import work_list


@triton.jit
def _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, vcol0, kvh, lo, hi,
                K, V, SK, SV, stride_kt, stride_vn, stride_vd,
                D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                MASKED: tl.constexpr, FP8: tl.constexpr, USE_TMA: tl.constexpr,
                FOLD_LR: tl.constexpr, LOOP_STAGES: tl.constexpr, K_ALIGNED: tl.constexpr,
                TILE_SCALES: tl.constexpr = False):
    """KV tiles [lo, hi) of the document (doc-local token indices); MASKED: diagonal/end tiles. FP8
    reads V from the K-major copy vt8, whose column vcol0 + n holds the document's key n (vcol0 + lo
    a multiple of 16), in wgmma key order: row p of a V tile is key mma_order16(p) of the tile, and
    P is passed to the PV wgmma in that key order too. K_ALIGNED: tok0 + lo is a multiple of 16 too
    (the token-block grid starts tiles at document-local offsets). TILE_SCALES (unmasked tiles of
    the block copies): one power-of-two sk and sv per tile, read once; s * sk joins the row factor
    (exactly) and sv the exponent's per-row constant (forward_gluon._online_softmax_block)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if FP8:
        offs_v0 = mma_order16(offs_n0)      # the key of each V row
    else:
        offs_v0 = offs_n0
    # TILE_SCALES: each tile's sk and sv load one tile ahead into registers (two LDGs); loaded
    # in the tile, the loop's pipeline would stage them through shared memory (cp.async, a
    # bar.sync per tile)
    sk_t = tl.load(SK + lo, mask=TILE_SCALES & (lo < hi), other=1.0)
    sv_t = tl.load(SV + lo, mask=TILE_SCALES & (lo < hi), other=1.0)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=LOOP_STAGES):
        if TILE_SCALES:
            nxt = tl.minimum(start_n + BLOCK_N, hi - BLOCK_N)
            sk_n = tl.load(SK + nxt)
            sv_n = tl.load(SV + nxt)
        else:
            sk_n = sk_t
            sv_n = sv_t
        offs_n = start_n + offs_n0
        col_ok = (offs_n >= 0) & (offs_n < L)
        vrow0 = tl.multiple_of((vcol0 + start_n).to(tl.int32), 16)   # vt8 column, 16-aligned
        if K_ALIGNED:
            krow0 = tl.multiple_of((tok0 + start_n).to(tl.int32), 16)
        else:
            krow0 = (tok0 + start_n).to(tl.int32)
        # ---- S = Q K^T (fp32 accumulate) ----
        if USE_TMA:
            kt = K.load([krow0, kvh * D]).T
        else:
            k_ptrs = K + (tok0 + offs_n)[None, :] * stride_kt + kvh * D + offs_d[:, None]
            if MASKED:
                kt = tl.load(k_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                kt = tl.load(k_ptrs)
        s = tl.dot(q, kt)
        if TILE_SCALES:
            rf = row_f * sk_t
            # sv joins the exponent's per-row constant (e = lr + log2 sv, floored at -90; log2 of
            # the power of two from its exponent bits)
            e = lr + log2_pow2(sv_t)
            e = tl.where(e < -90.0, -90.0, e)             # (a NaN e stays NaN)
        else:
            rf = row_f
            e = lr
        if FP8 and not TILE_SCALES:
            if MASKED:
                sk = tl.load(SK + offs_n, mask=col_ok, other=0.0)
            else:
                sk = tl.load(SK + offs_n)
            s = s * sk[None, :]
        # ---- online softmax in log2 units; the row's lr rides on the subtracted max ----
        if MASKED:
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= offs_n[None, :])
            x = tl.where(valid, s * row_f[:, None], float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, 1))
            if FOLD_LR:
                p = tl.math.exp2(x - (m_new - lr)[:, None])
            else:
                p = tl.math.exp2((x - m_new[:, None]) + lr[:, None])   # lr survives a huge max
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * rf)        # rf >= 0
            if FOLD_LR:
                p = tl.math.exp2(s * rf[:, None] - (m_new - e)[:, None])
            else:
                p = tl.math.exp2((s * rf[:, None] - m_new[:, None]) + e[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        if TILE_SCALES:     # p is p' sv
            l_i = l_i * alpha + tl.sum(p, 1) * tl.math.exp2(lr - e)
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        # ---- O += P V ----
        if USE_TMA and FP8 and not MASKED:
            # V's wait ahead of P's conversion: with no wait loop between them, ptxas packs each
            # A register with two F2FP.MERGE_C instead of two F2FP and a PRMT
            v_early = V.load([kvh * D, vrow0]).T
        if TILE_SCALES:
            a = mma_key_order(p.to(tl.float8e4nv))           # RNE
        elif FP8:
            if MASKED:
                sv = tl.load(SV + offs_n, mask=col_ok, other=0.0)
            else:
                sv = tl.load(SV + offs_n)
            a = (p * sv[None, :]).to(tl.float8e4nv)          # sv_j / cap_i * 256 folded, RNE
            # A's column p = P's column mma_order16(p), each value in its thread (kmajor)
            a = mma_key_order(a)
        else:
            a = p.to(tl.bfloat16)
        offs_v = start_n + offs_v0
        v_ok = (offs_v >= 0) & (offs_v < L)
        if USE_TMA:
            if FP8 and not MASKED:
                v = v_early
            elif FP8:
                v = V.load([kvh * D, vrow0]).T
            else:
                v = V.load([krow0, kvh * D])
            if MASKED:   # rows past the document end belong to the next one: never let a NaN in
                v = tl.where(v_ok[:, None], v, 0.0)
        else:
            v_ptrs = V + (vcol0 + offs_n)[:, None] * stride_vn + offs_d[None, :] * stride_vd
            if MASKED:
                v = tl.load(v_ptrs, mask=v_ok[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs)
        acc = tl.dot(a, v, acc)
        m_i = m_new
        sk_t = sk_n
        sv_t = sv_n
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(Q, K, V, SQ, SK, SV, VCAP, O, LSE, ITEMS, CU, KD, VD, SKD, SVD, PCU, RMAX,
                     stride_qt, stride_kt, stride_vn, stride_vd, stride_vh, stride_ot, stride_oh,
                     T, N_ITEMS, HQ, GROUP, qk_scale,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, FP8: tl.constexpr, USE_TMA: tl.constexpr,
                     FOLD_LR: tl.constexpr, FULL_STAGES: tl.constexpr,
                     MASKED_STAGES: tl.constexpr, ROW_MAX: tl.constexpr,
                     KV_CHUNK: tl.constexpr):
    """One (query block, head) of the work list. FP8 (token-block scaling): K, V (vt8), SK, SV
    the block copies and KD, VD (vt8_diag), SKD, SVD the token copies (causal), vt8's columns in
    the padded layout (PCU). ROW_MAX: the row max m (natural log) into RMAX too."""
    # Chunks of KV_CHUNK KV heads slowest, then the item (the list is heaviest first), the query
    # heads of the chunk fastest: the CTAs resident together read a few KV heads' K / V tiles
    # (kept in L2); with every head fastest they would read every KV head's at once (one
    # 8k-token document's K / V over 32 heads is 32 MB).
    pid = tl.program_id(0)
    per_chunk = N_ITEMS * GROUP * KV_CHUNK
    chunk = pid // per_chunk
    rem = pid - chunk * per_chunk
    item = rem // (GROUP * KV_CHUNK)
    head = chunk * (GROUP * KV_CHUNK) + rem % (GROUP * KV_CHUNK)
    kvh = head // GROUP
    doc = tl.load(ITEMS + item)
    if doc < 0:
        return
    blk = tl.load(ITEMS + N_ITEMS + item)
    start = tl.load(CU + doc)
    L = tl.load(CU + doc + 1) - start
    q_lo = blk * BLOCK_M
    offs_m = q_lo + tl.arange(0, BLOCK_M)          # doc-local rows
    offs_d = tl.arange(0, D)
    row_ok = offs_m < L
    tok0 = start.to(tl.int64)
    rows = tok0 + offs_m

    if USE_TMA:
        q = Q.load([(tok0 + q_lo).to(tl.int32), head * D])
    else:
        q = tl.load(Q + rows[:, None] * stride_qt + head * D + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
    if FP8:
        sq = tl.load(SQ + head * T + rows, mask=row_ok, other=0.0)
        row_f = sq * qk_scale
        cap = tl.load(VCAP + kvh * T + rows, mask=row_ok, other=1.0)
        # lr = log2(256 / cap): exact from the exponent bits (cap is a power of two or 0)
        ecap = ((cap.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        lr = tl.where(cap > 0.0, tl.minimum(8 - ecap, 100), 0).to(tl.float32)
    else:
        row_f = tl.zeros([BLOCK_M], tl.float32) + qk_scale
        lr = tl.zeros([BLOCK_M], tl.float32)

    m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    SKh = SK + kvh * T + tok0
    SVh = SV + kvh * T + tok0
    if USE_TMA:
        Vh = V
        VDh = VD
    else:
        Vh = V + kvh * stride_vh
        VDh = VD + kvh * stride_vh
    if FP8:
        # Key tiles at document-local multiples of BLOCK_N (module docstring); causal, the query
        # block's own 128-block reads the token copies (KD, VD, SKD, SVD).
        vcol0 = tl.load(PCU + doc).to(tl.int64)
        if CAUSAL:
            d0 = (q_lo // 128) * 128              # keys < d0: off-diagonal, all visible
            hi = tl.minimum(q_lo + BLOCK_M, L)
            n_full = d0 + ((q_lo - d0) // BLOCK_N) * BLOCK_N
            acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, vcol0, kvh,
                                        0, d0, K, Vh, SKh, SVh, stride_kt, stride_vn, stride_vd,
                                        D, BLOCK_N, CAUSAL, False, FP8, USE_TMA, FOLD_LR,
                                        FULL_STAGES, False, True)
            SKDh = SKD + kvh * T + tok0
            SVDh = SVD + kvh * T + tok0
            acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, vcol0, kvh,
                                        d0, n_full, KD, VDh, SKDh, SVDh, stride_kt, stride_vn,
                                        stride_vd, D, BLOCK_N, CAUSAL, False, FP8, USE_TMA,
                                        FOLD_LR, MASKED_STAGES, False)
            acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, vcol0, kvh,
                                        n_full, hi, KD, VDh, SKDh, SVDh, stride_kt, stride_vn,
                                        stride_vd, D, BLOCK_N, CAUSAL, True, FP8, USE_TMA,
                                        FOLD_LR, MASKED_STAGES, False)
        else:
            n_full = (L // BLOCK_N) * BLOCK_N
            acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, vcol0, kvh,
                                        0, n_full, K, Vh, SKh, SVh, stride_kt, stride_vn,
                                        stride_vd, D, BLOCK_N, CAUSAL, False, FP8, USE_TMA,
                                        FOLD_LR, FULL_STAGES, False, True)
            acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, vcol0, kvh,
                                        n_full, L, K, Vh, SKh, SVh, stride_kt, stride_vn,
                                        stride_vd, D, BLOCK_N, CAUSAL, True, FP8, USE_TMA,
                                        FOLD_LR, MASKED_STAGES, False)
    else:
        # bf16 (module docstring; K_ALIGNED, vrow0: 16-aligned rows): in doc-local keys tile j is
        # [j*BN - shift, ...): a masked head tile if shift > 0, full tiles left of the diagonal (no
        # mask), the diagonal / document-end tiles (masked).
        shift = start % 16
        if CAUSAL:
            limit = q_lo                            # keys < q_lo are visible to every row
            hi = tl.minimum(q_lo + BLOCK_M, L)
        else:
            limit = L
            hi = L
        head_hi = tl.where(shift > 0, tl.minimum(BLOCK_N - shift, hi), -shift)
        acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, tok0, kvh,
                                    -shift, head_hi, K, Vh, SKh, SVh, stride_kt, stride_vn,
                                    stride_vd,
                                    D, BLOCK_N, CAUSAL, True, FP8, USE_TMA, FOLD_LR,
                                    MASKED_STAGES, True)
        n_lo = tl.where(shift > 0, BLOCK_N - shift, 0)
        n_full = n_lo + (tl.maximum(limit - n_lo, 0) // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, tok0, kvh,
                                    n_lo, n_full, K, Vh, SKh, SVh, stride_kt, stride_vn, stride_vd,
                                    D, BLOCK_N, CAUSAL, False, FP8, USE_TMA, FOLD_LR,
                                    FULL_STAGES, True)
        acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, tok0, kvh,
                                    n_full, hi, K, Vh, SKh, SVh, stride_kt, stride_vn, stride_vd,
                                    D, BLOCK_N, CAUSAL, True, FP8, USE_TMA, FOLD_LR,
                                    MASKED_STAGES, True)
    # ---- epilogue: O = acc / l', lse = ln2 * (m + log2 l' - lr) ----
    inv_l = 1.0 / l_i
    out = acc * inv_l[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i) - lr) * 0.6931471805599453
    tl.store(LSE + head * T + rows, lse, mask=row_ok)
    if ROW_MAX:
        tl.store(RMAX + head * T + rows, m_i * 0.6931471805599453, mask=row_ok)


def _descriptor(x: torch.Tensor, shape, strides, block_shape):
    """A host-side TMA descriptor over x's storage seen as a 2-D (rows, cols) matrix."""
    return TensorDescriptor(x, list(shape), list(strides), list(block_shape))


def attention_forward(qkv: QuantizedQKV, cu_seqlens: torch.Tensor, max_seqlen: int | None,
                      causal: bool, softmax_scale: float | None, out_dtype, *,
                      config: FwdConfig | PersistentFwdConfig | None = None,
                      poison: bool = False, return_row_max: bool = False):
    """out (T, Hq, D) in out_dtype and lse (Hq, T) fp32 (natural log, softmax-scaled scores); with
    return_row_max=True (out, lse, row_max), row_max (Hq, T) fp32 the row max m of the
    softmax-scaled scores (natural log: the largest normalised P of a row is exp(m - lse)).

    fp8: block_m and block_n must divide 128 (module docstring; reference._forward_kvblock). The
    work list needs only cu_seqlens (max_seqlen: an upper bound on the document lengths). config:
    the kernel and its tiles, config.forward_config(D, recipe, device) by default (a
    PersistentFwdConfig runs forward_gluon's kernel, a FwdConfig _attn_fwd_kernel). poison:
    NaN-filled outputs (tests)."""
    T, Hq, Hkv, D = qkv.shape
    if qkv.recipe not in ("bf16", "fp8"):
        raise ValueError(f"the forward kernels implement bf16 and fp8, not {qkv.recipe!r}")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    fp8 = qkv.kvblock
    dev = qkv.q8.device
    config = config or forward_config(D, qkv.recipe, dev, max_seqlen, Hq // Hkv)
    persistent = isinstance(config, PersistentFwdConfig)
    if persistent:
        from . import forward_gluon
        forward_gluon.check_operands(qkv)
    elif fp8 and qkv.vt8 is None:
        raise ValueError("the fp8 forward reads V from its K-major copy: quantize_qkv's vt8")
    q8, k8, v8 = qkv.q8, qkv.k8, qkv.v8
    for name, x in (("q", q8), ("k", k8), ("v", v8)):
        if x.stride(2) != 1 or x.stride(1) != D:
            raise ValueError(f"{name}8 must have layout (T, H, D) with unit-stride heads/dims")
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    fill = float("nan") if poison else None
    out = new_tensor((T, Hq, D), out_dtype, dev, fill)
    lse = new_tensor((Hq, T), torch.float32, dev, fill)
    row_max = new_tensor((Hq, T), torch.float32, dev, fill) if return_row_max else None
    result = (out, lse, row_max) if return_row_max else (out, lse)
    if T == 0:
        return result
    BM, BN = config.block_m, config.block_n
    if fp8:
        check_kvblock_tiles(qkv, causal, BM, BN)
    items = work_list(cu_seqlens, T, BM, BN, causal)
    if persistent:
        forward_gluon.launch(qkv, items, causal, scale, out, lse, row_max, config)
        return result
    if fp8:
        vt = qkv.vt8                                  # (Hkv, D, T_pad)
        stride_vn, stride_vd, stride_vh = 1, vt.stride(1), vt.stride(0)
    else:
        vt = v8
        stride_vn, stride_vd, stride_vh = v8.stride(0), 1, D
    use_tma = bool(config.use_tma)
    if use_tma:
        # (T, H, D) with unit-stride heads/dims is a (T, H*D) matrix of row stride stride(0).
        Qa = _descriptor(q8, (T, Hq * D), (q8.stride(0), 1), (BM, D))
        Ka = _descriptor(k8, (T, Hkv * D), (k8.stride(0), 1), (BN, D))
        if fp8:
            Va = _descriptor(vt, (Hkv * D, vt.shape[2]), (vt.stride(1), 1), (D, BN))
        else:
            Va = _descriptor(v8, (T, Hkv * D), (v8.stride(0), 1), (BN, D))
    else:
        Qa, Ka, Va = q8, k8, vt
    sq, sk, sv, vcap = (qkv.sq, qkv.sk, qkv.sv, qkv.vcap) if fp8 else (lse,) * 4
    # the token copies (token-block scaling, causal); placeholders of the same kind otherwise
    KDa, VDa, skd, svd = Ka, Va, sk, sv
    if fp8 and causal:
        skd, svd = qkv.sk_diag, qkv.sv_diag
        if use_tma:
            KDa = _descriptor(qkv.k8_diag, (T, Hkv * D), (qkv.k8_diag.stride(0), 1), (BN, D))
            VDa = _descriptor(qkv.vt8_diag, (Hkv * D, qkv.vt8_diag.shape[2]),
                              (qkv.vt8_diag.stride(1), 1), (D, BN))
        else:
            KDa, VDa = qkv.k8_diag, qkv.vt8_diag
    pcu = qkv.kv_pcu if fp8 else items
    n_items = items.shape[1]
    grid = (n_items * Hq,)
    launch_kernel(_attn_fwd_kernel, grid,
        Qa, Ka, Va, sq, sk, sv, vcap, out, lse, items, cu_seqlens, KDa, VDa, skd, svd,
        pcu, lse if row_max is None else row_max,
        q8.stride(0), k8.stride(0), stride_vn, stride_vd, stride_vh, out.stride(0), out.stride(1),
        T, n_items, Hq, Hq // Hkv, scale * LOG2E,
        D=D, BLOCK_M=BM, BLOCK_N=BN, CAUSAL=bool(causal), FP8=fp8, USE_TMA=use_tma,
        FOLD_LR=bool(config.fold_lr), FULL_STAGES=config.num_stages,
        MASKED_STAGES=config.masked_stages or config.num_stages, ROW_MAX=bool(return_row_max),
        KV_CHUNK=math.gcd(Hkv, FWD_KV_CHUNK),
        num_warps=config.num_warps, num_stages=config.num_stages,
        **({"maxnreg": config.maxnreg} if config.maxnreg else {}))
    return result

