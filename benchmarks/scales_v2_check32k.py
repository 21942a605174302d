"""Scales v2 (issue 27) at long documents: the fp8_block spec against today's fp8, on CUDA.

The CPU study (benchmarks/scales_v2_study.py) measured the token-block spec (candidate 3c, now the
recipe `fp8_block` in flamia/reference.py) up to one 8192-token document, where the backward's
bound-based dS scale put 5x more of dS's squared mass into e4m3's subnormals than at 1024 tokens.
This script checks the same at 32k on the H200: the reference emulation (fp32, on the GPU) of
`fp8_block` and of `fp8`, on one document of --tokens tokens (doc32k) and on 4 documents of a
quarter each (doc8k_x4), --heads query / KV heads (default 4 / 1, D=128), input families mild and
outliers; relative Frobenius error of O, dQ, dK, dV (bf16, as the user gets them) against a
float64 reference; and for fp8_block the bound's range use: the share of the squared mass of the
P^T and dS copies (x = P_ij sdo_i and dS_ij sqf_i, against their CTA scales c) that lands in
e4m3's subnormal range (|x / c| < 2^-6) or rounds to zero, and the largest |x| / c (448 = e4m3's
max: the bound never saturates). (The study weighted dS by (dS_ij sq_i skb)^2: the same share on
mild inputs, a different one on outliers, whose hot tokens raise some blocks' skb.)

    python benchmarks/scales_v2_check32k.py                         # H200: about a minute
    python benchmarks/scales_v2_check32k.py --device cpu --tokens 512 --heads 2 1   # CPU smoke run

Memory plan (defaults: T = 32768, 4 query heads, 1 KV head, D = 128; one L x L fp32 tensor of a
32k document is 4 GiB):
- inputs, outputs, gradients and the float64 truth's outputs: (T, H, D) tensors, < 1 GiB in all;
- float64 truth: exact attention computed head by head in chunks of --chunk query rows (default
  1024) against the keys <= the chunk's last row: 4 live (chunk x T) float64 tensors, 1 GiB;
- fp8_block emulation: 128-row query blocks (forward) and 128-key CTAs (backward), all heads at
  once: (Hq, T, 128) fp32 tensors, 64 MiB each;
- fp8 emulation: flamia.reference's dense per-document form, (H, L, L) per document; measured peak
  on the CPU about 9.4 L x L fp32 tensors per head (forward + backward, L = 4096), so it runs one
  query head at a time (its heads are independent: per-token scales; dK / dV are summed over the
  group here, in fp32): ~38 GiB at L = 32768, the peak of the run. The CUDA cache is emptied
  between calls and the peak allocation is printed at the end (expected < 45 GiB).
Time (estimate for the H200): fp32 GEMMs without TF32 and elementwise passes over 4 GiB tensors,
well under a second per head and call; ~16 emulation calls plus the truth: about a minute.
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from flamia import reference as R
from flamia.inputs import make_qkv, rel_err
from flamia.quant import E4M3_MAX, round_to_format, safe_reciprocal
from flamia.recipes import get_recipe

SUBNORMAL = 2.0 ** -6      # e4m3's smallest normal magnitude


def size_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def exact_chunked(q, k, v, cu, do, chunk):
    """Float64 causal attention and its gradients, head by head, in chunks of query rows (each
    chunk sees its full rows, so the softmax is exact). Returns o, dq (T, Hq, D), dk, dv (T, Hkv, D)."""
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


def run_block(q, k, v, cu, do, recipe):
    """fp8_block-style recipes: one call, all heads (the backward's CTA scale spans the group)."""
    out, lse, saved = R.forward(q, k, v, cu, recipe)
    o16 = out.to(q.dtype)
    dq, dk, dv = R.backward(do, o16, lse, saved, cu, recipe)
    return o16, dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def run_per_head(q, k, v, cu, do, recipe):
    """Per-token recipes (fp8): one query head at a time (heads are independent), dK / dV summed
    over the group in fp32."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    out = torch.zeros_like(q)
    dq = torch.zeros_like(q)
    dk = torch.zeros(T, Hkv, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for h in range(Hq):
        g = h // group
        sl, kl = slice(h, h + 1), slice(g, g + 1)
        o, lse, saved = R.forward(q[:, sl], k[:, kl], v[:, kl], cu, recipe)
        o16 = o.to(q.dtype)
        del o
        gq, gk, gv = R.backward(do[:, sl], o16, lse, saved, cu, recipe)
        out[:, sl], dq[:, sl] = o16, gq.to(q.dtype)
        dk[:, kl] += gk
        dv[:, kl] += gv
        del saved, gq, gk, gv
        if q.is_cuda:
            torch.cuda.empty_cache()
    return out, dq, dk.to(q.dtype), dv.to(q.dtype)


def bound_stats(q, k, v, cu, do, recipe="fp8_block"):
    """For the token-block spec: what the CTAs quantize with the preprocess bounds
    (reference.backward_scales), recomputed CTA by CTA from the saved operands: per copy (P^T for
    dV, the shared dS copy), [squared mass, mass with |x / c| < 2^-6, mass rounding to zero,
    max |x| / c]."""
    rec = get_recipe(recipe)
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = D ** -0.5
    out, lse, saved = R.forward(q, k, v, cu, rec)
    o16 = out.to(q.dtype).float()
    doq = R.quantize_token_blocks(do.float(), rec.do, cu, R.DO_BLOCK)
    sc = R.backward_scales(doq, doq.dequant(), o16, lse, saved, cu, True, rec.p, rec.ds)
    blk, _ = R.token_blocks(cu)
    heads = torch.arange(Hq, device=q.device) // group
    st = {"P^T": [0.0, 0.0, 0.0, 0.0], "dS": [0.0, 0.0, 0.0, 0.0]}

    def count(name, x, c):
        y = (x * safe_reciprocal(c)).abs()
        w = x.double() ** 2
        s = st[name]
        s[0] += w.sum().item()
        s[1] += (w * (y < SUBNORMAL)).sum().item()
        s[2] += (w * (round_to_format(y, rec.p if name == "P^T" else rec.ds) == 0)).sum().item()
        s[3] = max(s[3], y.max().item() if y.numel() else 0.0)

    cuts = cu.tolist()
    for a, b in zip(cuts[:-1], cuts[1:]):
        L = b - a
        hf = lambda x: R._heads_first(x[a:b], group)                      # noqa: E731
        qd = saved.q.dequant()[a:b].transpose(0, 1)
        kbd, vbd = hf(saved.k.dequant()), hf(saved.v.dequant())
        ktd, vtd = hf(saved.k_diag.dequant()), hf(saved.v_diag.dequant())
        dod = doq.dequant()[a:b].transpose(0, 1)
        for c0 in range(0, L, R.KV_BLOCK):
            c1 = min(c0 + R.KV_BLOCK, L)
            n = int(blk[a + c0])
            masked = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=q.device).triu(1)
            s = torch.cat([(qd[:, c0:c1] @ ktd[:, c0:c1].transpose(1, 2)).masked_fill(masked, -math.inf),
                           qd[:, c1:] @ kbd[:, c0:c1].transpose(1, 2)], 1) * scale
            dp = torch.cat([dod[:, c0:c1] @ vtd[:, c0:c1].transpose(1, 2),
                            dod[:, c1:] @ vbd[:, c0:c1].transpose(1, 2)], 1)
            p = torch.exp(s - lse[:, a + c0:b, None])
            ds = p * (dp - sc.delta[:, a + c0:b, None])
            count("P^T", p * sc.sdo[:, a + c0:b, None], sc.pt[heads, n][:, None, None])
            count("dS", ds * sc.sqf[:, a + c0:b, None], sc.ds[heads, n][:, None, None])
    return st


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=32768, help="one document of this many tokens; "
                    "the packed layout is 4 documents of a quarter each")
    ap.add_argument("--heads", type=int, nargs=2, default=(4, 1), metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=1024, help="query rows per float64 truth chunk")
    ap.add_argument("--families", nargs="+", default=("mild", "outliers"))
    ap.add_argument("--recipes", nargs="+", default=("fp8_block", "fp8"))
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if dev.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    N, (hq, hkv), d = args.tokens, args.heads, args.head_dim
    layouts = {f"doc{size_label(N)}": (N,), f"doc{size_label(N // 4)}_x4": (N // 4,) * 4}
    t0 = time.time()
    print(f"# scales v2 at long documents: reference emulation (fp32) on {dev}, float64 truth; "
          f"{hq} query / {hkv} KV heads, D={d}; torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else ""))
    rows, stats = [], []
    for lname, lengths in layouts.items():
        for fam in args.families:
            (q, k, v, cu, do), ref = case_and_truth(lengths, hq, hkv, d, fam, dev, args.chunk)
            for recipe in args.recipes:
                rec = get_recipe(recipe)
                fn = run_block if rec.scaling == R.KVBLOCK else run_per_head
                t1 = time.time()
                got = fn(q, k, v, cu, do, recipe)
                errs = [rel_err(a, b) for a, b in zip(got, ref)]
                rows.append((recipe, lname, fam, errs, time.time() - t1))
                del got
                if rec.scaling == R.KVBLOCK and rec.ds != "bf16":
                    stats.append((recipe, lname, fam, bound_stats(q, k, v, cu, do, recipe)))
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            del ref
            print(f"[{time.time() - t0:6.1f} s] {lname} {fam} done", flush=True)

    print("\n## Relative Frobenius error vs float64 (bf16 outputs)\n")
    print("| recipe | layout | inputs | O | dQ | dK | dV | s |")
    print("|---|---|---|---|---|---|---|---|")
    for recipe, lname, fam, errs, secs in rows:
        print(f"| {recipe} | {lname} | {fam} | " + " | ".join(f"{e:.4f}" for e in errs) + f" | {secs:.1f} |")
    if stats:
        print("\n## fp8_block's bound scales: share of squared mass in e4m3 subnormals / rounded "
              f"to zero, and max |x| / c (e4m3 max {E4M3_MAX:g})\n")
        print("| recipe | layout | inputs | P^T subnormal | P^T zero | P^T max | dS subnormal | dS zero "
              "| dS max |")
        print("|---|---|---|---|---|---|---|---|---|")
        for recipe, lname, fam, st in stats:
            cells = []
            for name in ("P^T", "dS"):
                tot, sub, zero, mx = st[name]
                cells += [f"{sub / tot:.1e}", f"{zero / tot:.1e}", f"{mx:.4g}"]
            print(f"| {recipe} | {lname} | {fam} | " + " | ".join(cells) + " |")
    if dev.type == "cuda":
        print(f"\npeak CUDA memory allocated: {torch.cuda.max_memory_allocated(dev) / 2 ** 30:.1f} GiB")
    print(f"total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
