"""RNG streams for dropout under tensor parallelism, on CPU and GPU.

Two kinds of activations need two kinds of random streams:

* replicated activations (the residual stream, embeddings, anything after a row-parallel all-reduce) must draw
  the *same* dropout mask on every rank of a TP group, or the replicas drift apart. They use torch's default
  generator, seeded identically on every rank (:func:`manual_seed`) and consumed identically because every TP
  rank runs the same ops on the same shapes outside the sharded regions;
* sharded activations (the attention probabilities of this rank's heads) must draw *different* masks per rank,
  like the unsharded model whose heads draw independent masks. Their modules run inside
  ``tracker.fork()``, which swaps in a per-TP-rank generator state for the duration of the call.

All-to-all sequence parallelism (mesh dimension ``sp``) adds a third kind: activations sharded along the sequence
but replicated over the TP group (the residual stream inside the layers) draw from the "sequence-parallel" stream,
seeded per sp rank; the "tensor-parallel" stream is then seeded per (sp, tp) rank, since its heads differ on both.

torch's offset-based RNG tracker (``torch.distributed.tensor._random``) is CUDA-only, hence this one. It keeps
plain generator states (``torch.get_rng_state`` / ``torch.cuda.get_rng_state``) so it works on any device.
"""

from __future__ import annotations

import contextlib

import torch

#: Offset added to the base seed for the tensor-parallel stream (Megatron uses 2718 too).
TP_SEED_OFFSET = 2718
#: Offset added to the base seed for the all-to-all sequence-parallel stream.
SP_SEED_OFFSET = 3141


class RNGStatesTracker:
    """Named RNG states that can be swapped in around a region of code."""

    def __init__(self):
        self._states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        with _preserve_default_rng():
            torch.manual_seed(seed)
            self._states[name] = _get_state()

    def has(self, name: str) -> bool:
        return name in self._states

    @contextlib.contextmanager
    def fork(self, name: str = "tensor-parallel"):
        """Run the block with the named stream as the default generator; advance that stream, not the default."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was never added; call shardlib.manual_seed(seed, mesh) first")
        outer = _get_state()
        _set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state()
            _set_state(outer)

    def get_states(self) -> dict:
        return dict(self._states)

    def set_states(self, states: dict) -> None:
        self._states = dict(states)


def _get_state():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


@contextlib.contextmanager
def preserved_rng(tracker: RNGStatesTracker | None = None):
    """Run the block without advancing any random stream: torch's default generator (CPU and CUDA) and every
    stream of ``tracker`` are put back afterwards."""
    state = _get_state()
    streams = tracker.get_states() if tracker is not None else None
    try:
        yield
    finally:
        _set_state(state)
        if tracker is not None:
            tracker.set_states(streams)


@contextlib.contextmanager
def _preserve_default_rng():
    state = _get_state()
    try:
        yield
    finally:
        _set_state(state)


def manual_seed(seed: int, mesh=None, tracker: RNGStatesTracker | None = None) -> RNGStatesTracker:
    """Seed the default generator with ``seed`` (same on every rank) and return a tracker whose
    "tensor-parallel" stream is seeded with ``seed + 2718 + tp_rank``.

    Pass the returned tracker to :func:`shardlib.shard` (``rng_tracker=``), or let ``shard`` create one from the
    current default generator state.
    """
    torch.manual_seed(seed)
    return rng_streams(tracker or RNGStatesTracker(), seed, mesh)


def rng_streams(tracker: RNGStatesTracker, seed: int, mesh=None) -> RNGStatesTracker:
    """Add this rank's "tensor-parallel" stream (``seed + 2718 + tp_rank + tp * sp_rank``) and, on a mesh with
    all-to-all sequence parallelism, its "sequence-parallel" stream (``seed + 3141 + sp_rank``)."""
    tp, tp_rank = (mesh.tp, mesh.tp_rank) if mesh is not None else (1, 0)
    sp, sp_rank = getattr(mesh, "sp", 1), 0
    if sp > 1:
        sp_rank = mesh.sp_rank
        tracker.add("sequence-parallel", seed + SP_SEED_OFFSET + sp_rank)
    tracker.add("tensor-parallel", seed + TP_SEED_OFFSET + tp_rank + tp * sp_rank)
    return tracker
