"""The fp8 attention forward for Hopper (sm_90a) in Gluon: a persistent, warp-specialized kernel.

Same contract, numerics, work list (flamia.ops.schedule) and KV tile grid as
flamia.ops.forward._attn_fwd_kernel for the fp8 recipe (token-block scaling: that module's
docstring); the bf16 recipe runs there only.

Each CTA walks work indices w = pid, pid + G, ... (G = grid size, config.ctas_per_sm CTAs per SM;
w = item * HQ + head) with one producer warp (24 registers) that issues every TMA load and runs
ahead across item boundaries, and one consumer warpgroup that computes. Per tile the consumer runs

    wait S_j = Q K_j^T (issued one tile earlier) -> softmax(S_j) -> release r_j
    -> acc *= alpha_j -> issue O += A_j V_j -> issue S_{j+1} -> retire PV_j

so each tile's PV wgmma is retired within its tile and P's e4m3 A operand never crosses the loop's
back edge (where the compiler would repack it); S_{j+1} crosses it in flight instead. V^T's columns
are in wgmma key order (flamia.ops.kmajor), as the Triton kernel's, so P becomes the A operand by a
register renaming and an in-thread pack, with no lane shuffles (_key_ordered, _e4m3_words). Per
row the operation order is the Triton kernel's (acc_j = alpha_j * acc_{j-1} + A_j V_j, l, m, the fp8
rounding of A, the epilogue; each exponent one FMA, one fp32 rounding), so results agree with it to
the fp32 rounding of the MMA and of the exponent, and P1 / P2 hold bitwise by construction (masked
scores are -inf, V^T columns outside the document are zeroed in shared memory before the PV wgmma,
masked sk / sv count as 0).

The producer loads each tile from the token or the block copies as the Triton kernel does
(_pers_producer); the consumer folds an unmasked tile's one K and one V scale into per-row constants
(_online_softmax_block). Per item the consumer waits on no global load (_pers_consumer), and a query
block inside its document leaves by a TMA store that nobody waits for (_store_out).

Ring protocol, in one tile sequence g = 0, 1, ... over all items of the CTA: K_g and V_g go to stage
g % STAGES; the consumer's release r_g (after S_g is read and PV_{g-1} retired) frees K_g and
V_{g-1}; the producer loads K_g after r_{g-STAGES} and V_g after r_{g-STAGES+1}. Q is double
buffered (item i's Q goes to buffer i % 2 after the consumer's q_free of item i - 2), so the next
item's Q loads while this one computes.

GQA pairs (config heads_per_cta = 2, PAIR_FWD_CONFIG; an even group, long documents): an item is
the query block of two query heads of one KV group (w = item * HQ / 2 + pair), one CTA per SM
with two consumer warpgroups, one per head, that read every K / V tile of the ring (the release
and q_free barriers take one arrival from each), so the CTA moves half the L2 -> shared bytes per
FLOP. The warpgroups take turns at the tensor cores on named barriers TURN_BAR + wg (FA3's
ping-pong): each issues PV_j and S_{j+1} between `bar.sync TURN_BAR + wg` and `bar.arrive
TURN_BAR + 1 - wg`, so that one warpgroup's softmax runs under the other's GEMMs. Each head's
rows see the same tiles, masks and operation order as in the one-head kernel: results are
bitwise the same.
"""
from __future__ import annotations

import torch

from .config import PersistentFwdConfig
from .gluon_common import HAVE_GLUON, descriptor_2d
from .launch import launch_kernel
from .layout import QuantizedQKV
from .numerics import LOG2E, log2_pow2
from .schedule import persistent_grid

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    from .gluon_common import (alloc_barriers, arrive_synced, invalidate_barriers, named_barrier,
                               wgmma_layout)
    from .kmajor import mma_key_order_gluon, mma_order16_gluon
    from .schedule import work_item

    _log2_pow2 = gluon.jit(log2_pow2.fn)
    TURN_BAR = gl.constexpr(8)     # the pair's turn barriers: ids 8 and 9 (Triton uses 0-7)


