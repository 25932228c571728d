"""Masks as data (kernels/mask_spec.py), in one process: a MaskSpec's pieces, merged by log-sum-exp, equal dense
attention under the [L, L] mask the spec stands for, forward and backward (given the global output and
log-sum-exp), at every ring position of every ring size (zigzag, Ulysses x ring) and as a ring of one, for padding
(any valid keys, several runs) and packed documents (any lengths, padding), causal or not, grouped K/V heads, T5's
relative bias per distance and dropout; the builder describes what transformers asks for or falls back, by reason.
Which blocks travel where: exactly where a query sees them. The multi-rank wire and the models are covered by
test_ring_attention.py, test_packing.py and test_masks_linear.py."""

import math

import pytest
import torch
from hypothesis import assume, given, strategies as st
from transformers.masking_utils import (
    bidirectional_mask_function, causal_mask_function, sliding_window_causal_mask_function,
)

from shardlib.kernels.mask_spec import (
    MaskSpec, _every_query_sees_a_key, describe, enter_documents, leave_documents, spec_builder,
)
from shardlib.kernels.ring_blocks import (
    RingGeometry, RingLayout, RingProblem, _expand_kv, _fold_kv, _merge, piece_backward, piece_forward,
)
from test_ring_kernel import _keep

SCALE = 0.7


def _ids(draw, batch: int, length: int, kind: str, causal: bool):
    """Query and key ids [batch, length] of ``kind``: every query sees at least one key, as the builder ensures."""
    queries, keys = [], []
    for _ in range(batch):
        if kind == "padding":
            valid = draw(st.lists(st.booleans(), min_size=length, max_size=length))
            valid[0] = True  # a key every query may see (causal: the first)
            key = torch.tensor([0 if v else -1 for v in valid])
            queries.append(torch.zeros(length, dtype=torch.long))
        else:
            lengths = draw(st.lists(st.integers(1, length), min_size=1, max_size=4))
            ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[:length]
            padding = draw(st.integers(0, length - 1))
            key = torch.cat([ids, torch.full((length,), -1)])[:length]
            key[length - padding:] = -1
            queries.append(key)
        keys.append(key)
    return torch.stack(queries), torch.stack(keys)


@st.composite
def problems(draw):
    n, ulysses = draw(st.integers(0, 4)), draw(st.integers(1, 2))  # n = 0: a ring of one (RingGeometry.whole)
    length, batch = draw(st.integers(1, 21)), draw(st.integers(1, 2))
    causal, kind = draw(st.booleans()), draw(st.sampled_from(["padding", "documents"]))
    query_ids, key_ids = _ids(draw, batch, length, kind, causal)
    window = draw(st.one_of(st.none(), st.integers(1, max(length - 1, 1)))) if causal and length > 1 else None
    assume(kind == "documents" or _every_query_sees_a_key(key_ids == 0, causal, window))
    return {"n": n, "ulysses": ulysses, "rank": draw(st.integers(0, max(n - 1, 0))), "length": length,
            "batch": batch, "kv_heads": draw(st.integers(1, 2)), "groups": draw(st.integers(1, 2)),
            "head_dim": draw(st.sampled_from([1, 3, 4])), "spec": MaskSpec(query_ids, key_ids, causal, window),
            "relative": draw(st.booleans()), "dropout": draw(st.sampled_from([0.0, 0.0, 0.3])),
            "softcap": draw(st.sampled_from([0.0, 0.0, 1.5])),
            "seed": draw(st.integers(0, 2 ** 40))}


