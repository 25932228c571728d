"""From the graph's facts to a :class:`~shardlib.sharding.plan.Plan`: the Megatron styles on the sites found, the
head attributes to divide, the layer trunk, the dropouts' streams, module paths of the twin's layers turned into
patterns (``encoder.layer.0.attention`` -> ``encoder.layer.*.attention``) so that the plan applies to a model of
any depth."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ...parallel.styles import ColwiseParallel, CopyInputs, LocalRNG, RowwiseParallel, VocabParallel, style_name
from ..plan import EXAMPLES, TOKENS, LossItems, LossSpec, Plan, Stack, match_modules
from .graph import CHECK_OPS, Graph
from .sites import AttentionFact, MlpFact, Unplaced

LOSS_KINDS = {"MASKED_LM": ("masked_lm", TOKENS), "CAUSAL_LM": ("causal_lm", LossItems(key="labels", shift=1)),
              "SEQ_TO_SEQ_CAUSAL_LM": ("seq2seq_lm", TOKENS)}


@dataclass
class Facts:
    """Everything the analysis found on the twin, by concrete module path."""

    attention: list[AttentionFact]
    mlps: list[MlpFact]
    tables: list[str]
    head: str | None
    relative: list[str]
    stacks: list[str]
    unplaced: list[Unplaced]
    #: module -> {projection: the forward argument of the module it reads unchanged} (the args entering TP)
    entries: dict[str, dict[str, str]] = field(default_factory=dict)
    divide: dict[str, tuple[str, ...]] = field(default_factory=dict)
    carries: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)  # stack -> Stack.carry
    moe_blocks: list[str] = field(default_factory=list)  # mixture-of-experts blocks (.experts)
    norms: dict[str, object] = field(default_factory=dict)  # q/k norm -> its style (:mod:`.norms`)


def entry_arguments(model: nn.Module, inputs: dict, groups: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """For each ``module -> projections`` group: the forward argument of ``module`` that each projection reads
    unchanged (found by tensor identity in one eager forward); a group whose projections read anything else gets
    none (each projection then copies its own input)."""
    seen_args: dict[str, dict[int, str]] = {}
    read: dict[str, int] = {}
    handles = []
    for owner in groups:
        module = model.get_submodule(owner)
        params = list(inspect.signature(module.forward).parameters)

        def note_args(mod, args, kwargs, owner=owner, params=params):
            named = dict(zip(params, args)) | kwargs
            seen_args.setdefault(owner, {}).update({id(v): k for k, v in named.items() if torch.is_tensor(v)})

        handles.append(module.register_forward_pre_hook(note_args, with_kwargs=True))
        for path in groups[owner]:
            def note_input(mod, args, path=path):
                read.setdefault(path, id(args[0]))

            handles.append(model.get_submodule(path).register_forward_pre_hook(note_input))
    _run_observed(model, inputs, handles)
    out = {}
    for owner, paths in groups.items():
        names = {p: seen_args.get(owner, {}).get(read.get(p)) for p in paths}
        if all(names.values()):
            out[owner] = names
    return out


def entry_names(facts: Facts, owner: str) -> tuple[str, ...]:
    """The forward arguments of ``owner`` its projections read unchanged, each once; () when not all are known."""
    return tuple(dict.fromkeys(facts.entries.get(owner, {}).values()))


def _run_observed(model: nn.Module, inputs: dict, handles: list) -> None:
    """One eager forward of ``model`` without autograd, then the observing hooks ``handles`` removed."""
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()


def layer_carries(model: nn.Module, inputs: dict, stacks: list[str]) -> dict[str, tuple[tuple[int, int], ...]]:
    """For each stack: the (positional argument of a layer, output index of the layer before it) pairs of the
    values the second layer takes straight from the first one's output (found by tensor identity in one eager
    forward): what a pipeline cut between two layers must carry (:attr:`Stack.carry`; T5's position bias besides
    the hidden state). The hidden state alone when nothing is found; :mod:`.cuts` proves it either way."""
    outputs: dict[str, tuple] = {}
    arguments: dict[str, tuple] = {}
    handles = []
    for stack in stacks:
        layers = model.get_submodule(stack)
        if len(layers) < 2:
            continue
        def note_output(mod, args, out, stack=stack):  # a hook returning a value would replace the output
            outputs.setdefault(stack, out if isinstance(out, tuple) else (out,))

        def note_arguments(mod, args, stack=stack):
            arguments.setdefault(stack, args)

        handles += [layers[0].register_forward_hook(note_output), layers[1].register_forward_pre_hook(note_arguments)]
    _run_observed(model, inputs, handles)
    found = {}
    for stack in stacks:
        out, args = outputs.get(stack, ()), arguments.get(stack, ())
        pairs = [(i, next(j for j, o in enumerate(out) if o is a)) for i, a in enumerate(args)
                 if torch.is_tensor(a) and any(o is a for o in out)]
        found[stack] = tuple(pairs) if pairs and pairs[0] == (0, 0) else ((0, 0),)
    return found


def inputs_only_projected(g: Graph, owner: str, projections) -> bool:
    """Whether, inside module ``owner``, the inputs of ``projections`` (linear calls) feed nothing but them: only
    then may ``owner`` copy its argument into the TP region for all its uses (a residual add of the same argument
    inside ``owner``, as ALBERT's attention has, would get its gradient all-reduced too)."""
    allowed = set(projections)
    for node in {p.args[0] for p in projections}:
        for user in node.users:
            inside = g.module_of(user) == owner or g.module_of(user).startswith(owner + ".")
            if inside and user not in allowed and user.target not in CHECK_OPS:
                return False
    return True


def attributes_read(model: nn.Module, inputs: dict, blocks: list[str]) -> dict[str, set[str]]:
    """The attributes each block's forward reads, in one eager forward of ``model`` (the analysis twin: its blocks'
    classes are swapped for recording subclasses for the call, then put back)."""
    reads: dict[str, set[str]] = {block: set() for block in blocks}
    swapped = []
    for block in blocks:
        module, seen = model.get_submodule(block), reads[block]
        cls = type(module)

        def __getattribute__(self, name, _cls=cls, _seen=seen):  # noqa: N807 - the recording override
            _seen.add(name)
            return _cls.__getattribute__(self, name)

        module.__class__ = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})
        swapped.append((module, cls))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for module, cls in swapped:
            module.__class__ = cls
    return reads


