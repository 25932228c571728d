"""The sharding compiler (docs/architecture.md): a :class:`~.plan.Plan` (plain data, from a policy) is resolved
against one model and mesh and applied by a sequence of passes (:mod:`.passes`) behind :func:`~.sharder.shard`.

* :mod:`.plan`: the plan's data types and pattern matching; :mod:`.shard_report`: what ``shard()`` did;
* :mod:`.passes`, :mod:`.sharder`: check everything, then rewrite; :mod:`.transaction`: a failed rewrite restores
  the model; :mod:`.sharded`: the state a sharded model carries;
* :mod:`.sequence` (Megatron) and :mod:`.all_to_all` (Ulysses): sequence parallelism;
* :mod:`.losses`: vocab-parallel losses; :mod:`.state`: full state dicts to and from the shards.

:mod:`.plan` is a layer of its own, below :mod:`shardlib.policies` and :mod:`shardlib.pipeline` (which import it)
and below the rest of this package (which imports them). So this ``__init__`` is lazy (PEP 562) and imports nothing
of the package: importing :mod:`.plan` runs it, and must not load the compiler; ``shardlib.sharding.shard`` imports
the sharder on first use.
"""

from .._lazy import lazy_attributes

__getattr__, __dir__ = lazy_attributes(__name__, {
    "plan": ["Plan", "PlanError", "LossSpec", "LossItems", "Stack", "AttentionSite", "HeadsOf", "match_modules"],
    "sharder": ["shard", "report"],
    "shard_report": ["ShardReport", "ReportRow"],
    "sharded": ["ShardState", "shard_state"],
    "state": ["full_state_dict", "load_full_state_dict", "materialize"],
    "sequence": ["SequenceParallel"],
})

__all__ = ["Plan", "PlanError", "LossSpec", "LossItems", "Stack", "AttentionSite", "HeadsOf", "match_modules", "shard",
           "report", "ShardReport", "ReportRow", "ShardState", "shard_state", "full_state_dict", "load_full_state_dict",
           "materialize", "SequenceParallel"]
