"""Mixture-of-experts blocks (``Plan.moe``): what the sharded model does around each block besides splitting its
experts (:class:`shardlib.parallel.experts.ExpertsTensorParallel`, a style of the plan).

The router stays replicated and computes exactly what the unsharded model computes, on every rank of the TP group:
the same tokens, the same experts, the same capacity drops, in the dtype the model routes in. So:

* **Megatron sequence parallelism**: a block sees the whole sequence, as the model's own router does (Switch counts
  an expert's capacity along each whole sequence): its input is all-gathered at the block (bwd: this rank's chunk
  of the gradient, which is whole on every rank: the router computes on every rank, the experts' and shared
  experts' inputs are all-reduced by their own entries) and its output cut back to this rank's chunk (bwd:
  all-gather). The block's replicated parameters (the router, a shared expert's gate) then get their whole
  gradient on every rank, so the layer's sequence-parallel gradient sum leaves them out
  (:data:`shardlib.parallel.gradsync.WHOLE_SEQUENCE_ATTR`), and the styles inside the block use the plain
  tensor-parallel entries and exits (no sequence collectives).
* **Sequence parallelism over sp** (all-to-all, ring): each rank routes its own positions, which is exact for
  routers that route each token alone (Mixtral, Qwen-MoE); a router with a per-sequence capacity is refused, and so
  are the auxiliary router losses (a load-balancing loss over the whole batch is not a sum over positions).
* **Pipelines**: the auxiliary router losses sum over every layer's router, which no single stage holds: asking a
  pipelined model for them (``output_router_logits``) is refused at the forward.
* **Losses**: the auxiliary losses the model adds to its training loss (:func:`router_losses`) are added to the
  vocab-parallel loss the same way (:mod:`shardlib.sharding.losses`).
* **Expert parallelism** (``mesh.ep > 1``): each experts module keeps the E/ep experts of its rank of the ep group
  (its 3-D weights split along the expert dim, the layout recorded over ``ep``) and exchanges tokens with the others
  (:mod:`shardlib.parallel.expert_parallel`); ``shard(expert_capacity=c)`` picks the static-capacity exchange.
  Built for transformers' fused experts and for ModuleDicts of expert modules (Switch, whose own capacity decides
  which tokens are routed before any exchange, so the same tokens drop at every ep), at tp = pp = 1 without
  sequence parallelism over sp; the other combinations are refused before anything changes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from torch import nn

from ..parallel.expert_parallel import (
    EP_KEYS_ATTR, ROUTED_ATTR, expert_parallel_forward, modules_expert_parallel_forward, take_counts,
)
from ..parallel.collectives import all_reduce
from ..parallel.experts import EXPERTS_ATTR, is_fused_experts
from ..parallel.gradsync import WHOLE_SEQUENCE_ATTR
from ..parallel.layout import layout_of, set_layout
from .sequence import MEGATRON, SP_MODES, SequenceStream

log = logging.getLogger("shardlib")


def moe_sites(r) -> list[tuple[str, object]]:
    """(module path, :class:`~shardlib.sharding.plan.MoESite`) of ``r``'s mixture-of-experts blocks (a
    :class:`shardlib.sharding.passes.Resolved`)."""
    return [(path, site) for pattern, site in r.plan.moe.items() for path in r.match(pattern, "moe")]


def moe_blocks(r) -> list[str]:
    """The module paths of ``r``'s mixture-of-experts blocks."""
    return [path for path, _ in moe_sites(r)]


