"""Benchmark workloads: loading and validating the JSON suite, workloads from flags, FLOPs.

A workload is causal attention over packed documents (cu_seqlens), bf16 in and out:
q (T, Hq, D), k and v (T, Hkv, D), T = sum(doc_lengths).

FLOPs follow the FlashAttention convention: forward = sum over documents of 2 GEMMs of
2*Hq*D*L^2 flops each, halved by causality, i.e. 2*Hq*D*L^2 per document; backward = 2.5x the
forward; forward+backward = 3.5x the forward.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ENTRY_KEYS = ("name", "heads_q", "heads_kv", "head_dim", "total_tokens", "doc_lengths")
OPTIONAL_ENTRY_KEYS = ("description", "about", "note")
MAX_HEAD_DIM = 256
BWD_FACTOR = 2.5


class WorkloadError(ValueError):
    """A workloads file or a workload given by flags is invalid. The message says where and why."""


@dataclass(frozen=True)
class Problem:
    """The shape of one attention problem: packed causal documents and heads."""
    doc_lengths: tuple[int, ...]
    heads_q: int
    heads_kv: int
    head_dim: int

    @property
    def T(self) -> int:
        return int(sum(self.doc_lengths))

    @property
    def n_docs(self) -> int:
        return len(self.doc_lengths)

    @property
    def max_len(self) -> int:
        return max(self.doc_lengths)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def problem(self) -> "Problem":
        """The bare shape (a plain Problem: hashable the same way for every source)."""
        return Problem(self.doc_lengths, self.heads_q, self.heads_kv, self.head_dim)


@dataclass(frozen=True, kw_only=True)
class Workload(Problem):
    """A named problem from a workloads file or from flags."""
    name: str
    description: str = ""

    @property
    def total_tokens(self) -> int:
        return self.T

    def shape_str(self) -> str:
        return f"Hq={self.heads_q} Hkv={self.heads_kv} D={self.head_dim}"

    def docs_str(self, limit: int = 6) -> str:
        """Compact description of the document lengths, e.g. '2048x16' or '2167,130,...(22)'."""
        lens = self.doc_lengths
        if len(set(lens)) == 1:
            return f"{lens[0]}x{len(lens)}" if len(lens) > 1 else f"{lens[0]}"
        if len(lens) <= limit:
            return ",".join(str(n) for n in lens)
        return ",".join(str(n) for n in lens[:limit]) + f",...({len(lens)} docs)"

    def to_dict(self) -> dict:
        return {
            "name": self.name, "heads_q": self.heads_q, "heads_kv": self.heads_kv,
            "head_dim": self.head_dim, "total_tokens": self.total_tokens,
            "doc_lengths": list(self.doc_lengths),
        }


# ---------------------------------------------------------------------------------------------
# FLOPs


def fwd_flops(doc_lengths: Sequence[int], heads_q: int, head_dim: int) -> float:
    """Causal forward FLOPs: sum over docs of 2 * 2 * Hq * D * L^2 / 2."""
    return float(sum(2 * 2 * heads_q * head_dim * int(L) * int(L) / 2 for L in doc_lengths))


def bwd_flops(doc_lengths: Sequence[int], heads_q: int, head_dim: int) -> float:
    return BWD_FACTOR * fwd_flops(doc_lengths, heads_q, head_dim)


def fwdbwd_flops(doc_lengths: Sequence[int], heads_q: int, head_dim: int) -> float:
    return (1.0 + BWD_FACTOR) * fwd_flops(doc_lengths, heads_q, head_dim)


def workload_flops(w: Workload) -> dict:
    return {
        "fwd": fwd_flops(w.doc_lengths, w.heads_q, w.head_dim),
        "bwd": bwd_flops(w.doc_lengths, w.heads_q, w.head_dim),
        "fwdbwd": fwdbwd_flops(w.doc_lengths, w.heads_q, w.head_dim),
    }


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s for `flops` done in `ms` milliseconds."""
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# Validation


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _validate_entry(entry, where: str) -> tuple[Workload | None, list[str]]:
    errors: list[str] = []
    if not isinstance(entry, dict):
        return None, [f"{where}: must be an object, got {type(entry).__name__}"]
    name = entry.get("name")
    if isinstance(name, str) and name.strip():
        where = f"{where} ({name!r})"
    unknown = sorted(set(entry) - set(ENTRY_KEYS) - set(OPTIONAL_ENTRY_KEYS))
    if unknown:
        errors.append(f"{where}: unknown key(s) {unknown}; allowed: {list(ENTRY_KEYS)}")
    for key in ("name", "heads_q", "heads_kv", "head_dim", "doc_lengths"):
        if key not in entry:
            errors.append(f"{where}: missing required key {key!r}")
    if "name" in entry:
        if not isinstance(name, str) or not name.strip():
            errors.append(f"{where}: 'name' must be a non-empty string, got {name!r}")
        elif not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
            errors.append(f"{where}: 'name' may only contain letters, digits, '_', '-', '.'")
    for key in ("heads_q", "heads_kv", "head_dim"):
        if key in entry and not (_is_int(entry[key]) and entry[key] > 0):
            errors.append(f"{where}: {key!r} must be a positive integer, got {entry[key]!r}")
    hq, hkv, d = entry.get("heads_q"), entry.get("heads_kv"), entry.get("head_dim")
    if _is_int(hq) and _is_int(hkv) and hq > 0 and hkv > 0 and hq % hkv != 0:
        errors.append(f"{where}: heads_q ({hq}) must be divisible by heads_kv ({hkv}) (GQA)")
    if _is_int(d) and d > 0 and (d % 8 != 0 or d > MAX_HEAD_DIM):
        errors.append(f"{where}: head_dim must be a multiple of 8 and at most {MAX_HEAD_DIM}, got {d}")
    lens = entry.get("doc_lengths")
    lens_ok = False
    if "doc_lengths" in entry:
        if not isinstance(lens, list) or not lens:
            errors.append(f"{where}: 'doc_lengths' must be a non-empty list of positive integers")
        else:
            bad = [(i, x) for i, x in enumerate(lens) if not (_is_int(x) and x > 0)]
            if bad:
                shown = ", ".join(f"[{i}]={x!r}" for i, x in bad[:5])
                errors.append(f"{where}: 'doc_lengths' must hold positive integers; bad: {shown}")
            else:
                lens_ok = True
    if "total_tokens" in entry:
        tt = entry["total_tokens"]
        if not (_is_int(tt) and tt > 0):
            errors.append(f"{where}: 'total_tokens' must be a positive integer, got {tt!r}")
        elif lens_ok and sum(lens) != tt:
            errors.append(f"{where}: doc_lengths sum to {sum(lens)}, but total_tokens is {tt}")
    if errors:
        return None, errors
    desc = entry.get("description") or entry.get("about") or entry.get("note") or ""
    return Workload(name=name, heads_q=hq, heads_kv=hkv, head_dim=d,
                    doc_lengths=tuple(int(x) for x in lens), description=str(desc)), []


