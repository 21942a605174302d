"""Stage-by-stage check of the fp8_block one-pass backward on the H200 (development): the
preprocess outputs, K-major copies and CTA scales against torch / flamia.reference, then the
kernel's dQ accumulator, dK, dV and the final gradients per document (non-finite counts,
relative error against the reference emulation).

    python benchmarks/fp8_bwd_debug.py [--D 64] [--causal 1] [--heads 8,2]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flamia import reference as R  # noqa: E402
from flamia.inputs import cu_seqlens_from_lengths  # noqa: E402
from flamia.ops import backward_sm90 as B  # noqa: E402
from flamia.ops.kmajor import mma_order16_host  # noqa: E402
from flamia.quant import pow2_scale  # noqa: E402
from tests.gpu.test_backward_sm90_fp8_gpu import qkv_from_saved  # noqa: E402


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--heads", default="8,2")
    ap.add_argument("--lengths", default="700,0,1,2,513,129,64,300")
    args = ap.parse_args()
    D, causal = args.D, bool(args.causal)
    Hq, Hkv = (int(x) for x in args.heads.split(","))
    lengths = [int(x) for x in args.lengths.split(",")]
    T = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(T, h, D, generator=g, device="cuda").to(torch.bfloat16)
                   for h in (Hq, Hkv, Hkv, Hq))
    cu = cu_seqlens_from_lengths(lengths, device="cuda")
    out, lse, saved = R.forward(q, k, v, cu, "fp8_block", causal)
    out, lse = out.to(torch.bfloat16), lse.float().contiguous()
    rmax = saved.row_max.float().contiguous()
    qkv = qkv_from_saved(saved, cu, causal)
    scale = D ** -0.5
    cfg = B.select_config(D, "fp8_block")
    prep = B.fp8_prepare(do, out, lse, rmax, qkv, cu, causal, scale, cfg.block_m)
    torch.cuda.synchronize()
    prow = prep.kb.prow.long()
    # dO blocks
    doo = R.quantize_token_blocks(do.float(), "e4m3", cu, R.DO_BLOCK)
    ref8 = doo.values.to(torch.float8_e4m3fn)
    print("do8 byte mismatches:", (prep.do8.view(torch.uint8) != ref8.view(torch.uint8)).sum().item())
    sc = R.backward_scales(doo, doo.dequant(), out.float(), lse, saved, cu, causal)
    A = prep.vec[0][:, prow]
    print("A rel:", rel(A, scale * R_LOG2E * qkv.sq))
    live = sc.sdo > 0
    Bv = prep.vec[1][:, prow]
    Bref = torch.where(live, lse * R_LOG2E - torch.log2(torch.where(live, sc.sdo, 1)), torch.inf)
    print("B rel (live):", rel(Bv[live], Bref[live]), "dead all inf:", bool(torch.isinf(Bv[~live]).all()))
    print("Hv rel:", rel(prep.vec[2][:, prow], torch.where(live, sc.sqf, 0)))
    print("E rel:", rel(prep.vec[3][:, prow], torch.where(live, sc.delta * sc.sqf / torch.where(live, sc.sdo, 1), 0)))
    if causal:
        print("kcap rel:", rel(prep.vec[4][:, prow], qkv.kcap.repeat_interleave(Hq // Hkv, 0)))
    # CTA scales vs reference (pt, ds per (Hkv, global block))
    items = prep.kb.items.cpu()
    ndoc = len(lengths)
    base = [0]
    for L in lengths:
        base.append(base[-1] + -(-L // 128))
    bad = 0
    n = 0
    for c in range(items.shape[1]):
        d, blk, kvh = int(items[0, c]), int(items[1, c]), int(items[5, c])
        if d < 0:
            continue
        n += 1
        ref_pt = sc.pt[kvh, base[d] + blk].item()
        ref_ds = sc.ds[kvh, base[d] + blk].item()
        if prep.cpt[c].item() != ref_pt or prep.cds[c].item() != ref_ds:
            bad += 1
            if bad < 5:
                print(f"  cta {c} doc {d} blk {blk} kvh {kvh}: cpt {prep.cpt[c].item()} vs "
                      f"{ref_pt}, cds {prep.cds[c].item()} vs {ref_ds}")
    print(f"CTA scales: {bad} of {n} differ")
    # K-major copies
    cols = torch.arange(prep.kb.q_rows, device="cuda")
    src_col = mma_order16_host(cols)
    tok = prep.ptok.long()
    def check_t(name, x8, xT, order):
        c = src_col if order else cols
        t = tok[c]
        ok = t >= 0
        want = torch.zeros_like(xT.view(torch.uint8))
        want[:, :, ok] = x8.view(torch.uint8)[t[ok]].permute(1, 2, 0)
        print(f"{name} mismatches: {(xT.view(torch.uint8) != want).sum().item()}")
    check_t("dot8", prep.do8, prep.dot8, True)
    check_t("qt8", qkv.q8, prep.qt8, True)
    check_t("kt8", qkv.k8, prep.kt8, False)
    if causal:
        check_t("ktd8", qkv.k8_diag, prep.ktd8, False)
    # kernel
    dv = torch.full((T, Hkv, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    dq_acc, dk32 = B.fp8_main(prep, qkv, causal, scale, True, dv)
    torch.cuda.synchronize()
    acc = dq_acc[prow]
    emu = R.backward(do, out, lse, saved, cu, "fp8_block", causal)
    got = B.attention_backward_sm90_fp8(do, out, lse, rmax, qkv, cu, causal, deterministic=True)
    s0 = 0
    for d, L in enumerate(lengths):
        sl = slice(s0, s0 + L)
        s0 += L
        if L == 0:
            continue
        msg = [f"doc {d} L={L}:"]
        for name, x in (("dq_acc", acc[sl]), ("dk32", dk32[sl]), ("dv", dv[sl])):
            nf = (~torch.isfinite(x)).sum().item()
            if nf:
                rows = (~torch.isfinite(x)).any(-1).nonzero()
                msg.append(f"{name} non-finite {nf} (rows/heads e.g. {rows[:4].tolist()})")
        for name, x, e in zip(("dq", "dk", "dv"), got, emu):
            msg.append(f"{name} rel {rel(x[sl].float().nan_to_num(1e9), e[sl]):.3e}")
        print(" ".join(msg))


R_LOG2E = 1.4426950408889634

if __name__ == "__main__":
    main()