if HAVE_GLUON:

    @gluon.jit
    def _kv_tiles(q_lo, L, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
        """(full_end, n_tiles) of query rows [q_lo, q_lo + BM): keys < full_end are visible to
        every row, and the rows visit KV tiles 0 .. n_tiles - 1."""
        if CAUSAL:
            hi = gl.minimum(q_lo + BM, L)       # keys [0, hi) visited
            full_end = q_lo
        else:
            hi = L
            full_end = L
        return full_end, (hi + BN - 1) // BN

    @gluon.jit
    def _query_rows(start, q_lo, L, BM: gl.constexpr, s_layout: gl.constexpr):
        """(tok0, doc-local rows, row_ok) of query rows [q_lo, q_lo + BM) (the rows of S)."""
        rows = q_lo + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        return start.to(gl.int64), rows, rows < L

    @gluon.jit
    def _row_loads(SQ, VCAP, T, start, q_lo, L, head, kvh, BM: gl.constexpr,
                   s_layout: gl.constexpr):
        """sq and cap of query rows [q_lo, q_lo + BM) of an item (issued one item ahead)."""
        tok0, rows, row_ok = _query_rows(start, q_lo, L, BM, s_layout)
        sq = gl.load(SQ + head.to(gl.int64) * T + tok0 + rows, mask=row_ok, other=0.0)
        cap = gl.load(VCAP + kvh.to(gl.int64) * T + tok0 + rows, mask=row_ok, other=1.0)
        return sq, cap

    @gluon.jit
    def _row_constants(sq, cap, qk_scale):
        """row_f = sq * qk_scale and lr = log2(256 / cap), exact from cap's exponent bits (cap is
        a power of two or 0)."""
        ecap = ((cap.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
        lr = gl.where(cap > 0.0, gl.minimum(8 - ecap, 100), 0).to(gl.float32)
        return sq * qk_scale, lr

    @gluon.jit
    def _alloc_kv_ring(k_desc, v_desc, sc_desc, STAGES: gl.constexpr, BN: gl.constexpr,
                       D: gl.constexpr):
        """Shared memory of the STAGES-deep ring: K (BN x D), V^T (D x BN), sk and sv (1 x BN,
        boxes of scale_cols) per stage, in the layouts of their TMA descriptors."""
        k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BN], v_desc.layout)
        sk_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BN], sc_desc.layout)
        sv_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BN], sc_desc.layout)
        return k_smem, v_smem, sk_smem, sv_smem

    @gluon.jit
    def _load_k_cols(k_desc, sc_desc, k_smem, sk_smem, sv_smem, k_ready, st, krow, col, kvh,
                     srow_k, srow_v):
        """TMA of the K tile (BN x D) at token row krow (any row) and its sk / sv (1 x BN) from
        scale_cols rows srow_k / srow_v, column col (a multiple of 16), into ring stage st; the
        scales ride on K's barrier (S's softmax needs both). Sizes come from the buffers' types (a
        worker partition's constexpr arguments arrive as tensors)."""
        D: gl.constexpr = k_smem.type.shape[2]
        bk = k_ready.index(st)
        mbarrier.expect(bk, k_desc.block_type.nbytes + 2 * sc_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [krow, kvh * D], bk, k_smem.index(st))
        tma.async_copy_global_to_shared(sc_desc, [srow_k, col], bk, sk_smem.index(st))
        tma.async_copy_global_to_shared(sc_desc, [srow_v, col], bk, sv_smem.index(st))

    @gluon.jit
    def _load_v_at(v_desc, v_smem, v_ready, st, row, kvh):
        """TMA of the V^T tile (D x BN) at token column `row` of vt8 into ring stage st."""
        D: gl.constexpr = v_smem.type.shape[1]
        bv = v_ready.index(st)
        mbarrier.expect(bv, v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kvh * D, row], bv, v_smem.index(st))

    @gluon.jit
    def _issue_qk(q_tile, k_tile, s_layout: gl.constexpr):
        """S = Q K^T of one KV tile, as an async wgmma into a fresh accumulator."""
        BM: gl.constexpr = q_tile.type.shape[0]
        BN: gl.constexpr = k_tile.type.shape[0]
        return warpgroup_mma(q_tile, k_tile.permute((1, 0)),
                             gl.zeros([BM, BN], gl.float32, s_layout), use_acc=False,
                             is_async=True)

    @gluon.jit
    def _scale_view(ring, st, BN: gl.constexpr):
        """Stage st of a (STAGES, 1, BN) fp32 ring (unswizzled, i.e. row-major) as a 1-D view."""
        return ring.index(st)._reinterpret(gl.float32, [BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    @gluon.jit
    def _key_ordered(p, o_layout: gl.constexpr):
        """p (fp32, S's accumulator layout) with its keys in wgmma order (V^T's column order), in
        the PV wgmma's A operand layout: a register renaming (flamia.ops.kmajor). The identity move
        before it keeps the compiler from carrying the permuted layout back into the softmax, where
        the masks' index math would become bit shuffles; ptxas removes the moves."""
        p = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [p], dtype=gl.float32,
                                      is_pure=True, pack=1)
        return gl.convert_layout(mma_key_order_gluon(p),
                                 gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4))

    @gluon.jit
    def _e4m3_words(a32):
        """_key_ordered's fp32 values as e4m3 A-operand registers: each thread packs its 4
        consecutive keys (RNE, satfinite, as .to(float8e4nv)) into one 32-bit word, carried by
        the first fp32 value of its group of 4 (the other three are copies). Called in each
        branch of _softmax_tile, so that the cvts' inputs come from the branch's own arithmetic
        (ptxas then packs a register's two halves with F2FP.MERGE_C; from a join's values it
        adds a PRMT per register: benchmarks/merge_probe.py) and the join carries 32-bit words
        (e4m3 tensors cross a join as bytes, repacked at the wgmma)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $5, $4; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $7, $6; mov.b32 $0, {lo, hi}; "
            "mov.b32 $1, $0; mov.b32 $2, $0; mov.b32 $3, $0; }",
            "=r,=r,=r,=r,r,r,r,r", [a32], dtype=gl.float32, is_pure=True, pack=4)

    @gluon.jit
    def _words_operand(w):
        """The e4m3 A operand from _e4m3_words' registers (one per group of 4)."""
        a8 = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [w], dtype=gl.int8,
                                       is_pure=True, pack=4)
        return a8.to(gl.float8e4nv, bitcast=True)

    @gluon.jit
    def _quad_sums(p):
        """Partial row sums of p (BM, BN; S's accumulator layout: a quad's 4 lanes share each row)
        as (BM, 4), each lane's sum over its own columns, no shuffles. l' is kept so and reduced
        across the quad once per item (_pers_consumer)."""
        BM: gl.constexpr = p.type.shape[0]
        BN: gl.constexpr = p.type.shape[1]
        return gl.sum(gl.sum(gl.reshape(p, [BM, BN // 8, 4, 2]), axis=3), axis=1)

    @gluon.jit
    def _scale_quads(l4, x):
        """l4 (BM, 4) * x[:, None], x one value per row."""
        return l4 * gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(1, l4.type.layout)), 1)

    @gluon.jit
    def _online_softmax(s, sk_s, sv_s, m_i, l_i, row_f, lr, rows, n0, L,
                        CAUSAL: gl.constexpr, o_layout: gl.constexpr):
        """Online softmax of one masked S tile (the token copies' diagonal tiles, the document's
        end) in log2 units -> (p' sv key-ordered in fp32 (_key_ordered), m, l, alpha): y = s sk
        (-inf where masked), m = max(m, max(y) rf), p' = exp2(y rf + (lr - m)) by one FMA (the
        Triton kernel rounds x = y rf first; the two agree to the exponent's fp32 rounding). sk / sv
        are read from their shared-memory stage here (short live ranges). Keys past the document's
        end hold a neighbour's scales (maybe NaN): their scores become -inf and their sv 0, as with
        the Triton kernel's masks."""
        BN: gl.constexpr = s.type.shape[1]
        col_layout: gl.constexpr = gl.SliceLayout(0, s.type.layout)
        # tile-local key c (= key n0 + c) visible to row i iff c <= lim_i: one compare per score
        # against loop-invariant column indices (rows past the document's end, never stored, see its
        # keys as its last row does)
        c = gl.arange(0, BN, layout=col_layout)
        sv = gl.where(c < L - n0, sv_s.load(col_layout), 0.0)
        if CAUSAL:
            lim = gl.minimum(rows, L - 1) - n0
        else:
            lim = gl.zeros_like(rows) + (L - 1 - n0)
        valid = gl.expand_dims(c, 0) <= gl.expand_dims(lim, 1)
        y = gl.where(valid, s * gl.expand_dims(sk_s.load(col_layout), 0), float("-inf"))
        # x = y rf: rf >= 0 keeps the max, and the exponent is one FMA; rf = 0 (an all-zero q
        # row, whose scores are 0) is taken as 1 so that a masked -inf * rf stays -inf
        rf = gl.where(row_f == 0.0, 1.0, row_f)
        m_new = gl.maximum(m_i, gl.max(y, axis=1) * rf)
        p = gl.exp2(gl.fma(y, gl.expand_dims(rf, 1), gl.expand_dims(lr - m_new, 1)))
        alpha = gl.exp2(m_i - m_new)
        l_i = _scale_quads(l_i, alpha) + _quad_sums(p)
        return _key_ordered(p * gl.expand_dims(sv, 0), o_layout), m_new, l_i, alpha

    @gluon.jit
    def _tile_scale(ring, st, BN: gl.constexpr):
        """The one scale of a block copy's tile: element 0 of ring stage st (every key of the
        tile holds its 128-token block's scale), as a scalar."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        return gl.max(_scale_view(ring, st, BN).slice(0, 1).load(one), axis=0)

    @gluon.jit
    def _online_softmax_block(s, sk_smem, sv_smem, st, m_i, l_i, row_f, lr,
                              o_layout: gl.constexpr):
        """_online_softmax of an unmasked tile of the token-block scaling's block copies, whose
        keys share one power-of-two sk and sv: no per-element scale work and no scale vector.
        s * sk joins the row factor (rf = row_f sk, an exact rescaling), and sv the exponent's
        per-row constant: A = e4m3(exp2(s rf + (e - m))) with e = lr + log2 sv, which is
        e4m3(p' sv) up to the fp32 rounding of that constant. l' takes sum(p' sv) * 2^(lr - e).
        e is floored at -90 (only when sv / cap < 2^-98, where every A is 0 anyway: p' sv <=
        2^(lr + log2 sv) < 2^-90) so that the p' sv behind l' cannot underflow to 0; an sv of
        0 gives A = 0 and l' = sum p', a NaN sv a NaN tile, as the per-key form does."""
        BN: gl.constexpr = s.type.shape[1]
        sk = _tile_scale(sk_smem, st, BN)
        sv = _tile_scale(sv_smem, st, BN)
        rf = row_f * sk
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * rf)
        e = lr + _log2_pow2(sv)
        e = gl.where(e < -90.0, -90.0, e)                    # (a NaN e stays NaN)
        p = gl.exp2(gl.fma(s, gl.expand_dims(rf, 1), gl.expand_dims(e - m_new, 1)))
        alpha = gl.exp2(m_i - m_new)
        l_i = _scale_quads(l_i, alpha) + _scale_quads(_quad_sums(p), gl.exp2(lr - e))
        return _key_ordered(p, o_layout), m_new, l_i, alpha

    @gluon.jit
    def _softmax_tile(s, sk_smem, sv_smem, st, m_i, l_i, row_f, lr, rows, n0, L, full_end,
                      CAUSAL: gl.constexpr, o_layout: gl.constexpr):
        """_online_softmax of the S tile whose keys start at n0 (scales in ring stage st), masked
        where the tile reaches past the document's end or full_end, else _online_softmax_block ->
        (A, m, l, alpha), A the PV wgmma's e4m3 operand in V^T's key order."""
        BN: gl.constexpr = s.type.shape[1]
        sk_s = _scale_view(sk_smem, st, BN)
        sv_s = _scale_view(sv_smem, st, BN)
        if n0 + BN > full_end:
            a, m_i, l_i, alpha = _online_softmax(s, sk_s, sv_s, m_i, l_i, row_f, lr, rows, n0, L,
                                                 CAUSAL, o_layout)
            w = _e4m3_words(a)
        else:
            a, m_i, l_i, alpha = _online_softmax_block(s, sk_smem, sv_smem, st, m_i, l_i, row_f,
                                                       lr, o_layout)
            w = _e4m3_words(a)
        return _words_operand(w), m_i, l_i, alpha

    @gluon.jit
    def _mul_rows(acc, x):
        """acc * x[:, None]: x holds one value per row (in any layout)."""
        return acc * gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(1, acc.type.layout)), 1)

    @gluon.jit
    def _zero_v_outside(v_tile, n0, L, num_warps: gl.constexpr):
        """Zero in place the V^T columns (keys; column c holds key n0 + mma_order16(c)) of a ring
        stage that lie outside the document: their P is 0, but 0 * NaN is NaN in the MMA, and a
        neighbouring document's keys (head tile, document end) must not let its NaN/Inf in (P2).
        Only for the <= 2 edge tiles per item."""
        BN: gl.constexpr = v_tile.type.shape[1]
        TPW_N: gl.constexpr = BN // 16
        blk: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_N, TPW_N], [num_warps, 1], [1, 0])
        v = v_tile.load(blk)
        c = gl.arange(0, BN, layout=gl.SliceLayout(0, blk))
        cols = n0 + mma_order16_gluon(c)
        ok = gl.expand_dims((cols >= 0) & (cols < L), 0)
        v = gl.where(ok, v, gl.zeros_like(v))
        v_tile.store(v)
        fence_async_shared()      # generic-proxy stores -> visible to the wgmma (async proxy)
        gl.thread_barrier()       # every thread's columns written before any warp issues PV

    @gluon.jit
    def _wait_v(v_smem, v_ready, st, j, n0, L, num_warps: gl.constexpr):
        """Wait for V^T tile j (ring stage st, keys from n0) and zero its keys outside the
        document if it is an edge tile, before the PV wgmma reads it."""
        STAGES: gl.constexpr = v_smem.type.shape[0]
        BN: gl.constexpr = v_smem.type.shape[2]
        mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
        if (n0 < 0) | (n0 + BN > L):
            _zero_v_outside(v_smem.index(st), n0, L, num_warps)

    @gluon.jit
    def _store_out(acc, m_i, l_i, lr, o_desc, o_smem, O, LSE, RMAX, stride_ot, stride_oh, T,
                   tok0, q_lo, rows, row_ok, L, head, ROW_MAX: gl.constexpr):
        """Epilogue of query rows [q_lo, q_lo + BM): O = acc / l', lse = ln2 * (m + log2 l' - lr)
        and, ROW_MAX, the row max ln2 * m into RMAX. A block inside its document goes out through
        o_smem by one TMA store that the consumer does not wait for (the next epilogue's store_wait
        does, before it reuses o_smem); a block reaching past the document's end is stored
        row-masked from registers (a TMA box would overwrite the next document's first rows)."""
        BM: gl.constexpr = acc.type.shape[0]
        D: gl.constexpr = acc.type.shape[1]
        inv_l = 1.0 / l_i
        out = _mul_rows(acc, inv_l).to(O.dtype.element_ty)
        if q_lo + BM <= L:
            tma.store_wait(0)           # the previous block's store has read o_smem
            gl.thread_barrier()
            o_smem.store(out)
            fence_async_shared()        # generic-proxy writes -> visible to the TMA (async proxy)
            gl.thread_barrier()         # every warp's rows written before the copy starts
            tma.async_copy_shared_to_global(o_desc, [(tok0 + q_lo).to(gl.int32), head * D],
                                            o_smem)
        else:
            rows_o = q_lo + gl.arange(0, BM, layout=gl.SliceLayout(1, acc.type.layout))
            offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc.type.layout))
            o_ptrs = (O + gl.expand_dims((tok0 + rows_o) * stride_ot, 1) + head * stride_oh
                      + gl.expand_dims(offs_d, 0))
            gl.store(o_ptrs, out, mask=gl.expand_dims(rows_o < L, 1))
        lse = (m_i + gl.log2(l_i) - lr) * 0.6931471805599453
        gl.store(LSE + head.to(gl.int64) * T + tok0 + rows, lse, mask=row_ok)
        if ROW_MAX:
            gl.store(RMAX + head.to(gl.int64) * T + tok0 + rows, m_i * 0.6931471805599453,
                     mask=row_ok)

    @gluon.jit
    def _ws_release(rel, st):
        """One arrival of this consumer warpgroup on release barrier st, by one thread once the
        barrier has seen every warp's scale reads complete; the fence orders those generic-proxy
        reads (and the V zeroing stores) before the producer's next TMA write to the stage."""
        fence_async_shared()
        gl.thread_barrier()
        arrive_synced(rel.index(st))

    @gluon.jit
    def _pers_producer(q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc, q_smem,
                       k_smem, v_smem, sk_smem, sv_smem, q_ready, q_free, k_ready, v_ready, rel,
                       ITEMS, N_ITEMS, HQ, GROUP, W, PCU, BM: gl.constexpr, BN: gl.constexpr,
                       CAUSAL: gl.constexpr, QBUF: gl.constexpr, HPC: gl.constexpr):
        """Every TMA load. An item's Q tiles (HPC heads: Q buffer HPC (it % QBUF) + i holds head
        HPC hp + i) and its K / V tiles: tile t holds the document's keys [t BN, (t + 1) BN), from
        the token copies (kd_desc, vd_desc, scale_cols rows 2-3) on the query block's own
        128-block when causal, else from the block copies (k_desc, v_desc, scale_cols rows 0-1;
        sc_desc is scale_cols); V^T and the scales at the padded column PCU[doc] + t BN."""
        STAGES: gl.constexpr = k_smem.type.shape[0]
        D: gl.constexpr = k_smem.type.shape[2]
        g = 0               # tiles loaded so far (the CTA-wide tile sequence)
        it = 0              # items started so far
        for w in range(gl.program_id(0), W, gl.num_programs(0)):
            doc, hp, kvh, start, L, blk = work_item(ITEMS, N_ITEMS, HQ // HPC, GROUP // HPC, W,
                                                    w)
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
                mbarrier.expect(q_ready.index(qb), HPC * q_desc.block_type.nbytes)
                for i in gl.static_range(HPC):
                    tma.async_copy_global_to_shared(q_desc, [start + q_lo, (HPC * hp + i) * D],
                                                    q_ready.index(qb), q_smem.index(HPC * qb + i))
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
    def _keep_alive(x):
        """Keeps x's registers (an fp8 wgmma A operand) allocated past the wait that retires the
        wgmma reading them: an empty asm statement, no instruction (warpgroup_mma_wait's deps takes
        no 8-bit tensor in triton 3.6)."""
        gl.inline_asm_elementwise("", "=r,r", [x], dtype=gl.int8, is_pure=False, pack=4)

    @gluon.jit
    def _pers_serial_step(s, acc, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready,
                          rel, m_i, l_i, row_f, lr, rows, n0, L, full_end, g, rescale,
                          NEXT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                          CAUSAL: gl.constexpr, NW: gl.constexpr, WG: gl.constexpr,
                          TURNS: gl.constexpr):
        """One tile g of _pers_serial_tiles in the module docstring's order; rescale (a runtime
        flag, so that an item's first tile shares the copy of the step): not on an item's first
        tile (acc is zero); NEXT: S_{g+1} issued behind PV_g, then PV_g retired. P's registers
        stay alive to that wait (_keep_alive): the PV wgmma reads them asynchronously. TURNS
        (two consumer warpgroups, WG = 0, 1): PV_g and S_{g+1} are issued in this warpgroup's
        turn (module docstring)."""
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
        if TURNS:
            named_barrier(TURN_BAR + WG, 256, False)
        acc = warpgroup_mma(a, v_smem.index(st).permute((1, 0)), acc, is_async=True)
        g += 1
        if NEXT:
            nst = g % STAGES
            mbarrier.wait(k_ready.index(nst), (g // STAGES) & 1)
            s = _issue_qk(q_tile, k_smem.index(nst), s_layout)
            if TURNS:
                named_barrier(TURN_BAR + 1 - WG, 256, True)
            acc = warpgroup_mma_wait(1, deps=[acc])     # in order: PV_g, not S_{g+1}
        else:
            if TURNS:
                named_barrier(TURN_BAR + 1 - WG, 256, True)
            acc = warpgroup_mma_wait(0, deps=[acc])
        _keep_alive(a)
        return s, acc, m_i, l_i, g

    @gluon.jit
    def _pers_serial_tiles(q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel,
                           m_i, l_i, row_f, lr, rows, L, full_end, n_tiles, g,
                           BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                           CAUSAL: gl.constexpr, NW: gl.constexpr, WG: gl.constexpr,
                           TURNS: gl.constexpr):
        """Every tile of one item (Q ready, g = its first tile's index): S_0 issued here, then
        _pers_serial_step per tile, one copy for the tiles before the last and one for the last
        (S_{j+1} in flight and the retired acc cross the loop's back edge, never P's A operand).
        Returns (acc with every PV added, m, l, g past the item)."""
        s_layout: gl.constexpr = wgmma_layout(NW, 1, BN, 32)
        o_layout: gl.constexpr = wgmma_layout(NW, 1, D, 32)
        st = g % STAGES
        mbarrier.wait(k_ready.index(st), (g // STAGES) & 1)
        s = _issue_qk(q_tile, k_smem.index(st), s_layout)
        acc = gl.zeros([16 * NW, D], gl.float32, o_layout)
        for j in range(n_tiles - 1):
            s, acc, m_i, l_i, g = _pers_serial_step(
                s, acc, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel, m_i,
                l_i, row_f, lr, rows, j * BN, L, full_end, g, j > 0, True, BN, STAGES, CAUSAL,
                NW, WG, TURNS)
        # the last tile (the only one of a one-tile item); its S is waited on: a plain tensor
        _s, acc, m_i, l_i, g = _pers_serial_step(
            s, acc, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel, m_i, l_i,
            row_f, lr, rows, (n_tiles - 1) * BN, L, full_end, g, n_tiles > 1, False, BN, STAGES,
            CAUSAL, NW, WG, TURNS)
        return acc, m_i, l_i, g

    @gluon.jit
    def _pers_consumer(q_smem, k_smem, v_smem, sk_smem, sv_smem, o_smem, q_ready, q_free,
                       k_ready, v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ, VCAP, o_desc, O,
                       LSE, RMAX, stride_ot, stride_oh, T, qk_scale, D: gl.constexpr,
                       BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                       NW: gl.constexpr, QBUF: gl.constexpr, ROW_MAX: gl.constexpr,
                       HPC: gl.constexpr, WG: gl.constexpr):
        """Consumer WG of HPC (head WG of each item's HPC heads): per item wait for its Q,
        _pers_serial_tiles on the CTA-wide tile sequence, free the Q buffer (every QK^T of the
        item is done), the epilogue."""
        BM: gl.constexpr = 16 * NW
        s_layout: gl.constexpr = wgmma_layout(NW, 1, BN, 32)
        TURNS: gl.constexpr = HPC == 2
        o_tile = o_smem.index(WG)
        if TURNS:
            if WG == 1:
                named_barrier(TURN_BAR, 256, True)     # warpgroup 0 takes the first turn
        g = 0
        it = 0
        # No dependent global load on an item's path: work list entries are loaded two items ahead
        # and the per-row loads (which need an entry) one item ahead, each issued when an item
        # starts, so they land while it computes.
        G = gl.num_programs(0)
        pid = gl.program_id(0)
        doc, hp, kvh, start, L, blk = work_item(ITEMS, N_ITEMS, HQ // HPC, GROUP // HPC, W, pid)
        head = HPC * hp + WG
        sq, cap = _row_loads(SQ, VCAP, T, start, blk * BM, L, head, kvh, BM, s_layout)
        for w in range(pid, W, G):
            c_doc, c_head, c_L, c_blk, c_start, c_sq, c_cap = doc, head, L, blk, start, sq, cap
            doc, hp, kvh, start, L, blk = work_item(ITEMS, N_ITEMS, HQ // HPC, GROUP // HPC, W,
                                                    w + G)
            head = HPC * hp + WG
            if c_doc >= 0:
                row_f, lr = _row_constants(c_sq, c_cap, qk_scale)
                q_lo = c_blk * BM
                c_tok0, c_rows, c_row_ok = _query_rows(c_start, q_lo, c_L, BM, s_layout)
                full_end, n_tiles = _kv_tiles(q_lo, c_L, BM, BN, CAUSAL)
                m_i = gl.full_like(row_f, float("-inf"))
                l_i = _quad_sums(gl.zeros([BM, BN], gl.float32, s_layout))   # (BM, 4)
                qb = it % QBUF
                q_tile = q_smem.index(HPC * qb + WG)

                mbarrier.wait(q_ready.index(qb), (it // QBUF) & 1)
                acc, m_i, l_i, g = _pers_serial_tiles(
                    q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel, m_i, l_i,
                    row_f, lr, c_rows, c_L, full_end, n_tiles, g, BN, D, STAGES, CAUSAL, NW, WG,
                    TURNS)
                # every warp waited for the item's last QK^T before the last tile's release
                # barrier: the Q buffer may take item it + QBUF
                arrive_synced(q_free.index(qb))
                sq, cap = _row_loads(SQ, VCAP, T, start, blk * BM, L, head, kvh, BM, s_layout)
                l_i = gl.convert_layout(gl.sum(l_i, axis=1), m_i.type.layout)
                _store_out(acc, m_i, l_i, lr, o_desc, o_tile, O, LSE, RMAX, stride_ot,
                           stride_oh, T, c_tok0, q_lo, c_rows, c_row_ok, c_L, c_head, ROW_MAX)
                it += 1
            else:
                sq, cap = _row_loads(SQ, VCAP, T, start, blk * BM, L, head, kvh, BM, s_layout)
        tma.store_wait(0)       # o_smem stays valid until the last O store has read it

    # values that follow cu_seqlens are not specialized on: one build for every split
    @gluon.jit(do_not_specialize=["T", "N_ITEMS"])
    def _attn_fwd_gluon_persistent_kernel(q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc,
                                          o_desc, SQ, VCAP, O, LSE, RMAX, PCU, ITEMS, stride_ot,
                                          stride_oh, T, N_ITEMS, HQ, GROUP, qk_scale,
                                          D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                                          STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                          PRODUCER_REGS: gl.constexpr, QBUF: gl.constexpr,
                                          ROW_MAX: gl.constexpr, HPC: gl.constexpr,
                                          CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """kd_desc, vd_desc: the token copies; sc_desc: scale_cols; PCU: the padded
        columns' document starts (_pers_producer). ROW_MAX: the row max m into RMAX too. HPC:
        query heads per item (1, or 2: a second consumer warpgroup at CONSUMER_REGS)."""
        W = N_ITEMS * (HQ // HPC)
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [HPC * QBUF, BM, D], q_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [HPC, BM, D], o_desc.layout)
        k_smem, v_smem, sk_smem, sv_smem = _alloc_kv_ring(k_desc, v_desc, sc_desc, STAGES, BN, D)
        q_ready, q_free = alloc_barriers(QBUF), alloc_barriers(QBUF, HPC)
        k_ready, v_ready = alloc_barriers(STAGES), alloc_barriers(STAGES)
        rel = alloc_barriers(STAGES, HPC)
        if HPC == 2:
            gl.warp_specialize([
                (_pers_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, o_smem, q_ready,
                                  q_free, k_ready, v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ,
                                  VCAP, o_desc, O, LSE, RMAX, stride_ot, stride_oh, T, qk_scale, D,
                                  BN, STAGES, CAUSAL, num_warps, QBUF, ROW_MAX, HPC, 0)),
                (_pers_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, o_smem, q_ready,
                                  q_free, k_ready, v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ,
                                  VCAP, o_desc, O, LSE, RMAX, stride_ot, stride_oh, T, qk_scale, D,
                                  BN, STAGES, CAUSAL, num_warps, QBUF, ROW_MAX, HPC, 1)),
                (_pers_producer, (q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc, q_smem,
                                  k_smem, v_smem, sk_smem, sv_smem, q_ready, q_free, k_ready,
                                  v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, PCU, BM, BN, CAUSAL,
                                  QBUF, HPC)),
            ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_pers_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, o_smem, q_ready,
                                  q_free, k_ready, v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ,
                                  VCAP, o_desc, O, LSE, RMAX, stride_ot, stride_oh, T, qk_scale, D,
                                  BN, STAGES, CAUSAL, num_warps, QBUF, ROW_MAX, HPC, 0)),
                (_pers_producer, (q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc, q_smem,
                                  k_smem, v_smem, sk_smem, sv_smem, q_ready, q_free, k_ready,
                                  v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, PCU, BM, BN, CAUSAL,
                                  QBUF, HPC)),
            ], [1], [PRODUCER_REGS])
        invalidate_barriers((q_ready, q_free, k_ready, v_ready, rel))


def check_operands(qkv: QuantizedQKV) -> None:
    """What the persistent kernel needs beyond forward.attention_forward's checks."""
    if not HAVE_GLUON:
        raise NotImplementedError("triton.experimental.gluon is not available")
    if not qkv.kvblock:
        raise NotImplementedError(f"the Gluon forward implements the fp8 recipe, not "
                                  f"{qkv.recipe!r}")
    if qkv.vt8 is None:
        raise ValueError("the Gluon forward reads V from its K-major copy: quantize_qkv's vt8")
    if qkv.shape[3] not in (64, 128):
        raise ValueError(f"head dim {qkv.shape[3]}: the Gluon forward supports 64 and 128")
    if qkv.vt8.stride(2) != 1:
        raise ValueError("vt8 must be (Hkv, D, T_pad) with unit stride over tokens")


def _descriptors(qkv: QuantizedQKV, BM: int, BN: int):
    """Host TMA descriptors of q, k, V^T, scale_cols (an (n * Hkv, Tp) matrix, box (1, BN) at
    16-aligned columns) and the token copies' k and V^T (causal; else k's and V^T's, unused): a
    (T, H, D) tensor as a (T, H*D) matrix, vt8 (Hkv, D, Tp) as an (Hkv*D, Tp) one."""
    T, Hq, Hkv, D = qkv.shape
    sc = qkv.scale_cols

    def kv(k8, vt8):
        return (descriptor_2d(k8, T, Hkv * D, k8.stride(0), [BN, D]),
                descriptor_2d(vt8, Hkv * D, vt8.shape[2], vt8.stride(1), [D, BN]))
    kd, vd = kv(qkv.k8, qkv.vt8)
    kdd, vdd = kv(qkv.k8_diag, qkv.vt8_diag) if qkv.k8_diag is not None else (kd, vd)
    return (descriptor_2d(qkv.q8, T, Hq * D, qkv.q8.stride(0), [BM, D]), kd, vd,
            descriptor_2d(sc, sc.shape[0] * Hkv, sc.shape[2], sc.shape[2], [1, BN]), kdd, vdd)


def launch(qkv: QuantizedQKV, items, causal: bool, scale: float, out, lse, row_max,
           cfg: PersistentFwdConfig) -> None:
    """The persistent kernel over the work list `items` (forward.attention_forward has checked the
    operands, check_operands included, and allocated out, lse and row_max, None or not)."""
    T, Hq, Hkv, D = qkv.shape
    BM, BN = cfg.block_m, cfg.block_n
    if cfg.heads_per_cta not in (1, 2) or (Hq // Hkv) % cfg.heads_per_cta:
        raise ValueError(f"config.heads_per_cta={cfg.heads_per_cta} must be 1 or 2 and divide "
                         f"the GQA group Hq / Hkv = {Hq // Hkv}")
    n_items = items.shape[1]
    # GQA pairs: 3 warpgroups launch at maxnreg; setmaxnreg gives the producer's warpgroup
    # producer_regs and each consumer warpgroup the rest (168 x 384 = 2 x 240 x 128 + 24 x 128)
    consumer_regs = (cfg.maxnreg * 384 - cfg.producer_regs * 128) // 256 // 8 * 8
    grid = persistent_grid(n_items * Hq // cfg.heads_per_cta, cfg.ctas_per_sm, out.device)
    launch_kernel(_attn_fwd_gluon_persistent_kernel, grid,
        *_descriptors(qkv, BM, BN), descriptor_2d(out, T, Hq * D, Hq * D, [BM, D]), qkv.sq,
        qkv.vcap, out, lse, lse if row_max is None else row_max, qkv.kv_pcu, items,
        out.stride(0), out.stride(1), T, n_items, Hq, Hq // Hkv, scale * LOG2E, D=D, BM=BM, BN=BN,
        STAGES=cfg.stages, CAUSAL=bool(causal), PRODUCER_REGS=cfg.producer_regs,
        QBUF=cfg.q_buffers, ROW_MAX=row_max is not None, HPC=cfg.heads_per_cta,
        CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=cfg.maxnreg)
