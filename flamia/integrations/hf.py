"""flamia attention for Hugging Face transformers (the `AttentionInterface`).

    import flamia.integrations.hf as fhf
    fhf.register("flamia_fp8", recipe="fp8")          # or fhf.register_all()
    model = LlamaForCausalLM.from_pretrained(..., attn_implementation="flamia_fp8")
    # or: model.set_attn_implementation("flamia_fp8")

What the registered function does, per attention layer:
- HF passes q, k, v as (B, H, S, D) (k, v with the model's kv heads: GQA is passed through to
  flamia, never materialized); they become packed (T, H, D) tokens with int32 cu_seqlens and go
  through `flamia.flamia_attn_varlen_func` (recipe, `module.scaling` as softmax_scale, causal from
  `is_causal` / `module.is_causal`). Returns (attn_output (B, S, Hq, D), None).
- Document boundaries, first match wins:
  1. `cu_seq_lens_q` / `cu_seq_lens_k` / `max_length_q` / `max_length_k` kwargs (what
     `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` produces; batch of one row):
     used as given, no host sync besides one validation per forward.
  2. a 2-D padding mask (`attention_mask`, 1 = token): the tokens of each row are gathered into
     one document (left, right, even interior padding: a token attends to the non-padding tokens
     before it, exactly as the eager path does); padding positions get a zero output.
  3. `position_ids`: a new document starts wherever a position is not the previous one plus one
     (HF's own packed-sequence rule, `find_packed_sequence_indices`), and at every row start.
     A plain `arange` per row is simply one document per row.
  4. otherwise one document per row.
  Cases 2 and 3 need the number of documents and the longest one on the host: that is one device
  sync per forward pass, not per layer (the result is cached on the identity and version of the
  position_ids / mask tensor, which every layer of one forward shares). Pass case 1's kwargs
  (host-known lengths) to avoid it.
- dtypes: bf16 / fp16 pass through. fp32 q, k, v (a model in fp32, or fp32 RoPE output under
  autocast) are cast to the autocast dtype if autocast is on (the output stays in it), else to
  bf16 and the output is cast back to fp32 -- as transformers' flash-attention path does.
- A matching mask function is registered too, so transformers never builds a dense 4-D mask for
  these names: it returns None (no padding) or the 2-D padding mask.
- Clear errors instead of silent wrong answers: sliding window, softcap, attention sinks,
  dropout > 0, a 4-D (custom) mask, a KV cache with more keys than queries (decoding: flamia is a
  training kernel; generate with "sdpa"), head counts that are not a GQA multiple.

The names never contain "flash": transformers switches on flash-attention-specific handling for
such names.

Also here: `register_exact(name)`, torch's own exact bf16 attention with the same packing rules
(torch `varlen_attn` = FlashAttention-2 on CUDA when available, else SDPA per document), used by
`flamia train-check` to evaluate every model with exact attention.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from ..recipes import RECIPES, get_recipe

PREFIX = "flamia_"
EXACT_NAME = "flamia_torch_exact"

__all__ = [
    "register", "register_all", "register_exact", "register_varlen", "make_attention_function",
    "mask_function",
    "Packing", "resolve_packing", "attention_forward", "registered_name", "exact_backend",
    "torch_exact_varlen", "PREFIX", "EXACT_NAME",
]


# --------------------------------------------------------------------------------------------
# Packing: which tokens take part and where documents start
# --------------------------------------------------------------------------------------------

@dataclass
class Packing:
    """Packed layout of a (B, S) batch: documents over the flattened tokens B*S.

    cu_seqlens: int32 (n_docs + 1,) on the tokens' device, offsets into the *selected* tokens.
    max_seqlen: longest document (host int).
    index: None when every one of the B*S tokens takes part (in order); else int64 flat indices of
           the tokens that do (padding removed), the rest get a zero output.
    """
    cu_seqlens: torch.Tensor
    max_seqlen: int
    index: torch.Tensor | None = None


class _OneEntryCache:
    """Remembers one result keyed on a tensor's identity and version (plus extra meta).

    Every attention layer of one forward pass receives the same position_ids / mask tensor, so
    the host sync that derives the packing happens once per forward pass.
    """

    def __init__(self):
        self._ref = None
        self._meta = None
        self._value = None

    def get(self, t: torch.Tensor, meta):
        if self._ref is not None and self._ref() is t and self._meta == (t._version, meta):
            return self._value
        return None

    def put(self, t: torch.Tensor, meta, value):
        try:
            self._ref = weakref.ref(t)
        except TypeError:  # pragma: no cover - tensors support weakrefs
            self._ref = None
            return value
        self._meta = (t._version, meta)
        self._value = value
        return value


_POS_CACHE = _OneEntryCache()
_MASK_CACHE = _OneEntryCache()
_CU_CACHE = _OneEntryCache()


def _dense_packing(batch: int, seqlen: int, device) -> Packing:
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
    return Packing(cu, int(seqlen), None)


def packing_from_position_ids(position_ids: torch.Tensor, batch: int, seqlen: int) -> Packing:
    """Documents start at every row start and wherever position_ids[t] != position_ids[t-1] + 1."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.shape[-1] != seqlen or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"flamia: position_ids of shape {tuple(position_ids.shape)} do not match the "
                         f"attention input's (batch {batch}, length {seqlen})")
    meta = (batch, seqlen, str(position_ids.device))
    hit = _POS_CACHE.get(position_ids, meta)
    if hit is not None:
        return hit
    pos = position_ids.expand(batch, seqlen)
    start = torch.ones(batch, seqlen, dtype=torch.bool, device=pos.device)
    if seqlen > 1:
        start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    starts = start.reshape(-1).nonzero().squeeze(1)                  # host sync (count)
    total = torch.full((1,), batch * seqlen, dtype=starts.dtype, device=starts.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    max_seqlen = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
    return _POS_CACHE.put(position_ids, meta, Packing(cu, max_seqlen, None))


def packing_from_attention_mask(mask: torch.Tensor) -> Packing:
    """2-D padding mask (B, S), nonzero = token. Each row's tokens form one document."""
    if mask.dim() != 2:
        raise ValueError(
            f"flamia attention takes no dense {mask.dim()}-D attention mask (got shape "
            f"{tuple(mask.shape)}): it needs the document structure instead. Pass packed documents "
            "via position_ids or cu_seq_lens_q/k kwargs, or a 2-D padding mask.")
    meta = (tuple(mask.shape), str(mask.device))
    hit = _MASK_CACHE.get(mask, meta)
    if hit is not None:
        return hit
    valid = mask.to(torch.bool)
    B, S = valid.shape
    lengths = valid.sum(1, dtype=torch.int32)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = torch.cumsum(lengths, 0, dtype=torch.int32)
    index = valid.reshape(-1).nonzero().squeeze(1)                   # host sync
    max_seqlen = int(lengths.max().item()) if B else 0
    if index.numel() == B * S:
        index = None
    return _MASK_CACHE.put(mask, meta, Packing(cu, max_seqlen, index))


def packing_from_cu_seqlens(cu_q, cu_k, max_q, max_k, batch: int, seqlen: int, device) -> Packing:
    """Explicit varlen kwargs (DataCollatorWithFlattening). Self-attention: q and k share docs."""
    if batch != 1:
        raise ValueError(f"flamia: cu_seq_lens_q/k describe a flattened batch of one row; got a batch "
                         f"of {batch} rows")
    if cu_k is not None and cu_k is not cu_q and (cu_k.shape != cu_q.shape or not torch.equal(
            cu_k.to(cu_q.device, cu_q.dtype), cu_q)):
        raise NotImplementedError("flamia: cu_seq_lens_k differs from cu_seq_lens_q (cross attention or "
                                  "a KV cache): flamia attention is self-attention only")
    meta = (seqlen, str(device))
    hit = _CU_CACHE.get(cu_q, meta)
    if hit is None:
        cu = cu_q.to(device=device, dtype=torch.int32)
        first, last = (int(x) for x in cu[[0, -1]].tolist())               # one sync per forward
        if first != 0 or last != seqlen:
            raise ValueError(f"flamia: cu_seq_lens_q must run from 0 to the number of tokens {seqlen}, "
                             f"got {first} .. {last}")
        hit = _CU_CACHE.put(cu_q, meta, cu)
    mq = max_q if max_q is not None else max_k
    if mq is None:
        mq = int((hit[1:] - hit[:-1]).max().item())
    mq = int(mq.item()) if isinstance(mq, torch.Tensor) else int(mq)
    if max_k is not None:
        mk = int(max_k.item()) if isinstance(max_k, torch.Tensor) else int(max_k)
        mq = max(mq, mk)
    return Packing(hit, mq, None)


def resolve_packing(batch: int, seqlen: int, device, attention_mask=None, position_ids=None,
                    cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None,
                    max_length_k=None) -> Packing:
    """The packed layout for one attention call (module docstring: the order of precedence)."""
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        cu_q = cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k
        return packing_from_cu_seqlens(cu_q, cu_seq_lens_k, max_length_q, max_length_k, batch, seqlen,
                                       device)
    if attention_mask is not None:
        if attention_mask.dim() == 2 and attention_mask.shape != (batch, seqlen):
            raise ValueError(f"flamia: 2-D attention_mask of shape {tuple(attention_mask.shape)} does not "
                             f"match the queries (batch {batch}, length {seqlen})")
        return packing_from_attention_mask(attention_mask)
    if position_ids is not None:
        return packing_from_position_ids(position_ids, batch, seqlen)
    return _dense_packing(batch, seqlen, device)


# --------------------------------------------------------------------------------------------
# Backends: packed (T, H, D) attention
# --------------------------------------------------------------------------------------------

_SIG_CACHE: dict = {}


def _accepted_kwargs(fn, kwargs: dict) -> dict:
    key = id(fn)
    if key not in _SIG_CACHE:
        try:
            params = inspect.signature(fn).parameters
            var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            _SIG_CACHE[key] = None if var_kw else frozenset(params)
        except (TypeError, ValueError):
            _SIG_CACHE[key] = None
    names = _SIG_CACHE[key]
    return dict(kwargs) if names is None else {k: v for k, v in kwargs.items() if k in names}


def flamia_varlen(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, recipe, **opts):
    """flamia.flamia_attn_varlen_func (the public API); the reference emulation until it exists."""
    import flamia
    fn = getattr(flamia, "flamia_attn_varlen_func", None)
    if fn is not None:
        kw = _accepted_kwargs(fn, opts)
        return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal,
                  softmax_scale=softmax_scale, recipe=recipe, **kw)
    from ..reference import ReferenceAttention
    out, _ = ReferenceAttention.apply(q, k, v, cu_seqlens, recipe, causal, softmax_scale, torch.float32)
    return out


