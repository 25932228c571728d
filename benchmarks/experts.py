"""Expert parallelism against data parallelism with replicated experts, on CPU: a Switch-base-8-wide model (2 + 2
layers, one MoE layer of 8 experts per stack), fp32, AdamW by ``Trainer.train_step``, the same global batch in every
layout. 1. bytes per rank of the experts' parameters + AdamW state (ep=4 against dp=4); 2. train_step throughput in
interleaved rounds of persistent rank pools (ep=2 against dp=2, and ep=2's static capacity against its dropless
exchange); 3. where the ep step's time goes (its all-to-alls, timed where the step waits and replayed alone) against
the dp step's gradient all-reduce. Docs: docs/benchmarks/experts.md.

A script of its own rather than a flag on an existing workload: those build BERT, ViT and T5 (step_anatomy.py,
zero_memory.py), and neither their models nor their measures (profiled op categories, ZeRO buckets) answer what a
mixture of experts asks: what its experts cost per rank and what moving its tokens costs.

    .venv/bin/python benchmarks/experts.py --json docs/data/experts_switch8_cpu_run1.json   # all three (~4 min idle)
    .venv/bin/python benchmarks/experts.py --parts bytes                        # 1. only (~1 min)
    .venv/bin/python benchmarks/experts.py --parts time,anatomy --rounds 7      # 2. and 3. only
    .venv/bin/python benchmarks/experts.py --quick                              # smoke run, tiny widths (make bench)
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _experts_workload as workload  # noqa: E402
from _harness import median_spread, paired_ratio, print_closing, print_table, wait_idle, write_json  # noqa: E402
from _rank_pool import RankPool  # noqa: E402

BYTES_TARGET, SPEED_TARGET = 0.27, 0.9  # ep=4 / dp=4 expert bytes per rank (at most); ep=2 / dp=2 tokens/s (at least)
IDLE_CORES = 0.1
MIB = 2 ** 20


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: d_model 64, d_ff 256, vocab 1000, 32 + 8 tokens, "
                                                        "2 rounds")
    p.add_argument("--parts", default="bytes,time,anatomy", help="comma-separated from bytes, time, anatomy")
    p.add_argument("--batch", type=int, default=8, help="global batch, sequences (default 8)")
    p.add_argument("--input-len", type=int, help="encoder tokens per sequence (default 128; --quick 32)")
    p.add_argument("--label-len", type=int, help="decoder tokens (labels) per sequence (default 32; --quick 8)")
    p.add_argument("--vocab", type=int, help="vocabulary (default 32128; --quick 1000)")
    p.add_argument("--router-capacity", type=int, help="Switch's own expert_capacity, tokens per expert and sequence "
                                                       "(default 64; --quick 16)")
    p.add_argument("--capacity", type=float, help="ep2_static's shard(expert_capacity=c): each rank sends every "
                   "expert ceil(c * tokens / experts) rows (default: the smallest c, to 0.1, that drops nothing on "
                   "these batches, read from the routers of the dp2 / ep2 pools' warm-up steps)")
    p.add_argument("--lr", type=float, default=0.0, help="AdamW's lr (default 0: the weights, so the routing, stay "
                   "the same in every round; the step does the same work)")
    p.add_argument("--rounds", type=int, help="interleaved rounds of part 2 (default 5; --quick 2)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per layout and round (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="steps when a pool starts (DDP is built at the second)")
    p.add_argument("--anatomy-steps", type=int, default=2, help="part 3: instrumented steps per layout (default 2)")
    p.add_argument("--wait-idle", type=float, help="seconds to wait for quiet before each window (default 5; "
                                                   "--quick 0)")
    p.add_argument("--busy-cores", type=float, default=0.3, help="part 2: a round with a window in which other "
                   "processes used more cores than this is run again (default 0.3)")
    p.add_argument("--retries", type=int, help="part 2: rounds run again at most (default 2 x --rounds; --quick 0)")
    p.add_argument("--json", help="write every measurement here")
    args = p.parse_args(argv)
    args.parts = args.parts.split(",")
    if set(args.parts) - {"bytes", "time", "anatomy"}:
        p.error(f"unknown parts {sorted(set(args.parts) - {'bytes', 'time', 'anatomy'})}")
    if args.batch % 4:
        p.error("--batch must divide by 4 (dp=4 in part 1)")
    q = args.quick
    args.input_len = args.input_len or (32 if q else 128)
    args.label_len = args.label_len or (8 if q else 32)
    args.rounds = args.rounds or (2 if q else 5)
    args.retries = args.retries if args.retries is not None else (0 if q else 2 * args.rounds)
    args.wait_idle = args.wait_idle if args.wait_idle is not None else (0.0 if q else 5.0)
    base = workload.QUICK if q else workload.MODEL
    args.model = dict(base, vocab_size=args.vocab or base["vocab_size"],
                      expert_capacity=args.router_capacity or base["expert_capacity"])
    return args


def spread(values, scale: float = 1.0, fmt: str = ".0f") -> str:
    med, lo, hi = median_spread(values)
    return f"{med * scale:{fmt}} [{lo * scale:{fmt}}-{hi * scale:{fmt}}]"


class Pools:
    """The layouts' rank pools, started on demand; a layout whose pool fails is reported and left out."""

    def __init__(self, args, warnings: list):
        self.args, self.warnings, self.pools, self.failed, self.started_s = args, warnings, {}, {}, {}

    def get(self, layout: str, warmup: int | None = None) -> RankPool | None:
        if layout in self.pools or layout in self.failed:
            return self.pools.get(layout)
        a = self.args
        setup = functools.partial(workload.setup, layout=layout, model=a.model, batch=a.batch, input_len=a.input_len,
                                  label_len=a.label_len, capacity=a.capacity, lr=a.lr, batches=2,
                                  warmup=a.warmup if warmup is None else warmup)
        t0 = time.perf_counter()
        try:
            self.pools[layout] = RankPool(workload.LAYOUTS[layout][0], setup, workload.serve, timeout_s=900)
        except (RuntimeError, TimeoutError) as exc:
            self.fail(layout, exc)
            return None
        self.started_s[layout] = time.perf_counter() - t0
        print(f"  {layout}: started in {self.started_s[layout]:.0f} s (spawn, build, warm-up)", flush=True)
        return self.pools[layout]

    def call(self, layout: str, command: str, **kwargs):
        pool = self.get(layout)
        if pool is None:
            return None
        try:
            return pool.call(command, **kwargs)
        except (RuntimeError, TimeoutError, EOFError, OSError) as exc:
            self.fail(layout, exc)
            return None

    def fail(self, layout: str, exc: BaseException) -> None:
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        self.failed[layout] = lines[-1] if lines else type(exc).__name__
        self.warnings.append(f"{layout} failed: {self.failed[layout]}")
        print(f"  FAILED {layout}: {self.failed[layout]}", flush=True)
        pool = self.pools.pop(layout, None)
        if pool is not None:
            pool.close()

    def close(self, layout: str | None = None) -> None:
        for name in [layout] if layout else list(self.pools):
            pool = self.pools.pop(name, None)
            if pool is not None:
                pool.close()


