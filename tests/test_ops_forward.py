"""CPU tests of the quantize / Triton forward kernels (Triton interpreter) against
flamia.reference, for both kernel recipes (bf16, and fp8's token-block scaling;
tests/test_forward_kvblock.py has fp8's quantize layout, tile shapes and bitwise P1 / P2).

- quantize_qkv: bf16 is a view of the inputs; fp8 on NaN / Inf and extreme tokens equals the
  reference's quantized operands (the NaN confined to its token's and its block's scales).
- the forward's work list: every query block once, heaviest first.
- attention_forward: out / lse match the reference emulation by the FlashAttention rule
  (max |out - ref64| <= 2 max |emul - ref64| + atol, and elementwise with a noise-level atol),
  relative error close to the emulation's; every output element written (outputs start as NaN);
  MHA / MQA, GQA over several KV-head chunks of the grid, softmax_scale, fold_lr, fp16 inputs,
  V^T in either column order, a NaN confined to its document.
- P1 (causal prefix) and P2 (document isolation) bitwise, through flamia.audit, and the control
  that the audit catches a leaky V cap.
- The bf16 forward compiles for sm_90a (no GPU needed: triton's bundled ptxas).
- Which forward kernel a call takes (config.uses_persistent_forward).
"""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (tests/conftest.py too)

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from flamia import reference  # noqa: E402
from flamia.inputs import make_qkv, rel_err  # noqa: E402
from flamia.ops import interpreting  # noqa: E402
from flamia.ops.config import FwdConfig  # noqa: E402
from flamia.ops.forward import attention_forward  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402
from flamia.ops.schedule import build_schedule  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs the Triton interpreter")

# Empty and length-1 documents, unaligned starts; the 150-token document spans two 128-token
# K/V blocks (fp8: block copies off the diagonal block, token copies on it).
LENGTHS = (150, 0, 1, 37, 45)
# Small tiles so that the 150-token document spans several query blocks and KV tiles; both
# BLOCK_N < BLOCK_M and BLOCK_N > BLOCK_M, TMA descriptors and plain pointer loads.
CFG_TMA = FwdConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, use_tma=True)
CFG_PTR = FwdConfig(block_m=16, block_n=32, num_warps=4, num_stages=1, use_tma=False)


def _run(q, k, v, cu, recipe, causal, cfg, scale=None):
    qkv = quantize_qkv(q, k, v, cu, recipe, causal, poison=True)
    return attention_forward(qkv, cu, int((cu[1:] - cu[:-1]).max()), causal, scale, q.dtype,
                             config=cfg, poison=True)


# ------------------------------------------------------------------------------------------ quantize

def test_quantize_bf16_is_a_view():
    q, k, v, cu = make_qkv(LENGTHS, 4, 2, 64)
    qkv = quantize_qkv(q, k, v, cu, "bf16", True)
    assert qkv.q8.data_ptr() == q.data_ptr() and qkv.v8.data_ptr() == v.data_ptr()
    assert qkv.sq is None and qkv.vcap is None and qkv.vt8 is None and not qkv.rotated


