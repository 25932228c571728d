"""ZeRO-3: torch's FSDP2 (``fully_shard``) over the data-parallel dimension, composed with shardlib's tensor
parallelism (as torchtitan composes FSDP2 with TP).

shardlib's tensor-parallel parameters are plain tensors (each tp rank's slice), so FSDP2 on the 1-D dp sub-mesh
shards each of them again along dim 0 over dp (a DTensor ``Shard(0)`` whose global shape is the tp-local shape),
all-gathers a layer's parameters before its forward and backward and reduce-scatters its gradients after. Each
layer of the policy's stacks (``Plan.trunk``) is one FSDP group, the rest of the model (embeddings, heads, and so
every tied weight: BERT's MLM decoder, T5's ``shared`` / ``lm_head``) is the root group: FSDP2 refuses a parameter
shared by two groups.

* Gradients are **summed** over dp, as everywhere in the Trainer (FSDP2 averages by default): a divide factor
  of 1, reduced with a plain SUM (``set_force_sum_reduction_for_comms``: gloo has no PREMUL_SUM).
* Sequence parallelism composes: FSDP2's pre-forward hook runs before shardlib's (it is prepended), so the per-
  parameter gradient hooks of Megatron SP / all-to-all SP see the unsharded parameters and run before the
  reduce-scatter (tested against zero=0 in float64).
* Pipeline stages (pp > 1): the layers of this rank's stages are its layer groups, the root group holds the rest of
  what its stages use (embeddings, heads, tied weights); the other stages' parameters (meta tensors here) are
  ``ignored_params``. Each microbatch's backward ends with FSDP2's final callback (reduce-scatter, reshard), and the
  next forward or backward gathers again, so between steps a rank holds 1/dp of its stages' parameters. A stage
  that is not the last ends the HF forward with an exception raised in a hook at its cut
  (:mod:`shardlib.pipeline.split`), so the root's post-forward hook never runs: the runner calls it
  (:func:`complete_root_forward`), which registers the root's pre-backward unshard on the boundary tensors, and
  tied parameters are summed over pp as dp-local shards (:func:`~shardlib.parallel.dp_shards.local_shape` for a
  rank not holding one).
* Expert parallelism (``ep > 1``): each experts module is an FSDP group of its own on the expert-data-parallel
  sub-mesh (the ranks holding the same experts; ``Mesh.edp_device_mesh``), inside its layer's group on dp, as
  torchtitan shards its experts: each ep rank's experts are sharded again over edp and their gradients
  reduce-scattered (summed) there, the rest of the layer over dp.
* ``offload=True``: FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer state in host memory, the
  step on CPU); refused on a mesh without CUDA, where everything already is in host memory.

What a dp-sharded tensor looks like to the rest of shardlib (this rank's shard, the whole tp-local tensor, a value
placed as a parameter is) is :mod:`shardlib.parallel.dp_shards`, re-exported here.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from ..parallel.dp_shards import like, local, local_shape, whole  # noqa: F401 - re-exported
from ..parallel.experts import EXPERTS_ATTR, every_expert_gets_a_gradient, is_fused_experts
from ..parallel.gradsync import unbucket
from ..sharding.sharded import shard_state


def dp_device_mesh(mesh) -> DeviceMesh:
    """The 1-D data-parallel sub-mesh of shardlib's mesh (its dims are dp, pp, sp, tp)."""
    return mesh.device_mesh["dp"]


def apply_fsdp(model: nn.Module, *, offload: bool = False) -> list[FSDPModule]:
    """``fully_shard`` every layer of the model's stacks, then the model (root); returns the FSDP modules."""
    state = shard_state(model)
    policy: OffloadPolicy = OffloadPolicy()
    if offload:  # a CUDA mesh (train.optim.check_zero refuses offload elsewhere)
        policy = CPUOffloadPolicy()
    dp_mesh = dp_device_mesh(state.mesh)
    unbucket(model)  # FSDP2 reads a layer's gradients right after its backward
    for module in model.modules():  # each layer's flat gradient buffer must be as long on every dp rank
        if module.__dict__.get(EXPERTS_ATTR) and not is_fused_experts(module):
            every_expert_gets_a_gradient(module)
    # expert parallelism: each experts module is a group of its own over the ranks holding the same experts
    experts_mesh = state.mesh.edp_device_mesh() if getattr(state.mesh, "ep", 1) > 1 else None
    modules = []
    for stack in state.plan.trunk:
        for layer in model.get_submodule(stack.layers):  # under a pipeline, this rank's stages' layers
            if experts_mesh is not None:
                modules += [fully_shard(m, mesh=experts_mesh, offload_policy=policy) for m in layer.modules()
                            if m.__dict__.get(EXPERTS_ATTR)]
            modules.append(fully_shard(layer, mesh=dp_mesh, offload_policy=policy))
    other_stages = {p for p in model.parameters() if p.is_meta}  # a pipeline's other stages (PipelineSplit)
    modules.append(fully_shard(model, mesh=dp_mesh, offload_policy=policy, ignored_params=other_stages or None))
    for module in modules:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM for the factor
    return modules


def complete_root_forward(model: nn.Module, boundary: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Run the FSDP2 root's post-forward hook that a pipeline stage's cut skipped (module docstring): it ends the
    root's forward pass and, with grad enabled, registers its pre-backward unshard on the ``boundary`` tensors the
    stage sends. torch has no public call for it (``FSDPModule`` exposes unshard / reshard, not the hook's
    bookkeeping of the iteration's forward root and training state); the zero=3 x pipeline equality tests fail if
    its meaning changes."""
    with warnings.catch_warnings():  # boundary tensors may be views (T5's sliced position bias): none is modified
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)
        return fully_shard.state(model)._post_forward(model, (), boundary)


def reshard(model: nn.Module) -> None:
    """Free the unsharded parameters a forward without backward (evaluation) leaves on the root module, so that
    ``model.parameters()`` are the sharded ones again (what the optimizer and checkpoints hold)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
