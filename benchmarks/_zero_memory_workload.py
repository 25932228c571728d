"""The workload of ``benchmarks/zero_memory.py`` (its models, inputs, ranks and measurements); the script keeps its command line
and its report. ZeRO stages 0-3 on CPU: the bytes each dp rank holds (optimizer state, gradient peak during a step,
parameters), the step time, and the peak RSS of a large model."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import sys
import time
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine_busy_s, reset_peak_rss, status_kib  # noqa: E402

BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522)
LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, vocab_size=30522)
TINY_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
TINY_LARGE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                  vocab_size=1000)
STAGES = (0, 1, 2, 3)
OPT_TARGET = 1.01  # zero 1/2: the largest rank's optimizer state / (full / dp)
IDLE_CORES = 0.1
MIB = 2 ** 20
RSS_PER_PARAM_BYTE = 5.5  # peak RSS per rank / fp32 parameter bytes at zero=0 (measured 5.3 at hidden 1024 x 8,
#                           4.4 for BERT-base at dp 2 and 4)
RSS_BASE = 0.4 * 2 ** 30  # torch + transformers + gloo per rank


def rss_need(zero: int, param_bytes: float, dp: int, microbatches: int = 1) -> float:
    """Estimated peak RSS of one rank building and training a model of ``param_bytes`` (fp32, AdamW) at ``zero``
    and ``dp``. Multiples of the parameter bytes measured for BERT-base with MALLOC_MMAP_THRESHOLD_=131072 (peak
    RSS - 400 MiB): zero 1/2 3.3 / 2.2 / 2.0 at dp 2 / 4 / 8 (parameters, AdamW's 2/dp and its temporaries, the
    gradient buckets), zero=3 2.2 / 2.0 / 2.0 (building the whole model before FSDP2 shards it)."""
    if zero == 0:
        factor = RSS_PER_PARAM_BYTE
    elif zero == 3:
        factor = 2.0 + 1.0 / dp
    else:
        factor = 1.75 + 4.0 / dp
        if zero == 1 and microbatches > 1:
            factor += 1.0  # zero=1 accumulates whole gradients over the microbatches
    return factor * param_bytes + RSS_BASE


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
                               precision="fp32", zero=zero, microbatches=opts.get("microbatches", 1),
                               bucket_mb=opts.get("bucket_mb", 25.0))
    return config, model, trainer


def _batches(opts: dict, mesh, vocab: int, n: int) -> list[dict]:
    from torch.utils.data import default_collate

    import shardlib

    from _workloads import classification_samples

    b, seq = opts["batch"], opts["seq"]
    samples = classification_samples(n * b, seq, vocab)
    return [shardlib.dp_shard(default_collate(samples[i * b:(i + 1) * b]), mesh) for i in range(n)]


def _nbytes_all(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _instrument(trainer) -> tuple[list[int], object]:
    """Sample the gradient bytes this rank holds during the next train_step into the returned ``[peak]`` (module
    docstring of zero_memory.py, 1.): under zero 1/2 every ``.grad``, the buckets' gradient shards and the flat
    buffer in flight, after each post-accumulate-grad hook and when a bucket's flat buffer is allocated (the
    bucket's full gradients still alive: wrapping ``FlatZero._reduce_scatter``, as tests/zero_tasks.py does); under
    every stage right after the step's backwards (``trainer.reduce_gradients`` is called after them): the local
    ``.grad`` bytes (DDP's bucket views at zero=0, FSDP2's reduce-scattered shards at zero=3). Also returns
    ``undo()``: removes the hooks and wrappers (a hook on a parameter that refers to the trainer would keep the
    stage's model alive into the next stage)."""
    from shardlib.train.fsdp import local
    from shardlib.train.zero import FlatZero

    peak = [0]
    zero = trainer.optimizer if isinstance(trainer.optimizer, FlatZero) else None
    params = list(trainer.params)

    def live(extra: int = 0) -> int:
        grads = _nbytes_all(local(p.grad) for p in params if p.grad is not None)
        if zero is None:
            return grads
        shards = _nbytes_all(b.grad_shard for b in zero.buckets)
        flight = _nbytes_all([zero._inflight[1]]) if zero._inflight else 0
        return grads + shards + flight + extra

    def sample(extra: int = 0) -> None:
        peak[0] = max(peak[0], live(extra))

    handles = []
    if zero is not None:
        original = zero._reduce_scatter

        def reduce_scatter(bucket):
            zero._settle()  # what the original does first; then the flat buffer is allocated beside the gradients
            sample(bucket.numel * bucket.data.element_size())
            original(bucket)

        zero._reduce_scatter = reduce_scatter
        handles = [p.register_post_accumulate_grad_hook(lambda _: sample()) for p in params]
    reduce_gradients = trainer.reduce_gradients

    def after_backward() -> None:
        sample()
        reduce_gradients()

    trainer.reduce_gradients = after_backward

    def undo() -> None:
        for handle in handles:
            handle.remove()
        del trainer.reduce_gradients
        if zero is not None:
            del zero._reduce_scatter
        params.clear()

    return peak, undo


def _bytes_of(trainer, peak: int) -> dict:
    """This rank's figures after the instrumented step: optimizer state it holds, its gradient peak, its local
    parameters; the model's full parameter bytes; under zero 1/2 the bucket layout (bound on the gradient peak)."""
    from shardlib.train.fsdp import local
    from shardlib.train.optim import held_state_bytes
    from shardlib.train.zero import FlatZero

    out = dict(opt=held_state_bytes(trainer.optimizer, trainer.params), grad=peak,
               param=_nbytes_all(local(p) for p in trainer.params),
               full_param=sum(p.numel() * p.element_size() for p in trainer.params), n_params=len(trainer.params))
    zero = trainer.optimizer
    if isinstance(zero, FlatZero):
        sizes = [b.numel * b.data.element_size() for b in zero.buckets]
        out.update(buckets=len(sizes), bucket=max(sizes), shards=sum(s // zero.dp for s in sizes))
    return out


def _worker_bytes(opts: dict) -> dict:
    """Part 1: each stage of ``opts['zeros']`` one after another, each on a fresh model freed before the next: one
    instrumented ``train_step`` (it creates AdamW's state too), then this rank's bytes; per stage the rank's peak
    RSS from building the model to after the step (VmHWM reset first)."""
    import torch.distributed as dist

    import shardlib

    mesh = shardlib.init_mesh(tp=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = {}
    for zero in opts["zeros"]:
        gc.collect()
        _malloc_trim()
        reset_peak_rss()
        t0 = time.perf_counter()
        config, model, trainer = _build(opts, mesh, zero)
        del model  # the trainer holds it: nothing of this stage may outlive it (checked below)
        batch = _batches(opts, mesh, config.vocab_size, 1)[0]
        peak, undo = _instrument(trainer)
        dist.barrier()
        t1 = time.perf_counter()
        loss = trainer.train_step(batch)
        undo()
        del undo  # its closure holds the trainer
        mine = dict(_bytes_of(trainer, peak[0]), rss_peak=status_kib("VmHWM") * 1024)
        counts[zero] = _gather(mine)
        if rank == 0:
            print(f"  dp={world} zero={zero}: built in {t1 - t0:.1f} s, step {time.perf_counter() - t1:.1f} s "
                  f"(loss {loss:.4f}); rank 0: optimizer {mine['opt'] / MIB:.1f} MiB, gradient peak "
                  f"{mine['grad'] / MIB:.1f} MiB, parameters {mine['param'] / MIB:.1f} MiB, peak RSS "
                  f"{mine['rss_peak'] / MIB:.0f} MiB", flush=True)
        alive = weakref.ref(trainer.model)
        del trainer, batch
        gc.collect()
        if alive() is not None:
            print(f"  WARNING: rank {rank}: zero={zero}'s model is still alive after its stage: the next stages' "
                  "peak RSS counts it", flush=True)
        dist.barrier()
    return dict(counts=counts, world=world)


def _gather(value):
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _worker_steps(opts: dict) -> dict:
    """Part 2: with ``opts['interleave']`` a trainer per stage, all alive at once, their steps interleaved; else the
    stages one after another, each on a fresh model. See the module docstring."""
    import torch
    import torch.distributed as dist

    import shardlib

    mesh = shardlib.init_mesh(tp=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    zeros, warmup, rounds = opts["zeros"], opts["warmup"], opts["rounds"]
    records = []
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
    return dict(records=records, world=world, peak_rss=max(hwm), interleave=opts["interleave"])


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
    reset = reset_peak_rss()
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
    result = {"bytes": _worker_bytes, "steps": _worker_steps, "rss": _worker_rss}[args.worker](opts)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
