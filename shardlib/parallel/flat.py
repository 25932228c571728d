"""Flat gradient / parameter buckets of ZeRO-1/2 (:mod:`shardlib.train.zero`): which parameters share a flat buffer,
where each lies in it, and which elements each data-parallel rank owns. A pure function of the shapes, so the dry
run (``shardlib.plan``) predicts exactly what the Trainer builds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

DEFAULT_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket


@dataclass(eq=False)
class Bucket:
    """Parameters of one dtype laid out in one flat buffer ``data`` (each a view into it), ``numel`` padded to a
    multiple of dp; this rank owns ``[lo, hi)``."""

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    lo: int
    hi: int
    late: bool  # reduced after backward (finish_grads), not by the hooks
    experts: bool = False  # of expert weights split over ep: partitioned over the ranks holding the same experts
    data: torch.Tensor = None
    grad_shard: torch.Tensor | None = None  # this rank's summed gradient elements [hi - lo] (None: nothing yet)
    arrived: set = field(default_factory=set)  # indices of params whose gradient arrived in this backward

    def span(self, i: int) -> tuple[int, int]:
        """Where parameter ``i`` lies in the flat buffer."""
        return self.offsets[i], self.offsets[i] + self.params[i].numel()

    def owned(self, rank: int, dp: int) -> tuple[int, int]:
        """The elements dp rank ``rank`` owns: an exact 1/dp of the (padded) buffer."""
        shard = self.numel // dp
        return rank * shard, (rank + 1) * shard


def flat_buckets(params, dp: int, bucket_bytes: int, late=frozenset(), order=None, experts=frozenset(),
                 edp: int | None = None) -> list[Bucket]:
    """The buckets of ``params`` (each once) in reverse ``order`` (the model's registration order; default: as
    given): one open bucket per (dtype, device, late, expert), filled up to ``bucket_bytes`` (a parameter that would
    overflow it starts the next one; a parameter larger than ``bucket_bytes`` is a bucket of its own), its element
    count padded to a multiple of ``dp`` (of ``edp`` for a bucket of the parameters whose ids are in ``experts``).
    So a bucket is at most max(``bucket_bytes``, the largest parameter). A pure function of the shapes: the dry run
    (``shardlib.plan``) calls it too."""
    seen, unique = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    position = {id(p): i for i, p in enumerate(order if order is not None else unique)}
    unique.sort(key=lambda p: -position.get(id(p), -1))
    closed, open_ = [], {}
    for p in unique:
        key = (p.dtype, p.device, id(p) in late, id(p) in experts)
        members = open_.get(key, [])
        if members and (sum(m.numel() for m in members) + p.numel()) * p.element_size() > bucket_bytes:
            closed.append((key, open_.pop(key)))
        open_.setdefault(key, []).append(p)
    buckets = []
    for i, (key, members) in enumerate(closed + list(open_.items())):
        offsets = [sum(m.numel() for m in members[:j]) for j in range(len(members))]
        ranks = (edp or dp) if key[3] else dp
        numel = -(-(offsets[-1] + members[-1].numel()) // ranks) * ranks
        buckets.append(Bucket(i, members, offsets, numel, 0, 0, key[2], key[3]))
    return buckets
