"""One public fp8 call under Nsight Compute: hardware counters of every kernel it launches.

    ncu --clock-control none --profile-from-start off --set detailed -o $OUT/ncu \
        python benchmarks/ncu_call.py --only doc8k_x4

Warm-up calls (compilation, memo) run outside the profiled range; one forward+backward call
runs between cudaProfilerStart / Stop, so ncu replays exactly the kernels of one user call.
`--forward-only` profiles the training forward alone. (Firecracker devices only: on gVisor ncu
cannot read the counters.)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flamia.bench.workloads import load_workloads  # noqa: E402
from flamia.inputs import make_qkv  # noqa: E402

from profile_call import call_fn  # noqa: E402  (benchmarks/: the same call profile_call times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="doc8k_x4")
    ap.add_argument("--recipe", default="fp8")
    ap.add_argument("--forward-only", action="store_true")
    args = ap.parse_args()
    workloads, _ = load_workloads()
    w = next(w for w in workloads if w.name == args.only)
    q, k, v, cu = make_qkv(tuple(w.doc_lengths), w.heads_q, w.heads_kv, w.head_dim, "mild",
                           device="cuda", seed=0)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    call = call_fn(q, k, v, cu, max(w.doc_lengths), args.recipe, dout, args.forward_only)
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one {args.recipe} call of {w.name}")


if __name__ == "__main__":
    main()
