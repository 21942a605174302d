"""Which kernel runs where, and every tunable of the kernels.

`select(head_dim, recipe, device)` resolves, for one call, the forward kernel and its config and
the backward's kernels and their configs; the launchers take these configs (tests and
benchmarks may pass their own). Nothing here reads the environment: what runs depends on the
device, the recipe, the head dim, the input dtype and (for one backward choice) the longest
document, never on a switch. Tile shapes were measured on the H200 (benchmarks/NOTES.md).

    forward   fp8 / fp8_mixed at D=128 on sm_90: the persistent Gluon kernel (forward_gluon),
              PersistentFwdConfig, V^T quantized in token order
              otherwise: the Triton kernel (forward), FwdConfig, V^T in wgmma key order (fp8)
    backward  bf16 (bf16 inputs) at D=64/128 on sm_90: the one-pass kernel (backward_sm90,
              which picks its own tiles: backward_sm90.select_config)
              fp8 / fp8_mixed on sm_90: preprocess + the Gluon dK/dV and dQ kernels
              (backward_gluon, backward_gluon_mixed), Gluon*Config / Mixed*Config
              otherwise (other GPUs, fp16 bf16-recipe inputs, the CPU interpreter): the Triton
              kernels (backward), BwdConfig
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from . import interpreting, is_sm90
from .gluon_common import HAVE_GLUON

FP8_RECIPES = ("fp8", "fp8_mixed")


def _recipe_name(recipe) -> str:
    return getattr(recipe, "name", recipe)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FwdConfig:
    """The Triton forward kernel (forward._attn_fwd_kernel)."""
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    use_tma: bool = True        # TMA descriptors for Q/K/V tiles (pointer loads otherwise)
    maxnreg: int | None = None  # register cap per thread (e.g. 168: three 4-warp CTAs per SM)
    # fold_lr: exp2(s * row_f - (m - lr)) instead of exp2((s * row_f - m) + lr): the per-row
    # offset joins the per-row max once per tile, not once per score (-64 FADD per 64 x 128
    # tile per thread). Rounding differs by one fp32 add on the exponent (|m| 2^-24).
    fold_lr: bool = False
    # masked_stages: pipeline depth of the masked-tile loops (head / diagonal / document end,
    # one or two tiles per query block); None = num_stages. 1 (no prefetch there) is what lets
    # ptxas keep the unmasked loop's wgmmas asynchronous at num_stages = 3: with the masked
    # loops pipelined too, ptxas serializes every wgmma of the kernel (C7515, non-wgmma code
    # defining accumulator registers inside a pipeline stage).
    masked_stages: int | None = None

    def with_(self, **kw) -> "FwdConfig":
        return replace(self, **kw)


def triton_forward_config(head_dim: int, fp8: bool, device: torch.device) -> FwdConfig:
    """Tile shapes of the Triton forward per head dim (benchmarks/fwd_dev.py on the H200).

    FP8: 64x128 tiles with 4 warps, so one CTA's softmax overlaps another's MMAs (Triton waits
    on each wgmma at once: there is no ping-pong inside a program). The unmasked-tile loop
    prefetches two (D=128) or three (D=64) tiles ahead and the masked loops (one or two tiles per
    block) not at all: with one stage of lead the warps waited on K's TMA barrier at the top of
    every iteration (17 % of the forward's warp samples), and pipelining the masked loops as well
    makes ptxas serialize every wgmma (C7515). D=64 caps registers at 168 so that three CTAs fit
    per SM: 12 warps to hide latency for 120 B of spills, none in the unmasked-tile loop. The CPU
    (the interpreter) takes small tiles and pointer loads."""
    if device.type != "cuda":
        return FwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=1, use_tma=False)
    if fp8:
        if head_dim <= 64:
            return FwdConfig(block_m=64, block_n=128, num_warps=4, num_stages=4, maxnreg=168,
                             fold_lr=True, masked_stages=1)
        return FwdConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, fold_lr=True,
                         masked_stages=1)
    return FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


@dataclass(frozen=True)
class PersistentFwdConfig:
    """The persistent Gluon forward (forward_gluon): 64 query rows x 128 keys per tile, a
    two-stage K / V ring, two Q buffers, two CTAs per SM (maxnreg 128 x 8 warps: the consumer
    warpgroup setmaxnreg's up to 232, the producer warp down to producer_regs)."""
    block_m: int = 64
    block_n: int = 128
    stages: int = 2
    q_buffers: int = 2
    ctas_per_sm: int = 2
    maxnreg: int = 128
    producer_regs: int = 24


def uses_persistent_forward(head_dim: int, recipe, device) -> bool:
    """The fp8 recipes at D=128 on an sm_90 GPU run the persistent Gluon kernel.

    Its producer warp loads the next item's Q, K and V while the consumer computes, which short
    documents need: one program per (query block, head) pays a chain of exposed latencies (work
    list, Q, the diagonal tile's K then V) that 1-8 tiles cannot hide. H200, forward kernel ms,
    Triton -> persistent: doc512_x64 0.599 -> 0.485, doc2k_x16 1.117 -> 1.039, longtail 2.886 ->
    2.827, doc32k 12.88 -> 12.77, doc8k_x4 3.283 -> 3.344. At D=64 it is 9 % slower
    (d64_doc8k_x4 2.507 -> 2.736): D=64 keeps the Triton kernel."""
    if interpreting() or _recipe_name(recipe) not in FP8_RECIPES or head_dim != 128:
        return False
    return is_sm90(torch.device(device)) and HAVE_GLUON


def forward_config(head_dim: int, recipe, device) -> FwdConfig | PersistentFwdConfig:
    """The config of the forward kernel a call runs (its type says which kernel)."""
    if uses_persistent_forward(head_dim, recipe, device):
        return PersistentFwdConfig()
    return triton_forward_config(head_dim, _recipe_name(recipe) != "bf16", torch.device(device))


def vt_mma_order(head_dim: int, recipe, device) -> bool:
    """The column order quantize_qkv writes V^T in: wgmma key order for the Triton forward (P's
    registers are then the PV wgmma's A operand as they are: flamia.ops.kmajor), token order for
    the persistent Gluon kernel."""
    return not uses_persistent_forward(head_dim, recipe, device)
