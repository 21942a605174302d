"""Where each kernel's warps wait, per SASS instruction: a summary of Nsight Compute's source page.

    ncu ... --section SourceCounters -o rep python benchmarks/ncu_call.py
    ncu --import rep.ncu-rep --page source --csv --print-source sass > source.csv
    python benchmarks/ncu_source.py source.csv [--top 30]

The warp-state sampler charges every sample to the instruction a warp is parked at (the one it
cannot issue yet), so the samples of one kernel add up to where its time goes: at the wgmma wait
(WARPGROUP.DEPBAR / ARRIVES), at an mbarrier wait (SYNCS), at a CTA barrier (BAR), behind a
shared-memory load (LDS consumers), or spread over the element-wise math (issue-bound).
Prints, per kernel: the sample total, the samples per opcode (largest first), and the top
instructions with their share. Column names differ between ncu versions, so the sample column
is found by name ("Warp Stall Sampling (All ...") and the header is echoed once.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import re


def blocks(text: str):
    """[(title, header, rows)] -- one CSV table per kernel; a title is the last non-CSV line
    before the table's header (ncu prints the kernel's name there)."""
    out, title, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith('"') and "Address" in line and "Source" in line:
            header = next(csv.reader([line]))
            rows = []
            i += 1
            while i < len(lines) and lines[i].startswith('"') and not (
                    "Address" in lines[i] and "Source" in lines[i]):
                rows.append(next(csv.reader(io.StringIO(lines[i]))))
                i += 1
            out.append((title, header, rows))
            continue
        if line.strip() and not line.startswith('"'):
            title = line.strip()
        elif line.startswith('"') and not out and not title:
            title = line.strip()
        i += 1
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
    echoed = False
    for title, header, rows in blocks(text):
        if kernel_filter and not re.search(kernel_filter, title):
            continue
        cols = {name: j for j, name in enumerate(header)}
        src = next((j for n, j in cols.items() if n.strip() == "Source"), None)
        addr = next((j for n, j in cols.items() if n.strip() == "Address"), None)
        allc = next((j for n, j in cols.items() if "Sampling (All" in n), None)
        noti = next((j for n, j in cols.items() if "Not-issued" in n or "Not Issued" in n), None)
        if not echoed:
            lines.append("columns: " + " | ".join(header))
            echoed = True
        if src is None or allc is None:
            lines.append(f"{title}: no sample column")
            continue
        data = [(r[addr] if addr is not None else "", r[src], number(r[allc]),
                 number(r[noti]) if noti is not None else 0.0) for r in rows if len(r) > allc]
        total = sum(d[2] for d in data) or 1.0
        lines.append(f"\n## {title}\n{len(data)} instructions, {total:.0f} samples "
                     f"({sum(d[3] for d in data) / total:.0%} not issued)")
        by_op = collections.Counter()
        for _, s, n, _ in data:
            by_op[opcode(s)] += n
        lines.append("by opcode: " + ", ".join(f"{op} {n / total:.1%}"
                                               for op, n in by_op.most_common(18)))
        lines.append("top instructions (share of samples, not-issued share, SASS):")
        for a, s, n, ni in sorted(data, key=lambda d: -d[2])[:top]:
            lines.append(f"  {n / total:6.2%} {ni / total:6.2%}  {a:>8}  {s.strip()[:90]}")
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
