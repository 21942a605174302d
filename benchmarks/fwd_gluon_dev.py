"""Gluon FP8 forward (flamia/ops/forward_gluon.py) vs the Triton forward on the H200.

    python benchmarks/fwd_gluon_dev.py                                  # all phases, default configs
    python benchmarks/fwd_gluon_dev.py --configs g64x128w4s2,g128x128w8s2,g64x64w4s3
    python benchmarks/fwd_gluon_dev.py --quick                          # fewer reps / workloads
    python benchmarks/fwd_gluon_dev.py --skip-timing                    # correctness only
    python benchmarks/fwd_gluon_dev.py --cpu-smoke                      # CPU: compile every config
    python benchmarks/fwd_gluon_dev.py --isolate                        # one subprocess per config
    OUT=/dir python benchmarks/fwd_gluon_dev.py                         # also $OUT/fwd_gluon_dev.json

    python benchmarks/fwd_gluon_dev.py --isolate --quick --configs nextfwd   # the next candidates

--configs nextfwd = the current best (g64x128w4s3-ws1-p24-r128) and forward_gluon.NEXT_FWD
(ping-pong ws2, folded exponent, lazy rescale, polynomial exp2). With --quick it also means
head dim 128 only in agreement / P1 / P2, forward-only timing on doc32k, doc8k_x4, doc2k_x16,
longtail, and --parallel 4: the correctness children (which also compile every timing
specialization into the Triton cache) run 4 at a time, then the timing children one at a time.

--isolate runs the Triton timing and then each config (agreement, P1/P2, timing) in its own
subprocess with a timeout (--child-timeout), so a hang, a CUDA error or a corrupted context in one
config costs only that config; the parent merges the children's results into one table / JSON.

Config names: gBMxBNwWARPSsSTAGES[-wsN-pPREGS[-cCREGS]][-rMAXNREG][-pp][-f][-k][-eN][-PN][-m][-w][-S]; -wsN is the
warp-specialized kernel with N consumer warpgroups (BM = 64 N), a 1-warp producer with PREGS
registers, the second consumer (N = 2) with CREGS; -pp ping-pong (ws2), -f folded exponent,
-k lazy rescale, -eN one exp2 in N by polynomial, -PN persistent with N CTAs per SM (ws1),
-m vt8 in wgmma key order, -w PV waited at once, -S the serial tile loop (see
forward_gluon.GluonFwdConfig).

Phases (each config / kernel in its own try/except: one failure never stops the table):
1. Resources: registers, spills, shared memory, C7515, PTX counts (wgmma, waits, barriers...)
   per config and head dim (on the GPU from the launched kernel; --cpu-smoke compiles only).
2. Agreement with the Triton kernel on small packed slices with unaligned documents (and empty /
   length-1 ones), causal and not, D 128 / 64, GQA, inputs `mild` and `outliers`: both kernels
   on the same QuantizedQKV, outputs NaN-poisoned first; O max |diff| and relative Frobenius
   diff, LSE max |diff|, unwritten (NaN) rows; plus the FlashAttention rule vs the reference
   emulation (flamia.reference) for the Gluon kernel.
3. P1 (perturb tokens after t of one document, re-quantize: outputs / LSE at <= t bitwise equal)
   and P2 (perturb one document, random and NaN: every other document bitwise equal), Gluon.
4. Timing (CUDA events, warm-up, median of --reps): forward kernel only (schedule prebuilt) and
   quantize + forward, Triton default vs each Gluon config, on doc32k, doc8k_x4, doc2k_x16,
   doc512_x64, longtail (unaligned) and d64_doc8k_x4 (flamia/data/workloads.json). TFLOP/s by
   the FlashAttention convention: 4 * Hq * D * sum(L^2) / 2 (causal). A table comes last.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
import traceback

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
os.environ.pop("TRITON_INTERPRET", None)      # Gluon kernels compile / run only for real

import torch  # noqa: E402
import triton  # noqa: E402

from flamia.bench.workloads import fwd_flops  # noqa: E402
from flamia.bench.timing import TimingSettings, cuda_time as bench_cuda_time  # noqa: E402
from flamia.inputs import make_qkv, rel_err  # noqa: E402
from flamia.ops import forward_gluon as G  # noqa: E402

T0 = time.time()
RESULTS: dict = {"env": {}, "resources": [], "agreement": [], "properties": [], "timing": [],
                 "errors": []}
DEFAULT_CONFIGS = ("g64x128w4s2,g64x128w4s2-ws1-p24-r128,g64x128w4s3-ws1-p24-r128,"
                   "g128x128w4s2-ws2-p24-c240-r168,g128x128w4s3-ws2-p24-c240-r168")
BASE = "g64x128w4s2"      # warp-specialized configs are compared bitwise with this one
WORKLOADS = ["doc32k", "doc8k_x4", "doc2k_x16", "doc512_x64", "longtail", "d64_doc8k_x4"]
NEXTFWD_BEST = "g64x128w4s3-ws1-p24-r128"
NEXTFWD_QUICK_WORKLOADS = "doc32k,doc8k_x4,doc2k_x16,longtail"
DIMS = (128, 64)            # head dims of agreement / P1 / P2 (--dims)


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def short(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def record_error(where: str, e: BaseException):
    tb = traceback.format_exc()
    print(tb, flush=True)
    RESULTS["errors"].append({"where": where, "error": short(e), "trace": tb[-4000:]})
    log(f"ERROR {where}: {short(e)}")


def parse_configs(spec: str):
    cfgs = []
    for name in spec.split(","):
        name = name.strip()
        if not name:
            continue
        if name in G.CONFIGS:
            cfgs.append(G.CONFIGS[name])
            continue
        if name == "none":          # --isolate's Triton-only child
            continue
        if name == "nextfwd":
            cfgs += [G.CONFIGS[NEXTFWD_BEST]] + list(G.NEXT_FWD)
            continue
        m = re.fullmatch(r"g(\d+)x(\d+)w(\d+)s(\d+)(?:-ws(\d)-p(\d+)(?:-c(\d+))?)?(?:-r(\d+))?"
                         r"(-pp)?(-f)?(-k)?(?:-e(\d))?(?:-P(\d))?(-m)?", name)
        if not m:
            sys.exit(f"unknown config {name!r}: use gBMxBNwWARPSsSTAGES[-wsN-pP[-cC]][-rMAXNREG]"
                     "[-pp][-f][-k][-eN][-PN][-m], e.g. g64x128w4s2 or g64x128w4s2-ws1-p24-r128-f-k")
        bm, bn, w, s, ws, p, c, r, pp, f, k, e, pers, mo = m.groups()
        cfg = G.GluonFwdConfig(int(bm), int(bn), int(w), int(s), int(r) if r else None)
        if ws:
            cfg = cfg.with_(ws=int(ws), producer_regs=int(p),
                            **({"consumer_regs": int(c)} if c else {}))
        cfg = cfg.with_(pingpong=bool(pp), fold=bool(f), lazy=bool(k), poly=int(e or 0),
                        persistent=int(pers or 0), mma_order=bool(mo))
        G._check_config(cfg, 128)
        cfgs.append(cfg)
    return cfgs


def usage_of(kernel) -> dict:
    from flamia.ops._interp import resource_usage
    u = resource_usage(kernel)
    ptx = kernel.asm["ptx"]
    u.update({k: len(re.findall(p, ptx)) for k, p in G.PTX_COUNTS.items()})
    return u


def usage_str(u: dict) -> str:
    keys = ("wgmma", "wait", "bar", "tma", "mbar_wait", "shfl", "st_shared", "ld_shared", "local")
    return (f"regs {u['regs']:>3} spill {u['spill_stores']} smem {u['shared'] // 1024}K "
            f"{'C7515-SERIALIZED ' if u['wgmma_serialized'] else ''}"
            + " ".join(f"{k}={u[k]}" for k in keys))


# ------------------------------------------------------------------------------------- resources

def phase_resources_cpu(cfgs):
    print("\n=== sm_90a compile report (CPU, compile only) ===")
    for cfg in cfgs:
        for D in (128, 64):
            for causal in (True, False):
                where = f"compile {cfg.name} D={D} causal={causal}"
                try:
                    u = G.compile_report(cfg, D, causal)
                    u = {k: v for k, v in u.items() if k not in ("ptx", "kernel")}
                    RESULTS["resources"].append({"config": cfg.name, "D": D, "causal": causal, **u})
                    log(f"{cfg.name:14s} D={D:3d} {'causal' if causal else 'full  '} {usage_str(u)}")
                except Exception as e:   # noqa: BLE001
                    record_error(where, e)


def resources_gpu(cfg, D):
    try:
        u = usage_of(G.LAST_KERNEL)
        RESULTS["resources"].append({"config": cfg.name, "D": D, **u})
        log(f"  resources {cfg.name} D={D}: {usage_str(u)}")
    except Exception as e:   # noqa: BLE001
        record_error(f"resources {cfg.name} D={D}", e)


# ------------------------------------------------------------------------------------- agreement

def phase_agreement(cfgs, dev, quick):
    from flamia import reference as R
    from flamia.ops.forward import attention_forward
    from flamia.ops.quantize import quantize_qkv
    print("\n=== agreement with the Triton forward (same quantized operands) ===")
    slices = [((700, 1, 0, 300, 17, 129, 1000), 8, 2), ((37, 0, 1, 70, 19, 260), 4, 4)]
    seen_usage = set()
    passed = {c.name: True for c in cfgs}
    for D in DIMS:
        for lengths, Hq, Hkv in slices:
            for family in (("mild", "outliers") if not quick else ("outliers",)):
                q, k, v, cu = make_qkv(lengths, Hq, Hkv, D, family, device=dev, seed=3)
                for causal in (True, False):
                    qkv = quantize_qkv(q, k, v, cu, "fp8", causal, poison=True, vt_mma_order=False)
                    qkv_m = (quantize_qkv(q, k, v, cu, "fp8", causal, poison=True)
                             if any(c.mma_order for c in cfgs) else None)   # -m: key-ordered vt8
                    try:
                        ref_o, ref_l = attention_forward(qkv, cu, max(lengths), causal, None, q.dtype,
                                                         poison=True)
                    except Exception as e:   # noqa: BLE001
                        record_error(f"triton fwd D={D} {lengths} {family} causal={causal}", e)
                        continue
                    emu_o, emu_l, _ = R.forward(q, k, v, cu, "fp8", causal)
                    base = None     # the single-partition Gluon kernel, for the bitwise check
                    if any(c.ws for c in cfgs):
                        try:
                            base = G.attention_forward_gluon(qkv, cu, max(lengths), causal, None,
                                                             q.dtype, config=G.CONFIGS[BASE],
                                                             poison=True)
                        except Exception as e:   # noqa: BLE001
                            record_error(f"gluon {BASE} (bitwise base) D={D} causal={causal}", e)
                    exact = R.attention_exact(q, k, v, cu, causal)
                    err_emu = (emu_o.to(q.dtype).double() - exact).abs()
                    for cfg in cfgs:
                        where = f"gluon {cfg.name} D={D} T={sum(lengths)} {family} causal={causal}"
                        try:
                            o, lse = G.attention_forward_gluon(qkv_m if cfg.mma_order else qkv,
                                                               cu, max(lengths), causal, None,
                                                               q.dtype, config=cfg, poison=True)
                            torch.cuda.synchronize()
                            if (cfg.name, D) not in seen_usage:
                                seen_usage.add((cfg.name, D))
                                resources_gpu(cfg, D)
                            nan_g = int(o.isnan().any(-1).any(-1).sum() + lse.isnan().sum())
                            nan_t = int(ref_o.isnan().any(-1).any(-1).sum() + ref_l.isnan().sum())
                            d_o = (o.float() - ref_o.float()).abs().max().item()
                            r_o = rel_err(o, ref_o)
                            d_l = (lse - ref_l).abs().max().item()
                            # FlashAttention rule vs the reference emulation (as fwd_dev.check_slice)
                            err = (o.double() - exact).abs()
                            atol = 4 * err_emu.pow(2).mean().sqrt().item() + 1e-5
                            fa_max = err.max().item() <= 2 * err_emu.max().item() + 1e-5
                            fa_frac = (err > 2 * err_emu + atol).double().mean().item()
                            ok = (nan_g == 0 and nan_t == 0 and r_o <= 5e-3 and d_l <= 1e-3
                                  and fa_max and fa_frac <= 1e-4)
                            passed[cfg.name] &= ok
                            rec = {"config": cfg.name, "D": D, "lengths": list(lengths), "Hq": Hq,
                                   "Hkv": Hkv, "family": family, "causal": causal, "passed": ok,
                                   "max_abs_o": d_o, "rel_fro_o": r_o, "max_abs_lse": d_l,
                                   "nan_rows_gluon": nan_g, "nan_rows_triton": nan_t,
                                   "rel_err_vs_exact": rel_err(o, exact),
                                   "rel_err_emulation": rel_err(emu_o.to(q.dtype), exact),
                                   "fa_rule_max": fa_max, "fa_rule_frac": fa_frac}
                            if cfg.ws and base is not None:
                                # same tile grid and op order per 64-row group: expected bitwise
                                rec["bitwise_vs_" + BASE] = bool(torch.equal(o, base[0])
                                                                 and torch.equal(lse, base[1]))
                            RESULTS["agreement"].append(rec)
                            log(f"{'PASS' if ok else 'FAIL'} {where}: O max {d_o:.2e} rel {r_o:.2e} "
                                f"| LSE max {d_l:.2e} | NaN g/t {nan_g}/{nan_t} | vs exact "
                                f"{rec['rel_err_vs_exact']:.3e} (emul {rec['rel_err_emulation']:.3e}) "
                                f"FA-rule {'ok' if fa_max and fa_frac <= 1e-4 else 'FAIL'}"
                                + (f" | bitwise={rec['bitwise_vs_' + BASE]}"
                                   if "bitwise_vs_" + BASE in rec else ""))
                        except Exception as e:   # noqa: BLE001
                            passed[cfg.name] = False
                            record_error(where, e)
    return [c for c in cfgs if passed[c.name]]


# ------------------------------------------------------------------------------------ properties

def _perturbed(x, sel, gen, nan=False):
    y = x.clone()
    if nan:
        y[sel] = float("nan")
    else:
        y[sel] = torch.randn(y[sel].shape, generator=gen).to(y.device, y.dtype) * 3
    return y


def phase_properties(cfgs, dev):
    from flamia.ops.quantize import quantize_qkv
    print("\n=== P1 / P2, bitwise (Gluon kernel) ===")
    lengths = (1000, 777, 300, 45, 1500)          # unaligned starts: 1000, 1777, 2077, 2122
    cu_host = [0]
    for n in lengths:
        cu_host.append(cu_host[-1] + n)
    for D in DIMS:
        q, k, v, cu = make_qkv(lengths, 8, 2, D, "outliers", device=dev, seed=11)
        for cfg in cfgs:
            def run(q_, k_, v_, causal=True):
                qkv = quantize_qkv(q_, k_, v_, cu, "fp8", causal, poison=True,
                                   vt_mma_order=cfg.mma_order)
                return G.attention_forward_gluon(qkv, cu, max(lengths), causal, None, q.dtype,
                                                 config=cfg, poison=True)
            try:
                o0, l0 = run(q, k, v)
                gen = torch.Generator().manual_seed(5)
                # P1: document 1 (starts at 1000), t = 333 doc-local; perturb q, k, v after t
                s1, e1 = cu_host[1], cu_host[2]
                for t in (333, 0, 776 - 1):
                    sel = slice(s1 + t + 1, e1)
                    o1, l1 = run(_perturbed(q, sel, gen), _perturbed(k, sel, gen), _perturbed(v, sel, gen))
                    keep = slice(0, s1 + t + 1)
                    same_o = torch.equal(o0[keep], o1[keep])
                    same_l = torch.equal(l0[:, keep], l1[:, keep])
                    # later documents are independent as well
                    same_rest = torch.equal(o0[e1:], o1[e1:]) and torch.equal(l0[:, e1:], l1[:, e1:])
                    ok = same_o and same_l and same_rest
                    RESULTS["properties"].append({"config": cfg.name, "D": D, "prop": "P1", "t": t,
                                                  "passed": ok})
                    log(f"{'PASS' if ok else 'FAIL'} P1 {cfg.name} D={D} doc1 t={t}: O<=t equal "
                        f"{same_o}, LSE<=t equal {same_l}, other docs equal {same_rest}")
                # P2: perturb document 2 (random, then NaN/Inf): the others bitwise equal
                for mode in ("random", "nan"):
                    s2, e2 = cu_host[2], cu_host[3]
                    sel = slice(s2, e2)
                    nan = mode == "nan"
                    o2, l2 = run(_perturbed(q, sel, gen, nan), _perturbed(k, sel, gen, nan),
                                 _perturbed(v, sel, gen, nan))
                    same = (torch.equal(o0[:s2], o2[:s2]) and torch.equal(o0[e2:], o2[e2:])
                            and torch.equal(l0[:, :s2], l2[:, :s2]) and torch.equal(l0[:, e2:], l2[:, e2:]))
                    RESULTS["properties"].append({"config": cfg.name, "D": D, "prop": "P2",
                                                  "mode": mode, "passed": same})
                    log(f"{'PASS' if same else 'FAIL'} P2 {cfg.name} D={D} perturb doc2 ({mode}): "
                        f"other documents bitwise equal {same}")
                # non-causal P2 with NaN (the end tile of doc 1 reaches into doc 2's keys)
                o3, l3 = run(q, k, v, causal=False)
                o4, l4 = run(_perturbed(q, sel, gen, True), _perturbed(k, sel, gen, True),
                             _perturbed(v, sel, gen, True), causal=False)
                same = (torch.equal(o3[:s2], o4[:s2]) and torch.equal(o3[e2:], o4[e2:])
                        and torch.equal(l3[:, :s2], l4[:, :s2]) and torch.equal(l3[:, e2:], l4[:, e2:]))
                RESULTS["properties"].append({"config": cfg.name, "D": D, "prop": "P2-noncausal",
                                              "mode": "nan", "passed": same})
                log(f"{'PASS' if same else 'FAIL'} P2 {cfg.name} D={D} non-causal NaN doc2: {same}")
            except Exception as e:   # noqa: BLE001
                record_error(f"properties {cfg.name} D={D}", e)


# ---------------------------------------------------------------------------------------- timing

def cuda_time(fn, reps: int, warmup: int = 5) -> float:
    """Median milliseconds over `reps` CUDA-event-timed calls, after `warmup` calls."""
    settings = TimingSettings(warmup=warmup, reps=reps, min_reps=reps)
    return bench_cuda_time(lambda _: fn(), 1, settings).median_ms


def load_workloads(names=()):
    """The suite's workloads by name, plus synthetic ones named in `names` as docN_xM (M
    documents of N tokens, the suite's heads: Hq 32, Hkv 8, D 128), e.g. doc1k_x32 = doc1024_x32."""
    with open(os.path.join(ROOT, "flamia", "data", "workloads.json")) as f:
        wls = {w["name"]: w for w in json.load(f)["workloads"]}
    for name in names:
        m = re.fullmatch(r"doc(\d+)(k?)_x(\d+)", name)
        if name not in wls and m:
            n = int(m.group(1)) * (1024 if m.group(2) else 1)
            wls[name] = {"name": name, "heads_q": 32, "heads_kv": 8, "head_dim": 128,
                         "doc_lengths": [n] * int(m.group(3))}
    return wls


