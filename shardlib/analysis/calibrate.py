"""``shardlib calibrate``: measure this machine's :class:`~.profile.Profile` for the step-time cost model.

:func:`calibrate` starts ``world_size`` ranks on this machine, as a training run would (one process per rank,
OMP_NUM_THREADS threads each, 1 unless set: what ``shardlib run`` gives a rank), and measures with all ranks busy
at once, so that the numbers are what one rank gets while the others work too:

* GEMM throughput per dtype (float32 and bfloat16; float16 too on CUDA) over GEMM sizes of transformer layers,
  from small to large; a size whose GEMM would take longer than :data:`GEMM_MAX_S` is skipped (the rate has long
  stopped growing there, and the profile clamps to its largest size);
* elementwise bandwidth: ``a.add_(b)`` on 32 MiB float32 tensors, three tensor-passes of bytes per op;
* every collective over the real backend, for each group size n >= 2 dividing the world, all groups of that size
  at once as a mesh runs them (send/recv: pairs of ranks exchanging). A few message sizes are timed and
  ``latency_s + bytes / bytes_per_s`` is fitted to them (:meth:`~.profile.LinkFit.fit`). A world of one (one GPU)
  measures no collective: its profile prices the layouts of one rank only. On a CPU the all-reduce, all-gather and
  reduce-scatter are timed over the shared-memory transport too (the profile's ``shared_memory``), which the tp and
  sp groups of a mesh on one host use by default.

Every timing runs from a barrier to a barrier (a rank the scheduler runs late stretches it, as it stretches a
training step) and is the median of a few repeats after a warm-up; each value is the median over the ranks,
gathered at once so every rank takes the same decisions (which sizes to skip, how many iterations) and no rank
waits on a barrier the others skipped. The ranks rendezvous through a file store in a temporary directory and
gloo binds to the loopback interface: nothing listens beyond this machine. Every wait is bounded: the process
group has a timeout, the whole run ``timeout_s``; a rank that fails stops the others and is reported by rank and
error.

torch is imported inside the functions: the CLI builds its parser without loading torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .profile import COLLECTIVES, SHARED_MEMORY_OPS, LinkFit, Profile, ProfileError, load_profile

#: (m, k, n) of a transformer layer's GEMMs: m tokens times the (in, out) features of its linears.
DEFAULT_SHAPES = tuple((m, k, n) for m in (256, 1024, 4096)
                       for k, n in ((256, 256), (256, 1024), (768, 768), (768, 3072), (1024, 4096)))
QUICK_SHAPES = ((256, 256, 256), (256, 768, 768), (512, 1024, 1024))
#: a GEMM size whose estimated time (at the rate of the size before it) exceeds this is not measured
GEMM_MAX_S = 0.5
_SPREAD = 2.5  # default shapes kept: each at least this many times the flops of the one before
#: a GEMM size measured at under this fraction of the rate of the size before it is timed again and the faster
#: timing kept: a larger GEMM is not that much slower on any device, a machine busy for a second is. (A 4-rank
#: calibration here once read the largest size at 16.6 GFLOP/s where five others read 32-38; the layouts of
#: T5-small priced with it ranked at Spearman rho 0.64 against the measured steps, 0.82-0.83 with either of two
#: profiles calibrated right after: docs/benchmarks.md, "Plan accuracy".)
DROP = 0.6


class CalibrationError(RuntimeError):
    """A calibration that could not finish: a rank failed, or the ranks ran out of time."""


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What the ranks measure and how long each timing runs (it travels to the ranks as JSON)."""

    shapes: tuple[tuple[int, int, int], ...]
    message_bytes: tuple[int, ...]
    repeats: int
    target_s: float  # each timing runs about this long: enough iterations to dwarf the timer's noise
    threads: int


def calibrate(world_size: int, *, backend: str = "gloo", shapes=None, quick: bool = False,
              timeout_s: float = 300) -> Profile:
    """Measure this machine with ``world_size`` concurrent ranks over ``backend`` ("gloo", or "nccl" with one
    CUDA device per rank); ``shapes``: the GEMMs (m, k, n) to time instead of the default spread; ``quick``: a
    handful of sizes, seconds instead of about a minute (tests). Raises ValueError for bad arguments and
    :class:`CalibrationError` when a rank fails or the run takes longer than ``timeout_s``."""
    _check_world(world_size, backend)
    settings = _Settings(
        shapes=_gemm_shapes(shapes, quick),
        message_bytes=(4 << 10, 64 << 10, 1 << 20) if quick else (4 << 10, 32 << 10, 256 << 10, 2 << 20, 16 << 20),
        repeats=2 if quick else 3, target_s=0.02 if quick else 0.1, threads=_threads_per_rank())
    with tempfile.TemporaryDirectory(prefix="shardlib-calibrate-") as workdir:
        out = os.path.join(workdir, "profile.json")
        config = {"world_size": world_size, "backend": backend, "settings": dataclasses.asdict(settings),
                  "workdir": workdir, "out": out, "timeout_s": timeout_s}
        _run_ranks(config)
        return load_profile(out, world_size)


