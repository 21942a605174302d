"""CPU checks of the Gluon fp8_mixed dK/dV and dQ kernels (flamia/ops/backward_gluon_mixed.py):
they compile for sm_90a (D = 64 and 128, causal and not), use fp8 wgmma for S / dV and bf16 wgmma
for dP / dK / dQ (dK's and dQ's B operand MN-major from shared memory), TMA, no ptxas wgmma
serialization, and stay within a spill bound.

Compiled in a subprocess without TRITON_INTERPRET (conftest.py sets it on CPU-only machines;
Gluon does not run in the interpreter). Numerics: benchmarks/bwd_gluon_dev.py --recipe fp8_mixed on the H200.
"""
from __future__ import annotations

import pytest

from _sm90 import compile_report

# Spill stores (bytes / thread). Measured when written (default configs): dK/dV D=128 144
# (causal) / 160, D=64 0; dQ 0 everywhere (196 regs at D=128).
DKDV_SPILL_BOUND = {128: 384, 64: 64}
DQ_SPILL_BOUND = {128: 64, 64: 64}

# the GPU dev script's ladders (D=128 causal) must compile too
DKDV_LADDER = {
    "safe": dict(stages=1, vec_tma=False, sync_mma=True),
    "sync": dict(stages=2, vec_tma=False, sync_mma=True),
    "earlydv": dict(early_dv=True),
}
DQ_LADDER = {
    "safe": dict(stages=1, vec_tma=False, sync_mma=True),
    "sync": dict(stages=2, vec_tma=False, sync_mma=True),
    "w8": dict(bm=128, num_warps=8),
}

_SCRIPT = r"""
import json
import re
from benchmarks.tools.compile import build, fake_state, report
from flamia.ops import backward_gluon_mixed as M
DKDV_LADDER, DQ_LADDER = %r, %r
out = []
def rep(kernel, D, causal, name, cfg):
    st = fake_state(D, T=1024, Hq=8, Hkv=2, causal=causal, rotate=True, lengths=[300, 0, 1, 723],
                    recipe="fp8_mixed")
    launch = M.launch_dkdv_gluon_mixed if kernel == "dkdv" else M.launch_dq_gluon_mixed
    k = next(v for n, v in build(launch, st, cfg).items() if "mixed" in n)
    r = report(k)
    ptx = k.asm["ptx"]
    # bf16 wgmma with A from registers: "..., scale-d, imm-scale-a, imm-scale-b, imm-tnsp-b;"
    r["bf16_reg_a_tnsp_b"] = sorted(set(re.findall(
        r"wgmma\.mma_async\S*\.bf16\.bf16 \{[^}]*\}, \{[^}]*\}, %%rd\d+, \S+, 1, 1, (\d);", ptx)))
    out.append(dict(kernel=kernel, D=D, causal=causal, config=name, **r))
for D in (128, 64):
    for causal in (True, False):
        rep("dkdv", D, causal, "default", M.default_mixed_dkdv_config(D))
        rep("dq", D, causal, "default", M.default_mixed_dq_config(D))
for name, kw in DKDV_LADDER.items():
    rep("dkdv", 128, True, name, M.MixedDkdvConfig(**{**M.default_mixed_dkdv_config(128).__dict__, **kw}))
for name, kw in DQ_LADDER.items():
    rep("dq", 128, True, name, M.MixedDqConfig(**{**M.default_mixed_dq_config(128).__dict__, **kw}))
print("REPORT" + json.dumps(out))
""" % (DKDV_LADDER, DQ_LADDER)


@pytest.fixture(scope="module")
def report():
    return compile_report(_SCRIPT, timeout=900)


def _get(report, kernel, D, causal, config="default"):
    return next(x for x in report if x["kernel"] == kernel and x["D"] == D
                and x["causal"] == causal and x["config"] == config)


