"""Multi-rank behaviour beyond equivalence: exact collective counts, dropout RNG streams, input guards."""

import pytest

import rank_tasks

BASE = {"seq": 6, "batch": 2, "padding": True, "dtype": "float32", "seed": 11,
        "config": {"heads": 4, "head_dim": 4, "layers": 1, "intermediate": 32, "vocab": 50}}


def _spec(cls, tp, layers, labels=True, **config):
    return {**BASE, "cls": cls, "tp": tp, "labels": labels,
            "config": {**BASE["config"], "layers": layers, **config}}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("layers", [1, 3])
def test_collectives_per_bert_layer(pool, tp, layers):
    """Per layer: forward 2 all-reduces (attention output, MLP output), backward 2 (the gradients of the inputs
    entering attention and the MLP). Plus the vocab-parallel embedding's forward all-reduce. Nothing else."""
    counts = pool.run(rank_tasks.collective_counts, _spec("BertModel", tp, layers, labels=False))[0]
    assert counts["forward"] == {"all_reduce": 1 + 2 * layers}
    assert counts["backward"] == {"all_reduce": 2 * layers}


def test_collectives_masked_lm_never_gathers_logits_for_the_loss(pool):
    """MLM with labels: + 2 forward all-reduces in the vocab-parallel cross-entropy (max; target logit and sum of
    exps stacked) and 1 backward all-reduce entering the LM head. No all-gather: logits stay sharded."""
    counts = pool.run(rank_tasks.collective_counts, _spec("BertForMaskedLM", 2, 2))[0]
    assert counts["forward"] == {"all_reduce": 1 + 2 * 2 + 2}
    assert counts["backward"] == {"all_reduce": 2 * 2 + 1}
    assert counts["logits_last_dim"] == 25


def test_inference_logits_are_gathered(pool):
    counts = pool.run(rank_tasks.collective_counts, _spec("BertForMaskedLM", 2, 1, labels=False))[0]
    assert counts["forward"] == {"all_reduce": 3, "all_gather_into_tensor": 1}
    assert counts["logits_last_dim"] == 50


def test_cross_attention_collectives(pool):
    """A decoder layer with cross-attention adds 1 forward all-reduce and 1 backward (the query input; the
    encoder states here are a constant input, so their copy has no gradient to reduce). Without labels the
    logits are gathered (1 all-gather) and the LM head's input copy reduces its gradient (1 all-reduce)."""
    counts = pool.run(rank_tasks.collective_counts,
                      {**_spec("BertLMHeadModel", 2, 1, labels=False, cross_attention=True), "enc_seq": 4})[0]
    assert counts["forward"] == {"all_reduce": 1 + 3, "all_gather_into_tensor": 1}
    assert counts["backward"] == {"all_reduce": 2 + 1 + 1}


@pytest.mark.parametrize("tp", [2, 4])
def test_dropout_keeps_replicated_parameters_identical(pool, tp):
    spec = _spec("BertForMaskedLM", tp, 2, dropout=0.1)
    results = pool.run(rank_tasks.dropout_training_keeps_replicas_identical, spec)
    assert all(r["replicated_checked"] > 10 for r in results)
    # TP ranks of one replica compute the same loss; training moved it
    assert results[0]["losses"] == results[1]["losses"]


def test_divergent_inputs_across_tp_ranks_are_caught(pool):
    messages = pool.run(rank_tasks.divergent_inputs_are_caught, _spec("BertForMaskedLM", 2, 1))
    assert all("input_ids" in m and "differ across the tensor-parallel group" in m for m in messages)


@pytest.mark.parametrize("tp", [2, 4])
def test_collective_mappings_forward_and_backward(pool, tp):
    assert pool.run(rank_tasks.collective_mappings, {"tp": tp, "seed": tp}) == [6] * 4


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_linear_overlapped_in_blocks(pool, tp):
    assert pool.run(rank_tasks.row_linear_blocks, {"tp": tp, "seed": tp}) == [[1, 2, 3]] * 4


T5_SPEC = {"family": "t5", "cls": "T5ForConditionalGeneration", "seq": 6, "dec_seq": 4, "batch": 2, "padding": True,
           "dtype": "float32", "seed": 3, "config": {"vocab": 40, "d_model": 12, "d_kv": 4, "heads": 4, "d_ff": 16,
                                                      "layers": 2, "decoder_layers": 2, "ffn": "gated-gelu"}}
VIT_SPEC = {"family": "vit", "cls": "ViTForImageClassification", "batch": 2, "dtype": "float32", "seed": 3,
            "config": {"image": 8, "patch": 2, "heads": 4, "head_dim": 4, "layers": 2, "intermediate": 32}}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("base", [T5_SPEC, VIT_SPEC], ids=["t5", "vit"])
def test_dropout_keeps_replicated_parameters_identical_t5_vit(pool, tp, base):
    spec = {**base, "tp": tp, "config": {**base["config"], "dropout": 0.1}}
    results = pool.run(rank_tasks.dropout_training_keeps_replicas_identical, spec)
    assert all(r["replicated_checked"] > 5 for r in results)
    assert results[0]["losses"] == results[1]["losses"]


def test_collectives_t5_layers(pool):
    """T5Model with E encoder and D decoder blocks: forward 1 all-reduce per embedding lookup (encoder and decoder)
    + 2 per encoder block (o, wo) + 3 per decoder block (self o, cross o, wo); backward 2 per encoder block (the
    inputs of attention and FFN) + 3 per decoder block (self-attention input, cross-attention query input, FFN
    input; the gated FFN's wi_0 and wi_1 share one) + 1 for the encoder states, which enter the TP region once for
    the whole decoder. The relative bias tables need none."""
    spec = {**T5_SPEC, "cls": "T5Model", "tp": 2, "labels": False,
            "config": {**T5_SPEC["config"], "layers": 2, "decoder_layers": 3}}
    counts = pool.run(rank_tasks.collective_counts, spec)[0]
    assert counts["forward"] == {"all_reduce": 2 + 2 * 2 + 3 * 3}
    assert counts["backward"] == {"all_reduce": 2 * 2 + 3 * 3 + 1}


def test_collectives_vit_layers(pool):
    spec = {**VIT_SPEC, "cls": "ViTModel", "tp": 2, "labels": False}
    counts = pool.run(rank_tasks.collective_counts, spec)[0]
    assert counts["forward"] == {"all_reduce": 2 * 2}
    assert counts["backward"] == {"all_reduce": 2 * 2}


def test_t5_training_never_gathers_logits(pool):
    """T5ForConditionalGeneration with labels: the vocab-parallel cross-entropy adds 2 forward all-reduces and the
    LM head's input copy 1 backward; no all-gather anywhere."""
    spec = {**T5_SPEC, "tp": 2, "config": {**T5_SPEC["config"], "layers": 1, "decoder_layers": 2}}
    counts = pool.run(rank_tasks.collective_counts, spec)[0]
    assert counts["forward"] == {"all_reduce": 2 + 2 * 1 + 3 * 2 + 2}
    assert counts["backward"] == {"all_reduce": 2 * 1 + (3 * 2 + 1) + 1}
    assert counts["logits_last_dim"] == 20
