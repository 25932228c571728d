"""Plots of ``benchmarks/train_throughput.py``'s logs (its ``load_results`` / ``summarize``): samples/s per mode and
precision over the baseline's, and the loss curves per precision. Docs: docs/benchmarks/training-runs.md.

    .venv/bin/python benchmarks/plot_train_throughput.py                      # benchmarks/results/train_throughput
    .venv/bin/python benchmarks/plot_train_throughput.py --out benchmarks/results/train_throughput_quick \\
        --img-dir /tmp/img                                                    # the --quick run, elsewhere

``docs/img`` is the default ``--img-dir``: run it on the logs of a full run only, the PNGs there are committed.
"""

from __future__ import annotations

import argparse
import os
import textwrap
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROOT = Path(__file__).resolve().parent.parent
SPEED_PNG, LOSS_PNG = "train_throughput_speed.png", "train_throughput_loss.png"


def _subtitle(meta: dict) -> str:
    where = f"{meta['cpus']} CPU cores" if meta["device"] == "cpu" else "one GPU"
    return (f"BERT-{meta['size']} sequence classification, batch {meta['batch']} x {meta['seq']} tokens, "
            f"{meta['steps']} steps, dropout {meta['dropout']:g}, {where}, torch {meta['torch']}")


def plot_speed(meta: dict, rows: list[dict], path: Path) -> None:
    """Grouped bars: x = mode, one bar per precision, height = samples/s / baseline samples/s (same precision)."""
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    titles = {r["mode"]: r["title"] for r in rows}
    width = 0.8 / len(precisions)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.5 * len(modes)), 5.5))
    for j, precision in enumerate(precisions):
        xs, heights, labels = [], [], []
        for i, mode in enumerate(modes):
            row = next((r for r in rows if r["mode"] == mode and r["precision"] == precision), None)
            if row is not None and row.get("vs_baseline") is not None:
                xs.append(i + (j - (len(precisions) - 1) / 2) * width)
                heights.append(row["vs_baseline"])
                labels.append(f"{row['samples_per_s']:.3g}/s")
        bars = ax.bar(xs, heights, width, label=precision)
        ax.bar_label(bars, labels=labels, fontsize=7, rotation=90, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    wrap = lambda m: textwrap.fill(titles[m], 14, break_long_words=False)  # noqa: E731 - tick labels never overlap
    ax.set_xticks(range(len(modes)), [wrap(m) for m in modes], fontsize=8)
    ax.set_ylabel("samples/s vs baseline (same precision)")
    ax.set_ylim(0, max([r["vs_baseline"] or 0 for r in rows] + [1.0]) * 1.3)
    baseline = titles.get(meta["baseline"], meta["baseline"])
    ax.set_title(f"Training throughput vs {baseline} = 1.0\n{_subtitle(meta)}", fontsize=9)
    ax.legend(title="precision")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss(meta: dict, rows: list[dict], path: Path) -> None:
    """One panel per precision: every mode's per-step loss, the baseline thick and grey underneath."""
    import matplotlib.pyplot as plt

    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    fig, axes = plt.subplots(1, len(precisions), figsize=(6.0 * len(precisions), 4.5), squeeze=False, sharey=True)
    for ax, precision in zip(axes[0], precisions):
        for row in (r for r in rows if r["precision"] == precision and r["losses"]):
            steps = range(1, len(row["losses"]) + 1)
            if row["mode"] == meta["baseline"]:
                ax.plot(steps, row["losses"], color="0.55", linewidth=4, label=row["title"], zorder=1)
            else:
                ax.plot(steps, row["losses"], linewidth=1.2, marker=".", markersize=3, label=row["title"], zorder=2)
        ax.set_title(precision)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss (global batch)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"Loss curves, same data, seed and lr in every mode\n{_subtitle(meta)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "train_throughput", help="its --out")
    p.add_argument("--img-dir", type=Path, default=ROOT / "docs" / "img", help="where the PNGs go (default docs/img)")
    args = p.parse_args(argv)
    if not (args.out / "runs.json").exists():
        p.error(f"{args.out / 'runs.json'} does not exist: run benchmarks/train_throughput.py first")
    import matplotlib

    matplotlib.use("Agg")
    from train_throughput import load_results, summarize

    meta, runs = load_results(args.out)
    rows = [r for r in summarize(meta, runs) if "error" not in r]
    if not rows:
        p.error(f"no run in {args.out} left a log")
    args.img_dir.mkdir(parents=True, exist_ok=True)
    plot_speed(meta, rows, args.img_dir / SPEED_PNG)
    plot_loss(meta, rows, args.img_dir / LOSS_PNG)
    print(f"wrote {args.img_dir / SPEED_PNG} and {args.img_dir / LOSS_PNG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
