"""Quantize + forward kernels (recipes bf16 and fp8) on the H200 at realistic sizes (skipped
without CUDA).

    python -m pytest -q tests/gpu/test_forward_gpu.py

The checks of tests/test_ops_forward.py: fp8's quantized operands equal the reference's (up to
the rotation's rounding ties), forward out / lse match the reference emulation by the
FlashAttention rule, every output written (NaN poison), P1 / P2 bitwise through flamia.audit,
and the persistent Gluon forward is the default at D=128. The float64 references run per KV-head
group (the heads are independent) so an 8k-token document fits in memory. fp8's K-major copies,
vcap, vnorm and row max, and the Gluon kernel against the Triton one:
tests/gpu/test_forward_kvblock_gpu.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from flamia import reference as R  # noqa: E402
from flamia.inputs import make_qkv, rel_err  # noqa: E402
from flamia.ops.config import FwdConfig, triton_forward_config  # noqa: E402
from flamia.ops.forward import attention_forward  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402

DEV = "cuda"
HQ, HKV = 32, 8


def _longtail_8k():
    """The `longtail` workload's document lengths scaled to ~8k tokens, plus an empty and a
    length-1 document."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "flamia", "data", "workloads.json")
    with open(path) as f:
        wl = {w["name"]: w for w in json.load(f)["workloads"]}
    lengths = [max(1, round(n / 4)) for n in wl["longtail"]["doc_lengths"]]
    return tuple(lengths[:5]) + (0, 1) + tuple(lengths[5:])


WORKLOADS = {"doc8k": (8192,), "longtail8k": _longtail_8k()}
CONFIGS = {     # the same shapes as benchmarks/fwd_dev.py sweeps (shares triton's compile cache)
    "default": None,
    "128x128": FwdConfig(128, 128, 8, 2),
    "64x64r168": FwdConfig(64, 64, 4, 2, maxnreg=168),
    "ptr": FwdConfig(64, 128, 4, 2, use_tma=False),
}


def _references(q, k, v, cu, recipe, causal=True):
    """(emulation out as the user gets it (bf16 -> f64), emulation lse, (exact f64 out, exact
    f64 lse)), computed one KV-head group at a time."""
    G = q.shape[1] // k.shape[1]
    outs, lses, exact, exact_lse = [], [], [], []
    for g in range(k.shape[1]):
        qs, ks, vs = q[:, g * G:(g + 1) * G], k[:, g:g + 1], v[:, g:g + 1]
        o, l, _ = R.forward(qs, ks, vs, cu, recipe, causal)
        outs.append(o.to(q.dtype).double())
        lses.append(l.float())
        exact.append(R.attention_exact(qs, ks, vs, cu, causal))
        exact_lse.append(R.lse_exact(qs, ks, cu, causal))
        del o, l
        torch.cuda.empty_cache()
    return torch.cat(outs, 1), torch.cat(lses, 0), (torch.cat(exact, 1), torch.cat(exact_lse, 0))


def _fa_rule(got, emul, exact, name, out_eps=0.0, fp32_ulps=0):
    """The FlashAttention rule, elementwise: |got - exact| <= 2 |emul - exact| + atol, with the
    max error bounded by twice the emulation's and at most 1e-5 of the elements outside.

    out_eps: relative spacing of the output dtype when both got and emul were rounded to it
    (bf16: 2^-7). Rounding moves each by at most half a spacing, so the rule on the unrounded
    values allows 1.5 spacings on the rounded ones (where the two fp32 values straddle a
    rounding midpoint, a one-ulp flip is not an error of the kernel).
    fp32_ulps: fp32 spacings of |exact| allowed on top, for fp32 results whose emulation is
    itself only fp32-accurate (the bf16 recipe's LSE: two orders of the same fp32 sums fail the
    rule against each other, benchmarks/lse_order_check.py)."""
    err, err_ref = (got.double() - exact).abs(), (emul.double() - exact).abs()
    assert err.max() <= 2 * err_ref.max() + 1e-5, (name, err.max().item(), err_ref.max().item())
    atol = (4 * err_ref.pow(2).mean().sqrt().item() + 1e-5 + 1.5 * out_eps * exact.abs()
            + fp32_ulps * 2.0 ** -23 * exact.abs())
    frac = (err > 2 * err_ref + atol).double().mean().item()
    assert frac <= 1e-5, (name, frac)


