"""Spike (benchmarks/, loaded by fwd_ab.py as a copy of flamia/ops/forward_gluon.py): the persistent
fp8 forward with FA3's structure. One CTA per SM holds the two query heads of a GQA pair, one
consumer warpgroup each, sharing every K / V tile (half the L2 -> shared memory bytes per FLOP of
the library kernel), and, TURNS, the two warpgroups take turns at the tensor cores on named
barriers (`bar.sync` / `bar.arrive`, 256 threads, ids TURN_BAR + warpgroup): each issues its PV_j
and S_{j+1} in its turn, then hands the turn over, so that one warpgroup's softmax runs under the
other's GEMMs. Without TURNS it is the fifth session's GQA pair kernel on today's tile. PREFETCH:
each warpgroup issues its next item's S_0 right behind an item's epilogue stores (the ring is one
tile sequence across items), so that the CTA's lone pair of warpgroups does not sit through an
item's serial end and start with the tensor cores idle (one CTA per SM: no other CTA hides
them). Both consumers see the same rows, tiles and masks as the library kernel's 64-row items of
their heads, so out / lse / row max are bitwise the library's. Needs an even GQA group.

The four forms in one call (H100, ~80 s; `sed` writes the variants, fwd_ab.py times them with the
library kernel as "main", outputs checked bitwise):

    sed 's/^TURNS = True/TURNS = False/; s/^PREFETCH = True.*/PREFETCH = False/' \
        benchmarks/fwd_pingpong.py > /tmp/pair.py
    sed 's/^TURNS = True/TURNS = False/' benchmarks/fwd_pingpong.py > /tmp/pair_pf.py
    sed 's/^PREFETCH = True.*/PREFETCH = False/' benchmarks/fwd_pingpong.py > /tmp/pp.py
    FWD_AB_ARGS="--gluon main=flamia/ops/forward_gluon.py,pair=/tmp/pair.py,pair_pf=/tmp/pair_pf.py,\
    pp=/tmp/pp.py,pp_pf=benchmarks/fwd_pingpong.py --workloads doc32k,doc8k_x4,doc2k_x16,longtail,\
    doc512_x64 --rounds 5" bash benchmarks/device_run.sh fwd-ab:240

The tile primitives (softmax, masks, loads, scales) are the library's, imported from
flamia/ops/forward_gluon.py; what differs is the work split, the producer's pair loads, the
steps' turns and the prefetch.
"""
from __future__ import annotations

from .config import PersistentFwdConfig
from .forward_gluon import _descriptors, check_operands  # noqa: F401  (fwd_ab.py calls it)
from .gluon_common import HAVE_GLUON, descriptor_2d
from .launch import launch_kernel
from .layout import QuantizedQKV
from .numerics import LOG2E
from .schedule import persistent_grid

PAIR_STAGES = 2
PAIR_CONSUMER_REGS = 240
TURNS = True
PREFETCH = True     # the next item's S_0 issued behind an item's epilogue (else at its start)
TURN_BAR = 8        # named barriers 8 and 9 (Triton's partitions use the low ids)

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    from .forward_gluon import (
        _alloc_kv_ring, _issue_qk, _keep_alive, _kv_tiles, _load_k_cols, _load_v_at, _mul_rows,
        _quad_sums, _query_rows, _row_constants, _row_loads, _softmax_tile, _store_out, _wait_v,
        _ws_release)
    from .gluon_common import alloc_barriers, arrive_synced, invalidate_barriers, wgmma_layout
    from .schedule import work_item

    _TURNS = gl.constexpr(TURNS)
    _PREFETCH = gl.constexpr(PREFETCH)
    _TURN_BAR = gl.constexpr(TURN_BAR)


