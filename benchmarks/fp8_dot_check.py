"""Is the FP8 QK^T wgmma exact enough? (H200; for the LSE mismatch in benchmarks/NOTES.md)

    python benchmarks/fp8_dot_check.py

Scores S = q8 k8^T of the kernel's own quantized operands (outlier and mild inputs, 2k tokens,
one head, D=128), three ways: a Triton tile dot on e4m3 (what the forward kernel does), the same
split into K-chunks of 32 / 64 whose partial products are added in fp32, and float64. Prints the
scores' error (in units of the softmax argument, natural log) and the causal LSE each gives.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flamia.inputs import make_qkv  # noqa: E402
from flamia.ops.quantize import quantize_qkv  # noqa: E402


@triton.jit
def _scores(Q, K, S, T, D: tl.constexpr, KC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    i = tl.program_id(0) * BM + tl.arange(0, BM)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for c in tl.static_range(0, D, KC):
        d = c + tl.arange(0, KC)
        q = tl.load(Q + i[:, None] * D + d[None, :])
        k = tl.load(K + j[None, :] * D + d[:, None])
        acc += tl.dot(q, k)          # a fresh wgmma chain per chunk, summed in fp32
    tl.store(S + i[:, None] * T + j[None, :], acc)


T, D = 2048, 128
for family in ("outliers", "mild"):
    q, k, v, cu = make_qkv((T,), 1, 1, D, family, device="cuda", seed=1)
    qkv = quantize_qkv(q, k, v, cu, "fp8", True)
    q8, k8 = qkv.q8[:, 0].contiguous(), qkv.k8[:, 0].contiguous()
    rs = qkv.sq[0].double()[:, None] * qkv.sk[0].double()[None, :] * D ** -0.5
    exact = (q8.double() @ k8.double().T) * rs
    mask = torch.ones(T, T, dtype=torch.bool, device="cuda").triu(1)
    lse64 = torch.logsumexp(exact.masked_fill(mask, float("-inf")), -1)
    for kc in (128, 64, 32):
        s = torch.empty(T, T, device="cuda")
        _scores[(T // 64, T // 64)](q8, k8, s, T, D=D, KC=kc, BM=64, BN=64, num_warps=4)
        sc = s.double() * rs
        err = (sc - exact).abs().masked_fill(mask, 0)
        lse = torch.logsumexp(sc.masked_fill(mask, float("-inf")), -1)
        print(f"{family:8s} K-chunk {kc:3d}: max |score err| {err.max().item():.3e}  "
              f"max |lse err| {(lse - lse64).abs().max().item():.3e}  rows > 1e-4 "
              f"{((lse - lse64).abs() > 1e-4).double().mean().item():.4f}  "
              f"(max |score| {exact.masked_fill(mask, 0).abs().max().item():.1f})", flush=True)

# Does the backward's recompute of S^T = k8 q8^T (operands swapped, as in the dK/dV kernel) give
# the forward's S bit for bit? If yes, P rows recomputed in the backward sum to what the forward's
# LSE assumed, whatever the accumulator's precision.
for family in ("outliers", "mild"):
    q, k, v, cu = make_qkv((T,), 1, 1, D, family, device="cuda", seed=1)
    qkv = quantize_qkv(q, k, v, cu, "fp8", True)
    q8, k8 = qkv.q8[:, 0].contiguous(), qkv.k8[:, 0].contiguous()
    for bm, bn in ((64, 64), (128, 64), (64, 128)):
        s = torch.empty(T, T, device="cuda")
        st = torch.empty(T, T, device="cuda")
        _scores[(T // bm, T // bn)](q8, k8, s, T, D=D, KC=128, BM=bm, BN=bn, num_warps=4)
        _scores[(T // bn, T // bm)](k8, q8, st, T, D=D, KC=128, BM=bn, BN=bm, num_warps=4)
        diff = (s != st.T)
        print(f"{family:8s} S vs (k8 q8^T)^T, tiles {bm}x{bn}: {diff.sum().item()} of {T * T} "
              f"elements differ, max |diff| {(s - st.T).abs().max().item():.3e}", flush=True)

# The same question for bf16 operands (the bf16 recipe's QK^T): does the bf16 wgmma sum in full
# fp32? Scores of bf16-rounded q, k (unrotated, as the bf16 recipe uses them) vs float64.
for family in ("outliers", "mild"):
    q, k, v, cu = make_qkv((T,), 1, 1, D, family, device="cuda", seed=1)
    qb, kb = q[:, 0].contiguous(), k[:, 0].contiguous()
    exact = (qb.double() @ kb.double().T) * D ** -0.5
    mask = torch.ones(T, T, dtype=torch.bool, device="cuda").triu(1)
    for kc in (128, 32):
        s = torch.empty(T, T, device="cuda")
        _scores[(T // 64, T // 64)](qb, kb, s, T, D=D, KC=kc, BM=64, BN=64, num_warps=4)
        err = ((s.double() * D ** -0.5) - exact).abs().masked_fill(mask, 0)
        s32 = (qb.float() @ kb.float().T) * D ** -0.5          # torch fp32 GEMM (cuBLAS)
        err32 = (s32.double() - exact).abs().masked_fill(mask, 0)
        print(f"{family:8s} bf16 K-chunk {kc:3d}: max |score err| {err.max().item():.3e} "
              f"(cuBLAS fp32 of the same bf16 values {err32.max().item():.3e}; max |score| "
              f"{exact.masked_fill(mask, 0).abs().max().item():.1f})", flush=True)
