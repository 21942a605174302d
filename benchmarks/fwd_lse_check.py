"""Which side of tests/gpu/test_forward_gpu.py::test_forward_matches_reference[fp8-128-*] is off
(H200): the forward kernel's LSE, or the reference emulation's?

    python benchmarks/fwd_lse_check.py

Outlier and mild inputs, one 8k document, D=128. A third LSE, "direct", is computed in float64
from the kernel's own quantized operands (q8 sq, k8 sk): logsumexp over the causal row. Printed:
how many rows each of kernel / emulation differs from direct by more than 1e-4 and by how much,
per 1k-row band (a position-dependent error points at the online softmax), and O's errors.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))

import torch  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
from test_forward_gpu import HKV, HQ, WORKLOADS, _references  # noqa: E402

from flamia.inputs import make_qkv, rel_err  # noqa: E402
from flamia.ops.forward import attention_forward  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402


def direct_lse(qkv, T, scale):
    """float64 lse of the kernel's quantized operands, one head at a time, causal."""
    G = HQ // HKV
    out = torch.empty(HQ, T, dtype=torch.float64, device="cuda")
    mask = torch.ones(T, T, dtype=torch.bool, device="cuda").triu(1)
    for h in range(HQ):
        q = qkv.q8[:, h].double() * qkv.sq[h, :, None].double()
        k = qkv.k8[:, h // G].double() * qkv.sk[h // G, :, None].double()
        s = (q @ k.T * scale).masked_fill(mask, float("-inf"))
        out[h] = torch.logsumexp(s, -1)
    return out


for family in ("outliers", "mild"):
    q, k, v, cu = make_qkv(WORKLOADS["doc8k"], HQ, HKV, 128, family, device="cuda", seed=1)
    T = q.shape[0]
    emul, emul_lse, exact = _references(q, k, v, cu, "fp8")
    qkv = quantize_qkv(q, k, v, cu, "fp8", True)
    out, lse = attention_forward(qkv, cu, T, True, None, q.dtype, poison=True)
    ref = direct_lse(qkv, T, 128 ** -0.5)
    print(f"{family}: O rel err vs exact kernel {rel_err(out, exact):.4e}, emulation "
          f"{rel_err(emul, exact):.4e}", flush=True)
    for name, x in (("kernel", lse), ("emulation", emul_lse)):
        d = (x.double() - ref).abs()
        bands = " ".join(f"{d[:, a:a + 1024].max().item():.1e}" for a in range(0, T, 1024))
        print(f"  {name:9s} vs direct: rows off {(d > 1e-4).double().mean().item():.4f} max "
              f"{d.max().item():.2e}; max per 1k-row band: {bands}", flush=True)
    d = (lse - emul_lse).abs()
    print(f"  kernel vs emulation: rows off {(d > 1e-4).double().mean().item():.4f} max "
          f"{d.max().item():.2e}", flush=True)
