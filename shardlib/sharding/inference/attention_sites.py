"""The attention sites of an inferred plan (:attr:`Plan.attention`): the modules that sequence parallelism over sp
(``"all_to_all"``, ``"ring"``) wraps, each with how to count its heads, the other sequence of a cross-attention and
the per-position tensors it receives from outside.

A block is a site when it calls transformers' attention interface: in one eager forward of the analysis twin, the
implementation is switched to a probe that marks the modules calling it (a block that computes attention in its own
code, DeBERTa-v2's, could not be wrapped and would attend within its own chunk). Then:

- **Heads**: the block's attribute holding the twin's 12 query heads, else :class:`HeadsOf` its q projection; grouped
  key/value heads as :class:`HeadsOf` its k projection (all-to-all checks both against tp * sp).
- **Cross-attention**: k reads another graph value than q; ``kv_input`` is the block's forward argument that k and v
  read unchanged (tensor identity, :func:`.assemble.entry_arguments`): BART's ``key_value_states``.
- **Positions**: values q, k or v are computed from (besides the projections) that the block receives from outside,
  one per position along dim 1 (rotary cos and sin, ``[1, 7, 8]`` on the 7-token example): the block's forward
  argument holding a tensor of that shape (Llama's ``position_embeddings``), cut to each rank's chunk.

Sites are listed for every attention of the layer stacks or for none: an attention op in a stack that is not a site
would attend within its own chunk, and the whole model's implementation is switched. When one block cannot be a site
(a relative position table, whose bias method a policy must name, is another reason), the plan lists none and the
reason is reported; sequence parallelism over sp then refuses the model.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import fx, nn

from ...kernels.attention import _register_wrapper, inner_attention, registries, set_attention
from ..plan import AttentionSite, HeadsOf
from .assemble import Facts, pattern_of
from .graph import ATTENTION_OPS, SOFTMAX_OPS, Graph, shape
from .sites import AttentionFact, Unplaced
from .twin import Sizes

PROBE_PREFIX = "shardlib_probe_"
CALLED_ATTR = "_shardlib_probe_called"


def _probe(module, query, key, value, attention_mask, *, implementation: str, **kwargs):
    module.__dict__[CALLED_ATTR] = True
    return inner_attention(module, implementation)(module, query, key, value, attention_mask, **kwargs)


def observe_blocks(model: nn.Module, inputs: dict, blocks: list[str]) -> dict[str, tuple[bool, dict]]:
    """Block -> (whether it called the attention interface, its forward arguments as name -> shapes of the tensors
    in it), from one eager forward of ``model`` (the analysis twin) with a probe implementation, registered for the
    call only."""
    arguments: dict[str, dict] = {}
    handles = []
    for block in blocks:
        module = model.get_submodule(block)

        def note(mod, args, kwargs, block=block, params=list(inspect.signature(module.forward).parameters)):
            named = dict(zip(params, args)) | kwargs
            arguments.setdefault(block, {k: shapes for k, v in named.items() if (shapes := _shapes(v))})

        handles.append(module.register_forward_pre_hook(note, with_kwargs=True))
    implementation = model.config._attn_implementation or "sdpa"
    switch = getattr(model, "_can_set_attn_implementation", lambda: True)()
    saved = [(mapping, mapping.copy()) for mapping in registries()]
    try:
        if switch:
            probe = functools.partial(_probe, implementation=implementation)
            set_attention(model, _register_wrapper(PROBE_PREFIX + implementation, probe, implementation))
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
        if switch:
            set_attention(model, implementation)
        for mapping, copy in saved:
            mapping.clear()
            mapping.update(copy)
    called = {b: bool(model.get_submodule(b).__dict__.pop(CALLED_ATTR, False)) for b in dict.fromkeys(blocks)}
    return {b: (called[b], arguments.get(b, {})) for b in called}


def _shapes(value) -> list[tuple[int, ...]]:
    if torch.is_tensor(value):
        return [tuple(value.shape)]
    if isinstance(value, (tuple, list)):
        return [s for v in value for s in _shapes(v)]
    return []


def attention_sites(g: Graph, facts: Facts, model: nn.Module, sizes: Sizes, seq: int,
                    observed: dict[str, tuple[bool, dict]]) -> tuple[dict[str, AttentionSite], list[Unplaced]]:
    """Pattern -> site for every attention block of the stacks, or no sites and the reason (module docstring).
    ``seq``: the example batch's sequence length."""
    why = _unsited_attention(g, facts)
    if facts.relative:
        why.append(Unplaced(", ".join(facts.relative), "a per-head relative position table: sequence parallelism "
                                                       "over sp needs a policy naming its bias method "
                                                       "(AttentionSite.bias_method)"))
    sites: dict[str, AttentionSite] = {}
    for fact in facts.attention:
        site = _site(g, fact, facts, model, sizes, seq, observed[fact.block], why)
        pattern = pattern_of(fact.block, facts.stacks)
        if site is not None and sites.setdefault(pattern, site) != site:
            why.append(Unplaced(pattern, f"its layers' attention sites differ: {sites[pattern]} / {site}"))
    if why:  # one line per pattern and reason (every layer of a stack gives the same)
        reasons = dict.fromkeys((pattern_of(u.module, facts.stacks), u.why) for u in why)
        return {}, [Unplaced(module, "no attention sites for sequence parallelism over sp (all-to-all, ring): "
                                     f"{reason}") for module, reason in reasons]
    return sites, []


