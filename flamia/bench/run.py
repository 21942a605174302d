"""`flamia bench` / `python -m flamia.bench`: measure flamia against the bf16 baselines.

See benchmarks/README.md for what is measured and how.
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from . import report
from .baselines import (
    BASELINE_HELP, BASELINE_KEYS, Impl, Problem, make_impls, make_inputs, parse_baselines,
)
from .common import Skip, short_error
from .timing import TimingSettings, cuda_time, l2_bytes, n_copies_for, peak_memory
from .workloads import (
    Workload, WorkloadError, accuracy_slice, load_workloads, select, workload_flops,
    workload_from_flags,
)

DEFAULT_RECIPES = "fp8,bf16"
DEFAULT_OUT = "benchmarks/results"
FULL = TimingSettings(warmup=3, reps=50, min_reps=5, target_s=1.0)
QUICK = TimingSettings(warmup=2, reps=10, min_reps=3, target_s=0.25)
DEVICE = "cuda"   # tests point this at "cpu" to exercise the orchestration without a GPU
NEEDS_GPU = ("flamia bench: needs a CUDA GPU (torch.cuda.is_available() is False on this "
             "machine). Use --dry-run to validate the workloads and list what would run.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flamia bench",
        description="Benchmark flamia attention (forward and forward+backward, bf16 in/out, "
                    "everything included) against the fastest bf16 baselines on packed-document "
                    "causal workloads, measured in the same process.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="baselines: " + "; ".join(f"{k}: {v}" for k, v in BASELINE_HELP.items()))
    g = p.add_argument_group("workloads")
    g.add_argument("--workloads", metavar="PATH",
                   help="workloads JSON file (default: the packaged flamia/data/workloads.json)")
    g.add_argument("--docs", metavar="SPEC",
                   help="one workload from flags instead: '2048x16' (16 docs of 2048 tokens) or "
                        "'8192,4096,17' (explicit lengths); mixes like '8192x2,512' work")
    g.add_argument("--heads", metavar="HQ/HKV", help="with --docs: head counts (default 32/8)")
    g.add_argument("--head-dim", type=int, metavar="D", help="with --docs: head dim (default 128)")
    g.add_argument("--name", help="with --docs: the workload's name")
    g.add_argument("--only", metavar="NAME[,NAME]", help="run only these workloads")
    g = p.add_argument_group("implementations")
    g.add_argument("--recipes", default=DEFAULT_RECIPES,
                   help=f"flamia recipes to measure (default {DEFAULT_RECIPES}; 'none' for none)")
    g.add_argument("--baselines", default="all",
                   help=f"comma list of {', '.join(BASELINE_KEYS)}, or all (default) / none")
    g = p.add_argument_group("measurement")
    g.add_argument("--reps", type=int, help=f"most timed reps per measurement (default {FULL.reps}; "
                                            f"--quick {QUICK.reps})")
    g.add_argument("--warmup", type=int, help=f"warm-up calls (default {FULL.warmup}; --quick "
                                              f"{QUICK.warmup})")
    g.add_argument("--target-time", type=float, metavar="S",
                   help=f"aim for ~S seconds of GPU time per measurement (default {FULL.target_s};"
                        f" --quick {QUICK.target_s})")
    g.add_argument("--quick", action="store_true", help="fewer reps: a fast, noisier pass")
    g.add_argument("--no-accuracy", action="store_true", help="skip the accuracy columns")
    g.add_argument("--accuracy-tokens", type=int, default=2048, metavar="N",
                   help="accuracy on the leading documents up to N tokens (default 2048)")
    g.add_argument("--accuracy-heads", type=int, default=4, metavar="HQ",
                   help="accuracy with at most HQ query heads, GQA ratio kept (default 4)")
    g.add_argument("--families", default="mild,outliers",
                   help="input families for accuracy (default mild,outliers)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("output")
    g.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"directory for bench-<date>-<commit>.json/.md/.png (default {DEFAULT_OUT})")
    g.add_argument("--no-chart", action="store_true", help="do not write the PNG chart")
    g.add_argument("--max-minutes", type=float, metavar="M",
                   help="start no new workload after M minutes (the rest is listed as not run); "
                        "results are written after every workload either way")
    g.add_argument("--dry-run", action="store_true",
                   help="validate the workloads and list what would run (no GPU needed)")
    return p


# ---------------------------------------------------------------------------------------------
# configuration


@dataclass
class Config:
    workloads: list
    source: str
    recipes: list
    baselines: list
    settings: TimingSettings
    accuracy: bool
    families: list
    accuracy_tokens: int
    accuracy_heads: int
    seed: int
    out: str
    chart: bool
    quick: bool
    max_minutes: float | None = None


def resolve(args) -> Config:
    """Validate the arguments; raises WorkloadError / ValueError with a clear message."""
    if args.docs is not None:
        if args.workloads:
            raise WorkloadError("give either --workloads or --docs, not both")
        w = workload_from_flags(args.docs, args.heads or "32/8",
                                128 if args.head_dim is None else args.head_dim, args.name)
        workloads, source = [w], "flags"
    else:
        for flag, val in (("--heads", args.heads), ("--head-dim", args.head_dim),
                          ("--name", args.name)):
            if val is not None:
                raise WorkloadError(f"{flag} only applies with --docs (a workload from flags)")
        workloads, source = load_workloads(args.workloads)
    workloads = select(workloads, args.only)

    from flamia.ops import KERNEL_RECIPES
    from flamia.recipes import RECIPES

    recipes = []
    spec = (args.recipes or "").strip()
    if spec.lower() not in ("", "none"):
        for r in spec.split(","):
            r = r.strip()
            if not r:
                continue
            if r not in RECIPES:
                raise ValueError(f"--recipes: unknown recipe {r!r}; flamia recipes: "
                                 f"{', '.join(sorted(RECIPES))}")
            if r not in KERNEL_RECIPES:
                raise ValueError(f"--recipes: {r!r} has no GPU kernels (reference numerics only); "
                                 f"benchmarkable recipes: {', '.join(KERNEL_RECIPES)}")
            if r not in recipes:
                recipes.append(r)
    baselines = parse_baselines(args.baselines)
    base = QUICK if args.quick else FULL
    settings = TimingSettings(
        warmup=base.warmup if args.warmup is None else args.warmup,
        reps=base.reps if args.reps is None else args.reps,
        min_reps=base.min_reps, target_s=base.target_s if args.target_time is None else args.target_time)
    if settings.reps < 1 or settings.warmup < 0 or settings.target_s <= 0:
        raise ValueError("--reps must be >= 1, --warmup >= 0, --target-time > 0")
    settings.min_reps = min(settings.min_reps, settings.reps)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    from flamia.inputs import FAMILIES
    for f in families:
        if f not in FAMILIES:
            raise ValueError(f"--families: unknown family {f!r}; choose from {', '.join(FAMILIES)}")
    if args.accuracy_tokens < 1 or args.accuracy_heads < 1:
        raise ValueError("--accuracy-tokens and --accuracy-heads must be positive")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise ValueError("--max-minutes must be positive")
    return Config(workloads, source, recipes, baselines, settings, not args.no_accuracy, families,
                  args.accuracy_tokens, args.accuracy_heads, args.seed, args.out,
                  not args.no_chart, args.quick, args.max_minutes)


def problem_of(w: Workload) -> Problem:
    return w.problem()


# ---------------------------------------------------------------------------------------------
# dry run


def dry_run_text(cfg: Config, impls: list) -> str:
    lines = [f"flamia bench --dry-run: {len(cfg.workloads)} workload(s) from {cfg.source} (valid)", ""]
    rows = []
    for w in cfg.workloads:
        fl = workload_flops(w)
        rows.append([w.name, f"{w.heads_q}/{w.heads_kv}", w.head_dim, w.n_docs, w.total_tokens,
                     w.max_len, f"{fl['fwd'] / 1e12:.2f}", f"{fl['fwdbwd'] / 1e12:.2f}",
                     w.docs_str()])
    lines.append(report.text_table(["workload", "Hq/Hkv", "D", "docs", "tokens", "max doc",
                                    "fwd TFLOP", "f+b TFLOP", "lengths"], rows,
                                   "lrrrrrrrl"))
    lines.append("")
    lines.append(f"implementations ({len(impls)}): " + ", ".join(
        f"{i.label} [{'flamia' if i.kind == 'flamia' else i.kind + ' baseline'}]" for i in impls))
    lines.append("")
    lines.append("per workload (knowable from the shapes):")
    for w in cfg.workloads:
        p = problem_of(w)
        runs, skips = [], {}
        for i in impls:
            r = i.static_skip(p)
            if r:
                skips.setdefault(r, []).append(i.label)
            else:
                runs.append(i.label)
        lines.append(f"  {w.name}: runs {', '.join(runs) or '(nothing)'}")
        for r, labels in skips.items():
            lines.append(f"  {' ' * len(w.name)}  would skip {', '.join(labels)}: {r}")
    lines.append("")
    lines.append("environment here (re-checked at run time on the GPU machine):")
    for i in impls:
        try:
            r = i.env_skip()
        except Exception as e:  # pragma: no cover
            r = short_error(e)
        lines.append(f"  {i.label}: {'would skip: ' + r if r else 'available'}")
    try:
        import torch
        if not torch.cuda.is_available():
            lines.append("  (no CUDA GPU here: a real run would exit with an error)")
    except Exception:
        pass
    s = cfg.settings
    lines.append("")
    lines.append(f"timing: CUDA events, median of {s.min_reps}..{s.reps} reps (~{s.target_s} s per "
                 f"measurement), {s.warmup} warm-up calls{' [--quick]' if cfg.quick else ''}")
    if cfg.accuracy:
        sl = [f"{w.name}: {accuracy_slice(w, cfg.accuracy_tokens, cfg.accuracy_heads).describe()}"
              for w in cfg.workloads]
        lines.append(f"accuracy: rel. error of O, dQ, dK, dV vs float64 on families "
                     f"{', '.join(cfg.families)}:")
        lines += ["  " + x for x in sl]
    else:
        lines.append("accuracy: off (--no-accuracy)")
    lines.append(f"output: {cfg.out}/bench-<date>-<commit>.json, .md" +
                 ("" if not cfg.chart else ", .png"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# environment


def _run(cmd: list, timeout: float = 10.0) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return r.stdout.strip() if r.returncode == 0 else None
    except Exception:
        return None


def git_info() -> dict:
    root = Path(__file__).resolve().parents[2]
    commit = os.environ.get("FLAMIA_GIT_COMMIT") or _run(["git", "-C", str(root), "rev-parse", "HEAD"])
    info = {"commit": commit, "short": commit[:8] if commit else None, "dirty": None,
            "source": "env FLAMIA_GIT_COMMIT" if os.environ.get("FLAMIA_GIT_COMMIT") else "git"}
    if os.environ.get("FLAMIA_GIT_DIRTY") is not None:
        info["dirty"] = os.environ["FLAMIA_GIT_DIRTY"] not in ("0", "", "false")
    elif commit:
        st = _run(["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain",
                   "--untracked-files=no"])
        info["dirty"] = None if st is None else bool(st)
    return info


def collect_env() -> dict:
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    try:
        env["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        env["cudnn"] = None
    try:
        from importlib.metadata import version
        env["flamia"] = version("flamia")
    except Exception:
        env["flamia"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["sm_count"] = props.multi_processor_count
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
        env["l2_bytes"] = l2_bytes()
    drv = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    env["driver"] = drv.splitlines()[0].strip() if drv else None
    from .baselines import fa4_version
    env["flash_attn_4"] = fa4_version()
    try:  # the CuTe DSL that compiles FA4's kernels
        from importlib.metadata import version
        env["nvidia_cutlass_dsl"] = version("nvidia-cutlass-dsl") if env["flash_attn_4"] else None
    except Exception:
        env["nvidia_cutlass_dsl"] = None
    from .cudnn_graphs import versions
    v = versions()
    env["cudnn_frontend"] = v.get("cudnn_frontend")
    env["cudnn_frontend_backend"] = v.get("cudnn_backend_version_string") or v.get(
        "cudnn_backend_version")
    env["git"] = git_info()
    return env


# ---------------------------------------------------------------------------------------------
# progress


class Progress:
    """One transient status line on a terminal (stderr); permanent lines otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._len = 0
        self.t0 = time.perf_counter()

    def _clear(self):
        if self.tty and self._len:
            self.stream.write("\r" + " " * self._len + "\r")
            self._len = 0

    def update(self, msg: str):
        if not self.tty:
            return
        msg = f"[{time.perf_counter() - self.t0:6.0f}s] {msg}"
        try:
            cols = os.get_terminal_size(self.stream.fileno()).columns
        except Exception:
            cols = 120
        msg = msg[: max(20, cols - 1)]
        self._clear()
        self.stream.write(msg)
        self.stream.flush()
        self._len = len(msg)

    def log(self, msg: str):
        self._clear()
        self.stream.write(f"[{time.perf_counter() - self.t0:6.0f}s] {msg}\n")
        self.stream.flush()

    def done(self):
        self._clear()
        self.stream.flush()


