"""Backward kernels (flamia/ops/backward.py) under the Triton interpreter, against the reference.

Small shapes (a launch costs ~0.1 s in the interpreter): packed documents with an empty and a
length-1 document, GQA 4/2 heads, head dims 64 and 128, recipes fp8 / fp8_mixed / bf16, tiles of
16/32 tokens so every document spans several tiles. The quantized operands come from
reference.forward's Saved (the same bytes quantize_qkv produces), so the tests check the backward
alone. Every buffer the module allocates is NaN-poisoned before the launches.
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.tools.operands import quantized_qkv_from_reference
from flamia import reference as R
from flamia.inputs import cu_seqlens_from_lengths, make_qkv, rel_err
from flamia.ops import backward as B
from flamia.ops import interpreting
from flamia.ops.config import BwdConfig
from flamia.ops.layout import QuantizedQKV

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA (before triton is imported);
# on the GPU machine tests/gpu/test_backward_gpu.py covers the kernels.
pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU tests under the Triton interpreter")

RECIPES = ("fp8", "fp8_mixed", "bf16")
LENGTHS = (37, 0, 1, 70)          # packed: a 37-token doc, an empty one, a length-1, a 70-token doc
HQ, HKV = 4, 2
CFG = BwdConfig(kv_bn=32, kv_bm=16, q_bm=32, q_bn=16, pre_bt=32)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(B, "POISON", True)


def _forward(q, k, v, cu, recipe, causal=True):
    out, lse, saved = R.forward(q, k, v, cu, recipe, causal)
    return out.to(q.dtype), lse.float(), saved


def _kernel(dout, out, lse, saved, cu, recipe, causal=True, grad_dtype=torch.float32, cfg=CFG):
    qkv = quantized_qkv_from_reference(saved, recipe, cu, causal)
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


def _case(recipe, D, family="mild", causal=True, lengths=LENGTHS, seed=0, cfg=CFG):
    q, k, v, cu = make_qkv(lengths, HQ, HKV, D, family, seed=seed)
    out, lse, saved = _forward(q, k, v, cu, recipe, causal)
    dout = _dout(out.shape, seed + 1)
    ref = R.backward(dout, out, lse, saved, cu, recipe, causal)
    kern = _kernel(dout, out, lse, saved, cu, recipe, causal, cfg=cfg)
    g64 = _grads64(q, k, v, cu, dout, causal)
    for name, g, r, e in zip(("dq", "dk", "dv"), kern, ref, g64):
        _check_fa_rule(f"{recipe} D={D} {family} {name}", g, r, e)
    return kern, ref


@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("recipe", RECIPES)
def test_accuracy_vs_reference(recipe, D):
    _case(recipe, D)


def test_accuracy_outliers_fp8():
    _case("fp8", 128, family="outliers", seed=3)


@pytest.mark.parametrize("recipe", RECIPES)
def test_split_dkdv_launches(recipe):
    """config.split_dkdv: dK and dV from two launches (each recomputes S^T) give the same
    gradients as the fused launch, bitwise (same tiles, same values, same order)."""
    split = BwdConfig(kv_bn=32, kv_bm=16, q_bm=32, q_bn=16, pre_bt=32, split_dkdv=True,
                        kv_bm_dv=16)
    fused, _ = _case(recipe, 64, seed=17)
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, 64, seed=17)
    out, lse, saved = _forward(q, k, v, cu, recipe)
    dout = _dout(out.shape, 18)
    for name, a, b in zip(("dq", "dk", "dv"), _kernel(dout, out, lse, saved, cu, recipe),
                          _kernel(dout, out, lse, saved, cu, recipe, cfg=split)):
        assert torch.equal(a, b), f"{recipe} {name}: split and fused dK/dV launches differ"
    # a different query step for the dV launch: same function (FlashAttention rule)
    _case(recipe, 64, seed=19, cfg=BwdConfig(kv_bn=32, kv_bm=16, q_bm=32, q_bn=16, pre_bt=32,
                                                split_dkdv=True, kv_bm_dv=32))


@pytest.mark.parametrize("recipe", ("fp8", "fp8_mixed"))
def test_late_large_values(recipe):
    """dO and V 2^10 larger on the last tokens of the 70-token document: the per-row fp8 scales
    of later tiles are far larger than of earlier ones (dK/dV visit queries from the diagonal
    down, dQ keys from the document start up)."""
    D = 64
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, D, seed=41)
    v[-20:] *= 2 ** 10
    out, lse, saved = _forward(q, k, v, cu, recipe)
    dout = _dout(out.shape, 42)
    dout[-20:] *= 2 ** 10
    ref = R.backward(dout, out, lse, saved, cu, recipe)
    kern = _kernel(dout, out, lse, saved, cu, recipe)
    g64 = _grads64(q, k, v, cu, dout)
    for name, g, r, e in zip(("dq", "dk", "dv"), kern, ref, g64):
        _check_fa_rule(f"{recipe} late-large {name}", g, r, e)


def test_accuracy_non_causal():
    _case("fp8", 64, causal=False, lengths=(21, 0, 1, 40), seed=5)


def _exact_pow2_scale(amax):
    """2^ceil(log2(amax / 448)) computed exactly (frexp), 0 for amax == 0."""
    m, e = torch.frexp(amax.double() / 448)
    e = torch.where(m == 0.5, e - 1, e).clamp(-126, 127)
    return torch.where(amax > 0, torch.exp2(e.double()), torch.zeros_like(m)).float()


def test_preprocess_scale_is_exact_at_powers_of_two():
    """Rows whose amax / 448 sits a few ulps above a power of two: the kernel takes the exact
    ceil (value <= 448, nothing saturates). quant.pow2_scale's fp32 log2 can round such a
    quotient down onto the power of two and then saturates that element at 448 instead."""
    T, H, D = 64, 2, 64
    g = torch.Generator().manual_seed(0)
    amax = torch.tensor([448 * 2.0 ** k * (1 + j * 2 ** -23) for k in range(-10, 5)
                         for j in (-2, -1, 0, 1, 2, 3)])
    amax = torch.cat([amax, torch.rand(T * H - amax.numel(), generator=g) * 100]).reshape(T, H)
    dout = torch.randn(T, H, D, generator=g)
    dout = dout / dout.abs().amax(-1, keepdim=True) * 0.9 * amax[..., None]
    dout[..., 0] = amax
    z = torch.zeros(T, H, D).to(torch.float8_e4m3fn)
    one = torch.ones(H, T)
    qkv = QuantizedQKV("fp8_mixed", z, z, z, one, one, one, one, False)
    cu = cu_seqlens_from_lengths([T])
    st = B.make_state(dout, torch.randn(T, H, D), torch.zeros(H, T), qkv, cu, T, True, None, CFG)
    B.launch_preprocess(st)
    assert torch.equal(st.sdo, _exact_pow2_scale(amax).T)
    vals = st.do8.float()
    assert vals.abs().max() <= 448
    torch.testing.assert_close(vals * st.sdo.T[..., None], dout, rtol=2 ** -4, atol=0)


def test_preprocess_quantizes_do_like_reference():
    """do8 / sdo bitwise equal to the reference's token quantization of dO; Delta close."""
    D = 64
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, D, seed=7)
    for recipe in ("fp8", "fp8_mixed"):
        out, lse, saved = _forward(q, k, v, cu, recipe)
        dout = _dout(out.shape, 8) * 3.0
        dout[5] = 0.0                              # an all-zero token: scale 0, values 0
        qkv = quantized_qkv_from_reference(saved, recipe, cu)
        st = B.make_state(dout, out, lse, qkv, cu, 70, True, None, CFG)
        B.launch_preprocess(st)
        ref = R.quantize_operand(dout.float(), "e4m3", "token")
        assert torch.equal(st.do8.float(), ref.values)
        assert torch.equal(st.sdo, ref.scale[..., 0].T)
        col = _padded_columns(cu)                  # padded, 16-aligned K-major layout
        assert st.tok_of_col.shape == (st.Tp,)
        assert torch.equal(st.tok_of_col[col].long(), torch.arange(col.numel()))
        pad = torch.ones(st.Tp, dtype=torch.bool)
        pad[col] = False
        assert (st.tok_of_col[pad] == -1).all()
        assert torch.equal(st.doT8[:, :, col].float(), ref.values.permute(1, 2, 0))
        assert (st.doT8[:, :, pad].view(torch.uint8) == 0).all()
        # fp8: Delta in units of sdo (rowsum(do8 * O)); fp8_mixed: from the bf16 dO
        do_used = ref.values if recipe == "fp8" else dout.float()
        delta = (do_used * out.float()).sum(-1).T
        torch.testing.assert_close(st.delta, delta, rtol=1e-5, atol=1e-5)
        if recipe == "fp8":
            assert torch.equal(st.qT8[:, :, col].float(), qkv.q8.float().permute(1, 2, 0))
            assert torch.equal(st.kT8[:, :, col].float(), qkv.k8.float().permute(1, 2, 0))
            assert (st.qT8[:, :, pad].view(torch.uint8) == 0).all()
            assert (st.kT8[:, :, pad].view(torch.uint8) == 0).all()


