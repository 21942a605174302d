"""K-major (token-contiguous) copies of fp8 operands, for the Hopper wgmma B operand.

Hopper's FP8 wgmma takes 8-bit operands only K-major, so every GEMM that reduces over tokens
(PV in the forward; P^T dO, dS^T Q, dS K in the backward) reads a transposed copy xT8
(heads, D, Tp) of the (T, heads, D) bytes the quantization produced: nothing is re-quantized.

Column layout (`kmajor_layout`): document d occupies columns [pcu[d], pcu[d] + len_d) with
pcu[d] = sum_{e<d} ceil16(len_e), so every document starts at a multiple of 16 and TMA (16-byte
aligned coordinates along the contiguous axis) can read every tile whatever cu_seqlens is.
Columns that hold no token are zero. The forward's V copy uses the plain layout (column = token;
`tok_of_col=None`), optionally with the tokens of each 16-column group in wgmma order
(`mma_order=True`, below).

wgmma order. The FP8 wgmma A operand from registers (m64 k32) gives lane group c of a quad the
keys 4c..4c+3 and 16+4c..16+4c+3 of each 32-key block; the fp32 accumulator that produced P
gives it keys 2c, 2c+1 (+ 8, + 16, + 24). Read as an A operand as they are, P's registers hold
in A position p (bits p3 p2 p1 p0) the key mma_order16(p) = (p1 p3 p2 p0): a permutation of
bits 0-3, so within every 16-key group. Storing V^T with column p = that key makes the GEMM
the same sum over keys, and the compiler's layout conversion of P an in-register byte shuffle
instead of cross-lane shuffles (FlashAttention-3 reorders V for the same reason).

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

from .numerics import log2_pow2

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


def mma_order16_host(c):
    """The token held by column c of a wgmma-ordered copy: bits 0-3 of c = (p3 p2 p1 p0) ->
    (p1 p3 p2 p0), bits 4 and up unchanged (module docstring). Plain operators, so the same
    function serves torch tensors / ints here and Triton tensors as `mma_order16`."""
    return (c & -16) | ((c >> 1) & 1) << 3 | ((c >> 3) & 1) << 2 | ((c >> 2) & 1) << 1 | (c & 1)


def mma_key_order_host(x8):
    """x8 (rows, k) with its columns put in wgmma A order: column p of the result is column
    mma_order16(p) of x8. A reshape / permute of the 4 low column bits, which keeps every value
    in the thread holding it when x8 is an MMA accumulator's (fp8) image, so converting the
    result to the A operand layout moves no data. Tensor methods only, so the same function
    serves torch tensors here and Triton / Gluon tensors as `mma_key_order(_gluon)`."""
    return x8.reshape([x8.shape[0], x8.shape[1] // 16, 2, 2, 2, 2]) \
             .permute((0, 1, 3, 4, 2, 5)).reshape([x8.shape[0], x8.shape[1]])


# The kernels' copies of the two definitions above (Triton, and Gluon where it is available)
mma_order16 = triton.jit(mma_order16_host)
mma_key_order = triton.jit(mma_key_order_host)
try:
    from triton.experimental import gluon as _gluon
    mma_order16_gluon = _gluon.jit(mma_order16_host)
    mma_key_order_gluon = _gluon.jit(mma_key_order_host)
except ImportError:   # pragma: no cover - triton without Gluon
    mma_order16_gluon = mma_key_order_gluon = None


@triton.jit
def copy_columns(src, dst, tok_of_col, T, Tp, stride_t, h,
                  D: tl.constexpr, BLOCK_C: tl.constexpr, PLAIN: tl.constexpr,
                  MMA_ORDER: tl.constexpr):
    """Output columns of program_id(0)'s block of head h: dst[h, :, c] = src[tok(c), h, :]."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    d = tl.arange(0, D)
    if PLAIN:
        tok = mma_order16(c) if MMA_ORDER else c
        ok = tok < T
    else:
        tok = tl.load(tok_of_col + (mma_order16(c) if MMA_ORDER else c), mask=c < Tp, other=-1)
        ok = tok >= 0
    x = tl.load(src + tok[None, :].to(tl.int64) * stride_t + h * D + d[:, None], mask=ok[None, :],
                other=0)
    tl.store(dst + (h * D + d[:, None]).to(tl.int64) * Tp + c[None, :], x, mask=(c < Tp)[None, :])


