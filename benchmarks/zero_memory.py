"""Memory by layout: ZeRO stages 0-3 on CPU, the bytes each dp rank holds, the step time, the peak RSS of a large model.
Each launch runs this file on N gloo ranks (``--worker``, internal), skipped where its estimated RAM exceeds 90% of
MemAvailable. Docs: docs/benchmarks/zero-memory.md.

    .venv/bin/python benchmarks/zero_memory.py                      # all three parts (BERT-large zero=0: ~29 GiB)
    .venv/bin/python benchmarks/zero_memory.py --large-layers 12    # part 3 on a 24 GiB machine
    .venv/bin/python benchmarks/zero_memory.py --parts bytes        # 1. only: BERT-base at dp 2, 4, 8
    .venv/bin/python benchmarks/zero_memory.py --quick              # smoke run: tiny BERTs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import loopback_ifname, print_closing, wait_idle  # noqa: E402
from _zero_memory_workload import (  # noqa: E402
    BASE, IDLE_CORES, LARGE, RSS_BASE, STAGES, TINY_BASE, TINY_LARGE, rss_need, worker_main,
)

FAILED: list[str] = []  # the launches that failed


def launch(args, nproc: int, worker: str, opts: dict, tag: str, what: str, warnings: list, mmap: bool = False):
    """Run this file on ``nproc`` ranks through ``python -m shardlib.cli run``; rank 0's result, None on failure."""
    if args.wait_idle > 0 and (load := wait_idle(args.wait_idle, IDLE_CORES)) > IDLE_CORES:
        warnings.append(f"{load:.2f} cores busy by other processes before {what}")
        print(f"  WARNING: {warnings[-1]}", flush=True)
    opts_path, out = os.path.join(args.tmp, f"{tag}.opts.json"), os.path.join(args.tmp, f"{tag}.json")
    with open(opts_path, "w") as f:
        json.dump(opts, f)
    extra = {"MALLOC_MMAP_THRESHOLD_": "131072"} if mmap else {}
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME")
               or loopback_ifname(), **extra)
    print(f"$ {'MALLOC_MMAP_THRESHOLD_=131072 ' if mmap else ''}python -m shardlib.cli run --nproc {nproc} "
          f"benchmarks/zero_memory.py --worker {worker} ...", flush=True)
    rc = subprocess.call([sys.executable, "-m", "shardlib.cli", "run", "--nproc", str(nproc), os.path.abspath(__file__),
                          "--worker", worker, "--opts", opts_path, "--out", out], env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if rc != 0 or not os.path.exists(out):
        print(f"  FAILED: the {tag} launch exited with {rc}", flush=True)
        FAILED.append(tag)
        return None
    with open(out) as f:
        return json.load(f)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), 0)


def param_count(model: dict) -> int:
    import torch
    import transformers

    with torch.device("meta"):
        m = transformers.BertForSequenceClassification(transformers.BertConfig(**model, max_position_embeddings=512,
                                                                               num_labels=2))
    return sum(p.numel() for p in m.parameters())


def run_bytes(args, dps: list, warnings: list) -> tuple[dict, dict]:
    """Part 1: one launch per dp; a stage whose estimated need does not fit is left out of its launch."""
    results, skipped, pb = {}, {}, 4.0 * param_count(args.base)
    for dp in dps:
        avail, zeros = mem_available(), []
        for zero in STAGES:
            need = dp * rss_need(zero, pb, dp, args.microbatches)
            if need > 0.9 * avail and not args.no_memory_check:
                skipped[(dp, zero)] = f"needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
                print(f"\ndp={dp} zero={zero}: SKIPPED, {skipped[(dp, zero)]}", flush=True)
            else:
                zeros.append(zero)
        if zeros:
            need = max(dp * rss_need(z, pb, dp, args.microbatches) for z in zeros)
            print(f"\nbytes dp={dp}: stages {zeros}, estimated need {need / 2**30:.1f} GiB; MemAvailable "
                  f"{avail / 2**30:.1f} GiB", flush=True)
            t0 = time.perf_counter()
            opts = dict(model=args.base, batch=args.batch, seq=args.seq, zeros=zeros, microbatches=args.microbatches,
                        bucket_mb=args.bucket_mb)
            if (res := launch(args, dp, "bytes", opts, f"bytes_dp{dp}", f"bytes dp={dp}", warnings, True)) is not None:
                results[dp] = res
            print(f"  bytes dp={dp}: {time.perf_counter() - t0:.0f} s", flush=True)
    return results, skipped


