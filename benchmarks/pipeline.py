"""Pipeline schedules on CPU: GPipe vs 1F1B vs interleaved 1F1B against the bubble formula, pp=2 over gloo.

What is measured
----------------
Two models, random weights from configs, fp32, dropout 0, ``train()`` mode, full attention masks:

* ``bert``: ``BertForMaskedLM`` at BERT-base size (12 layers, hidden 768, 12 heads, intermediate 3072, vocab
  30522); batch ``input_ids`` / ``attention_mask`` / ``labels`` (a label on every token), 16 x 32 tokens;
* ``t5``: ``T5ForConditionalGeneration`` at T5-base size (12 + 12 layers, d_model 768, d_kv 64, 12 heads, d_ff 3072,
  vocab 32128); batch ``input_ids`` / ``attention_mask`` / ``labels`` (HF shifts ``labels`` right into the decoder
  input), 16 x (16 encoder + 16 decoder) tokens.

Those sizes keep the full sweep near 10 minutes on 2 cores (692 s on the reference machine; ``--batch``, ``--seq``;
``--layers`` shrinks the stacks, keeping the width). Each model is split by ``shardlib.shard(model,
init_mesh(pp=2), stages_per_rank=...)`` (embeddings go with the first layer of their stack, the LM head with the
last stage):

* ``stages_per_rank=1`` (2 stages, stage s on rank s) for ``gpipe`` and ``1f1b``;
* ``stages_per_rank=2`` (4 stages, stages 0 and 2 on rank 0, 1 and 3 on rank 1) for ``interleaved_1f1b``,

and run by ``shardlib.Trainer(model, microbatches=m, schedule=...)`` for m in 1, 2, 4, 8, 16. A cell is
one ``trainer.forward_backward(batch)`` of the whole global batch (no optimizer step, so no optimizer is built):
``--warmup`` untimed steps (the first one also runs torch's metadata inference; its time is printed as "first
step"), then ``--repeats`` timed ones, each after a barrier, its time the maximum over the two ranks; the table
gives the median. Each rank's main-thread CPU time per step is printed too: its compute inside the pipeline (a
rank waiting on gloo for the other sleeps). Combinations torch refuses (its 1F1B needs m >= pp) print n/a with
torch's reason.

The ideal
---------
Per-stage compute time per microbatch, ``t_s``: the first step at each m records the inputs of one microbatch of
every local ``StageModule`` (received boundary tensors and the batch keyword arguments); each rank then runs its
stages alone on them, forward then backward (a ones gradient on the boundary outputs; the loss on the last stage),
no communication, ``--stage-repeats`` times after one warm-up run; ``t_s`` is the median. It is measured for every
microbatch size (16 / m sequences), because smaller matmuls are less efficient per token on a CPU (the weights are
streamed from memory once per microbatch), and the ideal should not charge that to the schedule. It is timed twice:
with both ranks computing at once (what the pipeline's steady state does; memory bandwidth is shared) and with one
rank at a time (the other idle, as in the fill and drain of the pipeline). The ideal uses the first:

    ideal(m) = (m + p - 1) * max_s t_s  =  m * max_s t_s / (1 - bubble),   bubble = (p - 1) / (m + p - 1)

and the second is printed as a reference row. For the interleaved schedule (v = 2 stages per rank, p = 2 ranks) the
same over chunks (Megatron's bubble (p - 1) / (v m + p - 1) for equal chunks): ``ideal(m) = m * max_r (sum of rank
r's t_s) + (p - 1) * max_s t_s``; it assumes m >= p (with fewer microbatches the chunks cannot interleave and the
formula undercounts the bubble). The table prints measured / ideal per cell; what is left above 1.00x is what the
runtime adds: point-to-point sends and receives over gloo, waiting beyond what max_s t_s charges, the schedule's
bookkeeping, the loss all-reduce at the end of the step.

Memory
------
At m = ``--memory-m`` (default 8) one more step per schedule runs under ``torch.autograd.graph.saved_tensors_hooks``:
every tensor saved for backward adds its storage's bytes to a live counter (each storage counted once, keyed by
``untyped_storage().data_ptr()``; the parameters' own storages are not activations and are skipped) until autograd
frees it; the peak is the activation memory a schedule keeps alive per rank. Next to it the predictions from one
microbatch's saved bytes per stage, a_s (measured the same way on the isolated stage): GPipe keeps all m
microbatches, m x a_s; 1F1B keeps at most min(m, p - r) in flight on rank r. Also printed: the growth of the
process's peak RSS during that step (``/proc/self/clear_refs`` resets VmHWM after ``malloc_trim``; includes
gradients, allocator slack and communication buffers, so it is a coarser number).

Machine
-------
Two ranks, one thread each (``torch.set_num_threads(1)``), on a 2-core machine: nothing else may run. Rank 0 waits
(``--wait-idle``, default up to 120 s) for other processes to go quiet before each model, and every timed window
(a cell's repeats, a set of isolated stage runs) records the CPU other processes used meanwhile (the machine's busy
time minus both ranks' own). Above 0.1 cores the window is measured again after waiting (up to 60 s) for quiet
(``--retries``, default once; not with ``--quick``); if it is still noisy the cell is marked ``*`` and listed under
the tables. The load average is printed at the start and the end.

How to run
----------
    .venv/bin/shardlib run --nproc 2 benchmarks/pipeline.py            # full sweep, about 12 minutes
    .venv/bin/shardlib run --nproc 2 benchmarks/pipeline.py --quick    # smoke check: tiny models, ~30 s
    .venv/bin/shardlib run --nproc 2 benchmarks/pipeline.py --models bert --microbatches 4,8 --repeats 5

It prints progress per cell, then per model markdown tables: the stage split, the per-stage compute times, the
step times (median ms and measured / ideal) with the bubble and the ideal rows, the CPU time per rank, the first
steps, the memory table, and a line saying whether 1F1B at m = 8 is within 1.15x of its ideal (the target).
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shardlib  # noqa: E402

from _harness import wait_idle  # noqa: E402
from _pipeline_workload import (  # noqa: E402
    BASE, DEFAULT_SEQ, IDLE_CORES, SCHEDULES, STAGES_PER_RANK, TARGET_M, TARGET_RATIO, TITLES, _mib, bench_split,
    describe, make_batch, model_config,
)


def ideal_ms(stage_ms: list[float], m: int, pp: int = 2) -> float:
    """m x (largest per-rank work per microbatch) + (pp - 1) x (largest stage): (m + p - 1) max t_s for one stage
    per rank; stage s runs on rank s % pp."""
    work = [sum(t for s, t in enumerate(stage_ms) if s % pp == r) for r in range(pp)]
    return m * max(work) + (pp - 1) * max(stage_ms)


def report(name, config, batch_size, seq, results, microbatches, args, warnings) -> list[str]:
    """The markdown tables of one model (rank 0)."""

    def stages(spr, m):
        return results.get(spr, {}).get("stages", {}).get(m)

    def flag(foreign, what):
        if foreign is not None and foreign > IDLE_CORES:
            warnings.append(f"{name} {what}: other processes used {foreign:.2f} cores while it was timed")
            return "*"
        return ""

    lines = [f"### {name}: {describe(name, config, batch_size, seq)}", ""]
    for spr, res in sorted(results.items()):
        plan = "; ".join(f"{s} (rank {s % 2}): {_layer_span(layers)}" for s, layers in enumerate(res["plan"]))
        lines.append(f"- {2 * spr} stages: {plan}")
    lines += ["", "Per-stage compute t_s, forward + backward of one microbatch of the stage alone, no communication "
              "(median ms; both ranks computing at once, in brackets one rank at a time):", "",
              "| m | sequences per microbatch | 2 stages: t_0 / t_1 | 4 stages: t_0 / t_1 / t_2 / t_3 |",
              "|---:|---:|---|---|"]
    for m in microbatches:
        cols = []
        for spr in (1, 2):
            r = stages(spr, m)
            if not r:
                cols.append("n/a")
                continue
            mark = flag(r["together_foreign"], f"stages ({2 * spr}) m={m} together") + flag(
                r["alone_foreign"], f"stages ({2 * spr}) m={m} one at a time")
            cols.append(" / ".join(f"{x:.0f}" for x in r["together"]) + " ("
                        + " / ".join(f"{x:.0f}" for x in r["alone"]) + ")" + mark[:1])
        lines.append(f"| {m} | {batch_size // m} | {cols[0]} | {cols[1]} |")
    header = "| schedule | " + " | ".join(f"m={m}" for m in microbatches) + " |"
    rule = "|---|" + "---:|" * len(microbatches)
    lines += ["", f"Step time, forward + backward of the global batch, median ms of {args.repeats} "
              "(measured / ideal from t_s together):", "", header, rule,
              "| bubble (p-1)/(m+p-1), p=2 | " + " | ".join(f"{1 / (m + 1):.0%}" for m in microbatches) + " |"]

    def ideal_rows(spr, label):
        rows = []
        for key, what in (("together", "t_s together"), ("alone", "t_s one rank at a time")):
            cells = [f"{ideal_ms(stages(spr, m)[key], m):.0f}" if stages(spr, m) else "n/a" for m in microbatches]
            rows.append(f"| ideal, {label}, {what} | " + " | ".join(cells) + " |")
        return rows

    rows_cpu, rows_first, ideals_shown = [], [], set()
    for sched in sorted(args.schedules, key=SCHEDULES.index):
        spr = STAGES_PER_RANK[sched]
        if spr not in ideals_shown:
            ideals_shown.add(spr)
            lines += ideal_rows(spr, "2 stages: (m+1) max t_s" if spr == 1 else
                                "4 stages: m max_r(t_r + t_r+2) + max t_s")
        cells, cpus, firsts = [], [], []
        for m in microbatches:
            cell = results.get(spr, {}).get("cells", {}).get((sched, m))
            if cell is None or "error" in cell:
                cells.append("n/a")
                cpus.append("n/a")
                firsts.append("n/a")
                if cell:
                    warnings.append(f"n/a: {name} {TITLES[sched]} m={m}: {cell['error']}")
                continue
            med = statistics.median(cell["times"]) * 1e3
            ratio = f" ({med / ideal_ms(stages(spr, m)['together'], m):.2f}x)" if stages(spr, m) else ""
            cells.append(f"{med:.0f}{ratio}{flag(cell['foreign'], f'{TITLES[sched]} m={m}')}")
            cpus.append(" / ".join(f"{x:.0f}" for x in cell["cpu_ms"]))
            firsts.append(f"{cell['first'] * 1e3:.0f}")
        lines.append(f"| **{TITLES[sched]}** | " + " | ".join(cells) + " |")
        rows_cpu.append(f"| {TITLES[sched]} | " + " | ".join(cpus) + " |")
        rows_first.append(f"| {TITLES[sched]} | " + " | ".join(firsts) + " |")
    lines += ["", "CPU time of each rank's main thread per step (median ms, rank 0 / rank 1: its compute in the "
              "pipeline; waiting for the other rank is idle):", "", header, rule, *rows_cpu]
    lines += ["", "First step (ms; includes torch's metadata inference for a new schedule):", "", header, rule,
              *rows_first]
    mm = args.memory_m
    mem = {s: results.get(STAGES_PER_RANK[s], {}).get("mem", {}).get(s) for s in args.schedules}
    if any(mem.values()):
        lines += ["", f"Peak bytes saved for backward per rank at m={mm} (activations alive at once), predicted from "
                  "one microbatch's saved bytes a_s of the isolated stage, and the growth of peak RSS during the step:",
                  "", "| schedule | rank 0 saved | rank 1 saved | predicted rank 0 / rank 1 | rank 0 RSS growth "
                  "| rank 1 RSS growth |", "|---|---:|---:|---|---:|---:|"]
        for sched, r in mem.items():
            if not r:
                continue
            st = stages(STAGES_PER_RANK[sched], mm)
            a = st["saved"] if st else None
            pred = "n/a"
            if a and sched == "gpipe":
                pred = " / ".join(_mib(mm * a[k]) for k in range(2)) + " (m a_s)"
            elif a and sched == "1f1b":
                pred = " / ".join(_mib(min(mm, 2 - k) * a[k]) for k in range(2)) + " (min(m, p - r) a_s)"
            rss = [_mib(x) for x in r["rss"]] if r["rss"] else ["n/a", "n/a"]
            lines.append(f"| {TITLES[sched]} | {_mib(r['saved'][0])} | {_mib(r['saved'][1])} | {pred} | {rss[0]} | "
                         f"{rss[1]} |")
        if mem.get("gpipe") and mem.get("1f1b"):
            g, o = mem["gpipe"]["saved"], mem["1f1b"]["saved"]
            lines += ["", f"GPipe / 1F1B peak saved bytes at m={mm}: rank 0 {g[0] / o[0]:.2f}x, rank 1 "
                          f"{g[1] / o[1]:.2f}x."]
    cell = results.get(1, {}).get("cells", {}).get(("1f1b", TARGET_M))
    st = stages(1, TARGET_M)
    if cell and "times" in cell and st:
        med, ideal = statistics.median(cell["times"]) * 1e3, ideal_ms(st["together"], TARGET_M)
        verdict = "within" if med / ideal <= TARGET_RATIO else "NOT within"
        lines += ["", f"**Target: 1F1B at m={TARGET_M}: {med:.0f} ms vs ideal {ideal:.0f} ms = {med / ideal:.2f}x, "
                      f"{verdict} {TARGET_RATIO}x.**"]
    return lines


def _layer_span(layers) -> str:
    """'encoder.layer.0-5' style summary of a stage's layer paths."""
    groups: dict[str, list[str]] = {}
    for path in layers:
        stack, _, key = path.rpartition(".")
        groups.setdefault(stack, []).append(key)
    parts = []
    for stack, keys in groups.items():
        parts.append(f"{stack}.{keys[0]}" + (f"-{keys[-1]}" if len(keys) > 1 else ""))
    return " + ".join(parts)


