"""Reading and writing safetensors files without mapping them: strict header parsing, slice reads with ``preadv``
straight into destination tensors, and streamed checksummed writes (used by :mod:`shardlib.checkpoint`).

Reading never maps a file: :class:`SafetensorsFile` parses the safetensors header itself (strictly: every error
names the file and the tensor) and reads exactly the bytes of the requested rows straight into the destination
tensor, so a rank's resident memory is its local shards and never the file's pages. Nothing is ever unpickled.
Writing streams: a file's header first, then each tensor's bytes in bounded blocks, written by background threads
while the caller hashes (xxh3-128) and reads the next block; byte ranges of another file are copied inside the
kernel (``copy_file_range``) while the caller reads them once to hash them; files are fsynced when finished.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                                     torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}
CHECKSUM = "xxh3_128"  # of every written file; v1 checkpoints carry "sha256" entries, still verified
BLOCK = 4 << 20  # bytes: the unit of every streamed read and write (bounded buffers). Converting BERT-large here,
#                 4 MiB beat 16 MiB and 1 MiB: a block is still in cache when it is hashed and written.
DIRECT_ROW = 1 << 20  # strided reads of runs at least this long go straight to the destination, one per run
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
COPY_CHUNK = 16 << 20  # bytes per in-kernel copy (copy_file_range) job
HASH_BLOCK = 1 << 20  # bytes read at a time to hash copied ranges: fits the L2 cache (read + hash of 1.34 GB took
#                      0.18 s of CPU with 1 MiB, 0.22 s with 4 MiB here)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or cannot go into this model: the message names the file or tensor."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------------------ checksums
def _hasher(algorithm: str):
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r}")


def checksum_of(path: Path, algorithm: str = CHECKSUM) -> str:
    """Hex digest of a whole file (read in blocks into one reused buffer)."""
    digest = _hasher(algorithm)
    buffer = memoryview(bytearray(min(BLOCK, max(os.path.getsize(path), 1))))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(buffer[:n])
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    return checksum_of(path, "sha256")


def file_checksum(info: dict) -> tuple[str, str]:
    """(algorithm, hex value) of a ``files`` entry of ``shardlib.json`` (v2 ``checksum`` or v1 ``sha256``)."""
    if "checksum" in info:
        return info["checksum"]["algorithm"], info["checksum"]["value"]
    return "sha256", info["sha256"]


def _inside(directory: Path, name: str) -> Path:
    """``directory / name``, refusing names that leave the directory (path traversal in an index)."""
    path = (directory / name).resolve()
    if directory.resolve() not in path.parents:
        raise CheckpointError(f"{name!r} points outside the checkpoint directory {directory}")
    return path


# ---------------------------------------------------------------------------------- safetensors, without mmap
# safetensors dtype names, in the order of safetensors' own Dtype enum (files list larger dtypes first)
_ST_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
              "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
              "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
              "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64}
_ST_NAMES = {t: name for name, t in _ST_DTYPES.items()}
_ST_RANK = {t: i for i, t in enumerate(_ST_DTYPES.values())}


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file: dtype, shape and absolute byte range ``[begin, end)`` in the file."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _pread_into(fd: int, view: memoryview, offset: int, path) -> None:
    """Fill ``view`` with the file's bytes from ``offset`` on (``preadv``: straight into the destination)."""
    while len(view):
        n = os.preadv(fd, [view[: 1 << 30]], offset)
        if n <= 0:
            raise CheckpointError(f"{path}: unexpected end of file at byte {offset} (truncated?)")
        view, offset = view[n:], offset + n


_IOV_MAX = 1024  # buffers per preadv call (POSIX guarantees at least 16; Linux allows 1024)
try:
    _IOV_MAX = min(_IOV_MAX, os.sysconf("SC_IOV_MAX"))
except (AttributeError, ValueError, OSError):
    pass


