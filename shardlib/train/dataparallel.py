"""The data-parallel layer: how gradients meet over dp. One object per Trainer (:func:`data_parallel`), one kind per
ZeRO stage, one interface the Trainer calls (:class:`DataParallel`): ``module`` (what forward runs), ``backward(last)``
around each backward, ``finish_grads`` after the step's backwards, ``zero_grad``, ``after_eval``. The optimizer
(:mod:`shardlib.train.optim`) steps and holds the state, partitioned where the stage says so.

* zero=0, :class:`Replicated`: torch's ``DistributedDataParallel`` on the dp group where it composes, else a
  post-backward sum;
* zero=1/2, :class:`Partitioned`: :class:`shardlib.train.zero.FlatZero` (flat buckets, reduce-scatter in backward);
* zero=3, :class:`FullySharded`: torch's FSDP2 (:mod:`shardlib.train.fsdp`), which reduce-scatters in backward.

DDP, where it composes: the Trainer wraps the sharded model (tensor, sequence parallel or neither) in
``torch.nn.parallel.DistributedDataParallel(model, process_group=<dp group>)``: DDP's reducer sums the gradients in
25 MiB buckets, each started as soon as its last gradient is ready, while backward goes on, with the gradients as
views into the buckets (``gradient_as_bucket_view``: no second copy of them). The sharded layers hold plain local
tensors, so DDP sees an ordinary module: each tp rank's DDP sums its own shards over its own dp group.

Settings and why:

* a comm hook that sums (``SUM``) instead of DDP's average: the Trainer already weighs each rank's loss by its
  share of the global batch's loss items (:mod:`shardlib.train.trainer`), as before;
* ``find_unused_parameters=True``: a model may leave parameters out of its loss (a pooler under a token loss);
  those keep ``grad=None`` on every rank, as without dp. Its graph walk costs well under 1% of a CPU step;
* ``init_sync=False``, ``forward_sync_buffers=False``: ``shard()`` builds identical replicas and the buffers are
  constants (position ids), so nothing is broadcast;
* parameters whose gradient a sequence-parallel bucket completes after backward (:mod:`shardlib.parallel.gradsync`: the
  LayerNorms and row-parallel biases under Megatron SP, every layer parameter under all-to-all SP) are left out
  (DDP would read their ``.grad`` before it is complete); they are summed over dp once backward is done.

Where DDP does not compose, zero=0 sums after backward in 25 MiB buckets
(:func:`shardlib.parallel.collectives.all_reduce_flat`): pipeline stages (several backward passes per step per stage;
the tied-weight sum must come first), a custom ``forward_step`` (it is given the model itself, not a wrapper), and
:meth:`~shardlib.train.trainer.Trainer.forward_backward` called on its own (gradient accumulation by the caller: DDP
would sum at every backward).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..parallel.collectives import all_reduce_flat
from ..parallel.gradsync import sequence_bucketed
from .fsdp import reshard
from .zero import FlatZero


def _sum_hook(group, bucket):
    """DDP comm hook: all-reduce the bucket with SUM (DDP's default divides by the group size)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_ddp(model: nn.Module, group) -> tuple[DistributedDataParallel, list[nn.Parameter]]:
    """``model`` in DDP over ``group``, and the parameters left out of it (summed by the Trainer after backward)."""
    left_out = sequence_bucketed(model)
    names = [name for name, p in model.named_parameters() if id(p) in left_out]
    had = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    try:
        ddp = DistributedDataParallel(model, process_group=group, forward_sync_buffers=False, init_sync=False,
                                      find_unused_parameters=True, gradient_as_bucket_view=True)
    finally:  # DDP read the list; leave no attribute of its own on the user's model
        if had is None:
            del model._ddp_params_and_buffers_to_ignore
        else:
            model._ddp_params_and_buffers_to_ignore = had
    ddp.register_comm_hook(group, _sum_hook)
    return ddp, [p for p in model.parameters() if id(p) in left_out and p.requires_grad]


def ddp_composes(mesh, pipeline, zero: int, custom_forward: bool) -> bool:
    """Whether the Trainer sums gradients over dp with torch's DDP (module docstring: where it does not)."""
    return mesh.dp > 1 and pipeline is None and zero == 0 and not custom_forward


class DataParallel:
    """No data parallelism (dp=1): the base of every kind, which the Trainer calls the same way."""

    def __init__(self, model: nn.Module):
        self.model = model

    @property
    def module(self) -> nn.Module:
        """What the Trainer's forward runs (DDP's wrapper, or the model)."""
        return self.model

    def backward(self, last: bool):
        """Context around one backward of the Trainer; ``last``: the step's last one."""
        return contextlib.nullcontext()

    def finish_grads(self) -> None:
        """After the step's backwards (and the tied-weight sum over pipeline stages): gradients summed over dp,
        where the optimizer step reads them."""

    def zero_grad(self) -> None:
        """Forget the step's gradients (the Trainer clears every ``.grad`` itself)."""

    def after_eval(self) -> None:
        """After a forward without backward."""


class Replicated(DataParallel):
    """zero=0 over dp > 1: torch's DDP where it composes (``ddp``), the post-backward flat sum elsewhere."""

    def __init__(self, model: nn.Module, group, params: list, use_ddp: bool):
        super().__init__(model)
        self.group, self.params = group, params
        self.ddp, self.left_out_of_ddp = wrap_ddp(model, group) if use_ddp else (None, [])
        self.synced = False  # DDP summed the gradients in the step's last backward

    @property
    def module(self) -> nn.Module:
        return self.ddp if self.ddp is not None else self.model

    def backward(self, last: bool):
        # under DDP every backward but the step's last accumulates locally (no_sync); the last one sums
        self.synced = self.ddp is not None and last
        return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()

    def finish_grads(self) -> None:
        """Sum over dp what DDP did not (everything, without DDP or when :meth:`backward` was not the Trainer's):
        flat all-reduces of at most 25 MiB (``collectives.FLAT_BUCKET_BYTES``). A parameter no replica used keeps
        grad None (AdamW then leaves it alone, as without dp)."""
        candidates = self.left_out_of_ddp if self.synced else self.params
        used = torch.tensor([p.grad is not None for p in candidates], dtype=torch.uint8,
                            device=candidates[0].device if candidates else "cpu")
        if candidates:
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group)
        params = [p for p, u in zip(candidates, used.tolist()) if u]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_flat([p.grad for p in params], self.group)

    def zero_grad(self) -> None:
        self.synced = False


