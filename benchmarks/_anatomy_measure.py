"""What a rank of ``benchmarks/step_anatomy.py``'s pools measures on command (:func:`serve`, on an
``_anatomy_workload.Step``): ``time`` (slowest rank's wall, all ranks' CPU time and minor page faults), ``profile``
(``torch.profiler`` self time per category; ring layouts under :class:`RingProbe`), ``peak`` (one step's live tensors,
:class:`PeakStorages`), ``switch`` (``_step_variants``). Docs: docs/benchmarks/tensor-parallel.md.
"""

from __future__ import annotations

import contextlib
import gc
import resource
import statistics
import time

import torch
import torch.distributed as dist
from _harness import libc

MIB = 2 ** 20
#: (category, substrings of an op's name): the first category with a match takes the op's self time
CATEGORIES = (
    ("ring p2p wait", ("ring wait",)),  # RingProbe's marks: the ring's waits for K/V and dK/dV blocks
    ("collectives", ("c10d::", "gloo", "nccl", "_ReduceFromTP", "_CopyToTP", "_GatherFromTP", "_ScatterToTP",
                     "_ReduceScatterToTP", "_AllGatherFromTP", "_AllToAll", "_ColumnLinearBackward",
                     "all_reduce", "all_gather", "reduce_scatter")),
    ("GEMMs", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy")),
    ("attention", ("scaled_dot_product", "aten::_softmax", "aten::softmax", "_softmax_backward")),
    ("norms", ("layer_norm",)),
    ("casts/copies", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::stack",
                      "aten::contiguous")),
    ("element-wise", ("aten::",)),
)
ORDER = ("GEMMs", "attention", "loss", "element-wise", "norms", "casts/copies", "collectives", "ring p2p wait",
         "optimizer", "host")