def _common(r):
    assert not r["wgmma_serialized"], r           # no ptxas C7515
    assert r["ld_local"] == 0 and r["regs"] <= 255, r
    assert r["tma_1d"] == 0, r                    # 1-D boxes at unaligned addresses: illegal instr.
    assert r["ex2"] > 0, r
    # the bf16 GEMM with A from registers reads B MN-major (imm-tnsp-b = 1): dK's Q, dQ's K
    assert r["bf16_reg_a_tnsp_b"] == ["1"], r


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_dkdv_compiles_for_sm90a(report, D, causal):
    r = _get(report, "dkdv", D, causal)
    _common(r)
    # loop: S^T fp8 (D/32 k-steps), dV fp8 (2 per 64-column chunk); dP^T bf16 (D/16), dK bf16
    # (4 per chunk); epilogue rotation bf16
    assert r["wgmma_e4m3"] >= D // 32 + 2 * (D // 64), r
    assert r["wgmma_bf16"] >= D // 16 + 4 * (D // 64), r
    assert r["wait"] >= 4, r
    assert r["tma"] >= 2 + 4 + 4, r               # K, bf16 V; q8, dO, doT8; the 4 vectors
    assert r["cvt_e4m3"] > 0, r                   # e4m3(P^T sdo / c) for the dV GEMM
    assert r["spill_stores"] is not None and r["spill_stores"] <= DKDV_SPILL_BOUND[D], r
    assert r["shared"] <= 113 * 1024, r           # 2 CTAs per SM


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_dq_compiles_for_sm90a(report, D, causal):
    r = _get(report, "dq", D, causal)
    _common(r)
    assert r["wgmma_e4m3"] >= D // 32, r          # S in fp8 (bitwise the forward's)
    assert r["wgmma_bf16"] >= D // 16 + 4 * (D // 64), r     # dP, dQ in bf16
    assert r["cvt_e4m3"] == 0, r                  # no fp8 quantization in the fp8_mixed dQ
    assert r["wait"] >= 2, r
    assert r["tma"] >= 2 + 3, r
    assert r["spill_stores"] is not None and r["spill_stores"] <= DQ_SPILL_BOUND[D], r
    assert r["shared"] <= 113 * 1024, r           # 2 CTAs per SM


@pytest.mark.parametrize("name", list(DKDV_LADDER))
def test_dkdv_ladder_compiles(report, name):
    r = _get(report, "dkdv", 128, True, name)
    _common(r)
    assert r["spill_stores"] is not None and r["spill_stores"] <= 1024, r


@pytest.mark.parametrize("name", list(DQ_LADDER))
def test_dq_ladder_compiles(report, name):
    r = _get(report, "dq", 128, True, name)
    _common(r)
    assert r["spill_stores"] is not None and r["spill_stores"] <= 512, r


def test_module_imports_and_rejects_other_recipes():
    from benchmarks.tools.compile import fake_state
    from flamia.ops import backward_gluon_mixed as M
    assert M.default_mixed_dkdv_config(128).bm == 64 and not M.default_mixed_dq_config(128).carry
    # D=128: query indices only inside the masked branches (measured 14 % faster, bitwise equal)
    assert M.default_mixed_dkdv_config(128).lazy_cols
    assert not M.default_mixed_dkdv_config(64).lazy_cols
    # q8's bf16 copy converted unmasked, rows past the document end zeroed on tail tiles only
    assert M.default_mixed_dkdv_config(128).tail_zero and M.default_mixed_dkdv_config(64).tail_zero
    st = fake_state(128, T=64, Hq=2, Hkv=1, recipe="fp8_mixed")
    kw = M._dkdv_args(st, M.default_mixed_dkdv_config(128))[2]
    assert kw["TAIL_ZERO"] and kw["LAZY"]
    st = fake_state(64, T=64, Hq=2, Hkv=1)          # recipe fp8
    with pytest.raises((ValueError, RuntimeError)):
        M.launch_dkdv_gluon_mixed(st)
    with pytest.raises((ValueError, RuntimeError)):
        M.launch_dq_gluon_mixed(st)
    st = fake_state(64, T=64, Hq=2, Hkv=1, recipe="fp8_mixed")
    with pytest.raises((ValueError, RuntimeError)):
        M.launch_dq_gluon_mixed(st, M.MixedDqConfig(bm=128, num_warps=4))   # BM != 16 * warps


def test_mixed_operands_are_exact():
    """bf16 V / K copies hold the e4m3 values exactly; bf16 dO is passed through; fp32 dO is
    rounded like backward._bf16_op."""
    import torch
    from benchmarks.tools.compile import fake_state
    from flamia.ops import backward_gluon_mixed as M
    st = fake_state(64, T=96, Hq=4, Hkv=2, lengths=[40, 56], recipe="fp8_mixed")
    g = torch.Generator().manual_seed(0)
    for x in (st.v8, st.k8):
        x.copy_((torch.randn(x.shape, generator=g) * 40).to(x.dtype))
    dob, vb, kb = M.mixed_operands(st)
    assert dob.data_ptr() == st.dout.data_ptr()
    assert torch.equal(vb.float(), st.v8.float()) and torch.equal(kb.float(), st.k8.float())
    st.dout = torch.randn(96, 4, 64, generator=g)
    dob, _, kb = M.mixed_operands(st, need_k=False)
    assert kb is None and torch.equal(dob, st.dout.to(torch.bfloat16))
