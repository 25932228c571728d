"""Rank tasks for pipeline-parallel models (see harness.py): each builds the unsharded model and its pp x tp (x dp)
sharded copy under the same seed, runs a training step through :class:`shardlib.Trainer` on the global
batch (each dp rank its share), runs the unsharded model on the whole batch, and compares the loss, every
gradient of this rank's stages and every weight after one AdamW step. Tolerances as in rank_tasks.py.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import shardlib
from shardlib.train import Trainer, dp_shard

from harness import mesh as pool_mesh
from rank_tasks import DTYPES, SP_DIM_MODES, TOL, _adamw, _close, cases, cast_batch, set_attention, shard_options

MULTI_STAGE = ("interleaved_1f1b", "looped_bfs")


def first_output_objective(value: torch.Tensor) -> torch.Tensor:
    """For models without a loss: a fixed weighting of the first output; a sum, so it splits over microbatches."""
    return (value.double() * torch.linspace(-1, 1, value.shape[-1], dtype=torch.float64)).sum()


def build(spec: dict):
    mesh = pool_mesh(pp=spec["pp"], tp=spec["tp"], sp=spec.get("sp_size", 1) if spec.get("sp") in SP_DIM_MODES else 1)
    family = cases(spec)
    ref = family.make_model(spec)
    options = shard_options(spec)
    set_attention(ref, options["kernels"].attention)
    stages_per_rank = 2 if spec["schedule"] in MULTI_STAGE else 1
    model = shardlib.shard(copy.deepcopy(ref), mesh, stages_per_rank=stages_per_rank,
                           layers_per_stage=spec.get("layers_per_stage"), **options)
    batch = cast_batch(family.make_batch(spec, ref.config), DTYPES[spec["dtype"]])
    return mesh, ref, model, batch


def reference_loss(ref, batch, has_loss: bool) -> torch.Tensor:
    out = ref(**batch)
    return out.loss if has_loss else first_output_objective(out[next(iter(out.keys()))])


def pipeline_equivalence(spec: dict) -> dict:
    """Loss, every gradient of this rank's stages, and the weights after one AdamW step == unsharded."""
    # HF computes the causal-LM loss in float32 (logits.float()): float32 noise in float64 models too. Masked image
    # modeling divides by (masked pixels + 1e-5): weighting microbatches by their masked patches is exact up to that
    # epsilon, a relative 1e-5 / (masked pixels), far below float32 tolerance but above float64's
    loose = spec["cls"] in ("BertLMHeadModel", "ViTForMaskedImageModeling") or spec["cls"].endswith("ForCausalLM")
    dtype = torch.float32 if loose else DTYPES[spec["dtype"]]
    mesh, ref, model, batch = build(spec)
    compile = {"backend": spec["compile"]} if spec.get("compile") else False
    if compile:
        torch._dynamo.reset()
    has_loss = not spec["cls"].endswith("Model") or spec["cls"].endswith("LMHeadModel")  # base models: no loss
    trainer = Trainer(model, _adamw, microbatches=spec["microbatches"], schedule=spec["schedule"],
                      loss_fn=None if has_loss else first_output_objective, compile=compile)
    if compile:  # the Trainer compiled each layer of this rank's stages in place
        layers = shardlib.analysis.compiling.stage_layers(model)
        assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    loss = trainer.forward_backward(dp_shard(batch, mesh))
    trainer.reduce_gradients()
    ref_loss = reference_loss(ref, batch, has_loss)
    ref_loss.backward()
    # the weighted sum of microbatch losses is formed in float64 by the runtime
    _close("loss", torch.tensor(loss, dtype=torch.float64), ref_loss.detach().double(), dtype)
    grads = shardlib.full_state_dict(model, grads=True)
    ref_params = dict(ref.named_parameters())
    local_names = set(shardlib.full_state_dict(model))
    for name, g in grads.items():  # unused parameters (a base model's pooler): None there, zeros after dp's sum
        expected = ref_params[name].grad
        _close(f"grad {name}", g, expected if expected is not None else torch.zeros_like(g), dtype)
    missing = {n for n in local_names - set(grads) if ref_params[n].grad is not None}
    assert not missing, f"no gradient on the pipelined model for {sorted(missing)}"
    trainer.optimizer.step()
    _adamw(ref.parameters()).step()
    weights = shardlib.full_state_dict(model)
    for name, w in weights.items():
        _close(f"weight after AdamW {name}", w, ref_params[name].detach(), dtype)
    return {"grads": len(grads), "weights": len(weights), "names": sorted(local_names),
            "all_names": sorted(n for n, _ in ref.named_parameters()),
            "stages": [list(s) for s in shardlib.shard_state(model).pipeline.plan.layers]}


