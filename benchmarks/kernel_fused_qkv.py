"""Fused QKV on CPU: the attention projections as three linears (stock HF) vs one GEMM (``shardlib.kernels``).

What is measured
----------------
Forward + backward time of the q/k/v projections of one attention block: ``q, k, v = Q(x), K(x), V(x)`` on
``x`` [batch, seq, 768] (requires grad, like hidden states inside a model) followed by
``torch.autograd.backward((q, k, v), fixed random grads)``, i.e. 3 GEMMs forward and 6 backward for stock, 1 + 2 for
fused. float32, biases on (BERT / ViT), parameter gradients cleared (set to None) between steps. Sizes: BERT-base
hidden 768 / 12 heads at batch 8 x 128 and 16 x 128 tokens, each with full projections (out 768 each, tp=1) and with
the local shapes of tp=2 (out 384 each: one rank's ``ColumnParallelLinear`` shard).

Modes, run interleaved round after round (so a busy neighbour slows all of them alike):

* ``stock``     three ``nn.Linear`` (what HF runs);
* ``fused``     the same three linears after ``shardlib.kernels.fused_qkv.fuse_linears`` (the real call path: one
                ``torch.autograd.Function`` GEMM, the other slices handed to k and v);
* ``cat``       the design alternative: ``F.linear(x, torch.cat(W), torch.cat(b)).split(...)`` under plain autograd
                (one GEMM forward, one each for dx and dW in backward, but saves the concatenated weight);
* ``fwd-only``  a second table: forward under ``torch.no_grad()`` (inference), stock vs fused.

Each time is the median over ``--rounds`` rounds of the median of ``--repeats`` timed steps (after warm-up); the
modes of a round run back to back (order reversed every other round), and each ratio is the median over rounds of
that round's mode / stock, so a neighbour that comes and goes between rounds cancels out (< 1: faster than stock).
The machine has 2 cores shared with other jobs: the CPU taken by *other* processes during each size is sampled
(``benchmarks/_harness.py``: machine-wide busy time minus this process' CPU time) and printed, and each size first
waits up to ``--wait-idle`` seconds for the machine to go quiet; trust ratios, not absolute times, and rerun when
the ``others`` column is well above 0.

Run: ``.venv/bin/python benchmarks/kernel_fused_qkv.py [--threads 2] [--rounds 15] [--repeats 3] [--wait-idle 60]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import interleaved, machine_busy_s, paired_ratio, timed, wait_idle  # noqa: E402

from shardlib.kernels.fused_qkv import fuse_linears, fused_group  # noqa: E402

HIDDEN = 768
SIZES = [  # (batch, seq, out per projection, label)
    (8, 128, 768, "8x128 tp=1"),
    (16, 128, 768, "16x128 tp=1"),
    (8, 128, 384, "8x128 tp=2 local"),
    (16, 128, 384, "16x128 tp=2 local"),
]


def make(out: int, seed: int = 0):
    torch.manual_seed(seed)
    stock = [nn.Linear(HIDDEN, out) for _ in range(3)]
    fused = copy.deepcopy(stock)
    fuse_linears(fused, names=["q", "k", "v"])
    return stock, fused


def step_modules(mods, x, grads):
    outs = [m(x) for m in mods]
    torch.autograd.backward(outs, grads)


def step_cat(mods, x, grads):
    w = torch.cat([m.weight for m in mods])
    b = torch.cat([m.bias for m in mods])
    outs = F.linear(x, w, b).split([m.out_features for m in mods], -1)
    torch.autograd.backward(outs, grads)


def forward_only(mods, x):
    with torch.no_grad():
        outs = [m(x) for m in mods]
    return outs


def step_seconds(fn, params, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls, the gradients dropped before each."""

    def drop_grads():
        for p in params:
            p.grad = None

    return statistics.median(timed(fn, repeats, warmup=warmup, before=drop_grads))


def run_size(batch, seq, out, rounds, repeats):
    stock, fused = make(out)
    x = torch.randn(batch, seq, HIDDEN, requires_grad=True)
    grads = [torch.randn(batch, seq, out) for _ in range(3)]
    params = [x] + [p for m in stock + fused for p in m.parameters()]
    modes = {
        "stock": lambda: step_modules(stock, x, grads),
        "fused": lambda: step_modules(fused, x, grads),
        "cat": lambda: step_cat(stock, x, grads),
        "fwd-only stock": lambda: forward_only(stock, x),
        "fwd-only fused": lambda: forward_only(fused, x),
    }
    # correctness of what is timed (fused outputs equal stock up to float32 rounding)
    for a, b in zip([m(x) for m in stock], [m(x) for m in fused]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    group = fused_group(fused[0])
    group.reset_counters()
    b0, c0, t0 = machine_busy_s(), time.process_time(), time.perf_counter()
    results = interleaved({name: (lambda fn=fn: step_seconds(fn, params, repeats)) for name, fn in modes.items()},
                          rounds)
    wall = time.perf_counter() - t0
    load = (machine_busy_s() - b0 - (time.process_time() - c0)) / wall  # cores used by other processes
    assert group.own_calls == 0 and group.fused_gemms == group.handed_out // 2 > 0, group  # fusion really ran
    medians = {k: statistics.median(v) * 1e3 for k, v in results.items()}
    # ratios paired within a round (the modes of one round ran seconds apart, under the same neighbours)
    ratios = {
        "fused": paired_ratio(results["fused"], results["stock"])[0],
        "cat": paired_ratio(results["cat"], results["stock"])[0],
        "fwd": paired_ratio(results["fwd-only fused"], results["fwd-only stock"])[0],
    }
    return medians, ratios, load


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--wait-idle", type=float, default=60.0,
                    help="before each size, wait up to this many seconds for other processes to go quiet")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, float32, hidden {HIDDEN}, bias on; "
          f"medians over {args.rounds} rounds x {args.repeats} steps (ms); ratio = median over rounds of "
          "mode / stock", flush=True)
    header = (f"{'size':<20}{'stock':>9}{'fused':>9}{'ratio':>8}{'cat':>9}{'ratio':>8}   "
              f"{'fwd stock':>10}{'fwd fused':>10}{'ratio':>8}{'others':>8}")
    print(header)
    print("-" * len(header))
    for batch, seq, out, label in SIZES:
        if args.wait_idle > 0:
            wait_idle(args.wait_idle, threshold_cores=0.3)
        m, q, load = run_size(batch, seq, out, args.rounds, args.repeats)
        print(f"{label:<20}{m['stock']:9.2f}{m['fused']:9.2f}{q['fused']:8.3f}"
              f"{m['cat']:9.2f}{q['cat']:8.3f}   {m['fwd-only stock']:10.2f}{m['fwd-only fused']:10.2f}"
              f"{q['fwd']:8.3f}{load:8.2f}", flush=True)
    print("stock/fused/cat: forward + backward of q, k, v; fwd: forward under no_grad; others: cores used by other "
          f"processes while the size ran (of {os.cpu_count()})")


if __name__ == "__main__":
    main()
