"""Pieces every benchmark implementation module shares (baselines, cudnn_graphs, run): the
inputs, the Bound protocol, the skip signal, small helpers, FP8 per-tensor scaling."""
from __future__ import annotations

from dataclasses import dataclass

E4M3_MAX = 448.0


class Skip(Exception):
    """This implementation cannot run this problem; the message says why."""


@dataclass
class Inputs:
    """Packed bf16 inputs on the GPU (no grad): q, dout (T, Hq, D); k, v (T, Hkv, D)."""
    q: object
    k: object
    v: object
    dout: object
    cu_seqlens: object   # int32 (n_docs + 1,)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.dout))


def short_error(e: BaseException, n: int = 300) -> str:
    msg = " ".join(str(e).split())
    msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return msg if len(msg) <= n else msg[: n - 3] + "..."


def sync():
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def sum_groups(x, heads_kv: int):
    """(T, Hq, D) gradient w.r.t. repeated kv -> (T, Hkv, D) (what autograd of repeat gives)."""
    T, H, D = x.shape
    return x.float().reshape(T, heads_kv, H // heads_kv, D).sum(2)


class Bound:
    notes: list
    n_copies: int = 1

    def fwd(self, i: int):
        raise NotImplementedError

    def fwdbwd(self, i: int):
        raise NotImplementedError

    def outputs(self):
        raise NotImplementedError

    def close(self):
        pass



def cudnn_module():
    import cudnn  # the cudnn-frontend python package
    return cudnn


def fp8_quantize_per_tensor(x):
    """Per-tensor current scaling (Transformer Engine style): x8 = e4m3(x * s), s = 448 / amax.
    Returns (x8, descale (1, 1, 1, 1) float32 = 1 / s)."""
    import torch

    amax = x.detach().abs().amax().float()
    s = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))
    x8 = (x.float() * s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, (1.0 / s).reshape(1, 1, 1, 1).contiguous()


def scale_from_amax(amax_t, fmt_max: float = E4M3_MAX):
    """FP8 scale (1, 1, 1, 1) float32 = fmt_max / amax (1 where amax is 0 or not finite)."""
    import torch

    a = amax_t.detach().float().reshape(())
    ok = torch.isfinite(a) & (a > 0)
    s = torch.where(ok, fmt_max / torch.where(ok, a, torch.ones_like(a)), torch.ones_like(a))
    return s.reshape(1, 1, 1, 1).contiguous()
