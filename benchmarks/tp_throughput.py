"""Tensor-parallel training throughput on CPU: unsharded vs shardlib tp=2 vs transformers' own DTensor TP.

What is measured
----------------
Forward + backward tokens/s of a ``transformers.BertModel`` (the bare encoder with pooler; no optimizer step) on a
batch of 8 x 128 token ids (full attention mask, dropout 0, fp32, model in ``train()`` mode). The loss is
``last_hidden_state.float().pow(2).mean()`` in every mode, and every mode starts from the same random weights
(``torch.manual_seed(seed); BertModel(config)``), so the arithmetic is identical. That loss is ~1 whatever the
weights (it is the mean square of a LayerNorm output), so a fixed random projection of ``last_hidden_state`` from
the first step is printed per mode as the check that all three compute the same thing. Three modes, run one after another (never two at once: the machine has 2 cores):

1. ``unsharded``  one process, ``torch.set_num_threads(2)`` (both cores on one model);
2. ``shardlib``   two processes, one thread each: ``mesh = shardlib.init_mesh(tp=2)``; ``shardlib.shard(model, mesh)``;
3. ``hf``         two processes, one thread each: transformers 5's native DTensor TP
                  (``benchmarks/_hf_dtensor_tp.build_hf_tp_bert``, loads a checkpoint written to a temp dir).

Each mode runs ``--warmup`` untimed steps, then ``--steps`` timed ones. Every timed step starts after a barrier and
its time is the maximum over the ranks; the table reports the median step (tokens per step / median seconds) and
the ratios shardlib/unsharded and shardlib/HF. A second table gives ms/step median, min and max per mode.

Sizes (``--sizes``, comma separated): ``small`` (4 layers, hidden 256, 4 heads, intermediate 1024) and ``base``
(BERT-base: 12 layers, hidden 768, 12 heads, intermediate 3072), both with the BERT vocabulary (30522) and 512
positions; ``tiny`` (2 layers, hidden 64, vocab 1000) is what ``--quick`` uses.

Workers are started by this script itself (``torch.multiprocessing`` spawn, one fresh set of processes per mode
and size). They rendezvous through a ``FileStore`` in a private temp dir (no TCP store) and gloo is bound to the
loopback interface (``GLOO_SOCKET_IFNAME=lo``), so nothing listens on anything but 127.0.0.1. Nothing is
downloaded: the models are built from configs with random weights.

How to run
----------
    make bench                                   # = .venv/bin/python benchmarks/tp_throughput.py (small,base)
    .venv/bin/python benchmarks/tp_throughput.py --sizes small --steps 10
    .venv/bin/python benchmarks/tp_throughput.py --quick            # smoke check, well under a minute
    .venv/bin/python benchmarks/tp_throughput.py --modes shardlib,hf --sizes base

On the reference machine (2 cores, no GPU) the full default run (small 20 + base 12 timed steps per mode) takes
about 3 minutes, ``--quick`` about 20 s. The machine must otherwise be idle: two TP ranks with one thread each or
one process with two threads leave no core spare, and a single busy neighbour process can halve a mode's speed
(the two-thread unsharded run suffers most: its OpenMP regions wait for the descheduled thread). Each mode
therefore first waits (``--wait-idle``, default up to 60 s) for other processes to go quiet, and every timing
window records how much CPU other processes used meanwhile; windows with more than 0.1 cores of foreign load are
flagged with a WARNING under the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

# Quiet and offline before transformers is imported (here and in the spawned workers, which import this module).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SIZES: dict[str, dict] = {
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256, vocab_size=1000),
    "small": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                  vocab_size=30522),
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                 vocab_size=30522),
}
#: Timed steps per size when --steps is not given (on 2 cores a base step takes ~2-2.5 s, a small one ~0.1-0.2 s).
DEFAULT_STEPS = {"tiny": 5, "small": 20, "base": 12}
MODES = ("unsharded", "shardlib", "hf")
MODE_TITLES = {"unsharded": "unsharded", "shardlib": "shardlib tp=2", "hf": "HF DTensor tp=2"}
WORLD = {"unsharded": 1, "shardlib": 2, "hf": 2}
THREADS = {"unsharded": 2, "shardlib": 1, "hf": 1}
SEED = 1234


def _loopback_ifname() -> str:
    """Name of the loopback interface (for GLOO_SOCKET_IFNAME); 'lo' on Linux."""
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read().strip(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
    except OSError:
        pass
    return "lo"


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all CPUs; /proc/stat, steal excluded)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:8]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq = v
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def bert_config(size: str):
    from transformers import BertConfig

    return BertConfig(
        **SIZES[size],
        max_position_embeddings=512,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


# ------------------------------------------------------------------------------------------------------- worker
def _build_model(mode: str, config, tmpdir: str):
    from transformers import BertModel

    if mode == "hf":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _hf_dtensor_tp import build_hf_tp_bert

        return build_hf_tp_bert(config, tmpdir, seed=SEED)
    torch.manual_seed(SEED)
    model = BertModel(config)
    if mode == "shardlib":
        import shardlib

        mesh = shardlib.init_mesh(tp=2)
        model = shardlib.shard(model, mesh)
    return model


def _worker(rank: int, mode: str, size: str, batch: int, seq: int, warmup: int, steps: int, tmpdir: str) -> None:
    world = WORLD[mode]
    torch.set_num_threads(THREADS[mode])
    if world > 1:
        # The launcher environment some libraries look at (transformers reads LOCAL_RANK); the rendezvous itself
        # is a FileStore, so no TCP store is started.
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        import datetime

        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmpdir, 'store')}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )

    def barrier():
        if world > 1:
            dist.barrier()

    config = bert_config(size)
    t_build = time.perf_counter()
    model = _build_model(mode, config, tmpdir)
    build_s = time.perf_counter() - t_build
    model.train()

    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)

    # The loss, mean(h^2) of the final LayerNorm's output, is ~1 whatever the weights; a fixed random projection of
    # h (computed on the first step only, outside the timed loop) is the cross-mode check that the math is the same.
    probe = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    checksum = None

    def step() -> float:  # one forward + backward; no optimizer
        nonlocal checksum
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, attention_mask=attention_mask)
        loss = out.last_hidden_state.float().pow(2).mean()
        loss.backward()
        if checksum is None:
            checksum = (out.last_hidden_state.detach().double() @ probe).mean().item()
        return loss.item()

    first_loss = None
    for _ in range(warmup):
        loss = step()
        first_loss = loss if first_loss is None else first_loss
    times = []
    barrier()
    # Other load on the machine during the timed window: busy CPU time of the whole machine minus our own.
    busy0, own0, wall0 = _machine_busy_s(), time.process_time(), time.perf_counter()
    for _ in range(steps):
        barrier()
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
        first_loss = loss if first_loss is None else first_loss
    barrier()
    busy, own, wall = _machine_busy_s() - busy0, time.process_time() - own0, time.perf_counter() - wall0
    if world > 1:
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
        times = t.tolist()
        o = torch.tensor([own], dtype=torch.float64)
        dist.all_reduce(o)
        own = o.item()
    # /proc/stat counts in clock ticks (10 ms): windows shorter than 0.5 s are too coarse to judge.
    foreign_cores = max(0.0, (busy - own) / wall) if wall >= 0.5 else None
    if rank == 0:
        result = dict(
            mode=mode, size=size, times=times, first_loss=first_loss, checksum=checksum, build_s=build_s,
            threads=torch.get_num_threads(), foreign_cores=foreign_cores, own_cores=own / wall,
            attn=getattr(model.config, "_attn_implementation", None),
        )
        with open(os.path.join(tmpdir, "result.json"), "w") as f:
            json.dump(result, f)
    barrier()
    if world > 1:
        dist.destroy_process_group()


def _worker_entry(rank: int, *args) -> None:
    try:
        _worker(rank, *args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise


# ------------------------------------------------------------------------------------------------------- parent
def run_mode(mode: str, size: str, batch: int, seq: int, warmup: int, steps: int) -> dict:
    """Run one mode on one size in fresh worker processes; return rank 0's result dict."""
    tmpdir = tempfile.mkdtemp(prefix=f"tp_bench_{mode}_{size}_")
    try:
        t0 = time.perf_counter()
        mp.start_processes(
            _worker_entry, args=(mode, size, batch, seq, warmup, steps, tmpdir), nprocs=WORLD[mode],
            join=True, start_method="spawn",
        )
        with open(os.path.join(tmpdir, "result.json")) as f:
            result = json.load(f)
        result["wall_s"] = time.perf_counter() - t0
        return result
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