def part_bytes(args, pools: Pools, summary: list) -> dict:
    """1. One step at dp=4 and at ep=4 (one pool after the other), each rank's bytes after it."""
    out = {}
    for layout in ("dp4", "ep4"):
        ranks = pools.call(layout, "bytes") if pools.get(layout, warmup=1) else None
        if ranks:
            out[layout] = {"ranks": ranks, "routing": pools.call(layout, "routing")}
        pools.close(layout)
    rows, base = [], out.get("dp4")
    for layout, res in out.items():
        top = {k: max(r[k] for r in res["ranks"]) for k in res["ranks"][0]}
        experts, everything = top["expert_param"] + top["expert_opt"], top["param"] + top["opt"]
        row = [workload.TITLES[layout], f"{top['expert_param'] / MIB:,.1f}", f"{top['expert_opt'] / MIB:,.1f}",
               f"{experts / MIB:,.1f}", "", f"{everything / MIB:,.1f}", "", f"{top['peak_rss'] / MIB:,.0f}"]
        if base:
            b = {k: max(r[k] for r in base["ranks"]) for k in base["ranks"][0]}
            res["expert_ratio"] = (top["expert_param"] + top["expert_opt"]) / (b["expert_param"] + b["expert_opt"])
            res["total_ratio"] = (top["param"] + top["opt"]) / (b["param"] + b["opt"])
            row[4], row[6] = f"{res['expert_ratio']:.3f}x", f"{res['total_ratio']:.3f}x"
        rows.append(row)
    print_table("1. Bytes per rank after one train_step (MiB, the largest rank; ratio: layout / dp=4)",
                ["layout", "expert params", "their AdamW state", "experts: params + state", "ratio",
                 "all params + AdamW state", "ratio", "peak RSS of a rank"], rows)
    if "ep4" in out and "expert_ratio" in out["ep4"]:
        r = out["ep4"]
        summary.append(f"1. experts' params + AdamW state per rank, ep=4 / dp=4: {r['expert_ratio']:.3f}x (target <= "
                       f"{BYTES_TARGET}x: {'met' if r['expert_ratio'] <= BYTES_TARGET else 'MISSED'}); all params + "
                       f"state {r['total_ratio']:.3f}x")
    return out


