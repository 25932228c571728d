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

torch's offset-based RNG tracker (``torch.distributed.tensor._random``) is CUDA-only, hence this one. Its streams
are plain ``torch.Generator`` objects, so it works on any device, and under ``torch.compile`` (see
:func:`local_dropout`).
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist

#: Offset added to the base seed for the tensor-parallel stream (Megatron uses 2718 too).
TP_SEED_OFFSET = 2718
#: Offset added to the base seed for the all-to-all sequence-parallel stream.
SP_SEED_OFFSET = 3141


class RNGStatesTracker:
    """Named random streams, each a ``torch.Generator`` per device type (CPU, and CUDA on first use), swapped in as
    the default generator around a region of code (:meth:`fork`).

    Compiled code cannot swap generators (dynamo graph-breaks on it, and does not pass a generator object to a
    random op), so there a stream is drawn from torch's default generator instead: ``ranks[name] = (index, count)``
    says which of ``count`` equal draws this rank keeps (:func:`local_dropout`)."""

    def __init__(self):
        self._seeds: dict[str, int] = {}
        self._generators: dict[str, dict[str, torch.Generator]] = {}
        self.ranks: dict[str, tuple[int, int]] = {}
        #: per :meth:`fork` in progress, innermost last: the default generator state it swapped out (kept current
        #: by :meth:`replicated`)
        self._outer: list[list] = []

    def add(self, name: str, seed: int, *, index: int = 0, count: int = 1) -> None:
        """Add stream ``name`` seeded with ``seed``; this rank is ``index`` of the ``count`` ranks whose draws must
        differ (used only by compiled code)."""
        if name in self._seeds:
            raise ValueError(f"RNG state {name!r} already exists")
        if not 0 <= index < count:
            raise ValueError(f"RNG stream {name!r}: rank index {index} is not in [0, {count})")
        self._seeds[name] = seed
        self._generators[name] = {"cpu": torch.Generator().manual_seed(seed)}
        self.ranks[name] = (index, count)

    def has(self, name: str) -> bool:
        return name in self._seeds

    def generator(self, name: str, device: torch.device | str = "cpu") -> torch.Generator:
        """The named stream's generator on ``device`` (a CUDA one is created on first use, seeded like the CPU one,
        as ``torch.manual_seed`` seeds both)."""
        if name not in self._seeds:
            raise KeyError(f"RNG state {name!r} was never added; call shardlib.manual_seed(seed, mesh) first")
        kind = torch.device(device).type
        generators = self._generators[name]
        if kind not in generators:
            generators[kind] = torch.Generator(device=kind).manual_seed(self._seeds[name])
        return generators[kind]

    @contextlib.contextmanager
    def fork(self, name: str = "tensor-parallel"):
        """Run the block with the named stream as the default generator; advance that stream, not the default."""
        cpu = self.generator(name)
        cuda = self.generator(name, "cuda") if _cuda_in_use() else None
        outer = [_get_state()]
        _set_state((cpu.get_state(), cuda.get_state() if cuda is not None else None))
        self._outer.append(outer)
        try:
            yield
        finally:
            self._outer.pop()
            cpu_state, cuda_state = _get_state()
            cpu.set_state(cpu_state)
            if cuda is not None:
                cuda.set_state(cuda_state)
            _set_state(outer[0])

    @contextlib.contextmanager
    def replicated(self):
        """Inside :meth:`fork`, run the block on the default generator that the fork swapped out (the stream every
        rank of the group shares) and advance that one: for replicated activations inside a module whose other
        random draws act on sharded ones (a LoRA adapter's dropout on the input of a column-parallel q projection
        inside the attention block). Outside any fork: nothing to do."""
        if not self._outer:
            yield
            return
        outer = self._outer[-1]
        inner = _get_state()
        _set_state(outer[0])
        try:
            yield
        finally:
            outer[0] = _get_state()
            _set_state(inner)

    def get_states(self) -> dict:
        """{name: (CPU state, CUDA state or None)}: a copy, for checkpoints and replays."""
        return {name: (gens["cpu"].get_state(), gens["cuda"].get_state() if "cuda" in gens else None)
                for name, gens in self._generators.items()}

    def set_states(self, states: dict) -> None:
        """Restore :meth:`get_states`' output (streams not named in ``states`` are dropped)."""
        seeds, self._seeds, self._generators = self._seeds, {}, {}
        for name, (cpu, cuda) in states.items():
            self._seeds[name] = seeds.get(name, 0)
            self.ranks.setdefault(name, (0, 1))
            self._generators[name] = {"cpu": torch.Generator()}
            self._generators[name]["cpu"].set_state(cpu)
            if cuda is not None:
                self.generator(name, "cuda").set_state(cuda)


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_state():
    return torch.get_rng_state(), torch.cuda.get_rng_state() if _cuda_in_use() else None


def _set_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def generator_disagreement(mesh) -> list[str]:
    """The mesh dimensions (tp, sp) over which torch's default generator is not in the same state on every rank:
    replicated dropout there would draw different masks and the replicas of every replicated parameter would train
    apart, silently (the Trainer refuses it). One small all-reduce per dimension of more than one rank; none without
    process groups."""
    if not dist.is_initialized() or not hasattr(mesh, "group"):
        return []
    digest = hashlib.sha256(b"".join(s.numpy().tobytes() for s in _get_state() if s is not None)).digest()
    value = int.from_bytes(digest[:7], "little")  # fits an int64, as its negation does
    apart = []
    for dim in ("tp", "sp"):
        if mesh.size(dim) > 1:
            both = torch.tensor([value, -value], dtype=torch.int64, device=mesh.device_type)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=mesh.group(dim))
            if both.tolist() != [value, -value]:  # the maximum and the minimum differ from this rank's
                apart.append(dim)
    return apart


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
        tracker.add("sequence-parallel", seed + SP_SEED_OFFSET + sp_rank, index=sp_rank, count=sp)
    tracker.add("tensor-parallel", seed + TP_SEED_OFFSET + tp_rank + tp * sp_rank, index=tp_rank + tp * sp_rank,
                count=tp * sp)
    return tracker


#: Module attribute naming the per-rank stream a module's sharded activations draw from (set by ``LocalRNG``).
LOCAL_STREAM_ATTR = "_shardlib_local_stream"


def local_dropout(x: torch.Tensor, p: float, index: int, count: int) -> torch.Tensor:
    """``F.dropout(x, p, training=True)`` whose mask differs across the ``count`` ranks of a stream: every rank draws
    ``count`` masks from torch's default generator (the same draw everywhere, so replicated streams stay in step)
    and keeps mask ``index``. What compiled code runs for a dropout on sharded activations, in place of eager
    mode's swap of the per-rank generator (which dynamo cannot trace). It draws ``count`` times the numbers one
    rank needs: as many as the unsharded model draws for the same activations. Same law as eager mode's masks,
    not the same masks."""
    if p >= 1:
        return x * 0
    keep = torch.rand((count, *x.shape), device=x.device)[index] >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))
