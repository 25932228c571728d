"""A policy for a new architecture written as data: RoBERTa (the worked example of docs/policy-authoring.md).

    import shardlib, roberta_policy
    model = shardlib.shard(RobertaForMaskedLM(config), mesh, policy=roberta_policy.POLICY)

Proven equal to the unsharded model by tests/test_policy_example.py.
"""

from transformers import RobertaForMaskedLM, RobertaModel

from shardlib import ColwiseParallel, LossSpec, Plan, RowwiseParallel, Stack, VocabParallel
from shardlib.parallel.styles import attention_block
from shardlib.policies import Policy


def roberta_plan(model, tp: int) -> Plan:
    base = "" if isinstance(model, RobertaModel) else "roberta."
    layer = f"{base}encoder.layer.*"
    attention = f"{layer}.attention"
    styles = {
        f"{base}embeddings.word_embeddings": VocabParallel(),
        **attention_block(f"{attention}.self", [f"{attention}.self.{n}" for n in ("query", "key", "value")],
                          f"{attention}.output.dense"),
        f"{layer}.intermediate.dense": ColwiseParallel(),
        f"{layer}.output.dense": RowwiseParallel(),
    }
    loss = None
    if isinstance(model, RobertaForMaskedLM):
        loss = LossSpec(kind="masked_lm", head="lm_head.decoder")
        styles["lm_head.decoder"] = VocabParallel()
    return Plan(styles=styles, divide_by_tp={f"{layer}.attention.self": ("num_attention_heads", "all_head_size")},
                trunk=(Stack(layers=f"{base}encoder.layer", before=(f"{base}embeddings",)),), loss=loss)


POLICY = Policy(name="roberta", model_classes=(RobertaModel, RobertaForMaskedLM), make_plan=roberta_plan)
