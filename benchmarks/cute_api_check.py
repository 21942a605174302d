"""Compile-only checks of the CuTe DSL (nvidia-cutlass-dsl 4.8.1) API pieces an sm_90a attention
backward needs. One small kernel per item of benchmarks/cute_notes_api.md; each is compiled with
cute.compile(..., options="--gpu-arch sm_90a --keep-ptx ...") on a CPU-only machine, and the kept
PTX is searched for the instructions the item must produce. Prints PASS/FAIL per item.

    /tmp/cute/bin/python benchmarks/cute_api_check.py

Nothing here runs on a GPU; the kernels are shaped to compile, not to compute anything useful.
"""
from __future__ import annotations

import glob
import os
import re
import sys
import tempfile
import traceback
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import BFloat16, Float32, Int32, Int64  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup  # noqa: E402
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

BM, BN, D, STAGES = 64, 128, 128, 2
OPTS = "--gpu-arch sm_90a --keep-ptx --dump-dir {}"


def compile_ptx(fn, *args):
    with tempfile.TemporaryDirectory() as tmp:
        cute.compile(fn, *args, options=OPTS.format(tmp))
        return "".join(open(p).read() for p in glob.glob(os.path.join(tmp, "*.ptx")))


def sym_T():        # a dynamic (runtime) token extent
    return cute.sym_int32(symbol="T")


def bf16_tile_layout(rows, cols, stages=None):
    """(rows, cols[, stages]) bf16, cols contiguous, 128B swizzle: the K_SW128 wgmma atom (8 x 64)."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    return cute.tile_to_shape(atom, shape, order=tuple(range(len(shape))))


def f32_tile_layout(rows, cols):
    """(rows, cols) fp32, cols contiguous, 128B swizzle (atom 8 x 32 fp32)."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, Float32)
    return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))


def transpose_view(t):
    """Swap the two modes of a 2D smem tensor (same memory)."""
    return cute.composition(t, cute.make_ordered_layout((t.shape[1], t.shape[0]), order=(1, 0)))


def smem_tile(smem, dtype, layout):
    """Allocate a (possibly swizzled ComposedLayout) smem tensor; swizzle goes on the pointer."""
    if isinstance(layout, cute.ComposedLayout):
        return smem.allocate_tensor(dtype, layout.outer, 1024, swizzle=layout.inner)
    return smem.allocate_tensor(dtype, layout, 128)


