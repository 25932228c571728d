"""Non-finite steps (``Trainer(skip_nonfinite=True, max_consecutive_skips=K)``, shardlib/train/nonfinite.py).

On the rank pool, in float32 without clipping (where, without the option, the optimizer would write inf/nan into the
weights): an inf injected into one parameter's gradient on one rank (a tensor hook on that rank only) skips the step
on every rank; every rank's parameters and optimizer state are bitwise what they were before it, and the next step
leaves every rank bitwise where a run that never saw the bad batch is after the same clean batches (no dropout: the
skipped forward draws no random numbers; AdamW's step count was not advanced). ``fit`` does not step the LR
scheduler on a skipped step, logs ``skipped_steps``, resets the run of skips on a clean step and stops on the K-th
skip in a row naming the parameter and the ranks holding it. In one process: the option off (no clipping: nan
written into the weights, as plain PyTorch; clipping: FloatingPointError, tests/test_trainer_args.py), a clipping
norm that overflows although every gradient is finite, fp16 (the scaler's skips counted once), bad arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardlib
from test_trainer_args import batch, model, sgd, weights  # noqa: F401 (model: the world-of-one fixture)

BERT = {"family": "bert", "cls": "BertForSequenceClassification", "seq": 8, "seed": 3, "dtype": "float32",
        "config": {"heads": 4, "head_dim": 4, "layers": 2, "intermediate": 24, "vocab": 41, "num_labels": 3},
        "batch_size": 8, "microbatches": 2}
LAYOUTS = {"dp2_tp2": {"dp": 2, "tp": 2}, "pp2_tp2": {"dp": 1, "pp": 2, "tp": 2}}


# ------------------------------------------------------------------------------------------------ rank tasks
def _trainer(spec: dict, **options):
    import train_tasks

    mesh, model = train_tasks.build_sharded(spec)
    trainer = shardlib.Trainer(model, train_tasks.adamw, microbatches=spec["microbatches"], skip_nonfinite=True,
                               **spec.get("trainer", {}), **options)
    here = all(mesh.local_rank(dim) == index for dim, index in spec["inject"].items())
    return mesh, trainer, here


def _batches(spec: dict, mesh, count: int) -> list[dict]:
    import train_tasks

    samples, _ = train_tasks.dataset(spec, count * spec["batch_size"])
    size = spec["batch_size"]
    return [shardlib.dp_shard(torch.utils.data.default_collate(samples[i * size:(i + 1) * size]), mesh)
            for i in range(count)]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def skip_then_step(spec: dict) -> dict:
    """Batches 0, 1 (inf injected on one rank), 2 against a second model from the same seed trained on 0, 2."""
    from train_tasks import snapshot

    mesh, trainer, here = _trainer(spec)
    b0, b1, b2 = _batches(spec, mesh, 3)
    trainer.train_step(b0)
    before = snapshot(trainer)
    target = trainer.params[-1]
    hook = target.register_hook(lambda grad: grad + float("inf")) if here else None
    trainer.train_step(b1)
    if hook is not None:
        hook.remove()
    seen = (trainer.last_step_skipped, trainer.skipped_steps, trainer.nonfinite.consecutive)
    unchanged = _equal(before, snapshot(trainer))
    trainer.train_step(b2)
    after = (trainer.last_step_skipped, trainer.skipped_steps, trainer.nonfinite.consecutive)
    state = snapshot(trainer)
    _, reference, _ = _trainer(spec)
    reference.train_step(b0)
    reference.train_step(b2)
    name = next(n for n, p in trainer.model.named_parameters() if p is target)
    return {"injected": here, "name": name, "seen": seen, "unchanged": unchanged, "after": after,
            "as_if_absent": _equal(state, snapshot(reference))}


def fit_until_stopped(spec: dict, workdir: str) -> dict:
    """fit over 6 steps with an inf injected on one rank in steps 2, 4 and 5 and max_consecutive_skips=2: step 2 is
    skipped, step 3 steps, 4 is skipped, 5 stops the run. What every rank saw, and rank 0's log records."""
    import train_tasks

    mesh, trainer, here = _trainer(spec, max_consecutive_skips=2)
    calls = []

    def hook(grad):  # one call per microbatch backward: the step is calls // microbatches + 1
        calls.append(1)
        return grad + float("inf") if (len(calls) - 1) // spec["microbatches"] + 1 in (2, 4, 5) else grad

    target = trainer.params[-1]
    if here:
        target.register_hook(hook)
    scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: 1.0 / (s + 1))
    train, _ = train_tasks.dataset(spec, 6 * spec["batch_size"])
    save_dir = Path(workdir) / "run"
    try:
        trainer.fit(train, batch_size=spec["batch_size"], max_steps=6, lr_scheduler=scheduler, save_dir=save_dir,
                    log_interval=1, progress=False, shuffle=False)
        error = "no error"
    except FloatingPointError as e:
        error = str(e)
    dist.barrier()
    records = []
    if dist.get_rank() == 0:
        records = [json.loads(line) for line in (save_dir / "log.jsonl").read_text().splitlines()]
    name = next(n for n, p in trainer.model.named_parameters() if p is target)
    return {"error": error, "records": records, "scheduler_steps": scheduler.last_epoch, "injected": here,
            "name": name, "where": str(dist.get_rank())}


