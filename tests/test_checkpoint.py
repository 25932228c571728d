"""Checkpoints: HF -> shards, sharded save, reshard, export to HF, on 4 gloo ranks; bad input, single process."""

import pytest
from hypothesis import given, settings, strategies as st

import rank_tasks

BERT = {"family": "bert", "cls": "BertForMaskedLM", "seq": 6, "batch": 2, "dtype": "float32", "seed": 1,
        "config": {"heads": 4, "head_dim": 4, "layers": 2, "intermediate": 32, "vocab": 51}}
VIT = {"family": "vit", "cls": "ViTForImageClassification", "batch": 2, "dtype": "float32", "seed": 2,
       "config": {"image": 8, "patch": 2, "heads": 4, "head_dim": 4, "layers": 2, "intermediate": 32}}
T5 = {"family": "t5", "cls": "T5ForConditionalGeneration", "seq": 6, "dec_seq": 4, "batch": 2, "dtype": "float32",
      "seed": 3, "config": {"vocab": 45, "d_model": 12, "d_kv": 4, "heads": 4, "d_ff": 16, "layers": 2,
                             "ffn": "gated-gelu"}}


@pytest.mark.parametrize("base", [BERT, VIT, T5], ids=["bert", "vit", "t5"])
@pytest.mark.parametrize("tp_a, tp_b", [(2, 4), (4, 2), (1, 4), (2, 1)])
def test_round_trip_reshard_export(pool, tmp_path, base, tp_a, tp_b):
    results = pool.run(rank_tasks.checkpoint_round_trip, {**base, "tp_a": tp_a, "tp_b": tp_b}, str(tmp_path))
    assert results[0]["tensors"] > 10


def test_export_in_several_shards(pool, tmp_path):
    pool.run(rank_tasks.checkpoint_round_trip, {**BERT, "tp_a": 2, "tp_b": 2, "max_shard_bytes": 4096},
             str(tmp_path))
    assert len(list((tmp_path / "export").glob("model-0000*-of-*.safetensors"))) > 3
    assert (tmp_path / "export" / "model.safetensors.index.json").exists()
