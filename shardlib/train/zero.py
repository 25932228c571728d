"""ZeRO-1/2 over flat, bucketed buffers: every data-parallel rank owns an exact 1/dp of every bucket's elements.

The parameters an optimizer steps are laid, in reverse registration order (about the order backward produces their
gradients), into flat buffers of at most ``bucket_bytes`` each (per dtype; a larger parameter is a bucket of its
own: :func:`shardlib.parallel.flat.flat_buckets`), padded to a multiple of dp; each
parameter becomes a view into its bucket (no second copy of the weights). dp rank ``r`` owns elements
``[r * n / dp, (r + 1) * n / dp)`` of every bucket of ``n`` elements, so the largest rank holds at most ``dp - 1``
padding elements per bucket more than ``full / dp``. The user's optimizer is rebuilt over this rank's *pieces*:
for each parameter, the 1-D slice of it that lies in the rank's range (a view into the bucket, or its fp32 master
copy), in the parameter's own group (weight decay, learning rate per group are kept). That is exact for optimizers
whose state and update are per element (SGD, Adam(W), ...); others are refused (:func:`check_elementwise`).

Gradients (Megatron's distributed optimizer, DeepSpeed ZeRO-2, ColossalAI's LowLevelZero do the same):

* **zero=2**: each parameter's post-accumulate-grad hook marks it arrived; when the last parameter of a bucket has
  arrived the bucket's gradients are copied into one flat buffer, the parameters' ``.grad`` freed, and a
  reduce-scatter over dp is started without waiting: it runs while backward goes on (on gloo an all-reduce of the
  flat buffer in place, of which the rank keeps its range: gloo's reduce-scatter would copy the whole bucket).
  Buckets are launched in bucket order on every rank (one that completes early waits for the earlier ones; the end
  of backward launches the rest), so all dp ranks issue the same collectives in the same order, as DDP's reducer
  does. Before the next bucket starts the previous one is waited for and its shard added into the rank's gradient
  shard (``numel / dp`` per bucket, persistent over the step's microbatches). So at most two buckets of full-size
  gradients exist at any time (the one filling, the one in flight) besides the shards. Every microbatch's backward
  reduces into the shards: the alternative (keep full gradients over the microbatches, reduce once) is ZeRO-1's
  memory.
* **zero=1**: gradients accumulate in full over the microbatches; the step's last backward reduce-scatters them
  bucket by bucket as above (under a pipeline, once after the schedule).
* Parameters whose gradient is completed after backward (:mod:`shardlib.parallel.gradsync`'s sequence-parallel
  buckets; weights tied across pipeline stages, summed over their stages first) are in buckets of their own,
  reduce-scattered by :meth:`FlatZero.finish_grads` after backward.
* A parameter that no dp rank used in the step keeps no gradient (its pieces' ``.grad`` is None: AdamW leaves it
  alone, as without dp): one all-reduce of one flag per parameter.

After the step each bucket's updated shard is all-gathered back into the bucket (one collective per bucket, all
started at once, the buckets of the first layers first), so every rank's parameters are whole again. By default the
step waits for them. With ``overlap_param_gather`` (Megatron's option of that name) it returns with them in flight
and each bucket is waited for by its first reader (:func:`install_gather_waits`): the forward pre-hook of every
module holding one of its parameters, any ``state_dict()`` of such a module, shardlib's checkpoint save and load
(:func:`shardlib.sharding.sharded.settle_parameters`), and the optimizer's own next step or state access. Code that
reads a parameter's values some other way between steps calls :meth:`FlatZero.wait_params` first.

Checkpoints are written in zero=0's format (each parameter's state whole, tp-local): :meth:`FlatZero.param_state`
all-gathers a bucket's state once (a collective: every dp rank walks the same tensors), dp rank 0 writes; a load
reads the whole tensor and keeps this rank's piece. So a checkpoint saved at any zero stage and dp loads at any
other.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ..parallel.collectives import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE
from ..parallel.flat import DEFAULT_BUCKET_BYTES, Bucket, flat_buckets
from ..parallel.optim_state import ParamStateOptimizer
from ..sharding.sharded import shard_state
from .zero_state import MASTER_KEY, StateByParameter

#: optimizers whose state and update are per element: exact on 1-D pieces of the parameters
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.Rprop,
               torch.optim.ASGD)


def check_elementwise(optimizer_class: type, zero: int) -> None:
    """Refuse an optimizer whose state or update is not per element (factored moments, line searches, matrix
    orthogonalization): partitioning its tensors by elements would change what it computes."""
    if not issubclass(optimizer_class, ELEMENTWISE):
        known = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(f"zero={zero} partitions every parameter by elements over the data-parallel ranks, which is "
                         f"exact only for optimizers whose state and update are per element ({known}); "
                         f"{optimizer_class.__name__} is not one of them (Adafactor's factored moments, LBFGS's line "
                         "search and Muon's orthogonalization need whole tensors). Use zero=0 or zero=3")


@dataclass(eq=False)
class Piece:
    """The elements ``[start, stop)`` of ``param`` (flattened) that this rank steps, as ``tensor`` (a view into the
    bucket, or an fp32 master copy); ``at`` is where they start in the rank's gradient shard."""

    param: nn.Parameter
    bucket: Bucket
    start: int
    stop: int
    at: int
    tensor: torch.Tensor


