"""Where each kernel's warps wait, per SASS instruction: a summary of Nsight Compute's source page.

    ncu ... --section SourceCounters -o rep python benchmarks/ncu_call.py
    ncu --import rep.ncu-rep --page source --csv --print-source sass > source.csv
    python benchmarks/ncu_source.py source.csv [--top 30]

The warp-state sampler charges every sample to the instruction a warp is parked at (the one it
cannot issue yet), so the samples of one kernel add up to where its time goes: at the wgmma wait
(WARPGROUP.DEPBAR / ARRIVES), at an mbarrier wait (SYNCS), at a CTA barrier (BAR), behind a
shared-memory load (LDS consumers), or spread over the element-wise math (issue-bound).
Prints, per kernel: the sample total, the samples per stall reason and per opcode (largest
first), the same per reason without the samples of parked warps (below), and the top
instructions with their share and main reasons.

Parked warps: a warp that waits out the kernel at one instruction executed only a few times per
CTA (warp_specialize's padding warps of a partition's warpgroup sit at a NOP with the
"barrier" reason; the persistent forward's 3 such warps per CTA were 37 % of its samples, which
read as a 44 % barrier stall). Such instructions are told apart by their execution count: below
1 % of the kernel's most executed instruction. Columns are found by name
("Warp Stall Sampling (All Samples)", "stall_<reason>"), as ncu 2025 writes them.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import re


def blocks(text: str):
    """[(title, header, rows)] -- one CSV table per kernel. ncu precedes each table with a
    `"Kernel Name","<name>",` line (older versions: a plain line); that is the title."""
    out, title = [], ""
    header, rows = None, []
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name" or (len(row) == 1 and not row[0].startswith("0x")):
            if header is not None:
                out.append((title, header, rows))
            title = row[1] if row[0] == "Kernel Name" and len(row) > 1 else row[0]
            header, rows = None, []
        elif row[0] == "Address" and "Source" in row:
            if header is not None:
                out.append((title, header, rows))
            header, rows = row, []
        elif header is not None:
            rows.append(row)
    if header is not None:
        out.append((title, header, rows))
    return out


def number(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(src: str) -> str:
    """The SASS mnemonic (predicate and modifiers stripped to the base name plus one modifier,
    so WARPGROUP.DEPBAR and WARPGROUP.ARRIVE stay apart)."""
    s = re.sub(r"^@!?U?P\w+\s+", "", src.strip())
    m = re.match(r"([A-Z][A-Z0-9_]*)(\.[A-Z0-9_]+)?", s)
    if not m:
        return s[:16]
    base, mod = m.group(1), m.group(2) or ""
    return base + (mod if base in ("WARPGROUP", "SYNCS", "BAR", "MUFU", "F2FP", "LDS", "STS",
                                   "UTMALDG", "HGMMA", "QGMMA", "LDG", "LDL", "STL") else "")


def summarize(text: str, top: int, kernel_filter: str | None) -> str:
    lines = []
    for title, header, rows in blocks(text):
        if kernel_filter and not re.search(kernel_filter, title):
            continue
        col = {name.strip(): j for j, name in enumerate(header)}
        allc = next((j for n, j in col.items() if "Sampling (All" in n), None)
        if "Source" not in col or allc is None:
            lines.append(f"{title}: no sample column in {header[:6]}")
            continue
        # per-reason sample columns: "stall_<reason>" (issued or not), not the "(Not Issued)" copy
        reasons = [(n[6:], j) for n, j in col.items() if n.startswith("stall_") and "(" not in n]

        def cell(r, j):
            return number(r[j]) if j is not None and j < len(r) else 0.0
        execc = col.get("Instructions Executed")
        data, execs = [], []
        for r in rows:
            if len(r) <= allc:
                continue
            data.append((r[col["Address"]][-5:], r[col["Source"]], cell(r, allc),
                         {name: cell(r, j) for name, j in reasons}))
            execs.append(cell(r, execc))
        total = sum(d[2] for d in data) or 1.0
        by_reason = collections.Counter()
        by_op = collections.Counter()
        for _, src, n, rs in data:
            by_op[opcode(src)] += n
            by_reason.update(rs)
        lines.append(f"\n## {title}\n{len(data)} instructions, {total:.0f} samples")
        lines.append("by reason: " + ", ".join(f"{k} {v / total:.1%}"
                                               for k, v in by_reason.most_common(10)))
        lines.append("by opcode: " + ", ".join(f"{op} {n / total:.1%}"
                                               for op, n in by_op.most_common(18)))
        if execc is not None and execs:
            rare = 0.01 * max(execs)
            parked, busy = 0.0, collections.Counter()
            for (_, _, n, rs), e in zip(data, execs):
                if e < rare:
                    parked += n
                else:
                    busy.update(rs)
            rest = (total - parked) or 1.0
            lines.append(f"parked warps (at instructions executed < 1 % as often as the most "
                         f"executed one): {parked / total:.1%} of samples; the rest by reason: "
                         + ", ".join(f"{k} {v / rest:.1%}" for k, v in busy.most_common(8)))
        lines.append("top instructions (share of samples, its main reasons, address, SASS):")
        for a, src, n, rs in sorted(data, key=lambda d: -d[2])[:top]:
            why = ", ".join(f"{k} {v / n:.0%}" for k, v in
                            sorted(rs.items(), key=lambda kv: -kv[1])[:2] if v > 0)
            lines.append(f"  {n / total:6.2%}  {why:<32} {a:>6}  {src.strip()[:80]}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--kernel", default=None, help="regex on the kernel title")
    args = ap.parse_args()
    with open(args.csv, errors="replace") as f:
        print(summarize(f.read(), args.top, args.kernel))


if __name__ == "__main__":
    main()
