"""The optimizer state of :class:`shardlib.train.zero.FlatZero` by model parameter, for checkpoints: each
parameter's state whole (tp-local), gathered over dp from the ranks' pieces on save, and this rank's piece kept on
load, so a checkpoint saved at any zero stage and dp loads at any other (zero=0's format)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.collectives import ALL_GATHER_SINGLE
from ..parallel.flat import Bucket
from ..parallel.optim_state import MASTER_KEY


class StateByParameter:
    """Mixed into :class:`~shardlib.train.zero.FlatZero` (its buckets, pieces, inner optimizer and dp group)."""

    def param_state(self, param) -> dict:
        """The whole (tp-local) optimizer state of ``param``, gathered over dp: a collective on the dp group (every
        dp rank must ask for the same parameters in the same order). Master weights under ``MASTER_KEY``."""
        self.wait_params()
        located = self._bucket_of.get(id(param))
        if located is None:
            return {}
        bucket, i = located
        if bucket.index not in self._gathered:
            if len(self._gathered) == 2:  # an eager and a late bucket alternate in registration order
                self._gathered.pop(next(iter(self._gathered)))
            self._gathered[bucket.index] = self._gather_state(bucket)
        flats, keys = self._gathered[bucket.index]
        a, b = bucket.span(i)
        return {key: flats[key][a:b].view_as(param).clone() if value is None else value
                for key, value in keys.get(i, {}).items()}

    def _gather_state(self, bucket: Bucket) -> tuple[dict, dict]:
        """The bucket's element-wise state tensors whole (one all-gather per state key) and, per parameter index,
        its state keys: None for an element-wise tensor (in the first dict), else the value (``step``), from the
        ranks that hold a piece of it."""
        mine, described = {}, {}
        for i, p in enumerate(bucket.params):
            piece = self._piece_of.get(id(p))
            if piece is None:
                continue
            state = dict(self.inner.state.get(piece.tensor, {}))
            if self.master_weights:
                state[MASTER_KEY] = piece.tensor
            mine[i] = (piece, state)
            described[i] = {k: (str(v.dtype).removeprefix("torch."), None if _elementwise(v, piece) else v.tolist())
                            for k, v in state.items() if torch.is_tensor(v)}
        group, size, _ = self.group_of(bucket)
        everyone: list = [None] * size
        dist.all_gather_object(everyone, described, group=group)
        element_dtypes, keys = {}, {}
        for described_by_rank in everyone:
            for i, by_key in described_by_rank.items():
                for key, (dtype, value) in by_key.items():
                    if value is None:
                        element_dtypes[key] = getattr(torch, dtype)
                        keys.setdefault(i, {})[key] = None
                    else:
                        keys.setdefault(i, {})[key] = torch.tensor(value, dtype=getattr(torch, dtype))
        flats = {}
        for key in sorted(element_dtypes):  # the same order on every rank
            shard = torch.zeros(bucket.hi - bucket.lo, dtype=element_dtypes[key], device=bucket.data.device)
            for piece, state in mine.values():
                if key in state:
                    shard[piece.at:piece.at + piece.stop - piece.start].copy_(state[key])
            flat = torch.empty(bucket.numel, dtype=shard.dtype, device=shard.device)
            ALL_GATHER_SINGLE(flat, shard, group=group)
            flats[key] = flat
        return flats, keys

    def set_param_state(self, param, state: dict) -> None:
        """Keep this rank's piece of ``param``'s whole (tp-local) state; a master weight missing from ``state`` (a
        checkpoint saved without master weights) is taken from the parameter."""
        self.wait_params()
        piece = self._piece_of.get(id(param))
        if piece is None:
            return
        self._gathered.clear()
        mine = {}
        for key, value in state.items():
            if key == MASTER_KEY:
                continue
            if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0:
                value = value.reshape(-1)[piece.start:piece.stop].to(piece.tensor.device).clone()
            mine[key] = value
        if self.master_weights:
            with torch.no_grad():
                source = state.get(MASTER_KEY, param)
                piece.tensor.copy_(source.reshape(-1)[piece.start:piece.stop])
        if mine:
            self.inner.state[piece.tensor] = mine


def _elementwise(value: torch.Tensor, piece) -> bool:
    return value.dim() > 0 and value.shape == piece.tensor.shape
