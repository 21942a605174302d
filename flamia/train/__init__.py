"""`flamia train-check`: does a Llama-style model pretrained with flamia attention match bf16?

A stock transformers LlamaForCausalLM (RMSNorm, RoPE, SwiGLU, GQA; ~23M parameters by default) is
trained from scratch on the Python standard library's source (byte-level, one file = one
document, split by file, packed with cu_seqlens so no token attends across documents), once per
attention: flamia `bf16`, `fp8`, the deliberately leaky `fp8_tensorwise` control,
and `bf16` with another init seed (run-to-run noise) -- same init seed and data order otherwise.
Every run's validation loss is measured with its own attention and with exact bf16 attention
(torch varlen / SDPA): a model that learned to exploit leakage does better with its own.

    python -m flamia.train --tiny                      # CPU smoke test (~10 s)
    python -m flamia.train --out results/train_check   # the GPU check (~23M params, 4 runs)

Writes train_check.json (settings, environment, curves, verdict), train_check.md (verdict
table) and train_check.png (loss curves; needs matplotlib, in the test and train extras) under
--out (default out/train_check, which git ignores). Exit status 0 when
every non-leaky run passes (always 0 for --tiny, whose numbers mean nothing), 1 otherwise, 2
for a user error on the command line (flamia.cli).
"""
from __future__ import annotations

import argparse
import sys

from ..cli import (ArgumentParser, UsageError, device_type, handles_usage_errors, int_at_least,
                   nonnegative_int, positive_float, positive_int, require_module, resolve_device)

DEFAULT_RUNS = "bf16,fp8,bf16_seed1,fp8_tensorwise"   # the slow control last
TINY_RUNS = "bf16,fp8,fp8_tensorwise"
DEFAULT_OUT = "out/train_check"
TINY_TIME = "~10 s on a 2-core CPU"     # measured, imports included

__all__ = ["main", "build_parser", "config_from_args", "DEFAULT_RUNS"]


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="flamia train-check",
        description="Pretrain a small Llama on the Python stdlib with each attention recipe and "
                    "compare the losses (identical init seed and data order).")
    p.add_argument("--tiny", action="store_true",
                   help=f"CPU smoke test, {TINY_TIME}: tiny model, few steps, 3 runs (defaults "
                        f"below change)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps per run (300; tiny 8)")
    p.add_argument("--tokens-per-step", type=positive_int, default=None,
                   help="packed tokens per step (32768; tiny 512)")
    p.add_argument("--max-doc-len", type=int_at_least(2), default=None,
                   help="longer files are cut into documents of at most this many tokens (2048; tiny 128)")
    p.add_argument("--runs", default=None,
                   help=f"comma list of runs: a recipe name, 'torch' (torch's exact bf16 varlen "
                        f"attention), 'cudnn' (cuDNN bf16 ragged attention; CUDA), optional "
                        f"_seed<N> suffix (default {DEFAULT_RUNS}; tiny {TINY_RUNS})")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--device", type=device_type, default="auto", help="auto | cuda | cuda:N | cpu")
    p.add_argument("--lr", type=positive_float, default=None, help="peak learning rate (2e-3)")
    p.add_argument("--warmup", type=int, default=-1, help="warmup steps (default 10 %% of steps)")
    p.add_argument("--eval-every", type=int, default=-1, help="steps between evaluations (steps/5)")
    p.add_argument("--leaky-steps", type=positive_int, default=None,
                   help="stop leaky controls (fp8_tensorwise) after N steps, same LR schedule; every "
                        "run also evaluates at step N for the comparison. The control runs on "
                        "flamia's reference emulation (no kernel), far slower on a GPU (default: all)")
    p.add_argument("--time-limit", type=positive_float, default=None,
                   help="seconds for the whole check: a run still going then stops (status timeout), "
                        "later runs are skipped, the report is written (results are also written "
                        "after every run)")
    p.add_argument("--val-batches", type=positive_int, default=None, help="validation batches (8; tiny 2)")
    p.add_argument("--log-every", type=positive_int, default=None, help="progress line every N steps (10; tiny 1)")
    p.add_argument("--seed", type=int, default=0, help="init seed of the runs (plus any _seed<N>)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the data order")
    p.add_argument("--exact", default="torch", choices=("torch", "flamia:bf16"),
                   help="exact attention for the second evaluation (torch varlen/SDPA, or flamia bf16)")
    p.add_argument("--max-files", type=positive_int, default=None,
                   help="use only the first N stdlib files (sorted) before the split (tiny: 400)")
    p.add_argument("--stdlib", default=None, help="source tree to train on (default: this Python's stdlib)")
    p.add_argument("--model", default=None, choices=("small", "tiny"),
                   help="model preset (small ~23M params; tiny with --tiny)")
    for name, help_ in (("hidden", "hidden size"), ("layers", "decoder layers"), ("heads", "query heads"),
                        ("kv-heads", "key/value heads"), ("intermediate", "SwiGLU intermediate size")):
        p.add_argument(f"--{name}", type=positive_int, default=None,
                       help=f"override the preset's {help_}")
    p.add_argument("--head-dim", type=int, choices=(64, 128), default=None,
                   help="override the preset's head dim (64 or 128)")
    p.add_argument("--time-rounds", type=nonnegative_int, default=None,
                   help="after the runs, time the training step of every non-leaky run's attention "
                        "interleaved on one model, this many rounds (5; tiny 1; 0: off)")
    p.add_argument("--time-steps", type=positive_int, default=None,
                   help="batches per attention and round of that timing (8; tiny 2)")
    p.add_argument("--no-amp", action="store_true", help="fp32 without bf16 autocast")
    return p


