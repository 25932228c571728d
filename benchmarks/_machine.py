"""Helpers shared by the benchmarks: how busy the whole machine is, waiting for it to go quiet (2 cores: one busy
neighbour process halves a mode's speed), and starting gloo ranks on loopback."""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback


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
    """Sample the machine's CPU use in 1 s windows until it is at most ``threshold_cores`` or ``timeout_s`` has
    passed; return the last sample (cores busy)."""
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
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read().strip(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
    except OSError:
        pass
    return "lo"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_traceback(worker, rank: int, *args) -> None:
    """Run ``worker(rank, *args)`` in a spawned rank, printing its traceback before the failure propagates."""
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


def print_closing(summary: list[str], warnings: list[str], started: float) -> None:
    """A benchmark's last lines: its summary, its warnings, the total wall time since ``started``."""
    print()
    for line in summary:
        print(line)
    for line in warnings:
        print("WARNING:", line)
    print(f"\ntotal wall time {time.perf_counter() - started:.0f} s")
