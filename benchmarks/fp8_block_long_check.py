"""fp8_block's kernels at long documents: relative Frobenius error against float64 of the public
call (quantize, forward, one-pass backward) next to the recipe's reference emulation and the
other kernel recipes, on one document of --tokens tokens and on 4 documents of a quarter each.

Why: the one-pass fp8 backward accumulates dK and dV in the tensor core's FP8 accumulator across
every query step of a key block (2048 steps at 32k tokens with 4 query heads), and Hopper's FP8
wgmma adds with fewer bits than fp32 (benchmarks/NOTES.md, "The FP8 tensor core's
accumulator"); the GPU tests stop at 3000-token documents. If the accumulation costs accuracy,
the kernel's dK / dV error grows with the document over the emulation's.

    python benchmarks/fp8_block_long_check.py            # H200, about a minute
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scales_v2_check32k import case_and_truth, run_block, size_label  # noqa: E402

from flamia import flamia_attn_varlen_func  # noqa: E402
from flamia.inputs import rel_err  # noqa: E402


def run_api(q, k, v, cu, do, recipe):
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    L = int((cu[1:] - cu[:-1]).max())
    out = flamia_attn_varlen_func(*xs, cu, cu, L, L, recipe=recipe, deterministic=True)
    out.backward(do)
    return out.detach(), *(x.grad for x in xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, nargs=2, default=(4, 1), metavar=("HQ", "HKV"))
    ap.add_argument("--head-dims", type=int, nargs="+", default=(128, 64))
    ap.add_argument("--families", nargs="+", default=("mild", "outliers"))
    ap.add_argument("--kernels", nargs="+", default=("fp8_block", "fp8", "bf16"))
    ap.add_argument("--chunk", type=int, default=1024)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    N, (hq, hkv) = args.tokens, args.heads
    layouts = {f"doc{size_label(N)}": (N,), f"doc{size_label(N // 4)}_x4": (N // 4,) * 4}
    t0 = time.time()
    print(f"# fp8_block at long documents: kernels (public call, deterministic) and the reference "
          f"emulation vs float64; {hq}/{hkv} heads; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(dev)}")
    rows = []
    for d in args.head_dims:
        for lname, lengths in layouts.items():
            for fam in args.families:
                (q, k, v, cu, do), ref = case_and_truth(lengths, hq, hkv, d, fam, dev,
                                                        args.chunk)
                runs = [(f"{r} kernels", lambda r=r: run_api(q, k, v, cu, do, r))
                        for r in args.kernels]
                runs.append(("fp8_block emulation", lambda: run_block(q, k, v, cu, do, "fp8_block")))
                for name, fn in runs:
                    got = fn()
                    rows.append((d, lname, fam, name, [rel_err(a, b) for a, b in zip(got, ref)]))
                    del got
                    torch.cuda.empty_cache()
                del ref
                print(f"[{time.time() - t0:6.1f} s] D={d} {lname} {fam} done", flush=True)
    print("\n| D | layout | inputs | implementation | O | dQ | dK | dV |")
    print("|---|---|---|---|---|---|---|---|")
    for d, lname, fam, name, errs in rows:
        print(f"| {d} | {lname} | {fam} | {name} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")
    print(f"total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
