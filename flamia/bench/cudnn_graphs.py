"""cuDNN SDPA baselines through cudnn-frontend's Python graph API (`import cudnn`).

CudnnRaggedBF16: bf16, causal, packed documents in THD layout: each document is one batch element
  of a (b, h, s_max, d) tensor whose rows are found through ragged offsets (element offsets
  cu_seqlens * H * D, int64) and the padding mask (actual lengths, int32 (b, 1, 1, 1)). q, k, v, o,
  dO, dQ, dK, dV all live in the packed (T, H, D) buffers, untouched. Softmax stats are dense
  (b, Hq, s_max, 1) float32, or ragged (T, Hq) if cuDNN refuses dense stats with THD inputs.
  GQA is native (Hkv < Hq).
CudnnFp8Dense: FP8 e4m3 in and out, per-tensor scales (Transformer Engine's current scaling for
  Q, K, V, dO; O's scale from max|V| since |O| <= max|V|; dQ, dK, dV, dP scales from the amaxes of
  a first, calibration backward: the best case of delayed scaling), one document, BSHD, kv
  repeated to Hq heads. Quantization happens outside the timed region.

Graphs are built once per problem, outside the timed region. The keyword names of the graph API
moved across cudnn-frontend releases (is_inference -> generate_stats, use_causal_mask ->
diagonal_alignment + right bound), so each node is created by trying the known spellings in turn.
"""
from __future__ import annotations

import time

from .common import (
    E4M3_MAX, Bound, Inputs, Skip, cudnn_module, fp8_quantize_per_tensor, scale_from_amax,
    short_error, sum_groups, sync,
)
from .workloads import Problem

_HANDLE = None


def handle():
    """The process's cuDNN handle, bound to the current torch stream: called at every execute,
    so cuDNN runs where the caller's torch ops run (a side stream, a CUDA graph capture), not
    on whatever stream was current when a graph was built."""
    import torch

    global _HANDLE
    c = cudnn_module()
    if _HANDLE is None:
        _HANDLE = c.create_handle()
    if torch.cuda.is_available():
        c.set_stream(handle=_HANDLE, stream=torch.cuda.current_stream().cuda_stream)
    return _HANDLE


def versions() -> dict:
    try:
        c = cudnn_module()
    except Exception as e:
        return {"cudnn_frontend": None, "error": short_error(e, 200)}
    out = {"cudnn_frontend": getattr(c, "__version__", None)}
    for name in ("backend_version_string", "backend_version"):
        try:
            out[f"cudnn_{name}"] = str(getattr(c, name)())
        except Exception:
            pass
    return out


def _try_variants(fn, variants: list, what: str):
    """Call fn(**kw) for the first kw in variants that the binding accepts (pybind TypeError)."""
    errors = []
    for kw in variants:
        try:
            return fn(**kw)
        except TypeError as e:
            errors.append(short_error(e, 600))
    raise RuntimeError(f"{what}: none of {len(variants)} keyword spellings accepted; "
                       f"first error: {errors[0]}")


def _causal_variants(base: dict) -> list:
    """base + causal masking, in the spellings of successive cudnn-frontend versions."""
    c = cudnn_module()
    out = [dict(base, use_causal_mask=True)]
    da = getattr(c, "diagonal_alignment", None)
    if da is not None:
        out.append(dict(base, diagonal_alignment=da.TOP_LEFT, right_bound=0))
        out.append(dict(base, diagonal_alignment=da.TOP_LEFT, diagonal_band_right_bound=0))
    return out


def _stats_variants(variants: list) -> list:
    return [dict(kw, generate_stats=True) for kw in variants] + \
           [dict(kw, is_inference=False) for kw in variants]