def _torch_varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


def torch_exact_varlen(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale):
    """Exact attention by torch: `varlen_attn` (FlashAttention-2) on CUDA when available, else
    `scaled_dot_product_attention` per document. Returns (T, Hq, D)."""
    group = q.shape[1] // k.shape[1]
    if exact_backend(q, softmax_scale) == "torch varlen_attn":
        fn = _torch_varlen_fn()
        params = inspect.signature(fn).parameters
        kw = {"scale": softmax_scale} if "scale" in params else {}
        if "window_size" in params:
            kw["window_size"] = (-1, 0) if causal else (-1, -1)
        elif "is_causal" in params:
            kw["is_causal"] = causal
        if group > 1:
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            else:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
        out = fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kw)
        return out[0] if isinstance(out, tuple) else out
    return sdpa_per_document(q, k, v, cu_seqlens, causal, softmax_scale)


def exact_backend(q: torch.Tensor, softmax_scale: float | None = None) -> str:
    """Which implementation `torch_exact_varlen` uses for tensors like q."""
    fn = _torch_varlen_fn() if q.is_cuda else None
    if fn is None or q.dtype not in (torch.bfloat16, torch.float16):
        return "torch sdpa per document"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return "torch sdpa per document"
    if "window_size" not in params and "is_causal" not in params:
        return "torch sdpa per document"
    if "scale" not in params and softmax_scale is not None and softmax_scale != q.shape[-1] ** -0.5:
        return "torch sdpa per document"
    return "torch varlen_attn"


