"""An optimizer's state by model parameter, whoever holds it: what checkpoints save and load
(:mod:`shardlib.checkpoint`) and what the Trainer counts (:mod:`shardlib.train.optim`).

torch's optimizers keep a parameter's state in ``optimizer.state[param]``. An optimizer that keeps it elsewhere
(fp32 master weights, ZeRO-1/2 pieces of flat buckets: :class:`shardlib.train.optim.MasterWeightsOptimizer`,
:class:`shardlib.train.zero.FlatZero`) subclasses :class:`ParamStateOptimizer` and answers for its parameters
itself. The state is keyed as the sharded checkpoint stores it (``optimizer.<key>.<param name>``), master weights
under :data:`MASTER_KEY`, so a checkpoint saved at one setting loads at any other.
"""

from __future__ import annotations

#: the state key of a parameter's fp32 master weight
MASTER_KEY = "master"


class ParamStateOptimizer:
    """Mixed into an optimizer whose per-parameter state is not torch's ``state[param]``."""

    def owns(self, param) -> bool:
        """Whether this rank steps ``param`` (some elements of it) and so holds state to load."""
        return True

    def param_state(self, param) -> dict:
        """The whole (tp-local) state of model parameter ``param``, master weight under :data:`MASTER_KEY`."""
        raise NotImplementedError

    def set_param_state(self, param, state: dict) -> None:
        """Restore ``param``'s state from its whole (tp-local) tensors."""
        raise NotImplementedError


def holds_state(optimizer, param) -> bool:
    """Whether this rank steps ``param`` (some elements of it, under zero=1/2) and so holds state to load."""
    return optimizer.owns(param) if isinstance(optimizer, ParamStateOptimizer) else True


def param_state(optimizer, param) -> dict:
    """The whole (tp-local) optimizer state of model parameter ``param``: under zero=1/2 gathered over dp, a
    collective every dp rank makes for the same parameters in the same order."""
    if isinstance(optimizer, ParamStateOptimizer):
        return optimizer.param_state(param)
    return optimizer.state.get(param, {})


def set_param_state(optimizer, param, state: dict) -> None:
    """Restore ``param``'s state from its whole (tp-local) tensors (under zero=1/2 this rank keeps its piece); a
    master weight missing from ``state`` (a checkpoint saved without master weights) is taken from the parameter,
    and one present is dropped for an optimizer without master weights."""
    if isinstance(optimizer, ParamStateOptimizer):
        optimizer.set_param_state(param, state)
        return
    state = {k: v for k, v in state.items() if k != MASTER_KEY}
    if state:
        optimizer.state[param] = state


__all__ = ["MASTER_KEY", "ParamStateOptimizer", "holds_state", "param_state", "set_param_state"]
