"""Loading: HF checkpoints and sharded checkpoints (any tp) straight into a sharded model's local shards, with its
optimizer state; building a sharded model from either."""

from __future__ import annotations

import copy
import inspect
import logging
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..parallel.dp_shards import like, local
from ..parallel.layout import Layout, layout_of
from ..parallel.optim_state import holds_state, set_param_state
from ..parallel.timeouts import stalled_ranks_named
from ..safetensors_io import CheckpointError, SafetensorsFiles
from ..sharding.sharded import shard_state
from ..sharding.state import materialize
from .format import OPTIMIZER_PREFIX, hf_class_name, hf_config, read_hf_config
from .outcome import all_ranks, timeout_of
from .reader import ShardedCheckpoint
from .experts import check_shapes, expert_keys, merged_experts, read_merged, renamed_keys
from .tensors import ep_rank, fill_local, local_tensors, model_tensor_names, tp_rank

log = logging.getLogger("shardlib.checkpoint")


def _unmatched(model: nn.Module, source: str, missing: list[str], unexpected: list[str], strict: bool) -> None:
    """Refuse (``strict``) or warn about tensors the model lacks in the checkpoint and checkpoint tensors the model
    does not have, naming them. Unexpected keys the model class itself lists as ignorable on load (HF's
    ``_keys_to_ignore_on_load_unexpected``) are not reported."""
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = [k for k in unexpected if not any(p.search(k) for p in ignore)]
    lines = []
    if missing:
        lines.append(f"{len(missing)} tensor(s) of {type(model).__name__} missing from {source}"
                     f"{'' if strict else ' (left as initialized)'}: {_names(missing)}")
    if unexpected:
        lines.append(f"{len(unexpected)} tensor(s) in {source} that {type(model).__name__} does not have"
                     f"{'' if strict else ' (skipped)'}: {_names(unexpected)}")
    if lines and strict:
        raise CheckpointError("; ".join(lines) + " (strict=False loads the rest)")
    if not dist.is_initialized() or dist.get_rank() == 0:  # the same names on every rank: said once, as HF does
        for line in lines:
            log.warning("%s", line)


def _names(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" ... ({len(names) - 8} more)" if len(names) > 8 else "")


def _hub_keys(model: nn.Module, files: SafetensorsFiles, model_names: set[str]):
    """Model tensor name -> the key it has in ``files``: the policy's Hub key, with the base model prefix (``bert.``,
    ``vit.``) dropped for a base-model checkpoint loaded into a model with a head, or added for the reverse, as
    transformers' ``from_pretrained`` decides it (for the whole checkpoint at once)."""
    state = shard_state(model, required=False)
    policy = state.policy if state is not None else None
    to_hub = policy.to_hub_key if policy is not None else (lambda n: n)
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    if prefix == ".":
        return to_hub
    model_has = any(to_hub(n).startswith(prefix) for n in model_names)
    files_have = any(k.startswith(prefix) for k in files.weight_map)
    if model_has and not files_have:
        return lambda n: to_hub(n).removeprefix(prefix)
    if files_have and not model_has:
        return lambda n: prefix + to_hub(n)
    return to_hub


@torch.no_grad()
def load_hf_weights(model: nn.Module, files: SafetensorsFiles, *, strict: bool = True) -> list[str]:
    """Fill a sharded model (materialized) with its slices of an HF checkpoint, read straight into the parameters;
    return the names loaded. ``strict``: refuse a checkpoint with missing or extra tensors (else warn, naming
    them). Every refusal comes before the first read. Every rank calls it: a failure on one rank is raised on every
    rank, naming it (:func:`.outcome.all_ranks`)."""
    mesh = _mesh_of(model)
    with all_ranks(f"loading {files.directory}", mesh):
        found, initialized = _read_hf_weights(model, files, strict)
    with stalled_ranks_named(f"loading {files.directory} (the tensors it lacks, made identical on every replica)",
                             timeout_of(mesh)):
        _agree_across_replicas(model, initialized)
    return found


def _mesh_of(model: nn.Module):
    state = shard_state(model, required=False)
    return state.mesh if state is not None else None


