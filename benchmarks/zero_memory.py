"""ZeRO stages 0-3 on CPU: the bytes each dp rank holds, the step time, and the peak RSS of a large model.

What is measured
----------------
``BertForSequenceClassification`` built from a config (random weights, ``torch.manual_seed(0)`` on every rank, HF's
default dropout 0.1, 2 labels), ``shardlib.shard(model, init_mesh(tp=1))`` (dp = the number of ranks), trained by
``shardlib.Trainer(model, lambda ps: AdamW(ps, lr=1e-4), max_grad_norm=1.0, precision="fp32", zero=k)`` on
SST-2-shaped batches (``_workloads.classification_samples``: random tokens, full mask; global batch ``--batch``
x ``--seq`` tokens, each rank its ``dp_shard``). zero=0 is DDP, zero 1/2 :class:`shardlib.train.zero.FlatZero`
(parameters as views into flat buckets of ``--bucket-mb``; each dp rank owns an exact 1/dp of every bucket's
elements and steps AdamW over its 1-D pieces; zero=2 reduce-scatters bucket by bucket during every backward and
frees the full gradients, zero=1 in the step's last backward), zero=3 FSDP2. Every group of ranks is started by
this script through ``python -m shardlib.cli run --nproc N`` (gloo over loopback, one torch thread per rank); each
launch is a fresh process group:

1. **Bytes per rank at dp 2, 4, 8** (``--dps-bytes``; one launch per dp, ``MALLOC_MMAP_THRESHOLD_=131072``),
   BERT-base (hidden 768, 12 layers, 12 heads, intermediate 3072, vocab 30522), zero 0/1/2/3 one after another,
   each on a fresh model freed before the next, ``--microbatches`` (default 1, the Trainer's) per step. Per stage one
   ``trainer.train_step`` (it also creates AdamW's state), then per rank:

   * optimizer state: ``shardlib.train.optim.held_state_bytes(trainer.optimizer, trainer.params)``, what the rank
     holds (zero 1/2: its pieces' ``exp_avg``, ``exp_avg_sq``, ``step``; zero=3: its DTensor shards);
   * gradient peak during that step: the gradient bytes alive at once. zero 1/2: every ``p.grad`` + the buckets'
     ``grad_shard`` + the flat buffer in flight, sampled after every post-accumulate-grad hook and when each
     bucket's flat buffer is allocated (wrapping ``FlatZero._reduce_scatter``, as ``tests/zero_tasks.py`` does) and
     after the last backward. zero 0/3: the local ``p.grad`` bytes right after backward (DDP's bucket views; FSDP2's
     reduce-scattered shards: its transient unsharded gradients of one layer group are not counted);
   * parameters: ``shardlib.train.fsdp.local(p)`` over ``trainer.params``;
   * the rank's peak RSS from building the model to after the step (VmHWM reset before each stage).

   Max over ranks, next to full/dp, full being zero=0's figure, and the ratio max / (full/dp). zero=0 holds
   parameters, gradients (DDP's buckets), AdamW and its temporaries: 2.2 GiB per rank for BERT-base (measured), so 8
   ranks need ~18 GiB and the estimate (``rss_need``, 5.5x the parameter bytes + 0.4 GiB) ~21 GiB. A stage whose
   estimate exceeds 90% of MemAvailable is left out of the launch (message in the output; on a 24 GiB machine: zero=0
   at dp=8), and the full figures come from zero=0 at another dp (they do not depend on dp), or, where no zero=0 ran,
   from the model's parameter count (AdamW: 2 x parameter bytes + a 4-byte ``step`` per tensor). Targets: optimizer
   state of zero 1/2 on the largest rank <= 1.01 x full/dp (each rank owns 1/dp of every bucket, at most dp - 1
   padding elements more); the zero=2 gradient peak <= full/dp + 2 x the largest bucket (the shards, the bucket
   filling and the bucket in flight; a peak above it by no more than the shards' padding is reported as met up to the
   padding). A second table gives the bucket layout and the bound shards + 2 buckets. A bucket closes once it holds
   ``--bucket-mb``, so one can be larger: BERT-base's last bucket (the word embeddings, 89 MiB, and the rest of the
   embeddings) is 93 MiB of its 13, and dominates the peak. At ``--microbatches 1`` zero=1's only backward is also
   its last, so it reduce-scatters during backward like zero=2 and has the same peak; ``--microbatches 2`` (and a
   ``--batch`` that gives each rank a multiple of it) shows zero=1 holding whole gradients over the step.

2. **Step time** of each stage against zero=0 at dp=2 and dp=4 (``--dps``; one launch per dp). Interleaved
   (``--interleave yes``): one Trainer per stage, all four alive at once (fresh models, same seed); ``--warmup``
   untimed steps of each, then ``--rounds`` rounds of one timed ``trainer.train_step`` per stage, the order
   alternating from round to round (0 1 2 3, 3 2 1 0, ...) so that bursts and drift of other processes' load spread
   over the stages. That holds every stage's parameters and AdamW state at once (BERT-base at dp=4: ~5.2 GiB peak
   per rank, ~21 GiB in all), so ``--interleave auto`` (the default) does it only where the estimate
   (:func:`_steps_need`) fits in 70% of MemAvailable, and otherwise runs the stages one after another, each on a
   fresh model freed before the next (``--warmup`` untimed, then ``--rounds`` timed steps). Each step runs between
   two barriers (its time is the slowest rank's); ``trainer.zero_grad()`` after each step, outside the window, so
   only one stage's gradients exist at a time. Per stage: the median step, the median of the ratios zero_k / zero_0
   paired by round and the ratio of the medians. The CPU time of all ranks per step (``time.process_time``, summed
   over ranks) is given too: waiting in a collective costs little CPU, so its ratio is a steadier measure of the
   work a stage adds on a shared machine (not of its communication time). Other processes' CPU use during each step
   (whole-machine busy time from /proc/stat minus our ranks' CPU) is printed; steps above 0.1 cores are flagged.

3. **Peak RSS per rank** of BERT-large (hidden 1024, ``--large-layers`` layers (default 24), 16 heads,
   intermediate 4096) training at dp=4, zero 0 against 1, 2 and 3 (``--rss-stages``), one fresh launch per stage
   with ``MALLOC_MMAP_THRESHOLD_=131072`` in the ranks' environment (glibc then serves every allocation above 128 KiB
   by mmap and gives it back at free, so the resident set follows the live tensors and a peak is a peak). Per rank,
   after building model and Trainer: ``malloc_trim``, RSS, then VmHWM reset (``/proc/self/clear_refs`` = 5), two
   training steps (the first allocates AdamW's state), VmHWM again: the step peak. Also the process's lifetime
   peak (``ru_maxrss``): every rank builds the full model before zero 1/2 flatten it or FSDP2 shards it, so the
   lifetime peak is at least one whole fp32 model plus the runtime. Max over ranks.

   zero=0 at 24 layers needs about 4 x (1.34 GB parameters + 1.34 GB gradients in DDP's buckets + 2.7 GB AdamW +
   AdamW's temporaries) ~ 28 GB: before each launch the script estimates the need (``rss_need``: per-stage
   multiples of the fp32 parameter bytes + ``RSS_BASE`` per rank) and skips the launch with a message when it
   exceeds 90% of MemAvailable; rerun with ``--large-layers 12`` (or ``--no-memory-check``).

Before the reimplementation (torch's ZeroRedundancyOptimizer) zero 1/2 partitioned whole parameters over the ranks,
so the largest rank could hold far more than 1/dp of the optimizer state (BERT's word embeddings alone are 21% of
BERT-base), and zero=2 kept every full gradient until after backward.

How to run
----------
    .venv/bin/python benchmarks/zero_memory.py                      # BERT-large 24 layers (zero=0 needs ~29 GiB)
    .venv/bin/python benchmarks/zero_memory.py --large-layers 12    # on a 24 GiB machine (see 3.)
    .venv/bin/python benchmarks/zero_memory.py --parts bytes        # 1. only: BERT-base at dp 2, 4, 8
    .venv/bin/python benchmarks/zero_memory.py --quick              # smoke run: tiny BERTs
    .venv/bin/python benchmarks/zero_memory.py --parts bytes,time --rounds 5 --batch 16

Nothing is downloaded. The ranks run this file with ``--worker ...`` (internal).
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import loopback_ifname, print_closing, wait_idle  # noqa: E402
from _zero_memory_report import print_bytes, print_rss, print_times  # noqa: E402
from _zero_memory_workload import (  # noqa: E402
    BASE, IDLE_CORES, LARGE, RSS_BASE, STAGES, TINY_BASE, TINY_LARGE, rss_need, worker_main,
)


# ================================================================================================== driver side
FAILED: list[str] = []  # the launches that failed (exit status 1)


def _launch(nproc: int, worker: str, opts: dict, tmp: str, tag: str, extra_env: dict | None = None) -> dict | None:
    """Run this file on ``nproc`` ranks through ``python -m shardlib.cli run``; rank 0's result, None on failure."""
    opts_path, out = os.path.join(tmp, f"{tag}.opts.json"), os.path.join(tmp, f"{tag}.json")
    with open(opts_path, "w") as f:
        json.dump(opts, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME")
               or loopback_ifname(), **(extra_env or {}))
    cmd = [sys.executable, "-m", "shardlib.cli", "run", "--nproc", str(nproc), os.path.abspath(__file__),
           "--worker", worker, "--opts", opts_path, "--out", out]
    print(f"$ {' '.join(f'{k}={v}' for k, v in (extra_env or {}).items())}{' ' if extra_env else ''}"
          f"python -m shardlib.cli run --nproc {nproc} benchmarks/zero_memory.py --worker {worker} ...", flush=True)
    rc = subprocess.call(cmd, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if rc != 0 or not os.path.exists(out):
        print(f"  FAILED: the {tag} launch exited with {rc}", flush=True)
        FAILED.append(tag)
        return None
    with open(out) as f:
        return json.load(f)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _param_count(model: dict) -> int:
    import torch
    import transformers

    config = transformers.BertConfig(**model, max_position_embeddings=512, num_labels=2)
    with torch.device("meta"):
        m = transformers.BertForSequenceClassification(config)
    return sum(p.numel() for p in m.parameters())


def _steps_need(n_params: int, dp: int, interleave: bool) -> float:
    """Estimated RAM of a part-2 launch (all ranks): zero=0's parameters, AdamW state, gradients, the flat
    all-reduce buffer and AdamW's temporaries; with ``interleave`` also the other stages' parameters and state;
    10% for the allocator's slack."""
    pb = 4.0 * n_params
    per_rank = pb * 6
    if interleave:
        per_rank += pb * (2 * (1 + 3 / dp) + 4 / dp)
    return dp * (1.1 * per_rank + RSS_BASE)


def _wait(args, what: str, warnings: list) -> None:
    if args.wait_idle > 0:
        load = wait_idle(args.wait_idle, IDLE_CORES)
        if load > IDLE_CORES:
            warnings.append(f"{load:.2f} cores busy by other processes before {what}")
            print(f"  WARNING: {warnings[-1]}", flush=True)


def _ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x})