def _same(a, b):
    """Equal, NaN where the other is NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.nonfinite
@pytest.mark.parametrize("causal", [True, False])
def test_quantize_nonfinite_and_extreme_tokens(causal):
    """fp8 with a NaN in q, an Inf in k and a huge and a tiny V token: values, scales and vcap
    equal the reference's operands; a non-finite token's scale is NaN in its token copy and in
    its block's scale in the block copy, and the other document's scales stay finite."""
    q, k, v, cu = make_qkv((20, 12), 2, 1, 64)
    q[2, 0, 5] = float("nan")
    k[4, 0, 1] = float("inf")
    v[6, 0] *= 1e30                                 # huge but finite: scale 2^k, no saturation
    v[7, 0] *= 1e-30
    qkv = quantize_qkv(q, k, v, cu, "fp8", causal, poison=True)
    _, _, saved = reference.forward(q, k, v, cu, "fp8", causal)
    assert torch.isnan(qkv.sq[0, 2]) and not torch.isnan(qkv.sq[:, 20:]).any()
    assert torch.isnan(qkv.sk[0, :20]).all() and not torch.isnan(qkv.sk[:, 20:]).any()
    pairs = [(qkv.q8, qkv.sq, saved.q), (qkv.k8, qkv.sk, saved.k), (qkv.v8, qkv.sv, saved.v)]
    if causal:
        assert torch.isnan(qkv.sk_diag[0, 4]) and torch.isnan(qkv.sk_diag[0]).sum() == 1
        pairs += [(qkv.k8_diag, qkv.sk_diag, saved.k_diag),
                  (qkv.v8_diag, qkv.sv_diag, saved.v_diag)]
    for i, (x8, s, op) in enumerate(pairs):
        assert _same(x8.float(), op.values.float()), i
        assert _same(s.t(), op.scale[..., 0]), i
    assert torch.equal(qkv.vcap.t(), saved.v_cap)


# ------------------------------------------------------------------------------------------ schedule

@pytest.mark.parametrize("causal", [True, False])
def test_schedule_covers_each_block_once_heaviest_first(causal):
    lengths = (130, 0, 1, 64, 65, 300)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    BM, BN = 64, 32
    sch = build_schedule(cu, sum(lengths), BM, BN, causal)
    doc, blk, start, length = sch.tolist()
    real = [(d, b) for d, b in zip(doc, blk) if d >= 0]
    expect = [(d, b) for d, L in enumerate(lengths) for b in range(-(-L // BM))]
    assert sorted(real) == sorted(expect)
    for i, d in enumerate(doc[:len(real)]):            # each item's document span, inline
        assert (start[i], length[i]) == (cu[d].item(), lengths[d])
    assert all(d < 0 for d in doc[len(real):])           # padding items at the end

    def cost(d, b):
        L = lengths[d]
        hi = min((b + 1) * BM, L) if causal else L
        return -(-hi // BN)
    costs = [cost(d, b) for d, b in real]
    assert costs == sorted(costs, reverse=True)


# ------------------------------------------------------------------------------------------ forward

def _check_forward(q, k, v, cu, recipe, causal, cfg, family, scale=None):
    out, lse = _run(q, k, v, cu, recipe, causal, cfg, scale)
    ref_out, ref_lse, _ = reference.forward(q, k, v, cu, recipe, causal, scale)
    emul = ref_out.to(q.dtype).double()                 # what a user of the reference gets
    exact = reference.attention_exact(q, k, v, cu, causal, scale)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    assert not out.isnan().any() and not lse.isnan().any(), "an output element was not written"
    err, err_ref = (out.double() - exact).abs(), (emul - exact).abs()
    # FlashAttention's rule on the max error, then elementwise with a noise-level atol: the
    # kernel rounds P at the running max (online softmax), the emulation at the final max, so
    # single elements differ by independent rounding noise of the same size.
    assert err.max() <= 2 * err_ref.max() + 1e-5, (err.max().item(), err_ref.max().item())
    atol = 4 * err_ref.pow(2).mean().sqrt().item() + 1e-5
    assert (err <= 2 * err_ref + atol).all()
    r, r_ref = rel_err(out, exact), rel_err(emul, exact)
    assert r <= 1.1 * r_ref + 1e-4, (r, r_ref)
    valid = torch.isfinite(ref_lse)
    assert torch.allclose(lse[valid], ref_lse[valid].float(), atol=2e-5, rtol=1e-5)
    return out, lse


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("cfg", [CFG_TMA, CFG_PTR], ids=["tma32x16", "ptr16x32"])
def test_forward_causal_gqa_bf16(D, cfg):
    """(fp8's causal GQA cases at these tiles: tests/test_forward_kvblock.py.)"""
    family = "outliers" if D == 128 else "mild"
    q, k, v, cu = make_qkv(LENGTHS, 4, 2, D, family, seed=1)
    _check_forward(q, k, v, cu, "bf16", True, cfg, family)


@pytest.mark.parametrize("recipe,causal,hkv", [("fp8", False, 4), ("bf16", False, 1),
                                               ("fp8", True, 1)])
def test_forward_variants(recipe, causal, hkv):
    """MHA and MQA, causal and not, with a softmax_scale of the caller's."""
    q, k, v, cu = make_qkv(LENGTHS, 4, hkv, 64, "mild", seed=2)
    _check_forward(q, k, v, cu, recipe, causal, CFG_TMA, "mild", scale=0.2)


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_forward_kv_head_chunks(recipe):
    """GQA with more KV heads than one chunk of the grid's order (config.FWD_KV_CHUNK): every
    (query block, head) is computed once, by the CTA that the chunked order gives it."""
    from flamia.ops.config import FWD_KV_CHUNK
    hkv = 2 * FWD_KV_CHUNK
    q, k, v, cu = make_qkv(LENGTHS, 2 * hkv, hkv, 64, "mild", seed=6)
    _check_forward(q, k, v, cu, recipe, True, CFG_PTR, "mild")


@pytest.mark.parametrize("recipe,D,family,causal,hkv,seed,scale", [
    ("fp8", 128, "outliers", True, 2, 1, None), ("fp8", 64, "mild", False, 4, 2, 0.2),
    ("bf16", 64, "mild", True, 2, 1, None)])
def test_forward_fold_lr(recipe, D, family, causal, hkv, seed, scale):
    """FwdConfig.fold_lr (the per-row offset folded into the max once per tile; fp8's default
    on the GPU) causal and not: the same rule against the reference and float64, and within
    fp32 rounding of the exponent of the default (P moves by ~|m - lr| 2^-24 relative, far
    below e4m3's step)."""
    q, k, v, cu = make_qkv(LENGTHS, 4, hkv, D, family, seed=seed)
    out, lse = _check_forward(q, k, v, cu, recipe, causal, dataclasses.replace(CFG_TMA, fold_lr=True), family,
                              scale)
    out0, lse0 = _run(q, k, v, cu, recipe, causal, CFG_TMA, scale)
    torch.testing.assert_close(lse, lse0, rtol=1e-6, atol=1e-5)
    assert (out.float() - out0.float()).abs().max() <= 0.05 * out0.float().abs().max()


def test_forward_fp16_inputs():
    q, k, v, cu = make_qkv(LENGTHS, 2, 1, 64, "outliers", seed=3, dtype=torch.float16)
    _check_forward(q, k, v, cu, "fp8", True, CFG_TMA, "outliers")
    _check_forward(q, k, v, cu, "bf16", True, CFG_PTR, "outliers")


@pytest.mark.nonfinite
def test_forward_nan_stays_in_its_document():
    """A NaN token poisons rows of its own document only (the rows that attend to it, and --
    through 0 * NaN in the diagonal tile's PV product -- possibly earlier rows of its query
    block; the reference's dense P @ V poisons the whole document). (A NaN in a block copy read
    off the diagonal block: tests/test_forward_kvblock.py.)"""
    q, k, v, cu = make_qkv(LENGTHS, 2, 1, 64, "mild", seed=5)
    v[155, 0, 3] = float("nan")                    # document 3 (tokens 151..187), position 4
    for cfg in (CFG_TMA, CFG_PTR):
        out, _ = _run(q, k, v, cu, "fp8", True, cfg)
        nan_rows = out.isnan().any(-1).any(-1)
        assert not nan_rows[:151].any() and not nan_rows[188:].any()
        assert nan_rows[155:188].all()


# ------------------------------------------------------------------------------------------ P1 / P2

def _kernel_fn(recipe, cfg):
    def fn(q, k, v, cu_seqlens, max_seqlen):
        qkv = quantize_qkv(q, k, v, cu_seqlens, recipe, True)
        return attention_forward(qkv, cu_seqlens, max_seqlen, True, None, q.dtype, config=cfg)[0]
    fn.__name__ = f"kernels[{recipe}]"
    return fn


# 32x32 tiles: t falls inside a query block and inside a KV tile. The `outliers` family: with
# power-of-two scales a leak through a scale only shows where e4m3 rounding is not scale
# invariant (subnormals), which needs the wide dynamic range of that family (see the control).
AUDIT_CFG = FwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=1, use_tma=True)
AUDIT_KW = dict(doc_lengths=(90, 1, 0, 75, 17, 60), heads_q=4, heads_kv=2, head_dim=64,
                backward=False, family="outliers")


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_prefix_invariance_and_document_isolation(recipe):
    audit = pytest.importorskip("flamia.audit")
    report = audit.audit(_kernel_fn(recipe, AUDIT_CFG), **AUDIT_KW)
    assert report.passed, str(report)


