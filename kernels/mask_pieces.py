"""Cutting attention into pieces along runs of ids (:class:`~.mask_spec.MaskSpec`): which query positions meet
which key positions with nothing to mask, where the causal diagonal needs the kernel's causal flag, and where a
sliding window's edge needs a small mask. Positions are global; spans are half-open [start, stop)."""

from __future__ import annotations

import torch

#: rows per tile of a piece a sliding window crosses: each tile's window edge is a mask of at most tile x tile
WINDOW_TILE = 512


def real_prefix(runs, length: int) -> int:
    """How many of a block's positions (its ``runs``) are within ``length``: a prefix of the chunk (of its first
    segment, or all of it and of the second's), since positions past the length are the sequence's last."""
    return sum(max(0, min(last, length - 1) - first + 1) for _, _, first, last in runs)


def keys_real_in(keys, start: int, stop: int) -> torch.Tensor | None:
    """Which keys of [start, stop) are real per row, or None where all are (no mask)."""
    if keys is None or bool(keys[1][:, start:stop].all()):
        return None
    return keys[0][:, start:stop]


def id_runs(ids: torch.Tensor) -> list[tuple[int, int, int]]:
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


def matching_runs(query_runs, key_runs, query_span, key_span):
    """((query start, stop), (key start, stop)) of every query run and key run of the same id within the spans; a
    padding query run (id < 0) of a row whose keys hold no padding meets every key run (:class:`MaskSpec`)."""
    keys: dict[int, list] = {}
    for c, d, value in _clip(key_runs, *key_span):
        keys.setdefault(value, []).append((c, d))
    everything = sorted(span for spans in keys.values() for span in spans)
    sees_all = not any(value < 0 for _, _, value in key_runs)
    for a, b, value in _clip(query_runs, *query_span):
        for c, d in everything if value < 0 and sees_all else keys.get(value, ()):
            yield (a, b), (c, d)


def causal_cut(a: int, b: int, c: int, d: int):
    """Queries [a, b) against keys [c, d) under k <= q: ((rows), (cols), diagonal) parts with no mask, or with the
    kernel's causal flag aligned at their top-left corner (``diagonal``)."""
    if c > b - 1:
        return []  # every key after every query
    if d - 1 <= a:
        return [((a, b), (c, d), False)]  # every key at or before every query
    parts = [((a, b), (c, a), False)] if c < a else []  # the keys before the first query: all seen
    start = max(a, c)
    return parts + [((start, b), (start, d), True)]  # rows before ``start`` see none of the rest


def window_cut(a: int, b: int, c: int, d: int, diagonal: bool, window: int):
    """A part of the causal cut (queries [a, b) against keys [c, d), every key at or before every query, or
    ``diagonal``: aligned at the corner) under q - k < ``window``: ((rows), (cols), diagonal, edge) parts; an
    ``edge`` part needs the window's mask (k > q - window), at most WINDOW_TILE x WINDOW_TILE."""
    if (b - 1) - c < window:
        return [((a, b), (c, d), diagonal, False)]  # every pair within the window
    if a - (d - 1) >= window:
        return []  # every key out of every query's window
    parts, tile = [], min(window, WINDOW_TILE)
    for r0 in range(a, b, tile):
        r1 = min(r0 + tile, b)
        first_any, first_all = max(c, r0 - window + 1), max(c, r1 - window)  # keys some / every row may see
        stop_all = min(d, r0) if diagonal else d  # causally seen by every row of the tile
        if first_any < min(first_all, stop_all):
            parts.append(((r0, r1), (first_any, min(first_all, stop_all)), False, True))
        if first_all < stop_all:
            parts.append(((r0, r1), (first_all, stop_all), False, False))
        if diagonal and r0 < d:  # the tile's own diagonal: within the window, since the tile is no wider than it
            parts.append(((r0, r1), (r0, min(d, r1)), True, False))
    return parts
