"""Parallel styles: small keyword-only objects that say how one module is parallelized.

A plan maps module-path patterns to a style (or a tuple of styles). Each style checks a module before anything
changes (``check`` returns a list of problems, each naming the module and the numbers) and then rewrites it
(``apply`` returns the module that takes its place, possibly the same object with hooks added).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from .collectives import Group, copy_to_tp
from .layers import (
    UNSUPPORTED_EMBEDDING_OPTIONS, ColumnParallelEmbedding, ColumnParallelLinear, RowParallelLinear,
    VocabParallelEmbedding, is_conv1d, unsupported_embedding_options,
)
from .random import LOCAL_STREAM_ATTR, local_dropout


@dataclass
class ShardContext:
    """What a style needs to rewrite one module on this rank."""

    group: Group | None
    tp: int
    rank: int = 0
    rng_tracker: object | None = None
    sequence: object | None = None  # shardlib.sharding.sequence.SequenceStream inside a sequence-parallel layer stack

    @property
    def tp_args(self) -> dict:
        return {"tp_size": self.tp, "tp_rank": self.rank}


def class_path(cls: type) -> str:
    """``torch.nn.Linear``, ``peft.tuners.lora.layer.Linear``: a class named so that look-alikes are told apart
    (torch's own by their public path)."""
    module = cls.__module__
    if module.startswith("torch.nn.modules."):
        module = "torch.nn"
    return f"{module}.{cls.__qualname__}"


class Style:
    def check(self, path: str, module: nn.Module, tp: int) -> list[str]:
        return []

    def apply(self, path: str, module: nn.Module, ctx: ShardContext) -> nn.Module:
        raise NotImplementedError

    def _expect(self, path, module, kind) -> list[str]:
        if not isinstance(module, kind):
            return [f"{path}: {type(self).__name__} applies to {class_path(kind)}, found {class_path(type(module))}"]
        return []

    def _linear_dim_divides(self, path, module, attr: str, tp: int, blocks: int = 1) -> list[str]:
        """Problems with splitting ``module.<attr>`` (in_features / out_features of a Linear, or of transformers'
        Conv1D: ``nx`` / ``nf``) tp ways (in each of ``blocks`` equal blocks)."""
        if is_conv1d(module):
            size = module.nf if attr == "out_features" else module.nx
        elif problems := self._expect(path, module, nn.Linear):
            return problems
        else:
            size = getattr(module, attr)
        if size % (tp * blocks):
            return [f"{path}: {attr} {size} is not divisible by tp={tp}"
                    + (f" in each of its {blocks} fused blocks" if blocks > 1 else "")]
        return []

    def _embedding_options(self, path, module) -> list[str]:
        """An embedding whose options a sharded embedding cannot honour (``max_norm``, ``scale_grad_by_freq``,
        ``sparse``): found here, before any change, not half-way through the rewrite."""
        found = unsupported_embedding_options(module)
        if not found:
            return []
        return [f"{path}: {type(self).__name__} cannot shard an embedding with {', '.join(found)} "
                f"(sharded embeddings support none of {', '.join(UNSUPPORTED_EMBEDDING_OPTIONS)}): unset it"]


@dataclass(frozen=True, kw_only=True)
class ColwiseParallel(Style):
    """nn.Linear -> ColumnParallelLinear: output features split; copy the input into the TP region unless an
    enclosing :class:`CopyInputs` already did; optionally gather the output.
    nn.Embedding -> ColumnParallelEmbedding: the embedding dim split (as torch's ColwiseParallel does), e.g. a
    relative-position bias table [buckets, heads] split by head.
    ``blocks``: a fused projection whose output is that many equal blocks (GPT-2's ``c_attn``: q, k, v), each split
    by head, so that every rank computes q, k and v of the same heads. transformers' ``Conv1D`` is taken as a
    Linear."""

    copy_input: bool = True
    gather_output: bool = False
    blocks: int = 1

    def check(self, path, module, tp):
        if isinstance(module, nn.Embedding):
            problems = self._embedding_options(path, module)
            if module.embedding_dim % tp:
                problems.append(f"{path}: embedding_dim {module.embedding_dim} is not divisible by tp={tp}")
            return problems
        return self._linear_dim_divides(path, module, "out_features", tp, self.blocks)

    def apply(self, path, module, ctx):
        if isinstance(module, nn.Embedding):
            return ColumnParallelEmbedding(module, ctx.group, gather_output=self.gather_output, **ctx.tp_args)
        return ColumnParallelLinear(module, ctx.group, copy_input=self.copy_input, gather_output=self.gather_output,
                                    blocks=self.blocks, sequence=ctx.sequence, **ctx.tp_args)


@dataclass(frozen=True, kw_only=True)
class RowwiseParallel(Style):
    """nn.Linear (or transformers' Conv1D) -> RowParallelLinear: input features split (input already sharded), output
    all-reduced (under sequence parallelism: reduce-scattered along the sequence)."""

    def check(self, path, module, tp):
        return self._linear_dim_divides(path, module, "in_features", tp)

    def apply(self, path, module, ctx):
        return RowParallelLinear(module, ctx.group, sequence=ctx.sequence, **ctx.tp_args)


@dataclass(frozen=True, kw_only=True)
class VocabParallel(Style):
    """The vocabulary dimension split (padded to a multiple of tp): nn.Embedding -> VocabParallelEmbedding, an
    output head nn.Linear -> ColumnParallelLinear with padding whose logits stay vocab-sharded unless
    ``gather_output``. A head and an embedding that share their weight stay tied."""

    gather_output: bool = False

    def check(self, path, module, tp):
        if isinstance(module, nn.Embedding):
            return self._embedding_options(path, module)
        if isinstance(module, nn.Linear):
            return []
        return [f"{path}: VocabParallel applies to torch.nn.Embedding or torch.nn.Linear, found "
                f"{class_path(type(module))}"]

    def apply(self, path, module, ctx):
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding(module, ctx.group, **ctx.tp_args)
        return ColumnParallelLinear(module, ctx.group, copy_input=True, gather_output=self.gather_output, pad=True,
                                    **ctx.tp_args)


@dataclass(frozen=True)
class CopyInputs(Style):
    """Enter the TP region once at this module: the named replicated inputs go through ``copy_to_tp`` (forward
    identity, backward one all-reduce each), so the column linears inside need no copy of their own. Under
    sequence parallelism the ``sequence_inputs`` (default ``hidden_states``) arrive sequence-sharded and are
    all-gathered instead (backward: reduce-scatter); other inputs (encoder states for cross-attention) stay
    replicated."""

    names: tuple[str, ...]
    #: the inputs that carry the residual stream, sequence-sharded under sequence parallelism (all-gathered here)
    sequence_inputs: tuple[str, ...] = ("hidden_states",)

    def __init__(self, *names: str, sequence_inputs: tuple[str, ...] = ("hidden_states",)):
        object.__setattr__(self, "names", tuple(names))
        object.__setattr__(self, "sequence_inputs", tuple(sequence_inputs))

    def apply(self, path, module, ctx):
        if ctx.tp == 1:
            return module
        params = list(inspect.signature(module.forward).parameters)
        positions = {name: params.index(name) for name in self.names if name in params}
        names, group, sequence = self.names, ctx.group, ctx.sequence

        def enter(name, x):
            if sequence is not None and name in self.sequence_inputs:
                return sequence.gather(x)
            return copy_to_tp(x, group)

        def copy_inputs(mod, args, kwargs):
            args = list(args)
            for name in names:
                pos = positions.get(name)
                if pos is not None and pos < len(args):
                    if isinstance(args[pos], torch.Tensor):
                        args[pos] = enter(name, args[pos])
                elif isinstance(kwargs.get(name), torch.Tensor):
                    kwargs[name] = enter(name, kwargs[name])
            return tuple(args), kwargs

        module.register_forward_pre_hook(copy_inputs, with_kwargs=True)
        return module


@dataclass(frozen=True, kw_only=True)
class LocalRNG(Style):
    """The module's dropout acts on TP-sharded activations (e.g. attention probabilities of local heads): its random
    draws come from the per-rank "tensor-parallel" RNG stream so ranks draw different masks.

    Eager mode runs the module's forward with the stream swapped in as the default generator (hooks around it).
    Compiled code cannot swap generators (dynamo does not trace it), so there every ``nn.Dropout`` inside the module
    keeps this rank's share of a draw from the default generator (:func:`shardlib.parallel.random.local_dropout`, a
    forward
    hook replacing the output), and attention dropout does the same through the attention wrapper
    (:func:`shardlib.kernels.attention.call_attention`), which finds the stream on the module."""

    stream: str = "tensor-parallel"

    def apply(self, path, module, ctx):
        tracker, stream = ctx.rng_tracker, self.stream
        if tracker is None or _single_rank(tracker, stream):
            return module
        module.__dict__[LOCAL_STREAM_ATTR] = (tracker, stream)
        _eager_forward_inside(module, lambda: tracker.fork(stream))
        for sub in module.modules():
            if isinstance(sub, nn.Dropout):
                sub.register_forward_hook(_compiled_stream_dropout(tracker, stream))
        return module


@dataclass(frozen=True)
class ReplicatedRNG(Style):
    """The module's random draws act on replicated activations although an enclosing module runs on a per-rank
    stream (``LocalRNG``): in eager mode it draws from the shared default generator the enclosing fork swapped out
    (:meth:`~shardlib.parallel.random.RNGStatesTracker.replicated`), so every rank draws the same mask. Compiled
    code never swaps generators, so there it draws from the shared one anyway; the module must not carry the
    enclosing ``LocalRNG``'s compiled-mode dropout hook (apply this to a module that does not)."""

    def apply(self, path, module, ctx):
        tracker = ctx.rng_tracker
        if tracker is not None and not _single_rank(tracker, "tensor-parallel"):
            _eager_forward_inside(module, tracker.replicated)
        return module


def _single_rank(tracker, stream: str) -> bool:
    """Whether ``stream`` is drawn by one rank only (tp = sp = 1): its activations are not sharded, so they draw from
    torch's default generator, as the unsharded model does (a world of one is the model itself)."""
    return stream in tracker.ranks and tracker.ranks[stream][1] == 1


def _eager_forward_inside(module: nn.Module, context) -> None:
    """Run every eager forward of ``module`` inside a fresh ``context()`` (hooks; it is left even when the forward
    raises). Compiled code skips it: dynamo cannot trace a generator swap."""
    active: list = []

    def enter(mod, args):
        if not torch.compiler.is_compiling():
            active.append(context())
            active[-1].__enter__()

    def leave(mod, args, output):
        if active and not torch.compiler.is_compiling():
            active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _compiled_stream_dropout(tracker, stream: str):
    """Forward hook of an ``nn.Dropout`` (or the fused ``DropoutAdd``, called as ``(x, residual)``) on sharded
    activations: under torch.compile, recompute its output with this rank's mask of the stream
    (:func:`shardlib.parallel.random.local_dropout`)."""

    def hook(mod, args, output):
        if not torch.compiler.is_compiling() or not mod.training or mod.p == 0:
            return None
        dropped = local_dropout(args[0], mod.p, *tracker.ranks[stream])
        return dropped if len(args) < 2 or args[1] is None else args[1] + dropped

    return hook


def attention_block(block: str, qkv: list[str], out: str, inputs: tuple[str, ...] = ("hidden_states",)) -> dict:
    """The Megatron plan of one attention block, as plan entries: ``block`` (the module that computes q, k and v)
    enters the TP region once for the named inputs (``CopyInputs``) and runs on the per-rank RNG stream (attention
    dropout acts on local heads); the ``qkv`` linears are column-parallel without a copy of their own; ``out`` is
    row-parallel. All paths are plan patterns."""
    return {
        block: (CopyInputs(*inputs), LocalRNG()),
        **{path: ColwiseParallel(copy_input=False) for path in qkv},
        out: RowwiseParallel(),
    }


def as_tuple(styles) -> tuple[Style, ...]:
    return styles if isinstance(styles, tuple) else (styles,)


def style_name(style: Style) -> str:
    fields = {k: v for k, v in vars(style).items() if v != getattr(type(style), k, object())}
    if isinstance(style, CopyInputs):
        return f"CopyInputs({', '.join(style.names)})"
    args = ", ".join(f"{k}={v}" for k, v in fields.items())
    return f"{type(style).__name__}({args})"


__all__ = [
    "ShardContext", "Style", "ColwiseParallel", "RowwiseParallel", "VocabParallel", "CopyInputs", "LocalRNG",
    "ReplicatedRNG",
    "attention_block",
]
