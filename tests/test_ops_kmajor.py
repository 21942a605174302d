"""K-major copies (flamia/ops/kmajor.py) under the Triton interpreter: layout and bytes."""
from __future__ import annotations

import pytest
import torch

from flamia.inputs import cu_seqlens_from_lengths
from flamia.ops import interpreting
import triton
import triton.language as tl

from flamia.ops.kmajor import (ORDER_MMA_A, ORDER_PAIRS, ORDER_TOKEN, check_copy, copy_columns,
                               kmajor_layout, mma_key_order_host, mma_order16_host,
                               pair_order16_host, padded_columns)

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU tests under the Triton interpreter")


@triton.jit
def _copy_kernel(src, dst, tok_of_col, Tp, stride_t, D: tl.constexpr, BLOCK_C: tl.constexpr,
                 ORDER: tl.constexpr):
    copy_columns(src, dst, tok_of_col, Tp, stride_t, tl.program_id(1),
                 tl.program_id(0) * BLOCK_C, D, BLOCK_C, ORDER)


def kmajor_copy(src, dst, tok_of_col=None, block_c=16, order=ORDER_TOKEN):
    """One copy_columns launch (the kernel the library's copies are built on); tok_of_col=None:
    column c holds token c (zeros for c >= T)."""
    check_copy(src, dst, order)
    T, H, D = src.shape
    Tp = dst.shape[2]
    if tok_of_col is None:
        tok_of_col = torch.arange(Tp, dtype=torch.int32).masked_fill_(torch.arange(Tp) >= T, -1)
    _copy_kernel[(triton.cdiv(Tp, block_c), H)](src.view(torch.uint8), dst.view(torch.uint8),
                                               tok_of_col, Tp, src.stride(0), D=D,
                                               BLOCK_C=block_c, ORDER=int(order))
    return dst


def _expected_columns(lengths):
    cols, base = [], 0
    for n in lengths:
        cols += range(base, base + n)
        base += (n + 15) // 16 * 16
    return torch.tensor(cols, dtype=torch.long), base


@pytest.mark.parametrize("lengths", [(37, 0, 1, 70), (16, 32), (5,), (0, 0)])
def test_layout_and_copy(lengths):
    T, H, D = sum(lengths), 3, 32
    cu = cu_seqlens_from_lengths(lengths)
    pcu, tok_of_col, Tp = kmajor_layout(cu, T)
    cols, used = _expected_columns(lengths)
    assert Tp == padded_columns(T, len(lengths)) and Tp >= used
    assert (pcu % 16 == 0).all() and pcu[-1] == used
    assert torch.equal(tok_of_col[cols].long(), torch.arange(T))
    pad = torch.ones(Tp, dtype=torch.bool)
    pad[cols] = False
    assert (tok_of_col[pad] == -1).all()
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (T, H, D), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    dst = torch.full((H, D, Tp), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)   # NaN poison
    kmajor_copy(src, dst, tok_of_col, block_c=16)
    b = dst.view(torch.uint8)
    assert torch.equal(b[:, :, cols], src.view(torch.uint8).permute(1, 2, 0))
    assert (b[:, :, pad] == 0).all()


def test_plain_copy_zero_fills_past_T():
    T, H, D = 45, 2, 16
    src = torch.randint(0, 256, (T, H, D), dtype=torch.uint8)
    dst = torch.full((H, D, 64), 0xFF, dtype=torch.uint8)
    kmajor_copy(src, dst, block_c=16)
    assert torch.equal(dst[:, :, :T], src.permute(1, 2, 0))
    assert (dst[:, :, T:] == 0).all()


