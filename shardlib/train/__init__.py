"""Training on the dp x pp x sp x tp mesh, in layers a user can take one at a time:

* :class:`shardlib.pipeline.PipelineRunner`: pipeline stages and schedules;
* :class:`Trainer` (:mod:`.trainer`): weigh microbatch losses, reduce, clip, step; precision and the fp16 loss
  scaler (:mod:`.precision`), master weights (:mod:`.optim`), ZeRO-1/2 over flat buckets (:mod:`.zero`), ZeRO-3
  (:mod:`.fsdp`), and the one data-parallel layer over them and DDP (:mod:`.dataparallel`);
* :meth:`Trainer.fit` (:mod:`.loop`): data (:mod:`.data`), evaluation, logging (:mod:`.logs`), checkpoints and
  exact resume (:mod:`.checkpoints`);
* :class:`TrainingArguments` (:mod:`.args`): one dataclass of command-line arguments, the mesh and the launch
  (:mod:`.launch`: torchrun's elastic agent, on loopback for one node).

Lazy (PEP 562), like the package: ``import shardlib.train`` loads none of them. Training sits above
:mod:`shardlib.checkpoint`, which it saves through; the checkpoints read the optimizer state through
:mod:`shardlib.parallel.optim_state` and FSDP2's dp shards through :mod:`shardlib.parallel.dp_shards`.
"""

from .._lazy import lazy_attributes

__getattr__, __dir__ = lazy_attributes(__name__, {
    "args": ["TrainingArguments", "launch_if_requested", "mesh_from_args", "parse_args"],
    "batches": ["dp_shard", "split_batch"],
    "data": ["GlobalBatchSampler", "epoch_order"],
    "loop": ["FitResult", "evaluate", "fit", "warmup_cosine"],
    "precision": ["DynamicLossScaler"],
    "trainer": ["Trainer", "rng_safe_checkpointing"],
})

__all__ = ["Trainer", "DynamicLossScaler", "fit", "FitResult", "evaluate", "warmup_cosine", "GlobalBatchSampler",
           "epoch_order", "dp_shard", "split_batch", "rng_safe_checkpointing", "TrainingArguments", "parse_args",
           "mesh_from_args", "launch_if_requested"]
