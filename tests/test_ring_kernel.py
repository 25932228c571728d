"""The ring-attention pieces and their merge, in one process: for ring position r of n, every piece's forward merged
by log-sum-exp and every piece's backward (given the global output and log-sum-exp) equal the attention of r's
queries over the whole sequence computed densely with autograd, in the zigzag layout (plain ring and Ulysses x
ring): padding, masks (boolean and additive), causality, grouped K/V heads, T5's relative bias per distance and
dropout (the same keep masks). The wire between ranks is covered by the multi-rank tests (test_ring_attention.py)."""

import math

import torch
from hypothesis import given, strategies as st

from shardlib.kernels.ring_attention import _self_mask
from shardlib.kernels.ring_blocks import (
    RingGeometry, RingLayout, RingProblem, _dropout_keep, _expand_kv, _fold_kv, _merge, piece_backward,
    piece_forward,
)

SCALE = 0.7


@st.composite
def problems(draw):
    n, ulysses = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    return {"n": n, "ulysses": ulysses, "rank": draw(st.integers(0, n - 1)), "length": draw(st.integers(1, 19)),
            "batch": draw(st.integers(1, 2)), "kv_heads": draw(st.integers(1, 2)), "groups": draw(st.integers(1, 2)),
            "head_dim": draw(st.sampled_from([1, 3, 4])),
            "mask": draw(st.sampled_from([None, "bool", "additive", "causal"])),
            "relative": draw(st.booleans()), "dropout": draw(st.sampled_from([0.0, 0.0, 0.3])),
            "seed": draw(st.integers(0, 2 ** 40))}


def _setup(p, dtype=torch.float64):
    layout = RingLayout(ranks=p["n"] * p["ulysses"], ring=p["n"])
    L, P = p["length"], layout.padded(p["length"])
    order = layout.order(L, "cpu")
    geometry = RingGeometry(p["rank"], p["n"], P // p["n"], L, order)
    g = torch.Generator().manual_seed(p["seed"] % 2 ** 31)
    hq = p["kv_heads"] * p["groups"]
    q = torch.randn(p["batch"], hq, P, p["head_dim"], generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(p["batch"], p["kv_heads"], P, p["head_dim"], generator=g, dtype=torch.float64).to(dtype)
            for _ in range(2))
    relative = torch.randn(1, hq, 1, 2 * L - 1, generator=g, dtype=torch.float64) if p["relative"] else None
    mask = None
    if p["mask"] in ("bool", "additive"):
        seen = torch.rand(p["batch"], 1, L, L, generator=g) > 0.4
        seen[..., 0] = True  # every row sees a key: HF's padding masks keep the first token
        mask = seen if p["mask"] == "bool" else torch.zeros(seen.shape, dtype=torch.float64).masked_fill(
            ~seen, torch.finfo(torch.float64).min)
    return geometry, q, k, v, relative, mask


def _problem(p, geometry, mask, acc=torch.float64):
    problem = RingProblem(None, geometry, SCALE, acc, causal=p["mask"] == "causal", dropout=p["dropout"],
                          seed=p["seed"])
    if mask is not None:
        problem.mask, problem.visible = _self_mask(mask, geometry, acc)
    problem.relative_length = p["length"] if p["relative"] else 0
    return problem


def _keep(p, problem, shape) -> torch.Tensor:
    """The pieces' keep masks (scaled) in a dense [b, h, rows, L] in natural key order (1 where no piece is)."""
    g = problem.geometry
    keep = torch.ones(*shape[:2], g.chunk, g.size * g.chunk, dtype=torch.float64)
    for src in range(g.size):
        for piece in problem.pieces(src):
            rows = torch.arange(g.chunk)[piece.rows]
            cols = src * g.chunk + torch.arange(g.chunk)[piece.cols]
            batch = torch.arange(shape[0])[piece.batch]
            part = _dropout_keep((len(batch), shape[1], len(rows), len(cols)), p["dropout"], p["seed"] + piece.tag,
                                 "cpu")
            keep[batch[:, None, None, None], torch.arange(shape[1])[None, :, None, None], rows[None, None, :, None],
                 cols[None, None, None, :]] = part.double() / (1 - p["dropout"])
    return keep[..., torch.argsort(g.order)][..., :g.length]


def _dense(p, problem, q, k, v, relative, mask):
    """softmax(q k^T * scale + bias + mask) v of position r's queries over the real keys, with the pieces' keeps."""
    g = problem.geometry
    L, rows = g.length, g.positions(g.rank)
    kk, vv = (_expand_kv(t[:, :, :L], p["groups"]) for t in (k, v))
    s = q[:, :, rows] @ kk.transpose(-1, -2) * SCALE
    if relative is not None:
        s = s + relative[0, :, 0][:, (torch.arange(L)[None, :] - rows[:, None] + L - 1).clamp(0, 2 * L - 2)]
    if mask is not None:
        m = mask.index_select(-2, rows.clamp(max=L - 1))  # a padding query takes the last real query's row
        s = s.masked_fill(~m, torch.finfo(s.dtype).min) if m.dtype == torch.bool else s + m
    if p["mask"] == "causal":
        s = s.masked_fill(torch.arange(L)[None, :] > rows[:, None], -math.inf)
    probs = torch.softmax(s, dim=-1)
    if p["dropout"]:
        probs = probs * _keep(p, problem, q.shape)
    return probs @ vv


def _ring_forward(p, problem, q, k, v, relative):
    g, c = problem.geometry, problem.geometry.chunk
    mine = q[:, :, g.positions(g.rank)]
    out = mine.new_zeros(mine.shape, dtype=problem.acc)
    lse = mine.new_full(mine.shape[:-1], -math.inf, dtype=problem.acc)
    for src in range(g.size):
        kb, vb = (t[:, :, g.positions(src)] for t in (k, v))
        for piece in problem.pieces(src):
            o_b, lse_b = piece_forward(mine[:, :, piece.rows], _expand_kv(kb[:, :, piece.cols], p["groups"]),
                                       _expand_kv(vb[:, :, piece.cols], p["groups"]), SCALE, piece, relative,
                                       p["dropout"], p["seed"] + piece.tag)
            out[:, :, piece.rows], lse[:, :, piece.rows] = _merge(out[:, :, piece.rows], lse[:, :, piece.rows],
                                                                  o_b, lse_b)
    return mine, out, lse


@given(problems())
def test_pieces_merged_equal_dense_attention(p):
    geometry, q, k, v, relative, mask = _setup(p)
    problem = _problem(p, geometry, mask)
    for t in (q, k, v) + ((relative,) if relative is not None else ()):
        t.requires_grad_(True)
    expected = _dense(p, problem, q, k, v, relative, mask)
    grad_out = torch.randn(expected.shape, dtype=torch.float64)
    expected.backward(grad_out)

    rel = None if relative is None else relative.detach()
    with torch.no_grad():  # as inside the autograd function
        mine, out, lse = _ring_forward(p, problem, q.detach(), k.detach(), v.detach(), rel)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-10, atol=1e-12)
    g, dq = geometry, torch.zeros_like(mine)
    for src in range(g.size):
        kb, vb = (t.detach()[:, :, g.positions(src)] for t in (k, v))
        dkv = torch.zeros((2, *kb.shape), dtype=torch.float64)
        for piece in problem.pieces(src):
            rows = piece.rows
            dq_b, dk_b, dv_b, drel = piece_backward(
                grad_out[:, :, rows], mine[:, :, rows], _expand_kv(kb[:, :, piece.cols], p["groups"]),
                _expand_kv(vb[:, :, piece.cols], p["groups"]), out[:, :, rows], lse[:, :, rows], SCALE, piece, rel,
                p["dropout"], p["seed"] + piece.tag)
            dq[:, :, rows] += dq_b
            dkv[0][:, :, piece.cols] += _fold_kv(dk_b, p["groups"])
            dkv[1][:, :, piece.cols] += _fold_kv(dv_b, p["groups"])
            if drel is not None:
                relative.grad -= drel  # what is left must be the other positions' rows' share: zero here
        for name, got, full in (("k", dkv[0], k), ("v", dkv[1], v)):
            torch.testing.assert_close(got, full.grad[:, :, g.positions(src)], rtol=1e-10, atol=1e-12,
                                       msg=f"d{name} of block {src}")
    torch.testing.assert_close(dq, q.grad[:, :, g.positions(g.rank)], rtol=1e-10, atol=1e-12)
    if relative is not None:
        torch.testing.assert_close(relative.grad, torch.zeros_like(relative), rtol=0, atol=1e-12)


