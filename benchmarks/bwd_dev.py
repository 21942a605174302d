"""Backward kernels on the H200: correctness on a slice, then per-kernel timing (issue 6).

    python benchmarks/bwd_dev.py                 # everything, ~3-4 min of GPU time
    python benchmarks/bwd_dev.py --quick         # doc8k D=128 only, fewer configs
    OUT=/some/dir python benchmarks/bwd_dev.py   # also writes $OUT/bwd_dev.json

1. Correctness (small packed slice, GQA, D 128 and 64, fp8 / fp8_mixed / bf16): the kernels'
   dq, dk, dv from the reference forward's saved operands vs reference.backward and vs float64
   autograd through attention_exact (FlashAttention rule), P1 bitwise on the GPU, run-to-run
   determinism; and, when flamia.ops.quantize / forward import, the end-to-end kernel
   forward + backward vs the reference.
2. Timing (triton.testing.do_bench, median ms) of the backward launches alone and per kernel
   (preprocess, dkdv, dq) on doc8k (1 x 8192) and doc2k_x16, Hq=32 Hkv=8, D=128 and D=64, a few
   block configs; the kernel forward (quantize + forward) when available; torch SDPA cuDNN
   forward and forward+backward. TFLOP/s by the FlashAttention convention.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from flamia import reference as R  # noqa: E402
from flamia.bench.workloads import BWD_FACTOR, fwd_flops  # noqa: E402
from flamia.bench.workloads import tflops as bench_tflops  # noqa: E402
from flamia.inputs import make_qkv, rel_err  # noqa: E402
from flamia.ops import backward as B  # noqa: E402
from flamia.quant import hadamard  # noqa: E402

RESULTS: dict = {"correctness": [], "timing": [], "baselines": [], "errors": []}
DEV = "cuda"
SMOKE = False        # --cpu-smoke: tiny sizes on the CPU interpreter, to check this script itself
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def short(e: BaseException) -> str:
    s = " ".join(f"{type(e).__name__}: {e}".split())
    return s[:400]


def kernel_forward():
    try:
        from flamia.ops.forward import attention_forward
        from flamia.ops.quantize import quantize_qkv
        return quantize_qkv, attention_forward
    except Exception as e:   # noqa: BLE001
        log("kernel forward not importable:", short(e))
        return None


# ------------------------------------------------------------------------------------------------
# correctness
# ------------------------------------------------------------------------------------------------

def fa_rule(g, g_ref, g64, atol_frac=2e-3):
    err = (g.double() - g64).abs().max().item()
    err_ref = (g_ref.double() - g64).abs().max().item()
    atol = atol_frac * g64.abs().max().item()
    return err <= 2 * err_ref + atol, err, err_ref


def grads64(q, k, v, cu, dout, causal=True):
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o = R.attention_exact(*x64, cu, causal)
    o.backward(dout.double())
    return [x.grad for x in x64]


def correctness(recipes, dims, cfgs, fwd, aligned=False):
    lengths = (30, 0, 1, 77, 64) if SMOKE else (300, 0, 1, 777, 1024)
    if aligned:   # every document start a multiple of 16: the TMA K-major path (B._use_tma)
        lengths = (32, 0, 16, 80, 61) if SMOKE else (304, 0, 16, 784, 1001)
    Hq, Hkv = 8, 2
    ok_all = True
    for D in dims:
        q, k, v, cu = make_qkv(lengths, Hq, Hkv, D, "mild", device=DEV, seed=1)
        g = torch.Generator(device=DEV).manual_seed(2)
        dout = torch.randn(q.shape, generator=g, device=DEV).to(torch.bfloat16)
        g64 = grads64(q, k, v, cu, dout)
        for recipe in recipes:
            out, lse, saved = R.forward(q, k, v, cu, recipe, True)
            out = out.to(torch.bfloat16)
            ref = R.backward(dout, out, lse, saved, cu, recipe, True)
            qkv = B.quantized_qkv_from_reference(saved, recipe, cu, True)
            for cname, cfg in (cfgs if (recipe == "fp8" and D == 128) else
                               cfgs[:2] if D == 128 else cfgs[:1]):
                try:
                    kern = B.attention_backward(dout, out, lse.float(), qkv, cu, max(lengths), True,
                                                config=cfg, grad_dtype=torch.float32)
                    sync()
                except Exception as e:  # noqa: BLE001
                    log(f"  FAIL {recipe} D={D} {cname}: {short(e)}")
                    RESULTS["errors"].append({"what": f"correctness {recipe} D={D} {cname}",
                                              "error": short(e)})
                    ok_all = False
                    continue
                row = {"recipe": recipe, "D": D, "config": cname}
                line = []
                for name, gk, gr, ge in zip(("dq", "dk", "dv"), kern, ref, g64):
                    ok, err, err_ref = fa_rule(gk, gr, ge)
                    fin = bool(torch.isfinite(gk).all())
                    row[name] = {"rel_kernel": rel_err(gk, ge), "rel_reference": rel_err(gr, ge),
                                 "rel_kernel_vs_reference": rel_err(gk, gr),
                                 "maxabs_kernel": err, "maxabs_reference": err_ref,
                                 "fa_rule": ok and fin}
                    ok_all &= ok and fin
                    line.append(f"{name} {rel_err(gk, ge):.3e}/{rel_err(gr, ge):.3e}"
                                f"{'' if ok and fin else ' FAIL'}")
                RESULTS["correctness"].append(row)
                log(f"  {recipe:9s} D={D:3d} {cname:12s} rel err kernel/reference: " + "  ".join(line))
            if fwd is not None and recipe in ("fp8", "fp8_mixed", "bf16"):
                try:
                    quantize_qkv, attention_forward = fwd
                    qkv2 = quantize_qkv(q, k, v, cu, recipe, True)
                    out2, lse2 = attention_forward(qkv2, cu, max(lengths), True, None, torch.bfloat16)
                    kern2 = B.attention_backward(dout, out2, lse2, qkv2, cu, max(lengths), True,
                                                 grad_dtype=torch.float32)
                    res = []
                    for name, gk, gr, ge in zip(("dq", "dk", "dv"), kern2, ref, g64):
                        ok, err, err_ref = fa_rule(gk, gr, ge)
                        ok_all &= ok
                        res.append(f"{name} {rel_err(gk, ge):.3e}{'' if ok else ' FAIL'}")
                    log(f"  {recipe:9s} D={D:3d} end-to-end (kernel quantize+fwd+bwd): " + "  ".join(res))
                except Exception as e:  # noqa: BLE001
                    log(f"  end-to-end {recipe} D={D}: {short(e)}")
                    RESULTS["errors"].append({"what": f"end-to-end {recipe} D={D}", "error": short(e)})
    # P1 bitwise + determinism, fp8 and fp8_mixed, D=128, on the GPU (wgmma accumulation)
    D = 128
    for recipe in ("fp8", "fp8_mixed", "bf16"):
        q, k, v, cu = make_qkv(lengths, Hq, Hkv, D, "mild", device=DEV, seed=3)
        t = 30 + 1 + 50 if SMOKE else 300 + 1 + 500
        g = torch.Generator(device=DEV).manual_seed(4)
        dout = torch.randn(q.shape, generator=g, device=DEV).to(torch.bfloat16)
        dout[t + 1:] = 0

        def run(q_, k_, v_):
            out, lse, saved = R.forward(q_, k_, v_, cu, recipe, True)
            qkv = B.quantized_qkv_from_reference(saved, recipe, cu, True)
            return B.attention_backward(dout, out.to(torch.bfloat16), lse.float(), qkv, cu,
                                        max(lengths), True, deterministic=True)
        try:
            a = run(q, k, v)
            a2 = run(q, k, v)
            q2, k2, v2 = (x.clone() for x in (q, k, v))
            for x in (q2, k2, v2):
                x[t + 1:] = (torch.randn(x[t + 1:].shape, generator=g, device=DEV) * 16).to(x.dtype)
            b = run(q2, k2, v2)
            det = all(torch.equal(x, y) for x, y in zip(a, a2))
            p1 = all(torch.equal(x[:t + 1], y[:t + 1]) for x, y in zip(a, b))
            zero = all(bool((y[t + 1:] == 0).all()) for y in b)
        except Exception as e:  # noqa: BLE001
            det = p1 = zero = False
            RESULTS["errors"].append({"what": f"P1 {recipe}", "error": short(e)})
            log("  P1 error", short(e))
        ok_all &= det and p1 and zero
        RESULTS["correctness"].append({"recipe": recipe, "D": D, "deterministic": det,
                                       "p1_prefix_bitwise": p1, "p1_suffix_zero": zero})
        log(f"  {recipe:9s} D=128 deterministic={det} P1 prefix bitwise={p1} suffix zero={zero}")
    return ok_all


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------

def tflops(flops, ms):
    """flamia.bench's TFLOP/s, NaN instead of None (the log lines format it as a number)."""
    t = bench_tflops(flops, ms)
    return float("nan") if t is None else t


