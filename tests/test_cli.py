"""The `flamia` command line: every user error is one line naming the flag, exit status 2, no
traceback (issue 30); the demo's header names every recipe's path and what it skips."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

import flamia
from flamia import cli, demo
from flamia.recipes import RECIPES

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")

# (argv, text the one-line message must contain)
CASES = [
    pytest.param(["demo", "--device", "cuda"], "--device", marks=NO_CUDA, id="demo-cuda"),
    pytest.param(["audit", "--device", "cuda"], "--device", marks=NO_CUDA, id="audit-cuda"),
    pytest.param(["train-check", "--device", "cuda"], "--device", marks=NO_CUDA, id="train-cuda"),
    pytest.param(["train-check", "--runs", "cudnn"], "--runs", marks=NO_CUDA, id="train-cudnn-cpu"),
    pytest.param(["train-check", "--runs", "fa4"], "--runs", marks=NO_CUDA, id="train-fa4-cpu"),
    (["demo", "--device", "foo"], "--device"),
    (["demo", "--device", "cuda:x"], "--device"),
    (["demo", "--bogus"], "--bogus"),
    (["audit", "--head-dim", "96"], "--head-dim"),
    (["audit", "--lengths", "5", "-3"], "--lengths"),
    (["audit", "--lengths", "2", "1"], "--lengths"),
    (["audit", "--layout", "dense", "--lengths", "5", "6"], "--lengths"),
    (["audit", "--heads-q", "3"], "--heads-kv"),
    (["audit", "--heads-kv", "0"], "--heads-kv"),
    (["audit", "--recipes", "nope"], "--recipes"),
    (["audit", "--seed", "x"], "--seed"),
    (["train-check", "--runs", "bf16,nope"], "--runs"),
    (["train-check", "--runs", "bf16,bf16"], "--runs"),
    (["train-check", "--steps", "0"], "--steps"),
    (["train-check", "--lr", "-1"], "--lr"),
    (["train-check", "--max-doc-len", "1"], "--max-doc-len"),
    (["train-check", "--head-dim", "96"], "--head-dim"),
    (["train-check", "--tiny", "--kv-heads", "3"], "--kv-heads"),
    (["train-check", "--tiny", "--stdlib", "/nonexistent/flamia"], "--stdlib"),
    (["frob"], "unknown command"),
]


def _one_line_error(capsys, rc, flag):
    out, err = capsys.readouterr()
    assert rc == 2
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error" in lines[0] and flag in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("argv,flag", CASES)
def test_user_error_is_one_line(argv, flag, capsys):
    _one_line_error(capsys, cli.main(argv), flag)


def test_messages_say_what_is_allowed(capsys):
    line = _one_line_error(capsys, cli.main(["audit", "--head-dim", "96"]), "--head-dim")
    assert "64, 128, 256" in line
    line = _one_line_error(capsys, cli.main(["audit", "--lengths", "5", "-3"]), "--lengths")
    assert ">= 0" in line and "-3" in line
    line = _one_line_error(capsys, cli.main(["demo", "--device", "foo"]), "--device")
    assert "cpu, cuda or cuda:N" in line
    if not torch.cuda.is_available():
        line = _one_line_error(capsys, cli.main(["audit", "--device", "cuda"]), "--device")
        assert "no CUDA device" in line and "--device cpu" in line


def test_module_entry_points_exit_2(capsys):
    """python -m flamia.train and flamia.demo.main handle their usage errors themselves."""
    from flamia.train import main as train_main
    _one_line_error(capsys, train_main(["--steps", "-2"]), "--steps")
    _one_line_error(capsys, demo.main(["--device", "tpu"]), "--device")


def test_missing_optional_package_is_a_usage_error():
    with pytest.raises(cli.UsageError, match=r"needs the no_such_flamia_pkg package.*\.\[train\]"):
        cli.require_module("no_such_flamia_pkg", "flamia train-check", "train")


def test_too_small_corpus_is_a_usage_error(capsys):
    pytest.importorskip("transformers")
    rc = cli.main(["train-check", "--tiny", "--max-files", "2", "--out", "/nonexistent/never"])
    line = _one_line_error(capsys, rc, "--max-files")
    assert "fewer than one step" in line


def test_argparse_types():
    assert cli.positive_int("3") == 3
    assert cli.nonnegative_int("0") == 0
    for parse, bad in ((cli.positive_int, "0"), (cli.positive_int, "1.5"),
                       (cli.nonnegative_int, "-1"), (cli.positive_float, "nan"),
                       (cli.positive_float, "0"), (cli.device_type, "mps"),
                       (cli.device_type, "cpu:1")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    assert cli.device_type("CPU") == "cpu" and cli.device_type("auto") == "auto"
    assert cli.resolve_device("auto") in ("cpu", "cuda")


def test_subprocess_without_traceback():
    """The installed command's path: `python -m flamia` in a fresh interpreter."""
    p = subprocess.run([sys.executable, "-m", "flamia", "audit", "--lengths", "5", "-3"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert "Traceback" not in p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        "flamia audit: error: argument --lengths: must be an integer >= 0, got -3 "
        "(see flamia audit --help)"]


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["audit", "--help"])
    assert e.value.code == 0
    assert "--lengths" in capsys.readouterr().out


# ----------------------------------------------------------------------------- demo header

def test_recipe_path_names_every_recipe_and_why():
    paths = {name: demo.recipe_path("cpu", 64, name) for name in RECIPES}
    assert "emulated Blackwell" in paths["mxfp8"] and "emulated Blackwell" in paths["nvfp4_mixed"]
    assert "leaky control" in paths["fp8_tensorwise"]
    assert "reference-only spec" in paths["fp8_mixed"] and "reference-only spec" in paths["fp8_token"]
    for name in ("fp8", "bf16"):
        assert paths[name].startswith(("kernels", "reference")), paths[name]


def test_recipe_path_reference_on_cpu(reference_only):
    assert demo.recipe_path("cpu", 64, "fp8").endswith("FLAMIA_KERNELS=0")


def test_demo_header_lists_recipes_and_skips(monkeypatch, capsys):
    """The header (with the accuracy and audit sections stubbed out: the header is the test)."""
    monkeypatch.setattr(demo, "accuracy_table", lambda *a, **k: {})

    class Report:
        def __init__(self, leaky):
            self.passed = not leaky

        def __str__(self):
            return "audit stub"

    monkeypatch.setattr(demo._audit, "audit", lambda fn, **k: Report("tensorwise" in fn.__name__))
    assert demo.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    header = out.split("\n1. Accuracy")[0]
    for name in RECIPES:
        assert f"\n  {name} " in header, name
    assert "skipped: 3. speed (no CUDA GPU" in header
    assert "3. Speed: skipped (no CUDA GPU" in out
    assert demo.main(["--device", "cpu", "--no-speed"]) == 0
    assert "skipped: 3. speed (--no-speed)" in capsys.readouterr().out


def test_train_check_default_out_is_ignored_by_git():
    from pathlib import Path

    from flamia.train import DEFAULT_OUT, build_parser
    assert build_parser().parse_args([]).out == DEFAULT_OUT == "out/train_check"
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    try:
        p = subprocess.run(["git", "check-ignore", "-q", f"{DEFAULT_OUT}/train_check.json"],
                           cwd=root, capture_output=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("no git binary")
    assert p.returncode == 0, "the default --out of train-check is not ignored by git"
