"""Plans inferred from the model's own graph: the sharding compiler for architectures nobody wrote a policy for.

``shard(model, mesh)`` on a class with no registered policy, or ``policy="auto"`` on any class:

1. an **analysis twin** (:mod:`.twin`: the same class, 2 layers, sizes that tell roles apart) is exported with
   ``torch.export`` (non-strict) on an example batch of its task (:mod:`.graph`);
2. the graph is read site by site (:mod:`.sites`): each attention op (SDPA, or softmax between two matmuls) is
   walked back through reshapes, transposes, rotary and grouped-KV ops to its q, k and v projections and on to its
   output projection; linear -> element-wise -> linear regions are MLPs; embeddings with the vocabulary's rows, and
   the heads tied to them, are vocab-parallel; per-head tables inside attention blocks are split by head;
3. the facts become a plan (:mod:`.assemble`): Megatron styles, input copies where the projections read the
   block's own arguments, per-rank RNG on sharded activations, head attributes to divide, the layer trunk (with
   what a cut between two layers carries), and patterns over the layer index; the attention blocks that call
   transformers' attention interface become the sites sequence parallelism over sp wraps (:mod:`.attention_sites`);
4. before ``shard()`` uses it, the plan is **proven** on a verification twin (:mod:`.verify`), and so are its
   pipeline cuts when the mesh has pp > 1 (:mod:`.cuts`).

Anything the analysis cannot place stays replicated and is listed (:attr:`Inferred.unplaced`). The result is
cached per model class and config structure (the plan depends on the architecture, not the sizes).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ...parallel.random import preserved_rng
from ...parallel.styles import as_tuple, style_name
from ..examples import example_batch, task_of
from ..plan import INFERRED, Plan, PlanError
from .assemble import (
    Facts, attributes_read, build_plan, divided_attributes, entry_arguments, inputs_only_projected, layer_carries,
    pattern_of, stacks_of,
)
from .attention_sites import attention_sites, observe_blocks
from .experts import moe_facts, moe_plan_entries, taken_by_moe
from .graph import ExportError, export_twin, out_features
from .norms import qk_norms
from .sites import Unplaced, attention_facts, mlp_facts, relative_tables, vocab_sites
from .twin import ROLES, analysis_twin


@dataclass
class Inferred:
    """An inferred plan, the evidence for each decision, and what stays replicated."""

    model_class: str
    plan: Plan
    evidence: dict[str, list[str]] = field(default_factory=dict)
    unplaced: list[Unplaced] = field(default_factory=list)
    seconds: float = 0.0
    #: attention block pattern -> (q child, k child, head-dim attribute, parts of the q and of the k child's output
    #: (fused projections)): heads are counted on the model to shard
    heads: dict[str, tuple[str, str, str, int, int]] = field(default_factory=dict)

    def head_problems(self, model: nn.Module, tp: int) -> list[str]:
        """Attention blocks whose query or key/value heads ``tp`` does not divide (checked on ``model`` itself,
        whatever attributes its blocks hold)."""
        from ..plan import match_modules

        problems, modules = [], dict(model.named_modules())
        for pattern, (q, k, head_dim, q_parts, k_parts) in self.heads.items():
            for path in match_modules(pattern, modules):
                block = modules[path]
                d = getattr(block, head_dim)
                for role, child, parts in (("query", q, q_parts), ("key/value", k, k_parts)):
                    n = out_features(block.get_submodule(child)) // parts // d
                    if n % tp:
                        problems.append(f"{path}: {n} {role} heads ({child}: {n * d * parts} outputs"
                                        + (f" in {parts} fused parts" if parts > 1 else "") + f" / {head_dim} {d}) "
                                        f"are not divisible by tp={tp}")
        return list(dict.fromkeys(problems))

    def describe(self) -> str:
        lines = [f"inferred plan for {self.model_class} ({self.seconds:.2f} s):"]
        for pattern, styles in self.plan.styles.items():
            lines.append(f"  {pattern}: {' + '.join(style_name(s) for s in as_tuple(styles))}")
        for pattern, names in self.plan.divide_by_tp.items():
            lines.append(f"  {pattern}: divide {', '.join(names)} by tp")
        for stack in self.plan.trunk:
            carry = f", carry {list(stack.carry)}" if stack.carry != ((0, 0),) else ""
            lines.append(f"  trunk {stack.layers} (before {list(stack.before)}, after {list(stack.after)}{carry})")
        for pattern, site in self.plan.attention.items():
            fields = {k: v for k, v in vars(site).items() if v not in (None, ())}
            lines.append(f"  attention site {pattern}: {', '.join(f'{k} {v}' for k, v in fields.items())}")
        if self.plan.sequence_dropout:
            lines.append(f"  sequence-parallel dropouts: {', '.join(self.plan.sequence_dropout)}")
        if self.plan.loss is not None:
            lines.append(f"  loss {self.plan.loss.kind} on vocab-parallel {self.plan.loss.head}")
        lines.append("evidence:")
        for site, items in self.evidence.items():
            lines += [f"  {site}: {item}" for item in items]
        if self.unplaced:
            lines.append("left replicated:")
            lines += [f"  {u.module}: {u.why}" for u in self.unplaced]
        return "\n".join(lines)


_CACHE: dict[tuple, Inferred] = {}
#: the analysis twin's example sequence length (a dim of 7 is the sequence)
SEQ = 7


def _structure_key(model: nn.Module) -> tuple:
    """What the plan depends on: the class and every config field but the sizes the twins set (and labels, names,
    versions): a field that may change the architecture (an attention or position-embedding kind) keeps its own
    entry."""
    ignored = {name for names in ROLES.values() for name in names} | {
        "max_position_embeddings", "n_positions", "num_labels", "id2label", "label2id", "_name_or_path",
        "transformers_version", "torch_dtype", "dtype"}
    config = {k: repr(v) for k, v in model.config.to_dict().items() if k not in ignored}
    return type(model), tuple(sorted(config.items()))


def infer(model: nn.Module) -> Inferred:
    """The inferred plan of ``model``'s architecture (module docstring); cached. Raises :class:`ExportError` (a
    :class:`PlanError`) when the twin does not export, and :class:`PlanError` when no attention block is found."""
    key = _structure_key(model)
    if key not in _CACHE:
        _CACHE[key] = _infer(model)
    return _CACHE[key]


def _infer(model: nn.Module) -> Inferred:
    start = time.perf_counter()
    with preserved_rng():
        torch.manual_seed(0)
        twin, sizes = analysis_twin(model)
        inputs = example_batch(twin, 2, SEQ, device="cpu", generator=torch.Generator().manual_seed(0))
        g = export_twin(twin, inputs)
    unplaced: list[Unplaced] = []
    attention = attention_facts(g, sizes, unplaced)
    if not attention:
        reasons = "; ".join(f"{u.module}: {u.why}" for u in unplaced) or "no attention op in the graph"
        raise PlanError(f"cannot infer a plan for {type(model).__name__}: no attention block could be identified "
                        f"({reasons}). Write a policy for it (docs/policy-authoring.md)")
    moe = moe_facts(twin, sizes.hidden, unplaced)
    taken = {p for f in attention for p in (f.q, f.k, f.v, f.out)} | taken_by_moe(moe)
    blocks = [f.block for f in attention]
    stacks = stacks_of(twin, blocks)
    mlps = mlp_facts(g, taken, tuple(stacks))
    tables, head = vocab_sites(g, twin, sizes, unplaced)
    facts = Facts(attention=attention, mlps=mlps, tables=tables, head=head, relative=relative_tables(g, sizes, blocks),
                  stacks=stacks, unplaced=unplaced, moe_blocks=[f.block for f in moe])
    norms = qk_norms(g, attention, unplaced)
    facts.norms = {n.path: n.style for n in norms}
    facts.entries = entry_arguments(twin, inputs, _entry_groups(g, attention, mlps))
    facts.carries = layer_carries(twin, inputs, stacks)
    facts.divide = divided_attributes(twin, blocks, sizes, attributes_read(twin, inputs, blocks))
    plan, dropped = build_plan(facts, g, twin, task_of(twin), inspect.signature(twin.forward).parameters)
    sites, unsited = attention_sites(g, facts, twin, sizes, SEQ, observe_blocks(twin, inputs, blocks))
    moe_styles, moe_sites = moe_plan_entries(moe, lambda path: pattern_of(path, stacks))
    plan = dataclasses.replace(plan, attention=sites, styles={**plan.styles, **moe_styles}, moe=moe_sites)
    evidence = {f"attention {f.block}": f.evidence for f in attention}
    evidence |= {f"mlp {f.down}": f.evidence for f in mlps}
    evidence |= {f"norm {n.path}": [n.evidence] for n in norms}
    if tables:
        evidence["vocabulary"] = [f"{', '.join(tables)}: {sizes.vocab} rows (the twin's vocabulary)"]
    evidence |= {f"experts {f.block}.{f.experts}": [f"fused experts; router {f.block}.{f.router}"] for f in moe}
    if facts.relative:
        evidence["per-head tables"] = [f"{', '.join(facts.relative)}: {sizes.heads} columns, inside attention blocks"]
    return Inferred(type(model).__name__, plan, evidence, unplaced + dropped + unsited, time.perf_counter() - start,
                    _head_counts(twin, attention, sizes, stacks))


def _entry_groups(g, attention, mlps) -> dict[str, list[str]]:
    """Module -> the projections that may share one copy of its input: each attention block's q/k/v, each MLP's up
    and gate projections (their parent), where nothing else inside the module reads that input."""
    groups = {f.block: (list(dict.fromkeys((f.q, f.k, f.v))), list(f.nodes.values())) for f in attention}
    groups |= {parent: (list(f.up), list(f.nodes)) for f in mlps
               if len(f.up) > 1 and (parent := f.up[0].rpartition(".")[0])}
    return {owner: paths for owner, (paths, calls) in groups.items() if inputs_only_projected(g, owner, calls)}


def _head_counts(twin, attention, sizes, stacks) -> dict[str, tuple[str, str, str, int, int]]:
    """Block pattern -> (q child, k child, head-dim attribute, their parts): how to count a block's heads on any
    model."""
    heads = {}
    for f in attention:
        block = twin.get_submodule(f.block)
        head_dim = next((k for k, v in vars(block).items() if type(v) is int and v == sizes.head_dim), None)
        if head_dim is not None and f.q.startswith(f.block + ".") and f.k.startswith(f.block + "."):
            heads[pattern_of(f.block, stacks)] = (f.q[len(f.block) + 1:], f.k[len(f.block) + 1:], head_dim,
                                                  f.blocks.get(f.q, 1), f.blocks.get(f.k, 1))
    return heads


def inferred_policy(model: nn.Module):
    """A :class:`shardlib.policies.Policy` whose plan is :func:`infer`'s for ``model``'s class."""
    from shardlib.policies import Policy

    inferred = infer(model)
    return Policy(name=INFERRED, model_classes=(type(model),), make_plan=lambda m, tp: inferred.plan)


__all__ = ["Inferred", "infer", "inferred_policy", "ExportError"]
