"""The public API: input validation (every error names its argument), layouts, options, autograd."""
from __future__ import annotations

import pytest
import torch

import flamia
from flamia import flamia_attn_func, flamia_attn_varlen_func
from flamia.inputs import cu_seqlens_from_lengths, make_qkv, rel_err
from flamia.interface import backend
from flamia.reference import attention_exact

BF16 = torch.bfloat16


def packed(lengths=(20, 1, 0, 12), hq=4, hkv=2, d=64, dtype=BF16, seed=0, family="mild"):
    return make_qkv(lengths, hq, hkv, d, family, dtype, seed=seed)


def dense(b=2, s=16, hq=4, hkv=2, d=64, dtype=BF16, seed=0):
    q, k, v, _ = make_qkv([s] * b, hq, hkv, d, "mild", dtype, seed=seed)
    return q.reshape(b, s, hq, d), k.reshape(b, s, hkv, d), v.reshape(b, s, hkv, d)


def call_varlen(q, k, v, cu, cu_k=None, max_q=None, max_k=None, **kw):
    m = 20 if max_q is None else max_q
    return flamia_attn_varlen_func(q, k, v, cu, cu if cu_k is None else cu_k, m,
                                   m if max_k is None else max_k, **kw)


# ---------------------------------------------------------------------------------------------
# Bad inputs: the error type and the argument named in the message.

def _bad_dense_cases():
    q, k, v = dense()
    return [
        ("q", TypeError, lambda: flamia_attn_func(q.float(), k, v)),
        ("same dtype", TypeError, lambda: flamia_attn_func(q, k.half(), v.half())),
        ("same dtype", TypeError, lambda: flamia_attn_func(q, k, v.half())),
        ("v must be a torch.Tensor", TypeError, lambda: flamia_attn_func(q, k, [1.0])),
        ("q must be 4-D", ValueError, lambda: flamia_attn_func(q[0], k, v)),
        ("head dim .* must be one of \\(64, 128, 256\\)", ValueError,
         lambda: flamia_attn_func(q[..., :48], k[..., :48], v[..., :48])),
        ("q and k must have the same head dim", ValueError,
         lambda: flamia_attn_func(q, torch.zeros(2, 16, 2, 128, dtype=BF16), torch.zeros(2, 16, 2, 128, dtype=BF16))),
        ("k and v", ValueError, lambda: flamia_attn_func(q, k, v[:, :8])),
        ("heads of k and v \\(3\\) must divide", ValueError, lambda: flamia_attn_func(q, k[:, :, :1].expand(-1, -1, 3, -1),
                                                        v[:, :, :1].expand(-1, -1, 3, -1))),
        ("same batch and seqlen", ValueError, lambda: flamia_attn_func(q, k[:, :8], v[:, :8])),
        ("same device", ValueError, lambda: flamia_attn_func(q, k.to("meta"), v)),
        ("softmax_scale", ValueError, lambda: flamia_attn_func(q, k, v, softmax_scale=-1.0)),
        ("softmax_scale", ValueError, lambda: flamia_attn_func(q, k, v, softmax_scale=float("nan"))),
        ("softmax_scale", ValueError, lambda: flamia_attn_func(q, k, v, softmax_scale=float("inf"))),
        ("softmax_scale", TypeError, lambda: flamia_attn_func(q, k, v, softmax_scale="0.1")),
        ("recipe", ValueError, lambda: flamia_attn_func(q, k, v, recipe="fp4")),
        ("recipe", TypeError, lambda: flamia_attn_func(q, k, v, recipe=8)),
        ("causal", TypeError, lambda: flamia_attn_func(q, k, v, causal="yes")),
        ("return_lse", TypeError, lambda: flamia_attn_func(q, k, v, return_lse=None)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_dense_cases())))
def test_dense_bad_inputs(case):
    needle, exc, fn = _bad_dense_cases()[case]
    with pytest.raises(exc, match=needle):
        fn()


