"""Leakage audit for any causal attention implementation (properties P1 and P2, bitwise).

    from flamia import audit
    report = audit(audit.recipe_fn("fp8"))          # flamia itself
    report = audit(my_varlen_attention)             # fn(q, k, v, cu_seqlens, max_seqlen) -> out
    report = audit(my_dense_attention, layout="dense")   # fn(q, k, v) -> out (B, S, H, D)
    print(report); assert report.passed

Checks (each compares two calls bitwise; any change is a LEAK, but for the relaxed backward
rule below):
- P1 forward: every token after position t is replaced by fresh values 16x larger (q, k and v);
  outputs at positions <= t must not change.
- P1 backward: with dO zero after t, the gradients at positions <= t must not change between the
  original and the perturbed inputs, and the gradients after t must be exactly zero.
  The relaxed rule (DESIGN.md P1, issue 27), for implementations whose backward quantizes with
  scales shared by several tokens (`Recipe.shared_backward_scale`; `backward_rule="relaxed"`
  for any fn): the gradients at <= t may change at rounding level. The audit then reports, per
  gradient, the relative change at <= t next to the implementation's own error there against
  float64 (same inputs, same dO), and the check passes when each change is below that error.
  The bitwise count of changed elements is reported either way.
- P2 forward / backward: one whole document in the middle (the longest with documents on both
  sides) is replaced (q, k, v and dO, 16x larger); every other document's outputs and gradients
  must not change. For the dense layout each batch row is a document.
t is placed inside a document, away from multiples of 16 (a tile or scale-block boundary would
hide a leak confined to a block).

Scales shared across tokens are the usual culprit: a per-tensor or per-block amax includes the
future and the other documents, so the quantized value of an early token depends on them.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .inputs import make_qkv

__all__ = ["audit", "recipe_fn", "AuditReport", "CheckResult", "DEFAULT_DOC_LENGTHS"]

DEFAULT_DOC_LENGTHS = (200, 1, 0, 150, 17, 130)
PERTURB_GAIN = 16.0


@dataclass
class CheckResult:
    name: str
    max_change: float          # largest |after - before| among changed elements (0.0: none); inf for NaN
    n_changed: int             # number of elements that changed
    where: str                 # "token 412, head 3, dq" of the largest change, or "-"
    passed: bool
    rule: str = "bitwise"      # "bitwise": any change fails; "relaxed": see rel_change / own_error
    # relaxed rule only: per gradient ("dq", "dk", "dv"), the relative Frobenius change at
    # positions <= t, and the implementation's own relative error there against float64
    rel_change: dict | None = None
    own_error: dict | None = None

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "LEAK"


@dataclass
class AuditReport:
    label: str
    layout: str
    doc_lengths: tuple
    t: int
    perturbed_doc: int | None
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def __getitem__(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def __str__(self) -> str:
        head = (f"audit of {self.label} ({self.layout}, documents {list(self.doc_lengths)}, t={self.t}"
                + (f", perturbed document {self.perturbed_doc}" if self.perturbed_doc is not None else "")
                + f"): {'PASS' if self.passed else 'LEAK'}")
        rows = [("check", "max change", "changed", "where", "verdict")]
        rows += [(c.name, f"{c.max_change:.3g}", str(c.n_changed), c.where, c.verdict) for c in self.checks]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [head] + ["  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
        for c in self.checks:
            if c.rule == "relaxed":
                lines.append(f"  {c.name}, relaxed rule (a shared backward scale): relative change at "
                             f"<= t vs own error against float64: " + ", ".join(
                                 f"{n} {c.rel_change[n]:.2g} vs {c.own_error[n]:.2g}" for n in c.rel_change)
                             + (" (each change below its error)" if c.passed else " (NOT below)"))
        return "\n".join(lines)


def _changes(pairs, select_rows, token_name):
    """Compare (name, before, after) tensors (T, H, D) on the token rows `select_rows` (bool (T,)).

    Equality is value equality (NaN equal to NaN at the same place); returns (max, count, where).
    """
    best, count, where = 0.0, 0, "-"
    for name, a, b in pairs:
        a, b = a.detach()[select_rows].double(), b.detach()[select_rows].double()
        changed = ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
        n = int(changed.sum())
        if n == 0:
            continue
        count += n
        diff = torch.where(changed, (a - b).abs().nan_to_num(nan=float("inf")), torch.zeros_like(a))
        flat = int(diff.flatten().argmax())
        val = float(diff.flatten()[flat])
        if val >= best:
            tok, head = flat // (a.shape[1] * a.shape[2]), (flat // a.shape[2]) % a.shape[1]
            token = int(select_rows.nonzero()[tok])
            best, where = val, f"{token_name(token)}, head {head}, {name}"
    return best, count, where


def _nonzero(pairs, select_rows, token_name):
    """Largest |value| of the tensors on `select_rows` (must be exactly zero)."""
    zeros = [(name, torch.zeros_like(x), x) for name, x in pairs]
    return _changes(zeros, select_rows, token_name)


def pick_t(lengths: Sequence[int]) -> int:
    """A position in the middle of a document, near T/2, not on a multiple of 16."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    T = cu[-1]
    candidates = []
    for a, b in zip(cu[:-1], cu[1:]):
        for t in range(a + 1, b - 1):      # strictly inside: at least one token before and after
            if t % 16 not in (0, 15):
                candidates.append(t)
    if not candidates:
        raise ValueError(f"audit needs a document of at least 3 tokens, got lengths {list(lengths)}")
    target = T // 2 + 37 if T > 160 else T // 2 + 5
    return min(candidates, key=lambda t: (abs(t - target), t))


