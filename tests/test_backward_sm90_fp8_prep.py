"""The fp8 backward's preprocess on the CPU (Triton interpreter): everything before the
Gluon kernel (backward_sm90.fp8_prepare: dO per 64-row block, the per-row vectors and bounds,
the K-major copies, the bounds of the CTA scales) against flamia.reference.backward_scales and torch, on
operands built from the reference forward. The kernel itself runs on the H200
(tests/gpu/test_backward_sm90_fp8_gpu.py)."""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (tests/conftest.py too)

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flamia import reference as R  # noqa: E402
from flamia.quant import E4M3_MAX, pow2_scale  # noqa: E402
from flamia.inputs import make_qkv  # noqa: E402
from flamia.ops import interpreting  # noqa: E402
from flamia.ops import backward_sm90 as B  # noqa: E402
from flamia.ops.config import sm90_backward_config  # noqa: E402
from flamia.ops.kmajor import mma_order16_host, pair_order16_host  # noqa: E402
from flamia.ops.numerics import fwht, hadamard_signs  # noqa: E402
from tests._kvblock import qkv_from_saved  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs the Triton interpreter")

LENGTHS = (150, 0, 1, 2, 133, 37)
LOG2E = 1.4426950408889634


@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("D,onchip", ((64, False), (128, False), (128, True)))
def test_prepare_matches_reference(D, onchip, causal, monkeypatch):
    Hq, Hkv = 4, 2
    q, k, v, cu = make_qkv(LENGTHS, Hq, Hkv, D, "outliers", seed=5)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    do[40:70] = 0                                                  # all-zero dO rows
    out, lse, saved = R.forward(q, k, v, cu, "fp8", causal)
    out, lse = out.to(torch.bfloat16), lse.float().contiguous()
    qkv = qkv_from_saved(saved, cu, causal)
    scale = D ** -0.5
    empty = torch.empty

    def poisoned(*args, **kwargs):     # fp32 buffers start as NaN, int32 as -1: unwritten shows
        x = empty(*args, **kwargs)
        if x.dtype == torch.int32:
            return x.fill_(-1)
        return x.fill_(float("nan")) if x.dtype == torch.float32 else x
    monkeypatch.setattr(torch, "empty", poisoned)
    cfg = dataclasses.replace(sm90_backward_config(D), fp8_kmajor_onchip=onchip)
    prep = B.fp8_prepare(do, out, lse, saved.row_max.float().contiguous(), qkv, cu, causal, scale,
                         cfg)
    monkeypatch.setattr(torch, "empty", empty)
    prow = prep.kb.prow.long()
    assert prep.dq_acc.shape == (prep.kb.q_rows, Hq, D)   # the kernel's first write stores
    BM = sm90_backward_config(D).block_m
    assert prep.sem.shape == (Hq, prep.kb.q_rows // BM) and not prep.sem.any()   # zeroed
    doo = R.quantize_token_blocks(do.float(), "e4m3", cu, R.DO_BLOCK)
    assert torch.equal(prep.do8.view(torch.uint8), doo.values.to(torch.float8_e4m3fn).view(torch.uint8))
    sc = R.backward_scales(doo, doo.dequant(), out.float(), lse, saved, cu, causal)
    live = sc.sdo > 0
    one = torch.ones_like(sc.sdo)
    A, Bv, Hv, E = (prep.vec[i][:, prow] for i in range(B.N_VEC))
    assert torch.equal(A, scale * LOG2E * qkv.sq)
    torch.testing.assert_close(Bv[live], (lse * LOG2E - torch.log2(torch.where(live, sc.sdo, one)))[live])
    assert torch.isinf(Bv[~live]).all() and (Bv[~live] > 0).all()
    assert torch.equal(Hv, torch.where(live, sc.sqf, 0 * one))
    torch.testing.assert_close(E, torch.where(live, sc.delta * sc.sqf / torch.where(live, sc.sdo, one), 0 * one))
    # the 64-row block bounds the kernel takes its CTA scales from: per work-list column, the
    # scales of their max over the blocks the CTA sees (the kernel's _cta_scales, mirrored in
    # torch) against the reference's per (KV head, block); the kernel's own reduction is checked
    # on the GPU (tests/gpu/test_backward_sm90_fp8_gpu.py)
    base = torch.tensor([0] + [-(-n // 128) for n in LENGTHS]).cumsum(0).tolist()
    items = prep.kb.items
    group = Hq // Hkv
    for c in range(items.shape[1]):
        d, blk, L, pq, kvh = (int(items[r, c]) for r in (0, 1, 3, 4, 5))
        if d >= 0:
            b0, b1 = (pq + blk * 128 if causal else pq) // 64, -(-(pq + L) // 64)
            for bound, want in ((prep.bpt, sc.pt), (prep.bds, sc.ds)):
                m = bound[kvh * group:(kvh + 1) * group, b0:b1].amax()
                assert pow2_scale(m, E4M3_MAX).item() == want[kvh, base[d] + blk].item(), \
                    (c, d, blk, kvh)
    # the K-major copies: column c of the padded layout holds the token of row c (wgmma order
    # within 16 for dO^T and Q^T, pair order for K^T), zeros on pad columns
    cols = torch.arange(prep.kb.q_rows)
    copies = [(qkv.k8, prep.kt8, pair_order16_host)]
    if onchip:      # the kernel makes Q^T and dO^T itself
        assert prep.qt8 is None and prep.dot8 is None
    else:
        copies += [(prep.do8, prep.dot8, mma_order16_host), (qkv.q8, prep.qt8, mma_order16_host)]
    for x8, xT, order in copies:
        tok = prep.ptok.long()[order(cols)]
        ok = tok >= 0
        want = torch.zeros_like(xT.view(torch.uint8))
        want[:, :, ok] = x8.view(torch.uint8)[tok[ok]].permute(1, 2, 0)
        assert torch.equal(xT.view(torch.uint8), want)


@pytest.mark.parametrize("rotated", (True, False))
@pytest.mark.parametrize("D", (64, 128))
def test_post_pass(D, rotated):
    """fp8_post: dq = (dq_acc at the padded rows, in the kernels' dq_row order) * scale / sqf,
    rotated back (x @ H / sqrt(D)) when `rotated`; T spans several programs and ends inside one
    (the tail rows are masked)."""
    cfg = sm90_backward_config(D)
    T, Hq = 3 * cfg.fp8_post_rows + 37, 3
    g = torch.Generator().manual_seed(11)
    prow = (torch.arange(T) + 5 + torch.arange(T) // 100 * 7).to(torch.int32)   # gaps: padding
    dq_acc = torch.randn(int(prow.max()) + 9, Hq, D, generator=g)
    sq = torch.rand(Hq, T, generator=g) + 0.5
    sq[:, 3] = 0.0                                   # a zero scale (sqf = 1)
    scale = 0.3
    dq = torch.full((T, Hq, D), float("nan")).to(torch.bfloat16)
    B.fp8_post(dq_acc, prow, sq, rotated, scale, dq, cfg)
    sqf = torch.where(sq > 0, sq, torch.ones_like(sq)).T[:, :, None]
    want_q = dq_acc[B.dq_row_host(prow.long())].double() * scale / sqf.double()
    if rotated:
        from flamia.ops.numerics import hadamard_signs
        want_q = want_q @ (hadamard_signs(D, torch.float64, "cpu") / D ** 0.5)
    torch.testing.assert_close(dq.double(), want_q.to(torch.bfloat16).double(), rtol=2 ** -7, atol=1e-4)


@pytest.mark.parametrize("D", (16, 64, 128, 256))
def test_sylvester_parity_builds_the_hadamard_signs(D):
    """The fp8 kernel's epilogue builds H (rotating dK back) as 1 - 2 sylvester_parity(i, j)."""
    from flamia.ops.numerics import hadamard_signs, sylvester_parity_host
    i = torch.arange(D)
    assert torch.equal((1 - 2 * sylvester_parity_host(i[:, None], i[None, :])).double(),
                       hadamard_signs(D, torch.float64, "cpu"))


@triton.jit
def _fwht_rows(X, Y, M: tl.constexpr, D: tl.constexpr):
    r = tl.arange(0, M)
    c = tl.arange(0, D)
    x = tl.load(X + r[:, None] * D + c[None, :])
    tl.store(Y + r[:, None] * D + c[None, :], fwht(x, M, D))


@pytest.mark.parametrize("D", (16, 32, 64, 128, 256))
def test_fwht_is_the_sylvester_hadamard_product(D):
    """numerics.fwht (the post pass's rotation): x @ H_D for every supported D, to fp32 rounding
    of its D-term sums (relative to the largest |x|, D * 2^-24 is a loose bound)."""
    x = torch.randn(16, D, generator=torch.Generator().manual_seed(D))
    x[3] = 0.0
    y = torch.empty_like(x)
    _fwht_rows[(1,)](x, y, 16, D)
    want = x.double() @ hadamard_signs(D, torch.float64, "cpu")
    assert (y.double() - want).abs().max() <= D * 2 ** -24 * x.abs().max() * D ** 0.5
    assert torch.equal(y[3], torch.zeros(D))
