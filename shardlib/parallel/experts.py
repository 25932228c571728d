"""Expert tensor parallelism: a mixture-of-experts layer's experts split over the TP group like an MLP.

An experts module is called as ``experts(hidden_states [T, H], expert_index, routing_weights)`` by its MoE block,
after the block's router (replicated: every TP rank routes the same tokens the same way) chose each token's
experts. Under tensor parallelism every expert's up (and gate) projection is column-parallel and its down
projection row-parallel, so each rank computes every routed token through its slice of every expert's
intermediate width and returns a partial sum. The experts module then enters and leaves the TP region once, for
all its experts:

* entry: ``hidden_states`` and ``routing_weights`` through ``copy_to_tp`` (fwd identity, bwd all-reduce): each
  rank's gradient of both is a partial sum (``routing_weights`` scales the partial expert outputs), so summing it
  makes the router's gradient, and the hidden states', the unsharded model's;
* exit: the weighted sum over experts through ``reduce_from_tp`` (fwd all-reduce, bwd identity): one all-reduce
  per layer whatever the number of experts, not one per expert.

Two kinds of experts module, one style (:class:`ExpertsTensorParallel`):

* **fused** (transformers' ``@use_experts_implementation`` modules: Mixtral, Qwen2-MoE, Qwen3-MoE, ...): 3-D
  parameters ``gate_up_proj`` [E, 2I, H] (gate and up side by side, or interleaved) and ``down_proj`` [E, H, I]
  (``is_transposed``: [E, H, 2I] and [E, I, H]); each is replaced by this rank's slice of the intermediate
  dim (gate and up split block-wise, so ``chunk(2)`` still yields gate and up), with its layout recorded. Every
  experts implementation transformers dispatches to (``eager``, ``batched_mm``, ``grouped_mm``) reads the same
  parameters and computes the partial sum unchanged.
* **modules** (a ModuleDict of small MLPs: Switch Transformers' ``expert_<i>``): ``up`` children column-parallel,
  ``down`` row-parallel without their own reduction; their dropout draws per-rank masks (it acts on sharded
  activations).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from .collectives import all_reduce, copy_to_tp, reduce_from_tp
from .layers import ColumnParallelLinear, RowParallelLinear
from .layout import Layout, set_layout
from .styles import LocalRNG, ShardContext, Style


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers fused experts module (``@use_experts_implementation``: 3-D expert
    weights, dispatched by ``config._experts_implementation``), recognized by its attributes."""
    down = getattr(module, "down_proj", None)
    return (isinstance(down, nn.Parameter) and down.dim() == 3 and hasattr(module, "is_transposed")
            and hasattr(module, "has_gate") and isinstance(getattr(module, "num_experts", None), int))


def _fused_weights(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Parameter name -> (the dim that holds the intermediate width, blocks along it) of a fused experts module."""
    up = "gate_up_proj" if module.has_gate else "up_proj"
    up_dim, down_dim = (2, 1) if module.is_transposed else (1, 2)
    blocks = 2 if module.has_gate and getattr(module, "is_concatenated", True) else 1
    return {up: (up_dim, blocks), "down_proj": (down_dim, 1)}


@dataclass(frozen=True, kw_only=True)
class ExpertsTensorParallel(Style):
    """Expert tensor parallelism on an experts module (module docstring). ``up`` / ``down``: for a ModuleDict of
    expert MLPs, the child linears of each expert that are column- / row-parallel (Switch: ``("wi",)``, ``"wo"``);
    empty for transformers' fused experts, whose 3-D weights are split directly."""

    up: tuple[str, ...] = ()
    down: str = ""

    def check(self, path, module, tp):
        if not self.down:
            return self._check_fused(path, module, tp)
        problems = []
        for name, expert in module.named_children():
            for child in (*self.up, self.down):
                linear = getattr(expert, child, None)
                if not isinstance(linear, nn.Linear):
                    problems.append(f"{path}.{name}: expected a torch.nn.Linear {child!r} in every expert")
                    continue
                size = linear.out_features if child != self.down else linear.in_features
                if size % tp:
                    problems.append(f"{path}.{name}.{child}: expert width {size} is not divisible by tp={tp}")
                if child == self.down and linear.bias is not None and tp > 1:
                    problems.append(f"{path}.{name}.{child}: a row-parallel expert projection with a bias is not "
                                    "supported (the bias would be added once per rank before the reduction)")
        return problems

    def _check_fused(self, path, module, tp):
        if not is_fused_experts(module):
            return [f"{path}: ExpertsTensorParallel without up/down applies to transformers' fused experts modules "
                    f"(3-D gate_up_proj / down_proj, @use_experts_implementation), found {type(module).__name__}"]
        if getattr(module, "has_bias", False) and tp > 1:
            return [f"{path}: fused experts with biases are not supported under tensor parallelism (the down "
                    "projection's bias would be added on every rank before the reduction)"]
        problems = []
        for name, (dim, blocks) in _fused_weights(module).items():
            size = getattr(module, name).shape[dim]
            if size % (tp * blocks):
                problems.append(f"{path}.{name}: intermediate width {size // blocks} of {module.num_experts} experts "
                                f"is not divisible by tp={tp}")
        return problems

    def apply(self, path, module, ctx):
        if ctx.tp == 1:
            return module
        if self.down:
            self._shard_modules(path, module, ctx)
        else:
            self._shard_fused(module, ctx)
        _enter_and_leave_once(module, ctx)
        return module

    def _shard_modules(self, path: str, module: nn.Module, ctx: ShardContext) -> None:
        for name, expert in module.named_children():
            for child in self.up:
                setattr(expert, child, ColumnParallelLinear(getattr(expert, child), ctx.group, copy_input=False,
                                                            **ctx.tp_args))
            setattr(expert, self.down, RowParallelLinear(getattr(expert, self.down), ctx.group, reduce_output=False,
                                                         **ctx.tp_args))
            LocalRNG().apply(f"{path}.{name}", expert, ctx)

    def _shard_fused(self, module: nn.Module, ctx: ShardContext) -> None:
        for name, (dim, blocks) in _fused_weights(module).items():
            param = getattr(module, name)
            layout = Layout(tuple(param.shape), shard_dim=dim, num_shards=ctx.tp, blocks=blocks)
            setattr(module, name, nn.Parameter(layout.shard(param.detach(), ctx.rank),
                                               requires_grad=param.requires_grad))
            set_layout(module, name, layout)
        if isinstance(getattr(module, "intermediate_dim", None), int):
            module.intermediate_dim //= ctx.tp


def _enter_and_leave_once(module: nn.Module, ctx: ShardContext) -> None:
    """The experts' inputs (positional 0: hidden states, 2: routing weights) enter the TP region through
    ``copy_to_tp``, the output leaves through ``reduce_from_tp`` (module docstring)."""
    group = ctx.group
    names = list(inspect.signature(module.forward).parameters)[:3]

    def enter(mod, args, kwargs):
        args = list(args)
        for position in (0, 2):
            if position < len(args):
                args[position] = copy_to_tp(args[position], group)
            elif position < len(names) and torch.is_tensor(kwargs.get(names[position])):
                kwargs[names[position]] = copy_to_tp(kwargs[names[position]], group)
        return tuple(args), kwargs

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(lambda mod, args, out: reduce_from_tp(out, group))


#: set on an experts module by shard() (:mod:`shardlib.sharding.experts`)
EXPERTS_ATTR = "_shardlib_experts"


class _ZeroGradients(torch.autograd.Function):
    """forward: ``out`` unchanged; backward: ``out``'s gradient, and zeros for ``params`` (which took no part)."""

    @staticmethod
    def forward(ctx, out, *params):
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes))


