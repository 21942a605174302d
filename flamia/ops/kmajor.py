"""K-major (token-contiguous) copies of fp8 operands, for the Hopper wgmma B operand.

Hopper's FP8 wgmma takes 8-bit operands only K-major, so every GEMM that reduces over tokens
(PV in the forward; P^T dO, dS^T Q, dS K in the backward) reads a transposed copy xT8
(heads, D, Tp) of the (T, heads, D) bytes the quantization produced: nothing is re-quantized.

Column layout (`kmajor_layout`): document d occupies columns [pcu[d], pcu[d] + len_d) with
pcu[d] = sum_{e<d} ceil16(len_e), so every document starts at a multiple of 16 and TMA (16-byte
aligned coordinates along the contiguous axis) can read every tile whatever cu_seqlens is.
Columns that hold no token are zero. The forward's V copy uses the plain layout (column = token;
`tok_of_col=None`).

`kmajor_copy` works in the destination's frame: each program owns a block of output columns,
gathers the D bytes of each column's token (a 128-byte row of the source) and stores whole
columns contiguously, pads included. Two earlier ways were slow or wrong on the H200: torch's
`index_copy_` / strided `copy_` along the transposed axis (2.0 ms per call for dO at 32k tokens,
32 heads, 0.2 ms for V: byte-wise uncoalesced stores; benchmarks/NOTES.md) and a transposed
store of freshly converted fp8 values inside the quantization kernels (Triton 3.6 miscompiles
it on sm_90: 25 % of bytes wrong). Here the kernel only moves bytes (uint8) it loaded.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ALIGN = 16      # tokens; TMA needs 16-byte aligned coordinates along the contiguous axis


def padded_columns(T: int, n_docs: int) -> int:
    """Host-side bound on the columns of the padded layout: sum_d ceil16(len_d) <= ceil16(T) +
    16 (n_docs - 1), plus 16 spare columns that are always padding."""
    return (T + ALIGN - 1) // ALIGN * ALIGN + ALIGN * max(n_docs - 1, 0) + ALIGN


def kmajor_layout(cu: torch.Tensor, T: int):
    """(pcu int32 (n_docs + 1,), tok_of_col int32 (Tp,), Tp) on the device, no host sync.

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


@triton.jit
def _kmajor_copy_kernel(src, dst, tok_of_col, T, Tp, stride_t,
                        D: tl.constexpr, BLOCK_C: tl.constexpr, PLAIN: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    if PLAIN:
        tok = c
        ok = c < T
    else:
        tok = tl.load(tok_of_col + c, mask=c < Tp, other=-1)
        ok = tok >= 0
    x = tl.load(src + tok[None, :].to(tl.int64) * stride_t + h * D + d[:, None], mask=ok[None, :],
                other=0)
    tl.store(dst + (h * D + d[:, None]).to(tl.int64) * Tp + c[None, :], x, mask=(c < Tp)[None, :])


def kmajor_copy(src: torch.Tensor, dst: torch.Tensor, tok_of_col: torch.Tensor | None = None,
                block_c: int = 64) -> torch.Tensor:
    """dst[h, :, c] = src[tok_of_col[c], h, :] (zeros where tok_of_col[c] < 0); every column of
    dst (heads, D, Tp) is written. tok_of_col=None: column c holds token c (zeros for c >= T).
    src (T, heads, D) with unit-stride heads and dims; both are moved as bytes."""
    T, H, D = src.shape
    Hd, Dd, Tp = dst.shape
    if (Hd, Dd) != (H, D) or src.element_size() != 1 or dst.element_size() != 1:
        raise ValueError(f"kmajor_copy: src {tuple(src.shape)} {src.dtype} -> dst "
                         f"{tuple(dst.shape)} {dst.dtype}: need 1-byte types, same heads and D")
    if src.stride(2) != 1 or src.stride(1) != D or not dst.is_contiguous():
        raise ValueError("kmajor_copy: src must be (T, H, D) with unit-stride heads/dims and dst "
                         "contiguous")
    if Tp == 0 or H == 0:
        return dst
    plain = tok_of_col is None
    _kmajor_copy_kernel[(triton.cdiv(Tp, block_c), H)](
        src.view(torch.uint8), dst.view(torch.uint8), dst if plain else tok_of_col, T, Tp,
        src.stride(0), D=D, BLOCK_C=block_c, PLAIN=plain, num_warps=4)
    return dst
