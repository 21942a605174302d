"""Which backward a call runs (flamia/ops/config.py) and the dispatch (flamia/ops/backward.py).

Off sm_90 (other GPUs, the CPU interpreter) both kernel recipes take the reference backward on
the kernel forward's operands; on sm_90 the one-pass kernel (tests/gpu covers it).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flamia import reference as R
from flamia.inputs import cu_seqlens_from_lengths, make_qkv
from flamia.ops import backward as B
from flamia.ops.config import ReferenceBwdConfig, Sm90BwdConfig
from flamia.ops.layout import QuantizedQKV, reference_saved

HQ, HKV = 4, 2


@pytest.mark.parametrize("causal", (True, False))
def test_bf16_off_sm90_is_the_reference(causal):
    """The bf16 recipe off sm_90: attention_backward is reference.backward on the forward's
    bf16 operands (reference_saved), bitwise, in the caller's dtype; empty and length-1
    documents included, and a call without tokens."""
    lengths = (37, 0, 1, 70)
    q, k, v, cu = make_qkv(lengths, HQ, HKV, 64, seed=3)
    out, lse, saved = R.forward(q, k, v, cu, "bf16", causal)
    out, lse = out.to(q.dtype), lse.float()
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(q.dtype)
    qkv = QuantizedQKV("bf16", q, k, v, None, None, None, None, False)
    got = B.attention_backward(dout, out, lse, qkv, cu, max(lengths), causal,
                               config=ReferenceBwdConfig(), grad_dtype=torch.float32)
    want = R.backward(dout, out, lse, reference_saved(qkv, causal), cu, "bf16", causal)
    ref = R.backward(dout, out, lse, saved, cu, "bf16", causal)
    for g, w, r in zip(got, want, ref):
        assert torch.equal(g, w)
        assert torch.equal(g, r)     # the same operands as reference.forward's Saved
    z = torch.zeros(0, HQ, 64, dtype=torch.bfloat16)
    qkv0 = QuantizedQKV("bf16", z, z[:, :HKV], z[:, :HKV], None, None, None, None, False)
    dq, dk, dv = B.attention_backward(z, z, torch.zeros(HQ, 0), qkv0,
                                      cu_seqlens_from_lengths([0, 0]), 0)
    assert dq.shape == (0, HQ, 64) and dk.shape == (0, HKV, 64) and dv.dtype == torch.bfloat16


def test_backward_selection(monkeypatch, fake_capability):
    """Which backward a call runs (config.backward_config and select, CUDA faked). On an sm_90
    GPU with Gluon: bf16 (bf16 or fp16 inputs) and fp8 at D=64/128 the one-pass kernel
    (Sm90BwdConfig: 128-row steps at D=64, 64 at D=128), with the persistent Gluon forward for
    fp8 at D=128. fp8 anywhere else (other head dims, other GPUs, no Gluon, the interpreter, the
    CPU): the reference backward on the kernel forward's operands (ReferenceBwdConfig). bf16
    anywhere else (fp32 operands, other head dims, other GPUs, no Gluon, the interpreter, the
    CPU): the same reference backward."""
    from flamia.ops import config as C
    from flamia.recipes import RECIPES
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for D in (64, 128):                                    # the CPU, under the interpreter
        assert isinstance(C.backward_config(D, "fp8", cpu), ReferenceBwdConfig)
        assert isinstance(C.backward_config(D, "bf16", cpu), ReferenceBwdConfig)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # (a GPU process from here on)
    fake_capability((9, 0))
    monkeypatch.setattr(C, "HAVE_GLUON", True)
    for recipe in ("bf16", "fp8", RECIPES["bf16"], RECIPES["fp8"]):
        for D in (64, 128):
            cfg = C.backward_config(D, recipe, cuda)
            assert cfg == Sm90BwdConfig(block_m=128 if D == 64 else 64), (recipe, D, cfg)
            assert C.select(D, recipe, cuda).backward == cfg
    # fp8 at D=128 makes Q^T / dO^T in the kernel up to SM90_FP8_ONCHIP_MAX_SEQLEN tokens per
    # document (max_seqlen), loads the preprocess's copies above it and at D=64
    edge = C.SM90_FP8_ONCHIP_MAX_SEQLEN
    for D, L, onchip in ((128, 512, True), (128, edge, True), (128, edge + 1, False),
                         (128, None, False), (64, 512, False)):
        assert C.backward_config(D, "fp8", cuda, max_seqlen=L).fp8_kmajor_onchip is onchip, (D, L)
    # an H200 never selects it (the saved pass costs less at its DRAM bandwidth)
    fake_capability((9, 0), "NVIDIA H200")
    assert C.fp8_onchip_max_seqlen(cuda) == 0
    for L in (1, 512, edge, None):
        assert not C.backward_config(128, "fp8", cuda, max_seqlen=L).fp8_kmajor_onchip, L
    fake_capability((9, 0))
    assert isinstance(C.backward_config(128, "bf16", cuda, torch.float16), Sm90BwdConfig)
    assert isinstance(C.backward_config(64, "fp8", cuda, torch.float8_e4m3fn), Sm90BwdConfig)
    assert isinstance(C.backward_config(128, "bf16", cuda, torch.float32), ReferenceBwdConfig)
    assert isinstance(C.backward_config(96, "bf16", cuda), ReferenceBwdConfig)
    assert isinstance(C.backward_config(96, "fp8", cuda), ReferenceBwdConfig)
    for D in (64, 128):                                    # the CPU, not interpreting
        assert isinstance(C.backward_config(D, "fp8", cpu), ReferenceBwdConfig)
        assert isinstance(C.backward_config(D, "bf16", cpu), ReferenceBwdConfig)
    sel = C.select(128, "fp8", cuda)
    assert isinstance(sel.forward, C.PersistentFwdConfig)
    sel = C.select(64, "fp8", cuda)
    assert isinstance(sel.forward, C.FwdConfig)
    assert isinstance(C.select(128, "bf16", cuda).forward, C.FwdConfig)

    monkeypatch.setenv("TRITON_INTERPRET", "1")            # the interpreter, sm_90 present
    assert isinstance(C.backward_config(128, "fp8", cuda), ReferenceBwdConfig)
    assert isinstance(C.backward_config(128, "bf16", cuda), ReferenceBwdConfig)
    monkeypatch.delenv("TRITON_INTERPRET")

    monkeypatch.setattr(C, "HAVE_GLUON", False)            # no Gluon
    assert isinstance(C.backward_config(128, "fp8", cuda), ReferenceBwdConfig)
    assert isinstance(C.backward_config(64, "bf16", cuda), ReferenceBwdConfig)
    assert isinstance(C.forward_config(128, "fp8", cuda), C.FwdConfig)
    monkeypatch.setattr(C, "HAVE_GLUON", True)

    fake_capability((10, 0))                 # not Hopper
    for D in (64, 128):
        assert isinstance(C.backward_config(D, "fp8", cuda), ReferenceBwdConfig)
        assert isinstance(C.backward_config(D, "bf16", cuda), ReferenceBwdConfig)
    sel = C.select(128, "fp8", cuda)
    assert isinstance(sel.backward, ReferenceBwdConfig)
    assert isinstance(sel.forward, C.FwdConfig)


def test_emulated_recipes_never_reach_the_kernels(monkeypatch):
    """The kernels implement bf16 and fp8 only: every emulated recipe (and the leaky control)
    runs the reference, on CUDA and under FLAMIA_KERNELS=1 on the CPU alike
    (ops.kernels_available, interface.backend), so no kernel config is ever built for it."""
    from flamia import ops
    from flamia.interface import backend
    from flamia.recipes import RECIPES
    monkeypatch.setenv("FLAMIA_KERNELS", "1")
    assert ops.KERNEL_RECIPES == ("bf16", "fp8")
    on_cuda = SimpleNamespace(is_cuda=True)
    q = torch.zeros(4, HQ, 64)
    for name, recipe in RECIPES.items():
        kernels = not recipe.emulated and not recipe.leaky
        assert (name in ops.KERNEL_RECIPES) == kernels, name
        assert ops.kernels_available(on_cuda, name) == kernels, name
        assert ops.kernels_available(q, name) == kernels, name
        assert backend(q, name) == ("kernels" if kernels else "reference"), name
    assert {n for n, r in RECIPES.items() if r.emulated} >= {"fp8_mixed", "fp8_token"}


def test_dispatch_by_config(monkeypatch):
    """attention_backward runs what its config names (the entry points faked: routing only):
    Sm90BwdConfig the one-pass kernel (its fp8 entry, with the forward's row max, for an fp8
    qkv), ReferenceBwdConfig reference.backward on layout.reference_saved(qkv) cast to the
    caller's dtype; without a config, backward_config's choice (here on the CPU: the
    reference for both recipes)."""
    from flamia.ops import backward_sm90
    T, D = 6, 64
    cu = cu_seqlens_from_lengths([T])
    dout = torch.zeros(T, HQ, D, dtype=torch.bfloat16)
    lse = torch.zeros(HQ, T)
    zb = torch.zeros(T, HQ, D, dtype=torch.bfloat16)
    bf16 = QuantizedQKV("bf16", zb, zb[:, :HKV], zb[:, :HKV], None, None, None, None, False)
    z8 = zb.to(torch.float8_e4m3fn)
    one = torch.ones(HQ, T)
    fp8 = QuantizedQKV("fp8", z8, z8[:, :HKV], z8[:, :HKV], one, one[:HKV], one[:HKV],
                       one[:HKV], True, row_max=torch.zeros(HQ, T))
    calls = []
    grads = (torch.zeros(T, HQ, D), torch.zeros(T, HKV, D), torch.zeros(T, HKV, D))

    def sm90(*args, config=None, **kw):
        calls.append(("sm90", config, args[3] is bf16.q8))
        return grads

    def sm90_fp8(*args, config=None, **kw):
        calls.append(("sm90_fp8", config, args[3] is fp8.row_max and args[4] is fp8))
        return grads

    def saved(qkv, causal):
        return ("saved", qkv, causal)

    def reference(*args):
        qkv = {"fp8": fp8, "bf16": bf16}[args[5]]
        calls.append(("reference", args[5], args[3] == ("saved", qkv, True)))
        return grads

    monkeypatch.setattr(backward_sm90, "attention_backward_sm90", sm90)
    monkeypatch.setattr(backward_sm90, "attention_backward_sm90_fp8", sm90_fp8)
    monkeypatch.setattr(B, "reference_saved", saved)
    monkeypatch.setattr(R, "backward", reference)

    def route(qkv, cfg, grad_dtype=None):
        calls.clear()
        out = B.attention_backward(dout, dout, lse, qkv, cu, T, True, config=cfg,
                                   grad_dtype=grad_dtype)
        assert len(calls) == 1, calls
        return calls[0], out

    sm = Sm90BwdConfig(block_m=128)
    assert route(bf16, sm)[0] == ("sm90", sm, True)
    assert route(fp8, sm)[0] == ("sm90_fp8", sm, True)
    call, out = route(fp8, ReferenceBwdConfig(), torch.float16)
    assert call == ("reference", "fp8", True) and all(g.dtype == torch.float16 for g in out)
    assert route(fp8, None)[0] == ("reference", "fp8", True)
    assert route(bf16, None)[0] == ("reference", "bf16", True)