IDLE_CORES = 0.1  # other processes' average CPU use above which a timing is flagged


def _wait_idle(timeout_s: float) -> float:
    """Sample the machine's CPU use in 1 s windows until it is below IDLE_CORES or ``timeout_s`` has passed;
    return the last sample (cores busy)."""
    start = time.perf_counter()
    while True:
        b0, t0 = _machine_busy_s(), time.perf_counter()
        time.sleep(1.0)
        load = (_machine_busy_s() - b0) / (time.perf_counter() - t0)
        waited = time.perf_counter() - start
        if load <= IDLE_CORES or waited >= timeout_s:
            if waited > 1.5:
                print(f"  (waited {waited:.0f} s for other processes to go quiet; now {load:.2f} cores busy)", flush=True)
            return load


def _fmt_cores(x: float | None) -> str:
    return "n/a (window < 0.5 s)" if x is None else f"{x:.2f} cores"


def _fmt_tok(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def _fmt_ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None, help="comma-separated, from: " + ", ".join(SIZES) + " (default small,base)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per mode (default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + ")")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per mode (default 2)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; --quick 32)")
    p.add_argument("--wait-idle", type=float, default=60.0, metavar="SECONDS",
                   help="before each mode, wait up to this long for other processes to go quiet (default 60; 0: "
                        "don't wait). Timings taken while other processes use CPU are flagged either way.")
    p.add_argument("--quick", action="store_true", help="smoke check: tiny model, 8x32 tokens, 3 timed steps")
    args = p.parse_args(argv)

    sizes = (args.sizes or ("tiny" if args.quick else "small,base")).split(",")
    modes = args.modes.split(",")
    for s in sizes:
        if s not in SIZES:
            p.error(f"unknown size {s!r}; choose from {', '.join(SIZES)}")
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    batch = args.batch or 8
    seq = args.seq or (32 if args.quick else 128)
    if args.warmup < 0 or (args.steps is not None and args.steps < 1):
        p.error("--warmup must be >= 0 and --steps >= 1")

    # Children inherit this: gloo binds to loopback only.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_ifname())
    os.environ.setdefault("SHARDLIB_TIMEOUT", "300")

    print(f"# BertModel fwd+bwd throughput, batch {batch} x {seq} tokens, fp32, dropout 0, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    t_all = time.perf_counter()
    results: dict[tuple[str, str], dict] = {}
    busy_warnings: list[str] = []
    for size in sizes:
        steps = args.steps or (3 if args.quick else DEFAULT_STEPS[size])
        for mode in modes:
            load = _wait_idle(args.wait_idle)
            if load > IDLE_CORES:
                print(f"  WARNING: the machine is not idle ({load:.2f} cores busy by other processes) before "
                      f"{size}/{mode}", flush=True)
            r = run_mode(mode, size, batch, seq, args.warmup, steps)
            results[(size, mode)] = r
            med = statistics.median(r["times"])
            print(f"  {size:<5} {MODE_TITLES[mode]:<16} median {med * 1e3:8.1f} ms/step  "
                  f"({len(r['times'])} steps, {r['threads']} thread(s)/rank, attn={r['attn']}, "
                  f"output checksum {r['checksum']:+.6f}, wall {r['wall_s']:.0f} s, CPU in timed window: ours "
                  f"{r['own_cores']:.2f} cores, others {_fmt_cores(r['foreign_cores'])})", flush=True)
            if r["foreign_cores"] is not None and r["foreign_cores"] > IDLE_CORES:
                busy_warnings.append(f"{size}/{mode}: other processes used {r['foreign_cores']:.2f} cores on "
                                     "average while it was timed; its numbers are not reliable")

    def tok_s(size, mode):
        r = results.get((size, mode))
        return batch * seq / statistics.median(r["times"]) if r else None

    print()
    print("| model | unsharded tok/s | shardlib tp=2 tok/s | HF DTensor tp=2 tok/s | shardlib/unsharded | shardlib/HF |")
    print("|---|---:|---:|---:|---:|---:|")
    for size in sizes:
        u, s, h = tok_s(size, "unsharded"), tok_s(size, "shardlib"), tok_s(size, "hf")
        print(f"| {size} | {_fmt_tok(u)} | {_fmt_tok(s)} | {_fmt_tok(h)} | {_fmt_ratio(s, u)} | {_fmt_ratio(s, h)} |")

    print()
    print("| model | mode | steps | median ms/step | min ms | max ms | first loss | output checksum |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        for mode in modes:
            t = results[(size, mode)]["times"]
            print(f"| {size} | {MODE_TITLES[mode]} | {len(t)} | {statistics.median(t) * 1e3:.1f} | "
                  f"{min(t) * 1e3:.1f} | {max(t) * 1e3:.1f} | {results[(size, mode)]['first_loss']:.6f} | "
                  f"{results[(size, mode)]['checksum']:+.6f} |")

    bad = []
    for size in sizes:
        sums = [results[(size, m)]["checksum"] for m in modes]
        if max(sums) - min(sums) > 1e-4 * max(1.0, abs(sums[0])):
            bad.append(f"{size}: the modes computed different outputs (checksums {sums})")
    for line in bad + busy_warnings:
        print("WARNING:", line)
    print(f"\ntotal wall time {time.perf_counter() - t_all:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
