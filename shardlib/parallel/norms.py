"""Norms applied to tensor-parallel activations: the query and key norms of Qwen3 and OLMo-2 (``q_norm``,
``k_norm``), which run after the column-parallel q and k projections, so on each tp rank's own heads only.

Shapes: ``n`` = TP group size, ``r`` = this rank, ``D`` = head dim, ``W`` = the projection's width (heads x D),
``*`` = any leading dims.

* **Per head** (Qwen3: an RMSNorm over ``D``, applied to every head alike): the weight ``w`` [D] stays replicated
  and the module's own forward runs unchanged on this rank's heads. The weight's gradient on rank ``r`` sums over
  ``r``'s heads only, a partial sum; the whole one is its sum over the TP group. :class:`PartialGrads` makes
  it so: each forward, the module's own parameters enter the TP region through ``copy_to_tp`` (forward identity,
  backward all-reduce), so ``.grad`` holds the whole gradient on every rank when backward returns. Under Megatron
  sequence parallelism the layer's gradient bucket (:class:`~.gradsync.ReplicatedGradSync` over tp) already sums
  every replicated parameter of the layer, so the style adds nothing there. Under sequence parallelism over sp
  (all-to-all, ring) with tp > 1, that bucket sums over sp only: the tp sum comes from the ``copy_to_tp`` here, in
  autograd before the gradient reaches the parameter, so the two sums compose whatever order the hooks run in.
* **Whole width** (OLMo-2: an RMSNorm over all ``W`` features of q, before the head split):
  ``y = w * x / sqrt(sum(x^2) / W + eps)``. :class:`ColwiseNorm` splits ``w`` [W] with the heads, as the
  column-parallel projection splits its output (``w_r`` = ``w[r W/n : (r+1) W/n]``, layout recorded), and takes the
  sum of squares over the whole width: this rank's ``sum(x_r^2)`` [*, 1] all-reduced over tp (forward all-reduce,
  backward all-reduce: every rank's statistic feeds every rank's heads, each rank's gradient of it is partial). One
  all-reduce of [*, 1] per norm and forward, one in backward. ``w_r`` is used by this rank's heads only: its gradient
  is whole without a sum.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from .collectives import Group, copy_to_tp, reduce_from_tp
from .layout import Layout, set_layout
from .styles import ShardContext, Style, class_path

#: the attribute holding an RMSNorm's epsilon: transformers' RMSNorms (``variance_epsilon``), torch's (``eps``)
EPS_ATTRS = ("variance_epsilon", "eps")


@dataclass(frozen=True, kw_only=True)
class PartialGrads(Style):
    """The module's own parameters stay replicated, but each tp rank's forward applies them to its share of a
    tensor-parallel activation (a per-head norm on this rank's heads): their gradient is summed over the TP group in
    backward (module docstring). The module and its forward are unchanged."""

    def check(self, path, module, tp):
        if next(module.parameters(recurse=False), None) is None:
            return [f"{path}: PartialGrads applies to a module holding parameters of its own, "
                    f"{class_path(type(module))} holds none"]
        return []

    def apply(self, path, module, ctx: ShardContext):
        if ctx.tp == 1 or ctx.sequence is not None:  # Megatron SP: the layer's bucket sums them over tp already
            return module
        _params_enter_tp(module, ctx.group)
        return module


def _params_enter_tp(module: nn.Module, group: Group) -> None:
    """While ``module`` runs with autograd on, each of its own parameters that requires a gradient is replaced, in
    ``module._parameters``, by ``copy_to_tp`` of it (a view: same values, gradient all-reduced over ``group`` on its
    way to the parameter), and put back when the forward returns or raises. The parameter objects never change
    (optimizers, ties and checkpoints hold the same ones), and the parameters are read at every call (a checkpoint
    load or ``materialize`` that replaced one is followed)."""
    held: list[dict[str, nn.Parameter]] = []

    def enter(mod, args):
        grad = torch.is_grad_enabled()
        params = {name: p for name, p in mod._parameters.items() if grad and p is not None and p.requires_grad}
        held.append(params)
        for name, p in params.items():
            mod._parameters[name] = copy_to_tp(p, group)

    def leave(mod, args, out):
        if held:
            mod._parameters.update(held.pop())

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _eps_attr(module: nn.Module) -> str | None:
    return next((a for a in EPS_ATTRS if isinstance(getattr(module, a, None), (int, float))), None)


@dataclass(frozen=True, kw_only=True)
class ColwiseNorm(Style):
    """An RMSNorm over all features of a column-parallel linear's output (OLMo-2's ``q_norm`` / ``k_norm`` over
    heads x head dim): its weight split with the linear's output features, its mean of squares taken over the whole
    width through one all-reduce over tp (module docstring). The module's forward is replaced by the RMSNorm it
    computes, as transformers writes it: ``(weight * x / sqrt(mean(x^2) + eps)).to(x.dtype)`` with the statistic and
    the normalized ``x`` in float32; ``eps`` is read from the module (``variance_epsilon`` or ``eps``) at each
    call."""

    def check(self, path, module, tp):
        weight = getattr(module, "weight", None)
        own = {name for name, p in module.named_parameters(recurse=False)}
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or own != {"weight"} or _eps_attr(module) is None:
            return [f"{path}: ColwiseNorm applies to an RMSNorm (one 1-D weight, no bias, an epsilon in "
                    f"{' or '.join(EPS_ATTRS)}), found {class_path(type(module))}"]
        if weight.shape[0] % tp:
            return [f"{path}: norm width {weight.shape[0]} is not divisible by tp={tp}"]
        return []

    def apply(self, path, module, ctx: ShardContext):
        if ctx.tp == 1:
            return module
        weight = module.weight
        layout = Layout((weight.shape[0],), shard_dim=0, num_shards=ctx.tp)
        module.weight = nn.Parameter(layout.shard(weight.detach(), ctx.rank), requires_grad=weight.requires_grad)
        set_layout(module, "weight", layout)
        module.forward = functools.partial(colwise_rms_norm, module, ctx.group, weight.shape[0], _eps_attr(module))
        return module


def colwise_rms_norm(module: nn.Module, group: Group | None, width: int, eps_attr: str,
                     hidden_states: torch.Tensor) -> torch.Tensor:
    """``module``'s RMSNorm of this rank's features ``hidden_states`` [*, width / n] of a ``width``-wide whole, with
    its weight shard [width / n]: the sum of squares [*, 1] all-reduced over ``group`` (forward and backward)."""
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    # fwd: all-reduce (reduce_from_tp), bwd: all-reduce (copy_to_tp): each rank's heads read the whole sum
    squares = copy_to_tp(reduce_from_tp(x.pow(2).sum(-1, keepdim=True), group), group)
    x = x * torch.rsqrt(squares / width + getattr(module, eps_attr))
    return (module.weight * x).to(dtype)


__all__ = ["PartialGrads", "ColwiseNorm", "colwise_rms_norm"]
