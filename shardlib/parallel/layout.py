"""A tensor's layout over the mesh: which mesh dim splits which tensor dim, and the padding.

A layout is recorded once, by the parallel module that owns the parameter (``module._shardlib_layouts[name]``),
and everything downstream (state-dict gather and load, checkpoints, reports) reads it from there via
:func:`layout_of` / :func:`named_layouts`. Nothing re-derives a layout from parameter names.

Padding: a dim of global size ``G`` split ``n`` ways is padded at its end to ``P = ceil(G / n) * n``; rank ``r``
holds rows ``[r * P/n, (r+1) * P/n)`` of the padded tensor, of which ``[r * P/n, min((r+1) * P/n, G))`` are real
and the rest are zero padding (e.g. BERT's vocabulary 30522 at tp=4 is padded to 30524, 7631 rows per rank).

Blocks: a fused projection's output (GPT-2's ``c_attn``: q, k and v side by side) is ``blocks`` equal parts of the
dim, each split ``n`` ways, so that every rank holds the same heads of q, of k and of v: rank ``r`` holds rows
``[b * G/blocks + r * G/(blocks n), b * G/blocks + (r+1) * G/(blocks n))`` of each block ``b``, concatenated in
block order (:meth:`Layout.ranges`). Blocked dims are never padded.

Experts: under expert parallelism a tensor of a mixture-of-experts layer also lies over the ``ep`` ranks of the
expert-parallel group (``ep > 1``). A fused experts tensor ([E, ...]) is split along ``ep_dim`` (its expert dim) into
``ep`` equal parts, ep rank ``q`` holding experts ``[q E/ep, (q+1) E/ep)``; the tensor-parallel split then applies
within that part (:meth:`Layout.within_ep`). A tensor of one expert's own module (``ep_dim=None``) is held whole by
the ep rank that holds that expert (which one is the module's business:
:data:`shardlib.parallel.expert_parallel.EP_KEYS_ATTR`), split over tp as any other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

LAYOUTS_ATTR = "_shardlib_layouts"


@dataclass(frozen=True)
class Layout:
    """How one global tensor maps onto the ranks of one mesh dimension.

    ``shard_dim=None`` means replicated on every rank of ``mesh_dim``. ``ep`` / ``ep_dim``: the tensor's place
    over the expert-parallel ranks (module docstring).
    """

    global_shape: tuple[int, ...]
    shard_dim: int | None = None
    mesh_dim: str = "tp"
    num_shards: int = 1
    blocks: int = 1
    ep: int = 1
    ep_dim: int | None = None

    def __post_init__(self):
        if self.shard_dim is not None and not 0 <= self.shard_dim < len(self.global_shape):
            raise ValueError(f"shard_dim {self.shard_dim} out of range for shape {self.global_shape}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if self.blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {self.blocks}")
        if self.blocks > 1 and (self.shard_dim is None or self.global_shape[self.shard_dim] % (self.blocks *
                                                                                                 self.num_shards)):
            raise ValueError(f"a dim of {self.blocks} blocks must divide into {self.blocks} x {self.num_shards} "
                             f"equal parts, got shape {self.global_shape} split on dim {self.shard_dim}")
        if self.ep_dim is not None and (self.ep_dim == self.shard_dim or self.global_shape[self.ep_dim] % self.ep):
            raise ValueError(f"dim {self.ep_dim} of shape {self.global_shape} cannot split into {self.ep} equal "
                             f"expert-parallel parts (tp splits dim {self.shard_dim})")

    @classmethod
    def replicated(cls, shape) -> Layout:
        return cls(global_shape=tuple(shape))

    @property
    def is_sharded(self) -> bool:
        """Whether tensor parallelism splits the tensor (expert parallelism aside: :attr:`is_expert_split`)."""
        return self.shard_dim is not None and self.num_shards > 1

    @property
    def is_expert_split(self) -> bool:
        """Whether the tensor is split over the ep ranks along its expert dim."""
        return self.ep > 1 and self.ep_dim is not None

    def within_ep(self) -> Layout:
        """The layout of one ep rank's part (its global shape that part's; the tp split as before)."""
        if self.ep == 1:
            return self
        shape = list(self.global_shape)
        if self.ep_dim is not None:
            shape[self.ep_dim] //= self.ep
        return replace(self, global_shape=tuple(shape), ep=1, ep_dim=None)

    def ep_range(self, ep_rank: int) -> tuple[int, int]:
        """The ``[start, stop)`` of dim :attr:`ep_dim` that ep rank ``ep_rank`` holds (the whole dim 0 when the
        tensor is not split over ep)."""
        if not self.is_expert_split:
            return 0, self.global_shape[0] if self.global_shape else 0
        part = self.global_shape[self.ep_dim] // self.ep
        return ep_rank * part, (ep_rank + 1) * part

    @property
    def padded_size(self) -> int:
        """Global size of the sharded dim after padding to a multiple of ``num_shards``."""
        if self.shard_dim is None:
            return 0
        g = self.global_shape[self.shard_dim]
        return -(-g // self.num_shards) * self.num_shards

    @property
    def padding(self) -> int:
        return self.padded_size - self.global_shape[self.shard_dim] if self.shard_dim is not None else 0

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.ep > 1:
            return self.within_ep().local_shape
        if self.shard_dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.shard_dim] = self.padded_size // self.num_shards
        return tuple(shape)

    def valid_range(self, rank: int) -> tuple[int, int]:
        """The global index range ``[start, stop)`` of real (non-padding) rows that ``rank`` holds (one range: not
        for a blocked layout, whose rows are :meth:`ranges`)."""
        if self.blocks > 1:
            raise ValueError(f"a layout of {self.blocks} blocks holds several ranges per rank: use Layout.ranges")
        if self.shard_dim is None:
            return 0, self.global_shape[0] if self.global_shape else 0
        local = self.padded_size // self.num_shards
        g = self.global_shape[self.shard_dim]
        start = min(rank * local, g)
        return start, min(start + local, g) if rank * local < g else start

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """The global ``[start, stop)`` ranges of real rows ``rank`` holds, in the order its local tensor holds them
        (one range unless the layout is blocked; an empty one for a rank that holds padding only)."""
        if self.blocks == 1:
            return [self.valid_range(rank)]
        block = self.global_shape[self.shard_dim] // self.blocks
        part = block // self.num_shards
        return [(b * block + rank * part, b * block + (rank + 1) * part) for b in range(self.blocks)]

    def shard(self, full: torch.Tensor, rank: int, ep_rank: int = 0) -> torch.Tensor:
        """This rank's local piece of ``full`` (a new tensor; zero padding appended where needed): tp rank ``rank``'s
        piece of ep rank ``ep_rank``'s part."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"tensor of shape {tuple(full.shape)} does not match layout {self.global_shape}")
        if self.ep > 1:
            start, stop = self.ep_range(ep_rank)
            part = full.narrow(self.ep_dim, start, stop - start) if self.is_expert_split else full
            return self.within_ep().shard(part, rank)
        if self.shard_dim is None:
            return full.clone()
        if self.blocks > 1:
            return torch.cat([full.narrow(self.shard_dim, a, b - a) for a, b in self.ranges(rank)], self.shard_dim)
        start, stop = self.valid_range(rank)
        piece = full.narrow(self.shard_dim, start, stop - start)
        pad = self.local_shape[self.shard_dim] - (stop - start)
        if pad:
            pad_shape = list(self.local_shape)
            pad_shape[self.shard_dim] = pad
            piece = torch.cat([piece, piece.new_zeros(pad_shape)], dim=self.shard_dim)
        return piece.clone()

    def unshard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The global tensor from every rank's local piece (in rank order), padding stripped."""
        if self.shard_dim is None:
            return pieces[0]
        if self.blocks > 1:  # block b of the whole = block b of every rank's piece, in rank order
            chunks = [p.chunk(self.blocks, self.shard_dim) for p in pieces]
            return torch.cat([c[b] for b in range(self.blocks) for c in chunks], self.shard_dim)
        full = torch.cat(pieces, dim=self.shard_dim)
        return full.narrow(self.shard_dim, 0, self.global_shape[self.shard_dim])

    def placements(self):
        """The equivalent DTensor placement on ``mesh_dim`` (padding and blocks are not expressible there)."""
        from torch.distributed.tensor import Replicate, Shard

        return (Shard(self.shard_dim),) if self.is_sharded else (Replicate(),)

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.blocks == 1:  # as every checkpoint before blocked layouts wrote it
            del d["blocks"]
        if self.ep == 1:  # as every checkpoint before expert parallelism wrote it
            del d["ep"], d["ep_dim"]
        d["global_shape"] = list(self.global_shape)
        d["padded_size"] = self.padded_size
        return d

    def describe(self) -> str:
        if self.ep > 1:
            experts = (f"dim {self.ep_dim} split {self.ep}-way over ep" if self.is_expert_split
                       else f"one expert's, held by 1 of {self.ep} ep ranks")
            within = self.within_ep().describe()
            return experts if within == "replicated" else f"{experts}; {within}"
        if not self.is_sharded:
            return "replicated"
        pad = f", padded {self.global_shape[self.shard_dim]}->{self.padded_size}" if self.padding else ""
        blocks = f", in each of {self.blocks} blocks" if self.blocks > 1 else ""
        return f"dim {self.shard_dim} split {self.num_shards}-way over {self.mesh_dim}{blocks}{pad}"


def set_layout(module: nn.Module, name: str, layout: Layout) -> None:
    layouts = module.__dict__.setdefault(LAYOUTS_ATTR, {})
    layouts[name] = layout


def layout_of(model: nn.Module, name: str) -> Layout:
    """The layout of parameter or buffer ``name`` (a dotted path from ``model``); replicated if none recorded."""
    owner_path, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    layout = owner.__dict__.get(LAYOUTS_ATTR, {}).get(attr)
    if layout is not None:
        return layout
    tensor = getattr(owner, attr)
    return Layout.replicated(tensor.shape)


def named_layouts(model: nn.Module, *, buffers: bool = False):
    """Yield ``(name, tensor, layout)`` for every parameter (and every buffer if asked); a tied tensor once."""
    items = list(model.named_parameters())
    if buffers:
        items += list(model.named_buffers())
    for name, tensor in items:
        yield name, tensor, layout_of(model, name)
