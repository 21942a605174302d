"""CPU tests (Triton interpreter) of the fp8 recipe's token-block scaling in the quantize and
forward kernels, against flamia.reference:

- quantize_qkv: q per token and the block copies (k8, v8, sk, sv) bitwise
  reference.quantize_operand / reference.quantize_token_blocks, the token copies (k8_diag,
  v8_diag, sk_diag, sv_diag; causal) bitwise reference.quantize_operand (rotated operands up
  to the rotation's rounding ties); vcap bitwise reference._visible_max, vnorm within fp32
  rounding of it; the K-major copies and scale_cols in kmajor's padded column layout; every
  output written (NaN poison); the launch tiling changes no byte; the reference-only recipes
  are refused.
- attention_forward: out / lse / row_max against reference.forward(recipe="fp8") by the
  FlashAttention rule with the float64 truth (reference.attention_exact), on odd packed
  documents (0-, 1- and 2-token documents, documents of two 128-blocks with unaligned starts),
  D = 64 and 128, GQA, causal and not, several tile shapes.
- P1 (causal prefix invariance) and P2 (document isolation), bitwise on out, lse and row_max.
"""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (tests/conftest.py too)

import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from _sm90 import compile_report  # noqa: E402
from flamia import reference as R  # noqa: E402
from flamia.inputs import cu_seqlens_from_lengths, make_qkv, rel_err  # noqa: E402
from flamia.ops import interpreting  # noqa: E402
from flamia.ops.config import FwdConfig, QuantizeConfig  # noqa: E402
from flamia.ops.forward import attention_forward  # noqa: E402
from flamia.ops.kmajor import kmajor_layout, mma_order16_host  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs the Triton interpreter")

# Documents of two 128-blocks (150 = 128 + 22, 133 = 128 + 5) at starts that are not multiples of
# 16, empty, 1- and 2-token documents.
LENGTHS = (150, 0, 1, 2, 133, 37)
STARTS = cu_seqlens_from_lengths(LENGTHS).tolist()
HQ, HKV = 4, 2
CFG_TMA = FwdConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, use_tma=True)
CFG_PTR = FwdConfig(block_m=16, block_n=32, num_warps=4, num_stages=1, use_tma=False)
CFG_WIDE = FwdConfig(block_m=64, block_n=128, num_warps=4, num_stages=1, use_tma=True)  # GPU's


def _inputs(D, seed=1):
    q, k, v, cu = make_qkv(LENGTHS, HQ, HKV, D, "outliers", seed=seed)
    q[20, 1] = 0                                   # an all-zero query, key and value token
    k[140, 0] = 0
    v[3] = 0
    v[STARTS[3]:STARTS[4]] = 0                     # the 2-token document's V is zero: cap = 0
    return q, k, v, cu


@functools.lru_cache(maxsize=None)
def _case(D, causal):
    """Inputs and their quantize_qkv (poisoned), computed once per (D, causal)."""
    q, k, v, cu = _inputs(D)
    return q, k, v, cu, quantize_qkv(q, k, v, cu, "fp8", causal, poison=True)


def _forward(qkv, cu, causal, cfg):
    return attention_forward(qkv, cu, max(LENGTHS), causal, None, torch.bfloat16, config=cfg,
                             poison=True, return_row_max=True)


def _kernels(q, k, v, cu, causal, cfg):
    return _forward(quantize_qkv(q, k, v, cu, "fp8", causal), cu, causal, cfg)


def _per_doc_visible_max(cu, off, diag, causal):
    return R._per_document(cu, lambda o, d: R._visible_max(o, d, causal), off, diag)


# ------------------------------------------------------------------------------------------ quantize

