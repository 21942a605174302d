"""The fp8 recipe's one-pass Hopper backward (flamia.ops.backward_sm90,
attention_backward_sm90_fp8) on the H200 (skipped without an sm_90 GPU), from the reference
forward's quantized operands (flamia.reference._forward_kvblock): accuracy against float64 next
to the reference emulation (reference._backward_kvblock, fp32) by the FlashAttention rule,
determinism, P1 (gradients after t exactly zero when dO is zero after t), P2 bitwise, and a fuzz
over random packed shapes.

    python -m pytest -q -s tests/gpu/test_backward_sm90_fp8_gpu.py
"""
from __future__ import annotations

import dataclasses
import os
import random
import time
import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from flamia import reference as R  # noqa: E402
from flamia.inputs import cu_seqlens_from_lengths  # noqa: E402
from flamia.ops import backward_sm90 as B  # noqa: E402
from flamia.ops.backward_sm90 import attention_backward_sm90_fp8  # noqa: E402
from flamia.ops.config import sm90_backward_config  # noqa: E402
from tests._kvblock import qkv_from_saved, random_case  # noqa: E402

DEV = "cuda"
RECIPE = "fp8"
FUZZ_CASES = int(os.environ.get("FLAMIA_FUZZ_CASES", "300"))
FUZZ_SEED = int(os.environ.get("FLAMIA_FUZZ_SEED", "20261203"))
MODES = ((64, False), (128, False), (128, True))   # head dim, Q^T / dO^T made in the kernel


def _poison():
    x = torch.full((64 << 20,), float("nan"), device=DEV)
    del x


