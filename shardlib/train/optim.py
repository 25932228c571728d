"""The Trainer's optimizer: the user's optimizer, over fp32 master weights and/or partitioned over dp (ZeRO-1/2).

``Trainer(model, optimizer=lambda params: AdamW(params, lr=...), master_weights=..., zero=...)``: the function is
called once on this rank's parameters (torch optimizers allocate their state lazily, so this costs nothing); its
class and parameter groups are then rebuilt where needed:

* :class:`MasterWeightsOptimizer`: the same optimizer over fp32 copies of fp16/bf16 parameters;
* :class:`shardlib.train.zero.FlatZero`: ZeRO-1/2 over flat buckets, each dp rank stepping an exact 1/dp of every
  bucket's elements (with master weights for that share only), then all-gathering them.

Everything else talks to any of them through :func:`param_pairs`, :func:`param_state` and
:func:`set_param_state`: which parameters this rank steps (and the tensor whose ``.grad`` the step reads), and
each parameter's state by model parameter, as the sharded checkpoint stores it (``optimizer.<key>.<param name>``,
``optimizer.master.<param name>`` for master weights), so a checkpoint saved at one setting loads at any other.
The per-parameter state view is :mod:`shardlib.parallel.optim_state` (below the checkpoints that read it; both
wrappers implement its :class:`~shardlib.parallel.optim_state.ParamStateOptimizer`), re-exported here.
"""

from __future__ import annotations

import inspect

import torch
from torch.optim import Optimizer

from ..parallel.dp_shards import local
from ..parallel.optim_state import MASTER_KEY, holds_state, param_state, set_param_state  # noqa: F401 - re-exported
from .zero import FlatZero, InnerOptimizer, check_elementwise


def _groups(params) -> list[dict]:
    params = list(params)
    return params if params and isinstance(params[0], dict) else [{"params": params}]


class MasterWeightsOptimizer(InnerOptimizer):
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

    def __repr__(self) -> str:
        return f"MasterWeightsOptimizer({self.inner!r})"


def param_pairs(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model parameter, the tensor the step updates) for every parameter this rank steps."""
    if isinstance(optimizer, FlatZero):
        return optimizer.pairs()
    if isinstance(optimizer, MasterWeightsOptimizer):
        return optimizer.pairs
    return [(p, p) for g in optimizer.param_groups for p in g["params"]]


def copy_grads(optimizer) -> None:
    """Move the model's gradients to where the step reads them (master weights), before unscaling / clipping
    (:class:`FlatZero` gives its fp32 pieces their gradients itself, in ``finish_grads``)."""
    if isinstance(optimizer, MasterWeightsOptimizer):
        optimizer.copy_grads()


def held_state_bytes(optimizer, params) -> int:
    """Bytes of optimizer state (moments, master weights) this rank holds (its pieces' under zero=1/2, its dp
    shards' under zero=3)."""
    if isinstance(optimizer, FlatZero):
        return optimizer.held_state_bytes()
    tensors = [v for p in params for v in param_state(optimizer, p).values() if torch.is_tensor(v)]
    return sum(local(v).numel() * v.element_size() for v in tensors)


def _constructor_defaults(optimizer: Optimizer) -> dict:
    """``optimizer.defaults`` restricted to what its class's constructor takes (AdamW's defaults hold Adam's
    ``decoupled_weight_decay``, which AdamW's constructor does not accept)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def base_optimizer(factory, params: list) -> Optimizer:
    """``factory(params)``, checked to be a fresh ``torch.optim.Optimizer``."""
    base = factory(params)
    if not isinstance(base, Optimizer):
        raise TypeError(f"optimizer(params) gave a {type(base).__name__}, not a torch.optim.Optimizer")
    return base


def build_optimizer(base: Optimizer, *, master_weights: bool, zero: int, dp_group=None, **zero_options) -> Optimizer:
    """The Trainer's optimizer (module docstring) from the user's ``base`` optimizer: itself, or rebuilt with its
    class and parameter groups over master weights and/or dp pieces (``zero_options``: :class:`FlatZero`'s)."""
    if not master_weights and zero in (0, 3):  # zero=3: FSDP2 already sharded the parameters it steps
        return base
    if base.state:
        raise ValueError(f"{type(base).__name__} built by optimizer(params) already holds state; master weights and "
                         "zero rebuild it on other tensors, so it must be fresh")
    groups = [dict(g) for g in base.param_groups]  # every hyperparameter, per group; the model's parameters
    cls, defaults = type(base), _constructor_defaults(base)
    if zero in (1, 2):
        return FlatZero(groups, cls, defaults, stage=zero, group=dp_group, master_weights=master_weights,
                        **zero_options)
    return MasterWeightsOptimizer(groups, inner_class=cls, **defaults)


ZERO_STAGES = (0, 1, 2, 3)


def check_zero(zero, offload: bool, mesh, optimizer, master_weights: bool = False, base=None, *,
               overlap: bool = False, compiled: bool = False) -> None:
    """``zero``, ``offload`` and ``overlap`` (``overlap_param_gather``) against the mesh and the user's ``base``
    optimizer, before anything is built (one-line errors)."""
    if zero not in ZERO_STAGES or isinstance(zero, bool):
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    if zero and mesh.dp == 1:
        raise ValueError(f"zero={zero} partitions over data-parallel ranks, but this mesh has dp=1 "
                         f"(dp={mesh.dp}, pp={mesh.pp}, sp={mesh.sp}, tp={mesh.tp}): use zero=0")
    if zero and optimizer is None:
        raise ValueError(f"zero={zero} partitions an optimizer: pass Trainer(model, optimizer=lambda params: ...)")
    if zero == 3 and master_weights:
        raise ValueError("zero=3 with master_weights: FSDP2 keeps the sharded parameters in their own dtype; give the "
                         "model fp32 weights and train with precision='fp16' or 'bf16' (autocast) instead")
    if offload and zero != 3:
        raise ValueError(f"offload=True is FSDP2's CPUOffloadPolicy and needs zero=3 (got zero={zero}); zero=1/2 "
                         "keep their shards on the parameters' device")
    device = getattr(mesh, "device_type", "cpu")
    if offload and device != "cuda":
        raise ValueError(f"offload=True moves zero=3's parameters, gradients and optimizer state from the GPU to host "
                         f"memory, but this mesh runs on {device!r}, where they already are: leave offload off")
    if overlap and zero not in (1, 2):
        raise ValueError(f"overlap_param_gather overlaps zero=1/2's parameter all-gather with the next forward; "
                         f"zero={zero} has none" + (" (FSDP2 prefetches its own gathers)" if zero == 3 else ""))
    if overlap and compiled:
        raise ValueError("overlap_param_gather waits for each bucket in module forward hooks, which torch.compile "
                         "would trace; use one or the other")
    if zero in (1, 2) and base is not None:
        check_elementwise(type(base), zero)
