"""Masks as data: what each query may see, described in O(L) per row and turned into work only per piece.

A :class:`MaskSpec` says that query q of row b sees key k when ``query_ids[b, q] == key_ids[b, k]`` (and k <= q when
``causal``):

* padding: every query's id is 0, a real key's 0, a padding key's -1 (a padding query sees every real key, as in
  transformers' masks);
* packed documents: each token's document id on both sides, padding -1 (a padding token sees the padding, as
  :func:`shardlib.sharding.documents.document_mask` has it).

Where the spec comes from: shardlib's attention implementations that compute attention per piece (ring attention,
``Kernels(attention="blocks")``) register, under their own names in transformers' ``AttentionMaskInterface``, the
mask builder :func:`spec_builder`. transformers calls it where it would build its [b, 1, L, L] mask
(``create_bidirectional_mask``, ``create_causal_mask``), with the 2-D padding mask and a mask function; a plain
causal or bidirectional mask over a fresh sequence becomes a spec, and so do packed documents, which the document
hook hands over through :func:`enter_documents` instead of building a 4-D mask. Everything else (sliding
windows, chunked or custom mask functions, a cache offset, rows in which a query would see no key, meta tensors,
torch.compile) gets transformers' own dense mask; :data:`MASKS_BUILT` counts both, the dense ones by reason.

Where it goes: :meth:`MaskSpec.pieces` cuts a ring block (or the whole sequence, a ring of one) at run boundaries of
the ids into pieces that each run with no mask (those no query sees are never made); under ``causal`` a piece that
straddles the diagonal runs the kernel's own causal flag, aligned at the piece's corner. A kernel that takes only
dense masks gets one from :meth:`MaskSpec.dense` (its fallback), or one broadcast row (:meth:`MaskSpec.key_row`)
where every query sees the same keys.
"""

from __future__ import annotations

import collections
import contextvars
import functools
from dataclasses import dataclass, field

import torch

#: masks shardlib's builders and kernels made, in this process: "data" (a MaskSpec) or "dense: <reason>" (for tests
#: and debugging: a layout that should carry masks as data and still builds dense ones shows here)
MASKS_BUILT: collections.Counter = collections.Counter()

_DOCUMENTS: contextvars.ContextVar = contextvars.ContextVar("shardlib_documents", default=None)


def enter_documents(documents: torch.Tensor):
    """From now until :func:`leave_documents`: the spec builders describe self-attention masks by ``documents``
    [rows, length] (a packed forward's, handed over by the document hook) rather than by the padding mask
    transformers passes. Returns the token to leave with."""
    return _DOCUMENTS.set(documents)


def leave_documents(token) -> None:
    _DOCUMENTS.reset(token)


def same_document(documents: torch.Tensor):
    """The mask function (transformers' index signature) of "query and key are in the same document"."""

    def mask(batch, head, q, kv):
        return documents[batch, q] == documents[batch, kv]

    return mask


