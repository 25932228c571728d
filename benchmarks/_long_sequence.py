"""Long-sequence probes of ``benchmarks/step_anatomy.py``: a step's peak of live tensors per rank (``--peak``) and
where the ring attention's time goes (the ``sp*_ring`` modes' profile).

* :func:`peak_step`: one step of a layout (the ``encoder`` workload's hand loop) with this rank's gradients already
  allocated (zeroed in place, so neither the parameters nor their gradients count), under
  ``_plan_accuracy_workload.PeakStorages`` (a dispatch mode that follows every storage of 64 KiB or more the step's
  ops create until it dies): the peak of their sum, the activation memory of the step, and the largest storages
  alive at that moment (what makes it). The shared-memory transport's mapping (made once, ``2 x sp x 16 MiB`` per
  group) is not a step's and is not counted.
* :class:`RingProbe`: wraps the ring kernel's piece functions, its wire and its autograd Function
  (``shardlib.kernels.ring_blocks``) with timers and ``torch.profiler`` marks ("ring wait": its own profile row), so
  a profiled step tells the pieces' compute (forward, backward) from the time a rank waits for a K/V or dK/dV block
  that had a whole block's compute to arrive under, and from the last wait of a backward (the dK/dV block coming
  home: nothing left to compute under it); :meth:`RingProbe.alone` times one exchange with nothing to hide it.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist

from _harness import print_table

MIB = 2 ** 20


def peak_step(step) -> dict:
    """{"peak_mib": MiB, "at_peak": [(MiB, op, serial number of the op)] largest first} of one step (docstring)."""
    from _plan_accuracy_workload import PeakStorages

    for p in step.model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    gc.collect()
    with PeakStorages() as probe:
        step.run(keep_grads=True)
    return {"peak_mib": probe.peak / MIB, "at_peak": probe.at_peak}


class RingProbe:
    """Timers (seconds summed per step: pieces or blocks computed, exchanges posted, waits, per pass) and profiler
    marks around the ring kernel's pieces while in the ``with`` block. The last wait of a backward (the dK/dV block
    coming home after its last hop: nothing left to compute under it) is timed apart as ``wait home``."""

    def __init__(self):
        import importlib

        names = ("shardlib.kernels.ring_blocks", "shardlib.kernels.ring_attention")  # the kernel, then its first home
        m = next(m for m in map(importlib.import_module, names) if hasattr(m, "_Ring"))
        pieces = ("piece_forward", "piece_backward") if hasattr(m, "piece_forward") else ("block_forward",
                                                                                         "block_backward")
        self.module, self.seconds, self.counts, self.phase = m, {}, {}, ""
        self.shape, self.ring, self.last = None, None, 0.0
        self.saved = {name: getattr(m, name) for name in pieces}
        self.saved.update(start=m._Ring.start, wait=m._Ring.wait, forward=m._RingAttention.forward,
                          backward=m._RingAttention.backward)
        self.pieces = pieces

    def _add(self, key: str, seconds: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.counts[key] = self.counts.get(key, 0) + 1

    def _timed(self, name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            with torch.profiler.record_function(f"ring {name} {self.phase}"):
                out = fn(*args, **kwargs)
            self.last = time.perf_counter() - start
            self._add(f"{name} {self.phase}", self.last)
            return out
        return wrapper

    def _pass(self, phase, fn):
        def wrapper(*args):
            self.phase, self.last = phase, 0.0
            out = fn(*args)
            if phase == "backward":
                self._add("wait home", self.last)
            return out
        return staticmethod(wrapper)

    def __enter__(self):
        m, saved = self.module, self.saved

        def noted_start(ring, send, tag):
            self.shape, self.ring = (send.shape, send.dtype), ring
            return saved["start"](ring, send, tag)
        for name, phase in zip(self.pieces, ("forward", "backward")):
            setattr(m, name, self._timed("pieces", saved[name]))
        m._Ring.start = self._timed("start", noted_start)
        m._Ring.wait = staticmethod(self._timed("wait", saved["wait"]))
        m._RingAttention.forward = self._pass("forward", saved["forward"])
        m._RingAttention.backward = self._pass("backward", saved["backward"])
        return self

    def __exit__(self, *exc):
        m = self.module
        for name in self.pieces:
            setattr(m, name, self.saved[name])
        m._Ring.start, m._Ring.wait = self.saved["start"], staticmethod(self.saved["wait"])
        m._RingAttention.forward = staticmethod(self.saved["forward"])
        m._RingAttention.backward = staticmethod(self.saved["backward"])

    def alone(self, repeats: int = 7) -> float:
        """Median ms of one exchange of the last block shape sent (send to rank + 1, receive from rank - 1, waited
        for at once), all ranks together."""
        block = torch.randn(*self.shape[0], dtype=self.shape[1])
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            self.saved["wait"](self.saved["start"](self.ring, block, 0))
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def summary(self, steps: int) -> dict:
        """Per step: ms and calls of each timer; one exchange alone (ms) and its block's MiB."""
        out = {f"{k} ms": v * 1e3 / steps for k, v in sorted(self.seconds.items())}
        out.update({f"{k} calls": v / steps for k, v in sorted(self.counts.items())})
        if self.ring is not None:
            out["exchange alone ms"] = self.alone()
            out["block MiB"] = torch.Size(self.shape[0]).numel() * self.shape[1].itemsize / MIB
        return out


