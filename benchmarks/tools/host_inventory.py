"""What one call of the kernel path issues, counted on a CPU: the Triton / Gluon launches (by
kernel), the torch operations that would launch a CUDA kernel, the allocations, the TMA
descriptors, and whether the per-cu_seqlens metadata is rebuilt.

    with host_inventory() as inv:                # sm_90 code paths on CPU tensors
        out, lse, qkv = kernel_forward(...)
    inv.launches    # ['_quantize_q_kernel', ...]

Launches are stubbed the way Triton's own launcher starts (its binder specializes every
argument and computes the cache key) and stop before the driver: nothing runs, outputs are
left unwritten. Triton's path hands back a stub compiled kernel, so flamia.ops.launch takes
later calls of the same specialization past the binder as on a GPU, and the host time measured
under the stub is our Python plus, for a call site's first specialization, Triton's binder
(not the driver's launch, nor the CUDA caching allocator, which is cheaper than the CPU's).
Needs real JITFunctions (TRITON_INTERPRET unset); tests run it in a subprocess (tests/_sm90.py).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operations that launch nothing on CUDA: allocations and views (_local_scalar_dense, a
# device sync, is counted apart)
_ALLOCATIONS = ("empty.memory_format", "empty_strided.default", "empty_like.default",
                "new_empty.default", "new_empty_strided.default")
_NO_KERNEL = ("view", "_unsafe_view", "as_strided", "slice", "select", "permute", "t",
              "transpose", "unsqueeze", "squeeze", "expand", "alias", "detach", "_reshape_alias",
              "reshape", "unflatten", "flatten", "split", "chunk", "unbind", "lift_fresh",
              "view_as")


class _Counter(TorchDispatchMode):
    def __init__(self, inv):
        super().__init__()
        self.inv = inv

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__             # e.g. "empty.memory_format", "zero_.default"
        base = name.split(".")[0]
        if name in _ALLOCATIONS:
            self.inv.allocations += 1
        elif base == "_local_scalar_dense":
            self.inv.syncs.append(name)      # .item() / .tolist(): a device sync on CUDA
        elif base not in _NO_KERNEL:
            self.inv.torch_kernels.append(name)
        return func(*args, **(kwargs or {}))


class Inventory:
    def __init__(self):
        self.launches: list[str] = []
        self.torch_kernels: list[str] = []
        self.syncs: list[str] = []
        self.allocations = 0
        self.descriptors = 0

    def as_dict(self) -> dict:
        return {"launches": self.launches, "torch_kernels": self.torch_kernels,
                "syncs": self.syncs, "allocations": self.allocations,
                "descriptors": self.descriptors}


@contextlib.contextmanager
def stubbed_sm90():
    """The sm_90 code paths on CPU tensors, every launch stubbed after Triton's binder (or,
    for a specialization met before, flamia.ops.launch's key)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    from flamia.ops import config, launch

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor
    descriptor_types = (GluonDescriptor, TensorDescriptor)

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders: dict = {}
    launched: list[tuple[str, int]] = []     # (kernel, TMA descriptors among its arguments)

    class Compiled:
        """What Triton's path returns: flamia.ops.launch launches later calls of the same
        specialization through its run(), which records them the same way."""
        function = packed_metadata = None

        def __init__(self, name):
            self.name = name

        def run(self, *args):       # grid (3), stream, function, metadata, hooks (3), values
            launched.append((self.name, sum(isinstance(a, descriptor_types) for a in args[9:])))

    def run(fn, *args, grid, warmup, **kwargs):
        if fn not in binders:
            binders[fn] = (create_function_from_signature(fn.signature, fn.params, backend), {})
        binder, key_cache = binders[fn]
        _bound, specialization, options = binder(*args, **kwargs)
        compute_cache_key(key_cache, specialization, options)
        launched.append((fn.__name__, sum(isinstance(a, descriptor_types) for a in args)))
        return Compiled(fn.__name__)

    run.returns_launchable = True        # flamia.ops.launch may launch its Compiled

    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    saved = (JITFunction.run, config.is_sm90, config.interpreting,
             config.triton_forward_config, torch.cuda.current_device)
    triton_config = config.triton_forward_config
    JITFunction.run = run
    config.is_sm90 = lambda device: True
    config.interpreting = lambda: False
    config.triton_forward_config = lambda d, fp8, device: triton_config(d, fp8,
                                                                        torch.device("cuda"))
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    launch.clear()                # stub kernels live only inside this block
    try:
        yield launched
    finally:
        launch.clear()
        (JITFunction.run, config.is_sm90, config.interpreting,
         config.triton_forward_config, torch.cuda.current_device) = saved
        if raw_stream is None:
            del torch._C._cuda_getCurrentRawStream
        else:
            torch._C._cuda_getCurrentRawStream = raw_stream


@contextlib.contextmanager
def host_inventory():
    """An Inventory of everything issued inside the block (module docstring)."""
    inv = Inventory()
    with stubbed_sm90() as launched, _Counter(inv):
        yield inv
    inv.launches = [name for name, _ in launched]
    inv.descriptors = sum(n for _, n in launched)


def memo_entries(cu_seqlens: torch.Tensor) -> int:
    """How many metadata entries the kernels memoized on this cu_seqlens tensor
    (flamia.ops.schedule.per_cu_seqlens)."""
    from flamia.ops import schedule
    memo = getattr(cu_seqlens, schedule._MEMO_ATTR, None)
    return 0 if memo is None else len(memo[1])