# ---------------------------------------------------------------------------------------------
# measuring


class Accuracy:
    """float64 references on a slice of a workload, one per input family (computed once)."""

    def __init__(self, w: Workload, cfg: Config):
        self.slice = accuracy_slice(w, cfg.accuracy_tokens, cfg.accuracy_heads)
        s = self.slice
        self.problem = s.problem()
        self.seed = cfg.seed
        self._data = {}

    def data(self, family: str):
        if family not in self._data:
            import torch
            from flamia.inputs import make_qkv
            from flamia.reference import attention_exact

            p = self.problem
            q, k, v, cu = make_qkv(p.doc_lengths, p.heads_q, p.heads_kv, p.head_dim, family=family,
                                   dtype=torch.bfloat16, device=DEVICE, seed=self.seed)
            gen = torch.Generator().manual_seed(self.seed + 1)
            dout = torch.randn(p.T, p.heads_q, p.head_dim, generator=gen).to(DEVICE, torch.bfloat16)
            q64, k64, v64 = (x.double().requires_grad_(True) for x in (q, k, v))
            o64 = attention_exact(q64, k64, v64, cu, causal=True)
            o64.backward(dout.double())
            ref = (o64.detach(), q64.grad, k64.grad, v64.grad)
            self._data[family] = (make_inputs(p, device=DEVICE, q=q, k=k, v=v, dout=dout), ref)
        return self._data[family]

    def measure(self, impl: Impl, family: str) -> dict:
        from flamia.inputs import rel_err

        inputs, ref = self.data(family)
        why = impl.static_skip(self.problem)
        if why:
            raise Skip(why)
        bound = impl.build(self.problem, inputs, 1)
        try:
            outs = bound.outputs()
            return {k: rel_err(x, r) for k, x, r in zip(report.ERR_KEYS, outs, ref)}
        finally:
            bound.close()