def _assert_values(got8, ref_vals, rotated, name):
    """fp8 bytes equal the reference's; rotated operands may differ by one e4m3 step on a
    rounding tie of the rotation's fp32 sums (a few per million: tests/test_ops_forward.py)."""
    a, b = got8.float(), ref_vals.float()
    n_bad = int((a != b).sum())
    assert n_bad <= (a.numel() // 10000 if rotated else 0), (name, n_bad)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_quantize_matches_reference(D, causal):
    q, k, v, cu, x = _case(D, causal)
    T = q.shape[0]
    H = R.hadamard(D, torch.float32, q.device)
    qc, kc, vc = q.float() @ H, k.float() @ H, v.float()
    qo = R.quantize_operand(qc, "e4m3", "token")
    kb = R.quantize_token_blocks(kc, "e4m3", cu, R.KV_BLOCK)
    vb = R.quantize_token_blocks(vc, "e4m3", cu, R.KV_BLOCK)
    assert x.recipe == "fp8" and x.rotated and x.kvblock
    for name, x8, s, op, rot in (("q", x.q8, x.sq, qo, True), ("k", x.k8, x.sk, kb, True),
                                 ("v", x.v8, x.sv, vb, False)):
        assert x8.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (x8.shape[1], T)
        _assert_values(x8, op.values, rot, name)
        assert torch.equal(s.t(), op.scale[..., 0]), name
    svb = vb.token_scale()
    if causal:   # the token copies: per-token scales, as q's
        kt = R.quantize_operand(kc, "e4m3", "token")
        vt = R.quantize_operand(vc, "e4m3", "token")
        for name, x8, s, op, rot in (("k_diag", x.k8_diag, x.sk_diag, kt, True),
                                     ("v_diag", x.v8_diag, x.sv_diag, vt, False)):
            assert x8.dtype == torch.float8_e4m3fn and s.shape == (HKV, T), name
            _assert_values(x8, op.values, rot, name)
            assert torch.equal(s.t(), op.scale[..., 0]), name
        svt = vt.token_scale()
        vnt = (x.v8_diag.float() * x.sv_diag.t()[..., None]).norm(dim=-1)
    else:
        assert x.k8_diag is None and x.v8_diag is None and x.sk_diag is None
        assert x.vt8_diag is None
        svt = svb
    assert torch.equal(x.vcap.t(), _per_doc_visible_max(cu, svb, svt, causal))
    # vnorm: the visible max of the 2-norms of the dequantized copies (reference.backward_scales)
    vnb = (x.v8.float() * x.sv.t()[..., None]).norm(dim=-1)
    want = _per_doc_visible_max(cu, vnb, vnt if causal else vnb, causal)
    torch.testing.assert_close(x.vnorm.t(), want, rtol=2e-6, atol=0)
    # the K-major copies and the scales in kmajor's padded column layout, pads zero
    pcu, tok_of_col, Tp = kmajor_layout(cu, T)
    assert torch.equal(x.kv_pcu, pcu)
    cols = torch.arange(Tp)
    tok = tok_of_col[mma_order16_host(cols)].long()
    ok = tok >= 0
    copies = [(x.vt8, x.v8)] + ([(x.vt8_diag, x.v8_diag)] if causal else [])
    for vt8, v8 in copies:
        assert vt8.shape == (HKV, D, Tp)
        b = vt8.view(torch.uint8)
        assert torch.equal(b[:, :, ok], v8.view(torch.uint8)[tok[ok]].permute(1, 2, 0))
        assert (b[:, :, ~ok] == 0).all()
    scales = [x.sk, x.sv] + ([x.sk_diag, x.sv_diag] if causal else [])
    assert x.scale_cols.shape == (len(scales), HKV, Tp)
    plain = tok_of_col.long()
    for i, s in enumerate(scales):
        assert torch.equal(x.scale_cols[i][:, plain >= 0], s[:, plain[plain >= 0]]), i
        assert (x.scale_cols[i][:, plain < 0] == 0).all()


@pytest.mark.parametrize("causal", [True, False])
def test_visible_maxima_long_documents_and_non_finite_v(causal):
    """vcap (bitwise) and vnorm of documents of up to 33 KV blocks (a carry over many blocks,
    more than one of the cols kernel's loads), with a NaN and an Inf V token: NaN reaches the
    visible maxima of the rows that see them, as in the reference, and no other document's."""
    lens = [3000, 1, 0, 2177, 128, 129, 4100]
    cu = cu_seqlens_from_lengths(lens)
    T, H, D = sum(lens), 2, 16
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(T, H, D, generator=g).to(torch.bfloat16) for _ in range(2))
    v = (torch.randn(T, H, D, generator=g) * torch.randn(T, 1, 1, generator=g).mul(3).exp())
    v = v.to(torch.bfloat16)
    v[5000, 1, 3] = float("nan")       # document 3
    v[7000, 0, 0] = float("inf")       # document 6
    x = quantize_qkv(q, k, v, cu, "fp8", causal)
    svb = x.sv.t()
    svt = x.sv_diag.t() if causal else svb
    vnb = (x.v8.float() * svb[..., None]).norm(dim=-1)
    vnt = (x.v8_diag.float() * svt[..., None]).norm(dim=-1) if causal else vnb
    want = _per_doc_visible_max(cu, svb, svt, causal)
    clean = torch.cat([want[:3001], want[5178:5435]])     # the documents with finite V only
    assert want.isnan().any() and not clean.isnan().any()
    assert torch.equal(x.vcap.t().nan_to_num(-1.0), want.nan_to_num(-1.0))
    torch.testing.assert_close(x.vnorm.t(), _per_doc_visible_max(cu, vnb, vnt, causal),
                               rtol=2e-6, atol=0, equal_nan=True)


