"""The cost model's inputs, checked against real runs, and the layout search (shardlib.analysis.search): the dry
run's activation term equals what a real gloo step saves for backward; the layer table's reports equal the dry
run's; the search returns only layouts the Trainer accepts; bad input gets one line. Rank tasks in
plan_tasks.py."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

import plan_tasks
import shardlib
from shardlib import cli
from rank_tasks import cases
from shardlib.analysis.layertable import LayerTable
from shardlib.analysis.layout import Layout
from shardlib.analysis.metarun import meta_model
from shardlib.analysis.dryrun_report import size_text
from shardlib.analysis.profile import default_profile
from shardlib.analysis.search import MODES, no_fit_message, search
from shardlib.policies import policy_for
from profiles import CI, ci_only
from test_train import BERT, T5

EXACT = [
    pytest.param(BERT, {"dp": 2, "tp": 2}, {}, id="bert-tp2"),
    pytest.param(BERT, {"dp": 1, "pp": 2, "tp": 2}, {}, id="bert-pp2-tp2"),
    pytest.param(BERT, {"dp": 2, "tp": 2}, {"sequence_parallel": "megatron"}, id="bert-megatron-sp",
                 marks=ci_only("about 6 s: Megatron SP's saved shards")),
    pytest.param(BERT, {"dp": 2, "sp": 2}, {"sequence_parallel": "all_to_all"}, id="bert-all-to-all"),
    pytest.param(BERT, {"dp": 2, "sp": 2}, {"sequence_parallel": "ring"}, id="bert-ring"),
    pytest.param(BERT, {"dp": 1, "sp": 4}, {"sequence_parallel": "ring", "ulysses": 2}, id="bert-ulysses"),
    pytest.param(T5, {"dp": 2, "sp": 2}, {"sequence_parallel": "ring"}, id="t5-ring",
                 marks=[ci_only("about 5 s: T5's relative bias per distance in the ring"),
                        pytest.mark.xfail(strict=False, reason="masks as data: a padded T5 step under the ring saves "
                                          "other bytes than the dry run, which runs unpadded on meta (dense "
                                          "fallback); the activation term is not yet re-derived for it")]),
    pytest.param({"family": "inferred", "model": "llama", "cls": "LlamaForCausalLM", "seed": 2, "dtype": "float32",
                  "config": {"num_key_value_heads": 2}}, {"dp": 2, "sp": 2}, {"sequence_parallel": "ring"},
                 id="llama-ring", marks=ci_only("about 5 s: grouped K/V and causal pieces by an inferred plan")),
    pytest.param(T5, {"dp": 1, "pp": 2, "tp": 2}, {}, id="t5-pp2-tp2", marks=ci_only("about 6 s: T5 across stages")),
    pytest.param(BERT, {"dp": 2, "tp": 2}, {}, "bf16", id="bert-tp2-bf16"),
    pytest.param(T5, {"dp": 1, "pp": 2, "tp": 2}, {}, "bf16", id="t5-pp2-tp2-bf16",
                 marks=ci_only("about 6 s: T5 across stages, under autocast")),
    pytest.param(BERT, {"dp": 1, "pp": 2, "tp": 2}, {}, "fp16", id="bert-pp2-tp2-fp16",
                 marks=ci_only("about 4 s: the dev profile's bf16 case covers the casts")),
]


@pytest.mark.parametrize("family, layout, shard, precision", [
    p if len(p.values) == 4 else pytest.param(*p.values, "fp32", id=p.id, marks=p.marks) for p in EXACT])
def test_activation_term_equals_what_a_real_step_saves(pool, family, layout, shard, precision):
    """One Trainer.train_step on 4 gloo ranks saves, on every rank, exactly the bytes the dry run of its stage
    counts per microbatch (the activation term of the memory prediction), times the microbatches (pipelines: 2);
    under bf16 / fp16 the Trainer's CPU autocast against the dry run's (shardlib.analysis.meta_autocast)."""
    microbatches = layout.get("pp", 1)
    spec = {**family, "layout": layout, "shard": shard, "batch": 4, "seq": 8, "microbatches": microbatches,
            "precision": precision}
    ranks = pool.run(plan_tasks.saved_in_a_step, spec)
    report = shardlib.plan(cases(spec).make_model(spec), tp=layout.get("tp", 1), pp=layout.get("pp", 1),
                           dp=layout["dp"], sp=layout.get("sp", 1),
                           sequence_parallel=shard.get("sequence_parallel", False), batch=4, seq=8,
                           precision=precision, device_type="cpu", ulysses=shard.get("ulysses", 1))
    for rank in ranks:
        expected = microbatches * report.stages[rank["stage"]].memory.activation_bytes
        assert rank["saved"] == expected, (rank, expected)


# ------------------------------------------------------------------------------------------- the layer table
TABLE_LAYOUTS = [
    Layout(dp=2, tp=2, batch=3),
    Layout(dp=2, pp=2, batch=2, microbatches=2),
    Layout(dp=1, pp=2, tp=2, sequence_parallel="megatron", batch=3, microbatches=2),
    Layout(dp=2, sp=2, sequence_parallel="all_to_all", batch=4),
    Layout(dp=2, sp=2, sequence_parallel="ring", batch=4),
]


@pytest.mark.parametrize("family", ["bert", pytest.param("t5", marks=ci_only("about 6 s in all: T5's four"))])
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


# ------------------------------------------------------------------------------------------------ the search
def _sample(predictions, n: int):
    """``n`` layouts spread over the ranked list, each mesh / ZeRO / checkpointing combination at most once."""
    seen, out = set(), []
    step = max(1, len(predictions) // (2 * n))
    for p in predictions[::step] + predictions:
        la = p.layout
        key = (la.dp, la.pp, la.tp, la.sp, la.sequence_parallel, la.zero, la.activation_checkpointing)
        if key not in seen:
            seen.add(key)
            out.append(la)
    return out[:n]


def test_searched_layouts_are_accepted_by_the_trainer(pool):
    """Every layout the search returns for 4 ranks is one the Trainer builds and steps: a sample of them (5 here,
    24 in CI), spread over meshes, ZeRO stages and checkpointing, each takes one step on 4 gloo ranks."""
    spec = {**BERT, "seq": 8}
    model = cases(spec).make_model(spec)
    result = search(model, 4, global_batch=8, seq=8)
    assert result.ranked and not result.over_budget
    meshes = {(p.layout.dp, p.layout.pp, p.layout.tp, p.layout.sp) for p in result.ranked}
    assert {(4, 1, 1, 1), (2, 2, 1, 1), (1, 1, 4, 1), (2, 1, 1, 2), (1, 2, 2, 1)} <= meshes
    for layout in _sample(result.ranked, 24 if CI else 5):
        trainer = {"microbatches": layout.microbatches, "schedule": layout.schedule, "zero": layout.zero,
                   "activation_checkpointing": layout.activation_checkpointing}
        mode = layout.shard_mode()
        run = {**spec, "layout": {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp, "sp": layout.sp},
               "shard": {"sequence_parallel": mode} if mode else {}, "trainer": trainer, "batch": layout.batch}
        for rank in pool.run(plan_tasks.step_layout, run):
            assert math.isfinite(rank["loss"]), layout


def test_search_takes_a_budget_and_says_what_nothing_fits():
    """Under a budget every ranked layout fits and the rest are over it; a budget nothing meets names the
    smallest peak and its largest term."""
    spec = {**BERT, "seq": 8}
    model = cases(spec).make_model(spec)
    none = search(model, 2, global_batch=8, seq=8, memory_bytes=1024, checkpointing=(False,))
    assert not none.ranked and none.over_budget
    peaks = sorted(p.peak_bytes for p in none.over_budget)
    message = no_fit_message(none)
    assert f"smallest peak is {size_text(peaks[0])}" in message and "mostly" in message, message
    budget = peaks[len(peaks) // 2]
    tight = search(model, 2, global_batch=8, seq=8, memory_bytes=budget, checkpointing=(False,))
    assert tight.ranked and tight.over_budget
    assert all(p.peak_bytes <= budget for p in tight.ranked) and all(p.peak_bytes > budget for p in tight.over_budget)
    assert [p.step_s for p in tight.ranked] == sorted(p.step_s for p in tight.ranked)


def test_search_prices_packed_rows_by_their_real_tokens():
    """``mean_tokens``: a global batch of 12 samples of 3.5 tokens packs into ceil(42 / 8) = 6 rows of 8; every dp x
    microbatches is a candidate (the packer pads the rows to a multiple of it), each priced on exactly those rows,
    and the rate is real tokens per second. Fewer rows than the padded batch's 12: every layout is faster packed."""
    spec = {**BERT, "seq": 8}
    model = cases(spec).make_model(spec)
    padded = search(model, 4, global_batch=12, seq=8, checkpointing=(False,))
    packed = search(model, 4, global_batch=12, seq=8, checkpointing=(False,), mean_tokens=3.5)
    assert packed.real_tokens == 42 and padded.real_tokens is None
    for p in packed.ranked:
        parts = p.layout.dp * p.layout.microbatches
        assert p.layout.global_batch == math.ceil(6 / parts) * parts, p.layout
        assert packed.real_tokens_per_s(p) == pytest.approx(42 / p.step_s)
    assert any(p.layout.dp == 4 and p.layout.microbatches == 2 for p in packed.ranked)  # 8 rows: 2 of them empty
    by_layout = {p.layout: p.step_s for p in padded.ranked}
    faster = [by_layout[replace(p.layout, batch=12 // (p.layout.dp * p.layout.microbatches))] > p.step_s
              for p in packed.ranked if 12 % (p.layout.dp * p.layout.microbatches) == 0]
    assert faster and all(faster)
    with pytest.raises(ValueError, match=r"mean length must be in \(0, seq=8\] tokens, got 9"):
        search(model, 4, global_batch=12, seq=8, mean_tokens=9)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    """``shardlib ...`` in this process: (exit status, stdout, stderr)."""
    status = cli.main([*argv, "--class", BERT["cls"]])
    out, err = capsys.readouterr()
    return status, out, err


def test_plan_cli_search_and_its_bad_input(tmp_path, capsys):
    """`shardlib plan --world` prints the ranked table (exit 0), or exit 3 with the smallest peak when nothing
    fits; a world of 7 ranks only ring attention can use (the others refused with their reasons); a bad profile is
    one line naming the field."""
    spec = {**BERT, "seq": 8}
    cases(spec).make_model(spec).config.save_pretrained(tmp_path)
    search_args = ("plan", str(tmp_path), "--world", "2", "--global-batch", "8", "--seq", "8")
    status, out, err = _cli(capsys, *search_args, "--memory", "1GiB")
    assert status == 0 and "dp2 pp1 tp1" in out, err
    status, out, err = _cli(capsys, *search_args, "--memory", "1KiB")
    assert status == 3 and "no layout fits 1.00 KiB per rank: the smallest peak is" in out, out
    status, out, err = _cli(capsys, "plan", str(tmp_path), "--world", "7", "--global-batch", "8", "--seq", "8")
    assert status == 0 and "dp1 pp1 tp1 sp7-ring" in out and "sp7-a2a" in out, (out, err)  # a2a: refused (4 heads)
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps({**default_profile().to_dict(), "world_size": 2, "memory_bytes_per_s": -1}))
    status, out, err = _cli(capsys, *search_args, "--profile", str(bad))
    assert status == 1 and len(err.strip().splitlines()) == 1 and "memory_bytes_per_s" in err, err
    status, out, err = _cli(capsys, *search_args, "--memory", "lots")
    assert status == 1 and "expected a positive size" in err, err
    status, out, err = _cli(capsys, *search_args, "--packing", "3.5")
    assert status == 0 and "tokens/s" in out and "samples/s" not in out, (out, err)
    status, out, err = _cli(capsys, "plan", str(tmp_path), "--packing", "3.5")
    assert status == 1 and "--packing prices the rows of packed samples in the layout search: it needs --world" in err


def test_layout_auto_sets_the_training_arguments(tmp_path, capsys):
    """`--layout auto --memory M --nproc 2`: parse_args takes the search's best layout (the mesh fills the 2
    ranks, the global batch stays), says what it chose, and hands the ranks explicit flags instead; without
    --memory, with --memory alone, or without the model, it refuses in one line."""
    from shardlib.train import parse_args
    from shardlib.train.args import _choose_layout

    spec = {**BERT, "seq": 8}
    model = cases(spec).make_model(spec)
    argv = ["--layout", "auto", "--memory", "1GiB", "--nproc", "2", "--batch_size", "8"]
    args = parse_args(args=argv, launch=False, model=model, seq=8)
    assert args.dp * args.pp * args.tp * args.sp == 2 and args.batch_size == 8 and args.layout is None
    chose = Layout(dp=args.dp, pp=args.pp, tp=args.tp, sp=args.sp, sequence_parallel=args.sequence_parallel or "off",
                   zero=args.zero, microbatches=args.microbatches, schedule=args.schedule,
                   activation_checkpointing=args.activation_checkpointing)
    assert f"--layout auto chose {chose.name()}: predicted peak" in capsys.readouterr().out
    fresh = parse_args(args=["--nproc", "2", "--batch_size", "8"], launch=False)
    fresh.layout, fresh.memory = "auto", "1GiB"
    ranks_argv = _choose_layout(fresh, model, 8, argv)  # what parse_args hands the ranks it launches
    assert "--layout" not in ranks_argv and "--memory" not in ranks_argv
    again = parse_args(args=ranks_argv[1:], launch=False)  # what a rank parses: the choice, no search
    fields = ("dp", "pp", "tp", "sp", "sequence_parallel", "zero", "microbatches", "schedule",
              "activation_checkpointing", "batch_size")
    assert [getattr(again, f) for f in fields] == [getattr(fresh, f) for f in fields]
    for bad, message in [(["--layout", "auto"], "needs --memory"), (["--memory", "1G"], "are for --layout auto")]:
        with pytest.raises(SystemExit) as stop:  # as argparse ends on a bad flag: one line, no traceback
            parse_args(args=bad, launch=False, model=model)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ValueError, match="needs the model"):
        parse_args(args=argv, launch=False)


