"""Compile kernel launches for sm_90a on a CPU-only machine: nothing executes, the binary is the
one a GPU launch would build (same specialization and options), and ptxas -v tells registers,
spills and whether it serialized the wgmma instructions (warning C7515: a large, silent
slowdown on Hopper).

    with compile_only() as built:
        flamia.ops.forward.attention_forward(fake_qkv(...), ...)     # launchers run as usual
    for name, kernel in built: print(name, resource_usage(kernel))

Needs TRITON_INTERPRET unset (real JITFunctions) and the ptxas / cuobjdump that ship with
triton; tests run it in a subprocess (tests/_sm90.py) because their conftest sets the
interpreter on CPU machines.
"""
from __future__ import annotations

import os
import re

import torch

def bind_for(fn, args, kwargs, arch: int = 90, warp_size: int = 32):
    """(target, backend, bound_args, specialization, options) of the launch
    `fn[grid](*args, **kwargs)` on `arch` (default sm_90a), by the launcher's own binder: ints
    specialized on == 1 and on divisibility by 16, as a GPU launch does."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, warp_size)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    return (target, backend, *binder(*args, **kwargs))


def compile_for(fn, args, kwargs, arch: int = 90, warp_size: int = 32):
    """Compile the Triton or Gluon JIT function `fn` for `arch` (default sm_90a) as the launch
    `fn[grid](*args, **kwargs)` would, without a GPU: the launcher's own binder and argument
    packing pick the same specialization and options, so the binary is the launched one."""
    import triton
    from triton.compiler import ASTSource

    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source_cls
    else:
        source_cls = ASTSource
    target, backend, bound_args, specialization, options = bind_for(fn, args, kwargs, arch,
                                                                    warp_size)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args,
                                                          specialization, options)
    return triton.compile(source_cls(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


class compile_only:
    """Context manager: kernel launches (Triton or Gluon) compile for `arch` (default sm_90a)
    instead of running.

        with compile_only() as built:
            attention_forward(qkv_on_cpu, ...)      # launchers run as usual on CPU tensors
        for name, kernel in built: print(name, resource_usage(kernel), kernel.metadata.shared)

    Lets CI catch GPU-only compile errors (layouts, shared memory, TMA descriptors) and lets a
    developer read the TTGIR/PTX/SASS. Needs TRITON_INTERPRET unset (real JITFunctions) and the
    ptxas that ships with triton. Outputs of the launchers are left unwritten.
    """

    def __init__(self, arch: int = 90, warp_size: int = 32):
        self.arch, self.warp_size = arch, warp_size
        self.built: list = []

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        built = self.built
        self._orig = JITFunction.run

        def run(fn, *args, grid, warmup, **kwargs):
            kernel = compile_for(fn, args, kwargs, self.arch, self.warp_size)
            kernel._init_handles = lambda: None     # no driver to load the binary into
            built.append((fn.__name__, kernel))
            return kernel

        JITFunction.run = run
        return built

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction
        JITFunction.run = self._orig
        return False


def triton_tool(name: str) -> str:
    """Path of a CUDA tool (ptxas, cuobjdump) bundled with triton: no CUDA toolkit needed."""
    import os

    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resource_usage(kernel) -> dict:
    """Registers / stack / spills / shared memory of a compiled kernel, and whether ptxas had to
    serialize its wgmma instructions (warning C7515: a large, silent slowdown on Hopper), from
    re-running the bundled ptxas on the kernel's PTX."""
    import os
    import re
    import subprocess
    import tempfile

    arch = f"sm_{kernel.metadata.target.arch}" + ("a" if kernel.metadata.target.arch == 90 else "")
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        text = subprocess.run([triton_tool("ptxas"), "-v", f"--gpu-name={arch}", ptx,
                               "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True).stderr
    usage = {"regs": None, "stack": None, "spill_stores": None}
    for key, pat in (("regs", r"Used (\d+) registers"), ("stack", r"(\d+) bytes stack frame"),
                     ("spill_stores", r"(\d+) bytes spill stores")):
        m = re.search(pat, text)
        usage[key] = int(m.group(1)) if m else None
    usage["wgmma_serialized"] = "C7515" in text or "wgmma.mma_async instructions are serialized" in text
    usage["shared"] = kernel.metadata.shared
    return usage


# PTX instruction classes counted by ptx_counts (regular expressions).
PTX_COUNTS = {
    "wgmma": r"wgmma\.mma_async",
    "wgmma_bf16": r"wgmma\.mma_async\S*\.bf16\.bf16",
    "wgmma_e4m3": r"wgmma\.mma_async\S*\.e4m3\.e4m3",
    "wait": r"wgmma\.wait_group",
    "commit": r"wgmma\.commit_group",
    "bar": r"\bbar\.sync|barrier\.sync",
    "ex2": r"ex2\.approx",
    "cvt_e4m3": r"cvt\.rn\.satfinite\.e4m3x2",
    "tma": r"cp\.async\.bulk\.tensor",
    "tma_1d": r"cp\.async\.bulk\.tensor\.1d",
    "mbar_wait": r"mbarrier\.try_wait",
    "shfl": r"shfl\.sync",
    "local": r"\.local\.",
    "ld_local": r"ld\.local",
}


def ptx_counts(ptx: str) -> dict:
    """{class: count} of PTX_COUNTS in a kernel's PTX, and "partition_regs": the sorted
    setmaxnreg operands of a warp-specialized kernel (its partitions' register budgets)."""
    out = {k: len(re.findall(p, ptx)) for k, p in PTX_COUNTS.items()}
    out["partition_regs"] = sorted({int(x) for x in re.findall(
        r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
    return out


def report(kernel) -> dict:
    """resource_usage and ptx_counts of a compiled kernel, in one dict."""
    return resource_usage(kernel) | ptx_counts(kernel.asm["ptx"])


def build(fn, *args, **kwargs) -> dict:
    """{kernel name: compiled kernel} of every launch that fn(*args, **kwargs) makes, built for
    sm_90a instead of run (a name launched twice keeps its last build)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compiling for sm_90a needs TRITON_INTERPRET unset")
    with compile_only() as built:
        fn(*args, **kwargs)
    return dict(built)


# ---------------------------------------------------------------------------------------------
# Operands of the real shapes and dtypes (zeros), on the CPU, for compile-only launches
# ---------------------------------------------------------------------------------------------

def fake_qkv(T: int, Hq: int, Hkv: int, D: int, recipe: str = "fp8", rotated: bool = True):
    """A QuantizedQKV of zeros (scales one) as quantize_qkv lays it out: fp8 (token-block
    scaling: block and per-token diagonal copies, vt8 in padded columns for two documents) or
    bf16."""
    from flamia.ops.layout import QuantizedQKV
    if recipe == "bf16":
        b = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)        # noqa: E731
        return QuantizedQKV("bf16", b(T, Hq, D), b(T, Hkv, D), b(T, Hkv, D), None, None, None,
                            None, rotated=False)
    if recipe != "fp8":
        raise ValueError(f"fake_qkv lays out the kernel recipes fp8 and bf16, not {recipe!r}")
    z = lambda *s: torch.zeros(*s, dtype=torch.float8_e4m3fn)       # noqa: E731
    one = torch.ones
    tp = (T + 15) // 16 * 16 + 64     # padded columns (two documents)
    return QuantizedQKV(recipe, z(T, Hq, D), z(T, Hkv, D), z(T, Hkv, D), one(Hq, T),
                        one(Hkv, T), one(Hkv, T), one(Hkv, T), rotated=rotated,
                        vt8=z(Hkv, D, tp),
                        k8_diag=z(T, Hkv, D), v8_diag=z(T, Hkv, D), sk_diag=one(Hkv, T),
                        sv_diag=one(Hkv, T), vnorm=one(Hkv, T),
                        kv_pcu=torch.tensor([0, T // 2, T], dtype=torch.int32),
                        vt8_diag=z(Hkv, D, tp), scale_cols=one(4, Hkv, tp))


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
