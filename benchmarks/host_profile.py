"""Where the host time of one flamia call goes (H200 machine): cProfile of back-to-back calls.

    python benchmarks/host_profile.py                         # doc512_x64, fp8, fwd+bwd
    python benchmarks/host_profile.py --only doc2k_x16 --forward-only --top 40
    python benchmarks/host_profile.py --docs 2048x14,1024x4 --heads 8/2 --head-dim 64   # train-check

benchmarks/profile_call.py measures the host issue time per call (1.9-2.9 ms per fp8 fwd+bwd
on the H200 machine's CPU, session 5) against the kernels' GPU time; at doc512_x64 the two are
about equal, so a faster kernel set would be host-bound. This script says which Python
functions and torch / Triton calls that time is spent in: warm-up calls first (compiles,
metadata memo), then `--calls` calls under cProfile with one synchronize at the end, sorted by
own time and by cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flamia.inputs import make_qkv  # noqa: E402

from profile_call import add_workload_flags, call_fn, workloads_of  # noqa: E402  (benchmarks/ is on sys.path as the script dir)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="doc512_x64")
    ap.add_argument("--recipe", default="fp8")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--forward-only", action="store_true")
    add_workload_flags(ap)
    args = ap.parse_args()
    workloads = workloads_of(args)
    if args.docs:
        args.only = "docs"
    for w in workloads:
        if w.name not in args.only.split(","):
            continue
        q, k, v, cu = make_qkv(tuple(w.doc_lengths), w.heads_q, w.heads_kv, w.head_dim, "mild",
                               device="cuda", seed=0)
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        fn = call_fn(q, k, v, cu, max(w.doc_lengths), args.recipe, torch.randn_like(q),
                     args.forward_only)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        prof.disable()
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key)
            st.print_stats(args.top)
            print(f"== {w.name} {args.recipe} {'fwd' if args.forward_only else 'fwd+bwd'}: "
                  f"{args.calls} calls, sorted by {key} (times are totals over the calls)")
            print("\n".join(line for line in s.getvalue().splitlines()
                            if line.strip() and not line.startswith(("   Ordered", "   List"))))


if __name__ == "__main__":
    main()
