"""The bf16 backward of one workload under Nsight Compute: flamia's one-pass sm90 kernel next to
FlashAttention-4's sm90 backward (when importable), same inputs, one process (--fp8: flamia's
fp8 recipe's one-pass kernel instead of its bf16 one; --cute: also the CuTe DSL spike's bf16
backward, benchmarks/cute_bwd_sm90.py, D=128 only).

    ncu --clock-control none --profile-from-start off --section SourceCounters ... \
        -o rep python benchmarks/ncu_bwd_sm90.py --only d64_doc8k_x4

Both forwards and warm-up backwards run outside the profiled range; inside it run exactly one
flamia backward (pre, main, post) and one FA4 backward (autograd through its forward, graph
retained), and with --cute one backward_cute (its pre and post passes are the library's), so ncu
replays the backward kernels alone. The `ncu-bwd` stage of
benchmarks/device_run.sh runs it and summarizes the report with benchmarks/ncu_source.py.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import flamia  # noqa: E402
from flamia.bench.workloads import load_workloads  # noqa: E402
from flamia.inputs import cu_seqlens_from_lengths  # noqa: E402
from flamia.ops import backward_sm90 as B  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="d64_doc8k_x4")
    ap.add_argument("--no-fa4", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="flamia's fp8 recipe's kernel (inputs of "
                    "bwd_sm90_dev.fp8_timing_inputs) instead of its bf16 one")
    ap.add_argument("--cute", action="store_true", help="also the CuTe DSL spike's bf16 "
                    "backward (benchmarks/cute_bwd_sm90.py; D=128)")
    args = ap.parse_args()
    workloads, _ = load_workloads()
    w = next(w for w in workloads if w.name == args.only)
    lengths, Hq, Hkv, D = list(w.doc_lengths), w.heads_q, w.heads_kv, w.head_dim
    T = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(T, h, D, device="cuda", generator=g).to(torch.bfloat16)
                   for h in (Hq, Hkv, Hkv, Hq))
    cu = cu_seqlens_from_lengths(lengths, device="cuda")
    L = max(lengths)
    o, lse = flamia.flamia_attn_varlen_func(q, k, v, cu, cu, L, L, recipe="bf16",
                                            return_lse=True, check_finite=False)

    if args.fp8:
        from benchmarks.bwd_sm90_dev import fp8_timing_inputs
        qkv8 = fp8_timing_inputs(q, k, v, cu, True)
        lse_b = lse.contiguous()

        def ours():
            B.attention_backward_sm90_fp8(do, o, lse_b, lse_b, qkv8, cu, True)
    else:
        def ours():
            B.attention_backward_sm90(do, o, lse, q, k, v, cu, True)

    cute = None
    if args.cute:
        if D != 128:
            raise SystemExit(f"--cute: the CuTe DSL spike is built for D=128, not {D}")
        from benchmarks.cute_bwd_sm90 import backward_cute

        def cute():
            backward_cute(do, o, lse, q, k, v, cu, True)
    fa4 = None
    if not args.no_fa4:
        try:
            from flash_attn.cute import flash_attn_varlen_func
            qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
            r = flash_attn_varlen_func(qa, ka, va, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                       max_seqlen_q=L, max_seqlen_k=L, causal=True)
            out = r[0] if isinstance(r, tuple) else r

            def fa4():
                torch.autograd.grad(out, (qa, ka, va), do, retain_graph=True)
        except Exception as e:  # noqa: BLE001
            print(f"FA4 not profiled: {type(e).__name__}: {e}"[:300])
    for _ in range(3):
        ours()
        if cute:
            cute()
        if fa4:
            fa4()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    ours()
    if cute:
        cute()
    if fa4:
        fa4()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one backward of {w.name}: flamia sm90 {'fp8' if args.fp8 else 'bf16'}"
          + (", the CuTe DSL spike bf16" if cute else "") + (" and FA4 bf16" if fa4 else ""))


if __name__ == "__main__":
    main()