def _run_bytes(args, dps: list, base: dict, seq: int, tmp: str, warnings: list) -> tuple[dict, dict]:
    """Part 1: one launch per dp; a stage whose estimated need does not fit is left out of its launch."""
    results, skipped = {}, {}
    pb = 4.0 * _param_count(base)
    for dp in dps:
        avail = _mem_available()
        zeros = []
        for zero in STAGES:
            need = dp * rss_need(zero, pb, dp, args.microbatches)
            if need > 0.9 * avail and not args.no_memory_check:
                skipped[(dp, zero)] = f"needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
                print(f"\ndp={dp} zero={zero}: SKIPPED, {skipped[(dp, zero)]}", flush=True)
            else:
                zeros.append(zero)
        if not zeros:
            continue
        print(f"\nbytes dp={dp}: stages {zeros}, estimated need "
              f"{max(dp * rss_need(z, pb, dp, args.microbatches) for z in zeros) / 2**30:.1f} GiB; MemAvailable "
              f"{avail / 2**30:.1f} GiB", flush=True)
        opts = dict(model=base, batch=args.batch, seq=seq, zeros=zeros, microbatches=args.microbatches,
                    bucket_mb=args.bucket_mb)
        _wait(args, f"bytes dp={dp}", warnings)
        t0 = time.perf_counter()
        res = _launch(dp, "bytes", opts, tmp, f"bytes_dp{dp}", {"MALLOC_MMAP_THRESHOLD_": "131072"})
        print(f"  bytes dp={dp}: {time.perf_counter() - t0:.0f} s", flush=True)
        if res is not None:
            results[dp] = res
    return results, skipped


