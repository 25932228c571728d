"""The ring-attention block kernels and their merge, in one process: for rank r of a ring of n, every block's
forward merged by log-sum-exp and every block's backward (given the global output and log-sum-exp) equal the
attention of r's queries over the whole sequence computed densely with autograd: padding, masks (boolean and
additive), causality, grouped K/V heads, T5's relative bias per distance and dropout (the same keep masks).
The wire between ranks is covered by the multi-rank tests (test_ring_attention.py)."""

import math

import torch
from hypothesis import given, strategies as st

from shardlib.kernels.ring_attention import (
    RingGeometry, RingProblem, _dropout_keep, _expand_kv, _fold_kv, _merge, _self_mask, block_backward,
    block_forward,
)


@st.composite
def problems(draw):
    n = draw(st.integers(1, 4))
    chunk = draw(st.integers(1, 4))
    length = draw(st.integers(max(1, (n - 1) * chunk + 1), n * chunk))  # the last chunk holds 1..chunk real ones
    return {"n": n, "rank": draw(st.integers(0, n - 1)), "chunk": chunk, "length": length,
            "batch": draw(st.integers(1, 2)), "kv_heads": draw(st.integers(1, 2)), "groups": draw(st.integers(1, 2)),
            "head_dim": draw(st.sampled_from([1, 3, 4])),
            "mask": draw(st.sampled_from([None, "bool", "additive", "causal"])),
            "relative": draw(st.booleans()), "dropout": draw(st.sampled_from([0.0, 0.0, 0.3])),
            "seed": draw(st.integers(0, 2 ** 40))}


def _inputs(p):
    g = torch.Generator().manual_seed(p["seed"] % 2 ** 31)
    total, hq = p["n"] * p["chunk"], p["kv_heads"] * p["groups"]
    q = torch.randn(p["batch"], hq, total, p["head_dim"], generator=g, dtype=torch.float64)
    k = torch.randn(p["batch"], p["kv_heads"], total, p["head_dim"], generator=g, dtype=torch.float64)
    v = torch.randn(p["batch"], p["kv_heads"], total, p["head_dim"], generator=g, dtype=torch.float64)
    relative = torch.randn(1, hq, 1, 2 * p["length"] - 1, generator=g, dtype=torch.float64) if p["relative"] else None
    mask = None
    if p["mask"] in ("bool", "additive"):
        seen = torch.rand(p["batch"], 1, p["length"], p["length"], generator=g) > 0.4
        seen[..., 0] = True  # every row sees a key: HF's padding masks keep the first token
        mask = seen if p["mask"] == "bool" else torch.zeros(seen.shape, dtype=torch.float64).masked_fill(
            ~seen, torch.finfo(torch.float64).min)
    return q, k, v, relative, mask


def _problem(p, mask):
    geometry = RingGeometry(p["rank"], p["n"], p["chunk"], p["length"])
    problem = RingProblem(None, geometry, 0.7, torch.float64, causal=p["mask"] == "causal",
                          dropout=p["dropout"], seed=p["seed"])
    if mask is not None:
        problem.mask, problem.visible = _self_mask(mask, geometry, torch.float64)
    if p["relative"]:
        problem.relative_length = p["length"]
    return problem


def _dense(p, q, k, v, relative, mask):
    """softmax(q k^T * 0.7 + bias + mask) v for rank r's queries over the real keys, with the kernel's keep masks."""
    L, c, r = p["length"], p["chunk"], p["rank"]
    rows = torch.arange(r * c, (r + 1) * c)
    kk, vv = (_expand_kv(t[:, :, :L], p["groups"]) for t in (k, v))
    s = q[:, :, r * c:(r + 1) * c] @ kk.transpose(-1, -2) * 0.7
    if relative is not None:
        s = s + relative[0, :, 0][:, (torch.arange(L)[None, :] - rows[:, None] + L - 1).clamp(0, 2 * L - 2)]
    if mask is not None:
        m = torch.cat((mask, mask.new_ones(mask.shape[:-2] + (p["n"] * c - L, L)) if mask.dtype == torch.bool
                       else mask.new_zeros(mask.shape[:-2] + (p["n"] * c - L, L))), dim=-2)[..., rows, :]
        s = s.masked_fill(~m, torch.finfo(s.dtype).min) if m.dtype == torch.bool else s + m
    if p["mask"] == "causal":
        s = s.masked_fill(torch.arange(L)[None, :] > rows[:, None], -math.inf)
    probs = torch.softmax(s, dim=-1)
    if p["dropout"]:
        keep = torch.cat([_dropout_keep((p["batch"], q.shape[1], c, c), p["dropout"], p["seed"] + b, "cpu").double()
                          for b in range(p["n"])], dim=-1)[..., :L]
        probs = probs * keep / (1 - p["dropout"])
    return probs @ vv


