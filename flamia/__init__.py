"""flamia: FP8 attention for training Transformers on NVIDIA Hopper, causal-exact and
packed-document native.

    import flamia
    out = flamia.flamia_attn_func(q, k, v, causal=True, recipe="fp8")            # (B, S, H, D)
    out = flamia.flamia_attn_varlen_func(q, k, v, cu, cu, max_len, max_len)     # packed (T, H, D)
    print(flamia.audit(flamia.audit.recipe_fn("fp8")))                          # leakage audit

The numerics of every recipe are specified by `flamia.reference`; see README.md.
"""
from __future__ import annotations

from importlib import metadata as _metadata

from .recipes import RECIPES, SAFE_RECIPES, Recipe, get_recipe
from .interface import FlamiaAttention, flamia_attn_func, flamia_attn_varlen_func
from . import audit

try:
    __version__ = _metadata.version("flamia")
except _metadata.PackageNotFoundError:   # running from a source tree without installing
    __version__ = "0.1.0"

__all__ = [
    "flamia_attn_func", "flamia_attn_varlen_func", "FlamiaAttention", "Recipe", "RECIPES",
    "SAFE_RECIPES", "get_recipe", "audit", "__version__",
]
