"""What one rank of ``shardlib calibrate`` times (:mod:`.calibrate` starts the ranks and writes the profile): GEMM
rates, element-wise and AdamW bandwidth, the fixed cost of an eager op, and the collectives over the backend and over
the shared-memory transport, each with every rank busy at once (:class:`RankClock`).

torch is imported inside the functions: the CLI builds its parser without loading torch.
"""

from __future__ import annotations

import contextlib
import platform
import socket
import statistics
import time

from .profile import COLLECTIVES, SHARED_MEMORY_OPS, LinkFit

#: a GEMM size whose estimated time (at the rate of the size before it) exceeds this is not measured
GEMM_MAX_S = 0.5
#: a GEMM size measured at under this fraction of the rate of the size before it is timed again and the faster
#: timing kept: a larger GEMM is not that much slower on any device, a machine busy for a second is. (A 4-rank
#: calibration here once read the largest size at 16.6 GFLOP/s where five others read 32-38; the layouts of
#: T5-small priced with it ranked at Spearman rho 0.64 against the measured steps, 0.82-0.83 with either of two
#: profiles calibrated right after: docs/data/plan_accuracy_t5small_shm_default*.json.)
DROP = 0.6


class RankClock:
    """Times work on every rank at once: barrier, run, synchronize the device, read the timer; and agrees on a
    value across ranks (an all-gather of one number per rank) so every rank decides alike."""

    def __init__(self, device, settings):
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


def gemm_rates(clock: RankClock, shapes) -> dict[str, list[list[float]]]:
    """dtype -> [[flops per GEMM, flops per second], ...] over ``shapes`` (by increasing flops), each rank
    multiplying at once; stops at the first size whose GEMM would take longer than :data:`GEMM_MAX_S`.

    (Tried on an H100, 2026-11-27, and not kept: each shape timed as a linear's three training GEMMs on the device
    alone. The models' GEMM kernels ran 1.04-1.22x the time these rates priced; the device-only rates did no better
    in fp32 and worse in bf16 (1.2-1.6x): docs/data/gpu_profile_h100_run2.json; docs/benchmarks/planner-accuracy.md,
    "Step-time terms on one H100".)"""
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


def optimizer_bandwidth(clock: RankClock, nbytes: int = 64 << 20, tensors: int = 16) -> float:
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
    traffic = _adamw_state(params)[2]
    optimizer = torch.optim.AdamW(params, foreach=True)
    return traffic / clock.seconds(optimizer.step)


def bandwidth(clock: RankClock, nbytes: int = 32 << 20) -> float:
    """Bytes per second of ``a.add_(b)`` on float32 tensors of ``nbytes`` (read a, read b, write a)."""
    a = clock.torch.ones(nbytes // 4, device=clock.device)
    b = clock.torch.ones(nbytes // 4, device=clock.device)
    return 3 * nbytes / clock.seconds(lambda: a.add_(b))


def op_seconds(clock: RankClock, steps: int = 200) -> float:
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


def collective_fits(clock: RankClock, settings) -> dict[str, dict[str, dict[str, float]]]:
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


def shared_memory_fits(clock: RankClock, settings) -> dict:
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


def _sample_shared_memory(clock: RankClock, transport, op: str, n: int, nbytes: int) -> tuple[float, float]:
    """(input bytes, seconds) of one ``op`` over the shared-memory ``transport``, as :func:`_sample`."""
    x = clock.torch.ones(max(n, nbytes // 4 // n * n))
    run = {"all_reduce": lambda: transport.all_reduce(x), "all_gather": lambda: transport.all_gather(x, 0),
           "reduce_scatter": lambda: transport.reduce_scatter(x, 0)}[op]
    return 4.0 * x.numel(), clock.seconds(run)


def _sample(clock: RankClock, op: str, group, n: int, nbytes: int) -> tuple[float, float]:
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


def machine_name(device, threads: int) -> str:
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
