"""Pipeline stages: the pure stage assignment (hypothesis), and pipelined training (pp x tp x dp on 4 gloo ranks)
equal to the unsharded model for BERT, ViT and T5 across schedules and microbatch counts."""

import itertools

import pytest
import torch
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shardlib.pipeline import assign_stages, stage_plan
from shardlib.policies import policy_for
from shardlib.sharding.plan import PlanError

import pipeline_tasks
from strategies import pipeline_specs


# ------------------------------------------------------------------------------------------ pure assignment
@given(costs=st.lists(st.floats(0.1, 100.0), min_size=1, max_size=9), stages=st.integers(1, 9))
def test_assignment_covers_every_layer_once_in_order_without_empty_stages(costs, stages):
    if stages > len(costs):
        with pytest.raises(PlanError, match="every stage needs at least one layer"):
            assign_stages(costs, stages)
        return
    ranges = assign_stages(costs, stages)
    assert len(ranges) == stages and all(len(r) >= 1 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(len(costs)))
    # optimal: no other contiguous split has a cheaper most-expensive stage
    best = max(sum(costs[i] for i in r) for r in ranges)
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0, *cuts, len(costs))
        other = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert best <= other + 1e-9


@given(counts=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_explicit_layers_per_stage_is_used_as_given(counts):
    ranges = assign_stages([1.0] * sum(counts), len(counts), counts)
    assert [len(r) for r in ranges] == counts


@pytest.mark.parametrize("bad", [[2, 1], [3, 0, 1], [1, 1, 1]])
def test_bad_layers_per_stage_is_refused(bad):
    with pytest.raises(PlanError, match="layers_per_stage"):
        assign_stages([1.0] * 4, 3, bad)


def _t5(layers=4, decoder_layers=4):
    config = transformers.T5Config(vocab_size=300, d_model=64, d_kv=16, d_ff=128, num_layers=layers,
                                   num_decoder_layers=decoder_layers, num_heads=4)
    return transformers.T5ForConditionalGeneration(config)


def test_t5_stages_weigh_decoder_layers_and_the_head():
    model = _t5()
    plan = stage_plan(model, policy_for(model).plan(model, 1).trunk, 2)
    first, second = plan.layers
    # decoder layers (with cross-attention) cost more than encoder layers, and the LM head is charged to the
    # last stage: the cut falls after the middle of the 8 layers
    assert len(first) > len(second)
    assert "shared" in plan.modules[1] and "lm_head" in plan.modules[1]
    assert "encoder.embed_tokens" in plan.modules[0] and "decoder.final_layer_norm" in plan.modules[1]
    assert max(plan.costs) < 0.6 * sum(plan.costs)


def test_bert_embeddings_first_heads_last_and_too_many_stages():
    config = transformers.BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                     intermediate_size=64)
    model = transformers.BertForMaskedLM(config)
    trunk = policy_for(model).plan(model, 1).trunk
    plan = stage_plan(model, trunk, 3)
    assert plan.layers == (("bert.encoder.layer.0",), ("bert.encoder.layer.1",), ("bert.encoder.layer.2",))
    assert "bert.embeddings" in plan.modules[0] and "cls.predictions" in plan.modules[2]
    with pytest.raises(PlanError, match="4 pipeline stages but only 3 layers"):
        stage_plan(model, trunk, 4)


def test_a_root_that_holds_a_tensor_gives_only_that_tensor_to_the_last_stage():
    """BART's root module holds the ``final_logits_bias`` buffer: the last stage owns that buffer, not every
    parameter below the root (which once made the stages disagree on the tied parameters and abort)."""
    from shardlib.pipeline import tensor_owners
    from shardlib.sharding.inference import infer

    config = transformers.BartConfig(vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                     decoder_ffn_dim=16, max_position_embeddings=32)
    model = transformers.BartForConditionalGeneration(config)
    plan = stage_plan(model, infer(model).plan.trunk, 2)
    assert "final_logits_bias" in plan.modules[1] and "" not in plan.modules[1]
    owners = tensor_owners(model, plan)
    assert owners["final_logits_bias"] == {1} and owners["model.encoder.layers.0.fc1.weight"] == {0}
    # the tied embedding, by each of its names: the encoder's on stage 0, the shared one and the LM head's on stage 1
    assert owners["model.encoder.embed_tokens.weight"] == {0} and owners["lm_head.weight"] == {1}


