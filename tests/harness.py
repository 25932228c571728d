"""A persistent pool of real gloo ranks for multi-rank tests.

Starting processes and process groups costs seconds; a hypothesis example costs milliseconds. So the pool starts
``world_size`` rank processes once (spawned, 1 thread each, gloo on 127.0.0.1, every collective bounded by
``collective_timeout_s``) and then runs one *task* at a time on all of them: a module-level function, named by
module and qualified name, called with picklable arguments on every rank. ``pool.run`` returns every rank's
return value, or raises :class:`RankFailure` with each failing rank's traceback. A task that does not finish
within its timeout (counted once every rank has joined the process group: a pool started under load takes
seconds) kills the pool (a hung collective cannot be recovered) and fails with the ranks that did not answer;
the next task starts a fresh pool. After any failure the pool is restarted too, since ranks may have left
collectives unmatched.

A rank that dies of a *native* crash (SIGABRT, SIGSEGV, SIGBUS: glibc's heap checks or a fault inside torch or
gloo, never a Python assertion, which comes back as a failure) reruns the task once on a fresh pool, with a
warning that carries the crash's stacks; a second crash fails the test. Gloo ranks aborted ("double free or
corruption"), segfaulted or hung about once in 1,000 tasks, always waiting on a functional collective run eagerly;
eager collectives are c10d's synchronous calls since (``shardlib/parallel/collectives.py``), and this stays as a
net. A Python-level failure is never retried.

A *silent hang* is treated the same way: ranks that do not answer within the task's timeout while no rank reported
anything, not even the collective timeout every wait is bounded by (``collective_timeout_s``, shorter than any task
timeout), are stuck below Python. Their stacks are written before they are killed (Python's, by faulthandler on
SIGUSR1, and the native threads' through gdb where it is installed) and the task reruns once; a deterministic hang
hangs again and fails.

Inside a task, :func:`mesh` returns a cached mesh of the requested shape (building process groups is slow).
"""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import signal
import shutil
import socket
import subprocess
import tempfile
import sys
import time
import traceback
import warnings

import torch.multiprocessing as mp


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class NativeCrash(RankFailure):
    """Every dead rank was killed by a native-crash signal (see the module docstring)."""


_NATIVE_CRASHES = {-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGBUS}


class RankTimeout(AssertionError):
    """Ranks did not answer in time (a hang); the pool was killed."""


