"""Collective checkpoint operations end together: every rank learns whether every rank's part succeeded, and every
wait on the other ranks is bounded and names a rank that stalled (:mod:`shardlib.parallel.timeouts`).

A rank whose part of a load fails (a file only its rows lie in is truncated, say) would otherwise go on alone: the
others would train on and wait in their first collective until the timeout, which then blames a "stalled" rank.
:func:`all_ranks` ends a load with one all-gather of a fixed-size byte tensor per rank (the failure's message, or
nothing; no pickle), so every rank raises at once, naming the rank that failed and why.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..parallel.mesh import DEFAULT_TIMEOUT_S
from ..parallel.timeouts import CollectiveFailure, failure_kind, stalled_ranks_named
from ..safetensors_io import CheckpointError

MESSAGE_BYTES = 1024  # of a rank's failure message, sent to every rank (longer ones are cut)


def timeout_of(mesh) -> float:
    """The mesh's bound on every collective wait (its ``timeout_s``; the default for a mesh without one)."""
    return getattr(mesh, "timeout_s", DEFAULT_TIMEOUT_S)


def runs_collectives(mesh) -> bool:
    """Whether ``mesh`` is a live mesh of several processes (an :class:`~shardlib.parallel.mesh.OfflineMesh`, or a
    world of one, has nobody to agree with)."""
    return mesh is not None and hasattr(mesh, "group") and dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def all_ranks(what: str, mesh):
    """Run the block (this rank's part of ``what``, e.g. ``"loading DIR"``), then learn every rank's outcome: a
    rank whose part raised re-raises its own error, unchanged; the others raise a :class:`CheckpointError` naming
    the rank(s) that failed and the first one's error. Every rank of the world must run it (the ranks of ``mesh``,
    which spans the world). A collective failure inside the block is raised at once (its group is closed: there is
    nothing to agree over), and a rank that stalls or dies before the end makes the others raise
    :class:`~shardlib.parallel.timeouts.CollectiveFailure` naming it, within the mesh's timeout."""
    if not runs_collectives(mesh):
        yield
        return
    error = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001  (every rank learns of it below, then this rank re-raises it)
        if isinstance(exc, CollectiveFailure) or failure_kind(exc) is not None:
            raise
        error = exc
    with stalled_ranks_named(what, timeout_of(mesh)):
        messages = _gather(None if error is None else f"{type(error).__name__}: {error}", mesh)
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
    if failed:
        ranks = ", ".join(str(rank) for rank, _ in failed)
        raise CheckpointError(f"{what} failed on rank{'s' if len(failed) > 1 else ''} {ranks} (rank {failed[0][0]}: "
                              f"{failed[0][1]})")


def _gather(message: str | None, mesh) -> list[str | None]:
    """Every rank's ``message`` (None: it succeeded), in rank order: one all-gather over the world of a flag byte
    and ``MESSAGE_BYTES`` of UTF-8."""
    mine = torch.zeros(MESSAGE_BYTES + 1, dtype=torch.uint8)
    if message is not None:
        raw = message.encode()[:MESSAGE_BYTES]
        mine[0] = 1
        mine[1:1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    device = getattr(mesh, "device_type", "cpu")  # NCCL gathers CUDA tensors only
    everyone = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine.to(device))
    return [bytes(t[1:].cpu().tolist()).rstrip(b"\0").decode(errors="replace") if t[0] else None for t in everyone]
