"""Gluon (Hopper sm_90a) dK/dV and dQ kernels for the `fp8_mixed` recipe (backward RECIPE == 1).

Not wired into backward.launch_dkdv / launch_dq yet: `benchmarks/bwd_gluon_dev.py --recipe
fp8_mixed` checks them against the Triton RECIPE == 1 kernels on the H200 first. Same contract as those launchers:
`st` from backward.make_state + backward.launch_preprocess (recipe fp8_mixed), results written to
st.dk / st.dv / st.dq (dK, dQ * sm_scale, Hadamard rotate-back when st.rotate, cast).

Per tile, the formulas of backward._dkdv_tile / _dq_tile for RECIPE == 1:

  dK/dV (one program per document, kv head, BN = 64 keys; loop over GROUP heads x query blocks):
    S^T  = (k8_j q8_i^T) * rowf_j * sq_i            fp8 wgmma (bitwise the forward's S)
    P^T  = exp2(S^T - lse2_i)
    a    = P^T sdo_i
    dV_j += c_j * (e4m3(a / c_j) @ doT8_i)          fp8 wgmma, as the fp8 recipe; per-tile fp32
                                                    promotion (zero-started wgmma, CUDA-core add)
    dS^T = P^T ((bf16(V_j) bf16(dO_i)^T) sv_j - Delta_i)         bf16 wgmma, fp32 sums
    dK_j += bf16(dS^T sq_i) @ bf16(q8_i)             bf16 wgmma accumulating in place
  dQ (one program per document, query head, BM = 64 queries; loop over kv blocks j <= i):
    S    = (q8_i k8_j^T) * sk_j * rowf_i            fp8 wgmma
    P    = exp2(S - lse2_i)
    dS   = P ((bf16(dO_i) bf16(V_j)^T) sv_j - Delta_i)           bf16 wgmma
    dQ_i += bf16(dS sk_j) @ bf16(k8_j)               bf16 wgmma accumulating in place
    epilogue: * sm_scale (no sdo: the bf16 path never scaled dO), rotate back, cast.
Delta is preprocess's rowsum(bf16(dO) * O) (not in sdo units for fp8_mixed). Only the dV GEMM has
a per-tile scale (c_j over BM = 64 queries, the Triton split config's kv_bm_dv; the fused Triton
config uses 32), so dK and dQ match the Triton kernels up to fp32 summation order and dV by the
FlashAttention rule. Hopper's bf16 wgmma sums in fp32 (benchmarks/NOTES.md session 3, item 5),
so the bf16 GEMMs chain their accumulators across tiles; only fp8 results are promoted per tile.

Operands. e4m3 values are exact in bf16, so the bf16 GEMMs read bf16 copies of fp8 bytes:
  - dK's B operand Q_i (BM x D, N = D contiguous): MN-major, which the 16-bit wgmma accepts from
    shared memory (no K-major copy qT8; make_state only allocates qT8 / kT8 for fp8). It is made
    in the kernel: the q8_i tile that TMA brought for S^T is converted e4m3 -> bf16 into a
    (BM, 64)-chunked bf16 buffer while the S^T / dP^T wgmmas run (the same 8 KB per tile as
    fp8's qT8 comes from L2; a host bf16 copy of Q would stream 16 KB more per tile and push the
    ring past 2 CTAs / SM).
  - V_j (dK/dV: A of dP^T; dQ: B of dP, K-major from token-major), K_j (dQ: B of the dQ GEMM,
    MN-major) and dO (bf16, the caller's dO rounded like the Triton kernel's _bf16_op) come by
    TMA from host bf16 tensors (`mixed_operands`: v8 / k8 -> bf16, (T, Hkv, D) each, one pass;
    dO as is when already bf16). dQ re-reads every kv tile once per query block, so converting
    there per tile would cost more than the pass.
  - Every bf16 tile is a (rows, 64) box (128-byte rows, the 128-byte swizzle's width): D = 128
    GEMMs reducing over D are two chained wgmmas (K = 64 each), those producing D columns two
    64-column halves (as the fp8 kernels' chunks).
Everything else is backward_gluon's design (its docstring): one warpgroup per CTA aiming at 2
CTAs / SM, an NS-stage TMA + mbarrier ring, the per-row vectors as (1, BM) / (1, BN) boxes of
padded copies (16-byte aligned innermost coordinates: an unaligned 1-D TMA was an illegal
instruction on the H200), out-of-document columns zeroed in shared memory on the end tile
(K-major doT8 columns; bf16 q rows at conversion; bf16 k rows in dQ) and `where` masks on a /
dS (never 0 * x: the next document's bytes may be NaN).

Config: `sync_mma` waits for every wgmma at once (the bisection baseline). `carry` would keep
the in-place bf16 accumulator wgmmas (dK, dQ) in flight into the next tile (they complete, in
order, before that tile's S wait); off by default because ptxas 3.6 then serializes all wgmmas
(warning C7515) in both kernels. dK/dV `early_dv` issues dV's first half before dS^T is
computed, as the fp8 kernel does: 240 vs 144 bytes of spills at D = 128, so off by default.

What does not depend on the GEMM operand types comes from backward_gluon unchanged: the program
prologues, rings, barriers, per-row vectors, tile indices, masks, P^T / the dV operand, the
epilogues (its "Pieces ... reuse" section), the host-side checks, descriptors and launch
arguments, _compile_sm90 and resource_report.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import backward_gluon as G

HAVE_GLUON = G.HAVE_GLUON
if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from .backward_gluon import (  # noqa: F401  (gluon.jit resolves them from this module)
        _causal_shift, _dkdv_bounds, _dkdv_epilogue, _dkdv_program, _dq_bounds, _dq_program,
        _dv_operand, _init_barriers, _invalidate_barriers, _issue_key_vecs, _issue_query_vecs,
        _key_scales, _kv_tile, _mask_ds, _mask_ds_t, _mma, _mma_wait, _next_tile, _promote,
        _q_tile_at, _q_tile_rows, _query_scales, _row_vec, _store_out, _vec_ring,
        _zero_tail_cols)

CH_ = G.CH_     # 64: column chunk of D; also BM (dK/dV) / BN (dQ)
RECIPE_MIXED = 1


@dataclass(frozen=True)
class MixedDkdvConfig:
    bn: int = 64            # keys per CTA (one warpgroup: 16 * num_warps)
    bm: int = 64            # query rows per step (== 64)
    stages: int = 2         # TMA ring depth (D=128: ~106 KB smem -> 2 CTAs / SM)
    vec_tma: bool = True    # lse / Delta / sq / sdo by (1, BM) TMA boxes (False: gl.load)
    num_warps: int = 4
    sync_mma: bool = False  # every wgmma waited for at once (bisection baseline)
    # dK wgmmas left in flight into the next tile. Off: ptxas serializes every wgmma of the
    # kernel when an accumulator stays in flight across the loop's back edge (C7515, compile
    # report); kept as a knob for a later compiler
    carry: bool = False
    early_dv: bool = False  # dV's first half issued before dS^T is computed (more registers)
    # the tile's query indices inside the masked branches only (backward_gluon._cols_of;
    # CPU SASS per tile at D=128: 1147 -> 1075, local-memory ops 32 -> 10; D=64 886 -> 871)
    lazy_cols: bool = False
    # tail_zero: q8 -> bf16 (the dK GEMM's B operand) converted unmasked, its rows past the
    # document end zeroed afterwards on the tiles that have any (constexpr TAIL_ZERO)
    tail_zero: bool = False


@functools.lru_cache(maxsize=None)   # frozen: one per D, not rebuilt per call
def default_mixed_dkdv_config(D: int) -> MixedDkdvConfig:
    """tail_zero, and at D=128 lazy_cols: bitwise the same dK / dV as without (H200, ms, same
    process; benchmarks/NOTES.md session 13). lazy_cols: doc8k_x4 11.92 -> 10.16, longtail
    10.87 -> 9.40, doc32k 46.87 -> 40.07 (at D=64: 7.17 -> 6.99, d64_longtail 5.55 -> 5.64,
    not adopted). tail_zero: doc8k_x4 10.13 -> 9.80, longtail 9.43 -> 9.23, doc32k within
    the run's noise, d64_doc8k_x4 7.46 -> 7.17, d64_longtail 5.57 -> 5.55."""
    return MixedDkdvConfig(stages=3 if D <= 64 else 2, lazy_cols=D > 64, tail_zero=True)