class Partitioned(DataParallel):
    """zero=1/2: :class:`~shardlib.train.zero.FlatZero` reduce-scatters in backward (zero=2: every backward, zero=1:
    the step's last) and after it what backward left whole."""

    def __init__(self, model: nn.Module, optimizer: FlatZero):
        super().__init__(model)
        self.optimizer = optimizer

    def backward(self, last: bool):
        self.optimizer.arm(last)
        return contextlib.nullcontext()

    def finish_grads(self) -> None:
        self.optimizer.finish_grads()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


class FullySharded(DataParallel):
    """zero=3: FSDP2 (applied by :func:`shardlib.train.fsdp.apply_fsdp` before the optimizer is built) reduce-scatters
    each layer's gradients in backward itself."""

    def after_eval(self) -> None:
        reshard(self.model)  # a forward without backward leaves the root unsharded


def data_parallel(model: nn.Module, mesh, split, zero: int, optimizer, params: list,
                  custom_forward: bool) -> DataParallel:
    """The data-parallel layer of a Trainer (module docstring)."""
    if zero == 3:
        return FullySharded(model)
    if isinstance(optimizer, FlatZero):
        return Partitioned(model, optimizer)
    if mesh.dp == 1:
        return DataParallel(model)
    return Replicated(model, mesh.group("dp"), params, ddp_composes(mesh, split, zero, custom_forward))