def _unsited_attention(g: Graph, facts: Facts) -> list[Unplaced]:
    """Attention ops inside the stacks that are no identified block's (an attention left replicated there), and
    blocks outside the stacks (the implementation switch would reach them too)."""
    blocks = {f.block for f in facts.attention}
    routing = tuple(b + "." for b in facts.moe_blocks)  # a router's softmax is not attention
    why = [Unplaced(g.module_of(op), "an attention op inside the layers that is not an identified attention block")
           for op in g.calls(ATTENTION_OPS | SOFTMAX_OPS) if g.module_of(op) not in blocks
           and any(g.module_of(op).startswith(s + ".") for s in facts.stacks)
           and not g.module_of(op).startswith(routing)]
    why += [Unplaced(b, "an attention block outside the layer stacks") for b in sorted(blocks)
            if not any(b.startswith(s + ".") for s in facts.stacks)]
    return why


def _site(g: Graph, fact: AttentionFact, facts: Facts, model: nn.Module, sizes: Sizes, seq: int,
          observed: tuple[bool, dict], why: list[Unplaced]) -> AttentionSite | None:
    """The site of one block, or None with the reason added to ``why``."""
    interface, arguments = observed
    if not interface:
        why.append(Unplaced(fact.block, "it computes attention in its own code, not through transformers' attention "
                                        "interface, which sequence parallelism over sp wraps"))
        return None
    heads, kv_heads = _head_specs(model.get_submodule(fact.block), fact, sizes)
    if heads is None or (fact.kv_heads != fact.heads and kv_heads is None):
        why.append(Unplaced(fact.block, "no head-count or head-dim attribute to count its heads by"))
        return None
    reads = facts.entries.get(fact.block, {})
    kv_input = None
    if fact.nodes["k"].args[0] is not fact.nodes["q"].args[0]:  # keys and values from another sequence
        kv_input = reads.get(fact.k)
        if kv_input is None or reads.get(fact.v) != kv_input or kv_input == reads.get(fact.q):
            why.append(Unplaced(fact.block, "cross-attention whose keys and values are not one forward argument"))
            return None
    positions = _positions(g, fact, arguments, set(reads.values()), seq, why)
    if positions is None:
        return None
    return AttentionSite(heads, kv_input=kv_input, kv_heads=kv_heads if fact.kv_heads != fact.heads else None,
                         positions=positions)


def _head_specs(block: nn.Module, fact: AttentionFact, sizes: Sizes):
    """(query heads, key/value heads) as :attr:`AttentionSite.heads` takes them: the attribute holding the twin's
    query heads, else counted on the projections (:class:`HeadsOf`); None where neither is possible."""
    ints = {k: v for k, v in vars(block).items() if type(v) is int}
    head_dim = next((k for k, v in ints.items() if v == sizes.head_dim), None)

    def counted(path: str):
        if head_dim is None or not path.startswith(fact.block + "."):
            return None
        return HeadsOf(path[len(fact.block) + 1:], head_dim, fact.blocks.get(path, 1))

    heads = next((k for k, v in ints.items() if v == sizes.heads), None) or counted(fact.q)
    return heads, counted(fact.k)


def _positions(g: Graph, fact: AttentionFact, arguments: dict, entries: set[str], seq: int,
               why: list[Unplaced]) -> tuple[str, ...] | None:
    """The forward arguments of the block holding the per-position values q, k and v are computed from besides the
    projections (module docstring); None (with the reason in ``why``) where one cannot be named."""
    names = []
    for node in _outside_operands(g, fact):
        found = shape(node)
        candidates = [name for name, shapes in arguments.items() if found in shapes and name not in entries]
        if len(found) < 2 or found[1] != seq or len(candidates) != 1:
            why.append(Unplaced(fact.block, f"q, k or v is computed from {node.name} {list(found)} (from "
                                            f"{g.module_of(node) or 'the model'}), which is not one forward argument "
                                            f"holding one value per position along dim 1"))
            return None
        names.append(candidates[0])
    return tuple(dict.fromkeys(names))


def _outside_operands(g: Graph, fact: AttentionFact) -> list[fx.Node]:
    """Values computed outside the block that its q, k or v are computed from inside it, not through its
    projections (rotary cos and sin); parameters, buffers and the model's own inputs are not among them."""
    projections = set(fact.nodes.values())
    inside = (lambda n: g.module_of(n) == fact.block or g.module_of(n).startswith(fact.block + "."))
    found, todo, seen = [], list(fact.operands), set()
    while todo:
        node = todo.pop()
        if not isinstance(node, fx.Node) or node in seen or node in projections or node.op != "call_function":
            continue
        seen.add(node)
        if not inside(node):
            found.append(node)
            continue
        todo += node.all_input_nodes
    return sorted(found, key=lambda n: n.name)


__all__ = ["observe_blocks", "attention_sites", "PROBE_PREFIX"]