def part_time(args, pools: Pools, layouts: list[str], warnings: list, summary: list) -> dict:
    """2. ``args.rounds`` interleaved rounds (ABBA order) of one window of ``args.steps`` steps per layout; a round in
    which other processes used more than ``--busy-cores`` in some window is run again, up to ``--retries`` times in
    all (the discarded rounds are kept in the JSON)."""
    records, discarded, retries = {m: [] for m in layouts}, [], args.retries
    r = 0
    while r < args.rounds:
        got = {}
        for layout in layouts if r % 2 == 0 else layouts[::-1]:
            if layout in pools.failed:
                continue
            if args.wait_idle > 0:
                wait_idle(args.wait_idle, IDLE_CORES)
            res = pools.call(layout, "time", steps=args.steps)
            if res:
                got[layout] = res[0]
        line = ", ".join(f"{m} {got[m]['step_s']:.2f} s (others {got[m]['foreign_cores']:.2f} cores)"
                         for m in layouts if m in got)
        if got and max(x["foreign_cores"] for x in got.values()) > args.busy_cores and retries > 0:
            retries -= 1
            discarded.append(dict(got, round=r))
            print(f"  round {r + 1}: {line}: busy, again ({retries} retries left)", flush=True)
            continue
        for layout, value in got.items():
            records[layout].append(value)
        print(f"  round {r + 1}: {line}", flush=True)
        r += 1
    if discarded:
        warnings.append(f"{len(discarded)} round(s) run again: other processes used more than {args.busy_cores} "
                        "cores in them")
    tokens = args.batch * (args.input_len + args.label_len)
    pairs = {"ep2": "dp2", "ep2_static": "ep2"}
    rows = []
    for layout in layouts:
        rec = records[layout]
        if not rec:
            rows.append([workload.TITLES[layout], f"failed: {pools.failed.get(layout, '?')}", "", "", "", ""])
            continue
        base = pairs.get(layout)
        ratio = ""
        if base and len(records.get(base, [])) == len(rec):
            med, lo, hi = paired_ratio([records[base][i]["step_s"] for i in range(len(rec))],
                                       [x["step_s"] for x in rec])
            ratio = f"{med:.3f} [{lo:.3f}-{hi:.3f}] vs {base}"
            target = f" (target >= {SPEED_TARGET}x: {'met' if med >= SPEED_TARGET else 'MISSED'})" \
                if layout == "ep2" else ""
            summary.append(f"2. tokens/s, {layout} / {base}: {med:.3f}x [{lo:.3f}-{hi:.3f}] over {len(rec)} rounds"
                           f"{target}")
        rows.append([workload.TITLES[layout], spread([x["step_s"] for x in rec], 1e3),
                     spread([tokens / x["step_s"] for x in rec]), spread([x["cpu_s"] for x in rec], 1e3), ratio,
                     spread([x["foreign_cores"] for x in rec], 1, ".2f")])
        busy = [x["foreign_cores"] for x in rec if x["foreign_cores"] > args.busy_cores]
        if busy:
            warnings.append(f"{layout}: other processes used {max(busy):.2f} cores in {len(busy)} of {len(rec)} "
                            "windows")
    records["discarded_rounds"] = discarded
    print_table(f"2. train_step, {tokens} tokens per step (input + labels), median of {args.rounds} interleaved "
                f"rounds of {args.steps} steps [range]",
                ["layout", "ms / step", "tokens / s", "CPU ms / step (all ranks)", "tokens/s ratio (paired)",
                 "other processes, cores"], rows)
    return records


