"""The public attention functions: validation, layout, dispatch to the kernels or the reference.

Dispatch: `flamia.ops.kernels_available(q, recipe)` decides (CUDA for the kernel recipes; on the
CPU only under the Triton interpreter with FLAMIA_KERNELS=1). Everything else -- emulated
recipes, custom Recipe objects, head dim 256, the leaky control, ordinary CPU calls -- runs
`flamia.reference`, the numerics specification, in fp32. Both paths compute the same function (the kernels are tested against the
reference) and both are autograd-capable.
"""
from __future__ import annotations

import functools
import warnings

import torch

from . import custom_ops, ops
from .kernel_path import (dense_cu_seqlens, dense_offsets, kernel_backward, kernel_entry_points,
                          kernel_forward)
from .reference import ReferenceAttention
from .recipes import RECIPES, Recipe
from .validate import (check_finite_enabled, check_flags, check_recipe, check_softmax_scale,
                       check_values, validate_dense, validate_varlen)

__all__ = ["flamia_attn_func", "flamia_attn_varlen_func", "FlamiaAttention", "backend"]

KERNEL_HEAD_DIMS = (64, 128)


def backend(q: torch.Tensor, recipe: "str | Recipe") -> str:
    """"kernels" or "reference": which implementation a call with this q and recipe runs.

    Raises ValueError for a head dim the kernels do not implement when the call would have to run
    them on CUDA (falling back to the reference there would be silently slow).
    """
    name = recipe.name if isinstance(recipe, Recipe) else recipe
    if isinstance(recipe, Recipe) and RECIPES.get(name) != recipe:
        return "reference"      # a custom recipe (even under a built-in name): the kernels don't know it
    if not ops.kernels_available(q, name):
        return "reference"
    if q.shape[-1] not in KERNEL_HEAD_DIMS:
        if q.is_cuda:
            raise ValueError(
                f"head dim {q.shape[-1]} with recipe {name!r} on CUDA: the flamia kernels support "
                f"head dims {KERNEL_HEAD_DIMS}; head dim 256 runs only on the reference emulation "
                f"(CPU tensors, or the reference-only recipes fp8_mixed, fp8_token, mxfp8, "
                f"nvfp4_mixed)")
        return "reference"
    entry, why = kernel_entry_points()
    if entry is None:
        _warn_no_kernels(why)
        return "reference"
    return "kernels"


@functools.lru_cache(maxsize=1)
def _warn_no_kernels(why: str) -> None:
    warnings.warn(f"flamia kernels are not available ({why}); running the reference emulation "
                  f"(correct, slow)", RuntimeWarning, stacklevel=4)


