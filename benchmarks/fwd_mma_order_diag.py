"""Which key order does a Gluon forward variant with wgmma-ordered V^T (-m) actually apply to P?

    python benchmarks/fwd_mma_order_diag.py [CONFIG]     # H200; default the persistent -m config
    python benchmarks/fwd_mma_order_diag.py --quick CONFIG,CONFIG   # each vs the Triton forward

Runs the kernel on one 256-token document with vt8 rebuilt under each of the 24 permutations of
the 4 low column bits (column c of a 16-column group holds token perm(c)) and prints the largest
|O - O_triton| for each, against the Triton forward on token-ordered vt8: the permutation that
matches (error ~0) is the one the kernel's P operand is in. kmajor.mma_order16 is
token bits (3, 2, 1, 0) = column bits (1, 3, 2, 0).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flamia.inputs import make_qkv  # noqa: E402
from flamia.ops import forward_gluon as G  # noqa: E402
from flamia.ops.forward import attention_forward  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402


def quick(names):
    """Each config on its own vt8 order (quantize_qkv), against the Triton forward on the same
    inputs: one aligned document and packed unaligned ones (edge tiles), causal."""
    from flamia.inputs import rel_err
    for lengths in ((256,), (37, 0, 1, 70, 19, 260), (700, 1, 0, 300, 17, 129, 1000)):
        q, k, v, cu = make_qkv(lengths, 8, 2, 128, "mild", device="cuda", seed=3)
        ref, ref_l = attention_forward(quantize_qkv(q, k, v, cu, "fp8", True), cu, max(lengths),
                                       True, None, torch.bfloat16)
        for name in names:
            cfg = G.CONFIGS[name]
            qkv = quantize_qkv(q, k, v, cu, "fp8", True, vt_mma_order=cfg.mma_order)
            o, lse = G.attention_forward_gluon(qkv, cu, max(lengths), True, None, torch.bfloat16,
                                               config=cfg, poison=True)
            print(f"{name:40s} docs {lengths}: O max |d| {(o.float() - ref.float()).abs().max():.3e}"
                  f" rel {rel_err(o, ref):.2e} | LSE max |d| {(lse - ref_l).abs().max():.2e}",
                  flush=True)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--quick":
        return quick(sys.argv[2].split(","))
    name = sys.argv[1] if len(sys.argv) > 1 else G.PERSISTENT_FWD[2].name
    cfg = G.CONFIGS[name]
    T = 256
    q, k, v, cu = make_qkv((T,), 1, 1, 128, "mild", device="cuda", seed=0)
    qkv = quantize_qkv(q, k, v, cu, "fp8", True, vt_mma_order=False)
    ref, _ = attention_forward(qkv, cu, T, True, None, torch.bfloat16)
    Tp = qkv.vt8.shape[2]
    cols = torch.arange(Tp, device="cuda")
    rows = []
    for perm in itertools.permutations(range(4)):     # token bit i = column bit perm[i]
        tok = cols & -16
        for i, b in enumerate(perm):
            tok = tok | (((cols >> b) & 1) << i)
        vt = torch.zeros_like(qkv.vt8)
        ok = tok < T
        vt[:, :, ok] = qkv.v8[tok[ok]].permute(1, 2, 0)
        o, _ = G.attention_forward_gluon(dataclasses.replace(qkv, vt8=vt, vt8_mma_order=True), cu,
                                         T, True, None, torch.bfloat16, config=cfg)
        err = (o.float() - ref.float()).abs().max().item()
        rows.append((err, perm))
        print(f"token bits (3,2,1,0) = column bits {tuple(reversed(perm))}: max |dO| {err:.3e}",
              flush=True)
    err, perm = min(rows)
    print(f"{name}: best column bits {tuple(reversed(perm))} (max |dO| {err:.3e}); "
          "kmajor.mma_order16 is (1, 3, 2, 0)")


if __name__ == "__main__":
    main()