def _bad_varlen_cases():
    q, k, v, cu = packed()               # T = 33, documents (20, 1, 0, 12)
    T = q.shape[0]
    return [
        ("q must be 3-D", ValueError, lambda: call_varlen(q[None], k, v, cu)),
        ("k must be 3-D", ValueError, lambda: call_varlen(q, k[None], v, cu)),
        ("number of tokens", ValueError, lambda: call_varlen(q, k[:-1], v[:-1], cu)),
        ("q must be torch.bfloat16 or torch.float16", TypeError, lambda: call_varlen(q.double(), k, v, cu)),
        ("cu_seqlens_q must be torch.int32", TypeError, lambda: call_varlen(q, k, v, cu.long())),
        ("cu_seqlens_k must be torch.int32", TypeError, lambda: call_varlen(q, k, v, cu, cu_k=cu.long())),
        ("cu_seqlens_q must be 1-D", ValueError, lambda: call_varlen(q, k, v, cu[None])),
        ("cu_seqlens_q must be 1-D", ValueError, lambda: call_varlen(q, k, v, cu[:0])),
        ("cu_seqlens_q must be on the same device", ValueError, lambda: call_varlen(q, k, v, cu.to("meta"))),
        ("cu_seqlens_q must start at 0", ValueError,
         lambda: call_varlen(q, k, v, torch.tensor([1, 20, 21, 21, T], dtype=torch.int32))),
        ("cu_seqlens_q must end at the total number of tokens", ValueError,
         lambda: call_varlen(q, k, v, torch.tensor([0, 20, 21, 21, T - 1], dtype=torch.int32))),
        ("cu_seqlens_q must be non-decreasing", ValueError,
         lambda: call_varlen(q, k, v, torch.tensor([0, 20, 10, 21, T], dtype=torch.int32))),
        ("cu_seqlens_k must equal cu_seqlens_q.*self-attention", ValueError,
         lambda: call_varlen(q, k, v, cu, cu_k=torch.tensor([0, 10, 21, 21, T], dtype=torch.int32))),
        ("cu_seqlens_k must equal cu_seqlens_q.*self-attention", ValueError,
         lambda: call_varlen(q, k, v, cu, cu_k=torch.tensor([0, T], dtype=torch.int32))),
        ("max_seqlen_q \\(19\\) is smaller than the longest document \\(20\\)", ValueError,
         lambda: call_varlen(q, k, v, cu, max_q=19, max_k=20)),
        ("max_seqlen_k", ValueError, lambda: call_varlen(q, k, v, cu, max_q=20, max_k=5)),
        ("max_seqlen_q must be an int", TypeError, lambda: call_varlen(q, k, v, cu, max_q=20.0)),
        ("max_seqlen_k must be >= 0", ValueError, lambda: call_varlen(q, k, v, cu, max_k=-1)),
        ("deterministic", TypeError, lambda: call_varlen(q, k, v, cu, deterministic=1)),
        ("check_finite", TypeError, lambda: call_varlen(q, k, v, cu, check_finite="no")),
    ]


@pytest.mark.parametrize("case", range(len(_bad_varlen_cases())))
def test_varlen_bad_inputs(case):
    needle, exc, fn = _bad_varlen_cases()[case]
    with pytest.raises(exc, match=needle):
        fn()


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_inputs_raise_by_default(name, value):
    q, k, v, cu = packed()
    x = dict(q=q, k=k, v=v)
    x[name][25, 1, 7] = value
    with pytest.raises(ValueError, match=f"{name} contains NaN or Inf.*check_finite=False"):
        call_varlen(x["q"], x["k"], x["v"], cu)
    qd, kd, vd = dense()
    xd = dict(q=qd, k=kd, v=vd)
    xd[name][1, 3, 0, 0] = value
    with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
        flamia_attn_func(xd["q"], xd["k"], xd["v"])


