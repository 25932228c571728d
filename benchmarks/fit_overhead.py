"""The overhead of ``Trainer.fit`` over a bare loop of ``trainer.train_step(batch)`` calls.

What is measured
----------------
One ``BertForSequenceClassification`` (built from a config with random weights, ``torch.manual_seed(0)``, HF's
default dropout 0.1, 2 labels) sharded by ``shardlib.shard`` and trained by one ``shardlib.Trainer`` with AdamW
(lr 1e-4, no clipping, one microbatch), on two gloo ranks with one torch thread each, once per layout
(``--layouts``, default ``tp2,dp2``: ``init_mesh(tp=2)`` and ``init_mesh(dp=2)``, a fresh process pair each).

The data is a list of ``steps x batch`` samples ``{"input_ids": [seq], "attention_mask": [seq], "labels": []}``
(random token ids, full attention mask), i.e. one epoch per round. Variants, all on the same trainer:

* ``fit``:  ``trainer.fit(samples, batch_size=batch, max_steps=steps, log_interval=10, progress=False)`` (no eval,
  no ``save_dir``, so no checkpoints and no log files; shuffling on, its default). The timed window is the whole
  call: building its loaders, the DataLoader collating every batch from the samples (``default_collate``, this
  rank's dp share only), the gradient norm on its logging steps, logging, scheduler bookkeeping;
* ``bare``: ``for batch in batches: trainer.train_step(batch)`` over **pre-collated** batches: the same global
  batches collated once with ``default_collate`` before the timing, each rank holding its dp share
  (``shardlib.train.dp_shard``). So the ratio fit / bare charges fit with its data loading too;
* ``bare_norm`` (diagnostic, ``--variants fit,bare,bare_norm``): the bare loop with ``trainer.track_grad_norm =
  True``, i.e. the global gradient norm (fused ``get_total_norm`` plus a tp/pp all-reduce) on every step, where
  ``fit`` computes it only on its logging steps (every ``log_interval``-th). ``fit`` leaves
  ``track_grad_norm`` as it set it for its last step (True when that was a logging step); this benchmark resets it
  to False after every round.

After warm-up (2 bare steps, then a 2-step fit), ``--rounds`` interleaved rounds each time every variant for
``--steps`` optimizer steps; the order alternates from round to round (fit, bare; then bare, fit), so
slow drift of the machine does not favour one variant. Each window starts and ends with a barrier; its time is the
slowest rank's. samples/s = steps x global batch / window; the table gives the median over rounds and the median of
the per-round paired ratios to ``bare`` (and the ratio of the medians). Because wall time on a shared 2-core machine
swings with other processes' load, the CPU time of both ranks per sample (``time.process_time``, all threads,
summed over the ranks) is reported as well: its ratio bare / variant is a steadier measure of the work fit adds
(waiting for the other rank in a collective blocks in gloo and costs little CPU). Other processes' CPU use during
each window (whole-machine busy time from /proc/stat minus our ranks' CPU time) is printed; windows above 0.1
cores are flagged. Target: fit >= 0.97x bare.

Because those ratios carry the step-to-step spread of the training step itself (a few % on this VM even when it is
idle), the fit rounds also time what fit does besides training: ``trainer.train_step`` and ``trainer.grad_norm`` are
wrapped (instance attributes, for the fit call only) with timestamps, and fit's own work per step = (the fit
call - the time inside ``train_step``) / steps, the gradient norm (inside ``train_step``, on logging steps) separately;
a second table gives both and their share of the bare step time.

How to run
----------
    .venv/bin/python benchmarks/fit_overhead.py            # BERT hidden 256, 4 layers, 16 x 128: ~4 min idle
    .venv/bin/python benchmarks/fit_overhead.py --small    # smoke run: tiny BERT, 8 x 32 tokens, ~30 s
    .venv/bin/python benchmarks/fit_overhead.py --layouts tp2 --rounds 5 --steps 40 --variants fit,bare,bare_norm

Nothing is downloaded. The workers are started by this script (``torch.multiprocessing`` spawn; gloo over
127.0.0.1 with a free port and ``GLOO_SOCKET_IFNAME`` set to the loopback interface).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _workloads import classification_samples  # noqa: E402
from _harness import (  # noqa: E402
    free_port, loopback_ifname, machine_busy_s, print_closing, run_rank, wait_idle,
)

LAYOUTS = {"tp2": dict(tp=2), "dp2": dict(dp=2)}
VARIANTS = ("fit", "bare", "bare_norm")
DEFAULT_VARIANTS = ("fit", "bare")
FULL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, vocab_size=30522)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
IDLE_CORES = 0.1




# ------------------------------------------------------------------------------------------------------- worker
def _worker(rank: int, world: int, port: int, layout: str, opts: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import transformers
    from torch.utils.data import default_collate

    import shardlib
    from shardlib.train import dp_shard

    mesh = shardlib.init_mesh(**LAYOUTS[layout])
    config = transformers.BertConfig(**opts["model"], max_position_embeddings=512, num_labels=2)
    torch.manual_seed(0)
    model = shardlib.shard(transformers.BertForSequenceClassification(config), mesh)
    trainer = shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=1e-4))

    steps, batch, seq = opts["steps"], opts["batch"], opts["seq"]
    samples = classification_samples(steps * batch, seq, config.vocab_size)
    batches = [dp_shard(default_collate(samples[i * batch:(i + 1) * batch]), mesh) for i in range(steps)]

    inside = {"step": 0.0, "norm": 0.0, "call": 0.0}  # seconds of the last fit call: in train_step, in grad_norm

    def timed(fn, key):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inside[key] += time.perf_counter() - t0
        return wrapper

    def run(variant: str, n: int) -> None:
        if variant == "fit":
            inside.update(step=0.0, norm=0.0)
            # instance attributes for the call: fit's own time = the call minus the time inside train_step
            trainer.train_step, trainer.grad_norm = timed(trainer.train_step, "step"), timed(trainer.grad_norm, "norm")
            t0 = time.perf_counter()
            try:
                result = trainer.fit(samples, batch_size=batch, max_steps=n, log_interval=10, progress=False)
            finally:
                inside["call"] = time.perf_counter() - t0
                del trainer.train_step, trainer.grad_norm
            assert len(result.losses) == n
            return
        trainer.track_grad_norm = variant == "bare_norm"
        for b in batches[:n]:
            trainer.train_step(b)

    # warm-up: allocator, AdamW state, DataLoader / fit imports
    run("bare", 2)
    run("fit", 2)
    trainer.track_grad_norm = False
    records = []
    for r in range(opts["rounds"]):
        order = list(opts["variants"]) if r % 2 == 0 else list(reversed(opts["variants"]))
        for variant in order:
            gc.collect()
            dist.barrier()
            busy0, own0, t0 = machine_busy_s(), time.process_time(), time.perf_counter()
            run(variant, steps)
            dist.barrier()
            wall, busy, own = time.perf_counter() - t0, machine_busy_s() - busy0, time.process_time() - own0
            trainer.track_grad_norm = False  # fit leaves it as it set it for its last step
            outside = inside["call"] - inside["step"] if variant == "fit" else 0.0
            t = torch.tensor([wall, outside, inside["norm"] if variant == "fit" else 0.0, own], dtype=torch.float64)
            dist.all_reduce(t[:3], op=dist.ReduceOp.MAX)
            dist.all_reduce(t[3:])
            wall, outside, norm, own = t.tolist()
            records.append(dict(round=r, variant=variant, wall_s=wall, samples_per_s=steps * batch / wall,
                                outside_ms_per_step=outside * 1e3 / steps, norm_ms_per_step=norm * 1e3 / steps,
                                cpu_ms_per_sample=own * 1e3 / (steps * batch),
                                foreign_cores=max(0.0, (busy - own) / wall) if wall >= 0.5 else None))
            if rank == 0:
                print(f"  {layout} round {r} {variant:<9} {steps * batch / wall:8.1f} samples/s "
                      f"({wall:.2f} s; CPU {own:.2f} s over both ranks)", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(records=records, mesh=str(mesh)), f)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------- parent
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="smoke run: tiny BERT (2 layers, hidden 64, vocab 1000), "
                                                        "8 x 32 tokens, 10 steps per round")
    p.add_argument("--layouts", default="tp2,dp2", help="comma-separated from: " + ", ".join(LAYOUTS))
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated from: " + ", ".join(VARIANTS)
                   + " (default " + ",".join(DEFAULT_VARIANTS) + "; bare is the baseline and always runs)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per variant and round (default 30; "
                                                           "--small 10)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default 16; --small 8)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; --small 32)")
    p.add_argument("--wait-idle", type=float, default=60.0, metavar="SECONDS",
                   help="before each layout, wait up to this long for other processes to go quiet (0: don't)")
    args = p.parse_args(argv)
    layouts = args.layouts.split(",")
    variants = args.variants.split(",")
    if "bare" not in variants:
        variants.insert(0, "bare")
    for x in layouts:
        if x not in LAYOUTS:
            p.error(f"unknown layout {x!r}")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}")
    opts = dict(model=SMALL if args.small else FULL, rounds=args.rounds, variants=variants,
                steps=args.steps or (10 if args.small else 30), batch=args.batch or (8 if args.small else 16),
                seq=args.seq or (32 if args.small else 128))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
    m = opts["model"]
    print(f"# Trainer.fit vs bare train_step loop: BertForSequenceClassification {m['num_hidden_layers']} layers, "
          f"hidden {m['hidden_size']}, vocab {m['vocab_size']}; global batch {opts['batch']} x {opts['seq']} tokens; "
          f"{opts['steps']} steps per variant per round, {opts['rounds']} rounds; 2 gloo ranks x 1 thread; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    t_all = time.perf_counter()
    results = {}
    for layout in layouts:
        load = wait_idle(args.wait_idle, IDLE_CORES) if args.wait_idle > 0 else 0.0
        if load > IDLE_CORES:
            print(f"  WARNING: {load:.2f} cores busy by other processes before {layout}", flush=True)
        tmp = tempfile.mkdtemp(prefix="fit_overhead_")
        try:
            out = os.path.join(tmp, "result.json")
            mp.start_processes(run_rank, args=(_worker, 2, free_port(), layout, opts, out), nprocs=2, join=True,
                               start_method="spawn")
            with open(out) as f:
                results[layout] = json.load(f)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    print()
    print("| layout | variant | samples/s (median of rounds) | per round | ratio to bare (median of paired) | "
          "ratio of medians | CPU ms per sample (median) | CPU ratio bare / variant (median of paired) |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    warnings = []
    summary = []
    for layout in layouts:
        recs = results[layout]["records"]
        by = {v: [r for r in recs if r["variant"] == v] for v in variants}
        bare = {r["round"]: r["samples_per_s"] for r in by["bare"]}
        bare_cpu = {r["round"]: r["cpu_ms_per_sample"] for r in by["bare"]}
        med_bare = statistics.median(bare.values())
        for v in variants:
            rates = [r["samples_per_s"] for r in by[v]]
            med = statistics.median(rates)
            paired = statistics.median(r["samples_per_s"] / bare[r["round"]] for r in by[v])
            cpu = statistics.median(r["cpu_ms_per_sample"] for r in by[v])
            cpu_paired = statistics.median(bare_cpu[r["round"]] / r["cpu_ms_per_sample"] for r in by[v])
            print(f"| {layout} | {v} | {med:.1f} | {' / '.join(f'{x:.1f}' for x in rates)} | {paired:.3f}x | "
                  f"{med / med_bare:.3f}x | {cpu:.1f} | {cpu_paired:.3f}x |")
            if v.startswith("fit"):
                summary.append(f"{layout}: {v} / bare = {paired:.3f}x samples/s (target >= 0.97x: "
                               f"{'MET' if paired >= 0.97 else 'MISSED'}); by CPU time {cpu_paired:.3f}x")
            for r in by[v]:
                if r["foreign_cores"] is not None and r["foreign_cores"] > IDLE_CORES:
                    warnings.append(f"{layout} round {r['round']} {v}: other processes used "
                                    f"{r['foreign_cores']:.2f} cores during the window")
    print()
    print("Inside the fit windows (timestamps around train_step and grad_norm; slowest rank; median of rounds):")
    print()
    print("| layout | fit's own work outside train_step, ms per step | gradient norm (logging steps), ms per step | "
          "both, share of the bare step |")
    print("|---|---:|---:|---:|")
    for layout in layouts:
        recs = results[layout]["records"]
        fits = [r for r in recs if r["variant"] == "fit"]
        outside = statistics.median(r["outside_ms_per_step"] for r in fits)
        norm = statistics.median(r["norm_ms_per_step"] for r in fits)
        bare_step_ms = statistics.median(r["wall_s"] for r in recs if r["variant"] == "bare") * 1e3 / opts["steps"]
        print(f"| {layout} | {outside:.2f} | {norm:.2f} | {(outside + norm) / bare_step_ms:.2%} |")
    print_closing(summary, warnings, t_all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