@triton.jit
def _kmajor_copy_kernel(src, dst, tok_of_col, T, Tp, stride_t,
                        D: tl.constexpr, BLOCK_C: tl.constexpr, PLAIN: tl.constexpr,
                        MMA_ORDER: tl.constexpr):
    copy_columns(src, dst, tok_of_col, T, Tp, stride_t, tl.program_id(1), D, BLOCK_C, PLAIN,
                  MMA_ORDER)


@triton.jit
def _kmajor_copies_kernel(src0, dst0, src1, dst1, src2, dst2, tok_of_col, T, Tp,
                          stride0, stride1, stride2, H0, H1,
                          D: tl.constexpr, BLOCK_C: tl.constexpr, N: tl.constexpr,
                          MMA0: tl.constexpr, MMA1: tl.constexpr, MMA2: tl.constexpr):
    """N (2 or 3) padded-layout copies in one launch: grid axis 1 runs over the heads of copy
    0, then of copy 1, then of copy 2."""
    _copies_at(src0, dst0, src1, dst1, src2, dst2, tok_of_col, T, Tp, stride0, stride1, stride2,
               H0, H1, tl.program_id(1), D, BLOCK_C, N, MMA0, MMA1, MMA2)


@triton.jit
def _copies_at(src0, dst0, src1, dst1, src2, dst2, tok_of_col, T, Tp, stride0, stride1, stride2,
               H0, H1, h, D: tl.constexpr, BLOCK_C: tl.constexpr, N: tl.constexpr,
               MMA0: tl.constexpr, MMA1: tl.constexpr, MMA2: tl.constexpr):
    """Row h of a copies grid: the heads of copy 0, then of copy 1, then of copy 2."""
    if h < H0:
        copy_columns(src0, dst0, tok_of_col, T, Tp, stride0, h, D, BLOCK_C, False, MMA0)
    elif (N == 2) or (h < H0 + H1):
        copy_columns(src1, dst1, tok_of_col, T, Tp, stride1, h - H0, D, BLOCK_C, False, MMA1)
    else:
        copy_columns(src2, dst2, tok_of_col, T, Tp, stride2, h - H0 - H1, D, BLOCK_C, False,
                      MMA2)


@triton.jit
def _copies_and_rows_kernel(src0, dst0, src1, dst1, src2, dst2, stride0, stride1, stride2, H0, H1,
                            a0, a1, a2, a3, dst_a, b0, b1, b2, b3, dst_b, HA, HB, tok_of_col, T,
                            Tp, HC, D: tl.constexpr, N: tl.constexpr, MMA0: tl.constexpr,
                            MMA1: tl.constexpr, MMA2: tl.constexpr,
                            NV_A: tl.constexpr, FILL0_INF_A: tl.constexpr,
                            INTERLEAVE_A: tl.constexpr, FOLD0_A: tl.constexpr,
                            NV_B: tl.constexpr, FILL0_INF_B: tl.constexpr,
                            INTERLEAVE_B: tl.constexpr, FOLD0_B: tl.constexpr,
                            BLOCK_C: tl.constexpr):
    """kmajor_copies and two row-vector gathers (a, b; _padded_rows_cols) in one launch: grid
    axis 1 runs over the copies' HC heads, then row set a's heads, then b's; axis 0 over column
    blocks of both."""
    h = tl.program_id(1)
    if h < HC:
        _copies_at(src0, dst0, src1, dst1, src2, dst2, tok_of_col, T, Tp, stride0, stride1,
                   stride2, H0, H1, h, D, BLOCK_C, N, MMA0, MMA1, MMA2)
    else:
        _rows_two_at(a0, a1, a2, a3, dst_a, b0, b1, b2, b3, dst_b, tok_of_col, T, Tp, HA, HB,
                     h - HC, NV_A, FILL0_INF_A, INTERLEAVE_A, FOLD0_A, NV_B, FILL0_INF_B,
                     INTERLEAVE_B, FOLD0_B, BLOCK_C)


