"""Where a training step's time goes, by layout (``_anatomy_workload.MODES``: unsharded, world of one, tp=2 +- SP, sp,
dp/ZeRO, compiled, fit; ``--gpu``: one GPU): step time in interleaved rounds of persistent rank pools, the profiled
anatomy, switched variants, peaks of live tensors, a baseline checkout's layouts in the same rounds; ``--lengths``:
packed against padded batches of real datasets' sample lengths, real tokens / s. Docs:
docs/benchmarks/tensor-parallel.md (also long-sequences.md, one-gpu.md, kernels-and-compile.md, training-runs.md).

    .venv/bin/python benchmarks/step_anatomy.py                 # BERT-base MLM, 8 x 128, 5 rounds (~10 min idle)
    .venv/bin/python benchmarks/step_anatomy.py --quick         # BERT-small (~2 min): make bench
    .venv/bin/python benchmarks/step_anatomy.py --throughput [--quick]    # tp throughput, BERT / ViT / T5
    .venv/bin/python benchmarks/step_anatomy.py --throughput --size bert-base,vit-base,t5-base \
        --modes unsharded,unsharded_compiled,tp2,tp2_compiled --steps 6     # eager vs compiled
    .venv/bin/python benchmarks/step_anatomy.py --size bert-small --batch 16 --steps 30 --rounds 3 \
        --modes tp2_loop,tp2_fit --base tp2_loop --profile-steps 0         # Trainer.fit overhead
    .venv/bin/python benchmarks/step_anatomy.py --workload encoder --modes unsharded,tp2,tp2_sp --fresh --steps 4
    .venv/bin/python benchmarks/step_anatomy.py --in-process    # the world of one's variants in one process
    python benchmarks/step_anatomy.py --gpu --rounds 7 --steps 10 --budget 330 --json out.json   # one GPU, ~6 min
    .venv/bin/python benchmarks/step_anatomy.py --cpu-test --rounds 2 --steps 2   # --gpu's logic, tiny, on CPU
    .venv/bin/python benchmarks/step_anatomy.py --workload encoder --modes tp2_sp --switch reduce-scatter --rounds 12
    .venv/bin/python benchmarks/step_anatomy.py --workload encoder --modes unsharded,tp2@base,tp2 \
        --baseline /tmp/before                                   # after `git worktree add /tmp/before <commit>`
    .venv/bin/python benchmarks/step_anatomy.py --workload encoder --batch 1 --seq 4096 --layers 2 --padding 0.1 \
        --modes sp2_a2a,sp2_ring --base sp2_a2a     # ring against Ulysses; --modes unsharded,sp4_ring --peak --seq 8192
    .venv/bin/python benchmarks/step_anatomy.py --workload encoder --size bert-256 --batch 1 --seq 4096,8192,16384 \
        --padding 0,0.1 --modes world1,world1_blocks,world1_docs,world1_blocks_docs --peak --rounds 0 \
        --profile-steps 0     # masks as data: peaks by length, unmasked, padded, 8 packed documents (~6 min)
    .venv/bin/python benchmarks/step_anatomy.py --lengths sst2 --peak --batch 32 --steps 2 \
        --modes world1_padded,world1_longest,world1_packed    # packed vs padded, BERT-base, SST-2 lengths (~5 min);
        # tp2_padded,tp2_longest,tp2_packed for tp=2: one layout per run (docs/benchmarks/packing.md)
    .venv/bin/python benchmarks/step_anatomy.py --lengths sst2 --quick   # all six, BERT-tiny, 2 rounds (make bench)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _anatomy_measure as measure  # noqa: E402
import _anatomy_report as report  # noqa: E402
import _anatomy_workload as workload  # noqa: E402
from _harness import print_table, wait_idle, write_json  # noqa: E402
from _rank_pool import RankPool  # noqa: E402

#: --throughput: timed steps per size (one round; tp_throughput.py's), the sizes, the layouts
THROUGHPUT_STEPS = {"bert-small": 20, "bert-base": 12, "vit-small": 20, "vit-base": 8, "t5-small": 12, "t5-base": 6,
                    "bert-tiny": 5, "vit-tiny": 5, "t5-tiny": 5}
THROUGHPUT = ("bert-small,bert-base,vit-base,t5-base", "bert-tiny,vit-tiny,t5-tiny", "unsharded,tp2,tp2_sp,sp2_a2a")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", help="comma-separated of: " + ", ".join(workload.SIZES) + " (default bert-base; "
                    "--quick bert-small)")
    ap.add_argument("--modes", help="of: " + ", ".join(workload.MODES) + " (default "
                    + ",".join(workload.DEFAULT_MODES) + ")")
    ap.add_argument("--batch", type=int, help="samples per step (default 8; --lengths 64)")
    ap.add_argument("--seq", help="tokens per sequence, comma-separated for a sweep (default 128; --throughput "
                    "--quick 32)")
    ap.add_argument("--layers", type=int, help="layers of the model (default: the size's)")
    ap.add_argument("--padding", default="0", help="fraction of every row the attention mask hides, comma-separated "
                    "for a sweep (each length at each padding; with --peak a table of peaks by length)")
    ap.add_argument("--documents", type=int, help="the rows of the modes named MODE_docs (encoder workload, sharded "
                    "layouts) packed as N equal documents (document_ids, accept_documents; default 8)")
    ap.add_argument("--base", default="unsharded", help="the layout of the paired ratios base / layout")
    ap.add_argument("--peak", action="store_true", help="each layout's peak of live tensors in one step, per rank")
    ap.add_argument("--workload", choices=("mlm", "encoder", "cls"), help="mlm: BertForMaskedLM training step "
                    "(Trainer for shardlib; the default for BERT); encoder: the bare model's fwd+bwd (BERT, ViT, T5); "
                    "cls: BertForSequenceClassification training step (Trainer), what --lengths runs")
    ap.add_argument("--lengths", choices=tuple(workload.LENGTHS), help="samples as long as a real dataset's "
                    "(docs/data/sst2_train_token_lengths.json), each batch form a mode (" + ", ".join(
                        workload.LENGTH_MODES) + "; _packed_fixed): real tokens / s, packed / padded")
    ap.add_argument("--dropout", type=float, help="hidden and attention dropout (default: 0.1 for mlm, 0 for encoder)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 5; --throughput 1)")
    ap.add_argument("--steps", type=int, help="timed steps per layout and round (default 3; --throughput 20/12/8/6)")
    ap.add_argument("--profile-steps", type=int, help="profiled steps per layout (default 2; --throughput 0)")
    ap.add_argument("--wait-idle", type=float, help="seconds to wait for quiet before each layout (--throughput 60)")
    ap.add_argument("--quick", action="store_true", help="BERT-small (--throughput: tiny BERT, ViT, T5, 3 steps; "
                    "--lengths: BERT-tiny, 2 rounds)")
    ap.add_argument("--throughput", action="store_true", help="tp throughput: the encoder workload of BERT, ViT, T5 at "
                    "4 layouts, one round, no profile, waiting for quiet")
    ap.add_argument("--warmup", type=int, default=2, help="steps a layout's ranks run before any measurement "
                    "(default 2; --lengths: at least each batch once)")
    ap.add_argument("--fresh", action="store_true", help="new ranks per layout and round, one warm-up step")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--in-process", action="store_true", help="the world of one's variants in this one process")
    ap.add_argument("--gpu", action="store_true", help="one GPU: the world of one against hand loops (_gpu_anatomy)")
    ap.add_argument("--cases", help="--gpu: comma-separated cases of _gpu_anatomy.CASES (default: the CUDA ones, in "
                                    "priority order; bert-small-b8-fp32-cpu is the CPU's world of one)")
    ap.add_argument("--budget", type=float, default=270, help="--gpu: seconds after which no new case starts")
    ap.add_argument("--cpu-test", action="store_true", help="--gpu's logic on the CPU with tiny models")
    ap.add_argument("--switch", help="a set of _step_variants.SETS switched step by step (first of --modes)")
    ap.add_argument("--baseline", help="a checkout of the code before a change (git worktree add DIR COMMIT): modes "
                                       "named MODE@base run it, in the same rounds as this checkout's")
    args = ap.parse_args(argv)
    tp, quick, lengths = args.throughput, args.quick, args.lengths
    args.size = args.size or (THROUGHPUT[1 if quick else 0] if tp else "bert-tiny" if quick and lengths
                              else "bert-small" if quick else "bert-base")
    args.sizes = args.size.split(",")
    args.modes = (args.modes or (THROUGHPUT[2] if tp else ",".join(workload.LENGTH_MODES if lengths
                                                                    else workload.DEFAULT_MODES))).split(",")
    args.batch = args.batch or (64 if lengths else 8)
    args.seqs = [int(n) for n in (args.seq or str(32 if tp and quick else 128)).split(",")]
    args.paddings = [float(f) for f in args.padding.split(",")]
    args.seq, args.padding = args.seqs[0], args.paddings[0]
    args.rounds = args.rounds if args.rounds is not None else 1 if tp else 2 if lengths and quick else 5
    args.profile_steps = args.profile_steps if args.profile_steps is not None else 0 if tp or lengths else 2
    args.wait_idle = args.wait_idle if args.wait_idle is not None else 60 if tp else 0
    args.base = args.modes[0] if lengths and args.base == "unsharded" else args.base
    bert = all(workload.family(s) == "bert" for s in args.sizes)
    args.workload = args.workload or ("cls" if lengths else "mlm" if bert and not tp else "encoder")
    args.dropout = args.dropout if args.dropout is not None else 0.1 if args.workload in ("mlm", "cls") else 0.0
    check_documents(ap, args)
    unknown = [x for x in args.sizes if x not in workload.SIZES]
    unknown += [m for m in args.modes if m.partition("@")[0] not in workload.MODES]
    if unknown:
        ap.error(f"unknown sizes or modes {unknown}")
    if args.workload in ("mlm", "cls") and not bert:
        ap.error("ViT and T5 sizes run --workload encoder")
    forms = [m for m in args.modes if m.partition("@")[0].endswith(tuple(workload.FORMS))]
    if (args.workload == "cls") != bool(lengths) or forms != (args.modes if lengths else []):
        ap.error(f"--lengths (workload cls) runs the batch forms' modes {list(workload.FORMS)} only, and they run "
                 "only under --lengths")
    if any("@" in m for m in args.modes) and not args.baseline:
        ap.error("a mode@baseline needs --baseline CHECKOUT")
    if len(args.seqs) + len(args.paddings) > 2 and (args.switch or args.in_process or args.gpu or args.cpu_test
                                                   or lengths):
        ap.error("a sweep of --seq or --padding runs the layouts (not --switch, --in-process, --gpu, --lengths)")
    return args


def check_documents(ap, args) -> None:
    """``--documents N`` goes with the modes named MODE_docs (encoder workload): N, by default 8."""
    packed = [m for m in args.modes if m.partition("@")[0].endswith("_docs")]
    if "unsharded_docs" in args.modes:
        ap.error("the unsharded hand loop cannot take document_ids (shardlib's document hook turns them into masks): "
                 "world1_docs is the same model at a world of one")
    if args.documents is not None and not packed:
        ap.error("--documents N packs the rows of the modes named MODE_docs (e.g. --modes sp4_ring,sp4_ring_docs)")
    if packed and args.workload != "encoder":
        ap.error(f"{packed} pack the encoder workload's rows: --workload encoder")
    args.documents = args.documents or (8 if packed else 0)


def main(argv=None) -> None:
    args = parse(argv)
    started = time.perf_counter()
    if args.switch:
        return switched(args, args.modes[0])
    if args.in_process:
        return in_process(args)
    if args.gpu or args.cpu_test:
        return gpu(args)
    if len(args.seqs) + len(args.paddings) > 2:
        return sweep(args, started)
    runs = {size: layouts(args, size, args.steps or (THROUGHPUT_STEPS.get(size, 3) if args.throughput
                                                     and not args.quick else 3)) for size in args.sizes}
    if args.json:
        write_json(args.json, {"args": vars(args), **(runs[args.sizes[0]] if len(runs) == 1 else {"sizes": runs})})
    print(f"total wall time {time.perf_counter() - started:.0f} s")


def sweep(args, started: float) -> None:
    """Every size at every ``--seq`` and ``--padding``, one after another (the JSON's ``points``); with ``--peak``, the
    peaks by length with their growth and their ratio to the same layout unmasked. Peaks alone (no rounds, no
    profile): one layout's ranks at a time, the longest rows' memory."""
    points = []
    alone = not args.rounds and not args.profile_steps
    for size, seq, padding, modes in ((z, n, f, m) for z in args.sizes for n in args.seqs for f in args.paddings
                                      for m in ([[m] for m in args.modes] if alone else [args.modes])):
        point = argparse.Namespace(**{**vars(args), "seq": seq, "padding": padding, "modes": modes})
        points.append({"size": size, "seq": seq, "padding": padding, **layouts(point, size, args.steps or 3)})
        if args.json:  # after every point: a sweep cut short keeps what it measured
            write_json(args.json, {"args": vars(args), "points": points})
    if args.peak:
        report.sweep_peaks(args.modes, points, args.documents)
    print(f"total wall time {time.perf_counter() - started:.0f} s")


def layouts(args, size: str, steps: int) -> dict:
    """Every layout of ``--modes`` on ``size``: step time in interleaved rounds, anatomy, peaks."""
    modes = args.modes
    what = {"mlm": "BertForMaskedLM training step (AdamW)", "encoder": "forward + backward",
            "cls": "BertForSequenceClassification training step (AdamW)"}[args.workload]
    lengths = workload.length_batches(args.lengths, steps, args.batch, args.seq) if args.lengths else None
    masks = (f", padding {args.padding:g}" if args.padding else "") + (
        f", {args.documents} documents in the _docs modes" if args.documents else "")
    shape = f"batch {args.batch} x {args.seq}{masks}" if not lengths else (
        f"{steps} global batches of {args.batch} samples of {args.lengths} lengths (mean "
        f"{sum(map(sum, lengths)) / steps / args.batch:.1f}, max {max(map(max, lengths))} tokens), rows of {args.seq}")
    print(f"step anatomy: {what}, {size}, {shape}, dropout {args.dropout}; "
          f"{args.rounds} interleaved rounds of {steps} steps", flush=True)
    pools, started_s = {}, {}
    rec = {"seconds": {m: [] for m in modes}, "cpu_seconds": {m: [] for m in modes},
           "minor_faults": {m: [] for m in modes}}

    def start(mode: str) -> RankPool:
        name, _, baseline = mode.partition("@")
        setup = functools.partial(workload.setup, mode=name, size=size, batch=args.batch, seq=args.seq,
                                  dropout=args.dropout, workload=args.workload, layers=args.layers,
                                  padding=args.padding, lengths=args.lengths, window=steps,
                                  documents=args.documents, warmup=args.warmup)
        t0 = time.perf_counter()
        with checkout(args.baseline if baseline else None):
            pools[mode] = RankPool(workload.MODES[name][0], setup, measure.serve)
        started_s[mode] = time.perf_counter() - t0
        return pools[mode]

    try:
        for mode in modes if not args.fresh else ():
            start(mode)
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                if args.wait_idle:
                    wait_idle(args.wait_idle, 0.1)
                if args.fresh:  # new ranks, one warm-up step: what a user's script does (their start not timed)
                    if mode in pools:
                        pools.pop(mode).close()
                    start(mode).call("time", steps=1)
                for key, value in zip(rec, pools[mode].call("time", steps=steps)[0]):
                    rec[key][mode].append(value)
            print(f"  round {r + 1}: " + ", ".join(f"{m} {rec['seconds'][m][-1] * 1e3:.0f} ms" for m in modes),
                  flush=True)
        rec["anatomy_ms"] = {m: pools[m].call("profile", steps=args.profile_steps)[0] for m in modes
                             if args.profile_steps}
        rec["peaks"] = {m: pools[m].call("peak") for m in modes} if args.peak else {}
    finally:
        for pool in pools.values():
            pool.close()
    rec["started_s"] = started_s
    real = sum(map(sum, lengths)) / steps if lengths else None
    report.layouts(modes, rec, args.base, real or workload.tokens(size, args.batch, args.seq), size)
    report.documents_rows(modes, rec)
    if rec["peaks"]:
        report.peak_rows(modes, rec["peaks"], args.base)
    if lengths:
        positions = {m: workload.slots(m.partition("@")[0], lengths, args.seq) for m in modes}
        rec["lengths"] = {"real_tokens_per_step": real, "positions_per_step": positions, "sample_lengths": lengths,
                          "packed_over": report.forms(modes, rec, real, positions)}
    return rec


def switched(args, mode: str) -> None:
    """``--switch``: the variants of one set alternated step by step in the same ranks."""
    import _step_variants

    if args.switch not in _step_variants.SETS:
        raise SystemExit(f"unknown --switch {args.switch!r}; known: {', '.join(_step_variants.SETS)}")
    print(f"switched variants {args.switch!r}: {mode}, {args.workload}, {args.size}, batch {args.batch} x {args.seq};"
          f" {args.rounds} pairs of steps", flush=True)
    setup = functools.partial(workload.setup, mode=mode, size=args.sizes[0], batch=args.batch, seq=args.seq,
                              dropout=args.dropout, workload=args.workload)
    pool = RankPool(workload.MODES[mode][0], setup, measure.serve)
    try:
        seconds = pool.call("switch", steps=args.rounds, variants=args.switch)[0]
    finally:
        pool.close()
    report.switched(seconds)
    if args.json:
        write_json(args.json, {"args": vars(args), "seconds": seconds})


def in_process(args) -> None:
    """``--in-process``: the world-of-one variants timed in this process, interleaved; wall and CPU per step."""
    import shardlib

    shardlib.init_mesh()
    size, steps = args.sizes[0], args.steps or 3
    runs = workload.in_process_steps(size, args.batch, args.seq, args.dropout)
    seconds, cpu = {m: [] for m in runs}, {m: [] for m in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start, cpu0 = time.perf_counter(), time.process_time()
            runs[name].window(steps)
            seconds[name].append((time.perf_counter() - start) / steps)
            cpu[name].append((time.process_time() - cpu0) / steps)
        print(f"  round {r + 1}: " + ", ".join(f"{m} {seconds[m][-1] * 1e3:.1f} ms" for m in names), flush=True)
    report.in_process(seconds, cpu, workload.IN_PROCESS_TITLES, f"One process, {size} {args.batch} x {args.seq} "
                      f"(median of {args.rounds} rounds of {steps} steps [range])")
    if args.json:
        write_json(args.json, {"args": vars(args), "seconds": seconds, "cpu_seconds": cpu})


def gpu(args) -> None:
    """``--gpu``: each case of ``_gpu_anatomy.CASES`` in its own process, until ``--budget`` seconds have passed."""
    import json
    import subprocess
    import tempfile

    import _gpu_anatomy

    cases = args.cases.split(",") if args.cases else [c for c, spec in _gpu_anatomy.CASES.items() if spec[-1] == "cuda"]
    started, results, steps = time.perf_counter(), [], args.steps or 3
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            left = args.budget - (time.perf_counter() - started)
            if left < 20:
                print(f"{case}: skipped, the budget of {args.budget:.0f} s is spent", flush=True)
                continue
            out = Path(tmp) / f"{case}.json"
            command = [sys.executable, str(Path(__file__).with_name("_gpu_anatomy.py")), case, str(out),
                       str(args.rounds), str(steps)] + (["--cpu-test"] if args.cpu_test else [])
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
    print_table(f"World of one: hand loop / Trainer (median of {args.rounds} rounds of {steps} steps)",
                _gpu_anatomy.SUMMARY_HEADER, _gpu_anatomy.summary_rows(results))


def checkout(path: str | None):
    """Ranks spawned inside the block import shardlib from ``path`` (``_checkout.py``), else from this one."""
    return mock.patch.dict(os.environ, {"SHARDLIB_CHECKOUT": str(Path(path).resolve())} if path else {})


if __name__ == "__main__":
    main()
