"""Spike (CPU compile check; GPU A/B pending): the one-pass backward (bf16, and the fp8
recipe's kernel) with its two MMA warpgroups in separate partitions, so that they need not run
in lockstep.

The library kernel (flamia.ops.backward_sm90) runs both MMA warpgroups in one 8-warp partition:
the dQ GEMM of a step reads the dS^T rows of both, so every step has partition-wide barriers
(four bar.sync per step in its PTX) and the two warpgroups do their element-wise work at the
same time while the tensor cores idle (ncu: tensor pipe 30 %, issue 31 %, benchmarks/NOTES.md).
Here each warpgroup is its own partition owning 64 keys of the block, and computes its own
partial dQ over those 64 keys (M = BM query rows, K = 64 keys, N = D); the dQ writer warp
reduce-adds both partials (twice the dQ reduce-add bytes of the library kernel). The only
coupling left is the shared Q / dO ring (a stage is refilled once both have used it), so one
warpgroup's softmax can run under the other's GEMMs. pingpong=True also makes the two take
turns issuing their GEMM bursts (FlashAttention-3's forward schedule, with an mbarrier pair).

    python benchmarks/bwd_pingpong_spike.py [--lines]   # CPU: sm_90a build per D (registers,
                                                        # spills, shared memory, serialized
                                                        # wgmma, SASS of the main loop)
    python benchmarks/bwd_pingpong_spike.py --check --time   # GPU (device_run.sh pingpong)

Its compute partitions are variants of backward_sm90._bwd_compute / _fp8_compute (duplicated on purpose, with
the library kernel's Gluon helpers imported as they are: a spike, not a stable consumer): if it
wins, it replaces them in the library; if it loses, this file goes. The fp8 kernel keeps the
library's preprocess, K-major copies and post pass, and reads its warpgroup's 64 keys of K^T as a
column slice of the K^T tile. What the GPU has to show before this replaces anything: the GPU tests of
tests/gpu/test_backward_sm90_gpu.py against it, and the whole backward against the library
kernel in one process (bwd_sm90_dev.py --ab).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import triton  # noqa: E402

from flamia.ops import backward_sm90 as B  # noqa: E402
from flamia.ops.config import (SM90_BLOCK_N, SM90_DQ_REGS, SM90_LOADER_REGS,  # noqa: E402
                               SM90_PASS_ROWS, SM90_STAGES, sm90_backward_config)
from flamia.ops.gluon_common import HAVE_GLUON, descriptor_2d  # noqa: E402
from flamia.ops.numerics import LOG2E  # noqa: E402
from flamia.ops.schedule import per_cu_seqlens  # noqa: E402

MMA_REGS = 240      # setmaxnreg of each MMA warpgroup partition

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    from flamia.ops.gluon_common import (alloc_barriers, arrive_synced, invalidate_barriers,
                                         tma_reduce_add, wgmma_layout)
    _item, _query_blocks, _next_step = B._item, B._query_blocks, B._next_step
    _zero_rows_from, _visible, _column_vector = B._zero_rows_from, B._visible, B._column_vector
    _bwd_loader = B._bwd_loader

    @gluon.jit
    def _await_turn(turn, k, WG: gl.constexpr):
        """Before GEMM burst k of a warpgroup (two per step): wg 1 waits until wg 0 has issued
        its burst k, wg 0 (from its second burst on) until wg 1 has issued burst k - 1. `turn`
        holds one mbarrier per warpgroup, which the other arrives on after each of its bursts
        (completion n has parity n & 1; strict alternation keeps every waiter within one
        completion, so parities cannot alias)."""
        if WG == 0:
            mbarrier.wait(turn.index(0), (k - 1) & 1, pred=k >= 1)
        else:
            mbarrier.wait(turn.index(1), k & 1)

    @gluon.jit
    def _pp_dq_writer(dq_desc, dq_smem, dq_ready, dq_free, ITEMS, N_ITEMS, GROUP,
                      BN: gl.constexpr, CAUSAL: gl.constexpr):
        """Per step, reduce-adds the two warpgroups' partial dQ tiles (one buffer each)."""
        BM: gl.constexpr = dq_smem.type.shape[1]
        D: gl.constexpr = dq_smem.type.shape[2]
        doc, blk, start, L, pq, kvh = _item(ITEMS, N_ITEMS)
        if doc >= 0:
            m_lo, n_m = _query_blocks(blk * BN, L, BM, CAUSAL)
            h = kvh * GROUP
            q0 = m_lo * BM
            for i in range(GROUP * n_m):
                for w in gl.static_range(2):
                    mbarrier.wait(dq_ready.index(w), i & 1)
                    tma_reduce_add(dq_desc, [pq + q0, h * D], dq_smem.index(w))
                    tma.store_wait(0)
                    mbarrier.arrive(dq_free.index(w), count=1)
                h, q0 = _next_step(h, q0, m_lo, n_m, BM)

    @gluon.jit
    def _pp_compute(q_smem, do_smem, k_smem, v_smem, lse_smem, dl_smem, ds_smem, dq_smem,
                    kv_ready, q_ready, do_ready, q_free, dq_ready, dq_free, turn, ITEMS,
                    N_ITEMS, GROUP, DK, DV, stride_kt, qk_scale_log2, sm_scale,
                    WG: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
        """MMA warpgroup WG (4 warps): keys [64 WG, 64 WG + 64) of the block, every step.
        PINGPONG: the two warpgroups issue their GEMM bursts (S^T and dP^T; dV, dQ's first half
        and dK) in turns, wg 0 first (_await_turn), so one's element-wise work falls under the
        other's GEMMs."""
        STAGES: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        D: gl.constexpr = q_smem.type.shape[2]
        BN: gl.constexpr = k_smem.type.shape[0]
        KW: gl.constexpr = BN // 2                                    # keys per warpgroup
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = wgmma_layout(4, 1, BM, 16)           # S^T, dP^T (KW, BM)
        kv_layout: gl.constexpr = wgmma_layout(4, 1, D, 16)           # dK, dV (KW, D)
        DH: gl.constexpr = D // 2
        dq_layout: gl.constexpr = wgmma_layout(4, 1, DH, 16)          # partial dQ half (BM, D/2)
        a_layout: gl.constexpr = gl.DotOperandLayout(0, kv_layout, 2)
        col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        k_w = k_smem.slice(WG * KW, KW)
        v_w = v_smem.slice(WG * KW, KW)
        ds_w = ds_smem.index(WG)
        dq_w = dq_smem.index(WG)

        doc, blk, start, L, pq, kvh = _item(ITEMS, N_ITEMS)
        if doc >= 0:
            k0 = blk * BN + WG * KW          # this warpgroup's first key
            m_lo, n_m = _query_blocks(blk * BN, L, BM, CAUSAL)
            mbarrier.wait(kv_ready, 0)
            if k0 + KW > L:
                _zero_rows_from(k_w, L - k0, 4)
            dk = gl.zeros([KW, D], gl.float32, kv_layout)
            dv = gl.zeros([KW, D], gl.float32, kv_layout)
            for i in range(GROUP * n_m):
                q0 = (m_lo + i % n_m) * BM
                s = i % STAGES
                ph = (i // STAGES) & 1
                q_tile = q_smem.index(s)
                do_tile = do_smem.index(s)
                edge_q = q0 + BM > L
                mbarrier.wait(q_ready.index(s), ph)
                if edge_q:    # both warpgroups write the same zeros
                    _zero_rows_from(q_tile, L - q0, 4)
                if PINGPONG:
                    _await_turn(turn, 2 * i, WG)
                st = warpgroup_mma(k_w, q_tile.permute((1, 0)),
                                   gl.zeros([KW, BM], gl.float32, s_layout), use_acc=False,
                                   is_async=True)
                mbarrier.wait(do_ready.index(s), ph)
                if edge_q:
                    _zero_rows_from(do_tile, L - q0, 4)
                dpt = warpgroup_mma(v_w, do_tile.permute((1, 0)),
                                    gl.zeros([KW, BM], gl.float32, s_layout), use_acc=False,
                                    is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(1 - WG), count=1)
                st = warpgroup_mma_wait(1, deps=[st])
                if CAUSAL:
                    masked = (q0 < k0 + KW - 1) | edge_q | (k0 + KW > L)
                else:
                    masked = edge_q | (k0 + KW > L)
                lse2 = gl.expand_dims(_column_vector(lse_smem, s, col_l), 0)
                pt = gl.exp2(st * qk_scale_log2 - lse2)
                if masked:
                    ok = _visible(k0, q0, L, KW, BM, s_layout, CAUSAL)
                    pt = gl.where(ok, pt, 0.0)
                dpt = warpgroup_mma_wait(0, deps=[dpt])
                delta = gl.expand_dims(_column_vector(dl_smem, s, col_l), 0)
                dst = pt * (dpt - delta)
                if masked:
                    dst = gl.where(_visible(k0, q0, L, KW, BM, s_layout, CAUSAL), dst, 0.0)
                pa = gl.convert_layout(pt.to(dtype), a_layout)
                if not PINGPONG:
                    dv = warpgroup_mma(pa, do_tile, dv, is_async=True)
                dsb = dst.to(dtype)
                ds_w.store(dsb)
                fence_async_shared()
                gl.thread_barrier()          # this partition's 4 warps only
                dsa = gl.convert_layout(dsb, a_layout)
                if PINGPONG:
                    _await_turn(turn, 2 * i + 1, WG)
                    dv = warpgroup_mma(pa, do_tile, dv, is_async=True)
                # the partial dQ in two column halves (32 accumulator registers each, not 64)
                dq0 = warpgroup_mma(ds_w.permute((1, 0)), k_w.slice(0, DH, dim=1),
                                    gl.zeros([BM, DH], gl.float32, dq_layout), use_acc=False,
                                    is_async=True)
                dk = warpgroup_mma(dsa, q_tile, dk, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(1 - WG), count=1)
                dv, dq0 = warpgroup_mma_wait(1, deps=[dv, dq0])
                mbarrier.wait(dq_free.index(WG), (i + 1) & 1, pred=i >= 1)
                dq_w.slice(0, DH, dim=1).store(dq0)
                dq1 = warpgroup_mma(ds_w.permute((1, 0)), k_w.slice(DH, DH, dim=1),
                                    gl.zeros([BM, DH], gl.float32, dq_layout), use_acc=False,
                                    is_async=True)
                dk = warpgroup_mma_wait(1, deps=[dk])
                dq1 = warpgroup_mma_wait(0, deps=[dq1])
                dq_w.slice(DH, DH, dim=1).store(dq1)
                fence_async_shared()
                gl.thread_barrier()      # one barrier releases the Q / dO stage and the dQ tile
                arrive_synced(dq_ready.index(WG))
                arrive_synced(q_free.index(s))
            rows = gl.expand_dims(k0 + gl.arange(0, KW, layout=gl.SliceLayout(1, kv_layout)), 1)
            cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout)), 0)
            offs = (start + rows).to(gl.int64) * stride_kt + kvh * D + cols
            keep = rows < L
            gl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=keep)
            gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=keep)

    @gluon.jit(do_not_specialize=["N_ITEMS"])
    def _attn_bwd_pingpong_kernel(q_desc, do_desc, k_desc, v_desc, lse_desc, dl_desc, dq_desc,
                                  DK, DV, ITEMS, N_ITEMS, GROUP, stride_kt, qk_scale_log2,
                                  sm_scale, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                                  STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                  PINGPONG: gl.constexpr, MMA_REGS_: gl.constexpr,
                                  LOADER_REGS: gl.constexpr, DQ_REGS: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, D], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BN, D], v_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BM], lse_desc.layout)
        dl_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BM], dl_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                       element_bitwidth=16, rank=2)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BN // 2, BM], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BM, D], dq_desc.layout)
        kv_ready = alloc_barriers(1).index(0)
        q_ready, do_ready = alloc_barriers(STAGES), alloc_barriers(STAGES)
        q_free = alloc_barriers(STAGES, 2)         # both warpgroups release a stage
        dq_ready, dq_free = alloc_barriers(2), alloc_barriers(2)
        turn = alloc_barriers(2)
        gl.warp_specialize([
            (_pp_compute, (q_smem, do_smem, k_smem, v_smem, lse_smem, dl_smem, ds_smem, dq_smem,
                           kv_ready, q_ready, do_ready, q_free, dq_ready, dq_free, turn, ITEMS,
                           N_ITEMS, GROUP, DK, DV, stride_kt, qk_scale_log2, sm_scale, 0, CAUSAL,
                           PINGPONG)),
            (_pp_compute, (q_smem, do_smem, k_smem, v_smem, lse_smem, dl_smem, ds_smem, dq_smem,
                           kv_ready, q_ready, do_ready, q_free, dq_ready, dq_free, turn, ITEMS,
                           N_ITEMS, GROUP, DK, DV, stride_kt, qk_scale_log2, sm_scale, 1, CAUSAL,
                           PINGPONG)),
            (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, lse_desc, dl_desc, q_smem, do_smem,
                           k_smem, v_smem, lse_smem, dl_smem, kv_ready, q_ready, do_ready, q_free,
                           ITEMS, N_ITEMS, GROUP, CAUSAL)),
            (_pp_dq_writer, (dq_desc, dq_smem, dq_ready, dq_free, ITEMS, N_ITEMS, GROUP, BN,
                             CAUSAL)),
        ], [4, 1, 1], [MMA_REGS_, LOADER_REGS, DQ_REGS])
        mbarrier.invalidate(kv_ready)
        invalidate_barriers((q_ready, do_ready, q_free, dq_ready, dq_free, turn))


