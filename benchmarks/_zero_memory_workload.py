"""The ranks' side of ``benchmarks/zero_memory.py``: models, batches, and what a rank measures per part."""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
import weakref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import libc, machine_busy_s, reset_peak_rss, status_kib  # noqa: E402

BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522)
LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, vocab_size=30522)
TINY_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
TINY_LARGE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, vocab_size=1000)
STAGES = (0, 1, 2, 3)
OPT_TARGET = 1.01  # zero 1/2: the largest rank's optimizer state / (full / dp)
IDLE_CORES = 0.1
MIB = 2 ** 20
RSS_BASE = 0.4 * 2 ** 30  # torch + transformers + gloo per rank


def rss_need(zero: int, param_bytes: float, dp: int, microbatches: int = 1) -> float:
    """Estimated peak RSS of a rank training ``param_bytes`` of fp32 parameters with AdamW (measured multiples; zero=3
    builds the whole model before FSDP2 shards it; zero=1 holds whole gradients over microbatches)."""
    factor = {0: 5.5, 3: 2.0 + 1.0 / dp}.get(zero, 1.75 + 4.0 / dp + (zero == 1 and microbatches > 1))
    return factor * param_bytes + RSS_BASE


def _nbytes(tensors) -> int:
    from shardlib.train.fsdp import local

    return sum(local(t).numel() * t.element_size() for t in tensors if t is not None)


def _gather(value) -> list:
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _build(opts: dict, mesh, zero: int):
    """(config, Trainer): ``BertForSequenceClassification`` (seed 0, 2 labels), AdamW (lr 1e-4), clipping at 1."""
    import torch
    import transformers

    import shardlib

    config = transformers.BertConfig(**opts["model"], max_position_embeddings=512, num_labels=2)
    torch.manual_seed(0)
    model = shardlib.shard(transformers.BertForSequenceClassification(config), mesh)
    return config, shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=1e-4), max_grad_norm=1.0,
                                    precision="fp32", zero=zero, microbatches=opts.get("microbatches", 1),
                                    bucket_mb=opts.get("bucket_mb", 25.0))


def _batches(opts: dict, mesh, vocab: int, n: int) -> list[dict]:
    """``n`` global batches of SST-2-shaped samples (random ids, full mask, 2 labels), the same on every rank."""
    import torch
    from torch.utils.data import default_collate

    import shardlib

    b, seq, g = opts["batch"], opts["seq"], torch.Generator().manual_seed(1234)
    ids, labels = torch.randint(0, vocab, (n * b, seq), generator=g), torch.randint(0, 2, (n * b,), generator=g)
    mask = torch.ones(seq, dtype=torch.long)
    samples = [{"input_ids": ids[i], "attention_mask": mask, "labels": labels[i]} for i in range(n * b)]
    return [shardlib.dp_shard(default_collate(samples[i * b:(i + 1) * b]), mesh) for i in range(n)]


def _instrument(trainer):
    """``([peak], undo)``: the gradient bytes alive during the next step, sampled after the backwards and, under zero
    1/2, at every gradient's arrival and bucket allocation. ``undo()`` drops the hooks (they keep the model alive)."""
    from shardlib.train.zero import FlatZero

    peak, params = [0], list(trainer.params)
    zero = trainer.optimizer if isinstance(trainer.optimizer, FlatZero) else None

    def sample(extra: int = 0) -> None:
        live = _nbytes(p.grad for p in params)
        if zero is not None:
            live += _nbytes(b.grad_shard for b in zero.buckets) + (_nbytes([zero._inflight[1]]) if zero._inflight
                                                                   else 0) + extra
        peak[0] = max(peak[0], live)

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
    trainer.reduce_gradients = lambda: (sample(), reduce_gradients())[1]

    def undo() -> None:
        for handle in handles:
            handle.remove()
        del trainer.reduce_gradients
        if zero is not None:
            del zero._reduce_scatter
        params.clear()

    return peak, undo