def bench(fn, warmup=10, rep=60):
    if SMOKE:
        t = time.time()
        fn()
        return (time.time() - t) * 1e3
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def reference_quantized(q, k, v, cu, recipe):
    """QuantizedQKV + out + lse without the forward kernels: token quantization as the reference,
    exact attention (fp32, per document) on the dequantized operands for out / lse."""
    rec = R.get_recipe(recipe)
    D = q.shape[-1]
    Hq, Hkv = q.shape[1], k.shape[1]
    qc, kc, vc = q.float(), k.float(), v.float()
    if rec.rotate_qk:
        H = hadamard(D, torch.float32, q.device)
        qc, kc = qc @ H, kc @ H
    qo = R.quantize_operand(qc, rec.qk, rec.scaling)
    ko = R.quantize_operand(kc, rec.qk, rec.scaling)
    vo = R.quantize_operand(vc, rec.v, rec.scaling)
    saved = R.Saved(qo, ko, vo, None if not rec.rotate_qk else torch.eye(1), None, True)
    qkv = B.quantized_qkv_from_reference(saved, recipe, cu, True)
    qd, kd, vd = qo.dequant(), ko.dequant(), vo.dequant()
    T = q.shape[0]
    out = torch.empty(T, Hq, D, device=q.device, dtype=torch.bfloat16)
    lse = torch.empty(Hq, T, device=q.device)
    grp = Hq // Hkv
    cul = cu.tolist()
    for a, b in zip(cul[:-1], cul[1:]):
        if b == a:
            continue
        for h0 in range(0, Hq, 8):
            hs = slice(h0, h0 + 8)
            qq = qd[a:b, hs].transpose(0, 1)
            kk = kd[a:b].repeat_interleave(grp, 1)[:, hs].transpose(0, 1)
            vv = vd[a:b].repeat_interleave(grp, 1)[:, hs].transpose(0, 1)
            s = qq @ kk.transpose(1, 2) * D ** -0.5
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1),
                              float("-inf"))
            lse[hs, a:b] = torch.logsumexp(s, -1)
            out[a:b, hs] = (torch.softmax(s, -1) @ vv).transpose(0, 1).to(torch.bfloat16)
    return qkv, out, lse