def test_a_pipeline_on_shared_cores_is_bound_by_its_total_work():
    """With a core per rank the steady state is the slowest stage m times plus the bubble; with more ranks than
    cores (CPU), waiting ranks lend their cores, so the mean stage m times, or the critical path at a full core's
    speed, whichever is longer (docs/planning.md, "Time")."""
    import dataclasses

    from shardlib.analysis.costmodel import _schedule
    from shardlib.analysis.layout import Layout
    from shardlib.analysis.profile import default_profile

    layout = Layout(dp=2, pp=2, microbatches=4, batch=2, seq=8)
    unbalanced = [{"compute": 1.0}, {"compute": 3.0}]
    own_cores = dataclasses.replace(default_profile(), device="cpu", cores=None)
    assert sum(_schedule(unbalanced, layout, own_cores).values()) == 4 * 3.0 + 1.0
    shared = dataclasses.replace(own_cores, cores=2)  # 4 ranks on 2 cores
    assert sum(_schedule(unbalanced, layout, shared).values()) == 4 * 2.0  # the mean stage, no bubble left
    one = dataclasses.replace(layout, microbatches=1)  # the critical path at a full core: (1 + 3) / 2
    assert sum(_schedule(unbalanced, one, shared).values()) == 2.0
    assert _schedule(unbalanced, one, shared)["pipeline bubble"] == 0.0
    long_path = [{"compute": 1.0}, {"compute": 1.0}, {"compute": 1.0}, {"compute": 5.0}]  # 4 stages, 4 ranks
    deep = Layout(pp=4, microbatches=2, batch=2, seq=8)
    times = _schedule(long_path, deep, shared)  # mean 2 x 2 = 4; critical (8 + 5) / 2 = 6.5
    assert times["compute"] == 4.0 and times["pipeline bubble"] == 2.5


