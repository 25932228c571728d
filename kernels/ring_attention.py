"""Ring attention through transformers' attention interface (``sequence_parallel="ring"``): the function registered
as ``shardlib_ring_<inner>`` that each attention module calls, with the state it reads from the module. The math,
the ring and its backward are in :mod:`.ring_blocks`; this module turns HF's arguments into a ring problem: this
rank's rows of the model's mask, causality by HF's SDPA rule, T5's relative bias per distance, cross-attention,
Ulysses x ring's exchange of sequence for heads, and incremental decoding (unsplit).

The mask HF builds for the whole sequence ([b, 1, L | 1, L], boolean or additive) is read for this rank's rows (its
positions in the ring layout; padding rows see every key) over every column (in ring order, padding columns -inf);
a boolean mask's hidden entry is ``finfo.min``, as in HF's eager masks. Blocks no row of this rank sees through the
mask are skipped, unless some row sees no key at all: such a row averages over every key, as the reference does.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from shardlib.parallel.collectives import all_to_all

from .attention import _register_wrapper, inner_attention, sequence_bias, to_heads
from .block_attention import block_attention_forward, cross_attention
from .mask_spec import MaskSpec
from .ring_blocks import ACC_DTYPES, RingGeometry, RingLayout, RingProblem, ring_attention

RING_PREFIX = "shardlib_ring_"
CONTEXT_ATTR = "_shardlib_ring"
#: keyword arguments of HF attention functions that change the math in ways the ring does not compute (a sliding
#: window it does: the mask transformers builds for it carries it, as a spec's window or densely; a softcap too)
UNSUPPORTED = ("s_aux",)


@dataclass
class UlyssesGroup:
    """Ulysses x ring: the ranks that exchange sequence for heads around each ring position (consecutive chunks)."""

    group: object
    rank: int
    size: int


@dataclass
class RingContext:
    """What the ring attention of one attention module needs: the sp group, this rank and the group size, the
    sequence stream of its stack (``length``: the true length of the current forward), the inner implementation
    (``base``: "sdpa" or "eager", whose mask semantics apply), whether keys and values come from another,
    replicated sequence (cross-attention), whether ``position_bias`` is a relative bias vector (T5), and the
    stack's mask cache (every layer of a forward gets the same mask), and the layout of the sequence over the sp
    ranks (the stack entry's, :class:`SequenceParallel.layout`). Ulysses x ring: ``group``, ``rank`` and ``size``
    are the ring's, ``ulysses`` the Ulysses group inside each ring position."""

    group: object
    rank: int
    size: int
    stream: object  # shardlib.sharding.sequence.SequenceStream
    implementation: str
    base: str
    cross: bool = False
    relative: bool = False
    masks: "MaskCache | None" = None
    ulysses: UlyssesGroup | None = None
    layout: RingLayout | None = None


class MaskCache:
    """The last mask converted for a stack: (the HF mask it came from, the true length) -> (rows, visible). The HF
    mask is held by weak reference: the cache does not keep the whole-sequence mask alive through backward."""

    def __init__(self):
        self.key, self.source, self.value = None, lambda: None, None

    def get(self, mask, length, make):
        key = (id(mask), mask.shape, length)
        if self.key != key or self.source() is not mask:
            self.key, self.source, self.value = key, weakref.ref(mask), make()
        return self.value


def _rows(mask: torch.Tensor, g: RingGeometry) -> torch.Tensor:
    """The rows of this rank's queries of a mask [..., L | 1, Lk]; a padding query (position >= L, its output cut off
    at the stack exit) takes the last real query's row. One row [..., 1, Lk] where they are all the same (a
    padding mask): the pieces broadcast it."""
    if mask.shape[-2] == 1:
        return mask
    rows = mask.index_select(-2, g.positions(g.rank).clamp(max=g.length - 1))
    return rows[..., :1, :] if bool((rows == rows[..., :1, :]).all()) else rows


def _self_mask(mask: torch.Tensor, g: RingGeometry, acc: torch.dtype):
    """This rank's rows of a self-attention mask over all padded columns in position order, additive in ``acc`` (a
    hidden entry of a boolean mask is ``finfo.min``, as HF's eager masks; padding columns -inf), and per block
    whether any row sees any key through it (None when some row sees no key at all: then no block is skipped, as
    the reference averages over every key of such a row)."""
    rows = _rows(mask, g)
    if rows.dtype == torch.bool:
        seen = rows
        rows = torch.zeros(rows.shape, dtype=acc, device=rows.device).masked_fill_(~seen, torch.finfo(acc).min)
    else:
        seen = rows > torch.finfo(rows.dtype).min / 2
        rows = rows.clamp(min=torch.finfo(acc).min).to(acc)  # finite: HF's float64 finfo.min would be -inf in fp32
    extra = g.size * g.chunk - rows.shape[-1]
    if extra:
        rows = torch.nn.functional.pad(rows, (0, extra), value=-math.inf)
        seen = torch.nn.functional.pad(seen, (0, extra), value=False)
    if not bool(seen.any(-1).all()):
        return rows, None
    per_segment = seen.unflatten(-1, (2 * g.size, g.chunk // 2)).any(-1).flatten(0, -2).any(0)  # [2n]
    # (bool(), not tolist(): the dry run answers it on meta)
    return rows, [bool(per_segment[p]) or bool(per_segment[2 * g.size - 1 - p]) for p in range(g.size)]


def ring_attention_forward(module, query, key, value, attention_mask, *, position_bias=None, **kwargs):
    """HF attention function (registered as ``shardlib_ring_<inner>``): q [b, h, c, d] of this rank's chunk;
    self-attention k, v the same chunk's (the ring brings the others), cross-attention k, v of the whole replicated
    other sequence. Ulysses x ring: q, k, v first exchange sequence for heads within the rank's Ulysses group, the
    ring then runs over the group's joint chunk for its share of the heads, and the output is exchanged back.
    Returns ([b, c, h, d], None); attention weights are never materialised."""
    ctx: RingContext = module.__dict__[CONTEXT_ATTR]
    if ctx.stream.unsplit:  # incremental decoding: the whole sequence on every rank (a mask spec: as blocks)
        return block_attention_forward(module, query, key, value, attention_mask, implementation=ctx.implementation,
                                       position_bias=position_bias, **kwargs)
    unsupported = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported:
        raise RuntimeError(f"{type(module).__name__}: ring attention does not compute {', '.join(unsupported)}")
    if not ctx.cross and key.shape[2] != query.shape[2]:
        raise RuntimeError(f"{type(module).__name__}: ring self-attention got query {tuple(query.shape)} and key "
                           f"{tuple(key.shape)} (a key/value cache is not supported)")
    u = ctx.ulysses
    if u is not None:
        query, key, value, position_bias = _ulysses_in(module, u, ctx.cross, query, key, value, position_bias)
    length = ctx.stream.length
    g = RingGeometry(ctx.rank, ctx.size, query.shape[2], length, ctx.layout.order(length, query.device))
    attend = _cross_attention if ctx.cross else _self_attention
    out = attend(module, ctx, g, query, key, value, attention_mask, position_bias=position_bias, **kwargs)
    if u is not None:  # [b, u*c, h/u, d] -> [b, c, h, d]
        out = all_to_all((out,), u.group, scatter_dim=1, gather_dim=2)[0]
    return out, None


def _ulysses_in(module, u: "UlyssesGroup", cross: bool, query, key, value, position_bias):
    """Sequence for heads within the Ulysses group: q (self-attention: k and v too) [b, h, c, d] -> [b, h/u, u*c,
    d]; cross-attention keeps its share of the replicated k and v heads; a relative bias its share of the heads."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % u.size or kv_heads % u.size:
        raise RuntimeError(f"{type(module).__name__}: {heads} query and {kv_heads} key/value heads do not split over "
                           f"the {u.size} ranks of a Ulysses group")
    if cross:
        share = kv_heads // u.size
        key, value = (t.narrow(1, u.rank * share, share) for t in (key, value))
        return to_heads(query, u.group, None), key, value, None  # T5's cross-attention bias is zeros
    if kv_heads == heads:
        query, key, value = to_heads((query, key, value), u.group, None)
    else:
        query, (key, value) = to_heads(query, u.group, None), to_heads((key, value), u.group, None)
    if position_bias is not None:
        share = heads // u.size
        position_bias = position_bias.narrow(1, u.rank * share, share)
    return query, key, value, position_bias


def _self_attention(module, ctx: RingContext, g: RingGeometry, query, key, value, attention_mask, *,
                    dropout: float = 0.0, scaling: float | None = None, position_bias=None,
                    is_causal: bool | None = None, softcap: float | None = None, **kwargs):
    acc = ACC_DTYPES.get(query.dtype, query.dtype)
    problem = RingProblem(ctx.group, g, query.shape[-1] ** -0.5 if scaling is None else scaling, acc,
                          softcap=softcap or 0.0)
    if isinstance(attention_mask, MaskSpec):
        problem.spec = attention_mask
    elif attention_mask is not None:
        problem.mask, problem.visible = ctx.masks.get(attention_mask, g.length,
                                                      lambda: _self_mask(attention_mask, g, acc))
    elif ctx.base != "eager" and g.length > 1:  # HF's SDPA rule: no mask means causal unless the module says not
        problem.causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    relative = None
    if position_bias is not None:
        if not ctx.relative or position_bias.shape[-1] != 2 * g.length - 1:
            raise RuntimeError(f"{type(module).__name__}: ring attention got a position bias "
                               f"{tuple(position_bias.shape)}; it computes only relative biases given per distance "
                               f"([1, h, 1, {2 * g.length - 1}], AttentionSite.bias_method)")
        relative, problem.relative_length = position_bias, g.length
    if dropout and module.training:
        problem.dropout, problem.seed = dropout, int(torch.randint(2 ** 62, ()))
    return ring_attention(problem, query, key, value, relative).transpose(1, 2).contiguous()


def _cross_attention(module, ctx: RingContext, g: RingGeometry, query, key, value, attention_mask, **kwargs):
    """Cross-attention: this rank's queries against the whole other sequence (replicated, entered into the sp
    region once so that its gradient, from this rank's queries only, is summed): the inner implementation with the
    mask's rows of this chunk, or a mask spec's pieces (its query ids read at this rank's positions; T5's
    cross-attention bias, zeros, left out)."""
    inner = inner_attention(module, ctx.implementation)
    if isinstance(attention_mask, MaskSpec):
        spec = attention_mask
        rows = g.positions(g.rank).clamp(max=g.length - 1)  # a padding query takes the last real query's ids
        local = MaskSpec(spec.query_ids.index_select(1, rows), spec.key_ids)
        kwargs.pop("position_bias", None)
        return cross_attention(module, inner, ctx.base, local, query, key, value, **kwargs)
    mask = None if attention_mask is None else _rows(attention_mask, g)
    return inner(module, query, key, value, mask, **kwargs)[0]


def relative_bias_vector(compute_bias, stream):
    """T5's relative position bias of every distance of the whole sequence, [1, h, 1, 2L - 1] (entry
    ``L - 1 + k - q``): the model's own lookup, asked for one query at position L - 1 against keys 0 .. 2L - 2. It
    travels to the later layers as T5 passes its bias on; each piece gathers its part."""
    return sequence_bias(compute_bias, stream, "ring attention", lambda length: (1, 2 * length - 1, length - 1))


def ring_name(implementation: str) -> str:
    """Register (once) and return the attention-interface name of ring attention around ``implementation``; its
    masks are described as data where they can be (:mod:`.mask_spec`), built as HF builds the inner
    implementation's elsewhere."""
    return _register_wrapper(RING_PREFIX + implementation, ring_attention_forward, implementation, masks_as_data=True)


__all__ = ["ring_attention_forward", "ring_name", "relative_bias_vector", "RingContext", "UlyssesGroup", "MaskCache",
           "CONTEXT_ATTR", "RING_PREFIX"]