def audit(fn: Callable, layout: str = "varlen", doc_lengths: Sequence[int] | None = None,
          heads_q: int = 4, heads_kv: int = 2, head_dim: int = 64, dtype=torch.bfloat16,
          device="cpu", backward: bool = True, seed: int = 0, t: int | None = None,
          family: str = "outliers", label: str | None = None,
          backward_rule: str | None = None) -> AuditReport:
    """Run the P1 and P2 checks on `fn` and return an AuditReport (`report.passed`).

    layout="varlen": fn(q, k, v, cu_seqlens, max_seqlen) -> out (T, Hq, D), documents
        `doc_lengths` packed (empty and length-1 documents are fine).
    layout="dense":  fn(q, k, v) -> out (B, S, Hq, D); doc_lengths must be B equal lengths S.
    backward=False skips the gradient checks. t: the P1 position (default: inside a document
    near the middle, off block boundaries). family: the inputs (flamia.inputs.make_qkv); the
    default "outliers" gives peaked attention rows, which expose a scale shared by several
    tokens far more often than standard normal inputs do (an MX block scale over P leaks on
    "outliers" and passes on "mild"). backward_rule: "bitwise" or "relaxed" for the gradients at
    <= t (module docstring); default: "relaxed" when fn carries a recipe (recipe_fn) whose
    `shared_backward_scale` is set, else "bitwise".
    """
    if layout not in ("varlen", "dense"):
        raise ValueError(f"layout must be 'varlen' or 'dense', got {layout!r}")
    if doc_lengths is None:
        doc_lengths = DEFAULT_DOC_LENGTHS if layout == "varlen" else (160, 160, 160)
    lengths = tuple(int(n) for n in doc_lengths)
    if any(n < 0 for n in lengths):
        raise ValueError(f"doc_lengths must be >= 0, got {list(lengths)}")
    if layout == "dense" and len(set(lengths)) != 1:
        raise ValueError(f"the dense layout needs equal doc_lengths (batch rows), got {list(lengths)}")
    T = sum(lengths)
    if t is None:
        t = pick_t(lengths) if layout == "varlen" else pick_t(lengths[:1])
    S = lengths[0] if layout == "dense" else T
    if not 0 <= t < S - 1:
        raise ValueError(f"t must be in [0, {S - 2}], got {t}")
    label = label or getattr(fn, "__name__", repr(fn))
    if backward_rule is None:
        recipe = getattr(fn, "recipe", None)
        backward_rule = "relaxed" if getattr(recipe, "shared_backward_scale", False) else "bitwise"
    if backward_rule not in ("bitwise", "relaxed"):
        raise ValueError(f"backward_rule must be 'bitwise' or 'relaxed', got {backward_rule!r}")

    q, k, v, cu = make_qkv(lengths, heads_q, heads_kv, head_dim, family, dtype, device, seed)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)

    def fresh(x):
        return (torch.randn(x.shape, generator=gen) * PERTURB_GAIN).to(device=device, dtype=dtype)

    do = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)
    pos = torch.arange(T, device=device)
    if layout == "dense":
        pos = pos % S                           # position inside the batch row
        doc_of = torch.arange(T, device=device) // S

        def token_name(i):
            return f"batch {i // S} pos {i % S}"
    else:
        doc_of = torch.bucketize(torch.arange(T, device=device), cu[1:].long(), right=True)

        def token_name(i):
            return f"token {i}"

    def call(q_, k_, v_, do_):
        """out (T, Hq, D) and, with backward, grads (T, H, D) from dO = do_."""
        if layout == "dense":
            B = len(lengths)
            shape = lambda x: x.reshape(B, S, *x.shape[1:])  # noqa: E731
            args = [shape(x).detach().requires_grad_(backward) for x in (q_, k_, v_)]
            out = fn(*args).reshape(T, heads_q, head_dim)
        else:
            args = [x.detach().requires_grad_(backward) for x in (q_, k_, v_)]
            out = fn(*args, cu, max(lengths, default=0))
        grads = None
        if backward:
            grads = torch.autograd.grad(out, args, do_.reshape(out.shape))
            grads = [g.reshape(T, -1, head_dim) for g in grads]
        return out.detach(), grads

    checks = []
    # P1: perturb everything after t; dO zero after t.
    after = pos > t
    m = after[:, None, None]
    do1 = torch.where(m, torch.zeros_like(do), do)
    out0, g0 = call(q, k, v, do1)
    out1, g1 = call(torch.where(m, fresh(q), q), torch.where(m, fresh(k), k), torch.where(m, fresh(v), v), do1)
    checks.append(_result("P1 forward", _changes([("out", out0, out1)], ~after, token_name)))
    if backward:
        names = ("dq", "dk", "dv")
        p1b = _result("P1 backward", _changes(list(zip(names, g0, g1)), ~after, token_name))
        if backward_rule == "relaxed":
            p1b = _relaxed(p1b, names, g0, g1, _exact_grads(q, k, v, cu, do1), ~after)
        checks.append(p1b)
        zero = _nonzero([(n, g) for n, g0_, g1_ in zip(names, g0, g1) for g in (g0_, g1_)], after, token_name)
        checks.append(_result("P1 backward, grads after t == 0", zero))

    # P2: perturb one whole document in the middle (q, k, v and dO).
    perturbed = None
    nonempty = [i for i, n in enumerate(lengths) if n > 0]
    if len(nonempty) >= 2:
        # The longest document with documents on both sides (else the middle one).
        interior = [i for i in nonempty if nonempty[0] < i < nonempty[-1]]
        perturbed = (max(interior, key=lambda i: (lengths[i], -i)) if interior
                     else min(nonempty, key=lambda i: abs(i - (len(lengths) - 1) / 2)))
        inside = doc_of == perturbed
        m = inside[:, None, None]
        out0, g0 = call(q, k, v, do)
        out2, g2 = call(torch.where(m, fresh(q), q), torch.where(m, fresh(k), k),
                        torch.where(m, fresh(v), v), torch.where(m, fresh(do), do))
        checks.append(_result("P2 forward", _changes([("out", out0, out2)], ~inside, token_name)))
        if backward:
            checks.append(_result("P2 backward", _changes(list(zip(("dq", "dk", "dv"), g0, g2)), ~inside,
                                                          token_name)))
    return AuditReport(label, layout, lengths, t, perturbed, checks)


