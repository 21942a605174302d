"""Implementations the benchmark measures: flamia (one per recipe) and the baselines.

Each implementation is an `Impl`. `Impl.build(problem, inputs, n_copies)` prepares everything that
is not timed (layouts, leaf tensors, cuDNN graphs, block masks, FP8 quantization for the cuDNN FP8
baseline) and returns a `Bound` with
  fwd(i)      one forward on input copy i (training forward: inputs require grad),
  fwdbwd(i)   forward then backward (out.backward(dout)), grads cleared afterwards,
  outputs()   (o, dq, dk, dv) of one forward+backward in the packed (T, H, D) layout, for accuracy.
`build` raises `Skip` when the implementation cannot run this problem; any other exception is
recorded by the runner as an error for that row, never fatal.

kind: "flamia" (our rows), "bf16" (the bf16 baselines, FlashAttention-4 among them: the speedup
reference is the fastest of them), "fp8" (cuDNN FP8: reported, never a speedup reference).
"""
from __future__ import annotations

import inspect
import warnings
from typing import Callable, Sequence

from .common import (E4M3_MAX, Bound, Inputs, Skip, cudnn_module, fp8_quantize_per_tensor,  # noqa: F401
                     scale_from_amax, short_error, sum_groups, sync)
from .workloads import Problem

BASELINE_KEYS = ("sdpa_cudnn", "sdpa_flash", "cudnn", "fa4", "varlen", "flex", "cudnn_fp8")
BASELINE_HELP = {
    "sdpa_cudnn": "torch SDPA, cuDNN backend (one document, dense)",
    "sdpa_flash": "torch SDPA, flash backend (one document, dense)",
    "cudnn": "cuDNN bf16 SDPA on packed documents (cudnn-frontend, ragged THD)",
    "fa4": "FlashAttention-4 (flash-attn-4, flash_attn.cute.flash_attn_varlen_func), its sm90 "
           "bf16 CuTe DSL kernels on packed documents",
    "varlen": "torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen)",
    "flex": "torch.compile'd flex_attention with a document-causal block mask",
    "cudnn_fp8": "cuDNN FP8 SDPA, per-tensor scales (one document; its quantization not timed)",
}
def make_inputs(problem: Problem, seed: int = 0, device="cuda", q=None, k=None, v=None,
                dout=None) -> Inputs:
    """Standard-normal bf16 inputs drawn on the device (fast at benchmark sizes), or given ones."""
    import torch
    from flamia.inputs import cu_seqlens_from_lengths

    gen = torch.Generator(device=device).manual_seed(seed)
    T, Hq, Hkv, D = problem.T, problem.heads_q, problem.heads_kv, problem.head_dim

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)

    q = rnd(T, Hq, D) if q is None else q
    k = rnd(T, Hkv, D) if k is None else k
    v = rnd(T, Hkv, D) if v is None else v
    dout = rnd(T, Hq, D) if dout is None else dout
    return Inputs(q, k, v, dout, cu_seqlens_from_lengths(problem.doc_lengths, device=device))


class AutogradBound(Bound):
    """An autograd-differentiable call on fresh leaf tensors (the user's call)."""

    def __init__(self, call: Callable, leaves: list, douts: list, to_packed: Callable,
                 notes: Sequence[str] = ()):
        self.call, self.leaves, self.douts, self.to_packed = call, leaves, douts, to_packed
        self.notes = list(notes)
        self.n_copies = len(leaves)

    def _out(self, q, k, v):
        out = self.call(q, k, v)
        return out[0] if isinstance(out, (tuple, list)) else out

    def fwd(self, i: int):
        q, k, v = self.leaves[i]
        self._out(q, k, v)

    def fwdbwd(self, i: int):
        q, k, v = self.leaves[i]
        out = self._out(q, k, v)
        out.backward(self.douts[i])
        q.grad = k.grad = v.grad = None

    def outputs(self):
        q, k, v = self.leaves[0]
        out = self._out(q, k, v)
        out.backward(self.douts[0])
        res = self.to_packed(out.detach(), q.grad, k.grad, v.grad)
        q.grad = k.grad = v.grad = None
        return res

    def close(self):
        self.leaves = self.douts = None