def _free():
    import torch
    gc.collect()
    torch.cuda.empty_cache()


def _error(e: BaseException) -> str:
    return short_error(e, 400)


def measure_impl(impl: Impl, w: Workload, inputs, n_copies: int, cfg: Config, acc, progress,
                 tag: str) -> dict:
    import torch

    row = report.new_row(impl.key, impl.label, impl.kind, impl.recipe, impl.static_notes)
    p = problem_of(w)
    reason = impl.env_skip() or impl.static_skip(p)
    if reason:
        row.update(status="skipped", reason=reason)
        return row
    bound = None
    try:
        progress.update(f"{tag}: build")
        bound = impl.build(p, inputs, n_copies)
        row["notes"] += [n for n in bound.notes if n not in row["notes"]]
    except Skip as e:
        row.update(status="skipped", reason=str(e))
        return row
    except Exception as e:
        row["errors"]["build"] = _error(e)
        row["traceback"] = traceback.format_exc(limit=8)
        row["status"] = "error"
        _free()
        return row
    for metric, fn in (("fwd", bound.fwd), ("fwdbwd", bound.fwdbwd)):
        try:
            progress.update(f"{tag}: {report.METRIC_LABEL[metric]}")
            t = cuda_time(fn, bound.n_copies, cfg.settings)
            row[f"{metric}_ms"], row[f"{metric}_min_ms"], row[f"{metric}_reps"] = \
                t.median_ms, t.min_ms, t.reps
        except Exception as e:
            row["errors"][metric] = _error(e)
            row.setdefault("traceback", traceback.format_exc(limit=8))
            if isinstance(e, torch.cuda.OutOfMemoryError):
                _free()
    if row["fwdbwd_ms"] is not None:
        try:
            progress.update(f"{tag}: peak memory")
            row["peak_mem_bytes"] = peak_memory(functools.partial(bound.fwdbwd, 0))
        except Exception as e:
            row["errors"]["memory"] = _error(e)
    row["n_copies"] = bound.n_copies
    try:
        bound.close()
    except Exception:
        pass
    bound = None
    _free()
    if acc is not None:
        for fam in cfg.families:
            try:
                progress.update(f"{tag}: accuracy ({fam})")
                row["accuracy"][fam] = acc.measure(impl, fam)
            except Skip as e:
                row["accuracy"][fam] = {"error": f"skipped: {e}"}
            except Exception as e:
                row["accuracy"][fam] = {"error": _error(e)}
                _free()
    timed = row["fwd_ms"] is not None and row["fwdbwd_ms"] is not None
    row["status"] = "ok" if timed and not row["errors"] else "partial" if (
        row["fwd_ms"] is not None or row["fwdbwd_ms"] is not None) else "error"
    return row


