"""The backward's dispatch (config.backward_config): the one-pass Hopper kernel (backward_sm90), or
where it does not run flamia.reference.backward in fp32 on the kernel forward's operands
(ReferenceBwdConfig: the kernel's function, not its speed, and memory of one score matrix per
document and head).
"""
from __future__ import annotations

from .config import ReferenceBwdConfig, backward_config
from .layout import QuantizedQKV, reference_saved


def attention_backward(dout, out, lse, qkv: QuantizedQKV, cu_seqlens, max_seqlen, causal=True,
                       softmax_scale=None, deterministic=False, config=None, grad_dtype=None):
    """(dq (T, Hq, D), dk, dv (T, Hkv, D)) in grad_dtype (default dout's dtype), dq and dk rotated
    back to the input space. dout, out (T, Hq, D); lse (Hq, T) fp32 from the forward. config:
    config.backward_config(D, recipe, device, dtype, max_seqlen) by default; a
    backward_sm90.Sm90BwdConfig runs the one-pass Hopper kernel (its dQ adds are unordered unless
    deterministic=True; qkv.row_max is required for fp8), ReferenceBwdConfig
    flamia.reference.backward on qkv's operands (deterministic). max_seqlen (a bound on document
    length) only selects the config; cu_seqlens[-1] must be T."""
    D = qkv.shape[3]
    cfg = config or backward_config(D, qkv.recipe, dout.device, qkv.q8.dtype, max_seqlen)
    if isinstance(cfg, ReferenceBwdConfig):
        from ..reference import backward
        dq, dk, dv = backward(dout, out, lse, reference_saved(qkv, causal), cu_seqlens,
                              qkv.recipe, causal, softmax_scale)
        dt = grad_dtype or dout.dtype
        return dq.to(dt), dk.to(dt), dv.to(dt)
    from .backward_sm90 import attention_backward_sm90, attention_backward_sm90_fp8
    if qkv.kvblock:
        return attention_backward_sm90_fp8(dout, out, lse, qkv.row_max, qkv, cu_seqlens, causal,
                                           softmax_scale, grad_dtype, deterministic, config=cfg)
    return attention_backward_sm90(dout, out, lse, qkv.q8, qkv.k8, qkv.v8, cu_seqlens, causal,
                                   softmax_scale, grad_dtype, deterministic, config=cfg)
