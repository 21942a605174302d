"""CPU checks of the Gluon dK/dV and dQ kernels of the split backward (flamia/ops/backward_gluon.py,
fp8 and fp8_mixed): the launches an sm_90 GPU makes (preprocess, dK/dV, dQ with
config.split_backward_config(gluon=True)) compile for sm_90a, D=64 and 128, causal and not,
with async wgmma and TMA, no 1-D TMA boxes, no ptxas wgmma serialization, within a spill bound.

Gluon kernels cannot run under the Triton interpreter that conftest.py turns on without a GPU,
so the compile runs in a subprocess without TRITON_INTERPRET (benchmarks/tools/compile.py:
nothing executes; ptxas -v gives registers and spills). Numerics are checked on the H200
(tests/gpu/test_backward_gpu.py).
"""
from __future__ import annotations

import pytest

from _sm90 import compile_report, gluon_available

_SCRIPT = r"""
import json, re
from benchmarks.tools.compile import build, fake_state, report
from flamia.ops import backward as B

def run(st):
    B.launch_preprocess(st)       # (the packed vectors the fp8 kernels read: allocated only)
    B.launch_dkdv(st)
    B.launch_dq(st)

out = []
for recipe in ("fp8", "fp8_mixed"):
    for D in (128, 64):
        for causal in (True, False):
            st = fake_state(D, T=1024, Hq=8, Hkv=2, causal=causal, rotate=True,
                            lengths=[300, 0, 1, 723], recipe=recipe)
            for name, k in build(run, st).items():
                if not name.startswith(("_dkdv", "_dq")):
                    continue
                r = report(k)
                # bf16 wgmma with A from registers: "..., scale-d, imm-scale-a, imm-scale-b,
                # imm-tnsp-b;"
                r["bf16_reg_a_tnsp_b"] = sorted(set(re.findall(
                    r"wgmma\.mma_async\S*\.bf16\.bf16 \{[^}]*\}, \{[^}]*\}, %rd\d+, \S+, 1, 1, "
                    r"(\d);", k.asm["ptx"])))
                out.append(dict(recipe=recipe, kernel="dkdv" if "dkdv" in name else "dq", D=D,
                                causal=causal, **r))
print("REPORT" + json.dumps(out))
"""

pytestmark = pytest.mark.skipif(not gluon_available(), reason="triton.experimental.gluon missing")

# Spill stores (bytes / thread). Measured when written: fp8 dK/dV D=128 64 (causal), D=64 0;
# fp8 dQ 0; fp8_mixed dK/dV D=128 ~70-160, D=64 0, dQ 0.
SPILL_BOUND = {("fp8", "dkdv"): {128: 512, 64: 64}, ("fp8", "dq"): {128: 128, 64: 64},
               ("fp8_mixed", "dkdv"): {128: 384, 64: 64}, ("fp8_mixed", "dq"): {128: 64, 64: 64}}


@pytest.fixture(scope="module")
def reports():
    return compile_report(_SCRIPT, timeout=900)


def _get(reports, recipe, kernel, D, causal):
    return next(x for x in reports if (x["recipe"], x["kernel"], x["D"], x["causal"])
                == (recipe, kernel, D, causal))