def config_from_args(args):
    from dataclasses import replace

    from .loop import TrainConfig
    from .model import PRESETS

    tiny = args.tiny
    size = PRESETS[args.model or ("tiny" if tiny else "small")]
    overrides = {k: getattr(args, k.replace("-", "_")) for k in
                 ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate")
                 if getattr(args, k.replace("-", "_")) is not None}
    size = replace(size, **overrides)

    def pick(value, full, small):
        return value if value is not None else (small if tiny else full)

    return TrainConfig(
        steps=pick(args.steps, 300, 8),
        tokens_per_step=pick(args.tokens_per_step, 32768, 512),
        max_doc_len=pick(args.max_doc_len, 2048, 128),
        lr=pick(args.lr, 2e-3, 2e-3),
        warmup=args.warmup,
        eval_every=args.eval_every if args.eval_every > 0 else (4 if tiny else -1),
        leaky_steps=args.leaky_steps,
        time_limit=args.time_limit,
        val_batches=pick(args.val_batches, 8, 2),
        log_every=pick(args.log_every, 10, 1),
        timing_skip=2 if tiny else 5,
        time_rounds=pick(args.time_rounds, 5, 1),
        time_steps=pick(args.time_steps, 8, 2),
        data_seed=args.data_seed,
        init_seed=args.seed,
        exact=args.exact,
        amp=not args.no_amp,
        device=args.device,
        max_files=pick(args.max_files, None, 400),
        stdlib=args.stdlib,
        model=size,
    )


def check_args(args, cfg, runs) -> None:
    """UsageError for settings that cannot run here, before any data is read or model built."""
    import torch

    from .loop import check_runs_can_run

    m = cfg.model
    if m.heads % m.kv_heads:
        raise UsageError(f"--kv-heads must divide --heads (grouped-query attention), got "
                         f"{m.heads} query and {m.kv_heads} key/value heads")
    try:
        check_runs_can_run(runs, torch.device(resolve_device(cfg.device)))
    except ValueError as e:
        raise UsageError(f"--runs: {e}") from None
    if args.stdlib is not None:
        from pathlib import Path
        if not Path(args.stdlib).is_dir():
            raise UsageError(f"--stdlib: {args.stdlib!r} is not a directory")


@handles_usage_errors("flamia train-check")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    require_module("transformers", "flamia train-check", "train")
    from . import report
    from .data import DataError
    from .loop import parse_runs, run_check

    cfg = config_from_args(args)
    try:
        runs = parse_runs(args.runs or (TINY_RUNS if args.tiny else DEFAULT_RUNS))
    except ValueError as e:
        raise UsageError(f"--runs: {e}") from None
    check_args(args, cfg, runs)

    def log(msg):
        print(msg, flush=True)

    def partial(res):
        res["tiny"] = bool(args.tiny)
        report.write(res, args.out, log=lambda _msg: None)

    try:
        results = run_check(cfg, runs, log=log, on_progress=partial)
    except DataError as e:      # the corpus the flags select cannot fill the steps
        raise UsageError(f"{e} (the corpus is what --stdlib and --max-files select; a step takes "
                         f"--tokens-per-step tokens)") from None
    results["tiny"] = bool(args.tiny)
    v = report.write(results, args.out, log=log)
    log(f"total {results['total_wall_s']:.0f}s")
    if args.tiny:
        return 0
    return 0 if v["pass"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
