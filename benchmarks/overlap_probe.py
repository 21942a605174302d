"""Do tensor-core work and CUDA-core work overlap on one H200 SM? A probe, not a kernel of ours.

    python benchmarks/overlap_probe.py                 # on the H200: the table below
    python benchmarks/overlap_probe.py --compile-only  # CPU: build both probes for sm_90a

Session 11 (benchmarks/NOTES.md, item 6) found every kernel's tile time close to its GEMM time
*plus* its element-wise issue time, as if the SM alternated between the two instead of running
one CTA's exp / scale work under the other CTA's wgmmas. This asks the hardware directly, with
synthetic loops that have no memory traffic in them:

  ws    one CTA per SM, two warpgroups: warpgroup 0 only issues fp8 wgmmas (m64 n128 k128, both
        operands in shared memory, random data), warpgroup 1 only runs element-wise loops on a
        64 x 128 fp32 tile in registers. Each alone, then both at once.
  alt   the shape of our kernels: one warpgroup per CTA doing wgmma -> wait -> element-wise on
        its result, tile after tile; one CTA per SM, then two (the same work per CTA).

Element-wise kinds: ffma (x = x * a + b), exp (x = exp2(x * a - b): FFMA + MUFU.EX2), soft (a
softmax step: row max, exp2, row sum, e4m3 cast of the result).

Reading it: both-at-once time near max(alone times) means the SM overlaps them; near the sum
means it does not, and no schedule of our warps can hide one under the other.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

BM, BN, BK = 64, 128, 128      # the forward's S tile: m64 n128, k = head dim 128
NB = 6                          # B tiles cycled through (6 x 16 KB: two probe CTAs per SM at most)
KINDS = {"ffma": 0, "exp": 1, "soft": 2}
_BM, _BN, _BK, _NB = gl.constexpr(BM), gl.constexpr(BN), gl.constexpr(BK), gl.constexpr(NB)
_A_LAYOUT = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv))
_B_LAYOUT = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv))


@gluon.constexpr_function
def _acc_layout(num_warps):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, _BN, 32])


@gluon.jit
def _fill(a_ptr, b_ptr, a_smem, b_smem, num_warps: gl.constexpr):
    """Random fp8 operands from global into shared memory, once."""
    L: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
    r = gl.arange(0, _BM, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, _BK, layout=gl.SliceLayout(0, L))
    a_smem.store(gl.load(a_ptr + gl.expand_dims(r, 1) * _BK + gl.expand_dims(c, 0)))
    rb = gl.arange(0, _BN, layout=gl.SliceLayout(1, L))
    for i in gl.static_range(_NB):
        ptr = b_ptr + i * _BN * _BK + gl.expand_dims(rb, 1) * _BK + gl.expand_dims(c, 0)
        b_smem.index(i).store(gl.load(ptr))
    fence_async_shared()


@gluon.jit
def _stamp(clk_ptr, slot: gl.constexpr, num_warps: gl.constexpr):
    """Thread 0 records (%clock64, %globaltimer) at slot 0 (start) or 1 (end) of its CTA's row:
    the SM clock the CTA actually ran at (the H200 lowers it under load; we only read it)."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    i = gl.arange(0, 32 * num_warps, layout=L)
    clk = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [i], dtype=gl.int64,
                                    is_pure=False, pack=1)
    ns = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [i], dtype=gl.int64,
                                   is_pure=False, pack=1)
    base = clk_ptr + gl.program_id(0) * 4 + slot * 2 + i * 0
    gl.store(base, clk, mask=i == 0)
    gl.store(base + 1, ns, mask=i == 0)


@gluon.jit
def _elementwise(x, KIND: gl.constexpr):
    """One tile's worth of element-wise work on the 64 x 128 fp32 tile x."""
    if KIND == 0:
        x = x * 0.999 + 0.001
    elif KIND == 1:
        x = gl.exp2(x * 0.999 - 0.5)
    else:
        m = gl.max(x, axis=1)
        p = gl.exp2(x * 0.999 - gl.expand_dims(m, 1))
        s = gl.sum(p, axis=1)
        p8 = p.to(gl.float8e4nv)
        # back to fp32 so the chain continues (the cast must not be dead code)
        x = p8.to(gl.float32) + gl.expand_dims(s, 1) * 0.001
    return x