def make_leaves(inputs: Inputs, n_copies: int, tq: Callable, tkv: Callable, tdo: Callable):
    """n_copies of (q, k, v) leaves requiring grad, in the layout tq/tkv produce (then made
    contiguous), and matching douts (tdo's layout, kept as the view tdo returns)."""
    import torch

    leaves, douts = [], []
    for _ in range(n_copies):
        q = tq(inputs.q).clone(memory_format=torch.contiguous_format).requires_grad_(True)
        k = tkv(inputs.k).clone(memory_format=torch.contiguous_format).requires_grad_(True)
        v = tkv(inputs.v).clone(memory_format=torch.contiguous_format).requires_grad_(True)
        leaves.append((q, k, v))
        douts.append(tdo(inputs.dout))
    return leaves, douts


# ---------------------------------------------------------------------------------------------
# Impl base


class Impl:
    key: str = ""
    label: str = ""
    kind: str = "bf16"      # "flamia" | "bf16" | "fp8"
    recipe: str = "bf16"
    static_notes: tuple = ()

    def env_skip(self) -> str | None:
        """Why this implementation cannot run in this environment at all (None if it can)."""
        return None

    def static_skip(self, problem: Problem) -> str | None:
        """Why it cannot run this problem, knowable from the shape alone (None if it may)."""
        return None

    def build(self, problem: Problem, inputs: Inputs, n_copies: int = 1) -> Bound:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"key": self.key, "label": self.label, "kind": self.kind, "recipe": self.recipe}


def _one_doc_only(problem: Problem, what: str = "") -> str | None:
    if problem.n_docs != 1:
        return f"one document only (workload has {problem.n_docs})"
    return None


# ---------------------------------------------------------------------------------------------
# flamia


def flamia_api():
    import flamia
    fn = getattr(flamia, "flamia_attn_varlen_func", None)
    if fn is None:
        from flamia.interface import flamia_attn_varlen_func as fn  # noqa: N813
    return fn


class FlamiaImpl(Impl):
    kind = "flamia"

    def __init__(self, recipe: str):
        self.recipe = recipe
        self.key = f"flamia:{recipe}"
        self.label = f"flamia {recipe}"
        self.static_notes = ("bf16 in/out, everything included",)

    def env_skip(self):
        try:
            flamia_api()
        except Exception as e:
            return f"flamia.flamia_attn_varlen_func not importable: {short_error(e)}"
        return None

    def _check_kernels(self, q):
        """Refuse to time the reference emulation (what the API falls back to without kernels):
        at benchmark sizes it would be hopelessly slow or run out of memory."""
        try:
            from flamia import interface
        except Exception:
            return
        backend = getattr(interface, "backend", None)
        if backend is None:
            return
        try:
            which = backend(q, self.recipe)
        except ValueError as e:
            raise Skip(f"flamia {self.recipe}: {short_error(e, 200)}") from e
        if which != "kernels":
            why = ""
            try:
                from flamia.kernel_path import kernel_entry_points
                why = kernel_entry_points()[1] or ""
            except Exception:
                pass
            raise Skip(f"flamia {self.recipe} would run the reference emulation here, not the "
                       f"kernels" + (f" ({why})" if why else ""))

    def build(self, problem, inputs, n_copies=1):
        fn = flamia_api()
        self._check_kernels(inputs.q)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        kw = {"causal": True, "recipe": self.recipe}
        if "check_finite" in params:
            kw["check_finite"] = False
        cu, L = inputs.cu_seqlens, problem.max_len

        def call(q, k, v):
            return fn(q, k, v, cu, cu, L, L, **kw)

        ident = lambda t: t  # noqa: E731
        leaves, douts = make_leaves(inputs, n_copies, ident, ident, ident)
        return AutogradBound(call, leaves, douts, lambda o, dq, dk, dv: (o, dq, dk, dv))


# ---------------------------------------------------------------------------------------------
# torch SDPA (one document, dense)