def phase_timing(cfgs, dev, names, reps, with_triton=True, forward_only=False, warm_only=False):
    """warm_only: one call of each timed function, nothing recorded (fills the Triton cache for
    --parallel's timing children)."""
    from flamia.ops.forward import attention_forward, default_config
    from flamia.ops.quantize import quantize_qkv
    from flamia.ops.schedule import build_schedule
    print("\n=== timing (causal, median of CUDA events) ===")
    wls = load_workloads(names)
    for name in names:
        if name not in wls:
            log(f"unknown workload {name}")
            continue
        wl = wls[name]
        lengths, Hq, Hkv, D = wl["doc_lengths"], wl["heads_q"], wl["heads_kv"], wl["head_dim"]
        try:
            q, k, v, cu = make_qkv(lengths, Hq, Hkv, D, "mild", device=dev, seed=0)
            T = q.shape[0]
            flops = fwd_flops(lengths, Hq, D)
            qkv = quantize_qkv(q, k, v, cu, "fp8", True, vt_mma_order=False)   # Gluon: token order
            qkv_t = quantize_qkv(q, k, v, cu, "fp8", True)                      # Triton: its default
        except Exception as e:   # noqa: BLE001
            record_error(f"timing setup {name}", e)
            continue

        def timed(fn):
            if warm_only:
                fn()
                torch.cuda.synchronize()
                return None
            return cuda_time(fn, reps)

        def rec(kernel, what, ms):
            if ms is None:
                return
            tf = flops / (ms * 1e-3) / 1e12
            RESULTS["timing"].append({"workload": name, "kernel": kernel, "what": what, "ms": ms,
                                      "tflops": tf})
            log(f"{name:13s} {kernel:16s} {what:14s} {ms:8.3f} ms {tf:7.1f} TFLOP/s")

        c = default_config(D, True, q.device)
        sch_t = build_schedule(cu, T, c.block_m, c.block_n, True)
        try:
            if not with_triton:
                raise StopIteration
            rec("triton", "forward", timed(lambda: attention_forward(
                qkv_t, cu, max(lengths), True, None, q.dtype, schedule=sch_t)))
            if not forward_only:
                rec("triton", "quant+forward", timed(lambda: attention_forward(
                    quantize_qkv(q, k, v, cu, "fp8", True), cu, max(lengths), True, None,
                    q.dtype)))
        except StopIteration:
            pass
        except Exception as e:   # noqa: BLE001
            record_error(f"timing triton {name}", e)
        for cfg in cfgs:
            try:
                sch = build_schedule(cu, T, cfg.block_m, cfg.block_n, True)
                rec(cfg.name, "forward", timed(lambda: G.attention_forward_gluon(
                    qkv_t if cfg.mma_order else qkv, cu, max(lengths), True, None, q.dtype,
                    config=cfg, schedule=sch)))
                if not forward_only:
                    rec(cfg.name, "quant+forward", timed(lambda: G.attention_forward_gluon(
                        quantize_qkv(q, k, v, cu, "fp8", True, vt_mma_order=cfg.mma_order), cu,
                        max(lengths), True, None, q.dtype, config=cfg)))
            except Exception as e:   # noqa: BLE001
                record_error(f"timing {cfg.name} {name}", e)
        q = k = v = qkv = qkv_t = None      # free before the next workload
        torch.cuda.empty_cache()


