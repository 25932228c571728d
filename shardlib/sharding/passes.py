"""``shard()`` as a sequence of passes over a resolved plan.

:class:`Resolved` is a plan matched against one model and mesh: every pattern is resolved to module paths once,
through one check that reports a pattern matching no module. Each feature is a pass with two methods:

* ``problems(r) -> list[str]``: everything that stops it, found before anything changes (``shard`` reports the
  problems of all passes together in one PlanError and leaves the model untouched);
* ``install(r)``: the rewrite, in pass order, recording what it did in ``r.report`` (and ``prepare(r)``, optional:
  state that any install may read, run for every pass before the first install).

``shard`` runs every pass's ``problems`` before the first ``prepare`` / ``install``, and the installs inside a
transaction that restores the model if one raises (:mod:`shardlib.sharding.transaction`). So a pass's checks must
not change the model, and an install may replace anything a module holds (children, parameters, attributes, hooks,
its class) and write its config, but must not write tensor data in place (that could not be undone).

Adding a feature (context parallelism, say) is adding a pass to :func:`passes_for`; no other pass changes. The
passes: tensor-parallel styles with ties and attributes (:class:`TensorParallel`), fused kernels
(:class:`KernelsPass`), Megatron sequence parallelism (``shardlib.sharding.sequence.MegatronSequenceParallel``),
all-to-all sequence parallelism (``shardlib.sharding.all_to_all.AllToAllSequenceParallel``), ring attention
(``shardlib.sharding.ring.RingSequenceParallel``), the per-position attention inputs both cut to each sp rank's
chunk (``shardlib.sharding.positions.SequencePositions``), the vocab-parallel loss (:class:`VocabParallelLoss`),
the replicated-input check (:class:`ReplicatedInputCheck`) and the pipeline split (:class:`PipelinePass`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from .. import pipeline
from ..kernels import Kernels
from ..kernels.attention import (
    IMPLEMENTATIONS, base_implementation, local_rng_name, own_configs, registered_problems, set_attention,
)
from ..kernels.block_attention import blocks_name
from ..parallel.collectives import all_reduce
from ..parallel.layout import LAYOUTS_ATTR, layout_of, set_layout
from ..parallel.random import LOCAL_STREAM_ATTR
from ..parallel.styles import ColwiseParallel, RowwiseParallel, ShardContext, VocabParallel, as_tuple, style_name
from .adapters import adapter_problems, is_lora_layer, shard_adapted, styled_module
from .all_to_all import AllToAllSequenceParallel
from .experts import MixtureOfExperts, moe_blocks
from .losses import LOSSES, install_vocab_parallel_loss
from .plan import Plan, PlanError, match_modules
from .positions import SequencePositions
from .ring import RingSequenceParallel
from .sequence import ALL_TO_ALL, MEGATRON, RING, SP_MODES, MegatronSequenceParallel, SequenceParallel
from .shard_report import ReportRow

PARAM_STYLES = (ColwiseParallel, RowwiseParallel, VocabParallel)


@dataclass
class Resolved:
    """A plan matched against one model and mesh, and the options of this ``shard`` call."""

    model: nn.Module
    mesh: object
    plan: Plan
    options: dict
    report: object  # shardlib.sharding.shard_report.ShardReport
    modules: dict[str, nn.Module] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    _matches: dict = field(default_factory=dict)
    #: set while installing: the sequence-parallel state (Megatron: the styles route their collectives through it)
    sequence: SequenceParallel | None = None
    #: set by the pipeline pass: this rank's stages
    split: pipeline.PipelineSplit | None = None

    def __post_init__(self):
        self.modules = dict(self.model.named_modules())

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def group(self):
        return self.mesh.tp_group if self.mesh.tp > 1 else None

    @property
    def name(self) -> str:
        return type(self.model).__name__

    def match(self, pattern: str, kind: str = "") -> list[str]:
        """The module paths ``pattern`` matches, in model order; a pattern that matches none is a problem (once)."""
        if pattern not in self._matches:
            self._matches[pattern] = match_modules(pattern, self.modules)
            if not self._matches[pattern]:
                self.problems.append(f"{kind + ' ' if kind else ''}pattern {pattern!r} matches no module of "
                                     f"{self.name}")
        return self._matches[pattern]

    def stack_of(self, path: str) -> int | None:
        """The index of the trunk stack whose layers contain module ``path``."""
        return next((k for k, stack in enumerate(self.plan.trunk) if path.startswith(stack.layers + ".")), None)

    def shard_context(self, path: str) -> ShardContext:
        """What a style needs at ``path``: under Megatron sequence parallelism, the sequence stream of its stack,
        except inside a mixture-of-experts block, which runs on the whole sequence (:mod:`.experts`)."""
        ctx = ShardContext(group=self.group, tp=self.tp, rank=self.mesh.tp_rank,
                           rng_tracker=self.options["rng_tracker"])
        stack = self.stack_of(path) if self.sequence is not None else None
        if stack is None or any(path == b or path.startswith(b + ".") for b in moe_blocks(self)):
            return ctx
        return replace(ctx, sequence=self.sequence.stream(stack))


# --------------------------------------------------------------------------------------------- tensor parallel
class TensorParallel:
    """The plan's styles (column / row / vocab parallel linears and embeddings, input copies, per-rank RNG),
    restored parameter ties, and the attributes divided by tp (head counts)."""

    def __init__(self, r: Resolved):
        self.assigned: dict[str, tuple] = {}
        self.attrs: dict[str, tuple[str, ...]] = {}
        self.ties = _tied_groups(r.model)

    def problems(self, r: Resolved) -> list[str]:
        problems = []
        for pattern, styles in r.plan.styles.items():
            for path in r.match(pattern):
                module = r.modules[path]
                for style in as_tuple(styles):
                    problems += style.check(path, styled_module(module, style), r.tp)
                problems += adapter_problems(path, module, as_tuple(styles), r)
                self.assigned[path] = self.assigned.get(path, ()) + as_tuple(styles)
        for pattern, names in r.plan.divide_by_tp.items():
            for path in r.match(pattern, "attribute"):
                problems += _attribute_problems(path, r.modules[path], names, r.tp)
                self.attrs[path] = names
        for path, styles in self.assigned.items():
            if sum(isinstance(s, PARAM_STYLES) for s in styles) > 1:
                problems.append(f"{path}: more than one parameter style ({', '.join(map(style_name, styles))})")
            if LAYOUTS_ATTR in r.modules[path].__dict__:
                problems.append(f"{path}: already sharded")
        order = {path: i for i, path in enumerate(r.modules)}
        self.assigned = dict(sorted(self.assigned.items(), key=lambda kv: order[kv[0]]))
        return problems + _tie_problems(self.ties, self.assigned, r.model)

    def install(self, r: Resolved) -> None:
        for path, styles in self.assigned.items():
            module = r.modules[path]
            for style in styles:
                ctx = r.shard_context(path)
                adapted = styled_module(module, style) is not module
                module = shard_adapted(path, module, style, ctx) if adapted else style.apply(path, module, ctx)
            if path:
                _set_submodule(r.model, path, module)
            tensors = [
                (name, layout_of(module, name).global_shape, tuple(p.shape), layout_of(module, name).describe())
                for name, p in module.named_parameters(recurse=is_lora_layer(module))
            ] if isinstance(module, (nn.Linear, nn.Embedding)) or is_lora_layer(module) else []
            r.report.rows.append(ReportRow(path, " + ".join(style_name(s) for s in styles), tensors))
        _retie(r.model, self.ties)
        if any(LOCAL_STREAM_ATTR in m.__dict__ for m in r.model.modules()):  # per-rank attention dropout
            set_attention(r.model, local_rng_name(r.model.config._attn_implementation))
        for path, names in self.attrs.items():
            module = r.model.get_submodule(path)
            for name in names:
                before = getattr(module, name)
                setattr(module, name, before // r.tp)
                r.report.attributes.append((path, name, before, before // r.tp))


def _attribute_problems(path: str, module: nn.Module, names, tp: int) -> list[str]:
    problems = []
    for name in names:
        value = getattr(module, name, None)
        if not isinstance(value, int):
            problems.append(f"{path}.{name}: expected an integer attribute, found {value!r}")
        elif value % tp:
            problems.append(f"{path}.{name} = {value} is not divisible by tp={tp}")
    return problems


def _tied_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Parameters held by more than one (module path, attribute): the ties to restore after rewriting."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((path, name))
    return [h for h in holders.values() if len(set(h)) > 1]


def _tie_problems(ties, assigned, model) -> list[str]:
    """Tied holders must agree: one parameter style for all, and no plain Linear / Embedding left to run a
    sharded tensor as if it were whole. Other unstyled holders (e.g. a head's ``bias`` alias) are re-pointed."""
    problems = []
    for group in ties:
        names = ", ".join(f"{p}.{n}" for p, n in group)
        kinds = {type(s).__name__ for p, _ in group for s in assigned.get(p, ()) if isinstance(s, PARAM_STYLES)}
        if len(kinds) > 1:
            problems.append(f"tied parameters {names} would get different styles ({', '.join(sorted(kinds))})")
        if kinds:
            for path, _ in group:
                module = model.get_submodule(path)
                if isinstance(module, (nn.Linear, nn.Embedding)) and not any(
                    isinstance(s, PARAM_STYLES) for s in assigned.get(path, ())
                ):
                    problems.append(f"{path} shares a parameter with a sharded module ({names}) but has no "
                                    f"parameter style; give it the same style ({', '.join(sorted(kinds))})")
    return problems


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)


