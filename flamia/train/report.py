"""Verdict, table, JSON and plot of `flamia train-check`.

Verdict rules (all on the final validation loss, nats per byte-token):
- reference: the run "bf16" (else the first non-leaky bf16 / torch / cudnn / fa4 run); seed spread:
  the largest |val_exact| difference between the reference and runs with the same attention and
  another init seed (e.g. "bf16_seed1"); exact-bf16 spread: the same over runs with another exact
  bf16 attention (torch varlen, cuDNN ragged, FlashAttention-4) and the same seed. Those differ from
  the reference only by floating-point summation order, and at a few hundred steps that moves the
  final loss by as much as a new seed does (measured: 0.4 % between two seeds, 3.4 % between two
  exact kernels), so both estimate the run-to-run noise. Each run is compared with the reference's
  evaluation at the same step (its last one: a leaky control capped by --leaky-steps stops early).
- quality: a run passes when val_exact - val_exact(reference) <= max(seed spread, exact-bf16
  spread, 1 % of the reference's val loss). Evaluated with exact attention, so it measures the
  model, not the kernel.
- leakage: gap = val_own - val_exact. A model that learned to use information leaking through
  shared scales does better with its own (leaky) attention than with exact attention: it is
  flagged when -gap > max(0.5 % of the reference loss, 3 x |gap| of the reference run). A small
  positive gap is only the recipe's own quantization noise at evaluation.
- stability: no NaN/Inf; no spike (train loss more than 15 % above the reference run's loss on the
  same batch, after warmup -- the data order is identical, so batch difficulty cancels; for the
  reference itself, 50 % above its own trailing median of 20 steps); not diverging (mean loss of
  the last 10 % of steps not more than 5 % above the best such window).
- speed (reported, not part of pass / fail): the training step of each non-leaky run's attention
  timed interleaved on one model (loop.time_steps), against the fastest exact bf16 attention
  among them (flamia bf16, torch varlen, cuDNN ragged, FlashAttention-4).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

SPIKE_VS_REF = 0.15
SPIKE_VS_MEDIAN = 0.5
DIVERGE = 0.05
QUALITY_REL = 0.01
EXACT_BF16 = ("flamia:bf16", "torch", "cudnn", "fa4")   # attentions that compute exact bf16
LEAK_REL = 0.005
LEAK_REF_MULT = 3.0


def _final(xs):
    return xs[-1] if xs else float("nan")


def _window_mean(xs, w):
    return [sum(xs[i:i + w]) / w for i in range(0, len(xs) - w + 1)]


def _reference(results: dict, order: list[str]) -> str | None:
    if "bf16" in results:
        return "bf16"
    for n in order:
        r = results[n]
        if not r["leaky"] and r["attention"] in EXACT_BF16:
            return n
    return order[0] if order else None


def stability(rec: dict, ref: dict | None, warmup: int) -> dict:
    losses = rec["train_loss"]
    out = {"nan_step": rec.get("nan_step"), "spikes": 0, "max_excess_vs_ref": None,
           "diverging": False}
    if rec["status"] == "nan":
        out["summary"] = f"NaN at step {rec['nan_step']}"
        return out
    spikes = 0
    if ref is not None and ref is not rec and ref["status"] == "ok":
        n = min(len(losses), len(ref["train_loss"]))
        excess = [losses[i] / ref["train_loss"][i] - 1 for i in range(warmup, n)
                  if ref["train_loss"][i] > 0]
        spikes = sum(e > SPIKE_VS_REF for e in excess)
        out["max_excess_vs_ref"] = max(excess) if excess else None
    else:
        for i in range(max(warmup, 20), len(losses)):
            med = statistics.median(losses[i - 20:i])
            spikes += losses[i] > (1 + SPIKE_VS_MEDIAN) * med
    out["spikes"] = int(spikes)
    w = max(1, len(losses) // 10)
    if len(losses) >= 2 * w:
        wins = _window_mean(losses, w)
        out["diverging"] = wins[-1] > (1 + DIVERGE) * min(wins)
    parts = []
    if spikes:
        parts.append(f"{spikes} spike(s)")
    if out["diverging"]:
        parts.append("diverging")
    out["summary"] = ", ".join(parts) if parts else "stable"
    return out


def _at(rec: dict, key: str, step: int) -> float:
    """An evaluation of `rec` at `step` (NaN when it has none there)."""
    steps = rec.get("eval_step") or []
    return rec[key][steps.index(step)] if step in steps else float("nan")


def verdict(results: dict) -> dict:
    """Per-run verdict (module docstring) and the overall pass/fail of the non-leaky runs.

    Every run is compared with the reference at the step of its own last evaluation (a leaky
    control capped with --leaky-steps stops earlier; the reference evaluates there too)."""
    runs = results["results"]
    order = [n for n in results["runs"] if n in runs]
    warmup = results["settings"]["warmup"]
    ref_name = _reference(runs, order)
    ref = runs.get(ref_name)
    ref_final = ref["eval_step"][-1] if ref and ref.get("eval_step") else None
    base = _final(ref["val_loss_exact"]) if ref else float("nan")
    seeds = [n for n in order if n != ref_name and ref and runs[n]["attention"] == ref["attention"]]
    others = [n for n in order if n != ref_name and n not in seeds and not runs[n]["leaky"]
              and runs[n]["attention"] in EXACT_BF16]

    def spread_of(names):
        s_ = max((abs(_at(runs[n], "val_loss_exact", ref_final) - base) for n in names),
                 default=0.0)
        return s_ if math.isfinite(s_) else 0.0

    seed_spread, exact_spread = spread_of(seeds), spread_of(others)
    spread = max(seed_spread, exact_spread)

    def tolerances(step):
        b = _at(ref, "val_loss_exact", step) if ref else float("nan")
        g = abs(_at(ref, "val_loss_own", step) - b) if ref else 0.0
        return b, max(spread, QUALITY_REL * b), max(LEAK_REL * b, LEAK_REF_MULT * g)

    _, tol, leak_tol = tolerances(ref_final)
    # Speed from the interleaved step timing only: a run's own median includes one-time work
    # that falls in its steps (compilation, per-shape setup; issue 30's CPU --tiny run showed
    # fp8 18.5x faster than bf16 where the interleaved timing said 0.96x), so the medians of two
    # runs are not comparable. Runs it did not time (leaky controls) get no speed ratio.
    timed = (results.get("step_timing") or {}).get("attentions") or {}
    ref_timed = timed.get(ref["attention"]) if ref else None
    per_run = {}
    for n in order:
        r = runs[n]
        step = r["eval_step"][-1] if r.get("eval_step") else None
        own, exact = _final(r["val_loss_own"]), _final(r["val_loss_exact"])
        b, tol_n, leak_tol_n = tolerances(step)
        gap = own - exact
        delta = exact - b
        stab = stability(r, ref if n != ref_name else (runs[seeds[0]] if seeds else None), warmup)
        finite = math.isfinite(own) and math.isfinite(exact)
        quality_ok = finite and r["status"] == "ok" and math.isfinite(delta) and delta <= tol_n
        leak = finite and math.isfinite(leak_tol_n) and (-gap > leak_tol_n)
        stable = stab["summary"] == "stable"
        w = max(1, len(r["train_loss"]) // 10)
        role = ("reference" if n == ref_name else "seed" if n in seeds
                else "exact bf16" if n in others
                else "leaky control" if r["leaky"] else "candidate")
        passed = quality_ok and not leak and stable
        per_run[n] = {
            "role": role, "at_step": step,
            "final_train_loss": (sum(r["train_loss"][-w:]) / w) if r["train_loss"] else None,
            "val_own": own, "val_exact": exact, "gap_own_minus_exact": gap,
            "ref_val_exact_at_step": b, "delta_vs_ref": delta,
            "delta_vs_ref_rel": delta / b if (b and math.isfinite(b)) else None,
            "tolerance": tol_n, "leak_tolerance": leak_tol_n,
            "quality_ok": quality_ok, "leak_exploited": leak, "stability": stab,
            "tokens_per_s": r.get("tokens_per_s"),     # the run's own median (see above)
            "timed_tokens_per_s": timed[r["attention"]]["tokens_per_s"] if r["attention"] in timed
            else None,
            "speedup_vs_ref": (ref_timed["median_s"] / timed[r["attention"]]["median_s"])
            if (ref_timed and r["attention"] in timed) else None,
            "pass": passed,
        }
    candidates = [n for n in order
                  if per_run[n]["role"] in ("candidate", "reference", "seed", "exact bf16")]
    skipped = list(results.get("skipped") or [])
    overall = bool(candidates) and all(per_run[n]["pass"] for n in candidates) and not skipped
    return {"reference": ref_name, "seed_runs": seeds, "seed_spread": seed_spread,
            "exact_bf16_runs": others, "exact_bf16_spread": exact_spread, "spread": spread,
            "tolerance": tol,
            "leak_tolerance": leak_tol, "runs": per_run, "skipped": skipped, "pass": overall,
            "speed_vs_fastest_bf16": speed(results.get("step_timing"))}


def _fmt(x, spec=".4f"):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x, spec)


def table(results: dict, v: dict) -> str:
    """The verdict as a markdown table (printed and written to train_check.md)."""
    runs = results["results"]
    lines = [
        f"reference `{v['reference']}`; seed spread {_fmt(v['seed_spread'])} "
        f"({', '.join(v['seed_runs']) or 'no seed run'}); spread of the other exact bf16 "
        f"attentions {_fmt(v.get('exact_bf16_spread'))} "
        f"({', '.join(v.get('exact_bf16_runs') or []) or 'none'}); quality tolerance "
        f"{_fmt(v['tolerance'])} nats (max of the spreads, 1 % of the reference); "
        f"leak flagged when exact - own > "
        f"{_fmt(v['leak_tolerance'])}",
        "",
        "| run | attention | role | step | train loss | val (own attn) | val (exact bf16) | gap own-exact | "
        "Δ vs ref (exact) | quality | leak exploited | stability | tok/s | speed vs ref | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, p in v["runs"].items():
        r = runs[n]
        rel = p["delta_vs_ref_rel"]
        delta = f"{_fmt(p['delta_vs_ref'], '+.4f')} ({_fmt(rel * 100 if rel is not None else None, '+.2f')} %)"
        if p["role"] == "leaky control":
            verdict_s = "control: leak " + ("DETECTED" if p["leak_exploited"] else "not exploited")
        else:
            verdict_s = "PASS" if p["pass"] else "FAIL"
        lines.append(
            f"| {n} | {r['attention']} | {p['role']} | {p['at_step'] if p['at_step'] is not None else 'n/a'} | {_fmt(p['final_train_loss'])} | "
            f"{_fmt(p['val_own'])} | {_fmt(p['val_exact'])} | {_fmt(p['gap_own_minus_exact'], '+.4f')} | "
            f"{delta} | {'ok' if p['quality_ok'] else 'WORSE'} | {'YES' if p['leak_exploited'] else 'no'} | "
            f"{p['stability']['summary']} | {_tok_s(p)} | "
            f"{_fmt(p['speedup_vs_ref'], '.3f')}{'x' if p['speedup_vs_ref'] else ''} | {verdict_s} |")
    lines.append("")
    errors = results.get("errors") or {}
    for n, msg in errors.items():
        lines.append(f"FAILED run {n}: {msg}")
    late = [n for n in v.get("skipped", []) if n not in errors]
    if late:
        lines.append(f"skipped (time limit): {', '.join(late)}")
    timed_out = [n for n in v["runs"] if runs[n]["status"] == "timeout"]
    if timed_out:
        lines.append(f"stopped by the time limit: {', '.join(timed_out)}")
    lines.append(f"overall (non-leaky runs): {'PASS' if v['pass'] else 'FAIL'}")
    own = "† the run's own median step, which includes one-time work (compilation, per-shape " \
          "setup) that fell in its steps: not comparable between runs"
    if results.get("step_timing"):
        untimed = any(p["timed_tokens_per_s"] is None and p["tokens_per_s"]
                      for p in v["runs"].values())
        lines.append("(tok/s and speed vs ref above: the interleaved step timing below, one model, "
                     "after a warm-up pass" + (f"; {own}" if untimed else "") + ")")
    else:
        lines.append(f"(no interleaved step timing (--time-rounds 0 or the time limit), so no speed "
                     f"comparison; {own})")
    lines += timing_table(results.get("step_timing"))
    return "\n".join(lines)


def _tok_s(p: dict) -> str:
    """The table's tok/s: the interleaved timing's, else the run's own median marked †."""
    if p["timed_tokens_per_s"] is not None:
        return _fmt(p["timed_tokens_per_s"], ",.0f")
    return _fmt(p["tokens_per_s"], ",.0f") + (" †" if p["tokens_per_s"] else "")