@dataclass(frozen=True)
class MixedDqConfig:
    bm: int = 64            # query rows per CTA (16 * num_warps)
    bn: int = 64            # keys per step (== 64)
    stages: int = 2         # kv ring depth (D=128: 40.5 KB per stage)
    vec_tma: bool = True    # sk / sv by (1, BN) TMA boxes (False: gl.load)
    num_warps: int = 4
    sync_mma: bool = False
    carry: bool = False     # dQ wgmmas left in flight (stages >= 2); off: C7515, as dK/dV's


@functools.lru_cache(maxsize=None)   # frozen: one per D, not rebuilt per call
def default_mixed_dq_config(D: int) -> MixedDqConfig:
    return MixedDqConfig(stages=3 if D <= 64 else 2)


if HAVE_GLUON:
    CH = gl.constexpr(CH_)

    @gluon.jit
    def _mma_acc(a, b, acc, SYNC: gl.constexpr):
        """acc + a @ b (in place: the bf16 GEMMs, and the second K-half of a D = 128 GEMM)."""
        if SYNC:
            r = warpgroup_mma(a, b, acc)
        else:
            r = warpgroup_mma(a, b, acc, is_async=True)
        return r

    @gluon.jit
    def _wait_pair(x0, x1, N: gl.constexpr, NCH: gl.constexpr, SYNC: gl.constexpr):
        """Wait until at most N wgmma groups are pending; the (one or two) chunk accumulators
        as tensors (x1 passes through untouched when NCH == 1)."""
        if SYNC:
            r0 = x0
            r1 = x1
        elif NCH == 2:
            r0, r1 = warpgroup_mma_wait(N, deps=(x0, x1))
        else:
            r0 = warpgroup_mma_wait(N, deps=(x0,))
            r1 = x1
        return r0, r1

    @gluon.jit
    def _load_once(f8_desc, bf_desc, bar, f8_s, bf_s, start, r0, head, D: gl.constexpr,
                   NCH: gl.constexpr):
        """TMA of a program's operand loaded once: its fp8 tile (tokens start + r0 on, head
        `head`) and the bf16 copy's NCH (rows, 64) chunks (columns head * D + 64 c: 128-byte
        aligned). The coordinates are computed here, after the expect, not by the caller: that
        is the order of the validated PTX."""
        mbarrier.expect(bar, f8_desc.block_type.nbytes + NCH * bf_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(f8_desc, [start + r0, head * D], bar, f8_s)
        for cc in gl.static_range(NCH):
            tma.async_copy_global_to_shared(bf_desc, [start + r0, head * D + cc * CH], bar,
                                            bf_s.index(cc))

    @gluon.jit
    def _e4m3_to_bf16_rows(src, dst, row0, L, ROWS: gl.constexpr, num_warps: gl.constexpr,
                           TAIL_ZERO: gl.constexpr = False):
        """dst (ROWS, 64) bf16 <- the e4m3 values of src (ROWS, 64) (exact), rows with
        row0 + r >= L zeroed (the next document's bytes: 0 * NaN would reach the GEMM).
        TAIL_ZERO (MixedDkdvConfig.tail_zero): converted unmasked, those rows zeroed after it
        only when the tile has any (_zero_tail_rows): the mask costs every tile ~66 SASS."""
        BLQ: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        if TAIL_ZERO:
            dst.store(src.load(BLQ).to(gl.float32).to(gl.bfloat16))
            if row0 + ROWS > L:   # (rows written above by other threads: ordered first)
                gl.thread_barrier()
                _zero_tail_rows(dst, row0, L, ROWS, num_warps)
        else:
            x = src.load(BLQ).to(gl.float32)
            rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, BLQ))
            x = gl.where(gl.expand_dims(rows < L, 1), x, 0.0)
            dst.store(x.to(gl.bfloat16))

    @gluon.jit
    def _zero_tail_rows(x_s, row0, L, ROWS: gl.constexpr, num_warps: gl.constexpr):
        """Zero the rows (tokens) row0 + r >= L of a token-major (ROWS, 64) bf16 tile."""
        BLR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        x = x_s.load(BLR)
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, BLR))
        x = gl.where(gl.expand_dims(rows < L, 1), x, gl.zeros_like(x))
        x_s.store(x)

    # ------------------------------------------------------------------------------------------
    # dK / dV
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _issue_q_tile(it, nb, lo, start, pstart, hk,
                      q_desc, dob_desc, doT_desc, lse_desc, dl_desc, sq_desc, sdo_desc,
                      q_s, dob_s, doT_s, lse_s, dl_s, sq_s, sdo_s, ready, pred,
                      GROUP, D: gl.constexpr, BM: gl.constexpr, NS: gl.constexpr,
                      NCH: gl.constexpr, VEC_TMA: gl.constexpr):
        """TMA loads of query tile `it` (head g = it // nb, block i0) into ring slot it % NS."""
        i0, h = _q_tile_rows(it, nb, lo, hk, GROUP, BM)
        _issue_q_tile_at(i0, h, it % NS, start, pstart, q_desc, dob_desc, doT_desc, lse_desc,
                         dl_desc, sq_desc, sdo_desc, q_s, dob_s, doT_s, lse_s, dl_s, sq_s, sdo_s,
                         ready, pred, D, NCH, VEC_TMA)

    @gluon.jit
    def _issue_q_tile_at(i0, h, s, start, pstart,
                         q_desc, dob_desc, doT_desc, lse_desc, dl_desc, sq_desc, sdo_desc,
                         q_s, dob_s, doT_s, lse_s, dl_s, sq_s, sdo_s, ready, pred,
                         D: gl.constexpr, NCH: gl.constexpr, VEC_TMA: gl.constexpr):
        """TMA loads of the query tile (head h, first row i0) into ring slot s:
        q8_i (fp8, token-major), dO_i (bf16, NCH (BM, 64) chunks), doT8_i (fp8 K-major, padded
        columns) and with VEC_TMA lse / Delta / sq / sdo ((1, BM) boxes, padded columns)."""
        bar = ready.index(s)
        if VEC_TMA:
            NBYTES: gl.constexpr = (q_desc.block_type.nbytes + NCH * dob_desc.block_type.nbytes
                                    + doT_desc.block_type.nbytes + 4 * lse_desc.block_type.nbytes)
        else:
            NBYTES: gl.constexpr = (q_desc.block_type.nbytes + NCH * dob_desc.block_type.nbytes
                                    + doT_desc.block_type.nbytes)
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [start + i0, h * D], bar, q_s.index(s), pred=pred)
        for cc in gl.static_range(NCH):
            # bf16 column h * D + 64 c: 128-byte aligned
            tma.async_copy_global_to_shared(dob_desc, [start + i0, h * D + cc * CH], bar,
                                            dob_s.index(s * NCH + cc), pred=pred)
        tma.async_copy_global_to_shared(doT_desc, [h * D, pstart + i0], bar, doT_s.index(s),
                                        pred=pred)
        if VEC_TMA:
            _issue_query_vecs(lse_desc, dl_desc, sq_desc, sdo_desc, lse_s, dl_s, sq_s, sdo_s, h,
                              pstart + i0, bar, s, pred)

    @gluon.jit(do_not_specialize=["T", "HQ", "HKV"])
    def _dkdv_mixed_kernel(
        k_desc, vb_desc, q_desc, dob_desc, doT_desc,
        lse_desc, dl_desc, sq_desc, sdo_desc,
        lse, delta, sq, sdo, sk, sv, dk, dv, hmat, cu, pcu,
        T, stride_dkt, sm_scale, qk_scale2, out_scale,
        HQ, HKV, D: gl.constexpr, BM: gl.constexpr,
        BN: gl.constexpr, NS: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
        VEC_TMA: gl.constexpr, SYNC: gl.constexpr, CARRY: gl.constexpr,
        EARLY_DV: gl.constexpr, num_warps: gl.constexpr, LAZY: gl.constexpr = False,
        TAIL_ZERO: gl.constexpr = False,
    ):
        GROUP = HQ // HKV
        NCH: gl.constexpr = D // CH
        # fp8 wgmma results (S^T, dV; N = 64): per-key and per-query vectors broadcast without
        # conversions
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, CH, 32])
        # bf16 wgmma results (dP^T, dK): k = 16 instructions; the same registers as L
        # (the accumulator layout does not depend on k), so the conversions are free
        LB: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, CH, 16])
        AOP8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=4)
        AOPB: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=LB, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, L)     # per key
        COL: gl.constexpr = gl.SliceLayout(0, L)     # per query
        BF_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, CH], gl.bfloat16)

        hk, start, L_doc, pstart, n0 = _dkdv_program(cu, pcu, HKV, D, BM, BN, num_warps)
        if n0 >= L_doc:
            return

        # --- shared memory ------------------------------------------------------------------
        k_s = gl.allocate_shared_memory(k_desc.dtype, [BN, D], k_desc.layout)
        vb_s = gl.allocate_shared_memory(vb_desc.dtype, [NCH, BN, CH], vb_desc.layout)
        q_s = gl.allocate_shared_memory(q_desc.dtype, [NS, BM, D], q_desc.layout)
        dob_s = gl.allocate_shared_memory(dob_desc.dtype, [NS * NCH, BM, CH], dob_desc.layout)
        doT_s = gl.allocate_shared_memory(doT_desc.dtype, [NS, D, BM], doT_desc.layout)
        qb_s = gl.allocate_shared_memory(gl.bfloat16, [NCH, BM, CH], BF_LAYOUT)
        lse_s = _vec_ring(lse_desc, q_s, NS, BM, VEC_TMA)
        dl_s = _vec_ring(dl_desc, q_s, NS, BM, VEC_TMA)
        sq_s = _vec_ring(sq_desc, q_s, NS, BM, VEC_TMA)
        sdo_s = _vec_ring(sdo_desc, q_s, NS, BM, VEC_TMA)
        ready, kv_bar, _ = _init_barriers(NS, False)

        # --- K_j (fp8, for S^T) and bf16 V_j (A of dP^T), once ---------------------------
        _load_once(k_desc, vb_desc, kv_bar, k_s, vb_s, start, n0, hk, D, NCH)

        lo, nb, total = _dkdv_bounds(n0, L_doc, GROUP, BM, CAUSAL)
        for pi in gl.static_range(NS - 1):
            _issue_q_tile(pi, nb, lo, start, pstart, hk, q_desc, dob_desc, doT_desc,
                          lse_desc, dl_desc, sq_desc, sdo_desc, q_s, dob_s, doT_s,
                          lse_s, dl_s, sq_s, sdo_s, ready, pi < total, GROUP, D, BM, NS, NCH,
                          VEC_TMA)

        n_idx, n_ok, rowf, sv_j = _key_scales(sk, sv, hk, T, start, n0, L_doc, qk_scale2, BN, ROW)

        zero = gl.zeros([BN, CH], gl.float32, L)
        zero_b = gl.zeros([BN, CH], gl.float32, LB)
        acc_dv0 = gl.zeros([BN, CH], gl.float32, L)
        acc_dk0 = gl.zeros([BN, CH], gl.float32, LB)
        acc_dv1 = gl.zeros([BN, CH], gl.float32, L)
        acc_dk1 = gl.zeros([BN, CH], gl.float32, LB)
        shift = _causal_shift(L_doc, CAUSAL)
        mbarrier.wait(kv_bar, 0)
        # (head, block) cursors of the current and the refill tile (backward_gluon._dkdv_loop)
        g_cur = 0
        blk_cur = 0
        g_nxt = (NS - 1) // nb
        blk_nxt = (NS - 1) - g_nxt * nb

        for it in range(total):
            s = it % NS
            i0 = lo + blk_cur * BM
            h = hk * GROUP + g_cur
            m_idx, tail, need_mask = _q_tile_at(i0, n0, L_doc, BM, BN, CAUSAL, COL)
            if LAZY:
                cols = i0
            else:
                cols = m_idx
            g_cur, blk_cur = _next_tile(g_cur, blk_cur, nb)
            # every warp is past its reads of slot (it - 1) % NS (vectors, q8 by ld.shared)
            # before the refill; that slot's wgmmas were waited for in tile it - 1 (dK reads
            # only qb_s)
            gl.thread_barrier()
            nxt = it + NS - 1
            _issue_q_tile_at(lo + blk_nxt * BM, hk * GROUP + g_nxt, nxt % NS, start, pstart,
                             q_desc, dob_desc, doT_desc, lse_desc, dl_desc, sq_desc, sdo_desc,
                             q_s, dob_s, doT_s, lse_s, dl_s, sq_s, sdo_s, ready, nxt < total, D,
                             NCH, VEC_TMA)
            g_nxt, blk_nxt = _next_tile(g_nxt, blk_nxt, nb)
            mbarrier.wait(ready.index(s), (it // NS) & 1)
            qs = q_s.index(s)
            doTs = doT_s.index(s)

            s_tok = _mma(k_s, qs.permute((1, 0)), zero, SYNC)                       # fp8
            dp_tok = _mma(vb_s.index(0), dob_s.index(s * NCH).permute((1, 0)), zero_b, SYNC)
            if NCH == 2:   # second half of the reduction over D, chained in place
                dp_tok = _mma_acc(vb_s.index(1), dob_s.index(s * NCH + 1).permute((1, 0)),
                                  dp_tok, SYNC)

            # bf16 copy of q8_i for the dK GEMM, while S^T / dP^T run; the previous tile's dK
            # wgmmas (issued before S^T) must be done reading qb_s
            if CARRY:
                acc_dk0, acc_dk1 = _wait_pair(acc_dk0, acc_dk1, 1 + NCH, NCH, SYNC)
            for cc in gl.static_range(NCH):
                _e4m3_to_bf16_rows(qs.slice(cc * CH, CH, dim=1), qb_s.index(cc), i0, L_doc, BM,
                                   num_warps, TAIL_ZERO)
            if tail:   # at most once per head: doT8 columns past the document end
                _zero_tail_cols(doTs, i0, L_doc, D, BM, num_warps)
            fence_async_shared()
            gl.thread_barrier()

            # (S^T waited for past the dP^T wgmmas: NCH of them)
            p, a, c, a8 = _dv_operand(s_tok, s, rowf, n_idx, cols, h, T, start, L_doc, shift,
                                      need_mask, lse_s, sq_s, sdo_s, lse, sq, sdo, NCH, BM, COL,
                                      AOP8, VEC_TMA, SYNC, False, False, False, LAZY)
            if EARLY_DV:   # dV's first half overlaps dS^T (its 32 result registers in flight)
                dv0_tok = _mma(a8, doTs.slice(0, CH, dim=0).permute((1, 0)), zero, SYNC)

            dl_i = _row_vec(dl_s, s, delta, h, T, start, m_idx, L_doc, 0.0, COL, VEC_TMA)
            if EARLY_DV:
                dp = gl.convert_layout(_mma_wait(dp_tok, 1, SYNC), L)
            else:
                dp = gl.convert_layout(_mma_wait(dp_tok, 0, SYNC), L)
            sq_i2 = _row_vec(sq_s, s, sq, h, T, start, m_idx, L_doc, 0.0, COL, VEC_TMA)
            # _dkdv_tile: ds_t = p_t (dP^T sv_j - Delta_i); dK operand bf16(ds_t sq_i)
            b = _mask_ds_t(p * (dp * gl.expand_dims(sv_j, 1) - gl.expand_dims(dl_i, 0))
                           * gl.expand_dims(sq_i2, 0), n_idx, cols, shift, L_doc, need_mask,
                           False, False, COL, LAZY)
            b16 = gl.convert_layout(b.to(gl.bfloat16), AOPB)
            if not EARLY_DV:
                dv0_tok = _mma(a8, doTs.slice(0, CH, dim=0).permute((1, 0)), zero, SYNC)

            if NCH == 2:
                dv1_tok = _mma(a8, doTs.slice(CH, CH, dim=0).permute((1, 0)), zero, SYNC)
                dk0_tok = _mma_acc(b16, qb_s.index(0), acc_dk0, SYNC)
                dk1_tok = _mma_acc(b16, qb_s.index(1), acc_dk1, SYNC)
                acc_dv0 = _promote(dv0_tok, 3, acc_dv0, c, SYNC)
                acc_dv1 = _promote(dv1_tok, 2, acc_dv1, c, SYNC)
                if CARRY:
                    acc_dk0, acc_dk1 = _wait_pair(dk0_tok, dk1_tok, 2, NCH, SYNC)
                else:
                    acc_dk0, acc_dk1 = _wait_pair(dk0_tok, dk1_tok, 0, NCH, SYNC)
            else:
                dk0_tok = _mma_acc(b16, qb_s.index(0), acc_dk0, SYNC)
                acc_dv0 = _promote(dv0_tok, 1, acc_dv0, c, SYNC)
                if CARRY:
                    acc_dk0, acc_dk1 = _wait_pair(dk0_tok, acc_dk1, 1, NCH, SYNC)
                else:
                    acc_dk0, acc_dk1 = _wait_pair(dk0_tok, acc_dk1, 0, NCH, SYNC)

        if CARRY:
            acc_dk0, acc_dk1 = _wait_pair(acc_dk0, acc_dk1, 0, NCH, SYNC)
        _invalidate_barriers(ready, kv_bar, ready, NS, False)
        _dkdv_epilogue(acc_dv0, acc_dv1, acc_dk0, acc_dk1, dv, dk, hmat, n_idx, n_ok, start, hk,
                       stride_dkt, sm_scale, out_scale, ROTATE, D, BN, NCH, L, num_warps)

    # ------------------------------------------------------------------------------------------
    # dQ
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _issue_kv_tile(jt, start, pstart, hk, k_desc, kb_desc, vb_desc, sk_desc, sv_desc,
                       k_s, kb_s, vb_s, sk_s, sv_s, ready, pred,
                       D: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, NCH: gl.constexpr,
                       VEC_TMA: gl.constexpr):
        """TMA loads of kv tile `jt` into slot jt % NS: k8_j (fp8, for S), bf16 K_j and V_j in
        (BN, 64) chunks, and with VEC_TMA sk_j / sv_j ((1, BN) boxes, padded columns)."""
        j0 = jt * BN
        s = jt % NS
        bar = ready.index(s)
        if VEC_TMA:
            NBYTES: gl.constexpr = (k_desc.block_type.nbytes + NCH * kb_desc.block_type.nbytes
                                    + NCH * vb_desc.block_type.nbytes
                                    + 2 * sk_desc.block_type.nbytes)
        else:
            NBYTES: gl.constexpr = (k_desc.block_type.nbytes + NCH * kb_desc.block_type.nbytes
                                    + NCH * vb_desc.block_type.nbytes)
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [start + j0, hk * D], bar, k_s.index(s), pred=pred)
        for cc in gl.static_range(NCH):
            tma.async_copy_global_to_shared(kb_desc, [start + j0, hk * D + cc * CH], bar,
                                            kb_s.index(s * NCH + cc), pred=pred)
            tma.async_copy_global_to_shared(vb_desc, [start + j0, hk * D + cc * CH], bar,
                                            vb_s.index(s * NCH + cc), pred=pred)
        if VEC_TMA:
            _issue_key_vecs(sk_desc, sv_desc, sk_s, sv_s, hk, pstart + j0, bar, s, pred)

    @gluon.jit(do_not_specialize=["T", "HQ", "HKV"])
    def _dq_mixed_kernel(
        q_desc, dob_desc, k_desc, kb_desc, vb_desc, sk_desc, sv_desc,
        lse, delta, sq, sk, sv, dq, hmat, cu, pcu,
        T, stride_dqt, sm_scale, qk_scale2, out_scale,
        HQ, HKV, D: gl.constexpr, BM: gl.constexpr,
        BN: gl.constexpr, NS: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
        VEC_TMA: gl.constexpr, SYNC: gl.constexpr, CARRY: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        gl.static_assert(NS >= 2 or not CARRY, "carry needs a ring of 2+ stages")
        GROUP = HQ // HKV
        NCH: gl.constexpr = D // CH
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, CH, 32])
        LB: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, CH, 16])    # bf16 results
        AOPB: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=LB, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, L)     # per query
        COL: gl.constexpr = gl.SliceLayout(0, L)     # per key

        h, hk, start, L_doc, pstart, ib = _dq_program(cu, pcu, HQ, GROUP, D, BM, BN, num_warps)
        if ib < 0:
            return
        m0 = ib * BM

        # --- shared memory ------------------------------------------------------------------
        q_s = gl.allocate_shared_memory(q_desc.dtype, [BM, D], q_desc.layout)
        dob_s = gl.allocate_shared_memory(dob_desc.dtype, [NCH, BM, CH], dob_desc.layout)
        k_s = gl.allocate_shared_memory(k_desc.dtype, [NS, BN, D], k_desc.layout)
        kb_s = gl.allocate_shared_memory(kb_desc.dtype, [NS * NCH, BN, CH], kb_desc.layout)
        vb_s = gl.allocate_shared_memory(vb_desc.dtype, [NS * NCH, BN, CH], vb_desc.layout)
        sk_s = _vec_ring(sk_desc, k_s, NS, BN, VEC_TMA)
        sv_s = _vec_ring(sv_desc, k_s, NS, BN, VEC_TMA)
        ready, q_bar, _ = _init_barriers(NS, False)

        # --- q8_i (fp8, A of S) and bf16 dO_i (A of dP), once --------------------------------
        _load_once(q_desc, dob_desc, q_bar, q_s, dob_s, start, m0, h, D, NCH)

        mask_from, shift, total = _dq_bounds(m0, L_doc, BM, BN, CAUSAL)
        for pi in gl.static_range(NS - 1):
            _issue_kv_tile(pi, start, pstart, hk, k_desc, kb_desc, vb_desc, sk_desc, sv_desc,
                           k_s, kb_s, vb_s, sk_s, sv_s, ready, pi < total, D, BN, NS, NCH,
                           VEC_TMA)

        m_idx, m_ok, lse2, rowf, dl_i = _query_scales(lse, sq, delta, h, T, start, m0, L_doc,
                                                      qk_scale2, BM, ROW)

        zero = gl.zeros([BM, CH], gl.float32, L)
        zero_b = gl.zeros([BM, CH], gl.float32, LB)
        acc0 = gl.zeros([BM, CH], gl.float32, LB)
        acc1 = gl.zeros([BM, CH], gl.float32, LB)
        mbarrier.wait(q_bar, 0)

        for jt in range(total):
            s = jt % NS
            j0, end, need_mask, n_idx = _kv_tile(jt, L_doc, mask_from, BN, COL)
            if NS == 1:   # no prefetch: this tile's own loads (tile jt - 1's wgmmas all done)
                gl.thread_barrier()
                _issue_kv_tile(jt, start, pstart, hk, k_desc, kb_desc, vb_desc, sk_desc,
                               sv_desc, k_s, kb_s, vb_s, sk_s, sv_s, ready, jt < total, D, BN,
                               NS, NCH, VEC_TMA)
            mbarrier.wait(ready.index(s), (jt // NS) & 1)
            ks = k_s.index(s)

            s_tok = _mma(q_s, ks.permute((1, 0)), zero, SYNC)                         # fp8
            dp_tok = _mma(dob_s.index(0), vb_s.index(s * NCH).permute((1, 0)), zero_b, SYNC)
            if NCH == 2:
                dp_tok = _mma_acc(dob_s.index(1), vb_s.index(s * NCH + 1).permute((1, 0)),
                                  dp_tok, SYNC)

            if end:   # once per program: bf16 K rows past the document end (0 * NaN is NaN)
                for cc in gl.static_range(NCH):
                    _zero_tail_rows(kb_s.index(s * NCH + cc), j0, L_doc, BN, num_warps)
                fence_async_shared()
                gl.thread_barrier()

            sk_j = _row_vec(sk_s, s, sk, hk, T, start, n_idx, L_doc, 0.0, COL, VEC_TMA)
            # waits for S and (issued before it) tile jt - 1's dQ wgmmas
            sc = _mma_wait(s_tok, NCH, SYNC)
            if NS > 1:
                # slot (jt - 1) % NS is free now (S, dP, dQ of tile jt - 1 done; every warp past
                # its vector reads): prefetch tile jt + NS - 1 into it
                gl.thread_barrier()
                nxt = jt + NS - 1
                _issue_kv_tile(nxt, start, pstart, hk, k_desc, kb_desc, vb_desc, sk_desc,
                               sv_desc, k_s, kb_s, vb_s, sk_s, sv_s, ready, nxt < total, D, BN,
                               NS, NCH, VEC_TMA)
            p = gl.exp2(sc * gl.expand_dims(sk_j, 0) * gl.expand_dims(rowf, 1)
                        - gl.expand_dims(lse2, 1))
            sv_j = _row_vec(sv_s, s, sv, hk, T, start, n_idx, L_doc, 0.0, COL, VEC_TMA)
            dp = gl.convert_layout(_mma_wait(dp_tok, 0, SYNC), L)
            sk_j2 = _row_vec(sk_s, s, sk, hk, T, start, n_idx, L_doc, 0.0, COL, VEC_TMA)
            # _dq_tile: ds = p (dP sv_j - Delta_i); dQ operand bf16(ds sk_j)
            b = _mask_ds(p * (dp * gl.expand_dims(sv_j, 0) - gl.expand_dims(dl_i, 1))
                         * gl.expand_dims(sk_j2, 0), n_idx, m_idx, shift, L_doc, need_mask)
            b16 = gl.convert_layout(b.to(gl.bfloat16), AOPB)

            q0_tok = _mma_acc(b16, kb_s.index(s * NCH), acc0, SYNC)
            if NCH == 2:
                q1_tok = _mma_acc(b16, kb_s.index(s * NCH + 1), acc1, SYNC)
            else:
                q1_tok = acc1
            if CARRY:
                acc0, acc1 = _wait_pair(q0_tok, q1_tok, NCH, NCH, SYNC)
            else:
                acc0, acc1 = _wait_pair(q0_tok, q1_tok, 0, NCH, SYNC)

        acc0, acc1 = _wait_pair(acc0, acc1, 0, NCH, SYNC)
        _invalidate_barriers(ready, q_bar, ready, NS, False)

        # --- epilogue: * sm_scale, rotate back, cast -------------------------------------------
        acc0 = gl.convert_layout(acc0, L) * sm_scale
        acc1 = gl.convert_layout(acc1, L) * sm_scale
        row_off = (start + m_idx) * stride_dqt + h * D
        _store_out(acc0, acc1, hmat, dq, m_ok, row_off, out_scale, ROTATE, D, BM, NCH, L, num_warps)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

def mixed_operands(st, need_k: bool = True):
    """(dO bf16 (T, Hq, D), V bf16 (T, Hkv, D), K bf16 (T, Hkv, D) or None): the bf16 GEMMs'
    token-major operands. V / K: e4m3 values, exact in bf16 (one pass over v8 / k8). dO: the
    caller's, rounded to bf16 as backward._bf16_op does when it is fp16 / fp32. Production would
    have launch_preprocess / the quantization write these."""
    bf = torch.bfloat16
    dob = st.dout if st.dout.dtype == bf else st.dout.to(bf)
    vb = st.v8.to(bf)
    kb = st.k8.to(bf) if need_k else None
    return dob.contiguous(), vb.contiguous(), kb.contiguous() if need_k else None


def _dkdv_args(st, cfg: MixedDkdvConfig, vecs=None, ops=None):
    G._check_state(st, RECIPE_MIXED, "fp8_mixed dK/dV")
    G._check_blocks(cfg, cfg.bn, cfg.bm, "fp8_mixed dK/dV")
    D, BM, BN = st.D, cfg.bm, cfg.bn
    dob, vb, _ = ops if ops is not None else mixed_operands(st, need_k=False)
    for x in (st.q8, st.k8, st.doT8, st.lse, st.delta, st.sq, st.sdo, st.sk, st.sv, st.dk,
              st.dv, dob, vb):
        assert x.is_contiguous()
    f8, bf = gl.float8e4nv, gl.bfloat16
    descs = (G.tok_major_desc(st.k8, BN, D, f8), G.tok_major_desc(vb, BN, CH_, bf),
             G.tok_major_desc(st.q8, BM, D, f8), G.tok_major_desc(dob, BM, CH_, bf),
             G.kmajor_desc(st.doT8, BM),
             *G._vec_descs(st, cfg, vecs, BM, 4, G.padded_vectors, G.padded_vectors_triton))
    tensors = (st.lse, st.delta, st.sq, st.sdo, st.sk, st.sv, st.dk, st.dv)
    return G._launch_args(st, cfg, descs, tensors, False, CARRY=cfg.carry and not cfg.sync_mma,
                          EARLY_DV=cfg.early_dv,
                          **({"LAZY": True} if cfg.lazy_cols else {}),
                          **({"TAIL_ZERO": True} if cfg.tail_zero else {}))


def launch_dkdv_gluon_mixed(st, config: MixedDkdvConfig | None = None, vecs=None,
                            ops=None) -> None:
    """dK, dV of fp8_mixed into st.dk / st.dv (the contract of backward.launch_dkdv). `vecs`:
    G.padded_vectors(st), `ops`: mixed_operands(st) when the caller already has them."""
    cfg = config or default_mixed_dkdv_config(st.D)
    if G._no_tokens(st, st.dk, st.dv):
        return
    grid, args, kwargs = _dkdv_args(st, cfg, vecs, ops)
    _dkdv_mixed_kernel[grid](*args, **kwargs)


def _dq_args(st, cfg: MixedDqConfig, vecs=None, ops=None):
    G._check_state(st, RECIPE_MIXED, "fp8_mixed dQ")
    G._check_blocks(cfg, cfg.bm, cfg.bn, "fp8_mixed dQ")
    D, BM, BN = st.D, cfg.bm, cfg.bn
    dob, vb, kb = ops if ops is not None else mixed_operands(st)
    for x in (st.q8, st.k8, st.lse, st.delta, st.sq, st.sk, st.sv, st.dq, dob, vb, kb):
        assert x.is_contiguous()
    f8, bf = gl.float8e4nv, gl.bfloat16
    descs = (G.tok_major_desc(st.q8, BM, D, f8), G.tok_major_desc(dob, BM, CH_, bf),
             G.tok_major_desc(st.k8, BN, D, f8), G.tok_major_desc(kb, BN, CH_, bf),
             G.tok_major_desc(vb, BN, CH_, bf),
             *G._vec_descs(st, cfg, vecs, BN, 2, G.padded_kv_vectors, G.padded_kv_vectors_triton))
    tensors = (st.lse, st.delta, st.sq, st.sk, st.sv, st.dq)    # (no sdo: dO was never scaled)
    return G._launch_args(st, cfg, descs, tensors, True,
                          CARRY=cfg.carry and not cfg.sync_mma and cfg.stages >= 2)


def launch_dq_gluon_mixed(st, config: MixedDqConfig | None = None, vecs=None, ops=None) -> None:
    """dQ of fp8_mixed into st.dq (the contract of backward.launch_dq without dq_atomic).
    `vecs`: G.padded_kv_vectors(st), `ops`: mixed_operands(st) when already built."""
    cfg = config or default_mixed_dq_config(st.D)
    if G._no_tokens(st, st.dq):
        return
    grid, args, kwargs = _dq_args(st, cfg, vecs, ops)
    _dq_mixed_kernel[grid](*args, **kwargs)
