"""A world of one is the identity: at tp = sp = pp = 1, ``shard()`` leaves every module computing exactly what
transformers computes (the same GEMMs with their biases, the model's own attention and loss, dropout drawn from
torch's default generator), so a sharded model's outputs and gradients are *bitwise* equal to the unsharded
model's, in training mode with dropout on (fp32, eager). Checked for every BERT, ViT and T5 class, with hypothesis
choosing sizes, padding and dropout."""

from __future__ import annotations

import copy

import bert_cases
import pytest
import t5_cases
import torch
import torch.distributed as dist
import vit_cases
from hypothesis import given
from hypothesis import strategies as st

import shardlib

CASES = {**{c: bert_cases for c in bert_cases.CLASSES}, **{c: vit_cases for c in vit_cases.CLASSES},
         **{c: t5_cases for c in t5_cases.CLASSES}}


@pytest.fixture(scope="module")
def mesh():
    """A world of one: an in-process gloo group, destroyed afterwards."""
    mesh = shardlib.init_mesh()
    yield mesh
    dist.destroy_process_group()


def _spec(cls: str, draw) -> dict:
    dropout = draw(st.sampled_from([0.0, 0.1, 0.5]))
    heads, seed = draw(st.integers(1, 3)), draw(st.integers(0, 2**16))
    if CASES[cls] is vit_cases:
        config = dict(image=8, patch=4, heads=heads, head_dim=4, layers=2, intermediate=24, dropout=dropout)
        return dict(cls=cls, seed=seed, batch=2, config=config)
    if CASES[cls] is t5_cases:
        config = dict(vocab=37, d_model=8 * heads, d_kv=4, d_ff=20, layers=2, heads=heads, dropout=dropout,
                      ffn=draw(st.sampled_from(["relu", "gated-gelu"])))
        return dict(cls=cls, seed=seed, batch=2, seq=draw(st.integers(3, 7)), dec_seq=5, config=config)
    config = dict(vocab=41, heads=heads, head_dim=4, layers=2, intermediate=24, dropout=dropout)
    return dict(cls=cls, seed=seed, batch=2, seq=draw(st.integers(3, 9)), padding=draw(st.booleans()),
                config=config)


def _outputs(model, batch: dict, seed: int) -> tuple[dict, dict]:
    """Every tensor output of one training forward (dropout drawn from ``seed``) and every parameter's gradient of
    a loss that reaches all of them."""
    model.train()
    torch.manual_seed(seed)
    out = model(**batch)
    tensors = {k: v for k, v in out.items() if torch.is_tensor(v)}
    objective = sum(v.float().sum() * (i + 1) for i, v in enumerate(tensors.values()) if v.requires_grad)
    objective.backward()
    return tensors, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@given(data=st.data(), cls=st.sampled_from(sorted(CASES)))
def test_world_of_one_is_bitwise_the_unsharded_model(mesh, data, cls):
    cases = CASES[cls]
    spec = _spec(cls, data.draw)
    reference = cases.make_model(spec)
    sharded = shardlib.shard(copy.deepcopy(reference), mesh)
    batch = cases.make_batch(spec, reference.config)

    want_out, want_grads = _outputs(reference, batch, spec["seed"])
    got_out, got_grads = _outputs(sharded, batch, spec["seed"])

    assert want_out.keys() == got_out.keys()
    for name, want in want_out.items():
        assert got_out[name].dtype == want.dtype and torch.equal(got_out[name], want), f"{cls} output {name}"
    assert want_grads.keys() == got_grads.keys(), f"{cls}: other parameters got gradients"
    for name, want in want_grads.items():
        assert torch.equal(got_grads[name], want), f"{cls}: gradient of {name} differs"


def test_sequence_parallelism_at_tp1_says_it_does_nothing(mesh):
    spec = dict(cls="BertForMaskedLM", seed=0, batch=2, seq=6,
                config=dict(vocab=41, heads=2, head_dim=4, layers=1, intermediate=24))
    model = shardlib.shard(bert_cases.make_model(spec), mesh, sequence_parallel=True)
    notes = shardlib.report(model).notes
    assert len(notes) == 1 and "sequence_parallel=True does nothing at tp=1" in notes[0]
    assert "note: sequence_parallel=True does nothing at tp=1" in str(shardlib.report(model))


def test_a_microbatch_without_loss_items_adds_nothing_to_the_step(mesh):
    """HF's token loss over a microbatch whose labels are all -100 is a mean over nothing, NaN; the Trainer weighs
    it by its share of the loss items, 0, so the step's loss and gradients are those of the other microbatch."""
    spec = dict(cls="BertForMaskedLM", seed=0, batch=4, seq=6,
                config=dict(vocab=41, heads=2, head_dim=4, layers=1, intermediate=24, dropout=0.0))
    reference = bert_cases.make_model(spec).double()
    batch = bert_cases.make_batch(spec, reference.config)
    labels = batch["input_ids"].clone()
    labels[2:] = -100  # the second microbatch has no loss item
    batch["labels"] = labels
    trainer = shardlib.Trainer(shardlib.shard(copy.deepcopy(reference), mesh), torch.optim.SGD, microbatches=2)
    trainer.zero_grad()
    loss = trainer.forward_backward(batch)
    expected = reference(**{k: v[:2] for k, v in batch.items()}).loss
    expected.backward()
    assert torch.isfinite(torch.as_tensor(loss)) and torch.allclose(torch.as_tensor(loss, dtype=torch.float64),
                                                                    expected.detach(), rtol=1e-12)
    for name, p in trainer.model.named_parameters():
        want = reference.get_parameter(name).grad
        assert (p.grad is None) == (want is None), name
        if want is not None:
            assert torch.allclose(p.grad, want, rtol=1e-10, atol=1e-14), name