def part_anatomy(args, pools: Pools, layouts: list[str], summary: list) -> dict:
    """3. Per layout, ``args.anatomy_steps`` steps under ``workload.Collectives`` (every rank's figures)."""
    out = {}
    for layout in layouts:
        res = pools.call(layout, "anatomy", steps=args.anatomy_steps)
        if res:
            out[layout] = res
    kinds = sorted({k for res in out.values() for r in res for k in r["kinds"]})
    rows = []
    for kind in kinds:
        row = [kind]
        for layout in out:
            per_rank = [r["kinds"].get(kind) for r in out[layout]]
            row.append(" / ".join("-" if k is None else f"{k['ms']:.0f} ({k['calls']:.0f}, {k['mib_sent']:.1f} MiB)"
                                  for k in per_rank))
        rows.append(row)
    rows.append(["**step (slowest rank)**"] + [f"**{res[0]['step_ms']:.0f}**" for res in out.values()])
    alone = sorted({k for res in out.values() for r in res for k in r["alone_ms"]})
    rows += [[f"{k}, replayed alone"] + [" / ".join(f"{r['alone_ms'][k]:.0f}" if k in r["alone_ms"] else "-"
                                                     for r in res) for res in out.values()] for k in alone]
    # the static exchange's received rows include its padding, which eager experts skip (they compute the filled
    # slots: as many as dropless receives)
    rows.append(["rows the rank's experts received (fwd)"] + [
        " / ".join(f"{r['rows_received_fwd']:.0f}" for r in res) if workload.LAYOUTS[m][1] > 1 else "all its tokens'"
        for m, res in out.items()])
    print_table(f"3. Collectives per step, ms (calls, MiB sent to other ranks), rank 0 / rank 1; mean of "
                f"{args.anatomy_steps} steps", ["collective"] + [workload.TITLES[m] for m in out], rows)
    for layout, res in out.items():
        line = f"3. {layout}: step {res[0]['step_ms']:.0f} ms; "
        if workload.LAYOUTS[layout][1] > 1:
            rows = " / ".join(f"{r['rows_received_fwd']:.0f}" for r in res)
            line += (f"all-to-alls {_ms(res, 'a2a')} ms on rank {' / '.join(map(str, range(len(res))))} (replayed "
                     f"alone {_ms(res, 'a2a', 'alone_ms')} ms; rows its experts received {rows}); ")
        line += (f"gradient all-reduce it waits for {_ms(res, 'all-reduce gradients (blocking)')} ms after backward "
                 f"+ {_ms(res, 'DDP wait')} ms DDP tail (in flight {_ms(res, 'all-reduce gradients (DDP')} ms; "
                 f"replayed alone {_ms(res, 'all-reduce gradients', 'alone_ms')} ms); AdamW {_ms(res, 'AdamW')} ms")
        summary.append(line)
    return out


def _ms(ranks: list[dict], prefix: str, source: str = "kinds") -> str:
    """Each rank's ms per step in the kinds of collective whose name starts with ``prefix``, as "rank 0 / rank 1"."""
    def total(r: dict) -> float:
        return sum(v["ms"] if source == "kinds" else v for k, v in r[source].items() if k.startswith(prefix))
    return " / ".join(f"{total(r):.0f}" for r in ranks)