class SilentHang(RankTimeout):
    """Ranks hung past every collective timeout with no rank reporting an error (see the module docstring)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ in the ranks
_MESHES: dict = {}


def mesh(dp=None, pp=1, tp=1, sp=1, ep=1):
    """A cached ``shardlib.Mesh`` over the pool's world (call inside a task)."""
    import torch.distributed as dist

    import shardlib

    world = dist.get_world_size()
    key = (dp or world // (pp * sp * tp), pp, tp, sp, ep)
    if key not in _MESHES:
        # the process group's collectives (the path NCCL and multi-host gloo take) under every property; the
        # shared-memory transport, the default on one host, is proven on its own (tests/test_shm.py)
        _MESHES[key] = shardlib.init_mesh(*key[:3], sp=sp, ep=ep, transport="c10d")
    return _MESHES[key]


def _worker(rank: int, world: int, port: int, timeout_s: float, tasks, results, fault_log: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                      TRANSFORMERS_VERBOSITY="error")
    import faulthandler

    import torch
    import torch.distributed as dist

    # a rank killed by a signal writes where each of its threads was; the driver puts it in the RankFailure
    log = open(fault_log, "w")  # noqa: SIM115 - open for the process's life
    faulthandler.enable(log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, log, all_threads=True)  # the driver asks for the stacks of a hang
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    results.put((_READY, rank, True, None))  # a task's clock starts once every rank is up
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, module, name, args, kwargs = task
        try:
            fn = importlib.import_module(module)
            for part in name.split("."):
                fn = getattr(fn, part)
            results.put((task_id, rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the driver
            results.put((task_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- the driver
_READY = 0  # the task id of a rank's "up and joined" message (tasks count from 1)


class RankPool:
    def __init__(self, world_size: int = 4, collective_timeout_s: float = 60.0, startup_timeout_s: float = 300.0):
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._procs: list = []
        self._task_id = 0
        self._fault_dir = tempfile.mkdtemp(prefix="shardlib-pool-")

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, port, self.collective_timeout_s, self._tasks[r], self._results,
                              self._fault_log(r)))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Until every rank has joined the process group (a task's timeout counts from then, not from the spawn)."""
        ready, deadline = set(), time.monotonic() + self.startup_timeout_s
        while len(ready) < self.world_size:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                late = dead or sorted(set(range(self.world_size)) - ready)
                self.stop(graceful=False)
                raise RankFailure(f"the pool did not start: rank(s) {late} "
                                  + ("died" if dead else f"not up within {self.startup_timeout_s}s"))
            try:
                task_id, rank, _, _ = self._results.get(timeout=1.0)
            except queue.Empty:
                continue
            if task_id == _READY:
                ready.add(rank)

    def _fault_log(self, rank: int) -> str:
        return os.path.join(self._fault_dir, f"rank{rank}.faults")

    def _faults(self, ranks: list[int]) -> str:
        """What faulthandler wrote for ``ranks`` (the Python stacks of a rank killed by a signal)."""
        out = []
        for r in ranks:
            try:
                with open(self._fault_log(r)) as f:
                    text = f.read().split("\nExtension modules:")[0].strip()
            except OSError:
                continue
            if text:
                out.append(f"\n--- rank {r}: faulthandler ---\n{text[-6000:]}")
        return "".join(out)

    def _hang_stacks(self, ranks: list[int]) -> str:
        """The Python stacks (faulthandler) and, where gdb is installed, the native stacks of the hung ``ranks``."""
        native = []
        for r in ranks:
            os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        if shutil.which("gdb"):
            for r in ranks:
                try:
                    out = subprocess.run(["gdb", "-p", str(self._procs[r].pid), "-batch", "-nx", "-ex",
                                          "thread apply all bt 30"], capture_output=True, text=True, timeout=60)
                    native.append(f"\n--- rank {r}: native threads (gdb) ---\n{out.stdout[-12000:]}")
                except (OSError, subprocess.SubprocessError) as e:
                    native.append(f"\n--- rank {r}: gdb failed: {e!r}")
        return self._faults(ranks) + "".join(native)

    def stop(self, graceful: bool = True) -> None:
        if graceful:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self._procs = []

    def run(self, fn, *args, timeout_s: float = 120.0, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        try:
            return self._run_once(fn, args, kwargs, timeout_s)
        except (NativeCrash, SilentHang) as fault:
            warnings.warn(f"rerunning {fn.__qualname__} once on a fresh pool after a native crash or silent hang: "
                          f"{fault}", stacklevel=2)
        try:
            return self._run_once(fn, args, kwargs, timeout_s)
        except (NativeCrash, SilentHang) as fault:
            kind = RankFailure if isinstance(fault, NativeCrash) else RankTimeout
            raise kind(f"{fault} (happened twice: not a one-off)") from None

    def _run_once(self, fn, args: tuple, kwargs: dict, timeout_s: float) -> list:
        if not self._procs:
            self.start()
        self._task_id += 1
        task = (self._task_id, fn.__module__, fn.__qualname__, args, kwargs)
        for q in self._tasks:
            q.put(task)
        results, failures = {}, {}
        deadline = time.monotonic() + timeout_s
        while len(results) + len(failures) < self.world_size:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead:
                codes = [self._procs[r].exitcode for r in dead]  # before stop() forgets the processes
                self.stop(graceful=False)
                error = NativeCrash if set(codes) <= _NATIVE_CRASHES else RankFailure
                raise error(f"{fn.__qualname__}: rank(s) {dead} died (exit codes {codes}; negative: the "
                            "signal that killed it)" + self._faults(dead))
            try:
                task_id, rank, ok, value = self._results.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(results) - set(failures))
                    silent = not failures and timeout_s > self.collective_timeout_s
                    stacks = self._hang_stacks(missing) if silent else ""
                    died = {r: self._procs[r].exitcode for r in missing if not self._procs[r].is_alive()}
                    self.stop(graceful=False)
                    if died and set(died.values()) <= _NATIVE_CRASHES:  # it was dying, not hung (a slow abort)
                        raise NativeCrash(f"{fn.__qualname__}: rank(s) {sorted(died)} died (exit codes "
                                          f"{list(died.values())}; negative: the signal that killed it)"
                                          + self._faults(sorted(died)))
                    detail = "".join(f"\n--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items()))
                    raise (SilentHang if silent else RankTimeout)(
                        f"{fn.__qualname__}: rank(s) {missing} did not finish within {timeout_s}s" + detail + stacks)
                continue
            if task_id != self._task_id:
                continue  # a stale answer from an earlier, failed task
            (results if ok else failures)[rank] = value
        if failures:
            self.stop(graceful=False)
            first = min(failures)
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise RankFailure(f"{fn.__qualname__} failed on rank(s) {sorted(failures)} (first: rank {first})\n{detail}")
        return [results[r] for r in range(self.world_size)]


def ensure_importable() -> None:
    """Tasks are looked up by module name in the ranks: make the tests folder importable there too."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
