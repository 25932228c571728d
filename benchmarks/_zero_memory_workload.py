"""The workload of ``benchmarks/zero_memory.py`` (its models, inputs, ranks and measurements); the script keeps its command line
and its report. ZeRO stages 0-3 on CPU: the bytes each dp rank holds, the step time, and the peak RSS of a large model."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine_busy_s, status_kib  # noqa: E402

BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522)
LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, vocab_size=30522)
TINY_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
TINY_LARGE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                  vocab_size=1000)
STAGES = (0, 1, 2, 3)
TARGET = 1.05
IDLE_CORES = 0.1
MIB = 2 ** 20
RSS_PER_PARAM_BYTE = 5.5  # peak RSS per rank / fp32 parameter bytes at zero=0 (measured 5.3 at hidden 1024 x 8)
RSS_PER_PARAM_BYTE_Z3 = 1.6  # zero=3: one whole model per rank while building it, before FSDP2 shards it
RSS_BASE = 0.4 * 2 ** 30  # torch + transformers + gloo per rank
PARTITIONED = {"opt": 1, "grad_after": 2, "param": 3}  # quantity -> the lowest stage that partitions it


# ================================================================================================== rank side
def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _nbytes(t) -> int:
    from shardlib.train.fsdp import local

    t = local(t)
    return t.numel() * t.element_size()


def _build(opts: dict, mesh, zero: int):
    import torch
    import transformers

    import shardlib

    config = transformers.BertConfig(**opts["model"], max_position_embeddings=512, num_labels=2)
    torch.manual_seed(0)
    model = shardlib.shard(transformers.BertForSequenceClassification(config), mesh)
    trainer = shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=1e-4), max_grad_norm=1.0,
                               precision="fp32", zero=zero)
    return config, model, trainer


def _batches(opts: dict, mesh, vocab: int, n: int) -> list[dict]:
    from torch.utils.data import default_collate

    import shardlib

    from _workloads import classification_samples

    b, seq = opts["batch"], opts["seq"]
    samples = classification_samples(n * b, seq, vocab)
    return [shardlib.dp_shard(default_collate(samples[i * b:(i + 1) * b]), mesh) for i in range(n)]


def _byte_counts(trainer, batch: dict) -> dict:
    """This rank's optimizer-state, parameter and gradient bytes (module docstring, 1.)."""
    from shardlib.train.optim import param_state

    opt = sum(_nbytes(v) for p in trainer.params for v in param_state(trainer.optimizer, p).values()
              if hasattr(v, "numel"))
    param = sum(_nbytes(p) for p in trainer.params)
    trainer.zero_grad()
    total = trainer._global_items([batch])
    trainer.forward_backward(batch, total_items=total)
    grad_before = sum(_nbytes(p.grad) for p in trainer.params if p.grad is not None)
    trainer.reduce_gradients()
    grad_after = sum(_nbytes(p.grad) for p in trainer.params if p.grad is not None)
    trainer.zero_grad()
    return dict(opt=opt, param=param, grad_before=grad_before, grad_after=grad_after)