@gluon.jit
def _mma_role(a_smem, b_smem, out_ptr, MMA_ITERS, num_warps: gl.constexpr):
    LACC: gl.constexpr = _acc_layout(num_warps)
    acc = gl.zeros([_BM, _BN], gl.float32, LACC)
    for i in range(MMA_ITERS):
        acc = warpgroup_mma(a_smem, b_smem.index(i % _NB).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
    r = gl.arange(0, _BM, layout=gl.SliceLayout(1, LACC))
    c = gl.arange(0, _BN, layout=gl.SliceLayout(0, LACC))
    gl.store(out_ptr + gl.program_id(0) * _BM * _BN + gl.expand_dims(r, 1) * _BN +
             gl.expand_dims(c, 0), acc)


@gluon.jit
def _alu_role(x_ptr, ALU_ITERS, KIND: gl.constexpr, num_warps: gl.constexpr):
    LACC: gl.constexpr = _acc_layout(num_warps)
    r = gl.arange(0, _BM, layout=gl.SliceLayout(1, LACC))
    c = gl.arange(0, _BN, layout=gl.SliceLayout(0, LACC))
    offs = gl.program_id(0) * _BM * _BN + gl.expand_dims(r, 1) * _BN + gl.expand_dims(c, 0)
    x = gl.load(x_ptr + offs)
    for i in range(ALU_ITERS):
        x = _elementwise(x, KIND)
    gl.store(x_ptr + offs, x)


@gluon.jit
def _probe_ws_kernel(a_ptr, b_ptr, out_ptr, x_ptr, clk_ptr, MMA_ITERS, ALU_ITERS,
                     KIND: gl.constexpr, ALU_REGS: gl.constexpr, num_warps: gl.constexpr):
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [_BM, _BK], _A_LAYOUT)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [_NB, _BN, _BK], _B_LAYOUT)
    _fill(a_ptr, b_ptr, a_smem, b_smem, num_warps)
    _stamp(clk_ptr, 0, num_warps)
    gl.warp_specialize([
        (_mma_role, (a_smem, b_smem, out_ptr, MMA_ITERS, num_warps)),
        (_alu_role, (x_ptr, ALU_ITERS, KIND, 4)),
    ], [4], [ALU_REGS])
    _stamp(clk_ptr, 1, num_warps)


@gluon.jit
def _alt_loop(a_smem, b_smem, out_ptr, ITERS, ALU_REPS, turn, KIND: gl.constexpr,
              MMA: gl.constexpr, PP: gl.constexpr, CID: gl.constexpr, NC: gl.constexpr,
              num_warps: gl.constexpr):
    """Our kernels' shape: wgmma, wait, element-wise on its result (ALU_REPS passes), repeat.
    MMA=False: the same loop with the wgmma replaced by an FFMA (element-wise alone). PP: two
    such loops in one CTA take turns issuing their wgmma (FA3's ping-pong: the turn is handed
    over right after the issue, so the other's wgmma queues behind this one)."""
    LACC: gl.constexpr = _acc_layout(num_warps)
    r = gl.arange(0, _BM, layout=gl.SliceLayout(1, LACC))
    c = gl.arange(0, _BN, layout=gl.SliceLayout(0, LACC))
    # a non-uniform stand-in for the wgmma result (a uniform one folds to scalars)
    x0 = (gl.expand_dims(r, 1) * _BN + gl.expand_dims(c, 0)).to(gl.float32) * 1e-4
    carry = gl.zeros([_BM, _BN], gl.float32, LACC)
    for i in range(ITERS):
        if MMA:
            if PP:
                mbarrier.wait(turn.index(CID), (i + CID + 1) & 1, pred=(i + CID) > 0)
            s = warpgroup_mma(a_smem, b_smem.index(i % _NB).permute((1, 0)),
                              gl.zeros([_BM, _BN], gl.float32, LACC), use_acc=False,
                              is_async=True)
            if PP:
                mbarrier.arrive(turn.index(1 - CID), count=1)
            s = warpgroup_mma_wait(0, deps=[s])
        else:
            s = carry * 0.5 + x0
        for _ in range(ALU_REPS):
            s = _elementwise(s, KIND)
        carry = carry + s
    gl.store(out_ptr + (gl.program_id(0) * NC + CID) * _BM * _BN + gl.expand_dims(r, 1) * _BN +
             gl.expand_dims(c, 0), carry)


