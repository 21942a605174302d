"""The numerics specification of every recipe, in plain PyTorch (CPU or GPU).

Read this file to know exactly what flamia computes. Forward and backward are written out in the
data flow the kernels have: quantize Q, K, V once (document-local, token-local scales); S; P and
its rounding; LSE; O. Backward from the saved quantized operands and the forward's LSE:
D = rowsum(dO * O), dP, dS, dV, dQ, dK.

Layout: packed tokens, q (T, Hq, D), k and v (T, Hkv, D), int32 cu_seqlens (n_docs + 1,); GQA
when Hkv divides Hq (query head h reads kv head h // (Hq // Hkv)). Internally a document's
attention is dense: S is (H, L, L) for a document of L tokens.

Why every safe recipe satisfies P1 (causal prefix invariance) and P2 (document isolation) by
construction -- each quantization below is a function of data the output may depend on:
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
    granularity: str  # "none" | "token" | "block" | "tensor"

    def dequant(self) -> torch.Tensor:
        return self.values if self.scale is None else self.values * self.scale

    def token_scale(self) -> torch.Tensor | None:
        """(T, H) per-token scalar scale, when the operand has one (token or tensor scaling)."""
        if self.granularity == "token":
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


def forward(q, k, v, cu_seqlens, recipe: "str | Recipe" = "fp8", causal: bool = True,
            softmax_scale: float | None = None, compute_dtype=torch.float32, ste: bool = False):
    """Emulated forward. Returns (out (T, Hq, D) in compute_dtype, lse (Hq, T) fp32-or-compute, saved).

    ste=True makes every rounding straight-through, so autograd through this function gives the
    gradient the explicit `backward` must reproduce (property P3).
    """
    recipe = get_recipe(recipe)
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