def divided_attributes(model: nn.Module, blocks: list[str], sizes, reads: dict[str, set[str]]) -> dict[str, tuple]:
    """The int attributes of each attention block holding a head count or heads' width (by value on the twin); one
    whose value is also the hidden size (BERT's ``all_head_size``) only when the forward reads it (then it must be
    the local width: MegatronBERT's and Data2VecVision's reshapes read it)."""
    widths, ambiguous = sizes.widths, {sizes.heads * sizes.head_dim} & {sizes.hidden}
    out = {}
    for block in blocks:
        names = tuple(k for k, v in vars(model.get_submodule(block)).items() if type(v) is int
                      and (v in widths or (v in ambiguous and k in reads.get(block, ()))))
        if names:
            out[block] = names
    return out


def stacks_of(model: nn.Module, blocks: list[str]) -> list[str]:
    """The ModuleLists of same-class layers that hold attention blocks, as paths."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1 \
                and any(b.startswith(f"{path}.") for b in blocks):
            found.append(path)
    return found


def _span(g: Graph) -> dict[str, tuple[int, int]]:
    """First and last node index of every module (ancestors included) in graph order."""
    span: dict[str, tuple[int, int]] = {}
    for i, node in enumerate(g.graph.nodes):
        path = g.module_of(node)
        while True:
            lo, hi = span.get(path, (i, i))
            span[path] = (min(lo, i), max(hi, i))
            if not path:
                break
            path = path.rpartition(".")[0]
    return span


def trunk(g: Graph, model: nn.Module, stacks: list[str], forward_params, carries: dict) -> tuple[Stack, ...]:
    """Each stack with what crosses a cut between its layers (``carries``, :func:`layer_carries`), the modules run before its first layer (since the previous stack) and, inside its owner,
    after its last; an encoder's stack in an encoder-decoder model ends at its owner, whose output later stages
    take as ``encoder_outputs``."""
    span = _span(g)
    stacks = sorted(stacks, key=lambda s: span.get(s, (0, 0))[0])
    with_params = {p for p, m in model.named_modules() if any(True for _ in m.parameters())}
    out, previous_end = [], -1
    for k, stack in enumerate(stacks):
        first, last = span[f"{stack}.0"][0], span[f"{stack}.{len(model.get_submodule(stack)) - 1}"][1]
        following = span[stacks[k + 1]][0] if k + 1 < len(stacks) else len(g.graph.nodes)
        owner = stack.rpartition(".")[0]

        def topmost(ok):
            chosen = sorted(p for p in with_params if p and p in span and not stack.startswith(p)
                            and not p.startswith(stack + ".") and ok(p))
            return tuple(p for p in chosen if not any(p.startswith(q + ".") for q in chosen if q != p))

        before = topmost(lambda p: previous_end < span[p][0] and span[p][1] < first)
        after = topmost(lambda p: (not owner or p.startswith(owner + ".")) and last < span[p][0]
                        and span[p][1] < following)
        encoder = len(stacks) == 2 and k == 0 and "encoder_outputs" in forward_params
        out.append(Stack(layers=stack, before=before, after=after, carry=carries.get(stack, ((0, 0),)),
                         end=owner if len(stacks) == 2 else None,
                         output_arg="encoder_outputs" if encoder else None))
        previous_end = max([last] + [span[p][1] for p in after])
    return tuple(out)


def pattern_of(path: str, stacks: list[str]) -> str:
    for stack in stacks:
        if path.startswith(stack + "."):
            return re.sub(rf"^{re.escape(stack)}\.\d+", f"{stack}.*", path)
    return path


def build_plan(facts: Facts, g: Graph, model: nn.Module, task: str, forward_params) -> tuple[Plan, list[Unplaced]]:
    """The plan of ``facts`` as patterns; a pattern whose twin modules were not all decided alike is dropped (and
    reported), so a plan never reaches a layer the analysis did not read."""
    concrete: dict[str, tuple] = {}
    for fact in facts.attention:
        names = entry_names(facts, fact.block)
        concrete[fact.block] = (CopyInputs(*names), LocalRNG()) if names else (LocalRNG(),)
        for path in dict.fromkeys((fact.q, fact.k, fact.v)):
            concrete[path] = (ColwiseParallel(copy_input=not names, blocks=fact.blocks.get(path, 1)),)
        concrete[fact.out] = (RowwiseParallel(),)
    for fact in facts.mlps:
        owner = _common_parent(fact.up)
        names = entry_names(facts, owner) if len(fact.up) > 1 else None
        if names:  # an MLP's input is the residual stream (sequence-sharded under sequence parallelism)
            concrete[owner] = concrete.get(owner, ()) + (CopyInputs(*names, sequence_inputs=names),)
        for path in fact.up:
            concrete[path] = (ColwiseParallel(copy_input=not names),)
        concrete[fact.down] = (RowwiseParallel(),)
        for path in fact.local_dropout:
            concrete[path] = (LocalRNG(),)
    for path in facts.tables:
        concrete[path] = (VocabParallel(),)
    for path in facts.relative:
        concrete[path] = (ColwiseParallel(),)
    for path, style in facts.norms.items():
        concrete[path] = (style,)
    unplaced = []
    styles: dict[str, tuple] = {}
    seen: dict[str, list[str]] = {}
    for path, chosen in concrete.items():
        pattern = pattern_of(path, facts.stacks)
        if pattern in styles and styles[pattern] != chosen:
            unplaced.append(Unplaced(pattern, "its layers were decided differently: "
                                              f"{' / '.join(style_name(s) for s in styles[pattern] + chosen)}"))
            styles[pattern] = None
            continue
        styles.setdefault(pattern, chosen)
        seen.setdefault(pattern, []).append(path)
    modules = list(dict(model.named_modules()))
    for pattern, paths in seen.items():
        if styles.get(pattern) is not None and set(match_modules(pattern, modules)) != set(paths):
            missed = sorted(set(match_modules(pattern, modules)) - set(paths))
            unplaced.append(Unplaced(pattern, f"decided for {len(paths)} of its layers only (not {', '.join(missed)})"))
            styles[pattern] = None
    styles = {p: (s[0] if len(s) == 1 else s) for p, s in styles.items() if s is not None}
    divide = {pattern_of(p, facts.stacks): names for p, names in facts.divide.items()}
    loss, items = None, EXAMPLES
    if facts.head is not None and task in LOSS_KINDS and "labels" in forward_params:
        kind, items = LOSS_KINDS[task]
        loss = LossSpec(kind=kind, head=facts.head)
    elif task == "TOKEN_CLASSIFICATION":
        items = TOKENS
    if facts.head is not None and loss is None:  # sharded logits nobody turns into a loss: keep the head whole
        for path in [p for p in styles if isinstance(styles[p], VocabParallel) and p == facts.head]:
            styles[path] = VocabParallel(gather_output=True)
    sequence_dropout = _sequence_dropouts(g, facts, styles)
    plan = Plan(styles=styles, divide_by_tp=divide, trunk=trunk(g, model, facts.stacks, forward_params, facts.carries),
                loss=loss,
                sequence_dropout=sequence_dropout, loss_items=items)
    return plan, unplaced


def _common_parent(paths) -> str:
    parents = {p.rpartition(".")[0] for p in paths}
    return parents.pop() if len(parents) == 1 else ""


def _sequence_dropouts(g: Graph, facts: Facts, styles: dict) -> tuple[str, ...]:
    """Dropout modules inside the layers that act on the residual stream: not in an attention block, not on a
    sharded MLP region (those draw per rank already)."""
    blocks = [f.block for f in facts.attention]
    local = {p for f in facts.mlps for p in f.local_dropout}
    found = set()
    for node in g.calls({torch.ops.aten.dropout.default}):
        path = g.module_of(node)
        if not isinstance(g.modules.get(path), nn.Dropout) or path in local:
            continue
        if any(path == b or path.startswith(b + ".") for b in blocks):
            continue
        if any(path.startswith(s + ".") for s in facts.stacks):
            found.add(pattern_of(path, facts.stacks))
    return tuple(sorted(found))


__all__ = ["Facts", "entry_arguments", "entry_names", "inputs_only_projected", "attributes_read", "divided_attributes",
           "stacks_of", "trunk", "pattern_of", "build_plan"]
