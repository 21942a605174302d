"""flamia.ops.launch: a compiled kernel is reused only for calls Triton itself would specialize
the same way (tests/_launch_check.py, run outside the interpreter), and launch_kernel sends
every call it cannot key, or made under a launch hook, through Triton's path."""
from __future__ import annotations

import pytest

from tests._sm90 import compile_report

SCRIPT = ("import runpy, sys; sys.argv[0] = '_launch_check.py'; "
          "runpy.run_path('tests/_launch_check.py', run_name='__main__')")


@pytest.fixture(scope="module")
def report():
    return compile_report(SCRIPT)


def test_keys_no_coarser_than_triton(report):
    """Every launch of the fp8 and bf16 kernel paths and ~1,700 variants: equal keys, equal
    Triton specializations (the script asserts it per call; here: that it covered them)."""
    assert report["kernels"] == sorted([
        "_attn_bwd_sm90_fp8_kernel", "_attn_bwd_sm90_kernel", "_attn_fwd_gluon_persistent_kernel",
        "_attn_fwd_kernel", "_bwd_postprocess", "_bwd_postprocess_fp8", "_bwd_preprocess",
        "_bwd_preprocess_fp8", "_kvblock_cols_kernel", "_quantize_kv_kernel",
        "_quantize_q_kernel"])
    assert report["checked"] >= 1000
    assert report["keys"] < report["checked"] / 2     # variants do share keys


def test_dispatch(report):
    d = report["dispatch"]
    # first call, same key, a T in the same class, another class, an unaligned q, a profiler's
    # hook, after the hook, a replaced JITFunction.run that does not return launchable kernels,
    # an unhashable constexpr twice
    assert d["route"] == ["triton", "compiled", "compiled", "triton", "triton", "triton",
                          "compiled", "triton", "triton", "triton"]
    # grid (2, 1, 1), the stream, the kernel's function and metadata, no launch metadata or
    # hooks, then every parameter of _quantize_q_kernel in order, constexprs included
    assert d["compiled_head"] == ["2", "1", "1", "7", "function", "metadata", "None", "None",
                                  "None"]
    assert d["compiled_tail"] == ["0.1", "128", "64", "True"]
    assert d["n_values"] == 9 + 12
