"""``Trainer.fit`` on the rank pool: parallel layouts train the same model as the unsharded one, evaluation counts
every sample once at any layout, runs resume bitwise at their layout and closely at others, bad input is refused.

Tolerances. float64: the layouts sum the same products in other orders (row-parallel partial sums, dp sums of
microbatch losses): measured 2e-16 relative on the first step's loss; rtol 1e-10 here and on evaluation. float32
over 20 steps: measured at most 1.6e-7 relative (T5, pp=2 x tp=2); rtol 1e-5 here, so real drift (a wrong
gradient moves the loss by far more within a few AdamW steps) cannot pass. Resume at another layout: measured
2.7e-8; rtol 1e-6.
"""

from __future__ import annotations

import pytest

import train_tasks

BERT = {"family": "bert", "cls": "BertForSequenceClassification", "seq": 8, "seed": 3,
        "config": {"heads": 4, "head_dim": 4, "layers": 2, "intermediate": 24, "vocab": 41, "num_labels": 3}}
VIT = {"family": "vit", "cls": "ViTForImageClassification", "seed": 4,
       "config": {"image": 8, "patch": 4, "heads": 4, "head_dim": 4, "layers": 2, "intermediate": 24, "num_labels": 3}}
T5 = {"family": "t5", "cls": "T5ForConditionalGeneration", "seq": 6, "dec_seq": 5, "seed": 5,
      "config": {"vocab": 37, "d_model": 16, "d_kv": 4, "heads": 4, "d_ff": 16, "layers": 2, "decoder_layers": 2}}
FAMILIES = {"bert": BERT, "vit": VIT, "t5": T5}
LAYOUTS = {"dp4": {"dp": 4}, "dp2_tp2": {"dp": 2, "tp": 2}, "pp2_tp2": {"dp": 1, "pp": 2, "tp": 2}}
RUN = {"batch_size": 8, "microbatches": 2, "samples": 40}


def close(a, b, rtol):
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-30)


@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_and_eval_identical_in_float64_at_every_layout(pool, family):
    """dp=4, dp=2 x tp=2 and pp=2 x tp=2 against the unsharded model: the first step's loss, and after 2 steps the
    evaluation of 30 samples in global batches of 8, whose tail of 6 splits 2, 2, 1, 1 over dp=4 (odd
    microbatches): every sample counted once, loss and accuracy identical. Without a pipeline the dp sum is torch's
    DDP, in the step's last backward (the first microbatch's backward runs under no_sync)."""
    spec = {**FAMILIES[family], **RUN, "dtype": "float64", "steps": 2, "eval_samples": 30, "metrics": True}
    expected = train_tasks.reference_run(spec)
    for name, layout in LAYOUTS.items():
        got = pool.run(train_tasks.fit_run, {**spec, "layout": layout})[0]
        assert got["ddp"] == ("pp" not in layout), (name, got["ddp"])
        first = got["losses"][0]
        assert close(first, expected["losses"][0], 1e-10), f"{family} {name}: {first!r} != {expected['losses'][0]!r}"
        (record,) = got["evals"]  # eval_interval None: once, at the end
        assert record["samples"] == 30, (name, record)
        for key in ("loss", "accuracy"):
            want = expected["eval"][key]
            assert close(record[key], want, 1e-10), f"{family} {name} eval {key}: {record[key]} != {want}"