class MixtureOfExperts:
    """The pass of a plan with ``moe`` blocks (module docstring)."""

    def problems(self, r) -> list[str]:
        problems, mode = [], r.options.get("sequence_mode")
        for path, site in moe_sites(r):
            for role, child in (("router", site.router), ("experts", site.experts)):
                if not isinstance(_child(r.modules[path], child), nn.Module):
                    problems.append(f"{path}: the MoE block has no {role} module {child!r}")
            if mode in SP_MODES and site.capacity:
                problems.append(f"{path}: its router drops tokens past each expert's capacity counted along the "
                                f"whole sequence, which sequence_parallel={mode!r} splits over ranks; use "
                                "sequence_parallel=True (Megatron, on the TP group), which routes whole sequences")
        problems += _expert_parallel_problems(r)
        if mode in SP_MODES and r.plan.moe and getattr(r.model.config, "output_router_logits", False):
            problems.append(f"{r.name}: config.output_router_logits=True adds a load-balancing loss over the whole "
                            f"batch, which sequence_parallel={mode!r} cannot split over positions; set it False")
        return problems

    def prepare(self, r) -> None:
        """Mark each experts module (what ZeRO-3 looks for: :func:`~shardlib.parallel.experts.
        every_expert_gets_a_gradient`) and, before the sequence-parallel pass hooks the layers' replicated
        parameters, the blocks that run on the whole sequence."""
        for path, site in moe_sites(r):
            r.modules[path].get_submodule(site.experts).__dict__[EXPERTS_ATTR] = True
        for path in self._whole_sequence_blocks(r):
            r.modules[path].__dict__[WHOLE_SEQUENCE_ATTR] = True

    def install(self, r) -> None:
        for path, site in moe_sites(r):
            block = r.modules[path]
            _count_routes(block, block.get_submodule(site.router))
            if getattr(r.mesh, "ep", 1) > 1:
                _split_experts(block.get_submodule(site.experts), r.mesh, r.options.get("expert_capacity"))
        if getattr(r.mesh, "ep", 1) > 1 and moe_sites(r) and callable(getattr(r.model, "generate", None)):
            r.model.generate = _in_step(r.model.generate)
        if getattr(r.mesh, "pp", 1) > 1:
            r.model.register_forward_pre_hook(_refuse_router_losses, with_kwargs=True)
        for path in self._whole_sequence_blocks(r):
            _whole_sequence(r.modules[path], r.sequence.stream(r.stack_of(path)))

    @staticmethod
    def _whole_sequence_blocks(r) -> list[str]:
        if r.options.get("sequence_mode") != MEGATRON or r.sequence is None:
            return []
        return [path for path in moe_blocks(r) if r.stack_of(path) is not None]


def _expert_parallel_problems(r) -> list[str]:
    ep, capacity = getattr(r.mesh, "ep", 1), r.options.get("expert_capacity")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, float))
                                 or capacity <= 0):
        return [f"expert_capacity={capacity!r}: expected None (dropless) or a capacity factor > 0"]
    if ep == 1:
        return [] if capacity is None else [f"expert_capacity={capacity} sets the static capacity of expert "
                                            "parallelism: it needs a mesh with ep > 1 (init_mesh(ep=N))"]
    if not r.plan.moe:
        return [f"{r.name} has no mixture-of-experts layer for ep={ep} to split"]
    problems = []
    for path, site in moe_sites(r):
        experts = _child(r.modules[path], site.experts)
        if experts is None:
            continue
        count = experts.num_experts if is_fused_experts(experts) else len(experts._modules)
        if count % ep:
            problems.append(f"{path}.{site.experts}: {count} experts are not divisible by ep={ep}: each rank holds "
                            "whole experts")
    return problems


def _split_experts(experts: nn.Module, mesh, capacity: float | None) -> None:
    """Keep this rank's E/ep experts and route through the ep group
    (:func:`shardlib.parallel.expert_parallel.expert_parallel_forward`): a fused module's 3-D weights split along
    dim 0 (layout over ``ep``); a ModuleDict of expert modules keeps its own (their parameters' layouts say "ep":
    each ep rank holds others, :data:`~shardlib.parallel.expert_parallel.EP_KEYS_ATTR` the whole list)."""
    group = mesh.ep_group
    if is_fused_experts(experts):
        total = experts.num_experts
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.dim() >= 1 and param.shape[0] == total:
                layout = dataclasses.replace(layout_of(experts, name), ep=mesh.ep, ep_dim=0)
                start, stop = layout.ep_range(mesh.ep_rank)
                setattr(experts, name, nn.Parameter(param.detach()[start:stop].clone(),
                                                    requires_grad=param.requires_grad))
                set_layout(experts, name, layout)
        experts.num_experts = total // mesh.ep
        experts._shardlib_global_experts = total  # what a checkpoint holding every expert is read against
        local_forward = type(experts).forward.__get__(experts)
        experts.forward = functools.partial(expert_parallel_forward, experts, local_forward, group, total, capacity)
        return
    keys = list(experts._modules)
    local = len(keys) // mesh.ep
    mine = keys[mesh.ep_rank * local:(mesh.ep_rank + 1) * local]
    for key in keys:
        if key not in mine:
            del experts[key]
    for name, param in experts.named_parameters():
        owner, _, attr = name.rpartition(".")
        set_layout(experts.get_submodule(owner), attr, dataclasses.replace(layout_of(experts, name), ep=mesh.ep))
    experts.__dict__[EP_KEYS_ATTR] = (keys, mesh.ep)
    experts.forward = functools.partial(modules_expert_parallel_forward, experts, group, len(keys), capacity)