# ------------------------------------------------------------------------------------------------
# 1. runtime tensors from torch / fake tensors, dynamic token extent, scalar args
@cute.kernel
def k1(mQ: cute.Tensor, mL: cute.Tensor, mW: cute.Tensor, out: cute.Tensor, scale: Float32, start: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    T = mQ.shape[0]                       # runtime extent
    r = (start + tidx) % T
    out[tidx] = Float32(mQ[r, tidx]) * scale + mL[0, r] + Float32(mW[0, 1])


@cute.jit
def host1(mQ: cute.Tensor, mL: cute.Tensor, mW: cute.Tensor, out: cute.Tensor, scale: Float32, start: Int32):
    k1(mQ, mL, mW, out, scale, start).launch(grid=[1, 1, 1], block=[128, 1, 1])


def item1():
    H = 4
    # (a) CPU torch tensors through DLPack; token dim (mode 0 of q, mode 1 of lse) made dynamic.
    # mark_compact_shape_dynamic's stride_order follows torch.Tensor.dim_order(): outermost first.
    q = torch.empty(1000, H * D, dtype=torch.bfloat16)
    lse = torch.empty(H, 1024, dtype=torch.float32)
    work = torch.empty(8, 4, dtype=torch.int32)
    out = torch.empty(128, dtype=torch.float32)
    mq = from_dlpack(q, assumed_align=16).mark_compact_shape_dynamic(mode=0, stride_order=q.dim_order())
    ml = from_dlpack(lse, assumed_align=16).mark_compact_shape_dynamic(
        mode=1, stride_order=lse.dim_order(), divisibility=4)
    mw = from_dlpack(work).mark_compact_shape_dynamic(mode=0, stride_order=work.dim_order())
    ptx_a = compile_ptx(host1, mq, ml, mw, from_dlpack(out), Float32(0.125), Int32(3))
    # (b) no torch at all: fake tensors; stride_order here is innermost-first (0 = stride-1 mode)
    T = sym_T()
    fq = make_fake_compact_tensor(BFloat16, (T, H * D), stride_order=(1, 0), assumed_align=16)
    fl = make_fake_compact_tensor(Float32, (H, cute.sym_int32(divisibility=4)), stride_order=(1, 0),
                                  assumed_align=16)
    fw = make_fake_compact_tensor(Int32, (cute.sym_int32(), 4), stride_order=(1, 0), assumed_align=16)
    fo = make_fake_compact_tensor(Float32, (128,), assumed_align=16)
    ptx_b = compile_ptx(host1, fq, fl, fw, fo, Float32(0.125), Int32(3))
    return {".target sm_90a": ptx_a.count(".target sm_90a") + ptx_b.count(".target sm_90a")}


# ------------------------------------------------------------------------------------------------
# 2. TMA load of a (64, 128) bf16 box at runtime (row0, col0) into stage s + (1, 64) fp32 row box
@cute.kernel
def k2(tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_l: cute.CopyAtom, mL: cute.Tensor,
       sQ_layout: cute.ComposedLayout, sL_layout: cute.Layout, start: Int32, q0: Int32, h: Int32):
    smem = SmemAllocator()
    sQ = smem_tile(smem, BFloat16, sQ_layout)            # (64, 128, STAGES)
    sL = smem_tile(smem, Float32, sL_layout)             # (1, 64, STAGES)
    mbar = smem.allocate_array(Int64, STAGES, byte_alignment=8)
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp_idx == 0:
        cpasync.prefetch_descriptor(tma_q)
        cpasync.prefetch_descriptor(tma_l)
        with cute.arch.elect_one():
            for s in cutlass.range_constexpr(STAGES):
                cute.arch.mbarrier_init(mbar + s, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()

    row0 = start + q0
    col0 = h * D
    # Runtime (non tile-aligned) origin: shift the TMA coordinate tensor, then take one tile.
    gQ = cute.local_tile(cute.domain_offset((row0, col0), mQ), (BM, D), (0, 0))
    tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                       cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
    gL = cute.local_tile(cute.domain_offset((h, row0), mL), (1, BM), (0, 0))
    tLsL, tLgL = cpasync.tma_partition(tma_l, 0, cute.make_layout(1),
                                       cute.group_modes(sL, 0, 2), cute.group_modes(gL, 0, 2))
    s = q0 % STAGES
    if warp_idx == 0:                     # one whole warp calls cute.copy; it elects a lane itself
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, BM * D * 2 + BM * 4)
        cute.copy(tma_q, tQgQ, tQsQ[None, s], tma_bar_ptr=mbar + s)
        cute.copy(tma_l, tLgL, tLsL[None, s], tma_bar_ptr=mbar + s)
    cute.arch.mbarrier_wait(mbar + s, 0)


@cute.jit
def host2(mQ: cute.Tensor, mL: cute.Tensor, start: Int32, q0: Int32, h: Int32):
    sQ_layout = bf16_tile_layout(BM, D, STAGES)
    tma_q, mQ_tma = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), mQ, cute.select(sQ_layout, mode=[0, 1]), (BM, D))
    sL_layout = cute.make_layout((1, BM, STAGES), stride=(BM, 1, BM))
    tma_l, mL_tma = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), mL, cute.select(sL_layout, mode=[0, 1]), (1, BM))
    k2(tma_q, mQ_tma, tma_l, mL_tma, sQ_layout, sL_layout, start, q0, h).launch(
        grid=[1, 1, 1], block=[128, 1, 1])