if HAVE_GLUON:

    @gluon.jit
    def _named_barrier(bar_id, ARRIVE: gl.constexpr):
        """bar.sync (ARRIVE: bar.arrive) on named barrier bar_id for 256 threads, by every thread
        of this 4-warp partition: the sync waits until the other warpgroup has arrived."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ids = gl.full([128], 0, gl.int32, one) + bar_id
        if ARRIVE:
            gl.inline_asm_elementwise("bar.arrive $1, 256; mov.u32 $0, 0;", "=r,r", [ids],
                                      dtype=gl.int32, is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("bar.sync $1, 256; mov.u32 $0, 0;", "=r,r", [ids],
                                      dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _pers_producer(q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc, q_smem,
                       k_smem, v_smem, sk_smem, sv_smem, q_ready, q_free, k_ready, v_ready, rel,
                       ITEMS, N_ITEMS, HQ, GROUP, W, PCU, BM: gl.constexpr, BN: gl.constexpr,
                       CAUSAL: gl.constexpr, QBUF: gl.constexpr):
        """Every TMA load. Tile t of an item holds the document's keys [t BN, (t + 1) BN), from
        the token copies (kd_desc, vd_desc, scale_cols rows 2-3) on the query block's own
        128-block when causal, else from the block copies (k_desc, v_desc, scale_cols rows 0-1;
        sc_desc is scale_cols); V^T and the scales at the padded column PCU[doc] + t BN."""
        STAGES: gl.constexpr = k_smem.type.shape[0]
        D: gl.constexpr = k_smem.type.shape[2]
        g = 0               # tiles loaded so far (the CTA-wide tile sequence)
        it = 0              # items started so far
        for w in range(gl.program_id(0), W, gl.num_programs(0)):
            doc, hp, kvh, start, L, blk = work_item(ITEMS, N_ITEMS, HQ // 2, GROUP // 2, W, w)
            if doc >= 0:
                q_lo = blk * BM
                pcol = gl.load(PCU + doc)
                if CAUSAL:     # keys from d0 on: the query block's own 128-block
                    d0 = (q_lo // 128) * 128
                else:          # (no diagonal pairs)
                    d0 = L
                hkv = HQ // GROUP
                _, n_tiles = _kv_tiles(q_lo, L, BM, BN, CAUSAL)
                qb = it % QBUF
                mbarrier.wait(q_free.index(qb), ((it // QBUF) + 1) & 1, pred=it >= QBUF)
                mbarrier.expect(q_ready.index(qb), 2 * q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [start + q_lo, 2 * hp * D],
                                                q_ready.index(qb), q_smem.index(2 * qb))
                tma.async_copy_global_to_shared(q_desc, [start + q_lo, (2 * hp + 1) * D],
                                                q_ready.index(qb), q_smem.index(2 * qb + 1))
                for t in range(n_tiles):
                    st = g % STAGES
                    # K_g after r_{g-STAGES}, V_g after r_{g-STAGES+1} (ring protocol: module
                    # docstring); re-waiting r_{g+1-STAGES} at the next tile is safe: it cannot
                    # complete again before K_{g+1}.
                    mbarrier.wait(rel.index(st), ((g // STAGES) + 1) & 1, pred=g >= STAGES)
                    n0 = t * BN
                    col = pcol + n0
                    if n0 >= d0:
                        _load_k_cols(kd_desc, sc_desc, k_smem, sk_smem, sv_smem, k_ready, st,
                                     start + n0, col, kvh, 2 * hkv + kvh, 3 * hkv + kvh)
                    else:
                        _load_k_cols(k_desc, sc_desc, k_smem, sk_smem, sv_smem, k_ready, st,
                                     start + n0, col, kvh, kvh, hkv + kvh)
                    mbarrier.wait(rel.index((g + 1) % STAGES), (((g + 1) // STAGES) + 1) & 1,
                                  pred=g + 1 >= STAGES)
                    if n0 >= d0:
                        _load_v_at(vd_desc, v_smem, v_ready, st, col, kvh)
                    else:
                        _load_v_at(v_desc, v_smem, v_ready, st, col, kvh)
                    g += 1
                it += 1

    @gluon.jit
    def _pers_serial_step(s, acc, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready,
                          rel, m_i, l_i, row_f, lr, rows, n0, L, full_end, g, rescale,
                          NEXT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                          CAUSAL: gl.constexpr, NW: gl.constexpr, WG: gl.constexpr):
        """One tile g of _pers_serial_tiles in the module docstring's order; rescale (a runtime
        flag, so that an item's first tile shares the copy of the step): not on an item's first
        tile (acc is zero); NEXT: S_{g+1} issued behind PV_g, then PV_g retired. P's registers
        stay alive to that wait (_keep_alive): the PV wgmma reads them asynchronously."""
        s_layout: gl.constexpr = wgmma_layout(NW, 1, BN, 32)
        o_layout: gl.constexpr = wgmma_layout(NW, 1, acc.type.shape[1], 32)
        st = g % STAGES
        s = warpgroup_mma_wait(0, deps=[s])
        a, m_i, l_i, alpha = _softmax_tile(s, sk_smem, sv_smem, st, m_i, l_i, row_f, lr, rows,
                                           n0, L, full_end, CAUSAL, o_layout)
        _ws_release(rel, st)
        if rescale:
            acc = _mul_rows(acc, alpha)
        _wait_v(v_smem, v_ready, st, g, n0, L, NW)
        if _TURNS:
            _named_barrier(_TURN_BAR + WG, False)
        acc = warpgroup_mma(a, v_smem.index(st).permute((1, 0)), acc, is_async=True)
        g += 1
        if NEXT:
            nst = g % STAGES
            mbarrier.wait(k_ready.index(nst), (g // STAGES) & 1)
            s = _issue_qk(q_tile, k_smem.index(nst), s_layout)
            if _TURNS:
                _named_barrier(_TURN_BAR + 1 - WG, True)
            acc = warpgroup_mma_wait(1, deps=[acc])     # in order: PV_g, not S_{g+1}
        else:
            if _TURNS:
                _named_barrier(_TURN_BAR + 1 - WG, True)
            acc = warpgroup_mma_wait(0, deps=[acc])
        _keep_alive(a)
        return s, acc, m_i, l_i, g

    @gluon.jit
    def _pers_serial_tiles(s, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel,
                           m_i, l_i, row_f, lr, rows, L, full_end, n_tiles, g,
                           BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                           CAUSAL: gl.constexpr, NW: gl.constexpr, WG: gl.constexpr):
        """Every tile of one item (g = its first tile's index, s = its S_0 in flight: issued by
        _issue_first), _pers_serial_step per tile, one copy for the tiles before the last and one
        for the last. Returns (acc with every PV added, m, l, g past the item)."""
        o_layout: gl.constexpr = wgmma_layout(NW, 1, D, 32)
        acc = gl.zeros([16 * NW, D], gl.float32, o_layout)
        for j in range(n_tiles - 1):
            s, acc, m_i, l_i, g = _pers_serial_step(
                s, acc, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel, m_i,
                l_i, row_f, lr, rows, j * BN, L, full_end, g, j > 0, True, BN, STAGES, CAUSAL,
                NW, WG)
        # the last tile (the only one of a one-tile item); its S is waited on: a plain tensor
        _s, acc, m_i, l_i, g = _pers_serial_step(
            s, acc, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel, m_i, l_i,
            row_f, lr, rows, (n_tiles - 1) * BN, L, full_end, g, n_tiles > 1, False, BN, STAGES,
            CAUSAL, NW, WG)
        return acc, m_i, l_i, g

    @gluon.jit
    def _issue_first(q_smem, k_smem, q_ready, k_ready, it, g, valid, WG: gl.constexpr,
                     s_layout: gl.constexpr):
        """S_0 = Q K_g^T of this warpgroup's head of the CTA's item `it` (Q buffer
        2 (it % QBUF) + WG, first tile g of the ring), issued as soon as its Q and K have landed;
        issued whether or not the item exists (valid: it does, so the waits happen), so that S
        stays one value in flight across the item loop (without an item it reads idle buffers and
        nobody uses it)."""
        QBUF: gl.constexpr = q_smem.type.shape[0] // 2
        STAGES: gl.constexpr = k_smem.type.shape[0]
        qb = it % QBUF
        st = g % STAGES
        mbarrier.wait(q_ready.index(qb), (it // QBUF) & 1, pred=valid)
        mbarrier.wait(k_ready.index(st), (g // STAGES) & 1, pred=valid)
        return _issue_qk(q_smem.index(2 * qb + WG), k_smem.index(st), s_layout)

    @gluon.jit
    def _pers_consumer(q_smem, k_smem, v_smem, sk_smem, sv_smem, o_smem, q_ready, q_free,
                       k_ready, v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ, VCAP, o_desc, O,
                       LSE, RMAX, stride_ot, stride_oh, T, qk_scale, WG: gl.constexpr,
                       D: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, NW: gl.constexpr, QBUF: gl.constexpr,
                       ROW_MAX: gl.constexpr):
        """Per item: _pers_serial_tiles on the CTA-wide tile sequence (S_0 issued at the item's
        start, or with PREFETCH behind the previous item's epilogue), free the Q buffer (every
        QK^T of the item is done), the epilogue."""
        BM: gl.constexpr = 16 * NW
        s_layout: gl.constexpr = wgmma_layout(NW, 1, BN, 32)
        g = 0
        it = 0
        # No dependent global load on an item's path: work list entries are loaded two items ahead
        # and the per-row loads (which need an entry) one item ahead, each issued when an item
        # starts, so they land while it computes.
        G = gl.num_programs(0)
        pid = gl.program_id(0)
        o_tile = o_smem.index(WG)
        if _TURNS:
            if WG == 1:
                _named_barrier(_TURN_BAR, True)     # warpgroup 0 takes the first turn
        doc, hp, kvh, start, L, blk = work_item(ITEMS, N_ITEMS, HQ // 2, GROUP // 2, W, pid)
        head = 2 * hp + WG
        sq, cap = _row_loads(SQ, VCAP, T, start, blk * BM, L, head, kvh, BM, s_layout)
        if _PREFETCH:
            s = _issue_first(q_smem, k_smem, q_ready, k_ready, 0, 0, doc >= 0, WG, s_layout)
        for w in range(pid, W, G):
            c_doc, c_head, c_L, c_blk, c_start, c_sq, c_cap = doc, head, L, blk, start, sq, cap
            doc, hp, kvh, start, L, blk = work_item(ITEMS, N_ITEMS, HQ // 2, GROUP // 2, W,
                                                    w + G)
            head = 2 * hp + WG
            if c_doc >= 0:
                row_f, lr = _row_constants(c_sq, c_cap, qk_scale)
                q_lo = c_blk * BM
                c_tok0, c_rows, c_row_ok = _query_rows(c_start, q_lo, c_L, BM, s_layout)
                full_end, n_tiles = _kv_tiles(q_lo, c_L, BM, BN, CAUSAL)
                m_i = gl.full_like(row_f, float("-inf"))
                l_i = _quad_sums(gl.zeros([BM, BN], gl.float32, s_layout))   # (BM, 4)
                qb = it % QBUF
                if _PREFETCH:
                    s0 = s
                else:
                    s0 = _issue_first(q_smem, k_smem, q_ready, k_ready, it, g, True, WG,
                                      s_layout)
                acc, m_i, l_i, g = _pers_serial_tiles(
                    s0, q_smem.index(2 * qb + WG), k_smem, v_smem, sk_smem, sv_smem, k_ready,
                    v_ready, rel, m_i, l_i, row_f, lr, c_rows, c_L, full_end, n_tiles, g, BN, D,
                    STAGES, CAUSAL, NW, WG)
                # every warp waited for the item's last QK^T before the last tile's release
                # barrier: the Q buffer may take item it + QBUF
                arrive_synced(q_free.index(qb))
                sq, cap = _row_loads(SQ, VCAP, T, start, blk * BM, L, head, kvh, BM, s_layout)
                l_i = gl.convert_layout(gl.sum(l_i, axis=1), m_i.type.layout)
                _store_out(acc, m_i, l_i, lr, o_desc, o_tile, O, LSE, RMAX, stride_ot,
                           stride_oh, T, c_tok0, q_lo, c_rows, c_row_ok, c_L, c_head, ROW_MAX)
                # the next item's S_0 runs under this one's stores and the next one's start (work
                # items with a document come first in the list: if the next one has none, no
                # later one has)
                if _PREFETCH:
                    s = _issue_first(q_smem, k_smem, q_ready, k_ready, it + 1, g, doc >= 0, WG,
                                     s_layout)
                it += 1
            else:
                sq, cap = _row_loads(SQ, VCAP, T, start, blk * BM, L, head, kvh, BM, s_layout)
        if _PREFETCH:
            warpgroup_mma_wait(0, deps=[s])     # the S_0 issued past the CTA's last item
        tma.store_wait(0)       # o_smem stays valid until the last O store has read it

    # values that follow cu_seqlens are not specialized on: one build for every split
    @gluon.jit(do_not_specialize=["T", "N_ITEMS"])
    def _attn_fwd_gluon_persistent_kernel(q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc,
                                          o_desc, SQ, VCAP, O, LSE, RMAX, PCU, ITEMS, stride_ot,
                                          stride_oh, T, N_ITEMS, HQ, GROUP, qk_scale,
                                          D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                                          STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                          PRODUCER_REGS: gl.constexpr, QBUF: gl.constexpr,
                                          ROW_MAX: gl.constexpr, CONS_REGS: gl.constexpr,
                                          num_warps: gl.constexpr):
        """kd_desc, vd_desc: the token copies; sc_desc: scale_cols; PCU: the padded
        columns' document starts (_pers_producer). ROW_MAX: the row max m into RMAX too."""
        W = N_ITEMS * (HQ // 2)
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * QBUF, BM, D], q_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [2, BM, D], o_desc.layout)
        k_smem, v_smem, sk_smem, sv_smem = _alloc_kv_ring(k_desc, v_desc, sc_desc, STAGES, BN, D)
        q_ready, q_free = alloc_barriers(QBUF), alloc_barriers(QBUF, 2)
        k_ready, v_ready = alloc_barriers(STAGES), alloc_barriers(STAGES)
        rel = alloc_barriers(STAGES, 2)
        gl.warp_specialize([
            (_pers_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, o_smem, q_ready, q_free,
                              k_ready, v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ, VCAP,
                              o_desc, O, LSE, RMAX, stride_ot, stride_oh, T, qk_scale, 0, D, BN,
                              STAGES, CAUSAL, num_warps, QBUF, ROW_MAX)),
            (_pers_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, o_smem, q_ready, q_free,
                              k_ready, v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ, VCAP,
                              o_desc, O, LSE, RMAX, stride_ot, stride_oh, T, qk_scale, 1, D, BN,
                              STAGES, CAUSAL, 4, QBUF, ROW_MAX)),
            (_pers_producer, (q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc,
                              q_smem, k_smem, v_smem, sk_smem, sv_smem, q_ready, q_free,
                              k_ready, v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, PCU, BM, BN,
                              CAUSAL, QBUF)),
        ], [4, 1], [CONS_REGS, PRODUCER_REGS])
        invalidate_barriers((q_ready, q_free, k_ready, v_ready, rel))


