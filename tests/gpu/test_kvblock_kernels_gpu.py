"""fp8 (token-block scaling) through flamia's public API on the H200 (skipped without an sm_90
GPU): quantize_qkv, the forward with its row max and the one-pass backward from what the forward
handed over (flamia.kernel_path), against the reference emulation (flamia.reference forward /
backward, fp32) and float64 by the FlashAttention rule; P1 / P2 through flamia.audit (forward
bitwise, the relaxed backward rule); and a fuzz over random packed shapes, GQA groups and head
dims with P2 bitwise per case.

    python -m pytest -q -s tests/gpu/test_kvblock_kernels_gpu.py
"""
from __future__ import annotations

import os
import random
import time

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from flamia import audit, flamia_attn_varlen_func  # noqa: E402
from flamia import reference as R  # noqa: E402
from flamia.inputs import cu_seqlens_from_lengths  # noqa: E402
from flamia.interface import backend  # noqa: E402
from flamia.ops.config import backward_config, forward_config  # noqa: E402
from tests._kvblock import random_case  # noqa: E402

DEV = "cuda"
RECIPE = "fp8"
FUZZ_CASES = int(os.environ.get("FLAMIA_FUZZ_CASES", "100"))
FUZZ_SEED = int(os.environ.get("FLAMIA_FUZZ_SEED", "20261203"))


def _fa_rule(name, g, emu, ref, scale_ref, frac=2e-3):
    """|g - ref| <= 2 |emu - ref| + atol (max over the tensor), atol relative to the case's
    gradient scale (tests/gpu/test_backward_sm90_fp8_gpu.py says why)."""
    if g.numel() == 0:
        return
    emu = emu.to(g.dtype)
    err = (g.double() - ref).abs().max().item()
    err_emu = (emu.double() - ref).abs().max().item()
    atol = frac * (scale_ref.abs().max().item() if scale_ref.numel() else 0.0) + 1e-6
    assert err <= 2 * err_emu + atol, f"{name}: max err {err:.3e} vs emulation {err_emu:.3e}"


def _inputs(lengths, Hq, Hkv, D, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(lengths)
    return [torch.randn(T, h, D, generator=g, device=DEV).to(torch.bfloat16)
            for h in (Hq, Hkv, Hkv, Hq)]


def _poison():
    """Fill the caching allocator's free memory with NaN: an output element the kernels leave
    unwritten then shows as NaN."""
    x = torch.full((64 << 20,), float("nan"), device=DEV)
    del x


def _api(q, k, v, do, cu, causal, deterministic=True):
    """(out, lse, dq, dk, dv) of the public call, on poisoned memory."""
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    L = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    _poison()
    out, lse = flamia_attn_varlen_func(*xs, cu, cu, max(L, 1), max(L, 1), causal=causal,
                                       recipe=RECIPE, return_lse=True,
                                       deterministic=deterministic)
    out.backward(do)
    return out.detach(), lse, *(x.grad for x in xs)


def _check_case(lengths, Hq, Hkv, D, causal, seed):
    q, k, v, do = _inputs(lengths, Hq, Hkv, D, seed)
    cu = cu_seqlens_from_lengths(lengths, device=DEV)
    out, lse, *grads = _api(q, k, v, do, cu, causal)
    out_r, lse_r, saved = R.forward(q, k, v, cu, RECIPE, causal)
    emu = R.backward(do, out_r.to(torch.bfloat16), lse_r, saved, cu, RECIPE, causal)
    x64 = [x.double().requires_grad_() for x in (q, k, v)]
    o64 = R.attention_exact(*x64, cu, causal)
    o64.backward(do.double())
    tag = f"{lengths} {Hq}/{Hkv} D={D} causal={causal}"
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), tag
    _fa_rule(f"{tag} out", out, out_r, o64.detach(), o64.detach())
    for name, g, e, x in zip(("dq", "dk", "dv"), grads, emu, x64):
        assert torch.isfinite(g).all(), f"{tag} {name}: unwritten or non-finite"
        _fa_rule(f"{tag} {name}", g, e, x.grad, x64[2].grad)
    return (q, k, v, do, cu), (out, *grads)


def test_routing():
    """fp8 runs the kernels on sm_90: the persistent Gluon forward at D=128 and the one-pass
    backward at both head dims."""
    from flamia.ops.config import Sm90BwdConfig
    from flamia.ops.config import PersistentFwdConfig
    probe = torch.empty(1, 1, 128, device=DEV)
    assert backend(probe, RECIPE) == "kernels"
    assert isinstance(forward_config(128, RECIPE, probe.device), PersistentFwdConfig)
    for D in (64, 128):
        assert isinstance(backward_config(D, RECIPE, probe.device), Sm90BwdConfig)


@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("heads", ((8, 2), (4, 4)))
def test_api_against_emulation(D, causal, heads):
    _check_case([700, 0, 1, 2, 513, 129, 64, 300], *heads, D, causal, seed=D + heads[0] + causal)


@pytest.mark.parametrize("D", (64, 128))
def test_audit(D):
    """P1 (forward bitwise, gradients after t exactly zero, the gradient prefix change under the
    recipe's own error) and P2 bitwise, through the public API (deterministic backward)."""
    report = audit(audit.recipe_fn(RECIPE), doc_lengths=(700, 1, 0, 1300, 17, 300), heads_q=8,
                   heads_kv=2, head_dim=D, device=DEV)
    print(report)
    assert report.passed, str(report)


def test_deterministic_bitwise():
    q, k, v, do = _inputs([2048, 1, 900], 8, 2, 128, seed=3)
    cu = cu_seqlens_from_lengths([2048, 1, 900], device=DEV)
    a = _api(q, k, v, do, cu, True)
    b = _api(q, k, v, do, cu, True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_fuzz():
    """Random packed shapes through the public API: FA rule against the emulation and float64,
    and P2 bitwise (one document replaced, the others' outputs and gradients unchanged)."""
    rng = random.Random(FUZZ_SEED)
    t0 = time.time()
    print(f"fuzz: {FUZZ_CASES} cases, seed {FUZZ_SEED}")
    for case in range(FUZZ_CASES):
        lengths, Hq, Hkv, D, causal = random_case(rng)
        try:
            (q, k, v, do, cu), got = _check_case(lengths, Hq, Hkv, D, causal, seed=case)
            j = rng.randrange(len(lengths))             # P2: replace document j
            a, b = int(cu[j]), int(cu[j + 1])
            if 0 < b - a < q.shape[0]:
                q2, k2, v2, do2 = (x.clone() for x in (q, k, v, do))
                for x in (q2, k2, v2, do2):
                    x[a:b] = torch.randn_like(x[a:b]) * 4
                out2, _, *grads2 = _api(q2, k2, v2, do2, cu, causal)
                for name, x, y in zip(("out", "dq", "dk", "dv"), got, (out2, *grads2)):
                    assert torch.equal(x[:a], y[:a]) and torch.equal(x[b:], y[b:]), \
                        f"P2: {name} of another document changed"
        except AssertionError as e:
            raise AssertionError(f"fuzz case {case} (seed {FUZZ_SEED}): {e}") from e
        if (case + 1) % 10 == 0:      # a run cut short still says how far it got
            print(f"fuzz: {case + 1} cases passed in {time.time() - t0:.0f} s", flush=True)
    print(f"fuzz: {FUZZ_CASES} cases passed in {time.time() - t0:.0f} s")