def sdpa_per_document(q, k, v, cu_seqlens, causal, softmax_scale):
    """torch SDPA on each document separately (any device, any dtype)."""
    import torch.nn.functional as F
    group = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b <= a:
            continue
        qd, kd, vd = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        if group > 1:
            kd = kd.repeat_interleave(group, dim=1)
            vd = vd.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=softmax_scale)
        pieces.append(o.squeeze(0).transpose(0, 1))
    if not pieces:
        return q.new_zeros(q.shape)
    return torch.cat(pieces, 0)


# --------------------------------------------------------------------------------------------
# The HF attention function
# --------------------------------------------------------------------------------------------

def _target_dtype(x: torch.Tensor):
    """(compute dtype, output dtype) for HF's q/k/v dtype."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.dtype, x.dtype
    dev = x.device.type
    try:
        autocast = torch.is_autocast_enabled(dev)
    except TypeError:  # pragma: no cover - old torch
        autocast = torch.is_autocast_enabled()
    if autocast:
        dt = torch.get_autocast_dtype(dev)
        if dt in (torch.bfloat16, torch.float16):
            return dt, dt
    return torch.bfloat16, x.dtype


def attention_forward(module, query, key, value, attention_mask, *, varlen: Callable,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, s_aux=None, **kwargs):
    """HF attention function body. query (B, Hq, S, D); key, value (B, Hkv, S_k, D).

    `varlen(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale)` computes packed attention.
    """
    if dropout and dropout > 0.0:
        raise ValueError(f"flamia attention has no attention dropout (got dropout={dropout}); set the "
                         "model's attention_dropout to 0")
    if sliding_window is not None or getattr(module, "sliding_window", None) is not None:
        raise NotImplementedError("flamia attention does not implement sliding-window attention")
    if softcap is not None:
        raise NotImplementedError("flamia attention does not implement logit softcapping")
    if s_aux is not None:
        raise NotImplementedError("flamia attention does not implement attention sinks (s_aux)")
    if kwargs.get("output_attentions", False):
        raise ValueError("flamia attention never materializes attention weights: output_attentions=True "
                         "needs attn_implementation='eager'")
    B, Hq, S, D = query.shape
    Bk, Hkv, Sk, Dk = key.shape
    if Sk != S or Bk != B:
        raise NotImplementedError(
            f"flamia attention is self-attention over the same tokens (queries {S}, keys {Sk}): a KV cache "
            "(decoding with past keys) is not supported -- flamia is a training kernel; generate with "
            "attn_implementation='sdpa', or pass use_cache=False")
    if Dk != D or value.shape[-1] != D:
        raise NotImplementedError(f"flamia attention needs equal q/k/v head dims, got {D}, {Dk}, "
                                  f"{value.shape[-1]}")
    if Hq % Hkv:
        raise ValueError(f"flamia attention: {Hq} query heads are not a multiple of {Hkv} kv heads")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else getattr(module, "scaling", None)

    packing = resolve_packing(
        B, S, query.device, attention_mask=attention_mask, position_ids=kwargs.get("position_ids"),
        cu_seq_lens_q=kwargs.get("cu_seq_lens_q"), cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
        max_length_q=kwargs.get("max_length_q"), max_length_k=kwargs.get("max_length_k"))

    compute_dtype, out_dtype = _target_dtype(query)
    # (B, H, S, D) -> (B*S, H, D) packed tokens
    q, k, v = (x.transpose(1, 2).reshape(B * S, x.shape[1], D).to(compute_dtype).contiguous()
               for x in (query, key, value))
    if packing.index is not None:
        q, k, v = (x.index_select(0, packing.index) for x in (q, k, v))
    with torch.autocast(query.device.type, enabled=False):
        out = varlen(q, k, v, packing.cu_seqlens, packing.max_seqlen, causal, scale)
    if packing.index is not None:
        out = out.new_zeros(B * S, Hq, D).index_copy(0, packing.index, out)
    out = out.reshape(B, S, Hq, D)
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    return out, None


def make_attention_function(recipe="fp8", check_finite: bool = True, deterministic: bool = False):
    """An HF attention function running flamia with this recipe."""
    rec = get_recipe(recipe)
    opts = {"check_finite": check_finite, "deterministic": deterministic}

    def varlen(q, k, v, cu, max_seqlen, causal, scale):
        return flamia_varlen(q, k, v, cu, max_seqlen, causal, scale, rec.name, **opts)

    def flamia_attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, varlen=varlen, **kwargs)

    flamia_attention.recipe = rec.name
    flamia_attention.__qualname__ = flamia_attention.__name__ = f"flamia_attention_{rec.name}"
    return flamia_attention


def exact_attention(module, query, key, value, attention_mask, **kwargs):
    """HF attention function: torch's exact attention with flamia's packing rules."""
    return attention_forward(module, query, key, value, attention_mask, varlen=torch_exact_varlen,
                             **kwargs)


def mask_function(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
                  mask_function=None, attention_mask=None, **kwargs):
    """Mask for flamia names: None (no padding) or the 2-D boolean padding mask; never 4-D."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        return attention_mask
    if kv_length is not None:
        attention_mask = attention_mask[:, -kv_length:]
    if (kv_length is None or attention_mask.shape[1] == kv_length) and bool(attention_mask.all()):
        return None
    return attention_mask.to(torch.bool)


