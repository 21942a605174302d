"""The portable backward (flamia/ops/backward.py) under the Triton interpreter, against the
reference, and which backward a call runs (flamia/ops/config.py).

The split kernels implement the bf16 recipe. Small shapes (a launch costs ~0.1 s in the
interpreter): packed documents with an empty and a length-1 document, GQA 4/2 heads, head dims
64 and 128, tiles of 16/32 tokens so every document spans several tiles. The operands come from
reference.forward's Saved (the same bytes quantize_qkv produces), so the tests check the
backward alone. Every buffer the module allocates is NaN-poisoned before the launches.
"""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from benchmarks.tools.operands import quantized_qkv_from_reference
from flamia import reference as R
from flamia.inputs import cu_seqlens_from_lengths, make_qkv, rel_err
from flamia.ops import backward as B
from flamia.ops import interpreting
from flamia.ops.config import BwdConfig, ReferenceBwdConfig, Sm90BwdConfig
from flamia.ops.layout import QuantizedQKV

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA (before triton is imported);
# on the GPU machine tests/gpu/test_backward_gpu.py covers the kernels.
pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU tests under the Triton interpreter")

RECIPE = "bf16"                   # the split kernels' recipe
LENGTHS = (37, 0, 1, 70)          # packed: a 37-token doc, an empty one, a length-1, a 70-token doc
HQ, HKV = 4, 2
CFG = BwdConfig(kv_bn=32, kv_bm=16, q_bm=32, q_bn=16, pre_bt=32)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(B, "POISON", True)


def _forward(q, k, v, cu, causal=True):
    out, lse, saved = R.forward(q, k, v, cu, RECIPE, causal)
    return out.to(q.dtype), lse.float(), saved


def _kernel(dout, out, lse, saved, cu, causal=True, grad_dtype=torch.float32, cfg=CFG):
    qkv = quantized_qkv_from_reference(saved, RECIPE, cu, causal)
    max_len = int((cu[1:] - cu[:-1]).max())
    grads = B.attention_backward(dout, out, lse, qkv, cu, max_len, causal, config=cfg,
                                 grad_dtype=grad_dtype)
    for g in grads:   # poisoned buffers: every element must have been written
        assert torch.isfinite(g).all(), "unwritten (NaN-poisoned) or non-finite gradient"
    return grads


