"""The numerics specification of every recipe, in plain PyTorch (CPU or GPU).

Read this file to know exactly what flamia computes. Forward and backward are written out in the
data flow the kernels have: quantize Q, K, V once (document-local, token-local scales); S; P and
its rounding; LSE; O. Backward from the saved quantized operands and the forward's LSE:
D = rowsum(dO * O), dP, dS, dV, dQ, dK.

Layout: packed tokens, q (T, Hq, D), k and v (T, Hkv, D), int32 cu_seqlens (n_docs + 1,); GQA
when Hkv divides Hq (query head h reads kv head h // (Hq // Hkv)). Internally a document's
attention is dense: S is (H, L, L) for a document of L tokens.

Recipes (flamia.recipes): fp8 and fp8_mixed use the token-block scaling (the section "Token-block
scaling" below); fp8_token (per-token scales, the comparison), mxfp8 and nvfp4_mixed the token-
and row-local scalings of points 1-5; bf16 none; fp8_tensorwise is the leaky control.

Why every safe token-local recipe (fp8_token, mxfp8, nvfp4_mixed) satisfies P1 (causal prefix
invariance) and P2 (document isolation) by construction -- each quantization below is a function
of data the output may depend on:
1. Stored operands Q, K, V, dO are quantized with a scale per (token, head) over the head dim
   ("token" scaling) or per 32 channels of one token ("block"): token-local, so a token's FP8
   bytes depend on that token alone. The Hadamard rotation of q and k is token-local too.
2. S = (sq_i sk_j) * (Qf_i . Kf_j): per-token scales of Q and K are a free row/column scaling.
3. P for O = P V (reduction over keys j) must carry V's per-token scale sv_j. We quantize
   A_ij = p_ij * (sv_j / cap_i) * 256 with p_ij = exp(S_ij - m_i) <= 1, where
   cap_i = max_{j <= i, same document} sv_j is a *causal prefix* maximum: a function of keys the
   row may see, so A_ij <= 256 without any scale reaching into the future. O_i is then
   cap_i / (256 l_i) * sum_j A_ij Vf_j. All ratios are powers of two, so folding is exact.
4. In-kernel operands of the backward (P^T for dV, dS for dQ and dK) are quantized with a scale
   per *output row* over the reduction dim, after folding in the partner's per-token scale:
   dQ_i  uses row i of dS*sk    : entries j > i are masked to exactly 0;
   dK_j  uses column j of dS*sq : entries i > t vanish when dO is zero after t (P1's backward
                                  premise), because dS_ij = P_ij (dO_i.V_j - dO_i.O_i) = 0;
   dV_j  uses column j of P*sdo : sdo_i = 0 for an all-zero dO row.
   An exact zero never changes an absolute maximum, so these scales see only what may matter.
   (Kernels compute the same maxima per tile, a subset of the row: also leak-free.)
5. Everything above is computed per document: no scale ever spans a document boundary.
The "tensor" scaling of the leaky control breaks 1, 3 and 4 on purpose.

Token-block scaling ("kvblock128": recipes fp8, fp8_mixed)
----------------------------------------------------------
What the fp8 kernels compute: one FP8 copy of each stored operand and one scalar scale per
kernel tile along every token reduction, instead of per-token scales folded into P and dS element
by element. Constants: KV_BLOCK = 128 (K/V scale block = the backward CTA's key block),
DO_BLOCK = 64 (dO scale block = the backward's query step).
- Blocks: a document's tokens are cut into blocks of KV_BLOCK from the document's first token;
  the last block of a document may be short; no block crosses cu_seqlens. Scales are powers of
  two from the block's amax over its tokens x head dim (per head), values e4m3 with saturation.
- Q: per (token, head) scale sq_i (a row scale of S). dO: per (64-token block, head).
- K, V: the *block copy* (scale skb, svb per (block, head)) and, causal only, the *token copy*
  (per-token scales skt_j, svt_j, as fp8_token's). Pair (i, j) is *diagonal* when key j <= query i
  lies in query i's block; diagonal pairs use the token copy, every other visible pair (j in an
  earlier block) the block copy. With KV_BLOCK = 128 a 128-row diagonal tile holds only diagonal
  (or masked) pairs, so each tile uses one copy and, off the diagonal, one K and one V scale.
  Non-causal attention has no diagonal pairs: the block copy everywhere.
- Forward, per query block (the rows of one KV block): S_ij = Q_i . Kc_j (Kc the pair's copy),
  m_i the row max, p_ij = exp(S_ij - m_i) <= 1, l_i = sum_j p_ij, and P rounded as in point 3
  above with sv(i, j) the pair's V scale: A_ij = round(p_ij * 256 * sv(i, j) / cap_i),
  cap_i = max of sv(i, j) over the visible pairs (a function of keys <= i: the block scales of
  earlier blocks and the token scales of the row's own block up to i), O_i = cap_i / (256 l_i)
  sum_j A_ij Vcf_j. The forward saves lse and the row max m (Saved.row_max): the backward's bound
  needs pmax_i = exp(m_i - lse_i), the largest normalised P of row i.
- Backward preprocess (`backward_scales`, the pass the kernels' preprocess mirrors):
  delta_i = dO_i . O_i (dO as the dP GEMM sees it); per (query head, row) the bounds
      |P_ij sdo_i| <= pmax_i sdo_i live_i                          (dV's operand)
      |dS_ij sqf_i| <= b_i sqf_i,  b_i = pmax_i (|dO_i| Vn_i + |delta_i|)   (dK's and dQ's)
  with |dO_i| the 2-norm of row i of the quantized dO, Vn_i the max 2-norm of the V copies row i
  sees (same visible-pair rule as cap_i), live_i = (dO_i != 0) and sqf_i = sq_i (1 for an all-zero
  Q row, whose FP8 bytes are zeros under any scale: a nonzero fold keeps its dQ). A CTA is one
  KV_BLOCK of keys of one KV head; causally it sees the query rows >= its first key, of every query
  head of its GQA group. Its scales c_pt, c_ds are the power-of-two scales (pow2_scale, e4m3's 448)
  of the max of those bounds over the rows it sees: a suffix max over query positions, taken at
  the block's first key (non-causal: the max over the document).
- Backward, per CTA (key block b), from the forward's quantized operands and lse:
  P = exp(S - lse), dP_ij = dO_i . Vc_j, dS = P (dP - delta).
  dV_b = c_pt * sum_i round(P_ij sdo_i / c_pt) dOf_i                  (one P^T copy per CTA)
  Y_ij = round(dS_ij sqf_i / c_ds): the shared dS copy, for both
  dK_b = scale * c_ds * sum_i Y_ij Qf_i  and, off the diagonal,
  dQ_i += scale * (c_ds skb / sqf_i) sum_j Y_ij Kbf_j   (skb: the block's K scale, a CTA scalar),
  on every row the CTA sees, the diagonal rows included: dQ reads K's block copy only (one dS
  copy, one K^T copy per CTA; a per-token K here would need a second dS copy scaled per key).
  Every quotient is bounded by 448 by construction (|P| <= pmax, |dP_ij| <= |dO_i| |Vc_j|), so
  nothing saturates beyond rounding. fp8_mixed: dP from the bf16 dO, delta with it, and the
  dS GEMMs in bf16 (no dS scale); dV as fp8.

Why P1 holds for the forward, bitwise. A shared scale reaches query t from keys > t only if the
block it covers holds such a key. Off-diagonal pairs (i, j) have block(j) < block(i): every key of
block(j) is before the first token of block(i), hence <= i, so skb, svb and the block bytes row i
multiplies depend only on keys <= i. Diagonal pairs use per-token bytes and scales (token-local).
cap_i is a max over scales of visible pairs only, each leak-free; masked entries are exact zeros
(S = -inf, P = 0, their weight set to 0). Q is per token and the rotation is token-local. So O_i,
m_i and lse_i are functions of tokens <= i.
Why P2 holds, bitwise, forward and gradients: blocks restart at every document start, the dO
blocks too, a CTA's row range and its suffix max stop at the document's end, and the emulation
runs document by document: no scale or sum ever mixes two documents.
Backward (the rule of issue 27, DESIGN.md P1): with dO zero after t, every P^T and dS entry of a
row after t is an exact zero (dO_i = 0 gives dP = 0, delta = 0, live = 0), so gradients after t
are exactly zero. Gradients at <= t *may* depend on later inputs through a backward scale shared
by several tokens (rounding level: no channel the forward can use at inference); the audit
measures that change and requires it below the recipe's own error against float64 (recipes with
`Recipe.shared_backward_scale`). In this spec dK and dV keep the prefix bitwise (dO's 64-block
scales are functions of dO alone; c_pt and c_ds are maxima over terms that are exact zeros for
rows after t: live_i = 0 and b_i = 0 there, and an exact zero never changes a max). dQ of a row
i <= t in t's own key block reads that block's K copy, whose scale and bytes depend on the
block's keys after t: that is the rounding-level dependence the relaxed rule admits, and the
tests measure it against the recipe's own error.
Per-element work this removes from the kernels' inner loops (the study's operation model,
benchmarks/scales_v2_study.py): extra instructions per score element on off-diagonal tiles,
forward 2 -> 0 and backward 14.5 -> 1 at D=128 (12 -> 0.5 at D=64); diagonal tiles keep per-token
work (forward 2, backward 4.5 at D=128). The costs: a second K/V copy, the bound pass, m saved.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import (
    E4M3_MAX, FORMAT_MAX, hadamard, pow2_scale, quantize_lastdim, quantize_nvfp4_lastdim,
    round_to_format, safe_reciprocal,
)
from .recipes import Recipe, get_recipe

P_SCALE = 256.0        # a row's largest P entry maps to 256: a power of two, well inside e4m3
MX_BLOCK = 32
KVBLOCK = "kvblock128" # the token-block scaling (module docstring, "Token-block scaling")
KV_BLOCK = 128         # tokens per K/V scale block = keys per backward CTA = forward query block
DO_BLOCK = 64          # tokens per dO scale block = query rows per backward step


def _ste(x: torch.Tensor, rounded: torch.Tensor, ste: bool) -> torch.Tensor:
    """Rounded values; with ste=True, gradients pass straight through the rounding."""
    return x + (rounded - x).detach() if ste else rounded


@dataclass
class Operand:
    """A quantized operand: `values` (what the tensor core multiplies) times `scale`.

    scale is None (bf16 / already-dequantized values), (T, H, 1) per token, (T, H, D) per block,
    or a (1, 1, 1) tensor-wide scale.
    """
    values: torch.Tensor
    scale: torch.Tensor | None
    granularity: str  # "none" | "token" | "block" | "tensor" | "tokenblock" (scale per block of tokens)

    def dequant(self) -> torch.Tensor:
        return self.values if self.scale is None else self.values * self.scale

    def token_scale(self) -> torch.Tensor | None:
        """(T, H) per-token scalar scale, when the operand has one (token, token-block or tensor
        scaling; a token-block scale is the same for every token of its block)."""
        if self.granularity in ("token", "tokenblock"):
            return self.scale[..., 0]
        if self.granularity == "tensor":
            return self.scale[..., 0].expand(self.values.shape[:2])
        return None

    def rows(self, a: int, b: int) -> "Operand":
        scale = self.scale if self.scale is None or self.granularity == "tensor" else self.scale[a:b]
        return Operand(self.values[a:b], scale, self.granularity)


def quantize_operand(x: torch.Tensor, fmt: str, scaling: str, ste: bool = False) -> Operand:
    """Quantize a stored operand (T, H, D) as the recipe says. See the module docstring."""
    if fmt == "bf16" or fmt == "none":
        rounded = round_to_format(x, "bf16") if fmt == "bf16" else x
        return Operand(_ste(x, rounded, ste), None, "none")
    if fmt == "nvfp4":
        with torch.no_grad():
            deq = quantize_nvfp4_lastdim(x.detach())
        return Operand(_ste(x, deq, ste), None, "block")
    if fmt == "mxfp8":
        with torch.no_grad():
            _, scale = quantize_lastdim(x.detach(), "e4m3", MX_BLOCK)
        return _scaled(x, scale, "e4m3", "block", ste)
    if fmt in ("e4m3", "e5m2"):
        with torch.no_grad():
            if scaling == "tensor":
                scale = pow2_scale(x.detach().abs().amax().reshape(1, 1, 1), FORMAT_MAX[fmt]).to(x.dtype)
            elif scaling == "token":
                _, scale = quantize_lastdim(x.detach(), fmt, None)
            else:
                raise ValueError(f"format {fmt} needs token or tensor scaling, not {scaling!r}")
        return _scaled(x, scale, fmt, scaling, ste)
    raise ValueError(f"unknown operand format {fmt!r}")


def _scaled(x, scale, fmt, granularity, ste) -> Operand:
    unscaled = x * safe_reciprocal(scale)
    return Operand(_ste(unscaled, round_to_format(unscaled.detach(), fmt), ste), scale, granularity)


def _doc_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _heads_first(x: torch.Tensor, group: int) -> torch.Tensor:
    """(L, H, D) -> (H * group, L, D): kv heads repeated for their query heads (GQA)."""
    return x.repeat_interleave(group, dim=1).transpose(0, 1)


def _causal_mask(L: int, device) -> torch.Tensor:
    return torch.ones(L, L, dtype=torch.bool, device=device).triu(1)


@dataclass
class Saved:
    """What the forward keeps for the backward: quantized operands, nothing else recomputed."""
    q: Operand
    k: Operand
    v: Operand
    rotation: torch.Tensor | None
    row_max: torch.Tensor       # (Hq, T) final row max m: lets the P3 check rebuild forward's P
    causal: bool
    # Token-block scaling only (None otherwise): the per-token copies of K and V used on diagonal
    # pairs (causal), and per token (T, Hkv): v_cap = cap_i (module docstring).
    k_diag: Operand | None = None
    v_diag: Operand | None = None
    v_cap: torch.Tensor | None = None


def forward(q, k, v, cu_seqlens, recipe: "str | Recipe" = "fp8", causal: bool = True,
            softmax_scale: float | None = None, compute_dtype=torch.float32, ste: bool = False):
    """Emulated forward. Returns (out (T, Hq, D) in compute_dtype, lse (Hq, T) fp32-or-compute, saved).

    ste=True makes every rounding straight-through, so autograd through this function gives the
    gradient the explicit `backward` must reproduce (property P3).
    """
    recipe = get_recipe(recipe)
    if recipe.scaling == KVBLOCK:
        return _forward_kvblock(q, k, v, cu_seqlens, recipe, causal, softmax_scale, compute_dtype, ste)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    qc, kc, vc = (x.to(compute_dtype) for x in (q, k, v))
    rotation = None
    if recipe.rotate_qk:
        rotation = hadamard(D, compute_dtype, q.device)
        qc, kc = qc @ rotation, kc @ rotation   # token-local, orthogonal: S is unchanged
    qo = quantize_operand(qc, recipe.qk, recipe.scaling, ste)
    ko = quantize_operand(kc, recipe.qk, recipe.scaling, ste)
    vo = quantize_operand(vc, recipe.v, recipe.scaling, ste)

    out = torch.zeros(T, Hq, D, dtype=compute_dtype, device=q.device)
    lse = torch.zeros(Hq, T, dtype=compute_dtype, device=q.device)
    outs, lses, row_max = [], [], []
    for a, b in _doc_bounds(cu_seqlens):
        L = b - a
        if L == 0:
            continue
        qd = qo.rows(a, b).dequant().transpose(0, 1)          # (Hq, L, D)
        kd = _heads_first(ko.rows(a, b).dequant(), group)     # (Hq, L, D)
        s = torch.einsum("hid,hjd->hij", qd, kd) * scale
        if causal:
            s = s.masked_fill(_causal_mask(L, q.device), float("-inf"))
        m = s.amax(-1, keepdim=True).detach()
        p = torch.exp(s - m)                                  # unnormalised, <= 1
        l = p.sum(-1, keepdim=True)                           # from unrounded p (as kernels do)
        o = _round_p(p, vo.rows(a, b), recipe, group, causal, ste) @ _heads_first(vo.rows(a, b).dequant(), group)
        row_max.append(m.squeeze(-1))
        outs.append((o / l).transpose(0, 1))
        lses.append((m + torch.log(l)).squeeze(-1))
    # Concatenate (no in-place writes, so autograd with ste=True sees one graph). Documents tile
    # the packed tokens in order; empty documents contribute nothing.
    m_all = torch.zeros(Hq, T, dtype=compute_dtype, device=q.device)
    if outs:
        out = torch.cat(outs, 0)
        lse = torch.cat(lses, 1)
        m_all = torch.cat(row_max, 1).detach()
    return out, lse, Saved(qo, ko, vo, rotation, m_all, causal)


def _v_cap(sv: torch.Tensor, causal: bool) -> torch.Tensor:
    """cap_i: max of V's per-token scales over the keys row i may see (heads first: (H, L))."""
    if causal:
        return torch.cummax(sv, dim=-1).values
    return sv.amax(-1, keepdim=True).expand_as(sv)