def test_quantize_tiling_free_and_reference_only_recipes_refused():
    """The launch tiling does not change a byte; the recipes without kernels (fp8_mixed,
    fp8_token: reference only) are refused."""
    q, k, v, cu, x = _case(64, True)
    y = quantize_qkv(q, k, v, cu, "fp8", True,
                     launch=QuantizeConfig(block_t=32, q_warps=8, kv_warps=4, cols_block=128,
                                           cols_warps=8))
    assert y.recipe == "fp8"
    for name in ("q8", "k8", "v8", "k8_diag", "v8_diag", "vt8", "vt8_diag"):
        assert torch.equal(getattr(x, name).view(torch.uint8), getattr(y, name).view(torch.uint8)), name
    for name in ("sq", "sk", "sv", "sk_diag", "sv_diag", "vcap", "vnorm", "scale_cols"):
        assert torch.equal(getattr(x, name), getattr(y, name)), name
    for recipe in ("fp8_mixed", "fp8_token"):
        with pytest.raises(ValueError, match="implements fp8 and bf16"):
            quantize_qkv(q, k, v, cu, recipe, True)


# ------------------------------------------------------------------------------------------ forward

def _row_max_exact(q, k, cu, causal):
    """(Hq, T) float64 row max of the softmax-scaled scores of the unquantized inputs."""
    out = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    g = q.shape[1] // k.shape[1]
    for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        if b > a:
            s = torch.einsum("ihd,jhd->hij", q[a:b].double(), k[a:b].double().repeat_interleave(g, 1))
            if causal:
                s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), -float("inf"))
            out[:, a:b] = s.amax(-1) * q.shape[2] ** -0.5
    return out


def _fa_rule(got, emul, exact, name):
    """|got - exact| <= 2 |emul - exact| + atol elementwise (atol: noise level plus 4 fp32
    ulps of |exact|), and the max error at most twice the emulation's."""
    err, err_ref = (got.double() - exact).abs(), (emul.double() - exact).abs()
    assert err.max() <= 2 * err_ref.max() + 1e-5, (name, err.max().item(), err_ref.max().item())
    atol = 4 * err_ref.pow(2).mean().sqrt().item() + 1e-5 + 4 * 2.0 ** -23 * exact.abs()
    assert (err <= 2 * err_ref + atol).all(), name


