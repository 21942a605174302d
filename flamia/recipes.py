"""Recipes: which number format each attention GEMM uses, and how its scales are chosen.

A recipe is pure data. `flamia/reference.py` gives each field its exact meaning; the kernels in
`flamia/ops/` implement the recipes they list in `KERNEL_RECIPES`.

Scaling granularities
- "token":  one power-of-two scale per (token, head) over the head dim for the stored operands
            Q, K, V, dO. Token-local, hence causal- and document-safe by construction (P1, P2).
            Operands produced inside the kernel (P, dS) get a scale per row of the GEMM's output
            over the reduction dim (see reference.py for why that is leak-free too).
- "block":  MX-style power-of-two scales per 32 elements (16 with an e4m3 scale for NVFP4) along
            the head dim for stored operands, along the reduction dim for P and dS. Token-local /
            row-local, hence safe.
- "tensor": one scale per tensor (Transformer Engine's current scaling). A function of every
            token, the future and the other documents included: it LEAKS. Kept only as the
            control that the audit must catch (`fp8_tensorwise`).
- "kvblock128": one power-of-two scale per (block of 128 tokens, head) for K and V, blocks
            restarting at every document start (the last block of a document may be short), with
            per-token copies of K and V on the diagonal pairs (same block, key j <= query i); Q per
            token, dO per 64-token block; in the backward P^T and dS get a per-CTA bound computed
            by a preprocess pass (reference.py, "Token-block scaling"). Forward bitwise leak-free
            and document-local (P1, P2); the backward scales are shared by many tokens
            (`Recipe.shared_backward_scale`), so the audit judges its gradient prefix by the
            relaxed rule.
- "none":   no scales (bf16 operands).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

FORMATS = ("bf16", "e4m3", "e5m2", "mxfp8", "nvfp4")

# Scalings whose backward quantizes with scales shared by several tokens: with dO zero after t,
# gradients at <= t may depend on later inputs through such a scale at rounding level (the
# relaxed backward rule of P1; the audit measures that change against the recipe's own error).
SHARED_BACKWARD_SCALINGS = ("kvblock128",)


@dataclass(frozen=True)
class Recipe:
    name: str
    qk: str            # format of Q and K in S = Q K^T (and of the copies reused in dQ, dK)
    v: str             # format of V in O = P V (and dP = dO V^T when dp is low precision)
    p: str             # format of P in O = P V and dV = P^T dO
    do: str            # format of dO in dV = P^T dO (and dP when dp is low precision)
    dp: str            # "fp8": dP from the quantized dO and V; "bf16": from bf16 dO and V
    ds: str            # format of dS in dQ = dS K and dK = dS^T Q
    scaling: str       # "token" | "block" | "kvblock128" | "tensor" | "none"
    rotate_qk: bool    # Hadamard-rotate q and k before quantizing (token-local, cuts outliers)
    leaky: bool = False
    emulated: bool = False   # reference numerics only (Blackwell formats, specs ahead of kernels)
    description: str = ""

    @property
    def shared_backward_scale(self) -> bool:
        """Does the backward quantize with scales shared by several tokens (see
        SHARED_BACKWARD_SCALINGS)? Then P1's backward prefix is judged by the relaxed rule."""
        return self.scaling in SHARED_BACKWARD_SCALINGS

    def with_(self, **changes) -> "Recipe":
        return replace(self, **changes)


BF16 = Recipe(
    "bf16", qk="bf16", v="bf16", p="bf16", do="bf16", dp="bf16", ds="bf16",
    scaling="none", rotate_qk=False,
    description="bf16 operands, fp32 accumulation: the exact baseline and fallback")

FP8 = Recipe(
    "fp8", qk="e4m3", v="e4m3", p="e4m3", do="e4m3", dp="fp8", ds="e4m3",
    scaling="kvblock128", rotate_qk=True,
    description="every attention GEMM in FP8 e4m3 with token-block scales: K/V per 128-token "
                "block with per-token copies on diagonal pairs, dO per 64-token block, P^T and dS "
                "scaled by a per-CTA bound; q, k Hadamard-rotated")

FP8_MIXED = Recipe(
    "fp8_mixed", qk="e4m3", v="e4m3", p="e4m3", do="e4m3", dp="bf16", ds="bf16",
    scaling="kvblock128", rotate_qk=True, emulated=True,
    description="fp8's forward and dV; dP = dO V^T and the dS GEMMs in bf16 (a spec without "
                "kernels: see README, 'Recipes')")

FP8_TOKEN = Recipe(
    "fp8_token", qk="e4m3", v="e4m3", p="e4m3", do="e4m3", dp="fp8", ds="e4m3",
    scaling="token", rotate_qk=True, emulated=True,
    description="every attention GEMM in FP8 e4m3 with per-token scales folded into P and dS "
                "element by element (the comparison for fp8's token-block scales)")

MXFP8 = Recipe(
    "mxfp8", qk="mxfp8", v="mxfp8", p="mxfp8", do="mxfp8", dp="fp8", ds="mxfp8",
    scaling="block", rotate_qk=False, emulated=True,
    description="emulated Blackwell MXFP8: e4m3 values, power-of-two scale per 32 elements")

NVFP4_MIXED = Recipe(
    "nvfp4_mixed", qk="nvfp4", v="mxfp8", p="mxfp8", do="mxfp8", dp="bf16", ds="bf16",
    scaling="block", rotate_qk=True, emulated=True,
    description="emulated Blackwell mixed path: QK^T in NVFP4 (rotated), PV and dV in MXFP8, "
                "dP and dS GEMMs in bf16")

FP8_TENSORWISE = Recipe(
    "fp8_tensorwise", qk="e4m3", v="e4m3", p="e4m3", do="e4m3", dp="fp8", ds="e4m3",
    scaling="tensor", rotate_qk=False, leaky=True,
    description="LEAKY control: per-tensor current scaling (Transformer Engine's scheme)")

RECIPES: dict[str, Recipe] = {r.name: r for r in (BF16, FP8, FP8_MIXED, FP8_TOKEN, MXFP8,
                                                  NVFP4_MIXED, FP8_TENSORWISE)}

# Recipes that flamia offers as safe (the audit must report zero change for each).
SAFE_RECIPES = tuple(name for name, r in RECIPES.items() if not r.leaky)


def get_recipe(recipe: "str | Recipe") -> Recipe:
    """Look a recipe up by name, or pass a Recipe through."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(f"recipe must be one of {sorted(RECIPES)} or a flamia.Recipe, got {recipe!r}")
