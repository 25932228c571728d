"""Batches as dicts of tensors: slicing a batch into microbatches and into data-parallel shares."""

from __future__ import annotations

import torch


def first_tensor(batch: dict) -> torch.Tensor:
    try:
        return next(v for v in batch.values() if torch.is_tensor(v))
    except StopIteration:
        raise ValueError(f"the batch has no tensors (keys: {sorted(batch)})") from None


def split_batch(batch: dict, parts: int) -> list[dict]:
    """``parts`` equal slices along dim 0 of every tensor (other values are shared)."""
    sizes = {v.shape[0] for v in batch.values() if torch.is_tensor(v)}
    if not sizes:
        raise ValueError(f"the batch has no tensors (keys: {sorted(batch)})")
    if len(sizes) != 1:
        raise ValueError(f"batch tensors disagree on the batch size: {sorted(sizes)}")
    (size,) = sizes
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
