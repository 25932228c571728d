"""Checkpoints: HF safetensors straight into shards, the sharded format, resharding and export to HF.

Reading always goes through ``safe_open(...).get_slice(key)``, so a rank reads only the rows of each tensor it
holds: no rank ever materializes a full copy of a sharded tensor. Nothing is ever unpickled.

The sharded format (``docs/checkpoint-format.md``) is a directory with

* ``shardlib.json``: format version, model class, model config, and for every tensor its global shape, dtype,
  layout, aliases (tied names) and *pieces*: which file holds which rows ``[start, stop)`` of which dim;
  plus every file's size and SHA-256;
* ``model-tp{r}-of-{n}.safetensors``: rank r's rows of every sharded tensor (padding is not stored);
* ``model-replicated.safetensors``: every replicated tensor, written once.

Writes are atomic: all ranks write into a hidden temporary directory next to the destination, and the directory
appears under its final name (replacing an older checkpoint only with ``overwrite``) after every rank finished
and ``shardlib.json`` is complete. A crash mid-save leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .layout import Layout, layout_of
from .state import materialize

FORMAT = "shardlib-sharded-v1"
METADATA = "shardlib.json"
REPLICATED_FILE = "model-replicated.safetensors"
DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                                     torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or cannot go into this model: the message names the file or tensor."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _inside(directory: Path, name: str) -> Path:
    """``directory / name``, refusing names that leave the directory (path traversal in an index)."""
    path = (directory / name).resolve()
    if directory.resolve() not in path.parents:
        raise CheckpointError(f"{name!r} points outside the checkpoint directory {directory}")
    return path


# ------------------------------------------------------------------------------------------------ reading slices
class SafetensorsFiles:
    """The tensors of a directory of safetensors files (a single ``model.safetensors``, an HF index + shards, or
    explicit key -> file map), read slice by slice. Files open lazily; a corrupt or truncated file is an error
    naming it."""

    def __init__(self, directory: str | Path, weight_map: dict[str, str] | None = None):
        self.directory = Path(directory)
        self._open: dict[Path, object] = {}
        if weight_map is None:
            weight_map = self._hf_weight_map()
        self.weight_map = {key: _inside(self.directory, name) for key, name in weight_map.items()}

    def _hf_weight_map(self) -> dict[str, str]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                return json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        single = self.directory / "model.safetensors"
        if not single.exists():
            raise CheckpointError(f"{self.directory}: no model.safetensors or model.safetensors.index.json")
        return {key: single.name for key in self._handle(single).keys()}

    def _handle(self, path: Path):
        if path not in self._open:
            if not path.exists():
                raise CheckpointError(f"missing checkpoint file {path}")
            try:
                self._open[path] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
        return self._open[path]

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(self.weight_map[key]).get_slice(key).get_shape())

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``dim`` (the whole tensor when ``dim`` is None), reading only those bytes."""
        path = self.weight_map[key]
        try:
            if dim is None:
                return self._handle(path).get_tensor(key)
            piece = self._handle(path).get_slice(key)
            index = tuple(slice(None) if d != dim else slice(start, stop) for d in range(len(piece.get_shape())))
            return piece[index]
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read tensor {key!r} ({exc})") from None


