"""Sequence parallelism (Megatron, on the TP group): exact collective counts per layer, per-rank dropout streams,
the refusal under pipeline stages. Equivalence with the unsharded model (outputs, every gradient, weights after
AdamW, sequence lengths tp does not divide) is part of the BERT / ViT / T5 hypothesis properties, which draw
``sp`` on and off, and of the fixed cases below."""

import pytest

import rank_tasks
from test_tp_behaviour import T5_SPEC, VIT_SPEC, _spec

#: shardlib's reduce-scatter as gloo runs it: an all-to-all and a local sum (shardlib.parallel.collectives)
RS = "all_to_all_single"
ALL_KERNELS = {"attention": "sdpa", "fused_qkv": True, "bias_gelu": True, "dropout_add": True}


@pytest.mark.parametrize("kernels", [{}, ALL_KERNELS], ids=["stock", "all-kernels"])
@pytest.mark.parametrize("tp", [2, 4])
def test_sp_collectives_per_bert_layer(pool, tp, kernels):
    """Per layer, all-gather + reduce-scatter instead of all-reduce at both region boundaries: forward 2 all-gathers
    (attention and MLP inputs) and 2 reduce-scatters (their outputs); backward the transposes, plus the 2 inputs
    all-gathered again from their saved shards (Megatron's trade: saved activations stay 1/tp), plus one
    all-reduce of the layer's replicated parameters (2 LayerNorms x 2 + 2 row-parallel biases = 6 gradients in one
    bucket, shardlib.parallel.gradsync). The stack's
    entry keeps a chunk (no communication; backward all-gather), its exit all-gathers (backward keeps a chunk).
    The vocab-parallel embedding keeps its all-reduce. The fused kernels change no collective."""
    layers = 2
    spec = {**_spec("BertModel", tp, layers, labels=False), "sp": True, "kernels": kernels}
    counts = pool.run(rank_tasks.collective_counts, spec)[0]
    assert counts["forward"] == {"all_reduce": 1, "all_gather_into_tensor": 2 * layers + 1,
                                 RS: 2 * layers}
    assert counts["backward"] == {"all_reduce": layers, "all_gather_into_tensor": 4 * layers + 1,
                                  RS: 2 * layers}


def test_sp_collectives_t5(pool):
    """T5Model, E encoder / D decoder blocks: per encoder block 2 all-gathers + 2 reduce-scatters, per decoder block
    3 + 3 (self-attention, cross-attention query, FFN); entry/exit per stack; backward: the transposes, the
    region inputs gathered again from their saved shards, one all-reduce per block for its sublayer norms (one
    bucket: 2 norms per encoder block, 3 per decoder block) and one for the replicated encoder states, which enter
    the TP region once for the whole decoder. No biases in T5."""
    e, d = 2, 3
    spec = {**T5_SPEC, "cls": "T5Model", "tp": 2, "labels": False, "sp": True, "seq": 7,
            "config": {**T5_SPEC["config"], "layers": e, "decoder_layers": d}}
    counts = pool.run(rank_tasks.collective_counts, spec)[0]
    assert counts["forward"] == {"all_reduce": 2, "all_gather_into_tensor": 2 * e + 3 * d + 2,
                                 RS: 2 * e + 3 * d}
    assert counts["backward"] == {"all_reduce": e + d + 1, "all_gather_into_tensor": 2 * (2 * e + 3 * d) + 2,
                                  RS: 2 * e + 3 * d}


def test_sp_collectives_vit(pool):
    spec = {**VIT_SPEC, "cls": "ViTModel", "tp": 2, "labels": False, "sp": True}
    counts = pool.run(rank_tasks.collective_counts, spec)[0]
    assert counts["forward"] == {"all_gather_into_tensor": 2 * 2 + 1, RS: 2 * 2}
    assert counts["backward"] == {"all_reduce": 2, "all_gather_into_tensor": 4 * 2 + 1,
                                  RS: 2 * 2}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("base", ["bert", T5_SPEC, VIT_SPEC], ids=["bert", "t5", "vit"])
