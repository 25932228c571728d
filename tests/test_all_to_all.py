"""All-to-all (Ulysses) sequence parallelism on the mesh's sp dimension: equality with the unsharded model (outputs,
every gradient, weights after AdamW) for BERT (incl. the cross-attention decoder), ViT and T5 / UMT5 (relative
position bias, cross-attention), alone and with tensor parallelism, sequence lengths sp does and does not divide;
exact collective counts per layer; per-rank dropout with identical replicas. The hypothesis properties of all
three families draw it too (tests/strategies.py); the refusals are in test_validation.py."""

import pytest

import rank_tasks

BERT = {"cls": "BertForMaskedLM", "config": {"heads": 4, "head_dim": 4, "layers": 2, "intermediate": 24, "vocab": 41}}
BERT_CROSS = {"cls": "BertLMHeadModel", "enc_seq": 5, "config": {**BERT["config"], "cross_attention": True}}
VIT = {"family": "vit", "cls": "ViTForImageClassification",
       "config": {"image": 8, "patch": 2, "heads": 4, "head_dim": 4, "layers": 2, "intermediate": 24, "num_labels": 3}}
VIT_MIM = {"family": "vit", "cls": "ViTForMaskedImageModeling",
           "config": {"image": 8, "patch": 4, "heads": 4, "head_dim": 4, "layers": 2, "intermediate": 24}}
T5 = {"family": "t5", "cls": "T5ForConditionalGeneration", "dec_seq": 6,
      "config": {"vocab": 37, "d_model": 16, "d_kv": 4, "heads": 4, "d_ff": 16, "layers": 2, "decoder_layers": 2}}
UMT5 = {"family": "t5", "cls": "UMT5ForConditionalGeneration", "dec_seq": 5,
        "config": {**T5["config"], "ffn": "gated-gelu"}}
CASES = [BERT, BERT_CROSS, VIT, VIT_MIM, T5, UMT5]


def _spec(case, tp, sp, seq=7, **extra):
    return {"tp": tp, "sp": "all_to_all", "sp_size": sp, "seq": seq, "batch": 2, "padding": True,
            "dtype": "float32", "seed": 11, **case, **extra}


@pytest.mark.parametrize("tp,sp", [(1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("case", CASES, ids=[c["cls"] for c in CASES])
def test_all_to_all_matches_unsharded(pool, case, tp, sp):
    # seq 7 (BERT) / 17 and 5 tokens (ViT with CLS): never divisible by sp, so padding is always exercised
    results = pool.run(rank_tasks.equivalence, _spec(case, tp, sp))
    assert all(r["grads"] > 10 for r in results)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_all_to_all_divisible_length_and_both_attention_implementations(pool, attention):
    pool.run(rank_tasks.equivalence, _spec(BERT, 1, 4, seq=8, kernels={"attention": attention}))
    pool.run(rank_tasks.equivalence, _spec(VIT, 2, 2, dtype="float64", kernels={"attention": attention}))


def test_all_to_all_on_a_meta_built_model_loaded_afterwards(pool):
    pool.run(rank_tasks.equivalence, _spec(BERT, 2, 2, meta=True))


def test_all_to_all_collectives_per_layer(pool):
    """Per layer forward: one all-to-all of q, k, v (one message), one of the attention output; backward the two
    inverse all-to-alls, the output exchanged again for the output projection's saved input (kept as the
    attention's own output: 1/sp memory), and one all-reduce of the layer's parameter gradients (every parameter is
    replicated over sp and saw only this rank's tokens: BERT's 16 = q, k, v, o, two MLP linears (weight + bias
    each) and two LayerNorms, in one bucket, shardlib.parallel.gradsync). The stack entry keeps a chunk (backward: one
    all-gather), its exit all-gathers."""
    layers = 2
    spec = _spec({**BERT, "cls": "BertModel", "labels": False}, 1, 4)
    counts = pool.run(rank_tasks.collective_counts, spec)[0]
    assert counts["forward"] == {"all_to_all_single": 2 * layers, "all_gather_into_tensor": 1}
    assert counts["backward"] == {"all_to_all_single": 3 * layers, "all_reduce": layers,
                                  "all_gather_into_tensor": 1}


@pytest.mark.parametrize("case", [BERT, T5], ids=["bert", "t5"])
def test_all_to_all_dropout_keeps_replicas_identical(pool, case):
    spec = _spec({**case, "config": {**case["config"], "dropout": 0.1}}, 1, 2)
    results = pool.run(rank_tasks.dropout_training_keeps_replicas_identical, spec)
    assert all(r["replicated_checked"] > 5 for r in results)


@pytest.mark.parametrize("a,b", [((2, 2), (4, 1)), ((1, 4), (2, 2)), ((1, 1), (1, 2))], ids=str)
def test_checkpoints_across_all_to_all_layouts(pool, tmp_path, a, b):
    """HF -> sharded under (tp, sp) layout a -> save -> load under layout b -> export: bitwise equal weights; the sp
    ranks of a layout hold the same shards, and only one of them writes."""
    spec = {**BERT, "seq": 6, "batch": 2, "dtype": "float32", "seed": 1, "tp_a": a[0], "sp_a": a[1], "tp_b": b[0],
            "sp_b": b[1]}
    results = pool.run(rank_tasks.checkpoint_round_trip, spec, str(tmp_path))
    assert results[0]["tensors"] > 10
    assert sum(r["wrote"] for r in results) == a[0]  # one writer per tensor-parallel rank
