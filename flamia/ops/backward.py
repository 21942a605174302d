"""The portable backward: the Triton split kernels of the bf16 recipe, and the dispatch.

attention_backward runs, per config.backward_config, the one-pass Hopper kernel
(backward_sm90: bf16 and fp8 on sm_90), fp8's reference backward on the kernel forward's
operands elsewhere (ReferenceBwdConfig), or the three bf16 launches here (other GPUs, fp32
inputs, the CPU interpreter). Numerics: `flamia.reference.backward` for bf16 (P and dS rounded to
bf16, fp32 accumulation). Deterministic by construction (no atomics).

1. `_bwd_preprocess`, grid (token blocks, Hq): Delta_i = rowsum(bf16(dO_i) * O_i).
2. `_bwd_dkdv`, FA2 style, one program per (document, kv head, kv block j); it loops over the
   query heads of its GQA group and over the query blocks i >= j of its document (only tiles
   inside the causal triangle are visited; only the diagonal blocks are masked). Per tile:
       P^T = exp2(S^T - lse_i),  dV_j += bf16(P^T) dO_i,
       dS^T = P^T (V_j dO_i^T - Delta_i),  dK_j += bf16(dS^T) Q_i
3. `_bwd_dq`, one program per (document, query head, query block i), loop over kv blocks
   j <= i: recomputes S and dP; dQ_i += bf16(dS) K_j.
Epilogues multiply by softmax_scale and cast to the caller's dtype.

Tiles are aligned to document starts (cu_seqlens): no tile ever reads another document's
tokens (P2 by construction); rows past a document's end load lse = +inf so their P is exactly 0.
Under the Triton interpreter (CPU tests) bf16 tl.dot (the interpreter multiplies bf16 as raw
uint16) runs on bf16-valued fp32 operands.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import interpreting
from .config import BwdConfig, ReferenceBwdConfig, backward_config, split_backward_config
from .layout import QuantizedQKV, reference_saved

if interpreting():
    from . import interpreter
    interpreter.install()

LOG2E = 1.4426950408889634

# Test hook: fill every buffer this module allocates with NaN before the kernels run, so a test
# can check that every element it reads back was written.
POISON = False


@triton.jit
def _bf16_op(x, INTERP: tl.constexpr):
    """An operand of a bf16 GEMM (rounded to nearest even). In the interpreter, bf16-valued fp32
    (its tl.dot would multiply bf16's raw uint16 storage)."""
    if INTERP:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _mm(a, b, INTERP: tl.constexpr):
    """fp32-accumulating tile GEMM of two _bf16_op operands."""
    if INTERP:
        return tl.dot(a, b, out_dtype=tl.float32, input_precision="ieee")
    else:
        return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def _bwd_preprocess(dout, out, delta, T, stride_dot, stride_ot,
                    D: tl.constexpr, BLOCK_T: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    mask_t = offs_t < T
    m2 = mask_t[:, None]
    do = tl.load(dout + offs_t[:, None] * stride_dot + h * D + offs_d[None, :], mask=m2, other=0.0)
    o = tl.load(out + offs_t[:, None] * stride_ot + h * D + offs_d[None, :], mask=m2, other=0.0)
    do_used = do.to(tl.float32).to(tl.bfloat16).to(tl.float32)
    tl.store(delta + h * T + offs_t, tl.sum(do_used * o.to(tl.float32), axis=1), mask=mask_t)


@triton.jit
def _dkdv_tile(acc_dk, acc_dv, k, v, qk_scale2, offs_n, q8, dout, lse, delta,
               h, start, L, i0, T, stride_qt, stride_dot,
               D: tl.constexpr, BM: tl.constexpr, MASK: tl.constexpr, INTERP: tl.constexpr):
    offs_m = i0 + tl.arange(0, BM)             # document-relative query positions
    offs_d = tl.arange(0, D)
    mask_m = offs_m < L
    tok_m = start + offs_m
    m2 = mask_m[:, None]
    q = _bf16_op(tl.load(q8 + tok_m[:, None] * stride_qt + h * D + offs_d[None, :], mask=m2,
                         other=0.0), INTERP)
    lse2 = tl.load(lse + h * T + tok_m, mask=mask_m, other=float("inf")) * 1.4426950408889634
    di = tl.load(delta + h * T + tok_m, mask=mask_m, other=0.0)
    # S^T (BN, BM) in log2 units, P^T = exp2(S^T - lse_i)
    p_t = tl.math.exp2(_mm(k, tl.trans(q), INTERP) * qk_scale2 - lse2[None, :])
    if MASK:
        p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
    do_b = _bf16_op(tl.load(dout + tok_m[:, None] * stride_dot + h * D + offs_d[None, :],
                            mask=m2, other=0.0), INTERP)
    acc_dv += _mm(_bf16_op(p_t, INTERP), do_b, INTERP)       # dV_j += bf16(P^T) dO_i
    ds_t = p_t * (_mm(v, tl.trans(do_b), INTERP) - di[None, :])
    acc_dk += _mm(_bf16_op(ds_t, INTERP), q, INTERP)         # dK_j += bf16(dS^T) Q_i
    return acc_dk, acc_dv


@triton.jit
def _bwd_dkdv(q8, k8, v8, dout, lse, delta, dk, dv, cu,
              T, stride_qt, stride_kt, stride_dot, stride_dkt, sm_scale, qk_scale2,
              HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, CAUSAL: tl.constexpr, INTERP: tl.constexpr):
    GROUP: tl.constexpr = HQ // HKV
    pid = tl.program_id(0)
    jb = tl.program_id(1)
    doc = pid // HKV
    hk = pid % HKV
    start = tl.load(cu + doc)
    L = tl.load(cu + doc + 1) - start
    n0 = jb * BN
    if n0 >= L:
        return
    offs_n = n0 + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    mask_n = offs_n < L
    tok_n = start + offs_n
    n2 = mask_n[:, None]
    k = _bf16_op(tl.load(k8 + tok_n[:, None] * stride_kt + hk * D + offs_d[None, :], mask=n2,
                         other=0.0), INTERP)
    v = _bf16_op(tl.load(v8 + tok_n[:, None] * stride_kt + hk * D + offs_d[None, :], mask=n2,
                         other=0.0), INTERP)
    acc_dk = tl.zeros([BN, D], dtype=tl.float32)
    acc_dv = tl.zeros([BN, D], dtype=tl.float32)
    if CAUSAL:
        diag_end = tl.minimum(n0 + BN, L)
        lo = n0
    else:
        diag_end = 0
        lo = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        # query blocks i0 (multiples of BM from the document start): the diagonal blocks
        # (causal mask), then the ones strictly below the diagonal
        for i0 in range(lo, diag_end, BM):
            acc_dk, acc_dv = _dkdv_tile(acc_dk, acc_dv, k, v, qk_scale2, offs_n, q8, dout, lse,
                                        delta, h, start, L, i0, T, stride_qt, stride_dot,
                                        D, BM, True, INTERP)
        for i0 in range(diag_end, L, BM):
            acc_dk, acc_dv = _dkdv_tile(acc_dk, acc_dv, k, v, qk_scale2, offs_n, q8, dout, lse,
                                        delta, h, start, L, i0, T, stride_qt, stride_dot,
                                        D, BM, False, INTERP)
    ptr = tok_n[:, None] * stride_dkt + hk * D + offs_d[None, :]
    tl.store(dk + ptr, (acc_dk * sm_scale).to(dk.dtype.element_ty), mask=n2)
    tl.store(dv + ptr, acc_dv.to(dv.dtype.element_ty), mask=n2)


@triton.jit
def _dq_tile(acc, q, do_i, qk_scale2, lse2, di, offs_m, k8, v8, hk, start, L, j0, stride_kt,
             D: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
             INTERP: tl.constexpr):
    offs_n = j0 + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    mask_n = offs_n < L
    tok_n = start + offs_n
    n2 = mask_n[:, None]
    k = _bf16_op(tl.load(k8 + tok_n[:, None] * stride_kt + hk * D + offs_d[None, :], mask=n2,
                         other=0.0), INTERP)
    v = _bf16_op(tl.load(v8 + tok_n[:, None] * stride_kt + hk * D + offs_d[None, :], mask=n2,
                         other=0.0), INTERP)
    p = tl.math.exp2(_mm(q, tl.trans(k), INTERP) * qk_scale2 - lse2[:, None])
    if MASK:
        if CAUSAL:
            p = tl.where((offs_n[None, :] <= offs_m[:, None]) & mask_n[None, :], p, 0.0)
        else:
            p = tl.where(mask_n[None, :], p, 0.0)
    ds = p * (_mm(do_i, tl.trans(v), INTERP) - di[:, None])
    return acc + _mm(_bf16_op(ds, INTERP), k, INTERP)


@triton.jit
def _bwd_dq(q8, k8, v8, dout, lse, delta, dq, cu,
            T, stride_qt, stride_kt, stride_dot, stride_dqt, sm_scale, qk_scale2,
            HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
            BN: tl.constexpr, CAUSAL: tl.constexpr, INTERP: tl.constexpr):
    GROUP: tl.constexpr = HQ // HKV
    pid = tl.program_id(0)
    doc = pid // HQ
    h = pid % HQ
    hk = h // GROUP
    start = tl.load(cu + doc)
    L = tl.load(cu + doc + 1) - start
    # Largest blocks first: program 0 of the second grid axis takes the document's last block.
    ib = tl.cdiv(L, BM) - 1 - tl.program_id(1)
    if ib < 0:
        return
    m0 = ib * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < L
    tok_m = start + offs_m
    m2 = mask_m[:, None]
    q = _bf16_op(tl.load(q8 + tok_m[:, None] * stride_qt + h * D + offs_d[None, :], mask=m2,
                         other=0.0), INTERP)
    lse2 = tl.load(lse + h * T + tok_m, mask=mask_m, other=float("inf")) * 1.4426950408889634
    di = tl.load(delta + h * T + tok_m, mask=mask_m, other=0.0)
    do_i = _bf16_op(tl.load(dout + tok_m[:, None] * stride_dot + h * D + offs_d[None, :],
                            mask=m2, other=0.0), INTERP)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    if CAUSAL:
        full_end = m0          # kv blocks entirely at or before the block's first row
        hi = tl.minimum(m0 + BM, L)
    else:
        full_end = (L // BN) * BN
        hi = L
    for j0 in range(0, full_end, BN):
        acc = _dq_tile(acc, q, do_i, qk_scale2, lse2, di, offs_m, k8, v8, hk, start, L, j0,
                       stride_kt, D, BN, False, CAUSAL, INTERP)
    for j0 in range(full_end, hi, BN):
        acc = _dq_tile(acc, q, do_i, qk_scale2, lse2, di, offs_m, k8, v8, hk, start, L, j0,
                       stride_kt, D, BN, True, CAUSAL, INTERP)
    tl.store(dq + tok_m[:, None] * stride_dqt + h * D + offs_d[None, :],
             (acc * sm_scale).to(dq.dtype.element_ty), mask=m2)


def _empty(shape, dtype, device):
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass
class BwdState:
    """Everything the three launches share: inputs, outputs, Delta."""
    T: int
    Hq: int
    Hkv: int
    D: int
    n_docs: int
    max_seqlen: int
    causal: bool
    sm_scale: float
    interp: bool
    cfg: BwdConfig
    dout: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    cu: torch.Tensor
    delta: torch.Tensor           # (Hq, T) fp32
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def make_state(dout, out, lse, qkv: QuantizedQKV, cu_seqlens, max_seqlen, causal=True,
               softmax_scale=None, config: BwdConfig | None = None,
               grad_dtype=None) -> BwdState:
    """Validate, allocate outputs and Delta (nothing launched). config: the tiles, by default
    config.split_backward_config(D)."""
    if qkv.recipe != "bf16":
        raise ValueError(f"the split backward kernels implement the bf16 recipe, not "
                         f"{qkv.recipe!r} (fp8 runs backward_sm90 or the reference)")
    T, Hq, Hkv, D = qkv.shape
    if Hq % Hkv:
        raise ValueError(f"Hkv={Hkv} must divide Hq={Hq}")
    if D not in (16, 32, 64, 128):
        raise ValueError(f"head dim {D} not supported by the backward kernels")
    if dout.shape != (T, Hq, D) or out.shape != (T, Hq, D) or lse.shape != (Hq, T):
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)}, lse {tuple(lse.shape)}"
                         f" do not match q8 {(T, Hq, D)}")
    if T * Hq * D >= 2 ** 31:
        raise ValueError("the backward kernels index with int32: T * Hq * D must stay below 2^31")
    cfg = config or split_backward_config(D)
    # a step wider than its block would walk the diagonal's tiles unmasked (tiles are powers of 2)
    if cfg.kv_bn % cfg.kv_bm or cfg.q_bm % cfg.q_bn:
        raise ValueError(f"bad block config {cfg}: kv_bm must divide kv_bn and q_bn q_bm")
    device = dout.device
    grad_dtype = grad_dtype or dout.dtype
    return BwdState(
        T=T, Hq=Hq, Hkv=Hkv, D=D, n_docs=cu_seqlens.numel() - 1, max_seqlen=int(max_seqlen),
        causal=bool(causal), sm_scale=D ** -0.5 if softmax_scale is None else float(softmax_scale),
        interp=device.type == "cpu", cfg=cfg, dout=dout.contiguous(), out=out.contiguous(),
        lse=lse.contiguous().float(), q8=qkv.q8.contiguous(), k8=qkv.k8.contiguous(),
        v8=qkv.v8.contiguous(), cu=cu_seqlens.to(device=device, dtype=torch.int32).contiguous(),
        delta=_empty((Hq, T), torch.float32, device),
        dq=_empty((T, Hq, D), grad_dtype, device), dk=_empty((T, Hkv, D), grad_dtype, device),
        dv=_empty((T, Hkv, D), grad_dtype, device))


