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
* unused parameters, decided by the first step (:meth:`Replicated.finish_grads`, details below): parameters the loss
  reaches on no rank (a pooler under a token loss) are left out of DDP, and ``find_unused_parameters`` is off unless
  the first step showed the set of used parameters to depend on the data;
* ``init_sync=False``, ``forward_sync_buffers=False``: ``shard()`` builds identical replicas and the buffers are
  constants (position ids), so nothing is broadcast;
* parameters whose gradient a sequence-parallel bucket completes after backward (:mod:`shardlib.parallel.gradsync`: the
  LayerNorms and row-parallel biases under Megatron SP, every layer parameter under all-to-all SP) are left out
  (DDP would read their ``.grad`` before it is complete); they are summed over dp once backward is done.

Unused parameters. ``find_unused_parameters=True`` makes DDP walk the autograd graph from every output tensor in each
step's forward (and all-reduce a map of the used parameters), and torch warns once per rank where it finds none
unused, which is every HF model whose loss reaches each parameter. The walk is also not the question that matters:
it starts from every output, not the loss, so a returned ``pooler_output`` the loss does not use counts as used.
So the first step decides, from the gradients it actually produced: it runs without DDP, through the post-backward
sum below (which already counts, per parameter, the ranks that gave it a gradient: one small all-reduce it does
anyway), and DDP is built before the second step's first forward:

* no rank gave a parameter a gradient: it is left out of DDP and summed after backward with the sequence-parallel
  ones (it keeps ``grad=None`` while no rank uses it, as without dp, and is summed in any step some rank does);
* some ranks did, others did not: which parameters the loss reaches depends on the data, so DDP gets
  ``find_unused_parameters=True`` (its graph walk is what such models need);
* else (every HF task model here) ``find_unused_parameters=False``: no walk, no warning. A parameter DDP sums that
  gets no gradient in a later step on some rank (layer drop, a mixture of experts that happened to use every expert
  in the first step) is an error on that rank after its backward, naming the parameters and
  ``Trainer(find_unused_parameters=True)``, before any other collective could pair with DDP's pending all-reduce.

