"""Gluon (Hopper sm_90a) dK/dV and dQ kernels for the `fp8` recipe.

Same function as `backward._bwd_dkdv` with RECIPE == 0, fused dK and dV, no DQ_ATOMIC: it
consumes the `BwdState` of `backward.make_state` + `backward.launch_preprocess` and writes
st.dk / st.dv like `backward.launch_dkdv` (dK * sm_scale, Hadamard rotate-back when st.rotate,
cast to the gradient dtype). Per tile the numerics are `_dkdv_tile`'s for RECIPE == 0:

    S^T  = (k8_j q8_i^T) * rowf_j * sq_i            rowf_j = sk_j * sm_scale * log2(e)
    P^T  = exp2(S^T - lse2_i)                       masked (exact 0) on diagonal / tail tiles
    a    = P^T sdo_i
    dV_j += c_j  * (e4m3(a / c_j) @ do8_i)           c_j  = _pow2_scale(max_i |a|)  over the tile
    t    = (v8_j do8_i^T) * sv_j - Delta_i           (Delta in units of sdo_i)
    b    = a * t * sq_i
    dK_j += c2_j * (e4m3(b / c2_j) @ q8_i)           c2_j = _pow2_scale(max_i |b|)

with the per-tile fp32 promotion kept: every fp8 wgmma of the dV / dK GEMMs starts from a zero
accumulator (use_acc=False) and its result is scaled and added to fp32 registers by the CUDA
cores (Hopper's fp8 accumulator keeps fewer bits than fp32; chaining it across tiles cost 1.5e-2,
benchmarks/NOTES.md). The query block of a tile is BM = 64 rows (the Triton kernel uses 32), so
the per-tile scales are over other subsets: results match by the FlashAttention rule, not bitwise.

Structure (one warpgroup = 4 warps per CTA, BN = 64 keys, aimed at 2 CTAs per SM so the two
CTAs' element-wise phases and tensor-core phases interleave):
  - K_j, V_j (BN x D, token-major) land in shared memory once, by TMA.
  - Per query block (flattened loop over the GROUP query heads of the kv head and the query
    blocks i >= the kv block for causal), an NS-stage TMA + mbarrier ring brings q8_i, do8_i
    (token-major, B operands of S^T / dP^T, K-major as fp8 wgmma needs), qT8_i, doT8_i (the
    K-major copies in the padded per-document layout, B operands of dK / dV) and the per-query
    vectors lse, Delta, sq, sdo ((1, BM) fp32 TMA boxes, or one (4, BM) box with pack_vecs, so
    they cost no registers until used).
    The vectors come from (Hq, Tp) copies in the same padded layout as the K-major tiles
    (`padded_vectors`), read at column pstart + i0: TMA needs the innermost box coordinate
    16-byte aligned (an unaligned one is an *illegal instruction* on Hopper, not a masked read;
    triton-lang/triton#7385, the Gluon TMA tutorial's list of restrictions), and the packed
    (Hq, T) vectors' h * T + start + i0 is not: the first H200 run's crash.
  - S^T and dP^T are issued back to back as async wgmmas; the kernel waits for S^T only and
    computes P^T, a, c_j, e4m3(a / c_j) while dP^T runs; the dV GEMM (A = the fp8 tile from
    registers, B = doT8 tile in shared memory) is issued before t / b / c2 are computed. The dV
    and dK GEMMs are split into 64-column halves of D so that at most two 64 x 64 fp32 results
    are in flight next to the two BN x D accumulators (register budget 255 / thread).
  - Tiles that reach past the document end (at most one per head) get their K-major tiles'
    out-of-document columns zeroed in shared memory (a NaN byte of the next document would
    survive 0 * NaN in the MMA) and a = P^T sdo / b masked with `where` (never multiplied: the
    next document's lse / sdo / Delta / sq / q8 / do8 come in through the TMA boxes).
  - The innermost component of every TMA coordinate is a multiple of 16 bytes: h * D (q8, do8,
    k8, v8) and pstart + i0 with pstart % 16 == 0 (qT8, doT8, and the padded vectors).
  - GluonDkdvConfig.sync_mma waits for every wgmma right after issuing it (no overlap): a
    bisection baseline, like vec_tma=False (plain masked gl.load of the vectors) and stages=1.
Causal masking is the same `where` on a and b for the diagonal tiles (query >= key,
document-relative); the result equals masking P^T.

Options (GluonDkdvConfig; the defaults per head dim, `default_gluon_config`, are the fastest
combination measured on the H200, benchmarks/NOTES.md session 5):
  - ws (constexpr WS; default at D=64): FA3's layout, BN = 128 keys and two consumer warpgroups
    (64 keys each) in one CTA per SM, fed by a 1-warp TMA producer partition (the ws comment
    above `_release_slot`). The one-warpgroup overlap / ws variants lost and were removed
    (session 4).
  - fold_sdo (constexpr FOLD; default): sdo_i is a power of two, so the lse vector arrives as
    lse2_i - log2(sdo_i) and a = exp2(S^T - that) directly (one multiply per element less).
  - pack_vecs (default): lse, Delta, sq, sdo interleaved per head in one (Hq * 4, Tp) buffer
    and one (4, BM) TMA box per tile (`_packed_query_vectors`, one Triton launch).
  - shared_mask (constexpr SHARED_MASK; the D=128 default until session 7): the two masks as
    one expression, which the compiler evaluates on every tile; with threshold_mask it no longer
    saves spills, so the default leaves it off.

dQ (`launch_dq_gluon`): see the comment of the dQ launcher section; its opt-in ws schedule
(constexpr WS): above `_dq_producer`. CPU builds: compile_sm90 / compile_dq_sm90.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

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

from .kmajor import mma_key_order_gluon, mma_order16_gluon

if HAVE_GLUON:   # the persistent kernels' work-list reader
    from .schedule import work_item

LOG2E = 1.4426950408889634
CH_ = 64    # column chunk of D for the dV / dK GEMM results and accumulators


@dataclass(frozen=True)
class GluonDkdvConfig:
    bn: int = 64          # keys per CTA (one warpgroup)
    bm: int = 64          # query rows per step
    stages: int = 2       # TMA ring depth (D=128: 2 keeps ~90 KB smem -> 2 CTAs / SM)
    vec_tma: bool = True  # lse / Delta / sq / sdo by (1, BM) TMA boxes (False: gl.load)
    num_warps: int = 4
    sync_mma: bool = False  # every wgmma waited for at once (bisection baseline)
    # ws: a 1-warp TMA producer partition, for bn=128 / num_warps=8 only (FA3's layout). The two
    # consumer warpgroups issue no TMA, so the membar pass's bar.sync per TMA issue goes away
    # (12 partition-wide bar.sync per tile -> 4) and they can drift apart between the rest.
    ws: bool = False
    producer_regs: int = 24   # setmaxnreg of the ws producer warp
    # the padded vectors built by one Triton launch (kmajor.padded_rows) instead of 4 torch
    # gathers (host side only: the kernel is the same)
    vec_gather: bool = False
    # fold_sdo: the lse vector arrives as lse * log2(e) - log2(sdo) (sdo is a power of two), so
    # exp2 gives a = P^T sdo_i directly: one FMUL per element and one per query less per tile
    # (constexpr FOLD; needs vec_tma)
    fold_sdo: bool = False
    # shared_mask: the dS^T mask written as the same expression as the dV operand's; the
    # compiler then computes the predicate once, before the first masked `where`, on every
    # tile (~180 more SASS instructions per tile at D=128, but 180 instead of 340 B of spills).
    # Off: each masked branch computes its own (constexpr SHARED_MASK).
    shared_mask: bool = False
    # pack_vecs: lse, Delta, sq, sdo interleaved per head in one (Hq * 4, Tp) buffer, one (4, BM)
    # TMA box per tile instead of four (1, BM) ones (each TMA issue costs the consumer a CTA
    # barrier and ~20 instructions of descriptor / coordinate set-up; needs vec_tma)
    pack_vecs: bool = False
    # threshold_mask: both masks as one compare per element against a per-column threshold
    # (constexpr THR_MASK; the same predicate). late_dv: the dV GEMM issued after the dS^T
    # operand, not overlapping its math (constexpr LATE_DV): 32 fewer live registers. Together
    # at D=128 with shared_mask: 1132 -> 1010 SASS on the unconditional path per tile, spills
    # 204 -> 80 B (benchmarks/NOTES.md session 5 item 12); doc32k 37.5 -> 33.0 ms (session 6).
    threshold_mask: bool = False
    late_dv: bool = False
    # key_order_dv / key_order_dk: the A operand a8 = P^T sdo of the dV GEMM / b8 = dS^T of the
    # dK GEMM goes in as its registers already are an fp8 wgmma A operand (queries, the
    # reduction dim, in kmajor.mma_order16 order within 16-query groups), with doT8 / qT8 in the
    # same column order (launch_preprocess writes them so when this kernel runs), instead of a
    # cross-lane conversion (constexpr KEY_ORDER_DV / KEY_ORDER_DK). CPU, SASS per tile: D=64
    # both 692 -> 643, no spills (the default since session 10); D=128 dk only 929 -> 902 and
    # spills 64 -> 60 B, dv only 974, both 998 with 292 B (benchmarks/NOTES.md session 10).
    key_order_dv: bool = False
    key_order_dk: bool = False
    diag: int = 0   # timing diagnostic (wrong results): _dkdv_loop's DIAG (benchmarks/NOTES.md s11)


def plain_gluon_config(D: int) -> GluonDkdvConfig:
    """One warpgroup per 64 keys, no opt-in: the base the dev ladders and variants start from."""
    return GluonDkdvConfig(stages=3 if D <= 64 else 2)


@functools.lru_cache(maxsize=None)   # frozen: one per D, not rebuilt per call
def default_gluon_config(D: int) -> GluonDkdvConfig:
    """The fastest config measured on the H200 (benchmarks/NOTES.md, session 6 item 1 and
    session 7 item 7; bwd_gluon_dev.py in one process, ms, doc8k_x4 / longtail / doc32k at
    D=128, doc8k_x4 at D=64): D=128 fold_sdo + pack_vecs + late_dv + threshold_mask 8.10 / 8.11
    / 32.30 (with shared_mask as well, the session-6 default: 8.36 / 8.34 / 31.95; without the
    last two 9.62 / 9.01 / 37.54, plain 10.44 / 10.22 / 43.94, session 6); D=64 FA3's layout
    (w8ws) + fold_sdo + pack_vecs 6.51 (+ threshold_mask 6.62, plain 7.35), + key_order_dv/dk
    (session 10): d64_doc8k_x4 6.36 -> 5.95, d64_longtail 5.06 -> 4.76."""
    if D <= 64:
        return dataclasses.replace(plain_gluon_config(D), bn=128, num_warps=8, ws=True,
                                   fold_sdo=True, pack_vecs=True, key_order_dv=True,
                                   key_order_dk=True)
    return dataclasses.replace(plain_gluon_config(D), fold_sdo=True, pack_vecs=True,
                               late_dv=True, threshold_mask=True)


@dataclass(frozen=True)
class GluonDqConfig:
    bm: int = 64          # query rows per CTA (16 per warp: one m64 wgmma block per warpgroup)
    bn: int = 64          # keys per step
    stages: int = 3       # kv ring depth (D=128: ~99 KB smem with the rotate tile -> 2 CTAs / SM)
    vec_tma: bool = True  # sk / sv by (1, BN) TMA boxes of padded (Hkv, Tp) copies (False: gl.load)
    num_warps: int = 4
    sync_mma: bool = False  # every wgmma waited for at once (bisection baseline)
    # --- opt-in (off: the production schedule of _dq_fp8_kernel) ---
    # ws: a 1-warp TMA producer partition (constexpr WS); needs vec_tma, not sync_mma, one
    # warpgroup. (The software-pipelined S / dP "overlap" schedules lost on the H200 and were
    # removed: benchmarks/NOTES.md, session 5.)
    ws: bool = False
    producer_regs: int = 24   # setmaxnreg of the ws producer warp
    # launch register cap (0: none). ws allocates 8 warps (the producer warp padded to a
    # warpgroup): maxnreg 128 keeps 2 CTAs / SM, the consumer then setmaxnreg's up to ~232
    maxnreg: int = 0
    vec_gather: bool = False   # sk / sv by one Triton launch (kmajor.padded_rows)
    # persistent: that many CTAs per SM walk the forward's work list (flamia.ops.schedule), the
    # ws producer running ahead across items (_dq_fp8_persistent_kernel); needs ws. qbuf: q8 /
    # do8 buffers (2: the next item's pair loads during this item)
    persistent: int = 0
    qbuf: int = 2
    diag: int = 0   # persistent only, timing diagnostic (wrong results): _dq_tile_update's DIAG


def plain_dq_config(D: int) -> GluonDqConfig:
    """One program per (document, query head, query block): the base the dev ladders and
    variants start from. sk / sv gathered by one Triton launch (vec_gather; bitwise the torch
    gathers, and the same kernel: timed alike on the H200, session 5) to spare the host 4 small
    torch ops."""
    return GluonDqConfig(stages=4 if D <= 64 else 3, vec_gather=True)


@functools.lru_cache(maxsize=None)   # frozen: one per D, not rebuilt per call
def default_dq_config(D: int) -> GluonDqConfig:
    """The persistent kernel, two CTAs per SM, q8 / do8 single-buffered at the plain ring depth
    (benchmarks/NOTES.md session 11 item 2; bitwise the plain kernel's results). H200, ms, plain
    -> persistent, same process: doc512_x64 0.72 -> 0.62, doc2k_x16 1.67 -> 1.54, longtail
    4.54 -> 4.17, doc8k_x4 5.74 -> 5.27, d64_doc8k_x4 4.22 -> 4.07."""
    return dataclasses.replace(plain_dq_config(D), ws=True, maxnreg=128, persistent=2, qbuf=1)


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
    def _issue_tile(it, nb, lo, start, pstart, hk, T,
                    q_desc, do_desc, qT_desc, doT_desc, lse_desc, dl_desc, sq_desc, sdo_desc,
                    q_s, do_s, qT_s, doT_s, lse_s, dl_s, sq_s, sdo_s, ready, pred,
                    GROUP, D: gl.constexpr, BM: gl.constexpr, NS: gl.constexpr,
                    VEC_TMA: gl.constexpr):
        """TMA loads of query tile `it` (head g = it // nb, block i0) into ring slot it % NS."""
        i0, h = _q_tile_rows(it, nb, lo, hk, GROUP, BM)
        _issue_tile_at(i0, h, it % NS, start, pstart, q_desc, do_desc, qT_desc, doT_desc,
                       lse_desc, dl_desc, sq_desc, sdo_desc, q_s, do_s, qT_s, doT_s, lse_s, dl_s,
                       sq_s, sdo_s, ready, pred, D, VEC_TMA)

    @gluon.jit
    def _issue_tile_at(i0, h, s, start, pstart,
                       q_desc, do_desc, qT_desc, doT_desc, lse_desc, dl_desc, sq_desc, sdo_desc,
                       q_s, do_s, qT_s, doT_s, lse_s, dl_s, sq_s, sdo_s, ready, pred,
                       D: gl.constexpr, VEC_TMA: gl.constexpr):
        """TMA loads of the query tile (head h, first row i0) into ring slot s.
        Packed vectors (lse_desc with (4, BM) boxes, GluonDkdvConfig.pack_vecs): one box of the
        four rows lse, Delta, sq, sdo into lse_s (the one ring) instead of four (1, BM) boxes."""
        bar = ready.index(s)
        PACK: gl.constexpr = lse_desc.block_type.shape[0] > 1
        NVEC: gl.constexpr = 1 if PACK else 4
        # the full boxes' bytes (TMA counts out-of-bounds fills too), from the descriptors
        if VEC_TMA:
            NBYTES: gl.constexpr = (2 * q_desc.block_type.nbytes + 2 * qT_desc.block_type.nbytes
                                    + NVEC * lse_desc.block_type.nbytes)
        else:
            NBYTES: gl.constexpr = 2 * q_desc.block_type.nbytes + 2 * qT_desc.block_type.nbytes
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [start + i0, h * D], bar, q_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(do_desc, [start + i0, h * D], bar, do_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(qT_desc, [h * D, pstart + i0], bar, qT_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(doT_desc, [h * D, pstart + i0], bar, doT_s.index(s),
                                        pred=pred)
        if VEC_TMA and PACK:
            tma.async_copy_global_to_shared(lse_desc, [h * 4, pstart + i0], bar, lse_s.index(s),
                                            pred=pred)
        elif VEC_TMA:
            _issue_query_vecs(lse_desc, dl_desc, sq_desc, sdo_desc, lse_s, dl_s, sq_s, sdo_s, h,
                              pstart + i0, bar, s, pred)

    @gluon.jit
    def _row_vec(ring, s, ptr, h, T, start, m_idx, L, other, COL: gl.constexpr,
                 VEC_TMA: gl.constexpr, ROW: gl.constexpr = 0):
        """A per-query vector of the tile in the column slice layout of the MMA results: stage s
        of a (NS, R, BM) fp32 ring (unswizzled, so read as a plain 1-D buffer; row ROW when the
        ring packs R > 1 vectors, else row 0), or a masked global load."""
        if VEC_TMA:
            R: gl.constexpr = ring.shape[1]
            BM: gl.constexpr = ring.shape[2]
            flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            if R == 1:
                x = ring.index(s)._reinterpret(gl.float32, [BM], flat).load(COL)
            else:
                x = ring.index(s)._reinterpret(gl.float32, [R * BM], flat).slice(
                    ROW * BM, BM).load(COL)
        else:
            x = gl.load(ptr + h * T + start + m_idx, mask=m_idx < L, other=other)
        return x

    @gluon.jit
    def _mma(a, b, zero, SYNC: gl.constexpr):
        """a @ b from a zero accumulator: an async wgmma (a token for _mma_wait), or with SYNC a
        plain one, waited for at once (the bisection baseline: no wgmma ever overlaps)."""
        if SYNC:
            r = warpgroup_mma(a, b, zero, use_acc=False)
        else:
            r = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
        return r

    @gluon.jit
    def _mma_wait(tok, N: gl.constexpr, SYNC: gl.constexpr):
        if SYNC:
            r = tok
        else:
            r = warpgroup_mma_wait(N, deps=(tok,))
        return r

    @gluon.jit
    def _promote(tok, N: gl.constexpr, acc, c, SYNC: gl.constexpr):
        """The fp32 promotion of one fresh fp8 GEMM result: acc + result * c per row, once the
        wgmma is retired (waited for down to N groups still in flight)."""
        return acc + _mma_wait(tok, N, SYNC) * gl.expand_dims(c, 1)

    @gluon.jit
    def _promote_pair(tok0, tok1, acc0, acc1, c, SYNC: gl.constexpr):
        """_promote of two in-flight 64-column GEMM halves (issued in this order, no later
        wgmma outstanding), each as soon as it is done."""
        acc0 = _promote(tok0, 1, acc0, c, SYNC)
        acc1 = _promote(tok1, 0, acc1, c, SYNC)
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

    # ------------------------------------------------------------------------------------------
    # Pieces of the fp8 kernels below that the fp8_mixed ones (backward_gluon_mixed) reuse as
    # they are, like the helpers above: program prologues, shared-memory rings and barriers,
    # per-key / per-query vectors, tile indices, masks, P^T and the dV operand, epilogues.
    # Triton inlines them, and the PTX follows their op order: keep it when editing (an
    # argument computed by the caller moves its instructions before the helper's first op).
    # ------------------------------------------------------------------------------------------

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
    def _vec_ring(desc, placeholder, NS: gl.constexpr, BOX: gl.constexpr,
                  VEC_TMA: gl.constexpr):
        """The (NS, R, BOX) fp32 ring of a per-row vector's TMA boxes (R rows per box: 1, or 4
        packed vectors; the descriptor's unswizzled layout); without VEC_TMA `placeholder`, never
        touched."""
        if VEC_TMA:
            R: gl.constexpr = desc.block_type.shape[0]
            ring = gl.allocate_shared_memory(gl.float32, [NS, R, BOX], desc.layout)
        else:
            ring = placeholder
        return ring

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
    def _dv_operand(s_tok, s, rowf, n_idx, cols, h, T, start, L_doc, shift, need_mask,
                    lse_s, sq_s, sdo_s, lse, sq, sdo, PENDING: gl.constexpr, BM: gl.constexpr,
                    COL: gl.constexpr, AOP: gl.constexpr, VEC_TMA: gl.constexpr,
                    SYNC: gl.constexpr, FOLD: gl.constexpr, THR: gl.constexpr,
                    KEY_ORDER: gl.constexpr = False, LAZY: gl.constexpr = False):
        """P^T of a dK/dV tile from its S^T wgmma (waited for down to PENDING groups) and the
        dV GEMM's A operand: a = P^T sdo_i (masked), its per-key scale c_j, e4m3(a / c_j).
        cols: the tile's query indices, or with LAZY its first query (_cols_of).
        FOLD: the lse ring holds lse * log2(e) - log2(sdo_i), the exponent gives a at once
        (p is then a as well: only for callers that do not need P itself)."""
        if VEC_TMA:
            m_idx = cols   # (unused by _row_vec)
        else:
            m_idx = _cols_of(cols, BM, COL, LAZY)
        lse2 = _row_vec(lse_s, s, lse, h, T, start, m_idx, L_doc, float("inf"), COL, VEC_TMA)
        if not FOLD:
            lse2 = lse2 * 1.4426950408889634
        sq_i = _row_vec(sq_s, s, sq, h, T, start, m_idx, L_doc, 0.0, COL, VEC_TMA, 2)
        st = _mma_wait(s_tok, PENDING, SYNC)
        p = gl.exp2(st * gl.expand_dims(rowf, 1) * gl.expand_dims(sq_i, 0)
                    - gl.expand_dims(lse2, 0))
        if FOLD:
            a = p
        else:
            sdo_i = _row_vec(sdo_s, s, sdo, h, T, start, m_idx, L_doc, 0.0, COL, VEC_TMA, 3)
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
        the lane id). Inside, the fp8_mixed kernel gained 14 % (H200); the fp8 kernel at
        D=128 lost 20 % (ptxas spilled more: 276 B), so it keeps the indices (NOTES s13)."""
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
    def _mask_ds_t(b, n_idx, cols, shift, L_doc, need_mask, SHARED: gl.constexpr,
                   THR: gl.constexpr, COL: gl.constexpr, LAZY: gl.constexpr = False):
        """dK/dV: b (the dK operand before scaling) masked like a in _dv_operand, where needed:
        dP^T, Delta, sq of out-of-document columns may be anything (another document). cols:
        as in _dv_operand."""
        BM: gl.constexpr = b.shape[1]
        if SHARED and need_mask:
            b = gl.where(_visible(n_idx, _cols_of(cols, BM, COL, LAZY), shift, L_doc, THR), b,
                         0.0)
        elif need_mask:
            m_idx = _cols_of(cols, BM, COL, LAZY)
            # the predicate of _dv_operand's `ok`, written differently: as the same expression
            # the compiler computed it once, before the first `if`, on every tile (~120 of
            # ~1200 SASS instructions per tile; benchmarks/NOTES.md, session 4)
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

    # ------------------------------------------------------------------------------------------
    # ws (GluonDkdvConfig.ws / GluonDqConfig.ws; constexpr WS of _dkdv_fp8_kernel /
    # _dq_fp8_kernel): gl.warp_specialize with a 1-warp TMA producer partition (forward_gluon's
    # ready / release protocol). The producer issues every TMA load: K / V (dQ: q8 / do8) once,
    # the first NS ring tiles, then, per release r_j (count 1, phase j // NS of rel[j % NS]),
    # tile j + NS into the freed slot. The consumer (the default partition: dK/dV two
    # warpgroups, dQ one) waits for ready[j % NS] as without ws, issues no TMA (so no CTA-wide
    # bar.sync per TMA issue in its loop), and releases slot j % NS once every one of its warps
    # is done reading it (_release_slot). The accumulators are returned from the partition; the
    # epilogue (stores, Hadamard rotate) runs after it. Per tile the numerics are the default's,
    # op for op: results expected bitwise equal.
    # ------------------------------------------------------------------------------------------

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
    def _dkdv_producer(k_desc, v_desc, q_desc, do_desc, qT_desc, doT_desc,
                       lse_desc, dl_desc, sq_desc, sdo_desc,
                       k_s, v_s, q_s, do_s, qT_s, doT_s, lse_s, dl_s, sq_s, sdo_s,
                       ready, rel, kv_bar, start, pstart, n0, hk, lo, nb, total, GROUP, T):
        """The 1-warp TMA partition of _dkdv_fp8_kernel with WS. Sizes from the buffers' types
        (constexpr arguments of a worker partition arrive as tensors in Triton 3.6)."""
        NS: gl.constexpr = q_s.type.shape[0]
        BM: gl.constexpr = q_s.type.shape[1]
        D: gl.constexpr = q_s.type.shape[2]
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [start + n0, hk * D], kv_bar, k_s)
        tma.async_copy_global_to_shared(v_desc, [start + n0, hk * D], kv_bar, v_s)
        for pi in gl.static_range(NS):
            _issue_tile(pi, nb, lo, start, pstart, hk, T, q_desc, do_desc, qT_desc, doT_desc,
                        lse_desc, dl_desc, sq_desc, sdo_desc, q_s, do_s, qT_s, doT_s,
                        lse_s, dl_s, sq_s, sdo_s, ready, pi < total, GROUP, D, BM, NS, True)
        for j in range(total - NS):
            mbarrier.wait(rel.index(j % NS), (j // NS) & 1)
            _issue_tile(j + NS, nb, lo, start, pstart, hk, T, q_desc, do_desc, qT_desc,
                        doT_desc, lse_desc, dl_desc, sq_desc, sdo_desc, q_s, do_s, qT_s, doT_s,
                        lse_s, dl_s, sq_s, sdo_s, ready, True, GROUP, D, BM, NS, True)

    @gluon.jit
    def _dkdv_loop(q_desc, do_desc, qT_desc, doT_desc, lse_desc, dl_desc, sq_desc, sdo_desc,
                   k_s, v_s, q_s, do_s, qT_s, doT_s, lse_s, dl_s, sq_s, sdo_s, ready, rel,
                   kv_bar, lse, delta, sq, sdo, sk, sv, start, pstart, L_doc, n0, hk, lo, nb,
                   total, GROUP, T, qk_scale2,
                   D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
                   CAUSAL: gl.constexpr, VEC_TMA: gl.constexpr, SYNC: gl.constexpr,
                   WS: gl.constexpr, FOLD: gl.constexpr, SHARED_MASK: gl.constexpr,
                   THR_MASK: gl.constexpr, LATE_DV: gl.constexpr, num_warps: gl.constexpr,
                   KEY_ORDER_DV: gl.constexpr = False, KEY_ORDER_DK: gl.constexpr = False,
                   DIAG: gl.constexpr = 0):
        """The main loop of _dkdv_fp8_kernel (with WS: its consumer partition); returns the
        fp32 accumulators (dV half 0, 1, dK half 0, 1). DIAG=1 (timing diagnostic, wrong
        results): the four GEMMs with almost no element-wise work between them (the dV / dK
        A operands are S^T / dP^T cast to e4m3, the promotion scales rowf_j)."""
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
        # advanced per tile, so the loop divides by nb only here (two runtime divisions per
        # tile before: D=128 1010 -> 969 SASS per tile, doc32k 33.9 -> 32.0 ms; NOTES s7 item 3)
        g_cur = 0
        blk_cur = 0
        g_nxt = (NS - 1) // nb
        blk_nxt = (NS - 1) - g_nxt * nb

        for it in range(total):
            if not WS:   # refill the slot consumed at it - 1 (its wgmmas were all waited for)
                nxt = it + NS - 1
                _issue_tile_at(lo + blk_nxt * BM, hk * GROUP + g_nxt, nxt % NS, start, pstart,
                               q_desc, do_desc, qT_desc, doT_desc, lse_desc, dl_desc, sq_desc,
                               sdo_desc, q_s, do_s, qT_s, doT_s, lse_s, dl_s, sq_s, sdo_s, ready,
                               nxt < total, D, VEC_TMA)
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
            s_tok = _mma(k_s, qs.permute((1, 0)), zero, SYNC)
            dp_tok = _mma(v_s, dos.permute((1, 0)), zero, SYNC)

            if tail:   # at most once per head: the K-major tiles' columns past the document end
                _zero_tail_cols(qTs, i0, L_doc, D, BM, num_warps, KEY_ORDER_DK)
                _zero_tail_cols(doTs, i0, L_doc, D, BM, num_warps, KEY_ORDER_DV)
                fence_async_shared()
                gl.thread_barrier()

            if DIAG == 1:
                a8 = gl.convert_layout(_mma_wait(s_tok, 1, SYNC).to(gl.float8e4nv), AOP)
                c = rowf
            else:
                p, a, c, a8 = _dv_operand(s_tok, s, rowf, n_idx, m_idx, h, T, start, L_doc,
                                          shift, need_mask, lse_s, sq_s, sdo_s, lse, sq, sdo, 1,
                                          BM, COL, AOP, VEC_TMA, SYNC, FOLD, THR_MASK,
                                          KEY_ORDER_DV)
            if not LATE_DV:   # dV's first half overlaps the dS^T math (32 result registers)
                dv0_tok = _mma(a8, doTs.slice(0, CH, dim=0).permute((1, 0)), zero, SYNC)

            dl_i = _row_vec(dl_s, s, delta, h, T, start, m_idx, L_doc, 0.0, COL, VEC_TMA, 1)
            if LATE_DV:   # nothing issued after dP^T yet
                dp = _mma_wait(dp_tok, 0, SYNC)
            else:
                dp = _mma_wait(dp_tok, 1, SYNC)
            if DIAG == 1:
                b8 = gl.convert_layout(dp.to(gl.float8e4nv), AOP)
                c2 = rowf
            else:
                t = dp * gl.expand_dims(sv_j, 1) - gl.expand_dims(dl_i, 0)
                # sq_i again from shared memory: not kept live in registers across the wgmma
                # waits
                sq_i2 = _row_vec(sq_s, s, sq, h, T, start, m_idx, L_doc, 0.0, COL, VEC_TMA, 2)
                b = _mask_ds_t(a * t * gl.expand_dims(sq_i2, 0), n_idx, m_idx, shift, L_doc,
                               need_mask, SHARED_MASK, THR_MASK, COL)
                c2, inv2 = _pow2_scale_g(gl.max(gl.abs(b), axis=1), 8)
                if KEY_ORDER_DK:
                    b8 = gl.convert_layout(
                        mma_key_order_gluon((b * gl.expand_dims(inv2, 1)).to(gl.float8e4nv)),
                        AOP)
                else:
                    b8 = gl.convert_layout((b * gl.expand_dims(inv2, 1)).to(gl.float8e4nv), AOP)
            if LATE_DV:
                dv0_tok = _mma(a8, doTs.slice(0, CH, dim=0).permute((1, 0)), zero, SYNC)

            if NCH == 2:
                dv1_tok = _mma(a8, doTs.slice(CH, CH, dim=0).permute((1, 0)), zero, SYNC)
                acc_dv0 = _promote(dv0_tok, 1, acc_dv0, c, SYNC)
                dk0_tok = _mma(b8, qTs.slice(0, CH, dim=0).permute((1, 0)), zero, SYNC)
                acc_dv1 = _promote(dv1_tok, 1, acc_dv1, c, SYNC)
                dk1_tok = _mma(b8, qTs.slice(CH, CH, dim=0).permute((1, 0)), zero, SYNC)
                acc_dk0, acc_dk1 = _promote_pair(dk0_tok, dk1_tok, acc_dk0, acc_dk1, c2, SYNC)
            else:
                dk0_tok = _mma(b8, qTs.permute((1, 0)), zero, SYNC)
                acc_dv0 = _promote(dv0_tok, 1, acc_dv0, c, SYNC)
                acc_dk0 = _promote(dk0_tok, 0, acc_dk0, c2, SYNC)
            if WS:   # every read of slot s is done (wgmmas waited; vectors read)
                _release_slot(rel, s)

        return acc_dv0, acc_dv1, acc_dk0, acc_dk1

    # T, HQ, HKV runtime and unspecialized: one binary per (config, D, causal, dtypes), not one
    # per head count / T % 16 (fewer compiles in the GPU dev runs; nothing depends on them)
    @gluon.jit(do_not_specialize=["T", "HQ", "HKV"])
    def _dkdv_fp8_kernel(
        k_desc, v_desc, q_desc, do_desc, qT_desc, doT_desc,
        lse_desc, dl_desc, sq_desc, sdo_desc,
        lse, delta, sq, sdo, sk, sv, dk, dv, hmat, cu, pcu,
        T, stride_dkt, sm_scale, qk_scale2, out_scale,
        HQ, HKV, D: gl.constexpr, BM: gl.constexpr,
        BN: gl.constexpr, NS: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
        VEC_TMA: gl.constexpr, SYNC: gl.constexpr, WS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, FOLD: gl.constexpr, SHARED_MASK: gl.constexpr,
        THR_MASK: gl.constexpr, LATE_DV: gl.constexpr, num_warps: gl.constexpr,
        KEY_ORDER_DV: gl.constexpr = False, KEY_ORDER_DK: gl.constexpr = False,
        DIAG: gl.constexpr = 0,
    ):
        gl.static_assert(not WS or (VEC_TMA and not SYNC and num_warps == 8),
                         "ws needs VEC_TMA, async wgmma and two consumer warpgroups")
        gl.static_assert(not FOLD or VEC_TMA, "FOLD needs VEC_TMA (the folded padded vector)")
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
        lse_s = _vec_ring(lse_desc, q_s, NS, BM, VEC_TMA)
        if lse_desc.block_type.shape[0] > 1:   # pack_vecs: one ring, rows lse, Delta, sq, sdo
            dl_s = lse_s
            sq_s = lse_s
            sdo_s = lse_s
        else:
            dl_s = _vec_ring(dl_desc, q_s, NS, BM, VEC_TMA)
            sq_s = _vec_ring(sq_desc, q_s, NS, BM, VEC_TMA)
            sdo_s = _vec_ring(sdo_desc, q_s, NS, BM, VEC_TMA)
        ready, kv_bar, rel = _init_barriers(NS, WS)

        # --- K_j, V_j (WS: by the producer), the first NS - 1 query tiles --------------------
        if not WS:
            mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [start + n0, hk * D], kv_bar, k_s)
            tma.async_copy_global_to_shared(v_desc, [start + n0, hk * D], kv_bar, v_s)

        lo, nb, total = _dkdv_bounds(n0, L_doc, GROUP, BM, CAUSAL)
        if WS:   # (the arguments twice: a shared tuple would not keep D, BM, .. constexpr)
            accs = gl.warp_specialize([
                (_dkdv_loop, (q_desc, do_desc, qT_desc, doT_desc, lse_desc, dl_desc, sq_desc,
                              sdo_desc, k_s, v_s, q_s, do_s, qT_s, doT_s, lse_s, dl_s, sq_s,
                              sdo_s, ready, rel, kv_bar, lse, delta, sq, sdo, sk, sv, start,
                              pstart, L_doc, n0, hk, lo, nb, total, GROUP, T, qk_scale2, D, BM,
                              BN, NS, CAUSAL, VEC_TMA, SYNC, WS, FOLD, SHARED_MASK, THR_MASK,
                              LATE_DV, num_warps, KEY_ORDER_DV, KEY_ORDER_DK, DIAG)),
                (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, qT_desc, doT_desc,
                                  lse_desc, dl_desc, sq_desc, sdo_desc, k_s, v_s, q_s, do_s,
                                  qT_s, doT_s, lse_s, dl_s, sq_s, sdo_s, ready, rel, kv_bar,
                                  start, pstart, n0, hk, lo, nb, total, GROUP, T)),
            ], [1], [PRODUCER_REGS])
        else:
            for pi in gl.static_range(NS - 1):
                _issue_tile(pi, nb, lo, start, pstart, hk, T, q_desc, do_desc, qT_desc,
                            doT_desc, lse_desc, dl_desc, sq_desc, sdo_desc, q_s, do_s, qT_s,
                            doT_s, lse_s, dl_s, sq_s, sdo_s, ready, pi < total, GROUP, D, BM,
                            NS, VEC_TMA)
            accs = _dkdv_loop(q_desc, do_desc, qT_desc, doT_desc, lse_desc, dl_desc, sq_desc,
                              sdo_desc, k_s, v_s, q_s, do_s, qT_s, doT_s, lse_s, dl_s, sq_s,
                              sdo_s, ready, rel, kv_bar, lse, delta, sq, sdo, sk, sv, start,
                              pstart, L_doc, n0, hk, lo, nb, total, GROUP, T, qk_scale2, D, BM,
                              BN, NS, CAUSAL, VEC_TMA, SYNC, WS, FOLD, SHARED_MASK, THR_MASK,
                              LATE_DV, num_warps, KEY_ORDER_DV, KEY_ORDER_DK, DIAG)
        acc_dv0, acc_dv1, acc_dk0, acc_dk1 = accs
        _invalidate_barriers(ready, kv_bar, rel, NS, WS)

        # --- epilogue ---------------------------------------------------------------------
        n_idx = n0 + gl.arange(0, BN, layout=ROW)
        n_ok = n_idx < L_doc
        _dkdv_epilogue(acc_dv0, acc_dv1, acc_dk0, acc_dk1, dv, dk, hmat, n_idx, n_ok, start, hk,
                       stride_dkt, sm_scale, out_scale, ROTATE, D, BN, NCH, L, num_warps)

    # ------------------------------------------------------------------------------------------
    # dQ (same numerics as backward._dq_tile, RECIPE == 0)
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _issue_kv(jt, start, pstart, hk, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                  k_s, v_s, kT_s, sk_s, sv_s, ready, pred,
                  D: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, VEC_TMA: gl.constexpr):
        """TMA loads of kv tile `jt` (keys j0 = jt * BN of the document) into ring slot jt % NS:
        k8_j, v8_j (token-major), kT8_j (K-major, padded columns) and with VEC_TMA sk_j, sv_j
        ((1, BN) boxes of the padded (Hkv, Tp) copies)."""
        _issue_kv_at(jt * BN, jt % NS, start, pstart, hk, k_desc, v_desc, kT_desc, sk_desc,
                     sv_desc, k_s, v_s, kT_s, sk_s, sv_s, ready, pred, D, VEC_TMA)

    @gluon.jit
    def _issue_kv_at(j0, s, start, pstart, hk, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                     k_s, v_s, kT_s, sk_s, sv_s, ready, pred, D: gl.constexpr,
                     VEC_TMA: gl.constexpr):
        """_issue_kv of the tile at key j0 into ring slot s."""
        bar = ready.index(s)
        if VEC_TMA:
            NBYTES: gl.constexpr = (k_desc.block_type.nbytes + v_desc.block_type.nbytes
                                    + kT_desc.block_type.nbytes + 2 * sk_desc.block_type.nbytes)
        else:
            NBYTES: gl.constexpr = (k_desc.block_type.nbytes + v_desc.block_type.nbytes
                                    + kT_desc.block_type.nbytes)
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [start + j0, hk * D], bar, k_s.index(s), pred=pred)
        tma.async_copy_global_to_shared(v_desc, [start + j0, hk * D], bar, v_s.index(s), pred=pred)
        # pstart % 16 == 0 and j0 % BN == 0: 16-byte aligned innermost coordinates (fp8, fp32)
        tma.async_copy_global_to_shared(kT_desc, [hk * D, pstart + j0], bar, kT_s.index(s),
                                        pred=pred)
        if VEC_TMA:
            _issue_key_vecs(sk_desc, sv_desc, sk_s, sv_s, hk, pstart + j0, bar, s, pred)

    # ------------------------------------------------------------------------------------------
    # Opt-in schedule of the dQ kernel: ws (GluonDqConfig.ws / producer_regs; constexprs WS,
    # PRODUCER_REGS of _dq_fp8_kernel; off by default: then it compiles to the production PTX).
    # The protocol of the dK/dV kernel's (comment above _release_slot) with a one-warpgroup
    # consumer; the producer loads q8 / do8 once, then the kv ring. Per tile the numerics are
    # the default's, op for op; only who issues the TMA loads changes, so the results are
    # expected bitwise equal to the default's. Needs VEC_TMA, async wgmma (not SYNC) and one
    # warpgroup (_check_dq_ws).
    # ------------------------------------------------------------------------------------------

    @gluon.jit
    def _dq_producer(q_desc, do_desc, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                     q_s, do_s, k_s, v_s, kT_s, sk_s, sv_s, ready, rel, q_bar,
                     start, pstart, m0, h, hk, total):
        """The 1-warp TMA partition of _dq_fp8_kernel with WS (VEC_TMA): q8_i / do8_i once,
        then the kv ring."""
        NS: gl.constexpr = k_s.type.shape[0]
        BN: gl.constexpr = k_s.type.shape[1]
        D: gl.constexpr = k_s.type.shape[2]
        mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [start + m0, h * D], q_bar, q_s)
        tma.async_copy_global_to_shared(do_desc, [start + m0, h * D], q_bar, do_s)
        for pi in gl.static_range(NS):
            _issue_kv(pi, start, pstart, hk, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                      k_s, v_s, kT_s, sk_s, sv_s, ready, pi < total, D, BN, NS, True)
        for j in range(total - NS):
            mbarrier.wait(rel.index(j % NS), (j // NS) & 1)
            _issue_kv(j + NS, start, pstart, hk, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                      k_s, v_s, kT_s, sk_s, sv_s, ready, True, D, BN, NS, True)

    @gluon.jit
    def _dq_tile_update(s_tok, dp_tok, kTs, s, sk_s, sv_s, sk, sv, hk, T, start, n_idx, L_doc,
                        m_idx, shift, need_mask, rowf, lse2, dl_i, acc0, acc1, zero,
                        NCH: gl.constexpr, COL: gl.constexpr, AOP: gl.constexpr,
                        VEC_TMA: gl.constexpr, SYNC: gl.constexpr, DIAG: gl.constexpr = 0):
        """One dQ tile after its S / dP wgmmas were issued (both dQ kernels): P, t, the masked
        dS operand with its per-query scale, the dS K GEMM and the fp32 promotion into acc.
        DIAG=1 (timing diagnostic, wrong results): the three GEMMs with almost no element-wise
        work between them (the dQ GEMM's A operand is S + dP cast to e4m3, the promotion scale
        rowf_i, as _dkdv_loop's DIAG)."""
        if DIAG == 1:
            sc = _mma_wait(s_tok, 1, SYNC)
            dp = _mma_wait(dp_tok, 0, SYNC)
            b8 = gl.convert_layout((sc + dp).to(gl.float8e4nv), AOP)
            c = rowf
        else:
            sk_j = _row_vec(sk_s, s, sk, hk, T, start, n_idx, L_doc, 0.0, COL, VEC_TMA)
            sc = _mma_wait(s_tok, 1, SYNC)
            # the order of backward._dq_tile: s = (q8 k8^T) sk_j, P = exp2(s rowf_i - lse2_i)
            p = gl.exp2(sc * gl.expand_dims(sk_j, 0) * gl.expand_dims(rowf, 1)
                        - gl.expand_dims(lse2, 1))
            sv_j = _row_vec(sv_s, s, sv, hk, T, start, n_idx, L_doc, 0.0, COL, VEC_TMA)
            dp = _mma_wait(dp_tok, 0, SYNC)
            t = dp * gl.expand_dims(sv_j, 0) - gl.expand_dims(dl_i, 1)
            # sk_j again from shared memory / L1: not kept live across the wgmma waits
            sk_j2 = _row_vec(sk_s, s, sk, hk, T, start, n_idx, L_doc, 0.0, COL, VEC_TMA)
            b = _mask_ds(p * t * gl.expand_dims(sk_j2, 0), n_idx, m_idx, shift, L_doc,
                         need_mask)
            c, inv = _pow2_scale_g(gl.max(gl.abs(b), axis=1), 8)
            b8 = gl.convert_layout((b * gl.expand_dims(inv, 1)).to(gl.float8e4nv), AOP)

        # per-tile fp32 promotion: each fp8 wgmma from zero, scaled and added by the CUDA cores
        if NCH == 2:
            d0_tok = _mma(b8, kTs.slice(0, CH, dim=0).permute((1, 0)), zero, SYNC)
            d1_tok = _mma(b8, kTs.slice(CH, CH, dim=0).permute((1, 0)), zero, SYNC)
            acc0, acc1 = _promote_pair(d0_tok, d1_tok, acc0, acc1, c, SYNC)
        else:
            d0_tok = _mma(b8, kTs.permute((1, 0)), zero, SYNC)
            acc0 = _promote(d0_tok, 0, acc0, c, SYNC)
        return acc0, acc1

    @gluon.jit
    def _dq_loop(k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                 q_s, do_s, k_s, v_s, kT_s, sk_s, sv_s, ready, rel, q_bar,
                 lse, delta, sq, sk, sv, start, pstart, L_doc, m0, h, hk, total, mask_from,
                 shift, T, qk_scale2,
                 D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
                 VEC_TMA: gl.constexpr, SYNC: gl.constexpr, WS: gl.constexpr,
                 num_warps: gl.constexpr):
        """The main loop of _dq_fp8_kernel (with WS: its consumer partition); returns the fp32
        accumulators (dQ half 0, 1)."""
        NCH: gl.constexpr = D // CH
        # One MMA layout for S, dP and the 64-column chunks of the dQ results / accumulators: the
        # per-query vectors (ROW) and per-key vectors (COL) broadcast without conversions.
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, CH, 32])
        AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=4)
        ROW: gl.constexpr = gl.SliceLayout(1, L)     # per query (rows of S)
        COL: gl.constexpr = gl.SliceLayout(0, L)     # per key (columns of S)

        m_idx, m_ok, lse2, rowf, dl_i = _query_scales(lse, sq, delta, h, T, start, m0, L_doc,
                                                      qk_scale2, BM, ROW)

        zero = gl.zeros([BM, CH], gl.float32, L)
        acc0 = gl.zeros([BM, CH], gl.float32, L)
        acc1 = gl.zeros([BM, CH], gl.float32, L)
        mbarrier.wait(q_bar, 0)

        for jt in range(total):
            if not WS:
                # every warp is past its reads of slot (jt - 1) % NS (vectors by ld.shared; with
                # two warpgroups also the other one's wgmmas) before the TMA refill overwrites it
                gl.thread_barrier()
                nxt = jt + NS - 1
                _issue_kv(nxt, start, pstart, hk, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                          k_s, v_s, kT_s, sk_s, sv_s, ready, nxt < total, D, BN, NS, VEC_TMA)
            s = jt % NS
            j0, end, need_mask, n_idx = _kv_tile(jt, L_doc, mask_from, BN, COL)
            # (the same ops in two orders: each the PTX its schedule was validated with)
            if WS:
                kTs = kT_s.index(s)
                mbarrier.wait(ready.index(s), (jt // NS) & 1)
                s_tok = _mma(q_s, k_s.index(s).permute((1, 0)), zero, False)
                dp_tok = _mma(do_s, v_s.index(s).permute((1, 0)), zero, False)
            else:
                mbarrier.wait(ready.index(s), (jt // NS) & 1)
                ks = k_s.index(s)
                vs = v_s.index(s)
                kTs = kT_s.index(s)
                s_tok = _mma(q_s, ks.permute((1, 0)), zero, SYNC)
                dp_tok = _mma(do_s, vs.permute((1, 0)), zero, SYNC)

            if end:   # once per program: kT8 columns past the document end (0 * NaN is NaN)
                _zero_tail_cols(kTs, j0, L_doc, D, BN, num_warps)
                fence_async_shared()
                gl.thread_barrier()

            acc0, acc1 = _dq_tile_update(s_tok, dp_tok, kTs, s, sk_s, sv_s, sk, sv, hk, T, start,
                                         n_idx, L_doc, m_idx, shift, need_mask, rowf, lse2, dl_i,
                                         acc0, acc1, zero, NCH, COL, AOP, VEC_TMA, SYNC)
            if WS:   # every read of slot s is done (wgmmas waited; sk / sv read)
                _release_slot(rel, s)

        return acc0, acc1

    @gluon.jit(do_not_specialize=["T", "HQ", "HKV"])
    def _dq_fp8_kernel(
        q_desc, do_desc, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
        lse, delta, sq, sdo, sk, sv, dq, hmat, cu, pcu,
        T, stride_dqt, sm_scale, qk_scale2, out_scale,
        HQ, HKV, D: gl.constexpr, BM: gl.constexpr,
        BN: gl.constexpr, NS: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
        VEC_TMA: gl.constexpr, SYNC: gl.constexpr, WS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        gl.static_assert(not WS or (VEC_TMA and not SYNC and num_warps == 4),
                         "ws needs VEC_TMA, async wgmma and one warpgroup")
        GROUP = HQ // HKV
        NCH: gl.constexpr = D // CH
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, CH, 32])
        ROW: gl.constexpr = gl.SliceLayout(1, L)     # per query (rows of S)

        h, hk, start, L_doc, pstart, ib = _dq_program(cu, pcu, HQ, GROUP, D, BM, BN, num_warps)
        if ib < 0:
            return
        m0 = ib * BM

        # --- shared memory ------------------------------------------------------------------
        q_s = gl.allocate_shared_memory(q_desc.dtype, [BM, D], q_desc.layout)
        do_s = gl.allocate_shared_memory(do_desc.dtype, [BM, D], do_desc.layout)
        k_s = gl.allocate_shared_memory(k_desc.dtype, [NS, BN, D], k_desc.layout)
        v_s = gl.allocate_shared_memory(v_desc.dtype, [NS, BN, D], v_desc.layout)
        kT_s = gl.allocate_shared_memory(kT_desc.dtype, [NS, D, BN], kT_desc.layout)
        sk_s = _vec_ring(sk_desc, k_s, NS, BN, VEC_TMA)
        sv_s = _vec_ring(sv_desc, k_s, NS, BN, VEC_TMA)
        ready, q_bar, rel = _init_barriers(NS, WS)

        # --- q8_i, do8_i once (rows past the document end: other tokens, never stored) -------
        if not WS:   # (WS: by the producer)
            mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [start + m0, h * D], q_bar, q_s)
            tma.async_copy_global_to_shared(do_desc, [start + m0, h * D], q_bar, do_s)

        mask_from, shift, total = _dq_bounds(m0, L_doc, BM, BN, CAUSAL)
        if WS:
            accs = gl.warp_specialize([
                (_dq_loop, (k_desc, v_desc, kT_desc, sk_desc, sv_desc, q_s, do_s, k_s, v_s,
                            kT_s, sk_s, sv_s, ready, rel, q_bar, lse, delta, sq, sk, sv, start,
                            pstart, L_doc, m0, h, hk, total, mask_from, shift, T, qk_scale2,
                            D, BM, BN, NS, VEC_TMA, SYNC, WS, num_warps)),
                (_dq_producer, (q_desc, do_desc, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                                q_s, do_s, k_s, v_s, kT_s, sk_s, sv_s, ready, rel, q_bar,
                                start, pstart, m0, h, hk, total)),
            ], [1], [PRODUCER_REGS])
        else:
            for pi in gl.static_range(NS - 1):
                _issue_kv(pi, start, pstart, hk, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                          k_s, v_s, kT_s, sk_s, sv_s, ready, pi < total, D, BN, NS, VEC_TMA)
            accs = _dq_loop(k_desc, v_desc, kT_desc, sk_desc, sv_desc, q_s, do_s, k_s, v_s,
                            kT_s, sk_s, sv_s, ready, rel, q_bar, lse, delta, sq, sk, sv, start,
                            pstart, L_doc, m0, h, hk, total, mask_from, shift, T, qk_scale2,
                            D, BM, BN, NS, VEC_TMA, SYNC, WS, num_warps)
        acc0, acc1 = accs
        _invalidate_barriers(ready, q_bar, rel, NS, WS)

        # --- epilogue: * sdo_i * sm_scale (sdo_i moved out of the row scales), rotate, cast ---
        m_idx = m0 + gl.arange(0, BM, layout=ROW)
        m_ok = m_idx < L_doc
        f = gl.load(sdo + h * T + start + m_idx, mask=m_ok, other=0.0) * sm_scale
        acc0 = acc0 * gl.expand_dims(f, 1)
        acc1 = acc1 * gl.expand_dims(f, 1)
        row_off = (start + m_idx) * stride_dqt + h * D
        _store_out(acc0, acc1, hmat, dq, m_ok, row_off, out_scale, ROTATE, D, BM, NCH, L, num_warps)


    # ------------------------------------------------------------------------------------------
    # Persistent dQ (GluonDqConfig.persistent = CTAs per SM; _dq_fp8_persistent_kernel). Batches
    # of short documents pay, per one-item program, a chain of dependent latencies (cu_seqlens ->
    # q8 / do8 and the first kv tiles by TMA -> ... -> the epilogue's rotation and stores) with
    # the tensor cores idle in between: doc512_x64 spends about half of its dQ time outside
    # the tile loop (benchmarks/NOTES.md, session 11). Here each CTA walks work indices
    # w = pid, pid + G, ... of the forward's work list (w = item * HQ + head: flamia.ops.schedule,
    # heaviest first) with a 1-warp TMA producer that runs ahead across item boundaries:
    #   - kv ring over the CTA-wide tile sequence g = 0, 1, ...: tile g in slot g % NS, loaded
    #     after the consumer's release of tile g - NS (the dQ ws protocol, _release_slot);
    #   - q8_i / do8_i in QBUF buffers: item `it`'s pair in buffer it % QBUF, loaded after the
    #     consumer's q_free arrival for item it - QBUF (every S / dP wgmma of it done). The
    #     default QBUF = 1 (room for 3 ring stages at 2 CTAs per SM) still loads the next pair
    #     during this item's epilogue;
    #   - the consumer reads the next item's work-list entry and query vectors one item ahead
    #     (loop-carried), and the Hadamard tile of the rotate-back once per CTA.
    # Per tile the numerics are _dq_loop's, op for op: results expected bitwise equal.
    # ------------------------------------------------------------------------------------------

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
                                 sk_desc, sv_desc, k_s, v_s, kT_s, sk_s, sv_s, ready, True, D,
                                 True)
                    g += 1
                it += 1

    @gluon.jit
    def _dq_pers_consumer(q_s, do_s, k_s, v_s, kT_s, sk_s, sv_s, h_s, ready, rel, q_ready,
                          q_free, ITEMS, N_ITEMS, HQ, GROUP, W, lse, delta, sq, sdo, sk,
                          sv, dq, T, stride_dqt, sm_scale, qk_scale2, out_scale,
                          D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                          NS: gl.constexpr, QBUF: gl.constexpr, CAUSAL: gl.constexpr,
                          ROTATE: gl.constexpr, num_warps: gl.constexpr,
                          DIAG: gl.constexpr = 0):
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
                    s_tok = _mma(qs, k_s.index(s).permute((1, 0)), zero, False)
                    dp_tok = _mma(dos, v_s.index(s).permute((1, 0)), zero, False)
                    if end:   # once per item: kT8 columns past the document end
                        _zero_tail_cols(kTs, j0, c_L, D, BN, num_warps)
                        fence_async_shared()
                        gl.thread_barrier()
                    acc0, acc1 = _dq_tile_update(s_tok, dp_tok, kTs, s, sk_s, sv_s, sk, sv, c_hk,
                                                 T, c_start, n_idx, c_L, c_m_idx, shift,
                                                 need_mask, c_rowf, c_lse2, c_dl, acc0, acc1,
                                                 zero, NCH, COL, AOP, True, False, DIAG)
                    _release_slot(rel, s)   # (its barrier: every S / dP of the item waited too)
                    g += 1
                # q8_i / do8_i are read: the buffer may take item it + QBUF
                mbarrier.arrive(q_free.index(qb), count=1)
                m_idx, m_ok, lse2, rowf, dl_i, f = _dq_item_rows(lse, sq, delta, sdo, h, T,
                                                                 start, blk, L_doc, sm_scale,
                                                                 qk_scale2, BM, ROW)
                # --- epilogue: * sdo_i * sm_scale, rotate back, cast (as _dq_fp8_kernel's) ---
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
        lse, delta, sq, sdo, sk, sv, dq, hmat, ITEMS, pcu,
        T, stride_dqt, sm_scale, qk_scale2, out_scale, N_ITEMS,
        HQ, HKV, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
        QBUF: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr, DIAG: gl.constexpr = 0,
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
        sk_s = _vec_ring(sk_desc, k_s, NS, BN, True)
        sv_s = _vec_ring(sv_desc, k_s, NS, BN, True)
        if ROTATE:   # H_64 once per CTA (the one-item kernels load it in every epilogue)
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
                                 sq, sdo, sk, sv, dq, T, stride_dqt, sm_scale, qk_scale2,
                                 out_scale, D, BM, BN, NS, QBUF, CAUSAL, ROTATE, num_warps,
                                 DIAG)),
            (_dq_pers_producer, (q_desc, do_desc, k_desc, v_desc, kT_desc, sk_desc, sv_desc,
                                 q_s, do_s, k_s, v_s, kT_s, sk_s, sv_s, ready, rel, q_ready,
                                 q_free, ITEMS, N_ITEMS, HQ, GROUP, W, pcu, CAUSAL)),
        ], [1], [PRODUCER_REGS])
        for i in gl.static_range(QBUF):
            mbarrier.invalidate(q_ready.index(i))
            mbarrier.invalidate(q_free.index(i))
        _invalidate_barriers(ready, once, rel, NS, True)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

