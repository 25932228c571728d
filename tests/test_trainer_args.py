"""The Trainer's and TrainingArguments' own arguments, in one process (a world of one): each bad value is refused with
an error naming the argument and the value, before a gradient or a parameter changes; a non-finite gradient norm
when clipping stops the run naming the step and the parameters. (Before: ``microbatches=True`` and a string
``max_grad_norm`` got through or failed inside a comparison, a batch without tensors raised "generator raised
StopIteration", a NaN gradient norm did not say where.)"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification

import shardlib
from shardlib.train import TrainingArguments


@pytest.fixture
def model():
    """A tiny BERT classifier sharded on a world of one (an in-process gloo group, destroyed afterwards)."""
    mesh = shardlib.init_mesh()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32)
    try:
        yield shardlib.shard(BertForSequenceClassification(config), mesh)
    finally:
        dist.destroy_process_group()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def batch(n=4):
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 40, (n, 5), generator=g), "labels": torch.randint(0, 2, (n,), generator=g)}


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model, before):
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kwargs, error, message", [
    ({"microbatches": True}, ValueError, "microbatches must be a positive integer, got True"),
    ({"max_grad_norm": "1"}, ValueError, "max_grad_norm must be a positive finite number or None, got '1'"),
    ({"max_grad_norm": True}, ValueError, "max_grad_norm must be a positive finite number or None, got True"),
    ({"forward_step": "loss"}, TypeError, "forward_step must be a function (model, batch) -> loss"),
    ({"loss_fn": 3}, TypeError, "loss_fn must be a function from the model's first output to a loss, got int"),
    ({"bucket_mb": 0}, ValueError, "bucket_mb must be a positive finite number (MiB per gradient bucket), got 0"),
], ids=["microbatches-bool", "max_grad_norm-str", "max_grad_norm-bool", "forward_step", "loss_fn", "bucket_mb"])
def test_trainer_options_are_refused_at_construction(model, kwargs, error, message):
    with pytest.raises(error) as err:
        shardlib.Trainer(model, sgd, **kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("bad, error, message", [
    ({"input_ids": [[1, 2, 3]], "labels": None}, ValueError,
     "the batch has no tensors (keys: ['input_ids', 'labels']; value types: ['NoneType', 'list'])"),
    ({}, ValueError, "the batch has no tensors (keys: []"),
    (torch.zeros(2, 3, dtype=torch.long), TypeError, "the batch must be a dict of tensors (name -> [batch, ...]), "
                                                      "got Tensor"),
    ([{"input_ids": torch.zeros(2, 3, dtype=torch.long)}, [1, 2]], TypeError,
     "batch 1 of 2 must be a dict of tensors"),
    ([], ValueError, "train_step got an empty list of batches"),
    ({"input_ids": torch.zeros(4, 5, dtype=torch.long), "labels": torch.zeros(3, dtype=torch.long)}, ValueError,
     "the batch's tensors disagree on the batch size: input_ids: 4, labels: 3"),
    ({"input_ids": torch.zeros(4, 5, dtype=torch.long), "labels": torch.tensor(1)}, ValueError,
     "the batch has 0-dim tensors (labels); every tensor needs a batch dimension"),
], ids=["no-tensors", "empty-dict", "tensor", "list-item", "empty-list", "sizes-disagree", "0-dim"])
def test_bad_batches_are_refused_before_any_change(model, bad, error, message):
    trainer = shardlib.Trainer(model, sgd)
    trainer.forward_backward(batch())  # gradients a refused step must leave alone
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    before = weights(model)
    with pytest.raises(error) as err:
        trainer.train_step(bad)
    assert message in str(err.value)
    assert unchanged(model, before)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if n in grads)
    if isinstance(bad, dict):
        with pytest.raises(error, match="the batch"):
            trainer.forward_backward(bad)


def _nan_gradient_at(model, call: int):
    """From the ``call``-th backward on, the classifier's weight gradient is NaN."""
    calls = []

    def hook(grad):
        calls.append(1)
        return grad * float("nan") if len(calls) >= call else grad

    model.classifier.weight.register_hook(hook)