@pytest.mark.nonfinite
def test_nonfinite_check_can_be_turned_off(monkeypatch):
    q, k, v, cu = packed()
    q[25, 1, 7] = float("nan")
    out = call_varlen(q, k, v, cu, check_finite=False)
    assert torch.isnan(out).any()
    monkeypatch.setenv("FLAMIA_CHECK_FINITE", "0")
    out_env = call_varlen(q, k, v, cu)
    assert torch.equal(out.isnan(), out_env.isnan())


# ---------------------------------------------------------------------------------------------
# Layouts, options, recipes.

@pytest.mark.parametrize("recipe", ["fp8", "bf16", "mxfp8"])
def test_dense_equals_varlen(recipe):
    qd, kd, vd = dense(b=2, s=24)
    B, S, Hq, D = qd.shape
    xs_d = [x.clone().requires_grad_() for x in (qd, kd, vd)]
    out_d, lse_d = flamia_attn_func(*xs_d, recipe=recipe, return_lse=True, deterministic=True)
    do = torch.randn(out_d.shape, generator=torch.Generator().manual_seed(1)).to(BF16)
    g_d = torch.autograd.grad(out_d, xs_d, do)

    xs_v = [x.reshape(B * S, *x.shape[2:]).clone().requires_grad_() for x in (qd, kd, vd)]
    cu = cu_seqlens_from_lengths([S] * B)
    out_v, lse_v = flamia_attn_varlen_func(*xs_v, cu, cu, S, S, recipe=recipe, return_lse=True,
                                           deterministic=True)
    g_v = torch.autograd.grad(out_v, xs_v, do.reshape(B * S, Hq, D))
    assert out_d.shape == (B, S, Hq, D) and lse_d.shape == (B, Hq, S)
    assert torch.equal(out_d.reshape(B * S, Hq, D), out_v)
    assert torch.equal(lse_d, lse_v.reshape(Hq, B, S).transpose(0, 1))
    for a, b in zip(g_d, g_v):
        assert torch.equal(a.reshape(b.shape), b)


def test_return_lse_shapes_and_values():
    q, k, v, cu = packed()
    out, lse = call_varlen(q, k, v, cu, return_lse=True)
    assert out.dtype == BF16 and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0])
    assert torch.equal(out, call_varlen(q, k, v, cu))
    # bf16 recipe: lse close to the exact logsumexp of the softmax-scaled scores.
    _, lse16 = call_varlen(q, k, v, cu, return_lse=True, recipe="bf16")
    qh, kh = q.double().transpose(0, 1), k.double().repeat_interleave(2, 1).transpose(0, 1)
    s = qh[:, :20] @ kh[:, :20].transpose(1, 2) * 64 ** -0.5
    s = s.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse16[:, :20].double(), torch.logsumexp(s, -1), rtol=0, atol=2e-2)


def test_recipe_objects():
    q, k, v, cu = packed()
    by_name = call_varlen(q, k, v, cu, recipe="fp8")
    assert torch.equal(by_name, call_varlen(q, k, v, cu, recipe=flamia.RECIPES["fp8"]))
    assert torch.equal(by_name, call_varlen(q, k, v, cu, recipe=flamia.get_recipe("fp8")))
    custom = flamia.get_recipe("fp8").with_(name="fp8_norot", rotate_qk=False)
    out = call_varlen(q, k, v, cu, recipe=custom)
    assert not torch.equal(out, by_name)
    # A custom recipe under a built-in name never reaches the kernels (they implement the built-in).
    assert backend(q, flamia.get_recipe("fp8").with_(rotate_qk=False)) == "reference"
    assert backend(q, "mxfp8") == "reference" and backend(q, "fp8_tensorwise") == "reference"


