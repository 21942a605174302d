"""The `flamia` command: demo, bench, train-check, audit (also `python -m flamia`).

User errors on the command line (a bad flag value, a device this machine does not have, a
missing optional package) end as one line `flamia <command>: error: ...` naming the flag and
what is allowed, with exit status 2, as `flamia bench` does; a traceback means a bug. The
pieces: `UsageError`, `ArgumentParser` (argparse's own errors on one line), `handles_usage_errors`
(wraps a command's main), and the argparse types below.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import sys

COMMANDS = {
    "demo": "accuracy of every recipe vs float64, leakage audit, speed on CUDA",
    "bench": "benchmarks against the bf16 baselines (flamia.bench)",
    "train-check": "training validation on a small Llama-style model (flamia.train)",
    "audit": "leakage audit (P1 causal prefix, P2 document isolation) of flamia's recipes",
}

USAGE_EXIT = 2


class UsageError(Exception):
    """A user error on the command line: printed as one line naming the flag, exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, invalid value or choice) raise UsageError: one line
    instead of the usage block and the message."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def handles_usage_errors(prog: str):
    """Decorator for a command's main(argv) -> int: a UsageError becomes the line
    `<prog>: error: <message>` on stderr and exit status 2."""
    def wrap(fn):
        @functools.wraps(fn)
        def main(argv=None):
            try:
                return fn(argv)
            except UsageError as e:
                print(f"{prog}: error: {e}", file=sys.stderr)
                return USAGE_EXIT
        return main
    return wrap


# ----------------------------------------------------------------------------- argparse types

def device_type(value: str) -> str:
    """--device: 'auto', 'cpu', 'cuda' or 'cuda:N' that exists on this machine (the string,
    normalized: 'cuda:0' stays 'cuda:0')."""
    import torch

    value = value.strip().lower()
    if value == "auto":
        return value
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {value!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{value!r}: no CUDA device on this machine (torch.cuda.is_available() is False); "
                f"use --device cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise argparse.ArgumentTypeError(
                f"{value!r}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    return str(dev)


def resolve_device(value: "str | None") -> str:
    """'auto' or None -> 'cuda' when available, else 'cpu'; anything else as device_type left it."""
    if value in (None, "auto"):
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    return value


def int_at_least(lowest: int):
    """argparse type: an integer >= lowest."""
    what = f"an integer >= {lowest}"

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if n < lowest:
            raise argparse.ArgumentTypeError(f"must be {what}, got {n}")
        return n
    parse.__name__ = what
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def positive_float(text: str) -> float:
    import math
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return x


def require_module(module: str, what: str, extra: str) -> None:
    """UsageError when an optional dependency is missing (how to install it included)."""
    import importlib.util
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{what} needs the {module} package, not installed here: "
                         f"pip install -e \".[{extra}]\"")


# ----------------------------------------------------------------------------- commands

def _usage() -> str:
    lines = ["usage: flamia <command> [options]   (flamia <command> --help for its options)", "",
             "commands:"]
    lines += [f"  {name:12s} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


AUDIT_HELP = "a few seconds on a CPU with the defaults: 2.4 s for all eight recipes on 2 cores"


@handles_usage_errors("flamia audit")
def audit_main(argv=None) -> int:
    import torch

    from . import audit as _audit
    from .interface import backend
    from .recipes import RECIPES
    from .validate import SUPPORTED_HEAD_DIMS

    p = ArgumentParser(prog="flamia audit", description=f"{COMMANDS['audit']} ({AUDIT_HELP}).")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--layout", choices=("varlen", "dense"), default="varlen")
    p.add_argument("--lengths", nargs="+", type=nonnegative_int, default=None,
                   help=f"document lengths (default {' '.join(map(str, _audit.DEFAULT_DOC_LENGTHS))}; "
                        f"dense: equal lengths, one per batch row, default 160 160 160)")
    p.add_argument("--heads-q", type=positive_int, default=4)
    p.add_argument("--heads-kv", type=positive_int, default=2)
    p.add_argument("--head-dim", type=int, default=64, choices=SUPPORTED_HEAD_DIMS)
    p.add_argument("--device", type=device_type, default="auto",
                   help="auto, cpu, cuda or cuda:N (default auto: cuda when available, else cpu)")
    p.add_argument("--no-backward", action="store_true", help="forward checks only")
    p.add_argument("--family", choices=("mild", "outliers"), default="outliers",
                   help="input family (outliers: peaked attention, exposes shared scales best)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    lengths = args.lengths
    if lengths is not None:
        if args.layout == "dense" and len(set(lengths)) != 1:
            raise UsageError(f"--lengths: the dense layout needs equal lengths (one per batch row), "
                             f"got {' '.join(map(str, lengths))}")
        try:
            _audit.pick_t(lengths[:1] if args.layout == "dense" else lengths)
        except ValueError:
            raise UsageError(f"--lengths: needs a document of at least 3 tokens, got "
                             f"{' '.join(map(str, lengths))}") from None
    if args.heads_q % args.heads_kv:
        raise UsageError(f"--heads-kv must divide --heads-q (grouped-query attention), got "
                         f"--heads-q {args.heads_q} --heads-kv {args.heads_kv}")
    probe = torch.empty(1, 1, args.head_dim, device=device)
    for name in args.recipes:
        try:
            backend(probe, name)
        except ValueError as e:        # a head dim the kernels lack, on CUDA
            raise UsageError(f"--head-dim {args.head_dim}: {e}") from None
    unexpected = []
    for name in args.recipes:
        rep = _audit.audit(_audit.recipe_fn(name, layout=args.layout), layout=args.layout,
                           doc_lengths=lengths, heads_q=args.heads_q, heads_kv=args.heads_kv,
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
        return 0 if argv else USAGE_EXIT
    if argv[0] in ("-V", "--version"):
        from . import __version__
        print(f"flamia {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"flamia: error: unknown command {cmd!r}: use one of {', '.join(COMMANDS)} "
              f"(see flamia --help)", file=sys.stderr)
        return USAGE_EXIT
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
            return USAGE_EXIT
    # the commands catch their own UsageErrors (also when run as python -m flamia.<module>);
    # this catches any that escape a command without the decorator
    rc = handles_usage_errors(f"flamia {cmd}")(run)(rest)
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