@dataclass(eq=False)
class MaskSpec:
    """Query q of row b sees key k when ``query_ids[b, q] == key_ids[b, k]`` (and k <= q when ``causal``): see the
    module docstring. Every query sees at least one key (the builder checks it)."""

    query_ids: torch.Tensor  # [b, Lq] int64
    key_ids: torch.Tensor  # [b, Lk] int64
    causal: bool = False
    _groups: list | None = field(default=None, repr=False)
    _pieces: dict = field(default_factory=dict, repr=False)

    def groups(self) -> list[tuple[slice, list, list, tuple | None]]:
        """(batch rows, query runs, key runs, keys) where rows share their runs; a run is (first position, last
        position, id). Rows with the same ids are one group; so are padded rows of different lengths (every query
        id 0), whose runs are those of the keys real in any row, ``keys`` then being (which keys are real per row
        [b, Lk] on the device, the same on the host) for the pieces' masks. One host read per forward (cached on
        the spec every layer receives)."""
        if self._groups is None:
            q, k = self.query_ids.cpu(), self.key_ids.cpu()
            if bool((q == q[:1]).all()) and bool((k == k[:1]).all()):
                self._groups = [(slice(None), _runs(q[0]), _runs(k[0]), None)]
            elif not bool(q.any()):  # padding: one call over the batch, a key row where the rows differ
                real = k == 0
                self._groups = [(slice(None), _runs(q[0]), _runs(torch.where(real.any(0), 0, -1)),
                                 (self.key_ids == 0, real))]
            else:
                self._groups = [(slice(b, b + 1), _runs(q[b]), _runs(k[b]), None) for b in range(q.shape[0])]
        return self._groups

    def key_row(self, base: str, dtype: torch.dtype) -> torch.Tensor | None:
        """[b, 1, 1, Lk]: the one row every query of a row sees (padding), in ``base``'s mask format (sdpa:
        boolean; eager: additive), or None where queries see different keys."""
        if not bool((self.query_ids == self.query_ids[:, :1]).all()) or self.causal:
            return None
        seen = (self.key_ids == self.query_ids[:, :1])[:, None, None, :]
        return seen if base != "eager" else _additive(seen, dtype)

    def dense(self, base: str, dtype: torch.dtype) -> torch.Tensor:
        """The [b, 1, Lq, Lk] mask transformers would have built (a fallback for kernels that take only that)."""
        seen = self.query_ids[:, None, :, None] == self.key_ids[:, None, None, :]
        if self.causal:
            q, k = seen.shape[-2:]
            seen = seen & (torch.arange(q, device=seen.device)[:, None] >= torch.arange(k, device=seen.device))
        return seen if base != "eager" else _additive(seen, dtype)

    def pieces(self, geometry, src: int, make_piece, cache_key=None) -> list:
        """The pieces of ring block ``src`` for this rank's queries (``geometry``: a
        :class:`~shardlib.kernels.ring_blocks.RingGeometry`): every run of equal ids among this rank's query
        segments against every run of the same id among the block's key segments, cut at the causal diagonal.
        ``make_piece(batch, rows, cols, queries, keys, causal, tag, real)`` builds each (chunk offsets, positions,
        and which of its keys are real per row where rows of different lengths share it, else None). Every layer
        of a forward gets the same spec: the pieces are cut once per block and ``cache_key`` (what else
        ``make_piece`` depends on), and reused by the other layers and the backward."""
        if cache_key is None:
            return self._cut_block(geometry, src, make_piece)
        key = (geometry.rank, geometry.size, geometry.chunk, geometry.length, src, cache_key)
        if key not in self._pieces:
            self._pieces[key] = self._cut_block(geometry, src, make_piece)
        return self._pieces[key]

    def _cut_block(self, geometry, src: int, make_piece) -> list:
        g, pieces = geometry, []
        if not self.causal and not bool(self.query_ids.any()):
            return self._padding_pieces(g, src, make_piece)
        block = [run for run in g.runs(src) if run[2] < g.length]
        for batch, query_runs, key_runs, real_keys in self.groups():
            for q_start, _, q_first, q_last in g.runs(g.rank):
                for k_start, _, k_first, k_last in block:
                    # padding positions (past the length) neither ask nor answer: their rows are cut off at the exit
                    spans = (q_first, min(q_last, g.length - 1)), (k_first, min(k_last, g.length - 1))
                    for queries, keys in _matching(query_runs, key_runs, *spans):
                        for (a, b), (c, d), diagonal in self._cut(queries, keys):
                            rows = slice(q_start + a - q_first, q_start + b - q_first)
                            cols = slice(k_start + c - k_first, k_start + d - k_first)
                            pieces.append(make_piece(batch, rows, cols, (a, b), (c, d), diagonal,
                                                     src * 2 ** 20 + len(pieces), _real(real_keys, c, d)))
        return pieces

    def _padding_pieces(self, g, src: int, make_piece) -> list:
        """Padding without causality: every query sees the same keys, so one piece per block: this rank's real
        queries against the block's keys up to its last real one (positions past the length come last in each
        chunk), with a key row where some row's key among them is padding."""
        rows, cols = _real_prefix(g, g.rank), _real_prefix(g, src)
        if not rows or not cols:
            return []
        positions = g.positions(src)[:cols]
        real = self.key_ids.index_select(1, positions) == 0  # [b, cols]
        seen = real.any(0)
        if not bool(seen.any()):
            return []
        cols = int(torch.nonzero(seen).max()) + 1
        real = real[:, :cols]
        return [make_piece(slice(None), slice(0, rows), slice(0, cols), g.positions(g.rank)[:rows], positions[:cols],
                           False, src * 2 ** 20, None if bool(real.all()) else real)]

    def _cut(self, queries, keys):
        return _causal_cut(*queries, *keys) if self.causal else [(queries, keys, False)]


def _real_prefix(g, block: int) -> int:
    """How many of block ``block``'s positions are within the length: a prefix of the chunk (of its first segment,
    or all of it and of the second's), since positions past the length are the sequence's last."""
    return sum(max(0, min(last, g.length - 1) - first + 1) for _, _, first, last in g.runs(block))


def _real(keys, start: int, stop: int) -> torch.Tensor | None:
    """Which keys of [start, stop) are real per row, or None where all are (no mask)."""
    if keys is None or bool(keys[1][:, start:stop].all()):
        return None
    return keys[0][:, start:stop]


