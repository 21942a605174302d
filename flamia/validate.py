"""Input validation for the public API: every bad input is a TypeError or ValueError naming the
argument, before any kernel runs.

Two kinds of checks:
- metadata checks (dtype, rank, shapes, devices, scalars): free, always on;
- content checks, which read tensor values: q, k, v finite, below 2**100 in magnitude, with
  scores |q.k| * softmax_scale bounded below 2**16 (where float32 resolves the softmax), and
  the values of cu_seqlens (0 first, total last, non-decreasing, cu_seqlens_k equal to
  cu_seqlens_q, max_seqlen large enough). On a GPU reading values costs one device -> host
  synchronisation per call (all content checks share it). They are on by default;
  `check_finite=False` or the environment variable FLAMIA_CHECK_FINITE=0 turns them off. On the
  CPU the cu_seqlens checks always run (free there).

Non-finite inputs with the checks off (the NaN policy, for every recipe but the leaky control):
a NaN or +-Inf anywhere in q, k or v of document d can only make document d's outputs (out, lse)
and gradients non-finite. Every other document's outputs and gradients are bitwise the same as
with clean inputs (P2 holds for NaN too: no value crosses a document boundary). Within d, for a
non-finite value at token j:
- in q, head h: out[j, h] and lse[h, j] are non-finite; no other out or lse entry changes;
- a NaN in k or v, kv head g: out at rows >= j of document d for every query head of group g is
  NaN; with a NaN in v, earlier rows of d may be NaN too (a masked score is an exact 0, and
  0 * NaN = NaN in P V); lse changes only through k;
- an Inf in k or v behaves like a NaN, or gives the correct limit (a key whose score is -inf
  simply gets weight 0);
- any gradient of document d (dq, dk, dv) may be non-finite.
Nothing hangs, and nothing outside document d changes.
The leaky control `fp8_tensorwise` has tensor-wide scales: one NaN makes every output NaN.
"""
from __future__ import annotations

import math
import numbers
import os

import torch

from .recipes import Recipe, get_recipe

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# Head dims the public API accepts. The Triton kernels implement 64 and 128; 256 runs on the
# reference emulation (CPU anywhere; on CUDA only for the emulated recipes, see interface.py).
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def check_finite_enabled(check_finite: bool = True) -> bool:
    """The effective content-check switch: the keyword, unless FLAMIA_CHECK_FINITE=0 says off."""
    return bool(check_finite) and os.environ.get("FLAMIA_CHECK_FINITE", "1") != "0"


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _check_qkv_common(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be torch.bfloat16 or torch.float16, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got q on {q.device}, k on {k.device}, "
                         f"v on {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    D = q.shape[-1]
    if k.shape[-1] != D:
        raise ValueError(f"q and k must have the same head dim, got q {D} and k {k.shape[-1]}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim (last dim of q, k, v) must be one of {SUPPORTED_HEAD_DIMS}, got {D}")
    Hq, Hkv = q.shape[-2], k.shape[-2]
    if Hkv == 0 or Hq == 0 or Hq % Hkv:
        raise ValueError(f"number of heads of k and v ({Hkv}) must divide the number of heads of q "
                         f"({Hq}) (grouped-query attention)")


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """None -> 1/sqrt(head_dim); otherwise a positive finite number."""
    if softmax_scale is None:
        return head_dim ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    s = float(softmax_scale)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale!r}")
    return s


def check_recipe(recipe) -> Recipe:
    if not isinstance(recipe, (str, Recipe)):
        raise TypeError(f"recipe must be a recipe name (str) or a flamia.Recipe, got {type(recipe).__name__}")
    return get_recipe(recipe)   # ValueError "recipe must be one of [...]" for an unknown name


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_flags(causal, return_lse, deterministic, check_finite) -> None:
    for name, value in (("causal", causal), ("return_lse", return_lse),
                        ("deterministic", deterministic), ("check_finite", check_finite)):
        _check_flag(name, value)


# Finite inputs this large would overflow the fp32 arithmetic of attention (the Hadamard rotation,
# the scores, the P V sums) and come out NaN: rejected by the same check as NaN and Inf.
MAX_INPUT_MAGNITUDE = 2.0 ** 100
# Largest attention score magnitude accepted when values are checked (see check_finite_values).
MAX_SCORE_MAGNITUDE = 2.0 ** 16


