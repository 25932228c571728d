"""Data for ``fit``: a global sample order that depends on the seed and the epoch only, never on the mesh.

Each epoch's order is a permutation of the dataset drawn from ``(seed, epoch)`` (or the dataset's own order
without shuffling). Consecutive runs of ``batch_size`` samples form the *global batches*; data-parallel rank r
takes the r-th of dp contiguous shares of each global batch and reads only those samples; the pp x sp x tp ranks of
one dp rank read the same share. So a run resumed at another dp size continues with the same samples, in the same
global batches, from the same position. (torch's ``DistributedSampler`` interleaves samples by rank and pads by
repeating some, so its order changes with dp.)

The last partial global batch of an epoch: training drops it (every step has exactly ``batch_size`` samples; which
samples fall in it changes with each epoch's permutation, so no sample is left out every epoch); evaluation keeps it,
split as evenly as possible over dp (a share may be empty), so every sample is evaluated exactly once.

Packing (``packing=``, a :class:`shardlib.train.packing.PackingCollator`): every rank reads the whole global batch,
packs it into rows (the same rows everywhere: the packing is a function of the samples), and keeps the r-th of dp
contiguous shares of the rows; the collator pads the row count to a multiple of dp x microbatches with empty rows.

Loading goes through torch's ``DataLoader`` (workers, pinned memory, prefetching) with :class:`GlobalBatchSampler`
as its batch sampler. Iterable datasets are read in their own order; every rank iterates the stream and collates
only its share of each global batch (with workers, worker w takes global batches w, w + W, ...).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, default_collate, get_worker_info

from .batches import split_batch, to_device


def epoch_order(length: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The global sample order of ``epoch``: a permutation drawn from ``(seed, epoch)`` alone."""
    if not shuffle:
        return torch.arange(length)
    return torch.randperm(length, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def dp_share(size: int, dp: int, dp_rank: int) -> range:
    """Rank ``dp_rank``'s contiguous share of ``size`` samples: equal when dp divides size, else the first
    ``size % dp`` ranks take one more."""
    base, extra = divmod(size, dp)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (dp_rank < extra))


class GlobalBatchSampler(Sampler):
    """Batch sampler yielding this data-parallel rank's indices of each global batch of one epoch
    (:meth:`set_epoch` chooses the epoch and the first global batch, for resuming mid-epoch)."""

    def __init__(self, length: int, batch_size: int, dp: int = 1, dp_rank: int = 0, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True):
        self.length, self.batch_size, self.dp, self.dp_rank = length, batch_size, dp, dp_rank
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.length, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        return max(self.batches_per_epoch() - self.start, 0)

    def __iter__(self) -> Iterator[list[int]]:
        order = epoch_order(self.length, self.seed, self.epoch, self.shuffle)
        for b in range(self.start, self.batches_per_epoch()):
            batch = order[b * self.batch_size:(b + 1) * self.batch_size]
            share = dp_share(len(batch), self.dp, self.dp_rank)
            if len(share):
                yield batch[share.start:share.stop].tolist()


class _IterableShares(IterableDataset):
    """This rank's collated share of each global batch of an iterable dataset, skipping ``start`` global batches."""

    def __init__(self, source, batch_size: int, dp: int, dp_rank: int, start: int, drop_last: bool,
                 collate_fn: Callable):
        self.source, self.batch_size, self.dp, self.dp_rank = source, batch_size, dp, dp_rank
        self.start, self.drop_last, self.collate_fn = start, drop_last, collate_fn

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        chunk: list = []
        index = 0
        for item in self.source:
            chunk.append(item)
            if len(chunk) == self.batch_size:
                yield from self._share(index, chunk, workers, worker)
                chunk, index = [], index + 1
        if chunk and not self.drop_last:
            yield from self._share(index, chunk, workers, worker)

    def _share(self, index: int, chunk: list, workers: int, worker: int):
        if index < self.start or (index - self.start) % workers != worker:
            return
        share = dp_share(len(chunk), self.dp, self.dp_rank)
        if len(share):
            yield self.collate_fn(chunk[share.start:share.stop])


class EpochData:
    """One dataset's loader for ``fit``: ``batches(epoch, start)`` iterates this rank's shares of the global
    batches of ``epoch`` from global batch ``start`` on."""

    def __init__(self, dataset, batch_size: int, mesh, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, collate_fn: Callable | None = None, num_workers: int = 0,
                 prefetch_factor: int | None = None, what: str = "train_data", device: str = "cpu",
                 packing: Callable | None = None):
        self.dataset, self.batch_size, self.what = dataset, batch_size, what
        self.device = torch.device(device)
        self.collate_fn = collate_fn or default_collate
        self.packing = packing
        self.iterable = isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__")
        self.mesh_dp, self.mesh_dp_rank = mesh.dp, (mesh.local_rank("dp") if mesh.dp > 1 else 0)
        # packed: the samplers hand every rank the whole global batch, and the rows are shared out after packing
        dp, dp_rank = (1, 0) if packing is not None else (self.mesh_dp, self.mesh_dp_rank)
        self.dp, self.dp_rank, self.drop_last = dp, dp_rank, drop_last
        self.loader_options = dict(num_workers=num_workers, pin_memory=self.device.type == "cuda",
                                   prefetch_factor=prefetch_factor if num_workers else None)
        self.sampler = None
        if not self.iterable:
            if len(dataset) == 0:
                raise ValueError(f"{what} is empty")
            self.sampler = GlobalBatchSampler(len(dataset), batch_size, dp, dp_rank, seed=seed, shuffle=shuffle,
                                              drop_last=drop_last)
            if self.sampler.batches_per_epoch() == 0:
                raise ValueError(f"{what} has {len(dataset)} samples, fewer than one global batch of {batch_size}")
            # the loader draws its workers' seeds from its own generator, never from the global one, so a resumed
            # run's global RNG stream is not advanced by creating loaders
            self.loader = DataLoader(dataset, batch_sampler=self.sampler, collate_fn=self._collate,
                                     generator=torch.Generator().manual_seed(seed), **self.loader_options)

    def steps_per_epoch(self) -> int | None:
        return self.sampler.batches_per_epoch() if self.sampler is not None else None

    def _collate(self, items: list):
        if self.packing is not None:
            rows = self.packing(items)
            return split_batch(rows, self.mesh_dp)[self.mesh_dp_rank] if self.mesh_dp > 1 else rows
        batch = self.collate_fn(items)
        if not isinstance(batch, dict):
            raise TypeError(f"{self.what}: a batch must be a dict of tensors, collate_fn gave "
                            f"{type(batch).__name__} (make the dataset's items dicts, or pass collate_fn=...)")
        return batch

    def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
        """This rank's batches of ``epoch`` from global batch ``start`` on, on ``self.device``."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, start)
            loader = self.loader
        else:
            shares = _IterableShares(self.dataset, self.batch_size, self.dp, self.dp_rank, start, self.drop_last,
                                     self._collate)
            loader = DataLoader(shares, batch_size=None, generator=torch.Generator().manual_seed(epoch),
                                **self.loader_options)
        return (to_device(batch, self.device) for batch in loader)
