"""A/B on the GPU, one process: flamia's calls with flamia.ops.launch's compiled-kernel path
(later calls of a specialization skip Triton's binder) against every launch through Triton's
own path (launch.HAVE_FAST_LAUNCH off). Same kernels, same bytes: the difference is host time,
which shows wherever the host issues a call slower than the GPU runs it (short documents).

    python benchmarks/fast_launch_ab.py [--workloads doc512_x64,...] [--recipes fp8,bf16]
        [--rounds 5]          # recipes: fp8 by default

Per workload and recipe, the suite's timing (flamia.bench: the public API on autograd leaves,
back-to-back calls each between its own CUDA events, the median) of the forward and of
forward+backward, the two paths interleaved over --rounds rounds; outputs and gradients of the
two paths are compared first (out, dk, dv bitwise; dq, summed by unordered reduce-adds, by its
largest difference). Also the host time alone: the median wall time to issue
one forward+backward call with the GPU kept busy (a long kernel queued ahead), per path.
A short table comes last.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flamia.bench.baselines import FlamiaImpl, make_inputs  # noqa: E402
from flamia.bench.timing import TimingSettings, cuda_time, l2_bytes, n_copies_for  # noqa: E402
from flamia.bench.workloads import load_workloads  # noqa: E402
from flamia.ops import launch  # noqa: E402

TIMING = TimingSettings(warmup=3, reps=30, min_reps=5, target_s=0.5)
DEFAULT = "doc512_x64,doc2k_x16,d64_longtail,longtail,doc32k"


def issue_ms(bound, calls: int = 15) -> float:
    """Median host time to issue one forward+backward while the GPU is busy elsewhere."""
    times = []
    for i in range(calls):
        torch.cuda._sleep(20_000_000)     # ~12 ms of GPU work queued: the host never waits
        t0 = time.perf_counter()
        bound.fwdbwd(i % bound.n_copies)
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=DEFAULT)
    ap.add_argument("--recipes", default="fp8")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    workloads = {w.name: w for w in load_workloads()[0]}
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for name in args.workloads.split(","):
        w = workloads[name]
        inputs = make_inputs(w.problem())
        n_copies = n_copies_for(inputs.nbytes(), l2_bytes())
        for recipe in args.recipes.split(","):
            bound = FlamiaImpl(recipe).build(w.problem(), inputs, n_copies)
            outs = {}
            for fast in (False, True):
                launch.HAVE_FAST_LAUNCH = fast
                bound.outputs()                     # the compiled kernels, both paths
                outs[fast] = [x.clone() for x in bound.outputs()]
            # out, dk, dv bitwise; dq is summed by unordered fp32 reduce-adds (not deterministic
            # between any two calls), so its largest difference
            o0, dq0, dk0, dv0 = outs[False]
            o1, dq1, dk1, dv1 = outs[True]
            same = (f"{all(torch.equal(a, b) for a, b in ((o0, o1), (dk0, dk1), (dv0, dv1)))}"
                    f" dq{(dq0.float() - dq1.float()).abs().max().item():.1e}")
            t = {(fast, what): [] for fast in (False, True) for what in ("fwd", "fwdbwd", "host")}
            for r in range(args.rounds):
                for fast in ((False, True) if r % 2 == 0 else (True, False)):
                    launch.HAVE_FAST_LAUNCH = fast
                    t[fast, "fwd"].append(cuda_time(bound.fwd, bound.n_copies,
                                                    TIMING).median_ms)
                    t[fast, "fwdbwd"].append(cuda_time(bound.fwdbwd, bound.n_copies,
                                                       TIMING).median_ms)
                    t[fast, "host"].append(issue_ms(bound))
            med = {k: statistics.median(v) for k, v in t.items()}
            row = (name, recipe, same, *(med[False, x] for x in ("fwd", "fwdbwd", "host")),
                   *(med[True, x] for x in ("fwd", "fwdbwd", "host")))
            rows.append(row)
            print(f"{name} {recipe} bitwise={same} " + " ".join(
                f"{k[1]}[{'fast' if k[0] else 'triton'}]={[round(x, 4) for x in v]}"
                for k, v in t.items()), flush=True)
            bound.close()
        launch.HAVE_FAST_LAUNCH = True
    print("\n| workload | recipe | out dk dv bitwise, dq | fwd ms triton / fast "
          "| fwd+bwd ms triton / fast | ratio fwd / fwd+bwd | host ms per fwd+bwd triton / fast |")
    print("|---|---|---|---|---|---|---|")
    for name, recipe, same, f0, b0, h0, f1, b1, h1 in rows:
        print(f"| {name} | {recipe} | {same} | {f0:.3f} / {f1:.3f} | {b0:.3f} / {b1:.3f} "
              f"| {f1 / f0:.3f} / {b1 / b0:.3f} | {h0:.3f} / {h1:.3f} |")


if __name__ == "__main__":
    main()