def padded_vectors(st):
    """lse, Delta, sq, sdo as (Hq, Tp) fp32 in the padded per-document layout of the K-major
    copies (column c holds token st.tok_of_col[c]; pad columns: lse +inf, the others 0), so a
    tile's (1, BM) box starts at column pstart + i0, a multiple of 16 (TMA's 16-byte rule for
    the innermost coordinate), and the row stride Tp * 4 bytes is a multiple of 16 too.
    4 gathers of Hq x Tp floats (a few MB at 32k tokens); production would write these from
    launch_preprocess directly."""
    toc = st.tok_of_col.long()
    pad = toc < 0
    idx = toc.clamp(min=0)
    out = []
    for x, fill in ((st.lse, float("inf")), (st.delta, 0.0), (st.sq, 0.0), (st.sdo, 0.0)):
        y = x.float().index_select(1, idx)
        y.masked_fill_(pad, fill)
        out.append(y)
    return tuple(out)


def padded_vectors_triton(st):
    """padded_vectors(st) by one Triton launch (flamia.ops.kmajor.padded_rows, in the columns'
    frame) instead of 4 index_select + masked_fill pairs: bitwise the same values, as views of
    one (4, Hq, Tp) fp32 buffer (each TMA-legal)."""
    from .kmajor import padded_rows
    return padded_rows((st.lse, st.delta, st.sq, st.sdo), st.tok_of_col, st.Tp, fill0_inf=True)


