"""Tensors FSDP2 (ZeRO-3, :mod:`shardlib.train.fsdp`) shards over the data-parallel dimension, seen from shardlib's
tp-local tensors.

Under ZeRO-3 a parameter (and its gradient and optimizer state) is a DTensor ``Shard(0)`` on the 1-D dp sub-mesh
whose global shape is the tp-local shape; everywhere else it is a plain tensor. These helpers let the layers that
read or write such tensors (full state dicts, checkpoints, the Trainer) treat both alike without knowing FSDP2.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def local_shape(shape: torch.Size, dp: int, dp_rank: int) -> torch.Size:
    """The shape of dp rank ``dp_rank``'s FSDP2 shard of a tensor of ``shape`` (``Shard(0)``: ``torch.chunk``'s
    rows, the last ranks' possibly fewer or none)."""
    if not shape:
        return shape
    rows = -(-shape[0] // dp)
    return torch.Size((max(0, min(rows, shape[0] - dp_rank * rows)), *shape[1:]))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard; a plain tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The tp-local tensor of a dp-sharded DTensor, gathered over dp (a collective on the dp group); a plain tensor
    itself."""
    return tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor


def like(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``value`` (a tp-local tensor) placed as ``reference`` is: this rank's dp slice of it when ``reference`` is a
    DTensor of the same shape (no communication: every rank slices its own copy)."""
    if isinstance(reference, DTensor) and value.shape == reference.shape:
        return distribute_tensor(value.to(reference.device), reference.device_mesh, reference.placements,
                                 src_data_rank=None)
    return value


__all__ = ["local_shape", "local", "whole", "like"]
