"""shardlib: policy-driven sharding of unmodified HuggingFace models over a dp x pp x sp x tp mesh.

    mesh = shardlib.init_mesh(tp=2)          # under `shardlib run` / torchrun
    model = shardlib.shard(model, mesh)      # policy found from the model class
    print(shardlib.plan("bert-large/", tp=8, pp=4))   # dry run of a layout, no ranks needed

The package is layered (docs/architecture.md); each layer is a sub-package that imports only from the layers
below it:

* :mod:`shardlib.parallel`: what a rank runs: mesh, collectives, parallel layers and styles, layouts, RNG streams,
  overlap, gradient sync, timeouts, dp-sharded tensors, the optimizer's state by parameter (and
  :mod:`shardlib.safetensors_io`, file I/O);
* :mod:`shardlib.kernels`: fused ops, each with its reference;
* :mod:`shardlib.sharding.plan`: the plan's vocabulary (plain data, pattern matching);
* :mod:`shardlib.policies` (one plan per architecture) and :mod:`shardlib.pipeline` (stages cut from the trunk);
* :mod:`shardlib.sharding`: the compiler: passes, ``shard()``, sequence parallelism, losses, state;
* :mod:`shardlib.analysis` (what reads a sharded model without training it: dry run, meta run, export, compile) and
  :mod:`shardlib.checkpoint` (checkpoints);
* :mod:`shardlib.train`: training (ZeRO, launch), saving through the checkpoints;
* :mod:`shardlib.cli`: the ``shardlib`` command.

``import shardlib`` imports none of them (nor torch): every name below loads its module on first use.
"""

from ._lazy import lazy_attributes

__version__ = "0.1.0"

__getattr__, __dir__ = lazy_attributes(__name__, {
    "parallel.mesh": ["init_mesh", "Mesh", "MeshError"],
    "parallel.layout": ["Layout", "layout_of", "named_layouts"],
    "parallel.random": ["manual_seed", "RNGStatesTracker"],
    "parallel.styles": ["ColwiseParallel", "RowwiseParallel", "VocabParallel", "CopyInputs", "LocalRNG"],
    "sharding.plan": ["Plan", "LossSpec", "Stack", "PlanError"],
    "sharding.sharder": ["shard", "report"],
    "sharding.shard_report": ["ShardReport"],
    "sharding.sharded": ["shard_state", "ShardState"],
    "sharding.state": ["full_state_dict", "load_full_state_dict", "materialize"],
    "kernels": ["Kernels"],
    "analysis.dryrun": ["plan", "PlanReport"],
    "analysis.compiling": ["compile_model"],
    "checkpoint": ["from_pretrained", "save_pretrained", "save_adapter", "load_adapter"],
    "train": ["Trainer", "TrainingArguments", "dp_shard"],
}, modules={name: name for name in ("parallel", "sharding", "analysis", "kernels", "policies", "pipeline", "train",
                                    "checkpoint", "safetensors_io", "cli")} | {"export": "analysis.export"})

__all__ = [
    "init_mesh", "Mesh", "MeshError", "shard", "report", "ShardReport", "Plan", "LossSpec", "Stack", "PlanError",
    "ColwiseParallel", "RowwiseParallel", "VocabParallel", "CopyInputs", "LocalRNG", "Layout", "layout_of",
    "named_layouts", "full_state_dict", "load_full_state_dict", "materialize", "manual_seed", "RNGStatesTracker",
    "Trainer", "TrainingArguments", "dp_shard", "checkpoint", "train", "Kernels", "shard_state", "ShardState",
    "plan", "PlanReport", "compile_model", "export", "from_pretrained", "save_pretrained", "save_adapter",
    "load_adapter",
]
