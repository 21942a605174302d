"""Which kernel runs where, and every tunable of the kernels.

`select(head_dim, recipe, device)` resolves, for one call, the forward kernel and the backward's
kernels and their configs; the launchers take these configs (tests and benchmarks may pass their
own). Nothing here reads the environment: what runs depends on the device, the recipe, the head dim
and the input dtype, never on a switch. Tile shapes: benchmarks/NOTES.md.

    forward   fp8 at D=128 on sm_90: the persistent Gluon kernel (forward_gluon),
              PersistentFwdConfig (on GQA pairs for long documents: PAIR_FWD_CONFIG);
              otherwise the Triton kernel (forward), FwdConfig
    backward  bf16 and fp8 at D=64/128 on sm_90: the one-pass kernel (backward_sm90),
              Sm90BwdConfig; elsewhere (other GPUs, the CPU interpreter) ReferenceBwdConfig
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import device_name, interpreting, is_sm90
from .gluon_common import HAVE_GLUON

# The FP8 recipe with kernels (token-block scaling); the other kernel recipe is bf16
FP8_RECIPE = "fp8"


def _recipe_name(recipe) -> str:
    return getattr(recipe, "name", recipe)


@dataclass(frozen=True)
class FwdConfig:
    """The Triton forward kernel (forward._attn_fwd_kernel)."""
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    use_tma: bool = True        # TMA descriptors for Q/K/V tiles (pointer loads otherwise)
    maxnreg: int | None = None  # register cap per thread (e.g. 168: three 4-warp CTAs per SM)
    # fold_lr: exp2(s * row_f - (m - lr)) instead of exp2((s * row_f - m) + lr): the per-row offset
    # joins the per-row max once per tile, not once per score. Rounding differs by one fp32 add on
    # the exponent (|m| 2^-24).
    fold_lr: bool = False
    # masked_stages: pipeline depth of the masked-tile loops (head / diagonal / document end, one or
    # two tiles per query block); None = num_stages. 1 (no prefetch there) lets ptxas keep the
    # unmasked loop's wgmmas asynchronous at num_stages = 3; pipelined masked loops make it
    # serialize every wgmma (C7515: non-wgmma code defining accumulator registers in a stage).
    masked_stages: int | None = None


def triton_forward_config(head_dim: int, fp8: bool, device: torch.device) -> FwdConfig:
    """Tile shapes of the Triton forward per head dim. FP8: 64x128 tiles at 4 warps, so one CTA's
    softmax overlaps another's MMAs (Triton has no ping-pong inside a program); the unmasked loop
    prefetches 2 (D=128) or 3 (D=64) tiles, the masked loops none (masked_stages); D=64 caps
    registers at 168 for three CTAs per SM. The CPU takes small tiles and pointer loads."""
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
    warpgroup setmaxnreg's up to 232, the producer warp down to producer_regs).
    heads_per_cta=2 (PAIR_FWD_CONFIG): each item is the query block of two query heads of one GQA
    group, one consumer warpgroup each (both at what the launch's maxnreg leaves beside the
    producer's warpgroup: forward_gluon.launch), sharing every K / V tile, taking turns at the
    tensor cores; one CTA per SM."""
    block_m: int = 64
    block_n: int = 128
    stages: int = 2
    q_buffers: int = 2
    ctas_per_sm: int = 2
    maxnreg: int = 128
    producer_regs: int = 24
    heads_per_cta: int = 1


# The GQA pair: 384 threads (two consumer warpgroups, the producer warp rounded up to a third)
# launch at 65536 / 384 registers rounded down to 8, setmaxnreg moves the producer's share to the
# second consumer. Against the one-head kernel (H100, forward kernel alone, paired,
# benchmarks/NOTES.md 2026-12-07): -6 to -8 % at a 32k document, -3 to -13 % at 8k, -3 to -7 % at
# longtail (documents up to 12.5k), +3.5 to +4.5 % at 2k, +15 % at 512: sharing K / V halves the
# L2 traffic per FLOP, which long documents are bound by, and one CTA per SM leaves an item's
# serial start and end unhidden, which short documents pay for.
PAIR_FWD_CONFIG = PersistentFwdConfig(ctas_per_sm=1, maxnreg=65536 // 384 // 8 * 8,
                                      heads_per_cta=2)
PAIR_FWD_MIN_SEQLEN = 4096     # max_seqlen from which the pair runs (measured: 2048 loses, 8192 wins)


