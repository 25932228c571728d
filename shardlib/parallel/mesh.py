"""The dp x pp x tp device mesh.

`init_mesh` is the one entry point: it initializes torch.distributed from the launcher's environment (torchrun's
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) when that has not been done yet, picks NCCL when CUDA is available
and gloo otherwise, and returns a validated :class:`Mesh` over a torch ``DeviceMesh`` with dimensions named
``("dp", "pp", "sp", "tp")``. ``sp`` is the all-to-all (Ulysses) sequence-parallel dimension: its ranks hold
different parts of the same sequences (``shard(..., sequence_parallel="all_to_all")``); it is 1 unless asked for. There is no module-level process-group state: the mesh is passed explicitly to
everything that communicates.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import shm

DIM_NAMES = ("dp", "pp", "sp", "tp")

#: Default bound on every collective wait (seconds). A hung or dead rank turns into an error after this long.
DEFAULT_TIMEOUT_S = float(os.environ.get("SHARDLIB_TIMEOUT", "120"))


class MeshError(ValueError):
    """A mesh that does not fit the world: the message shows the arithmetic."""


def _resolve_sizes(world_size: int, dp: int | None, pp: int, tp: int, sp: int = 1) -> tuple[int, int, int, int]:
    for name, value in (("pp", pp), ("sp", sp), ("tp", tp)):
        if not isinstance(value, int) or value < 1:
            raise MeshError(f"{name} must be a positive integer, got {value!r}")
    named = f"pp({pp}) * sp({sp}) * tp({tp})" if sp > 1 else f"pp({pp}) * tp({tp})"
    if dp is None:
        if world_size % (pp * sp * tp):
            raise MeshError(
                f"{named} = {pp * sp * tp} does not divide WORLD_SIZE {world_size}, so dp cannot be inferred"
            )
        dp = world_size // (pp * sp * tp)
    elif not isinstance(dp, int) or dp < 1:
        raise MeshError(f"dp must be a positive integer, got {dp!r}")
    if dp * pp * sp * tp != world_size:
        raise MeshError(f"dp({dp}) * {named} = {dp * pp * sp * tp} != WORLD_SIZE {world_size}")
    return dp, pp, sp, tp


def _hint(world_size: int) -> str:
    return (" (this process is a world of one: start the ranks with `shardlib run --nproc N`, torchrun, or "
            "--nproc N with shardlib.train.parse_args)") if world_size == 1 else ""


@dataclass(frozen=True)
class Mesh:
    """A validated dp x pp x sp x tp mesh. ``device_mesh`` is torch's DeviceMesh with dims ("dp", "pp", "sp", "tp")."""

    device_mesh: DeviceMesh
    dp: int
    pp: int
    tp: int
    sp: int = 1
    #: expert parallelism: each mixture-of-experts layer's experts split over ``ep`` data-parallel ranks (consecutive
    #: ones; ep divides dp), which exchange their tokens (:mod:`shardlib.parallel.expert_parallel`)
    ep: int = 1
    #: the bound on every collective wait, seconds (``init_mesh(timeout_s=...)``; :mod:`shardlib.parallel.timeouts`)
    timeout_s: float = field(default=DEFAULT_TIMEOUT_S, compare=False)
    #: how the tp and sp groups move tensors: "c10d" (the process group's backend) or "shm" (shared memory, ranks
    #: on one host: :mod:`shardlib.parallel.shm`; with ``init_mesh(transport="auto")``, "shm" if any group attached)
    transport: str = field(default="c10d", compare=False)
    _groups: dict = field(default_factory=dict, repr=False, compare=False)

    def group(self, dim: str) -> dist.ProcessGroup:
        if dim in ("ep", "edp"):
            return self.split_dp_for_experts()[dim == "edp"]
        if dim not in self._groups:
            self._groups[dim] = self.device_mesh.get_group(dim)
        return self._groups[dim]

    def split_sp(self, ulysses: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """The sp dimension as rings of ``sp // ulysses`` positions, each position ``ulysses`` ranks holding
        consecutive chunks of the sequence (Ulysses x ring attention): (this rank's Ulysses group, its ring group).
        Collective the first time (every rank of the world creates the groups), cached after. Built with
        DeviceMesh's ``_unflatten`` (private in torch 2.13, the only way to split a dimension of an existing mesh
        into named dimensions whose groups carry the mesh's bookkeeping)."""
        key = f"sp/{ulysses}"
        if key not in self._groups:
            if ulysses < 1 or self.sp % ulysses:
                raise MeshError(f"ulysses={ulysses} does not divide sp={self.sp}")
            split = self.device_mesh._unflatten("sp", (self.sp // ulysses, ulysses), ("sp_ring", "sp_ulysses"))
            groups = split.get_group("sp_ulysses"), split.get_group("sp_ring")
            if dist.get_backend() != FAKE_BACKEND:
                for group in groups:
                    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=self.timeout_s), group)
            self._groups[key] = groups
        return self._groups[key]

    def split_dp_for_experts(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """The dp dimension as ``dp / ep`` groups of ``ep`` consecutive ranks: (this rank's expert-parallel group,
        which splits the experts, its expert-data-parallel group: the ranks holding the same experts, over which
        their gradients are summed). Collective the first time, cached after (``_unflatten`` as in
        :meth:`split_sp`)."""
        if "ep" not in self._groups:
            split = self.device_mesh._unflatten("dp", (self.dp // self.ep, self.ep), ("edp", "ep"))
            groups = split.get_group("ep"), split.get_group("edp")
            if dist.get_backend() != FAKE_BACKEND:
                for group in groups:
                    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=self.timeout_s), group)
            self._groups["ep"], self._groups["edp"] = groups
            self._groups["experts mesh"] = split
        return self._groups["ep"], self._groups["edp"]

    def edp_device_mesh(self):
        """The 1-D device mesh of this rank's expert-data-parallel ranks (those holding the same experts), over which
        ZeRO-3 shards the experts (:meth:`split_dp_for_experts`)."""
        self.split_dp_for_experts()
        return self._groups["experts mesh"]["edp"]

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.split_dp_for_experts()[0]

    @property
    def ep_rank(self) -> int:
        return self.local_rank("dp") % self.ep

    def size(self, dim: str) -> int:
        return {"dp": self.dp, "pp": self.pp, "sp": self.sp, "tp": self.tp, "ep": self.ep,
                "edp": self.dp // self.ep}[dim]

    def local_rank(self, dim: str) -> int:
        return self.device_mesh.get_local_rank(dim)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def tp_rank(self) -> int:
        return self.local_rank("tp")

    @property
    def sp_rank(self) -> int:
        return self.local_rank("sp")

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    def __str__(self) -> str:
        text = self._describe()
        return text if self.ep == 1 else text.replace("Mesh(dp=", f"Mesh(ep={self.ep} of dp=", 1)

    def _describe(self) -> str:
        coord = tuple(self.device_mesh.get_coordinate() or ())
        if self.sp == 1:
            at = coord[:2] + coord[3:]
            return f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}; this rank at (dp, pp, tp) = {at})"
        return (f"Mesh(dp={self.dp}, pp={self.pp}, sp={self.sp}, tp={self.tp}; "
                f"this rank at (dp, pp, sp, tp) = {coord})")


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """Whether a launcher (``shardlib run``, torchrun, a rank pool) started this process: any of its variables."""
    return dist.is_initialized() or any(v in os.environ for v in LAUNCHER_ENV)


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialize the default process group from torchrun's environment unless it already is initialized. A
    process that no launcher started (none of its variables set) becomes a world of one on an in-process store,
    so ``python train.py`` runs on a CPU or one GPU with the same code."""
    if dist.is_initialized():
        return
    missing = [v for v in LAUNCHER_ENV if v not in os.environ]
    if missing and len(missing) < len(LAUNCHER_ENV):
        raise MeshError(
            "torch.distributed is not initialized and the launcher environment is incomplete "
            f"(missing {', '.join(missing)}); start the script with `shardlib run --nproc N script.py` or torchrun"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # pragma: no cover - no GPU in CI
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    if missing:  # a world of one: nothing to rendezvous with
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)


def init_mesh(
    dp: int | None = None,
    pp: int = 1,
    tp: int = 1,
    *,
    sp: int = 1,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    transport: str | None = None,
    ep: int = 1,
) -> Mesh:
    """Return a validated dp x pp x sp x tp :class:`Mesh` over all ranks (``dp=None`` infers dp from WORLD_SIZE).
    ``ep``: expert parallelism over that many consecutive data-parallel ranks (it must divide dp).

    Rank order is dp-major, tp-minor: tensor-parallel peers are adjacent ranks (on one node when possible), then
    the all-to-all sequence-parallel peers (``sp``, which also move activations every layer).

    ``transport``: how the tp and sp groups move tensors. "shm": through shared memory instead of gloo's loopback
    sockets (CPU ranks on one host, :mod:`shardlib.parallel.shm`; refused where it cannot run); "c10d": the process
    group's backend; "auto" (the default): "shm" for each CPU group that can use it, else "c10d". None reads the
    ``SHARDLIB_TRANSPORT`` environment variable (so a launched job chooses without code changes), else "auto".
    """
    transport = transport or os.environ.get("SHARDLIB_TRANSPORT") or "auto"
    if transport not in TRANSPORTS:
        raise MeshError(f"transport={transport!r}: expected one of {', '.join(TRANSPORTS)}")
    if transport == "shm":
        shm.check_platform()  # before anything is set up
    created = not dist.is_initialized()
    init_distributed(backend, timeout_s)
    world = dist.get_world_size()
    try:
        dp, pp, sp, tp = _resolve_sizes(world, dp, pp, tp, sp)
        if not isinstance(ep, int) or ep < 1 or dp % ep:
            raise MeshError(f"ep={ep!r} must be a positive integer dividing dp={dp} (expert-parallel ranks are drawn "
                            f"from the data-parallel ones); ep=1 or a divisor of {dp}")
    except MeshError as exc:
        if created:  # leave the process as it was: no half-set-up world behind a refused mesh
            dist.destroy_process_group()
        raise MeshError(f"{exc}{_hint(world)}") from None
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if transport == "shm" and device_type != "cpu":
        if created:
            dist.destroy_process_group()
        raise MeshError(f"transport='shm' moves CPU tensors between ranks of one host; this mesh runs on "
                        f"{dist.get_backend()} ({device_type}): leave transport at 'c10d'")
    device_mesh = init_device_mesh(device_type, (dp, pp, sp, tp), mesh_dim_names=DIM_NAMES)
    sizes = dict(zip(DIM_NAMES, (dp, pp, sp, tp)))
    real = dist.get_backend() != FAKE_BACKEND
    # DeviceMesh creates its dimension groups with torch's default timeout (30 min for gloo), not the world's:
    # bound every wait on them too, so a dead peer ends a pipeline recv or a TP all-reduce with an error
    for dim in DIM_NAMES:
        if sizes[dim] > 1 and real:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), device_mesh.get_group(dim))
    required = transport != "auto"  # the default: shm where it can run, quietly gloo elsewhere
    if not required:
        transport = "shm" if device_type == "cpu" and real and shm.supported() else "c10d"
    if transport == "shm" and real:
        groups = [device_mesh.get_group(dim) for dim in ("sp", "tp") if sizes[dim] > 1]
        transport = _attach_shared_memory(groups, timeout_s, required, created)
    return Mesh(device_mesh=device_mesh, dp=dp, pp=pp, tp=tp, sp=sp, ep=ep, timeout_s=timeout_s, transport=transport)


def _attach_shared_memory(groups: list, timeout_s: float, required: bool, created: bool) -> str:
    """Attach the shared-memory transport to ``groups``; the mesh's transport: "shm" if any group attached, else
    "c10d" (``required=False``: a group that cannot use it keeps its process group). On an error nothing stays
    attached, and no world this call created stays up."""
    attached = []
    try:
        for group in groups:
            if shm.attach(group, timeout_s, required=required) is not None:
                attached.append(group)
    except Exception:  # a group spanning hosts (required), a peer that did not arrive
        for group in attached:
            shm.detach(group)
        if created:
            dist.destroy_process_group()
        raise
    return "shm" if attached or (required and not groups) else "c10d"


#: values of ``init_mesh(transport=...)``
TRANSPORTS = ("auto", "c10d", "shm")


FAKE_BACKEND = "fake"


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """Within the block, this process is rank ``rank`` of a world of ``world_size`` ranks that exist only on paper:
    torch's fake process group (the one torch's own tests use), on which every collective returns at once without
    moving data. :func:`init_mesh` then builds any mesh of that size, so a model (usually on the meta device) can
    be sharded, traced, exported or planned exactly as a real rank would, with no ranks started. The default
    process group is destroyed on exit; refused when one already exists (it would be replaced)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise MeshError("fake_world: torch.distributed is already initialized in this process (a real run); plan or "
                        "export from a separate process, e.g. the `shardlib plan` command")
    if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
        raise MeshError(f"fake_world needs world_size >= 1 and 0 <= rank < world_size, got {world_size}, {rank}")
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class OfflineMesh:
    """The tensor-parallel coordinates of one rank without any process group: shard a model (usually on the meta
    device) to learn its layouts, plan, inspect or convert checkpoints. Modules sharded this way refuse to run."""

    tp: int = 1
    tp_rank: int = 0
    dp: int = 1
    pp: int = 1
    sp: int = 1

    def __post_init__(self):
        if self.tp < 1 or not 0 <= self.tp_rank < self.tp:
            raise MeshError(f"offline mesh needs tp >= 1 and 0 <= tp_rank < tp, got tp={self.tp}, rank={self.tp_rank}")

    tp_group = None

    def __str__(self) -> str:
        return f"OfflineMesh(tp={self.tp}; tp rank {self.tp_rank}; no process group)"