@pytest.mark.parametrize("family", FAMILIES)
def test_twenty_step_float32_curves_agree(pool, family):
    spec = {**FAMILIES[family], **RUN, "dtype": "float32", "steps": 20}
    reference = train_tasks.reference_run(spec)["losses"]
    for name, layout in LAYOUTS.items():
        losses = pool.run(train_tasks.fit_run, {**spec, "layout": layout})[0]["losses"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        assert len(losses) == 20 and worst < 1e-5, f"{family} {name}: worst relative difference {worst:.2e}"
        assert losses[-1] < losses[0], f"{family} {name} did not learn: {losses}"


def test_resume_at_the_same_layout_is_bitwise_with_dropout(pool, tmp_path):
    """pp=2 x tp=2 T5 with dropout (pipeline stages and per-rank streams): 6 steps straight, or 3 then resumed."""
    spec = {**T5, **RUN, "config": {**T5["config"], "dropout": 0.1}, "dtype": "float32", "steps": 6,
            "layout": LAYOUTS["pp2_tp2"], "save_dir": "run", "save_interval": 3}
    straight = pool.run(train_tasks.fit_run, spec, str(tmp_path))[0]
    resumed = pool.run(train_tasks.fit_run, {**spec, "save_dir": "resumed", "save_interval": None,
                                             "resume": "run/checkpoints/step-00000003"}, str(tmp_path))[0]
    assert resumed["first_step"] == 3
    assert resumed["losses"] == straight["losses"][3:], "resumed losses differ from the uninterrupted run"


@pytest.mark.parametrize("target", ["dp4", "tp4", "pp2_tp2"])
def test_resume_at_another_layout(pool, tmp_path, target):
    """Saved at tp=2 x dp=2 after 4 steps, resumed at another layout: model and optimizer resharded, same global
    sample order; steps 5-8 equal the uninterrupted run within float32 rounding (rtol 1e-6)."""
    spec = {**BERT, **RUN, "dtype": "float32", "steps": 8, "layout": LAYOUTS["dp2_tp2"], "save_dir": "run",
            "save_interval": 4}
    straight = pool.run(train_tasks.fit_run, spec, str(tmp_path))[0]
    layout = {"dp4": {"dp": 4}, "tp4": {"dp": 1, "tp": 4}, "pp2_tp2": LAYOUTS["pp2_tp2"]}[target]
    resumed = pool.run(train_tasks.fit_run, {**spec, "layout": layout, "save_dir": None, "save_interval": None,
                                             "resume": "run/checkpoints/step-00000004"}, str(tmp_path))[0]
    assert resumed["first_step"] == 4 and len(resumed["losses"]) == 4
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed["losses"], straight["losses"][4:]))
    assert worst < 1e-6, f"resumed at {target}: worst relative difference {worst:.2e}"


BAD_INPUT = [
    ("indivisible_batch", "ValueError: global batch_size 6 is not divisible by dp(4) x microbatches(2) = 8"),
    ("empty", "ValueError: train_data is empty"),
    ("no_length", "ValueError: fit needs epochs or max_steps (both are missing)"),
    ("scheduler_type", "TypeError: lr_scheduler gave a str, not a torch.optim.lr_scheduler.LRScheduler"),
    ("forward_step_type", "TypeError: forward_step returned int; expected a scalar loss tensor"),
    ("loss_not_scalar", "ValueError: forward_step returned a loss of shape (1, 3); expected a scalar"),
    ("resume:nowhere", "resume: {workdir}/nowhere is not a directory"),
    ("resume:incomplete", "incomplete: no shardlib.json (not a shardlib checkpoint, or an unfinished save)"),
    ("resume:torn/checkpoints/step-00000002", "is damaged: missing checkpoint file"),
    ("resume:foreign/checkpoints/step-00000002", "is not a checkpoint of this run: its config differs"),
]


def test_bad_input_is_refused_with_nothing_written(pool, tmp_path):
    spec = {**BERT, **RUN, "dtype": "float32", "steps": 2, "layout": LAYOUTS["dp4"]}
    pool.run(train_tasks.fit_run, {**spec, "save_dir": "torn", "save_interval": 2}, str(tmp_path))
    torn = tmp_path / "torn/checkpoints/step-00000002"
    next(torn.glob("rng-rank*.safetensors")).unlink()
    (tmp_path / "incomplete").mkdir()
    (tmp_path / "incomplete" / "model-tp0-of-1.safetensors").write_bytes(b"partial")
    foreign = {**spec, "config": {**BERT["config"], "intermediate": 20}}
    pool.run(train_tasks.fit_run, {**foreign, "save_dir": "foreign", "save_interval": 2}, str(tmp_path))
    for case, message in BAD_INPUT:
        errors = pool.run(train_tasks.expect_error, spec, str(tmp_path), case)
        assert all(message.format(workdir=tmp_path) in e for e in errors), f"{case}: {errors[0]}"
        assert not (tmp_path / "bad-input").exists(), f"{case}: the run wrote its save_dir before failing"