def kmajor_copy(src: torch.Tensor, dst: torch.Tensor, tok_of_col: torch.Tensor | None = None,
                block_c: int = 64, mma_order: bool = False) -> torch.Tensor:
    """dst[h, :, c] = src[tok_of_col[c], h, :] (zeros where tok_of_col[c] < 0); every column of
    dst (heads, D, Tp) is written. tok_of_col=None: column c holds token c (zeros for c >= T).
    mma_order=True: column c holds what column mma_order16(c) would (Tp a multiple of 16; the
    padded layout's documents start at multiples of 16, so every 16-column group stays in its
    document). src (T, heads, D) with unit-stride heads and dims; both are moved as bytes."""
    check_copy(src, dst, mma_order)
    T, H, D = src.shape
    Tp = dst.shape[2]
    plain = tok_of_col is None
    if Tp == 0 or H == 0:
        return dst
    _kmajor_copy_kernel[(triton.cdiv(Tp, block_c), H)](
        src.view(torch.uint8), dst.view(torch.uint8), dst if plain else tok_of_col, T, Tp,
        src.stride(0), D=D, BLOCK_C=block_c, PLAIN=plain, MMA_ORDER=bool(mma_order),
        num_warps=4)
    return dst


def check_copy(src: torch.Tensor, dst: torch.Tensor, mma_order: bool = False) -> None:
    """The argument rules of kmajor_copy (and of every launch built on copy_columns)."""
    T, H, D = src.shape
    Hd, Dd, Tp = dst.shape
    if (Hd, Dd) != (H, D) or src.element_size() != 1 or dst.element_size() != 1:
        raise ValueError(f"kmajor_copy: src {tuple(src.shape)} {src.dtype} -> dst "
                         f"{tuple(dst.shape)} {dst.dtype}: need 1-byte types, same heads and D")
    if src.stride(2) != 1 or src.stride(1) != D or not dst.is_contiguous():
        raise ValueError("kmajor_copy: src must be (T, H, D) with unit-stride heads/dims and dst "
                         "contiguous")
    if mma_order and Tp % 16:
        raise ValueError(f"kmajor_copy: mma_order needs Tp % 16 == 0 (Tp={Tp})")


def kmajor_copies(copies, tok_of_col: torch.Tensor, block_c: int = 64) -> None:
    """Several kmajor_copy(src, dst, tok_of_col, mma_order=...) into the padded layout, in one
    launch (the backward's dO, q and k copies: two launches fewer per call, which at short
    documents are host time). copies: 1-3 (src, dst, mma_order)
    with one D and one Tp; the results are those of the separate copies, byte for byte."""
    plan = _CopiesPlan(copies)
    if plan.n == 1:
        src, dst, order = plan.copies[0]
        kmajor_copy(src, dst, tok_of_col, block_c=block_c, mma_order=order)
        return
    if plan.Tp == 0 or plan.heads == 0:
        return
    _kmajor_copies_kernel[(triton.cdiv(plan.Tp, block_c), plan.heads)](
        *plan.slots[:6], tok_of_col, plan.T, plan.Tp, *plan.slots[6:11], D=plan.D,
        BLOCK_C=block_c, **plan.flags, num_warps=4)