def launch_preprocess(st: BwdState) -> None:
    cfg = st.cfg
    _bwd_preprocess[(triton.cdiv(st.T, cfg.pre_bt), st.Hq)](
        st.dout, st.out, st.delta, st.T, st.dout.stride(0), st.out.stride(0),
        D=st.D, BLOCK_T=cfg.pre_bt, num_warps=cfg.pre_warps)


def launch_dkdv(st: BwdState) -> None:
    cfg = st.cfg
    _bwd_dkdv[(st.n_docs * st.Hkv, triton.cdiv(st.max_seqlen, cfg.kv_bn))](
        st.q8, st.k8, st.v8, st.dout, st.lse, st.delta, st.dk, st.dv, st.cu,
        st.T, st.q8.stride(0), st.k8.stride(0), st.dout.stride(0), st.dk.stride(0),
        st.sm_scale, st.sm_scale * LOG2E,
        HQ=st.Hq, HKV=st.Hkv, D=st.D, BM=cfg.kv_bm, BN=cfg.kv_bn, CAUSAL=st.causal,
        INTERP=st.interp, num_warps=cfg.kv_warps, num_stages=cfg.kv_stages)


def launch_dq(st: BwdState) -> None:
    cfg = st.cfg
    _bwd_dq[(st.n_docs * st.Hq, triton.cdiv(st.max_seqlen, cfg.q_bm))](
        st.q8, st.k8, st.v8, st.dout, st.lse, st.delta, st.dq, st.cu,
        st.T, st.q8.stride(0), st.k8.stride(0), st.dout.stride(0), st.dq.stride(0),
        st.sm_scale, st.sm_scale * LOG2E,
        HQ=st.Hq, HKV=st.Hkv, D=st.D, BM=cfg.q_bm, BN=cfg.q_bn, CAUSAL=st.causal,
        INTERP=st.interp, num_warps=cfg.q_warps, num_stages=cfg.q_stages)