def _dout(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def _grads64(q, k, v, cu, dout, causal=True):
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o = R.attention_exact(*x64, cu, causal)
    o.backward(dout.double())
    return [x.grad for x in x64]


def _check_fa_rule(name, g, g_ref, g64, atol_frac=2e-3):
    """FlashAttention's rule: max|g - ref64| <= 2 max|g_emulation - ref64| + atol."""
    err = (g.double() - g64).abs().max().item()
    err_ref = (g_ref.double() - g64).abs().max().item()
    atol = atol_frac * g64.abs().max().item()
    assert err <= 2 * err_ref + atol, f"{name}: kernel err {err:.3e} vs reference err {err_ref:.3e}"
    # and in relative Frobenius norm (P4's measure)
    rk, rr = rel_err(g, g64), rel_err(g_ref, g64)
    assert rk <= 1.25 * rr + 1e-4, f"{name}: rel err kernel {rk:.3e} vs reference {rr:.3e}"
    return rk, rr


def _case(D, family="mild", causal=True, lengths=LENGTHS, seed=0, cfg=CFG):
    q, k, v, cu = make_qkv(lengths, HQ, HKV, D, family, seed=seed)
    out, lse, saved = _forward(q, k, v, cu, causal)
    dout = _dout(out.shape, seed + 1)
    ref = R.backward(dout, out, lse, saved, cu, RECIPE, causal)
    kern = _kernel(dout, out, lse, saved, cu, causal, cfg=cfg)
    g64 = _grads64(q, k, v, cu, dout, causal)
    for name, g, r, e in zip(("dq", "dk", "dv"), kern, ref, g64):
        _check_fa_rule(f"D={D} {family} causal={causal} {name}", g, r, e)
    return kern, ref


@pytest.mark.parametrize("D", (64, 128))
def test_accuracy_vs_reference(D):
    _case(D)


def test_accuracy_outliers():
    _case(128, family="outliers", seed=3)


def test_accuracy_non_causal():
    _case(64, causal=False, lengths=(21, 0, 1, 40), seed=5)


@pytest.mark.parametrize("cfg", (
    BwdConfig(kv_bn=32, kv_bm=32, q_bm=32, q_bn=32, pre_bt=16),
    BwdConfig(kv_bn=128, kv_bm=16, q_bm=128, q_bn=16, pre_bt=64),
), ids=("square", "wide"))
def test_other_tiles(cfg):
    """Other tile shapes (query and key steps as large as the block they walk; key and query
    blocks wider than the longest document, walked in 16-token steps): the same function by the
    FlashAttention rule, every element written."""
    _case(64, seed=19, cfg=cfg)


@pytest.mark.parametrize("bad", (dict(kv_bn=32, kv_bm=64), dict(kv_bn=16, kv_bm=32),
                                 dict(q_bm=16, q_bn=32), dict(q_bm=32, q_bn=64)))
def test_bad_block_config(bad):
    """Tiles whose step does not divide the block (kv_bn % kv_bm, q_bm % q_bn; the tiles are
    powers of two, so a step wider than its block) are refused: the kernels walk a block's
    diagonal in whole steps, and a wider step would take tiles past the diagonal unmasked and
    count them twice."""
    T, D = 40, 64
    zb = torch.zeros(T, HQ, D, dtype=torch.bfloat16)
    qkv = QuantizedQKV("bf16", zb, zb[:, :HKV], zb[:, :HKV], None, None, None, None, False)
    cfg = replace(CFG, **bad)
    with pytest.raises(ValueError, match="block config"):
        B.make_state(zb, zb, torch.zeros(HQ, T), qkv, cu_seqlens_from_lengths([T]), T,
                     config=cfg)


def test_preprocess_delta_from_bf16_dout():
    """Delta_i = rowsum(bf16(dO_i) * O_i) (reference.backward's bf16 recipe) for fp32 dO, over
    a partial last token block; dO unrounded would give a different Delta."""
    D = 64
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, D, seed=7)
    out, lse, saved = _forward(q, k, v, cu)
    g = torch.Generator().manual_seed(8)
    dout = torch.randn(out.shape, generator=g) * 3.0           # fp32: not bf16-representable
    qkv = quantized_qkv_from_reference(saved, RECIPE, cu)
    st = B.make_state(dout, out, lse, qkv, cu, 70, True, None, CFG)
    assert st.T % CFG.pre_bt                                   # a partial last token block
    B.launch_preprocess(st)
    rounded = (dout.to(torch.bfloat16).float() * out.float()).sum(-1).T
    unrounded = (dout * out.float()).sum(-1).T
    torch.testing.assert_close(st.delta, rounded, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(st.delta, unrounded, rtol=1e-5, atol=1e-5)


def test_split_kernels_take_only_bf16():
    """make_state (and so a BwdConfig) refuses an fp8 qkv: the split kernels implement bf16."""
    T, D = 8, 64
    z8 = torch.zeros(T, HQ, D).to(torch.float8_e4m3fn)
    one = torch.ones(HQ, T)
    qkv = QuantizedQKV("fp8", z8, z8[:, :HKV], z8[:, :HKV], one, one[:HKV], one[:HKV], one[:HKV],
                       True)
    cu = cu_seqlens_from_lengths([T])
    dout = torch.zeros(T, HQ, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        B.make_state(dout, dout, torch.zeros(HQ, T), qkv, cu, T)
    with pytest.raises(ValueError, match="bf16"):
        B.attention_backward(dout, dout, torch.zeros(HQ, T), qkv, cu, T, config=CFG)


def test_p1_causal_prefix_and_p2_document_isolation():
    """P1: dO zero after t, q/k/v after t replaced by 16x larger values: grads at <= t bitwise
    unchanged, after t exactly zero. P2: perturbing one document leaves the others' grads
    bitwise unchanged."""
    D = 64
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, D, seed=11)
    T = q.shape[0]
    t = 37 + 1 + 40                                    # inside the 70-token document
    dout = _dout((T, HQ, D), 12)
    dout[t + 1:] = 0
    base = _kernel(dout, *_forward(q, k, v, cu), cu)

    g = torch.Generator().manual_seed(13)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[t + 1:] = (torch.randn(x[t + 1:].shape, generator=g) * 16).to(x.dtype)
    pert = _kernel(dout, *_forward(q2, k2, v2, cu), cu)
    for name, a, b in zip(("dq", "dk", "dv"), base, pert):
        assert torch.equal(a[:t + 1], b[:t + 1]), f"P1 {name}: prefix changed"
        assert torch.equal(b[t + 1:], torch.zeros_like(b[t + 1:])), f"P1 {name}: nonzero"

    # P2: perturb the first document (tokens 0..36) in q, k, v and dO
    dout_full = _dout((T, HQ, D), 14)
    base = _kernel(dout_full, *_forward(q, k, v, cu), cu)
    q3, k3, v3, d3 = (x.clone() for x in (q, k, v, dout_full))
    for x in (q3, k3, v3, d3):
        x[:37] = (torch.randn(x[:37].shape, generator=g) * 4).to(x.dtype)
    pert = _kernel(d3, *_forward(q3, k3, v3, cu), cu)
    for name, a, b in zip(("dq", "dk", "dv"), base, pert):
        assert torch.equal(a[37:], b[37:]), f"P2 {name}: another document changed"
        assert not torch.equal(a[:37], b[:37])


def test_deterministic_and_caller_dtype():
    D = 128
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, D, seed=21)
    out, lse, saved = _forward(q, k, v, cu)
    dout = _dout(out.shape, 22)
    a = _kernel(dout, out, lse, saved, cu, grad_dtype=None)
    b = _kernel(dout, out, lse, saved, cu, grad_dtype=None)
    for x, y in zip(a, b):
        assert x.dtype == torch.bfloat16
        assert torch.equal(x, y)


