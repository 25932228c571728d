"""Saving a live sharded model: every rank stages its own tensors (views, or host copies for an asynchronous
save) and all ranks commit them into one atomic directory (:mod:`.atomic`)."""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.mesh import DEFAULT_TIMEOUT_S
from ..parallel.timeouts import stalled_ranks_named
from ..safetensors_io import CheckpointError, Writer
from ..sharding.sharded import shard_state
from ..sharding.state import _pipeline, gather_full, tp_group_of
from .atomic import publish, recover, staging_dir
from .format import (
    FORMAT, expert_file, hf_class_name, header_metadata, parameter_names, rank_file, replicated_file, tensor_entry,
    write_document,
)
from .tensors import saved_tensors


def _optimizer_hyperparameters(optimizer) -> list[dict] | None:
    if optimizer is None:
        return None
    return [{k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, str, type(None),
                                                                                 list, tuple))}
            for group in optimizer.param_groups]


def _rank_file_tensors(model: nn.Module, rank: int, optimizer=None, *, replica: int | None = 0) -> tuple[dict, dict]:
    """This rank's file contents: {file: {key: tensor view}} (real rows only, no copies; a blocked tensor's local
    rows as one tensor, whose piece says which global rows they are), and the metadata of the tensors this rank's
    pipeline stage writes (all of them without a pipeline; a tensor used by several stages is written by the lowest
    pipeline rank using it). ``replica``: this rank's dp rank when it is the one replica of
    its (pp, tp) position that writes (sp rank 0), else None; everything is written by dp rank 0 (a ZeRO
    optimizer's state is gathered whole first, :func:`saved_tensors`), experts under expert parallelism by the
    first ep group (:class:`_ExpertWriter`)."""
    split = _pipeline(model)
    stage = split.pp_rank if split is not None else None
    experts = _ExpertWriter(model, rank, replica, stage)
    files: dict[str, dict[str, torch.Tensor]] = {}
    meta = {}
    for name, tensor, layout, aliases in saved_tensors(model, optimizer):
        names = [name, *aliases]
        if split is not None and not split.writer(parameter_names(names)):
            continue
        meta[names[0]] = tensor_entry(layout, tensor.dtype, names[1:], stage, ep_rank=experts.ep_rank)
        if layout.ep > 1:
            experts.add(files, names[0], tensor, layout)
        elif replica != 0:
            continue
        elif layout.is_sharded:
            rows = sum(max(stop - start, 0) for start, stop in layout.ranges(rank))  # one piece (every block's rows)
            if rows:
                files.setdefault(rank_file(rank, layout.num_shards, stage), {})[names[0]] = \
                    tensor.detach().narrow(layout.shard_dim, 0, rows)  # a view without the padding: streamed
        elif rank == 0:
            files.setdefault(replicated_file(stage), {})[names[0]] = tensor.detach()
    return files, meta


class _ExpertWriter:
    """Where this rank's expert tensors go under expert parallelism (:func:`.format.pieces`): the ranks of the first
    ep group write (one replica of each ep rank's experts, dp ranks ``[0, ep)``); a tensor split over ep is
    gathered over tp first (a collective on the tp group: every rank of it walks the same tensors) and written whole
    over tp by tp rank 0; an expert module's own tensor as its tp pieces."""

    def __init__(self, model: nn.Module, rank: int, replica: int | None, stage: int | None):
        state = shard_state(model, required=False)
        self.ep = getattr(state.mesh, "ep", 1) if state is not None else 1
        self.ep_rank = state.mesh.ep_rank if self.ep > 1 else 0
        self.writes = replica is not None and replica < self.ep
        self.rank, self.stage, self.tp_group = rank, stage, tp_group_of(model)

    def add(self, files: dict, name: str, tensor: torch.Tensor, layout) -> None:
        within = layout.within_ep()
        if layout.is_expert_split:
            if within.is_sharded:
                tensor = gather_full(tensor, within, self.tp_group)
            if self.writes and self.rank == 0:
                files.setdefault(expert_file(self.ep_rank, self.ep, self.stage), {})[name] = tensor.detach()
        elif self.writes and within.is_sharded:
            rows = layout.ranges(self.rank)[0]
            if rows[1] > rows[0]:
                file = expert_file(self.ep_rank, self.ep, self.stage, self.rank, layout.num_shards)
                files.setdefault(file, {})[name] = tensor.detach().narrow(layout.shard_dim, 0, rows[1] - rows[0])
        elif self.writes and self.rank == 0:
            files.setdefault(expert_file(self.ep_rank, self.ep, self.stage), {})[name] = tensor.detach()


def _broadcast_str(value: str, group=None) -> str:
    holder = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
    return holder[0]


def claim(directory: Path, overwrite: bool, group=None) -> str:
    """Before a collective write of ``directory``: rank 0 finishes or cleans what an interrupted writer left
    (:func:`.atomic.recover`) and checks that ``directory`` may be written; every rank gets the same outcome, a
    token naming this write's staging directory or the same :class:`CheckpointError`."""
    status = uuid.uuid4().hex[:12]
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        recover(directory)
        if directory.exists() and not overwrite:
            status = f"!{directory} exists; pass overwrite=True to replace it"
    status = _broadcast_str(status, group)
    if status.startswith("!"):
        raise CheckpointError(status[1:])
    return status


