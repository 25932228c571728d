"""The layout search's worker processes (:func:`shardlib.analysis.search.search`'s ``workers``): forked from the
searching process, they dry-run the layer tables it will price (:class:`~shardlib.analysis.layertable.LayerTable`'s
runs, the bulk of a search's time) while it prices those already made. The answer is the one process's."""

from __future__ import annotations

import contextlib
import multiprocessing
import threading

import torch

from ..sharding.plan import PlanError
from .layertable import LayerTable
from .layout import SHARD_MODES as MODES
from .metarun import PlanInputError


#: what a search's worker processes dry-run tables of (set before they fork): "full", "policy", "device_type"
_FORKED: dict = {}


def _dry_runs(key: tuple) -> tuple[tuple, list | str]:
    """In a worker process: the dry runs of the table of ``key`` (the search pricer's table key), or why shard()
    refuses it."""
    tp, sp, mode, checkpointing, seq, precision, ulysses = key
    try:
        table = LayerTable(_FORKED["full"], _FORKED["policy"], tp=tp, sp=sp, mode=MODES[mode], mode_name=mode,
                           activation_checkpointing=checkpointing, seq=seq, precision=precision,
                           device_type=_FORKED["device_type"], ulysses=ulysses)
    except (PlanError, PlanInputError) as exc:
        return key, " ".join(str(exc).split())
    return key, table.runs


def _worker() -> None:
    torch.set_num_threads(1)


class Makers:
    """Worker processes dry-running layer tables (:func:`_dry_runs`) ahead of the pricing that takes them
    (:meth:`take`), in the order asked (:meth:`ask`). A ring's table waits for its mesh's all-to-all table, and is
    made only where shard() refuses that one (as the search prices rings only past the heads all-to-all splits)."""

    def __init__(self, pool):
        self.pool = pool
        self.done = threading.Condition()
        self.results: dict[tuple, list | str | BaseException] = {}
        self.asked: set[tuple] = set()
        self.after: dict[tuple, list[tuple]] = {}  # an all-to-all table's key -> the ring tables waiting for it

    def ask(self, key: tuple, probe: tuple | None = None) -> None:
        """Dry-run the table of ``key``; where ``probe`` (its mesh's all-to-all table) is given, once that one is
        refused."""
        with self.done:
            if probe is not None:
                self._ask(probe)
                found = self.results.get(probe)
                if found is None:
                    self.after.setdefault(probe, []).append(key)
                    return
                if not isinstance(found, str):
                    return
            self._ask(key)

    def _ask(self, key: tuple) -> None:
        if key not in self.asked:
            self.asked.add(key)
            self.pool.apply_async(_dry_runs, (key,), callback=self._made,
                                  error_callback=lambda exc: self._made((key, exc)))

    def _made(self, result: tuple) -> None:
        key, made = result
        with self.done:
            self.results[key] = made
            for waiting in self.after.pop(key, []):
                if isinstance(made, str):
                    self._ask(waiting)
            self.done.notify_all()

    def take(self, key: tuple) -> list | str | None:
        """The dry runs of the table of ``key`` (or why shard() refuses it), once made; None where not asked."""
        with self.done:
            if key not in self.asked:
                return None
            while key not in self.results:
                self.done.wait()
            found = self.results[key]
        if isinstance(found, BaseException):
            raise found
        return found


@contextlib.contextmanager
def workers_for(pricer, count: int):
    """``pricer`` with :class:`Makers` of ``count`` worker processes forked from this one (none where one is
    asked for, or fork is not there)."""
    if count <= 1 or "fork" not in multiprocessing.get_all_start_methods() or multiprocessing.current_process().daemon:
        yield pricer
        return
    _FORKED.update(full=pricer.full, policy=pricer.policy, device_type=pricer.device_type)
    try:
        with multiprocessing.get_context("fork").Pool(count, initializer=_worker) as pool:
            pricer.makers = Makers(pool)
            yield pricer
    finally:
        pricer.makers = None
        _FORKED.clear()


__all__ = ["Makers", "workers_for"]
