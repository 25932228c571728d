"""The sharded checkpoint format (``docs/checkpoint-format.md``): file names, tensor entries, and ``shardlib.json``
written with a checksum of its own and read back only after a strict check of every field.

A tensor is stored whole (one piece, ``dim`` None, in a replicated file) or as pieces along one dim that tile it
exactly: no gap, no overlap, nothing out of range. A piece of a blocked layout (a fused projection, ``blocks`` k)
holds the same rows of each of the k equal blocks of its dim, stored one after the other (:func:`piece_spans`).
Everything a reader relies on is checked when the metadata is read, so a damaged ``shardlib.json`` is refused with
the field it lacks, never half-loaded.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..parallel.layout import Layout
from ..safetensors_io import DTYPES, CheckpointError, dtype_name, strict_json

FORMAT = "shardlib-sharded-v3"
# v1: SHA-256 file checksums; v2: xxh3-128 file checksums; v3: v2 plus the checksum of shardlib.json itself
READABLE_FORMATS = ("shardlib-sharded-v1", "shardlib-sharded-v2", FORMAT)
METADATA = "shardlib.json"
HEADER_PIECES = "pieces"  # the data file's own record of the pieces it holds, in its safetensors __metadata__
REPLICATED_FILE = "model-replicated.safetensors"
OPTIMIZER_PREFIX = "optimizer."
HEX_DIGITS = {"xxh3_128": 32, "sha256": 64}


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of ``dim`` stored in ``file``; with ``blocks`` k > 1, those rows of each of the k
    equal blocks of ``dim`` (:func:`piece_spans`)."""

    file: str
    dim: int | None
    start: int
    stop: int
    blocks: int = 1

    def to_dict(self) -> dict:
        """The piece's entry in ``shardlib.json`` (``blocks`` only when > 1: unblocked pieces as they always were)."""
        d = vars(self).copy()
        if self.blocks == 1:
            del d["blocks"]
        return d


def rank_file(rank: int, tp: int, stage: int | None = None, dp: int | None = None) -> str:
    """The file of tp rank ``rank``'s pieces; under a pipeline, of pipeline rank ``stage``'s tp rank ``rank``;
    with ``dp``, of the optimizer state that data-parallel rank held (what zero=1/2 wrote before its state was gathered
    on save; still read)."""
    prefix = "model" if stage is None else f"model-pp{stage:02d}"
    return f"{prefix}-tp{rank:02d}-of-{tp:02d}{_dp_suffix(dp)}.safetensors"


def replicated_file(stage: int | None = None, dp: int | None = None) -> str:
    if stage is None and dp is None:
        return REPLICATED_FILE
    prefix = "model" if stage is None else f"model-pp{stage:02d}"
    return f"{prefix}-replicated{_dp_suffix(dp)}.safetensors"


def _dp_suffix(dp: int | None) -> str:
    return "" if dp is None else f"-dp{dp:02d}"


def piece_shape(shape, dim: int | None, start: int, stop: int, blocks: int = 1) -> tuple[int, ...]:
    """The shape a piece of a tensor of ``shape`` is stored with: rows ``[start, stop)`` of ``dim`` (of each of
    ``blocks`` blocks; all of it when ``dim`` is None)."""
    shape = list(shape)
    if dim is not None:
        shape[dim] = (stop - start) * blocks
    return tuple(shape)


def piece_spans(piece: dict, shape) -> list[tuple[int, int, int]]:
    """The global rows of dim ``piece["dim"]`` that a piece stores, as ``(start, stop, offset)``: global rows
    ``[start, stop)`` are the stored rows ``[offset, offset + stop - start)``. One span, unless the piece is
    blocked (``"blocks": k``): then rows ``[start, stop)`` of each of the k equal blocks of the dim, in block
    order. The one place that says where a piece's rows are: every reader and the tiling check use it."""
    blocks, rows = piece.get("blocks", 1), piece["stop"] - piece["start"]
    stride = shape[piece["dim"]] // blocks
    return [(piece["start"] + b * stride, piece["stop"] + b * stride, b * rows) for b in range(blocks)]