def _finalize(graph, what: str):
    c = cudnn_module()
    not_supported = getattr(c, "cudnnGraphNotSupportedError", ())
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([c.heur_mode.A, c.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception as e:
        if not_supported and isinstance(e, not_supported):
            raise Skip(f"cuDNN does not support this {what} graph: {short_error(e, 250)}") from e
        raise


def _scalar(g, name):
    c = cudnn_module()
    return g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=c.data_type.FLOAT)


def _out(t, dim, stride, dtype=None):
    t.set_output(True)
    t.set_dim(list(dim))
    t.set_stride(list(stride))
    if dtype is not None:
        t.set_data_type(dtype)
    return t


# ---------------------------------------------------------------------------------------------


_GRAPHS: dict = {}
GRAPH_BUILDS = {"count": 0, "seconds": 0.0}   # ragged graph pairs built in this process so far


def _cached(kind: str, shapes, device, build):
    """cuDNN graphs depend only on the shapes: build once per (kind, shapes, device)."""
    key = (kind, shapes, str(device))
    if key not in _GRAPHS:
        _GRAPHS[key] = build()
    return _GRAPHS[key]


class RaggedOffsets:
    """The runtime tensors of a ragged call, made on the device from cu_seqlens (no host sync):
    actual lengths (b, 1, 1, 1) int32 and element offsets (b + 1, 1, 1, 1) int64 of the q-like
    (T, Hq, D), kv-like (T, Hkv, D) and ragged-stats (T, Hq) buffers."""

    def __init__(self, cu_seqlens, Hq: int, Hkv: int, D: int):
        import torch

        cu = cu_seqlens.to(torch.int64)
        b = cu.numel() - 1
        self.seqlen = (cu[1:] - cu[:-1]).to(torch.int32).view(b, 1, 1, 1)
        self.q = (cu * (Hq * D)).view(b + 1, 1, 1, 1)
        self.kv = (cu * (Hkv * D)).view(b + 1, 1, 1, 1)
        self.stats = (cu * Hq).view(b + 1, 1, 1, 1)


class _RaggedGraphs:
    """Forward and backward graphs of bf16 causal ragged SDPA for b documents of at most s
    tokens, T tokens in all. The graphs depend only on these shapes; the document lengths and
    offsets are runtime tensors (RaggedOffsets), so one pair serves every batch of the shape."""

    def __init__(self, b: int, s: int, T: int, Hq: int, Hkv: int, D: int, scale: float,
                 ragged_stats: bool = False):
        c = cudnn_module()
        h = handle()
        self.Hq, self.Hkv, self.D = Hq, Hkv, D
        BF16, FLOAT, I32, I64 = (c.data_type.BFLOAT16, c.data_type.FLOAT, c.data_type.INT32,
                                 c.data_type.INT64)
        qdim, qstr = [b, Hq, s, D], [s * Hq * D, D, Hq * D, 1]
        kdim, kstr = [b, Hkv, s, D], [s * Hkv * D, D, Hkv * D, 1]
        # softmax stats: dense (b, Hq, s_max, 1), or ragged "TH1" (T, Hq) with offsets cu * Hq
        self.sdim = [b, Hq, s, 1]
        sstr = [s * Hq, 1, Hq, 1] if ragged_stats else [Hq * s, s, 1, 1]
        self.stats_shape = (T, Hq) if ragged_stats else tuple(self.sdim)
        self.ragged_stats = ragged_stats
        max_t = ((T + 63) // 64) * 64

        def graph():
            return c.pygraph(io_data_type=BF16, intermediate_data_type=FLOAT,
                             compute_data_type=FLOAT, handle=h)

        def common(g, names_dims):
            t = {n: g.tensor(name=n, dim=d, stride=st, data_type=dt) for n, d, st, dt in names_dims}
            t["seq_q"] = g.tensor(name="seq_q", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
            t["seq_kv"] = g.tensor(name="seq_kv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
            return t

        def offset(g, name):
            return g.tensor(name=name, dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I64)

        # forward
        gf = graph()
        f = common(gf, [("q", qdim, qstr, BF16), ("k", kdim, kstr, BF16), ("v", kdim, kstr, BF16)])
        for n in ("q", "k", "v", "o"):
            f[n + "_off"] = offset(gf, n + "_off")
        for n in ("q", "k", "v"):
            f[n].set_ragged_offset(f[n + "_off"])
        base = dict(name="sdpa", q=f["q"], k=f["k"], v=f["v"], attn_scale=scale,
                    use_padding_mask=True, seq_len_q=f["seq_q"], seq_len_kv=f["seq_kv"])
        o, stats = _try_variants(gf.sdpa, _stats_variants(_causal_variants(base)), "pygraph.sdpa")
        _out(o, qdim, qstr, BF16)
        o.set_ragged_offset(f["o_off"])
        _out(stats, self.sdim, sstr, FLOAT)
        if ragged_stats:
            f["stats_off"] = offset(gf, "stats_off")
            stats.set_ragged_offset(f["stats_off"])
        f["o"], f["stats"] = o, stats
        _finalize(gf, "bf16 ragged forward")

        # backward
        gb = graph()
        bt = common(gb, [("q", qdim, qstr, BF16), ("k", kdim, kstr, BF16), ("v", kdim, kstr, BF16),
                         ("o", qdim, qstr, BF16), ("dO", qdim, qstr, BF16),
                         ("stats", self.sdim, sstr, FLOAT)])
        for n in ("q", "k", "v", "o", "dO") + (("stats",) if ragged_stats else ()):
            bt[n + "_off"] = offset(gb, n + "_off")
            bt[n].set_ragged_offset(bt[n + "_off"])
        base = dict(name="sdpa_backward", q=bt["q"], k=bt["k"], v=bt["v"], o=bt["o"], dO=bt["dO"],
                    stats=bt["stats"], attn_scale=scale, use_padding_mask=True,
                    seq_len_q=bt["seq_q"], seq_len_kv=bt["seq_kv"])
        variants = _causal_variants(base)
        variants = [dict(kw, max_total_seq_len_q=max_t, max_total_seq_len_kv=max_t)
                    for kw in variants] + variants
        dQ, dK, dV = _try_variants(gb.sdpa_backward, variants, "pygraph.sdpa_backward")
        for t, dim, st, off in ((dQ, qdim, qstr, "q_off"), (dK, kdim, kstr, "k_off"),
                                (dV, kdim, kstr, "v_off")):
            _out(t, dim, st, BF16)
            t.set_ragged_offset(bt[off])
        bt["dQ"], bt["dK"], bt["dV"] = dQ, dK, dV
        _finalize(gb, "bf16 ragged backward")

        self.gf, self.gb, self.f, self.bt = gf, gb, f, bt
        self.ws = max(int(gf.get_workspace_size()), int(gb.get_workspace_size()), 1)

    def offsets(self, cu_seqlens) -> RaggedOffsets:
        return RaggedOffsets(cu_seqlens, self.Hq, self.Hkv, self.D)

    def forward(self, q, k, v, off: RaggedOffsets):
        """(o, softmax stats, workspace) of packed q (T, Hq, D), k, v (T, Hkv, D)."""
        import torch

        f = self.f
        o = torch.empty_like(q)
        stats = torch.empty(self.stats_shape, dtype=torch.float32, device=q.device)
        ws = torch.empty(self.ws, dtype=torch.uint8, device=q.device)
        pack = {f["q"]: q, f["k"]: k, f["v"]: v, f["o"]: o, f["stats"]: stats,
                f["seq_q"]: off.seqlen, f["seq_kv"]: off.seqlen,
                f["q_off"]: off.q, f["k_off"]: off.kv, f["v_off"]: off.kv, f["o_off"]: off.q}
        if "stats_off" in f:
            pack[f["stats_off"]] = off.stats
        self.gf.execute(pack, ws, handle=handle())
        return o, stats, ws

    def backward(self, q, k, v, o, do, stats, off: RaggedOffsets, ws=None):
        """(dq, dk, dv) for the forward's o and stats and the output gradient do (T, Hq, D)."""
        import torch

        bt = self.bt
        if ws is None:
            ws = torch.empty(self.ws, dtype=torch.uint8, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        pack = {bt["q"]: q, bt["k"]: k, bt["v"]: v, bt["o"]: o, bt["dO"]: do,
                bt["stats"]: stats, bt["dQ"]: dq, bt["dK"]: dk, bt["dV"]: dv,
                bt["seq_q"]: off.seqlen, bt["seq_kv"]: off.seqlen,
                bt["q_off"]: off.q, bt["k_off"]: off.kv, bt["v_off"]: off.kv,
                bt["o_off"]: off.q, bt["dO_off"]: off.q}
        if "stats_off" in bt:
            pack[bt["stats_off"]] = off.stats
        self.gb.execute(pack, ws, handle=handle())
        return dq, dk, dv


def ragged_graphs(b: int, s: int, T: int, Hq: int, Hkv: int, D: int, scale: float, device):
    """The cached graph pair for these shapes: dense softmax stats first (the long-standing
    layout), ragged (T, Hq) stats if cuDNN refuses them."""
    def build():
        t0 = time.perf_counter()
        try:
            g = _RaggedGraphs(b, s, T, Hq, Hkv, D, scale, ragged_stats=False)
        except Exception as first:
            try:
                g = _RaggedGraphs(b, s, T, Hq, Hkv, D, scale, ragged_stats=True)
            except Exception as second:
                raise RuntimeError(f"cuDNN ragged graphs: with dense stats: {short_error(first, 250)}; "
                                   f"with ragged stats: {short_error(second, 250)}") from second
        GRAPH_BUILDS["count"] += 1
        GRAPH_BUILDS["seconds"] += time.perf_counter() - t0
        return g
    return _cached("ragged", (b, s, T, Hq, Hkv, D, float(scale)), device, build)


class CudnnRaggedBF16(Bound):
    def __init__(self, problem: Problem, inputs: Inputs, n_copies: int = 1):
        self.g = ragged_graphs(problem.n_docs, problem.max_len, problem.T, problem.heads_q,
                               problem.heads_kv, problem.head_dim, problem.scale, inputs.q.device)
        self.off = self.g.offsets(inputs.cu_seqlens)
        self.notes = ["THD ragged offsets, padding mask, native GQA"] + (
            ["ragged softmax stats"] if self.g.ragged_stats else [])
        if n_copies == 1:
            self.copies = [(inputs.q, inputs.k, inputs.v, inputs.dout)]
        else:
            self.copies = [tuple(t.clone() for t in (inputs.q, inputs.k, inputs.v, inputs.dout))
                           for _ in range(n_copies)]
        self.n_copies = n_copies

    def _fwdbwd(self, i):
        q, k, v, do = self.copies[i]
        o, stats, ws = self.g.forward(q, k, v, self.off)
        return (o,) + self.g.backward(q, k, v, o, do, stats, self.off, ws)

    def fwd(self, i):
        q, k, v, _ = self.copies[i]
        self.g.forward(q, k, v, self.off)

    def fwdbwd(self, i):
        self._fwdbwd(i)

    def outputs(self):
        return self._fwdbwd(0)

    def close(self):
        self.copies = None


# ---------------------------------------------------------------------------------------------


class _Fp8Graphs:
    """Forward and backward graphs of FP8 SDPA (dense BSHD, one document, Hkv = Hq)."""

    FWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s",
                   "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")

    def __init__(self, problem: Problem):
        c = cudnn_module()
        h = handle()
        L, Hq, D = problem.T, problem.heads_q, problem.head_dim
        FP8, FLOAT = c.data_type.FP8_E4M3, c.data_type.FLOAT
        qdim, qstr = [1, Hq, L, D], [L * Hq * D, D, Hq * D, 1]
        self.sdim, sstr = [1, Hq, L, 1], [Hq * L, L, 1, 1]

        def graph():
            return c.pygraph(io_data_type=FP8, intermediate_data_type=FLOAT,
                             compute_data_type=FLOAT, handle=h)

        # forward graph (amax_s declared as an output where the engine produces it)
        def build_fwd(with_amax_s: bool):
            g = graph()
            t = {n: g.tensor(name=n, dim=qdim, stride=qstr, data_type=FP8) for n in ("q", "k", "v")}
            for n in self.FWD_SCALARS:
                t[n] = _scalar(g, n)
            base = dict(name="sdpa_fp8", q=t["q"], k=t["k"], v=t["v"], attn_scale=problem.scale,
                        **{n: t[n] for n in self.FWD_SCALARS})
            o, stats, amax_s, amax_o = _try_variants(
                g.sdpa_fp8, _stats_variants(_causal_variants(base)), "pygraph.sdpa_fp8")
            _out(o, qdim, qstr, FP8)
            _out(stats, self.sdim, sstr, FLOAT)
            t["o"], t["stats"] = o, stats
            t["amax_o"] = _out(amax_o, [1, 1, 1, 1], [1, 1, 1, 1], FLOAT)
            if with_amax_s and amax_s is not None:
                t["amax_s"] = _out(amax_s, [1, 1, 1, 1], [1, 1, 1, 1], FLOAT)
            _finalize(g, "FP8 forward")
            return g, t

        try:
            self.gf, self.f = build_fwd(True)
        except Skip:
            raise
        except Exception as e:
            first = short_error(e, 200)
            try:
                self.gf, self.f = build_fwd(False)
            except Exception:
                raise RuntimeError(f"FP8 forward graph: {first}") from e

        gb = graph()
        bt = {n: gb.tensor(name=n, dim=qdim, stride=qstr, data_type=FP8)
              for n in ("q", "k", "v", "o", "dO")}
        bt["stats"] = gb.tensor(name="stats", dim=self.sdim, stride=sstr, data_type=FLOAT)
        for n in self.BWD_SCALARS:
            bt[n] = _scalar(gb, n)
        base = dict(name="sdpa_fp8_backward", q=bt["q"], k=bt["k"], v=bt["v"], o=bt["o"],
                    dO=bt["dO"], stats=bt["stats"], attn_scale=problem.scale,
                    **{n: bt[n] for n in self.BWD_SCALARS})
        outs = _try_variants(gb.sdpa_fp8_backward, _causal_variants(base), "pygraph.sdpa_fp8_backward")
        dQ, dK, dV, amax_dQ, amax_dK, amax_dV, amax_dP = outs
        for n, t in (("dQ", dQ), ("dK", dK), ("dV", dV)):
            bt[n] = _out(t, qdim, qstr, FP8)
        for n, t in (("amax_dQ", amax_dQ), ("amax_dK", amax_dK), ("amax_dV", amax_dV),
                     ("amax_dP", amax_dP)):
            bt[n] = _out(t, [1, 1, 1, 1], [1, 1, 1, 1], FLOAT)
        _finalize(gb, "FP8 backward")
        self.gb, self.bt = gb, bt
        self.ws = max(int(self.gf.get_workspace_size()), int(gb.get_workspace_size()), 1)


class CudnnFp8Dense(Bound):
    FWD_SCALARS = _Fp8Graphs.FWD_SCALARS
    BWD_SCALARS = _Fp8Graphs.BWD_SCALARS

    def __init__(self, problem: Problem, inputs: Inputs, n_copies: int = 1):
        import torch

        if problem.n_docs != 1:
            raise Skip(f"cuDNN FP8 takes one document only (workload has {problem.n_docs})")
        Hq, Hkv, G = problem.heads_q, problem.heads_kv, problem.group
        self.Hkv = Hkv
        self.notes = ["per-tensor current scaling of Q, K, V, dO; dQ/dK/dV/dP scales from a "
                      "calibration backward"]
        if G > 1:
            self.notes.append(f"kv repeated to Hkv=Hq={Hq} heads outside the timed region")
        dev = inputs.q.device

        # quantize (outside the timed region)
        def quantized(q, k, v, do):
            kr = k.repeat_interleave(G, dim=1) if G > 1 else k
            vr = v.repeat_interleave(G, dim=1) if G > 1 else v
            q8, dsq = fp8_quantize_per_tensor(q)
            k8, dsk = fp8_quantize_per_tensor(kr)
            v8, dsv = fp8_quantize_per_tensor(vr)
            do8, dsdo = fp8_quantize_per_tensor(do)
            return (q8.contiguous(), k8.contiguous(), v8.contiguous(), do8.contiguous()), \
                (dsq, dsk, dsv, dsdo, v.detach().abs().amax())

        base8, (dsq, dsk, dsv, dsdo, vmax) = quantized(inputs.q, inputs.k, inputs.v, inputs.dout)
        self.copies = [base8] + [tuple(t.clone() for t in base8) for _ in range(n_copies - 1)]
        self.n_copies = n_copies
        one = lambda: torch.ones(1, 1, 1, 1, dtype=torch.float32, device=dev)  # noqa: E731
        scale_o = scale_from_amax(vmax)
        self.sc = {
            "descale_q": dsq, "descale_k": dsk, "descale_v": dsv, "descale_dO": dsdo,
            "scale_s": one() * E4M3_MAX, "descale_s": one() / E4M3_MAX,
            "scale_o": scale_o, "descale_o": (1.0 / scale_o).contiguous(),
            # calibration values, replaced after the first backward:
            "scale_dQ": one(), "scale_dK": one(), "scale_dV": one(), "scale_dP": one(),
            "descale_dP": one(),
        }

        g = _cached("fp8", problem, dev, lambda: _Fp8Graphs(problem))
        self.gf, self.f, self.gb, self.bt, self.ws = g.gf, g.f, g.gb, g.bt, g.ws
        self.sdim = g.sdim

        # calibration backward: amaxes of dQ, dK, dV, dP -> their scales (best-case delayed scaling)
        _, _, _, _, amax = self._fwdbwd(0)
        sync()
        for n in ("dQ", "dK", "dV", "dP"):
            self.sc["scale_" + n] = scale_from_amax(amax[n])
        self.sc["descale_dP"] = (1.0 / self.sc["scale_dP"]).contiguous()

    def _fwd(self, i):
        import torch

        q8, k8, v8, _ = self.copies[i]
        f, dev = self.f, q8.device
        o8 = torch.empty_like(q8)
        stats = torch.empty(self.sdim, dtype=torch.float32, device=dev)
        ws = torch.empty(self.ws, dtype=torch.uint8, device=dev)
        pack = {f["q"]: q8, f["k"]: k8, f["v"]: v8, f["o"]: o8, f["stats"]: stats,
                f["amax_o"]: torch.empty(1, 1, 1, 1, dtype=torch.float32, device=dev)}
        if "amax_s" in f:
            pack[f["amax_s"]] = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=dev)
        for n in self.FWD_SCALARS:
            pack[f[n]] = self.sc[n]
        self.gf.execute(pack, ws, handle=handle())
        return o8, stats, ws

    def _fwdbwd(self, i):
        import torch

        q8, k8, v8, do8 = self.copies[i]
        o8, stats, ws = self._fwd(i)
        bt, dev = self.bt, q8.device
        dq8, dk8, dv8 = torch.empty_like(q8), torch.empty_like(k8), torch.empty_like(v8)
        amax = {n: torch.empty(1, 1, 1, 1, dtype=torch.float32, device=dev)
                for n in ("dQ", "dK", "dV", "dP")}
        pack = {bt["q"]: q8, bt["k"]: k8, bt["v"]: v8, bt["o"]: o8, bt["dO"]: do8,
                bt["stats"]: stats, bt["dQ"]: dq8, bt["dK"]: dk8, bt["dV"]: dv8}
        for n in amax:
            pack[bt["amax_" + n]] = amax[n]
        for n in self.BWD_SCALARS:
            pack[bt[n]] = self.sc[n]
        self.gb.execute(pack, ws, handle=handle())
        return o8, dq8, dk8, dv8, amax

    def fwd(self, i):
        self._fwd(i)

    def fwdbwd(self, i):
        self._fwdbwd(i)

    def outputs(self):
        o8, dq8, dk8, dv8, _ = self._fwdbwd(0)
        sc = self.sc
        o = o8.float() * sc["descale_o"].reshape(())
        dq = dq8.float() / sc["scale_dQ"].reshape(())
        dk = sum_groups(dk8.float() / sc["scale_dK"].reshape(()), self.Hkv)
        dv = sum_groups(dv8.float() / sc["scale_dV"].reshape(()), self.Hkv)
        return o, dq, dk, dv

    def close(self):
        self.copies = None


# ---------------------------------------------------------------------------------------------
# cuDNN ragged bf16 attention as a differentiable function: a training baseline
# (`flamia train-check` run "cudnn"), the same graphs as the benchmark's "cudnn" row.
# ---------------------------------------------------------------------------------------------

_FUNCTION = None


def _seq_bucket(max_seqlen: int) -> int:
    """The graph's per-document length s: the next power of two (>= 64), so that batches with
    different longest documents share graphs (the lengths themselves are runtime tensors)."""
    s = 64
    while s < max_seqlen:
        s *= 2
    return s


def _ragged_function():
    global _FUNCTION
    if _FUNCTION is not None:
        return _FUNCTION
    import torch

    class CudnnRaggedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale):
            g = ragged_graphs(cu_seqlens.numel() - 1, _seq_bucket(max_seqlen), q.shape[0],
                              q.shape[1], k.shape[1], q.shape[2], scale, q.device)
            off = g.offsets(cu_seqlens)
            o, stats, _ = g.forward(q, k, v, off)
            ctx.save_for_backward(q, k, v, o, stats)
            ctx.graphs, ctx.off = g, off
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, stats = ctx.saved_tensors
            dq, dk, dv = ctx.graphs.backward(q, k, v, o, do.contiguous(), stats, ctx.off)
            return dq, dk, dv, None, None, None

    _FUNCTION = CudnnRaggedAttention
    return _FUNCTION


def cudnn_ragged_varlen(q, k, v, cu_seqlens, max_seqlen: int, causal: bool = True,
                        softmax_scale: float | None = None):
    """Causal bf16 attention over packed documents by cuDNN (ragged THD graphs), differentiable:
    q (T, Hq, D), k / v (T, Hkv, D) bf16 on CUDA, int32 cu_seqlens. Returns (T, Hq, D).

    One graph pair per (number of documents, power-of-two bucket of the longest one, T, heads,
    D, scale), built on first use and cached; GRAPH_BUILDS counts them and their build time."""
    import torch

    if not causal:
        raise NotImplementedError("cudnn_ragged_varlen: causal attention only")
    if not q.is_cuda:
        raise ValueError("cudnn_ragged_varlen: q, k, v must be CUDA tensors (cuDNN)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"cudnn_ragged_varlen: {name} must be bfloat16, got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(f"cudnn_ragged_varlen: {name} must be (T, H, D), got {tuple(t.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"cudnn_ragged_varlen: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} are not packed self-attention with GQA")
    scale = q.shape[2] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _ragged_function().apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                    cu_seqlens.to(device=q.device, dtype=torch.int32),
                                    int(max_seqlen), scale)