def _check_world(world_size: int, backend: str) -> None:
    """ValueError unless ``world_size`` ranks can run over ``backend`` here."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < world_size:
            raise ValueError(f"backend nccl needs one CUDA device per rank: {world_size} ranks, {count} devices")


def _gemm_shapes(shapes, quick: bool) -> tuple[tuple[int, int, int], ...]:
    """The GEMMs to time, by increasing flops, one per flop count; the default ones thinned to a spread of sizes
    (:data:`_SPREAD`), which is what the profile interpolates over."""
    if shapes is None:
        chosen = QUICK_SHAPES if quick else DEFAULT_SHAPES
    else:
        chosen = [tuple(s) for s in shapes]
        bad = [s for s in chosen if len(s) != 3 or not all(isinstance(d, int) and d > 0 for d in s)]
        if bad or not chosen:
            raise ValueError(f"shapes must be a non-empty list of (m, k, n) positive integers, got {shapes!r}")
    spread = _SPREAD if shapes is None and not quick else 1.0
    kept: list[tuple[int, int, int]] = []
    for shape in sorted(chosen, key=math.prod):
        last = math.prod(kept[-1]) if kept else 0
        if math.prod(shape) > last and math.prod(shape) >= spread * last:
            kept.append(shape)
    return tuple(kept)


def _threads_per_rank() -> int:
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def _loopback_interface() -> str | None:
    """The loopback network interface's name (Linux: IFF_LOOPBACK in its flags), for GLOO_SOCKET_IFNAME. The same
    lookup as :mod:`shardlib.train.launch`'s, which this layer may not import."""
    for flags in sorted(Path("/sys/class/net").glob("*/flags")):
        with contextlib.suppress(OSError, ValueError):
            if int(flags.read_text(), 16) & 0x8:
                return flags.parent.name
    return None


def _run_ranks(config: dict) -> None:
    """Start the ranks (``python -m shardlib.analysis.calibrate RANK CONFIG``: a fresh interpreter each, so the
    caller's script needs no ``if __name__ == "__main__"`` guard) and wait, at most ``timeout_s``. A failed rank
    stops the others; the error names every rank that failed and its last line of output."""
    world_size, timeout_s = config["world_size"], config["timeout_s"]
    root = str(Path(__file__).resolve().parents[2])  # where `shardlib` imports from
    env = {**os.environ, "OMP_NUM_THREADS": str(config["settings"]["threads"]),
           "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    loopback = _loopback_interface() if config["backend"] == "gloo" else None
    if loopback and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = loopback
    logs = [os.path.join(config["workdir"], f"rank{rank}.log") for rank in range(world_size)]
    procs = []
    try:
        for rank, log in enumerate(logs):
            with open(log, "wb") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", __spec__.name, str(rank), json.dumps(config)],
                                              stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                              env=env))
        deadline = time.monotonic() + timeout_s
        while (codes := [p.poll() for p in procs]) != [0] * world_size:
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                raise CalibrationError("calibrate: " + "; ".join(
                    f"rank {rank} failed: {_last_line(logs[rank], codes[rank])}" for rank in failed))
            if time.monotonic() > deadline:
                raise CalibrationError(f"calibrate: the {world_size} ranks did not finish within {timeout_s:g} s "
                                       f"(a hung collective, or a machine far slower than expected)")
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _last_line(log: str, returncode: int) -> str:
    """The last line a rank wrote (its exception, for a Python error), or how it ended."""
    with contextlib.suppress(OSError):
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        if lines:
            return lines[-1]
    return f"exit code {returncode}" if returncode >= 0 else f"killed by signal {-returncode}"


