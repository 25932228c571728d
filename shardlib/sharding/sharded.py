"""What :func:`shardlib.shard` leaves on a model, and the one accessor that reads it."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .plan import Plan

_ATTR = "_shardlib"


@dataclass
class ShardState:
    """Everything a sharded model carries: its mesh, policy, plan, the report of every rewrite, the per-rank
    dropout streams and, when ``mesh.pp > 1``, this rank's pipeline stages (:class:`shardlib.pipeline.PipelineSplit`)."""

    mesh: object  # shardlib.Mesh, or an OfflineMesh for a model sharded without process groups
    policy: object
    plan: Plan
    report: object  # shardlib.sharding.shard_report.ShardReport
    rng_tracker: object  # shardlib.parallel.random.RNGStatesTracker
    pipeline: object = None

    def attach(self, model: nn.Module) -> None:
        setattr(model, _ATTR, self)


def shard_state(model: nn.Module, *, required: bool = True) -> ShardState | None:
    """The :class:`ShardState` of a model sharded by :func:`shardlib.shard`. ``required``: raise a ValueError
    naming the model class when it is not sharded (else return None)."""
    state = getattr(model, _ATTR, None)
    if state is None and required:
        raise ValueError(f"{type(model).__name__} is not sharded: call shardlib.shard(model, mesh) first")
    return state
