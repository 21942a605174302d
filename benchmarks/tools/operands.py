"""Kernel operands from the reference emulation, for tests and benchmarks that check the
backward kernels alone (flamia.ops.layout.QuantizedQKV from reference.forward's Saved)."""
from __future__ import annotations

import torch

from flamia.ops.layout import QuantizedQKV


def quantized_qkv_from_reference(saved, recipe: str, cu_seqlens,
                                 causal: bool = True):
    """The kernel layout of reference.forward(...)'s Saved operands (same bytes and scales that
    flamia.ops.quantize.quantize_qkv produces)."""
    if recipe == "bf16":
        return QuantizedQKV("bf16", saved.q.values.to(torch.bfloat16).contiguous(),
                            saved.k.values.to(torch.bfloat16).contiguous(),
                            saved.v.values.to(torch.bfloat16).contiguous(),
                            None, None, None, None, rotated=False)
    fp8 = torch.float8_e4m3fn

    def sc(op):
        return op.scale[..., 0].transpose(0, 1).float().contiguous()

    sv = sc(saved.v)
    vcap = torch.empty_like(sv)
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            vcap[:, a:b] = torch.cummax(sv[:, a:b], dim=1).values if causal else \
                sv[:, a:b].amax(1, keepdim=True).expand(-1, b - a)
    return QuantizedQKV(recipe, saved.q.values.to(fp8).contiguous(),
                        saved.k.values.to(fp8).contiguous(), saved.v.values.to(fp8).contiguous(),
                        sc(saved.q), sc(saved.k), sv, vcap, rotated=saved.rotation is not None)