def _padded_columns(cu):
    """Column of each packed token in the K-major copies: document d starts at
    sum_{e<d} ceil16(len_e)."""
    cols, base = [], 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        cols += [base + i for i in range(b - a)]
        base += (b - a + 15) // 16 * 16
    return torch.tensor(cols, dtype=torch.long)


@pytest.mark.parametrize("recipe", ("fp8", "fp8_mixed"))
def test_tma_unaligned_documents(recipe, monkeypatch):
    """Packed documents with unaligned starts (37, 0, 1, 70, 19) read the K-major copies by TMA
    (the padded layout; the interpreter asserts 16-byte aligned descriptor coordinates), incl.
    partial end tiles, and match the reference by the FlashAttention rule."""
    descs = []
    orig = B._kmajor_desc
    monkeypatch.setattr(B, "_kmajor_desc", lambda x, bt: descs.append(bt) or orig(x, bt))
    _case(recipe, 64, lengths=(37, 0, 1, 70, 19), seed=41)
    assert descs, "TMA path not taken"


@pytest.mark.parametrize("recipe", RECIPES)
def test_p1_causal_prefix_and_p2_document_isolation(recipe):
    """P1: dO zero after t, q/k/v after t replaced by 16x larger values: grads at <= t bitwise
    unchanged, after t exactly zero. P2: perturbing one document leaves the others' grads
    bitwise unchanged."""
    D = 64
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, D, seed=11)
    T = q.shape[0]
    t = 37 + 1 + 40                                    # inside the 70-token document
    dout = _dout((T, HQ, D), 12)
    dout[t + 1:] = 0
    base = _kernel(dout, *_forward(q, k, v, cu, recipe), cu, recipe)

    g = torch.Generator().manual_seed(13)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[t + 1:] = (torch.randn(x[t + 1:].shape, generator=g) * 16).to(x.dtype)
    pert = _kernel(dout, *_forward(q2, k2, v2, cu, recipe), cu, recipe)
    for name, a, b in zip(("dq", "dk", "dv"), base, pert):
        assert torch.equal(a[:t + 1], b[:t + 1]), f"P1 {recipe} {name}: prefix changed"
        assert torch.equal(b[t + 1:], torch.zeros_like(b[t + 1:])), f"P1 {recipe} {name}: nonzero"

    # P2: perturb the first document (tokens 0..36) in q, k, v and dO
    dout_full = _dout((T, HQ, D), 14)
    base = _kernel(dout_full, *_forward(q, k, v, cu, recipe), cu, recipe)
    q3, k3, v3, d3 = (x.clone() for x in (q, k, v, dout_full))
    for x in (q3, k3, v3, d3):
        x[:37] = (torch.randn(x[:37].shape, generator=g) * 4).to(x.dtype)
    pert = _kernel(d3, *_forward(q3, k3, v3, cu, recipe), cu, recipe)
    for name, a, b in zip(("dq", "dk", "dv"), base, pert):
        assert torch.equal(a[37:], b[37:]), f"P2 {recipe} {name}: another document changed"
        assert not torch.equal(a[:37], b[:37])


