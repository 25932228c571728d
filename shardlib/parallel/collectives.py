"""Differentiable tensor-parallel collectives (the Megatron mappings).

Each mapping is one autograd Function whose docstring states its forward and backward in one line. The process
group is always passed explicitly; with a group of one rank every mapping returns its input unchanged (no
communication, no autograd node). The wire operations are c10d's synchronous collectives in eager mode
(``dist.all_gather_into_tensor`` and friends, each waited on inside the call) and torch's functional collectives
(``torch.distributed._functional_collectives``) under ``torch.compile`` / ``torch.export``, which trace them; both
are counted by ``torch.distributed.tensor.debug.CommDebugMode``. Every wait is bounded by the process group's
timeout. On gloo a reduce-scatter is an all-to-all and a local sum (:func:`start_reduce_scatter`: gloo's own
costs a whole all-reduce). A group attached to the shared-memory transport (``init_mesh(transport="shm")``,
:mod:`.shm`) runs its eager all-reduces, all-gathers and reduce-scatters through it instead, each complete when
the call returns (no c10d op is issued, so ``CommDebugMode`` does not count them).

Why not the functional collectives in eager mode too: on gloo their eager path (an ``AsyncCollectiveTensor`` whose
work is registered and waited on later) crashed a rank about once in 1,000 test tasks, always inside its wait
(``wait_tensor``): "double free or corruption" (SIGABRT) or a segmentation fault, with one wait or two; c10d's own
calls never did.

Names follow the direction of the forward pass:

============================  ===================================  ===================================
mapping                       forward                              backward
============================  ===================================  ===================================
``copy_to_tp``                identity                             all-reduce
``reduce_from_tp``            all-reduce                           identity
``scatter_to_tp(dim)``        keep this rank's chunk along dim     all-gather along dim
``gather_from_tp(dim)``       all-gather along dim                 keep this rank's chunk along dim
``reduce_scatter_to_tp(dim)`` reduce-scatter along dim             all-gather along dim
``all_gather_from_tp(dim)``   all-gather along dim                 reduce-scatter along dim
``all_to_all(s, g)``          split along s, exchange, concat      ``all_to_all(g, s)``
                              along g
============================  ===================================  ===================================

``reduce_scatter_to_tp`` / ``all_gather_from_tp`` are the sequence-parallel pair (dim = the sequence dim);
``all_to_all`` turns sequence-sharded activations into head-sharded ones and back (Ulysses).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import shm

Group = dist.ProcessGroup


def group_size(group: Group | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group | None) -> int:
    return 0 if group is None else dist.get_rank(group)


# ----------------------------------------------------------------------------------------------- wire operations
def _traced() -> bool:
    """Whether torch.compile or torch.export is tracing: the functional collectives then (module docstring)."""
    return torch.compiler.is_compiling()


def _waited(out: torch.Tensor) -> torch.Tensor:
    """The result of a functional collective in a traced graph, followed by its ``wait_tensor`` node."""
    return funcol.wait_tensor(out)


#: torch 2.13 renamed the tensor forms (``all_gather_into_tensor`` -> ``all_gather_single``, ``reduce_scatter_tensor``
#: -> ``reduce_scatter_single``) and warns on the old names; older torch (the GPU machine's 2.11) has only those
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_C10D_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}


def all_reduce(x: torch.Tensor, group: Group, op: str = "sum", *, inplace: bool = False) -> torch.Tensor:
    """All-reduce (``op`` in sum / max / min / avg), waited on.

    ``inplace=True`` (for tensors the caller owns, e.g. a fresh matmul output or gradient) reduces ``x`` itself in
    eager mode, saving a copy (~10% of a 3 MiB all-reduce on gloo); traced, the functional collective returns a new
    tensor either way.
    """
    if _traced():
        return _waited(funcol.all_reduce(x.contiguous(), op, group))
    out = x if inplace and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    transport = shm.for_group(group)
    if transport is not None and transport.fits(out):
        return transport.all_reduce(out, op)
    dist.all_reduce(out, op=_C10D_OPS[op], group=group)
    return out


def start_all_reduce(x: torch.Tensor, group: Group) -> "Pending":
    """Start summing ``x`` (contiguous, owned by the caller) over ``group`` in place (eager mode); over a
    shared-memory transport it is done when this returns."""
    transport = shm.for_group(group)
    if transport is not None and transport.fits(x):
        return Pending.done(transport.all_reduce(x))
    return Pending(dist.all_reduce(x, group=group, async_op=True), lambda: x)


#: Largest flat buffer of :func:`all_reduce_flat` (torch DDP's default bucket): the gradients are summed in buckets
#: of at most this many bytes, so no second full copy of them is ever allocated.
FLAT_BUCKET_BYTES = 25 * 2**20


def all_reduce_flat(tensors: list[torch.Tensor], group: Group) -> None:
    """Sum each tensor over ``group`` in place, with one all-reduce per dtype and bucket of the tensors flattened
    together (buckets of at most :data:`FLAT_BUCKET_BYTES`)."""
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        for bucket in _buckets(same, FLAT_BUCKET_BYTES):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat, group=group)
            torch._foreach_copy_(bucket, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in bucket]),
                                                                         bucket)])


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut into runs of at most ``limit`` bytes (a larger tensor is a run of its own)."""
    runs, size = [[]], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if runs[-1] and size + nbytes > limit:
            runs.append([])
            size = 0
        runs[-1].append(t)
        size += nbytes
    return [r for r in runs if r]


