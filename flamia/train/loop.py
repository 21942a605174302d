"""Training runs of `flamia train-check`: same data order, same init seed, only attention differs."""
from __future__ import annotations

import math
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from ..recipes import RECIPES
from . import data as D
from .report import EXACT_BF16
from .model import (ModelSize, batch_to_device, build_model, count_parameters, loss_sum,
                    set_attention)


# ----------------------------------------------------------------------------- run specs

@dataclass(frozen=True)
class RunSpec:
    """One training run: which attention trains the model, and the init seed."""
    name: str
    attention: str      # "flamia:<recipe>", "torch" (torch's exact varlen), "cudnn" (ragged), "fa4"
    seed_offset: int = 0

    @property
    def recipe(self) -> str | None:
        return self.attention.split(":", 1)[1] if self.attention.startswith("flamia:") else None

    @property
    def leaky(self) -> bool:
        return self.recipe is not None and RECIPES[self.recipe].leaky


def parse_runs(text: str) -> list[RunSpec]:
    """'bf16,fp8,fp8_mixed,fp8_tensorwise,bf16_seed1' -> RunSpecs.

    <recipe> trains with flamia's recipe; 'torch' with torch's exact bf16 varlen attention
    (FlashAttention-2 varlen on CUDA); 'cudnn' with cuDNN's bf16 ragged attention (CUDA and
    cudnn-frontend only); 'fa4' with FlashAttention-4's bf16 varlen attention (flash-attn-4, an
    sm90 GPU); a '_seed<N>' suffix offsets the init seed by N (same data).
    """
    runs = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        m = re.fullmatch(r"(.+?)(?:_seed(\d+))?", tok)
        base, seed = m.group(1), int(m.group(2) or 0)
        if base in RECIPES:
            runs.append(RunSpec(tok, f"flamia:{base}", seed))
        elif base in ("torch", "torch_bf16"):
            runs.append(RunSpec(tok, "torch", seed))
        elif base in ("cudnn", "fa4"):
            runs.append(RunSpec(tok, base, seed))
        else:
            raise ValueError(f"unknown run {tok!r}: use a recipe ({', '.join(RECIPES)}), 'torch', "
                             "'cudnn', 'fa4', optionally with a _seed<N> suffix")
    if len({r.name for r in runs}) != len(runs):
        raise ValueError(f"duplicate run names in {text!r}")
    return runs


def attention_names(check_finite: bool = False) -> dict[str, str]:
    """Register every attention this check uses with transformers; {attention spec: HF name}."""
    from ..integrations import hf
    names = {f"flamia:{r}": hf.register(f"flamia_train_{r}", r, check_finite=check_finite)
             for r in RECIPES}
    names["torch"] = hf.register_exact()
    from ..bench.cudnn_graphs import cudnn_ragged_varlen
    names["cudnn"] = hf.register_varlen("flamia_baseline_cudnn_ragged", cudnn_ragged_varlen)
    from ..bench.baselines import fa4_varlen
    names["fa4"] = hf.register_varlen("flamia_baseline_fa4", fa4_varlen)
    return names


def check_runs_can_run(runs: list[RunSpec], device: torch.device) -> None:
    """Fail before any training when a run's attention cannot run here."""
    if any(r.attention == "cudnn" for r in runs):
        if device.type != "cuda":
            raise ValueError("run 'cudnn' (cuDNN ragged attention) needs a CUDA device")
        import importlib.util
        if importlib.util.find_spec("cudnn") is None:    # the cudnn-frontend package
            raise ValueError("run 'cudnn' needs the cudnn-frontend package "
                             "(pip install nvidia-cudnn-frontend)")
    if any(r.attention == "fa4" for r in runs):
        if device.type != "cuda":
            raise ValueError("run 'fa4' (FlashAttention-4 varlen attention) needs a CUDA device")
        from ..bench.baselines import fa4_env_skip
        why = fa4_env_skip()
        if why:
            raise ValueError(f"run 'fa4' cannot run here: {why}")


# ----------------------------------------------------------------------------- config

