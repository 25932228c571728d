"""Machine-load helpers shared by the benchmarks: how busy the whole machine is, and waiting for it to go quiet
(2 cores: one busy neighbour process halves a mode's speed)."""

from __future__ import annotations

import os
import time


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
