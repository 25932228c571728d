"""Mixture-of-experts blocks found on the twin: transformers' fused experts modules (``@use_experts_implementation``:
Mixtral, Qwen2-MoE, Qwen3-MoE and the other families built on it) and the router beside each.

The experts are recognized by what they are rather than read off the graph: their per-expert loop is
data-dependent (torch.export cannot trace it; the analysis twin exports ``batched_mm``, which it can), and every
such module has the same parameters and call (``experts(hidden_states, top_k_index, top_k_weights)``). The router
is the block's child whose weight maps the hidden size to one logit per expert (an ``nn.Linear`` or a bare
``weight`` [experts, hidden]). Both become plan entries: the experts split over tp
(:class:`~shardlib.parallel.experts.ExpertsTensorParallel`), the block a :class:`~shardlib.sharding.plan.MoESite`;
the router stays replicated, and the graph analysis leaves both alone (a router's softmax is not attention, its
linear not an MLP's)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ...parallel.experts import ExpertsTensorParallel, is_fused_experts
from ..plan import MoESite
from .sites import Unplaced


@dataclass(frozen=True)
class MoEFact:
    block: str
    router: str  # child path, relative to the block
    experts: str  # child path, relative to the block


def moe_facts(model: nn.Module, hidden: int, unplaced: list[Unplaced]) -> list[MoEFact]:
    """Every fused experts module of ``model`` (the twin, hidden size ``hidden``) with its block and router; an
    experts module whose block has no recognizable router is listed in ``unplaced`` and left replicated."""
    facts = []
    for path, module in model.named_modules():
        if not is_fused_experts(module):
            continue
        block_path, _, name = path.rpartition(".")
        block = model.get_submodule(block_path)
        routers = [child for child, sub in block.named_children()
                   if child != name and _routes(sub, module.num_experts, hidden)]
        if len(routers) != 1:
            unplaced.append(Unplaced(path, f"experts whose block has {len(routers)} candidate routers (a child "
                                           f"mapping {hidden} features to {module.num_experts} expert logits)"))
            continue
        facts.append(MoEFact(block=block_path, router=routers[0], experts=name))
    return facts


def _routes(module: nn.Module, experts: int, hidden: int) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and tuple(weight.shape) == (experts, hidden)


def taken_by_moe(facts: list[MoEFact]) -> set[str]:
    """Module paths the graph analysis must not place: routers and experts."""
    return {f"{f.block}.{child}" for f in facts for child in (f.router, f.experts)}


def moe_plan_entries(facts: list[MoEFact], pattern_of) -> tuple[dict, dict[str, MoESite]]:
    """(styles, moe sites) of ``facts`` as plan patterns (``pattern_of(path)``)."""
    styles, sites = {}, {}
    for f in facts:
        styles[pattern_of(f"{f.block}.{f.experts}")] = ExpertsTensorParallel()
        sites[pattern_of(f.block)] = MoESite(router=f.router, experts=f.experts)
    return styles, sites


__all__ = ["MoEFact", "moe_facts", "taken_by_moe", "moe_plan_entries"]