def _row_line(row: dict) -> str:
    if row["status"] == "skipped":
        return f"skipped: {row['reason']}"
    parts = [f"fwd {report.fmt_ms(row['fwd_ms'])} ms", f"fwd+bwd {report.fmt_ms(row['fwdbwd_ms'])} ms",
             f"mem {report.fmt_gib(row['peak_mem_bytes'])} GiB"]
    for fam, a in row.get("accuracy", {}).items():
        parts.append(f"{fam} " + ("err" if "error" in a else
                                  "/".join(report.fmt_err(a.get(k)) for k in report.ERR_KEYS)))
    if row["errors"]:
        parts.append("ERRORS: " + "; ".join(f"{k}: {v}" for k, v in row["errors"].items()))
    return ", ".join(parts)


def run_workload(w: Workload, impls: list, cfg: Config, progress: Progress, wi: int, nw: int) -> dict:
    t0 = time.perf_counter()
    p = problem_of(w)
    flops = workload_flops(w)
    wdict = dict(w.to_dict(), n_docs=w.n_docs, max_len=w.max_len, docs_str=w.docs_str(),
                 flops_fwd=flops["fwd"], flops_fwdbwd=flops["fwdbwd"])
    wres = {"workload": wdict, "rows": []}
    progress.log(f"workload {wi}/{nw}: {w.name} ({w.n_docs} docs, T={w.total_tokens}, "
                 f"{w.shape_str()})")
    try:
        inputs = make_inputs(p, seed=cfg.seed, device=DEVICE)
    except Exception as e:
        wres["error"] = f"cannot create inputs: {_error(e)}"
        progress.log(f"  {wres['error']}")
        return wres
    n_copies = n_copies_for(inputs.nbytes(), l2_bytes())
    wres["n_copies"] = n_copies
    acc = None
    if cfg.accuracy:
        acc = Accuracy(w, cfg)
        wres["accuracy_slice"] = acc.slice.describe()
    for ii, impl in enumerate(impls):
        tag = f"[{wi}/{nw} {w.name} {ii + 1}/{len(impls)}] {impl.label}"
        try:
            row = measure_impl(impl, w, inputs, n_copies, cfg, acc, progress, tag)
        except Exception as e:  # never let one implementation end the run
            row = report.new_row(impl.key, impl.label, impl.kind, impl.recipe)
            row.update(status="error")
            row["errors"]["run"] = _error(e)
            row["traceback"] = traceback.format_exc(limit=8)
            _free()
        wres["rows"].append(row)
        progress.log(f"  {impl.label}: {_row_line(row)}")
    del inputs, acc
    _free()
    report.add_tflops(wres["rows"], flops)
    wres["fastest_bf16"] = report.compute_speedups(wres["rows"])
    wres["wall_s"] = round(time.perf_counter() - t0, 1)
    return wres