@dataclass
class TrainConfig:
    steps: int = 300
    tokens_per_step: int = 32768
    max_doc_len: int = 2048
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = -1                 # -1: 10 % of steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = -1             # -1: steps // 5
    leaky_steps: int | None = None   # stop leaky controls after this many steps (same schedule)
    time_limit: float | None = None  # seconds for the whole check; runs past it stop ("timeout")
    val_batches: int = 8
    val_fraction: float = 0.05
    data_seed: int = 0
    init_seed: int = 0
    log_every: int = 10
    timing_skip: int = 5             # first steps excluded from tokens/s (compilation, autotune)
    time_rounds: int = 5             # interleaved step timing after the runs (0: off)
    time_steps: int = 8              # batches per attention and round of that timing
    exact: str = "torch"             # exact evaluator: "torch" or "flamia:bf16"
    amp: bool = True
    device: str = "auto"
    max_files: int | None = None
    stdlib: str | None = None
    model: ModelSize = field(default_factory=lambda: ModelSize(512, 8, 8, 2, 64, 1408))

    def resolved_warmup(self) -> int:
        return max(1, self.steps // 10) if self.warmup < 0 else self.warmup

    def resolved_eval_every(self) -> int:
        return max(1, self.steps // 5) if self.eval_every <= 0 else self.eval_every

    def steps_of(self, spec: "RunSpec") -> int:
        if spec.leaky and self.leaky_steps:
            return max(1, min(self.steps, self.leaky_steps))
        return self.steps

    def eval_points(self) -> list[int]:
        """Steps after which every run evaluates (a capped control's last step included)."""
        every = self.resolved_eval_every()
        pts = set(range(every, self.steps + 1, every)) | {self.steps}
        if self.leaky_steps and self.leaky_steps < self.steps:
            pts.add(max(1, self.leaky_steps))
        return sorted(pts)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["warmup"] = self.resolved_warmup()
        d["eval_every"] = self.resolved_eval_every()
        d["eval_points"] = self.eval_points()
        return d


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine down to lr * min_lr_ratio at the last step."""
    warm = cfg.resolved_warmup()
    if step < warm:
        return cfg.lr * (step + 1) / warm
    span = max(1, cfg.steps - warm)
    t = min(1.0, (step - warm) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- data

@dataclass
class Data:
    train: D.Corpus
    val: D.Corpus
    train_steps: list          # list[D.Batch], identical for every run
    val_set: list              # list[D.Batch]

    def stats(self) -> dict:
        def docs(c):
            return {"files": len(c.files), "tokens": c.n_tokens}
        n_docs = [len(b.cu_seqlens) - 1 for b in self.train_steps]
        return {
            "root": self.train.root, "train": docs(self.train), "val": docs(self.val),
            "val_batches": len(self.val_set), "val_tokens": sum(b.n_tokens for b in self.val_set),
            "docs_per_step_mean": (sum(n_docs) / len(n_docs)) if n_docs else 0,
            "max_seqlen_mean": (sum(b.max_seqlen for b in self.train_steps) / len(self.train_steps))
            if self.train_steps else 0,
        }


def prepare_data(cfg: TrainConfig) -> Data:
    files = D.list_sources(cfg.stdlib) if cfg.stdlib else D.list_sources()
    train = D.load_corpus("train", cfg.stdlib, cfg.val_fraction, cfg.max_files, files=files)
    val = D.load_corpus("val", cfg.stdlib, cfg.val_fraction, cfg.max_files, files=files)
    it = D.train_batches(train, cfg.tokens_per_step, cfg.max_doc_len, cfg.data_seed)
    steps = [next(it) for _ in range(cfg.steps)]
    vals = D.val_batches(val, cfg.tokens_per_step, cfg.max_doc_len, cfg.val_batches)
    if not vals:
        raise D.DataError("empty validation split: no validation file among the selected sources")
    return Data(train, val, steps, vals)


# ----------------------------------------------------------------------------- runs

@torch.no_grad()
def evaluate(model, batches, device, amp: bool) -> float:
    """Mean next-token loss (nats per token) over the validation batches."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        b = batch_to_device(batch, device)
        total += float(loss_sum(model, b, amp))
        count += b["n_targets"]
    model.train(was_training)
    return total / max(count, 1)


def _optimizer(model, cfg: TrainConfig, device):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in n else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    if device.type == "cuda":
        kw["fused"] = True
    return torch.optim.AdamW(groups, **kw)


def train_step(model, opt, batch, lr: float, cfg: TrainConfig, device) -> tuple:
    """One optimizer step on one packed batch: (loss, grad norm, seconds). The time runs from
    an idle device to the step's last kernel (host-to-device copy of the batch included)."""
    for g in opt.param_groups:
        g["lr"] = lr
    _sync(device)
    t0 = time.perf_counter()
    b = batch_to_device(batch, device)
    loss = loss_sum(model, b, cfg.amp) / b["n_targets"]
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss_v, gnorm_v = loss.detach().item(), gnorm.item()    # syncs
    _sync(device)
    return loss_v, gnorm_v, time.perf_counter() - t0


def train_run(spec: RunSpec, cfg: TrainConfig, data: Data, names: dict, device,
              log=print, deadline: float | None = None) -> dict:
    """Train one model from scratch; returns its curves, evaluations, timings and status."""
    own = names[spec.attention]
    exact = names[cfg.exact]
    model = build_model(cfg.model, cfg.max_doc_len, cfg.init_seed + spec.seed_offset, device, own)
    model.train()
    opt = _optimizer(model, cfg, device)
    n_steps = cfg.steps_of(spec)
    eval_points = set(p for p in cfg.eval_points() if p <= n_steps) | {n_steps}
    rec = {"name": spec.name, "attention": spec.attention, "recipe": spec.recipe,
           "leaky": spec.leaky, "init_seed": cfg.init_seed + spec.seed_offset,
           "hf_attention": own, "params": count_parameters(model),
           "step": [], "train_loss": [], "lr": [], "grad_norm": [], "step_time_s": [],
           "eval_step": [], "val_loss_own": [], "val_loss_exact": [], "eval_time_s": [],
           "status": "ok", "nan_step": None, "steps_planned": n_steps}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_run = time.perf_counter()
    eval_total = 0.0
    if n_steps < cfg.steps:
        log(f"[{spec.name}] leaky control capped at {n_steps} of {cfg.steps} steps (same LR schedule)")
    for step in range(n_steps):
        if deadline is not None and time.perf_counter() > deadline:
            rec["status"] = "timeout"
            log(f"[{spec.name}] time limit reached after {step} steps: stopping this run")
            break
        lr = lr_at(step, cfg)
        loss_v, gnorm_v, dt = train_step(model, opt, data.train_steps[step], lr, cfg, device)
        rec["step"].append(step + 1)
        rec["train_loss"].append(loss_v)
        rec["lr"].append(lr)
        rec["grad_norm"].append(gnorm_v)
        rec["step_time_s"].append(dt)
        if not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):
            rec["status"] = "nan"
            rec["nan_step"] = step + 1
            log(f"[{spec.name}] step {step + 1}: non-finite loss {loss_v} / grad norm {gnorm_v}: stopping")
            break
        if step + 1 == min(n_steps, cfg.timing_skip + 5):
            med = statistics.median(rec["step_time_s"][cfg.timing_skip:] or rec["step_time_s"])
            est = (time.perf_counter() - t_run) + med * (n_steps - step - 1)
            log(f"[{spec.name}] {med * 1e3:.1f} ms/step, {cfg.tokens_per_step / med:,.0f} tok/s: "
                f"estimated {est:.0f} s for {n_steps} steps (+ {len(eval_points)} evaluations)")
        if (step + 1) % cfg.log_every == 0 or step == 0 or step + 1 == n_steps:
            timed = rec["step_time_s"][cfg.timing_skip:] or rec["step_time_s"]
            tps = cfg.tokens_per_step / statistics.median(timed)
            log(f"[{spec.name}] step {step + 1:>5}/{n_steps}  loss {loss_v:.4f}  lr {lr:.2e}  "
                f"|g| {gnorm_v:.2f}  {tps:,.0f} tok/s  {time.perf_counter() - t_run:.0f}s")
        if step + 1 in eval_points:
            te = time.perf_counter()
            v_own = evaluate(model, data.val_set, device, cfg.amp)
            if exact == own:
                v_exact = v_own
            else:
                set_attention(model, exact)
                v_exact = evaluate(model, data.val_set, device, cfg.amp)
                set_attention(model, own)
            te = time.perf_counter() - te
            eval_total += te
            rec["eval_step"].append(step + 1)
            rec["val_loss_own"].append(v_own)
            rec["val_loss_exact"].append(v_exact)
            rec["eval_time_s"].append(te)
            log(f"[{spec.name}] eval @ {step + 1}: val loss own {v_own:.4f}  exact-bf16 {v_exact:.4f}  "
                f"gap {v_own - v_exact:+.4f}  ({te:.1f}s)")
    rec["wall_s"] = time.perf_counter() - t_run
    rec["eval_wall_s"] = eval_total
    timed = rec["step_time_s"][cfg.timing_skip:] or rec["step_time_s"]
    rec["step_time_median_s"] = statistics.median(timed) if timed else None
    rec["tokens_per_s"] = cfg.tokens_per_step / rec["step_time_median_s"] if timed else None
    rec["peak_mem_gib"] = (torch.cuda.max_memory_allocated(device) / 2 ** 30
                           if device.type == "cuda" else None)
    del opt, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def time_steps(cfg: TrainConfig, data: Data, runs: list[RunSpec], names: dict, device,
               log=print) -> dict | None:
    """Training-step time of each non-leaky run's attention, measured interleaved on one model.

    The per-run tokens/s of train_run come from runs minutes apart, and two identical bf16 runs
    differ by 1-8 % there. Here one model (the runs' init seed) takes steps on the same
    cfg.time_steps batches with each attention in turn: one warm-up pass per attention
    (compilation, autotuning, cuDNN graphs), then cfg.time_rounds rounds, the order rotated per
    round. Returns per attention the median step time and tokens/s, and the fastest exact bf16
    attention (report.EXACT_BF16) among them."""
    atts = []
    for r in runs:
        if not r.leaky and r.attention not in atts:
            atts.append(r.attention)
    if cfg.time_rounds <= 0 or not atts:
        return None
    label = {a: next(r.name for r in runs if r.attention == a) for a in atts}
    batches = data.train_steps[:max(1, cfg.time_steps)]
    model = build_model(cfg.model, cfg.max_doc_len, cfg.init_seed, device, names[atts[0]])
    model.train()
    opt = _optimizer(model, cfg, device)
    lr = cfg.lr * cfg.min_lr_ratio
    log(f"=== step timing: {', '.join(label[a] for a in atts)}; {len(batches)} batches x "
        f"{cfg.time_rounds} rounds each, interleaved, one model ===")
    times = {a: [] for a in atts}
    for rnd in range(-1, cfg.time_rounds):            # round -1: warm-up, not recorded
        k = max(rnd, 0) % len(atts)
        for a in atts[k:] + atts[:k]:
            set_attention(model, names[a])
            for batch in batches:
                loss_v, _, dt = train_step(model, opt, batch, lr, cfg, device)
                if not math.isfinite(loss_v):
                    raise FloatingPointError(f"step timing: non-finite loss with {a}")
                if rnd >= 0:
                    times[a].append(dt)
    out = {}
    for a in atts:
        med = statistics.median(times[a])
        out[a] = {"run": label[a], "median_s": med, "tokens_per_s": cfg.tokens_per_step / med,
                  "min_s": min(times[a]), "n": len(times[a])}
    bf16 = [a for a in atts if a in EXACT_BF16]
    fastest = min(bf16, key=lambda a: out[a]["median_s"]) if bf16 else None
    for a in atts:
        rel = (f"  {out[fastest]['median_s'] / out[a]['median_s']:.3f}x the fastest bf16 "
               f"({label[fastest]})" if fastest else "")
        log(f"[timing] {label[a]:>12s} ({a}): {out[a]['median_s'] * 1e3:.2f} ms/step, "
            f"{out[a]['tokens_per_s']:,.0f} tok/s{rel}")
    del opt, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"rounds": cfg.time_rounds, "batches": len(batches), "lr": lr,
            "attentions": out, "fastest_bf16": fastest}