# ------------------------------------------------------------------------------------------ pipelined training
@settings(max_examples=max(4, settings().max_examples // 4))
@example(spec={"family": "vit", "cls": "ViTForMaskedImageModeling", "tp": 1, "pp": 2, "schedule": "gpipe",
               "microbatches": 1, "batch": 2, "dtype": "float32", "seed": 890, "interpolate": False, "padding": False,
               "meta": False, "sp": False, "kernels": {}, "all_targets": False,
               "config": {"image": 2, "patch": 2, "heads": 1, "head_dim": 4, "layers": 2, "intermediate": 1,
                          "act": "relu", "num_labels": 2, "qkv_bias": False}})  # no masked patch at all: loss 0, not NaN
@given(spec=pipeline_specs())
def test_pipelined_training_matches_unsharded(pool, spec):
    results = pool.run(pipeline_tasks.pipeline_equivalence, spec)
    covered = set().union(*(r["names"] for r in results))
    assert covered == set(results[0]["all_names"])  # every parameter lives on some stage
    assert all(r["grads"] >= 1 and r["weights"] >= 1 for r in results)


FIXED = {
    "bert": {"heads": 4, "head_dim": 8, "layers": 4, "intermediate": 64, "vocab": 97, "tie": True, "num_labels": 3,
             "cross_attention": True},
    "vit": {"image": 8, "patch": 4, "heads": 4, "head_dim": 8, "layers": 4, "intermediate": 64, "num_labels": 5},
    "t5": {"vocab": 53, "d_model": 16, "d_kv": 4, "heads": 4, "d_ff": 16, "layers": 2, "decoder_layers": 3,
           "buckets": 8, "max_distance": 16, "tie": True, "num_labels": 3},
}
CLASSES = {"bert": ["BertForMaskedLM", "BertForPreTraining", "BertLMHeadModel", "BertForMultipleChoice", "BertModel"],
           "vit": ["ViTForImageClassification", "ViTForMaskedImageModeling", "ViTModel"],
           "t5": ["T5ForConditionalGeneration", "T5Model", "T5ForSequenceClassification", "UMT5ForConditionalGeneration",
                  "T5EncoderModel"]}


def _spec(family, cls, pp, tp, microbatches, schedule, dtype="float32"):
    dp = 4 // (pp * tp)
    return {"family": family, "cls": cls, "pp": pp, "tp": tp, "microbatches": microbatches, "schedule": schedule,
            "config": FIXED[family], "seq": 6, "dec_seq": 5, "enc_seq": 4, "batch": dp * microbatches,
            "padding": True, "dtype": dtype, "seed": 11, "all_targets": cls == "BertForPreTraining"}


@pytest.mark.parametrize("family,cls", [(f, c) for f, cs in CLASSES.items() for c in cs])
@pytest.mark.parametrize("pp,tp,microbatches,schedule", [(2, 2, 2, "1f1b"), (4, 1, 4, "gpipe")])
def test_every_head_pipelined(pool, family, cls, pp, tp, microbatches, schedule):
    spec = _spec(family, cls, pp, tp, microbatches, schedule)
    if cls.endswith("EncoderModel"):
        spec["config"] = {**spec["config"], "layers": 4}  # the encoder alone must fill 4 stages
    pool.run(pipeline_tasks.pipeline_equivalence, spec)


@pytest.mark.parametrize("schedule,microbatches", [("interleaved_1f1b", 4), ("looped_bfs", 2), ("gpipe", 8),
                                                   ("gpipe", 1), ("1f1b", 2)])
def test_schedules_and_microbatch_counts(pool, schedule, microbatches):
    spec = _spec("t5", "T5ForConditionalGeneration", 2, 1, microbatches, schedule)
    spec["batch"] = 2 * microbatches
    results = pool.run(pipeline_tasks.pipeline_equivalence, spec)
    if schedule in pipeline_tasks.MULTI_STAGE:
        assert len(results[0]["stages"]) == 4


@pytest.mark.parametrize("family,cls", [("bert", "BertForMaskedLM"), ("vit", "ViTForImageClassification"),
                                        ("t5", "T5ForConditionalGeneration"), ("t5", "UMT5ForConditionalGeneration")])
@pytest.mark.parametrize("seq", [6, 7])
def test_sequence_parallel_pipeline(pool, family, cls, seq):
    """tp=2 x pp=2 with sequence parallelism: activations cross the stage boundaries still sharded along the
    sequence (the true length travels as the shape of a [1, L] tensor), any length."""
    spec = {**_spec(family, cls, 2, 2, 2, "1f1b"), "sp": True, "seq": seq, "dec_seq": seq - 2}
    spec["config"] = {**spec["config"], "layers": 3} if family != "t5" else spec["config"]
    pool.run(pipeline_tasks.pipeline_equivalence, spec)


def test_training_is_deterministic_across_runs(pool):
    spec = {**_spec("bert", "BertForMaskedLM", 2, 2, 2, "1f1b"), "max_grad_norm": 0.5}
    first = pool.run(pipeline_tasks.losses_over_steps, spec)
    second = pool.run(pipeline_tasks.losses_over_steps, spec)
    assert first == second  # bitwise: same floats on every rank and run
    assert len({tuple(r) for r in first}) == 1 and first[0][0] != first[0][-1]


@pytest.mark.parametrize("pp,tp", [(2, 2), (4, 1)])
def test_gradient_clipping_over_the_whole_mesh(pool, pp, tp):
    spec = {**_spec("t5", "T5ForConditionalGeneration", pp, tp, 2, "gpipe"), "max_grad_norm": 0.05}
    results = pool.run(pipeline_tasks.clipping_matches, spec)
    assert len({r["norm"] for r in results}) == 1 and results[0]["norm"] > 0.05


def test_activation_checkpointing_replays_dropout(pool):
    config = {**FIXED["bert"], "dropout": 0.3}
    spec = {**_spec("bert", "BertForMaskedLM", 2, 2, 2, "1f1b"), "config": config}
    results = pool.run(pipeline_tasks.checkpointing_replays_dropout, spec)
    assert all(r["grads"] >= 1 for r in results)


def test_gradient_accumulation_equals_one_big_step(pool):
    spec = _spec("vit", "ViTForImageClassification", 2, 1, 2, "1f1b")
    spec["batch"] = 16  # two accumulated batches of 8: 4 per dp rank, 2 microbatches of 2
    pool.run(pipeline_tasks.accumulation_matches_one_big_batch, spec)


def test_bf16_autocast_through_the_pipeline(pool):
    spec = _spec("bert", "BertForMaskedLM", 2, 2, 2, "1f1b")
    results = pool.run(pipeline_tasks.bf16_autocast_close, spec)
    assert len({r["loss"] for r in results}) == 1  # closeness to the unsharded loss is asserted on the ranks


@pytest.mark.parametrize("cls,a,b", [
    ("T5ForConditionalGeneration", (2, 2), (2, 2)),   # same layout: bitwise
    ("T5ForConditionalGeneration", (2, 1), (4, 1)),   # more stages
    ("BertForMaskedLM", (2, 2), (1, 2)),              # pipeline -> no pipeline
    ("BertForMaskedLM", (1, 4), (2, 2)),              # tensor-parallel only -> pipeline
])
def test_pipelined_checkpoint_save_reshard_resume_export(pool, tmp_path, cls, a, b):
    family = "t5" if cls.startswith("T5") else "bert"
    spec = {**_spec(family, cls, 2, 1, 2, "gpipe"), "pp_a": a[0], "tp_a": a[1], "pp_b": b[0], "tp_b": b[1],
            "batch": 8}
    results = pool.run(pipeline_tasks.pipelined_checkpoint_resumes, spec, str(tmp_path))
    assert len({tuple(r["resumed"]) for r in results}) == 1


@pytest.mark.parametrize("pp_b,tp_b", [(2, 2), (4, 1), (1, 4)])
def test_convert_with_pp_writes_stage_files_any_layout_loads(pool, tmp_path, pp_b, tp_b):
    import json
    import sys

    from shardlib.cli import main as cli

    import t5_cases

    spec = {**_spec("t5", "T5ForConditionalGeneration", 2, 2, 2, "gpipe"), "pp_b": pp_b, "tp_b": tp_b}
    t5_cases.make_model(spec).save_pretrained(tmp_path / "hf")
    assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / "converted"), "--tp", "2", "--pp", "2"]) == 0
    document = json.loads((tmp_path / "converted" / "shardlib.json").read_text())
    assert document["pp"] == 2
    assert {f.split("-tp")[0].split("-replicated")[0] for f in document["files"]} == {"model-pp00", "model-pp01"}
    assert cli(["verify", str(tmp_path / "converted")]) == 0
    results = pool.run(pipeline_tasks.converted_checkpoint_loads, spec, str(tmp_path))
    assert set().union(*(r["local"] for r in results)) == set(t5_cases.make_model(spec).state_dict()) - {
        "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}  # tied: named "shared.weight"


@pytest.mark.parametrize("family,cls", [("bert", "BertForMaskedLM"), ("vit", "ViTForImageClassification"),
                                        ("t5", "T5ForConditionalGeneration"), ("t5", "UMT5ForConditionalGeneration")])
def test_all_to_all_sequence_parallel_pipeline(pool, family, cls):
    """pp=2 x sp=2 with all-to-all sequence parallelism: the stages exchange sequence chunks (T5: and the whole-
    sequence position bias), a length sp does not divide."""
    spec = {**_spec(family, cls, 2, 1, 2, "1f1b"), "sp": "all_to_all", "sp_size": 2, "seq": 7, "dec_seq": 5}
    spec["config"] = {**spec["config"], "layers": 3} if family != "t5" else spec["config"]
    pool.run(pipeline_tasks.pipeline_equivalence, spec)
