"""The report of ``benchmarks/zero_memory.py``: its three tables (bytes per rank, step times, BERT-large RSS) and
the summary lines; the script keeps its command line and launches, ``_zero_memory_workload`` the ranks' side."""

from __future__ import annotations

import statistics

from _zero_memory_workload import IDLE_CORES, MIB, OPT_TARGET, STAGES


def _mib(x: float) -> str:
    return f"{x / MIB:,.1f}" if x >= 10 * MIB else f"{x / MIB:.3f}"


def _full_figures(results: dict) -> dict:
    """Per dp: zero=0's figures (max over ranks) and where they come from: that dp's launch, else the smallest dp
    whose launch ran zero=0 (they do not depend on dp), else the model's parameter count (module docstring, 1.)."""
    measured = {dp: {q: max(r[q] for r in res["counts"]["0"]) for q in ("opt", "grad", "param")}
                for dp, res in sorted(results.items()) if "0" in res["counts"]}
    full = {}
    for dp, res in results.items():
        if dp in measured:
            full[dp] = dict(measured[dp], source="measured at this dp")
        elif measured:
            other = min(measured)
            full[dp] = dict(measured[other], source=f"zero=0 measured at dp={other}")
        else:
            r = next(iter(res["counts"].values()))[0]
            full[dp] = dict(opt=2 * r["full_param"] + 4 * r["n_params"], grad=r["full_param"], param=r["full_param"],
                            source="from the parameter count (no zero=0 launch fitted)")
    return full


def print_bytes(results: dict, skipped: dict, summary: list) -> None:
    full = _full_figures(results)
    print("\n### 1. Bytes per rank (MiB, max over ranks; full = zero=0's figure; ratio = max rank / (full/dp))\n")
    print("| dp | zero | optimizer state | ratio | sum over ranks / full | gradient peak | ratio | parameters | "
          "ratio | peak RSS of a rank |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dp, res in sorted(results.items()):
        f = full[dp]
        print(f"| {dp} | full/{dp} ({f['source']}) | {_mib(f['opt'] / dp)} | | | {_mib(f['grad'] / dp)} | | "
              f"{_mib(f['param'] / dp)} | | |")
        for zero in STAGES:
            if str(zero) not in res["counts"]:
                print(f"| {dp} | {zero} | not run: {skipped.get((dp, zero), 'failed')} | | | | | | | |")
                continue
            ranks = res["counts"][str(zero)]
            m = {q: max(r[q] for r in ranks) for q in ("opt", "grad", "param", "rss_peak")}
            ratio = {q: m[q] / (f[q] / dp) for q in ("opt", "grad", "param")}
            opt_sum = sum(r["opt"] for r in ranks) / f["opt"]
            print(f"| {dp} | {zero} | {_mib(m['opt'])} | {ratio['opt']:.3f}x | {opt_sum:.3f} | {_mib(m['grad'])} | "
                  f"{ratio['grad']:.3f}x | {_mib(m['param'])} | {ratio['param']:.3f}x | {m['rss_peak'] / MIB:,.0f} |")
            if zero in (1, 2):
                met = ratio["opt"] <= OPT_TARGET
                summary.append(f"dp={dp} zero={zero}: optimizer state of the largest rank {ratio['opt']:.4f}x "
                               f"full/dp (target <= {OPT_TARGET}x: {'met' if met else 'MISSED'})")
    print("\n(ratio of zero=0's gradient peak and parameters: dp, every rank holds them whole; zero=3's gradient "
          "peak: its shards after backward)")
    print("\nzero 1/2 buckets and the gradient-peak bound (MiB, max over ranks)\n")
    print("| dp | zero | buckets | largest bucket | shards (sum numel/dp) | full/dp + 2 buckets | shards + 2 buckets | "
          "gradient peak | peak / (full/dp + 2 buckets) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dp, res in sorted(results.items()):
        for zero in (1, 2):
            ranks = res["counts"].get(str(zero))
            if not ranks:
                continue
            r0, peak = ranks[0], max(r["grad"] for r in ranks)
            target = full[dp]["grad"] / dp + 2 * r0["bucket"]
            print(f"| {dp} | {zero} | {r0['buckets']} | {_mib(r0['bucket'])} | {_mib(r0['shards'])} | {_mib(target)} | "
                  f"{_mib(r0['shards'] + 2 * r0['bucket'])} | {_mib(peak)} | {peak / target:.3f} |")
            if zero == 2:
                bound = r0["shards"] + 2 * r0["bucket"]  # full/dp + 2 buckets + the padding to a multiple of dp
                verdict = ("met" if peak <= target else f"met up to the padding: {peak - target:,.0f} bytes over, "
                           f"within shards + 2 buckets" if peak <= bound else "MISSED")
                summary.append(f"dp={dp} zero=2: gradient peak {_mib(peak)} MiB, {peak / target:.3f} of full/dp + 2 "
                               f"buckets = {_mib(target)} MiB (target <= 1: {verdict}); "
                               f"{peak / (full[dp]['grad'] / dp):.2f}x full/dp, buckets up to {_mib(r0['bucket'])} MiB")


def print_times(results: dict, warnings: list) -> None:
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


def print_rss(rss: dict, stages: list, layers: int, skipped: dict, summary: list) -> None:
    print(f"\n### 3. Peak RSS per rank, BERT-large ({layers} layers) at dp=4, MALLOC_MMAP_THRESHOLD_=131072 "
          "(MiB, max over ranks)\n")
    print("| zero | local parameters | RSS before the steps | peak during 2 training steps | "
          "lifetime peak (incl. build) | step s (rank 0) |")
    print("|---:|---:|---:|---:|---:|---|")
    for zero in stages:
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
    if 0 not in rss:
        return
    p0 = max(r["step_hwm"] for r in rss[0]["ranks"])
    l0 = max(r["lifetime"] for r in rss[0]["ranks"])
    for zero in stages:
        if zero != 0 and zero in rss:
            pk = max(r["step_hwm"] for r in rss[zero]["ranks"])
            lk = max(r["lifetime"] for r in rss[zero]["ranks"])
            summary.append(f"BERT-large {layers} layers dp=4 peak RSS per rank during training: zero={zero} "
                           f"{pk / MIB:,.0f} MiB vs zero=0 {p0 / MIB:,.0f} MiB ({pk / p0:.2f}x); lifetime incl. "
                           f"building the model {lk / MIB:,.0f} vs {l0 / MIB:,.0f} MiB ({lk / l0:.2f}x)")
