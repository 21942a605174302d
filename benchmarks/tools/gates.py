"""Issue 26's and 28's criteria from committed bench JSON files (flamia.bench's schema).

    python benchmarks/tools/gates.py benchmarks/results/bench-*.json

Per workload: flamia fp8 forward+backward and forward-only speedups over the fastest bf16
baseline (the bench's own columns), and the backward (fwd+bwd median minus fwd median, same
bench) of flamia fp8 and flamia bf16 against FlashAttention-4's (>1 = flamia faster); then the
fp8 fwd+bwd geomean and which criteria hold.
"""
from __future__ import annotations

import json
import math
import sys


def _bwd(row: dict) -> float:
    return row["fwdbwd_ms"] - row["fwd_ms"]


def gates(path: str) -> None:
    d = json.load(open(path))
    print(path.split("/")[-1])
    print(f"{'workload':13s} {'fp8 fwd+bwd':>11s} {'fp8 fwd':>8s} {'fp8 bwd/FA4':>12s} "
          f"{'bf16 bwd/FA4':>13s}")
    fb, fwd, skel = [], [], []
    for w in d["workloads"]:
        rows = {r["key"]: r for r in w["rows"]}
        f8, b16 = rows["flamia:fp8"], rows["flamia:bf16"]
        fa4 = [r for r in w["rows"] if r["impl"].startswith("FlashAttention-4")]
        name = w["workload"]["name"]
        fb.append(f8["speedup_fwdbwd"])
        fwd.append((name, f8["speedup_fwd"]))
        if fa4:
            skel.append((name, _bwd(fa4[0]) / _bwd(b16)))
            print(f"{name:13s} {f8['speedup_fwdbwd']:11.4f} {f8['speedup_fwd']:8.4f} "
                  f"{_bwd(fa4[0]) / _bwd(f8):12.4f} {skel[-1][1]:13.4f}")
        else:
            print(f"{name:13s} {f8['speedup_fwdbwd']:11.4f} {f8['speedup_fwd']:8.4f} (no FA4 row)")
    gm = math.exp(sum(map(math.log, fb)) / len(fb))
    print(f"fp8 fwd+bwd geomean {gm:.4f} (issue 26: >= 1.10), lowest {min(fb):.4f} (>= 0.95)")
    low = [n for n, x in skel if x < 0.95]
    print("issue 26 skeleton gate (bf16 bwd >= 0.95x FA4's):",
          "holds" if skel and not low else f"missed at {', '.join(low) or 'no FA4 rows'}")
    long_ok = all(x >= 1.25 for n, x in fwd if n in ("doc32k", "doc8k_x4"))
    print("issue 28 forward (>= 1.25x doc32k / doc8k_x4, >= 1.0x everywhere):",
          "holds" if long_ok and all(x >= 1.0 for _, x in fwd) else "missed")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        gates(p)
