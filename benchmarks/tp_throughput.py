"""Tensor-parallel training throughput on CPU: unsharded vs shardlib tp=2 vs transformers' own DTensor TP.

What is measured
----------------
Forward + backward throughput (no optimizer step) of three model families, fp32, dropout 0, models in ``train()``
mode, batch 8 (``--batch``):

* ``BertModel`` (bare encoder with pooler) on 8 x 128 token ids (full attention mask): tokens/s;
* ``ViTModel`` (with pooler) on 8 random 224 x 224 RGB images, patch 16 = 196 patches + CLS = 197 tokens per image
  (1,576 tokens per step): images/s and tokens/s;
* ``T5Model`` (encoder-decoder, no LM head) on 8 x 128 encoder token ids (full attention mask) and 8 x 128
  ``decoder_input_ids`` passed explicitly (causal self-attention + cross-attention, ``use_cache=False``): tokens/s
  counting encoder and decoder tokens (2,048 per step).

The loss is the sum of ``h.float().pow(2).mean()`` over the model's final hidden states: ``last_hidden_state``
for BERT and ViT, ``last_hidden_state`` (decoder) and ``encoder_last_hidden_state`` for T5, so the backward runs
through both stacks. Every mode starts from the same random weights (``torch.manual_seed(seed); Model(config)``),
so the arithmetic is identical. That loss is ~1 per term whatever the weights (the mean square of a LayerNorm /
RMSNorm output), so a fixed random projection of the final hidden states from the first step is printed per mode
("output checksum"; for T5 decoder/encoder) as the check that all modes compute the same thing. Three modes, run
one after another (never two at once: the machine has 2 cores):

1. ``unsharded``  one process, ``torch.set_num_threads(2)`` (both cores on one model);
2. ``shardlib``   two processes, one thread each: ``mesh = shardlib.init_mesh(tp=2)``; ``shardlib.shard(model, mesh)``
                  (the BERT, ViT and T5 policies are found from the model class);
   ``shardlib_sp`` the same with ``sequence_parallel=True`` (norms, dropout and residuals on half the sequence;
                  all-gather / reduce-scatter instead of all-reduce, plus backward re-gathers of saved shards);
   ``shardlib_a2a`` two processes: ``init_mesh(tp=1, sp=2)``, ``sequence_parallel="all_to_all"`` (every
                  activation on half the sequence, two all-to-alls per attention, weights replicated and their
                  gradients all-reduced over the two ranks);
3. ``hf``         two processes, one thread each: transformers 5's native DTensor TP with hand-written Megatron plans
                  (``benchmarks/_hf_dtensor_tp.py``: ``build_hf_tp_bert`` / ``build_hf_tp_vit``; loads a
                  checkpoint written to a temp dir). T5 has no HF number: transformers' TP cannot split T5's
                  attention heads, because the relative position bias (and the zero bias built from ``n_heads``
                  in layers without a bias table) keeps all heads on every rank. The benchmark still tries it
                  (``build_hf_tp_t5``): the first forward fails with ``RuntimeError: The size of tensor a (6) must
                  match the size of tensor b (12) at non-singleton dimension 1``, the cell reads "n/a" and the
                  reason and the observed error are printed under the table. Any other failure is an error.

Each mode runs ``--warmup`` untimed steps, then ``--steps`` timed ones. Every timed step starts after a barrier and
its time is the maximum over the ranks; the table reports the median step (tokens per step / median seconds) and
the ratios shardlib/unsharded and shardlib/HF. A second table gives ms/step median, min and max per mode.

Sizes (``--sizes``, comma separated; default ``bert-small,bert-base,vit-base,t5-base``):

* ``bert-base``  BERT-base: 12 layers, hidden 768, 12 heads, intermediate 3072, vocab 30522, 512 positions;
  ``bert-small``: 4 layers, hidden 256, 4 heads, intermediate 1024 (same vocabulary);
* ``vit-base``   ViT-B/16: 224 px, patch 16, 12 layers, hidden 768, 12 heads, intermediate 3072;
  ``vit-small``: 224 px, patch 16, 4 layers, hidden 256, 4 heads, intermediate 1024 (the ``bert-small`` shape,
  not DeiT-S);
* ``t5-base``    T5-base: d_model 768, d_kv 64, 12 heads, d_ff 3072 (ReLU), 12 encoder + 12 decoder layers,
  vocab 32128, 32 relative-position buckets; ``t5-small``: d_model 256, d_kv 64, 4 heads, d_ff 1024, 4 + 4
  layers, vocab 32128 (the ``bert-small`` shape, not Google's t5-small);
* ``bert-tiny``, ``vit-tiny`` (32 px, patch 8: 17 tokens per image), ``t5-tiny``: 2 layers (2 + 2 for T5), hidden
  64, 4 heads, intermediate 256, vocab 1000: what ``--quick`` runs (8 x 32 tokens for BERT and T5).

``tiny``, ``small`` and ``base`` are accepted as the old names of the BERT sizes.

Workers are started by this script itself (``torch.multiprocessing`` spawn, one fresh set of processes per mode
and size; with ``--quick`` one set per mode runs all sizes, to save the start-up time). They rendezvous through a
``FileStore`` in a private temp dir (no TCP store) and gloo is bound to the loopback interface
(``GLOO_SOCKET_IFNAME=lo``), so nothing listens on anything but 127.0.0.1. Nothing is downloaded: the models are
built from configs with random weights.

How to run
----------
    make bench                                   # = .venv/bin/python benchmarks/tp_throughput.py (default sizes)
    .venv/bin/python benchmarks/tp_throughput.py --sizes bert-small,vit-small,t5-small --steps 10
    .venv/bin/python benchmarks/tp_throughput.py --quick            # smoke check, well under a minute
    .venv/bin/python benchmarks/tp_throughput.py --modes shardlib,hf --sizes vit-base

On the reference machine (2 cores, no GPU) the full default run (timed steps per mode: bert-small 20, bert-base
12, vit-base 8, t5-base 6, each after 2 warm-up steps; the big models report the median of fewer steps) takes
about 7 minutes, ``--quick`` about 20 s. The machine must otherwise be idle: two TP ranks with one thread each or
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

# Quiet and offline before transformers is imported (here and in the spawned workers, which import this module).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from _harness import fmt_cores, loopback_ifname, run_rank, wait_idle  # noqa: E402
from _tp_throughput_workload import (  # noqa: E402
    ALIASES, DEFAULT_SIZES, DEFAULT_STEPS, IDLE_CORES, MODE_TITLES, MODES, QUICK_SIZES, SIZES, WORLD, _worker, family,
)


def step_shape(size: str, batch: int, seq: int, dec_seq: int) -> tuple[int, int, str]:
    """(tokens per step, items per step, item name) for ``size``."""
    fam, c = family(size), SIZES[size]
    if fam == "vit":
        return batch * ((c["image_size"] // c["patch_size"]) ** 2 + 1), batch, "images"
    if fam == "t5":
        return batch * (seq + dec_seq), batch, "pairs"
    return batch * seq, batch, "sequences"


def describe(size: str, batch: int, seq: int, dec_seq: int) -> str:
    c, fam = SIZES[size], family(size)
    tokens = step_shape(size, batch, seq, dec_seq)[0]
    if fam == "bert":
        arch = (f"BertModel {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} "
                f"heads, intermediate {c['intermediate_size']}, vocab {c['vocab_size']}; {batch} x {seq} tokens")
    elif fam == "vit":
        n = (c["image_size"] // c["patch_size"]) ** 2 + 1
        arch = (f"ViTModel {c['image_size']} px, patch {c['patch_size']} ({n} tokens/image), {c['num_hidden_layers']} "
                f"layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads, intermediate "
                f"{c['intermediate_size']}; {batch} images")
    else:
        arch = (f"T5Model {c['num_layers']} + {c['num_decoder_layers']} layers, d_model {c['d_model']}, d_kv "
                f"{c['d_kv']}, {c['num_heads']} heads, d_ff {c['d_ff']}, vocab {c['vocab_size']}; {batch} x {seq} "
                f"encoder + {batch} x {dec_seq} decoder tokens")
    return f"{size}: {arch} = {tokens:,} tokens/step"


# ------------------------------------------------------------------------------------------------------- parent
def run_mode(mode: str, sizes: list[str], batch: int, seq: int, dec_seq: int, warmup: int,
             steps: dict[str, int]) -> dict[str, dict]:
    """Run one mode on ``sizes`` (one after another) in one fresh set of worker processes; return rank 0's result
    dict per size."""
    tmpdir = tempfile.mkdtemp(prefix=f"tp_bench_{mode}_")
    try:
        t0 = time.perf_counter()
        mp.start_processes(
            run_rank, args=(_worker, mode, sizes, batch, seq, dec_seq, warmup, steps, tmpdir), nprocs=WORLD[mode],
            join=True, start_method="spawn",
        )
        wall = time.perf_counter() - t0
        results = {}
        for size in sizes:
            with open(os.path.join(tmpdir, f"result_{size}.json")) as f:
                results[size] = json.load(f)
            results[size]["wall_s"] = wall / len(sizes)  # per size when several share the processes
        return results
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def _fmt_ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def _fmt_checksum(c: list[float]) -> str:
    return " / ".join(f"{x:+.6f}" for x in c)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None,
                   help="comma-separated, from: " + ", ".join(SIZES) + " (old names: " + ", ".join(
                       f"{k} = {v}" for k, v in ALIASES.items()) + "; default " + ",".join(DEFAULT_SIZES)
                   + "; --quick: " + ",".join(QUICK_SIZES) + ")")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per mode (default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items())
                   + "; --quick 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per mode (default 2)")
    p.add_argument("--batch", type=int, default=None, help="sequences / images / sequence pairs per step (default 8)")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per BERT sequence and per T5 encoder sequence (default 128; --quick 32)")
    p.add_argument("--dec-seq", type=int, default=None, help="tokens per T5 decoder sequence (default: --seq)")
    p.add_argument("--wait-idle", type=float, default=60.0, metavar="SECONDS",
                   help="before each mode, wait up to this long for other processes to go quiet (default 60; 0: "
                        "don't wait). Timings taken while other processes use CPU are flagged either way.")
    p.add_argument("--quick", action="store_true",
                   help="smoke check: " + ", ".join(QUICK_SIZES) + " (8 x 32 tokens), 3 timed steps, one set of "
                        "processes per mode")
    args = p.parse_args(argv)

    sizes = args.sizes.split(",") if args.sizes else list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    sizes = [ALIASES.get(s, s) for s in sizes]
    modes = args.modes.split(",")
    for s in sizes:
        if s not in SIZES:
            p.error(f"unknown size {s!r}; choose from {', '.join(SIZES)}")
    if len(set(sizes)) != len(sizes):
        p.error("a size is listed twice")
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    batch = args.batch or 8
    seq = args.seq or (32 if args.quick else 128)
    dec_seq = args.dec_seq or seq
    if args.warmup < 0 or (args.steps is not None and args.steps < 1) or min(batch, seq, dec_seq) < 1:
        p.error("--warmup must be >= 0 and --steps, --batch, --seq, --dec-seq >= 1")
    steps = {s: args.steps or (3 if args.quick else DEFAULT_STEPS[s]) for s in sizes}

    # Children inherit this: gloo binds to loopback only.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
    os.environ.setdefault("SHARDLIB_TIMEOUT", "300")

    print(f"# fwd+bwd throughput, batch {batch}, fp32, dropout 0, torch {torch.__version__}, {os.cpu_count()} CPUs",
          flush=True)
    for s in sizes:
        print(f"#   {describe(s, batch, seq, dec_seq)}", flush=True)
    t_all = time.perf_counter()
    results: dict[tuple[str, str], dict] = {}
    busy_warnings: list[str] = []

    def report(size: str, mode: str, r: dict) -> None:
        results[(size, mode)] = r
        if "error" in r:
            print(f"  {size:<10} {MODE_TITLES[mode]:<16} n/a: {r['error']} (build {r['build_s']:.0f} s, "
                  f"wall {r['wall_s']:.0f} s)", flush=True)
            return
        med = statistics.median(r["times"])
        print(f"  {size:<10} {MODE_TITLES[mode]:<16} median {med * 1e3:8.1f} ms/step  "
              f"({len(r['times'])} steps, {r['threads']} thread(s)/rank, attn={r['attn']}, "
              f"output checksum {_fmt_checksum(r['checksum'])}, build {r['build_s']:.0f} s, wall {r['wall_s']:.0f} s, "
              f"CPU in timed window: ours {r['own_cores']:.2f} cores, others {fmt_cores(r['foreign_cores'])})",
              flush=True)
        if r["foreign_cores"] is not None and r["foreign_cores"] > IDLE_CORES:
            busy_warnings.append(f"{size}/{mode}: other processes used {r['foreign_cores']:.2f} cores on "
                                 "average while it was timed; its numbers are not reliable")

    def wait(label: str) -> None:
        load = wait_idle(args.wait_idle, IDLE_CORES)
        if load > IDLE_CORES:
            print(f"  WARNING: the machine is not idle ({load:.2f} cores busy by other processes) before {label}",
                  flush=True)

    if args.quick:  # start-up (spawn, imports) dominates tiny models: one set of processes per mode
        for mode in modes:
            wait(f"{mode} ({', '.join(sizes)})")
            for size, r in run_mode(mode, sizes, batch, seq, dec_seq, args.warmup, steps).items():
                report(size, mode, r)
    else:
        for size in sizes:
            for mode in modes:
                wait(f"{size}/{mode}")
                report(size, mode, run_mode(mode, [size], batch, seq, dec_seq, args.warmup, steps)[size])

    def rate(size, mode, per="tokens"):
        r = results.get((size, mode))
        if r is None or "error" in r:
            return None
        tokens, items, _ = step_shape(size, batch, seq, dec_seq)
        return (tokens if per == "tokens" else items) / statistics.median(r["times"])

    na_notes = []
    for size in sizes:
        for mode in modes:
            r = results[(size, mode)]
            if "error" in r:
                na_notes.append(f"n/a: {size} / {MODE_TITLES[mode]}: {r['reason']} (observed: {r['error']})")

    print()
    print("| model | tokens/step | unsharded tok/s | shardlib tp=2 tok/s | shardlib tp=2 + SP tok/s | shardlib sp=2 "
          "all-to-all tok/s | HF DTensor tp=2 tok/s | shardlib/unsharded | shardlib/HF | SP/shardlib | "
          "all-to-all/shardlib |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        u, s, sp, a2a, h = (rate(size, m) for m in ("unsharded", "shardlib", "shardlib_sp", "shardlib_a2a", "hf"))
        print(f"| {size} | {step_shape(size, batch, seq, dec_seq)[0]:,} | {_fmt_rate(u)} | {_fmt_rate(s)} | "
              f"{_fmt_rate(sp)} | {_fmt_rate(a2a)} | {_fmt_rate(h)} | {_fmt_ratio(s, u)} | {_fmt_ratio(s, h)} | "
              f"{_fmt_ratio(sp, s)} | {_fmt_ratio(a2a, s)} |")
    vit_sizes = [s for s in sizes if family(s) == "vit"]
    if vit_sizes:
        print()
        print("| model | images/step | " + " | ".join(f"{MODE_TITLES[m]} img/s" for m in MODES) + " |")
        print("|---|---:|" + "---:|" * len(MODES))
        for size in vit_sizes:
            print(f"| {size} | {batch} | " + " | ".join(_fmt_rate(rate(size, m, "items")) for m in MODES) + " |")
    for line in na_notes:
        print(line)

    print()
    print("| model | mode | steps | median ms/step | min ms | max ms | first loss | output checksum |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        for mode in modes:
            r = results[(size, mode)]
            if "error" in r:
                print(f"| {size} | {MODE_TITLES[mode]} | n/a | n/a | n/a | n/a | n/a | n/a |")
                continue
            t = r["times"]
            print(f"| {size} | {MODE_TITLES[mode]} | {len(t)} | {statistics.median(t) * 1e3:.1f} | "
                  f"{min(t) * 1e3:.1f} | {max(t) * 1e3:.1f} | {r['first_loss']:.6f} | "
                  f"{_fmt_checksum(r['checksum'])} |")

    bad = []
    for size in sizes:
        sums = [results[(size, m)]["checksum"] for m in modes if "error" not in results[(size, m)]]
        for i in range(len(sums[0]) if sums else 0):
            col = [c[i] for c in sums]
            if max(col) - min(col) > 1e-4 * max(1.0, abs(col[0])):
                bad.append(f"{size}: the modes computed different outputs (checksums {sums})")
                break
    for line in bad + busy_warnings:
        print("WARNING:", line)
    print(f"\ntotal wall time {time.perf_counter() - t_all:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