def summarize(cfgs):
    rows = RESULTS["timing"]
    if rows:
        kernels = ["triton"] + [c.name for c in cfgs]
        names = []
        for r in rows:
            if r["workload"] not in names:
                names.append(r["workload"])
        for what in ("forward", "quant+forward"):
            print(f"\n=== {what}: ms (TFLOP/s); causal, FA convention ===")
            wid = [max(22, len(k) + 2) for k in kernels]
            print(f"{'workload':14s}" + "".join(f"{k:>{w}s}" for k, w in zip(kernels, wid))
                  + f"{'best/triton':>13s}")
            for n in names:
                cells, best, tri = [], None, None
                for kname in kernels:
                    r = next((x for x in rows if x["workload"] == n and x["kernel"] == kname
                              and x["what"] == what), None)
                    cells.append(f"{r['ms']:9.3f} ({r['tflops']:6.1f})" if r else f"{'-':>17s}")
                    if r and kname == "triton":
                        tri = r["ms"]
                    elif r and (best is None or r["ms"] < best):
                        best = r["ms"]
                sp = f"{tri / best:13.2f}" if (tri and best) else f"{'-':>13s}"
                print(f"{n:14s}" + "".join(f"{c:>{w}s}" for c, w in zip(cells, wid)) + sp)
    agree = RESULTS["agreement"]
    if agree:
        print("\nagreement:", {c.name: all(r["passed"] for r in agree if r["config"] == c.name)
                               for c in cfgs})
    bw = {c.name: all(r.get("bitwise_vs_" + BASE, False) for r in agree if r["config"] == c.name)
          for c in cfgs if c.ws}
    if bw and agree:
        print(f"bitwise equal to {BASE}:", bw)
    props = RESULTS["properties"]
    if props:
        print("P1/P2:", {c.name: all(r["passed"] for r in props if r["config"] == c.name)
                         for c in cfgs})
    if RESULTS["errors"]:
        print(f"{len(RESULTS['errors'])} errors (tracebacks above):")
        for e in RESULTS["errors"]:
            print("  -", e["where"], "|", e["error"])


