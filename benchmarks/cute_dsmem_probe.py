"""Does CuTe DSL build distributed-shared-memory traffic for sm_90a on this CPU? A compile-only probe.

    python -m venv /tmp/cute && /tmp/cute/bin/pip install nvidia-cutlass-dsl==4.8.1 torch
    /tmp/cute/bin/python benchmarks/cute_dsmem_probe.py

The companion of cluster_dsmem_probe.py (Gluon in Triton 3.6 cannot lower data movement between
the CTAs of a cluster). Here a 2-CTA cluster kernel in CuTe DSL (the language FA4 uses): CTA 1
writes 128 words into CTA 0's shared memory with st.async (completion counted on CTA 0's
mbarrier), CTA 0 waits on the mbarrier and stores them. It is compiled for sm_90a with no GPU
(cute.compile with --gpu-arch sm_90a), and the kept PTX's cluster instructions are counted:
mapa, st.async.shared::cluster, barrier.cluster. 2026-12-05, CuTe DSL 4.8.1: all present, so the
backward's on-chip dQ pair reduction and the forward's K / V sharing across CTAs
(benchmarks/NOTES.md, "L2 bytes per FLOP") can be built and compile-checked on a CPU in CuTe DSL.
On a machine with a GPU it also runs the kernel and checks the words.
"""
from __future__ import annotations

import glob
import os
import re
import tempfile

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass.cute.runtime import from_dlpack
from cutlass.memory import SmemAllocator

WORDS = 128


@cute.kernel
def _pair_kernel(out: cute.Tensor):
    alloc = SmemAllocator()
    buf = alloc.allocate_array(Int32, WORDS, byte_alignment=16)
    mbar = alloc.allocate_array(cutlass.Int64, 1, byte_alignment=8)
    rank = cute.arch.block_idx_in_cluster()
    tidx, _, _ = cute.arch.thread_idx()
    local = cute.make_tensor(buf, cute.make_layout(WORDS))
    if tidx == 0:
        cute.arch.mbarrier_init(mbar, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    if rank == 0:
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, 4 * WORDS)
    if rank == 1:       # into CTA 0's buf, counted on CTA 0's mbarrier
        cute.arch.store_async_dsmem(buf + tidx, tidx, mbar, 0)
    if rank == 0:
        cute.arch.mbarrier_wait(mbar, 0)
        out[tidx] = Float32(local[tidx])
    cute.arch.cluster_arrive()      # CTA 1 stays resident until CTA 0 has its words
    cute.arch.cluster_wait()


@cute.jit
def _launch(out: cute.Tensor):
    _pair_kernel(out).launch(grid=[2, 1, 1], block=[WORDS, 1, 1], cluster=[2, 1, 1])


def main():
    with tempfile.TemporaryDirectory() as tmp:
        cute.compile(_launch, from_dlpack(torch.zeros(WORDS)),
                     options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp}")
        ptx = "".join(open(p).read() for p in glob.glob(os.path.join(tmp, "*.ptx")))
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    print("target", target.group(1) if target else "?")
    for op in ("mapa.shared::cluster", "st.async.shared::cluster", "barrier.cluster.arrive",
               "barrier.cluster.wait"):
        print(f"{op:28s} {len(re.findall(re.escape(op), ptx))}")
    if torch.cuda.is_available():   # on the device: run it and check CTA 0 got CTA 1's words
        out = torch.full((WORDS,), -1.0, device="cuda")
        cute.compile(_launch, from_dlpack(out))(from_dlpack(out))
        torch.cuda.synchronize()
        ok = torch.equal(out.cpu(), torch.arange(WORDS, dtype=torch.float32))
        print("run on", torch.cuda.get_device_name(), "PASS" if ok else f"FAIL {out[:8]}")


if __name__ == "__main__":
    main()