# ------------------------------------------------------------------------------------------------- in a rank
def _rank_main(rank: int, config: dict) -> None:
    """One rank: join the group, measure, and (rank 0) write the profile to ``config["out"]``."""
    import datetime

    import torch
    import torch.distributed as dist

    backend, world_size, settings = config["backend"], config["world_size"], _Settings(**config["settings"])
    torch.set_num_threads(settings.threads)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(os.path.join(config["workdir"], "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=min(config["timeout_s"], 120)))
    try:
        clock = _Clock(device, settings)
        data = {"shardlib_profile": 1, "machine": _machine_name(device, settings.threads), "backend": backend,
                "device": device.type, "world_size": world_size, "gemm": _gemm_rates(clock, settings.shapes),
                "memory_bytes_per_s": _bandwidth(clock), "collectives": _collective_fits(clock, settings),
                "op_seconds": _op_seconds(clock), "optimizer_bytes_per_s": _optimizer_bandwidth(clock),
                "cores": os.cpu_count() if device.type == "cpu" else None, **_shared_memory_fits(clock, settings)}
        if rank == 0:
            Profile.from_dict(data, source="calibration").save(config["out"])
        dist.barrier()
    finally:
        dist.destroy_process_group()


class _Clock:
    """Times work on every rank at once: barrier, run, synchronize the device, read the timer; and agrees on a
    value across ranks (an all-gather of one number per rank) so every rank decides alike."""

    def __init__(self, device, settings: _Settings):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.device, self.settings = torch, dist, device, settings
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.device.type == "cuda":
            self.dist.barrier(device_ids=[self.device.index])
        else:
            self.dist.barrier()

    def agreed(self, value: float, how=statistics.median) -> float:
        """``how`` (median, max) of every rank's ``value``: the same number on every rank."""
        mine = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        every = self.torch.empty(self.world, dtype=self.torch.float64, device=self.device)
        self.dist.all_gather_into_tensor(every, mine)
        return how(every.tolist())

    def seconds(self, run) -> float:
        """Seconds of one ``run()`` on a rank while every rank runs it: warm up, size the iterations to
        ``target_s``, then the median of ``repeats`` timings (agreed: the median over ranks)."""
        run()
        once = self.agreed(self._timed(run, 1), max)
        iters = max(1, min(50, round(self.settings.target_s / max(once, 1e-6))))
        times = [self._timed(run, iters) for _ in range(self.settings.repeats)]
        return self.agreed(statistics.median(times))

    def _timed(self, run, iters: int) -> float:
        """Seconds per ``run()`` from a common start (a barrier) until every rank is done (a barrier): a rank the
        scheduler ran late stretches every rank's time, as it stretches a training step."""
        self.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            run()
        self.sync()
        self.barrier()
        return (time.perf_counter() - start) / iters


def _gemm_rates(clock: _Clock, shapes) -> dict[str, list[list[float]]]:
    """dtype -> [[flops per GEMM, flops per second], ...] over ``shapes`` (by increasing flops), each rank
    multiplying at once; stops at the first size whose GEMM would take longer than :data:`GEMM_MAX_S`.

    (Tried on an H100, 2026-11-27, and not kept: each shape timed as a linear's three training GEMMs on the device
    alone. The models' GEMM kernels ran 1.04-1.22x the time these rates priced; the device-only rates did no better
    in fp32 and worse in bf16 (1.2-1.6x): docs/benchmarks.md, "Time terms on one H100".)"""
    torch = clock.torch
    dtypes = ("float32", "bfloat16", "float16") if clock.device.type == "cuda" else ("float32", "bfloat16")
    rates: dict[str, list[list[float]]] = {}
    for name in dtypes:
        points = rates[name] = []
        for m, k, n in shapes:
            flops = 2.0 * m * k * n
            if points and flops / points[-1][1] > GEMM_MAX_S:
                break
            dtype = getattr(torch, name)
            a = torch.randn(m, k, dtype=dtype, device=clock.device)
            b = torch.randn(k, n, dtype=dtype, device=clock.device)
            c = torch.empty(m, n, dtype=dtype, device=clock.device)
            rate = flops / clock.seconds(lambda: torch.matmul(a, b, out=c))
            if points and rate < DROP * points[-1][1]:  # a disturbance (noise only slows), or a real cliff: again,
                rate = max(rate, flops / clock.seconds(lambda: torch.matmul(a, b, out=c)))  # the faster kept
            points.append([flops, rate])
    return rates


def _optimizer_bandwidth(clock: _Clock, nbytes: int = 64 << 20, tensors: int = 16) -> float:
    """Bytes per second of an AdamW step (``foreach``, the default, as the Trainer builds it) over ``tensors``
    float32 parameters of ``nbytes`` in all: the memory traffic the dry run counts for that step (the same
    :class:`~.counting.WorkRecorder` over the same step) per second of it. Its multi-tensor kernels move their
    bytes slower than one large ``add_``: an H100 1.86 against 2.53 TB/s (its optimizer kernels then took 0.97-1.01x
    the time priced, 1.36-1.44x with the element-wise rate), this 2-core CPU 8 against 23 GB/s."""
    from .dryrun import _adamw_state

    torch = clock.torch
    params = [torch.nn.Parameter(torch.ones(nbytes // 4 // tensors, device=clock.device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    traffic = sum(w.traffic for w in _adamw_state(params)[1].work.values())
    optimizer = torch.optim.AdamW(params, foreach=True)
    return traffic / clock.seconds(optimizer.step)


def _bandwidth(clock: _Clock, nbytes: int = 32 << 20) -> float:
    """Bytes per second of ``a.add_(b)`` on float32 tensors of ``nbytes`` (read a, read b, write a)."""
    a = clock.torch.ones(nbytes // 4, device=clock.device)
    b = clock.torch.ones(nbytes // 4, device=clock.device)
    return 3 * nbytes / clock.seconds(lambda: a.add_(b))


def _op_seconds(clock: _Clock, steps: int = 200) -> float:
    """Seconds of one op of a training step beyond its work (dispatch, autograd, module calls, Python), with every
    rank busy: forward and backward of a stack of tiny layers (16 features: the arithmetic is nothing), timed,
    divided by the ops one step dispatches (counted once)."""
    torch = clock.torch
    from torch.utils._python_dispatch import TorchDispatchMode

    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                                       torch.nn.GELU(), torch.nn.Dropout(0.1)) for _ in range(4)])
    layers.to(clock.device)
    x = torch.ones(2, 16, device=clock.device)

    def step():
        layers(x).sum().backward()

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()

    def run():
        for _ in range(steps):
            step()

    return clock.seconds(run) / (steps * Count.ops)


def _collective_fits(clock: _Clock, settings: _Settings) -> dict[str, dict[str, dict[str, float]]]:
    """op -> {group size: {latency_s, bytes_per_s}} for every group size n >= 2 dividing the world (the groups of
    consecutive ranks, all at once), and send/recv between the pairs (0, 1), (2, 3), ..."""
    dist, world, rank = clock.dist, clock.world, clock.rank
    fits: dict[str, dict[str, dict[str, float]]] = {op: {} for op in COLLECTIVES}
    if world == 1:
        return fits  # nothing to measure: a one-rank profile prices no collective
    for n in (d for d in range(2, world + 1) if world % d == 0):
        groups = [dist.new_group(list(range(start, start + n))) for start in range(0, world, n)]
        group = groups[rank // n]
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            samples = [_sample(clock, op, group, n, size) for size in settings.message_bytes]
            fits[op][str(n)] = LinkFit.fit(samples)._asdict()
    samples = [_sample(clock, "send_recv", None, 2, size) for size in settings.message_bytes]
    fits["send_recv"]["2"] = LinkFit.fit(samples)._asdict()
    return fits


def _shared_memory_fits(clock: _Clock, settings: _Settings) -> dict:
    """The profile's ``shared_memory`` fits and slot size: the collectives of the shared-memory transport, which
    a mesh's tp and sp groups use on one host by default, timed as :func:`_collective_fits` times the backend's
    (groups of n consecutive ranks, all at once); none where the transport cannot attach (a GPU, another CPU)."""
    from ..parallel import shm

    if clock.device.type != "cpu" or clock.world == 1 or not shm.supported():
        return {}
    fits: dict[str, dict[str, dict[str, float]]] = {}
    for n in (d for d in range(2, clock.world + 1) if clock.world % d == 0):
        groups = [clock.dist.new_group(list(range(start, start + n))) for start in range(0, clock.world, n)]
        group = groups[clock.rank // n]
        transport = shm.attach(group, timeout_s=60, required=False)
        if transport is None:  # the decision is the group's: every rank of it skips alike
            continue
        try:
            for op in SHARED_MEMORY_OPS:
                samples = [_sample_shared_memory(clock, transport, op, n, size) for size in settings.message_bytes
                           if size <= transport.slot_bytes]
                fits.setdefault(op, {})[str(n)] = LinkFit.fit(samples)._asdict()
        finally:
            shm.detach(group)
    return {"shared_memory": fits, "shared_memory_slot_bytes": shm.DEFAULT_SLOT_BYTES} if fits else {}


def _sample_shared_memory(clock: _Clock, transport, op: str, n: int, nbytes: int) -> tuple[float, float]:
    """(input bytes, seconds) of one ``op`` over the shared-memory ``transport``, as :func:`_sample`."""
    x = clock.torch.ones(max(n, nbytes // 4 // n * n))
    run = {"all_reduce": lambda: transport.all_reduce(x), "all_gather": lambda: transport.all_gather(x, 0),
           "reduce_scatter": lambda: transport.reduce_scatter(x, 0)}[op]
    return 4.0 * x.numel(), clock.seconds(run)


def _sample(clock: _Clock, op: str, group, n: int, nbytes: int) -> tuple[float, float]:
    """(input bytes, seconds) of one ``op`` whose input on this rank is about ``nbytes`` of float32 (rounded to a
    multiple of the group size)."""
    torch, dist, rank = clock.torch, clock.dist, clock.rank
    numel = max(n, nbytes // 4 // n * n)
    x = torch.ones(numel, device=clock.device)
    if op == "all_reduce":
        run = lambda: dist.all_reduce(x, group=group)  # noqa: E731
    elif op == "all_gather":
        out = torch.empty(numel * n, device=clock.device)
        run = lambda: dist.all_gather_into_tensor(out, x, group=group)  # noqa: E731
    elif op == "reduce_scatter":
        out = torch.empty(numel // n, device=clock.device)
        run = lambda: dist.reduce_scatter_tensor(out, x, group=group)  # noqa: E731
    elif op == "all_to_all":
        out = torch.empty_like(x)
        run = lambda: dist.all_to_all_single(out, x, group=group)  # noqa: E731
    else:
        partner, out = rank ^ 1, torch.empty_like(x)
        run = (lambda: [r.wait() for r in (dist.isend(x, partner), dist.irecv(out, partner))]) \
            if partner < clock.world else (lambda: None)  # an odd world's last rank has no partner
    return 4.0 * numel, clock.seconds(run)


def _machine_name(device, threads: int) -> str:
    """Hostname and processor (and GPU) of this machine, for the profile's ``machine``."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    name = f"{socket.gethostname()}, {cpu}"
    if device.type == "cuda":
        import torch

        return f"{name}, {torch.cuda.get_device_name(device)}"
    return f"{name}, {threads} thread{'s' if threads > 1 else ''} per rank"


# ------------------------------------------------------------------------------------------------------ CLI
CALIBRATE_HELP = """\
Measure this machine for the step-time cost model: GEMM throughput per dtype and size, elementwise bandwidth, and
the latency and bandwidth of every collective per group size, with all --world ranks busy at once (as in
training). Writes a JSON profile for `shardlib plan --profile FILE`. About a minute on a small CPU machine."""


def add_calibrate_parser(sub) -> argparse.ArgumentParser:
    """Add the ``calibrate`` subcommand to ``sub`` (the CLI's subparsers)."""
    p = sub.add_parser("calibrate", help="measure this machine's profile for the cost model",
                       description=CALIBRATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  shardlib calibrate --world 4\n"
                              "  shardlib calibrate --world 8 --backend nccl --out h100x8.json")
    p.add_argument("--world", type=int, default=4, help="ranks to run concurrently (default 4): the plan's world")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="process-group backend (default gloo)")
    p.add_argument("--out", default="shardlib-profile.json", help="where to write the profile "
                                                                  "(default shardlib-profile.json)")
    p.add_argument("--quick", action="store_true", help="a few sizes only: seconds, rougher numbers")
    return p


def calibrate_command(args: argparse.Namespace) -> int:
    """Run ``shardlib calibrate``: measure, write the profile, print a summary. 0 on success, 1 with one line on
    stderr otherwise."""
    try:
        if not Path(args.out).resolve().parent.is_dir():
            raise ValueError(f"--out {args.out}: no such directory {str(Path(args.out).parent)!r}")
        _check_world(args.world, args.backend)
        print(f"calibrating {args.world} ranks over {args.backend}{' (quick)' if args.quick else ''}...",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        profile = calibrate(args.world, backend=args.backend, quick=args.quick)
        profile.save(args.out)
    except (ValueError, CalibrationError, ProfileError, OSError) as exc:
        print(f"shardlib calibrate: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(profile.summary())
    print(f"measured in {time.monotonic() - start:.0f} s; profile written to {args.out}")
    return 0


if __name__ == "__main__":  # one rank of a calibration (_run_ranks)
    _rank_main(int(sys.argv[1]), json.loads(sys.argv[2]))
