"""Block attention (``Kernels(attention="blocks")``): a mask described as data (:class:`~.mask_spec.MaskSpec`)
runs as the pieces of a ring of one, through the ring's autograd function (:mod:`.ring_blocks`) with nothing to
send, so that no [L, L] mask or score tensor exists; the function registered as ``shardlib_blocks_<inner>`` in
transformers' attention interface, its mask builder describing masks as data where it can."""

from __future__ import annotations

import functools

import torch

from .attention import BLOCKS_PREFIX, _register_wrapper, base_implementation, inner_attention
from .mask_spec import MASKS_BUILT, MaskSpec
from .ring_blocks import ACC_DTYPES, CrossGeometry, RingGeometry, RingProblem, ring_attention

#: keyword arguments that block attention leaves to the inner implementation with a dense mask
DENSE_ARGUMENTS = ("position_bias", "s_aux")


def block_attention_forward(module, query, key, value, attention_mask, *, implementation: str, **kwargs):
    """``Kernels(attention="blocks")`` without sequence parallelism: a mask described as data
    (:class:`~.mask_spec.MaskSpec`) runs as the pieces of a ring of one (no [L, L] tensor: each piece is a run of
    queries against a run of keys they all see); cross-attention takes the one key row every query sees; anything
    else the inner ``implementation`` computes (with the dense mask where the spec must become one: a position bias,
    queries that see different keys of another sequence)."""
    inner = inner_attention(module, implementation)
    spec = attention_mask
    if not isinstance(spec, MaskSpec):
        return inner(module, query, key, value, attention_mask, **kwargs)
    base = base_implementation(implementation)
    dense = [name for name in DENSE_ARGUMENTS if kwargs.get(name) is not None]
    if dense:
        MASKS_BUILT["dense: " + ", ".join(dense)] += 1
        return inner(module, query, key, value, spec.dense(base, query.dtype), **kwargs)
    if key.shape[2] != query.shape[2]:
        return cross_attention(module, inner, base, spec, query, key, value, **kwargs), None
    geometry = RingGeometry.whole(query.shape[2], query.device)
    return spec_attention(module, spec, geometry, query, key, value, **kwargs).transpose(1, 2).contiguous(), None


def cross_attention(module, inner, base: str, spec: MaskSpec, query, key, value, **kwargs) -> torch.Tensor:
    """Queries against all keys of another sequence, [b, Lq, h, d]: the inner implementation with the one key row
    every query sees where they all see the same keys (padding), else the spec's pieces (packed documents: each
    decoder document against its encoder document)."""
    row = spec.key_row(base, query.dtype)
    if row is not None:
        return inner(module, query, key, value, row, **kwargs)[0]
    geometry = CrossGeometry(query.shape[2], key.shape[2], query.device)
    return spec_attention(module, spec, geometry, query, key, value, **kwargs).transpose(1, 2).contiguous()


def spec_attention(module, spec: MaskSpec, geometry, query, key, value, *, scaling: float | None = None,
                   dropout: float = 0.0, softcap: float | None = None, **_) -> torch.Tensor:
    """Attention of ``query`` [b, h, Lq, d] over ``key``/``value`` under ``spec``, as the pieces of a ring of one
    (``geometry``: the whole sequence, or a :class:`CrossGeometry`), [b, h, Lq, d]."""
    acc = ACC_DTYPES.get(query.dtype, query.dtype)
    problem = RingProblem(None, geometry, query.shape[-1] ** -0.5 if scaling is None else scaling, acc, spec=spec,
                          softcap=softcap or 0.0)
    if dropout and module.training:
        problem.dropout, problem.seed = dropout, int(torch.randint(2 ** 62, ()))
    return ring_attention(problem, query, key, value)


def blocks_name(implementation: str) -> str:
    """Register (once) and return the attention-interface name of block attention around ``implementation``
    ("sdpa" or "eager", whose mask semantics it keeps)."""
    if implementation.startswith(BLOCKS_PREFIX):
        return implementation
    return _register_wrapper(BLOCKS_PREFIX + implementation,
                             functools.partial(block_attention_forward, implementation=implementation),
                             implementation, masks_as_data=True)


__all__ = ["block_attention_forward", "blocks_name", "cross_attention", "spec_attention"]