def _retie(model: nn.Module, ties) -> None:
    for group in ties:
        sharded = [(p, n) for p, n in group if n in model.get_submodule(p).__dict__.get(LAYOUTS_ATTR, {})]
        if not sharded:
            continue
        src_path, src_name = sharded[0]
        src_module = model.get_submodule(src_path)
        param, layout = src_module._parameters[src_name], src_module.__dict__[LAYOUTS_ATTR][src_name]
        for path, name in group:
            other = model.get_submodule(path)
            other_layout = other.__dict__.get(LAYOUTS_ATTR, {}).get(name)
            if other_layout is not None and other_layout != layout:
                raise PlanError(f"tied {src_path}.{src_name} and {path}.{name} got layouts {layout} / {other_layout}")
            other._parameters[name] = param
            set_layout(other, name, layout)


# ---------------------------------------------------------------------------------------------- smaller passes
class KernelsPass:
    """The attention implementation (``prepare``, before any install, so that later wrappers wrap it) and the fused
    kernels (``install``, after the styles: they fuse the sharded linears)."""

    def __init__(self, kernels: Kernels):
        self.kernels = kernels

    def problems(self, r: Resolved) -> list[str]:
        own = getattr(r.model.config, "_attn_implementation", None)
        implementation = self.kernels.attention or own
        problems = []
        if implementation == "blocks":
            implementation = own
            if base_implementation(own) not in IMPLEMENTATIONS:
                problems.append(f"{r.name}: Kernels(attention='blocks') keeps the mask semantics of "
                                f"{' or '.join(IMPLEMENTATIONS)}; the model runs {own!r} (attn_implementation='sdpa')")
        return (problems + self.kernels.problems(kernel_sites(self.kernels, r.plan, r.modules))
                + registered_problems(r.name, implementation))

    def prepare(self, r: Resolved) -> None:
        own_configs(r.model)  # the attention switches below and later write to the config: not to a shared one
        chosen = self.kernels.attention
        if chosen == "blocks":  # block attention around the model's own implementation (its mask semantics)
            chosen = blocks_name(r.model.config._attn_implementation or "sdpa")
        set_attention(r.model, chosen)

    def install(self, r: Resolved) -> None:
        sites = list(kernel_sites(self.kernels, r.plan, dict(r.model.named_modules())))  # the sharded modules
        for kind, paths in self.kernels.install(sites).items():
            r.report.kernels.append((kind, len(paths)))


