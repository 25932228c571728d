"""ZeRO stages 0-3 on CPU: the bytes each dp rank holds, the step time, and the peak RSS of a large model.

What is measured
----------------
``BertForSequenceClassification`` built from a config (random weights, ``torch.manual_seed(0)`` on every rank, HF's
default dropout 0.1, 2 labels), ``shardlib.shard(model, init_mesh(tp=1))`` (dp = the number of ranks), trained by
``shardlib.Trainer(model, lambda ps: AdamW(ps, lr=1e-4), max_grad_norm=1.0, precision="fp32", zero=k)`` on
SST-2-shaped batches (``_workloads.classification_samples``: random tokens, full mask; global batch ``--batch``
x ``--seq`` tokens, each rank its ``dp_shard``). Every group of ranks is started by this script through
``python -m shardlib.cli run --nproc N`` (gloo over loopback, one torch thread per rank); each launch is a fresh
process group:

1. **Bytes per rank at dp=4**, BERT-base (hidden 768, 12 layers, 12 heads, intermediate 3072, vocab 30522), for
   zero 0/1/2/3, in the dp=4 launch of 2., after its timed steps (so AdamW's state exists):

   * optimizer state: every tensor of ``shardlib.train.optim.param_state(trainer.optimizer, p)`` over ``trainer.params``
     (``exp_avg``, ``exp_avg_sq``, ``step``; the local shard of a DTensor);
   * parameters: ``shardlib.train.fsdp.local(p)`` over ``trainer.params``;
   * gradients: ``trainer.zero_grad(); trainer.forward_backward(batch, total_items=...)``, then ``local(p.grad)``
     bytes counted twice: right after backward (what a step holds at its gradient peak) and after
     ``trainer.reduce_gradients()`` (what stays until the optimizer step; zero=1 drops the gradients of parameters
     another rank steps there too).

   Each next to full/4, full being the zero=0 figure, and the ratio max over ranks / (full/4). Target: <= 1.05x for
   what the stage partitions (optimizer state for zero >= 1, gradients after the reduction for zero >= 2, parameters
   for zero = 3). The sum over ranks / full shows that nothing is held twice.

2. **Step time** of each stage against zero=0 at dp=2 and dp=4 (``--dps``; one launch per dp). Interleaved
   (``--interleave yes``): one Trainer per stage, all four alive at once (fresh models, same seed); ``--warmup``
   untimed steps of each, then ``--rounds`` rounds of one timed ``trainer.train_step`` per stage, the order
   alternating from round to round (0 1 2 3, 3 2 1 0, ...) so that bursts and drift of other processes' load spread
   over the stages. That holds every stage's parameters and AdamW state at once (BERT-base at dp=4: ~5.2 GiB peak
   per rank, ~21 GiB in all), so ``--interleave auto`` (the default) does it only where the estimate
   (:func:`_steps_need`) fits in 70% of MemAvailable, and otherwise runs the stages one after another, each on a fresh
   model freed before the next (``--warmup`` untimed, then ``--rounds`` timed steps). Each step runs between two
   barriers (its time is the slowest rank's); ``trainer.zero_grad()`` after each step, outside the window, so only
   one stage's gradients exist at a time. Per stage: the median step, the median of the ratios zero_k / zero_0
   paired by round and the ratio of the medians. The CPU time of all ranks per
   step (``time.process_time``, summed over ranks) is given too: waiting in a collective costs little CPU, so its
   ratio is a steadier measure of the work a stage adds on a shared machine (not of its communication time).
   Other processes' CPU use during each step (whole-machine busy time from /proc/stat minus our ranks' CPU) is
   printed; steps above 0.1 cores are flagged.

3. **Peak RSS per rank** of BERT-large (hidden 1024, ``--large-layers`` layers (default 24), 16 heads,
   intermediate 4096) training at dp=4, zero 0 vs zero 3, one fresh launch per stage with
   ``MALLOC_MMAP_THRESHOLD_=131072`` in the ranks' environment (glibc then serves every allocation above 128 KiB by
   mmap and gives it back at free, so the resident set follows the live tensors and a peak is a peak). Per rank,
   after building model and Trainer: ``malloc_trim``, RSS, then VmHWM reset (``/proc/self/clear_refs`` = 5), two
   training steps (the first allocates AdamW's state), VmHWM again: the step peak. Also the process's lifetime
   peak (``ru_maxrss``): every rank builds the full model before FSDP2 shards it, so zero=3's lifetime peak is at
   least one whole fp32 model plus the runtime (below its step peak in our runs). Max over ranks.

   zero=0 at 24 layers needs about 4 x (1.34 GB parameters + 1.34 GB gradients + 1.34 GB of the flat all-reduce
   buffer + 2.7 GB AdamW + AdamW's temporaries) ~ 28 GB: before each launch the script estimates the need
   (``RSS_PER_PARAM_BYTE`` x fp32 parameter bytes + ``RSS_BASE`` per rank; from a measurement of hidden 1024 x 8
   layers: 2807 MiB per rank) and skips the launch with a message when it exceeds 90% of MemAvailable; rerun with
   ``--large-layers 12`` (or ``--no-memory-check``).

How to run
----------
    .venv/bin/python benchmarks/zero_memory.py                      # BERT-large 24 layers (zero=0 needs ~29 GiB)
    .venv/bin/python benchmarks/zero_memory.py --large-layers 12    # on a 24 GiB machine (see 3.): ~8 min idle
    .venv/bin/python benchmarks/zero_memory.py --quick              # smoke run: tiny BERTs, ~1.5 minutes
    .venv/bin/python benchmarks/zero_memory.py --parts bytes,time --rounds 5 --batch 16

Nothing is downloaded. The ranks run this file with ``--worker ...`` (internal).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import loopback_ifname, print_closing, wait_idle  # noqa: E402
from _zero_memory_workload import (  # noqa: E402
    BASE, IDLE_CORES, LARGE, MIB, PARTITIONED, RSS_BASE, RSS_PER_PARAM_BYTE, RSS_PER_PARAM_BYTE_Z3, STAGES, TARGET,
    TINY_BASE, TINY_LARGE, worker_main,
)


# ================================================================================================== driver side
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


def _mib(x: float) -> str:
    return f"{x / MIB:,.1f}"


def _print_bytes(counts: dict, world: int, summary: list) -> None:
    print(f"\n### 1. Bytes per rank at dp={world} (tp=1), fp32, AdamW (MiB; full = the zero=0 figure; "
          f"ratio = max over ranks / (full/{world}))\n")
    print(f"| zero | quantity | max rank | min rank | full/{world} | ratio max / (full/{world}) | "
          "sum over ranks / full | target |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    names = {"opt": "optimizer state", "param": "parameters", "grad_before": "gradients after backward",
             "grad_after": "gradients after reduce_gradients"}
    full = {q: max(r[q] for r in counts["0"]) for q in names}
    for zero in sorted(counts, key=int):
        ranks = counts[zero]
        for q, name in names.items():
            hi, lo, tot = max(r[q] for r in ranks), min(r[q] for r in ranks), sum(r[q] for r in ranks)
            ideal = full[q] / world
            ratio = hi / ideal if ideal else float("nan")
            target = ""
            if q in PARTITIONED and int(zero) >= PARTITIONED[q]:
                met = ratio <= TARGET
                target = f"<= {TARGET}x: {'met' if met else 'MISSED'}"
                summary.append(f"zero={zero} {name}: {ratio:.3f}x of full/{world} on the largest rank "
                               f"({'met' if met else 'MISSED'})")
            print(f"| {zero} | {name} | {_mib(hi)} | {_mib(lo)} | {_mib(ideal)} | {ratio:.3f}x | "
                  f"{tot / full[q] if full[q] else float('nan'):.3f} | {target} |")


def _print_times(results: dict, warnings: list) -> None:
    print("\n### 2. Step time per stage against zero=0 (each step between barriers, slowest rank)\n")
    print("| dp | zero | rounds | step s (median) | per round | zero_k / zero_0 (median of paired) | ratio of medians | "
          "CPU s per step, all ranks (median) | CPU zero_k / zero_0 (median of paired) | other processes, cores "
          "(median) |")
    print("|---:|---:|---|---:|---|---:|---:|---:|---:|---:|")
    for world, res in sorted(results.items()):
        by = {}
        for r in res["records"]:
            by.setdefault(r["zero"], {})[r["round"]] = r
        if 0 not in by:
            continue
        base = by[0]
        base_wall = statistics.median(r["wall_s"] for r in base.values())
        for zero in sorted(by):
            recs = by[zero]
            walls = [recs[k]["wall_s"] for k in sorted(recs)]
            med = statistics.median(walls)
            paired = statistics.median(recs[k]["wall_s"] / base[k]["wall_s"] for k in recs)
            cpu = statistics.median(r["cpu_s"] for r in recs.values())
            cpu_paired = statistics.median(recs[k]["cpu_s"] / base[k]["cpu_s"] for k in recs)
            foreign = [r["foreign_cores"] for r in recs.values() if r["foreign_cores"] is not None]
            mode = "interleaved" if res.get("interleave") else "sequential"
            print(f"| {world} | {zero} | {mode} | {med:.2f} | {' / '.join(f'{w:.2f}' for w in walls)} | {paired:.2f}x | "
                  f"{med / base_wall:.2f}x | {cpu:.2f} | {cpu_paired:.2f}x | "
                  f"{f'{statistics.median(foreign):.2f}' if foreign else 'n/a'} |")
            busy = [f for f in foreign if f > IDLE_CORES]
            if busy:
                warnings.append(f"dp={world} zero={zero}: other processes used more than {IDLE_CORES} cores during "
                                f"{len(busy)} of {len(recs)} timed steps (up to {max(busy):.2f})")
    print()
    for world, res in sorted(results.items()):
        if res.get("peak_rss"):
            print(f"dp={world}: peak RSS of a rank {res['peak_rss'] / MIB:,.0f} MiB"
                  f"{' (all four trainers alive)' if res.get('interleave') else ''}")
    print("(interleaved: round r = one step of every stage, order alternating, paired within the round; "
          "sequential: the stages one after another, round r = the stage's r-th timed step)")


def _print_rss(rss: dict, layers: int, skipped: dict, summary: list) -> None:
    print(f"\n### 3. Peak RSS per rank, BERT-large ({layers} layers) at dp=4, MALLOC_MMAP_THRESHOLD_=131072 "
          "(MiB, max over ranks)\n")
    print("| zero | local parameters | RSS before the steps | peak during 2 training steps | "
          "lifetime peak (incl. build) | step s (rank 0) |")
    print("|---:|---:|---:|---:|---:|---|")
    for zero in (0, 3):
        if zero in skipped:
            print(f"| {zero} | skipped: {skipped[zero]} | | | | |")
            continue
        if zero not in rss:
            print(f"| {zero} | failed | | | | |")
            continue
        ranks = rss[zero]["ranks"]
        m = {k: max(r[k] for r in ranks) for k in ("param_bytes", "before", "step_hwm", "lifetime")}
        reset = all(r["reset"] for r in ranks)
        print(f"| {zero} | {_mib(m['param_bytes'])} | {_mib(m['before'])} | "
              f"{_mib(m['step_hwm'])}{'' if reset else ' (VmHWM not reset: lifetime)'} | {_mib(m['lifetime'])} | "
              f"{' / '.join(f'{s:.1f}' for s in ranks[0]['step_s'])} |")
    if 0 in rss and 3 in rss:
        p0 = max(r["step_hwm"] for r in rss[0]["ranks"])
        p3 = max(r["step_hwm"] for r in rss[3]["ranks"])
        l0 = max(r["lifetime"] for r in rss[0]["ranks"])
        l3 = max(r["lifetime"] for r in rss[3]["ranks"])
        summary.append(f"BERT-large {layers} layers dp=4 peak RSS per rank during training: zero=3 "
                       f"{p3 / MIB:,.0f} MiB vs zero=0 {p0 / MIB:,.0f} MiB ({p3 / p0:.2f}x); lifetime incl. "
                       f"building the model {l3 / MIB:,.0f} vs {l0 / MIB:,.0f} MiB ({l3 / l0:.2f}x)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny BERTs (hidden 64/128, 2 layers, vocab "
                                                        "1000), 8 x 32 tokens, 2 rounds")
    p.add_argument("--parts", default="bytes,time,rss", help="comma-separated from bytes, time, rss (bytes runs "
                                                              "with the dp=4 timing launch)")
    p.add_argument("--dps", default="2,4", help="dp sizes for the step times (bytes: always dp=4)")
    p.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; --quick 32)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds, one timed step per stage each "
                                                             "(default 3; --quick 2)")
    p.add_argument("--interleave", choices=["auto", "yes", "no"], default="auto",
                   help="part 2: all four trainers alive at once with interleaved rounds (yes), the stages one "
                        "after another (no), or interleaved where the estimate fits in 70%% of MemAvailable (auto)")
    p.add_argument("--large-layers", type=int, default=24, help="BERT-large layers for part 3 (default 24)")
    p.add_argument("--no-memory-check", action="store_true", help="launch part 3 even where the estimate says "
                                                                   "it does not fit in MemAvailable")
    p.add_argument("--wait-idle", type=float, default=None, metavar="SECONDS",
                   help="before each launch wait up to this long for other processes to go quiet (default 10; "
                        "--quick 0; 0: don't)")
    p.add_argument("--worker", choices=["steps", "rss"], help=argparse.SUPPRESS)
    p.add_argument("--opts", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0

    parts = set(args.parts.split(","))
    if parts - {"bytes", "time", "rss"}:
        p.error(f"unknown parts {sorted(parts - {'bytes', 'time', 'rss'})}")
    dps = sorted({int(x) for x in args.dps.split(",")}) if "time" in parts else []
    if "bytes" in parts and 4 not in dps:
        dps.append(4)
    seq = args.seq or (32 if args.quick else 128)
    rounds = args.rounds or (2 if args.quick else 3)
    wait = args.wait_idle if args.wait_idle is not None else (0.0 if args.quick else 10.0)
    args.wait_idle = wait
    if any(args.batch % d for d in dps) or args.batch % 4:
        p.error("--batch must divide by every dp size (and by 4 for part 3)")
    base = TINY_BASE if args.quick else BASE
    large = dict(TINY_LARGE if args.quick else LARGE, num_hidden_layers=args.large_layers if not args.quick else 2)
    import torch
    import transformers

    print(f"# ZeRO 0-3 on CPU: BertForSequenceClassification fp32, AdamW, max_grad_norm 1.0, tp=1; global batch "
          f"{args.batch} x {seq} tokens; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{os.cpu_count()} CPUs, MemAvailable {_mem_available() / 2**30:.1f} GiB, load average "
          f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}{'; QUICK (tiny models)' if args.quick else ''}",
          flush=True)
    t_all = time.perf_counter()
    warnings: list[str] = []
    summary: list[str] = []
    tmp = tempfile.mkdtemp(prefix="zero_memory_")
    try:
        step_results = {}
        n_base = _param_count(base) if dps else 0
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
            opts = dict(model=base, batch=args.batch, seq=seq, warmup=args.warmup, rounds=rounds,
                        zeros=list(STAGES), bytes=("bytes" in parts and dp == 4), interleave=interleave)
            _wait(args, f"dp={dp}", warnings)
            res = _launch(dp, "steps", opts, tmp, f"steps_dp{dp}")
            if res is not None:
                step_results[dp] = res

        rss, skipped = {}, {}
        if "rss" in parts:
            n_params = _param_count(large)
            for zero in (0, 3):
                factor = RSS_PER_PARAM_BYTE if zero == 0 else RSS_PER_PARAM_BYTE_Z3
                need = 4 * (factor * 4 * n_params + RSS_BASE)
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
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if 4 in step_results and step_results[4]["counts"]:
        _print_bytes(step_results[4]["counts"], 4, summary)
    if "time" in parts and step_results:
        _print_times(step_results, warnings)
    if "rss" in parts:
        _print_rss(rss, large["num_hidden_layers"], skipped, summary)
        if large["num_hidden_layers"] != LARGE["num_hidden_layers"] and not args.quick:
            print(f"\nNOTE: part 3 ran BERT-large with {large['num_hidden_layers']} layers, not 24 "
                  f"(--large-layers {large['num_hidden_layers']}).")
    print_closing(summary, warnings, t_all)
    return 0 if (not dps or len(step_results) == len(dps)) else 1


if __name__ == "__main__":
    sys.exit(main())