def _resolve_vecs(vecs, cfg, st, torch_fn, triton_fn):
    """The launchers' `vecs`: prebuilt tensors, or None / "torch" / "triton" to build them
    (None: the config's choice, cfg.vec_gather -> the Triton gather; the fp8_mixed configs
    have no vec_gather: torch)."""
    if vecs is None:
        vecs = "triton" if getattr(cfg, "vec_gather", False) else "torch"
    if isinstance(vecs, str):
        if vecs not in ("torch", "triton"):
            raise ValueError(f"vecs={vecs!r}: tensors, None, 'torch' or 'triton'")
        vecs = (triton_fn if vecs == "triton" else torch_fn)(st)
    return vecs


_DUMMY: dict = {}


def _dummy_vec(device, BM: int):
    """A (1, BM) fp32 tensor for the vector descriptors when vec_tma is off (never read)."""
    key = (str(device), BM)
    if key not in _DUMMY:
        _DUMMY[key] = torch.zeros(1, BM, dtype=torch.float32, device=device)
    return _DUMMY[key]


def check_tma_coords(st, cfg: GluonDkdvConfig | None = None) -> list[str]:
    """Host-side check (syncs) of what the kernel's TMA coordinates rely on; [] when fine.
    Innermost coordinates: h * D (fp8: D bytes), pstart + i0 (fp8: 16 | pstart; fp32 vectors:
    4 * pstart, so 4 | pstart) and the global strides / bases (16 bytes)."""
    cfg = cfg or default_gluon_config(st.D)
    bad = []
    pcu = st.pcu.tolist()
    if any(c % 16 for c in pcu):
        bad.append(f"pcu not 16-aligned: {[c for c in pcu if c % 16][:8]}")
    if st.Tp % 16:
        bad.append(f"Tp={st.Tp} not a multiple of 16")
    if (st.D * st.Hq) % 16 or st.D % 16:
        bad.append(f"D={st.D} / Hq*D not 16-byte multiples")
    for name in ("q8", "k8", "v8", "do8", "qT8", "doT8", "lse", "delta", "sq", "sdo"):
        x = getattr(st, name)
        if x.data_ptr() % 16:
            bad.append(f"{name} base not 16-byte aligned")
    if cfg.bm * 4 % 16 or cfg.bm % 16:
        bad.append(f"bm={cfg.bm}: box bytes not a multiple of 16")
    return bad


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int, dtype):
    """The shared layout of a (rows, cols) TMA box, memoized: building it is pure Python with
    validation (~10 us each, 16 descriptors per backward call; the host issues a short-document
    call about as fast as the GPU runs it, benchmarks/NOTES.md session 5). fp32 boxes (the
    padded vectors) unswizzled, so each row reads as a plain 1-D buffer."""
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
    """TMA descriptor over padded per-token fp32 vectors (H, Tp), (rows, cols) boxes, like
    forward_gluon's sk / sv boxes."""
    return GluonTensorDescriptor(x, list(x.shape), list(x.stride()), [rows, cols],
                                 _smem_layout(rows, cols, gl.float32))