def serve(step, command: str, steps: int = 1, variants: str = ""):
    try:
        if command == "time":
            if step.windowed:
                return tuple(v / steps for v in measured(step, lambda: step.window(steps)))
            return sorted(measured(step, step.run) for _ in range(steps))[steps // 2]
        return {"profile": lambda: profile_steps(step, steps), "peak": lambda: peak_step(step),
                "switch": lambda: switched_steps(step, variants, steps)}[command]()
    finally:
        release(step)


def release(step) -> None:
    """``--lengths``: a pool going idle hands its step's peak back to the system (glibc keeps freed heap), else the
    six pools of BERT-base at 64 x 128 would keep theirs all at once; every batch form's first step of the next
    window faults its activations in again, in proportion to their size."""
    if step.real_tokens:
        libc("malloc_trim", 0)


def measured(step, fn) -> tuple[float, float, float]:
    """``fn()`` behind a barrier: (the slowest rank's wall seconds, all ranks' CPU seconds and minor page faults)."""
    if step.world > 1:
        dist.barrier()
    start, cpu, faults = time.perf_counter(), time.process_time(), _minor_faults()
    fn()
    values = [time.perf_counter() - start, time.process_time() - cpu, _minor_faults() - faults]
    if step.world == 1:
        return tuple(float(v) for v in values)
    wall, summed = torch.tensor(values[:1], dtype=torch.float64), torch.tensor(values[1:], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(summed)
    return (*wall.tolist(), *summed.tolist())


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def switched_steps(step, variants: str, pairs: int) -> dict[str, list[float]]:
    """{variant: [slowest rank's wall s]}: ``pairs`` steps of each variant, switched between consecutive steps."""
    import _step_variants

    chosen = _step_variants.SETS[variants]
    names = list(chosen)
    for name in names * 2:
        chosen[name]()
        step.run()
    seconds = {name: [] for name in names}
    for i in range(pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            chosen[name]()
            seconds[name].append(measured(step, step.run)[0])
    chosen[names[0]]()
    return seconds


def profile_steps(step, steps: int) -> dict:
    """Milliseconds per step by category over ``steps`` profiled steps (this rank's), and the profiled wall."""
    from torch.profiler import ProfilerActivity, profile

    if step.world > 1:
        dist.barrier()
    with RingProbe() if step.ring else contextlib.nullcontext() as ring, \
            profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step.window(steps)
        wall = time.perf_counter() - start
    totals = dict.fromkeys(ORDER, 0.0)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        totals[_category(event)] += event.self_cpu_time_total / 1e3
    accounted = sum(totals.values())  # what no op accounts for (Python, autograd, hooks, the profiler) is host
    totals["host"] = max(0.0, wall * 1e3 - accounted + totals["host"])
    return {"wall_ms": wall * 1e3 / steps, **{k: v / steps for k, v in totals.items()},
            **({"ring": ring.summary(steps)} if ring else {})}


def _category(event) -> str:
    parent = event
    while parent is not None:
        if parent.name.startswith("Optimizer.step") or parent.name.startswith("Optimizer.zero_grad"):
            return "optimizer"
        if "CrossEntropy" in parent.name:  # shardlib's vocab-parallel cross-entropy (an autograd Function)
            return "loss"
        parent = parent.cpu_parent
    for category, needles in CATEGORIES:
        if any(n in event.name for n in needles):
            return category
    return "host"


def peak_step(step) -> dict:
    """{"peak_mib", "at_peak": [(MiB, op, op number)]} of one step; gradients exist before it (zeroed in place), so
    neither they nor the parameters count, nor the shared-memory transport's mapping (made once). A step with
    ``real_tokens`` (``--lengths``): forward + backward of each of its batches, the largest peak, and each batch's
    peak per real token (``kib_per_real_token``, in batch order)."""
    for p in step.model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    probes = {}
    for _ in range(len(step.real_tokens) if step.real_tokens else 1):
        gc.collect()
        batch = step.i % len(step.data)
        with PeakStorages() as probes[batch]:
            step.run(keep_grads=True)
    top = max(probes.values(), key=lambda probe: probe.peak)
    out = {"peak_mib": top.peak / MIB, "at_peak": top.at_peak}
    if step.real_tokens:
        out["kib_per_real_token"] = [probes[b].peak / 1024 / n for b, n in enumerate(step.real_tokens)]
    return out


class RingProbe:
    """Timers and profiler marks around the ring kernel's pieces, posts and waits (per pass) in the ``with`` block; a
    backward's last wait (the dK/dV block coming home: nothing left to hide it) is timed apart as ``wait home``."""

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

        def noted_start(ring, send, tag, *where):
            self.shape, self.ring = (send.shape, send.dtype), ring
            return saved["start"](ring, send, tag, *where)
        for name in self.pieces:
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
        """Median ms of one exchange of the last block shape sent, waited for at once, all ranks together."""
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


class PeakStorages:
    """A dispatch mode following every storage of 64 KiB+ its ops make until it dies: their ``peak``, ``at_peak``."""

    SMALLEST, KEEP = 65536, 30

    def __init__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.ops += 1
                if not func.is_view:
                    outer.created(func, tree_leaves((args, kwargs or {})), tree_leaves(out))
                return out

        self.weakref, self.tensor = weakref.ref, torch.Tensor
        self.mode, self.live, self.total, self.peak, self.ops, self.at_peak = Mode(), {}, 0, 0, 0, []

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def created(self, func, inputs, outputs) -> None:
        inputs = {t.untyped_storage()._cdata for t in inputs if isinstance(t, self.tensor)}
        for t in outputs:
            if not isinstance(t, self.tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            if key in self.live or key in inputs or nbytes < self.SMALLEST:
                continue
            self.live[key] = (nbytes, str(func), self.ops, self.weakref(storage, self._freed(key)))
            self.total += nbytes
            if self.total > self.peak:
                self.peak = self.total
                self.at_peak = sorted(((round(v[0] / MIB, 2), v[1], v[2]) for v in self.live.values()),
                                      reverse=True)[:self.KEEP]

    def _freed(self, key: int):
        def callback(_ref):
            entry = self.live.pop(key, None)
            if entry is not None:
                self.total -= entry[0]

        return callback
