"""The quantized operands the forward produces and the backward consumes (see ops/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

KV_BLOCK = 128          # tokens per K/V scale block (flamia.reference.KV_BLOCK)


@dataclass
class QuantizedQKV:
    """Q, K, V quantized once for every GEMM of forward and backward: bf16 tensors and no scales for
    the bf16 recipe; fp8 (reference.py "Token-block scaling") fills the fields below."""
    recipe: str
    q8: torch.Tensor              # (T, Hq, D)  rotated (fp8) q / sq
    k8: torch.Tensor              # (T, Hkv, D)
    v8: torch.Tensor              # (T, Hkv, D)
    sq: torch.Tensor | None       # (Hq, T)  fp32 powers of two (or 0 for an all-zero token)
    sk: torch.Tensor | None       # (Hkv, T)
    sv: torch.Tensor | None       # (Hkv, T)
    vcap: torch.Tensor | None     # (Hkv, T) the visible max of the V scales a row's pairs use
                                  #   (reference._visible_max)
    rotated: bool                 # q8/k8 live in the Hadamard-rotated space
    vt8: torch.Tensor | None = None   # (Hkv, D, Tp) K-major V copy for the PV GEMM (fp8)
    # fp8: k8 / v8 / sk / sv are the block copies (one scale per document-local 128-token block
    # and head, sk / sv broadcast to the block's tokens); the fields below are None for bf16.
    k8_diag: torch.Tensor | None = None   # (T, Hkv, D) per-token copies for the diagonal pairs
    v8_diag: torch.Tensor | None = None   #   (causal only; per-token scales)
    sk_diag: torch.Tensor | None = None   # (Hkv, T) their per-token scales (causal only)
    sv_diag: torch.Tensor | None = None
    vnorm: torch.Tensor | None = None     # (Hkv, T) visible max of the 2-norms of V's
                                          #   dequantized copies (the backward's bound)
    # vt8 / vt8_diag / scale_cols columns: flamia.ops.kmajor's padded layout (document d from column
    # kv_pcu[d], a multiple of 16, so tiles at document-local multiples of 16 are TMA-legal) and, in
    # vt8 / vt8_diag, its wgmma key order within each 16-column group.
    kv_pcu: torch.Tensor | None = None    # (n_docs + 1,) int32
    vt8_diag: torch.Tensor | None = None  # (Hkv, D, Tp) K-major copy of v8_diag (causal only)
    # (n, Hkv, Tp) fp32: sk, sv (n = 2), then sk_diag, sv_diag (causal: n = 4), in the padded
    # columns (pads 0): the Gluon forward's TMA boxes of scales
    scale_cols: torch.Tensor | None = None
    # The forward's row max m (Hq, T) fp32 of the softmax-scaled scores (token-block scaling: the
    # backward bounds P^T by exp(m - lse)); set by the kernel path after the forward, None before
    row_max: torch.Tensor | None = None

    @property
    def kvblock(self) -> bool:
        """Token-block scaling (block copies plus per-token diagonal copies): the fp8 recipe."""
        return self.recipe == "fp8"

    @property
    def shape(self):
        return self.q8.shape[0], self.q8.shape[1], self.k8.shape[1], self.q8.shape[2]


def new_tensor(shape, dtype, device, fill: float | None = None) -> torch.Tensor:
    """torch.empty, or torch.full with `fill` (the NaN poison of tests: every element written)."""
    if fill is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, fill, dtype=dtype, device=device)


def check_kvblock_tiles(qkv: QuantizedQKV, causal: bool, block_m: int, block_n: int) -> None:
    """The token-block forward's rules (both kernels): tiles inside the 128-token K/V blocks and
    16-aligned in vt8's padded columns, and the operands quantize_qkv makes for it."""
    if KV_BLOCK % block_m or KV_BLOCK % block_n or block_n % 16:
        raise ValueError(f"token-block scaling needs block_m and block_n dividing {KV_BLOCK} "
                         f"and block_n a multiple of 16, got {block_m} x {block_n}")
    if qkv.kv_pcu is None or qkv.vt8 is None or (causal and (
            qkv.k8_diag is None or qkv.vt8_diag is None or qkv.sk_diag is None)):
        raise ValueError(f"recipe {qkv.recipe}: the forward needs quantize_qkv's block and "
                         f"(causal) token copies; quantize with causal={causal}")


def reference_saved(qkv: QuantizedQKV, causal: bool):
    """The reference's Saved (flamia.reference) holding exactly the kernel forward's operands
    (fp8: the quantized ones, with the forward's row max): what reference.backward
    differentiates where no backward kernel runs (ops.config.backward_config)."""
    from ..quant import hadamard
    from ..reference import Operand, Saved
    if qkv.recipe == "bf16":
        q, k, v = (Operand(x.float(), None, "none") for x in (qkv.q8, qkv.k8, qkv.v8))
        return Saved(q, k, v, None, None, causal)
    if qkv.row_max is None:
        raise ValueError("reference_saved needs the fp8 recipe's operands with the "
                         "forward's row_max (kernel_path.kernel_forward)")
    f32 = torch.float32
    T, Hq, Hkv, D = qkv.shape

    def op(values, scale, granularity):       # (T, H, D) values, (H, T) scales
        return Operand(values.to(f32), scale.transpose(0, 1).to(f32)[..., None], granularity)

    saved = Saved(op(qkv.q8, qkv.sq, "token"), op(qkv.k8, qkv.sk, "tokenblock"),
                  op(qkv.v8, qkv.sv, "tokenblock"),
                  hadamard(D, f32, qkv.q8.device) if qkv.rotated else None,
                  qkv.row_max.to(f32), causal, v_cap=qkv.vcap.transpose(0, 1).to(f32))
    if causal:
        saved.k_diag = op(qkv.k8_diag, qkv.sk_diag, "token")
        saved.v_diag = op(qkv.v8_diag, qkv.sv_diag, "token")
    return saved