class SdpaImpl(Impl):
    kind = "bf16"
    recipe = "bf16"

    def __init__(self, backend: str):
        assert backend in ("cudnn", "flash")
        self.backend = backend
        self.key = f"sdpa_{backend}"
        self.label = "SDPA cuDNN" if backend == "cudnn" else "SDPA flash"
        self.static_notes = ("dense (1, S, H, D) input",)

    def _backend(self):
        from torch.nn.attention import SDPBackend
        name = "CUDNN_ATTENTION" if self.backend == "cudnn" else "FLASH_ATTENTION"
        if not hasattr(SDPBackend, name):
            raise Skip(f"torch has no SDPBackend.{name}")
        return getattr(SDPBackend, name)

    def env_skip(self):
        try:
            from torch.nn.attention import sdpa_kernel  # noqa: F401
            self._backend()
        except Skip as e:
            return str(e)
        except Exception as e:
            return f"torch.nn.attention.sdpa_kernel unavailable: {short_error(e)}"
        return None

    def static_skip(self, problem):
        return _one_doc_only(problem, self.label)

    def build(self, problem, inputs, n_copies=1):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        backend = self._backend()
        G = problem.group

        def make_call(gqa: bool):
            kw = {"enable_gqa": True} if gqa else {}

            def call(q, k, v):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, **kw)
            return call

        tq = lambda t: t.unsqueeze(0)                           # noqa: E731  (1, S, H, D)
        tdo = lambda t: t.unsqueeze(0).clone().transpose(1, 2)  # noqa: E731  out's (1, H, S, D) view

        def to_packed_native(o, dq, dk, dv):
            return o[0].transpose(0, 1), dq[0], dk[0], dv[0]

        def to_packed_rep(o, dq, dk, dv):
            return (o[0].transpose(0, 1), dq[0], sum_groups(dk[0], problem.heads_kv),
                    sum_groups(dv[0], problem.heads_kv))

        notes = []
        if G > 1:
            leaves, douts = make_leaves(inputs, n_copies, tq, tq, tdo)
            bound = AutogradBound(make_call(True), leaves, douts, to_packed_native,
                                  ["GQA via enable_gqa=True"])
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    bound.fwdbwd(0)
                    sync()
                return bound
            except Exception as e:
                bound.close()
                notes.append(f"enable_gqa=True rejected ({short_error(e, 120)}); kv repeated to "
                             f"{problem.heads_q} heads with repeat_interleave outside the timed "
                             f"region (dK, dV summed over the group for accuracy)")
            rep = lambda t: t.repeat_interleave(G, dim=1).unsqueeze(0)  # noqa: E731
            leaves, douts = make_leaves(inputs, n_copies, tq, rep, tdo)
            bound = AutogradBound(make_call(False), leaves, douts, to_packed_rep, notes)
        else:
            leaves, douts = make_leaves(inputs, n_copies, tq, tq, tdo)
            bound = AutogradBound(make_call(False), leaves, douts, to_packed_native)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                bound.fwdbwd(0)
                sync()
            except RuntimeError as e:
                bound.close()
                raise Skip(f"{self.label} cannot run this shape: {short_error(e, 200)}") from e
        return bound


# ---------------------------------------------------------------------------------------------
# torch varlen_attn (FlashAttention-2 varlen)


def _varlen_fn():
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn


class VarlenImpl(Impl):
    kind = "bf16"
    recipe = "bf16"
    key = "varlen"
    label = "varlen_attn (FA2)"
    static_notes = ("packed (T, H, D)",)

    def __init__(self):
        self._native_gqa: dict = {}

    def env_skip(self):
        try:
            _varlen_fn()
        except Exception as e:
            import torch
            return f"torch.nn.attention.varlen.varlen_attn not available in torch {torch.__version__} " \
                   f"({short_error(e, 100)})"
        return None

    def causal_kwargs(self) -> tuple[dict, str]:
        params = inspect.signature(_varlen_fn()).parameters
        if "window_size" in params:
            return {"window_size": (-1, 0)}, "causal as window_size=(-1, 0)"
        if "is_causal" in params:
            return {"is_causal": True}, "causal as is_causal=True"
        raise Skip(f"varlen_attn{inspect.signature(_varlen_fn())} has neither window_size nor "
                   f"is_causal: cannot express causal attention")

    def _probe_native_gqa(self, D: int, kw: dict, device="cuda") -> tuple[bool, str]:
        """Without enable_gqa in the signature: does passing Hkv < Hq heads work, and right?"""
        import torch
        from flamia.inputs import cu_seqlens_from_lengths
        from flamia.reference import attention_exact

        if D in self._native_gqa:
            return self._native_gqa[D]
        lens, Hq, Hkv = (64, 100), 4, 2
        gen = torch.Generator(device=device).manual_seed(1)
        q = torch.randn(sum(lens), Hq, D, device=device, generator=gen).bfloat16()
        k = torch.randn(sum(lens), Hkv, D, device=device, generator=gen).bfloat16()
        v = torch.randn(sum(lens), Hkv, D, device=device, generator=gen).bfloat16()
        cu = cu_seqlens_from_lengths(lens, device=device)
        try:
            out = _varlen_fn()(q, k, v, cu, cu, max(lens), max(lens), **kw)
            ref = attention_exact(q, k, v, cu, causal=True, dtype=torch.float32)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            res = (err < 2e-2, f"native GQA probe rel err {err:.1e}")
        except Exception as e:
            res = (False, f"native GQA probe failed: {short_error(e, 120)}")
        self._native_gqa[D] = res
        return res

    def build(self, problem, inputs, n_copies=1):
        fn = _varlen_fn()
        params = inspect.signature(fn).parameters
        kw, how = self.causal_kwargs()
        notes = [how]
        G = problem.group
        repeat = False
        if G > 1:
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
                notes.append("GQA via enable_gqa=True")
            else:
                ok, msg = self._probe_native_gqa(problem.head_dim, dict(kw), inputs.q.device)
                if ok:
                    notes.append(f"GQA native (Hkv < Hq accepted; {msg})")
                else:
                    repeat = True
                    notes.append(f"no enable_gqa ({msg}): kv repeated to {problem.heads_q} heads "
                                 f"outside the timed region")
        cu, L = inputs.cu_seqlens, problem.max_len

        def call(q, k, v):
            return fn(q, k, v, cu, cu, L, L, **kw)

        ident = lambda t: t  # noqa: E731
        tkv = (lambda t: t.repeat_interleave(G, dim=1)) if repeat else ident
        leaves, douts = make_leaves(inputs, n_copies, ident, tkv, ident)
        if repeat:
            to_packed = lambda o, dq, dk, dv: (o, dq, sum_groups(dk, problem.heads_kv),  # noqa: E731
                                               sum_groups(dv, problem.heads_kv))
        else:
            to_packed = lambda o, dq, dk, dv: (o, dq, dk, dv)  # noqa: E731
        return AutogradBound(call, leaves, douts, to_packed, notes)


# ---------------------------------------------------------------------------------------------
# flex_attention with a document-causal block mask

_FLEX_COMPILED = None
_MASK_MODS: dict = {}


def _document_causal_mask_mod(doc_lengths, device):
    """The document-causal mask_mod for these lengths. One function object per (T, device),
    reading a per-token document id buffer that is refilled in place: a new workload of the same
    size never makes dynamo recompile the flex kernels for a new closure."""
    import torch

    lens = torch.tensor(doc_lengths, device=device)
    ids = torch.repeat_interleave(torch.arange(len(doc_lengths), device=device, dtype=torch.int32),
                                  lens)
    key = (int(ids.numel()), str(device))
    if key not in _MASK_MODS:
        buf = ids.clone()

        def document_causal(b, h, q_idx, kv_idx):
            return (buf[q_idx] == buf[kv_idx]) & (q_idx >= kv_idx)

        _MASK_MODS[key] = (buf, document_causal)
    buf, fn = _MASK_MODS[key]
    buf.copy_(ids)
    return fn


def _flex_compiled():
    global _FLEX_COMPILED
    if _FLEX_COMPILED is None:
        import torch
        import torch._dynamo.config as dcfg
        from torch.nn.attention.flex_attention import flex_attention

        # Each workload shape compiles once; never fall back to eager (it materializes S).
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(dcfg, name):
                setattr(dcfg, name, max(64, getattr(dcfg, name)))
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


