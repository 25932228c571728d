"""LoRA adapters (peft) on tensor-parallel linears.

``peft.get_peft_model`` wraps each targeted ``nn.Linear`` in a ``peft.tuners.lora.layer.Linear`` that computes
``y = base(x) + B(A(dropout(x))) * scaling`` per active adapter (``A`` [r, in], ``B`` [out, r]). A plan names the
linear's path, which now holds the wrapper; its style is applied to the wrapped ``base_layer`` and the adapters
are sharded to match, inside peft's own module (so ``set_adapter``, ``disable_adapter``, merging and peft's
``save_pretrained`` keep working):

* **column-parallel base** (output features split): ``B`` is split like the base's output, ``A`` is replicated.
  The input enters the TP region once, in front of both (the wrapper copies or, under sequence parallelism,
  gathers it when the style would have; q/k/v inside a ``CopyInputs`` block get it entered already), and the
  base and ``B`` compute this rank's output slice. ``A``'s gradient on each rank comes from its slice only, so it
  is summed over the TP group in backward (:class:`~shardlib.parallel.gradsync.ReplicatedGradSync`; inside a
  Megatron sequence-parallel stack the layer's own sum already covers it). A ``gather_output`` style gathers the
  sum. The adapter's dropout acts on the replicated input: every rank draws the same mask, from the shared stream
  (``ReplicatedRNG``), also inside an attention block that otherwise draws per rank.
* **row-parallel base** (input features split): ``A`` is split like the base's input, ``B`` is replicated. The
  base and the adapter each give a partial sum; the wrapper adds them and reduces once (all-reduce, or the
  sequence reduce-scatter), then adds the base's bias: the adapter's output joins the base's before the
  all-reduce, no collective of its own in forward. ``B``'s gradient comes from a partial ``A x`` on each rank, so
  it is summed over the TP group like ``A``'s above. The dropout acts on the rank's feature slice: per-rank stream
  (``LocalRNG``).

Merging works on the shards as they are (``B_r A`` and ``B A_r`` are the base shard's own delta). Not supported
(refused by name before anything changes): LoRA on embeddings or convolutions, DoRA and the other LoRA variants,
``lora_bias`` on a row-parallel base, sequence parallelism on the sp dimension (all-to-all, ring) with tp > 1.
Adapters are added before :func:`shardlib.shard`, not after (peft sizes a new adapter from the wrapper's unsharded
feature counts).

peft is optional: nothing here imports it; a model can hold its layers only if it was imported.
"""

from __future__ import annotations

import sys

from torch import nn

from ..parallel.collectives import copy_to_tp, gather_from_tp, reduce_from_tp
from ..parallel.gradsync import ReplicatedGradSync
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel.styles import ColwiseParallel, LocalRNG, ReplicatedRNG, RowwiseParallel, ShardContext, Style, \
    class_path
from .sequence import SP_MODES

ADAPTED_STYLES = (ColwiseParallel, RowwiseParallel)


def _peft_class(module: str, name: str):
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer (a wrapper around a ``base_layer``)."""
    cls = _peft_class("peft.tuners.lora.layer", "LoraLayer")
    return cls is not None and isinstance(module, cls)


def peft_inner_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside a peft ``PeftModel`` (or its ``LoraModel``), else None."""
    peft_model = _peft_class("peft.peft_model", "PeftModel")
    tuner = _peft_class("peft.tuners.tuners_utils", "BaseTuner")
    if peft_model is not None and isinstance(model, peft_model):
        model = model.base_model
    if tuner is not None and isinstance(model, tuner):
        return model.model
    return None


def styled_module(module: nn.Module, style: Style) -> nn.Module:
    """What ``style`` checks and shards: a LoRA layer's base linear for a linear style, else ``module``."""
    return module.base_layer if is_lora_layer(module) and isinstance(style, ADAPTED_STYLES) else module