def environment(device) -> dict:
    import platform
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["cpu_threads"] = torch.get_num_threads()
    try:
        import flamia
        env["flamia_public_api"] = hasattr(flamia, "flamia_attn_varlen_func")
        from ..interface import backend
        x = torch.zeros(1, 1, 64, dtype=torch.bfloat16, device=device)
        env["flamia_backend"] = {r: backend(x, r) for r in RECIPES}
    except Exception as e:  # pragma: no cover - report, never fail the check for this
        env["flamia_backend"] = f"unknown ({type(e).__name__}: {e})"
    try:
        from ..integrations.hf import exact_backend
        env["exact_attention"] = exact_backend(torch.zeros(1, 1, 64, dtype=torch.bfloat16, device=device))
    except ImportError:  # pragma: no cover
        pass
    env["commit"] = _git_commit()
    return env


def _git_commit() -> str | None:
    """FLAMIA_GIT_COMMIT when set (a copied tree whose .git is stale, as on the device: the
    same rule as `flamia bench`), else HEAD read from .git (no git binary needed; read-only)."""
    import os
    from pathlib import Path
    if os.environ.get("FLAMIA_GIT_COMMIT"):
        return os.environ["FLAMIA_GIT_COMMIT"]
    here = Path(__file__).resolve()
    for parent in here.parents:
        head = parent / ".git" / "HEAD"
        if head.is_file():
            try:
                ref = head.read_text().strip()
                if ref.startswith("ref: "):
                    p = parent / ".git" / ref[5:]
                    if p.is_file():
                        return p.read_text().strip()
                    packed = parent / ".git" / "packed-refs"
                    if packed.is_file():
                        for line in packed.read_text().splitlines():
                            if line.endswith(ref[5:]):
                                return line.split()[0]
                    return None
                return ref
            except OSError:
                return None
    return None


