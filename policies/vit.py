"""ViT: ViTModel, ViTForImageClassification, ViTForMaskedImageModeling.

transformers 5 names ViT's modules in memory ``layers.N.attention.{q,k,v,o}_proj`` and ``layers.N.mlp.fc{1,2}``
(checkpoints on disk keep the Hub names ``encoder.layer.N.attention.attention.query``; that mapping belongs to
the checkpoint code). Plan: attention enters the TP region once (``CopyInputs``), q/k/v column-parallel (heads
split), o row-parallel; fc1 column-, fc2 row-parallel. The patch-embedding convolution, CLS and mask tokens,
position embeddings (so ``interpolate_pos_encoding`` and other resolutions work unchanged), LayerNorms, pooler,
classifier and the masked-image-modeling decoder stay replicated: a classifier of any label count works as is,
no padding of the label set.
"""

from __future__ import annotations

from transformers import ViTForImageClassification, ViTForMaskedImageModeling, ViTModel

from shardlib.parallel.styles import ColwiseParallel, RowwiseParallel, attention_block
from shardlib.sharding.plan import EXAMPLES, AttentionSite, LossItems, Plan, Stack

from . import Policy, register_policy


def vit_plan(model, tp: int) -> Plan:
    base = "" if isinstance(model, ViTModel) else "vit."
    layer = f"{base}layers.*"
    attention = f"{layer}.attention"  # the output projection lives inside the attention module
    styles = attention_block(attention, [f"{attention}.{n}_proj" for n in "qkv"], f"{attention}.o_proj")
    styles[f"{layer}.mlp.fc1"] = ColwiseParallel()
    styles[f"{layer}.mlp.fc2"] = RowwiseParallel()
    return Plan(styles=styles, divide_by_tp={f"{layer}.attention": ("num_attention_heads",)},
                trunk=(Stack(layers=f"{base}layers", before=(f"{base}embeddings",)),),
                sequence_dropout=(f"{layer}.dropout",), attention={attention: AttentionSite("num_attention_heads")},
                fused_projections={attention: ("q_proj", "k_proj", "v_proj")},
                epilogues={"bias_gelu": (f"{layer}.mlp",), "dropout_add": (layer,)},
                loss_items=(LossItems(key="bool_masked_pos", count="true")
                            if isinstance(model, ViTForMaskedImageModeling) else EXAMPLES))


#: in memory (transformers 5) -> on disk (Hub checkpoints, what save_pretrained writes); ".attention.o_proj." goes
#: before ".mlp.fc2." so that the reverse direction maps ".attention.output.dense." first
CHECKPOINT_KEYS = (
    ("layers.", "encoder.layer."),
    (".attention.q_proj.", ".attention.attention.query."),
    (".attention.k_proj.", ".attention.attention.key."),
    (".attention.v_proj.", ".attention.attention.value."),
    (".attention.o_proj.", ".attention.output.dense."),
    (".mlp.fc1.", ".intermediate.dense."),
    (".mlp.fc2.", ".output.dense."),
)

POLICY = register_policy(Policy(
    name="vit", model_classes=(ViTModel, ViTForImageClassification, ViTForMaskedImageModeling), make_plan=vit_plan,
    checkpoint_keys=CHECKPOINT_KEYS,
))
