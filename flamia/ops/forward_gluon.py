"""FP8 attention forward for Hopper (sm_90a) written in Gluon: async wgmma, TMA ring, P in registers.

Same contract and numerics as flamia.ops.forward._attn_fwd_kernel for the fp8 recipe (see that
module's docstring), same work list (flamia.ops.schedule) and the same KV tile grid inside each
document (tile j covers doc-local keys [j*BN - shift, (j+1)*BN - shift), shift = start % 16, so
every tile starts at a 16-aligned absolute token). What changes is how one program spends its
time. The Triton kernel waits on each wgmma right after issuing it; here, per KV tile j:

    issue S_j = Q K_j^T (async)   |  K_j, V_j arrived by TMA STAGES-1 tiles earlier (mbarriers)
    issue O += A_{j-1} V_{j-1}    |  A_{j-1} = e4m3(p' sv) of the previous tile, in registers
    load sk_j, sv_j               |  global loads in flight while the tensor cores work
    wait S_j; softmax(S_j)        |  overlaps the PV wgmma still in flight
    wait PV; O *= alpha_j         |  same operation order as the Triton kernel (see below)
    refill the freed stage with tile j-1+STAGES by TMA

so the exp2 / scale / cast work of tile j runs while the tensor cores do tile j-1's PV (FA3's
intra-warpgroup overlap), and with 4 warps two CTAs per SM overlap each other as well.

Operation order per row is the Triton kernel's: acc_j = alpha_j * acc_{j-1} + A_j V_j with
acc_{j-1} already holding A_{j-1} V_{j-1}; l, m, the masked / unmasked expressions, the fp8
rounding of A and the epilogue are written the same way. Results are therefore expected to agree
with the Triton kernel to fp32 rounding noise of the MMA (not guaranteed bitwise: instruction
shapes / FMA contraction can differ), and P1 / P2 hold bitwise by construction (no value from a
masked key can reach a visible one: masked scores are -inf, masked V columns of the shared tile
are zeroed in shared memory before the PV wgmma, masked sk / sv load as 0).

Warp-specialized variant (GluonFwdConfig.ws = 1 or 2, _attn_fwd_gluon_ws_kernel): a 1-warp
producer partition (24 registers) issues every TMA load; each consumer warpgroup runs the loop
above unchanged except that, instead of issuing loads, it arrives once per tile on a release
barrier r_j ("K_j and V_{j-1} are free"), after which the producer refills both stages. Triton
3.6 still puts a bar.sync in front of each mbarrier op, but now partition-local (the 4 consumer
warps, named barrier) and only two per steady-state tile. ws=2: two consumer warpgroups (rows
0-63 / 64-127 of a 128-row item) share one ring (FA3 style, one CTA per SM). Per 64-row group
the tile grid and op order are those of g64x128w4s2, so outputs are expected bitwise equal.

bf16 recipe: not implemented here (raise NotImplementedError; callers fall back to forward.py).
Wired into the public API: the persistent kernel with its serial tile loop (below,
PERSISTENT_FWD[0]) for the fp8 recipes at D=128 (forward.persistent_forward); the other variants
are measured by benchmarks/fwd_gluon_dev.py and lose to it or to the Triton kernel.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import torch

try:   # Gluon ships with triton >= 3.5; keep this module importable without it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    HAVE_GLUON = True
except Exception:   # pragma: no cover - older triton
    HAVE_GLUON = False

from .gluon_common import shared_layout
from .kmajor import mma_key_order_gluon, mma_order16_gluon
from .layout import QuantizedQKV
from .schedule import Schedule, persistent_grid, work_list

LOG2E = 1.4426950408889634
LAST_KERNEL = None      # the last compiled Gluon forward kernel launched (diagnostics)


@dataclass(frozen=True)
class GluonFwdConfig:
    block_m: int = 64       # query rows per CTA: 64 per warpgroup (num_warps=4 -> 64, 8 -> 128)
    block_n: int = 128      # keys per KV tile
    num_warps: int = 4      # 4: one consumer warpgroup (two CTAs per SM); 8: two warpgroups
    stages: int = 2         # depth of the K / V shared-memory ring
    maxnreg: int | None = None
    # Warp specialization: 0 = the single-partition kernel above; 1 or 2 = that many consumer
    # warpgroups (64 query rows each, block_m = 64 * ws) fed by one producer warp that issues
    # every TMA load. num_warps stays 4 (the default partition is one consumer warpgroup).
    ws: int = 0
    producer_regs: int = 24     # setmaxnreg of the producer warp(group)
    consumer_regs: int = 240    # setmaxnreg of the second consumer (ws=2); the first gets the rest
    # Opt-in variants (all off = the kernels above, bitwise). Name suffixes in this order.
    pingpong: bool = False  # -pp, ws=2 only: the consumers take turns issuing their wgmmas (FA3)
    fold: bool = False      # -f: unmasked tiles: p = exp2(fma(s sk, row_f, lr - m)), 1 FFMA
                            #     instead of FMUL + 2 FADD (fp32 rounding of the exponent only)
    lazy: bool = False      # -k: skip acc *= alpha when every alpha of the warpgroup is 1.0
                            #     (no row max changed): bitwise the same result
    poly: int = 0           # -eN: 1 of every N exp2 of unmasked tiles on the FMA pipe (degree-5
                            #     polynomial, ~2e-7 relative like MUFU); N in (2, 4, 8)
    # -PN, ws=1 only: persistent, N CTAs per SM, each walking the work list with stride grid
    # size; the producer warp loads the next item's Q and first K / V tiles while the consumer
    # finishes the current one (_attn_fwd_gluon_persistent_kernel)
    persistent: int = 0
    # -m: vt8 stored in wgmma key order (QuantizedQKV.vt8_mma_order): P's accumulator registers
    # are the PV wgmma's A operand as they are (flamia.ops.kmajor)
    mma_order: bool = False
    # -w, persistent only (diagnostics): each PV wgmma waited for at once, so P's registers are
    # dead before the next tile's softmax (no PV / softmax overlap)
    pv_sync: bool = False
    # -S, persistent only: each tile's PV wgmma issued right after its softmax and retired
    # within the tile (S_{j+1} issued behind it crosses the back edge in flight instead), so
    # P's e4m3 A operand never crosses the loop's back edge, where the compiler repacks it
    # (benchmarks/overlap_probe.py: 595 instead of 799 SASS per tile in the synthetic loop,
    # and at two CTAs per SM the serial order is as fast as the overlapped one there). Same
    # operations in the same order per tile.
    serial: bool = False

    def with_(self, **kw) -> "GluonFwdConfig":
        return replace(self, **kw)

    @property
    def name(self) -> str:
        s = f"g{self.block_m}x{self.block_n}w{self.num_warps}s{self.stages}"
        if self.ws:
            s += f"-ws{self.ws}-p{self.producer_regs}"
            if self.ws == 2:
                s += f"-c{self.consumer_regs}"
        s += f"-r{self.maxnreg}" if self.maxnreg else ""
        s += "-pp" if self.pingpong else ""
        s += "-f" if self.fold else ""
        s += "-k" if self.lazy else ""
        s += f"-e{self.poly}" if self.poly else ""
        s += f"-P{self.persistent}" if self.persistent else ""
        s += "-m" if self.mma_order else ""
        s += "-w" if self.pv_sync else ""
        return s + ("-S" if self.serial else "")


# Named variants for benchmarks (--configs) and the compile test.
CONFIGS = {
    "g64x128w4s2": GluonFwdConfig(64, 128, 4, 2),
    "g64x128w4s3": GluonFwdConfig(64, 128, 4, 3),
    "g64x64w4s3": GluonFwdConfig(64, 64, 4, 3),
    "g128x128w8s2": GluonFwdConfig(128, 128, 8, 2),
    "g128x128w8s3": GluonFwdConfig(128, 128, 8, 3),
    "g128x64w8s3": GluonFwdConfig(128, 64, 8, 3),
    # warp-specialized: 1 consumer warpgroup + 1 producer warp (8 warps allocated), maxnreg 128
    # keeps two CTAs per SM (2 x 8 warps x 32 x 128 = 64K registers), the consumer gets 232
    "g64x128w4s2-ws1-p24-r128": GluonFwdConfig(64, 128, 4, 2, 128, ws=1, producer_regs=24),
    "g64x128w4s3-ws1-p24-r128": GluonFwdConfig(64, 128, 4, 3, 128, ws=1, producer_regs=24),
    # FA3 style: 2 consumer warpgroups (rows 0-63 / 64-127 of a 128-row item) share the ring,
    # one CTA per SM: 12 warps x 168 registers; consumers 240 each, producer 24
    "g128x128w4s2-ws2-p24-c240-r168": GluonFwdConfig(128, 128, 4, 2, 168, ws=2, producer_regs=24,
                                                     consumer_regs=240),
    "g128x128w4s3-ws2-p24-c240-r168": GluonFwdConfig(128, 128, 4, 3, 168, ws=2, producer_regs=24,
                                                     consumer_regs=240),
}

# Next-forward candidates (opt-in flags on the two warp-specialized shapes; see GluonFwdConfig).
# ws2 registers: 12 warps x 168 = 2 x 4 x 240 + 4 x 24, the whole 64K file at one CTA per SM; a
# 40-register producer would need maxnreg 176 (> 64K), so 240 / 24 is already the rebalanced split.
_WS1 = CONFIGS["g64x128w4s3-ws1-p24-r128"]
_WS2 = CONFIGS["g128x128w4s2-ws2-p24-c240-r168"]
_WS2S3 = CONFIGS["g128x128w4s3-ws2-p24-c240-r168"]
NEXT_FWD = [
    _WS1.with_(fold=True),
    _WS1.with_(fold=True, lazy=True),
    _WS1.with_(fold=True, lazy=True, poly=8),
    _WS2.with_(pingpong=True),
    _WS2.with_(pingpong=True, fold=True, lazy=True),
    _WS2S3.with_(pingpong=True, fold=True, lazy=True),
    _WS2.with_(pingpong=True, fold=True, lazy=True, poly=4),
]
CONFIGS.update({c.name: c for c in NEXT_FWD})
# persistent (two CTAs per SM, as ws1's maxnreg 128 allows), token- and key-ordered vt8
# (ws1 at two stages: the second Q buffer would not leave room for two CTAs at three)
_WS1S2 = CONFIGS["g64x128w4s2-ws1-p24-r128"]
# [0] is the default (forward.persistent_forward): the serial tile loop (-S) beat the session-10
# loop ([1]) by 7-19 % on every workload (benchmarks/NOTES.md, session 12)
PERSISTENT_FWD = [_WS1S2.with_(fold=True, persistent=2, serial=True),
                  _WS1S2.with_(fold=True, persistent=2),
                  _WS1S2.with_(fold=True, persistent=2, mma_order=True),
                  _WS1.with_(fold=True, persistent=2),
                  _WS1.with_(fold=True, persistent=2, serial=True)]
# diagnostics of -m (benchmarks/fwd_mma_order_diag.py): the PV wgmma waited for at once
PERSISTENT_DIAG = [_WS1S2.with_(fold=True, persistent=2, pv_sync=True),
                   _WS1S2.with_(fold=True, persistent=2, mma_order=True, pv_sync=True)]
CONFIGS.update({c.name: c for c in PERSISTENT_FWD + PERSISTENT_DIAG})


def persistent_q_buffers(cfg: GluonFwdConfig) -> int:
    """Q buffers of the persistent kernel: two (the next item's Q loads during this item) unless
    three or more ring stages leave no room for them at two CTAs per SM (228 KB)."""
    return 2 if cfg.stages <= 2 else 1


def default_gluon_config(head_dim: int) -> GluonFwdConfig:
    """To be re-tuned on the H200 (benchmarks/fwd_gluon_dev.py); compile-clean on CPU."""
    return GluonFwdConfig(64, 128, 4, 2)


def _check_config(cfg: GluonFwdConfig, D: int):
    if cfg.ws:
        if cfg.ws not in (1, 2) or cfg.num_warps != 4 or cfg.block_m != 64 * cfg.ws:
            raise ValueError(f"{cfg}: warp-specialized configs use num_warps=4 (one consumer "
                             "warpgroup per partition) and block_m = 64 * ws")
    elif cfg.num_warps not in (4, 8) or cfg.block_m != 16 * cfg.num_warps:
        raise ValueError(f"{cfg}: block_m must be 16 * num_warps (64 rows per warpgroup)")
    if cfg.pingpong and cfg.ws != 2:
        raise ValueError(f"{cfg}: ping-pong needs two consumer warpgroups (ws=2)")
    if cfg.persistent and (cfg.ws != 1 or cfg.lazy or cfg.poly):
        raise ValueError(f"{cfg}: the persistent kernel is ws=1 without lazy / poly")
    if (cfg.mma_order or cfg.pv_sync or cfg.serial) and not cfg.persistent:
        raise ValueError(f"{cfg}: mma_order (-m), pv_sync (-w) and serial (-S) exist in the "
                         "persistent kernel only")
    if cfg.serial and cfg.pv_sync:
        raise ValueError(f"{cfg}: serial (-S) and pv_sync (-w) are two different tile loops")
    if cfg.poly not in (0, 2, 4, 8):
        raise ValueError(f"{cfg}: poly is 0 or one exp2 in 2, 4 or 8 on the FMA pipe")
    if cfg.block_n not in (64, 128) or cfg.stages < 2:
        raise ValueError(f"{cfg}: block_n in (64, 128), stages >= 2")
    if D not in (64, 128):
        raise ValueError(f"head dim {D}: the Gluon forward supports 64 and 128")


# exp2 on the FMA pipe for one of every `pack` elements (the rest stay on MUFU, which is 16/clk/SM
# against 128 FMA/clk): x clamped at -126 (result >= 2^-126: only unmasked tiles, where the true
# value is <= 2^-126 * 2^lr and vanishes in l and in e4m3 anyway), j = rint(x) by the 1.5 * 2^23
# trick, r = x - j in [-0.5, 0.5], 2^r by a degree-5 fit (max rel. error 2.2e-7 in fp32 Horner,
# MUFU's ex2.approx is ~2 ulp), then j is added to the exponent field: f's low bits hold j, so
# (f << 23) + bits(2^r) in one integer multiply-add.
_POLY_C = ("0f3AAE0A20", "0f3C1E8639", "0f3D635B64", "0f3E75FC8B", "0f3F317214", "0f3F800000")


def _exp2_mixed_asm(pack: int) -> str:
    body = [f"ex2.approx.ftz.f32 ${i}, ${pack + i};" for i in range(pack - 1)]
    o, x = f"${pack - 1}", f"${2 * pack - 1}"
    body += ["{", ".reg .f32 xc, fj, jf, r, q;", ".reg .b32 fb, qb, ob;",
             f"max.ftz.f32 xc, {x}, 0fC2FC0000;",
             "add.rn.f32 fj, xc, 0f4B400000;", "sub.rn.f32 jf, fj, 0f4B400000;",
             "sub.rn.f32 r, xc, jf;", f"fma.rn.f32 q, {_POLY_C[0]}, r, {_POLY_C[1]};"]
    body += [f"fma.rn.f32 q, q, r, {c};" for c in _POLY_C[2:]]
    body += ["mov.b32 fb, fj;", "mov.b32 qb, q;", "mad.lo.s32 ob, fb, 8388608, qb;",
             f"mov.b32 {o}, ob;", "}"]
    return "\n".join(body)


EXP2_MIXED_ASM = {n: _exp2_mixed_asm(n) for n in (2, 4, 8)}
if HAVE_GLUON:      # jit code reads globals only as constexpr
    _EXP2_ASM2 = gl.constexpr(EXP2_MIXED_ASM[2])
    _EXP2_ASM4 = gl.constexpr(EXP2_MIXED_ASM[4])
    _EXP2_ASM8 = gl.constexpr(EXP2_MIXED_ASM[8])


if HAVE_GLUON:

    @gluon.constexpr_function
    def _wgmma_layout(n, num_warps):
        """Accumulator layout of an m64 x n wgmma: one 64-row block per warpgroup (warps
        stacked along M)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                         instr_shape=[16, n, 32])

    @gluon.jit
    def _program_item(ITEMS, HQ):
        """(query head, work item, document) of this program; doc < 0 marks a padding item. Head
        fastest: the GROUP query heads of one KV head run side by side (L2 reuse)."""
        pid = gl.program_id(0)
        head = pid % HQ
        item = pid // HQ
        doc = gl.load(ITEMS + item)
        return head, item, doc

    @gluon.jit
    def _item_span(ITEMS, CU, N_ITEMS, item, doc):
        """(first token, length) of the item's document and the item's query block in it."""
        blk = gl.load(ITEMS + N_ITEMS + item)
        start = gl.load(CU + doc)
        L = gl.load(CU + doc + 1) - start
        return start, L, blk

    @gluon.jit
    def _kv_tiles(q_lo, L, shift, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
        """(full_end, n_tiles) of query rows [q_lo, q_lo + BM): keys < full_end are visible to
        every row, and the rows visit KV tiles 0 .. n_tiles - 1."""
        if CAUSAL:
            hi = gl.minimum(q_lo + BM, L)       # keys [0, hi) visited
            full_end = q_lo
        else:
            hi = L
            full_end = L
        return full_end, (hi + shift + BN - 1) // BN

    @gluon.jit
    def _query_rows(SQ, VCAP, T, qk_scale, start, q_lo, L, head, kvh, BM: gl.constexpr,
                    s_layout: gl.constexpr):
        """Per-row constants of query rows [q_lo, q_lo + BM) (the rows of S): tok0, the doc-local
        rows, row_ok, row_f = sq * qk_scale and lr = log2(256 / cap)."""
        tok0 = start.to(gl.int64)
        rows = q_lo + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        row_ok = rows < L
        sq = gl.load(SQ + head.to(gl.int64) * T + tok0 + rows, mask=row_ok, other=0.0)
        row_f = sq * qk_scale
        cap = gl.load(VCAP + kvh.to(gl.int64) * T + tok0 + rows, mask=row_ok, other=1.0)
        # lr exact from the exponent bits (cap is a power of two or 0)
        ecap = ((cap.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
        lr = gl.where(cap > 0.0, gl.minimum(8 - ecap, 100), 0).to(gl.float32)
        return tok0, rows, row_ok, row_f, lr

    @gluon.jit
    def _alloc_kv_ring(k_desc, v_desc, sk_desc, sv_desc, STAGES: gl.constexpr, BN: gl.constexpr,
                       D: gl.constexpr):
        """Shared memory of the STAGES-deep ring: K (BN x D), V^T (D x BN), sk and sv (1 x BN)
        per stage, in the layouts of their TMA descriptors."""
        k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BN], v_desc.layout)
        sk_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BN], sk_desc.layout)
        sv_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BN], sv_desc.layout)
        return k_smem, v_smem, sk_smem, sv_smem

    @gluon.jit
    def _load_k(k_desc, sk_desc, sv_desc, k_smem, sk_smem, sv_smem, k_ready, j, kv_row0, kvh,
                pred):
        """TMA K tile j (BN x D, token rows) and its sk / sv (1 x BN) into K-ring stage j % STAGES
        (the scales ride on K's barrier: both are needed for S_j's softmax). Sizes come from the
        buffers' types: constexpr arguments of a worker partition arrive as tensors in 3.6."""
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BN: gl.constexpr = k_smem.type.shape[1]
        D: gl.constexpr = k_smem.type.shape[2]
        st = j % STAGES
        row = kv_row0 + j * BN
        bk = k_ready.index(st)
        mbarrier.expect(bk, k_desc.block_type.nbytes + 2 * sk_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [row, kvh * D], bk, k_smem.index(st), pred)
        tma.async_copy_global_to_shared(sk_desc, [kvh, row], bk, sk_smem.index(st), pred)
        tma.async_copy_global_to_shared(sv_desc, [kvh, row], bk, sv_smem.index(st), pred)

    @gluon.jit
    def _load_v(v_desc, v_smem, v_ready, j, kv_row0, kvh, pred):
        """TMA V^T tile j (D x BN, from vt8) into V-ring stage j % STAGES."""
        STAGES: gl.constexpr = v_smem.type.shape[0]
        D: gl.constexpr = v_smem.type.shape[1]
        BN: gl.constexpr = v_smem.type.shape[2]
        st = j % STAGES
        bv = v_ready.index(st)
        mbarrier.expect(bv, v_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(v_desc, [kvh * D, kv_row0 + j * BN], bv, v_smem.index(st),
                                        pred)

    @gluon.jit
    def _load_v_bounded(v_desc, v_smem, v_ready, j, kv_row0, kvh, n_tiles):
        """_load_v with pred = j < n_tiles (the plain kernel's loads), formed here after the
        barrier address rather than by the caller: that is the plain kernel's PTX order."""
        STAGES: gl.constexpr = v_smem.type.shape[0]
        D: gl.constexpr = v_smem.type.shape[1]
        BN: gl.constexpr = v_smem.type.shape[2]
        st = j % STAGES
        bv = v_ready.index(st)
        mbarrier.expect(bv, v_desc.block_type.nbytes, pred=j < n_tiles)
        tma.async_copy_global_to_shared(v_desc, [kvh * D, kv_row0 + j * BN], bv, v_smem.index(st),
                                        j < n_tiles)

    @gluon.jit
    def _load_k_at(k_desc, sk_desc, sv_desc, k_smem, sk_smem, sv_smem, k_ready, st, row, kvh):
        """_load_k into ring stage st from absolute token row `row` (the persistent kernel's
        tile sequence does not start at the document)."""
        D: gl.constexpr = k_smem.type.shape[2]
        bk = k_ready.index(st)
        mbarrier.expect(bk, k_desc.block_type.nbytes + 2 * sk_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kvh * D], bk, k_smem.index(st))
        tma.async_copy_global_to_shared(sk_desc, [kvh, row], bk, sk_smem.index(st))
        tma.async_copy_global_to_shared(sv_desc, [kvh, row], bk, sv_smem.index(st))

    @gluon.jit
    def _load_v_at(v_desc, v_smem, v_ready, st, row, kvh):
        """_load_v into ring stage st from absolute token column `row` of vt8."""
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
    def _exp2_mixed(x, POLY: gl.constexpr):
        """exp2(x), 1 of every POLY elements by the polynomial of EXP2_MIXED_ASM (x > -inf)."""
        if POLY == 2:
            return gl.inline_asm_elementwise(_EXP2_ASM2, "=f,=f,f,f", [x], dtype=gl.float32,
                                             is_pure=True, pack=2)
        elif POLY == 4:
            return gl.inline_asm_elementwise(_EXP2_ASM4, "=f,=f,=f,=f,f,f,f,f", [x],
                                             dtype=gl.float32, is_pure=True, pack=4)
        else:
            gl.static_assert(POLY == 8)
            return gl.inline_asm_elementwise(_EXP2_ASM8,
                                             "=f,=f,=f,=f,=f,=f,=f,=f,f,f,f,f,f,f,f,f", [x],
                                             dtype=gl.float32, is_pure=True, pack=8)

    @gluon.jit
    def _online_softmax(s, sk_s, sv_s, m_i, l_i, row_f, lr, rows, n0, L,
                        MASKED: gl.constexpr, CAUSAL: gl.constexpr, o_layout: gl.constexpr,
                        FOLD: gl.constexpr = False, POLY: gl.constexpr = 0,
                        MMA_ORDER: gl.constexpr = False):
        """Online softmax of one S tile, written like forward._attn_inner (log2 units, lr riding
        on the subtracted max) -> (A = e4m3(p' sv) as the PV wgmma's A operand, m, l, alpha).

        sk / sv are read from their shared-memory stage here (short register live ranges). On
        masked tiles keys outside the document hold a neighbour's scales (maybe NaN): their
        scores become -inf and their sv 0, as the Triton kernel's masked loads give."""
        BN: gl.constexpr = s.type.shape[1]
        col_layout: gl.constexpr = gl.SliceLayout(0, s.type.layout)
        s = s * gl.expand_dims(sk_s.load(col_layout), 0)
        if MASKED:
            cols = n0 + gl.arange(0, BN, layout=col_layout)
            col_ok = (cols >= 0) & (cols < L)
            sv = gl.where(col_ok, sv_s.load(col_layout), 0.0)
            valid = gl.expand_dims(col_ok, 0)
            if CAUSAL:
                valid = valid & (gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0))
            x = gl.where(valid, s * gl.expand_dims(row_f, 1), float("-inf"))
            m_new = gl.maximum(m_i, gl.max(x, axis=1))
            p = gl.exp2((x - gl.expand_dims(m_new, 1)) + gl.expand_dims(lr, 1))
        else:
            sv = sv_s.load(col_layout)
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * row_f)      # row_f >= 0
            if FOLD:
                # (x - m) + lr as one FFMA per element; lr - m rounds once per row instead
                arg = gl.fma(s, gl.expand_dims(row_f, 1), gl.expand_dims(lr - m_new, 1))
            else:
                arg = (s * gl.expand_dims(row_f, 1) - gl.expand_dims(m_new, 1)) + gl.expand_dims(lr, 1)
            if POLY > 0:
                p = _exp2_mixed(arg, POLY)
            else:
                p = gl.exp2(arg)
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        a = (p * gl.expand_dims(sv, 0)).to(gl.float8e4nv)          # RNE, satfinite
        if MMA_ORDER:
            a = mma_key_order_gluon(a)
        a = gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4))
        return a, m_new, l_i, alpha

    @gluon.jit
    def _softmax_tile(s, sk_smem, sv_smem, st, m_i, l_i, row_f, lr, rows, n0, L, full_end,
                      CAUSAL: gl.constexpr, o_layout: gl.constexpr, FOLD: gl.constexpr,
                      POLY: gl.constexpr, MMA_ORDER: gl.constexpr = False):
        """_online_softmax of the S tile whose keys start at n0 and whose scales sit in ring
        stage st: masked where the tile reaches outside the document or past full_end, the
        FOLD / POLY variants elsewhere."""
        BN: gl.constexpr = s.type.shape[1]
        sk_s = _scale_view(sk_smem, st, BN)
        sv_s = _scale_view(sv_smem, st, BN)
        if (n0 < 0) | (n0 + BN > full_end):
            a, m_i, l_i, alpha = _online_softmax(s, sk_s, sv_s, m_i, l_i, row_f, lr, rows, n0, L,
                                                 True, CAUSAL, o_layout, False, 0, MMA_ORDER)
        else:
            a, m_i, l_i, alpha = _online_softmax(s, sk_s, sv_s, m_i, l_i, row_f, lr, rows, n0, L,
                                                 False, CAUSAL, o_layout, FOLD, POLY, MMA_ORDER)
        return a, m_i, l_i, alpha

    @gluon.jit
    def _any_rescale(alpha):
        """Does any row of the warpgroup need acc *= alpha? alpha == 1.0 exactly when the row max
        did not move (exp2(0) = 1), and multiplying by 1.0 is the identity, so skipping is bitwise
        neutral; NaN compares unequal and still multiplies. One cross-warp max per tile: each
        warp holds 16 of the 64 rows; a per-warp branch is not expressible in Gluon 3.6."""
        return gl.max(gl.where(alpha != 1.0, 1, 0), axis=0) != 0

    @gluon.jit
    def _mul_rows(acc, x):
        """acc * x[:, None]: x holds one value per row (in any layout)."""
        return acc * gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(1, acc.type.layout)), 1)

    @gluon.jit
    def _zero_v_outside(v_tile, n0, L, num_warps: gl.constexpr, MMA_ORDER: gl.constexpr = False):
        """Zero the V^T columns (keys) of a ring stage that lie outside the document, in place.

        Their P is 0, but 0 * NaN is NaN in the MMA: keys of a neighbouring document (head tile,
        document end) must not let its NaN/Inf in (P2). Only for the <= 2 edge tiles per item.
        """
        BN: gl.constexpr = v_tile.type.shape[1]
        TPW_N: gl.constexpr = BN // 16
        blk: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_N, TPW_N], [num_warps, 1], [1, 0])
        v = v_tile.load(blk)
        c = gl.arange(0, BN, layout=gl.SliceLayout(0, blk))
        if MMA_ORDER:       # column c holds key mma_order16(c) of the tile (tiles 16-aligned)
            c = mma_order16_gluon(c)
        cols = n0 + c
        ok = gl.expand_dims((cols >= 0) & (cols < L), 0)
        v = gl.where(ok, v, gl.zeros_like(v))
        v_tile.store(v)
        fence_async_shared()      # generic-proxy stores -> visible to the wgmma (async proxy)
        gl.thread_barrier()       # every thread's columns written before any warp issues PV

    @gluon.jit
    def _wait_v(v_smem, v_ready, st, j, n0, L, num_warps: gl.constexpr,
                MMA_ORDER: gl.constexpr = False):
        """Wait for V^T tile j (ring stage st, keys from n0) and zero its keys outside the
        document if it is an edge tile, before the PV wgmma reads it."""
        STAGES: gl.constexpr = v_smem.type.shape[0]
        BN: gl.constexpr = v_smem.type.shape[2]
        mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
        if (n0 < 0) | (n0 + BN > L):
            _zero_v_outside(v_smem.index(st), n0, L, num_warps, MMA_ORDER)

    @gluon.jit
    def _store_out(acc, m_i, l_i, lr, O, LSE, stride_ot, stride_oh, T, tok0, q_lo, rows, row_ok,
                   L, head):
        """Epilogue of query rows [q_lo, q_lo + BM): O = acc / l' and
        lse = ln2 * (m + log2 l' - lr)."""
        BM: gl.constexpr = acc.type.shape[0]
        D: gl.constexpr = acc.type.shape[1]
        inv_l = 1.0 / l_i
        out = _mul_rows(acc, inv_l)
        rows_o = q_lo + gl.arange(0, BM, layout=gl.SliceLayout(1, acc.type.layout))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc.type.layout))
        o_ptrs = (O + gl.expand_dims((tok0 + rows_o) * stride_ot, 1) + head * stride_oh
                  + gl.expand_dims(offs_d, 0))
        gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=gl.expand_dims(rows_o < L, 1))
        lse = (m_i + gl.log2(l_i) - lr) * 0.6931471805599453
        gl.store(LSE + head.to(gl.int64) * T + tok0 + rows, lse, mask=row_ok)

    @gluon.jit
    def _attn_fwd_gluon_kernel(q_desc, k_desc, v_desc, sk_desc, sv_desc, SQ, VCAP, O, LSE, ITEMS,
                               CU, stride_ot, stride_oh, T, N_ITEMS, HQ, GROUP, qk_scale,
                               D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                               FOLD: gl.constexpr, LAZY: gl.constexpr, POLY: gl.constexpr,
                               num_warps: gl.constexpr):
        s_layout: gl.constexpr = _wgmma_layout(BN, num_warps)
        o_layout: gl.constexpr = _wgmma_layout(D, num_warps)

        head, item, doc = _program_item(ITEMS, HQ)
        if doc < 0:
            return
        start, L, blk = _item_span(ITEMS, CU, N_ITEMS, item, doc)
        kvh = head // GROUP
        q_lo = blk * BM
        shift = start % 16
        kv_row0 = start - shift                 # absolute, 16-aligned row of KV tile 0
        full_end, n_tiles = _kv_tiles(q_lo, L, shift, BM, BN, CAUSAL)

        # ---- shared memory: Q, a STAGES-deep ring of K, V^T, sk, sv; mbarriers ----
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BM, D], q_desc.layout)
        k_smem, v_smem, sk_smem, sv_smem = _alloc_kv_ring(k_desc, v_desc, sk_desc, sv_desc,
                                                          STAGES, BN, D)
        bar_q = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        bar_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        bar_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bar_q.index(0), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(bar_k.index(i), count=1)
            mbarrier.init(bar_v.index(i), count=1)

        mbarrier.expect(bar_q.index(0), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [start + q_lo, head * D], bar_q.index(0), q_smem)
        for i in gl.static_range(STAGES):
            _load_k(k_desc, sk_desc, sv_desc, k_smem, sk_smem, sv_smem, bar_k, i, kv_row0, kvh,
                    i < n_tiles)
        for i in gl.static_range(STAGES):
            _load_v_bounded(v_desc, v_smem, bar_v, i, kv_row0, kvh, n_tiles)

        # ---- per-row state (overlaps the first loads) ----
        tok0, rows, row_ok, row_f, lr = _query_rows(SQ, VCAP, T, qk_scale, start, q_lo, L, head,
                                                    kvh, BM, s_layout)
        m_i = gl.full_like(row_f, float("-inf"))
        l_i = gl.zeros_like(row_f)

        # ---- tile 0: S_0, softmax (no PV in flight yet) ----
        n0 = -shift
        mbarrier.wait(bar_q.index(0), 0)
        mbarrier.wait(bar_k.index(0), 0)
        s = _issue_qk(q_smem, k_smem.index(0), s_layout)
        s = warpgroup_mma_wait(0, deps=[s])
        a, m_i, l_i, alpha = _softmax_tile(s, sk_smem, sv_smem, 0, m_i, l_i, row_f, lr, rows, n0,
                                           L, full_end, CAUSAL, o_layout, FOLD, POLY)
        # K stage 0 is free (S_0 done, its scales read): refill it with tile STAGES
        _load_k(k_desc, sk_desc, sv_desc, k_smem, sk_smem, sv_smem, bar_k, STAGES, kv_row0, kvh,
                STAGES < n_tiles)
        acc = gl.zeros([BM, D], gl.float32, o_layout)

        # ---- steady state: S_j in flight with PV_{j-1}; softmax_j overlaps PV_{j-1} ----
        for j in range(1, n_tiles):
            st = j % STAGES
            pst = (j - 1) % STAGES
            n0_prev = n0
            n0 = j * BN - shift
            mbarrier.wait(bar_k.index(st), (j // STAGES) & 1)
            s = _issue_qk(q_smem, k_smem.index(st), s_layout)
            _wait_v(v_smem, bar_v, pst, j - 1, n0_prev, L, num_warps)
            acc = warpgroup_mma(a, v_smem.index(pst).permute((1, 0)), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s])
            a_new, m_i, l_i, alpha = _softmax_tile(s, sk_smem, sv_smem, st, m_i, l_i, row_f, lr,
                                                   rows, n0, L, full_end, CAUSAL, o_layout, FOLD,
                                                   POLY)
            # K stage st is free (S_j done, its scales read): tile j + STAGES gets a full
            # iteration of slack even with two stages
            _load_k(k_desc, sk_desc, sv_desc, k_smem, sk_smem, sv_smem, bar_k, j + STAGES,
                    kv_row0, kvh, j + STAGES < n_tiles)
            if LAZY:
                resc = _any_rescale(alpha)
            # The PV wgmma reads `a` from registers until this wait (fp8 values cannot be wait
            # deps in 3.6; ptxas keeps wgmma register operands alive up to wgmma.wait_group).
            acc = warpgroup_mma_wait(0, deps=[acc])
            if LAZY:
                if resc:
                    acc = _mul_rows(acc, alpha)
            else:
                acc = _mul_rows(acc, alpha)
            a = a_new
            # V stage pst is free (read by the PV just waited on)
            _load_v_bounded(v_desc, v_smem, bar_v, j - 1 + STAGES, kv_row0, kvh, n_tiles)

        # ---- last PV ----
        last = n_tiles - 1
        lst = last % STAGES
        _wait_v(v_smem, bar_v, lst, last, n0, L, num_warps)
        acc = warpgroup_mma(a, v_smem.index(lst).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])

        mbarrier.invalidate(bar_q.index(0))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bar_k.index(i))
            mbarrier.invalidate(bar_v.index(i))

        _store_out(acc, m_i, l_i, lr, O, LSE, stride_ot, stride_oh, T, tok0, q_lo, rows, row_ok,
                   L, head)

    # -----------------------------------------------------------------------------------------
    # Warp-specialized variant: a 1-warp producer issues every TMA load into an empty/ready
    # mbarrier ring; each consumer warpgroup (64 query rows) runs the loop body above with the
    # TMA issues replaced by releases of the stages it has finished reading.
    # -----------------------------------------------------------------------------------------

    @gluon.jit
    def _ws_producer(q_desc, k_desc, v_desc, sk_desc, sv_desc, q_smem, k_smem, v_smem, sk_smem,
                     sv_smem, bar_q, k_ready, v_ready, rel, q_row, head, kv_row0, kvh, n_tiles):
        """Q (one 64-row box per consumer) and the first STAGES tiles of K (+ sk, sv) and V^T,
        then per consumer release r_j: K_{j+STAGES} into K_j's stage and V_{j+STAGES-1} into
        V_{j-1}'s (r_j says both are free; r_0 frees K_0 only).

        One release barrier per step instead of separate K / V empties because Triton 3.6 puts
        a partition-wide bar.sync in front of every mbarrier.arrive. Sizes come from the
        buffers' types (see _load_k)."""
        NC: gl.constexpr = q_smem.type.shape[0]
        STAGES: gl.constexpr = k_smem.type.shape[0]
        D: gl.constexpr = k_smem.type.shape[2]
        mbarrier.expect(bar_q.index(0), NC * q_desc.block_type.nbytes)
        for c in gl.static_range(NC):
            tma.async_copy_global_to_shared(q_desc, [q_row + c * 64, head * D], bar_q.index(0),
                                            q_smem.index(c))
        for i in gl.static_range(STAGES):
            _load_k(k_desc, sk_desc, sv_desc, k_smem, sk_smem, sv_smem, k_ready, i, kv_row0,
                    kvh, i < n_tiles)
        for i in gl.static_range(STAGES):
            _load_v(v_desc, v_smem, v_ready, i, kv_row0, kvh, i < n_tiles)
        for j in range(0, n_tiles - STAGES + 1):
            mbarrier.wait(rel.index(j % STAGES), (j // STAGES) & 1)
            _load_k(k_desc, sk_desc, sv_desc, k_smem, sk_smem, sv_smem, k_ready, j + STAGES,
                    kv_row0, kvh, j + STAGES < n_tiles)
            _load_v(v_desc, v_smem, v_ready, j + STAGES - 1, kv_row0, kvh, j > 0)

    @gluon.jit
    def _ws_consumer(q_smem, k_smem, v_smem, sk_smem, sv_smem, bar_q, k_ready, v_ready, rel,
                     turn, SQ, VCAP, O, LSE, stride_ot, stride_oh, T, qk_scale, start, L, q_lo0,
                     head, kvh, CID: gl.constexpr, D: gl.constexpr, BN: gl.constexpr,
                     STAGES: gl.constexpr, CAUSAL: gl.constexpr, NW: gl.constexpr,
                     FOLD: gl.constexpr, LAZY: gl.constexpr, POLY: gl.constexpr,
                     PP: gl.constexpr):
        """Rows [q_lo0 + 64 CID, +64) of the item: the numerics of _attn_fwd_gluon_kernel, op for
        op (same tile grid, same softmax / rounding / rescale order), so results are bitwise
        those of the single-partition kernel up to the wgmma's own rounding."""
        BM: gl.constexpr = 16 * NW
        s_layout: gl.constexpr = _wgmma_layout(BN, NW)
        o_layout: gl.constexpr = _wgmma_layout(D, NW)

        q_lo = q_lo0 + CID * BM
        shift = start % 16
        # With two consumers the producer runs to the second one's n_tiles (>= this one's, by
        # at most one tile); the extra tile needs no release: nothing is loaded after it.
        full_end, n_tiles = _kv_tiles(q_lo, L, shift, BM, BN, CAUSAL)
        if PP:
            # the other consumer's tile count: both run max(n) + 1 turns (the extra ones empty)
            # so that neither waits for a hand-over that never comes
            _, n_other = _kv_tiles(q_lo0 + (1 - CID) * BM, L, shift, BM, BN, CAUSAL)

        tok0, rows, row_ok, row_f, lr = _query_rows(SQ, VCAP, T, qk_scale, start, q_lo, L, head,
                                                    kvh, BM, s_layout)
        m_i = gl.full_like(row_f, float("-inf"))
        l_i = gl.zeros_like(row_f)
        q_tile = q_smem.index(CID)

        # ---- tile 0 ----
        n0 = -shift
        mbarrier.wait(bar_q.index(0), 0)
        mbarrier.wait(k_ready.index(0), 0)
        if PP:
            if CID == 1:                        # consumer 0 takes the first turn
                mbarrier.wait(turn.index(1), 0)
        s = _issue_qk(q_tile, k_smem.index(0), s_layout)
        if PP:
            _pp_handover(turn, CID)
        s = warpgroup_mma_wait(0, deps=[s])
        a, m_i, l_i, alpha = _softmax_tile(s, sk_smem, sv_smem, 0, m_i, l_i, row_f, lr, rows, n0,
                                           L, full_end, CAUSAL, o_layout, FOLD, POLY)
        _ws_release(rel, 0)                     # r_0: K_0 (and its scales) read
        acc = gl.zeros([BM, D], gl.float32, o_layout)

        for j in range(1, n_tiles):
            st = j % STAGES
            pst = (j - 1) % STAGES
            n0_prev = n0
            n0 = j * BN - shift
            mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
            if PP:
                # data first, then the turn: the turn is held only while issuing (FA3 ping-pong:
                # this group's GEMMs queue behind the other's, its softmax runs under them)
                _wait_v(v_smem, v_ready, pst, j - 1, n0_prev, L, NW)
                _pp_acquire(turn, CID, j)
                s = _issue_qk(q_tile, k_smem.index(st), s_layout)
                acc = warpgroup_mma(a, v_smem.index(pst).permute((1, 0)), acc, is_async=True)
                _pp_handover(turn, CID)
            else:
                s = _issue_qk(q_tile, k_smem.index(st), s_layout)
                _wait_v(v_smem, v_ready, pst, j - 1, n0_prev, L, NW)
                acc = warpgroup_mma(a, v_smem.index(pst).permute((1, 0)), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s])
            a_new, m_i, l_i, alpha = _softmax_tile(s, sk_smem, sv_smem, st, m_i, l_i, row_f, lr,
                                                   rows, n0, L, full_end, CAUSAL, o_layout, FOLD,
                                                   POLY)
            if LAZY:
                resc = _any_rescale(alpha)
            acc = warpgroup_mma_wait(0, deps=[acc])
            # r_j: K_j (read by S_j, its scales by the softmax) and V_{j-1} (read by the PV
            # just waited on) are free. PV_{j-1} was issued before softmax_j, so holding K_j
            # until here costs ~nothing.
            _ws_release(rel, st)
            if LAZY:
                if resc:
                    acc = _mul_rows(acc, alpha)
            else:
                acc = _mul_rows(acc, alpha)
            a = a_new

        last = n_tiles - 1
        lst = last % STAGES
        _wait_v(v_smem, v_ready, lst, last, n0, L, NW)
        if PP:
            _pp_acquire(turn, CID, n_tiles)
        acc = warpgroup_mma(a, v_smem.index(lst).permute((1, 0)), acc, is_async=True)
        if PP:
            _pp_handover(turn, CID)
            for k in range(n_tiles + 1, n_other + 1):      # empty turns (at most one)
                _pp_acquire(turn, CID, k)
                _pp_handover(turn, CID)
        acc = warpgroup_mma_wait(0, deps=[acc])

        _store_out(acc, m_i, l_i, lr, O, LSE, stride_ot, stride_oh, T, tok0, q_lo, rows, row_ok,
                   L, head)

    @gluon.jit
    def _pp_acquire(turn, CID: gl.constexpr, k):
        """Wait for this consumer's k-th turn (k >= 1 for consumer 0, which opens): hand-over
        number k + CID on turn[CID], i.e. phase parity (k + CID - 1) & 1. Turns alternate
        strictly, so a barrier is never more than one phase ahead of its waiter."""
        mbarrier.wait(turn.index(CID), (k + CID + 1) & 1)

    @gluon.jit
    def _pp_handover(turn, CID: gl.constexpr):
        """This consumer's wgmmas are issued (committed): the other one may issue its own.
        (Triton's partition-wide bar.sync before the arrive makes it follow every warp's issue.)"""
        mbarrier.arrive(turn.index(1 - CID), count=1)

    @gluon.jit
    def _ws_release(rel, st):
        """One arrival of this consumer warpgroup on release barrier st. Triton puts a
        partition-wide bar.sync before the arrive (issued by one thread), which is what makes
        every warp's reads of the scales complete first; the fence orders those generic-proxy
        reads (and the V zeroing stores) before the producer's next TMA write to the stage."""
        fence_async_shared()
        mbarrier.arrive(rel.index(st), count=1)

    @gluon.jit
    def _attn_fwd_gluon_ws_kernel(q_desc, k_desc, v_desc, sk_desc, sv_desc, SQ, VCAP, O, LSE,
                                  ITEMS, CU, stride_ot, stride_oh, T, N_ITEMS, HQ, GROUP, qk_scale,
                                  D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, NC: gl.constexpr,
                                  PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                  FOLD: gl.constexpr, LAZY: gl.constexpr, POLY: gl.constexpr,
                                  PP: gl.constexpr, num_warps: gl.constexpr):
        head, item, doc = _program_item(ITEMS, HQ)
        if doc < 0:
            return
        start, L, blk = _item_span(ITEMS, CU, N_ITEMS, item, doc)
        kvh = head // GROUP
        q_lo = blk * BM
        shift = start % 16
        kv_row0 = start - shift
        # the producer loads for the whole item: the last consumer's rows reach furthest
        _, n_tiles = _kv_tiles(q_lo, L, shift, BM, BN, CAUSAL)

        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [NC, 64, D], q_desc.layout)
        k_smem, v_smem, sk_smem, sv_smem = _alloc_kv_ring(k_desc, v_desc, sk_desc, sv_desc,
                                                          STAGES, BN, D)
        bar_q = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        rel = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bar_q.index(0), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(rel.index(i), count=NC)
        if PP:
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(turn.index(0), count=1)
            mbarrier.init(turn.index(1), count=1)
        else:
            turn = rel      # unused placeholder

        prod_args = (q_desc, k_desc, v_desc, sk_desc, sv_desc, q_smem, k_smem, v_smem, sk_smem,
                     sv_smem, bar_q, k_ready, v_ready, rel, start + q_lo, head, kv_row0, kvh,
                     n_tiles)
        if NC == 1:
            gl.warp_specialize([
                (_ws_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, bar_q, k_ready, v_ready,
                                rel, turn, SQ, VCAP, O, LSE, stride_ot, stride_oh, T,
                                qk_scale, start, L, q_lo, head, kvh, 0, D, BN, STAGES, CAUSAL,
                                num_warps, FOLD, LAZY, POLY, PP)),
                (_ws_producer, prod_args),
            ], [1], [PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_ws_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, bar_q, k_ready, v_ready,
                                rel, turn, SQ, VCAP, O, LSE, stride_ot, stride_oh, T,
                                qk_scale, start, L, q_lo, head, kvh, 0, D, BN, STAGES, CAUSAL,
                                num_warps, FOLD, LAZY, POLY, PP)),
                (_ws_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, bar_q, k_ready, v_ready,
                                rel, turn, SQ, VCAP, O, LSE, stride_ot, stride_oh, T,
                                qk_scale, start, L, q_lo, head, kvh, 1, D, BN, STAGES, CAUSAL,
                                num_warps, FOLD, LAZY, POLY, PP)),
                (_ws_producer, prod_args),
            ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])

        mbarrier.invalidate(bar_q.index(0))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(rel.index(i))
        if PP:
            mbarrier.invalidate(turn.index(0))
            mbarrier.invalidate(turn.index(1))


    # -----------------------------------------------------------------------------------------
    # Persistent variant (GluonFwdConfig.persistent = CTAs per SM, ws=1): each CTA walks work
    # indices w = pid, pid + G, ... (G = grid size; w = item * HQ + head, the one-program-per-
    # item kernels' order) with one producer warp and one consumer warpgroup. A short item (a
    # 512-token document: 1-4 KV tiles per 64-row block) otherwise pays, per program, a chain of
    # dependent latencies (work list -> cu_seqlens -> Q / K by TMA -> ... -> V) with the tensor
    # cores idle in between; here the producer runs ahead across item boundaries.
    #
    # Ring protocol, in one tile sequence g = 0, 1, ... over all items of the CTA: K_g and V_g
    # go to stage g % STAGES; the consumer's release r_g (after S_g and PV_{g-1} are done) frees
    # K_g and V_{g-1}; the producer loads K_g after r_{g-STAGES} (K_{g-STAGES} read) and V_g
    # after r_{g-STAGES+1} (V_{g-STAGES} read), the release K_{g+1} waits for anyway. PV of an
    # item's last tile is waited on before the next item starts, so V of that tile is free by
    # the next release. Q is double
    # buffered at two ring stages (item i's Q goes to buffer i % 2 after the consumer's q_free
    # for item i - 2) and single at three, where two buffers would leave room for one CTA per SM
    # only; one buffer is still refilled before the item ends (after its last QK^T).
    # -----------------------------------------------------------------------------------------

    @gluon.jit
    def _pers_meta(ITEMS, N_ITEMS, HQ, GROUP, W, w):
        """(doc, head, kvh, start, L, blk) of work index w, straight from the work list (rows
        document, block, first token, length: no dependent cu_seqlens load); doc < 0 for a
        padding item or w >= W. Independent loads: issued one item ahead, they arrive while
        the current item computes."""
        ok = w < W
        head = w % HQ
        item = w // HQ
        doc = gl.load(ITEMS + item, mask=ok, other=-1)
        blk = gl.load(ITEMS + N_ITEMS + item, mask=ok, other=0)
        start = gl.load(ITEMS + 2 * N_ITEMS + item, mask=ok, other=0)
        L = gl.load(ITEMS + 3 * N_ITEMS + item, mask=ok, other=0)
        return doc, head, head // GROUP, start, L, blk

    @gluon.jit
    def _pers_producer(q_desc, k_desc, v_desc, sk_desc, sv_desc, q_smem, k_smem, v_smem,
                       sk_smem, sv_smem, q_ready, q_free, k_ready, v_ready, rel, ITEMS,
                       N_ITEMS, HQ, GROUP, W, BM: gl.constexpr, BN: gl.constexpr,
                       CAUSAL: gl.constexpr, QBUF: gl.constexpr):
        STAGES: gl.constexpr = k_smem.type.shape[0]
        D: gl.constexpr = k_smem.type.shape[2]
        g = 0               # tiles loaded so far (the CTA-wide tile sequence)
        it = 0              # items started so far
        for w in range(gl.program_id(0), W, gl.num_programs(0)):
            doc, head, kvh, start, L, blk = _pers_meta(ITEMS, N_ITEMS, HQ, GROUP, W, w)
            if doc >= 0:
                q_lo = blk * BM
                shift = start % 16
                _, n_tiles = _kv_tiles(q_lo, L, shift, BM, BN, CAUSAL)
                qb = it % QBUF
                mbarrier.wait(q_free.index(qb), ((it // QBUF) + 1) & 1, pred=it >= QBUF)
                mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [start + q_lo, head * D],
                                                q_ready.index(qb), q_smem.index(qb))
                row = start - shift
                for t in range(n_tiles):
                    st = g % STAGES
                    # K_g after r_{g-STAGES} (K_{g-STAGES} read); V_g after r_{g-STAGES+1}
                    # (V_{g-STAGES} read), which K_{g+1} needs anyway. Re-waiting r_{g+1-STAGES}
                    # at the next tile is safe: its barrier cannot complete again before K_{g+1}.
                    mbarrier.wait(rel.index(st), ((g // STAGES) + 1) & 1, pred=g >= STAGES)
                    _load_k_at(k_desc, sk_desc, sv_desc, k_smem, sk_smem, sv_smem, k_ready, st,
                               row, kvh)
                    mbarrier.wait(rel.index((g + 1) % STAGES), (((g + 1) // STAGES) + 1) & 1,
                                  pred=g + 1 >= STAGES)
                    _load_v_at(v_desc, v_smem, v_ready, st, row, kvh)
                    row += BN
                    g += 1
                it += 1

    @gluon.jit
    def _keep_alive(x):
        """An empty asm statement reading every register of x (an fp8 wgmma A operand): the
        registers stay allocated up to here, past the wait that retires the wgmma reading them.
        (warpgroup_mma_wait's deps takes no 8-bit tensor in triton 3.6: "Unexpected bitwidth in
        WGMMAWaitGroupOp".) No instruction is emitted."""
        gl.inline_asm_elementwise("", "=r,r", [x], dtype=gl.int8, is_pure=False, pack=4)

    @gluon.jit
    def _pers_serial_step(s, acc, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready,
                          rel, m_i, l_i, row_f, lr, rows, n0, L, full_end, g,
                          RESCALE: gl.constexpr, NEXT: gl.constexpr, BN: gl.constexpr,
                          STAGES: gl.constexpr, CAUSAL: gl.constexpr, NW: gl.constexpr,
                          FOLD: gl.constexpr, MMA_ORDER: gl.constexpr):
        """One tile g of _pers_serial_tiles: its S (in flight) -> softmax -> release r_g (K_g
        read; V_{g-1} read by the previous PV, retired) -> rescale (RESCALE: not on an item's
        first tile, whose acc is zero) -> PV_g; then (NEXT) S_{g+1} issued behind it, and PV_g
        retired with S_{g+1} left in flight. P's registers are kept alive to that wait
        (_keep_alive): the PV wgmma reads them asynchronously."""
        s_layout: gl.constexpr = _wgmma_layout(BN, NW)
        o_layout: gl.constexpr = _wgmma_layout(acc.type.shape[1], NW)
        st = g % STAGES
        s = warpgroup_mma_wait(0, deps=[s])
        a, m_i, l_i, alpha = _softmax_tile(s, sk_smem, sv_smem, st, m_i, l_i, row_f, lr, rows,
                                           n0, L, full_end, CAUSAL, o_layout, FOLD, 0, MMA_ORDER)
        _ws_release(rel, st)
        if RESCALE:
            acc = _mul_rows(acc, alpha)
        _wait_v(v_smem, v_ready, st, g, n0, L, NW, MMA_ORDER)
        acc = warpgroup_mma(a, v_smem.index(st).permute((1, 0)), acc, is_async=True)
        g += 1
        if NEXT:
            nst = g % STAGES
            mbarrier.wait(k_ready.index(nst), (g // STAGES) & 1)
            s = _issue_qk(q_tile, k_smem.index(nst), s_layout)
            acc = warpgroup_mma_wait(1, deps=[acc])     # in order: PV_g, not S_{g+1}
        else:
            acc = warpgroup_mma_wait(0, deps=[acc])
        _keep_alive(a)
        return s, acc, m_i, l_i, g

    @gluon.jit
    def _pers_serial_tiles(q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel,
                           m_i, l_i, row_f, lr, rows, L, full_end, n_tiles, shift, g,
                           BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                           CAUSAL: gl.constexpr, NW: gl.constexpr, FOLD: gl.constexpr,
                           MMA_ORDER: gl.constexpr):
        """Every tile of one item (Q ready, g = its first tile's index): S_0 issued here, then
        _pers_serial_step per tile. What crosses the loop's back edge is S_{j+1} in flight
        (fp32 registers in the accumulator layout) and the retired acc, never P's e4m3 A
        operand. Returns (acc with every PV added, m, l, g past the item)."""
        s_layout: gl.constexpr = _wgmma_layout(BN, NW)
        o_layout: gl.constexpr = _wgmma_layout(D, NW)
        st = g % STAGES
        mbarrier.wait(k_ready.index(st), (g // STAGES) & 1)
        s = _issue_qk(q_tile, k_smem.index(st), s_layout)
        acc = gl.zeros([16 * NW, D], gl.float32, o_layout)
        if n_tiles == 1:     # (the last step's S is waited on: a plain tensor, not kept)
            _s, acc, m_i, l_i, g = _pers_serial_step(
                s, acc, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel, m_i,
                l_i, row_f, lr, rows, -shift, L, full_end, g, False, False, BN, STAGES, CAUSAL,
                NW, FOLD, MMA_ORDER)
        else:
            s, acc, m_i, l_i, g = _pers_serial_step(
                s, acc, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel, m_i,
                l_i, row_f, lr, rows, -shift, L, full_end, g, False, True, BN, STAGES, CAUSAL,
                NW, FOLD, MMA_ORDER)
            for j in range(1, n_tiles - 1):
                s, acc, m_i, l_i, g = _pers_serial_step(
                    s, acc, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel,
                    m_i, l_i, row_f, lr, rows, j * BN - shift, L, full_end, g, True, True, BN,
                    STAGES, CAUSAL, NW, FOLD, MMA_ORDER)
            _s, acc, m_i, l_i, g = _pers_serial_step(
                s, acc, q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel, m_i,
                l_i, row_f, lr, rows, (n_tiles - 1) * BN - shift, L, full_end, g, True, False,
                BN, STAGES, CAUSAL, NW, FOLD, MMA_ORDER)
        return acc, m_i, l_i, g

    @gluon.jit
    def _pers_consumer(q_smem, k_smem, v_smem, sk_smem, sv_smem, q_ready, q_free, k_ready,
                       v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ, VCAP, O, LSE,
                       stride_ot, stride_oh, T, qk_scale, D: gl.constexpr, BN: gl.constexpr,
                       STAGES: gl.constexpr, CAUSAL: gl.constexpr, NW: gl.constexpr,
                       FOLD: gl.constexpr, MMA_ORDER: gl.constexpr, QBUF: gl.constexpr,
                       PV_SYNC: gl.constexpr, SERIAL: gl.constexpr):
        """Per item: the loop of _ws_consumer, op for op, on the CTA-wide tile sequence (SERIAL:
        _pers_serial_tiles instead, the same operations in the same order)."""
        BM: gl.constexpr = 16 * NW
        s_layout: gl.constexpr = _wgmma_layout(BN, NW)
        o_layout: gl.constexpr = _wgmma_layout(D, NW)
        g = 0
        it = 0
        # The work list entries and per-row vectors of the next item are loaded one item ahead
        # (loop-carried), so an item starts without a dependent global load on its path.
        G = gl.num_programs(0)
        doc, head, kvh, start, L, blk = _pers_meta(ITEMS, N_ITEMS, HQ, GROUP, W,
                                                   gl.program_id(0))
        tok0, rows, row_ok, row_f, lr = _query_rows(SQ, VCAP, T, qk_scale, start, blk * BM, L,
                                                    head, kvh, BM, s_layout)
        for w in range(gl.program_id(0), W, G):
            c_doc, c_head, c_start, c_L, c_blk = doc, head, start, L, blk
            c_tok0, c_rows, c_row_ok, c_row_f, c_lr = tok0, rows, row_ok, row_f, lr
            doc, head, kvh, start, L, blk = _pers_meta(ITEMS, N_ITEMS, HQ, GROUP, W, w + G)
            if c_doc >= 0:
                q_lo = c_blk * BM
                shift = c_start % 16
                full_end, n_tiles = _kv_tiles(q_lo, c_L, shift, BM, BN, CAUSAL)
                m_i = gl.full_like(c_row_f, float("-inf"))
                l_i = gl.zeros_like(c_row_f)
                qb = it % QBUF
                q_tile = q_smem.index(qb)

                if SERIAL:
                    mbarrier.wait(q_ready.index(qb), (it // QBUF) & 1)
                    acc, m_i, l_i, g = _pers_serial_tiles(
                        q_tile, k_smem, v_smem, sk_smem, sv_smem, k_ready, v_ready, rel, m_i, l_i,
                        c_row_f, c_lr, c_rows, c_L, full_end, n_tiles, shift, g, BN, D, STAGES,
                        CAUSAL, NW, FOLD, MMA_ORDER)
                    mbarrier.arrive(q_free.index(qb), count=1)
                    tok0, rows, row_ok, row_f, lr = _query_rows(SQ, VCAP, T, qk_scale, start,
                                                                blk * BM, L, head, kvh, BM,
                                                                s_layout)
                else:
                    # ---- tile 0 of the item (global g) ----
                    n0 = -shift
                    st = g % STAGES
                    mbarrier.wait(q_ready.index(qb), (it // QBUF) & 1)
                    mbarrier.wait(k_ready.index(st), (g // STAGES) & 1)
                    s = _issue_qk(q_tile, k_smem.index(st), s_layout)
                    s = warpgroup_mma_wait(0, deps=[s])
                    a, m_i, l_i, alpha = _softmax_tile(s, sk_smem, sv_smem, st, m_i, l_i, c_row_f,
                                                       c_lr, c_rows, n0, c_L, full_end, CAUSAL,
                                                       o_layout, FOLD, 0, MMA_ORDER)
                    _ws_release(rel, st)            # r_g: K_g read (V_{g-1}: the previous item's
                    acc = gl.zeros([BM, D], gl.float32, o_layout)       # last PV was waited on)
                    g += 1

                    for j in range(1, n_tiles):
                        st = g % STAGES
                        pst = (g - 1) % STAGES
                        n0_prev = n0
                        n0 = j * BN - shift
                        mbarrier.wait(k_ready.index(st), (g // STAGES) & 1)
                        s = _issue_qk(q_tile, k_smem.index(st), s_layout)
                        _wait_v(v_smem, v_ready, pst, g - 1, n0_prev, c_L, NW, MMA_ORDER)
                        acc = warpgroup_mma(a, v_smem.index(pst).permute((1, 0)), acc,
                                            is_async=True)
                        if PV_SYNC:
                            acc, s = warpgroup_mma_wait(0, deps=[acc, s])
                        else:
                            s = warpgroup_mma_wait(1, deps=[s])
                        a_new, m_i, l_i, alpha = _softmax_tile(s, sk_smem, sv_smem, st, m_i, l_i,
                                                               c_row_f, c_lr, c_rows, n0, c_L,
                                                               full_end, CAUSAL, o_layout, FOLD, 0,
                                                               MMA_ORDER)
                        acc = warpgroup_mma_wait(0, deps=[acc])
                        _ws_release(rel, st)        # r_g: K_g and V_{g-1} are free
                        acc = _mul_rows(acc, alpha)
                        a = a_new
                        g += 1

                    # every QK^T of the item is done: its Q buffer may take item it + QBUF
                    mbarrier.arrive(q_free.index(qb), count=1)
                    tok0, rows, row_ok, row_f, lr = _query_rows(SQ, VCAP, T, qk_scale, start,
                                                                blk * BM, L, head, kvh, BM,
                                                                s_layout)
                    lst = (g - 1) % STAGES
                    _wait_v(v_smem, v_ready, lst, g - 1, n0, c_L, NW, MMA_ORDER)
                    acc = warpgroup_mma(a, v_smem.index(lst).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(0, deps=[acc])
                _store_out(acc, m_i, l_i, c_lr, O, LSE, stride_ot, stride_oh, T, c_tok0, q_lo,
                           c_rows, c_row_ok, c_L, c_head)
                it += 1
            else:
                tok0, rows, row_ok, row_f, lr = _query_rows(SQ, VCAP, T, qk_scale, start,
                                                            blk * BM, L, head, kvh, BM, s_layout)

    @gluon.jit
    def _attn_fwd_gluon_persistent_kernel(q_desc, k_desc, v_desc, sk_desc, sv_desc, SQ, VCAP, O,
                                          LSE, ITEMS, CU, stride_ot, stride_oh, T, N_ITEMS, HQ,
                                          GROUP, qk_scale, D: gl.constexpr, BM: gl.constexpr,
                                          BN: gl.constexpr, STAGES: gl.constexpr,
                                          CAUSAL: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                          FOLD: gl.constexpr, MMA_ORDER: gl.constexpr,
                                          QBUF: gl.constexpr, num_warps: gl.constexpr,
                                          PV_SYNC: gl.constexpr = False,
                                          SERIAL: gl.constexpr = False):
        W = N_ITEMS * HQ
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [QBUF, BM, D], q_desc.layout)
        k_smem, v_smem, sk_smem, sv_smem = _alloc_kv_ring(k_desc, v_desc, sk_desc, sv_desc,
                                                          STAGES, BN, D)
        q_ready = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        rel = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(QBUF):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_free.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(rel.index(i), count=1)
        gl.warp_specialize([
            (_pers_consumer, (q_smem, k_smem, v_smem, sk_smem, sv_smem, q_ready, q_free, k_ready,
                              v_ready, rel, ITEMS, N_ITEMS, HQ, GROUP, W, SQ, VCAP, O, LSE,
                              stride_ot, stride_oh, T, qk_scale, D, BN, STAGES, CAUSAL,
                              num_warps, FOLD, MMA_ORDER, QBUF, PV_SYNC, SERIAL)),
            (_pers_producer, (q_desc, k_desc, v_desc, sk_desc, sv_desc, q_smem, k_smem, v_smem,
                              sk_smem, sv_smem, q_ready, q_free, k_ready, v_ready, rel, ITEMS,
                              N_ITEMS, HQ, GROUP, W, BM, BN, CAUSAL, QBUF)),
        ], [1], [PRODUCER_REGS])
        for i in gl.static_range(QBUF):
            mbarrier.invalidate(q_ready.index(i))
            mbarrier.invalidate(q_free.index(i))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(rel.index(i))


def _layout(block_shape, dtype=None):
    """The shared layout of a box of fp8 (default) or `dtype` elements (memoized)."""
    return shared_layout(block_shape, dtype or gl.float8e4nv)


def _scale_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(Hkv, T) fp32 scales as a TMA-able matrix: the row stride must be a multiple of 16 bytes.

    quantize_qkv writes sk / sv contiguous, so this is free whenever T % 4 == 0 (every
    benchmark workload). Otherwise one copy kernel into a padded-stride buffer (its pad columns
    are never read: the descriptor's extent is the true T). quantize_qkv could remove even that
    by allocating sk / sv (and sq, vcap) as (H, T_pad) storage and returning [:, :T] views, as
    it already does for vt8; every consumer reads them through (h * T + t) today, so that needs
    a row-stride argument in the Triton kernels first."""
    T = x.shape[1]
    if x.stride(1) == 1 and x.stride(0) % 4 == 0 and x.data_ptr() % 16 == 0:
        return x, x.stride(0)
    tp = (T + 3) // 4 * 4
    y = x.new_empty(x.shape[0], tp)
    y[:, :T].copy_(x)
    return y, tp


def _descriptors(qkv: QuantizedQKV, BMQ: int, BN: int):
    """Host TMA descriptors (plain Python objects; the launcher encodes them at launch, as
    the Triton path does for its three). BMQ: rows of one Q box (64 per consumer when
    warp-specialized)."""
    T, Hq, Hkv, D = qkv.shape
    q8, k8, vt = qkv.q8, qkv.k8, qkv.vt8
    # (T, H, D) with unit-stride heads/dims is a (T, H*D) matrix; vt8 (Hkv, D, Tp) is (Hkv*D, Tp).
    qd = GluonTensorDescriptor(q8, [T, Hq * D], [q8.stride(0), 1], [BMQ, D], _layout([BMQ, D]))
    kd = GluonTensorDescriptor(k8, [T, Hkv * D], [k8.stride(0), 1], [BN, D], _layout([BN, D]))
    vd = GluonTensorDescriptor(vt, [Hkv * D, vt.shape[2]], [vt.stride(1), 1], [D, BN],
                               _layout([D, BN]))
    # Scales as (Hkv, T) with box (1, BN): tile j's box starts at the same 16-aligned token as
    # K's; the true T bounds it (zeros past the end), the stride may be padded.
    sc = []
    for x in (qkv.sk, qkv.sv):
        xs, stride = _scale_rows(x)
        sc.append(GluonTensorDescriptor(xs, [Hkv, T], [stride, 1], [1, BN],
                                        _layout([1, BN], gl.float32)))
    return qd, kd, vd, sc[0], sc[1]


def attention_forward_gluon(qkv: QuantizedQKV, cu_seqlens: torch.Tensor, max_seqlen: int | None,
                            causal: bool, softmax_scale: float | None, out_dtype, *,
                            config: GluonFwdConfig | None = None, schedule: Schedule | None = None,
                            poison: bool = False):
    """out (T, Hq, D) in out_dtype and lse (Hq, T) fp32; drop-in for forward.attention_forward
    on the fp8 recipes (fp8, fp8_mixed: same forward). Raises NotImplementedError for bf16 or
    when Gluon is missing, so a caller can fall back to the Triton kernel."""
    if not HAVE_GLUON:
        raise NotImplementedError("triton.experimental.gluon is not available")
    if qkv.recipe == "bf16":
        raise NotImplementedError("the Gluon forward implements the fp8 recipes only")
    if qkv.vt8 is None:
        raise ValueError("the Gluon forward needs the K-major V copy (quantize_qkv(write_vt=True))")
    T, Hq, Hkv, D = qkv.shape
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    cfg = config or default_gluon_config(D)
    _check_config(cfg, D)
    if bool(qkv.vt8_mma_order) != cfg.mma_order:
        want = "vt_mma_order=True" if cfg.mma_order else "vt_mma_order=False"
        raise ValueError(f"{cfg.name} reads vt8 in {'wgmma key' if cfg.mma_order else 'token'} "
                         f"order: quantize_qkv(..., {want})")
    dev = qkv.q8.device
    for name, x in (("q", qkv.q8), ("k", qkv.k8)):
        if x.stride(2) != 1 or x.stride(1) != D:
            raise ValueError(f"{name}8 must have layout (T, H, D) with unit-stride heads/dims")
    if qkv.vt8.stride(2) != 1:
        raise ValueError("vt8 must be (Hkv, D, T_pad) with unit stride over tokens")
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    alloc = (lambda shape, dt: torch.full(shape, float("nan"), dtype=dt, device=dev)) if poison else \
        (lambda shape, dt: torch.empty(shape, dtype=dt, device=dev))
    out = alloc((T, Hq, D), out_dtype)
    lse = alloc((Hq, T), torch.float32)
    if T == 0:
        return out, lse
    BM, BN = cfg.block_m, cfg.block_n
    schedule = work_list(cu_seqlens, T, BM, BN, causal, schedule)
    qd, kd, vd, skd, svd = _descriptors(qkv, 64 if cfg.ws else BM, BN)
    n_items = schedule.items.shape[1]
    args = (qd, kd, vd, skd, svd, qkv.sq, qkv.vcap, out, lse, schedule.items, cu_seqlens,
            out.stride(0), out.stride(1), T, n_items, Hq, Hq // Hkv, scale * LOG2E)
    extra = {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}
    global LAST_KERNEL
    if cfg.persistent:
        grid = persistent_grid(n_items * Hq, cfg.persistent, dev)
        LAST_KERNEL = _attn_fwd_gluon_persistent_kernel[grid](
            *args, D=D, BM=BM, BN=BN, STAGES=cfg.stages, CAUSAL=bool(causal),
            PRODUCER_REGS=cfg.producer_regs, FOLD=cfg.fold, MMA_ORDER=cfg.mma_order,
            QBUF=persistent_q_buffers(cfg), num_warps=cfg.num_warps,
            **({"PV_SYNC": True} if cfg.pv_sync else {}),
            **({"SERIAL": True} if cfg.serial else {}), **extra)
    elif cfg.ws:
        LAST_KERNEL = _attn_fwd_gluon_ws_kernel[(n_items * Hq,)](
            *args, D=D, BM=BM, BN=BN, STAGES=cfg.stages, CAUSAL=bool(causal), NC=cfg.ws,
            PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs,
            FOLD=cfg.fold, LAZY=cfg.lazy, POLY=cfg.poly, PP=cfg.pingpong,
            num_warps=cfg.num_warps, **extra)
    else:
        LAST_KERNEL = _attn_fwd_gluon_kernel[(n_items * Hq,)](
            *args, D=D, BM=BM, BN=BN, STAGES=cfg.stages, CAUSAL=bool(causal),
            FOLD=cfg.fold, LAZY=cfg.lazy, POLY=cfg.poly, num_warps=cfg.num_warps, **extra)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Compile-only (CPU): build the sm_90a binary through the real launcher, nothing executes.
# ---------------------------------------------------------------------------------------------

PTX_COUNTS = {
    "wgmma": r"wgmma\.mma_async",
    "wait": r"wgmma\.wait_group",
    "commit": r"wgmma\.commit_group",
    "fence_wg": r"wgmma\.fence",
    "bar": r"\bbar\.sync|barrier\.sync",
    "ex2": r"ex2\.approx",
    "cvt_e4m3": r"cvt\.rn\.satfinite\.e4m3x2",
    "tma": r"cp\.async\.bulk\.tensor",
    "mbar_wait": r"mbarrier\.try_wait",
    "st_shared": r"\bst\.shared",
    "ld_shared": r"\bld\.shared",
    "shfl": r"shfl\.sync",
    "local": r"\.local\.",
    "setmaxnreg": r"setmaxnreg\.",
}


def _fake_qkv(T: int, Hq: int, Hkv: int, D: int, mma_order: bool = False) -> QuantizedQKV:
    f8 = torch.float8_e4m3fn
    z = lambda *s: torch.zeros(*s, dtype=f8)            # noqa: E731
    tp = (T + 15) // 16 * 16
    return QuantizedQKV("fp8", z(T, Hq, D), z(T, Hkv, D), z(T, Hkv, D), torch.ones(Hq, T),
                        torch.ones(Hkv, T), torch.ones(Hkv, T), torch.ones(Hkv, T), rotated=True,
                        vt8=z(Hkv, D, tp), vt8_mma_order=mma_order)


def compile_report(cfg: GluonFwdConfig, D: int, causal: bool = True, T: int = 4096, Hq: int = 8,
                   Hkv: int = 2) -> dict:
    """Compile the Gluon forward for sm_90a on the CPU; registers / spills / smem / PTX counts."""
    from ._interp import compile_only, resource_usage
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_report needs TRITON_INTERPRET unset (run it in a subprocess)")
    qkv = _fake_qkv(T, Hq, Hkv, D, cfg.mma_order)
    cu = torch.tensor([0, T], dtype=torch.int32)
    with compile_only() as built:
        attention_forward_gluon(qkv, cu, T, causal, None, torch.bfloat16, config=cfg)
    (_, kern), = built
    u = resource_usage(kern)
    ptx = kern.asm["ptx"]
    u.update({k: len(re.findall(p, ptx)) for k, p in PTX_COUNTS.items()})
    # warp-specialized: "regs" is the launch budget (maxnreg); the partitions' own budgets are
    # the setmaxnreg operands (consumer(s) first, producer last in the PTX)
    u["partition_regs"] = sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
    u["ptx"] = ptx
    u["kernel"] = kern
    return u
