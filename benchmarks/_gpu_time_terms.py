"""What a one-GPU training step is made of, measured beside ``plan_accuracy_gpu.py``'s step time (``--terms``), so that
each time term of the cost model can be checked on its own (issue 36, item 5):

* ``kernel_terms``: a profile of ``steps`` steps: the CUDA kernels' time per step by class (``gemm``, ``attention``,
  ``optimizer``, ``other``: the element-wise, reductions, norms, copies), kernels per step, the top kernels by time
  (to re-class them offline), and the host's time per step spent waiting for the device (the loss read);
* ``host_step_s``: the same Trainer's step at a tiny batch (every kernel tiny: the step is the host's dispatch plus
  the optimizer's kernels, which do not shrink);
* ``micro_costs``: the fixed costs a calibration can measure: the host's cost of one op of a few kinds (views,
  element-wise ops with autograd, element-wise ops without it, a stack of tiny layers), and the device's time per
  tiny kernel when kernels queue behind each other (``kernel_floor_s``).
"""

from __future__ import annotations

import statistics
import time

#: kernel class -> substrings of CUDA kernel names (lower case); the first class that matches wins; "other" else
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
    ("optimizer", ("multi_tensor", "foreach", "adam")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv", "splitk", "sm90_", "sm80_", "ampere_")),
)
#: host calls that wait for the device (their CPU time is the host waiting, not dispatching)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def kernel_terms(step, steps: int = 3) -> dict:
    """Profile ``steps`` calls of ``step()`` (synchronized at both ends): device ms per step by kernel class, kernels
    per step, the 15 kernels that took longest, and the host's ms per step waiting on the device."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    by_class: dict[str, float] = {}
    by_name: dict[str, float] = {}
    kernels = waits = 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            if getattr(e, "is_user_annotation", False) or e.name.startswith(("Optimizer.", "ProfilerStep")):
                continue  # GPU spans of annotations: they hold idle time
            us = getattr(e, "device_time_total", 0) or 0
            by_class[kernel_class(e.name)] = by_class.get(kernel_class(e.name), 0.0) + us
            by_name[e.name] = by_name.get(e.name, 0.0) + us
            kernels += 1
        elif e.name in WAITS:
            waits += e.cpu_time_total
    return {"kernel_ms": {k: v / 1e3 / steps for k, v in by_class.items()}, "kernels": kernels / steps,
            "profiled_ms": wall * 1e3 / steps, "wait_ms": waits / 1e3 / steps,
            "top_kernels_ms": {k[:100]: v / 1e3 / steps for k, v in sorted(by_name.items(), key=lambda x: -x[1])[:15]}}


def host_step_s(step, steps: int = 12) -> float:
    """Median seconds of synchronized ``step()`` calls (after two unmeasured ones)."""
    import torch

    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _per_op(run, device, iters: int = 200) -> float:
    """Seconds per dispatched op of ``run()`` (ops counted once by a dispatch mode), the median of 5 timings."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    with Count():
        run()
    times = []
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            run()
        sync(device)
        times.append((time.perf_counter() - start) / (iters * Count.ops))
    return statistics.median(times[1:])


def micro_costs(device) -> dict:
    """The host's seconds per op of four small programs, and the device's seconds per queued tiny kernel."""
    import torch

    x = torch.randn(4, 16, device=device, requires_grad=True)

    def views():
        y = x
        for _ in range(16):
            y = y.view(16, 4).transpose(0, 1).transpose(0, 1).view(4, 16)
        y.sum().backward()

    def elementwise():
        y = x
        for _ in range(16):
            y = y * 1.5 + 0.5
        y.sum().backward()

    def no_grad():
        with torch.no_grad():
            for _ in range(16):
                x.add_(0.0)

    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                                       torch.nn.GELU(), torch.nn.Dropout(0.1)) for _ in range(4)])
    layers.to(device)

    def tiny_layers():
        layers(x[:2]).sum().backward()

    out = {name: _per_op(fn, device) for name, fn in
           (("view_s", views), ("elementwise_s", elementwise), ("no_grad_s", no_grad), ("tiny_layers_s", tiny_layers))}
    if device.type != "cuda":
        return out
    a = torch.zeros(1024, device=device)
    floors = []
    for _ in range(5):  # the device's time per tiny kernel, queued behind a sleeping kernel so that none waits
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        torch.cuda._sleep(50_000_000)
        begin.record()
        for _ in range(500):
            a.add_(1.0)
        end.record()
        torch.cuda.synchronize(device)
        floors.append(begin.elapsed_time(end) / 1e3 / 500)
    out["kernel_floor_s"] = statistics.median(floors)
    return out
