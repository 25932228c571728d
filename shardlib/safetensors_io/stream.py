"""Copying a tensor from any source with ``read_into`` (and, where it has them, ``extents``: whole byte ranges of
its files) into :class:`~shardlib.safetensors_io.writer.OutFile`\\ s, every source byte read once, memory bounded
by the writer's block pool. The one streaming surface of checkpoint conversion and export."""

from __future__ import annotations

import math

import torch

from . import base
from .base import scatter_read
from .writer import OutFile, Writer


def _blocks(writer: Writer, count: int, row: int):
    """``(i, k, block, pooled)`` for blocks of ``k`` whole rows of ``row`` bytes covering rows ``[0, count)``: a
    pool block when the rows fit one (``pooled``: the caller hands it on or gives it back), else a one-off buffer."""
    step = max(1, base.BLOCK // row)
    for i in range(0, count, step):
        k = min(step, count - i)
        pooled = k * row <= base.BLOCK
        yield i, k, writer.buffer() if pooled else torch.empty(k * row, dtype=torch.uint8), pooled


def copy_rows(writer: Writer, source, key: str, shape: tuple[int, ...], dtype: torch.dtype, start: int, stop: int,
              out: OutFile) -> None:
    """Append dim-0 rows ``[start, stop)`` of tensor ``key`` of ``source`` to ``out``. When the source stores them
    as whole byte ranges of its files (``source.extents``) they are copied inside the kernel (:meth:`Writer.copy`,
    hashed from the source on the way); otherwise block by block, each read straight into a pool buffer."""
    extents = source.extents(key, start, stop if shape else None) if hasattr(source, "extents") else None
    if extents is not None:
        for file, offset, nbytes in extents:
            writer.copy(out, file, offset, nbytes)
        return
    if not shape:  # a scalar
        block = writer.buffer()
        source.read_into(key, block[:dtype.itemsize].view(dtype).view(()))
        writer.emit(out, memoryview(block.numpy())[:dtype.itemsize], block)
        return
    row = math.prod(shape[1:]) * dtype.itemsize
    if row == 0:
        return
    for i, k, block, pooled in _blocks(writer, stop - start, row):
        source.read_into(key, block[:k * row].view(dtype).view(k, *shape[1:]), 0, start + i, start + i + k)
        writer.emit(out, memoryview(block.numpy())[:k * row], block if pooled else None)


def copy_split(writer: Writer, source, key: str, shape: tuple[int, ...], dtype: torch.dtype, dim: int | None,
               ranges: list[tuple[int, int, int]], outs: dict) -> int:
    """Copy tensor ``key`` of ``source`` split along ``dim`` into ``outs`` (``ranges``: ``(part, start, stop)``
    rows of ``dim`` per part; ``outs``: part -> :class:`OutFile`; ``dim`` None: whole, to ``outs[None]``), reading
    every source byte once: a split along dim 0 goes range by range; one along another dim in blocks of whole
    dim-0 rows whose columns go to each part's file. Returns the bytes copied."""
    nbytes = math.prod(shape) * dtype.itemsize
    if dim is None:
        copy_rows(writer, source, key, shape, dtype, 0, shape[0] if shape else 0, outs[None])
        return nbytes
    ranges = [(r, a, b) for r, a, b in ranges if b > a]
    if dim == 0:
        for r, a, b in ranges:
            copy_rows(writer, source, key, shape, dtype, a, b, outs[r])
        return nbytes
    if _copy_columns(writer, source, key, shape, dtype, dim, ranges, outs):
        return nbytes
    row = math.prod(shape[1:]) * dtype.itemsize
    if row == 0:
        return 0
    for i, k, block, pooled in _blocks(writer, shape[0], row):
        rows = source.read_into(key, block[:k * row].view(dtype).view(k, *shape[1:]), 0, i, i + k)
        for r, a, b in ranges:
            writer.emit_copy(outs[r], rows.narrow(dim, a, b - a), k * row // shape[dim] * (b - a))
        if pooled:
            writer.give_back(block)
    return nbytes


def _copy_columns(writer: Writer, source, key: str, shape: tuple[int, ...], dtype: torch.dtype, d: int,
                  ranges: list[tuple[int, int, int]], outs: dict) -> bool:
    """A tensor split along dim ``d`` > 0 whose source is one byte range of one file: seen as ``outer`` super-rows
    of ``shape[d] * inner`` bytes (``outer``: the product of the dims before ``d``), each super-row holds every
    part's run of columns back to back. A block of whole super-rows is read with ``preadv`` scattering each run
    straight into its part's region of one pool buffer, so each part comes out contiguous (no copy in this
    process), is hashed once and written with one ``pwrite``. False (nothing done) when the source does not have
    the tensor as one byte range or the parts' columns do not tile the dim."""
    extents = source.extents(key) if hasattr(source, "extents") else None
    if extents is None or len(extents) != 1 or not ranges or ranges[0][1] != 0 or ranges[-1][2] != shape[d] or \
            any(b != a for (_, _, b), (_, a, _) in zip(ranges, ranges[1:])):
        return False
    file, offset, nbytes = extents[0]
    if nbytes != math.prod(shape) * dtype.itemsize:
        return False
    inner = math.prod(shape[d + 1:]) * dtype.itemsize
    outer, row = math.prod(shape[:d]), shape[d] * inner
    if row == 0 or outer == 0:
        return True
    runs = [(outs[r], (b - a) * inner) for r, a, b in ranges]
    for i, k, block, pooled in _blocks(writer, outer, row):
        data = memoryview(block.numpy())
        parts, position = [], 0
        for out, run in runs:
            parts.append((out, data[position:position + k * run], run))
            position += k * run
        scatter_read(file.fd, [part[j * run:(j + 1) * run] for j in range(k) for _, part, run in parts],
                     offset + i * row, file.path)
        writer.emit_parts([(out, part) for out, part, _ in parts], block if pooled else None)
    return True
