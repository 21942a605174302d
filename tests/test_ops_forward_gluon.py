"""The Gluon FP8 forward (flamia/ops/forward_gluon.py) compiles for sm_90a on a CPU-only machine.

Gluon kernels cannot run under the Triton interpreter, and conftest.py sets TRITON_INTERPRET=1
for the whole suite on CPU machines, so the compile runs in a subprocess without it (the real
JIT path, the bundled ptxas). Checked: no register spills beyond a small bound, no wgmma
serialization (ptxas C7515), wgmma / TMA / mbarrier instructions present. Numerics are checked
on the H200 by benchmarks/fwd_gluon_dev.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from _sm90 import compile_report, gluon_available

_SCRIPT = r"""
import json, sys
from flamia.ops.forward_gluon import compile_report, CONFIGS
out = []
for name, D, causal in json.loads(sys.argv[1]):
    u = compile_report(CONFIGS[name], D, causal)
    out.append({k: v for k, v in u.items() if k not in ("ptx", "kernel")} | {"name": name, "D": D})
print("REPORT" + json.dumps(out))
"""

SPILL_BOUND = 64      # bytes of spill stores tolerated (today: 0 for every config)


def _compile(jobs):
    return compile_report(_SCRIPT, json.dumps(jobs))


def _assert_clean_ws(u) -> str:
    """A warp-specialized build is clean: registers within the file, spills bounded, no wgmma
    serialization, no local memory, the producer at 24 registers and a consumer at >= 232."""
    tag = f"{u['name']} D={u['D']}"
    assert u["regs"] is not None and u["regs"] <= 255, tag
    assert (u["spill_stores"] or 0) <= SPILL_BOUND, f"{tag}: {u['spill_stores']} B spilled"
    assert not u["wgmma_serialized"], f"{tag}: ptxas serialized the wgmma (C7515)"
    assert u["local"] == 0, tag
    assert 24 in u["partition_regs"] and max(u["partition_regs"]) >= 232, tag
    return tag


pytestmark = pytest.mark.skipif(not gluon_available(), reason="triton.experimental.gluon missing")


WS_CONFIGS = ("g64x128w4s2-ws1-p24-r128", "g128x128w4s2-ws2-p24-c240-r168")


def test_gluon_forward_compiles_for_sm90a():
    jobs = [("g64x128w4s2", 128, True), ("g64x128w4s2", 64, True), ("g128x128w8s2", 128, True)]
    jobs += [(WS_CONFIGS[0], 128, True), (WS_CONFIGS[0], 64, False), (WS_CONFIGS[1], 128, True)]
    for u in _compile(jobs):
        tag = f"{u['name']} D={u['D']}"
        assert u["regs"] is not None and u["regs"] <= 255, tag
        assert (u["spill_stores"] or 0) <= SPILL_BOUND, f"{tag}: {u['spill_stores']} B spilled"
        assert not u["wgmma_serialized"], f"{tag}: ptxas serialized the wgmma (C7515)"
        assert u["wgmma"] > 0 and u["wait"] > 0, tag
        assert u["tma"] > 0 and u["mbar_wait"] > 0, tag
        assert u["local"] == 0, f"{tag}: local memory in the PTX"
        # the PV wgmma takes A (= P) from registers: m64nDk32 e4m3 with a register A operand
        assert u["shared"] < 227 * 1024, tag
        if u["name"] in WS_CONFIGS:
            # producer / consumer register budgets are set (setmaxnreg), producer at 24
            assert u["setmaxnreg"] > 0 and 24 in u["partition_regs"], tag
            assert max(u["partition_regs"]) >= 232, tag


def test_gluon_ws_launcher_helpers():
    """Host side of the launcher: scales need no copy when T % 4 == 0; warp-specialized
    configs are validated; the named configs are all well formed."""
    from flamia.ops import forward_gluon as G
    x = torch.ones(2, 64)
    y, stride = G._scale_rows(x)
    assert y is x and stride == 64
    x = torch.arange(2 * 6, dtype=torch.float32).reshape(2, 6)
    y, stride = G._scale_rows(x)
    assert stride == 8 and torch.equal(y[:, :6], x)
    for name, cfg in G.CONFIGS.items():
        assert cfg.name == name
        G._check_config(cfg, 128)
    with pytest.raises(ValueError):
        G._check_config(G.GluonFwdConfig(128, 128, 4, 2, ws=1), 128)


def test_gluon_forward_importable_and_falls_back_for_bf16():
    from flamia.inputs import make_qkv
    from flamia.ops import forward_gluon as G
    from flamia.ops.quantize import quantize_qkv
    q, k, v, cu = make_qkv((40, 23), 4, 2, 64)
    qkv = quantize_qkv(q, k, v, cu, "bf16", True)
    with pytest.raises(NotImplementedError):
        G.attention_forward_gluon(qkv, cu, 40, True, None, torch.bfloat16)
    with pytest.raises(ValueError):
        G._check_config(G.GluonFwdConfig(block_m=128, num_warps=4), 128)


def test_gluon_forward_next_variants_compile():
    """The opt-in next-forward variants (ping-pong ws2, folded exponent, lazy rescale, polynomial
    exp2) compile clean for sm_90a, and leave the default kernels' PTX alone (flags are
    constexpr: off = the old code path)."""
    from flamia.ops import forward_gluon as G
    pp_all = "g128x128w4s2-ws2-p24-c240-r168-pp-f-k-e4"
    ws1_all = "g64x128w4s3-ws1-p24-r128-f-k-e8"
    assert pp_all in G.CONFIGS and ws1_all in G.CONFIGS
    for cfg in G.NEXT_FWD:
        assert G.CONFIGS[cfg.name] is cfg
        G._check_config(cfg, 128)
    with pytest.raises(ValueError):
        G._check_config(G.CONFIGS["g64x128w4s2-ws1-p24-r128"].with_(pingpong=True), 128)
    with pytest.raises(ValueError):
        G._check_config(G.CONFIGS["g64x128w4s2"].with_(poly=3), 128)
    for u in _compile([(pp_all, 128, True), (ws1_all, 64, False)]):
        tag = _assert_clean_ws(u)
        # part of the exp2 went to the FMA pipe: fewer MUFU ex2 than S elements per tile
        assert u["ex2"] > 0, tag


def test_gluon_persistent_forward_compiles():
    """The persistent kernel (a CTA walks the work list; the producer warp runs ahead across
    items) compiles clean for sm_90a in both vt8 orders and with the default's serial tile loop
    (no spills, no wgmma serialization); with key-ordered vt8 the conversion of
    P to the PV wgmma's A operand needs far fewer shuffles; the launcher refuses a vt8 in the
    other order, and configs it does not implement."""
    from flamia.ops import forward_gluon as G
    # [0] the default (-S, serial tile loop), then session 10's loop, -m, three stages
    names = [c.name for c in G.PERSISTENT_FWD[1:4]]
    assert names == ["g64x128w4s2-ws1-p24-r128-f-P2", "g64x128w4s2-ws1-p24-r128-f-P2-m",
                     "g64x128w4s3-ws1-p24-r128-f-P2"]
    assert G.PERSISTENT_FWD[0] == G.CONFIGS[names[0]].with_(serial=True)
    assert [G.persistent_q_buffers(c) for c in G.PERSISTENT_FWD] == [2, 2, 2, 1, 1]
    with pytest.raises(ValueError):
        G._check_config(G.CONFIGS[names[0]].with_(lazy=True), 128)
    with pytest.raises(ValueError):
        G._check_config(G.CONFIGS["g64x128w4s2"].with_(mma_order=True), 128)
    qkv = G._fake_qkv(64, 2, 1, 64, mma_order=False)
    with pytest.raises(ValueError, match="vt_mma_order=True"):
        G.attention_forward_gluon(qkv, torch.tensor([0, 64], dtype=torch.int32), 64, True, None,
                                  torch.bfloat16, config=G.CONFIGS[names[1]])
    shfl = {}
    default = G.PERSISTENT_FWD[0].name
    for u in _compile([(names[0], 128, True), (names[1], 128, True), (names[1], 64, False),
                       (names[2], 128, True), (default, 128, True), (default, 64, False)]):
        tag = _assert_clean_ws(u)
        # two Q buffers + two ring stages, or one + three: two CTAs fit in 228 KB per SM
        assert 2 * u["shared"] <= 227 * 1024, tag
        shfl[(u["name"], u["D"])] = u["shfl"]
    assert shfl[(names[1], 128)] < shfl[(names[0], 128)] / 2
