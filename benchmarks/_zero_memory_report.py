"""The tables of ``benchmarks/zero_memory.py`` (bytes per rank, step times, BERT-large RSS) and its summary lines."""

from __future__ import annotations

import statistics

from _harness import print_table
from _zero_memory_workload import IDLE_CORES, MIB, OPT_TARGET, STAGES


def _mib(x: float) -> str:
    return f"{x / MIB:,.1f}" if x >= 10 * MIB else f"{x / MIB:.3f}"


def _full_figures(results: dict) -> dict:
    """Per dp: zero=0's figures (max over ranks), else another dp's or the parameter count's where it did not run."""
    measured = {dp: {q: max(r[q] for r in res["counts"]["0"]) for q in ("opt", "grad", "param")}
                for dp, res in sorted(results.items()) if "0" in res["counts"]}
    full = {}
    for dp, res in results.items():
        if measured:
            other = dp if dp in measured else min(measured)
            full[dp] = dict(measured[other], source="measured at this dp" if other == dp else
                            f"zero=0 measured at dp={other}")
        else:
            r = next(iter(res["counts"].values()))[0]
            full[dp] = dict(opt=2 * r["full_param"] + 4 * r["n_params"], grad=r["full_param"], param=r["full_param"],
                            source="from the parameter count (no zero=0 launch fitted)")
    return full


def print_bytes(results: dict, skipped: dict, summary: list) -> None:
    full, rows, bucket_rows = _full_figures(results), [], []
    for dp, res in sorted(results.items()):
        f = full[dp]
        rows.append([dp, f"full/{dp} ({f['source']})", _mib(f["opt"] / dp), "", "", _mib(f["grad"] / dp), "",
                     _mib(f["param"] / dp), "", ""])
        for zero in STAGES:
            ranks = res["counts"].get(str(zero))
            if not ranks:
                rows.append([dp, zero, f"not run: {skipped.get((dp, zero), 'failed')}"] + [""] * 7)
                continue
            m = {q: max(r[q] for r in ranks) for q in ("opt", "grad", "param", "rss_peak")}
            ratio = {q: m[q] / (f[q] / dp) for q in ("opt", "grad", "param")}
            opt_sum = sum(r["opt"] for r in ranks) / f["opt"]
            rows.append([dp, zero, _mib(m["opt"]), f"{ratio['opt']:.3f}x", f"{opt_sum:.3f}",
                         _mib(m["grad"]), f"{ratio['grad']:.3f}x", _mib(m["param"]), f"{ratio['param']:.3f}x",
                         f"{m['rss_peak'] / MIB:,.0f}"])
            if zero in (1, 2):
                met = "met" if ratio["opt"] <= OPT_TARGET else "MISSED"
                summary.append(f"dp={dp} zero={zero}: optimizer state of the largest rank {ratio['opt']:.4f}x "
                               f"full/dp (target <= {OPT_TARGET}x: {met})")
                r0, peak = ranks[0], m["grad"]
                target, bound = f["grad"] / dp + 2 * r0["bucket"], r0["shards"] + 2 * r0["bucket"]  # bound: + padding
                bucket_rows.append([dp, zero, r0["buckets"], _mib(r0["bucket"]), _mib(r0["shards"]), _mib(target),
                                    _mib(bound), _mib(peak), f"{peak / target:.3f}"])
                if zero == 2:
                    verdict = ("met" if peak <= target else f"met up to the padding: {peak - target:,.0f} bytes over, "
                               "within shards + 2 buckets" if peak <= bound else "MISSED")
                    summary.append(f"dp={dp} zero=2: gradient peak {_mib(peak)} MiB, {peak / target:.3f} of full/dp "
                                   f"+ 2 buckets = {_mib(target)} MiB (target <= 1: {verdict}); "
                                   f"{peak / (f['grad'] / dp):.2f}x full/dp, buckets up to {_mib(r0['bucket'])} MiB")
    print_table("1. Bytes per rank (MiB, max over ranks; full = zero=0's figure; ratio = max rank / (full/dp))",
                ["dp", "zero", "optimizer state", "ratio", "sum over ranks / full", "gradient peak", "ratio",
                 "parameters", "ratio", "peak RSS of a rank"], rows)
    print_table("zero 1/2 buckets and the gradient-peak bound (MiB, max over ranks)",
                ["dp", "zero", "buckets", "largest bucket", "shards (sum numel/dp)", "full/dp + 2 buckets",
                 "shards + 2 buckets", "gradient peak", "peak / (full/dp + 2 buckets)"], bucket_rows)