def pack_vectors(vecs):
    """The padded (lse, Delta, sq, sdo), each (Hq, Tp), interleaved per head as one (Hq * 4, Tp)
    buffer: rows 4h .. 4h + 3 are head h's four vectors (GluonDkdvConfig.pack_vecs)."""
    return torch.stack(vecs, dim=1).reshape(-1, vecs[0].shape[1])


# --- launch pieces shared with backward_gluon_mixed -----------------------------------------------

def _check_state(st, recipe: int, what: str) -> None:
    """What every Gluon backward kernel needs of `st`; `what` names the kernel in messages."""
    if not HAVE_GLUON:
        raise RuntimeError("triton.experimental.gluon is not available")
    if st.recipe != recipe or st.dq_atomic:
        raise ValueError(f"the Gluon {what} kernel needs st.recipe == {recipe} (not "
                         f"{st.recipe}) and no dq_atomic")
    if st.D not in (64, 128):
        raise ValueError(f"the Gluon {what} kernel supports D in (64, 128), not {st.D}")


def _check_blocks(cfg, cta_rows: int, step_rows: int, what: str) -> None:
    """The block sizes every kernel assumes: a CTA's rows (dK/dV: bn keys, dQ: bm queries) one
    m64 wgmma row block per warpgroup, 64 rows per loop step (the chunk layout), a ring."""
    if step_rows != CH_ or cta_rows != 16 * cfg.num_warps or cfg.stages < 1:
        raise ValueError(f"unsupported Gluon {what} config {cfg}")


