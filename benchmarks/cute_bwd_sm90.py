"""Spike: the one-pass Hopper backward (bf16 recipe) in CuTe DSL, next to the Gluon kernel.

Why: flamia's bf16 backward sits at 0.85-0.89x of FA4's on long documents (issue 26's skeleton
gate is 0.95x), and Triton 3.6's Gluon cannot express what the next factor needs (2-CTA
clusters: Q / dO multicast, dQ tiles of two key blocks added on chip). CuTe DSL can; it also has
per-warp mbarrier arrivals and non-blocking named-barrier arrives, so the warpgroups meet once
per step instead of Gluon's four. Measured so far (benchmarks/NOTES.md, tenth and fifteenth
sessions): that alone does not close the gap to FA4, and the 2-CTA cluster that adds two key
blocks' dQ tiles on chip loses to this kernel without it (5b35eac keeps its pair mode). This
is the same algorithm as flamia.ops.backward_sm90._attn_bwd_sm90_kernel (its work list, padded
dQ rows, preprocess and post pass are reused), written as a CuTe DSL kernel:

  CTA = one key block (BN=128 keys of one document) of one KV head, all query heads of its GQA
  group, query blocks of BM=64 rows; 384 threads: warp 0 loads (TMA), warp 1 writes dQ
  (TMA reduce-add into the fp32 buffer, zeroed by the caller), warpgroups 1-2 compute (keys 0-63
  and 64-127 of every key-major GEMM; dQ's columns split between them).
  Per step: S^T = K Q^T, dP^T = V dO^T (SS), P^T = exp2(S^T c - lse2), dS^T = P^T (dP^T - delta),
  dV += P^T dO and dK += dS^T Q (A from registers), dQ = dS K (dS^T through shared memory).

Compile-only on a CPU (no GPU needed):
    /tmp/cute/bin/python benchmarks/cute_bwd_sm90.py --compile
and its innermost wgmma loop's SASS (every branch; the Gluon kernel's: bwd_sm90_compile.py --sass):
    python benchmarks/tools/ptx_sass.py /tmp/cute_bwd_dump/*.ptx
On a GPU: checks dQ / dK / dV against the library's Gluon bf16 kernel and times both:
    python benchmarks/cute_bwd_sm90.py --check --time
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import from_dlpack
import cutlass.utils.hopper_helpers as sm90_utils

BM, BN, D = 64, 128, 128
STAGES = 2
THREADS = 384
MMA_THREADS = 256
PRODUCER_REGS, MMA_REGS = 24, 240
# named barriers (0 is __syncthreads)
BAR_DS = 1                 # dS^T stored by both MMA warpgroups
BAR_DQ_FULL = 2            # + b: dQ buffer b written (MMA threads arrive, the writer waits)
BAR_DQ_EMPTY = 4           # + b: dQ buffer b read by TMA (the writer arrives, MMA threads wait)


@cute.jit
def _zero_rows(s: cute.Tensor, first: Int32, tidx: Int32, nthreads: cutlass.Constexpr):
    """Rows >= first of the shared (R, C) tile s set to zero (TMA brought them from the next
    document), by nthreads threads; the caller fences and synchronizes."""
    R, C = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    for i in cutlass.range(tidx, R * C, nthreads):
        r = i // C
        if r >= first:
            s[r, i % C] = s.element_type(0)


class BwdSm90Cute:
    def __init__(self, group: int, causal: bool = True):
        self.group = group
        self.causal = causal

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mItems: cute.Tensor, mSem: cute.Tensor, n_items: Int32,
                 qblocks: Int32, scale_log2: Float32, scale: Float32, stream):
        dt = BFloat16
        k_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            cute.nvgpu.warpgroup.SmemLayoutAtomKind.K_SW128, dt)
        mn_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            cute.nvgpu.warpgroup.SmemLayoutAtomKind.MN_SW128, dt)
        sQ_layout = cute.tile_to_shape(k_atom, (BM, D, STAGES), order=(0, 1, 2))
        sK_layout = cute.tile_to_shape(k_atom, (BN, D), order=(0, 1))
        sdS_layout = cute.tile_to_shape(mn_atom, (BM, BN, STAGES), order=(1, 0, 2))  # A of dQ
        # dQ tiles: 128-byte swizzled (64 x 32 fp32 atoms; four TMA boxes per tile), so that the
        # accumulator's 8-byte stores (8 rows x 4 column pairs per warp) do not bank-conflict
        f32_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            cute.nvgpu.warpgroup.SmemLayoutAtomKind.K_SW128, Float32)
        sdQ_layout = cute.tile_to_shape(f32_atom, (BM, D, 2), order=(0, 1, 2))
        sVec_layout = cute.make_layout((1, BM, STAGES), stride=(BM, 1, BM))

        tma_q, tQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, cute.select(sQ_layout, mode=[0, 1]), (BM, D))
        tma_do, tdO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mdO, cute.select(sQ_layout, mode=[0, 1]), (BM, D))
        tma_k, tK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, sK_layout, (BN, D))
        tma_v, tV = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, sK_layout, (BN, D))
        tma_lse, tLSE = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mLSE, cute.select(sVec_layout, mode=[0, 1]),
            (1, BM))
        tma_dl, tDelta = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mDelta, cute.select(sVec_layout, mode=[0, 1]),
            (1, BM))
        tma_dqs, _ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mdQ, cute.select(sdQ_layout, mode=[0, 1]), (BM, D))
        tma_dq, tdQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQ, cute.select(sdQ_layout, mode=[0, 1]),
            (BM, D))

        mma_s, mma_kv, mma_dq = _tiled_mmas()

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, 1 + 3 * STAGES]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, BM * STAGES], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, BM * STAGES], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        self.kernel(tma_q, tQ, tma_do, tdO, tma_k, tK, tma_v, tV, tma_lse, tLSE, tma_dl, tDelta,
                    tma_dq, tma_dqs, tdQ, mdK, mdV, mItems, mSem, n_items, qblocks, scale_log2,
                    scale, sQ_layout,
                    sK_layout, sdS_layout, sdQ_layout, sVec_layout, mma_s, mma_kv, mma_dq,
                    Storage).launch(grid=[n_items, 1, 1], block=[THREADS, 1, 1],
                                    smem=Storage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, tQ: cute.Tensor, tma_do: cute.CopyAtom,
               tdO: cute.Tensor, tma_k: cute.CopyAtom, tK: cute.Tensor, tma_v: cute.CopyAtom,
               tV: cute.Tensor, tma_lse: cute.CopyAtom, tLSE: cute.Tensor,
               tma_dl: cute.CopyAtom, tDelta: cute.Tensor, tma_dq: cute.CopyAtom,
               tma_dqs: cute.CopyAtom,
               tdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mItems: cute.Tensor,
               mSem: cute.Tensor, n_items: Int32, qblocks: Int32, scale_log2: Float32,
               scale: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sdQ_layout: cute.ComposedLayout,
               sVec_layout: cute.Layout, mma_s: cute.TiledMma, mma_kv: cute.TiledMma,
               mma_dq: cute.TiledMma, Storage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        item = cute.arch.block_idx()[0]
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        bars = st.bars.data_ptr()
        kv_ready = bars
        q_ready = bars + 1                   # + s: Q, lse2 (and dO, delta) of stage s landed
        q_free = bars + 1 + STAGES           # + s: stage s read by both warpgroups (8 warps)
        do_ready = bars + 1 + 2 * STAGES
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(kv_ready, 1)
                for s in cutlass.range_constexpr(STAGES):
                    cute.arch.mbarrier_init(q_ready + s, 1)
                    cute.arch.mbarrier_init(do_ready + s, 1)
                    cute.arch.mbarrier_init(q_free + s, 8)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = st.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = st.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sdS = st.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = st.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        sLSE = st.sLSE.get_tensor(sVec_layout)
        sDelta = st.sDelta.get_tensor(sVec_layout)

        doc = mItems[0, item]
        blk = mItems[1, item]
        start = mItems[2, item]
        L = mItems[3, item]
        pq = mItems[4, item]
        kvh = mItems[5, item]
        k0 = blk * BN
        m_lo = Int32(0)
        if const_expr(self.causal):
            m_lo = k0 // BM
        n_m = (L + BM - 1) // BM - m_lo
        n_steps = n_m * self.group
        if doc < 0:
            n_steps = Int32(0)

        if warp < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0 and doc >= 0:
                self.load(tma_q, tQ, tma_do, tdO, tma_k, tK, tma_v, tV, tma_lse, tLSE, tma_dl,
                          tDelta, sQ, sdO, sK, sV, sLSE, sDelta, kv_ready, q_ready, do_ready,
                          q_free, start, k0, kvh, pq, m_lo, n_m, n_steps)
            if warp == 1 and doc >= 0:
                self.write_dq(tma_dq, tma_dqs, tdQ, sdQ, mSem, qblocks, start, pq, kvh, m_lo,
                              n_m, n_steps)
        else:
            cute.arch.setmaxregister_increase(MMA_REGS)
            self.compute(mma_s, mma_kv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, sLSE, sDelta,
                         mdK, mdV, kv_ready, q_ready, do_ready, q_free, tidx - 128, doc, start,
                         L, k0, kvh, m_lo, n_m, n_steps, scale_log2, scale)

    @cute.jit
    def load(self, tma_q, tQ, tma_do, tdO, tma_k, tK, tma_v, tV, tma_lse, tLSE, tma_dl, tDelta,
             sQ, sdO, sK, sV, sLSE, sDelta, kv_ready, q_ready, do_ready, q_free, start, k0, kvh,
             pq, m_lo, n_m, n_steps):
        one = cute.make_layout(1)
        # K / V of the CTA's key block: box at (start + k0, kvh * D)
        gK = cute.local_tile(cute.domain_offset((start + k0, kvh * D), tK), (BN, D), (0, 0))
        gV = cute.local_tile(cute.domain_offset((start + k0, kvh * D), tV), (BN, D), (0, 0))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2),
                                         cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2),
                                         cute.group_modes(gV, 0, 2))
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(kv_ready, 2 * BN * D * 2)
        cute.copy(tma_k, tKg, tKs, tma_bar_ptr=kv_ready)
        cute.copy(tma_v, tVg, tVs, tma_bar_ptr=kv_ready)
        h = kvh * self.group
        q0 = m_lo * BM
        for i in cutlass.range(n_steps, unroll=1):
            s = i % STAGES
            if i >= STAGES:
                cute.arch.mbarrier_wait(q_free + s, ((i // STAGES) + 1) % 2)
            gQ = cute.local_tile(cute.domain_offset((start + q0, h * D), tQ), (BM, D), (0, 0))
            gdO = cute.local_tile(cute.domain_offset((start + q0, h * D), tdO), (BM, D), (0, 0))
            gL = cute.local_tile(cute.domain_offset((h, pq + q0), tLSE), (1, BM), (0, 0))
            gDl = cute.local_tile(cute.domain_offset((h, pq + q0), tDelta), (1, BM), (0, 0))
            tQs, tQg = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ[None, None, s], 0, 2),
                                             cute.group_modes(gQ, 0, 2))
            tOs, tOg = cpasync.tma_partition(tma_do, 0, one,
                                             cute.group_modes(sdO[None, None, s], 0, 2),
                                             cute.group_modes(gdO, 0, 2))
            tLs, tLg = cpasync.tma_partition(tma_lse, 0, one,
                                             cute.group_modes(sLSE[None, None, s], 0, 2),
                                             cute.group_modes(gL, 0, 2))
            tDs, tDg = cpasync.tma_partition(tma_dl, 0, one,
                                             cute.group_modes(sDelta[None, None, s], 0, 2),
                                             cute.group_modes(gDl, 0, 2))
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(q_ready + s, BM * D * 2 + BM * 4)
            cute.copy(tma_q, tQg, tQs, tma_bar_ptr=q_ready + s)
            cute.copy(tma_lse, tLg, tLs, tma_bar_ptr=q_ready + s)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(do_ready + s, BM * D * 2 + BM * 4)
            cute.copy(tma_do, tOg, tOs, tma_bar_ptr=do_ready + s)
            cute.copy(tma_dl, tDg, tDs, tma_bar_ptr=do_ready + s)
            h, q0 = _next_step(h, q0, m_lo, n_m)

    @cute.jit
    def write_dq(self, tma_dq, tma_dqs, tdQ, sdQ, mSem, qblocks, start, pq, kvh, m_lo, n_m,
                 n_steps):
        """Each step's dQ tile into the fp32 buffer, which nobody zeroes: the first tile to reach
        a (query head, query block) is stored, every later one reduce-added once that store has
        landed (mSem[head, block]: 0 -> 1 by compare-and-swap, the winner stores and sets 2 when
        its write has landed; the others wait for 2, which waits only on an issued store), as
        the Gluon kernel's writer does by default."""
        one = cute.make_layout(1)
        lane = cute.arch.lane_idx()
        h = kvh * self.group
        q0 = m_lo * BM
        for i in cutlass.range(n_steps, unroll=1):
            b = i % 2
            cute.arch.barrier(barrier_id=BAR_DQ_FULL + b, number_of_threads=MMA_THREADS + 32)
            gdQ = cute.local_tile(cute.domain_offset((pq + q0, h * D), tdQ), (BM, D), (0, 0))
            tSs, tGg = cpasync.tma_partition(tma_dq, 0, one,
                                             cute.group_modes(sdQ[None, None, b], 0, 2),
                                             cute.group_modes(gdQ, 0, 2))
            sem = mSem.iterator + (h * qblocks + (pq + q0) // BM)
            state = Int32(0)
            if lane == 0:
                state = cute.arch.atomic_cas(sem, cmp=Int32(0), val=Int32(1), sem="acquire",
                                             scope="gpu")
                while state == 1:
                    state = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
            state = cute.arch.shuffle_sync(state, 0)
            cute.arch.fence_proxy("async.global")
            if state == 0:
                cute.copy(tma_dqs, tSs, tGg)     # (one elected lane issues each copy)
            else:
                cute.copy(tma_dq, tSs, tGg)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if i + 2 < n_steps:                  # the MMA threads wait before steps 2..
                cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY + b,
                                         number_of_threads=MMA_THREADS + 32)
            if state == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                cute.arch.fence_proxy("async.global")
                if lane == 0:
                    cute.arch.atomic_exch(sem, Int32(2), sem="release", scope="gpu")
            h, q0 = _next_step(h, q0, m_lo, n_m)
        cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def compute(self, mma_s, mma_kv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, sLSE, sDelta, mdK, mdV,
                kv_ready, q_ready, do_ready, q_free, tidx, doc, start, L, k0, kvh, m_lo, n_m,
                n_steps, scale_log2, scale):
        thr_s = mma_s.get_slice(tidx)
        thr_kv = mma_kv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        # shared-memory operands partitioned by the (warp-uniform) warpgroup, not the thread: the
        # wgmma descriptors are then uniform values (no per-thread R2UR per wgmma)
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_s = mma_s.get_slice(wg * 128)
        wg_kv = mma_kv.get_slice(wg * 128)
        wg_dq = mma_dq.get_slice(wg * 128)
        # S^T = K Q^T and dP^T = V dO^T: A = K / V (BN, D), B = Q / dO (BM, D), both K-major
        tSrK = mma_s.make_fragment_A(wg_s.partition_A(sK))
        tSrV = mma_s.make_fragment_A(wg_s.partition_A(sV))
        tSrQ = mma_s.make_fragment_B(wg_s.partition_B(sQ))
        tSrdO = mma_s.make_fragment_B(wg_s.partition_B(sdO))
        # dV += P^T dO, dK += dS^T Q: B = dO / Q seen as (D, BM) (N-major)
        sQt = cute.make_tensor(sQ.iterator, cute.select(sQ.layout, mode=[1, 0, 2]))
        sdOt = cute.make_tensor(sdO.iterator, cute.select(sdO.layout, mode=[1, 0, 2]))
        tKVrQt = mma_kv.make_fragment_B(wg_kv.partition_B(sQt))
        tKVrdOt = mma_kv.make_fragment_B(wg_kv.partition_B(sdOt))
        # dQ = dS K: A = dS (BM, BN) M-major, B = K seen as (D, BN) (N-major)
        sKt = cute.make_tensor(sK.iterator, cute.select(sK.layout, mode=[1, 0]))
        tQrdS = mma_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tQrKt = mma_dq.make_fragment_B(wg_dq.partition_B(sKt))
        # dS^T stored through the transposed view of sdS, partitioned like S^T
        sdSt = cute.make_tensor(sdS.iterator, cute.select(sdS.layout, mode=[1, 0, 2]))
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16), mma_s)
        thr_r2s = r2s.get_slice(tidx)
        tSsdSt = thr_r2s.partition_D(sdSt)          # dS^T by stmatrix (8 x 8 bf16 blocks)
        tQsdQ = thr_dq.partition_C(sdQ)
        # coordinates (key, query) of the S^T accumulator elements
        cS = thr_s.partition_C(cute.make_identity_tensor((BN, BM)))

        acc_dk = cute.make_rmem_tensor(thr_kv.partition_shape_C((BN, D)), Float32)
        acc_dv = cute.make_rmem_tensor(thr_kv.partition_shape_C((BN, D)), Float32)
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((BN, BM)), Float32)
        acc_dp = cute.make_rmem_tensor(thr_s.partition_shape_C((BN, BM)), Float32)
        acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C((BM, D)), Float32)
        # P^T / dS^T as A operands of dV / dK: the accumulator's values in the same order
        frgA = cute.make_layout(((2, 2, 2), 1, BM // 16), stride=((1, 2, 4), 0, 8))
        rP = cute.make_rmem_tensor(cute.size(acc_s), BFloat16)
        rdS = cute.make_rmem_tensor(cute.size(acc_s), BFloat16)
        tKVrP = cute.make_tensor(rP.iterator, frgA)
        tKVrdS = cute.make_tensor(rdS.iterator, frgA)
        tSrdS = thr_r2s.retile(cute.make_tensor(rdS.iterator, acc_s.layout))

        frags = (mma_s, mma_kv, mma_dq, sQ, sdO, sLSE, sDelta, tSrK, tSrV, tSrQ, tSrdO,
                 tKVrQt, tKVrdOt, tQrdS, tQrKt, tSsdSt, tQsdQ, cS, acc_s, acc_dp, acc_dq, acc_dk,
                 acc_dv, rP, rdS, tKVrP, tKVrdS, tSrdS, r2s, q_ready, do_ready, q_free, tidx, L, k0,
                 m_lo, n_m, scale_log2)
        if n_steps > 0:
            cute.arch.mbarrier_wait(kv_ready, 0)
            if k0 + BN > L:
                _zero_rows(sK, L - k0, tidx, MMA_THREADS)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=BAR_DS, number_of_threads=MMA_THREADS)
            # steps in pairs, so that the stage (and the dQ buffer) is a compile-time constant in
            # every shared-memory address and wgmma descriptor
            q0 = m_lo * BM
            for j in cutlass.range(n_steps // 2, unroll=1):
                q0 = self.step(0, 2 * j, j % 2, q0, *frags)
                q0 = self.step(1, 2 * j + 1, j % 2, q0, *frags)
            if n_steps % 2 == 1:
                q0 = self.step(0, n_steps - 1, (n_steps // 2) % 2, q0, *frags)
            # epilogue: dK (times the softmax scale) and dV of the keys inside the document
            gdK = cute.local_tile(cute.domain_offset((start + k0, kvh * D), mdK), (BN, D), (0, 0))
            gdV = cute.local_tile(cute.domain_offset((start + k0, kvh * D), mdV), (BN, D), (0, 0))
            tKVgdK = thr_kv.partition_C(gdK)
            tKVgdV = thr_kv.partition_C(gdV)
            cKV = thr_kv.partition_C(cute.make_identity_tensor((BN, D)))
            rdK = cute.make_rmem_tensor_like(acc_dk, BFloat16)
            rdV = cute.make_rmem_tensor_like(acc_dv, BFloat16)
            rdK.store((acc_dk.load() * scale).to(BFloat16))
            rdV.store(acc_dv.load().to(BFloat16))
            # 2-byte stores (autovec_copy does not pair them: the tile's base alignment is
            # a runtime value)
            for e in cutlass.range_constexpr(cute.size(acc_dk)):
                if k0 + cKV[e][0] < L:
                    tKVgdK[e] = rdK[e]
                    tKVgdV[e] = rdV[e]


    @cute.jit
    def mask(self, acc: cute.Tensor, cS: cute.Tensor, k0: Int32, q0: Int32, L: Int32):
        """Zero the elements of an S^T-shaped accumulator outside the document (key or query
        >= L) and, causal, above the diagonal (key > query); cS: their (key, query) in the tile."""
        for e in cutlass.range_constexpr(cute.size(acc)):
            key = k0 + cS[e][0]
            qry = q0 + cS[e][1]
            ok = key < L and qry < L
            if const_expr(self.causal):
                ok = ok and key <= qry
            if not ok:
                acc[e] = Float32(0.0)

    @cute.jit
    def step(self, s: cutlass.Constexpr, i: Int32, ph: Int32, q0: Int32, mma_s, mma_kv, mma_dq,
             sQ, sdO, sLSE, sDelta, tSrK, tSrV, tSrQ, tSrdO, tKVrQt, tKVrdOt, tQrdS, tQrKt,
             tSsdSt, tQsdQ, cS, acc_s, acc_dp, acc_dq, acc_dk, acc_dv, rP, rdS, tKVrP, tKVrdS,
             tSrdS, r2s, q_ready, do_ready, q_free, tidx, L, k0, m_lo, n_m, scale_log2):
        """Step i (query block q0.., one query head) on stage s (= i % STAGES, also the dQ
        buffer); returns the next step's q0."""
        # the wgmma atoms' accumulate flag is state of the TiledMma object: fresh ones per step,
        # so that no flag value set inside one loop body is used in another
        mma_s, mma_kv, mma_dq = _tiled_mmas()
        edge_q = q0 + BM > L
        cute.arch.mbarrier_wait(q_ready + s, ph)
        if edge_q:
            _zero_rows(sQ[None, None, s], L - q0, tidx, MMA_THREADS)
        cute.arch.mbarrier_wait(do_ready + s, ph)
        if edge_q:
            _zero_rows(sdO[None, None, s], L - q0, tidx, MMA_THREADS)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=BAR_DS, number_of_threads=MMA_THREADS)
        warpgroup.fence()
        _gemm(mma_s, acc_s, tSrK, tSrQ[None, None, None, s], True)
        warpgroup.commit_group()
        _gemm(mma_s, acc_dp, tSrV, tSrdO[None, None, None, s], True)
        warpgroup.commit_group()
        warpgroup.wait_group(1)
        masked = edge_q or k0 + BN > L
        if const_expr(self.causal):
            masked = masked or q0 < k0 + BN - 1
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[e] = cute.math.exp2(acc_s[e] * scale_log2 - sLSE[0, cS[e][1], s],
                                      fastmath=True)
        if masked:
            self.mask(acc_s, cS, k0, q0, L)
        rP.store(acc_s.load().to(BFloat16))
        warpgroup.wait_group(0)
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            acc_dp[e] = acc_s[e] * (acc_dp[e] - sDelta[0, cS[e][1], s])
        if masked:     # dP^T of keys past the document end, delta of pad rows may be NaN
            self.mask(acc_dp, cS, k0, q0, L)
        rdS.store(acc_dp.load().to(BFloat16))
        warpgroup.fence()
        _gemm(mma_kv, acc_dv, tKVrP, tKVrdOt[None, None, None, s], False)
        warpgroup.commit_group()
        cute.copy(r2s, tSrdS, tSsdSt[None, None, None, s])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_DS, number_of_threads=MMA_THREADS)
        warpgroup.fence()
        _gemm(mma_dq, acc_dq, tQrdS[None, None, None, s], tQrKt, True)
        warpgroup.commit_group()
        _gemm(mma_kv, acc_dk, tKVrdS, tKVrQt[None, None, None, s], False)
        warpgroup.commit_group()
        warpgroup.wait_group(1)            # dV and dQ done
        if i >= 2:                         # the writer has read buffer s's last tile
            cute.arch.barrier(barrier_id=BAR_DQ_EMPTY + s, number_of_threads=MMA_THREADS + 32)
        cute.autovec_copy(acc_dq, tQsdQ[None, None, None, s])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=BAR_DQ_FULL + s, number_of_threads=MMA_THREADS + 32)
        warpgroup.wait_group(0)            # dK done: stage s is free
        if tidx % 32 == 0:
            cute.arch.mbarrier_arrive(q_free + s)
        return _next_step(Int32(0), q0, m_lo, n_m)[1]

@cute.jit
def _next_step(h: Int32, q0: Int32, m_lo: Int32, n_m: Int32):
    """(query head, first query row) of the step after (h, q0): the next query block, or the
    first of the next head of the GQA group."""
    nh, nq = h, q0 + BM
    if q0 + BM == (m_lo + n_m) * BM:
        nh, nq = h + 1, m_lo * BM
    return nh, nq


def _tiled_mmas():
    """The three wgmma tilings: S^T / dP^T (SS, K-major A and B, keys split between the
    warpgroups), dK / dV (A from registers, N-major B), dQ (M-major A, N-major B, columns split)."""
    dt, K_, MN_ = BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
    return (sm90_utils.make_trivial_tiled_mma(dt, dt, K_, K_, Float32, (2, 1, 1), (64, BM)),
            sm90_utils.make_trivial_tiled_mma(dt, dt, K_, MN_, Float32, (2, 1, 1), (64, D),
                                              a_source=warpgroup.OperandSource.RMEM),
            sm90_utils.make_trivial_tiled_mma(dt, dt, MN_, MN_, Float32, (1, 2, 1), (64, D // 2)))


@cute.jit
def _gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
          zero_init: cutlass.Constexpr):
    """acc (+)= A B over every k-block of the fragments (the caller fences and commits)."""
    tiled_mma.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        cute.gemm(tiled_mma, acc, tA[None, None, k], tB[None, None, k], acc)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------

def _as_cute(x: torch.Tensor, mode: int = 0, divisibility: int = 1):
    """x (compact, 2D) for the kernel: only the extent of `mode` (tokens, rows) is dynamic, so the
    strides are compile-time values (vectorized global stores, static TMA strides)."""
    return from_dlpack(x, assumed_align=16).mark_compact_shape_dynamic(
        mode, stride_order=x.dim_order(), divisibility=divisibility)


def _kernel_args(q, k, v, dout, lse2, delta, dq_acc, dk, dv, items, sem):
    """The kernel's tensor arguments: (T, H D) views with dynamic T, (Hq, QR) vectors with dynamic
    QR (a multiple of BM), the (QR, Hq D) dQ buffer, the (6, N) work list, (Hq, QR / BM)."""
    T, Hq, Hkv, QR = q.shape[0], q.shape[1], k.shape[1], lse2.shape[1]
    return [_as_cute(q.view(T, Hq * D)), _as_cute(k.view(T, Hkv * D)),
            _as_cute(v.view(T, Hkv * D)), _as_cute(dout.view(T, Hq * D)),
            _as_cute(lse2, 1, BM), _as_cute(delta, 1, BM), _as_cute(dq_acc.view(QR, Hq * D), 0, BM),
            _as_cute(dk.view(T, Hkv * D)), _as_cute(dv.view(T, Hkv * D)), _as_cute(items, 1),
            _as_cute(sem, 1)]


_COMPILED: dict = {}


def backward_cute(dout, out, lse, q, k, v, cu_seqlens, causal=True, softmax_scale=None):
    """(dq, dk, dv) as flamia.ops.backward_sm90.attention_backward_sm90 (bf16, D=128), by the
    CuTe DSL kernel; its preprocess and post pass are the library's."""
    from flamia.ops import backward_sm90 as B
    from flamia.ops.numerics import LOG2E
    from flamia.ops.schedule import per_cu_seqlens
    import triton
    T, Hq, _ = q.shape
    Hkv = k.shape[1]
    dev = q.device
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    q, k, v, dout, out = (x.contiguous() for x in (q, k, v, dout, out))
    dq, dk, dv = B._grads(T, Hq, Hkv, D, dout.dtype, dev)
    kb = per_cu_seqlens(cu_seqlens, ("bwd_sm90", T, BM, BN, bool(causal), Hkv),
                        lambda: B.key_blocks(cu_seqlens, T, BM, BN, causal, Hkv))
    QR = kb.q_rows
    lse2 = torch.empty((Hq, QR), dtype=torch.float32, device=dev)
    delta = torch.empty((Hq, QR), dtype=torch.float32, device=dev)
    dq_acc = torch.empty((QR, Hq, D), dtype=torch.float32, device=dev)   # the kernel stores first
    grid_t = (triton.cdiv(T, B.SM90_PASS_ROWS), Hq)
    B._bwd_preprocess[grid_t](out, dout, lse.contiguous(), kb.prow, lse2, delta, T, QR, Hq * D,
                              D=D, BT=B.SM90_PASS_ROWS, num_warps=4)
    args = _kernel_args(q, k, v, dout, lse2, delta, dq_acc, dk, dv, kb.items,
                        B._semaphores(kb, Hq, BM))
    import cuda.bindings.driver as cuda
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    key = (Hq, Hkv, bool(causal))
    extra = (Int32(kb.n_items), Int32(QR // BM), Float32(scale * LOG2E), Float32(scale), stream)
    if key not in _COMPILED:
        _COMPILED[key] = cute.compile(BwdSm90Cute(Hq // Hkv, bool(causal)), *args, *extra)
    _COMPILED[key](*args, *extra)
    # this kernel stores dQ rows in natural order; the library's post pass reads row
    # dq_row_host(prow): hand it the rows whose image is prow (dq_row_host rotates the three low
    # bits, so applied twice it is its own inverse)
    rows = B.dq_row_host(B.dq_row_host(kb.prow))
    B._bwd_postprocess[grid_t](dq_acc, rows, dq, T, scale, Hq * D, D=D, BT=B.SM90_PASS_ROWS,
                               num_warps=4)
    return dq, dk, dv


def compile_only(causal=True, T=4096, Hq=32, Hkv=8, dump=None):
    """Build for sm_90a on a machine without a GPU (CPU tensors stand in for the arguments);
    with dump, the PTX is kept there."""
    import cuda.bindings.driver as cuda
    QR = T + 1024
    bf = torch.bfloat16
    args = _kernel_args(
        torch.zeros(T, Hq, D, dtype=bf), torch.zeros(T, Hkv, D, dtype=bf),
        torch.zeros(T, Hkv, D, dtype=bf), torch.zeros(T, Hq, D, dtype=bf),
        torch.zeros(Hq, QR), torch.zeros(Hq, QR), torch.zeros(QR, Hq, D),
        torch.zeros(T, Hkv, D, dtype=bf), torch.zeros(T, Hkv, D, dtype=bf),
        torch.zeros(6, 64, dtype=torch.int32), torch.zeros(Hq, QR // BM, dtype=torch.int32))
    opts = "--gpu-arch sm_90a" + (f" --keep-ptx --dump-dir {dump}" if dump else "")
    return cute.compile(BwdSm90Cute(Hq // Hkv, causal), *args, Int32(64), Int32(QR // BM),
                        Float32(1.0), Float32(1.0), cuda.CUstream(0), options=opts)


def check(seed: int = 0) -> bool:
    """Random packed cases at D=128 (0/1/2-token documents, GQA groups 1/2/4/8, causal and not)
    against float64 (flamia.reference, autograd), outputs poisoned first, within the Gluon bf16
    kernel's bar (bwd_sm90_dev.check); P2: a perturbed document leaves every other document's
    dk / dv bitwise unchanged (dq up to the order of fp32 adds)."""
    from benchmarks.bwd_sm90_dev import case_inputs, p2_perturbed, poison, rel
    from flamia.ops import backward_sm90 as B
    g = torch.Generator().manual_seed(seed)
    cases = [(4, 4, [1, 0, 2, 131, 257, 64], True), (8, 2, [700, 17, 1, 0, 330], True),
             (6, 3, [513], False), (4, 1, [128, 256, 3, 200], True), (2, 2, [2049], True),
             (32, 8, [1000, 24, 300], True), (8, 1, [129, 127, 640], True)]
    ok_all = True
    for Hq, Hkv, lengths, causal in cases:
        scale = D ** -0.5
        q, k, v, do, cu, o, lse, (dq64, dk64, dv64) = case_inputs(g, D, Hq, Hkv, lengths,
                                                                  causal, scale)
        poison()
        new = backward_cute(do, o, lse, q, k, v, cu, causal, scale)
        old = B.attention_backward_sm90(do, o, lse, q, k, v, cu, causal, scale)
        torch.cuda.synchronize()
        errs = [rel(x, r) for x, r in zip(new, (dq64, dk64, dv64))]
        errs_g = [rel(x, r) for x, r in zip(old, (dq64, dk64, dv64))]
        finite = all(torch.isfinite(x).all().item() for x in new)
        ok = finite and all(e <= 2 * 2.5e-3 + 1e-3 for e in errs)
        p2, p2_ok = p2_perturbed(lambda *a: backward_cute(*a, causal, scale), new,
                                 q, k, v, do, o, lse, cu, lengths)
        ok = ok and p2_ok
        ok_all = ok_all and ok
        print(f"{'PASS' if ok else 'FAIL'} H={Hq}/{Hkv} causal={causal} L={lengths}: dq/dk/dv "
              f"{errs[0]:.2e}/{errs[1]:.2e}/{errs[2]:.2e} (gluon {errs_g[0]:.2e}/{errs_g[1]:.2e}/"
              f"{errs_g[2]:.2e}) finite={finite} P2={p2}", flush=True)
    return ok_all


def _variants(do, o, lse, q, k, v, cu, causal, scale, D_, with_g1=False):
    """The CuTe kernel; with_g1 (--g1) adds, to tell whether keeping a GQA group's query heads in
    one CTA costs L2 locality (FA4 runs one CTA per key block and query head), both kernels on
    K / V repeated to one KV head per query head (one head per CTA, the same FLOPs and Q / dO /
    dQ bytes), dK / dV then summed over the group (the repeats are made outside the timing)."""
    from flamia.ops import backward_sm90 as B
    if D_ != D:
        return {}
    out = {"cute bf16": functools.partial(backward_cute, do, o, lse, q, k, v, cu, causal, scale)}
    G = q.shape[1] // k.shape[1]
    if G > 1 and with_g1:
        k1, v1 = (x.repeat_interleave(G, dim=1).contiguous() for x in (k, v))

        def g1(fn):
            def call():
                dq, dk, dv = fn(do, o, lse, q, k1, v1, cu, causal, scale)
                T = q.shape[0]
                return (dq, dk.view(T, -1, G, D).sum(2), dv.view(T, -1, G, D).sum(2))
            return call
        out["gluon g1"] = g1(B.attention_backward_sm90)
        out["cute g1"] = g1(backward_cute)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="build for sm_90a only (CPU)")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--workloads", default="doc32k,doc8k_x4,doc2k_x16,longtail,doc512_x64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--g1", action="store_true", help="--time: also both kernels on K / V "
                    "repeated to one KV head per query head (the tenth session's question)")
    ap.add_argument("--shapes", default="",
                    help="more workloads, name:Hq:Hkv:D:L1+L2+... separated by commas")
    a = ap.parse_args()
    if a.compile:
        import time
        t0 = time.time()
        os.makedirs("/tmp/cute_bwd_dump", exist_ok=True)
        compile_only(dump="/tmp/cute_bwd_dump")
        print(f"compiled for sm_90a in {time.time() - t0:.1f} s (PTX in /tmp/cute_bwd_dump)")
    ok = True
    if a.check:
        ok = check()
        print("check:", "PASS" if ok else "FAIL", flush=True)
    if a.time:
        from benchmarks import bwd_sm90_dev as dev
        from flamia.ops.config import sm90_backward_config
        dev.EXTRA_VARIANTS.append(functools.partial(_variants, with_g1=a.g1))
        dev.time_workloads(a.workloads.split(","), lambda d: [sm90_backward_config(d)],
                           shapes=[x for x in a.shapes.split(",") if x], rounds=a.rounds)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