def _scatter_read(fd: int, views: list[memoryview], offset: int, path) -> None:
    """Fill ``views`` in order from one contiguous range of the file (``preadv``: straight into each buffer)."""
    for i in range(0, len(views), _IOV_MAX):
        batch = views[i:i + _IOV_MAX]
        n = os.preadv(fd, batch, offset)
        offset += n
        for view in batch:  # a short read (rare): finish buffer by buffer
            if n >= len(view):
                n -= len(view)
                continue
            _pread_into(fd, view[n:], offset, path)
            offset += len(view) - n
            n = 0


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable memoryview of its own storage (no copy; any dtype,
    bfloat16 included: it is viewed as uint8)."""
    flat = t.detach().reshape(-1)  # a view: ``t`` is contiguous
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


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

    def _parse_header(self) -> tuple[dict[str, _Entry], dict]:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._bad(f"{size} bytes: too short for a header (truncated?)")
        prefix = bytearray(8)
        _pread_into(self._fd, memoryview(prefix), 0, self.path)
        length = int.from_bytes(prefix, "little")
        if not 2 <= length <= min(MAX_HEADER, size - 8):
            raise self._bad(f"header length {length} is impossible for a file of {size} bytes (corrupt or truncated)")
        raw = bytearray(length)
        _pread_into(self._fd, memoryview(raw), 8, self.path)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise self._bad(f"header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise self._bad("__metadata__ is not an object")
        data_start, data_size = 8 + length, size - 8 - length
        entries, ranges = {}, []
        for name, e in header.items():
            if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
                raise self._bad(f"tensor {name!r}: entry needs dtype, shape and data_offsets, got {e!r}")
            dtype = _ST_DTYPES.get(e["dtype"])
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
            entries[name] = _Entry(dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
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

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()

    def keys(self):
        return self.entries.keys()

    def entry(self, key: str) -> _Entry:
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
            _pread_into(self._fd, memoryview(dest.numpy()).cast("B"), offset, self.path)
        elif stride == run:  # one contiguous range of the file into evenly strided rows: scatter into them
            _scatter_read(self._fd, [memoryview(row) for row in dest.numpy()], offset, self.path)
        elif run >= DIRECT_ROW or stride > BLOCK:
            for i in range(rows):
                _pread_into(self._fd, memoryview(dest[i].numpy()), offset + i * stride, self.path)
        else:
            scratch = self._scratch.get("block")
            if scratch is None or scratch.numel() < BLOCK:
                scratch = self._scratch["block"] = torch.empty(BLOCK, dtype=torch.uint8)
            step = BLOCK // stride
            for i in range(0, rows, step):
                k = min(step, rows - i)
                nbytes = (k - 1) * stride + run  # not past the last run: it may end the file
                _pread_into(self._fd, memoryview(scratch.numpy())[:nbytes], offset + i * stride, self.path)
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


class SafetensorsFiles(ReaderPool):
    """The tensors of a directory of safetensors files (a single ``model.safetensors``, an HF index + shards, or
    explicit key -> file map), read slice by slice without mmap. Files open lazily (once each); a corrupt or
    truncated file is an error naming it."""

    def __init__(self, directory: str | Path, weight_map: dict[str, str] | None = None):
        super().__init__()
        self.directory = Path(directory)
        if weight_map is None:
            weight_map = self._hf_weight_map()
        paths = {name: _inside(self.directory, name) for name in set(weight_map.values())}  # each file once
        self.weight_map = {key: paths[name] for key, name in weight_map.items()}

    def _hf_weight_map(self) -> dict[str, str]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                return json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        single = self.directory / "model.safetensors"
        if not single.exists():
            raise CheckpointError(f"{self.directory}: no model.safetensors or model.safetensors.index.json")
        return {key: single.name for key in self._handle(single).keys()}

    def _handle(self, path: Path) -> SafetensorsFile:
        return self._reader_for(path, lambda: path)

    def _entry(self, key: str) -> _Entry:
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
        lives in one file), for in-kernel copies (:meth:`_Writer.copy`)."""
        return [self._handle(self.weight_map[key]).extent(key, start, stop)]

    def read_into(self, key: str, out: torch.Tensor, dim: int | None = None, start: int = 0,
                  stop: int | None = None) -> torch.Tensor:
        """:meth:`SafetensorsFile.read_into` on the file holding ``key``."""
        return self._handle(self.weight_map[key]).read_into(key, out, dim, start, stop)


