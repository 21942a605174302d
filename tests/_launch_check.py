"""Run by tests/test_launch.py outside the interpreter (real JITFunctions, no GPU): flamia's
launch keys (flamia.ops.launch.spec_key) against Triton's own binder, and launch_kernel's
dispatch with the driver stubbed. Prints one REPORT<json> line.

Calls: every launch of the kernel path's fp8 and bf16 forward and backward (D = 64 / 128, causal
or not, several document splits and head counts), captured with the launches stubbed; then
random variants of each (ints across Triton's classes: 1, multiples of 16, i32 / i64 range;
tensors at 16-byte aligned and unaligned addresses; floats), one argument changed per
variant. Checked: calls with equal keys get
equal Triton specializations and options (the key is at least as fine as Triton's), and the
values handed to the compiled kernel are the binder's, in its order.
"""
from __future__ import annotations

import json
import os
import random
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from benchmarks.tools.host_inventory import stubbed_sm90  # noqa: E402
from flamia.kernel_path import kernel_backward, kernel_forward  # noqa: E402
from flamia.ops import launch as launch_mod  # noqa: E402

INTS = [0, 1, 2, 15, 16, 17, 48, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, 2 ** 40,
        2 ** 63 + 16, -16, -1, -2 ** 31, -2 ** 31 - 16]


def captured_calls():
    calls = []
    cases = [("fp8", 128, [512] * 4, 8, 2, True), ("fp8", 64, [300, 0, 1, 2, 700], 4, 4, True),
             ("fp8", 128, [1000, 24], 4, 1, False), ("bf16", 128, [512, 512], 8, 2, True),
             ("bf16", 64, [129, 7], 2, 2, False)]
    with stubbed_sm90():
        stub = JITFunction.run

        def record(fn, *args, grid, warmup, **kwargs):
            calls.append((fn, args, kwargs))
            return stub(fn, *args, grid=grid, warmup=warmup, **kwargs)

        JITFunction.run = record
        launch_mod.HAVE_FAST_LAUNCH = False       # every call through Triton's path
        try:
            for recipe, d, lens, hq, hkv, causal in cases:
                T = sum(lens)
                q = torch.randn(T, hq, d).to(torch.bfloat16)
                k, v = (torch.randn(T, hkv, d).to(torch.bfloat16) for _ in range(2))
                cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
                out, lse, qkv = kernel_forward(q, k, v, cu, max(lens), recipe, causal, None)
                kernel_backward(torch.randn_like(q), out, lse, qkv, cu, max(lens), causal, None,
                                False)
        finally:
            launch_mod.HAVE_FAST_LAUNCH = True
    return calls


def unaligned(x: torch.Tensor) -> torch.Tensor:
    """A tensor of x's dtype whose address is off 16-byte alignment."""
    flat = torch.empty(x.numel() + 16, dtype=x.dtype)
    return flat[1:1 + x.numel()].view(x.shape) if x.numel() else flat[1:1]


def variant(fn, args, kwargs, rng):
    """args with one non-constexpr argument changed (so that many variants share a key)."""
    const = [p.is_constexpr for p in fn.params]
    free = [i for i, a in enumerate(args) if not const[i]
            and (type(a) in (int, float) or isinstance(a, torch.Tensor))]
    i = rng.choice(free)
    a = args[i]
    if type(a) is int:
        new = rng.choice(INTS + [a, a + 16, a + 32])
    elif type(a) is float:
        new = rng.choice([a, 0.0, 1.0, -3.5])
    else:
        new = unaligned(a) if rng.random() < 0.5 else a.clone()
    return args[:i] + (new,) + args[i + 1:], kwargs


def main():
    backend = make_backend(GPUTarget("cuda", 90, 32))
    rng = random.Random(0)
    calls = captured_calls()
    binders = {}
    seen: dict = {}       # (fn, key) -> Triton's (specialization, options)
    n_checked = n_keys = 0
    for fn, args, kwargs in calls:
        if fn not in binders:
            binders[fn] = create_function_from_signature(fn.signature, fn.params, backend)
        for r in range(60):
            a, kw = (args, kwargs) if r == 0 else variant(fn, args, kwargs, rng)
            key, values = launch_mod.spec_key(fn, a, kw)
            assert key is not None, f"{fn.__name__}: an argument spec_key cannot describe"
            bound, spec, options = binders[fn](*a, **kw)
            assert len(values) == len(bound) and all(
                x is y for x, y in zip(values, bound.values())), \
                f"{fn.__name__}: launch values differ from the binder's"
            triton_key = (str(spec), str(sorted(options.items())))
            prev = seen.setdefault((fn, key), triton_key)
            assert prev == triton_key, \
                f"{fn.__name__}: one key, two Triton specializations:\n{prev}\n{triton_key}"
            n_checked += 1
    n_keys = len(seen)
    print("REPORT" + json.dumps({"calls": len(calls), "checked": n_checked, "keys": n_keys,
                                 "kernels": sorted({fn.__name__ for fn, _, _ in calls}),
                                 "dispatch": dispatch_check()}))


def dispatch_check() -> dict:
    """launch_kernel with Triton's path and the compiled kernel stubbed: what goes where."""
    from triton import knobs

    from flamia.ops.quantize import _quantize_q_kernel as fn
    events = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def run(self, *args):
            events.append(("compiled", args))

    def triton_path(fn_, *args, grid, warmup, **kwargs):
        events.append(("triton", args))
        return Compiled()

    triton_path.returns_launchable = True

    saved = (JITFunction.run, torch.cuda.current_device,
             getattr(torch._C, "_cuda_getCurrentRawStream", None))
    JITFunction.run = triton_path
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 7
    try:
        x = torch.zeros(64, 2, 128, dtype=torch.bfloat16)
        q8 = torch.empty(64, 2, 128, dtype=torch.float8_e4m3fn)
        sq = torch.empty(2, 64)

        def call(q, T):
            launch_mod.launch_kernel(fn, (2, 1), q, q8, sq, x, q.stride(0), q.stride(1), T, 2, 0.1,
                                     D=128, BLOCK_T=64, ROTATE=True, num_warps=4)
        call(x, 64)
        call(x, 64)              # same key: the compiled kernel
        call(x, 48)              # 48 % 16 == 0 as 64: still the same key
        call(x, 50)              # another Triton class: Triton's path
        call(unaligned(x), 64)   # another alignment: Triton's path
        hook = lambda metadata: None  # noqa: E731
        knobs.runtime.launch_enter_hook.add(hook)
        call(x, 64)              # a profiler's hook: Triton's path
        knobs.runtime.launch_enter_hook.remove(hook)
        call(x, 64)
        triton_path.returns_launchable = False
        call(x, 64)              # a replaced JITFunction.run that does not say so: its path
        triton_path.returns_launchable = True
        for _ in range(2):       # an unhashable constexpr: Triton's path every time
            launch_mod.launch_kernel(fn, (2, 1), x, q8, sq, x, x.stride(0), x.stride(1), 64, 2,
                                     0.1, D=[128], BLOCK_T=64, ROTATE=True, num_warps=4)
        compiled = events[1][1]
    finally:
        JITFunction.run, torch.cuda.current_device, stream = saved
        if stream is None:
            del torch._C._cuda_getCurrentRawStream
        else:
            torch._C._cuda_getCurrentRawStream = stream
    return {"route": [e[0] for e in events],
            "compiled_head": [str(v) for v in compiled[:9]],
            "compiled_tail": [str(v) for v in compiled[-4:]],
            "n_values": len(compiled)}


if __name__ == "__main__":
    main()