@gluon.jit
def _probe_alt_kernel(a_ptr, b_ptr, out_ptr, clk_ptr, ITERS, ALU_REPS, KIND: gl.constexpr,
                      MMA: gl.constexpr, num_warps: gl.constexpr):
    """One warpgroup per CTA running _alt_loop (two CTAs share an SM at grid = 2 x SMs)."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [_BM, _BK], _A_LAYOUT)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [_NB, _BN, _BK], _B_LAYOUT)
    _fill(a_ptr, b_ptr, a_smem, b_smem, num_warps)
    _stamp(clk_ptr, 0, num_warps)
    _alt_loop(a_smem, b_smem, out_ptr, ITERS, ALU_REPS, a_smem, KIND, MMA, False, 0, 1,
              num_warps)
    _stamp(clk_ptr, 1, num_warps)


@gluon.jit
def _pair_setup(a_ptr, b_ptr, clk_ptr, num_warps: gl.constexpr):
    """Shared operands, the two turn barriers and the start stamp of a two-warpgroup probe."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [_BM, _BK], _A_LAYOUT)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [_NB, _BN, _BK], _B_LAYOUT)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    _fill(a_ptr, b_ptr, a_smem, b_smem, num_warps)
    _stamp(clk_ptr, 0, num_warps)
    return a_smem, b_smem, turn


@gluon.jit
def _probe_alt2_kernel(a_ptr, b_ptr, out_ptr, clk_ptr, ITERS, ALU_REPS, KIND: gl.constexpr,
                       PP: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr):
    """Two warpgroups of one CTA each running _alt_loop, with or without ping-pong turns."""
    a_smem, b_smem, turn = _pair_setup(a_ptr, b_ptr, clk_ptr, num_warps)
    gl.warp_specialize([
        (_alt_loop, (a_smem, b_smem, out_ptr, ITERS, ALU_REPS, turn, KIND, True, PP, 0, 2,
                     num_warps)),
        (_alt_loop, (a_smem, b_smem, out_ptr, ITERS, ALU_REPS, turn, KIND, True, PP, 1, 2, 4)),
    ], [4], [REGS])
    _stamp(clk_ptr, 1, num_warps)
    mbarrier.invalidate(turn.index(0))
    mbarrier.invalidate(turn.index(1))


@gluon.constexpr_function
def _shape_layouts(N, K, num_warps):
    return (gl.NVMMASharedLayout.get_default_for([64, K], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([N, K], gl.float8e4nv),
            gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                      instr_shape=[16, N, 32]))


@gluon.jit
def _probe_shape_kernel(a_ptr, b_ptr, out_ptr, clk_ptr, ITERS, N: gl.constexpr, K: gl.constexpr,
                        NBUF: gl.constexpr, NMMA: gl.constexpr, USE_ACC: gl.constexpr,
                        num_warps: gl.constexpr):
    """The wgmma rate of one tile shape as our kernels issue it: NMMA wgmmas m64 x N x K
    (independent accumulators, issued back to back), then a wait; fresh accumulators (USE_ACC
    False: an S / dP tile, consumed by one FADD per element) or accumulating (a dV / dK / O)."""
    AL: gl.constexpr = _shape_layouts(N, K, num_warps)[0]
    BL: gl.constexpr = _shape_layouts(N, K, num_warps)[1]
    LACC: gl.constexpr = _shape_layouts(N, K, num_warps)[2]
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [64, K], AL)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [NBUF, N, K], BL)
    L: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, K, layout=gl.SliceLayout(0, L))
    a_smem.store(gl.load(a_ptr + gl.expand_dims(r, 1) * K + gl.expand_dims(c, 0)))
    rb = gl.arange(0, N, layout=gl.SliceLayout(1, L))
    for i in gl.static_range(NBUF):
        b_smem.index(i).store(gl.load(b_ptr + i * N * K + gl.expand_dims(rb, 1) * K +
                                      gl.expand_dims(c, 0)))
    fence_async_shared()
    _stamp(clk_ptr, 0, num_warps)
    acc = gl.zeros([64, N], gl.float32, LACC)
    acc2 = gl.zeros([64, N], gl.float32, LACC)
    for i in range(ITERS):
        b1 = b_smem.index(i % NBUF).permute((1, 0))
        b2 = b_smem.index((i + 1) % NBUF).permute((1, 0))
        if USE_ACC:
            acc = warpgroup_mma(a_smem, b1, acc, is_async=True)
            if NMMA == 2:
                acc2 = warpgroup_mma(a_smem, b2, acc2, is_async=True)
                acc, acc2 = warpgroup_mma_wait(0, deps=[acc, acc2])
            else:
                acc = warpgroup_mma_wait(0, deps=[acc])
        else:
            s1 = warpgroup_mma(a_smem, b1, gl.zeros([64, N], gl.float32, LACC), use_acc=False,
                               is_async=True)
            if NMMA == 2:
                s2 = warpgroup_mma(a_smem, b2, gl.zeros([64, N], gl.float32, LACC),
                                   use_acc=False, is_async=True)
                s1, s2 = warpgroup_mma_wait(0, deps=[s1, s2])
                acc = acc + s1
                acc2 = acc2 + s2
            else:
                s1 = warpgroup_mma_wait(0, deps=[s1])
                acc = acc + s1
    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, LACC))
    co = gl.arange(0, N, layout=gl.SliceLayout(0, LACC))
    gl.store(out_ptr + gl.program_id(0) * 64 * N + gl.expand_dims(ro, 1) * N +
             gl.expand_dims(co, 0), acc + acc2)
    _stamp(clk_ptr, 1, num_warps)


