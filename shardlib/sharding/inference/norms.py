"""Norms on q and k between their projections and the attention op (Qwen3's per-head ``q_norm`` / ``k_norm``,
OLMo-2's over the whole projected width): the walk from the attention op back to the q and k projections
(:func:`.graph.back_to_linears`) passes through them, since an RMSNorm's ops on its input are casts and products.
Each module with a 1-D weight that the walk passes inside is a norm, told apart by its weight's size on the analysis
twin (head dim 8, 12 query and 4 key/value heads: sizes that cannot be confused):

- the head dim: a per-head norm, its weight replicated and its gradient summed over tp
  (:class:`~shardlib.parallel.norms.PartialGrads`);
- the projection's whole width (heads x head dim): a norm over all heads, its weight split with them and its
  statistic all-reduced over tp (:class:`~shardlib.parallel.norms.ColwiseNorm`), where it is an RMSNorm and the
  projection is not fused;
- anything else stays replicated and is reported (the proof then refuses what would compute otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...parallel.norms import ColwiseNorm, PartialGrads
from ...parallel.styles import Style
from .graph import Graph, back_to_linears, out_features, shape
from .sites import AttentionFact, Unplaced


@dataclass(frozen=True)
class NormFact:
    path: str
    style: Style
    evidence: str


def qk_norms(g: Graph, attention: list[AttentionFact], unplaced: list[Unplaced]) -> list[NormFact]:
    """The norms on the q and k paths of every attention fact, with their styles (module docstring)."""
    linears, found, refused = set(g.linear_calls()), {}, set()
    for fact in attention:
        head_dim = shape(fact.operands[0])[-1]
        for role, operand in zip(("q", "k"), fact.operands[:2]):
            projection = getattr(fact, role)
            parts = fact.blocks.get(projection, 1)
            width = out_features(g.modules[projection]) // parts
            _, passed = back_to_linears(g, operand, linears)
            for path in dict.fromkeys(g.module_of(n) for n in passed):
                weight = getattr(g.modules.get(path), "weight", None)
                if path in found or path in refused or path == fact.block or weight is None or weight.dim() != 1:
                    continue
                size, where = weight.shape[0], f"{role} norm, weight [{weight.shape[0]}]"
                why = None
                if size == head_dim:
                    found[path] = NormFact(path, PartialGrads(), f"{where} = head dim: per head, replicated, its "
                                                                 "gradient summed over tp")
                elif size != width:
                    why = (f"a module with a weight of {size} on the {role} path from {projection} (neither the head "
                           f"dim {head_dim} nor the projection's width {width})")
                elif parts > 1:
                    why = f"a norm over the whole width of a part of the fused projection {projection}"
                elif problems := ColwiseNorm().check(path, g.modules[path], 1):
                    why = f"a norm over the whole width of {projection} that is not an RMSNorm ({problems[0]})"
                else:
                    found[path] = NormFact(path, ColwiseNorm(), f"{where} = {projection}'s width: over all heads, "
                                                                "split with them, statistic all-reduced over tp")
                if why is not None:
                    refused.add(path)
                    unplaced.append(Unplaced(path, why))
    return list(found.values())


__all__ = ["NormFact", "qk_norms"]
