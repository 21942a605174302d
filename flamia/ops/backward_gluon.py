"""Gluon (Hopper sm_90a) dK/dV and dQ kernels of the split backward, for the fp8 and fp8_mixed
recipes: backward.launch_dkdv / launch_dq run them on sm_90 GPUs (config.uses_gluon_backward).

They consume the `BwdState` of `backward.make_state` + `backward.launch_preprocess` and write
st.dk / st.dv / st.dq like the Triton kernels (dK, dQ * sm_scale, Hadamard rotate-back when
st.rotate, cast to the gradient dtype). The configs are st.cfg.dkdv / st.cfg.dq
(flamia.ops.config: GluonDkdvConfig / GluonDqConfig for fp8, MixedDkdvConfig / MixedDqConfig
for fp8_mixed).

fp8 dK/dV (`_dkdv_fp8_kernel`; per tile the numerics of backward._dkdv_tile, RECIPE == 0):

    S^T  = (k8_j q8_i^T) * rowf_j * sq_i            rowf_j = sk_j * sm_scale * log2(e)
    a    = P^T sdo_i = exp2(S^T - (lse2_i - log2 sdo_i))     masked (exact 0) on diagonal / tail
    dV_j += c_j  * (e4m3(a / c_j) @ do8_i)           c_j  = _pow2_scale(max_i |a|)  over the tile
    t    = (v8_j do8_i^T) * sv_j - Delta_i           (Delta in units of sdo_i)
    b    = a * t * sq_i
    dK_j += c2_j * (e4m3(b / c2_j) @ q8_i)           c2_j = _pow2_scale(max_i |b|)

with the per-tile fp32 promotion: every fp8 wgmma of the dV / dK GEMMs starts from a zero
accumulator and its result is scaled and added to fp32 registers by the CUDA cores (Hopper's fp8
accumulator keeps fewer bits than fp32; chaining it across tiles cost 1.5e-2 at 32k tokens). The
query block of a tile is BM = 64 rows (the Triton kernel uses 32), so the per-tile scales are
over other subsets: results match by the FlashAttention rule, not bitwise.
  - K_j, V_j (BN x D, token-major) land in shared memory once, by TMA. Per query block (a
    flattened loop over the GROUP query heads of the kv head and the query blocks i >= the kv
    block for causal), an NS-stage TMA + mbarrier ring brings q8_i, do8_i (token-major, B
    operands of S^T / dP^T), qT8_i, doT8_i (the K-major copies in the padded per-document layout,
    B operands of dK / dV) and one (4, BM) box of the per-query vectors lse (folded with sdo),
    Delta, sq, sdo: rows 4h .. 4h + 3 of an (Hq * 4, Tp) buffer in the same padded layout, which
    launch_preprocess gathers in its copy launch (vector_gathers). TMA needs the innermost box
    coordinate 16-byte aligned (an unaligned one is an illegal instruction on Hopper, not a
    masked read: triton-lang/triton#7385): pstart + i0 is, h * T + start + i0 is not.
  - S^T and dP^T are issued back to back as async wgmmas; the kernel waits for S^T only and
    computes a, c_j, e4m3(a / c_j) while dP^T runs. The dV and dK GEMMs are split into 64-column
    halves of D so that at most two 64 x 64 fp32 results are in flight next to the two BN x D
    accumulators (255 registers / thread).
  - Tiles that reach past the document end (at most one per head) get their K-major tiles'
    out-of-document columns zeroed in shared memory (a NaN byte of the next document would
    survive 0 * NaN in the MMA) and a / b masked with `where` (never multiplied: the next
    document's lse / sdo / Delta / sq / q8 / do8 come in through the TMA boxes).
  - D=64 (GluonDkdvConfig.ws): FA3's layout, BN = 128 keys and two consumer warpgroups (64 keys
    each) in one CTA per SM, fed by a 1-warp TMA producer partition (_release_slot's comment);
    its A operands go in in wgmma key order (key_order_dv / dk). D=128: one warpgroup per 64
    keys, two CTAs per SM, the dV GEMM issued after the dS^T operand (late_dv) and the masks as
    one threshold compare (threshold_mask).

fp8 dQ (`_dq_fp8_persistent_kernel`; backward._dq_tile for RECIPE == 0): two CTAs per SM walk
the forward's work list (flamia.ops.schedule), one (document, query head, 64-row query block)
item at a time, a 1-warp producer running ahead across items; the consumer warpgroup loops over
the kv blocks j0 = 0, BN, .. (j <= i causal):

    S  = (q8_i k8_j^T) * sk_j * rowf_i              rowf_i = sq_i * sm_scale * log2(e)
    P  = exp2(S - lse2_i)
    t  = (do8_i v8_j^T) * sv_j - Delta_i             (Delta in units of sdo_i)
    b  = P t sk_j                                    masked (where) on diagonal / end tiles
    dQ_i += c_i * (e4m3(b / c_i) @ kT8_j)            c_i = _pow2_scale(max_j |b|) over the tile
    epilogue: dQ_i * sdo_i * sm_scale, rotate back, cast

q8_i / do8_i come by TMA per item; the ring brings k8_j, v8_j, kT8_j and sk_j / sv_j as (1, BN)
boxes of (Hkv, Tp) padded copies (gathered with the query vectors). BN = 64 = the Triton
kernel's, so the per-row scales c_i are over the same key subsets.

fp8_mixed (`_dkdv_mixed_kernel`, `_dq_mixed_kernel`; RECIPE == 1): forward in fp8, dP and the
dS GEMMs in bf16. One program per (document, kv head, 64 keys) / (document, query head, 64
queries):

    S^T  = (k8_j q8_i^T) * rowf_j * sq_i            fp8 wgmma (bitwise the forward's S)
    a    = P^T sdo_i, dV_j += c_j * (e4m3(a / c_j) @ doT8_i)     fp8, as the fp8 recipe
    dS^T = P^T ((bf16(V_j) bf16(dO_i)^T) sv_j - Delta_i)         bf16 wgmma, fp32 sums
    dK_j += bf16(dS^T sq_i) @ bf16(q8_i)             bf16 wgmma accumulating in place
    dS   = P ((bf16(dO_i) bf16(V_j)^T) sv_j - Delta_i);  dQ_i += bf16(dS sk_j) @ bf16(k8_j)
    epilogue: * sm_scale (no sdo: the bf16 path never scaled dO), rotate back, cast.
Hopper's bf16 wgmma sums in fp32, so the bf16 GEMMs chain their accumulators across tiles; only
fp8 results are promoted per tile. e4m3 values are exact in bf16: dK's B operand Q_i is made in
the kernel (q8_i's tile converted to bf16 in shared memory while S^T / dP^T run; rows past the
document end zeroed on tail tiles), V_j, K_j and dO come by TMA from host bf16 copies
(mixed_operands, one pass). Every bf16 tile is a (rows, 64) box (128-byte rows): D = 128 GEMMs
reducing over D are two chained wgmmas, those producing D columns two 64-column halves. The
per-row vectors come as four (1, BM) / two (1, BN) boxes of padded copies (torch gathers).
"""
from __future__ import annotations

import functools

import torch
import triton

try:   # Gluon ships with triton >= 3.5; keep the module importable where it does not
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    HAVE_GLUON = True
except ImportError:   # pragma: no cover
    HAVE_GLUON = False

from .config import RECIPE_IDS, GluonDkdvConfig, GluonDqConfig, MixedDkdvConfig, MixedDqConfig
from .kmajor import mma_key_order_gluon, mma_order16_gluon
from .schedule import persistent_grid, work_list

if HAVE_GLUON:   # the persistent kernels' work-list reader
    from .schedule import work_item

LOG2E = 1.4426950408889634
CH_ = 64    # column chunk of D for the dV / dK GEMM results and accumulators
RECIPE_FP8, RECIPE_MIXED = RECIPE_IDS["fp8"], RECIPE_IDS["fp8_mixed"]


