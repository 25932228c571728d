"""Data-parallel gradient sums overlapped with backward: torch's ``DistributedDataParallel`` on the dp group.

Where it composes, the Trainer wraps the sharded model (tensor, sequence parallel or neither) in
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
  (DDP would read their ``.grad`` before it is complete); the Trainer sums them over dp once backward is done.

Where DDP does not compose the Trainer keeps its own post-backward sum in 25 MiB buckets
(:func:`shardlib.parallel.collectives.all_reduce_flat`): pipeline stages (several backward passes per step per stage;
the tied-weight sum must come first), ZeRO-2 (each gradient is *reduced* to the one dp rank that steps it, not
all-reduced), ZeRO-3 (FSDP2 reduce-scatters in backward itself), a custom ``forward_step`` (it is given the model
itself, not a wrapper), and :meth:`~shardlib.train.trainer.Trainer.forward_backward` called on its own (gradient
accumulation by the caller: DDP would sum at every backward).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..parallel.gradsync import sequence_bucketed


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

