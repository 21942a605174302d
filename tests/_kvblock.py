"""The fp8 backward kernel's operands built from the reference forward (flamia.reference Saved):
what tests/gpu/test_backward_sm90_fp8_gpu.py feeds the kernel, and the contract
flamia.ops.quantize.quantize_qkv's token-block fields must meet (tests/test_kvblock_contract.py)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from flamia import reference as R

RECIPE = "fp8"


def qkv_from_saved(saved: R.Saved, cu: torch.Tensor, causal: bool) -> SimpleNamespace:
    """The kernel's operands (layout.QuantizedQKV's fp8 fields) from the reference
    forward's: the same bytes and scales, (H, T) scale vectors, Vn the visible max of the V
    copies' 2-norms (reference.backward_scales)."""
    f8 = torch.float8_e4m3fn
    vals = lambda op: op.values.to(f8).contiguous()                          # noqa: E731
    tok = lambda op: op.token_scale().transpose(0, 1).float().contiguous()  # noqa: E731
    vnb = saved.v.dequant().norm(dim=-1)
    vnt = saved.v_diag.dequant().norm(dim=-1) if causal else vnb
    vn = R._per_document(cu, lambda o, d: R._visible_max(o, d, causal), vnb, vnt)
    ns = SimpleNamespace(q8=vals(saved.q), sq=tok(saved.q), k8=vals(saved.k), sk=tok(saved.k),
                         v8=vals(saved.v), sv=tok(saved.v), vnorm=vn.transpose(0, 1).float().contiguous(),
                         rotated=saved.rotation is not None, recipe=RECIPE,
                         k8_diag=None, v8_diag=None, sk_diag=None, sv_diag=None)
    if causal:
        ns.k8_diag, ns.sk_diag = vals(saved.k_diag), tok(saved.k_diag)
        ns.v8_diag, ns.sv_diag = vals(saved.v_diag), tok(saved.v_diag)
    return ns


def random_case(rng):
    """(lengths, Hq, Hkv, D, causal) of one GPU fuzz case drawn from random.Random rng: 1-6
    documents of 0, 1, 2, 3-200 or 200-900 tokens (never all empty), GQA groups 1/2/4/8 over 1,
    2 or 4 KV heads, D 64 or 128, causal 4 times in 5."""
    n_docs = rng.randint(1, 6)
    lengths = [rng.choice([0, 1, 2, rng.randint(3, 200), rng.randint(200, 900)])
               for _ in range(n_docs)]
    if sum(lengths) == 0:
        lengths.append(5)
    Hkv = rng.choice([1, 2, 4])
    Hq = Hkv * rng.choice([1, 2, 4, 8])
    D = rng.choice([64, 128])
    causal = rng.random() < 0.8
    return lengths, Hq, Hkv, D, causal
