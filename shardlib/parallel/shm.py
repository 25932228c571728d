"""Collectives through shared memory for the ranks of one group on one host (``init_mesh(transport="shm")``).

Why not gloo: gloo moves a tensor between two processes of one machine over loopback TCP. Measured on the project's
2-core VM (two gloo ranks): a 3 MiB all-reduce takes 3.5-9 ms, an all-gather of 1.5 -> 3 MiB 3.4 ms,
where copying 3 MiB takes 0.14 ms and adding two of them 0.16 ms. Tensor and sequence parallelism send such a tensor
at every region boundary (BERT-base: 48 a step at tp=2, 120 with sequence parallelism), so on one host the
transport, not the arithmetic, bounds them. torch has no shared-memory backend for CPU tensors (DeepSpeed and vLLM
ship their own for CPU inference, in C++); this one is torch ops on a shared mapping.

The mapping: one file in /dev/shm per group, created by the group's first rank, mapped by every rank
(``torch.from_file(shared=True)``) and unlinked as soon as all have mapped it, so nothing is left behind, even by a
killed job. It holds one int64 flag per rank (64 bytes apart) and, per rank, two slots of ``slot_bytes`` (even and
odd operations alternate).

One operation (every rank calls the group's collectives in the same order, as with any backend), number s:
the rank copies its input into its slot of parity s % 2, stores s in its flag, and waits until every flag is >= s;
then it reads every rank's slot and computes its result (sums in rank order, so every rank of an all-reduce gets
the same bits). A slot of parity s % 2 is written again only at operation s + 2, which a rank reaches only after
every rank's flag said s + 1, i.e. after every rank finished reading operation s: one wait per operation, no second
barrier. A wait ends at once when a late rank's process is gone (as gloo's closed socket ends its wait). Stores
become visible in program order on x86-64 (total store order; the flag is stored after the data by
a later torch call), which is why the transport refuses other machines. Every wait is bounded by the mesh's timeout
and names the ranks that did not arrive.

Tensors larger than a slot, and anything traced by torch.compile, go through the process group as before.

The transport is the default for CPU ranks (``init_mesh``'s ``transport="auto"``): a group attaches where it can,
i.e. on Linux on x86-64 with every rank of the group on this host and /dev/shm holding the whole segment (reserved
at once with ``posix_fallocate``, so a full /dev/shm is a clear refusal now rather than a SIGBUS mid-step: a
container's default /dev/shm of 64 MiB holds no segment of 16 MiB slots); elsewhere it keeps its process group.
The decision is taken collectively, so every rank of a group reaches the same one.
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
import sys
import time
import uuid

import torch
import torch.distributed as dist

#: bytes of one rank's slot (x2 parities x ranks in the mapping; pages are only resident once written): a larger
#: tensor goes through the process group
DEFAULT_SLOT_BYTES = int(os.environ.get("SHARDLIB_SHM_SLOT_MIB", "16")) * 2**20
_FLAG_STRIDE = 8  # int64s between two ranks' flags: one cache line each
_NAME_BYTES = 96

#: group name -> SharedMemoryGroup of the groups attached in this process
_GROUPS: dict[str, "SharedMemoryGroup"] = {}


class SharedMemoryError(RuntimeError):
    """The shared-memory transport cannot serve this group (another host, another architecture) or a rank did not
    arrive in time."""


class SharedMemoryTimeout(SharedMemoryError):
    """A live rank of the group did not reach the collective within the mesh's timeout (a stalled rank)."""


class PeerGone(SharedMemoryError):
    """A rank of the group was waited for whose process is gone (as gloo's "connection closed by peer")."""


class Unsuitable(SharedMemoryError):
    """This group cannot use the transport (it spans hosts, /dev/shm has no room): raised on every rank of the group
    alike, so that the default transport can keep the process group instead."""


def for_group(group) -> "SharedMemoryGroup | None":
    """The transport attached to ``group`` in this process, or None (then the process group's own collectives)."""
    if not _GROUPS or group is None:
        return None
    return _GROUPS.get(group.group_name)


def attach(group, timeout_s: float, slot_bytes: int = DEFAULT_SLOT_BYTES, *,
           required: bool = True) -> "SharedMemoryGroup | None":
    """Map a shared segment for ``group`` (a collective call: every rank of the group at once) and route its
    collectives through it from now on. ``required=False`` (the default transport): None on every rank of the
    group where it spans hosts or /dev/shm has no room (:class:`Unsuitable`), and the group keeps its process
    group's collectives."""
    try:
        shm = SharedMemoryGroup(group, timeout_s, slot_bytes)
    except Unsuitable:
        if required:
            raise
        return None
    _GROUPS[group.group_name] = shm
    return shm


def detach(group) -> None:
    """Route ``group``'s collectives through its process group again (every rank of the group at once)."""
    _GROUPS.pop(group.group_name, None)