def test_audit_catches_a_leaky_vcap():
    """Control: a whole-document V cap (the non-causal quantize's vcap in a causal forward) must
    be caught."""
    audit = pytest.importorskip("flamia.audit")

    def leaky(q, k, v, cu_seqlens, max_seqlen):
        qkv = quantize_qkv(q, k, v, cu_seqlens, "fp8", True)
        qkv.vcap = quantize_qkv(q, k, v, cu_seqlens, "fp8", False).vcap
        return attention_forward(qkv, cu_seqlens, max_seqlen, True, None, q.dtype,
                                 config=AUDIT_CFG)[0]
    report = audit.audit(leaky, **AUDIT_KW)
    assert not report["P1 forward"].passed and report["P2 forward"].passed


# ------------------------------------------------------------------------------------------ sm_90a

_COMPILE_SCRIPT = textwrap.dedent("""
    import torch
    from benchmarks.tools.compile import compile_only, resource_usage
    from flamia.ops.config import triton_forward_config
    from flamia.ops.forward import attention_forward
    from flamia.ops.quantize import quantize_qkv
    from flamia.inputs import make_qkv
    for D in (64, 128):
        q, k, v, cu = make_qkv((200, 56), 4, 2, D)
        for causal in (True, False):
            with compile_only() as built:   # outputs unwritten: compile only
                x = quantize_qkv(q, k, v, cu, "bf16", causal)
                cfg = triton_forward_config(D, False, torch.device("cuda"))
                attention_forward(x, cu, 200, causal, None, torch.bfloat16, config=cfg)
            assert [name for name, _ in built] == ["_attn_fwd_kernel"], built
            for name, kern in built:
                u = resource_usage(kern)
                print(D, causal, name, u)
                assert u["spill_stores"] == 0, (D, causal, name, u)
                assert not u["wgmma_serialized"], (D, causal, name, u)
""")