# ------------------------------------------------------------------------------------------- streamed writing
def _header(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None) -> tuple[bytes, list]:
    """A safetensors header for ``(name, dtype, shape)`` tensors and their data order (safetensors' own: larger
    dtypes first, then by name; the JSON padded with spaces to 8 bytes), as ``save_file`` writes it."""
    order = sorted(tensors, key=lambda t: (-_ST_RANK[t[1]], t[0]))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in order:
        if dtype not in _ST_NAMES:
            raise CheckpointError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, order


def _writeback_starter():
    """``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)`` where the C library has it (Linux): start writing
    a range to disk now, so the fsync at the end waits for the tail only; else None."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, ImportError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd, offset, n: fn(fd, offset, n, 2)


_start_writeback = _writeback_starter()


_kernel_copy_works = hasattr(os, "copy_file_range")
_copy_buffers = threading.local()


def _copy_range(src_fd: int, dst_fd: int, count: int, src_offset: int, dst_offset: int) -> int:
    """Copy up to ``count`` bytes between two files at the given offsets; the bytes copied (0 at the source's end).
    ``os.copy_file_range`` copies inside the kernel (page cache to page cache, no user-space buffer); where the
    system refuses it (no such call, another file system type on older kernels, EINVAL/EOPNOTSUPP) this falls back
    once and for all to ``pread`` + ``pwrite`` through a per-thread 4 MiB buffer."""
    global _kernel_copy_works
    if _kernel_copy_works:
        try:
            return os.copy_file_range(src_fd, dst_fd, count, src_offset, dst_offset)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ETXTBSY):
                raise
            _kernel_copy_works = False
    buffer = getattr(_copy_buffers, "block", None)
    if buffer is None:
        buffer = _copy_buffers.block = memoryview(bytearray(BLOCK))
    n = os.preadv(src_fd, [buffer[:min(count, BLOCK)]], src_offset)
    done = 0
    while done < n:
        done += os.pwrite(dst_fd, buffer[done:n], dst_offset + done)
    return n


@dataclass(frozen=True)
class _Copy:
    """A writer-thread job: ``nbytes`` bytes of ``source`` (a :class:`SafetensorsFile`) from ``offset``."""
    source: SafetensorsFile
    offset: int
    nbytes: int


class _Shared:
    """A pool block whose parts go to several files: returned to the pool after its last part is written."""

    def __init__(self, block: torch.Tensor, parts: int):
        self.block, self.parts, self._lock = block, parts, threading.Lock()

    def done(self) -> bool:
        with self._lock:
            self.parts -= 1
            return self.parts == 0


def _copy_strided(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` in this thread only: numpy on uint8 views where the strides allow (torch's intra-op
    threads spin against the writer thread and other processes on a 2-core machine: 10x slower here)."""
    try:
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    except (RuntimeError, TypeError, ValueError):
        dst.copy_(src)


class _OutFile:
    """A safetensors file being streamed: its fd, expected size, hash and the tensors still to come, in order."""

    def __init__(self, path: Path, tensors: list, metadata: dict | None, checksum: str | None):
        header, order = _header(tensors, metadata)
        self.path, self.order = path, [name for name, _, _ in order]
        self.shapes = {name: (dtype, tuple(shape)) for name, dtype, shape in order}
        self.size = len(header) + sum(math.prod(s) * d.itemsize for _, d, s in order)
        self.hasher = _hasher(checksum) if checksum else None
        self.submitted = self.written = 0
        self._lock = threading.Lock()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.pending_header = header

    def write(self, view: memoryview, offset: int) -> None:
        """Write ``view`` at ``offset`` (writer threads; blocks of one file may be written in any order), then start
        its write-back to disk."""
        length = len(view)
        while len(view):
            n = os.pwrite(self.fd, view, offset + length - len(view))
            view = view[n:]
        if _start_writeback is not None and length >= DIRECT_ROW:
            _start_writeback(self.fd, offset, length)
        with self._lock:
            self.written += length

    def copy(self, job: _Copy, offset: int) -> None:
        """Copy ``job``'s source bytes to ``offset`` inside the kernel (writer threads), then start write-back."""
        done = 0
        while done < job.nbytes:
            n = _copy_range(job.source._fd, self.fd, job.nbytes - done, job.offset + done, offset + done)
            if n <= 0:
                raise CheckpointError(f"{job.source.path}: unexpected end of file at byte {job.offset + done} "
                                      "(truncated?)")
            done += n
        if _start_writeback is not None and job.nbytes >= DIRECT_ROW:
            _start_writeback(self.fd, offset, job.nbytes)
        with self._lock:
            self.written += job.nbytes

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Writer:
    """Streams safetensors files into ``directory``: :meth:`open` writes a file's header, then :meth:`tensor` /
    :meth:`emit` pass each tensor's bytes in the header's order. The calling thread hashes each block (in file
    order); a background thread writes it at its offset (so the caller's next read or hash overlaps the write);
    :meth:`finish` waits, checks every file is complete, fsyncs and closes them and returns
    ``{file: {"bytes", "checksum"}}``. Buffers for non-contiguous data come from a pool of a few 4 MiB blocks:
    memory stays bounded."""

    POOL = 8  # blocks of BLOCK bytes (32 MiB)
    THREADS = 1  # writer threads (pwrite at offsets: more would work; on 2 cores a second one did not help, also
    #              not one thread per output file for convert: 0.73 vs 0.69 s, the kernel's copies slowed each other)

    def __init__(self, directory: Path, *, checksum: str | None = CHECKSUM):
        self.directory, self.checksum = Path(directory), checksum
        self.files: dict[str, _OutFile] = {}
        self._free: queue.Queue = queue.Queue()
        self._allocated = 0
        self._jobs: queue.Queue = queue.Queue(maxsize=8)
        self._error: BaseException | None = None
        self._hash_buffer: memoryview | None = None  # copy(): the source bytes, read here to be hashed
        self._threads = [threading.Thread(target=self._run, name=f"shardlib-checkpoint-writer-{i}", daemon=True)
                         for i in range(self.THREADS)]
        for thread in self._threads:
            thread.start()

    # --- the writer threads
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            out, offset, data, release = job
            try:
                if self._error is None:
                    out.copy(data, offset) if isinstance(data, _Copy) else out.write(data, offset)
            except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
                self._error = exc
            finally:
                if isinstance(release, _Shared):
                    if release.done():
                        self._free.put(release.block)
                elif release is not None:
                    self._free.put(release)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    # --- buffers
    def buffer(self) -> torch.Tensor:
        """A free 4 MiB uint8 block (blocks until a writer thread returns one)."""
        self._check()
        if self._free.empty() and self._allocated < self.POOL:
            self._allocated += 1
            return torch.empty(BLOCK, dtype=torch.uint8)
        return self._free.get()

    def give_back(self, block: torch.Tensor) -> None:
        self._free.put(block)

    # --- files and bytes
    def open(self, name: str, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
             metadata: dict | None = None) -> _OutFile:
        out = _OutFile(self.directory / name, tensors, metadata, self.checksum)
        self.files[name] = out
        header, out.pending_header = out.pending_header, None
        self.emit(out, memoryview(header))
        return out

    def emit(self, out: _OutFile, view: memoryview, release: torch.Tensor | None = None) -> None:
        """Hash ``view`` here and hand it to the writer thread (``release``: a pool block to return after)."""
        self._check()
        if not len(view):
            if release is not None:
                self.give_back(release)
            return
        if out.submitted + len(view) > out.size:
            raise RuntimeError(f"{out.path}: more bytes than its header announces")
        if out.hasher is not None:
            out.hasher.update(view)
        self._jobs.put((out, out.submitted, view, release))
        out.submitted += len(view)

    def emit_parts(self, parts: list[tuple[_OutFile, memoryview]], block: torch.Tensor | None) -> None:
        """:meth:`emit` each ``(file, view)`` (views into one pool ``block``, returned after the last is written)."""
        parts = [(out, view) for out, view in parts if len(view)]
        if not parts:
            if block is not None:
                self.give_back(block)
            return
        shared = _Shared(block, len(parts)) if block is not None else None
        for out, view in parts:
            self.emit(out, view, shared)

    def copy(self, out: _OutFile, source: SafetensorsFile, offset: int, nbytes: int) -> None:
        """Append ``nbytes`` bytes of ``source`` from ``offset`` to ``out`` without passing them through this
        process: a writer thread copies them inside the kernel (``copy_file_range``) in chunks of 16 MiB, while this
        thread reads the same source bytes into one reused 1 MiB buffer and hashes them, in file order, so hashing
        overlaps the copy on the other core. (Without a checksum, e.g. ``export_hf``, nothing is read here.) The
        checksum is of the source bytes the kernel copies: were the source changed during the copy, the file would
        fail verification, never load silently wrong."""
        self._check()
        if out.submitted + nbytes > out.size:
            raise RuntimeError(f"{out.path}: more bytes than its header announces")
        scratch = None
        if out.hasher is not None:
            scratch = self._hash_buffer
            if scratch is None:
                scratch = self._hash_buffer = memoryview(bytearray(HASH_BLOCK))
        for i in range(0, nbytes, COPY_CHUNK):
            n = min(COPY_CHUNK, nbytes - i)
            self._jobs.put((out, out.submitted, _Copy(source, offset + i, n), None))
            out.submitted += n
            if scratch is not None:
                for j in range(i, i + n, len(scratch)):
                    view = scratch[:min(len(scratch), i + n - j)]
                    _pread_into(source._fd, view, offset + j, source.path)
                    out.hasher.update(view)
            self._check()

    def tensor(self, out: _OutFile, name: str, t: torch.Tensor) -> None:
        """Write in-memory tensor ``name`` (any strides) as the next tensor of ``out``."""
        dtype, shape = out.shapes[name]
        if (t.dtype, tuple(t.shape)) != (dtype, shape):
            raise RuntimeError(f"{out.path}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, the header says "
                               f"{dtype} {shape}")
        t = t.detach()
        if t.numel() == 0:
            return
        if t.is_contiguous():
            view = _bytes_of(t)
            for i in range(0, len(view), BLOCK):
                self.emit(out, view[i:i + BLOCK])
            return
        row = math.prod(shape[1:]) * dtype.itemsize
        if row > BLOCK:  # one row does not fit a block: rows one by one
            for i in range(shape[0]):
                self._emit_copy(out, t[i:i + 1], row)
            return
        step = BLOCK // row
        for i in range(0, shape[0], step):
            self._emit_copy(out, t[i:i + step], row * min(step, shape[0] - i))

    def _emit_copy(self, out: _OutFile, t: torch.Tensor, nbytes: int) -> None:
        """Copy a strided ``t`` into a pool block (or a one-off buffer when it is larger) and emit it."""
        block = self.buffer() if nbytes <= BLOCK else torch.empty(nbytes, dtype=torch.uint8)
        _copy_strided(block[:nbytes].view(t.dtype).view(t.shape), t)
        self.emit(out, memoryview(block.numpy())[:nbytes], block if nbytes <= BLOCK else None)

    def finish(self) -> dict[str, dict]:
        """Wait for every write, check sizes, fsync and close every file; the files' size and checksum."""
        self._stop()
        info = {}
        for name, out in self.files.items():
            if out.written != out.size:
                raise RuntimeError(f"{out.path}: wrote {out.written} bytes, its header announces {out.size}")
            os.fsync(out.fd)
            out.close()
            info[name] = {"bytes": out.size}
            if out.hasher is not None:
                info[name]["checksum"] = {"algorithm": self.checksum, "value": out.hasher.hexdigest()}
        return info

    def _stop(self) -> None:
        alive = [thread for thread in self._threads if thread.is_alive()]
        for _ in alive:
            self._jobs.put(None)
        for thread in alive:
            thread.join()
        self._check()

    def abort(self) -> None:
        """After an error: stop the thread and close the files (the caller removes the directory)."""
        self._error = self._error or RuntimeError("aborted")
        try:
            self._stop()
        except BaseException:  # noqa: BLE001
            pass
        for out in self.files.values():
            out.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is not None or any(t.is_alive() for t in self._threads):  # error, or no finish(): incomplete
            self.abort()


# ------------------------------------------------------------------------------------------ loading into shards
