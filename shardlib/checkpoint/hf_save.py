"""``save_pretrained`` for a live sharded model: an HF checkpoint written straight from any dp x pp x tp x sp
layout.

Every rank first writes its own shards into a sharded checkpoint staged inside the destination's staging
directory (:func:`.saving.commit`: collective, each tensor streamed from the rank that holds it, no gather); rank 0
then streams that into HF files (:func:`.conversion.write_hf`, as ``export_hf``), one 4 MiB block at a time. No rank ever holds more
than its own shards plus a few blocks, whatever the layout: the price is writing the bytes twice. (Gathering each
tensor to rank 0 over the network would write them once but needs one gather per tensor per layout, pipeline
stages and FSDP2 shards included: the sharded save already does all of that, and is tested for each.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist
from torch import nn

from ..parallel.timeouts import stalled_ranks_named
from ..safetensors_io import CheckpointError
from ..sharding.sharded import shard_state
from .adapter import is_peft_model, save_adapter
from .atomic import AtomicDirectory, scratch_dir
from .conversion import write_hf
from .outcome import timeout_of
from .reader import ShardedCheckpoint
from .saving import _broadcast_str, claim, commit, stage


def save_pretrained(model: nn.Module, directory: str | Path, *, overwrite: bool = True,
                    max_shard_bytes: int = 2 << 30) -> Path:
    """Write ``model`` (sharded, any layout) as a plain HF checkpoint that ``from_pretrained`` of transformers or
    :func:`shardlib.from_pretrained` loads bitwise: ``config.json``, the safetensors weights (with an index past
    ``max_shard_bytes``) and ``generation_config.json`` where the model has one. Tokenizer files are the user's, as
    in transformers (``tokenizer.save_pretrained(directory)``). Every rank calls it. An existing ``directory`` is
    replaced, as transformers does, but atomically: a crash leaves the old checkpoint or the new one, never a mix
    (``overwrite=False`` refuses an existing one).

    A peft model saves its adapters alone, in peft's format, as ``PeftModel.save_pretrained`` does
    (:func:`.adapter.save_adapter`)."""
    if is_peft_model(model):
        return save_adapter(model, directory, overwrite=overwrite)
    directory = Path(directory)
    with stalled_ranks_named(f"saving {directory}", timeout_of(shard_state(model).mesh)):
        return _save_pretrained(model, directory, overwrite, max_shard_bytes)


def _save_pretrained(model: nn.Module, directory: Path, overwrite: bool, max_shard_bytes: int) -> Path:
    """:func:`save_pretrained` of a model without adapters."""
    leader = not dist.is_initialized() or dist.get_rank() == 0
    claim(directory, overwrite)
    status = ""
    scratch = scratch_dir(directory)  # recover() removes it after a kill: it never outlives an interrupted save
    commit(stage(model), scratch, overwrite=True)
    if leader:
        try:
            with ShardedCheckpoint(scratch) as ckpt, \
                    AtomicDirectory(directory, overwrite=overwrite, recovered=True) as tmp:
                write_hf(ckpt, tmp, max_shard_bytes)
        except BaseException as exc:
            status = f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    status = _broadcast_str(status)
    if status:
        raise CheckpointError(f"saving {directory} failed: {status}")
    return directory
