"""What the safetensors reader and writer share: limits, the error type, dtypes, checksums, ``preadv`` helpers.

The size limits are read as ``base.BLOCK`` etc. at call time, so a test can shrink them for every reader and writer
at once (``monkeypatch.setattr(shardlib.safetensors_io.base, "BLOCK", 64)``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------------------ checksums
def hasher(algorithm: str):
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r}")


def checksum_of(path: Path, algorithm: str = CHECKSUM) -> str:
    """Hex digest of a whole file (read in blocks into one reused buffer)."""
    digest = hasher(algorithm)
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


def strict_json(raw: bytes, where: str):
    """``raw`` parsed as JSON, read as a hostile file: invalid UTF-8, invalid JSON, ``NaN`` / ``Infinity``, nesting
    too deep for the parser (``RecursionError``) and duplicate keys (json keeps the last silently: two entries for
    one tensor would hide one) are each a :class:`CheckpointError` ``"<where> ..."``."""
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise CheckpointError(f"{where} has a duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
        return dict(pairs)

    def no_constant(name):
        raise CheckpointError(f"{where} is not JSON ({name} is not a JSON number)")

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where} is not UTF-8 ({exc})") from None
    except RecursionError:
        raise CheckpointError(f"{where} is nested too deeply to be read") from None
    except CheckpointError:
        raise
    except ValueError as exc:
        raise CheckpointError(f"{where} is not JSON ({exc})") from None


def inside(directory: Path, name: str) -> Path:
    """``directory / name``, refusing names that leave the directory (path traversal in an index)."""
    try:
        path = (directory / name).resolve()
    except (ValueError, OSError) as exc:  # a NUL byte in the name, a symlink loop
        raise CheckpointError(f"{name!r} is not a file name in the checkpoint directory {directory} ({exc})") from None
    if directory.resolve() not in path.parents:
        raise CheckpointError(f"{name!r} points outside the checkpoint directory {directory}")
    return path


# ---------------------------------------------------------------------------------- safetensors, without mmap
# safetensors dtype names, in the order of safetensors' own Dtype enum (files list larger dtypes first)
ST_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
              "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
              "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
              "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64}
ST_NAMES = {t: name for name, t in ST_DTYPES.items()}
ST_RANK = {t: i for i, t in enumerate(ST_DTYPES.values())}


def safetensors_order(name: str, dtype: torch.dtype) -> tuple[int, str]:
    """The sort key of safetensors' data order (larger dtypes first, then by name): files are written front to
    back when their tensors are walked in this order."""
    return -ST_RANK[dtype], name


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: dtype, shape and absolute byte range ``[begin, end)`` in the file."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def pread_into(fd: int, view: memoryview, offset: int, path) -> None:
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


def scatter_read(fd: int, views: list[memoryview], offset: int, path) -> None:
    """Fill ``views`` in order from one contiguous range of the file (``preadv``: straight into each buffer)."""
    for i in range(0, len(views), _IOV_MAX):
        batch = views[i:i + _IOV_MAX]
        n = os.preadv(fd, batch, offset)
        offset += n
        for view in batch:  # a short read (rare): finish buffer by buffer
            if n >= len(view):
                n -= len(view)
                continue
            pread_into(fd, view[n:], offset, path)
            offset += len(view) - n
            n = 0


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable memoryview of its own storage (no copy; any dtype,
    bfloat16 included: it is viewed as uint8)."""
    flat = t.detach().reshape(-1)  # a view: ``t`` is contiguous
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")

