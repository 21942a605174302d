"""The fp8 recipe's token-block scaling on the H200: quantize_qkv, the Triton forward and the
persistent Gluon forward (skipped without CUDA).

    python -m pytest -q tests/gpu/test_forward_kvblock_gpu.py

Same checks as tests/test_forward_kvblock.py at larger shapes: quantized operands equal the
reference's (bitwise up to the rotation's rounding ties), out / lse / row_max match
reference.forward(recipe="fp8") by the FlashAttention rule against float64, every output
written (NaN poison), P1 / P2 bitwise for both kernels, the Gluon and Triton kernels agree, and
a small fuzz over random document splits.
"""
from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from flamia import reference as R  # noqa: E402
from flamia.inputs import make_qkv, rel_err  # noqa: E402
from flamia.ops.config import (  # noqa: E402
    PAIR_FWD_CONFIG, FwdConfig, PersistentFwdConfig, triton_forward_config)
from flamia.ops.forward import attention_forward  # noqa: E402
from flamia.ops.gluon_common import HAVE_GLUON  # noqa: E402
from flamia.ops.kmajor import kmajor_layout, mma_order16_host  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402

DEV = "cuda"
HQ, HKV = 8, 2
DOCS = (1000, 3000, 128, 1)
ODD = (1000, 0, 3000, 1, 2, 128, 129, 77, 1)     # empty, 1- and 2-token, unaligned starts


def _gluon_ok():
    return HAVE_GLUON and torch.cuda.get_device_capability() == (9, 0)


def _run(kernel, q, k, v, cu, causal, cfg=None):
    """(out, lse, row_max) of one kernel ("triton", "gluon" or "gluon_pair": the Gluon kernel
    on GQA pairs), outputs poisoned first."""
    L = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    D = q.shape[2]
    if kernel.startswith("gluon"):
        x = quantize_qkv(q, k, v, cu, "fp8", causal, poison=True)
        default = PAIR_FWD_CONFIG if kernel == "gluon_pair" else PersistentFwdConfig()
        return attention_forward(x, cu, L, causal, None, q.dtype, config=cfg or default,
                                 poison=True, return_row_max=True)
    x = quantize_qkv(q, k, v, cu, "fp8", causal, poison=True)
    return attention_forward(x, cu, L, causal, None, q.dtype,
                             config=cfg or triton_forward_config(D, True, torch.device(DEV)),
                             poison=True, return_row_max=True)


KERNELS = ["triton"] + [pytest.param(k, marks=pytest.mark.skipif(
    not _gluon_ok(), reason="needs Gluon and sm_90")) for k in ("gluon", "gluon_pair")]


def _row_max_exact(q, k, cu, causal):
    out = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64, device=q.device)
    g = q.shape[1] // k.shape[1]
    for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        if b > a:
            s = torch.einsum("ihd,jhd->hij", q[a:b].double(),
                             k[a:b].double().repeat_interleave(g, 1))
            if causal:
                s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device)
                                  .triu(1), -float("inf"))
            out[:, a:b] = s.amax(-1) * q.shape[2] ** -0.5
    return out


def _references(q, k, v, cu, causal):
    """(emulation out as the user gets it, its lse and row max, and the float64 out, lse and
    row max of the unquantized inputs)."""
    out, lse, saved = R.forward(q, k, v, cu, "fp8", causal)
    return ((out.to(q.dtype).double(), lse.float(), saved.row_max.float()),
            (R.attention_exact(q, k, v, cu, causal), R.lse_exact(q, k, cu, causal),
             _row_max_exact(q, k, cu, causal)))


def _fa_rule(got, emul, exact, name, out_eps=0.0):
    """|got - exact| <= 2 |emul - exact| + atol elementwise, for all but 1e-5 of the elements,
    and the max error within twice the emulation's (tests/gpu/test_forward_gpu.py's rule:
    out_eps for results rounded to bf16, 4 fp32 ulps of |exact| for fp32 ones: the FP8 wgmma
    sums q8 . k8 with fewer bits than the emulation's fp32)."""
    err, err_ref = (got.double() - exact).abs(), (emul.double() - exact).abs()
    assert err.max() <= 2 * err_ref.max() + 1e-5, (name, err.max().item(), err_ref.max().item())
    atol = (4 * err_ref.pow(2).mean().sqrt().item() + 1e-5 + 1.5 * out_eps * exact.abs()
            + 4 * 2.0 ** -23 * exact.abs())
    frac = (err > 2 * err_ref + atol).double().mean().item()
    assert frac <= 1e-5, (name, frac)


