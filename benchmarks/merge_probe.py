"""Does ptxas pack e4m3 pairs into a wgmma A operand with F2FP.MERGE_C (two instructions per
register) or with two F2FP and a PRMT (three)? A minimal Gluon kernel, compiled for sm_90a on
the CPU (nothing runs): per loop iteration, an fp32 (64, 128) tile from global memory, exp2,
converted to e4m3 in wgmma key order (flamia.ops.kmajor) and fed from registers to an async
m64n64 wgmma against a V^T tile in shared memory.

    python benchmarks/merge_probe.py                 # the variants below, one line each

Variants: --ws (a 1-warp idle worker partition, setmaxnreg), --late (other work and a store
between the wgmma's issue and its wait, the A registers kept alive to the wait), --two (a second
conversion and wgmma in flight), --no-key-order (the plain layout conversion, whose byte
shuffles need PRMTs anyway). Prints the kernel's PRMT and F2FP counts and how many F2FPs merge
into another's register (MERGE_C with a register C, not RZ).

benchmarks/NOTES.md (twenty-ninth session): every variant merges except join=1, which is what
the fp8 backward does (X^T and Y^T converted after its plain / masked branches join) and why it
never merges. The Gluon D=128 forward converts P to e4m3 words inside each branch
(forward_gluon._e4m3_words) and the Triton D=64 forward waits for V before P's conversion
(1257415): both merge.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.pop("TRITON_INTERPRET", None)     # compile for sm_90a, not the interpreter

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    warpgroup_mma, warpgroup_mma_wait,
)

from benchmarks.tools.compile import compile_for  # noqa: E402
from benchmarks.tools.sass import sass_of  # noqa: E402
from flamia.ops.gluon_common import wgmma_layout  # noqa: E402
from flamia.ops.kmajor import mma_key_order_gluon  # noqa: E402


@gluon.jit
def _hold(x):
    """x's registers stay allocated up to here (an empty asm statement)."""
    gl.inline_asm_elementwise("", "=r,r", [x], dtype=gl.int8, is_pure=False, pack=4)


@gluon.jit
def _to_a(p, o_layout: gl.constexpr, KEY_ORDER: gl.constexpr):
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    if KEY_ORDER:
        return gl.convert_layout(mma_key_order_gluon(p.to(gl.float8e4nv)), a_layout)
    return gl.convert_layout(p.to(gl.float8e4nv), a_layout)


@gluon.jit
def _body(S, V, O, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
          KEY_ORDER: gl.constexpr, LATE: gl.constexpr, TWO: gl.constexpr,
          JOIN: gl.constexpr):
    s_layout: gl.constexpr = wgmma_layout(4, 1, BN, 32)
    o_layout: gl.constexpr = wgmma_layout(4, 1, D, 32)
    v_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    ld: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, BM, gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BN, gl.SliceLayout(0, s_layout))
    vr = gl.arange(0, D, gl.SliceLayout(1, ld))
    vc = gl.arange(0, BN, gl.SliceLayout(0, ld))
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [D, BN], v_sl,
                                       gl.load(V + vr[:, None] * BN + vc[None, :]))
    acc = gl.zeros([BM, D], gl.float32, o_layout)
    acc2 = gl.zeros([BM, D], gl.float32, o_layout)
    for it in range(gl.load(O).to(gl.int32)):
        s = gl.load(S + it * BM * BN + rows[:, None] * BN + cols[None, :])
        if JOIN > 0:      # p from either branch of a runtime if / else
            if it > 3:
                p = gl.exp2(s)
            else:
                p = gl.exp2(s * 0.5) + 1.0
            if JOIN == 2:     # one arithmetic op after the join
                p = p * 1.0000001
        else:
            p = gl.exp2(s)
        acc = acc * 0.5
        a = _to_a(p, o_layout, KEY_ORDER)
        acc = warpgroup_mma(a, v_smem.permute((1, 0)), acc, is_async=True)
        if TWO:
            a2 = _to_a(p * s, o_layout, KEY_ORDER)
            acc2 = warpgroup_mma(a2, v_smem.permute((1, 0)), acc2, is_async=True)
            acc, acc2 = warpgroup_mma_wait(0, deps=[acc, acc2])
        if LATE:
            p2 = gl.exp2(gl.load(S + (it + 1) * BM * BN + rows[:, None] * BN + cols[None, :]))
            gl.store(S + rows[:, None] * BN + cols[None, :], p2)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _hold(a)
    orow = gl.arange(0, BM, gl.SliceLayout(1, o_layout))
    ocol = gl.arange(0, D, gl.SliceLayout(0, o_layout))
    gl.store(O + orow[:, None] * D + ocol[None, :], acc + acc2)


@gluon.jit
def _idle(S):
    pass


@gluon.jit
def probe_kernel(S, V, O, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                 WS: gl.constexpr, KEY_ORDER: gl.constexpr, LATE: gl.constexpr,
                 TWO: gl.constexpr, JOIN: gl.constexpr):
    if WS:
        gl.warp_specialize([(_body, (S, V, O, BM, BN, D, KEY_ORDER, LATE, TWO, JOIN)),
                            (_idle, (S,))], [1], [24])
    else:
        _body(S, V, O, BM, BN, D, KEY_ORDER, LATE, TWO, JOIN)


def counts(ws: bool, key_order: bool, late: bool, two: bool, join: int = 0) -> dict:
    S = torch.empty(64 * 128, dtype=torch.float32)
    V = torch.empty(64 * 128, dtype=torch.float8_e4m3fn)
    O = torch.empty(64 * 64, dtype=torch.float32)
    k = compile_for(probe_kernel, (S, V, O, 64, 128, 64, ws, key_order, late, two, join),
                    dict(num_warps=4))
    lines = sass_of(k).split("\n")
    merged = sum(1 for x in lines if "MERGE_C" in x and not x.split("MERGE_C")[1].split(";")[0]
                 .rstrip().endswith("RZ"))
    return {"PRMT": sum("PRMT" in x for x in lines), "F2FP": sum("F2FP" in x for x in lines),
            "merged": merged}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.parse_args()
    for ws, ko, late, two in itertools.product((False, True), (True, False), (False, True),
                                               (False, True)):
        c = counts(ws, ko, late, two)
        print(f"ws={ws:d} key_order={ko:d} late={late:d} two={two:d}: {c}", flush=True)
    for join in (1, 2):
        print(f"ws=1 key_order=1 join={join}: {counts(True, True, True, False, join)}", flush=True)


if __name__ == "__main__":
    main()
