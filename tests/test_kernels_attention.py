"""The attention kernel switch (``Kernels(attention=...)``): PyTorch SDPA through transformers' attention interface
against the models' own eager attention (the reference), unsharded in one process and sharded over real ranks
(local heads under tensor parallelism, all-to-all sequence parallelism). float32 tolerances of rank_tasks.py: SDPA
fuses scale, mask, softmax and the two matmuls, so it rounds differently (and ViT's eager softmax runs in float32)."""

import copy

import pytest
import torch

import bert_cases
import rank_tasks
import t5_cases
import vit_cases
from shardlib.kernels.attention import set_attention

SPECS = [
    (bert_cases, {"cls": "BertLMHeadModel", "seq": 7, "enc_seq": 5, "batch": 2, "padding": True, "seed": 3,
                  "config": {"heads": 4, "head_dim": 8, "layers": 2, "intermediate": 32, "vocab": 41,
                             "cross_attention": True}}),
    (bert_cases, {"cls": "BertForMaskedLM", "seq": 9, "batch": 3, "padding": True, "seed": 4,
                  "config": {"heads": 4, "head_dim": 8, "layers": 2, "intermediate": 32, "vocab": 41}}),
    (vit_cases, {"family": "vit", "cls": "ViTForImageClassification", "batch": 2, "seed": 5,
                 "config": {"image": 8, "patch": 2, "heads": 4, "head_dim": 8, "layers": 2, "intermediate": 32}}),
    (t5_cases, {"family": "t5", "cls": "T5ForConditionalGeneration", "seq": 7, "dec_seq": 6, "batch": 2,
                "padding": True, "seed": 6, "config": {"vocab": 37, "d_model": 16, "d_kv": 4, "heads": 4, "d_ff": 16,
                                                       "layers": 2, "decoder_layers": 2}}),
]
IDS = [spec["cls"] for _, spec in SPECS]


@pytest.mark.parametrize("family,spec", SPECS, ids=IDS)
def test_sdpa_matches_eager_reference_unsharded(family, spec):
    eager = family.make_model(spec)
    set_attention(eager, "eager")
    sdpa = copy.deepcopy(eager)
    set_attention(sdpa, "sdpa")
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    batch = family.make_batch(spec, eager.config)
    rank_tasks.compare_training_step(eager, sdpa, batch, torch.float32)


@pytest.mark.parametrize("family,spec", SPECS, ids=IDS)
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "sp": "all_to_all", "sp_size": 2}], ids=["tp2", "tp2-sp2"])
def test_sharded_sdpa_matches_unsharded_eager(pool, family, spec, layout):
    full = {**spec, **layout, "dtype": "float32", "kernels": {"attention": "sdpa"}, "reference_attention": "eager"}
    results = pool.run(rank_tasks.equivalence, full)
    assert all(r["grads"] > 10 for r in results)
