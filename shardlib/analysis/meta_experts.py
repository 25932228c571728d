"""Mixture-of-experts layers in the dry run (:mod:`shardlib.analysis.dryrun`): run on the meta device, where a
router's choices have no values, as if every layer's tokens were spread evenly over its experts, and recorded
(:class:`~shardlib.analysis.dryrun_report.MoELayer`) for the cost of expert parallelism
(:mod:`shardlib.analysis.expert_cost`).

* transformers' fused experts (3-D ``gate_up_proj`` / ``down_proj``) run their own implementation where it reads no
  routing values (``grouped_mm``, ``batched_mm``, ...); ``eager``, which loops over the experts a batch hits, runs as
  ``grouped_mm`` (the same T x top-k rows through the same weights, one call per projection);
* a ModuleDict of expert MLPs (Switch Transformers) runs each expert on ``ceil(T / E)`` of the T tokens, gathered
  and added back as the model's loop does (its router's capacity drops nothing there);
* two ops whose meta kernels are missing or stricter than the CPU's (:func:`meta_op`): ``bincount`` (a count per
  expert: zeros of its ``minlength``) and ``_grouped_mm`` (its meta kernel takes bfloat16 only: run in bfloat16 for
  the shape, returned in the inputs' dtype).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ..parallel.experts import is_fused_experts
from ..sharding.plan import match_modules
from .dryrun_report import MoELayer

#: the implementations of fused experts that loop over the experts a batch hits (values the meta device lacks)
_LOOPING = (None, "eager")


def _bincount(args, kwargs):
    minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
    return torch.zeros(minlength, dtype=torch.long, device="meta")


def _grouped_mm(args, kwargs):
    dtype = args[0].dtype
    if dtype == torch.bfloat16:
        return torch.ops.aten._grouped_mm.default(*args, **kwargs)
    cast = [a.to(torch.bfloat16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    return torch.ops.aten._grouped_mm.default(*cast, **kwargs).to(dtype)


_META_OPS = {torch.ops.aten.bincount.default: _bincount, torch.ops.aten._grouped_mm.default: _grouped_mm}


def meta_op(func, args, kwargs):
    """The result of ``func`` on meta tensors where its meta kernel cannot give it (module docstring), else None;
    called by the dry run's dispatch mode for every op, so it returns at once for any other."""
    run = _META_OPS.get(func)
    if run is None or not (args and torch.is_tensor(args[0]) and args[0].is_meta):
        return None
    return run(args, kwargs)


def experts_modules(model: nn.Module, plan) -> dict[str, nn.Module]:
    """Path -> experts module of every mixture-of-experts layer of ``model`` (the blocks of ``plan.moe``)."""
    names = dict(model.named_modules())
    paths = [f"{block}.{site.experts}" for pattern, site in plan.moe.items()
             for block in match_modules(pattern, names)]
    return {path: names[path] for path in paths if path in names}


def expert_count(experts: nn.Module) -> int:
    """E of an experts module: fused (3-D weights) or a ModuleDict of expert modules."""
    return experts.num_experts if is_fused_experts(experts) else len(experts._modules)


def install(model: nn.Module, plan) -> dict[str, dict]:
    """Make every mixture-of-experts layer of ``model`` (the blocks of ``plan.moe``) run on the meta device as the
    module docstring says. Returns what its forwards fill in: experts path -> ``{"experts", "top_k", "tokens",
    "row_bytes"}`` (of the first forward: a checkpointed recompute runs it again)."""
    seen: dict[str, dict] = {}
    for path, experts in experts_modules(model, plan).items():
        _balance(experts, path, seen)
    return seen


def _balance(experts: nn.Module, path: str, seen: dict) -> None:
    fused = is_fused_experts(experts)
    run = _fused_forward(experts) if fused else functools.partial(_balanced_modules, experts)
    names = list(inspect.signature(experts.forward).parameters)[:3]

    def forward(*args, **kwargs):
        hidden, routing, weights = list(args[:3]) + [kwargs.pop(n) for n in names[len(args):]]
        if path not in seen:
            seen[path] = dict(experts=expert_count(experts), top_k=routing.shape[-1] if fused else 1,
                              tokens=hidden.shape[0],
                              row_bytes=hidden.shape[-1] * hidden.element_size())
        return run(hidden, routing, weights, **kwargs)

    experts.forward = forward


def _fused_forward(experts: nn.Module):
    """The fused experts' own forward, or ``grouped_mm`` where theirs loops over the experts hit."""
    if getattr(experts.config, "_experts_implementation", None) not in _LOOPING:
        return experts.forward
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return functools.partial(ALL_EXPERTS_FUNCTIONS["grouped_mm"], experts)


def _balanced_modules(experts: nn.Module, hidden: torch.Tensor, selected: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """Switch's loop over its experts (transformers' ``SwitchTransformersExperts.forward``: each expert on the rows
    routed to it, weighted, added back), every expert given ``ceil(T / E)`` of the T rows."""
    out = torch.zeros_like(hidden)
    index = torch.arange(-(-hidden.shape[0] // len(experts._modules)), device=hidden.device)
    weight = weights.reshape(weights.shape[0], -1)
    for expert in experts._modules.values():
        out.index_add_(0, index, (expert(hidden[index]) * weight[index, 0, None]).to(hidden.dtype))
    return out


def moe_layers(model: nn.Module, seen: dict[str, dict], work: dict) -> list[MoELayer]:
    """The :class:`MoELayer` of every experts module that ran (``seen``, from :func:`install`), with this rank's
    bytes of its experts and what they saved (``work``: module path -> the dry run's ``ModuleWork``)."""
    layers = []
    for path, found in seen.items():
        params = list(model.get_submodule(path).parameters())
        saved = sum(w.saved for where, w in work.items() if where == path or where.startswith(path + "."))
        layers.append(MoELayer(path=path, **found, parameter_bytes=_nbytes(params),
                               gradient_bytes=_nbytes(p for p in params if p.requires_grad), saved=saved))
    return layers


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