def test_memory_moments_of_pipelines_checkpointing_and_zero():
    """GPipe runs every forward before any backward, so the first backward starts with no gradient of the step (the
    second with the first's, one microbatch fewer); ZeRO-1 under a pipeline reduce-scatters after the schedule, so
    its flat bucket sits beside the whole gradients, not beside a microbatch's backward; a checkpointed non-last
    stage's transient is a layer's saved bytes without checkpointing; ZeRO-2 holds no bucket at the running
    microbatch's peak, two at backward's end (docs/planning.md, "Memory")."""
    from shardlib.analysis.costmodel import _largest_bucket, stage_memory
    from shardlib.analysis.search import _Pricer
    from shardlib.analysis.metarun import planned_policy

    spec = {**BERT, "config": {**BERT["config"], "layers": 4}}
    full = meta_model(cases(spec).make_model(spec))
    pricer = _Pricer(full, planned_policy(full), "cpu")

    def first_stage(**kw):
        layout = Layout(dp=2, pp=2, batch=2, seq=16, **kw)
        report = pricer.report(layout)
        stage = report.stages[0]
        return layout, stage, stage_memory(report, layout, stage)

    layout, stage, one = first_stage(schedule="gpipe", microbatches=1)
    assert one["gradients"] == 0 and one["activations"] == 0
    assert sum(one.values()) == stage.parameter_bytes + stage.optimizer_bytes + stage.memory.peak_bytes
    layout, stage, four = first_stage(schedule="gpipe", microbatches=4)
    act, grads = stage.memory.activation_bytes, stage.gradient_bytes
    base = stage.parameter_bytes + stage.optimizer_bytes + stage.memory.peak_bytes
    assert sum(four.values()) == max(base + 3 * act, base + 2 * act + grads)
    layout, stage, zero1 = first_stage(schedule="1f1b", microbatches=4, zero=1)
    assert zero1.get("gradients") == grads and _largest_bucket(stage, 2) > 0  # no bucket during backward
    static = zero1["parameters"] + zero1["optimizer state"]
    assert sum(zero1.values()) >= static + grads + _largest_bucket(stage, 2)  # the reduce-scatter's moment
    # under checkpointing a non-last stage's backward first re-materializes a layer: its saved bytes without it
    ckpt = Layout(dp=2, pp=2, batch=2, seq=16, microbatches=2, activation_checkpointing=True)
    stage = pricer.report(ckpt).stages[0]
    plain = pricer.report(replace(ckpt, activation_checkpointing=False)).stages[0]
    largest = max(w.saved for w in plain.work if w.layer)
    assert largest > max(w.saved for w in stage.work if w.layer)
    assert stage.memory.peak_bytes == stage.memory.activation_bytes + largest
    # ZeRO-2: no bucket of gradients at the running microbatch's peak, two at backward's end
    zero2 = Layout(dp=2, batch=64, seq=16, zero=2)  # activations outweigh two buckets: backward's moment wins
    report = pricer.report(zero2)
    stage = report.stages[0]
    terms = stage_memory(report, zero2, stage)
    shards = max(next(z for z in stage.zero if z.zero == 2).gradients)
    static = terms["parameters"] + terms["optimizer state"]
    assert sum(terms.values()) >= static + shards + 2 * _largest_bucket(stage, 2)
    assert sum(terms.values()) >= static + shards + stage.memory.peak_bytes
    assert terms["gradients"] == shards and terms["running microbatch"] == stage.memory.peak_bytes