# "default" = B.default_config(D, recipe) (fp8 / fp8_mixed D=128: kv128x32w8, q128x64w8, TMA
# K-major tiles). "_ptr" = the same tiles with the old masked pointer loads of doT8 / qT8 / kT8
# (use_tma=False; byte loads, not pipelined), to measure what the TMA change bought.
DKDV_CONFIGS = {
    "default": dict(),
    "kv128x64w8": dict(kv_bn=128, kv_bm=64, kv_warps=8, kv_stages=2),
    "kv128x32w8": dict(kv_bn=128, kv_bm=32, kv_warps=8, kv_stages=2),
    "kv128x32w8s1": dict(kv_bn=128, kv_bm=32, kv_warps=8, kv_stages=1),
    "kv64x32w4": dict(kv_bn=64, kv_bm=32, kv_warps=4, kv_stages=2),
    "kv128x32w8_ptr": dict(kv_bn=128, kv_bm=32, kv_warps=8, kv_stages=2, use_tma=False),
}
DQ_CONFIGS = {
    "default": dict(),
    "q128x64w8": dict(q_bm=128, q_bn=64, q_warps=8, q_stages=2),
    "q128x32w8": dict(q_bm=128, q_bn=32, q_warps=8, q_stages=2),
    "q64x64w4": dict(q_bm=64, q_bn=64, q_warps=4, q_stages=2),
    "q128x64w8_ptr": dict(q_bm=128, q_bn=64, q_warps=8, q_stages=2, use_tma=False),
}


