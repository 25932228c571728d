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
from dataclasses import dataclass, field, replace

import torch

from .mask_pieces import causal_cut, id_runs, keys_real_in, matching_runs, real_prefix, window_cut

#: masks shardlib's builders and kernels made, in this process: "data" (a MaskSpec) or "dense: <reason>" (for tests
#: and debugging: a layout that should carry masks as data and still builds dense ones shows here)
MASKS_BUILT: collections.Counter = collections.Counter()

_DOCUMENTS: contextvars.ContextVar = contextvars.ContextVar("shardlib_documents", default=None)


def enter_documents(causal=None, bidirectional=None):
    """From now until :func:`leave_documents`: the spec builders describe masks by document ids (a packed forward's,
    handed over by the document hook) rather than by the padding mask transformers passes: a causal mask by
    ``causal`` and a bidirectional one by ``bidirectional``, each (query ids [rows, Lq], key ids [rows, Lk]); a
    kind given as None may not be built meanwhile (a mask no document hook prepared for: refused, not guessed).
    Returns the token to leave with."""
    return _DOCUMENTS.set({True: causal, False: bidirectional})


def leave_documents(token) -> None:
    _DOCUMENTS.reset(token)


def same_document(queries: torch.Tensor, keys: torch.Tensor):
    """The mask function (transformers' index signature) of "query and key are in the same document" (a padding
    query, id < 0, sees the keys' padding, or every key of a row without padding: :class:`MaskSpec`)."""
    keys_pad = (keys < 0).any(-1)

    def mask(batch, head, q, kv):
        mine = queries[batch, q]
        return (mine == keys[batch, kv]) | ((mine < 0) & ~keys_pad[batch])

    return mask


def _documents_of(causal: bool, batch_size: int, q_length: int, kv_length: int):
    """The (query ids, key ids) the document hook gave for this kind of mask, None outside a packed forward."""
    documents = _DOCUMENTS.get()
    if documents is None:
        return None
    pair = documents[causal]
    if pair is None or tuple(pair[0].shape) != (batch_size, q_length) or tuple(pair[1].shape) != (batch_size,
                                                                                                  kv_length):
        got = "none" if pair is None else f"{tuple(pair[0].shape)} x {tuple(pair[1].shape)}"
        raise ValueError(f"packing: a {'causal' if causal else 'bidirectional'} mask of {q_length} queries x "
                         f"{kv_length} keys (batch {batch_size}) in a packed forward whose document ids for it are "
                         f"{got}")
    return pair


