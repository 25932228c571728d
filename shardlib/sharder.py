"""The generic sharder: validate a plan against a model and a mesh, then rewrite the model in place.

Everything is checked before anything changes: a pattern that matches no module, a style on the wrong module
type, a width or head count that tp does not divide, tied parameters that would get different layouts. All
problems are reported together in one :class:`PlanError`, and the model is left untouched.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from . import pipeline
from .kernels import Kernels
from .kernels.attention import (
    CONTEXT_ATTR, AllToAllContext, all_to_all_name, local_rng_name, set_attention, whole_sequence_bias,
)
from .collectives import all_reduce
from .layout import LAYOUTS_ATTR, Layout, layout_of, set_layout
from .losses import install_vocab_parallel_loss
from .mesh import Mesh
from .plan import Plan, PlanError, match_modules
from .random import LOCAL_STREAM_ATTR, RNGStatesTracker, rng_streams
from .sequence import ReplicatedGradSync, SequenceParallel
from .sharded import ShardState, shard_state
from .styles import (
    ColwiseParallel, CopyInputs, LocalRNG, RowwiseParallel, ShardContext, VocabParallel, as_tuple, style_name,
)

log = logging.getLogger("shardlib")

_PARAM_STYLES = (ColwiseParallel, RowwiseParallel, VocabParallel)


@dataclass
class ReportRow:
    module: str
    style: str
    tensors: list[tuple[str, tuple[int, ...], tuple[int, ...], str]]  # name, global shape, local shape, layout


@dataclass
class ShardReport:
    """Every rewrite the sharder made on this rank, and the parameter bytes per rank before and after."""

    policy: str
    model_class: str
    mesh: str
    rows: list[ReportRow] = field(default_factory=list)
    attributes: list[tuple[str, str, int, int]] = field(default_factory=list)  # module, attr, before, after
    kernels: list[tuple[str, int]] = field(default_factory=list)  # fused kernel, modules it was installed on
    unsharded_bytes: int = 0
    local_bytes: int = 0

    def __str__(self) -> str:
        lines = [f"shardlib: {self.model_class} with policy '{self.policy}' on {self.mesh}"]
        lines.append(f"{'module':<56} {'style':<44} {'tensor':<7} {'global':>14} {'local':>14}")
        for row in self.rows:
            if not row.tensors:
                lines.append(f"{row.module:<56} {row.style:<44}")
            for i, (name, glob, loc, _) in enumerate(row.tensors):
                mod, sty = (row.module, row.style) if i == 0 else ("", "")
                lines.append(f"{mod:<56} {sty:<44} {name:<7} {_shape(glob):>14} {_shape(loc):>14}")
        for module, attr, before, after in self.attributes:
            lines.append(f"{module:<56} {'attribute ' + attr:<44} {before:>7} -> {after}")
        for kind, count in self.kernels:
            lines.append(f"{'kernel ' + kind:<56} installed on {count} modules")
        ratio = self.local_bytes / self.unsharded_bytes if self.unsharded_bytes else 1.0
        lines.append(
            f"parameter bytes per rank: {_mib(self.local_bytes)} (unsharded {_mib(self.unsharded_bytes)}, "
            f"{ratio:.3f}x)"
        )
        return "\n".join(lines)


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values())


def _resolve(plan: Plan, model: nn.Module, tp: int):
    """Match every pattern and collect all problems. Returns ({path: styles}, {path: attrs}) in module order."""
    modules = dict(model.named_modules())
    problems: list[str] = []
    assigned: dict[str, tuple] = {}
    for pattern, styles in plan.styles.items():
        matches = match_modules(pattern, modules)
        if not matches:
            problems.append(f"pattern {pattern!r} matches no module of {type(model).__name__}")
        for path in matches:
            for style in as_tuple(styles):
                problems += style.check(path, modules[path], tp)
            assigned[path] = assigned.get(path, ()) + as_tuple(styles)
    attrs: dict[str, tuple[str, ...]] = {}
    for pattern, names in plan.divide_by_tp.items():
        matches = match_modules(pattern, modules)
        if not matches:
            problems.append(f"attribute pattern {pattern!r} matches no module of {type(model).__name__}")
        for path in matches:
            for name in names:
                value = getattr(modules[path], name, None)
                if not isinstance(value, int):
                    problems.append(f"{path}.{name}: expected an integer attribute, found {value!r}")
                elif value % tp:
                    problems.append(f"{path}.{name} = {value} is not divisible by tp={tp}")
            attrs[path] = names
    for path, styles in assigned.items():
        if sum(isinstance(s, _PARAM_STYLES) for s in styles) > 1:
            problems.append(f"{path}: more than one parameter style ({', '.join(map(style_name, styles))})")
        if LAYOUTS_ATTR in modules[path].__dict__:
            problems.append(f"{path}: already sharded")
    if plan.loss is not None:
        head = plan.loss.head
        if not any(isinstance(s, VocabParallel) for s in assigned.get(head, ())):
            problems.append(f"loss head {head!r} must be styled VocabParallel in the plan")
    order = {path: i for i, path in enumerate(modules)}
    return dict(sorted(assigned.items(), key=lambda kv: order[kv[0]])), attrs, problems


def _tied_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Parameters held by more than one (module path, attribute): the ties to restore after rewriting."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((path, name))
    return [h for h in holders.values() if len(set(h)) > 1]


def _check_ties(ties, assigned, model) -> list[str]:
    """Tied holders must agree: one parameter style for all, and no plain Linear / Embedding left to run a
    sharded tensor as if it were whole. Other unstyled holders (e.g. a head's ``bias`` alias) are re-pointed."""
    problems = []
    for group in ties:
        names = ", ".join(f"{p}.{n}" for p, n in group)
        kinds = {type(s).__name__ for p, _ in group for s in assigned.get(p, ()) if isinstance(s, _PARAM_STYLES)}
        if len(kinds) > 1:
            problems.append(f"tied parameters {names} would get different styles ({', '.join(sorted(kinds))})")
        if kinds:
            for path, _ in group:
                module = model.get_submodule(path)
                if isinstance(module, (nn.Linear, nn.Embedding)) and not any(
                    isinstance(s, _PARAM_STYLES) for s in assigned.get(path, ())
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


def shard(
    model: nn.Module,
    mesh: Mesh,
    policy=None,
    *,
    gather_logits: bool | None = None,
    rng_tracker: RNGStatesTracker | None = None,
    check_replicated_inputs: bool = False,
    stages_per_rank: int = 1,
    layers_per_stage: list[int] | None = None,
    sequence_parallel: bool | str = False,
    kernels: Kernels | None = None,
) -> nn.Module:
    """Shard ``model`` in place over ``mesh``'s tensor-parallel dim and return it.

    ``policy``: defaults to the registered policy for the model class (``shardlib.policies``).
    ``gather_logits``: see :mod:`shardlib.losses` (None: gather only when no labels are passed).
    ``rng_tracker``: the per-rank dropout stream for sharded activations (default: seeded from the current default
    generator state, which must be identical on all ranks: call ``torch.manual_seed`` first).
    ``check_replicated_inputs``: verify at every forward that the tensor inputs are identical across the TP group
    (one small all-reduce; catches silently wrong results from divergent inputs).

    ``sequence_parallel``: ``True``: Megatron sequence parallelism on the TP group inside the policy's layer stacks
    (:mod:`shardlib.sequence`): norms, dropout and residuals on 1/tp of the sequence; any sequence length.
    ``"all_to_all"``: Ulysses sequence parallelism over the mesh's ``sp`` dimension: every activation inside the
    stacks holds 1/sp of the sequence, attention exchanges sequence for heads (:mod:`shardlib.kernels.attention`).

    ``kernels``: which fused kernels to use (:class:`shardlib.kernels.Kernels`; default: the fastest measured).

    Pipeline (``mesh.pp > 1``): the model is cut into ``mesh.pp * stages_per_rank`` stages from the policy's trunk
    (:mod:`shardlib.pipeline`; balanced by a cost model unless ``layers_per_stage`` gives the layer counts), this
    rank keeps its stages (``shard_state(model).pipeline``) and frees the rest; run it with
    :class:`shardlib.runtime.Trainer`.

    The report of every rewrite is ``shard_state(model).report`` (also ``shardlib.report(model)``).
    """
    from shardlib.policies import policy_for

    if shard_state(model, required=False) is not None:
        raise PlanError(f"{type(model).__name__} is already sharded")
    policy = policy or policy_for(model)
    tp, group = mesh.tp, mesh.tp_group if mesh.tp > 1 else None
    plan = policy.plan(model, tp)
    assigned, attrs, problems = _resolve(plan, model, tp)
    ties = _tied_groups(model)
    problems += _check_ties(ties, assigned, model)
    pp = getattr(mesh, "pp", 1)
    stage_plan = None
    if stages_per_rank > 1 and pp == 1:
        problems.append(f"stages_per_rank={stages_per_rank} needs a pipeline (mesh pp > 1)")
    elif pp > 1:
        try:
            stage_plan = pipeline.stage_plan(model, plan.trunk, pp * stages_per_rank, layers_per_stage)
        except PlanError as e:
            problems.append(str(e))
    kernels = kernels or Kernels()
    problems += kernels.problems(plan, model)
    mode = _sequence_mode(sequence_parallel, problems)
    sp_size = getattr(mesh, "sp", 1)
    if mode is not None:
        problems += _sequence_parallel_problems(plan, model)
    if mode == ALL_TO_ALL:
        problems += _all_to_all_problems(plan, model, tp, sp_size)
    elif sp_size > 1:
        problems.append(f"the mesh has sp={sp_size} ranks per sequence but sequence_parallel={sequence_parallel!r}; "
                        "pass sequence_parallel='all_to_all'")
    if problems:
        raise PlanError(
            f"cannot shard {type(model).__name__} with policy '{policy.name}' at tp={tp}, pp={pp}"
            + (f", sp={sp_size}" if sp_size > 1 else "") + ":\n  "
            + "\n  ".join(problems)
        )

    if rng_tracker is None:
        rng_tracker = rng_streams(RNGStatesTracker(), torch.initial_seed(), mesh)
    report = ShardReport(policy=policy.name, model_class=type(model).__name__, mesh=str(mesh))
    report.unsharded_bytes = _param_bytes(model.parameters())
    ctx = ShardContext(group=group, tp=tp, rank=mesh.tp_rank, rng_tracker=rng_tracker)
    sp = SequenceParallel(group, tp) if mode == MEGATRON and tp > 1 else None
    set_attention(model, kernels.attention)
    for path, styles in assigned.items():
        module = model.get_submodule(path)
        stack = _stack_of(plan, path) if sp is not None else None
        style_ctx = ctx if stack is None else replace(ctx, sequence=sp.stream(stack))
        for style in styles:
            module = style.apply(path, module, style_ctx)
        if path:
            _set_submodule(model, path, module)
        tensors = [
            (name, layout_of(module, name).global_shape, tuple(p.shape), layout_of(module, name).describe())
            for name, p in module.named_parameters(recurse=False)
        ] if isinstance(module, (nn.Linear, nn.Embedding)) else []
        report.rows.append(ReportRow(path, " + ".join(style_name(s) for s in styles), tensors))
    _retie(model, ties)
    if any(LOCAL_STREAM_ATTR in m.__dict__ for m in model.modules()):
        set_attention(model, local_rng_name(model.config._attn_implementation))
    for path, names in attrs.items():
        module = model.get_submodule(path)
        for name in names:
            before = getattr(module, name)
            setattr(module, name, before // tp)
            report.attributes.append((path, name, before, before // tp))
    for kind, paths in kernels.install(plan, model).items():
        report.kernels.append((kind, len(paths)))
    if sp is not None:
        _install_sequence_parallel(model, plan, sp, ctx)
    if mode == ALL_TO_ALL:
        sp = SequenceParallel(mesh.group("sp"), sp_size)
        _install_sequence_parallel(model, plan, sp, ctx, all_to_all=True)
        _install_all_to_all_attention(model, plan, sp, model.config._attn_implementation)
    if plan.loss is not None:
        install_vocab_parallel_loss(model, plan.loss, gather_logits)
    if check_replicated_inputs and tp > 1:
        model.register_forward_pre_hook(_replicated_input_check(group), with_kwargs=True)
    split = None
    if stage_plan is not None:
        split = pipeline.PipelineSplit(model, plan.trunk, stage_plan, mesh, stages_per_rank)
        if sp is not None:
            split.sequence, sp.saving_managed_outside = sp, True
    report.local_bytes = _param_bytes(split.local_parameters() if split else model.parameters())
    ShardState(mesh=mesh, policy=policy, plan=plan, report=report, rng_tracker=rng_tracker,
               pipeline=split).attach(model)
    log.info("%s", report)
    return model


def _stack_of(plan: Plan, path: str) -> int | None:
    """The index of the trunk stack whose layers contain module ``path``."""
    return next((k for k, stack in enumerate(plan.trunk) if path.startswith(stack.layers + ".")), None)


MEGATRON, ALL_TO_ALL = "megatron", "all_to_all"


def _sequence_mode(value, problems: list[str]) -> str | None:
    """``sequence_parallel`` as None / MEGATRON / ALL_TO_ALL."""
    if value is False or value is None:
        return None
    if value is True or value == MEGATRON:
        return MEGATRON
    if value == ALL_TO_ALL:
        return ALL_TO_ALL
    problems.append(f"sequence_parallel={value!r}: expected False, True (Megatron, on the TP group) or "
                    f"'{ALL_TO_ALL}' (Ulysses, on the mesh's sp dimension)")
    return None


def _all_to_all_problems(plan: Plan, model: nn.Module, tp: int, sp: int) -> list[str]:
    name = type(model).__name__
    if sp < 2:
        return [f"sequence_parallel='{ALL_TO_ALL}' needs a mesh with sp > 1 ranks per sequence "
                "(init_mesh(..., sp=N)); this mesh has sp=1"]
    if not plan.attention:
        return [f"the policy of {name} lists no attention modules (Plan.attention) that all-to-all sequence "
                "parallelism can wrap (docs/sequence-parallel.md says which models support it)"]
    modules = dict(model.named_modules())
    problems = []
    for pattern, site in plan.attention.items():
        matches = match_modules(pattern, modules)
        if not matches:
            problems.append(f"attention pattern {pattern!r} matches no module of {name}")
        for path in matches:
            if site.kv_input and site.kv_input not in inspect.signature(modules[path].forward).parameters:
                problems.append(f"{path}: forward has no argument {site.kv_input!r} (AttentionSite.kv_input)")
            heads = getattr(modules[path], site.heads)
            if heads % (tp * sp):
                problems.append(f"{path}.{site.heads} = {heads} is not divisible by tp({tp}) * sp({sp}) = {tp * sp}:"
                                " all-to-all gives each sp rank whole heads")
    return problems


def _install_all_to_all_attention(model: nn.Module, plan: Plan, sp: SequenceParallel, implementation: str) -> None:
    """Each attention module calls all-to-all attention around ``implementation`` with its stack's stream;
    cross-attention inputs enter the sp region (backward: their gradient, from this rank's heads only, is summed);
    relative position biases are computed for the whole sequence."""
    modules = dict(model.named_modules())
    rank = dist.get_rank(sp.group)
    for pattern, site in plan.attention.items():
        for path in match_modules(pattern, modules):
            module, stream = modules[path], sp.stream(_stack_of(plan, path))
            module.__dict__[CONTEXT_ATTR] = AllToAllContext(sp.group, rank, stream, implementation,
                                                            cross=site.kv_input is not None)
            if site.kv_input is not None:
                CopyInputs(site.kv_input).apply(path, module, ShardContext(group=sp.group, tp=sp.size))
            if site.bias_method is not None:
                setattr(module, site.bias_method, whole_sequence_bias(getattr(module, site.bias_method), stream))
    set_attention(model, all_to_all_name(implementation))


def _sequence_parallel_problems(plan: Plan, model: nn.Module) -> list[str]:
    problems = []
    if not plan.trunk:
        problems.append("sequence_parallel needs the policy's layer trunk (Plan.trunk)")
    paths = [p for p, _ in model.named_modules()]
    for pattern in plan.sequence_dropout:
        matches = match_modules(pattern, paths)
        if not matches:
            problems.append(f"sequence_dropout pattern {pattern!r} matches no module of {type(model).__name__}")
        problems += [f"{p}: sequence_dropout applies to nn.Dropout, found {type(model.get_submodule(p)).__name__}"
                     for p in matches if not isinstance(model.get_submodule(p), nn.Dropout)]
    return problems


def _install_sequence_parallel(model: nn.Module, plan: Plan, sp: SequenceParallel, ctx: ShardContext, *,
                               all_to_all: bool = False) -> None:
    """Scatter the sequence at each stack's first layer and gather it after the last; per-rank dropout streams on
    sequence-sharded activations; one all-reduce over the sequence group of the gradient of every parameter in the
    layers that the group replicates (Megatron: the TP-replicated ones; all-to-all: all)."""
    paths = [p for p, _ in model.named_modules()]
    stream = "sequence-parallel" if all_to_all else "tensor-parallel"
    for pattern in plan.sequence_dropout:
        for path in match_modules(pattern, paths):
            LocalRNG(stream=stream).apply(path, model.get_submodule(path), ctx)
    grad_sync = ReplicatedGradSync(sp.group, tp_sharded_too=all_to_all)
    for k, stack in enumerate(plan.trunk):
        layers = list(model.get_submodule(stack.layers)._modules.values())
        if not layers:
            continue
        seq, saving = sp.stream(k), []

        def enter(mod, args, kwargs, _s=seq, _saving=saving):
            if not sp.saving_managed_outside and not torch.compiler.is_compiling():
                _saving.append(sp.saving_shards())
                _saving[-1].__enter__()
            return (_s.enter(args[0]), *args[1:]), kwargs

        def leave(mod, args, out, _s=seq, _saving=saving):
            if _saving:
                _saving.pop().__exit__(None, None, None)
            return _s.leave(out) if isinstance(out, torch.Tensor) else (_s.leave(out[0]), *out[1:])

        def close(mod, args, out, _saving=saving):  # the stack's owner returned or raised (maybe in a middle layer)
            while _saving:
                _saving.pop().__exit__(None, None, None)

        layers[0].register_forward_pre_hook(enter, with_kwargs=True)
        layers[-1].register_forward_hook(leave, always_call=True)
        owner = stack.layers.rpartition(".")[0]
        (model.get_submodule(owner) if owner else model).register_forward_hook(close, always_call=True)
        for layer in layers:
            grad_sync(layer)
            layer.register_forward_pre_hook(grad_sync)


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


def report(model: nn.Module) -> ShardReport:
    """The :class:`ShardReport` of a sharded model."""
    return shard_state(model).report


__all__ = ["shard", "report", "ShardReport", "ShardState", "PlanError", "Layout"]
