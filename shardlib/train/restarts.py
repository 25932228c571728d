"""What ``fit`` does when its job was restarted: torchrun's elastic agent (``shardlib run --max-restarts N``,
``python train.py --nproc N --max-restarts N``, ``--nnodes MIN:MAX``) starts every rank again after a failure or a
change of nodes, and ``fit`` continues from the newest complete checkpoint on its own.

* :func:`default_resume`: under a launcher that may restart the job (``TORCHELASTIC_MAX_RESTARTS`` > 0), ``resume``
  left unset means ``"auto"`` when there is a ``save_dir``. Every rank of every node decides alike (a node that
  joins late has restart count 0 while the others have more, so the count itself cannot decide).
* :class:`Progress`: rank 0 notes the last step it finished (``save_dir/progress.json``: step and wall time, one small
  file replaced after each step), so a restarted run can say how many steps and samples it replays and how long
  the job stood still (from the last finished step to the first step after the restart).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("shardlib.train")

PROGRESS_FILE = "progress.json"


def restart_count() -> int:
    """How many times the elastic agent has restarted this job's ranks (0: the first attempt, or no launcher)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def launcher_max_restarts() -> int:
    """How many times the launcher that started this process restarts the job (0: none, or no launcher)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)


def restartable() -> bool:
    """Whether a launcher runs this process that restarts the job after a failure."""
    return launcher_max_restarts() > 0


def default_resume(resume, save_dir) -> str | Path | None:
    """``resume`` as given; unset under a restarting launcher with a ``save_dir``: ``"auto"``."""
    if resume is None and save_dir is not None and restartable():
        return "auto"
    return resume


class Progress:
    """``save_dir/progress.json`` on rank 0: ``{"step", "time"}`` of the last finished step (None: not kept)."""

    def __init__(self, save_dir: Path | None, enabled: bool):
        self.path = save_dir / PROGRESS_FILE if save_dir is not None and enabled else None
        self.previous = self._read()  # the attempt before this one, read before this one writes

    def _read(self) -> dict | None:
        if self.path is None:
            return None
        try:
            record = json.loads(self.path.read_text())
            return record if isinstance(record.get("step"), int) else None
        except (OSError, ValueError, AttributeError):  # none yet, or torn by a kill: informational only
            return None

    def step(self, step: int) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{PROGRESS_FILE}.tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"step": step, "time": time.time()}))
        os.replace(tmp, self.path)


def announce(resumed_from: Path, step: int, batch_size: int, previous: dict | None) -> str:
    """The log line of a resume: the restart, the checkpoint, its step, and what is replayed."""
    attempt = restart_count()
    text = f"{f'restart {attempt}: ' if attempt else ''}resuming from {resumed_from} at step {step}"
    if previous is not None and previous["step"] > step:
        replayed = previous["step"] - step
        steps = f"steps {step + 1}-{previous['step']} are" if replayed > 1 else f"step {step + 1} is"
        text += f"; {steps} replayed ({replayed * batch_size} samples)"
    elif previous is not None:
        text += "; nothing is replayed"
    return text
