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
    #: waits for parameter values still being written by a collective (a Trainer's ZeRO-1/2 all-gathers with
    #: ``overlap_param_gather``): :func:`settle_parameters` calls it before a reader outside a forward
    settle: object = None

    def attach(self, model: nn.Module) -> None:
        setattr(model, _ATTR, self)


def settle_parameters(model: nn.Module) -> None:
    """Wait until the model's parameters hold their values (a no-op unless a collective is still writing them):
    what every reader of the parameters outside a forward (checkpoint save and load, exports) calls first."""
    state = getattr(model, _ATTR, None)
    if state is not None and state.settle is not None:
        state.settle()


def shard_state(model: nn.Module, *, required: bool = True) -> ShardState | None:
    """The :class:`ShardState` of a model sharded by :func:`shardlib.shard`. ``required``: raise a ValueError
    naming the model class when it is not sharded (else return None)."""
    state = getattr(model, _ATTR, None)
    if state is None and required:
        raise ValueError(f"{type(model).__name__} is not sharded: call shardlib.shard(model, mesh) first")
    return state
