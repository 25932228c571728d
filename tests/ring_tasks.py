"""Rank-side tasks of the ring-attention tests (tests/test_ring_attention.py)."""

from __future__ import annotations

import torch

import shardlib
from shardlib.train import Trainer, dp_shard

from harness import mesh as pool_mesh
from pipeline_tasks import build, first_output_objective, reference_loss
from rank_tasks import DTYPES, _adamw, cases, cast_batch

#: float64 training steps: relative 1e-10 (atol for gradients that cancel to ~0)
EXACT = dict(rtol=1e-10, atol=1e-12)


def training_steps(spec: dict) -> dict:
    """``spec["steps"]`` Trainer steps (a new batch each) of the sharded model (any dp x pp x sp x tp, the Trainer's
    microbatches and ``spec["trainer"]``'s options) against the unsharded model: every step's loss, and every
    gradient (without ZeRO: ZeRO-1/2 keep this rank's partition of them) and weight after AdamW (up to ZeRO-2:
    ZeRO-3's are FSDP2's dp shards, whose next losses are compared) equal to ``EXACT``."""
    spec = {"pp": 1, "schedule": "1f1b", "microbatches": 1, "steps": 3, "trainer": {}, **spec}
    mesh, ref, model, batch = build(spec)
    has_loss = "labels" in batch  # without labels (a causal LM here): a weighted sum of the first output
    trainer = Trainer(model, _adamw, microbatches=spec["microbatches"], schedule=spec["schedule"],
                      loss_fn=None if has_loss else first_output_objective, **spec["trainer"])
    zero = spec["trainer"].get("zero", 0)
    ref_opt, ref_params = _adamw(ref.parameters()), dict(ref.named_parameters())
    compared = 0
    for step in range(spec["steps"]):
        batch = cast_batch(cases(spec).make_batch({**spec, "seed": spec["seed"] + step}, ref.config),
                           DTYPES[spec["dtype"]])
        loss = trainer.forward_backward(dp_shard(batch, mesh))
        trainer.reduce_gradients()
        ref_loss = reference_loss(ref, batch, has_loss)
        ref_loss.backward()
        _exact(f"step {step} loss", torch.tensor(loss, dtype=torch.float64), ref_loss.detach().double())
        for name, g in (shardlib.full_state_dict(model, grads=True) if not zero else {}).items():
            _exact(f"step {step} grad {name}", g, ref_params[name].grad)
            compared += 1
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        for name, w in (shardlib.full_state_dict(model) if zero < 3 else {}).items():
            _exact(f"step {step} weight {name}", w, ref_params[name].detach())
            compared += 1
    return {"compared": compared}


def _exact(name, actual, expected):
    torch.testing.assert_close(actual, expected, **EXACT, msg=lambda m: f"{name}: {m}")


def refusal(spec: dict) -> str:
    """The message of ``shard()``'s refusal of the spec's layout."""
    mesh = pool_mesh(tp=spec["tp"], sp=spec["sp_size"])
    try:
        shardlib.shard(cases(spec).make_model(spec), mesh, sequence_parallel=spec["sp"])
    except shardlib.PlanError as e:
        return str(e)
    raise AssertionError(f"sequence_parallel={spec['sp']!r} was not refused")


def disagreeing_lengths(spec: dict) -> str:
    """Odd sp ranks get one token more: every rank raises, naming the ranks' shapes (no hang, no wrong result)."""
    mesh = pool_mesh(tp=1, sp=spec["sp_size"])
    model = shardlib.shard(cases(spec).make_model(spec), mesh, sequence_parallel="ring")
    batch = cases(spec).make_batch({**spec, "seq": spec["seq"] + mesh.sp_rank % 2}, model.config)
    try:
        model(**batch)
    except RuntimeError as e:
        return str(e)
    raise AssertionError("disagreeing sequence lengths were not caught")