class FlexImpl(Impl):
    kind = "bf16"
    recipe = "bf16"
    key = "flex"
    label = "flex_attention"
    static_notes = ("torch.compile'd; block mask built outside the timed region",)

    def env_skip(self):
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
        except Exception as e:
            return f"torch.nn.attention.flex_attention unavailable: {short_error(e)}"
        return None

    def build(self, problem, inputs, n_copies=1):
        from torch.nn.attention.flex_attention import create_block_mask

        dev = inputs.q.device
        T = problem.T
        document_causal = _document_causal_mask_mod(problem.doc_lengths, dev)
        block_mask = create_block_mask(document_causal, None, None, T, T, device=dev)
        flex = _flex_compiled()
        kw = {"enable_gqa": True} if problem.group > 1 else {}

        def call(q, k, v):
            return flex(q, k, v, block_mask=block_mask, **kw)

        heads_first = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731  (1, H, T, D)
        tdo = lambda t: heads_first(t).contiguous()  # noqa: E731

        def to_packed(o, dq, dk, dv):
            return tuple(x[0].transpose(0, 1) for x in (o, dq, dk, dv))

        leaves, douts = make_leaves(inputs, n_copies, heads_first, heads_first, tdo)
        notes = ["(1, H, T, D) layout"] + (["GQA via enable_gqa=True"] if kw else [])
        return AutogradBound(call, leaves, douts, to_packed, notes)


# ---------------------------------------------------------------------------------------------
# cuDNN through cudnn-frontend (bf16 ragged, FP8 dense)


class CudnnImpl(Impl):
    kind = "bf16"
    recipe = "bf16"
    key = "cudnn"
    label = "cuDNN ragged"
    static_notes = ("cudnn-frontend graphs built once outside the timed region",)

    def env_skip(self):
        return cudnn_env_skip()

    def build(self, problem, inputs, n_copies=1):
        from .cudnn_graphs import CudnnRaggedBF16
        return CudnnRaggedBF16(problem, inputs, n_copies)


class CudnnFp8Impl(Impl):
    kind = "fp8"
    recipe = "fp8"
    key = "cudnn_fp8"
    label = "cuDNN FP8*"
    static_notes = ("*FP8 e4m3 in/out, its quantization not timed",)

    def env_skip(self):
        return cudnn_env_skip()

    def static_skip(self, problem):
        return _one_doc_only(problem, "cuDNN FP8")

    def build(self, problem, inputs, n_copies=1):
        from .cudnn_graphs import CudnnFp8Dense
        return CudnnFp8Dense(problem, inputs, n_copies)


def cudnn_env_skip() -> str | None:
    try:
        c = cudnn_module()
    except Exception as e:
        return f"cudnn-frontend (python package 'cudnn') not importable: {short_error(e, 150)}"
    for name in ("pygraph", "create_handle"):
        if not hasattr(c, name):
            return f"cudnn-frontend {getattr(c, '__version__', '?')} has no cudnn.{name}"
    return None


# ---------------------------------------------------------------------------------------------
# FlashAttention-4 (flash-attn-4, CuTe DSL kernels; sm90 bf16 here)

FA4_DIST = "flash-attn-4"


def _fa4_fn():
    from flash_attn.cute import flash_attn_varlen_func
    return flash_attn_varlen_func


def fa4_version() -> str | None:
    """The installed flash-attn-4 distribution's version (None when it is not installed)."""
    try:
        from importlib.metadata import version
        return version(FA4_DIST)
    except Exception:
        return None


def fa4_env_skip() -> str | None:
    """Why FA4 cannot run here (None if it can): flash_attn.cute must import and the current
    GPU must be sm90 (the kernels this baseline stands for)."""
    try:
        _fa4_fn()
    except Exception as e:
        return (f"flash-attn-4 (flash_attn.cute.flash_attn_varlen_func) not importable: "
                f"{short_error(e, 150)} (pip install 'flamia[fa4]')")
    import torch
    if not torch.cuda.is_available():
        return "FlashAttention-4 needs a CUDA GPU (none here)"
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return (f"FlashAttention-4 baseline measures the sm90 kernels; this GPU is "
                f"sm{cap[0]}{cap[1]}")
    return None


