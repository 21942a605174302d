"""The fp8 recipe's kernels at long documents: relative Frobenius error against float64 of the
public call (quantize, forward, one-pass backward) next to the recipe's reference emulation and
the other kernel recipes, on one document of --tokens tokens and on 4 documents of a quarter each.

Why: the one-pass fp8 backward accumulates dK and dV in the tensor core's FP8 accumulator across
every query step of a key block (2048 steps at 32k tokens with 4 query heads), and Hopper's FP8
wgmma adds with fewer bits than fp32 (benchmarks/NOTES.md, "The FP8 tensor core's
accumulator"); the GPU tests stop at 3000-token documents. If the accumulation costs accuracy,
the kernel's dK / dV error grows with the document over the emulation's.

    python benchmarks/fp8_long_check.py            # H200, about a minute

Memory (defaults: T = 32768, 4 query heads, 1 KV head): the float64 truth is exact attention
computed head by head in chunks of --chunk query rows (default 1024) against the keys <= the
chunk's last row, 4 live (chunk x T) float64 tensors (1 GiB); the emulation (flamia.reference,
fp32 on the GPU) works in 128-row query blocks and 128-key CTAs, (Hq, T, 128) fp32 tensors.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flamia import flamia_attn_varlen_func  # noqa: E402
from flamia import reference as R  # noqa: E402
from flamia.inputs import make_qkv, rel_err  # noqa: E402


def size_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def exact_chunked(q, k, v, cu, do, chunk):
    """Float64 causal attention and its gradients, head by head, in chunks of query rows (each
    chunk sees its full rows, so the softmax is exact). Returns o, dq (T, Hq, D), dk, dv
    (T, Hkv, D)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scale = D ** -0.5
    f64 = torch.float64
    o = torch.zeros(T, Hq, D, dtype=f64, device=q.device)
    dq = torch.zeros_like(o)
    dk = torch.zeros(T, Hkv, D, dtype=f64, device=q.device)
    dv = torch.zeros_like(dk)
    cuts = cu.tolist()
    for a, b in zip(cuts[:-1], cuts[1:]):
        for h in range(Hq):
            g = h // group
            qh, doh = q[a:b, h].to(f64), do[a:b, h].to(f64)
            kh, vh = k[a:b, g].to(f64), v[a:b, g].to(f64)
            for r0 in range(0, b - a, chunk):
                r1 = min(r0 + chunk, b - a)
                s = (qh[r0:r1] @ kh[:r1].T) * scale                     # keys <= the chunk's end
                rows = torch.arange(r0, r1, device=q.device)[:, None]
                s = s.masked_fill(torch.arange(r1, device=q.device)[None, :] > rows, -math.inf)
                p = torch.softmax(s, -1)
                del s
                oc = p @ vh[:r1]
                dp = doh[r0:r1] @ vh[:r1].T
                delta = (doh[r0:r1] * oc).sum(-1, keepdim=True)
                ds = p * (dp - delta)
                del dp
                o[a + r0:a + r1, h] = oc
                dq[a + r0:a + r1, h] = (ds @ kh[:r1]) * scale
                dk[a:a + r1, g] += (ds.T @ qh[r0:r1]) * scale
                dv[a:a + r1, g] += p.T @ doh[r0:r1]
                del p, ds
    return o, dq, dk, dv


def case_and_truth(lengths, hq, hkv, d, family, dev, chunk):
    """The inputs of one case (seed 0, dO seed 1, bf16, on dev) and their float64 truth
    (exact_chunked): ((q, k, v, cu, do), (o, dq, dk, dv))."""
    q, k, v, cu = make_qkv(lengths, hq, hkv, d, family, torch.bfloat16, seed=0)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    q, k, v, cu, do = (x.to(dev) for x in (q, k, v, cu, do))
    return (q, k, v, cu, do), exact_chunked(q, k, v, cu, do, chunk)


def run_emulation(q, k, v, cu, do, recipe):
    """flamia.reference's forward and backward of a token-block recipe in one call, all heads
    (the backward's CTA scale spans the GQA group), outputs in the inputs' dtype."""
    out, lse, saved = R.forward(q, k, v, cu, recipe)
    o16 = out.to(q.dtype)
    dq, dk, dv = R.backward(do, o16, lse, saved, cu, recipe)
    return o16, dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def run_api(q, k, v, cu, do, recipe):
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    L = int((cu[1:] - cu[:-1]).max())
    out = flamia_attn_varlen_func(*xs, cu, cu, L, L, recipe=recipe, deterministic=True)
    out.backward(do)
    return out.detach(), *(x.grad for x in xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, nargs=2, default=(4, 1), metavar=("HQ", "HKV"))
    ap.add_argument("--head-dims", type=int, nargs="+", default=(128, 64))
    ap.add_argument("--families", nargs="+", default=("mild", "outliers"))
    ap.add_argument("--kernels", nargs="+", default=("fp8", "bf16"),
                    help="recipes run through the public call (kernels)")
    ap.add_argument("--emulations", nargs="+", default=("fp8",),
                    help="token-block recipes run on flamia.reference (e.g. fp8 fp8_mixed)")
    ap.add_argument("--chunk", type=int, default=1024, help="query rows per float64 truth chunk")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    N, (hq, hkv) = args.tokens, args.heads
    layouts = {f"doc{size_label(N)}": (N,), f"doc{size_label(N // 4)}_x4": (N // 4,) * 4}
    t0 = time.time()
    print(f"# fp8 at long documents: kernels (public call, deterministic) and the reference "
          f"emulation vs float64; {hq}/{hkv} heads; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(dev)}")
    rows = []
    for d in args.head_dims:
        for lname, lengths in layouts.items():
            for fam in args.families:
                (q, k, v, cu, do), ref = case_and_truth(lengths, hq, hkv, d, fam, dev,
                                                        args.chunk)
                runs = [(f"{r} kernels", lambda r=r: run_api(q, k, v, cu, do, r))
                        for r in args.kernels]
                runs += [(f"{r} emulation", lambda r=r: run_emulation(q, k, v, cu, do, r))
                         for r in args.emulations]
                for name, fn in runs:
                    got = fn()
                    rows.append((d, lname, fam, name, [rel_err(a, b) for a, b in zip(got, ref)]))
                    del got
                    torch.cuda.empty_cache()
                del ref
                print(f"[{time.time() - t0:6.1f} s] D={d} {lname} {fam} done", flush=True)
    print("\n| D | layout | inputs | implementation | O | dQ | dK | dV |")
    print("|---|---|---|---|---|---|---|---|")
    for d, lname, fam, name, errs in rows:
        print(f"| {d} | {lname} | {fam} | {name} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")
    print(f"total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
