"""CPU: how many partition-wide bar.syncs Triton's Gluon puts around mbarrier operations.

Builds small warp-specialized kernels for sm_90a (nothing runs) whose compute partition loops
over one pattern of mbarrier waits / arrives, and counts the bar.sync instructions the PTX has
inside that loop. The one-pass backward's compute partition has four per step
(benchmarks/NOTES.md, 2026-12-05): this shows which operations bring them.

    python benchmarks/mbarrier_sync_probe.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from benchmarks.tools.compile import compile_only  # noqa: E402
from flamia.ops.gluon_common import HAVE_GLUON, alloc_barriers  # noqa: E402

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    @gluon.jit
    def _producer(a_bars, N):
        for i in range(N):
            mbarrier.arrive(a_bars.index(i % 2), count=1)

    @gluon.jit
    def _compute(a_bars, c_bars, N, PATTERN: gl.constexpr, num_warps: gl.constexpr):
        for i in range(N):
            s = i % 2
            if PATTERN == 0:      # one wait
                mbarrier.wait(a_bars.index(s), (i // 2) & 1)
            if PATTERN == 1:      # two waits on different rings
                mbarrier.wait(a_bars.index(s), (i // 2) & 1)
                mbarrier.wait(c_bars.index(s), (i // 2) & 1)
            if PATTERN == 2:      # one arrive
                mbarrier.arrive(c_bars.index(s), count=1)
            if PATTERN == 3:      # two arrives on different barriers, back to back
                mbarrier.arrive(c_bars.index(s), count=1)
                mbarrier.arrive(c_bars.index(1 - s), count=1)
            if PATTERN == 4:      # a wait, then an arrive (a consumer's acquire / release)
                mbarrier.wait(a_bars.index(s), (i // 2) & 1)
                mbarrier.arrive(c_bars.index(s), count=1)

    @gluon.jit
    def _probe_kernel(N, PATTERN: gl.constexpr, WARPS: gl.constexpr):
        a_bars = alloc_barriers(2)
        c_bars = alloc_barriers(2)
        gl.warp_specialize([(_compute, (a_bars, c_bars, N, PATTERN, WARPS)),
                            (_producer, (a_bars, N))], [1], [24])

PATTERNS = ["one wait", "two waits", "one arrive", "two arrives", "wait + arrive"]


def loop_bar_syncs(ptx: str) -> int:
    """bar.sync instructions between the compute loop's label and its back edge: the PTX lines
    whose .loc points into _compute's loop body."""
    first = _compute.fn.__code__.co_firstlineno
    lines = range(first + 1, first + 20)
    n, inside = 0, False
    for line in ptx.splitlines():
        t = line.strip()
        if t.startswith(".loc"):
            where = t.split("//")[-1].strip()
            inside = os.path.basename(__file__) + ":" in where and \
                int(where.split(":")[1]) in lines and "@[" not in where.split(" ", 1)[0]
        elif inside and t.startswith("bar.sync"):
            n += 1
    return n


def main():
    if not HAVE_GLUON:
        sys.exit("needs triton's Gluon")
    print("| pattern in the compute loop | bar.sync per iteration, 4-warp partition | 8-warp |")
    print("| --- | --- | --- |")
    for p, name in enumerate(PATTERNS):
        counts = []
        for warps in (4, 8):
            with compile_only() as built:
                _probe_kernel[(1,)](10, PATTERN=p, WARPS=warps, num_warps=warps)
            counts.append(loop_bar_syncs(dict(built)["_probe_kernel"].asm["ptx"]))
        print(f"| {name} | {counts[0]} | {counts[1]} |")


if __name__ == "__main__":
    main()
