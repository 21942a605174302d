"""The fp8 recipe's backward passes around its kernel on the H200: GPU time per kernel
(torch.profiler) of attention_backward_sm90_fp8 under launch settings of the preprocess and the
post pass (config.Sm90BwdConfig's fp8_pre_warps, fp8_post_rows, fp8_post_warps), one process,
the shared/workloads.json shapes.

    python benchmarks/bwd_fp8_passes_dev.py [--workloads doc512_x64,d64_doc8k_x4]
        [--settings 4:64:4,8:64:8,4:128:8]          # pre warps : post rows : post warps
                                                    #   [: Q^T / dO^T in the kernel, 0 / 1]
        [--ab name=path,...]     # copies of backward_sm90.py, each at the library's config
                                 #   for the workload (as a call would choose it)
        [--rounds 5]             # settings and copies interleaved, medians reported

Every setting and copy is checked bitwise against the first setting (deterministic mode; the
preprocess's row sums may round differently at another warp count: 16 warps at D=64 do).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flamia.inputs import cu_seqlens_from_lengths  # noqa: E402
from flamia.ops import backward_sm90 as B  # noqa: E402
from flamia.ops.config import sm90_backward_config  # noqa: E402
from flamia.ops.forward import attention_forward  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402


def kernel_ms(fn, calls=5):
    """{kernel name: GPU ms per call} over `calls` calls after a warm-up."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key[:40]] += e.device_time_total / 1e3 / calls
    return dict(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="doc512_x64,doc32k,d64_doc8k_x4")
    ap.add_argument("--settings", default="4:64:4,8:64:4,4:64:8,4:128:8,8:128:8,4:32:4")
    ap.add_argument("--ab", default="", help="name=path,... copies of backward_sm90.py")
    ap.add_argument("--rounds", type=int, default=1, help="settings and copies interleaved "
                    "over this many rounds; medians reported")
    args = ap.parse_args()
    from bwd_sm90_dev import load_ab_base   # (benchmarks/ is the script's directory)
    mods = {n: load_ab_base(p, "ab_" + n) for n, p in
            (x.split("=") for x in filter(None, args.ab.split(",")))}
    wl = {w["name"]: w for w in json.load(open(os.path.join(
        os.path.dirname(__file__), "..", "flamia", "data", "workloads.json")))["workloads"]}
    settings = [tuple(int(x) for x in s.split(":")) for s in args.settings.split(",")]
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    rows = []
    for name in args.workloads.split(","):
        w = wl[name]
        lengths, Hq, Hkv, D = w["doc_lengths"], w["heads_q"], w["heads_kv"], w["head_dim"]
        T = sum(lengths)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(T, h, D, device="cuda", generator=g).to(torch.bfloat16)
                       for h in (Hq, Hkv, Hkv, Hq))
        cu = cu_seqlens_from_lengths(lengths, device="cuda")
        qkv = quantize_qkv(q, k, v, cu, "fp8", True)
        out, lse, rmax = attention_forward(qkv, cu, max(lengths), True, None, torch.bfloat16,
                                           return_row_max=True)
        first = None
        # the library's config for this max_seqlen (so the preprocess's K-major copies are
        # written or not as a call would), with the settings' pass launches and, given a fourth
        # field, Q^T / dO^T made in the kernel (1, D=128 only) or by the preprocess (0)
        runs = []
        for st in settings:
            cfg = replace(sm90_backward_config(D, max(lengths)), fp8_pre_warps=st[0],
                          fp8_post_rows=st[1], fp8_post_warps=st[2])
            if len(st) > 3:
                if st[3] and D != 128:
                    continue
                cfg = replace(cfg, fp8_kmajor_onchip=bool(st[3]))
            runs.append((":".join(map(str, st)), B, cfg))
        runs += [(n, m, sm90_backward_config(D, max(lengths))) for n, m in mods.items()]
        times = {label: [] for label, _, _ in runs}
        same = {}
        for rnd in range(args.rounds):
            for label, mod, cfg in runs:
                run = lambda: mod.attention_backward_sm90_fp8(do, out, lse, rmax, qkv, cu,  # noqa
                                                              True, deterministic=True, config=cfg)
                if rnd == 0:
                    got = run()
                    if first is None:
                        first = got
                    same[label] = all(torch.equal(a, b) for a, b in zip(got, first))
                ms = kernel_ms(run)
                times[label].append((sum(t for k_, t in ms.items() if "preprocess" in k_),
                                     sum(t for k_, t in ms.items() if "postprocess" in k_),
                                     sum(ms.values())))
                print(name, label, rnd, {k_: round(t, 3) for k_, t in ms.items()}, flush=True)
        for label, _, _ in runs:
            med = [statistics.median(x[i] for x in times[label]) for i in range(3)]
            rows.append((name, label, *med, same[label]))
    print("\n| workload | pre warps:post rows:post warps or copy | preprocess ms | post ms "
          "| all kernels ms | bitwise = first |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.3f} | {r[5]} |")


if __name__ == "__main__":
    main()