def test_deterministic_and_caller_dtype():
    D = 128
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, D, seed=21)
    out, lse, saved = _forward(q, k, v, cu, "fp8")
    dout = _dout(out.shape, 22)
    a = _kernel(dout, out, lse, saved, cu, "fp8", grad_dtype=None)
    b = _kernel(dout, out, lse, saved, cu, "fp8", grad_dtype=None)
    for x, y in zip(a, b):
        assert x.dtype == torch.bfloat16
        assert torch.equal(x, y)


def test_degenerate_documents():
    """Only empty and length-1 documents; and no tokens at all."""
    D = 64
    lengths = (0, 1, 0, 1, 0)
    q, k, v, cu = make_qkv(lengths, HQ, HKV, D, seed=31)
    for recipe in ("fp8", "bf16"):
        out, lse, saved = _forward(q, k, v, cu, recipe)
        dout = _dout(out.shape, 32)
        ref = R.backward(dout, out, lse, saved, cu, recipe)
        kern = _kernel(dout, out, lse, saved, cu, recipe)
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
    """Which backward a call runs (config.backward_config, CUDA faked): bf16 with bf16 or fp16
    inputs at D=64/128 the one-pass sm90 kernel; the fp8 recipes the split backward with the Gluon
    dK/dV and dQ kernels (their configs per head dim); everything else the Triton kernels."""
    from flamia.ops import config as C
    from flamia.ops.config import Sm90BwdConfig
    cuda = torch.device("cuda")
    _fake_capability(monkeypatch, (9, 0))
    if not C.HAVE_GLUON:
        pytest.skip("triton.experimental.gluon not available")
    assert isinstance(C.backward_config(128, "bf16", cuda, 4096), Sm90BwdConfig)
    assert isinstance(C.backward_config(64, "bf16", cuda, 4096), Sm90BwdConfig)
    assert isinstance(C.backward_config(128, "bf16", cuda, 4096, torch.float16), Sm90BwdConfig)
    for args in ((96, "bf16", cuda, 4096),):
        cfg = C.backward_config(*args)
        assert isinstance(cfg, BwdConfig) and cfg.dkdv is None and cfg.dq is None, args
    for D in (64, 128):
        cfg = C.backward_config(D, "fp8", cuda, 8192)
        assert (cfg.dkdv, cfg.dq) == (C.gluon_dkdv_config(D), C.gluon_dq_config(D))
        cfg = C.backward_config(D, "fp8_mixed", cuda, 8192)
        assert (cfg.dkdv, cfg.dq) == (C.mixed_dkdv_config(D), C.mixed_dq_config(D))
        assert not cfg.split_dkdv or D == 128    # (the Triton tiles stay; unused on sm_90)
    assert C.gluon_dkdv_config(64).ws and C.gluon_dkdv_config(64).key_order_dk
    assert C.gluon_dkdv_config(128).late_dv and C.gluon_dkdv_config(128).threshold_mask
    assert C.mixed_dkdv_config(128).lazy_cols and not C.mixed_dkdv_config(64).lazy_cols
    for args in ((96, "fp8"), (128, "mxfp8")):
        assert not C.uses_gluon_backward(*args, cuda), args
    assert C.backward_config(128, "fp8", torch.device("cpu")).dkdv is None
    _fake_capability(monkeypatch, (10, 0))                 # not Hopper
    cfg = C.backward_config(128, "fp8", cuda)
    assert cfg.dkdv is None and cfg.dq is None
    assert isinstance(C.backward_config(128, "bf16", cuda), BwdConfig)
    sel = C.select(128, "fp8", cuda, 4096)
    assert sel.backward == cfg and isinstance(sel.forward, C.FwdConfig) and sel.vt_mma_order


