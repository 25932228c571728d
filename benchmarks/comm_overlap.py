"""What gloo on loopback costs, and how much of it a GEMM hides: the measured bound behind the TP targets.

Two ranks, one thread each (as ``tp_throughput.py``'s tp=2 modes), BERT-base tp=2 sizes (8 x 128 tokens, hidden
768, q/k/v shard 3 x 384, MLP shard 1536). Each line is the median over ``--steps`` barrier-separated repetitions,
timed on rank 0:

* ``all_reduce 3 MiB``: one [1024, 768] fp32 all-reduce (what every TP region boundary costs without SP);
* ``all_gather`` / ``reduce_scatter``: the sequence-parallel pair over the same bytes;
* ``all_reduce 24 KiB``: one LayerNorm-sized gradient (SP's replicated parameters; latency-bound), and ``x16``
  of them one after another against one all-reduce of their concatenation (the bucketing of shardlib.parallel.gradsync);
* ``wgrad GEMM``: the q/k/v weight-gradient GEMM [1152, 1024] x [1024, 768] of one rank;
* ``sequential`` = all-reduce then GEMM; ``overlapped`` = the all-reduce started with ``async_op=True``, the GEMM,
  then the wait (shardlib.parallel.overlap's column-parallel backward). ``hidden`` = how much of the all-reduce's time
  the
  overlap removed;
* a reduce-scatter at each of ``SWEEP_KIB`` per rank: gloo's against shardlib's (an all-to-all and a local sum);
* ZeRO's bucket (``--bucket-rounds`` interleaved rounds, a 24 MiB flat bucket, shardlib.train.zero): gloo's
  reduce-scatter against the in-place all-reduce and this rank's range copied out (what ZeRO runs on gloo), each
  call's time and the peak RSS it adds beyond the bucket (gloo's copies the bucket into a scratch buffer);
* sequence parallelism's pair, hidden the same way: ``reduce_scatter as all_to_all + sum`` (each rank sends the other
  its half and adds what it receives: half the bytes of gloo's reduce-scatter), the all-gather started before the
  input-gradient GEMM [1024, 1152] x [1152, 768] and waited after it (``all_gather under dgrad``), and the
  all-to-all reduce-scatter under the weight-gradient GEMM (``reduce_scatter under wgrad``).

    .venv/bin/python benchmarks/comm_overlap.py [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import _checkout  # noqa: E402,F401  (shardlib from this checkout)
from _harness import loopback_ifname, run_rank, timed, wait_idle  # noqa: E402
from shardlib.parallel.collectives import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE  # noqa: E402


def _median_ms(fn, steps: int) -> float:
    return statistics.median(timed(fn, steps, warmup=3, barrier=dist.barrier)) * 1e3


def _measure(steps: int) -> dict[str, float]:
    act = torch.randn(1024, 768)
    half, full = torch.randn(512, 768), torch.empty(1024, 768)
    small = [torch.randn(6144) for _ in range(16)]
    grad_out, saved = torch.randn(1024, 1152), torch.randn(1024, 768)

    def overlapped():
        work = dist.all_reduce(act, async_op=True)
        grad_out.t() @ saved
        work.wait()

    weight = torch.randn(1152, 768)

    def rs_by_all_to_all():
        received = torch.empty_like(act)
        dist.all_to_all_single(received, act)
        return received.view(2, 512, 768).sum(0)

    def gather_under_dgrad():
        work = ALL_GATHER_SINGLE(full, half, async_op=True)
        grad_out @ weight
        work.wait()

    def scatter_under_wgrad():
        received = torch.empty_like(act)
        work = dist.all_to_all_single(received, act, async_op=True)
        grad_out.t() @ saved
        work.wait()
        received.view(2, 512, 768).sum(0)

    return {
        "all_reduce 3 MiB": _median_ms(lambda: dist.all_reduce(act), steps),
        "all_gather 1.5 -> 3 MiB": _median_ms(lambda: ALL_GATHER_SINGLE(full, half), steps),
        "reduce_scatter 3 -> 1.5 MiB": _median_ms(lambda: REDUCE_SCATTER_SINGLE(half, full), steps),
        "all_reduce 24 KiB": _median_ms(lambda: dist.all_reduce(small[0]), steps),
        "all_reduce 24 KiB x16": _median_ms(lambda: [dist.all_reduce(t) for t in small], steps),
        "all_reduce 16 x 24 KiB as one": _median_ms(lambda: dist.all_reduce(torch.cat(small)), steps),
        "wgrad GEMM": _median_ms(lambda: grad_out.t() @ saved, steps),
        "sequential": _median_ms(lambda: (dist.all_reduce(act), grad_out.t() @ saved), steps),
        "overlapped": _median_ms(overlapped, steps),
        "reduce_scatter as all_to_all + sum": _median_ms(rs_by_all_to_all, steps),
        "dgrad GEMM": _median_ms(lambda: grad_out @ weight, steps),
        "all_gather under dgrad": _median_ms(gather_under_dgrad, steps),
        "reduce_scatter under wgrad": _median_ms(scatter_under_wgrad, steps),
        **_reduce_scatter_sizes(steps),
    }


#: input bytes per rank of the reduce-scatter size sweep
SWEEP_KIB = (16, 64, 256, 1024, 3072)


def _reduce_scatter_sizes(steps: int) -> dict[str, float]:
    """gloo's reduce-scatter against shardlib's (an all-to-all and a local sum on gloo) at each of SWEEP_KIB."""
    from shardlib.parallel.collectives import start_reduce_scatter

    out = {}
    for kib in SWEEP_KIB:
        x = torch.randn(kib * 256)
        half = torch.empty(x.numel() // 2)
        out[f"reduce_scatter {kib} KiB gloo"] = _median_ms(lambda: REDUCE_SCATTER_SINGLE(half, x), steps)
        out[f"reduce_scatter {kib} KiB shardlib"] = _median_ms(
            lambda: start_reduce_scatter(x, 0, dist.group.WORLD).wait(), steps)
    return out


BUCKET_MIB = 24  # shardlib.parallel.flat.DEFAULT_BUCKET_BYTES, about


def _zero_bucket(rounds: int) -> dict[str, list[float]]:
    """ZeRO's reduce of one flat bucket both ways, alternating, ``rounds`` times: milliseconds per call and the peak
    RSS (MiB) a call adds over the RSS before it (malloc returns blocks of 64 KiB or more to the OS at once here)."""
    import ctypes

    from _harness import reset_peak_rss, status_kib

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD: a freed scratch buffer leaves the RSS
    flat = torch.randn(BUCKET_MIB * 2 ** 18)
    n, r = flat.numel() // 2, dist.get_rank()
    ways = {"gloo reduce_scatter": lambda: REDUCE_SCATTER_SINGLE(torch.empty(n), flat),
            "all_reduce in place + copy": lambda: (dist.all_reduce(flat), flat[r * n:(r + 1) * n].clone())}
    found: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in ways.items():
            before = status_kib("VmRSS")
            reset_peak_rss()
            found.setdefault(name + " ms", []).extend(x * 1e3 for x in timed(fn, 1, barrier=dist.barrier))
            found.setdefault(name + " MiB", []).append((status_kib("VmHWM") - before) / 1024)
    return found


def _worker(rank: int, store_path: str, steps: int, queue, bucket_rounds: int = 0) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        if bucket_rounds:
            result = _zero_bucket(bucket_rounds)
            if rank == 0:
                queue.put(result)
            return
        result = _measure(steps)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bucket-rounds", type=int, default=0, help="only ZeRO's bucket, this many rounds")
    args = parser.parse_args()
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_ifname()
    wait_idle(60, 0.1)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(run_rank, args=(_worker, os.path.join(tmp, "store"), args.steps, queue,
                                           args.bucket_rounds), nprocs=2, start_method="spawn")
    r = queue.get()
    if args.bucket_rounds:
        print(f"ZeRO's {BUCKET_MIB} MiB bucket on 2 gloo ranks, {args.bucket_rounds} interleaved rounds: median "
              "[min-max]")
        for name, values in r.items():
            lo, mid, hi = min(values), statistics.median(values), max(values)
            print(f"  {name:34s} {mid:7.1f} [{lo:.1f}-{hi:.1f}]")
        return
    for name, ms in r.items():
        if name.startswith("reduce_scatter ") and "KiB" in name:
            continue
        print(f"  {name:32s} {ms:8.2f} ms")
    hidden = (r["sequential"] - r["overlapped"]) / r["all_reduce 3 MiB"]
    print(f"\n  overlap hid {100 * hidden:.0f}% of the 3 MiB all-reduce behind the weight-gradient GEMM")
    print(f"  16 small all-reduces cost {r['all_reduce 24 KiB x16'] / r['all_reduce 16 x 24 KiB as one']:.1f}x "
          "one bucketed all-reduce of the same bytes")
    print(f"  reduce-scatter by all-to-all + sum: {r['reduce_scatter as all_to_all + sum']:.2f} ms against gloo's "
          f"{r['reduce_scatter 3 -> 1.5 MiB']:.2f} ms")
    print("\n  | input per rank | " + " | ".join(f"{k} KiB" for k in SWEEP_KIB) + " |")
    print("  |---|" + "---:|" * len(SWEEP_KIB))
    for impl in ("gloo", "shardlib"):
        print(f"  | reduce-scatter, {impl}, ms | "
              + " | ".join(f"{r[f'reduce_scatter {k} KiB {impl}']:.2f}" for k in SWEEP_KIB) + " |")
    for pair, gemm in (("all_gather under dgrad", "dgrad GEMM"), ("reduce_scatter under wgrad", "wgrad GEMM")):
        print(f"  {pair}: {r[pair] - r[gemm]:+.2f} ms over the GEMM alone")


if __name__ == "__main__":
    main()
