"""torch.compile through flamia: the kernel path is one custom op per direction (flamia.custom_ops).

On the CPU the kernels run under Triton's interpreter (conftest.py) and the compiler backend is
aot_eager (dynamo + fake tensors + AOT autograd, no C++ toolchain needed). What must hold: a
full graph (no graph break), results and gradients bitwise those of the eager call, the value
checks still raising under compile, and the ops' fake implementations agreeing with the real
ones (torch.library.opcheck). tests/gpu/test_compile_gpu.py repeats this with inductor.
"""
from __future__ import annotations

import pytest
import torch

import flamia
from flamia import custom_ops
from flamia.ops import kernels_available

pytestmark = pytest.mark.skipif(
    not kernels_available(torch.empty(0), "fp8"),
    reason="needs the kernels (CUDA, or the Triton interpreter with FLAMIA_KERNELS=1)")

D = 64


def _packed(lengths, hq=4, hkv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    mk = lambda h: torch.randn(T, h, D, generator=g).to(torch.bfloat16).requires_grad_()
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return mk(hq), mk(hkv), mk(hkv), cu, torch.randn(T, hq, D, generator=g).to(torch.bfloat16)


def _run(fn, q, k, v, dout, *args):
    out = fn(q, k, v, *args)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_varlen_compiles_to_one_graph_bitwise_eager(recipe):
    """Packed documents (one empty), GQA: no graph break, outputs and gradients bitwise eager."""
    q, k, v, cu, dout = _packed([40, 0, 23])

    def f(q, k, v, cu):
        return flamia.flamia_attn_varlen_func(q, k, v, cu, cu, 40, 40, recipe=recipe)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(q, k, v, cu)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for got, want in zip(_run(compiled, q, k, v, dout, cu), _run(f, q, k, v, dout, cu)):
        assert torch.equal(got, want)


def test_dense_and_module_compile_bitwise_eager():
    """flamia_attn_func and FlamiaAttention under compile, with return_lse."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 24, h, D).to(torch.bfloat16).requires_grad_() for h in (4, 2, 2))
    dout = torch.randn(2, 24, 4, D).to(torch.bfloat16)

    def f(q, k, v):
        out, lse = flamia.flamia_attn_func(q, k, v, recipe="bf16", return_lse=True)
        return out + lse.transpose(1, 2).unsqueeze(-1).to(out.dtype) * 0
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for got, want in zip(_run(compiled, q, k, v, dout), _run(f, q, k, v, dout)):
        assert torch.equal(got, want)

    module = flamia.FlamiaAttention(recipe="fp8")
    torch._dynamo.reset()
    cm = torch.compile(module, backend="aot_eager", fullgraph=True)
    assert torch.equal(cm(q, k, v), module(q, k, v))


@pytest.mark.nonfinite
def test_value_checks_still_raise_under_compile():
    """The checks that read values run inside the forward op: NaN and a bad cu_seqlens still
    give flamia's errors under compile; check_finite=False still skips the NaN check."""
    q, k, v, cu, _ = _packed([16, 16])

    def f(q, k, v, cu, check_finite=True):
        return flamia.flamia_attn_varlen_func(q, k, v, cu, cu, 16, 16,
                                              check_finite=check_finite)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    bad = q.detach().clone()
    bad[3, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="q contains NaN"):
        compiled(bad, k, v, cu)
    with pytest.raises(ValueError, match="non-decreasing"):
        compiled(q, k, v, torch.tensor([0, 20, 18, 32], dtype=torch.int32))
    with pytest.raises(ValueError, match="longest document"):
        compiled(q, k, v, torch.tensor([0, 30, 32], dtype=torch.int32))
    out = compiled(bad, k, v, cu, check_finite=False)
    assert out[:16].isnan().any() and not out[16:].isnan().any()   # the first document only


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_custom_ops_opcheck(recipe):
    """torch.library.opcheck: the fake implementations against the real outputs (shapes,
    dtypes, devices), both ops. (Its schema test compares fp8 tensors with ops the CPU lacks
    for float8: "mul_cpu_reduced_float" not implemented; the ops have no autograd registration
    of their own: custom_ops._OpAttention is their autograd.)"""
    q, k, v, cu, dout = _packed([20, 12], seed=2)
    args = (q, k, v, cu, cu, 20, 20, recipe, True, D ** -0.5, False, True)
    torch.library.opcheck(custom_ops.fwd, args,
                          test_utils=("test_faketensor",))
    out, lse, saved = custom_ops.fwd(*args)
    if recipe == "bf16":
        saved[:3] = q.detach(), k.detach(), v.detach()
    torch.library.opcheck(custom_ops.bwd, (dout, out.detach(), lse, saved, cu, 20, recipe, True,
                                           D ** -0.5, False),
                          test_utils=("test_faketensor",))


def test_reference_path_under_compile(reference_only):
    """The reference emulation (every call off the kernels) compiles too, with graph breaks
    where it reads values, and gives the eager results; a dense call included."""
    q, k, v, cu, dout = _packed([20, 12], seed=3)

    def f(q, k, v, cu):
        return flamia.flamia_attn_varlen_func(q, k, v, cu, cu, 20, 20)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager")
    for got, want in zip(_run(compiled, q, k, v, dout, cu), _run(f, q, k, v, dout, cu)):
        assert torch.equal(got, want)
    qd, kd, vd = (x.detach()[:32].reshape(2, 16, -1, D) for x in (q, k, v))
    dense = torch.compile(lambda q, k, v: flamia.flamia_attn_func(q, k, v), backend="aot_eager")
    assert torch.equal(dense(qd, kd, vd), flamia.flamia_attn_func(qd, kd, vd))


def test_hf_llama_compiles_with_flamia_attention():
    """A tiny transformers Llama with flamia's fp8 attention (packed documents by position_ids),
    compiled: loss and gradients match the eager model's."""
    transformers = pytest.importorskip("transformers")
    from flamia.integrations import hf
    name = hf.register("flamia_fp8")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=64, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.set_attn_implementation(name)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(24), torch.arange(16)])[None]
    results = []
    torch._dynamo.reset()
    for fn in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad()
        loss = fn(input_ids=ids, position_ids=pos, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-3, atol=1e-3)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def test_new_documents_each_step_compile_at_most_twice():
    """A training loop: every step packs other documents (cu_seqlens of another length,
    another max_seqlen). Dynamo compiles once, then once more with those dynamic; results stay
    bitwise eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def f(q, k, v, cu, L):
        return flamia.flamia_attn_varlen_func(q, k, v, cu, cu, L, L)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for seed, lengths in enumerate([[40, 24], [30, 2, 32], [10, 20, 30, 4], [64]]):
        q, k, v, cu, dout = _packed(lengths, seed=seed)
        got = _run(compiled, q, k, v, dout, cu, max(lengths))
        for a, b in zip(got, _run(f, q, k, v, dout, cu, max(lengths))):
            assert torch.equal(a, b)
    assert counter.frame_count <= 2