def _check(out, lse, emul, emul_lse, exact):
    exact, exact_lse = exact
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten (NaN-poisoned) output"
    _fa_rule(out, emul, exact, "out", torch.finfo(out.dtype).eps)
    r, r_ref = rel_err(out, exact), rel_err(emul, exact)
    assert r <= 1.1 * r_ref + 1e-4, (r, r_ref)
    # LSE by the same rule as O, against the float64 LSE of the unquantized inputs. Not
    # allclose to the emulation's: the emulation sums q8 . k8 exactly in fp32, Hopper's FP8
    # wgmma with fewer bits (scores off by up to ~3e-4 of their magnitude, 6.6e-2 at |s| = 233
    # on outlier inputs; benchmarks/NOTES.md, the fp8 dot-product check), which no FP8 kernel on this
    # hardware can avoid. What matters for training is that the backward recomputes the very
    # same scores (bitwise, whatever the tile shape, in that check) and that the LSE is as
    # accurate as the emulation's, which this checks.
    ok = torch.isfinite(emul_lse)
    assert torch.equal(torch.isfinite(lse), ok), "LSE finite where the emulation's is not"
    _fa_rule(lse[ok], emul_lse[ok], exact_lse[ok], "lse", fp32_ulps=4)
    return r, r_ref


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("family", ["mild", "outliers"])
def test_quantize_matches_reference(D, family):
    """fp8's operands against the reference's: q per token, k and v per 128-token block (the
    block copies) and per token (the diagonal copies, causal); a rotated value may differ only
    on a rounding tie of the rotation's fp32 sums."""
    q, k, v, cu = make_qkv(WORKLOADS["longtail8k"], HQ, HKV, D, family, device=DEV, seed=D)
    qkv = quantize_qkv(q, k, v, cu, "fp8", True, poison=True)
    H = R.hadamard(D, torch.float32, DEV)
    qc, kc, vc = q.float() @ H, k.float() @ H, v.float()
    token = lambda x: R.quantize_operand(x, "e4m3", "token")                      # noqa: E731
    block = lambda x: R.quantize_token_blocks(x, "e4m3", cu, R.KV_BLOCK)          # noqa: E731
    for name, x8, s, x, xf, op, rot in (
            ("q", qkv.q8, qkv.sq, q, qc, token(qc), True),
            ("k", qkv.k8, qkv.sk, k, kc, block(kc), True),
            ("k_diag", qkv.k8_diag, qkv.sk_diag, k, kc, token(kc), True),
            ("v", qkv.v8, qkv.sv, v, vc, block(vc), False),
            ("v_diag", qkv.v8_diag, qkv.sv_diag, v, vc, token(vc), False)):
        got = x8.float()
        bad = (got != op.values).sum().item()
        if rot:
            # fp32 summation order of the rotation may move a value across an e4m3 rounding
            # boundary by one ulp, and only a tie: both sums of the D products +-x_d are
            # within (D-1) 2^-24 sum|x_d| of the exact one, so the pre-rounding value must lie
            # within 2^-16 sum|x_d| (in units of the scale) of the midpoint of the two results
            # (tokens whose scale differs are covered by the scale check below)
            diff = (got != op.values) & (s.t() == op.scale[..., 0])[..., None]
            y = (xf / op.scale)[diff]
            tol = (2.0 ** -16 * x.float().abs().sum(-1, keepdim=True) / op.scale).expand_as(xf)[diff]
            mid = (got[diff] + op.values[diff]) / 2
            assert ((y - mid).abs() <= tol).all(), (name, "a mismatch that is not a rounding tie")
        # such ties are rare (same bound as tests/test_forward_kvblock.py; H200, outliers, D=128:
        # 402 of 8.4M q/k values)
        assert bad <= (x8.numel() // 10000 if rot else 0), (name, bad)
        sbad = (s.t() != op.scale[..., 0]).sum().item()
        assert sbad <= (s.numel() // 10000 if rot else 0), (name, sbad)


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_forward_matches_reference(workload, D, recipe):
    family = "outliers" if D == 128 else "mild"
    q, k, v, cu = make_qkv(WORKLOADS[workload], HQ, HKV, D, family, device=DEV, seed=1)
    emul, emul_lse, exact = _references(q, k, v, cu, recipe)
    qkv = quantize_qkv(q, k, v, cu, recipe, True, poison=True)
    for name, cfg in CONFIGS.items():
        if recipe == "bf16" and name == "64x64r168":
            continue
        out, lse = attention_forward(qkv, cu, max(WORKLOADS[workload]), True, None, q.dtype,
                                     config=cfg, poison=True)
        r, r_ref = _check(out, lse, emul, emul_lse, exact)
        print(f"{workload} D={D} {recipe} {name}: rel err {r:.4e} (reference {r_ref:.4e})")


def test_forward_non_causal_gqa_scale():
    q, k, v, cu = make_qkv(WORKLOADS["longtail8k"], HQ, HKV, 128, "mild", device=DEV, seed=2)
    for recipe in ("fp8", "bf16"):
        emul, emul_lse, exact = _references(q, k, v, cu, recipe, causal=False)
        qkv = quantize_qkv(q, k, v, cu, recipe, False, poison=True)
        out, lse = attention_forward(qkv, cu, 3133, False, None, q.dtype, poison=True)
        _check(out, lse, emul, emul_lse, exact)


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_prefix_invariance_and_document_isolation(recipe):
    from flamia import audit

    def fn(q, k, v, cu_seqlens, max_seqlen):
        qkv = quantize_qkv(q, k, v, cu_seqlens, recipe, True)
        return attention_forward(qkv, cu_seqlens, max_seqlen, True, None, q.dtype)[0]
    fn.__name__ = f"kernels[{recipe}]"
    for D in (128, 64):
        report = audit.audit(fn, doc_lengths=(1500, 1, 0, 900, 17, 700), heads_q=HQ, heads_kv=HKV,
                             head_dim=D, device=DEV, backward=False, family="outliers")
        assert report.passed, str(report)


def test_default_config_is_what_runs():
    cfg = triton_forward_config(128, True, torch.device(DEV))
    assert cfg.block_m % 16 == 0 and cfg.block_n % 16 == 0


# unaligned, empty and length-1 documents, short ones (1-8 tiles per query block) and two long
# ones (up to 33 tiles: the serial tile loop's steady state)
PERSISTENT_DOCS = (512, 700, 1, 0, 4100, 17, 300, 129, 1000, 64, 2500)


@pytest.mark.parametrize("family", ["mild", "outliers"])
@pytest.mark.parametrize("causal", [True, False])
def test_default_forward_is_persistent_and_correct(family, causal):
    """At D=128 the fp8 forward runs the persistent Gluon kernel by default, on token-ordered
    vt8 (quantize_qkv's default there): bitwise the explicit launch of that kernel, checked
    against the reference emulation and float64 like the Triton kernel, and against the Triton
    kernel on key-ordered operands; D=64 keeps the Triton kernel."""
    from flamia.ops import config as C
    dev = torch.device(DEV)
    if not C.uses_persistent_forward(128, "fp8", dev):
        pytest.skip("no Gluon / not sm_90")
    assert not C.uses_persistent_forward(64, "fp8", dev)
    q, k, v, cu = make_qkv(PERSISTENT_DOCS, HQ, HKV, 128, family, device=DEV, seed=7)
    emul, emul_lse, exact = _references(q, k, v, cu, "fp8", causal)
    L = max(PERSISTENT_DOCS)
    qkv = quantize_qkv(q, k, v, cu, "fp8", causal, poison=True)
    out, lse = attention_forward(qkv, cu, L, causal, None, q.dtype, poison=True)
    _check(out, lse, emul, emul_lse, exact)
    g_o, g_l = attention_forward(qkv, cu, L, causal, None, q.dtype,
                                 config=C.PersistentFwdConfig(), poison=True)
    assert torch.equal(out, g_o) and torch.equal(lse, g_l)
    # the Triton kernel on the same quantized values
    ref_o, ref_l = attention_forward(qkv, cu, L, causal, None, q.dtype,
                                     config=triton_forward_config(128, True, dev), poison=True)
    assert rel_err(out, ref_o) <= 5e-3 and (lse - ref_l).abs().max().item() <= 1e-3


def test_persistent_forward_prefix_invariance_and_isolation():
    """P1 / P2 bitwise through the public API, whose D=128 fp8 path is the persistent kernel."""
    from flamia import audit, flamia_attn_varlen_func

    def fn(q, k, v, cu_seqlens, max_seqlen):
        return flamia_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                       causal=True, recipe="fp8")
    fn.__name__ = "public API fp8, D=128"
    report = audit.audit(fn, doc_lengths=(700, 1, 0, 2900, 17, 300), heads_q=HQ, heads_kv=HKV,
                         head_dim=128, device=DEV, backward=True, family="outliers")
    assert report.passed, str(report)
