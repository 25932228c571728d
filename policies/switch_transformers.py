"""Switch Transformers (SwitchTransformersModel, ForConditionalGeneration incl. ``generate()``, EncoderModel): T5's
layout with a mixture of experts in every ``encoder_sparse_step``-th / ``decoder_sparse_step``-th feed-forward.

Attention, relative position bias, embeddings, the LM head, the trunk and the seq2seq loss are T5's
(:mod:`shardlib.policies.t5`). A dense feed-forward (``SwitchTransformersDenseActDense``: wi column, wo row) is
T5's too. A sparse one (``SwitchTransformersSparseMLP``) keeps its top-1 router replicated (float32, its jitter
drawn from the stream every TP rank shares, the capacity and its dropped tokens the unsharded model's), and its
experts split like that MLP (:class:`~shardlib.parallel.experts.ExpertsTensorParallel`: each expert's wi column,
wo row, one input copy and one output all-reduce for all experts). The z-loss and load-balancing loss the model
adds when asked for its router logits are added to the vocab-parallel loss the same way
(:mod:`shardlib.sharding.experts`).
"""

from __future__ import annotations

import dataclasses

import transformers

from shardlib.parallel.experts import ExpertsTensorParallel
from shardlib.parallel.styles import ColwiseParallel, CopyInputs, LocalRNG, RowwiseParallel
from shardlib.sharding.plan import MoESite, Plan

from . import BUILTIN, Policy, register_policy
from .t5 import t5_attention_plan

MODEL_CLASSES = tuple(getattr(transformers, name) for name in BUILTIN["switch_transformers"])


def switch_plan(model, tp: int) -> Plan:
    plan = t5_attention_plan(model)
    styles, moe = dict(plan.styles), {}
    for stack in ("encoder", "decoder"):
        if not hasattr(model, stack):
            continue
        for i, block in enumerate(model.get_submodule(stack).block):
            ff = f"{stack}.block.{i}.layer.{len(block.layer) - 1}.mlp"
            if block.is_sparse:
                styles[f"{ff}.experts"] = ExpertsTensorParallel(up=("wi",), down="wo")
                moe[ff] = MoESite(router="router", experts="experts", capacity=True)
            else:
                styles[ff] = (CopyInputs("hidden_states"), LocalRNG())
                styles[f"{ff}.wi"] = ColwiseParallel(copy_input=False)
                styles[f"{ff}.wo"] = RowwiseParallel()
    return dataclasses.replace(plan, styles=styles, moe=moe)


POLICY = register_policy(Policy(name="switch_transformers", model_classes=MODEL_CLASSES, make_plan=switch_plan))