Cost: nothing is recomputed and no RNG stream is touched (the decision reads the first step's own gradients); the
first step's dp sum runs after backward instead of overlapping it, and so does the second (DDP without
``find_unused_parameters`` puts every gradient in one bucket in its first iteration and rebuilds its buckets in
backward order after it), then each step saves the graph walk and DDP's used-map all-reduce (where
parameters were left out, the post-backward sum's small all-reduce of per-parameter flags takes its place). Measured
on a shared 2-core CPU host: the dp sum of BERT-base's gradients at dp=2 over gloo takes 0.6 s (the most the first
two steps can expose, once per run), its 201 flags 0.5-4 ms. Why not the alternatives: a probe forward/backward of
the first microbatch costs a microbatch and must fork every RNG stream; a meta-device dry run cannot see
data-dependent control flow; DDP's ``static_graph`` also learns the unused parameters in its first iteration, but
under torch 2.13 it failed both ways tried at dp=2: an internal assert in the reducer (``expect_autograd_hooks_``)
under ``no_sync`` (the Trainer's microbatches), and "Expected to have finished reduction in the prior iteration" in
the third step of a BertModel whose loss leaves the pooler out.
``Trainer(find_unused_parameters=True | False)`` skips the decision (DDP built at once, as given).

Where DDP does not compose, zero=0 sums after backward in 25 MiB buckets
(:func:`shardlib.parallel.collectives.all_reduce_flat`): pipeline stages (several backward passes per step per stage;
the tied-weight sum must come first), a custom ``forward_step`` (it is given the model itself, not a wrapper), and
:meth:`~shardlib.train.trainer.Trainer.forward_backward` called on its own (gradient accumulation by the caller: DDP
would sum at every backward).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..parallel.collectives import all_reduce_flat
from ..parallel.experts import expert_module_params
from ..parallel.gradsync import sequence_bucketed
from ..parallel.layout import named_layouts
from .fsdp import reshard
from .zero import FlatZero

log = logging.getLogger("shardlib.train")


def _sum_hook(group, bucket):
    """DDP comm hook: all-reduce the bucket with SUM (DDP's default divides by the group size)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_ddp(model: nn.Module, group, left_out: set[int], find_unused: bool) -> DistributedDataParallel:
    """``model`` in DDP over ``group``, without the parameters whose ids are in ``left_out`` (the Trainer sums those
    after backward)."""
    # every name of a left-out parameter: DDP matches names, and a tied one has one per module holding it
    names = [name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in left_out]
    had = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    try:
        ddp = DistributedDataParallel(model, process_group=group, forward_sync_buffers=False, init_sync=False,
                                      find_unused_parameters=find_unused, gradient_as_bucket_view=True)
    finally:  # DDP read the list; leave no attribute of its own on the user's model
        if had is None:
            del model._ddp_params_and_buffers_to_ignore
        else:
            model._ddp_params_and_buffers_to_ignore = had
    ddp.register_comm_hook(group, _sum_hook)
    return ddp


def unused_settings(ranks_used: list[int], dp: int) -> tuple[list[int], bool]:
    """DDP's settings from the first step (module docstring): given, per parameter DDP would sum, how many of the
    ``dp`` ranks gave it a gradient, the indices of those to leave out of DDP (no rank did) and whether DDP must look
    for unused parameters in every step (some ranks did and others not: the data decides what the loss reaches)."""
    return [i for i, n in enumerate(ranks_used) if n == 0], any(0 < n < dp for n in ranks_used)


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
    """zero=0 over dp > 1: torch's DDP where it composes (``ddp``, built before the second step unless
    ``find_unused`` is given: module docstring), the post-backward flat sum elsewhere."""

    def __init__(self, model: nn.Module, group, params: list, use_ddp: bool, find_unused: bool | None = None,
                 expert_group=None):
        super().__init__(model)
        self.group, self.params = group, params
        self.ddp = None
        self.synced = False  # DDP summed the gradients in the step's last backward
        self.left_out_of_ddp: list[nn.Parameter] = []  # summed after backward even under DDP
        self.in_ddp: list[nn.Parameter] = []  # what DDP sums (once built)
        self.find_unused = find_unused  # None: not decided yet (the first step decides)
        self.decided = False  # find_unused was decided by the first step (not given)
        #: expert weights split over ep: summed over the ranks holding the same experts (mesh.group("edp"))
        self.expert_group = expert_group
        self.split_experts = {id(p) for _, p, layout in named_layouts(model) if layout.ep > 1}
        if use_ddp:
            late = sequence_bucketed(model) | self.split_experts | expert_module_params(model)
            trained = [p for p in model.parameters() if p.requires_grad]
            self.left_out_of_ddp = [p for p in trained if id(p) in late]
            self.in_ddp = [p for p in trained if id(p) not in late]
            if find_unused is not None:
                self._build()

    @property
    def module(self) -> nn.Module:
        return self.ddp if self.ddp is not None else self.model

    def _build(self) -> None:
        self.ddp = wrap_ddp(self.model, self.group, {id(p) for p in self.left_out_of_ddp}, self.find_unused)

    def backward(self, last: bool):
        if self.ddp is None and self.find_unused is not None and self.in_ddp:
            self._build()  # decided by the first step, before this forward (DDP's forward prepares its backward)
        # under DDP every backward but the step's last accumulates locally (no_sync); the last one sums
        self.synced = self.ddp is not None and last
        return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()

    def finish_grads(self) -> None:
        """Sum over dp what DDP did not (everything, without DDP or when :meth:`backward` was not the Trainer's):
        flat all-reduces of at most 25 MiB (``collectives.FLAT_BUCKET_BYTES``). A parameter no replica used keeps
        grad None (AdamW then leaves it alone, as without dp). Before DDP is built, the count of ranks that gave
        each parameter a gradient decides how to build it (module docstring)."""
        if self.synced and not self.ddp.find_unused_parameters:
            self._check_all_used()  # before any collective that could pair with DDP's pending all-reduce
        candidates = self.left_out_of_ddp if self.synced else self.params
        # experts split over ep: counted over the ranks holding the same experts (other dp ranks hold others)
        candidates = ([p for p in candidates if id(p) not in self.split_experts]
                      + [p for p in candidates if id(p) in self.split_experts])
        ranks_used = torch.tensor([p.grad is not None for p in candidates], dtype=torch.int32,
                                  device=candidates[0].device if candidates else "cpu")
        experts_from = len(candidates) - len(self.split_experts & set(map(id, candidates)))
        if experts_from:
            dist.all_reduce(ranks_used[:experts_from], group=self.group)
        if experts_from < len(candidates) and self.expert_group is not None:
            dist.all_reduce(ranks_used[experts_from:], group=self.expert_group)
        ranks_used = ranks_used.tolist()
        if self.find_unused is None and self.in_ddp:
            self._decide(dict(zip(map(id, candidates), ranks_used)))
        params = [p for p, n in zip(candidates, ranks_used) if n]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_flat([p.grad for p in params if id(p) not in self.split_experts], self.group)
        if self.expert_group is not None:
            all_reduce_flat([p.grad for p in params if id(p) in self.split_experts], self.expert_group)

    def _decide(self, ranks_used: dict[int, int]) -> None:
        """How to build DDP, from the first step's count of ranks that gave each parameter a gradient."""
        dp, self.decided = dist.get_world_size(self.group), True
        unused, self.find_unused = unused_settings([ranks_used.get(id(p), 0) for p in self.in_ddp], dp)
        left_out, unused = [self.in_ddp[i] for i in unused], set(unused)
        self.left_out_of_ddp += left_out
        self.in_ddp = [p for i, p in enumerate(self.in_ddp) if i not in unused]
        if dist.get_rank() == 0:
            names = {id(p): n for n, p in self.model.named_parameters()}
            log.info("data parallel (dp=%d): %d parameter(s) got no gradient on any rank in the first step%s; DDP "
                     "sums %d parameter(s) with find_unused_parameters=%s%s", dp, len(left_out),
                     f" ({', '.join(names[id(p)] for p in left_out[:8])}{', ...' if len(left_out) > 8 else ''}), "
                     "left out of DDP" if left_out else "", len(self.in_ddp), self.find_unused,
                     " (some ranks used parameters that others did not)" if self.find_unused else "")

    def _check_all_used(self) -> None:
        """Under DDP without ``find_unused_parameters``: every parameter it sums got a gradient on this rank (else
        its reducer waits for one that never comes while the other ranks wait in its all-reduce)."""
        missing = [p for p in self.in_ddp if p.grad is None]
        if missing:
            names = {id(p): n for n, p in self.model.named_parameters()}
            listed = ", ".join(names.get(id(p), "?") for p in missing[:8]) + (", ..." if len(missing) > 8 else "")
            raise RuntimeError(
                f"{len(missing)} parameter(s) that torch's DDP sums got no gradient in this step on data-parallel "
                f"rank {dist.get_rank(self.group)} ({listed}), and DDP runs without find_unused_parameters "
                + ("(every rank gave them a gradient in the first step, which decided it): which parameters this "
                   "model's loss reaches changes from step to step (layer drop? experts?). " if self.decided else
                   "(as given). ") + "Pass Trainer(..., find_unused_parameters=True). The other data-parallel ranks "
                "wait in DDP's all-reduce until the collective timeout.")

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
                  custom_forward: bool, find_unused: bool | None = None) -> DataParallel:
    """The data-parallel layer of a Trainer (module docstring); ``find_unused``: DDP's ``find_unused_parameters``
    (None: decided by the first step)."""
    if zero == 3:
        return FullySharded(model)
    if isinstance(optimizer, FlatZero):
        return Partitioned(model, optimizer)
    if mesh.dp == 1:
        return DataParallel(model)
    ep = getattr(mesh, "ep", 1)
    return Replicated(model, mesh.group("dp"), params, ddp_composes(mesh, split, zero, custom_forward), find_unused,
                      expert_group=mesh.group("edp") if 1 < ep < mesh.dp else None)