def _round_p(p, vo: Operand, recipe: Recipe, group: int, causal: bool, ste: bool):
    """The forward's rounding of P for O = P V, as effective values: O_i = sum_j p_eff_ij V_j.

    p (H, L, L) is exp(S - m) <= 1 with m the row max. For per-token FP8 the kernel multiplies
    round(p_ij * w_ij * 256) by the FP8 values of V and rescales rows by cap_i / 256
    (module docstring, point 3); here that is written as p_eff = round(p w 256) / (w 256), the
    same number because w is a power of two.
    """
    if recipe.p == "none":
        return p
    if recipe.p == "bf16":
        return _ste(p, round_to_format(p.detach(), "bf16"), ste)
    if recipe.p == "mxfp8":
        # MX blocks of 32 keys along the row (row-local: safe), aligned to the document start.
        with torch.no_grad():
            _, blk = quantize_lastdim(p.detach(), "e4m3", MX_BLOCK)
        return _ste(p, round_to_format(p.detach() * safe_reciprocal(blk), "e4m3") * blk, ste)
    if recipe.p in ("e4m3", "e5m2"):
        sv = vo.token_scale()
        if sv is None:
            raise ValueError(f"recipe {recipe.name}: P in {recipe.p} needs V with a per-token scale")
        sv = sv.repeat_interleave(group, dim=1).transpose(0, 1)     # (H, L)
        cap = _v_cap(sv, causal)                                      # (H, L)
        w = sv[:, None, :] * safe_reciprocal(cap)[:, :, None] * P_SCALE  # (H, i, j): 2^k * 256
        with torch.no_grad():
            rounded = round_to_format(p.detach() * w, recipe.p) * safe_reciprocal(w)
        return _ste(p, rounded, ste)
    raise ValueError(f"unknown P format {recipe.p!r}")