def _setup(p):
    L = p["length"]
    if p["n"]:
        layout = RingLayout(ranks=p["n"] * p["ulysses"], ring=p["n"])
        geometry = RingGeometry(p["rank"], p["n"], layout.padded(L) // p["n"], L, layout.order(L, "cpu"))
    else:
        geometry = RingGeometry.whole(L, "cpu")
    P = geometry.size * geometry.chunk
    g = torch.Generator().manual_seed(p["seed"] % 2 ** 31)
    hq = p["kv_heads"] * p["groups"]
    q = torch.randn(p["batch"], hq, P, p["head_dim"], generator=g, dtype=torch.float64)
    k, v = (torch.randn(p["batch"], p["kv_heads"], P, p["head_dim"], generator=g, dtype=torch.float64)
            for _ in range(2))
    relative = torch.randn(1, hq, 1, 2 * L - 1, generator=g, dtype=torch.float64) if p["relative"] else None
    problem = RingProblem(None, geometry, SCALE, torch.float64, spec=p["spec"], dropout=p["dropout"], seed=p["seed"],
                          relative_length=L if p["relative"] else 0, softcap=p["softcap"])
    return problem, q, k, v, relative


def _dense(p, problem, q, k, v, relative):
    """softmax(q k^T * scale + bias, under the spec's dense mask) v of this position's real queries."""
    g, L = problem.geometry, problem.geometry.length
    rows = g.positions(g.rank)
    kk, vv = (_expand_kv(t[:, :, :L], p["groups"]) for t in (k, v))
    s = q[:, :, rows] @ kk.transpose(-1, -2) * SCALE
    if p["softcap"]:
        s = torch.tanh(s / p["softcap"]) * p["softcap"]
    if relative is not None:
        s = s + relative[0, :, 0][:, (torch.arange(L)[None, :] - rows[:, None] + L - 1).clamp(0, 2 * L - 2)]
    seen = p["spec"].dense("sdpa", torch.float64).index_select(-2, rows.clamp(max=L - 1))
    probs = torch.softmax(s.masked_fill(~seen, -math.inf), dim=-1)
    if p["dropout"]:
        probs = probs * _keep(p, problem, q.shape)
    return (probs @ vv) * (rows < L)[:, None]  # padding queries compute nothing


def _forward(p, problem, q, k, v, relative):
    g = problem.geometry
    mine = q[:, :, g.positions(g.rank)]
    out = mine.new_zeros(mine.shape)
    lse = mine.new_full(mine.shape[:-1], -math.inf)
    for src in range(g.size):
        kb, vb = (t[:, :, g.positions(src)] for t in (k, v))
        for piece in problem.pieces(src):
            at, cols = (piece.batch, slice(None), piece.rows), (piece.batch, slice(None), piece.cols)
            o_b, lse_b = piece_forward(mine[at], _expand_kv(kb[cols], p["groups"]), _expand_kv(vb[cols], p["groups"]),
                                       SCALE, piece, relative, p["dropout"], p["seed"] + piece.tag, p["softcap"])
            out[at], lse[at] = _merge(out[at], lse[at], o_b, lse_b)
    return mine, out, lse


@given(problems())
def test_spec_pieces_merged_equal_dense_attention(p):
    problem, q, k, v, relative = _setup(p)
    for t in (q, k, v) + ((relative,) if relative is not None else ()):
        t.requires_grad_(True)
    expected = _dense(p, problem, q, k, v, relative)
    grad_out = torch.randn(expected.shape, dtype=torch.float64)
    expected.backward(grad_out)
    rel = None if relative is None else relative.detach()
    with torch.no_grad():
        mine, out, lse = _forward(p, problem, q.detach(), k.detach(), v.detach(), rel)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-10, atol=1e-12)
    g, dq = problem.geometry, torch.zeros_like(mine)
    drel = torch.zeros_like(rel) if rel is not None else None
    for src in range(g.size):
        kb, vb = (t.detach()[:, :, g.positions(src)] for t in (k, v))
        dkv = torch.zeros((2, *kb.shape), dtype=torch.float64)
        for piece in problem.pieces(src):
            at, cols = (piece.batch, slice(None), piece.rows), (piece.batch, slice(None), piece.cols)
            dq_b, dk_b, dv_b, drel_b = piece_backward(
                grad_out[at], mine[at], _expand_kv(kb[cols], p["groups"]), _expand_kv(vb[cols], p["groups"]),
                out[at], lse[at], SCALE, piece, rel, p["dropout"], p["seed"] + piece.tag, p["softcap"])
            dq[at] += dq_b
            dkv[0][cols] += _fold_kv(dk_b, p["groups"])
            dkv[1][cols] += _fold_kv(dv_b, p["groups"])
            if drel_b is not None:
                drel += drel_b
        for name, got, full in (("k", dkv[0], k), ("v", dkv[1], v)):
            torch.testing.assert_close(got, full.grad[:, :, g.positions(src)], rtol=1e-10, atol=1e-12,
                                       msg=f"d{name} of block {src}")
    torch.testing.assert_close(dq, q.grad[:, :, g.positions(g.rank)], rtol=1e-10, atol=1e-12)
    if relative is not None:
        torch.testing.assert_close(drel, relative.grad, rtol=1e-10, atol=1e-12)


