"""The picture of a ``fit`` log (``save_dir/log.jsonl``, :mod:`shardlib.train.logs`): the loss curve and, beside it
for a mixture-of-experts model, the auxiliary router losses and each MoE layer's load over the steps: its imbalance
(the tokens of its busiest expert over the mean per expert: 1 is even, E puts every token on one of E experts) and the
share of its tokens a capacity router dropped.

Drawn with matplotlib (``pip install "shardlib[plot]"``), from the log's records, as
``benchmarks/plot_train_throughput.py`` draws the benchmark's loss curves; on matplotlib's object API (no pyplot, so
a caller's backend is left alone). ``shardlib plot RUN`` does the same from the command line::

    from shardlib.train.plots import plot_log
    plot_log("run")                      # run/log.jsonl -> run/log.png
    plot_log("run/log.jsonl", "run/train.svg")   # SVG keeps its text (the layer names) as text
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .logs import LOG_FILE

#: the panels beside the loss curve: (series key, title)
LOAD_PANELS = (("imbalance", "MoE layer imbalance (max / mean tokens per expert)"),
               ("dropped_share", "share of tokens the capacity dropped"))


def log_path(run: str | Path) -> Path:
    """``run``'s log: ``run`` itself, or ``run/log.jsonl`` for a run directory (a fit ``save_dir``)."""
    run = Path(run)
    return run / LOG_FILE if run.is_dir() else run


def read_log(path: str | Path) -> list[dict]:
    """The records of a log; a torn line (a killed writer's last) is skipped."""
    records = []
    for line in log_path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def imbalance(tokens_per_expert: list[int]) -> float:
    """The most tokens an expert received over the mean per expert (nan when no expert received a token)."""
    total = sum(tokens_per_expert)
    return max(tokens_per_expert) * len(tokens_per_expert) / total if total else math.nan


def _number(value) -> float:
    return float(value)  # the log writes inf / nan as strings, which float() reads back


def series(records: list[dict]) -> dict[str, dict[str, tuple[list, list]]]:
    """What :func:`plot_log` draws: ``"loss"``: ``loss``, ``main_loss`` and ``eval_loss`` -> (steps, values);
    ``"terms"``: each auxiliary loss term; ``"imbalance"`` and ``"dropped_share"``: MoE layer -> (steps, values)."""
    out = {"loss": {}, "terms": {}, "imbalance": {}, "dropped_share": {}}

    def put(kind, name, step, value):
        steps, values = out[kind].setdefault(name, ([], []))
        steps.append(step)
        values.append(_number(value))

    for record in records:
        step = record.get("step", 0)
        if record.get("eval"):
            if record.get("loss") is not None:
                put("loss", "eval_loss", step, record["loss"])
            continue
        for name, value in record.items():
            if name in ("loss", "main_loss"):
                put("loss", name, step, value)
            elif name.startswith("router_") and name.endswith("_loss"):
                put("terms", name, step, value)
        for layer, load in (record.get("experts") or {}).items():
            put("imbalance", layer, step, imbalance(load["tokens_per_expert"]))
            put("dropped_share", layer, step, load["dropped_share"])
    return out


def plot_log(run: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run``'s log (a log file or a fit ``save_dir``) into ``out`` (default: the log's path with ``.png``;
    the format follows the suffix) and return ``out``: the loss curve, then, where the log has them, the auxiliary
    router losses and each MoE layer's imbalance and dropped share, one line per layer, named by its module path."""
    path = log_path(run)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such log (fit(save_dir=...) writes save_dir/{LOG_FILE})")
    drawn = series(read_log(path))
    if "loss" not in drawn["loss"]:
        raise ValueError(f"{path} holds no training record (a 'loss' of a train step) to draw")
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError('drawing a training log needs matplotlib: pip install "shardlib[plot]"') from exc
    panels = [("loss", "training loss")] + ([("terms", "auxiliary router losses")] if drawn["terms"] else [])
    panels += [p for p in LOAD_PANELS if drawn[p[0]]]
    fig = Figure(figsize=(5.0 * len(panels), 4.2), layout="constrained")
    for ax, (kind, title) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        for name, (steps, values) in drawn[kind].items():
            style = dict(marker="o", linestyle="none") if name == "eval_loss" else dict(linewidth=1.2)
            ax.plot(steps, values, label=name, **style)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6 if len(drawn[kind]) > 4 else 8, ncols=2 if len(drawn[kind]) > 8 else 1)
    fig.suptitle(str(path), fontsize=9)
    out = Path(out) if out is not None else path.with_suffix(".png")
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(out, dpi=120)
    return out
