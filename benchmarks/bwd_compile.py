"""sm_90a compile report of the backward kernels, on a CPU-only machine (no GPU needed).

    python benchmarks/bwd_compile.py                      # default configs, fp8 / fp8_mixed / bf16
    python benchmarks/bwd_compile.py --sweep              # a few dK/dV and dQ block shapes too

Builds dK/dV and dQ for D=128 and 64 with Triton's compiler for sm_90a (flamia.ops._interp
.compile_only: the launchers run on CPU tensors, nothing executes) and prints, per kernel,
registers, spill bytes, whether ptxas serialized the wgmma instructions (C7515), and PTX counts
that tell where element-wise work and synchronisation go: wgmma issued, wgmma waits, CTA
barriers, MUFU ex2, fp8 conversions. Must run without TRITON_INTERPRET.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from flamia.ops import backward as B  # noqa: E402
from flamia.ops._interp import compile_only, resource_usage  # noqa: E402
from flamia.ops.layout import QuantizedQKV  # noqa: E402

PTX_COUNTS = {
    "wgmma": r"wgmma\.mma_async",
    "wait": r"wgmma\.wait_group",
    "bar": r"\bbar\.sync|barrier\.sync",
    "ex2": r"ex2\.approx",
    "cvt_e4m3": r"cvt\.rn\.satfinite\.e4m3x2",
    "tma": r"cp\.async\.bulk\.tensor",
    "ld_b8": r"ld\.global(\.\w+)*\.b8",
}


def fake_qkv(recipe, T, Hq, Hkv, D):
    f8 = torch.float8_e4m3fn
    dt = torch.bfloat16 if recipe == "bf16" else f8
    z = lambda *s: torch.zeros(*s, dtype=dt)            # noqa: E731
    sc = None if recipe == "bf16" else torch.ones(Hq, T)
    sk = None if recipe == "bf16" else torch.ones(Hkv, T)
    return QuantizedQKV(recipe, z(T, Hq, D), z(T, Hkv, D), z(T, Hkv, D), sc, sk,
                        None if sk is None else sk.clone(), None if sk is None else sk.clone(),
                        rotated=recipe != "bf16")


def report(recipe, D, cfg, T=4096, Hq=16, Hkv=4):
    qkv = fake_qkv(recipe, T, Hq, Hkv, D)
    cu = torch.tensor([0, T], dtype=torch.int32)
    dout = torch.zeros(T, Hq, D, dtype=torch.bfloat16)
    lse = torch.zeros(Hq, T)
    with compile_only() as built:
        st = B.make_state(dout, dout, lse, qkv, cu, T, True, None, cfg)
        st.interp = False      # compile the GPU code paths (wgmma, hardware casts)
        st.kmajor_tma = st.kmajor_tma or (recipe != "bf16" and cfg.use_tma)
        B.launch_dkdv(st)
        B.launch_dq(st)
    rows = []
    for name, kern in built:
        u = resource_usage(kern)
        ptx = kern.asm["ptx"]
        counts = {k: len(re.findall(p, ptx)) for k, p in PTX_COUNTS.items()}
        rows.append((name, u, counts))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--split", action="store_true", help="split dK / dV launches too")
    ap.add_argument("--recipes", default="fp8,fp8_mixed,bf16")
    ap.add_argument("--dims", default="128,64")
    args = ap.parse_args()
    print(f"{'recipe':9} {'D':>3} {'kernel':10} {'config':24} {'regs':>4} {'spill':>5} {'ser':>3} "
          + " ".join(f"{k:>8}" for k in PTX_COUNTS))
    for recipe in args.recipes.split(","):
        for D in map(int, args.dims.split(",")):
            cfgs = [("default", B.default_config(D, recipe))]
            if args.sweep:
                for bn, bm in ((128, 32), (128, 64), (64, 64)):
                    cfgs.append((f"kv{bn}x{bm}", B.BwdConfig(kv_bn=bn, kv_bm=bm, kv_warps=8 if bn == 128 else 4)))
            if args.split:
                for bm, bmv in ((32, 64), (64, 128), (64, 64)):
                    cfgs.append((f"split{bm}/{bmv}", B.BwdConfig(kv_bn=128, kv_bm=bm, kv_warps=8,
                                                                 split_dkdv=True, kv_bm_dv=bmv)))
            for label, cfg in cfgs:
                try:
                    rows = report(recipe, D, cfg)
                except Exception as e:   # noqa: BLE001
                    print(f"{recipe:9} {D:>3} FAILED {label}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                n_dkdv = sum("dkdv" in name for name, _, _ in rows)
                for i, (name, u, c) in enumerate(rows):
                    kind = "dkdv" if "dkdv" in name else "dq"
                    if n_dkdv == 2 and kind == "dkdv":
                        kind = "dk" if i == 0 else "dv"
                    shape = (f"q{cfg.q_bm}x{cfg.q_bn}w{cfg.q_warps}" if kind == "dq" else
                             f"kv{cfg.kv_bn}x{cfg.kv_bm_dv if kind == 'dv' else cfg.kv_bm}w{cfg.kv_warps}")
                    print(f"{recipe:9} {D:>3} {kind:10} {label + ' ' + shape:24} {u['regs']:>4} "
                          f"{u['spill_stores']:>5} {'Y' if u['wgmma_serialized'] else '-':>3} "
                          + " ".join(f"{c[k]:>8}" for k in PTX_COUNTS), flush=True)


if __name__ == "__main__":
    main()