def adapter_problems(path: str, module: nn.Module, styles: tuple[Style, ...], r) -> list[str]:
    """What stops sharding the LoRA layer at ``path`` with ``styles`` (none for any other module)."""
    if not is_lora_layer(module):
        return []
    linear_styles = [s for s in styles if isinstance(s, ADAPTED_STYLES)]
    where = f"{path} ({class_path(type(module))})"
    if not linear_styles:
        other = ", ".join(type(s).__name__ for s in styles)
        return [f"{where}: shardlib shards LoRA adapters on column- or row-parallel linears, not under {other}: "
                "leave this module out of the LoraConfig's target_modules"]
    problems = []
    if type(module).__name__ != "Linear" or not isinstance(module.base_layer, nn.Linear):
        problems.append(f"{where}: LoRA on {class_path(type(module.base_layer))} is not supported (only on "
                        "torch.nn.Linear): leave it out of target_modules")
    for name in module.lora_A:
        if name in getattr(module, "lora_variant", {}):
            problems.append(f"{where}: adapter {name!r} is a LoRA variant ({type(module.lora_variant[name]).__name__}"
                            ", e.g. DoRA), which shardlib does not shard: use plain LoRA")
        if isinstance(linear_styles[0], RowwiseParallel) and module.lora_B[name].bias is not None:
            problems.append(f"{where}: adapter {name!r} has lora_bias on a row-parallel base (its bias would be "
                            "added on every rank before the reduction): set lora_bias=False")
    if r.options.get("sequence_mode") in SP_MODES and r.tp > 1:
        problems.append(f"{where}: LoRA adapters with sequence_parallel={r.options['sequence_mode']!r} need tp=1 (the "
                        "adapter's partial gradients would need one sum over tp and sp together)")
    return problems


def shard_adapted(path: str, module: nn.Module, style: Style, ctx: ShardContext) -> nn.Module:
    """Shard the LoRA layer ``module`` at ``path`` with ``style`` (module docstring); returns it, rewritten in
    place."""
    if isinstance(style, RowwiseParallel):
        _shard_row(path, module, ctx)
    else:
        _shard_column(module, style, ctx)
    return module


def _shard_column(module: nn.Module, style: ColwiseParallel, ctx: ShardContext) -> None:
    global_out = module.base_layer.out_features
    module.base_layer = ColumnParallelLinear(module.base_layer, ctx.group, copy_input=False, **ctx.tp_args)
    for name, up in list(module.lora_B.items()):
        module.lora_B[name] = ColumnParallelLinear(up, ctx.group, copy_input=False, **ctx.tp_args)
    for name, drop in list(module.lora_dropout.items()):
        if isinstance(drop, nn.Dropout):  # a fresh one: no per-rank hook of an enclosing LocalRNG on it
            module.lora_dropout[name] = ReplicatedRNG().apply("", nn.Dropout(drop.p, drop.inplace), ctx)
    _sum_partial_gradients(module.lora_A, ctx)
    if ctx.tp == 1:
        return
    group, sequence = ctx.group, ctx.sequence
    if style.copy_input:
        def enter(mod, args):
            x = sequence.gather(args[0]) if sequence is not None else copy_to_tp(args[0], group)
            return (x, *args[1:])

        module.register_forward_pre_hook(enter)
    if style.gather_output:
        module.register_forward_hook(lambda mod, args, y: gather_from_tp(y, group, -1)[..., :global_out])


def _shard_row(path: str, module: nn.Module, ctx: ShardContext) -> None:
    module.base_layer = RowParallelLinear(module.base_layer, ctx.group, reduce_output=False, **ctx.tp_args)
    for name, down in list(module.lora_A.items()):
        module.lora_A[name] = RowParallelLinear(down, ctx.group, reduce_output=False, **ctx.tp_args)
    for name, drop in module.lora_dropout.items():
        if isinstance(drop, nn.Dropout):
            LocalRNG().apply(f"{path}.lora_dropout.{name}", drop, ctx)
    _sum_partial_gradients(module.lora_B, ctx)
    group, sequence = ctx.group, ctx.sequence

    def reduce(mod, args, y):
        y = sequence.reduce_scatter(y) if sequence is not None else reduce_from_tp(y, group)
        bias = mod.base_layer.bias
        return y if bias is None else y + bias

    module.register_forward_hook(reduce)


def _sum_partial_gradients(adapters: nn.ModuleDict, ctx: ShardContext) -> None:
    """The replicated adapter matrices get a partial gradient on each TP rank: sum it over the group in backward.
    Inside a Megatron sequence-parallel stack the layer's own sum covers every replicated parameter already."""
    if ctx.tp == 1 or ctx.sequence is not None:
        return
    grad_sum = ReplicatedGradSync(ctx.group)
    for linear in adapters.values():
        grad_sum(linear)
        linear.register_forward_pre_hook(grad_sum)


__all__ = ["is_lora_layer", "peft_inner_model", "styled_module", "adapter_problems", "shard_adapted"]