@given(problems(), st.sampled_from([torch.bfloat16, torch.float16]))
def test_half_precision_pieces_accumulate_in_float32(p, dtype):
    """bf16 / fp16 q, k, v: pieces merged in float32 give the float64 dense attention of the same (rounded) inputs
    to half precision's resolution."""
    p = {**p, "dropout": 0.0}
    geometry, q, k, v, relative, mask = _setup(p, dtype)
    problem = _problem(p, geometry, mask, acc=torch.float32)
    expected = _dense(p, problem, q.double(), k.double(), v.double(), relative, mask)
    _, out, lse = _ring_forward(p, problem, q, k, v, None if relative is None else relative.to(dtype))
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=0.05, atol=0.05)


def test_zigzag_balances_causal_work():
    """Under a causal mask every ring position computes the same number of query-key pairs (within one segment's
    diagonal), where contiguous chunks would give the last position n times the first's."""
    n, length = 4, 64
    layout = RingLayout(ranks=n, ring=n)
    order = layout.order(length, "cpu")
    work = []
    for rank in range(n):
        problem = RingProblem(None, RingGeometry(rank, n, length // n, length, order), 1.0, torch.float64,
                              causal=True)
        pairs = 0
        for src in range(n):
            for piece in problem.pieces(src):
                rows = torch.arange(problem.geometry.chunk)[piece.rows]
                cols = torch.arange(problem.geometry.chunk)[piece.cols]
                pairs += len(rows) * len(cols)
        work.append(pairs)
    assert max(work) == min(work), work
    assert max(work) <= (length * length // n) * 0.6, work  # about half of the full square: masked pairs skipped
