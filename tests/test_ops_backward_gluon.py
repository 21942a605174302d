"""CPU checks of the Gluon fp8 dK/dV and dQ kernels (flamia/ops/backward_gluon.py): they compile
for sm_90a (D=64 and 128, causal and not), use async wgmma and TMA, and stay within a spill bound.

Gluon kernels cannot run under the Triton interpreter that conftest.py turns on without a GPU,
so the compile runs in a subprocess without TRITON_INTERPRET (nothing executes; ptxas -v gives
registers and spills). Numerics are checked on the H200 by benchmarks/bwd_gluon_dev.py.
"""
from __future__ import annotations

import dataclasses
import pytest

from _sm90 import compile_report
from benchmarks.tools.compile import fake_state

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
from benchmarks.tools.compile import build, fake_state, report as resource_report
from flamia.ops import backward_gluon as G
def _kernel(launch, st, cfg=None):
    built = build(launch, st, cfg)
    k = next(v for n, v in built.items() if n.startswith(("_dkdv", "_dq")))
    r = resource_report(k)
    r["setmaxnreg"] = max(r["partition_regs"]) if r["partition_regs"] else None
    return k, r
LADDER = %r
out = []
for D in (128, 64):
    for causal in (True, False):
        st = fake_state(D, T=1024, Hq=8, Hkv=2, causal=causal, rotate=True,
                        lengths=[300, 0, 1, 723])
        r = _kernel(G.launch_dkdv_gluon, st)[1]
        out.append(dict(D=D, causal=causal, config="default", **r))
for name, kw in LADDER.items():
    st = fake_state(128, T=1024, Hq=8, Hkv=2, causal=True, rotate=True, lengths=[300, 0, 1, 723])
    cfg = G.GluonDkdvConfig(**{**G.plain_gluon_config(128).__dict__, **kw})
    r = _kernel(G.launch_dkdv_gluon, st, cfg)[1]
    out.append(dict(D=128, causal=True, config=name, **r))
print("REPORT" + json.dumps(out))
""" % (LADDER,)


@pytest.fixture(scope="module")
def report():
    return compile_report(_SCRIPT, timeout=600)


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
    st = fake_state(64, T=64, Hq=2, Hkv=1)
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
    st = fake_state(64, T=sum(lengths), Hq=4, Hkv=2, lengths=lengths)
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
    "plain": dict(),     # the one-item-per-program kernel (the default is the persistent one)
}

_DQ_SCRIPT = r"""
import json
from benchmarks.tools.compile import build, fake_state, report as resource_report
from flamia.ops import backward_gluon as G
def _kernel(launch, st, cfg=None):
    built = build(launch, st, cfg)
    k = next(v for n, v in built.items() if n.startswith(("_dkdv", "_dq")))
    r = resource_report(k)
    r["setmaxnreg"] = max(r["partition_regs"]) if r["partition_regs"] else None
    return k, r
LADDER = %r
out = []
for D in (128, 64):
    for causal in (True, False):
        st = fake_state(D, T=1024, Hq=8, Hkv=2, causal=causal, rotate=True,
                        lengths=[300, 0, 1, 723])
        r = _kernel(G.launch_dq_gluon, st)[1]
        out.append(dict(D=D, causal=causal, config="default", **r))
for name, kw in LADDER.items():
    st = fake_state(128, T=1024, Hq=8, Hkv=2, causal=True, rotate=True, lengths=[300, 0, 1, 723])
    cfg = G.GluonDqConfig(**{**G.plain_dq_config(128).__dict__, **kw})
    r = _kernel(G.launch_dq_gluon, st, cfg)[1]
    out.append(dict(D=128, causal=True, config=name, **r))
