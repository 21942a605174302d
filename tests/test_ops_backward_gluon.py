"""CPU checks of the Gluon fp8 dK/dV and dQ kernels (flamia/ops/backward_gluon.py): they compile
for sm_90a (D=64 and 128, causal and not), use async wgmma and TMA, and stay within a spill bound.

Gluon kernels cannot run under the Triton interpreter that conftest.py turns on without a GPU,
so the compile runs in a subprocess without TRITON_INTERPRET (nothing executes; ptxas -v gives
registers and spills). Numerics are checked on the H200 by benchmarks/bwd_gluon_dev.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Spill budget (bytes of spill stores per thread). Measured when written: D=128 180 (causal) /
# 336 (not causal), D=64 0; the Triton fp8 dK/dV kernel spills ~384 B at D=128.
SPILL_BOUND = {128: 512, 64: 64}

# The bisection ladder of benchmarks/bwd_gluon_dev.py (D=128 causal): it must compile too.
LADDER = {
    "safe": dict(stages=1, vec_tma=False, sync_mma=True),
    "sync": dict(stages=2, vec_tma=False, sync_mma=True),
    "vecload": dict(vec_tma=False),
    "w8ns3": dict(bn=128, num_warps=8, stages=3),
}

_SCRIPT = r"""
import json, sys
from flamia.ops import backward_gluon as G
LADDER = %r
out = []
for D in (128, 64):
    for causal in (True, False):
        st = G.fake_state(D, T=1024, Hq=8, Hkv=2, causal=causal, rotate=True,
                          lengths=[300, 0, 1, 723])
        r = G.resource_report(G.compile_sm90(st))
        out.append(dict(D=D, causal=causal, config="default", **r))
for name, kw in LADDER.items():
    st = G.fake_state(128, T=1024, Hq=8, Hkv=2, causal=True, rotate=True, lengths=[300, 0, 1, 723])
    cfg = G.GluonDkdvConfig(**{**G.default_gluon_config(128).__dict__, **kw})
    r = G.resource_report(G.compile_sm90(st, cfg))
    out.append(dict(D=128, causal=True, config=name, **r))