def kernel_sites(kernels: Kernels, plan: Plan, modules: dict[str, nn.Module]):
    """(kind, path, module, child linear names or None) of every module a switched-on kernel goes to; a kernel's
    pattern that matches no module is no problem (the kernel is optional where the plan lists it)."""
    if kernels.fused_qkv:
        for pattern, names in plan.fused_projections.items():
            for path in match_modules(pattern, modules):
                yield "fused_qkv", path, modules[path], names
    for kind in ("bias_gelu", "dropout_add"):
        if getattr(kernels, kind):
            for pattern in plan.epilogues.get(kind, ()):
                for path in match_modules(pattern, modules):
                    yield kind, path, modules[path], None


class VocabParallelLoss:
    """The model's own loss recomputed on vocab-sharded logits (:mod:`shardlib.sharding.losses`)."""

    def problems(self, r: Resolved) -> list[str]:
        spec = r.plan.loss
        problems = []
        if spec.kind not in LOSSES:
            problems.append(f"loss kind {spec.kind!r} is not one of {', '.join(sorted(LOSSES))}")
        head_styles = [s for pattern, styles in r.plan.styles.items() if spec.head in r.match(pattern)
                       for s in as_tuple(styles)]
        if not any(isinstance(s, VocabParallel) for s in head_styles):
            problems.append(f"loss head {spec.head!r} must be styled VocabParallel in the plan")
        return problems

    def install(self, r: Resolved) -> None:
        if r.tp > 1:  # a world of one keeps the model's own loss: the vocabulary is not split
            install_vocab_parallel_loss(r.model, r.plan.loss, r.options["gather_logits"])