def speed(timing: dict | None) -> dict | None:
    """From the interleaved step timing: each attention's step time against the fastest exact
    bf16 attention's (> 1: faster)."""
    if not timing or not timing.get("fastest_bf16"):
        return None
    att = timing["attentions"]
    base = att[timing["fastest_bf16"]]["median_s"]
    return {a: base / t["median_s"] for a, t in att.items()}


def timing_table(timing: dict | None) -> list:
    if not timing:
        return []
    rel = speed(timing) or {}
    fastest = timing.get("fastest_bf16")
    name = timing["attentions"][fastest]["run"] if fastest else None
    lines = ["", f"Training step, timed interleaved on one model ({timing['rounds']} rounds x "
                 f"{timing['batches']} batches per attention, after a warm-up pass; median):", "",
             "| run | attention | ms / step | tokens / s | vs fastest bf16 attention |",
             "| --- | --- | --- | --- | --- |"]
    for a, t in timing["attentions"].items():
        mark = " (fastest bf16)" if a == fastest else ""
        lines.append(f"| {t['run']} | {a} | {t['median_s'] * 1e3:.2f} | {t['tokens_per_s']:,.0f} | "
                     f"{_fmt(rel.get(a), '.3f')}x{mark} |")
    if name:
        lines.append("")
        lines.append(f"fastest exact bf16 attention: {name} ({fastest})")
    return lines


