"""Kernel launches with less host time than Triton's own path, for calls that repeat.

    launch_kernel(kernel, grid, *args, **kwargs)      # as kernel[grid](*args, **kwargs)

Triton's `JITFunction.run` specializes every argument on every call (its binder: a type and an
attribute string per argument, the layout's repr for each TMA descriptor), builds the cache key
from them, looks the compiled kernel up, checks the globals it read and asks the driver for the
device and stream: 2-26 us per launch on a CPU where our whole fp8 call issues in ~0.3 ms, more on
a slower host, seven launches per fp8 forward and backward. Here the first call of a call site
goes through `JITFunction.run` and keeps the compiled kernel it returns under a key that is at
least as fine as Triton's specialization (`spec_key`: every rule Triton 3.6 specializes on, and
constexprs by value); a later call with the same key launches that compiled kernel directly
(`CompiledKernel.run`, the launcher Triton itself calls last). Anything the key does not cover
(an argument of another type, a launch hook, a callable grid, the interpreter, a replaced
JITFunction.run such as benchmarks/tools/compile.py's) takes Triton's path. tests/test_launch.py
holds the key to Triton's binder.
"""
from __future__ import annotations

import torch

try:
    from triton import knobs
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor as _TritonDescriptor
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
        _DESCRIPTORS = (_TritonDescriptor, _GluonDescriptor)
    except Exception:  # pragma: no cover - triton without Gluon
        _DESCRIPTORS = (_TritonDescriptor,)
    HAVE_FAST_LAUNCH = True
    _TRITON_RUN = JITFunction.run
except Exception:  # pragma: no cover - another triton
    HAVE_FAST_LAUNCH = False

_I32_MIN, _I32_MAX, _I64_MAX = -2 ** 31, 2 ** 31 - 1, 2 ** 63 - 1
_MAX_ENTRIES = 256         # compiled kernels kept per kernel (programs that sweep shapes)


class _Unkeyed(Exception):
    """An argument outside the rules below: the call takes Triton's path."""


def _int_key(x: int):
    # Triton: 1 becomes a constexpr; otherwise i32 / i64 / u64 by range, "D" when x % 16 == 0
    if x == 1:
        return 1
    return (x & 15 == 0, _I32_MIN <= x <= _I32_MAX, x <= _I64_MAX)


def _tensor_key(x):
    return (x.dtype, x.data_ptr() & 15 == 0)     # a pointer: its type and 16-byte alignment


def _descriptor_key(x):
    return (type(x), x.base.dtype, *x.block_shape, getattr(x, "layout", None), x.padding)


def _other_key(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):              # a subclass
        return _tensor_key(x)
    if HAVE_FAST_LAUNCH and isinstance(x, _DESCRIPTORS):
        return _descriptor_key(x)
    raise _Unkeyed


# What Triton's specialization of a non-constexpr argument depends on, by the argument's type
_KEYS = {int: _int_key, bool: lambda x: x, float: lambda x: float,   # fp32: never specialized
         torch.Tensor: _tensor_key}
if HAVE_FAST_LAUNCH:
    _KEYS.update({d: _descriptor_key for d in _DESCRIPTORS})


class _Site:
    """One kernel's parameters (their order, defaults, which are constexprs) and the compiled
    kernels met so far, by key."""
    __slots__ = ("names", "params", "defaults", "keyers", "compiled")

    def __init__(self, fn):
        self.names = [p.name for p in fn.params]
        self.params = frozenset(self.names)
        self.defaults = {p.name: p.default for p in fn.params if p.has_default}
        # per parameter: None for a constexpr (keyed by value), else the table above
        self.keyers = [None if p.is_constexpr else _KEYS for p in fn.params]
        self.compiled: dict = {}


_SITES: dict = {}


def clear() -> None:
    """Forget every kept compiled kernel (tools that stub Triton's path call it around the stub)."""
    _SITES.clear()


def spec_key(fn, args: tuple, kwargs: dict):
    """(key, values): a key that equal Triton specializations of fn's call share, or None where
    an argument is outside the rules this module knows; values: every parameter's value in
    signature order, as Triton's launcher takes them."""
    site = _SITES.get(fn)
    if site is None:
        site = _SITES[fn] = _Site(fn)
    values = list(args)
    if len(args) < len(site.names):
        try:
            values += [kwargs[nm] if nm in kwargs else site.defaults[nm]
                       for nm in site.names[len(args):]]
        except KeyError as e:
            raise TypeError(f"{fn.__name__}: missing argument {e.args[0]!r}") from None
    try:
        key = tuple([v if keys is None else keys.get(type(v), _other_key)(v)
                     for v, keys in zip(values, site.keyers)])
    except _Unkeyed:
        return None, values
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in site.params))
    return (key, options), values


def _run_replaced() -> bool:
    """JITFunction.run is not Triton's (tools that compile instead of launching, stubs): every
    call goes to it, unless the replacement returns launchable kernels and says so
    (`returns_launchable`)."""
    run = JITFunction.run
    return run is not _TRITON_RUN and not getattr(run, "returns_launchable", False)


def _hooked(hook) -> bool:
    """A launch hook is set (a profiler's): an empty HookChain, Triton's default, is none."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_kernel(fn, grid, *args, **kwargs):
    """fn[grid](*args, **kwargs), through the compiled kernel of an earlier call with the same
    specialization when there is one (module docstring)."""
    if (not HAVE_FAST_LAUNCH or not isinstance(fn, JITFunction) or callable(grid)
            or fn.pre_run_hooks or _run_replaced() or _hooked(knobs.runtime.launch_enter_hook)
            or _hooked(knobs.runtime.launch_exit_hook)):
        return fn[grid](*args, **kwargs)
    spec, values = spec_key(fn, args, kwargs)
    if spec is None:
        return fn[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    # the options Triton's path adds from its knobs, and the device its caches are kept per
    key = (spec, device, knobs.runtime.debug, knobs.compilation.instrumentation_mode)
    compiled = _SITES[fn].compiled
    try:
        kernel = compiled.get(key)
    except TypeError:              # an unhashable constexpr value: Triton's path
        return fn[grid](*args, **kwargs)
    if kernel is None:
        kernel = fn[grid](*args, **kwargs)
        if kernel is not None and hasattr(kernel, "run") and not hasattr(kernel, "result"):
            if len(compiled) >= _MAX_ENTRIES:
                compiled.clear()
            compiled[key] = kernel
        return kernel
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(device)
    kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None,
               None, *values)
    return kernel
