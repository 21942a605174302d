"""CPU compile spike for an fp8 one-pass backward: the fp8 pieces of one step (one warpgroup,
64 keys x 64 queries, D=128) built for sm_90a, SASS counted per source line.

    python benchmarks/fp8_bwd_spike.py [transposed_store | permute_regs]

Pieces: S^T = K Q^T and dP^T = V dO^T from fp8 tiles; P^T and dS^T converted from the fp32
accumulator to fp8 A operands in registers (dV += P^T dO, dK += dS^T Q with dO^T and Q^T as
K-major fp8 copies: fp8 wgmma wants both operands K-major); dS stored transposed (queries x
keys, keys contiguous) for dQ = dS K with a K^T copy. benchmarks/NOTES.md has what it showed.
"""
import collections
import os
import re
import subprocess
import sys
import tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from benchmarks.tools.compile import compile_only, resource_usage, triton_tool
from benchmarks.tools.sass import sass_of, parse

VARIANT = sys.argv[1] if len(sys.argv) > 1 else "transposed_store"

@gluon.constexpr_function
def acc_layout(n, k):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, k])

@gluon.jit
def _tile(ptr, R: gl.constexpr, C: gl.constexpr, layout: gl.constexpr):
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (C // 16), C // 16], [4, 1], [1, 0])
    r = gl.arange(0, R, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, blk))
    x = gl.load(ptr + gl.expand_dims(r, 1) * C + gl.expand_dims(c, 0))
    s = gl.allocate_shared_memory(ptr.dtype.element_ty, [R, C], layout)
    s.store(x)
    return s

@gluon.jit
def spike(K, V, Q, QT, DO, DOT, KT, OUT, BN: gl.constexpr, BM: gl.constexpr, D: gl.constexpr,
          TRANSPOSED: gl.constexpr):
    f8: gl.constexpr = gl.float8e4nv
    L_ND: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    L_T: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    k_s = _tile(K, BN, D, L_ND)
    v_s = _tile(V, BN, D, L_ND)
    q_s = _tile(Q, BM, D, L_ND)
    do_s = _tile(DO, BM, D, L_ND)
    qt_s = _tile(QT, D, BM, L_T)
    dot_s = _tile(DOT, D, BM, L_T)
    kt_s = _tile(KT, D, BN, L_T)
    fence_async_shared()
    gl.thread_barrier()
    s_l: gl.constexpr = acc_layout(BM, 32)
    kv_l: gl.constexpr = acc_layout(D, 32)
    a_l: gl.constexpr = gl.DotOperandLayout(0, kv_l, 4)
    st = warpgroup_mma(k_s, q_s.permute((1, 0)), gl.zeros([BN, BM], gl.float32, s_l), use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_s, do_s.permute((1, 0)), gl.zeros([BN, BM], gl.float32, s_l), use_acc=False, is_async=True)
    st = warpgroup_mma_wait(1, deps=[st])
    pt = gl.exp2(st - 1.0)
    dpt = warpgroup_mma_wait(0, deps=[dpt])
    dst = pt * (dpt - 0.5)
    pa = gl.convert_layout(pt.to(f8), a_l)          # LINE_PA
    dv = warpgroup_mma(pa, dot_s.permute((1, 0)), gl.zeros([BN, D], gl.float32, kv_l), use_acc=False, is_async=True)
    dsb = dst.to(f8)
    dsa = gl.convert_layout(dsb, a_l)               # LINE_DSA
    dk = warpgroup_mma(dsa, qt_s.permute((1, 0)), gl.zeros([BN, D], gl.float32, kv_l), use_acc=False, is_async=True)
    dq_l: gl.constexpr = acc_layout(D, 32)
    if TRANSPOSED:
        ds_s = gl.allocate_shared_memory(f8, [BM, BN], L_T)
        ds_s.permute((1, 0)).store(dsb)               # LINE_DSSTORE
    else:
        ds_s = gl.allocate_shared_memory(f8, [BM, BN], L_T)
        ds_s.store(gl.permute(dsb, (1, 0)))           # LINE_DSSTORE2
    fence_async_shared()
    gl.thread_barrier()
    dq = warpgroup_mma(ds_s, kt_s.permute((1, 0)), gl.zeros([BM, D], gl.float32, dq_l), use_acc=False, is_async=True)
    dv, dk, dq = warpgroup_mma_wait(0, deps=[dv, dk, dq])
    o_blk: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, o_blk))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, o_blk))
    offs = gl.expand_dims(r, 1) * D + gl.expand_dims(c, 0)
    gl.store(OUT + offs, gl.convert_layout(dv, o_blk))
    gl.store(OUT + BN * D + offs, gl.convert_layout(dk, o_blk))
    gl.store(OUT + 2 * BN * D + offs, gl.convert_layout(dq, o_blk))

BN, BM, D = 64, 64, 128
f8 = torch.float8_e4m3fn
t = lambda r, c: torch.zeros(r, c).to(f8)
with compile_only() as built:
    spike[(1,)](t(BN, D), t(BN, D), t(BM, D), t(D, BM), t(BM, D), t(D, BM), t(D, BN),
                torch.zeros(3 * BN * D), BN=BN, BM=BM, D=D, TRANSPOSED=VARIANT == "transposed_store", num_warps=4)
kern = dict(built)["spike"]
print(VARIANT, resource_usage(kern))
with tempfile.TemporaryDirectory() as d:
    p = os.path.join(d, "k.cubin"); open(p, "wb").write(kern.asm["cubin"])
    txt = subprocess.run([triton_tool("nvdisasm"), "-g", "-c", p], capture_output=True, text=True).stdout
src = open(__file__).read().splitlines()
where = "?"; per = collections.defaultdict(collections.Counter)
for line in txt.splitlines():
    m = re.search(r'//## File ".*?([^/"]+)", line (\d+)', line)
    if m: where = int(m.group(2)) if m.group(1) == os.path.basename(__file__) else where; continue
    m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    if m: per[where][m.group(3).split(".")[0]] += 1
for ln in sorted(k for k in per if isinstance(k, int)):
    if "LINE_" in src[ln - 1] or "warpgroup_mma(" in src[ln - 1]:
        print(ln, src[ln - 1].strip()[:60], dict(per[ln].most_common(8)))
