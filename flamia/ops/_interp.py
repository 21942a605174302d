"""Test-only: make the Triton interpreter's float casts behave like the GPU's.

Under TRITON_INTERPRET=1 the interpreter converts floats with its own bit manipulation, which
differs from the hardware on 1-6 % of values: fp32 -> fp8 loses the mantissa carry, rounds ties
away from zero, truncates subnormals and does not saturate (537.6 -> 256), and fp32 -> bf16
truncates instead of rounding to nearest even. The kernels rely on the hardware behaviour
(`cvt.rn.satfinite.e4m3x2.f32`, `cvt.rn.bf16.f32`), so `install()` routes every float <-> float
conversion of the interpreter through torch, clamping to the format's finite range first for the
FP8 formats (satfinite; NaN stays NaN). Kernel sources are unchanged: `x.to(tl.float8e4nv)` is
the same line on the GPU and here.

Also fixes tl.dot on bf16 operands (the interpreter multiplies their raw uint16 storage).

Called by flamia.ops.quantize / forward at import time, only when interpreting. Idempotent.
"""
from __future__ import annotations

import numpy as np
import torch

_INSTALLED = False


def _torch_dtype(tl_dtype):
    import triton.language as tl
    return {
        tl.float32: torch.float32,
        tl.float64: torch.float64,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
    }.get(tl_dtype)


_SAT = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# How the interpreter stores each dtype in numpy (bf16 / fp8 as raw unsigned integers).
_NP_STORAGE = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
               torch.bfloat16: np.uint16, torch.float8_e4m3fn: np.uint8, torch.float8_e5m2: np.uint8}
_TORCH_RAW = {np.dtype(np.uint16): torch.int16, np.dtype(np.uint8): torch.uint8}


def _to_torch(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    arr = np.ascontiguousarray(data)
    raw = _TORCH_RAW.get(arr.dtype)
    if raw is None:
        return torch.from_numpy(arr.copy()).to(dtype)
    return torch.from_numpy(arr.view(np.int16) if raw is torch.int16 else arr.copy()).view(dtype)


def _to_numpy(x: torch.Tensor) -> np.ndarray:
    storage = _NP_STORAGE[x.dtype]
    if storage == np.uint16:
        return x.contiguous().view(torch.int16).numpy().view(np.uint16)
    if storage == np.uint8:
        return x.contiguous().view(torch.uint8).numpy()
    return x.contiguous().numpy()


def torch_cast(data: np.ndarray, src: torch.dtype, dst: torch.dtype) -> np.ndarray:
    """Cast interpreter storage `data` from `src` to `dst` the way the GPU does (RNE, satfinite)."""
    x = _to_torch(data, src)
    if dst in _SAT:
        fmax = _SAT[dst]
        x = x.float().clamp(-fmax, fmax)
    return _to_numpy(x.to(dst)).reshape(np.shape(data))


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from triton.runtime import interpreter as interp

    builder_cls = interp.InterpreterBuilder
    orig_fp_to_fp = builder_cls.create_fp_to_fp
    orig_cast_impl = builder_cls.cast_impl

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        s, d = _torch_dtype(src.dtype.scalar), _torch_dtype(dst_type.scalar)
        if s is None or d is None:
            return orig_fp_to_fp(self, src, dst_type, rounding_mode)
        return interp.TensorHandle(torch_cast(src.data, s, d), dst_type.scalar)

    def cast_impl(self, src, dst_type):
        s, d = _torch_dtype(src.dtype.scalar), _torch_dtype(dst_type.scalar)
        if s is None or d is None or s == d:
            return orig_cast_impl(self, src, dst_type)
        return interp.TensorHandle(torch_cast(src.data, s, d), dst_type.scalar)

    orig_dot = builder_cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # The interpreter multiplies bf16 operands as their raw uint16 storage; decode every
        # 16/8-bit float operand exactly to fp32 (the products are exact there, as on the MMA).
        sa, sb = _torch_dtype(a.dtype.scalar), _torch_dtype(b.dtype.scalar)
        if sa is None or sb is None or (sa == torch.float32 and sb == torch.float32):
            return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        a32 = _to_torch(a.data, sa).float().numpy()
        b32 = _to_torch(b.data, sb).float().numpy()
        out = np.matmul(a32, b32, dtype=np.float32).astype(d.data.dtype) + d.data
        return interp.TensorHandle(out, d.dtype.scalar)

    builder_cls.create_fp_to_fp = create_fp_to_fp
    builder_cls.cast_impl = cast_impl
    builder_cls.create_dot = create_dot
    # fp_ext / fp_trunc are class-level lambdas bound to cast_impl by name lookup at call time
    builder_cls.create_fp_ext = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder_cls.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    _INSTALLED = True


# ---------------------------------------------------------------------------------------------
# Compile-only mode: build the real sm_90a binaries on a machine without a GPU.
# ---------------------------------------------------------------------------------------------

def compile_for(fn, args, kwargs, arch: int = 90, warp_size: int = 32):
    """Compile the Triton or Gluon JIT function `fn` for `arch` (default sm_90a) as the launch
    `fn[grid](*args, **kwargs)` would, without a GPU: the launcher's own binder and argument
    packing pick the same specialization and options, so the binary is the launched one."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source_cls
    else:
        source_cls = ASTSource
    target = GPUTarget("cuda", arch, warp_size)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
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