def test_gqa_equals_repeated_heads():
    q, k, v, cu = packed(hq=4, hkv=2)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = call_varlen(*xs, cu, recipe="bf16")
    krep, vrep = (x.detach().repeat_interleave(2, 1).requires_grad_() for x in (k, v))
    q2 = q.clone().requires_grad_()
    out_rep = call_varlen(q2, krep, vrep, cu, recipe="bf16")
    torch.testing.assert_close(out, out_rep, rtol=0, atol=0)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(BF16)
    g = torch.autograd.grad(out, xs, do)
    g_rep = torch.autograd.grad(out_rep, (q2, krep, vrep), do)
    torch.testing.assert_close(g[0], g_rep[0], rtol=0, atol=0)
    for a, b in zip(g[1:], g_rep[1:]):      # dK of a kv head: the sum over its query heads
        torch.testing.assert_close(a.float(), b.float().reshape(b.shape[0], 2, 2, -1).sum(2),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_autograd_against_float64(dtype, causal):
    q, k, v, cu = packed(dtype=dtype)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = call_varlen(*xs, cu, recipe="bf16", causal=causal)
    assert out.dtype == dtype
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    grads = torch.autograd.grad(out, xs, do)
    x64 = [x.double().requires_grad_() for x in (q, k, v)]
    o64 = attention_exact(*x64, cu, causal=causal)
    g64 = torch.autograd.grad(o64, x64, do.double())
    assert rel_err(out, o64) < 1e-2
    for g, r, x in zip(grads, g64, xs):
        assert g.dtype == dtype and g.shape == x.shape
        assert rel_err(g, r) < 2e-2


def test_fp16_fp8_recipe_runs():
    q, k, v, cu = packed(dtype=torch.float16, family="outliers")
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = call_varlen(*xs, cu, recipe="fp8")
    out.float().sum().backward()
    assert out.dtype == torch.float16
    assert all(torch.isfinite(x.grad).all() and x.grad.dtype == torch.float16 for x in xs)


def test_softmax_scale_is_used():
    q, k, v, cu = packed()
    out = call_varlen(q, k, v, cu, recipe="bf16", softmax_scale=0.3)
    ref = attention_exact(q, k, v, cu, softmax_scale=0.3)
    assert rel_err(out, ref) < 1e-2
    assert rel_err(call_varlen(q, k, v, cu, recipe="bf16"), ref) > 5e-2


def test_head_dim_256_on_cpu():
    q, k, v, cu = packed(d=256, lengths=(9, 4))
    out = call_varlen(q, k, v, cu, recipe="fp8", max_q=9, max_k=9)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("lengths", [(), (0,), (0, 0, 0)])
def test_empty_total(lengths):
    q, k, v, cu = packed(lengths=lengths)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = call_varlen(*xs, cu, max_q=0, max_k=0, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0) and lse.dtype == torch.float32
    out.sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in xs)
    for b, s in ((0, 8), (2, 0)):
        qd = torch.zeros(b, s, 4, 64, dtype=BF16)
        kd = torch.zeros(b, s, 2, 64, dtype=BF16)
        out, lse = flamia_attn_func(qd, kd, kd, return_lse=True)
        assert out.shape == qd.shape and lse.shape == (b, 4, s)


def test_non_contiguous_inputs():
    q, k, v, cu = packed()
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)      # same values, other strides
    assert not qt.is_contiguous()
    assert torch.equal(call_varlen(qt, k, v, cu), call_varlen(q, k, v, cu))


def test_module_and_exports():
    assert flamia.__version__
    for name in ("flamia_attn_func", "flamia_attn_varlen_func", "Recipe", "RECIPES", "get_recipe", "audit"):
        assert hasattr(flamia, name)
    assert callable(flamia.audit) and callable(flamia.audit.recipe_fn)
    q, k, v, cu = packed()
    mod = flamia.FlamiaAttention(recipe="fp8")
    assert torch.equal(mod(q, k, v, cu, 20), call_varlen(q, k, v, cu))
    qd, kd, vd = dense()
    assert torch.equal(mod(qd, kd, vd), flamia_attn_func(qd, kd, vd))
    assert "fp8" in repr(mod)