def parse_workloads(data, source: str = "<workloads>") -> list[Workload]:
    """Validate parsed JSON (an object with a 'workloads' list, or a bare list) into Workloads.

    Raises WorkloadError listing every problem found.
    """
    if isinstance(data, dict):
        if "workloads" not in data:
            raise WorkloadError(f"{source}: top-level object has no 'workloads' list")
        entries = data["workloads"]
    else:
        entries = data
    if not isinstance(entries, list):
        raise WorkloadError(f"{source}: 'workloads' must be a list, got {type(entries).__name__}")
    if not entries:
        raise WorkloadError(f"{source}: 'workloads' is empty")
    out, errors, seen = [], [], {}
    for i, entry in enumerate(entries):
        w, errs = _validate_entry(entry, f"{source}: workloads[{i}]")
        errors.extend(errs)
        if w is not None:
            if w.name in seen:
                errors.append(f"{source}: workloads[{i}]: duplicate name {w.name!r} "
                              f"(also workloads[{seen[w.name]}])")
            seen.setdefault(w.name, i)
            out.append(w)
    if errors:
        raise WorkloadError("invalid workloads:\n  " + "\n  ".join(errors))
    return out


def default_workloads_path() -> Path:
    """The packaged suite, flamia/data/workloads.json."""
    try:
        from importlib.resources import files
        p = files("flamia").joinpath("data/workloads.json")
        return Path(str(p))
    except Exception:  # pragma: no cover - unusual packaging
        return Path(__file__).resolve().parent.parent / "data" / "workloads.json"


