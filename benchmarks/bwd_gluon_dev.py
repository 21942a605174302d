"""A/B of the Gluon backward kernels (flamia/ops/backward_gluon.py: fp8 dK/dV and dQ;
backward_gluon_mixed.py with --recipe fp8_mixed) against the Triton ones (backward.launch_dkdv /
launch_dq with FLAMIA_GLUON=0) on the H200.

    python benchmarks/bwd_gluon_dev.py --isolate             # the bisection ladder (below)
    python benchmarks/bwd_gluon_dev.py --configs default,w8ns3   # one process, as before
    python benchmarks/bwd_gluon_dev.py --workloads doc8k_x4 --skip-checks
    python benchmarks/bwd_gluon_dev.py --cpu-smoke --configs ladder   # no GPU: sm_90a report
    OUT=/dir python benchmarks/bwd_gluon_dev.py ...          # also writes $OUT/bwd_gluon_dev.json

Config ladder (LADDER, most conservative first; each step adds one feature of the design):
    safe     1 stage (no prefetch), vectors by masked gl.load, every wgmma waited for at once
    sync     + the 2-stage TMA ring (prefetch of the next query block)
    vecload  + async wgmma (S^T / dP^T / dV / dK overlapped with the element-wise work)
    default  + lse / Delta / sq / sdo by (1, BM) TMA boxes of the padded (Hq, Tp) copies
    w8safe   2 warpgroups (BN = 128), otherwise as safe
    w8ns3    2 warpgroups, 3 stages, the full design

--isolate runs every config in its own subprocess, in two phases:
  smoke (CUDA_LAUNCH_BLOCKING=1, so a crash names its launch): tiny single-document launches
     (256 tokens, Hq = Hkv = 1: D 128 causal / not, D 64), a packed unaligned GQA case, then the
     packed small checks (empty / length-1 / unaligned documents) vs float64 autograd and vs the
     Triton kernel, and NaN-document isolation. Each step prints "STEP ..." before it launches.
  perf (one subprocess for the configs whose smoke did not crash or hang; restarted past a
     config that crashes): P1 with the kernel forward, then per workload agreement with the
     Triton kernel and CUDA-event timing (kernel only; the padded-vector gather timed apart).
Each config ends with a line "RESULT <config>: smoke PASS|FAIL|CRASH|TIMEOUT ... perf ...".
The Gluon kernels are compiled for sm_90a beforehand in parallel CPU processes into the Triton
cache the subprocesses share (--no-precompile to skip), and --deadline bounds the whole run.

Checks:
1. Small checks: reference forward's saved operands -> make_state + launch_preprocess; the
   Triton and Gluon dK/dV on the same state with NaN-poisoned outputs; both vs float64 autograd
   (FlashAttention rule against the reference emulation) and vs each other. NaN isolation: a NaN
   document next to the others must not change their dK/dV bitwise.
2. P1 for the Gluon path with the kernel forward: dO zero after t, q/k/v after t perturbed
   (forward re-run): dK/dV at <= t bitwise equal, after t exactly zero; deterministic.
3. Per workload (kernel quantize + forward make the operands once): Triton and Gluon dK/dV on
   the same state, max |diff| / max |ref| and relative Frobenius per tensor, then CUDA-event
   timing (warm-up, median of --reps, in --rounds interleaved rounds of Triton and every
   config: the median of the rounds is reported, each round kept in the JSON). dK/dV FLOPs: 4 of the backward's 5 GEMMs, each
   2 * Hq * D * L^2 / 2 causal, i.e. 4 * Hq * D * sum(L^2) (the convention of NOTES.md's
   "77 ms, ~230 TFLOP/s" at doc32k).
Every config / workload runs under try/except (tracebacks printed) so the table always prints.

--kernel dq: the same phases for the Gluon dQ kernel (backward_gluon.launch_dq_gluon) against the
Triton dQ (backward.launch_dq, FLAMIA_GLUON=0), dQ only; configs from DQ_CONFIGS, ladder
DQ_LADDER (safe: 1 stage, sk / sv by gl.load, sync wgmma; sync: + 2-stage kv ring; vecload: +
async wgmma; default: + sk / sv (1, BN) TMA boxes of padded (Hkv, Tp) copies; ns2: default with
a 2-stage ring; w8: BM = 128, two warpgroups sharing each K / V / kT tile, 1 CTA / SM). P1 for dQ: dO zero after t, q / k / v after t
perturbed: dQ at <= t bitwise, after t exactly zero, reruns bitwise. FLOPs: 3 causal GEMMs.

    python benchmarks/bwd_gluon_dev.py --kernel dq --isolate --configs ladder
    python benchmarks/bwd_gluon_dev.py --kernel dq --cpu-smoke --configs ladder

--configs next (both kernels): the production default and the opt-in variants (NEXT / DQ_NEXT).
dK/dV: "default" is default_gluon_config (tuned per head dim), the others start from
plain_gluon_config (no opt-ins): late (the D=128 default with the dV GEMM issued after the dS^T
operand: fewer live registers), lateth (+ the threshold masks), w8wsth (the D=64 default, FA3's
layout, + the threshold masks), plain; more in CONFIGS (fold, smaskfold, w8wsfold,
smaskfoldpack, gather: the padded vectors by one Triton launch). dQ (default: sk / sv by the
Triton gather): torchvec (by torch gathers), ws (constexpr WS of _dq_fp8_kernel: 1-warp TMA
producer partition, maxnreg 128: 2 CTAs / SM, consumer setmaxnreg 232; the default's per-tile
numerics op for op, expected bitwise equal to it). The overlap variants (xo1 / xo2 / wsxo1 /
wsxo2) lost and were removed (benchmarks/NOTES.md, session 5).

    python benchmarks/bwd_gluon_dev.py --isolate --configs next
    python benchmarks/bwd_gluon_dev.py --kernel dq --isolate --configs next

--recipe fp8_mixed (flamia/ops/backward_gluon_mixed.py; its own ladders MIXED_LADDER /
MIXED_DQ_LADDER; the bf16 operands its kernels read (mixed_operands) are built with the padded
vectors once per state and timed apart), < 4 minutes for both kernels:
    python benchmarks/bwd_gluon_dev.py --recipe fp8_mixed --isolate --configs ladder --deadline 125
    python benchmarks/bwd_gluon_dev.py --recipe fp8_mixed --kernel dq --isolate --configs ladder \
        --deadline 95
    python benchmarks/bwd_gluon_dev.py --cpu-smoke --configs next [--kernel dq]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

if "--cpu-smoke" in sys.argv or "--precompile-worker" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)     # compile for sm_90a, not the interpreter

import torch  # noqa: E402

from flamia.ops import backward as B  # noqa: E402
from flamia.bench.timing import TimingSettings, cuda_time  # noqa: E402
from flamia.ops import backward_gluon as G  # noqa: E402
from flamia.ops import backward_gluon_mixed as M  # noqa: E402

T0 = time.time()
RESULTS: dict = {"checks": [], "p1": [], "timing": [], "compile": [], "errors": [], "steps": []}
JSON_PATH: str | None = None        # --json: progress file the --isolate parent reads
KERNEL = "dkdv"                     # --kernel: dkdv or dq (set in main before anything runs)
ROUNDS = 3                          # --rounds: interleaved timing rounds per workload

CONFIGS = {
    "safe": "stages=1,vec_tma=False,sync_mma=True",      # no prefetch, no vector TMA, sync MMA
    "sync": "stages=2,vec_tma=False,sync_mma=True",      # + TMA ring prefetch
    "vecload": "vec_tma=False",                          # + async wgmma
    "synctma": "stages=2,sync_mma=True",                 # vector TMA without async wgmma
    "default": None,                                     # default_gluon_config (tuned per D)
    "plain": None,                                       # plain_gluon_config: no opt-ins
    "ns3": "stages=3",                                   # 1 CTA/SM at D=128
    "w8safe": "bn=128,num_warps=8,stages=1,vec_tma=False,sync_mma=True",
    "w8ns3": "bn=128,num_warps=8,stages=3",              # 2 warpgroups / CTA
    "w8ns4": "bn=128,num_warps=8,stages=4",
    # opt-in variants (GluonDkdvConfig.vec_gather: host side only; .ws: constexpr WS)
    "gather": "vec_gather=True",                         # padded vectors by one Triton launch
    "w8ws": "bn=128,num_warps=8,ws=True",                # w8 + a 1-warp TMA producer partition
    "fold": "fold_sdo=True",                             # sdo folded into the exponent
    "smaskfold": "shared_mask=True,fold_sdo=True",
    "w8wsfold": "bn=128,num_warps=8,ws=True,fold_sdo=True",
    "smaskfoldpack": "shared_mask=True,fold_sdo=True,pack_vecs=True",   # + one vector box
    "w8wsfoldpack": "bn=128,num_warps=8,ws=True,fold_sdo=True,pack_vecs=True",
    "w8wssmaskfold": "bn=128,num_warps=8,ws=True,shared_mask=True,fold_sdo=True",
    # session 5 item 12, timed in session 6 item 1: lateth is the D=128 default since; w8wsth
    # (the D=64 default + threshold masks) lost to it by 2 %
    "late": "shared_mask=True,fold_sdo=True,pack_vecs=True,late_dv=True",
    "lateth": "shared_mask=True,fold_sdo=True,pack_vecs=True,late_dv=True,threshold_mask=True",
    "w8wsth": "bn=128,num_warps=8,ws=True,fold_sdo=True,pack_vecs=True,threshold_mask=True",
    # session 6 item 5, timed in session 7 item 1: the D=64 default with a 4-deep TMA ring,
    # 1 % slower
    "w8ws4": "bn=128,num_warps=8,ws=True,fold_sdo=True,pack_vecs=True,stages=4",
    # session 7 item 7: the D=128 default without shared_mask (with threshold_mask the shared
    # predicate is what the compiler hoists onto every tile: 969 -> 929 SASS, spills 72 -> 64 B)
    "lathns": "fold_sdo=True,pack_vecs=True,late_dv=True,threshold_mask=True",
    # session 10 item 7, prepared (CPU): the D=128 default with dS^T / qT8 in wgmma key order
    # (929 -> 902 SASS per tile, spills 64 -> 60 B); = "default+key_order_dk=True" at D=128
    "lathnskeydk": "fold_sdo=True,pack_vecs=True,late_dv=True,threshold_mask=True,key_order_dk=True",
}
LADDER = ["safe", "sync", "vecload", "default", "w8safe", "w8ns3"]
# --configs next: the production default and the opt-in variants
NEXT = ["default", "late", "lateth", "w8wsth", "plain"]

# --kernel dq: the Gluon dQ kernel (GluonDqConfig) against backward.launch_dq (Triton _bwd_dq)
DQ_CONFIGS = {
    "safe": "stages=1,vec_tma=False,sync_mma=True",      # no prefetch, sk / sv by gl.load, sync MMA
    "sync": "stages=2,vec_tma=False,sync_mma=True",      # + kv TMA ring prefetch
    "vecload": "vec_tma=False",                          # + async wgmma (default stages)
    "default": None,                                     # default_dq_config (persistent)
    "plain": None,                                       # plain_dq_config: one item per program
    "ns2": "stages=2",
    "w8safe": "bm=128,num_warps=8,stages=1,vec_tma=False,sync_mma=True",
    "w8": "bm=128,num_warps=8",                          # BM = 128: 2 warpgroups share K / V
    # opt-in variants (GluonDqConfig.ws / vec_gather; WS of _dq_fp8_kernel)
    "torchvec": "vec_gather=False",                      # sk / sv by torch gathers (host side)
    "ws": "ws=True,maxnreg=128",                         # 1-warp TMA producer, 2 CTAs / SM
    "s5": "stages=5",     # D=64: 3 CTAs / SM by registers (163), 5 stages: 12 % slower (s7)
    # session 7 item 3: one more CTA per SM, paid in spills (CPU compile report): D=128 3 CTAs
    # (168 regs, 212 B spills, 66.6 KB shared), D=64 4 CTAs (128 regs, 128 B, 46.6 KB)
    "r168s2": "stages=2,maxnreg=168",
    "r128s3": "stages=3,maxnreg=128",
    # session 11: persistent CTAs walking the work list (2 per SM), the ws producer running
    # ahead across items; q8 / do8 single-buffered at the default ring depth (D=128 100 KB
    # shared), or double-buffered with a 2-deep ring (91 KB)
    "pers": "ws=True,maxnreg=128,persistent=2,qbuf=1",
    "pers2s2": "ws=True,maxnreg=128,persistent=2,qbuf=2,stages=2",
}
DQ_LADDER = ["safe", "sync", "vecload", "default", "ns2", "w8"]
DQ_NEXT = ["default", "torchvec", "ws"]

# --recipe fp8_mixed: flamia/ops/backward_gluon_mixed.py against the Triton fp8_mixed kernels
# (default fp8_mixed BwdConfig: fused BM=32 below 4096 tokens, split dK / dV launches above)
MIXED_CONFIGS = {
    "safe": "stages=1,vec_tma=False,sync_mma=True",      # no prefetch, no vector TMA, sync MMA
    "sync": "stages=2,vec_tma=False,sync_mma=True",      # + TMA ring prefetch
    "vecload": "vec_tma=False",                          # + async wgmma, vectors by gl.load
    "default": None,                                     # default_mixed_dkdv_config
    "earlydv": "early_dv=True",                          # dV half 0 before dS^T (more spills)
    "ns3": "stages=3",                                   # 1 CTA/SM at D=128
    "carry": "carry=True",                               # C7515-serialized (compile report)
}
MIXED_LADDER = ["safe", "sync", "default", "earlydv"]
MIXED_DQ_CONFIGS = {
    "safe": "stages=1,vec_tma=False,sync_mma=True",
    "sync": "stages=2,vec_tma=False,sync_mma=True",
    "vecload": "vec_tma=False",
    "default": None,                                     # default_mixed_dq_config
    "ns3": "stages=3",                                   # 1 CTA/SM at D=128
    "w8": "bm=128,num_warps=8",                          # 2 warpgroups share K / V tiles
    "carry": "carry=True",
}
MIXED_DQ_LADDER = ["safe", "sync", "default", "w8"]
RECIPE = "fp8"                      # --recipe: fp8 (backward_gluon) or fp8_mixed (..._mixed)


def mixed() -> bool:
    return RECIPE == "fp8_mixed"


def kernel_configs():
    if mixed():
        return MIXED_DQ_CONFIGS if KERNEL == "dq" else MIXED_CONFIGS
    return DQ_CONFIGS if KERNEL == "dq" else CONFIGS


def kernel_ladder():
    if mixed():
        return MIXED_DQ_LADDER if KERNEL == "dq" else MIXED_LADDER
    return DQ_LADDER if KERNEL == "dq" else LADDER


def kernel_next():
    if mixed():
        raise SystemExit("--configs next: the opt-in variants exist for --recipe fp8 only")
    return DQ_NEXT if KERNEL == "dq" else NEXT


def kernel_module():
    """The module with the Gluon kernels under test (fake_state, resource_report, PTX_COUNTS)."""
    return M if mixed() else G


def compile_fn():
    if mixed():
        return M.compile_dq_sm90 if KERNEL == "dq" else M.compile_dkdv_sm90
    return G.compile_dq_sm90 if KERNEL == "dq" else G.compile_sm90


def out_names():
    """The gradients the kernel under test writes, and their index in (dq, dk, dv)."""
    return (("dq", 0),) if KERNEL == "dq" else (("dk", 1), ("dv", 2))

# name -> (doc lengths, Hq, Hkv, D); longtail comes from the packaged suite when present
WORKLOADS = {
    "doc32k": ((32768,), 32, 8, 128),
    "doc8k_x4": ((8192,) * 4, 32, 8, 128),
    "doc2k_x16": ((2048,) * 16, 32, 8, 128),
    "doc512_x64": ((512,) * 64, 32, 8, 128),
    "longtail": ((2167, 130, 309, 1091, 206, 641, 867, 258, 145, 883, 2305, 322, 37, 1, 4099),
                 32, 8, 128),
    "d64_doc8k_x4": ((8192,) * 4, 32, 32, 64),
}
ISOLATE_WORKLOADS = "doc8k_x4,longtail,d64_doc8k_x4,doc32k"

# smoke steps before the packed checks: (name, lengths, Hq, Hkv, D, causal)
TINY_STEPS = [
    ("tiny_d128_causal", (256,), 1, 1, 128, True),
    ("tiny_d128_full", (256,), 1, 1, 128, False),
    ("tiny_d64_causal", (256,), 1, 1, 64, True),
    ("packed_gqa_unaligned", (100, 37, 300), 4, 2, 128, True),
]
SMALL_LENGTHS = (300, 0, 1, 777, 1024, 45)


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def dump_progress():
    if JSON_PATH:
        tmp = JSON_PATH + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(RESULTS, fh, default=str)
        os.replace(tmp, JSON_PATH)


def step(name, **kw):
    """Mark the launch about to run (printed and in the progress file: a crash names it)."""
    RESULTS["steps"].append(dict(step=name, done=False, **kw))
    dump_progress()
    log("STEP", name, *(f"{k}={v}" for k, v in kw.items()))


def step_done(**kw):
    RESULTS["steps"][-1].update(done=True, **kw)
    dump_progress()


def record_error(what: str, e: Exception) -> None:
    """Print and record a failed step and go on, unless the CUDA context is dead: then re-raise
    and let the process end (the --isolate parent reports it)."""
    traceback.print_exc()
    RESULTS["errors"].append(dict(what=what, error=repr(e)[:400]))
    dump_progress()
    if "CUDA error" in repr(e) or "illegal" in repr(e):
        raise e


def expand_configs(spec: str) -> list[str]:
    names = []
    for c in spec.split(","):
        if c == "ladder":
            names.extend(kernel_ladder())
        elif c == "next":
            names.extend(kernel_next())
        else:
            names.append(c.replace(";", ","))
    return names


def make_cfg(name: str, D: int):
    dq = KERNEL == "dq"
    if mixed():
        base = M.default_mixed_dq_config(D) if dq else M.default_mixed_dkdv_config(D)
        cls = M.MixedDqConfig if dq else M.MixedDkdvConfig
        if name == "default":
            return base
        if name.startswith("default+"):
            name = name[len("default+"):]
    else:
        # dK/dV: variants start from the plain config (no opt-ins), "default" is the default
        base = G.plain_dq_config(D) if dq else G.plain_gluon_config(D)
        cls = G.GluonDqConfig if dq else G.GluonDkdvConfig
        default = G.default_dq_config if dq else G.default_gluon_config
        if name == "default":
            return default(D)
        if name.startswith("default+"):   # the per-D default with these overrides
            base, name = default(D), name[len("default+"):]
    spec = kernel_configs().get(name, name)   # unknown names are parsed as key=value lists
    if not spec:
        return base
    over = {}
    for kv in spec.split(","):
        k, v = kv.split("=")
        over[k] = (v == "True") if v in ("True", "False") else int(v)
    return cls(**{**base.__dict__, **over})


def packaged_workloads():
    try:
        from flamia.bench.workloads import load_workloads
        ws, _ = load_workloads()
        for w in ws:
            if w.name in ("longtail", "d64_longtail", "d64_doc8k_x4"):
                WORKLOADS[w.name] = (tuple(w.doc_lengths), w.heads_q, w.heads_kv, w.head_dim)
    except Exception as e:   # noqa: BLE001
        log("packaged workloads not loaded (using built-in longtail):", e)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def cmp(x, ref):
    x, ref = x.float(), ref.float()
    d = (x - ref)
    fin = bool(torch.isfinite(x).all())
    return dict(max_rel=(d.abs().max() / ref.abs().max().clamp_min(1e-30)).item(),
                fro_rel=(d.norm() / ref.norm().clamp_min(1e-30)).item(), finite=fin)


def outs(st):
    return tuple(getattr(st, n) for n, _ in out_names())


def poison(st):
    for x in outs(st):
        x.fill_(float("nan"))


def triton_launch(st):
    """The Triton kernel under comparison: backward.launch_dq / launch_dkdv with FLAMIA_GLUON=0,
    so the reference stays the Triton kernel where the Gluon one is wired in."""
    old = os.environ.get("FLAMIA_GLUON")
    os.environ["FLAMIA_GLUON"] = "0"
    try:
        (B.launch_dq if KERNEL == "dq" else B.launch_dkdv)(st)
    finally:
        if old is None:
            os.environ.pop("FLAMIA_GLUON", None)
        else:
            os.environ["FLAMIA_GLUON"] = old


def gluon_launch(st, cfg, vecs=None):
    if mixed():       # vecs: (padded vectors, bf16 operands) from gluon_vecs, or None
        v, ops = vecs if vecs is not None else (None, None)
        (M.launch_dq_gluon_mixed if KERNEL == "dq" else M.launch_dkdv_gluon_mixed)(st, cfg, v, ops)
    elif KERNEL == "dq":
        G.launch_dq_gluon(st, cfg, vecs)
    else:
        G.launch_dkdv_gluon(st, cfg, vecs)


def gluon_vecs(st):
    """The padded vectors the vec_tma configs read (built once per state, timed apart); for
    fp8_mixed also the host-side bf16 operands (mixed_operands)."""
    v = G.padded_kv_vectors(st) if KERNEL == "dq" else G.padded_vectors(st)
    return (v, M.mixed_operands(st, need_k=KERNEL == "dq")) if mixed() else v


def gluon_vecs_triton(st):
    """The same padded vectors by one Triton launch (flamia.ops.kmajor.padded_rows)."""
    return G.padded_kv_vectors_triton(st) if KERNEL == "dq" else G.padded_vectors_triton(st)


def run_triton(st):
    poison(st)
    triton_launch(st)
    torch.cuda.synchronize()
    return tuple(x.clone() for x in outs(st))


def run_gluon(st, cfg, vecs=None):
    poison(st)
    torch.cuda.synchronize()          # a fault in poison() is not the kernel's
    gluon_launch(st, cfg, vecs)
    torch.cuda.synchronize()
    return tuple(x.clone() for x in outs(st))


def time_ms(fn, warmup=3, reps=20):
    """Median ms of `reps` CUDA-event-timed calls after `warmup` (flamia.bench.timing)."""
    settings = TimingSettings(warmup=warmup, reps=reps, min_reps=reps)
    return cuda_time(lambda _: fn(), 1, settings).median_ms


def kernel_inputs(lengths, Hq, Hkv, D, causal=True, seed=0, family="mild"):
    from flamia.inputs import make_qkv
    from flamia.ops.forward import attention_forward
    from flamia.ops.quantize import quantize_qkv
    q, k, v, cu = make_qkv(lengths, Hq, Hkv, D, family, device="cuda", seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    dout = torch.randn(q.shape, generator=g, device="cuda").to(torch.bfloat16)
    qkv = quantize_qkv(q, k, v, cu, RECIPE, causal)
    out, lse = attention_forward(qkv, cu, max(lengths), causal, None, torch.bfloat16)
    return q, k, v, cu, dout, qkv, out, lse


def state(dout, out, lse, qkv, cu, max_len, causal, grad_dtype=None):
    st = B.make_state(dout, out, lse, qkv, cu, max_len, causal, None, None, grad_dtype)
    B.launch_preprocess(st)
    return st


# ------------------------------------------------------------------------------------------------
# 1. checks vs float64 (tiny steps + packed small checks)
# ------------------------------------------------------------------------------------------------

def check_case(tag, lengths, Hq, Hkv, D, causal, cfg_names, nan_doc=None):
    """Triton and Gluon dK/dV of one case vs float64 autograd and vs each other; with nan_doc,
    also NaN isolation (that document's q and dO NaN must not change the others bitwise).
    Gradients in fp32 (one compiled variant per (config, D, causal) for all check cases)."""
    from flamia import reference as R
    from flamia.inputs import make_qkv
    ok_all = True
    q, k, v, cu = make_qkv(lengths, Hq, Hkv, D, "mild", device="cuda", seed=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    dout = torch.randn(q.shape, generator=g, device="cuda").to(torch.bfloat16)
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    R.attention_exact(*x64, cu, causal).backward(dout.double())
    g64 = [x.grad for x in x64]
    out, lse, saved = R.forward(q, k, v, cu, RECIPE, causal)
    out = out.to(torch.bfloat16)
    ref = R.backward(dout, out, lse, saved, cu, RECIPE, causal)
    qkv = B.quantized_qkv_from_reference(saved, RECIPE, cu, causal)
    st = state(dout, out, lse.float(), qkv, cu, max(lengths), causal, torch.float32)
    step(f"{tag} triton", D=D, causal=causal)
    tk = run_triton(st)
    step_done()
    for cname in cfg_names:
        try:
            cfg = make_cfg(cname, D)
            if cfg.vec_tma:
                bad = (G.check_tma_coords_dq if KERNEL == "dq" else G.check_tma_coords)(st, cfg)
                if bad:
                    log(f"{tag} {cname}: TMA coordinate rules violated on the host side: {bad}")
            step(f"{tag} gluon", config=cname, D=D, causal=causal, Hq=Hq, Hkv=Hkv,
                 lengths=list(lengths))
            gk = run_gluon(st, cfg)
            line, row = [], dict(case=tag, D=D, causal=causal, config=cname)
            ok_case = True
            names = [n for n, _ in out_names()]
            for name, xg, xt, xr, x64_ in zip(names, gk, tk, [ref[i] for _, i in out_names()],
                                              [g64[i] for _, i in out_names()]):
                e_g = (xg.double() - x64_).abs().max().item()
                e_t = (xt.double() - x64_).abs().max().item()
                e_r = (xr.double() - x64_).abs().max().item()
                atol = 2e-3 * x64_.abs().max().item()
                fa = bool(torch.isfinite(xg).all()) and e_g <= 2 * e_r + atol
                vs_t = cmp(xg, xt)
                row[name] = dict(err64_gluon=e_g, err64_triton=e_t, err64_reference=e_r,
                                 fa_rule=fa, vs_triton=vs_t)
                ok_case &= fa
                line.append(f"{name}: err64 gluon {e_g:.3e} triton {e_t:.3e} ref {e_r:.3e}"
                            f" vs triton max {vs_t['max_rel']:.2e} fro {vs_t['fro_rel']:.2e}"
                            f"{'' if fa else ' FAIL'}")
            ok_all &= ok_case
            row["ok"] = ok_case
            RESULTS["checks"].append(row)
            step_done(ok=ok_case)
            log(f"check {tag} D={D} causal={causal} {cname}: " + " | ".join(line))
        except Exception as e:   # noqa: BLE001
            ok_all = False
            record_error(f"check {tag} D={D} causal={causal} {cname}", e)
    if nan_doc is None:
        return ok_all
    # NaN isolation: document nan_doc gets NaN q and dO
    try:
        cu_l = cu.tolist()
        a, b = cu_l[nan_doc], cu_l[nan_doc + 1]
        q2 = q.clone()
        q2[a:b] = float("nan")
        d2 = dout.clone()
        d2[a:b] = float("nan")
        out2, lse2, saved2 = R.forward(q2, k, v, cu, RECIPE, causal)
        qkv2 = B.quantized_qkv_from_reference(saved2, RECIPE, cu, causal)
        st2 = state(d2, out2.to(torch.bfloat16), lse2.float(), qkv2, cu, max(lengths),
                    causal, torch.float32)
        for cname in cfg_names:
            cfg = make_cfg(cname, D)
            step(f"{tag} nan-isolation", config=cname, D=D, causal=causal)
            g1 = run_gluon(st, cfg)
            g2 = run_gluon(st2, cfg)
            keep = torch.ones(cu_l[-1], dtype=torch.bool, device="cuda")
            keep[a:b] = False
            iso = all(torch.equal(x[keep], y[keep]) for x, y in zip(g1, g2))
            ok_all &= iso
            RESULTS["checks"].append(dict(case=tag, D=D, causal=causal, config=cname,
                                          nan_isolation_bitwise=iso, ok=iso))
            step_done(ok=iso)
            log(f"check {tag} D={D} causal={causal} {cname}: NaN document isolation "
                f"bitwise={iso}")
    except Exception as e:   # noqa: BLE001
        ok_all = False
        record_error(f"nan isolation {tag} D={D}", e)
    return ok_all


def tiny_checks(cfg_names):
    ok = True
    for name, lengths, Hq, Hkv, D, causal in TINY_STEPS:
        ok &= check_case(name, lengths, Hq, Hkv, D, causal, cfg_names)
    return ok


def small_checks(cfg_names):
    ok = True
    for D in (128, 64):
        for causal in (True, False):
            # doc 3 (777 tokens, right after an unaligned tail) is the NaN document
            ok &= check_case("packed", SMALL_LENGTHS, 8, 2, D, causal, cfg_names, nan_doc=3)
    return ok


# ------------------------------------------------------------------------------------------------
# 2. P1 with the kernel forward
# ------------------------------------------------------------------------------------------------

def p1_check(cfg_names):
    from flamia.inputs import make_qkv
    from flamia.ops.forward import attention_forward
    from flamia.ops.quantize import quantize_qkv
    lengths = (1000, 3000, 517)
    Hq, Hkv, D = 8, 2, 128
    t = 1000 + 1234           # a position inside the second document
    ok_all = True
    q, k, v, cu = make_qkv(lengths, Hq, Hkv, D, "mild", device="cuda", seed=3)
    g = torch.Generator(device="cuda").manual_seed(4)
    dout = torch.randn(q.shape, generator=g, device="cuda").to(torch.bfloat16)
    dout[t + 1:] = 0
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[t + 1:] = (torch.randn(x[t + 1:].shape, generator=g, device="cuda") * 16).to(x.dtype)

    def grads(q_, k_, v_, cfg):
        qkv = quantize_qkv(q_, k_, v_, cu, RECIPE, True)
        out, lse = attention_forward(qkv, cu, max(lengths), True, None, torch.bfloat16)
        st = state(dout, out, lse, qkv, cu, max(lengths), True)
        return run_gluon(st, cfg)

    for cname in cfg_names:
        try:
            cfg = make_cfg(cname, D)
            step("P1", config=cname)
            a = grads(q, k, v, cfg)
            a2 = grads(q, k, v, cfg)
            b = grads(q2, k2, v2, cfg)
            det = all(torch.equal(x, y) for x, y in zip(a, a2))
            pre = all(torch.equal(x[:t + 1], y[:t + 1]) for x, y in zip(a, b))
            # keys after t are only seen by queries after t, whose dO is zero
            zero = all(bool((y[t + 1:] == 0).all()) for y in b)
            ok_all &= det and pre and zero
            RESULTS["p1"].append(dict(config=cname, deterministic=det, prefix_bitwise=pre,
                                      suffix_zero=zero))
            step_done(ok=det and pre and zero)
            log(f"P1 {cname}: deterministic={det} prefix bitwise={pre} suffix zero={zero}")
        except Exception as e:   # noqa: BLE001
            ok_all = False
            record_error(f"P1 {cname}", e)
    return ok_all


# ------------------------------------------------------------------------------------------------
# 3. workloads: A/B + timing
# ------------------------------------------------------------------------------------------------

def print_table(rows):
    names = [n for n, _ in out_names()]
    print("\n| workload | D | impl | config | ms | TFLOP/s | vs triton | "
          + " | ".join(f"{n} max/fro rel" for n in names) + " | finite |")
    print("|" + "---|" * (8 + len(names)))
    for r in rows:
        if r["impl"] == "triton":
            print(f"| {r['workload']} | {r['D']} | triton | {r['config']} | {r['ms']:.3f} | "
                  f"{r['tflops']:.0f} | 1.00x | " + " | ".join("-" for _ in names) + " | - |")
        else:
            print(f"| {r['workload']} | {r['D']} | gluon | {r['config']} | {r['ms']:.3f} | "
                  f"{r['tflops']:.0f} | {r['speedup']:.2f}x | "
                  + " | ".join(f"{r[n]['max_rel']:.1e} / {r[n]['fro_rel']:.1e}" for n in names)
                  + f" | {all(r[n]['finite'] for n in names)} |")
    sys.stdout.flush()


def workloads(names, cfg_names, reps):
    rows = RESULTS["timing"]
    for wname in names:
        try:
            lengths, Hq, Hkv, D = WORKLOADS[wname]
            _, _, _, cu, dout, qkv, out, lse = kernel_inputs(lengths, Hq, Hkv, D)
            st = state(dout, out, lse, qkv, cu, max(lengths), True)
            # causal GEMMs of 2 * Hq * D * L^2 / 2 each: 4 for dK/dV (2x fwd_flops; NOTES' 230
            # TFLOP/s), 3 for dQ (S, dP, dS K; "32 ms, ~410 TFLOP/s" at doc32k)
            flops = (3 if KERNEL == "dq" else 4) * sum(Hq * D * L * L for L in lengths)
            step(f"{wname} triton")
            ref = run_triton(st)
            t_tr = time_ms(lambda: triton_launch(st), reps=reps)
            step_done()
            c = st.cfg
            tcfg = (f"q{c.q_bm}x{c.q_bn}w{c.q_warps}" if KERNEL == "dq"
                    else f"kv{c.kv_bn}x{c.kv_bm}split{c.kv_bm_dv}" if c.split_dkdv
                    else f"kv{c.kv_bn}x{c.kv_bm}")
            trow = dict(workload=wname, D=D, impl="triton", config=tcfg, ms=t_tr,
                        tflops=flops / t_tr / 1e9)
            rows.append(trow)
            log(f"{wname}: triton {KERNEL} {t_tr:.3f} ms ({flops / t_tr / 1e9:.0f} TFLOP/s)")
            vecs = gluon_vecs(st)
            t_vec = time_ms(lambda: gluon_vecs(st), reps=reps)
            log(f"{wname}: padded vectors{' + bf16 operands' if mixed() else ''} (host side, "
                f"not in the kernel times) {t_vec:.3f} ms")
            try:   # fp8: the one-launch Triton gather (config vec_gather / launchers' vecs="triton")
                if mixed():
                    raise LookupError("no Triton gather for fp8_mixed")
                vt = gluon_vecs_triton(st)
                same = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                           for a, b in zip(vecs, vt))
                t_vt = time_ms(lambda: gluon_vecs_triton(st), reps=reps)
                RESULTS.setdefault("gather", []).append(dict(workload=wname, torch_ms=t_vec,
                                                             triton_ms=t_vt, bitwise=same))
                log(f"{wname}: Triton padded-vector gather {t_vt:.3f} ms (torch {t_vec:.3f}), "
                    f"bitwise equal {same}")
                vt = None
            except LookupError:
                pass
            except Exception as e:   # noqa: BLE001
                traceback.print_exc()
                RESULTS["errors"].append(dict(what=f"{wname} triton gather", error=repr(e)[:400]))
        except Exception as e:   # noqa: BLE001
            record_error(f"{wname} setup/triton", e)
            continue
        timed = []   # (name, config, comparison vs Triton) of the configs that ran
        for cname in cfg_names:
            try:
                cfg = make_cfg(cname, D)
                step(f"{wname} gluon", config=cname)
                gk = run_gluon(st, cfg, vecs)
                cs = {n: cmp(x, y) for (n, _), x, y in zip(out_names(), gk, ref)}
                timed.append((cname, cfg, cs))
                step_done()
                log(f"{wname}: gluon {cname} "
                    + "  ".join(f"{n} max {c['max_rel']:.2e} fro {c['fro_rel']:.2e}"
                                for n, c in cs.items())
                    + f"  finite {all(c['finite'] for c in cs.values())}")
            except Exception as e:   # noqa: BLE001
                record_error(f"{wname} gluon {cname}", e)
        # Timing in ROUNDS interleaved rounds (Triton, then every config; again): the median
        # of each, so drift of the GPU during the run (clocks, temperature) hits all alike.
        # Timed once each, one after the other, two configs launching the same kernel came
        # out up to 8 % apart (benchmarks/NOTES.md, session 5, item 5).
        try:
            step(f"{wname} timing rounds")
            t_trs, t_gs = [t_tr], {cname: [] for cname, _, _ in timed}
            for r in range(ROUNDS):
                if r:
                    t_trs.append(time_ms(lambda: triton_launch(st), reps=reps))
                for cname, cfg, _ in timed:
                    t_gs[cname].append(time_ms(lambda: gluon_launch(st, cfg, vecs), reps=reps))
            step_done()
            t_tr = statistics.median(t_trs)
            trow.update(ms=t_tr, tflops=flops / t_tr / 1e9, rounds_ms=t_trs)
            for cname, cfg, cs in timed:
                t_g = statistics.median(t_gs[cname])
                row = dict(workload=wname, D=D, impl="gluon", config=cname, ms=t_g,
                           tflops=flops / t_g / 1e9, speedup=t_tr / t_g, **cs,
                           gather_ms=t_vec if cfg.vec_tma else 0.0, rounds_ms=t_gs[cname])
                rows.append(row)
                log(f"{wname}: gluon {cname} {t_g:.3f} ms ({row['tflops']:.0f} TFLOP/s, "
                    f"{t_tr / t_g:.2f}x; rounds " + " ".join(f"{x:.3f}" for x in t_gs[cname])
                    + ")")
        except Exception as e:   # noqa: BLE001
            record_error(f"{wname} timing", e)
        st = dout = qkv = out = lse = ref = vecs = None     # free before the next workload
        torch.cuda.empty_cache()
    print_table(rows)


# ------------------------------------------------------------------------------------------------
# CPU: compile report, parallel precompile
# ------------------------------------------------------------------------------------------------

def cpu_smoke(cfg_names):
    print(f"{'D':>3} {'causal':6} {'config':9} {'regs':>4} {'setmx':>5} {'spill':>5} {'C7515':>5} {'smem':>7} "
          + " ".join(f"{k:>8}" for k in kernel_module().PTX_COUNTS))
    ok = True
    for D in (128, 64):
        for causal in (True, False):
            for cname in cfg_names:
                try:
                    cfg = make_cfg(cname, D)
                    st = kernel_module().fake_state(D, causal=causal)
                    kern = compile_fn()(st, cfg)
                    r = kernel_module().resource_report(kern)
                    RESULTS["compile"].append(dict(D=D, causal=causal, config=cname, **r))
                    print(f"{D:>3} {str(causal):6} {cname:9} {r['regs']:>4} {str(r.get('setmaxnreg') or '-'):>5} {r['spill_stores']:>5} "
                          f"{'Y' if r['wgmma_serialized'] else '-':>5} {r['shared']:>7} "
                          + " ".join(f"{r[k]:>8}" for k in kernel_module().PTX_COUNTS), flush=True)
                    if r["tma_1d"]:
                        print("   ^ 1-D TMA in the PTX (its coordinates must be 16-byte aligned)")
                except Exception:   # noqa: BLE001
                    ok = False
                    traceback.print_exc()
    return ok


# the variants the GPU phases launch: checks in fp32 (D x causal), P1 / workloads in bf16 causal
PRECOMPILE_VARIANTS = [(128, True, "f32"), (128, False, "f32"), (64, True, "f32"),
                       (64, False, "f32"), (128, True, "bf16"), (64, True, "bf16")]


def precompile_worker(job: str):
    cname, D, causal, dt = job.split("|")
    st = kernel_module().fake_state(int(D), T=1024, Hq=8, Hkv=2, causal=causal == "True", rotate=True,
                      lengths=[300, 0, 1, 723],
                      grad_dtype=torch.float32 if dt == "f32" else torch.bfloat16)
    compile_fn()(st, make_cfg(cname, int(D)))


def precompile(cfg_names, jobs, timeout):
    """Compile every (config, variant) for sm_90a in parallel CPU subprocesses into the Triton
    cache (the kernel's cache key does not depend on T / head counts). Failures only cost time:
    the GPU phases compile what is missing."""
    todo = [f"{c}|{D}|{causal}|{dt}" for c in cfg_names for D, causal, dt in PRECOMPILE_VARIANTS]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs, t0, n_ok = [], time.time(), 0
    per = max(1, (len(todo) + jobs - 1) // jobs)
    for i in range(0, len(todo), per):
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--kernel", KERNEL, "--recipe", RECIPE, "--precompile-worker",
             ",".join(todo[i:i + per])], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, timeout - (time.time() - t0)))
            n_ok += out.count("PRECOMPILED")
            if p.returncode:
                log("precompile worker failed:", out[-1500:])
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            log("precompile worker timed out")
    log(f"precompiled {n_ok}/{len(todo)} kernels in {time.time() - t0:.1f}s ({len(procs)} procs)")


# ------------------------------------------------------------------------------------------------
# --isolate: one subprocess per config (smoke), one for the survivors (perf)
# ------------------------------------------------------------------------------------------------

def _child(args_list, env_extra, timeout, json_path):
    env = dict(os.environ)
    env.pop("OUT", None)
    env.update(env_extra)
    cmd = [sys.executable, os.path.abspath(__file__), "--kernel", KERNEL, "--recipe", RECIPE, "--json", json_path,
           *args_list]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out, timed_out = p.returncode, p.stdout + p.stderr, False
    except subprocess.TimeoutExpired as e:
        def txt(x):
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
        rc, out, timed_out = None, txt(e.stdout) + txt(e.stderr), True
    res = {}
    try:
        with open(json_path) as fh:
            res = json.load(fh)
    except (OSError, ValueError):
        pass
    return rc, out, timed_out, res, time.time() - t0


def _first_error(out: str) -> str:
    for key in ("illegal", "CUDA error", "Error", "error"):
        for ln in out.splitlines():
            if key in ln and "STEP" not in ln:
                return ln.strip()[:300]
    return ""


def _last_step(res) -> dict | None:
    """The step in flight when the child died (the last one, if it never finished)."""
    st = res.get("steps", [])
    return st[-1] if st and not st[-1].get("done") else None


def _print_child(tag, out):
    print(f"----- {tag} output -----")
    for ln in out.splitlines():
        print(f"[{tag}] {ln}")
    print(f"----- end {tag} -----", flush=True)


def isolate(args, cfg_names):
    deadline = T0 + args.deadline
    tmp = tempfile.mkdtemp(prefix=f"bwd_gluon_dev_{RECIPE}_")
    summary = {c: dict(smoke="NOT RUN", perf="NOT RUN") for c in cfg_names}
    merged = {"smoke": {}, "perf": [], "summary": summary}
    if args.precompile:
        precompile(cfg_names, args.jobs_compile, timeout=min(120, args.deadline / 3))

    # smoke: one subprocess per config, a few at a time (a crashed or hung context is per
    # process; the GPU time-slices the others)
    pending = list(cfg_names)
    running = []
    while pending or running:
        while pending and len(running) < args.jobs and time.time() < deadline - 20:
            c = pending.pop(0)
            jp = os.path.join(tmp, f"smoke_{c.replace(',', '_')}.json")
            sargs = ["--phase", "smoke", "--configs", c.replace(",", ";")]
            env = {"CUDA_LAUNCH_BLOCKING": "1"}
            cmd = [sys.executable, os.path.abspath(__file__), "--kernel", KERNEL, "--recipe", RECIPE, "--json", jp,
                   *sargs]
            full_env = dict(os.environ)
            full_env.pop("OUT", None)
            full_env.update(env)
            fh = open(os.path.join(tmp, f"smoke_{c.replace(',', '_')}.log"), "w+")
            p = subprocess.Popen(cmd, env=full_env, stdout=fh, stderr=subprocess.STDOUT, text=True)
            running.append((c, p, fh, jp, time.time()))
            log(f"smoke {c}: started (pid {p.pid})")
        if not running:
            for c in pending:
                summary[c]["smoke"] = "SKIPPED (deadline)"
            break
        time.sleep(0.5)
        for item in list(running):
            c, p, fh, jp, t0 = item
            limit = min(args.smoke_timeout, deadline - t0)
            timed_out = False
            if p.poll() is None:
                if time.time() - t0 < limit:
                    continue
                p.kill()
                p.wait()
                timed_out = True
            running.remove(item)
            fh.seek(0)
            out = fh.read()
            fh.close()
            res = {}
            try:
                with open(jp) as jf:
                    res = json.load(jf)
            except (OSError, ValueError):
                pass
            _print_child(f"smoke {c}", out)
            last = _last_step(res)
            ctx = {k: v for k, v in (last or {}).items() if k not in ("step", "done")}
            where = f" at {last['step']} {ctx}" if last else ""
            checks = [r for r in res.get("checks", []) if r.get("config") == c]
            n_ok = sum(bool(r.get("ok")) for r in checks)
            if timed_out:
                status = f"TIMEOUT after {time.time() - t0:.0f}s{where}"
            elif p.returncode != 0:
                status = f"CRASH rc={p.returncode}{where}: {_first_error(out)}"
            elif res.get("ok"):
                status = f"PASS ({n_ok}/{len(checks)} checks)"
            else:
                status = f"FAIL ({n_ok}/{len(checks)} checks ok)"
            worst = {}
            for r in checks:
                for nm, _ in out_names():
                    if nm in r:
                        w = worst.setdefault(nm, [0.0, 0.0])
                        w[0] = max(w[0], r[nm]["vs_triton"]["max_rel"])
                        w[1] = max(w[1], r[nm]["vs_triton"]["fro_rel"])
            if worst:
                status += " | worst vs triton " + " ".join(
                    f"{nm} max {w[0]:.1e} fro {w[1]:.1e}" for nm, w in worst.items())
            summary[c]["smoke"] = status
            merged["smoke"][c] = res
            log(f"smoke {c}: {status} ({time.time() - t0:.0f}s)")

    # perf: the configs that neither crashed nor hung, one subprocess, restarted past a crash
    todo = [c for c in cfg_names if summary[c]["smoke"].startswith(("PASS", "FAIL"))]
    for c in cfg_names:
        if c not in todo and summary[c]["perf"] == "NOT RUN":
            summary[c]["perf"] = "skipped (smoke)"
    attempt = 0
    while todo and not args.skip_perf:
        left = deadline - time.time()
        if left < 30:
            for c in todo:
                summary[c]["perf"] = "SKIPPED (deadline)"
            break
        attempt += 1
        jp = os.path.join(tmp, f"perf_{attempt}.json")
        pargs = ["--phase", "perf", "--configs", ",".join(x.replace(",", ";") for x in todo),
                 "--workloads", args.workloads, "--reps", str(args.reps),
                 "--rounds", str(args.rounds)]
        if args.skip_p1:
            pargs.append("--skip-p1")
        rc, out, timed_out, res, dt = _child(pargs, {}, left - 5, jp)
        _print_child(f"perf#{attempt}", out)
        merged["perf"].append(res)
        for c in todo:      # a restarted child re-measures its configs: keep the latest
            summary[c].pop("rows", None)
            summary[c].pop("p1", None)
        for r in res.get("timing", []):
            if r["impl"] == "gluon" and r["config"] in summary:
                summary[r["config"]].setdefault("rows", []).append(r)
        for r in res.get("p1", []):
            if r["config"] in summary:
                summary[r["config"]]["p1"] = r
        if rc == 0 and not timed_out:
            for c in todo:
                summary[c]["perf"] = "done"
            break
        last = _last_step(res)
        bad = last.get("config") if last else None
        what = "TIMEOUT" if timed_out else f"CRASH rc={rc}: {_first_error(out)}"
        if bad not in todo:     # not inside a config's launch (setup / Triton): stop here
            for c in todo:
                summary[c]["perf"] = f"{what} (outside a Gluon launch: {last})"
            break
        summary[bad]["perf"] = f"{what} at {last['step']}"
        todo = [c for c in todo if c != bad]

    print("\n==================== per-config results ====================")
    for c in cfg_names:
        s = summary[c]
        p1 = s.get("p1")
        p1s = (f" | P1 det={p1['deterministic']} prefix={p1['prefix_bitwise']} "
               f"suffix0={p1['suffix_zero']}" if p1 else "")
        perf = "; ".join(f"{r['workload']} {r['ms']:.2f} ms {r['speedup']:.2f}x "
                         + " ".join(f"{n} max {r[n]['max_rel']:.1e} fro {r[n]['fro_rel']:.1e}"
                                    for n, _ in out_names())
                         + ("" if all(r[n]["finite"] for n, _ in out_names()) else " NONFINITE")
                         for r in s.get("rows", []))
        cfgs = f"D=128 {make_cfg(c, 128)}"   # the D=64 config too where it differs
        if make_cfg(c, 64) != make_cfg(c, 128):
            cfgs += f"; D=64 {make_cfg(c, 64)}"
        print(f"RESULT {'dq ' if KERNEL == 'dq' else ''}{c} [{cfgs}]: smoke {s['smoke']}{p1s} | perf "
              f"{s['perf'] if not perf or s['perf'] != 'done' else ''}{perf}", flush=True)
    tr = {}
    for res in merged["perf"]:
        for r in res.get("timing", []):
            if r["impl"] == "triton":
                tr[r["workload"]] = r["ms"]
    if tr:
        print(f"RESULT triton {'dq ' if KERNEL == 'dq' else ''}reference: "
              + "; ".join(f"{w} {ms:.2f} ms" for w, ms in tr.items()))
    log(f"isolate done in {time.time() - T0:.0f}s (deadline {args.deadline}s)")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, json_name()), "w") as fh:
            json.dump(merged, fh, indent=1, default=str)


def json_name():
    stem = "bwd_gluon_dev" + ("_mixed" if mixed() else "")
    return stem + ("_dq.json" if KERNEL == "dq" else ".json")


def main():
    global JSON_PATH, KERNEL, RECIPE, ROUNDS
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", choices=("fp8", "fp8_mixed"), default="fp8",
                    help="fp8: flamia/ops/backward_gluon.py; fp8_mixed: backward_gluon_mixed.py "
                         f"(configs {sorted(MIXED_CONFIGS)}, dq: {sorted(MIXED_DQ_CONFIGS)})")
    ap.add_argument("--kernel", choices=("dkdv", "dq"), default="dkdv",
                    help="dkdv: Gluon dK/dV vs launch_dkdv; dq: Gluon dQ vs Triton launch_dq")
    ap.add_argument("--configs", default="default",
                    help=f"comma list of {sorted(CONFIGS)} (dq: {sorted(DQ_CONFIGS)}), 'ladder' "
                         f"({','.join(LADDER)}; dq: {','.join(DQ_LADDER)}), 'next' "
                         f"({','.join(NEXT)}; dq: {','.join(DQ_NEXT)}), or "
                         "key=value;key=value overrides")
    ap.add_argument("--workloads", default=None,
                    help=f"default: all ({','.join(WORKLOADS)}); with --isolate "
                         f"{ISOLATE_WORKLOADS}")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved timing rounds per workload (median of the rounds)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-p1", action="store_true")
    ap.add_argument("--skip-perf", action="store_true", help="--isolate: smoke phase only")
    ap.add_argument("--cpu-smoke", action="store_true", help="compile-only report, no GPU")
    ap.add_argument("--isolate", action="store_true",
                    help="each config in its own subprocess (smoke), then perf; see docstring")
    ap.add_argument("--phase", choices=("all", "smoke", "perf"), default="all")
    ap.add_argument("--json", default=None, help="progress / results file (subprocess mode)")
    ap.add_argument("--deadline", type=float, default=225.0,
                    help="--isolate: seconds for the whole run; nothing new starts after it")
    ap.add_argument("--smoke-timeout", type=float, default=150.0)
    ap.add_argument("--jobs", type=int, default=3, help="--isolate: smoke subprocesses at once")
    ap.add_argument("--jobs-compile", type=int, default=12)
    ap.add_argument("--no-precompile", dest="precompile", action="store_false")
    ap.add_argument("--precompile-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    KERNEL = args.kernel
    RECIPE = args.recipe
    ROUNDS = max(1, args.rounds)
    if args.precompile_worker:
        for job in args.precompile_worker.split(","):
            try:
                precompile_worker(job)
                print("PRECOMPILED", job, flush=True)
            except Exception:   # noqa: BLE001
                traceback.print_exc()
        return
    cfg_names = expand_configs(args.configs)
    if args.cpu_smoke:
        sys.exit(0 if cpu_smoke(cfg_names) else 1)
    if args.workloads is None:
        args.workloads = ISOLATE_WORKLOADS if args.isolate else ",".join(WORKLOADS)
    if args.isolate:
        isolate(args, cfg_names)
        return
    JSON_PATH = args.json
    assert torch.cuda.is_available(), "needs the H200 (or use --cpu-smoke)"
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} "
        f"triton {__import__('triton').__version__} configs {cfg_names} phase {args.phase} "
        f"CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING', '0')}")
    for c in cfg_names:
        log(f"config {c}: {make_cfg(c, 128)} (D=128) / {make_cfg(c, 64)} (D=64)")
    packaged_workloads()
    ok = True
    RESULTS["ok"] = False
    dump_progress()
    if args.phase in ("all", "smoke") and not args.skip_checks:
        ok &= tiny_checks(cfg_names)
        ok &= small_checks(cfg_names)
    if args.phase in ("all", "perf") and not args.skip_checks and not args.skip_p1:
        ok &= p1_check(cfg_names)
    if not args.skip_checks:
        log("CHECKS", "PASS" if ok else "FAIL")
    RESULTS["ok"] = ok
    dump_progress()
    if args.phase in ("all", "perf"):
        workloads(args.workloads.split(","), cfg_names, args.reps)
    if RESULTS["errors"]:
        log(f"{len(RESULTS['errors'])} errors:", *(e["what"] for e in RESULTS["errors"]))
    dump_progress()
    out = os.environ.get("OUT")
    if out and not JSON_PATH:
        RESULTS["env"] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                              triton=__import__("triton").__version__, checks_ok=ok)
        with open(os.path.join(out, json_name()), "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
