"""One attention call (forward + backward) issued eagerly vs replayed from a CUDA graph, on the H200.

    python benchmarks/graph_timing.py                                   # the train-check shape
    python benchmarks/graph_timing.py --docs 512x64 --heads 32/8 --head-dim 128 --recipes fp8
    python benchmarks/graph_timing.py --workloads all --recipes cudnn,fp8,bf16
    python benchmarks/graph_timing.py --workloads all --recipes fa4,cudnn,fp8  # x: against FA4

Calls are queued back to back (N per round, interleaved rounds, median), as the layers of a
training step queue theirs: when the host issues a call more slowly than the GPU runs it, the
eager rate is the host's, and the graph's is the GPU's. The gap between the two columns is what
a fixed-shape training loop can win by capturing its step (tests/gpu/test_cuda_graphs_gpu.py:
replays are bitwise the eager calls). --compiled adds the call under torch.compile (inductor,
fullgraph: flamia's custom ops, flamia.custom_ops), forward compiled and backward through the
compiled graph's autograd: the host cost of the custom-op path (--compile-mode reduce-overhead:
torch.compile's own CUDA graphs). --workloads NAMES (or all) times shared/workloads.json's
workloads one after another and ends with a table of replayed ms and each spec's speed against
the first spec's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import flamia  # noqa: E402
from flamia.bench.workloads import load_workloads, parse_docs, parse_heads, select  # noqa: E402
from flamia.inputs import cu_seqlens_from_lengths  # noqa: E402


def queued_ms(fn, reps):
    """Milliseconds per call of `reps` calls queued back to back between two CUDA events."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


BASELINES = ("cudnn", "fa4")   # specs that are bf16 baselines, not flamia recipes


