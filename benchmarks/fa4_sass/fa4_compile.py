"""What compile_fa4_bwd.py and compile_fa4_fwd.py share: FA4's CPU cross-compile switches, a
wrapper around cute.compile that names each kernel's PTX / cubin dump, and the SASS, resource
and ptxas -v reports of the dumps.

FA4's own switches (interface._get_device_arch's docstring): FLASH_ATTENTION_ARCH=sm_90 picks the
kernels, CUTE_DSL_ARCH=sm_90a is the compile target, FLASH_ATTENTION_NUM_SMS=132; with torch
FakeTensors on device 'cuda' (a CPU-only torch works) FA4 only compiles and launches nothing.
SASS via nvdisasm (pip nvidia-cuda-nvdisasm) if present, else cuobjdump -sass.
"""
import glob
import os
import re
import shutil
import subprocess


def setup(out):
    """Set the cross-compile switches and the dump folder; call before importing cutlass or
    flash_attn. Returns the dump folder."""
    tmpdump = out + "/_dump"
    os.makedirs(tmpdump, exist_ok=True)
    os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = tmpdump
    os.environ.setdefault("CUTE_DSL_NO_CACHE", "1")
    os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
    return tmpdump


def name_compiles(out, tmpdump, suffix=lambda cls, names: ""):
    """Wrap cute.compile so each compile's dumps move to out/<n>_<class><suffix>.sm_90a.<ext>
    (the DSL's own file names are truncated and may overwrite each other) and print the dynamic
    shared memory the kernel asked SmemAllocator for."""
    import cutlass.cute as cute
    import cutlass.utils as cu_utils
    from flash_attn.cute import interface as fi
    names, smem = [], []
    orig_alloc = cu_utils.SmemAllocator.allocate

    def alloc(self, size_or_type, byte_alignment=1, *a, **kw):
        if isinstance(size_or_type, int):
            smem.append(("bytes", size_or_type))
        elif isinstance(size_or_type, cute.struct):
            smem.append((getattr(size_or_type, "__name__", "struct"), size_or_type.__sizeof__()))
        else:
            smem.append((str(size_or_type), None))
        return orig_alloc(self, size_or_type, byte_alignment, *a, **kw)

    orig_compile = cute.compile

    def compile_(*args, **kw):
        r = orig_compile(*args, **kw)
        cls = type(args[0]).__name__
        base = f"{len(names)}_{cls}{suffix(cls, names)}"
        names.append(base)
        for f in glob.glob(tmpdump + "/*"):
            shutil.move(f, f"{out}/{base}.sm_90a.{f.rsplit('.', 1)[-1]}")
        print(f"compiled {base} | SmemAllocator requests: {smem}", flush=True)
        smem.clear()
        return r

    cu_utils.SmemAllocator.allocate = alloc
    cute.compile = fi.cute.compile = compile_


def reports(out):
    """For every dumped kernel: SASS, cuobjdump resource usage, the threads per CTA, and (with a
    ptxas on PATH or in PTXAS) a ptxas -v cross-check. The DSL emits PTX ISA 9.4; an older ptxas
    (CUDA 13.0 = ISA 9.0) takes it with the .version line lowered (only for the -v report: the
    SASS is the DSL's own cubin's)."""
    os.rmdir(out + "/_dump")
    import torch
    here = os.path.dirname(os.path.abspath(torch.__file__))
    cands = glob.glob(os.path.join(os.path.dirname(here), "nvidia/cu13/bin/nvdisasm"))
    nvdisasm = cands[0] if cands else shutil.which("nvdisasm")
    tri = os.environ.get("TRITON_NV_BIN") or os.path.join(
        os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin")
    cuobjdump = shutil.which("cuobjdump") or os.path.join(tri, "cuobjdump")
    run = lambda *cmd: subprocess.run(cmd, capture_output=True, text=True)   # noqa: E731
    for cub in sorted(glob.glob(out + "/*.cubin")):
        stem = cub[:-len(".cubin")]
        txt = (run(nvdisasm, "-c", cub) if nvdisasm else run(cuobjdump, "-sass", cub)).stdout
        open(stem + ".sass", "w").write(txt)
        open(stem + ".resource.txt", "w").write(run(cuobjdump, "--dump-resource-usage", cub).stdout)
        print(os.path.basename(stem) + ".sass", "lines", txt.count("\n"))
    ptxas = os.environ.get("PTXAS", shutil.which("ptxas"))
    for ptx in sorted(glob.glob(out + "/*.ptx")):
        src = open(ptx).read()
        m = re.search(r"\.reqntid\s+(\d+)", src)
        print(os.path.basename(ptx), "| .reqntid (threads per CTA):", m.group(1) if m else "?")
        if not ptxas:
            continue
        tmp = ptx + ".tmp.ptx"
        open(tmp, "w").write(re.sub(r"^\.version\s+\S+", ".version 9.0", src, count=1, flags=re.M))
        r = run(ptxas, "-arch=sm_90a", "-O3", "-v", "-o", os.devnull, tmp)
        os.remove(tmp)
        ver = run(ptxas, "--version").stdout.strip().splitlines()[-1]
        open(ptx[:-len(".ptx")] + ".ptxas_v.txt", "w").write(ver + "\n" + r.stdout + r.stderr)
        regs = re.search(r"Used (\d+) registers.*", r.stdout + r.stderr)
        spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                          r"loads", r.stdout + r.stderr)
        print(os.path.basename(ptx), "| ptxas -v:", regs.group(0) if regs else "?", "|",
              spill.group(0) if spill else "?")