class ReplicatedInputCheck:
    """At every forward, verify that the tensor inputs are identical across the TP group (one small all-reduce)."""

    def problems(self, r: Resolved) -> list[str]:
        return []

    def install(self, r: Resolved) -> None:
        r.model.register_forward_pre_hook(_replicated_input_check(r.group), with_kwargs=True)


def _replicated_input_check(group):
    def check(module, args, kwargs):
        named = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
        tensors = [(n, t) for n, t in named if isinstance(t, torch.Tensor)]
        if not tensors:
            return None
        sig = torch.stack([t.detach().double().sum() + t.detach().double().abs().sum() * 1e-3 for _, t in tensors])
        both = all_reduce(torch.cat([sig, -sig]), group, "max")
        hi, lo = both[: len(tensors)], -both[len(tensors):]
        differ = [n for (n, _), h, l in zip(tensors, hi, lo) if h != l]
        if differ:
            raise ValueError(
                f"inputs {', '.join(differ)} of {type(module).__name__} differ across the tensor-parallel group; "
                "every TP rank must get the same batch"
            )
        return None

    return check


class PipelinePass:
    """Cut the model into ``pp * stages_per_rank`` stages from the policy's trunk; this rank keeps its own."""

    def __init__(self):
        self.stage_plan = None

    def problems(self, r: Resolved) -> list[str]:
        stages_per_rank = r.options["stages_per_rank"]
        try:
            self.stage_plan = pipeline.stage_plan(r.model, r.plan.trunk, r.mesh.pp * stages_per_rank,
                                                  r.options["layers_per_stage"])
        except PlanError as e:
            return [str(e)]
        return []

    def install(self, r: Resolved) -> None:
        split = pipeline.PipelineSplit(r.model, r.plan.trunk, self.stage_plan, r.mesh, r.options["stages_per_rank"])
        if r.sequence is not None:
            split.sequence, r.sequence.saving_managed_outside = r.sequence, True
        r.split = split


def passes_for(r: Resolved) -> list:
    """The passes this ``shard`` call runs, in install order; problems of the options themselves go to
    ``r.problems``."""
    o, pp, sp = r.options, getattr(r.mesh, "pp", 1), getattr(r.mesh, "sp", 1)
    # the kernels' prepare() (the attention implementation) runs before any install; their install() fuses the
    # linears the styles made, so it comes after TensorParallel's
    passes: list = [TensorParallel(r), KernelsPass(o["kernels"] or Kernels())]
    mode = o["sequence_mode"]
    if mode == ALL_TO_ALL:
        passes.append(AllToAllSequenceParallel())
    elif mode == RING:
        passes.append(RingSequenceParallel())
    elif mode == MEGATRON:
        passes.append(MegatronSequenceParallel())
    if mode in SP_MODES and any(site.positions for site in r.plan.attention.values()):
        passes.append(SequencePositions())
    if o.get("ulysses", 1) != 1 and mode != RING:
        r.problems.append(f"ulysses={o['ulysses']} applies to sequence_parallel='ring' (Ulysses x ring), not to "
                          f"sequence_parallel={o['sequence_parallel']!r}")
    if mode not in SP_MODES and sp > 1:
        r.problems.append(f"the mesh has sp={sp} ranks per sequence but sequence_parallel={o['sequence_parallel']!r}; "
                          "pass sequence_parallel='all_to_all' or 'ring'")
    if r.plan.moe:
        passes.append(MixtureOfExperts())
    if r.plan.loss is not None:
        passes.append(VocabParallelLoss())
    if o["check_replicated_inputs"] and r.tp > 1:
        passes.append(ReplicatedInputCheck())
    if o["stages_per_rank"] > 1 and pp == 1:
        r.problems.append(f"stages_per_rank={o['stages_per_rank']} needs a pipeline (mesh pp > 1)")
    elif pp > 1:
        passes.append(PipelinePass())
    return passes
