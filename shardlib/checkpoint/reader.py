"""Reading a sharded checkpoint: its checked metadata, verified files, and slice reads across pieces."""

from __future__ import annotations

from pathlib import Path

import torch

from ..safetensors_io import (
    DTYPES, CheckpointError, ReaderPool, SafetensorsFile, checksum_of, dtype_name, file_checksum, inside,
)
from .atomic import recover
from .format import METADATA, header_pieces, header_problem, piece_shape, piece_spans, read_document


class ShardedCheckpoint(ReaderPool):
    """A sharded checkpoint directory: its metadata, verified files, and slice reads across pieces."""

    def __init__(self, directory: str | Path, *, verify: bool = True):
        super().__init__()
        self.directory = Path(directory)
        meta_path = self.directory / METADATA
        if not meta_path.exists():
            recover(self.directory)  # a save killed between its two renames left the checkpoint aside
        if not meta_path.exists():
            raise CheckpointError(f"{self.directory}: no {METADATA} (not a shardlib checkpoint, or an unfinished save)")
        self.meta = read_document(meta_path)
        self.tensors = self.meta["tensors"]
        self._verified: dict[str, Path] = {}  # file name -> checked path
        self._held: dict[str, dict | None] = {}  # file name -> the pieces its header records (None: none recorded)
        self._verify = verify
        for file in {p["file"] for t in self.tensors.values() for p in t["pieces"]}:
            inside(self.directory, file)

    def problems(self) -> list[str]:
        """Completeness and checksums of every file, and that each piece's file stores it (dtype and shape as
        recorded); an empty list when the checkpoint is whole."""
        needed = {p["file"] for t in self.tensors.values() for p in t["pieces"]}
        bad = needed - set(self.meta["files"])
        out = [f"{name}: named by tensors but not listed in {METADATA}" for name in sorted(bad)]
        for name, info in sorted(self.meta["files"].items()):
            try:
                self._check_file(name, info)
            except CheckpointError as exc:
                out.append(str(exc))
                bad.add(name)
        for name, t in self.tensors.items():
            for piece in t["pieces"]:
                if piece["file"] not in bad:
                    try:
                        self._piece_reader(name, piece)
                    except CheckpointError as exc:
                        out.append(str(exc))
        return out

    def verified_file(self, name: str) -> Path:
        """The path of file ``name`` listed in the metadata, after checking its size and checksum."""
        if name not in self.meta["files"]:
            raise CheckpointError(f"{self.directory / name}: not listed in {METADATA}")
        return self._check_file(name, self.meta["files"][name])

    def _check_file(self, name: str, info: dict) -> Path:
        if name in self._verified:
            return self._verified[name]
        path = inside(self.directory, name)
        if not path.exists():
            raise CheckpointError(f"missing checkpoint file {path}")
        if path.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, {METADATA} records {info['bytes']} (truncated?)")
        if self._verify:
            algorithm, value = file_checksum(info)
            if checksum_of(path, algorithm) != value:
                raise CheckpointError(f"{path}: checksum mismatch (corrupted; {algorithm})")
        self._verified[name] = path
        return path

    def _reader(self, file: str) -> SafetensorsFile:
        """One open reader per file (verified once) for every tensor stored in it."""
        if file not in self._readers and file not in self.meta["files"]:
            raise CheckpointError(f"{self.directory / file}: named by tensors but not listed in {METADATA}")
        return self._reader_for(file, lambda: self._check_file(file, self.meta["files"][file]))

    def _piece_reader(self, name: str, piece: dict) -> SafetensorsFile:
        """The reader of ``piece``'s file, once the file is known to store that piece of ``name``: the dtype and
        the rows that the metadata records, and, where the file's header records the pieces it holds, that very
        piece (a file that disagrees is refused, never read as something else: two same-size pieces swapped)."""
        reader = self._reader(piece["file"])
        entry, meta = reader.entry(name), self.tensors[name]
        shape = list(piece_shape(meta["shape"], piece["dim"], piece["start"], piece["stop"], piece.get("blocks", 1)))
        if entry.dtype != self.dtype(name) or list(entry.shape) != shape:
            raise CheckpointError(f"{reader.path}: tensor {name!r} is {dtype_name(entry.dtype)} {list(entry.shape)}, "
                                  f"{METADATA} records {meta['dtype']} {shape} for this piece")
        if piece["file"] not in self._held:
            self._held[piece["file"]] = header_pieces(reader.metadata, str(reader.path))
        problem = header_problem(self._held[piece["file"]], name, meta, piece)
        if problem:
            raise CheckpointError(f"{reader.path}: {problem}")
        return reader

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.tensors[name]["dtype"]]  # a known name: read_document checked it

    def extents(self, name: str, start: int = 0,
                stop: int | None = None) -> list[tuple[SafetensorsFile, int, int]] | None:
        """Where global dim-0 rows ``[start, stop)`` of ``name`` lie, as ``[(file, offset, nbytes)]`` in order
        (the whole tensor when ``stop`` is None and ``start`` 0), or None when they are not whole byte ranges of
        the files (pieces split along another dim). Opens (and so verifies) the files. The pieces tile the tensor
        (:func:`.format.read_document` checked it when the checkpoint was opened)."""
        t = self.tensors[name]
        pieces, shape = t["pieces"], tuple(t["shape"])
        whole = next((p for p in pieces if p["dim"] is None), None)
        if whole is not None:
            return [self._piece_reader(name, whole).extent(name, start, stop)]
        if not shape or any(p["dim"] != 0 for p in pieces):
            return None
        stop = shape[0] if stop is None else stop
        return [self._piece_reader(name, p).extent(name, at, at + hi - lo)
                for p, lo, hi, at in _overlaps(pieces, shape, start, stop)]

    def read(self, name: str, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
        """Global rows ``[start, stop)`` of ``dim`` of tensor ``name`` (whole tensor when dim is None), as a new
        tensor read from the pieces that overlap them."""
        shape = list(self.shape(name))
        if dim is not None:
            shape[dim] = (shape[dim] if stop is None else stop) - start
        return self.read_into(name, torch.empty(shape, dtype=self.dtype(name)), dim, start, stop)

    def read_into(self, name: str, out: torch.Tensor, dim: int | None = None, start: int = 0,
                  stop: int | None = None) -> torch.Tensor:
        """Read global rows ``[start, stop)`` of ``dim`` of tensor ``name`` (all of it when dim is None) into
        ``out`` (that shape; may be a strided view): each stored span that overlaps them (a piece's rows; each
        block's, for a blocked piece) is read straight into its part of ``out``. Pieces split along another dim
        than ``dim`` each fill their own rows of that dim (:meth:`_read_across`). The pieces tile the tensor along
        one dim (checked when the checkpoint was opened)."""
        t = self.tensors[name]
        pieces = t["pieces"]
        if any(p["dim"] is None for p in pieces):  # stored whole
            return self._piece_reader(name, pieces[0]).read_into(name, out, dim, start, stop)
        shape, pdim = tuple(t["shape"]), pieces[0]["dim"]
        if dim is None:
            dim, start, stop = pdim, 0, shape[pdim]
        stop = shape[dim] if stop is None else stop
        if dim != pdim:
            for p in pieces:
                self._read_across(name, p, out, dim, start, stop)
            return out
        for p, lo, hi, at in _overlaps(pieces, shape, start, stop):
            self._piece_reader(name, p).read_into(name, out.narrow(dim, lo - start, hi - lo), dim, at, at + hi - lo)
        return out

    def _read_across(self, name: str, piece: dict, out: torch.Tensor, dim: int, start: int, stop: int) -> None:
        """Global rows ``[start, stop)`` of ``dim`` from ``piece``, split along another dim, into its own rows of
        that dim in ``out``: straight in for a piece of one span; a blocked piece's spans are not one view of
        ``out``, so its part of the rows is read once and each span copied to its place."""
        reader, pdim = self._piece_reader(name, piece), piece["dim"]
        spans = piece_spans(piece, self.shape(name))
        if len(spans) == 1:
            a, b, _ = spans[0]
            reader.read_into(name, out.narrow(pdim, a, b - a), dim, start, stop)
            return
        stored = reader.read(name, dim, start, stop)  # this piece's part only, never the whole tensor
        for a, b, at in spans:
            out.narrow(pdim, a, b - a).copy_(stored.narrow(pdim, at, b - a))


def _overlaps(pieces: list[dict], shape: tuple[int, ...], start: int, stop: int) -> list[tuple[dict, int, int, int]]:
    """``(piece, lo, hi, at)`` for every stored span (:func:`.format.piece_spans`) of ``pieces``, split along one
    dim, that overlaps global rows ``[start, stop)`` of it, in global order: global rows ``[lo, hi)`` are the
    piece's stored rows ``[at, at + hi - lo)``."""
    found = []
    for p in pieces:
        for a, b, offset in piece_spans(p, shape):
            lo, hi = max(start, a), min(stop, b)
            if lo < hi:
                found.append((p, lo, hi, offset + lo - a))
    return sorted(found, key=lambda span: span[1])