def print_times(results: dict, warnings: list) -> None:
    rows, median = [], statistics.median
    for world, res in sorted(results.items()):
        by: dict = {}
        for r in res["records"]:
            by.setdefault(r["zero"], {})[r["round"]] = r
        if 0 not in by:
            continue
        base = by[0]
        base_wall = median(r["wall_s"] for r in base.values())
        for zero, recs in sorted(by.items()):
            walls = [recs[k]["wall_s"] for k in sorted(recs)]
            foreign = [r["foreign_cores"] for r in recs.values() if r["foreign_cores"] is not None]
            rows.append([world, zero, "interleaved" if res.get("interleave") else "sequential", f"{median(walls):.2f}",
                         " / ".join(f"{w:.2f}" for w in walls),
                         f"{median(recs[k]['wall_s'] / base[k]['wall_s'] for k in recs):.2f}x",
                         f"{median(walls) / base_wall:.2f}x", f"{median(r['cpu_s'] for r in recs.values()):.2f}",
                         f"{median(recs[k]['cpu_s'] / base[k]['cpu_s'] for k in recs):.2f}x",
                         f"{median(foreign):.2f}" if foreign else "n/a"])
            if busy := [f for f in foreign if f > IDLE_CORES]:
                warnings.append(f"dp={world} zero={zero}: other processes used more than {IDLE_CORES} cores during "
                                f"{len(busy)} of {len(recs)} timed steps (up to {max(busy):.2f})")
    print_table("2. Step time per stage against zero=0 (each step between barriers, slowest rank)",
                ["dp", "zero", "rounds", "step s (median)", "per round", "zero_k / zero_0 (median of paired)",
                 "ratio of medians", "CPU s per step, all ranks (median)", "CPU zero_k / zero_0 (median of paired)",
                 "other processes, cores (median)"], rows)
    for world, res in sorted(results.items()):
        if res.get("peak_rss"):
            print(f"dp={world}: peak RSS of a rank {res['peak_rss'] / MIB:,.0f} MiB"
                  f"{' (all four trainers alive)' if res.get('interleave') else ''}")


def print_rss(rss: dict, stages: list, layers: int, skipped: dict, summary: list) -> None:
    rows = []
    for zero in stages:
        if zero in skipped or zero not in rss:
            rows.append([zero, f"skipped: {skipped[zero]}" if zero in skipped else "failed", "", "", "", ""])
            continue
        ranks = rss[zero]["ranks"]
        m = {k: max(r[k] for r in ranks) for k in ("param_bytes", "before", "step_hwm", "lifetime")}
        rows.append([zero, _mib(m["param_bytes"]), _mib(m["before"]), _mib(m["step_hwm"]) + (
            "" if all(r["reset"] for r in ranks) else " (VmHWM not reset: lifetime)"), _mib(m["lifetime"]),
            " / ".join(f"{s:.1f}" for s in ranks[0]["step_s"])])
    print_table(f"3. Peak RSS per rank, BERT-large ({layers} layers) at dp=4, MALLOC_MMAP_THRESHOLD_=131072 (MiB, max "
                "over ranks)", ["zero", "local parameters", "RSS before the steps", "peak during 2 training steps",
                                "lifetime peak (incl. build)", "step s (rank 0)"], rows)
    if 0 not in rss:
        return
    peak = {z: max(r["step_hwm"] for r in rss[z]["ranks"]) for z in rss}
    life = {z: max(r["lifetime"] for r in rss[z]["ranks"]) for z in rss}
    for zero in stages:
        if zero != 0 and zero in rss:
            p, z0, lz, l0 = (v / MIB for v in (peak[zero], peak[0], life[zero], life[0]))
            summary.append(f"BERT-large {layers} layers dp=4 peak RSS per rank, training: zero={zero} {p:,.0f} MiB vs "
                           f"zero=0 {z0:,.0f} MiB ({p / z0:.2f}x); lifetime incl. the build {lz:,.0f} vs {l0:,.0f} MiB "
                           f"({lz / l0:.2f}x)")