# ------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bert,t5", help="comma-separated subset of: bert, t5 (default both)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of: "
                   + ", ".join(SCHEDULES))
    p.add_argument("--microbatches", default="1,2,4,8,16", help="comma-separated (each must divide --batch)")
    p.add_argument("--batch", type=int, default=16, help="global batch, sequences (default 16)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence, T5: per encoder and per decoder "
                   "sequence (default: BERT 32, T5 16; --quick 16)")
    p.add_argument("--layers", type=int, default=None, help="layers per stack instead of 12 (width unchanged)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per cell, >= 1 (default 1: the first step)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per cell (default 3; --quick 2)")
    p.add_argument("--stage-repeats", type=int, default=None,
                   help="timed runs of each isolated stage per microbatch size (default 5; --quick 3)")
    p.add_argument("--retries", type=int, default=None,
                   help="measure a cell again (after waiting for quiet) when other processes used more than "
                        f"{IDLE_CORES} cores meanwhile, up to this many times (default 1; --quick 0)")
    p.add_argument("--memory-m", type=int, default=8, help="microbatches of the memory measurement (default 8)")
    p.add_argument("--wait-idle", type=float, default=None, metavar="SECONDS",
                   help="before each model rank 0 waits up to this long for other processes to go quiet (default "
                        "120; --quick 10; 0: don't wait)")
    p.add_argument("--quick", action="store_true", help="smoke check: tiny models (hidden 64, 4 layers), 16 x 16 "
                   "tokens, 2 timed steps per cell")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.schedules = args.schedules.split(",")
    microbatches = [int(x) for x in args.microbatches.split(",")]
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.stage_repeats = args.stage_repeats or (3 if args.quick else 5)
    args.wait_idle = args.wait_idle if args.wait_idle is not None else (10.0 if args.quick else 120.0)
    args.retries = args.retries if args.retries is not None else (0 if args.quick else 1)
    bad = [m for m in args.models if m not in BASE] + [s for s in args.schedules if s not in SCHEDULES]
    if bad or any(args.batch % m for m in microbatches) or args.warmup < 1 or args.batch % args.memory_m:
        p.error(f"bad arguments {bad}: models from bert, t5; schedules from {', '.join(SCHEDULES)}; every "
                "microbatch count and --memory-m must divide --batch; --warmup >= 1")

    torch.set_num_threads(1)
    mesh = shardlib.init_mesh(pp=2)
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("run on exactly 2 ranks: shardlib run --nproc 2 benchmarks/pipeline.py")

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    log(f"# pipeline schedules, pp=2 on 2 processes x 1 thread, gloo, fp32, dropout 0, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs; load average at start {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    t_all = time.perf_counter()
    warnings: list[str] = []
    out_lines: list[str] = []
    for name in args.models:
        seq = args.seq or (16 if args.quick else DEFAULT_SEQ[name])
        config = model_config(name, args.quick, args.layers)
        log(f"\n## {name}: {describe(name, config, args.batch, seq)}")
        if rank == 0 and args.wait_idle > 0:
            load = wait_idle(args.wait_idle, IDLE_CORES)
            if load > IDLE_CORES:
                msg = f"the machine was not idle ({load:.2f} cores busy by other processes) before {name}"
                log(f"  WARNING: {msg}")
                warnings.append(msg)
        dist.barrier()
        log(f"  load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
        batch = make_batch(config, args.batch, seq)
        results = {}
        for spr in (1, 2):
            scheds = [s for s in args.schedules if STAGES_PER_RANK[s] == spr]
            if scheds:
                results[spr] = bench_split(mesh, name, config, batch, spr, scheds, microbatches, args, log)
        if rank == 0:
            out_lines += ["", *report(name, config, args.batch, seq, results, microbatches, args, warnings)]
    log("\n" + "\n".join(out_lines))
    for w in warnings:
        log(f"WARNING: {w}" if not w.startswith("n/a") else w)
    log(f"\nload average at end {' / '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"total wall time {time.perf_counter() - t_all:.0f} s")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