@dataclass(eq=False)
class MaskSpec:
    """Query q of row b sees key k when ``query_ids[b, q] == key_ids[b, k]`` (and k <= q when ``causal``, and
    q - k < ``window`` where given); a padding query (id < 0) of a row whose keys hold no padding sees every key
    (a packed decoder's padding against a full encoder row, as transformers' dense document masks have it). See
    the module docstring. Every query sees at least one key (the builder checks it)."""

    query_ids: torch.Tensor  # [b, Lq] int64
    key_ids: torch.Tensor  # [b, Lk] int64
    causal: bool = False
    window: int | None = None  # causal only: and q - k < window (transformers' sliding window)
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
                self._groups = [(slice(None), id_runs(q[0]), id_runs(k[0]), None)]
            elif not bool(q.any()):  # padding: one call over the batch, a key row where the rows differ
                real = k == 0
                self._groups = [(slice(None), id_runs(q[0]), id_runs(torch.where(real.any(0), 0, -1)),
                                 (self.key_ids == 0, real))]
            else:
                self._groups = [(slice(b, b + 1), id_runs(q[b]), id_runs(k[b]), None) for b in range(q.shape[0])]
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
        keys_pad = (self.key_ids < 0).any(-1)[:, None, None, None]
        seen = (self.query_ids[:, None, :, None] == self.key_ids[:, None, None, :]) | \
            ((self.query_ids[:, None, :, None] < 0) & ~keys_pad)
        if self.causal:
            q, k = seen.shape[-2:]
            distance = torch.arange(q, device=seen.device)[:, None] - torch.arange(k, device=seen.device)
            seen = seen & (distance >= 0) & (distance < (self.window or q + k))
        return seen if base != "eager" else _additive(seen, dtype)

    def pieces(self, geometry, src: int, make_piece, cache_key=None) -> list:
        """The pieces of ring block ``src`` for this rank's queries (``geometry``: a
        :class:`~shardlib.kernels.ring_blocks.RingGeometry`): every run of equal ids among this rank's query
        segments against every run of the same id among the block's key segments, cut at the causal diagonal.
        ``make_piece(batch, rows, cols, queries, keys, causal, tag, real, window)`` builds each (chunk offsets,
        positions, which of its keys are real per row where rows of different lengths share it, else None, and the
        window where the piece is at a sliding window's edge, else None). Every layer
        of a forward gets the same spec: the pieces are cut once per block and ``cache_key`` (what else
        ``make_piece`` depends on), and reused by the other layers and the backward."""
        if cache_key is None:
            return self._cut_block(geometry, src, make_piece)
        g = geometry
        key = (type(g).__name__, g.rank, g.size, g.chunk, g.query_length, g.key_length, src, cache_key)
        if key not in self._pieces:
            self._pieces[key] = self._cut_block(geometry, src, make_piece)
        return self._pieces[key]

    def sees(self, geometry, src: int, position: int) -> bool:
        """Whether the queries of ring position ``position`` see any key of block ``src`` (whether it would cut any
        piece; none is made). The ids are the whole sequence's on every rank, so both ends of a transfer answer
        alike: ring attention sends a block only where it is seen."""
        g = geometry
        key = ("sees", g.size, g.chunk, g.query_length, g.key_length, src, position)
        if key not in self._pieces:
            self._pieces[key] = bool(self._cut_block(replace(g, rank=position), src, _nothing))
        return self._pieces[key]

    def _cut_block(self, g, src: int, make_piece) -> list:
        if not self.causal and not bool(self.query_ids.any()):
            return self._padding_pieces(g, src, make_piece)
        pieces = []
        block = [run for run in g.key_runs(src) if run[2] < g.key_length]
        for batch, query_runs, key_runs, shared in self.groups():
            for q_start, _, q_first, q_last in g.query_runs():
                for k_start, _, k_first, k_last in block:
                    # padding positions (past the length) neither ask nor answer: their rows are cut off at the exit
                    spans = (q_first, min(q_last, g.query_length - 1)), (k_first, min(k_last, g.key_length - 1))
                    for queries, keys in matching_runs(query_runs, key_runs, *spans):
                        for (a, b), (c, d), diagonal, edge in self._cut(queries, keys):
                            rows = slice(q_start + a - q_first, q_start + b - q_first)
                            cols = slice(k_start + c - k_first, k_start + d - k_first)
                            pieces.append(make_piece(batch, rows, cols, (a, b), (c, d), diagonal,
                                                     src * 2 ** 20 + len(pieces), keys_real_in(shared, c, d),
                                                     self.window if edge else None))
        return pieces

    def _padding_pieces(self, g, src: int, make_piece) -> list:
        """Padding without causality: every query sees the same keys, so one piece per block: this rank's real
        queries against the block's keys up to its last real one (positions past the length come last in each
        chunk), with a key row where some row's key among them is padding."""
        rows, cols = real_prefix(g.query_runs(), g.query_length), real_prefix(g.key_runs(src), g.key_length)
        if not rows or not cols:
            return []
        positions = g.key_positions(src)[:cols]
        real = self.key_ids.index_select(1, positions) == 0  # [b, cols]
        seen = real.any(0)
        if not bool(seen.any()):
            return []
        cols = int(torch.nonzero(seen).max()) + 1
        real = real[:, :cols]
        return [make_piece(slice(None), slice(0, rows), slice(0, cols), g.query_positions()[:rows], positions[:cols],
                           False, src * 2 ** 20, None if bool(real.all()) else real, None)]

    def _cut(self, queries, keys):
        if not self.causal:
            return [(queries, keys, False, False)]
        parts = causal_cut(*queries, *keys)
        if self.window is None:
            return [(rows, cols, diagonal, False) for rows, cols, diagonal in parts]
        return [cut for rows, cols, diagonal in parts for cut in window_cut(*rows, *cols, diagonal, self.window)]


def _nothing(*args) -> bool:
    """A piece maker that makes nothing (:meth:`MaskSpec.sees` asks only whether there would be a piece)."""
    return True


