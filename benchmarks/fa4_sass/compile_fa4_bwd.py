#!/usr/bin/env python3
"""Compile FA4 (flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1) SM90 bf16 BACKWARD
(causal, varlen packed (total, heads, D), 32 q-heads / 8 kv-heads) on a CPU-only machine,
keep PTX + cubin, and disassemble to SASS.

  python compile_fa4_bwd.py HDIM OUTDIR

How (fa4_compile.py): FA4's own CPU cross-compile switches and FakeTensors on device 'cuda',
so _flash_attn_bwd only compiles (preprocess, main bwd, postprocess) and launches nothing.
"""
import os
import sys

from fa4_compile import name_compiles, reports, setup

hdim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
out = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else f"out/hd{hdim}")
tmpdump = setup(out)
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from flash_attn.cute import interface as fi  # noqa: E402


def postprocess_suffix(cls, names):
    """The interface compiles dQ's postprocess first, then dK's (dV reuses dK's kernel)."""
    if cls != "FlashAttentionBackwardPostprocess":
        return ""
    return "_dQ" if not any("Postprocess" in n for n in names) else "_dKV"


name_compiles(out, tmpdump, postprocess_suffix)

H, HKV = 32, 8
seqlens = [1024, 2048, 512, 4096]
total = sum(seqlens)
cfg = fi._tile_size_bwd_sm90(hdim, hdim, True, False)
print("BwdConfig picked for sm90 (hdim=%d, causal):" % hdim, cfg, flush=True)
with FakeTensorMode():
    dev, dt = "cuda", torch.bfloat16
    q = torch.empty(total, H, hdim, device=dev, dtype=dt)
    k = torch.empty(total, HKV, hdim, device=dev, dtype=dt)
    v = torch.empty(total, HKV, hdim, device=dev, dtype=dt)
    o = torch.empty(total, H, hdim, device=dev, dtype=dt)
    do = torch.empty(total, H, hdim, device=dev, dtype=dt)
    lse = torch.empty(H, total, device=dev, dtype=torch.float32)
    cu_q = torch.empty(len(seqlens) + 1, device=dev, dtype=torch.int32)
    cu_k = torch.empty(len(seqlens) + 1, device=dev, dtype=torch.int32)
    fi._flash_attn_bwd(q, k, v, o, do, lse, causal=True,
                       cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                       max_seqlen_q=max(seqlens), max_seqlen_k=max(seqlens))
reports(out)
