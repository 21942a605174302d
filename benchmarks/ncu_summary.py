"""Compact per-kernel table from an Nsight Compute raw CSV (`ncu --import X.ncu-rep --page raw
--csv`, as the `ncu` stage of benchmarks/device_run.sh writes it).

    python benchmarks/ncu_summary.py ncu-raw.csv [--match _dkdv,_dq,_attn_fwd]

Per kernel: duration, warp instructions, issue-slot and tensor-pipe utilisation, the busiest
other pipes, registers, local-memory (spill) traffic, and the stall reasons of the PC sampler
as shares of all samples: enough to say whether a kernel is bound by its instruction stream,
its dependency latency, memory, or the tensor cores.
"""
from __future__ import annotations

import argparse
import csv


def _num(x: str) -> float | None:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return None


def summarize(path: str, match: list[str]) -> str:
    rows = list(csv.reader(open(path)))
    hdr = rows[0]
    col = {h: i for i, h in enumerate(hdr)}
    lines = []
    for r in rows[2:]:                      # row 1: units
        name = r[col["Kernel Name"]]
        if match and not any(m in name for m in match):
            continue

        def g(key):
            return _num(r[col[key]]) if key in col else None
        inst = g("smsp__inst_executed.sum")
        local = (g("smsp__sass_inst_executed_op_local_ld.sum") or 0) + \
                (g("smsp__sass_inst_executed_op_local_st.sum") or 0)
        pipes = {p: g(f"sm__inst_executed_pipe_{p}.avg.pct_of_peak_sustained_active")
                 for p in ("alu", "fma", "xu", "lsu")}
        stalls = {h[len("smsp__pcsamp_warps_issue_stalled_"):]: _num(r[i]) or 0.0
                  for i, h in enumerate(hdr)
                  if h.startswith("smsp__pcsamp_warps_issue_stalled_")
                  and not h.endswith("_not_issued")}
        total = sum(stalls.values()) or 1.0
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:7]
        lines.append(
            f"{name[:60]}\n"
            f"  {g('gpu__time_duration.sum') or 0:.3f} ms, {inst or 0:.3g} warp instructions, "
            f"issue {g('sm__issue_active.avg.pct_of_peak_sustained_elapsed') or 0:.0f} %, tensor "
            f"{g('sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed') or 0:.0f} %, "
            + ", ".join(f"{p} {v:.0f} %" for p, v in pipes.items() if v is not None)
            + f"; {g('launch__registers_per_thread') or 0:.0f} regs, grid "
            f"{g('launch__grid_size') or 0:.0f}, local ld+st {local:.3g}"
            + (f" ({100 * local / inst:.1f} % of instructions)" if inst else "") + "\n"
            f"  stalls: " + ", ".join(f"{k} {100 * v / total:.0f} %" for k, v in top))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--match", default="_dkdv,_dq,_attn_fwd,_quantize,_kmajor,_bwd_pre")
    args = ap.parse_args()
    print(summarize(args.csv, [m for m in args.match.split(",") if m]))


if __name__ == "__main__":
    main()