def _run_steps(args, dps: list, base: dict, seq: int, rounds: int, tmp: str, warnings: list) -> dict:
    """Part 2: one launch per dp, all four stages."""
    results = {}
    n_base = _param_count(base)
    for dp in dps:
        avail = _mem_available()
        need = {mode: _steps_need(n_base, dp, mode) for mode in (True, False)}
        interleave = args.interleave == "yes" or (args.interleave == "auto" and need[True] <= 0.7 * avail)
        print(f"\ndp={dp}: estimated need {need[True] / 2**30:.1f} GiB with the four trainers alive at once, "
              f"{need[False] / 2**30:.1f} GiB one after another; MemAvailable {avail / 2**30:.1f} GiB: "
              f"{'interleaved rounds' if interleave else 'stages one after another'}", flush=True)
        if need[interleave] > 0.9 * avail and not args.no_memory_check:
            warnings.append(f"dp={dp} skipped: needs ~{need[interleave] / 2**30:.0f} GiB")
            print(f"  SKIPPED: {warnings[-1]}", flush=True)
            continue
        opts = dict(model=base, batch=args.batch, seq=seq, warmup=args.warmup, rounds=rounds, zeros=list(STAGES),
                    interleave=interleave)
        _wait(args, f"dp={dp}", warnings)
        res = _launch(dp, "steps", opts, tmp, f"steps_dp{dp}")
        if res is not None:
            results[dp] = res
    return results