def test_memory_beside_a_checkpointed_recompute(monkeypatch):
    """A checkpointed stage before the last re-materializes a layer all through its backward, so its transient also
    holds the partial gradient of a weight two of its roots share (T5's embedding, with the encoder's and the
    decoder's first layers on stage 0) and, under all-to-all SP, two layers' gradient buckets; unrecomputed, the peak
    is backward's start, before either. ZeRO-2 keeps a gradient tied across stages whole until backward's end, and
    a recomputing stage of several buckets has one in flight (docs/planning.md, "Memory"; measured on t5-small)."""
    from shardlib.analysis import costmodel
    from shardlib.analysis.costmodel import _largest_bucket, stage_memory
    from shardlib.analysis.metarun import planned_policy
    from shardlib.analysis.search import _Pricer

    def pricer_of(spec):
        full = meta_model(cases(spec).make_model(spec))
        return full, _Pricer(full, planned_policy(full), "cpu")

    full, pricer = pricer_of({**T5, "config": {**T5["config"], "layers": 1, "decoder_layers": 3}})
    ckpt = Layout(dp=2, pp=2, batch=2, seq=16, microbatches=2, activation_checkpointing=True, zero=2)
    report = pricer.report(ckpt)
    stage, plain = report.stages[0], pricer.report(replace(ckpt, activation_checkpointing=False)).stages[0]
    assert {"encoder.embed_tokens", "decoder.embed_tokens"} <= set(stage.modules)
    embedding = full.shared.weight.numel() * 4
    assert stage.late_gradient_bytes == embedding  # tied to the head on stage 1
    largest = max(w.saved for w in plain.work if w.layer)
    assert stage.memory.peak_bytes == stage.memory.activation_bytes + largest + embedding
    assert plain.memory.peak_bytes == plain.memory.activation_bytes + largest
    terms = stage_memory(report, ckpt, stage)
    shards = max(next(z for z in stage.zero if z.zero == 2).gradients)
    assert terms["gradients"] == shards + embedding - embedding // 2  # one bucket: none in flight beside
    monkeypatch.setattr(costmodel, "DEFAULT_BUCKET_BYTES", 1024)  # several buckets: one in flight beside
    assert _largest_bucket(stage, 2) == 1024
    several = stage_memory(report, ckpt, stage)
    assert "running microbatch" in several and several["gradients"] == terms["gradients"] + 1024
    # all-to-all SP: every layer parameter is bucketed; a layer's partials beside the flat copy of the one before
    full, pricer = pricer_of({**BERT, "config": {**BERT["config"], "layers": 4}})
    a2a = Layout(sp=2, pp=2, batch=2, seq=16, microbatches=2, activation_checkpointing=True,
                 sequence_parallel="all_to_all")
    stage = pricer.report(a2a).stages[0]
    plain = pricer.report(replace(a2a, activation_checkpointing=False)).stages[0]
    layer = sum(p.numel() * 4 for p in full.bert.encoder.layer[0].parameters())
    largest = max(w.saved for w in plain.work if w.layer)
    assert stage.memory.peak_bytes == stage.memory.activation_bytes + largest + 2 * layer


