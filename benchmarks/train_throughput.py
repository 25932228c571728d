"""Training throughput, TorchAcc style: eager + torch DDP (the baseline) against shardlib's layouts under
``Trainer.fit``, fp32 and mixed precision, on the same BERT classifier, generated SST-2-like data, seed, global batch,
learning rate and steps, each mode in fresh processes: samples/s and a per-step loss check against the baseline
(FAIL: exit status 1). Per-step JSONL logs go to ``<out>/<mode>-<precision>/log.jsonl``, ``plot_train_throughput.py``
draws them. Docs: docs/benchmarks/training-runs.md.

    .venv/bin/python benchmarks/train_throughput.py --quick     # tiny BERT, 30 steps, fp32 + bf16, 6 modes, ~1.5 min
    .venv/bin/python benchmarks/train_throughput.py             # BERT-base, 40 steps, fp32 + bf16, 8 modes, ~1 hour
    .venv/bin/python benchmarks/train_throughput.py --size tiny --steps 6 --modes ddp,tp2,pp2
    .venv/bin/python benchmarks/train_throughput.py --dropout 0 --precisions fp32,bf16,fp16 --size small
    .venv/bin/python benchmarks/plot_train_throughput.py        # the PNGs from the last full run's logs
    python benchmarks/train_throughput.py --device cuda         # one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from _harness import loopback_ifname, print_closing, timed, wait_idle, write_json  # noqa: E402
from _train_throughput_workload import (  # noqa: E402
    BASELINE, CHECKED_STEPS, DEFAULT_LR, DEFAULT_MODES, DEFAULT_PRECISIONS, DEFAULT_STEPS, LAST_K, QUICK_MODES, ROOT,
    SIZES, TOLERANCE, mode_spec, run_mode, threads_for,
)

IDLE_CORES = 0.1  # other processes' average CPU use above which a mode is flagged


# ------------------------------------------------------------------------------------------ results, the table
def load_results(out: Path) -> tuple[dict, list[dict]]:
    """``runs.json`` and per run from its log: ``losses``, the ``rates`` after the warm-up, their median."""
    meta = json.loads((out / "runs.json").read_text())
    runs = []
    for run in meta["runs"]:
        log = out / f"{run['mode']}-{run['precision']}" / "log.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
        records = [r for r in records if not r.get("eval")]
        timed = [r["samples_per_s"] for r in records if r["step"] > meta["warmup"]]
        runs.append(dict(run, losses=[r["loss"] for r in records], rates=timed,
                         samples_per_s=statistics.median(timed) if timed else None,
                         skipped=records[-1].get("skipped_steps") if records else None))
    return meta, runs


def _loss_check(meta: dict, run: dict, base: dict | None) -> tuple[float | None, str]:
    """(max per-step |loss - baseline loss|, verdict)."""
    if run["mode"] == meta["baseline"]:
        return None, "baseline"
    if base is None or not base["losses"] or not run["losses"]:
        return None, "n/a"
    diffs = [abs(a - b) for a, b in zip(run["losses"], base["losses"])]
    if meta["dropout"] > 0:
        return max(diffs), "n/a (dropout)"
    if len(run["losses"]) != len(base["losses"]):
        return max(diffs), f"FAIL ({len(run['losses'])} steps vs {len(base['losses'])})"
    n, tolerance = CHECKED_STEPS[run["precision"]], TOLERANCE[run["precision"]]
    where, checked = "every step" if n is None else f"steps 1-{n}", max(diffs[:n])
    if checked <= tolerance:
        return max(diffs), f"ok: {where} within {checked:.1e}"
    return max(diffs), f"FAIL: {where}: {checked:.1e} > {tolerance:g}"


def summarize(meta: dict, runs: list[dict]) -> list[dict]:
    """Each run with its ratios to the baseline (same precision, and fp32) and its loss check."""
    base = {r["precision"]: r for r in runs if r["mode"] == meta["baseline"] and r["samples_per_s"]}
    rows = []
    for run in runs:
        same, fp32, rate = base.get(run["precision"]), base.get("fp32"), run["samples_per_s"]
        diff, check = _loss_check(meta, run, same)
        rows.append(dict(run, vs_baseline=rate / same["samples_per_s"] if rate and same else None,
                         vs_baseline_fp32=rate / fp32["samples_per_s"] if rate and fp32 else None,
                         loss_diff=diff, check=check))
    return rows


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def print_table(meta: dict, rows: list[dict]) -> None:
    base = mode_spec(meta["device"], meta["baseline"]).title
    print(f"\n| mode | ranks x threads | precision | samples/s | vs {base}, same precision | vs {base} fp32 | "
          f"first loss | last {LAST_K} steps' loss | max abs per-step loss diff vs baseline | loss check |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['title']} | {r['world']} x {r['threads']} | {r['precision']} | failed: {r['error']} "
                  "| | | | | | |")
            continue
        losses = r["losses"]
        final, rate = statistics.fmean(losses[-LAST_K:]) if losses else None, r["samples_per_s"]
        print(f"| {r['title']} | {r['world']} x {r['threads']} | {r['precision']} | "
              f"{_fmt(rate, ',.0f' if (rate or 0) >= 100 else ',.1f')} | {_fmt(r['vs_baseline'], '.2f', 'x')} | "
              f"{_fmt(r['vs_baseline_fp32'], '.2f', 'x')} | {_fmt(losses[0] if losses else None, '.4f')} | "
              f"{_fmt(final, '.4f')} | {_fmt(r['loss_diff'], '.2e')} | {r['check']} |")


# ------------------------------------------------------------------------------------------------------ main
def fp16_slowdown() -> float:
    """How much slower fp16 autocast runs a 256 x 768 @ 768 x 768 linear than fp32 here (one thread, best of 3)."""
    layer, x, threads, best = torch.nn.Linear(768, 768), torch.randn(256, 768), torch.get_num_threads(), {}
    torch.set_num_threads(1)
    try:
        for fp16 in (False, True):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                best[fp16] = min(timed(lambda: layer(x), 3))
    finally:
        torch.set_num_threads(threads)
    return best[True] / best[False]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo ranks; cuda: one GPU")
    p.add_argument("--size", choices=tuple(SIZES), default=None, help="BERT size (default base; --quick tiny)")
    p.add_argument("--modes", default=None, help="comma-separated (default, CPU: " + ",".join(DEFAULT_MODES["cpu"])
                   + "; --quick: " + ",".join(QUICK_MODES) + "; any shardlib mode + _compiled; CUDA: "
                   + ",".join(DEFAULT_MODES["cuda"]) + ")")
    p.add_argument("--precisions", default=None, help="comma-separated from fp32,bf16,fp16 (default CPU "
                   f"{DEFAULT_PRECISIONS['cpu']}, CUDA {DEFAULT_PRECISIONS['cuda']})")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 40; tiny 30)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median (default 2)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default 8; CUDA 32)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence, padding included (default 128)")
    p.add_argument("--lr", type=float, default=None, help="AdamW lr (default: base 5e-5, small 3e-4, tiny 3e-3)")
    p.add_argument("--dropout", type=float, default=None, help="hidden and attention dropout (default 0.1, the "
                   "config's; --quick 0, so the per-step loss check applies)")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches for pp modes (default 4)")
    p.add_argument("--out", type=Path, default=None, help="where the logs go (default "
                   "benchmarks/results/train_throughput; --quick: benchmarks/results/train_throughput_quick)")
    p.add_argument("--wait-idle", type=float, default=60.0, metavar="SECONDS", help="wait for quiet before a mode")
    p.add_argument("--quick", action="store_true", help="tiny BERT, 30 steps, dropout 0, fp32 + bf16, modes "
                   + ",".join(QUICK_MODES) + " (about 1.5 minutes on 2 cores)")
    args = p.parse_args(argv)
    args.size = args.size or ("tiny" if args.quick else "base")
    args.modes = (args.modes or ",".join(QUICK_MODES if args.quick else DEFAULT_MODES[args.device])).split(",")
    args.precisions = (args.precisions or DEFAULT_PRECISIONS[args.device]).split(",")
    args.steps = args.steps or DEFAULT_STEPS[args.size]
    args.batch = args.batch or (32 if args.device == "cuda" else 8)
    args.lr = args.lr if args.lr is not None else DEFAULT_LR[args.size]
    args.dropout = args.dropout if args.dropout is not None else (0.0 if args.quick else 0.1)
    args.out = args.out or ROOT / "benchmarks" / "results" / ("train_throughput_quick" if args.quick
                                                              else "train_throughput")
    _validate(p, args)
    return args


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for m in args.modes:
        try:
            spec = mode_spec(args.device, m)
        except KeyError:
            p.error(f"unknown mode {m!r} for --device {args.device}")
        if args.batch % (spec.mesh.get("dp", 1) * (args.microbatches if spec.mesh.get("pp", 1) > 1 else 1)):
            p.error(f"--batch {args.batch} does not split over {m}'s dp ranks and microbatches")
    if len(set(args.modes)) != len(args.modes) or not set(args.precisions) <= set(TOLERANCE):
        p.error("a mode is listed twice, or a precision is not one of fp32, bf16, fp16")
    if args.warmup < 0 or args.steps <= args.warmup or min(args.batch, args.seq - 34, args.microbatches) < 1:
        p.error("need --steps > --warmup >= 0, --batch >= 1, --seq >= 35, --microbatches >= 1")
    if not 0 <= args.dropout < 1 or args.lr <= 0:
        p.error("--dropout must be in [0, 1) and --lr > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")


def _header(args: argparse.Namespace) -> list[str]:
    c = SIZES[args.size]
    lines = [f"# BertForSequenceClassification {args.size}: {c['num_hidden_layers']} layers, hidden "
             f"{c['hidden_size']}, {c['num_attention_heads']} heads, intermediate {c['intermediate_size']}, vocab "
             f"{c['vocab_size']}; 2 labels; global batch {args.batch} x {args.seq} tokens; {args.steps} steps "
             f"(median of the last {args.steps - args.warmup}); AdamW lr {args.lr:g}; dropout {args.dropout:g}",
             f"# torch {torch.__version__}, device {args.device}"
             + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else f", {os.cpu_count()} CPUs")
             + f"; logs in {args.out}"]
    if args.device == "cpu":
        slow = fp16_slowdown()
        state = "runs" if "fp16" in args.precisions else "is not in the default set"
        lines.append(f"# fp16: autocast + GradScaler work on CPU in torch {torch.__version__}, but this CPU runs an "
                     f"fp16 linear {slow:.0f}x slower than fp32 (no fp16 matmul kernel), so fp16 {state}")
    if any(mode_spec(args.device, m).world > (os.cpu_count() or 1) for m in args.modes):
        lines.append("# modes with more ranks than cores are oversubscribed (their rows say so)")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())  # children inherit it: gloo on loopback only
    os.environ.setdefault("SHARDLIB_TIMEOUT", "900")
    # Inductor compiles in the rank itself, not in a pool of worker processes: the CPU it uses stays the mode's own
    # (the foreign-load check counts the ranks' CPU time) and no compile pool competes with the other rank
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    started = time.perf_counter()
    for line in _header(args):
        print(line, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ".gitignore").write_text("# written by benchmarks/train_throughput.py: logs are not committed\n*\n")
    opts = dict(device=args.device, size=args.size, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
                dropout=args.dropout, microbatches=args.microbatches, out=str(args.out))
    meta = dict(opts, warmup=args.warmup, baseline=BASELINE[args.device], torch=torch.__version__,
                cpus=os.cpu_count(), runs=[])
    warnings = []
    for mode in args.modes:
        spec = mode_spec(args.device, mode)
        load = wait_idle(args.wait_idle, IDLE_CORES) if args.device == "cpu" else 0.0
        if load > IDLE_CORES:
            print(f"  WARNING: {load:.2f} cores busy with other processes before {mode}", flush=True)
        results = run_mode(mode, args.precisions, opts)
        for precision, r in results.items():
            meta["runs"].append(dict(r, mode=mode, precision=precision, title=spec.title, world=spec.world,
                                     threads=threads_for(spec.world)))
            print(f"  {spec.title:<48} {precision:<5} " + (f"failed: {r['error']}" if "error" in r else
                  f"{r['wall_s']:.0f} s") + f" (others used {r['foreign_cores']:.2f} cores)", flush=True)
            if r["foreign_cores"] > IDLE_CORES and args.device == "cpu":
                warnings.append(f"{mode}/{precision}: other processes used {r['foreign_cores']:.2f} cores on "
                                "average meanwhile; its numbers are not reliable")
        write_json(args.out / "runs.json", meta)  # after every mode: a partial run plots
    rows = summarize(*load_results(args.out))
    print_table(meta, rows)
    failed = [f"{r['mode']}/{r['precision']}: " + (r.get("error") or r["check"]) for r in rows
              if "error" in r or r["check"].startswith("FAIL")]
    summary = [f"plot: .venv/bin/python benchmarks/plot_train_throughput.py --out {args.out}"]
    print_closing(summary, [f"failed: {f}" for f in failed] + warnings, started)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
