"""Which kernel runs where, and every tunable of the kernels.

`select(head_dim, recipe, device)` resolves, for one call, the forward kernel and its config and
the backward's kernels and their configs; the launchers take these configs (tests and
benchmarks may pass their own). Nothing here reads the environment: what runs depends on the
device, the recipe, the head dim, the input dtype and (for one backward choice) the longest
document, never on a switch. Tile shapes were measured on the H200 (benchmarks/NOTES.md).

    forward   fp8 / fp8_mixed at D=128 on sm_90: the persistent Gluon kernel (forward_gluon),
              PersistentFwdConfig, V^T quantized in token order
              otherwise: the Triton kernel (forward), FwdConfig, V^T in wgmma key order (fp8)
    backward  bf16 (bf16 or fp16 inputs) and fp8_block at D=64/128 on sm_90: the one-pass kernel
              (backward_sm90), Sm90BwdConfig (sm90_backward_config)
              fp8_block elsewhere (other GPUs, the CPU interpreter): ReferenceBwdConfig, the
              reference backward on the kernel forward's operands (no split kernel for it)
              fp8 / fp8_mixed on sm_90: preprocess + the Gluon dK/dV and dQ kernels
              (backward_gluon), BwdConfig with Gluon*Config / Mixed*Config
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
# The token-block recipe with kernels in both directions (its forward is the fp8 forward kernels'
# token-block mode; its backward the one-pass kernel's fp8 mode)
KVBLOCK_KERNEL_RECIPE = "fp8_block"
# The kernels' recipe ids (their RECIPE constexpr; BwdState.recipe)
RECIPE_IDS = {"fp8": 0, "fp8_mixed": 1, "bf16": 2}


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


@dataclass(frozen=True)
class QuantizeConfig:
    """quantize_qkv's launch (flamia.ops.quantize): tokens per row block, row blocks per
    program of the q rows, warps. Only the schedule: every choice writes the same bytes."""
    block_t: int
    sub: int
    num_warps: int = 4


def quantize_config(kvblock: bool) -> QuantizeConfig:
    """64-token row blocks; four per q program for the per-token recipes, one for the
    token-block ones: their launch is as wide as the K/V blocks' (T / 128 per K or V head), so
    with four only half of the q programs had work. H200, quantize_qkv(fp8_block) ms
    (benchmarks/quant_dev.py, results/quant_dev-20261203-840ce81-fp8_block.log): doc512_x64
    0.400 -> 0.344 at one, 0.387 at two; d64_doc8k_x4 0.451 -> 0.454 (even). The interpreter
    takes a K/V block (or 32 tokens) in one chunk: fewer interpreted steps."""
    if interpreting():
        return QuantizeConfig(128 if kvblock else 32, 1)
    return QuantizeConfig(64, 1 if kvblock else 4)


def uses_persistent_forward(head_dim: int, recipe, device) -> bool:
    """The fp8 recipes at D=128 on an sm_90 GPU run the persistent Gluon kernel.

    Its producer warp loads the next item's Q, K and V while the consumer computes, which short
    documents need: one program per (query block, head) pays a chain of exposed latencies (work
    list, Q, the diagonal tile's K then V) that 1-8 tiles cannot hide. H200, forward kernel ms,
    Triton -> persistent: doc512_x64 0.599 -> 0.485, doc2k_x16 1.117 -> 1.039, longtail 2.886 ->
    2.827, doc32k 12.88 -> 12.77, doc8k_x4 3.283 -> 3.344. At D=64 it is 9 % slower
    (d64_doc8k_x4 2.507 -> 2.736): D=64 keeps the Triton kernel."""
    if (interpreting() or _recipe_name(recipe) not in (*FP8_RECIPES, KVBLOCK_KERNEL_RECIPE)
            or head_dim != 128):
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


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GluonDkdvConfig:
    """The fp8 recipe's Gluon dK/dV kernel (backward_gluon._dkdv_fp8_kernel)."""
    bn: int = 64            # keys per CTA: 16 * num_warps (one m64 wgmma row block per warpgroup)
    bm: int = 64            # query rows per step
    stages: int = 2         # TMA ring depth (D=128: 2 keeps ~90 KB smem -> 2 CTAs / SM)
    num_warps: int = 4
    # ws: FA3's layout, bn=128 and two consumer warpgroups (num_warps=8) in one CTA per SM, fed
    # by a 1-warp TMA producer partition at producer_regs registers (constexpr WS)
    ws: bool = False
    producer_regs: int = 24
    # threshold_mask: both masks as one compare per element against a per-column threshold
    # (constexpr THR_MASK; the same predicate). late_dv: the dV GEMM issued after the dS^T
    # operand, not overlapping its math (constexpr LATE_DV): 32 fewer live registers.
    threshold_mask: bool = False
    late_dv: bool = False
    # key_order_dv / key_order_dk: the A operand a8 = P^T sdo of the dV GEMM / b8 = dS^T of the
    # dK GEMM goes in as its registers already are an fp8 wgmma A operand (queries in
    # kmajor.mma_order16 order within 16-query groups), with doT8 / qT8 written in the same
    # column order by launch_preprocess, instead of a cross-lane conversion
    key_order_dv: bool = False
    key_order_dk: bool = False


@functools.lru_cache(maxsize=None)
def gluon_dkdv_config(head_dim: int) -> GluonDkdvConfig:
    """H200, ms (doc8k_x4 / longtail / doc32k at D=128): D=128 one warpgroup per 64 keys with
    late_dv + threshold_mask 8.10 / 8.11 / 32.30 (without them 9.62 / 9.01 / 37.54): SASS per
    tile 1132 -> 1010, spills 204 -> 80 B. D=64 FA3's layout with key-ordered A operands:
    d64_doc8k_x4 6.51 -> 5.95 (key orders: 692 -> 643 SASS per tile, no spills)."""
    if head_dim <= 64:
        return GluonDkdvConfig(bn=128, stages=3, num_warps=8, ws=True, key_order_dv=True,
                               key_order_dk=True)
    return GluonDkdvConfig(stages=2, late_dv=True, threshold_mask=True)


@dataclass(frozen=True)
class GluonDqConfig:
    """The fp8 recipe's persistent Gluon dQ kernel (backward_gluon._dq_fp8_persistent_kernel):
    ctas_per_sm CTAs per SM walk the forward's work list, a 1-warp producer (producer_regs)
    running ahead across items; one consumer warpgroup of bm = 64 query rows."""
    bm: int = 64
    bn: int = 64            # keys per step
    stages: int = 3         # kv ring depth
    q_buffers: int = 1      # q8 / do8 buffers (2: the next item's pair loads during this one)
    ctas_per_sm: int = 2
    maxnreg: int = 128      # 8 warps x 128: 2 CTAs / SM; the consumer setmaxnreg's up to ~232
    producer_regs: int = 24


@functools.lru_cache(maxsize=None)
def gluon_dq_config(head_dim: int) -> GluonDqConfig:
    """H200, ms, one program per (query block, head) -> persistent: doc512_x64 0.72 -> 0.62,
    doc2k_x16 1.67 -> 1.54, longtail 4.54 -> 4.17, doc8k_x4 5.74 -> 5.27, d64_doc8k_x4 4.22 ->
    4.07 (bitwise the same results)."""
    return GluonDqConfig(stages=4 if head_dim <= 64 else 3)


@dataclass(frozen=True)
class MixedDkdvConfig:
    """The fp8_mixed recipe's Gluon dK/dV kernel (backward_gluon._dkdv_mixed_kernel)."""
    bn: int = 64            # keys per CTA (one warpgroup: 16 * num_warps)
    bm: int = 64            # query rows per step
    stages: int = 2         # TMA ring depth (D=128: ~106 KB smem -> 2 CTAs / SM)
    num_warps: int = 4
    # lazy_cols: the tile's query indices computed inside the masked branches only (constexpr
    # LAZY; backward_gluon._cols_of; SASS per tile at D=128: 1147 -> 1075)
    lazy_cols: bool = False


@functools.lru_cache(maxsize=None)
def mixed_dkdv_config(head_dim: int) -> MixedDkdvConfig:
    """lazy_cols at D=128 (H200, ms: doc8k_x4 11.92 -> 10.16, longtail 10.87 -> 9.40, doc32k
    46.87 -> 40.07; at D=64 7.17 -> 6.99 but d64_longtail 5.55 -> 5.64: not taken)."""
    return MixedDkdvConfig(stages=3 if head_dim <= 64 else 2, lazy_cols=head_dim > 64)


@dataclass(frozen=True)
class MixedDqConfig:
    """The fp8_mixed recipe's Gluon dQ kernel (backward_gluon._dq_mixed_kernel)."""
    bm: int = 64            # query rows per CTA (16 * num_warps)
    bn: int = 64            # keys per step
    stages: int = 2         # kv ring depth (D=128: 40.5 KB per stage)
    num_warps: int = 4


@functools.lru_cache(maxsize=None)
def mixed_dq_config(head_dim: int) -> MixedDqConfig:
    return MixedDqConfig(stages=3 if head_dim <= 64 else 2)


@dataclass(frozen=True)
class BwdConfig:
    """The split backward (backward.py): preprocess, then dK/dV and dQ. dkdv / dq: the Gluon
    kernels' configs on sm_90 (their type says which kernel), None: the Triton kernels with the
    tiles below. Triton dK/dV: kv_bn kv rows per program, kv_bm query rows per step
    (kv_bn % kv_bm == 0); dQ: q_bm query rows per program, q_bn kv rows per step."""
    kv_bn: int = 128
    kv_bm: int = 64
    kv_warps: int = 8
    kv_stages: int = 2
    q_bm: int = 128
    q_bn: int = 64
    q_warps: int = 8
    q_stages: int = 2
    pre_bt: int = 64
    pre_warps: int = 4
    # dK and dV in two launches (each recomputes S^T; half the accumulator registers each, so
    # larger query steps fit): kv_bm for the dK launch, kv_bm_dv for the dV launch.
    split_dkdv: bool = False
    kv_bm_dv: int = 64
    dkdv: GluonDkdvConfig | MixedDkdvConfig | None = None
    dq: GluonDqConfig | MixedDqConfig | None = None


# Longest document from which the Triton fp8_mixed backward splits its dK/dV launch.
SPLIT_DKDV_MIN_SEQLEN = 4096


def split_backward_config(head_dim: int, recipe, max_seqlen: int | None = None,
                          gluon: bool = False) -> BwdConfig:
    """The split backward's config; gluon: with the Gluon dK/dV and dQ kernels of the fp8
    recipes (an sm_90 GPU). The Triton kernels' tiles come from the sm_90a compile analysis
    and the H200 A/Bs of their time: the dK/dV kernel keeps dK and dV (BN x D fp32) live plus ~6
    (BN x BM) temporaries, and at D=128 BM=32 spills least (fp8 ~0.4 KB). fp8_mixed at D=128
    runs dK and dV as two launches with BM=64 (each holds one accumulator): 112 -> 90 ms at
    doc32k and 29 -> 24 ms at doc8k_x4 despite recomputing S^T, but slower on short documents,
    so only when the longest document has at least SPLIT_DKDV_MIN_SEQLEN tokens; fp8 loses with
    the split (76 -> 86 ms at doc32k)."""
    name = _recipe_name(recipe)
    if head_dim <= 64:
        cfg = BwdConfig(kv_bn=128, kv_bm=64, kv_warps=8, q_bm=128, q_bn=64, q_warps=8)
    elif name == "fp8_mixed" and (max_seqlen or 0) >= SPLIT_DKDV_MIN_SEQLEN:
        cfg = BwdConfig(kv_bn=128, kv_bm=64, kv_warps=8, kv_stages=2, split_dkdv=True,
                        kv_bm_dv=64)
    elif name in FP8_RECIPES:
        cfg = BwdConfig(kv_bn=128, kv_bm=32, kv_warps=8, kv_stages=2)
    else:
        cfg = BwdConfig()
    if gluon and name == "fp8":
        cfg = replace(cfg, dkdv=gluon_dkdv_config(head_dim), dq=gluon_dq_config(head_dim))
    elif gluon and name == "fp8_mixed":
        cfg = replace(cfg, dkdv=mixed_dkdv_config(head_dim), dq=mixed_dq_config(head_dim))
    return cfg


def uses_gluon_backward(head_dim: int, recipe, device) -> bool:
    """The fp8 recipes at D=64/128 on an sm_90 GPU run the Gluon dK/dV and dQ kernels (H200:
    dK/dV 1.6-1.9x and dQ 1.4-1.8x the Triton kernels)."""
    if interpreting() or _recipe_name(recipe) not in FP8_RECIPES or head_dim not in (64, 128):
        return False
    return is_sm90(torch.device(device)) and HAVE_GLUON


def uses_sm90_backward(head_dim: int, recipe, device, dtype=torch.bfloat16) -> bool:
    """The one-pass Hopper kernel (backward_sm90) runs the backward of the bf16 recipe (bf16 and
    fp16 inputs: P and dS feed its GEMMs in the inputs' dtype, as the split kernels do) and of
    fp8_block, on an sm_90 GPU at head dims 64 and 128."""
    name = _recipe_name(recipe)
    if head_dim not in (64, 128) or interpreting() or not HAVE_GLUON:
        return False
    if name == "bf16" and dtype not in (torch.bfloat16, torch.float16):
        return False
    if name not in ("bf16", KVBLOCK_KERNEL_RECIPE):
        return False
    return is_sm90(torch.device(device))


# The one-pass Hopper backward's fixed shape: 128 keys per CTA (64 per MMA warpgroup; fp8_block's
# K/V scale block, so not a tunable), a 2-deep Q / dO ring (shared memory holds no third stage
# at D=128), setmaxnreg 24 for the loader and dQ-writer warps (the MMA warpgroups get 240), and
# 64 rows per program in the bf16 pre and post passes.
SM90_BLOCK_N = 128
SM90_STAGES = 2
SM90_LOADER_REGS = 24
SM90_DQ_REGS = 24
SM90_PASS_ROWS = 64


@dataclass(frozen=True)
class Sm90BwdConfig:
    """What varies in the one-pass Hopper backward (backward_sm90) and its fp8 passes."""
    block_m: int                # query rows per step
    fp8_pre_warps: int = 8      # fp8_block: warps of the preprocess (one 64-row dO block each)
    fp8_post_rows: int = 64     # fp8_block: rows and warps of the post pass
    fp8_post_warps: int = 4

    @property
    def name(self) -> str:
        return f"m{self.block_m}n{SM90_BLOCK_N}"


def sm90_backward_config(head_dim: int) -> Sm90BwdConfig:
    """The one-pass backward's tiles (H200, benchmarks/NOTES.md): 128 keys per CTA; 64 query
    rows per step at D=128 (128 rows do not fit the registers next to dK and dV), 128 at D=64
    (bf16: 12-16 % faster than 64; fp8_block: 14-18 % faster, its per-query vectors loaded one
    at a time). fp8_block's passes: preprocess at 8 warps (0.46 ms against 0.53 at 4, doc512_x64),
    post pass at 64 rows x 4 warps (0.36-0.44 ms; 128 x 8 0.71-0.77, 32 x 4 0.57, several
    blocks per program 0.37-0.39 at doc32k). The same for both recipes."""
    if head_dim not in (64, 128):
        raise ValueError(f"the sm90 backward supports head dims 64 and 128, not {head_dim}")
    return Sm90BwdConfig(block_m=128 if head_dim == 64 else 64)


@dataclass(frozen=True)
class ReferenceBwdConfig:
    """fp8_block's backward where the one-pass kernel does not run (other GPUs, the CPU
    interpreter): flamia.reference.backward in fp32 on the kernel forward's operands
    (layout.reference_saved). The same function as the kernel's, not its speed."""


def backward_config(head_dim: int, recipe, device, max_seqlen: int | None = None,
                    dtype=torch.bfloat16):
    """The config of the backward a call runs: Sm90BwdConfig (the one-pass kernel),
    ReferenceBwdConfig (fp8_block off sm_90) or the split backward's BwdConfig."""
    if uses_sm90_backward(head_dim, recipe, device, dtype):
        return sm90_backward_config(head_dim)
    if _recipe_name(recipe) == KVBLOCK_KERNEL_RECIPE:
        return ReferenceBwdConfig()
    return split_backward_config(head_dim, recipe, max_seqlen,
                                 gluon=uses_gluon_backward(head_dim, recipe, device))


@dataclass(frozen=True)
class Selection:
    """What one call runs (select)."""
    vt_mma_order: bool          # the V^T column order quantize_qkv writes for the forward
    forward: FwdConfig | PersistentFwdConfig
    backward: object            # BwdConfig, Sm90BwdConfig or ReferenceBwdConfig


def select(head_dim: int, recipe, device, max_seqlen: int | None = None,
           dtype=torch.bfloat16) -> Selection:
    """The kernels and configs of a call with this head dim, recipe, device, longest document
    and input dtype (the module docstring's table)."""
    return Selection(vt_mma_order(head_dim, recipe, device),
                     forward_config(head_dim, recipe, device),
                     backward_config(head_dim, recipe, device, max_seqlen, dtype))