def expert_file(ep_rank: int, ep: int, stage: int | None = None, rank: int | None = None, tp: int = 1) -> str:
    """The file of the experts ep rank ``ep_rank`` holds under expert parallelism: their experts-split tensors whole
    over tp, their own modules' tensors (with ``rank``: tp rank ``rank``'s pieces of them)."""
    prefix = "model" if stage is None else f"model-pp{stage:02d}"
    within = "" if rank is None else f"-tp{rank:02d}-of-{tp:02d}"
    return f"{prefix}-ep{ep_rank:02d}-of-{ep:02d}{within}.safetensors"


def pieces(layout: Layout, stage: int | None = None, dp: int | None = None, ep_rank: int = 0) -> list[Piece]:
    """Where each rank's local rows of a ``layout`` tensor are stored: one piece per rank that holds real rows (a
    blocked layout's piece: the rank's rows of the first block, and ``blocks``), or one whole piece. A tensor split
    over ep: one piece of experts per ep rank, whole over tp; one expert's tensor held by ep rank ``ep_rank``: its
    pieces in that ep rank's files."""
    if layout.is_expert_split:
        part = layout.global_shape[layout.ep_dim] // layout.ep
        return [Piece(expert_file(q, layout.ep, stage), layout.ep_dim, q * part, (q + 1) * part)
                for q in range(layout.ep)]
    if layout.ep > 1:
        return _tp_pieces(layout, expert_file(ep_rank, layout.ep, stage),
                          lambda r: expert_file(ep_rank, layout.ep, stage, r, layout.num_shards))
    return _tp_pieces(layout, replicated_file(stage, dp), lambda r: rank_file(r, layout.num_shards, stage, dp))


def _tp_pieces(layout: Layout, whole_file: str, file_of) -> list[Piece]:
    if not layout.is_sharded:
        return [Piece(whole_file, None, 0, 0)]
    out = []
    for r in range(layout.num_shards):
        start, stop = layout.ranges(r)[0]
        if stop > start:
            out.append(Piece(file_of(r), layout.shard_dim, start, stop, layout.blocks))
    return out


def tensor_entry(layout: Layout, dtype: torch.dtype, aliases: list[str], stage: int | None = None,
                 dp: int | None = None, ep_rank: int = 0) -> dict:
    return {"shape": list(layout.global_shape), "dtype": dtype_name(dtype), "layout": layout.to_dict(),
            "aliases": aliases, "pieces": [p.to_dict() for p in pieces(layout, stage, dp, ep_rank)]}


def parameter_names(names: list[str]) -> list[str]:
    """The model tensor names behind saved names (optimizer state ``optimizer.<key>.<param>`` -> ``<param>``)."""
    return [n[len(OPTIMIZER_PREFIX):].partition(".")[2] if n.startswith(OPTIMIZER_PREFIX) else n for n in names]


def hf_class_name(model: nn.Module) -> str:
    """The HF class of a (possibly loss-wrapped, possibly FSDP2-wrapped) sharded model."""
    cls = type(model)
    if issubclass(cls, FSDPModule):  # fully_shard swaps in a class FSDP<name>(FSDPModule, <the model's class>)
        cls = next(base for base in cls.__bases__ if not issubclass(base, FSDPModule))
    return getattr(cls, "_shardlib_base_class", cls).__name__


def hf_config(meta: dict):
    """The transformers config in a checkpoint's metadata, naming its model class (``architectures``)."""
    from transformers import AutoConfig

    config_dict = dict(meta["config"])
    model_type = config_dict.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **config_dict)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{METADATA}: its 'config' is not a transformers config ({exc})") from None
    config.architectures = [meta["model_class"]]
    return config


def read_hf_config(directory: Path):
    """The transformers config of an HF checkpoint directory (its ``config.json``), refused with the file named."""
    from transformers import AutoConfig

    if not (directory / "config.json").exists():
        raise CheckpointError(f"{directory}: no config.json (not an HF checkpoint directory)")
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{directory}/config.json: not a transformers config ({exc})") from None