def _read_hf_weights(model: nn.Module, files: SafetensorsFiles, strict: bool) -> tuple[list[str], list]:
    """:func:`load_hf_weights` on this rank: the names loaded, and the tensors the checkpoint lacks. A class whose
    Hub checkpoints transformers renames or merges on load (Mixtral's per-expert tensors) is read through that
    mapping (:mod:`.experts`)."""
    model_names = model_tensor_names(model)
    hub = _hub_keys(model, files, model_names)
    renamed = renamed_keys(model)

    def to_hub(name: str) -> str:
        key = hub(name)
        return key if key in files or renamed(key) not in files else renamed(key)

    local = local_tensors(model)
    merged = merged_experts(model, [names[0] for _, names in local], files)
    found, missing, initialized, merged_found = [], [], [], []
    for tensor, names in local:
        key = next((to_hub(n) for n in names if to_hub(n) in files), None)
        if key is None and names[0] in merged:
            layout = layout_of(model, names[0])
            check_shapes(files, names[0], merged[names[0]], layout)
            merged_found.append((tensor, names[0], layout))
            continue
        if key is None:
            missing.append(" = ".join(to_hub(n) for n in names))
            initialized.append((tensor, layout_of(model, names[0])))
            continue
        layout = layout_of(model, names[0])
        shape = files.shape(key)
        if shape != layout.global_shape:
            raise CheckpointError(f"tensor {key!r} in {files.weight_map[key].name} has shape {shape}, "
                                  f"the model expects {layout.global_shape} ({names[0]})")
        found.append((tensor, names[0], key, layout))
    known, per_expert = {to_hub(n) for n in model_names}, expert_keys(model)
    _unmatched(model, str(files.directory), missing,
               sorted(k for k in set(files.weight_map) - known if not per_expert(k)), strict)
    for tensor, name, key, layout in found:  # each rank reads only its slice (its experts' rows under ep)
        fill_local(lambda d, a, b, view: files.read_into(key, view, d, a, b), layout, tp_rank(model), tensor, key,
                   ep_rank(model))
    for tensor, name, layout in merged_found:
        read_merged(files, merged[name], layout, tp_rank(model), ep_rank(model), tensor)
    return [name for _, name, _, _ in found] + [name for _, name, _ in merged_found], initialized


def _agree_across_replicas(model: nn.Module, tensors: list[tuple[torch.Tensor, Layout]]) -> None:
    """Tensors the checkpoint lacked keep HF's initialization, drawn from each rank's own generator: ranks that
    were not seeded alike would train different copies of a replicated head, silently. Each such tensor is
    broadcast from the first rank of every mesh dimension that replicates it (dp and sp always, tp unless the
    tensor is tp-sharded, whose shards may differ)."""
    state = shard_state(model, required=False)
    mesh = state.mesh if state is not None else None
    if not tensors or not dist.is_initialized() or not hasattr(mesh, "group"):  # an OfflineMesh: one process
        return
    for dim in ("dp", "sp", "tp"):
        if mesh.size(dim) == 1:
            continue
        group = mesh.group(dim)
        for tensor, layout in tensors:
            if dim != "tp" or not layout.is_sharded:
                dist.broadcast(tensor.data, group=group, group_src=0)


def _build_sharded(model_class, config, mesh, shard_options: dict, *, init: str = "buffers",
                   torch_dtype: torch.dtype | None = None) -> nn.Module:
    from ..sharding.sharder import shard

    with torch.device("meta"):
        is_module_class = isinstance(model_class, type) and issubclass(model_class, nn.Module)
        model = model_class(config) if is_module_class else model_class.from_config(config)  # Auto classes
    if torch_dtype is not None:
        model.to(torch_dtype)  # floating tensors only, still on the meta device
    shard(model, mesh, **shard_options)
    materialize(model, init=init)  # "buffers": every parameter comes from the checkpoint, no init to overwrite
    return model


def shard_option_names() -> frozenset[str]:
    """The keyword options of :func:`shardlib.shard` (``from_pretrained`` tells them from config overrides)."""
    from ..sharding.sharder import shard

    return frozenset(n for n, p in inspect.signature(shard).parameters.items() if p.kind is p.KEYWORD_ONLY)


