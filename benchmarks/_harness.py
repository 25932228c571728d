"""The harness every benchmark uses: the machine's load, timing (interleaved rounds), statistics (paired ratios),
markdown and JSON output, gloo ranks spawned on loopback."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

# quiet and offline: set before a benchmark imports transformers (spawned ranks inherit the environment)
for _key in ("HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):
    os.environ.setdefault(_key, "error" if _key == "TRANSFORMERS_VERBOSITY" else "1")


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all CPUs; /proc/stat, steal excluded)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:8]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq = v
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def wait_idle(timeout_s: float, threshold_cores: float) -> float:
    """Wait (1 s samples) until at most ``threshold_cores`` are busy or ``timeout_s`` passed; the last sample."""
    start = time.perf_counter()
    while True:
        b0, t0 = machine_busy_s(), time.perf_counter()
        time.sleep(1.0)
        load = (machine_busy_s() - b0) / (time.perf_counter() - t0)
        waited = time.perf_counter() - start
        if load <= threshold_cores or waited >= timeout_s:
            if waited > 1.5:
                print(f"  (waited {waited:.0f} s for other processes to go quiet; now {load:.2f} cores busy)",
                      flush=True)
            return load


def loopback_ifname() -> str:
    """The loopback interface's name (for GLOO_SOCKET_IFNAME: ranks talk over loopback only)."""
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir("/sys/class/net")):
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read().strip(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
    return "lo"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, worker, *args) -> None:
    """``worker(rank, *args)`` in a spawned rank, printing its traceback before the failure propagates."""
    try:
        worker(rank, *args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise


def status_kib(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM, ...), 0 when absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def libc(name: str, *args) -> None:
    """glibc's ``name(*args)`` (``malloc_trim``, ``mallopt``); nothing where there is no glibc."""
    with contextlib.suppress(OSError, AttributeError):
        getattr(ctypes.CDLL("libc.so.6"), name)(*args)


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM (the kernel's peak RSS) to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def print_closing(summary: list[str], warnings: list[str], started: float) -> None:
    """A benchmark's last lines: its summary, its warnings, the total wall time since ``started``."""
    print("", *summary, *(f"WARNING: {line}" for line in warnings), sep="\n")
    print(f"\ntotal wall time {time.perf_counter() - started:.0f} s")


# ---------------------------------------------------------------------------------------------------- timing
def timed(fn, repeats: int, *, warmup: int = 0, before=None) -> list[float]:
    """Seconds per call of ``fn`` over ``repeats`` calls after ``warmup``; ``before()`` untimed ahead of each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def interleaved(modes: dict, rounds: int) -> dict:
    """``{mode: [value per round]}``, every mode once per round in ABBA order: drift hits every mode alike."""
    samples: dict[str, list] = {name: [] for name in modes}
    order = list(modes)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            samples[name].append(modes[name]())
    return samples


# -------------------------------------------------------------------------------------------------- statistics
def median_spread(values) -> tuple[float, float, float]:
    """(median, min, max)."""
    values = list(values)
    return statistics.median(values), min(values), max(values)


def paired_ratio(values, baseline) -> tuple[float, float, float]:
    """Median, min and max of the per-round ratios ``values[i] / baseline[i]`` (rounds paired: drift cancels)."""
    return median_spread(v / b for v, b in zip(values, baseline, strict=True))


def fmt_cores(x: float | None) -> str:
    """Other processes' CPU use during a measurement, in cores (None: the window was too short to tell)."""
    return "n/a (window < 0.5 s)" if x is None else f"{x:.2f} cores"


# ------------------------------------------------------------------------------------------------------ output
def print_table(title: str | None, header: list[str], rows) -> None:
    """A markdown table (``rows``: lists of cells, as strings), under a ``###`` title when given."""
    if title:
        print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(["---"] * len(header)) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print()


def write_json(path: str | Path, data) -> None:
    """``data`` as indented JSON at ``path`` (its folder created; what JSON cannot hold written as ``str``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


# ------------------------------------------------------------------------------------------------------- ranks
def spawn_ranks(fn, nprocs: int, args: tuple, deadline_s: float, start_method: str = "spawn",
                poll_s: float = 1.0) -> str | None:
    """``fn(rank, nprocs, port, *args)`` in ``nprocs`` fresh processes; None when all finished, else why not."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(run_rank, args=(fn, nprocs, free_port(), *args), nprocs=nprocs, join=False,
                             start_method=start_method)
    end = time.perf_counter() + deadline_s
    try:
        while not ctx.join(timeout=poll_s):
            if time.perf_counter() > end:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                return f"workers did not finish within {deadline_s:.0f} s (killed)"
    except mp.ProcessRaisedException as exc:
        return f"worker failed: {str(exc).strip().splitlines()[-1]}"
    except mp.ProcessExitedException as exc:
        return f"worker exited: {exc}"
    return None
