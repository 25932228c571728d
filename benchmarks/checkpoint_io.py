"""Checkpoint I/O on CPU at tp=2: shardlib's sharded load/save/convert vs full loads, transformers' TP and DCP (peak
RSS, save and reshard times, HF -> sharded GB/s against a raw read). Docs: docs/benchmarks/checkpoint-io.md.

    .venv/bin/python benchmarks/checkpoint_io.py            # BERT-large, ~1.5 minutes on 2 cores (~2 GB a rank)
    .venv/bin/python benchmarks/checkpoint_io.py --quick    # small model, smoke run (~30 s)
    .venv/bin/python benchmarks/checkpoint_io.py --size bert-base --variants shardlib,hf
    .venv/bin/python benchmarks/checkpoint_io.py --only convert --convert-repeats 5   # part 3 only
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

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkpoint_io_workload import CONFIGS, MiB, dcp_reshard_worker, dir_bytes, load_worker, results  # noqa: E402
from _harness import machine_busy_s, print_table, spawn_ranks, timed, wait_idle  # noqa: E402

VARIANTS = ("shardlib", "full", "hf")
TITLES = {"shardlib": "shardlib", "full": "full load + shard", "hf": "HF tp_plan", "dcp": "DCP", "raw": "raw I/O"}


def fmt_s(times: list[float]) -> str:
    return "n/a" if not times else f"{statistics.median(times):.2f}" + (
        f" (median of {len(times)})" if len(times) > 1 else "")


def _raw_write(path: Path, nbytes: int, block: memoryview) -> None:
    """``nbytes`` into a new file in ``len(block)``-byte writes, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, block[:min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)


def convert_benchmark(checkpoint, hf_dir: Path, hf_files: list[Path], hf_bytes: int, root: Path, repeats: int) -> dict:
    """Part 3: a raw read, xxh3-128 and write + fsync of the HF bytes, then HF -> sharded tp=2."""
    busy0, wall0, buf = machine_busy_s(), time.perf_counter(), memoryview(bytearray(64 * MiB))

    def read_all():
        for f in hf_files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass

    scratch, out2 = root / "durable_write.bin", root / "convert_tp2"
    drop, clear = (lambda: scratch.unlink(missing_ok=True)), (lambda: shutil.rmtree(out2, ignore_errors=True))
    res = dict(raw=timed(read_all, 3), xxh=timed(lambda: [checkpoint.checksum_of(f) for f in hf_files], 1),
               durable=timed(lambda: _raw_write(scratch, hf_bytes, buf[:16 * MiB]), 3, before=drop))
    drop()
    res["conv2"] = timed(lambda: checkpoint.convert(hf_dir, out2, tp=2), repeats, before=clear)
    res["conv2_bytes"] = dir_bytes(out2)
    clear()
    res["busy"] = (machine_busy_s() - busy0) / (time.perf_counter() - wall0)
    print(f"raw read {fmt_s(res['raw'])} s, xxh3-128 {fmt_s(res['xxh'])} s, write+fsync {fmt_s(res['durable'])} s, "
          f"convert HF -> tp=2 {fmt_s(res['conv2'])} s; all convert runs: {' '.join(f'{t:.2f}' for t in res['conv2'])}"
          f" s; machine busy {res['busy']:.2f} cores (this process included)", flush=True)
    return res


def convert_rows(conv: dict, hf_bytes: int) -> list[tuple[str, dict, str]]:
    """The row of part 3: GB/s of the HF bytes."""
    gbps = {k: hf_bytes / statistics.median(conv[k]) / 1e9 for k in ("raw", "xxh", "durable", "conv2")}
    runs = {k: f"({statistics.median(conv[k]):.2f} s, median of {len(conv[k])})" for k in ("raw", "conv2")}
    return [("HF -> sharded tp=2: GB/s of HF bytes (fsync of every file included)",
             {"shardlib": f"{gbps['conv2']:.2f} {runs['conv2']}", "raw": f"read {gbps['raw']:.2f} {runs['raw']}; "
              f"xxh3-128 {gbps['xxh']:.2f}; write+fsync {gbps['durable']:.2f}"},
             f">= 0.5x raw read: {gbps['conv2'] / gbps['raw']:.2f}x " + ("MET" if gbps["conv2"] >= 0.5 * gbps["raw"]
                                                                          else "MISSED")
             + f"; {gbps['conv2'] / gbps['durable']:.2f}x write+fsync")]