def _common(r, recipe, kernel, D):
    assert not r["wgmma_serialized"], r            # no ptxas C7515
    assert r["ld_local"] == 0 and r["regs"] <= 255, r
    # no 1-D boxes: their unaligned h * T + start + i0 coordinates were an illegal instruction
    # on the H200; the vectors come as boxes of padded (H, Tp) copies
    assert r["tma_1d"] == 0, r
    assert r["ex2"] > 0, r
    assert r["spill_stores"] is not None and r["spill_stores"] <= SPILL_BOUND[recipe, kernel][D], r


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_dkdv_compiles_for_sm90a(reports, D, causal):
    r = _get(reports, "fp8", "dkdv", D, causal)
    _common(r, "fp8", "dkdv", D)
    # main loop: S^T, dP^T (D/32 k-steps each), dV and dK (2 k-steps per 64-column chunk)
    assert r["wgmma"] >= 2 * (D // 32) + 2 * 2 * (D // 64), r
    assert r["wait"] >= 4, r                       # async wgmma with explicit waits
    assert r["tma"] >= 2 + 5, r                    # K, V; the ring's q8, dO, qT8, doT8, vectors
    assert r["cvt_e4m3"] > 0, r
    if D == 64:
        # FA3's layout: 8 consumer warps + the producer's warpgroup, one CTA per SM: 12 x 32 x
        # 168 launch registers, the consumers setmaxnreg 240, the producer 24
        assert r["regs"] <= 168 and max(r["partition_regs"]) >= 232, r
        assert 24 in r["partition_regs"] and r["shared"] <= 227 * 1024, r
    else:
        assert not r["partition_regs"], r          # one warpgroup, no partitions
        assert r["shared"] <= 227 * 1024 // 2, r   # 2 CTAs per SM


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_dq_compiles_for_sm90a(reports, D, causal):
    r = _get(reports, "fp8", "dq", D, causal)
    _common(r, "fp8", "dq", D)
    # S and dP (D/32 k-steps each), dS K (BN/32 = 2 k-steps per 64-column chunk of D)
    assert r["wgmma"] >= 2 * (D // 32) + 2 * (D // 64), r
    assert r["wait"] >= 3 and r["tma"] >= 2 + 5, r     # q8, do8; K, V, kT, sk, sv per step
    assert r["cvt_e4m3"] > 0, r
    # persistent, warp-specialized: 8 warps x 128 registers (2 CTAs / SM), the consumer
    # setmaxnreg's up, the producer down to 24
    assert r["regs"] <= 128 and max(r["partition_regs"]) >= 224, r
    assert 24 in r["partition_regs"] and r["shared"] <= 227 * 1024 // 2, r


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_mixed_dkdv_compiles_for_sm90a(reports, D, causal):
    r = _get(reports, "fp8_mixed", "dkdv", D, causal)
    _common(r, "fp8_mixed", "dkdv", D)
    # the bf16 GEMM with A from registers reads B MN-major (imm-tnsp-b = 1): dK's Q
    assert r["bf16_reg_a_tnsp_b"] == ["1"], r
    # loop: S^T fp8 (D/32 k-steps), dV fp8 (2 per 64-column chunk); dP^T bf16 (D/16), dK bf16
    # (4 per chunk); epilogue rotation bf16
    assert r["wgmma_e4m3"] >= D // 32 + 2 * (D // 64), r
    assert r["wgmma_bf16"] >= D // 16 + 4 * (D // 64), r
    assert r["wait"] >= 4, r
    assert r["tma"] >= 2 + 4 + 4, r                # K, bf16 V; q8, dO, doT8; the 4 vectors
    assert r["cvt_e4m3"] > 0, r                    # e4m3(P^T sdo / c) for the dV GEMM
    assert r["shared"] <= 113 * 1024, r            # 2 CTAs per SM


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_mixed_dq_compiles_for_sm90a(reports, D, causal):
    r = _get(reports, "fp8_mixed", "dq", D, causal)
    _common(r, "fp8_mixed", "dq", D)
    assert r["bf16_reg_a_tnsp_b"] == ["1"], r      # dQ's K, MN-major
    assert r["wgmma_e4m3"] >= D // 32, r           # S in fp8 (bitwise the forward's)
    assert r["wgmma_bf16"] >= D // 16 + 4 * (D // 64), r     # dP, dQ in bf16
    assert r["cvt_e4m3"] == 0, r                   # no fp8 quantization in the fp8_mixed dQ
    assert r["wait"] >= 2 and r["tma"] >= 2 + 3, r
    assert r["shared"] <= 113 * 1024, r            # 2 CTAs per SM


def test_launchers_check_the_state():
    """A launcher refuses a state of another recipe, a config of another kernel, and (fp8) a
    state whose padded vectors launch_preprocess has not gathered."""
    from benchmarks.tools.compile import fake_state
    from flamia.ops import backward_gluon as G
    from flamia.ops.config import split_backward_config
    st = fake_state(64, T=64, Hq=2, Hkv=1)
    for launch in (G.launch_dkdv_gluon, G.launch_dq_gluon):
        with pytest.raises(ValueError, match="launch_preprocess"):
            launch(st)
    with pytest.raises(ValueError, match="MixedDkdvConfig"):
        G.launch_dkdv_gluon_mixed(st)
    st.cfg = split_backward_config(64, "fp8_mixed", gluon=True)
    with pytest.raises(ValueError, match="recipe"):
        G.launch_dq_gluon_mixed(st)


def test_mixed_operands_are_exact():
    """bf16 V / K copies hold the e4m3 values exactly, built once per state; bf16 dO is passed
    through; fp32 dO is rounded like backward._bf16_op."""
    import torch
    from benchmarks.tools.compile import fake_state
    from flamia.ops import backward_gluon as G
    st = fake_state(64, T=96, Hq=4, Hkv=2, lengths=[40, 56], recipe="fp8_mixed")
    g = torch.Generator().manual_seed(0)
    for x in (st.v8, st.k8):
        x.copy_((torch.randn(x.shape, generator=g) * 40).to(x.dtype))
    dob, vb, kb = G.mixed_operands(st)
    assert dob.data_ptr() == st.dout.data_ptr() and G.mixed_operands(st)[1] is vb
    assert torch.equal(vb.float(), st.v8.float()) and torch.equal(kb.float(), st.k8.float())
    st.dout, st.mixed_ops = torch.randn(96, 4, 64, generator=g), None
    dob = G.mixed_operands(st)[0]
    assert dob.dtype == torch.bfloat16 and torch.equal(dob, st.dout.to(torch.bfloat16))