def item2():
    fq = make_fake_compact_tensor(BFloat16, (sym_T(), 4 * D), stride_order=(1, 0), assumed_align=16)
    fl = make_fake_compact_tensor(Float32, (4, cute.sym_int32(divisibility=4)), stride_order=(1, 0),
                                  assumed_align=16)
    ptx = compile_ptx(host2, fq, fl, Int32(0), Int32(5), Int32(1))
    return {"cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes": 3,
            "mbarrier.arrive.expect_tx": 1, "prefetch.tensormap": 2, "mbarrier.try_wait.parity": 1}, ptx


# ------------------------------------------------------------------------------------------------
# 3. TMA store and TMA reduce-add of a (64, 128) fp32 smem tile to (QR, Hq*D) at (row0, col0)
@cute.kernel
def k3(tma_st: cute.CopyAtom, tma_red: cute.CopyAtom, mO_st: cute.Tensor, mO_red: cute.Tensor,
       sO_layout: cute.ComposedLayout, row0: Int32, col0: Int32):
    smem = SmemAllocator()
    sO = smem_tile(smem, Float32, sO_layout)
    tidx, _, _ = cute.arch.thread_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    for i in cutlass.range_constexpr(BM * D // 128):       # plain st.shared by 128 threads
        e = i * 128 + tidx
        sO[e // D, e % D] = Float32(i)
    cute.arch.fence_view_async_shared()       # fence.proxy.async.shared::cta: generic -> async proxy
    cute.arch.barrier(barrier_id=1, number_of_threads=128)
    g_st = cute.local_tile(cute.domain_offset((row0, col0), mO_st), (BM, D), (0, 0))
    g_red = cute.local_tile(cute.domain_offset((row0, col0), mO_red), (BM, D), (0, 0))
    tSs, tSg = cpasync.tma_partition(tma_st, 0, cute.make_layout(1),
                                     cute.group_modes(sO, 0, 2), cute.group_modes(g_st, 0, 2))
    tRs, tRg = cpasync.tma_partition(tma_red, 0, cute.make_layout(1),
                                     cute.group_modes(sO, 0, 2), cute.group_modes(g_red, 0, 2))
    if warp_idx == 0:
        cute.copy(tma_st, tSs, tSg)           # cp.async.bulk.tensor.2d.global.shared::cta
        cute.arch.cp_async_bulk_commit_group()
        cute.copy(tma_red, tRs, tRg)          # cp.reduce.async.bulk.tensor.2d...add.f32
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)   # smem may be overwritten again
        cute.arch.cp_async_bulk_wait_group(0)              # writes complete (visible in global)
        cute.arch.fence_proxy("async.global")              # fence.proxy.async.global
    cute.arch.barrier(barrier_id=1, number_of_threads=128)


@cute.jit
def host3(mO: cute.Tensor, row0: Int32, col0: Int32):
    sO_layout = f32_tile_layout(BM, D)
    tma_st, mO_st = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (BM, D))
    tma_red, mO_red = cpasync.make_tiled_tma_atom(
        cpasync.CopyReduceBulkTensorTileS2GOp(cute.ReductionKind.ADD), mO, sO_layout, (BM, D))
    k3(tma_st, tma_red, mO_st, mO_red, sO_layout, row0, col0).launch(grid=[1, 1, 1], block=[128, 1, 1])


def item3():
    fo = make_fake_compact_tensor(Float32, (sym_T(), 4 * D), stride_order=(1, 0), assumed_align=16)
    ptx = compile_ptx(host3, fo, Int32(7), Int32(D))
    return {"cp.async.bulk.tensor.2d.global.shared::cta": 4,
            "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add": 4,
            "cp.async.bulk.commit_group": 2, "cp.async.bulk.wait_group.read 0": 1,
            "cp.async.bulk.wait_group 0": 1, "fence.proxy.async.shared::cta": 1,
            "fence.proxy.async.global": 1}, ptx