@given(problems())
def test_a_ring_of_one_is_the_autograd_function(p):
    """Without sequence parallelism the spec runs through the ring's own autograd Function (no wire)."""
    from shardlib.kernels.ring_blocks import ring_attention

    p = {**p, "n": 0, "rank": 0, "dropout": 0.0}
    problem, q, k, v, relative = _setup(p)
    inputs = [t.requires_grad_(True) for t in (q, k, v)]
    expected = _dense(p, problem, q, k, v, relative)
    got = ring_attention(problem, *inputs, relative)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    grad = torch.randn(expected.shape, dtype=torch.float64)
    mine = torch.autograd.grad(got, inputs, grad)
    theirs = torch.autograd.grad(expected, inputs, grad)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_packed_work_is_the_documents_squares():
    """Eight equal documents in a row: the pieces cover exactly the documents' squares (1/8 of the row's pairs), at a
    ring of one and over a ring of 4 (zigzag; documents span segments)."""
    length, documents = 256, 8
    ids = (torch.arange(length) * documents // length)[None]
    spec = MaskSpec(ids, ids)
    for n in (1, 4):
        layout = RingLayout(ranks=n, ring=n)
        pairs = 0
        for rank in range(n):
            geometry = RingGeometry(rank, n, layout.padded(length) // n, length, layout.order(length, "cpu"))
            problem = RingProblem(None, geometry, 1.0, torch.float64, spec=spec)
            for src in range(n):
                pairs += sum((pc.rows.stop - pc.rows.start) * (pc.cols.stop - pc.cols.start)
                             for pc in problem.pieces(src))
        assert pairs == length * length // documents, (n, pairs)


@given(problems())
def test_a_block_is_sent_exactly_where_a_query_sees_it(p):
    """Ring attention under a spec sends block ``src`` to ring position ``position`` only where
    :meth:`RingProblem.sees` says so: exactly where some real query of the position sees some real key of the block
    under the spec's dense mask (never a block a query needs left behind, never one sent for nothing)."""
    assume(p["n"] > 1)
    problem, *_ = _setup(p)
    g, L = problem.geometry, problem.geometry.length
    seen = p["spec"].dense("sdpa", torch.float64)[:, 0]
    for position in range(g.size):
        rows = g.positions(position)
        for src in range(g.size):
            cols = g.positions(src)
            expected = bool(seen[:, rows[rows < L]][:, :, cols[cols < L]].any())
            assert problem.sees(position, src) == expected, (position, src)


def test_documents_within_a_position_travel_nowhere():
    """Documents each within one ring position's two segments (zigzag: segment p and 2n - 1 - p): no position sees
    another's block, so no K/V is sent; documents spanning positions send only to the positions they span."""
    n, length = 4, 64
    layout = RingLayout(ranks=n, ring=n)
    order = layout.order(length, "cpu")
    chunk = layout.padded(length) // n
    owner = torch.empty(length, dtype=torch.long)
    owner[order] = torch.arange(length) // chunk  # each position's tokens one document
    aligned = MaskSpec(owner[None], owner[None])
    spanning = (torch.arange(length) // 24)[None]  # 24-token documents cross segment boundaries
    for spec, expect_sent in ((aligned, False), (MaskSpec(spanning, spanning), True)):
        sent = [RingProblem(None, RingGeometry(0, n, chunk, length, order), 1.0, torch.float64, spec=spec
                            ).sees(position, src) for position in range(n) for src in range(n) if position != src]
        assert any(sent) == expect_sent and not all(sent)


ARGS = dict(batch_size=2, q_length=6, kv_length=6, device="cpu")


@pytest.mark.parametrize("function,causal", [(bidirectional_mask_function, False), (causal_mask_function, True)])
def test_the_builder_describes_padding(function, causal):
    padding = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    spec = describe(**ARGS, mask_function=function, attention_mask=padding)
    assert isinstance(spec, MaskSpec) and spec.causal == causal
    assert spec.key_ids.tolist() == [[0, 0, 0, 0, -1, -1], [0] * 6] and not spec.query_ids.any()


def test_the_builder_describes_documents_and_leaves_what_it_cannot():
    documents = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 1, 2, 3, 4, 5]])
    token = enter_documents(causal=(documents, documents), bidirectional=(documents, documents))
    try:
        spec = describe(**ARGS, mask_function=causal_mask_function, attention_mask=documents >= 0)
        assert spec.query_ids is spec.key_ids and spec.key_ids.tolist() == documents.tolist()
        windowed = describe(**ARGS, mask_function=sliding_window_causal_mask_function(2), local_size=2)
        assert windowed.causal and windowed.window == 2
        # a mask function it does not know stays dense, and keeps the documents apart
        dense = spec_builder(_sdpa())(**ARGS, mask_function=lambda b, h, q, kv: q >= kv,
                                      attention_mask=documents >= 0)
        assert torch.is_tensor(dense) and not bool(dense[0, 0, 2, 1]) and bool(dense[0, 0, 3, 2])
    finally:
        leave_documents(token)
    left_padding = torch.tensor([[0, 1, 1, 1, 1, 1]] * 2, dtype=torch.bool)
    assert describe(**ARGS, mask_function=causal_mask_function, attention_mask=left_padding) == \
        "a query that sees no key"
    assert describe(**ARGS, mask_function=causal_mask_function, q_offset=3) == "cache offset"
    padding = torch.tensor([[1, 1, 0, 0, 0, 1]] * 2, dtype=torch.bool)  # query 4 sees only padding in its window
    assert describe(**ARGS, mask_function=sliding_window_causal_mask_function(3), attention_mask=padding,
                    local_size=3) == "a query that sees no key"
    assert describe(**ARGS, mask_function=sliding_window_causal_mask_function(6), attention_mask=padding,
                    local_size=6).window is None  # a window past the length: causal
    assert describe(**ARGS, mask_function=sliding_window_causal_mask_function(0), attention_mask=padding,
                    local_size=0) == "a window that hides every key"
    assert describe(**{**ARGS, "device": "meta"}, mask_function=causal_mask_function) == "meta"


