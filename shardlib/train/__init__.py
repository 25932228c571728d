"""Training on the dp x pp x sp x tp mesh, in layers a user can take one at a time:

* :class:`shardlib.pipeline.PipelineRunner`: pipeline stages and schedules;
* :class:`Trainer` (:mod:`.trainer`): weigh microbatch losses, reduce, clip, step; precision and the fp16 loss
  scaler (:mod:`.precision`), master weights and ZeRO-1/2 (:mod:`shardlib.optim`), ZeRO-3 (:mod:`shardlib.fsdp`);
* :meth:`Trainer.fit` (:mod:`.fit`): data (:mod:`.data`), evaluation, logging (:mod:`.logs`), checkpoints and
  exact resume (:mod:`.checkpoints`);
* :class:`TrainingArguments` (:mod:`.args`): one dataclass of command-line arguments, the mesh and the launch.
"""

from .args import TrainingArguments, launch_if_requested, mesh_from_args, parse_args
from .batches import dp_shard, split_batch
from .data import GlobalBatchSampler, epoch_order
from .fit import FitResult, evaluate, fit, warmup_cosine
from .precision import DynamicLossScaler
from .trainer import Trainer, rng_safe_checkpointing

__all__ = ["Trainer", "DynamicLossScaler", "fit", "FitResult", "evaluate", "warmup_cosine", "GlobalBatchSampler", "epoch_order",
           "dp_shard", "split_batch", "rng_safe_checkpointing", "TrainingArguments", "parse_args", "mesh_from_args",
           "launch_if_requested"]