def capacity_dropping_nothing(pools: Pools, layouts: list[str]) -> float:
    """The smallest static capacity factor (to 0.1) that drops nothing on the batches the pools' routers saw (the
    largest share of a rank's tokens one expert got, times the experts); the weights do not change at lr 0, so
    neither does the routing."""
    for layout in layouts:
        ranks = pools.call(layout, "routing")
        if ranks:
            needed = max(r["factor_dropping_nothing"] for r in ranks)
            factor = math.ceil(needed * 10 - 1e-9) / 10
            share = needed / pools.args.model["num_experts"]
            print(f"  static capacity factor {factor:g}: one expert got up to {share:.1%} of a rank's tokens in a "
                  f"layer ({layout}'s routers)", flush=True)
            return factor
    return float(pools.args.model["num_experts"])


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    import transformers

    started, warnings, summary = time.perf_counter(), [], []
    counts = workload.layout_parameters("dp2", args.model)
    m = args.model
    print(f"# experts: SwitchTransformersForConditionalGeneration d_model {m['d_model']}, d_ff {m['d_ff']}, "
          f"{m['num_experts']} experts, {m['num_layers']} + {m['num_decoder_layers']} layers (MoE every 2nd), vocab "
          f"{m['vocab_size']}, router capacity {m['expert_capacity']} tokens per expert and sequence; "
          f"{counts['total'] / 1e6:.1f} M parameters ({counts['experts'] / 1e6:.1f} M in experts); fp32, AdamW lr "
          f"{args.lr:g}; global batch {args.batch} x ({args.input_len} + {args.label_len}) tokens; torch "
          f"{torch.__version__}, transformers {transformers.__version__}, "
          f"{os.cpu_count()} CPUs, gloo; load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}"
          f"{'; QUICK' if args.quick else ''}", flush=True)
    pools = Pools(args, warnings)
    result = {"args": vars(args), "parameters": counts, "load_average_start": os.getloadavg(),
              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
                          "backend": "gloo"}}
    try:
        if "bytes" in args.parts:
            print("\npart 1: bytes at dp=4 and ep=4", flush=True)
            result["bytes"] = part_bytes(args, pools, summary)
        layouts = ["dp2", "ep2", "ep2_static"]
        if {"time", "anatomy"} & set(args.parts):
            print("\nparts 2-3: dp=2 and ep=2 pools", flush=True)
            for layout in layouts[:2]:
                pools.get(layout)
            if args.capacity is None:
                args.capacity = capacity_dropping_nothing(pools, layouts[:2])
            pools.get(layouts[2])
            result["started_s"] = pools.started_s
        if "time" in args.parts:
            result["time"] = part_time(args, pools, layouts, warnings, summary)
        if "anatomy" in args.parts:
            result["anatomy"] = part_anatomy(args, pools, layouts, summary)
        result["routing"] = {m: pools.call(m, "routing") for m in layouts if m in pools.pools}
    finally:
        pools.close()
    for layout, ranks in result.get("routing", {}).items():
        if ranks:
            kept, routed = sum(r["router_kept"] for r in ranks), sum(r["router_tokens"] for r in ranks)
            pairs, dropped = sum(r["exchange_pairs"] for r in ranks), sum(r["capacity_dropped"] for r in ranks)
            line = f"{layout}: Switch's routers kept {kept / max(routed, 1):.1%} of {routed} tokens"
            print(line + (f"; the static capacity dropped {dropped:.0f} of {pairs:.0f} pairs" if pairs else ""))
    result["failed"], result["summary"], result["warnings"] = pools.failed, summary, warnings
    result["load_average_end"] = os.getloadavg()
    if args.json:
        write_json(args.json, result)
    print_closing(summary, warnings, started)
    return 1 if pools.failed else 0


if __name__ == "__main__":
    sys.exit(main())
