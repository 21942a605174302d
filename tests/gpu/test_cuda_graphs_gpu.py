"""A flamia call, forward and backward, captured in a CUDA graph (skipped without CUDA).

    python -m pytest -q tests/gpu/test_cuda_graphs_gpu.py

A small model's training step is bound by the host's time to issue each layer's kernels
(benchmarks/NOTES.md, sessions 14-15); with a fixed shape (dense batches, or packed batches of
one cu_seqlens) a CUDA graph removes that time. What capture needs: no host sync inside the call
(check_finite=False), metadata memoized on cu_seqlens built before capture (the warm-up call),
and every launch deterministic so that a replay gives what an eager call gives, bitwise.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import flamia  # noqa: E402
from flamia.inputs import cu_seqlens_from_lengths  # noqa: E402

LENGTHS = (700, 17, 0, 1, 1330)


def _inputs(layout: str, D: int, gen: torch.Generator):
    hq, hkv = 8, 2
    shape = (2, 1024) if layout == "dense" else (sum(LENGTHS),)
    mk = lambda h: torch.randn(*shape, h, D, generator=gen, device="cuda").bfloat16()  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), mk(hq)      # q, k, v, dout


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_graph_replay_equals_eager(recipe, layout, D):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (x.clone() for x in _inputs(layout, D, gen))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    cu = cu_seqlens_from_lengths(LENGTHS, device="cuda")

    def step():
        if layout == "dense":
            out = flamia.flamia_attn_func(q, k, v, recipe=recipe, check_finite=False,
                                          deterministic=True)
        else:
            out = flamia.flamia_attn_varlen_func(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS),
                                                 recipe=recipe, check_finite=False,
                                                 deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):            # warm-up: compiles, memoizes the metadata
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    for _ in range(2):                       # new values in the captured input buffers
        with torch.no_grad():
            for x, y in zip((q, k, v, dout), _inputs(layout, D, gen)):
                x.copy_(y)
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "dq", "dk", "dv"), captured, eager):
            assert torch.isfinite(b).all(), name
            assert torch.equal(a, b), f"{name}: replay differs from the eager call"