def run_check(cfg: TrainConfig, runs: list[RunSpec], log=print, on_progress=None) -> dict:
    """Every run on the same data; returns the results dict (report.py turns it into files).

    on_progress(results) is called after each run (e.g. to write partial results). With
    cfg.time_limit, a run still going at the limit stops (status "timeout") and the runs after
    it are skipped (listed in results["skipped"])."""
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    check_runs_can_run(runs, device)
    names = attention_names(check_finite=False)
    if cfg.exact not in names:
        raise ValueError(f"unknown exact evaluator {cfg.exact!r}: use 'torch' or 'flamia:bf16'")
    t0 = time.perf_counter()
    deadline = t0 + cfg.time_limit if cfg.time_limit else None
    data = prepare_data(cfg)
    stats = data.stats()
    log(f"data: {stats['train']['files']} train files / {stats['train']['tokens']:,} tokens, "
        f"{stats['val']['files']} val files / {stats['val']['tokens']:,} tokens from {stats['root']}; "
        f"{cfg.steps} steps x {cfg.tokens_per_step} tokens, {stats['docs_per_step_mean']:.1f} docs/step, "
        f"validation {stats['val_batches']} batches ({time.perf_counter() - t0:.1f}s)")
    env = environment(device)
    log("env: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    backends = env.get("flamia_backend")
    if device.type == "cuda" and isinstance(backends, dict):
        slow = [s.name for s in runs if s.recipe and backends.get(s.recipe) == "reference"]
        if slow:
            log(f"note: runs {slow} use flamia's reference emulation on this GPU (no kernel for "
                f"their recipe): correct but slow; their tokens/s says nothing about flamia's speed")
    results = {"settings": cfg.as_dict(), "data": stats, "env": env,
               "runs": [r.name for r in runs], "results": {}, "skipped": []}
    for spec in runs:
        if deadline is not None and time.perf_counter() > deadline:
            log(f"=== run {spec.name}: skipped (time limit {cfg.time_limit:.0f}s reached) ===")
            results["skipped"].append(spec.name)
            continue
        log(f"=== run {spec.name}: attention {spec.attention}, init seed "
            f"{cfg.init_seed + spec.seed_offset} ===")
        try:
            rec = train_run(spec, cfg, data, names, device, log, deadline)
        except Exception as e:   # one broken attention must not cost the other runs
            import traceback
            log(traceback.format_exc())
            log(f"=== run {spec.name}: FAILED ({type(e).__name__}: {e}); going on ===")
            results["skipped"].append(spec.name)
            results.setdefault("errors", {})[spec.name] = f"{type(e).__name__}: {e}"
            continue
        if spec.attention == "cudnn":
            from ..bench.cudnn_graphs import GRAPH_BUILDS
            rec["cudnn_graph_builds"] = dict(GRAPH_BUILDS)
            log(f"[{spec.name}] cuDNN graph pairs built so far: {GRAPH_BUILDS['count']} "
                f"({GRAPH_BUILDS['seconds']:.1f} s, inside the steps that built them)")
        results["results"][spec.name] = rec
        log(f"[{spec.name}] done in {rec['wall_s']:.0f}s (eval {rec['eval_wall_s']:.0f}s): "
            f"{rec['tokens_per_s'] or 0:,.0f} tok/s, status {rec['status']}; "
            f"{time.perf_counter() - t0:.0f}s since start")
        sys.stdout.flush()
        results["total_wall_s"] = time.perf_counter() - t0
        if on_progress is not None:
            on_progress(results)
    if deadline is not None and time.perf_counter() > deadline:
        log("step timing: skipped (time limit reached)")
    else:
        failed = results.get("errors", {})
        results["step_timing"] = time_steps(cfg, data, [r for r in runs if r.name not in failed],
                                            names, device, log)
    results["total_wall_s"] = time.perf_counter() - t0
    return results
