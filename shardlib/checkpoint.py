"""Checkpoints: HF safetensors straight into shards, the sharded format, resharding and export to HF.

Files are read and written by :mod:`shardlib.safetensors_io`: no file is ever mapped (a rank's resident memory is
its local shards: slices are read with ``preadv`` straight into the parameters), writes stream in bounded blocks
with an xxh3-128 checksum computed on the way, and nothing is ever unpickled. ``convert`` reads each source tensor
once and sends each block's rows to the output files that hold them.

The sharded format (``docs/checkpoint-format.md``) is a directory with

* ``shardlib.json``: format version, model class, model config, and for every tensor its global shape, dtype,
  layout, aliases (tied names) and *pieces*: which file holds which rows ``[start, stop)`` of which dim;
  plus every file's size and checksum;
* ``model-tp{r}-of-{n}.safetensors``: rank r's rows of every sharded tensor (padding is not stored);
* ``model-replicated.safetensors``: every replicated tensor, written once.

Writes are atomic: all ranks write into a hidden temporary directory next to the destination, and the directory
appears under its final name (replacing an older checkpoint only with ``overwrite``) after every rank finished
and fsynced its files and ``shardlib.json`` is complete. A crash mid-save leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .fsdp import like, local, whole
from .layout import Layout, layout_of
from .optim import holds_state, param_state, set_param_state
from .safetensors_io import (  # noqa: F401  (sha256_of, DIRECT_ROW: re-exported, part of this module's API)
    BLOCK, DIRECT_ROW, _ST_RANK, CheckpointError, ReaderPool, SafetensorsFile, SafetensorsFiles, _dtype_name,
    _inside, _OutFile, _scatter_read, _Writer,
    checksum_of, file_checksum, sha256_of,
)
from .sharded import shard_state
from .state import _pipeline, materialize

FORMAT = "shardlib-sharded-v2"
READABLE_FORMATS = ("shardlib-sharded-v1", FORMAT)  # v1: the same layout with SHA-256 file checksums
METADATA = "shardlib.json"
REPLICATED_FILE = "model-replicated.safetensors"


def _fill_local(read_into, layout: Layout, rank: int, out: torch.Tensor, what: str) -> torch.Tensor:
    """Fill ``out``, this rank's local tensor for ``layout``, in place: ``read_into(dim, start, stop, view)`` reads
    global rows straight into ``view`` (a narrow of ``out``); padding rows are zeroed in place. No temporary."""
    if tuple(out.shape) != tuple(layout.local_shape):
        raise CheckpointError(f"{what}: the local tensor has shape {tuple(out.shape)}, its layout says "
                              f"{tuple(layout.local_shape)}")
    if not layout.is_sharded:
        read_into(None, 0, None, out)
        return out
    d = layout.shard_dim
    start, stop = layout.valid_range(rank)
    valid = max(stop - start, 0)
    if valid:
        read_into(d, start, stop, out.narrow(d, 0, valid))
    if valid < out.shape[d]:
        out.narrow(d, valid, out.shape[d] - valid).zero_()
    return out

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
    split = _pipeline(model)
    if split is None:
        return _tensors_to_load(model)
    local = {id(p) for p in split.local_parameters()}
    return [(t, names) for t, names in _tensors_to_load(model)
            if not isinstance(t, nn.Parameter) or id(t) in local]


def _tp_rank(model: nn.Module) -> int:
    state = shard_state(model, required=False)
    return state.mesh.tp_rank if state is not None else 0


@torch.no_grad()
def load_hf_weights(model: nn.Module, files: SafetensorsFiles, *, strict: bool = True) -> list[str]:
    """Fill a sharded model (materialized) with its slices of an HF checkpoint, read straight into the parameters;
    return the names loaded."""
    state = shard_state(model, required=False)
    policy = state.policy if state is not None else None
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
        _fill_local(lambda d, a, b, view: files.read_into(key, view, d, a, b), layout, rank, tensor, key)
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
    index + shards) into the parameters. ``shard_options`` are :func:`shardlib.shard`'s. Returns the model in eval
    mode, as HF does."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}: no config.json (not an HF checkpoint directory)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = _build_sharded(model_class, config, mesh, shard_options)
    with SafetensorsFiles(path) as files:
        load_hf_weights(model, files)
    return model.eval()


# --------------------------------------------------------------------------------------------- the sharded format
@dataclass(frozen=True)
class Piece:
    file: str
    dim: int | None
    start: int
    stop: int


def rank_file(rank: int, tp: int, stage: int | None = None, dp: int | None = None) -> str:
    """The file of tp rank ``rank``'s pieces; under a pipeline, of pipeline rank ``stage``'s tp rank ``rank``;
    with ``dp``, of the optimizer state that data-parallel rank holds (an optimizer partitioned over dp)."""
    prefix = "model" if stage is None else f"model-pp{stage:02d}"
    return f"{prefix}-tp{rank:02d}-of-{tp:02d}{_dp_suffix(dp)}.safetensors"


def replicated_file(stage: int | None = None, dp: int | None = None) -> str:
    if stage is None and dp is None:
        return REPLICATED_FILE
    prefix = "model" if stage is None else f"model-pp{stage:02d}"
    return f"{prefix}-replicated{_dp_suffix(dp)}.safetensors"


def _dp_suffix(dp: int | None) -> str:
    return "" if dp is None else f"-dp{dp:02d}"


def _pieces(layout: Layout, stage: int | None = None, dp: int | None = None) -> list[Piece]:
    if not layout.is_sharded:
        return [Piece(replicated_file(stage, dp), None, 0, 0)]
    pieces = []
    for r in range(layout.num_shards):
        start, stop = layout.valid_range(r)
        if stop > start:
            pieces.append(Piece(rank_file(r, layout.num_shards, stage, dp), layout.shard_dim, start, stop))
    return pieces


def hf_class_name(model: nn.Module) -> str:
    """The HF class of a (possibly loss-wrapped, possibly FSDP2-wrapped) sharded model."""
    cls = type(model)
    if issubclass(cls, FSDPModule):  # fully_shard swaps in a class FSDP<name>(FSDPModule, <the model's class>)
        cls = next(base for base in cls.__bases__ if not issubclass(base, FSDPModule))
    return getattr(cls, "_shardlib_base_class", cls).__name__


def _tensor_entry(layout: Layout, dtype: torch.dtype, aliases: list[str], stage: int | None = None,
                  dp: int | None = None) -> dict:
    return {"shape": list(layout.global_shape), "dtype": _dtype_name(dtype), "layout": layout.to_dict(),
            "aliases": aliases, "pieces": [vars(p) for p in _pieces(layout, stage, dp)]}


OPTIMIZER_PREFIX = "optimizer."


def _saved_tensors(model: nn.Module, optimizer=None):
    """(name, tensor, layout, aliases, partitioned) of everything a checkpoint holds: parameters and persistent
    buffers (tied ones once), then, with an optimizer, each parameter's state tensors held on this rank as
    ``optimizer.<state>.<param name>`` (master weights: ``optimizer.master.<param name>``): moments shaped like
    the parameter share its layout, scalars (``step``) are replicated. ``partitioned``: an optimizer partitioned over
    dp (:class:`shardlib.optim.PartitionedOptimizer`), whose states each dp rank writes for its own parameters.
    Parameters sharded over dp by FSDP2 (zero=3) and their states are gathered to their tp-local tensors here (a
    collective on the dp group: every rank walks the same tensors)."""
    for tensor, names in _tensors_to_load(model):
        yield names[0], whole(tensor), layout_of(model, names[0]), names[1:], False
    if optimizer is None:
        return
    partitioned = getattr(optimizer, "partitioned", False)
    for tensor, names in _tensors_to_load(model):
        for key, value in param_state(optimizer, tensor).items():
            if torch.is_tensor(value):
                layout = layout_of(model, names[0]) if value.shape == tensor.shape else Layout.replicated(value.shape)
                yield f"{OPTIMIZER_PREFIX}{key}.{names[0]}", whole(value), layout, [], partitioned


def _optimizer_hyperparameters(optimizer) -> list[dict] | None:
    if optimizer is None:
        return None
    return [{k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, str, type(None),
                                                                                 list, tuple))}
            for group in optimizer.param_groups]


def _rank_file_tensors(model: nn.Module, rank: int, optimizer=None, *, replica: int | None = 0) -> tuple[dict, dict]:
    """This rank's file contents: {file: {key: tensor view}} (real rows only, no copies), and the metadata of the
    tensors this rank's pipeline stage writes (all of them without a pipeline; a tensor used by several stages is
    written by the lowest pipeline rank using it). ``replica``: this rank's dp rank when it is the one replica of
    its (pp, tp) position that writes (sp rank 0), else None; replicated tensors are written by dp rank 0, the
    state of a partitioned optimizer by the dp rank holding it."""
    split = _pipeline(model)
    stage = split.pp_rank if split is not None else None
    files: dict[str, dict[str, torch.Tensor]] = {}
    meta = {}
    for name, tensor, layout, aliases, partitioned in _saved_tensors(model, optimizer):
        names = [name, *aliases]
        if split is not None and not split.writer(_parameter_names(names)):
            continue
        dp = replica if partitioned else None
        meta[names[0]] = _tensor_entry(layout, tensor.dtype, names[1:], stage, dp)
        if replica is None or (replica != 0 and not partitioned):
            continue
        if layout.is_sharded:
            start, stop = layout.valid_range(rank)
            if stop > start:
                files.setdefault(rank_file(rank, layout.num_shards, stage, dp), {})[names[0]] = \
                    tensor.detach().narrow(layout.shard_dim, 0, stop - start)  # a view: streamed
        elif rank == 0:
            files.setdefault(replicated_file(stage, dp), {})[names[0]] = tensor.detach()
    return files, meta


def _parameter_names(names: list[str]) -> list[str]:
    """The model tensor names behind saved names (optimizer state ``optimizer.<key>.<param>`` -> ``<param>``)."""
    return [n[len(OPTIMIZER_PREFIX):].partition(".")[2] if n.startswith(OPTIMIZER_PREFIX) else n for n in names]


def _broadcast_str(value: str, group=None) -> str:
    holder = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
    return holder[0]


@dataclass
class StagedSave:
    """One rank's part of a checkpoint, ready to be written: ``files`` ({file: {key: tensor}}, views of the live
    tensors or, staged with ``copy=True``, private copies), the metadata of the tensors this rank describes, and
    the document fields only rank 0 writes."""

    files: dict
    meta: dict
    document: dict


def _host_copy(tensor: torch.Tensor, buffers: dict | None, key) -> torch.Tensor:
    """``tensor`` copied to host memory, into ``buffers[key]`` when it fits (reused across saves: no fresh
    allocation to fault in; pinned for CUDA tensors, so the copy runs asynchronously)."""
    tensor = tensor.detach()
    out = buffers.get(key) if buffers is not None else None
    if out is None or out.shape != tensor.shape or out.dtype != tensor.dtype:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        if buffers is not None:
            buffers[key] = out
    out.copy_(tensor, non_blocking=tensor.is_cuda)
    return out


def stage(model: nn.Module, *, optimizer=None, copy: bool = False, extra_files: dict | None = None,
          buffers: dict | None = None) -> StagedSave:
    """Collect what :func:`save` writes from this rank. ``copy``: copy every tensor to host memory (the model may
    train on while the copies are written, see :func:`commit`), into ``buffers`` (a dict kept by the caller and
    reused by its next save, once this one is committed). ``extra_files``: {file: {key: tensor}} this
    rank writes whatever its mesh position (per-rank state), listed and checksummed like the model files. Local
    work only, no collective."""
    state = shard_state(model)
    mesh = state.mesh
    # one copy per tensor-parallel rank: the dp replicas and the all-to-all sequence-parallel peers hold the same
    # (the dp ranks of a partitioned optimizer each write the state they hold)
    sp_writer = mesh.sp == 1 or mesh.local_rank("sp") == 0
    dp_rank = mesh.local_rank("dp") if mesh.dp > 1 else 0
    files, meta = _rank_file_tensors(model, mesh.tp_rank, optimizer, replica=dp_rank if sp_writer else None)
    files |= extra_files or {}
    if copy:
        files = {f: {k: _host_copy(t, buffers, (f, k)) for k, t in tensors.items()} for f, tensors in files.items()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the asynchronous copies are complete before anything reads them
    document = {"model_class": hf_class_name(model), "config": model.config.to_dict(), "tp": mesh.tp,
                "optimizer": _optimizer_hyperparameters(optimizer)}
    if state.pipeline is not None:
        document["pp"] = mesh.pp
        document["stages"] = [list(layers) for layers in state.pipeline.plan.layers]
    return StagedSave(files=files, meta=meta, document=document)


def commit(staged: StagedSave, directory: str | Path, *, overwrite: bool = False, group=None,
           metadata: dict | None = None) -> Path:
    """Write a :func:`stage`-d checkpoint atomically (module docstring). Every rank of ``group`` (default: the
    world) calls it; collectives run on ``group`` only, so a background thread can commit on a group of its own
    while training goes on. ``metadata``: extra top-level fields of ``shardlib.json`` (rank 0's are written)."""
    directory = Path(directory)
    if directory.exists() and not overwrite:
        raise CheckpointError(f"{directory} exists; pass overwrite=True to replace it")
    tmp = directory.parent / f".{directory.name}.tmp-{_broadcast_str(uuid.uuid4().hex[:12], group)}"
    tmp.mkdir(parents=True, exist_ok=True)
    written = _write_files(tmp, staged.files) if staged.files else {}  # fsynced before rank 0 writes the metadata
    gathered = [(written, staged.meta)]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size(group)
        # small dicts between our own ranks: file names, checksums and (under a pipeline) each stage's tensors
        dist.all_gather_object(gathered, (written, staged.meta), group=group)
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        all_files = {k: v for files_of_rank, _ in gathered for k, v in files_of_rank.items()}
        all_meta = {k: v for _, meta_of_rank in gathered for k, v in meta_of_rank.items()}
        document = {"format": FORMAT, **staged.document, "tensors": all_meta, "files": all_files, **(metadata or {})}
        _finish(tmp, directory, document)
    if dist.is_initialized():
        dist.barrier(group=group)
    return directory


def save(model: nn.Module, directory: str | Path, *, optimizer=None, overwrite: bool = False) -> Path:
    """Write ``model``'s local shards (no gather, no copies: each tensor is streamed from its own memory) plus
    ``shardlib.json``; atomic (see module docstring). Every rank of the mesh must call it; replicas other than dp
    rank 0 and all-to-all sp rank 0 write nothing. With ``optimizer``, its per-parameter state (AdamW moments and
    step) is saved the same way, keyed by parameter name, and its hyperparameters go into the metadata, so training
    resumes exactly (also under another tp)."""
    return commit(stage(model, optimizer=optimizer), directory, overwrite=overwrite)


def _document(model_class: str, config: dict, tp: int, tensors: dict, files: dict) -> dict:
    return {"format": FORMAT, "model_class": model_class, "config": config, "tp": tp, "tensors": tensors,
            "files": files}


def _fsync_directory(path: Path) -> None:
    """Make a directory's entries (new files, a rename) durable, where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _finish(tmp: Path, directory: Path, document: dict | None) -> None:
    """Write the metadata last (the data files are fsynced already), then swap the finished directory in (the old
    one survives until then)."""
    if document is not None:
        with open(tmp / METADATA, "w") as f:
            f.write(json.dumps(document, indent=1))
            f.flush()
            os.fsync(f.fileno())
    _fsync_directory(tmp)
    old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    _fsync_directory(directory.parent)
    shutil.rmtree(old, ignore_errors=True)


def _write_files(directory: Path, files: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Stream ``{file: {key: tensor}}`` into safetensors files (tensors may be strided views); the files' sizes and
    checksums. Every file is fsynced when this returns."""
    with _Writer(directory) as writer:
        for name, tensors in files.items():
            out = writer.open(name, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()],
                              {"format": "pt", "writer": FORMAT})
            for key in out.order:
                writer.tensor(out, key, tensors[key])
        return writer.finish()


