"""Checkpoints: HF safetensors straight into shards, the sharded format, resharding and export to HF.

Files are read and written by :mod:`shardlib.safetensors_io`: no file is ever mapped (a rank's resident memory is
its local shards: slices are read with ``preadv`` straight into the parameters), writes stream in bounded blocks
with an xxh3-128 checksum computed on the way, and nothing is ever unpickled. ``convert`` reads each source tensor
once and sends each block's rows to the output files that hold them.

The sharded format (:mod:`.format`, ``docs/checkpoint-format.md``) is a directory with

* ``shardlib.json``: format version, model class, model config, and for every tensor its global shape, dtype,
  layout, aliases (tied names) and *pieces*: which file holds which rows ``[start, stop)`` of which dim;
  plus every file's size and checksum, and a checksum of the document itself (each data file also records the
  pieces it holds in its own header, checked on load);
* ``model-tp{r}-of-{n}.safetensors``: rank r's rows of every sharded tensor (padding is not stored);
* ``model-replicated.safetensors``: every replicated tensor, written once.

Writes are atomic (:mod:`.atomic`): all ranks write into a hidden staging directory next to the destination, and
the directory appears under its final name (replacing an older checkpoint only with ``overwrite``) after every
rank finished and fsynced its files and ``shardlib.json`` is complete. A crash mid-save leaves the previous
checkpoint untouched, and the next save or load finishes or removes what it left.

Modules: :mod:`.format`, :mod:`.atomic`, :mod:`.tensors` (the model side), :mod:`.reader`, :mod:`.saving`,
:mod:`.loading`, :mod:`.conversion`, :mod:`.hf_save`, :mod:`.outcome` (every rank learns every rank's outcome of a
load), :mod:`.adapter` (LoRA adapters in peft's format).
"""

from ..safetensors_io import CheckpointError, SafetensorsFile, SafetensorsFiles, checksum_of, file_checksum
from .adapter import load_adapter, save_adapter
from .atomic import recover
from .conversion import convert, export_hf
from .format import FORMAT, METADATA, READABLE_FORMATS, Piece, hf_class_name, rank_file, replicated_file
from .hf_save import save_pretrained
from .loading import from_pretrained, from_sharded, load, load_hf_weights, whole_buffer
from .reader import ShardedCheckpoint
from .saving import StagedSave, commit, save, stage

__all__ = [
    "CheckpointError", "SafetensorsFile", "SafetensorsFiles", "checksum_of", "file_checksum", "recover", "convert",
    "export_hf", "FORMAT", "METADATA", "READABLE_FORMATS", "Piece", "hf_class_name", "rank_file", "replicated_file",
    "save_pretrained", "from_pretrained", "from_sharded", "load", "load_hf_weights", "whole_buffer",
    "ShardedCheckpoint", "StagedSave", "commit", "save", "stage", "save_adapter", "load_adapter",
]
