"""The report of ``benchmarks/plan_accuracy.py``: predicted against measured per model, the targets, the plot."""

from __future__ import annotations

import statistics

from _harness import print_table

MIB = 2 ** 20
TARGET_MEMORY, TARGET_RHO, TARGET_BEST = 0.10, 0.8, 0.10


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(xs):
        order, r, i = sorted(range(len(xs)), key=xs.__getitem__), [0.0] * len(xs), 0
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


def _figures(m: dict):
    """(peak bytes, step s, static bytes) of one measurement of either study, None where it failed."""
    if m.get("error"):
        return None
    if "step_s_median" in m:  # 4 ranks: library code pages left out of the peak
        return m["peak_growth_anon_bytes"], m["step_s_median"], None
    return m["peak"], m["step_s"], m.get("static")


def summarize(name: str, layers, chosen, predicted, runs, world: int) -> dict:
    """One model's table, predicted against measured, and the targets; one device ranks by time per sample."""
    one, rows, points = world == 1, [], []
    scale, fmt = (1e3, ".1f") if one else (1, ".3f")
    for layout, p, found in zip(chosen, predicted, runs):
        ok = [f for f in map(_figures, found) if f]
        head = [layout.name()] + ([str(layout.batch)] if one else [])
        if isinstance(p, str) or not ok:
            rows.append(head + ([p] if isinstance(p, str) else ["-"]) + [found[-1].get("error") or "failed"])
            continue
        steps = [f[1] for f in ok]
        peak, step = (None if ok[0][0] is None else statistics.median(f[0] for f in ok)), statistics.median(steps)
        static = None if ok[0][2] is None else statistics.median(f[2] for f in ok)
        static_pred = p.memory.get("parameters", 0) + p.memory.get("optimizer state", 0)
        points.append(dict(layout=layout.name(), batch=layout.batch, predicted_peak=p.peak_bytes, measured_peak=peak,
                           predicted_step=p.step_s, measured_step=step, step_spread=[min(steps), max(steps)],
                           round_steps=steps, predicted_static=static_pred, measured_static=static,
                           bottleneck=p.bottleneck, memory_terms=p.memory, time_terms=p.time))
        rows.append(head + [f"{p.peak_bytes / MIB:.0f}", "-" if peak is None else f"{peak / MIB:.0f}",
                            "-" if peak is None else f"{(p.peak_bytes - peak) / peak:+.1%}"]
                    + ([f"{static_pred / MIB:.0f} / " + ("-" if static is None else f"{static / MIB:.0f}")]
                       if one else [])
                    + [f"{p.step_s * scale:{fmt}}", f"{step * scale:{fmt}} ({min(steps) * scale:{fmt}}-"
                       f"{max(steps) * scale:{fmt}})", p.bottleneck])
    print_table(f"{name}, {layers} layers per stack, {'one device' if one else f'{world} ranks'}: predicted vs "
                f"measured (peak MiB per rank, step {'ms' if one else 's'}; {len(runs[0])} rounds)",
                ["layout"] + (["batch"] if one else []) + ["pred peak", "meas peak", "error"]
                + (["static pred / meas"] if one else []) + ["pred step", "meas step (range)", "bottleneck"], rows)
    out = dict(model=name, layers=layers, world=world, points=points,
               measured=[{"layout": la.to_dict(), "runs": r} for la, r in zip(chosen, runs)])
    if len(points) < 2:
        return out
    per = [pt["batch"] if one else 1 for pt in points]
    pred = [pt["predicted_step"] / n for pt, n in zip(points, per)]
    meas = [pt["measured_step"] / n for pt, n in zip(points, per)]
    picked, fastest = min(range(len(points)), key=pred.__getitem__), min(range(len(points)), key=meas.__getitem__)
    label = lambda i: points[i]["layout"] + (f" b{points[i]['batch']}" if one else "")  # noqa: E731
    out.update(rho=spearman(pred, meas), picked=label(picked), fastest=label(fastest),
               best_gap=meas[picked] / meas[fastest] - 1)
    line = (f"{'time-per-sample' if one else 'step-time'} Spearman rho {out['rho']:.2f} (target >= {TARGET_RHO}); "
            f"predicted fastest {out['picked']} is {out['best_gap']:+.1%} from the measured fastest {out['fastest']} "
            f"(target <= {TARGET_BEST:.0%})")
    if points[0]["measured_peak"] is not None:
        errors = [abs(pt["predicted_peak"] - pt["measured_peak"]) / pt["measured_peak"] for pt in points]
        out.update(memory_error_max=max(errors), memory_error_median=statistics.median(errors),
                   memory_within=sum(e <= TARGET_MEMORY for e in errors))
        line = (f"memory error max {max(errors):.1%}, median {out['memory_error_median']:.1%} ({out['memory_within']}/"
                f"{len(errors)} within {TARGET_MEMORY:.0%}); " + line)
    print(f"{name}: {line}\n", flush=True)
    return out


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for res in results:
        for ax, key, scale in ((axes[0], "peak", MIB), (axes[1], "step", 1)):
            ax.scatter([p[f"measured_{key}"] / scale for p in res["points"]],
                       [p[f"predicted_{key}"] / scale for p in res["points"]], label=res["model"], s=18)
    for ax, what in zip(axes, ("peak memory per rank (MiB)", "step time (s)")):
        lo, hi = min(ax.get_xlim()[0], ax.get_ylim()[0]), max(ax.get_xlim()[1], ax.get_ylim()[1])
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
        if what.startswith("peak"):
            ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.15,
                            label="±10%")
        ax.set(xscale="log", yscale="log", xlabel=f"measured {what}", ylabel=f"predicted {what}")
        ax.legend(fontsize=8)
    fig.suptitle("shardlib plan on 4 gloo ranks (2 cores): predicted vs measured, every layout")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
