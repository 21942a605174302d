"""Scales v2 study (issue 27): which scaling scheme should the fp8 recipe use?

(Its answer, candidate 3c, is today's fp8 recipe: token-block scaling, flamia/reference.py
"Token-block scaling". Candidate 0, the per-token scheme that fp8 was when the study ran, is
the emulated recipe fp8_token now; "today" below means at the time of the study.)

A self-contained CPU emulation (float32 arithmetic with exact e4m3 rounding, float64 truth) of
candidate scaling schemes for the fp8 recipe, in the data flow of the kernels that will run them:
a forward with 64/128-query x 128-key tiles, and the one-pass Hopper backward
(flamia/ops/backward_sm90.py: one CTA per 128-key block and KV head, two MMA warpgroups of 64 keys
each, 64-query steps; S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, dQ = dS K).
It does not touch flamia/reference.py; candidate 0 is checked against its fp8_token recipe.

    PYTHONPATH=. .venv/bin/python benchmarks/scales_v2_study.py [--quick]

Cases: T=1024 one document, 8 query / 2 KV heads, D=128, causal (the issue's shape; seeds 0-3),
a packed case (documents of 333, 1, 0, 190, 64, 129, 307 tokens) at D=64, 8/2 heads, to check
that every block is document-local, and one document of 8192 tokens (1 head, D=128) for the
backward's scale variants, whose bounds loosen as documents grow. Inputs: flamia.inputs.make_qkv families `mild` and `outliers`, bf16,
seed 0, dO standard normal (seed 1), as in tests/test_reference.py. Reported: relative Frobenius
error vs float64 of O, dQ, dK, dV (outputs rounded to bf16, as the user sees them).

Numerics common to every candidate
- q and k are Hadamard-rotated (token-local) unless the candidate says "no rot".
- Q is quantized per (token, head): a row scale of S, free in the forward; a per-block Q scale
  would leak for every query block, so no candidate has one in the forward.
- Power-of-two scales, e4m3 values with saturation (flamia.quant).
- P (forward): A_ij = round(p_ij * 256 * sv(i,j) / cap_i), p_ij = exp(S_ij - m_i) <= 1, sv(i,j)
  the scale of the V copy that pair (i, j) uses, cap_i = max of sv(i,j) over the keys j <= i
  (a causal prefix maximum). O_i = cap_i / (256 l_i) sum_j A_ij Vf_j.
- Backward: P = exp(S - lse) from the forward's operands, dP from the quantized dO,
  delta_i = dO_i . O_i with that same dO, dS = P (dP - delta).

Block scales (the candidates' K / V): one power-of-two scale per (block of B tokens, head) over
the block's B x D values; blocks restart at every document start, the last one may be short.

Diagonal pairs: query i and key j <= i in the same B-block. A block scale of K or V is a function
of all keys of its block, so it reaches query t from keys > t only through those pairs (an
off-diagonal pair (i, j) has block(j) < block(i): every key of block(j) is < the block start of
i, hence <= i). The safeguard replaces the operand on exactly those pairs:
- diag "token": a second FP8 copy of K and V with per-token scales (today's bytes),
- diag "pmax":  a second copy with c_j = the causal prefix max, within the block, of the
                token amaxes up to j (equals the block scale at the block's end),
- diag "none":  the block copy everywhere: the LEAKY control the leak check must catch.
The backward uses the same pair selection (P3: it differentiates the forward's function).

In-kernel operands of the backward (what candidates (3) vary). dV = P^T dO quantizes
X = P_ij sdo_i (dO's scale folded), dK = dS^T Q quantizes dS_ij sq_i, dQ = dS K quantizes
dS_ij sk(i,j), each with a scale that is constant along the GEMM's reduction:
- "row":     per output row over the whole reduction (flamia.reference today; a one-pass kernel
             cannot know a whole row's amax, it computes "tilerow"),
- "tilerow": per output row within the kernel's tile (64 queries for dK / dV, 128 keys for dQ),
- "tile":    one scalar per 64 x 128 tile from its amax, one dS copy for dK and dQ,
- "bound":   one scalar per CTA (key block of 128, KV head: every query step and every query head
             of the GQA group) from bounds computed in the backward's preprocess, one dS copy:
               |dS_ij| <= b_i = pmax_i (|dO_i| Vn_i + |delta_i|),  pmax_i = exp(m_i - lse_i)
             (m_i the forward's row max, saved next to lse), Vn_i = max_{j<=i} |V_j| (causal
             prefix max of V's row norms), and P_ij sdo_i <= pmax_i sdo_i for dV. The CTA's
             scale is the max over the queries it visits (a suffix max over query blocks),
- "bound1":  the same with P <= 1 (pmax_i = 1: nothing extra saved by the forward),
- "boundg":  one scalar per (document, KV head): the same bound maximised over the document;
             "boundg1" with P <= 1.
The shared dS copy is X_ij = dS_ij sq_i sK(j) with sK the K *block* scale (a scalar per
warpgroup): dK_j = (c / sK(j)) sum_i Xq_ij Qf_i and dQ_i = (c / sq_i) sum_j Xq_ij Kf_j, both
exact power-of-two factors per output row. On diagonal pairs dQ's K is the per-token copy, so
dQ needs a second copy there, round(dS_ij sq_i sk_tok(j) / c2). With B = BN = 128 a diagonal
step holds only diagonal pairs, so c2 is its own: the tile's amax ("tile"), or per query row
the CTA's bound times max_{j <= i in the block} sk_tok(j) ("bound"); no K block scale enters.
With B = 64 (or boundg's document-wide units) one dQ GEMM mixes both copies and c2 = c.
dO's scale is multiplied by a live flag (dO_i != 0), a per-column constant of the exponent:
rows whose dO is zero then give exact zeros in P^T and dS, which keeps them out of every amax
and bound even where a 64-block dO scale is not zero on them.

P1 (forward: O and LSE at t bitwise independent of tokens > t) per candidate
- token (0): every stored scale is per token; cap_i is a causal prefix max: leak-free.
- block + diag token (1a, 2a, 3*, 4a): off-diagonal pairs use block scales of blocks that end
  before the query's block (argument above); diagonal pairs use per-token bytes and scales; cap_i
  is a max over the scales of pairs (i, j <= i), each leak-free: leak-free.
- block + diag pmax (1b, 2b): c_j depends on keys b0..j of the block, and query i uses it only
  for j <= i: leak-free.
- lag (5): K / V of block b >= 1 scaled by headroom x max amax of blocks < b of the document
  (saturating when a block outgrows it); block 0 is scaled by its own amax off the diagonal and
  per token on it. Every scale depends on keys before the key it scales: leak-free, and no second
  copy beyond block 0. Silent saturation (P5) is the price.
- diag none (X): query t on its own block uses K / V bytes scaled by keys > t: LEAKS.
Backward (dO zero after t; gradients at <= t may depend on tokens > t at rounding level only):
every P^T / dS entry of a row after t is exactly zero (live flag), every bound term after t is
zero (b_i = 0, sdo_i = 0) and an exact zero never changes a max, so "row", "tilerow", "tile" and
"bound" with B = 128 keep the gradients bitwise. What does reach back, at rounding level: the
Q block copy (3h: Q's 64-block scale), B = 64 (the CTA's two K block scales in one bound, 3f),
boundg (the document's largest K block scale). Measured below as "bwd prefix change".

Per-element work (extra instructions per score element, beyond the scale-free fp8 chain that
every candidate has: the exponent FFMA with per-row/column constants, exp2, dP - delta, the
dS multiply, the row max/sum, the cvt of P / dS). The model:
- A scalar per tile, per row or per column of a GEMM output (S, dP) folds into the per-row /
  per-column constants of the FFMA that already touches each element: 0.
- Per-token scales on both sides of S (Q and K per token): +1 FMUL (the constants are rank-1);
  same for dP^T with V per token. Forward: K per token +1, V's per-token weight on P +1.
- A partner's per-token scale along a reduction: 0 when it is a per-column constant of the
  chain (sdo_i into the exponent's bias, sq_i into dP^T g_i - h_i), +1 when per row (sk_j for
  dQ's copy).
- A dynamic scale (row / tile amax): +1 FMNMX and +1 FMUL (applied after the max is known), and
  the scale changes per step, so dK / dV accumulate through a promotion (fresh accumulator, then
  FFMA): D/BM per score element (BM = 64 query rows per step).
- dQ partials in per-CTA units: one multiply per partial element when stored, D/BN per score
  element (BN = 128 keys); none for boundg (units constant per row: the post pass scales).
- A second fp8 copy of dS: +0.5 (e4m3x2 cvt) plus its scale multiply (+1 amax for "tile").
Diagonal tiles pay the per-token terms; at T=1024 they are 22 % of the computed tiles (forward
128 x 128 and backward 64 x 128), at 32k tokens < 1 %. "row" is counted as "tilerow".
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import torch

from flamia import reference as R
from flamia.inputs import make_qkv, rel_err
from flamia.quant import E4M3_MAX, hadamard, pow2_scale, round_to_format, safe_reciprocal

P_SCALE = 256.0
BM, BN = 64, 128          # backward: query rows per step, keys per CTA
DO_BLOCK = QDK_BLOCK = 64  # dO and the backward Q copy: one scale per 64-token block
SEEDS = (0, 1, 2, 3)       # input draws at T=1024 (seed 0 is the main table's)


@dataclass(frozen=True)
class Cand:
    key: str
    kv: str = "token"       # K / V scales: "token" | "block" | "lag"
    block: int = 128        # K / V block size (tokens)
    diag: str = "token"     # copy on diagonal pairs: "token" | "pmax" | "none" (leaky)
    rot: bool = True
    do: str = "token"       # "token" | "block" (64)
    qdk: str = "token"      # Q for dK: "token" (the forward's) | "block" (64-block copy)
    pt: str = "row"         # P^T for dV: row | tilerow | tile | bound | bound1 | boundg | boundg1
    ds: str = "row"         # dS for dK / dQ: the same choices
    headroom: float = 16.0  # lag only

    def label(self) -> str:
        kv = "K/V per token" if self.kv == "token" else (
            f"K/V lag-{self.block} x{self.headroom:g}" if self.kv == "lag" else
            f"K/V {self.block}-block, diag {self.diag}")
        parts = [kv, "rot" if self.rot else "no rot",
                 "dO token" if self.do == "token" else f"dO {DO_BLOCK}-block"]
        if self.qdk == "block":
            parts.append(f"Q {QDK_BLOCK}-block copy for dK")
        parts.append(f"P^T {self.pt}, dS {self.ds}")
        return "; ".join(parts)


BASE = Cand("2a", kv="block", block=128, diag="token", do="block")
CANDIDATES = [
    Cand("0", pt="row", ds="row"),
    Cand("0k", pt="tilerow", ds="tilerow"),
    Cand("0n", rot=False),
    Cand("1a", kv="block", block=64, diag="token", do="block"),
    Cand("1b", kv="block", block=64, diag="pmax", do="block"),
    BASE,
    replace(BASE, key="2b", diag="pmax"),
    replace(BASE, key="3a", pt="tilerow", ds="tilerow"),
    replace(BASE, key="3b", pt="tile", ds="tile"),
    replace(BASE, key="3c", pt="bound", ds="bound"),
    replace(BASE, key="3d", pt="bound1", ds="bound1"),
    replace(BASE, key="3e", pt="boundg", ds="boundg"),
    replace(BASE, key="3j", pt="boundg1", ds="boundg1"),   # added after the first run
    replace(BASE, key="3f", block=64, pt="bound", ds="bound"),
    replace(BASE, key="3g", do="token", pt="bound", ds="bound"),
    replace(BASE, key="3h", qdk="block", pt="bound", ds="bound"),
    replace(BASE, key="3i", pt="bound", ds="tile"),
    replace(BASE, key="4a", rot=False, pt="bound", ds="bound"),
    replace(BASE, key="5", kv="lag", pt="bound", ds="bound"),
    replace(BASE, key="X", diag="none", pt="bound", ds="bound"),
]

BARS = {"outliers": (0.07, 0.50, 0.50, 0.08), "mild": (0.05, 0.07, 0.07, 0.07)}


# ---------------------------------------------------------------------------------------------
# Per-element work model (see the module docstring).

def ops(c: Cand, D: int) -> tuple[float, float, float, float]:
    """(forward off-diagonal, forward diagonal, backward off-diagonal, backward diagonal)."""
    def fwd(tok):
        return 2.0 if tok else 0.0

    def bwd(tok):
        e = 2.0 if tok else 0.0                          # K row scale in S^T, V row scale in dP^T
        if c.pt in ("row", "tilerow", "tile"):
            e += 2 + D / BM                              # amax + apply + dV promotion
        if c.ds in ("row", "tilerow"):
            e += 2 + D / BM                              # dK copy: amax + apply + promotion
            e += 2 + 0.5 + D / BN + (1 if tok else 0)    # dQ copy: amax + apply + cvt + partial (+ sk)
        else:
            if c.ds == "tile":
                e += 2 + D / BM                          # tile amax + apply + dK promotion
            if not c.ds.startswith("boundg"):
                e += D / BN                              # dQ partial in per-CTA (per-step) units
            if tok:
                e += 1 + (0.5 if c.kv != "token" else 0)  # sk_j fold; second copy on diag pairs
                if c.ds == "tile" and c.kv != "token" and c.block == BN:
                    e += 1                               # the diagonal copy's own tile amax
        return e

    off_tok = c.kv == "token"
    diag_tok = c.kv == "token" or (c.kv == "block" and c.diag != "none")
    return fwd(off_tok), fwd(diag_tok), bwd(off_tok), bwd(diag_tok)


# ---------------------------------------------------------------------------------------------
# Stored operands.

@dataclass
class Op:
    """A quantized (T, H, D) operand: values (what the tensor core multiplies) and the per-token
    effective scale (T, H); deq = values * scale."""
    values: torch.Tensor
    scale: torch.Tensor

    @property
    def deq(self):
        return self.values * self.scale[..., None]


def _quant(x, scale):
    return Op(round_to_format(x * safe_reciprocal(scale)[..., None], "e4m3"), scale)


def doc_index(cu, T):
    """(doc id, position in the document) per packed token."""
    doc = torch.zeros(T, dtype=torch.long)
    pos = torch.zeros(T, dtype=torch.long)
    cut = cu.tolist()
    for d, (a, b) in enumerate(zip(cut[:-1], cut[1:])):
        doc[a:b] = d
        pos[a:b] = torch.arange(b - a)
    return doc, pos


def block_ids(cu, T, B):
    """Global id of each token's document-local B-block (blocks restart at document starts)."""
    ids = torch.zeros(T, dtype=torch.long)
    cut, base = cu.tolist(), 0
    for a, b in zip(cut[:-1], cut[1:]):
        ids[a:b] = base + torch.arange(b - a) // B
        base += -(-(b - a) // B)
    return ids, base


def quant_token(x):
    return _quant(x, pow2_scale(x.abs().amax(-1), E4M3_MAX).to(x.dtype))


def block_amax(x, ids, nb):
    tok = x.abs().amax(-1)                                       # (T, H)
    out = torch.zeros(nb, x.shape[1], dtype=x.dtype)
    return out.scatter_reduce(0, ids[:, None].expand_as(tok), tok, "amax", include_self=False)


def quant_block(x, cu, B):
    ids, nb = block_ids(cu, x.shape[0], B)
    return _quant(x, pow2_scale(block_amax(x, ids, nb), E4M3_MAX).to(x.dtype)[ids])


def quant_pmax(x, cu, B):
    """Scale of token j: the causal prefix max, within j's block, of token amaxes up to j."""
    tok = x.abs().amax(-1)
    pref = torch.empty_like(tok)
    cut = cu.tolist()
    for a, b in zip(cut[:-1], cut[1:]):
        for s in range(a, b, B):
            e = min(s + B, b)
            pref[s:e] = torch.cummax(tok[s:e], 0).values
    return _quant(x, pow2_scale(pref, E4M3_MAX).to(x.dtype))


def quant_lag(x, cu, B, headroom):
    """Block b >= 1 of a document: scale from headroom x the max amax of blocks < b (saturating);
    block 0: its own amax (its diagonal pairs use the per-token copy). Returns (op, saturated
    fraction)."""
    ids, nb = block_ids(cu, x.shape[0], B)
    amax = block_amax(x, ids, nb)                                # (nb, H)
    ref = amax.clone()
    cut, base = cu.tolist(), 0
    for a, b in zip(cut[:-1], cut[1:]):
        n = -(-(b - a) // B)
        if n > 1:
            prev = torch.cummax(amax[base:base + n - 1], 0).values * headroom
            ref[base + 1:base + n] = prev
        base += n
    op = _quant(x, pow2_scale(ref, E4M3_MAX).to(x.dtype)[ids])
    sat = (x.abs() * safe_reciprocal(op.scale)[..., None] > E4M3_MAX).double().mean().item()
    return op, sat


def stored_kv(x, c: Cand, cu):
    """(block copy, diagonal copy) of K or V; the same Op twice when there is one copy."""
    if c.kv == "token":
        op = quant_token(x)
        return op, op, 0.0
    if c.kv == "lag":
        blk, sat = quant_lag(x, cu, c.block, c.headroom)
        tok = quant_token(x)
        # Diagonal copy: per token in each document's first block, the lag copy elsewhere.
        _, pos = doc_index(cu, x.shape[0])
        first = pos < c.block
        safe = Op(torch.where(first[:, None, None], tok.values, blk.values),
                  torch.where(first[:, None], tok.scale, blk.scale))
        return blk, safe, sat
    blk = quant_block(x, cu, c.block)
    if c.diag == "none":
        return blk, blk, 0.0
    safe = quant_token(x) if c.diag == "token" else quant_pmax(x, cu, c.block)
    return blk, safe, 0.0


def hf(x, group):
    """(L, H, ...) -> (H * group, L, ...): KV heads repeated for their query heads (GQA)."""
    return x.repeat_interleave(group, dim=1).transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# Forward and backward emulation.

def forward(c: Cand, q, k, v, cu):
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = D ** -0.5
    qc, kc, vc = (x.float() for x in (q, k, v))
    rot = hadamard(D, torch.float32) if c.rot else None
    if rot is not None:
        qc, kc = qc @ rot, kc @ rot
    Q = quant_token(qc)
    Kb, Ks, satk = stored_kv(kc, c, cu)
    Vb, Vs, satv = stored_kv(vc, c, cu)
    ids, _ = block_ids(cu, T, c.block)
    two = Kb is not Ks
    out = torch.zeros(T, Hq, D)
    lse = torch.zeros(Hq, T)
    m_all = torch.zeros(Hq, T)
    cut = cu.tolist()
    for a, b in zip(cut[:-1], cut[1:]):
        L = b - a
        if L == 0:
            continue
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        diag = (ids[a:b, None] == ids[None, a:b]) & causal
        qd = Q.deq[a:b].transpose(0, 1)
        s = torch.einsum("hid,hjd->hij", qd, hf(Kb.deq[a:b], group)) * scale
        if two:
            ss = torch.einsum("hid,hjd->hij", qd, hf(Ks.deq[a:b], group)) * scale
            s = torch.where(diag, ss, s)
        s = s.masked_fill(~causal, float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        svb, svs = hf(Vb.scale[a:b], group)[:, None, :], hf(Vs.scale[a:b], group)[:, None, :]
        sv = torch.where(diag, svs, svb) * causal                 # sv(i, j), 0 where masked
        cap = sv.amax(-1, keepdim=True)                           # causal prefix max
        w = sv * safe_reciprocal(cap) * P_SCALE
        peff = round_to_format(p * w, "e4m3") * safe_reciprocal(w)
        o = (peff * ~diag) @ hf(Vb.deq[a:b], group) if two else peff @ hf(Vb.deq[a:b], group)
        if two:
            o = o + (peff * diag) @ hf(Vs.deq[a:b], group)
        out[a:b] = (o / l).transpose(0, 1)
        lse[:, a:b] = (m + torch.log(l)).squeeze(-1)
        m_all[:, a:b] = m.squeeze(-1)
    saved = dict(Q=Q, Kb=Kb, Ks=Ks, Vb=Vb, Vs=Vs, ids=ids, m=m_all, rot=rot, sat=(satk, satv))
    return out, lse, saved


def _tile_amax(x, ti, tj):
    """Amax of |x| (H, L, L) over (ti x tj) tiles, broadcast back to (H, L, L)."""
    H, L, _ = x.shape
    Li, Lj = -(-L // ti) * ti, -(-L // tj) * tj
    xp = torch.nn.functional.pad(x.abs(), (0, Lj - L, 0, Li - L))
    t = xp.reshape(H, Li // ti, ti, Lj // tj, tj).amax((2, 4), keepdim=True)
    return t.expand(H, Li // ti, ti, Lj // tj, tj).reshape(H, Li, Lj)[:, :L, :L]


def _pm(kind, pmax):
    """The bound's P factor: exp(m - lse) from the forward, or 1 for the "...1" kinds."""
    return torch.ones_like(pmax) if kind.endswith("1") else pmax


def _cta_scale(bound_hi, group, L, kind):
    """Per-CTA (KV head, 128-key block) or per-document bound from per-(head, query) bounds."""
    H = bound_hi.shape[0]
    g = bound_hi.reshape(H // group, group, L).amax(1)           # max over the GQA group
    if kind.startswith("boundg"):
        s = g.amax(-1, keepdim=True).expand(-1, L)
    else:
        suffix = torch.flip(torch.cummax(torch.flip(g, [-1]), -1).values, [-1])   # max_{i' >= i}
        kb = torch.arange(L) // BN * BN                         # each key's CTA start
        s = suffix[:, kb]                                        # (Hkv, L): scale per key column
    return s.repeat_interleave(group, 0)[:, None, :]             # (H, 1, L over keys)


def _qscale(x, kind, along):
    """Dynamic scale of x (H, i, j) constant along `along` ("i": per key column, "j": per query
    row), or per tile."""
    if kind == "row":
        amax = x.abs().amax(1 if along == "i" else 2, keepdim=True)
    elif kind == "tilerow":
        amax = _tile_amax(x, BM, 1) if along == "i" else _tile_amax(x, 1, BN)
    elif kind == "tile":
        amax = _tile_amax(x, BM, BN)
    else:
        raise ValueError(kind)
    return pow2_scale(amax, E4M3_MAX).to(x.dtype)


def _rq(x, sc):
    return round_to_format(x * safe_reciprocal(sc), "e4m3") * sc


def _count(stats, name, x, sc):
    """Share of x's squared mass (sum x^2) that, quantized with scale sc, lands in e4m3's
    subnormal range (|x / sc| < 2^-6) and that rounds to zero. Weighted by mass because most
    nonzero entries of a peaked P are ~e^-50 and vanish under any scale."""
    if stats is None:
        return
    y = (x * safe_reciprocal(sc)).abs()
    w = x.double() ** 2
    st = stats.setdefault(name, [0.0, 0.0, 0.0])
    st[0] += w.sum().item()
    st[1] += (w * (y < 2.0 ** -6)).sum().item()
    st[2] += (w * (round_to_format(y, "e4m3") == 0)).sum().item()


def backward(c: Cand, dout, out, lse, saved, cu, stats=None):
    T, Hq, D = dout.shape
    Q, Kb, Ks, Vb, Vs, ids = (saved[n] for n in ("Q", "Kb", "Ks", "Vb", "Vs", "ids"))
    Hkv = Kb.values.shape[1]
    group = Hq // Hkv
    scale = D ** -0.5
    two = Kb is not Ks
    do_c, o_c = dout.float(), out.float()
    DO = quant_token(do_c) if c.do == "token" else quant_block(do_c, cu, DO_BLOCK)
    QP = Q if c.qdk == "token" else quant_block(Q.deq, cu, QDK_BLOCK)   # partner of dK
    dq = torch.zeros(T, Hq, D)
    dk = torch.zeros(T, Hkv, D)
    dv = torch.zeros(T, Hkv, D)
    cut = cu.tolist()
    for a, b in zip(cut[:-1], cut[1:]):
        L = b - a
        if L == 0:
            continue
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        diag = (ids[a:b, None] == ids[None, a:b]) & causal
        qd = Q.deq[a:b].transpose(0, 1)
        s = torch.einsum("hid,hjd->hij", qd, hf(Kb.deq[a:b], group)) * scale
        dod = DO.deq[a:b].transpose(0, 1)
        dp = torch.einsum("hid,hjd->hij", dod, hf(Vb.deq[a:b], group))
        if two:
            ss = torch.einsum("hid,hjd->hij", qd, hf(Ks.deq[a:b], group)) * scale
            s = torch.where(diag, ss, s)
            dps = torch.einsum("hid,hjd->hij", dod, hf(Vs.deq[a:b], group))
            dp = torch.where(diag, dps, dp)
        s = s.masked_fill(~causal, float("-inf"))
        lse_d = lse[:, a:b, None]
        p = torch.exp(s - lse_d)
        delta = (dod * o_c[a:b].transpose(0, 1)).sum(-1)          # (H, L)
        ds = p * (dp - delta[..., None])

        # Preprocess bounds (the "bound*" schemes).
        pmax = torch.exp(saved["m"][:, a:b] - lse[:, a:b])
        # Vn_i = max over keys j <= i of |V_j| for the copy pair (i, j) uses: the block copy of
        # earlier blocks, the diagonal copy of the query's own block up to i.
        nb, ns = Vb.deq[a:b].norm(dim=-1), Vs.deq[a:b].norm(dim=-1)   # (L, Hkv)
        vn = torch.zeros_like(nb)
        for s0 in range(0, L, c.block):
            before = torch.cummax(nb[:s0], 0).values[-1] if s0 else torch.zeros_like(nb[0])
            own = torch.cummax(ns[s0:s0 + c.block], 0).values
            vn[s0:s0 + c.block] = torch.maximum(before[None], own)
        vn = hf(vn, group)                                        # (H, L)
        # dO's scale per query, times a live flag (dO_i != 0): a per-column constant of the
        # exponent, so free; rows with zero dO then give P^T exact zeros, which keeps them out of
        # every amax and bound (a 64-block scale is not zero on such rows).
        live = (dod != 0).any(-1)
        sdo = DO.scale[a:b].transpose(0, 1) * live                # (H, L)

        # dV = P^T dO.
        X = p * sdo[..., None]
        if c.pt.startswith("bound"):
            sc = pow2_scale(_cta_scale(_pm(c.pt, pmax) * sdo, group, L, c.pt), E4M3_MAX)
        else:
            sc = _qscale(X, c.pt, "i")
        _count(stats, "P^T", X, sc)
        dv_h = (_rq(X, sc) * safe_reciprocal(sdo)[..., None]).transpose(1, 2) @ DO.deq[a:b].transpose(0, 1)

        sqp = QP.scale[a:b].transpose(0, 1)                       # (H, L) dK's partner scale
        skb = hf(Kb.scale[a:b], group)                            # (H, L) per key
        sks = hf(Ks.scale[a:b], group)
        qpd = QP.deq[a:b].transpose(0, 1)
        kbd, ksd = hf(Kb.deq[a:b], group), hf(Ks.deq[a:b], group)
        if c.ds in ("row", "tilerow"):
            Xk = ds * sqp[..., None]
            sck = _qscale(Xk, c.ds, "i")
            _count(stats, "dS", Xk, sck)
            dsk = _rq(Xk, sck) * safe_reciprocal(sqp)[..., None]
            sku = torch.where(diag, sks[:, None, :], skb[:, None, :])
            Xq = ds * sku
            dsq = _rq(Xq, _qscale(Xq, c.ds, "j")) * safe_reciprocal(sku)
            dsq_off, dsq_diag = (dsq * ~diag, dsq * diag) if two else (dsq, None)
        else:
            Xs = ds * sqp[..., None] * skb[:, None, :]
            if c.ds == "tile":
                sc = _qscale(Xs, "tile", "ij")
            else:
                bnd = _pm(c.ds, pmax) * (dod.norm(dim=-1) * vn + delta.abs()) * sqp
                kmax = torch.zeros_like(skb)                      # max K block scale per CTA
                for s0 in range(0, L, BN):
                    kmax[:, s0:s0 + BN] = skb[:, s0:s0 + BN].amax(-1, keepdim=True)
                if c.ds.startswith("boundg"):
                    kmax = skb.amax(-1, keepdim=True).expand_as(skb)
                bcta = _cta_scale(bnd, group, L, c.ds)            # (H, 1, keys)
                sc = pow2_scale(bcta * kmax[:, None, :], E4M3_MAX)
            _count(stats, "dS", Xs, sc)
            Xq = _rq(Xs, sc)
            dsk = Xq * safe_reciprocal(sqp)[..., None] * safe_reciprocal(skb)[:, None, :]
            dsq_off = dsk * ~diag
            if two:   # second copy on diagonal pairs, where dQ's K is the per-token copy
                X2 = ds * sqp[..., None] * sks[:, None, :]
                if c.block == BN and c.ds == "tile":
                    # The diagonal step holds only diagonal pairs: its own tile amax.
                    sc2 = _qscale(X2 * diag, "tile", "ij")
                elif c.block == BN and c.ds in ("bound", "bound1"):
                    # Per query row: the CTA's bound times the largest per-token K scale of the
                    # row's own block up to the row (causal), so no K block scale enters.
                    cm = torch.zeros_like(sks)
                    for s0 in range(0, L, c.block):
                        cm[:, s0:s0 + c.block] = torch.cummax(sks[:, s0:s0 + c.block], -1).values
                    sc2 = pow2_scale(bcta[:, 0, :] * cm, E4M3_MAX)[..., None]
                else:
                    sc2 = sc   # one scale per dQ GEMM (B=64 halves, boundg's global units)
                dsq_diag = (_rq(X2, sc2) * safe_reciprocal(sqp)[..., None]
                            * safe_reciprocal(sks)[:, None, :]) * diag
            else:
                dsq_off, dsq_diag = dsk, None
        dk_h = scale * (dsk.transpose(1, 2) @ qpd)
        dq_h = dsq_off @ kbd
        if dsq_diag is not None:
            dq_h = dq_h + dsq_diag @ ksd
        dq[a:b] = scale * dq_h.transpose(0, 1)
        dk[a:b] = dk_h.reshape(Hkv, group, L, D).sum(1).transpose(0, 1)
        dv[a:b] = dv_h.reshape(Hkv, group, L, D).sum(1).transpose(0, 1)
    if saved["rot"] is not None:
        dq, dk = dq @ saved["rot"].T, dk @ saved["rot"].T
    return dq, dk, dv


def run(c, q, k, v, cu, do, stats=None):
    out, lse, saved = forward(c, q, k, v, cu)
    o16 = out.to(torch.bfloat16)
    dq, dk, dv = backward(c, do, o16, lse, saved, cu, stats)
    return out, lse, (dq, dk, dv), saved


# ---------------------------------------------------------------------------------------------
# Cases, truth, checks.

CASES = {
    "T1024-D128": dict(lengths=(1024,), hq=8, hkv=2, d=128),
    "packed-D64": dict(lengths=(333, 1, 0, 190, 64, 129, 307), hq=8, hkv=2, d=64),
}
# A long document for the backward's scale variants: a bound maximised over more rows is looser
# (P's row maxima fall with the row's length), so T=1024 alone cannot vouch for them.
LONG = ("T8192-D128", dict(lengths=(8192,), hq=1, hkv=1, d=128))
LONG_CANDS = ("0", "3b", "3c", "3d", "3e", "3j")


def make_case(case, family, seed=0):
    cfg = CASES[case] if case in CASES else LONG[1]
    q, k, v, cu = make_qkv(cfg["lengths"], cfg["hq"], cfg["hkv"], cfg["d"], family, torch.bfloat16, seed=seed)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    return q, k, v, cu, do


def truth(q, k, v, cu, do):
    x64 = [x.double().requires_grad_() for x in (q, k, v)]
    o64 = R.attention_exact(*x64, cu)
    return (o64.detach(), *torch.autograd.grad(o64, x64, do.double()))


def errors(c, q, k, v, cu, do, ref, stats=None):
    out, _, grads, saved = run(c, q, k, v, cu, do, stats)
    got = (out.to(torch.bfloat16), *(g.to(torch.bfloat16) for g in grads))
    return tuple(rel_err(a, b) for a, b in zip(got, ref)), saved["sat"]


def check_reference(q, k, v, cu, do):
    """Candidate 0 against flamia.reference's fp8_token (bf16 outputs, as ReferenceAttention
    returns)."""
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    o_r, lse_r = R.ReferenceAttention.apply(*xs, cu, "fp8_token", True, None, torch.float32)
    g_r = torch.autograd.grad(o_r, xs, do)
    out, lse, grads, _ = run(CANDIDATES[0], q, k, v, cu, do)
    mine = (out.to(torch.bfloat16), *(g.to(torch.bfloat16) for g in grads))
    theirs = (o_r, *g_r)
    rel = [rel_err(a, b) for a, b in zip(mine, theirs)]
    return rel, (lse - lse_r).abs().max().item()


def leak_checks(c, q, k, v, cu, do, ts, t_bwd):
    """P1 forward bitwise at each t; backward with dO zero after t_bwd: gradients after t exactly
    zero and their relative change at <= t; P2: perturb document 3, the others bitwise."""
    gen = torch.Generator().manual_seed(123)
    out0, lse0, _ = forward(c, q, k, v, cu)
    fwd_ok = True
    for t in ts:
        qp, kp, vp = (x.clone() for x in (q, k, v))
        for x in (qp, kp, vp):
            x[t + 1:] = (torch.randn(x[t + 1:].shape, generator=gen) * 8).to(x.dtype)
        out1, lse1, _ = forward(c, qp, kp, vp, cu)
        fwd_ok &= torch.equal(out0[:t + 1], out1[:t + 1]) and torch.equal(lse0[:, :t + 1], lse1[:, :t + 1])
    # Backward prefix audit.
    t = t_bwd
    dz = do.clone()
    dz[t + 1:] = 0
    qp, kp, vp = (x.clone() for x in (q, k, v))
    for x in (qp, kp, vp):
        x[t + 1:] = (torch.randn(x[t + 1:].shape, generator=gen) * 8).to(x.dtype)
    _, _, g0, _ = run(c, q, k, v, cu, dz)
    _, _, g1, _ = run(c, qp, kp, vp, cu, dz)
    zero_after = all(torch.all(g[t + 1:] == 0).item() for g in (*g0, *g1))
    change = max(rel_err(b[:t + 1], a[:t + 1]) for a, b in zip(g0, g1))
    ref = truth(q, k, v, cu, dz)
    own = min(rel_err(g[:t + 1].to(torch.bfloat16), r[:t + 1]) for g, r in zip(g0, ref[1:]))
    # P2: document 3 perturbed.
    cut = cu.tolist()
    a3, b3 = cut[3], cut[4]
    qp, kp, vp = (x.clone() for x in (q, k, v))
    for x in (qp, kp, vp):
        x[a3:b3] = (torch.randn(x[a3:b3].shape, generator=gen) * 8).to(x.dtype)
    o_a, l_a, g_a, _ = run(c, q, k, v, cu, do)
    o_b, l_b, g_b, _ = run(c, qp, kp, vp, cu, do)
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[a3:b3] = False
    p2 = torch.equal(o_a[keep], o_b[keep]) and torch.equal(l_a[:, keep], l_b[:, keep]) and all(
        torch.equal(x[keep], y[keep]) for x, y in zip(g_a, g_b))
    return fwd_ok, zero_after, change, own, p2


def fmt_ops(x):
    return f"{x:g}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="candidates 0, 2a, 3c, X only")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.time()
    cands = [c for c in CANDIDATES if not args.quick or c.key in ("0", "2a", "3c", "X")]
    print("# Scales v2 study (issue 27): float32 emulation vs float64, bf16 in / out")
    print(f"torch {torch.__version__}; tiles: backward {BM} queries x {BN} keys per step, "
          f"forward 64/128 x 128; dO / Q-copy blocks {DO_BLOCK}\n")

    # Candidate 0 reproduces flamia.reference's fp8_token recipe (per-token scales).
    q, k, v, cu, do = make_case("T1024-D128", "outliers")
    rel, dl = check_reference(q, k, v, cu, do)
    print("Candidate 0 vs flamia.reference fp8_token (T1024-D128 outliers): relative difference "
          f"O {rel[0]:.1e}, dQ {rel[1]:.1e}, dK {rel[2]:.1e}, dV {rel[3]:.1e}; max |dLSE| {dl:.1e}\n")

    errs, sats, stats = {}, {}, {}
    for case in CASES:
        for fam in ("mild", "outliers"):
            q, k, v, cu, do = make_case(case, fam)
            ref = truth(q, k, v, cu, do)
            for c in cands:
                st = stats.setdefault((case, fam, c.key), {})
                errs[case, fam, c.key], sats[case, fam, c.key] = errors(c, q, k, v, cu, do, ref, st)
            print(f"[{time.time() - t0:6.1f} s] {case} {fam} done", flush=True)
    # Input draws other than seed 0 (the error varies more between draws than between most
    # candidates): worst case over seeds.
    worst = {}
    for fam in ("mild", "outliers"):
        for seed in SEEDS[1:]:
            q, k, v, cu, do = make_case("T1024-D128", fam, seed=seed)
            ref = truth(q, k, v, cu, do)
            for c in cands:
                e, _ = errors(c, q, k, v, cu, do, ref)
                prev = worst.get((fam, c.key), errs["T1024-D128", fam, c.key])
                worst[fam, c.key] = tuple(max(x, y) for x, y in zip(prev, e))
        print(f"[{time.time() - t0:6.1f} s] T1024-D128 {fam} seeds {SEEDS[1:]} done", flush=True)

    # One long document for the backward's scale variants.
    long_errs, long_stats = {}, {}
    for fam in ("mild", "outliers"):
        q, k, v, cu, do = make_case(LONG[0], fam)
        ref = truth(q, k, v, cu, do)
        for c in cands:
            if c.key in LONG_CANDS:
                st = long_stats.setdefault((fam, c.key), {})
                long_errs[fam, c.key], _ = errors(c, q, k, v, cu, do, ref, st)
        del q, k, v, do, ref
        print(f"[{time.time() - t0:6.1f} s] {LONG[0]} {fam} done", flush=True)

    # Leakage: packed D=64 outliers (several documents), plus the main case at one t.
    q, k, v, cu, do = make_case("packed-D64", "outliers")
    ts = [40, 200, 333 + 1 + 100, 333 + 1 + 190 + 64 + 129 + 150]
    leaks = {c.key: leak_checks(c, q, k, v, cu, do, ts, t_bwd=ts[2]) for c in cands}
    qm, km, vm, cum, dom = make_case("T1024-D128", "outliers")
    main_ok = {}
    for c in cands:
        out0, lse0, _ = forward(c, qm, km, vm, cum)
        t = 700
        qp, kp, vp = (x.clone() for x in (qm, km, vm))
        gen = torch.Generator().manual_seed(7)
        for x in (qp, kp, vp):
            x[t + 1:] = (torch.randn(x[t + 1:].shape, generator=gen) * 8).to(x.dtype)
        out1, lse1, _ = forward(c, qp, kp, vp, cum)
        main_ok[c.key] = torch.equal(out0[:t + 1], out1[:t + 1]) and torch.equal(lse0[:, :t + 1], lse1[:, :t + 1])
    print(f"[{time.time() - t0:6.1f} s] leak checks done\n")

    def passes(key, case="T1024-D128"):
        return all(e <= b for fam in ("mild", "outliers")
                   for e, b in zip(errs[case, fam, key], BARS[fam]))

    def passes_all_seeds(key):
        return all(e <= b for fam in ("mild", "outliers") for e, b in zip(worst[fam, key], BARS[fam]))

    def passes_long(key):
        # Candidates not run on the long document share their backward scheme with one that was.
        ref_key = key if ("mild", key) in long_errs else next(
            (c.key for c in cands if ("mild", c.key) in long_errs
             and (c.pt, c.ds) == (by_key[key].pt, by_key[key].ds)), None)
        if ref_key is None:
            return True
        return all(e <= b for fam in ("mild", "outliers") for e, b in zip(long_errs[fam, ref_key], BARS[fam]))

    by_key = {c.key: c for c in cands}

    print("## T=1024 one document, 8/2 heads, D=128: relative error vs float64\n")
    print("Bars: outliers O <= 0.07, dQ <= 0.50, dK <= 0.50, dV <= 0.08; mild O <= 0.05, grads <= 0.07. "
          "Ops: extra instructions per score element, off-diagonal / diagonal tiles, D=128.\n")
    print("| cand | scheme | mild O | dQ | dK | dV | outl. O | dQ | dK | dV | max / cand 0 | "
          "fwd leak-free | ops fwd | ops bwd | bars |")
    print("|---|---|" + "---|" * 13)
    e0 = (*errs["T1024-D128", "mild", "0"], *errs["T1024-D128", "outliers", "0"])
    for c in cands:
        m, o = errs["T1024-D128", "mild", c.key], errs["T1024-D128", "outliers", c.key]
        f0, f1, b0, b1 = ops(c, 128)
        lf = "yes" if leaks[c.key][0] and main_ok[c.key] else "**NO**"
        ratio = max(x / y for x, y in zip((*m, *o), e0))
        print(f"| {c.key} | {c.label()} | " + " | ".join(f"{x:.4f}" for x in (*m, *o))
              + f" | {ratio:.3f} | {lf} | {fmt_ops(f0)} / {fmt_ops(f1)} | {fmt_ops(b0)} / {fmt_ops(b1)} | "
              + ("pass" if passes(c.key) else "fail") + " |")

    print(f"\n## T=1024, D=128: worst error over seeds {SEEDS} (inputs and dO)\n")
    print("| cand | mild O | dQ | dK | dV | outl. O | dQ | dK | dV | bars, every seed |")
    print("|---|" + "---|" * 9)
    for c in cands:
        print(f"| {c.key} | " + " | ".join(f"{x:.4f}" for x in (*worst["mild", c.key], *worst["outliers", c.key]))
              + " | " + ("pass" if passes_all_seeds(c.key) else "fail") + " |")

    print("\n## Packed documents (333, 1, 0, 190, 64, 129, 307), 8/2 heads, D=64\n")
    print("Leak checks on the outliers draw: P1 forward bitwise at t = " + ", ".join(map(str, ts))
          + f" (and t=700 on the T=1024 case); backward with dO zero after t={ts[2]}: gradients "
          "after t exactly zero, max relative change of dQ/dK/dV at <= t when tokens > t are "
          "perturbed, against the candidate's smallest own gradient error there; P2: document 3 "
          "perturbed, the others' O, LSE and gradients bitwise. Ops at D=64.\n")
    print("| cand | mild O | dQ | dK | dV | outl. O | dQ | dK | dV | P1 fwd | grads after t = 0 | "
          "bwd prefix change / own error | P2 | ops bwd (D=64) |")
    print("|---|" + "---|" * 13)
    for c in cands:
        m, o = errs["packed-D64", "mild", c.key], errs["packed-D64", "outliers", c.key]
        fwd_ok, zero_after, change, own, p2 = leaks[c.key]
        _, _, b0, b1 = ops(c, 64)
        print(f"| {c.key} | " + " | ".join(f"{x:.4f}" for x in (*m, *o))
              + f" | {'yes' if fwd_ok else '**NO**'} | {'yes' if zero_after else '**NO**'} | "
              + f"{change:.1e} / {own:.1e} | {'yes' if p2 else '**NO**'} | {fmt_ops(b0)} / {fmt_ops(b1)} |")

    print("\n## How much range the in-kernel scales give away (T=1024, D=128, seed 0)\n")
    print("Share of the squared mass of P^T (dV) and of dS (the dK copy) that lands in e4m3's "
          "subnormal range / that rounds to zero, with each scheme's scale.\n")
    print("| cand | P^T, dS scheme | mild P^T | mild dS | outl. P^T | outl. dS |")
    print("|---|---|---|---|---|---|")
    seen = set()
    for c in cands:
        if (c.pt, c.ds) in seen or c.kv == "lag" or c.diag == "none" or not c.rot:
            continue
        seen.add((c.pt, c.ds))
        cells = []
        for fam in ("mild", "outliers"):
            st = stats["T1024-D128", fam, c.key]
            for name in ("P^T", "dS"):
                n, sub, zero = st[name]
                cells.append(f"{sub / n:.1e} / {zero / n:.1e}")
        print(f"| {c.key} | {c.pt}, {c.ds} | " + " | ".join(cells) + " |")

    if long_errs:
        print(f"\n## One long document: {LONG[0]} ({LONG[1]['hq']}/{LONG[1]['hkv']} heads), the "
              "backward's scale variants\n")
        print("Errors vs float64, then the squared-mass share of dS (dK copy) in subnormals / "
              "rounded to zero.\n")
        print("| cand | P^T, dS | mild O | dQ | dK | dV | outl. O | dQ | dK | dV | mild dS sub / zero "
              "| outl. dS sub / zero | bars |")
        print("|---|---|" + "---|" * 11)
        for c in cands:
            if ("mild", c.key) not in long_errs:
                continue
            cells = []
            for fam in ("mild", "outliers"):
                n, sub, zero = long_stats[fam, c.key]["dS"]
                cells.append(f"{sub / n:.1e} / {zero / n:.1e}")
            ok_long = all(e <= b for fam in ("mild", "outliers")
                          for e, b in zip(long_errs[fam, c.key], BARS[fam]))
            print(f"| {c.key} | {c.pt}, {c.ds} | " + " | ".join(
                f"{x:.4f}" for x in (*long_errs["mild", c.key], *long_errs["outliers", c.key]))
                + " | " + " | ".join(cells) + " | " + ("pass" if ok_long else "fail") + " |")

    lag = [c.key for c in cands if c.kv == "lag"]
    for key in lag:
        s = {f: sats["T1024-D128", f, key] for f in ("mild", "outliers")}
        print(f"\nLag candidate {key}: saturated fraction of K / V elements: "
              + "; ".join(f"{f} {a:.1e} / {b:.1e}" for f, (a, b) in s.items()))

    ok = [c for c in cands if passes_all_seeds(c.key) and passes(c.key, "packed-D64")
          and passes_long(c.key) and leaks[c.key][0] and main_ok[c.key] and leaks[c.key][1]
          and leaks[c.key][4]]
    print("\nCandidates meeting every bar (T=1024 at every seed, packed at seed 0, the long "
          "document through their backward scheme), forward leak-free, document-isolated: "
          + ", ".join(c.key for c in ok))

    def work(c):
        return (ops(c, 128)[2], ops(c, 128)[0], ops(c, 128)[3], ops(c, 128)[1])

    safe = [c for c in ok if c.kv != "lag"]
    if safe:
        best = min(safe, key=work)
        print(f"Least work among those that cannot saturate: {best.key} ({best.label()}); ops fwd "
              f"{ops(best, 128)[0]:g} / {ops(best, 128)[1]:g}, bwd {ops(best, 128)[2]:g} / "
              f"{ops(best, 128)[3]:g} at D=128 ({ops(best, 64)[2]:g} / {ops(best, 64)[3]:g} at D=64) "
              f"vs candidate 0's fwd {ops(CANDIDATES[0], 128)[0]:g}, bwd {ops(CANDIDATES[0], 128)[2]:g} "
              f"({ops(CANDIDATES[0], 64)[2]:g} at D=64)")
    for c in ok:
        if c.kv == "lag" and work(c) < work(best):
            print(f"Cheaper but saturating when a block outgrows {c.headroom:g} x the earlier blocks' "
                  f"max (silent, P5): {c.key}, ops fwd {ops(c, 128)[0]:g} / {ops(c, 128)[1]:g}, "
                  f"bwd {ops(c, 128)[2]:g} / {ops(c, 128)[3]:g}")
    print(f"\nTotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
