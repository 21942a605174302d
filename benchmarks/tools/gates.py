"""Issue 26's and 28's criteria from committed bench JSON files (flamia.bench's schema).

    python benchmarks/tools/gates.py benchmarks/results/bench-*.json
    python benchmarks/tools/gates.py --spread benchmarks/results/bench-2026120[56]-*.json

Per workload: flamia fp8 forward+backward and forward-only speedups over the fastest bf16
baseline (the bench's own columns), and the backward (fwd+bwd median minus fwd median, same
bench) of flamia fp8 and flamia bf16 against FlashAttention-4's (>1 = flamia faster); then the
fp8 fwd+bwd geomean and which criteria hold.
"""
from __future__ import annotations

import json
import statistics
import sys

FP8_GEOMEAN = 1.10          # issue 26: fp8 fwd+bwd geomean over the workloads
FP8_LOWEST = 0.95           # issue 26: no workload below
SKELETON = 0.95             # issue 26: flamia bf16 backward / FA4's, every workload
FWD_LONG = 1.25             # issue 28: fp8 forward at the long-document workloads
FWD_LONG_WORKLOADS = ("doc32k", "doc8k_x4")


def _bwd(row: dict) -> float:
    return row["fwdbwd_ms"] - row["fwd_ms"]


def criteria(results: dict) -> dict:
    """Per workload (name -> fp8 fwd+bwd, fp8 fwd, fp8 bwd / FA4's, bf16 bwd / FA4's; the last
    two None without an FA4 row) and the verdicts."""
    per = {}
    for w in results["workloads"]:
        rows = {r["key"]: r for r in w["rows"]}
        f8, b16, fa4 = rows["flamia:fp8"], rows["flamia:bf16"], rows.get("fa4")
        per[w["workload"]["name"]] = (
            f8["speedup_fwdbwd"], f8["speedup_fwd"],
            _bwd(fa4) / _bwd(f8) if fa4 else None,
            _bwd(fa4) / _bwd(b16) if fa4 else None)
    fb = [v[0] for v in per.values()]
    gm = statistics.geometric_mean(fb)
    skel = {n: v[3] for n, v in per.items()}
    return {
        "per_workload": per,
        "fp8_geomean": gm,
        "fp8_lowest": min(fb),
        "issue26_fp8": gm >= FP8_GEOMEAN and min(fb) >= FP8_LOWEST,
        "skeleton_missed": sorted(n for n, x in skel.items() if x is None or x < SKELETON),
        "issue28_forward": all(v[1] >= (FWD_LONG if n in FWD_LONG_WORKLOADS else 1.0)
                               for n, v in per.items()),
    }


def spread(results: list[dict]) -> dict:
    """Per workload, over several suites (each a bench JSON): the fwd+bwd medians (ms) of
    FlashAttention-4, flamia fp8 and flamia bf16, as (min, median, max) over the suites that
    timed them. Gates near their edge flip between suites when the baseline moves between
    processes; this shows by how much each side moved."""
    times: dict = {}
    for res in results:
        for w in res["workloads"]:
            rows = {r["key"]: r for r in w["rows"]}
            for col, key in (("fa4", "fa4"), ("fp8", "flamia:fp8"), ("bf16", "flamia:bf16")):
                row = rows.get(key)
                if row and row.get("fwdbwd_ms"):
                    times.setdefault(w["workload"]["name"], {}).setdefault(col, []).append(
                        row["fwdbwd_ms"])
    return {name: {col: (min(xs), statistics.median(xs), max(xs)) for col, xs in cols.items()}
            for name, cols in times.items()}


def spread_report(paths: list[str]) -> str:
    sp = spread([json.load(open(p)) for p in paths])
    out = [f"fwd+bwd ms over {len(paths)} suites: min / median / max (max / min - 1)",
           f"{'workload':13s} {'FA4':>26s} {'flamia fp8':>26s} {'flamia bf16':>26s}"]
    for name, cols in sp.items():
        cells = []
        for col in ("fa4", "fp8", "bf16"):
            lo, mid, hi = cols.get(col, (None, None, None))
            cells.append("-" if lo is None else
                         f"{lo:.2f} / {mid:.2f} / {hi:.2f} ({100 * (hi / lo - 1):.0f}%)")
        out.append(f"{name:13s} " + " ".join(f"{c:>26s}" for c in cells))
    return "\n".join(out)


def report(path: str) -> str:
    c = criteria(json.load(open(path)))
    out = [path.split("/")[-1],
           f"{'workload':13s} {'fp8 fwd+bwd':>11s} {'fp8 fwd':>8s} {'fp8 bwd/FA4':>12s} "
           f"{'bf16 bwd/FA4':>13s}"]
    fmt = lambda x: "-" if x is None else f"{x:.4f}"       # noqa: E731
    for name, (fb, fwd, b8, b16) in c["per_workload"].items():
        out.append(f"{name:13s} {fb:11.4f} {fwd:8.4f} {fmt(b8):>12s} {fmt(b16):>13s}")
    out.append(f"fp8 fwd+bwd geomean {c['fp8_geomean']:.4f} (issue 26: >= {FP8_GEOMEAN}), "
               f"lowest {c['fp8_lowest']:.4f} (>= {FP8_LOWEST}): "
               f"{'holds' if c['issue26_fp8'] else 'missed'}")
    miss = c["skeleton_missed"]
    out.append(f"issue 26 skeleton gate (bf16 backward >= {SKELETON}x FA4's): "
               + ("holds" if not miss else "missed at " + ", ".join(miss)))
    out.append(f"issue 28 forward (>= {FWD_LONG}x at {' / '.join(FWD_LONG_WORKLOADS)}, >= 1.0x "
               f"everywhere): {'holds' if c['issue28_forward'] else 'missed'}")
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--spread"]:
        print(spread_report(sys.argv[2:]))
    else:
        for p in sys.argv[1:]:
            print(report(p))
