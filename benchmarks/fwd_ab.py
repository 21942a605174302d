"""A/B of the fp8 recipe's forward kernels in one process on the H200: the working tree's against
copies of the kernel modules (e.g. `git show HEAD:flamia/ops/forward_gluon.py > base.py`).

    python benchmarks/fwd_ab.py --gluon base=base_g.py[,...] --triton base=base_t.py[,...]
        [--workloads doc32k,...] [--rounds 3] [--d64-gluon] [--pair]

--gluon copies of forward_gluon.py run the D=128 workloads (their launch(), outputs allocated
here as attention_forward does; V^T in wgmma key order), --triton copies of forward.py the D=64 ones (attention_forward
with the Triton config); "current" is the working tree's module. Per workload: one
quantize_qkv (fp8, causal), every variant's out / lse / row max on poisoned outputs
compared with the first variant's (bitwise, or the largest difference relative to max |out|),
then CUDA-event medians of the forward kernel alone, the variants interleaved over --rounds
rounds (median of the rounds). --pair also times the working tree's Gluon kernel on GQA pairs
(config.PAIR_FWD_CONFIG) as "pair", at D=64 too (against the Triton kernel there, by the largest
difference). A short table comes last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks.bwd_sm90_dev import cuda_ms, load_ab_base  # noqa: E402
from flamia.inputs import make_qkv  # noqa: E402
from flamia.ops import forward as current_triton  # noqa: E402
from flamia.ops import forward_gluon as current_gluon  # noqa: E402
from flamia.ops.config import (  # noqa: E402
    PAIR_FWD_CONFIG, PersistentFwdConfig, triton_forward_config)
from flamia.ops.quantize import quantize_qkv  # noqa: E402
from flamia.ops.schedule import work_list  # noqa: E402

WORKLOADS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "flamia", "data",
                         "workloads.json")


def variants(spec: str, current):
    out = {}
    for item in filter(None, spec.split(",")):
        name, path = item.split("=")
        out[name] = load_ab_base(path, f"ab_fwd_{name}")
    out["current"] = current
    return out


def gluon_forward(mod, x, cu, cfg=None):
    """attention_forward's persistent path with forward_gluon module `mod` (causal, poisoned
    outputs, cfg: PersistentFwdConfig() by default): (out, lse, row_max)."""
    T, Hq, _, D = x.shape
    cfg = cfg or PersistentFwdConfig()
    out = torch.full((T, Hq, D), float("nan"), dtype=torch.bfloat16, device=x.q8.device)
    lse, rmax = (torch.full((Hq, T), float("nan"), device=x.q8.device) for _ in range(2))
    mod.check_operands(x)
    mod.launch(x, work_list(cu, T, cfg.block_m, cfg.block_n, True), True, D ** -0.5, out, lse,
               rmax, cfg)
    return out, lse, rmax


def runner(mod, gluon: bool, x, cu, L, D):
    """x: the quantized operands (V^T in wgmma key order, which both kernels read)."""
    if gluon:
        return lambda: gluon_forward(mod, x, cu)
    cfg = triton_forward_config(D, True, torch.device("cuda"))
    return lambda: mod.attention_forward(x, cu, L, True, None, torch.bfloat16, config=cfg,
                                         poison=True, return_row_max=True)


def compare(a, b) -> str:
    if all(torch.equal(x, y) for x, y in zip(a, b)):
        return "bitwise"
    o = (a[0].float() - b[0].float()).abs().max().item() / a[0].float().abs().max().item()
    lse = (a[1] - b[1]).abs().max().item()
    nan = bool(b[0].isnan().any())
    return f"out {o:.1e} lse {lse:.1e}" + (" NaN!" if nan else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gluon", default="")
    ap.add_argument("--triton", default="")
    ap.add_argument("--workloads", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--d64-gluon", action="store_true", help="D=64 workloads: also time the "
                    "working tree's Gluon kernel, checked against the Triton kernel by the "
                    "largest difference")
    ap.add_argument("--pair", action="store_true", help="also time the working tree's Gluon "
                    "kernel on GQA pairs (PAIR_FWD_CONFIG)")
    args = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    kinds = {True: variants(args.gluon, current_gluon), False: variants(args.triton,
                                                                          current_triton)}
    wl = json.load(open(WORKLOADS))["workloads"]
    names = [x for x in args.workloads.split(",") if x]
    table = []
    for w in wl:
        if names and w["name"] not in names:
            continue
        lengths, Hq, Hkv, D = w["doc_lengths"], w["heads_q"], w["heads_kv"], w["head_dim"]
        gluon = D == 128
        mods = kinds[gluon]
        q, k, v, cu = make_qkv(lengths, Hq, Hkv, D, "mild", device="cuda", seed=0)
        x = quantize_qkv(q, k, v, cu, "fp8", True)
        L = max(lengths)
        fns = {n: runner(m, gluon, x, cu, L, D) for n, m in mods.items()}
        if args.d64_gluon and not gluon:
            fns["gluon"] = runner(current_gluon, True, x, cu, L, D)
        if args.pair:
            fns["pair"] = lambda: gluon_forward(current_gluon, x, cu, PAIR_FWD_CONFIG)
        first = None
        row = {"workload": w["name"], "kernel": "gluon" if gluon else "triton"}
        for n, f in fns.items():
            got = f()
            torch.cuda.synchronize()
            if first is None:
                first = got
                row[f"{n} check"] = "reference"
            else:
                row[f"{n} check"] = compare(first, got)
        times = {n: [] for n in fns}
        order = list(fns)
        for r in range(args.rounds):       # the order reversed every other round
            for n in (order if r % 2 == 0 else order[::-1]):
                times[n].append(cuda_ms(fns[n]))
        for n in fns:
            row[n] = statistics.median(times[n])
            # per-round ratio to the first variant (the rounds' drift cancels)
            row[f"{n} paired"] = statistics.median(a / b for a, b in zip(times[n],
                                                                        times[order[0]]))
        print(json.dumps(row), flush=True)
        table.append(row)
    for gluon in (True, False):
        rows = [r for r in table if r["kernel"] == ("gluon" if gluon else "triton")]
        if not rows:
            continue
        ns = (list(kinds[gluon]) + (["gluon"] if args.d64_gluon and not gluon else [])
              + (["pair"] if args.pair else []))
        print(f"\n{'gluon (D=128)' if gluon else 'triton (D=64)'} forward kernel, ms "
              f"(change of the medians vs {ns[0]}; paired: median of the per-round ratios)")
        print("| workload | " + " | ".join(ns) + " | checks |")
        print("|---" * (len(ns) + 2) + "|")
        for r in rows:
            cells = [f"{r[ns[0]]:.3f}"] + [f"{r[n]:.3f} ({100 * (r[n] / r[ns[0]] - 1):+.1f} %; "
                                           f"paired {r[n + ' paired']:.3f})" for n in ns[1:]]
            checks = "; ".join(f"{n}: {r[n + ' check']}" for n in ns[1:])
            print(f"| {r['workload']} | " + " | ".join(cells) + f" | {checks} |")


if __name__ == "__main__":
    main()