@dataclass(frozen=True)
class QuantizeConfig:
    """quantize_qkv's launches: tokens per q program, warps of the q programs and of the K / V block
    programs (one 128-token block each), columns and warps of the V column programs
    (_kvblock_cols_kernel), and on sm_90 the Gluon q and K / V kernels' warps (q: and lanes per
    token). Only the schedule: every choice writes the same bytes, except that the Gluon kernels
    rotate by butterflies (fp32 sums in another order than the Triton kernels' GEMM with the +-1
    matrix: a value on an e4m3 rounding tie may round the other way) and sum V's norms over a
    token's lanes in their own order. quantize_config(head_dim) gives the measured choice."""
    block_t: int = 64
    q_warps: int = 4
    kv_warps: int = 8
    cols_block: int = 128
    cols_warps: int = 4
    # sm_90 at D=64 / 128 (the Gluon kernels; block_t, q_warps and kv_warps are the Triton
    # kernels' elsewhere): q at this many warps, a token per q_gluon_tpr lanes (1, 2 or 4); K
    # and V at kv_gluon_warps (4, 8 or 16: a token per 1, 2 or 4 lanes of a 128-token block)
    q_gluon_warps: int = 4
    q_gluon_tpr: int = 2
    kv_gluon_warps: int = 8


def quantize_config(head_dim: int) -> QuantizeConfig:
    """quantize_qkv's launches at this head dim (H100, one process, benchmarks/NOTES.md): 128
    columns per V column program (whole quantize_qkv -0.2 to -2 % against 64); the Gluon q kernel
    at 4 warps x 2 lanes per token (-0.02 to -0.05 ms per call at D=128, within +-4 % at D=64);
    the Gluon K / V kernel (-0.01 to -0.03 ms per call against Triton's) at 8 warps at D=128 (4
    warps hold a 128-wide row per thread: 228 registers) and 4 at D=64 (-0.004 to -0.02 ms
    against 8)."""
    return QuantizeConfig(kv_gluon_warps=4 if head_dim <= 64 else 8)


def uses_persistent_forward(head_dim: int, recipe, device) -> bool:
    """fp8 at D=128 on sm_90 runs the persistent Gluon kernel: its producer warp loads the next item
    while the consumer computes, which short documents need; at D=64 the Triton kernel is faster."""
    if interpreting() or _recipe_name(recipe) != FP8_RECIPE or head_dim != 128:
        return False
    return is_sm90(torch.device(device)) and HAVE_GLUON


def forward_config(head_dim: int, recipe, device, max_seqlen: int | None = None,
                   group: int = 1) -> FwdConfig | PersistentFwdConfig:
    """The config of the forward kernel a call runs (its type says which kernel). The persistent
    kernel takes the GQA pair (PAIR_FWD_CONFIG) when the group (Hq / Hkv) is even and the call's
    max_seqlen is at least PAIR_FWD_MIN_SEQLEN (None: unknown, the one-head kernel)."""
    if uses_persistent_forward(head_dim, recipe, device):
        if group % 2 == 0 and max_seqlen is not None and max_seqlen >= PAIR_FWD_MIN_SEQLEN:
            return PAIR_FWD_CONFIG
        return PersistentFwdConfig()
    return triton_forward_config(head_dim, _recipe_name(recipe) != "bf16", torch.device(device))


def uses_sm90_backward(head_dim: int, recipe, device, dtype=torch.bfloat16) -> bool:
    """The one-pass Hopper kernel (backward_sm90) runs the backward of bf16 (16-bit operands: P and
    dS feed its GEMMs in their dtype) and fp8 on sm_90 at head dims 64 and 128."""
    name = _recipe_name(recipe)
    if head_dim not in (64, 128) or interpreting() or not HAVE_GLUON:
        return False
    if name == "bf16" and dtype not in (torch.bfloat16, torch.float16):
        return False
    if name not in ("bf16", FP8_RECIPE):
        return False
    return is_sm90(torch.device(device))


# The one-pass Hopper backward's fixed shape: 128 keys per CTA (64 per MMA warpgroup; fp8's K/V
# scale block, so not a tunable), a 2-deep Q / dO ring (shared memory holds no third stage at
# D=128), setmaxnreg 24 for the loader and dQ-writer warps (the MMA warpgroups get 240), and 64 rows
# per program in the bf16 pre and post passes.
SM90_BLOCK_N = 128
SM90_STAGES = 2
SM90_LOADER_REGS = 24
SM90_DQ_REGS = 24
SM90_PASS_ROWS = 64

# The Triton forward's CTA order (forward._attn_fwd_kernel): the CTAs of this many KV heads
# interleave (then item, heaviest first), so that the CTAs resident together share those heads'
# K / V in L2; 2 beat 1, 4, 8 and every head in one A/B at D=64 (benchmarks/NOTES.md).
FWD_KV_CHUNK = 2


