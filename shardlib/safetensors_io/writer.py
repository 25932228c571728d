"""Streamed, checksummed writing of safetensors files: headers first, tensor bytes in bounded blocks written by a
background thread, byte ranges of other files copied inside the kernel, every file fsynced when finished."""

from __future__ import annotations

import errno
import json
import math
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import base
from .base import CHECKSUM, CheckpointError, ST_NAMES, bytes_of, hasher, pread_into, safetensors_order
from .reader import SafetensorsFile


def _header(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None) -> tuple[bytes, list]:
    """A safetensors header for ``(name, dtype, shape)`` tensors and their data order (safetensors' own: larger
    dtypes first, then by name; the JSON padded with spaces to 8 bytes), as ``save_file`` writes it."""
    order = sorted(tensors, key=lambda t: safetensors_order(t[0], t[1]))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in order:
        if dtype not in ST_NAMES:
            raise CheckpointError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
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
        buffer = _copy_buffers.block = memoryview(bytearray(base.BLOCK))
    n = os.preadv(src_fd, [buffer[:min(count, base.BLOCK)]], src_offset)
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


class OutFile:
    """A safetensors file being streamed: its fd, expected size, hash and the tensors still to come, in order."""

    def __init__(self, path: Path, tensors: list, metadata: dict | None, checksum: str | None):
        header, order = _header(tensors, metadata)
        self.path, self.order = path, [name for name, _, _ in order]
        self.shapes = {name: (dtype, tuple(shape)) for name, dtype, shape in order}
        self.size = len(header) + sum(math.prod(s) * d.itemsize for _, d, s in order)
        self.hasher = hasher(checksum) if checksum else None
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
        if _start_writeback is not None and length >= base.DIRECT_ROW:
            _start_writeback(self.fd, offset, length)
        with self._lock:
            self.written += length

    def copy(self, job: _Copy, offset: int) -> None:
        """Copy ``job``'s source bytes to ``offset`` inside the kernel (writer threads), then start write-back."""
        done = 0
        while done < job.nbytes:
            n = _copy_range(job.source.fd, self.fd, job.nbytes - done, job.offset + done, offset + done)
            if n <= 0:
                raise CheckpointError(f"{job.source.path}: unexpected end of file at byte {job.offset + done} "
                                      "(truncated?)")
            done += n
        if _start_writeback is not None and job.nbytes >= base.DIRECT_ROW:
            _start_writeback(self.fd, offset, job.nbytes)
        with self._lock:
            self.written += job.nbytes

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Writer:
    """Streams safetensors files into ``directory``: :meth:`open` writes a file's header, then :meth:`tensor` /
    :meth:`emit` pass each tensor's bytes in the header's order. The calling thread hashes each block (in file
    order); a background thread writes it at its offset (so the caller's next read or hash overlaps the write);
    :meth:`finish` waits, checks every file is complete, fsyncs and closes them and returns
    ``{file: {"bytes", "checksum"}}``. Buffers for non-contiguous data come from a pool of a few 4 MiB blocks:
    memory stays bounded."""

    POOL = 8  # blocks of base.BLOCK bytes (32 MiB)
    THREADS = 1  # writer threads (pwrite at offsets: more would work; on 2 cores a second one did not help, also
    #              not one thread per output file for convert: 0.73 vs 0.69 s, the kernel's copies slowed each other)

    def __init__(self, directory: Path, *, checksum: str | None = CHECKSUM):
        self.directory, self.checksum = Path(directory), checksum
        self.files: dict[str, OutFile] = {}
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
            return torch.empty(base.BLOCK, dtype=torch.uint8)
        return self._free.get()

    def give_back(self, block: torch.Tensor) -> None:
        self._free.put(block)

    # --- files and bytes
    def open(self, name: str, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
             metadata: dict | None = None) -> OutFile:
        out = OutFile(self.directory / name, tensors, metadata, self.checksum)
        self.files[name] = out
        header, out.pending_header = out.pending_header, None
        self.emit(out, memoryview(header))
        return out

    def emit(self, out: OutFile, view: memoryview, release: torch.Tensor | None = None) -> None:
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

    def emit_parts(self, parts: list[tuple[OutFile, memoryview]], block: torch.Tensor | None) -> None:
        """:meth:`emit` each ``(file, view)`` (views into one pool ``block``, returned after the last is written)."""
        parts = [(out, view) for out, view in parts if len(view)]
        if not parts:
            if block is not None:
                self.give_back(block)
            return
        shared = _Shared(block, len(parts)) if block is not None else None
        for out, view in parts:
            self.emit(out, view, shared)

    def copy(self, out: OutFile, source: SafetensorsFile, offset: int, nbytes: int) -> None:
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
                scratch = self._hash_buffer = memoryview(bytearray(base.HASH_BLOCK))
        for i in range(0, nbytes, base.COPY_CHUNK):
            n = min(base.COPY_CHUNK, nbytes - i)
            self._jobs.put((out, out.submitted, _Copy(source, offset + i, n), None))
            out.submitted += n
            if scratch is not None:
                for j in range(i, i + n, len(scratch)):
                    view = scratch[:min(len(scratch), i + n - j)]
                    pread_into(source.fd, view, offset + j, source.path)
                    out.hasher.update(view)
            self._check()

    def tensor(self, out: OutFile, name: str, t: torch.Tensor) -> None:
        """Write in-memory tensor ``name`` (any strides) as the next tensor of ``out``."""
        dtype, shape = out.shapes[name]
        if (t.dtype, tuple(t.shape)) != (dtype, shape):
            raise RuntimeError(f"{out.path}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, the header says "
                               f"{dtype} {shape}")
        t = t.detach()
        if t.numel() == 0:
            return
        if t.is_contiguous():
            view = bytes_of(t)
            for i in range(0, len(view), base.BLOCK):
                self.emit(out, view[i:i + base.BLOCK])
            return
        row = math.prod(shape[1:]) * dtype.itemsize
        if row > base.BLOCK:  # one row does not fit a block: rows one by one
            for i in range(shape[0]):
                self.emit_copy(out, t[i:i + 1], row)
            return
        step = base.BLOCK // row
        for i in range(0, shape[0], step):
            self.emit_copy(out, t[i:i + step], row * min(step, shape[0] - i))

    def emit_copy(self, out: OutFile, t: torch.Tensor, nbytes: int) -> None:
        """Copy a strided ``t`` into a pool block (or a one-off buffer when it is larger) and emit it."""
        block = self.buffer() if nbytes <= base.BLOCK else torch.empty(nbytes, dtype=torch.uint8)
        _copy_strided(block[:nbytes].view(t.dtype).view(t.shape), t)
        self.emit(out, memoryview(block.numpy())[:nbytes], block if nbytes <= base.BLOCK else None)

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