def time_backward(wname, lengths, Hq, Hkv, D, recipes, fwd, sweep):
    dev = DEV
    q, k, v, cu = make_qkv(lengths, Hq, Hkv, D, "mild", device=dev, seed=0)
    g = torch.Generator(device=dev).manual_seed(1)
    dout = torch.randn(q.shape, generator=g, device=dev).to(torch.bfloat16)
    F = fwd_flops(lengths, Hq, D)
    max_len = max(lengths)
    for recipe in recipes:
        row = {"workload": wname, "D": D, "Hq": Hq, "Hkv": Hkv, "recipe": recipe,
               "fwd_flops": F, "bwd_flops": BWD_FACTOR * F}
        try:
            if fwd is not None:
                quantize_qkv, attention_forward = fwd
                qkv = quantize_qkv(q, k, v, cu, recipe, True)
                out, lse = attention_forward(qkv, cu, max_len, True, None, torch.bfloat16)
                row["fwd_source"] = "kernels"
                row["fwd_ms"] = bench(lambda: attention_forward(
                    quantize_qkv(q, k, v, cu, recipe, True), cu, max_len, True, None, torch.bfloat16))
                row["quantize_ms"] = bench(lambda: quantize_qkv(q, k, v, cu, recipe, True))
            else:
                qkv, out, lse = reference_quantized(q, k, v, cu, recipe)
                row["fwd_source"] = "reference"
        except Exception as e:  # noqa: BLE001
            log(f"  {wname} {recipe}: forward failed ({short(e)}); using the reference operands")
            qkv, out, lse = reference_quantized(q, k, v, cu, recipe)
            row["fwd_source"] = "reference"
        sync()
        base = B.default_config(D, recipe)
        swp = sweep and recipe in ("fp8", "fp8_mixed")
        kv_names = list(DKDV_CONFIGS) if swp else ["default"]
        q_names = list(DQ_CONFIGS) if swp else ["default"]
        if recipe == "fp8_mixed":     # fewer: the dK/dV kernel shares the TMA doT8 path with fp8
            kv_names = [n for n in kv_names if n in ("default", "kv128x64w8", "kv128x32w8_ptr")]
            q_names = ["default"]
        per = {}
        for kind, names, table, launch in (("dkdv", kv_names, DKDV_CONFIGS, B.launch_dkdv),
                                           ("dq", q_names, DQ_CONFIGS, B.launch_dq)):
            for n in names:
                cfg = B.BwdConfig(**{**base.__dict__, **table[n]})
                try:
                    st = B.make_state(dout, out, lse, qkv, cu, max_len, True, None, cfg)
                    B.launch_preprocess(st)
                    ms = bench(lambda: launch(st))
                    per[f"{kind}:{n}"] = ms
                    log(f"  {wname} D={D} {recipe:9s} {kind:4s} {n:13s} {ms:7.3f} ms")
                except Exception as e:  # noqa: BLE001
                    per[f"{kind}:{n}"] = None
                    log(f"  {wname} D={D} {recipe} {kind} {n}: FAILED {short(e)}")
                    RESULTS["errors"].append({"what": f"{wname} D={D} {recipe} {kind} {n}",
                                              "error": short(e), "tb": traceback.format_exc()[-2000:]})
        st = B.make_state(dout, out, lse, qkv, cu, max_len, True, None, base)
        per["pre"] = bench(lambda: B.launch_preprocess(st))
        best_kv = min((v_ for k_, v_ in per.items() if k_.startswith("dkdv:") and v_), default=None)
        best_q = min((v_ for k_, v_ in per.items() if k_.startswith("dq:") and v_), default=None)
        best_kv_name = min((k_ for k_, v_ in per.items() if k_.startswith("dkdv:") and v_),
                           key=lambda k_: per[k_], default=None)
        best_q_name = min((k_ for k_, v_ in per.items() if k_.startswith("dq:") and v_),
                          key=lambda k_: per[k_], default=None)
        # experimental: dQ by fp32 atomics from the dK/dV kernel (deterministic=False)
        try:
            kvc = DKDV_CONFIGS[best_kv_name[5:]] if best_kv_name else {}
            cfg_a = B.BwdConfig(**{**base.__dict__, **kvc, "dq_atomic": True})
            st = B.make_state(dout, out, lse, qkv, cu, max_len, True, None, cfg_a,
                              deterministic=False)
            B.launch_preprocess(st)

            def atomic_dkdv():
                st.dq_acc.zero_()
                B.launch_dkdv(st)
            per["dkdv_atomic"] = bench(atomic_dkdv)
            per["dq_finalize"] = bench(lambda: B.launch_dq(st))
            per["bwd_atomic_total"] = bench(lambda: B.attention_backward(
                dout, out, lse, qkv, cu, max_len, True, deterministic=False, config=cfg_a))
            log(f"  {wname} D={D} {recipe:9s} dq_atomic: dkdv+atomics {per['dkdv_atomic']:.3f}  "
                f"finalize {per['dq_finalize']:.3f}  bwd total {per['bwd_atomic_total']:.3f} ms")
        except Exception as e:  # noqa: BLE001
            log(f"  {wname} D={D} {recipe} dq_atomic: FAILED {short(e)}")
            RESULTS["errors"].append({"what": f"{wname} D={D} {recipe} dq_atomic", "error": short(e),
                                      "tb": traceback.format_exc()[-2000:]})
        try:
            if best_kv_name and best_q_name:
                cfg = B.BwdConfig(**{**base.__dict__, **DKDV_CONFIGS[best_kv_name[5:]],
                                     **DQ_CONFIGS[best_q_name[3:]]})
            else:
                cfg = base
            total = bench(lambda: B.attention_backward(dout, out, lse, qkv, cu, max_len, True,
                                                        config=cfg))
        except Exception as e:  # noqa: BLE001
            total = None
            RESULTS["errors"].append({"what": f"{wname} D={D} {recipe} total", "error": short(e)})
        row.update(per=per, best_dkdv=best_kv_name, best_dq=best_q_name, bwd_ms=total,
                   bwd_tflops=tflops(BWD_FACTOR * F, total))
        if row.get("fwd_ms") and total:
            row["fwdbwd_ms"] = row["fwd_ms"] + total
            row["fwdbwd_tflops"] = tflops((1 + BWD_FACTOR) * F, row["fwdbwd_ms"])
        log(f"  {wname} D={D} {recipe:9s} pre {per['pre']:.3f}  dkdv {best_kv or float('nan'):.3f} "
            f"({best_kv_name})  dq {best_q or float('nan'):.3f} ({best_q_name})  bwd total "
            f"{total or float('nan'):.3f} ms = {row['bwd_tflops']:.0f} TFLOP/s"
            + (f"  fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwdbwd_ms']:.3f} ms"
               if row.get("fwdbwd_ms") else ""))
        RESULTS["timing"].append(row)


