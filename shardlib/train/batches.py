"""Batches as dicts of tensors: slicing a batch into microbatches and into data-parallel shares."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def check_batch(batch, what: str = "the batch") -> int:
    """The size of dim 0 shared by every tensor of ``batch``, a mapping of names to tensors (other values ride
    along unsliced): a TypeError naming the type of anything else, a ValueError naming the keys of a batch with no
    tensor, a 0-dim tensor or tensors that disagree."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"{what} must be a dict of tensors (name -> [batch, ...]), got {type(batch).__name__}")
    tensors = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    if not tensors:
        raise ValueError(f"{what} has no tensors (keys: {sorted(map(str, batch))}; "
                         f"value types: {sorted({type(v).__name__ for v in batch.values()})})")
    scalars = sorted(str(k) for k, v in tensors.items() if v.dim() == 0)
    if scalars:
        raise ValueError(f"{what} has 0-dim tensors ({', '.join(scalars)}); every tensor needs a batch dimension")
    sizes = {v.shape[0] for v in tensors.values()}
    if len(sizes) != 1:
        raise ValueError(f"{what}'s tensors disagree on the batch size: "
                         f"{', '.join(f'{k}: {v.shape[0]}' for k, v in tensors.items())}")
    return sizes.pop()


def first_tensor(batch) -> torch.Tensor:
    """The first tensor of ``batch`` (the Trainer's entry points checked it: :func:`check_batch` runs here only to
    say what is wrong with a batch that has none)."""
    found = next((v for v in batch.values() if torch.is_tensor(v)), None) if isinstance(batch, Mapping) else None
    if found is None:
        check_batch(batch)
    return found


def split_batch(batch: dict, parts: int) -> list[dict]:
    """``parts`` equal slices along dim 0 of every tensor (other values are shared)."""
    size = check_batch(batch)
    if size % parts:
        raise ValueError(f"batch size {size} is not divisible by {parts} microbatches")
    step = size // parts
    return [{k: v[i * step:(i + 1) * step] if torch.is_tensor(v) else v for k, v in batch.items()}
            for i in range(parts)]


def microbatch_count(size: int, microbatches: int) -> int:
    """The largest divisor of ``size`` that is at most ``microbatches`` (an evaluation tail of any size runs)."""
    return max(d for d in range(1, min(size, microbatches) + 1) if size % d == 0)


def to_device(batch: dict, device: torch.device) -> dict:
    """Every tensor of ``batch`` on ``device`` (asynchronously from pinned memory); others unchanged."""
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def dp_shard(batch: dict, mesh) -> dict:
    """This data-parallel rank's contiguous share of a global batch (the same on its pp x sp x tp ranks)."""
    if mesh.dp == 1:
        return batch
    return split_batch(batch, mesh.dp)[mesh.local_rank("dp")]