@gluon.jit
def _fwd_softmax(s, m_i, l_i, sk, sv, AOP: gl.constexpr):
    """The forward's unmasked online-softmax step (forward_gluon._online_softmax, FOLD) with the
    per-key scales held in registers: -> (A operand e4m3(p sv), m, l, alpha)."""
    s = s * gl.expand_dims(sk, 0)
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * 0.125)
    p = gl.exp2(gl.fma(s, gl.full_like(s, 0.125), gl.expand_dims(-m_new, 1)))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    a = gl.convert_layout((p * gl.expand_dims(sv, 0)).to(gl.float8e4nv), AOP)
    return a, m_new, l_i, alpha


@gluon.jit
def _fwd_loop(q_smem, kv_smem, out_ptr, ITERS, turn, SCHED: gl.constexpr, PP: gl.constexpr,
              CID: gl.constexpr, NC: gl.constexpr, num_warps: gl.constexpr):
    """A synthetic forward: per tile S = Q K_j^T (m64 n128 k128, fresh), the online softmax,
    O += P V_j (m64 n128 k128, A = P from registers), O rescaled by alpha. No loads: K_j and
    V_j^T are fixed random tiles in shared memory. SCHED 0: every wgmma waited for at once;
    SCHED 1: S_j and PV_{j-1} in flight together, softmax_j under PV_{j-1} (the Gluon
    forward's order, FA3's), P_{j-1}'s e4m3 operand carried across the back edge; SCHED 2: the
    same overlap with the loop rotated so that S_j is carried instead (timing only: P's registers
    are not held while PV_j is in flight, the race flamia/ops/forward_gluon.py's _keep_alive
    prevents in the real kernel; the probe's results are never checked). PP (SCHED >= 1): two
    such loops take turns issuing."""
    LACC: gl.constexpr = _acc_layout(num_warps)
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=LACC, k_width=4)
    COLL: gl.constexpr = gl.SliceLayout(0, LACC)
    ROWL: gl.constexpr = gl.SliceLayout(1, LACC)
    c = gl.arange(0, _BN, layout=COLL)
    sk = 1.0 + c.to(gl.float32) * 1e-3
    sv = 1.0 - c.to(gl.float32) * 1e-3
    m_i = gl.full([_BM], -1e30, gl.float32, ROWL)
    l_i = gl.zeros([_BM], gl.float32, ROWL)
    acc = gl.zeros([_BM, _BN], gl.float32, LACC)
    zero = gl.zeros([_BM, _BN], gl.float32, LACC)
    if SCHED == 0:
        for j in range(ITERS):
            s = warpgroup_mma(q_smem, kv_smem.index(j % _NB).permute((1, 0)), zero,
                              use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            a, m_i, l_i, alpha = _fwd_softmax(s, m_i, l_i, sk, sv, AOP)
            acc = acc * gl.expand_dims(alpha, 1)
            acc = warpgroup_mma(a, kv_smem.index((j + 3) % _NB).permute((1, 0)), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
    elif SCHED == 2:
        # rotated: S_{j+1} is what crosses the back edge (fp32, the accumulator layout), and P_j
        # goes from the softmax to its PV wgmma inside one iteration; PV_j's accumulator
        # crosses in flight (the first iteration peeled so that it is in flight at the top)
        s = warpgroup_mma(q_smem, kv_smem.index(0).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        a, m_i, l_i, alpha = _fwd_softmax(s, m_i, l_i, sk, sv, AOP)
        s = warpgroup_mma(q_smem, kv_smem.index(1).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        acc = warpgroup_mma(a, kv_smem.index(3).permute((1, 0)), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s])
        for j in range(1, ITERS - 1):
            a, m_i, l_i, alpha = _fwd_softmax(s, m_i, l_i, sk, sv, AOP)
            acc = warpgroup_mma_wait(0, deps=[acc])            # PV_{j-1}
            acc = acc * gl.expand_dims(alpha, 1)
            if PP:
                mbarrier.wait(turn.index(CID), (j + CID) & 1, pred=(j + CID) > 1)
            s = warpgroup_mma(q_smem, kv_smem.index((j + 1) % _NB).permute((1, 0)), zero,
                              use_acc=False, is_async=True)
            acc = warpgroup_mma(a, kv_smem.index((j + 3) % _NB).permute((1, 0)), acc,
                                is_async=True)
            if PP:
                mbarrier.arrive(turn.index(1 - CID), count=1)
            s = warpgroup_mma_wait(1, deps=[s])               # S_{j+1}; PV_j stays in flight
        a, m_i, l_i, alpha = _fwd_softmax(s, m_i, l_i, sk, sv, AOP)
        acc = warpgroup_mma_wait(0, deps=[acc])
        acc = acc * gl.expand_dims(alpha, 1)
        acc = warpgroup_mma(a, kv_smem.index(2).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
    else:
        s = warpgroup_mma(q_smem, kv_smem.index(0).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        a, m_i, l_i, alpha = _fwd_softmax(s, m_i, l_i, sk, sv, AOP)
        for j in range(1, ITERS):
            if PP:
                mbarrier.wait(turn.index(CID), (j + CID) & 1, pred=(j + CID) > 1)
            s = warpgroup_mma(q_smem, kv_smem.index(j % _NB).permute((1, 0)), zero,
                              use_acc=False, is_async=True)
            acc = warpgroup_mma(a, kv_smem.index((j + 2) % _NB).permute((1, 0)), acc,
                                is_async=True)
            if PP:
                mbarrier.arrive(turn.index(1 - CID), count=1)
            s = warpgroup_mma_wait(1, deps=[s])
            a_new, m_i, l_i, alpha = _fwd_softmax(s, m_i, l_i, sk, sv, AOP)
            acc = warpgroup_mma_wait(0, deps=[acc])
            acc = acc * gl.expand_dims(alpha, 1)
            a = a_new
        acc = warpgroup_mma(a, kv_smem.index(2).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
    r = gl.arange(0, _BM, layout=ROWL)
    acc = acc / gl.expand_dims(l_i, 1)
    gl.store(out_ptr + (gl.program_id(0) * NC + CID) * _BM * _BN + gl.expand_dims(r, 1) * _BN +
             gl.expand_dims(c, 0), acc)


@gluon.jit
def _probe_fwd_kernel(a_ptr, b_ptr, out_ptr, clk_ptr, ITERS, SCHED: gl.constexpr,
                      num_warps: gl.constexpr):
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [_BM, _BK], _A_LAYOUT)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [_NB, _BN, _BK], _B_LAYOUT)
    _fill(a_ptr, b_ptr, a_smem, b_smem, num_warps)
    _stamp(clk_ptr, 0, num_warps)
    _fwd_loop(a_smem, b_smem, out_ptr, ITERS, a_smem, SCHED, False, 0, 1, num_warps)
    _stamp(clk_ptr, 1, num_warps)


@gluon.jit
def _probe_fwd2_kernel(a_ptr, b_ptr, out_ptr, clk_ptr, ITERS, SCHED: gl.constexpr,
                       PP: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr):
    """Two warpgroups of one CTA each running _fwd_loop, with or without ping-pong turns."""
    a_smem, b_smem, turn = _pair_setup(a_ptr, b_ptr, clk_ptr, num_warps)
    gl.warp_specialize([
        (_fwd_loop, (a_smem, b_smem, out_ptr, ITERS, turn, SCHED, PP, 0, 2, num_warps)),
        (_fwd_loop, (a_smem, b_smem, out_ptr, ITERS, turn, SCHED, PP, 1, 2, 4)),
    ], [4], [REGS])
    _stamp(clk_ptr, 1, num_warps)
    mbarrier.invalidate(turn.index(0))
    mbarrier.invalidate(turn.index(1))


def fwd(args, dev, sms):
    """The synthetic forward's rate (2 GEMMs per tile) and SM clock."""
    global CLK
    flop_tile = 2 * 2 * BM * BN * BK
    print("\n| synthetic forward (no loads) | CTAs | TFLOP/s | SM MHz |")
    print("|---|---|---|---|")
    names = {0: "serial: S, wait, softmax, PV, wait",
             1: "S_j and PV_(j-1) in flight, softmax_j under PV_(j-1), P carried",
             2: "the same overlap, loop rotated (S carried)"}
    for sched in (0, 1, 2):
        for per_sm in (1, 2):
            g = per_sm * sms
            a, b, out, x = _operands(dev, g)
            CLK = torch.zeros(g, 4, dtype=torch.int64, device=dev)
            t, mhz = _time(lambda: _probe_fwd_kernel[(g,)](a, b, out, CLK, args.fwd_iters, sched,
                                                           num_warps=4))
            print(f"| {names[sched]} | {per_sm} per SM | "
                  f"{flop_tile * args.fwd_iters * g / t / 1e9:.0f} | {mhz:.0f} |")
    a, b, out, x = _operands(dev, 2 * sms)
    CLK = torch.zeros(sms, 4, dtype=torch.int64, device=dev)
    for sched in (1, 2):
        for pp in (False, True):
            t, mhz = _time(lambda: _probe_fwd2_kernel[(sms,)](a, b, out, CLK, args.fwd_iters,
                                                              sched, pp, 232, num_warps=4))
            print(f"| {names[sched]}, two warpgroups per CTA{', ping-pong' if pp else ''} "
                  f"| 1 per SM | {flop_tile * args.fwd_iters * 2 * sms / t / 1e9:.0f} "
                  f"| {mhz:.0f} |")


# (N, K, NMMA, USE_ACC, what it stands for)
SHAPES = [
    (64, 128, 1, False, "S or dP^T tile of dQ / dK/dV (n64 k128)"),
    (64, 128, 2, False, "S and dP issued together (dQ)"),
    (128, 64, 1, True, "dV / dK accumulate (n128 k64)"),
    (128, 64, 2, True, "dV and dK issued together"),
    (128, 128, 1, False, "forward S (n128 k128)"),
    (128, 128, 2, False, "S and dP at 128 keys (n128 k128, two)"),
    (128, 128, 1, True, "n128 k128 accumulate (forward PV)"),
    (256, 64, 1, True, "n256 k64 accumulate"),
    (256, 128, 1, False, "n256 k128 fresh"),
]


def shapes(args, dev, sms):
    global CLK
    print("\n| wgmma shape (m64) | issued per wait | accumulate | stands for | 1 CTA/SM TFLOP/s "
          "| 2 CTA/SM TFLOP/s | SM MHz (1 / 2 CTA/SM) |")
    print("|---|---|---|---|---|---|---|")
    for n, k, nmma, use_acc, what in SHAPES:
        nbuf = max(2, min(6, 96 * 1024 // (n * k)))
        a = (torch.rand(64, k) * 2 - 1).to(torch.float8_e4m3fn).to(dev)
        b = (torch.rand(nbuf, n, k) * 2 - 1).to(torch.float8_e4m3fn).to(dev)
        iters = args.shape_flop // (2 * 64 * n * k * nmma)
        tf, mhz = [], []
        for per_sm in (1, 2):
            g = per_sm * sms
            out = torch.empty(g, 64, n, device=dev)
            CLK = torch.zeros(g, 4, dtype=torch.int64, device=dev)
            t, f = _time(lambda: _probe_shape_kernel[(g,)](a, b, out, CLK, iters, n, k, nbuf,
                                                           nmma, use_acc, num_warps=4))
            tf.append(2 * 64 * n * k * nmma * iters * g / t / 1e9)
            mhz.append(f)
        print(f"| n{n} k{k} | {nmma} | {use_acc} | {what} | {tf[0]:.0f} | {tf[1]:.0f} "
              f"| {mhz[0]:.0f} / {mhz[1]:.0f} |")


def _operands(dev, ctas):
    g = torch.Generator(device="cpu").manual_seed(0)
    a = (torch.rand(BM, BK, generator=g) * 2 - 1).to(torch.float8_e4m3fn).to(dev)
    b = (torch.rand(NB, BN, BK, generator=g) * 2 - 1).to(torch.float8_e4m3fn).to(dev)
    out = torch.empty(ctas, BM, BN, device=dev)
    x = torch.rand(ctas, BM, BN, generator=g).to(dev)
    return a, b, out, x


CLK = None     # (CTAs, 4) int64: clock64 / globaltimer at start and end, set by run()


def _mhz():
    """Median SM clock (MHz) over the CTAs of the last launch, from their own stamps."""
    c = CLK.double()
    f = (c[:, 2] - c[:, 0]) / (c[:, 3] - c[:, 1]).clamp(min=1) * 1e3
    return f.median().item()


def _time(fn, reps=20):
    """Median ms of fn over reps (CUDA events), and the SM clock of its last run."""
    fn()
    torch.cuda.synchronize()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(start, end):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(start, end))[reps // 2], _mhz()


def run(args):
    global CLK
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    flop_iter = 2 * BM * BN * BK
    print(f"{torch.cuda.get_device_name()} {sms} SMs; wgmma m{BM} n{BN} k{BK} fp8 "
          f"({flop_iter / 1e6:.2f} MFLOP per iteration)")
    if args.only_shapes:
        shapes(args, dev, sms)
        return
    if args.only_fwd:
        fwd(args, dev, sms)
        return
    rows = []
    # ---- ws: two warpgroups of one CTA, one role each ----
    a, b, out, x = _operands(dev, sms)
    CLK = torch.zeros(sms, 4, dtype=torch.int64, device=dev)
    M = args.mma_iters
    for kind, n_alu in (("ffma", args.ffma_iters), ("exp", args.exp_iters),
                        ("soft", args.soft_iters)):
        def go(m, n):
            return lambda: _probe_ws_kernel[(sms,)](a, b, out, x, CLK, m, n, KINDS[kind], 152,
                                                      num_warps=4)
        t_m, t_a, t_both = _time(go(M, 0)), _time(go(0, n_alu)), _time(go(M, n_alu))
        rows.append((f"ws {kind}", t_m, t_a, t_both, flop_iter * M * sms / t_m[0] / 1e9))
    # ---- alt: our kernels' serial tile; MMA alone, element-wise alone, both ----
    for kind, reps in (("exp", args.alt_exp_reps), ("soft", args.alt_soft_reps)):
        for ctas_per_sm in (1, 2):
            g = ctas_per_sm * sms
            a, b, out, x = _operands(dev, g)
            CLK = torch.zeros(g, 4, dtype=torch.int64, device=dev)

            def go(r, mma=True):
                return lambda: _probe_alt_kernel[(g,)](a, b, out, CLK, args.alt_iters, r,
                                                         KINDS[kind], mma, num_warps=4)
            t_m, t_a, t_both = _time(go(0)), _time(go(reps, False)), _time(go(reps))
            rows.append((f"alt {kind} x{reps}, {ctas_per_sm} CTA/SM", t_m, t_a, t_both,
                         flop_iter * args.alt_iters * g / t_m[0] / 1e9))
        # two warpgroups of one CTA (the 2 CTA/SM work), free-running and ping-pong
        a, b, out, x = _operands(dev, 2 * sms)
        CLK = torch.zeros(sms, 4, dtype=torch.int64, device=dev)
        for pp in (False, True):
            def go2(r):
                return lambda: _probe_alt2_kernel[(sms,)](a, b, out, CLK, args.alt_iters, r,
                                                            KINDS[kind], pp, 232, num_warps=4)
            t_m, t_both = _time(go2(0)), _time(go2(reps))
            t_a = rows[-1][2]       # element-wise alone: the 2 CTA/SM row's (same work)
            rows.append((f"alt {kind} x{reps}, 2 warpgroups/CTA{' ping-pong' if pp else ''}",
                         t_m, t_a, t_both, flop_iter * args.alt_iters * 2 * sms / t_m[0] / 1e9))
    print()
    print("| probe | MMA alone ms | element-wise alone ms | both ms | both / max | both / sum "
          "| MMA TFLOP/s | SM MHz (MMA / element-wise / both) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (t_m, f_m), (t_a, f_a), (t_both, f_b), tf in rows:
        print(f"| {name} | {t_m:.3f} | {t_a:.3f} | {t_both:.3f} | "
              f"{t_both / max(t_m, t_a):.2f} | {t_both / (t_m + t_a):.2f} | {tf:.0f} "
              f"| {f_m:.0f} / {f_a:.0f} / {f_b:.0f} |")
    shapes(args, dev, sms)
    fwd(args, dev, sms)
    print("\n(alt rows: 'MMA alone' = the loop with no element-wise pass, 'element-wise alone' = "
          "the loop with an FFMA instead of the wgmma; 2 CTA/SM and 2 warpgroups/CTA run twice "
          "the work of 1 CTA/SM)")


def compile_only():
    from benchmarks.tools.compile import compile_for, resource_usage
    from benchmarks.tools.sass import parse, sass_of
    f8 = torch.float8_e4m3fn
    a, b = torch.zeros(BM, BK, dtype=f8), torch.zeros(NB, BN, BK, dtype=f8)
    out, x = torch.zeros(1, BM, BN), torch.zeros(1, BM, BN)
    clk = torch.zeros(1, 4, dtype=torch.int64)
    for kind in KINDS.values():
        k = compile_for(_probe_ws_kernel, (a, b, out, x, clk, 7, 7, kind, 152), {"num_warps": 4})
        print("ws", kind, resource_usage(k), len(parse(sass_of(k))), "SASS")
        for mma in (True, False):
            k = compile_for(_probe_alt_kernel, (a, b, out, clk, 7, 7, kind, mma), {"num_warps": 4})
            print("alt", kind, mma, resource_usage(k), len(parse(sass_of(k))), "SASS")
        for pp in (False, True):
            k = compile_for(_probe_alt2_kernel, (a, b, out, clk, 7, 7, kind, pp, 232),
                            {"num_warps": 4})
            print("alt2", kind, pp, resource_usage(k), len(parse(sass_of(k))), "SASS")
    for sched in (0, 1, 2):
        k = compile_for(_probe_fwd_kernel, (a, b, out, clk, 7, sched), {"num_warps": 4})
        print("fwd", sched, resource_usage(k), len(parse(sass_of(k))), "SASS")
    for sched in (1, 2):
        for pp in (False, True):
            k = compile_for(_probe_fwd2_kernel, (a, b, out, clk, 7, sched, pp, 232),
                            {"num_warps": 4})
            print("fwd2", sched, pp, resource_usage(k), len(parse(sass_of(k))), "SASS")
    for n, k_, nmma, use_acc, what in SHAPES:
        nbuf = max(2, min(6, 96 * 1024 // (n * k_)))
        k = compile_for(_probe_shape_kernel, (torch.zeros(64, k_, dtype=f8),
                                              torch.zeros(nbuf, n, k_, dtype=f8),
                                              torch.zeros(1, 64, n), clk, 7, n, k_, nbuf, nmma,
                                              use_acc), {"num_warps": 4})
        print("shape", n, k_, nmma, use_acc, resource_usage(k), len(parse(sass_of(k))), "SASS")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--mma-iters", type=int, default=8000)
    ap.add_argument("--ffma-iters", type=int, default=4000)
    ap.add_argument("--exp-iters", type=int, default=1000)
    ap.add_argument("--soft-iters", type=int, default=1000)
    ap.add_argument("--alt-iters", type=int, default=4000)
    ap.add_argument("--alt-exp-reps", type=int, default=1)
    ap.add_argument("--alt-soft-reps", type=int, default=1)
    ap.add_argument("--shape-flop", type=int, default=2 * 64 * 128 * 128 * 8000,
                    help="FLOPs per CTA of each wgmma-shape row")
    ap.add_argument("--only-shapes", action="store_true")
    ap.add_argument("--only-fwd", action="store_true")
    ap.add_argument("--fwd-iters", type=int, default=4000)
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
    else:
        run(args)


if __name__ == "__main__":
    main()