def _gather(value):
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _worker_steps(opts: dict) -> dict:
    """Part 2 (and 1 with ``opts['bytes']``): with ``opts['interleave']`` a trainer per stage, all alive at once,
    their steps interleaved; else the stages one after another, each on a fresh model. See the module docstring."""
    import torch
    import torch.distributed as dist

    import shardlib

    mesh = shardlib.init_mesh(tp=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    zeros, warmup, rounds = opts["zeros"], opts["warmup"], opts["rounds"]
    records, counts = [], {}
    trainers, batches = {}, []

    def build(zero):
        t_build = time.perf_counter()
        config, _, trainers[zero] = _build(opts, mesh, zero)
        if not batches:
            batches.extend(_batches(opts, mesh, config.vocab_size, warmup + rounds))
        dist.barrier()
        if rank == 0:
            print(f"  dp={world} zero={zero}: built in {time.perf_counter() - t_build:.1f} s", flush=True)

    def step(r, i, zero):
        trainer = trainers[zero]
        gc.collect()
        dist.barrier()
        busy0, own0, t0 = machine_busy_s(), time.process_time(), time.perf_counter()
        loss = trainer.train_step(batches[i])
        dist.barrier()
        wall, busy, own = time.perf_counter() - t0, machine_busy_s() - busy0, time.process_time() - own0
        trainer.zero_grad()  # outside the window: only one stage's gradients exist at a time (every stage alike)
        t = torch.tensor([wall, own], dtype=torch.float64)
        dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
        dist.all_reduce(t[1:])
        wall, own = t.tolist()
        foreign = max(0.0, (busy - own) / wall) if wall > 0.2 else None
        if rank == 0:
            print(f"  dp={world} zero={zero} {'warm-up' if r is None else f'round {r}'}: {wall:.2f} s "
                  f"(CPU {own:.2f} s over {world} ranks; other processes "
                  f"{'?' if foreign is None else f'{foreign:.2f}'} cores; loss {loss:.4f})", flush=True)
        if r is not None:
            records.append(dict(round=r, zero=zero, wall_s=wall, cpu_s=own, foreign_cores=foreign))

    def finish(zero):
        if opts["bytes"]:
            counts[zero] = _gather(_byte_counts(trainers[zero], batches[0]))
        del trainers[zero]
        gc.collect()
        _malloc_trim()

    if opts["interleave"]:
        for zero in zeros:
            build(zero)
        # warm-up in order, then rounds of one timed step per stage, the order alternating (0 1 2 3, 3 2 1 0, ...)
        for i in range(warmup):
            for zero in zeros:
                step(None, i, zero)
        for r in range(rounds):
            for zero in (zeros if r % 2 == 0 else list(reversed(zeros))):
                step(r, warmup + r, zero)
        for zero in zeros:
            finish(zero)
    else:
        for zero in zeros:
            build(zero)
            for i in range(warmup + rounds):
                step(i - warmup if i >= warmup else None, i, zero)
            finish(zero)
            dist.barrier()
    hwm = _gather(status_kib("VmHWM") * 1024)
    return dict(records=records, counts=counts, world=world, peak_rss=max(hwm), interleave=opts["interleave"])


def _worker_rss(opts: dict) -> dict:
    """Part 3: one stage, peak RSS around two training steps (module docstring)."""
    import torch.distributed as dist

    import shardlib

    mesh = shardlib.init_mesh(tp=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    config, model, trainer = _build(opts, mesh, opts["zero"])
    batches = _batches(opts, mesh, config.vocab_size, 2)
    param_bytes = sum(_nbytes(p) for p in trainer.params)
    gc.collect()
    _malloc_trim()
    build_s = time.perf_counter() - t0
    build_hwm = status_kib("VmHWM") * 1024
    before = status_kib("VmRSS") * 1024
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    dist.barrier()
    step_s = []
    for batch in batches:
        t1 = time.perf_counter()
        trainer.train_step(batch)
        step_s.append(time.perf_counter() - t1)
    step_hwm = status_kib("VmHWM") * 1024
    after = status_kib("VmRSS") * 1024
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = dict(param_bytes=param_bytes, build_hwm=build_hwm, before=before, step_hwm=step_hwm, after=after,
                lifetime=lifetime, reset=reset, build_s=build_s, step_s=step_s)
    if rank == 0:
        print(f"  zero={opts['zero']} rank 0: RSS {before / MIB:.0f} MiB before the steps, peak {step_hwm / MIB:.0f} "
              f"MiB during them, lifetime peak {lifetime / MIB:.0f} MiB; steps "
              f"{' / '.join(f'{s:.1f}' for s in step_s)} s", flush=True)
    return dict(ranks=_gather(mine), world=world)


def worker_main(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(args.opts) as f:
        opts = json.load(f)
    result = _worker_steps(opts) if args.worker == "steps" else _worker_rss(opts)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
