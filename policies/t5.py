"""T5 family: T5, MT5 and UMT5 (Model, ForConditionalGeneration, EncoderModel, ForSequenceClassification,
ForTokenClassification, ForQuestionAnswering), which share one module structure.

Plan, per attention module (``SelfAttention``, and ``EncDecAttention`` in the decoder): the inputs enter the TP
region once (``CopyInputs``: the hidden states; the encoder states enter once for the whole decoder, at the decoder
stack, so their backward all-reduce runs once rather than once per cross-attention), q/k/v are
column-parallel (heads split), o is row-parallel, the relative attention bias table [buckets, heads] is split by
head (``ColwiseParallel`` on an Embedding: each rank looks up the bias of its own heads, no communication), and
``n_heads`` / ``inner_dim`` become per-rank values (T5 builds the zero position bias of layers without a table
from ``n_heads``). Attention dropout runs on the per-rank RNG stream.

Feed-forward: ``T5DenseActDense`` (wi column, wo row) or the gated ``T5DenseGatedActDense`` used by T5 v1.1,
Flan-T5 and mT5 (wi_0 and wi_1 column, wo row). The input enters the TP region once for both wi_0 and wi_1
(``CopyInputs``; one backward all-reduce, not two), and the inner dropout acts on sharded activations, so the
module runs on the per-rank RNG stream too.

Embeddings: ``shared``, ``encoder.embed_tokens``, ``decoder.embed_tokens`` and the ``lm_head`` are vocab-parallel
and stay tied wherever the model ties them (transformers 5 always ties them for the T5 family;
``tie_word_embeddings=False`` now only turns off the decoder-output scaling, which HF's forward applies
unchanged). The seq2seq loss runs on vocab-sharded logits. Classification / QA heads stay replicated.
UMT5 has a relative bias table in every layer; the same patterns cover it.
"""

from __future__ import annotations

import dataclasses

import transformers

from shardlib.parallel.styles import (
    ColwiseParallel, CopyInputs, LocalRNG, RowwiseParallel, VocabParallel, attention_block,
)
from shardlib.sharding.plan import EXAMPLES, TOKENS, AttentionSite, LossSpec, Plan, Stack

from . import BUILTIN, Policy, register_policy

MODEL_CLASSES = tuple(getattr(transformers, name) for name in BUILTIN["t5"])  # T5, MT5, UMT5: every head
ATTENTION_INPUTS = ("hidden_states", "key_value_states", "encoder_hidden_states")  # T5/MT5 and UMT5 kv names


def _attention(path: str) -> dict:
    return attention_block(path, [f"{path}.{n}" for n in "qkv"], f"{path}.o", ATTENTION_INPUTS)


def t5_plan(model, tp: int) -> Plan:
    plan = t5_attention_plan(model)
    base = "transformer." if hasattr(model, "transformer") else ""
    styles = dict(plan.styles)
    for stack in (s.layers.rpartition(".block")[0][len(base):] for s in plan.trunk):
        ff = f"{base}{stack}.block.*.layer.{2 if stack == 'decoder' else 1}.DenseReluDense"
        styles[ff] = (CopyInputs("hidden_states"), LocalRNG())  # gated: wi_0 and wi_1 share one input copy
        for wi in ("wi_0", "wi_1") if model.config.is_gated_act else ("wi",):
            styles[f"{ff}.{wi}"] = ColwiseParallel(copy_input=False)
        styles[f"{ff}.wo"] = RowwiseParallel()
    return dataclasses.replace(plan, styles=styles)


def t5_attention_plan(model) -> Plan:
    """T5's plan without the feed-forward layers: attention, relative bias, embeddings, the LM head and its loss,
    the trunk (shared with Switch Transformers, whose feed-forward differs)."""
    base = "transformer." if hasattr(model, "transformer") else ""
    root = model.get_submodule(base.rstrip(".")) if base else model
    stacks = ["encoder", "decoder"] if hasattr(root, "decoder") else ["encoder"]
    styles = {f"{base}shared": VocabParallel()}
    heads, attention, projections = {}, {}, {}
    for stack in stacks:
        block = f"{base}{stack}.block.*"
        styles[f"{base}{stack}.embed_tokens"] = VocabParallel()
        styles |= _attention(f"{block}.layer.0.SelfAttention")
        styles[f"{base}{stack}.block.**.relative_attention_bias"] = ColwiseParallel()
        heads[f"{block}.layer.0.SelfAttention"] = ("n_heads", "inner_dim")
        attention[f"{block}.layer.0.SelfAttention"] = AttentionSite("n_heads", bias_method="compute_bias")
        projections[f"{block}.layer.0.SelfAttention"] = ("q", "k", "v")
        if stack == "decoder":
            # the encoder states enter the TP region once for the whole decoder (at the decoder stack), not once per
            # cross-attention: backward sums their gradient over the layers locally and all-reduces it once
            styles[f"{base}{stack}"] = CopyInputs("encoder_hidden_states")
            styles |= _attention(f"{block}.layer.1.EncDecAttention")
            styles[f"{block}.layer.1.EncDecAttention"] = (CopyInputs("hidden_states"), LocalRNG())
            heads[f"{block}.layer.1.EncDecAttention"] = ("n_heads", "inner_dim")
            kv_input = "encoder_hidden_states" if "umt5" in type(model).__module__ else "key_value_states"
            attention[f"{block}.layer.1.EncDecAttention"] = AttentionSite("n_heads", kv_input=kv_input)
            projections[f"{block}.layer.1.EncDecAttention"] = ("k", "v")
    epilogues = {}
    if type(model).__module__.endswith(".modeling_t5"):  # the fused forwards restate T5's (not MT5's / UMT5's)
        epilogues["dropout_add"] = tuple(f"{base}{stack}.block.*.layer.*" for stack in stacks)
    loss = None
    if hasattr(model, "lm_head"):
        loss = LossSpec(kind="seq2seq_lm", head="lm_head")
        styles["lm_head"] = VocabParallel()
    dropout = tuple(f"{base}{stack}.block.*.layer.*.dropout" for stack in stacks)  # each sublayer's residual dropout
    token_loss = loss is not None or type(model).__name__.endswith("ForTokenClassification")
    return Plan(styles=styles, divide_by_tp=heads, trunk=_trunk(model, base, stacks), loss=loss,
                sequence_dropout=dropout, attention=attention, fused_projections=projections,
                epilogues=epilogues, loss_items=TOKENS if token_loss else EXAMPLES)


def _trunk(model, base: str, stacks: list[str]) -> tuple[Stack, ...]:
    """Encoder then decoder. A cut between two T5 blocks carries the hidden state and the position bias that block
    0 computed (positional input 2, output 1); UMT5 blocks compute their own bias and carry the hidden state only.
    A stage after the encoder gets its output as ``encoder_outputs`` (the decoder's cross-attention input)."""
    carry = ((0, 0),) if model.config.model_type == "umt5" else ((0, 0), (2, 1))
    return tuple(
        Stack(layers=f"{base}{s}.block", before=(f"{base}{s}.embed_tokens",), after=(f"{base}{s}.final_layer_norm",),
              carry=carry, end=f"{base}{s}", output_arg="encoder_outputs" if s == "encoder" else None)
        for s in stacks
    )


POLICY = register_policy(Policy(name="t5", model_classes=MODEL_CLASSES, make_plan=t5_plan))