# ------------------------------------------------------------------------------------------------
# 4-7. wgmma: (a) SS S^T = K Q^T, (b) RS dV += P^T dO, (c) SS dQ = dS K with MN-major A and B
def make_mmas():
    mma_s = sm90_utils.make_trivial_tiled_mma(          # (a): warpgroups stacked along M (keys)
        BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
        atom_layout_mnk=(2, 1, 1), tiler_mn=(64, BM))
    mma_dv = sm90_utils.make_trivial_tiled_mma(         # (b): A from registers, B MN-major
        BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
        atom_layout_mnk=(2, 1, 1), tiler_mn=(64, D), a_source=warpgroup.OperandSource.RMEM)
    mma_dq = sm90_utils.make_trivial_tiled_mma(         # (c): A and B MN-major, warpgroups split N
        BFloat16, BFloat16, OperandMajorMode.MN, OperandMajorMode.MN, Float32,
        atom_layout_mnk=(1, 2, 1), tiler_mn=(64, D // 2))
    return mma_s, mma_dv, mma_dq


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
         zero_init: cutlass.Constexpr[bool]):
    """All k-blocks of one GEMM; ACCUMULATE=False on the first one when zero_init."""
    atom = cute.make_mma_atom(tiled_mma.op)        # fresh atom: its ACCUMULATE field is mutated
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for kb in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        cute.gemm(atom, acc, tA[None, None, kb], tB[None, None, kb], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)


def acc_to_frgA(acc: cute.Tensor) -> cute.Tensor:
    """Item 5. sm90 accumulator ((2,2,N/8),MMA_M,MMA_N) viewed as a k16 A-operand fragment
    ((2,2,2),MMA_M,(N/16,MMA_N)): two adjacent n8 column blocks of C = one k16 block of A.
    Pure layout reinterpretation (no data movement); needs N/8 even."""
    l = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    s, d = l.shape, l.stride
    return cute.make_tensor(acc.iterator, cute.make_layout(
        ((s[0][0], s[0][1], s[0][2][0]), s[1], (s[0][2][1], s[2])),
        stride=((d[0][0], d[0][1], d[0][2][0]), d[1], (d[0][2][1], d[2]))))


@cute.kernel
def k4(mma_s: cute.TiledMma, mma_dv: cute.TiledMma, mma_dq: cute.TiledMma, out: cute.Tensor,
       q_base: Int32, k_base: Int32):
    smem = SmemAllocator()
    sQ = smem_tile(smem, BFloat16, bf16_tile_layout(BM, D))     # (64 q, 128 d)  d contiguous
    sdO = smem_tile(smem, BFloat16, bf16_tile_layout(BM, D))    # (64 q, 128 d)
    sK = smem_tile(smem, BFloat16, bf16_tile_layout(BN, D))     # (128 k, 128 d)
    sV = smem_tile(smem, BFloat16, bf16_tile_layout(BN, D))
    sdSt = smem_tile(smem, BFloat16, bf16_tile_layout(BN, BM))  # (128 k, 64 q)  q contiguous
    sdQ = smem_tile(smem, Float32, f32_tile_layout(BM, D))      # (64 q, 128 d)  fp32
    sLSE = smem.allocate_tensor(Float32, cute.make_layout(BM), 16)
    sDelta = smem.allocate_tensor(Float32, cute.make_layout(BM), 16)
    tidx, _, _ = cute.arch.thread_idx()
    tidx = tidx - 128                     # consumer threads 128..383 -> 0..255

    # (a) S^T = K @ Q^T and dP^T = V @ dO^T, both SS, two commit groups in flight
    thr_s = mma_s.get_slice(tidx)
    tSrK = thr_s.make_fragment_A(thr_s.partition_A(sK))        # A: (M=128 keys, K=128 d)
    tSrQ = thr_s.make_fragment_B(thr_s.partition_B(sQ))        # B: (N=64 q,     K=128 d)
    tSrV = thr_s.make_fragment_A(thr_s.partition_A(sV))
    tSrdO = thr_s.make_fragment_B(thr_s.partition_B(sdO))
    acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((BN, BM)), Float32)
    acc_dp = cute.make_rmem_tensor(thr_s.partition_shape_C((BN, BM)), Float32)
    warpgroup.fence()
    gemm(mma_s, acc_s, tSrK, tSrQ, True)
    warpgroup.commit_group()
    gemm(mma_s, acc_dp, tSrV, tSrdO, True)
    warpgroup.commit_group()
    warpgroup.wait_group(1)               # S^T done; dP^T may still be running

    # 6. (row, col) of each accumulator element: identity tensor partitioned like C
    tScS = thr_s.partition_C(cute.make_identity_tensor((BN, BM)))
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        key, q = tScS[i]                  # row = key within tile, col = query within tile
        lse = sLSE[q]                     # per-column vector from smem
        if k_base + key > q_base + q:     # causal mask (runtime)
            acc_s[i] = -Float32.inf
        acc_s[i] = cute.math.exp2(acc_s[i] - lse, fastmath=True)
    warpgroup.wait_group(0)
    for i in cutlass.range_constexpr(cute.size(acc_dp)):
        key, q = tScS[i]
        acc_dp[i] = acc_s[i] * (acc_dp[i] - sDelta[q])

    # 5. P^T fp32 accumulator -> bf16, then viewed as the RS A-operand fragment
    tPrP = cute.make_rmem_tensor(acc_s.layout, BFloat16)
    tPrP.store(acc_s.load().to(BFloat16))               # cvt.rn.bf16x2.f32 pairs
    tdVrP = acc_to_frgA(tPrP)

    # (b) dV += P^T @ dO : A regs (M=128 keys, K=64 q); B = dO^T view (N=128 d, K=64 q), MN-major
    thr_dv = mma_dv.get_slice(tidx)
    tdVrdO = thr_dv.make_fragment_B(thr_dv.partition_B(transpose_view(sdO)))
    acc_dv = cute.make_rmem_tensor(thr_dv.partition_shape_C((BN, D)), Float32)
    warpgroup.fence()
    gemm(mma_dv, acc_dv, tdVrP, tdVrdO, True)
    warpgroup.commit_group()

    # 7a. dS^T (bf16) -> sdSt (128 k, 64 q) swizzled, stmatrix tiled like C of mma_s
    tdSr = cute.make_rmem_tensor(acc_dp.layout, BFloat16)
    tdSr.store(acc_dp.load().to(BFloat16))
    r2s = cute.make_tiled_copy_C(
        cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16), mma_s)
    thr_r2s = r2s.get_slice(tidx)
    cute.copy(r2s, thr_r2s.retile(tdSr), thr_r2s.partition_D(sdSt))
    cute.arch.fence_view_async_shared()   # generic-proxy smem writes -> visible to wgmma (async)
    cute.arch.barrier(barrier_id=2, number_of_threads=256)

    # (c) dQ = dS @ K : A = dS (M=64 q, K=128 k) = transpose of sdSt (MN-major),
    #                   B = K^T view (N=128 d, K=128 k) (MN-major); each warpgroup 64 d columns
    thr_dq = mma_dq.get_slice(tidx)
    tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(transpose_view(sdSt)))
    tdQrK = thr_dq.make_fragment_B(thr_dq.partition_B(transpose_view(sK)))
    acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C((BM, D)), Float32)
    warpgroup.fence()
    gemm(mma_dq, acc_dq, tdQrdS, tdQrK, True)
    warpgroup.commit_group()
    warpgroup.wait_group(0)

    # 7b. dQ fp32 -> sdQ (the TMA-store/reduce tile of item 3): partition the smem tile like C
    cute.autovec_copy(acc_dq, thr_dq.partition_C(sdQ))
    cute.arch.fence_view_async_shared()
    out[tidx] = acc_dv[0]


