"""Reading safetensors files without mapping them: a strict header parser and slice reads with ``preadv`` straight
into destination tensors."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from . import base
from .base import CheckpointError, Entry, ST_DTYPES, inside, pread_into, scatter_read, strict_json


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes as a uint8 matrix ``[rows, row_bytes]`` (a view, each row contiguous, rows evenly strided)
    with rows as long as the strides allow; None when ``t`` has no such view."""
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    try:
        u = t.view(torch.uint8)
    except RuntimeError:
        return None
    if u.stride(-1) != 1 and u.shape[-1] != 1:
        return None
    cols, k = u.shape[-1], u.dim() - 1
    while k > 0 and (u.shape[k - 1] == 1 or u.stride(k - 1) == cols):
        cols *= u.shape[k - 1]
        k -= 1
    try:
        return u.view(-1, cols)
    except RuntimeError:
        return None


def _split_rows(rows: torch.Tensor, run: int) -> torch.Tensor | None:
    """The uint8 matrix ``rows`` re-cut into rows of exactly ``run`` bytes, when that is a view."""
    if rows.shape[1] == run:
        return rows
    if rows.shape[1] % run:
        return None
    try:
        return rows.view(-1, run)
    except RuntimeError:
        return None


class SafetensorsFile:
    """One safetensors file, read without mmap: the header is parsed and checked here (length, JSON, dtypes,
    shapes against byte ranges, ranges inside the data area and covering it), tensor bytes are read with
    ``preadv`` into the caller's tensor. Errors name the file and the tensor."""

    def __init__(self, path: str | Path, scratch: dict | None = None):
        self.path = Path(path)
        self._scratch = {} if scratch is None else scratch  # the row-block buffer, shared by a reader's files
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise CheckpointError(f"missing checkpoint file {self.path}") from None
        try:
            self.entries, self.metadata = self._parse_header()
        except BaseException:
            self.close()
            raise

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable safetensors file ({why})")

    def _parse_header(self) -> tuple[dict[str, Entry], dict]:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._bad(f"{size} bytes: too short for a header (truncated?)")
        prefix = bytearray(8)
        pread_into(self._fd, memoryview(prefix), 0, self.path)
        length = int.from_bytes(prefix, "little")
        if not 2 <= length <= size - 8:
            raise self._bad(f"header length {length} is impossible for a file of {size} bytes (corrupt or truncated)")
        if length > base.MAX_HEADER:  # checked before anything is allocated or read
            raise self._bad(f"header length {length} exceeds the limit of {base.MAX_HEADER} bytes")
        raw = bytearray(length)
        pread_into(self._fd, memoryview(raw), 8, self.path)
        try:
            header = strict_json(bytes(raw), "header")
        except CheckpointError as exc:
            raise self._bad(str(exc)) from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        metadata = header.pop("__metadata__", None)
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._bad(f"__metadata__ is not an object of strings: {metadata!r:.200}")
        data_start, data_size = 8 + length, size - 8 - length
        entries, ranges = {}, []
        for name, e in header.items():
            if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
                raise self._bad(f"tensor {name!r}: entry needs dtype, shape and data_offsets, got {e!r:.200}")
            dtype = ST_DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
            if dtype is None:
                raise self._bad(f"tensor {name!r}: unknown dtype {e['dtype']!r}")
            shape, offsets = e["shape"], e["data_offsets"]
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise self._bad(f"tensor {name!r}: bad shape {shape!r}")
            if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                    or not 0 <= offsets[0] <= offsets[1]):
                raise self._bad(f"tensor {name!r}: bad data_offsets {offsets!r}")
            nbytes = math.prod(shape) * dtype.itemsize
            if offsets[1] - offsets[0] != nbytes:
                raise self._bad(f"tensor {name!r}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, "
                                f"shape {shape} of {e['dtype']} needs {nbytes}")
            if offsets[1] > data_size:
                raise self._bad(f"tensor {name!r}: data_offsets {offsets} lie outside the data area of "
                                f"{data_size} bytes (truncated?)")
            entries[name] = Entry(dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
            ranges.append((offsets[0], offsets[1], name))
        position = 0
        for begin, end, name in sorted(ranges):
            if begin != position:
                raise self._bad(f"tensor {name!r}: data_offsets start at {begin}, expected {position} "
                                "(overlapping tensors or a gap in the data area)")
            position = end
        if position != data_size:
            raise self._bad(f"the tensors end at byte {position} of a {data_size}-byte data area (trailing bytes)")
        return entries, metadata

    @property
    def fd(self) -> int:
        """The open file descriptor (for ``preadv`` and in-kernel copies by the writer)."""
        return self._fd

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def keys(self):
        return self.entries.keys()

    def entry(self, key: str) -> Entry:
        if key not in self.entries:
            raise CheckpointError(f"{self.path}: no tensor {key!r} in the file")
        return self.entries[key]

    def extent(self, key: str, start: int = 0, stop: int | None = None) -> tuple[SafetensorsFile, int, int]:
        """``(self, offset, nbytes)``: where dim-0 rows ``[start, stop)`` of tensor ``key`` lie in this file (the
        whole tensor for a scalar, or when ``stop`` is None and ``start`` 0): one contiguous byte range."""
        e = self.entry(key)
        if not e.shape:
            if (start, stop) not in ((0, None), (0, 1)):
                raise CheckpointError(f"{self.path}: tensor {key!r} is a scalar, no rows [{start}, {stop})")
            return self, e.begin, e.end - e.begin
        stop = e.shape[0] if stop is None else stop
        if not 0 <= start <= stop <= e.shape[0]:
            raise CheckpointError(f"{self.path}: rows [{start}, {stop}) are outside tensor {key!r} of shape {e.shape}")
        row = math.prod(e.shape[1:]) * e.dtype.itemsize
        return self, e.begin + start * row, (stop - start) * row

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``dim`` (the whole tensor when ``dim`` is None) as a new tensor."""
        e = self.entry(key)
        shape = list(e.shape)
        if dim is not None:
            shape[dim] = (shape[dim] if stop is None else stop) - start
        out = torch.empty(shape, dtype=e.dtype)
        self.read_into(key, out, dim, start, stop)
        return out

    def read_into(self, key: str, out: torch.Tensor, dim: int | None = None, start: int = 0,
                  stop: int | None = None) -> torch.Tensor:
        """Read rows ``[start, stop)`` of ``dim`` of tensor ``key`` (all of it when ``dim`` is None) into ``out``,
        which has exactly that shape and may be a strided view (e.g. a narrow of a parameter). Only those bytes
        are read, with ``preadv`` straight into ``out`` when its dtype matches; a slice along dim > 0 is read in
        row blocks of at most 4 MiB through a reused buffer, or run by run when runs are long. Returns ``out``."""
        e = self.entry(key)
        shape = e.shape
        if dim is not None:
            if not 0 <= dim < len(shape):
                raise CheckpointError(f"{self.path}: tensor {key!r} of shape {shape} has no dim {dim}")
            stop = shape[dim] if stop is None else stop
            if not 0 <= start <= stop <= shape[dim]:
                raise CheckpointError(f"{self.path}: rows [{start}, {stop}) of dim {dim} are outside tensor {key!r} "
                                      f"of shape {shape}")
            want = shape[:dim] + (stop - start,) + shape[dim + 1:]
        else:
            want = shape
        if tuple(out.shape) != want:
            raise CheckpointError(f"{self.path}: tensor {key!r}: reading shape {want} into a tensor of shape "
                                  f"{tuple(out.shape)}")
        if out.numel() == 0:
            return out
        if out.dtype != e.dtype or out.device.type != "cpu":
            out.copy_(self.read_into(key, torch.empty(want, dtype=e.dtype), dim, start, stop))  # converts
            return out
        dest = _as_rows(out)
        if dim is None or dim == 0 or math.prod(shape[:dim]) == 1 or stop - start == shape[dim]:
            # one contiguous byte range of the file: any row split of the destination fits it
            inner = math.prod(shape[dim + 1:]) * e.dtype.itemsize if dim is not None else 0
            first = e.begin + (start * inner if dim is not None and math.prod(shape[:dim]) == 1 else 0)
            if dest is not None:
                self._copy_rows(first, dest.shape[1], dest)
                return out
        else:
            inner = math.prod(shape[dim + 1:]) * e.dtype.itemsize
            run = (stop - start) * inner
            rows = _split_rows(dest, run) if dest is not None else None
            if rows is not None:
                self._copy_rows(e.begin + start * inner, shape[dim] * inner, rows)
                return out
        out.copy_(self.read_into(key, torch.empty(want, dtype=e.dtype), dim, start, stop))  # odd strides
        return out

    def _copy_rows(self, offset: int, stride: int, dest: torch.Tensor) -> None:
        """``dest[i] = file[offset + i * stride : + dest.shape[1]]`` for every row i of the uint8 matrix ``dest``."""
        rows, run = dest.shape
        if stride == run and dest.is_contiguous():
            pread_into(self._fd, memoryview(dest.numpy()).cast("B"), offset, self.path)
        elif stride == run:  # one contiguous range of the file into evenly strided rows: scatter into them
            scatter_read(self._fd, [memoryview(row) for row in dest.numpy()], offset, self.path)
        elif run >= base.DIRECT_ROW or stride > base.BLOCK:
            for i in range(rows):
                pread_into(self._fd, memoryview(dest[i].numpy()), offset + i * stride, self.path)
        else:
            scratch = self._scratch.get("block")
            if scratch is None or scratch.numel() < base.BLOCK:
                scratch = self._scratch["block"] = torch.empty(base.BLOCK, dtype=torch.uint8)
            step = base.BLOCK // stride
            for i in range(0, rows, step):
                k = min(step, rows - i)
                nbytes = (k - 1) * stride + run  # not past the last run: it may end the file
                pread_into(self._fd, memoryview(scratch.numpy())[:nbytes], offset + i * stride, self.path)
                dest[i:i + k].copy_(scratch.as_strided((k, run), (stride, 1)))


class ReaderPool:
    """Open :class:`SafetensorsFile` readers kept by key (each file opened once, sharing one block buffer), all
    closed by :meth:`close` or at the end of a ``with`` block."""

    def __init__(self):
        self._readers: dict = {}
        self._scratch: dict = {}

    def _reader_for(self, key, open_path) -> SafetensorsFile:
        """The reader of ``key``, opening ``open_path()`` the first time."""
        if key not in self._readers:
            self._readers[key] = SafetensorsFile(open_path(), self._scratch)
        return self._readers[key]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._scratch.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


INDEX = "model.safetensors.index.json"


class SafetensorsFiles(ReaderPool):
    """The tensors of a directory of safetensors files (a single ``model.safetensors``, an HF index + shards, or
    explicit key -> file map), read slice by slice without mmap. Files open lazily (once each); a corrupt or
    truncated file is an error naming it."""

    def __init__(self, directory: str | Path, weight_map: dict[str, str] | None = None):
        super().__init__()
        self.directory = Path(directory)
        index = self.directory / INDEX
        if weight_map is None and index.exists():
            weight_map = self._index_weight_map(index)
            paths = {}
            for name in set(weight_map.values()):  # each file once, named with the index that names it
                try:
                    paths[name] = inside(self.directory, name)
                except CheckpointError as exc:
                    raise CheckpointError(f"{index}: {exc}") from None
                if not paths[name].is_file():
                    raise CheckpointError(f"{index}: names shard {name!r}, which is missing from {self.directory}")
        else:
            weight_map = self._single_file_map() if weight_map is None else weight_map
            paths = {name: inside(self.directory, name) for name in set(weight_map.values())}  # each file once
        self.weight_map = {key: paths[name] for key, name in weight_map.items()}

    @staticmethod
    def _index_weight_map(index: Path) -> dict[str, str]:
        """The ``weight_map`` of an HF index, checked: an object of tensor name -> file name."""
        document = strict_json(index.read_bytes(), str(index))
        if not isinstance(document, dict):
            raise CheckpointError(f"{index}: a JSON {type(document).__name__}, expected an object with a 'weight_map'")
        weight_map = document.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' missing or not an object of tensor name -> file name")
        for key, name in weight_map.items():
            if not isinstance(name, str) or not name:
                raise CheckpointError(f"{index}: weight_map[{key!r}] is {name!r:.100}, expected a file name")
        return weight_map

    def _single_file_map(self) -> dict[str, str]:
        single = self.directory / "model.safetensors"
        if not single.exists():
            raise CheckpointError(f"{self.directory}: no model.safetensors or model.safetensors.index.json")
        return {key: single.name for key in self._handle(single).keys()}

    def _handle(self, path: Path) -> SafetensorsFile:
        return self._reader_for(path, lambda: path)

    def _entry(self, key: str) -> Entry:
        return self._handle(self.weight_map[key]).entry(key)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def dtype(self, key: str) -> torch.dtype:
        return self._entry(key).dtype

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``dim`` (the whole tensor when ``dim`` is None), reading only those bytes."""
        return self._handle(self.weight_map[key]).read(key, dim, start, stop)

    def extents(self, key: str, start: int = 0, stop: int | None = None) -> list[tuple[SafetensorsFile, int, int]]:
        """Where dim-0 rows ``[start, stop)`` of ``key`` lie: ``[(file, offset, nbytes)]`` (one range: a tensor
        lives in one file), for in-kernel copies (:meth:`Writer.copy`)."""
        return [self._handle(self.weight_map[key]).extent(key, start, stop)]

    def read_into(self, key: str, out: torch.Tensor, dim: int | None = None, start: int = 0,
                  stop: int | None = None) -> torch.Tensor:
        """:meth:`SafetensorsFile.read_into` on the file holding ``key``."""
        return self._handle(self.weight_map[key]).read_into(key, out, dim, start, stop)

