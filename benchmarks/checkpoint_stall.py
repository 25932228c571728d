"""How long a checkpoint save in ``Trainer.fit`` stalls training, against a synchronous ``checkpoint.save``.

What is measured
----------------
A BERT-base ``BertForSequenceClassification`` (12 layers, hidden 768, 12 heads, intermediate 3072, vocab 30522,
2 labels, HF's default dropout 0.1; random weights from ``torch.manual_seed(0)``) sharded at tp=2 over two gloo
ranks with one torch thread each (``--world 1``: one process, tp=1), trained by a ``shardlib.Trainer`` with
AdamW (lr 1e-4) on a global batch of 4 x 128 random tokens. In one process pair, in this order:

1. warm-up: 2 ``trainer.train_step`` calls on pre-collated batches (AdamW's moments exist from here on);
2. ``--bare-steps`` timed bare ``train_step`` calls: the step time (per step the slowest rank; median);
3. a synchronous save, ``shardlib.checkpoint.save(model, dir, optimizer=trainer.optimizer)`` on all ranks, after a
   barrier: its wall time on the slowest rank (model + AdamW state, every file fsynced) into a fresh directory;
4. ``trainer.fit(samples, batch_size=4, max_steps=45, save_dir=..., save_interval=20, log_interval=10,
   progress=False)``: saves after steps 20 and 40 and the final save after step 45 (``fit`` saves at the end too;
   it first waits for the step-40 write, which is long done by then). Recorded per save: ``FitResult.save_blocked_s``
   (the time ``TrainCheckpoints.save`` spends staging the local shards, which the loop waits for; the slowest
   rank); the loop's stall at that save measured from outside (``train_step`` is wrapped on the instance to
   timestamp every step, ``shardlib.checkpoint.commit`` to timestamp the background write): from the end of the
   step that triggered the save to the start of its background write, and, where a next step exists, the gap
   between the two steps minus the median gap between other steps; both also contain what ``save_blocked_s``
   leaves out (waiting for the previous save's thread, creating the commit process group at the first save); the
   duration of the background write; how many training steps ran while the write was in
   flight and how much longer they took than the median step without a write (the write thread competes with the
   ranks for the 2 cores: that is a stall too, just not one the loop waits for); and, after the last save, how long
   ``fit`` waits at its end for the write to finish;
5. two more synchronous saves (3 in all; the median is reported).

Blocked share = blocked time per save / (20 x step time); target <= 10%. The step time is the smaller of the bare
median (2.) and the median of fit's steps that ran without a write in flight (a burst of foreign load in either
window would inflate it; the smaller gives the larger share). Note that fit computes the gradient norm on its logging
steps (every 10th), the bare steps never. The table also gives the share
counting the slower steps during the write, and the synchronous save's share for comparison.

How to run
----------
    .venv/bin/python benchmarks/checkpoint_stall.py            # BERT-base tp=2: ~3 minutes idle, ~5 busy
    .venv/bin/python benchmarks/checkpoint_stall.py --small    # smoke run: tiny BERT, 12 steps, save every 4

Nothing is downloaded. The workers are started by this script (``torch.multiprocessing`` spawn; gloo over
127.0.0.1 with a free port and ``GLOO_SOCKET_IFNAME`` set to the loopback interface). Checkpoints go to a temp
directory that is removed at the end.
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
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _workloads import classification_samples  # noqa: E402
from _harness import (  # noqa: E402
    free_port, loopback_ifname, machine_busy_s, run_rank, wait_idle,
)

FULL = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
IDLE_CORES = 0.1
SYNC_SAVES = 3




def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------------------- worker
def _writing() -> bool:
    return any(t.name.startswith("shardlib-save-step-") and t.is_alive() for t in threading.enumerate())


def _worker(rank: int, world: int, port: int, opts: dict, work: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(opts["threads"])
    import transformers
    from torch.utils.data import default_collate

    import shardlib
    import shardlib.checkpoint as checkpoint
    from shardlib.train import dp_shard

    work = Path(work)
    mesh = shardlib.init_mesh(tp=world)
    config = transformers.BertConfig(**opts["model"], max_position_embeddings=512, num_labels=2)
    torch.manual_seed(0)
    model = shardlib.shard(transformers.BertForSequenceClassification(config), mesh)
    trainer = shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=1e-4))
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    steps, batch, seq, interval = opts["steps"], opts["batch"], opts["seq"], opts["save_interval"]
    samples = classification_samples(steps * batch, seq, config.vocab_size)
    bare_batches = [dp_shard(default_collate(samples[i * batch:(i + 1) * batch]), mesh)
                    for i in range(2 + opts["bare_steps"])]

    def max_over_ranks(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def barrier():
        if world > 1:
            dist.barrier()

    # 1. warm-up, 2. bare steps
    for b in bare_batches[:2]:
        trainer.train_step(b)
    bare = []
    busy0, own0, wall0 = machine_busy_s(), time.process_time(), time.perf_counter()
    for b in bare_batches[2:]:
        t0 = time.perf_counter()
        trainer.train_step(b)
        bare.append(time.perf_counter() - t0)
    bare_window = (machine_busy_s() - busy0, time.process_time() - own0, time.perf_counter() - wall0)
    bare = max_over_ranks(bare)

    # synchronous saves
    sync = []

    def sync_save(i: int) -> None:
        gc.collect()
        barrier()
        t0 = time.perf_counter()
        checkpoint.save(model, work / f"sync-{i}", optimizer=trainer.optimizer)
        seconds = time.perf_counter() - t0
        barrier()
        if rank == 0:
            sync_bytes.append(_dir_bytes(work / f"sync-{i}"))
            shutil.rmtree(work / f"sync-{i}")
        barrier()
        sync.append(max_over_ranks([seconds])[0])

    sync_bytes: list[int] = []
    sync_save(0)

    # 4. fit, instrumented from outside
    starts, ends, writing = [], [], []
    original_step = trainer.train_step

    def timed_step(b):
        writing.append(_writing())
        starts.append(time.perf_counter())
        loss = original_step(b)
        ends.append(time.perf_counter())
        return loss

    commits = []  # (start, end) of each background commit
    original_commit = checkpoint.commit

    def timed_commit(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original_commit(*args, **kwargs)
        finally:
            if threading.current_thread() is not threading.main_thread():
                commits.append((t0, time.perf_counter()))

    trainer.train_step = timed_step
    checkpoint.commit = timed_commit
    gc.collect()
    barrier()
    busy0, own0, wall0 = machine_busy_s(), time.process_time(), time.perf_counter()
    result = trainer.fit(samples, batch_size=batch, max_steps=steps, save_dir=work / "fit", save_interval=interval,
                         log_interval=10, progress=False)
    fit_return = time.perf_counter()
    fit_window = (machine_busy_s() - busy0, time.process_time() - own0, fit_return - wall0)
    del trainer.train_step
    checkpoint.commit = original_commit
    ckpt_bytes = _dir_bytes(result.checkpoints[-1]) if rank == 0 else 0

    # 5. more synchronous saves
    for i in range(1, SYNC_SAVES):
        sync_save(i)

    # per-step series, slowest rank (each rank's own gaps first, then the max)
    step_s = max_over_ranks([e - s for s, e in zip(starts, ends)])
    gaps = max_over_ranks([starts[i + 1] - ends[i] for i in range(len(starts) - 1)])
    writing = [bool(x) for x in max_over_ranks([float(w) for w in writing])]
    blocked = max_over_ranks(result.save_blocked_s)
    commit_s = max_over_ranks([e - s for s, e in commits])
    # from the end of the step that triggered each save to its background write starting: the loop's stall at the
    # save measured from outside (staging plus whatever precedes it), also for the last save, which has no next step
    saved_steps = [int(p.name.split("-")[1]) for p in result.checkpoints]
    until_write = max_over_ranks([c[0] - ends[s - result.first_step - 1] for c, s in zip(commits, saved_steps)])
    end_wait = max_over_ranks([fit_return - ends[-1]])[0]
    own = torch.tensor([bare_window[1], fit_window[1]], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(own)
    if rank == 0:
        foreign = lambda w, o: max(0.0, (w[0] - o) / w[2])  # noqa: E731
        with open(work / "result.json", "w") as f:
            json.dump(dict(bare=bare, sync=sync, sync_bytes=sync_bytes, ckpt_bytes=ckpt_bytes, step_s=step_s,
                           gaps=gaps, writing=writing, blocked=blocked, commit_s=commit_s, end_wait=end_wait,
                           saved_steps=saved_steps, until_write=until_write,
                           local_bytes=local_bytes, mesh=str(mesh), losses=result.losses,
                           foreign_bare=foreign(bare_window, own[0].item()),
                           foreign_fit=foreign(fit_window, own[1].item())), f)
    barrier()
    if world > 1:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------- parent
def _analyse(r: dict, interval: int) -> dict:
    """Per save: blocked (FitResult), the loop's gap at the save minus the typical gap, the background write, the
    steps the write overlapped and their excess over the median step without a write."""
    step_s, gaps, writing = r["step_s"], r["gaps"], r["writing"]
    clean = [t for i, t in enumerate(step_s) if i > 0 and not writing[i]]
    clean_med = statistics.median(clean)
    save_after = {s - 1 for s in r["saved_steps"]}  # index of the step after which the save ran
    typical_gap = statistics.median(g for i, g in enumerate(gaps) if i not in save_after)
    saves = []
    for k, s in enumerate(r["saved_steps"]):
        i = s - 1
        nxt = range(i + 1, min(i + 1 + interval, len(step_s)))
        overlapped = [j for j in nxt if writing[j]]
        saves.append(dict(step=s, blocked=r["blocked"][k] if k < len(r["blocked"]) else None,
                          gap=(gaps[i] - typical_gap) if i < len(gaps) else None,
                          until_write=r["until_write"][k] if k < len(r["until_write"]) else None,
                          commit=r["commit_s"][k] if k < len(r["commit_s"]) else None,
                          overlapped=len(overlapped), excess=sum(step_s[j] - clean_med for j in overlapped)))
    return dict(clean_med=clean_med, typical_gap=typical_gap, saves=saves)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="smoke run: tiny BERT, 4 x 32 tokens, 12 steps, save "
                                                        "every 4")
    p.add_argument("--world", type=int, default=2, choices=(1, 2), help="ranks (tp = world; default 2)")
    p.add_argument("--steps", type=int, default=None, help="fit steps (default 45; --small 12)")
    p.add_argument("--save-interval", type=int, default=None, help="default 20; --small 4")
    p.add_argument("--bare-steps", type=int, default=None, help="timed bare steps (default 8; --small 4)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=None, help="default 128; --small 32")
    p.add_argument("--wait-idle", type=float, default=30.0, metavar="SECONDS",
                   help="first wait up to this long for other processes to go quiet (default 30; 0: don't)")
    args = p.parse_args(argv)
    opts = dict(model=SMALL if args.small else FULL, steps=args.steps or (12 if args.small else 45),
                save_interval=args.save_interval or (4 if args.small else 20),
                bare_steps=args.bare_steps or (4 if args.small else 8), batch=args.batch,
                seq=args.seq or (32 if args.small else 128), threads=1 if args.world == 2 else 2)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
    m, interval = opts["model"], opts["save_interval"]
    print(f"# checkpoint stall in Trainer.fit: BertForSequenceClassification {m['num_hidden_layers']} layers, "
          f"hidden {m['hidden_size']}, vocab {m['vocab_size']}, AdamW; tp={args.world} on {args.world} gloo rank(s) "
          f"x {opts['threads']} thread(s); batch {opts['batch']} x {opts['seq']} tokens; fit {opts['steps']} steps, "
          f"save every {interval}; torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    if args.wait_idle > 0:
        load = wait_idle(args.wait_idle, IDLE_CORES)
        if load > IDLE_CORES:
            print(f"  WARNING: {load:.2f} cores busy by other processes before the run", flush=True)
    t_all = time.perf_counter()
    work = tempfile.mkdtemp(prefix="checkpoint_stall_")
    try:
        mp.start_processes(run_rank, args=(_worker, args.world, free_port(), opts, work), nprocs=args.world, join=True,
                           start_method="spawn")
        with open(os.path.join(work, "result.json")) as f:
            r = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    a = _analyse(r, interval)
    bare_med = statistics.median(r["bare"])
    # the step time the shares are taken of: the smaller of the bare median and fit's median step without a write
    # (a burst of foreign load in one of the two windows inflates it; the smaller one gives the larger, safer share)
    step_ref = min(bare_med, a["clean_med"])
    window = interval * step_ref
    sync_med = statistics.median(r["sync"])
    saves = a["saves"]
    blocked = [s["blocked"] for s in saves]
    measured = [s["until_write"] for s in saves]
    effective = [max(s["blocked"], s["until_write"]) + max(0.0, s["excess"]) for s in saves]
    blocked_med, measured_med, eff = (statistics.median(x) for x in (blocked, measured, effective))

    def per(xs):
        return " / ".join(f"{x:.3f}" for x in xs)

    print()
    print(f"{r['mesh']}; local parameters {r['local_bytes'] / 2**20:.0f} MiB per rank; checkpoint (model + AdamW) "
          f"{r['ckpt_bytes'] / 2**20:.0f} MiB on disk (sync save {statistics.median(r['sync_bytes']) / 2**20:.0f} "
          f"MiB)")
    print(f"step time: bare median {bare_med * 1e3:.0f} ms ({len(r['bare'])} steps); in fit, steps without a write "
          f"in flight, median {a['clean_med'] * 1e3:.0f} ms; the shares use the smaller: {interval} steps = "
          f"{window:.1f} s; fit's loop gap between steps {a['typical_gap'] * 1e3:.1f} ms")
    print()
    print("| per save | synchronous `checkpoint.save` | async in `fit`: blocked (`save_blocked_s`) | async: end of step "
          "to write start (measured) | async: that + slower steps during the write |")
    print("|---|---:|---:|---:|---:|")
    print(f"| loop stalled, s (median) | {sync_med:.3f} | {blocked_med:.3f} | {measured_med:.3f} | {eff:.3f} |")
    print(f"| each save, s | {per(r['sync'])} | {per(blocked)} | {per(measured)} | {per(effective)} |")
    print(f"| share of {interval} steps ({interval} x {step_ref:.3f} s) | {sync_med / window:.1%} | "
          f"**{blocked_med / window:.1%}** | {measured_med / window:.1%} | {eff / window:.1%} |")
    print()
    print("| save after step | blocked s (FitResult) | end of step to write start, s | loop gap - typical gap, s "
          "| background write s | steps during the write | their excess over the median step, s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for s in saves:
        fmt = lambda x: "n/a (last step)" if x is None else f"{x:.3f}"  # noqa: E731
        print(f"| {s['step']} | {s['blocked']:.3f} | {s['until_write']:.3f} | {fmt(s['gap'])} | {s['commit']:.3f} "
              f"| {s['overlapped']} | {s['excess']:+.3f} |")
    print(f"\nend of fit: waited {r['end_wait']:.3f} s after the last step (the last save: staging and its write)")
    share = blocked_med / window
    print(f"blocked share = {blocked_med:.3f} s / ({interval} x {step_ref:.3f} s) = {share:.1%} "
          f"(target <= 10%: {'MET' if share <= 0.10 else 'MISSED'})")
    print(f"other processes' CPU use: {r['foreign_bare']:.2f} cores during the bare steps, {r['foreign_fit']:.2f} "
          f"during fit" + ("  WARNING: not idle" if max(r['foreign_bare'], r['foreign_fit']) > IDLE_CORES else ""))
    print(f"\ntotal wall time {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