def _local_piece(read_rows, layout: Layout, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's local tensor for ``layout``: ``read_rows(dim, start, stop)`` supplies global rows; zero padding
    is appended where the layout pads."""
    if not layout.is_sharded:
        return read_rows(None, 0, None).to(dtype)
    start, stop = layout.valid_range(rank)
    local = torch.zeros(layout.local_shape, dtype=dtype)
    if stop > start:
        local.narrow(layout.shard_dim, 0, stop - start).copy_(read_rows(layout.shard_dim, start, stop))
    return local


def _tensors_to_load(model: nn.Module):
    """(tensor, [names]) for every distinct parameter and persistent buffer: tied tensors once, with all names."""
    seen: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if attr in module._buffers and attr in module._non_persistent_buffers_set:
            continue
        seen.setdefault(id(t), (t, []))[1].append(name)
    return list(seen.values())


def _local_tensors(model: nn.Module):
    """:func:`_tensors_to_load` without the parameters of other ranks' pipeline stages (meta tensors here)."""
    split = getattr(getattr(model, "_shardlib", None), "pipeline", None)
    if split is None:
        return _tensors_to_load(model)
    local = {id(p) for p in split.local_parameters()}
    return [(t, names) for t, names in _tensors_to_load(model)
            if not isinstance(t, nn.Parameter) or id(t) in local]


def _tp_rank(model: nn.Module) -> int:
    return model._shardlib.mesh.tp_rank if hasattr(model, "_shardlib") else 0


@torch.no_grad()
def load_hf_weights(model: nn.Module, files: SafetensorsFiles, *, strict: bool = True) -> list[str]:
    """Fill a sharded model (materialized) with its slices of an HF checkpoint; return the names loaded."""
    policy = model._shardlib.policy if hasattr(model, "_shardlib") else None
    to_hub = policy.to_hub_key if policy is not None else (lambda n: n)
    rank, loaded, missing = _tp_rank(model), [], []
    for tensor, names in _local_tensors(model):
        key = next((to_hub(n) for n in names if to_hub(n) in files), None)
        if key is None:
            missing.append(" = ".join(to_hub(n) for n in names))
            continue
        layout = layout_of(model, names[0])
        shape = files.shape(key)
        if shape != layout.global_shape:
            raise CheckpointError(f"tensor {key!r} in {files.weight_map[key].name} has shape {shape}, "
                                  f"the model expects {layout.global_shape} ({names[0]})")
        tensor.copy_(_local_piece(lambda d, a, b: files.read(key, d, a, b), layout, rank, tensor.dtype))
        loaded.append(names[0])
    if missing and strict:
        raise CheckpointError(f"{len(missing)} tensor(s) of {type(model).__name__} missing from {files.directory}: "
                              + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))
    return loaded


def _build_sharded(model_class, config, mesh, shard_options: dict) -> nn.Module:
    from .sharder import shard

    with torch.device("meta"):
        is_module_class = isinstance(model_class, type) and issubclass(model_class, nn.Module)
        model = model_class(config) if is_module_class else model_class.from_config(config)  # Auto classes
    shard(model, mesh, **shard_options)
    materialize(model, init="buffers")  # every parameter comes from the checkpoint: no random init to overwrite
    return model


