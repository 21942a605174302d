"""What one call of the kernel path issues on the host (benchmarks/host_cpu.py, the sm_90 code
paths on a CPU with the launches stubbed after Triton's binder): the launches per forward and
backward, no torch kernels and no device sync in a steady-state call, and the per-cu_seqlens
metadata built once. README ("Launches per call") states these counts."""
from __future__ import annotations

import pytest

from tests._sm90 import compile_report

SCRIPT = ("import runpy, sys; sys.argv[0] = 'host_cpu.py'; "
          "runpy.run_path('benchmarks/host_cpu.py', run_name='__main__')")

QUANTIZE = ["_quantize_q_kernel", "_quantize_kv_kernel", "_kvblock_cols_kernel"]
FP8_BACKWARD = ["_bwd_preprocess_fp8", "_attn_bwd_sm90_fp8_kernel",
                "_bwd_postprocess_fp8"]
EXPECTED = {
    "fp8 D=128": (QUANTIZE + ["_attn_fwd_gluon_persistent_kernel"], [], FP8_BACKWARD, []),
    "fp8 D=64": (QUANTIZE + ["_attn_fwd_kernel"], [], FP8_BACKWARD, []),
    # the bf16 backward zeroes its fp32 dQ buffer with a torch fill
    "bf16 D=128": (["_attn_fwd_kernel"], [],
                   ["_bwd_preprocess", "_attn_bwd_sm90_kernel", "_bwd_postprocess"],
                   ["zeros.default"]),
}


@pytest.fixture(scope="module")
def report():
    return compile_report(SCRIPT, "--json")


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_launches_per_call(report, case):
    fwd_launches, fwd_torch, bwd_launches, bwd_torch = EXPECTED[case]
    r = report[case]
    assert r["forward"]["launches"] == fwd_launches
    assert r["forward"]["torch_kernels"] == fwd_torch
    assert r["backward"]["launches"] == bwd_launches
    assert r["backward"]["torch_kernels"] == bwd_torch


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_no_sync_and_metadata_once(report, case):
    r = report[case]
    assert r["forward"]["syncs"] == [] and r["backward"]["syncs"] == []
    assert r["memo_entries"] > 0
    assert r["memo_entries_after_second_call"] == r["memo_entries"]
    assert r["first_call_extra_torch_kernels"] > 0     # the metadata really is built on call 1


def test_descriptor_templates():
    """descriptor_2d builds one TensorDescriptor per (rows, cols, stride, box, dtype) and copies
    it with the new base: the copy has the given tensor and the same fields, the cache keeps no
    tensor alive, and a base off 16-byte alignment is refused as on the first build."""
    import gc
    import weakref

    import torch

    from flamia.ops.gluon_common import HAVE_GLUON, descriptor_2d
    if not HAVE_GLUON:
        pytest.skip("triton.experimental.gluon is not available")
    a = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    b = torch.ones(64, 256, dtype=torch.float8_e4m3fn)
    da = descriptor_2d(a, 64, 256, 256, [64, 128])
    db = descriptor_2d(b, 64, 256, 256, [64, 128])
    assert da.base is a and db.base is b
    assert {k: v for k, v in vars(da).items() if k != "base"} == \
        {k: v for k, v in vars(db).items() if k != "base"}
    ref = weakref.ref(a)
    del a, da
    gc.collect()
    assert ref() is None
    with pytest.raises(ValueError, match="16-byte aligned"):
        descriptor_2d(b.view(-1)[1:16385], 64, 256, 256, [64, 128])
