"""The host side of one fp8 / bf16 attention call, on a CPU: what the kernel path issues per
forward and per backward (launches by kernel, torch operations that launch a CUDA kernel,
allocations, TMA descriptors, device syncs), whether a second call with the same cu_seqlens
rebuilds metadata, and the host time of our Python plus Triton's binder per call
(benchmarks/tools/host_inventory.py says what that time leaves out).

    python benchmarks/host_cpu.py                  # table
    python benchmarks/host_cpu.py --json           # one REPORT<json> line (tests/test_host_path.py)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from benchmarks.tools.host_inventory import host_inventory, memo_entries, stubbed_sm90  # noqa: E402
from flamia.kernel_path import kernel_backward, kernel_forward  # noqa: E402

# (name, recipe, head dim, document lengths, Hq, Hkv)
CASES = (("fp8 D=128", "fp8", 128, [512] * 8, 8, 2),
         ("fp8 D=64", "fp8", 64, [512] * 8, 8, 2),
         ("bf16 D=128", "bf16", 128, [512] * 8, 8, 2))


def inputs(lens, hq, hkv, d):
    T = sum(lens)
    q = torch.randn(T, hq, d).to(torch.bfloat16)
    k, v = (torch.randn(T, hkv, d).to(torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu, torch.randn_like(q), max(lens)


def inventory(recipe, d, lens, hq, hkv) -> dict:
    """The second call's forward and backward (the first builds the metadata memoized on
    cu_seqlens: its extra torch operations are counted apart)."""
    q, k, v, cu, do, L = inputs(lens, hq, hkv, d)
    with host_inventory() as first:
        out, lse, qkv = kernel_forward(q, k, v, cu, L, recipe, True, None)
        kernel_backward(do, out, lse, qkv, cu, L, True, None, False)
    memo = memo_entries(cu)
    with host_inventory() as fwd:
        out, lse, qkv = kernel_forward(q, k, v, cu, L, recipe, True, None)
    with host_inventory() as bwd:
        kernel_backward(do, out, lse, qkv, cu, L, True, None, False)
    steady = len(fwd.torch_kernels) + len(bwd.torch_kernels)
    return {"forward": fwd.as_dict(), "backward": bwd.as_dict(), "memo_entries": memo,
            "memo_entries_after_second_call": memo_entries(cu),
            "first_call_extra_torch_kernels": len(first.torch_kernels) - steady}


def host_ms(recipe, d, lens, hq, hkv, calls: int = 30) -> float:
    q, k, v, cu, do, L = inputs(lens, hq, hkv, d)
    with stubbed_sm90():
        def call():
            out, lse, qkv = kernel_forward(q, k, v, cu, L, recipe, True, None)
            kernel_backward(do, out, lse, qkv, cu, L, True, None, False)
        call()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - t0) / calls * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = {name: inventory(r, d, lens, hq, hkv) for name, r, d, lens, hq, hkv in CASES}
    if args.json:
        print("REPORT" + json.dumps(report))
        return
    print("Per call once cu_seqlens' metadata is memoized (the first call builds it: its torch "
          "operations in the last column).\n\n| call | pass | launches | torch kernels | "
          "allocations | descriptors | syncs | host ms per call (CPU) | first call's extra "
          "torch ops |\n|---|---|---|---|---|---|---|---|---|")
    for name, r, d, lens, hq, hkv in CASES:
        ms = host_ms(r, d, lens, hq, hkv)
        for p in ("forward", "backward"):
            x = report[name][p]
            print(f"| {name} | {p} | {len(x['launches'])}: {', '.join(x['launches'])} | "
                  f"{len(x['torch_kernels'])}: {', '.join(x['torch_kernels'])} | "
                  f"{x['allocations']} | {x['descriptors']} | {len(x['syncs'])} | "
                  f"{ms:.2f} | {report[name]['first_call_extra_torch_kernels']} |")


if __name__ == "__main__":
    main()
