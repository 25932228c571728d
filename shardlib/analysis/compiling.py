"""``torch.compile`` of a sharded model, in place (docs/compile.md).

A sharded model compiles as one graph per forward: shardlib's collectives are torch's functional collectives,
its per-rank dropout has a traceable form (:func:`shardlib.parallel.random.local_dropout`), and the eager-only memory
savers (sequence-parallel saved-tensor sharding) step aside under the compiler. :func:`compile_model` is the
one entry point the Trainer uses too:

* no pipeline: ``model.compile(**options)`` (``nn.Module.compile``: the module is compiled in place, so its
  parameters, state dict keys, hooks and ``shard_state`` stay what they were; ``torch.compile(model)`` would wrap
  it and prefix every key with ``_orig_mod.``);
* a pipeline stage (``mesh.pp > 1``): each layer of the trunk that this rank holds is compiled in place. The stage
  itself stays eager: it runs the HF forward between cut points with hooks and an exception that stops it at its
  last layer, which is control flow dynamo would break on, and torch.distributed.pipelining's schedules call the
  stage eagerly anyway. Every layer of a stack shares one compiled graph (same code, parameters as inputs).
"""

from __future__ import annotations

from torch import nn

from ..sharding.sharded import shard_state


def compile_model(model: nn.Module, **options) -> nn.Module:
    """Compile sharded ``model`` in place (``options`` go to ``torch.compile``: backend, mode, dynamic, ...) and
    return it. Pipeline stages compile their layers (module docstring)."""
    state = shard_state(model, required=False)
    split = state.pipeline if state is not None else None
    if split is None:
        model.compile(**options)
        return model
    for layer in stage_layers(model):
        layer.compile(**options)
    return model


def stage_layers(model: nn.Module) -> list[nn.Module]:
    """The trunk layers whose parameters this pipeline rank holds, in model order."""
    state = shard_state(model)
    local = {id(p) for p in state.pipeline.local_parameters()}
    layers = []
    for stack in state.plan.trunk:
        for layer in model.get_submodule(stack.layers).children():
            if any(id(p) in local for p in layer.parameters()):
                layers.append(layer)
    return layers


__all__ = ["compile_model", "stage_layers"]
