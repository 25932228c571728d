"""The policy-authoring guide's worked example (a RoBERTa policy written as data) computes what RoBERTa does."""

import pytest

import rank_tasks


@pytest.mark.parametrize("tp, vocab", [(2, 51), (4, 64)])
def test_roberta_policy_example(pool, tp, vocab):
    for compared in pool.run(rank_tasks.roberta_example_equivalence, {"tp": tp, "vocab": vocab, "seed": 5}):
        assert compared["grads"] > 20