def _reduce_over_tokens(a: torch.Tensor, partner: Operand, fmt: str, group: int, tensor_amax=None):
    """result = A @ partner for A (H, M, R) reducing over the R tokens of `partner` (R, Hp, D).

    The partner keeps its forward quantization (its FP8 values are reused as they are). A is
    quantized here in `fmt` with one scale per output row m over R, after folding in the
    partner's per-token scale (module docstring, point 4).
    """
    if fmt in ("none", "bf16"):
        aq = a if fmt == "none" else round_to_format(a, "bf16")
        return aq @ _heads_first(partner.dequant(), group)
    if fmt == "mxfp8":
        # An MX block of 32 reduction tokens shares one scale. Entries facing an all-zero partner
        # row contribute nothing to the product, so zero them before taking the block amax:
        # otherwise (dV with dO zero after t) P's values of future rows would set the scale of
        # past rows' entries -- a causal leak that only the scale carries.
        live = (partner.dequant() != 0).any(-1).repeat_interleave(group, 1).transpose(0, 1)
        a = a * live[:, None, :]
        _, blk = quantize_lastdim(a, "e4m3", MX_BLOCK)
        aq = round_to_format(a * safe_reciprocal(blk), "e4m3") * blk
        return aq @ _heads_first(partner.dequant(), group)
    s = partner.token_scale()
    if s is None:   # partner without per-token scales (bf16): nothing to fold
        folded, partner_values = a, partner.dequant()
    else:
        s = s.repeat_interleave(group, dim=1).transpose(0, 1)       # (H, R)
        folded, partner_values = a * s[:, None, :], partner.values
    amax = folded.abs().amax(-1, keepdim=True) if tensor_amax is None else tensor_amax
    row_scale = pow2_scale(amax, FORMAT_MAX[fmt]).to(a.dtype)
    aq = round_to_format(folded * safe_reciprocal(row_scale), fmt)
    return (aq @ _heads_first(partner_values, group)) * row_scale