def make_step(spec, lengths, hq, hkv, D, forward_only=False, compiled=None):
    """The call of `spec`: a flamia recipe, cudnn or fa4, optionally with @NAME=VALUE (environment
    variables set around every call, e.g. fp8@FLAMIA_CHECK_FINITE=0; several: fp8@A=1@B=0).
    compiled: a torch.compile mode: the flamia call under torch.compile(fullgraph=True)."""
    recipe, _, env = spec.partition("@")
    T = sum(lengths)
    mk = lambda h: torch.randn(T, h, D, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, dout = mk(hq).requires_grad_(), mk(hkv).requires_grad_(), mk(hkv).requires_grad_(), mk(hq)
    cu = cu_seqlens_from_lengths(lengths, device="cuda")
    L = max(lengths)

    def attend(q, k, v):
        return flamia.flamia_attn_varlen_func(q, k, v, cu, cu, L, L, recipe=recipe,
                                              check_finite=False)
    if compiled and recipe not in BASELINES:
        # one eager call first: the kernels' caches (the metadata memoized on cu) are then built
        # outside the memory pool of reduce-overhead's CUDA graphs, whose warm-up would own them
        torch.autograd.grad(attend(q, k, v), (q, k, v), dout)
        attend = torch.compile(attend, fullgraph=True, mode=compiled)

    def call():
        if recipe == "cudnn":      # cuDNN ragged bf16
            from flamia.bench.cudnn_graphs import cudnn_ragged_varlen
            out = cudnn_ragged_varlen(q, k, v, cu, L)
        elif recipe == "fa4":      # FlashAttention-4 bf16 (sm90 CuTe DSL), packed, GQA native
            from flamia.bench.baselines import fa4_varlen
            out = fa4_varlen(q, k, v, cu, L)
        else:
            out = attend(q, k, v)
        return out if forward_only else torch.autograd.grad(out, (q, k, v), dout)

    settings = [item.partition("=")[::2] for item in env.split("@")] if env else []

    def step():
        if not settings:
            return call()
        old = {name: os.environ.get(name) for name, _ in settings}
        os.environ.update(dict(settings))
        try:
            return call()
        finally:
            for name, value in old.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
    return step


def time_workload(args, specs, lengths, hq, hkv, D):
    """{(spec, column): median ms per call} for one shape; prints its table. The calls per round
    are capped so that a round of one column takes about --round-ms (long documents: few calls)."""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; docs T={sum(lengths)} "
          f"({len(lengths)} documents, longest {max(lengths)}), heads {hq}/{hkv}, D={D}; "
          f"{args.rounds} rounds, queued back to back", flush=True)
    fns = {}
    for recipe in specs:
        if args.compiled and recipe.partition("@")[0] not in BASELINES:
            cstep = make_step(recipe, lengths, hq, hkv, D, args.forward_only, args.compile_mode)
            try:
                for _ in range(3):
                    cstep()
                fns[(recipe, "compiled")] = cstep
            except Exception as e:  # noqa: BLE001  (report and go on with the other columns)
                print(f"{recipe}: compiled ({args.compile_mode}) failed: {type(e).__name__}: "
                      f"{str(e)[:300]}")
                torch.cuda.synchronize()
        step = make_step(recipe, lengths, hq, hkv, D, args.forward_only)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        fns[(recipe, "eager")] = step
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            fns[(recipe, "graph")] = graph.replay
        except Exception as e:  # noqa: BLE001  (an attention that cannot be captured)
            print(f"{recipe}: capture failed: {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.synchronize()
    one = queued_ms(next(iter(fns.values())), 1)
    calls = max(2, min(args.calls, int(args.round_ms / max(one, 1e-3))))
    times = {key: [] for key in fns}
    for _ in range(args.rounds):
        for key, fn in fns.items():
            times[key].append(queued_ms(fn, calls))
    med = {key: statistics.median(t) for key, t in times.items()}
    print(f"{calls} calls per round")
    print(f"{'recipe':32s} {'eager ms/call':>14s} {'graph ms/call':>14s} {'eager/graph':>12s}"
          + (f" {'compiled ms/call':>17s}" if args.compiled else ""))
    for recipe in specs:
        e = med[(recipe, "eager")]
        c = med.get((recipe, "compiled"))
        tail = (f" {c:17.3f}" if c else f" {'-':>17s}") if args.compiled else ""
        if (recipe, "graph") not in med:
            print(f"{recipe:32s} {e:14.3f} {'-':>14s} {'-':>12s}" + tail)
            continue
        g = med[(recipe, "graph")]
        print(f"{recipe:32s} {e:14.3f} {g:14.3f} {e / g:12.2f}x" + tail, flush=True)
    del fns
    torch.cuda.empty_cache()
    return med


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", default="2048x14,1024x4")
    ap.add_argument("--heads", default="8/2")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--workloads", default=None,
                    help="suite workloads by name (comma-separated) or 'all', instead of --docs")
    ap.add_argument("--recipes", default="fp8,bf16,cudnn",
                    help="flamia recipes and/or cudnn (cuDNN ragged bf16; needs cudnn-frontend) "
                         "and fa4 (FlashAttention-4 bf16; needs flash-attn-4 and an sm90 GPU)")
    ap.add_argument("--forward-only", action="store_true", help="the forward alone")
    ap.add_argument("--compiled", action="store_true",
                    help="also each flamia recipe under torch.compile")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode of --compiled (reduce-overhead: CUDA graphs)")
    ap.add_argument("--calls", type=int, default=40, help="calls per round, at most")
    ap.add_argument("--round-ms", type=float, default=250.0,
                    help="fewer calls per round when one call is long (at least 2)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    specs = args.recipes.split(",")
    if any(s.partition("@")[0] == "fa4" for s in specs):
        from flamia.bench.baselines import fa4_env_skip
        why = fa4_env_skip()
        if why:      # the other specs still run
            print(f"fa4: skipped: {why}")
            specs = [s for s in specs if s.partition("@")[0] != "fa4"]
    if args.workloads:
        suite = load_workloads()[0]
        shapes = [(w.name, list(w.doc_lengths), w.heads_q, w.heads_kv, w.head_dim)
                  for w in select(suite, None if args.workloads == "all" else args.workloads)]
    else:
        hq, hkv = parse_heads(args.heads)
        shapes = [(args.docs, list(parse_docs(args.docs)), hq, hkv, args.head_dim)]
    results = {}
    for name, lengths, hq, hkv, D in shapes:
        print(f"== {name}")
        results[name] = time_workload(args, specs, lengths, hq, hkv, D)
    if len(shapes) > 1:
        base = specs[0]
        print(f"\nreplayed (GPU) ms per call; x: {base}'s time / the spec's; columns: "
              + ", ".join(specs))
        print(f"{'workload':14s}" + "".join(f" {s[:30]:>30s}" for s in specs))
        ratios = {s: [] for s in specs}
        for name, med in results.items():
            b = med.get((base, "graph"))
            cells = []
            for s in specs:
                g = med.get((s, "graph"))
                if g is None or b is None:
                    cells.append(f" {'-':>30s}")
                    continue
                ratios[s].append(b / g)
                cells.append(f" {g:20.3f} ({b / g:5.2f}x)")
            print(f"{name:14s}" + "".join(cells))
        print(f"{'geomean':14s}" + "".join(
            f" {'':20s} ({statistics.geometric_mean(r):5.2f}x)" if r else f" {'-':>30s}"
            for r in ratios.values()))


if __name__ == "__main__":
    main()
