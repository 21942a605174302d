"""The persistent Gluon fp8 forward (flamia/ops/forward_gluon.py) on a CPU-only machine.

Gluon kernels cannot run under the Triton interpreter, and conftest.py sets TRITON_INTERPRET=1
for the whole suite on CPU machines, so the sm_90a compile runs in a subprocess without it (the
real JIT path, the bundled ptxas; benchmarks/tools/compile.py). Checked: no register spills, no
wgmma serialization (ptxas C7515), no local memory, the producer warp at 24 registers and the
consumer at >= 232, two CTAs per SM by shared memory. Numerics are checked on the H200
(tests/gpu/test_forward_gpu.py).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from _sm90 import compile_report, gluon_available

_SCRIPT = r"""
import json, sys, torch
from benchmarks.tools.compile import build, cu_seqlens, fake_qkv, report
from benchmarks.tools.sass import (local_memory_ops, loop_paths, main_loop, parse, predicated,
                                   sass_of)
from flamia.ops.config import PAIR_FWD_CONFIG, PersistentFwdConfig
from flamia.ops.forward import attention_forward
out = []
for D, causal, pair in json.loads(sys.argv[1]):
    qkv = fake_qkv(4096, 8, 2, D)
    built = build(attention_forward, qkv, cu_seqlens([4096]), 4096, causal, None,
                  torch.bfloat16, config=PAIR_FWD_CONFIG if pair else PersistentFwdConfig())
    kern = built["_attn_fwd_gluon_persistent_kernel"]
    u = report(kern)
    sass = sass_of(kern)
    loop = main_loop(parse(sass))
    plain = min(loop_paths(loop, predicated(sass)), key=len)
    u["plain_tile_bars"] = sum(op.startswith("BAR") for _, op, _ in plain)
    u["loop_local"] = local_memory_ops(loop)
    out.append(u | {"D": D, "causal": causal, "pair": pair})
print("REPORT" + json.dumps(out))
"""

pytestmark = pytest.mark.skipif(not gluon_available(), reason="triton.experimental.gluon missing")


def test_persistent_forward_compiles_clean():
    jobs = [(128, True, False), (128, False, False), (64, True, False), (128, True, True),
            (128, False, True)]
    for u in compile_report(_SCRIPT, json.dumps(jobs)):
        tag = f"D={u['D']} causal={u['causal']} pair={u['pair']}"
        if u["pair"]:
            _check_pair(u, tag)
            continue
        assert u["regs"] is not None and u["regs"] <= 128, tag     # 2 CTAs x 8 warps per SM
        assert (u["spill_stores"] or 0) == 0, f"{tag}: {u['spill_stores']} B spilled"
        assert not u["wgmma_serialized"], f"{tag}: ptxas serialized the wgmma (C7515)"
        assert u["local"] == 0, f"{tag}: local memory in the PTX"
        assert u["wgmma"] > 0 and u["wait"] > 0 and u["tma"] > 0 and u["mbar_wait"] > 0, tag
        assert 24 in u["partition_regs"] and max(u["partition_regs"]) >= 232, tag
        # two Q buffers + two ring stages: two CTAs fit in 228 KB per SM
        assert 2 * u["shared"] <= 227 * 1024, tag
        # one bar.sync per plain tile: the stage release (arrive_synced; a plain mbarrier.arrive
        # brings a second before the next tile's wait)
        assert u["plain_tile_bars"] == 1, f"{tag}: {u['plain_tile_bars']} bar.syncs per tile"


def _check_pair(u, tag):
    """The GQA pair (config.PAIR_FWD_CONFIG): 384 threads at the launch's 168 registers, the
    consumers at 240 and the producer at 24 by setmaxnreg, one CTA per SM by shared memory
    (four Q buffers, two O tiles, the ring). ptxas spills one 8-byte value at the causal build,
    outside the tile loop: nothing spilled may be touched per tile."""
    assert u["regs"] is not None and u["regs"] <= 168, tag
    assert (u["spill_stores"] or 0) <= 8, f"{tag}: {u['spill_stores']} B spilled"
    assert u["loop_local"] == 0, f"{tag}: {u['loop_local']} local memory ops in the tile loop"
    assert not u["wgmma_serialized"], f"{tag}: ptxas serialized the wgmma (C7515)"
    assert 24 in u["partition_regs"] and 240 in u["partition_regs"], tag
    assert 2 * u["shared"] > 227 * 1024 >= u["shared"], tag
    # per plain tile: the stage release, then the two turn barriers (sync, arrive)
    assert u["plain_tile_bars"] == 3, f"{tag}: {u['plain_tile_bars']} barriers per tile"


def test_launcher_checks():
    """bf16 is refused (the Triton kernel runs it), and so are fp8 operands without V's K-major
    copy."""
    from flamia.inputs import make_qkv
    from flamia.ops.config import PersistentFwdConfig
    from flamia.ops.forward import attention_forward
    from flamia.ops.quantize import quantize_qkv
    q, k, v, cu = make_qkv((40, 23), 4, 2, 64)
    with pytest.raises(NotImplementedError):
        attention_forward(quantize_qkv(q, k, v, cu, "bf16", True), cu, 40, True, None,
                          torch.bfloat16, config=PersistentFwdConfig())
    with pytest.raises(ValueError, match="K-major copy"):
        attention_forward(dataclasses.replace(quantize_qkv(q, k, v, cu, "fp8", True), vt8=None),
                          cu, 40, True, None, torch.bfloat16, config=PersistentFwdConfig())
