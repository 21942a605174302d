"""Hopper (sm_90a) attention backward in Gluon: one pass, five GEMMs per tile, dQ written by TMA.

One CTA owns one key block (BN keys of one document) of one KV head and walks every query block that
sees it, for every query head of the KV head's GQA group, in one loop; recipes bf16 (bf16 or fp16
inputs as given) and fp8 (every GEMM in FP8: "The fp8 recipe" below). Per step (query block of BM
rows, one query head), with S^T and dP^T in registers (keys are the rows):

    S^T  = K Q^T            (wgmma, A = K from shared memory)
    dP^T = V dO^T           (wgmma, A = V from shared memory)
    P^T  = exp2(S^T * scale * log2 e - lse2)          lse2 = lse * log2 e, per query (column)
    dS^T = P^T * (dP^T - delta)                       delta = rowsum(dO * O), per query
    dV  += P^T dO           (wgmma, A = P^T from registers)
    dK  += dS^T Q           (wgmma, A = dS^T from registers)
    dQ   = dS K             (wgmma, A = dS^T stored to shared memory, read transposed)

dK and dV stay in registers for the whole CTA (the GQA group's query heads reduce there, no
atomics); dQ of each step goes to shared memory (rows in dq_row_host's order, for conflict-free
stores), and a dedicated warp writes it into an fp32 buffer by TMA: the first tile to reach a
(query head, query block) is stored, the later ones reduce-added (_bwd_dq_writer), so the buffer is
never zeroed. A small pass converts that buffer to dq. Warp roles (gl.warp_specialize): two MMA
warpgroups in the default partition (keys 0-63 and 64-127 of the block, warps stacked along M of
every key-major GEMM; dQ splits its columns between them), one TMA loader warp and the dQ writer
warp, both at a low register budget.

Layouts. Tokens are packed (cu_seqlens); documents are never crossed: query blocks and key blocks
are document-local. The fp32 dQ buffer and the per-query vectors lse2 / delta use a padded row
layout in which every document starts at a multiple of BM (row = token - doc start + padded doc
start), so a query block's reduce-add box never touches another document. K, Q, dO rows past the
document end (loaded by TMA from the next document) are zeroed in shared memory before a GEMM
reduces over them (0 * Inf would be NaN); V's and masked scores are discarded by selects. So every
document's gradients depend on that document alone (P2), NaN/Inf included.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .config import (SM90_BLOCK_N, SM90_DQ_REGS, SM90_LOADER_REGS, SM90_PASS_ROWS, SM90_STAGES,
                     Sm90BwdConfig, sm90_backward_config)
from .gluon_common import HAVE_GLUON
from .kmajor import ORDER_MMA_A, ORDER_PAIRS, check_copy, copy_columns
from .launch import launch_kernel
from .numerics import (EXP2_FMA_PTX, LOG2E, fwht, log2_pow2, pow2_scale_bits,
                       sylvester_parity_host)
from .schedule import per_cu_seqlens

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    from .gluon_common import (alloc_barriers, arrive_synced, descriptor_2d, invalidate_barriers,
                               tma_reduce_add, wgmma_layout)
    from .kmajor import mma_key_order_gluon
    _sylvester_parity = gluon.jit(sylvester_parity_host)
    _EXP2_FMA_ASM = gl.constexpr(EXP2_FMA_PTX.replace("$IN", "$1").replace("$OUT", "$0"))
    _pow2_scale_bits = gluon.jit(pow2_scale_bits.fn)


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
               n_kv_heads: int = 1, pad: int | None = None) -> KeyBlocks:
    """The CTAs' work, one (key block, KV head) each, in launch order:

    - heaviest first by cost class (floor(log2(query blocks seen)); all items under 8 query blocks
      form one class): every KV head's long items start early, none ends the launch alone;
    - within a class by KV head, document (heaviest first), key block (heaviest first, ties in
      packed order): CTAs resident at one time share one KV head and a few documents, whose Q, dO
      and dQ rows stay in L2; a short document's key blocks stay together (benchmarks/NOTES.md);
    - padding items (doc -1) last.
    Within one (document, KV head), a lower key block never comes later (deterministic mode's dQ
    adds wait on them). In the padded row layout every document starts at a multiple of `pad`
    (default BM; a multiple of BM). Built on the device with no host sync; item count and padded
    rows bounded on the host (sum_d ceil(L_d / BN) <= T // BN + n_docs;
    sum_d ceil(L_d / pad) pad <= T + n_docs (pad - 1))."""
    pad = pad or BM
    dev = cu_seqlens.device
    n_docs = cu_seqlens.numel() - 1
    n = max(T // BN + n_docs, 1)
    N = n * n_kv_heads
    q_rows = max(-(-(T + n_docs * (pad - 1)) // pad) * pad, pad)
    if n_docs <= 0 or T == 0:
        return KeyBlocks(torch.full((6, N), -1, dtype=torch.int32, device=dev), N, q_rows,
                         torch.zeros((T,), dtype=torch.int32, device=dev))
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    nq = (lengths + BM - 1) // BM
    npad = (lengths + pad - 1) // pad * pad
    pq = torch.cumsum(npad, 0) - npad                # padded first row of each document
    nk = (lengths + BN - 1) // BN
    ends = torch.cumsum(nk, 0)
    idx = torch.arange(n, device=dev, dtype=torch.int64)
    doc = torch.searchsorted(ends, idx, right=True)
    valid = doc < n_docs
    d = doc.clamp(max=n_docs - 1)
    blk = idx - (ends[d] - nk[d])
    cost = nq[d] - (blk * BN) // BM if causal else nq[d]
    cost = torch.where(valid, cost, torch.full_like(cost, 0))
    cls = torch.where(valid, torch.floor(torch.log2(cost.clamp(min=8).double())).long(),
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


def dq_row_host(r):
    """The row of the fp32 dQ buffer that holds padded query row r: bits 0-2 of r = (a2 a1 a0) ->
    (a1 a0 a2), bits 3 and up unchanged (a permutation inside every 8-row group, so inside every
    query block). The kernels store each dQ tile with its rows in this order: a warp's accumulator
    store then covers rows {0, 2, 4, 6} (or {1, 3, 5, 7}) of the 128-byte-swizzled tile in each
    half-warp phase, whose bank groups differ, where rows l and l + 1 would share theirs (a two-way
    conflict on every dQ store: ncu at doc32k, benchmarks/NOTES.md). Plain operators: torch
    tensors / ints here, Triton tensors as `_dq_row`."""
    return (r & -8) | ((r & 3) << 1) | ((r >> 2) & 1)


def dq_rows_stored_host(x):
    """x (rows, D), rows a multiple of 8, with its rows in dq_row order: row dq_row_host(a) of the
    result is row a of x. A reshape / permute of the row index's 3 low bits, so a register tensor's
    values stay in their threads and the shared-memory store computes the permuted addresses.
    Tensor methods only: torch tensors here, Gluon tensors as `_dq_rows_stored`."""
    return x.reshape([x.shape[0] // 8, 2, 2, 2, x.shape[1]]).permute((0, 2, 3, 1, 4)) \
            .reshape([x.shape[0], x.shape[1]])


# The steps of a CTA: per query head of its GQA group, the query blocks that see its keys; the
# group's first head from the key block's own block upwards, the later heads downwards from the
# document's last block. Why: a key block has BN / BM steps per head fewer than the one before
# it, so CTAs that start together drift apart by that much per head. Walking upwards, the CTAs of
# neighbouring key blocks read a Q / dO block of head h (and add to its dQ rows) (h + 1) BN / BM
# steps apart, walking downwards h BN / BM: the rows stay in L2 between the two reads (at doc32k,
# 132 CTAs x 64 KB a step against the 50 MB L2; benchmarks/NOTES.md). Two forms of one order:
# counters (the loader, the dQ writer, the helper warps and the 64-row steps) and a division by
# step index (the 128-row steps, where a carried counter spills); tests/test_backward_sm90.py
# holds them equal. Plain operators: ints here, Gluon tensors as `_first_step` etc.

def first_step_host(m_lo, n_m, BM):
    """(first query row, row step, row where the head ends) of a CTA's first step."""
    return m_lo * BM, BM, (m_lo + n_m - 1) * BM


def next_step_host(h, q0, dq0, q_end, m_lo, n_m, BM):
    """(query head, first query row, row step, end row) of the step after (h, q0): the next
    query block of this head in its direction, or, after the head's end row, the next head's
    last block, walking down."""
    wrap = (q0 == q_end) * 1
    last = (m_lo + n_m - 1) * BM
    nq0 = q0 + dq0 + wrap * (last - q0 - dq0)
    return h + wrap, nq0, dq0 - wrap * (dq0 + BM), q_end + wrap * (m_lo * BM - q_end)


def step_q0_host(i, m_lo, n_m, BM):
    """First query row of step i (of head i // n_m), by a division."""
    j = i % n_m
    up = (i < n_m) * 1
    return (m_lo + up * j + (1 - up) * (n_m - 1 - j)) * BM


