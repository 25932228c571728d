"""Directories that appear whole or not at all, and the recovery of what a killed writer left behind.

A writer fills a hidden staging directory ``.<name>.tmp-<id>`` next to the destination, fsyncs it, moves an old
destination aside to ``.<name>.old-<id>``, renames the staging directory into place, and removes the old one. A
``SIGKILL`` can stop it anywhere, so every save and load first calls :func:`recover`:

* a staging directory that is *complete* (a sharded checkpoint's ``shardlib.json``, which is written last, or an
  HF export's ``.complete`` marker, likewise last) while the destination is missing: the kill fell between the two
  renames; it is renamed into place (the newest whole copy wins);
* otherwise a missing destination with an ``.old-`` copy gets the old copy back;
* every other staging or old directory of this destination is removed.

One writer per destination at a time (as with any file): recovery never runs while another process writes the
same destination. Renames are atomic, so ranks that recover at once agree on the result.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from ..safetensors_io import CheckpointError
from .format import METADATA

COMPLETE_MARKER = ".complete"  # written last into a staged directory that has no shardlib.json (HF exports)


def staging_dir(destination: Path, token: str | None = None) -> Path:
    """A new hidden staging directory next to ``destination`` (``token``: the same on every rank of a save)."""
    tmp = destination.parent / f".{destination.name}.tmp-{token or uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def scratch_dir(destination: Path) -> Path:
    """A hidden working directory of a writer of ``destination`` (an intermediate copy): never published,
    removed by :func:`recover` together with its own writer's debris."""
    return destination.parent / f".{destination.name}.scratch"


def debris(destination: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """(staging directories, old copies, scratch) a writer of ``destination`` left behind, oldest first."""
    parent, name = destination.parent, destination.name
    if not parent.is_dir():
        return [], [], []
    found = sorted(parent.iterdir(), key=lambda p: p.stat().st_mtime if p.exists() else 0)
    scratch = scratch_dir(destination).name
    return ([p for p in found if p.name.startswith(f".{name}.tmp-")],
            [p for p in found if p.name.startswith(f".{name}.old-")],
            [p for p in found if p.name == scratch or p.name.startswith(f".{scratch}.")])


def _is_complete(staged: Path) -> bool:
    return (staged / METADATA).exists() or (staged / COMPLETE_MARKER).exists()


def recover(destination: str | Path) -> list[str]:
    """Finish or clean up what an interrupted writer of ``destination`` left (module docstring). Returns what was
    done, one line each (empty: nothing to do)."""
    destination = Path(destination)
    staged, old, scratch = debris(destination)
    done = []
    if not destination.exists():
        complete = [p for p in staged if _is_complete(p)]
        for candidate in complete[::-1] + old[::-1]:  # the newest complete staging first, then the newest old copy
            try:
                candidate.rename(destination)
            except OSError:
                if not destination.exists():
                    continue
            done.append(f"restored {destination} from {candidate.name}")
            break
    for path in staged + old + scratch:
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path.name}")
    return done


def fsync_directory(path: Path) -> None:
    """Make a directory's entries (new files, a rename) durable, where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(tmp: Path, destination: Path, *, marker: bool = False) -> None:
    """Swap the finished staging directory ``tmp`` in under ``destination`` (an old destination survives until
    then). ``marker``: first write :data:`COMPLETE_MARKER` (for contents without a metadata file of their own);
    it is removed once the directory is in place."""
    if marker:
        (tmp / COMPLETE_MARKER).touch()
    fsync_directory(tmp)
    old = destination.parent / f".{destination.name}.old-{uuid.uuid4().hex[:8]}"
    if destination.exists():
        destination.rename(old)
    tmp.rename(destination)
    fsync_directory(destination.parent)
    if marker:
        (destination / COMPLETE_MARKER).unlink(missing_ok=True)
    shutil.rmtree(old, ignore_errors=True)


class AtomicDirectory:
    """``with AtomicDirectory(dest, overwrite) as tmp:`` write into ``tmp``; on a clean exit it is published under
    ``dest`` (:func:`publish`), on an exception removed. ``marker``: see :func:`publish`. Single process."""

    def __init__(self, destination: str | Path, *, overwrite: bool = False, marker: bool = True,
                 what: str = "overwrite=True", recovered: bool = False):
        self.destination, self.marker = Path(destination), marker
        if not recovered:  # (``recovered``: the caller did it, and its own scratch is in use)
            recover(self.destination)
        if self.destination.exists() and not overwrite:
            raise CheckpointError(f"{self.destination} exists; pass {what} to replace it")

    def __enter__(self) -> Path:
        self.tmp = staging_dir(self.destination)
        return self.tmp

    def __exit__(self, exc_type, exc, _):
        if exc_type is None:
            publish(self.tmp, self.destination, marker=self.marker)
            return
        shutil.rmtree(self.tmp, ignore_errors=True)
        if isinstance(exc, OSError):  # a full disk, say: one error that says so, and that nothing changed
            raise CheckpointError(f"writing {self.destination} failed, {self.destination} is as it was before: "
                                  f"{type(exc).__name__}: {exc}") from exc