@pytest.mark.slow
def test_kernels_compile_for_sm90a():
    """The bf16 Triton forward at the GPU's tiles compiles for sm_90a without spills or
    serialized wgmma (ptxas C7515); the fp8 kernels: tests/test_forward_kvblock.py."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(__file__)),
                                                      env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]


def test_metadata_memo_follows_cu_seqlens_version():
    """The work list memoized on cu_seqlens is rebuilt after an in-place change of it."""
    from flamia.ops.schedule import per_cu_seqlens
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    calls = []

    def build():
        calls.append(cu.tolist())
        return cu.sum().item()
    assert per_cu_seqlens(cu, "k", build) == 14 and per_cu_seqlens(cu, "k", build) == 14
    assert len(calls) == 1
    cu[2] = 12                                     # in place: version counter moves
    assert per_cu_seqlens(cu, "k", build) == 17 and len(calls) == 2
    # the forward's work list: documents (20, 11), then the same tensor changed to (9, 22)
    q, k, v, cu2 = make_qkv((20, 11), 2, 1, 64, seed=3)
    attention_forward(quantize_qkv(q, k, v, cu2, "fp8", True), cu2, 20, True, None, torch.float32)
    cu2[1] = 9
    fresh = cu2.clone()
    out_memo, _ = attention_forward(quantize_qkv(q, k, v, cu2, "fp8", True), cu2, 22, True, None,
                                    torch.float32)
    out_fresh, _ = attention_forward(quantize_qkv(q, k, v, fresh, "fp8", True), fresh, 22, True,
                                     None, torch.float32)
    assert torch.equal(out_memo, out_fresh)


def test_persistent_forward_rule(monkeypatch, fake_capability):
    """Which calls the persistent Gluon forward takes: fp8 (by name or Recipe) at D=128, any
    document lengths, on an sm_90 GPU (never under the interpreter or on the CPU, where the
    Triton kernel / reference run, nor for the reference-only recipes)."""
    from flamia.ops import config as C
    from flamia.recipes import get_recipe
    cuda = torch.device("cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fake_capability((9, 0))
    ok = C.uses_persistent_forward(128, "fp8", cuda)
    assert ok == C.HAVE_GLUON
    assert C.uses_persistent_forward(128, get_recipe("fp8"), cuda) == ok
    for name in ("fp8_mixed", "fp8_token"):             # emulated: no kernel runs them
        assert get_recipe(name).emulated
        assert not C.uses_persistent_forward(128, get_recipe(name), cuda), name
    assert isinstance(C.forward_config(128, "fp8", cuda), C.PersistentFwdConfig) == ok
    if ok:      # the GQA pair: an even group and documents up to >= PAIR_FWD_MIN_SEQLEN tokens
        long = C.PAIR_FWD_MIN_SEQLEN
        assert C.forward_config(128, "fp8", cuda, long, 4) == C.PAIR_FWD_CONFIG
        assert C.forward_config(128, "fp8", cuda, 2 * long, 2).heads_per_cta == 2
        for seqlen, group in ((long - 1, 4), (None, 4), (long, 1), (long, 3)):
            assert C.forward_config(128, "fp8", cuda, seqlen, group).heads_per_cta == 1
    for args in ((64, "fp8"), (128, "bf16"), (256, "fp8")):
        assert not C.uses_persistent_forward(*args, cuda), args
        assert isinstance(C.forward_config(*args, cuda), C.FwdConfig)
    assert not C.uses_persistent_forward(128, "fp8", torch.device("cpu"))
    fake_capability((10, 0))
    assert not C.uses_persistent_forward(128, "fp8", cuda)
    fake_capability((9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not C.uses_persistent_forward(128, "fp8", cuda)