def test_resume_auto_skips_a_torn_newest_checkpoint(pool, tmp_path):
    """Checkpoints written in the loop (async_save=False) this time; the newest is truncated after the run."""
    spec = {**BERT, **RUN, "dtype": "float32", "steps": 4, "layout": LAYOUTS["dp2_tp2"], "save_dir": "run",
            "save_interval": 2, "async_save": False}
    straight = pool.run(train_tasks.fit_run, spec, str(tmp_path))[0]
    newest = tmp_path / "run/checkpoints/step-00000004"
    victim = max(newest.glob("model-*.safetensors"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-8])  # truncated: size and checksum no longer match
    resumed = pool.run(train_tasks.fit_run, {**spec, "resume": "auto"}, str(tmp_path))[0]
    assert resumed["first_step"] == 2 and resumed["losses"] == straight["losses"][2:]


def test_shape_inference_forward_is_the_first_of_a_new_schedule(pool):
    """Pins torch's behaviour that the RNG-neutral shape-inference forward relies on: the first step of a new
    schedule runs microbatches + 1 forwards per stage, the extra one first; later steps run microbatches."""
    spec = {**BERT, **RUN, "dtype": "float32", "layout": LAYOUTS["pp2_tp2"]}
    for first, second in pool.run(train_tasks.first_step_stage_forwards, spec):
        assert first == [True] + [False] * RUN["microbatches"], first
        assert second == [False] * RUN["microbatches"], second


def test_trainer_arguments_are_checked():
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    import shardlib
    from shardlib.parallel.mesh import OfflineMesh

    model = shardlib.shard(BertForSequenceClassification(BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)),
        OfflineMesh())
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    for kwargs, message in [({"microbatches": 0}, "microbatches must be a positive integer, got 0"),
                            ({"max_grad_norm": -1.0}, "max_grad_norm must be a positive finite number"),
                            ({"schedule": "zb"}, "unknown schedule 'zb'")]:
        with pytest.raises(ValueError, match=message):
            shardlib.Trainer(model, sgd, **kwargs)
    with pytest.raises(ValueError, match="this Trainer has no optimizer"):
        shardlib.Trainer(model).train_step({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match="BertModel is not sharded"):
        shardlib.Trainer(BertForSequenceClassification(model.config).bert, sgd)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", [{"tp": 1}, {"tp": 2}, {"dp": 1, "pp": 2, "tp": 2}], ids=["tp1", "tp2", "pp2_tp2"])
def test_the_loss_of_a_low_precision_step_is_float32(pool, precision, layout):
    """Under bf16 / fp16 autocast transformers computes its loss in float32 (autocast's float32 log_softmax), and so
    do the loss ``train_step`` returns and the loss of ``eval_step``'s outputs: not rounded to the logits' dtype
    (before: 10.375 where transformers said 10.3720). tp=1 is the model itself: equal to rtol 1e-6. At tp > 1 the
    row-parallel sums round other low-precision activations (measured up to 4e-4 relative on this model), while a
    loss rounded to bf16 is off by up to 2**-9 = 2e-3: the train and eval losses of the same weights and batch must
    agree to 1e-6 (the same forward; fp16's scale divided out in float64; with a pipeline, two microbatches and
    the last stage's view), and be float32."""
    spec = {**BERT, "cls": "BertForMaskedLM", "batch": 4, "precision": precision, "layout": layout}
    got = pool.run(train_tasks.autocast_losses, spec)[-1]  # the last rank holds the last pipeline stage
    assert got["reference_dtype"] == "torch.float32"
    assert got["eval"] and all(dtype == "torch.float32" for _, dtype in got["eval"]), got
    if len(got["eval"]) == 1:
        assert close(got["train_step"], got["eval"][0][0], 1e-6), got
    assert close(got["train_step"], got["reference"], 1e-6 if layout == {"tp": 1} else 2e-3), got