def kmajor_copies_and_rows(copies, a: dict, b: dict, tok_of_col: torch.Tensor, Tp: int,
                           block_c: int = 64):
    """kmajor_copies(copies, tok_of_col) and two gathers of per-token row vectors (H, T) into
    (H, Tp) fp32 copies in the padded column layout, in one launch: the backward's K-major
    copies and its padded query / key vectors after the preprocess kernel (one launch less per
    call: host time at short documents). a, b: dict(srcs=(1-4 vectors of one shape),
    fill0_inf=, interleave=, fold0=): column c holds src[:, tok_of_col[c]], pad columns 0 (the
    first source's +inf with fill0_inf, for lse); interleave puts head h's vectors in rows
    h * len(srcs) + v of one (H * len(srcs), Tp) buffer; fold0 (4 sources: lse, Delta, sq, sdo)
    puts lse * log2(e) - log2(sdo) in the first row (sdo is a power of two). Returns a's and b's
    results: the one interleaved buffer, or views of one (len(srcs), H, Tp) buffer, each
    TMA-legal (row stride Tp * 4 bytes, 16 | Tp). Pure copies: bitwise torch's gathers
    (tests/test_ops_kmajor.py)."""
    plan = _CopiesPlan(copies)
    ga, gb = (_RowsGather(tp=Tp, **x) for x in (a, b))
    if plan.Tp != Tp or ga.T != gb.T or ga.T != plan.T:
        raise ValueError(f"kmajor_copies_and_rows: copies of {plan.T} tokens into {plan.Tp} "
                         f"columns, vectors of {ga.T} / {gb.T} tokens into {Tp}")
    if Tp > 0 and plan.heads + ga.H + gb.H > 0:
        sa, sb = ga.slots, gb.slots
        _copies_and_rows_kernel[(triton.cdiv(Tp, block_c), plan.heads + ga.H + gb.H)](
            *plan.slots, sa[0], sa[1], sa[2], sa[3], ga.dst, sb[0], sb[1], sb[2], sb[3], gb.dst,
            ga.H, gb.H, tok_of_col, plan.T, Tp, plan.heads, D=plan.D, **plan.flags,
            **ga.flags("_A"), **gb.flags("_B"), BLOCK_C=block_c, num_warps=4,
            enable_fp_fusion=False)   # fold0: two roundings, as torch's mul then sub
    return ga.result(), gb.result()


class _CopiesPlan:
    """kmajor_copies' checked arguments: 1-3 (src, dst, mma_order) of one D and Tp, as the
    launch slots (src0, dst0, src1, dst1, src2, dst2, stride0, stride1, stride2, H0, H1; unused
    slots repeat the last copy and are never taken) and constexpr flags."""

    def __init__(self, copies):
        copies = list(copies)
        if not 1 <= len(copies) <= 3:
            raise ValueError(f"kmajor_copies: 1-3 copies, got {len(copies)}")
        for src, dst, order in copies:
            check_copy(src, dst, order)
        D, Tp = copies[0][1].shape[1], copies[0][1].shape[2]
        if any(dst.shape[1:] != (D, Tp) for _, dst, _ in copies):
            raise ValueError("kmajor_copies: every copy needs the same D and Tp")
        self.copies, self.n, self.D, self.Tp = copies, len(copies), D, Tp
        self.T = copies[0][0].shape[0]
        heads = [src.shape[1] for src, _, _ in copies]
        self.heads = sum(heads)
        (s0, d0, m0), (s1, d1, m1), (s2, d2, m2) = copies + [copies[-1]] * (3 - len(copies))
        self.slots = (s0.view(torch.uint8), d0.view(torch.uint8), s1.view(torch.uint8),
                      d1.view(torch.uint8), s2.view(torch.uint8), d2.view(torch.uint8),
                      s0.stride(0), s1.stride(0), s2.stride(0), heads[0],
                      heads[1] if len(heads) > 1 else 0)
        self.flags = dict(N=max(len(copies), 2), MMA0=bool(m0), MMA1=bool(m1), MMA2=bool(m2))