@cute.jit
def host4(out: cute.Tensor, q_base: Int32, k_base: Int32):
    mma_s, mma_dv, mma_dq = make_mmas()
    k4(mma_s, mma_dv, mma_dq, out, q_base, k_base).launch(grid=[1, 1, 1], block=[384, 1, 1])


def item4_7():
    ptx = compile_ptx(host4, make_fake_compact_tensor(Float32, (256,), assumed_align=16), Int32(0), Int32(0))
    return ptx


def item4(ptx):
    return {"wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16": 24,      # (a) 8+8, (c) 8
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16": 4,      # (b) RS, K=64
            "wgmma.fence.sync.aligned": 3, "wgmma.commit_group.sync.aligned": 4,
            "wgmma.wait_group.sync.aligned 1": 1, "wgmma.wait_group.sync.aligned 0": 2,
            # trans-b=1 on (b); trans-a=1, trans-b=1 on (c); 0, 0 on (a)
            "p, 1, 1, 1;": 4, "p, 1, 1, 1, 1;": 8, "p, 1, 1, 0, 0;": 16}


def item5(ptx):
    return {"cvt.rn.bf16x2.f32": 32}     # 2 x (128x64 / 256 threads / 2)


def item6(ptx):
    return {"ex2.approx.ftz.f32": 32, "selp.f32": 1}