def fa4_varlen(q, k, v, cu_seqlens, max_seqlen: int, causal: bool = True,
               softmax_scale: float | None = None):
    """FlashAttention-4 on packed documents, differentiable: q (T, Hq, D), k / v (T, Hkv, D)
    bf16 on CUDA (GQA native), int32 cu_seqlens. Returns out (T, Hq, D); FA4 also returns its
    lse, which is dropped. The same signature as cudnn_ragged_varlen (a training baseline)."""
    import torch

    if not q.is_cuda:
        raise ValueError("fa4_varlen: q, k, v must be CUDA tensors (FlashAttention-4)")
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    out = _fa4_fn()(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=int(max_seqlen),
                    max_seqlen_k=int(max_seqlen), causal=causal, softmax_scale=softmax_scale)
    return out[0] if isinstance(out, (tuple, list)) else out


class Fa4Impl(Impl):
    kind = "bf16"
    recipe = "bf16"
    key = "fa4"
    static_notes = ("packed (T, H, D), cu_seqlens; GQA native (Hkv heads)",)

    def __init__(self):
        ver = fa4_version()
        self.label = f"FlashAttention-4 {ver}" if ver else "FlashAttention-4"

    def env_skip(self):
        return fa4_env_skip()

    def build(self, problem, inputs, n_copies=1):
        fn = _fa4_fn()
        cu, L = inputs.cu_seqlens, problem.max_len

        def call(q, k, v):
            return fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=L, max_seqlen_k=L,
                      causal=True)

        ident = lambda t: t  # noqa: E731
        leaves, douts = make_leaves(inputs, n_copies, ident, ident, ident)
        bound = AutogradBound(call, leaves, douts, lambda o, dq, dk, dv: (o, dq, dk, dv),
                              ["JIT compiled by one forward+backward in build, outside the timing"])
        try:
            bound.fwdbwd(0)      # CuTe DSL compiles its forward and backward kernels here
            sync()
        except Exception:
            bound.close()
            raise
        return bound


# ---------------------------------------------------------------------------------------------
# registry


def make_impls(recipes: Sequence[str], baselines: Sequence[str]) -> list[Impl]:
    impls: list[Impl] = [FlamiaImpl(r) for r in recipes]
    factories = {
        "sdpa_cudnn": lambda: SdpaImpl("cudnn"),
        "sdpa_flash": lambda: SdpaImpl("flash"),
        "cudnn": CudnnImpl,
        "fa4": Fa4Impl,
        "varlen": VarlenImpl,
        "flex": FlexImpl,
        "cudnn_fp8": CudnnFp8Impl,
    }
    for key in baselines:
        impls.append(factories[key]())
    return impls


def parse_baselines(spec: str | None) -> list[str]:
    """'all' (default), 'none', or a comma list of BASELINE_KEYS (a few aliases accepted)."""
    aliases = {"sdpa": ["sdpa_cudnn", "sdpa_flash"], "cudnn_bf16": ["cudnn"],
               "cudnn_ragged": ["cudnn"], "fa2": ["varlen"], "varlen_attn": ["varlen"],
               "flex_attention": ["flex"], "fp8": ["cudnn_fp8"], "flash_attn_4": ["fa4"],
               "flash-attn-4": ["fa4"]}
    if spec is None or spec.strip().lower() in ("", "all"):
        return list(BASELINE_KEYS)
    if spec.strip().lower() == "none":
        return []
    out: list[str] = []
    for part in spec.split(","):
        p = part.strip().lower()
        if not p:
            continue
        keys = aliases.get(p, [p])
        for key in keys:
            if key not in BASELINE_KEYS:
                raise ValueError(f"--baselines: unknown baseline {part.strip()!r}; choose from "
                                 f"{', '.join(BASELINE_KEYS)} (or all, none)")
            if key not in out:
                out.append(key)
    return out