@triton.jit
def _rows_two_at(a0, a1, a2, a3, dst_a, b0, b1, b2, b3, dst_b, tok_of_col, T, Tp, HA, HB, h,
                 NV_A: tl.constexpr, FILL0_INF_A: tl.constexpr, INTERLEAVE_A: tl.constexpr,
                 FOLD0_A: tl.constexpr, NV_B: tl.constexpr, FILL0_INF_B: tl.constexpr,
                 INTERLEAVE_B: tl.constexpr, FOLD0_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row h of a two-gathers grid: set a's heads, then b's."""
    if h < HA:
        _padded_rows_cols(a0, a1, a2, a3, dst_a, tok_of_col, T, Tp, HA, h, NV_A, FILL0_INF_A,
                          INTERLEAVE_A, FOLD0_A, BLOCK_C)
    else:
        _padded_rows_cols(b0, b1, b2, b3, dst_b, tok_of_col, T, Tp, HB, h - HA, NV_B,
                          FILL0_INF_B, INTERLEAVE_B, FOLD0_B, BLOCK_C)


@triton.jit
def _padded_rows_cols(src0, src1, src2, src3, dst, tok_of_col, T, Tp, H, h,
                      NV: tl.constexpr, FILL0_INF: tl.constexpr, INTERLEAVE: tl.constexpr,
                      FOLD0: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst[v, h, c] (INTERLEAVE: dst[h, v, c]) = src_v[h, tok_of_col[c]] (fp32), pads
    (tok < 0) 0, or +inf for v = 0 with FILL0_INF. FOLD0 (NV = 4): row 0 is src0 * log2(e) -
    log2(src3), bitwise the torch ops' mul then sub (kmajor_copies_and_rows launches with fp
    fusion off). The columns of program_id(0)'s block, head h: every column written."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < Tp
    tok = tl.load(tok_of_col + c, mask=c_ok, other=-1)
    ok = tok >= 0
    src_off = h * T + tok            # H * Tp < 2^31 (backward.make_state's int32 rule)
    if INTERLEAVE:
        out = dst + h * NV * Tp + c
        plane = Tp
    else:
        out = dst + h * Tp + c
        plane = H * Tp
    x = tl.load(src0 + src_off, mask=ok, other=0.0).to(tl.float32)
    if FILL0_INF:
        x = tl.where(ok, x, float("inf"))
    if FOLD0:
        x = x * 1.4426950408889634 - log2_pow2(tl.load(src3 + src_off, mask=ok,
                                                         other=0.0).to(tl.float32))
    tl.store(out, x, mask=c_ok)
    if NV > 1:
        x = tl.load(src1 + src_off, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + plane, x, mask=c_ok)
    if NV > 2:
        x = tl.load(src2 + src_off, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + 2 * plane, x, mask=c_ok)
    if NV > 3:
        x = tl.load(src3 + src_off, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + 3 * plane, x, mask=c_ok)


class _RowsGather:
    """One row-vector gather of kmajor_copies_and_rows: its checked sources (4 launch slots),
    destination buffer and flags, and the views it returns."""

    def __init__(self, srcs, tp: int, fill0_inf: bool = False, interleave: bool = False,
                 fold0: bool = False):
        nv = len(srcs)
        if not 1 <= nv <= 4:
            raise ValueError(f"kmajor_copies_and_rows: 1-4 sources, not {nv}")
        if fold0 and nv != 4:
            raise ValueError("kmajor_copies_and_rows: fold0 needs the four sources lse, Delta, sq, sdo")
        H, T = srcs[0].shape
        srcs = [x.contiguous() for x in srcs]
        for x in srcs:
            if tuple(x.shape) != (H, T):
                raise ValueError(f"kmajor_copies_and_rows: sources of shape {(H, T)}, got {tuple(x.shape)}")
        self.nv, self.H, self.T, self.Tp = nv, H, T, tp
        self.fill0_inf, self.interleave, self.fold0 = fill0_inf, interleave, fold0
        self.slots = srcs + [srcs[0]] * (4 - nv)
        shape = (H, nv, tp) if interleave else (nv, H, tp)
        self.dst = torch.empty(shape, dtype=torch.float32, device=srcs[0].device)

    def flags(self, suffix: str) -> dict:
        return {"NV" + suffix: self.nv, "FILL0_INF" + suffix: self.fill0_inf,
                "INTERLEAVE" + suffix: self.interleave, "FOLD0" + suffix: self.fold0}

    def result(self):
        if self.interleave:
            return self.dst.view(self.H * self.nv, self.Tp)
        return tuple(self.dst[i] for i in range(self.nv))
