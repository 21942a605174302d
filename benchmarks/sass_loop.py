"""SASS of a forward kernel's main loop, counted by opcode, on a CPU-only machine.

    python benchmarks/sass_loop.py                          # the Triton forward, fp8, D=128
    python benchmarks/sass_loop.py --D 64                   # the Triton forward at D=64
    python benchmarks/sass_loop.py --kernel fwd_gluon       # the persistent Gluon forward
    python benchmarks/sass_loop.py --recipe bf16            # the Triton forward of bf16
    python benchmarks/sass_loop.py --set num_stages=2       # a config field changed
    python benchmarks/sass_loop.py --dump /tmp/k.sass       # the whole SASS as well
    python benchmarks/sass_loop.py --common                 # histogram of the common path
    python benchmarks/sass_loop.py --lines                  # the common path per source line
    python benchmarks/sass_loop.py --kernel fwd_gluon --module /tmp/copy.py
                                                            # a copy of forward_gluon.py instead

Compiles for sm_90a with the bundled ptxas (benchmarks/tools/compile.py: nothing runs),
disassembles with the bundled cuobjdump, and takes the main loop (tools.sass.main_loop: the
innermost loop that issues wgmmas, the forward's unmasked-tile loop). Prints the total, the
loop's length and its "common path" (minus what a forward branch inside it can skip: what every
tile issues, the count benchmarks/NOTES.md quotes), the opcode histogram (largest first) and the
local-memory (spill) operations. --kernel fwd is the Triton forward (FwdConfig, V^T in wgmma key
order), fwd_gluon the persistent Gluon forward (PersistentFwdConfig; fp8 only). The one-pass
Hopper backward has its own compile-only script: benchmarks/bwd_sm90_compile.py.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.pop("TRITON_INTERPRET", None)     # compile for sm_90a, not the interpreter

import torch  # noqa: E402

from benchmarks.tools import compile as tools  # noqa: E402
from benchmarks.tools.sass import (  # noqa: E402
    by_source_line, common_path, describe_paths, local_memory_ops, main_loop, parse, sass_of,
)


def with_sets(cfg, sets: list[str]):
    """cfg with the --set field=value overrides (values as Python literals, cast to the field's
    type where it has one: a field that defaults to None takes the literal as it is)."""
    for item in sets:
        key, val = item.split("=")
        cur, new = getattr(cfg, key), eval(val)
        cfg = dataclasses.replace(cfg, **{key: new if cur is None else type(cur)(new)})
    return cfg


def build_forward(recipe: str, D: int, causal: bool, sets: list[str]):
    """The Triton forward (_attn_fwd_kernel) as attention_forward launches it on the H200."""
    from flamia.ops.config import triton_forward_config
    from flamia.ops.forward import attention_forward
    cfg = with_sets(triton_forward_config(D, recipe != "bf16", torch.device("cuda")), sets)
    qkv = tools.fake_qkv(2048, 8, 2, D, recipe)
    built = tools.build(attention_forward, qkv, tools.cu_seqlens([1024, 1024]), 1024, causal,
                        None, torch.bfloat16, config=cfg)
    return built["_attn_fwd_kernel"], cfg


def build_forward_gluon(recipe: str, D: int, causal: bool, sets: list[str], module=None):
    """The persistent Gluon forward as attention_forward launches it on the H200 (D=128); module:
    a copy of forward_gluon.py to build in its place (e.g. a spike in benchmarks/)."""
    import flamia.ops
    from flamia.ops.config import PersistentFwdConfig
    from flamia.ops.forward import attention_forward
    if module:
        from benchmarks.bwd_sm90_dev import load_ab_base
        mod = load_ab_base(module, "sass_loop_module")
        sys.modules["flamia.ops.forward_gluon"] = mod
        flamia.ops.forward_gluon = mod
    cfg = with_sets(PersistentFwdConfig(), sets)
    built = tools.build(attention_forward, tools.fake_qkv(2048, 8, 2, D, recipe),
                        tools.cu_seqlens([1024, 1024]), 1024, causal, None, torch.bfloat16,
                        config=cfg)
    return built["_attn_fwd_gluon_persistent_kernel"], cfg


def build(kernel: str, recipe: str, D: int, causal: bool, sets: list[str], module=None):
    if kernel == "fwd":
        return build_forward(recipe, D, causal, sets)
    return build_forward_gluon(recipe, D, causal, sets, module)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=("fwd", "fwd_gluon"), default="fwd",
                    help="fwd: the Triton forward; fwd_gluon: the persistent Gluon forward")
    ap.add_argument("--recipe", choices=("fp8", "bf16"), default="fp8",
                    help="bf16: --kernel fwd only")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="config field=value (repeatable)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--common", action="store_true", help="histogram of the common path only")
    ap.add_argument("--dump", default=None, help="write the whole SASS here")
    ap.add_argument("--ptx", default=None, help="write the PTX here")
    ap.add_argument("--module", default=None, help="--kernel fwd_gluon: build this copy of "
                    "forward_gluon.py instead")
    ap.add_argument("--lines", action="store_true",
                    help="the common path's instructions per source line (nvdisasm -g)")
    args = ap.parse_args()
    if args.kernel == "fwd_gluon" and args.recipe != "fp8":
        ap.error("--kernel fwd_gluon runs the fp8 recipe only")
    if args.module and args.kernel != "fwd_gluon":
        ap.error("--module replaces forward_gluon.py: --kernel fwd_gluon only")
    kern, cfg = build(args.kernel, args.recipe, args.D, not args.no_causal, args.set, args.module)
    if args.ptx:
        with open(args.ptx, "w") as f:
            f.write(kern.asm["ptx"])
    sass = sass_of(kern)
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(sass)
    usage = tools.resource_usage(kern)
    instrs = parse(sass)
    loop = main_loop(instrs)
    common = common_path(loop)
    hist = collections.Counter(op.split(".")[0] for _, op, _ in (common if args.common else loop))
    local = local_memory_ops(loop)
    print(f"{args.kernel} {args.recipe} D={args.D} causal={not args.no_causal} {cfg}")
    print(f"kernel {len(instrs)} SASS instructions; main loop {len(loop)} "
          f"(local memory ops {local}); regs/spills {usage['regs']}/{usage['spill_stores']} B")
    print(f"common path (every tile, branches skipped): {len(common)} "
          f"(local memory ops {local_memory_ops(common)})")
    print("one tile issues, by the branches it takes (the shortest: unmasked, no edge):")
    print(describe_paths(sass))
    for op, n in hist.most_common(args.top):
        print(f"  {op:10s} {n:5d}")
    if args.lines:
        print("common path per source line (largest first):")
        rows = sorted(by_source_line(kern, common).items(), key=lambda kv: -sum(kv[1].values()))
        for where, ops in rows[:args.top]:
            print(f"  {sum(ops.values()):5d}  {where:32s} {dict(ops.most_common(6))}")


if __name__ == "__main__":
    main()
