"""Make the Triton interpreter's float casts behave like the GPU's (the CPU path of the kernels).

Under TRITON_INTERPRET=1 the interpreter converts floats with its own bit manipulation, which
differs from the hardware on 1-6 % of values: fp32 -> fp8 loses the mantissa carry, rounds ties away
from zero, truncates subnormals and does not saturate (537.6 -> 256), and fp32 -> bf16 truncates
instead of rounding to nearest even. The kernels rely on the hardware behaviour
(`cvt.rn.satfinite.e4m3x2.f32`, `cvt.rn.bf16.f32`), so `install()` routes every float <-> float
conversion of the interpreter through torch, clamping to the format's finite range first for the FP8
formats (satfinite; NaN stays NaN). Kernel sources are unchanged: `x.to(tl.float8e4nv)` is the same
line on the GPU and here. Also fixes tl.dot on bf16 operands (the interpreter multiplies their raw
uint16 storage). Called by flamia.ops.numerics (which every kernel module imports) at import time,
only when interpreting (TRITON_INTERPRET=1). Idempotent.
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
               torch.bfloat16: np.uint16, torch.float8_e4m3fn: np.uint8,
               torch.float8_e5m2: np.uint8}
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
