"""K-major copies (flamia/ops/kmajor.py) under the Triton interpreter: layout and bytes."""
from __future__ import annotations

import pytest
import torch

from benchmarks.tools.compile import fake_state
from flamia.inputs import cu_seqlens_from_lengths
from flamia.ops import interpreting
from flamia.ops.kmajor import (kmajor_copies, kmajor_copy, kmajor_layout, mma_key_order_host,
                               mma_order16_host, padded_columns)

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU tests under the Triton interpreter")


def _expected_columns(lengths):
    cols, base = [], 0
    for n in lengths:
        cols += range(base, base + n)
        base += (n + 15) // 16 * 16
    return torch.tensor(cols, dtype=torch.long), base


@pytest.mark.parametrize("lengths", [(37, 0, 1, 70), (16, 32), (5,), (0, 0)])
def test_layout_and_copy(lengths):
    T, H, D = sum(lengths), 3, 32
    cu = cu_seqlens_from_lengths(lengths)
    pcu, tok_of_col, Tp = kmajor_layout(cu, T)
    cols, used = _expected_columns(lengths)
    assert Tp == padded_columns(T, len(lengths)) and Tp >= used
    assert (pcu % 16 == 0).all() and pcu[-1] == used
    assert torch.equal(tok_of_col[cols].long(), torch.arange(T))
    pad = torch.ones(Tp, dtype=torch.bool)
    pad[cols] = False
    assert (tok_of_col[pad] == -1).all()
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (T, H, D), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    dst = torch.full((H, D, Tp), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)   # NaN poison
    kmajor_copy(src, dst, tok_of_col, block_c=16)
    b = dst.view(torch.uint8)
    assert torch.equal(b[:, :, cols], src.view(torch.uint8).permute(1, 2, 0))
    assert (b[:, :, pad] == 0).all()


def test_plain_copy_zero_fills_past_T():
    T, H, D = 45, 2, 16
    src = torch.randint(0, 256, (T, H, D), dtype=torch.uint8)
    dst = torch.full((H, D, 64), 0xFF, dtype=torch.uint8)
    kmajor_copy(src, dst, block_c=16)
    assert torch.equal(dst[:, :, :T], src.permute(1, 2, 0))
    assert (dst[:, :, T:] == 0).all()


def test_mma_order_is_the_wgmma_register_permutation():
    """mma_order16 maps an FP8 wgmma A-operand position to the key the fp32 accumulator of
    S = Q K^T holds in the same thread and register byte: lane group c (of a quad) holds keys
    2c, 2c+1 (+8, +16, +24) in the accumulator and A positions 4c..4c+3, 16+4c..19+4c."""
    p = torch.arange(64)
    key = mma_order16_host(p)
    assert torch.equal(torch.sort(key).values, p)                  # a permutation
    assert torch.equal(key // 16, p // 16)                          # inside 16-key groups
    lane_of_a_pos = (p % 16) // 4                                   # A operand, 8-bit, k32
    lane_of_key = (key % 8) // 2                                    # fp32 accumulator columns
    assert torch.equal(lane_of_a_pos, lane_of_key)


def test_mma_key_order_puts_column_mma_order16_p_at_p():
    """The one reshape / permute the kernels apply to an A operand (kmajor.mma_key_order): column
    p of the result is column mma_order16(p) of the input, in every 16-column group."""
    x = torch.arange(3 * 64).reshape(3, 64)
    assert torch.equal(mma_key_order_host(x), x[:, mma_order16_host(torch.arange(64))])


def test_plain_copy_in_mma_order():
    T, H, D = 45, 2, 16
    src = torch.randint(0, 256, (T, H, D), dtype=torch.uint8)
    dst = torch.full((H, D, 64), 0xFF, dtype=torch.uint8)
    kmajor_copy(src, dst, block_c=16, mma_order=True)
    tok = mma_order16_host(torch.arange(64))
    ok = tok < T
    assert torch.equal(dst[:, :, ok], src[tok[ok]].permute(1, 2, 0))
    assert (dst[:, :, ~ok] == 0).all()
    with pytest.raises(ValueError, match="mma_order"):
        kmajor_copy(src, torch.zeros(H, D, 40, dtype=torch.uint8), mma_order=True)


def test_padded_copy_in_mma_order():
    """The padded layout in key order (the dK/dV kernel's qT8 / doT8 with key_order): column c
    holds what column mma_order16(c) holds in token order, pads zero, no group leaves its
    document (documents start at multiples of 16)."""
    lengths = (37, 0, 16, 1, 50)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T, H, D = sum(lengths), 2, 16
    pcu, tok_of_col, Tp = kmajor_layout(cu, T)
    src = torch.randint(1, 256, (T, H, D), dtype=torch.uint8)
    plain = torch.full((H, D, Tp), 0xFF, dtype=torch.uint8)
    keyed = torch.full((H, D, Tp), 0xFF, dtype=torch.uint8)
    kmajor_copy(src, plain, tok_of_col, block_c=16)
    kmajor_copy(src, keyed, tok_of_col, block_c=16, mma_order=True)
    assert torch.equal(keyed, plain[:, :, mma_order16_host(torch.arange(Tp))])
    doc_of_col = torch.bucketize(torch.arange(Tp), pcu[1:].long(), right=True)
    assert torch.equal(doc_of_col, doc_of_col[mma_order16_host(torch.arange(Tp))])


@pytest.mark.parametrize("n", [2, 3])
def test_copies_in_one_launch_equal_the_separate_copies(n):
    """kmajor_copies (the backward's dO, q, k copies in one launch): byte for byte what the
    separate copies write, with different head counts, strides and orders per copy, every
    column written (poisoned destinations)."""
    lengths = (37, 0, 16, 1, 50)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T, D = sum(lengths), 16
    _, tok_of_col, Tp = kmajor_layout(cu, T)
    g = torch.Generator().manual_seed(n)
    heads, orders = (3, 3, 1)[:n], (True, False, False)[:n]
    # the third source is a strided (T, H, D) view: token stride larger than H * D
    srcs = [torch.randint(1, 256, (T, h, D), generator=g, dtype=torch.uint8) for h in heads[:2]]
    if n == 3:
        srcs.append(torch.randint(1, 256, (T, 2, D), generator=g, dtype=torch.uint8)[:, :1])
    want = [torch.full((h, D, Tp), 0xFF, dtype=torch.uint8) for h in heads]
    got = [torch.full((h, D, Tp), 0xFF, dtype=torch.uint8) for h in heads]
    for src, dst, order in zip(srcs, want, orders):
        kmajor_copy(src, dst, tok_of_col, block_c=16, mma_order=order)
    kmajor_copies(list(zip(srcs, got, orders)), tok_of_col, block_c=16)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="same D and Tp"):
        kmajor_copies([(srcs[0], got[0], False), (srcs[1], got[1][:, :, :16].contiguous(), False)],
                      tok_of_col)