def _ema(xs, alpha):
    out, m = [], None
    for x in xs:
        if not math.isfinite(x):
            out.append(float("nan"))
            continue
        m = x if m is None else (1 - alpha) * m + alpha * x
        out.append(m)
    return out


def plot(results: dict, path: Path) -> bool:
    """Loss curves PNG; False (and nothing written) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = results["results"]
    order = [n for n in results["runs"] if n in runs]
    v = results.get("verdict") or verdict(results)
    ref = runs.get(v["reference"])
    steps = results["settings"]["steps"]
    alpha = min(1.0, 10.0 / max(steps, 10))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(order):
        r, c = runs[n], colors[i % len(colors)]
        axes[0].plot(r["step"], _ema(r["train_loss"], alpha), color=c, label=n)
        if ref is not None and r is not ref:
            m = min(len(r["train_loss"]), len(ref["train_loss"]))
            diff = [r["train_loss"][j] - ref["train_loss"][j] for j in range(m)]
            axes[1].plot(r["step"][:m], _ema(diff, alpha), color=c, label=n)
        axes[2].plot(r["eval_step"], r["val_loss_own"], "o-", color=c, label=f"{n} (own)")
        axes[2].plot(r["eval_step"], r["val_loss_exact"], "x--", color=c, label=f"{n} (exact bf16)")
    axes[0].set(title="train loss (EMA)", xlabel="step", ylabel="nats / byte")
    if steps > 20:
        tail = [x for n in order for x in runs[n]["train_loss"][steps // 5:] if math.isfinite(x)]
        if tail:
            axes[0].set_ylim(min(tail) * 0.95, max(tail) * 1.05)
    axes[1].axhline(0.0, color="k", lw=0.8)
    axes[1].set(title=f"train loss minus {v['reference']} (same batches, EMA)", xlabel="step",
                ylabel="nats / byte")
    axes[2].set(title="validation loss: own attention (o) vs exact bf16 (x)", xlabel="step",
                ylabel="nats / byte")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    s = results["settings"]
    m = s["model"]
    fig.suptitle(f"flamia train-check: Llama {m['hidden']}d x {m['layers']}L, {m['heads']}/{m['kv_heads']} "
                 f"heads, {results['results'][order[0]]['params'] / 1e6:.1f}M params; {s['steps']} steps x "
                 f"{s['tokens_per_step']} tokens; {results['env'].get('gpu', results['env']['device'])}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(results: dict, out_dir: "str | Path", log=print) -> dict:
    """Verdict + train_check.json, train_check.md, train_check.png under out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    v = verdict(results)
    results["verdict"] = v
    text = table(results, v)
    (out / "train_check.json").write_text(json.dumps(_clean(results), indent=1, default=_json_default,
                                                    allow_nan=False))
    (out / "train_check.md").write_text("# flamia train-check\n\n" + text + "\n")
    png = out / "train_check.png"
    made = plot(results, png)
    log(text)
    log(f"wrote {out / 'train_check.json'}, {out / 'train_check.md'}"
        + (f", {png}" if made else " (no PNG: matplotlib missing; pip install -e \".[train]\")"))
    return v


def _clean(x):
    """NaN / Inf -> None, recursively (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)
