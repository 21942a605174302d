"""Where the time of one user call goes: per-kernel GPU time of flamia forward+backward (H200).

    python benchmarks/profile_call.py                          # every workload, fp8
    python benchmarks/profile_call.py --only doc512_x64,doc32k --recipes fp8,bf16
    python benchmarks/profile_call.py --forward-only        # the training forward alone

For each workload of shared/workloads.json: bf16 inputs, the public varlen call forward and
backward (check_finite=False, as `flamia bench` times it), median wall time over CUDA events,
then torch.profiler over a few calls: GPU time per kernel (summed over calls, per call), the
sum of all kernels, and the gap (wall - kernels: launch overhead, host syncs, idle GPU). A gap
that is a large share of the wall time says the call is bound by the host, not by the kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flamia.bench.workloads import load_workloads  # noqa: E402
from flamia.inputs import make_qkv  # noqa: E402
from flamia.interface import flamia_attn_varlen_func  # noqa: E402


def call_fn(q, k, v, cu, L, recipe, dout, forward_only=False):
    def run():
        out = flamia_attn_varlen_func(q, k, v, cu, cu, L, L, recipe=recipe, check_finite=False)
        if not forward_only:
            torch.autograd.grad(out, (q, k, v), dout)     # no .grad accumulation kernels
    return run


def wall_ms(fn, reps=10):
    """Median ms of one call, each timed from an idle GPU (synchronized before the next): the
    host time before the first kernel counts, as a layer's call in a training step sees it.
    (flamia.bench.timing queues reps back to back, which hides that gap.)"""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def host_ms(fn, calls=20):
    """CPU time to issue one call when the GPU never waits on the host (no sync inside)."""
    import time
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1000 / calls


def host_breakdown(T, cu):
    """CPU ms per call of the host-side pieces that run torch ops (GPU kept busy), called
    directly: the call path memoizes both per cu_seqlens tensor, so this is what a call with a
    new cu_seqlens pays on top of the issue time above."""
    import time
    from flamia.ops.kmajor import kmajor_layout
    from flamia.ops.schedule import build_schedule
    res = {}
    for name, f in (("build_schedule", lambda: build_schedule(cu, T, 64, 128, True)),
                    ("kmajor_layout", lambda: kmajor_layout(cu, T))):
        f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            f()
        res[name] = (time.perf_counter() - t0) * 1000 / 20
        torch.cuda.synchronize()
    return res


def kernel_table(fn, calls=3):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            rows[ev.name] = rows.get(ev.name, 0.0) + ev.device_time / 1000.0
    return sorted(((n, t / calls) for n, t in rows.items()), key=lambda r: -r[1])


def idle_gaps(fn, calls=3, top=6):
    """Where the GPU idles inside back-to-back calls: a chrome trace of `calls` calls, its
    kernels sorted by start, and the gaps between one kernel's end and the next one's start
    (the host not keeping up, or a host sync). Returns (busy span ms per call, kernel ms per
    call, idle ms per call, the `top` largest gaps as (us, kernel before, kernel after))."""
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace = json.load(fh)
    ks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace.get("traceEvents", [])
                if e.get("cat") == "kernel" and "dur" in e)
    if not ks:
        return 0.0, 0.0, 0.0, []
    gaps = [(b0 - a1, an, bn) for (_, a1, an), (b0, _, bn) in zip(ks, ks[1:]) if b0 > a1]
    span = ks[-1][1] - ks[0][0]
    kern = sum(b - a for a, b, _ in ks)
    idle = sum(g for g, _, _ in gaps)
    gaps.sort(key=lambda g: -g[0])
    return span / 1000 / calls, kern / 1000 / calls, idle / 1000 / calls, gaps[:top]


def sync_points(fn):
    """The host syncs of one call (torch.cuda.set_sync_debug_mode('warn') warnings)."""
    import warnings
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [str(w.message).splitlines()[0][:160] for w in caught
            if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)]


def add_workload_flags(ap) -> None:
    """--docs / --heads / --head-dim: one workload from flags instead of workloads.json."""
    ap.add_argument("--docs", default=None,
                    help="one workload from flags instead (flamia bench --docs syntax), e.g. "
                         "'2048x14,1024x4' with --heads 8/2 --head-dim 64: train-check's shape")
    ap.add_argument("--heads", default="32/8", help="with --docs: HQ/HKV")
    ap.add_argument("--head-dim", type=int, default=128, help="with --docs")


def workloads_of(args) -> list:
    """The --docs workload (named "docs"), or every workload of workloads.json."""
    if args.docs:
        from flamia.bench.workloads import workload_from_flags
        return [workload_from_flags(args.docs, args.heads, args.head_dim, name="docs")]
    return load_workloads()[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--recipes", default="fp8")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--forward-only", action="store_true",
                    help="the training forward alone (inputs require grad, nothing backward)")
    ap.add_argument("--gaps", action="store_true",
                    help="also: GPU idle gaps between kernels of back-to-back calls, host syncs")
    add_workload_flags(ap)
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    report = []
    workloads = workloads_of(args)
    for w in workloads:
        if only and w.name not in only:
            continue
        for recipe in args.recipes.split(","):
            q, k, v, cu = make_qkv(tuple(w.doc_lengths), w.heads_q, w.heads_kv, w.head_dim,
                                   "mild", device="cuda", seed=0)
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            dout = torch.randn_like(q)
            L = max(w.doc_lengths)
            fn = call_fn(q, k, v, cu, L, recipe, dout, args.forward_only)
            ms = wall_ms(fn)
            table = kernel_table(fn)
            ksum = sum(t for _, t in table)
            hms = host_ms(fn)
            parts = host_breakdown(q.shape[0], cu)
            what = "fwd" if args.forward_only else "fwd+bwd"
            print(f"\n== {w.name} {recipe}: wall {ms:.3f} ms per {what} call, kernels {ksum:.3f} ms,"
                  f" gap {ms - ksum:.3f} ms ({100 * (ms - ksum) / ms:.0f} %); host issue time "
                  f"{hms:.3f} ms per call (memoized per cu_seqlens; unmemoized they would cost "
                  + ", ".join(f"{n} {t:.3f}" for n, t in parts.items()) + ")", flush=True)
            for name, t in table[:args.top]:
                print(f"  {t:8.3f} ms  {100 * t / ms:5.1f} %  {name[:110]}")
            if args.gaps:
                span, kern, idle, top = idle_gaps(fn)
                print(f"  back-to-back: GPU span {span:.3f} ms per call, kernels {kern:.3f}, "
                      f"idle between kernels {idle:.3f} ms ({100 * idle / max(span, 1e-9):.1f} %)")
                for g, a, b in top:
                    print(f"    idle {g:8.1f} us after {a[:50]} before {b[:50]}")
                syncs = sync_points(fn)
                print(f"  host syncs in one call: {len(syncs)}"
                      + "".join(f"\n    {m}" for m in syncs[:8]))
            report.append({"workload": w.name, "recipe": recipe, "what": what, "wall_ms": ms,
                           "kernels_ms": ksum, "host_ms": hms, "host_parts": parts,
                           "kernels": table[:40]})
            del q, k, v, dout, fn
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        name = "profile_call_fwd.json" if args.forward_only else "profile_call.json"
        with open(os.path.join(out, name), "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": report}, fh, indent=1)


if __name__ == "__main__":
    main()
