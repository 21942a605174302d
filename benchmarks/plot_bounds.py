"""Plot what the kernels reach and what their timing diagnostics bound, against cuDNN.

    python benchmarks/plot_bounds.py benchmarks/results/bounds-20261201-6cb35b2.log \
        benchmarks/results/bounds-fwd-20261201-5952065.log --out bounds.png

Reads the logs of the device stages `bounds` and `bounds-fwd` (benchmarks/graph_timing.py over
the suite, then the train shape; GPU time of CUDA-graph replays, every column in one process)
and draws, per workload, each spec's speed relative to the first spec (cuDNN ragged bf16) with
the issues' targets as lines. The diagnostic columns compute WRONG results: they time the
kernels with the per-element work of per-token scaling (or all of it) left out, an upper bound
of what removing that work could give with the same tiles, loads and launches.
"""
from __future__ import annotations

import argparse
import re


def parse_log(path: str):
    """(specs, {workload: {spec: ms}}): the suite's summary table and the train shape's table."""
    text = open(path).read()
    head = re.search(r"columns: (.+)", text)
    if head is None:
        raise ValueError(f"{path}: no summary table (graph_timing --workloads)")
    specs = head.group(1).strip().split(", ")
    rows = {}
    summary = text[head.end():].split("\n== ", 1)
    for line in summary[0].splitlines()[2:]:
        cells = line.split()
        if not cells or cells[0] == "geomean":
            break
        values = [float(c) for c in cells[1:] if re.fullmatch(r"\d+\.\d+", c)]
        rows[cells[0]] = dict(zip(specs, values))
    if len(summary) > 1:   # the single-shape table that follows: recipe, eager, graph, ratio
        train = {}
        for line in summary[1].splitlines():
            cells = line.split()
            if len(cells) >= 3 and cells[0] in specs:
                train[cells[0]] = float(cells[2])
        if train:
            rows["train shape"] = train
    return specs, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("fwdbwd_log")
    ap.add_argument("fwd_log")
    ap.add_argument("--out", default="bounds.png")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "fp8": "flamia fp8",
        "fp8@FLAMIA_BWD_DIAG=1": "backward without per-element work",
        "fp8@FLAMIA_BWD_DIAG=1@FLAMIA_FWD_DIAG=1@FLAMIA_PERSISTENT_FWD=0":
            "+ forward without per-key scales",
        "fp8@FLAMIA_PERSISTENT_FWD=0": "Triton forward",
        "fp8@FLAMIA_FWD_DIAG=1@FLAMIA_PERSISTENT_FWD=0": "Triton forward without per-key scales",
    }
    panels = [(args.fwdbwd_log, "forward + backward", [(1.3, "#6: 1.3x geomean"),
                                                        (1.15, "#6: 1.15x each")]),
              (args.fwd_log, "forward (quantization included)", [(1.4, "#4: 1.4x each")])]
    fig, axes = plt.subplots(1, 2, figsize=(15, 6), sharey=True)
    for ax, (path, title, targets) in zip(axes, panels):
        specs, rows = parse_log(path)
        base, others = specs[0], specs[1:]
        names = list(rows)
        width = 0.8 / len(others)
        for k, spec in enumerate(others):
            xs = [i + (k - (len(others) - 1) / 2) * width for i in range(len(names))]
            ys = [rows[n][base] / rows[n][spec] for n in names]
            bars = ax.bar(xs, ys, width, label=labels.get(spec, spec))
            for b, y in zip(bars, ys):
                ax.text(b.get_x() + b.get_width() / 2, y + 0.01, f"{y:.2f}", ha="center",
                        va="bottom", fontsize=6.5)
        ax.axhline(1.0, color="black", lw=0.8)
        for y, what in targets:
            ax.axhline(y, color="tab:red", ls="--", lw=0.9)
            ax.text(-0.45, y + 0.01, what, color="tab:red", ha="left", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
        ax.set_title(f"{title}: x of cuDNN ragged bf16 (GPU time)", fontsize=10)
        ax.set_ylim(0, 1.6)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    axes[0].set_ylabel("speed relative to cuDNN ragged bf16 (>1: faster)")
    fig.suptitle("H200: flamia fp8 and its timing bounds (diagnostic columns compute wrong "
                 "results)", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