def launch(qkv: QuantizedQKV, items, causal: bool, scale: float, out, lse, row_max,
           cfg: PersistentFwdConfig) -> None:
    """The persistent kernel over the work list `items` (forward.attention_forward has checked the
    operands, check_operands included, and allocated out, lse and row_max, None or not)."""
    T, Hq, Hkv, D = qkv.shape
    BM, BN = cfg.block_m, cfg.block_n
    n_items = items.shape[1]
    if (Hq // Hkv) % 2:
        raise ValueError("the GQA-pair spike needs an even group")
    grid = persistent_grid(n_items * Hq // 2, 1, out.device)
    # three 4-warp groups (the producer warp rounds up to one): the launch register count fits
    # 384 threads, setmaxnreg moves the producer's share to the consumers
    maxnreg = 65536 // 384 // 8 * 8
    launch_kernel(_attn_fwd_gluon_persistent_kernel, grid,
        *_descriptors(qkv, BM, BN), descriptor_2d(out, T, Hq * D, Hq * D, [BM, D]), qkv.sq,
        qkv.vcap, out, lse, lse if row_max is None else row_max, qkv.kv_pcu, items,
        out.stride(0), out.stride(1), T, n_items, Hq, Hq // Hkv, scale * LOG2E, D=D, BM=BM, BN=BN,
        STAGES=PAIR_STAGES, CAUSAL=bool(causal), PRODUCER_REGS=cfg.producer_regs,
        QBUF=cfg.q_buffers, ROW_MAX=row_max is not None, CONS_REGS=PAIR_CONSUMER_REGS,
        num_warps=4, maxnreg=maxnreg)
