"""A/B of quantize_qkv (the fp8 recipe's quantization) on the H200, in one process: the working
tree under launch configs (config.QuantizeConfig) against copies of flamia/ops/quantize.py
(e.g. `git show HEAD:flamia/ops/quantize.py > base.py`).

    python benchmarks/quant_ab.py --ab base=base.py [--workloads doc512_x64,...]
        [--configs 64:4:8,128:8:8:128:4]    # tokens per q program : q warps : K/V warps
                                            #   [: V columns per program : their warps]

Per workload: every variant's outputs (q8, the K / V block and diagonal copies, scales, vcap,
vnorm) compared with the working tree's default (bytes that differ: rotation ties only are
expected when the rotation's summation order differs), then CUDA-event medians of the whole
quantize_qkv call, variants interleaved over --rounds rounds. A short table comes last.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks.bwd_sm90_dev import cuda_ms, load_ab_base  # noqa: E402
from flamia.bench.workloads import load_workloads  # noqa: E402
from flamia.inputs import make_qkv  # noqa: E402
from flamia.ops import quantize as current  # noqa: E402
from flamia.ops.config import QuantizeConfig  # noqa: E402

FIELDS = ("q8", "k8", "v8", "sq", "sk", "sv", "k8_diag", "v8_diag", "sk_diag", "sv_diag", "vcap",
          "vnorm", "vt8", "vt8_diag", "scale_cols")


def differ(a, b) -> int:
    """Elements that differ (NaN == NaN)."""
    if a.dtype.itemsize == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
        return int((a != b).sum())
    return int(((a != b) & ~(a.isnan() & b.isnan())).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ab", default="", help="name=path,... copies of quantize.py")
    ap.add_argument("--workloads", default="doc512_x64,doc32k,d64_doc8k_x4")
    ap.add_argument("--configs", default="", help="block_t:q_warps:kv_warps[:cols_block:"
                    "cols_warps],... of the working tree's kernels (config.QuantizeConfig), "
                    "besides the default")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    mods = {}
    for item in filter(None, args.ab.split(",")):
        name, path = item.split("=")
        mods[name] = load_ab_base(path, "ab_" + name)
    configs = {"current": None}
    for c in filter(None, args.configs.split(",")):
        configs[f"current {c}"] = QuantizeConfig(*(int(x) for x in c.split(":")))
    suite = {w.name: w for w in load_workloads()[0]}
    rows = []
    for wname in args.workloads.split(","):
        w = suite[wname]
        q, k, v, cu = make_qkv(w.doc_lengths, w.heads_q, w.heads_kv, w.head_dim, "outliers",
                               device="cuda", seed=0)
        variants = {name: (lambda c=c: current.quantize_qkv(q, k, v, cu, "fp8", True, launch=c))
                    for name, c in configs.items()}
        variants.update({name: (lambda m=m: m.quantize_qkv(q, k, v, cu, "fp8", True))
                         for name, m in mods.items()})
        ref = variants["current"]()
        checks = {}
        for name, fn in variants.items():
            got = fn()
            checks[name] = {f: differ(getattr(got, f), getattr(ref, f)) for f in FIELDS
                            if getattr(ref, f) is not None}
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(cuda_ms(fn))
        row = {"workload": wname} | {n: statistics.median(t) for n, t in times.items()}
        print(row, {n: {f: c for f, c in ch.items() if c} for n, ch in checks.items()}, flush=True)
        rows.append(row)
    names = list(rows[0])[1:]
    print("\n| workload | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 1))
    for r in rows:
        print(f"| {r['workload']} | " + " | ".join(f"{r[n]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()