def with_overrides(config, overrides: dict, model_class):
    """A copy of ``config`` with ``overrides`` set, as transformers' ``from_pretrained`` sets its keyword arguments
    that name config attributes (``num_labels``, ``id2label``, ``problem_type``, ``hidden_dropout_prob`` ...); one
    that names none is refused, naming it (transformers passes it to the model's constructor, which refuses it)."""
    unknown = sorted(k for k in overrides if not hasattr(config, k))
    if unknown:
        options = ", ".join(sorted(shard_option_names()))
        raise TypeError(f"from_pretrained({getattr(model_class, '__name__', model_class)}, ...): "
                        f"{', '.join(map(repr, unknown))} is neither an attribute of {type(config).__name__} nor a "
                        f"shard option ({options})")
    config = copy.deepcopy(config)
    for key, value in overrides.items():
        setattr(config, key, value)  # num_labels: transformers' setter rebuilds id2label / label2id
    return config


def from_pretrained(model_class, path: str | Path, mesh, *, config=None, torch_dtype: torch.dtype | None = None,
                    strict: bool = True, shard: dict | None = None, **kwargs) -> nn.Module:
    """Build ``model_class`` (an HF model class or Auto class) on the meta device, shard it over ``mesh`` and read
    each rank's slice of each tensor straight from the HF safetensors checkpoint at ``path`` (single file or
    index + shards) into the parameters, converted to ``torch_dtype`` when given. Returns the model in eval mode,
    as HF does.

    As in transformers: ``config`` replaces the checkpoint's ``config.json``; a keyword argument that names a config
    attribute overrides it (``num_labels=2``, ``problem_type=...``, ``hidden_dropout_prob=0.0``); ``strict=False``:
    tensors the checkpoint lacks keep HF's initialization and extra ones are skipped, each named once in a warning
    on the ``shardlib.checkpoint`` logger (a head fine-tuned from a base checkpoint). :func:`shardlib.shard`'s
    options go in ``shard=dict(...)``, or by name as keyword arguments (``sequence_parallel=True``); a keyword
    argument that is neither is refused, naming it."""
    path = Path(path)
    shard_options, overrides = dict(shard or {}), {}
    for key, value in kwargs.items():
        if key in shard_option_names():
            if key in shard_options:
                raise TypeError(f"from_pretrained: shard option {key!r} given twice (by name and in shard=)")
            shard_options[key] = value
        else:
            overrides[key] = value
    config = with_overrides(config if config is not None else read_hf_config(path), overrides, model_class)
    model = _build_sharded(model_class, config, mesh, shard_options, init="buffers" if strict else "all",
                           torch_dtype=torch_dtype)
    with SafetensorsFiles(path) as files:
        load_hf_weights(model, files, strict=strict)
    return model.eval()


def whole_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """Where to read a tensor's tp-local rows: the tensor itself, or for a dp-sharded DTensor (FSDP2) a new tensor
    of its tp-local shape, whose dp slice is then copied in."""
    if isinstance(tensor, DTensor):
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=local(tensor).device)
    return tensor


def _check_stored_shape(ckpt: ShardedCheckpoint, name: str, layout: Layout) -> None:
    stored = ckpt.shape(name)
    if stored != layout.global_shape:
        raise CheckpointError(f"tensor {name!r} in {ckpt.directory} has shape {stored}, the model expects "
                              f"{layout.global_shape}")


def _read_local(ckpt: ShardedCheckpoint, name: str, layout: Layout, rank: int, dtype: torch.dtype,
                ep_rank: int = 0) -> torch.Tensor:
    """A new local tensor for ``layout`` read from ``ckpt`` (optimizer state: there is no tensor to fill yet), as tp
    rank ``rank`` and ep rank ``ep_rank`` hold it."""
    _check_stored_shape(ckpt, name, layout)
    out = torch.empty(layout.local_shape, dtype=dtype)
    return fill_local(lambda d, a, b, view: ckpt.read_into(name, view, d, a, b), layout, rank, out, name, ep_rank)


