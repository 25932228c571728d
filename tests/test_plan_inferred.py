"""The planner for every family ``shard()`` shards by an inferred plan (issue 36): the dry run resolves the plan as
``shard()`` does (the registered policy, else the inferred one), so each family of the inference coverage table
(``inference_cases.FAMILIES``) is planned at tp=2, a decoder with grouped key/value heads is planned at pp and SP
and searched (layouts whose tp does not divide its key/value heads refused with shard()'s reason), and a model
that can be neither found nor inferred gets shard()'s refusal."""

from __future__ import annotations

import pytest
import torch
import transformers

import inference_cases
import shardlib
from profiles import CI
from shardlib.analysis.metarun import PlanInputError
from shardlib.analysis.search import search

#: one class per family in the dev profile (every class in CI's)
CASES = [case for i, case in enumerate(inference_cases.CASES)
         if CI or case[0] not in {c[0] for c in inference_cases.CASES[:i]}]


def _config(family: str, cls: str):
    return inference_cases.make_model(cls, family, dtype=torch.float32).config


#: heads whose forward reads values (BART's eos pooling: unique_consecutive; DeBERTa-v2's: nonzero), which the meta
#: device cannot run: refused in one message naming the class and the op (each family's other classes plan)
META_LIMITS = {"BartForSequenceClassification", "PLBartForSequenceClassification",
               "DebertaV2ForSequenceClassification"}


@pytest.mark.parametrize("family,cls", CASES, ids=[c for _, c in CASES])
def test_every_inferred_family_is_planned_at_tp2(family, cls):
    """The dry run at tp=2 of every family's class: the inferred policy, each rank holding less than the model."""
    if cls in META_LIMITS:
        with pytest.raises(PlanInputError, match=f"{cls} cannot run on the meta device, so it cannot be planned: "):
            shardlib.plan(_config(family, cls), cls=cls, tp=2, batch=2, seq=8)
        return
    report = shardlib.plan(_config(family, cls), cls=cls, tp=2, batch=2, seq=8)
    assert report.policy == "inferred" and report.model_class == cls
    stage = report.stages[0]
    assert 0 < stage.parameter_bytes < report.sharding.unsharded_bytes, (stage.parameter_bytes,
                                                                         report.sharding.unsharded_bytes)
    assert any(c.op == "all_reduce" for layer in stage.collectives for c in layer.collectives)


def _llama():
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                                    tie_word_embeddings=True, architectures=["LlamaForCausalLM"])


def test_a_causal_lm_is_planned_at_pp_and_sp_with_its_own_batch():
    """A Llama (grouped key/value heads, tied embeddings) at pp=2 x tp=2 with Megatron SP: two stages, a causal LM's
    batch (the labels are the inputs, with a mask)."""
    report = shardlib.plan(_llama(), tp=2, pp=2, sequence_parallel=True, batch=2, seq=8)
    assert report.policy == "inferred" and len(report.stages) == 2
    assert set(report.inputs) == {"input_ids", "attention_mask", "labels"}
    assert report.inputs["labels"].shape == report.inputs["input_ids"].shape == (2, 8)


def test_the_search_refuses_a_tp_that_does_not_divide_the_key_value_heads():
    result = search(_llama(), 4, global_batch=8, seq=16)
    assert result.ranked and all(p.layout.tp in (1, 2) for p in result.ranked + result.over_budget)
    refused = dict(result.refused)
    assert any("2 key/value heads" in why and "not divisible by tp=4" in why for why in refused.values()), refused


def test_a_model_that_can_be_neither_found_nor_inferred_gets_shards_refusal():
    """No policy, and no attention to infer one from: both reasons, not a bare 'pass policy=' advice."""
    config = transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32,
                                         architectures=["ConvNextForImageClassification"])
    with pytest.raises(PlanInputError, match="no shardlib policy for model class ConvNextForImageClassification;"
                                             ".* and its plan cannot be inferred .*no attention") as refused:
        shardlib.plan(config, tp=2, batch=2)
    assert "Pass policy=" not in str(refused.value)
