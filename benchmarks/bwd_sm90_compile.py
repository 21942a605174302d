"""Compile the one-pass sm90 backward kernel for sm_90a on a CPU (no GPU): registers, spills,
shared memory, wgmma serialization and SASS per step, per head dim / config.

    python benchmarks/bwd_sm90_compile.py [--dims 64,128] [--sass]     # the bf16 kernel
    python benchmarks/bwd_sm90_compile.py --fp8 [--block-m 64]          # the fp8 recipe's kernel
    python benchmarks/bwd_sm90_compile.py --fp8 --dims 64 --sass --lines # SASS per source line
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flamia.ops import backward_sm90 as B  # noqa: E402
from flamia.ops.config import Sm90BwdConfig, sm90_backward_config  # noqa: E402
from benchmarks.tools.compile import (  # noqa: E402
    compile_only, fake_qkv, ptx_counts, resource_usage)


def build(D: int, cfg=None, causal=True, T=1024, Hq=8, Hkv=2, dtype=torch.bfloat16,
          deterministic=False):
    q = torch.randn(T, Hq, D).to(dtype)
    k = torch.randn(T, Hkv, D).to(dtype)
    v = torch.randn(T, Hkv, D).to(dtype)
    do = torch.randn(T, Hq, D).to(dtype)
    o = torch.randn(T, Hq, D).to(dtype)
    lse = torch.zeros(Hq, T)
    cu = torch.tensor([0, 300, T], dtype=torch.int32)
    with compile_only() as built:
        B.attention_backward_sm90(do, o, lse, q, k, v, cu, causal, None,
                                  deterministic=deterministic, config=cfg)
    return dict(built)


def build_fp8(D: int, cfg=None, causal=True, T=1024, Hq=8, Hkv=2, deterministic=False):
    qkv = fake_qkv(T, Hq, Hkv, D, "fp8")
    do = torch.randn(T, Hq, D).to(torch.bfloat16)
    o = torch.randn(T, Hq, D).to(torch.bfloat16)
    cu = torch.tensor([0, 300, T], dtype=torch.int32)
    with compile_only() as built:
        B.attention_backward_sm90_fp8(do, o, torch.zeros(Hq, T), torch.zeros(Hq, T), qkv, cu,
                                      causal, deterministic=deterministic, config=cfg)
    return dict(built)


def report(kern, label: str, sass: bool = True, lines: bool = False, path: int | None = None
           ) -> None:
    """Print one sm_90a build: registers (and the partitions' setmaxnreg), spills, shared
    memory, wgmma serialization and count, bar.syncs; sass: the main loop's SASS count; lines:
    its opcodes per source line, most first (path: those of the path-th shortest distinct path
    through one step instead of the whole loop; 0 is the plain step)."""
    u = resource_usage(kern)
    ptx = kern.asm["ptx"]
    c = ptx_counts(ptx)
    print(f"{label}: regs={u['regs']} setmaxnreg={c['partition_regs']} stack={u['stack']} "
          f"spills={u['spill_stores']} smem={u['shared']} serialized={u['wgmma_serialized']} "
          f"wgmma={c['wgmma']} bar.sync={c['bar']}")
    if sass:
        from benchmarks.tools.sass import (describe_paths, loop_paths, main_loop, parse,
                                           predicated, sass_of)
        text = sass_of(kern)
        loop = main_loop(parse(text))
        print(f"  main loop: {len(loop)} SASS; one step issues, by the branches it takes:")
        print(describe_paths(text))
        if lines and path is not None:
            distinct = {len(p): p for p in loop_paths(loop, predicated(text))}
            loop = distinct[sorted(distinct)[path]]
            print(f"  lines of path {path} ({len(loop)} SASS):")
        if lines:
            from benchmarks.tools.sass import by_source_line
            for where, ops in sorted(by_source_line(kern, loop).items(),
                                     key=lambda kv: -sum(kv[1].values())):
                print(f"  {where:28s} {sum(ops.values()):5d}  "
                      + " ".join(f"{o}:{n}" for o, n in ops.most_common(6)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--sass", action="store_true", help="SASS count of the main loop")
    ap.add_argument("--lines", action="store_true", help="with --sass: the main loop's opcodes "
                    "per source line, most first")
    ap.add_argument("--ptx", default=None, help="write the kernel PTX to this path")
    ap.add_argument("--fp8", action="store_true", help="the fp8 recipe's kernel "
                    "(_attn_bwd_sm90_fp8_kernel; token-block operands of tools.fake_qkv)")
    ap.add_argument("--block-m", type=int, default=None, help="query rows per step")
    ap.add_argument("--path", type=int, default=None, help="with --lines: the path-th shortest "
                    "path through a step (0: plain, then the masked / diagonal variants)")
    args = ap.parse_args()
    for D in [int(x) for x in args.dims.split(",")]:
        cfg = sm90_backward_config(D)
        if args.fp8:
            cfg = Sm90BwdConfig(args.block_m) if args.block_m else sm90_backward_config(D)
            built = build_fp8(D, cfg)
            kern = built["_attn_bwd_sm90_fp8_kernel"]
        else:
            built = build(D, cfg)
            kern = built["_attn_bwd_sm90_kernel"]
        report(kern, f"D={D} m{cfg.block_m}n128", args.sass, args.lines, args.path)
        if args.ptx:
            with open(f"{args.ptx}.D{D}.ptx", "w") as f:
                f.write(kern.asm["ptx"])


if __name__ == "__main__":
    main()
