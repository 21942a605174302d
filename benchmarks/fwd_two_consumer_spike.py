"""Spike: the persistent fp8 forward with two consumer warpgroups sharing each K / V tile.

The library's persistent forward (flamia/ops/forward_gluon.py) runs one consumer warpgroup of 64
query rows per CTA, two CTAs per SM, each CTA loading its own K / V tiles. At D=128 a 64 x 128
tile brings 32 KB of K and V^T into shared memory for 4.2 MFLOP: at the ~800 TFLOP/s the kernel
reaches on long documents that is ~6 TB/s of L2 -> shared memory traffic, about what the L2
delivers. Here one CTA per SM holds two consumer warpgroups on 128 query rows (64 each, the
library's per-row code unchanged: forward_gluon._pers_serial_tiles) and one producer warp
(forward_gluon._pers_producer with BM = 128): each K / V tile is loaded once for both, half the
traffic per FLOP. A stage is released when both consumers arrived (arrival count 2), the Q
buffer likewise; each consumer stores its own 64 rows of O.

Both consumers walk the same items and tiles, so every row sees the same tiles, in the same
order, with the same masks and scale copies as in the library kernel (the 128-row item covers
the two 64-row items of the library's list; the token copies start at the item's 128-block in
both): out, lse and the row max should be bitwise the library's.

    python benchmarks/fwd_two_consumer_spike.py              # CPU: sm_90a build, SASS per tile
    python benchmarks/fwd_two_consumer_spike.py --check --time [--workloads doc32k,...]   # GPU
    ... --dims 64 --ctas 2 --regs 112      # D=64: two CTAs per SM (against both library kernels)

The library's forward_gluon helpers are imported as they are (a spike, not a stable consumer):
if it wins, it becomes the library kernel's structure and this file goes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from flamia.ops import forward_gluon as F  # noqa: E402
from flamia.ops.config import PersistentFwdConfig  # noqa: E402
from flamia.ops.gluon_common import HAVE_GLUON, descriptor_2d  # noqa: E402
from flamia.ops.numerics import LOG2E  # noqa: E402
from flamia.ops.schedule import persistent_grid, work_list  # noqa: E402

BM2 = 128           # query rows per item: two consumers of 64
CONSUMER_REGS = 224

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from flamia.ops.gluon_common import (alloc_barriers, arrive_synced, invalidate_barriers,
                                         wgmma_layout)
    from flamia.ops.schedule import work_item

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, sk_smem, sv_smem, o_smem, q_ready, q_free, k_ready,
                  v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ, VCAP, o_desc, O, LSE, RMAX,
                  stride_ot, stride_oh, T, qk_scale, WG: gl.constexpr, D: gl.constexpr,
                  BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  QBUF: gl.constexpr, ROW_MAX: gl.constexpr):
        """forward_gluon._pers_consumer for rows [64 WG, 64 WG + 64) of each 128-row item: the
        tiles the item's producer loads (n_tiles of all 128 rows), masked as these rows need."""
        NW: gl.constexpr = 4
        BM: gl.constexpr = 16 * NW
        s_layout: gl.constexpr = wgmma_layout(NW, 1, BN, 32)
        o_tile = o_smem.index(WG)
        g = 0
        it = 0
        G = gl.num_programs(0)
        pid = gl.program_id(0)
        doc, head, kvh, start, L, blk = work_item(ITEMS, N_ITEMS, HQ, GROUP, W, pid)
        sq, cap = F._row_loads(SQ, VCAP, T, start, blk * (2 * BM) + WG * BM, L, head, kvh, BM,
                               s_layout)
        for w in range(pid, W, G):
            c_doc, c_head, c_L, c_blk, c_start, c_sq, c_cap = doc, head, L, blk, start, sq, cap
            doc, head, kvh, start, L, blk = work_item(ITEMS, N_ITEMS, HQ, GROUP, W, w + G)
            if c_doc >= 0:
                row_f, lr = F._row_constants(c_sq, c_cap, qk_scale)
                q_item = c_blk * (2 * BM)
                q_lo = q_item + WG * BM
                c_tok0, c_rows, c_row_ok = F._query_rows(c_start, q_lo, c_L, BM, s_layout)
                full_end, _n = F._kv_tiles(q_lo, c_L, BM, BN, CAUSAL)
                _f, n_tiles = F._kv_tiles(q_item, c_L, 2 * BM, BN, CAUSAL)
                m_i = gl.full_like(row_f, float("-inf"))
                l_i = F._quad_sums(gl.zeros([BM, BN], gl.float32, s_layout))
                qb = it % QBUF
                q_tile = q_smem.index(qb).slice(WG * BM, BM)
                mbarrier.wait(q_ready.index(qb), (it // QBUF) & 1)
                acc, m_i, l_i, g = F._pers_serial_tiles(
                    q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel, m_i, l_i,
                    row_f, lr, c_rows, c_L, full_end, n_tiles, g, BN, D, STAGES, CAUSAL, NW)
                arrive_synced(q_free.index(qb))
                sq, cap = F._row_loads(SQ, VCAP, T, start, blk * (2 * BM) + WG * BM, L, head,
                                       kvh, BM, s_layout)
                l_i = gl.convert_layout(gl.sum(l_i, axis=1), m_i.type.layout)
                F._store_out(acc, m_i, l_i, lr, o_desc, o_tile, O, LSE, RMAX, stride_ot,
                             stride_oh, T, c_tok0, q_lo, c_rows, c_row_ok, c_L, c_head, ROW_MAX)
                it += 1
            else:
                sq, cap = F._row_loads(SQ, VCAP, T, start, blk * (2 * BM) + WG * BM, L, head,
                                       kvh, BM, s_layout)
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=["T", "N_ITEMS"])
    def _fwd_two_consumer_kernel(q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc, o_desc, SQ,
                                 VCAP, O, LSE, RMAX, PCU, ITEMS, stride_ot, stride_oh, T,
                                 N_ITEMS, HQ, GROUP, qk_scale, D: gl.constexpr, BN: gl.constexpr,
                                 STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                 PRODUCER_REGS: gl.constexpr, CONS_REGS: gl.constexpr,
                                 QBUF: gl.constexpr, ROW_MAX: gl.constexpr,
                                 num_warps: gl.constexpr):
        W = N_ITEMS * HQ
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [QBUF, 2 * 16 * num_warps, D],
                                           q_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [2, 16 * num_warps, D], o_desc.layout)
        k_smem, v_smem, sk_smem, sv_smem = F._alloc_kv_ring(k_desc, v_desc, sc_desc, STAGES, BN,
                                                            D)
        q_ready, q_free = alloc_barriers(QBUF), alloc_barriers(QBUF, 2)
        k_ready, v_ready = alloc_barriers(STAGES), alloc_barriers(STAGES)
        rel = alloc_barriers(STAGES, 2)
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, o_smem, q_ready, q_free,
                         k_ready, v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ, VCAP, o_desc,
                         O, LSE, RMAX, stride_ot, stride_oh, T, qk_scale, 0, D, BN, STAGES,
                         CAUSAL, QBUF, ROW_MAX)),
            (_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, o_smem, q_ready, q_free,
                         k_ready, v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ, VCAP, o_desc,
                         O, LSE, RMAX, stride_ot, stride_oh, T, qk_scale, 1, D, BN, STAGES,
                         CAUSAL, QBUF, ROW_MAX)),
            (F._pers_producer, (q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc, q_smem,
                                k_smem, v_smem, sk_smem, sv_smem, q_ready, q_free, k_ready,
                                v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, PCU,
                                gl.program_id(0), gl.num_programs(0), 2 * 16 * num_warps, BN,
                                CAUSAL, QBUF)),
        ], [4, 1], [CONS_REGS, PRODUCER_REGS])
        invalidate_barriers((q_ready, q_free, k_ready, v_ready, rel))