def _vec_descs(st, cfg, vecs, box: int, count: int, torch_fn, triton_fn) -> tuple:
    """TMA descriptors ((1, box) boxes) of the `count` padded per-row vectors: `vecs` resolved
    by _resolve_vecs with vec_tma, else dummies the kernel never reads."""
    if cfg.vec_tma:
        vecs = _resolve_vecs(vecs, cfg, st, torch_fn, triton_fn)
    else:
        vecs = (_dummy_vec(st.lse.device, box),) * count
    return tuple(vec_desc(x, box) for x in vecs)


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
                  CAUSAL=st.causal, ROTATE=st.rotate, VEC_TMA=cfg.vec_tma, SYNC=cfg.sync_mma,
                  num_warps=cfg.num_warps, **kwargs)
    return grid, args, kwargs


def _no_tokens(st, *outs) -> bool:
    """True (and `outs` zeroed) when there is nothing to launch for: no tokens / documents."""
    if st.T == 0 or st.n_docs == 0 or st.max_seqlen == 0:
        for x in outs:
            x.zero_()
        return True
    return False


# --- dK/dV ----------------------------------------------------------------------------------------

def _descs(st, cfg: GluonDkdvConfig, vecs=None):
    D, BM, BN = st.D, cfg.bm, cfg.bn
    f8 = gl.float8e4nv
    if cfg.pack_vecs:   # one descriptor, passed for all four vectors (the kernel reads rows)
        vec_descs = (vec_desc(_packed_query_vectors(st, cfg, vecs), BM, rows=4),) * 4
    else:
        if cfg.fold_sdo:
            vecs = fold_sdo(_resolve_vecs(vecs, cfg, st, padded_vectors, padded_vectors_triton))
        vec_descs = _vec_descs(st, cfg, vecs, BM, 4, padded_vectors, padded_vectors_triton)
    return (tok_major_desc(st.k8, BN, D, f8), tok_major_desc(st.v8, BN, D, f8),
            tok_major_desc(st.q8, BM, D, f8), tok_major_desc(st.do8, BM, D, f8),
            *(kmajor_desc(x, BM) for x in _qT_doT(st, cfg.key_order_dk, cfg.key_order_dv)),
            *vec_descs)


