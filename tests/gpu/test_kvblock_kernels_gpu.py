"""fp8_block end to end in the kernels on the H200 (skipped without an sm_90 GPU): quantize_qkv,
the forward with its row max, and the one-pass backward from what the forward handed over,
against the reference emulation (flamia.reference forward / backward) and float64 by the
FlashAttention rule. The step before the recipe is routed through flamia's API.

    python -m pytest -q -s tests/gpu/test_kvblock_kernels_gpu.py
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from flamia import reference as R  # noqa: E402
from flamia.inputs import cu_seqlens_from_lengths  # noqa: E402
from flamia.ops.backward_sm90 import attention_backward_sm90_fp8  # noqa: E402
from flamia.ops.forward import attention_forward  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402

DEV = "cuda"


def _fa_rule(name, g, emu, ref, scale_ref, frac=2e-3):
    emu = emu.to(g.dtype)
    err = (g.double() - ref).abs().max().item()
    err_emu = (emu.double() - ref).abs().max().item()
    atol = frac * scale_ref.abs().max().item() + 1e-6
    assert err <= 2 * err_emu + atol, f"{name}: max err {err:.3e} vs emulation {err_emu:.3e}"


@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("causal", (True, False))
def test_forward_then_backward(D, causal):
    lengths = [700, 0, 1, 2, 513, 129, 64, 300]
    Hq, Hkv = 8, 2
    g = torch.Generator(device=DEV).manual_seed(D + causal)
    T = sum(lengths)
    q, k, v, do = (torch.randn(T, h, D, generator=g, device=DEV).to(torch.bfloat16)
                   for h in (Hq, Hkv, Hkv, Hq))
    cu = cu_seqlens_from_lengths(lengths, device=DEV)
    qkv = quantize_qkv(q, k, v, cu, "fp8_block", causal)
    out, lse, row_max = attention_forward(qkv, cu, max(lengths), causal, None, torch.bfloat16,
                                          return_row_max=True)
    dq, dk, dv = attention_backward_sm90_fp8(do, out, lse, row_max, qkv, cu, causal)
    # the emulation from the same (reference) forward, and float64
    out_r, lse_r, saved = R.forward(q, k, v, cu, "fp8_block", causal)
    emu = R.backward(do, out_r.to(torch.bfloat16), lse_r, saved, cu, "fp8_block", causal)
    x64 = [x.double().requires_grad_() for x in (q, k, v)]
    o64 = R.attention_exact(*x64, cu, causal)
    o64.backward(do.double())
    _fa_rule("out", out, out_r, o64.detach(), o64.detach())
    for name, x, e, r in zip(("dq", "dk", "dv"), (dq, dk, dv), emu, (x.grad for x in x64)):
        assert torch.isfinite(x).all(), name
        _fa_rule(f"D={D} causal={causal} {name}", x, e, r, x64[2].grad)