class InnerOptimizer(ParamStateOptimizer, Optimizer):
    """An optimizer whose parameter groups and state live in ``self.inner`` (over other tensors than the model's),
    whose state is read and written per model parameter (:class:`~shardlib.parallel.optim_state.ParamStateOptimizer`:
    the sharded checkpoint's view), not by ``state_dict``.
    ``Optimizer.__init__`` is not called on purpose."""

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def load_state_dict(self, state_dict):
        raise NotImplementedError("load through shardlib.checkpoint.load(model, dir, optimizer=...)")

    def state_dict(self):
        raise NotImplementedError("save through shardlib.checkpoint.save(model, dir, optimizer=...)")


class FlatZero(StateByParameter, InnerOptimizer):
    """ZeRO-1 (``stage=1``) or ZeRO-2 (``stage=2``) of ``optimizer_class`` over ``groups`` (the user's parameter
    groups) on the dp ``group`` (module docstring). ``late``: ids of parameters reduced after backward;
    ``order``: the model's parameters in registration order (buckets follow its reverse). ``experts``: ids of the
    expert weights that expert parallelism splits over ep, partitioned over ``expert_group`` (the ranks holding the
    same experts) in buckets of their own."""

    def __init__(self, groups: list[dict], optimizer_class: type, defaults: dict, *, stage: int, group,
                 master_weights: bool = False, late: set[int] = frozenset(), order: list | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap_param_gather: bool = False,
                 experts: set[int] = frozenset(), expert_group=None):
        # Optimizer.__init__ is not called on purpose: the parameter groups and the state live in the inner
        # optimizer over this rank's pieces (as in MasterWeightsOptimizer)
        check_elementwise(optimizer_class, stage)
        self.stage, self.group, self.master_weights = stage, group, master_weights
        self.overlap_param_gather = overlap_param_gather
        self._gathering: dict[int, object] = {}  # bucket index -> its parameter all-gather in flight
        self.dp, self.dp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.expert_group = expert_group if experts else None
        #: (group, size, this rank's index) of the expert buckets: the ranks holding the same experts, or dp
        self._experts_over = (self.group, self.dp, self.dp_rank) if self.expert_group is None else \
            (expert_group, dist.get_world_size(expert_group), dist.get_rank(expert_group))
        edp = self._experts_over[1] if self.expert_group is not None else None
        self.buckets = flat_buckets([p for g in groups for p in g["params"]], self.dp, bucket_bytes, late, order,
                                    experts, edp)
        self._bucket_of: dict[int, tuple[Bucket, int]] = {}
        self.pieces: list[Piece] = []
        self._piece_of: dict[int, Piece] = {}
        for bucket in self.buckets:
            self._flatten(bucket)
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        inner_groups = [{**g, "params": []} for g in groups]
        for piece in self.pieces:
            inner_groups[group_of[id(piece.param)]]["params"].append(piece.tensor)
        self.inner = optimizer_class(inner_groups, **defaults)
        self.defaults = self.inner.defaults
        self._expected = [sum(p.requires_grad for p in b.params) for b in self.buckets]  # gradients per backward
        #: buckets the hooks reduce, in the order every dp rank launches them
        self._eager = [b.index for b in self.buckets if not b.late and self._expected[b.index]]
        self._next = 0  # the first of _eager not launched in this backward
        self._ready: set[int] = set()  # complete in this backward, waiting for an earlier bucket
        self._reduced: set[int] = set()  # reduce-scattered since the step began
        self.armed = stage == 2  # the hooks reduce-scatter (zero=2: every backward; zero=1: the step's last)
        self._inflight = None
        self._gloo = dist.get_backend(group) == "gloo"
        self._waiting: set[int] = set()  # graph tasks whose end-of-backward callback is queued
        self._used: set[int] = set()  # ids of parameters that got a gradient in this step
        self._gathered: dict[int, tuple] = {}  # bucket index -> _gather_state(bucket), the last two (checkpoints)
        me = weakref.ref(self)
        for bucket in self.buckets:
            if not bucket.late:
                for i, p in enumerate(bucket.params):
                    p.register_post_accumulate_grad_hook(functools.partial(_arrived, me, bucket.index, i))

    # -- layout -------------------------------------------------------------------------------------------------
    def group_of(self, bucket: Bucket) -> tuple:
        """(process group, its size, this rank's index in it) that ``bucket`` is partitioned over: dp, or for
        expert weights the ranks holding the same experts."""
        return self._experts_over if bucket.experts else (self.group, self.dp, self.dp_rank)

    def _flatten(self, bucket: Bucket) -> None:
        """Make the bucket's parameters views into one flat buffer and cut this rank's pieces out of it."""
        first = bucket.params[0]
        bucket.data = torch.zeros(bucket.numel, dtype=first.dtype, device=first.device)
        group, size, rank = self.group_of(bucket)
        bucket.lo, bucket.hi = bucket.owned(rank, size)
        with torch.no_grad():
            for i, p in enumerate(bucket.params):
                a, b = bucket.span(i)
                view = bucket.data[a:b]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
                self._bucket_of[id(p)] = (bucket, i)
                lo, hi = max(a, bucket.lo), min(b, bucket.hi)
                if lo < hi:
                    tensor = bucket.data[lo:hi]
                    tensor = tensor.to(torch.float32, copy=True) if self.master_weights else tensor
                    piece = Piece(p, bucket, lo - a, hi - a, lo - bucket.lo, tensor)
                    self.pieces.append(piece)
                    self._piece_of[id(p)] = piece

    def pairs(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(model parameter, the piece of it this rank steps): what clipping and the loss scaler act on."""
        return [(piece.param, piece.tensor) for piece in self.pieces]

    def owns(self, param) -> bool:
        """Whether this rank steps some elements of ``param`` (and so holds their state)."""
        return id(param) in self._piece_of

    def held_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: its pieces' moments (and fp32 master pieces)."""
        tensors = [v for state in self.inner.state.values() for v in state.values() if torch.is_tensor(v)]
        if self.master_weights:
            tensors += [piece.tensor for piece in self.pieces]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- gradients ------------------------------------------------------------------------------------------------
    def arm(self, last_backward: bool) -> None:
        """Before a backward of the Trainer: zero=1 reduce-scatters in the step's last backward only (its gradients
        accumulate whole over the microbatches before), zero=2 in every backward."""
        self.armed = self.stage == 2 or last_backward

    def arrived(self, bucket_index: int, i: int) -> None:
        """Parameter ``i`` of bucket ``bucket_index`` has its gradient of this backward (its post-accumulate hook)."""
        if not self.armed:
            return
        bucket = self.buckets[bucket_index]
        task = torch._C._current_graph_task_id()
        if task not in self._waiting:
            self._waiting.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._backward_done, task))
        bucket.arrived.add(i)
        if len(bucket.arrived) == self._expected[bucket_index]:
            self._ready.add(bucket_index)
            while self._next < len(self._eager) and self._eager[self._next] in self._ready:
                self._reduce_scatter(self.buckets[self._eager[self._next]])
                self._next += 1

    def _backward_done(self, task: int) -> None:
        """End of a backward: the buckets not launched yet (some of their parameters got no gradient in it, or an
        earlier bucket did not complete) are reduced as they are, in order: every dp rank issues the same
        reduce-scatters in the same order whatever its graph did (as DDP's reducer launches its buckets)."""
        self._waiting.discard(task)
        for index in self._eager[self._next:]:
            self._reduce_scatter(self.buckets[index])
        self._next = 0
        self._ready.clear()
        self._settle()

    def _reduce_scatter(self, bucket: Bucket) -> None:
        """Start summing the bucket's full gradients into the dp ranks' shards; free them."""
        self._settle()  # at most one bucket in flight: the peak is the shards + two buckets
        like = {"dtype": bucket.data.dtype, "device": bucket.data.device}
        parts = []
        for p in bucket.params:
            if p.grad is None:
                parts.append(torch.zeros(p.numel(), **like))
            else:
                parts.append(p.grad.reshape(-1))
                self._used.add(id(p))
        parts.append(torch.zeros(bucket.numel - bucket.offsets[-1] - bucket.params[-1].numel(), **like))
        flat = torch.cat(parts)  # one allocation, one copy
        del parts
        for p in bucket.params:
            p.grad = None
        bucket.arrived.clear()
        self._reduced.add(bucket.index)
        if self._gloo:
            # gloo's reduce-scatter copies its whole input into a scratch buffer (a third bucket beside the flat copy
            # and the filling one) and runs slower than its all-reduce (a 24 MiB bucket on 2 ranks: +36 MiB and 65 ms
            # against +12 MiB and 42 ms, measured on two gloo ranks): the flat copy is all-reduced
            # in place and this rank's range kept when it is settled
            work = dist.all_reduce(flat, group=self.group_of(bucket)[0], async_op=True)
            self._inflight = (bucket, flat, None, work)
            return
        out = torch.empty(bucket.hi - bucket.lo, dtype=flat.dtype, device=flat.device)
        work = REDUCE_SCATTER_SINGLE(out, flat, group=self.group_of(bucket)[0], async_op=True)
        self._inflight = (bucket, flat, out, work)

    def _settle(self) -> None:
        """Wait for the bucket in flight and add its shard into the rank's gradient shard."""
        if self._inflight is None:
            return
        bucket, flat, out, work = self._inflight
        self._inflight = None
        work.wait()  # bounded by the process group's timeout
        if out is None:  # all-reduced whole (gloo): this rank's range of it
            out = flat[bucket.lo:bucket.hi]
            if bucket.grad_shard is None:
                out = out.clone()
        if bucket.grad_shard is None:
            bucket.grad_shard = out
        else:
            bucket.grad_shard.add_(out)

    def finish_grads(self) -> None:
        """After the step's backwards (and the tied-weight sum over pipeline stages): reduce-scatter the late buckets
        and those no hook reduced in this step (zero=1 under a pipeline), agree over dp on which parameters were
        used, and give each piece its gradient."""
        for bucket in self.buckets:
            if self._expected[bucket.index] and (bucket.late or bucket.index not in self._reduced):
                self._reduce_scatter(bucket)
        self._settle()
        self._reduced.clear()
        used_ids = set()
        for experts in (False, True):  # agreed over the ranks each kind of bucket is partitioned over
            buckets = [b for b in self.buckets if b.experts == experts]
            params = [p for b in buckets for p in b.params]
            if params:
                used = torch.tensor([id(p) in self._used for p in params], dtype=torch.uint8, device=params[0].device)
                dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group_of(buckets[0])[0])
                used_ids |= {id(p) for p, u in zip(params, used.tolist()) if u}
        for piece in self.pieces:
            shard = piece.bucket.grad_shard
            if id(piece.param) not in used_ids or shard is None:
                piece.tensor.grad = None
                continue
            grad = shard[piece.at:piece.at + piece.stop - piece.start]
            piece.tensor.grad = grad.to(torch.float32) if self.master_weights else grad
        self._used.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._settle()
        self._reduced.clear()
        for bucket in self.buckets:
            bucket.grad_shard = None
            bucket.arrived.clear()
            for p in bucket.params:
                p.grad = None
        for piece in self.pieces:
            piece.tensor.grad = None
        self._used.clear()

    # -- step -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        self.wait_params()  # the pieces are views into the buckets the last gathers write
        self._gathered.clear()
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        if self.master_weights:
            for piece in self.pieces:
                a = piece.bucket.lo + piece.at
                piece.bucket.data[a:a + piece.tensor.numel()].copy_(piece.tensor)
        self.gather_params()
        return loss

    def gather_params(self) -> None:
        """Every rank's updated shard back into every bucket: one all-gather per bucket, all started at once, the
        first layers' buckets (the last ones) first; waited for here, or with ``overlap_param_gather`` by each
        bucket's first reader (module docstring)."""
        for b in reversed(self.buckets):
            self._gathering[b.index] = ALL_GATHER_SINGLE(b.data, b.data[b.lo:b.hi].clone(),
                                                         group=self.group_of(b)[0], async_op=True)
        if not self.overlap_param_gather:
            self.wait_params()

    def wait_params(self, indices=None) -> None:
        """Wait for the parameter all-gathers in flight of the buckets ``indices`` (default: all of them)."""
        if not self._gathering:
            return
        for index in list(self._gathering) if indices is None else indices:
            work = self._gathering.pop(index, None)
            if work is not None:
                work.wait()  # bounded by the process group's timeout

    def __repr__(self) -> str:
        return f"FlatZero(stage={self.stage}, dp={self.dp}, buckets={len(self.buckets)}, {self.inner!r})"