def losses_over_steps(spec: dict, steps: int = 3) -> list[float]:
    """Losses of a few training steps (same batch each step); for the determinism test."""
    mesh, ref, model, batch = build(spec)
    trainer = Trainer(model, _adamw, microbatches=spec["microbatches"], schedule=spec["schedule"],
                      max_grad_norm=spec.get("max_grad_norm"), activation_checkpointing=spec.get("checkpointing", False))
    return [trainer.train_step(dp_shard(batch, mesh)) for _ in range(steps)]


def clipping_matches(spec: dict) -> dict:
    """The mesh-wide gradient norm equals the unsharded model's, and clipping scales gradients identically."""
    dtype = DTYPES[spec["dtype"]]
    mesh, ref, model, batch = build(spec)
    trainer = Trainer(model, _adamw, microbatches=spec["microbatches"], schedule=spec["schedule"])
    trainer.forward_backward(dp_shard(batch, mesh))
    trainer.reduce_gradients()
    ref(**batch).loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), spec["max_grad_norm"])
    norm = trainer.clip_grad_norm(spec["max_grad_norm"])
    torch.testing.assert_close(torch.tensor(norm, dtype=torch.float64), ref_norm.double(), **TOL[dtype])
    ref_params = dict(ref.named_parameters())
    grads = shardlib.full_state_dict(model, grads=True)
    for name, g in grads.items():
        _close(f"clipped grad {name}", g, ref_params[name].grad, dtype)
    return {"norm": norm, "grads": len(grads)}