def from_pretrained(model_class, path: str | Path, mesh, **shard_options) -> nn.Module:
    """Build ``model_class`` (an HF model class or Auto class) on the meta device, shard it over ``mesh`` and read
    each rank's slice of each tensor straight from the HF safetensors checkpoint at ``path`` (single file or
    index + shards). ``shard_options`` are :func:`shardlib.shard`'s. Returns the model in eval mode, as HF does."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}: no config.json (not an HF checkpoint directory)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = _build_sharded(model_class, config, mesh, shard_options)
    load_hf_weights(model, SafetensorsFiles(path))
    return model.eval()


# --------------------------------------------------------------------------------------------- the sharded format
@dataclass(frozen=True)
class Piece:
    file: str
    dim: int | None
    start: int
    stop: int


def rank_file(rank: int, tp: int, stage: int | None = None) -> str:
    """The file of tp rank ``rank``'s pieces; under a pipeline, of pipeline rank ``stage``'s tp rank ``rank``."""
    prefix = "model" if stage is None else f"model-pp{stage:02d}"
    return f"{prefix}-tp{rank:02d}-of-{tp:02d}.safetensors"


def replicated_file(stage: int | None = None) -> str:
    return REPLICATED_FILE if stage is None else f"model-pp{stage:02d}-replicated.safetensors"


def _pieces(layout: Layout, stage: int | None = None) -> list[Piece]:
    if not layout.is_sharded:
        return [Piece(replicated_file(stage), None, 0, 0)]
    pieces = []
    for r in range(layout.num_shards):
        start, stop = layout.valid_range(r)
        if stop > start:
            pieces.append(Piece(rank_file(r, layout.num_shards, stage), layout.shard_dim, start, stop))
    return pieces


def hf_class_name(model: nn.Module) -> str:
    """The HF class of a (possibly loss-wrapped) sharded model."""
    return getattr(type(model), "_shardlib_base_class", type(model)).__name__


def _tensor_entry(layout: Layout, dtype: torch.dtype, aliases: list[str], stage: int | None = None) -> dict:
    return {"shape": list(layout.global_shape), "dtype": _dtype_name(dtype), "layout": layout.to_dict(),
            "aliases": aliases, "pieces": [vars(p) for p in _pieces(layout, stage)]}


OPTIMIZER_PREFIX = "optimizer."


def _saved_tensors(model: nn.Module, optimizer=None):
    """(name, tensor, layout, aliases) of everything a checkpoint holds: parameters and persistent buffers (tied
    ones once), then, with an optimizer, each parameter's state tensors as ``optimizer.<state>.<param name>``:
    moments shaped like the parameter share its layout, scalars (``step``) are replicated."""
    for tensor, names in _tensors_to_load(model):
        yield names[0], tensor, layout_of(model, names[0]), names[1:]
    if optimizer is None:
        return
    for tensor, names in _tensors_to_load(model):
        for key, value in optimizer.state.get(tensor, {}).items():
            if torch.is_tensor(value):
                layout = layout_of(model, names[0]) if value.shape == tensor.shape else Layout.replicated(value.shape)
                yield f"{OPTIMIZER_PREFIX}{key}.{names[0]}", value, layout, []


def _optimizer_hyperparameters(optimizer) -> list[dict] | None:
    if optimizer is None:
        return None
    return [{k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, str, type(None),
                                                                                 list, tuple))}
            for group in optimizer.param_groups]


def _rank_file_tensors(model: nn.Module, rank: int, optimizer=None) -> tuple[dict, dict]:
    """This rank's file contents: {file: {key: tensor}} (real rows only), and the metadata of the tensors this
    rank's pipeline stage writes (all of them without a pipeline; a tensor used by several stages is written by
    the lowest pipeline rank using it)."""
    split = getattr(model._shardlib, "pipeline", None) if hasattr(model, "_shardlib") else None
    stage = split.pp_rank if split is not None else None
    files: dict[str, dict[str, torch.Tensor]] = {}
    meta = {}
    for name, tensor, layout, aliases in _saved_tensors(model, optimizer):
        names = [name, *aliases]
        if split is not None and not split.writer(_parameter_names(names)):
            continue
        meta[names[0]] = _tensor_entry(layout, tensor.dtype, names[1:], stage)
        if layout.is_sharded:
            start, stop = layout.valid_range(rank)
            if stop > start:
                files.setdefault(rank_file(rank, layout.num_shards, stage), {})[names[0]] = \
                    tensor.detach().narrow(layout.shard_dim, 0, stop - start).contiguous()
        elif rank == 0:
            files.setdefault(replicated_file(stage), {})[names[0]] = tensor.detach().contiguous()
    return files, meta


def _parameter_names(names: list[str]) -> list[str]:
    """The model tensor names behind saved names (optimizer state ``optimizer.<key>.<param>`` -> ``<param>``)."""
    return [n[len(OPTIMIZER_PREFIX):].partition(".")[2] if n.startswith(OPTIMIZER_PREFIX) else n for n in names]


def _broadcast_str(value: str) -> str:
    holder = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return holder[0]


def save(model: nn.Module, directory: str | Path, *, optimizer=None, overwrite: bool = False) -> Path:
    """Write ``model``'s local shards (no gather) plus ``shardlib.json``; atomic (see module docstring). Every rank
    of the mesh must call it; data-parallel replicas other than dp rank 0 write nothing. With ``optimizer``, its
    per-parameter state (AdamW moments and step) is saved the same way, keyed by parameter name, and its
    hyperparameters go into the metadata, so training resumes exactly (also under another tp)."""
    state = model._shardlib
    mesh = state.mesh
    directory = Path(directory)
    is_writer = getattr(mesh, "dp", 1) == 1 or mesh.local_rank("dp") == 0
    if directory.exists() and not overwrite:
        raise CheckpointError(f"{directory} exists; pass overwrite=True to replace it")
    tmp = directory.parent / f".{directory.name}.tmp-{_broadcast_str(uuid.uuid4().hex[:12])}"
    tmp.mkdir(parents=True, exist_ok=True)
    files, meta = _rank_file_tensors(model, mesh.tp_rank, optimizer)
    written = {}
    if is_writer:
        for name, tensors in files.items():
            written[name] = _write_file(tmp, name, tensors)
    gathered = [(written, meta)]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        # small dicts between our own ranks: file names, checksums and (under a pipeline) each stage's tensors
        dist.all_gather_object(gathered, (written, meta))
    if not dist.is_initialized() or dist.get_rank() == 0:
        all_files = {k: v for files_of_rank, _ in gathered for k, v in files_of_rank.items()}
        all_meta = {k: v for _, meta_of_rank in gathered for k, v in meta_of_rank.items()}
        document = _document(hf_class_name(model), model.config.to_dict(), mesh.tp, all_meta, all_files)
        if state.pipeline is not None:
            document["pp"] = mesh.pp
            document["stages"] = [list(layers) for layers in state.pipeline.plan.layers]
        document["optimizer"] = _optimizer_hyperparameters(optimizer)
        _finish(tmp, directory, document)
    if dist.is_initialized():
        dist.barrier()
    return directory


def _document(model_class: str, config: dict, tp: int, tensors: dict, files: dict) -> dict:
    return {"format": FORMAT, "model_class": model_class, "config": config, "tp": tp, "tensors": tensors,
            "files": files}


def _finish(tmp: Path, directory: Path, document: dict | None) -> None:
    """Write the metadata last, then swap the finished directory in (the old one survives until then)."""
    if document is not None:
        with open(tmp / METADATA, "w") as f:
            f.write(json.dumps(document, indent=1))
            f.flush()
            os.fsync(f.fileno())
    old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)


def _write_file(tmp: Path, name: str, tensors: dict) -> dict:
    save_file(tensors, str(tmp / name), metadata={"format": "pt", "writer": FORMAT})
    return {"bytes": (tmp / name).stat().st_size, "sha256": sha256_of(tmp / name)}


class ShardedCheckpoint:
    """A sharded checkpoint directory: its metadata, verified files, and slice reads across pieces."""

    def __init__(self, directory: str | Path, *, verify: bool = True):
        self.directory = Path(directory)
        meta_path = self.directory / METADATA
        if not meta_path.exists():
            raise CheckpointError(f"{self.directory}: no {METADATA} (not a shardlib checkpoint, or an unfinished save)")
        try:
            self.meta = json.loads(meta_path.read_text())
        except ValueError as exc:
            raise CheckpointError(f"{meta_path}: not valid JSON ({exc})") from None
        if self.meta.get("format") != FORMAT:
            raise CheckpointError(f"{meta_path}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        self.tensors = self.meta["tensors"]
        self._verified: dict[str, Path] = {}  # file name -> checked path
        self._readers: dict[str, SafetensorsFiles] = {}
        self._verify = verify
        for t in self.tensors.values():
            for p in t["pieces"]:
                _inside(self.directory, p["file"])

    def problems(self) -> list[str]:
        """Completeness and checksums of every file; an empty list when the checkpoint is whole."""
        out = []
        needed = {p["file"] for t in self.tensors.values() for p in t["pieces"]}
        for name in sorted(needed - set(self.meta["files"])):
            out.append(f"{name}: named by tensors but not listed in {METADATA}")
        for name, info in sorted(self.meta["files"].items()):
            try:
                self._check_file(name, info)
            except CheckpointError as exc:
                out.append(str(exc))
        return out

    def _check_file(self, name: str, info: dict) -> Path:
        if name in self._verified:
            return self._verified[name]
        path = _inside(self.directory, name)
        if not path.exists():
            raise CheckpointError(f"missing checkpoint file {path}")
        if path.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, {METADATA} records {info['bytes']} (truncated?)")
        if self._verify and sha256_of(path) != info["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (corrupted)")
        self._verified[name] = path
        return path

    def _reader(self, file: str) -> SafetensorsFiles:
        """One open reader per file (verified once) for every tensor stored in it."""
        if file not in self._readers:
            path = self._check_file(file, self.meta["files"][file])
            keys = {name: path.name for name, t in self.tensors.items() if any(p["file"] == file for p in t["pieces"])}
            self._readers[file] = SafetensorsFiles(self.directory, keys)
        return self._readers[file]

    def read(self, name: str, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
        """Global rows ``[start, stop)`` of ``dim`` of tensor ``name`` (whole tensor when dim is None), read from
        the pieces that overlap them."""
        t = self.tensors[name]
        parts = []
        for p in t["pieces"]:
            reader = self._reader(p["file"])
            if p["dim"] is None:
                whole = reader.read(name)
                return whole if dim is None else whole.narrow(dim, start, (stop or whole.shape[dim]) - start)
            if dim is None:
                parts.append(reader.read(name))
                continue
            if dim != p["dim"]:
                raise CheckpointError(f"{name}: stored split along dim {p['dim']}, requested along {dim}")
            lo, hi = max(start, p["start"]), min(stop, p["stop"])
            if lo < hi:
                parts.append(reader.read(name, dim, lo - p["start"], hi - p["start"]))
        if not parts:
            raise CheckpointError(f"{name}: no stored rows for [{start}, {stop}) of dim {dim}")
        return torch.cat(parts, dim=t["pieces"][0]["dim"] if dim is None else dim)


def _read_local(ckpt: ShardedCheckpoint, name: str, layout: Layout, rank: int, dtype: torch.dtype) -> torch.Tensor:
    stored = tuple(ckpt.tensors[name]["shape"])
    if stored != layout.global_shape:
        raise CheckpointError(f"tensor {name!r} in {ckpt.directory} has shape {stored}, the model expects "
                              f"{layout.global_shape}")
    return _local_piece(lambda d, a, b: ckpt.read(name, d, a, b), layout, rank, dtype)


@torch.no_grad()
def load(model: nn.Module, directory: str | Path, *, optimizer=None) -> nn.Module:
    """Load a sharded checkpoint into a sharded model of the same architecture under any tp layout (resharding:
    each rank reads only the overlapping rows of the stored pieces); with ``optimizer`` (built over this model's
    parameters), restore its state and hyperparameters too."""
    ckpt = ShardedCheckpoint(directory)
    expected = hf_class_name(model)
    if ckpt.meta["model_class"] != expected:
        raise CheckpointError(f"{directory} holds a {ckpt.meta['model_class']}, not a {expected}")
    if any(t.device.type == "meta" for t, _ in _local_tensors(model)):
        materialize(model, init="buffers")  # every parameter is read below
    rank = _tp_rank(model)
    for tensor, names in _local_tensors(model):
        name = next((n for n in names if n in ckpt.tensors), None)
        if name is None:
            raise CheckpointError(f"tensor {names[0]!r} of {type(model).__name__} is not in {directory}")
        tensor.copy_(_read_local(ckpt, name, layout_of(model, names[0]), rank, tensor.dtype))
    if optimizer is not None:
        _load_optimizer(model, ckpt, optimizer, rank)
    return model


def _load_optimizer(model: nn.Module, ckpt: ShardedCheckpoint, optimizer, rank: int) -> None:
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
    for tensor, names in _local_tensors(model):
        state = {}
        param_layout = layout_of(model, names[0])
        for key, stored in stored_state.get(names[0], {}).items():
            shape = tuple(ckpt.tensors[stored]["shape"])
            layout = param_layout if shape == param_layout.global_shape else Layout.replicated(shape)
            state[key] = _read_local(ckpt, stored, layout, rank, DTYPES[ckpt.tensors[stored]["dtype"]])
        if state:
            optimizer.state[tensor] = state


def from_sharded(model_class, directory: str | Path, mesh, **shard_options) -> nn.Module:
    """Build ``model_class`` from the config stored in a sharded checkpoint, shard it over ``mesh`` (any tp) and
    load it."""
    from transformers import AutoConfig

    ckpt = ShardedCheckpoint(directory)
    config_dict = dict(ckpt.meta["config"])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    model = _build_sharded(model_class, config, mesh, shard_options)
    return load(model, directory).eval()


def export_hf(directory: str | Path, destination: str | Path, *, overwrite: bool = False,
              max_shard_bytes: int = 2 << 30, progress=None) -> Path:
    """Write a plain HF checkpoint (Hub key names, ``config.json``; ``model.safetensors`` or index + shards of at
    most ``max_shard_bytes``) from a sharded checkpoint, one full tensor at a time. Needs no process group."""
    from shardlib.policies import policy_for_class_name  # noqa: PLC0415

    ckpt = ShardedCheckpoint(directory)
    policy = policy_for_class_name(ckpt.meta["model_class"])
    destination = Path(destination)
    if destination.exists() and not overwrite:
        raise CheckpointError(f"{destination} exists; pass overwrite=True to replace it")
    tmp = destination.parent / f".{destination.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    written: list[tuple[str, list[str]]] = []  # (part file, hub keys); one part held in memory at a time
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        part = f".part-{len(written)}"
        save_file(current, str(tmp / part), metadata={"format": "pt"})
        written.append((part, list(current)))

    for name in ckpt.tensors:
        tensor = ckpt.read(name, None, 0, None).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
            current, size = {}, 0
        current[policy.to_hub_key(name)] = tensor
        size += nbytes
        if progress:
            progress(name, nbytes)
    flush()
    if len(written) == 1:
        os.replace(tmp / written[0][0], tmp / "model.safetensors")
    else:
        weight_map = {}
        for i, (part, keys) in enumerate(written):
            final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
            os.replace(tmp / part, tmp / final)
            weight_map |= {k: final for k in keys}
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(ckpt.meta["config"], indent=1))
    _finish(tmp, destination, None)
    return destination


def _config_and_class(source: Path):
    """(HF config, model class, tensor reader(name, dim, start, stop), policy) of an HF or sharded checkpoint."""
    import transformers
    from transformers import AutoConfig

    from shardlib.policies import policy_for_class_name  # noqa: PLC0415

    if (source / METADATA).exists():
        ckpt = ShardedCheckpoint(source)
        config_dict = dict(ckpt.meta["config"])
        config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
        class_name = ckpt.meta["model_class"]
        return config, class_name, ckpt.read
    if not (source / "config.json").exists():
        raise CheckpointError(f"{source}: neither a shardlib checkpoint ({METADATA}) nor an HF one (config.json)")
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    class_name = (config.architectures or [None])[0]
    if class_name is None or not hasattr(transformers, class_name):
        raise CheckpointError(f"{source}/config.json names no known model class (architectures={config.architectures})")
    files = SafetensorsFiles(source)
    to_hub = policy_for_class_name(class_name).to_hub_key
    return config, class_name, lambda name, dim, start, stop: files.read(to_hub(name), dim, start, stop)


def convert(source: str | Path, destination: str | Path, *, tp: int, pp: int = 1, overwrite: bool = False,
            progress=None) -> Path:
    """HF -> sharded or sharded -> sharded (any tp, any pp), without a process group: the layouts come from
    sharding the model on the meta device offline, the pipeline stages from :func:`shardlib.pipeline.stage_plan`.
    With ``pp > 1`` each stage's tensors go to that stage's files (``model-ppXX-...``), as a pipelined ``save``
    writes them. One file is held in memory at a time (at most 1/tp of a stage)."""
    import transformers

    from .mesh import OfflineMesh
    from .pipeline import stage_plan, tensor_owners
    from .policies import policy_for
    from .sharder import shard

    source, destination = Path(source), Path(destination)
    if destination.exists() and not overwrite:
        raise CheckpointError(f"{destination} exists; pass overwrite=True / --overwrite to replace it")
    if pp < 1 or tp < 1:
        raise CheckpointError(f"--tp and --pp must be >= 1, got tp={tp}, pp={pp}")
    config, class_name, read = _config_and_class(source)
    with torch.device("meta"):
        model = getattr(transformers, class_name)(config)
    owners = None
    if pp > 1:  # before sharding: the cost model reads the full shapes
        owners = tensor_owners(model, stage_plan(model, policy_for(model).plan(model, tp).trunk, pp))
    shard(model, OfflineMesh(tp=tp))  # validates the layout: e.g. heads that the new tp does not divide

    def stage_of(names):
        return None if owners is None else min(s for n in names for s in owners.get(n, {0}))

    entries = [(names, layout_of(model, names[0]), tensor.dtype, stage_of(names))
               for tensor, names in _tensors_to_load(model)]
    tmp = destination.parent / f".{destination.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    try:
        meta = {names[0]: _tensor_entry(layout, dtype, names[1:], stage) for names, layout, dtype, stage in entries}
        written = {}
        for stage in sorted({e[3] for e in entries}, key=lambda x: -1 if x is None else x):
            mine = [e for e in entries if e[3] == stage]
            for rank in [None, *range(tp)]:  # the replicated file, then each tp rank's file
                tensors = {}
                for names, layout, _, _ in mine:
                    if rank is None and not layout.is_sharded:
                        tensors[names[0]] = read(names[0], None, 0, None)
                    elif rank is not None and layout.is_sharded:
                        start, stop = layout.valid_range(rank)
                        if stop > start:
                            tensors[names[0]] = read(names[0], layout.shard_dim, start, stop).contiguous()
                    if progress and names[0] in tensors:
                        progress(names[0], tensors[names[0]].numel() * tensors[names[0]].element_size())
                if tensors:
                    name = replicated_file(stage) if rank is None else rank_file(rank, tp, stage)
                    written[name] = _write_file(tmp, name, tensors)
        document = _document(class_name, config.to_dict(), tp, meta, written)
        if pp > 1:
            document["pp"] = pp
        _finish(tmp, destination, document)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return destination