@dataclass
class StagedSave:
    """One rank's part of a checkpoint, ready to be written: ``files`` ({file: {key: tensor}}, views of the live
    tensors or, staged with ``copy=True``, private copies), the metadata of the tensors this rank describes, and
    the document fields only rank 0 writes."""

    files: dict
    meta: dict
    document: dict
    timeout_s: float = DEFAULT_TIMEOUT_S  # the mesh's bound on the commit's collectives (for their errors)


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
    work, except where a ZeRO stage's state or FSDP2's parameters are gathered over dp (every dp rank calls it)."""
    state = shard_state(model)
    mesh = state.mesh
    # one copy per tensor-parallel rank: the dp replicas and the all-to-all sequence-parallel peers hold the same
    # (a ZeRO optimizer's state too, once saved_tensors has gathered it)
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
    if getattr(mesh, "ep", 1) > 1:
        document["ep"] = mesh.ep
    if state.pipeline is not None:
        document["pp"] = mesh.pp
        document["stages"] = [list(layers) for layers in state.pipeline.plan.layers]
    return StagedSave(files=files, meta=meta, document=document,
                      timeout_s=getattr(mesh, "timeout_s", DEFAULT_TIMEOUT_S))


def commit(staged: StagedSave, directory: str | Path, *, overwrite: bool = False, group=None,
           metadata: dict | None = None) -> Path:
    """Write a :func:`stage`-d checkpoint atomically (module docstring). Every rank of ``group`` (default: the
    world) calls it; collectives run on ``group`` only, so a background thread can commit on a group of its own
    while training goes on. ``metadata``: extra top-level fields of ``shardlib.json`` (rank 0's are written).
    Rank 0 first finishes or cleans what an interrupted save of ``directory`` left (:func:`.atomic.recover`). A
    failure on any rank (a full disk, say) is raised on every rank, naming it, and leaves ``directory`` as it was;
    a rank that dies or stalls makes the others raise :class:`~shardlib.parallel.timeouts.CollectiveFailure` within the
    mesh's timeout (rank 0 then removes the staging directory)."""
    directory = Path(directory)
    leader = not dist.is_initialized() or dist.get_rank(group) == 0
    with stalled_ranks_named(f"saving {directory}", staged.timeout_s):
        tmp = staging_dir(directory, claim(directory, overwrite, group))
    try:  # fsynced before rank 0 writes the metadata
        outcome = (_write_files(tmp, staged.files, staged.meta) if staged.files else {}, staged.meta, None)
    except Exception as exc:  # noqa: BLE001  (every rank learns of it below, then raises)
        outcome = ({}, {}, f"{type(exc).__name__}: {exc}")
    gathered = [outcome]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size(group)
        try:  # small dicts between our own ranks: file names, checksums and (under a pipeline) each stage's tensors
            with stalled_ranks_named(f"saving {directory}", staged.timeout_s):
                dist.all_gather_object(gathered, outcome, group=group)
        except BaseException:
            if leader:  # a rank died or stalled: nothing was published, its staging directory goes
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    status = _publish(tmp, directory, gathered, {**staged.document, **(metadata or {})}) if leader else ""
    with stalled_ranks_named(f"saving {directory}", staged.timeout_s):
        status = _broadcast_str(status, group)
    if status:
        raise CheckpointError(f"saving {directory} failed, the previous checkpoint (if any) is intact: {status}")
    return directory


def _publish(tmp: Path, directory: Path, gathered: list[tuple], document: dict) -> str:
    """Rank 0, after every rank wrote its files: the metadata of all of them, then the directory swapped in; or,
    when any rank (this one included) failed, the staging directory removed. What failed, or ``""``."""
    failed = [f"rank {r}: {error}" for r, (_, _, error) in enumerate(gathered) if error is not None]
    try:
        if not failed:
            all_files = {k: v for files_of_rank, _, _ in gathered for k, v in files_of_rank.items()}
            all_meta = {k: v for _, meta_of_rank, _ in gathered for k, v in meta_of_rank.items()}
            write_document(tmp, {**document, "tensors": all_meta, "files": all_files})
            publish(tmp, directory)
    except Exception as exc:  # noqa: BLE001  (raised on every rank by the caller)
        failed.append(f"rank 0: {type(exc).__name__}: {exc}")
    if failed:
        shutil.rmtree(tmp, ignore_errors=True)
    return "; ".join(failed)


def save(model: nn.Module, directory: str | Path, *, optimizer=None, overwrite: bool = False) -> Path:
    """Write ``model``'s local shards (no gather, no copies: each tensor is streamed from its own memory) plus
    ``shardlib.json``; atomic (see module docstring). Every rank of the mesh must call it; replicas other than dp
    rank 0 and all-to-all sp rank 0 write nothing. With ``optimizer``, its per-parameter state (AdamW moments and
    step) is saved the same way, keyed by parameter name, and its hyperparameters go into the metadata, so training
    resumes exactly (also under another tp)."""
    return commit(stage(model, optimizer=optimizer), directory, overwrite=overwrite)


def _write_files(directory: Path, files: dict[str, dict[str, torch.Tensor]], meta: dict | None = None) -> dict:
    """Stream ``{file: {key: tensor}}`` into safetensors files (tensors may be strided views), each file's header
    recording the pieces ``meta`` (the tensors' ``shardlib.json`` entries) places in it (None: no record, as files
    were written before v3 recorded them); the files' sizes and checksums. Every file is fsynced when this
    returns."""
    with Writer(directory) as writer:
        for name, tensors in files.items():
            header = header_metadata(meta, name) if meta is not None else {"format": "pt", "writer": FORMAT}
            out = writer.open(name, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], header)
            for key in out.order:
                writer.tensor(out, key, tensors[key])
        return writer.finish()
