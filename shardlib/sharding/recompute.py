"""Activation checkpointing of a sharded model whose recomputation replays its dropout streams: what the Trainer
turns on with ``activation_checkpointing=True`` and the dry run (:mod:`shardlib.analysis.dryrun`) counts."""

from __future__ import annotations

import contextlib

from torch import nn

from .sharded import shard_state


def rng_safe_checkpointing(model: nn.Module, recompute_context=contextlib.nullcontext) -> None:
    """HF activation checkpointing per layer (non-reentrant) whose recomputation replays the per-rank dropout
    stream too: the tracker's state at the forward is restored for the recompute, then put back.
    ``recompute_context()``: entered around each recomputation too (the dry run's: backward may run on another
    thread, outside the modes of the forward)."""
    tracker = shard_state(model).rng_tracker

    def context_fn():
        snapshot = tracker.get_states()

        @contextlib.contextmanager
        def recompute():
            current = tracker.get_states()
            tracker.set_states(snapshot)
            try:
                with recompute_context():
                    yield
            finally:
                tracker.set_states(current)

        return contextlib.nullcontext(), recompute()

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                       "context_fn": context_fn})