# ------------------------------------------------------------------------------------------ writing and reading
def _digest(document: dict) -> str:
    """xxh3-128 of the document without its ``metadata_checksum``, in a canonical serialization."""
    body = {k: v for k, v in document.items() if k != "metadata_checksum"}
    return xxhash.xxh3_128(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def document_text(document: dict) -> str:
    """``shardlib.json``'s text for ``document`` (format v3), with the checksum of its own content."""
    document = {**document, "format": FORMAT}
    return json.dumps({**document, "metadata_checksum": {"algorithm": "xxh3_128", "value": _digest(document)}},
                      indent=1)


def write_document(directory: Path, document: dict) -> None:
    """``shardlib.json`` into a staged ``directory``, written last (its data files are fsynced already) and fsynced:
    its presence marks the staged checkpoint complete (:func:`.atomic.recover`)."""
    with open(directory / METADATA, "w") as f:
        f.write(document_text(document))
        f.flush()
        os.fsync(f.fileno())


def read_document(path: Path) -> dict:
    """``shardlib.json`` at ``path``, checked field by field (:func:`document_problems`); a v3 document's own
    checksum is verified first. Every refusal is a :class:`CheckpointError` naming the file and the field."""
    document = strict_json(path.read_bytes(), str(path))
    if not isinstance(document, dict):
        raise CheckpointError(f"{path}: a JSON {type(document).__name__}, expected an object")
    if document.get("format") not in READABLE_FORMATS:
        newer = newer_format(document.get("format"), FORMAT)
        raise CheckpointError(f"{path}: {newer}" if newer else f"{path}: format {document.get('format')!r}, expected "
                              f"one of {', '.join(READABLE_FORMATS)}")
    if document["format"] == FORMAT:
        stored = document.get("metadata_checksum")
        if not isinstance(stored, dict) or stored.get("algorithm") != "xxh3_128":
            raise CheckpointError(f"{path}: field 'metadata_checksum' missing or malformed")
        if stored.get("value") != _digest(document):
            raise CheckpointError(f"{path}: metadata checksum mismatch (the file was changed or damaged after "
                                  "it was written)")
    problems = document_problems(document)
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
    return document


def newer_format(found, newest: str) -> str | None:
    """Why ``found`` cannot be read when it is a later version of ``newest``'s format (``<name>-v<N>``: the same
    name, a larger N), naming both; else None."""
    name, _, version = newest.rpartition("-v")
    match = re.fullmatch(re.escape(name) + r"-v(\d+)", found) if isinstance(found, str) else None
    if match is None or int(match[1]) <= int(version):
        return None
    return (f"format {found!r} was written by a newer shardlib; this one reads {name} up to {newest!r} (upgrade "
            "shardlib to read it)")


# ------------------------------------------------------------------------ the pieces a data file says it holds
def header_metadata(entries: dict[str, dict], file: str) -> dict[str, str]:
    """The safetensors ``__metadata__`` of data file ``file``: safetensors' ``format``, the writer's format, and
    ``pieces``: for each tensor ``entries`` (name -> its ``shardlib.json`` entry) places in ``file``, the global
    shape and the piece (``dim``, ``start``, ``stop``, ``blocks`` as in ``shardlib.json``), as one JSON string. A
    file that says what it holds is checked against ``shardlib.json`` on load (:func:`header_problem`)."""
    held = {name: {"shape": entry["shape"], **{k: v for k, v in p.items() if k != "file"}}
            for name, entry in entries.items() for p in entry["pieces"] if p["file"] == file}
    return {"format": "pt", "writer": FORMAT,
            HEADER_PIECES: json.dumps(held, sort_keys=True, separators=(",", ":"))}


def header_pieces(metadata: dict[str, str], where: str) -> dict | None:
    """The ``pieces`` a data file's ``__metadata__`` records (name -> piece with ``shape``), None for a file written
    before files recorded them (nothing to check: such files still load)."""
    raw = metadata.get(HEADER_PIECES)
    if raw is None:
        return None
    held = strict_json(raw.encode(), f"{where}: header field __metadata__.{HEADER_PIECES}")
    if not isinstance(held, dict) or not all(isinstance(v, dict) for v in held.values()):
        raise CheckpointError(f"{where}: header field __metadata__.{HEADER_PIECES} is not an object of tensor name "
                              "-> piece")
    return held


def _piece_key(piece: dict) -> tuple:
    return (piece.get("shape"), piece.get("dim"), piece.get("start"), piece.get("stop"), piece.get("blocks", 1))


def describe_piece(piece: dict) -> str:
    """``rows [a, b) of dim d`` (of each of k blocks) ``of shape [..]``, or ``all of shape [..]``."""
    shape = piece.get("shape")
    if piece.get("dim") is None:
        return f"all of shape {shape}"
    blocks = f" of each of {piece['blocks']} blocks" if piece.get("blocks", 1) != 1 else ""
    return f"rows [{piece.get('start')}, {piece.get('stop')}){blocks} of dim {piece['dim']} of shape {shape}"


def header_problem(held: dict | None, name: str, entry: dict, piece: dict) -> str | None:
    """What is wrong with a data file whose header records ``held`` (:func:`header_pieces`) as the holder of
    ``piece`` of tensor ``name`` (``entry``: its ``shardlib.json`` entry): it records no piece of that tensor, or
    another one (files swapped or renamed); None when it agrees or records nothing."""
    if held is None:
        return None
    expected = {"shape": entry["shape"], **{k: v for k, v in piece.items() if k != "file"}}
    if name not in held:
        return (f"its header records no piece of tensor {name!r}; {METADATA} places {describe_piece(expected)} of "
                "it in this file (files swapped or renamed?)")
    if _piece_key(held[name]) != _piece_key(expected):
        return (f"holds {describe_piece(held[name])} of tensor {name!r} (its header), but {METADATA} places "
                f"{describe_piece(expected)} of it in this file (files swapped or renamed?)")
    return None


def _is_int(value, low: int = 0) -> bool:
    return type(value) is int and value >= low


def document_problems(document: dict) -> list[str]:
    """What is wrong with a parsed ``shardlib.json``: missing or mistyped fields, unknown dtypes, files named by
    no entry or with a checksum of the wrong length, pieces that do not tile their tensor exactly."""
    out = []
    for key, kind in (("model_class", str), ("config", dict), ("tp", int), ("tensors", dict), ("files", dict)):
        if not isinstance(document.get(key), kind):
            out.append(f"field {key!r} missing or not a {kind.__name__}")
    if out:
        return out
    if not _is_int(document["tp"], 1):
        out.append(f"field 'tp' is {document['tp']!r}, expected an integer >= 1")
    for key in ("pp", "ep"):
        if key in document and not _is_int(document[key], 1):
            out.append(f"field {key!r} is {document[key]!r}, expected an integer >= 1")
    groups = document.get("optimizer")
    if groups is not None and (not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups)):
        out.append(f"field 'optimizer' is {groups!r:.100}, expected a list of parameter groups (objects) or null")
    if not isinstance(document.get("generation_config", {}), (dict, type(None))):
        out.append("field 'generation_config' is not an object")
    for name, info in document["files"].items():
        out += [f"file {name!r}: {p}" for p in _file_problems(info)]
    for name, entry in document["tensors"].items():
        most = max(document["tp"], document.get("ep", 1) if _is_int(document.get("ep", 1), 1) else 1)
        out += [f"tensor {name!r}: {p}" for p in _tensor_problems(entry, most, document["files"])]
    return out


