"""The Trainer's optimizer: the user's optimizer, over fp32 master weights and/or partitioned over dp (ZeRO-1/2).

``Trainer(model, optimizer=lambda params: AdamW(params, lr=...), master_weights=..., zero=...)``: the function is
called once on this rank's parameters (torch optimizers allocate their state lazily, so this costs nothing); its
class and parameter groups are then rebuilt where needed:

* :class:`MasterWeightsOptimizer`: the same optimizer over fp32 copies of fp16/bf16 parameters;
* :class:`PartitionedOptimizer`: torch's ``ZeroRedundancyOptimizer`` over the dp group (each dp rank steps and keeps
  the state of its share of the parameters, then broadcasts them), with master weights for that share only.

Everything else talks to any of them through :func:`param_pairs`, :func:`param_state` and
:func:`set_param_state`: which parameters this rank steps (and the tensor whose ``.grad`` the step reads), and
each parameter's state by model parameter, as the sharded checkpoint stores it (``optimizer.<key>.<param name>``,
``optimizer.master.<param name>`` for master weights), so a checkpoint saved at one setting loads at any other.
"""

from __future__ import annotations

import functools
import inspect
from itertools import chain

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

MASTER_KEY = "master"


def _groups(params) -> list[dict]:
    params = list(params)
    return params if params and isinstance(params[0], dict) else [{"params": params}]


class MasterWeightsOptimizer(Optimizer):
    """``inner_class`` over fp32 copies ("masters") of ``params``. :meth:`copy_grads` moves the low-precision
    gradients onto the masters (as fp32; the model's gradients are freed), :meth:`step` steps the masters and copies
    them back into the parameters. ``param_groups`` and ``state`` are the inner optimizer's (an LR scheduler on
    this object drives it). The constructor has the shape ``ZeroRedundancyOptimizer`` calls (groups, defaults)."""

    def __init__(self, params, inner_class: type[Optimizer], **defaults):  # noqa: D107 - Optimizer.__init__ not
        # called on purpose: the parameter groups and the state live in the inner optimizer
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        inner_groups = []
        for group in _groups(params):
            masters = []
            for p in group["params"]:
                master = p.detach().to(torch.float32, copy=True)
                self.pairs.append((p, master))
                masters.append(master)
            inner_groups.append({**group, "params": masters})
        self.inner = inner_class(inner_groups, **defaults)
        self.defaults = self.inner.defaults
        self._master_of = {id(p): m for p, m in self.pairs}
        self._grads_copied = False

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def copy_grads(self) -> None:
        for p, master in self.pairs:
            master.grad = p.grad.to(torch.float32) if p.grad is not None else None
            p.grad = None
        self._grads_copied = True

    @torch.no_grad()
    def step(self, closure=None):
        if not self._grads_copied:
            self.copy_grads()
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        stepped = [(p, m) for p, m in self.pairs if m.grad is not None]
        if stepped:
            torch._foreach_copy_([p for p, _ in stepped], [m for _, m in stepped])
        self._grads_copied = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, master in self.pairs:
            p.grad = master.grad = None

    def param_state(self, param) -> dict:
        master = self._master_of[id(param)]
        return {**self.inner.state.get(master, {}), MASTER_KEY: master}

    def set_param_state(self, param, state: dict) -> None:
        state = dict(state)
        master = self._master_of[id(param)]
        with torch.no_grad():
            master.copy_(state.pop(MASTER_KEY, param))
        if state:
            self.inner.state[master] = state

    def load_state_dict(self, state_dict):
        raise NotImplementedError("load through shardlib.checkpoint.load(model, dir, optimizer=...)")

    def state_dict(self):
        raise NotImplementedError("save through shardlib.checkpoint.save(model, dir, optimizer=...)")

    def __repr__(self) -> str:
        return f"MasterWeightsOptimizer({self.inner!r})"


class PartitionedOptimizer(ZeroRedundancyOptimizer):
    """ZeRO-1/2: torch's ``ZeroRedundancyOptimizer`` over the dp group, whose local optimizer is the user's (or its
    :class:`MasterWeightsOptimizer`). ``owner[i]``: the dp rank (in the group) that steps parameter ``i`` of
    ``param_groups``."""

    partitioned = True

    def __init__(self, groups: list[dict], local_class, group, **defaults):
        super().__init__(groups, optimizer_class=local_class, process_group=group, **defaults)
        self.params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        index = {id(p): i for i, p in enumerate(self.params)}
        mine = [index[id(p)] for p, _ in param_pairs(self.optim)]
        self._mine = {id(self.params[i]) for i in mine}
        # every rank learns every parameter's owner from the owners themselves (public state only)
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        self.owner = [0] * len(self.params)
        for rank, indices in enumerate(gathered):
            for i in indices:
                self.owner[i] = rank
        self.dp_rank = dist.get_rank(group)

    def owns(self, param) -> bool:
        """Whether this dp rank steps (and holds the state of) ``param``."""
        return id(param) in self._mine