def run_isolated(args, cfgs, env):
    """Triton timing, then each config, each in a child process of this script with a timeout;
    the children write their RESULTS as JSON, merged here."""
    passthrough = ["--only", args.only, "--reps", str(args.reps), "--dims", args.dims]
    for flag in ("quick", "skip_agreement", "skip_properties", "skip_timing", "time_failing",
                 "forward_only"):
        if getattr(args, flag):
            passthrough.append("--" + flag.replace("_", "-"))
    triton_job = ("triton", ["--configs", "none", "--skip-agreement", "--skip-properties"])
    cfg_jobs = [(c.name, ["--configs", c.name, "--no-triton"]) for c in cfgs]
    if args.parallel > 1 and cfgs:
        # correctness (plus one untimed call per timing workload, so every specialization is
        # compiled into the shared Triton cache) N at a time; then timing alone on the GPU
        run_children(args, passthrough, [(n, x + ["--skip-timing", "--warm-timing"])
                                         for n, x in cfg_jobs], args.parallel)
        if args.skip_timing:
            return
        failed = {r["config"] for r in RESULTS["agreement"] if not r["passed"]}
        failed |= {e["where"].split()[1] for e in RESULTS["errors"]
                   if e["where"].startswith("isolate ")}
        timed = [(n, x + ["--skip-agreement", "--skip-properties"]) for n, x in cfg_jobs
                 if args.time_failing or n not in failed]
        run_children(args, passthrough, [triton_job] + timed, 1)
        return
    jobs = [triton_job] + cfg_jobs
    if args.skip_timing:
        jobs = jobs[1:]
    run_children(args, passthrough, jobs, 1)