def _additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, torch.finfo(dtype).min)


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first, last, id) of each run of equal consecutive ids of a 1-D tensor."""
    if ids.numel() == 0:
        return []
    change = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
    starts, stops = [0, *change], [*change, ids.numel()]
    values = ids[starts].tolist()
    return [(s, e - 1, v) for s, e, v in zip(starts, stops, values)]


def _clip(runs, first: int, last: int):
    """The runs' parts within positions [first, last], as (start, stop, id) half-open."""
    if last < first:
        return
    for a, b, value in runs:
        if b >= first and a <= last:
            yield max(a, first), min(b, last) + 1, value


def _matching(query_runs, key_runs, query_span, key_span):
    """((query start, stop), (key start, stop)) of every query run and key run of the same id within the spans."""
    keys: dict[int, list] = {}
    for c, d, value in _clip(key_runs, *key_span):
        keys.setdefault(value, []).append((c, d))
    for a, b, value in _clip(query_runs, *query_span):
        for c, d in keys.get(value, ()):
            yield (a, b), (c, d)


def _causal_cut(a: int, b: int, c: int, d: int):
    """Queries [a, b) against keys [c, d) under k <= q: ((rows), (cols), diagonal) parts with no mask, or with the
    kernel's causal flag aligned at their top-left corner (``diagonal``)."""
    if c > b - 1:
        return []  # every key after every query
    if d - 1 <= a:
        return [((a, b), (c, d), False)]  # every key at or before every query
    parts = [((a, b), (c, a), False)] if c < a else []  # the keys before the first query: all seen
    start = max(a, c)
    return parts + [((start, b), (start, d), True)]  # rows before ``start`` see none of the rest


# ------------------------------------------------------------------------------------------- the mask builder
def _offset(value) -> bool:
    return bool(value) if not torch.is_tensor(value) else bool((value != 0).any())


def describe(*, batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask: torch.Tensor | None = None, local_size=None, device="cpu", **_) -> MaskSpec | str:
    """The spec of the mask transformers asks for, or the reason it stays dense."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, prepare_padding_mask

    if torch.compiler.is_compiling():
        return "torch.compile"  # the pieces are read from the data: a compiled graph keeps transformers' mask
    if mask_function not in (causal_mask_function, bidirectional_mask_function) or local_size is not None:
        return "mask function"  # sliding windows, chunks, packed position ids, overlays
    if _offset(q_offset) or _offset(kv_offset):
        return "cache offset"
    if torch.device(device).type == "meta" or (attention_mask is not None and attention_mask.is_meta):
        return "meta"
    causal = mask_function is causal_mask_function
    documents = _DOCUMENTS.get()
    if documents is not None:
        if tuple(documents.shape) != (batch_size, q_length) or q_length != kv_length:
            return "documents across sequences"
        ids = documents.to(device=device, dtype=torch.long)
        return MaskSpec(ids, ids, causal)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    valid = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device) if padding is None else \
        padding.to(device=device, dtype=torch.bool).expand(batch_size, kv_length)
    if not bool(valid[:, 0].all() if causal else valid.any(-1).all()):
        return "a query that sees no key"  # transformers' kernels decide what such a row computes
    key_ids = torch.where(valid, 0, -1)
    return MaskSpec(torch.zeros(batch_size, q_length, dtype=torch.long, device=device), key_ids, causal)


@functools.cache
def spec_builder(dense):
    """The mask builder (``AttentionMaskInterface`` signature) that describes what it can as a :class:`MaskSpec`
    and asks ``dense`` (transformers' builder for the inner implementation) for everything else. One builder per
    dense one: registering it again under a name changes nothing."""

    def build(**kwargs):
        spec = describe(**kwargs)
        MASKS_BUILT["data" if isinstance(spec, MaskSpec) else f"dense: {spec}"] += 1
        if isinstance(spec, MaskSpec):
            return spec
        documents = _DOCUMENTS.get()
        if documents is not None:  # a packed forward: the dense mask keeps the documents apart too
            from transformers.masking_utils import and_masks

            if tuple(documents.shape) != (kwargs["batch_size"], kwargs["q_length"]) or \
                    kwargs["q_length"] != kwargs["kv_length"]:
                raise ValueError(f"packing: a mask of {kwargs['q_length']} queries x {kwargs['kv_length']} keys in a "
                                 f"packed forward whose documents are {tuple(documents.shape)}")
            kwargs = {**kwargs, "mask_function": and_masks(kwargs["mask_function"], same_document(documents)),
                      "attention_mask": None, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False,
                      "use_vmap": False}
        return dense(**kwargs)

    build.dense = dense
    return build


def dense_builder(builder):
    """The dense builder under ``builder`` (itself where it is not a spec builder)."""
    return getattr(builder, "dense", builder)


def is_spec_builder(builder) -> bool:
    return hasattr(builder, "dense")


__all__ = ["MaskSpec", "MASKS_BUILT", "enter_documents", "leave_documents", "same_document", "describe",
           "spec_builder", "dense_builder", "is_spec_builder"]
