"""The fp8 recipe's fused q / k / v quantization (flamia/ops/quantize.py: token-block scaling)
under its tuning knobs, on the H200.

    python benchmarks/quant_dev.py                         # default knobs vs the candidates
    python benchmarks/quant_dev.py --configs 64x4w4,128x2w8 --rounds 5
    TRITON_INTERPRET=1 python benchmarks/quant_dev.py --cpu-smoke   # no GPU: bitwise check only

Config names: BLOCK_TxSUBwWARPS (tokens per block, blocks per program, warps); the default
(quantize_qkv's own choice) is timed first. Every candidate's outputs (q8, the block and
diagonal copies of k and v, vt8, scales, vcap, vnorm) must equal the default's bitwise on the
same inputs, else it is reported and not timed: the knobs change the schedule, not the
numerics. Timing: the whole `quantize_qkv` call (what a
forward pays), CUDA events, interleaved rounds (median of rounds), inputs larger than L2, with
the achieved DRAM rate (bf16 inputs read once, every output written once).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flamia.bench.timing import TimingSettings, cuda_time  # noqa: E402
from flamia.bench.workloads import load_workloads  # noqa: E402
from flamia.inputs import make_qkv  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402

CANDIDATES = "64x2w4,64x1w4,128x2w8,128x1w8,64x4w8,32x4w4"


def parse(name: str) -> dict:
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)", name)
    if not m:
        raise SystemExit(f"config {name!r}: expected BLOCK_TxSUBwWARPS, e.g. 64x4w4")
    return dict(block_t=int(m.group(1)), sub=int(m.group(2)), num_warps=int(m.group(3)))


def outputs(x) -> list[torch.Tensor]:
    """Every tensor quantize_qkv writes, as bytes (bitwise comparison, NaN equal to NaN)."""
    fields = ("q8", "k8", "v8", "vt8", "sq", "sk", "sv", "vcap", "k8_diag", "v8_diag", "sk_diag",
              "sv_diag", "vnorm", "vt8_diag", "scale_cols")
    return [t.contiguous().view(torch.uint8) for t in (getattr(x, f, None) for f in fields)
            if t is not None]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


RECIPE = "fp8"     # quantize_qkv's only quantizing recipe (bf16 returns its inputs)


def smoke(configs: str):
    q, k, v, cu = make_qkv((70, 0, 1, 57), 4, 2, 64, "outliers", seed=1)
    ref = outputs(quantize_qkv(q, k, v, cu, RECIPE, True))
    for n in configs.split(","):
        kw = parse(n)
        kw["block_t"] = min(kw["block_t"], 32)       # interpreter-sized blocks
        print(n, "bitwise equal to the default:",
              same(ref, outputs(quantize_qkv(q, k, v, cu, RECIPE, True, **kw))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=CANDIDATES)
    ap.add_argument("--workloads", default="doc512_x64,d64_doc8k_x4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="no GPU: the bitwise check only, tiny inputs, Triton interpreter")
    args = ap.parse_args()
    if args.cpu_smoke:
        return smoke(args.configs)
    if not torch.cuda.is_available():
        sys.exit("needs CUDA (or --cpu-smoke)")
    wls = {w.name: w for w in load_workloads()[0]}
    cfgs = {"default": {}} | {n: parse(n) for n in args.configs.split(",") if n}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for wname in args.workloads.split(","):
        w = wls[wname]
        q, k, v, cu = make_qkv(tuple(w.doc_lengths), w.heads_q, w.heads_kv, w.head_dim, "mild",
                               device="cuda", seed=0)
        ref = outputs(quantize_qkv(q, k, v, cu, RECIPE, True))
        # bytes: bf16 q, k, v read once, every output written once (the token-block quantization
        # reads k and v twice and its V copies once more: the rate is a lower bound)
        moved = 2 * (q.numel() + 2 * k.numel()) + sum(t.numel() for t in ref)
        ok = {}
        for n, kw in cfgs.items():
            try:
                ok[n] = same(ref, outputs(quantize_qkv(q, k, v, cu, RECIPE, True, **kw)))
            except Exception as e:   # noqa: BLE001  (a config the kernel cannot build)
                print(f"{wname} {n}: {type(e).__name__}: {str(e)[:200]}")
                ok[n] = False
            if not ok[n]:
                print(f"{wname} {n}: outputs differ from the default's or failed: not timed")
        times = {n: [] for n in cfgs if ok[n]}
        settings = TimingSettings(warmup=3, reps=30, min_reps=10, target_s=0.3)
        for _ in range(args.rounds):
            for n in times:
                kw = cfgs[n]
                t = cuda_time(lambda i: quantize_qkv(q, k, v, cu, RECIPE, True, **kw), 1,
                              settings)
                times[n].append(t.median_ms)
        base = statistics.median(times["default"])
        for n, ts in times.items():
            ms = statistics.median(ts)
            rows.append((wname, n, ms, moved / ms / 1e9, ms / base))
            print(f"{wname:13s} {n:8s} {ms:7.3f} ms {moved / ms / 1e9:5.2f} TB/s {ms / base:5.2f}x"
                  f"  rounds " + " ".join(f"{x:.3f}" for x in ts), flush=True)
    print("\nRESULT quantize_qkv ms (x of default):")
    for wname, n, ms, gbs, rel in rows:
        print(f"RESULT {wname} {n} {ms:.3f} {gbs:.2f}TB/s {rel:.3f}")


if __name__ == "__main__":
    main()