def _file_problems(info) -> list[str]:
    if not isinstance(info, dict) or not _is_int(info.get("bytes")):
        return ["'bytes' missing or not a non-negative integer"]
    if "checksum" in info:
        checksum = info["checksum"]
        if not isinstance(checksum, dict) or not isinstance(checksum.get("algorithm"), str) or \
                checksum["algorithm"] not in HEX_DIGITS:
            return [f"checksum {checksum!r}: expected {{'algorithm': one of {sorted(HEX_DIGITS)}, 'value': ...}}"]
        algorithm, value = checksum["algorithm"], checksum.get("value")
    elif "sha256" in info:
        algorithm, value = "sha256", info["sha256"]
    else:
        return ["no checksum"]
    if not isinstance(value, str) or len(value) != HEX_DIGITS[algorithm] or \
            any(c not in "0123456789abcdef" for c in value):
        return [f"{algorithm} value {value!r} is not {HEX_DIGITS[algorithm]} lowercase hex digits"]
    return []


def _tensor_problems(entry, tp: int, files: dict) -> list[str]:
    if not isinstance(entry, dict):
        return ["entry is not an object"]
    shape, dtype, parts = entry.get("shape"), entry.get("dtype"), entry.get("pieces")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        return [f"shape {shape!r} is not a list of non-negative integers"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        return [f"dtype {dtype!r} is not one of {sorted(DTYPES)}"]
    aliases = entry.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        return ["'aliases' is not a list of names"]
    if not isinstance(entry.get("carried", False), bool):
        return [f"'carried' is {entry['carried']!r}, expected true or false"]
    if not _layout_ok(entry.get("layout"), shape):
        return [f"layout {entry.get('layout')!r:.200} is not {{'global_shape': the shape, 'shard_dim': a dim or "
                "null, 'num_shards': int >= 1, 'padded_size': int >= 0, optionally 'blocks': int >= 2}"]
    if not isinstance(parts, list) or not parts:
        return ["no pieces"]
    for p in parts:
        if not isinstance(p, dict) or not isinstance(p.get("file"), str) or not _is_int(p.get("start")) or \
                not _is_int(p.get("stop")) or "dim" not in p or not (p["dim"] is None or _is_int(p["dim"])):
            return [f"piece {p!r}: expected {{'file': str, 'dim': int or null, 'start': int, 'stop': int}}"]
        if "blocks" in p and (not _is_int(p["blocks"], 2) or p["dim"] is None):
            return [f"piece {p!r}: 'blocks' must be an integer >= 2, on a piece with a dim"]
        if p["file"] not in files:
            return [f"piece file {p['file']!r} is not listed in 'files'"]
    return _tiling_problems(shape, parts, tp)


def _layout_ok(layout, shape: list[int]) -> bool:
    """The layout the tensor was saved with (read by ``inspect``): consistent with its shape."""
    if not isinstance(layout, dict) or layout.get("global_shape") != shape:
        return False
    dim, ep_dim = layout.get("shard_dim"), layout.get("ep_dim")
    return (dim is None or _is_int(dim) and dim < len(shape)) and _is_int(layout.get("num_shards"), 1) and \
        _is_int(layout.get("padded_size")) and _is_int(layout.get("blocks", 2), 2) and \
        _is_int(layout.get("ep", 2), 2) and (ep_dim is None or _is_int(ep_dim) and ep_dim < len(shape))


def _tiling_problems(shape: list[int], parts: list[dict], tp: int) -> list[str]:
    """The pieces must tile the tensor exactly: one whole piece, or pieces along one dim whose row ranges (every
    block's, for a blocked piece: :func:`piece_spans`) cover ``[0, shape[dim])`` with neither a gap nor an
    overlap, at most one per tp rank (``tp``: the most pieces a tensor may have, tp or ep)."""
    dims = {p["dim"] for p in parts}
    if None in dims:
        return [] if len(parts) == 1 else [f"{len(parts)} pieces, one of them whole (dim null)"]
    if len(dims) != 1:
        return [f"pieces split along several dims {sorted(dims)}"]
    dim = dims.pop()
    if dim >= len(shape):
        return [f"pieces split along dim {dim} of a {len(shape)}-dim tensor"]
    if len(parts) > tp:
        return [f"{len(parts)} pieces for tp={tp}"]
    if len({p["file"] for p in parts}) != len(parts):  # a file holds one entry per tensor name
        return [f"two pieces in one file ({sorted(p['file'] for p in parts)})"]
    for p in parts:
        blocks = p.get("blocks", 1)
        if blocks > 1 and (shape[dim] % blocks or p["stop"] > shape[dim] // blocks):
            return [f"piece {p['file']}: rows [{p['start']}, {p['stop']}) of each of {blocks} blocks do not fit "
                    f"dim {dim} of {shape[dim]} rows"]
    covered = 0
    spans = [(a, b, p["file"]) for p in parts for a, b, _ in piece_spans(p, shape)]
    for start, stop, file in sorted(spans, key=lambda span: span[:2]):
        if start != covered or stop <= start:
            what = "overlap" if start < covered else "gap" if start > covered else "empty piece"
            return [f"pieces do not tile dim {dim}: {what} at row {min(start, covered)} ({file})"]
        covered = stop
    if covered != shape[dim]:
        return [f"pieces cover rows [0, {covered}) of dim {dim}, the tensor has {shape[dim]}"]
    return []
