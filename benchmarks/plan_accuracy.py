"""How right is `shardlib plan`? Every layout of BERT (hidden 256 and 768) and a T5-small-sized model on 4 gloo
ranks: the cost model's prediction (the layout search's own pricing, shardlib.analysis.search.price, with a
profile of this machine) beside the measured peak RSS growth per rank and median step time of
``Trainer.train_step``, in one run.

    python benchmarks/plan_accuracy.py                      # calibrate, then every model, 3 interleaved rounds
    python benchmarks/plan_accuracy.py --models bert-256 --rounds 3 --profile prof.json
    python benchmarks/plan_accuracy.py --models bert-256 --only pp2       # the pipeline layouts alone
    python benchmarks/plan_accuracy.py --models t5-small --where "zero2 ckpt" --profile prof.json
                                             # where one layout's peak comes from: predicted terms, live storages

Targets (issue 25): predicted peak within 10% of measured for every layout; predicted step times rank the layouts
with Spearman rho >= 0.8; the layout predicted fastest within 10% of the measured fastest. Measurements: the rounds
run every layout in turn (so drift hits each alike); a layout's step time is the median over rounds of its
per-round medians, its peak the median over rounds of the largest rank's growth (benchmarks/_plan_accuracy_workload.py
says how RSS is measured). Prints markdown tables and writes JSON and a scatter plot (PNG).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import print_table, write_json  # noqa: E402
from _plan_accuracy_layouts import MODELS, layouts  # noqa: E402
from _plan_accuracy_workload import measure  # noqa: E402

MIB = 2 ** 20
TARGET_MEMORY, TARGET_RHO, TARGET_BEST = 0.10, 0.8, 0.10


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(xs):
        order = sorted(range(len(xs)), key=xs.__getitem__)
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def predictions(name: str, chosen, profile, layers):
    from shardlib.analysis.search import price

    spec = MODELS[name]
    return price(spec.config(layers), chosen, profile, cls=spec.cls)


def measure_rounds(name: str, chosen, rounds: int, steps: int, layers) -> list[list[dict]]:
    """``rounds`` x every layout, interleaved: per layout its list of measurements."""
    found: list[list[dict]] = [[] for _ in chosen]
    for r in range(rounds):
        for i, layout in enumerate(chosen):
            m = measure(name, layout, steps=steps, layers=layers)
            found[i].append(m)
            status = m["error"] or f"{m['peak_growth_bytes'] / MIB:.0f} MiB, {m['step_s_median']:.3f} s"
            print(f"  [{name} round {r + 1}/{rounds}] {layout.name():<40} {status}", flush=True)
    return found


def summarize(name: str, chosen, predicted, measured) -> dict:
    rows, points = [], []
    for layout, p, runs in zip(chosen, predicted, measured):
        ok = [m for m in runs if not m["error"]]
        if isinstance(p, str) or not ok:
            rows.append([layout.name(), "refused" if isinstance(p, str) else "-", "failed" if not ok else "-"])
            continue
        peak = statistics.median(m["peak_growth_anon_bytes"] for m in ok)  # library code pages left out
        step = statistics.median(m["step_s_median"] for m in ok)
        steps = [m["step_s_median"] for m in ok]
        points.append(dict(layout=layout.name(), predicted_peak=p.peak_bytes, measured_peak=peak,
                           predicted_step=p.step_s, measured_step=step, step_spread=[min(steps), max(steps)],
                           round_steps=steps,
                           bottleneck=p.bottleneck, memory_terms=p.memory, time_terms=p.time))
        rows.append([layout.name(), f"{p.peak_bytes / MIB:.0f}", f"{peak / MIB:.0f}",
                     f"{(p.peak_bytes - peak) / peak:+.1%}", f"{p.step_s:.3f}",
                     f"{step:.3f} ({min(steps):.3f}-{max(steps):.3f})", p.bottleneck])
    print_table(f"{name}: predicted vs measured (peak MiB per rank, step s; {len(measured[0])} rounds)",
                ["layout", "pred peak", "meas peak", "error", "pred step", "meas step (range)", "bottleneck"], rows)
    errors = [abs(pt["predicted_peak"] - pt["measured_peak"]) / pt["measured_peak"] for pt in points]
    rho = spearman([pt["predicted_step"] for pt in points], [pt["measured_step"] for pt in points])
    picked = min(points, key=lambda pt: pt["predicted_step"])
    fastest = min(points, key=lambda pt: pt["measured_step"])
    best = picked["measured_step"] / fastest["measured_step"] - 1
    within = sum(e <= TARGET_MEMORY for e in errors)
    print(f"{name}: memory error max {max(errors):.1%}, median {statistics.median(errors):.1%} "
          f"({within}/{len(errors)} within {TARGET_MEMORY:.0%}); step-time Spearman rho {rho:.2f} "
          f"(target >= {TARGET_RHO}); predicted fastest {picked['layout']} measured {picked['measured_step']:.3f} s, "
          f"measured fastest {fastest['layout']} {fastest['measured_step']:.3f} s: {best:+.1%} "
          f"(target <= {TARGET_BEST:.0%})\n", flush=True)
    return dict(model=name, points=points, memory_error_max=max(errors), memory_error_median=statistics.median(errors),
                memory_within=within, rho=rho, picked=picked["layout"], fastest=fastest["layout"], best_gap=best)


def reprice(path: str, profile, layers) -> list[dict]:
    """The measurements of an earlier run (its JSON), priced again by the current cost model and ``profile``."""
    import json

    earlier = json.loads(open(path).read())["results"]
    results = []
    for res in earlier:
        name = res["model"]
        by_name = {la.name(): la for la in layouts(name, layers=layers)}
        chosen = [by_name[pt["layout"]] for pt in res["points"]]
        predicted = predictions(name, chosen, profile, layers)
        measured = [[{"error": None, "peak_growth_anon_bytes": pt["measured_peak"], "step_s_median": step}
                     for step in _round_steps(pt)] for pt in res["points"]]
        results.append(summarize(name, chosen, predicted, measured))
    return results


def where(name: str, words: str, profile, layers, shown: int = 12) -> None:
    """Where one layout's peak comes from: the cost model's memory terms of every stage beside each rank's measured
    peak growth and the storages its memory step had alive at the peak (``measure(where=True)``)."""
    from shardlib.analysis.costmodel import stage_memory, transport_pages
    from shardlib.analysis.dryrun_report import size_text
    from shardlib.analysis.metarun import meta_model, planned_policy
    from shardlib.analysis.search import _Pricer

    layout = next(lay for lay in layouts(name, layers=layers) if all(w in lay.name().split() for w in words.split()))
    spec = MODELS[name]
    full = meta_model(spec.config(layers), spec.cls)
    report = _Pricer(full, planned_policy(full), profile.device).report(layout)
    print(f"{name} {layout.name()}: predicted, per stage")
    for stage in report.stages:
        terms = stage_memory(report, layout, stage) | transport_pages(stage, layout, profile)  # as predict() sums
        print(f"  stage {stage.index}: {size_text(sum(terms.values()))} = "
              + " + ".join(f"{k} {size_text(v)}" for k, v in terms.items() if v))
    m = measure(name, layout, steps=1, layers=layers, where=True)
    if m["error"]:
        print(f"  measurement failed: {m['error']}")
        return
    for rec in m["per_rank"]:
        print(f"  rank {rec['rank']}: peak growth {rec['peak_growth_anon'] / MIB:.1f} MiB (params "
              f"{rec['param_bytes'] / MIB:.1f}, optimizer state {rec['opt_state_bytes'] / MIB:.1f}); alive at the "
              f"step's peak, made by (op number):")
        for mib, op, serial in rec["peak_storages"][:shown]:
            print(f"      {mib:8.2f} MiB  {op} (#{serial})")


def _round_steps(point: dict) -> list[float]:
    """The per-round step medians of a stored point (3 rounds: exactly its minimum, median and maximum)."""
    return point.get("round_steps") or [point["step_spread"][0], point["measured_step"], point["step_spread"][1]]


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for res in results:
        pts = res["points"]
        axes[0].scatter([p["measured_peak"] / MIB for p in pts], [p["predicted_peak"] / MIB for p in pts],
                        label=res["model"], s=18)
        axes[1].scatter([p["measured_step"] for p in pts], [p["predicted_step"] for p in pts], label=res["model"],
                        s=18)
    for ax, what in zip(axes, ("peak memory per rank (MiB)", "step time (s)")):
        lo, hi = ax.get_xlim()
        lo, hi = min(lo, ax.get_ylim()[0]), max(hi, ax.get_ylim()[1])
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
        if what.startswith("peak"):
            ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.15,
                            label="±10%")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {what}")
        ax.set_ylabel(f"predicted {what}")
        ax.legend(fontsize=8)
    fig.suptitle("shardlib plan on 4 gloo ranks (2 cores): predicted vs measured, every layout")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert-256,bert-768,t5-small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement (after the warm-up and "
                                                             "memory steps)")
    parser.add_argument("--layers", type=int, default=None, help="layers per stack (default: each model's)")
    parser.add_argument("--profile", help="a profile JSON (default: calibrate this machine first; with --reprice, "
                                          "the run's own)")
    parser.add_argument("--out", default="benchmarks/results/plan_accuracy.json")
    parser.add_argument("--plot", default="docs/img/plan_accuracy.png")
    parser.add_argument("--only", metavar="WORDS", help="measure only the layouts whose name holds every word "
                                                         "(e.g. 'pp2' or 'zero3 pp2')")
    parser.add_argument("--where", metavar="WORDS", help="one layout (the first whose name holds every word): its "
                                                          "predicted terms per stage and, per rank, the storages "
                                                          "alive at its peak; measures nothing else")
    parser.add_argument("--reprice", metavar="JSON", help="price the measurements of an earlier run's JSON again "
                                                           "(with --profile), measuring nothing")
    args = parser.parse_args()
    from shardlib.analysis.calibrate import calibrate
    from shardlib.analysis.profile import load_profile

    started = time.perf_counter()
    if args.profile:
        profile = load_profile(args.profile, world_size=4)
    elif args.reprice:  # the run's own profile: a re-price compares cost models on the same measurements
        import json

        from shardlib.analysis.profile import Profile

        profile = Profile.from_dict(json.loads(open(args.reprice).read())["profile"], source=args.reprice)
    else:
        print("calibrating this machine (4 ranks)...", flush=True)
        profile = calibrate(4)
        profile.save(os.path.splitext(args.out)[0] + "_profile.json")
    print(profile.summary(), flush=True)
    if args.reprice:
        results = reprice(args.reprice, profile, args.layers)
        write_json(args.out, dict(profile=profile.to_dict(), results=results, repriced=args.reprice))
        plot(results, args.plot)
        return 0
    if args.where:
        for name in args.models.split(","):
            where(name, args.where, profile, args.layers)
        return 0
    results = []
    for name in args.models.split(","):
        chosen = [lay for lay in layouts(name, layers=args.layers)
                  if all(word in lay.name().split() for word in (args.only or "").split())]
        t0 = time.perf_counter()
        predicted = predictions(name, chosen, profile, args.layers)
        print(f"{name}: {len(chosen)} layouts priced in {time.perf_counter() - t0:.1f} s", flush=True)
        measured = measure_rounds(name, chosen, args.rounds, args.steps, args.layers)
        results.append(summarize(name, chosen, predicted, measured))
    write_json(args.out, dict(profile=profile.to_dict(), results=results))
    plot(results, args.plot)
    print(f"done in {(time.perf_counter() - started) / 60:.1f} min; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
