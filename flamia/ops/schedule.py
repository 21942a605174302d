"""Work lists for packed documents: which (document, query block) each program runs, heaviest first.

A kernel over packed documents launches one program per (work item, query head). A work item is one
query block of BLOCK_M rows inside one document, so no program straddles a document and the kernel
reads its document, block, first token and length directly (no per-tile search, and no dependent
cu_seqlens load before its first tile). Items are sorted by cost -- the number of KV tiles the block
visits (causal: up to its diagonal) -- longest first, so the long diagonal-heavy blocks of long
documents start first and short ones fill the tail (LPT).

Built on the device with a handful of torch ops and no host sync: the item count is bounded on the
host by T // BLOCK_M + n_docs (sum_d ceil(L_d / BLOCK_M) never exceeds it), and the unused tail of
the list holds doc = -1 items that exit at once. `max_seqlen` is not needed.
"""
from __future__ import annotations

import torch

from . import sm_count
from .gluon_common import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

_MEMO_ATTR = "_flamia_memo"


def per_cu_seqlens(cu_seqlens: torch.Tensor, key, build):
    """build(), memoized on the cu_seqlens tensor itself: one model step calls every attention
    layer, forward and backward, with the same cu_seqlens, and the metadata built from it (work
    list, K-major column layout) costs a dozen small torch ops of host time, more than the kernels
    of a short-document layer. The memo lives and dies with the tensor, and is dropped when the
    tensor's version counter moves (any in-place change through autograd-visible ops). Bytes changed
    behind PyTorch's back (`.data`, numpy views, CUDA kernels of other libraries) are not seen: a
    caller that changes cu_seqlens that way passes a new tensor. Results are read-only."""
    version = cu_seqlens._version
    memo = getattr(cu_seqlens, _MEMO_ATTR, None)
    if memo is None or memo[0] != version:
        memo = (version, {})
        try:
            setattr(cu_seqlens, _MEMO_ATTR, memo)
        except (AttributeError, RuntimeError):   # e.g. tensor subclasses that refuse attributes
            return build()
    table = memo[1]
    if key not in table:
        table[key] = build()
    return table[key]


def build_schedule(cu_seqlens: torch.Tensor, total_tokens: int, block_m: int, block_n: int,
                   causal: bool) -> torch.Tensor:
    """The (doc, q-block) work list for `cu_seqlens`, sorted by KV tiles visited, descending:
    (4, n_items) int32, rows document (-1: no work), query block, and the document's first token
    and length (no cu_seqlens lookup); n_items = T // block_m + n_docs, a host bound."""
    dev = cu_seqlens.device
    n_docs = cu_seqlens.numel() - 1
    n = max(total_tokens // block_m + n_docs, 1)
    if n_docs <= 0:
        return torch.full((4, n), -1, dtype=torch.int32, device=dev)
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    nblk = (lengths + block_m - 1) // block_m
    ends = torch.cumsum(nblk, 0)          # inclusive prefix: doc d owns [ends - nblk, ends)
    idx = torch.arange(n, device=dev, dtype=torch.int64)
    doc = torch.searchsorted(ends, idx, right=True)   # first doc whose range ends after idx
    valid = doc < n_docs
    d = doc.clamp(max=n_docs - 1)
    blk = idx - (ends[d] - nblk[d])
    L = lengths[d]
    if causal:
        hi = torch.minimum((blk + 1) * block_m, L)    # keys [0, hi) visited
    else:
        hi = L
    cost = torch.where(valid, (hi + block_n - 1) // block_n, torch.full_like(hi, -1))
    # Ties keep packed order (lower index first): neighbouring blocks share KV tiles in L2.
    key = cost * (1 << 20) - idx.clamp(max=(1 << 20) - 1)
    order = torch.argsort(key, descending=True)
    items = torch.stack([torch.where(valid, d, torch.full_like(d, -1))[order], blk[order],
                         cu[:-1][d][order], L[order]])
    return items.to(torch.int32).contiguous()


def work_list(cu_seqlens: torch.Tensor, total_tokens: int, block_m: int, block_n: int,
              causal: bool) -> torch.Tensor:
    """build_schedule's list, memoized on cu_seqlens (per_cu_seqlens): the one entry point of
    every kernel that walks a work list (the forward kernels, the quantize)."""
    return per_cu_seqlens(cu_seqlens, ("schedule", total_tokens, block_m, block_n, bool(causal)),
                          lambda: build_schedule(cu_seqlens, total_tokens, block_m, block_n,
                                                 causal))


def persistent_grid(n_work: int, ctas_per_sm: int, device: torch.device) -> tuple[int]:
    """Grid of a persistent kernel: ctas_per_sm CTAs per SM, at most one per work index (and
    at least one). On a CPU (compile-only builds) the H200's 132 SMs."""
    n_sm = sm_count(device) if device.type == "cuda" else 132
    return (max(1, min(n_work, ctas_per_sm * n_sm)),)


if HAVE_GLUON:

    @gluon.jit
    def work_item(ITEMS, N_ITEMS, HQ, GROUP, W, w):
        """(doc, head, kv head, first token, length, query block) of work index
        w = item * HQ + head, straight from the work list (no dependent cu_seqlens load); doc < 0:
        padding or w >= W."""
        ok = w < W
        head = w % HQ
        item = w // HQ
        doc = gl.load(ITEMS + item, mask=ok, other=-1)
        blk = gl.load(ITEMS + N_ITEMS + item, mask=ok, other=0)
        start = gl.load(ITEMS + 2 * N_ITEMS + item, mask=ok, other=0)
        L = gl.load(ITEMS + 3 * N_ITEMS + item, mask=ok, other=0)
        return doc, head, head // GROUP, start, L, blk