_dq_row = triton.jit(dq_row_host)
if HAVE_GLUON:
    _dq_rows_stored = gluon.jit(dq_rows_stored_host)
    _first_step = gluon.jit(first_step_host)
    _next_step = gluon.jit(next_step_host)
    _step_q0 = gluon.jit(step_q0_host)


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
    """dq[t, h] = scale * dq_acc[dq_row(padded row of t), h]."""
    h = tl.program_id(1)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = t < T
    d = tl.arange(0, D)
    pr = _dq_row(tl.load(PROW + t, mask=ok, other=0)).to(tl.int64)
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
    def _visible_tile(k0, q0, L, BN: gl.constexpr, BM: gl.constexpr, s_layout: gl.constexpr,
                      CAUSAL: gl.constexpr):
        """(BN, BM) boolean mask of an S^T tile (keys k0.., queries q0.., document-local): both
        inside the document and, causal, key <= query. The bf16 kernel's and the fp8 D=64
        step's form: there _visible / _keep measured slower (bf16: more SASS per step and
        spills at D=64 in the CPU build; fp8 D=64: 3-4 % on the H200 with equal SASS)."""
        keys = gl.expand_dims(k0 + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout)), 1)
        qs = gl.expand_dims(q0 + gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout)), 0)
        ok = (keys < L) & (qs < L)
        if CAUSAL:
            ok = ok & (keys <= qs)
        return ok

    @gluon.jit
    def _visible(k0, q0, L, BN: gl.constexpr, BM: gl.constexpr, s_layout: gl.constexpr,
                 CAUSAL: gl.constexpr):
        """The visible pairs of an S^T tile (keys k0.. as rows, queries q0.. as columns,
        document-local: both inside the document and, causal, key <= query) as two int32
        vectors for _keep: (cv (1, BM), lo (BN, 1)), pair (r, c) visible iff cv_c >= lo_r, with
        cv_c = c (-2^30 for a query past the end) and lo_r = r + k0 - q0 causal, else 0 (BM for
        a key past the end)."""
        r = gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
        c = gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout))
        if CAUSAL:
            lo = r + (k0 - q0)
        else:
            lo = gl.zeros_like(r)
        lo = gl.where(r < L - k0, lo, BM)
        cv = gl.where(c < L - q0, c, -(1 << 30))
        return gl.expand_dims(cv, 0), gl.expand_dims(lo, 1)

    @gluon.jit
    def _keep(x, vis):
        """x on the visible pairs vis = _visible(...), else 0. The compare and the select are
        one asm block at each use, so no tile of booleans is kept (ptxas holds one packed in
        registers and unpacks it per element: ~3 more instructions each)."""
        cv, lo = vis
        cv, lo = gl.broadcast(cv, lo)
        x, cv = gl.broadcast(x, cv)
        x, lo = gl.broadcast(x, lo)
        return gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ge.s32 p, $2, $3; selp.f32 $0, $1, 0f00000000, p; }",
            "=r,r,r,r", [x, cv, lo], dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _store_grad(x, desc, stage, X, start, k0, L, kvh, stride_kt):
        """dK or dV, (BN, D) fp32 in registers, of keys k0.. of a document (first token start,
        length L) into X (T, Hkv, D). A key block inside its document leaves by a TMA store
        through `stage`, a shared tile that is dead by now and holds a 16-bit (BN, D) box (the
        caller waits for the copy, tma.store_wait, before the CTA ends); one reaching past the
        document's end (a TMA box would overwrite the next document's first rows), and 32-bit
        gradients, by row-masked stores from registers (for both gradients ~2.6 us of every
        CTA's end at D=64 when all blocks stored that way: benchmarks/NOTES.md)."""
        BN: gl.constexpr = x.type.shape[0]
        D: gl.constexpr = x.type.shape[1]
        out_t: gl.constexpr = X.dtype.element_ty
        inside = k0 + BN <= L
        if out_t.primitive_bitwidth != 16:
            inside = False
        if inside:
            gl.thread_barrier()    # both warpgroups' last reads of `stage` are done
            st = stage._reinterpret(out_t, [BN, D], desc.layout)
            st.store(x.to(out_t))
            fence_async_shared()   # generic-proxy writes -> visible to the TMA
            gl.thread_barrier()    # every warp's rows written before the copy starts
            tma.async_copy_shared_to_global(desc, [start + k0, kvh * D], st)
        else:
            x_layout: gl.constexpr = x.type.layout
            rows = gl.expand_dims(k0 + gl.arange(0, BN, layout=gl.SliceLayout(1, x_layout)), 1)
            cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, x_layout)), 0)
            offs = (start + rows).to(gl.int64) * stride_kt + kvh * D + cols
            gl.store(X + offs, x.to(out_t), mask=rows < L)

    @gluon.jit
    def _ring_row(ring, s):
        """Stage s of a (STAGES, 1, BM) fp32 ring (unswizzled) as a (BM,) shared view."""
        BM: gl.constexpr = ring.type.shape[2]
        return ring.index(s)._reinterpret(gl.float32, [BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    @gluon.jit
    def _column_vector(ring, s, layout: gl.constexpr):
        """Stage s of a (STAGES, 1, BM) fp32 ring as a vector in `layout`."""
        return _ring_row(ring, s).load(layout)

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
            q0, dq0, q_end = _first_step(m_lo, n_m, BM)
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
                h, q0, dq0, q_end = _next_step(h, q0, dq0, q_end, m_lo, n_m, BM)

    @gluon.jit
    def _bulk_writes_done():
        """Wait until this thread's bulk async operations have completed their writes (not only
        their shared-memory reads, as tma.store_wait does), ordered before the generic-proxy
        release that follows."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; "
                                  "mov.u32 $0, 0;", "=r,r",
                                  [gl.full([32], 0, gl.int32, one)], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _acquired_before_bulk():
        """Orders the generic-proxy acquire before this thread's next bulk async operation."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r,r",
                                  [gl.full([32], 0, gl.int32, one)], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _bwd_dq_writer(dq_desc, dq_smem, dq_ready, dq_free, SEM, ITEMS, N_ITEMS, GROUP,
                       QBLOCKS, BN: gl.constexpr, CAUSAL: gl.constexpr,
                       DETERMINISTIC: gl.constexpr):
        """Writes each step's dQ tile into the fp32 buffer, which nobody zeroes: the first tile to
        reach a (query head, query block) is stored, every later one reduce-added once that store
        has landed. SEM[head, block] (zeroed by the caller) says which: by default the writers
        claim it (0 -> 1 by compare-and-swap; the winner stores, then sets 2 once the store has
        landed; the others wait for 2, which only waits on a store already issued, so it cannot
        deadlock). DETERMINISTIC: the adds happen in key-block order 0, 1, ...: the CTA of key
        block b waits until SEM == b and increments it once its write has landed; key block 0,
        which sees every query block of its document, stores. Every key block before b sees that
        query block too, and sits earlier in the work list (heavier, or the same cost and earlier
        in the document), so it was launched before: the wait cannot deadlock."""
        BM: gl.constexpr = dq_smem.type.shape[1]
        D: gl.constexpr = dq_smem.type.shape[2]
        doc, blk, start, L, pq, kvh = _item(ITEMS, N_ITEMS)
        if doc >= 0:
            m_lo, n_m = _query_blocks(blk * BN, L, BM, CAUSAL)
            h = kvh * GROUP
            q0, dq0, q_end = _first_step(m_lo, n_m, BM)
            for i in range(GROUP * n_m):
                b = i % 2
                mbarrier.wait(dq_ready.index(b), (i // 2) & 1)
                sem = SEM + h * QBLOCKS + (pq + q0) // BM
                if DETERMINISTIC:
                    turn = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
                    while turn != blk:
                        turn = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
                    first = blk == 0
                else:
                    state = gl.atomic_cas(sem, 0, 1, sem="acquire", scope="gpu")
                    first = state == 0
                    while state == 1:
                        state = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
                _acquired_before_bulk()
                if first:
                    tma.async_copy_shared_to_global(dq_desc, [pq + q0, h * D], dq_smem.index(b))
                else:
                    tma_reduce_add(dq_desc, [pq + q0, h * D], dq_smem.index(b))
                tma.store_wait(0)
                mbarrier.arrive(dq_free.index(b), count=1)
                if DETERMINISTIC:
                    _bulk_writes_done()
                    gl.atomic_add(sem, 1, sem="release", scope="gpu")
                elif first:
                    _bulk_writes_done()
                    gl.atomic_xchg(sem, 2, sem="release", scope="gpu")
                h, q0, dq0, q_end = _next_step(h, q0, dq0, q_end, m_lo, n_m, BM)

    @gluon.jit
    def _release_step(dq_ready, q_free, j):
        """Step j's releases, one barrier for both: its dQ tile written (to the dQ writer) and
        its Q / dO stage read by its last wgmma (dK's, retired by every warp before); the
        barrier also keeps the next step's dS store behind every warp's dQ wgmma. Called at the
        next step's head, after its S^T and dP^T are issued, so that the tensor cores start
        them without waiting for the barrier (j < 0: none; benchmarks/NOTES.md, 2026-12-06).
        The fp8 kernel's short-document mode releases at the step's end instead: its helper
        warps, behind the loader, need the stage back at once. The fence comes after dK's wait:
        ptxas 12.8 crashes on the other order."""
        STAGES: gl.constexpr = q_free.type.shape[0]
        fence_async_shared()
        gl.thread_barrier()
        jj = gl.maximum(j, 0)
        arrive_synced(dq_ready.index(jj % 2), j >= 0)
        arrive_synced(q_free.index(jj % STAGES), j >= 0)

    @gluon.jit
    def _p_ds(st, dpt, lse_smem, dl_smem, s, col_l: gl.constexpr, qk_scale_log2, k0, q0, L,
              masked, BN: gl.constexpr, BM: gl.constexpr, s_layout: gl.constexpr,
              CAUSAL: gl.constexpr):
        """(P^T, dS^T) of a bf16 step from S^T and the in-flight dP^T: P^T while dP^T runs (lse2
        dies before delta is loaded: registers at BM=128), then the wait, then dS^T, and on a
        `masked` step both set to zero outside the visible (key, query) pairs at the end (an
        exp2 of a masked key may be inf and dS^T NaN there, dP^T of keys past the document end
        too: V is not zeroed; the selects drop them). No branch sits between the exp2s and dS^T's
        math, so ptxas interleaves them (the MUFU pipe otherwise takes them in one burst of
        ~20-44 per warp while the FMA pipe idles)."""
        lse2 = gl.expand_dims(_column_vector(lse_smem, s, col_l), 0)
        pt = gl.exp2(st * qk_scale_log2 - lse2)
        dpt = warpgroup_mma_wait(0, deps=[dpt])
        delta = gl.expand_dims(_column_vector(dl_smem, s, col_l), 0)
        dst = pt * (dpt - delta)
        if masked:
            ok = _visible_tile(k0, q0, L, BN, BM, s_layout, CAUSAL)
            pt = gl.where(ok, pt, 0.0)
            dst = gl.where(ok, dst, 0.0)
        return pt, dst

    @gluon.jit
    def _bwd_compute(q_smem, do_smem, k_smem, v_smem, lse_smem, dl_smem, ds_smem, dq_smem,
                     kv_ready, q_ready, do_ready, q_free, dq_ready, dq_free, ITEMS, N_ITEMS,
                     GROUP, DK, DV, dk_desc, dv_desc, stride_kt, qk_scale_log2, sm_scale,
                     CAUSAL: gl.constexpr,
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
            q0, dq0, q_end = _first_step(m_lo, n_m, BM)
            for i in range(GROUP * n_m):
                if BM == 128:   # a division per step: a carried counter spills at D=64
                    q0 = _step_q0(i, m_lo, n_m, BM)
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
                _release_step(dq_ready, q_free, i - 1)
                st = warpgroup_mma_wait(1, deps=[st])
                if CAUSAL:
                    masked = (q0 < k0 + BN - 1) | edge_q | (k0 + BN > L)
                else:
                    masked = edge_q | (k0 + BN > L)
                # one straight block, the masks at its end: P^T's exp2 spread over dS^T's math
                pt, dst = _p_ds(st, dpt, lse_smem, dl_smem, s, col_l, qk_scale_log2, k0, q0, L,
                                masked, BN, BM, s_layout, CAUSAL)
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
                dq_smem.index(b).store(_dq_rows_stored(dq))
                dk = warpgroup_mma_wait(0, deps=[dk])
                if BM == 64:    # counters, not an integer division (~25 SASS) per step
                    _h, q0, dq0, q_end = _next_step(0, q0, dq0, q_end, m_lo, n_m, BM)
            _release_step(dq_ready, q_free, GROUP * n_m - 1)
            # epilogue: dK (times the softmax scale) and dV of the keys inside the document
            _store_grad(dv, dv_desc, v_smem, DV, start, k0, L, kvh, stride_kt)
            _store_grad(dk * sm_scale, dk_desc, k_smem, DK, start, k0, L, kvh, stride_kt)
            tma.store_wait(0)       # the tiles stay allocated until the copies have read them

    # values that follow cu_seqlens are not specialized on: one build for every split
    @gluon.jit(do_not_specialize=["N_ITEMS", "QBLOCKS"])
    def _attn_bwd_sm90_kernel(q_desc, do_desc, k_desc, v_desc, lse_desc, dl_desc, dq_desc,
                              dk_desc, dv_desc, DK, DV,
                              SEM, ITEMS, N_ITEMS, GROUP, QBLOCKS, stride_kt, qk_scale_log2,
                              sm_scale, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                              STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                              LOADER_REGS: gl.constexpr, DQ_REGS: gl.constexpr,
                              DETERMINISTIC: gl.constexpr, num_warps: gl.constexpr):
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
        kv_ready = alloc_barriers(1).index(0)
        q_ready, do_ready = alloc_barriers(STAGES), alloc_barriers(STAGES)
        q_free = alloc_barriers(STAGES)
        dq_ready, dq_free = alloc_barriers(2), alloc_barriers(2)
        gl.warp_specialize([
            (_bwd_compute, (q_smem, do_smem, k_smem, v_smem, lse_smem, dl_smem, ds_smem, dq_smem,
                            kv_ready, q_ready, do_ready, q_free, dq_ready, dq_free, ITEMS,
                            N_ITEMS, GROUP, DK, DV, dk_desc, dv_desc, stride_kt,
                            qk_scale_log2, sm_scale,
                            CAUSAL, num_warps)),
            (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, lse_desc, dl_desc, q_smem, do_smem,
                           k_smem, v_smem, lse_smem, dl_smem, kv_ready, q_ready, do_ready, q_free,
                           ITEMS, N_ITEMS, GROUP, CAUSAL)),
            (_bwd_dq_writer, (dq_desc, dq_smem, dq_ready, dq_free, SEM, ITEMS, N_ITEMS,
                              GROUP, QBLOCKS, BN, CAUSAL, DETERMINISTIC)),
        ], [1, 1], [LOADER_REGS, DQ_REGS])
        mbarrier.invalidate(kv_ready)
        invalidate_barriers((q_ready, do_ready, q_free, dq_ready, dq_free))


# ---------------------------------------------------------------------------------------------
# The fp8 recipe (scaling "kvblock128", reference.py "Token-block scaling"): every GEMM in FP8
# ---------------------------------------------------------------------------------------------
#
# Operands (e4m3). Row-major, as the forward quantized them: q8 (T, Hq, D) per-token scales sq;
# k8 / v8 the K / V block copies (one scale per document-local 128-token block: a CTA scalar) and,
# causal, k8_diag / v8_diag the per-token copies of the diagonal pairs. Hopper's FP8 wgmma reads
# both operands K-major, so the preprocess adds dO quantized per 64-row block (do8, token layout)
# and K-major copies in the 128-aligned padded layout (columns = padded rows, zeros between
# documents): dO^T and Q^T (Hq, D, QR) for dV += P^T dO and dK += dS^T Q, columns in wgmma order
# within 16 (flamia.ops.kmajor: X^T's and Y^T's accumulators are then the A operands), and K^T of
# the block copy (Hkv, D, QR) for dQ = dS K, columns in pair order within 16 (the kernel stores dS
# as 2-byte, not 1-byte, values). At D=128 on short documents (config.fp8_kmajor_onchip) the
# kernel makes dO^T and Q^T itself: the two helper warps build each step's tiles in shared memory
# from the do8 / q8 tiles, and the preprocess writes only K^T.
#
# Per step (query block i0.., head h; keys k0.. of the CTA) with the preprocess's per-row vectors
# A = qk_scale log2e sq, B = lse log2e - log2 sdo (+inf for an all-zero dO row), Hv = sqf (0 for a
# zero dO row), E = delta sqf / sdo (0 there), and the CTA scalars c_pt, c_ds (the per-CTA bounds),
# R = c_pt / c_ds, skb / svb (block scales):
#     X^T = exp2(S^T A skb - B - log2 c_pt)          = P^T sdo / c_pt       (dV's e4m3 operand)
#     Y^T = X^T (dP^T svb Hv R - E R)                 = dS^T sqf / c_ds      (dK's and dQ's)
#     dV += X^T dOf,  dK += Y^T Qf,  dQ_i += (c_ds skb) Y Kf (the units folded per step)
# X^T's exp2 is ex2.approx except in the plain steps at 128 query rows (D=64), where a quarter of
# them is a cubic on the FMA pipe (_exp2_fma, relative error 1.1e-4; both far below the e4m3
# rounding that follows). The helper warps also write the scaled vectors by pairs (A with B, Hv
# with E: vp_smem), so a plain step reads two of them per 16-byte load.
# Steps run in the bf16 kernel's order (per query head of the group, the query blocks that see the
# key block: the first head upwards, the later ones downwards; _first_step), so the dQ writer and
# its deterministic-mode wavefront are shared. Diagonal steps (the query block inside the key
# block) recompute S^T and dP^T from the token copies, as the forward did: skt_j, svt_j multiply
# them per key row. dQ reads the block copy on every step (reference.py). Epilogue: dV = c_pt acc,
# dK = scale c_ds acc rotated back (dK @ H / sqrt(D) by two bf16 wgmmas, H in the dead K tiles);
# the post pass divides dQ by sqf, multiplies by the softmax scale and rotates it back.

FP8_PAD = 128           # padded layout of the fp8 path: documents start at multiples of 128
DO_BLOCK = 64           # rows per dO scale (reference.DO_BLOCK)
N_VEC = 4               # per-row vectors A, B, Hv, E
N_VEC_C = tl.constexpr(N_VEC)
DO_BLOCK_C = tl.constexpr(DO_BLOCK)


@triton.jit
def _pow2_bound(amax):
    """numerics.pow2_scale_bits of a finite bound (a NaN one gives a NaN scale)."""
    return pow2_scale_bits(amax, amax != amax)


@triton.jit
def _bwd_preprocess_fp8(O, DO, LSE, RMAX, SQ, VNORM, PTOK, DO8, VEC, BPT, BDS, SEM, DO8B, Q8B,
                        K8B, DOT8, QT8, KT8, T, QR, HQ, GROUP, qk_scale_log2, stride_t, stride_kt,
                        D: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr,
                        QT_DOT: tl.constexpr):
    """One 64-row block (padded layout) of one query head: dO quantized with one scale for the block
    (do8, token layout), delta from the quantized dO, the per-row vectors A, B, Hv, E and the
    block's maxima of the per-row bounds (reference.backward_scales):
        row_pt = pmax sdo live,  row_ds = pmax (|dO| Vn + |delta|) sqf,  pmax = exp(m - lse);
    a zero for the dQ writer's state SEM (HQ, QR / BM) of the kernel's query block holding it;
    the block's columns of the K-major copies dO^T, Q^T (wgmma order; QT_DOT, i.e. unless the
    kernel makes them from q8 / do8 itself) and, for the first head of a GQA group, K^T (pair
    order), gathered as bytes (DO8B, Q8B, K8B: uint8 views) after the block's do8 rows are stored.
    Program blk * HQ + head: the CTAs resident together hold one
    block's heads and move whole (token, head, D) rows."""
    pid = tl.program_id(0)
    h = pid % HQ
    blk = pid // HQ
    r = blk * BT + tl.arange(0, BT)
    tok = tl.load(PTOK + r)
    ok = tok >= 0
    t = tl.where(ok, tok, 0).to(tl.int64)
    d = tl.arange(0, D)
    tl.store(SEM + h * (QR // BM) + (blk * BT) // BM, 0)
    offs = t[:, None] * stride_t + h * D + d[None, :]
    o = tl.load(O + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    sdo, inv = _pow2_bound(tl.max(tl.max(tl.abs(do), 1), 0))
    do8 = (do * inv).to(tl.float8e4nv)
    tl.store(DO8 + offs, do8, mask=ok[:, None])
    dq = do8.to(tl.float32) * sdo
    live = tl.max(tl.abs(dq), 1) > 0.0
    delta = tl.sum(dq * o, 1)
    nrm = tl.sqrt(tl.sum(dq * dq, 1))
    hrow = h.to(tl.int64) * T + t
    lse = tl.load(LSE + hrow, mask=ok, other=0.0)
    m = tl.load(RMAX + hrow, mask=ok, other=0.0)
    sq = tl.load(SQ + hrow, mask=ok, other=0.0)
    vn = tl.load(VNORM + (h // GROUP).to(tl.int64) * T + t, mask=ok, other=0.0)
    pmax = tl.exp(m - lse)
    sqf = tl.where(sq > 0.0, sq, 1.0)
    live = live & ok
    row_pt = tl.where(live, pmax * sdo, 0.0)
    row_ds = tl.where(ok, pmax * (nrm * vn + tl.abs(delta)) * sqf, 0.0)
    vrow = h.to(tl.int64) * QR + r
    tl.store(VEC + vrow, tl.where(ok, qk_scale_log2 * sq, 0.0))
    tl.store(VEC + HQ * QR + vrow,
             tl.where(live, lse * 1.4426950408889634 - log2_pow2(sdo), float("inf")))
    tl.store(VEC + 2 * HQ * QR + vrow, tl.where(live, sqf, 0.0))
    tl.store(VEC + 3 * HQ * QR + vrow, tl.where(live, delta * sqf * inv, 0.0))
    nb = QR // BT
    tl.store(BPT + h * nb + blk, tl.max(row_pt, 0))
    tl.store(BDS + h * nb + blk, tl.max(row_ds, 0))
    if QT_DOT:
        tl.debug_barrier()     # the block's do8 rows stored before any thread gathers them
        copy_columns(DO8B, DOT8, PTOK, QR, stride_t, h, blk * BT, D, BT, 1)    # ORDER_MMA_A
        copy_columns(Q8B, QT8, PTOK, QR, stride_t, h, blk * BT, D, BT, 1)
    if h % GROUP == 0:
        copy_columns(K8B, KT8, PTOK, QR, stride_kt, h // GROUP, blk * BT, D, BT, 2)  # PAIRS


@triton.jit
def _rotate_back(x, M: tl.constexpr, D: tl.constexpr):
    """x (M, D) fp32 @ H / sqrt(D), H the +-1 Sylvester matrix: fp32 butterflies in registers
    (numerics.fwht), no matrix loaded per block."""
    return fwht(x, M, D) * (1.0 / tl.sqrt(D * 1.0))


@triton.jit
def _bwd_postprocess_fp8(DQA, PROW, SQ, DQ, T, HQ, scale, ROTATE: tl.constexpr,
                         D: tl.constexpr, BT: tl.constexpr):
    """dq = rotate_back(dq_acc[dq_row(padded row)] * scale / sqf) (dK leaves the kernel rotated
    back), one BT-row block per program (several per program are slower: benchmarks/NOTES.md)."""
    h = tl.program_id(1)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = t < T
    d = tl.arange(0, D)
    t64 = t.to(tl.int64)
    pr = _dq_row(tl.load(PROW + t, mask=ok, other=0)).to(tl.int64)
    acc = tl.load(DQA + pr[:, None] * (HQ * D) + h * D + d[None, :], mask=ok[:, None],
                  other=0.0)
    sq = tl.load(SQ + h.to(tl.int64) * T + t64, mask=ok, other=1.0)
    acc = acc * (scale / tl.where(sq > 0.0, sq, 1.0))[:, None]
    if ROTATE:
        acc = _rotate_back(acc, BT, D)
    tl.store(DQ + t64[:, None] * (HQ * D) + h * D + d[None, :],
             acc.to(DQ.dtype.element_ty), mask=ok[:, None])


if HAVE_GLUON:

    @gluon.jit
    def _cta_scales(BPT, BDS, NB, kvh, GROUP, b0, b1, num_warps: gl.constexpr):
        """(c_pt, c_ds) of a CTA (reference.cta_scales): the power-of-two scales of the max of the
        preprocess's 64-row block bounds BPT / BDS (Hq, NB) over blocks [b0, b1) of every query
        head of KV head kvh's group, by the quantize kernels' numerics.pow2_scale_bits taken
        elementwise: pow2 is monotone and max ignores NaN, so the max of the blocks' scales is
        the scale of their max (0 for no block)."""
        CH: gl.constexpr = 4 * 32 * num_warps
        lay: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
        m_pt = gl.zeros([CH], gl.float32, lay)
        m_ds = gl.zeros([CH], gl.float32, lay)
        for g in range(GROUP):
            base = (kvh * GROUP + g).to(gl.int64) * NB
            for c in range(b0, b1, CH):
                idx = c + gl.arange(0, CH, layout=lay)
                mk = idx < b1
                m_pt = gl.maximum(m_pt, gl.load(BPT + base + idx, mask=mk, other=0.0))
                m_ds = gl.maximum(m_ds, gl.load(BDS + base + idx, mask=mk, other=0.0))
        c_pt, _ = _pow2_scale_bits(m_pt, m_pt != m_pt)
        c_ds, _ = _pow2_scale_bits(m_ds, m_ds != m_ds)
        return gl.max(c_pt, axis=0), gl.max(c_ds, axis=0)

    @gluon.jit
    def _rotate_back_rows(x, spare, num_warps: gl.constexpr):
        """x (R, D) fp32 (wgmma accumulator layout) @ H / sqrt(D), H the +-1 Sylvester matrix built
        as bf16 (exact) in the dead shared tile `spare` (>= 2 D^2 bytes): x = hi + lo in bf16 (16 of
        fp32's 24 mantissa bits, below the result's rounding), two wgmmas accumulating in fp32."""
        R: gl.constexpr = x.type.shape[0]
        D: gl.constexpr = x.type.shape[1]
        h_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, D], gl.bfloat16)
        h_smem = spare._reinterpret(gl.bfloat16, [D, D], h_layout)
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [num_warps, 1],
                                             [1, 0])
        i = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(1, blk)), 1)
        j = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, blk)), 0)
        h_smem.store((1 - 2 * _sylvester_parity(i, j)).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        x_l: gl.constexpr = x.type.layout
        acc_l: gl.constexpr = wgmma_layout(num_warps, 1, D, 16)
        a_l: gl.constexpr = gl.DotOperandLayout(0, acc_l, 2)
        x = gl.convert_layout(x, acc_l)
        hi = x.to(gl.bfloat16)
        lo = (x - hi.to(gl.float32)).to(gl.bfloat16)
        y = warpgroup_mma(gl.convert_layout(hi, a_l), h_smem, gl.zeros([R, D], gl.float32, acc_l),
                          use_acc=False)
        y = warpgroup_mma(gl.convert_layout(lo, a_l), h_smem, y)
        return gl.convert_layout(y * (1.0 / gl.sqrt(D * 1.0)), x_l)

    @gluon.jit
    def _load_stage(desc, t_desc, vec_desc, bar, smem, t_smem, vec_smem, sv, VI: gl.constexpr, h,
                    HQ, row, prow, ONCHIP: gl.constexpr):
        """One ring stage of Q (VI = 0) or dO (VI = 2), all counted on `bar`: its rows, its
        K-major copy unless ONCHIP, and its two per-row vectors (A, B or Hv, E) into vec_smem's
        slots sv + VI and sv + VI + 1."""
        D: gl.constexpr = smem.type.shape[1]
        if ONCHIP:
            mbarrier.expect(bar, desc.block_type.nbytes + 2 * vec_desc.block_type.nbytes)
        else:
            mbarrier.expect(bar, desc.block_type.nbytes + t_desc.block_type.nbytes
                            + 2 * vec_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(t_desc, [h * D, prow], bar, t_smem)
        tma.async_copy_global_to_shared(desc, [row, h * D], bar, smem)
        tma.async_copy_global_to_shared(vec_desc, [VI * HQ + h, prow], bar,
                                        vec_smem.index(sv + VI))
        tma.async_copy_global_to_shared(vec_desc, [(VI + 1) * HQ + h, prow], bar,
                                        vec_smem.index(sv + VI + 1))

    @gluon.jit
    def _fp8_loader(q_desc, qt_desc, do_desc, dot_desc, k_desc, kd_desc, v_desc, vd_desc,
                    kt_desc, vec_desc, q_smem, qt_smem, do_smem, dot_smem, k_smem,
                    v_smem, kt_smem, vec_smem, kv_ready, kt_ready, q_ready, do_ready,
                    q_free, ITEMS, N_ITEMS, GROUP, HQ, CAUSAL: gl.constexpr,
                    KMAJOR_ONCHIP: gl.constexpr):
        STAGES: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        D: gl.constexpr = q_smem.type.shape[2]
        BN: gl.constexpr = k_smem.type.shape[1]
        NV: gl.constexpr = vec_smem.type.shape[0] // STAGES
        doc, blk, start, L, pq, kvh = _item(ITEMS, N_ITEMS)
        if doc >= 0:
            k0 = blk * BN
            m_lo, n_m = _query_blocks(k0, L, BM, CAUSAL)
            KV_BYTES: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
            if CAUSAL:
                mbarrier.expect(kv_ready, 2 * KV_BYTES)
                tma.async_copy_global_to_shared(kd_desc, [start + k0, kvh * D], kv_ready,
                                                k_smem.index(1))
                tma.async_copy_global_to_shared(vd_desc, [start + k0, kvh * D], kv_ready,
                                                v_smem.index(1))
            else:
                mbarrier.expect(kv_ready, KV_BYTES)
            tma.async_copy_global_to_shared(k_desc, [start + k0, kvh * D], kv_ready,
                                            k_smem.index(0))
            tma.async_copy_global_to_shared(v_desc, [start + k0, kvh * D], kv_ready,
                                            v_smem.index(0))
            mbarrier.expect(kt_ready, kt_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kt_desc, [kvh * D, pq + k0], kt_ready, kt_smem)
            h = kvh * GROUP
            q0, dq0, q_end = _first_step(m_lo, n_m, BM)
            for i in range(GROUP * n_m):
                s = i % STAGES
                mbarrier.wait(q_free.index(s), ((i // STAGES) + 1) & 1, pred=i >= STAGES)
                # Q^T and dO^T come by TMA unless the helper warps make them
                _load_stage(q_desc, qt_desc, vec_desc, q_ready.index(s), q_smem.index(s),
                            qt_smem.index(s), vec_smem, s * NV, 0, h, HQ, start + q0, pq + q0,
                            KMAJOR_ONCHIP)
                _load_stage(do_desc, dot_desc, vec_desc, do_ready.index(s), do_smem.index(s),
                            dot_smem.index(s), vec_smem, s * NV, 2, h, HQ, start + q0, pq + q0,
                            KMAJOR_ONCHIP)
                h, q0, dq0, q_end = _next_step(h, q0, dq0, q_end, m_lo, n_m, BM)

    @gluon.jit
    def _e4m3_pairs(yt):
        """(y8, y16): yt in e4m3 (yt's layout), and its values as key pairs for the transposed
        dS store: y16[a, l, q] = (e4m3(yt[16 a + l, q]), e4m3(yt[16 a + 8 + l, q])), one 16-bit
        element (rows 16 a + l and 16 a + 8 + l are one thread's, in pair order). One cvt per two
        values serves both: a thread's consecutive accumulator registers hold (r, c), (r, c + 1),
        (r + 8, c), (r + 8, c + 1); each cvt makes a key pair, and one prmt per four values puts
        them in register order for y8."""
        BN: gl.constexpr = yt.type.shape[0]
        BM: gl.constexpr = yt.type.shape[1]
        y8, w = gl.inline_asm_elementwise(
            "{ .reg .b16 a, b; .reg .b32 w; "
            "cvt.rn.satfinite.e4m3x2.f32 a, $5, $3; cvt.rn.satfinite.e4m3x2.f32 b, $6, $4; "
            "mov.b32 w, {a, b}; prmt.b32 $0, w, 0, 0x3120; mov.b32 $1, w; mov.b32 $2, w; }",
            "=r,=r,=r,r,r,r,r", [yt], dtype=(gl.float8e4nv, gl.int16), is_pure=True, pack=4)
        # w at (r, q) holds rows r, r + 8 of column q; the copies at rows r + 8 are dropped
        lo, _hi = gl.split(gl.permute(gl.reshape(w, [BN // 16, 2, 8, BM]), (0, 2, 3, 1)))
        return y8, gl.reshape(lo, [BN // 2, BM])

    @gluon.jit
    def _store_pairs_transposed(y16, ds_smem):
        """ds_smem[q, c] = y16's byte of key(c), key(c) in pair order (kmajor's module
        docstring): a thread's two keys of a pair form one 16-bit element (_e4m3_pairs), stored
        transposed (stmatrix .trans)."""
        l16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                 rank=2)
        ds_smem._reinterpret(gl.int16, [y16.type.shape[1], y16.type.shape[0]], l16).permute(
            (1, 0)).store(y16)

    @gluon.jit
    def _quad_transpose(a, b, c, d):
        """4 x 4 byte transpose: words a, b, c, d (rows) -> word k = (a_k, b_k, c_k, d_k)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t0, t1, t2, t3; "
            "prmt.b32 t0, $4, $5, 0x5140; prmt.b32 t1, $6, $7, 0x5140; "
            "prmt.b32 t2, $4, $5, 0x7362; prmt.b32 t3, $6, $7, 0x7362; "
            "prmt.b32 $0, t0, t1, 0x5410; prmt.b32 $1, t0, t1, 0x7632; "
            "prmt.b32 $2, t2, t3, 0x5410; prmt.b32 $3, t2, t3, 0x7632; }",
            "=r,=r,=r,=r,r,r,r,r", [a, b, c, d], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
            is_pure=True, pack=1)

    @gluon.jit
    def _kmajor_tile_words(src, dst, n_valid):
        """dst[d, c] = src[mma_order16(c), d], rows of src from n_valid on taken as 0: the K-major
        copy (wgmma A order, kmajor.ORDER_MMA_A) of a (64, 128) or (128, 64) fp8 tile, made in
        shared memory from the row-major tile by 2 warps in 4-byte words. Per 16-row group each
        thread loads the words of one word column in rows 2j, 2j + 1, 2j + 8, 2j + 9 (wgmma A
        order's columns 4j .. 4j + 3), transposes them by bytes in registers (prmt) and stores 4-
        or 8-byte runs of the K-major rows: shared-memory accesses are whole rows per warp
        instruction instead of bytes."""
        BM: gl.constexpr = src.type.shape[0]
        D: gl.constexpr = src.type.shape[1]
        W: gl.constexpr = D // 4
        src32 = src._reinterpret(gl.int32, [BM, W], gl.NVMMASharedLayout(
            swizzle_byte_width=src.type.layout.swizzle_byte_width, element_bitwidth=32, rank=2))
        dst32 = dst._reinterpret(gl.int32, [D, BM // 4], gl.NVMMASharedLayout(
            swizzle_byte_width=dst.type.layout.swizzle_byte_width, element_bitwidth=32, rank=2))
        # each thread: rows 2j, 2j + 1, 2j + 8, 2j + 9 of a group (one or two j) of one word column
        if W == 32:
            lay: gl.constexpr = gl.BlockedLayout([4, 1], [1, 32], [2, 1], [0, 1])
        else:
            lay: gl.constexpr = gl.BlockedLayout([2, 1], [2, 16], [2, 1], [0, 1])
        r = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, lay)), 1)
        for g in gl.static_range(BM // 16):
            x = src32.slice(16 * g, 16, 0).load(lay)                  # (16 rows, W words)
            x = gl.where(r + 16 * g < n_valid, x, 0)   # the next document's rows go
            # row = 8 h + 4 jw + 2 j0 + p  ->  (jw, j0, w, h, p)
            y = gl.permute(gl.reshape(x, [2, 2, 2, 2, W]), (1, 2, 4, 0, 3))
            lo, hi = gl.split(y)
            a, c = gl.split(lo)
            b, d = gl.split(hi)
            o0, o1, o2, o3 = _quad_transpose(a, b, c, d)              # (jw, j0, w): d = 4 w + k
            z = gl.join(gl.join(o0, o1), gl.join(o2, o3))             # (jw, j0, w, k0, k1)
            z = gl.reshape(gl.permute(z, (2, 4, 3, 0, 1)), [D, 4])   # (4 w + k, 2 jw + j0)
            dst32.slice(4 * g, 4, 1).store(z)

    @gluon.jit
    def _fp8_helper(q_smem, qt_smem, do_smem, dot_smem, vec_smem, vp_smem, cs_smem, q_ready,
                    do_ready, t_ready, cs_ready, ITEMS, N_ITEMS, GROUP, SK, SV, T, BN: gl.constexpr,
                    CAUSAL: gl.constexpr, KMAJOR_ONCHIP: gl.constexpr, num_warps: gl.constexpr):
        """Each step's per-query vectors scaled by the CTA's scalars in place, once
        per step instead of once per compute thread: A sk (A alone on a diagonal step, whose
        per-key scales the compute warps apply), B + log2 c_pt, Hv sv R (diagonal: Hv R), E R,
        R = c_pt / c_ds (c_pt, c_ds from the compute warps: cs_smem, cs_ready); with
        KMAJOR_ONCHIP dO^T then Q^T in shared memory (_kmajor_tile_words) from the do8 / q8
        tiles the loader brought. t_ready[2 s] says the vectors (and dO^T, dV's B operand) are
        ready, t_ready[2 s + 1] Q^T (dK's). The stage is reloaded only after the compute warps
        free it, which is after they waited on both, so no other barrier is needed."""
        STAGES: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        NV: gl.constexpr = vec_smem.type.shape[0] // STAGES
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        doc, blk, start, L, pq, kvh = _item(ITEMS, N_ITEMS)
        if doc >= 0:
            k0 = blk * BN
            m_lo, n_m = _query_blocks(k0, L, BM, CAUSAL)
            kv_row = kvh.to(gl.int64) * T + start + k0
            skb = gl.load(SK + kv_row)
            svb = gl.load(SV + kv_row)
            mbarrier.wait(cs_ready, 0)      # the CTA scalars, which the compute warps reduced
            cs = cs_smem.load(gl.BlockedLayout([2], [32], [num_warps], [0]))
            two = gl.arange(0, 2, layout=cs.type.layout)
            c_pt = gl.max(gl.where(two == 0, cs, 0.0), axis=0)
            c_ds = gl.max(gl.where(two == 1, cs, 0.0), axis=0)
            lcpt = gl.where(c_pt > 0.0, gl.log2(c_pt), 0.0)
            ratio = gl.where(c_ds > 0.0, c_pt / c_ds, 0.0)
            ratio_svb = ratio * svb     # (exact: svb is a power of two)
            h = kvh * GROUP
            q0, dq0, q_end = _first_step(m_lo, n_m, BM)
            for i in range(GROUP * n_m):
                s = i % STAGES
                ph = (i // STAGES) & 1
                if CAUSAL:
                    diag = q0 < k0 + BN
                else:
                    diag = q0 < 0
                va = _ring_row(vec_smem, s * NV)
                vb = _ring_row(vec_smem, s * NV + 1)
                vh = _ring_row(vec_smem, s * NV + 2)
                ve = _ring_row(vec_smem, s * NV + 3)
                mbarrier.wait(q_ready.index(s), ph)
                a = va.load(lay)
                if not diag:
                    a = a * skb
                    va.store(a)
                b = vb.load(lay) + lcpt
                vb.store(b)
                _store_interleaved(vp_smem, 2 * s, a, b)
                mbarrier.wait(do_ready.index(s), ph)
                if diag:
                    hv = vh.load(lay) * ratio
                else:
                    hv = vh.load(lay) * ratio_svb
                vh.store(hv)
                e = ve.load(lay) * ratio
                ve.store(e)
                _store_interleaved(vp_smem, 2 * s + 1, hv, e)
                if KMAJOR_ONCHIP:
                    _kmajor_tile_words(do_smem.index(s), dot_smem.index(s), L - q0)
                fence_async_shared()   # before the stage's next TMA (and dO^T's wgmma)
                gl.thread_barrier()
                arrive_synced(t_ready.index(2 * s))
                if KMAJOR_ONCHIP:
                    mbarrier.wait(q_ready.index(s), ph)
                    _kmajor_tile_words(q_smem.index(s), qt_smem.index(s), L - q0)
                    fence_async_shared()
                    gl.thread_barrier()
                    arrive_synced(t_ready.index(2 * s + 1))
                h, q0, dq0, q_end = _next_step(h, q0, dq0, q_end, m_lo, n_m, BM)

    @gluon.jit
    def _mul_rn(x, v):
        """x v rounded on its own: mul.rn is never contracted into an FMA with a later add (at
        128 query rows the FMA would keep two per-query vectors live at once and spill)."""
        x, v = gl.broadcast(x, v)
        return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, v],
                                         dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _times(x, v, NOFUSE: gl.constexpr):
        """x v, by _mul_rn with NOFUSE."""
        if NOFUSE:
            return _mul_rn(x, v)
        else:
            return x * v

    @gluon.jit
    def _scaled(x, per_key, vec_smem, v, col_l: gl.constexpr, diag, BM: gl.constexpr,
                CAUSAL: gl.constexpr):
        """x (S^T or dP^T) times per-query vector v of the stage (vec_smem), after the per-key
        scales on a diagonal step. Not contracted into a later FMA at 128 query rows
        (_times)."""
        vv = gl.expand_dims(_column_vector(vec_smem, v, col_l), 0)
        if CAUSAL:
            if diag:
                y = (x * per_key) * vv
            else:
                y = _times(x, vv, BM == 128)
        else:
            y = _times(x, vv, BM == 128)
        return y

    @gluon.jit
    def _diag_key_scales(SKD, SVD, kv_row, k0, L, BN: gl.constexpr, row_l: gl.constexpr):
        """(skt, svt): the diagonal copies' per-key scales of keys k0.. (rows of S^T, 0 past
        the document's end), (BN, 1)."""
        keys = gl.arange(0, BN, layout=row_l)
        kin = keys < L - k0
        skt = gl.expand_dims(gl.load(SKD + kv_row + keys, mask=kin, other=0.0), 1)
        svt = gl.expand_dims(gl.load(SVD + kv_row + keys, mask=kin, other=0.0), 1)
        return skt, svt

    @gluon.jit
    def _col_halves(x):
        """(columns [0, BM/2), columns [BM/2, BM)) of a wgmma-layout tile: each thread's own
        registers (a thread's columns repeat every 8), no data moves."""
        BN: gl.constexpr = x.type.shape[0]
        BM: gl.constexpr = x.type.shape[1]
        return gl.split(gl.permute(gl.reshape(x, [BN, 2, BM // 2]), (0, 2, 1)))

    @gluon.jit
    def _col_join(lo, hi, layout: gl.constexpr):
        """The tile _col_halves split, in `layout`."""
        BN: gl.constexpr = lo.type.shape[0]
        H: gl.constexpr = lo.type.shape[1]
        x = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), [BN, 2 * H])
        return gl.convert_layout(x, layout)

    @gluon.jit
    def _interleaved_view(vp_smem, r, lo: gl.constexpr, n: gl.constexpr):
        """Columns [lo, lo + n) of row r of vp_smem as (n / 2, 2, 2): (column pair, vector,
        column in the pair)."""
        return _ring_row(vp_smem, r).slice(2 * lo, 2 * n)._reinterpret(
            gl.float32, [n // 2, 2, 2], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))

    @gluon.jit
    def _store_interleaved(vp_smem, r, a, b):
        """Row r of vp_smem = per-query vectors a and b by column pairs: a[2p], a[2p + 1],
        b[2p], b[2p + 1] at 4p (_vector_pair reads both with one 16-byte load)."""
        BM: gl.constexpr = a.type.shape[0]
        ab = gl.join(gl.reshape(a, [BM // 2, 2]), gl.reshape(b, [BM // 2, 2]))   # (p, e, k)
        _interleaved_view(vp_smem, r, 0, BM).store(gl.permute(ab, (0, 2, 1)))

    @gluon.jit
    def _vector_pair(vp_smem, r, h: gl.constexpr, like):
        """Columns [h H, (h + 1) H) of the two per-query vectors of row r of vp_smem
        (_store_interleaved), each broadcast along the rows of `like` (a (BN, H) half tile of
        _col_halves): one 16-byte load per column pair of a thread (the column pair 2p, 2p + 1
        of its quad lane p % 4) instead of two 8-byte ones."""
        H: gl.constexpr = like.type.shape[1]
        NW: gl.constexpr = gl.num_warps()
        lay: gl.constexpr = gl.BlockedLayout([1, 2, 2], [4, 8, 1], [1, NW, 1], [0, 2, 1])
        g = _interleaved_view(vp_smem, r, h * H, H).load(lay)      # (p, k, e)
        a, b = gl.split(gl.permute(g, (0, 2, 1)))                   # (p, e)
        col_l: gl.constexpr = gl.SliceLayout(0, like.type.layout)
        a = gl.convert_layout(gl.reshape(a, [H]), col_l)
        b = gl.convert_layout(gl.reshape(b, [H]), col_l)
        return gl.expand_dims(a, 0), gl.expand_dims(b, 0)

    @gluon.jit
    def _exp2_fma(t):
        """2^t in 8 FMA-pipe instructions instead of one MUFU ex2 (numerics.EXP2_FMA_PTX:
        relative error 1.1e-4 against ex2.approx's 2^-22, both far below the e4m3 rounding of
        X^T and Y^T; from t = -126 down a value below 2^-125, which e4m3 rounds to 0 as it does
        ex2.approx.ftz's; a NaN stays NaN)."""
        return gl.inline_asm_elementwise(_EXP2_FMA_ASM, "=r,r", [t], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _x_y_halves(st, dpt, vp_smem, r0, s_layout: gl.constexpr):
        """_x_y of a plain step at 128 query rows, by column halves: x a - b and d c - e are
        single FMAs whose two per-query vectors are live for half the columns at a time (whole
        vectors at once spill), read in pairs from vp_smem rows r0 (A, B) and r0 + 1 (Hv, E).
        The step waits on its MUFU pipe (64 exp2 per thread, 8 cycles a warp each) more than on
        issue: a quarter of X^T's exponentials run as _exp2_fma (+113 SASS, -16 MUFU per step;
        a half, -32 MUFU and +230 SASS, is slower; benchmarks/NOTES.md)."""
        s_lo, s_hi = _col_halves(st)
        a, b = _vector_pair(vp_smem, r0, 0, s_lo)
        x_lo = gl.exp2(s_lo * a - b)
        a, b = _vector_pair(vp_smem, r0, 1, s_hi)
        # a quarter of the exponentials (columns 96-127) on the FMA pipe (_exp2_fma)
        t_hi = s_hi * a - b
        q_a, q_b = _col_halves(t_hi)
        h_layout: gl.constexpr = t_hi.type.layout
        x_hi = _col_join(gl.exp2(q_a), _exp2_fma(q_b), h_layout)
        dpt = warpgroup_mma_wait(0, deps=[dpt])
        d_lo, d_hi = _col_halves(dpt)
        c, e = _vector_pair(vp_smem, r0 + 1, 0, d_lo)
        y_lo = x_lo * (d_lo * c - e)
        c, e = _vector_pair(vp_smem, r0 + 1, 1, d_hi)
        y_hi = x_hi * (d_hi * c - e)
        return _col_join(x_lo, x_hi, s_layout), _col_join(y_lo, y_hi, s_layout)

    @gluon.jit
    def _x_y_plain(st, dpt, vp_smem, r0, s_layout: gl.constexpr):
        """_x_y of a plain step (no diagonal, no mask): at 128 query rows by column halves
        (_x_y_halves), at 64 in one piece; the per-query vectors read in pairs (_vector_pair)."""
        BM: gl.constexpr = st.type.shape[1]
        if BM == 128:
            xt, yt = _x_y_halves(st, dpt, vp_smem, r0, s_layout)
        else:
            a, b = _vector_pair(vp_smem, r0, 0, st)
            xt = gl.exp2(st * a - b)
            dpt = warpgroup_mma_wait(0, deps=[dpt])
            c, e = _vector_pair(vp_smem, r0 + 1, 0, dpt)
            yt = xt * (dpt * c - e)
        return xt, yt

    @gluon.jit
    def _x_y(st, dpt, vec_smem, v0, col_l: gl.constexpr, skt, svt, diag, masked, k0, q0, L,
             BN: gl.constexpr, BM: gl.constexpr, s_layout: gl.constexpr, CAUSAL: gl.constexpr):
        """(X^T, Y^T) of an fp8 step that may be diagonal or masked (causal builds' plain steps
        run _x_y_plain) from S^T and the in-flight dP^T, the per-query vectors at vec_smem[v0 ..]
        (each already scaled by the CTA's scalars: _fp8_helper) and, on a diagonal step, the
        per-key scales skt / svt. One vector live at a time (32 registers each at 128 query rows);
        at 128 rows the products are not contracted into FMAs, which would keep two vectors live
        (_mul_rn). A masked step selects 0 in both results at the end, from one mask."""
        xt = _scaled(st, skt, vec_smem, v0, col_l, diag, BM, CAUSAL)
        vb = gl.expand_dims(_column_vector(vec_smem, v0 + 1, col_l), 0)
        xt = gl.exp2(xt - vb)
        dpt = warpgroup_mma_wait(0, deps=[dpt])
        yt = _scaled(dpt, svt, vec_smem, v0 + 2, col_l, diag, BM, CAUSAL)
        ve = gl.expand_dims(_column_vector(vec_smem, v0 + 3, col_l), 0)
        yt = xt * (yt - ve)
        if masked:   # exp2 of a masked key may be inf, dP^T past the document end NaN
            if BM == 64:     # D=128: a compare-select per use
                vis = _visible(k0, q0, L, BN, BM, s_layout, CAUSAL)
                xt = _keep(xt, vis)
                yt = _keep(yt, vis)
            else:            # D=64 (128 rows): the boolean tile, faster there
                ok = _visible_tile(k0, q0, L, BN, BM, s_layout, CAUSAL)
                xt = gl.where(ok, xt, 0.0)
                yt = gl.where(ok, yt, 0.0)
        return xt, yt

    @gluon.jit
    def _fp8_compute(q_smem, qt_smem, do_smem, dot_smem, k_smem, v_smem, kt_smem, vec_smem,
                     vp_smem, cs_smem, ds_smem, dq_smem, kv_ready, kt_ready, q_ready, do_ready,
                     q_free, cs_ready, t_ready, dq_ready, dq_free, ITEMS, N_ITEMS, GROUP, BPT, BDS,
                     NB, CTA,
                     SK, SV, SKD, SVD, DK, DV, dk_desc, dv_desc, T, stride_kt, sm_scale,
                     CAUSAL: gl.constexpr,
                     ROTATE: gl.constexpr, KMAJOR_ONCHIP: gl.constexpr, num_warps: gl.constexpr):
        STAGES: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        D: gl.constexpr = q_smem.type.shape[2]
        BN: gl.constexpr = k_smem.type.shape[1]
        NV: gl.constexpr = vec_smem.type.shape[0] // STAGES
        f8: gl.constexpr = gl.float8e4nv
        s_layout: gl.constexpr = wgmma_layout(num_warps, 1, BM, 32)       # S^T, dP^T (BN, BM)
        kv_layout: gl.constexpr = wgmma_layout(num_warps, 1, D, 32)       # dK, dV (BN, D)
        if BM == 16 * num_warps:
            dq_layout: gl.constexpr = wgmma_layout(num_warps, 1, D, 32)   # dQ (BM, D)
        else:
            dq_layout: gl.constexpr = wgmma_layout(4, num_warps // 4, D // (num_warps // 4), 32)
        a_layout: gl.constexpr = gl.DotOperandLayout(0, kv_layout, 4)
        col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)

        item = gl.program_id(0)
        doc, blk, start, L, pq, kvh = _item(ITEMS, N_ITEMS)
        if doc >= 0:
            k0 = blk * BN
            m_lo, n_m = _query_blocks(k0, L, BM, CAUSAL)
            # CTA scalars over the rows the CTA sees (from its first key on when causal), also
            # written to CTA (2, N_ITEMS) for the tests
            first = pq + k0 if CAUSAL else pq
            c_pt, c_ds = _cta_scales(BPT, BDS, NB, kvh, GROUP, first // DO_BLOCK_C,
                                     (pq + L + DO_BLOCK_C - 1) // DO_BLOCK_C, num_warps)
            gl.store(CTA + item, c_pt)
            gl.store(CTA + N_ITEMS + item, c_ds)
            # for the helper warps, which scale the per-query vectors by them
            two = gl.arange(0, 2, layout=gl.BlockedLayout([2], [32], [num_warps], [0]))
            cs_smem.store(gl.where(two == 0, c_pt, c_ds))
            gl.thread_barrier()
            arrive_synced(cs_ready)
            kv_row = kvh.to(gl.int64) * T + start + k0
            skb = gl.load(SK + kv_row)
            u_off = c_ds * skb
            if CAUSAL and BM == 64:   # the diagonal copies' per-key scales (rows of S^T)
                skt, svt = _diag_key_scales(SKD, SVD, kv_row, k0, L, BN, row_l)
            else:
                skt = 0.0
                svt = 0.0
            mbarrier.wait(kv_ready, 0)
            dk = gl.zeros([BN, D], gl.float32, kv_layout)
            dv = gl.zeros([BN, D], gl.float32, kv_layout)
            q0, dq0, q_end = _first_step(m_lo, n_m, BM)
            for i in range(GROUP * n_m):
                if BM == 128:   # a division per step: a carried counter measured no faster
                    q0 = _step_q0(i, m_lo, n_m, BM)
                if CAUSAL:    # the query block inside the key block: the token copies
                    diag = q0 < k0 + BN
                else:
                    diag = q0 < 0
                s = i % STAGES
                ph = (i // STAGES) & 1
                c = diag.to(gl.int32)
                mbarrier.wait(q_ready.index(s), ph)
                st = warpgroup_mma(k_smem.index(c), q_smem.index(s).permute((1, 0)),
                                   gl.zeros([BN, BM], gl.float32, s_layout), use_acc=False,
                                   is_async=True)
                mbarrier.wait(do_ready.index(s), ph)
                dpt = warpgroup_mma(v_smem.index(c), do_smem.index(s).permute((1, 0)),
                                    gl.zeros([BN, BM], gl.float32, s_layout), use_acc=False,
                                    is_async=True)
                if not KMAJOR_ONCHIP:   # (there the helper warps, behind the loader, need the
                    _release_step(dq_ready, q_free, i - 1)   # stage back at once)
                st = warpgroup_mma_wait(1, deps=[st])
                # the helper's vectors (and with KMAJOR_ONCHIP dO^T, dV's B operand)
                mbarrier.wait(t_ready.index(2 * s), ph)
                edge_q = q0 + BM > L
                if CAUSAL:
                    masked = diag | edge_q | (k0 + BN > L)
                else:
                    masked = edge_q | (k0 + BN > L)
                if BM == 64:   # plain steps run a copy of the block without branches
                    if masked:
                        xt, yt = _x_y(st, dpt, vec_smem, s * NV, col_l, skt, svt, diag, masked,
                                      k0, q0, L, BN, BM, s_layout, CAUSAL)
                    else:
                        xt, yt = _x_y_plain(st, dpt, vp_smem, 2 * s, s_layout)
                elif CAUSAL:   # 128 rows (D=64) sit at the register limit
                    if masked:   # the per-key scales loaded here, not held through the loop
                        skt2, svt2 = _diag_key_scales(SKD, SVD, kv_row, k0, L, BN, row_l)
                        xt, yt = _x_y(st, dpt, vec_smem, s * NV, col_l, skt2, svt2, diag,
                                      masked, k0, q0, L, BN, BM, s_layout, CAUSAL)
                    else:        # plain steps: single FMAs by column halves
                        xt, yt = _x_y_plain(st, dpt, vp_smem, 2 * s, s_layout)
                else:          # (non-causal: the halves' copy of the block spills in plain steps)
                    xt, yt = _x_y(st, dpt, vec_smem, s * NV, col_l, skt, svt, diag, masked, k0,
                                  q0, L, BN, BM, s_layout, CAUSAL)
                xa = gl.convert_layout(mma_key_order_gluon(xt.to(f8)), a_layout)
                dv = warpgroup_mma(xa, dot_smem.index(s).permute((1, 0)), dv, is_async=True)
                y8, y16 = _e4m3_pairs(yt)
                # dS for dQ: keys contiguous, in pair order (K^T's columns too)
                _store_pairs_transposed(y16, ds_smem)
                fence_async_shared()
                gl.thread_barrier()
                ya = gl.convert_layout(mma_key_order_gluon(y8), a_layout)
                mbarrier.wait(kt_ready, 0)
                dq = warpgroup_mma(ds_smem, kt_smem.permute((1, 0)),
                                   gl.zeros([BM, D], gl.float32, dq_layout), use_acc=False,
                                   is_async=True)
                if KMAJOR_ONCHIP:   # Q^T, made by the helper warps after dO^T
                    mbarrier.wait(t_ready.index(2 * s + 1), ph)
                dk = warpgroup_mma(ya, qt_smem.index(s).permute((1, 0)), dk, is_async=True)
                dv, dq = warpgroup_mma_wait(1, deps=[dv, dq])
                dq = dq * u_off
                b = i % 2
                mbarrier.wait(dq_free.index(b), ((i // 2) + 1) & 1, pred=i >= 2)
                dq_smem.index(b).store(_dq_rows_stored(dq))
                dk = warpgroup_mma_wait(0, deps=[dk])
                if KMAJOR_ONCHIP:
                    _release_step(dq_ready, q_free, i)
                if BM == 64:    # counters, not an integer division (~25 SASS) per step
                    _h, q0, dq0, q_end = _next_step(0, q0, dq0, q_end, m_lo, n_m, BM)
            if not KMAJOR_ONCHIP:
                _release_step(dq_ready, q_free, GROUP * n_m - 1)
            # epilogue: dV = c_pt acc; dK = softmax scale * c_ds * acc, rotated back (ROTATE);
            # V's and K's tiles (both copies) are dead and carry them out
            _store_grad(dv * c_pt, dv_desc, v_smem, DV, start, k0, L, kvh, stride_kt)
            dk = dk * (sm_scale * c_ds)
            if ROTATE:
                # K^T, K and the diagonal copies are dead: their bytes hold H for the rotation
                gl.thread_barrier()
                dk = _rotate_back_rows(dk, k_smem, num_warps)
            _store_grad(dk, dk_desc, k_smem, DK, start, k0, L, kvh, stride_kt)
            tma.store_wait(0)       # the tiles stay allocated until the copies have read them

    # values that follow cu_seqlens are not specialized on: one build for every split
    @gluon.jit(do_not_specialize=["N_ITEMS", "QBLOCKS", "NB", "T"])
    def _attn_bwd_sm90_fp8_kernel(q_desc, qt_desc, do_desc, dot_desc, k_desc, kd_desc, v_desc,
                                  vd_desc, kt_desc, vec_desc, dq_desc, dk_desc, dv_desc, DK,
                                  DV, SEM,
                                  ITEMS, N_ITEMS, GROUP, HQ, QBLOCKS, BPT, BDS, NB, CTA, SK, SV,
                                  SKD, SVD, T, stride_kt, sm_scale,
                                  BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                                  STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                  ROTATE: gl.constexpr,
                                  LOADER_REGS: gl.constexpr, DQ_REGS: gl.constexpr,
                                  DETERMINISTIC: gl.constexpr, KMAJOR_ONCHIP: gl.constexpr,
                                  num_warps: gl.constexpr):
        f8: gl.constexpr = gl.float8e4nv
        q_smem = gl.allocate_shared_memory(f8, [STAGES, BM, D], q_desc.layout)
        qt_smem = gl.allocate_shared_memory(f8, [STAGES, D, BM], qt_desc.layout)
        do_smem = gl.allocate_shared_memory(f8, [STAGES, BM, D], do_desc.layout)
        dot_smem = gl.allocate_shared_memory(f8, [STAGES, D, BM], dot_desc.layout)
        k_smem = gl.allocate_shared_memory(f8, [2, BN, D], k_desc.layout)      # block, diagonal
        v_smem = gl.allocate_shared_memory(f8, [2, BN, D], v_desc.layout)
        kt_smem = gl.allocate_shared_memory(f8, [D, BN], kt_desc.layout)
        vec_smem = gl.allocate_shared_memory(gl.float32, [STAGES * N_VEC_C, 1, BM], vec_desc.layout)
        # the helper's copy of the scaled vectors by pairs (A with B, Hv with E) per stage
        vp_smem = gl.allocate_shared_memory(gl.float32, [STAGES * 2, 1, 2 * BM],
                                            gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                       rank=2)
        ds_smem = gl.allocate_shared_memory(f8, [BM, BN], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BM, D], dq_desc.layout)
        kv_ready, kt_ready = alloc_barriers(1).index(0), alloc_barriers(1).index(0)
        q_ready, do_ready = alloc_barriers(STAGES), alloc_barriers(STAGES)
        q_free = alloc_barriers(STAGES)
        dq_ready, dq_free = alloc_barriers(2), alloc_barriers(2)
        t_ready = alloc_barriers(2 * STAGES)
        cs_ready = alloc_barriers(1).index(0)      # the CTA scalars c_pt, c_ds in cs_smem
        cs_smem = gl.allocate_shared_memory(gl.float32, [2],
                                            gl.SwizzledSharedLayout(1, 1, 1, [0]))
        gl.warp_specialize([
            (_fp8_compute, (q_smem, qt_smem, do_smem, dot_smem, k_smem, v_smem, kt_smem, vec_smem,
                            vp_smem, cs_smem, ds_smem, dq_smem, kv_ready, kt_ready, q_ready,
                            do_ready, q_free, cs_ready, t_ready, dq_ready, dq_free, ITEMS, N_ITEMS,
                            GROUP,
                            BPT, BDS, NB, CTA,
                            SK, SV, SKD, SVD, DK, DV, dk_desc, dv_desc, T, stride_kt,
                            sm_scale, CAUSAL, ROTATE,
                            KMAJOR_ONCHIP, num_warps)),
            (_fp8_loader, (q_desc, qt_desc, do_desc, dot_desc, k_desc, kd_desc, v_desc, vd_desc,
                           kt_desc, vec_desc, q_smem, qt_smem, do_smem, dot_smem,
                           k_smem, v_smem, kt_smem, vec_smem, kv_ready, kt_ready,
                           q_ready, do_ready, q_free, ITEMS, N_ITEMS, GROUP, HQ, CAUSAL,
                           KMAJOR_ONCHIP)),
            (_bwd_dq_writer, (dq_desc, dq_smem, dq_ready, dq_free, SEM, ITEMS, N_ITEMS, GROUP,
                              QBLOCKS, BN, CAUSAL, DETERMINISTIC)),
            (_fp8_helper, (q_smem, qt_smem, do_smem, dot_smem, vec_smem, vp_smem, cs_smem, q_ready,
                           do_ready, t_ready, cs_ready, ITEMS, N_ITEMS, GROUP, SK, SV, T, BN,
                           CAUSAL, KMAJOR_ONCHIP, 2)),
        ], [1, 1, 2], [LOADER_REGS, DQ_REGS, LOADER_REGS])
        mbarrier.invalidate(kv_ready)
        mbarrier.invalidate(kt_ready)
        mbarrier.invalidate(cs_ready)
        invalidate_barriers((q_ready, do_ready, q_free, dq_ready, dq_free, t_ready))


# ---------------------------------------------------------------------------------------------
# Host
# ---------------------------------------------------------------------------------------------

def attention_backward_sm90(dout, out, lse, q, k, v, cu_seqlens, causal=True, softmax_scale=None,
                            grad_dtype=None, deterministic=False,
                            config: Sm90BwdConfig | None = None):
    """(dq, dk, dv) of causal (or full) attention over packed documents. q, dout, out (T, Hq, D);
    k, v (T, Hkv, D), bf16 or fp16, unit stride in D; lse (Hq, T) fp32, natural log of the
    softmax-scaled scores (the forward's); cu_seqlens int32 (n_docs + 1,) with cu_seqlens[-1] == T.
    By default the dQ adds of different key blocks land in any order (fp32 sums not bitwise
    reproducible between runs; dK and dV are); deterministic=True orders them (bitwise reproducible,
    at the cost of waits)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    cfg = config or sm90_backward_config(D)
    BM, BN = cfg.block_m, SM90_BLOCK_N
    dev = q.device
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    q, k, v, dout, out = (x.contiguous() for x in (q, k, v, dout, out))
    dq, dk, dv = _grads(T, Hq, Hkv, D, grad_dtype or dout.dtype, dev)
    if T == 0:
        return dq, dk, dv
    kb = per_cu_seqlens(cu_seqlens, ("bwd_sm90", T, BM, BN, bool(causal), Hkv),
                        lambda: key_blocks(cu_seqlens, T, BM, BN, causal, Hkv))
    QR = kb.q_rows
    lse2 = torch.empty((Hq, QR), dtype=torch.float32, device=dev)
    delta = torch.empty((Hq, QR), dtype=torch.float32, device=dev)
    dq_acc = torch.empty((QR, Hq, D), dtype=torch.float32, device=dev)   # the kernel stores first
    grid_t = (triton.cdiv(T, SM90_PASS_ROWS), Hq)
    launch_kernel(_bwd_preprocess, grid_t, out, dout, lse.contiguous(), kb.prow, lse2, delta, T,
                  QR, Hq * D, D=D, BT=SM90_PASS_ROWS, num_warps=4)
    q_desc = descriptor_2d(q, T, Hq * D, Hq * D, [BM, D])
    do_desc = descriptor_2d(dout, T, Hq * D, Hq * D, [BM, D])
    k_desc = descriptor_2d(k, T, Hkv * D, Hkv * D, [BN, D])
    v_desc = descriptor_2d(v, T, Hkv * D, Hkv * D, [BN, D])
    lse_desc = descriptor_2d(lse2, Hq, QR, QR, [1, BM])
    dl_desc = descriptor_2d(delta, Hq, QR, QR, [1, BM])
    dq_desc = descriptor_2d(dq_acc, QR, Hq * D, Hq * D, [BM, D])
    launch_kernel(_attn_bwd_sm90_kernel, (kb.n_items,),
        q_desc, do_desc, k_desc, v_desc, lse_desc, dl_desc, dq_desc, *_grad_descriptors(dk, dv),
        dk, dv,
        _semaphores(kb, Hq, BM), kb.items,
        kb.n_items, Hq // Hkv, QR // BM, Hkv * D, scale * LOG2E, scale, BM=BM, BN=BN, D=D,
        STAGES=SM90_STAGES, CAUSAL=bool(causal), LOADER_REGS=SM90_LOADER_REGS,
        DQ_REGS=SM90_DQ_REGS, DETERMINISTIC=bool(deterministic), num_warps=8)
    launch_kernel(_bwd_postprocess, grid_t, dq_acc, kb.prow, dq, T, scale, Hq * D, D=D,
                  BT=SM90_PASS_ROWS, num_warps=4)
    return dq, dk, dv


@dataclass
class Fp8Prep:
    """The fp8 backward's buffers after its preprocess (fp8_prepare), before the kernel."""
    kb: KeyBlocks
    ptok: torch.Tensor      # (QR,) token of each padded row, -1 for padding
    do8: torch.Tensor       # (T, Hq, D) e4m3, one scale per 64-row block (padded layout)
    vec: torch.Tensor       # (N_VEC, Hq, QR) fp32: A, B, Hv, E per padded row
    bpt: torch.Tensor       # (Hq, QR / 64) per 64-row block the max of the row bounds of P^T
    bds: torch.Tensor       # and of dS, of which the kernel takes its CTA scales
    cta: torch.Tensor       # (2, n_items) c_pt, c_ds per work-list column, written by the kernel
    qt8: torch.Tensor | None    # (Hq, D, QR) K-major Q (columns in wgmma order within 16), or
    dot8: torch.Tensor | None   # None where the kernel makes them (fp8_kmajor_onchip); K-major dO
    kt8: torch.Tensor       # (Hkv, D, QR) K-major K, block copy (pair order, kmajor.py)
    dq_acc: torch.Tensor    # (QR, Hq, D) fp32, not initialized: the kernel's dQ target
    sem: torch.Tensor       # (Hq, QR / BM) int32 zeros: the kernel's dQ writer states


def fp8_prepare(dout, out, lse, row_max, qkv, cu_seqlens, causal, scale,
                cfg: Sm90BwdConfig) -> Fp8Prep:
    """The preprocess: dO quantized, delta, per-row vectors, the 64-row blocks' bounds (the kernel
    takes its CTA scales from them), the K-major copies."""
    T, Hq, D = qkv.q8.shape
    Hkv = qkv.k8.shape[1]
    BM, BN = cfg.block_m, SM90_BLOCK_N
    dev = dout.device
    group = Hq // Hkv
    kb = per_cu_seqlens(cu_seqlens, ("bwd_sm90_fp8", T, BM, BN, bool(causal), Hkv),
                        lambda: key_blocks(cu_seqlens, T, BM, BN, causal, Hkv, pad=FP8_PAD))
    QR = kb.q_rows
    ptok = per_cu_seqlens(cu_seqlens, ("bwd_sm90_fp8_ptok", T, QR),
                          lambda: _padded_tokens(kb.prow, QR))
    f8 = torch.float8_e4m3fn
    do8 = torch.empty((T, Hq, D), dtype=f8, device=dev)
    vec = torch.empty((N_VEC, Hq, QR), dtype=torch.float32, device=dev)
    nb = QR // DO_BLOCK
    bpt = torch.empty((Hq, nb), dtype=torch.float32, device=dev)
    bds = torch.empty((Hq, nb), dtype=torch.float32, device=dev)
    dq_acc = torch.empty((QR, Hq, D), dtype=torch.float32, device=dev)
    sem = torch.empty((Hq, QR // BM), dtype=torch.int32, device=dev)
    kt8 = torch.empty((Hkv, D, QR), dtype=f8, device=dev)
    copies = [(qkv.k8, kt8, ORDER_PAIRS)]
    qt8 = dot8 = None
    if not cfg.fp8_kmajor_onchip:
        qt8 = torch.empty((Hq, D, QR), dtype=f8, device=dev)
        dot8 = torch.empty((Hq, D, QR), dtype=f8, device=dev)
        copies += [(do8, dot8, ORDER_MMA_A), (qkv.q8, qt8, ORDER_MMA_A)]
    for src, dst, order in copies:
        check_copy(src, dst, order)
    u8 = [x.view(torch.uint8) for x in (do8, qkv.q8, qkv.k8, dot8 if dot8 is not None else kt8,
                                         qt8 if qt8 is not None else kt8, kt8)]
    launch_kernel(_bwd_preprocess_fp8, (nb * Hq,),
        out, dout, lse.contiguous(), row_max.contiguous(), qkv.sq, qkv.vnorm, ptok, do8, vec, bpt,
        bds, sem, *u8, T, QR, Hq, group, scale * LOG2E, Hq * D, qkv.k8.stride(0), D=D,
        BT=DO_BLOCK, BM=BM, QT_DOT=qt8 is not None, num_warps=cfg.fp8_pre_warps)
    cta = torch.empty((2, kb.n_items), dtype=torch.float32, device=dev)
    return Fp8Prep(kb, ptok, do8, vec, bpt, bds, cta, qt8, dot8, kt8, dq_acc, sem)


def attention_backward_sm90_fp8(dout, out, lse, row_max, qkv, cu_seqlens, causal=True,
                                softmax_scale=None, grad_dtype=None, deterministic=False,
                                config: Sm90BwdConfig | None = None):
    """(dq, dk, dv) of the fp8 recipe (scaling kvblock128) from the forward's quantized operands qkv
    (layout.QuantizedQKV with the block and diagonal copies), out, lse and row max (Hq, T), as
    reference.backward / _backward_kvblock define them: fp8_prepare, the kernel, fp8_post.
    config: sm90_backward_config(D) by default (Q^T / dO^T from the preprocess's copies)."""
    T, Hq, D = qkv.q8.shape
    Hkv = qkv.k8.shape[1]
    cfg = config or sm90_backward_config(D)
    if cfg.fp8_kmajor_onchip and D != 128:
        raise ValueError(f"config.fp8_kmajor_onchip needs head dim 128, not {D}")
    BM, BN = cfg.block_m, SM90_BLOCK_N
    dev = dout.device
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    dout, out = dout.contiguous(), out.contiguous()
    dq, dk, dv = _grads(T, Hq, Hkv, D, grad_dtype or dout.dtype, dev)
    if T == 0:
        return dq, dk, dv
    prep = fp8_prepare(dout, out, lse, row_max, qkv, cu_seqlens, causal, scale, cfg)
    kb, QR = prep.kb, prep.kb.q_rows
    k8d, v8d, skd, svd = ((qkv.k8_diag, qkv.v8_diag, qkv.sk_diag, qkv.sv_diag) if causal
                          else (qkv.k8, qkv.v8, qkv.sk, qkv.sv))
    if prep.qt8 is None:    # made by the kernel: the descriptors only give the tiles' layout
        qt_d = dot_d = descriptor_2d(prep.kt8, Hkv * D, QR, QR, [D, BM])
    else:
        qt_d = descriptor_2d(prep.qt8, Hq * D, QR, QR, [D, BM])
        dot_d = descriptor_2d(prep.dot8, Hq * D, QR, QR, [D, BM])
    descs = (
        descriptor_2d(qkv.q8, T, Hq * D, Hq * D, [BM, D]),
        qt_d,
        descriptor_2d(prep.do8, T, Hq * D, Hq * D, [BM, D]),
        dot_d,
        descriptor_2d(qkv.k8, T, Hkv * D, Hkv * D, [BN, D]),
        descriptor_2d(k8d, T, Hkv * D, Hkv * D, [BN, D]),
        descriptor_2d(qkv.v8, T, Hkv * D, Hkv * D, [BN, D]),
        descriptor_2d(v8d, T, Hkv * D, Hkv * D, [BN, D]),
        descriptor_2d(prep.kt8, Hkv * D, QR, QR, [D, BN]),
        descriptor_2d(prep.vec, N_VEC * Hq, QR, QR, [1, BM]),
        descriptor_2d(prep.dq_acc, QR, Hq * D, Hq * D, [BM, D]),
        *_grad_descriptors(dk, dv),
    )
    launch_kernel(_attn_bwd_sm90_fp8_kernel, (kb.n_items,),
        *descs, dk, dv, prep.sem, kb.items, kb.n_items, Hq // Hkv,
        Hq, QR // BM, prep.bpt, prep.bds, prep.bpt.shape[1], prep.cta, qkv.sk, qkv.sv, skd, svd,
        T, Hkv * D, scale, BM=BM, BN=BN, D=D, STAGES=SM90_STAGES, CAUSAL=bool(causal),
        ROTATE=bool(qkv.rotated), LOADER_REGS=SM90_LOADER_REGS, DQ_REGS=SM90_DQ_REGS,
        DETERMINISTIC=bool(deterministic), KMAJOR_ONCHIP=prep.qt8 is None, num_warps=8)
    fp8_post(prep.dq_acc, kb.prow, qkv.sq, bool(qkv.rotated), scale, dq, cfg)
    return dq, dk, dv


def fp8_post(dq_acc, prow, sq, rotated: bool, scale: float, dq, cfg: Sm90BwdConfig):
    """The post pass: dq (T, Hq, D) from the fp32 buffer dq_acc (padded rows prow, units of
    sq), rotated back when `rotated`."""
    T, Hq, D = dq.shape
    grid = (triton.cdiv(T, cfg.fp8_post_rows), Hq)
    launch_kernel(_bwd_postprocess_fp8, grid, dq_acc, prow, sq, dq, T, Hq, scale, ROTATE=rotated,
                  D=D, BT=cfg.fp8_post_rows, num_warps=cfg.fp8_post_warps)


def _grads(T, Hq, Hkv, D, dtype, dev):
    """Empty (dq, dk, dv)."""
    return (torch.empty((T, Hq, D), dtype=dtype, device=dev),
            *(torch.empty((T, Hkv, D), dtype=dtype, device=dev) for _ in range(2)))


def _grad_descriptors(dk, dv):
    """TMA descriptors of dK and dV (T, Hkv, D) as (T, Hkv * D) matrices, one (BN, D) box: the
    kernels' epilogue stores (_store_grad)."""
    T, Hkv, D = dk.shape
    return tuple(descriptor_2d(x, T, Hkv * D, Hkv * D, [SM90_BLOCK_N, D]) for x in (dk, dv))


def _semaphores(kb: KeyBlocks, Hq: int, BM: int) -> torch.Tensor:
    """The dQ writer's per-(query head, query block) states (_bwd_dq_writer), zeroed."""
    return torch.zeros((Hq, kb.q_rows // BM), dtype=torch.int32, device=kb.items.device)


def _padded_tokens(prow: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) int32: the token at each row of the padded layout, -1 for a pad row."""
    ptok = torch.full((rows,), -1, dtype=torch.int32, device=prow.device)
    ptok[prow.long()] = torch.arange(prow.numel(), dtype=torch.int32, device=prow.device)
    return ptok