class _KernelAttention(torch.autograd.Function):
    """Quantize once, forward, and a backward from the same quantized operands and LSE (P3).
    The eager path; under torch.compile the same functions run as custom ops (custom_ops)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, recipe, causal, softmax_scale, deterministic):
        out, lse, ctx.qkv = kernel_forward(q, k, v, cu_seqlens, max_seqlen, recipe, causal,
                                           softmax_scale)
        ctx.cfg = (max_seqlen, causal, softmax_scale, deterministic)
        ctx.save_for_backward(out, lse, cu_seqlens)
        ctx.mark_non_differentiable(lse)
        # lse gets no gradient: without this autograd would fill a zero (Hq, T) one for the
        # backward to ignore (an allocation and a launch per call)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:          # (grads are not materialized: nothing reached out)
            return (None,) * 9
        out, lse, cu_seqlens = ctx.saved_tensors
        max_seqlen, causal, softmax_scale, deterministic = ctx.cfg
        dq, dk, dv = kernel_backward(dout.contiguous(), out, lse, ctx.qkv, cu_seqlens, max_seqlen,
                                     causal, softmax_scale, deterministic)
        return dq, dk, dv, None, None, None, None, None, None


def _attention_packed(q, k, v, cu_seqlens, max_seqlen, recipe: Recipe, causal, softmax_scale,
                      deterministic, deferred=None):
    """Validated packed inputs -> (out (T, Hq, D) in q.dtype, lse (Hq, T) fp32).

    deferred: under torch.compile, the arguments of validate.check_values that validation left
    for later (check_content, cu_seqlens_k, max_seqlen_q, max_seqlen_k; cu_seqlens_k None for a
    dense call): the kernel path runs them inside its custom op, the reference path here (a
    graph break). A dense call's op gets no cu_seqlens and takes the memoized one itself
    (custom_ops.resolve_cu_seqlens): a traced one would be a new tensor at every call."""
    kernels = backend(q, recipe) == "kernels" and q.shape[0] > 0
    if deferred is not None:
        content, cu_k, max_q, max_k = deferred
        if kernels:
            return custom_ops.attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                        None if cu_k is None else cu_seqlens, max_q, max_k,
                                        recipe.name, causal, softmax_scale, deterministic, cu_k,
                                        content)
        check_values(q, k, v, softmax_scale, content, None if cu_k is None else cu_seqlens, cu_k,
                     max_q, max_k)
    if kernels:
        return _KernelAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens,
                                      max_seqlen, recipe.name, causal, softmax_scale, deterministic)
    return ReferenceAttention.apply(q, k, v, cu_seqlens, recipe, causal, softmax_scale, torch.float32)


def flamia_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal=True, softmax_scale=None, recipe="fp8", return_lse=False,
                            deterministic=False, check_finite=True):
    """Attention over packed documents, flash-attn's varlen interface (self-attention only).

    q (T, Hq, D), k and v (T, Hkv, D), bf16 or fp16, Hkv dividing Hq (GQA), D in 64/128 (256 on
    the reference). cu_seqlens_q == cu_seqlens_k: int32 (n_docs + 1,) offsets [0, ..., T]; empty
    documents are allowed. max_seqlen_*: an int >= the longest document. softmax_scale defaults
    to 1/sqrt(D). recipe: a name from flamia.RECIPES or a flamia.Recipe. deterministic: the
    backward gives bitwise reproducible gradients. check_finite: raise on NaN/Inf inputs (one
    device sync; see flamia.validate for the policy when off).

    Returns out (T, Hq, D) in q's dtype, or (out, lse) with lse (Hq, T) fp32 (natural log of the
    softmax denominator of the scaled scores) when return_lse=True. Differentiable in q, k, v.
    """
    compiling = torch.compiler.is_compiling()
    rec, scale, max_seqlen = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, causal, softmax_scale, recipe, return_lse,
                                             deterministic, check_finite, defer_values=compiling)
    deferred = (check_finite_enabled(check_finite), cu_seqlens_k, int(max_seqlen_q),
                int(max_seqlen_k)) if compiling else None
    out, lse = _attention_packed(q, k, v, cu_seqlens_q, max_seqlen, rec, causal, scale, deterministic,
                                 deferred)
    return (out, lse) if return_lse else out


def flamia_attn_func(q, k, v, causal=True, softmax_scale=None, recipe="fp8", return_lse=False,
                     deterministic=False, check_finite=True):
    """Attention on dense batches, flash-attn's interface: every batch row is one document.

    q (B, S, Hq, D), k and v (B, S, Hkv, D). Returns out (B, S, Hq, D) in q's dtype, or
    (out, lse) with lse (B, Hq, S) fp32 when return_lse=True. Other arguments as in
    flamia_attn_varlen_func.
    """
    compiling = torch.compiler.is_compiling()
    rec, scale = validate_dense(q, k, v, causal, softmax_scale, recipe, return_lse, deterministic,
                                check_finite, defer_values=compiling)
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    # one document per row (under compile the cache is not traced: _attention_packed says why)
    cu = (dense_offsets if compiling else dense_cu_seqlens)(B, S, q.device)
    deferred = (check_finite_enabled(check_finite), None, S, S) if compiling else None
    out, lse = _attention_packed(q.reshape(B * S, Hq, D), k.reshape(B * S, Hkv, D),
                                 v.reshape(B * S, Hkv, D), cu, S, rec, causal, scale, deterministic,
                                 deferred)
    out = out.reshape(B, S, Hq, D)
    if not return_lse:
        return out
    return out, lse.reshape(Hq, B, S).transpose(0, 1).contiguous()


class FlamiaAttention(torch.nn.Module):
    """nn.Module form: fixed recipe and options; call with dense or packed tensors.

    module(q, k, v) for dense (B, S, H, D); module(q, k, v, cu_seqlens, max_seqlen) for packed.
    """

    def __init__(self, recipe: "str | Recipe" = "fp8", causal: bool = True, softmax_scale=None,
                 deterministic: bool = False, check_finite: bool = True):
        super().__init__()
        # the same checks as every call's, here so a bad argument fails at construction
        check_recipe(recipe)
        check_flags(causal, False, deterministic, check_finite)
        if softmax_scale is not None:
            check_softmax_scale(softmax_scale, 64)     # (the head dim matters only for None)
        self.recipe, self.causal, self.softmax_scale = recipe, causal, softmax_scale
        self.deterministic, self.check_finite = deterministic, check_finite

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        kw = dict(causal=self.causal, softmax_scale=self.softmax_scale, recipe=self.recipe,
                  deterministic=self.deterministic, check_finite=self.check_finite)
        if cu_seqlens is None:
            return flamia_attn_func(q, k, v, **kw)
        if max_seqlen is None:
            raise ValueError("max_seqlen is required with cu_seqlens")
        return flamia_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kw)

    def extra_repr(self) -> str:
        name = self.recipe.name if isinstance(self.recipe, Recipe) else self.recipe
        return f"recipe={name!r}, causal={self.causal}"
