"""The tensors a checkpoint holds, seen from the model: tied tensors once with all their names, this rank's
pipeline stage only, and reads into a rank's local shard."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..parallel.dp_shards import whole
from ..parallel.layout import Layout, layout_of
from ..parallel.optim_state import param_state
from ..safetensors_io import CheckpointError
from ..sharding.sharded import settle_parameters, shard_state
from ..sharding.state import _pipeline, experts_held_elsewhere
from .format import OPTIMIZER_PREFIX


def fill_local(read_into, layout: Layout, rank: int, out: torch.Tensor, what: str, ep_rank: int = 0) -> torch.Tensor:
    """Fill ``out``, this rank's local tensor for ``layout`` (tp rank ``rank``, ep rank ``ep_rank``), in place:
    ``read_into(dim, start, stop, view)`` reads global rows straight into ``view`` (a narrow of ``out``), one call per
    range of :meth:`Layout.ranges` (several for a blocked layout, each into its part of ``out``); padding rows are
    zeroed in place. No temporary, except for experts split over both ep and tp: this ep rank's experts are read
    whole, then cut."""
    if tuple(out.shape) != tuple(layout.local_shape):
        raise CheckpointError(f"{what}: the local tensor has shape {tuple(out.shape)}, its layout says "
                              f"{tuple(layout.local_shape)}")
    if layout.is_expert_split:
        start, stop = layout.ep_range(ep_rank)
        within = layout.within_ep()
        if not within.is_sharded:
            read_into(layout.ep_dim, start, stop, out)
        else:
            part = out.new_empty(within.global_shape)
            read_into(layout.ep_dim, start, stop, part)
            out.copy_(within.shard(part, rank))
        return out
    if not layout.is_sharded:
        read_into(None, 0, None, out)
        return out
    d, filled = layout.shard_dim, 0
    for start, stop in layout.ranges(rank):
        rows = max(stop - start, 0)
        if rows:
            read_into(d, start, stop, out.narrow(d, filled, rows))
        filled += rows
    if filled < out.shape[d]:
        out.narrow(d, filled, out.shape[d] - filled).zero_()
    return out


def tensors_to_load(model: nn.Module):
    """(tensor, [names]) for every distinct parameter and persistent buffer: tied tensors once, with all names (once
    the parameters hold their values: ZeRO's overlapped gathers settled)."""
    settle_parameters(model)
    seen: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if attr in module._buffers and attr in module._non_persistent_buffers_set:
            continue
        seen.setdefault(id(t), (t, []))[1].append(name)
    return list(seen.values())


def local_tensors(model: nn.Module):
    """:func:`tensors_to_load` without the parameters of other ranks' pipeline stages (meta tensors here)."""
    split = _pipeline(model)
    if split is None:
        return tensors_to_load(model)
    local = {id(p) for p in split.local_parameters()}
    return [(t, names) for t, names in tensors_to_load(model)
            if not isinstance(t, nn.Parameter) or id(t) in local]


def model_tensor_names(model: nn.Module) -> set[str]:
    """Every name of every tensor the whole model holds, other ranks' pipeline stages included (their layers are
    released here, but the split remembers their names)."""
    names = {n for _, names in tensors_to_load(model) for n in names} | experts_held_elsewhere(model)
    split = _pipeline(model)
    return names | set(split.owners) if split is not None else names


def tp_rank(model: nn.Module) -> int:
    state = shard_state(model, required=False)
    return state.mesh.tp_rank if state is not None else 0


def ep_rank(model: nn.Module) -> int:
    """This rank's index in its expert-parallel group (0 without expert parallelism)."""
    state = shard_state(model, required=False)
    return state.mesh.ep_rank if state is not None and getattr(state.mesh, "ep", 1) > 1 else 0


def saved_tensors(model: nn.Module, optimizer=None):
    """(name, tensor, layout, aliases) of everything a checkpoint holds: parameters and persistent buffers (tied ones
    once), then, with an optimizer, each parameter's state tensors as ``optimizer.<state>.<param name>`` (master
    weights: ``optimizer.master.<param name>``): moments shaped like the parameter share its layout, scalars
    (``step``) are replicated. Every tensor is whole on its tp rank: parameters sharded over dp by FSDP2 (zero=3)
    and their states are gathered here, and so is the state zero=1/2 partitions by elements (collectives on the dp
    group: every rank walks the same tensors)."""
    for tensor, names in tensors_to_load(model):
        yield names[0], whole(tensor), layout_of(model, names[0]), names[1:]
    if optimizer is None:
        return
    for tensor, names in tensors_to_load(model):
        for key, value in param_state(optimizer, tensor).items():
            if torch.is_tensor(value):
                layout = layout_of(model, names[0])
                if value.shape != tensor.shape:  # a scalar (step): replicated, except with an expert held by one ep rank
                    layout = Layout.replicated(value.shape) if layout.ep == 1 or layout.is_expert_split else \
                        dataclasses.replace(Layout.replicated(value.shape), ep=layout.ep)
                yield f"{OPTIMIZER_PREFIX}{key}.{names[0]}", whole(value), layout, []