def run_children(args, passthrough, jobs, parallel):
    """Run (label, extra args) children of this script, `parallel` at a time, each with the
    --child-timeout; merge their JSON results into RESULTS in job order."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        pending = list(enumerate(jobs))
        running = []        # (index, label, proc, path, t0)
        done = {}
        while pending or running:
            while pending and len(running) < parallel:
                i, (label, extra) = pending.pop(0)
                path = os.path.join(d, f"child{i}.json")
                cmd = [sys.executable, os.path.abspath(__file__), *passthrough, *extra,
                       "--child-json", path]
                log(f"--- isolate: {label} (timeout {args.child_timeout}s)")
                running.append((i, label, subprocess.Popen(cmd), path, time.time()))
            time.sleep(0.2)
            for item in list(running):
                i, label, proc, path, t0 = item
                rc = proc.poll()
                if rc is None and time.time() - t0 > args.child_timeout:
                    proc.kill()
                    proc.wait()
                    rc = "timeout"
                if rc is not None:
                    running.remove(item)
                    done[i] = (label, rc, path)
        for i in sorted(done):
            label, rc, path = done[i]
            if os.path.exists(path):
                with open(path) as f:
                    child = json.load(f)
                for key in ("resources", "agreement", "properties", "timing", "errors"):
                    RESULTS[key] += child.get(key, [])
            if rc != 0:
                RESULTS["errors"].append({"where": f"isolate {label}", "error": f"child exit {rc}"
                                          + ("" if os.path.exists(path) else ", no results")})
                log(f"ERROR isolate {label}: child exit {rc}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help=f"comma list of {sorted(G.CONFIGS)} or gBMxBNwWsS[-rR] (default {DEFAULT_CONFIGS})")
    ap.add_argument("--only", default=",".join(WORKLOADS), help="timing workloads")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="outliers only in agreement; 20 reps")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--skip-properties", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--time-failing", action="store_true",
                    help="also time configs that failed the agreement phase")
    ap.add_argument("--cpu-smoke", action="store_true", help="compile every config for sm_90a only")
    ap.add_argument("--isolate", action="store_true",
                    help="run the Triton timing and each config in its own subprocess")
    ap.add_argument("--child-timeout", type=int, default=150, help="seconds per --isolate child")
    ap.add_argument("--no-triton", action="store_true", help="do not time the Triton forward")
    ap.add_argument("--dims", default=None, help="head dims of agreement / P1 / P2 (default 128,64)")
    ap.add_argument("--forward-only", action="store_true", help="skip the quant+forward timing")
    ap.add_argument("--parallel", type=int, default=None,
                    help="--isolate: correctness children N at a time, then timing children alone")
    ap.add_argument("--warm-timing", action="store_true",
                    help="after correctness, one untimed call per timing workload (cache warm-up)")
    ap.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    nextfwd_quick = args.quick and "nextfwd" in args.configs.split(",")
    if args.only == ",".join(WORKLOADS) and nextfwd_quick:
        args.only = NEXTFWD_QUICK_WORKLOADS
    if args.dims is None:
        args.dims = "128" if nextfwd_quick else "128,64"
    if args.parallel is None:
        args.parallel = 4 if nextfwd_quick else 1
    args.forward_only |= nextfwd_quick
    global DIMS
    DIMS = tuple(int(x) for x in args.dims.split(","))
    cfgs = parse_configs(args.configs)
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "argv": sys.argv[1:]}
    try:
        import subprocess
        env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip() or None
    except Exception:   # noqa: BLE001
        env["commit"] = None
    if args.cpu_smoke:
        RESULTS["env"] = env
        log("env", json.dumps(env))
        phase_resources_cpu(cfgs)
        summarize(cfgs)
        return
    if not torch.cuda.is_available():
        sys.exit("needs CUDA (or --cpu-smoke)")
    env.update(device=torch.cuda.get_device_name())
    RESULTS["env"] = env
    log("env", json.dumps(env))
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda"
    if args.isolate:
        run_isolated(args, cfgs, env)
    else:
        good = cfgs
        def dump():     # after every phase: a child killed later keeps what it measured
            if args.child_json:
                with open(args.child_json + ".tmp", "w") as f:
                    json.dump(RESULTS, f, default=str)
                os.replace(args.child_json + ".tmp", args.child_json)
        if not args.skip_agreement and cfgs:
            good = phase_agreement(cfgs, dev, args.quick)
            log("configs passing agreement:", [c.name for c in good])
            dump()
        if not args.skip_properties and cfgs:
            phase_properties(good or cfgs, dev)
            dump()
        if not args.skip_timing:
            reps = 20 if args.quick and args.reps == 30 else max(args.reps, 20)
            phase_timing(cfgs if args.time_failing else good, dev, args.only.split(","), reps,
                         with_triton=not args.no_triton, forward_only=args.forward_only)
            dump()
        elif args.warm_timing:
            phase_timing(good, dev, args.only.split(","), 1, with_triton=False,
                         forward_only=args.forward_only, warm_only=True)
        if args.child_json:
            return
    summarize(cfgs)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "fwd_gluon_dev.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
        log("wrote", os.path.join(out, "fwd_gluon_dev.json"))


if __name__ == "__main__":
    main()
