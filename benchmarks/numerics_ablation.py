"""Which quantized GEMM costs the most accuracy? Swap one recipe field at a time to bf16.

Runs on the CPU through the reference emulation (flamia/reference.py):
    PYTHONPATH=. python benchmarks/numerics_ablation.py [--family outliers] [--T 1024]
"""
import argparse

import torch

from flamia import reference as R
from flamia.inputs import make_qkv, rel_err
from flamia.recipes import FP8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="outliers")
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    q, k, v, cu = make_qkv([args.T], args.heads, args.heads, args.head_dim, args.family, seed=2)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref = R.attention_exact(q64, k64, v64, cu)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = torch.autograd.grad(ref, (q64, k64, v64), dout)
    variants = {
        "fp8": FP8,
        "qk in bf16": FP8.with_(qk="bf16"),
        "P in bf16": FP8.with_(p="bf16"),
        "dP GEMM in bf16": FP8.with_(dp="bf16"),
        "dS in bf16": FP8.with_(ds="bf16"),
        "dS in e5m2": FP8.with_(ds="e5m2"),
        "no rotation": FP8.with_(rotate_qk=False),
    }
    print(f"{args.family}, T={args.T}, H={args.heads}, D={args.head_dim}: relative error vs float64")
    print(f"{'variant':18s} {'O':>8s} {'dQ':>8s} {'dK':>8s} {'dV':>8s}")
    for name, recipe in variants.items():
        out, lse, saved = R.forward(q, k, v, cu, recipe)
        o = out.to(torch.bfloat16)
        dq, dk, dv = R.backward(dout.to(torch.bfloat16), o, lse, saved, cu, recipe)
        errs = [rel_err(o, ref)] + [rel_err(g, r) for g, r in zip((dq, dk, dv), grads)]
        print(f"{name:18s} " + " ".join(f"{e:8.3g}" for e in errs))


if __name__ == "__main__":
    main()