def test_kernel_path_keeps_no_forward_only_copy():
    """What waits for the backward (P3's quantized operands) holds no vt8: the forward's K-major
    V copy is the forward's alone (the backward reads v8), and the backward runs without it."""
    q, k, v, cu = packed(lengths=(33, 0, 17), hq=4, hkv=2, d=64)
    if backend(q, "fp8") != "kernels":
        pytest.skip("kernels not available")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = call_varlen(q, k, v, cu, max_q=33, recipe="fp8", check_finite=False)
    saved = out.grad_fn.qkv
    assert saved.vt8 is None and saved.v8 is not None
    out.float().square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_lse_output_needs_no_gradient():
    """return_lse=True: lse is not differentiable, and a loss of out alone gives the same
    gradients as without lse (autograd does not materialize a zero gradient for it)."""
    q, k, v, cu = packed(lengths=(9, 4), hq=2, hkv=1, d=64)
    grads = []
    for want_lse in (False, True):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        res = call_varlen(*x, cu, max_q=9, recipe="fp8", return_lse=want_lse)
        out = res[0] if want_lse else res
        if want_lse:
            assert not res[1].requires_grad
        out.float().sum().backward()
        grads.append([t.grad for t in x])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# FlamiaAttention checks its arguments when built, not at the first forward
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(recipe="nope"), ValueError, "recipe must be one of"),
    (dict(recipe=3), TypeError, "recipe"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(deterministic=None), TypeError, "deterministic must be a bool"),
    (dict(check_finite=0), TypeError, "check_finite must be a bool"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale"),
])
def test_flamia_attention_validates_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        flamia.FlamiaAttention(**kwargs)


def test_flamia_attention_accepts_good_arguments():
    m = flamia.FlamiaAttention(recipe=flamia.get_recipe("fp8_mixed"), causal=False,
                               softmax_scale=0.1)
    assert "fp8_mixed" in repr(m)


@pytest.mark.parametrize("causal", [True, False])
def test_fp8_kernel_path(causal):
    """fp8 through the kernel path: the quantize and forward kernels (here in the
    interpreter), then the backward (on sm_90 the one-pass kernel; here the reference backward on
    the kernel forward's operands: ops.config.ReferenceBwdConfig). Out and gradients against the
    reference emulation by the FlashAttention rule with float64 truth; what the forward hands to
    the backward holds the row max and none of the forward-only copies."""
    from flamia import reference as R
    lengths = (150, 0, 1, 2, 40)
    q, k, v, cu = packed(lengths=lengths, hq=4, hkv=2, d=64, family="outliers", seed=4)
    if backend(q, "fp8") != "kernels":
        pytest.skip("kernels not available")
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = call_varlen(*xs, cu, max_q=150, recipe="fp8", causal=causal, deterministic=True)
    saved = out.grad_fn.qkv
    assert saved.row_max is not None and saved.vt8 is None and saved.vt8_diag is None
    assert (saved.k8_diag is not None) == causal
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(BF16)
    grads = torch.autograd.grad(out, xs, do)
    out_r, lse_r, sv = R.forward(q, k, v, cu, "fp8", causal)
    emu = R.backward(do, out_r.to(BF16), lse_r, sv, cu, "fp8", causal)
    x64 = [x.double().requires_grad_() for x in (q, k, v)]
    o64 = attention_exact(*x64, cu, causal=causal)
    g64 = torch.autograd.grad(o64, x64, do.double())
    for name, g, e, r in ((("out", out.detach(), out_r, o64.detach()),)
                          + tuple(zip(("dq", "dk", "dv"), grads, emu, g64))):
        err = (g.double() - r).abs().max().item()
        err_emu = (e.to(BF16).double() - r).abs().max().item()
        assert torch.isfinite(g).all() and g.dtype == BF16, name
        assert err <= 2 * err_emu + 2e-3 * g64[2].abs().max().item(), (name, err, err_emu)