#: on an MoE block: [tokens routed to each expert, tokens its router's capacity dropped] since the last read
LOAD_ATTR = "_shardlib_router_load"


def _count_routes(block: nn.Module, router: nn.Module) -> None:
    """Count, in eager forwards, the tokens the block's router sends to each expert and those it drops (a capacity
    router's all-zero rows): top-k routers return the chosen indices, Switch's a masked one-hot (shapes read off the
    output, whatever its position)."""

    def count(mod, args, out):
        if torch.compiler.is_compiling():
            return
        chosen = next((t for t in out if torch.is_tensor(t) and not t.is_floating_point()), None)
        if chosen is None:
            return
        with torch.no_grad():
            experts = _experts_count(block, mod, chosen)
            if chosen.dim() >= 2 and chosen.shape[-1] == experts and chosen.max() <= 1:  # one-hot, masked
                rows = chosen.reshape(-1, experts)
                tokens, dropped = rows.sum(0), (rows.sum(1) == 0).sum()
            else:
                tokens, dropped = torch.bincount(chosen.reshape(-1), minlength=experts)[:experts], chosen.new_zeros(())
        held = block.__dict__.get(LOAD_ATTR)
        block.__dict__[LOAD_ATTR] = (tokens, dropped) if held is None else (held[0] + tokens, held[1] + dropped)

    router.register_forward_hook(count)


def _experts_count(block: nn.Module, router: nn.Module, chosen: torch.Tensor) -> int:
    for owner in (router, block):
        for name in ("num_experts", "num_local_experts"):
            if isinstance(getattr(owner, name, None), int):
                return getattr(owner, name)
    return int(chosen.max()) + 1


def router_load(model: nn.Module, groups=()) -> dict[str, dict]:
    """MoE block path -> ``{"tokens_per_expert": [...], "dropped_share": x}``: what its router routed since the last
    call (eager forwards; summed over each of ``groups``, a collective there: every rank of them calls), then
    reset. The share counts tokens a capacity router (Switch) dropped."""
    loads = {path: m.__dict__.pop(LOAD_ATTR) for path, m in model.named_modules() if LOAD_ATTR in m.__dict__}
    if groups and loads:
        flat = torch.cat([torch.cat([t.double(), d.double().reshape(1)]) for t, d in loads.values()])
        for group in groups:
            flat = all_reduce(flat, group)
        sizes = [t.numel() + 1 for t, _ in loads.values()]
        loads = {path: (part[:-1], part[-1]) for path, part in zip(loads, flat.split(sizes))}
    result = {}
    for path, (tokens, dropped) in loads.items():
        total = float(tokens.sum() + dropped)
        result[path] = {"tokens_per_expert": [int(t) for t in tokens.tolist()],
                        "dropped_share": float(dropped) / total if total else 0.0}
    return result


def expert_load(model: nn.Module) -> dict[str, tuple[float, float]]:
    """Experts module path -> (token-expert pairs it routed, pairs the static capacity dropped) on this rank since the
    last call (expert parallelism; reading synchronises with the device); empty when no module counts."""
    return {path: take_counts(m) for path, m in model.named_modules() if ROUTED_ATTR in m.__dict__}