print("REPORT" + json.dumps(out))
""" % (LADDER,)


def _gluon_available() -> bool:
    try:
        import triton.experimental.gluon  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except Exception:   # noqa: BLE001
        return False
    import triton
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return ptxas.exists()


@pytest.fixture(scope="module")
def report():
    if not _gluon_available():
        pytest.skip("triton.experimental.gluon (Hopper) or the bundled ptxas is not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"sm_90a compile failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1]
    return json.loads(line[len("REPORT"):])


def test_module_imports_without_gpu():
    from flamia.ops import backward_gluon as G
    assert hasattr(G, "launch_dkdv_gluon")
    assert G.default_gluon_config(128).bm == 64


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_compiles_for_sm90a(report, D, causal):
    r = next(x for x in report if x["D"] == D and x["causal"] == causal
             and x["config"] == "default")
    # main loop: S^T, dP^T (D/32 k-steps each), dV and dK (2 k-steps per 64-column chunk)
    loop_wgmma = 2 * (D // 32) + 2 * 2 * (D // 64)
    assert r["wgmma"] >= loop_wgmma, r
    assert r["wait"] >= 4, r                      # async wgmma with explicit waits
    assert r["tma"] >= 6 + 4, r                   # K, V, the ring's tiles and vectors by TMA
    # no 1-D boxes: their unaligned h * T + start + i0 coordinates were an illegal instruction
    # on the H200; the vectors come as (1, BM) boxes of the padded (Hq, Tp) copies
    assert r["tma_1d"] == 0, r
    assert r["cvt_e4m3"] > 0 and r["ex2"] > 0, r
    assert not r["wgmma_serialized"], r           # no ptxas C7515
    assert r["ld_local"] == 0, r
    assert r["regs"] <= 255, r
    assert r["spill_stores"] is not None and r["spill_stores"] <= SPILL_BOUND[D], r
    assert r["shared"] <= 227 * 1024 // 2 + 8 * 1024, r    # ~2 CTAs per SM


def test_rejects_other_recipes():
    from flamia.ops import backward_gluon as G
    st = G.fake_state(64, T=64, Hq=2, Hkv=1)
    st.recipe = 1
    with pytest.raises(ValueError):
        G.launch_dkdv_gluon(st)


@pytest.mark.parametrize("name", list(LADDER))
def test_ladder_configs_compile(report, name):
    r = next(x for x in report if x["config"] == name)
    assert r["wgmma"] >= 2 * (128 // 32) + 2 * 2 * 2, r
    assert r["tma"] >= 6 and r["tma_1d"] == 0, r
    assert not r["wgmma_serialized"] and r["ld_local"] == 0 and r["regs"] <= 255, r
    assert r["spill_stores"] is not None and r["spill_stores"] <= 1024, r


def test_padded_vectors_layout():
    """lse / Delta / sq / sdo in the K-major copies' padded layout: document d's tokens at
    columns pcu[d].., pads lse = +inf and 0; TMA-legal (16 | pcu, 16-byte row stride)."""
    import torch
    from flamia.ops import backward_gluon as G
    lengths = [300, 0, 1, 777, 1024, 45]
    st = G.fake_state(64, T=sum(lengths), Hq=4, Hkv=2, lengths=lengths)
    g = torch.Generator().manual_seed(0)
    for x in (st.lse, st.delta, st.sq, st.sdo):
        x.copy_(torch.randn(x.shape, generator=g))
    vecs = G.padded_vectors(st)
    pcu, cu = st.pcu.tolist(), st.cu.tolist()
    for y, x, fill in zip(vecs, (st.lse, st.delta, st.sq, st.sdo), (float("inf"), 0.0, 0.0, 0.0)):
        assert y.shape == (4, st.Tp) and y.is_contiguous() and (y.stride(0) * 4) % 16 == 0
        for d in range(len(lengths)):
            n = cu[d + 1] - cu[d]
            assert torch.equal(y[:, pcu[d]:pcu[d] + n], x[:, cu[d]:cu[d + 1]])
            assert bool((y[:, pcu[d] + n:pcu[d + 1]] == fill).all())
    assert G.check_tma_coords(st) == []


# ----------------------------------------------------------------------------------------------
# dQ kernel (backward_gluon._dq_fp8_kernel / launch_dq_gluon)
# ----------------------------------------------------------------------------------------------

# Spill budget of the dQ kernel (bytes of spill stores per thread). Measured when written: 0 for
# every config at D=64 and 128 (234-239 regs at D=128 default, 163-168 at D=64).
DQ_SPILL_BOUND = {128: 128, 64: 64}

# benchmarks/bwd_gluon_dev.py --kernel dq ladder (D=128 causal)
DQ_LADDER = {
    "safe": dict(stages=1, vec_tma=False, sync_mma=True),
    "sync": dict(stages=2, vec_tma=False, sync_mma=True),
    "vecload": dict(vec_tma=False),
    "w8": dict(bm=128, num_warps=8),
}

_DQ_SCRIPT = r"""
import json
from flamia.ops import backward_gluon as G
LADDER = %r
out = []
for D in (128, 64):
    for causal in (True, False):
        st = G.fake_state(D, T=1024, Hq=8, Hkv=2, causal=causal, rotate=True,
                          lengths=[300, 0, 1, 723])
        r = G.resource_report(G.compile_dq_sm90(st))
        out.append(dict(D=D, causal=causal, config="default", **r))
for name, kw in LADDER.items():
    st = G.fake_state(128, T=1024, Hq=8, Hkv=2, causal=True, rotate=True, lengths=[300, 0, 1, 723])
    cfg = G.GluonDqConfig(**{**G.default_dq_config(128).__dict__, **kw})
    r = G.resource_report(G.compile_dq_sm90(st, cfg))
    out.append(dict(D=128, causal=True, config=name, **r))