def _sdpa():
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask


@st.composite
def cross_problems(draw):
    """A packed decoder's documents against its encoder's: the same documents, other lengths, padding on either
    side (or none in the encoder: then the decoder's padding sees every key)."""
    documents = draw(st.integers(1, 3))
    sides = []
    for _ in range(2):
        lengths = [draw(st.integers(1, 5)) for _ in range(documents)]
        ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((draw(st.integers(0, 3)),),
                                                                                              -1)])
        sides.append(ids[None])
    return {"spec": MaskSpec(*sides), "groups": draw(st.integers(1, 2)), "seed": draw(st.integers(0, 2 ** 30))}


@given(cross_problems())
def test_cross_attention_pieces_equal_dense_attention(p):
    """Cross-attention by documents (CrossGeometry, a ring of one over two sequences): the pieces equal dense
    attention under the spec's mask, forward and backward, for every query that sees a key."""
    from shardlib.kernels.ring_blocks import CrossGeometry, ring_attention

    spec, groups = p["spec"], p["groups"]
    lq, lk = spec.query_ids.shape[1], spec.key_ids.shape[1]
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(1, 2 * groups, lq, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, lk, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    seen = spec.dense("sdpa", torch.float64)
    sees = seen.any(-1, keepdim=True)  # [1, 1, lq, 1]
    s = (q @ _expand_kv(k, groups).transpose(-1, -2) * SCALE).masked_fill(~seen, -math.inf)
    expected = (torch.softmax(s.masked_fill(~sees, 0), -1) @ _expand_kv(v, groups)) * sees
    problem = RingProblem(None, CrossGeometry(lq, lk, "cpu"), SCALE, torch.float64, spec=spec)
    got = ring_attention(problem, q, k, v)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    grad = torch.randn(expected.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_mask_no_document_hook_prepared_is_refused():
    """In a packed seq2seq forward, a mask built outside the encoder's and decoder's hooks (no ids for its kind) is
    refused, naming its kind and sizes, rather than described by padding alone (which would attend across
    documents)."""
    documents = torch.tensor([[0, 0, 1, 1, 1, -1]] * 2)
    token = enter_documents(bidirectional=(documents, documents))
    try:
        with pytest.raises(ValueError, match=r"packing: a causal mask of 6 queries x 6 keys \(batch 2\) in a packed "
                                             r"forward whose document ids for it are none"):
            describe(**ARGS, mask_function=causal_mask_function, attention_mask=documents >= 0)
    finally:
        leave_documents(token)