def test_degenerate_documents():
    """Only empty and length-1 documents; and no tokens at all."""
    D = 64
    lengths = (0, 1, 0, 1, 0)
    q, k, v, cu = make_qkv(lengths, HQ, HKV, D, seed=31)
    out, lse, saved = _forward(q, k, v, cu)
    dout = _dout(out.shape, 32)
    ref = R.backward(dout, out, lse, saved, cu, RECIPE)
    kern = _kernel(dout, out, lse, saved, cu)
    for g, r in zip(kern, ref):
        # length 1: P = 1, dS = 0, dq = dk = 0, dv = dO (summed over the group)
        torch.testing.assert_close(g, r, rtol=0.07, atol=1e-6)
    cu0 = cu_seqlens_from_lengths([0, 0])
    z = torch.zeros(0, HQ, D, dtype=torch.bfloat16)
    qkv = QuantizedQKV("bf16", z, z[:, :HKV], z[:, :HKV], None, None, None, None, False)
    dq, dk, dv = B.attention_backward(z, z, torch.zeros(HQ, 0), qkv, cu0, 0)
    assert dq.shape == (0, HQ, D) and dk.shape == (0, HKV, D) and dv.shape == (0, HKV, D)


def _fake_capability(monkeypatch, cap):
    """Every CUDA device reports capability `cap` (to torch and to flamia.ops' memo of it), and
    the process is not the interpreter's."""
    from flamia import ops
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    monkeypatch.setattr(ops, "_capability", lambda index: cap)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_backward_selection(monkeypatch):
    """Which backward a call runs (config.backward_config and select, CUDA faked). On an sm_90
    GPU with Gluon: bf16 (bf16 or fp16 inputs) and fp8 at D=64/128 the one-pass kernel
    (Sm90BwdConfig: 128-row steps at D=64, 64 at D=128), with the persistent Gluon forward for
    fp8 at D=128. fp8 anywhere else (other head dims, other GPUs, no Gluon, the interpreter, the
    CPU): the reference backward on the kernel forward's operands (ReferenceBwdConfig). bf16
    anywhere else (fp32 inputs, other head dims, other GPUs, no Gluon, the interpreter, the CPU):
    the split kernels with their default tiles (BwdConfig())."""
    from flamia.ops import config as C
    from flamia.recipes import RECIPES
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for D in (64, 128):                                    # the CPU, under the interpreter
        assert isinstance(C.backward_config(D, "fp8", cpu), ReferenceBwdConfig)
        assert C.backward_config(D, "bf16", cpu) == BwdConfig()

    _fake_capability(monkeypatch, (9, 0))
    monkeypatch.setattr(C, "HAVE_GLUON", True)
    for recipe in ("bf16", "fp8", RECIPES["bf16"], RECIPES["fp8"]):
        for D in (64, 128):
            cfg = C.backward_config(D, recipe, cuda)
            assert cfg == Sm90BwdConfig(block_m=128 if D == 64 else 64), (recipe, D, cfg)
            assert C.select(D, recipe, cuda).backward == cfg
    assert isinstance(C.backward_config(128, "bf16", cuda, torch.float16), Sm90BwdConfig)
    assert isinstance(C.backward_config(64, "fp8", cuda, torch.float8_e4m3fn), Sm90BwdConfig)
    assert C.backward_config(128, "bf16", cuda, torch.float32) == BwdConfig()
    assert C.backward_config(96, "bf16", cuda) == BwdConfig()
    assert isinstance(C.backward_config(96, "fp8", cuda), ReferenceBwdConfig)
    for D in (64, 128):                                    # the CPU, not interpreting
        assert isinstance(C.backward_config(D, "fp8", cpu), ReferenceBwdConfig)
        assert C.backward_config(D, "bf16", cpu) == BwdConfig()
    sel = C.select(128, "fp8", cuda)
    assert isinstance(sel.forward, C.PersistentFwdConfig) and not sel.vt_mma_order
    sel = C.select(64, "fp8", cuda)
    assert isinstance(sel.forward, C.FwdConfig) and sel.vt_mma_order
    assert isinstance(C.select(128, "bf16", cuda).forward, C.FwdConfig)

    monkeypatch.setenv("TRITON_INTERPRET", "1")            # the interpreter, sm_90 present
    assert isinstance(C.backward_config(128, "fp8", cuda), ReferenceBwdConfig)
    assert C.backward_config(128, "bf16", cuda) == BwdConfig()
    monkeypatch.delenv("TRITON_INTERPRET")

    monkeypatch.setattr(C, "HAVE_GLUON", False)            # no Gluon
    assert isinstance(C.backward_config(128, "fp8", cuda), ReferenceBwdConfig)
    assert C.backward_config(64, "bf16", cuda) == BwdConfig()
    assert isinstance(C.forward_config(128, "fp8", cuda), C.FwdConfig)
    monkeypatch.setattr(C, "HAVE_GLUON", True)

    _fake_capability(monkeypatch, (10, 0))                 # not Hopper
    for D in (64, 128):
        assert isinstance(C.backward_config(D, "fp8", cuda), ReferenceBwdConfig)
        assert C.backward_config(D, "bf16", cuda) == BwdConfig()
    sel = C.select(128, "fp8", cuda)
    assert isinstance(sel.backward, ReferenceBwdConfig)
    assert isinstance(sel.forward, C.FwdConfig) and sel.vt_mma_order