def all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (same shape on every rank)."""
    if _traced():
        return from_rank_major(_waited(funcol.all_gather_single(x.contiguous(), 0, group)), dim, group_size(group))
    return start_all_gather(x, dim, group).wait()


def from_rank_major(out: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """The ranks' tensors stacked along dim 0 ([n * a, ...], as an all-gather writes them) concatenated along ``dim``
    instead."""
    dim = dim % out.dim()
    if dim == 0:
        return out
    # [n * a, ...] -> [a, ..., n * d, ...] by views and one copy (no chunk + cat: symbolic sizes stay symbolic).
    # Contiguous always: with a size-1 dim the flatten can be a strided view, and sequence parallelism re-creates
    # a saved gathered tensor in backward assuming the contiguous layout
    return out.unflatten(0, (n, -1)).movedim(0, dim).flatten(dim, dim + 1).contiguous()


def to_rank_major(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``x`` cut into n chunks along ``dim``, stacked along dim 0 (contiguous): chunk i is what rank i receives."""
    dim = dim % x.dim()
    if dim != 0:
        x = x.unflatten(dim, (n, -1)).movedim(dim, 0).flatten(0, 1)
    return x.contiguous()


class Pending:
    """A collective started with ``async_op=True`` (eager mode); :meth:`wait` waits for it (bounded by the process
    group's timeout) and returns its result. Started before independent work (a GEMM), it runs on the backend's
    own threads (gloo) or stream (NCCL) meanwhile: ``shardlib.parallel.overlap``."""

    def __init__(self, work, finish):
        self._work, self._finish, self._result = work, finish, None

    @classmethod
    def done(cls, result: torch.Tensor) -> "Pending":
        """A collective that completed in the call (the shared-memory transport)."""
        pending = cls(None, None)
        pending._result = result
        return pending

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._work.wait()
            self._result, self._finish = self._finish(), None
        return self._result


def start_all_gather(x: torch.Tensor, dim: int, group: Group) -> Pending:
    """Start :func:`all_gather` (eager mode)."""
    transport = shm.for_group(group)
    if transport is not None and transport.fits(x):
        return Pending.done(transport.all_gather(x, dim))
    x, n = x.contiguous(), group_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    work = ALL_GATHER_SINGLE(out, x, group=group, async_op=True)
    return Pending(work, lambda: from_rank_major(out, dim, n))


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum over ranks, then keep this rank's chunk along ``dim`` (``x.shape[dim]`` divisible by the group)."""
    if _traced():
        return _waited(funcol.reduce_scatter_single(to_rank_major(x, dim, group_size(group)), "sum", 0, group))
    return start_reduce_scatter(x, dim, group).wait()


def start_reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> Pending:
    """Start :func:`reduce_scatter` (eager mode).

    On gloo, an all-to-all and a local sum: each rank sends every other rank the chunk that rank keeps and adds the
    chunks it receives, moving (n - 1) / n of ``x`` per rank where gloo's reduce-scatter costs a whole all-reduce
    (measured on two gloo ranks: 3 MiB in 5.8-9.3 ms, against 2.8-3.8 ms this way). The
    sum of the n chunks runs in rank order on every rank; with two ranks it is the same addition either way."""
    transport = shm.for_group(group)
    if transport is not None and transport.fits(x):
        return Pending.done(transport.reduce_scatter(x, dim % x.dim()))
    n = group_size(group)
    x = to_rank_major(x, dim, n)
    if dist.get_backend(group) == "gloo":
        received = torch.empty_like(x)
        work = dist.all_to_all_single(received, x, group=group, async_op=True)
        return Pending(work, lambda: received.unflatten(0, (n, -1)).sum(0))
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    work = REDUCE_SCATTER_SINGLE(out, x, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Pending(work, lambda: out)


def all_to_all_single(xs: tuple[torch.Tensor, ...], scatter_dim: int, gather_dim: int,
                      group: Group) -> tuple[torch.Tensor, ...]:
    """For each of ``xs`` (one dtype; shapes may differ, as grouped K/V heads differ from q's): cut it into n chunks
    along ``scatter_dim``, send chunk i to rank i and concatenate the chunks received (in rank order) along
    ``gather_dim``: [.., S, .., G, ..] -> [.., S/n, .., n*G, ..]. One message for all of them; each result is its own
    tensor (no result keeps another's memory alive)."""
    n = group_size(group)
    for x in xs:
        if x.shape[scatter_dim] % n:
            raise ValueError(f"all-to-all: size {x.shape[scatter_dim]} of dim {scatter_dim} is not divisible by "
                             f"{n} ranks")
    chunks = [x.chunk(n, dim=scatter_dim) for x in xs]
    same = len({x.shape for x in xs}) == 1
    if same:
        send = torch.stack([torch.stack(c) for c in chunks], dim=1)  # [n, k, chunk]: row i -> rank i
    else:  # each rank's chunks flattened into its row
        send = torch.stack([torch.cat([c[i].reshape(-1) for c in chunks]) for i in range(n)])
    send = send.contiguous()
    if _traced():
        received = _waited(funcol.all_to_all_single(send, None, None, group))
    else:
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
    if same:
        return tuple(torch.cat(received[:, i].unbind(0), dim=gather_dim) for i in range(len(xs)))
    pieces = received.split([c[0].numel() for c in chunks], dim=1)
    return tuple(torch.cat([row.view(c[0].shape) for row in piece.unbind(0)], dim=gather_dim)
                 for piece, c in zip(pieces, chunks))


def split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split size {x.shape[dim]} of dim {dim} evenly over {n} ranks")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


# ---------------------------------------------------------------------------------------------- autograd mappings
class _CopyToTP(torch.autograd.Function):
    """forward: identity, backward: all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # not in place: the incoming gradient may be a tensor the caller still holds (out.backward(g))
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce, backward: identity."""

    @staticmethod
    def forward(ctx, x, group, inplace):
        out = all_reduce(x, group, inplace=inplace)
        if out is x:  # reduced in place (eager only: under torch.compile the functional collective returns a new one)
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _dim_mapping(name: str, forward_op, backward_op, doc: str) -> type[torch.autograd.Function]:
    """An autograd Function ``f(x, group, dim)`` running ``forward_op`` forward and ``backward_op`` backward."""

    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return forward_op(x, dim, group)

    def backward(ctx, grad):
        return backward_op(grad, ctx.dim, ctx.group), None, None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward), "__doc__": doc})