def _check(got, refs):
    (out, lse, rm), ((emul, emul_lse, emul_rm), (exact, exact_lse, exact_rm)) = got, refs
    assert not out.isnan().any() and not lse.isnan().any() and not rm.isnan().any(), \
        "unwritten (NaN-poisoned) output"
    _fa_rule(out, emul, exact, "out", torch.finfo(out.dtype).eps)
    r, r_ref = rel_err(out, exact), rel_err(emul, exact)
    assert r <= 1.1 * r_ref + 1e-4, (r, r_ref)
    _fa_rule(lse, emul_lse, exact_lse, "lse")
    _fa_rule(rm, emul_rm, exact_rm, "row_max")
    return r, r_ref


# ------------------------------------------------------------------------------------------ quantize

@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_quantize_matches_reference(D, causal):
    q, k, v, cu = make_qkv(ODD, HQ, HKV, D, "outliers", device=DEV, seed=D)
    T = q.shape[0]
    x = quantize_qkv(q, k, v, cu, "fp8", causal, poison=True)
    H = R.hadamard(D, torch.float32, DEV)
    qc, kc = q.float() @ H, k.float() @ H
    qo = R.quantize_operand(qc, "e4m3", "token")
    kb = R.quantize_token_blocks(kc, "e4m3", cu, R.KV_BLOCK)
    vb = R.quantize_token_blocks(v.float(), "e4m3", cu, R.KV_BLOCK)
    # q, k: the rotation's fp32 summation order may move a value on an e4m3 rounding tie
    assert (x.q8.float() != qo.values).sum().item() <= x.q8.numel() // 10000
    assert (x.sq.t() != qo.scale[..., 0]).sum().item() <= x.sq.numel() // 10000
    assert (x.k8.float() != kb.values).sum().item() <= x.k8.numel() // 10000
    assert (x.sk.t() != kb.scale[..., 0]).sum().item() <= x.sk.numel() // 10000
    assert torch.equal(x.v8.float(), vb.values) and torch.equal(x.sv.t(), vb.scale[..., 0])
    if causal:   # the per-token copies: per-token scales, as q's
        kt = R.quantize_operand(kc, "e4m3", "token")
        vt = R.quantize_operand(v.float(), "e4m3", "token")
        assert (x.k8_diag.float() != kt.values).sum().item() <= x.k8_diag.numel() // 10000
        assert (x.sk_diag.t() != kt.scale[..., 0]).sum().item() <= x.sk_diag.numel() // 10000
        assert torch.equal(x.v8_diag.float(), vt.values)
        assert torch.equal(x.sv_diag.t(), vt.scale[..., 0])
        svt = x.sv_diag.t()
        vnt = (x.v8_diag.float() * x.sv_diag.t()[..., None]).norm(dim=-1)
    else:
        assert x.k8_diag is None
        svt = x.sv.t()
    vmax = lambda o, d: R._per_document(cu, lambda a, b: R._visible_max(a, b, causal), o, d)  # noqa: E731
    assert torch.equal(x.vcap.t(), vmax(x.sv.t(), svt))
    vnb = (x.v8.float() * x.sv.t()[..., None]).norm(dim=-1)
    torch.testing.assert_close(x.vnorm.t(), vmax(vnb, vnt if causal else vnb), rtol=2e-6, atol=0)
    pcu, tok_of_col, Tp = kmajor_layout(cu, T)
    assert torch.equal(x.kv_pcu, pcu)
    tok = tok_of_col[mma_order16_host(torch.arange(Tp, device=DEV))].long()
    ok = tok >= 0
    for vt8, v8 in [(x.vt8, x.v8)] + ([(x.vt8_diag, x.v8_diag)] if causal else []):
        b = vt8.view(torch.uint8)
        assert torch.equal(b[:, :, ok], v8.view(torch.uint8)[tok[ok]].permute(1, 2, 0))
        assert (b[:, :, ~ok] == 0).all()
    plain = tok_of_col.long()
    for i, s in enumerate([x.sk, x.sv] + ([x.sk_diag, x.sv_diag] if causal else [])):
        assert torch.equal(x.scale_cols[i][:, plain >= 0], s[:, plain[plain >= 0]])
        assert (x.scale_cols[i][:, plain < 0] == 0).all()


# ------------------------------------------------------------------------------------------ forward