def _additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, torch.finfo(dtype).min)


# ------------------------------------------------------------------------------------------- the mask builder
def _offset(value) -> bool:
    return bool(value) if not torch.is_tensor(value) else bool((value != 0).any())


def describe(*, batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask: torch.Tensor | None = None, local_size=None, device="cpu", **_) -> MaskSpec | str:
    """The spec of the mask transformers asks for, or the reason it stays dense."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, prepare_padding_mask

    if torch.compiler.is_compiling():
        return "torch.compile"  # the pieces are read from the data: a compiled graph keeps transformers' mask
    window = sliding_window(mask_function, local_size)
    if window is not None and window < 1:
        return "a window that hides every key"  # built by models that never use it (Qwen2-MoE's window of 0)
    if window is None and (mask_function not in (causal_mask_function, bidirectional_mask_function)
                           or local_size is not None):
        return "mask function"  # chunks, packed position ids, overlays
    if _offset(q_offset) or _offset(kv_offset):
        return "cache offset"
    if torch.device(device).type == "meta" or (attention_mask is not None and attention_mask.is_meta):
        return "meta"
    causal = window is not None or mask_function is causal_mask_function
    window = window if window is not None and window < kv_length else None  # a window past the length: causal
    documents = _documents_of(causal, batch_size, q_length, kv_length)
    if documents is not None:  # every real token sees its own document (a padding query may see none)
        return MaskSpec(*(ids.to(device=device, dtype=torch.long) for ids in documents), causal, window)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    valid = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device) if padding is None else \
        padding.to(device=device, dtype=torch.bool).expand(batch_size, kv_length)
    if not _every_query_sees_a_key(valid, causal, window):
        return "a query that sees no key"  # transformers' kernels decide what such a row computes
    key_ids = torch.where(valid, 0, -1)
    return MaskSpec(torch.zeros(batch_size, q_length, dtype=torch.long, device=device), key_ids, causal, window)


def _causal_kind(mask_function, local_size) -> bool:
    """Whether a mask function transformers passes is of the causal kind (causal, sliding window, anything built
    on them) rather than bidirectional: by whether query 0 sees key 1."""
    from transformers.masking_utils import bidirectional_mask_function

    if mask_function is bidirectional_mask_function:
        return False
    zero, one = torch.tensor(0), torch.tensor(1)
    return not bool(mask_function(zero, zero, zero, one))


def _every_query_sees_a_key(valid: torch.Tensor, causal: bool, window: int | None) -> bool:
    """Whether each query (all seeing the same real keys ``valid`` [b, L], up to itself where ``causal``, within
    ``window``) sees at least one."""
    if not causal:
        return bool(valid.any(-1).all())
    if window is None:
        return bool(valid[:, 0].all())
    seen = torch.nn.functional.pad(valid.long().cumsum(-1), (window, 0))  # real keys up to each query, shifted
    return bool((seen[:, window:] - seen[:, :-window] > 0).all())


def sliding_window(mask_function, local_size) -> int | None:
    """The window of transformers' ``sliding_window_causal_mask_function(local_size)`` (recognised by its parts'
    code: and_masks of sliding_window_overlay(local_size) and causal_mask_function), else None."""
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay

    if local_size is None or getattr(mask_function, "__code__", None) is not _and_masks_code():
        return None
    parts = next((c.cell_contents for c in mask_function.__closure__ or () if isinstance(c.cell_contents, tuple)), ())
    if len(parts) != 2 or parts[1] is not causal_mask_function or \
            getattr(parts[0], "__code__", None) is not sliding_window_overlay(1).__code__:
        return None
    window = parts[0].__closure__[0].cell_contents
    return window if window == local_size else None


@functools.cache
def _and_masks_code():
    from transformers.masking_utils import and_masks

    return and_masks(lambda *args: True).__code__


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
        documents = None if _DOCUMENTS.get() is None else _documents_of(
            _causal_kind(kwargs.get("mask_function"), kwargs.get("local_size")), kwargs["batch_size"],
            kwargs["q_length"], kwargs["kv_length"])
        if documents is not None:  # a packed forward: the dense mask keeps the documents apart too
            from transformers.masking_utils import and_masks

            kwargs = {**kwargs, "mask_function": and_masks(kwargs["mask_function"], same_document(*documents)),
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