@torch.no_grad()
def load(model: nn.Module, directory: str | Path, *, optimizer=None, strict: bool = True) -> nn.Module:
    """Load a sharded checkpoint into a sharded model of the same architecture under any tp layout (resharding:
    each rank reads only the overlapping rows of the stored pieces, straight into its parameters); with
    ``optimizer`` (built over this model's parameters), restore its state and hyperparameters too. ``strict``:
    refuse a checkpoint that lacks a tensor of the model or holds one the model does not have (else warn, naming
    them). Optimizer state and carried tensors (:mod:`.conversion`) are never counted as extra. Every rank calls
    it: a failure on one rank (a file only its rows lie in is damaged) is raised on every rank, naming it
    (:func:`.outcome.all_ranks`), and a rank that stalls makes the others raise ``CollectiveFailure`` naming it."""
    with all_ranks(f"loading {directory}", _mesh_of(model)):
        _load(model, directory, optimizer, strict)
    return model


def _load(model: nn.Module, directory: str | Path, optimizer, strict: bool) -> None:
    """:func:`load` on this rank."""
    with ShardedCheckpoint(directory) as ckpt:
        expected = hf_class_name(model)
        if ckpt.meta["model_class"] != expected:
            raise CheckpointError(f"{directory} holds a {ckpt.meta['model_class']}, not a {expected}")
        if any(t.device.type == "meta" for t, _ in local_tensors(model)):
            materialize(model, init="buffers" if strict else "all")  # strict: every parameter is read below
        known = model_tensor_names(model)
        extra = sorted(n for n, entry in ckpt.tensors.items()
                       if n not in known and not n.startswith(OPTIMIZER_PREFIX) and not entry.get("carried"))
        missing = [names[0] for _, names in local_tensors(model) if not any(n in ckpt.tensors for n in names)]
        _unmatched(model, str(directory), missing, extra, strict)
        ranks = tp_rank(model), ep_rank(model)
        for tensor, names in local_tensors(model):
            name = next((n for n in names if n in ckpt.tensors), None)
            if name is None:
                continue  # named in the warning above
            layout = layout_of(model, names[0])
            _check_stored_shape(ckpt, name, layout)
            target = whole_buffer(tensor)
            fill_local(lambda d, a, b, view: ckpt.read_into(name, view, d, a, b), layout, ranks[0], target, name,
                       ranks[1])
            if target is not tensor:
                local(tensor).copy_(local(like(target, tensor)))
        if optimizer is not None:
            _load_optimizer(model, ckpt, optimizer, ranks)


def _load_optimizer(model: nn.Module, ckpt: ShardedCheckpoint, optimizer, ranks: tuple[int, int]) -> None:
    groups = ckpt.meta.get("optimizer")
    if groups is None:
        raise CheckpointError(f"{ckpt.directory} has no optimizer state (saved without optimizer=)")
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{ckpt.directory}: {len(groups)} optimizer param groups, this optimizer has "
                              f"{len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    stored_state: dict[str, dict[str, str]] = {}  # parameter name -> {state key: stored tensor name}
    for stored in ckpt.tensors:
        if stored.startswith(OPTIMIZER_PREFIX):
            key, _, param = stored[len(OPTIMIZER_PREFIX):].partition(".")  # state keys have no dots
            stored_state.setdefault(param, {})[key] = stored
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for tensor, names in local_tensors(model):
        if not holds_state(optimizer, tensor):
            continue  # another dp rank steps this parameter (a partitioned optimizer)
        state = {}
        param_layout = layout_of(model, names[0])
        for key, stored in stored_state.get(names[0], {}).items():
            shape = tuple(ckpt.tensors[stored]["shape"])
            layout = param_layout if shape == param_layout.global_shape else Layout.replicated(shape)
            value = _read_local(ckpt, stored, layout, ranks[0], ckpt.dtype(stored), ranks[1])
            # on the parameter's device, as torch's Optimizer.load_state_dict places it (a step that is neither
            # capturable nor fused stays a CPU scalar)
            group = group_of.get(id(tensor), {})
            if key != "step" or group.get("capturable") or group.get("fused"):
                value = like(value.to(tensor.device), tensor)  # FSDP2: this rank's dp shard of it
            state[key] = value
        set_param_state(optimizer, tensor, state)


def from_sharded(model_class, directory: str | Path, mesh, **shard_options) -> nn.Module:
    """Build ``model_class`` from the config stored in a sharded checkpoint, shard it over ``mesh`` (any tp) and
    load it."""
    with ShardedCheckpoint(directory) as ckpt:
        config = hf_config(ckpt.meta)
    model = _build_sharded(model_class, config, mesh, shard_options)
    return load(model, directory).eval()
