"""The ranks' side of ``benchmarks/pipeline.py``: its models, the timed cells of one split, each stage alone."""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shardlib  # noqa: E402

from _harness import fmt_cores, libc, machine_busy_s, reset_peak_rss, status_kib, wait_idle  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B"}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}
IDLE_CORES = 0.1
DEFAULT_SEQ = {"bert": 32, "t5": 16}  # what keeps the full sweep near 10 minutes on 2 cores
BASE = {"bert": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                     vocab_size=30522),
        "t5": dict(num_layers=12, num_decoder_layers=12, d_model=768, d_kv=64, num_heads=12, d_ff=3072,
                   vocab_size=32128)}
TINY = {"bert": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                     vocab_size=1000),
        "t5": dict(num_layers=4, num_decoder_layers=4, d_model=64, d_kv=16, num_heads=4, d_ff=256, vocab_size=1000)}


def model_config(name: str, quick: bool, layers: int | None):
    from transformers import BertConfig, T5Config

    fields = dict((TINY if quick else BASE)[name])
    if name == "bert":
        fields.update({"num_hidden_layers": layers} if layers else {})
        return BertConfig(**fields, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    fields.update(dict(num_layers=layers, num_decoder_layers=layers) if layers else {})
    return T5Config(**fields, dropout_rate=0.0, use_cache=False, pad_token_id=0, eos_token_id=1,
                    decoder_start_token_id=0)


def describe(name: str, c, batch: int, seq: int) -> str:
    if name == "bert":
        return (f"BertForMaskedLM: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} "
                f"heads, intermediate {c.intermediate_size}, vocab {c.vocab_size}; batch {batch} x {seq} tokens")
    return (f"T5ForConditionalGeneration: {c.num_layers} + {c.num_decoder_layers} layers, d_model {c.d_model}, "
            f"{c.num_heads} heads, d_ff {c.d_ff}, vocab {c.vocab_size}; batch {batch} x ({seq} encoder + {seq} "
            "decoder) tokens")


def make_batch(config, batch: int, seq: int) -> dict:
    """``input_ids`` first: the Trainer takes the first tensor as the first stage's positional input."""
    g = torch.Generator().manual_seed(1)
    return dict(input_ids=torch.randint(1, config.vocab_size, (batch, seq), generator=g),
                attention_mask=torch.ones(batch, seq, dtype=torch.long),
                labels=torch.randint(1, config.vocab_size, (batch, seq), generator=g))


def all_reduce(values, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def per_rank(value: float) -> list[float]:
    """[rank 0's value, rank 1's value] on every rank."""
    return all_reduce([value if r == dist.get_rank() else 0.0 for r in range(dist.get_world_size())])


class SavedBytes:
    """``saved_tensors_hooks``: the peak bytes of storages saved for backward alive at once (``skip``: parameters)."""

    def __init__(self, skip: set[int]):
        self.skip, self.live, self.current, self.peak = skip, {}, 0, 0

    def pack(self, t: torch.Tensor):
        try:
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            key, nbytes = ("id", id(t)), t.numel() * t.element_size()
        if key in self.skip or nbytes == 0:
            return _Holder(t, None, None)
        entry = self.live.setdefault(key, [0, nbytes])
        entry[0] += 1
        if entry[0] == 1:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        return _Holder(t, self, key)

    def release(self, key) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda holder: holder.tensor)


class _Holder:
    """A saved tensor; its counter forgets the storage once autograd has dropped every holder of it."""
    __slots__ = ("tensor", "counter", "key")

    def __init__(self, tensor, counter, key):
        self.tensor, self.counter, self.key = tensor, counter, key

    def __del__(self):
        if self.counter is not None:
            self.counter.release(self.key)


def rss_growth(fn) -> float:
    """Peak RSS during ``fn()`` less the RSS before it (bytes), -1 where VmHWM cannot be reset."""
    gc.collect()
    libc("malloc_trim", 0)
    before, reset = status_kib("VmRSS"), reset_peak_rss()
    fn()
    return (status_kib("VmHWM") - before) * 1024.0 if reset else -1.0


def parameter_storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters() if not p.is_meta}


def measure_quietly(fn, args, log):
    """(``fn()``, cores others used meanwhile); above IDLE_CORES, wait for quiet and again (``args.retries``)."""
    for attempt in range(args.retries + 1):
        busy, own, wall = machine_busy_s(), time.process_time(), time.perf_counter()
        result = fn()
        busy, own, wall = machine_busy_s() - busy, time.process_time() - own, time.perf_counter() - wall
        own, busy = all_reduce([own])[0], all_reduce([busy if dist.get_rank() == 0 else 0.0])[0]
        wall = all_reduce([wall], dist.ReduceOp.MAX)[0]
        foreign = max(0.0, (busy - own) / wall) if wall >= 0.5 else None  # /proc/stat ticks are 10 ms
        if foreign is None or foreign <= IDLE_CORES or attempt == args.retries:
            return result, foreign
        log(f"    (other processes used {foreign:.2f} cores meanwhile: waiting for quiet, then measuring again)")
        if dist.get_rank() == 0:
            wait_idle(min(args.wait_idle, 60.0), IDLE_CORES)
        dist.barrier()


