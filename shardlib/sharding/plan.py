"""A plan is plain data: what a policy produces for one model and what the sharder applies.

Module-path patterns are dotted paths relative to the model root where ``*`` matches exactly one path atom
(``bert.encoder.layer.*.attention.self``) and ``**`` matches any number of atoms (zero or more).

A layer of its own (docs/architecture.md): policies and the pipeline read it, the rest of :mod:`shardlib.sharding`
applies it, so it imports nothing of shardlib but :mod:`shardlib.parallel`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from ..parallel.styles import Style


INFERRED = "inferred"  # the name of an inferred plan's policy (shardlib.sharding.inference.inferred_policy)


class PlanError(ValueError):
    """A plan that does not fit the model or the mesh; raised before the model is changed."""


@dataclass(frozen=True, kw_only=True)
class LossSpec:
    """How the sharded model computes its training loss from vocab-sharded logits instead of HF's own loss.

    ``kind``: a loss registered in :mod:`shardlib.sharding.losses` ("masked_lm", "causal_lm", "pretraining").
    ``head``: module path of the vocab-parallel output head (its layout says which vocab columns are local).
    ``logits``: the output field holding the head's logits. ``labels``: the forward arguments that carry labels.
    """

    kind: str
    head: str
    logits: str = "logits"
    labels: tuple[str, ...] = ("labels",)


@dataclass(frozen=True, kw_only=True)
class LossItems:
    """What the model's loss is a mean over, counted per example of a batch. The Trainer weighs each microbatch's
    loss by its share of the items of the whole global batch, so that a step's gradient is the unsharded model's on
    the global batch whatever the microbatch and data-parallel split.

    ``key``: the batch entry counted; when it is None or absent from a batch, every example is one item.
    ``count``: ``"targets"`` counts the entries that are not -100 (token labels; ``shift`` leading positions of the
    last dim are not targets, as in a causal LM's shifted labels), ``"true"`` counts True entries (a mask)."""

    key: str | None = None
    count: str = "targets"
    shift: int = 0

    def __post_init__(self):
        if self.count not in ("targets", "true"):
            raise PlanError(f"LossItems.count must be 'targets' or 'true', got {self.count!r}")

    def per_example(self, batch: dict):
        """Items per example of ``batch`` (float64, shape [batch size])."""
        import torch

        n = next(v for v in batch.values() if torch.is_tensor(v)).shape[0]
        value = batch.get(self.key) if self.key is not None else None
        if not torch.is_tensor(value) or value.dim() < 2:  # absent, or one label per example
            return torch.ones(n, dtype=torch.float64)
        if self.count == "true":
            return value.reshape(n, -1).sum(1).double()
        value = value[..., self.shift:]
        return (value != -100).reshape(n, -1).sum(1).double()


EXAMPLES = LossItems()
TOKENS = LossItems(key="labels")


@dataclass(frozen=True, kw_only=True)
class Stack:
    """One repeated layer stack of the model, in the terms pipeline stages are cut in (``shardlib.pipeline``).

    ``layers``: path of the ModuleList of layers. ``before``: modules the forward runs before the first layer
    (embeddings); they live on the stage of the first layer, and a stage that starts inside the stack gets a
    stand-in returning the received hidden states instead. ``after``: modules run after the last layer (a final
    norm), on the stage of the last layer. ``carry``: what crosses a cut between two layers, as (positional
    input index of a layer, output index of a layer) pairs; (0, 0) is the hidden state, T5 adds its position
    bias (2, 1). ``end``: the module whose output is the stack's output, and ``output_arg``: the forward argument
    that takes it instead of running the stack (T5's ``encoder`` / ``encoder_outputs``) on later stages.
    """

    layers: str
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    carry: tuple[tuple[int, int], ...] = ((0, 0),)
    end: str | None = None
    output_arg: str | None = None


@dataclass(frozen=True)
class HeadsOf:
    """A head count an attention module holds in no attribute (Llama's reshapes to ``(-1, head_dim)``), read off
    its child linear ``projection``: output width / ``parts`` (the equal q/k/v parts of a fused projection) / the
    module's int attribute ``head_dim``."""

    projection: str
    head_dim: str
    parts: int = 1

    def count(self, module) -> int:
        child = module.get_submodule(self.projection)
        width = child.nf if hasattr(child, "nf") else child.out_features  # transformers' Conv1D: nf
        return width // self.parts // getattr(module, self.head_dim)

    def __str__(self) -> str:
        parts = f" / {self.parts} parts" if self.parts > 1 else ""
        return f"{self.projection} outputs{parts} / {self.head_dim}"


@dataclass(frozen=True)
class AttentionSite:
    """A module that computes q, k, v and calls transformers' attention interface. ``heads``: its head-count
    attribute, or :class:`HeadsOf` where it holds none. ``kv_input``: for cross-attention, the forward argument
    carrying the other (replicated) sequence that keys and values come from. ``bias_method``: the method that
    computes a relative position bias from the query and key lengths (T5's ``compute_bias``), which must see the
    whole sequence's lengths. ``kv_heads``: the key/value head count where it differs from ``heads`` (grouped KV
    heads), as ``heads``. ``positions``: forward arguments carrying a tensor, or a tuple of tensors, per position of
    the whole sequence along dim 1 (rotary ``position_embeddings``), which sequence parallelism over sp cuts to this
    rank's chunk."""

    heads: str | HeadsOf
    kv_input: str | None = None
    bias_method: str | None = None
    kv_heads: str | HeadsOf | None = None
    positions: tuple[str, ...] = ()

    def head_counts(self, module) -> dict[str, int]:
        """``{"query": n}``, and ``"key/value"`` where the site names grouped KV heads, counted on ``module``."""
        def count(spec):
            return spec.count(module) if isinstance(spec, HeadsOf) else getattr(module, spec)

        counts = {"query": count(self.heads)}
        if self.kv_heads is not None:
            counts["key/value"] = count(self.kv_heads)
        return counts


@dataclass(frozen=True)
class MoESite:
    """A mixture-of-experts block: ``router`` (child path) computes which experts each token goes to and with what
    weight, and stays replicated (in the dtype the model computes it in); ``experts`` (child path) holds the experts,
    which tensor parallelism splits like an MLP (:class:`shardlib.parallel.experts.ExpertsTensorParallel`).
    ``capacity``: whether the router drops tokens past an expert's capacity counted along each whole sequence
    (Switch Transformers), which a sequence split over ranks or packed rows would change."""

    router: str
    experts: str
    capacity: bool = False


@dataclass(frozen=True, kw_only=True)
class Plan:
    """``styles``: pattern -> style or tuple of styles. ``divide_by_tp``: pattern -> integer attributes that become
    their per-rank value (head counts, widths). ``trunk``: the repeated layer stacks (ModuleLists), in forward
    order (:class:`Stack`), for pipeline stages and sequence parallelism. ``loss``: vocab-parallel loss, if the
    model has a vocab head. ``sequence_dropout``: patterns of the dropout modules inside the layers that act on
    sequence-sharded activations under sequence parallelism (they then draw per-rank masks). ``attention``:
    pattern -> :class:`AttentionSite` for the modules that call transformers' attention interface (all-to-all
    sequence parallelism wraps that call and splits their heads over the sp ranks). ``fused_projections``:
    pattern -> names of the child linears of each matched module that read the same input (q, k, v), which the
    fused-QKV kernel computes with one GEMM. ``epilogues``: kernel kind ("bias_gelu", "dropout_add") -> patterns
    of the modules it applies to (:mod:`shardlib.kernels.epilogues`). ``loss_items``: what the model's own loss
    averages over (:class:`LossItems`; every example by default). ``document_pool``: the module whose input's first
    token the head reads for the whole sequence (BERT's pooler), which packed rows feed each document's first token
    (:mod:`shardlib.sharding.documents`); None: the head cannot pool per document. ``moe``: pattern ->
    :class:`MoESite` for the mixture-of-experts blocks (:mod:`shardlib.sharding.experts`)."""

    styles: dict[str, Style | tuple[Style, ...]]
    divide_by_tp: dict[str, tuple[str, ...]] = field(default_factory=dict)
    trunk: tuple[Stack, ...] = ()
    loss: LossSpec | None = None
    sequence_dropout: tuple[str, ...] = ()
    attention: dict[str, AttentionSite] = field(default_factory=dict)
    fused_projections: dict[str, tuple[str, ...]] = field(default_factory=dict)
    epilogues: dict[str, tuple[str, ...]] = field(default_factory=dict)
    loss_items: LossItems = EXAMPLES
    document_pool: str | None = None
    moe: dict[str, MoESite] = field(default_factory=dict)


@lru_cache(maxsize=None)
def compile_pattern(pattern: str) -> re.Pattern:
    atoms = pattern.split(".")
    regex = ""
    for i, atom in enumerate(atoms):
        if atom == "**":
            if i == len(atoms) - 1:
                regex += r"(?:\.[^.]+)*" if i else r".*"
            else:
                regex += (r"\." if i else "") + r"(?:[^.]+\.)*"
            continue
        if i and atoms[i - 1] != "**":
            regex += r"\."
        regex += re.escape(atom).replace(r"\*", r"[^.]+")
    return re.compile(regex)


def match_modules(pattern: str, paths) -> list[str]:
    rx = compile_pattern(pattern)
    return [p for p in paths if rx.fullmatch(p)]