def checkpointing_replays_dropout(spec: dict) -> dict:
    """With dropout on, activation checkpointing gives the same gradients as storing activations: the recompute
    replays both the default and the per-rank (tensor-parallel) dropout streams."""
    results = []
    for checkpointing in (False, True):
        mesh = pool_mesh(pp=spec["pp"], tp=spec["tp"])
        family = cases(spec)
        ref = family.make_model(spec)
        torch.manual_seed(1234)
        model = shardlib.shard(ref, mesh, stages_per_rank=1)
        trainer = Trainer(model, _adamw, microbatches=spec["microbatches"], schedule=spec["schedule"],
                          activation_checkpointing=checkpointing)
        batch = family.make_batch(spec, model.config)
        torch.manual_seed(99)
        loss = trainer.forward_backward(dp_shard(batch, mesh))
        results.append((loss, shardlib.full_state_dict(model, grads=True)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == loss_b, (loss_a, loss_b)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=0, atol=0, msg=lambda m: f"grad {name}: {m}")
    return {"grads": len(grads_a), "loss": loss_a}


def accumulation_matches_one_big_batch(spec: dict) -> dict:
    """train_step over a list of batches == one unsharded step on their concatenation (loss and weights)."""
    dtype = DTYPES[spec["dtype"]]
    mesh, ref, model, batch = build(spec)
    trainer = Trainer(model, _adamw, microbatches=spec["microbatches"], schedule=spec["schedule"])
    half = next(iter(batch.values())).shape[0] // 2
    parts = [{k: v[:half] for k, v in batch.items()}, {k: v[half:] for k, v in batch.items()}]
    loss = trainer.train_step([dp_shard(p, mesh) for p in parts])
    ref_out = ref(**batch)
    ref_out.loss.backward()
    _adamw(ref.parameters()).step()
    _close("accumulated loss", torch.tensor(loss, dtype=torch.float64), ref_out.loss.detach().double(), dtype)
    ref_params = dict(ref.named_parameters())
    weights = shardlib.full_state_dict(model)
    for name, w in weights.items():
        _close(f"weight after accumulated step {name}", w, ref_params[name].detach(), dtype)
    return {"weights": len(weights)}


def bf16_autocast_close(spec: dict) -> dict:
    """bf16 autocast through the pipeline: the loss is the unsharded model's autocast loss to bf16 precision."""
    mesh, ref, model, batch = build(spec)
    trainer = Trainer(model, _adamw, microbatches=spec["microbatches"], schedule=spec["schedule"],
                      precision="bf16")
    loss = trainer.forward_backward(dp_shard(batch, mesh))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = ref(**batch).loss.float().item()
    assert abs(loss - ref_loss) <= 3e-2 * abs(ref_loss), (loss, ref_loss)  # bf16 has 8 bits of mantissa
    grads = shardlib.full_state_dict(model, grads=True)
    assert all(torch.isfinite(g).all() for g in grads.values())
    return {"loss": loss, "ref": ref_loss}


def _layout(spec: dict, side: str) -> dict:
    pp, tp = spec[f"pp_{side}"], spec[f"tp_{side}"]
    return {"pp": pp, "tp": tp, "stages_per_rank": 1}


def pipelined_checkpoint_resumes(spec: dict, workdir: str) -> dict:
    """HF checkpoint -> pipelined shards at layout a (from_pretrained reads only this rank's stage and tp slice)
    -> train 2 steps -> save with AdamW state -> 2 more steps. A fresh model at layout b (from_sharded + optimizer
    load) trains the same 2 steps: the losses agree, bitwise when the layouts are equal; the checkpoint exports to
    an HF checkpoint equal to the full weights at the save."""
    from pathlib import Path

    import transformers

    from shardlib import checkpoint as ckpt

    family = cases(spec)
    work = Path(workdir)
    cls = getattr(transformers, spec["cls"])
    original = family.make_model(spec)
    if dist.get_rank() == 0:
        original.save_pretrained(work / "hf")
    dist.barrier()

    def steps(model, trainer, first, count):
        mesh = shardlib.shard_state(model).mesh
        return [trainer.train_step(dp_shard(family.make_batch({**spec, "seed": spec["seed"] + s}, original.config),
                                            mesh)) for s in range(first, first + count)]

    a, b = _layout(spec, "a"), _layout(spec, "b")
    mesh_a = pool_mesh(pp=a["pp"], tp=a["tp"])
    model = ckpt.from_pretrained(cls, work / "hf", mesh_a).train()
    trainer = Trainer(model, _adamw, microbatches=spec["microbatches"], schedule="gpipe")
    steps(model, trainer, 0, 2)
    ckpt.save(model, work / "sharded", optimizer=trainer.optimizer, overwrite=True)
    saved = shardlib.full_state_dict(model)
    shardlib.save_pretrained(model, work / "live", overwrite=True)  # the live pipelined model straight to HF files
    live = cls.from_pretrained(work / "live").state_dict()
    for name, value in saved.items():  # this rank's stage
        assert torch.equal(live[name], value), f"save_pretrained: {name} differs"
    continued = steps(model, trainer, 2, 2)

    mesh_b = pool_mesh(pp=b["pp"], tp=b["tp"])
    resumed_model = ckpt.from_sharded(cls, work / "sharded", mesh_b).train()
    resumed_trainer = Trainer(resumed_model, _adamw, microbatches=spec["microbatches"], schedule="gpipe")
    ckpt.load(resumed_model, work / "sharded", optimizer=resumed_trainer.optimizer)
    resumed = steps(resumed_model, resumed_trainer, 2, 2)
    if a == b:
        assert resumed == continued, (resumed, continued)
    else:
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(continued), rtol=1e-5, atol=1e-6)
    if dist.get_rank() == 0:
        ckpt.export_hf(work / "sharded", work / "export", overwrite=True)
        exported = cls.from_pretrained(work / "export").state_dict()
        for name, value in saved.items():  # this rank's stage; the other stages are checked by their ranks' files
            assert torch.equal(exported[name], value), f"export: {name} differs"
    dist.barrier()
    return {"continued": continued, "resumed": resumed, "local": len(saved)}


def converted_checkpoint_loads(spec: dict, workdir: str) -> dict:
    """``shardlib convert --tp 2 --pp 2`` output (written offline by the driver) loads bitwise into layout b."""
    from pathlib import Path

    import transformers

    from shardlib import checkpoint as ckpt

    original = cases(spec).make_model(spec)
    mesh = pool_mesh(pp=spec["pp_b"], tp=spec["tp_b"])
    model = ckpt.from_sharded(getattr(transformers, spec["cls"]), Path(workdir) / "converted", mesh)
    expected = original.state_dict()
    local = shardlib.full_state_dict(model)
    for name, value in local.items():
        assert torch.equal(value, expected[name]), f"{name} differs after convert --pp -> load"
    return {"local": sorted(local)}
