"""What a rank says when a collective fails: which rank stalled, or that a peer went away.

Every wait on the mesh's process groups is bounded by the mesh's timeout (``init_mesh(timeout_s=...)``, default
``SHARDLIB_TIMEOUT`` or 120 s). When a collective does not complete in time, gloo's error names no rank ("Timed out
waiting 3000ms for recv operation to complete") and closes the group's connections. :func:`stalled_ranks_named`
turns that into a :class:`CollectiveFailure` naming the ranks that never reached the collective:

* every rank whose collective timed out checks in on the ranks' c10d store (the store the process group was set up
  with: a connection of its own, which outlives the closed group, and is served by its host even while that
  process's Python is stuck), waits up to ``min(timeout, 5 s)`` for the others to check in, and names those that
  did not: the stalled, hung or dead ranks. Every waiting rank names them, not only rank 0.
* a rank whose peer closed its connection (the peer exited, crashed, or gave up waiting for this rank) says so
  with its rank and the step it was in.

Which error is which (:func:`failure_kind`): by type where torch or shardlib has one that tells it (the store's
``DistStoreError`` and ``DistNetworkError``, the shared-memory transport's own), by gloo's and NCCL's own phrases
where it has none (gloo raises a plain ``RuntimeError`` for a timeout and for a lost peer alike); an error raised
from a collective's (a ``PlanError`` from a failed proof of an inferred plan) is looked through.

Where: the Trainer's steps, ``evaluate``'s all-reduce, ``shard()``'s proof of an inferred plan, and every collective
of :mod:`shardlib.checkpoint` (saving, loading, ``from_pretrained`` / ``from_sharded``, ``save_pretrained``,
adapters).

Why not ``dist.monitored_barrier``, torch's facility that names ranks missing from a barrier: it needs a working
gloo group, and after a timeout gloo has closed the group's pairs ("Application timeout caused pair closure"), so it
would need a second gloo group kept open on every run for the error path; and it names the missing ranks on rank 0
only (the others are told to read rank 0's log). The store is what torch's own NCCL process group uses to tell the
other ranks of a timeout (its debug-dump signal), and costs nothing until a collective fails.

Under NCCL, torch's watchdog usually aborts the process on a timeout before Python sees an error; its flight
recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``) is the tool there.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time

import torch.distributed as dist

from . import shm

#: The longest a timed-out rank waits for the others to time out too before naming those that did not.
GRACE_S = 5.0
# What gloo (torch 2.13) raises, measured with two processes: a plain RuntimeError, not a dist.DistError, for a
# timed-out collective ("[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to
# complete"; the same for send, barrier, object collectives, functional collectives and async work's wait()), for any
# later collective on that group ("Application timeout caused pair closure"), for a group that could not connect
# ("Gloo connectFullMesh failed with ... Connect timeout") and for a lost peer ("[.../pair.cc:553] Connection closed by
# peer [127.0.0.1]:port. This is typically caused by a remote worker crashing ..."). No public type tells these apart,
# so for a plain RuntimeError (and for DistBackendError, NCCL's one type for timeouts, aborts and other failures) the
# message is all there is: these phrases are gloo's and NCCL's own, specific enough that a DataLoader's "timed out"
# or a user's RuntimeError is not taken for a collective's. The c10d store's errors have types that say it:
# DistStoreError is its wait timing out (a rank never set its key), DistNetworkError a lost connection (its host died).
_TIMEOUT_MARKS = ("timed out waiting", "connect timeout", "collective operation timeout", "watchdog timeout")
_CLOSED_MARKS = ("application timeout caused pair closure",)  # an earlier timeout closed the group
_PEER_GONE_MARKS = ("connection closed by peer", "connection reset by peer", "broken pipe")
_CAUSES = 4  # how far down an exception's cause chain a collective's error is looked for
_depth = threading.local()
_incidents = 0


class CollectiveFailure(RuntimeError):
    """A collective that timed out or lost a peer. ``stalled``: the ranks that never reached it (timeouts whose
    store check worked), else None."""

    def __init__(self, message: str, stalled: list[int] | None = None):
        super().__init__(message)
        self.stalled = stalled


def failure_kind(exc: BaseException) -> str | None:
    """What a collective's error says: ``"timeout"``, ``"peer"`` (a peer closed its connection), ``"closed"`` (the
    group was closed by an earlier timeout on this rank), or None for any other error. By type where torch's public
    types tell it (the store's), else by gloo's / NCCL's message (see the constants above). An error raised *from* a
    collective's (``raise PlanError(...) from exc``) is looked through."""
    for _ in range(_CAUSES):
        if exc is None:
            return None
        if isinstance(exc, CollectiveFailure):
            return None  # already reported
        if isinstance(exc, dist.DistStoreError):
            return "timeout"
        if isinstance(exc, dist.DistNetworkError):
            return "peer"
        if isinstance(exc, (shm.SharedMemoryTimeout, shm.PeerGone)):  # the tp / sp groups' default transport
            return "timeout" if isinstance(exc, shm.SharedMemoryTimeout) else "peer"
        if isinstance(exc, RuntimeError):
            text = str(exc).lower()
            for kind, marks in (("peer", _PEER_GONE_MARKS), ("closed", _CLOSED_MARKS), ("timeout", _TIMEOUT_MARKS)):
                if any(m in text for m in marks):
                    return kind
            if isinstance(exc, dist.DistBackendError) and ("timed out" in text or "timeout" in text):
                return "timeout"
        exc = exc.__cause__
    return None


@contextlib.contextmanager
def stalled_ranks_named(what: str, timeout_s: float):
    """Within the block, a collective that times out or loses its peer raises :class:`CollectiveFailure` naming
    this rank, ``what`` it was doing, the timeout and the ranks that stalled. Re-entrant: the outermost block
    reports (so a step's message names the step)."""
    depth = getattr(_depth, "value", 0)
    _depth.value = depth + 1
    try:
        yield
    except Exception as exc:
        kind = failure_kind(exc)
        if depth or kind is None or not dist.is_initialized() or dist.get_world_size() == 1:
            raise
        raise _failure(kind, what, timeout_s, exc) from exc
    finally:
        _depth.value = depth


def names_stalled_ranks(method):
    """:func:`stalled_ranks_named` around a method of an object with a ``mesh`` (its ``timeout_s``)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        from .mesh import DEFAULT_TIMEOUT_S

        timeout_s = getattr(self.mesh, "timeout_s", DEFAULT_TIMEOUT_S)
        with stalled_ranks_named(f"{type(self).__name__}.{method.__name__}", timeout_s):
            return method(self, *args, **kwargs)

    return wrapper


def _failure(kind: str, what: str, timeout_s: float, exc: BaseException) -> CollectiveFailure:
    rank = dist.get_rank()
    root = exc
    while failure_kind(root) is not None and root.__cause__ is not None and failure_kind(root.__cause__):
        root = root.__cause__  # the collective's own error, under whatever was raised from it
    cause = re.sub(r"^\[[^\]]*\] ", "", (str(root).strip().splitlines() or [type(root).__name__])[0])[:200]
    if kind == "closed":
        return CollectiveFailure(
            f"rank {rank}: a collective in {what} failed: this rank's process group was closed by an earlier timeout "
            f"(whose error named the stalled ranks); start a new process group to go on [{cause}]")
    if kind == "peer":
        return CollectiveFailure(
            f"rank {rank}: a collective in {what} failed: a peer rank closed its connection (it exited, crashed, or "
            f"gave up waiting for this rank after the {timeout_s:g} s timeout; its own error says which) [{cause}]")
    grace = min(timeout_s, GRACE_S)
    stalled = _stalled_ranks(rank, dist.get_world_size(), grace)
    message = (f"rank {rank}: a collective in {what} did not complete within the {timeout_s:g} s timeout "
               f"(init_mesh(timeout_s=...) or SHARDLIB_TIMEOUT)")
    if stalled:
        ranks = ", ".join(map(str, stalled))
        message += (f"; stalled: rank{'s' if len(stalled) > 1 else ''} {ranks} (never reached it: "
                    f"{'they' if len(stalled) > 1 else 'it'} did not time out within {grace:g} s of this rank; "
                    "hung, stuck outside the collective, or dead)")
    elif stalled == []:
        message += ("; every rank timed out waiting: they are in different collectives (called in another order, "
                    "on another group, or with other shapes)")
    else:
        message += "; the ranks' store could not be reached to find which rank stalled"
    return CollectiveFailure(f"{message} [{cause}]", stalled)


def _stalled_ranks(rank: int, world: int, grace_s: float) -> list[int] | None:
    """Check in on the store and wait up to ``grace_s`` for every other rank to do the same; the ranks that did not
    (None when the store cannot be reached). Keys carry this process's count of timeouts, so a second timeout in a
    long-lived process is not answered by the first one's check-ins."""
    global _incidents
    _incidents += 1
    incident = _incidents

    def key(r: int) -> str:
        return f"shardlib/collective-timeout/{incident}/rank{r}"

    try:
        store = dist.distributed_c10d._get_default_store()  # private, but the only handle on the group's store
        store.set(key(rank), "timed out")
        deadline = time.monotonic() + grace_s
        while True:
            missing = [r for r in range(world) if r != rank and not store.check([key(r)])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)
    except (RuntimeError, ValueError, AttributeError):  # store host gone, or no default group store
        return None


__all__ = ["CollectiveFailure", "stalled_ranks_named", "names_stalled_ranks", "failure_kind", "GRACE_S"]