def _inputs(lengths, Hq, Hkv, D, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(lengths)
    return [torch.randn(T, h, D, generator=g, device=DEV).to(torch.bfloat16)
            for h in (Hq, Hkv, Hkv, Hq)]


def _truth(q, k, v, do, cu, causal):
    """float64 gradients of exact attention."""
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    o = R.attention_exact(q64, k64, v64, cu, causal)
    o.backward(do.double())
    return q64.grad, k64.grad, v64.grad


def _fa_rule(name, g, emu, ref, scale_ref, frac=2e-3):
    """|g - ref| <= 2 |emu - ref| + atol (max over the tensor), atol relative to the case's
    gradient scale max|dV| (scale_ref): dQ and dK of a one-token document are exactly zero in
    float64 but a cancellation dP - delta in FP8, whose rounding the kernel and the emulation
    need not share (the emulation's summation order happens to cancel exactly)."""
    emu = emu.to(g.dtype)
    err = (g.double() - ref).abs().max().item() if g.numel() else 0.0
    err_emu = (emu.double() - ref).abs().max().item() if g.numel() else 0.0
    atol = frac * (scale_ref.abs().max().item() if scale_ref.numel() else 0.0) + 1e-6
    assert err <= 2 * err_emu + atol, f"{name}: max err {err:.3e} vs emulation {err_emu:.3e}"
    return err, err_emu


def _forward(q, k, v, cu, causal):
    out, lse, saved = R.forward(q, k, v, cu, RECIPE, causal)
    return out.to(torch.bfloat16), lse.float().contiguous(), saved


def _kernel(do, out, lse, saved, cu, causal, deterministic=True, onchip=False):
    """The kernel; onchip: Q^T / dO^T made in the kernel (config.fp8_kmajor_onchip, D=128)."""
    qkv = qkv_from_saved(saved, cu, causal)
    cfg = dataclasses.replace(sm90_backward_config(do.shape[2]), fp8_kmajor_onchip=onchip)
    _poison()
    return attention_backward_sm90_fp8(do, out, lse, saved.row_max.float().contiguous(), qkv, cu,
                                       causal, deterministic=deterministic, config=cfg)


def _run_case(lengths, Hq, Hkv, D, causal, seed, deterministic=True, truth=True, onchip=False):
    q, k, v, do = _inputs(lengths, Hq, Hkv, D, seed)
    cu = cu_seqlens_from_lengths(lengths, device=DEV)
    out, lse, saved = _forward(q, k, v, cu, causal)
    got = _kernel(do, out, lse, saved, cu, causal, deterministic, onchip)
    emu = R.backward(do, out, lse, saved, cu, RECIPE, causal)
    ref = _truth(q, k, v, do, cu, causal) if truth else emu
    errs = []
    for name, x, e, r in zip(("dq", "dk", "dv"), got, emu, ref):
        assert torch.isfinite(x).all(), f"{name}: unwritten or non-finite"
        if truth:
            errs.append(_fa_rule(f"{lengths} {Hq}/{Hkv} D={D} causal={causal} {name}", x, e, r,
                                 ref[2]))
    return (q, k, v, do, out, lse, saved, cu), got, errs


@pytest.mark.parametrize("D,onchip", MODES)
@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("heads", ((8, 2), (4, 4), (6, 1)))
def test_accuracy(D, onchip, causal, heads):
    _, _, errs = _run_case([700, 0, 1, 2, 513, 129, 64, 300], *heads, D, causal,
                           seed=D + heads[0] + causal, onchip=onchip)
    print(f"D={D} onchip={onchip} causal={causal} heads={heads} (kernel, emulation) max errors:",
          [f"{a:.2e}/{b:.2e}" for a, b in errs])


@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("D", (64, 128))
def test_cta_scales(D, causal, monkeypatch):
    """The CTA scales the kernel reduces from the preprocess's block bounds (written to
    Fp8Prep.cta), per work-list column, equal the reference's (reference.cta_scales) exactly,
    over documents of 0, 1, 2 and several 128-key blocks and a GQA group of 4."""
    lengths = [700, 0, 1, 2, 513, 129, 64, 1300]
    Hq, Hkv = 8, 2
    q, k, v, do = _inputs(lengths, Hq, Hkv, D, seed=D + causal)
    cu = cu_seqlens_from_lengths(lengths, device=DEV)
    out, lse, saved = _forward(q, k, v, cu, causal)
    preps = []
    prepare = B.fp8_prepare
    monkeypatch.setattr(B, "fp8_prepare", lambda *a, **kw: preps.append(prepare(*a, **kw))
                        or preps[-1])
    _kernel(do, out, lse, saved, cu, causal)
    prep = preps[0]
    doo = R.quantize_token_blocks(do.float(), "e4m3", cu, R.DO_BLOCK)
    sc = R.backward_scales(doo, doo.dequant(), out.float(), lse, saved, cu, causal)
    base = torch.tensor([0] + [-(-n // 128) for n in lengths]).cumsum(0).tolist()
    items = prep.kb.items.cpu()
    cols = [c for c in range(items.shape[1]) if items[0, c] >= 0]
    blocks = [base[int(items[0, c])] + int(items[1, c]) for c in cols]
    heads = [int(items[5, c]) for c in cols]
    assert len(cols) == sc.pt.numel() > 0
    for i, want in enumerate((sc.pt, sc.ds)):
        assert torch.equal(prep.cta[i, cols].cpu(), want[heads, blocks].float().cpu())


@pytest.mark.parametrize("D", (64, 128))
def test_deterministic_bitwise(D):
    """Deterministic mode repeats bitwise, and at D=128 the in-kernel Q^T / dO^T give the same
    bits as the preprocess's copies (the same bytes in shared memory)."""
    (q, k, v, do, out, lse, saved, cu), a, _ = _run_case([2048, 1, 900], 8, 2, D, True, seed=3)
    b = _kernel(do, out, lse, saved, cu, True, deterministic=True)
    c = _kernel(do, out, lse, saved, cu, True, deterministic=False)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y)
        torch.testing.assert_close(z.float(), x.float(), rtol=1e-2, atol=1e-2)
    if D == 128:
        for x, y in zip(a, _kernel(do, out, lse, saved, cu, True, onchip=True)):
            assert torch.equal(x, y)


@pytest.mark.parametrize("D,onchip", MODES)
def test_p1_gradients_after_t_zero(D, onchip):
    """dO zero after t: every gradient row after t is exactly zero (dK, dV of keys > t; dQ of
    queries > t)."""
    lengths = [1000]
    q, k, v, do = _inputs(lengths, 4, 2, D, seed=11)
    cu = cu_seqlens_from_lengths(lengths, device=DEV)
    out, lse, saved = _forward(q, k, v, cu, True)
    t = 437
    do[t + 1:] = 0
    dq, dk, dv = _kernel(do, out, lse, saved, cu, True, onchip=onchip)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.count_nonzero(g[t + 1:]) == 0, name
        assert torch.count_nonzero(g[:t + 1]) > 0, name


@pytest.mark.parametrize("D,onchip", MODES)
def test_p2_bitwise(D, onchip):
    """A document's gradients do not depend on its neighbours (deterministic mode)."""
    lengths = [300, 700, 129]
    q, k, v, do = _inputs(lengths, 8, 2, D, seed=5)
    cu = cu_seqlens_from_lengths(lengths, device=DEV)
    out, lse, saved = _forward(q, k, v, cu, True)
    a = _kernel(do, out, lse, saved, cu, True, onchip=onchip)
    q2, k2, v2, do2 = (x.clone() for x in (q, k, v, do))
    for x in (q2, k2, v2, do2):
        x[:300] = torch.randn_like(x[:300]) * 4
        x[1000:] = torch.randn_like(x[1000:]) * 4
    out2, lse2, saved2 = _forward(q2, k2, v2, cu, True)
    b = _kernel(do2, out2, lse2, saved2, cu, True, onchip=onchip)
    for x, y in zip(a, b):
        assert torch.equal(x[300:1000], y[300:1000])


def test_fuzz():
    rng = random.Random(FUZZ_SEED)
    t0 = time.time()
    print(f"fuzz: {FUZZ_CASES} cases (odd ones in the unordered mode; at D=128 every other pair "
          f"with Q^T / dO^T made in the kernel), seed {FUZZ_SEED}")
    for case in range(FUZZ_CASES):
        lengths, Hq, Hkv, D, causal = random_case(rng)
        try:
            _run_case(lengths, Hq, Hkv, D, causal, seed=case, deterministic=case % 2 == 0,
                      onchip=D == 128 and case % 4 >= 2)
        except AssertionError as e:
            raise AssertionError(f"fuzz case {case} (seed {FUZZ_SEED}): {e}") from e
    print(f"fuzz: {FUZZ_CASES} cases passed in {time.time() - t0:.0f} s")
