"""`flamia train-check` (flamia/train): the data pipeline exactly, the verdict rules, and the tiny
end-to-end run (model, training, evaluation with own and exact attention, JSON / table / PNG)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from flamia.train import data as D
from flamia.train import report
from flamia.train.loop import TrainConfig, check_runs_can_run, lr_at, parse_runs


# ------------------------------------------------------------------ tokenizer

def test_byte_tokenizer_round_trips():
    samples = [b"", b"def f(x):\n    return x\n", "héllo ✓ 𝄞".encode(), bytes(range(256))]
    for s in samples:
        t = D.encode(s)
        assert t.dtype == np.int32 and t.size == len(s) and (t < 256).all()
        assert D.decode(t) == s
        doc = D.encode_document(s)
        assert doc[0] == D.BOS and doc[-1] == D.EOS and doc.size == len(s) + 2
        assert D.decode(doc) == s
    assert D.decode(D.encode("text")) == b"text"


# ------------------------------------------------------------------ corpus and split

@pytest.fixture
def tree(tmp_path):
    """A small source tree: files of varied lengths, a site-packages and a __pycache__ to skip."""
    rng = np.random.default_rng(0)
    for i in range(60):
        sub = tmp_path / ("pkg%d" % (i % 4) if i % 3 else "")
        sub.mkdir(parents=True, exist_ok=True)
        n = int(rng.integers(1, 900))
        (sub / f"mod{i:02d}.py").write_bytes(bytes(rng.integers(32, 127, n, dtype=np.uint8)))
    for skip in ("site-packages/foo", "__pycache__", "pkg1/__pycache__"):
        (tmp_path / skip).mkdir(parents=True, exist_ok=True)
        (tmp_path / skip / "x.py").write_text("print('skip me')\n")
    (tmp_path / "notes.txt").write_text("not python")
    return tmp_path


def test_list_sources_sorted_and_filtered(tree):
    files = D.list_sources(tree)
    assert files == sorted(files) and len(files) == 60
    assert all(f.endswith(".py") and "site-packages" not in f and "__pycache__" not in f for f in files)


def test_stdlib_listing_and_split_fraction():
    files = D.list_sources()
    assert len(files) > 500
    assert not any(f.startswith("site-packages/") for f in files)
    val = [f for f in files if D.split_of(f) == "val"]
    assert 0.02 < len(val) / len(files) < 0.09
    assert D.split_of(files[0]) == D.split_of(files[0])          # deterministic


def test_split_by_file_is_disjoint_and_complete(tree):
    files = D.list_sources(tree)
    train = D.load_corpus("train", tree, val_fraction=0.3, files=files)
    val = D.load_corpus("val", tree, val_fraction=0.3, files=files)
    assert set(train.files).isdisjoint(val.files)
    assert sorted(train.files + val.files) == files
    assert val.files and train.files
    for c in (train, val):
        for i, rel in enumerate(c.files):
            assert D.decode(c.document(i)) == (tree / rel).read_bytes()
    # a short list with no file hashing into val still gets one validation file
    tr, va = D.split_files(files[:3], val_fraction=1e-9)
    assert len(va) == 1 and sorted(tr + va) == files[:3]


def test_chunks_stay_inside_their_file(tree):
    c = D.load_corpus("all", tree)
    starts, lengths, doc = D.chunk_documents(c, 100)
    assert (lengths >= 1).all() and (lengths <= 100).all()
    ends = c.starts[doc] + c.lengths[doc]
    assert (starts >= c.starts[doc]).all() and (starts + lengths <= ends).all()
    for i in range(len(c.files)):                                 # chunks tile each file exactly
        sel = doc == i
        assert lengths[sel].sum() == c.lengths[i]
        assert starts[sel][0] == c.starts[i]


# ------------------------------------------------------------------ packing

def _check_batch(c: D.Corpus, b: D.Batch, budget: int, max_doc_len: int):
    cu = b.cu_seqlens
    assert b.tokens.size == budget and cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == budget
    assert (np.diff(cu) >= 1).all() and len(b.pieces) == len(cu) - 1
    assert b.max_seqlen == np.diff(cu).max() <= max_doc_len
    for d, (f, off, n) in enumerate(b.pieces):
        lo, hi = int(cu[d]), int(cu[d + 1])
        assert hi - lo == n
        # the piece lies inside one file: no document straddles a cu_seqlens boundary
        assert c.starts[f] <= off and off + n <= c.starts[f] + c.lengths[f]
        np.testing.assert_array_equal(b.tokens[lo:hi], c.tokens[off:off + n])
        np.testing.assert_array_equal(b.position_ids[lo:hi], np.arange(n))
        np.testing.assert_array_equal(b.targets[lo:hi - 1], b.tokens[lo + 1:hi])
        assert b.targets[hi - 1] == D.IGNORE                       # nothing predicted across
    assert b.n_targets == budget - (len(cu) - 1)


@pytest.mark.parametrize("budget,max_doc_len", [(256, 64), (1000, 300), (97, 1000)])
def test_packing_budget_and_document_boundaries(tree, budget, max_doc_len):
    c = D.load_corpus("all", tree)
    it = D.train_batches(c, budget, max_doc_len, seed=3)
    batches = [next(it) for _ in range(12)]
    for b in batches:
        _check_batch(c, b, budget, max_doc_len)
    # the stream is the shuffled chunk sequence, cut only at batch budgets
    starts, lengths, doc = D.chunk_documents(c, max_doc_len)
    order = np.random.default_rng([3, 0]).permutation(starts.size)
    stream = np.concatenate([c.tokens[starts[i]:starts[i] + lengths[i]] for i in order])
    got = np.concatenate([b.tokens for b in batches])
    n = min(got.size, stream.size)
    np.testing.assert_array_equal(got[:n], stream[:n])
    # same seed, same batches; another seed, another order
    again = D.train_batches(c, budget, max_doc_len, seed=3)
    assert all(np.array_equal(next(again).tokens, b.tokens) for b in batches)
    other = next(D.train_batches(c, budget, max_doc_len, seed=4))
    assert not np.array_equal(other.tokens, batches[0].tokens)


def test_validation_batches(tree):
    c = D.load_corpus("all", tree)
    vb = D.val_batches(c, 300, 128, n_batches=3)
    assert len(vb) == 3
    for b in vb:
        _check_batch(c, b, 300, 128)
    assert [b.tokens.tolist() for b in vb] == [b.tokens.tolist() for b in D.val_batches(c, 300, 128, 3)]
    small = D.val_batches(c, 10 ** 7, 128, n_batches=2)          # less than one batch: one short one
    assert len(small) == 1 and small[0].n_tokens == c.n_tokens


# ------------------------------------------------------------------ runs, schedule, verdict

def test_parse_runs():
    runs = parse_runs("bf16,fp8,fp8_mixed,fp8_tensorwise,bf16_seed1,torch")
    assert [r.name for r in runs] == ["bf16", "fp8", "fp8_mixed", "fp8_tensorwise", "bf16_seed1", "torch"]
    assert runs[4].attention == "flamia:bf16" and runs[4].seed_offset == 1
    assert runs[3].leaky and not runs[1].leaky and runs[5].attention == "torch"
    assert parse_runs("cudnn")[0].attention == "cudnn"
    with pytest.raises(ValueError, match="CUDA"):     # before any training, with the reason
        check_runs_can_run(parse_runs("bf16,cudnn"), torch.device("cpu"))
    check_runs_can_run(parse_runs("bf16,torch"), torch.device("cpu"))
    with pytest.raises(ValueError):
        parse_runs("fp7")
    with pytest.raises(ValueError):
        parse_runs("fp8,fp8")


def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) < 1.2e-4 and lr_at(100, cfg) == pytest.approx(1e-4)
    assert all(lr_at(i, cfg) >= lr_at(i + 1, cfg) for i in range(10, 100))


def _fake(name, attention, val_own, val_exact, train=None, leaky=False, status="ok", recipe=None):
    train = train or [3.0 - 0.01 * i for i in range(50)]
    return {"name": name, "attention": attention, "recipe": recipe, "leaky": leaky,
            "train_loss": train, "step": list(range(1, len(train) + 1)), "status": status,
            "nan_step": None if status == "ok" else len(train), "eval_step": [50],
            "val_loss_own": [val_own], "val_loss_exact": [val_exact], "tokens_per_s": 1000.0}


def test_verdict_rules():
    results = {"settings": {"warmup": 5, "steps": 50}, "runs": ["bf16", "fp8", "bad", "leak", "bf16_seed1"],
               "results": {
                   "bf16": _fake("bf16", "flamia:bf16", 2.000, 2.000, recipe="bf16"),
                   "bf16_seed1": _fake("bf16_seed1", "flamia:bf16", 2.010, 2.010, recipe="bf16"),
                   "fp8": _fake("fp8", "flamia:fp8", 2.020, 2.015, recipe="fp8"),
                   "bad": _fake("bad", "flamia:fp8_mixed", 2.10, 2.09, recipe="fp8_mixed"),
                   "leak": _fake("leak", "flamia:fp8_tensorwise", 1.95, 2.05, leaky=True,
                                 recipe="fp8_tensorwise"),
               }}
    v = report.verdict(results)
    assert v["reference"] == "bf16" and v["seed_runs"] == ["bf16_seed1"]
    assert v["seed_spread"] == pytest.approx(0.01) and v["tolerance"] == pytest.approx(0.02)
    r = v["runs"]
    assert r["fp8"]["pass"] and r["fp8"]["quality_ok"] and not r["fp8"]["leak_exploited"]
    assert not r["bad"]["quality_ok"] and not r["bad"]["pass"]
    assert r["leak"]["leak_exploited"] and r["leak"]["role"] == "leaky control"
    assert not v["pass"]                                            # "bad" fails the check
    text = report.table(results, v)
    assert "control: leak DETECTED" in text and "FAIL" in text
    # another exact bf16 attention, same seed: its distance to the reference is noise too
    results["runs"].append("torch")
    results["results"]["torch"] = _fake("torch", "torch", 2.10, 2.10)
    v = report.verdict(results)
    assert v["exact_bf16_runs"] == ["torch"] and v["exact_bf16_spread"] == pytest.approx(0.10)
    assert v["seed_spread"] == pytest.approx(0.01) and v["tolerance"] == pytest.approx(0.10)
    assert v["runs"]["torch"]["role"] == "exact bf16" and v["runs"]["bad"]["quality_ok"]


def test_verdict_nan_and_spike():
    ref_train = [3.0 - 0.01 * i for i in range(50)]
    spiky = list(ref_train)
    spiky[30] = 5.0
    results = {"settings": {"warmup": 5, "steps": 50}, "runs": ["bf16", "fp8", "nan"],
               "results": {
                   "bf16": _fake("bf16", "flamia:bf16", 2.0, 2.0, train=ref_train, recipe="bf16"),
                   "fp8": _fake("fp8", "flamia:fp8", 2.0, 2.0, train=spiky, recipe="fp8"),
                   "nan": _fake("nan", "flamia:fp8", float("nan"), float("nan"),
                                train=ref_train[:10] + [float("nan")], status="nan", recipe="fp8"),
               }}
    v = report.verdict(results)
    assert v["runs"]["fp8"]["stability"]["spikes"] == 1 and not v["runs"]["fp8"]["pass"]
    assert v["runs"]["nan"]["stability"]["summary"].startswith("NaN") and not v["runs"]["nan"]["pass"]
    results["results"].pop("nan")
    results["runs"].remove("nan")
    results["results"]["fp8"]["train_loss"] = list(ref_train)
    assert report.verdict(results)["pass"]
    results["skipped"] = ["bf16_seed1"]                             # a run the time limit cut
    v = report.verdict(results)
    assert not v["pass"] and "skipped (time limit): bf16_seed1" in report.table(results, v)


def test_speed_only_from_the_interleaved_timing():
    """A first run's own median includes one-time work (issue 30: fp8 '18.5x' faster than bf16
    where the interleaved timing said 0.96x): the table's speeds come from that timing only."""
    results = {"settings": {"warmup": 5, "steps": 50}, "runs": ["bf16", "fp8", "leak"],
               "results": {
                   "bf16": _fake("bf16", "flamia:bf16", 2.0, 2.0, recipe="bf16"),
                   "fp8": _fake("fp8", "flamia:fp8", 2.0, 2.0, recipe="fp8"),
                   "leak": _fake("leak", "flamia:fp8_tensorwise", 2.0, 2.0, leaky=True,
                                 recipe="fp8_tensorwise"),
               }}
    results["results"]["bf16"]["tokens_per_s"] = 138.0          # paid the warm-up
    results["results"]["fp8"]["tokens_per_s"] = 2549.0
    results["step_timing"] = {"rounds": 5, "batches": 8, "fastest_bf16": "flamia:bf16",
                              "attentions": {
                                  "flamia:bf16": {"run": "bf16", "median_s": 0.20, "tokens_per_s": 2560.0},
                                  "flamia:fp8": {"run": "fp8", "median_s": 0.25, "tokens_per_s": 2048.0}}}
    v = report.verdict(results)
    r = v["runs"]
    assert r["fp8"]["speedup_vs_ref"] == pytest.approx(0.8) and r["bf16"]["speedup_vs_ref"] == 1.0
    assert r["leak"]["speedup_vs_ref"] is None and r["fp8"]["tokens_per_s"] == 2549.0
    text = report.table(results, v)
    assert "18.5" not in text and "0.800x" in text
    assert "| 2,048 | 0.800x |" in text and "1,000 † | n/a |" in text
    results["step_timing"] = None                                  # --time-rounds 0
    v = report.verdict(results)
    assert all(p["speedup_vs_ref"] is None for p in v["runs"].values())
    text = report.table(results, v)
    assert "138 † | n/a |" in text and "no speed comparison" in text