def test_bad_arguments():
    src = torch.zeros(8, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="1-byte"):
        kmajor_copy(src.float(), torch.zeros(2, 16, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="same heads"):
        kmajor_copy(src, torch.zeros(3, 16, 16, dtype=torch.uint8))


LOG2E = 1.4426950408889634


def _packed_query_vectors(st):
    """The fp8 dK/dV kernel's (Hq * 4, Tp) query vectors by torch ops: the padded lse, Delta,
    sq, sdo (backward_gluon.padded_vectors), lse folded with sdo, interleaved per head."""
    from flamia.ops import backward_gluon as G
    lse, delta, sq, sdo = G.padded_vectors(st)
    vecs = (lse * LOG2E - torch.log2(sdo), delta, sq, sdo)
    return torch.stack(vecs, dim=1).reshape(-1, lse.shape[1])


def _random_vectors(st, seed):
    g = torch.Generator().manual_seed(seed)
    for x in (st.lse, st.delta, st.sq):
        x.copy_(torch.randn(x.shape, generator=g) * 30)
    for x in (st.sdo, st.sk, st.sv):
        x.copy_(torch.exp2(torch.randint(-30, 10, x.shape, generator=g).float()))
    if st.T:
        st.sdo[1, st.T // 2] = float("nan")         # NaN / zero sdo, -inf lse: as torch gives
        st.sdo[2, 0] = 0.0
        st.lse[0, 0] = float("-inf")
    return g


@pytest.mark.parametrize("lengths", [(300, 0, 1, 77, 45), (5,), (16, 32), (0, 3)])
def test_copies_and_rows_in_one_launch_equal_torch(lengths):
    """kmajor_copies_and_rows (the backward's K-major copies and its padded per-token vectors
    after the preprocess kernel): the copies byte for byte kmajor_copies', poisoned destinations;
    the fp8 dK/dV kernel's packed query vectors (lse folded with sdo) and the dQ kernel's key
    vectors bitwise the torch gathers, pads (+inf / 0) included, every buffer TMA-legal."""
    from flamia.ops import backward_gluon as G
    from flamia.ops.kmajor import kmajor_copies_and_rows
    st = fake_state(64, T=sum(lengths), Hq=4, Hkv=2, lengths=list(lengths))
    g = _random_vectors(st, 2)
    T, D = st.T, 16
    srcs = [torch.randint(1, 256, (T, h, D), generator=g, dtype=torch.uint8) for h in (4, 4, 2)]
    orders = (True, False, False)
    want = [torch.full((s.shape[1], D, st.Tp), 0xFF, dtype=torch.uint8) for s in srcs]
    got = [w.clone() for w in want]
    kmajor_copies(list(zip(srcs, want, orders)), st.tok_of_col, block_c=64)
    packed, kv = kmajor_copies_and_rows(list(zip(srcs, got, orders)), *G.vector_gathers(st),
                                        st.tok_of_col, st.Tp)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ref = _packed_query_vectors(st)
    assert packed.shape == ref.shape == (4 * 4, st.Tp) and packed.is_contiguous()
    assert torch.equal(ref.view(torch.int32), packed.view(torch.int32))
    for a, b in zip(G.padded_kv_vectors(st), kv):
        assert b.shape == a.shape and b.dtype == torch.float32 and b.is_contiguous()
        assert (b.data_ptr() % 16) == 0 and (b.stride(0) * 4) % 16 == 0
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    with pytest.raises(ValueError, match="columns"):
        kmajor_copies_and_rows(list(zip(srcs, got, orders)), *G.vector_gathers(st),
                               st.tok_of_col, st.Tp + 16)


def test_padded_vectors_layout():
    """The fp8_mixed kernels' torch gathers: document d's tokens at columns pcu[d].., pads lse
    +inf and 0 (key vectors 0); TMA-legal (16 | pcu, 16-byte row stride)."""
    from flamia.ops import backward_gluon as G
    lengths = [300, 0, 1, 777, 1024, 45]
    st = fake_state(64, T=sum(lengths), Hq=4, Hkv=2, lengths=lengths, recipe="fp8_mixed")
    _random_vectors(st, 0)
    pcu, cu = st.pcu.tolist(), st.cu.tolist()
    assert all(c % 16 == 0 for c in pcu) and st.Tp % 16 == 0
    for vecs, srcs, fills in ((G.padded_vectors(st), (st.lse, st.delta, st.sq, st.sdo),
                               (float("inf"), 0.0, 0.0, 0.0)),
                              (G.padded_kv_vectors(st), (st.sk, st.sv), (0.0, 0.0))):
        for y, x, fill in zip(vecs, srcs, fills):
            assert y.shape == (x.shape[0], st.Tp) and y.is_contiguous()
            assert (y.stride(0) * 4) % 16 == 0
            for d in range(len(lengths)):
                n = cu[d + 1] - cu[d]
                assert torch.equal(y[:, pcu[d]:pcu[d] + n].view(torch.int32),
                                   x[:, cu[d]:cu[d + 1]].view(torch.int32))
                assert bool((y[:, pcu[d] + n:pcu[d + 1]] == fill).all())


def test_preprocess_gathers_the_gluon_kernels_vectors():
    """On an sm_90 state (GluonDkdvConfig) launch_preprocess writes qT8 / doT8 in the dK/dV
    config's column orders and gathers the packed query vectors and the key vectors with the
    copies (state.query_vecs / kv_vecs, what the Gluon launchers read); on the Triton state
    neither, and token order."""
    from flamia.ops import backward as B
    from flamia.ops import backward_gluon as G
    for gluon, D in ((True, 64), (True, 128), (False, 64)):
        st = fake_state(D, T=40, Hq=4, Hkv=2, lengths=[33, 7], gluon=gluon)
        st.interp = True                         # (run here, under the interpreter)
        _random_vectors(st, 3)
        g = torch.Generator().manual_seed(4)
        st.dout.copy_(torch.randn(st.dout.shape, generator=g))
        st.q8.copy_(torch.randn(st.q8.shape, generator=g).to(st.q8.dtype))
        B.launch_preprocess(st)
        order = gluon and D == 64                # (gluon_dkdv_config: key orders at D=64)
        assert (st.cfg.dkdv is not None) == gluon
        perm = mma_order16_host(torch.arange(st.Tp)) if order else torch.arange(st.Tp)
        want = torch.zeros(4, D, st.Tp, dtype=torch.uint8)
        kmajor_copy(st.q8.view(torch.uint8), want, st.tok_of_col)
        assert torch.equal(st.qT8.view(torch.uint8), want[:, :, perm])
        if gluon:
            assert torch.equal(_packed_query_vectors(st).view(torch.int32),
                               st.query_vecs.view(torch.int32))
            for a, b in zip(G.padded_kv_vectors(st), st.kv_vecs):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        else:
            assert st.query_vecs is None and st.kv_vecs is None