def run_state(st: BwdState):
    if st.T == 0 or st.n_docs == 0 or st.max_seqlen == 0:
        return st.dq.zero_(), st.dk.zero_(), st.dv.zero_()
    launch_preprocess(st)
    launch_dkdv(st)
    launch_dq(st)
    return st.dq, st.dk, st.dv


def attention_backward(dout, out, lse, qkv: QuantizedQKV, cu_seqlens, max_seqlen, causal=True,
                       softmax_scale=None, deterministic=False, config=None, grad_dtype=None):
    """(dq (T, Hq, D), dk, dv (T, Hkv, D)) in grad_dtype (default dout's dtype), dq and dk rotated
    back to the input space. dout, out (T, Hq, D); lse (Hq, T) fp32 from the forward.

    config: config.backward_config(D, recipe, device, dtype) by default; a
    backward_sm90.Sm90BwdConfig runs the one-pass Hopper kernel (its dQ adds are unordered
    unless deterministic=True; qkv.row_max is required for fp8), a BwdConfig the bf16 split
    kernels here (deterministic either way), ReferenceBwdConfig flamia.reference.backward on
    qkv's operands (fp8 off sm_90).
    cu_seqlens[-1] must be T (no padding tokens).
    """
    D = qkv.shape[3]
    cfg = config or backward_config(D, qkv.recipe, dout.device, qkv.q8.dtype)
    if isinstance(cfg, ReferenceBwdConfig):
        from ..reference import backward
        dq, dk, dv = backward(dout, out, lse, reference_saved(qkv, causal), cu_seqlens,
                              qkv.recipe, causal, softmax_scale)
        dt = grad_dtype or dout.dtype
        return dq.to(dt), dk.to(dt), dv.to(dt)
    if not isinstance(cfg, BwdConfig):
        from .backward_sm90 import attention_backward_sm90, attention_backward_sm90_fp8
        if qkv.kvblock:
            return attention_backward_sm90_fp8(dout, out, lse, qkv.row_max, qkv, cu_seqlens,
                                               causal, softmax_scale, grad_dtype, deterministic,
                                               config=cfg)
        return attention_backward_sm90(dout, out, lse, qkv.q8, qkv.k8, qkv.v8, cu_seqlens, causal,
                                       softmax_scale, grad_dtype, deterministic, config=cfg)
    st = make_state(dout, out, lse, qkv, cu_seqlens, max_seqlen, causal, softmax_scale, cfg,
                    grad_dtype)
    return run_state(st)
