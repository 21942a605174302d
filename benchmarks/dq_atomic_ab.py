"""dQ by fp32 atomics from the fp8 dK/dV kernel vs the separate dQ kernel, on the H200 (issue 6:
"dQ (atomics or a separate pass: measure)").

    python benchmarks/dq_atomic_ab.py [--workloads doc8k_x4,longtail,doc32k,d64_doc8k_x4]

Per workload (fp8, causal, inputs from flamia.inputs.make_qkv, the kernel forward's operands):
  - check: dq of the atomic path against the dQ kernel's (relative max / Frobenius; the tiles'
    scales are the same subsets, only the fp32 summation order differs), dk / dv bitwise equal;
  - time, in interleaved rounds (median of CUDA-event-timed calls each): the whole backward
    (preprocess + dK/dV + dQ kernel | preprocess + dK/dV with atomics + finalize), and the
    kernels alone (dK/dV; dQ; dK/dV with atomics incl. zeroing the accumulator).
Prints one table; the CPU-side instruction counts are benchmarks/sass_loop.py --dq-atomic.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flamia.bench.workloads import load_workloads  # noqa: E402
from flamia.inputs import make_qkv  # noqa: E402
from flamia.ops import backward as B  # noqa: E402
from flamia.ops.forward import attention_forward  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402


def time_ms(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def rel(x, ref):
    d = (x.float() - ref.float())
    return ((d.abs().max() / ref.float().abs().max().clamp_min(1e-30)).item(),
            (d.norm() / ref.float().norm().clamp_min(1e-30)).item())


def run(w, rounds: int):
    lengths, D = tuple(w.doc_lengths), w.head_dim
    L = max(lengths)
    q, k, v, cu = make_qkv(lengths, w.heads_q, w.heads_kv, D, "mild", device="cuda", seed=0)
    g = torch.Generator(device="cuda").manual_seed(1)
    dout = torch.randn(q.shape, generator=g, device="cuda").to(torch.bfloat16)
    qkv = quantize_qkv(q, k, v, cu, "fp8", True)
    out, lse = attention_forward(qkv, cu, L, True, None, torch.bfloat16)
    base = B.default_config(D, "fp8", L)
    atomic = dataclasses.replace(base, dq_atomic=True)

    def bwd(cfg, det):
        return B.attention_backward(dout, out, lse, qkv, cu, L, True, deterministic=det,
                                    config=cfg)

    ref = [x.clone() for x in bwd(base, True)]
    got = [x.clone() for x in bwd(atomic, False)]
    got2 = [x.clone() for x in bwd(atomic, False)]
    dq_max, dq_fro = rel(got[0], ref[0])
    dq_run = rel(got2[0], got[0])
    same_dkdv = all(torch.equal(a, b) for a, b in zip(got[1:], ref[1:]))
    finite = all(bool(torch.isfinite(x).all()) for x in got)

    st = B.make_state(dout, out, lse, qkv, cu, L, True, None, base)
    B.launch_preprocess(st)
    sta = B.make_state(dout, out, lse, qkv, cu, L, True, None, atomic, deterministic=False)
    B.launch_preprocess(sta)

    def atomic_dkdv():
        sta.dq_acc.zero_()
        B.launch_dkdv(sta)

    fns = {"bwd": lambda: bwd(base, True), "bwd_atomic": lambda: bwd(atomic, False),
           "dkdv": lambda: B.launch_dkdv(st), "dq": lambda: B.launch_dq(st),
           "dkdv_atomic": atomic_dkdv, "finalize": lambda: B.launch_dq(sta)}
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            times[n].append(time_ms(fn))
    t = {n: statistics.median(v) for n, v in times.items()}
    return dict(workload=w.name, D=D, dq_max=dq_max, dq_fro=dq_fro, dq_run_max=dq_run[0],
                dkdv_bitwise=same_dkdv, finite=finite, **t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="doc8k_x4,longtail,doc32k,d64_doc8k_x4")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ws, _ = load_workloads()
    by_name = {w.name: w for w in ws}
    rows = []
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for name in args.workloads.split(","):
        r = run(by_name[name], args.rounds)
        rows.append(r)
        print(r, flush=True)
    print("\n| workload | D | bwd ms (dQ kernel) | bwd ms (atomic dQ) | dK/dV | dQ | dK/dV+atomics "
          "| finalize | dq rel max / fro vs dQ kernel | run-to-run dq max | dk, dv bitwise |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['D']} | {r['bwd']:.3f} | {r['bwd_atomic']:.3f} | "
              f"{r['dkdv']:.3f} | {r['dq']:.3f} | {r['dkdv_atomic']:.3f} | {r['finalize']:.3f} | "
              f"{r['dq_max']:.1e} / {r['dq_fro']:.1e} | {r['dq_run_max']:.1e} | "
              f"{r['dkdv_bitwise']} (finite {r['finite']}) |")


if __name__ == "__main__":
    main()