def _run_rss(args, stages: list, large: dict, seq: int, tmp: str, warnings: list) -> tuple[dict, dict]:
    """Part 3: one launch of 4 ranks per stage; a stage whose estimated need does not fit is skipped."""
    rss, skipped = {}, {}
    n_params = _param_count(large)
    for zero in stages:
        need = 4 * rss_need(zero, 4.0 * n_params, 4)
        avail = _mem_available()
        print(f"\nBERT-large {large['num_hidden_layers']} layers ({n_params / 1e6:.0f} M parameters), "
              f"zero={zero}: estimated need {need / 2**30:.1f} GiB for 4 ranks, MemAvailable "
              f"{avail / 2**30:.1f} GiB", flush=True)
        if need > 0.9 * avail and not args.no_memory_check:
            skipped[zero] = (f"needs ~{need / 2**30:.0f} GiB, {avail / 2**30:.0f} GiB available: rerun with "
                             f"fewer --large-layers (or --no-memory-check)")
            print(f"  SKIPPED: {skipped[zero]}", flush=True)
            continue
        opts = dict(model=large, batch=args.batch, seq=seq, zero=zero)
        _wait(args, f"BERT-large zero={zero}", warnings)
        res = _launch(4, "rss", opts, tmp, f"rss_zero{zero}", {"MALLOC_MMAP_THRESHOLD_": "131072"})
        if res is not None:
            rss[zero] = res
    return rss, skipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny BERTs (hidden 64/128, 2 layers, vocab "
                                                        "1000), 8 x 32 tokens, 2 rounds, part 1 in buckets of 1/16 MiB")
    p.add_argument("--parts", default="bytes,time,rss", help="comma-separated from bytes, time, rss")
    p.add_argument("--dps-bytes", default="2,4,8", help="dp sizes for the bytes (default 2,4,8)")
    p.add_argument("--dps", default="2,4", help="dp sizes for the step times (default 2,4)")
    p.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; --quick 32)")
    p.add_argument("--microbatches", type=int, default=1, help="part 1: Trainer microbatches (default 1)")
    p.add_argument("--bucket-mb", type=float, default=None, help="part 1: zero 1/2 bucket size in MiB (default 25, "
                                                                  "the Trainer's; --quick 1/16: several buckets)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds, one timed step per stage each "
                                                             "(default 3; --quick 2)")
    p.add_argument("--interleave", choices=["auto", "yes", "no"], default="auto",
                   help="part 2: all four trainers alive at once with interleaved rounds (yes), the stages one "
                        "after another (no), or interleaved where the estimate fits in 70%% of MemAvailable (auto)")
    p.add_argument("--large-layers", type=int, default=24, help="BERT-large layers for part 3 (default 24)")
    p.add_argument("--rss-stages", default="0,1,2,3", help="zero stages for part 3 (default 0,1,2,3)")
    p.add_argument("--no-memory-check", action="store_true", help="launch parts 1 and 3 even where the estimate "
                                                                   "says it does not fit in MemAvailable")
    p.add_argument("--wait-idle", type=float, default=None, metavar="SECONDS",
                   help="before each launch wait up to this long for other processes to go quiet (default 10; "
                        "--quick 0; 0: don't)")
    p.add_argument("--worker", choices=["bytes", "steps", "rss"], help=argparse.SUPPRESS)
    p.add_argument("--opts", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0

    parts = set(args.parts.split(","))
    if parts - {"bytes", "time", "rss"}:
        p.error(f"unknown parts {sorted(parts - {'bytes', 'time', 'rss'})}")
    dps_bytes = _ints(args.dps_bytes) if "bytes" in parts else []
    dps = _ints(args.dps) if "time" in parts else []
    rss_stages = _ints(args.rss_stages) if "rss" in parts else []
    if set(rss_stages) - set(STAGES):
        p.error("--rss-stages takes zero stages 0-3")
    seq = args.seq or (32 if args.quick else 128)
    rounds = args.rounds or (2 if args.quick else 3)
    args.wait_idle = args.wait_idle if args.wait_idle is not None else (0.0 if args.quick else 10.0)
    if any(args.batch % d for d in dps + dps_bytes) or (rss_stages and args.batch % 4):
        p.error("--batch must divide by every dp size (and by 4 for part 3)")
    if any((args.batch // d) % args.microbatches for d in dps_bytes):
        p.error("--batch / dp must divide by --microbatches at every --dps-bytes")
    args.bucket_mb = args.bucket_mb or (1 / 16 if args.quick else 25.0)
    base = TINY_BASE if args.quick else BASE
    large = dict(TINY_LARGE if args.quick else LARGE, num_hidden_layers=args.large_layers if not args.quick else 2)
    import torch
    import transformers

    part1 = (f"part 1: BERT-{'tiny' if args.quick else 'base'} at dp {', '.join(map(str, dps_bytes))}, microbatches "
             f"{args.microbatches}, buckets {args.bucket_mb:g} MiB; " if dps_bytes else "")
    print(f"# ZeRO 0-3 on CPU: BertForSequenceClassification fp32, AdamW, max_grad_norm 1.0, tp=1; global batch "
          f"{args.batch} x {seq} tokens; {part1}torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {os.cpu_count()} CPUs, MemAvailable {_mem_available() / 2**30:.1f} GiB, load "
          f"average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}{'; QUICK (tiny models)' if args.quick else ''}",
          flush=True)
    t_all = time.perf_counter()
    warnings: list[str] = []
    summary: list[str] = []
    tmp = tempfile.mkdtemp(prefix="zero_memory_")
    try:
        bytes_results, bytes_skipped = _run_bytes(args, dps_bytes, base, seq, tmp, warnings)
        step_results = _run_steps(args, dps, base, seq, rounds, tmp, warnings)
        rss, rss_skipped = _run_rss(args, rss_stages, large, seq, tmp, warnings)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if bytes_results:
        print_bytes(bytes_results, bytes_skipped, summary)
    if step_results:
        print_times(step_results, warnings)
    if rss_stages:
        print_rss(rss, rss_stages, large["num_hidden_layers"], rss_skipped, summary)
        if large["num_hidden_layers"] != LARGE["num_hidden_layers"] and not args.quick:
            print(f"\nNOTE: part 3 ran BERT-large with {large['num_hidden_layers']} layers, not 24 "
                  f"(--large-layers {large['num_hidden_layers']}).")
    if FAILED:
        warnings.append(f"failed launches: {', '.join(FAILED)}")
    print_closing(summary, warnings, t_all)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
