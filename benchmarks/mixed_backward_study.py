"""What an FP8 forward needs from its backward: gradient accuracy of the FP8 recipes against
an exact bf16 backward run on the FP8 forward's O and LSE (CPU, flamia.reference emulation,
float64 truth).

    python benchmarks/mixed_backward_study.py [--T 1024] [--d 128]

Candidates (relative Frobenius error vs float64 exact attention and its gradients, dO random):
  bf16, fp8 / fp8_mixed (per-token scales), fp8_block / fp8_block_mixed (token-block scales),
  and "fp8_block fwd + bf16 bwd": the fp8_block forward's (O, LSE) with the bf16 recipe's
  backward on the bf16 inputs (P recomputed in bf16 from Q K^T and normalised by the FP8
  forward's LSE, delta = rowsum(dO O) from the FP8 O): what the bf16 one-pass kernel computes
  if it is handed an FP8 forward's outputs. "... (bf16 lse)" uses the bf16 forward's LSE instead,
  to separate the normaliser's share of the error from O's.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flamia import reference as R  # noqa: E402
from benchmarks.scales_v2_check32k import case_and_truth  # noqa: E402


def rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def run(recipe, q, k, v, cu, do):
    out, lse, saved = R.forward(q, k, v, cu, recipe)
    o16 = out.to(q.dtype)
    return (o16,) + R.backward(do, o16, lse, saved, cu, recipe)


def fp8_fwd_bf16_bwd(q, k, v, cu, do, lse_from="fp8_block"):
    out, lse, _ = R.forward(q, k, v, cu, "fp8_block")
    o16 = out.to(q.dtype)
    _, lse_b, saved_b = R.forward(q, k, v, cu, "bf16")
    return (o16,) + R.backward(do, o16, lse if lse_from == "fp8_block" else lse_b, saved_b, cu,
                               "bf16")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--d", type=int, default=128)
    args = ap.parse_args()
    cases = [((args.T,), 8, 2, args.d, fam) for fam in ("mild", "outliers")]
    cases.append(((300, 0, 1, 2, 200, 521), 8, 2, 64, "outliers"))
    rows = []
    for lengths, hq, hkv, d, fam in cases:
        (q, k, v, cu, do), truth = case_and_truth(lengths, hq, hkv, d, fam, "cpu", 1024)
        cands = {r: run(r, q, k, v, cu, do) for r in ("bf16", "fp8", "fp8_mixed", "fp8_block",
                                                       "fp8_block_mixed")}
        cands["fp8_block fwd + bf16 bwd"] = fp8_fwd_bf16_bwd(q, k, v, cu, do)
        cands["fp8_block fwd + bf16 bwd (bf16 lse)"] = fp8_fwd_bf16_bwd(q, k, v, cu, do, "bf16")
        name = f"T={sum(lengths)} ({len(lengths)} docs) D={d} {fam}"
        for c, got in cands.items():
            errs = [rel(g, t) for g, t in zip(got, truth)]
            rows.append((name, c, errs))
            print(f"{name:32s} {c:36s} " + " ".join(f"{e:.4f}" for e in errs), flush=True)
    print("\n| case | candidate | O | dQ | dK | dV |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for name, c, errs in rows:
        print(f"| {name} | {c} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")


if __name__ == "__main__":
    main()
