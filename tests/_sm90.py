"""Compile Gluon kernels for sm_90a from CPU tests, without a GPU.

conftest.py turns on TRITON_INTERPRET on CPU-only machines and Gluon does not run in the
interpreter, so the compile happens in a subprocess without it: nothing executes, ptxas -v gives
registers and spills. A compile script prints its result as one line `REPORT<json>`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gluon_available() -> bool:
    """triton.experimental.gluon with the Hopper ops, and the ptxas bundled with triton."""
    try:
        import triton
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except Exception:   # noqa: BLE001
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def compile_report(script: str, *args: str, timeout: int = 600):
    """Run `script` (python -c) with `args` outside the interpreter; its REPORT line, parsed.
    Skips the calling test where Gluon or ptxas is missing."""
    if not gluon_available():
        pytest.skip("triton.experimental.gluon (Hopper) or the bundled ptxas is not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("REPORT")),
                None)
    assert proc.returncode == 0 and line, \
        f"sm_90a compile failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(line[len("REPORT"):])
