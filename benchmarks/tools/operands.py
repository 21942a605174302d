"""Kernel operands from the reference emulation, for tests and benchmarks that check the
backward kernels alone (flamia.ops.layout.QuantizedQKV from reference.forward's Saved)."""
from __future__ import annotations

import torch

from flamia.ops.layout import QuantizedQKV


def quantized_qkv_from_reference(saved, recipe: str, cu_seqlens,
                                 causal: bool = True):
    """The kernel layout of reference.forward(...)'s Saved operands for the bf16 recipe (the
    bytes flamia.ops.quantize.quantize_qkv produces: the inputs rounded to bf16). The fp8
    recipe's layout (block and diagonal copies, padded K-major columns) comes from quantize_qkv
    itself; cu_seqlens and causal are unused (kept for the callers' signature)."""
    if recipe != "bf16":
        raise ValueError(f"quantized_qkv_from_reference lays out the bf16 recipe only, not "
                         f"{recipe!r} (fp8: flamia.ops.quantize.quantize_qkv)")
    return QuantizedQKV("bf16", saved.q.values.to(torch.bfloat16).contiguous(),
                        saved.k.values.to(torch.bfloat16).contiguous(),
                        saved.v.values.to(torch.bfloat16).contiguous(),
                        None, None, None, None, rotated=False)
