"""The training runtime's former home; it lives in :mod:`shardlib.train` now (trainer, fit loop, data,
checkpoints) and the pipeline schedules in :class:`shardlib.pipeline.PipelineRunner`. Kept so that
``shardlib.runtime.Trainer`` and ``shardlib.runtime.dp_shard`` keep working."""

from .pipeline import SCHEDULES
from .train import Trainer, dp_shard, fit, rng_safe_checkpointing, split_batch

__all__ = ["Trainer", "dp_shard", "split_batch", "fit", "rng_safe_checkpointing", "SCHEDULES"]
