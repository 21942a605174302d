"""The `flamia` command: demo, bench, train-check, audit (also `python -m flamia`)."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": "accuracy of every recipe vs float64, leakage audit, speed on CUDA",
    "bench": "benchmarks against the bf16 baselines (flamia.bench)",
    "train-check": "training validation on a small Llama-style model (flamia.train)",
    "audit": "leakage audit (P1 causal prefix, P2 document isolation) of flamia's recipes",
}


def _usage() -> str:
    lines = ["usage: flamia <command> [options]   (flamia <command> --help for its options)", "",
             "commands:"]
    lines += [f"  {name:12s} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def audit_main(argv=None) -> int:
    import torch

    from . import audit as _audit
    from .recipes import RECIPES

    p = argparse.ArgumentParser(prog="flamia audit", description=COMMANDS["audit"])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--layout", choices=("varlen", "dense"), default="varlen")
    p.add_argument("--lengths", nargs="+", type=int, default=None,
                   help="document lengths (dense: equal lengths, one per batch row)")
    p.add_argument("--heads-q", type=int, default=4)
    p.add_argument("--heads-kv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--no-backward", action="store_true", help="forward checks only")
    p.add_argument("--family", choices=("mild", "outliers"), default="outliers",
                   help="input family (outliers: peaked attention, exposes shared scales best)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    unexpected = []
    for name in args.recipes:
        rep = _audit.audit(_audit.recipe_fn(name, layout=args.layout), layout=args.layout,
                           doc_lengths=args.lengths, heads_q=args.heads_q, heads_kv=args.heads_kv,
                           head_dim=args.head_dim, device=device, backward=not args.no_backward,
                           seed=args.seed, family=args.family)
        leaky = RECIPES[name].leaky
        print(rep)
        print("  -> " + ("expected: the leaky control must be caught" if leaky else "expected: PASS")
              + ("" if rep.passed != leaky else "   UNEXPECTED") + "\n", flush=True)
        if rep.passed == leaky:
            unexpected.append(name)
    print("all verdicts as expected" if not unexpected else f"UNEXPECTED verdicts for {unexpected}")
    return 1 if unexpected else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__
        print(f"flamia {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"flamia: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if cmd == "audit":
        run = audit_main
    else:   # imported lazily: each command loads only what it needs
        module = {"demo": "flamia.demo", "bench": "flamia.bench", "train-check": "flamia.train"}[cmd]
        try:
            run = importlib.import_module(module).main
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            print(f"flamia {cmd}: {module} is not part of this installation yet", file=sys.stderr)
            return 2
    rc = run(rest)
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
