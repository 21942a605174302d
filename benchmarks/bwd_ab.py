"""A/B timing of two versions of the backward kernels in one process (H200).

    git show <rev>:flamia/ops/backward.py > flamia/ops/_backward_prev.py   # the "A" side
    python benchmarks/bwd_ab.py [--workloads doc32k,doc8k_x4] [--recipes fp8,fp8_mixed]

For each workload and recipe: the kernel forward (quantize + forward) makes the operands once;
then, for A (flamia.ops._backward_prev, when present) and B (flamia.ops.backward) and each
block config, the dK/dV and dQ launches and the whole backward are timed (triton do_bench,
median ms) on the same operands, and B's gradients are compared with A's (max relative
difference; the two must compute the same function). SDPA cuDNN fwd+bwd on the same shapes is
timed in the same process as the bf16 reference point. A short table is printed last; with
$OUT set, $OUT/bwd_ab.json as well.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from flamia.bench.workloads import BWD_FACTOR, fwd_flops, tflops  # noqa: E402
from flamia.inputs import make_qkv  # noqa: E402
from flamia.ops import backward as NEW  # noqa: E402
from flamia.ops.forward import attention_forward  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402

WORKLOADS = {
    "doc32k": ((32768,), 128),
    "doc8k_x4": ((8192,) * 4, 128),
    "doc2k_x16": ((2048,) * 16, 128),
    "d64_doc8k_x4": ((8192,) * 4, 64),
}
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


DEV = "cuda"


def bench(fn):
    if DEV == "cpu":      # --cpu-smoke: one timed call (checks this script, not the kernels)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return do_bench(fn, warmup=5, rep=40, return_mode="median")


def sdpa_ms(lengths, Hq, Hkv, D):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    n, L = len(lengths), lengths[0]
    mk = lambda h: torch.randn(n, h, L, D, device="cuda", dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(Hq), mk(Hkv), mk(Hkv)
    dout = torch.randn(n, Hq, L, D, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        fwd = bench(f)
        fb = bench(lambda: f().backward(dout))
    return fwd, fb - fwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="doc32k,doc8k_x4,doc2k_x16,d64_doc8k_x4")
    ap.add_argument("--recipes", default="fp8,fp8_mixed")
    ap.add_argument("--configs", default="default",
                    help="comma list of default or kvBNxBMwW/qBMxBNwW overrides, e.g. kv128x64w8")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes under TRITON_INTERPRET=1")
    args = ap.parse_args()
    global DEV
    if args.cpu_smoke:
        DEV = "cpu"
        WORKLOADS.update({w: (tuple(max(L // 256, 16) for L in ls[:2]), D)
                          for w, (ls, D) in WORKLOADS.items()})
    try:
        OLD = importlib.import_module("flamia.ops._backward_prev")
    except ImportError:
        OLD = None
        log("no flamia.ops._backward_prev: timing B only")
    sides = [("A", OLD), ("B", NEW)] if OLD else [("B", NEW)]
    rows = []
    for wname in args.workloads.split(","):
        lengths, D = WORKLOADS[wname]
        Hq, Hkv = (4, 2) if DEV == "cpu" else (32, 8)
        F = fwd_flops(lengths, Hq, D)
        q, k, v, cu = make_qkv(lengths, Hq, Hkv, D, "mild", device=DEV, seed=0)
        dout = torch.randn(q.shape, device=DEV).to(torch.bfloat16)
        max_len = max(lengths)
        try:
            assert DEV == "cuda", "no SDPA timing in the CPU smoke run"
            s_fwd, s_bwd = sdpa_ms(lengths, Hq, Hkv, D)
            log(f"{wname}: SDPA cuDNN fwd {s_fwd:.3f} ms bwd {s_bwd:.3f} ms")
        except Exception as e:   # noqa: BLE001
            s_fwd = s_bwd = None
            log(f"{wname}: SDPA cuDNN failed: {e}")
        for recipe in args.recipes.split(","):
            qkv = quantize_qkv(q, k, v, cu, recipe, True)
            out, lse = attention_forward(qkv, cu, max_len, True, None, torch.bfloat16)
            fwd_ms = bench(lambda: attention_forward(quantize_qkv(q, k, v, cu, recipe, True), cu,
                                                     max_len, True, None, torch.bfloat16))
            grads = {}
            for cname in args.configs.split(","):
                for side, M in sides:
                    cfg = M.default_config(D, recipe)
                    if cname.startswith("split"):
                        bm, bmv = cname[5:].split("/")
                        cfg = M.BwdConfig(**{**cfg.__dict__, "split_dkdv": True, "kv_bm": int(bm),
                                             "kv_bm_dv": int(bmv)})
                    elif cname != "default":
                        kv, _, qq = cname.partition("/")
                        over = {}
                        if kv.startswith("kv"):
                            bn, rest = kv[2:].split("x")
                            bm, w = rest.split("w")
                            over.update(kv_bn=int(bn), kv_bm=int(bm), kv_warps=int(w))
                        if qq.startswith("q"):
                            bm, rest = qq[1:].split("x")
                            bn, w = rest.split("w")
                            over.update(q_bm=int(bm), q_bn=int(bn), q_warps=int(w))
                        cfg = M.BwdConfig(**{**cfg.__dict__, **over})
                    try:
                        st = M.make_state(dout, out, lse, qkv, cu, max_len, True, None, cfg)
                        M.launch_preprocess(st)
                        t_kv = bench(lambda: M.launch_dkdv(st))
                        t_q = bench(lambda: M.launch_dq(st))
                        t_all = bench(lambda: M.attention_backward(dout, out, lse, qkv, cu, max_len,
                                                                   True, config=cfg))
                        g = M.attention_backward(dout, out, lse, qkv, cu, max_len, True, config=cfg)
                        if DEV == "cuda":
                            torch.cuda.synchronize()
                        grads[(cname, side)] = g
                        diff = None
                        if side == "B" and (cname, "A") in grads:
                            diff = max(((x.float() - y.float()).abs().max()
                                        / y.float().abs().max().clamp_min(1e-30)).item()
                                       for x, y in zip(g, grads[(cname, "A")]))
                        row = dict(workload=wname, D=D, recipe=recipe, config=cname, side=side,
                                   dkdv_ms=t_kv, dq_ms=t_q, bwd_ms=t_all, fwd_ms=fwd_ms,
                                   bwd_tflops=tflops(BWD_FACTOR * F, t_all),
                                   fwdbwd_ms=fwd_ms + t_all, sdpa_fwd_ms=s_fwd, sdpa_bwd_ms=s_bwd,
                                   speedup_fwdbwd=((s_fwd + s_bwd) / (fwd_ms + t_all)) if s_fwd else None,
                                   maxrel_vs_A=diff, finite=all(bool(torch.isfinite(x).all()) for x in g))
                        rows.append(row)
                        log(f"{wname} D={D} {recipe:9s} {cname:18s} {side}: dkdv {t_kv:8.3f} dq {t_q:8.3f} "
                            f"bwd {t_all:8.3f} ms ({row['bwd_tflops']:.0f} TFLOP/s)"
                            + (f"  max rel diff vs A {diff:.2e}" if diff is not None else ""))
                    except Exception as e:   # noqa: BLE001
                        log(f"{wname} {recipe} {cname} {side}: FAILED {type(e).__name__}: {str(e)[:300]}")
            del grads
            if DEV == "cuda":
                torch.cuda.empty_cache()
    print("\n| workload | recipe | config | side | dkdv ms | dq ms | bwd ms | bwd TF/s | fwd ms | "
          "fwd+bwd ms | SDPA cuDNN fwd+bwd ms | speedup | max rel diff vs A |")
    print("|" + "---|" * 13)
    f = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"   # noqa: E731
    for r in rows:
        sd = (r["sdpa_fwd_ms"] + r["sdpa_bwd_ms"]) if r["sdpa_fwd_ms"] else None
        print(f"| {r['workload']} | {r['recipe']} | {r['config']} | {r['side']} | {f(r['dkdv_ms'])} | "
              f"{f(r['dq_ms'])} | {f(r['bwd_ms'])} | {r['bwd_tflops']:.0f} | {f(r['fwd_ms'])} | "
              f"{f(r['fwdbwd_ms'])} | {f(sd)} | {f(r['speedup_fwdbwd'], 2)} | "
              f"{'-' if r['maxrel_vs_A'] is None else format(r['maxrel_vs_A'], '.1e')} |")
    out = os.environ.get("OUT")
    if out:
        env = dict(device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__,
                   triton=__import__("triton").__version__)
        with open(os.path.join(out, "bwd_ab.json"), "w") as fh:
            json.dump(dict(env=env, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
