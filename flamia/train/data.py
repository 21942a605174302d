"""Training data for `flamia train-check`: the Python standard library's own source, byte-level.

- Corpus: every `*.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages, dist-packages
  and __pycache__ excluded), sorted by relative path; one file = one document. Real text that every
  machine has, no download.
- Split by file: a file is validation when the first 8 bytes of sha256(relative path) / 2**64 is
  below `val_fraction` (5 %); deterministic, machine-independent for the same stdlib (a tiny
  file list with no such file gets its lowest-hash file as validation).
- Tokenizer: bytes 0..255 are tokens 0..255; BOS = 256 starts a file, EOS = 257 ends it. Exact,
  reversible, no vocabulary to train.
- Chunking: a tokenized file longer than `max_doc_len` is cut into chunks of at most that many
  tokens; each chunk is its own document (attention never crosses a chunk boundary).
- Packing: chunks (shuffled per epoch by `data_seed`) fill fixed budgets of `tokens_per_step`
  tokens. A chunk that does not fit is cut at the budget; its rest opens the next batch as a new
  document. Every batch has exactly `tokens_per_step` tokens, int32 `cu_seqlens` over its pieces,
  position ids restarting at 0 in each piece, and next-token targets inside each piece (the last
  token of a piece has none: -100). No document ever straddles a cu_seqlens boundary.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

BOS = 256
EOS = 257
N_TOKENS = 258           # distinct token ids the data uses
IGNORE = -100            # target of a position with no next token in its document

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
    """The selected corpus cannot supply the batches asked for (too few tokens or files): a
    consequence of the settings, which `flamia train-check` reports as a usage error."""


# ----------------------------------------------------------------------------- tokenizer

def encode(data: "bytes | str") -> np.ndarray:
    """Bytes (or UTF-8 text) -> int32 tokens 0..255."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


def encode_document(data: "bytes | str") -> np.ndarray:
    """A whole file: BOS, its bytes, EOS."""
    body = encode(data)
    out = np.empty(body.size + 2, dtype=np.int32)
    out[0], out[1:-1], out[-1] = BOS, body, EOS
    return out


def decode(tokens) -> bytes:
    """Tokens -> bytes; BOS/EOS (and anything >= 256) dropped."""
    t = np.asarray(tokens)
    return t[t < 256].astype(np.uint8).tobytes()


# ----------------------------------------------------------------------------- corpus

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: "str | Path | None" = None) -> list[str]:
    """Sorted relative posix paths of the *.py files under root (default: the stdlib)."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if p.is_file():
            out.append(rel.as_posix())
    return sorted(out)


def _path_hash(relpath: str) -> float:
    return int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def split_of(relpath: str, val_fraction: float = 0.05) -> str:
    """'val' or 'train' for a file, from a hash of its relative path."""
    return "val" if _path_hash(relpath) < val_fraction else "train"


def split_files(files: list[str], val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """(train, val) by `split_of`; when no file hashes into val (a tiny file list), the file with
    the smallest hash is validation, so both splits are non-empty for two files or more."""
    val = [f for f in files if split_of(f, val_fraction) == "val"]
    if not val and len(files) > 1:
        val = [min(files, key=_path_hash)]
    chosen = set(val)
    return [f for f in files if f not in chosen], val


@dataclass
class Corpus:
    """Tokenized files of one split, concatenated: document i is tokens[starts[i]:starts[i]+lengths[i]]."""
    root: str
    files: list[str]
    tokens: np.ndarray      # uint16
    starts: np.ndarray      # int64
    lengths: np.ndarray     # int64

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.starts[i]:self.starts[i] + self.lengths[i]]


def load_corpus(split: str, root=None, val_fraction: float = 0.05, max_files: int | None = None,
                files: list[str] | None = None) -> Corpus:
    """Read and tokenize one split ('train' | 'val' | 'all'). max_files keeps the first files of
    the sorted list *before* splitting (a smaller, still deterministic corpus)."""
    root = Path(root) if root is not None else stdlib_root()
    if files is None:
        files = list_sources(root)
    if max_files is not None:
        files = files[:max_files]
    if split in ("train", "val"):
        files = split_files(files, val_fraction)[split == "val"]
    elif split != "all":
        raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")
    docs = []
    kept = []
    for rel in files:
        try:
            data = (root / rel).read_bytes()
        except OSError:
            continue
        docs.append(encode_document(data))
        kept.append(rel)
    lengths = np.array([d.size for d in docs], dtype=np.int64)
    starts = np.zeros(len(docs), dtype=np.int64)
    if len(docs):
        starts[1:] = np.cumsum(lengths)[:-1]
        tokens = np.concatenate(docs).astype(np.uint16)
    else:
        tokens = np.zeros(0, dtype=np.uint16)
    return Corpus(str(root), kept, tokens, starts, lengths)


def chunk_documents(corpus: Corpus, max_doc_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut documents into chunks of at most max_doc_len tokens.

    Returns (starts, lengths, doc_index), each (n_chunks,) int64: offsets into corpus.tokens, chunk
    lengths, and the file each chunk comes from. Chunks never span two files.
    """
    if max_doc_len < 2:
        raise ValueError("max_doc_len must be >= 2")
    n = (corpus.lengths + max_doc_len - 1) // max_doc_len
    doc_index = np.repeat(np.arange(len(n), dtype=np.int64), n)
    first = np.repeat(np.cumsum(n) - n, n)
    k = np.arange(doc_index.size, dtype=np.int64) - first           # chunk number inside its doc
    starts = corpus.starts[doc_index] + k * max_doc_len
    ends = np.minimum(starts + max_doc_len, corpus.starts[doc_index] + corpus.lengths[doc_index])
    return starts, ends - starts, doc_index