if HAVE_GLUON:
    CH = gl.constexpr(CH_)


    @gluon.jit
    def _pow2_scale_g(amax, FMT_EXP: gl.constexpr):
        """backward._pow2_scale for the kernels' A operands: (s, 1/s), s the smallest power of
        two with amax / s <= 1.75 * 2^FMT_EXP, clamped to 2^-126; NaN for Inf / NaN. Exact bit
        arithmetic. Unlike backward._pow2_scale an all-zero row (amax == 0) gets (2^-126,
        2^126), not (0, 0): its operand row is the same signed zeros either way (x * 2^126 of a
        zero), so is its GEMM row r (signed zeros, or NaN from a non-finite B), and r * s is r
        under either scale: bitwise the same results, two `where`s less per row (D=128 dK/dV
        929 -> 917 SASS per tile, dQ 515 -> 507)."""
        bits = amax.to(gl.int32, bitcast=True)
        e = (bits >> 23) & 0xFF
        e_new = e - FMT_EXP + ((bits & 0x7FFFFF) > 0x600000).to(gl.int32)
        e_new = gl.minimum(gl.maximum(e_new, 1), 254)
        scale = (e_new << 23).to(gl.float32, bitcast=True)
        inv = ((254 - e_new) << 23).to(gl.float32, bitcast=True)
        bad = (amax != amax) | (amax == float("inf"))
        scale = gl.where(bad, float("nan"), scale)
        inv = gl.where(bad, float("nan"), inv)
        return scale, inv

    @gluon.jit
    def _issue_tile(it, nb, lo, start, pstart, hk, q_desc, do_desc, qT_desc, doT_desc, vec_desc,
                    q_s, do_s, qT_s, doT_s, vec_s, ready, pred, GROUP, D: gl.constexpr,
                    BM: gl.constexpr, NS: gl.constexpr):
        """TMA loads of query tile `it` (head g = it // nb, block i0) into ring slot it % NS."""
        i0, h = _q_tile_rows(it, nb, lo, hk, GROUP, BM)
        _issue_tile_at(i0, h, it % NS, start, pstart, q_desc, do_desc, qT_desc, doT_desc,
                       vec_desc, q_s, do_s, qT_s, doT_s, vec_s, ready, pred, D)

    @gluon.jit
    def _issue_tile_at(i0, h, s, start, pstart, q_desc, do_desc, qT_desc, doT_desc, vec_desc,
                       q_s, do_s, qT_s, doT_s, vec_s, ready, pred, D: gl.constexpr):
        """TMA loads of the query tile (head h, first row i0) into ring slot s: q8_i, do8_i
        (token-major), qT8_i, doT8_i (K-major, padded columns) and one (4, BM) box of the packed
        per-query vectors lse, Delta, sq, sdo (rows 4h .. 4h + 3 of vector_gathers' buffer)."""
        bar = ready.index(s)
        # the full boxes' bytes (TMA counts out-of-bounds fills too), from the descriptors
        NBYTES: gl.constexpr = (2 * q_desc.block_type.nbytes + 2 * qT_desc.block_type.nbytes
                                + vec_desc.block_type.nbytes)
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [start + i0, h * D], bar, q_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(do_desc, [start + i0, h * D], bar, do_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(qT_desc, [h * D, pstart + i0], bar, qT_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(doT_desc, [h * D, pstart + i0], bar, doT_s.index(s),
                                        pred=pred)
        tma.async_copy_global_to_shared(vec_desc, [h * 4, pstart + i0], bar, vec_s.index(s),
                                        pred=pred)

    @gluon.jit
    def _row_vec(ring, s, COL: gl.constexpr, ROW: gl.constexpr = 0):
        """A per-query (or per-key) vector of the tile in the column slice layout of the MMA
        results: stage s of a (NS, R, BM) fp32 ring of TMA boxes (unswizzled, so read as a
        plain 1-D buffer), row ROW when the ring packs R > 1 vectors, else row 0."""
        R: gl.constexpr = ring.shape[1]
        BM: gl.constexpr = ring.shape[2]
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        if R == 1:
            x = ring.index(s)._reinterpret(gl.float32, [BM], flat).load(COL)
        else:
            x = ring.index(s)._reinterpret(gl.float32, [R * BM], flat).slice(
                ROW * BM, BM).load(COL)
        return x

    @gluon.jit
    def _mma(a, b, zero):
        """a @ b from a zero accumulator: an async wgmma (a token for _mma_wait)."""
        return warpgroup_mma(a, b, zero, use_acc=False, is_async=True)

    @gluon.jit
    def _mma_wait(tok, N: gl.constexpr):
        return warpgroup_mma_wait(N, deps=(tok,))

    @gluon.jit
    def _promote(tok, N: gl.constexpr, acc, c):
        """The fp32 promotion of one fresh fp8 GEMM result: acc + result * c per row, once the
        wgmma is retired (waited for down to N groups still in flight)."""
        return acc + _mma_wait(tok, N) * gl.expand_dims(c, 1)

    @gluon.jit
    def _promote_pair(tok0, tok1, acc0, acc1, c):
        """_promote of two in-flight 64-column GEMM halves (issued in this order, no later
        wgmma outstanding), each as soon as it is done."""
        acc0 = _promote(tok0, 1, acc0, c)
        acc1 = _promote(tok1, 0, acc1, c)
        return acc0, acc1

    @gluon.jit
    def _zero_tail_cols(x_s, i0, L, D: gl.constexpr, BM: gl.constexpr, num_warps: gl.constexpr,
                        KEY_ORDER: gl.constexpr = False):
        """Zero the columns (query tokens) >= L of a K-major (D, BM) fp8 tile in shared memory
        (KEY_ORDER: column c holds token mma_order16(c) of the tile, tiles 16-aligned)."""
        BLT: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        x = x_s.load(BLT)
        c = gl.arange(0, BM, layout=gl.SliceLayout(0, BLT))
        if KEY_ORDER:
            c = mma_order16_gluon(c)
        cols = i0 + c
        ok = gl.expand_dims(cols < L, 0)
        x = gl.where(ok, x, gl.zeros_like(x))
        x_s.store(x)

    @gluon.jit
    def _rotate_store(x0, x1, hmat, dst, rows_ok, row_off, out_scale,
                      D: gl.constexpr, BN: gl.constexpr, NCH: gl.constexpr,
                      LACC: gl.constexpr, num_warps: gl.constexpr):
        """dK (BN x D fp32 in NCH chunks of 64 columns) @ H_D / sqrt(D), H_D the +-1 Sylvester
        matrix, stored as bf16/fp16/fp32 (dst's dtype). Like backward._rotate: each chunk is split
        x = hi + lo into two bf16 operands, GEMMs in bf16 with fp32 accumulation (H is exact in
        bf16). H_128 = [[H64, H64], [H64, -H64]]: one 64 x 64 block of hmat in shared memory."""
        h_s = _hadamard_tile(hmat, D, num_warps)
        fence_async_shared()
        gl.thread_barrier()
        _rotate_store_h(x0, x1, h_s, dst, rows_ok, row_off, out_scale, BN, NCH, LACC, num_warps)

    @gluon.jit
    def _hadamard_tile(hmat, D: gl.constexpr, num_warps: gl.constexpr):
        """The 64 x 64 block H_64 of hmat (+-1, exact in bf16) in shared memory (the caller
        fences and syncs before a wgmma reads it)."""
        BLH: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        hr = gl.arange(0, CH, layout=gl.SliceLayout(1, BLH))
        hc = gl.arange(0, CH, layout=gl.SliceLayout(0, BLH))
        hv = gl.load(hmat + gl.expand_dims(hr, 1) * D + gl.expand_dims(hc, 0))
        return gl.allocate_shared_memory(gl.bfloat16, [CH, CH],
                                         gl.NVMMASharedLayout.get_default_for([CH, CH],
                                                                              gl.bfloat16), hv)

    @gluon.jit
    def _rotate_store_h(x0, x1, h_s, dst, rows_ok, row_off, out_scale, BN: gl.constexpr,
                        NCH: gl.constexpr, LACC: gl.constexpr, num_warps: gl.constexpr):
        """_rotate_store with H_64 already in shared memory (h_s, _hadamard_tile)."""
        LB: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, CH, 16])
        AOPB: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=LB, k_width=2)
        hi0 = x0.to(gl.bfloat16)
        lo0 = (x0 - hi0.to(gl.float32)).to(gl.bfloat16)
        hi0 = gl.convert_layout(hi0, AOPB)
        lo0 = gl.convert_layout(lo0, AOPB)
        zero = gl.zeros([BN, CH], gl.float32, LB)
        if NCH == 1:
            o0 = warpgroup_mma(hi0, h_s, zero, use_acc=False)
            o0 = warpgroup_mma(lo0, h_s, o0)
            o0 = gl.convert_layout(o0 * out_scale, LACC)
            _store_chunk(o0, dst, rows_ok, row_off, 0, LACC)
        else:
            hi1 = x1.to(gl.bfloat16)
            lo1 = (x1 - hi1.to(gl.float32)).to(gl.bfloat16)
            hi1 = gl.convert_layout(hi1, AOPB)
            lo1 = gl.convert_layout(lo1, AOPB)
            # out[:, :64] = x0 H64 + x1 H64 ; out[:, 64:] = x0 H64 - x1 H64
            o0 = warpgroup_mma(hi0, h_s, zero, use_acc=False)
            o0 = warpgroup_mma(hi1, h_s, o0)
            o0 = warpgroup_mma(lo0, h_s, o0)
            o0 = warpgroup_mma(lo1, h_s, o0)
            o0 = gl.convert_layout(o0 * out_scale, LACC)
            _store_chunk(o0, dst, rows_ok, row_off, 0, LACC)
            o1 = warpgroup_mma(hi0, h_s, zero, use_acc=False)
            o1 = warpgroup_mma(-hi1, h_s, o1)
            o1 = warpgroup_mma(lo0, h_s, o1)
            o1 = warpgroup_mma(-lo1, h_s, o1)
            o1 = gl.convert_layout(o1 * out_scale, LACC)
            _store_chunk(o1, dst, rows_ok, row_off, CH, LACC)

    @gluon.jit
    def _store_chunk(x, dst, rows_ok, row_off, col0: gl.constexpr, LACC: gl.constexpr):
        cols = col0 + gl.arange(0, CH, layout=gl.SliceLayout(0, LACC))
        ptr = dst + gl.expand_dims(row_off, 1) + gl.expand_dims(cols, 0)
        gl.store(ptr, x.to(dst.dtype.element_ty), mask=gl.expand_dims(rows_ok, 1))

    @gluon.jit
    def _store_pair(x0, x1, dst, rows_ok, row_off, NCH: gl.constexpr, LACC: gl.constexpr):
        """A (rows, D) result held as NCH 64-column chunks (x1 unused when NCH == 1)."""
        _store_chunk(x0, dst, rows_ok, row_off, 0, LACC)
        if NCH == 2:
            _store_chunk(x1, dst, rows_ok, row_off, CH, LACC)

    @gluon.jit
    def _store_out(x0, x1, hmat, dst, rows_ok, row_off, out_scale, ROTATE: gl.constexpr,
                   D: gl.constexpr, ROWS: gl.constexpr, NCH: gl.constexpr, LACC: gl.constexpr,
                   num_warps: gl.constexpr):
        """dK / dQ out: with ROTATE rotated back to the caller's frame first (_rotate_store)."""
        if ROTATE:
            _rotate_store(x0, x1, hmat, dst, rows_ok, row_off, out_scale, D, ROWS, NCH, LACC,
                          num_warps)
        else:
            _store_pair(x0, x1, dst, rows_ok, row_off, NCH, LACC)

    @gluon.jit
    def _dkdv_program(cu, pcu, HKV, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                      num_warps: gl.constexpr):
        """Program (doc * HKV + hk, key block) of a dK/dV kernel: kv head hk, the document's
        start / length / padded start and the first key n0 (the caller returns when
        n0 >= L_doc)."""
        gl.static_assert(BM == CH, "the S^T / dP^T tiles share the chunk layout (BM == 64)")
        gl.static_assert(D % CH == 0 and D <= 2 * CH, "D must be 64 or 128")
        gl.static_assert(BN == 16 * num_warps, "one m64 wgmma row block per warpgroup")
        pid = gl.program_id(0)
        jb = gl.program_id(1)
        doc = pid // HKV
        hk = pid % HKV
        start = gl.load(cu + doc)
        L_doc = gl.load(cu + doc + 1) - start
        pstart = gl.load(pcu + doc)
        n0 = jb * BN
        return hk, start, L_doc, pstart, n0

    @gluon.jit
    def _dq_program(cu, pcu, HQ, GROUP, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                    num_warps: gl.constexpr):
        """Program (doc * HQ + h, query block) of a dQ kernel: query head h, kv head hk, the
        document's start / length / padded start and the query block ib (the caller returns
        when ib < 0)."""
        gl.static_assert(BN == CH, "S / dP tiles share the chunk layout of the dQ results")
        gl.static_assert(D % CH == 0 and D <= 2 * CH, "D must be 64 or 128")
        gl.static_assert(BM == 16 * num_warps, "one m64 wgmma row block per warpgroup")
        pid = gl.program_id(0)
        doc = pid // HQ
        h = pid % HQ
        hk = h // GROUP
        start = gl.load(cu + doc)
        L_doc = gl.load(cu + doc + 1) - start
        pstart = gl.load(pcu + doc)
        # the document's last (longest causal) query block first, as backward._bwd_dq
        ib = gl.cdiv(L_doc, BM) - 1 - gl.program_id(1)
        return h, hk, start, L_doc, pstart, ib

    @gluon.jit
    def _vec_ring(desc, NS: gl.constexpr, BOX: gl.constexpr):
        """The (NS, R, BOX) fp32 ring of a per-row vector's TMA boxes (R rows per box: 1, or 4
        packed vectors; the descriptor's unswizzled layout)."""
        R: gl.constexpr = desc.block_type.shape[0]
        return gl.allocate_shared_memory(gl.float32, [NS, R, BOX], desc.layout)

    @gluon.jit
    def _init_barriers(NS: gl.constexpr, WS: gl.constexpr):
        """The ring's `ready` barriers, the barrier of the operands loaded once and with WS the
        consumer's `rel` barriers (else `ready`, a placeholder never touched), initialized."""
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        once = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if WS:
            rel = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        else:
            rel = ready
        for si in gl.static_range(NS):
            mbarrier.init(ready.index(si), count=1)
            if WS:
                mbarrier.init(rel.index(si), count=1)
        mbarrier.init(once, count=1)
        fence_async_shared()
        return ready, once, rel

    @gluon.jit
    def _invalidate_barriers(ready, once, rel, NS: gl.constexpr, WS: gl.constexpr):
        for si in gl.static_range(NS):
            mbarrier.invalidate(ready.index(si))
            if WS:
                mbarrier.invalidate(rel.index(si))
        mbarrier.invalidate(once)

    @gluon.jit
    def _dkdv_bounds(n0, L_doc, GROUP, BM: gl.constexpr, CAUSAL: gl.constexpr):
        """A dK/dV program's query rows from lo (causal: the kv block's first key), nb blocks
        per head, total = GROUP * nb tiles."""
        if CAUSAL:
            lo = n0
        else:
            lo = 0
        nb = gl.cdiv(L_doc - lo, BM)
        total = GROUP * nb
        return lo, nb, total

    @gluon.jit
    def _causal_shift(L_doc, CAUSAL: gl.constexpr):
        """The masks keep key <= query + shift: 0 causal, L_doc (never binding) otherwise."""
        if CAUSAL:
            shift = 0
        else:
            shift = L_doc
        return shift

    @gluon.jit
    def _dq_bounds(m0, L_doc, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
        """A dQ program's kv tiles (total, from key 0), the first key whose tile is masked and
        the causal mask's shift."""
        if CAUSAL:
            hi = gl.minimum(m0 + BM, L_doc)
            mask_from = m0        # tiles reaching past the block's first row: causal mask
        else:
            hi = L_doc
            mask_from = L_doc     # only the end tile
        total = gl.cdiv(hi, BN)
        return mask_from, _causal_shift(L_doc, CAUSAL), total

    @gluon.jit
    def _key_scales(sk, sv, hk, T, start, n0, L_doc, qk_scale2, BN: gl.constexpr,
                    ROW: gl.constexpr):
        """A dK/dV program's keys (masked loads, once): index, in-document mask, the S^T row
        factor rowf_j = sk_j * sm_scale * log2(e), and sv_j."""
        n_idx = n0 + gl.arange(0, BN, layout=ROW)
        n_ok = n_idx < L_doc
        sk_j = gl.load(sk + hk * T + start + n_idx, mask=n_ok, other=0.0)
        rowf = sk_j * qk_scale2
        sv_j = gl.load(sv + hk * T + start + n_idx, mask=n_ok, other=0.0)
        return n_idx, n_ok, rowf, sv_j

    @gluon.jit
    def _query_scales(lse, sq, delta, h, T, start, m0, L_doc, qk_scale2, BM: gl.constexpr,
                      ROW: gl.constexpr):
        """A dQ program's queries (masked loads, once; rows past the end get lse = +inf):
        index, in-document mask, lse2 = lse * log2(e), rowf_i = sq_i * sm_scale * log2(e),
        Delta_i."""
        m_idx = m0 + gl.arange(0, BM, layout=ROW)
        m_ok = m_idx < L_doc
        lse2 = gl.load(lse + h * T + start + m_idx, mask=m_ok,
                       other=float("inf")) * 1.4426950408889634
        rowf = gl.load(sq + h * T + start + m_idx, mask=m_ok, other=0.0) * qk_scale2
        dl_i = gl.load(delta + h * T + start + m_idx, mask=m_ok, other=0.0)
        return m_idx, m_ok, lse2, rowf, dl_i

    @gluon.jit
    def _q_tile_rows(it, nb, lo, hk, GROUP, BM: gl.constexpr):
        """First row i0 and query head h of a dK/dV program's tile `it` (head-major order)."""
        g = it // nb
        i0 = lo + (it - g * nb) * BM
        h = hk * GROUP + g
        return i0, h

    @gluon.jit
    def _q_tile_at(i0, n0, L_doc, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr,
                   COL: gl.constexpr):
        """A dK/dV loop tile from its first row i0: the query indices, whether it reaches past
        the document end (tail) and whether it needs the mask (tail or causal diagonal)."""
        m_idx = i0 + gl.arange(0, BM, layout=COL)
        tail = i0 + BM > L_doc
        if CAUSAL:
            need_mask = tail | (i0 < n0 + BN)
        else:
            need_mask = tail
        return m_idx, tail, need_mask

    @gluon.jit
    def _next_tile(g, blk, nb):
        """(head, block) of the next tile in the head-major order of _q_tile_rows, from the
        current one: a compare and two adds instead of a runtime division per tile."""
        blk = blk + 1
        wrap = (blk == nb).to(gl.int32)
        return g + wrap, blk - wrap * nb

    @gluon.jit
    def _kv_tile(jt, L_doc, mask_from, BN: gl.constexpr, COL: gl.constexpr):
        """Tile `jt` of the dQ loop: first key j0, whether it reaches past the document end,
        whether it needs the mask, the key indices."""
        j0 = jt * BN
        end = j0 + BN > L_doc
        need_mask = j0 + BN > mask_from
        n_idx = j0 + gl.arange(0, BN, layout=COL)
        return j0, end, need_mask, n_idx

    @gluon.jit
    def _issue_query_vecs(lse_desc, dl_desc, sq_desc, sdo_desc, lse_s, dl_s, sq_s, sdo_s,
                          h, c0, bar, s, pred):
        """TMA of a dK/dV query tile's lse / Delta / sq / sdo boxes into ring slot s: row h,
        column c0 = pstart + i0 of the padded (Hq, Tp) copies (16-aligned, like qT8's)."""
        tma.async_copy_global_to_shared(lse_desc, [h, c0], bar, lse_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(dl_desc, [h, c0], bar, dl_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(sq_desc, [h, c0], bar, sq_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(sdo_desc, [h, c0], bar, sdo_s.index(s), pred=pred)

    @gluon.jit
    def _issue_key_vecs(sk_desc, sv_desc, sk_s, sv_s, hk, c0, bar, s, pred):
        """TMA of a dQ kv tile's sk / sv boxes into ring slot s: row hk, column c0 = pstart + j0
        of the padded (Hkv, Tp) copies."""
        tma.async_copy_global_to_shared(sk_desc, [hk, c0], bar, sk_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(sv_desc, [hk, c0], bar, sv_s.index(s), pred=pred)

    @gluon.jit
    def _dv_operand(s_tok, s, rowf, n_idx, cols, L_doc, shift, need_mask, lse_s, sq_s, sdo_s,
                    PENDING: gl.constexpr, BM: gl.constexpr, COL: gl.constexpr,
                    AOP: gl.constexpr, FOLD: gl.constexpr, THR: gl.constexpr,
                    KEY_ORDER: gl.constexpr = False, LAZY: gl.constexpr = False):
        """P^T of a dK/dV tile from its S^T wgmma (waited for down to PENDING groups) and the
        dV GEMM's A operand: a = P^T sdo_i (masked), its per-key scale c_j, e4m3(a / c_j).
        cols: the tile's query indices, or with LAZY its first query (_cols_of).
        FOLD (the fp8 kernel): the lse ring holds lse * log2(e) - log2(sdo_i), the exponent
        gives a at once (p is then a as well: only for callers that do not need P itself).
        Without FOLD (fp8_mixed) lse_s / sq_s / sdo_s are separate (1, BM) rings; with it one
        packed (4, BM) ring (rows lse, Delta, sq, sdo)."""
        lse2 = _row_vec(lse_s, s, COL)
        if not FOLD:
            lse2 = lse2 * 1.4426950408889634
        sq_i = _row_vec(sq_s, s, COL, 2)
        st = _mma_wait(s_tok, PENDING)
        p = gl.exp2(st * gl.expand_dims(rowf, 1) * gl.expand_dims(sq_i, 0)
                    - gl.expand_dims(lse2, 0))
        if FOLD:
            a = p
        else:
            sdo_i = _row_vec(sdo_s, s, COL, 3)
            a = p * gl.expand_dims(sdo_i, 0)
        if need_mask:   # on a (not P): sdo of another document's token may be NaN
            a = gl.where(_visible(n_idx, _cols_of(cols, BM, COL, LAZY), shift, L_doc, THR), a,
                         0.0)
        c, inv = _pow2_scale_g(gl.max(gl.abs(a), axis=1), 8)
        if KEY_ORDER:
            a8 = gl.convert_layout(
                mma_key_order_gluon((a * gl.expand_dims(inv, 1)).to(gl.float8e4nv)), AOP)
        else:
            a8 = gl.convert_layout((a * gl.expand_dims(inv, 1)).to(gl.float8e4nv), AOP)
        return p, a, c, a8

    @gluon.jit
    def _cols_of(cols, BM: gl.constexpr, COL: gl.constexpr, LAZY: gl.constexpr):
        """The query indices of a dK/dV tile: `cols` itself, or with LAZY
        (MixedDkdvConfig.lazy_cols) computed here from cols = the tile's first query, inside
        each masked branch that needs them. Computed once for both branches, before the
        first, they cost every tile ~64 SASS instructions (the column pattern rebuilt from
        the lane id). Inside, the fp8_mixed kernel is 14 % faster on the H200; the fp8 kernel
        at D=128 20 % slower (ptxas spills more: 276 B), so it keeps the indices."""
        if LAZY:
            cols = cols + gl.arange(0, BM, layout=COL)
        return cols

    @gluon.jit
    def _visible(n_idx, m_idx, shift, L_doc, THR: gl.constexpr):
        """(key, query) pairs of a dK/dV tile that count: key <= query + shift and the query in
        the document. THR: as one compare per element against a per-column threshold (the
        last visible key, -1 past the document end; keys are >= 0), the same predicate."""
        if THR:
            thr = gl.where(m_idx < L_doc, m_idx + shift, -1)
            ok = gl.expand_dims(n_idx, 1) <= gl.expand_dims(thr, 0)
        else:
            ok = ((gl.expand_dims(m_idx, 0) + shift >= gl.expand_dims(n_idx, 1))
                  & gl.expand_dims(m_idx < L_doc, 0))
        return ok

    @gluon.jit
    def _mask_ds_t(b, n_idx, cols, shift, L_doc, need_mask, COL: gl.constexpr,
                   LAZY: gl.constexpr = False):
        """dK/dV: b (the dK operand before scaling) masked like a in _dv_operand, where needed:
        dP^T, Delta, sq of out-of-document columns may be anything (another document). cols:
        as in _dv_operand."""
        BM: gl.constexpr = b.shape[1]
        if need_mask:
            m_idx = _cols_of(cols, BM, COL, LAZY)
            # the predicate of _dv_operand's `ok`, written differently: as the same expression
            # the compiler computed it once, before the first `if`, on every tile (~120 of
            # ~1200 SASS instructions per tile)
            ok2 = (((gl.expand_dims(n_idx, 1) - gl.expand_dims(m_idx, 0)) <= shift)
                   & gl.expand_dims((L_doc - m_idx) > 0, 0))
            b = gl.where(ok2, b, 0.0)
        return b

    @gluon.jit
    def _mask_ds(b, n_idx, m_idx, shift, L_doc, need_mask):
        """dQ: b masked where needed (key <= query + shift, key in the document); `where`, not
        * 0: keys past the end (next document) may be NaN."""
        if need_mask:
            ok = ((gl.expand_dims(n_idx, 0) <= gl.expand_dims(m_idx, 1) + shift)
                  & gl.expand_dims(n_idx < L_doc, 0))
            b = gl.where(ok, b, 0.0)
        return b

    @gluon.jit
    def _dkdv_epilogue(acc_dv0, acc_dv1, acc_dk0, acc_dk1, dv, dk, hmat, n_idx, n_ok, start,
                       hk, stride_dkt, sm_scale, out_scale, ROTATE: gl.constexpr,
                       D: gl.constexpr, BN: gl.constexpr, NCH: gl.constexpr,
                       L: gl.constexpr, num_warps: gl.constexpr):
        """dV as accumulated, dK * sm_scale (rotated back with ROTATE). dK may come in another
        MMA layout with the same registers as L (fp8_mixed's bf16 one): converted for free."""
        row_off = (start + n_idx) * stride_dkt + hk * D
        _store_pair(acc_dv0, acc_dv1, dv, n_ok, row_off, NCH, L)
        acc_dk0 = gl.convert_layout(acc_dk0, L) * sm_scale
        acc_dk1 = gl.convert_layout(acc_dk1, L) * sm_scale
        _store_out(acc_dk0, acc_dk1, hmat, dk, n_ok, row_off, out_scale, ROTATE, D, BN, NCH, L,
                   num_warps)

    @gluon.jit
    def _release_slot(rel, s):
        """The consumer partition is done with ring slot s. The fence orders this thread's
        generic-proxy stores (tail zeroing) before the producer's next TMA write; the
        partition-wide barrier makes every consumer warp (dK/dV: both warpgroups) be past its
        wgmma waits and ld.shared of the slot before the one arrival (mbarrier.arrive is issued
        by the partition's thread 0 only)."""
        fence_async_shared()
        bar = rel.index(s)
        gl.thread_barrier()   # (the one Triton's membar pass put here anyway: no extra bar.sync)
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _dkdv_producer(k_desc, v_desc, q_desc, do_desc, qT_desc, doT_desc, vec_desc,
                       k_s, v_s, q_s, do_s, qT_s, doT_s, vec_s,
                       ready, rel, kv_bar, start, pstart, n0, hk, lo, nb, total, GROUP):
        """The 1-warp TMA partition of _dkdv_fp8_kernel with WS. Sizes from the buffers' types
        (constexpr arguments of a worker partition arrive as tensors in Triton 3.6)."""
        NS: gl.constexpr = q_s.type.shape[0]
        BM: gl.constexpr = q_s.type.shape[1]
        D: gl.constexpr = q_s.type.shape[2]
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [start + n0, hk * D], kv_bar, k_s)
        tma.async_copy_global_to_shared(v_desc, [start + n0, hk * D], kv_bar, v_s)
        for pi in gl.static_range(NS):
            _issue_tile(pi, nb, lo, start, pstart, hk, q_desc, do_desc, qT_desc, doT_desc,
                        vec_desc, q_s, do_s, qT_s, doT_s, vec_s, ready, pi < total, GROUP, D,
                        BM, NS)
        for j in range(total - NS):
            mbarrier.wait(rel.index(j % NS), (j // NS) & 1)
            _issue_tile(j + NS, nb, lo, start, pstart, hk, q_desc, do_desc, qT_desc, doT_desc,
                        vec_desc, q_s, do_s, qT_s, doT_s, vec_s, ready, True, GROUP, D, BM, NS)

    @gluon.jit
    def _dkdv_loop(q_desc, do_desc, qT_desc, doT_desc, vec_desc, k_s, v_s, q_s, do_s, qT_s,
                   doT_s, vec_s, ready, rel, kv_bar, sk, sv, start, pstart, L_doc, n0, hk, lo,
                   nb, total, GROUP, T, qk_scale2,
                   D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
                   CAUSAL: gl.constexpr, WS: gl.constexpr, THR_MASK: gl.constexpr,
                   LATE_DV: gl.constexpr, num_warps: gl.constexpr,
                   KEY_ORDER_DV: gl.constexpr = False, KEY_ORDER_DK: gl.constexpr = False):
        """The main loop of _dkdv_fp8_kernel (with WS: its consumer partition); returns the
        fp32 accumulators (dV half 0, 1, dK half 0, 1)."""
        NCH: gl.constexpr = D // CH
        # One MMA layout for S^T, dP^T, and every 64-column chunk of the dV / dK results and
        # accumulators: per-key scale vectors broadcast without layout conversions.
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, CH, 32])
        AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=4)
        ROW: gl.constexpr = gl.SliceLayout(1, L)     # per key (rows of S^T)
        COL: gl.constexpr = gl.SliceLayout(0, L)     # per query (columns of S^T)

        n_idx, n_ok, rowf, sv_j = _key_scales(sk, sv, hk, T, start, n0, L_doc, qk_scale2, BN, ROW)

        zero = gl.zeros([BN, CH], gl.float32, L)
        acc_dv0 = gl.zeros([BN, CH], gl.float32, L)
        acc_dk0 = gl.zeros([BN, CH], gl.float32, L)
        acc_dv1 = gl.zeros([BN, CH], gl.float32, L)
        acc_dk1 = gl.zeros([BN, CH], gl.float32, L)
        shift = _causal_shift(L_doc, CAUSAL)
        mbarrier.wait(kv_bar, 0)
        # (head, block) cursors of the current tile and of the tile NS - 1 ahead (the refill):
        # advanced per tile, so the loop divides by nb only here (a runtime division per tile
        # costs ~40 SASS of the ~1000 per tile at D=128, and 6 % of doc32k's time)
        g_cur = 0
        blk_cur = 0
        g_nxt = (NS - 1) // nb
        blk_nxt = (NS - 1) - g_nxt * nb

        for it in range(total):
            if not WS:   # refill the slot consumed at it - 1 (its wgmmas were all waited for)
                nxt = it + NS - 1
                _issue_tile_at(lo + blk_nxt * BM, hk * GROUP + g_nxt, nxt % NS, start, pstart,
                               q_desc, do_desc, qT_desc, doT_desc, vec_desc, q_s, do_s, qT_s,
                               doT_s, vec_s, ready, nxt < total, D)
                g_nxt, blk_nxt = _next_tile(g_nxt, blk_nxt, nb)
            s = it % NS
            i0 = lo + blk_cur * BM
            h = hk * GROUP + g_cur
            m_idx, tail, need_mask = _q_tile_at(i0, n0, L_doc, BM, BN, CAUSAL, COL)
            g_cur, blk_cur = _next_tile(g_cur, blk_cur, nb)
            mbarrier.wait(ready.index(s), (it // NS) & 1)
            qs = q_s.index(s)
            dos = do_s.index(s)
            qTs = qT_s.index(s)
            doTs = doT_s.index(s)
            s_tok = _mma(k_s, qs.permute((1, 0)), zero)
            dp_tok = _mma(v_s, dos.permute((1, 0)), zero)

            if tail:   # at most once per head: the K-major tiles' columns past the document end
                _zero_tail_cols(qTs, i0, L_doc, D, BM, num_warps, KEY_ORDER_DK)
                _zero_tail_cols(doTs, i0, L_doc, D, BM, num_warps, KEY_ORDER_DV)
                fence_async_shared()
                gl.thread_barrier()

            p, a, c, a8 = _dv_operand(s_tok, s, rowf, n_idx, m_idx, L_doc, shift, need_mask,
                                      vec_s, vec_s, vec_s, 1, BM, COL, AOP, True, THR_MASK,
                                      KEY_ORDER_DV)
            if not LATE_DV:   # dV's first half overlaps the dS^T math (32 result registers)
                dv0_tok = _mma(a8, doTs.slice(0, CH, dim=0).permute((1, 0)), zero)

            dl_i = _row_vec(vec_s, s, COL, 1)
            if LATE_DV:   # nothing issued after dP^T yet
                dp = _mma_wait(dp_tok, 0)
            else:
                dp = _mma_wait(dp_tok, 1)
            t = dp * gl.expand_dims(sv_j, 1) - gl.expand_dims(dl_i, 0)
            # sq_i again from shared memory: not kept live in registers across the wgmma waits
            sq_i2 = _row_vec(vec_s, s, COL, 2)
            b = _mask_ds_t(a * t * gl.expand_dims(sq_i2, 0), n_idx, m_idx, shift, L_doc,
                           need_mask, COL)
            c2, inv2 = _pow2_scale_g(gl.max(gl.abs(b), axis=1), 8)
            if KEY_ORDER_DK:
                b8 = gl.convert_layout(
                    mma_key_order_gluon((b * gl.expand_dims(inv2, 1)).to(gl.float8e4nv)), AOP)
            else:
                b8 = gl.convert_layout((b * gl.expand_dims(inv2, 1)).to(gl.float8e4nv), AOP)
            if LATE_DV:
                dv0_tok = _mma(a8, doTs.slice(0, CH, dim=0).permute((1, 0)), zero)

            if NCH == 2:
                dv1_tok = _mma(a8, doTs.slice(CH, CH, dim=0).permute((1, 0)), zero)
                acc_dv0 = _promote(dv0_tok, 1, acc_dv0, c)
                dk0_tok = _mma(b8, qTs.slice(0, CH, dim=0).permute((1, 0)), zero)
                acc_dv1 = _promote(dv1_tok, 1, acc_dv1, c)
                dk1_tok = _mma(b8, qTs.slice(CH, CH, dim=0).permute((1, 0)), zero)
                acc_dk0, acc_dk1 = _promote_pair(dk0_tok, dk1_tok, acc_dk0, acc_dk1, c2)
            else:
                dk0_tok = _mma(b8, qTs.permute((1, 0)), zero)
                acc_dv0 = _promote(dv0_tok, 1, acc_dv0, c)
                acc_dk0 = _promote(dk0_tok, 0, acc_dk0, c2)
            if WS:   # every read of slot s is done (wgmmas waited; vectors read)
                _release_slot(rel, s)

        return acc_dv0, acc_dv1, acc_dk0, acc_dk1

    @gluon.jit(do_not_specialize=["T", "HQ", "HKV"])
    def _dkdv_fp8_kernel(
        k_desc, v_desc, q_desc, do_desc, qT_desc, doT_desc, vec_desc,
        sk, sv, dk, dv, hmat, cu, pcu,
        T, stride_dkt, sm_scale, qk_scale2, out_scale,
        HQ, HKV, D: gl.constexpr, BM: gl.constexpr,
        BN: gl.constexpr, NS: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
        WS: gl.constexpr, PRODUCER_REGS: gl.constexpr, THR_MASK: gl.constexpr,
        LATE_DV: gl.constexpr, num_warps: gl.constexpr, KEY_ORDER_DV: gl.constexpr = False,
        KEY_ORDER_DK: gl.constexpr = False,
    ):
        gl.static_assert(not WS or num_warps == 8, "ws: two consumer warpgroups")
        GROUP = HQ // HKV
        NCH: gl.constexpr = D // CH
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, CH, 32])
        ROW: gl.constexpr = gl.SliceLayout(1, L)     # per key (rows of S^T)

        hk, start, L_doc, pstart, n0 = _dkdv_program(cu, pcu, HKV, D, BM, BN, num_warps)
        if n0 >= L_doc:
            return

        # --- shared memory ------------------------------------------------------------------
        k_s = gl.allocate_shared_memory(k_desc.dtype, [BN, D], k_desc.layout)
        v_s = gl.allocate_shared_memory(v_desc.dtype, [BN, D], v_desc.layout)
        q_s = gl.allocate_shared_memory(q_desc.dtype, [NS, BM, D], q_desc.layout)
        do_s = gl.allocate_shared_memory(do_desc.dtype, [NS, BM, D], do_desc.layout)
        qT_s = gl.allocate_shared_memory(qT_desc.dtype, [NS, D, BM], qT_desc.layout)
        doT_s = gl.allocate_shared_memory(doT_desc.dtype, [NS, D, BM], doT_desc.layout)
        vec_s = _vec_ring(vec_desc, NS, BM)     # one ring, rows lse, Delta, sq, sdo
        ready, kv_bar, rel = _init_barriers(NS, WS)

        # --- K_j, V_j (WS: by the producer), the first NS - 1 query tiles --------------------
        if not WS:
            mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [start + n0, hk * D], kv_bar, k_s)
            tma.async_copy_global_to_shared(v_desc, [start + n0, hk * D], kv_bar, v_s)

        lo, nb, total = _dkdv_bounds(n0, L_doc, GROUP, BM, CAUSAL)
        if WS:   # (the arguments twice: a shared tuple would not keep D, BM, .. constexpr)
            accs = gl.warp_specialize([
                (_dkdv_loop, (q_desc, do_desc, qT_desc, doT_desc, vec_desc, k_s, v_s, q_s,
                              do_s, qT_s, doT_s, vec_s, ready, rel, kv_bar, sk, sv, start,
                              pstart, L_doc, n0, hk, lo, nb, total, GROUP, T, qk_scale2, D, BM,
                              BN, NS, CAUSAL, WS, THR_MASK, LATE_DV, num_warps, KEY_ORDER_DV,
                              KEY_ORDER_DK)),
                (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, qT_desc, doT_desc,
                                  vec_desc, k_s, v_s, q_s, do_s, qT_s, doT_s, vec_s, ready, rel,
                                  kv_bar, start, pstart, n0, hk, lo, nb, total, GROUP)),
            ], [1], [PRODUCER_REGS])
        else:
            for pi in gl.static_range(NS - 1):
                _issue_tile(pi, nb, lo, start, pstart, hk, q_desc, do_desc, qT_desc, doT_desc,
                            vec_desc, q_s, do_s, qT_s, doT_s, vec_s, ready, pi < total, GROUP, D,
                            BM, NS)
            accs = _dkdv_loop(q_desc, do_desc, qT_desc, doT_desc, vec_desc, k_s, v_s, q_s, do_s,
                              qT_s, doT_s, vec_s, ready, rel, kv_bar, sk, sv, start, pstart,
                              L_doc, n0, hk, lo, nb, total, GROUP, T, qk_scale2, D, BM, BN, NS,
                              CAUSAL, WS, THR_MASK, LATE_DV, num_warps, KEY_ORDER_DV,
                              KEY_ORDER_DK)
        acc_dv0, acc_dv1, acc_dk0, acc_dk1 = accs
        _invalidate_barriers(ready, kv_bar, rel, NS, WS)

        # --- epilogue ---------------------------------------------------------------------
        n_idx = n0 + gl.arange(0, BN, layout=ROW)
        n_ok = n_idx < L_doc
        _dkdv_epilogue(acc_dv0, acc_dv1, acc_dk0, acc_dk1, dv, dk, hmat, n_idx, n_ok, start, hk,
                       stride_dkt, sm_scale, out_scale, ROTATE, D, BN, NCH, L, num_warps)

    @gluon.jit
    def _issue_kv_at(j0, s, start, pstart, hk, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                     k_s, v_s, kT_s, sk_s, sv_s, ready, pred, D: gl.constexpr):
        """TMA loads of the kv tile at key j0 into ring slot s: k8_j, v8_j (token-major), kT8_j
        (K-major, padded columns) and sk_j, sv_j ((1, BN) boxes of the padded (Hkv, Tp)
        copies)."""
        bar = ready.index(s)
        NBYTES: gl.constexpr = (k_desc.block_type.nbytes + v_desc.block_type.nbytes
                                + kT_desc.block_type.nbytes + 2 * sk_desc.block_type.nbytes)
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [start + j0, hk * D], bar, k_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(v_desc, [start + j0, hk * D], bar, v_s.index(s), pred=pred)
        # pstart % 16 == 0 and j0 % BN == 0: 16-byte aligned innermost coordinates (fp8, fp32)
        tma.async_copy_global_to_shared(kT_desc, [hk * D, pstart + j0], bar, kT_s.index(s),
                                        pred=pred)
        _issue_key_vecs(sk_desc, sv_desc, sk_s, sv_s, hk, pstart + j0, bar, s, pred)

    @gluon.jit
    def _dq_tile_update(s_tok, dp_tok, kTs, s, sk_s, sv_s, n_idx, L_doc, m_idx, shift, need_mask,
                        rowf, lse2, dl_i, acc0, acc1, zero, NCH: gl.constexpr, COL: gl.constexpr,
                        AOP: gl.constexpr):
        """One dQ tile after its S / dP wgmmas were issued: P, t, the masked dS operand with its
        per-query scale, the dS K GEMM and the fp32 promotion into acc."""
        sk_j = _row_vec(sk_s, s, COL)
        sc = _mma_wait(s_tok, 1)
        # the order of backward._dq_tile: s = (q8 k8^T) sk_j, P = exp2(s rowf_i - lse2_i)
        p = gl.exp2(sc * gl.expand_dims(sk_j, 0) * gl.expand_dims(rowf, 1)
                    - gl.expand_dims(lse2, 1))
        sv_j = _row_vec(sv_s, s, COL)
        dp = _mma_wait(dp_tok, 0)
        t = dp * gl.expand_dims(sv_j, 0) - gl.expand_dims(dl_i, 1)
        # sk_j again from shared memory / L1: not kept live across the wgmma waits
        sk_j2 = _row_vec(sk_s, s, COL)
        b = _mask_ds(p * t * gl.expand_dims(sk_j2, 0), n_idx, m_idx, shift, L_doc, need_mask)
        c, inv = _pow2_scale_g(gl.max(gl.abs(b), axis=1), 8)
        b8 = gl.convert_layout((b * gl.expand_dims(inv, 1)).to(gl.float8e4nv), AOP)

        # per-tile fp32 promotion: each fp8 wgmma from zero, scaled and added by the CUDA cores
        if NCH == 2:
            d0_tok = _mma(b8, kTs.slice(0, CH, dim=0).permute((1, 0)), zero)
            d1_tok = _mma(b8, kTs.slice(CH, CH, dim=0).permute((1, 0)), zero)
            acc0, acc1 = _promote_pair(d0_tok, d1_tok, acc0, acc1, c)
        else:
            d0_tok = _mma(b8, kTs.permute((1, 0)), zero)
            acc0 = _promote(d0_tok, 0, acc0, c)
        return acc0, acc1

    @gluon.jit
    def _dq_item(ITEMS, N_ITEMS, HQ, GROUP, W, w, pcu):
        """schedule.work_item of work index w plus the document's padded start."""
        doc, head, hk, start, L, blk = work_item(ITEMS, N_ITEMS, HQ, GROUP, W, w)
        pstart = gl.load(pcu + doc, mask=doc >= 0, other=0)
        return doc, head, hk, start, L, blk, pstart

    @gluon.jit
    def _dq_item_rows(lse, sq, delta, sdo, h, T, start, blk, L_doc, sm_scale, qk_scale2,
                      BM: gl.constexpr, ROW: gl.constexpr):
        """_query_scales of an item and its epilogue factor sdo_i * sm_scale (loaded early)."""
        m_idx, m_ok, lse2, rowf, dl_i = _query_scales(lse, sq, delta, h, T, start, blk * BM,
                                                      L_doc, qk_scale2, BM, ROW)
        f = gl.load(sdo + h * T + start + m_idx, mask=m_ok, other=0.0) * sm_scale
        return m_idx, m_ok, lse2, rowf, dl_i, f

    @gluon.jit
    def _dq_pers_producer(q_desc, do_desc, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                          q_s, do_s, k_s, v_s, kT_s, sk_s, sv_s, ready, rel, q_ready, q_free,
                          ITEMS, N_ITEMS, HQ, GROUP, W, pcu, CAUSAL: gl.constexpr):
        NS: gl.constexpr = k_s.type.shape[0]
        BN: gl.constexpr = k_s.type.shape[1]
        D: gl.constexpr = k_s.type.shape[2]
        QBUF: gl.constexpr = q_s.type.shape[0]
        BM: gl.constexpr = q_s.type.shape[1]
        g = 0       # kv tiles loaded so far (the CTA-wide tile sequence)
        it = 0      # items started so far
        for w in range(gl.program_id(0), W, gl.num_programs(0)):
            doc, h, hk, start, L_doc, blk, pstart = _dq_item(ITEMS, N_ITEMS, HQ, GROUP, W, w,
                                                             pcu)
            if doc >= 0:
                m0 = blk * BM
                _, _, total = _dq_bounds(m0, L_doc, BM, BN, CAUSAL)
                qb = it % QBUF
                mbarrier.wait(q_free.index(qb), ((it // QBUF) + 1) & 1, pred=it >= QBUF)
                mbarrier.expect(q_ready.index(qb),
                                q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [start + m0, h * D], q_ready.index(qb),
                                                q_s.index(qb))
                tma.async_copy_global_to_shared(do_desc, [start + m0, h * D],
                                                q_ready.index(qb), do_s.index(qb))
                for jt in range(total):
                    s = g % NS
                    mbarrier.wait(rel.index(s), ((g // NS) + 1) & 1, pred=g >= NS)
                    _issue_kv_at(jt * BN, s, start, pstart, hk, k_desc, v_desc, kT_desc,
                                 sk_desc, sv_desc, k_s, v_s, kT_s, sk_s, sv_s, ready, True, D)
                    g += 1
                it += 1

    @gluon.jit
    def _dq_pers_consumer(q_s, do_s, k_s, v_s, kT_s, sk_s, sv_s, h_s, ready, rel, q_ready,
                          q_free, ITEMS, N_ITEMS, HQ, GROUP, W, lse, delta, sq, sdo, dq, T,
                          stride_dqt, sm_scale, qk_scale2, out_scale,
                          D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                          NS: gl.constexpr, QBUF: gl.constexpr, CAUSAL: gl.constexpr,
                          ROTATE: gl.constexpr, num_warps: gl.constexpr):
        NCH: gl.constexpr = D // CH
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, CH, 32])
        AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=4)
        ROW: gl.constexpr = gl.SliceLayout(1, L)     # per query (rows of S)
        COL: gl.constexpr = gl.SliceLayout(0, L)     # per key (columns of S)
        zero = gl.zeros([BM, CH], gl.float32, L)
        G = gl.num_programs(0)
        g = 0
        it = 0
        doc, h, hk, start, L_doc, blk = work_item(ITEMS, N_ITEMS, HQ, GROUP, W,
                                                   gl.program_id(0))
        m_idx, m_ok, lse2, rowf, dl_i, f = _dq_item_rows(lse, sq, delta, sdo, h, T, start, blk,
                                                         L_doc, sm_scale, qk_scale2, BM, ROW)
        for w in range(gl.program_id(0), W, G):
            c_doc, c_h, c_hk, c_start, c_L, c_blk = doc, h, hk, start, L_doc, blk
            c_m_idx, c_m_ok, c_lse2, c_rowf, c_dl, c_f = m_idx, m_ok, lse2, rowf, dl_i, f
            doc, h, hk, start, L_doc, blk = work_item(ITEMS, N_ITEMS, HQ, GROUP, W, w + G)
            if c_doc >= 0:
                mask_from, shift, total = _dq_bounds(c_blk * BM, c_L, BM, BN, CAUSAL)
                acc0 = gl.zeros([BM, CH], gl.float32, L)
                acc1 = gl.zeros([BM, CH], gl.float32, L)
                qb = it % QBUF
                qs = q_s.index(qb)
                dos = do_s.index(qb)
                mbarrier.wait(q_ready.index(qb), (it // QBUF) & 1)
                for jt in range(total):
                    s = g % NS
                    kTs = kT_s.index(s)
                    j0, end, need_mask, n_idx = _kv_tile(jt, c_L, mask_from, BN, COL)
                    mbarrier.wait(ready.index(s), (g // NS) & 1)
                    s_tok = _mma(qs, k_s.index(s).permute((1, 0)), zero)
                    dp_tok = _mma(dos, v_s.index(s).permute((1, 0)), zero)
                    if end:   # once per item: kT8 columns past the document end
                        _zero_tail_cols(kTs, j0, c_L, D, BN, num_warps)
                        fence_async_shared()
                        gl.thread_barrier()
                    acc0, acc1 = _dq_tile_update(s_tok, dp_tok, kTs, s, sk_s, sv_s, n_idx, c_L,
                                                 c_m_idx, shift, need_mask, c_rowf, c_lse2, c_dl,
                                                 acc0, acc1, zero, NCH, COL, AOP)
                    _release_slot(rel, s)   # (its barrier: every S / dP of the item waited too)
                    g += 1
                # q8_i / do8_i are read: the buffer may take item it + QBUF
                mbarrier.arrive(q_free.index(qb), count=1)
                m_idx, m_ok, lse2, rowf, dl_i, f = _dq_item_rows(lse, sq, delta, sdo, h, T,
                                                                 start, blk, L_doc, sm_scale,
                                                                 qk_scale2, BM, ROW)
                # --- epilogue: * sdo_i * sm_scale (sdo_i moved out of the row scales), rotate
                # back, cast ---
                acc0 = acc0 * gl.expand_dims(c_f, 1)
                acc1 = acc1 * gl.expand_dims(c_f, 1)
                row_off = (c_start + c_m_idx) * stride_dqt + c_h * D
                if ROTATE:
                    _rotate_store_h(acc0, acc1, h_s, dq, c_m_ok, row_off, out_scale, BM, NCH,
                                    L, num_warps)
                else:
                    _store_pair(acc0, acc1, dq, c_m_ok, row_off, NCH, L)
                it += 1
            else:
                m_idx, m_ok, lse2, rowf, dl_i, f = _dq_item_rows(lse, sq, delta, sdo, h, T,
                                                                 start, blk, L_doc, sm_scale,
                                                                 qk_scale2, BM, ROW)

    @gluon.jit(do_not_specialize=["T", "HQ", "HKV", "N_ITEMS"])
    def _dq_fp8_persistent_kernel(
        q_desc, do_desc, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
        lse, delta, sq, sdo, dq, hmat, ITEMS, pcu,
        T, stride_dqt, sm_scale, qk_scale2, out_scale, N_ITEMS,
        HQ, HKV, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
        QBUF: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        gl.static_assert(num_warps == 4, "one consumer warpgroup")
        gl.static_assert(BN == CH, "S / dP tiles share the chunk layout of the dQ results")
        gl.static_assert(D % CH == 0 and D <= 2 * CH, "D must be 64 or 128")
        gl.static_assert(BM == 16 * num_warps, "one m64 wgmma row block per warpgroup")
        W = N_ITEMS * HQ
        GROUP = HQ // HKV
        q_s = gl.allocate_shared_memory(q_desc.dtype, [QBUF, BM, D], q_desc.layout)
        do_s = gl.allocate_shared_memory(do_desc.dtype, [QBUF, BM, D], do_desc.layout)
        k_s = gl.allocate_shared_memory(k_desc.dtype, [NS, BN, D], k_desc.layout)
        v_s = gl.allocate_shared_memory(v_desc.dtype, [NS, BN, D], v_desc.layout)
        kT_s = gl.allocate_shared_memory(kT_desc.dtype, [NS, D, BN], kT_desc.layout)
        sk_s = _vec_ring(sk_desc, NS, BN)
        sv_s = _vec_ring(sv_desc, NS, BN)
        if ROTATE:   # H_64 once per CTA
            h_s = _hadamard_tile(hmat, D, num_warps)
        else:
            h_s = k_s    # placeholder, never read
        ready, once, rel = _init_barriers(NS, True)
        q_ready = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(QBUF):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_free.index(i), count=1)
        fence_async_shared()
        gl.thread_barrier()
        gl.warp_specialize([
            (_dq_pers_consumer, (q_s, do_s, k_s, v_s, kT_s, sk_s, sv_s, h_s, ready, rel,
                                 q_ready, q_free, ITEMS, N_ITEMS, HQ, GROUP, W, lse, delta,
                                 sq, sdo, dq, T, stride_dqt, sm_scale, qk_scale2,
                                 out_scale, D, BM, BN, NS, QBUF, CAUSAL, ROTATE, num_warps)),
            (_dq_pers_producer, (q_desc, do_desc, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                                 q_s, do_s, k_s, v_s, kT_s, sk_s, sv_s, ready, rel, q_ready,
                                 q_free, ITEMS, N_ITEMS, HQ, GROUP, W, pcu, CAUSAL)),
        ], [1], [PRODUCER_REGS])
        for i in gl.static_range(QBUF):
            mbarrier.invalidate(q_ready.index(i))
            mbarrier.invalidate(q_free.index(i))
        _invalidate_barriers(ready, once, rel, NS, True)

    @gluon.jit
    def _mma_acc(a, b, acc):
        """acc + a @ b in place, async (the bf16 GEMMs, and the second K-half of a D = 128
        GEMM)."""
        return warpgroup_mma(a, b, acc, is_async=True)

    @gluon.jit
    def _wait_pair(x0, x1, N: gl.constexpr, NCH: gl.constexpr):
        """Wait until at most N wgmma groups are pending; the (one or two) chunk accumulators
        as tensors (x1 passes through untouched when NCH == 1)."""
        if NCH == 2:
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
    def _e4m3_to_bf16_rows(src, dst, row0, L, ROWS: gl.constexpr, num_warps: gl.constexpr):
        """dst (ROWS, 64) bf16 <- the e4m3 values of src (ROWS, 64) (exact), converted unmasked;
        on a tile that reaches past the document end its rows row0 + r >= L are zeroed after
        (the next document's bytes: 0 * NaN would reach the GEMM). A mask on the conversion
        would cost every tile ~66 SASS."""
        BLQ: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        dst.store(src.load(BLQ).to(gl.float32).to(gl.bfloat16))
        if row0 + ROWS > L:   # (rows written above by other threads: ordered first)
            gl.thread_barrier()
            _zero_tail_rows(dst, row0, L, ROWS, num_warps)

    @gluon.jit
    def _zero_tail_rows(x_s, row0, L, ROWS: gl.constexpr, num_warps: gl.constexpr):
        """Zero the rows (tokens) row0 + r >= L of a token-major (ROWS, 64) bf16 tile."""
        BLR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        x = x_s.load(BLR)
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, BLR))
        x = gl.where(gl.expand_dims(rows < L, 1), x, gl.zeros_like(x))
        x_s.store(x)

    @gluon.jit
    def _issue_q_tile(it, nb, lo, start, pstart, hk,
                      q_desc, dob_desc, doT_desc, lse_desc, dl_desc, sq_desc, sdo_desc,
                      q_s, dob_s, doT_s, lse_s, dl_s, sq_s, sdo_s, ready, pred,
                      GROUP, D: gl.constexpr, BM: gl.constexpr, NS: gl.constexpr,
                      NCH: gl.constexpr):
        """TMA loads of query tile `it` (head g = it // nb, block i0) into ring slot it % NS."""
        i0, h = _q_tile_rows(it, nb, lo, hk, GROUP, BM)
        _issue_q_tile_at(i0, h, it % NS, start, pstart, q_desc, dob_desc, doT_desc, lse_desc,
                         dl_desc, sq_desc, sdo_desc, q_s, dob_s, doT_s, lse_s, dl_s, sq_s, sdo_s,
                         ready, pred, D, NCH)

    @gluon.jit
    def _issue_q_tile_at(i0, h, s, start, pstart,
                         q_desc, dob_desc, doT_desc, lse_desc, dl_desc, sq_desc, sdo_desc,
                         q_s, dob_s, doT_s, lse_s, dl_s, sq_s, sdo_s, ready, pred,
                         D: gl.constexpr, NCH: gl.constexpr):
        """TMA loads of the query tile (head h, first row i0) into ring slot s:
        q8_i (fp8, token-major), dO_i (bf16, NCH (BM, 64) chunks), doT8_i (fp8 K-major, padded
        columns) and lse / Delta / sq / sdo ((1, BM) boxes, padded columns)."""
        bar = ready.index(s)
        NBYTES: gl.constexpr = (q_desc.block_type.nbytes + NCH * dob_desc.block_type.nbytes
                                + doT_desc.block_type.nbytes + 4 * lse_desc.block_type.nbytes)
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [start + i0, h * D], bar, q_s.index(s), pred=pred)
        for cc in gl.static_range(NCH):
            # bf16 column h * D + 64 c: 128-byte aligned
            tma.async_copy_global_to_shared(dob_desc, [start + i0, h * D + cc * CH], bar,
                                            dob_s.index(s * NCH + cc), pred=pred)
        tma.async_copy_global_to_shared(doT_desc, [h * D, pstart + i0], bar, doT_s.index(s),
                                        pred=pred)
        _issue_query_vecs(lse_desc, dl_desc, sq_desc, sdo_desc, lse_s, dl_s, sq_s, sdo_s, h,
                          pstart + i0, bar, s, pred)

    @gluon.jit(do_not_specialize=["T", "HQ", "HKV"])
    def _dkdv_mixed_kernel(
        k_desc, vb_desc, q_desc, dob_desc, doT_desc,
        lse_desc, dl_desc, sq_desc, sdo_desc,
        sk, sv, dk, dv, hmat, cu, pcu,
        T, stride_dkt, sm_scale, qk_scale2, out_scale,
        HQ, HKV, D: gl.constexpr, BM: gl.constexpr,
        BN: gl.constexpr, NS: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
        num_warps: gl.constexpr, LAZY: gl.constexpr = False,
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
        lse_s = _vec_ring(lse_desc, NS, BM)
        dl_s = _vec_ring(dl_desc, NS, BM)
        sq_s = _vec_ring(sq_desc, NS, BM)
        sdo_s = _vec_ring(sdo_desc, NS, BM)
        ready, kv_bar, _ = _init_barriers(NS, False)

        # --- K_j (fp8, for S^T) and bf16 V_j (A of dP^T), once ---------------------------
        _load_once(k_desc, vb_desc, kv_bar, k_s, vb_s, start, n0, hk, D, NCH)

        lo, nb, total = _dkdv_bounds(n0, L_doc, GROUP, BM, CAUSAL)
        for pi in gl.static_range(NS - 1):
            _issue_q_tile(pi, nb, lo, start, pstart, hk, q_desc, dob_desc, doT_desc,
                          lse_desc, dl_desc, sq_desc, sdo_desc, q_s, dob_s, doT_s,
                          lse_s, dl_s, sq_s, sdo_s, ready, pi < total, GROUP, D, BM, NS, NCH)

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
                             NCH)
            g_nxt, blk_nxt = _next_tile(g_nxt, blk_nxt, nb)
            mbarrier.wait(ready.index(s), (it // NS) & 1)
            qs = q_s.index(s)
            doTs = doT_s.index(s)

            s_tok = _mma(k_s, qs.permute((1, 0)), zero)                       # fp8
            dp_tok = _mma(vb_s.index(0), dob_s.index(s * NCH).permute((1, 0)), zero_b)
            if NCH == 2:   # second half of the reduction over D, chained in place
                dp_tok = _mma_acc(vb_s.index(1), dob_s.index(s * NCH + 1).permute((1, 0)),
                                  dp_tok)

            # bf16 copy of q8_i for the dK GEMM, while S^T / dP^T run (the previous tile's dK
            # wgmmas were waited for)
            for cc in gl.static_range(NCH):
                _e4m3_to_bf16_rows(qs.slice(cc * CH, CH, dim=1), qb_s.index(cc), i0, L_doc, BM,
                                   num_warps)
            if tail:   # at most once per head: doT8 columns past the document end
                _zero_tail_cols(doTs, i0, L_doc, D, BM, num_warps)
            fence_async_shared()
            gl.thread_barrier()

            # (S^T waited for past the dP^T wgmmas: NCH of them)
            p, a, c, a8 = _dv_operand(s_tok, s, rowf, n_idx, cols, L_doc, shift, need_mask,
                                      lse_s, sq_s, sdo_s, NCH, BM, COL, AOP8, False, False,
                                      False, LAZY)
            dl_i = _row_vec(dl_s, s, COL)
            dp = gl.convert_layout(_mma_wait(dp_tok, 0), L)
            sq_i2 = _row_vec(sq_s, s, COL)
            # _dkdv_tile: ds_t = p_t (dP^T sv_j - Delta_i); dK operand bf16(ds_t sq_i)
            b = _mask_ds_t(p * (dp * gl.expand_dims(sv_j, 1) - gl.expand_dims(dl_i, 0))
                           * gl.expand_dims(sq_i2, 0), n_idx, cols, shift, L_doc, need_mask,
                           COL, LAZY)
            b16 = gl.convert_layout(b.to(gl.bfloat16), AOPB)
            dv0_tok = _mma(a8, doTs.slice(0, CH, dim=0).permute((1, 0)), zero)

            if NCH == 2:
                dv1_tok = _mma(a8, doTs.slice(CH, CH, dim=0).permute((1, 0)), zero)
                dk0_tok = _mma_acc(b16, qb_s.index(0), acc_dk0)
                dk1_tok = _mma_acc(b16, qb_s.index(1), acc_dk1)
                acc_dv0 = _promote(dv0_tok, 3, acc_dv0, c)
                acc_dv1 = _promote(dv1_tok, 2, acc_dv1, c)
                acc_dk0, acc_dk1 = _wait_pair(dk0_tok, dk1_tok, 0, NCH)
            else:
                dk0_tok = _mma_acc(b16, qb_s.index(0), acc_dk0)
                acc_dv0 = _promote(dv0_tok, 1, acc_dv0, c)
                acc_dk0, acc_dk1 = _wait_pair(dk0_tok, acc_dk1, 0, NCH)

        _invalidate_barriers(ready, kv_bar, ready, NS, False)
        _dkdv_epilogue(acc_dv0, acc_dv1, acc_dk0, acc_dk1, dv, dk, hmat, n_idx, n_ok, start, hk,
                       stride_dkt, sm_scale, out_scale, ROTATE, D, BN, NCH, L, num_warps)

    @gluon.jit
    def _issue_kv_tile(jt, start, pstart, hk, k_desc, kb_desc, vb_desc, sk_desc, sv_desc,
                       k_s, kb_s, vb_s, sk_s, sv_s, ready, pred,
                       D: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, NCH: gl.constexpr):
        """TMA loads of kv tile `jt` into slot jt % NS: k8_j (fp8, for S), bf16 K_j and V_j in
        (BN, 64) chunks, and sk_j / sv_j ((1, BN) boxes, padded columns)."""
        j0 = jt * BN
        s = jt % NS
        bar = ready.index(s)
        NBYTES: gl.constexpr = (k_desc.block_type.nbytes + NCH * kb_desc.block_type.nbytes
                                + NCH * vb_desc.block_type.nbytes
                                + 2 * sk_desc.block_type.nbytes)
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [start + j0, hk * D], bar, k_s.index(s), pred=pred)
        for cc in gl.static_range(NCH):
            tma.async_copy_global_to_shared(kb_desc, [start + j0, hk * D + cc * CH], bar,
                                            kb_s.index(s * NCH + cc), pred=pred)
            tma.async_copy_global_to_shared(vb_desc, [start + j0, hk * D + cc * CH], bar,
                                            vb_s.index(s * NCH + cc), pred=pred)
        _issue_key_vecs(sk_desc, sv_desc, sk_s, sv_s, hk, pstart + j0, bar, s, pred)

    @gluon.jit(do_not_specialize=["T", "HQ", "HKV"])
    def _dq_mixed_kernel(
        q_desc, dob_desc, k_desc, kb_desc, vb_desc, sk_desc, sv_desc,
        lse, delta, sq, dq, hmat, cu, pcu,
        T, stride_dqt, sm_scale, qk_scale2, out_scale,
        HQ, HKV, D: gl.constexpr, BM: gl.constexpr,
        BN: gl.constexpr, NS: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        gl.static_assert(NS >= 2, "a ring of 2+ stages (the prefetch of tile jt + NS - 1)")
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
        sk_s = _vec_ring(sk_desc, NS, BN)
        sv_s = _vec_ring(sv_desc, NS, BN)
        ready, q_bar, _ = _init_barriers(NS, False)

        # --- q8_i (fp8, A of S) and bf16 dO_i (A of dP), once --------------------------------
        _load_once(q_desc, dob_desc, q_bar, q_s, dob_s, start, m0, h, D, NCH)

        mask_from, shift, total = _dq_bounds(m0, L_doc, BM, BN, CAUSAL)
        for pi in gl.static_range(NS - 1):
            _issue_kv_tile(pi, start, pstart, hk, k_desc, kb_desc, vb_desc, sk_desc, sv_desc,
                           k_s, kb_s, vb_s, sk_s, sv_s, ready, pi < total, D, BN, NS, NCH)

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
            mbarrier.wait(ready.index(s), (jt // NS) & 1)
            ks = k_s.index(s)

            s_tok = _mma(q_s, ks.permute((1, 0)), zero)                         # fp8
            dp_tok = _mma(dob_s.index(0), vb_s.index(s * NCH).permute((1, 0)), zero_b)
            if NCH == 2:
                dp_tok = _mma_acc(dob_s.index(1), vb_s.index(s * NCH + 1).permute((1, 0)),
                                  dp_tok)

            if end:   # once per program: bf16 K rows past the document end (0 * NaN is NaN)
                for cc in gl.static_range(NCH):
                    _zero_tail_rows(kb_s.index(s * NCH + cc), j0, L_doc, BN, num_warps)
                fence_async_shared()
                gl.thread_barrier()

            sk_j = _row_vec(sk_s, s, COL)
            # waits for S and (issued before it) tile jt - 1's dQ wgmmas
            sc = _mma_wait(s_tok, NCH)
            # slot (jt - 1) % NS is free now (S, dP, dQ of tile jt - 1 done; every warp past
            # its vector reads): prefetch tile jt + NS - 1 into it
            gl.thread_barrier()
            nxt = jt + NS - 1
            _issue_kv_tile(nxt, start, pstart, hk, k_desc, kb_desc, vb_desc, sk_desc, sv_desc,
                           k_s, kb_s, vb_s, sk_s, sv_s, ready, nxt < total, D, BN, NS, NCH)
            p = gl.exp2(sc * gl.expand_dims(sk_j, 0) * gl.expand_dims(rowf, 1)
                        - gl.expand_dims(lse2, 1))
            sv_j = _row_vec(sv_s, s, COL)
            dp = gl.convert_layout(_mma_wait(dp_tok, 0), L)
            sk_j2 = _row_vec(sk_s, s, COL)
            # _dq_tile: ds = p (dP sv_j - Delta_i); dQ operand bf16(ds sk_j)
            b = _mask_ds(p * (dp * gl.expand_dims(sv_j, 0) - gl.expand_dims(dl_i, 1))
                         * gl.expand_dims(sk_j2, 0), n_idx, m_idx, shift, L_doc, need_mask)
            b16 = gl.convert_layout(b.to(gl.bfloat16), AOPB)

            q0_tok = _mma_acc(b16, kb_s.index(s * NCH), acc0)
            if NCH == 2:
                q1_tok = _mma_acc(b16, kb_s.index(s * NCH + 1), acc1)
            else:
                q1_tok = acc1
            acc0, acc1 = _wait_pair(q0_tok, q1_tok, 0, NCH)

        acc0, acc1 = _wait_pair(acc0, acc1, 0, NCH)
        _invalidate_barriers(ready, q_bar, ready, NS, False)

        # --- epilogue: * sm_scale, rotate back, cast -------------------------------------------
        acc0 = gl.convert_layout(acc0, L) * sm_scale
        acc1 = gl.convert_layout(acc1, L) * sm_scale
        row_off = (start + m_idx) * stride_dqt + h * D
        _store_out(acc0, acc1, hmat, dq, m_ok, row_off, out_scale, ROTATE, D, BM, NCH, L, num_warps)


# ----------------------------------------------------------------------------------------------
# Host side: per-row vectors in the padded layout, descriptors, launch arguments
# ----------------------------------------------------------------------------------------------

def vector_gathers(st):
    """The kmajor.kmajor_copies_and_rows gathers (a, b) of the fp8 kernels' per-token vectors,
    in the padded column layout of the K-major copies: the dK/dV kernel's query vectors (lse,
    Delta, sq, sdo interleaved per head in one (Hq * 4, Tp) buffer, lse folded with sdo: lse *
    log2(e) - log2(sdo), so exp2 of S^T minus it gives P^T sdo at once; pads +inf) and the dQ
    kernel's key vectors (sk, sv). launch_preprocess keeps the results on the state
    (st.query_vecs, st.kv_vecs)."""
    return (dict(srcs=(st.lse, st.delta, st.sq, st.sdo), fill0_inf=True, interleave=True,
                 fold0=True),
            dict(srcs=(st.sk, st.sv)))


def padded_vectors(st):
    """lse, Delta, sq, sdo as (Hq, Tp) fp32 in the padded per-document layout of the K-major
    copies (column c holds token st.tok_of_col[c]; pad columns: lse +inf, the others 0): the
    fp8_mixed dK/dV kernel's (1, BM) boxes start at column pstart + i0, a multiple of 16, and
    the row stride Tp * 4 bytes is a multiple of 16 too (4 gathers of Hq x Tp floats)."""
    toc = st.tok_of_col.long()
    pad = toc < 0
    idx = toc.clamp(min=0)
    out = []
    for x, fill in ((st.lse, float("inf")), (st.delta, 0.0), (st.sq, 0.0), (st.sdo, 0.0)):
        y = x.float().index_select(1, idx)
        y.masked_fill_(pad, fill)
        out.append(y)
    return tuple(out)


def padded_kv_vectors(st):
    """sk, sv as (Hkv, Tp) fp32 in the padded per-document column layout (pads 0), for the
    fp8_mixed dQ kernel's (1, BN) boxes at the 16-aligned column pcu[doc] + j0."""
    toc = st.tok_of_col.long()
    pad = toc < 0
    idx = toc.clamp(min=0)
    out = []
    for x in (st.sk, st.sv):
        y = x.float().index_select(1, idx)
        y.masked_fill_(pad, 0.0)
        out.append(y)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int, dtype):
    """The shared layout of a (rows, cols) TMA box, memoized: building it is pure Python with
    validation (~10 us each, 16 descriptors per backward call; a short-document call's host
    time is about its GPU time). fp32 boxes (the padded vectors) unswizzled, so each row reads
    as a plain 1-D buffer."""
    if dtype == gl.float32:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


def tok_major_desc(x, rows: int, cols: int, dtype):
    """TMA descriptor over (T, heads, D) seen as (T, heads * D), (rows, cols) boxes."""
    x2 = x.view(x.shape[0], -1)
    return GluonTensorDescriptor(x2, list(x2.shape), list(x2.stride()), [rows, cols],
                                 _smem_layout(rows, cols, dtype))


def kmajor_desc(xT, cols: int):
    """TMA descriptor over a K-major fp8 copy (heads, D, Tp) seen as (heads * D, Tp), (D, cols)
    boxes."""
    H, D, Tp = xT.shape
    return GluonTensorDescriptor(xT, [H * D, Tp], [Tp, 1], [D, cols],
                                 _smem_layout(D, cols, gl.float8e4nv))


def vec_desc(x, cols: int, rows: int = 1):
    """TMA descriptor over padded per-token fp32 vectors (H, Tp), (rows, cols) boxes."""
    return GluonTensorDescriptor(x, list(x.shape), list(x.stride()), [rows, cols],
                                 _smem_layout(rows, cols, gl.float32))


def _check_state(st, recipe: int, what: str) -> None:
    """What every Gluon backward kernel needs of `st`; `what` names the kernel in messages."""
    if not HAVE_GLUON:
        raise RuntimeError("triton.experimental.gluon is not available")
    if st.recipe != recipe:
        raise ValueError(f"the Gluon {what} kernel needs st.recipe == {recipe}, not {st.recipe}")
    if st.D not in (64, 128):
        raise ValueError(f"the Gluon {what} kernel supports D in (64, 128), not {st.D}")


def _check_blocks(cfg, cta_rows: int, step_rows: int, num_warps: int, what: str) -> None:
    """The block sizes every kernel assumes: a CTA's rows (dK/dV: bn keys, dQ: bm queries) one
    m64 wgmma row block per warpgroup, 64 rows per loop step (the chunk layout), a ring."""
    if step_rows != CH_ or cta_rows != 16 * num_warps or cfg.stages < 1:
        raise ValueError(f"unsupported Gluon {what} config {cfg}")


def _launch_args(st, cfg, descs, tensors, dq: bool, **kwargs):
    """grid, args, kwargs of a kernel launch. One program per (document, kv head, bn keys) for
    dK/dV, (document, query head, bm queries) for dQ; args: the descriptors, the tensors, then
    the scalars every kernel takes; kwargs: the common ones and `kwargs`."""
    out = st.dq if dq else st.dk
    if dq:
        grid = (st.n_docs * st.Hq, triton.cdiv(st.max_seqlen, cfg.bm))
    else:
        grid = (st.n_docs * st.Hkv, triton.cdiv(st.max_seqlen, cfg.bn))
    args = (*descs, *tensors, st.hmat, st.cu, st.pcu, st.T, out.stride(0), st.sm_scale,
            st.sm_scale * LOG2E, st.D ** -0.5)
    kwargs = dict(HQ=st.Hq, HKV=st.Hkv, D=st.D, BM=cfg.bm, BN=cfg.bn, NS=cfg.stages,
                  CAUSAL=st.causal, ROTATE=st.rotate, **kwargs)
    return grid, args, kwargs


def _no_tokens(st, *outs) -> bool:
    """True (and `outs` zeroed) when there is nothing to launch for: no tokens / documents."""
    if st.T == 0 or st.n_docs == 0 or st.max_seqlen == 0:
        for x in outs:
            x.zero_()
        return True
    return False


def _config(st, attr: str, kind):
    cfg = getattr(st.cfg, attr)
    if not isinstance(cfg, kind):
        raise ValueError(f"st.cfg.{attr} is {cfg!r}: this launcher runs {kind.__name__}")
    return cfg


# --- fp8 ------------------------------------------------------------------------------------------

def _dkdv_args(st):
    cfg = _config(st, "dkdv", GluonDkdvConfig)
    _check_state(st, RECIPE_FP8, "fp8 dK/dV")
    _check_blocks(cfg, cfg.bn, cfg.bm, cfg.num_warps, "fp8 dK/dV")
    if cfg.ws and ((cfg.bn, cfg.num_warps) != (128, 8) or not 24 <= cfg.producer_regs <= 256):
        raise ValueError(f"ws needs bn=128, num_warps=8 (two consumer warpgroups) and "
                         f"producer_regs in [24, 256]: {cfg}")
    if st.query_vecs is None:
        raise ValueError("the fp8 dK/dV kernel reads the packed query vectors that "
                         "backward.launch_preprocess gathers (st.query_vecs)")
    for x in (st.q8, st.k8, st.v8, st.do8, st.qT8, st.doT8, st.lse, st.delta, st.sq, st.sdo,
              st.sk, st.sv, st.dk, st.dv):
        assert x.is_contiguous()
    D, BM, BN = st.D, cfg.bm, cfg.bn
    f8 = gl.float8e4nv
    descs = (tok_major_desc(st.k8, BN, D, f8), tok_major_desc(st.v8, BN, D, f8),
             tok_major_desc(st.q8, BM, D, f8), tok_major_desc(st.do8, BM, D, f8),
             kmajor_desc(st.qT8, BM), kmajor_desc(st.doT8, BM),
             vec_desc(st.query_vecs, BM, rows=4))   # (4, BM) boxes: lse, Delta, sq, sdo
    tensors = (st.sk, st.sv, st.dk, st.dv)
    return _launch_args(st, cfg, descs, tensors, False, WS=cfg.ws,
                        PRODUCER_REGS=cfg.producer_regs, THR_MASK=cfg.threshold_mask,
                        LATE_DV=cfg.late_dv, KEY_ORDER_DV=cfg.key_order_dv,
                        KEY_ORDER_DK=cfg.key_order_dk, num_warps=cfg.num_warps)


def launch_dkdv_gluon(st) -> None:
    """dK, dV of the fp8 recipe into st.dk / st.dv (backward.launch_dkdv's contract), with the
    kernel of st.cfg.dkdv (a GluonDkdvConfig). `st` from backward.make_state +
    backward.launch_preprocess (which wrote qT8 / doT8 in that config's column orders and the
    packed query vectors), on an sm_90a GPU."""
    if _no_tokens(st, st.dk, st.dv):
        return
    grid, args, kwargs = _dkdv_args(st)
    _dkdv_fp8_kernel[grid](*args, **kwargs)


def _dq_args(st):
    """grid, args, kwargs of _dq_fp8_persistent_kernel: the work list (memoized per cu_seqlens,
    like the forward's) in cu's place, ctas_per_sm CTAs per SM."""
    cfg = _config(st, "dq", GluonDqConfig)
    _check_state(st, RECIPE_FP8, "fp8 dQ")
    _check_blocks(cfg, cfg.bm, cfg.bn, 4, "fp8 dQ")
    if cfg.q_buffers not in (1, 2) or not 24 <= cfg.producer_regs <= 256:
        raise ValueError(f"persistent dQ needs q_buffers 1 or 2 and producer_regs in [24, 256]: "
                         f"{cfg}")
    if st.kv_vecs is None:
        raise ValueError("the fp8 dQ kernel reads the padded key vectors that "
                         "backward.launch_preprocess gathers (st.kv_vecs)")
    for x in (st.q8, st.k8, st.v8, st.do8, st.kT8, st.lse, st.delta, st.sq, st.sdo, st.sk,
              st.sv, st.dq):
        assert x.is_contiguous()
    D, BM, BN = st.D, cfg.bm, cfg.bn
    f8 = gl.float8e4nv
    descs = (tok_major_desc(st.q8, BM, D, f8), tok_major_desc(st.do8, BM, D, f8),
             tok_major_desc(st.k8, BN, D, f8), tok_major_desc(st.v8, BN, D, f8),
             kmajor_desc(st.kT8, BN), *(vec_desc(x, BN) for x in st.kv_vecs))
    tensors = (st.lse, st.delta, st.sq, st.sdo, st.dq)
    _, args, kwargs = _launch_args(st, cfg, descs, tensors, True,
                                   PRODUCER_REGS=cfg.producer_regs, num_warps=4)
    sched = work_list(st.cu, st.T, cfg.bm, cfg.bn, st.causal)
    n_items = sched.items.shape[1]
    grid = persistent_grid(n_items * st.Hq, cfg.ctas_per_sm, st.dq.device)
    # (descriptors, tensors, hmat, cu, pcu, scalars): the work list in cu's place, its length last
    i_cu = next(i for i, a in enumerate(args) if a is st.cu)
    args = (*args[:i_cu], sched.items, *args[i_cu + 1:], n_items)
    kwargs.update(QBUF=cfg.q_buffers, maxnreg=cfg.maxnreg)
    return grid, args, kwargs


def launch_dq_gluon(st) -> None:
    """dQ of the fp8 recipe into st.dq (backward.launch_dq's contract: * sdo_i * sm_scale,
    Hadamard rotate-back when st.rotate, cast to st.dq's dtype), with st.cfg.dq (a
    GluonDqConfig). `st` from backward.make_state + backward.launch_preprocess (kT8 and the
    padded key vectors), on an sm_90a GPU."""
    if _no_tokens(st, st.dq):
        return
    grid, args, kwargs = _dq_args(st)
    _dq_fp8_persistent_kernel[grid](*args, **kwargs)


# --- fp8_mixed ------------------------------------------------------------------------------------

def mixed_operands(st):
    """(dO bf16 (T, Hq, D), V bf16 (T, Hkv, D), K bf16 (T, Hkv, D)): the bf16 GEMMs' token-major
    operands, built once per state (st.mixed_ops; the dK/dV and the dQ launch share them). V / K:
    e4m3 values, exact in bf16 (one pass over v8 / k8). dO: the caller's, rounded to bf16 as
    backward._bf16_op does when it is fp16 / fp32."""
    if st.mixed_ops is None:
        bf = torch.bfloat16
        dob = st.dout if st.dout.dtype == bf else st.dout.to(bf)
        st.mixed_ops = (dob.contiguous(), st.v8.to(bf).contiguous(), st.k8.to(bf).contiguous())
    return st.mixed_ops


def _mixed_dkdv_args(st):
    cfg = _config(st, "dkdv", MixedDkdvConfig)
    _check_state(st, RECIPE_MIXED, "fp8_mixed dK/dV")
    _check_blocks(cfg, cfg.bn, cfg.bm, cfg.num_warps, "fp8_mixed dK/dV")
    D, BM, BN = st.D, cfg.bm, cfg.bn
    dob, vb, _ = mixed_operands(st)
    for x in (st.q8, st.k8, st.doT8, st.lse, st.delta, st.sq, st.sdo, st.sk, st.sv, st.dk,
              st.dv, dob, vb):
        assert x.is_contiguous()
    f8, bf = gl.float8e4nv, gl.bfloat16
    descs = (tok_major_desc(st.k8, BN, D, f8), tok_major_desc(vb, BN, CH_, bf),
             tok_major_desc(st.q8, BM, D, f8), tok_major_desc(dob, BM, CH_, bf),
             kmajor_desc(st.doT8, BM), *(vec_desc(x, BM) for x in padded_vectors(st)))
    tensors = (st.sk, st.sv, st.dk, st.dv)
    return _launch_args(st, cfg, descs, tensors, False, LAZY=cfg.lazy_cols,
                        num_warps=cfg.num_warps)


def launch_dkdv_gluon_mixed(st) -> None:
    """dK, dV of fp8_mixed into st.dk / st.dv (backward.launch_dkdv's contract), with
    st.cfg.dkdv (a MixedDkdvConfig)."""
    if _no_tokens(st, st.dk, st.dv):
        return
    grid, args, kwargs = _mixed_dkdv_args(st)
    _dkdv_mixed_kernel[grid](*args, **kwargs)


def _mixed_dq_args(st):
    cfg = _config(st, "dq", MixedDqConfig)
    _check_state(st, RECIPE_MIXED, "fp8_mixed dQ")
    _check_blocks(cfg, cfg.bm, cfg.bn, cfg.num_warps, "fp8_mixed dQ")
    if cfg.stages < 2:
        raise ValueError(f"the fp8_mixed dQ kernel prefetches: stages >= 2, not {cfg}")
    D, BM, BN = st.D, cfg.bm, cfg.bn
    dob, vb, kb = mixed_operands(st)
    for x in (st.q8, st.k8, st.lse, st.delta, st.sq, st.sk, st.sv, st.dq, dob, vb, kb):
        assert x.is_contiguous()
    f8, bf = gl.float8e4nv, gl.bfloat16
    descs = (tok_major_desc(st.q8, BM, D, f8), tok_major_desc(dob, BM, CH_, bf),
             tok_major_desc(st.k8, BN, D, f8), tok_major_desc(kb, BN, CH_, bf),
             tok_major_desc(vb, BN, CH_, bf), *(vec_desc(x, BN) for x in padded_kv_vectors(st)))
    tensors = (st.lse, st.delta, st.sq, st.dq)    # (no sdo: dO was never scaled)
    return _launch_args(st, cfg, descs, tensors, True, num_warps=cfg.num_warps)


def launch_dq_gluon_mixed(st) -> None:
    """dQ of fp8_mixed into st.dq (backward.launch_dq's contract), with st.cfg.dq (a
    MixedDqConfig)."""
    if _no_tokens(st, st.dq):
        return
    grid, args, kwargs = _mixed_dq_args(st)
    _dq_mixed_kernel[grid](*args, **kwargs)
