"""The contract between the token-block forward and backward kernels (recipe fp8), on the CPU:
flamia.ops.quantize.quantize_qkv's token-block fields are the operands the one-pass backward is
tested with on the H200 (tests/_kvblock.qkv_from_saved, built from the reference forward), field
by field. tests/gpu/test_backward_sm90_fp8_gpu.py checks the backward on those operands; this
file checks that the forward hands it the same ones."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (tests/conftest.py too)

import pytest  # noqa: E402
import torch  # noqa: E402

from flamia import reference as R  # noqa: E402
from flamia.inputs import make_qkv  # noqa: E402
from flamia.ops import interpreting  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402
from tests._kvblock import qkv_from_saved  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs the Triton interpreter")

LENGTHS = (150, 0, 1, 2, 133, 37)


@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("D", (64, 128))
def test_quantize_fields_are_the_backward_operands(D, causal):
    q, k, v, cu = make_qkv(LENGTHS, 4, 2, D, "outliers", seed=3)
    got = quantize_qkv(q, k, v, cu, "fp8", causal)
    want = qkv_from_saved(R.forward(q, k, v, cu, "fp8", causal)[2], cu, causal)
    assert got.rotated == want.rotated
    names = ["q8", "sq", "k8", "sk", "v8", "sv"]
    if causal:
        names += ["k8_diag", "sk_diag", "v8_diag", "sv_diag"]
    else:
        assert got.k8_diag is None and got.v8_diag is None
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.dtype == torch.float8_e4m3fn:
            # q and k are rotated in fp32 in both; a different summation order moves a value
            # across an e4m3 rounding boundary about once in 10^4
            differ = (a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item()
            assert differ <= (1e-3 if name in ("q8", "k8", "k8_diag") else 0.0), (name, differ)
        else:
            assert torch.equal(a, b), name
    torch.testing.assert_close(got.vnorm, want.vnorm, rtol=1e-5, atol=0)
