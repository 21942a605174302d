"""Input families and document splits shared by tests, the demo, the audit and the benchmark."""
from __future__ import annotations

from typing import Sequence

import torch

FAMILIES = ("mild", "outliers")


def cu_seqlens_from_lengths(lengths: Sequence[int], device=None) -> torch.Tensor:
    """int32 cumulative offsets [0, l0, l0+l1, ...] for packed documents."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_qkv(lengths: Sequence[int], heads_q: int, heads_kv: int, head_dim: int,
             family: str = "mild", dtype=torch.bfloat16, device="cpu", seed: int = 0,
             requires_grad: bool = False):
    """Packed q (T, Hq, D), k, v (T, Hkv, D) and cu_seqlens, drawn from an input family.

    mild:     standard normal q, k, v.
    outliers: 4 hot channels x8 in q and k (the same channels in every token, as in trained
              LLMs), and ~1/256 of tokens with k x6 and v x4.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T = int(sum(lengths))
    q = torch.randn(T, heads_q, head_dim, generator=gen)
    k = torch.randn(T, heads_kv, head_dim, generator=gen)
    v = torch.randn(T, heads_kv, head_dim, generator=gen)
    if family == "outliers":
        hot = torch.randperm(head_dim, generator=gen)[:4]
        q[..., hot] *= 8
        k[..., hot] *= 8
        n_hot = max(1, T // 256)
        tok = torch.randperm(T, generator=gen)[:n_hot]
        k[tok] *= 6
        v[tok] *= 4
    cu = cu_seqlens_from_lengths(lengths, device=device)
    out = []
    for x in (q, k, v):
        x = x.to(device=device, dtype=dtype)
        out.append(x.requires_grad_(requires_grad) if requires_grad else x)
    return (*out, cu)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||x - ref|| / ||ref|| in float64 (NaN if x has a NaN)."""
    x64, r64 = x.double(), ref.double()
    return ((x64 - r64).norm() / r64.norm().clamp_min(1e-300)).item()