@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("family", ["mild", "outliers"])
def test_forward_matches_reference(kernel, D, causal, family):
    q, k, v, cu = make_qkv(DOCS, HQ, HKV, D, family, device=DEV, seed=1)
    refs = _references(q, k, v, cu, causal)
    r, r_ref = _check(_run(kernel, q, k, v, cu, causal), refs)
    print(f"{kernel} D={D} causal={causal} {family}: rel err {r:.4e} (reference {r_ref:.4e})")


@pytest.mark.parametrize("kernel", KERNELS)
def test_forward_odd_documents_and_tiles(kernel):
    """Empty, 1- and 2-token documents at unaligned starts; for the Triton kernel also other
    tiles (128 x 64, 32 x 32 by pointer loads)."""
    q, k, v, cu = make_qkv(ODD, HQ, HKV, 128, "outliers", device=DEV, seed=2)
    refs = _references(q, k, v, cu, True)
    _check(_run(kernel, q, k, v, cu, True), refs)
    if kernel == "triton":
        for cfg in (FwdConfig(128, 64, 8, 2), FwdConfig(32, 32, 4, 2, use_tma=False)):
            _check(_run(kernel, q, k, v, cu, True, cfg=cfg), refs)


@pytest.mark.skipif(not _gluon_ok(), reason="needs Gluon and sm_90")
@pytest.mark.parametrize("causal", [True, False])
def test_gluon_agrees_with_triton(causal):
    """The two kernels on the same quantized values (V^T in each one's column order): LSE and
    the row max within fp32 rounding of the same scores, O within bf16 rounding noise."""
    q, k, v, cu = make_qkv(ODD, HQ, HKV, 128, "mild", device=DEV, seed=3)
    g = _run("gluon", q, k, v, cu, causal)
    t = _run("triton", q, k, v, cu, causal)
    assert rel_err(g[0], t[0]) <= 5e-3
    assert (g[1] - t[1]).abs().max().item() <= 1e-3 and (g[2] - t[2]).abs().max().item() <= 1e-3


@pytest.mark.skipif(not _gluon_ok(), reason="needs Gluon and sm_90")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_gluon_pair_bitwise_the_one_head_kernel(causal, hkv):
    """The GQA pair computes each head's rows as the one-head kernel does (same tiles, order
    and masks): out, lse and row max bitwise equal, over empty, tiny and unaligned documents and
    one long enough for the default path to take the pair (config.PAIR_FWD_MIN_SEQLEN), for
    groups 8, 4, 2; an odd group is refused by name."""
    q, k, v, cu = make_qkv(ODD + (4500, 3), HQ, hkv, 128, "outliers", device=DEV, seed=20 + hkv)
    one = _run("gluon", q, k, v, cu, causal)
    pair = _run("gluon_pair", q, k, v, cu, causal)
    for a, b in zip(one, pair):
        assert torch.equal(a, b)
    x = quantize_qkv(q, k, v, cu, "fp8", causal)
    default = attention_forward(x, cu, 4500, causal, None, q.dtype, return_row_max=True)
    for a, b in zip(one, default):
        assert torch.equal(a, b)
    q3, k3, v3, cu3 = make_qkv((300,), 6, 2, 128, device=DEV, seed=3)
    x3 = quantize_qkv(q3, k3, v3, cu3, "fp8", causal)
    with pytest.raises(ValueError, match="heads_per_cta"):
        attention_forward(x3, cu3, 300, causal, None, q.dtype, config=PAIR_FWD_CONFIG)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False])
def test_tile_scales_at_the_extremes(kernel, causal):
    """The unmasked tiles fold the block scales into per-row constants: a V block 2^-133 times
    the next one's (the exponent floor at -90: A is 0 there and p' sv would flush to 0 in the
    sum), an all-zero V block (sv = 0), and with the checks off a NaN in a V block, which makes
    the rows that see it NaN and leaves the other document bitwise unchanged (CPU twin:
    tests/test_forward_kvblock.py)."""
    D = 128 if kernel.startswith("gluon") else 64
    q, k, v, cu = make_qkv((600, 520), HQ, HKV, D, "mild", device=DEV, seed=11)
    v[0:256] = (v[0:256].float() * 1e-33).to(v.dtype)
    v[256:384] = (v[256:384].float() * 1e7).to(v.dtype)
    v[600:728] = 0
    got = _run(kernel, q, k, v, cu, causal)
    out = got[0]
    assert not out.isnan().any()
    (emul, emul_lse, _), (exact, exact_lse, _) = _references(q, k, v, cu, causal)
    err, err_ref = (out.double() - exact).abs(), (emul - exact).abs()
    assert err.max() <= 2 * err_ref.max() + 1e-5, (err.max().item(), err_ref.max().item())
    assert rel_err(out, exact) <= 1.1 * rel_err(emul, exact) + 1e-4
    _fa_rule(got[1], emul_lse, exact_lse, "lse")
    bad = v.clone()
    bad[5, 1, 3] = float("nan")
    nan_out = _run(kernel, q, k, bad, cu, causal)[0]
    assert torch.equal(nan_out[600:], out[600:])
    g = HQ // HKV
    seen = nan_out[128:600, g:2 * g] if causal else nan_out[:600, g:2 * g]
    assert seen.isnan().all()