def time_sdpa(wname, lengths, Hq, Hkv, D):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as Fn
    n, L = len(lengths), lengths[0]
    assert all(x == L for x in lengths)
    g = torch.Generator(device=DEV).manual_seed(0)
    mk = lambda h: torch.randn(n, h, L, D, generator=g, device=DEV).to(torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(Hq), mk(Hkv), mk(Hkv)
    dout = torch.randn(n, Hq, L, D, generator=g, device=DEV).to(torch.bfloat16)
    F = fwd_flops(lengths, Hq, D)
    row = {"workload": wname, "D": D, "impl": "sdpa_cudnn", "fwd_flops": F}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for gqa in (True, False):
            try:
                if gqa:
                    f = lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
                else:
                    ke = k.detach().repeat_interleave(Hq // Hkv, 1).requires_grad_()
                    ve = v.detach().repeat_interleave(Hq // Hkv, 1).requires_grad_()
                    f = lambda: Fn.scaled_dot_product_attention(q, ke, ve, is_causal=True)  # noqa: E731
                f().backward(dout)
                sync()
                fwd_ms = bench(f)
                fb_ms = bench(lambda: f().backward(dout), )
                row.update(gqa=gqa, fwd_ms=fwd_ms, fwdbwd_ms=fb_ms, bwd_ms=fb_ms - fwd_ms,
                           fwd_tflops=tflops(F, fwd_ms), bwd_tflops=tflops(BWD_FACTOR * F, fb_ms - fwd_ms),
                           fwdbwd_tflops=tflops((1 + BWD_FACTOR) * F, fb_ms))
                break
            except Exception as e:  # noqa: BLE001
                row[f"error_gqa_{gqa}"] = short(e)
    if "fwd_ms" in row:
        log(f"  SDPA cuDNN {wname} D={D}: fwd {row['fwd_ms']:.3f} ms ({row['fwd_tflops']:.0f})  "
            f"bwd {row['bwd_ms']:.3f} ms ({row['bwd_tflops']:.0f})  fwd+bwd {row['fwdbwd_ms']:.3f} ms "
            f"({row['fwdbwd_tflops']:.0f} TFLOP/s){'' if row['gqa'] else ' [kv expanded]'}")
    else:
        log(f"  SDPA cuDNN {wname} D={D}: unavailable {row}")
    RESULTS["baselines"].append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-correctness", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny CPU interpreter run of this script")
    args = ap.parse_args()
    global DEV, SMOKE
    if args.cpu_smoke:
        DEV, SMOKE = "cpu", True
    else:
        assert torch.cuda.is_available(), "needs a GPU"
    RESULTS["env"] = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                      "torch": torch.__version__,
                      "triton": triton.__version__, "python": platform.python_version(),
                      "cudnn": torch.backends.cudnn.version()}
    log("env", RESULTS["env"])
    fwd = kernel_forward()
    recipes = ("fp8", "fp8_mixed", "bf16")
    ok = None
    if not args.no_correctness:
        log("== correctness (kernel vs reference vs float64; FA rule) ==")
        cfgs = [("default", None),
                ("dq_atomic", B.BwdConfig(dq_atomic=True)),
                ("kv64x64w4", B.BwdConfig(kv_bn=64, kv_bm=64, kv_warps=4,
                                          q_bm=64, q_bn=64, q_warps=4))]
        ok = correctness(recipes, (128,) if args.quick else (128, 64), cfgs, fwd)
        log("== correctness, 16-aligned document starts (TMA K-major tiles) ==")
        ok = correctness(("fp8", "fp8_mixed"), (128,), cfgs[:1], fwd, aligned=True) and ok
        log("correctness:", "PASS" if ok else "FAIL")
        RESULTS["correctness_pass"] = ok
    if not args.no_timing:
        log("== timing ==")
        workloads = [("doc8k", (8192,)), ("doc2k_x16", (2048,) * 16)]
        if SMOKE:
            workloads = [("doc8k", (96,)), ("doc2k_x16", (32,) * 3)]
        dims = (128,) if args.quick else (128, 64)
        for wname, lengths in (workloads[:1] if args.quick else workloads):
            for D in dims:
                if not SMOKE:
                    time_sdpa(wname, lengths, 32, 8, D)
                sweep = (D == 128 and wname == "doc8k")
                time_backward(wname, lengths, 4 if SMOKE else 32, 2 if SMOKE else 8, D, recipes,
                              fwd, sweep)
                if DEV == "cuda":
                    torch.cuda.empty_cache()
    # summary
    base = {(r["workload"], r["D"]): r for r in RESULTS["baselines"] if "fwd_ms" in r}
    lines = ["", "| workload | D | recipe | pre | dkdv | dq | bwd ms | bwd TF/s | bwd ms (dq atomic) | "
             "fwd ms | fwd+bwd ms | cuDNN bwd ms | cuDNN fwd+bwd ms | speedup fwd+bwd |",
             "|" + "---|" * 14]
    for r in RESULTS["timing"]:
        b = base.get((r["workload"], r["D"]), {})
        per = r["per"]
        f = lambda x: f"{x:.3f}" if isinstance(x, (int, float)) and x == x else "-"  # noqa: E731
        sp = (b["fwdbwd_ms"] / r["fwdbwd_ms"]) if r.get("fwdbwd_ms") and b.get("fwdbwd_ms") else None
        kvm = per.get(r["best_dkdv"]) if r["best_dkdv"] else None
        qm = per.get(r["best_dq"]) if r["best_dq"] else None
        lines.append(f"| {r['workload']} | {r['D']} | {r['recipe']} | {f(per.get('pre'))} | {f(kvm)} | "
                     f"{f(qm)} | {f(r['bwd_ms'])} | {r['bwd_tflops']:.0f} | "
                     f"{f(per.get('bwd_atomic_total'))} | {f(r.get('fwd_ms'))} | "
                     f"{f(r.get('fwdbwd_ms'))} | {f(b.get('bwd_ms'))} | {f(b.get('fwdbwd_ms'))} | "
                     f"{f(sp)} |")
    print("\n".join(lines))
    if RESULTS["errors"]:
        print(f"\n{len(RESULTS['errors'])} errors:")
        for e in RESULTS["errors"]:
            print(" -", e["what"], ":", e["error"])
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bwd_dev.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)
        print("wrote", os.path.join(out_dir, "bwd_dev.json"))
    log("done")
    return 0 if ok in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