if HAVE_GLUON:
    _fp8_loader = B._fp8_loader
    N_VEC_C = B.N_VEC_C
    from flamia.ops.kmajor import mma_key_order_gluon

    @gluon.jit
    def _pp_fp8_compute(q_smem, qt_smem, do_smem, dot_smem, k_smem, v_smem, kt_smem, vec_smem,
                        ds_smem, dq_smem, kv_ready, kt_ready, q_ready, do_ready, q_free,
                        dq_ready, dq_free, turn, ITEMS, N_ITEMS, GROUP, CPT, CDS, SK, SV, SKD,
                        SVD, DK, DV, T, stride_kt, sm_scale, WG: gl.constexpr,
                        CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, ROTATE: gl.constexpr):
        """The fp8 kernel's step (backward_sm90._fp8_compute) for MMA warpgroup WG alone: keys
        [64 WG, 64 WG + 64) of the block, its own partial dQ over them (two N halves)."""
        STAGES: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        D: gl.constexpr = q_smem.type.shape[2]
        BN: gl.constexpr = k_smem.type.shape[1]
        KW: gl.constexpr = BN // 2
        DH: gl.constexpr = D // 2
        NV: gl.constexpr = vec_smem.type.shape[0] // STAGES
        f8: gl.constexpr = gl.float8e4nv
        s_layout: gl.constexpr = wgmma_layout(4, 1, BM, 32)           # S^T, dP^T (KW, BM)
        kv_layout: gl.constexpr = wgmma_layout(4, 1, D, 32)           # dK, dV (KW, D)
        dq_layout: gl.constexpr = wgmma_layout(4, 1, DH, 32)          # partial dQ half
        a_layout: gl.constexpr = gl.DotOperandLayout(0, kv_layout, 4)
        col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        ds_w = ds_smem.index(WG)
        dq_w = dq_smem.index(WG)
        kt_w = kt_smem.slice(WG * KW, KW, dim=1)                        # K^T of this warpgroup's keys

        item = gl.program_id(0)
        doc, blk, start, L, pq, kvh = _item(ITEMS, N_ITEMS)
        if doc >= 0:
            kb0 = blk * BN
            k0 = kb0 + WG * KW
            m_lo, n_m = _query_blocks(kb0, L, BM, CAUSAL)
            c_pt = gl.load(CPT + item)
            c_ds = gl.load(CDS + item)
            kv_row = kvh.to(gl.int64) * T + start + kb0
            skb = gl.load(SK + kv_row)
            svb = gl.load(SV + kv_row)
            lcpt = gl.where(c_pt > 0.0, gl.log2(c_pt), 0.0)
            ratio = gl.where(c_ds > 0.0, c_pt / c_ds, 0.0)
            u_off = c_ds * skb
            if CAUSAL:
                keys = WG * KW + gl.arange(0, KW, layout=row_l)
                kin = keys < L - kb0
                skt = gl.expand_dims(gl.load(SKD + kv_row + keys, mask=kin, other=0.0), 1)
                svt = gl.expand_dims(gl.load(SVD + kv_row + keys, mask=kin, other=0.0), 1)
            mbarrier.wait(kv_ready, 0)
            dk = gl.zeros([KW, D], gl.float32, kv_layout)
            dv = gl.zeros([KW, D], gl.float32, kv_layout)
            for i in range(GROUP * n_m):
                q0 = (m_lo + i % n_m) * BM
                if CAUSAL:
                    diag = q0 < kb0 + BN
                else:
                    diag = q0 < 0
                s = i % STAGES
                ph = (i // STAGES) & 1
                c = diag.to(gl.int32)
                mbarrier.wait(q_ready.index(s), ph)
                if PINGPONG:
                    _await_turn(turn, 2 * i, WG)
                st = warpgroup_mma(k_smem.index(c).slice(WG * KW, KW),
                                   q_smem.index(s).permute((1, 0)),
                                   gl.zeros([KW, BM], gl.float32, s_layout), use_acc=False,
                                   is_async=True)
                mbarrier.wait(do_ready.index(s), ph)
                dpt = warpgroup_mma(v_smem.index(c).slice(WG * KW, KW),
                                    do_smem.index(s).permute((1, 0)),
                                    gl.zeros([KW, BM], gl.float32, s_layout), use_acc=False,
                                    is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(1 - WG), count=1)
                st = warpgroup_mma_wait(1, deps=[st])
                edge_q = q0 + BM > L
                if CAUSAL:
                    masked = diag | edge_q | (kb0 + BN > L)
                else:
                    masked = edge_q | (kb0 + BN > L)
                va = gl.expand_dims(_column_vector(vec_smem, s * NV, col_l), 0)
                if CAUSAL:
                    if diag:
                        xt = (st * skt) * va
                    else:
                        xt = st * (va * skb)
                else:
                    xt = st * (va * skb)
                vb = gl.expand_dims(_column_vector(vec_smem, s * NV + 1, col_l), 0) + lcpt
                xt = gl.exp2(xt - vb)
                if masked:
                    ok = _visible(k0, q0, L, KW, BM, s_layout, CAUSAL)
                    xt = gl.where(ok, xt, 0.0)
                dpt = warpgroup_mma_wait(0, deps=[dpt])
                vh = gl.expand_dims(_column_vector(vec_smem, s * NV + 2, col_l), 0) * ratio
                if CAUSAL:
                    if diag:
                        yt = (dpt * svt) * vh
                    else:
                        yt = dpt * (vh * svb)
                else:
                    yt = dpt * (vh * svb)
                ve = gl.expand_dims(_column_vector(vec_smem, s * NV + 3, col_l), 0) * ratio
                yt = xt * (yt - ve)
                if masked:
                    yt = gl.where(_visible(k0, q0, L, KW, BM, s_layout, CAUSAL), yt, 0.0)
                xa = gl.convert_layout(mma_key_order_gluon(xt.to(f8)), a_layout)
                if not PINGPONG:
                    dv = warpgroup_mma(xa, dot_smem.index(s).permute((1, 0)), dv, is_async=True)
                y8 = yt.to(f8)
                ds_w.permute((1, 0)).store(y8)        # dS for dQ: keys contiguous
                fence_async_shared()
                gl.thread_barrier()                   # this partition's 4 warps only
                ya = gl.convert_layout(mma_key_order_gluon(y8), a_layout)
                mbarrier.wait(kt_ready, 0)
                if PINGPONG:
                    _await_turn(turn, 2 * i + 1, WG)
                    dv = warpgroup_mma(xa, dot_smem.index(s).permute((1, 0)), dv, is_async=True)
                dq0 = warpgroup_mma(ds_w, kt_w.slice(0, DH).permute((1, 0)),
                                    gl.zeros([BM, DH], gl.float32, dq_layout), use_acc=False,
                                    is_async=True)
                dk = warpgroup_mma(ya, qt_smem.index(s).permute((1, 0)), dk, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(1 - WG), count=1)
                dv, dq0 = warpgroup_mma_wait(1, deps=[dv, dq0])
                mbarrier.wait(dq_free.index(WG), (i + 1) & 1, pred=i >= 1)
                dq_w.slice(0, DH, dim=1).store(dq0 * u_off)
                dq1 = warpgroup_mma(ds_w, kt_w.slice(DH, DH).permute((1, 0)),
                                    gl.zeros([BM, DH], gl.float32, dq_layout), use_acc=False,
                                    is_async=True)
                dk = warpgroup_mma_wait(1, deps=[dk])
                dq1 = warpgroup_mma_wait(0, deps=[dq1])
                dq_w.slice(DH, DH, dim=1).store(dq1 * u_off)
                fence_async_shared()
                gl.thread_barrier()      # one barrier releases the Q / dO stage and the dQ tile
                arrive_synced(dq_ready.index(WG))
                arrive_synced(q_free.index(s))
            rows = gl.expand_dims(k0 + gl.arange(0, KW, layout=gl.SliceLayout(1, kv_layout)), 1)
            cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout)), 0)
            offs = (start + rows).to(gl.int64) * stride_kt + kvh * D + cols
            keep = rows < L
            gl.store(DV + offs, (dv * c_pt).to(DV.dtype.element_ty), mask=keep)
            dk = dk * (sm_scale * c_ds)
            if ROTATE:    # this warpgroup's dQ buffer, once the writer is done with it, holds H
                n = GROUP * n_m
                mbarrier.wait(dq_free.index(WG), (n + 1) & 1, pred=n >= 1)
                dk = B._rotate_back_rows(dk, dq_w, 4)
            gl.store(DK + offs, dk.to(DK.dtype.element_ty), mask=keep)

    @gluon.jit(do_not_specialize=["N_ITEMS", "T"])
    def _attn_bwd_pingpong_fp8_kernel(q_desc, qt_desc, do_desc, dot_desc, k_desc, kd_desc,
                                      v_desc, vd_desc, kt_desc, vec_desc, dq_desc, DK, DV,
                                      ITEMS, N_ITEMS, GROUP, HQ, CPT, CDS, SK, SV, SKD, SVD,
                                      T, stride_kt, sm_scale,
                                      BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                                      STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                      PINGPONG: gl.constexpr, ROTATE: gl.constexpr,
                                      MMA_REGS_: gl.constexpr, LOADER_REGS: gl.constexpr,
                                      DQ_REGS: gl.constexpr):
        f8: gl.constexpr = gl.float8e4nv
        q_smem = gl.allocate_shared_memory(f8, [STAGES, BM, D], q_desc.layout)
        qt_smem = gl.allocate_shared_memory(f8, [STAGES, D, BM], qt_desc.layout)
        do_smem = gl.allocate_shared_memory(f8, [STAGES, BM, D], do_desc.layout)
        dot_smem = gl.allocate_shared_memory(f8, [STAGES, D, BM], dot_desc.layout)
        k_smem = gl.allocate_shared_memory(f8, [2, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(f8, [2, BN, D], v_desc.layout)
        kt_smem = gl.allocate_shared_memory(f8, [D, BN], kt_desc.layout)
        vec_smem = gl.allocate_shared_memory(gl.float32, [STAGES * N_VEC_C, 1, BM],
                                             vec_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8,
                                                       rank=2)
        ds_smem = gl.allocate_shared_memory(f8, [2, BM, BN // 2], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BM, D], dq_desc.layout)
        kv_ready, kt_ready = alloc_barriers(1).index(0), alloc_barriers(1).index(0)
        q_ready, do_ready = alloc_barriers(STAGES), alloc_barriers(STAGES)
        q_free = alloc_barriers(STAGES, 2)
        dq_ready, dq_free = alloc_barriers(2), alloc_barriers(2)
        turn = alloc_barriers(2)
        gl.warp_specialize([
            (_pp_fp8_compute, (q_smem, qt_smem, do_smem, dot_smem, k_smem, v_smem, kt_smem,
                               vec_smem, ds_smem, dq_smem, kv_ready, kt_ready, q_ready, do_ready,
                               q_free, dq_ready, dq_free, turn, ITEMS, N_ITEMS, GROUP, CPT, CDS,
                               SK, SV, SKD, SVD, DK, DV, T, stride_kt, sm_scale, 0, CAUSAL,
                               PINGPONG, ROTATE)),
            (_pp_fp8_compute, (q_smem, qt_smem, do_smem, dot_smem, k_smem, v_smem, kt_smem,
                               vec_smem, ds_smem, dq_smem, kv_ready, kt_ready, q_ready, do_ready,
                               q_free, dq_ready, dq_free, turn, ITEMS, N_ITEMS, GROUP, CPT, CDS,
                               SK, SV, SKD, SVD, DK, DV, T, stride_kt, sm_scale, 1, CAUSAL,
                               PINGPONG, ROTATE)),
            (_fp8_loader, (q_desc, qt_desc, do_desc, dot_desc, k_desc, kd_desc, v_desc, vd_desc,
                           kt_desc, vec_desc, q_smem, qt_smem, do_smem, dot_smem,
                           k_smem, v_smem, kt_smem, vec_smem, kv_ready, kt_ready,
                           q_ready, do_ready, q_free, ITEMS, N_ITEMS, GROUP, HQ, CAUSAL)),
            (_pp_dq_writer, (dq_desc, dq_smem, dq_ready, dq_free, ITEMS, N_ITEMS, GROUP, BN,
                             CAUSAL)),
        ], [4, 1, 1], [MMA_REGS_, LOADER_REGS, DQ_REGS])
        mbarrier.invalidate(kv_ready)
        mbarrier.invalidate(kt_ready)
        invalidate_barriers((q_ready, do_ready, q_free, dq_ready, dq_free, turn))


def _token_order(kt8):
    """The prep's K^T (columns in pair order, which the library stores dS in) with its columns
    back in token order, which this kernel stores dS in: one gather of the Hkv x D x QR bytes,
    inside the timed call (a cost the library does not pay)."""
    from flamia.ops.kmajor import pair_order16_host
    cols = torch.arange(kt8.shape[2], device=kt8.device)
    src = torch.empty_like(cols)
    src[pair_order16_host(cols)] = cols
    return kt8.view(torch.uint8).index_select(2, src).view(kt8.dtype)


def attention_backward_pingpong_fp8(dout, out, lse, row_max, qkv, cu_seqlens, causal=True,
                                    softmax_scale=None, pingpong=False):
    """(dq, dk, dv) as flamia.ops.backward_sm90.attention_backward_sm90_fp8 (unordered dQ adds)
    through the split-warpgroup fp8 kernel above; its preprocess and post pass are the
    library's."""
    T, Hq, D = qkv.q8.shape
    Hkv = qkv.k8.shape[1]
    cfg = sm90_backward_config(D)
    BM, BN = cfg.block_m, SM90_BLOCK_N
    dev = dout.device
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    dout, out = dout.contiguous(), out.contiguous()
    dq, dk, dv = B._grads(T, Hq, Hkv, D, dout.dtype, dev)
    if T == 0:
        return dq, dk, dv
    prep = B.fp8_prepare(dout, out, lse, row_max, qkv, cu_seqlens, causal, scale, cfg)
    kb, QR = prep.kb, prep.kb.q_rows
    k8d, v8d, skd, svd = ((qkv.k8_diag, qkv.v8_diag, qkv.sk_diag, qkv.sv_diag) if causal
                          else (qkv.k8, qkv.v8, qkv.sk, qkv.sv))
    descs = (
        descriptor_2d(qkv.q8, T, Hq * D, Hq * D, [BM, D]),
        descriptor_2d(prep.qt8, Hq * D, QR, QR, [D, BM]),
        descriptor_2d(prep.do8, T, Hq * D, Hq * D, [BM, D]),
        descriptor_2d(prep.dot8, Hq * D, QR, QR, [D, BM]),
        descriptor_2d(qkv.k8, T, Hkv * D, Hkv * D, [BN, D]),
        descriptor_2d(k8d, T, Hkv * D, Hkv * D, [BN, D]),
        descriptor_2d(qkv.v8, T, Hkv * D, Hkv * D, [BN, D]),
        descriptor_2d(v8d, T, Hkv * D, Hkv * D, [BN, D]),
        descriptor_2d(_token_order(prep.kt8), Hkv * D, QR, QR, [D, BN]),
        descriptor_2d(prep.vec, B.N_VEC * Hq, QR, QR, [1, BM]),
        descriptor_2d(prep.dq_acc, QR, Hq * D, Hq * D, [BM, D]),
    )
    _attn_bwd_pingpong_fp8_kernel[(kb.n_items,)](
        *descs, dk, dv, kb.items, kb.n_items, Hq // Hkv, Hq, prep.cpt, prep.cds, qkv.sk,
        qkv.sv, skd, svd, T, Hkv * D, scale, BM=BM, BN=BN, D=D, STAGES=SM90_STAGES,
        CAUSAL=bool(causal), PINGPONG=bool(pingpong), ROTATE=bool(qkv.rotated),
        MMA_REGS_=MMA_REGS, LOADER_REGS=SM90_LOADER_REGS, DQ_REGS=SM90_DQ_REGS, num_warps=4)
    B.fp8_post(prep.dq_acc, kb.prow, qkv.sq, bool(qkv.rotated), scale, dq, cfg)
    return dq, dk, dv


def attention_backward_pingpong(dout, out, lse, q, k, v, cu_seqlens, causal=True,
                                softmax_scale=None, pingpong=False):
    """(dq, dk, dv) as flamia.ops.backward_sm90.attention_backward_sm90 (default unordered dQ
    adds), through the split-warpgroup kernel above (pingpong: GEMM bursts in turns)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    cfg = sm90_backward_config(D)
    BM, BN = cfg.block_m, SM90_BLOCK_N
    dev = q.device
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    q, k, v, dout, out = (x.contiguous() for x in (q, k, v, dout, out))
    dq, dk, dv = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    if T == 0:
        return dq, dk, dv
    kb = per_cu_seqlens(cu_seqlens, ("bwd_sm90", T, BM, BN, bool(causal), Hkv),
                        lambda: B.key_blocks(cu_seqlens, T, BM, BN, causal, Hkv))
    QR = kb.q_rows
    lse2 = torch.empty((Hq, QR), dtype=torch.float32, device=dev)
    delta = torch.empty((Hq, QR), dtype=torch.float32, device=dev)
    dq_acc = torch.zeros((QR, Hq, D), dtype=torch.float32, device=dev)
    grid_t = (triton.cdiv(T, SM90_PASS_ROWS), Hq)
    B._bwd_preprocess[grid_t](out, dout, lse.contiguous(), kb.prow, lse2, delta, T, QR, Hq * D,
                              D=D, BT=SM90_PASS_ROWS, num_warps=4)
    descs = (descriptor_2d(q, T, Hq * D, Hq * D, [BM, D]),
             descriptor_2d(dout, T, Hq * D, Hq * D, [BM, D]),
             descriptor_2d(k, T, Hkv * D, Hkv * D, [BN, D]),
             descriptor_2d(v, T, Hkv * D, Hkv * D, [BN, D]),
             descriptor_2d(lse2, Hq, QR, QR, [1, BM]),
             descriptor_2d(delta, Hq, QR, QR, [1, BM]),
             descriptor_2d(dq_acc, QR, Hq * D, Hq * D, [BM, D]))
    _attn_bwd_pingpong_kernel[(kb.n_items,)](
        *descs, dk, dv, kb.items, kb.n_items, Hq // Hkv, Hkv * D, scale * LOG2E, scale,
        BM=BM, BN=BN, D=D, STAGES=SM90_STAGES, CAUSAL=bool(causal), PINGPONG=bool(pingpong),
        MMA_REGS_=MMA_REGS,
        LOADER_REGS=SM90_LOADER_REGS, DQ_REGS=SM90_DQ_REGS, num_warps=4)
    B._bwd_postprocess[grid_t](dq_acc, kb.prow, dq, T, scale, Hq * D, D=D, BT=SM90_PASS_ROWS,
                               num_warps=4)
    return dq, dk, dv


def check(seed: int = 5) -> bool:
    """GPU: random packed cases (0/1/2-token documents, GQA, D 64 / 128, causal and not), memory
    poisoned with NaN first; dK, dV against the library kernel (bitwise expected: the same
    per-key arithmetic) and dq, dk, dv against float64 within the library check's bound."""
    from bwd_sm90_dev import poison, ref_attention, rel
    from flamia.inputs import cu_seqlens_from_lengths
    g = torch.Generator().manual_seed(seed)
    ok_all = True
    cases = [([700, 0, 1, 2, 513, 129, 64], 8, 2), ([2048, 1, 900], 4, 4), ([300], 6, 1),
             ([64, 64, 1, 127, 129], 32, 8)]
    for lengths, Hq, Hkv in cases:
        for D in (64, 128):
            for causal in (True, False):
                T = sum(lengths)
                q, k, v, do = (torch.randn(T, h, D, generator=g).to(torch.bfloat16).cuda()
                               for h in (Hq, Hkv, Hkv, Hq))
                cu = cu_seqlens_from_lengths(lengths, device="cuda")
                scale = D ** -0.5
                o64, lse, *g64 = ref_attention(q, k, v, do, cu, causal, scale)
                o = o64.to(torch.bfloat16)
                lse = lse.float().contiguous()
                poison()
                lib = B.attention_backward_sm90(do, o, lse, q, k, v, cu, causal, scale)
                lib_errs = [rel(x, r) for x, r in zip(lib, g64)]
                for pp in (False, True):
                    poison()
                    got = attention_backward_pingpong(do, o, lse, q, k, v, cu, causal, scale,
                                                      pingpong=pp)
                    errs = [rel(x, r) for x, r in zip(got, g64)]
                    same = [torch.equal(a, b) for a, b in zip(got[1:], lib[1:])]
                    finite = all(bool(torch.isfinite(x).all()) for x in got)
                    ok = finite and all(e <= 2 * le + 1e-3 for e, le in zip(errs, lib_errs))
                    ok_all &= ok
                    print(f"{'ok  ' if ok else 'FAIL'} pingpong={pp} {lengths} {Hq}/{Hkv} D={D} "
                          f"causal={causal}: dq/dk/dv rel err {errs[0]:.2e}/{errs[1]:.2e}/"
                          f"{errs[2]:.2e} (library {lib_errs[0]:.2e}/{lib_errs[1]:.2e}/"
                          f"{lib_errs[2]:.2e}); dk, dv bitwise the library's: {same}", flush=True)
    ok_all &= check_fp8(g)
    return ok_all


def _fp8_inputs(lengths, Hq, Hkv, D, causal, g):
    """bf16 q, k, v, dO, the flamia bf16 forward's out / lse (standing in for the fp8 forward's
    out, lse and row max: the backward's work does not depend on them) and quantize_qkv's fp8
    operands, as bwd_sm90_dev.py times the fp8 kernel."""
    import flamia
    from flamia.inputs import cu_seqlens_from_lengths
    from flamia.ops.quantize import quantize_qkv
    T = sum(lengths)
    q, k, v, do = (torch.randn(T, h, D, generator=g).to(torch.bfloat16).cuda()
                   for h in (Hq, Hkv, Hkv, Hq))
    cu = cu_seqlens_from_lengths(lengths, device="cuda")
    m = max(lengths)
    o, lse = flamia.flamia_attn_varlen_func(q, k, v, cu, cu, m, m, recipe="bf16", causal=causal,
                                            return_lse=True, check_finite=False)
    return do, o, lse.contiguous(), quantize_qkv(q, k, v, cu, "fp8", causal), cu


def check_fp8(g) -> bool:
    """GPU: the split fp8 kernel against the library's fp8 kernel on the same operands (memory
    poisoned): dk, dv bitwise expected, dq equal up to the order of fp32 adds."""
    from bwd_sm90_dev import poison
    ok_all = True
    for lengths, Hq, Hkv in (([700, 0, 1, 2, 513, 129, 64], 8, 2), ([2048, 1, 900], 4, 4),
                             ([64, 64, 1, 127, 129], 32, 8)):
        for D in (64, 128):
            for causal in (True, False):
                do, o, lse, qkv, cu = _fp8_inputs(lengths, Hq, Hkv, D, causal, g)
                poison()
                lib = B.attention_backward_sm90_fp8(do, o, lse, lse, qkv, cu, causal)
                for pp in (False, True):
                    poison()
                    got = attention_backward_pingpong_fp8(do, o, lse, lse, qkv, cu, causal,
                                                          pingpong=pp)
                    finite = all(bool(torch.isfinite(x).all()) for x in got)
                    same = [torch.equal(a, b) for a, b in zip(got[1:], lib[1:])]
                    dq_rel = ((got[0].double() - lib[0].double()).norm()
                              / lib[0].double().norm().clamp_min(1e-30)).item()
                    close = all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3)
                                for a, b in zip(got[1:], lib[1:]))
                    ok = finite and close and dq_rel < 1e-2
                    ok_all &= ok
                    print(f"{'ok  ' if ok else 'FAIL'} fp8 pingpong={pp} {lengths} {Hq}/{Hkv} "
                          f"D={D} causal={causal}: dq rel diff to the library {dq_rel:.2e}; "
                          f"dk, dv bitwise the library's: {same}", flush=True)
    return ok_all


def time_suite(names):
    """GPU: whole backward (pre + kernel + post) ms, library kernel vs this one, one process."""
    import json

    from bwd_sm90_dev import cuda_ms
    from flamia.inputs import cu_seqlens_from_lengths
    wl = json.load(open(os.path.join(os.path.dirname(__file__), "..", "flamia", "data",
                                     "workloads.json")))["workloads"]
    print("| workload | recipe | library ms | split ms | split + ping-pong ms | library / split "
          "| library / ping-pong |\n| --- | --- | --- | --- | --- | --- | --- |")
    for w in wl:
        if names and w["name"] not in names:
            continue
        lengths, Hq, Hkv, D = w["doc_lengths"], w["heads_q"], w["heads_kv"], w["head_dim"]
        T = sum(lengths)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(T, h, D, device="cuda", generator=gen).to(torch.bfloat16)
                       for h in (Hq, Hkv, Hkv, Hq))
        cu = cu_seqlens_from_lengths(lengths, device="cuda")
        o = torch.randn_like(q)
        lse = torch.randn(Hq, T, device="cuda").abs() + 5
        lib = cuda_ms(lambda: B.attention_backward_sm90(do, o, lse, q, k, v, cu, True))
        new = cuda_ms(lambda: attention_backward_pingpong(do, o, lse, q, k, v, cu, True))
        pp = cuda_ms(lambda: attention_backward_pingpong(do, o, lse, q, k, v, cu, True,
                                                         pingpong=True))
        print(f"| {w['name']} | bf16 | {lib:.3f} | {new:.3f} | {pp:.3f} | {lib / new:.3f} | "
              f"{lib / pp:.3f} |", flush=True)
        from flamia.ops.quantize import quantize_qkv
        qkv = quantize_qkv(q, k, v, cu, "fp8", True)
        lib = cuda_ms(lambda: B.attention_backward_sm90_fp8(do, o, lse, lse, qkv, cu, True))
        new = cuda_ms(lambda: attention_backward_pingpong_fp8(do, o, lse, lse, qkv, cu, True))
        pp = cuda_ms(lambda: attention_backward_pingpong_fp8(do, o, lse, lse, qkv, cu, True,
                                                             pingpong=True))
        print(f"| {w['name']} | fp8 | {lib:.3f} | {new:.3f} | {pp:.3f} | {lib / new:.3f} | "
              f"{lib / pp:.3f} |", flush=True)


def compile_report(dims, lines, pingpong=False, fp8=False):
    """CPU: the sm_90a build per D (bwd_sm90_compile.report)."""
    from benchmarks.bwd_sm90_compile import report
    from benchmarks.tools.compile import compile_only, fake_qkv
    for D in dims:
        T, Hq, Hkv = 1024, 8, 2
        q, k, v, do, o = (torch.randn(T, h, D).to(torch.bfloat16)
                          for h in (Hq, Hkv, Hkv, Hq, Hq))
        cu = torch.tensor([0, 300, T], dtype=torch.int32)
        with compile_only() as built:
            if fp8:
                attention_backward_pingpong_fp8(do, o, torch.zeros(Hq, T), torch.zeros(Hq, T),
                                                fake_qkv(T, Hq, Hkv, D, "fp8"), cu, True,
                                                pingpong=pingpong)
            else:
                attention_backward_pingpong(do, o, torch.zeros(Hq, T), q, k, v, cu, True,
                                            pingpong=pingpong)
        kern = dict(built)["_attn_bwd_pingpong_fp8_kernel" if fp8 else
                           "_attn_bwd_pingpong_kernel"]
        report(kern, f"{'fp8' if fp8 else 'bf16'} D={D} pingpong={pingpong}", True, lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--lines", action="store_true", help="the main loop's opcodes per line")
    ap.add_argument("--check", action="store_true", help="GPU: accuracy vs float64 and the "
                    "library kernel")
    ap.add_argument("--time", action="store_true", help="GPU: whole backward vs the library")
    ap.add_argument("--workloads", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        for fp8 in (False, True):
            for pp in (False, True):
                compile_report([int(x) for x in args.dims.split(",")], args.lines, pp, fp8)
        return
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    ok = check() if args.check else True
    if args.time:
        time_suite([x for x in args.workloads.split(",") if x])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