def backward(dout, out, lse, saved: Saved, cu_seqlens, recipe: "str | Recipe" = "fp8",
             causal: bool = True, softmax_scale: float | None = None, compute_dtype=torch.float32,
             quantize_backward: bool = True):
    """Explicit backward from the forward's quantized operands and LSE.

    dout, out: (T, Hq, D) as the user sees them (out is the forward's rounded output).
    Returns dq (T, Hq, D), dk, dv (T, Hkv, D) in compute_dtype.
    quantize_backward=False keeps every backward-only operand (dO, P, dP, dS) exact; then the
    result must equal autograd through `forward(..., ste=True)` (property P3).
    """
    recipe = get_recipe(recipe)
    if recipe.scaling == KVBLOCK:
        return _backward_kvblock(dout, out, lse, saved, cu_seqlens, recipe, causal, softmax_scale,
                                 compute_dtype, quantize_backward)
    T, Hq, D = dout.shape
    Hkv = saved.k.values.shape[1]
    group = Hq // Hkv
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    do_c, o_c = dout.to(compute_dtype), out.to(compute_dtype)
    tensorwise = recipe.scaling == "tensor"
    if quantize_backward:
        doo = quantize_operand(do_c, recipe.do, recipe.scaling)
        fmt_p, fmt_ds = recipe.p, recipe.ds
    else:
        doo = quantize_operand(do_c, "none", "none")
        fmt_p = fmt_ds = "none"

    dq = torch.zeros(T, Hq, D, dtype=compute_dtype, device=dout.device)
    dk = torch.zeros(T, Hkv, D, dtype=compute_dtype, device=dout.device)
    dv = torch.zeros(T, Hkv, D, dtype=compute_dtype, device=dout.device)
    for a, b in _doc_bounds(cu_seqlens):
        L = b - a
        if L == 0:
            continue
        qo, ko, vo, dop = saved.q.rows(a, b), saved.k.rows(a, b), saved.v.rows(a, b), doo.rows(a, b)
        qd = qo.dequant().transpose(0, 1)
        kd = _heads_first(ko.dequant(), group)
        s = torch.einsum("hid,hjd->hij", qd, kd) * scale
        if causal:
            s = s.masked_fill(_causal_mask(L, dout.device), float("-inf"))
        p = torch.exp(s - lse[:, a:b, None].to(compute_dtype))           # normalised P
        vd = _heads_first(vo.dequant(), group)
        if quantize_backward and recipe.dp == "fp8":
            do_dp = dop.dequant()
        elif quantize_backward:  # bf16 dP GEMM: dO in bf16, V's dequantized FP8 exact in bf16
            do_dp, vd = round_to_format(do_c[a:b], "bf16"), round_to_format(vd, "bf16")
        else:
            do_dp = do_c[a:b]
        dp = do_dp.transpose(0, 1) @ vd.transpose(1, 2)
        # D_i = dO_i . O_i with the *same* dO the dP GEMM used: dS_ij = P_ij dO_i.(V_j - O_i)
        # then cancels dO's rounding exactly (D = sum_j P_ij dP_ij up to V's rounding), which
        # matters when attention is peaked and dP_ij - D_i is a small difference of large terms.
        delta = (do_dp * o_c[a:b]).sum(-1).transpose(0, 1)
        ds = p * (dp - delta[..., None])                                  # (H, i, j)

        def tensor_amax(a_mat, partner, g):
            # Leaky control only: one scale over the whole document, every head.
            if not (tensorwise and quantize_backward):
                return None
            return (a_mat * _tok(partner, g)[:, None, :]).abs().amax()

        if quantize_backward:
            pt = p.transpose(1, 2)                                        # (H, j, i)
        else:  # exactly the P the forward multiplied V with (P3: autograd's dV)
            m = saved.row_max[:, a:b, None]
            p_fwd = _round_p(torch.exp(s - m), vo, recipe, group, causal, False)
            pt = (p_fwd * torch.exp(m - lse[:, a:b, None].to(compute_dtype))).transpose(1, 2)
        dv_h = _reduce_over_tokens(pt, dop, fmt_p, 1, tensor_amax(pt, dop, 1))
        dq_h = scale * _reduce_over_tokens(ds, ko, fmt_ds, group, tensor_amax(ds, ko, group))
        dst = ds.transpose(1, 2)
        # dK_j = sum_i dS_ij Q_i: Q's heads are the query heads themselves (group of 1).
        dk_h = scale * _reduce_over_tokens(dst, qo, fmt_ds, 1, tensor_amax(dst, qo, 1))
        dq[a:b] = dq_h.transpose(0, 1)
        dk[a:b] = dk_h.reshape(Hkv, group, L, D).sum(1).transpose(0, 1)
        dv[a:b] = dv_h.reshape(Hkv, group, L, D).sum(1).transpose(0, 1)
    if saved.rotation is not None:   # back from the rotated space: d(xH)/dx = H^T
        dq = dq @ saved.rotation.T
        dk = dk @ saved.rotation.T
    return dq, dk, dv


