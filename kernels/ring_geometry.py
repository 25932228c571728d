"""Where positions lie in ring attention: the zigzag layout of the sequence over the ring's ranks
(:class:`RingLayout`), one rank's view of it (:class:`RingGeometry`), and the view of queries of one sequence
against the keys of another on one rank (:class:`CrossGeometry`). Read by :mod:`.ring_blocks` (the pieces each
block is cut into) and :mod:`.mask_spec` (masks as data)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RingLayout:
    """Which positions of the padded sequence each of ``ranks`` ranks holds, for a ring of ``ring`` positions
    (Ulysses x ring: ``ranks // ring`` consecutive ranks share a ring position's positions, in order)."""

    ranks: int
    ring: int

    def padded(self, length: int) -> int:
        """The length padded to equal segments (2 per ring position), each divisible over a position's ranks."""
        return -(-length // (2 * self.ranks)) * 2 * self.ranks

    def order(self, length: int, device) -> torch.Tensor:
        """The padded positions in rank order: rank s holds ``order[s*c:(s+1)*c]`` (``c = padded / ranks``)."""
        return _zigzag(self.padded(length), self.ring, str(device))

    def inverse(self, length: int, device) -> torch.Tensor:
        """Where each padded position is in rank order (``order[inverse] == arange``)."""
        return _inverse(self.padded(length), self.ring, str(device))


@functools.lru_cache(maxsize=64)
def _zigzag(padded: int, ring: int, device: str) -> torch.Tensor:
    segment = padded // (2 * ring)
    starts = [s for p in range(ring) for s in (p, 2 * ring - 1 - p)]
    return torch.cat([torch.arange(s * segment, (s + 1) * segment) for s in starts]).to(device)


@functools.lru_cache(maxsize=64)
def _inverse(padded: int, ring: int, device: str) -> torch.Tensor:
    return torch.argsort(_zigzag(padded, ring, device))


@dataclass
class RingGeometry:
    """This rank's ring position (``rank`` of ``size``), the positions each ring position's ``chunk`` queries and
    keys are at (``order``: all of them, in ring order) and the true length."""

    rank: int
    size: int
    chunk: int
    length: int
    order: torch.Tensor

    # the mask spec's view (queries and keys of one sequence here; :class:`CrossGeometry`: of two)
    @property
    def device(self) -> torch.device:
        return self.order.device

    @property
    def query_length(self) -> int:
        return self.length

    key_length = query_length

    def query_runs(self) -> list[tuple[int, int, int, int]]:
        return self.runs(self.rank)

    def key_runs(self, block: int) -> list[tuple[int, int, int, int]]:
        return self.runs(block)

    def query_positions(self) -> torch.Tensor:
        return self.positions(self.rank)

    def key_positions(self, block: int) -> torch.Tensor:
        return self.positions(block)

    @classmethod
    def whole(cls, length: int, device) -> "RingGeometry":
        """A ring of one: the whole sequence, unpadded, on this rank (attention without sequence parallelism)."""
        return cls(0, 1, length, length, torch.arange(length, device=device))

    def positions(self, block: int) -> torch.Tensor:
        return self.order[block * self.chunk:(block + 1) * self.chunk]

    def runs(self, block: int) -> list[tuple[int, int, int, int]]:
        """(start, stop, first position, last position) of the two segments of block ``block``: ring position p
        holds segments p and 2n - 1 - p (:class:`RingLayout`), each a run of consecutive positions. Arithmetic, not
        read from ``order``: the same on the meta device (the dry run) and without a device sync. A ring of one holds
        one run (its positions in order)."""
        if self.size == 1:
            return [(0, self.chunk, 0, self.chunk - 1)]
        half, far = self.chunk // 2, 2 * self.size - 1 - block
        return [(0, half, block * half, (block + 1) * half - 1), (half, self.chunk, far * half, (far + 1) * half - 1)]


@dataclass
class CrossGeometry:
    """Queries of one sequence against all keys of another, on this rank: a ring of one (nothing travels), for
    cross-attention whose mask is data (the queries' positions are their local indices)."""

    query_length: int
    key_length: int
    device: torch.device
    rank: int = 0
    size: int = 1

    @property
    def chunk(self) -> int:
        return self.query_length

    def query_runs(self):
        return [(0, self.query_length, 0, self.query_length - 1)]

    def key_runs(self, block: int):
        return [(0, self.key_length, 0, self.key_length - 1)]

    def query_positions(self) -> torch.Tensor:
        return torch.arange(self.query_length, device=self.device)

    def key_positions(self, block: int) -> torch.Tensor:
        return torch.arange(self.key_length, device=self.device)


__all__ = ["RingLayout", "RingGeometry", "CrossGeometry"]