def _packed_query_vectors(st, cfg: GluonDkdvConfig, vecs=None):
    """The (Hq * 4, Tp) buffer of pack_vecs (lse folded with fold_sdo). vecs None or "triton":
    gathered, folded and interleaved by one Triton launch (kmajor.padded_rows; the call's
    default: one launch instead of ~12 small torch ops, which cost host time on short
    documents); "torch" or the four padded vectors: by torch ops (fold_sdo, pack_vectors),
    bitwise the same (tests/test_ops_kmajor.py)."""
    if vecs is None and st.query_vecs is not None and st.query_vecs[0] == cfg.fold_sdo:
        return st.query_vecs[1]     # gathered by launch_preprocess (vector_gathers)
    if vecs is None or (isinstance(vecs, str) and vecs == "triton"):
        # with the dQ kernel's padded sk / sv in the same launch (kept on the state for
        # padded_kv_vectors_triton): one launch less per call
        from .kmajor import padded_rows_two
        packed, st.kv_vecs = padded_rows_two(*vector_gathers(st, cfg.fold_sdo), st.tok_of_col,
                                             st.Tp)
        return packed
    vecs = _resolve_vecs(vecs, cfg, st, padded_vectors, padded_vectors_triton)
    return pack_vectors(fold_sdo(vecs) if cfg.fold_sdo else vecs)


