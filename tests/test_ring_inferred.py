"""Sequence parallelism over sp for models sharded by an inferred plan: the plan lists its attention sites (head
counts, grouped key/value heads, cross-attention's other sequence, rotary position tensors), and RoBERTa (masked
LM, padded) and Llama (grouped KV heads: 4 query, 2 key/value) equal the unsharded model in float64 (outputs, every
gradient, weights after AdamW) under ring attention at sp 2, 4 and tp 2 x sp 2, and under all-to-all where the
heads divide; the plan is proven over the tp x sp groups before use."""

import pytest
import torch

import inference_cases
import ring_inferred_tasks
from shardlib.sharding.inference import infer
from shardlib.sharding.plan import AttentionSite, HeadsOf

ROBERTA = ("roberta", "RobertaForMaskedLM")
LLAMA = ("llama", "LlamaForCausalLM")
LAYOUTS = [(1, 2), (1, 4), (2, 2)]
#: 8 query and 4 key/value heads: tp * sp = 4 divides both (the family's 4 / 2 do not at sp 4 or tp 2 x sp 2)
WIDE_LLAMA = dict(num_attention_heads=8, num_key_value_heads=4)


def _sites(family: str, cls: str):
    inferred = infer(inference_cases.make_model(cls, family, dtype=torch.float32))
    return inferred.plan.attention, inferred.unplaced


def test_inferred_plans_list_their_attention_sites():
    """A head-count attribute where the block holds one (RoBERTa), else heads counted on the projections with the
    grouped key/value heads and the rotary tensors cut per rank (Llama); cross-attention's other sequence (BART);
    none where a block computes attention in its own code (DeBERTa-v2), with the reason."""
    assert _sites(*ROBERTA)[0] == {"roberta.encoder.layer.*.attention.self": AttentionSite("num_attention_heads")}
    assert _sites(*LLAMA)[0] == {"model.layers.*.self_attn": AttentionSite(
        HeadsOf("q_proj", "head_dim"), kv_heads=HeadsOf("k_proj", "head_dim"), positions=("position_embeddings",))}
    bart = _sites("bart", "BartForConditionalGeneration")[0]
    assert bart["model.decoder.layers.*.encoder_attn"] == AttentionSite("num_heads", kv_input="key_value_states")
    assert bart["model.decoder.layers.*.self_attn"] == AttentionSite("num_heads")
    sites, unplaced = _sites("deberta-v2", "DebertaV2ForMaskedLM")
    assert sites == {} and any("not through transformers' attention interface" in u.why for u in unplaced)


@pytest.mark.parametrize("tp,sp", LAYOUTS)
@pytest.mark.parametrize("case", [ROBERTA, LLAMA], ids=["roberta", "llama"])
def test_ring_matches_unsharded(pool, case, tp, sp):
    results = pool.run(ring_inferred_tasks.sp_equivalence, *case, "ring", tp, sp)
    assert all(r["grads"] > 15 and r["weights"] == r["grads"] for r in results), results


def test_ring_without_padding_uses_the_causal_rule(pool):
    """No padding: HF passes Llama's SDPA no mask (causal by ``is_causal``), which the ring follows per block."""
    results = pool.run(ring_inferred_tasks.sp_equivalence, *LLAMA, "ring", 1, 4, False)
    assert all(r["grads"] > 15 for r in results)


@pytest.mark.parametrize("case,tp,sp,config", [
    (ROBERTA, 1, 2, {}), (ROBERTA, 1, 4, {}), (ROBERTA, 2, 2, {}),
    (LLAMA, 1, 2, {}), (LLAMA, 1, 4, WIDE_LLAMA), (LLAMA, 2, 2, WIDE_LLAMA),
], ids=["roberta-1x2", "roberta-1x4", "roberta-2x2", "llama-1x2", "llama8q4kv-1x4", "llama8q4kv-2x2"])
def test_all_to_all_matches_unsharded_where_heads_divide(pool, case, tp, sp, config):
    results = pool.run(ring_inferred_tasks.sp_equivalence, *case, "all_to_all", tp, sp, **config)
    assert all(r["grads"] > 15 for r in results)


@pytest.mark.parametrize("tp,sp", [(1, 4), (2, 2)])
def test_all_to_all_refuses_key_value_heads_it_cannot_split(pool, tp, sp):
    """4 query heads divide over tp * sp = 4, the 2 key/value heads do not: refused with the numbers (the ring
    above runs the same model)."""
    message = pool.run(ring_inferred_tasks.refusal, *LLAMA, "all_to_all", tp, sp)[0]
    assert f"2 key/value heads (k_proj outputs / head_dim) is not divisible by tp({tp}) * sp({sp}) = 4" in message
    assert "query heads" not in message


def test_the_proof_refuses_sites_without_their_rotary_positions(pool):
    """Llama's sites with ``positions`` dropped: the proof over the tp x sp groups refuses the plan before the
    model changes (cos and sin of the whole sequence would meet one rank's chunk of q and k)."""
    result = pool.run(ring_inferred_tasks.positions_dropped_is_refused, "ring", 1, 2)[0]
    assert "does not run at tp=1, sp=2" in result["message"] and "model.layers.0.self_attn" in result["message"]
    assert result["untouched"]


MISTRAL = ("mistral", "MistralForCausalLM")


@pytest.mark.parametrize("tp,sp,padded", [(1, 2, True), (1, 4, True), (1, 4, False), (2, 2, True)])
def test_ring_computes_a_sliding_window(pool, tp, sp, padded):
    """Mistral with a window of 3 over 7 tokens (every query past the third loses keys): the window is part of the
    mask the ring computes, as data where the builder describes it."""
    results = pool.run(ring_inferred_tasks.sp_equivalence, *MISTRAL, "ring", tp, sp, padded, sliding_window=3)
    assert all(r["grads"] > 15 for r in results), results
    assert all(r["masks"].get("data") and len(r["masks"]) == 1 for r in results), results[0]["masks"]

