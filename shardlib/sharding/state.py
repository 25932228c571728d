"""Full (unsharded) views of a sharded model's tensors, and loading full tensors into shards.

Both read every tensor's layout from where it was recorded (:func:`shardlib.parallel.layout.layout_of`). Gathering is a
collective over the TP group, and over the dp group for parameters FSDP2 shards (ZeRO-3: DTensors, see
:mod:`shardlib.parallel.dp_shards`): every rank of those groups must call it. Loading slices locally and needs no
communication.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.collectives import all_gather
from ..parallel import dp_shards
from ..parallel.layout import layout_of
from .sequence import rehook_replicated_grads
from .sharded import shard_state


def tp_group_of(model: nn.Module):
    """The TP process group of sharded ``model`` (None at tp=1 or when not sharded)."""
    state = shard_state(model, required=False)
    return state.mesh.tp_group if state is not None and state.mesh.tp > 1 else None


def _ep_group_of(model: nn.Module):
    state = shard_state(model, required=False)
    return state.mesh.ep_group if state is not None and getattr(state.mesh, "ep", 1) > 1 else None


def _pipeline(model: nn.Module):
    state = shard_state(model, required=False)
    return state.pipeline if state is not None else None


def gather_full(tensor: torch.Tensor, layout, group, ep_group=None) -> torch.Tensor:
    """The full tensor of this rank's shard ``tensor`` (a detached copy; padding dropped): collective over ``group``
    (tp) when ``layout`` is sharded, then over ``ep_group`` when it splits experts over ep."""
    if layout.is_expert_split:
        part = gather_full(tensor, layout.within_ep(), group)
        return all_gather(part, layout.ep_dim, ep_group).clone()
    if not layout.is_sharded:
        return tensor.detach().clone()
    full = all_gather(tensor.detach(), layout.shard_dim, group)
    if layout.blocks > 1:
        return layout.unshard(list(full.chunk(layout.num_shards, layout.shard_dim))).clone()
    return full.narrow(layout.shard_dim, 0, layout.global_shape[layout.shard_dim]).clone()


def full_state_dict(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Parameter (or, with ``grads=True``, gradient) name -> full unsharded tensor, on every rank: a plain tensor
    (never a DTensor) of the global shape at every layout, gathered over tp and, after ``Trainer(zero=3)``, over dp.
    A collective: every rank of this rank's tp and dp groups calls it.

    Tied parameters appear under their first name only, like ``named_parameters()``. Parameters without a
    gradient are left out when ``grads=True``. A pipelined model gives the parameters of this rank's stages.
    """
    groups = {"tp": tp_group_of(model), "ep": _ep_group_of(model)}
    split = _pipeline(model)
    local = {id(p) for p in split.local_parameters()} if split is not None else None
    elsewhere = _expert_keys_elsewhere(model)
    out = {}
    for name, p in model.named_parameters():
        if name in elsewhere:  # an expert module of an ep-split ModuleDict: every ep rank's, gathered over ep
            tensor, layout = p.grad if grads else p, layout_of(model, name)
            whole_tensor = None if tensor is None else gather_full(dp_shards.whole(tensor), layout, groups["tp"])
            pieces = _gather_experts(whole_tensor, p.new_zeros(layout.global_shape), groups["ep"])
            out |= {other: piece for other, piece in zip(elsewhere[name], pieces) if piece is not None}
            continue
        tensor = p.grad if grads else p
        if tensor is None or (local is not None and id(p) not in local):
            continue
        out[name] = gather_full(dp_shards.whole(tensor), layout_of(model, name), groups["tp"], groups["ep"])
    return out


def _expert_keys_elsewhere(model: nn.Module) -> dict[str, list[str]]:
    """For each parameter of an expert module that expert parallelism keeps on this rank (a ModuleDict split over
    ep: :data:`shardlib.parallel.expert_parallel.EP_KEYS_ATTR`), the names of the same parameter of the expert at the
    same place on every ep rank, in ep-rank order."""
    from ..parallel.expert_parallel import EP_KEYS_ATTR

    names = {}
    for path, module in model.named_modules():
        if EP_KEYS_ATTR not in module.__dict__:
            continue
        keys, ep = module.__dict__[EP_KEYS_ATTR]
        local = len(keys) // ep
        for j, key in enumerate(module._modules):
            for name, _ in module._modules[key].named_parameters():
                names[f"{path}.{key}.{name}"] = [f"{path}.{keys[q * local + j]}.{name}" for q in range(ep)]
    return names