# ----------------------------------------------------------------------------- packing

@dataclass
class Batch:
    """One packed step: T tokens, documents given by cu_seqlens."""
    tokens: np.ndarray        # (T,) int64
    targets: np.ndarray       # (T,) int64, IGNORE where the next token is in another document
    position_ids: np.ndarray  # (T,) int64, restarting at 0 in each document
    cu_seqlens: np.ndarray    # (n_docs + 1,) int32
    max_seqlen: int
    pieces: np.ndarray        # (n_docs, 3) int64: (file index, offset in corpus.tokens, length)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def n_targets(self) -> int:
        return int((self.targets != IGNORE).sum())


def make_batch(corpus: Corpus, pieces: list[tuple[int, int, int]]) -> Batch:
    """Assemble a batch from (file index, start offset, length) pieces, in order."""
    arr = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
    lengths = arr[:, 2]
    cu = np.zeros(len(arr) + 1, dtype=np.int64)
    cu[1:] = np.cumsum(lengths)
    T = int(cu[-1])
    idx = np.repeat(arr[:, 1] - cu[:-1], lengths) + np.arange(T)   # corpus offset of each token
    tokens = corpus.tokens[idx].astype(np.int64)
    pos = np.arange(T, dtype=np.int64) - np.repeat(cu[:-1], lengths)
    targets = np.full(T, IGNORE, dtype=np.int64)
    if T > 1:
        targets[:-1] = tokens[1:]
    targets[cu[1:] - 1] = IGNORE                                     # last token of every piece
    return Batch(tokens, targets, pos, cu.astype(np.int32), int(lengths.max()) if len(arr) else 0, arr)


def pack(corpus: Corpus, chunk_starts: np.ndarray, chunk_lengths: np.ndarray, chunk_doc: np.ndarray,
         tokens_per_step: int, order: "np.ndarray | None" = None, drop_last: bool = True
         ) -> Iterator[Batch]:
    """Pack chunks (in `order`) into batches of exactly tokens_per_step tokens (module docstring)."""
    order = np.arange(chunk_starts.size) if order is None else order
    pieces: list[tuple[int, int, int]] = []
    room = tokens_per_step
    for c in order:
        doc, start, length = int(chunk_doc[c]), int(chunk_starts[c]), int(chunk_lengths[c])
        while length > 0:
            take = min(length, room)
            pieces.append((doc, start, take))
            start += take
            length -= take
            room -= take
            if room == 0:
                yield make_batch(corpus, pieces)
                pieces, room = [], tokens_per_step
    if pieces and not drop_last:
        yield make_batch(corpus, pieces)


def train_batches(corpus: Corpus, tokens_per_step: int, max_doc_len: int, seed: int = 0
                  ) -> Iterator[Batch]:
    """Endless training batches: chunks reshuffled each epoch with (seed, epoch)."""
    starts, lengths, doc = chunk_documents(corpus, max_doc_len)
    if lengths.sum() < tokens_per_step:
        raise DataError(f"training corpus has {int(lengths.sum())} tokens, fewer than one step "
                         f"({tokens_per_step})")
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(starts.size)
        yield from pack(corpus, starts, lengths, doc, tokens_per_step, order)
        epoch += 1


def val_batches(corpus: Corpus, tokens_per_step: int, max_doc_len: int, n_batches: int,
                seed: int = 1234) -> list[Batch]:
    """A fixed validation set: up to n_batches full batches from a seeded order of the val chunks
    (a seeded order, so a small n_batches still samples many files). If the split holds less
    than one full batch, one shorter batch with everything."""
    starts, lengths, doc = chunk_documents(corpus, max_doc_len)
    order = np.random.default_rng([seed]).permutation(starts.size)
    out = []
    for b in pack(corpus, starts, lengths, doc, tokens_per_step, order, drop_last=True):
        out.append(b)
        if len(out) >= n_batches:
            break
    if not out and lengths.size:
        out = list(pack(corpus, starts, lengths, doc, tokens_per_step, order, drop_last=False))[:1]
    return out
