"""CPU spike (no GPU): a 64 x 128 fp32 tile's Hadamard transform in registers, in Gluon, as the
persistent forward would need it to quantize Q itself (benchmarks/NOTES.md, "Next", item 1).

    python benchmarks/fwht_gluon_spike.py        # builds for sm_90a, prints resources and SASS

The layout gives each thread 2 rows x 32 contiguous columns (4 lanes per row): stages of
distance 1..16 are in-thread butterflies (reshape / split / join: register renaming), the
stages of distance 32 and 64 one butterfly shuffle each (shfl.sync.bfly with lane xor 1, 2)
and one FMA: y = x * (+-1) + partner, which rounds as partner +- x does. The stage order and
each stage's (a + b, a - b) are numerics.fwht's, so the result is that function's bit for bit by
construction (fma(x, +-1, p) rounds p +- x once); not yet run on a GPU. Nothing runs here: the
build says what it costs (no shared memory, instructions per thread).
"""
from __future__ import annotations

import os
import re
import sys
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from benchmarks.tools.compile import compile_for, resource_usage  # noqa: E402
from benchmarks.tools.sass import sass_of  # noqa: E402


@gluon.jit
def _butterfly_in_thread(x, M: gl.constexpr, HI: gl.constexpr, LO: gl.constexpr):
    """Columns c and c + LO of every 2 LO-column group -> (a + b, a - b), both in the thread."""
    y = gl.permute(gl.reshape(x, [M, HI, 2, LO]), (0, 1, 3, 2))
    a, b = gl.split(y)
    y = gl.permute(gl.join(a + b, a - b), (0, 1, 3, 2))
    return gl.reshape(y, [M, HI * 2 * LO])


@gluon.jit
def _butterfly_lanes(x, cols, H: gl.constexpr, XOR: gl.constexpr):
    """Columns c and c + H held by lanes l and l ^ XOR -> (a + b, a - b): one shuffle, one FMA."""
    partner = gl.inline_asm_elementwise(f"shfl.sync.bfly.b32 $0, $1, {XOR}, 0x1f, -1;", "=r,r",
                                        [x], dtype=gl.float32, is_pure=True, pack=1)
    sign = gl.expand_dims(gl.where((cols & H) != 0, -1.0, 1.0), 0)
    return gl.fma(x, sign, partner)


@gluon.jit
def _tile(X, M: gl.constexpr, D: gl.constexpr, lay: gl.constexpr):
    """(X's (M, D) row-major tile as fp32 in `lay`, its offsets, its column indices)."""
    r = gl.arange(0, M, layout=gl.SliceLayout(1, lay))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, lay))
    offs = gl.expand_dims(r, 1) * D + gl.expand_dims(c, 0)
    return gl.load(X + offs).to(gl.float32), offs, c


@gluon.jit
def fwht_tile_kernel(X, Y, M: gl.constexpr, D: gl.constexpr):
    """Y = X @ H_D (X bf16 (M, D) row-major, Y fp32), D = 128, 4 warps."""
    x, offs, c = _tile(X, M, D, gl.BlockedLayout([2, 32], [8, 4], [4, 1], [1, 0]))
    x = _butterfly_in_thread(x, M, D // 2, 1)
    x = _butterfly_in_thread(x, M, D // 4, 2)
    x = _butterfly_in_thread(x, M, D // 8, 4)
    x = _butterfly_in_thread(x, M, D // 16, 8)
    x = _butterfly_in_thread(x, M, D // 32, 16)
    x = _butterfly_lanes(x, c, 32, 1)
    x = _butterfly_lanes(x, c, 64, 2)
    gl.store(Y + offs, x)


@gluon.jit
def fwht_a_operand_kernel(X, Y, M: gl.constexpr, D: gl.constexpr):
    """The same transform in the fp8 wgmma A operand layout (m64 k32, k_width 4: per 32 columns a
    quad's lane c holds 4c..4c+3 and 16 + 4c..16 + 4c + 3), cast to e4m3 in place: what the
    QK^T wgmma would take from registers. Columns' bits 0-1, 4-6 are in the thread, 2-3 across
    the quad, so distances 4 and 8 are the shuffles. (The convert_layout calls are no-ops: the
    in-thread stages return the same mapping as a linear layout.)"""
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 128, 32])
    lay: gl.constexpr = gl.DotOperandLayout(0, acc, 4)
    x, offs, c = _tile(X, M, D, lay)
    x = _butterfly_in_thread(x, M, D // 2, 1)
    x = _butterfly_in_thread(x, M, D // 4, 2)
    x = gl.convert_layout(x, lay)
    x = _butterfly_lanes(x, c, 4, 1)
    x = _butterfly_lanes(x, c, 8, 2)
    x = _butterfly_in_thread(x, M, D // 32, 16)
    x = _butterfly_in_thread(x, M, D // 64, 32)
    x = _butterfly_in_thread(x, M, D // 128, 64)
    x = gl.convert_layout(x, lay)
    gl.store(Y + offs, x.to(gl.float8e4nv))


def _report(kern):
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass_of(kern),
                     re.M)
    counts = Counter(op.split(".")[0] for op in ops)
    return f"{resource_usage(kern)}\n  {len(ops)} SASS per thread: {dict(counts.most_common(12))}"


def main():
    x = torch.empty(64, 128, dtype=torch.bfloat16)
    for kernel, out in ((fwht_tile_kernel, torch.float32),
                        (fwht_a_operand_kernel, torch.float8_e4m3fn)):
        kern = compile_for(kernel, (x, torch.empty(64, 128, dtype=out)),
                           dict(M=64, D=128, num_warps=4))
        print(kernel.__name__, _report(kern))


if __name__ == "__main__":
    main()
