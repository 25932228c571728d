"""Offline conversion: HF -> sharded, sharded -> sharded (any tp, any pp) and sharded -> HF, streamed without a
process group (:mod:`shardlib.safetensors_io.stream`), each destination written atomically (:mod:`.atomic`).

Tensors of an HF source that the model does not own (an old checkpoint's ``embeddings.position_ids``, say) are
*carried*: stored whole under their Hub key with ``"carried": true``, listed by ``shardlib inspect``, and written
back by :func:`export_hf`, so HF -> sharded -> HF returns every source tensor bitwise. ``generation_config.json`` is
carried the same way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..parallel.layout import Layout, layout_of
from ..safetensors_io import (
    CheckpointError, SafetensorsFiles, Writer, copy_rows, copy_split, safetensors_order, strict_json,
)
from .atomic import AtomicDirectory
from .format import (
    FORMAT, METADATA, OPTIMIZER_PREFIX, header_metadata, hf_config, piece_shape, pieces, rank_file, read_hf_config,
    replicated_file, tensor_entry, write_document,
)
from .reader import ShardedCheckpoint
from .tensors import tensors_to_load

GENERATION_CONFIG = "generation_config.json"


def _write_hf_configs(tmp: Path, meta: dict, dtype: torch.dtype | None) -> None:
    """``config.json`` (and ``generation_config.json`` for a generating model) by transformers' own writers, as
    ``save_pretrained`` writes them."""
    import transformers
    from transformers import GenerationConfig

    config = hf_config(meta)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(tmp)
    carried = meta.get("generation_config")
    if carried is not None:
        GenerationConfig.from_dict(carried).save_pretrained(tmp)
        return
    model_class = getattr(transformers, meta["model_class"], None)
    if model_class is not None and model_class.can_generate():
        GenerationConfig.from_model_config(config).save_pretrained(tmp)


def _hf_parts(ckpt: ShardedCheckpoint, to_hub, max_shard_bytes: int) -> list[list[tuple]]:
    """The export's files: ``[(name, hub key, dtype, shape)]`` each, filled in order up to ``max_shard_bytes``."""
    parts: list[list[tuple]] = [[]]
    size = 0
    for name, entry in ckpt.tensors.items():
        if name.startswith(OPTIMIZER_PREFIX):
            continue  # training state: not part of an HF model checkpoint
        dtype, shape = ckpt.dtype(name), ckpt.shape(name)
        nbytes = math.prod(shape) * dtype.itemsize
        if parts[-1] and size + nbytes > max_shard_bytes:
            parts.append([])
            size = 0
        parts[-1].append((name, name if entry.get("carried") else to_hub(name), dtype, shape))
        size += nbytes
    return parts


def export_hf(directory: str | Path, destination: str | Path, *, overwrite: bool = False,
              max_shard_bytes: int = 2 << 30, progress=None) -> Path:
    """Write a plain HF checkpoint from a sharded checkpoint, as ``save_pretrained`` writes it: Hub key names,
    ``config.json`` (and ``generation_config.json``) written by transformers; ``model.safetensors`` or an index
    (with ``metadata.total_size``) + shards of at most ``max_shard_bytes``. Streamed in 4 MiB blocks (a tensor's
    pieces are read straight into the block); atomic; needs no process group. Optimizer state is left out."""
    with ShardedCheckpoint(directory) as ckpt, AtomicDirectory(destination, overwrite=overwrite) as tmp:
        write_hf(ckpt, tmp, max_shard_bytes, progress)
    return Path(destination)