@given(problems())
def test_blocks_merged_equal_dense_attention(p):
    q, k, v, relative, mask = _inputs(p)
    for t in (q, k, v) + ((relative,) if relative is not None else ()):
        t.requires_grad_(True)
    expected = _dense(p, q, k, v, relative, mask)
    grad_out = torch.randn(expected.shape, dtype=torch.float64)
    expected.backward(grad_out)

    problem, c, r = _problem(p, mask), p["chunk"], p["rank"]
    mine = q.detach()[:, :, r * c:(r + 1) * c]
    blocks = {src: problem.block(src, "cpu") for src in range(p["n"])}
    out = lse = None
    for src, extra in blocks.items():
        if extra is not None:
            kb, vb = (_expand_kv(t.detach()[:, :, src * c:(src + 1) * c], p["groups"]) for t in (k, v))
            o_b, lse_b = block_forward(mine, kb, vb, 0.7, extra, relative, p["dropout"], p["seed"] + src)
            out, lse = _merge(out, lse, o_b, lse_b)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-10, atol=1e-12)

    dq = torch.zeros_like(mine)
    for src, extra in blocks.items():
        kb, vb = (_expand_kv(t.detach()[:, :, src * c:(src + 1) * c], p["groups"]) for t in (k, v))
        if extra is None:
            dk_b = dv_b = torch.zeros_like(kb)
        else:
            dq_b, dk_b, dv_b, drel = block_backward(grad_out, mine, kb, vb, out, lse, 0.7, extra,
                                                    relative.detach() if relative is not None else None,
                                                    p["dropout"], p["seed"] + src)
            dq += dq_b
            if drel is not None:
                relative.grad -= drel  # what is left must be the other ranks' rows' share: zero here
        for name, mine_grad, full in (("k", dk_b, k), ("v", dv_b, v)):
            torch.testing.assert_close(_fold_kv(mine_grad, p["groups"]), full.grad[:, :, src * c:(src + 1) * c],
                                       rtol=1e-10, atol=1e-12, msg=f"d{name} of block {src}")
    torch.testing.assert_close(dq, q.grad[:, :, r * c:(r + 1) * c], rtol=1e-10, atol=1e-12)
    if relative is not None:
        torch.testing.assert_close(relative.grad, torch.zeros_like(relative), rtol=0, atol=1e-12)


@given(problems(), st.sampled_from([torch.bfloat16, torch.float16]))
def test_half_precision_blocks_accumulate_in_float32(p, dtype):
    """bf16 / fp16 q, k, v: blocks merged in float32 give the float64 dense attention of the same (rounded) inputs
    to half precision's resolution, and the output comes back in the input dtype."""
    q, k, v, relative, mask = _inputs(p)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    expected = _dense(p, q.double(), k.double(), v.double(), relative, mask)
    problem, c, r = _problem(p, mask), p["chunk"], p["rank"]
    problem.acc = torch.float32
    if mask is not None:
        problem.mask, problem.visible = _self_mask(mask, problem.geometry, torch.float32)
    out = lse = None
    for src in range(p["n"]):
        extra = problem.block(src, "cpu")
        if extra is not None:
            kb, vb = (_expand_kv(t[:, :, src * c:(src + 1) * c], p["groups"]) for t in (k, v))
            o_b, lse_b = block_forward(q[:, :, r * c:(r + 1) * c], kb, vb, 0.7, extra,
                                       None if relative is None else relative.to(dtype), p["dropout"], p["seed"] + src)
            assert o_b.dtype == torch.float32 and lse_b.dtype == torch.float32
            out, lse = _merge(out, lse, o_b, lse_b)
    torch.testing.assert_close(out.double(), expected, rtol=0.05, atol=0.05)
