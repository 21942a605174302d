"""Results: speedups, terminal tables, Markdown, JSON and the PNG chart.

A result set is a plain dict (what the JSON file holds):
  {"schema", "timestamp", "argv", "env": {...}, "settings": {...},
   "workloads": [{"workload": {...}, "rows": [row, ...], "fastest_bf16": {...}, ...}, ...]}
A row: {"impl", "key", "kind" ("flamia" | "bf16" | "fp8"), "recipe", "status" ("ok" | "partial" |
"skipped" | "error"), "reason", "notes": [...], "fwd_ms", "fwdbwd_ms", "fwd_tflops",
"fwdbwd_tflops", "speedup_fwd", "speedup_fwdbwd", "peak_mem_bytes", "accuracy": {family: {"O",
"dQ", "dK", "dV"} | {"error": ...}}, "errors": {stage: message}}.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

SCHEMA = "flamia.bench/1"
METRICS = ("fwd", "fwdbwd")
METRIC_LABEL = {"fwd": "fwd", "fwdbwd": "fwd+bwd"}
ERR_KEYS = ("O", "dQ", "dK", "dV")


def new_row(key: str, label: str, kind: str, recipe: str, notes=()) -> dict:
    return {"impl": label, "key": key, "kind": kind, "recipe": recipe, "status": "pending",
            "reason": None, "notes": list(notes), "fwd_ms": None, "fwdbwd_ms": None,
            "fwd_reps": None, "fwdbwd_reps": None, "fwd_min_ms": None, "fwdbwd_min_ms": None,
            "fwd_tflops": None, "fwdbwd_tflops": None, "speedup_fwd": None,
            "speedup_fwdbwd": None, "peak_mem_bytes": None, "accuracy": {}, "errors": {}}


def _ok(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def fastest_bf16(rows: list, metric: str) -> dict | None:
    """The fastest bf16 baseline row for metric ("fwd" | "fwdbwd"); FP8 baselines and flamia rows
    are never the reference."""
    best = None
    for r in rows:
        ms = r.get(f"{metric}_ms")
        if r.get("kind") == "bf16" and _ok(ms) and (best is None or ms < best[f"{metric}_ms"]):
            best = r
    return best


def compute_speedups(rows: list) -> dict:
    """Set speedup_fwd / speedup_fwdbwd on every timed row (reference ms / row ms, > 1 = faster
    than the fastest bf16 baseline of this workload). Returns which baseline was the reference."""
    ref = {}
    for m in METRICS:
        best = fastest_bf16(rows, m)
        ref[m] = None if best is None else {"key": best["key"], "impl": best["impl"],
                                            "ms": best[f"{m}_ms"]}
        for r in rows:
            ms = r.get(f"{m}_ms")
            r[f"speedup_{m}"] = (best[f"{m}_ms"] / ms) if best is not None and _ok(ms) else None
    return ref


def add_tflops(rows: list, flops: dict) -> None:
    for r in rows:
        for m in METRICS:
            ms = r.get(f"{m}_ms")
            r[f"{m}_tflops"] = flops[m] / (ms * 1e-3) / 1e12 if _ok(ms) else None


# ---------------------------------------------------------------------------------------------
# formatting


def fmt_ms(x) -> str:
    if not _ok(x):
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.2f}" if x < 100 else f"{x:.1f}"


def fmt_tf(x) -> str:
    return f"{x:.0f}" if _ok(x) else "-"


def fmt_x(x) -> str:
    return f"{x:.2f}x" if _ok(x) else "-"


def fmt_gib(b) -> str:
    return f"{b / 2**30:.2f}" if isinstance(b, (int, float)) and b >= 0 else "-"


def fmt_err(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and math.isnan(x):
        return "NaN"
    return f"{x:.1e}"


def text_table(headers: list, rows: list, align: str | None = None) -> str:
    """Aligned plain-text table; align is a string of 'l'/'r' per column (default: first l)."""
    cols = len(headers)
    align = align or ("l" + "r" * (cols - 1))
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(cols)]

    def line(r):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(r, widths, align)).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def md_table(headers: list, rows: list, align: str | None = None) -> str:
    cols = len(headers)
    align = align or ("l" + "r" * (cols - 1))
    sep = ["---:" if a == "r" else "---" for a in align]

    def esc(c):
        return str(c).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(esc(h) for h in headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _acc(row, fam, key):
    a = row.get("accuracy", {}).get(fam)
    if not a:
        return "-"
    if "error" in a:
        return "err"
    return fmt_err(a.get(key))


def _status_cell(row) -> str:
    st = row.get("status")
    if st == "skipped":
        return "skipped"
    if st == "error":
        return "error"
    return ""


def workload_header(wres: dict) -> str:
    w = wres["workload"]
    docs = w.get("docs_str") or f"{w.get('n_docs')} docs"
    return (f"{w['name']}: {w['n_docs']} doc(s) [{docs}], T={w['total_tokens']}, "
            f"Hq={w['heads_q']} Hkv={w['heads_kv']} D={w['head_dim']}, "
            f"fwd {w['flops_fwd'] / 1e12:.2f} TFLOP, fwd+bwd {w['flops_fwdbwd'] / 1e12:.2f} TFLOP")


def _families(wres) -> list:
    fams = []
    for r in wres["rows"]:
        for f in r.get("accuracy", {}):
            if f not in fams:
                fams.append(f)
    return fams


def workload_text(wres: dict) -> str:
    """Terminal table of one workload, then its skipped / failed rows with reasons."""
    fams = _families(wres)
    headers = ["implementation", "fwd ms", "TFLOP/s", "f+b ms", "TFLOP/s", "x fwd", "x f+b",
               "mem GiB"]
    for f in fams:
        headers += [f"{f[:5]} O", f"{f[:5]} dQ"]
    rows, other = [], []
    for r in wres["rows"]:
        if r["status"] == "skipped":
            other.append(f"  - {r['impl']}: skipped: {r['reason']}")
            continue
        cells = [r["impl"] + (" (!)" if r.get("errors") else ""), fmt_ms(r["fwd_ms"]),
                 fmt_tf(r["fwd_tflops"]), fmt_ms(r["fwdbwd_ms"]), fmt_tf(r["fwdbwd_tflops"]),
                 fmt_x(r["speedup_fwd"]), fmt_x(r["speedup_fwdbwd"]), fmt_gib(r["peak_mem_bytes"])]
        for f in fams:
            cells += [_acc(r, f, "O"), _acc(r, f, "dQ")]
        rows.append(cells)
        for stage, msg in r.get("errors", {}).items():
            other.append(f"  - {r['impl']} (!) {stage}: {msg}")
        for fam, a in r.get("accuracy", {}).items():
            if "error" in a:
                other.append(f"  - {r['impl']}: accuracy ({fam}): {a['error']}")
    ref = wres.get("fastest_bf16") or {}
    parts = [workload_header(wres)]
    if rows:
        parts.append(text_table(headers, rows))
    refs = []
    for m in METRICS:
        if ref.get(m):
            refs.append(f"{METRIC_LABEL[m]}: {ref[m]['impl']} {fmt_ms(ref[m]['ms'])} ms")
    parts.append("speedups vs the fastest bf16 baseline (" + ("; ".join(refs) or "none measured")
                 + "); accuracy = rel. error vs float64 on " + str(wres.get("accuracy_slice", "-")))
    parts += other
    return "\n".join(parts)


def _impl_columns(results: dict) -> list:
    cols = []
    for wres in results["workloads"]:
        for r in wres["rows"]:
            if r["impl"] not in cols and r["status"] != "skipped":
                cols.append(r["impl"])
    return cols


def _geomean(xs):
    xs = [x for x in xs if _ok(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summary_rows(results: dict, metric: str = "fwdbwd"):
    cols = _impl_columns(results)
    rows, per_col = [], {c: [] for c in cols}
    for wres in results["workloads"]:
        ref = (wres.get("fastest_bf16") or {}).get(metric)
        by_impl = {r["impl"]: r for r in wres["rows"]}
        cells = [wres["workload"]["name"],
                 f"{ref['impl']} {fmt_ms(ref['ms'])} ms" if ref else "-"]
        for c in cols:
            r = by_impl.get(c)
            if r is None or r["status"] == "skipped":
                cells.append("-")
            elif _ok(r.get(f"speedup_{metric}")):
                cells.append(fmt_x(r[f"speedup_{metric}"]))
                per_col[c].append(r[f"speedup_{metric}"])
            elif _ok(r.get(f"{metric}_ms")):
                cells.append(f"{fmt_ms(r[f'{metric}_ms'])} ms")
            else:
                cells.append("err")
        rows.append(cells)
    if len(results["workloads"]) > 1:
        rows.append(["geomean", ""] + [fmt_x(_geomean(per_col[c])) for c in cols])
    headers = ["workload", f"fastest bf16 ({METRIC_LABEL[metric]})"] + cols
    return headers, rows


def summary_text(results: dict) -> str:
    out = []
    for m, title in (("fwdbwd", "forward+backward"), ("fwd", "forward")):
        headers, rows = summary_rows(results, m)
        out.append(f"SUMMARY {title}: speedup vs the fastest bf16 baseline of each workload "
                   f"(same process; >1 = faster)")
        out.append(text_table(headers, rows, "ll" + "r" * (len(headers) - 2)))
        out.append("")
    notes = _footnotes(results)
    if notes:
        out += notes
    return "\n".join(out).rstrip()


def _footnotes(results) -> list:
    notes = []
    for wres in results["workloads"]:
        for r in wres["rows"]:
            if r["kind"] == "fp8" and r["status"] != "skipped":
                notes.append("* cuDNN FP8: per-tensor scales, Hkv=Hq (kv repeated), FP8 in/out; "
                             "its quantization not timed; never the speedup reference.")
                return notes
    return notes


# ---------------------------------------------------------------------------------------------
# Markdown


def markdown(results: dict) -> str:
    env, st = results.get("env", {}), results.get("settings", {})
    git = env.get("git") or {}
    lines = [f"# flamia bench — {results.get('timestamp', '')}", ""]
    lines.append(f"- device: {env.get('device', '-')} (driver {env.get('driver', '-')}, "
                 f"CUDA {env.get('torch_cuda', '-')})")
    lines.append(f"- torch {env.get('torch', '-')}, triton {env.get('triton', '-')}, cuDNN "
                 f"{env.get('cudnn', '-')}, cudnn-frontend {env.get('cudnn_frontend', '-')}, "
                 f"flash-attn-4 {env.get('flash_attn_4') or '-'}")
    commit = git.get("commit") or "unknown"
    lines.append(f"- flamia commit {commit}{' (dirty)' if git.get('dirty') else ''}")
    if results.get("argv") is not None:
        lines.append(f"- command: `flamia bench {' '.join(results['argv'])}`")
    if st:
        lines.append(f"- timing: CUDA events, median of up to {st.get('reps')} reps "
                     f"(~{st.get('target_s')} s per measurement, at least {st.get('min_reps')}), "
                     f"{st.get('warmup')} warm-up calls; bf16 in/out; inputs rotated among copies "
                     f"when they fit in L2")
    if results.get("not_run"):
        lines.append(f"- not run (time budget): {', '.join(results['not_run'])}")
    if results.get("complete") is False and not results.get("not_run"):
        lines.append("- **incomplete run** (interrupted): the workloads below are all that was measured")
    lines += ["- FLOPs: FlashAttention convention (forward = sum over docs of 2·2·Hq·D·L²/2, "
              "backward 2.5x); speedup = fastest bf16 baseline ms / ms (FP8 baselines excluded "
              "from the reference)", ""]
    for m, title in (("fwdbwd", "Forward+backward"), ("fwd", "Forward")):
        headers, rows = summary_rows(results, m)
        lines += [f"## {title} speedup vs the fastest bf16 baseline", "",
                  md_table(headers, rows, "ll" + "r" * (len(headers) - 2)), ""]
    for wres in results["workloads"]:
        lines += [f"## {wres['workload']['name']}", "", workload_header(wres), ""]
        headers = ["implementation", "recipe", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms",
                   "fwd+bwd TFLOP/s", "speedup fwd", "speedup fwd+bwd", "peak mem GiB", "notes"]
        rows = []
        for r in wres["rows"]:
            if r["status"] == "skipped":
                continue
            rows.append([r["impl"], r["recipe"], fmt_ms(r["fwd_ms"]), fmt_tf(r["fwd_tflops"]),
                         fmt_ms(r["fwdbwd_ms"]), fmt_tf(r["fwdbwd_tflops"]),
                         fmt_x(r["speedup_fwd"]), fmt_x(r["speedup_fwdbwd"]),
                         fmt_gib(r["peak_mem_bytes"]), "; ".join(r.get("notes", []))])
        if rows:
            lines += [md_table(headers, rows, "llrrrrrrrl"), ""]
        fams = _families(wres)
        if fams:
            lines += [f"Accuracy: relative Frobenius error vs float64 on "
                      f"{wres.get('accuracy_slice', '-')}", ""]
            arows = []
            for r in wres["rows"]:
                for f in fams:
                    a = r.get("accuracy", {}).get(f)
                    if not a:
                        continue
                    if "error" in a:
                        arows.append([r["impl"], f, "error: " + str(a["error"]), "", "", ""])
                    else:
                        arows.append([r["impl"], f] + [fmt_err(a.get(k)) for k in ERR_KEYS])
            if arows:
                lines += [md_table(["implementation", "inputs", "O", "dQ", "dK", "dV"], arows,
                                   "llrrrr"), ""]
        extra = []
        for r in wres["rows"]:
            if r["status"] == "skipped":
                extra.append(f"- {r['impl']}: skipped: {r['reason']}")
            for stage, msg in r.get("errors", {}).items():
                extra.append(f"- {r['impl']}: error in {stage}: {msg}")
        if extra:
            lines += extra + [""]
    lines += _footnotes(results)
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------
# JSON, chart, paths


def _sanitize(x):
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return x
    if isinstance(x, dict):
        return {str(k): _sanitize(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_sanitize(v) for v in x]
    return x


def write_json(results: dict, path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_sanitize(results), indent=1) + "\n")
    return p


def write_markdown(results: dict, path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(markdown(results))
    return p


def write_chart(results: dict, path) -> str:
    """PNG: forward+backward speedup per workload vs its fastest bf16 baseline, one bar per
    implementation. Returns a message (written, or why not)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"chart skipped: matplotlib not available ({type(e).__name__}: {e})"
    cols = _impl_columns(results)
    names = [w["workload"]["name"] for w in results["workloads"]]
    data = {c: [] for c in cols}
    for wres in results["workloads"]:
        by = {r["impl"]: r for r in wres["rows"]}
        for c in cols:
            r = by.get(c)
            v = r.get("speedup_fwdbwd") if r else None
            data[c].append(v if _ok(v) else 0.0)
    cols = [c for c in cols if any(v > 0 for v in data[c])]
    if not cols or not names:
        return "chart skipped: no speedups to plot"
    n = len(cols)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(8.0, 1.4 * len(names) + 4), 4.8), dpi=120)
    for i, c in enumerate(cols):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, data[c], width, label=c)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right")
    ax.set_ylabel("fwd+bwd speedup vs fastest bf16 baseline")
    dev = results.get("env", {}).get("device", "")
    ax.set_title(f"flamia bench {results.get('timestamp', '')[:10]} {dev}".strip())
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)
    plt.close(fig)
    return f"chart written: {p}"


def output_paths(out_dir, stamp: str, short_commit: str) -> dict:
    base = Path(out_dir) / f"bench-{stamp}-{short_commit}"
    return {"json": base.with_suffix(".json"), "md": base.with_suffix(".md"),
            "png": base.with_suffix(".png")}