def test_sp_dropout_keeps_replicated_parameters_identical(pool, tp, base):
    """Dropout on sequence-sharded activations draws per-rank masks, yet LayerNorm weights and the other replicated
    parameters stay bitwise identical across the TP group after several AdamW steps (their gradients are summed)."""
    if base == "bert":
        spec = {**_spec("BertForMaskedLM", tp, 2, dropout=0.1), "sp": True, "seq": 7}
    else:
        spec = {**base, "tp": tp, "sp": True, "config": {**base["config"], "dropout": 0.1}}
    results = pool.run(rank_tasks.dropout_training_keeps_replicas_identical, spec)
    assert all(r["replicated_checked"] > 5 for r in results)
    assert results[0]["losses"] == results[1]["losses"]


@pytest.mark.parametrize("mode", ["megatron", "all_to_all"])
def test_bucketed_gradients_accumulate_over_plain_backwards(pool, mode):
    """Two ``loss.backward()`` calls without zeroing: each reduces only its own contribution, so every gradient
    equals the unsharded sum (the replicated parameters' buckets finish in an end-of-backward callback). A bucket's
    flat copy is settled when the next one starts: none is alive then (every layer's was, until backward's end)."""
    spec = {**_spec("BertForMaskedLM", 2 if mode == "megatron" else 1, 2), "sp": True if mode == "megatron" else "all_to_all",
            "sp_size": 2, "dtype": "float64"}
    for compared, starts, alive in pool.run(rank_tasks.accumulated_gradients, spec):
        assert compared > 20 and starts >= 4  # two layers' buckets, two backwards
        assert alive == 0


FIXED = [
    {"cls": "BertForMaskedLM", "config": {"heads": 4, "head_dim": 8, "layers": 2, "intermediate": 64, "vocab": 97}},
    {"cls": "BertLMHeadModel", "config": {"heads": 4, "head_dim": 8, "layers": 2, "intermediate": 64, "vocab": 97,
                                          "cross_attention": True}},
    {"family": "vit", "cls": "ViTForImageClassification",
     "config": {"image": 8, "patch": 4, "heads": 4, "head_dim": 8, "layers": 2, "intermediate": 64, "num_labels": 5}},
    {"family": "vit", "cls": "ViTForMaskedImageModeling",
     "config": {"image": 8, "patch": 2, "heads": 4, "head_dim": 8, "layers": 2, "intermediate": 64}},
    {"family": "t5", "cls": "T5ForConditionalGeneration",
     "config": {"vocab": 53, "d_model": 16, "d_kv": 4, "heads": 4, "d_ff": 16, "layers": 2, "decoder_layers": 2}},
    {"family": "t5", "cls": "UMT5ForConditionalGeneration",
     "config": {"vocab": 53, "d_model": 16, "d_kv": 4, "heads": 4, "d_ff": 16, "layers": 2, "decoder_layers": 2,
                "ffn": "gated-gelu"}},
]


@pytest.mark.parametrize("seq", [4, 7])  # divisible by tp, and padded
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", FIXED, ids=[c["cls"] for c in FIXED])
def test_sp_matches_unsharded(pool, case, tp, seq):
    spec = {"tp": tp, "seq": seq, "dec_seq": seq - 1, "enc_seq": 5, "batch": 2, "padding": True, "dtype": "float32",
            "seed": 5, "sp": True, **case}
    results = pool.run(rank_tasks.equivalence, spec)
    assert all(r["grads"] > 10 for r in results)


@pytest.mark.parametrize("case", FIXED[::2], ids=[c["cls"] for c in FIXED[::2]])
def test_sp_on_a_meta_built_model_loaded_afterwards(pool, case):
    """Built on the meta device, sharded, then loaded: the loaded parameters are new objects and still get their
    gradients summed over the TP group (a hook on the meta parameters would be lost)."""
    spec = {"tp": 2, "seq": 7, "dec_seq": 5, "enc_seq": 5, "batch": 2, "padding": True, "dtype": "float32",
            "seed": 6, "sp": True, "meta": True, **case}
    pool.run(rank_tasks.equivalence, spec)


@pytest.mark.parametrize("sp", [True, "all_to_all"], ids=["megatron", "all-to-all"])
def test_forward_without_backward_leaks_nothing(pool, sp):
    spec = {"tp": 2, "seq": 7, "batch": 2, "padding": True, "dtype": "float32", "seed": 5, "sp": sp, "sp_size": 2,
            **FIXED[0]}
    assert all(pool.run(rank_tasks.forward_without_backward_frees_graph, spec))
