"""What ``fit`` reports, on one rank (global rank 0): a tqdm bar, the ``logging`` module (logger
``shardlib.train``), one JSON line per log step in ``save_dir/log.jsonl`` and TensorBoard scalars when the
``tensorboard`` package is installed (the ``tensorboard`` extra).

A JSONL record: ``{"step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s"}`` (the loss is the
mean of the global-batch losses since the previous record); evaluation records carry ``"eval": true`` and the eval
loss and metrics. Under fp16 training records also carry ``"loss_scale"`` and ``"skipped_steps"``. A mixture of
experts' records carry each MoE layer's load (``"experts"``) and, when its loss holds auxiliary router losses, the
loss apart: ``"main_loss"`` and each term (``"router_z_loss"``, ``"router_aux_loss"``), averaged like the loss
(:mod:`shardlib.train.loss_terms`). :mod:`shardlib.train.plots` draws a log (``shardlib plot``).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

log = logging.getLogger("shardlib.train")

LOG_FILE = "log.jsonl"


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf / nan
    return value


class TrainLog:
    def __init__(self, save_dir: Path | None, *, enabled: bool, total_steps: int | None, start_step: int,
                 progress: bool = True):
        self.enabled = enabled
        self.path = save_dir / LOG_FILE if save_dir is not None and enabled else None
        self.bar = self.tensorboard = None
        self._start_step, self._opened = start_step, False  # files are touched at the first record, not before
        if enabled and progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=sys.stderr,
                            dynamic_ncols=True, mininterval=1.0)

    def _truncate_after(self, step: int) -> None:
        """A resumed run continues the log of the run it resumes: records after its checkpoint are dropped."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def record(self, values: dict) -> None:
        if not self.enabled:
            return
        values = {k: _clean(v) for k, v in values.items() if v is not None}
        if self.path is not None and not self._opened:
            self._opened = True
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._truncate_after(self._start_step)
            self.tensorboard = _tensorboard(self.path.parent / "tensorboard")
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(values) + "\n")
        is_eval = values.get("eval", False)
        shown = {k: v for k, v in values.items() if k not in ("step", "epoch", "eval")}
        log.info("%s step %d: %s", "eval" if is_eval else "train", values["step"],
                 ", ".join(f"{k}={_short(v)}" for k, v in shown.items()))
        if self.bar is not None and is_eval:  # evaluations stay visible above the bar
            self.bar.write(f"eval step {values['step']}: " + ", ".join(f"{k}={_short(v)}" for k, v in shown.items()))
        if self.bar is not None:
            postfix = {("eval_" if is_eval else "") + k: _short(v) for k, v in shown.items()
                       if k in ("loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s") or is_eval}
            self.bar.set_postfix(postfix, refresh=False)
        if self.tensorboard is not None:
            prefix = "eval/" if is_eval else "train/"
            for k, v in shown.items():
                if isinstance(v, (int, float)):
                    self.tensorboard.add_scalar(prefix + k, v, values["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _step_of(line: str) -> float:
    """The step of a JSONL record; a torn last line (a killed writer) counts as after every step."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return math.inf


def _short(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return value


def _tensorboard(directory: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the tensorboard extra is not installed
        return None
    return SummaryWriter(str(directory))
