"""Compact per-kernel table from an Nsight Compute raw CSV (`ncu --import X.ncu-rep --page raw
--csv`, as the `ncu` stage of benchmarks/device_run.sh writes it).

    python benchmarks/ncu_summary.py ncu-raw.csv [--match _attn_fwd,_attn_bwd]

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


# Memory-side counters of the `detailed` set, in the order printed: how busy L2 and DRAM were and
# how many bytes crossed them (TMA loads count as L2 traffic): is a kernel fed by L2 bandwidth?
MEMORY = (("L2", "lts__throughput.avg.pct_of_peak_sustained_elapsed", "%"),
          ("L2 hit", "lts__t_sector_hit_rate.pct", "%"),
          ("L2 bytes", "lts__t_bytes.sum", "B"),
          ("L2 read sectors", "lts__t_sectors_op_read.sum", ""),
          ("DRAM", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%"),
          ("DRAM read", "dram__bytes_read.sum", "B"),
          ("mem pipes", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", "%"),
          ("L1", "l1tex__throughput.avg.pct_of_peak_sustained_active", "%"))


def _memory(hdr: list[str], units: list[str], r: list[str]) -> str:
    col = {h: i for i, h in enumerate(hdr)}
    out = []
    for label, key, unit in MEMORY:
        v = _num(r[col[key]]) if key in col else None
        if v is not None:
            u = units[col[key]] if unit != "%" else "%"
            out.append(f"{label} {v:.0f} %" if unit == "%" else f"{label} {v:.3g} {u}")
    return ", ".join(out)


def memory_columns(path: str, match: list[str]) -> str:
    """Every L2 / DRAM / L1 counter of the matching kernels, one 'kernel metric value unit' line
    each (for the metric names MEMORY does not know)."""
    rows = list(csv.reader(open(path)))
    hdr, units = rows[0], rows[1]
    keep = [i for i, h in enumerate(hdr) if h.startswith(("lts__", "dram__", "l1tex__m_"))]
    lines = []
    for r in rows[2:]:
        name = r[hdr.index("Kernel Name")]
        if match and not any(m in name for m in match):
            continue
        lines += [f"{name[:40]} {hdr[i]} {r[i]} {units[i]}" for i in keep]
    return "\n".join(lines)


def summarize(path: str, match: list[str]) -> str:
    rows = list(csv.reader(open(path)))
    hdr, units = rows[0], rows[1]
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
        mem = _memory(hdr, units, r)
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
            "  stalls: " + ", ".join(f"{k} {100 * v / total:.0f} %" for k, v in top)
            + (f"\n  memory: {mem}" if mem else ""))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--match", default="_dkdv,_dq,_attn_fwd,_attn_bwd,_quantize,_kmajor,_bwd_pre,"
                    "_bwd_post,_kvblock_cols")
    ap.add_argument("--memory-columns", default=None, help="also write every L2 / DRAM counter here")
    args = ap.parse_args()
    match = [m for m in args.match.split(",") if m]
    print(summarize(args.csv, match))
    if args.memory_columns:
        open(args.memory_columns, "w").write(memory_columns(args.csv, match) + "\n")


if __name__ == "__main__":
    main()