def run_steps(args, dps: list, warnings: list) -> dict:
    """Part 2: one launch per dp, all four stages, interleaved where the estimate fits in 70% of MemAvailable."""
    results, pb = {}, 4.0 * param_count(args.base)
    for dp in dps:
        avail = mem_available()
        need = {mode: dp * (1.1 * pb * (6 + mode * (2 * (1 + 3 / dp) + 4 / dp)) + RSS_BASE) for mode in (True, False)}
        interleave = args.interleave == "yes" or (args.interleave == "auto" and need[True] <= 0.7 * avail)
        print(f"\ndp={dp}: estimated need {need[True] / 2**30:.1f} GiB with the four trainers alive at once, "
              f"{need[False] / 2**30:.1f} GiB one after another; MemAvailable {avail / 2**30:.1f} GiB: "
              f"{'interleaved rounds' if interleave else 'stages one after another'}", flush=True)
        if need[interleave] > 0.9 * avail and not args.no_memory_check:
            warnings.append(f"dp={dp} skipped: needs ~{need[interleave] / 2**30:.0f} GiB")
            print(f"  SKIPPED: {warnings[-1]}", flush=True)
            continue
        opts = dict(model=args.base, batch=args.batch, seq=args.seq, warmup=args.warmup, rounds=args.rounds,
                    zeros=list(STAGES), interleave=interleave)
        if (res := launch(args, dp, "steps", opts, f"steps_dp{dp}", f"dp={dp}", warnings)) is not None:
            results[dp] = res
    return results


