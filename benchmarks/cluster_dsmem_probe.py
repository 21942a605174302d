"""Can Gluon move data between the CTAs of a cluster? A compile-only probe (CPU, sm_90a).

    python benchmarks/cluster_dsmem_probe.py

Why: at doc32k both attention kernels run at ~79 % of the L2's throughput (benchmarks/NOTES.md,
fifth 2026-12-05 session). The backward's fp32 dQ reduce-add is half of its L2 traffic per step;
two CTAs of a cluster (adjacent key blocks) could add their dQ tiles on chip, through distributed
shared memory, before one TMA reduce-add. Gluon has no explicit DSMEM or multicast builtins in
Triton 3.6, but its layouts carry a `cga_layout` (how the CTAs of a cluster tile a tensor), and
the launcher takes num_ctas (the cluster size). Each case below builds a 2-CTA kernel in which
CTA c holds slice c of a (2, 64, 128) fp32 tensor and the sum over the CTAs is stored:

    reduce   gl.sum over the CTA-split axis
    convert  gl.convert_layout to a CTA-replicated layout, then gl.sum within the CTA

Each case compiles in its own process (a failed lowering can abort it) and reports whether it
built and, if so, the PTX's cluster instructions (mapa, shared::cluster, barrier.cluster).

Triton 3.6.0 (2026-12-05): neither builds. `reduce` trips ReduceOpToLLVM's assertion
isReduceWithinCTA; `convert` lowers to nvvm.mapa on a shared-memory pointer, which the NVVM
verifier rejects (address space 3; it takes 0 or 7). Shared memory descriptors cannot reach
inline asm either, so DSMEM (and TMA multicast) is CuTe DSL's for now.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def build(case: str) -> str:
    """Compile one case for sm_90a (in this process) -> "BUILT ..." with PTX counts."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, ROOT)
    import torch
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from benchmarks.tools.compile import compile_for

    @gluon.jit
    def _cluster_sum(X, Y, CONVERT: gl.constexpr, num_warps: gl.constexpr):
        split: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, 4, 1], [2, 1, 0],
                                               [[1, 0, 0]])
        i = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, split)))
        r = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, split)))
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, split)))
        off = (gl.expand_dims(gl.expand_dims(i, 1), 2) * 8192
               + gl.expand_dims(gl.expand_dims(r, 0), 2) * 128
               + gl.expand_dims(gl.expand_dims(c, 0), 1))
        x = gl.load(X + off)
        if CONVERT:
            whole: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, 4, 1], [2, 1, 0],
                                                   [[0, 0, 0]])
            x = gl.convert_layout(x, whole)
        s = gl.sum(x, axis=0)
        ro = gl.arange(0, 64, layout=gl.SliceLayout(1, s.type.layout))
        co = gl.arange(0, 128, layout=gl.SliceLayout(0, s.type.layout))
        gl.store(Y + gl.expand_dims(ro, 1) * 128 + gl.expand_dims(co, 0), s)

    kern = compile_for(_cluster_sum, (torch.empty(2 * 64 * 128), torch.empty(64 * 128)),
                       dict(CONVERT=case == "convert", num_warps=4, num_ctas=2))
    ptx = kern.asm["ptx"]
    return "BUILT " + " ".join(f"{k}={len(re.findall(re.escape(k), ptx))}"
                               for k in ("mapa", "shared::cluster", "barrier.cluster"))


def probe(case: str) -> str:
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", case],
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    built = re.search(r"^BUILT .*$", out, re.M)
    if built:
        return built.group(0)
    why = [ln for ln in out.splitlines()
           if re.search(r"error:|Assertion", ln) and "pipeline" not in ln]
    return "FAILED: " + (why[0].strip() if why else f"exit {run.returncode}")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        print(build(sys.argv[2]), flush=True)
        return
    for case in ("reduce", "convert"):
        print(f"{case:8s} {probe(case)}", flush=True)


if __name__ == "__main__":
    main()
