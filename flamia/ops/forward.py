"""FlashAttention-style forward over packed documents on the quantized operands (QuantizedQKV).

Per (query head, work item = one query block of one document) the program keeps its Q tile and
walks the KV tiles of its document only: first the tiles entirely left of the diagonal without
any mask, then the diagonal / document-end tiles with the mask. Fully masked tiles are never
visited and no tile crosses into another document's rows unmasked.

FP8 numerics (flamia/reference.py): with scores S_ij = sq_i sk_j (q8_i . k8_j) * scale,
    x_ij = dot(q8, k8^T)_ij * sk_j * (sq_i * scale * log2 e)          (log2 units)
    p'_ij = exp2(x_ij - m_i + lr_i),  lr_i = log2(256 / cap_i)           (= p_ij * 256 / cap_i)
    A_ij  = e4m3(p'_ij * sv_j)                                          (= p_ij sv_j/cap_i 256)
    acc_i = sum_j A_ij v8_j,   l'_i = sum_j p'_ij,   O_i = acc_i / l'_i
Folding 256/cap_i into the exponent costs nothing per element (it shifts the row's max), and it
cancels in acc / l'. With the online max the rounding of A happens at the running max instead of
the final one (rescaled by alpha afterwards), as in every FlashAttention FP8 kernel: the result
matches the reference emulation by the FlashAttention rule, not bitwise. lr_i is capped at 100 so
l' cannot overflow; that only matters for V whose amax is below ~1e-26 (cap < 2^-92).

bf16 recipe: the same kernel with bf16 operands, no scales, P rounded to bf16.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import interpreting, is_sm90
from .kmajor import mma_key_order, mma_order16
from .layout import QuantizedQKV
from .schedule import Schedule, work_list

if interpreting():
    from . import _interp
    _interp.install()

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:   # pragma: no cover - older triton
    TensorDescriptor = None

LOG2E = 1.4426950408889634
LAST_KERNEL = None      # the last compiled forward kernel launched (diagnostics: registers, spills)


@dataclass(frozen=True)
class FwdConfig:
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    use_tma: bool = True        # TMA descriptors for Q/K/V tiles (pointer loads otherwise)
    v_kmajor: bool = True       # FP8 PV GEMM reads V from the K-major copy vt8
    maxnreg: int | None = None  # register cap per thread (e.g. 168: three 4-warp CTAs per SM)
    # fold_lr: exp2(s * row_f - (m - lr)) instead of exp2((s * row_f - m) + lr): the per-row
    # offset joins the per-row max once per tile, not once per score (-64 FADD per 64 x 128
    # tile per thread, 775 -> 713 SASS in the loop; benchmarks/sass_loop.py --kernel fwd).
    # Rounding differs by one fp32 add on the exponent (|m| 2^-24). The FP8 default on the H200
    # since session 6 (fwd_dev.py: doc8k_x4 4.10 -> 3.95 ms, doc512_x64 0.596 -> 0.587).
    fold_lr: bool = False
    # masked_stages: pipeline depth of the masked-tile loops (head / diagonal / document end,
    # one or two tiles per query block); None = num_stages. 1 (no prefetch there) is what lets
    # ptxas keep the unmasked loop's wgmmas asynchronous at num_stages = 3: with the masked
    # loops pipelined too, ptxas serializes every wgmma of the kernel (C7515, non-wgmma code
    # defining accumulator registers inside a pipeline stage).
    masked_stages: int | None = None
    # diag: a timing diagnostic with WRONG results. 1: the unmasked-tile loop does not apply the
    # per-key scales (s * sk_j, p * sv_j: 128 FMUL per 64 x 128 tile per thread), what K / V
    # scales shared by a whole key tile would save (they fold into per-row factors). Set by
    # FLAMIA_FWD_DIAG=1 on the default config, for A/Bs in one process (benchmarks/NOTES.md
    # session 16 item 3).
    diag: int = 0

    def with_(self, **kw) -> "FwdConfig":
        return replace(self, **kw)


def default_config(head_dim: int, fp8: bool, device: torch.device) -> FwdConfig:
    """Tile shapes per head dim (re-tuned from benchmarks/fwd_dev.py on the H200).

    FP8: 64x128 tiles with 4 warps, so one CTA's softmax overlaps another's MMAs (Triton waits on
    each wgmma at once, there is no ping-pong inside a program). The unmasked-tile loop prefetches
    two (D=128) or three (D=64) tiles ahead and the masked loops (one or two tiles per block) not
    at all: with the next tile's loads issued at the end of an iteration (where Triton's pipeliner
    puts them), one stage of lead left the warps waiting on K's TMA barrier at the top of every
    iteration, 17 % of the forward's warp samples (ncu source counters, benchmarks/NOTES.md
    session 9); pipelining the masked loops as well makes ptxas serialize every wgmma (C7515).
    H200, forward ms, default before -> now: doc8k_x4 3.95 -> 3.66, doc2k_x16 1.25 -> 1.17,
    longtail 3.23 -> 3.11, doc512_x64 0.58 -> 0.60, d64_doc8k_x4 3.03 -> 2.75, d64_longtail
    2.38 -> 2.27 (session 9 item 2); vt8 in wgmma key order (QuantizedQKV.vt8_mma_order) takes
    another 4 % off (item 9).
    D=64 also caps registers at 168 so that three CTAs fit per SM: 12 warps to hide latency for
    120 B of spills, none in the unmasked-tile loop (session 8 item 2).
    """
    if device.type != "cuda":
        return FwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=1, use_tma=False)
    if fp8:
        if head_dim <= 64:
            return FwdConfig(block_m=64, block_n=128, num_warps=4, num_stages=4, maxnreg=168,
                             fold_lr=True, masked_stages=1)
        return FwdConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, fold_lr=True,
                         masked_stages=1)
    return FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


def persistent_forward(head_dim: int, recipe, device) -> bool:
    """Does the default forward run the persistent Gluon kernel (forward_gluon.PERSISTENT_FWD[0])
    rather than _attn_fwd_kernel? Yes for the fp8 recipes at D=128 on an sm_90 GPU, whatever
    the document lengths.

    Its producer warp loads the next item's Q, K and V while the consumer computes, which short
    documents need: one program per (query block, head) pays a chain of exposed latencies (work
    list, Q, the diagonal tile's K then V) that 1-8 tiles cannot hide (benchmarks/NOTES.md,
    session 10). Since session 12 its tile loop (-S: each PV retired within its tile, so P's e4m3
    operand never crosses the loop's back edge, where the compiler repacked it with ~200 PRMT /
    LOP3 per tile) is as fast as the Triton kernel's on long documents too. H200, forward kernel
    ms, Triton -> persistent (fwd_gluon_dev.py, one process): doc512_x64 0.599 -> 0.485,
    doc2k_x16 1.117 -> 1.039, longtail 2.886 -> 2.827, doc32k 12.88 -> 12.77, doc8k_x4 3.283 ->
    3.344; at D=64 it is 9 % slower (d64_doc8k_x4 2.507 -> 2.736), so D=64 keeps the Triton
    kernel. The caller quantizes V^T in token order for it (quantize_qkv(vt_mma_order=False));
    FLAMIA_PERSISTENT_FWD=0 turns it off; =all takes it at D=64 too (for A/Bs)."""
    mode = os.environ.get("FLAMIA_PERSISTENT_FWD", "1")
    if mode == "0" or interpreting():
        return False
    if getattr(recipe, "name", recipe) not in ("fp8", "fp8_mixed"):
        return False
    if head_dim != 128 and not (mode == "all" and head_dim == 64):
        return False
    dev = torch.device(device)
    if not is_sm90(dev):
        return False
    from . import forward_gluon
    return forward_gluon.HAVE_GLUON


@triton.jit
def _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, kvh, lo, hi,
                K, V, SK, SV, stride_kt, stride_vn, stride_vd,
                D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                MASKED: tl.constexpr, FP8: tl.constexpr, USE_TMA: tl.constexpr,
                V_KMAJOR: tl.constexpr, FOLD_LR: tl.constexpr, LOOP_STAGES: tl.constexpr,
                V_MMA_ORDER: tl.constexpr, KEY_SCALES: tl.constexpr = True):
    """KV tiles [lo, hi) of the document (doc-local token indices); MASKED: diagonal/end tiles.
    V_MMA_ORDER: row p of a V tile (from vt8) is key mma_order16(p) of the tile (tiles start at
    16-aligned tokens), and P is passed to the PV wgmma in that key order too."""
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if V_MMA_ORDER:
        offs_v0 = mma_order16(offs_n0)      # the key of each V row
    else:
        offs_v0 = offs_n0
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=LOOP_STAGES):
        offs_n = start_n + offs_n0
        col_ok = (offs_n >= 0) & (offs_n < L)
        row0 = tl.multiple_of((tok0 + start_n).to(tl.int32), 16)    # absolute, 16-aligned
        # ---- S = Q K^T (fp32 accumulate) ----
        if USE_TMA:
            kt = K.load([row0, kvh * D]).T
        else:
            k_ptrs = K + (tok0 + offs_n)[None, :] * stride_kt + kvh * D + offs_d[:, None]
            if MASKED:
                kt = tl.load(k_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                kt = tl.load(k_ptrs)
        s = tl.dot(q, kt)
        if FP8 and KEY_SCALES:
            if MASKED:
                sk = tl.load(SK + offs_n, mask=col_ok, other=0.0)
            else:
                sk = tl.load(SK + offs_n)
            s = s * sk[None, :]
        # ---- online softmax in log2 units; the row's lr rides on the subtracted max ----
        if MASKED:
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= offs_n[None, :])
            x = tl.where(valid, s * row_f[:, None], float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, 1))
            if FOLD_LR:
                p = tl.math.exp2(x - (m_new - lr)[:, None])
            else:
                p = tl.math.exp2((x - m_new[:, None]) + lr[:, None])   # lr survives a huge max
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * row_f)     # row_f >= 0
            if FOLD_LR:
                p = tl.math.exp2(s * row_f[:, None] - (m_new - lr)[:, None])
            else:
                p = tl.math.exp2((s * row_f[:, None] - m_new[:, None]) + lr[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        # ---- O += P V ----
        if FP8:
            if MASKED:
                sv = tl.load(SV + offs_n, mask=col_ok, other=0.0)
            else:
                sv = tl.load(SV + offs_n)
            if KEY_SCALES:
                a = (p * sv[None, :]).to(tl.float8e4nv)      # sv_j / cap_i * 256 folded, RNE
            else:   # (FwdConfig.diag: timing only)
                a = p.to(tl.float8e4nv)
            if V_MMA_ORDER:
                # column p of the A operand = P's column mma_order16(p): every value stays in
                # the thread holding it (flamia.ops.kmajor's module docstring)
                a = mma_key_order(a)
        else:
            a = p.to(tl.bfloat16)
        offs_v = start_n + offs_v0
        v_ok = (offs_v >= 0) & (offs_v < L)
        if USE_TMA:
            if FP8 and V_KMAJOR:
                v = V.load([kvh * D, row0]).T
            else:
                v = V.load([row0, kvh * D])
            if MASKED:   # rows past the document end belong to the next one: never let a NaN in
                v = tl.where(v_ok[:, None], v, 0.0)
        else:
            v_ptrs = V + (tok0 + offs_n)[:, None] * stride_vn + offs_d[None, :] * stride_vd
            if MASKED:
                v = tl.load(v_ptrs, mask=v_ok[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs)
        acc = tl.dot(a, v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(Q, K, V, SQ, SK, SV, VCAP, O, LSE, ITEMS, CU,
                     stride_qt, stride_kt, stride_vn, stride_vd, stride_vh, stride_ot, stride_oh,
                     T, N_ITEMS, HQ, GROUP, qk_scale,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, FP8: tl.constexpr, USE_TMA: tl.constexpr,
                     V_KMAJOR: tl.constexpr, FOLD_LR: tl.constexpr, FULL_STAGES: tl.constexpr,
                     MASKED_STAGES: tl.constexpr, V_MMA_ORDER: tl.constexpr,
                     DIAG: tl.constexpr = 0):
    # Head fastest: the GROUP query heads of a KV head run side by side and share its tiles in L2,
    # and the item list is sorted heaviest first across all heads.
    pid = tl.program_id(0)
    head = pid % HQ
    item = pid // HQ
    doc = tl.load(ITEMS + item)
    if doc < 0:
        return
    blk = tl.load(ITEMS + N_ITEMS + item)
    start = tl.load(CU + doc)
    L = tl.load(CU + doc + 1) - start
    kvh = head // GROUP
    q_lo = blk * BLOCK_M
    offs_m = q_lo + tl.arange(0, BLOCK_M)          # doc-local rows
    offs_d = tl.arange(0, D)
    row_ok = offs_m < L
    tok0 = start.to(tl.int64)
    rows = tok0 + offs_m

    if USE_TMA:
        q = Q.load([(tok0 + q_lo).to(tl.int32), head * D])
    else:
        q = tl.load(Q + rows[:, None] * stride_qt + head * D + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
    if FP8:
        sq = tl.load(SQ + head * T + rows, mask=row_ok, other=0.0)
        row_f = sq * qk_scale
        cap = tl.load(VCAP + kvh * T + rows, mask=row_ok, other=1.0)
        # lr = log2(256 / cap): exact from the exponent bits (cap is a power of two or 0)
        ecap = ((cap.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        lr = tl.where(cap > 0.0, tl.minimum(8 - ecap, 100), 0).to(tl.float32)
    else:
        row_f = tl.zeros([BLOCK_M], tl.float32) + qk_scale
        lr = tl.zeros([BLOCK_M], tl.float32)

    m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    SKh = SK + kvh * T + tok0
    SVh = SV + kvh * T + tok0
    if USE_TMA:
        Vh = V
    else:
        Vh = V + kvh * stride_vh
    # KV tiles start at absolute token rows that are multiples of 16 (TMA needs 16-byte aligned
    # coordinates along vt8's token axis), so in doc-local keys tile j is [j*BN - shift, ...):
    #   a head tile holding `shift` keys of the previous document (masked), if shift > 0;
    #   full tiles left of the diagonal (no mask); the diagonal / document-end tiles (masked).
    shift = start % 16
    if CAUSAL:
        limit = q_lo                            # keys < q_lo are visible to every row
        hi = tl.minimum(q_lo + BLOCK_M, L)
    else:
        limit = L
        hi = L
    head_hi = tl.where(shift > 0, tl.minimum(BLOCK_N - shift, hi), -shift)
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, kvh, -shift, head_hi,
                                K, Vh, SKh, SVh, stride_kt, stride_vn, stride_vd,
                                D, BLOCK_N, CAUSAL, True, FP8, USE_TMA, V_KMAJOR, FOLD_LR,
                                MASKED_STAGES, V_MMA_ORDER)
    n_lo = tl.where(shift > 0, BLOCK_N - shift, 0)
    n_full = n_lo + (tl.maximum(limit - n_lo, 0) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, kvh, n_lo, n_full,
                                K, Vh, SKh, SVh, stride_kt, stride_vn, stride_vd,
                                D, BLOCK_N, CAUSAL, False, FP8, USE_TMA, V_KMAJOR, FOLD_LR,
                                FULL_STAGES, V_MMA_ORDER, DIAG != 1)
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, row_f, lr, offs_m, L, tok0, kvh, n_full, hi,
                                K, Vh, SKh, SVh, stride_kt, stride_vn, stride_vd,
                                D, BLOCK_N, CAUSAL, True, FP8, USE_TMA, V_KMAJOR, FOLD_LR,
                                MASKED_STAGES, V_MMA_ORDER)
    # ---- epilogue: O = acc / l', lse = ln2 * (m + log2 l' - lr) ----
    inv_l = 1.0 / l_i
    out = acc * inv_l[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i) - lr) * 0.6931471805599453
    tl.store(LSE + head * T + rows, lse, mask=row_ok)


def _descriptor(x: torch.Tensor, shape, strides, block_shape):
    """A host-side TMA descriptor over x's storage seen as a 2-D (rows, cols) matrix."""
    return TensorDescriptor(x, list(shape), list(strides), list(block_shape))