# ------------------------------------------------------------------ tiny end to end

@pytest.mark.usefixtures("reference_only")
def test_tiny_train_check_end_to_end(tmp_path, capsys):
    pytest.importorskip("transformers")
    from flamia.train import main

    out = tmp_path / "out"
    rc = main(["--tiny", "--steps", "4", "--runs", "bf16,fp8_tensorwise,bf16_seed1",
               "--eval-every", "3", "--leaky-steps", "2", "--max-files", "120", "--tokens-per-step", "256",
               "--max-doc-len", "64", "--val-batches", "1", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "step     4/4" in printed and "estimated" in printed and "| run |" in printed
    res = json.loads((out / "train_check.json").read_text())
    assert res["runs"] == ["bf16", "fp8_tensorwise", "bf16_seed1"]
    assert res["settings"]["model"]["hidden"] == 64 and res["settings"]["tokens_per_step"] == 256
    assert res["settings"]["eval_points"] == [2, 3, 4]
    for name, r in res["results"].items():
        n = 2 if name == "fp8_tensorwise" else 4                  # the capped leaky control
        assert r["status"] == "ok" and len(r["train_loss"]) == n
        assert all(math.isfinite(x) for x in r["train_loss"])
        assert r["eval_step"] == ([2] if n == 2 else [2, 3, 4])
        assert len(r["val_loss_exact"]) == len(r["val_loss_own"]) == len(r["eval_step"])
        assert r["tokens_per_s"] > 0
    # same init seed and data: bf16 and the control start from the same loss; the seed run does not
    r = res["results"]
    assert r["bf16"]["train_loss"][0] == pytest.approx(r["fp8_tensorwise"]["train_loss"][0], abs=0.02)
    assert r["bf16"]["train_loss"][0] != r["bf16_seed1"]["train_loss"][0]
    v = res["verdict"]
    assert v["reference"] == "bf16" and v["seed_runs"] == ["bf16_seed1"]
    assert v["runs"]["fp8_tensorwise"]["at_step"] == 2 and v["runs"]["bf16"]["at_step"] == 4
    assert v["runs"]["fp8_tensorwise"]["ref_val_exact_at_step"] == r["bf16"]["val_loss_exact"][0]
    md = (out / "train_check.md").read_text()
    assert md.startswith("# flamia train-check")
    # interleaved step timing (tiny: 1 round x 2 batches) of the one non-leaky attention
    t = res["step_timing"]
    assert list(t["attentions"]) == ["flamia:bf16"] and t["fastest_bf16"] == "flamia:bf16"
    assert t["attentions"]["flamia:bf16"]["n"] == 2 and t["attentions"]["flamia:bf16"]["run"] == "bf16"
    assert v["speed_vs_fastest_bf16"] == {"flamia:bf16": 1.0}
    assert "timed interleaved" in md and "[timing]" in printed
    try:
        import matplotlib  # noqa: F401
        assert (out / "train_check.png").stat().st_size > 10_000
    except ImportError:
        assert not (out / "train_check.png").exists()


@pytest.mark.usefixtures("reference_only")
def test_a_failing_run_is_reported_and_the_others_go_on(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from flamia.train import loop, main

    real = loop.train_run

    def train_run(spec, *args, **kwargs):
        if spec.name == "fp8":
            raise RuntimeError("broken attention")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(loop, "train_run", train_run)
    out = tmp_path / "out"
    rc = main(["--tiny", "--steps", "2", "--runs", "bf16,fp8,bf16_seed1", "--max-files", "60",
               "--tokens-per-step", "128", "--max-doc-len", "64", "--val-batches", "1",
               "--time-steps", "1", "--out", str(out)])
    assert rc == 0   # (--tiny)
    res = json.loads((out / "train_check.json").read_text())
    assert set(res["results"]) == {"bf16", "bf16_seed1"}
    assert res["errors"] == {"fp8": "RuntimeError: broken attention"}
    assert not res["verdict"]["pass"] and res["verdict"]["skipped"] == ["fp8"]
    assert list(res["step_timing"]["attentions"]) == ["flamia:bf16"]     # fp8 left out
    assert "FAILED run fp8: RuntimeError: broken attention" in (out / "train_check.md").read_text()


def test_run_fa4_is_an_exact_bf16_baseline(monkeypatch):
    import sys

    from flamia.train.report import EXACT_BF16

    runs = parse_runs("bf16,fa4,fa4_seed1")
    assert [r.attention for r in runs] == ["flamia:bf16", "fa4", "fa4"] and not runs[1].leaky
    assert runs[2].seed_offset == 1 and "fa4" in EXACT_BF16
    with pytest.raises(ValueError, match="needs a CUDA device"):
        check_runs_can_run(runs, torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "flash_attn", None)           # not installed
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    with pytest.raises(ValueError, match="run 'fa4' cannot run here: flash-attn-4 .* not importable"):
        check_runs_can_run(runs, torch.device("cuda"))


@pytest.mark.usefixtures("reference_only")
def test_run_fa4_trains_and_takes_part_in_the_step_timing(tmp_path, monkeypatch):
    """`--runs bf16,fa4` with a CPU stand-in for FA4's varlen call: trained, registered under its
    own name, timed interleaved with flamia bf16 and counted among the exact bf16 attentions."""
    pytest.importorskip("transformers")
    from flamia.bench import baselines
    from flamia.integrations.hf import sdpa_per_document
    from flamia.train import loop, main

    used = []

    def fa4_stand_in(q, k, v, cu_seqlens, max_seqlen, causal=True, softmax_scale=None):
        used.append(k.shape[1] < q.shape[1])                          # GQA passed through
        return sdpa_per_document(q, k, v, cu_seqlens, causal, softmax_scale)

    monkeypatch.setattr(baselines, "fa4_varlen", fa4_stand_in)
    monkeypatch.setattr(loop, "check_runs_can_run", lambda runs, device: None)
    out = tmp_path / "out"
    rc = main(["--tiny", "--steps", "2", "--runs", "bf16,fa4", "--max-files", "60",
               "--tokens-per-step", "128", "--max-doc-len", "64", "--val-batches", "1",
               "--time-steps", "1", "--out", str(out)])
    assert rc == 0 and used
    res = json.loads((out / "train_check.json").read_text())
    assert res["results"]["fa4"]["status"] == "ok"
    assert res["results"]["fa4"]["hf_attention"] == "flamia_baseline_fa4"
    t = res["step_timing"]
    assert list(t["attentions"]) == ["flamia:bf16", "fa4"]
    assert t["fastest_bf16"] in ("flamia:bf16", "fa4")
