"""The cost model's inputs, checked against real runs, and the layout search (shardlib.analysis.search): the dry
run's activation term equals what a real gloo step saves for backward; the layer table's reports equal the dry
run's; the search returns only layouts the Trainer accepts; bad input gets one line. Rank tasks in
plan_tasks.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

import plan_tasks
import shardlib
from rank_tasks import cases
from shardlib.analysis.layertable import LayerTable
from shardlib.analysis.layout import Layout
from shardlib.analysis.metarun import meta_model
from shardlib.analysis.search import MODES
from shardlib.policies import policy_for
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


# ------------------------------------------------------------------------------------------- the layer table
TABLE_LAYOUTS = [
    Layout(dp=2, tp=2, batch=3),
    Layout(dp=2, pp=2, batch=2, microbatches=2),
    Layout(dp=1, pp=2, tp=2, sequence_parallel="megatron", batch=3, microbatches=2),
    Layout(dp=2, sp=2, sequence_parallel="all_to_all", batch=4),
]


@pytest.mark.parametrize("family", ["bert", "t5"])
@pytest.mark.parametrize("layout", TABLE_LAYOUTS, ids=[la.name() for la in TABLE_LAYOUTS])
def test_layer_table_reports_equal_the_dry_run(family, layout):
    """The reports the search assembles from a two-layer copy of the model (LayerTable) hold the dry run's bytes
    (parameters, gradients, AdamW, ZeRO: the largest rank's) and FLOPs exactly for a 4-layer model, at a
    microbatch size neither of the table's own. Unpipelined, also every collective and the saved activations (1%
    under all-to-all);
    pipelined, what the cut adds is estimated (the sequence-parallel gathers at a boundary, a stage's own masks):
    collectives within 10%, activations within 5%. The transient peak and the traffic, estimates, within 35%."""
    spec = {**{"bert": BERT, "t5": T5}[family], "seq": 8}
    spec["config"] = {**spec["config"], "layers": 4, "decoder_layers": 4}
    model = cases(spec).make_model(spec)
    full = meta_model(model)
    table = LayerTable(full, policy_for(full), tp=layout.tp, sp=layout.sp, mode=MODES[layout.sequence_parallel],
                       mode_name=layout.sequence_parallel, activation_checkpointing=False, seq=8)
    assembled = table.report(replace(layout, seq=8))
    exact = shardlib.plan(model, tp=layout.tp, pp=layout.pp, dp=layout.dp, sp=layout.sp,
                          sequence_parallel=MODES[layout.sequence_parallel], batch=layout.batch, seq=8)
    pipelined = layout.pp > 1
    for a, e in zip(assembled.stages, exact.stages, strict=True):
        assert (a.parameter_bytes, a.gradient_bytes, a.optimizer_bytes) == (
            e.parameter_bytes, e.gradient_bytes, e.optimizer_bytes)
        assert [(z.zero, max(z.parameters), max(z.gradients), max(z.optimizer)) for z in a.zero] == \
            [(z.zero, max(z.parameters), max(z.gradients), max(z.optimizer)) for z in e.zero]
        assert sum(w.flops for w in a.work) == sum(w.flops for w in e.work)
        assert [(c.op, c.bytes) for c in a.step] == [(c.op, c.bytes) for c in e.step if c.dim != "dp"]
        collectives = [sorted((c.op, c.dim, c.bytes) for x in r.collectives for c in x.collectives) for r in (a, e)]
        if pipelined:
            assert sum(c[2] for c in collectives[0]) == pytest.approx(sum(c[2] for c in collectives[1]), rel=0.1)
            assert a.memory.activation_bytes == pytest.approx(e.memory.activation_bytes, rel=0.05)
        else:
            assert collectives[0] == collectives[1]
            assert a.memory.activation_bytes == pytest.approx(  # all-to-all: one buffer of 512 B per model
                e.memory.activation_bytes, rel=0.01 if layout.sequence_parallel == "all_to_all" else 0)
        assert a.memory.peak_bytes == pytest.approx(e.memory.peak_bytes, rel=0.35)
        assert sum(w.traffic for w in a.work) == pytest.approx(sum(w.traffic for w in e.work), rel=0.35)
