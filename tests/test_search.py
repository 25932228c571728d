"""The cost model's inputs, checked against real runs, and the layout search (shardlib.analysis.search): the dry
run's activation term equals what a real gloo step saves for backward; the layer table's reports equal the dry
run's; the search returns only layouts the Trainer accepts; bad input gets one line. Rank tasks in
plan_tasks.py."""

from __future__ import annotations

import pytest

import plan_tasks
import shardlib
from rank_tasks import cases
from test_train import BERT, T5

EXACT = [
    ("bert-tp2", BERT, {"dp": 2, "tp": 2}, {}),
    ("bert-pp2-tp2", BERT, {"dp": 1, "pp": 2, "tp": 2}, {}),
    ("bert-megatron-sp", BERT, {"dp": 2, "tp": 2}, {"sequence_parallel": "megatron"}),
    ("bert-all-to-all", BERT, {"dp": 2, "sp": 2}, {"sequence_parallel": "all_to_all"}),
    ("t5-pp2-tp2", T5, {"dp": 1, "pp": 2, "tp": 2}, {}),
]


@pytest.mark.parametrize("family, layout, shard", [c[1:] for c in EXACT], ids=[c[0] for c in EXACT])
def test_activation_term_equals_what_a_real_step_saves(pool, family, layout, shard):
    """One Trainer.train_step on 4 gloo ranks saves, on every rank, exactly the bytes the dry run of its stage
    counts per microbatch (the activation term of the memory prediction), times the microbatches (pipelines: 2)."""
    microbatches = layout.get("pp", 1)
    spec = {**family, "layout": layout, "shard": shard, "batch": 4, "seq": 8, "microbatches": microbatches}
    ranks = pool.run(plan_tasks.saved_in_a_step, spec)
    report = shardlib.plan(cases(spec).make_model(spec), tp=layout.get("tp", 1), pp=layout.get("pp", 1),
                           dp=layout["dp"], sp=layout.get("sp", 1),
                           sequence_parallel=shard.get("sequence_parallel", False), batch=4, seq=8)
    for rank in ranks:
        expected = microbatches * report.stages[rank["stage"]].memory.activation_bytes
        assert rank["saved"] == expected, (rank, expected)
