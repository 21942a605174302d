"""Backward kernels on the H200 at realistic sizes (skipped without CUDA).

    python -m pytest -q tests/gpu/test_backward_gpu.py

Operands come from reference.forward (the numerics spec) so the backward is tested alone; one test
runs the kernel quantize + forward + backward end to end when those kernels import.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from benchmarks.tools.operands import quantized_qkv_from_reference  # noqa: E402
from flamia import reference as R  # noqa: E402
from flamia.inputs import make_qkv, rel_err  # noqa: E402
from flamia.ops import backward as B  # noqa: E402
from flamia.ops.config import BwdConfig  # noqa: E402

LENGTHS = (1536, 0, 1, 700, 2048)
HQ, HKV = 16, 4
DEV = "cuda"
CONFIGS = {       # None: what the device runs (sm_90: Gluon / one-pass); a BwdConfig without
    "default": None,  # Gluon configs: the Triton split kernels (other GPUs, the interpreter)
    "small": BwdConfig(kv_bn=64, kv_bm=64, kv_warps=4, q_bm=64, q_bn=64, q_warps=4),
    "bm32": BwdConfig(kv_bn=128, kv_bm=32, kv_warps=8, q_bm=128, q_bn=32, q_warps=8),
    "triton": BwdConfig(),
}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(B, "POISON", True)


def _dout(shape, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(shape, generator=g, device=DEV).to(torch.bfloat16)


def _forward(q, k, v, cu, recipe, causal=True):
    out, lse, saved = R.forward(q, k, v, cu, recipe, causal)
    return out.to(torch.bfloat16), lse.float(), saved


def _kernel(dout, out, lse, saved, cu, recipe, causal=True, cfg=None, grad_dtype=torch.float32,
            deterministic=True):
    qkv = quantized_qkv_from_reference(saved, recipe, cu, causal)
    grads = B.attention_backward(dout, out, lse, qkv, cu, max(LENGTHS), causal,
                                 deterministic=deterministic, config=cfg, grad_dtype=grad_dtype)
    for g in grads:
        assert torch.isfinite(g).all(), "unwritten (NaN-poisoned) or non-finite gradient"
    return grads


def _grads64(q, k, v, cu, dout, causal=True):
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    R.attention_exact(*x64, cu, causal).backward(dout.double())
    return [x.grad for x in x64]


def _check(name, g, g_ref, g64, atol_frac=2e-3, rel_atol=1e-4):
    err = (g.double() - g64).abs().max().item()
    err_ref = (g_ref.double() - g64).abs().max().item()
    assert err <= 2 * err_ref + atol_frac * g64.abs().max().item(), \
        f"{name}: kernel max err {err:.3e} vs reference {err_ref:.3e}"
    rk, rr = rel_err(g, g64), rel_err(g_ref, g64)
    assert rk <= 1.25 * rr + rel_atol, f"{name}: rel err kernel {rk:.3e} vs reference {rr:.3e}"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("recipe", ("fp8", "fp8_mixed", "bf16"))
@pytest.mark.parametrize("family", ("mild", "outliers"))
def test_accuracy(family, recipe, D, config):
    if config != "default" and (family != "mild" or D != 128):
        pytest.skip("block configs checked on one case")
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, D, family, device=DEV, seed=1)
    out, lse, saved = _forward(q, k, v, cu, recipe)
    dout = _dout(out.shape, 2)
    ref = R.backward(dout, out, lse, saved, cu, recipe)
    kern = _kernel(dout, out, lse, saved, cu, recipe, cfg=CONFIGS[config])
    g64 = _grads64(q, k, v, cu, dout)
    for name, g, r, e in zip(("dq", "dk", "dv"), kern, ref, g64):
        _check(f"{family} {recipe} D={D} {name}", g, r, e)


def test_non_causal():
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, 128, "mild", device=DEV, seed=3)
    out, lse, saved = _forward(q, k, v, cu, "fp8", causal=False)
    dout = _dout(out.shape, 4)
    ref = R.backward(dout, out, lse, saved, cu, "fp8", causal=False)
    kern = _kernel(dout, out, lse, saved, cu, "fp8", causal=False)
    g64 = _grads64(q, k, v, cu, dout, causal=False)
    for name, g, r, e in zip(("dq", "dk", "dv"), kern, ref, g64):
        _check(f"non-causal {name}", g, r, e)


@pytest.mark.parametrize("recipe", ("fp8", "fp8_mixed", "bf16"))
def test_p1_p2_bitwise_and_deterministic(recipe):
    D = 128
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, D, "mild", device=DEV, seed=5)
    t = 1536 + 1 + 333
    dout = _dout(q.shape, 6)
    dout[t + 1:] = 0
    a = _kernel(dout, *_forward(q, k, v, cu, recipe), cu, recipe)
    a2 = _kernel(dout, *_forward(q, k, v, cu, recipe), cu, recipe)
    for x, y in zip(a, a2):
        assert torch.equal(x, y), "not deterministic"
    g = torch.Generator(device=DEV).manual_seed(7)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[t + 1:] = (torch.randn(x[t + 1:].shape, generator=g, device=DEV) * 16).to(x.dtype)
    b = _kernel(dout, *_forward(q2, k2, v2, cu, recipe), cu, recipe)
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        assert torch.equal(x[:t + 1], y[:t + 1]), f"P1 {name}: prefix changed"
        assert bool((y[t + 1:] == 0).all()), f"P1 {name}: suffix not zero"
    # P2: perturb the first document only
    dfull = _dout(q.shape, 8)
    a = _kernel(dfull, *_forward(q, k, v, cu, recipe), cu, recipe)
    q3, k3, v3, d3 = (x.clone() for x in (q, k, v, dfull))
    for x in (q3, k3, v3, d3):
        x[:1536] = (torch.randn(x[:1536].shape, generator=g, device=DEV) * 4).to(x.dtype)
    b = _kernel(d3, *_forward(q3, k3, v3, cu, recipe), cu, recipe)
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        assert torch.equal(x[1536:], y[1536:]), f"P2 {name}: another document changed"


@pytest.mark.parametrize("recipe", ("fp8", "fp8_mixed", "bf16"))
def test_end_to_end_with_kernel_forward(recipe):
    try:
        from flamia.ops.forward import attention_forward
        from flamia.ops.quantize import quantize_qkv
    except ImportError as e:
        pytest.skip(f"kernel forward not available: {e}")
    D = 128
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, D, "mild", device=DEV, seed=9)
    qkv = quantize_qkv(q, k, v, cu, recipe, True)
    out, lse = attention_forward(qkv, cu, max(LENGTHS), True, None, torch.bfloat16)
    dout = _dout(q.shape, 10)
    kern = B.attention_backward(dout, out, lse, qkv, cu, max(LENGTHS), True)
    assert all(g.dtype == torch.bfloat16 for g in kern)
    rout, rlse, saved = _forward(q, k, v, cu, recipe)
    ref = R.backward(dout, rout, rlse, saved, cu, recipe)
    g64 = _grads64(q, k, v, cu, dout)
    for name, g, r, e in zip(("dq", "dk", "dv"), kern, ref, g64):
        # bf16 outputs: allow bf16's own rounding (relative 2^-9 per element) on top; the H200
        # showed dq 2.47e-3 vs the fp32 reference's 1.83e-3 for the bf16 recipe from that alone.
        _check(f"e2e {recipe} {name}", g.float(), r, e, atol_frac=8e-3, rel_atol=2 ** -8)