def item7(ptx):
    return {"stmatrix.sync.aligned.m8n8.x4.shared.b16": 4, "st.shared.v2.b32": 16,
            "fence.proxy.async.shared::cta": 2}


# ------------------------------------------------------------------------------------------------
# 8. warp specialization: producer WG (TMA warp + dQ-writer warp) + 2 consumer WGs
@cute.kernel
def k8(tma_q: cute.CopyAtom, mQ: cute.Tensor, sQ_layout: cute.ComposedLayout, out: cute.Tensor, n_blocks: Int32):
    smem = SmemAllocator()
    sQ = smem_tile(smem, BFloat16, sQ_layout)
    mbar_pipe = smem.allocate_array(Int64, 2 * STAGES, byte_alignment=8)   # full[S], empty[S]
    mbar_raw = smem.allocate_array(Int64, 2, byte_alignment=8)
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    tidx, _, _ = cute.arch.thread_idx()

    # PipelineTmaAsync: 1 producer thread arrives (+expect_tx); 8 consumer warps release (lane 0 each)
    pipe = pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar_pipe, num_stages=STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
        tx_count=BM * D * 2, defer_sync=True)
    # raw mbarriers: [0] "dQ ready" (256 consumer arrivals), [1] "dQ consumed" (1 arrival)
    if warp_idx == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar_raw, 256)
            cute.arch.mbarrier_init(mbar_raw + 1, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()

    gQ = cute.local_tile(mQ, (BM, D), (None, 0))                  # (64, 128, n_tiles)
    tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                       cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
    if warp_idx < 4:
        cute.arch.setmaxregister_decrease(24)                     # setmaxnreg.dec.sync.aligned.u32 24
        if warp_idx == 0:                                         # TMA producer warp
            st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            for m in cutlass.range(n_blocks, unroll=1):
                pipe.producer_acquire(st)                          # wait empty, arrive+expect_tx full
                cute.copy(tma_q, tQgQ[None, m], tQsQ[None, st.index],
                          tma_bar_ptr=pipe.producer_get_barrier(st))
                st.advance()
            pipe.producer_tail(st)
        if warp_idx == 1:                                         # dQ writer warp
            for m in cutlass.range(n_blocks, unroll=1):
                cute.arch.mbarrier_wait(mbar_raw, m % 2)          # phase flips every use
                # named barrier (id 3): 256 consumer threads arrive, this warp syncs: 288 total
                cute.arch.barrier(barrier_id=3, number_of_threads=256 + 32)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive(mbar_raw + 1)
    else:
        cute.arch.setmaxregister_increase(240)                    # setmaxnreg.inc.sync.aligned.u32 240
        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        acc = Float32(0.0)
        for m in cutlass.range(n_blocks, unroll=1):
            pipe.consumer_wait(st, pipe.consumer_try_wait(st))
            acc += Float32(sQ[tidx % BM, 0, st.index])
            pipe.consumer_release(st)
            st.advance()
            cute.arch.mbarrier_arrive(mbar_raw)
            cute.arch.barrier_arrive(barrier_id=3, number_of_threads=256 + 32)
            # consumer-only named barrier (id 2, 256 threads)
            cute.arch.barrier(barrier_id=2, number_of_threads=256)
            ready = cute.arch.mbarrier_try_wait(mbar_raw + 1, m % 2)
            if not ready:
                cute.arch.mbarrier_wait(mbar_raw + 1, m % 2)
        out[tidx - 128] = acc


@cute.jit
def host8(mQ: cute.Tensor, out: cute.Tensor, n_blocks: Int32):
    sQ_layout = bf16_tile_layout(BM, D, STAGES)
    tma_q, mQ_tma = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), mQ, cute.select(sQ_layout, mode=[0, 1]), (BM, D))
    k8(tma_q, mQ_tma, sQ_layout, out, n_blocks).launch(grid=[1, 1, 1], block=[384, 1, 1])