def ring_rows(modes: list[str], anatomy: dict, title) -> None:
    """The ring probe's numbers of every ring layout (rank 0): compute, waits, and the wire's cost had nothing hidden
    it (the exchanges of blocks in flight, i.e. all but each backward's last hop home, times one exchange alone)."""
    rows = []
    for m in modes:
        r = anatomy[m].get("ring") or {}
        if "exchange alone ms" not in r:
            continue
        home, calls = r.get("wait home ms", 0.0), r.get("wait home calls", 0.0)
        in_flight = r.get("wait forward ms", 0.0) + r.get("wait backward ms", 0.0) - home
        wire = r["exchange alone ms"] * (r.get("start forward calls", 0) + r.get("start backward calls", 0) - calls)
        posted = [r.get(f"start {phase} {what}", 0) for what in ("ms", "calls") for phase in ("forward", "backward")]
        rows.append([title(m), f"{r.get('pieces forward ms', 0):.0f}", f"{r.get('pieces backward ms', 0):.0f}",
                     f"{in_flight:.1f}", f"{home:.1f}", f"{posted[0] + posted[1]:.1f}",
                     f"{posted[2] + posted[3]:.0f} x {r['block MiB']:.1f} MiB",
                     f"{r['exchange alone ms']:.1f}", f"{wire:.0f}", f"{1 - min(1.0, in_flight / max(wire, 1e-9)):.0%}",
                     f"{(in_flight + home) / anatomy[m]['wall_ms']:.1%}"])
    if rows:
        print_table("Ring attention per step (profiled steps, rank 0)",
                    ["layout", "pieces fwd ms", "pieces bwd ms", "waits for blocks in flight ms",
                     "waits for dK/dV home ms", "posting ms", "exchanges", "one alone ms", "wire alone ms",
                     "wire hidden", "waits / step"], rows)


def peak_rows(modes: list[str], peaks: dict, title, base: str = "unsharded") -> None:
    """Per layout: the largest rank's peak of live tensors, every rank's, the ratio to ``base``'s, what makes it."""
    rows = []
    for m in modes:
        per_rank = [p["peak_mib"] for p in peaks[m]]
        top = max(peaks[m], key=lambda p: p["peak_mib"])
        ratio = f"{max(per_rank) / max(p['peak_mib'] for p in peaks[base]):.3f}" if base in peaks else "-"
        largest = ", ".join(f"{mib:.0f} {op.removeprefix('aten.')}" for mib, op, _ in top["at_peak"][:4])
        rows.append([title(m), f"{max(per_rank):.0f}", " / ".join(f"{v:.0f}" for v in per_rank), ratio, largest])
    print_table("Peak of live tensors in one step, MiB (parameters and their gradients excluded)",
                ["layout", "largest rank", "per rank", f"/ {base}", "largest storages at the peak (MiB op)"], rows)