def test_non_finite_gradient_norm_when_clipping_names_the_parameter_and_steps_nothing(model):
    trainer = shardlib.Trainer(model, sgd, max_grad_norm=1.0)
    _nan_gradient_at(model, 1)
    before = weights(model)
    with pytest.raises(FloatingPointError) as err:
        trainer.train_step(batch())
    message = str(err.value)
    assert "the gradient norm is nan (max_grad_norm=1.0); the optimizer did not step" in message
    assert "Non-finite gradients on this rank: classifier.weight." in message
    assert unchanged(model, before)


def test_fit_names_the_step_whose_gradient_norm_is_not_finite(model):
    trainer = shardlib.Trainer(model, sgd, max_grad_norm=1.0)
    _nan_gradient_at(model, 3)  # the third step
    samples = [{k: v[i] for k, v in batch(12).items()} for i in range(12)]
    with pytest.raises(FloatingPointError, match=r"^step 3 \(epoch 0\): the gradient norm is nan") as err:
        trainer.fit(samples, batch_size=4, max_steps=5, progress=False, shuffle=False)
    assert "classifier.weight" in str(err.value)


@pytest.mark.parametrize("field, value, message", [
    ("lr", -1e-3, "--lr must be a finite number >= 0, got -0.001"),
    ("lr", float("nan"), "--lr must be a finite number >= 0, got nan"),
    ("weight_decay", -0.1, "--weight-decay must be a finite number >= 0, got -0.1"),
    ("warmup_ratio", 1.0, "--warmup-ratio must be in [0, 1), got 1.0"),
    ("max_grad_norm", 0.0, "--max-grad-norm must be a positive finite number (or None: no clipping), got 0.0"),
    ("max_grad_norm", -1.0, "--max-grad-norm must be a positive finite number (or None: no clipping), got -1.0"),
    ("epochs", 0, "--epochs must be >= 1 when given, got 0"),
    ("max_steps", -5, "--max-steps must be >= 1 when given, got -5"),
    ("save_interval", 0, "--save-interval must be >= 1 when given, got 0"),
    ("eval_batch_size", 0, "--eval-batch-size must be >= 1 when given, got 0"),
    ("dp", 0, "--dp must be >= 1 when given, got 0"),
    ("nproc", 0, "--nproc must be >= 1 when given, got 0"),
    ("num_workers", -1, "--num-workers must be >= 0, got -1"),
    ("zero", 4, "--zero must be one of 0, 1, 2, 3, got 4"),
    ("bucket_mb", 0.0, "--bucket-mb must be positive, got 0.0"),
    ("ep", 0, "--ep must be >= 1, got 0"),
    ("expert_capacity", 1.0, "--expert-capacity sets expert parallelism's static capacity: give --ep N too"),
])
def test_training_arguments_refuse_invalid_values(field, value, message):
    with pytest.raises(ValueError) as err:
        TrainingArguments(**{field: value})
    assert str(err.value) == message


@pytest.mark.parametrize("options, message", [
    (dict(ep=2, expert_capacity=0.0), "--expert-capacity must be a positive capacity factor, got 0.0"),
])
def test_expert_parallel_arguments_refuse_what_ep_does_not_combine_with(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainingArguments(**options)
    assert TrainingArguments(ep=2, expert_capacity=1.5).shard_options() == {"expert_capacity": 1.5}


def test_training_arguments_defaults_are_valid():
    args = TrainingArguments()
    assert args.trainer_options()["max_grad_norm"] == 1.0 and args.fit_options()["lr_scheduler"] is None


def test_the_model_outputs_are_freed_before_backward(model):
    """The step keeps the loss alone through backward: a language model's logits (batch x vocabulary) held by the
    outputs object would add one such tensor to every step's peak (the dry run, rightly, counts none)."""
    import weakref

    held, alive_in_backward = [], []
    model.register_forward_hook(lambda module, args, output: held.append(weakref.ref(output.logits)))
    model.classifier.weight.register_hook(lambda grad: alive_in_backward.append(held[-1]() is not None))
    shardlib.Trainer(model, sgd).train_step(batch())
    assert alive_in_backward == [False]