def test_emulated_recipes_never_reach_the_kernels(monkeypatch):
    """The kernels implement bf16 and fp8 only: every emulated recipe (and the leaky control)
    runs the reference, on CUDA and under FLAMIA_KERNELS=1 on the CPU alike
    (ops.kernels_available, interface.backend), so no kernel config is ever built for it."""
    from flamia import ops
    from flamia.interface import backend
    from flamia.recipes import RECIPES
    monkeypatch.setenv("FLAMIA_KERNELS", "1")
    assert ops.KERNEL_RECIPES == ("bf16", "fp8")
    on_cuda = SimpleNamespace(is_cuda=True)
    q = torch.zeros(4, HQ, 64)
    for name, recipe in RECIPES.items():
        kernels = not recipe.emulated and not recipe.leaky
        assert (name in ops.KERNEL_RECIPES) == kernels, name
        assert ops.kernels_available(on_cuda, name) == kernels, name
        assert ops.kernels_available(q, name) == kernels, name
        assert backend(q, name) == ("kernels" if kernels else "reference"), name
    assert {n for n, r in RECIPES.items() if r.emulated} >= {"fp8_mixed", "fp8_token"}


def test_dispatch_by_config(monkeypatch):
    """attention_backward runs what its config names (the entry points faked: routing only):
    Sm90BwdConfig the one-pass kernel (its fp8 entry, with the forward's row max, for an fp8
    qkv), ReferenceBwdConfig reference.backward on layout.reference_saved(qkv) cast to the
    caller's dtype, BwdConfig the split kernels; without a config, backward_config's choice
    (here on the CPU: the reference for fp8, the split kernels for bf16)."""
    from flamia.ops import backward_sm90
    T, D = 6, 64
    cu = cu_seqlens_from_lengths([T])
    dout = torch.zeros(T, HQ, D, dtype=torch.bfloat16)
    lse = torch.zeros(HQ, T)
    zb = torch.zeros(T, HQ, D, dtype=torch.bfloat16)
    bf16 = QuantizedQKV("bf16", zb, zb[:, :HKV], zb[:, :HKV], None, None, None, None, False)
    z8 = zb.to(torch.float8_e4m3fn)
    one = torch.ones(HQ, T)
    fp8 = QuantizedQKV("fp8", z8, z8[:, :HKV], z8[:, :HKV], one, one[:HKV], one[:HKV],
                       one[:HKV], True, row_max=torch.zeros(HQ, T))
    calls = []
    grads = (torch.zeros(T, HQ, D), torch.zeros(T, HKV, D), torch.zeros(T, HKV, D))

    def sm90(*args, config=None, **kw):
        calls.append(("sm90", config, args[3] is bf16.q8))
        return grads

    def sm90_fp8(*args, config=None, **kw):
        calls.append(("sm90_fp8", config, args[3] is fp8.row_max and args[4] is fp8))
        return grads

    def saved(qkv, causal):
        return ("saved", qkv, causal)

    def reference(*args):
        calls.append(("reference", None, args[3] == ("saved", fp8, True) and args[5] == "fp8"))
        return grads

    def split(st):
        calls.append(("split", st.cfg, st.q8 is bf16.q8))
        return grads

    monkeypatch.setattr(backward_sm90, "attention_backward_sm90", sm90)
    monkeypatch.setattr(backward_sm90, "attention_backward_sm90_fp8", sm90_fp8)
    monkeypatch.setattr(B, "reference_saved", saved)
    monkeypatch.setattr(R, "backward", reference)
    monkeypatch.setattr(B, "run_state", split)

    def route(qkv, cfg, grad_dtype=None):
        calls.clear()
        out = B.attention_backward(dout, dout, lse, qkv, cu, T, True, config=cfg,
                                   grad_dtype=grad_dtype)
        assert len(calls) == 1, calls
        return calls[0], out

    sm = Sm90BwdConfig(block_m=128)
    assert route(bf16, sm)[0] == ("sm90", sm, True)
    assert route(fp8, sm)[0] == ("sm90_fp8", sm, True)
    call, out = route(fp8, ReferenceBwdConfig(), torch.float16)
    assert call == ("reference", None, True) and all(g.dtype == torch.float16 for g in out)
    assert route(bf16, CFG)[0] == ("split", CFG, True)
    assert route(fp8, None)[0] == ("reference", None, True)
    assert route(bf16, None)[0] == ("split", BwdConfig(), True)