def vector_gathers(st, fold: bool):
    """The padded_rows gathers (kmajor.padded_rows_two's a and b) of the fp8 kernels' per-token
    vectors: the dK/dV kernel's packed query vectors (lse, Delta, sq, sdo interleaved per head,
    lse folded with fold_sdo) and the dQ kernel's key vectors (sk, sv)."""
    return (dict(srcs=(st.lse, st.delta, st.sq, st.sdo), fill0_inf=True, interleave=True,
                 fold0=fold),
            dict(srcs=(st.sk, st.sv)))


def fold_sdo(vecs):
    """The padded (lse, Delta, sq, sdo) with lse replaced by lse * log2(e) - log2(sdo), the
    exponent offset of GluonDkdvConfig.fold_sdo (sdo is a power of two, so exp2 of the folded
    exponent is P * sdo up to the rounding of one fp32 add). Pad columns stay +inf (lse +inf,
    sdo 0); an out-of-document sdo of 0 gives +inf too (a = 0, as P * 0)."""
    lse, delta, sq, sdo = vecs
    return (lse * LOG2E - torch.log2(sdo), delta, sq, sdo)


def _args(st, cfg: GluonDkdvConfig, vecs=None):
    _check_state(st, 0, "fp8 dK/dV")
    _check_blocks(cfg, cfg.bn, cfg.bm, "fp8 dK/dV")
    if cfg.ws and ((cfg.bn, cfg.num_warps) != (128, 8) or not cfg.vec_tma or cfg.sync_mma
                   or not 24 <= cfg.producer_regs <= 256):
        raise ValueError(f"ws needs bn=128, num_warps=8 (two consumer warpgroups), vec_tma, "
                         f"async wgmma and producer_regs in [24, 256]: {cfg}")
    for x in (st.q8, st.k8, st.v8, st.do8, st.qT8, st.doT8, st.lse, st.delta, st.sq, st.sdo,
              st.sk, st.sv, st.dk, st.dv):
        assert x.is_contiguous()
    tensors = (st.lse, st.delta, st.sq, st.sdo, st.sk, st.sv, st.dk, st.dv)
    if (cfg.fold_sdo or cfg.pack_vecs) and not cfg.vec_tma:
        raise ValueError(f"fold_sdo and pack_vecs need vec_tma (padded vectors by TMA): {cfg}")
    return _launch_args(st, cfg, _descs(st, cfg, vecs), tensors, False, WS=cfg.ws,
                        PRODUCER_REGS=cfg.producer_regs, FOLD=cfg.fold_sdo,
                        SHARED_MASK=cfg.shared_mask, THR_MASK=cfg.threshold_mask,
                        LATE_DV=cfg.late_dv,
                        **({"KEY_ORDER_DV": True} if cfg.key_order_dv else {}),
                        **({"KEY_ORDER_DK": True} if cfg.key_order_dk else {}),
                        **({"DIAG": cfg.diag} if cfg.diag else {}))


def _qT_doT(st, q_key_order: bool, do_key_order: bool):
    """(qT8, doT8) in the column orders a dK/dV config reads (backward.qT_doT_in_order)."""
    from .backward import qT_doT_in_order
    return qT_doT_in_order(st, q_key_order, do_key_order)


