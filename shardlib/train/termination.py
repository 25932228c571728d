"""SIGTERM during ``fit``: a launcher stopping the job (torchrun forwards SIGTERM to its workers and kills them 30 s
later), a preempted or drained node. With a ``save_dir``, ``fit`` takes SIGTERM over for its duration: the step in
progress finishes, every rank learns of it at the step's end (one one-byte all-reduce over the world per step, so
a signal that reached one rank stops all of them at the same step), a checkpoint of that step is written and waited
for, and ``fit`` raises ``SystemExit(143)`` (128 + SIGTERM, the status a process killed by it reports). The
previous handler is restored when ``fit`` returns or raises. Off the main thread (where Python cannot install
handlers) SIGTERM keeps its own meaning."""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

EXIT_STATUS = 128 + signal.SIGTERM


class SigtermStop:
    def __init__(self, enabled: bool, device_type: str = "cpu"):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.device_type, self.received, self._previous = device_type, False, None

    def __enter__(self) -> "SigtermStop":
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame) -> None:
        self.received = True  # acted on at the end of the step: a handler must not run collectives

    def requested(self) -> bool:
        """Whether any rank received SIGTERM (every rank calls it after every step; the same answer on all)."""
        if not self.enabled:
            return False
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.received
        flag = torch.tensor([int(self.received)], dtype=torch.uint8, device=self.device_type)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
