"""Pipeline schedules on CPU: GPipe vs 1F1B vs interleaved 1F1B against the bubble formula's ideal, and the bytes
saved for backward per rank, pp=2 over gloo. Docs: docs/benchmarks/pipeline-schedules.md.

    .venv/bin/shardlib run --nproc 2 benchmarks/pipeline.py            # BERT-base and T5-base, about 12 minutes
    .venv/bin/shardlib run --nproc 2 benchmarks/pipeline.py --quick    # tiny models, ~30 s
    .venv/bin/shardlib run --nproc 2 benchmarks/pipeline.py --models bert --microbatches 4,8 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shardlib  # noqa: E402

from _harness import wait_idle  # noqa: E402
from _pipeline_workload import (  # noqa: E402
    BASE, DEFAULT_SEQ, IDLE_CORES, SCHEDULES, STAGES_PER_RANK, TITLES, bench_split, describe, make_batch, mib,
    model_config,
)

TARGET_M, TARGET_RATIO = 8, 1.15


def ideal_ms(stage_ms: list[float], m: int, pp: int = 2) -> float:
    """m x (the largest per-rank work per microbatch) + (pp - 1) x (the largest stage); stage s runs on rank s % pp."""
    work = [sum(t for s, t in enumerate(stage_ms) if s % pp == r) for r in range(pp)]
    return m * max(work) + (pp - 1) * max(stage_ms)


def layer_span(layers) -> str:
    """'bert.encoder.layer.0-5' style summary of a stage's layer paths."""
    groups: dict[str, list[str]] = {}
    for path in layers:
        stack, _, key = path.rpartition(".")
        groups.setdefault(stack, []).append(key)
    return " + ".join(f"{s}.{k[0]}" + (f"-{k[-1]}" if len(k) > 1 else "") for s, k in groups.items())


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
    lines += [f"- {2 * spr} stages: " + "; ".join(f"{s} (rank {s % 2}): {layer_span(lay)}"
                                                   for s, lay in enumerate(res["plan"]))
              for spr, res in sorted(results.items())]
    lines += ["", "Per-stage compute t_s, forward + backward of one microbatch of the stage alone, no communication, "
              "both ranks computing at once (median ms):", "",
              "| m | sequences per microbatch | 2 stages: t_0 / t_1 | 4 stages: t_0 / t_1 / t_2 / t_3 |",
              "|---:|---:|---|---|"]
    for m in microbatches:
        cols = [" / ".join(f"{x:.0f}" for x in r["times"]) + flag(r["foreign"], f"stages ({2 * spr}) m={m}")
                if (r := stages(spr, m)) else "n/a" for spr in (1, 2)]
        lines.append(f"| {m} | {batch_size // m} | {cols[0]} | {cols[1]} |")
    header = "| schedule | " + " | ".join(f"m={m}" for m in microbatches) + " |\n|---|" + "---:|" * len(microbatches)
    lines += ["", f"Step time, fwd + bwd of the global batch, median ms of {args.repeats} (measured / ideal):", "",
              header,
              "| bubble (p-1)/(m+p-1), p=2 | " + " | ".join(f"{1 / (m + 1):.0%}" for m in microbatches) + " |"]
    rows_cpu, ideals_shown = [], set()
    for sched in sorted(args.schedules, key=SCHEDULES.index):
        spr = STAGES_PER_RANK[sched]
        if spr not in ideals_shown:
            ideals_shown.add(spr)
            label = "2 stages: (m+1) max t_s" if spr == 1 else "4 stages: m max_r(t_r + t_r+2) + max t_s"
            lines.append(f"| ideal, {label} | " + " | ".join(
                f"{ideal_ms(stages(spr, m)['times'], m):.0f}" if stages(spr, m) else "n/a" for m in microbatches)
                + " |")
        cells, cpus = [], []
        for m in microbatches:
            cell = results.get(spr, {}).get("cells", {}).get((sched, m))
            if cell is None or "error" in cell:
                cells, cpus = cells + ["n/a"], cpus + ["n/a"]
                if cell:
                    warnings.append(f"n/a: {name} {TITLES[sched]} m={m}: {cell['error']}")
                continue
            med = statistics.median(cell["times"]) * 1e3
            ratio = f" ({med / ideal_ms(stages(spr, m)['times'], m):.2f}x)" if stages(spr, m) else ""
            cells.append(f"{med:.0f}{ratio}{flag(cell['foreign'], f'{TITLES[sched]} m={m}')}")
            cpus.append(" / ".join(f"{x:.0f}" for x in cell["cpu_ms"]))
        lines.append(f"| **{TITLES[sched]}** | " + " | ".join(cells) + " |")
        rows_cpu.append(f"| {TITLES[sched]} | " + " | ".join(cpus) + " |")
    lines += ["", "CPU ms per step of each rank's main thread (median, rank 0 / 1; waits idle):", "", header, *rows_cpu]
    mm = args.memory_m
    mem = {s: results.get(STAGES_PER_RANK[s], {}).get("mem", {}).get(s) for s in args.schedules}
    if any(mem.values()):
        lines += ["", f"Peak bytes saved for backward per rank at m={mm}, predicted from one microbatch's a_s of the "
                  "stage alone, and the growth of peak RSS:", "", "| schedule | rank 0 saved | rank 1 saved | "
                  "predicted rank 0 / 1 | rank 0 RSS growth | rank 1 RSS growth |", "|---|---:|---:|---|---:|---:|"]
        for sched, r in mem.items():
            if not r:
                continue
            st = stages(STAGES_PER_RANK[sched], mm)
            a, pred = st["saved"] if st else None, "n/a"
            if a and sched == "gpipe":
                pred = " / ".join(mib(mm * a[k]) for k in range(2)) + " (m a_s)"
            elif a and sched == "1f1b":
                pred = " / ".join(mib(min(mm, 2 - k) * a[k]) for k in range(2)) + " (min(m, p - r) a_s)"
            rss = [mib(x) for x in r["rss"]] if r["rss"] else ["n/a", "n/a"]
            lines.append(f"| {TITLES[sched]} | {mib(r['saved'][0])} | {mib(r['saved'][1])} | {pred} | {rss[0]} | "
                         f"{rss[1]} |")
        if mem.get("gpipe") and mem.get("1f1b"):
            g, o = mem["gpipe"]["saved"], mem["1f1b"]["saved"]
            lines += ["", f"GPipe / 1F1B peak saved bytes at m={mm}: rank 0 {g[0] / o[0]:.2f}x, rank 1 "
                          f"{g[1] / o[1]:.2f}x."]
    cell, st = results.get(1, {}).get("cells", {}).get(("1f1b", TARGET_M)), stages(1, TARGET_M)
    if cell and "times" in cell and st:
        med, ideal = statistics.median(cell["times"]) * 1e3, ideal_ms(st["times"], TARGET_M)
        lines += ["", f"**Target: 1F1B at m={TARGET_M}: {med:.0f} ms vs ideal {ideal:.0f} ms = {med / ideal:.2f}x, "
                      f"{'within' if med / ideal <= TARGET_RATIO else 'NOT within'} {TARGET_RATIO}x.**"]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bert,t5", help="comma-separated subset of: bert, t5 (default both)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of the default")
    p.add_argument("--microbatches", default="1,2,4,8,16", help="comma-separated (each must divide --batch)")
    p.add_argument("--batch", type=int, default=16, help="global batch, sequences (default 16)")
    p.add_argument("--seq", type=int, help="tokens per (T5: encoder and decoder) sequence (default: BERT 32, T5 16)")
    p.add_argument("--layers", type=int, help="layers per stack instead of 12 (width unchanged)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per cell, >= 1 (default 1: the first step)")
    p.add_argument("--repeats", type=int, help="timed steps per cell (default 3; --quick 2)")
    p.add_argument("--stage-repeats", type=int, help="timed runs of each stage alone per m (default 5; --quick 3)")
    p.add_argument("--retries", type=int, help=f"measure again where others used more than {IDLE_CORES} cores "
                   "meanwhile, up to this many times (default 1; --quick 0)")
    p.add_argument("--memory-m", type=int, default=8, help="microbatches of the memory measurement (default 8)")
    p.add_argument("--wait-idle", type=float, metavar="SECONDS", help="wait for quiet before each model (default 120;"
                   " --quick 10)")
    p.add_argument("--quick", action="store_true", help="smoke check: tiny models (hidden 64, 4 layers), 16 x 16 "
                   "tokens, 2 timed steps per cell")
    args = p.parse_args(argv)
    args.models, args.schedules = args.models.split(","), args.schedules.split(",")
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
    log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)  # noqa: E731
    load = lambda: " / ".join(f"{x:.2f}" for x in os.getloadavg())  # noqa: E731
    log(f"# pipeline schedules, pp=2 on 2 processes x 1 thread, gloo, fp32, dropout 0, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs; load average at start {load()}")
    t_all, warnings, out_lines = time.perf_counter(), [], []
    for name in args.models:
        seq = args.seq or (16 if args.quick else DEFAULT_SEQ[name])
        config = model_config(name, args.quick, args.layers)
        log(f"\n## {name}: {describe(name, config, args.batch, seq)}")
        if rank == 0 and args.wait_idle > 0 and (busy := wait_idle(args.wait_idle, IDLE_CORES)) > IDLE_CORES:
            warnings.append(f"the machine was not idle ({busy:.2f} cores busy by other processes) before {name}")
            log(f"  WARNING: {warnings[-1]}")
        dist.barrier()
        log(f"  load average {load()}")
        batch = make_batch(config, args.batch, seq)
        results = {spr: bench_split(mesh, name, config, batch, spr, scheds, microbatches, args, log)
                   for spr in (1, 2) if (scheds := [s for s in args.schedules if STAGES_PER_RANK[s] == spr])}
        if rank == 0:
            out_lines += ["", *report(name, config, args.batch, seq, results, microbatches, args, warnings)]
    log("\n" + "\n".join(out_lines))
    for w in warnings:
        log(w if w.startswith("n/a") else f"WARNING: {w}")
    log(f"\nload average at end {load()}; total wall time {time.perf_counter() - t_all:.0f} s")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