def expert_module_params(model: nn.Module) -> set[int]:
    """Ids of the parameters of the per-expert modules of ``model``'s experts (a ModuleDict marked by shard()):
    which of them get a gradient depends on where the tokens go, step by step, so the Trainer's data-parallel sum
    takes them after backward (counting the ranks that gave each one a gradient), not in torch's DDP."""
    return {id(p) for m in model.modules() if m.__dict__.get(EXPERTS_ATTR) and not is_fused_experts(m)
            for p in m.parameters()}


#: on an experts module hooked by :func:`every_expert_gets_a_gradient`: the experts that ran in the step so far
USED_ATTR = "_shardlib_used_experts"


def with_zero_gradients(out: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged, with a backward that also gives each of ``tensors`` a zero gradient: keeps them in the
    autograd graph where the computation did not reach them (experts that got no token)."""
    return _ZeroGradients.apply(out, *tensors)


def every_expert_gets_a_gradient(experts: nn.Module) -> None:
    """Give the experts of a ModuleDict that received no token in a forward a zero gradient in its backward (the
    model runs only the experts some token was routed to, so the others get none). What ZeRO-3 needs: FSDP2
    reduce-scatters a layer's gradients as one flat buffer per layer, so a rank whose expert got no tokens while
    another rank's did would pass a shorter buffer, and the collective fails. Which experts ran is kept (every
    forward under grad until :func:`release_idle_experts`), so that an expert no rank used goes without a
    gradient after the reduction, as in the unsharded model (an optimizer steps a zero gradient, not a missing
    one: AdamW would decay the weights). Fused experts (one 3-D parameter for all experts) need none of this."""
    used: set[int] = experts.__dict__.setdefault(USED_ATTR, set())
    ran: set[int] = set()

    def reset(mod, args):
        ran.clear()

    def note(mod, args, out):
        ran.add(id(mod))
        if torch.is_grad_enabled():
            used.add(id(mod))

    def touch(mod, args, out):
        idle = [p for expert in mod.children() if id(expert) not in ran
                for p in expert.parameters() if p.requires_grad]
        return with_zero_gradients(out, *idle) if idle and torch.is_grad_enabled() else out

    experts.register_forward_pre_hook(reset)
    for expert in experts.children():
        expert.register_forward_hook(note)
    experts.register_forward_hook(touch)


def release_idle_experts(model: nn.Module, group) -> None:
    """After a step's gradients were reduced over ``group`` (data parallel): the experts that ran on no rank of it
    since the last call lose their (zero) gradient (:func:`every_expert_gets_a_gradient`). One small all-reduce."""
    modules = [m for m in model.modules() if USED_ATTR in m.__dict__]
    if not modules:
        return
    experts = [(m, e) for m in modules for e in m.children()]
    ran = torch.tensor([float(id(e) in m.__dict__[USED_ATTR]) for m, e in experts])
    ran = all_reduce(ran, group, "max") if group is not None else ran
    for (module, expert), anywhere in zip(experts, ran.tolist()):
        if not anywhere:
            for p in expert.parameters():
                p.grad = None
    for module in modules:
        module.__dict__[USED_ATTR].clear()


__all__ = ["ExpertsTensorParallel", "is_fused_experts", "every_expert_gets_a_gradient", "release_idle_experts",
           "expert_module_params", "with_zero_gradients", "EXPERTS_ATTR"]