def _tok(op: Operand, group: int):
    s = op.token_scale()
    if s is None:
        return torch.ones(op.values.shape[1] * group, op.values.shape[0], dtype=op.values.dtype,
                          device=op.values.device)
    return s.repeat_interleave(group, dim=1).transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# Token-block scaling ("kvblock128"): the module docstring's "Token-block scaling" section.

def token_blocks(cu_seqlens: torch.Tensor, block: int = KV_BLOCK) -> tuple[torch.Tensor, int]:
    """(ids (T,), n): the global index of each token's document-local block of `block` tokens
    (blocks restart at every document start and are numbered in token order), and their number."""
    ids, base = [], 0
    for a, b in _doc_bounds(cu_seqlens):
        ids.append(base + torch.arange(b - a, device=cu_seqlens.device) // block)
        base += -(-(b - a) // block)
    ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long, device=cu_seqlens.device)
    return ids, base


def quantize_token_blocks(x: torch.Tensor, fmt: str, cu_seqlens: torch.Tensor, block: int,
                          ste: bool = False) -> Operand:
    """x (T, H, D) with one power-of-two scale per (document-local block of tokens, head) over the
    block's tokens x D values. The scale is stored per token, (T, H, 1), equal within a block."""
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"token-block scaling quantizes to e4m3 / e5m2, not {fmt!r}")
    with torch.no_grad():
        ids, n = token_blocks(cu_seqlens, block)
        tok = x.detach().abs().amax(-1)                                   # (T, H)
        amax = tok.new_zeros(n, x.shape[1]).scatter_reduce(
            0, ids[:, None].expand_as(tok), tok, "amax", include_self=False)
        scale = pow2_scale(amax, FORMAT_MAX[fmt]).to(x.dtype)[ids][..., None]
    return _scaled(x, scale, fmt, "tokenblock", ste)