def report_dropped_pairs(model: nn.Module) -> None:
    """Log what the static expert capacity dropped on this rank since the last call (a warning naming the layers):
    a capacity-limited exchange never drops silently (:mod:`shardlib.parallel.expert_parallel`)."""
    load = expert_load(model)
    dropped = {path: (routed, lost) for path, (routed, lost) in load.items() if lost}
    if dropped:
        routed, lost = sum(r for r, _ in dropped.values()), sum(d for _, d in dropped.values())
        log.warning("expert parallelism: the static capacity dropped %d of %d token-expert pairs on this rank (%s); "
                    "raise shard(expert_capacity=...) or use the dropless exchange (expert_capacity=None)",
                    lost, routed, ", ".join(f"{p}: {int(d)}" for p, (_, d) in list(dropped.items())[:4])
                    + (", ..." if len(dropped) > 4 else ""))


def _child(module: nn.Module, path: str):
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _whole_sequence(block: nn.Module, seq: SequenceStream) -> None:
    """Megatron SP: ``block`` runs on the whole sequence (module docstring)."""

    def gather(mod, args, kwargs):
        if args:
            return (seq.leave(args[0]).contiguous(), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": seq.leave(kwargs["hidden_states"]).contiguous()}

    def cut(mod, args, out):
        return seq.chunk(out) if torch.is_tensor(out) else (seq.chunk(out[0]), *out[1:])

    block.register_forward_pre_hook(gather, with_kwargs=True)
    block.register_forward_hook(cut)


def _in_step(generate):
    """``generate`` that keeps every rank decoding until all are done (transformers' ``synced_gpus``, as under
    ZeRO-3): under expert parallelism each decoding step exchanges tokens over the ep group, so a rank whose
    sequences ended first runs on, on its finished sequences, rather than leaving its peers waiting in the
    exchange. Every rank generates together (the agreement is an all-reduce over the world)."""

    def generate_in_step(*args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return generate(*args, **kwargs)

    return generate_in_step


def _refuse_router_losses(model, args, kwargs):
    if kwargs.get("output_router_logits") or (kwargs.get("output_router_logits") is None
                                              and getattr(model.config, "output_router_logits", False)):
        raise ValueError(f"{type(model).__name__}: the auxiliary router losses (output_router_logits=True) sum over "
                         "every MoE layer's router, and a pipeline stage holds only some of them; train without "
                         "them under pp > 1")


def router_loss_terms(model: nn.Module, out) -> dict[str, torch.Tensor]:
    """The auxiliary router losses a transformers MoE model adds to its loss when it was asked for its router
    logits, by name, from the fields of its output, each weighted as the model weighs it: Switch Transformers'
    ``router_z_loss`` (``router_z_loss_coef`` x the z-losses of encoder and decoder) and ``router_aux_loss``
    (``router_aux_loss_coef`` x their load-balancing losses); the decoders' (Mixtral, Qwen-MoE) ``router_aux_loss``
    (``router_aux_loss_coef`` x ``aux_loss``). Empty when the output carries none."""
    def total(*names):
        return sum(out.get(name) if out.get(name) is not None else 0 for name in names)

    if out.get("encoder_z_loss") is not None or out.get("decoder_z_loss") is not None:
        return {"router_z_loss": model.router_z_loss_coef * total("encoder_z_loss", "decoder_z_loss"),
                "router_aux_loss": model.router_aux_loss_coef * total("encoder_aux_loss", "decoder_aux_loss")}
    if out.get("aux_loss") is not None and hasattr(model, "router_aux_loss_coef"):
        return {"router_aux_loss": model.router_aux_loss_coef * out["aux_loss"]}
    return {}


def router_losses(model: nn.Module, out) -> torch.Tensor | None:
    """The sum of :func:`router_loss_terms`, what the model adds to its training loss; None when the output
    carries none."""
    terms = list(router_loss_terms(model, out).values())
    return functools.reduce(lambda a, b: a + b, terms) if terms else None


__all__ = ["MixtureOfExperts", "moe_blocks", "moe_sites", "router_losses", "router_loss_terms", "expert_load",
           "report_dropped_pairs", "router_load"]
