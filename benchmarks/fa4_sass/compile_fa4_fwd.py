#!/usr/bin/env python3
"""Compile FA4 (flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1) SM90 bf16 FORWARD
(causal, varlen packed (total, heads, D), 32 q-heads / 8 kv-heads) on a CPU-only machine,
keep PTX + cubin, and disassemble to SASS.

  python compile_fa4_fwd.py HDIM OUTDIR

Same method as compile_fa4_bwd.py (fa4_compile.py): interface._flash_attn_fwd only
compiles and launches nothing. All tile / pack_gqa /
mma_pv_is_rs / intra_wg_overlap / q_stage / num_splits choices are FA4's sm90 defaults
(nothing passed); return_lse=True (training forward writes LSE; only the epilogue differs).
The FwdConfig FA4 picks and the FlashAttentionForwardSm90 constructor arguments are printed.
"""
import os
import sys

from fa4_compile import name_compiles, reports, setup

hdim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
out = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else f"out/hd{hdim}_fwd")
tmpdump = setup(out)
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from flash_attn.cute import interface as fi  # noqa: E402

# --- report the config FA4 picks ---
_orig_cfg = fi._get_fwd_config
def _cfg(**kw):
    r = _orig_cfg(**kw)
    print(f"_get_fwd_config(head_dim={kw['head_dim']}, pack_gqa={kw['pack_gqa']}, causal={kw['causal']}, "
          f"max_seqlen_q={kw['max_seqlen_q']}) ->", r, flush=True)
    return r
fi._get_fwd_config = _cfg
_Sm90 = fi.FlashAttentionForwardSm90
_orig_init = _Sm90.__init__
def _init(self, *a, **kw):  # wrap __init__ (not a subclass: keeps the kernel's own name / codegen)
    print("FlashAttentionForwardSm90(", a, kw, ")", flush=True)
    _orig_init(self, *a, **kw)
    attrs = {k: getattr(self, k) for k in ("tile_m", "tile_n", "num_threads", "num_stages", "pack_gqa",
             "intra_wg_overlap", "mma_pv_is_rs", "num_mma_warp_groups", "use_scheduler_barrier",
             "num_producer_threads", "num_mma_threads", "tile_hdim", "tile_hdimv", "Q_in_regs",
             "qhead_per_kvhead") if hasattr(self, k)}
    print("  kernel object attrs:", attrs, flush=True)
_Sm90.__init__ = _init
name_compiles(out, tmpdump)

H, HKV = 32, 8
seqlens = [1024, 2048, 512, 8192]
total = sum(seqlens)
with FakeTensorMode():
    dev, dt = "cuda", torch.bfloat16
    q = torch.empty(total, H, hdim, device=dev, dtype=dt)
    k = torch.empty(total, HKV, hdim, device=dev, dtype=dt)
    v = torch.empty(total, HKV, hdim, device=dev, dtype=dt)
    cu = torch.empty(len(seqlens) + 1, device=dev, dtype=torch.int32)
    fi._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                       max_seqlen_q=max(seqlens), max_seqlen_k=max(seqlens), return_lse=True)
reports(out)