print("REPORT" + json.dumps(out))
""" % (DQ_LADDER,)


@pytest.fixture(scope="module")
def dq_report():
    return compile_report(_DQ_SCRIPT, timeout=600)


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
    st = fake_state(64, T=64, Hq=2, Hkv=1)
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
    st = fake_state(64, T=sum(lengths), Hq=4, Hkv=2, lengths=lengths)
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


# ----------------------------------------------------------------------------------------------
# Opt-in variants (constexpr WS of _dq_fp8_kernel, WS of _dkdv_fp8_kernel for two consumer
# warpgroups; vec_gather: host-only, both kernels). The dK/dV kernel's one-warpgroup overlap / ws
# variants and the dQ kernel's overlap schedules were removed: each lost to its default on the
# H200.
# ----------------------------------------------------------------------------------------------

# name -> (kernel, D, config overrides, spill bound in bytes). Measured when written (causal,
# ptxas of triton 3.6): dK/dV w8ws D=128 512 (consumer setmaxnreg 240; w8 without ws: 340),
# D=64 0; every dQ variant 0.
VARIANTS = {
    "dkdv_w8ws": ("dkdv", 128, dict(bn=128, num_warps=8, ws=True, stages=2), 600),
    "dkdv_w8ws_d64": ("dkdv", 64, dict(bn=128, num_warps=8, ws=True), 64),
    "dkdv_fold": ("dkdv", 128, dict(fold_sdo=True), 512),
    "dkdv_shared_mask": ("dkdv", 128, dict(shared_mask=True), 512),
    "dkdv_w8ws_fold": ("dkdv", 128, dict(bn=128, num_warps=8, ws=True, fold_sdo=True), 600),
    "dkdv_pack": ("dkdv", 128, dict(fold_sdo=True, shared_mask=True, pack_vecs=True), 512),
    "dkdv_late_threshold": ("dkdv", 128, dict(fold_sdo=True, shared_mask=True, pack_vecs=True,
                                              late_dv=True, threshold_mask=True), 128),
    "dkdv_w8ws_threshold_d64": ("dkdv", 64, dict(bn=128, num_warps=8, ws=True, fold_sdo=True,
                                                 pack_vecs=True, threshold_mask=True), 64),
    "dkdv_w8ws_pack_d64": ("dkdv", 64, dict(bn=128, num_warps=8, ws=True, fold_sdo=True,
                                            pack_vecs=True), 64),
    "dq_ws": ("dq", 128, dict(ws=True, maxnreg=128), 64),
    "dq_ws_d64": ("dq", 64, dict(ws=True, maxnreg=128), 64),
}

_VAR_SCRIPT = r"""
import json
from benchmarks.tools.compile import build, fake_state, report as resource_report
from flamia.ops import backward_gluon as G
def _kernel(launch, st, cfg=None):
    built = build(launch, st, cfg)
    k = next(v for n, v in built.items() if n.startswith(("_dkdv", "_dq")))
    r = resource_report(k)
    r["setmaxnreg"] = max(r["partition_regs"]) if r["partition_regs"] else None
    return k, r
VARIANTS = %r
out = {}
for name, (kern, D, kw, _) in VARIANTS.items():
    st = fake_state(D, T=1024, Hq=8, Hkv=2, causal=True, rotate=True, lengths=[300, 0, 1, 723])
    if kern == "dq":
        k, r = _kernel(G.launch_dq_gluon, st,
                       G.GluonDqConfig(**{**G.plain_dq_config(D).__dict__, **kw}))
    else:
        k, r = _kernel(G.launch_dkdv_gluon, st,
                       G.GluonDkdvConfig(**{**G.plain_gluon_config(D).__dict__, **kw}))
    r["ws_partition"] = "setmaxnreg" in k.asm["ptx"]
    r["maxnreg_directive"] = ".maxnreg" in k.asm["ptx"]
    out[name] = r
