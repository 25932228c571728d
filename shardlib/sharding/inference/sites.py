"""What the graph says, site by site: attention blocks (their q/k/v and output projections and head counts), MLPs
(up and gate projections, the element-wise region, the down projection), vocabulary embeddings and the LM head,
relative-position tables. Each fact keeps its evidence: the graph nodes that made the decision."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx, nn

from .graph import (
    ATTENTION_OPS, CHECK_OPS, aten, ELEMENTWISE_OPS, MATMUL_OPS, SHAPE_OPS, SOFTMAX_OPS, SPLIT_OPS, Graph, back_to_linears,
    inputs_through, on_to_linears, op_name, out_features, shape, tensor_args, users_through,
)
from .twin import Sizes


@dataclass
class AttentionFact:
    block: str  # the module that runs the attention op (CopyInputs / LocalRNG go here)
    q: str
    k: str
    v: str
    out: str
    heads: int
    kv_heads: int
    nodes: dict[str, fx.Node] = field(default_factory=dict, repr=False)  # the projections' calls, by role
    evidence: list[str] = field(default_factory=list)
    blocks: dict[str, int] = field(default_factory=dict)  # fused projection -> the equal parts its output splits into
    operands: tuple[fx.Node, ...] = field(default=(), repr=False)  # the attention op's q, k and v inputs


@dataclass
class MlpFact:
    up: tuple[str, ...]  # column-parallel: the up (and gate) projections
    down: str  # row-parallel
    local_dropout: tuple[str, ...]  # dropout modules on the sharded region (per-rank stream)
    nodes: tuple[fx.Node, ...] = field(default=(), repr=False)  # the up projections' calls
    evidence: list[str] = field(default_factory=list)


@dataclass
class Unplaced:
    module: str
    why: str


def _attention_operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """(q, k, v, output) of an attention op: SDPA directly; an eager softmax through the two matmuls around it."""
    if node.target in ATTENTION_OPS:
        q, k, v = node.args[:3]
        return q, k, v, node
    scores = _back_through(node.args[0], ELEMENTWISE_OPS | SHAPE_OPS, MATMUL_OPS)
    probs = _on_through(node, ELEMENTWISE_OPS | SHAPE_OPS, MATMUL_OPS, position=0)
    if scores is None or probs is None:
        return None
    return scores.args[0], scores.args[1], probs.args[1], probs


def _back_through(node, through, target):
    """The first ``target`` op ``node`` is computed from through ``through`` ops."""
    calls = (n for n in inputs_through(node, lambda n: n.op == "call_function" and n.target in through))
    return next((n for n in calls if n.op == "call_function" and n.target in target), None)


def _on_through(node, through, target, position):
    """The first ``target`` op taking (through ``through`` ops) ``node`` as its argument ``position``."""
    uses = users_through(node, lambda u: u.op == "call_function" and u.target in through)
    return next((u for n, u in uses if u.op == "call_function" and u.target in target and u.args[position] is n),
                None)


def _fused_split(passed: list[fx.Node]) -> tuple[int, int] | str | None:
    """(parts, which part) when the walk from an attention input back to its projection passed a split of the
    projection's output (a fused q/k/v projection) into equal parts along its last dim; a message when it passed
    a split that cannot be sharded per part; None when it passed none."""
    splits = [n for n in passed if n.target in SPLIT_OPS]
    if not splits:
        return None
    picks = [n for n in passed if n.op == "call_function" and n.args and n.args[0] in splits
             and n.target not in SPLIT_OPS]
    split, value = splits[0], splits[0].args[0].meta.get("val")
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if len(splits) != 1 or len(picks) != 1 or value is None or split.target is aten.unbind.int \
            or dim % value.dim() != value.dim() - 1:
        return "a fused projection split other than once along its features (per-part sharding not supported)"
    width, parts = value.shape[-1], {shape(n)[-1] for n in split.users if shape(n)}
    if len(parts) != 1 or width % next(iter(parts)):
        return f"a fused projection split into unequal parts ({sorted(parts)} of {width}): not supported"
    return width // next(iter(parts)), picks[0].args[1]


def attention_facts(g: Graph, sizes: Sizes, unplaced: list[Unplaced]) -> list[AttentionFact]:
    linears = set(g.linear_calls())
    facts = []
    for op in g.calls(ATTENTION_OPS | SOFTMAX_OPS):
        operands = _attention_operands(op)
        block = g.module_of(op)
        if operands is None:
            continue
        roles, blocks = {}, {}
        evidence = [f"{op.target} ({op.name}) in {block}"]
        for role, node in zip(("q", "k", "v"), operands[:3]):
            found, passed = back_to_linears(g, node, linears)
            if len(found) != 1:
                roles = None
                unplaced.append(Unplaced(block, f"the attention's {role} comes from {len(found)} linear modules "
                                                f"({', '.join(sorted(g.module_of(n) for n in found)) or 'none'})"))
                break
            (linear,) = found
            fused = _fused_split(passed)
            if isinstance(fused, str):
                roles = None
                unplaced.append(Unplaced(g.module_of(linear), fused))
                break
            if fused is not None:
                blocks[g.module_of(linear)] = fused[0]
                evidence.append(f"{role} is part {fused[1]} of {fused[0]} equal parts of {g.module_of(linear)}'s "
                                "output (split per head in each part)")
            roles[role] = linear
            evidence.append(f"{role} <- {g.module_of(linear)} ({linear.name}) via "
                            f"{', '.join(op_name(p) for p in dict.fromkeys(passed)) or 'nothing'}")
        if roles is None:
            continue
        outs = on_to_linears(g, operands[3], linears)
        if len(outs) != 1:
            unplaced.append(Unplaced(block, f"the attention output feeds {len(outs)} linear modules"))
            continue
        (out,) = outs
        evidence.append(f"out -> {g.module_of(out)} ({out.name})")
        head_dim = shape(operands[0])[-1]
        q_path, k_path = (g.module_of(roles[r]) for r in ("q", "k"))
        heads, kv_heads = (out_features(g.modules[p]) // blocks.get(p, 1) // head_dim for p in (q_path, k_path))
        if heads != sizes.heads:
            unplaced.append(Unplaced(block, f"{heads} query heads found where the twin has {sizes.heads}"))
            continue
        evidence.append(f"heads {heads}, key/value heads {kv_heads}, head dim {head_dim} (q {list(shape(operands[0]))})")
        facts.append(AttentionFact(block=block, q=g.module_of(roles["q"]), k=g.module_of(roles["k"]),
                                   v=g.module_of(roles["v"]), out=g.module_of(out), heads=heads, kv_heads=kv_heads,
                                   nodes=roles, evidence=evidence, blocks=blocks, operands=operands[:3]))
    return facts


def mlp_facts(g: Graph, taken: set[str], inside: tuple[str, ...]) -> list[MlpFact]:
    """Linear -> element-wise region -> linear, where every value in the region is per feature: the first linears
    column-parallel, the last row-parallel. Only inside the layer stacks ``inside`` (task heads stay replicated, as
    the hand policies keep them: at most hidden x hidden, sharding them adds collectives for no memory won)."""
    linears = {n for n in g.linear_calls() if g.module_of(n) not in taken
               and any(g.module_of(n).startswith(s + ".") for s in inside)}
    facts, used = [], set()
    for start in sorted(linears, key=lambda n: n.name):
        if start in used:
            continue
        region, downs, ok = _grow_region(start, linears)
        ups = {start}
        for node in list(region):  # what else the region reads with the same features: gates, or not an MLP
            for arg in tensor_args(node):
                if arg in region or arg in ups or not shape(arg) or shape(arg)[-1] != shape(start)[-1]:
                    continue
                if arg in linears and all(u in region or u in downs or u.target in CHECK_OPS for u in arg.users):
                    ups.add(arg)
                else:
                    ok = False
        if not ok or len(downs) != 1 or not region:
            continue
        (down,) = downs
        dropouts = tuple(sorted({g.module_of(n) for n in region if isinstance(g.modules.get(g.module_of(n)),
                                                                               nn.Dropout)}))
        used |= ups
        facts.append(MlpFact(up=tuple(sorted(g.module_of(u) for u in ups)), down=g.module_of(down),
                             local_dropout=dropouts, nodes=tuple(ups), evidence=[
                                 f"{', '.join(g.module_of(u) for u in sorted(ups, key=lambda n: n.name))} -> "
                                 f"{', '.join(sorted({op_name(n) for n in region}))} -> "
                                 f"{g.module_of(down)}"]))
    return facts


def _grow_region(start: fx.Node, linears: set[fx.Node]) -> tuple[set[fx.Node], set[fx.Node], bool]:
    """The element-wise nodes downstream of ``start`` up to the linears that consume them; False when a value of the
    region reaches anything else (a norm, a reduction, the output)."""
    region, downs, todo = set(), set(), list(start.users)
    while todo:
        node = todo.pop()
        if node in region or node in downs or node is start:
            continue
        if node in linears:  # a linear takes a region value as its input: where the region ends
            downs.add(node)
            continue
        if node.op == "call_function" and node.target in CHECK_OPS:
            continue
        if node.op != "call_function" or node.target not in ELEMENTWISE_OPS:
            return region, downs, False
        region.add(node)
        todo += list(node.users)
    return region, downs, True


def tied_holders(model: nn.Module, weight: nn.Parameter) -> list[str]:
    """Every module (by path, duplicates included) holding ``weight`` as its ``weight``."""
    return sorted({name for name, m in model.named_modules(remove_duplicate=False)
                   if getattr(m, "weight", None) is weight and isinstance(m, (nn.Embedding, nn.Linear))})


def vocab_sites(g: Graph, model: nn.Module, sizes: Sizes, unplaced: list[Unplaced]) -> tuple[list[str], str | None]:
    """The modules that hold the vocabulary table (embeddings and the heads tied to them), and the LM head if it
    can be vocab-parallel: its logits go only to reshapes, the loss and the output (no bias or mask added over the
    vocabulary, which would need the whole row). A table any of whose holders cannot be sharded stays whole."""
    weights: dict[int, nn.Parameter] = {}
    why: dict[int, list[tuple[str, str]]] = {}  # id(weight) -> (module, why it stays replicated); empty: shard it
    head = None

    def seen(path: str, module: nn.Module, problem: str | None) -> None:
        weights[id(module.weight)] = module.weight
        why.setdefault(id(module.weight), []).extend([(path, problem)] if problem else [])

    for node in g.embedding_calls():
        path, module = g.module_of(node), g.modules[g.module_of(node)]
        if module.num_embeddings == sizes.vocab:  # a scaled embedding (Gemma) would lose its scale
            seen(path, module, None if type(module).forward is nn.Embedding.forward else
                 f"{type(module).__name__} has a forward of its own (a vocab-parallel embedding would drop it)")
    for node in g.linear_calls():
        path, module = g.module_of(node), g.modules[g.module_of(node)]
        if out_features(module) == sizes.vocab:
            whole = type(module).forward is nn.Linear.forward and _logits_stay_whole(node)
            seen(path, module, None if whole else "the vocabulary head's logits meet another tensor over the "
                                                  "vocabulary (a bias or mask added to them)")
            head = path if whole else head
    tables = []
    for key, reasons in why.items():
        holders = tied_holders(model, weights[key])
        if reasons:
            unplaced += [Unplaced(path, f"{reason}: {', '.join(holders)} left replicated") for path, reason in reasons]
            head = None if head in holders else head
        else:
            tables += holders
    return sorted(tables), head


#: what a vocab-sharded logits tensor may meet before it leaves the model: reshapes and casts, then a loss (whose
#: scalar may go anywhere)
LOGIT_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.contiguous.default, aten.to.dtype,
             aten._to_copy.default, aten.slice.Tensor, aten.clone.default, aten.transpose.int, aten.permute.default}
LOSS_OPS = {aten.cross_entropy_loss.default, aten.nll_loss_forward.default, aten.nll_loss.default,
            aten._log_softmax.default, aten.log_softmax.int}


def _logits_stay_whole(node: fx.Node) -> bool:
    return all(u.op == "output" or u.target in CHECK_OPS | LOSS_OPS or u.target in LOGIT_OPS
               for _, u in users_through(node, lambda u: u.op == "call_function" and u.target in LOGIT_OPS))


def relative_tables(g: Graph, sizes: Sizes, blocks: list[str]) -> list[str]:
    """Embeddings inside an attention block with one column per head (T5's relative position bias): split by
    head."""
    return sorted({g.module_of(n) for n in g.embedding_calls()
                   if g.modules[g.module_of(n)].embedding_dim == sizes.heads
                   and any(g.module_of(n).startswith(b + ".") for b in blocks)})


__all__ = ["AttentionFact", "MlpFact", "Unplaced", "attention_facts", "mlp_facts", "vocab_sites", "relative_tables",
           "tied_holders"]