def test_fp8_block_backward_selection(monkeypatch):
    """fp8_block: the one-pass kernel on sm_90 (64-row steps at D=128, 128 at D=64), the reference
    backward on the kernel operands elsewhere (the CPU interpreter, other GPUs); never the split
    kernels. Its forward is the persistent Gluon kernel at D=128 on sm_90, as fp8's."""
    from flamia.ops import config as C
    from flamia.ops.config import Sm90BwdConfig
    cuda = torch.device("cuda")
    assert isinstance(C.backward_config(128, "fp8_block", torch.device("cpu")),
                      C.ReferenceBwdConfig)
    _fake_capability(monkeypatch, (9, 0))
    if not C.HAVE_GLUON:
        pytest.skip("triton.experimental.gluon not available")
    for D in (64, 128):
        cfg = C.backward_config(D, "fp8_block", cuda, 8192)
        assert isinstance(cfg, Sm90BwdConfig) and cfg.block_m == (128 if D == 64 else 64), (D, cfg)
    assert isinstance(C.forward_config(128, "fp8_block", cuda), C.PersistentFwdConfig)
    assert isinstance(C.forward_config(64, "fp8_block", cuda), C.FwdConfig)
    _fake_capability(monkeypatch, (10, 0))                 # not Hopper
    assert isinstance(C.backward_config(128, "fp8_block", cuda), C.ReferenceBwdConfig)


def test_split_backward_routing(monkeypatch):
    """launch_dkdv / launch_dq run the kernel the state's config names (the Gluon launchers
    faked: routing only)."""
    from types import SimpleNamespace

    from flamia.ops import backward_gluon
    from flamia.ops import config as C
    calls = []
    for name in ("launch_dkdv_gluon", "launch_dq_gluon", "launch_dkdv_gluon_mixed",
                 "launch_dq_gluon_mixed"):
        monkeypatch.setattr(backward_gluon, name, lambda st, name=name: calls.append(name))

    def route(cfg):
        calls.clear()
        st = SimpleNamespace(cfg=cfg)
        for fn in (B.launch_dkdv, B.launch_dq):
            try:
                fn(st)
            except AttributeError:      # a Triton launch on the fake state
                calls.append("triton")
        return calls

    assert route(C.split_backward_config(128, "fp8", gluon=True)) == ["launch_dkdv_gluon",
                                                                      "launch_dq_gluon"]
    assert route(C.split_backward_config(64, "fp8_mixed", gluon=True)) == [
        "launch_dkdv_gluon_mixed", "launch_dq_gluon_mixed"]
    assert route(C.split_backward_config(128, "fp8")) == ["triton", "triton"]
    assert route(C.split_backward_config(128, "bf16", gluon=True)) == ["triton", "triton"]