def write_hf(ckpt: ShardedCheckpoint, tmp: Path, max_shard_bytes: int, progress=None) -> None:
    """:func:`export_hf`'s files, into the (staging) directory ``tmp``."""
    from ..policies import hub_key_mapping  # noqa: PLC0415

    parts = _hf_parts(ckpt, hub_key_mapping(ckpt.meta["model_class"]), max_shard_bytes)
    files = ["model.safetensors"] if len(parts) == 1 else \
        [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    with Writer(tmp, checksum=None) as writer:
        for file, part in zip(files, parts):
            out = writer.open(file, [(hub, dtype, shape) for _, hub, dtype, shape in part], {"format": "pt"})
            by_hub = {hub: (name, dtype, shape) for name, hub, dtype, shape in part}
            for hub in out.order:
                name, dtype, shape = by_hub[hub]
                copy_rows(writer, ckpt, name, shape, dtype, 0, shape[0] if shape else 0, out)
                if progress:
                    progress(name, math.prod(shape) * dtype.itemsize)
        writer.finish()
    if len(parts) > 1:
        total = sum(math.prod(shape) * dtype.itemsize for part in parts for _, _, dtype, shape in part)
        weight_map = {hub: file for file, part in zip(files, parts) for _, hub, _, _ in part}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    floating = [dtype for part in parts for name, _, dtype, _ in part
                if dtype.is_floating_point and not ckpt.tensors[name].get("carried")]
    _write_hf_configs(tmp, ckpt.meta, floating[0] if floating else None)


class _HFSource(SafetensorsFiles):
    """An HF checkpoint as a convert source: tensors by Hub key; ``key(names)`` finds a tensor's key, and
    :meth:`carried` lists (after every ``key`` call) the keys no model tensor took."""

    def __init__(self, directory: Path, to_hub):
        super().__init__(directory)
        self._to_hub, self._taken = to_hub, set()
        generation = directory / GENERATION_CONFIG
        self.generation_config = strict_json(generation.read_bytes(), str(generation)) if generation.exists() \
            else None

    def key(self, names: list[str]) -> str:
        key = next((self._to_hub(n) for n in names if self._to_hub(n) in self), None)
        if key is None:
            raise CheckpointError(f"{self.directory}: no tensor {' = '.join(self._to_hub(n) for n in names)!r}")
        self._taken.add(key)
        return key

    def carried(self) -> list[str]:
        return sorted(set(self.weight_map) - self._taken)


class _ShardedSource(ShardedCheckpoint):
    generation_config = property(lambda self: self.meta.get("generation_config"))

    def key(self, names: list[str]) -> str:
        key = next((n for n in names if n in self.tensors), None)
        if key is None:
            raise CheckpointError(f"{self.directory}: no tensor {names[0]!r}")
        return key

    def carried(self) -> list[str]:
        return sorted(name for name, entry in self.tensors.items() if entry.get("carried"))


def _config_and_class(source: Path):
    """(HF config, model class name, source) of an HF or sharded checkpoint; the source reads tensors by the key
    that its ``key(names)`` gives (``shape``, ``dtype``, ``read_into``, ``close``)."""
    import transformers

    from ..policies import hub_key_mapping  # noqa: PLC0415

    if (source / METADATA).exists():
        ckpt = _ShardedSource(source)
        return hf_config(ckpt.meta), ckpt.meta["model_class"], ckpt
    if not (source / "config.json").exists():
        raise CheckpointError(f"{source}: neither a shardlib checkpoint ({METADATA}) nor an HF one (config.json)")
    config = read_hf_config(source)
    class_name = (config.architectures or [None])[0]
    if class_name is None or not hasattr(transformers, class_name):
        raise CheckpointError(f"{source}/config.json names no known model class (architectures={config.architectures})")
    return config, class_name, _HFSource(source, hub_key_mapping(class_name))


def _entries(model, src, source: Path, owners) -> list[tuple]:
    """``(names, layout, stored dtype, stage, source key)`` of every tensor the converted checkpoint holds: the
    model's, then the source's carried ones (whole, with the first stage)."""
    entries = []
    for _, names in tensors_to_load(model):
        layout, key = layout_of(model, names[0]), src.key(names)
        if tuple(src.shape(key)) != layout.global_shape:
            raise CheckpointError(f"tensor {key!r} in {source} has shape {tuple(src.shape(key))}, the model "
                                  f"expects {layout.global_shape} ({names[0]})")
        stage = None if owners is None else min(s for n in names for s in owners.get(n, {0}))
        entries.append((names, layout, src.dtype(key), stage, key))
    first = None if owners is None else 0
    for key in src.carried():
        entries.append(([key], Layout.replicated(tuple(src.shape(key))), src.dtype(key), first, key))
    return entries


def convert(source: str | Path, destination: str | Path, *, tp: int, pp: int = 1, overwrite: bool = False,
            progress=None) -> Path:
    """HF -> sharded or sharded -> sharded (any tp, any pp), without a process group: the layouts come from
    sharding the model on the meta device offline, the pipeline stages from :func:`shardlib.pipeline.stage_plan`.
    With ``pp > 1`` each stage's tensors go to that stage's files (``model-ppXX-...``), as a pipelined ``save``
    writes them. Streams: every output file of a stage is open at once and each source tensor is read once, in
    blocks of at most 4 MiB, each block's rows going to the files that hold them (memory: a few blocks)."""
    import transformers

    from ..parallel.mesh import OfflineMesh
    from ..pipeline import stage_plan, tensor_owners
    from ..sharding.sharder import resolve_policy, shard

    source, destination = Path(source), Path(destination)
    if type(tp) is not int or type(pp) is not int or pp < 1 or tp < 1:
        raise CheckpointError(f"--tp and --pp must be integers >= 1, got tp={tp!r}, pp={pp!r}")
    config, class_name, src = _config_and_class(source)
    with src:
        with torch.device("meta"):
            model = getattr(transformers, class_name)(config)
        owners = None
        if pp > 1:  # before sharding: the cost model reads the full shapes
            policy = resolve_policy(model)
            owners = tensor_owners(model, stage_plan(model, policy.plan(model, tp).trunk, pp))
        shard(model, OfflineMesh(tp=tp))  # validates the layout: e.g. heads that the new tp does not divide
        entries = _entries(model, src, source, owners)
        carried = set(src.carried())
        with AtomicDirectory(destination, overwrite=overwrite, marker=False, what="overwrite=True / --overwrite") \
                as tmp:
            meta = {names[0]: tensor_entry(layout, dtype, names[1:], stage) | ({"carried": True} if names[0] in
                                                                              carried else {})
                    for names, layout, dtype, stage, _ in entries}
            with Writer(tmp) as writer:
                for stage in sorted({e[3] for e in entries}, key=lambda x: -1 if x is None else x):
                    _write_stage(writer, src, [e for e in entries if e[3] == stage], stage, tp, progress)
                written = writer.finish()
            document = {"format": FORMAT, "model_class": class_name, "config": config.to_dict(), "tp": tp,
                        "tensors": meta, "files": written}
            if pp > 1:
                document["pp"] = pp
            if src.generation_config is not None:
                document["generation_config"] = src.generation_config
            write_document(tmp, document)  # last, fsynced: marks the staged checkpoint complete
    return destination


def _write_stage(writer: Writer, src, mine: list[tuple], stage: int | None, tp: int, progress) -> None:
    """Every file of one pipeline stage, open at once, each written front to back: its tensors are walked in
    safetensors' data order (dtype, name). Each file's header records the pieces it holds."""
    mine = sorted(mine, key=lambda e: safetensors_order(e[0][0], e[2]))
    contents: dict[str, list] = {}
    for names, layout, dtype, _, _ in mine:
        for p in pieces(layout, stage):
            contents.setdefault(p.file, []).append(
                (names[0], dtype, piece_shape(layout.global_shape, p.dim, p.start, p.stop, p.blocks)))
    entries = {names[0]: tensor_entry(layout, dtype, names[1:], stage) for names, layout, dtype, _, _ in mine}
    files = {name: writer.open(name, tensors, header_metadata(entries, name)) for name, tensors in contents.items()}
    for names, layout, dtype, _, key in mine:
        outs = {None: files.get(replicated_file(stage))} | {r: files.get(rank_file(r, tp, stage)) for r in range(tp)}
        nbytes = _copy_layout(writer, src, key, layout, dtype, outs)
        if progress:
            progress(names[0], nbytes)


def _copy_layout(writer: Writer, src, key: str, layout: Layout, dtype: torch.dtype, outs: dict) -> int:
    """Copy source tensor ``key`` into each rank's file (``outs``: rank -> file, None -> the replicated one) as
    ``layout`` splits it (:func:`copy_split`); the bytes copied. A rank's rows are its :meth:`Layout.ranges`, each
    appended in turn: right along dim 0, where they are whole rows. Along a dim d > 0 the ranges of a blocked
    layout interleave within each row, so the tensor is seen as :class:`_BlocksApart`, where they are one range per
    rank of a dim of their own."""
    if not layout.is_sharded:
        return copy_split(writer, src, key, layout.global_shape, dtype, None, [], outs)
    d, n = layout.shard_dim, layout.num_shards
    if layout.blocks > 1 and d > 0:
        apart = _BlocksApart(src, layout)
        rows = apart.shape[d + 1] // n
        return copy_split(writer, apart, key, apart.shape, dtype, d + 1,
                          [(r, r * rows, (r + 1) * rows) for r in range(n)], outs)
    ranges = [(r, start, stop) for r in range(n) for start, stop in layout.ranges(r)]
    return copy_split(writer, src, key, layout.global_shape, dtype, d, ranges, outs)


class _BlocksApart:
    """A convert source whose tensor of a blocked ``layout`` (split along dim d > 0) is seen with dim d cut into
    ``(blocks, rows of a block)``: the same bytes and the same dim-0 rows, so its reads are the source's, into
    the same memory viewed with the source's shape. A rank's local rows are then one range of dim d + 1."""

    def __init__(self, source, layout: Layout):
        d, shape = layout.shard_dim, layout.global_shape
        self.source, self._shape = source, shape
        self.shape = shape[:d] + (layout.blocks, shape[d] // layout.blocks) + shape[d + 1:]

    def extents(self, key: str, start: int = 0, stop: int | None = None):
        return self.source.extents(key, start, stop)

    def read_into(self, key: str, out: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
        """Dim-0 rows ``[start, stop)`` (the only reads :func:`copy_split` makes along a dim > 0)."""
        if dim != 0:
            raise ValueError(f"_BlocksApart reads dim-0 rows only, not dim {dim}")
        self.source.read_into(key, out.view(stop - start, *self._shape[1:]), 0, start, stop)
        return out