def run_stage_alone(module, args: tuple, kwargs: dict) -> None:
    """Forward then backward of one stage on recorded inputs, as the schedule runs it, without communication."""
    inputs = tuple(a.detach().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in args)
    outs = module(*inputs, **kwargs)
    if module.route.is_last:
        outs[0].backward()
        module.outputs.clear()
    else:
        outs = [o for o in outs if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def time_stages(model, split, captured: dict, args, log) -> dict:
    """Per stage (gathered over the ranks), one microbatch: bytes saved for backward, median fwd+bwd ms ("times")."""
    saved, skip = {}, parameter_storages(model)
    for module in split.stage_modules:  # the warm-up: counting hooks cost time, so this untimed run counts bytes
        dist.barrier()
        counter = SavedBytes(skip)
        with counter.hooks():
            run_stage_alone(module, *captured[module.index])
        saved[module.index] = counter.peak

    def timed() -> dict:
        times = {m.index: [] for m in split.stage_modules}
        for _ in range(args.stage_repeats):
            for module in split.stage_modules:
                dist.barrier()  # both ranks compute at once, as in the pipeline's steady state
                t0 = time.perf_counter()
                run_stage_alone(module, *captured[module.index])
                times[module.index].append(time.perf_counter() - t0)
        return times

    n = split.num_stages
    times, foreign = measure_quietly(timed, args, log)
    return {"saved": all_reduce([float(saved.get(s, 0)) for s in range(n)]), "foreign": foreign,
            "times": all_reduce([statistics.median(times[s]) * 1e3 if s in times else 0.0 for s in range(n)])}


def bench_split(mesh, name, config, batch, spr, schedules, microbatches, args, log) -> dict:
    """The schedules at ``stages_per_rank=spr`` on one sharded model: step times, stages alone, memory at m."""
    from transformers import BertForMaskedLM, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = (BertForMaskedLM if name == "bert" else T5ForConditionalGeneration)(config).train()
    model = shardlib.shard(model, mesh, stages_per_rank=spr)
    split = shardlib.shard_state(model).pipeline
    out = {"plan": [list(s) for s in split.plan.layers], "cells": {}, "stages": {}, "mem": {}}
    trainers: dict = {}
    cpu: list[float] = []  # this rank's main-thread CPU time per step: its compute (waits on gloo are idle)

    def trainer(sched, m):
        return trainers.setdefault((sched, m), shardlib.Trainer(model, None, microbatches=m, schedule=sched))

    def step(tr) -> float:
        tr.zero_grad()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        tr.forward_backward(batch)
        cpu.append(time.thread_time() - c0)
        return time.perf_counter() - t0

    for m in microbatches:
        captured: dict = {}  # the first step at this m records each local stage's inputs of one microbatch

        def capture(module, a, kw):
            if not any(torch.is_tensor(v) and v.is_meta for v in (*a, *kw.values())):
                clone = lambda v: v.detach().clone() if torch.is_tensor(v) else v  # noqa: E731
                captured[module.index] = (tuple(map(clone, a)), {k: clone(v) for k, v in kw.items()})

        handles = [s.register_forward_pre_hook(capture, with_kwargs=True) for s in split.stage_modules]
        for sched in schedules:
            tr = trainer(sched, m)
            try:  # torch refuses some combinations when the schedule is built, before any communication
                step(tr)
            except ValueError as e:
                out["cells"][(sched, m)] = {"error": str(e).split(": ", 1)[-1]}
                log(f"  {TITLES[sched]:<17} m={m:<3} n/a: {out['cells'][(sched, m)]['error']}")
                continue
            for h in handles:
                h.remove()
            handles = []
            for _ in range(args.warmup - 1):
                step(tr)

            def timed():
                cpu.clear()
                return [step(tr) for _ in range(args.repeats)]

            times, foreign = measure_quietly(timed, args, log)
            times = all_reduce(times, dist.ReduceOp.MAX)  # a step lasts until its slower rank is done
            busy = per_rank(statistics.median(cpu) * 1e3)
            out["cells"][(sched, m)] = {"times": times, "foreign": foreign, "cpu_ms": busy}
            log(f"  {TITLES[sched]:<17} m={m:<3} median {statistics.median(times) * 1e3:8.1f} ms  (CPU per rank "
                f"{busy[0]:.0f} / {busy[1]:.0f} ms; others' CPU {fmt_cores(foreign)})")
        for h in handles:
            h.remove()
        if len(captured) == len(split.stage_modules):
            model.zero_grad(set_to_none=True)
            out["stages"][m] = r = time_stages(model, split, captured, args, log)
            log(f"  stages alone      m={m:<3} " + " / ".join(f"{t:.1f}" for t in r["times"]) + " ms per "
                f"microbatch, both ranks at once (others' CPU {fmt_cores(r['foreign'])})")
        del captured
    mm = args.memory_m
    for sched in schedules:
        if "times" not in out["cells"].get((sched, mm), {}):
            continue
        tr = trainer(sched, mm)
        tr.zero_grad()
        counter = SavedBytes(parameter_storages(model))

        def run():
            with counter.hooks():
                tr.forward_backward(batch)

        dist.barrier()
        growth = rss_growth(run)
        peak, rss = per_rank(counter.peak), per_rank(growth)
        out["mem"][sched] = {"saved": peak, "rss": None if min(rss) < 0 else rss}
        log(f"  memory           {TITLES[sched]:<17} m={mm}: peak saved " + " / ".join(mib(x) for x in peak)
            + " (rank 0 / rank 1)")
    trainers.clear()
    del model, split
    gc.collect()
    return out


def mib(x: float) -> str:
    return f"{x / 2**20:.1f} MiB"