def check_finite_values(q, k, v, softmax_scale: float) -> None:
    """ValueError naming the tensor holding a NaN or Inf, with values of 2**100 or more, or (q
    and k) with scores too large for a float32 softmax. One reduction per tensor, read once, and
    one device sync for all three.

    |q_i . k_j| * scale <= |q_i| |k_j| * scale (Cauchy-Schwarz). The softmax is evaluated in float32
    (forward, and again from the LSE in the backward); a score of size s carries an absolute
    rounding error of ulp(s), a relative error of ulp(s) in P. So the token norms of q and k bound
    what matters, and a NaN or Inf anywhere in a token makes its norm non-finite too.
    """
    with torch.no_grad():
        qn, kn, vmax = torch.stack([
            torch.linalg.vector_norm(q, dim=-1, dtype=torch.float32).amax(),
            torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32).amax(),
            v.abs().amax().float()]).tolist()
    for name, x, m in (("q", q, qn), ("k", k, kn), ("v", v, vmax)):
        if math.isfinite(m) and m < MAX_INPUT_MAGNITUDE:
            continue
        # Rare error path: a norm can also overflow from large finite values, so look closer.
        amax = x.detach().abs().amax().float().item()
        if not math.isfinite(amax):
            raise ValueError(
                f"{name} contains NaN or Inf. flamia checks inputs by default (one device sync per "
                f"call); pass check_finite=False or set FLAMIA_CHECK_FINITE=0 to skip the check, "
                f"in which case the affected document's outputs are NaN (see flamia.validate)")
        if amax >= MAX_INPUT_MAGNITUDE:
            raise ValueError(f"{name} has values up to {amax:.3g}: attention in float32 would overflow "
                             f"(flamia accepts magnitudes below 2**100)")
    score_bound = qn * kn * softmax_scale
    if not score_bound <= MAX_SCORE_MAGNITUDE:
        raise ValueError(
            f"q and k are too large for float32 softmax: |q_i| |k_j| * softmax_scale reaches "
            f"{score_bound:.3g} (max token norms |q| = {qn:.3g}, |k| = {kn:.3g}); flamia accepts "
            f"scores below 2**16, where float32 rounding moves P by at most 2**-7")


def validate_dense(q, k, v, causal, softmax_scale, recipe, return_lse, deterministic, check_finite,
                   defer_values: bool = False):
    """Checks for flamia_attn_func. Returns (recipe: Recipe, softmax_scale: float).
    defer_values: skip check_values (the caller runs it later, see check_values)."""
    check_flags(causal, return_lse, deterministic, check_finite)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim) for flamia_attn_func, "
                             f"got shape {tuple(x.shape)} (use flamia_attn_varlen_func for packed (T, H, D))")
    _check_qkv_common(q, k, v)
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(f"q and k must have the same batch and seqlen (self-attention), got q "
                         f"{tuple(q.shape[:2])} and k {tuple(k.shape[:2])}")
    rec = check_recipe(recipe)
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    if not defer_values:
        check_values(q, k, v, scale, check_finite_enabled(check_finite))
    return rec, scale


def _check_max_seqlen(name: str, value) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                    softmax_scale, recipe, return_lse, deterministic, check_finite,
                    defer_values: bool = False):
    """Checks for flamia_attn_varlen_func. Returns (recipe, softmax_scale, max_seqlen: int).
    defer_values: skip check_values (the caller runs it later, see check_values)."""
    check_flags(causal, return_lse, deterministic, check_finite)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
        if x.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim) for "
                             f"flamia_attn_varlen_func, got shape {tuple(x.shape)} (use "
                             f"flamia_attn_func for dense (B, S, H, D))")
    _check_qkv_common(q, k, v)
    T = q.shape[0]
    if k.shape[0] != T:
        raise ValueError(f"q, k and v must have the same number of tokens (self-attention), got q {T} "
                         f"and k/v {k.shape[0]}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(name, cu)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be 1-D with n_docs + 1 >= 1 entries, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {cu.device}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k must equal cu_seqlens_q: flamia is self-attention over packed "
                         f"documents; got {cu_seqlens_k.numel()} and {cu_seqlens_q.numel()} entries")
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    rec = check_recipe(recipe)
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    if not defer_values:
        check_values(q, k, v, scale, check_finite_enabled(check_finite), cu_seqlens_q, cu_seqlens_k,
                     max_q, max_k)
    return rec, scale, max(max_q, max_k)


def check_values(q, k, v, softmax_scale: float, content: bool, cu_q=None, cu_k=None, max_q=0,
                 max_k=0) -> None:
    """The checks that read tensor values (one device sync): cu_seqlens (when given) against T
    and max_seqlen, and with `content` (check_finite) NaN / Inf / magnitudes of q, k, v.
    cu_seqlens on CUDA are read only with `content` (the same sync); on the CPU always (free).

    The validate_* functions run them unless told to defer (defer_values): under torch.compile
    reading values would break the graph, so the kernel path runs them inside its custom op
    (flamia.custom_ops), where the compiler does not look."""
    if cu_q is not None and (content or not q.is_cuda):
        _check_cu_values(cu_q, cu_k, q.shape[0], max_q, max_k)
    if content and q.numel() > 0:
        check_finite_values(q, k, v, softmax_scale)


def _check_cu_values(cu_q, cu_k, T, max_q, max_k) -> None:
    cu = cu_q.tolist()
    if cu_k is not cu_q and cu_k.tolist() != cu:
        raise ValueError("cu_seqlens_k must equal cu_seqlens_q: flamia is self-attention over packed "
                         "documents (keys and queries are the same tokens)")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {cu[0]}")
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens_q must end at the total number of tokens ({T}, q.shape[0]), got {cu[-1]}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens_q must be non-decreasing, got {cu}")
    longest = max(lengths, default=0)
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if m < longest:
            raise ValueError(f"{name} ({m}) is smaller than the longest document ({longest})")