def forward_two_consumer(qkv, cu, causal: bool, scale: float, out, lse, row_max,
                         stages: int = 2, qbuf: int = 2, ctas: int = 1,
                         regs: int = CONSUMER_REGS) -> None:
    """The spike's kernel on the library's quantized operands (fp8, V^T in key order; outputs
    allocated by the caller as attention_forward does)."""
    F.check_operands(qkv)
    T, Hq, Hkv, D = qkv.shape
    cfg = PersistentFwdConfig()
    BN = cfg.block_n
    items = work_list(cu, T, BM2, BN, causal)
    n_items = items.shape[1]
    q_d, k_d, v_d, sc_d, kd_d, vd_d = F._descriptors(qkv, BM2, BN)
    # three 4-warp groups (Triton rounds the producer warp up to a warpgroup): the launch
    # register count fits ctas CTAs' 384 threads in the register file, setmaxnreg moves the
    # producer's share to the consumers
    maxnreg = 65536 // (384 * ctas) // 8 * 8
    regs = min(regs, (3 * maxnreg - cfg.producer_regs) // 2 // 8 * 8)
    _fwd_two_consumer_kernel[persistent_grid(n_items * Hq, ctas, out.device)](
        q_d, k_d, v_d, sc_d, kd_d, vd_d, descriptor_2d(out, T, Hq * D, Hq * D, [BM2 // 2, D]),
        qkv.sq, qkv.vcap, out, lse, lse if row_max is None else row_max, qkv.kv_pcu, items,
        out.stride(0), out.stride(1), T, n_items, Hq, Hq // Hkv, scale * LOG2E, D=D, BN=BN,
        STAGES=stages, CAUSAL=bool(causal), PRODUCER_REGS=cfg.producer_regs,
        CONS_REGS=regs, QBUF=qbuf, ROW_MAX=row_max is not None, num_warps=4, maxnreg=maxnreg)


if HAVE_GLUON:

    @gluon.jit
    def _alloc_stream(q_desc, k_desc, v_desc, sc_desc, o_desc, BM: gl.constexpr,
                      BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                      QBUF: gl.constexpr):
        """One consumer's shared memory and barriers, as the library kernel allocates them."""
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [QBUF, BM, D], q_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [BM, D], o_desc.layout)
        k_smem, v_smem, sk_smem, sv_smem = F._alloc_kv_ring(k_desc, v_desc, sc_desc, STAGES, BN,
                                                            D)
        return (q_smem, o_smem, k_smem, v_smem, sk_smem, sv_smem, alloc_barriers(QBUF),
                alloc_barriers(QBUF), alloc_barriers(STAGES), alloc_barriers(STAGES),
                alloc_barriers(STAGES))

    @gluon.jit(do_not_specialize=["T", "N_ITEMS"])
    def _fwd_independent_kernel(q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc, o_desc, SQ,
                                VCAP, O, LSE, RMAX, PCU, ITEMS, stride_ot, stride_oh, T,
                                N_ITEMS, HQ, GROUP, qk_scale, D: gl.constexpr,
                                BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                PRODUCER_REGS: gl.constexpr, CONS_REGS: gl.constexpr,
                                QBUF: gl.constexpr, ROW_MAX: gl.constexpr,
                                num_warps: gl.constexpr):
        """Three consumer warpgroups on independent work sequences (consumer c of CTA p walks
        w = 3 p + c, stride 3 G), each with its own producer warp, shared memory and barriers:
        the library's consumer and producer as they are, three times in one CTA (12 consumer
        warps per SM at one CTA, the Triton kernel's count at D=64)."""
        W = N_ITEMS * HQ
        BM: gl.constexpr = 16 * num_warps
        pid = gl.program_id(0)
        G3 = 3 * gl.num_programs(0)
        q0, o0, k0, v0, a0, b0, qr0, qf0, kr0, vr0, r0 = _alloc_stream(
            q_desc, k_desc, v_desc, sc_desc, o_desc, BM, BN, D, STAGES, QBUF)
        q1, o1, k1, v1, a1, b1, qr1, qf1, kr1, vr1, r1 = _alloc_stream(
            q_desc, k_desc, v_desc, sc_desc, o_desc, BM, BN, D, STAGES, QBUF)
        q2, o2, k2, v2, a2, b2, qr2, qf2, kr2, vr2, r2 = _alloc_stream(
            q_desc, k_desc, v_desc, sc_desc, o_desc, BM, BN, D, STAGES, QBUF)
        gl.warp_specialize([
            (F._pers_consumer, (q0, k0, v0, a0, b0, o0, qr0, qf0, kr0, vr0, r0, ITEMS, N_ITEMS,
                                HQ, GROUP, W, SQ, VCAP, o_desc, O, LSE, RMAX, stride_ot,
                                stride_oh, T, qk_scale, 3 * pid, G3, D, BN, STAGES, CAUSAL,
                                num_warps, QBUF, ROW_MAX)),
            (F._pers_consumer, (q1, k1, v1, a1, b1, o1, qr1, qf1, kr1, vr1, r1, ITEMS, N_ITEMS,
                                HQ, GROUP, W, SQ, VCAP, o_desc, O, LSE, RMAX, stride_ot,
                                stride_oh, T, qk_scale, 3 * pid + 1, G3, D, BN, STAGES, CAUSAL,
                                num_warps, QBUF, ROW_MAX)),
            (F._pers_consumer, (q2, k2, v2, a2, b2, o2, qr2, qf2, kr2, vr2, r2, ITEMS, N_ITEMS,
                                HQ, GROUP, W, SQ, VCAP, o_desc, O, LSE, RMAX, stride_ot,
                                stride_oh, T, qk_scale, 3 * pid + 2, G3, D, BN, STAGES, CAUSAL,
                                num_warps, QBUF, ROW_MAX)),
            (F._pers_producer, (q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc, q0, k0, v0,
                                a0, b0, qr0, qf0, kr0, vr0, r0, ITEMS, N_ITEMS, HQ, GROUP, W,
                                PCU, 3 * pid, G3, BM, BN, CAUSAL, QBUF)),
            (F._pers_producer, (q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc, q1, k1, v1,
                                a1, b1, qr1, qf1, kr1, vr1, r1, ITEMS, N_ITEMS, HQ, GROUP, W,
                                PCU, 3 * pid + 1, G3, BM, BN, CAUSAL, QBUF)),
            (F._pers_producer, (q_desc, k_desc, v_desc, sc_desc, kd_desc, vd_desc, q2, k2, v2,
                                a2, b2, qr2, qf2, kr2, vr2, r2, ITEMS, N_ITEMS, HQ, GROUP, W,
                                PCU, 3 * pid + 2, G3, BM, BN, CAUSAL, QBUF)),
        ], [4, 4, 1, 1, 1], [CONS_REGS, CONS_REGS, PRODUCER_REGS, PRODUCER_REGS,
                             PRODUCER_REGS])
        invalidate_barriers((qr0, qf0, kr0, vr0, r0, qr1, qf1, kr1, vr1, r1, qr2, qf2, kr2,
                             vr2, r2))


def forward_independent(qkv, cu, causal: bool, scale: float, out, lse, row_max,
                        stages: int = 2, qbuf: int = 2, ctas: int = 1,
                        regs: int = CONSUMER_REGS) -> None:
    """The three-consumer kernel on the library's operands and work list (64-row items),
    one CTA per SM: 16 warps (three consumer warpgroups, three producer warps, Triton rounds
    to a warpgroup), so the launch count is 128 registers and setmaxnreg gives the consumers
    what the producers leave."""
    F.check_operands(qkv)
    T, Hq, Hkv, D = qkv.shape
    cfg = PersistentFwdConfig()
    BM, BN = cfg.block_m, cfg.block_n
    items = work_list(cu, T, BM, BN, causal)
    n_items = items.shape[1]
    maxnreg = 65536 // (512 * ctas) // 8 * 8
    regs = min(regs, (16 * maxnreg - 4 * cfg.producer_regs) // 12 // 8 * 8)
    q_d, k_d, v_d, sc_d, kd_d, vd_d = F._descriptors(qkv, BM, BN)
    _fwd_independent_kernel[persistent_grid(n_items * Hq, ctas, out.device)](
        q_d, k_d, v_d, sc_d, kd_d, vd_d, descriptor_2d(out, T, Hq * D, Hq * D, [BM, D]),
        qkv.sq, qkv.vcap, out, lse, lse if row_max is None else row_max, qkv.kv_pcu, items,
        out.stride(0), out.stride(1), T, n_items, Hq, Hq // Hkv, scale * LOG2E, D=D, BN=BN,
        STAGES=stages, CAUSAL=bool(causal), PRODUCER_REGS=cfg.producer_regs,
        CONS_REGS=regs, QBUF=qbuf, ROW_MAX=row_max is not None, num_warps=4, maxnreg=maxnreg)


def library_forward(qkv, cu, causal, scale, out, lse, row_max):
    """The library's persistent Gluon kernel (at D=64 too, where the library runs the Triton
    kernel: triton_forward below)."""
    cfg = PersistentFwdConfig()
    T = qkv.shape[0]
    F.launch(qkv, work_list(cu, T, cfg.block_m, cfg.block_n, causal), causal, scale, out, lse,
             row_max, cfg)


def triton_forward(qkv, cu, causal, scale, out, lse, row_max):
    """The library's default forward kernel for qkv's head dim (the Triton one at D=64)."""
    from flamia.ops.forward import attention_forward
    o, l_, m = attention_forward(qkv, cu, None, causal, scale, out.dtype, return_row_max=True)
    out.copy_(o), lse.copy_(l_), row_max.copy_(m)


VARIANTS = {"two": (forward_two_consumer, "_fwd_two_consumer_kernel"),
            "independent": (forward_independent, "_fwd_independent_kernel")}


def compile_report(dims, stages, ctas=1, regs=CONSUMER_REGS, variant="two"):
    """CPU: the sm_90a build per D (registers, spills, shared memory, SASS per tile)."""
    from benchmarks.tools.compile import build, cu_seqlens, fake_qkv, report
    from benchmarks.tools.sass import describe_paths, sass_of
    for D in dims:
        qkv = fake_qkv(4096, 8, 2, D)
        T, Hq = 4096, 8
        out = torch.empty(T, Hq, D, dtype=torch.bfloat16)
        lse, rmax = torch.empty(Hq, T), torch.empty(Hq, T)
        fn, kname = VARIANTS[variant]
        built = build(fn, qkv, cu_seqlens([4096]), True, D ** -0.5, out, lse, rmax, stages, 2,
                      ctas, regs)
        kern = built[kname]
        u = report(kern)
        print(f"D={D} stages={stages} regs={regs}: " + json.dumps({k: u.get(k) for k in (
            "regs", "spill_stores", "shared", "wgmma_serialized", "partition_regs")}))
        print(describe_paths(sass_of(kern)))


def run_gpu(names, dims, check: bool, time_it: bool, stages: int, ctas: int, regs: int,
            variant: str = "two"):
    spike = VARIANTS[variant][0]
    from benchmarks.bwd_sm90_dev import cuda_ms
    from flamia.inputs import make_qkv
    from flamia.ops.quantize import quantize_qkv
    wl = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "flamia",
                                     "data", "workloads.json")))["workloads"]
    rows = []
    for w in wl:
        if names and w["name"] not in names or w["head_dim"] not in dims:
            continue
        q, k, v, cu = make_qkv(w["doc_lengths"], w["heads_q"], w["heads_kv"], w["head_dim"],
                               "outliers", seed=0, device="cuda")
        x = quantize_qkv(q, k, v, cu, "fp8", True)
        T, Hq, _, D = x.shape
        scale = D ** -0.5

        def outputs():
            return (torch.full((T, Hq, D), float("nan"), dtype=torch.bfloat16, device="cuda"),
                    torch.full((Hq, T), float("nan"), device="cuda"),
                    torch.full((Hq, T), float("nan"), device="cuda"))
        a, b = outputs(), outputs()
        library_forward(x, cu, True, scale, *a)
        spike(x, cu, True, scale, *b, stages=stages, ctas=ctas, regs=regs)
        torch.cuda.synchronize()
        row = {"workload": w["name"]}
        if check:
            same = all(torch.equal(p.view(torch.int16) if p.dtype == torch.bfloat16 else
                                   p.view(torch.int32), r.view(torch.int16) if r.dtype ==
                                   torch.bfloat16 else r.view(torch.int32)) for p, r in zip(a, b))
            row["bitwise"] = same
            row["max |dout|"] = (a[0].float() - b[0].float()).abs().nan_to_num(1e9).max().item()
            row["nan"] = bool(b[0].isnan().any() or b[1].isnan().any())
        if time_it:
            row["library ms"] = cuda_ms(lambda: library_forward(x, cu, True, scale, *a))
            row["two-consumer ms"] = cuda_ms(lambda: spike(
                x, cu, True, scale, *b, stages=stages, ctas=ctas, regs=regs))
            row["library ms (again)"] = cuda_ms(lambda: library_forward(x, cu, True, scale, *a))
            if D != 128:     # the library runs the Triton kernel there
                c = outputs()
                row["triton ms"] = cuda_ms(lambda: triton_forward(x, cu, True, scale, *c))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if time_it:
        print("\n| workload | library Gluon ms | spike ms | change | Triton ms (D=64) |"
              "\n| --- | --- | --- | --- | --- |")
        for r in rows:
            base = min(r["library ms"], r["library ms (again)"])
            tri = f"{r['triton ms']:.3f}" if "triton ms" in r else "-"
            print(f"| {r['workload']} | {base:.3f} | {r['two-consumer ms']:.3f} | "
                  f"{100 * (r['two-consumer ms'] / base - 1):+.1f} % | {tri} |")
    if check and not all(r["bitwise"] for r in rows):
        sys.exit("two-consumer forward differs from the library's")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="128")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--ctas", type=int, default=1, help="CTAs per SM")
    ap.add_argument("--regs", type=int, default=CONSUMER_REGS, help="maxnreg / consumer regs")
    ap.add_argument("--check", action="store_true", help="GPU: bitwise against the library")
    ap.add_argument("--time", action="store_true", help="GPU: forward kernel vs the library's")
    ap.add_argument("--workloads", default="")
    ap.add_argument("--variant", default="two", choices=sorted(VARIANTS),
                    help="two: consumers sharing K / V on 128-row items; independent: three "
                         "consumers on their own 64-row items")
    args = ap.parse_args()
    if not HAVE_GLUON:
        sys.exit("needs triton's Gluon")
    if args.check or args.time:
        run_gpu([x for x in args.workloads.split(",") if x],
                [int(x) for x in args.dims.split(",")], args.check, args.time, args.stages,
                args.ctas, args.regs, args.variant)
    else:
        compile_report([int(x) for x in args.dims.split(",")], args.stages, args.ctas,
                       args.regs, args.variant)


if __name__ == "__main__":
    main()