def item8():
    fq = make_fake_compact_tensor(BFloat16, (sym_T(), D), stride_order=(1, 0), assumed_align=16)
    fo = make_fake_compact_tensor(Float32, (256,), assumed_align=16)
    ptx = compile_ptx(host8, fq, fo, Int32(4))
    return {"setmaxnreg.dec.sync.aligned.u32 24": 1, "setmaxnreg.inc.sync.aligned.u32 240": 1,
            "bar.sync 3, 288": 1, "bar.arrive 3, 288": 1, "bar.sync 2, 256": 1,
            "mbarrier.init.shared": 6, "mbarrier.arrive.expect_tx": 1, "mbarrier.try_wait": 4,
            "elect.sync": 2, "cp.async.bulk.tensor.2d": 1}, ptx


# ------------------------------------------------------------------------------------------------
# 9. global int32 semaphores: CAS acquire, atomic add, exchange release, ld.acquire; fences
@cute.kernel
def k9(mSem: cute.Tensor, out: cute.Tensor, expect: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    p = mSem.iterator + bid                           # cute.Pointer into global
    if tidx == 0:
        # spin until the semaphore equals `expect`, taking it (-> -1) with acquire semantics
        old = cute.arch.atomic_cas(p, cmp=expect, val=Int32(-1), sem="acquire", scope="gpu")
        while old != expect:
            old = cute.arch.atomic_cas(p, cmp=expect, val=Int32(-1), sem="acquire", scope="gpu")
        seen = cute.arch.load(p + 1, Int32, sem="acquire", scope="gpu")      # ld.acquire.gpu
        cute.arch.fence_proxy("async.global")        # order generic accesses vs TMA (async proxy)
        ticket = cute.arch.atomic_add(p + 2, Int32(1), sem="relaxed", scope="gpu")
        prev = cute.arch.atomic_exch(p, expect + 1, sem="release", scope="gpu")   # unlock, release
        cute.arch.store(p + 3, seen, sem="release", scope="gpu")             # st.release.gpu
        cute.arch.fence_acq_rel_gpu()
        out[bid] = ticket + prev


@cute.jit
def host9(mSem: cute.Tensor, out: cute.Tensor, expect: Int32):
    k9(mSem, out, expect).launch(grid=[4, 1, 1], block=[32, 1, 1])


def item9():
    fs = make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=16)
    fo = make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=16)
    ptx = compile_ptx(host9, fs, fo, Int32(0))
    # PTX omits the default scope (.gpu) and the default semantics (.relaxed)
    return {"atom.global.acquire.cas.b32": 2, "atom.global.add.u32": 1,
            "atom.global.release.exch.b32": 1, "ld.acquire.gpu.global.b32": 1,
            "st.release.gpu.global.b32": 1,
            "fence.proxy.async.global": 1, "fence.acq_rel.gpu": 1}, ptx


