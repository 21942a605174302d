"""Forward+backward through the public API with the persistent forward's tile loop swapped, in one
process, interleaved rounds (H200): did a forward change move the fwd+bwd time?

    python benchmarks/fwdbwd_ab.py --only doc512_x64,doc2k_x16 --reps 40 --rounds 3

Variants: the default (forward_gluon.PERSISTENT_FWD[0]) and each config named by --alt (default:
PERSISTENT_FWD[1], session 10's tile loop), installed as PERSISTENT_FWD[0] for its rounds.
Timing as flamia.bench: reps queued back to back between two CUDA events, per round the mean
per call; the table gives each variant's median over rounds and its per-round values.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flamia.bench.workloads import load_workloads  # noqa: E402
from flamia.inputs import make_qkv  # noqa: E402
from flamia.interface import flamia_attn_varlen_func  # noqa: E402
from flamia.ops import forward_gluon as G  # noqa: E402


def queued_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="doc512_x64,doc2k_x16")
    ap.add_argument("--alt", default=None, help="forward_gluon.CONFIGS names (comma-separated)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--recipe", default="fp8")
    args = ap.parse_args()
    default = G.PERSISTENT_FWD[0]
    variants = [default] + [G.CONFIGS[n] for n in (args.alt.split(",") if args.alt else
                                                   [G.PERSISTENT_FWD[1].name])]
    wls = {w.name: w for w in load_workloads()[0]}
    print(f"{torch.cuda.get_device_name()}; recipe {args.recipe}; {args.reps} queued calls per "
          f"round, {args.rounds} rounds; variants {[v.name for v in variants]}")
    for name in args.only.split(","):
        w = wls[name]
        q, k, v, cu = make_qkv(w.doc_lengths, w.heads_q, w.heads_kv, w.head_dim, device="cuda",
                               requires_grad=True)
        L = max(w.doc_lengths)
        dout = torch.randn_like(q)
        res = {v.name: {"fwd": [], "fwdbwd": []} for v in variants}

        def fwd():
            return flamia_attn_varlen_func(q, k, v, cu, cu, L, L, recipe=args.recipe,
                                           check_finite=False)

        def fwdbwd():
            torch.autograd.grad(fwd(), (q, k, v), dout)
        for _ in range(args.rounds):
            for var in variants:
                G.PERSISTENT_FWD[0] = var
                with torch.no_grad():
                    res[var.name]["fwd"].append(queued_ms(fwd, args.reps))
                res[var.name]["fwdbwd"].append(queued_ms(fwdbwd, args.reps))
        G.PERSISTENT_FWD[0] = default
        for var in variants:
            r = res[var.name]
            med = {k: sorted(x)[len(x) // 2] for k, x in r.items()}
            print(f"{name:12s} {var.name:34s} fwd {med['fwd']:.3f} ms "
                  f"({' '.join(f'{x:.3f}' for x in r['fwd'])})  fwd+bwd {med['fwdbwd']:.3f} ms "
                  f"({' '.join(f'{x:.3f}' for x in r['fwdbwd'])})")


if __name__ == "__main__":
    main()