# ------------------------------------------------------------------------------------------------ pool tests
@pytest.mark.parametrize("layout, inject, options, name", [
    ("dp2_tp2", {"dp": 1, "tp": 1}, {}, "classifier.bias"),
    ("pp2_tp2", {"pp": 0, "tp": 1}, {}, "bert.encoder.layer.0.output.LayerNorm.bias"),
    ("dp2_tp2", {"dp": 0, "tp": 1}, {"zero": 2}, "classifier.bias"),
], ids=["dp2_tp2", "pp2_tp2", "dp2_tp2_zero2"])
def test_an_inf_on_one_rank_skips_the_step_everywhere_and_the_next_step_is_as_if_it_never_happened(
        pool, layout, inject, options, name):
    """The inf is in a parameter replicated over tp, on tp rank 1 only, so no tp rank 0 ever holds it: dp=2 x tp=2
    (DDP sums it into the other dp replica of tp rank 1), pp=2 x tp=2 (on stage 0, whose loss is finite: the flag
    spans the stages), dp=2 x tp=2 with ZeRO-2 (the reduce-scatter puts it in one dp rank's piece)."""
    spec = {**BERT, "layout": LAYOUTS[layout], "inject": inject, "trainer": options}
    ranks = pool.run(skip_then_step, spec)
    assert [r["name"] for r in ranks if r["injected"]] == [name], ranks
    for r in ranks:
        assert r["seen"] == (True, 1, 1), r           # skipped, counted, one in a row
        assert r["unchanged"], r                      # parameters and optimizer state bitwise as before
        assert r["after"] == (False, 1, 0), r         # the next step stepped; the run of skips is over
        assert r["as_if_absent"], r                   # bitwise the run that never saw batch 1


def test_fit_skips_logs_keeps_the_schedule_and_stops_naming_the_parameter(pool, tmp_path):
    spec = {**BERT, "layout": LAYOUTS["dp2_tp2"], "inject": {"dp": 0, "tp": 1}}
    ranks = pool.run(fit_until_stopped, spec, str(tmp_path))
    (injector,) = [r for r in ranks if r["injected"]]
    for r in ranks:
        assert r["error"].startswith("step 5 (epoch 0): 2 steps in a row had inf/nan gradients and were skipped "
                                     "(skip_nonfinite=True, max_consecutive_skips=2)"), r["error"]
        # DDP summed the inf into tp rank 1's replica on dp 1 as well; tp rank 0 never held it
        assert f"in the last one: {injector['name']} on rank 1 (dp=0, tp=1), rank 3 (dp=1, tp=1)." in r["error"]
        assert r["scheduler_steps"] == 2, r  # steps 1 and 3 stepped; 2, 4, 5 skipped
    records = ranks[0]["records"]
    assert [rec["step"] for rec in records] == [1, 2, 3, 4]
    assert [rec["skipped_steps"] for rec in records] == [0, 1, 1, 2]
    base = 1e-3  # train_tasks.adamw
    assert [rec["lr"] for rec in records] == pytest.approx([base / 2, base / 2, base / 3, base / 3], rel=1e-12)
    assert "grad_norm" not in records[1] and records[2]["grad_norm"] > 0  # a skipped step has no norm (None)