def load_rows(loads: dict, load_repeats: int) -> list[tuple[str, dict, str]]:
    """The rows of part 1, one cell per variant from its ranks' records."""
    def metrics(r):
        base, after = r["baseline"], r["after"]
        return dict(load_s=r["load_s"], base=base["VmRSS"], local=r["local_bytes"], hwm=after["VmHWM"],
                    growth=after["VmHWM"] - base["VmRSS"], ratio=after["VmHWM"] / (r["local_bytes"] + base["VmRSS"]),
                    after_anon=after["RssAnon"], after_file=after["RssFile"], check_loss=r["check_loss"])

    ms = {v: [metrics(r) for r in res] for v, res in loads.items() if isinstance(res, list)}
    pair = lambda key: lambda m: " / ".join(f"{x[key] / MiB:,.0f}" for x in m)  # noqa: E731
    worst = lambda key: lambda m: f"{max(x[key] for x in m):.2f}x"  # noqa: E731
    rows = [("load: wall s, first load in fresh processes (slowest rank)",
             lambda m: f"{max(x['load_s'][0] for x in m):.2f}", "")]
    if load_repeats > 1:
        rows.append((f"load: wall s, median of {load_repeats} loads (slowest rank)",
                     lambda m: f"{statistics.median(max(x) for x in zip(*(y['load_s'] for y in m))):.2f}", ""))
    rows += [("load: process baseline RSS MiB (rank 0 / 1)", pair("base"), ""),
             ("load: local shard MiB (rank 0 / 1)", pair("local"), ""),
             ("load: PEAK RSS (VmHWM) MiB (rank 0 / 1)", pair("hwm"), ""),
             ("load: peak - baseline MiB (rank 0 / 1)", pair("growth"), ""),
             ("load: peak / (local shard + baseline), worst rank",
              lambda m: worst("ratio")(m) + (" MET" if max(x["ratio"] for x in m) <= 1.1 else " MISSED"), "<= 1.10x"),
             ("load: RSS after load, private + mapped file MiB (rank 0)",
              lambda m: f"{m[0]['after_anon'] / MiB:,.0f} + {m[0]['after_file'] / MiB:,.0f}", ""),
             ("load: MLM loss of a fixed batch (forward check)", lambda m: f"{m[0]['check_loss']:.6f}", "all equal")]
    return [(label, {v: "not run" if v not in loads else fn(ms[v]) if v in ms else "n/a" for v in VARIANTS}, target)
            for label, fn, target in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, smoke run (< 1 minute)")
    p.add_argument("--size", choices=sorted(CONFIGS), help="model size (default bert-large; --quick: quick)")
    p.add_argument("--load-repeats", type=int, help="loads per variant, peak from the first (default 3; quick: 1)")
    p.add_argument("--save-repeats", type=int, default=3, help="sharded saves per method (median)")
    p.add_argument("--convert-repeats", type=int, help="default 3 (quick: 2)")
    p.add_argument("--wait-idle", type=float, default=60.0, help="wait up to this long for an idle machine")
    p.add_argument("--variants", default=",".join(VARIANTS), help="load variants: shardlib,full,hf")
    p.add_argument("--only", choices=["convert"], help="'convert': part 3 alone, HF -> sharded tp=2 against raw I/O")
    args = p.parse_args(argv)
    size = args.size or ("quick" if args.quick else "bert-large")
    load_repeats = args.load_repeats or (1 if args.quick else 3)
    convert_repeats = args.convert_repeats or (2 if args.quick else 3)
    variants = [v for v in args.variants.split(",") if v]
    if "shardlib" not in variants:
        p.error("the shardlib variant is required (the save and reshard steps use its processes)")
    timeout, started = 120 if args.quick else 300, time.perf_counter()
    if args.wait_idle > 0 and (busy := wait_idle(args.wait_idle, 0.2)) > 0.2:
        print(f"WARNING: the machine is busy ({busy:.2f} cores used by other processes): timings will suffer")
    load_start, root, notes = open("/proc/loadavg").read().split()[:3], Path(tempfile.mkdtemp(prefix="ckpt_io_")), []
    try:
        from transformers import BertConfig, BertForMaskedLM
        from transformers.utils import logging as hf_logging

        from shardlib import checkpoint

        hf_logging.disable_progress_bar()
        t0 = time.perf_counter()
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(**CONFIGS[size], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        n_params = sum(p.numel() for p in model.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(hf_dir := root / "hf")
        del model
        gc.collect()
        hf_files = sorted(hf_dir.glob("*.safetensors"))
        hf_bytes = sum(f.stat().st_size for f in hf_files)
        print(f"setup: save_pretrained, {len(hf_files)} file(s), in {time.perf_counter() - t0:.1f} s", flush=True)
        title = (f"Checkpoint I/O: BertForMaskedLM {size} ({n_params / 1e6:.0f} M params, {param_bytes / 1e9:.2f} GB "
                 f"fp32; HF safetensors {hf_bytes / 1e9:.2f} GB), tp=2 on {os.cpu_count()} CPU cores, gloo, 1 "
                 "thread/rank")
        rows: list[tuple[str, dict, str]] = []
        loads: dict[str, list[dict] | str] = {}
        for variant in variants if args.only is None else []:  # 1 + 2a: loads; the saves in the shardlib ranks
            (work := root / f"w_{variant}").mkdir()
            opts = dict(load_repeats=load_repeats, save_repeats=args.save_repeats if variant == "shardlib" else 0,
                        timeout=timeout)
            t0 = time.perf_counter()
            failure = spawn_ranks(load_worker, 2, (variant, str(hf_dir), str(work), opts), deadline_s=timeout * 2)
            res = results(work, variant, 2)
            errors = {r.get("error") for r in res or []} - {None}
            loads[variant] = (failure or "no result") if res is None else errors.pop() if errors else res
            if tbs := [r["traceback"] for r in res or [] if "traceback" in r]:
                notes.append(f"{TITLES[variant]} traceback (last lines): "
                             + " | ".join(tbs[0].strip().splitlines()[-4:]))
            print(f"load {TITLES[variant]}: done in {time.perf_counter() - t0:.1f} s (processes included)"
                  + ("" if isinstance(loads[variant], list) else f": FAILED: {loads[variant]}"), flush=True)
        if args.only is None:
            if not isinstance(sl := loads["shardlib"], list):
                raise RuntimeError(f"the shardlib load failed: {sl}")
            sharded_tp2, dcp_tp2, tp4 = root / "w_shardlib" / "shardlib_tp2", root / "w_shardlib" / "dcp_tp2", \
                root / "shardlib_tp4"
            convert4 = timed(lambda: checkpoint.convert(sharded_tp2, tp4, tp=4), convert_repeats,
                             before=lambda: shutil.rmtree(tp4, ignore_errors=True))
            print(f"convert tp=2 -> tp=4: {fmt_s(convert4)} s", flush=True)
            (dcp4_work := root / "w_dcp4").mkdir()
            t0 = time.perf_counter()
            failure = spawn_ranks(dcp_reshard_worker, 4, (str(dcp_tp2), str(sharded_tp2 / checkpoint.METADATA),
                                                          str(tp4), str(dcp4_work), timeout), deadline_s=timeout * 2)
            dcp4 = results(dcp4_work, "dcp4", 4)
            print(f"DCP load tp=2 -> tp=4: done in {time.perf_counter() - t0:.1f} s (processes included)"
                  + (f": FAILED: {failure}" if dcp4 is None else ""), flush=True)
            for folder in (sharded_tp2, dcp_tp2, tp4):
                shutil.rmtree(folder, ignore_errors=True)
            save_s = {k: [max(a, b) for a, b in zip(sl[0]["save_s"][k], sl[1]["save_s"][k])]
                      for k in sl[0].get("save_s", {})}
            med_save = {k: statistics.median(v) for k, v in save_s.items() if v}
            rows = load_rows(loads, load_repeats) + [
                (f"save tp=2: wall s (median of {args.save_repeats}, slowest rank)",
                 {k: f"{v:.2f}" for k, v in med_save.items()},
                 f"shardlib/DCP {med_save['shardlib'] / med_save['dcp']:.2f}x" if len(med_save) == 2 else ""),
                ("save tp=2: bytes on disk MB", {k: f"{v / 1e6:,.1f}" for k, v in sl[0].get("save_bytes", {}).items()},
                 ""),
                ("reshard tp=2 -> tp=4: wall s",
                 {"shardlib": f"{statistics.median(convert4):.2f} (offline convert, 1 proc, writes files)",
                  "dcp": "n/a" if dcp4 is None else f"{max(r['load_s'] for r in dcp4):.2f} (load into tp=4 "
                                                    "DTensors, 4 procs)"}, "")]
        conv = convert_benchmark(checkpoint, hf_dir, hf_files, hf_bytes, root, convert_repeats)  # 3
        cols = ["shardlib", "raw"] if args.only else ["shardlib", "full", "hf", "dcp", "raw"]
        print_table(title, ["measurement", *(TITLES[c] for c in cols), "target / ratio"],
                    [[label, *(values.get(c, "") for c in cols), target]
                     for label, values, target in rows + convert_rows(conv, hf_bytes)])
        if args.only is None:
            notes[:0] = [f"{TITLES[v]}: n/a: {loads[v]}" for v in VARIANTS if isinstance(loads.get(v), str)]
            if isinstance(loads.get("hf"), list):
                notes.append(f"HF tp_plan: {loads['hf'][0]['dtensor_params']} parameters are DTensors (the rest, "
                             "embeddings, LayerNorms, the MLM head, replicated: its larger local bytes).")
            losses = {v: r[0]["check_loss"] for v, r in loads.items() if isinstance(r, list)}
            if len({round(x, 4) for x in losses.values()}) > 1:
                notes.append(f"WARNING: the forward check differs between variants: {losses}")
            if not all(r.get("peak_reset") for res in loads.values() if isinstance(res, list) for r in res):
                notes.append("/proc/self/clear_refs could not reset the peak: VmHWM includes the start-up peak.")
            bad = None if dcp4 is None else sum(r["n_mismatches"] for r in dcp4)
            notes.append(f"DCP reshard: n/a ({failure})" if dcp4 is None else
                         f"DCP tp=4 load vs shardlib tp=4 files: {sum(r['compared'] for r in dcp4)} (rank, tensor) "
                         "pairs compared, " + ("all bitwise equal." if not bad else
                                               f"{bad} MISMATCHES: {[r['mismatches'] for r in dcp4]}"))
            notes.append("DCP save: FileSystemWriter defaults (fsync per file, 1 writer thread), sharded tensors as "
                         "DTensors; shardlib's save xxh3-128-hashes while writing and fsyncs every file.")
        notes.append(f"HF->tp=2 convert wrote {conv['conv2_bytes'] / 1e9:.3f} GB, hashed and fsynced (machine busy "
                     f"{conv['busy']:.2f} cores in part 3); all reads are page-cache reads.")
        notes.append(f"load average at start {' '.join(load_start)}, at end "
                     f"{' '.join(open('/proc/loadavg').read().split()[:3])}; total run "
                     f"{time.perf_counter() - started:.0f} s")
        print("\n".join(f"- {n}" for n in notes))
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
