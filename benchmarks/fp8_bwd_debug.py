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
from flamia.ops.config import sm90_backward_config  # noqa: E402
from flamia.ops.kmajor import mma_order16_host  # noqa: E402
from flamia.quant import pow2_scale  # noqa: E402
from tests._kvblock import qkv_from_saved  # noqa: E402


f8 = torch.float8_e4m3fn
r8 = lambda x: x.to(f8).float()  # noqa: E731
LOG2E = 1.4426950408889634
import math  # noqa: E402


def kernel_emu(do, out, lse, rmax, ns, cu, causal, D, want=lambda diag: True):
    """dQ in the kernel's units (before the post pass), from the kernel's formulas in torch."""
    T, Hq, _ = do.shape; Hkv = ns.k8.shape[1]; G = Hq // Hkv
    scale = D ** -0.5
    dq = torch.zeros(T, Hq, D, device=do.device); dk = torch.zeros(T, Hkv, D, device=do.device); dv = torch.zeros(T, Hkv, D, device=do.device)
    cul = cu.tolist()
    for a, b in zip(cul[:-1], cul[1:]):
        L = b - a
        if L == 0: continue
        # preprocess per head, 64-blocks doc-local
        dof = do[a:b].float(); of = out[a:b].float()
        do8 = torch.zeros(L, Hq, D, device=do.device); sdo = torch.zeros(L, Hq, device=do.device)
        for r0 in range(0, L, 64):
            blk = dof[r0:r0+64]
            amax = blk.abs().amax(dim=(0, 2))
            s = pow2_scale(amax, 448.0)
            inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
            do8[r0:r0+64] = r8(blk * inv[None, :, None])
            sdo[r0:r0+64] = s[None]
        deq = do8 * sdo[..., None]
        live = (do8.abs().amax(-1) > 0)
        delta = (deq * of).sum(-1)
        nrm = deq.norm(dim=-1)
        sq = ns.sq[:, a:b].T; sqf = torch.where(sq > 0, sq, torch.ones_like(sq))
        vn = ns.vnorm[:, a:b].T.repeat_interleave(G, 1)
        lse_d = lse[:, a:b].T; m = rmax[:, a:b].T
        pmax = torch.exp(m - lse_d)
        row_pt = torch.where(live, pmax * sdo, 0); row_ds = pmax * (nrm * vn + delta.abs()) * sqf
        A = scale * LOG2E * sq
        B = torch.where(live, lse_d * LOG2E - torch.log2(torch.where(sdo>0, sdo, 1)), torch.full_like(sq, math.inf))
        Hv = torch.where(live, sqf, 0); E = torch.where(live, delta * sqf / torch.where(sdo>0, sdo, 1), 0)
        for k0 in range(0, L, 128):
            k1 = min(k0 + 128, L)
            for g in range(Hkv):
                heads = list(range(g * G, g * G + G))
                lo = k0 if causal else 0
                c_pt = pow2_scale(row_pt[lo:, heads].max(), 448.0)
                c_ds = pow2_scale(row_ds[lo:, heads].max(), 448.0)
                lcpt = math.log2(c_pt) if c_pt > 0 else 0.0
                ratio = c_pt / c_ds if c_ds > 0 else 0.0
                skb = ns.sk[g, a + k0]; svb = ns.sv[g, a + k0]
                accv = torch.zeros(k1 - k0, D, device=do.device); acck = torch.zeros(k1 - k0, D, device=do.device)
                for h in heads:
                    for q0 in range(lo, L, 64):
                        q1 = min(q0 + 64, L)
                        diag = causal and q0 < k0 + 128
                        if diag:
                            kk = ns.k8_diag[a+k0:a+k1, g].float(); vv = ns.v8_diag[a+k0:a+k1, g].float()
                            skt = ns.sk_diag[g, a+k0:a+k1][:, None]; svt = ns.sv_diag[g, a+k0:a+k1][:, None]
                        else:
                            kk = ns.k8[a+k0:a+k1, g].float(); vv = ns.v8[a+k0:a+k1, g].float()
                        qq = ns.q8[a+q0:a+q1, h].float()
                        st = kk @ qq.T; dpt = vv @ do8[q0:q1, h].T
                        va = A[q0:q1, h][None]; vb = B[q0:q1, h][None] + lcpt
                        vh = Hv[q0:q1, h][None] * ratio; ve = E[q0:q1, h][None] * ratio
                        if diag:
                            xt = torch.exp2((st * skt) * va - vb); yt = xt * ((dpt * svt) * vh - ve)
                        else:
                            xt = torch.exp2(st * (va * skb) - vb); yt = xt * (dpt * (vh * svb) - ve)
                        keys = torch.arange(k0, k1, device=do.device)[:, None]; qs = torch.arange(q0, q1, device=do.device)[None]
                        ok = (keys <= qs) if causal else torch.ones_like(keys <= qs)
                        xt = torch.where(ok, xt, 0); yt = torch.where(ok, yt, 0)
                        accv += r8(xt) @ do8[q0:q1, h]
                        acck += r8(yt) @ qq
                        dqt = (r8(yt).T @ ns.k8[a+k0:a+k1, g].float()) * (c_ds * skb)
                        if want(diag): dq[a+q0:a+q1, h] += dqt
                dv[a+k0:a+k1, g] = accv * c_pt
                dk[a+k0:a+k1, g] = acck * scale * c_ds
    return dq


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--heads", default="8,2")
    ap.add_argument("--lengths", default="700,0,1,2,513,129,64,300")
    ap.add_argument("--module", default="", help="a copy of backward_sm90.py to run instead")
    args = ap.parse_args()
    global B
    if args.module:
        import importlib.util
        spec = importlib.util.spec_from_file_location("flamia.ops.variant", args.module)
        B = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = B
        spec.loader.exec_module(B)
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
    cfg = sm90_backward_config(D)
    prep = B.fp8_prepare(do, out, lse, rmax, qkv, cu, causal, scale, cfg)
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
    # kernel
    dv = torch.full((T, Hkv, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    dq_acc, dk32 = B.fp8_main(prep, qkv, causal, scale, True, dv)
    torch.cuda.synchronize()
    acc = dq_acc[prow]
    exp_acc = kernel_emu(do, out, lse, rmax, qkv, cu, causal, D)
    s0 = 0
    for d, L in enumerate(lengths):
        if L:
            sl = slice(s0, s0 + L)
            print(f"doc {d} L={L}: dq_acc vs torch model of the kernel: rel "
                  f"{rel(acc[sl].nan_to_num(1e9), exp_acc[sl]):.3e}")
        s0 += L
    if causal:   # which part of dQ is off: diagonal steps only / later steps only
        for part, want in (("diag", lambda dg: dg), ("off", lambda dg: not dg)):
            e = kernel_emu(do, out, lse, rmax, qkv, cu, causal, D, want)
            print(f"  model dQ from {part} steps only vs kernel: rel {rel(acc.nan_to_num(1e9), e):.3e}")
        for name, change in (("k_diag=k block", dict(k8_diag=qkv.k8, sk_diag=qkv.sk)),):
            from types import SimpleNamespace
            ns = SimpleNamespace(**(vars(qkv) | change))
            p2 = B.fp8_prepare(do, out, lse, rmax, ns, cu, causal, scale, cfg)
            dvx = torch.empty_like(dv)
            a2, _ = B.fp8_main(p2, ns, causal, scale, True, dvx)
            e2 = kernel_emu(do, out, lse, rmax, ns, cu, causal, D)
            print(f"  inputs {name}: kernel vs model rel {rel(a2[prow].nan_to_num(1e9), e2):.3e}")
            x, y = a2[prow][:64, 0], e2[:64, 0]
            r = (x / y.where(y.abs() > 1e-6, torch.ones_like(y)))
            print(f"    doc0 rows 0-63 head 0: ratio median {r.median().item():.3e}, "
                  f"kernel rows non-zero {int((x.abs().sum(-1) > 0).sum())}, model {int((y.abs().sum(-1) > 0).sum())}")
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