# ------------------------------------------------------------------------------------------------
# 10. dynamic trip count with mbarrier waits (phase from i), runtime if/else on work-list fields
@cute.kernel
def k10(mWork: cute.Tensor, out: cute.Tensor):
    smem = SmemAllocator()
    mbar = smem.allocate_array(Int64, 2, byte_alignment=8)
    tidx, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    if tidx == 0:
        cute.arch.mbarrier_init(mbar, 1)
        cute.arch.mbarrier_init(mbar + 1, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    kind = mWork[bid, 0]                  # int32 fields of this CTA's work item
    n = mWork[bid, 1]
    base = mWork[bid, 2]
    acc = Int32(0)
    if kind == 0:
        acc = base
    elif kind == 1:
        acc = base * 2
    else:
        n = Int32(0)
    for i in cutlass.range(n, unroll=1):  # runtime trip count -> scf.for
        s = i % 2
        phase = (i // 2) % 2              # each barrier completes once per 2 iterations
        if tidx == 0:
            cute.arch.mbarrier_arrive(mbar + s)
        cute.arch.mbarrier_wait(mbar + s, phase)
        acc += i
    if n > 0:
        out[bid * 32 + tidx] = acc


@cute.jit
def host10(mWork: cute.Tensor, out: cute.Tensor):
    k10(mWork, out).launch(grid=[mWork.shape[0], 1, 1], block=[32, 1, 1])


def item10():
    fw = make_fake_compact_tensor(Int32, (cute.sym_int32(), 4), stride_order=(1, 0), assumed_align=16)
    fo = make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=16)
    ptx = compile_ptx(host10, fw, fo)
    return {"mbarrier.try_wait.parity": 1, "mbarrier.arrive": 1,
            "ld.global.v4.b32": 1}, ptx   # the three int32 fields merge into one 16B load


# ------------------------------------------------------------------------------------------------
def check(name, expect, ptx):
    ptx = re.sub(r"[ \t]+", " ", ptx)            # PTX mixes tabs and spaces
    bad = {k: ptx.count(k) for k, v in expect.items() if ptx.count(k) < v}
    got = ", ".join(f"{k.strip()} x{ptx.count(k)}" for k in expect)
    print(f"{'PASS' if not bad and '.target sm_90a' in ptx else 'FAIL'} {name}: {got}")
    return not bad


def _guarded(name, run) -> bool:
    """run() -> bool, with an exception counted as a failure of item `name`."""
    try:
        return run()
    except Exception:
        traceback.print_exc()
        print(f"FAIL {name}")
        return False


def _item1_ok(name) -> bool:
    res = item1()
    ok = res[".target sm_90a"] == 2
    print(f"{'PASS' if ok else 'FAIL'} {name}: "
          f"compiled from_dlpack(CPU torch) and make_fake_compact_tensor variants")
    return ok


def _items4_7_ok() -> bool:
    ptx = item4_7()
    ok = check("4 wgmma SS / RS / SS-MN-major, 2 groups in flight", item4(ptx), ptx)
    ok &= check("5 fp32 acc -> bf16 A-operand fragment", item5(ptx), ptx)
    ok &= check("6 accumulator coordinates: causal mask + per-column lse/delta", item6(ptx), ptx)
    ok &= check("7 acc -> smem: stmatrix dS^T bf16, dQ fp32 swizzled", item7(ptx), ptx)
    return ok


def main():
    ok = _guarded("1", lambda: _item1_ok("1 torch/fake tensors, dynamic T, scalars"))
    for name, fn in [("2 TMA load (64x128 bf16 SW128, 2 stages) + (1,64) fp32 row", item2),
                     ("3 TMA store + TMA reduce-add fp32, bulk groups, proxy fences", item3)]:
        ok &= _guarded(name, lambda: check(name, *fn()))
    ok &= _guarded("4-7", _items4_7_ok)
    for name, fn in [("8 warp specialization, setmaxnreg, named bars, mbarriers, PipelineTmaAsync", item8),
                     ("9 global int32 semaphores + fence.proxy.async.global", item9),
                     ("10 runtime loop with phased mbarrier waits, runtime if/else", item10)]:
        ok &= _guarded(name, lambda: check(name, *fn()))
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