def _check_forward(q, k, v, cu, causal, got):
    out, lse, row_max = got
    ref_out, ref_lse, saved = R.forward(q, k, v, cu, "fp8", causal)
    emul = ref_out.to(q.dtype).double()
    exact = R.attention_exact(q, k, v, cu, causal)
    T = q.shape[0]
    assert out.shape == q.shape and lse.shape == (HQ, T) and row_max.shape == (HQ, T)
    assert not out.isnan().any() and not lse.isnan().any() and not row_max.isnan().any()
    err, err_ref = (out.double() - exact).abs(), (emul - exact).abs()
    # the FlashAttention rule (tests/test_ops_forward.py): the kernel rounds P at the running max
    assert err.max() <= 2 * err_ref.max() + 1e-5, (err.max().item(), err_ref.max().item())
    atol = 4 * err_ref.pow(2).mean().sqrt().item() + 1e-5
    assert (err <= 2 * err_ref + atol).all()
    r, r_ref = rel_err(out, exact), rel_err(emul, exact)
    assert r <= 1.1 * r_ref + 1e-4, (r, r_ref)
    # lse and row_max: the FlashAttention rule against float64 too (their fp32 scores differ
    # from the emulation's in summation order only, which at |s| ~ 100 is ~1e-5 relative)
    _fa_rule(lse, ref_lse, R.lse_exact(q, k, cu, causal), "lse")
    _fa_rule(row_max, saved.row_max, _row_max_exact(q, k, cu, causal), "row_max")
    # the 2-token document's V is zero: so is its output
    assert (out[STARTS[3]:STARTS[4]] == 0).all()


@pytest.mark.parametrize("D,causal,cfg", [
    (64, True, CFG_TMA), (64, True, CFG_PTR), (64, True, CFG_WIDE), (128, True, CFG_TMA),
    (64, False, CFG_PTR), (128, False, CFG_TMA), (128, False, CFG_WIDE)],
    ids=["d64-causal-tma32x16", "d64-causal-ptr16x32", "d64-causal-tma64x128",
         "d128-causal-tma32x16", "d64-full-ptr16x32", "d128-full-tma32x16", "d128-full-tma64x128"])
def test_forward_matches_reference(D, causal, cfg):
    q, k, v, cu, x = _case(D, causal)
    _check_forward(q, k, v, cu, causal, _forward(x, cu, causal, cfg))


def test_forward_defaults_and_refusals():
    """Without return_row_max the call returns (out, lse), bitwise the first two results with
    it; tiles that do not divide 128 are refused, and so are operands quantized without the
    token copies (causal=False) in a causal forward."""
    q, k, v, cu, x = _case(64, True)
    got = _forward(x, cu, True, CFG_WIDE)
    two = attention_forward(x, cu, max(LENGTHS), True, None, torch.bfloat16, config=CFG_WIDE)
    assert len(two) == 2 and torch.equal(two[0], got[0]) and torch.equal(two[1], got[1])
    with pytest.raises(ValueError, match="dividing 128"):
        attention_forward(x, cu, max(LENGTHS), True, None, torch.bfloat16,
                          config=dataclasses.replace(CFG_TMA, block_m=256))
    noncausal = quantize_qkv(q, k, v, cu, "fp8", False)
    with pytest.raises(ValueError, match="token copies"):
        attention_forward(noncausal, cu, max(LENGTHS), True, None, torch.bfloat16, config=CFG_TMA)


def test_forward_uses_the_token_copy_on_the_diagonal():
    """Inputs where the two copies differ (a 2^12 times larger key pushes its block's other keys
    into e4m3's subnormals in the block copy): the kernel follows the reference's choice of copy
    per pair, which a forward reading one of the copies everywhere would not."""
    q, k, v, cu = _inputs(64, seed=3)
    k[STARTS[0] + 140] *= 4096
    v[STARTS[4] + 130] *= 4096
    got = _kernels(q, k, v, cu, True, CFG_TMA)
    _check_forward(q, k, v, cu, True, got)