def param_pairs(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model parameter, the tensor the step updates) for every parameter this rank steps."""
    if isinstance(optimizer, PartitionedOptimizer):
        return param_pairs(optimizer.optim)
    if isinstance(optimizer, MasterWeightsOptimizer):
        return optimizer.pairs
    return [(p, p) for g in optimizer.param_groups for p in g["params"]]


def _local(optimizer):
    """The optimizer that steps this rank's parameters: a partitioned optimizer's local one, or itself."""
    return optimizer.optim if isinstance(optimizer, PartitionedOptimizer) else optimizer


def copy_grads(optimizer) -> None:
    """Move the model's gradients to where the step reads them (master weights), before unscaling / clipping."""
    if isinstance(_local(optimizer), MasterWeightsOptimizer):
        _local(optimizer).copy_grads()


def holds_state(optimizer, param) -> bool:
    """Whether this rank steps ``param`` (and so holds its state)."""
    return optimizer.owns(param) if isinstance(optimizer, PartitionedOptimizer) else True


def param_state(optimizer, param) -> dict:
    """The optimizer state of model parameter ``param`` held on this rank ({} when another rank holds it)."""
    if not holds_state(optimizer, param):
        return {}
    local = _local(optimizer)
    return local.param_state(param) if isinstance(local, MasterWeightsOptimizer) else local.state.get(param, {})


def set_param_state(optimizer, param, state: dict) -> None:
    """Restore ``param``'s state where this rank steps it (other ranks' parameters are skipped); a master weight
    missing from ``state`` (a checkpoint saved without master weights) is taken from the parameter."""
    if not holds_state(optimizer, param):
        return
    local = _local(optimizer)
    if isinstance(local, MasterWeightsOptimizer):
        local.set_param_state(param, state)
        return
    state = {k: v for k, v in state.items() if k != MASTER_KEY}
    if state:
        local.state[param] = state


def _constructor_defaults(optimizer: Optimizer) -> dict:
    """``optimizer.defaults`` restricted to what its class's constructor takes (AdamW's defaults hold Adam's
    ``decoupled_weight_decay``, which AdamW's constructor does not accept)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def build_optimizer(factory, params: list, *, master_weights: bool, zero: int, dp_group) -> Optimizer:
    """The Trainer's optimizer (module docstring). ``factory(params)`` must give a ``torch.optim.Optimizer``."""
    base = factory(params)
    if not isinstance(base, Optimizer):
        raise TypeError(f"optimizer(params) gave a {type(base).__name__}, not a torch.optim.Optimizer")
    if not master_weights and zero in (0, 3):  # zero=3: FSDP2 already sharded the parameters it steps
        return base
    if base.state:
        raise ValueError(f"{type(base).__name__} built by optimizer(params) already holds state; master weights and "
                         "zero rebuild it on other tensors, so it must be fresh")
    groups = [dict(g) for g in base.param_groups]  # every hyperparameter, per group; the model's parameters
    cls, defaults = type(base), _constructor_defaults(base)
    local = functools.partial(MasterWeightsOptimizer, inner_class=cls) if master_weights else cls
    if zero == 0:
        return local(groups, **defaults)
    return PartitionedOptimizer(groups, local, dp_group, **defaults)


ZERO_STAGES = (0, 1, 2, 3)


def check_zero(zero, offload: bool, mesh, split, optimizer, master_weights: bool = False) -> None:
    """``zero`` and ``offload`` against the mesh, before anything is built (one-line errors)."""
    if zero not in ZERO_STAGES or isinstance(zero, bool):
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    if zero and mesh.dp == 1:
        raise ValueError(f"zero={zero} partitions over data-parallel ranks, but this mesh has dp=1 "
                         f"(dp={mesh.dp}, pp={mesh.pp}, sp={mesh.sp}, tp={mesh.tp}): use zero=0")
    if zero and optimizer is None:
        raise ValueError(f"zero={zero} partitions an optimizer: pass Trainer(model, optimizer=lambda params: ...)")
    if zero == 3 and split is not None:
        raise ValueError("zero=3 (FSDP2) does not compose with shardlib's pipeline stages (pp > 1): torch's schedules "
                         "would have to unshard every stage per microbatch; use zero=1 or 2 with pipelines "
                         "(docs/training.md)")
    if zero == 3 and master_weights:
        raise ValueError("zero=3 with master_weights: FSDP2 keeps the sharded parameters in their own dtype; give the "
                         "model fp32 weights and train with precision='fp16' or 'bf16' (autocast) instead")
    if offload and zero != 3:
        raise ValueError(f"offload=True is FSDP2's CPUOffloadPolicy and needs zero=3 (got zero={zero}); torch's "
                         "ZeroRedundancyOptimizer has no offload")


def owners(optimizer) -> dict[int, int]:
    """id(param) -> the dp rank stepping it, for a partitioned optimizer ({} otherwise)."""
    if not isinstance(optimizer, PartitionedOptimizer):
        return {}
    return {id(p): owner for p, owner in zip(optimizer.params, optimizer.owner)}