def install_gather_waits(model: nn.Module, zero: FlatZero) -> None:
    """With ``overlap_param_gather``: make each bucket's first reader wait for its all-gather (module docstring). A
    module holding parameters of buckets B waits for B in its forward pre-hook and its ``state_dict`` pre-hook (a
    tied parameter: every module holding it); shardlib's readers outside a forward wait for all of them."""
    bucket_of = {id(p): b.index for b in zero.buckets for p in b.params}
    me = weakref.ref(zero)
    for module in model.modules():
        mine = tuple(sorted({bucket_of[id(p)] for p in module._parameters.values()
                             if p is not None and id(p) in bucket_of}))
        if mine:
            module.register_forward_pre_hook(functools.partial(_wait_for_buckets, me, mine))
            module.register_state_dict_pre_hook(functools.partial(_wait_for_buckets, me, mine))
    shard_state(model).settle = functools.partial(_wait_for_buckets, me, None)


def _wait_for_buckets(zero_ref: weakref.ref, indices, *hook_args) -> None:
    zero = zero_ref()
    if zero is not None:
        zero.wait_params(indices)


def _arrived(zero_ref: weakref.ref, bucket_index: int, i: int, param) -> None:
    """A parameter's post-accumulate-grad hook (held weakly: a discarded Trainer's optimizer leaves no work)."""
    zero = zero_ref()
    if zero is not None:
        zero.arrived(bucket_index, i)
