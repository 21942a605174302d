"""The cuDNN ragged attention that `flamia train-check --runs cudnn` trains with
(flamia.bench.cudnn_graphs.cudnn_ragged_varlen), against an fp32 reference per document, on the
H200. Skipped where cudnn-frontend is not installed."""
from __future__ import annotations

import pytest
import torch

from flamia.integrations.hf import sdpa_per_document

cudnn = pytest.importorskip("cudnn")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("D", [64, 128])
def test_cudnn_ragged_varlen_matches_fp32_per_document(D):
    from flamia.bench import cudnn_graphs as CG

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(D)
    Hq, Hkv = 8, 2
    builds = CG.GRAPH_BUILDS["count"]
    for lengths in ([1000, 37, 2048, 513, 1], [7, 2000, 1024, 500, 68]):   # same T, 5 docs
        T = sum(lengths)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                          device=dev)
        q, k, v, do = (torch.randn(T, h, D, device=dev, generator=g).bfloat16()
                       for h in (Hq, Hkv, Hkv, Hq))
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        # poison: NaN in the caching allocator's free blocks, where the outputs will land
        poison = [torch.full_like(t, float("nan")) for t in (q, q, k, v, q)]
        del poison
        out = CG.cudnn_ragged_varlen(*x, cu, max(lengths)).detach()
        out_g = CG.cudnn_ragged_varlen(*x, cu, max(lengths))
        out_g.backward(do)
        y = [t.float().requires_grad_(True) for t in (q, k, v)]
        ref = sdpa_per_document(*y, cu, True, D ** -0.5)
        ref.backward(do.float())
        assert torch.isfinite(out).all()
        assert torch.equal(out, out_g)
        assert _rel(out, ref) < 1e-2
        for got, want, name in zip(x, y, ("dq", "dk", "dv")):
            assert torch.isfinite(got.grad).all(), name
            assert _rel(got.grad, want.grad) < 2e-2, (name, _rel(got.grad, want.grad))
    # both document sets: 5 documents, longest in the 2048 bucket, same T: one graph pair
    assert CG.GRAPH_BUILDS["count"] - builds <= 1


def test_cudnn_ragged_runs_on_the_callers_stream():
    """cuDNN executes on the torch stream current at the call (the handle is bound per execute):
    captured in a CUDA graph from a side stream after warm-up there, a replay with new inputs
    gives the eager call's outputs and gradients (were cuDNN still bound to the stream current
    when its graphs were built, nothing of it would be captured)."""
    from flamia.bench import cudnn_graphs as CG

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    lengths, Hq, Hkv, D = [700, 17, 1, 1330], 8, 2, 64
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                      device=dev)
    mk = lambda h: torch.randn(T, h, D, device=dev, generator=g).bfloat16()  # noqa: E731
    q, k, v, do = mk(Hq).requires_grad_(), mk(Hkv).requires_grad_(), mk(Hkv).requires_grad_(), mk(Hq)

    def step():
        out = CG.cudnn_ragged_varlen(q, k, v, cu, max(lengths))
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    step()                                    # graphs built on the default stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for x, h in zip((q, k, v, do), (Hq, Hkv, Hkv, Hq)):
            x.copy_(mk(h))
    graph.replay()
    eager = step()
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv"), captured, eager):
        assert torch.equal(a, b), name