def experts_held_elsewhere(model: nn.Module) -> set[str]:
    """Parameter names of the expert modules other ep ranks hold (in no tensor of this rank)."""
    return {other for names in _expert_keys_elsewhere(model).values() for other in names} - \
        {name for name, _ in model.named_parameters()}


def _gather_experts(tensor, zeros: torch.Tensor, group) -> list:
    """Every ep rank's whole ``tensor`` (shaped like ``zeros``), None where that rank's is None (an expert without a
    gradient)."""
    flags = all_gather(torch.tensor([float(tensor is not None)]), 0, group).tolist()
    value = (tensor if tensor is not None else zeros).detach().unsqueeze(0)
    pieces = all_gather(value, 0, group).unbind(0)
    return [piece.clone() if flag else None for piece, flag in zip(pieces, flags)]


def _unique_tensors(model: nn.Module):
    """(tensor, [(module, attr), ...]) for every distinct parameter and buffer, holders in module order."""
    holders: dict[int, tuple[torch.Tensor, list]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for attr, t in store.items():
                if t is not None:
                    holders.setdefault(id(t), (t, []))[1].append((module, attr))
    return list(holders.values())


def materialize(model: nn.Module, device: str | torch.device = "cpu", *, init: str = "all") -> nn.Module:
    """Give every meta tensor real (uninitialized) storage on ``device``, keeping ties and layouts, then run the
    HF weight initializer: on everything (``init="all"``), or only on the modules that own non-persistent buffers
    (``init="buffers"``: position ids and the like, when a checkpoint supplies every parameter). Local shapes
    only: no rank allocates a full sharded tensor; a pipelined model materializes its own stages' parameters."""
    split = _pipeline(model)
    local = {id(p) for p in split.local_parameters()} if split is not None else None
    for tensor, holders in _unique_tensors(model):
        if tensor.device.type != "meta":
            continue
        if local is not None and isinstance(tensor, nn.Parameter) and id(tensor) not in local:
            continue  # another pipeline rank's parameter
        new = torch.empty_like(tensor, device=device)
        if isinstance(tensor, nn.Parameter):
            new = nn.Parameter(new, requires_grad=tensor.requires_grad)
        for module, attr in holders:
            store = module._parameters if attr in module._parameters else module._buffers
            store[attr] = new
    with torch.no_grad():
        if init == "all" and hasattr(model, "initialize_weights"):
            model.initialize_weights()  # HF's initializer without its re-tying (ties are ours to keep)
        elif init == "buffers" and hasattr(model, "_init_weights"):
            for module in model.modules():
                if module._non_persistent_buffers_set:
                    model._init_weights(module)
    rehook_replicated_grads(model)
    return model


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy full tensors into a sharded model, each rank keeping its slice (padding zeroed; after
    ``Trainer(zero=3)``, its dp shard of it).

    Meta tensors are materialized first (:func:`materialize`). With ``strict``, every parameter must be present
    and every key must name a parameter or buffer; shapes must equal the global shape of the layout.
    """
    if any(t.device.type == "meta" for t, _ in _unique_tensors(model)):
        materialize(model)
    state = shard_state(model, required=False)
    # the mesh's: an OfflineMesh has no group to ask
    ranks = {"tp": state.mesh.tp_rank if state is not None else 0,
             "ep": state.mesh.ep_rank if state is not None and getattr(state.mesh, "ep", 1) > 1 else 0}
    targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    problems = []
    elsewhere = experts_held_elsewhere(model)
    if strict:
        problems += [f"unexpected key {k!r}" for k in state_dict if k not in targets and k not in elsewhere]
        problems += [f"missing parameter {k!r}" for k, _ in model.named_parameters() if k not in state_dict]
    for name, full in state_dict.items():
        if name in targets and tuple(full.shape) != layout_of(model, name).global_shape:
            problems.append(f"{name}: shape {tuple(full.shape)} != model {layout_of(model, name).global_shape}")
    if problems:
        raise ValueError("cannot load state dict:\n  " + "\n  ".join(problems))
    for name, full in state_dict.items():
        if name in targets:
            layout = layout_of(model, name)
            target, piece = targets[name], layout.shard(full, ranks["tp"], ranks["ep"])
            dp_shards.local(target).copy_(dp_shards.local(dp_shards.like(piece, target)))