def test_mma_order_is_the_wgmma_register_permutation():
    """mma_order16 maps an FP8 wgmma A-operand position to the key the fp32 accumulator of
    S = Q K^T holds in the same thread and register byte: lane group c (of a quad) holds keys
    2c, 2c+1 (+8, +16, +24) in the accumulator and A positions 4c..4c+3, 16+4c..19+4c."""
    p = torch.arange(64)
    key = mma_order16_host(p)
    assert torch.equal(torch.sort(key).values, p)                  # a permutation
    assert torch.equal(key // 16, p // 16)                          # inside 16-key groups
    lane_of_a_pos = (p % 16) // 4                                   # A operand, 8-bit, k32
    lane_of_key = (key % 8) // 2                                    # fp32 accumulator columns
    assert torch.equal(lane_of_a_pos, lane_of_key)


def test_mma_key_order_puts_column_mma_order16_p_at_p():
    """The one reshape / permute the kernels apply to an A operand (kmajor.mma_key_order): column
    p of the result is column mma_order16(p) of the input, in every 16-column group."""
    x = torch.arange(3 * 64).reshape(3, 64)
    assert torch.equal(mma_key_order_host(x), x[:, mma_order16_host(torch.arange(64))])


def test_plain_copy_in_mma_order():
    T, H, D = 45, 2, 16
    src = torch.randint(0, 256, (T, H, D), dtype=torch.uint8)
    dst = torch.full((H, D, 64), 0xFF, dtype=torch.uint8)
    kmajor_copy(src, dst, block_c=16, order=ORDER_MMA_A)
    tok = mma_order16_host(torch.arange(64))
    ok = tok < T
    assert torch.equal(dst[:, :, ok], src[tok[ok]].permute(1, 2, 0))
    assert (dst[:, :, ~ok] == 0).all()
    with pytest.raises(ValueError, match="column order needs Tp"):
        kmajor_copy(src, torch.zeros(H, D, 40, dtype=torch.uint8), order=ORDER_MMA_A)
    with pytest.raises(ValueError, match="unknown column order"):
        kmajor_copy(src, dst, order=3)


def test_pair_order_puts_an_accumulator_threads_rows_side_by_side():
    """pair_order16: position 16a + 2l + h holds row 16a + 8h + l (the rows l, l + 8 one thread
    of an MMA accumulator holds)."""
    p = torch.arange(48)
    a, l, h = p // 16, (p % 16) // 2, p % 2
    assert torch.equal(pair_order16_host(p), 16 * a + 8 * h + l)
    assert torch.equal(pair_order16_host(p).sort().values, p)         # a permutation


@pytest.mark.parametrize("order, perm", [(ORDER_MMA_A, mma_order16_host),
                                         (ORDER_PAIRS, pair_order16_host)], ids=["mma", "pairs"])
def test_padded_copy_in_column_order(order, perm):
    """The padded layout with each 16-column group reordered (ORDER_MMA_A: quantize_qkv's vt8,
    the fp8 backward's dO^T and Q^T; ORDER_PAIRS: its K^T, read against dS stored in pair
    order): column c holds what column perm(c) holds in token order, pads zero, no group leaves
    its document (documents start at multiples of 16)."""
    lengths = (37, 0, 16, 1, 50)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T, H, D = sum(lengths), 2, 16
    pcu, tok_of_col, Tp = kmajor_layout(cu, T)
    src = torch.randint(1, 256, (T, H, D), dtype=torch.uint8)
    plain = torch.full((H, D, Tp), 0xFF, dtype=torch.uint8)
    reordered = torch.full((H, D, Tp), 0xFF, dtype=torch.uint8)
    kmajor_copy(src, plain, tok_of_col, block_c=16)
    kmajor_copy(src, reordered, tok_of_col, block_c=16, order=order)
    assert torch.equal(reordered, plain[:, :, perm(torch.arange(Tp))])
    doc_of_col = torch.bucketize(torch.arange(Tp), pcu[1:].long(), right=True)
    assert torch.equal(doc_of_col, doc_of_col[perm(torch.arange(Tp))])


def test_bad_arguments():
    src = torch.zeros(8, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="1-byte"):
        kmajor_copy(src.float(), torch.zeros(2, 16, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="same heads"):
        kmajor_copy(src, torch.zeros(3, 16, 16, dtype=torch.uint8))