@dataclass(frozen=True)
class Sm90BwdConfig:
    """What varies in the one-pass Hopper backward (backward_sm90) and its fp8 passes."""
    block_m: int                # query rows per step
    fp8_pre_warps: int = 8      # fp8: warps of the preprocess (one 64-row dO block each)
    fp8_post_rows: int = 64     # fp8: rows and warps of the post pass
    fp8_post_warps: int = 4
    fp8_kmajor_onchip: bool = False  # fp8, D=128: the kernel makes Q^T / dO^T in shared memory


# fp8 at D=128: up to this max_seqlen the kernel's helper warps make Q^T and dO^T from the q8 /
# do8 tiles, instead of the preprocess writing K-major copies for the kernel to load. The
# preprocess transposes each token once; the kernel once per key block that visits it, so the
# in-kernel cost grows with the document while the saved pass does not. Whole fp8 backward on an
# H100 (benchmarks/NOTES.md, 2026-12-06 twenty-second session): -5 % at 512-token documents, -3 %
# at 2048, +4 % at 3072. On an H200 (4.8 against 3.35 TB/s of DRAM, so the saved pass costs
# less) the mode loses at every length measured (+1 % at 512, +11 % at 2048, +16 % at 3072; same
# session): it is never selected there.
SM90_FP8_ONCHIP_MAX_SEQLEN = 2048
SM90_FP8_ONCHIP_OFF = ("H200",)     # device names (substrings) where the mode is never selected


def fp8_onchip_max_seqlen(device=None) -> int:
    """The longest document for which the fp8 backward at D=128 makes Q^T / dO^T in the kernel
    on `device` (None: the current CUDA device; 0: never). A device that is not CUDA (host-side
    tools that run the sm_90 path on CPU tensors) gets the default."""
    if device is None:
        if not torch.cuda.is_available():
            return SM90_FP8_ONCHIP_MAX_SEQLEN
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and any(s in device_name(device) for s in SM90_FP8_ONCHIP_OFF):
        return 0
    return SM90_FP8_ONCHIP_MAX_SEQLEN


def sm90_backward_config(head_dim: int, max_seqlen: int | None = None,
                         device=None) -> Sm90BwdConfig:
    """The one-pass backward's tiles, both recipes: 64 query rows per step at D=128 (128 do not fit
    next to dK and dV), 128 at D=64; fp8's preprocess at 8 warps, post pass 64 rows x 4 warps;
    fp8's K-major Q^T / dO^T made in the kernel at D=128 for documents of at most
    fp8_onchip_max_seqlen(device) tokens (max_seqlen; None: loaded from the preprocess's copies).
    At D=64 the kernel always loads them: its step, at its register limit, spills with the
    transposition's barriers."""
    if head_dim not in (64, 128):
        raise ValueError(f"the sm90 backward supports head dims 64 and 128, not {head_dim}")
    onchip = (head_dim == 128 and max_seqlen is not None
              and max_seqlen <= fp8_onchip_max_seqlen(device))
    return Sm90BwdConfig(block_m=128 if head_dim == 64 else 64, fp8_kmajor_onchip=onchip)


@dataclass(frozen=True)
class ReferenceBwdConfig:
    """The backward where the one-pass kernel does not run (other GPUs, the CPU interpreter):
    flamia.reference.backward in fp32 on the kernel forward's operands
    (layout.reference_saved). The same function as the kernel's, not its speed."""


def backward_config(head_dim: int, recipe, device, dtype=torch.bfloat16,
                    max_seqlen: int | None = None):
    """The config of the backward a call runs: Sm90BwdConfig (the one-pass kernel) or
    ReferenceBwdConfig. max_seqlen: the call's bound on document length (a performance choice
    only, sm90_backward_config)."""
    if uses_sm90_backward(head_dim, recipe, device, dtype):
        return sm90_backward_config(head_dim, max_seqlen, device)
    return ReferenceBwdConfig()


@dataclass(frozen=True)
class Selection:
    """What one call runs (select)."""
    forward: FwdConfig | PersistentFwdConfig
    backward: object            # Sm90BwdConfig or ReferenceBwdConfig


def select(head_dim: int, recipe, device, dtype=torch.bfloat16) -> Selection:
    """The kernels and configs of a call with this head dim, recipe, device and input dtype
    (the module docstring's table)."""
    return Selection(forward_config(head_dim, recipe, device),
                     backward_config(head_dim, recipe, device, dtype))
