"""flamia under torch.compile with inductor, on the GPU (skipped without CUDA).

    python -m pytest -q tests/gpu/test_compile_gpu.py

Under compile the kernel path is one custom op per direction (flamia.custom_ops): the graph
must have no break, and outputs and gradients must be bitwise the eager call's (the same
kernels, deterministic launches). Also: a model around the call (projections and a norm that
inductor fuses), and the value checks still raising.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import flamia  # noqa: E402
from flamia.inputs import cu_seqlens_from_lengths  # noqa: E402

LENGTHS = (700, 17, 0, 1, 1330)


def _inputs(layout: str, D: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (2, 1024) if layout == "dense" else (sum(LENGTHS),)
    mk = lambda h: torch.randn(*shape, h, D, generator=gen, device="cuda").bfloat16()  # noqa: E731
    q, k, v = (mk(h).requires_grad_() for h in (8, 2, 2))
    return q, k, v, mk(8)


def _attend(layout, recipe, cu):
    L = max(LENGTHS)
    if layout == "dense":
        return lambda q, k, v: flamia.flamia_attn_func(q, k, v, recipe=recipe, deterministic=True)
    return lambda q, k, v: flamia.flamia_attn_varlen_func(q, k, v, cu, cu, L, L, recipe=recipe,
                                                          deterministic=True)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_inductor_full_graph_bitwise_eager(recipe, layout, D):
    q, k, v, dout = _inputs(layout, D)
    f = _attend(layout, recipe, cu_seqlens_from_lengths(LENGTHS, device="cuda"))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    for _ in range(2):          # the second call runs the cached graph
        got = compiled(q, k, v)
        got_grads = torch.autograd.grad(got, (q, k, v), dout)
    want = f(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)


class _Block(torch.nn.Module):
    """RMSNorm, q/k/v projections, flamia attention (GQA 8/2), output projection."""

    def __init__(self, dim=512, D=64):
        super().__init__()
        self.D = D
        self.norm = torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, (8 + 2 + 2) * D, bias=False)
        self.out = torch.nn.Linear(8 * D, dim, bias=False)

    def forward(self, x, cu, max_seqlen):
        T = x.shape[0]
        q, k, v = self.qkv(self.norm(x)).split([8 * self.D, 2 * self.D, 2 * self.D], dim=-1)
        o = flamia.flamia_attn_varlen_func(
            q.reshape(T, 8, self.D), k.reshape(T, 2, self.D), v.reshape(T, 2, self.D), cu, cu,
            max_seqlen, max_seqlen, recipe="fp8")
        return x + self.out(o.reshape(T, -1))


def test_compiled_block_trains_like_eager():
    """A block compiled whole (fullgraph): its loss and parameter gradients match eager. The
    attention is bitwise the same; inductor's fused norm / matmul epilogues may round
    differently, so the comparison is a tolerance."""
    torch.manual_seed(0)
    block = _Block().cuda().to(torch.bfloat16)
    cu = cu_seqlens_from_lengths(LENGTHS, device="cuda")
    x = torch.randn(sum(LENGTHS), 512, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    losses, grads = [], []
    for fn in (block, compiled):
        block.zero_grad()
        loss = fn(x, cu, max(LENGTHS)).float().square().mean()
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.float().clone() for p in block.parameters()])
    assert abs(losses[0] - losses[1]) <= 1e-2 * abs(losses[0])
    for a, b in zip(*grads):
        assert (a - b).norm() <= 0.05 * a.norm(), (a - b).norm() / a.norm()


def test_value_checks_raise_under_inductor():
    q, k, v, _ = _inputs("varlen", 64, seed=1)
    f = _attend("varlen", "fp8", cu_seqlens_from_lengths(LENGTHS, device="cuda"))
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    bad = q.detach().clone()
    bad[5, 3, 7] = float("inf")
    with pytest.raises(ValueError, match="q contains NaN or Inf"):
        compiled(bad, k, v)


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_reduce_overhead_mode_runs_flamia_outside_its_graphs(recipe):
    """mode="reduce-overhead": the ops are tagged cudagraph_unsafe (custom_ops says why), so
    inductor leaves them out of its CUDA graphs; results stay bitwise eager's."""
    q, k, v, dout = _inputs("varlen", 64, seed=2)
    f = _attend("varlen", recipe, cu_seqlens_from_lengths(LENGTHS, device="cuda"))
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):          # warm-up, record, replay
        got = compiled(q, k, v)
        got_grads = torch.autograd.grad(got, (q, k, v), dout)
    want = f(q, k, v)
    assert torch.equal(got, want)
    for a, b in zip(got_grads, torch.autograd.grad(want, (q, k, v), dout)):
        assert torch.equal(a, b)


def test_new_documents_each_step_inductor():
    """Other documents every step (cu_seqlens length and max_seqlen change): at most two
    compiles, results bitwise eager."""
    from torch._dynamo.testing import CompileCounterWithBackend
    gen = torch.Generator(device="cuda").manual_seed(3)

    def f(q, k, v, cu, L):
        return flamia.flamia_attn_varlen_func(q, k, v, cu, cu, L, L, recipe="fp8")
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for lengths in ([1500, 548], [700, 17, 0, 1, 1330], [2048], [100] * 20 + [48]):
        T = sum(lengths)
        q, k, v = (torch.randn(T, h, 64, generator=gen, device="cuda").bfloat16()
                   for h in (8, 2, 2))
        cu = cu_seqlens_from_lengths(lengths, device="cuda")
        assert torch.equal(compiled(q, k, v, cu, max(lengths)), f(q, k, v, cu, max(lengths)))
    assert counter.frame_count <= 2