def diagonal_pairs(L: int, causal: bool = True, device=None, block: int = KV_BLOCK) -> torch.Tensor:
    """(L, L) bool for one document: pair (i, j) is diagonal when key j <= query i lies in query
    i's block (these pairs use the per-token K/V copies); none when not causal."""
    pos = torch.arange(L, device=device)
    if not causal:
        return torch.zeros(L, L, dtype=torch.bool, device=device)
    return (pos[:, None] // block == pos[None, :] // block) & (pos[None, :] <= pos[:, None])


def _visible_max(off: torch.Tensor, diag: torch.Tensor | None, causal: bool,
                 block: int = KV_BLOCK) -> torch.Tensor:
    """Per query row of one document, the max over the pairs it sees of a nonnegative per-key
    quantity: `off` (L, H) for the block copy, `diag` (L, H) for the token copy. Causal: max of
    `off` over the blocks before the row's block and of `diag` over the row's block up to the
    row; otherwise the max of `off` over the document."""
    L, H = off.shape
    if L == 0:
        return off
    if not causal:
        return off.amax(0, keepdim=True).expand(L, H)
    nb = -(-L // block)
    pad = nb * block - L
    offb = torch.nn.functional.pad(off, (0, 0, 0, pad)).reshape(nb, block, H)
    diagb = torch.nn.functional.pad(diag, (0, 0, 0, pad)).reshape(nb, block, H)
    blockmax = offb.amax(1)                                               # (nb, H)
    before = torch.cat([torch.zeros_like(blockmax[:1]),
                        torch.cummax(blockmax, 0).values[:-1]], 0)       # blocks < b
    within = torch.cummax(diagb, 1).values                                # own block, up to the row
    return torch.maximum(before[:, None, :], within).reshape(nb * block, H)[:L]


def _per_document(cu_seqlens, fn, *xs):
    """Apply fn to each document's rows of the (T, ...) tensors xs and concatenate the results."""
    parts = [fn(*(x[a:b] for x in xs)) for a, b in _doc_bounds(cu_seqlens)]
    return torch.cat(parts, 0) if parts else xs[0][:0]


def _check_kvblock_recipe(recipe: Recipe) -> None:
    ok = (recipe.qk in ("e4m3", "e5m2") and recipe.v in ("e4m3", "e5m2")
          and recipe.p in ("e4m3", "e5m2") and recipe.do in ("e4m3", "e5m2")
          and recipe.dp in ("fp8", "bf16") and recipe.ds in ("e4m3", "e5m2", "bf16"))
    if not ok:
        raise ValueError(f"recipe {recipe.name}: {KVBLOCK} scaling needs FP8 q, k, v, P and dO, "
                         f"dP 'fp8' or 'bf16' and dS in FP8 or bf16")


def _forward_kvblock(q, k, v, cu_seqlens, recipe: Recipe, causal, softmax_scale, compute_dtype, ste):
    """forward() for the token-block scaling, one 128-row query block at a time (a forward CTA):
    off-diagonal key tiles with the block copies, the diagonal tile with the token copies."""
    _check_kvblock_recipe(recipe)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    B = KV_BLOCK
    qc, kc, vc = (x.to(compute_dtype) for x in (q, k, v))
    rotation = None
    if recipe.rotate_qk:
        rotation = hadamard(D, compute_dtype, q.device)
        qc, kc = qc @ rotation, kc @ rotation
    # The quantize pass: Q per token; K, V per block, and per token for the diagonal pairs.
    qo = quantize_operand(qc, recipe.qk, "token", ste)
    ko = quantize_token_blocks(kc, recipe.qk, cu_seqlens, B, ste)
    vo = quantize_token_blocks(vc, recipe.v, cu_seqlens, B, ste)
    kt = quantize_operand(kc, recipe.qk, "token", ste) if causal else None
    vt = quantize_operand(vc, recipe.v, "token", ste) if causal else None
    with torch.no_grad():
        svt = vt.token_scale() if causal else None
        v_cap = _per_document(cu_seqlens, lambda o, d: _visible_max(o, d, causal),
                              vo.token_scale(), svt if causal else vo.token_scale())

    outs, lses, row_max = [], [], []
    for a, b in _doc_bounds(cu_seqlens):
        L = b - a
        if L == 0:
            continue
        qd = qo.rows(a, b).dequant().transpose(0, 1)                      # (Hq, L, D)
        kbd = _heads_first(ko.rows(a, b).dequant(), group)
        vbd = _heads_first(vo.rows(a, b).dequant(), group)
        svb = _heads_first(vo.rows(a, b).scale, group)[..., 0]           # (Hq, L) per key
        cap = _heads_first(v_cap[a:b, :, None], group)[..., 0]           # (Hq, L) per query
        if causal:
            ktd = _heads_first(kt.rows(a, b).dequant(), group)
            vtd = _heads_first(vt.rows(a, b).dequant(), group)
            svd = _heads_first(vt.rows(a, b).scale, group)[..., 0]
        for r0 in range(0, L, B):
            r1 = min(r0 + B, L)
            qr = qd[:, r0:r1]
            if causal:   # keys [0, r0): block copies; the diagonal tile [r0, r1): token copies
                masked = _causal_mask(r1 - r0, q.device)
                s = torch.cat([qr @ kbd[:, :r0].transpose(1, 2),
                               (qr @ ktd[:, r0:r1].transpose(1, 2)).masked_fill(masked, float("-inf"))],
                              -1) * scale
                sv = torch.cat([svb[:, None, :r0].expand(-1, r1 - r0, -1),
                                svd[:, None, r0:r1].masked_fill(masked, 0)], -1)   # (Hq, rows, keys)
            else:
                s = (qr @ kbd.transpose(1, 2)) * scale
                sv = svb[:, None, :]
            m = s.amax(-1, keepdim=True).detach()
            p = torch.exp(s - m)
            l = p.sum(-1, keepdim=True)
            w = sv * safe_reciprocal(cap[:, r0:r1, None]) * P_SCALE
            with torch.no_grad():
                rounded = round_to_format(p.detach() * w, recipe.p) * safe_reciprocal(w)
            pe = _ste(p, rounded, ste)
            if causal:
                o = pe[..., :r0] @ vbd[:, :r0] + pe[..., r0:] @ vtd[:, r0:r1]
            else:
                o = pe @ vbd
            outs.append((o / l).transpose(0, 1))
            lses.append((m + torch.log(l)).squeeze(-1))
            row_max.append(m.squeeze(-1))
    out = torch.zeros(T, Hq, D, dtype=compute_dtype, device=q.device)
    lse = torch.zeros(Hq, T, dtype=compute_dtype, device=q.device)
    m_all = torch.zeros(Hq, T, dtype=compute_dtype, device=q.device)
    if outs:
        out, lse, m_all = torch.cat(outs, 0), torch.cat(lses, 1), torch.cat(row_max, 1).detach()
    return out, lse, Saved(qo, ko, vo, rotation, m_all, causal, kt, vt, v_cap)


@dataclass
class BackwardScales:
    """What the backward's preprocess computes for the token-block scaling (backward_scales).

    delta (Hq, T): D_i = dO_i . O_i, with the dO of the dP GEMM.
    pt, ds (Hkv, n_blocks): per CTA (KV head, document-local KV block; `token_blocks` numbers
    them), the power-of-two scale of dV's P^T copy and of the shared dS copy.
    row_pt, row_ds (Hq, T): the per-row bounds they are the maxima of (pmax_i sdo_i live_i and
    b_i sqf_i).
    sdo, sqf (Hq, T): the per-row folds of the main pass, sdo_i live_i and sqf_i.
    """
    delta: torch.Tensor
    pt: torch.Tensor
    ds: torch.Tensor
    row_pt: torch.Tensor
    row_ds: torch.Tensor
    sdo: torch.Tensor
    sqf: torch.Tensor


def cta_scales(row_bound: torch.Tensor, cu_seqlens: torch.Tensor, group: int, causal: bool,
               fmt_max: float, block: int = KV_BLOCK) -> torch.Tensor:
    """(Hkv, n_blocks) power-of-two CTA scales from per-(query head, row) bounds (Hq, T).

    A CTA (KV head g, key block [k0, k0 + block) of a document) sees, causally, the rows
    i >= k0 of the document, of the `group` query heads of g: its scale covers the max of their
    bounds, a suffix max over query positions taken at k0 (non-causal: the document's max).
    """
    Hq, T = row_bound.shape
    g = row_bound.reshape(Hq // group, group, T).amax(1)                 # (Hkv, T)
    out = []
    for a, b in _doc_bounds(cu_seqlens):
        if b == a:
            continue
        gd = g[:, a:b]
        if causal:
            suffix = torch.flip(torch.cummax(torch.flip(gd, [-1]), -1).values, [-1])
            out.append(suffix[:, ::block])
        else:
            out.append(gd.amax(-1, keepdim=True).expand(-1, -(-(b - a) // block)))
    if not out:
        return row_bound.new_zeros(Hq // group, 0)
    return pow2_scale(torch.cat(out, -1), fmt_max).to(row_bound.dtype)


def backward_scales(do_q: Operand, do_dp: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    saved: Saved, cu_seqlens: torch.Tensor, causal: bool, fmt_p: str = "e4m3",
                    fmt_ds: str = "e4m3") -> BackwardScales:
    """The backward's preprocess for the token-block scaling (the pass the kernels mirror).

    do_q: the quantized dO (64-token blocks); do_dp (T, Hq, D): the dO the dP GEMM uses (do_q's
    dequantized values, or bf16 dO for a bf16 dP); out: the forward's output as the user got it.
    Per row: pmax_i = exp(m_i - lse_i) (m: the forward's row max, Saved.row_max), live_i, sqf_i,
    |dO_i|, Vn_i, delta_i, the bounds, then the CTA scales (cta_scales). Module docstring.
    """
    T, Hq, D = do_dp.shape
    Hkv = saved.k.values.shape[1]
    group = Hq // Hkv
    dt = do_dp.dtype
    delta = (do_dp * out.to(dt)).sum(-1).transpose(0, 1)                  # (Hq, T)
    pmax = torch.exp(saved.row_max.to(dt) - lse.to(dt))
    live = (do_q.values != 0).any(-1).transpose(0, 1)
    sdo = do_q.token_scale().transpose(0, 1) * live
    sq = saved.q.token_scale().transpose(0, 1)
    sqf = torch.where(sq > 0, sq, torch.ones_like(sq))
    vnb = saved.v.dequant().norm(dim=-1)                                  # (T, Hkv)
    vnt = saved.v_diag.dequant().norm(dim=-1) if causal else vnb
    vn = _per_document(cu_seqlens, lambda o, d: _visible_max(o, d, causal), vnb, vnt)
    vn = vn.repeat_interleave(group, 1).transpose(0, 1)                   # (Hq, T)
    row_pt = pmax * sdo
    row_ds = pmax * (do_dp.norm(dim=-1).transpose(0, 1) * vn + delta.abs()) * sqf
    pt = cta_scales(row_pt, cu_seqlens, group, causal, FORMAT_MAX[fmt_p])
    ds = (cta_scales(row_ds, cu_seqlens, group, causal, FORMAT_MAX[fmt_ds])
          if fmt_ds in FORMAT_MAX else torch.zeros_like(pt))
    return BackwardScales(delta, pt, ds, row_pt, row_ds, sdo, sqf)


def _backward_kvblock(dout, out, lse, saved: Saved, cu_seqlens, recipe: Recipe, causal,
                      softmax_scale, compute_dtype, quantize_backward):
    """backward() for the token-block scaling: the preprocess, then one CTA per (document-local
    key block, all heads): diagonal rows with the token copies, later rows with the block copies."""
    _check_kvblock_recipe(recipe)
    T, Hq, D = dout.shape
    Hkv = saved.k.values.shape[1]
    group = Hq // Hkv
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    B = KV_BLOCK
    dev = dout.device
    do_c, o_c = dout.to(compute_dtype), out.to(compute_dtype)
    lse = lse.to(compute_dtype)
    if quantize_backward:
        doo = quantize_token_blocks(do_c, recipe.do, cu_seqlens, DO_BLOCK)
        do_dp = doo.dequant() if recipe.dp == "fp8" else round_to_format(do_c, "bf16")
        sc = backward_scales(doo, do_dp, o_c, lse, saved, cu_seqlens, causal, recipe.p, recipe.ds)
        delta, sdo_live, sqf = sc.delta, sc.sdo, sc.sqf
        fp8_ds = recipe.ds != "bf16"
    else:   # P3: backward-only rounding off, dO exact
        do_dp = do_c
        delta = (do_dp * o_c).sum(-1).transpose(0, 1)
    blk, _ = token_blocks(cu_seqlens, B)
    kv_head = torch.arange(Hq, device=dev) // group                   # each query head's KV head

    dq = torch.zeros(Hq, T, D, dtype=compute_dtype, device=dev)   # heads first; in dQ's units
    dk = torch.zeros(T, Hkv, D, dtype=compute_dtype, device=dev)
    dv = torch.zeros(T, Hkv, D, dtype=compute_dtype, device=dev)
    for a, b in _doc_bounds(cu_seqlens):
        L = b - a
        if L == 0:
            continue
        hf = lambda x: _heads_first(x, group)                               # noqa: E731
        qo, ko, vo = saved.q.rows(a, b), saved.k.rows(a, b), saved.v.rows(a, b)
        qd = qo.dequant().transpose(0, 1)                                    # (Hq, L, D)
        kbd, vbd = hf(ko.dequant()), hf(vo.dequant())
        if causal:
            kto, vto = saved.k_diag.rows(a, b), saved.v_diag.rows(a, b)
            ktd, vtd = hf(kto.dequant()), hf(vto.dequant())
        if quantize_backward and recipe.dp == "bf16":   # bf16 dP GEMM (V's FP8 values exact in bf16)
            vbd_dp = round_to_format(vbd, "bf16")
            vtd_dp = round_to_format(vtd, "bf16") if causal else None
        else:
            vbd_dp, vtd_dp = vbd, (vtd if causal else None)
        dod = do_dp[a:b].transpose(0, 1)
        lse_d, delta_d = lse[:, a:b, None], delta[:, a:b, None]
        if quantize_backward:
            qv = qo.values.transpose(0, 1)
            dov = doo.values[a:b].transpose(0, 1)
            sqf_d = sqf[:, a:b, None]
            kbv = hf(ko.values)
            skb = hf(ko.scale)[..., 0]
        else:   # the forward's P rounding, rebuilt (P3: autograd's dV uses it)
            m_d = saved.row_max[:, a:b, None].to(compute_dtype)
            cap = hf(saved.v_cap[a:b, :, None])                              # (Hq, L, 1)
            svb = hf(vo.scale)[..., 0]
            if causal:
                svd = hf(vto.scale)[..., 0]
        for c0 in range(0, L, B):                                            # one CTA
            c1 = min(c0 + B, L)
            n = int(blk[a + c0])
            r0 = c0 if causal else 0                                         # its first query row
            if causal:   # rows [c0, c1): diagonal (token copies); rows [c1, L): block copies
                masked = _causal_mask(c1 - c0, dev)
                s_diag = (qd[:, c0:c1] @ ktd[:, c0:c1].transpose(1, 2)).masked_fill(masked, float("-inf"))
                s = torch.cat([s_diag, qd[:, c1:] @ kbd[:, c0:c1].transpose(1, 2)], 1) * scale
                dp = torch.cat([dod[:, c0:c1] @ vtd_dp[:, c0:c1].transpose(1, 2),
                                dod[:, c1:] @ vbd_dp[:, c0:c1].transpose(1, 2)], 1)
            else:
                s = (qd @ kbd[:, c0:c1].transpose(1, 2)) * scale
                dp = dod @ vbd_dp[:, c0:c1].transpose(1, 2)
            p = torch.exp(s - lse_d[:, r0:])                                 # (Hq, rows, keys)
            ds = p * (dp - delta_d[:, r0:])
            nd = c1 - c0 if causal else 0                                    # diagonal rows
            if not quantize_backward:
                m = m_d[:, r0:]
                if causal:
                    sv = torch.cat([svd[:, None, c0:c1].expand(-1, nd, -1).masked_fill(masked, 0),
                                    svb[:, None, c0:c1].expand(-1, L - c1, -1)], 1)
                else:
                    sv = svb[:, None, c0:c1]
                w = sv * safe_reciprocal(cap[:, r0:]) * P_SCALE
                pf = torch.exp(s - m)
                pt = round_to_format(pf * w, recipe.p) * safe_reciprocal(w) * torch.exp(m - lse_d[:, r0:])
                dv_h = pt.transpose(1, 2) @ dod[:, r0:]
                dk_h = scale * (ds.transpose(1, 2) @ qd[:, r0:])
                if causal:
                    dq[:, a + c0:a + c1] += ds[:, :nd] @ ktd[:, c0:c1]
                    dq[:, a + c1:b] += ds[:, nd:] @ kbd[:, c0:c1]
                else:
                    dq[:, a:b] += ds @ kbd[:, c0:c1]
            else:
                c_pt = sc.pt[kv_head, n][:, None, None]
                c_ds = sc.ds[kv_head, n][:, None, None]
                # dV = P^T dO: one P^T copy per CTA, dO's 64-block scale folded per row
                xq = round_to_format(p * sdo_live[:, a + r0:b, None] * safe_reciprocal(c_pt), recipe.p)
                dv_h = c_pt * (xq.transpose(1, 2) @ dov[:, r0:])
                if fp8_ds:
                    # The shared dS copy: dK from it, and dQ on the rows of later blocks.
                    y = round_to_format(ds * sqf_d[:, r0:] * safe_reciprocal(c_ds), recipe.ds)
                    dk_h = scale * c_ds * (y.transpose(1, 2) @ qv[:, r0:])
                    units = c_ds * skb[:, c0, None, None]                    # c_ds skb: CTA scalars
                    dq[:, a + r0:b] += units * (y @ kbv[:, c0:c1])
                else:   # bf16 dS GEMMs (fp8_mixed)
                    dsb = round_to_format(ds, "bf16")
                    dk_h = scale * (dsb.transpose(1, 2) @ qd[:, r0:])
                    dq[:, a + r0:b] += dsb @ kbd[:, c0:c1]
            dk[a + c0:a + c1] = dk_h.reshape(Hkv, group, c1 - c0, D).sum(1).transpose(0, 1)
            dv[a + c0:a + c1] = dv_h.reshape(Hkv, group, c1 - c0, D).sum(1).transpose(0, 1)
    # The post pass: dQ out of its units (the softmax scale; 1 / sqf_i for the FP8 dS copies) and
    # heads back in place.
    dq = dq * scale
    if quantize_backward and fp8_ds:
        dq = dq * (1.0 / sqf)[..., None]
    dq = dq.transpose(0, 1)
    if saved.rotation is not None:
        dq = dq @ saved.rotation.T
        dk = dk @ saved.rotation.T
    return dq, dk, dv


def attention_exact(q, k, v, cu_seqlens, causal: bool = True, softmax_scale: float | None = None,
                    dtype=torch.float64) -> torch.Tensor:
    """Plain softmax attention in `dtype` (float64: the ground truth). Differentiable."""
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    pieces = [q.new_zeros((0, Hq, D), dtype=dtype)]
    for a, b in _doc_bounds(cu_seqlens):
        L = b - a
        if L == 0:
            continue
        qd = q[a:b].to(dtype).transpose(0, 1)
        kd = _heads_first(k[a:b].to(dtype), group)
        vd = _heads_first(v[a:b].to(dtype), group)
        s = torch.einsum("hid,hjd->hij", qd, kd) * scale
        if causal:
            s = s.masked_fill(_causal_mask(L, q.device), float("-inf"))
        pieces.append((torch.softmax(s, -1) @ vd).transpose(0, 1))
    return torch.cat(pieces, 0)


def lse_exact(q, k, cu_seqlens, causal: bool = True, softmax_scale: float | None = None,
              dtype=torch.float64) -> torch.Tensor:
    """(Hq, T) natural-log softmax denominators of the scaled scores in `dtype` (float64: the
    ground truth the kernels' LSE is judged against, like attention_exact for O)."""
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    out = q.new_full((Hq, T), float("-inf"), dtype=dtype)
    for a, b in _doc_bounds(cu_seqlens):
        L = b - a
        if L == 0:
            continue
        qd = q[a:b].to(dtype).transpose(0, 1)
        kd = _heads_first(k[a:b].to(dtype), group)
        s = torch.einsum("hid,hjd->hij", qd, kd) * scale
        if causal:
            s = s.masked_fill(_causal_mask(L, q.device), float("-inf"))
        out[:, a:b] = torch.logsumexp(s, -1)
    return out


class ReferenceAttention(torch.autograd.Function):
    """Autograd wrapper: forward() emulation + explicit backward(), as the kernels will do."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, recipe, causal, softmax_scale, compute_dtype):
        out, lse, saved = forward(q, k, v, cu_seqlens, recipe, causal, softmax_scale, compute_dtype)
        out = out.to(q.dtype)
        ctx.saved_quant = saved
        ctx.save_for_backward(out, lse, cu_seqlens)
        ctx.cfg = (recipe, causal, softmax_scale, compute_dtype, q.dtype, k.dtype)
        lse = lse.float()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        out, lse, cu_seqlens = ctx.saved_tensors
        recipe, causal, softmax_scale, compute_dtype, qdt, kdt = ctx.cfg
        dq, dk, dv = backward(dout, out, lse, ctx.saved_quant, cu_seqlens, recipe, causal,
                              softmax_scale, compute_dtype)
        return dq.to(qdt), dk.to(kdt), dv.to(kdt), None, None, None, None, None