class ShardedCheckpoint(ReaderPool):
    """A sharded checkpoint directory: its metadata, verified files, and slice reads across pieces."""

    def __init__(self, directory: str | Path, *, verify: bool = True):
        super().__init__()
        self.directory = Path(directory)
        meta_path = self.directory / METADATA
        if not meta_path.exists():
            raise CheckpointError(f"{self.directory}: no {METADATA} (not a shardlib checkpoint, or an unfinished save)")
        try:
            self.meta = json.loads(meta_path.read_text())
        except ValueError as exc:
            raise CheckpointError(f"{meta_path}: not valid JSON ({exc})") from None
        if self.meta.get("format") not in READABLE_FORMATS:
            raise CheckpointError(f"{meta_path}: format {self.meta.get('format')!r}, expected one of "
                                  f"{', '.join(READABLE_FORMATS)}")
        self.tensors = self.meta["tensors"]
        self._verified: dict[str, Path] = {}  # file name -> checked path
        self._verify = verify
        for file in {p["file"] for t in self.tensors.values() for p in t["pieces"]}:
            _inside(self.directory, file)

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

    def verified_file(self, name: str) -> Path:
        """The path of file ``name`` listed in the metadata, after checking its size and checksum."""
        if name not in self.meta["files"]:
            raise CheckpointError(f"{self.directory / name}: not listed in {METADATA}")
        return self._check_file(name, self.meta["files"][name])

    def _check_file(self, name: str, info: dict) -> Path:
        if name in self._verified:
            return self._verified[name]
        path = _inside(self.directory, name)
        if not path.exists():
            raise CheckpointError(f"missing checkpoint file {path}")
        if path.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, {METADATA} records {info['bytes']} (truncated?)")
        if self._verify:
            algorithm, value = file_checksum(info)
            if checksum_of(path, algorithm) != value:
                raise CheckpointError(f"{path}: checksum mismatch (corrupted; {algorithm})")
        self._verified[name] = path
        return path

    def _reader(self, file: str) -> SafetensorsFile:
        """One open reader per file (verified once) for every tensor stored in it."""
        if file not in self._readers and file not in self.meta["files"]:
            raise CheckpointError(f"{self.directory / file}: named by tensors but not listed in {METADATA}")
        return self._reader_for(file, lambda: self._check_file(file, self.meta["files"][file]))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        value = getattr(torch, str(self.tensors[name]["dtype"]), None)
        if not isinstance(value, torch.dtype):
            raise CheckpointError(f"{self.directory}: tensor {name!r} has unknown dtype "
                                  f"{self.tensors[name]['dtype']!r}")
        return value

    def extents(self, name: str, start: int = 0,
                stop: int | None = None) -> list[tuple[SafetensorsFile, int, int]] | None:
        """Where global dim-0 rows ``[start, stop)`` of ``name`` lie, as ``[(file, offset, nbytes)]`` in order
        (the whole tensor when ``stop`` is None and ``start`` 0), or None when they are not whole byte ranges of
        the files (pieces split along another dim) or the files store another dtype. Opens (and so verifies) the
        files."""
        t = self.tensors[name]
        pieces, dtype = t["pieces"], self.dtype(name)
        shape = tuple(t["shape"])
        whole = next((p for p in pieces if p["dim"] is None), None)
        if whole is not None:
            reader = self._reader(whole["file"])
            if reader.entry(name).dtype != dtype or reader.entry(name).shape != shape:
                return None
            return [reader.extent(name, start, stop)]
        if not shape or any(p["dim"] != 0 for p in pieces):
            return None
        stop = shape[0] if stop is None else stop
        out, covered = [], start
        for p in sorted(pieces, key=lambda p: p["start"]):
            lo, hi = max(covered, p["start"]), min(stop, p["stop"])
            if lo >= hi:
                continue
            if lo != covered:
                return None  # a gap: leave the error to read_into
            reader = self._reader(p["file"])
            if reader.entry(name).dtype != dtype or reader.entry(name).shape[1:] != shape[1:]:
                return None
            out.append(reader.extent(name, lo - p["start"], hi - p["start"]))
            covered = hi
        return out if covered == stop else None

    def read(self, name: str, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
        """Global rows ``[start, stop)`` of ``dim`` of tensor ``name`` (whole tensor when dim is None), as a new
        tensor read from the pieces that overlap them."""
        shape = list(self.shape(name))
        if dim is not None:
            shape[dim] = (shape[dim] if stop is None else stop) - start
        return self.read_into(name, torch.empty(shape, dtype=self.dtype(name)), dim, start, stop)

    def read_into(self, name: str, out: torch.Tensor, dim: int | None = None, start: int = 0,
                  stop: int | None = None) -> torch.Tensor:
        """Read global rows ``[start, stop)`` of ``dim`` of tensor ``name`` (all of it when dim is None) into
        ``out`` (that shape; may be a strided view): each overlapping piece is read straight into its part of
        ``out``. Pieces split along another dim than ``dim`` each fill their own columns of ``out``."""
        t = self.tensors[name]
        pieces = t["pieces"]
        if any(p["dim"] is None for p in pieces):  # stored whole
            return self._reader(pieces[0]["file"]).read_into(name, out, dim, start, stop)
        shape, pdim = tuple(t["shape"]), pieces[0]["dim"]
        if dim is None:
            dim, start, stop = pdim, 0, shape[pdim]
        stop = shape[dim] if stop is None else stop
        covered = 0
        for p in pieces:
            if p["dim"] != pdim:
                raise CheckpointError(f"{self.directory}: tensor {name!r} has pieces split along dims "
                                      f"{sorted({q['dim'] for q in pieces})}")
            if dim == pdim:
                lo, hi = max(start, p["start"]), min(stop, p["stop"])
                if lo < hi:
                    self._reader(p["file"]).read_into(name, out.narrow(dim, lo - start, hi - lo), dim,
                                                      lo - p["start"], hi - p["start"])
                    covered += hi - lo
            else:
                rows = p["stop"] - p["start"]
                self._reader(p["file"]).read_into(name, out.narrow(pdim, p["start"], rows), dim, start, stop)
                covered += rows
        wanted = stop - start if dim == pdim else shape[pdim]
        if covered != wanted:
            raise CheckpointError(f"{self.directory}: the pieces of tensor {name!r} cover {covered} of the {wanted} "
                                  f"rows [{start if dim == pdim else 0}, ...) of dim {pdim}")
        return out


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


def _read_local(ckpt: ShardedCheckpoint, name: str, layout: Layout, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A new local tensor for ``layout`` read from ``ckpt`` (optimizer state: there is no tensor to fill yet)."""
    _check_stored_shape(ckpt, name, layout)
    out = torch.empty(layout.local_shape, dtype=dtype)
    return _fill_local(lambda d, a, b, view: ckpt.read_into(name, view, d, a, b), layout, rank, out, name)


@torch.no_grad()
def load(model: nn.Module, directory: str | Path, *, optimizer=None) -> nn.Module:
    """Load a sharded checkpoint into a sharded model of the same architecture under any tp layout (resharding:
    each rank reads only the overlapping rows of the stored pieces, straight into its parameters); with
    ``optimizer`` (built over this model's parameters), restore its state and hyperparameters too."""
    with ShardedCheckpoint(directory) as ckpt:
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
            layout = layout_of(model, names[0])
            _check_stored_shape(ckpt, name, layout)
            target = whole_buffer(tensor)
            _fill_local(lambda d, a, b, view: ckpt.read_into(name, view, d, a, b), layout, rank, target, name)
            if target is not tensor:
                local(tensor).copy_(local(like(target, tensor)))
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
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for tensor, names in _local_tensors(model):
        if not holds_state(optimizer, tensor):
            continue  # another dp rank steps this parameter (a partitioned optimizer)
        state = {}
        param_layout = layout_of(model, names[0])
        for key, stored in stored_state.get(names[0], {}).items():
            shape = tuple(ckpt.tensors[stored]["shape"])
            layout = param_layout if shape == param_layout.global_shape else Layout.replicated(shape)
            value = _read_local(ckpt, stored, layout, rank, ckpt.dtype(stored))
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
    from transformers import AutoConfig

    ckpt = ShardedCheckpoint(directory)
    config_dict = dict(ckpt.meta["config"])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    model = _build_sharded(model_class, config, mesh, shard_options)
    return load(model, directory).eval()


# ------------------------------------------------------------------------------------ streamed copies of tensors
def _stream_rows(writer: _Writer, source, key: str, shape: tuple[int, ...], dtype: torch.dtype, start: int,
                 stop: int, out: _OutFile) -> None:
    """Copy dim-0 rows ``[start, stop)`` of tensor ``key`` of ``source`` (anything with ``read_into``) to ``out``.
    When the source stores them as whole byte ranges of its files (``source.extents``), they are copied inside the
    kernel (:meth:`_Writer.copy`: ``copy_file_range``, hashed from the source on the way); otherwise in blocks of
    at most 4 MiB: each block is read straight into a pool buffer, hashed and handed to the writer."""
    extents = source.extents(key, start, stop if shape else None) if hasattr(source, "extents") else None
    if extents is not None:
        for file, offset, nbytes in extents:
            writer.copy(out, file, offset, nbytes)
        return
    if not shape:  # a scalar
        block = writer.buffer()
        source.read_into(key, block[:dtype.itemsize].view(dtype).view(()))
        writer.emit(out, memoryview(block.numpy())[:dtype.itemsize], block)
        return
    row = math.prod(shape[1:]) * dtype.itemsize
    if row == 0:
        return
    step = max(1, BLOCK // row)
    for i in range(start, stop, step):
        k = min(step, stop - i)
        pooled = k * row <= BLOCK
        block = writer.buffer() if pooled else torch.empty(k * row, dtype=torch.uint8)
        source.read_into(key, block[:k * row].view(dtype).view(k, *shape[1:]), 0, i, i + k)
        writer.emit(out, memoryview(block.numpy())[:k * row], block if pooled else None)


def _stream_tensor(writer: _Writer, source, key: str, dtype: torch.dtype, layout: Layout, outs: dict) -> int:
    """Copy tensor ``key`` of ``source`` into the output files of ``layout`` (``outs``: tp rank, or None for
    the replicated file -> :class:`_OutFile`), reading every source byte once: a tensor split along dim 0 goes
    rank range by rank range; one split along another dim is read in blocks of whole dim-0 rows whose columns
    are copied to each rank's file. Returns the bytes written."""
    shape = layout.global_shape
    if not layout.is_sharded:
        _stream_rows(writer, source, key, shape, dtype, 0, shape[0] if shape else 0, outs[None])
        return math.prod(shape) * dtype.itemsize
    d = layout.shard_dim
    ranges = [(r, *layout.valid_range(r)) for r in range(layout.num_shards)]
    ranges = [(r, a, b) for r, a, b in ranges if b > a]
    if d == 0:
        for r, a, b in ranges:
            _stream_rows(writer, source, key, shape, dtype, a, b, outs[r])
        return math.prod(shape) * dtype.itemsize
    if _stream_columns(writer, source, key, dtype, layout, ranges, outs):
        return math.prod(shape) * dtype.itemsize
    row = math.prod(shape[1:]) * dtype.itemsize
    if row == 0:
        return 0
    step = max(1, BLOCK // row)
    for i in range(0, shape[0], step):
        k = min(step, shape[0] - i)
        pooled = k * row <= BLOCK
        block = writer.buffer() if pooled else torch.empty(k * row, dtype=torch.uint8)
        rows = source.read_into(key, block[:k * row].view(dtype).view(k, *shape[1:]), 0, i, i + k)
        for r, a, b in ranges:
            writer._emit_copy(outs[r], rows.narrow(d, a, b - a), k * row // shape[d] * (b - a))
        if pooled:
            writer.give_back(block)
    return math.prod(shape) * dtype.itemsize


def _stream_columns(writer: _Writer, source, key: str, dtype: torch.dtype, layout: Layout,
                    ranges: list[tuple[int, int, int]], outs: dict) -> bool:
    """A tensor split along dim ``d`` > 0 whose source is one byte range of one file: seen as ``outer`` super-rows
    of ``shape[d] * inner`` bytes (``outer``: the product of the dims before ``d``), each super-row holds every
    rank's run of columns back to back. A block of whole super-rows is read with ``preadv`` scattering each run
    straight into its rank's part of one pool buffer, so each rank's part comes out contiguous (no copy in this
    process), is hashed once and written with one ``pwrite``. False (nothing done) when the source does not have
    the tensor as one byte range or the ranks' columns do not tile the dim."""
    shape, d = layout.global_shape, layout.shard_dim
    extents = source.extents(key) if hasattr(source, "extents") else None
    if extents is None or len(extents) != 1 or not ranges or ranges[0][1] != 0 or ranges[-1][2] != shape[d] or \
            any(b != a for (_, _, b), (_, a, _) in zip(ranges, ranges[1:])):
        return False
    file, offset, nbytes = extents[0]
    if nbytes != math.prod(shape) * dtype.itemsize:
        return False
    inner = math.prod(shape[d + 1:]) * dtype.itemsize
    outer, row = math.prod(shape[:d]), shape[d] * inner
    if row == 0 or outer == 0:
        return True
    runs = [(outs[r], (b - a) * inner) for r, a, b in ranges]
    step = max(1, BLOCK // row)
    for i in range(0, outer, step):
        k = min(step, outer - i)
        pooled = k * row <= BLOCK
        block = writer.buffer() if pooled else torch.empty(k * row, dtype=torch.uint8)
        data = memoryview(block.numpy())
        parts, position = [], 0
        for out, run in runs:
            parts.append((out, data[position:position + k * run], run))
            position += k * run
        _scatter_read(file._fd, [part[j * run:(j + 1) * run] for j in range(k) for _, part, run in parts],
                      offset + i * row, file.path)
        writer.emit_parts([(out, part) for out, part, _ in parts], block if pooled else None)
    return True


def export_hf(directory: str | Path, destination: str | Path, *, overwrite: bool = False,
              max_shard_bytes: int = 2 << 30, progress=None) -> Path:
    """Write a plain HF checkpoint (Hub key names, ``config.json``; ``model.safetensors`` or index + shards of at
    most ``max_shard_bytes``) from a sharded checkpoint, streamed in 4 MiB blocks (a tensor's pieces are read
    straight into the block). Needs no process group."""
    from shardlib.policies import policy_for_class_name  # noqa: PLC0415

    destination = Path(destination)
    if destination.exists() and not overwrite:
        raise CheckpointError(f"{destination} exists; pass overwrite=True to replace it")
    with ShardedCheckpoint(directory) as ckpt:
        policy = policy_for_class_name(ckpt.meta["model_class"])
        parts: list[list[tuple[str, str, torch.dtype, tuple]]] = [[]]  # (name, hub key, dtype, shape)
        size = 0
        for name in ckpt.tensors:
            dtype, shape = ckpt.dtype(name), ckpt.shape(name)
            nbytes = math.prod(shape) * dtype.itemsize
            if parts[-1] and size + nbytes > max_shard_bytes:
                parts.append([])
                size = 0
            parts[-1].append((name, policy.to_hub_key(name), dtype, shape))
            size += nbytes
        tmp = destination.parent / f".{destination.name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir(parents=True)
        try:
            files = ["model.safetensors"] if len(parts) == 1 else \
                [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
            with _Writer(tmp, checksum=None) as writer:
                for file, part in zip(files, parts):
                    out = writer.open(file, [(hub, dtype, shape) for _, hub, dtype, shape in part], {"format": "pt"})
                    by_hub = {hub: (name, dtype, shape) for name, hub, dtype, shape in part}
                    for hub in out.order:
                        name, dtype, shape = by_hub[hub]
                        _stream_rows(writer, ckpt, name, shape, dtype, 0, shape[0] if shape else 0, out)
                        if progress:
                            progress(name, math.prod(shape) * dtype.itemsize)
                writer.finish()
            if len(parts) > 1:
                weight_map = {hub: file for file, part in zip(files, parts) for _, hub, _, _ in part}
                index = {"metadata": {}, "weight_map": weight_map}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
            (tmp / "config.json").write_text(json.dumps(ckpt.meta["config"], indent=1))
            _finish(tmp, destination, None)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return destination


class _HFSource(SafetensorsFiles):
    """An HF checkpoint as a convert source: tensors by Hub key; ``key(names)`` finds a tensor's key."""

    def __init__(self, directory: Path, to_hub):
        super().__init__(directory)
        self._to_hub = to_hub

    def key(self, names: list[str]) -> str:
        key = next((self._to_hub(n) for n in names if self._to_hub(n) in self), None)
        if key is None:
            raise CheckpointError(f"{self.directory}: no tensor {' = '.join(self._to_hub(n) for n in names)!r}")
        return key


class _ShardedSource(ShardedCheckpoint):
    def key(self, names: list[str]) -> str:
        key = next((n for n in names if n in self.tensors), None)
        if key is None:
            raise CheckpointError(f"{self.directory}: no tensor {names[0]!r}")
        return key


def _config_and_class(source: Path):
    """(HF config, model class name, source) of an HF or sharded checkpoint; the source reads tensors by the key
    that its ``key(names)`` gives (``shape``, ``dtype``, ``read_into``, ``close``)."""
    import transformers
    from transformers import AutoConfig

    from shardlib.policies import policy_for_class_name  # noqa: PLC0415

    if (source / METADATA).exists():
        ckpt = _ShardedSource(source)
        config_dict = dict(ckpt.meta["config"])
        config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
        return config, ckpt.meta["model_class"], ckpt
    if not (source / "config.json").exists():
        raise CheckpointError(f"{source}: neither a shardlib checkpoint ({METADATA}) nor an HF one (config.json)")
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    class_name = (config.architectures or [None])[0]
    if class_name is None or not hasattr(transformers, class_name):
        raise CheckpointError(f"{source}/config.json names no known model class (architectures={config.architectures})")
    return config, class_name, _HFSource(source, policy_for_class_name(class_name).to_hub_key)


def convert(source: str | Path, destination: str | Path, *, tp: int, pp: int = 1, overwrite: bool = False,
            progress=None) -> Path:
    """HF -> sharded or sharded -> sharded (any tp, any pp), without a process group: the layouts come from
    sharding the model on the meta device offline, the pipeline stages from :func:`shardlib.pipeline.stage_plan`.
    With ``pp > 1`` each stage's tensors go to that stage's files (``model-ppXX-...``), as a pipelined ``save``
    writes them. Streams: every output file of a stage is open at once and each source tensor is read once, in
    blocks of at most 4 MiB, each block's rows going to the files that hold them (memory: a few blocks)."""
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
    config, class_name, src = _config_and_class(source)
    try:
        with torch.device("meta"):
            model = getattr(transformers, class_name)(config)
        owners = None
        if pp > 1:  # before sharding: the cost model reads the full shapes
            owners = tensor_owners(model, stage_plan(model, policy_for(model).plan(model, tp).trunk, pp))
        shard(model, OfflineMesh(tp=tp))  # validates the layout: e.g. heads that the new tp does not divide

        def stage_of(names):
            return None if owners is None else min(s for n in names for s in owners.get(n, {0}))

        entries = []  # (names, layout, stored dtype, stage, source key)
        for _, names in _tensors_to_load(model):
            layout, key = layout_of(model, names[0]), src.key(names)
            if tuple(src.shape(key)) != layout.global_shape:
                raise CheckpointError(f"tensor {key!r} in {source} has shape {tuple(src.shape(key))}, the model "
                                      f"expects {layout.global_shape} ({names[0]})")
            entries.append((names, layout, src.dtype(key), stage_of(names), key))
        tmp = destination.parent / f".{destination.name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir(parents=True)
        try:
            meta = {names[0]: _tensor_entry(layout, dtype, names[1:], stage)
                    for names, layout, dtype, stage, _ in entries}
            with _Writer(tmp) as writer:
                for stage in sorted({e[3] for e in entries}, key=lambda x: -1 if x is None else x):
                    # data order of every file: safetensors' (dtype, name); walking the tensors in that order
                    # writes each file front to back
                    mine = sorted((e for e in entries if e[3] == stage), key=lambda e: (-_ST_RANK[e[2]], e[0][0]))
                    contents: dict[str, list] = {}
                    for names, layout, dtype, _, _ in mine:
                        for piece in _pieces(layout, stage):
                            shape = list(layout.global_shape)
                            if piece.dim is not None:
                                shape[piece.dim] = piece.stop - piece.start
                            contents.setdefault(piece.file, []).append((names[0], dtype, tuple(shape)))
                    files = {name: writer.open(name, tensors, {"format": "pt", "writer": FORMAT})
                             for name, tensors in contents.items()}
                    for names, layout, dtype, _, key in mine:
                        outs = {None: files.get(replicated_file(stage))} | {
                            r: files.get(rank_file(r, tp, stage)) for r in range(tp)}
                        nbytes = _stream_tensor(writer, src, key, dtype, layout, outs)
                        if progress:
                            progress(names[0], nbytes)
                written = writer.finish()
            document = _document(class_name, config.to_dict(), tp, meta, written)
            if pp > 1:
                document["pp"] = pp
            _finish(tmp, destination, document)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        src.close()
    return destination
