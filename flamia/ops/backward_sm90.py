"""Attention backward for Hopper (sm_90a) in Gluon: one pass, five GEMMs per tile, dQ by TMA
reduce-add.

One CTA owns one key block (BN keys of one document) of one KV head and walks every query block
that sees it, for every query head of the KV head's GQA group, in one loop. Per step (query
block of BM rows, one query head), with S^T and dP^T in registers (keys are the rows):

    S^T  = K Q^T            (wgmma, A = K from shared memory)
    dP^T = V dO^T           (wgmma, A = V from shared memory)
    P^T  = exp2(S^T * scale * log2 e - lse2)          lse2 = lse * log2 e, per query (column)
    dS^T = P^T * (dP^T - delta)                       delta = rowsum(dO * O), per query
    dV  += P^T dO           (wgmma, A = P^T from registers)
    dK  += dS^T Q           (wgmma, A = dS^T from registers)
    dQ   = dS K             (wgmma, A = dS^T stored to shared memory, read transposed)

dK and dV stay in registers for the whole CTA (the GQA group's query heads reduce there, no
atomics); dQ of each step goes to shared memory, and a dedicated warp adds it into an fp32
buffer with a TMA reduce-add. A small pass converts that buffer to dq.

Warp roles (gl.warp_specialize): the default partition is two MMA warpgroups (keys 0-63 and
64-127 of the block, warps stacked along M of every key-major GEMM; dQ splits its columns
between them), worker 0 is one TMA loader warp, worker 1 the dQ reduce-add warp, both at a low
register budget.

Layouts. Tokens are packed (cu_seqlens); documents are never crossed: query blocks and key
blocks are document-local. The fp32 dQ buffer and the per-query vectors lse2 / delta use a
padded row layout in which every document starts at a multiple of BM (row = token - doc start +
padded doc start), so a query block's reduce-add box never touches another document. K, Q, dO
rows past the document end (loaded by TMA from the next document) are zeroed in shared memory
before a GEMM reduces over them (0 * Inf would be NaN); V's and masked scores are discarded by
selects. So every document's gradients depend on that document alone (P2), NaN/Inf included.

Recipes: bf16 (inputs bf16 or fp16, the tensors as given).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gluon_common import HAVE_GLUON
from .schedule import per_cu_seqlens

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    from .gluon_common import descriptor_2d, tma_reduce_add, wgmma_layout

LOG2E = 1.4426950408889634


BLOCK_N = 128           # keys per CTA (64 per MMA warpgroup)
STAGES = 2              # Q / dO ring depth
LOADER_REGS = 24        # setmaxnreg of the loader and dQ warps (the MMA warpgroups get 240)
DQ_REGS = 24


@dataclass(frozen=True)
class Sm90BwdConfig:
    block_m: int            # query rows per step

    @property
    def name(self) -> str:
        return f"m{self.block_m}n{BLOCK_N}"


def select_config(head_dim: int) -> Sm90BwdConfig:
    """Tiles: 128 keys per CTA; 64 query rows per step at D=128 (128 rows do not fit the
    registers next to dK and dV), 128 at D=64 (measured 12-16 % faster than 64 there)."""
    if head_dim not in (64, 128):
        raise ValueError(f"the sm90 backward supports head dims 64 and 128, not {head_dim}")
    return Sm90BwdConfig(block_m=128 if head_dim == 64 else 64)


# ---------------------------------------------------------------------------------------------
# Work list: key blocks by document, heaviest first, and the padded query-row layout
# ---------------------------------------------------------------------------------------------

@dataclass
class KeyBlocks:
    items: torch.Tensor     # (6, n_items) int32 rows, one column per CTA in launch order:
                            # document (-1: no work), key block, first token, length, padded
                            # first query row of the document, KV head
    n_items: int            # host bound on the number of real items (key blocks x KV heads)
    q_rows: int             # rows of the padded query layout (host bound, a multiple of BM)
    prow: torch.Tensor      # (T,) int32: padded row of every token


def key_blocks(cu_seqlens: torch.Tensor, T: int, BM: int, BN: int, causal: bool,
               n_kv_heads: int = 1) -> KeyBlocks:
    """The CTAs' work, one (key block, KV head) each, in launch order:

    - heaviest first by cost class (floor(log2(query blocks seen))): the long items of every
      KV head start early, so none of them ends the launch alone;
    - within a class, KV head, then document (heaviest first), then key block (heaviest first,
      ties in packed order): the CTAs resident at one time share one KV head and a few
      documents, so the Q, dO and dQ rows they all walk stay in L2;
    - padding items (doc -1) last.
    Within one (document, KV head), a lower key block never comes later (deterministic mode's
    dQ adds wait on them). Built on the device with no host sync; item count and padded rows
    bounded on the host (sum_d ceil(L_d / BN) <= T // BN + n_docs; sum_d ceil(L_d / BM) BM <=
    T + n_docs (BM - 1))."""
    dev = cu_seqlens.device
    n_docs = cu_seqlens.numel() - 1
    n = max(T // BN + n_docs, 1)
    N = n * n_kv_heads
    q_rows = max(-(-(T + n_docs * (BM - 1)) // BM) * BM, BM)
    if n_docs <= 0 or T == 0:
        return KeyBlocks(torch.full((6, N), -1, dtype=torch.int32, device=dev), N, q_rows,
                         torch.zeros((T,), dtype=torch.int32, device=dev))
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    nq = (lengths + BM - 1) // BM
    pq = torch.cumsum(nq * BM, 0) - nq * BM          # padded first row of each document
    nk = (lengths + BN - 1) // BN
    ends = torch.cumsum(nk, 0)
    idx = torch.arange(n, device=dev, dtype=torch.int64)
    doc = torch.searchsorted(ends, idx, right=True)
    valid = doc < n_docs
    d = doc.clamp(max=n_docs - 1)
    blk = idx - (ends[d] - nk[d])
    cost = nq[d] - (blk * BN) // BM if causal else nq[d]
    cost = torch.where(valid, cost, torch.full_like(cost, 0))
    cls = torch.where(valid, torch.floor(torch.log2(cost.clamp(min=1).double())).long(),
                      torch.full_like(cost, -1))
    doc_order = torch.argsort(nq, descending=True, stable=True)
    rank = torch.empty_like(doc_order)
    rank[doc_order] = torch.arange(n_docs, device=dev, dtype=torch.int64)
    drank = rank[d]
    # one column per (item, KV head); stable sorts, least significant key first
    pair = torch.arange(N, device=dev, dtype=torch.int64)
    it, kvh = pair % n, pair // n
    order = torch.argsort(it, stable=True)
    for key, desc in ((cost[it], True), (drank[it], False), (kvh, False), (cls[it], True)):
        order = order[torch.argsort(key[order], descending=desc, stable=True)]
    it, kvh = it[order], kvh[order]
    items = torch.stack([torch.where(valid, d, torch.full_like(d, -1))[it], blk[it],
                         cu[:-1][d][it], lengths[d][it], pq[d][it], kvh])
    tok = torch.arange(T, device=dev, dtype=torch.int64)
    tdoc = torch.searchsorted(cu[1:], tok, right=True).clamp(max=n_docs - 1)
    prow = tok - cu[:-1][tdoc] + pq[tdoc]
    return KeyBlocks(items.to(torch.int32).contiguous(), N, q_rows, prow.to(torch.int32))


# ---------------------------------------------------------------------------------------------
# Pre- and postprocess (Triton)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _bwd_preprocess(O, DO, LSE, PROW, LSE2, DELTA, T, QR, stride_t, D: tl.constexpr,
                    BT: tl.constexpr):
    """delta = rowsum(dO * O) and lse2 = lse * log2 e of tokens [pid * BT, +BT) of one head,
    written at their padded rows."""
    h = tl.program_id(1)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = t < T
    d = tl.arange(0, D)
    offs = t[:, None].to(tl.int64) * stride_t + h * D + d[None, :]
    o = tl.load(O + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    lse = tl.load(LSE + h.to(tl.int64) * T + t, mask=ok, other=0.0)
    pr = tl.load(PROW + t, mask=ok, other=0)
    tl.store(LSE2 + h.to(tl.int64) * QR + pr, lse * 1.4426950408889634, mask=ok)
    tl.store(DELTA + h.to(tl.int64) * QR + pr, delta, mask=ok)


@triton.jit
def _bwd_postprocess(DQA, PROW, DQ, T, scale, stride_t, D: tl.constexpr, BT: tl.constexpr):
    """dq[t, h] = scale * dq_acc[padded row of t, h]."""
    h = tl.program_id(1)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = t < T
    d = tl.arange(0, D)
    pr = tl.load(PROW + t, mask=ok, other=0).to(tl.int64)
    acc = tl.load(DQA + pr[:, None] * stride_t + h * D + d[None, :], mask=ok[:, None], other=0.0)
    tl.store(DQ + t[:, None].to(tl.int64) * stride_t + h * D + d[None, :],
             (acc * scale).to(DQ.dtype.element_ty), mask=ok[:, None])


# ---------------------------------------------------------------------------------------------
# The Gluon kernel
# ---------------------------------------------------------------------------------------------

if HAVE_GLUON:

    @gluon.jit
    def _item(ITEMS, N_ITEMS):
        """(doc, key block, first token, length, padded first query row, KV head) of this CTA
        (column program_id of the work list); doc < 0: no work."""
        item = gl.program_id(0)
        doc = gl.load(ITEMS + item)
        blk = gl.load(ITEMS + N_ITEMS + item)
        start = gl.load(ITEMS + 2 * N_ITEMS + item)
        L = gl.load(ITEMS + 3 * N_ITEMS + item)
        pq = gl.load(ITEMS + 4 * N_ITEMS + item)
        kvh = gl.load(ITEMS + 5 * N_ITEMS + item)
        return doc, blk, start, L, pq, kvh

    @gluon.jit
    def _query_blocks(k0, L, BM: gl.constexpr, CAUSAL: gl.constexpr):
        """(first query block, number of query blocks) that see keys [k0, k0 + BN)."""
        m_lo = k0 // BM if CAUSAL else k0 * 0
        return m_lo, (L + BM - 1) // BM - m_lo

    @gluon.jit
    def _next_step(h, q0, m_lo, n_m, BM: gl.constexpr):
        """(query head, first query row) of the step after (h, q0): the next query block, or the
        first block of the next head of the GQA group (counters, not a division per step)."""
        wrap = (q0 + BM == (m_lo + n_m) * BM).to(gl.int32)
        return h + wrap, q0 + BM - wrap * (n_m * BM)

    @gluon.jit
    def _zero_rows_from(tile, first, num_warps: gl.constexpr):
        """Zero rows >= first of a shared (R, C) tile in place: rows past the document end,
        which TMA brought from the next document, before a GEMM reduces over them."""
        R: gl.constexpr = tile.type.shape[0]
        C: gl.constexpr = tile.type.shape[1]
        TPR: gl.constexpr = C // 8
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPR, TPR], [num_warps, 1], [1, 0])
        x = tile.load(blk)
        r = gl.arange(0, R, layout=gl.SliceLayout(1, blk))
        x = gl.where(gl.expand_dims(r < first, 1), x, gl.zeros_like(x))
        tile.store(x)
        fence_async_shared()      # generic-proxy stores -> visible to wgmma (async proxy)
        gl.thread_barrier()

    @gluon.jit
    def _visible(k0, q0, L, BN: gl.constexpr, BM: gl.constexpr, s_layout: gl.constexpr,
                 CAUSAL: gl.constexpr):
        """(BN, BM) mask of an S^T tile (keys k0.., queries q0.., document-local): both inside
        the document and, causal, key <= query."""
        keys = gl.expand_dims(k0 + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout)), 1)
        qs = gl.expand_dims(q0 + gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout)), 0)
        ok = (keys < L) & (qs < L)
        if CAUSAL:
            ok = ok & (keys <= qs)
        return ok

    @gluon.jit
    def _column_vector(ring, s, layout: gl.constexpr):
        """Stage s of a (STAGES, 1, BM) fp32 ring (unswizzled) as a vector in `layout`."""
        BM: gl.constexpr = ring.type.shape[2]
        return ring.index(s)._reinterpret(gl.float32, [BM], gl.SwizzledSharedLayout(1, 1, 1, [0])
                                          ).load(layout)

    @gluon.jit
    def _bwd_loader(q_desc, do_desc, k_desc, v_desc, lse_desc, dl_desc, q_smem, do_smem, k_smem,
                    v_smem, lse_smem, dl_smem, kv_ready, q_ready, do_ready, q_free, ITEMS,
                    N_ITEMS, GROUP, CAUSAL: gl.constexpr):
        STAGES: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        D: gl.constexpr = q_smem.type.shape[2]
        BN: gl.constexpr = k_smem.type.shape[0]
        doc, blk, start, L, pq, kvh = _item(ITEMS, N_ITEMS)
        if doc >= 0:
            k0 = blk * BN
            mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [start + k0, kvh * D], kv_ready, k_smem)
            tma.async_copy_global_to_shared(v_desc, [start + k0, kvh * D], kv_ready, v_smem)
            m_lo, n_m = _query_blocks(k0, L, BM, CAUSAL)
            h = kvh * GROUP
            q0 = m_lo * BM
            for i in range(GROUP * n_m):
                s = i % STAGES
                mbarrier.wait(q_free.index(s), ((i // STAGES) + 1) & 1, pred=i >= STAGES)
                qb = q_ready.index(s)
                mbarrier.expect(qb, q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [start + q0, h * D], qb, q_smem.index(s))
                tma.async_copy_global_to_shared(lse_desc, [h, pq + q0], qb, lse_smem.index(s))
                db = do_ready.index(s)
                mbarrier.expect(db, do_desc.block_type.nbytes + dl_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(do_desc, [start + q0, h * D], db, do_smem.index(s))
                tma.async_copy_global_to_shared(dl_desc, [h, pq + q0], db, dl_smem.index(s))
                h, q0 = _next_step(h, q0, m_lo, n_m, BM)

    @gluon.jit
    def _bulk_writes_done():
        """Wait until this thread's bulk async operations have completed their writes (not only
        their shared-memory reads, as tma.store_wait does)."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, 0;", "=r,r",
                                  [gl.full([32], 0, gl.int32, one)], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _bwd_dq_writer(dq_desc, dq_smem, dq_ready, dq_free, SEM, ITEMS, N_ITEMS, GROUP,
                       QBLOCKS, BN: gl.constexpr, CAUSAL: gl.constexpr,
                       DETERMINISTIC: gl.constexpr):
        """Adds each step's dQ tile into the fp32 buffer. DETERMINISTIC: the adds into one
        (query head, query block) happen in key-block order 0, 1, ...: the CTA of key block b
        waits until SEM[head, block] == b and increments it once its add has landed. Every key
        block before b sees that query block too, and sits earlier in the work list (heavier,
        or the same cost and earlier in the document), so it was launched before: the wait
        cannot deadlock."""
        BM: gl.constexpr = dq_smem.type.shape[1]
        D: gl.constexpr = dq_smem.type.shape[2]
        doc, blk, start, L, pq, kvh = _item(ITEMS, N_ITEMS)
        if doc >= 0:
            m_lo, n_m = _query_blocks(blk * BN, L, BM, CAUSAL)
            h = kvh * GROUP
            q0 = m_lo * BM
            for i in range(GROUP * n_m):
                b = i % 2
                mbarrier.wait(dq_ready.index(b), (i // 2) & 1)
                if DETERMINISTIC:
                    sem = SEM + h * QBLOCKS + (pq + q0) // BM
                    turn = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
                    while turn != blk:
                        turn = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
                tma_reduce_add(dq_desc, [pq + q0, h * D], dq_smem.index(b))
                if DETERMINISTIC:
                    _bulk_writes_done()
                    gl.atomic_add(sem, 1, sem="release", scope="gpu")
                else:
                    tma.store_wait(0)
                mbarrier.arrive(dq_free.index(b), count=1)
                h, q0 = _next_step(h, q0, m_lo, n_m, BM)

    @gluon.jit
    def _bwd_compute(q_smem, do_smem, k_smem, v_smem, lse_smem, dl_smem, ds_smem, dq_smem,
                     kv_ready, q_ready, do_ready, q_free, dq_ready, dq_free, ITEMS, N_ITEMS,
                     GROUP, DK, DV, stride_kt, qk_scale_log2, sm_scale, CAUSAL: gl.constexpr,
                     num_warps: gl.constexpr):
        STAGES: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        D: gl.constexpr = q_smem.type.shape[2]
        BN: gl.constexpr = k_smem.type.shape[0]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = wgmma_layout(num_warps, 1, BM, 16)       # S^T, dP^T (BN, BM)
        kv_layout: gl.constexpr = wgmma_layout(num_warps, 1, D, 16)       # dK, dV (BN, D)
        if BM == 16 * num_warps:
            dq_layout: gl.constexpr = wgmma_layout(num_warps, 1, D, 16)   # dQ (BM, D)
        else:
            dq_layout: gl.constexpr = wgmma_layout(4, num_warps // 4, D // (num_warps // 4), 16)
        a_layout: gl.constexpr = gl.DotOperandLayout(0, kv_layout, 2)
        col_l: gl.constexpr = gl.SliceLayout(0, s_layout)

        doc, blk, start, L, pq, kvh = _item(ITEMS, N_ITEMS)
        if doc >= 0:
            k0 = blk * BN
            m_lo, n_m = _query_blocks(k0, L, BM, CAUSAL)
            mbarrier.wait(kv_ready, 0)
            if k0 + BN > L:
                _zero_rows_from(k_smem, L - k0, num_warps)
            dk = gl.zeros([BN, D], gl.float32, kv_layout)
            dv = gl.zeros([BN, D], gl.float32, kv_layout)
            for i in range(GROUP * n_m):
                q0 = (m_lo + i % n_m) * BM
                s = i % STAGES
                ph = (i // STAGES) & 1
                q_tile = q_smem.index(s)
                do_tile = do_smem.index(s)
                edge_q = q0 + BM > L
                mbarrier.wait(q_ready.index(s), ph)
                if edge_q:
                    _zero_rows_from(q_tile, L - q0, num_warps)
                st = warpgroup_mma(k_smem, q_tile.permute((1, 0)),
                                   gl.zeros([BN, BM], gl.float32, s_layout), use_acc=False,
                                   is_async=True)
                mbarrier.wait(do_ready.index(s), ph)
                if edge_q:
                    _zero_rows_from(do_tile, L - q0, num_warps)
                dpt = warpgroup_mma(v_smem, do_tile.permute((1, 0)),
                                    gl.zeros([BN, BM], gl.float32, s_layout), use_acc=False,
                                    is_async=True)
                st = warpgroup_mma_wait(1, deps=[st])
                if CAUSAL:
                    masked = (q0 < k0 + BN - 1) | edge_q | (k0 + BN > L)
                else:
                    masked = edge_q | (k0 + BN > L)
                # P^T while dP^T runs; lse2 dies before delta is loaded (registers at BM=128)
                lse2 = gl.expand_dims(_column_vector(lse_smem, s, col_l), 0)
                pt = gl.exp2(st * qk_scale_log2 - lse2)
                if masked:
                    ok = _visible(k0, q0, L, BN, BM, s_layout, CAUSAL)
                    pt = gl.where(ok, pt, 0.0)
                dpt = warpgroup_mma_wait(0, deps=[dpt])
                delta = gl.expand_dims(_column_vector(dl_smem, s, col_l), 0)
                dst = pt * (dpt - delta)
                if masked:    # dP^T of keys past the document end may be NaN (V not zeroed)
                    dst = gl.where(_visible(k0, q0, L, BN, BM, s_layout, CAUSAL), dst, 0.0)
                pa = gl.convert_layout(pt.to(dtype), a_layout)
                dv = warpgroup_mma(pa, do_tile, dv, is_async=True)
                dsb = dst.to(dtype)
                ds_smem.store(dsb)
                fence_async_shared()
                gl.thread_barrier()
                dsa = gl.convert_layout(dsb, a_layout)
                # dQ first: it goes to shared memory while dK runs
                dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem,
                                   gl.zeros([BM, D], gl.float32, dq_layout), use_acc=False,
                                   is_async=True)
                dk = warpgroup_mma(dsa, q_tile, dk, is_async=True)
                dv, dq = warpgroup_mma_wait(1, deps=[dv, dq])
                b = i % 2
                mbarrier.wait(dq_free.index(b), ((i // 2) + 1) & 1, pred=i >= 2)
                dq_smem.index(b).store(dq)
                fence_async_shared()
                mbarrier.arrive(dq_ready.index(b), count=1)
                dk = warpgroup_mma_wait(0, deps=[dk])
                mbarrier.arrive(q_free.index(s), count=1)
            # epilogue: dK (times the softmax scale) and dV of the keys inside the document
            rows = gl.expand_dims(k0 + gl.arange(0, BN, layout=gl.SliceLayout(1, kv_layout)), 1)
            cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout)), 0)
            offs = (start + rows).to(gl.int64) * stride_kt + kvh * D + cols
            keep = rows < L
            gl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=keep)
            gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=keep)

    @gluon.jit
    def _attn_bwd_sm90_kernel(q_desc, do_desc, k_desc, v_desc, lse_desc, dl_desc, dq_desc, DK, DV,
                              SEM, ITEMS, N_ITEMS, GROUP, QBLOCKS, stride_kt, qk_scale_log2,
                              sm_scale,
                              BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                              STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                              LOADER_REGS: gl.constexpr, DQ_REGS: gl.constexpr,
                              DETERMINISTIC: gl.constexpr,
                              num_warps: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, D], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BN, D], v_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BM], lse_desc.layout)
        dl_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BM], dl_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                       element_bitwidth=16, rank=2)
        ds_smem = gl.allocate_shared_memory(dtype, [BN, BM], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BM, D], dq_desc.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(q_free.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(dq_ready.index(i), count=1)
            mbarrier.init(dq_free.index(i), count=1)
        gl.warp_specialize([
            (_bwd_compute, (q_smem, do_smem, k_smem, v_smem, lse_smem, dl_smem, ds_smem, dq_smem,
                            kv_ready, q_ready, do_ready, q_free, dq_ready, dq_free, ITEMS,
                            N_ITEMS, GROUP, DK, DV, stride_kt, qk_scale_log2, sm_scale,
                            CAUSAL, num_warps)),
            (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, lse_desc, dl_desc, q_smem, do_smem,
                           k_smem, v_smem, lse_smem, dl_smem, kv_ready, q_ready, do_ready, q_free,
                           ITEMS, N_ITEMS, GROUP, CAUSAL)),
            (_bwd_dq_writer, (dq_desc, dq_smem, dq_ready, dq_free, SEM, ITEMS, N_ITEMS,
                              GROUP, QBLOCKS, BN, CAUSAL, DETERMINISTIC)),
        ], [1, 1], [LOADER_REGS, DQ_REGS])
        mbarrier.invalidate(kv_ready)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(q_ready.index(i))
            mbarrier.invalidate(do_ready.index(i))
            mbarrier.invalidate(q_free.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(dq_ready.index(i))
            mbarrier.invalidate(dq_free.index(i))


# ---------------------------------------------------------------------------------------------
# Host
# ---------------------------------------------------------------------------------------------

PRE_BT = 64


def attention_backward_sm90(dout, out, lse, q, k, v, cu_seqlens, causal=True, softmax_scale=None,
                            grad_dtype=None, deterministic=False,
                            config: Sm90BwdConfig | None = None):
    """(dq, dk, dv) of causal (or full) attention over packed documents.

    q, dout, out (T, Hq, D); k, v (T, Hkv, D), bf16 or fp16, unit stride in D; lse (Hq, T) fp32,
    natural log of the softmax-scaled scores (the forward's); cu_seqlens int32 (n_docs + 1,)
    with cu_seqlens[-1] == T. By default the dQ adds of different key blocks land in any order
    (fp32 sums not bitwise reproducible between runs; dK and dV are); deterministic=True orders
    them (bitwise reproducible, at the cost of waits).
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    cfg = config or select_config(D)
    BM, BN = cfg.block_m, BLOCK_N
    dev = q.device
    grad_dtype = grad_dtype or dout.dtype
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    q, k, v, dout, out = (x.contiguous() for x in (q, k, v, dout, out))
    dq = torch.empty((T, Hq, D), dtype=grad_dtype, device=dev)
    dk = torch.empty((T, Hkv, D), dtype=grad_dtype, device=dev)
    dv = torch.empty((T, Hkv, D), dtype=grad_dtype, device=dev)
    if T == 0:
        return dq, dk, dv
    kb = per_cu_seqlens(cu_seqlens, ("bwd_sm90", T, BM, BN, bool(causal), Hkv),
                        lambda: key_blocks(cu_seqlens, T, BM, BN, causal, Hkv))
    QR = kb.q_rows
    lse2 = torch.empty((Hq, QR), dtype=torch.float32, device=dev)
    delta = torch.empty((Hq, QR), dtype=torch.float32, device=dev)
    dq_acc = torch.zeros((QR, Hq, D), dtype=torch.float32, device=dev)
    grid_t = (triton.cdiv(T, PRE_BT), Hq)
    _bwd_preprocess[grid_t](out, dout, lse.contiguous(), kb.prow, lse2, delta, T, QR, Hq * D,
                            D=D, BT=PRE_BT, num_warps=4)
    q_desc = descriptor_2d(q, T, Hq * D, Hq * D, [BM, D])
    do_desc = descriptor_2d(dout, T, Hq * D, Hq * D, [BM, D])
    k_desc = descriptor_2d(k, T, Hkv * D, Hkv * D, [BN, D])
    v_desc = descriptor_2d(v, T, Hkv * D, Hkv * D, [BN, D])
    lse_desc = descriptor_2d(lse2, Hq, QR, QR, [1, BM])
    dl_desc = descriptor_2d(delta, Hq, QR, QR, [1, BM])
    dq_desc = descriptor_2d(dq_acc, QR, Hq * D, Hq * D, [BM, D])
    sem = (torch.zeros((Hq, QR // BM), dtype=torch.int32, device=dev) if deterministic
           else kb.items)      # (never read when not deterministic)
    _attn_bwd_sm90_kernel[(kb.n_items,)](
        q_desc, do_desc, k_desc, v_desc, lse_desc, dl_desc, dq_desc, dk, dv, sem, kb.items,
        kb.n_items, Hq // Hkv, QR // BM, Hkv * D, scale * LOG2E, scale, BM=BM, BN=BN, D=D,
        STAGES=STAGES, CAUSAL=bool(causal), LOADER_REGS=LOADER_REGS, DQ_REGS=DQ_REGS,
        DETERMINISTIC=bool(deterministic), num_warps=8)
    _bwd_postprocess[grid_t](dq_acc, kb.prow, dq, T, scale, Hq * D, D=D, BT=PRE_BT, num_warps=4)
    return dq, dk, dv