print("REPORT" + json.dumps(out))
""" % (VARIANTS,)


@pytest.fixture(scope="module")
def variant_report():
    return compile_report(_VAR_SCRIPT, timeout=900)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_compile_for_sm90a(variant_report, name):
    kern, D, kw, spill_bound = VARIANTS[name]
    r = variant_report[name]
    assert r["ws_partition"] == bool(kw.get("ws")), r   # the schedule the options select
    loop = 2 * (D // 32) + (2 * 2 * (D // 64) if kern == "dkdv" else 2 * (D // 64))
    assert r["wgmma"] >= loop, r
    assert r["tma_1d"] == 0 and r["tma"] >= 7, r
    assert r["cvt_e4m3"] > 0 and r["ex2"] > 0, r
    assert not r["wgmma_serialized"], r            # no ptxas C7514 / C7515
    assert r["ld_local"] == 0, r
    assert r["regs"] <= 255, r
    assert r["spill_stores"] is not None and r["spill_stores"] <= spill_bound, r
    if kw.get("ws"):
        # producer warp padded to a warpgroup: setmaxnreg (consumer up, producer down to 24)
        assert r["setmaxnreg"] is not None and r["setmaxnreg"] <= 256, r
        if kw.get("maxnreg") == 128:               # 8 warps x 128 regs: 2 CTAs / SM
            assert r["regs"] <= 128 and r["setmaxnreg"] >= 224, r
    if kern == "dkdv" and kw.get("ws"):
        # 8 consumer warps + the producer's warpgroup: 12 x 32 x 168 launch registers, the
        # consumers setmaxnreg 240 (64K / SM); one CTA / SM by design (FA3's layout)
        assert r["regs"] <= 168 and r["setmaxnreg"] >= 232, r
        assert r["shared"] <= 227 * 1024, r
    else:
        assert r["shared"] <= 227 * 1024 // 2, r   # 2 CTAs / SM by shared memory


def test_variant_routing_and_validation():
    from flamia.ops import backward_gluon as G
    st = fake_state(64, T=64, Hq=2, Hkv=1)
    # dK/dV: no overlap schedule and no launch register cap; ws (constexpr WS) for two
    # consumer warpgroups only
    kw = G._args(st, G.plain_gluon_config(64))[2]
    assert (kw["WS"], kw["VEC_TMA"], kw["SYNC"]) == (False, True, False)
    # the defaults (fastest on the H200): D=64 FA3's layout, D=128 one warpgroup; both fold sdo
    # and read the four query vectors as one packed (4, BM) box
    assert G.default_gluon_config(64).pack_vecs and G.default_gluon_config(128).pack_vecs
    assert G._descs(st, G.default_gluon_config(64))[6].block_shape == [4, 64]
    kw = G._args(st, G.default_gluon_config(64))[2]
    assert (kw["WS"], kw["BN"], kw["num_warps"], kw["FOLD"], kw["SHARED_MASK"]) == \
        (True, 128, 8, True, False)
    st128 = fake_state(128, T=64, Hq=2, Hkv=1)
    kw = G._args(st128, G.default_gluon_config(128))[2]
    assert (kw["WS"], kw["BN"], kw["num_warps"], kw["FOLD"], kw["SHARED_MASK"],
            kw["THR_MASK"], kw["LATE_DV"]) == (False, 64, 4, True, False, True, True)
    assert not {"XO", "maxnreg"} & kw.keys()
    fields = {f.name for f in dataclasses.fields(G.GluonDkdvConfig)}
    assert not {"overlap", "maxnreg"} & fields and {"ws", "producer_regs"} <= fields
    assert "XO" not in G._dkdv_fp8_kernel.arg_names
    with pytest.raises(TypeError):
        G.GluonDkdvConfig(overlap=1)
    kw = G._args(st, G.GluonDkdvConfig(bn=128, num_warps=8, ws=True, producer_regs=32))[2]
    assert (kw["WS"], kw["PRODUCER_REGS"], kw["BN"], kw["num_warps"]) == (True, 32, 128, 8)
    assert "maxnreg" not in kw
    w8ws = dict(bn=128, num_warps=8, ws=True)
    for bad in (G.GluonDkdvConfig(ws=True), G.GluonDkdvConfig(ws=True, stages=3),
                G.GluonDkdvConfig(**w8ws, vec_tma=False), G.GluonDkdvConfig(**w8ws, sync_mma=True),
                G.GluonDkdvConfig(**w8ws, producer_regs=16)):
        with pytest.raises(ValueError):
            G._args(st, bad)
    # dQ: one kernel, the options are constexprs; maxnreg only when set; no overlap schedule
    kw = G._dq_args(st, G.plain_dq_config(64))[2]
    assert (kw["WS"], kw["VEC_TMA"], kw["SYNC"]) == (False, True, False)
    assert not {"XO", "maxnreg"} & kw.keys()
    kw = G._dq_args(st, G.GluonDqConfig(ws=True, maxnreg=128, producer_regs=32))[2]
    assert (kw["WS"], kw["PRODUCER_REGS"], kw["maxnreg"]) == (True, 32, 128)
    assert "overlap" not in {f.name for f in dataclasses.fields(G.GluonDqConfig)}
    assert "XO" not in G._dq_fp8_kernel.arg_names
    with pytest.raises(TypeError):
        G.GluonDqConfig(overlap=1)
    assert not hasattr(G, "_dkdv_fp8_v2_kernel") and not hasattr(G, "_dq_fp8_v2_kernel")
    for bad in (G.GluonDqConfig(ws=True, bm=128, num_warps=8),
                G.GluonDqConfig(ws=True, vec_tma=False), G.GluonDqConfig(ws=True, sync_mma=True),
                G.GluonDqConfig(ws=True, producer_regs=16)):
        with pytest.raises(ValueError):
            G._dq_args(st, bad)
    # the persistent default: the work list in cu's place, at most 2 CTAs per SM, no one-item
    # constexprs; it needs the ws producer and one consumer warpgroup
    grid, args, kw = G._dq_args(st, G.default_dq_config(64))
    assert G._dq_kernel(G.default_dq_config(64)) is G._dq_fp8_persistent_kernel
    assert len(grid) == 1 and 1 <= grid[0] <= 2 * 132
    assert kw["QBUF"] == 1 and not {"WS", "VEC_TMA", "SYNC"} & kw.keys()
    # (maxnreg is a launch option; DIAG a defaulted constexpr)
    assert len(args) + len(kw) - 1 == len(G._dq_fp8_persistent_kernel.arg_names) - 1
    # the timing diagnostics (wrong results by design; benchmarks/NOTES.md session 11 item 6)
    assert G._dq_args(st, dataclasses.replace(G.default_dq_config(64), diag=1))[2]["DIAG"] == 1
    assert G._args(st, dataclasses.replace(G.default_gluon_config(64), diag=1))[2]["DIAG"] == 1
    assert "DIAG" not in G._args(st, G.default_gluon_config(64))[2]
    for bad in (G.GluonDqConfig(persistent=2), G.GluonDqConfig(persistent=2, ws=True, qbuf=3),
                G.GluonDqConfig(diag=1)):
        with pytest.raises(ValueError):
            G._dq_args(st, bad)


def test_fold_sdo_vectors():
    """fold_sdo: the lse slot becomes lse * log2(e) - log2(sdo), so exp2(x - folded) is
    exp2(x - lse * log2(e)) * sdo for power-of-two sdo (to fp32 rounding of the add); pad
    columns (lse +inf, sdo 0) and zero sdo give +inf (a = 0); the other vectors are untouched;
    the kernel option needs the padded vectors (vec_tma)."""
    import torch
    from flamia.ops import backward_gluon as G
    g = torch.Generator().manual_seed(1)
    lse = torch.randn(3, 50, generator=g) * 20
    sdo = torch.exp2(torch.randint(-20, 5, (3, 50), generator=g).float())
    lse[:, -5:], sdo[:, -5:] = float("inf"), 0.0           # pad columns
    sdo[0, 3] = 0.0                                         # a zero dO row
    delta, sq = torch.randn(3, 50, generator=g), torch.rand(3, 50, generator=g)
    f, d2, q2, s2 = G.fold_sdo((lse, delta, sq, sdo))
    assert d2 is delta and q2 is sq and s2 is sdo
    assert bool(torch.isposinf(f[:, -5:]).all()) and bool(torch.isposinf(f[0, 3]))
    x = torch.randn(3, 45, generator=g) * 10
    want = torch.exp2(x - lse[:, :45] * G.LOG2E) * sdo[:, :45]
    got = torch.exp2(x - f[:, :45])
    torch.testing.assert_close(got, want, rtol=2e-5, atol=0)
    st = fake_state(64, T=64, Hq=2, Hkv=1)
    assert G._args(st, G.GluonDkdvConfig(fold_sdo=True))[2]["FOLD"] is True
    assert G._args(st, G.GluonDkdvConfig())[2]["FOLD"] is False
    with pytest.raises(ValueError, match="fold_sdo"):
        G._args(st, G.GluonDkdvConfig(fold_sdo=True, vec_tma=False))


def test_pack_vectors_layout():
    """pack_vecs: head h's lse, Delta, sq, sdo are rows 4h .. 4h + 3 of one (Hq * 4, Tp) buffer
    (one (4, BM) TMA box per tile); row stride 16-byte aligned like the separate vectors."""
    import torch
    from flamia.ops import backward_gluon as G
    g = torch.Generator().manual_seed(2)
    vecs = tuple(torch.randn(3, 48, generator=g) for _ in range(4))
    packed = G.pack_vectors(vecs)
    assert packed.shape == (12, 48) and packed.is_contiguous() and (packed.stride(0) * 4) % 16 == 0
    for h in range(3):
        for r in range(4):
            assert torch.equal(packed[4 * h + r], vecs[r][h])
    st = fake_state(64, T=64, Hq=2, Hkv=1)
    with pytest.raises(ValueError, match="pack_vecs"):
        G._args(st, G.GluonDkdvConfig(pack_vecs=True, vec_tma=False))


def test_vecs_option_resolution():
    """launch_*_gluon(vecs=...): tensors as given; None -> the config's choice (vec_gather: the
    one-launch Triton gather, tested bitwise in tests/test_ops_kmajor.py); 'torch' / 'triton'."""
    from flamia.ops import backward_gluon as G
    torch_fn, triton_fn = (lambda st: "torch"), (lambda st: "triton")
    d, g = G.GluonDkdvConfig(), G.GluonDkdvConfig(vec_gather=True)
    assert G._resolve_vecs(None, d, None, torch_fn, triton_fn) == "torch"
    assert G._resolve_vecs(None, g, None, torch_fn, triton_fn) == "triton"
    assert G._resolve_vecs("triton", d, None, torch_fn, triton_fn) == "triton"
    assert G._resolve_vecs("torch", g, None, torch_fn, triton_fn) == "torch"
    assert G._resolve_vecs((1, 2), g, None, torch_fn, triton_fn) == (1, 2)
    with pytest.raises(ValueError):
        G._resolve_vecs("cuda", d, None, torch_fn, triton_fn)


def test_timing_diagnostic_only_when_asked(monkeypatch):
    """FLAMIA_BWD_DIAG (benchmarks/graph_timing.py's what-if timings; WRONG results) reaches the
    default dK/dV and dQ configs only while it is set: the public call never carries it
    otherwise."""
    from flamia.ops import backward_gluon as G
    monkeypatch.delenv("FLAMIA_BWD_DIAG", raising=False)
    for D in (64, 128):
        assert G._with_env_diag(G.default_gluon_config(D)).diag == 0
        assert G._with_env_diag(G.default_dq_config(D)).diag == 0
    monkeypatch.setenv("FLAMIA_BWD_DIAG", "1")
    assert G._with_env_diag(G.default_gluon_config(64)).diag == 1
    assert G._with_env_diag(G.default_dq_config(128)).diag == 1
    assert G.default_gluon_config(64).diag == 0     # the memoized defaults stay untouched
