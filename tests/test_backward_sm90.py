"""The one-pass Hopper backward (flamia/ops/backward_sm90.py) on a CPU-only machine: its work list
and padded query layout, and the sm_90a builds of its bf16 and fp8 kernels (registers, spills,
wgmma serialization). Their numerics are checked on the H200 by tests/gpu/test_backward_sm90_gpu.py
and test_backward_sm90_fp8_gpu.py (Gluon does not run in the Triton interpreter)."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from _sm90 import compile_report
from flamia.inputs import cu_seqlens_from_lengths
from flamia.ops.backward_sm90 import (dq_row_host, dq_rows_stored_host, first_step_host,
                                      key_blocks, next_step_host, step_q0_host)


@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("BM", (64, 128))
def test_key_blocks(causal, BM):
    BN = 128
    rng = random.Random(BM + causal)
    for _ in range(20):
        lengths = [rng.choice([0, 1, 2, rng.randint(3, 700), rng.randint(700, 3000)])
                   for _ in range(rng.randint(1, 7))]
        H = rng.choice([1, 2, 3, 8])
        T = sum(lengths)
        cu = cu_seqlens_from_lengths(lengths)
        kb = key_blocks(cu, T, BM, BN, causal, H)
        doc, blk, start, L, pq, kvh = kb.items.tolist()
        valid = [i for i, d in enumerate(doc) if d >= 0]
        # every key block of every document, for every KV head, exactly once; padding last
        want = sorted((d, b, h) for d, n in enumerate(lengths) for b in range(-(-n // BN))
                      for h in range(H))
        assert sorted((doc[i], blk[i], kvh[i]) for i in valid) == want
        assert len(doc) == kb.n_items >= len(want)
        assert valid == list(range(len(valid)))
        # order: cost class (floor log2 of the query blocks seen, every cost below 8 in the
        # class of 8) descending, then KV head, then document (heaviest first, ties in packed
        # order), then cost descending, then key block
        nq = [-(-n // BM) for n in lengths]
        drank = {d: r for r, d in enumerate(sorted(range(len(lengths)), key=lambda d: -nq[d]))}
        cost = [nq[doc[i]] - (blk[i] * BN // BM if causal else 0) for i in valid]
        keys = [(-math.floor(math.log2(max(c, 8))), kvh[i], drank[doc[i]], -c, blk[i])
                for c, i in zip(cost, valid)]
        assert keys == sorted(keys)
        # within one (document, KV head) lower key blocks earlier (deterministic mode waits)
        pos = {(doc[i], blk[i], kvh[i]): r for r, i in enumerate(valid)}
        assert all(pos[(d, b, h)] > pos[(d, b - 1, h)] for (d, b, h) in pos if b > 0)
        # padded query rows: documents start at multiples of BM, in order, without overlap
        starts = [sum(nq[:d]) * BM for d in range(len(lengths))]
        for i in valid:
            assert pq[i] == starts[doc[i]] and start[i] == sum(lengths[:doc[i]])
            assert L[i] == lengths[doc[i]]
        assert kb.q_rows % BM == 0 and kb.q_rows >= sum(nq) * BM
        prow = kb.prow.tolist()
        t = 0
        for d, n in enumerate(lengths):
            assert prow[t:t + n] == list(range(starts[d], starts[d] + n))
            t += n


def _store_wavefronts(row_of) -> int:
    """Shared-memory wavefronts of the worst warp store of a wgmma fp32 accumulator (64 rows per
    warpgroup, lane t of warp w holding rows 16 w + t / 4 (+ 8) and columns 2 (t % 4), +1 of every
    8-column group: one 8-byte store per lane) into the dQ tile: accumulator row a at tile row
    row_of(a), 32-column boxes of 128-byte rows with TMA's 128-byte swizzle (16-byte unit u of row
    r at u ^ (r % 8)); 8-byte stores go in two half-warp phases, each as many wavefronts as its
    most-hit bank has distinct words."""
    worst = 0
    for w in range(4):
        for i in (0, 1):
            for j in range(16):
                waves = 0
                for phase in (0, 1):
                    banks: dict = {}
                    for t in range(16 * phase, 16 * phase + 16):
                        r, c = row_of(16 * w + t // 4 + 8 * i), 8 * j + 2 * (t % 4)
                        off = r * 128 + (c % 32) * 4
                        off ^= ((off >> 7) & 7) << 4
                        off += (c // 32) * 64 * 128
                        for word in (off // 4, off // 4 + 1):
                            banks.setdefault(word % 32, set()).add(word)
                    waves += max(len(v) for v in banks.values())
                worst = max(worst, waves)
    return worst


@pytest.mark.parametrize("BM", [64, 128])
def test_step_order_counters_equal_division(BM):
    """A CTA's steps: its loader, dQ writer and helper warps walk them by counters (next_step),
    the 128-row compute steps by a division (step_q0); both give, per query head of the group,
    every query block seeing the key block once, the first head upwards and the later ones
    downwards."""
    for m_lo in (0, 1, 7):
        for n_m in (1, 2, 5):
            for group in (1, 2, 4, 8):
                q0, dq0, q_end = first_step_host(m_lo, n_m, BM)
                h = 0
                for i in range(group * n_m):
                    assert (h, q0) == (i // n_m, step_q0_host(i, m_lo, n_m, BM)), (m_lo, n_m, i)
                    j = i % n_m
                    assert q0 == (m_lo + (j if h == 0 else n_m - 1 - j)) * BM
                    h, q0, dq0, q_end = next_step_host(h, q0, dq0, q_end, m_lo, n_m, BM)


def test_dq_row_order():
    """The dQ tile's row order (dq_row_host): a permutation inside every 8-row group, the one the
    kernels' register permute (dq_rows_stored_host) stores, and the one that makes the
    accumulator's store conflict-free (2 wavefronts, the minimum for 256 bytes; natural order: 4)."""
    r = torch.arange(4096)
    p = dq_row_host(r)
    assert torch.equal(p // 8, r // 8) and torch.equal(torch.sort(p).values, r)
    x = torch.randn(128, 5)
    assert torch.equal(dq_rows_stored_host(x)[dq_row_host(torch.arange(128))], x)
    assert _store_wavefronts(lambda a: a) == 4
    assert _store_wavefronts(dq_row_host) == 2


_SCRIPT = r"""
import dataclasses, json, re, sys, torch
from flamia.ops import backward_sm90 as B
from flamia.ops.config import sm90_backward_config
from benchmarks.tools.compile import compile_only, fake_qkv, resource_usage
from benchmarks.tools.sass import (local_memory_ops, loop_paths, main_loop, parse, predicated,
                                   sass_of)
out = []
for recipe, D, causal, det, onchip in json.loads(sys.argv[1]):
    T, Hq, Hkv = 1024, 8, 2
    q, do, o = (torch.randn(T, Hq, D).to(torch.bfloat16) for _ in range(3))
    k, v = (torch.randn(T, Hkv, D).to(torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 300, T], dtype=torch.int32)
    with compile_only() as built:
        if recipe == "fp8":
            B.attention_backward_sm90_fp8(do, o, torch.zeros(Hq, T), torch.zeros(Hq, T),
                                          fake_qkv(T, Hq, Hkv, D), cu, causal,
                                          deterministic=det, config=dataclasses.replace(
                                              sm90_backward_config(D), fp8_kmajor_onchip=onchip))
        else:
            B.attention_backward_sm90(do, o, torch.zeros(Hq, T), q, k, v, cu, causal,
                                      deterministic=det)
    kern = dict(built)["_attn_bwd_sm90_" + ("fp8_kernel" if recipe == "fp8" else "kernel")]
    u = resource_usage(kern)
    ptx = kern.asm["ptx"]
    u["partition_regs"] = sorted({int(x) for x in re.findall(
        r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
    u["wgmma"] = ptx.count("wgmma.mma_async")
    u["reduce"] = ptx.count("cp.reduce.async.bulk.tensor")
    sass = sass_of(kern)
    loop = main_loop(parse(sass))
    u["loop_local_ops"] = local_memory_ops(loop)
    plain = min(loop_paths(loop, predicated(sass)), key=len)
    u["plain_step_local_ops"] = local_memory_ops(plain)
    u["plain_step_bars"] = sum(op.startswith("BAR") for _, op, _ in plain)
    run = runs = 0
    for _, op, _ in plain:      # the longest run of consecutive MUFU (exp2) in a plain step
        run = run + 1 if op.startswith("MUFU") else 0
        runs = max(runs, run)
    u["plain_step_mufu_run"] = runs
    out.append(u | {"recipe": recipe, "D": D, "causal": causal, "det": det, "onchip": onchip})
print("REPORT" + json.dumps(out))
"""


def test_sm90_backward_compiles_clean():
    # (recipe, D, causal, deterministic, fp8's Q^T / dO^T made in the kernel)
    jobs = [("bf16", 128, True, False, False), ("bf16", 64, True, False, False),
            ("bf16", 64, True, True, False), ("bf16", 64, False, False, False),
            ("fp8", 128, True, False, False), ("fp8", 128, True, False, True),
            ("fp8", 64, True, False, False), ("fp8", 64, False, True, False)]
    for u in compile_report(_SCRIPT, json.dumps(jobs)):
        tag = (f"{u['recipe']} D={u['D']} causal={u['causal']} deterministic={u['det']} "
               f"onchip={u['onchip']}")
        # D=64 steps of 128 query rows run at the register limit: ptxas parks a few scalars
        # there (20 B, one reload per step, an L1 hit); a spilled tile would be hundreds of
        # bytes and tens of loads per step. The causal fp8 build's plain steps (single FMAs by
        # column halves, the per-query vectors read in pairs: _x_y_halves) build without spills
        # since the sixteen-byte vector loads (benchmarks/NOTES.md, twenty-eighth session).
        assert u["spill_stores"] <= 32, f"{tag}: {u['spill_stores']} B spilled"
        # a plain step (no mask, off the diagonal: most steps) reloads at most one parked scalar;
        # the masked and diagonal paths may reload a few more
        assert u["plain_step_local_ops"] <= 1, f"{tag}: {u['plain_step_local_ops']} local ops"
        assert u["loop_local_ops"] <= 8, f"{tag}: {u['loop_local_ops']} local ops in the loop"
        assert not u["wgmma_serialized"], f"{tag}: ptxas serialized the wgmma (C7514/C7515)"
        assert u["partition_regs"] == [24, 240], f"{tag}: {u['partition_regs']}"
        assert u["wgmma"] > 0 and u["reduce"] > 0, tag
        assert u["shared"] <= 227 * 1024, tag
        # the two warpgroups meet twice per plain step: dS written, then the release of the dQ
        # tile and the Q / dO stage (a plain mbarrier.arrive brings two more: arrive_synced)
        assert u["plain_step_bars"] == 2, f"{tag}: {u['plain_step_bars']} bar.syncs per step"
        # a plain step's exp2s interleave with dS's math (no branch between them): a burst of
        # 20-44 back-to-back MUFU.EX2 per warp left the FMA pipe idle (benchmarks/NOTES.md,
        # 2026-12-06); fp8 at D=64 keeps its branches (registers) and its burst
        if not (u["recipe"] == "fp8" and u["D"] == 64):
            assert u["plain_step_mufu_run"] <= 8, f"{tag}: {u['plain_step_mufu_run']} MUFU in a row"


def test_exp2_fma_arithmetic():
    """numerics.EXP2_FMA_PTX (the fp8 D=64 backward's exp2 on the FMA pipe) by its host twin:
    relative error <= 1.2e-4 from t = -125 on, below 2^-125 and not negative under it (e4m3
    rounds that to 0), NaN kept; its PTX carries the fp32 bits of the same constants."""
    import struct

    from flamia.ops.numerics import EXP2_CUBIC, EXP2_FMA_PTX, exp2_fma_host

    t = torch.linspace(-125.0, 20.0, 1_000_001)
    rel = (exp2_fma_host(t).double() / torch.exp2(t.double()) - 1).abs().max().item()
    assert rel <= 1.2e-4, rel
    low = exp2_fma_host(torch.tensor([-125.7, -126.0, -126.5, -300.0, float("-inf")]))
    assert bool(((low >= 0) & (low < 2.0 ** -125)).all()), low
    assert bool(exp2_fma_host(torch.tensor([float("nan")])).isnan().all())
    for c in EXP2_CUBIC:
        assert "0f%08X" % struct.unpack("<I", struct.pack("<f", c))[0] in EXP2_FMA_PTX