def test_the_shared_memory_transport_is_priced_in_time_and_pages():
    """A CPU profile that measured the shared-memory transport prices the tp group's collectives with its fits and
    adds the pages a rank maps (both parities of every rank's slot, as far as the largest message reaches); a
    profile without it (a GPU's, an older one) prices neither."""
    from shardlib.analysis.costmodel import predict
    from shardlib.analysis.metarun import planned_policy
    from shardlib.analysis.search import _Pricer

    full = meta_model(cases(BERT).make_model(BERT))
    layout = Layout(tp=2, batch=4, seq=16)
    report = _Pricer(full, planned_policy(full), "cpu").report(layout)
    gloo = default_profile()
    fast = {2: gloo.collectives["all_reduce"][2]._replace(latency_s=1e-7, bytes_per_s=1e13)}
    shm = replace(gloo, shared_memory={"all_reduce": fast, "all_gather": fast, "reduce_scatter": fast},
                  shared_memory_slot_bytes=1 << 20)
    before, after = predict(report, gloo, layout), predict(report, shm, layout)
    tp_terms = [k for k in before.time if k.startswith("tp ")]
    assert tp_terms and all(after.time[k] < before.time[k] / 100 for k in tp_terms)
    largest = max(c.bytes for e in report.stages[0].collectives for c in e.collectives if c.dim == "tp")
    assert "shared-memory transport" not in before.memory
    assert after.memory["shared-memory transport"] == 2 * 2 * -(-largest // 4096) * 4096
    assert after.peak_bytes == before.peak_bytes + after.memory["shared-memory transport"]
