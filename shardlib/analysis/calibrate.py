"""``shardlib calibrate``: measure this machine's :class:`~.profile.Profile` for the step-time cost model.

:func:`calibrate` starts ``world_size`` ranks on this machine, as a training run would (one process per rank,
OMP_NUM_THREADS threads each, 1 unless set: what ``shardlib run`` gives a rank), and measures with all ranks busy
at once, so that the numbers are what one rank gets while the others work too:

* GEMM throughput per dtype (float32 and bfloat16; float16 too on CUDA) over GEMM sizes of transformer layers,
  from small to large; a size whose GEMM would take longer than :data:`.rank_timing.GEMM_MAX_S` is skipped (the rate has long
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .profile import Profile, ProfileError, load_profile
from .rank_timing import (RankClock, bandwidth, collective_fits, gemm_rates, machine_name, op_seconds,
                          optimizer_bandwidth, shared_memory_fits)

#: (m, k, n) of a transformer layer's GEMMs: m tokens times the (in, out) features of its linears.
DEFAULT_SHAPES = tuple((m, k, n) for m in (256, 1024, 4096)
                       for k, n in ((256, 256), (256, 1024), (768, 768), (768, 3072), (1024, 4096)))
QUICK_SHAPES = ((256, 256, 256), (256, 768, 768), (512, 1024, 1024))
_SPREAD = 2.5  # default shapes kept: each at least this many times the flops of the one before


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
        clock = RankClock(device, settings)
        data = {"shardlib_profile": 1, "machine": machine_name(device, settings.threads), "backend": backend,
                "device": device.type, "world_size": world_size, "gemm": gemm_rates(clock, settings.shapes),
                "memory_bytes_per_s": bandwidth(clock), "collectives": collective_fits(clock, settings),
                "op_seconds": op_seconds(clock), "optimizer_bytes_per_s": optimizer_bandwidth(clock),
                "cores": os.cpu_count() if device.type == "cpu" else None, **shared_memory_fits(clock, settings)}
        if rank == 0:
            Profile.from_dict(data, source="calibration").save(config["out"])
        dist.barrier()
    finally:
        dist.destroy_process_group()


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