def run(cfg: Config, impls: list, argv: list) -> tuple[dict, dict]:
    progress = Progress()
    now = datetime.now(timezone.utc)
    env = collect_env()
    git = env.get("git") or {}
    results = {"schema": report.SCHEMA, "timestamp": now.isoformat(timespec="seconds"),
               "argv": list(argv), "env": env, "settings": dict(cfg.settings.to_dict(),
               quick=cfg.quick, accuracy=cfg.accuracy, families=cfg.families,
               accuracy_tokens=cfg.accuracy_tokens, accuracy_heads=cfg.accuracy_heads,
               seed=cfg.seed, workloads_source=cfg.source,
               implementations=[i.describe() for i in impls]),
               "workloads": [], "complete": False}
    paths = report.output_paths(cfg.out, now.strftime("%Y%m%d-%H%M%S"),
                                (git.get("short") or "nogit") + ("-dirty" if git.get("dirty") else ""))
    progress.log(f"flamia bench on {env.get('device')} (torch {env.get('torch')}, triton "
                 f"{env.get('triton')}, cuDNN {env.get('cudnn')}, cudnn-frontend "
                 f"{env.get('cudnn_frontend')}, flash-attn-4 {env.get('flash_attn_4')}); "
                 f"{len(cfg.workloads)} workload(s), "
                 f"{len(impls)} implementation(s)")
    results["not_run"] = []
    try:
        for wi, w in enumerate(cfg.workloads, 1):
            elapsed = time.perf_counter() - progress.t0
            if cfg.max_minutes is not None and elapsed > 60 * cfg.max_minutes:
                results["not_run"] = [x.name for x in cfg.workloads[wi - 1:]]
                progress.log(f"--max-minutes {cfg.max_minutes} reached after {elapsed:.0f} s: not "
                             f"running {', '.join(results['not_run'])}")
                break
            wres = run_workload(w, impls, cfg, progress, wi, len(cfg.workloads))
            results["workloads"].append(wres)
            progress.done()
            print(report.workload_text(wres) + "\n", flush=True)
            results["wall_s"] = round(time.perf_counter() - progress.t0, 1)
            try:  # so that a run killed later still leaves its numbers behind
                write_outputs(results, paths, chart=False)
            except Exception as e:
                progress.log(f"could not write partial results: {_error(e)}")
        results["complete"] = not results["not_run"]
    except KeyboardInterrupt:
        progress.log("interrupted: writing the partial results")
    finally:
        progress.done()
        results["wall_s"] = round(time.perf_counter() - progress.t0, 1)
    return results, paths