def _worker_bytes(opts: dict, mesh, rank: int, world: int) -> dict:
    """Part 1: per stage, on a fresh model, one instrumented ``train_step``; this rank's bytes and peak RSS."""
    import torch.distributed as dist

    from shardlib.train.optim import held_state_bytes
    from shardlib.train.zero import FlatZero

    counts = {}
    for zero in opts["zeros"]:
        gc.collect()
        libc("malloc_trim", 0)
        reset_peak_rss()
        t0 = time.perf_counter()
        config, trainer = _build(opts, mesh, zero)
        batch = _batches(opts, mesh, config.vocab_size, 1)[0]
        peak, undo = _instrument(trainer)
        dist.barrier()
        t1 = time.perf_counter()
        loss = trainer.train_step(batch)
        undo()
        del undo  # its closure holds the trainer
        params = trainer.params
        mine = dict(opt=held_state_bytes(trainer.optimizer, params), grad=peak[0], param=_nbytes(params),
                    full_param=sum(p.numel() * p.element_size() for p in params), n_params=len(params),
                    rss_peak=status_kib("VmHWM") * 1024)
        if isinstance(trainer.optimizer, FlatZero):  # the bucket layout: the bound on the gradient peak
            sizes = [b.numel * b.data.element_size() for b in trainer.optimizer.buckets]
            mine.update(buckets=len(sizes), bucket=max(sizes), shards=sum(s // trainer.optimizer.dp for s in sizes))
        counts[zero] = _gather(mine)
        if rank == 0:
            print(f"  dp={world} zero={zero}: built in {t1 - t0:.1f} s, step {time.perf_counter() - t1:.1f} s (loss "
                  f"{loss:.4f}); rank 0: optimizer {mine['opt'] / MIB:.1f} MiB, gradient peak {mine['grad'] / MIB:.1f} "
                  f"MiB, parameters {mine['param'] / MIB:.1f} MiB, peak RSS {mine['rss_peak'] / MIB:.0f} MiB",
                  flush=True)
        alive = weakref.ref(trainer.model)
        del trainer, batch, params
        gc.collect()
        if alive() is not None:
            print(f"  WARNING: rank {rank}: zero={zero}'s model is still alive after its stage: the next stages' "
                  "peak RSS counts it", flush=True)
        dist.barrier()
    return dict(counts=counts, world=world)


def _worker_steps(opts: dict, mesh, rank: int, world: int) -> dict:
    """Part 2: the stages' step times, interleaved (a trainer per stage, all alive) or one stage after another."""
    import torch
    import torch.distributed as dist

    zeros, warmup, rounds = opts["zeros"], opts["warmup"], opts["rounds"]
    records, trainers, batches = [], {}, []

    def build(zero):
        t0 = time.perf_counter()
        config, trainers[zero] = _build(opts, mesh, zero)
        batches.extend([] if batches else _batches(opts, mesh, config.vocab_size, warmup + rounds))
        dist.barrier()
        if rank == 0:
            print(f"  dp={world} zero={zero}: built in {time.perf_counter() - t0:.1f} s", flush=True)

    def step(r, i, zero):
        gc.collect()
        dist.barrier()
        busy0, own0, t0 = machine_busy_s(), time.process_time(), time.perf_counter()
        loss = trainers[zero].train_step(batches[i])
        dist.barrier()
        wall, busy, own = time.perf_counter() - t0, machine_busy_s() - busy0, time.process_time() - own0
        trainers[zero].zero_grad()  # outside the window: only one stage's gradients exist at a time
        t = torch.tensor([wall, own], dtype=torch.float64)
        dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
        dist.all_reduce(t[1:])
        wall, own = t.tolist()
        foreign = max(0.0, (busy - own) / wall) if wall > 0.2 else None
        if rank == 0:
            print(f"  dp={world} zero={zero} {'warm-up' if r is None else f'round {r}'}: {wall:.2f} s (CPU {own:.2f} s "
                  f"over {world} ranks; other processes {'?' if foreign is None else f'{foreign:.2f}'} cores; loss "
                  f"{loss:.4f})", flush=True)
        if r is not None:
            records.append(dict(round=r, zero=zero, wall_s=wall, cpu_s=own, foreign_cores=foreign))

    def finish(zero):
        del trainers[zero]
        gc.collect()
        libc("malloc_trim", 0)

    if opts["interleave"]:
        for zero in zeros:
            build(zero)
        for i in range(warmup):
            for zero in zeros:
                step(None, i, zero)
        for r in range(rounds):
            for zero in zeros[:: 1 if r % 2 == 0 else -1]:
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
    return dict(records=records, world=world, peak_rss=max(_gather(status_kib("VmHWM") * 1024)),
                interleave=opts["interleave"])


def _worker_rss(opts: dict, mesh, rank: int, world: int) -> dict:
    """Part 3: one stage; the RSS before two steps, their peak (VmHWM reset) and the lifetime peak (build included)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    config, trainer = _build(opts, mesh, opts["zero"])
    batches = _batches(opts, mesh, config.vocab_size, 2)
    param_bytes = _nbytes(trainer.params)
    gc.collect()
    libc("malloc_trim", 0)
    build_s, build_hwm, before = time.perf_counter() - t0, status_kib("VmHWM") * 1024, status_kib("VmRSS") * 1024
    reset = reset_peak_rss()
    dist.barrier()
    step_s = []
    for batch in batches:
        t1 = time.perf_counter()
        trainer.train_step(batch)
        step_s.append(time.perf_counter() - t1)
    mine = dict(param_bytes=param_bytes, build_hwm=build_hwm, before=before, step_hwm=status_kib("VmHWM") * 1024,
                after=status_kib("VmRSS") * 1024, lifetime=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                reset=reset, build_s=build_s, step_s=step_s)
    if rank == 0:
        print(f"  zero={opts['zero']} rank 0: RSS {before / MIB:.0f} MiB before the steps, peak "
              f"{mine['step_hwm'] / MIB:.0f} MiB during them, lifetime peak {mine['lifetime'] / MIB:.0f} MiB; steps "
              f"{' / '.join(f'{s:.1f}' for s in step_s)} s", flush=True)
    return dict(ranks=_gather(mine), world=world)


def worker_main(args) -> None:
    """A rank of a ``python -m shardlib.cli run`` launch: one part (``args.worker``), rank 0's result to ``--out``."""
    import torch
    import torch.distributed as dist

    import shardlib

    torch.set_num_threads(1)
    with open(args.opts) as f:
        opts = json.load(f)
    mesh = shardlib.init_mesh(tp=1)
    worker = {"bytes": _worker_bytes, "steps": _worker_steps, "rss": _worker_rss}[args.worker]
    result = worker(opts, mesh, dist.get_rank(), dist.get_world_size())
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