@pytest.mark.parametrize("causal", [True, False])
def test_forward_tile_scales_at_the_extremes(causal):
    """The unmasked tiles fold the block scales into per-row constants (_attn_inner's
    TILE_SCALES): a V block 2^-133 times its neighbour's (the exponent's floor at -90: its A
    are 0, its keys still count in l'), an all-zero V block (sv = 0) and, with the checks off,
    a NaN in a V block: out / lse by the FlashAttention rule where finite, the NaN only in its
    document's rows that see its block, the other document bitwise unchanged."""
    lengths = (300, 260)
    q, k, v, cu = make_qkv(lengths, HQ, HKV, 64, "mild", seed=7)
    v[0:128] = (v[0:128].float() * 1e-33).to(v.dtype)        # block 0 of document 0: tiny
    v[128:256] = (v[128:256].float() * 1e7).to(v.dtype)
    v[300:428] = 0                                            # block 0 of document 1: sv = 0
    out, lse, _ = _kernels(q, k, v, cu, causal, CFG_WIDE)
    ref_out, ref_lse, _ = R.forward(q, k, v, cu, "fp8", causal)
    exact = R.attention_exact(q, k, v, cu, causal)
    assert not out.isnan().any()
    # the FlashAttention rule's global bounds (a missing l' term would be an O(1) error)
    emul = ref_out.to(q.dtype).double()
    err, err_ref = (out.double() - exact).abs(), (emul - exact).abs()
    assert err.max() <= 2 * err_ref.max() + 1e-5, (err.max().item(), err_ref.max().item())
    assert rel_err(out, exact) <= 1.1 * rel_err(emul, exact) + 1e-4
    _fa_rule(lse, ref_lse, R.lse_exact(q, k, cu, causal), "lse")
    bad = v.clone()
    bad[5, 1, 3] = float("nan")
    nan_out = _kernels(q, k, bad, cu, causal, CFG_WIDE)[0]
    assert torch.equal(nan_out[300:], out[300:])
    g = HQ // HKV
    seen = nan_out[128:300, g:2 * g] if causal else nan_out[:300, g:2 * g]   # KV head 1's
    assert seen.isnan().all()


# ------------------------------------------------------------------------------------------ P1 / P2

def _fresh(x, seed):
    return (torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)) * 16).to(x.dtype)


def _perturbed(xs, where, seed):
    return [torch.where(where[:, None, None], _fresh(x, seed + i), x) for i, x in enumerate(xs)]


def test_p1_prefix_invariance_bitwise():
    """Perturb q, k, v after t: out, lse and row_max at <= t bitwise unchanged. One run per
    perturbation; the second perturbs, in each of several documents, the tokens after its own
    t_d only (documents are independent: P2), so one run checks a t per document: inside a first
    block, the last token of a block, the first of the next, a 2-token document."""
    q, k, v, cu = _inputs(64, seed=5)
    cfg = dataclasses.replace(CFG_TMA, block_n=32)
    base = _kernels(q, k, v, cu, True, cfg)
    T = q.shape[0]
    pos = torch.arange(T)
    t = STARTS[0] + 130
    pert = _kernels(*_perturbed((q, k, v), pos > t, 100), cu, True, cfg)
    assert torch.equal(base[0][:t + 1], pert[0][:t + 1])
    for a, b in zip(base[1:], pert[1:]):                 # lse, row_max: (Hq, T)
        assert torch.equal(a[:, :t + 1], b[:, :t + 1])
    ts = {0: STARTS[0] + 127, 3: STARTS[3], 4: STARTS[4] + 128, 5: STARTS[5] + 20}
    after = torch.zeros(T, dtype=torch.bool)
    keep = torch.zeros(T, dtype=torch.bool)
    for d, td in ts.items():
        after[td + 1:STARTS[d + 1]] = True
        keep[STARTS[d]:td + 1] = True
    pert = _kernels(*_perturbed((q, k, v), after, 200), cu, True, CFG_WIDE)
    base = _kernels(q, k, v, cu, True, CFG_WIDE)
    assert torch.equal(base[0][keep], pert[0][keep])
    assert torch.equal(base[1][:, keep], pert[1][:, keep])
    assert torch.equal(base[2][:, keep], pert[2][:, keep])