def attention_forward(qkv: QuantizedQKV, cu_seqlens: torch.Tensor, max_seqlen: int | None,
                      causal: bool, softmax_scale: float | None, out_dtype, *,
                      config: FwdConfig | None = None, schedule: Schedule | None = None,
                      poison: bool = False):
    """out (T, Hq, D) in out_dtype and lse (Hq, T) fp32 (natural log, softmax-scaled scores).

    The work list needs only cu_seqlens (max_seqlen: an upper bound on the document lengths).
    With config=None, a token-ordered vt8 (quantize_qkv(vt_mma_order=False)) and
    persistent_forward(D, ...) true, the persistent Gluon kernel runs instead.
    config picks tile sizes / warps / stages / TMA of _attn_fwd_kernel; schedule may be passed
    in to reuse one across calls (it must have been built for the same block sizes).
    poison=True: outputs start as NaN (tests).
    """
    T, Hq, Hkv, D = qkv.shape
    fp8 = qkv.recipe != "bf16"
    dev = qkv.q8.device
    if (config is None and fp8 and qkv.vt8 is not None and not qkv.vt8_mma_order
            and persistent_forward(D, qkv.recipe, dev)):
        from . import forward_gluon
        return forward_gluon.attention_forward_gluon(
            qkv, cu_seqlens, max_seqlen, causal, softmax_scale, out_dtype,
            config=forward_gluon.PERSISTENT_FWD[0], schedule=schedule, poison=poison)
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    if config is None:
        config = default_config(D, fp8, dev)
        if os.environ.get("FLAMIA_FWD_DIAG"):    # timing diagnostic, wrong results (FwdConfig)
            config = config.with_(diag=int(os.environ["FLAMIA_FWD_DIAG"]))
    use_tma = bool(config.use_tma and TensorDescriptor is not None)
    v_kmajor = bool(config.v_kmajor and fp8 and qkv.vt8 is not None)
    alloc = (lambda shape, dt: torch.full(shape, float("nan"), dtype=dt, device=dev)) if poison else \
        (lambda shape, dt: torch.empty(shape, dtype=dt, device=dev))
    out = alloc((T, Hq, D), out_dtype)
    lse = alloc((Hq, T), torch.float32)
    if T == 0:
        return out, lse
    BM, BN = config.block_m, config.block_n
    schedule = work_list(cu_seqlens, T, BM, BN, causal, schedule)

    q8, k8, v8 = qkv.q8, qkv.k8, qkv.v8
    for name, x in (("q", q8), ("k", k8), ("v", v8)):
        if x.stride(2) != 1 or x.stride(1) != D:
            raise ValueError(f"{name}8 must have layout (T, H, D) with unit-stride heads/dims")
    if v_kmajor:
        vt = qkv.vt8                                  # (Hkv, D, T_pad)
        stride_vn, stride_vd, stride_vh = 1, vt.stride(1), vt.stride(0)
    else:
        vt = v8
        stride_vn, stride_vd, stride_vh = v8.stride(0), 1, D
    if use_tma:
        # (T, H, D) with unit-stride heads/dims is a (T, H*D) matrix of row stride stride(0).
        Qa = _descriptor(q8, (T, Hq * D), (q8.stride(0), 1), (BM, D))
        Ka = _descriptor(k8, (T, Hkv * D), (k8.stride(0), 1), (BN, D))
        if v_kmajor:
            Va = _descriptor(vt, (Hkv * D, vt.shape[2]), (vt.stride(1), 1), (D, BN))
        else:
            Va = _descriptor(v8, (T, Hkv * D), (v8.stride(0), 1), (BN, D))
    else:
        Qa, Ka, Va = q8, k8, vt
    dummy = lse
    sq = qkv.sq if fp8 else dummy
    sk = qkv.sk if fp8 else dummy
    sv = qkv.sv if fp8 else dummy
    vcap = qkv.vcap if fp8 else dummy
    n_items = schedule.items.shape[1]
    grid = (n_items * Hq,)
    global LAST_KERNEL
    LAST_KERNEL = _attn_fwd_kernel[grid](
        Qa, Ka, Va, sq, sk, sv, vcap, out, lse, schedule.items, cu_seqlens,
        q8.stride(0), k8.stride(0), stride_vn, stride_vd, stride_vh, out.stride(0), out.stride(1),
        T, n_items, Hq, Hq // Hkv, scale * LOG2E,
        D=D, BLOCK_M=BM, BLOCK_N=BN, CAUSAL=bool(causal), FP8=fp8, USE_TMA=use_tma,
        V_KMAJOR=v_kmajor, FOLD_LR=bool(config.fold_lr), FULL_STAGES=config.num_stages,
        MASKED_STAGES=config.masked_stages or config.num_stages,
        V_MMA_ORDER=bool(v_kmajor and qkv.vt8_mma_order), DIAG=config.diag,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"maxnreg": config.maxnreg} if config.maxnreg else {}))
    return out, lse