def _check_dq_ws(cfg: GluonDqConfig) -> None:
    """The dQ kernel's opt-in warp-specialized schedule (constexpr WS of _dq_fp8_kernel): the
    option combinations it supports (the kernel's static_assert, as a ValueError here)."""
    if not cfg.ws:
        return
    if not cfg.vec_tma or cfg.sync_mma or cfg.num_warps != 4:
        raise ValueError(f"dQ ws needs vec_tma, async wgmma and one warpgroup (num_warps=4): "
                         f"{cfg}")
    if not 24 <= cfg.producer_regs <= 256:
        raise ValueError(f"producer_regs {cfg.producer_regs} out of range: {cfg}")


def _with_env_diag(cfg):
    """The default config, or with FLAMIA_BWD_DIAG=1 its timing diagnostic (WRONG results: the
    GEMMs with almost no element-wise work between them; GluonDkdvConfig.diag, GluonDqConfig.diag).
    For what-if timings of the public call in one process (benchmarks/graph_timing.py
    fp8@FLAMIA_BWD_DIAG=1), as FLAMIA_FWD_DIAG for the forward."""
    diag = os.environ.get("FLAMIA_BWD_DIAG")
    return dataclasses.replace(cfg, diag=int(diag)) if diag else cfg


def launch_dkdv_gluon(st, config: GluonDkdvConfig | None = None, vecs=None) -> None:
    """dK, dV of the fp8 recipe into st.dk / st.dv (same contract as backward.launch_dkdv).
    `st` from backward.make_state + backward.launch_preprocess, on an sm_90a GPU. `vecs`:
    padded_vectors(st) when the caller already has them (else built here if vec_tma: by torch,
    or with vecs="triton" / config.vec_gather by one Triton launch, padded_vectors_triton)."""
    cfg = config or _with_env_diag(default_gluon_config(st.D))
    if _no_tokens(st, st.dk, st.dv):
        return
    grid, args, kwargs = _args(st, cfg, vecs)
    _dkdv_fp8_kernel[grid](*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# dQ launcher
# ----------------------------------------------------------------------------------------------
# dQ (`launch_dq_gluon`, the fp8 default of backward.launch_dq on sm_90): `backward._bwd_dq` /
# `_dq_tile` for RECIPE == 0 with the same ingredients. Per (document, query head, query block
# of BM = 64 rows) item -- one program each in _dq_fp8_kernel (plain_dq_config: the last block
# first; GluonDqConfig.bm = 128: two warpgroups sharing each kv tile), or, the default, the
# persistent _dq_fp8_persistent_kernel walking the forward's work list (comment above it) --
# one warpgroup loops over the kv blocks j0 = 0, BN, .. (j <= i causal):
#
#     S  = (q8_i k8_j^T) * sk_j * rowf_i              rowf_i = sq_i * sm_scale * log2(e)
#     P  = exp2(S - lse2_i)
#     t  = (do8_i v8_j^T) * sv_j - Delta_i             (Delta in units of sdo_i)
#     b  = P t sk_j                                    masked (where) on diagonal / end tiles
#     dQ_i += c_i * (e4m3(b / c_i) @ kT8_j)            c_i = _pow2_scale(max_j |b|) over the tile
#     epilogue: dQ_i * sdo_i * sm_scale, rotate back, cast
#
# q8_i / do8_i come once by TMA (A operands of S / dP from shared memory); an NS-stage TMA ring
# brings k8_j, v8_j (token-major, B operands of S / dP), kT8_j (K-major, padded columns, B operand
# of the dQ GEMM) and sk_j / sv_j as (1, BN) boxes of (Hkv, Tp) padded copies (`padded_kv_vectors`,
# same 16-byte rule as above). BN = 64 = the Triton kernel's, so the per-row scales c_i are over the
# same key subsets. The per-query lse / Delta / sq / sdo are plain masked loads, once per program.
# The end tile (keys past the document end, the next document's bytes) gets kT8's out-of-document
# columns zeroed in shared memory and b masked with `where`; rows past the end only reach their own
# (unstored) rows of dQ.
#
# Importable without a GPU; `compile_sm90` / `compile_dq_sm90` build the kernels for sm_90a on a
# CPU-only machine (benchmarks/bwd_gluon_dev.py --cpu-smoke [--kernel dq],
# tests/test_ops_backward_gluon.py).


def padded_kv_vectors(st):
    """sk, sv as (Hkv, Tp) fp32 in the padded per-document column layout (pads 0), so the dQ
    kernel's (1, BN) boxes start at the 16-aligned column pcu[doc] + j0 (the packed (Hkv, T)
    vectors' hk * T + start + j0 is not TMA-legal). 2 gathers of Hkv x Tp floats; production
    would have the quantization write them padded."""
    toc = st.tok_of_col.long()
    pad = toc < 0
    idx = toc.clamp(min=0)
    out = []
    for x in (st.sk, st.sv):
        y = x.float().index_select(1, idx)
        y.masked_fill_(pad, 0.0)
        out.append(y)
    return tuple(out)


def padded_kv_vectors_triton(st):
    """padded_kv_vectors(st) by one Triton launch (kmajor.padded_rows), or the ones the dK/dV
    launch gathered with its query vectors (_packed_query_vectors): bitwise the same."""
    if st.kv_vecs is not None:
        return st.kv_vecs
    from .kmajor import padded_rows
    return padded_rows((st.sk, st.sv), st.tok_of_col, st.Tp)


def check_tma_coords_dq(st, cfg: GluonDqConfig | None = None) -> list[str]:
    """As check_tma_coords, for what the dQ kernel's TMA coordinates rely on; [] when fine."""
    cfg = cfg or default_dq_config(st.D)
    bad = []
    pcu = st.pcu.tolist()
    if any(c % 16 for c in pcu):
        bad.append(f"pcu not 16-aligned: {[c for c in pcu if c % 16][:8]}")
    if st.Tp % 16:
        bad.append(f"Tp={st.Tp} not a multiple of 16")
    if (st.D * st.Hq) % 16 or (st.D * st.Hkv) % 16:
        bad.append(f"D={st.D}: Hq*D / Hkv*D not 16-byte multiples")
    for name in ("q8", "k8", "v8", "do8", "kT8"):
        if getattr(st, name).data_ptr() % 16:
            bad.append(f"{name} base not 16-byte aligned")
    if cfg.bn % 16:
        bad.append(f"bn={cfg.bn}: box bytes not a multiple of 16")
    return bad


def _dq_descs(st, cfg: GluonDqConfig, vecs=None):
    D, BM, BN = st.D, cfg.bm, cfg.bn
    f8 = gl.float8e4nv
    return (tok_major_desc(st.q8, BM, D, f8), tok_major_desc(st.do8, BM, D, f8),
            tok_major_desc(st.k8, BN, D, f8), tok_major_desc(st.v8, BN, D, f8),
            kmajor_desc(st.kT8, BN),
            *_vec_descs(st, cfg, vecs, BN, 2, padded_kv_vectors, padded_kv_vectors_triton))


def _dq_args(st, cfg: GluonDqConfig, vecs=None):
    _check_state(st, 0, "fp8 dQ")
    _check_blocks(cfg, cfg.bm, cfg.bn, "fp8 dQ")
    for x in (st.q8, st.k8, st.v8, st.do8, st.kT8, st.lse, st.delta, st.sq, st.sdo, st.sk,
              st.sv, st.dq):
        assert x.is_contiguous()
    tensors = (st.lse, st.delta, st.sq, st.sdo, st.sk, st.sv, st.dq)
    grid, args, kwargs = _launch_args(st, cfg, _dq_descs(st, cfg, vecs), tensors, True,
                                      WS=cfg.ws, PRODUCER_REGS=cfg.producer_regs)
    _check_dq_ws(cfg)
    if cfg.maxnreg:
        kwargs["maxnreg"] = cfg.maxnreg
    if cfg.persistent:
        grid, args, kwargs = _persistent_dq_args(st, cfg, args, kwargs)
    elif cfg.diag:
        raise ValueError(f"the dQ timing diagnostic (diag) exists in the persistent kernel only: "
                         f"{cfg}")
    return grid, args, kwargs


def _persistent_dq_args(st, cfg: GluonDqConfig, args, kwargs):
    """_dq_args of the one-item kernel rewritten for _dq_fp8_persistent_kernel: the work list
    (memoized per cu_seqlens, like the forward's) instead of cu, a grid of `persistent` CTAs
    per SM."""
    from .schedule import persistent_grid, work_list
    if not cfg.ws or cfg.num_warps != 4 or cfg.qbuf not in (1, 2):
        raise ValueError(f"persistent dQ needs ws, one consumer warpgroup and qbuf 1 or 2: {cfg}")
    sched = work_list(st.cu, st.T, cfg.bm, cfg.bn, st.causal)
    n_items = sched.items.shape[1]
    grid = persistent_grid(n_items * st.Hq, cfg.persistent, st.dq.device)
    # (descriptors, tensors, hmat, cu, pcu, scalars): the work list in cu's place, its length last
    i_cu = next(i for i, a in enumerate(args) if a is st.cu)
    args = (*args[:i_cu], sched.items, *args[i_cu + 1:], n_items)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("VEC_TMA", "SYNC", "WS")}
    kwargs["QBUF"] = cfg.qbuf
    if cfg.diag:
        kwargs["DIAG"] = cfg.diag
    return grid, args, kwargs


def _dq_kernel(cfg: GluonDqConfig):
    return _dq_fp8_persistent_kernel if cfg.persistent else _dq_fp8_kernel


def launch_dq_gluon(st, config: GluonDqConfig | None = None, vecs=None) -> None:
    """dQ of the fp8 recipe into st.dq (same contract as backward.launch_dq without dq_atomic:
    * sdo_i * sm_scale, Hadamard rotate-back when st.rotate, cast to st.dq's dtype). `st` from
    backward.make_state + backward.launch_preprocess (kT8 needed), on an sm_90a GPU. `vecs`:
    padded_kv_vectors(st) when the caller already has them (else built here if vec_tma: by torch,
    or with vecs="triton" / config.vec_gather by one Triton launch, padded_kv_vectors_triton)."""
    cfg = config or _with_env_diag(default_dq_config(st.D))
    if _no_tokens(st, st.dq):
        return
    grid, args, kwargs = _dq_args(st, cfg, vecs)
    _dq_kernel(cfg)[grid](*args, **kwargs)
