#!/usr/bin/env python3
"""Compile FA4 (flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1) SM90 bf16 BACKWARD
(causal, varlen packed (total, heads, D), 32 q-heads / 8 kv-heads) on a CPU-only machine,
keep PTX + cubin, and disassemble to SASS.

  python compile_fa4_bwd.py HDIM OUTDIR

How: FA4's own CPU cross-compile switches (see interface._get_device_arch docstring):
FLASH_ATTENTION_ARCH=sm_90 (kernel selection), CUTE_DSL_ARCH=sm_90a (compile target),
FLASH_ATTENTION_NUM_SMS=132; CUTE_DSL_KEEP=ptx,cubin, CUTE_DSL_DUMP_DIR=<tmp>.
Inputs are torch FakeTensors on device 'cuda' (works with a CPU-only torch build): FA4 sees
fake mode, so _flash_attn_bwd only compiles (preprocess, main bwd, postprocess) and launches nothing.
Every cute.compile call is wrapped so its dumps get a short distinct name (the DSL's
file names are truncated, so dQ/dK/dV postprocess dumps would overwrite each other).
SASS via nvdisasm 13.5 (pip nvidia-cuda-nvdisasm) if present, else cuobjdump -sass.
"""
import os, sys, glob, shutil, subprocess
hdim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
out = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else f"out/hd{hdim}")
tmpdump = out + "/_dump"
os.makedirs(tmpdump, exist_ok=True)
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
os.environ["CUTE_DSL_DUMP_DIR"] = tmpdump
os.environ.setdefault("CUTE_DSL_NO_CACHE", "1")
os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
import cutlass.cute as cute
from flash_attn.cute import interface as fi

names = []
# record dynamic smem requested through SmemAllocator.allocate during each compile
import cutlass.utils as cu_utils
_smem_reqs = []
_orig_alloc = cu_utils.SmemAllocator.allocate
def _alloc(self, size_or_type, byte_alignment=1, *a, **kw):
    try:
        if isinstance(size_or_type, int):
            _smem_reqs.append(("bytes", size_or_type))
        elif isinstance(size_or_type, cute.struct):
            _smem_reqs.append((getattr(size_or_type, "__name__", "struct"), size_or_type.__sizeof__()))
        else:
            _smem_reqs.append((str(size_or_type), None))
    except Exception as e:
        _smem_reqs.append(("?", repr(e)))
    return _orig_alloc(self, size_or_type, byte_alignment, *a, **kw)
cu_utils.SmemAllocator.allocate = _alloc
smem_info = {}
_orig_compile = cute.compile
def _compile(*args, **kw):
    obj = args[0]
    r = _orig_compile(*args, **kw)
    cls = type(obj).__name__
    extra = ""
    if cls == "FlashAttentionBackwardPostprocess":
        # interface order: dQ postprocess first, then dK (dV reuses dK's compiled kernel: same key)
        extra = "_dQ" if not any("Postprocess" in n for n in names) else "_dKV"
    base = f"{len(names)}_{cls}{extra}"
    names.append(base)
    smem_info[base] = list(_smem_reqs); _smem_reqs.clear()
    for f in glob.glob(tmpdump + "/*"):
        ext = f.rsplit(".", 1)[-1]
        shutil.move(f, f"{out}/{base}.sm_90a.{ext}")
    print(f"compiled #{len(names)-1}: {cls} ->", base, "| SmemAllocator requests:", smem_info[base], flush=True)
    return r
cute.compile = _compile
fi.cute.compile = _compile

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
os.rmdir(tmpdump)

# --- SASS + resource usage ---
here = os.path.dirname(os.path.abspath(torch.__file__))
cands = glob.glob(os.path.join(os.path.dirname(here), "nvidia/cu13/bin/nvdisasm"))
nvdisasm = cands[0] if cands else shutil.which("nvdisasm")
tri = os.environ.get("TRITON_NV_BIN") or os.path.join(
    os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin")
cuobjdump = shutil.which("cuobjdump") or os.path.join(tri, "cuobjdump")
for cub in sorted(glob.glob(out + "/*.cubin")):
    sass = cub[:-len(".cubin")] + ".sass"
    if nvdisasm:
        txt = subprocess.run([nvdisasm, "-c", cub], capture_output=True, text=True).stdout
    else:
        txt = subprocess.run([cuobjdump, "-sass", cub], capture_output=True, text=True).stdout
    open(sass, "w").write(txt)
    ru = subprocess.run([cuobjdump, "--dump-resource-usage", cub], capture_output=True, text=True).stdout
    open(cub[:-len(".cubin")] + ".resource.txt", "w").write(ru)
    print(os.path.basename(sass), "lines", txt.count("\n"))

# --- cross-check with a system ptxas (-v: registers / spills / barriers), optional ---
# The DSL emits PTX ISA 9.4 (its bundled CUDA 13.x compiler); an older ptxas (e.g. CUDA 13.0 = ISA 9.0)
# accepts it after lowering the .version line. Only used for the -v report; SASS above is the DSL's own cubin.
import re as _re
ptxas = os.environ.get("PTXAS", shutil.which("ptxas"))
if ptxas:
    ver = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    for ptx in sorted(glob.glob(out + "/*.ptx")):
        src = open(ptx).read()
        tmp = ptx + ".tmp.ptx"
        open(tmp, "w").write(_re.sub(r"^\.version\s+\S+", ".version 9.0", src, count=1, flags=_re.M))
        r = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", "-o", os.devnull, tmp], capture_output=True, text=True)
        os.remove(tmp)
        open(ptx[:-len(".ptx")] + ".ptxas_v.txt", "w").write(ver.strip().splitlines()[-1] + "\n" + r.stdout + r.stderr)
        m = _re.search(r"Used (\d+) registers.*", r.stdout + r.stderr)
        s = _re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", r.stdout + r.stderr)
        print(os.path.basename(ptx), "| ptxas -v:", m.group(0) if m else "?", "|", s.group(0) if s else "?")
