"""flamia bench on the CPU: workloads, dry run, FLOPs, speedups, report writers, and the run loop
with fake timers (and a fake cudnn-frontend module that executes its graphs in plain PyTorch, to
check the layouts, ragged offsets and FP8 scale plumbing of the cuDNN baselines)."""
from __future__ import annotations

import io
import math
import json
import sys
import types

import pytest
import torch

from flamia.bench import main
from flamia.bench import baselines as B
from flamia.bench import report, run
from flamia.bench.workloads import (
    WorkloadError, accuracy_slice, fwd_flops, fwdbwd_flops, bwd_flops, load_workloads, parse_docs,
    parse_heads, parse_workloads, tflops, workload_from_flags,
)

DEFAULT_NAMES = ["doc32k", "doc8k_x4", "doc2k_x16", "longtail", "doc512_x64", "d64_doc8k_x4",
                 "d64_longtail"]


def _entry(**kw):
    e = {"name": "w", "heads_q": 32, "heads_kv": 8, "head_dim": 128, "total_tokens": 4096,
         "doc_lengths": [2048, 2048]}
    e.update(kw)
    return e


def _write(tmp_path, data, name="w.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


# ---------------------------------------------------------------------------------------------
# dry run and CLI


def test_dry_run_default_lists_suite(capsys):
    assert main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "7 workload(s)" in out and "(valid)" in out
    for name in DEFAULT_NAMES:
        assert name in out
    for label in ("flamia fp8", "flamia bf16", "SDPA cuDNN", "SDPA flash",
                  "cuDNN ragged", "FlashAttention-4", "varlen_attn (FA2)", "flex_attention",
                  "cuDNN FP8*"):
        assert label in out
    assert "flamia fp8_mixed" not in out            # a reference-only spec: not benchmarked
    assert "would skip SDPA cuDNN, SDPA flash, cuDNN FP8*: one document only (workload has 4)" in out
    assert "doc32k: runs" in out and "cuDNN FP8*" in out.split("doc32k: runs")[1].splitlines()[0]


@pytest.mark.parametrize("argv, name, docs, tokens", [
    (["--docs", "2048x16"], "flags_2048x16", 16, 32768),
    (["--docs", "8192,4096,17", "--heads", "16/4", "--head-dim", "64", "--name", "mine"],
     "mine", 3, 12305),
])
def test_dry_run_flag_workloads(capsys, argv, name, docs, tokens):
    assert main(["--dry-run"] + argv) == 0
    out = capsys.readouterr().out
    assert "1 workload(s) from flags" in out
    line = next(l for l in out.splitlines() if l.startswith(name + " "))
    assert f" {docs} " in line and f" {tokens} " in line


def test_dry_run_only_and_selection(capsys):
    assert main(["--dry-run", "--only", "longtail,doc32k", "--baselines", "varlen,flex",
                 "--recipes", "fp8", "--no-accuracy", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "2 workload(s)" in out and "doc8k_x4" not in out
    assert "implementations (3): flamia fp8 [flamia], varlen_attn (FA2)" in out
    assert "SDPA" not in out and "accuracy: off" in out


@pytest.mark.parametrize("argv, msg", [
    (["--only", "nope"], "unknown workload(s) ['nope']"),
    (["--recipes", "fp9"], "unknown recipe 'fp9'"),
    (["--recipes", "mxfp8"], "no GPU kernels"),
    (["--baselines", "sdpa_cudnn,xformers"], "unknown baseline 'xformers'"),
    (["--docs", "2048x"], "--docs: cannot parse"),
    (["--docs", "2048", "--heads", "32/5"], "divisible"),
    (["--heads", "32/8"], "--heads only applies with --docs"),
    (["--families", "spiky"], "unknown family"),
])
def test_bad_arguments_exit_2(capsys, argv, msg):
    assert main(["--dry-run"] + argv) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_real_run_on_cpu_exits_nonzero(capsys, tmp_path):
    assert main(["--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--dry-run" in err
    assert not list(tmp_path.iterdir())


def test_python_m_entry_point_and_help():
    import subprocess
    from pathlib import Path
    r = subprocess.run([sys.executable, "-m", "flamia.bench", "--help"], capture_output=True,
                       text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and "--dry-run" in r.stdout and "--baselines" in r.stdout


# ---------------------------------------------------------------------------------------------
# workloads files


def test_default_file_loads():
    ws, path = load_workloads()
    assert [w.name for w in ws] == DEFAULT_NAMES
    assert path.endswith("workloads.json")
    assert all(w.total_tokens == 32768 for w in ws)


@pytest.mark.parametrize("data, msg", [
    ("{not json", "not valid JSON"),
    ({"nothing": []}, "no 'workloads' list"),
    ({"workloads": []}, "'workloads' is empty"),
    ({"workloads": {"a": 1}}, "must be a list"),
    ({"workloads": [_entry(heads_kv=5)]}, "heads_q (32) must be divisible by heads_kv (5)"),
    ({"workloads": [_entry(total_tokens=4000)]}, "doc_lengths sum to 4096, but total_tokens is 4000"),
    ({"workloads": [_entry(doc_lengths=[2048, -1])]}, "'doc_lengths' must hold positive integers"),
    ({"workloads": [_entry(doc_lengths=[2048, 1.5])]}, "bad: [1]=1.5"),
    ({"workloads": [_entry(doc_lengths=[])]}, "non-empty list"),
    ({"workloads": [_entry(head_dim=100)]}, "head_dim must be a multiple of 8"),
    ({"workloads": [_entry(heads_q=0)]}, "'heads_q' must be a positive integer"),
    ({"workloads": [_entry(name="")]}, "'name' must be a non-empty string"),
    ({"workloads": [_entry(name="a b")]}, "may only contain"),
    ({"workloads": [_entry(), _entry()]}, "duplicate name 'w'"),
    ({"workloads": [_entry(heads_Q=4)]}, "unknown key(s) ['heads_Q']"),
    ({"workloads": [{"name": "x"}]}, "missing required key 'heads_q'"),
    ({"workloads": [3]}, "must be an object"),
])
def test_bad_workload_files(tmp_path, capsys, data, msg):
    path = _write(tmp_path, data)
    with pytest.raises(WorkloadError) as ei:
        load_workloads(path)
    assert msg in str(ei.value)
    assert main(["--dry-run", "--workloads", path]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.startswith("flamia bench: error:")


def test_bad_file_reports_every_problem_with_location(tmp_path):
    path = _write(tmp_path, {"workloads": [_entry(), _entry(name="b", heads_kv=3, total_tokens=1)]})
    with pytest.raises(WorkloadError) as ei:
        load_workloads(path)
    msg = str(ei.value)
    assert "workloads[1] ('b')" in msg and "divisible" in msg and "total_tokens is 1" in msg


def test_missing_file(tmp_path):
    with pytest.raises(WorkloadError, match="not found"):
        load_workloads(str(tmp_path / "none.json"))


def test_bare_list_and_optional_total(tmp_path):
    e = _entry()
    del e["total_tokens"]
    ws = parse_workloads([e, _entry(name="x", description="d")])
    assert ws[0].total_tokens == 4096 and ws[1].description == "d"


def test_parse_docs_and_heads():
    assert parse_docs("2048x16") == (2048,) * 16
    assert parse_docs("8192,4096,17") == (8192, 4096, 17)
    assert parse_docs("8192x2, 512") == (8192, 8192, 512)
    for bad in ("", "0", "2048x0", "a", "12x3x4"):
        with pytest.raises(WorkloadError):
            parse_docs(bad)
    assert parse_heads("32/8") == (32, 8) and parse_heads("16") == (16, 16)
    assert parse_heads("32:4") == (32, 4)
    for bad in ("32/7", "x", "0/0"):
        with pytest.raises(WorkloadError):
            parse_heads(bad)
    w = workload_from_flags("2048x16", "32/8", 128)
    assert w.name == "flags_2048x16" and w.n_docs == 16 and w.group == 4
    with pytest.raises(WorkloadError):
        workload_from_flags("2048", "32/8", 100)


def test_accuracy_slice():
    ws = {w.name: w for w in load_workloads()[0]}
    s = accuracy_slice(ws["doc512_x64"])
    assert s.doc_lengths == (512,) * 4 and (s.heads_q, s.heads_kv) == (4, 1) and not s.truncated
    s = accuracy_slice(ws["longtail"])     # first doc 2167 > 2048: truncated
    assert s.doc_lengths == (2048,) and s.truncated
    s = accuracy_slice(ws["d64_longtail"])
    assert (s.heads_q, s.heads_kv, s.head_dim) == (4, 4, 64)
    s = accuracy_slice(workload_from_flags("100,200,3000", "6/3"))
    assert s.doc_lengths == (100, 200) and (s.heads_q, s.heads_kv) == (4, 2)


# ---------------------------------------------------------------------------------------------
# FLOPs


def test_flops_hand_computed():
    # one causal doc: 2 GEMMs * 2 flops * Hq * D * L^2 / 2
    assert fwd_flops([4], 1, 1) == 2 * 2 * 1 * 1 * 16 / 2 == 32
    assert fwd_flops([4, 2], 3, 8) == 2 * 3 * 8 * (16 + 4) == 960
    assert bwd_flops([4, 2], 3, 8) == 2.5 * 960
    assert fwdbwd_flops([4, 2], 3, 8) == 3.5 * 960
    L, H, D = 32768, 32, 128
    assert fwd_flops([L], H, D) == 2 * H * D * L * L
    # ANCHORS: cuDNN SDPA bf16 fwd+bwd 56.98 ms on one 32k doc = 540 TFLOP/s
    assert round(tflops(fwdbwd_flops([L], H, D), 56.98)) == 540
    assert tflops(1e12, 0) is None and tflops(1e12, None) is None
    ws = {w.name: w for w in load_workloads()[0]}
    # 16 docs of 2048 = 1/16 of the flops of one 8192-token ... check vs closed form
    assert fwd_flops(ws["doc2k_x16"].doc_lengths, 32, 128) == 16 * 2 * 32 * 128 * 2048 ** 2


# ---------------------------------------------------------------------------------------------
# speedups and report writers


def _row(key, kind, fwd, fb, recipe="bf16", **kw):
    r = report.new_row(key, key.upper(), kind, recipe)
    r.update(dict(dict(fwd_ms=fwd, fwdbwd_ms=fb, status="ok"), **kw))
    return r


def test_speedup_against_fastest_bf16_baseline_excluding_fp8():
    rows = [_row("flamia:fp8", "flamia", 2.0, 5.0, "fp8"),
            _row("sdpa_cudnn", "bf16", 3.0, 8.0),
            _row("varlen", "bf16", 2.5, 10.0),
            _row("cudnn_fp8", "fp8", 1.0, 4.0, "fp8"),       # fastest overall, never the reference
            _row("flex", "bf16", None, None, status="error"),
            _row("flamia:bf16", "flamia", 0.5, 1.0)]         # flamia rows are not references
    ref = report.compute_speedups(rows)
    assert ref["fwd"]["key"] == "varlen" and ref["fwd"]["ms"] == 2.5
    assert ref["fwdbwd"]["key"] == "sdpa_cudnn" and ref["fwdbwd"]["ms"] == 8.0
    by = {r["key"]: r for r in rows}
    assert by["flamia:fp8"]["speedup_fwd"] == pytest.approx(1.25)
    assert by["flamia:fp8"]["speedup_fwdbwd"] == pytest.approx(1.6)
    assert by["cudnn_fp8"]["speedup_fwdbwd"] == pytest.approx(2.0)
    assert by["sdpa_cudnn"]["speedup_fwdbwd"] == pytest.approx(1.0)
    assert by["varlen"]["speedup_fwdbwd"] == pytest.approx(0.8)
    assert by["flex"]["speedup_fwd"] is None


def test_speedup_without_bf16_baseline():
    rows = [_row("flamia:fp8", "flamia", 2.0, 5.0), _row("cudnn_fp8", "fp8", 1.0, 4.0)]
    ref = report.compute_speedups(rows)
    assert ref == {"fwd": None, "fwdbwd": None}
    assert all(r["speedup_fwd"] is None for r in rows)


def _synthetic_results():
    w1 = {"name": "doc32k", "heads_q": 32, "heads_kv": 8, "head_dim": 128, "total_tokens": 32768,
          "doc_lengths": [32768], "n_docs": 1, "max_len": 32768, "docs_str": "32768",
          "flops_fwd": 8.796e12, "flops_fwdbwd": 3.0786e13}
    rows1 = [_row("flamia:fp8", "flamia", 12.0, 45.0, "fp8",
                  accuracy={"mild": {"O": 0.043, "dQ": 0.062, "dK": 0.061, "dV": 0.047},
                            "outliers": {"O": float("nan"), "dQ": 0.1, "dK": 0.1, "dV": 0.1}},
                  peak_mem_bytes=3 * 2**30),
             _row("sdpa_cudnn", "bf16", 15.0, 56.98, notes=["GQA via enable_gqa=True"]),
             _row("cudnn_fp8", "fp8", 10.0, 41.7, "fp8",
                  accuracy={"mild": {"error": "skipped: x"}}),
             dict(report.new_row("varlen", "varlen_attn (FA2)", "bf16", "bf16"),
                  status="skipped", reason="torch.nn.attention.varlen.varlen_attn not available"),
             dict(_row("flex", "bf16", 20.0, None), status="partial",
                  errors={"fwdbwd": "RuntimeError: boom"})]
    w2 = dict(w1, name="doc2k_x16", n_docs=16, doc_lengths=[2048] * 16, docs_str="2048x16",
              flops_fwd=5.5e11, flops_fwdbwd=1.92e12)
    rows2 = [_row("flamia:fp8", "flamia", 1.0, 3.0, "fp8"), _row("cudnn", "bf16", 1.5, 4.93)]
    results = {"schema": report.SCHEMA, "timestamp": "2026-11-29T10:00:00+00:00",
               "argv": ["--quick"], "complete": True,
               "env": {"device": "NVIDIA H200", "driver": "580.1", "torch": "2.11.0",
                       "triton": "3.6.0", "cudnn": 91900, "cudnn_frontend": "1.20.0",
                       "git": {"commit": "abcdef1234567", "short": "abcdef12", "dirty": True}},
               "settings": {"warmup": 2, "reps": 10, "min_reps": 3, "target_s": 0.25},
               "workloads": []}
    for w, rows in ((w1, rows1), (w2, rows2)):
        report.add_tflops(rows, {"fwd": w["flops_fwd"], "fwdbwd": w["flops_fwdbwd"]})
        ref = report.compute_speedups(rows)
        results["workloads"].append({"workload": w, "rows": rows, "fastest_bf16": ref,
                                     "accuracy_slice": "first 2048 tokens (2048), heads 4/1"})
    return results


def test_report_text_and_markdown():
    res = _synthetic_results()
    txt = report.workload_text(res["workloads"][0])
    assert "doc32k: 1 doc(s)" in txt and "implementation" in txt
    assert "flamia fp8" not in txt or "FLAMIA:FP8" in txt   # label from _row is KEY.upper()
    assert "FLAMIA:FP8" in txt and "1.27x" in txt            # 56.98 / 45
    assert "684" in txt                                      # 30.786 TFLOP / 45 ms
    assert "varlen_attn (FA2): skipped: torch.nn.attention.varlen.varlen_attn not available" in txt
    assert "FLEX (!) fwdbwd: RuntimeError: boom" in txt
    assert "NaN" in txt and "4.3e-02" in txt
    summ = report.summary_text(res)
    assert summ.startswith("SUMMARY forward+backward")
    assert "SDPA_CUDNN 56.98 ms" in summ and "geomean" in summ
    assert "CUDNN ragged" not in summ
    assert "* cuDNN FP8" in summ
    md = report.markdown(res)
    assert md.startswith("# flamia bench")
    assert "| implementation | recipe | fwd ms | fwd TFLOP/s |" in md
    assert "| FLAMIA:FP8 | fp8 | 12.00 |" in md
    assert "abcdef1234567 (dirty)" in md and "NVIDIA H200" in md
    assert "| FLAMIA:FP8 | outliers | NaN | 1.0e-01 |" in md
    assert "- varlen_attn (FA2): skipped:" in md and "error in fwdbwd: RuntimeError: boom" in md
    assert "## doc2k_x16" in md and "1.64x" in md             # 4.93 / 3.0


def test_report_json_and_files(tmp_path):
    res = _synthetic_results()
    paths = report.output_paths(tmp_path / "r", "20261129-100000", "abcdef12")
    assert paths["json"].name == "bench-20261129-100000-abcdef12.json"
    report.write_json(res, paths["json"])
    back = json.loads(paths["json"].read_text())
    assert back["workloads"][0]["rows"][0]["accuracy"]["outliers"]["O"] == "NaN"
    assert back["workloads"][0]["fastest_bf16"]["fwdbwd"]["key"] == "sdpa_cudnn"
    assert back["env"]["git"]["dirty"] is True
    report.write_markdown(res, paths["md"])
    assert paths["md"].read_text().startswith("# flamia bench")


def test_chart_written_or_skipped(tmp_path, monkeypatch):
    res = _synthetic_results()
    try:
        import matplotlib  # noqa: F401
        has_mpl = True
    except ImportError:
        has_mpl = False
    p = tmp_path / "c.png"
    msg = report.write_chart(res, p)
    if has_mpl:
        assert msg.startswith("chart written") and p.stat().st_size > 1000
    else:
        assert msg.startswith("chart skipped: matplotlib not available")
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import fails
    msg = report.write_chart(res, tmp_path / "d.png")
    assert msg.startswith("chart skipped: matplotlib not available")


def test_table_helpers():
    t = report.text_table(["a", "bb"], [["x", "1"], ["yy", "22"]])
    assert t.splitlines()[0] == "a   bb" and t.splitlines()[3] == "yy  22"
    assert report.md_table(["a|b", "c"], [["1", "2"]]).splitlines()[0] == "| a\\|b | c |"
    assert report.fmt_ms(56.98) == "56.98" and report.fmt_ms(4.071) == "4.071"
    assert report.fmt_ms(None) == "-" and report.fmt_x(1.2345) == "1.23x"
    assert report.fmt_err(float("nan")) == "NaN" and report.fmt_gib(2**31) == "2.00"


# ---------------------------------------------------------------------------------------------
# the run loop on the CPU, with fake timers and stand-ins for the CUDA-only kernels


def _fake_varlen(with_gqa_kw: bool, native_gqa: bool):
    """A differentiable stand-in for torch's varlen_attn (plain PyTorch, any device)."""
    from flamia.reference import attention_exact

    def impl(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, enable_gqa):
        if key.shape[1] != query.shape[1] and not (enable_gqa or native_gqa):
            raise RuntimeError("heads mismatch")
        return attention_exact(query, key, value, cu_seq_q, causal=causal,
                               dtype=torch.float32).to(query.dtype)

    if with_gqa_kw:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                        scale=None, window_size=(-1, -1), enable_gqa=False):
            return impl(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                        window_size == (-1, 0), enable_gqa)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
            return impl(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, False)
    return varlen_attn


@pytest.fixture
def cpu_bench(monkeypatch):
    """Point the runner at the CPU: fake CUDA timers, flamia's reference path, SDPA's math
    backend, eager flex (which refuses grad-requiring inputs on the CPU: an error row)."""
    from torch.nn.attention import SDPBackend

    calls = {"timed": 0}

    def fake_time(fn, n_copies, settings, on_progress=None):
        for i in range(2):
            fn(i % n_copies)
        calls["timed"] += 1
        ms = 1.0 + calls["timed"] * 0.1
        from flamia.bench.timing import Timing
        return Timing(ms, ms, ms, 2, [ms, ms])

    monkeypatch.setenv("FLAMIA_KERNELS", "0")     # flamia rows: the reference (fast on the CPU)
    monkeypatch.setattr(run, "DEVICE", "cpu")
    monkeypatch.setattr(run, "cuda_time", fake_time)
    monkeypatch.setattr(run, "peak_memory", lambda fn: (fn(), 1234)[1])
    monkeypatch.setattr(run, "l2_bytes", lambda: 60 << 20)
    monkeypatch.setattr(B.FlamiaImpl, "_check_kernels", lambda self, q: None)
    monkeypatch.setattr(B.SdpaImpl, "_backend", lambda self: SDPBackend.MATH)
    from torch.nn.attention.flex_attention import flex_attention
    monkeypatch.setattr(B, "_flex_compiled", lambda: flex_attention)
    return calls


def _cfg(workloads, **kw):
    base = dict(workloads=workloads, source="test", recipes=["bf16"], baselines=[],
                settings=run.TimingSettings(warmup=0, reps=2, min_reps=1, target_s=0.01),
                accuracy=True, families=["mild", "outliers"], accuracy_tokens=128,
                accuracy_heads=4, seed=0, out="unused", chart=False, quick=True)
    base.update(kw)
    return run.Config(**base)


def _quiet():
    return run.Progress(stream=io.StringIO())


def _run_one(w, baseline: str) -> dict:
    """The row of one baseline on one workload, no flamia recipe."""
    res = run.run_workload(w, B.make_impls([], [baseline]), _cfg([w], recipes=[]), _quiet(), 1, 1)
    return res["rows"][0]


def test_run_loop_on_cpu_records_rows_errors_and_accuracy(cpu_bench, monkeypatch):
    monkeypatch.setattr(B, "_varlen_fn", lambda: _fake_varlen(with_gqa_kw=True, native_gqa=False))
    w1 = workload_from_flags("96", "4/2", 64, name="one")
    w2 = workload_from_flags("40,56,7", "4/2", 64, name="three")
    impls = B.make_impls(["bf16"], ["sdpa_cudnn", "varlen", "flex", "cudnn"])
    cfg = _cfg([w1, w2])
    prog = _quiet()
    res = [run.run_workload(w, impls, cfg, prog, i + 1, 2) for i, w in enumerate([w1, w2])]
    rows1 = {r["key"]: r for r in res[0]["rows"]}
    rows2 = {r["key"]: r for r in res[1]["rows"]}
    # flamia bf16 through the reference: timed, accurate
    f = rows1["flamia:bf16"]
    assert f["status"] == "ok" and f["fwd_ms"] and f["fwdbwd_ms"] and f["peak_mem_bytes"] == 1234
    assert f["accuracy"]["mild"]["O"] < 1e-2 and f["accuracy"]["outliers"]["dK"] < 3e-2
    # SDPA: one doc only
    assert rows1["sdpa_cudnn"]["status"] == "ok" and rows1["sdpa_cudnn"]["accuracy"]["mild"]["dV"] < 2e-2
    assert "GQA via enable_gqa=True" in rows1["sdpa_cudnn"]["notes"]
    assert rows2["sdpa_cudnn"]["status"] == "skipped"
    assert "one document only (workload has 3)" in rows2["sdpa_cudnn"]["reason"]
    # varlen stand-in: window_size causal + enable_gqa
    v = rows2["varlen"]
    assert v["status"] == "ok" and "causal as window_size=(-1, 0)" in v["notes"]
    assert v["accuracy"]["mild"]["dQ"] < 2e-2
    # flex refuses inputs requiring grad on the CPU: an error row, never fatal
    fx = rows2["flex"]
    assert fx["status"] == "error" and {"fwd", "fwdbwd"} <= set(fx["errors"])
    assert "FlexAttention does not support backward on CPU" in fx["errors"]["fwd"]
    assert "error" in fx["accuracy"]["mild"] and fx["speedup_fwd"] is None
    # cudnn not importable here -> skipped with the reason (unless a fake is installed)
    assert rows2["cudnn"]["status"] == "skipped" and "cudnn" in rows2["cudnn"]["reason"]
    # speedups: reference is the fastest bf16 baseline that timed
    ref = res[1]["fastest_bf16"]["fwdbwd"]
    assert ref["key"] == "varlen"
    assert rows2["varlen"]["speedup_fwdbwd"] == pytest.approx(1.0)
    assert rows2["flamia:bf16"]["fwdbwd_tflops"] > 0
    results = {"workloads": res, "env": {}, "settings": {}, "timestamp": "t"}
    assert "geomean" in report.summary_text(results)
    assert "| varlen_attn (FA2) | mild |" in report.markdown(results)


@pytest.mark.parametrize("native", [True, False])
def test_varlen_without_enable_gqa_probes_or_repeats(cpu_bench, monkeypatch, native):
    monkeypatch.setattr(B, "_varlen_fn", lambda: _fake_varlen(with_gqa_kw=False, native_gqa=native))
    w = workload_from_flags("40,56", "4/2", 64, name="two")
    row = _run_one(w, "varlen")
    assert row["status"] == "ok", row
    assert "causal as is_causal=True" in row["notes"]
    assert any(("GQA native" in n) if native else ("kv repeated" in n) for n in row["notes"])
    assert row["accuracy"]["mild"]["dK"] < 2e-2     # repeat path sums dK over the group


def test_sdpa_falls_back_to_repeat_when_enable_gqa_is_rejected(cpu_bench, monkeypatch):
    import torch.nn.functional as F
    real = F.scaled_dot_product_attention

    def no_gqa(*a, enable_gqa=False, **kw):
        if enable_gqa:
            raise RuntimeError("No available kernel. Aborting execution.")
        return real(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", no_gqa)
    w = workload_from_flags("80", "4/2", 64, name="one")
    row = _run_one(w, "sdpa_flash")
    assert row["status"] == "ok"
    assert any("repeat_interleave outside the timed region" in n for n in row["notes"])
    assert row["accuracy"]["outliers"]["dK"] < 3e-2 and row["accuracy"]["mild"]["dV"] < 2e-2


# ---------------------------------------------------------------------------------------------
# FlashAttention-4: skip paths on this machine, and the row through a stand-in of its call


def _fake_fa4_module(calls: list):
    """A `flash_attn.cute` stand-in: flash_attn_varlen_func with FA4's keyword arguments,
    differentiable (plain PyTorch), returning (out, lse) as FA4 does."""
    from flamia.reference import attention_exact

    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None,
                               max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None,
                               seqused_q=None, seqused_k=None, gather_kv_indices=None,
                               page_table=None, softmax_scale=None, causal=False, **kw):
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k is cu_seqlens_q
        assert causal and isinstance(max_seqlen_q, int) and max_seqlen_q == max_seqlen_k
        assert q.shape[1] % k.shape[1] == 0
        calls.append((tuple(q.shape), tuple(k.shape), max_seqlen_q))
        out = attention_exact(q, k, v, cu_seqlens_q, causal=True, dtype=torch.float32)
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
        return out.to(q.dtype), lse

    pkg = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = flash_attn_varlen_func
    pkg.cute = cute
    return pkg, cute


def test_fa4_skipped_when_not_installed(cpu_bench, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)       # import fails
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setattr(B, "fa4_version", lambda: None)
    w = workload_from_flags("40,56", "4/2", 64, name="two")
    row = _run_one(w, "fa4")
    assert row["status"] == "skipped" and row["kind"] == "bf16"
    assert row["impl"] == "FlashAttention-4"
    assert "flash-attn-4" in row["reason"] and "not importable" in row["reason"]
    assert "\n" not in row["reason"] and "flamia[fa4]" in row["reason"]


def test_fa4_skipped_without_an_sm90_gpu(cpu_bench, monkeypatch):
    pkg, cute = _fake_fa4_module([])
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    w = workload_from_flags("40,56", "4/2", 64, name="two")
    row = _run_one(w, "fa4")
    assert row["status"] == "skipped"
    assert row["reason"] == "FlashAttention-4 needs a CUDA GPU (none here)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    reason = B.Fa4Impl().env_skip()
    assert "sm90" in reason and "sm100" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert B.Fa4Impl().env_skip() is None


def test_fa4_label_names_the_installed_version(monkeypatch):
    monkeypatch.setattr(B, "fa4_version", lambda: "4.0.0b36")
    impl = B.make_impls([], ["fa4"])[0]
    assert impl.label == "FlashAttention-4 4.0.0b36" and impl.kind == "bf16" and impl.key == "fa4"
    assert B.parse_baselines("flash_attn_4") == ["fa4"] and B.parse_baselines("fa4,cudnn") == \
        ["fa4", "cudnn"]
    assert "fa4" in B.parse_baselines("all") and "fa4" in B.BASELINE_HELP


def test_fa4_row_through_a_stand_in_is_a_bf16_reference(cpu_bench, monkeypatch):
    calls = []
    pkg, cute = _fake_fa4_module(calls)
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setattr(B, "fa4_env_skip", lambda: None)
    w = workload_from_flags("40,56,7", "4/2", 64, name="three")
    impls = B.make_impls(["bf16"], ["fa4"])
    res = run.run_workload(w, impls, _cfg([w]), _quiet(), 1, 1)
    rows = {r["key"]: r for r in res["rows"]}
    fa4 = rows["fa4"]
    assert fa4["status"] == "ok", fa4
    assert any("JIT compiled" in n for n in fa4["notes"]) and any("GQA native" in n
                                                                  for n in fa4["notes"])
    assert calls[0] == ((103, 4, 64), (103, 2, 64), 56)   # k, v keep their Hkv heads
    for fam in ("mild", "outliers"):
        assert max(fa4["accuracy"][fam].values()) < 3e-2, fa4["accuracy"]
    assert res["fastest_bf16"]["fwdbwd"]["key"] == "fa4"    # counts as a bf16 baseline
    assert rows["flamia:bf16"]["speedup_fwdbwd"] is not None
    results = {"workloads": [res], "env": {}, "settings": {}, "timestamp": "t"}
    assert fa4["impl"] in report.summary_text(results)


def test_fa4_listed_by_the_dry_run(capsys):
    assert main(["--dry-run", "--only", "doc8k_x4", "--recipes", "none", "--baselines",
                 "flash_attn_4"]) == 0
    out = capsys.readouterr().out
    assert "implementations (1): FlashAttention-4" in out and "[bf16 baseline]" in out
    assert "doc8k_x4: runs FlashAttention-4" in out
    assert "  FlashAttention-4" in out.split("environment here")[1]


def test_fa4_varlen_needs_cuda_tensors():
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        B.fa4_varlen(q, q, q, torch.tensor([0, 8], dtype=torch.int32), 8)


# ---------------------------------------------------------------------------------------------
# cuDNN baselines against a fake cudnn-frontend that runs its graphs in PyTorch


class _FT:
    def __init__(self, name="", dim=None, stride=None, data_type=None):
        self.name, self.dim, self.stride, self.dtype = name, dim, stride, data_type
        self.ragged, self.output = None, False

    def set_ragged_offset(self, t):
        self.ragged = t
        return self

    def set_output(self, b):
        self.output = b
        return self

    def set_dim(self, d):
        self.dim = list(d)
        return self

    def set_stride(self, s):
        self.stride = list(s)
        return self

    def set_data_type(self, d):
        self.dtype = d
        return self


class _FakeGraph:
    """Executes sdpa / sdpa_backward / sdpa_fp8 / sdpa_fp8_backward with plain PyTorch, reading
    its operands through the dims, strides and ragged offsets the caller declared."""

    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None,
                 handle=None):
        self.node = None
        self.built = []

    def tensor(self, name="", dim=None, stride=None, data_type=None):
        return _FT(name, list(dim), list(stride), data_type)

    # the old spelling: is_inference (generate_stats unknown), exercising the variant fallback
    def sdpa(self, *, name, q, k, v, attn_scale, is_inference, use_causal_mask=False,
             use_padding_mask=False, seq_len_q=None, seq_len_kv=None):
        assert use_causal_mask and not is_inference
        o, stats = _FT("o"), _FT("stats")
        self.node = ("sdpa", dict(q=q, k=k, v=v, scale=attn_scale, seq_q=seq_len_q), (o, stats))
        return o, stats

    def sdpa_backward(self, *, name, q, k, v, o, dO, stats, attn_scale, use_causal_mask=False,
                      use_padding_mask=False, seq_len_q=None, seq_len_kv=None):
        outs = (_FT("dQ"), _FT("dK"), _FT("dV"))
        self.node = ("bwd", dict(q=q, k=k, v=v, o=o, dO=dO, stats=stats, scale=attn_scale,
                                 seq_q=seq_len_q), outs)
        return outs

    def sdpa_fp8(self, *, name, q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s,
                 scale_o, attn_scale, generate_stats, use_causal_mask=False):
        outs = (_FT("o"), _FT("stats"), _FT("amax_s"), _FT("amax_o"))
        self.node = ("fp8", dict(q=q, k=k, v=v, dq=descale_q, dk=descale_k, dv=descale_v,
                                 so=scale_o, scale=attn_scale), outs)
        return outs

    def sdpa_fp8_backward(self, *, name, q, k, v, o, dO, stats, descale_q, descale_k, descale_v,
                          descale_o, descale_dO, descale_s, descale_dP, scale_s, scale_dQ,
                          scale_dK, scale_dV, scale_dP, attn_scale, use_causal_mask=False):
        outs = tuple(_FT(n) for n in ("dQ", "dK", "dV", "amax_dQ", "amax_dK", "amax_dV", "amax_dP"))
        self.node = ("fp8bwd", dict(q=q, k=k, v=v, dO=dO, dq=descale_q, dk=descale_k,
                                    dv=descale_v, ddo=descale_dO, sdq=scale_dQ, sdk=scale_dK,
                                    sdv=scale_dV, scale=attn_scale), outs)
        return outs

    refuse_dense_stats = False

    def validate(self):
        for t in self.node[2]:
            assert t.output, f"{t.name} not marked as output"
        if self.refuse_dense_stats and self.node[0] == "sdpa" and self.node[2][1].ragged is None:
            raise RuntimeError("fake: THD inputs need ragged stats")
        self.built.append("validate")

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        assert len(modes) == 2

    def check_support(self):
        pass

    def build_plans(self):
        pass

    def get_workspace_size(self):
        return 64

    # -- execution
    @staticmethod
    def _views(pack, t, lens):
        """Per batch element (h, L_i, d) views of the buffer bound to t, through its declared
        dims/strides/ragged offsets, for L_i in lens."""
        buf = pack[t]
        b, h, s, d = t.dim
        _, sh, ss, sd = t.stride
        offs = pack[t.ragged].flatten().tolist() if t.ragged is not None else \
            [i * t.stride[0] for i in range(b)]
        return [torch.as_strided(buf, (h, L, d), (sh, ss, sd), buf.storage_offset() + offs[i])
                for i, L in enumerate(lens)]

    def execute(self, pack, workspace, handle=None):
        # the backward kinds differentiate their own recomputation (also when called from an
        # autograd.Function's backward, where grad mode is off); the forward kinds track nothing
        backward = self.node[0] in ("bwd", "fp8bwd")
        with torch.enable_grad() if backward else torch.no_grad():
            self._execute(pack)

    def _execute(self, pack):
        kind, a, outs = self.node
        q = a["q"]
        b = q.dim[0]
        lens = pack[a["seq_q"]].flatten().tolist() if a.get("seq_q") is not None else [q.dim[2]] * b
        V = lambda t: self._views(pack, t, lens)  # noqa: E731

        def attn(qi, ki, vi, scale):
            g = qi.shape[0] // ki.shape[0]
            ki, vi = ki.repeat_interleave(g, 0), vi.repeat_interleave(g, 0)
            s = torch.einsum("hid,hjd->hij", qi, ki) * scale
            L = qi.shape[1]
            s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
            return torch.softmax(s, -1) @ vi, torch.logsumexp(s, -1)

        if kind == "sdpa":
            o, stats = outs
            for qi, ki, vi, oi, si in zip(V(q), V(a["k"]), V(a["v"]), V(o), V(stats)):
                out, lse = attn(qi.float(), ki.float(), vi.float(), a["scale"])
                oi.copy_(out)
                si.copy_(lse[..., None])
        elif kind == "bwd":
            dQ, dK, dV = outs
            for qi, ki, vi, doi, dqi, dki, dvi in zip(V(q), V(a["k"]), V(a["v"]), V(a["dO"]),
                                                      V(dQ), V(dK), V(dV)):
                x = [t.detach().float().requires_grad_(True) for t in (qi, ki, vi)]
                out, _ = attn(*x, a["scale"])
                out.backward(doi.float())
                for dst, src in zip((dqi, dki, dvi), x):
                    dst.copy_(src.grad)
        elif kind == "fp8":
            o, stats, amax_s, amax_o = outs
            sc = lambda n: pack[a[n]].reshape(()).float()  # noqa: E731
            for i, (qi, ki, vi, oi) in enumerate(zip(V(q), V(a["k"]), V(a["v"]), V(o))):
                out, lse = attn(qi.float() * sc("dq"), ki.float() * sc("dk"), vi.float() * sc("dv"),
                                a["scale"])
                oi.copy_((out * sc("so")).clamp(-448, 448).to(oi.dtype))
                pack[stats][i, :, :, 0] = lse
                pack[amax_o].fill_(out.abs().max())
            if amax_s in pack:
                pack[amax_s].fill_(1.0)
        else:
            dQ, dK, dV, *amaxes = outs
            sc = lambda n: pack[a[n]].reshape(()).float()  # noqa: E731
            for qi, ki, vi, doi, dqi, dki, dvi in zip(V(q), V(a["k"]), V(a["v"]), V(a["dO"]),
                                                      V(dQ), V(dK), V(dV)):
                x = [(t.detach().float() * sc(n)).requires_grad_(True)
                     for t, n in ((qi, "dq"), (ki, "dk"), (vi, "dv"))]
                out, _ = attn(*x, a["scale"])
                dO = doi.float() * sc("ddo")
                out.backward(dO)
                for dst, src, n, am in zip((dqi, dki, dvi), x, ("sdq", "sdk", "sdv"), amaxes):
                    dst.copy_((src.grad * sc(n)).clamp(-448, 448).to(dst.dtype))
                    pack[am].fill_(src.grad.abs().max())
                pack[amaxes[3]].fill_((dO @ x[2].detach().transpose(1, 2)).abs().max())


@pytest.fixture
def fake_cudnn(monkeypatch):
    from flamia.bench import cudnn_graphs

    mod = types.ModuleType("cudnn")
    mod.__version__ = "0.0-fake"
    mod.data_type = types.SimpleNamespace(BFLOAT16="bf16", FLOAT="f32", INT32="i32", INT64="i64",
                                          FP8_E4M3="e4m3")
    mod.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
    mod.diagonal_alignment = types.SimpleNamespace(TOP_LEFT="TL", BOTTOM_RIGHT="BR")
    mod.pygraph = _FakeGraph
    mod.create_handle = lambda: "handle"
    mod.set_stream = lambda handle=None, stream=None: None
    mod.backend_version_string = lambda: "9.19.0-fake"
    monkeypatch.setitem(sys.modules, "cudnn", mod)
    monkeypatch.setattr(cudnn_graphs, "_HANDLE", None)
    monkeypatch.setattr(cudnn_graphs, "_GRAPHS", {})
    return mod


def test_cudnn_ragged_falls_back_to_ragged_stats(cpu_bench, fake_cudnn, monkeypatch):
    monkeypatch.setattr(_FakeGraph, "refuse_dense_stats", True)
    w = workload_from_flags("40,56,7", "4/2", 64, name="three")
    row = _run_one(w, "cudnn")
    assert row["status"] == "ok", row
    assert "ragged softmax stats" in row["notes"]
    assert max(row["accuracy"]["mild"].values()) < 1e-2


def test_cudnn_ragged_and_fp8_plumbing_with_fake_frontend(cpu_bench, fake_cudnn):
    from flamia.bench.cudnn_graphs import versions
    assert versions()["cudnn_frontend"] == "0.0-fake"
    w_one = workload_from_flags("72", "4/2", 64, name="one")
    w_many = workload_from_flags("40,56,7", "4/2", 64, name="three")
    impls = B.make_impls([], ["cudnn", "cudnn_fp8"])
    prog = _quiet()
    res_many = run.run_workload(w_many, impls, _cfg([w_many], recipes=[]), prog, 1, 2)
    res_one = run.run_workload(w_one, impls, _cfg([w_one], recipes=[]), prog, 2, 2)
    r = {x["key"]: x for x in res_many["rows"]}
    assert r["cudnn"]["status"] == "ok", r["cudnn"]
    # ragged offsets + strides reconstruct every document: exact-ish accuracy
    for fam in ("mild", "outliers"):
        for key in ("O", "dQ", "dK", "dV"):
            assert r["cudnn"]["accuracy"][fam][key] < 1e-2, (fam, key, r["cudnn"]["accuracy"])
    assert r["cudnn_fp8"]["status"] == "skipped" and "one document" in r["cudnn_fp8"]["reason"]
    r1 = {x["key"]: x for x in res_one["rows"]}
    fp8 = r1["cudnn_fp8"]
    assert fp8["status"] == "ok", fp8
    assert any("kv repeated" in n for n in fp8["notes"])
    acc = fp8["accuracy"]["mild"]
    assert all(0 < acc[k] < 0.15 for k in ("O", "dQ", "dK", "dV")), acc   # FP8-level error
    assert fp8["speedup_fwdbwd"] is None or res_one["fastest_bf16"]["fwdbwd"]["key"] == "cudnn"


def test_run_writes_after_each_workload_and_honours_max_minutes(cpu_bench, tmp_path, monkeypatch):
    monkeypatch.setattr(run, "collect_env", lambda: {"device": "cpu", "git": {"short": "abc"}})
    w1 = workload_from_flags("64", "2/1", 64, name="a")
    w2 = workload_from_flags("32,32", "2/1", 64, name="b")
    impls = B.make_impls(["bf16"], [])
    cfg = _cfg([w1, w2], out=str(tmp_path), accuracy=False)
    res, paths = run.run(cfg, impls, [])
    assert res["complete"] and [w["workload"]["name"] for w in res["workloads"]] == ["a", "b"]
    back = json.loads(paths["json"].read_text())          # written after each workload
    assert len(back["workloads"]) == 2 and paths["md"].exists()
    cfg = _cfg([w1, w2], out=str(tmp_path / "x"), accuracy=False, max_minutes=1e-9)
    res, paths = run.run(cfg, impls, [])
    assert res["workloads"] == [] and res["not_run"] == ["a", "b"] and not res["complete"]
    run.write_outputs(res, paths, chart=False)
    assert "not run (time budget): a, b" in paths["md"].read_text()


def test_cudnn_ragged_training_function_with_fake_frontend(fake_cudnn, monkeypatch):
    """The differentiable cuDNN ragged attention of `train-check --runs cudnn`: outputs and
    gradients per document, and one graph pair per (documents, length bucket, shapes)."""
    from flamia.bench import cudnn_graphs as CG
    from flamia.integrations.hf import sdpa_per_document

    monkeypatch.setattr(CG, "GRAPH_BUILDS", {"count": 0, "seconds": 0.0})
    fn = CG._ragged_function()

    def check(lengths, seed):
        g = torch.Generator().manual_seed(seed)
        T, Hq, Hkv, D = sum(lengths), 4, 2, 64
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        q, k, v, do = (torch.randn(T, h, D, generator=g).bfloat16()
                       for h in (Hq, Hkv, Hkv, Hq))
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = fn.apply(*x, cu, max(lengths), D ** -0.5)
        o.backward(do)
        y = [t.float().requires_grad_(True) for t in (q, k, v)]
        ref = sdpa_per_document(*y, cu, True, D ** -0.5)
        ref.backward(do.float())
        assert (o.float() - ref).abs().max() < 2e-2
        for got, want in zip(x, y):
            assert (got.grad.float() - want.grad).abs().max() < 5e-2

    check([40, 56, 7], 0)
    assert CG.GRAPH_BUILDS["count"] == 1
    check([60, 40, 3], 1)            # same count, length bucket (64) and T: graphs reused
    assert CG.GRAPH_BUILDS["count"] == 1
    check([30, 73], 2)               # two documents: a new pair
    assert CG.GRAPH_BUILDS["count"] == 2
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA"):
        CG.cudnn_ragged_varlen(q, q, q, cu, 8)
    with pytest.raises(NotImplementedError, match="causal"):
        CG.cudnn_ragged_varlen(q, q, q, cu, 8, causal=False)


# ---------------------------------------------------------------------------------------------
# benchmarks/tools/gates.py: the issues' criteria from a bench JSON

def _gate_rows(fp8_fb, fp8_fwd, ms):
    """Rows of one workload: flamia fp8 / bf16 and FA4 (fwd_ms, fwdbwd_ms) = ms[key]."""
    rows = [{"key": k, "impl": impl, "fwd_ms": ms[k][0], "fwdbwd_ms": ms[k][1]}
            for k, impl in (("flamia:fp8", "flamia"), ("flamia:bf16", "flamia"),
                            ("fa4", "FlashAttention-4 4.0.0b36"))]
    rows[0].update(speedup_fwdbwd=fp8_fb, speedup_fwd=fp8_fwd)
    return rows


def test_gates_criteria_from_bench_json(tmp_path):
    from benchmarks.tools import gates
    # fp8 backward 8 ms, bf16 10 ms, FA4 9.9 ms (skeleton 0.99); the second workload's bf16 bwd
    # 11 ms (0.9x: missed), and its fp8 fwd+bwd 1.0x brings the geomean of 1.3 and 1.0 to 1.14
    ms_a = {"flamia:fp8": (2.0, 10.0), "flamia:bf16": (3.0, 13.0), "fa4": (3.0, 12.9)}
    ms_b = {"flamia:fp8": (2.0, 10.0), "flamia:bf16": (3.0, 14.0), "fa4": (3.0, 12.9)}
    res = {"workloads": [
        {"workload": {"name": "doc32k"}, "rows": _gate_rows(1.3, 1.3, ms_a)},
        {"workload": {"name": "short"}, "rows": _gate_rows(1.0, 0.9, ms_b)}]}
    c = gates.criteria(res)
    assert c["fp8_geomean"] == pytest.approx(math.sqrt(1.3))
    assert c["issue26_fp8"] and c["fp8_lowest"] == 1.0
    assert c["per_workload"]["doc32k"][2] == pytest.approx(9.9 / 8.0)
    assert c["per_workload"]["doc32k"][3] == pytest.approx(9.9 / 10.0)
    assert c["skeleton_missed"] == ["short"]
    assert not c["issue28_forward"]              # short's forward 0.9x, doc32k's 1.3 >= 1.25
    res["workloads"][1]["rows"][0]["speedup_fwdbwd"] = 0.9           # below the 0.95 floor
    assert not gates.criteria(res)["issue26_fp8"]
    p = _write(tmp_path, res, "bench.json")
    text = gates.report(p)
    assert "missed at short" in text and "geomean 1.0817" in text


def test_gates_spread_over_suites(tmp_path):
    """gates.spread: per workload and column, (min, median, max) of the fwd+bwd medians over
    the given suites; a column a suite did not time is left out, not counted as zero."""
    from benchmarks.tools import gates
    suites = []
    for fa4_ms in (12.0, 13.0, 15.0):
        ms = {"flamia:fp8": (2.0, 10.0), "flamia:bf16": (3.0, 13.0), "fa4": (3.0, fa4_ms)}
        suites.append({"workloads": [{"workload": {"name": "doc32k"},
                                      "rows": _gate_rows(1.3, 1.3, ms)}]})
    suites[2]["workloads"][0]["rows"] = suites[2]["workloads"][0]["rows"][:2]   # no FA4 row
    sp = gates.spread(suites)["doc32k"]
    assert sp["fa4"] == (12.0, 12.5, 13.0) and sp["fp8"] == (10.0, 10.0, 10.0)
    paths = [_write(tmp_path, r, f"b{i}.json") for i, r in enumerate(suites)]
    text = gates.spread_report(paths)
    assert "12.00 / 12.50 / 13.00 (8%)" in text and "over 3 suites" in text
