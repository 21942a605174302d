"""K-major (token-contiguous) copies of fp8 operands, for the Hopper wgmma B operand.

Hopper's FP8 wgmma takes 8-bit operands only K-major, so every GEMM that reduces over tokens (PV in
the forward; P^T dO, dS^T Q, dS K in the backward) reads a transposed copy xT8 (heads, D, Tp) of the
(T, heads, D) bytes the quantization produced: nothing is re-quantized.

Column layout (`kmajor_layout`): document d occupies columns [pcu[d], pcu[d] + len_d) with
pcu[d] = sum_{e<d} ceil16(len_e), so every document starts at a multiple of 16 and TMA (16-byte
aligned coordinates along the contiguous axis) can read every tile whatever cu_seqlens is. Columns
that hold no token are zero. A copy may hold the tokens of each 16-column group in another order
(ORDER_*, below).

wgmma order. The FP8 wgmma A operand from registers (m64 k32) gives lane group c of a quad the keys
4c..4c+3 and 16+4c..16+4c+3 of each 32-key block; the fp32 accumulator that produced P gives it keys
2c, 2c+1 (+ 8, + 16, + 24). Read as an A operand as they are, P's registers hold in A position p
(bits p3 p2 p1 p0) the key mma_order16(p) = (p1 p3 p2 p0): a permutation of bits 0-3, so within
every 16-key group. Storing V^T with column p = that key makes the GEMM the same sum over keys, and
the compiler's layout conversion of P an in-register byte shuffle instead of cross-lane shuffles
(FlashAttention-3 reorders V for the same reason).

Pair order. An fp32 accumulator's thread holds rows l and l + 8 of each 16-row group; stored
transposed to shared memory (K-major) as the A operand of the next GEMM (the backward's dS for
dQ = dS K), they are two single-byte stores. With the rows in pair order (row 16a + 2l + h is
row 16a + 8h + l) they are adjacent bytes, one 16-bit value, and the transposed store of 16-bit
values is stmatrix's (backward_sm90._store_pairs_transposed). The GEMM's B operand (K^T) then holds
its columns in the same order (`ORDER_PAIRS`).

`copy_columns` works in the destination's frame: each program owns a block of output columns,
gathers the D bytes of each column's token (a 128-byte row of the source) and stores whole columns
contiguously, pads included, moving only bytes (uint8) it loaded. The alternatives are slow or
wrong: torch's `index_copy_` / strided `copy_` along the transposed axis (byte-wise uncoalesced
stores; benchmarks/NOTES.md) and a transposed store of freshly converted fp8 values inside the
quantization kernels (Triton 3.6 miscompiles it on sm_90).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


ALIGN = 16      # tokens; TMA needs 16-byte aligned coordinates along the contiguous axis

# column orders of a copy within each 16-column group (module docstring)
ORDER_TOKEN = 0     # column c holds token c
ORDER_MMA_A = 1     # column c holds token mma_order16(c)
ORDER_PAIRS = 2     # column c holds token pair_order16(c)


def padded_columns(T: int, n_docs: int) -> int:
    """Host-side bound on the columns of the padded layout: sum_d ceil16(len_d) <= ceil16(T) +
    16 (n_docs - 1), plus 16 spare columns that are always padding."""
    return (T + ALIGN - 1) // ALIGN * ALIGN + ALIGN * max(n_docs - 1, 0) + ALIGN


def kmajor_layout(cu: torch.Tensor, T: int):
    """(pcu int32 (n_docs + 1,), tok_of_col int32 (Tp,), Tp) on the device, no host sync;
    tok_of_col[c] is the packed token stored in column c, or -1 for a pad column."""
    n = cu.numel() - 1
    Tp = padded_columns(T, n)
    dev = cu.device
    lens = (cu[1:] - cu[:-1]).long()
    pcu = torch.zeros(n + 1, dtype=torch.long, device=dev)
    torch.cumsum((lens + ALIGN - 1) // ALIGN * ALIGN, 0, out=pcu[1:])
    tok = torch.arange(T, dtype=torch.long, device=dev)
    if n > 0:
        doc = torch.searchsorted(cu[1:].long(), tok, right=True).clamp_(max=n - 1)
        col = tok + (pcu[:-1] - cu[:-1].long())[doc]
    else:
        col = tok
    tok_of_col = torch.full((Tp,), -1, dtype=torch.int32, device=dev)
    tok_of_col.index_copy_(0, col, tok.to(torch.int32))
    return pcu.to(torch.int32), tok_of_col, Tp


def mma_order16_host(c):
    """The token held by column c of a wgmma-ordered copy: bits 0-3 of c = (p3 p2 p1 p0) ->
    (p1 p3 p2 p0), bits 4 and up unchanged. Plain operators: torch tensors / ints here, Triton
    tensors as `mma_order16`."""
    return (c & -16) | ((c >> 1) & 1) << 3 | ((c >> 3) & 1) << 2 | ((c >> 2) & 1) << 1 | (c & 1)


def pair_order16_host(c):
    """The token held by column c of a pair-ordered copy: bits 0-3 of c = (p3 p2 p1 p0) ->
    (p0 p3 p2 p1), bits 4 and up unchanged (module docstring)."""
    return (c & -16) | (c & 1) << 3 | ((c >> 1) & 7)


def mma_key_order_host(x8):
    """x8 (rows, k) with its columns in wgmma A order (column p = x8's column mma_order16(p)): a
    reshape / permute of the 4 low column bits, which keeps every value in its thread when x8 is an
    MMA accumulator's (fp8) image, so converting to the A operand layout moves no data. Tensor
    methods only: torch tensors here, Triton / Gluon tensors as `mma_key_order(_gluon)`."""
    return x8.reshape([x8.shape[0], x8.shape[1] // 16, 2, 2, 2, 2]) \
             .permute((0, 1, 3, 4, 2, 5)).reshape([x8.shape[0], x8.shape[1]])


# The kernels' copies of the definitions above (Triton, and Gluon where it is available)
mma_order16 = triton.jit(mma_order16_host)
pair_order16 = triton.jit(pair_order16_host)
mma_key_order = triton.jit(mma_key_order_host)
try:
    from triton.experimental import gluon as _gluon
    mma_order16_gluon = _gluon.jit(mma_order16_host)
    mma_key_order_gluon = _gluon.jit(mma_key_order_host)
except ImportError:   # pragma: no cover - triton without Gluon
    mma_order16_gluon = mma_key_order_gluon = None


@triton.jit
def copy_columns(src, dst, tok_of_col, Tp, stride_t, h, c0, D: tl.constexpr,
                 BLOCK_C: tl.constexpr, ORDER: tl.constexpr):
    """Output columns [c0, c0 + BLOCK_C) of head h: dst[h, :, c] = src[tok(c), h, :], the
    columns of each 16-group in ORDER (ORDER_*; a bool: ORDER_MMA_A or ORDER_TOKEN)."""
    c = c0 + tl.arange(0, BLOCK_C)
    d = tl.arange(0, D)
    if ORDER == 2:      # ORDER_PAIRS
        src_col = pair_order16(c)
    elif ORDER == 1:    # ORDER_MMA_A
        src_col = mma_order16(c)
    else:
        src_col = c
    tok = tl.load(tok_of_col + src_col, mask=c < Tp, other=-1)
    ok = tok >= 0
    x = tl.load(src + tok[None, :].to(tl.int64) * stride_t + h * D + d[:, None], mask=ok[None, :],
                other=0)
    tl.store(dst + (h * D + d[:, None]).to(tl.int64) * Tp + c[None, :], x, mask=(c < Tp)[None, :])


def check_copy(src: torch.Tensor, dst: torch.Tensor, order: int = ORDER_TOKEN) -> None:
    """The argument rules of the launches built on copy_columns (dst[h, :, c] = src[tok_of_col[c],
    h, :], zeros where tok_of_col[c] < 0): src (T, heads, D) with unit-stride heads and dims and dst
    (heads, D, Tp) contiguous, both 1-byte; order (ORDER_*, or a bool for ORDER_MMA_A /
    ORDER_TOKEN): column c holds what column mma_order16(c) / pair_order16(c) would, Tp a multiple
    of 16 (the padded layout keeps every 16-column group inside its document)."""
    T, H, D = src.shape
    Hd, Dd, Tp = dst.shape
    if (Hd, Dd) != (H, D) or src.element_size() != 1 or dst.element_size() != 1:
        raise ValueError(f"K-major copy: src {tuple(src.shape)} {src.dtype} -> dst "
                         f"{tuple(dst.shape)} {dst.dtype}: need 1-byte types, same heads and D")
    if src.stride(2) != 1 or src.stride(1) != D or not dst.is_contiguous():
        raise ValueError("K-major copy: src must be (T, H, D) with unit-stride heads/dims and dst "
                         "contiguous")
    if int(order) not in (ORDER_TOKEN, ORDER_MMA_A, ORDER_PAIRS):
        raise ValueError(f"K-major copy: unknown column order {order!r}")
    if order and Tp % 16:
        raise ValueError(f"K-major copy: a column order needs Tp % 16 == 0 (Tp={Tp})")
