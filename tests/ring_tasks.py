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


def spec_wire(spec: dict) -> dict:
    """Ring attention of a MaskSpec over the world's ranks (a ring of all of them), float64: this rank's output and
    q / k / v gradients equal dense attention's under the spec's [L, L] mask, and the K/V and dK/dV blocks this rank
    sent (counted at the wire; K/V blocks travel in forward and again in backward) are those
    :meth:`RingProblem.sees` asks for: none where the documents stay within each rank's segments."""
    import math

    import torch.distributed as dist

    from shardlib.kernels import ring_blocks
    from shardlib.kernels.mask_spec import MaskSpec
    from shardlib.kernels.ring_blocks import RingGeometry, RingLayout, RingProblem, ring_attention

    n, rank, length = dist.get_world_size(), dist.get_rank(), spec["length"]
    ids = torch.tensor(spec["ids"])[None]
    mask = MaskSpec(ids, ids, causal=spec["causal"])
    layout = RingLayout(ranks=n, ring=n)
    geometry = RingGeometry(rank, n, layout.padded(length) // n, length, layout.order(length, "cpu"))
    problem = RingProblem(dist.group.WORLD, geometry, 0.5, torch.float64, spec=mask)
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(1, 2, layout.padded(length), 4, generator=g, dtype=torch.float64) for _ in range(3)]
    mine = [t[:, :, geometry.positions(rank)].clone().requires_grad_(True) for t in full]
    sent = []
    start = ring_blocks._Ring.start

    def counted(ring, send, tag, hop=1, outgoing=True, incoming=True):
        if outgoing:
            sent.append((tag, (ring.rank + hop) % ring.size))
        return start(ring, send, tag, hop, outgoing, incoming)

    ring_blocks._Ring.start = counted
    try:
        out = ring_attention(problem, *mine)
        out.backward(torch.ones_like(out))
    finally:
        ring_blocks._Ring.start = start
    reference = [t[:, :, :length].clone().requires_grad_(True) for t in full]
    q, k, v = reference
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~mask.dense("sdpa", torch.float64), -math.inf)
    expected = torch.softmax(scores, -1) @ v
    real = geometry.positions(rank) < length
    expected[:, :, geometry.positions(rank)[real]].backward(torch.ones_like(out[:, :, real]))
    _exact("output", out[:, :, real], expected[:, :, geometry.positions(rank)[real]].detach())
    _exact("dq", mine[0].grad[:, :, real], q.grad[:, :, geometry.positions(rank)[real]])
    seen = {(position, src) for position in range(n) for src in range(n) if problem.sees(position, src)}
    expected_sent = sorted(2 * [(0, position) for position in range(n) if position != rank and (position, rank) in seen]
                           + [(1, src) for src in range(n) if src != rank and (rank, src) in seen])  # K/V: twice
    assert sorted(sent) == expected_sent, (sorted(sent), expected_sent)
    return {"sent": len(sent), "dk": k.grad.detach(), "dv": v.grad.detach(),
            "mine_dk": mine[1].grad.detach(), "mine_dv": mine[2].grad.detach(),
            "positions": geometry.positions(rank)}