_ScatterToTP = _dim_mapping("_ScatterToTP", split, all_gather,
                            "forward: keep this rank's chunk along dim, backward: all-gather along dim.")
_GatherFromTP = _dim_mapping("_GatherFromTP", all_gather, split,
                             "forward: all-gather along dim, backward: keep this rank's chunk along dim.")
_ReduceScatterToTP = _dim_mapping("_ReduceScatterToTP", reduce_scatter, all_gather,
                                  "forward: reduce-scatter along dim, backward: all-gather along dim.")
_AllGatherFromTP = _dim_mapping("_AllGatherFromTP", all_gather, reduce_scatter,
                                "forward: all-gather along dim, backward: reduce-scatter along dim.")


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all (split scatter_dim, concat gather_dim), backward: all-to-all (split gather_dim, concat
    scatter_dim); several tensors in one message."""

    @staticmethod
    def forward(ctx, group, scatter_dim, gather_dim, *xs):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        out = all_to_all_single(xs, scatter_dim, gather_dim, group)
        ctx.shapes = [o.shape for o in out]
        return out

    @staticmethod
    def backward(ctx, *grads):
        scatter_dim, gather_dim = ctx.dims
        like = next(g for g in grads if g is not None)
        grads = tuple(like.new_zeros(shape) if g is None else g for g, shape in zip(grads, ctx.shapes))
        return None, None, None, *all_to_all_single(grads, gather_dim, scatter_dim, ctx.group)


def all_to_all(xs: tuple[torch.Tensor, ...], group: Group | None, scatter_dim: int,
               gather_dim: int) -> tuple[torch.Tensor, ...]:
    """forward: split each of ``xs`` ``scatter_dim`` n ways and exchange, concatenating along ``gather_dim`` (one
    message for all); backward: the inverse exchange."""
    return tuple(xs) if group_size(group) == 1 else _AllToAll.apply(group, scatter_dim, gather_dim, *xs)


def copy_to_tp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input. forward: identity, backward: all-reduce."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group | None, *, inplace: bool = False) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results. forward: all-reduce, backward: identity.

    ``inplace=True`` reduces ``x`` itself (pass only a tensor nobody else reads, like a fresh matmul output)."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group, inplace)


def scatter_to_tp(x: torch.Tensor, group: Group | None, dim: int = -1) -> torch.Tensor:
    """forward: keep this rank's chunk along ``dim``, backward: all-gather along ``dim``."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group, dim)


def gather_from_tp(x: torch.Tensor, group: Group | None, dim: int = -1) -> torch.Tensor:
    """forward: all-gather along ``dim``, backward: keep this rank's chunk along ``dim``."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group, dim)


def reduce_scatter_to_tp(x: torch.Tensor, group: Group | None, dim: int = 1) -> torch.Tensor:
    """Sequence parallel exit. forward: reduce-scatter along ``dim``, backward: all-gather along ``dim``."""
    return x if group_size(group) == 1 else _ReduceScatterToTP.apply(x, group, dim)


def all_gather_from_tp(x: torch.Tensor, group: Group | None, dim: int = 1) -> torch.Tensor:
    """Sequence parallel entry. forward: all-gather along ``dim``, backward: reduce-scatter along ``dim``."""
    return x if group_size(group) == 1 else _AllGatherFromTP.apply(x, group, dim)
