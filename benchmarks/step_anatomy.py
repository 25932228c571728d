"""Where a training step's time goes: the unsharded model, shardlib at a world of one, tp=2 and tp=2 + SP, side by
side (CPU), and the same layouts of a baseline checkout in the same rounds.

What is measured
----------------
One step per layout (``_anatomy_workload.MODES``) of ``--workload``:

* ``mlm`` (default): a ``BertForMaskedLM`` training step (forward, MLM loss on 15% labelled tokens, backward, AdamW)
  with HF's default dropout 0.1: a hand loop for the unsharded model, ``Trainer.train_step`` for shardlib's layouts;
* ``encoder``: ``BertModel`` forward + backward of ``last_hidden_state.pow(2).mean()``, dropout 0, no optimizer, a
  hand loop for every layout (``benchmarks/tp_throughput.py``'s workload: the layers alone).

The unsharded model and the world of one run on one process with both cores; tp=2 and tp=2 + Megatron SP on two
ranks of one thread each. All layouts start from the same weights and see the same batches. A mode named
``MODE@base`` runs the same layout with shardlib imported from ``--baseline`` (a ``git worktree`` of the commit
before a change), so before and after are timed in the same rounds.

1. **Step time**: every layout's ranks are started once and kept alive (``_rank_pool.RankPool``); ``--rounds``
   interleaved rounds (order reversed every other round) each time ``--steps`` steps of every layout (a step's time
   is the slowest rank's; a round's value is the median step). The table gives each layout's median over rounds with
   its range, and the median of the per-round ratios unsharded / layout (> 1: faster than unsharded) with their range;
   the same for the CPU time of all its ranks together (``time.process_time``: steadier on a shared machine, and
   a rank waiting in gloo costs little of it, so it measures the work a layout adds), and the minor page faults
   per step (each fresh large tensor is mapped and faulted in, ~10 us a page on this VM: one source of the spread).
2. **Anatomy**: ``--profile-steps`` steps of each layout under ``torch.profiler``, split into GEMMs, attention, the
   loss, element-wise, norms, casts/copies, collectives (including the time a rank waits in one), optimizer and host
   (whatever no op accounts for: Python, autograd bookkeeping, hooks, the profiler) in ms per step (rank 0 of a
   multi-rank layout). The profiler adds its own cost, so these rows explain the step; the wall times of (1) are the
   figures.

3. **Switched variants** (``--switch SET``, ``_step_variants.SETS``): one layout (the first of ``--modes``), its
   ranks started once, the set's variants of the code switched between consecutive steps (``--rounds`` pairs); each
   variant's median step and the median over pairs of variant / first variant with its quartiles. A pair of steps
   seconds apart sees the same neighbours, so this resolves a change of 2-3% that rounds minutes apart cannot.

4. **Peak of live tensors** (``--peak``, ``_long_sequence.py``): per rank, one step's tensors beyond the weights and
   their gradients. Long sequences: ``--layers``, ``--padding``, layouts ``sp*_a2a`` / ``sp*_ring`` (the ring's
   block compute, waits and one exchange alone are timed in its profiled steps).

5. **One GPU** (``--gpu``, ``_gpu_anatomy.py``): the world of one against the hand loops a user writes without
   shardlib, eager and compiled, bf16 and fp16, BERT-base MLM at 32 and 128 x 128, ViT-base and T5-base; step
   time per round, GPU kernel time, first-step (compile) time. Each case in its own process; ``--budget`` seconds
   after which no case starts (a device run's time is counted).

How to run
----------
    .venv/bin/python benchmarks/step_anatomy.py                 # BERT-base MLM, 8 x 128, 5 rounds (~10 min idle)
    .venv/bin/python benchmarks/step_anatomy.py --quick         # BERT-small (~2 min): make bench
    python benchmarks/step_anatomy.py --gpu --rounds 7 --steps 10 --budget 330 --json out.json   # one GPU, ~6 min
    .venv/bin/python benchmarks/step_anatomy.py --cpu-test --rounds 2 --steps 2   # --gpu's logic, tiny, on CPU
    .venv/bin/python benchmarks/step_anatomy.py --workload encoder --modes tp2_sp --switch reduce-scatter --rounds 12
    .venv/bin/python benchmarks/step_anatomy.py --workload encoder --modes unsharded,tp2@base,tp2 \
        --baseline /tmp/before                                   # after `git worktree add /tmp/before <commit>`
    .venv/bin/python benchmarks/step_anatomy.py --workload encoder --batch 1 --seq 4096 --layers 2 --padding 0.1 \
        --modes sp2_a2a,sp2_ring --base sp2_a2a     # ring against Ulysses; --modes unsharded,sp4_ring --peak --seq 8192
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _anatomy_workload as workload  # noqa: E402
import _long_sequence  # noqa: E402
from _harness import median_spread, print_table, write_json  # noqa: E402
from _rank_pool import RankPool  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="bert-base", choices=sorted(workload.SIZES))
    ap.add_argument("--modes", default=",".join(workload.DEFAULT_MODES), help="of: " + ", ".join(workload.MODES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, help="layers of the model (default: the size's)")
    ap.add_argument("--padding", type=float, default=0.0, help="fraction of every row the attention mask hides")
    ap.add_argument("--base", default="unsharded", help="the layout of the paired ratios base / layout")
    ap.add_argument("--peak", action="store_true", help="each layout's peak of live tensors in one step, per rank")
    ap.add_argument("--workload", default="mlm", choices=("mlm", "encoder"),
                    help="mlm: BertForMaskedLM training step (Trainer for shardlib); encoder: BertModel fwd+bwd")
    ap.add_argument("--dropout", type=float, default=None,
                    help="hidden and attention dropout (default: HF's 0.1 for mlm, 0 for encoder)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout per round (their median counts)")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="BERT-small (the anatomy in about a minute)")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--in-process", action="store_true",
                    help="the world of one only: unsharded hand loop, shardlib hand loop and Trainer in this process")
    ap.add_argument("--gpu", action="store_true",
                    help="one GPU: the world of one against hand loops, eager and compiled (_gpu_anatomy.CASES)")
    ap.add_argument("--cases", help="--gpu: comma-separated cases of _gpu_anatomy.CASES (default: the CUDA ones, in "
                                           "priority order; bert-small-b8-fp32-cpu is the CPU's world of one)")
    ap.add_argument("--budget", type=float, default=270, help="--gpu: seconds after which no new case starts")
    ap.add_argument("--cpu-test", action="store_true", help="--gpu's logic on the CPU with tiny models")
    ap.add_argument("--switch", help="a set of _step_variants.SETS: its variants switched step by step in the ranks of "
                    "the first of --modes (--rounds pairs)")
    ap.add_argument("--baseline", help="a checkout of the code before a change (git worktree add DIR COMMIT): modes "
                                       "named MODE@base run it, in the same rounds as this checkout's")
    args = ap.parse_args(argv)
    args.size = "bert-small" if args.quick else args.size
    if args.dropout is None:
        args.dropout = 0.1 if args.workload == "mlm" else 0.0
    modes = args.modes.split(",")
    if args.switch:
        return switched(args, modes[0])
    if any("@" in m for m in modes) and not args.baseline:
        ap.error("a mode@baseline needs --baseline CHECKOUT")
    unknown = [m for m in modes if m.partition("@")[0] not in workload.MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; known: {', '.join(workload.MODES)}")
    started = time.perf_counter()
    if args.in_process:
        return in_process(args)
    if args.gpu or args.cpu_test:
        return gpu(args)
    what = "BertForMaskedLM training step (AdamW)" if args.workload == "mlm" else "BertModel forward + backward"
    print(f"step anatomy: {what}, {args.size}, batch {args.batch} x {args.seq}, dropout {args.dropout}; "
          f"{args.rounds} interleaved rounds of {args.steps} steps", flush=True)
    pools = {}
    try:
        for mode in modes:
            name, _, baseline = mode.partition("@")
            setup = functools.partial(workload.setup, mode=name, size=args.size, batch=args.batch, seq=args.seq,
                                      dropout=args.dropout, workload=args.workload, layers=args.layers,
                                      padding=args.padding)
            with checkout(args.baseline if baseline else None):
                pools[mode] = RankPool(workload.MODES[name][0], setup, workload.serve)
        seconds, cpu, faults = ({m: [] for m in modes} for _ in range(3))
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                wall, cpu_s, minor = pools[mode].call("time", steps=args.steps)[0]
                seconds[mode].append(wall)
                cpu[mode].append(cpu_s)
                faults[mode].append(minor)
            print(f"  round {r + 1}: " + ", ".join(f"{m} {seconds[m][-1] * 1e3:.0f} ms" for m in modes), flush=True)
        anatomy = {m: pools[m].call("profile", steps=args.profile_steps)[0] for m in modes if args.profile_steps}
        peaks = {m: pools[m].call("peak") for m in modes} if args.peak else {}
    finally:
        for pool in pools.values():
            pool.close()
    report(modes, seconds, cpu, faults, anatomy, args)
    if peaks:
        _long_sequence.peak_rows(modes, peaks, title, args.base)
    if args.json:
        write_json(args.json, {"args": vars(args), "seconds": seconds, "cpu_seconds": cpu, "minor_faults": faults,
                               "anatomy_ms": anatomy, "peaks": peaks})
    print(f"total wall time {time.perf_counter() - started:.0f} s")


def switched(args, mode: str) -> None:
    """``--switch``: the variants of one set alternated step by step in the same ranks (module docstring, 3)."""
    import statistics

    import _step_variants

    if args.switch not in _step_variants.SETS:
        raise SystemExit(f"unknown --switch {args.switch!r}; known: {', '.join(_step_variants.SETS)}")
    print(f"switched variants {args.switch!r}: {mode}, {args.workload}, {args.size}, batch {args.batch} x {args.seq};"
          f" {args.rounds} pairs of steps", flush=True)
    setup = functools.partial(workload.setup, mode=mode, size=args.size, batch=args.batch, seq=args.seq,
                              dropout=args.dropout, workload=args.workload)
    pool = RankPool(workload.MODES[mode][0], setup, workload.serve)
    try:
        seconds = pool.call("switch", steps=args.rounds, variants=args.switch)[0]
    finally:
        pool.close()
    names = list(seconds)
    rows = []
    for name in names:
        ratios = [a / b for a, b in zip(seconds[name], seconds[names[0]])]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        rows.append([name, "%.0f [%.0f-%.0f]" % tuple(1e3 * v for v in median_spread(seconds[name])),
                     f"{statistics.median(ratios):.3f} [{quartiles[0]:.3f}-{quartiles[2]:.3f}]"])
    print_table(None, ["variant", "wall ms / step [range]", f"/ {names[0]}, per pair: median [quartiles]"], rows)
    if args.json:
        write_json(args.json, {"args": vars(args), "seconds": seconds})


def in_process(args) -> None:
    """``--in-process``: the world-of-one variants timed in this process, interleaved; wall and CPU per step."""
    import shardlib

    shardlib.init_mesh()
    steps = workload.in_process_steps(args.size, args.batch, args.seq, args.dropout)
    seconds, cpu = {m: [] for m in steps}, {m: [] for m in steps}
    names = list(steps)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                steps[name].run()
            seconds[name].append((time.perf_counter() - start) / args.steps)
            cpu[name].append((time.process_time() - cpu0) / args.steps)
        print(f"  round {r + 1}: " + ", ".join(f"{m} {seconds[m][-1] * 1e3:.1f} ms" for m in names), flush=True)
    rows = []
    for m in names:
        diff = [(s - b) * 1e3 for s, b in zip(seconds[m], seconds["unsharded"])]
        rows.append([workload.IN_PROCESS_TITLES[m], _spread(seconds[m], 1e3, ".1f"), _spread(cpu[m], 1e3, ".1f"),
                     _spread([b / s for b, s in zip(seconds["unsharded"], seconds[m])], 1, ".3f"),
                     _spread(diff, 1, "+.2f")])
    print_table(f"One process, {args.size} {args.batch} x {args.seq} (median of {args.rounds} rounds of {args.steps} "
                "steps [range])", ["variant", "wall ms / step", "CPU ms / step", "unsharded / variant (paired)",
                                   "ms / step more than unsharded (paired)"], rows)
    if args.json:
        write_json(args.json, {"args": vars(args), "seconds": seconds, "cpu_seconds": cpu})


def gpu(args) -> None:
    """``--gpu``: each case of ``_gpu_anatomy.CASES`` in its own process, until ``--budget`` seconds have passed."""
    import json
    import subprocess
    import tempfile

    import _gpu_anatomy

    cases = args.cases.split(",") if args.cases else [c for c, spec in _gpu_anatomy.CASES.items() if spec[-1] == "cuda"]
    started, results = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            left = args.budget - (time.perf_counter() - started)
            if left < 20:
                print(f"{case}: skipped, the budget of {args.budget:.0f} s is spent", flush=True)
                continue
            out = Path(tmp) / f"{case}.json"
            command = [sys.executable, str(Path(__file__).with_name("_gpu_anatomy.py")), case, str(out),
                       str(args.rounds), str(args.steps)] + (["--cpu-test"] if args.cpu_test else [])
            try:
                done = subprocess.run(command, timeout=left + 60).returncode
            except subprocess.TimeoutExpired:
                done = "timed out"
            if done != 0 or not out.exists():
                print(f"{case}: FAILED ({done})", flush=True)
                continue
            results.append(json.loads(out.read_text()))
            print_table(f"{case} so far", _gpu_anatomy.SUMMARY_HEADER, _gpu_anatomy.summary_rows(results[-1:]))
            if args.json:  # after every case: a run cut short keeps what it measured
                write_json(args.json, {"args": vars(args), "cases": results})
    print_table(f"World of one: hand loop / Trainer (median of {args.rounds} rounds of {args.steps} steps)",
                _gpu_anatomy.SUMMARY_HEADER, _gpu_anatomy.summary_rows(results))


@contextlib.contextmanager
def checkout(path: str | None):
    """Ranks spawned inside the block import shardlib from ``path`` (``_checkout.py``), else from this one."""
    before = os.environ.get("SHARDLIB_CHECKOUT")
    if path:
        os.environ["SHARDLIB_CHECKOUT"] = str(Path(path).resolve())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SHARDLIB_CHECKOUT", None)
        else:
            os.environ["SHARDLIB_CHECKOUT"] = before


def title(mode: str) -> str:
    name, _, baseline = mode.partition("@")
    return workload.TITLES[name] + (f" ({baseline})" if baseline else "")


def report(modes: list[str], seconds: dict, cpu: dict, faults: dict, anatomy: dict, args) -> None:
    base, base_cpu, tokens = seconds.get(args.base), cpu.get(args.base), args.batch * args.seq
    rows = []
    for m in modes if args.rounds else ():
        row = [title(m), _spread(seconds[m], 1e3, ".0f"), _spread([tokens / s for s in seconds[m]], 1, ".0f"),
               _spread(cpu[m], 1e3, ".0f"), _spread(faults[m], 1e-3, ".1f")]
        if base is not None:
            row += [_spread([b / s for b, s in zip(base, seconds[m])], 1, ".3f"),
                    _spread([b / s for b, s in zip(base_cpu, cpu[m])], 1, ".3f")]
        rows.append(row)
    header = ["layout", "wall ms / step", "tokens / s", "CPU ms / step (all ranks)", "k page faults / step (all ranks)"]
    if rows:
        print_table("Step time (median of rounds [range])", header + (
            [f"{args.base} / layout, wall (paired)", f"{args.base} / layout, CPU (paired)"] if base else []), rows)
    if not anatomy:
        return
    header = ["ms / step (profiled)"] + [title(m) for m in modes]
    rows = [[c] + [f"{anatomy[m][c]:.0f}" for m in modes] for c in workload.ORDER]
    rows.append(["**profiled wall**"] + [f"**{anatomy[m]['wall_ms']:.0f}**" for m in modes])
    print_table("Anatomy (torch.profiler, self time per category, rank 0)", header, rows)
    _long_sequence.ring_rows(modes, anatomy, title)


def _spread(values, scale: float, fmt: str) -> str:
    med, lo, hi = median_spread(values)
    return f"{med * scale:{fmt}} [{lo * scale:{fmt}}-{hi * scale:{fmt}}]"


if __name__ == "__main__":
    main()