print("REPORT" + json.dumps(out))
""" % (DQ_LADDER,)


@pytest.fixture(scope="module")
def dq_report():
    if not _gluon_available():
        pytest.skip("triton.experimental.gluon (Hopper) or the bundled ptxas is not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _DQ_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"sm_90a compile failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1]
    return json.loads(line[len("REPORT"):])


def _dq_loop_wgmma(D: int) -> int:
    # S and dP (D/32 k-steps each), dS K (BN/32 = 2 k-steps per 64-column chunk of D)
    return 2 * (D // 32) + 2 * (D // 64)


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_dq_compiles_for_sm90a(dq_report, D, causal):
    r = next(x for x in dq_report if x["D"] == D and x["causal"] == causal
             and x["config"] == "default")
    assert r["wgmma"] >= _dq_loop_wgmma(D), r
    assert r["wait"] >= 3, r                      # async wgmma with explicit waits
    assert r["tma"] >= 2 + 5, r                   # q8, do8 once; K, V, kT, sk, sv per step
    assert r["tma_1d"] == 0, r                    # sk / sv as (1, BN) boxes of padded copies
    assert r["cvt_e4m3"] > 0 and r["ex2"] > 0, r
    assert not r["wgmma_serialized"], r           # no ptxas C7515
    assert r["ld_local"] == 0, r
    assert r["regs"] <= 255, r
    assert r["spill_stores"] is not None and r["spill_stores"] <= DQ_SPILL_BOUND[D], r
    assert r["shared"] <= 227 * 1024 // 2, r      # 2 CTAs per SM


@pytest.mark.parametrize("name", list(DQ_LADDER))
def test_dq_ladder_configs_compile(dq_report, name):
    r = next(x for x in dq_report if x["config"] == name)
    assert r["wgmma"] >= _dq_loop_wgmma(128), r
    assert r["tma"] >= 5 and r["tma_1d"] == 0, r
    assert not r["wgmma_serialized"] and r["ld_local"] == 0 and r["regs"] <= 255, r
    assert r["spill_stores"] is not None and r["spill_stores"] <= 512, r


def test_dq_rejects_other_recipes_and_configs():
    from flamia.ops import backward_gluon as G
    st = G.fake_state(64, T=64, Hq=2, Hkv=1)
    with pytest.raises(ValueError):
        G.launch_dq_gluon(st, G.GluonDqConfig(bm=128, num_warps=4))   # BM != 16 * warps
    st.recipe = 1
    with pytest.raises(ValueError):
        G.launch_dq_gluon(st)


def test_padded_kv_vectors_layout():
    """sk / sv in the K-major copies' padded layout: document d's keys at columns pcu[d]..,
    pads 0; TMA-legal (16 | pcu, 16-byte row stride)."""
    import torch
    from flamia.ops import backward_gluon as G
    lengths = [300, 0, 1, 777, 1024, 45]
    st = G.fake_state(64, T=sum(lengths), Hq=4, Hkv=2, lengths=lengths)
    g = torch.Generator().manual_seed(0)
    for x in (st.sk, st.sv):
        x.copy_(torch.randn(x.shape, generator=g))
    vecs = G.padded_kv_vectors(st)
    pcu, cu = st.pcu.tolist(), st.cu.tolist()
    for y, x in zip(vecs, (st.sk, st.sv)):
        assert y.shape == (2, st.Tp) and y.is_contiguous() and (y.stride(0) * 4) % 16 == 0
        for d in range(len(lengths)):
            n = cu[d + 1] - cu[d]
            assert torch.equal(y[:, pcu[d]:pcu[d] + n], x[:, cu[d]:cu[d + 1]])
            assert bool((y[:, pcu[d] + n:pcu[d + 1]] == 0).all())
    assert G.check_tma_coords_dq(st) == []
