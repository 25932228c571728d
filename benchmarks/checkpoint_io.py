"""Checkpoint I/O on CPU at tp=2: shardlib's sharded load/save/convert vs full loads, transformers' TP and DCP.

What is measured
----------------
Setup: a ``BertForMaskedLM`` is built from a config with random weights (``torch.manual_seed(0)``) and written
with ``save_pretrained`` (safetensors) into a temp dir that the whole run shares. Default size: BERT-large
(24 layers, hidden 1024, 16 heads, intermediate 4096, vocab 30522, 512 positions): 335 M parameters, ~1.34 GB of
fp32 weights. ``--quick``: 2 layers, hidden 128, 4 heads, vocab 1000 (a smoke run).

1. Loading at tp=2. Two worker processes are spawned by this script (``torch.multiprocessing``, start method
   "spawn"; gloo over 127.0.0.1 with ``MASTER_ADDR=127.0.0.1``, a free port and ``GLOO_SOCKET_IFNAME=lo``), a
   fresh pair per variant, one torch thread per rank:

   * ``shardlib``: ``shardlib.checkpoint.from_pretrained(BertForMaskedLM, dir, mesh)`` (meta-device build, shard,
     each rank reads only its rows with ``preadv`` straight into its parameters: no mmap, so no file pages in RSS);
   * ``full load + shard`` (baseline): ``BertForMaskedLM.from_pretrained(dir)`` on every rank, then
     ``shardlib.shard(model, mesh)``;
   * ``HF tp_plan``: transformers' own ``BertForMaskedLM.from_pretrained(dir, distributed_config=
     DistributedConfig(tp_plan=...))`` with the Megatron plan of ``benchmarks/_hf_dtensor_tp.py`` prefixed with
     ``bert.`` (embeddings and the tied MLM decoder stay replicated). If it fails the column reads n/a with the
     reason.

   Per rank: the load's wall time (the table shows the slowest rank; the first load in the fresh process, and the
   median over ``--load-repeats`` loads in the same processes), the process baseline (``VmRSS`` right after the
   imports and the process-group init; then the peak is reset by writing ``5`` to ``/proc/self/clear_refs``), the
   peak resident memory (``VmHWM`` after the first load: anonymous memory *and* mapped file pages that were
   touched), and the local shard bytes (``shardlib.report(model).local_bytes``; for HF the local bytes of its
   parameters, DTensors counted by ``to_local()``). Target: peak <= 1.1 x (local shard bytes + baseline) on every
   rank. A forward check follows: every variant computes the MLM loss of one fixed masked batch; the values must
   agree.

2. Sharded save at tp=2 (in the ``shardlib`` processes, after its load): ``shardlib.checkpoint.save(model, dir)``
   vs ``torch.distributed.checkpoint.save`` (DCP, ``FileSystemWriter`` defaults, i.e. one file per rank, fsync on)
   of the same tensors, median of ``--save-repeats``, alternating, each into a new dir. DCP gets every sharded
   tensor as ``DTensor.from_local(local rows, tp mesh, [Shard(dim)])`` (no copy) and replicated tensors as plain
   tensors: with plain local tensors under the global names DCP's planner would de-duplicate them as if replicated
   and keep one rank's shard only, so the DTensor wrapping is the arrangement that saves each rank's local tensors
   (and it is what makes a DCP reshard possible). Tied tensors are saved once by both. Resharding tp=2 -> tp=4:
   ``shardlib.checkpoint.convert(sharded_tp2, out, tp=4)`` (offline, one process, writes the tp=4 files) vs DCP
   loading its tp=2 checkpoint into tp=4 DTensors in 4 fresh processes (load only, nothing written); the DCP
   result is then compared tensor by tensor with shardlib's tp=4 files.

3. HF -> sharded tp=2 conversion throughput: ``shardlib.checkpoint.convert(hf_dir, out, tp=2)`` (offline; reads,
   writes and xxh3-128-hashes the ~same number of bytes and fsyncs every file it wrote, as every shardlib write
   does) in GB/s of the HF safetensors bytes, vs reading those bytes with plain Python ``readinto`` (run right
   before; median of 3). Reference points: xxh3-128 of the same file, and the write throughput for the same
   number of bytes written from a buffer in 16 MiB ``write`` calls into a new file, with a final ``fsync`` (the
   disk's durable write throughput) and without (the page cache's); medians of 3.
   Diagnostic: the same convert with its durability work stubbed out (``os.fsync`` and the early-writeback call
   made no-ops in this process), i.e. what reading, hashing and writing into the page cache alone allow.
   Target: conversion >= 0.5 x raw read. Nothing drops the page cache: the HF file was just written (24 GB RAM),
   so every read in this benchmark, the raw read included, is a page-cache read; writes go to the page cache and
   then, through fsync, to the disk (shardlib and DCP).

How to run
----------
    .venv/bin/python benchmarks/checkpoint_io.py            # BERT-large, ~1.5 minutes on 2 cores
    .venv/bin/python benchmarks/checkpoint_io.py --quick    # small model, smoke run (~30 s)
    .venv/bin/python benchmarks/checkpoint_io.py --size bert-base --variants shardlib,hf
    .venv/bin/python benchmarks/checkpoint_io.py --only convert --convert-repeats 5   # part 3 only (~20 s)

Peak memory needs ~2 GB per rank at BERT-large (4 workers at most run at once) and ~6 GB of temp disk.

The machine should be otherwise idle (the script waits up to ``--wait-idle`` seconds for that). All temp dirs
are removed at the end (also on failure). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

from _checkpoint_io_workload import (  # noqa: E402
    CONFIGS, TITLES, VARIANTS, MiB, _bert_config, _convert_benchmark, _dcp_reshard_worker, _fmt_s, _load_worker,
    _results,
)
from _harness import print_table, spawn_ranks, timed, wait_idle  # noqa: E402


def _load_metrics(res: list[dict]) -> list[dict]:
    """Per-rank numbers of one load variant (bytes, seconds)."""
    out = []
    for r in res:
        base, after, peak, local = r["baseline"], r["after"], r["sampled_peak"], r["local_bytes"]
        out.append(dict(
            load_s=r["load_s"], base=base["VmRSS"], local=local, hwm=after["VmHWM"],
            growth=after["VmHWM"] - base["VmRSS"], ratio=after["VmHWM"] / (local + base["VmRSS"]),
            anon_growth=peak["RssAnon"] - base["RssAnon"], file_growth=peak["RssFile"] - base["RssFile"],
            anon_ratio=(base["VmRSS"] + peak["RssAnon"] - base["RssAnon"]) / (local + base["VmRSS"]),
            after_anon=after["RssAnon"], after_file=after["RssFile"], check_loss=r["check_loss"]))
    return out


def _fmt_pair(values, scale=MiB, fmt="{:,.0f}") -> str:
    return " / ".join(fmt.format(v / scale) for v in values)


def _convert_rows(conv: dict, hf_bytes: int) -> list[tuple[str, dict, str]]:
    """The table rows of part 3."""
    raw, xxh, durable, cached, conv2, conv2_cache = (conv[k] for k in ("raw", "xxh", "durable", "cached", "conv2",
                                                                        "conv2_cache"))
    gbps_conv = hf_bytes / statistics.median(conv2) / 1e9
    gbps_cache = hf_bytes / statistics.median(conv2_cache) / 1e9
    gbps_raw = hf_bytes / statistics.median(raw) / 1e9
    gbps_xxh = hf_bytes / statistics.median(xxh) / 1e9
    gbps_durable = hf_bytes / statistics.median(durable) / 1e9
    gbps_cached = hf_bytes / statistics.median(cached) / 1e9
    return [
        ("HF -> sharded tp=2: GB/s of HF bytes (fsync of every file included)",
         {"shardlib": f"{gbps_conv:.2f} ({statistics.median(conv2):.2f} s, median of {len(conv2)})",
          "raw": f"read {gbps_raw:.2f} ({statistics.median(raw):.2f} s, median of {len(raw)}); "
                 f"xxh3-128 {gbps_xxh:.2f}; write+fsync {gbps_durable:.2f}"},
         f">= 0.5x raw read: {gbps_conv / gbps_raw:.2f}x "
         + ("MET" if gbps_conv >= 0.5 * gbps_raw else "MISSED")
         + f"; {gbps_conv / gbps_durable:.2f}x write+fsync"),
        ("HF -> sharded tp=2 without fsync (diagnostic: page cache only): GB/s",
         {"shardlib": f"{gbps_cache:.2f} ({statistics.median(conv2_cache):.2f} s, median of "
                      f"{len(conv2_cache)})",
          "raw": f"write (no fsync) {gbps_cached:.2f}"},
         f"{gbps_cache / gbps_raw:.2f}x raw read; {gbps_cache / gbps_cached:.2f}x write"),
    ]


def _print_table(title: str, cols: list[str], rows: list) -> None:
    print_table(f"Checkpoint I/O: {title}", ["measurement", *(TITLES[c] for c in cols), "target / ratio"],
                [[label, *(values.get(c, "") for c in cols), target] for label, values, target in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, smoke run (< 1 minute)")
    p.add_argument("--size", choices=sorted(CONFIGS), default=None,
                   help="model size (default bert-large; --quick means --size quick)")
    p.add_argument("--load-repeats", type=int, default=None, help="loads per variant in the same processes "
                   "(peak memory is from the first); default 3 (quick: 1)")
    p.add_argument("--save-repeats", type=int, default=3, help="sharded saves per method (median)")
    p.add_argument("--convert-repeats", type=int, default=None, help="default 3 (quick: 2)")
    p.add_argument("--wait-idle", type=float, default=60.0, help="wait up to this long for an idle machine")
    p.add_argument("--variants", default=",".join(VARIANTS), help="load variants: shardlib,full,hf")
    p.add_argument("--only", choices=["convert"], default=None,
                   help="run one part only: 'convert' = part 3, HF -> sharded tp=2 against the raw I/O references")
    args = p.parse_args(argv)
    size = args.size or ("quick" if args.quick else "bert-large")
    load_repeats = args.load_repeats or (1 if args.quick else 3)
    convert_repeats = args.convert_repeats or (2 if args.quick else 3)
    variants = [v for v in args.variants.split(",") if v]
    if "shardlib" not in variants:
        p.error("the shardlib variant is required (the save and reshard steps use its processes)")
    timeout = 120 if args.quick else 300

    run_start = time.perf_counter()
    if args.wait_idle > 0:
        busy = wait_idle(args.wait_idle, 0.2)
        if busy > 0.2:
            print(f"WARNING: the machine is busy ({busy:.2f} cores used by other processes): timings will suffer")
    load_at_start = open("/proc/loadavg").read().split()[:3]
    root = Path(tempfile.mkdtemp(prefix="ckpt_io_bench_"))
    notes: list[str] = []
    try:
        from transformers import BertForMaskedLM
        # ---- setup
        from transformers.utils import logging as hf_logging

        from shardlib import checkpoint

        hf_logging.disable_progress_bar()
        config = _bert_config(size)
        t0 = time.perf_counter()
        torch.manual_seed(0)
        model = BertForMaskedLM(config)
        n_params = sum(p.numel() for p in model.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        hf_dir = root / "hf"
        model.save_pretrained(hf_dir)
        del model
        gc.collect()
        hf_files = sorted(hf_dir.glob("*.safetensors"))
        hf_bytes = sum(f.stat().st_size for f in hf_files)
        print(f"setup: {size} BertForMaskedLM, {n_params / 1e6:.1f} M parameters, {param_bytes / 1e9:.3f} GB fp32 "
              f"(tied decoder once); save_pretrained -> {len(hf_files)} safetensors file(s), {hf_bytes / 1e9:.3f} GB, "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)

        title = (f"BertForMaskedLM {size} ({n_params / 1e6:.0f} M params, {param_bytes / 1e9:.2f} GB fp32; HF "
                 f"safetensors {hf_bytes / 1e9:.2f} GB), tp=2 on {os.cpu_count()} CPU cores, gloo, 1 thread/rank")
        if args.only == "convert":
            conv = _convert_benchmark(checkpoint, hf_dir, hf_files, hf_bytes, root, convert_repeats)
            _print_table(title, ["shardlib", "raw"], _convert_rows(conv, hf_bytes))
            load_at_end = open("/proc/loadavg").read().split()[:3]
            print(f"- HF->tp=2 convert wrote {conv['conv2_bytes'] / 1e9:.3f} GB; machine busy {conv['busy']:.2f} "
                  f"cores during part 3 (this process included); load average at start {' '.join(load_at_start)}, "
                  f"at end {' '.join(load_at_end)}; total run {time.perf_counter() - run_start:.0f} s")
            return 0

        # ---- 1 + 2a: loads (fresh processes per variant); saves in the shardlib processes
        loads: dict[str, list[dict] | str] = {}
        for variant in variants:
            work = root / f"w_{variant}"
            work.mkdir()
            opts = dict(load_repeats=load_repeats, save_repeats=args.save_repeats if variant == "shardlib" else 0,
                        timeout=timeout)
            t0 = time.perf_counter()
            failure = spawn_ranks(_load_worker, 2, (variant, str(hf_dir), str(work), opts), deadline_s=timeout * 2)
            res = _results(work, variant, 2)
            if res is None:
                loads[variant] = failure or "no result"
            else:
                errors = {r.get("error") for r in res} - {None}
                loads[variant] = f"{errors.pop()}" if errors else res
                if errors or any("error" in r for r in res):
                    tb = next(r["traceback"] for r in res if "traceback" in r)
                    notes.append(f"{TITLES[variant]} traceback (last lines): "
                                 + " | ".join(tb.strip().splitlines()[-4:]))
            print(f"load {TITLES[variant]}: done in {time.perf_counter() - t0:.1f} s (processes included)"
                  + ("" if isinstance(loads[variant], list) else f": FAILED: {loads[variant]}"), flush=True)

        sl = loads.get("shardlib")
        if not isinstance(sl, list):
            raise RuntimeError(f"the shardlib load failed: {sl}")
        work = root / "w_shardlib"
        sharded_tp2, dcp_tp2 = work / "shardlib_tp2", work / "dcp_tp2"

        # ---- 2b: resharding tp=2 -> tp=4
        tp4 = root / "shardlib_tp4"
        convert4 = timed(lambda: checkpoint.convert(sharded_tp2, tp4, tp=4),
                                convert_repeats, before=lambda: shutil.rmtree(tp4, ignore_errors=True))
        print(f"convert tp=2 -> tp=4: {_fmt_s(convert4)} s", flush=True)
        dcp4_work = root / "w_dcp4"
        dcp4_work.mkdir()
        t0 = time.perf_counter()
        failure = spawn_ranks(_dcp_reshard_worker, 4, (str(dcp_tp2), str(sharded_tp2 / checkpoint.METADATA), str(tp4),
                                                  str(dcp4_work), timeout), deadline_s=timeout * 2)
        dcp4 = _results(dcp4_work, "dcp4", 4)
        print(f"DCP load tp=2 -> tp=4: done in {time.perf_counter() - t0:.1f} s (processes included)"
              + (f": FAILED: {failure}" if dcp4 is None else ""), flush=True)
        shutil.rmtree(work / "shardlib_tp2", ignore_errors=True)
        shutil.rmtree(work / "dcp_tp2", ignore_errors=True)
        shutil.rmtree(tp4, ignore_errors=True)

        # ---- 3: HF -> sharded tp=2 throughput vs raw read (raw read right before)
        conv = _convert_benchmark(checkpoint, hf_dir, hf_files, hf_bytes, root, convert_repeats)

        # ------------------------------------------------------------------------------------------ the table
        cols = ["shardlib", "full", "hf", "dcp", "raw"]
        rows: list[tuple[str, dict, str]] = []
        metrics = {v: _load_metrics(res) for v, res in loads.items() if isinstance(res, list)}

        def load_row(label: str, fn, target: str = "") -> None:
            """One table row over the load variants; ``fn(per-rank metrics)`` -> cell text."""
            cells = {}
            for v in VARIANTS:
                res = loads.get(v)
                cells[v] = "not run" if res is None else "n/a" if isinstance(res, str) else fn(metrics[v])
            rows.append((label, cells, target))

        def pair(key: str):
            return lambda ms: " / ".join(f"{m[key] / MiB:,.0f}" for m in ms)

        load_row("load: wall s, first load in fresh processes (slowest rank)",
                 lambda ms: f"{max(m['load_s'][0] for m in ms):.2f}")
        if load_repeats > 1:
            load_row(f"load: wall s, median of {load_repeats} loads (slowest rank)",
                     lambda ms: f"{statistics.median(max(x) for x in zip(*(m['load_s'] for m in ms))):.2f}")
        load_row("load: process baseline RSS MiB (rank 0 / 1)", pair("base"))
        load_row("load: local shard MiB (rank 0 / 1)", pair("local"))
        load_row("load: PEAK RSS (VmHWM) MiB (rank 0 / 1)", pair("hwm"))
        load_row("load: peak - baseline MiB (rank 0 / 1)", pair("growth"))
        load_row("load: peak / (local shard + baseline), worst rank",
                 lambda ms: f"{max(m['ratio'] for m in ms):.2f}x "
                            + ("MET" if max(m["ratio"] for m in ms) <= 1.1 else "MISSED"), "<= 1.10x")
        load_row("load: sampled peak growth, private (RssAnon) + mapped file pages (RssFile) MiB (rank 0 / 1)",
                 lambda ms: " / ".join(f"{m['anon_growth'] / MiB:,.0f} + {m['file_growth'] / MiB:,.0f}" for m in ms),
                 "diagnostic")
        load_row("load: (baseline + sampled private growth) / (local shard + baseline), worst rank",
                 lambda ms: f"{max(m['anon_ratio'] for m in ms):.2f}x", "diagnostic: page cache excluded")
        load_row("load: RSS after load, private + mapped file MiB (rank 0)",
                 lambda ms: f"{ms[0]['after_anon'] / MiB:,.0f} + {ms[0]['after_file'] / MiB:,.0f}")
        load_row("load: MLM loss of a fixed batch (forward check)", lambda ms: f"{ms[0]['check_loss']:.6f}",
                 "all equal")
        st = sl[0].get("save_s", {})
        sb = sl[0].get("save_bytes", {})
        save_max = {k: [max(a, b) for a, b in zip(sl[0]["save_s"][k], sl[1]["save_s"][k])] for k in st}
        med_save = {k: statistics.median(v) for k, v in save_max.items() if v}
        rows.append((f"save tp=2: wall s (median of {args.save_repeats}, slowest rank)",
                     {k: f"{v:.2f}" for k, v in med_save.items()},
                     f"shardlib/DCP {med_save['shardlib'] / med_save['dcp']:.2f}x" if len(med_save) == 2 else ""))
        rows.append(("save tp=2: bytes on disk MB",
                     {k: f"{v / 1e6:,.1f}" for k, v in sb.items()}, ""))
        if dcp4 is not None:
            dcp4_s = max(r["load_s"] for r in dcp4)
            bad = sum(r["n_mismatches"] for r in dcp4)
            dcp4_cell = f"{dcp4_s:.2f} (load into tp=4 DTensors, 4 procs)"
        else:
            dcp4_cell, bad = "n/a", None
        rows.append(("reshard tp=2 -> tp=4: wall s",
                     {"shardlib": f"{statistics.median(convert4):.2f} (offline convert, 1 proc, writes files)",
                      "dcp": dcp4_cell}, ""))
        rows += _convert_rows(conv, hf_bytes)

        _print_table(title, cols, rows)

        # ---- notes
        for v in VARIANTS:
            if isinstance(loads.get(v), str):
                print(f"- {TITLES[v]}: n/a: {loads[v]}")
        if isinstance(loads.get("hf"), list):
            print(f"- HF tp_plan: {loads['hf'][0].get('dtensor_params')} parameters are DTensors (the plan shards "
                  "attention and MLP Linears; embeddings, LayerNorms, the MLM head transform and the tied decoder "
                  "stay replicated, hence its larger local bytes).")
        losses = {v: r[0]["check_loss"] for v, r in loads.items() if isinstance(r, list)}
        if len(set(round(x, 4) for x in losses.values())) > 1:
            print(f"- WARNING: the forward check differs between variants: {losses}")
        if not all(r.get("peak_reset") for res in loads.values() if isinstance(res, list) for r in res):
            print("- /proc/self/clear_refs could not reset the peak: VmHWM includes the start-up peak.")
        print(f"- HF->tp=2 convert wrote {conv['conv2_bytes'] / 1e9:.3f} GB (files + metadata), xxh3-128-hashed "
              f"them and fsynced every file (machine busy {conv['busy']:.2f} cores during part 3, this process "
              "included); all reads are page-cache reads (the HF file was just written; "
              "nothing drops caches).")
        if dcp4 is not None:
            compared = sum(r["compared"] for r in dcp4)
            print(f"- DCP tp=4 load vs shardlib tp=4 files: {compared} (rank, tensor) pairs compared, "
                  + ("all bitwise equal." if not bad else f"{bad} MISMATCHES: {[r['mismatches'] for r in dcp4]}"))
        else:
            print(f"- DCP reshard: n/a ({failure})")
        print("- DCP save: FileSystemWriter defaults (fsync per file, 1 writer thread); sharded tensors passed as "
              "DTensor.from_local(...) (see the docstring), replicated ones as plain tensors (saved once). "
              "shardlib's save streams every tensor from its own memory, xxh3-128-hashes while writing and fsyncs "
              "every file, then shardlib.json.")
        for n in notes:
            print(f"- {n}")
        load_at_end = open("/proc/loadavg").read().split()[:3]
        print(f"- load average at start {' '.join(load_at_start)}, at end {' '.join(load_at_end)}; "
              f"total run {time.perf_counter() - run_start:.0f} s")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
