"""The quantized operands the forward produces and the backward consumes (see ops/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedQKV:
    """Q, K, V quantized once for every GEMM of forward and backward.

    For the bf16 recipe the tensors are bf16 and every scale is None.
    """
    recipe: str
    q8: torch.Tensor              # (T, Hq, D)  rotated (fp8 recipes) q / sq
    k8: torch.Tensor              # (T, Hkv, D)
    v8: torch.Tensor              # (T, Hkv, D)
    sq: torch.Tensor | None       # (Hq, T)  fp32 powers of two (or 0 for an all-zero token)
    sk: torch.Tensor | None       # (Hkv, T)
    sv: torch.Tensor | None       # (Hkv, T)
    vcap: torch.Tensor | None     # (Hkv, T) causal prefix max of sv within the document
    rotated: bool                 # q8/k8 live in the Hadamard-rotated space
    vt8: torch.Tensor | None = None   # optional (Hkv, D, T_pad) K-major V copy for the PV GEMM
    # vt8_mma_order: in each 16-column group of vt8, column c holds token mma_order16(c) of the
    # group (flamia.ops.kmajor), the key order in which the forward's P registers already are an
    # FP8 wgmma A operand; False: column = token.
    vt8_mma_order: bool = False

    @property
    def shape(self):
        return self.q8.shape[0], self.q8.shape[1], self.k8.shape[1], self.q8.shape[2]
