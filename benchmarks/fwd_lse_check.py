"""Which forward configs reproduce the reference emulation's LSE on outlier inputs (H200).

    python benchmarks/fwd_lse_check.py

For tests/gpu/test_forward_gpu.py::test_forward_matches_reference[fp8-128-*]: per config of
that test, the fraction of rows whose lse differs from the emulation by more than 1e-4 and
the largest difference; the output's relative error vs the emulation's.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))

import torch  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
from test_forward_gpu import CONFIGS, HKV, HQ, WORKLOADS, _references  # noqa: E402

from flamia.inputs import make_qkv, rel_err  # noqa: E402
from flamia.ops.forward import attention_forward  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402

for family in ("outliers", "mild"):
    q, k, v, cu = make_qkv(WORKLOADS["doc8k"], HQ, HKV, 128, family, device="cuda", seed=1)
    emul, emul_lse, exact = _references(q, k, v, cu, "fp8")
    qkv = quantize_qkv(q, k, v, cu, "fp8", True)
    for name, cfg in CONFIGS.items():
        out, lse = attention_forward(qkv, cu, 8192, True, None, q.dtype, config=cfg, poison=True)
        d = (lse - emul_lse).abs()
        print(f"{family:8s} {name:10s} lse rows off {(d > 1e-4).double().mean().item():.4f} "
              f"max {d.max().item():.2e}  out rel err vs exact {rel_err(out, exact):.3e} "
              f"(emulation {rel_err(emul, exact):.3e})", flush=True)