def test_fuzz_document_splits():
    """Random splits of ~2500 tokens (empty, 1-token and block-sized documents likely), random
    causal / kernel / D: the FlashAttention rule against the reference every time."""
    rng = random.Random(0)
    for case in range(8):
        lengths = []
        while sum(lengths) < 2500:
            lengths.append(rng.choice([0, 1, 2, 127, 128, 129, rng.randrange(1, 700)]))
        causal = rng.random() < 0.7
        D = rng.choice([64, 128])
        hkv = rng.choice([1, 2, 4])
        kernel = "triton"
        if _gluon_ok() and D == 128 and rng.random() < 0.7:
            kernel = "gluon_pair" if (4 // hkv) % 2 == 0 and rng.random() < 0.5 else "gluon"
        q, k, v, cu = make_qkv(lengths, 4, hkv, D, rng.choice(["mild", "outliers"]),
                               device=DEV, seed=100 + case)
        _check(_run(kernel, q, k, v, cu, causal), _references(q, k, v, cu, causal))


# ------------------------------------------------------------------------------------------ P1 / P2

def _fresh(x, seed):
    g = torch.Generator(device=x.device).manual_seed(seed)
    return (torch.randn(x.shape, generator=g, device=x.device) * 16).to(x.dtype)


def _perturbed(xs, where, seed):
    return [torch.where(where[:, None, None], _fresh(x, seed + i), x) for i, x in enumerate(xs)]


@pytest.mark.parametrize("kernel", KERNELS)
def test_p1_prefix_invariance_bitwise(kernel):
    """q, k, v perturbed after t: out, lse and row_max at <= t bitwise unchanged, for t inside a
    block, at a block's last and next-first token, in a 2-token and in a 129-token document."""
    q, k, v, cu = make_qkv(ODD, HQ, HKV, 128, "outliers", device=DEV, seed=4)
    c = cu.tolist()
    base = _run(kernel, q, k, v, cu, True)
    pos = torch.arange(q.shape[0], device=DEV)
    for n, t in enumerate((c[0] + 500, c[2] + 1023, c[2] + 1024, c[4], c[6] + 128, c[7] + 40)):
        pert = _run(kernel, *_perturbed((q, k, v), pos > t, 10 * n), cu, True)
        assert torch.equal(base[0][:t + 1], pert[0][:t + 1]), (kernel, t)
        for a, b in zip(base[1:], pert[1:]):
            assert torch.equal(a[:, :t + 1], b[:, :t + 1]), (kernel, t)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False])
def test_p2_document_isolation_bitwise(kernel, causal):
    q, k, v, cu = make_qkv(ODD, HQ, HKV, 128, "outliers", device=DEV, seed=5)
    c = cu.tolist()
    base = _run(kernel, q, k, v, cu, causal)
    for doc in (2, 3, 6):
        inside = torch.zeros(q.shape[0], dtype=torch.bool, device=DEV)
        inside[c[doc]:c[doc + 1]] = True
        pert = _run(kernel, *_perturbed((q, k, v), inside, 50 + doc), cu, causal)
        other = ~inside
        assert torch.equal(base[0][other], pert[0][other]), (kernel, doc)
        for a, b in zip(base[1:], pert[1:]):
            assert torch.equal(a[:, other], b[:, other]), (kernel, doc)


def test_empty_input():
    q, k, v, cu = make_qkv((0,), HQ, HKV, 128, device=DEV)
    out, lse, rm = _run("triton", q, k, v, cu, True)
    assert out.shape == (0, HQ, 128) and lse.shape == (HQ, 0) and rm.shape == (HQ, 0)
