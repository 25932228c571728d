"""Rank tasks of tests/test_shm.py: the shared-memory transport against the process group's own collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness import mesh as pool_mesh
from shardlib.parallel import collectives as C
from shardlib.parallel import shm

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _through_process_group(group, fn):
    transport = shm.for_group(group)
    shm.detach(group)
    try:
        return fn()
    finally:
        shm._GROUPS[group.group_name] = transport


def collectives_match_the_process_group(spec: dict) -> int:
    """all_reduce (sum/max/min; avg = sum / n), all_gather and reduce_scatter along ``spec["dim"]`` of a rank-seeded tensor:
    over shared memory == over gloo (all-gather exactly; sums exactly at tp=2, where both add the same two numbers;
    within rounding at tp=4), every rank of an all-reduce holding the same bits; the async start_* forms too."""
    mesh = pool_mesh(tp=spec["tp"])
    group, n = mesh.tp_group, mesh.tp
    shape = list(spec["shape"])
    shape[spec["dim"]] *= n  # divisible, for the reduce-scatter
    g = torch.Generator().manual_seed(spec["seed"] * 100 + mesh.tp_rank)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(DTYPES[spec["dtype"]])
    # sums of n values of about 1 in another order: partial sums reach ~4, so a few units of the last place at 4
    # apart (bf16: 2^-6 there, rounded at each of 3 additions)
    last_place = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 6e-2}[spec["dtype"]]
    tol = dict(rtol=0, atol=0) if n == 2 else dict(rtol=last_place, atol=last_place)
    shm.attach(group, timeout_s=60, slot_bytes=spec["slot_bytes"])
    checked = 0
    try:
        for op in ("sum", "max", "min"):
            got = C.all_reduce(x, group, op)
            want = _through_process_group(group, lambda: C.all_reduce(x, group, op))
            torch.testing.assert_close(got, want, **(tol if op == "sum" else dict(rtol=0, atol=0)))
            every = [torch.empty_like(got) for _ in range(n)]
            dist.all_gather(every, got.contiguous(), group=group)
            assert all(torch.equal(e, every[0]) for e in every), f"all_reduce {op}: ranks disagree"
            checked += 1
        # gloo has no AVG: the shared-memory one is the sum divided by n
        assert torch.equal(C.all_reduce(x, group, "avg"), C.all_reduce(x, group).div_(n))
        checked += 1
        dim = spec["dim"]
        assert torch.equal(C.all_gather(x, dim, group), _through_process_group(group, lambda: C.all_gather(x, dim, group)))
        torch.testing.assert_close(C.reduce_scatter(x, dim, group),
                                   _through_process_group(group, lambda: C.reduce_scatter(x, dim, group)), **tol)
        y = x.contiguous().clone()
        torch.testing.assert_close(C.start_all_reduce(y, group).wait(),
                                   _through_process_group(group, lambda: C.all_reduce(x, group)), **tol)
        checked += 3
        used = shm.for_group(group).seq
        fits = x.numel() * x.element_size() <= spec["slot_bytes"]
        assert (used > 0) == fits, f"{used} shared-memory operations for a tensor that fits: {fits}"
    finally:
        shm.detach(group)
    return checked


def late_rank_is_named(spec: dict) -> str:
    """A rank that never joins a collective: the others' wait ends after the timeout naming it (no hang)."""
    mesh = pool_mesh(tp=2)
    group = mesh.tp_group
    transport = shm.attach(group, timeout_s=spec["timeout_s"])
    try:
        if mesh.tp_rank == 1:
            return "skipped"
        try:
            C.all_reduce(torch.ones(4), group)
        except shm.SharedMemoryError as exc:
            return str(exc)
        return "no error"
    finally:
        shm.detach(group)
        del transport
        dist.barrier(group=group)


def dead_peer_worker(rank: int, store_path: str, out_path: str) -> None:
    """Rank 1 exits right after the segment is mapped; rank 0's next collective must end at once, naming it."""
    import os
    import time

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    shm.attach(dist.group.WORLD, timeout_s=60)
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        C.all_reduce(torch.ones(4), dist.group.WORLD)
        message = "no error"
    except shm.SharedMemoryError as exc:
        message = str(exc)
    with open(out_path, "w") as f:
        f.write(f"{time.monotonic() - start:.1f}\n{message}")
    os._exit(0)  # the dead peer would make the group's teardown wait


def default_transport_decisions(spec: dict) -> dict:
    """``init_mesh``'s default transport on the pool's ranks (one host): the tp groups attach; a group whose ranks
    report different hosts, or whose /dev/shm has no room, keeps gloo on every rank under the default, and is
    refused naming why where ``transport="shm"`` was asked for."""
    import errno
    import os

    import shardlib

    rank, out = dist.get_rank(), {}

    def build(transport: str):
        mesh = shardlib.init_mesh(tp=2, transport=transport)
        try:
            return mesh.transport, shm.for_group(mesh.tp_group) is not None
        finally:
            shm.detach(mesh.tp_group)

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out["default"] = build("auto")
    for case, name, patched in (("other hosts", "_host_id", lambda: rank), ("no room", "posix_fallocate", no_room)):
        owner = shm if name == "_host_id" else os
        original = getattr(owner, name)
        setattr(owner, name, patched)
        try:
            out[f"{case}, default"] = build("auto")
            try:
                build("shm")
                out[f"{case}, shm"] = "no error"
            except shm.SharedMemoryError as exc:
                out[f"{case}, shm"] = str(exc)
        finally:
            setattr(owner, name, original)
    return out