def _register(name: str, fn: Callable) -> str:
    if "flash" in name:
        raise ValueError(f"attention name {name!r} must not contain 'flash': transformers enables "
                         "flash-attention-specific handling for such names")
    from transformers import AttentionInterface
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # pragma: no cover - transformers < 4.53
        AttentionMaskInterface = None
    AttentionInterface.register(name, fn)
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(name, mask_function)
    return name


def registered_name(recipe) -> str:
    return PREFIX + get_recipe(recipe).name


def register(name: str | None = "flamia_fp8", recipe="fp8", check_finite: bool = True,
             deterministic: bool = False) -> str:
    """Register flamia attention (one recipe) with transformers under `name`; returns the name.

    Then `attn_implementation=name` (from_pretrained / from_config / set_attn_implementation).
    """
    name = registered_name(recipe) if name is None else name
    return _register(name, make_attention_function(recipe, check_finite, deterministic))


def register_all(check_finite: bool = True, deterministic: bool = False) -> dict[str, str]:
    """Register every recipe as "flamia_<recipe>"; returns {recipe: name}."""
    return {r: register(registered_name(r), r, check_finite, deterministic) for r in RECIPES}


def register_varlen(name: str, varlen: Callable) -> str:
    """Register any packed attention `varlen(q, k, v, cu_seqlens, max_seqlen, causal,
    softmax_scale) -> (T, Hq, D)` under `name`, with flamia's packing rules (e.g. a bf16
    baseline such as cuDNN's ragged attention, to train the same model with it)."""
    def varlen_attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, varlen=varlen,
                                 **kwargs)
    return _register(name, varlen_attention)


def register_exact(name: str = EXACT_NAME) -> str:
    """Register torch's exact attention (varlen FA2 on CUDA / SDPA per document) with flamia's
    packing rules, e.g. to evaluate a flamia-trained model with exact attention."""
    return _register(name, exact_attention)