# ------------------------------------------------------------------------------------------ one process
def test_option_off_without_clipping_steps_nan_into_the_weights_as_before(model):
    """The behaviour kept when the option is off and nothing clips: no check, the optimizer steps, the gradient's
    nan lands in the weight, no count (plain PyTorch's behaviour; with clipping it is FloatingPointError,
    tests/test_trainer_args.py)."""
    trainer = shardlib.Trainer(model, sgd)
    model.classifier.weight.register_hook(lambda grad: grad * float("nan"))
    trainer.train_step(batch())
    assert not trainer.last_step_skipped and trainer.skipped_steps is None and trainer.nonfinite is None
    assert torch.isnan(model.classifier.weight).all()


def test_a_clipping_norm_that_overflows_skips_and_stops(model):
    """Every gradient finite (1e25), their norm not (the squares overflow float32): with clipping and the option,
    skipped instead of FloatingPointError; the second in a row stops, saying the gradients are finite."""
    trainer = shardlib.Trainer(model, sgd, max_grad_norm=1.0, skip_nonfinite=True, max_consecutive_skips=2)
    model.bert.embeddings.word_embeddings.weight.register_hook(lambda grad: torch.full_like(grad, 1e25))
    before = weights(model)
    trainer.train_step(batch())
    assert trainer.last_step_skipped and trainer.skipped_steps == 1 and trainer.last_grad_norm is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(FloatingPointError, match="^2 steps in a row had inf/nan gradients") as err:
        trainer.train_step(batch())
    assert "in the last one: none: every gradient is finite; their norm is not" in str(err.value)


def test_fp16_overflows_are_the_scalers_skips_counted_once(model):
    """Under fp16 the scaler decides and counts (skipped_steps = its count, the option adds none) and the option
    stops its K-th overflow in a row, naming the parameter."""
    trainer = shardlib.Trainer(model, sgd, precision="fp16", skip_nonfinite=True, max_consecutive_skips=3)
    model.classifier.bias.register_hook(lambda grad: grad + float("inf"))
    for step in (1, 2):
        trainer.train_step(batch())
        assert trainer.last_step_skipped and trainer.scaler.skipped == step and trainer.nonfinite.skipped == 0
        assert trainer.skipped_steps == step
    with pytest.raises(FloatingPointError, match="^3 steps in a row") as err:
        trainer.train_step(batch())
    assert "in the last one: classifier.bias on rank 0." in str(err.value)


def test_the_skip_counts_are_part_of_the_train_state(model, tmp_path):
    """A checkpoint saved after a skipped step carries the counts (total, and the run of skips in progress): a run
    resumed from it continues them, so the K-th skip in a row stops as it would have without the restart."""
    trainer = shardlib.Trainer(model, sgd, skip_nonfinite=True, max_consecutive_skips=3)
    one = batch(8)
    samples = [{"input_ids": one["input_ids"][i], "labels": one["labels"][i]} for i in range(8)]
    bad = model.classifier.bias.register_hook(lambda grad: grad + float("inf"))
    trainer.fit(samples, batch_size=4, max_steps=2, save_dir=tmp_path, progress=False)
    assert trainer.nonfinite.state_dict() == {"skipped": 2, "consecutive": 2}
    trainer.nonfinite.load_state_dict({"skipped": 0, "consecutive": 0})
    with pytest.raises(FloatingPointError, match="^step 3 .*3 steps in a row"):
        trainer.fit(samples, batch_size=4, max_steps=3, save_dir=tmp_path, resume="auto", progress=False)
    bad.remove()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"skip_nonfinite": "yes"}, TypeError, "skip_nonfinite must be True or False, got 'yes'"),
    ({"max_consecutive_skips": 3}, ValueError, "max_consecutive_skips is for skip_nonfinite=True"),
    ({"skip_nonfinite": True, "max_consecutive_skips": 0}, ValueError,
     "max_consecutive_skips must be a positive integer, got 0"),
], ids=["not-bool", "without-skip", "zero"])
def test_skip_options_are_refused_at_construction(model, kwargs, error, message):
    with pytest.raises(error) as err:
        shardlib.Trainer(model, sgd, **kwargs)
    assert message in str(err.value)


def test_training_arguments_hand_the_options_to_the_trainer():
    from shardlib.train import parse_args

    args = parse_args(args=["--skip-nonfinite", "--max-consecutive-skips", "3"], launch=False)
    options = args.trainer_options()
    assert options["skip_nonfinite"] is True and options["max_consecutive_skips"] == 3
    default = parse_args(args=[], launch=False).trainer_options()
    assert default["skip_nonfinite"] is False and default["max_consecutive_skips"] is None