def run_rss(args, stages: list, warnings: list) -> tuple[dict, dict]:
    """Part 3: one launch of 4 ranks per stage; a stage whose estimated need does not fit is skipped."""
    rss, skipped, n = {}, {}, param_count(args.large)
    for zero in stages:
        need, avail = 4 * rss_need(zero, 4.0 * n, 4), mem_available()
        print(f"\nBERT-large {args.large['num_hidden_layers']} layers ({n / 1e6:.0f} M parameters), zero={zero}: "
              f"estimated need {need / 2**30:.1f} GiB for 4 ranks, MemAvailable {avail / 2**30:.1f} GiB", flush=True)
        if need > 0.9 * avail and not args.no_memory_check:
            skipped[zero] = (f"needs ~{need / 2**30:.0f} GiB, {avail / 2**30:.0f} GiB available: rerun with fewer "
                             "--large-layers (or --no-memory-check)")
            print(f"  SKIPPED: {skipped[zero]}", flush=True)
            continue
        opts = dict(model=args.large, batch=args.batch, seq=args.seq, zero=zero)
        if (res := launch(args, 4, "rss", opts, f"rss_zero{zero}", f"BERT-large zero={zero}", warnings, True)):
            rss[zero] = res
    return rss, skipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny BERTs (hidden 64/128, 2 layers, vocab "
                                                        "1000), 8 x 32 tokens, 2 rounds, part 1 in buckets of 1/16 MiB")
    p.add_argument("--parts", default="bytes,time,rss", help="comma-separated from bytes, time, rss")
    p.add_argument("--dps-bytes", default="2,4,8", help="dp sizes for the bytes (default 2,4,8)")
    p.add_argument("--dps", default="2,4", help="dp sizes for the step times (default 2,4)")
    p.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 128; --quick 32)")
    p.add_argument("--microbatches", type=int, default=1, help="part 1: Trainer microbatches (default 1)")
    p.add_argument("--bucket-mb", type=float, help="part 1: zero 1/2 bucket MiB (default 25; --quick 1/16)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, help="part 2 rounds, one timed step per stage each (default 3; --quick 2)")
    p.add_argument("--interleave", choices=["auto", "yes", "no"], default="auto",
                   help="part 2: all four trainers alive at once (yes), one after another (no), or yes where the "
                        "estimate fits in 70%% of MemAvailable (auto)")
    p.add_argument("--large-layers", type=int, default=24, help="BERT-large layers for part 3 (default 24)")
    p.add_argument("--rss-stages", default="0,1,2,3", help="zero stages for part 3 (default 0,1,2,3)")
    p.add_argument("--no-memory-check", action="store_true", help="launch even where the estimate does not fit")
    p.add_argument("--wait-idle", type=float, metavar="SECONDS", help="wait for quiet before a launch (default 10)")
    for hidden in ("--worker", "--opts", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    parts = set(args.parts.split(","))
    if parts - {"bytes", "time", "rss"}:
        p.error(f"unknown parts {sorted(parts - {'bytes', 'time', 'rss'})}")
    ints = lambda text, part: sorted({int(x) for x in text.split(",") if x}) if part in parts else []  # noqa: E731
    dps_bytes, dps, rss_stages = ints(args.dps_bytes, "bytes"), ints(args.dps, "time"), ints(args.rss_stages, "rss")
    if set(rss_stages) - set(STAGES):
        p.error("--rss-stages takes zero stages 0-3")
    if any(args.batch % d for d in dps + dps_bytes) or (rss_stages and args.batch % 4):
        p.error("--batch must divide by every dp size (and by 4 for part 3)")
    if any((args.batch // d) % args.microbatches for d in dps_bytes):
        p.error("--batch / dp must divide by --microbatches at every --dps-bytes")
    args.seq, args.rounds = args.seq or (32 if args.quick else 128), args.rounds or (2 if args.quick else 3)
    args.wait_idle = args.wait_idle if args.wait_idle is not None else (0.0 if args.quick else 10.0)
    args.bucket_mb = args.bucket_mb or (1 / 16 if args.quick else 25.0)
    args.base = TINY_BASE if args.quick else BASE
    args.large = TINY_LARGE if args.quick else dict(LARGE, num_hidden_layers=args.large_layers)
    import torch
    import transformers

    part1 = (f"part 1: BERT-{'tiny' if args.quick else 'base'} at dp {', '.join(map(str, dps_bytes))}, microbatches "
             f"{args.microbatches}, buckets {args.bucket_mb:g} MiB; " if dps_bytes else "")
    print(f"# ZeRO 0-3 on CPU: BertForSequenceClassification fp32, AdamW, max_grad_norm 1.0, tp=1; global batch "
          f"{args.batch} x {args.seq} tokens; {part1}torch {torch.__version__}, transformers {transformers.__version__}"
          f", {os.cpu_count()} CPUs, MemAvailable {mem_available() / 2**30:.1f} GiB, load average "
          f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}{'; QUICK' if args.quick else ''}", flush=True)
    t_all, warnings, summary = time.perf_counter(), [], []
    args.tmp = tempfile.mkdtemp(prefix="zero_memory_")
    try:
        bytes_results, bytes_skipped = run_bytes(args, dps_bytes, warnings)
        step_results = run_steps(args, dps, warnings)
        rss, rss_skipped = run_rss(args, rss_stages, warnings)
    finally:
        shutil.rmtree(args.tmp, ignore_errors=True)
    from _zero_memory_report import print_bytes, print_rss, print_times

    if bytes_results:
        print_bytes(bytes_results, bytes_skipped, summary)
    if step_results:
        print_times(step_results, warnings)
    if rss_stages:
        print_rss(rss, rss_stages, args.large["num_hidden_layers"], rss_skipped, summary)
    if FAILED:
        warnings.append(f"failed launches: {', '.join(FAILED)}")
    print_closing(summary, warnings, t_all)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
