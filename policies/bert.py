"""BERT: every HF BERT class (BertModel and all its task heads).

Tensor-parallel plan (Megatron): in each layer, self-attention (and cross-attention for decoders) enters the TP
region once (``CopyInputs``), q/k/v are column-parallel (heads split), the attention output projection is
row-parallel; the MLP is column- then row-parallel. The word embedding and, where the model has one, the LM
decoder are vocab-parallel and stay tied. Position / token-type embeddings, LayerNorms, the pooler, the
prediction-head transform and the small classifiers (NSP, sequence / token / QA / multiple-choice) stay
replicated: they are at most hidden x hidden and sharding them would add collectives for no memory win.
Attention-probability dropout acts on local heads, so it draws from the per-rank RNG stream (``LocalRNG``).
"""

from __future__ import annotations

from transformers import (
    BertForMaskedLM, BertForMultipleChoice, BertForNextSentencePrediction, BertForPreTraining, BertForQuestionAnswering,
    BertForSequenceClassification, BertForTokenClassification, BertLMHeadModel, BertModel,
)

from shardlib.parallel.styles import ColwiseParallel, RowwiseParallel, VocabParallel, attention_block
from shardlib.sharding.plan import EXAMPLES, TOKENS, AttentionSite, LossItems, LossSpec, Plan, Stack

from . import Policy, register_policy

HEAD_CLASSES = (
    BertForPreTraining, BertForMaskedLM, BertLMHeadModel, BertForNextSentencePrediction,
    BertForSequenceClassification, BertForMultipleChoice, BertForTokenClassification, BertForQuestionAnswering,
)

LOSSES = {
    BertForMaskedLM: LossSpec(kind="masked_lm", head="cls.predictions.decoder"),
    BertLMHeadModel: LossSpec(kind="causal_lm", head="cls.predictions.decoder"),
    BertForPreTraining: LossSpec(kind="pretraining", head="cls.predictions.decoder", logits="prediction_logits",
                                 labels=("labels", "next_sentence_label")),
}

#: what each head's loss averages over (the rest: one item per example; BertForPreTraining sums two means). Sequence
#: classification counts its labels: one per example padded, one per document in packed rows ([rows, documents])
LOSS_ITEMS = {BertForMaskedLM: TOKENS, BertForTokenClassification: TOKENS, BertForSequenceClassification: TOKENS,
              BertLMHeadModel: LossItems(key="labels", shift=1)}


def attention_styles(prefix: str, inputs: tuple[str, ...]) -> dict:
    """BertAttention at ``prefix``: q/k/v in ``.self``, the output projection in ``.output.dense``."""
    return attention_block(f"{prefix}.self", [f"{prefix}.self.{n}" for n in ("query", "key", "value")],
                           f"{prefix}.output.dense", inputs)


def bert_plan(model, tp: int) -> Plan:
    config = model.config
    base = "" if isinstance(model, BertModel) else "bert."
    layer = f"{base}encoder.layer.*"
    styles = {f"{base}embeddings.word_embeddings": VocabParallel()}
    styles |= attention_styles(f"{layer}.attention", ("hidden_states",))
    heads = {f"{layer}.attention.self": ("num_attention_heads", "all_head_size")}
    attention = {f"{layer}.attention.self": AttentionSite("num_attention_heads")}
    projections = {f"{layer}.attention.self": ("query", "key", "value")}  # fused-QKV groups
    dropout = (f"{layer}.attention.output.dropout", f"{layer}.output.dropout")  # after the row-parallel exits
    epilogues = {"bias_gelu": (f"{layer}.intermediate",),
                 "dropout_add": (f"{layer}.attention.output", f"{layer}.output")}
    if config.is_decoder and config.add_cross_attention:
        styles |= attention_styles(f"{layer}.crossattention", ("hidden_states", "encoder_hidden_states"))
        heads[f"{layer}.crossattention.self"] = ("num_attention_heads", "all_head_size")
        attention[f"{layer}.crossattention.self"] = AttentionSite("num_attention_heads",
                                                                  kv_input="encoder_hidden_states")
        projections[f"{layer}.crossattention.self"] = ("key", "value")
        dropout += (f"{layer}.crossattention.output.dropout",)
        epilogues["dropout_add"] += (f"{layer}.crossattention.output",)
    styles[f"{layer}.intermediate.dense"] = ColwiseParallel()
    styles[f"{layer}.output.dense"] = RowwiseParallel()
    loss = next((spec for cls, spec in LOSSES.items() if isinstance(model, cls)), None)
    if loss is not None:
        styles[loss.head] = VocabParallel()
    trunk = (Stack(layers=f"{base}encoder.layer", before=(f"{base}embeddings",)),)
    items = next((spec for cls, spec in LOSS_ITEMS.items() if isinstance(model, cls)), EXAMPLES)
    pool = f"{base}pooler" if isinstance(model, BertForSequenceClassification) and model.bert.pooler else None
    return Plan(styles=styles, divide_by_tp=heads, trunk=trunk, loss=loss, sequence_dropout=dropout,
                attention=attention, fused_projections=projections, epilogues=epilogues, loss_items=items,
                document_pool=pool)


POLICY = register_policy(Policy(name="bert", model_classes=(BertModel, *HEAD_CLASSES), make_plan=bert_plan))
