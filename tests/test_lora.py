"""LoRA through peft (issue 28): ``shard()`` takes a ``PeftModel``; every LoRA-wrapped linear is sharded with its
adapter (column base: ``lora_B`` split like the output, ``lora_A`` replicated; row base: ``lora_A`` split like the
input, ``lora_B`` replicated, joined before the all-reduce), equal to the unsharded peft model in float64 at tp=2 and
tp=4, with sequence parallelism, and under ``fit`` at dp2 x tp2 (resumed too) and pp2 x tp2; adapter dropout on the right stream; the adapter
saved in peft's format and loaded back into a sharded model; what cannot be sharded refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

import lora_tasks  # noqa: E402

CASES = [
    ("bert", "BertForSequenceClassification", 2, False),
    ("bert", "BertForMaskedLM", 4, False),
    ("bert", "BertForTokenClassification", 2, True),
    ("vit", "ViTForImageClassification", 2, False),
    ("vit", "ViTForImageClassification", 4, True),
    ("t5", "T5ForConditionalGeneration", 2, False),
    ("t5", "T5ForSequenceClassification", 4, False),
    ("t5", "T5ForConditionalGeneration", 2, True),
]


@pytest.mark.parametrize("family,cls,tp,sp", CASES, ids=[f"{c}-tp{tp}{'-sp' if sp else ''}" for _, c, tp, sp in CASES])
def test_lora_model_equals_unsharded(pool, family, cls, tp, sp):
    spec = {"family": family, "cls": cls, "tp": tp, "sp": sp, "dtype": "float64", "batch": 2, "seq": 6, "seed": 0,
            "config": lora_tasks.CONFIGS[family]}
    results = pool.run(lora_tasks.lora_equivalence, spec)
    for compared in results:
        assert compared["outputs"] and compared["grads"] >= 8 and compared["weights"], compared
        assert compared["adapted"] >= 4, compared  # LoRA layers sharded with their base, not left whole


def test_adapter_dropout_draws_from_the_stream_of_its_activations(pool):
    assert pool.run(lora_tasks.lora_dropout_streams, 2) == [{"query": True, "attention.output.dense": True}] * 4


def test_fit_then_save_in_peft_format_and_load_back(pool, tmp_path):
    results = pool.run(lora_tasks.lora_fit, str(tmp_path))
    assert results[0]["steps"] == 4
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(results[0]["files"])
    refused = results[0]["refused"]  # the adapter loaded into a model with another LoraConfig (r=8, not 4)
    assert "adapter_model.safetensors" in refused and "lora_A.weight: shape (4, 16)" in refused, refused


def test_what_cannot_be_sharded_is_refused_by_name(pool):
    dora, embedding, bias = pool.run(lora_tasks.lora_refusals)[0]
    assert "peft.tuners.lora" in dora and "LoRA variant" in dora and "query" in dora
    assert "word_embeddings" in embedding and "peft.tuners.lora.layer.Embedding" in embedding
    assert "lora_bias" in bias and "output.dense" in bias


@pytest.mark.parametrize("mode", ["all_to_all", "ring"])
def test_lora_on_the_sp_dimension_with_tp_is_refused(mode):
    """On the sp dimension every layer gradient is summed over sp; an adapter's partial gradients would need one
    sum over tp and sp together: refused (offline mesh, before anything changes) for both modes."""
    import shardlib
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertModel

    from shardlib.parallel.mesh import OfflineMesh

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    model = get_peft_model(BertModel(config), LoraConfig(r=2, target_modules=["query"]))
    with pytest.raises(shardlib.PlanError, match=f"LoRA adapters with sequence_parallel='{mode}' need tp=1"):
        shardlib.shard(model, OfflineMesh(tp=2, sp=2), sequence_parallel=mode)


def test_lora_on_a_family_sharded_by_an_inferred_plan(pool):
    for result in pool.run(lora_tasks.lora_on_an_inferred_plan):
        assert result["policy"] == "inferred" and result["grads"] >= 8 and result["weights"], result
