"""Property-based equivalence of sharded BERT (every class) with the unsharded model, on 4 real gloo ranks."""

import pytest
from hypothesis import given

import rank_tasks
from strategies import bert_specs
from bert_cases import CLASSES


@given(spec=bert_specs())
def test_sharded_bert_matches_unsharded(pool, spec):
    results = pool.run(rank_tasks.equivalence, spec)
    for compared in results:
        assert compared["outputs"] >= 1 and compared["grads"] >= 1 and compared["weights"] >= compared["grads"]


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("tp", [2, 4])
def test_every_bert_class_float32(pool, cls, tp):
    """Each class at least once per tp with a fixed mid-sized config, regardless of what hypothesis draws."""
    spec = {"cls": cls, "tp": tp, "seq": 7, "batch": 2, "padding": True, "dtype": "float32", "seed": 7,
            "enc_seq": 5, "config": {"heads": 4, "head_dim": 8, "layers": 2, "intermediate": 64, "vocab": 97,
                                     "tie": True, "cross_attention": True, "num_labels": 3}}
    pool.run(rank_tasks.equivalence, spec)


def test_bert_base_vocab_30522_at_tp4(pool):
    spec = {"cls": "BertForMaskedLM", "tp": 4, "seq": 6, "batch": 2, "padding": True, "dtype": "float32",
            "seed": 3, "config": {"heads": 4, "head_dim": 2, "layers": 1, "intermediate": 16, "vocab": 30522}}
    results = pool.run(rank_tasks.sharded_logits_with_labels, spec)
    # 30522 padded to 30524: 7631 rows per rank, the last rank holds 7629 real ones and 2 padding rows
    assert [r["local_vocab"] for r in results] == [7631] * 4
    assert [r["valid"] for r in results] == [7631, 7631, 7631, 7629]
    pool.run(rank_tasks.equivalence, {**spec, "meta": True})