@pytest.mark.parametrize("causal", [True, False])
def test_p2_document_isolation_bitwise(causal):
    """Perturb two documents (the 150-token one and the 1-token one): every other document's
    out, lse and row_max bitwise unchanged."""
    D = 128 if causal else 64
    q, k, v, cu, x = _case(D, causal)
    base = _forward(x, cu, causal, CFG_WIDE)
    inside = torch.zeros(q.shape[0], dtype=torch.bool)
    inside[STARTS[0]:STARTS[1]] = True
    inside[STARTS[2]:STARTS[3]] = True
    pert = _kernels(*_perturbed((q, k, v), inside, 300), cu, causal, CFG_WIDE)
    other = ~inside
    assert torch.equal(base[0][other], pert[0][other])
    assert torch.equal(base[1][:, other], pert[1][:, other])
    assert torch.equal(base[2][:, other], pert[2][:, other])


# ------------------------------------------------------------------------------------------ sm_90a

_COMPILE_SCRIPT = r"""
import json, torch
from benchmarks.tools.compile import compile_only, cu_seqlens, report
from flamia.inputs import make_qkv
from flamia.ops.config import PersistentFwdConfig, triton_forward_config
from flamia.ops.forward import attention_forward
from flamia.ops import quantize
from flamia.ops.quantize import quantize_qkv
lengths = [1000, 3000, 128, 1]
cu = cu_seqlens(lengths)
out = []
for D, causal in ((128, True), (128, False), (64, True)):
    q, k, v, _ = make_qkv(lengths, 8, 2, D)
    with compile_only() as built:   # outputs unwritten: compile only
        quantize.is_sm90 = lambda dev: True     # sm_90: the Gluon q and K / V kernels
        quantize_qkv(q, k, v, cu, "fp8", causal)
        quantize.is_sm90 = lambda dev: False    # the Triton ones (other GPUs)
        x = quantize_qkv(q, k, v, cu, "fp8", causal)
        attention_forward(x, cu, 3000, causal, None, torch.bfloat16,
                          config=PersistentFwdConfig(), return_row_max=True)
        attention_forward(x, cu, 3000, causal, None, torch.bfloat16,
                          config=triton_forward_config(D, True, torch.device("cuda")),
                          return_row_max=True)
    for name, kern in built:
        out.append(report(kern) | {"D": D, "causal": causal, "name": name})
print("REPORT" + json.dumps(out))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90a():
    """The token-block quantize kernels (q and K / V by Gluon on sm_90, by Triton elsewhere), the
    Triton forward at the GPU's tiles and the Gluon persistent forward compile for sm_90a: no
    spills, no serialized wgmma (ptxas C7515); the Gluon forward keeps its register split and two
    CTAs per SM; both K / V block kernels take at most 128 registers (the Gluon one at its
    config.quantize_config warps)."""
    reports = compile_report(_COMPILE_SCRIPT)
    names = {u["name"] for u in reports}
    assert names == {"_quantize_q_gluon", "_quantize_kv_gluon", "_quantize_q_kernel",
                     "_quantize_kv_kernel", "_kvblock_cols_kernel", "_attn_fwd_kernel",
                     "_attn_fwd_gluon_persistent_kernel"}, names
    for u in reports:
        tag = f"{u['name']} D={u['D']} causal={u['causal']}"
        assert (u["spill_stores"] or 0) == 0 and u["local"] == 0, tag
        assert not u["wgmma_serialized"], tag
        if u["name"] in ("_quantize_kv_kernel", "_quantize_kv_gluon"):
            assert u["regs"] <= 128, tag
        if u["name"] == "_attn_fwd_gluon_persistent_kernel":
            assert u["regs"] <= 128 and 24 in u["partition_regs"], tag
            assert max(u["partition_regs"]) >= 232 and 2 * u["shared"] <= 227 * 1024, tag