def _result(name, change) -> CheckResult:
    best, count, where = change
    return CheckResult(name, best, count, where, count == 0)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def _exact_grads(q, k, v, cu, do):
    """Float64 gradients of exact causal attention (flamia.reference.attention_exact)."""
    from .reference import attention_exact
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    return torch.autograd.grad(attention_exact(*x64, cu), x64, do.double())


def _relaxed(check: CheckResult, names, g0, g1, exact, rows) -> CheckResult:
    """The relaxed P1 backward rule: per gradient, the relative change at `rows` must be below
    the implementation's own relative error there against float64 (or exactly zero)."""
    change = {n: _rel(b[rows], a[rows]) for n, a, b in zip(names, g0, g1)}
    own = {n: _rel(a[rows], e.reshape(a.shape)[rows]) for n, a, e in zip(names, g0, exact)}
    passed = all(change[n] == 0 or change[n] < own[n] for n in names)
    return CheckResult(check.name, check.max_change, check.n_changed, check.where, passed,
                       "relaxed", change, own)


def recipe_fn(recipe, layout: str = "varlen", causal: bool = True, **kwargs) -> Callable:
    """flamia with `recipe` as an audit callable (deterministic backward)."""
    from .interface import flamia_attn_func, flamia_attn_varlen_func
    from .recipes import get_recipe
    name = getattr(recipe, "name", recipe)
    kwargs.setdefault("deterministic", True)
    if layout == "dense":
        def fn(q, k, v):
            return flamia_attn_func(q, k, v, causal=causal, recipe=recipe, **kwargs)
    elif layout == "varlen":
        def fn(q, k, v, cu_seqlens, max_seqlen):
            return flamia_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                           causal=causal, recipe=recipe, **kwargs)
    else:
        raise ValueError(f"layout must be 'varlen' or 'dense', got {layout!r}")
    fn.__name__ = f"flamia[{name}]"
    fn.recipe = get_recipe(recipe)     # the audit picks its backward rule from the recipe
    return fn


class _CallableModule(types.ModuleType):
    """`flamia.audit` is this module and also the audit function: flamia.audit(fn)."""

    def __call__(self, *args, **kwargs) -> AuditReport:
        return audit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