def check_platform() -> None:
    """Refuse a machine whose stores may become visible out of order (module docstring), or one without /dev/shm."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise SharedMemoryError(f"transport='shm' relies on x86-64's store order; this machine is "
                                f"{platform.machine()}: use transport='c10d'")
    if not sys.platform.startswith("linux") or not os.path.isdir("/dev/shm"):
        raise SharedMemoryError(f"transport='shm' maps files in /dev/shm, which this system ({sys.platform}) does "
                                f"not have: use transport='c10d'")


def supported() -> bool:
    """Whether this machine can run the transport at all (:func:`check_platform` passes)."""
    try:
        check_platform()
    except SharedMemoryError:
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host_id() -> int:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    digest = hashlib.sha256(f"{socket.gethostname()}/{boot}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


class SharedMemoryGroup:
    """The shared segment of one process group and its collectives (module docstring)."""

    def __init__(self, group, timeout_s: float, slot_bytes: int):
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if self.n < 2:
            raise ValueError(f"group {group.group_name} has one rank: nothing to exchange through shared memory")
        self.timeout_s, self.slot_bytes, self.seq = timeout_s, slot_bytes, 0
        self.pids = self._check_one_host(group)
        header = self.n * _FLAG_STRIDE * 8
        total = header + 2 * self.n * slot_bytes
        path = self._rendezvous(group, total)
        try:
            self.mem = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        finally:
            dist.barrier(group=group)  # every rank mapped it (or failed): the name can go
            if self.rank == 0:
                os.unlink(path)
        self.flags = self.mem[:header].view(torch.int64)[::_FLAG_STRIDE]
        self.slots = self.mem[header:].view(2, self.n, slot_bytes)

    def _check_one_host(self, group) -> list[int]:
        """Every rank's process id; refused unless the whole group runs on this host."""
        check_platform()
        every = torch.zeros(self.n, 2, dtype=torch.int64)  # row i: rank i's (host, pid), summed over the group
        every[self.rank] = torch.tensor([_host_id(), os.getpid()])
        dist.all_reduce(every, group=group)
        hosts, pids = every[:, 0].tolist(), every[:, 1].tolist()
        if len(set(hosts)) > 1:
            raise Unsuitable(f"transport='shm' needs every rank of a group on one host; group "
                             f"{group.group_name} spans {len(set(hosts))} hosts")
        return pids

    def _rendezvous(self, group, total: int) -> str:
        """The segment's path: created and its pages reserved by the group's first rank, its name broadcast to the
        others (an empty name: /dev/shm had no room, :class:`Unsuitable` on every rank)."""
        name, refusal = torch.zeros(_NAME_BYTES, dtype=torch.uint8), ""
        if self.rank == 0:
            path = f"/dev/shm/shardlib-{os.getpid()}-{uuid.uuid4().hex[:16]}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, total)  # the pages now, or ENOSPC now (not SIGBUS at a later write)
                name[:len(path)] = torch.tensor(list(path.encode()), dtype=torch.uint8)
            except OSError as exc:
                os.unlink(path)
                refusal = f" ({exc.strerror})"
            finally:
                os.close(fd)
        dist.broadcast(name, group=group, group_src=0)
        if not name.any():
            raise Unsuitable(f"transport='shm': /dev/shm has no room for group {group.group_name}'s segment of "
                             f"{total / 2**20:.0f} MiB{refusal}; enlarge it (e.g. docker --shm-size) or set "
                             f"SHARDLIB_SHM_SLOT_MIB lower")
        return bytes(name[name != 0].tolist()).decode()

    # ------------------------------------------------------------------------------------------------ exchange
    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() * t.element_size() <= self.slot_bytes

    def exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape and dtype on all), as views of their slots, valid until this rank's next
        operation on the group."""
        self.seq += 1
        s, nbytes = self.seq, x.numel() * x.element_size()
        mine = self.slots[s % 2, self.rank, :nbytes]
        mine.view(x.dtype).view(x.shape).copy_(x)
        self.flags[self.rank] = s
        self._wait_all(s)
        return [self.slots[s % 2, i, :nbytes].view(x.dtype).view(x.shape) for i in range(self.n)]

    def _wait_all(self, s: int) -> None:
        """Until every rank's flag says ``s``: spinning briefly, then yielding the core (ranks may share cores);
        a rank whose process is gone ends the wait at once (as gloo's closed socket would), a live one that does not
        arrive after the timeout."""
        flags, spins, deadline, next_check = self.flags, 0, None, 0.0
        while flags.min().item() < s:
            spins += 1
            if spins <= 100:
                continue
            time.sleep(0 if spins < 1000 else 5e-5)
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now < next_check:
                continue
            next_check = now + 0.2
            late = [i for i, f in enumerate(flags.tolist()) if f < s]
            dead = [i for i in late if not _alive(self.pids[i])]
            if dead:
                raise PeerGone(f"shared-memory collective {s}: the process of rank(s) {dead} of the group is gone")
            if now > deadline:
                raise SharedMemoryTimeout(f"shared-memory collective {s}: ranks {late} of the group did not arrive "
                                          f"within {self.timeout_s:.0f} s")

    # --------------------------------------------------------------------------------------------- collectives
    def all_reduce(self, out: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``out`` (contiguous) over the group into itself; the same bits on every rank."""
        views = self.exchange(out)
        if op in ("sum", "avg"):
            torch.add(views[0], views[1], out=out)
            for v in views[2:]:
                out.add_(v)
            if op == "avg":
                out.div_(self.n)
        else:
            pick = torch.maximum if op == "max" else torch.minimum
            out.copy_(views[0])
            for v in views[1:]:
                pick(out, v, out=out)
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (no rank-major staging copy)."""
        return torch.cat(self.exchange(x.contiguous()), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The sum over ranks of ``x``'s chunk ``rank`` along ``dim`` (summed in rank order), contiguous."""
        chunk = x.shape[dim] // self.n
        parts = [v.narrow(dim, self.rank * chunk, chunk) for v in self.exchange(x.contiguous())]
        out = parts[0] + parts[1]  # a new tensor: the slots are reused two operations later
        for p in parts[2:]:
            out.add_(p)
        return out