def load_workloads(path: str | Path | None = None) -> tuple[list[Workload], str]:
    """Load and validate a workloads file (default: the packaged suite). Returns (workloads, path)."""
    p = Path(path) if path is not None else default_workloads_path()
    if not p.exists():
        raise WorkloadError(f"workloads file not found: {p}")
    if p.is_dir():
        raise WorkloadError(f"workloads path is a directory, not a JSON file: {p}")
    try:
        text = p.read_text()
    except OSError as e:
        raise WorkloadError(f"cannot read workloads file {p}: {e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{p}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    return parse_workloads(data, str(p)), str(p)


# ---------------------------------------------------------------------------------------------
# Workloads from flags


def parse_docs(spec: str) -> tuple[int, ...]:
    """'2048x16' -> 16 docs of 2048; '8192,4096,17' -> three docs; '8192x2,512' mixes both."""
    if spec is None or not str(spec).strip():
        raise WorkloadError("--docs: empty specification")
    out: list[int] = []
    for part in str(spec).replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:[xX*](\d+))?", part)
        if not m:
            raise WorkloadError(f"--docs: cannot parse {part!r} in {spec!r}; use e.g. '2048x16' "
                                f"(16 documents of 2048 tokens) or '8192,4096,17'")
        length, count = int(m.group(1)), int(m.group(2) or 1)
        if length <= 0 or count <= 0:
            raise WorkloadError(f"--docs: lengths and counts must be positive, got {part!r}")
        out.extend([length] * count)
    return tuple(out)


def parse_heads(spec: str) -> tuple[int, int]:
    """'32/8' -> (32, 8); '32' -> (32, 32)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:[/:]\s*(\d+)\s*)?", str(spec))
    if not m:
        raise WorkloadError(f"--heads: cannot parse {spec!r}; use HQ/HKV, e.g. 32/8, or HQ")
    hq = int(m.group(1))
    hkv = int(m.group(2)) if m.group(2) else hq
    if hq <= 0 or hkv <= 0:
        raise WorkloadError(f"--heads: head counts must be positive, got {spec!r}")
    if hq % hkv:
        raise WorkloadError(f"--heads: heads_q ({hq}) must be divisible by heads_kv ({hkv})")
    return hq, hkv


def workload_from_flags(docs: str, heads: str = "32/8", head_dim: int = 128,
                        name: str | None = None) -> Workload:
    lens = parse_docs(docs)
    hq, hkv = parse_heads(heads)
    if not (isinstance(head_dim, int) and head_dim > 0 and head_dim % 8 == 0
            and head_dim <= MAX_HEAD_DIM):
        raise WorkloadError(f"--head-dim must be a positive multiple of 8 up to {MAX_HEAD_DIM}, "
                            f"got {head_dim}")
    if name is None:
        name = "flags_" + re.sub(r"[^A-Za-z0-9_.\-]", "_", docs.replace(" ", ""))
        if len(name) > 40:
            name = f"flags_{len(lens)}docs_T{sum(lens)}"
    entry = {"name": name, "heads_q": hq, "heads_kv": hkv, "head_dim": head_dim,
             "total_tokens": sum(lens), "doc_lengths": list(lens)}
    return parse_workloads([entry], "flags")[0]


def select(workloads: list[Workload], only: str | None) -> list[Workload]:
    """Keep the workloads named in a comma-separated `only` (in the file's order)."""
    if not only:
        return workloads
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {w.name for w in workloads}
    missing = [n for n in names if n not in known]
    if missing:
        raise WorkloadError(f"--only: unknown workload(s) {missing}; available: "
                            f"{', '.join(w.name for w in workloads)}")
    return [w for w in workloads if w.name in set(names)]


# ---------------------------------------------------------------------------------------------
# Accuracy slice


@dataclass(frozen=True)
class AccuracySlice(Problem):
    truncated: bool = False

    def describe(self) -> str:
        docs = ",".join(str(n) for n in self.doc_lengths) if len(self.doc_lengths) <= 4 else \
            f"{len(self.doc_lengths)} docs"
        return (f"first {sum(self.doc_lengths)} tokens ({docs}{', truncated' if self.truncated else ''}),"
                f" heads {self.heads_q}/{self.heads_kv}")


def accuracy_slice(w: Workload, max_tokens: int = 2048, max_heads_q: int = 4) -> AccuracySlice:
    """The leading documents of `w` that fit in `max_tokens` (the first one truncated if it alone
    is longer), with the head counts reduced to at most `max_heads_q`, keeping the GQA ratio where
    possible."""
    lens, total = [], 0
    for n in w.doc_lengths:
        if total + n > max_tokens:
            break
        lens.append(n)
        total += n
    truncated = False
    if not lens:
        lens, truncated = [min(w.doc_lengths[0], max_tokens)], True
    hq = min(w.heads_q, max_heads_q)
    hkv = max(1, (hq * w.heads_kv) // w.heads_q)
    while hq % hkv:
        hkv -= 1
    return AccuracySlice(tuple(lens), hq, hkv, w.head_dim, truncated)