def write_outputs(results: dict, paths: dict, chart: bool) -> list:
    msgs = []
    report.write_json(results, paths["json"])
    msgs.append(f"wrote {paths['json']}")
    report.write_markdown(results, paths["md"])
    msgs.append(f"wrote {paths['md']}")
    if chart:
        try:
            msgs.append(report.write_chart(results, paths["png"]))
        except Exception as e:
            msgs.append(f"chart failed: {_error(e)}")
    return msgs


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve(args)
    except (WorkloadError, ValueError) as e:
        print(f"flamia bench: error: {e}", file=sys.stderr)
        return 2
    impls = make_impls(cfg.recipes, cfg.baselines)
    if not impls:
        print("flamia bench: error: nothing to measure (--recipes none and --baselines none)",
              file=sys.stderr)
        return 2
    if args.dry_run:
        print(dry_run_text(cfg, impls))
        return 0
    import torch
    if not torch.cuda.is_available():
        print(NEEDS_GPU, file=sys.stderr)
        return 1
    _sigterm_as_interrupt()
    results, paths = run(cfg, impls, argv)
    msgs = write_outputs(results, paths, cfg.chart)
    sys.stderr.flush()
    print("\n".join(msgs))
    if results.get("not_run"):
        print(f"not run (--max-minutes): {', '.join(results['not_run'])}")
    print()
    print(report.summary_text(results), flush=True)
    if results.get("complete") or results.get("not_run"):
        return 0
    return 130


def _sigterm_as_interrupt():
    """`timeout` and job control send SIGTERM: finish like Ctrl-C, writing what was measured."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        pass
