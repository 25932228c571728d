"""Rank tasks for ``Trainer.fit`` (see harness.py) and the unsharded reference the driver compares them with.

A spec is a model case of bert_cases / vit_cases / t5_cases plus ``layout`` ({"dp", "pp", "tp"}), ``steps``,
``batch_size``, ``microbatches``, ``samples`` (dataset size) and optional ``eval_samples``, ``save``/``resume``
options. The dataset is ``samples`` rows of the case's batch, one dict per sample, so the global batches ``fit``
forms (``shardlib.train.epoch_order``) can be rebuilt by the reference.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import shardlib
from shardlib.train import epoch_order
from shardlib.train.optim import held_state_bytes, param_state

from harness import mesh as pool_mesh
from rank_tasks import cases

MAX_GRAD_NORM = 1.0


def adamw(params):
    # eps = 1e-3: see rank_tasks.py (a pure-rounding-noise gradient must not move a weight by ~lr)
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-3, weight_decay=0.01)


def dataset(spec: dict, samples: int, offset: int = 0) -> tuple[list[dict], object]:
    family = cases(spec)
    model_spec = {**spec, "batch": samples, "seed": spec["seed"] + offset}
    config = family.make_config(spec)
    batch = family.make_batch(model_spec, config)
    dtype = getattr(torch, spec["dtype"])
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    return [{k: v[i] for k, v in batch.items()} for i in range(samples)], config


def accuracy(out, mb):
    """Per-example correctness of a classifier, or of the first target of a token model (any per-example value)."""
    labels = mb["labels"]
    logits = out["logits"]
    if labels.dim() == 1:
        return (logits.argmax(-1) == labels).double()
    return (logits[:, 0].argmax(-1) == labels[:, 0]).double()


def build_sharded(spec: dict):
    layout = spec["layout"]
    mesh = pool_mesh(dp=layout.get("dp"), pp=layout.get("pp", 1), tp=layout.get("tp", 1), sp=layout.get("sp", 1))
    model = shardlib.shard(cases(spec).make_model(spec), mesh, **spec.get("shard", {}))
    return mesh, model


def fit_run(spec: dict, workdir: str | None = None) -> dict:
    """``fit`` at ``spec["layout"]``: every step's loss and the evaluations (rank 0's view, same on all ranks)."""
    mesh, model = build_sharded(spec)
    trainer = shardlib.Trainer(model, adamw, microbatches=spec["microbatches"], max_grad_norm=MAX_GRAD_NORM,
                               schedule=spec.get("schedule", "1f1b"), **spec.get("trainer", {}))
    train, _ = dataset(spec, spec["samples"])
    evals = dataset(spec, spec["eval_samples"], offset=100)[0] if spec.get("eval_samples") else None
    metrics = {"accuracy": accuracy} if spec.get("metrics") else None
    options = {k: spec[k] for k in ("save_interval", "keep_last", "eval_interval", "eval_batch_size", "epochs",
                                    "async_save") if k in spec}
    save_dir = str(Path(workdir) / spec["save_dir"]) if spec.get("save_dir") else None
    resume = spec.get("resume")
    if resume not in (None, "auto"):
        resume = str(Path(workdir) / resume)
    result = trainer.fit(train, eval_data=evals, batch_size=spec["batch_size"], max_steps=spec["steps"],
                         seed=spec.get("data_seed", 0), save_dir=save_dir, resume=resume, metrics=metrics,
                         log_interval=1, progress=False, **options)
    dist.barrier()
    scaler = trainer.scaler
    return {"losses": result.losses, "first_step": result.first_step, "evals": result.evals,
            "checkpoints": [str(p) for p in result.checkpoints], "mesh": str(mesh),
            "optimizer_bytes": optimizer_bytes(trainer), "scaler": scaler.state_dict() if scaler else None,
            "ddp": getattr(trainer.data_parallel, "ddp", None) is not None,
            "left_out_of_ddp": len(getattr(trainer.data_parallel, "left_out_of_ddp", [])),
            "find_unused": getattr(getattr(trainer.data_parallel, "ddp", None), "find_unused_parameters", None)}


def optimizer_bytes(trainer) -> int:
    """Bytes of optimizer state (moments, master weights) this rank holds."""
    return held_state_bytes(trainer.optimizer, trainer.params)


def expect_error(spec: dict, workdir: str, case: str) -> str:
    """Run one bad-input case of ``fit`` on every rank; return the error's type and message (or "no error")."""
    mesh, model = build_sharded(spec)
    train, _ = dataset(spec, spec["samples"])
    trainer = shardlib.Trainer(model, adamw, microbatches=spec["microbatches"])
    options = dict(batch_size=spec["batch_size"], max_steps=2, progress=False,
                   save_dir=str(Path(workdir) / "bad-input"))
    if case == "indivisible_batch":
        options["batch_size"] = 6
    elif case == "empty":
        train = []
    elif case == "no_length":
        options.pop("max_steps")
    elif case == "scheduler_type":
        options["lr_scheduler"] = lambda optimizer: "not a scheduler"
    elif case == "forward_step_type":
        trainer = shardlib.Trainer(model, adamw, microbatches=spec["microbatches"], forward_step=lambda m, b: 3)
    elif case == "loss_not_scalar":
        trainer = shardlib.Trainer(model, adamw, microbatches=spec["microbatches"],
                                   forward_step=lambda m, b: m(**b).logits)
    elif case.startswith("resume:"):
        options["resume"] = str(Path(workdir) / case.split(":", 1)[1])
    try:
        trainer.fit(train, **options)
        return "no error"
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        dist.barrier()


def reference_run(spec: dict) -> dict:
    """The unsharded model trained on the same global batches (one process): losses and final evaluation."""
    model = cases(spec).make_model(spec)
    opt = adamw(model.parameters())
    train, _ = dataset(spec, spec["samples"])
    losses = []
    per_epoch = len(train) // spec["batch_size"]
    for step in range(spec["steps"]):
        epoch, index = divmod(step, per_epoch)
        order = epoch_order(len(train), spec.get("data_seed", 0), epoch)
        picked = order[index * spec["batch_size"]:(index + 1) * spec["batch_size"]].tolist()
        batch = torch.utils.data.default_collate([train[i] for i in picked])
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        losses.append(loss.item())
    result = {"losses": losses}
    if spec.get("eval_samples"):
        result["eval"] = reference_eval(model, spec)
    return result


@torch.no_grad()
def reference_eval(model, spec: dict) -> dict:
    model.eval()
    data, _ = dataset(spec, spec["eval_samples"], offset=100)
    batch = torch.utils.data.default_collate(data)
    out = model(**batch)
    # the model's loss on the whole eval set: a mean over its loss items (what fit's weighted sum recovers)
    result = {"loss": float(out.loss), "samples": len(data)}
    if spec.get("metrics"):
        result["accuracy"] = float(accuracy(out, batch).mean())
    model.train()
    return result


def first_step_stage_forwards(spec: dict) -> list[int]:
    """How many forwards each pipeline stage runs in the first two steps (torch's schedules add one in the first,
    to infer boundary shapes; the runner keeps that one from drawing dropout masks, which relies on it coming
    first)."""
    mesh, model = build_sharded(spec)
    trainer = shardlib.Trainer(model, adamw, microbatches=spec["microbatches"])
    calls = []
    for stage in trainer.split.stage_modules:
        stage.register_forward_pre_hook(lambda module, args: calls.append(module.shape_inference_pending))
    train, _ = dataset(spec, spec["batch_size"])
    batch = torch.utils.data.default_collate(train)
    counts = []
    for _ in range(2):
        calls.clear()
        trainer.train_step(batch)
        counts.append(list(calls))
    return counts


def inject_inf(spec: dict) -> dict:
    """One clean fp16 step, then one step per entry of ``spec["inject"]`` (mesh coordinates, e.g. {"dp": 0, "tp": 1})
    in which the gradient of one parameter on the rank at those coordinates is inf: what every rank saw."""
    mesh, model = build_sharded(spec)
    trainer = shardlib.Trainer(model, adamw, microbatches=spec["microbatches"], max_grad_norm=MAX_GRAD_NORM,
                               precision="fp16", **spec.get("trainer", {}))
    train, _ = dataset(spec, spec["batch_size"])
    batch = shardlib.dp_shard(torch.utils.data.default_collate(train), mesh)
    trainer.train_step(batch)
    before = snapshot(trainer)
    scales, injected = [], []
    for coordinates in spec["inject"]:
        here = all(mesh.local_rank(dim) == index for dim, index in coordinates.items())
        hook = trainer.params[-1].register_hook(lambda grad: grad + float("inf")) if here else None
        trainer.train_step(batch)
        if hook is not None:
            hook.remove()
        injected.append(here)
        scales.append((trainer.scaler.scale, trainer.last_step_skipped, trainer.scaler.skipped))
    after = snapshot(trainer)
    unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return {"injected": injected, "scales": scales, "unchanged": unchanged}


def snapshot(trainer) -> dict:
    """Every parameter and optimizer state tensor of this rank, copied."""
    out = {f"param{i}": p.detach().clone() for i, p in enumerate(trainer.params)}
    for i, p in enumerate(trainer.params):
        for key, value in param_state(trainer.optimizer, p).items():
            if torch.is_tensor(value):
                out[f"state{i}.{key}"] = value.detach().clone()
    return out



def autocast_losses(spec: dict) -> dict:
    """One ``train_step`` and one ``eval_step`` of the sharded model at ``spec["layout"]`` under
    ``spec["precision"]`` (every dp rank given the whole batch, so the step's loss is the batch's), next to the
    unsharded model's loss under the same autocast, as transformers computes it: float32."""
    family = cases(spec)
    reference = family.make_model(spec)
    batch = family.make_batch(spec, reference.config)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec["precision"]]
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        want = reference(**batch).loss
    _, model = build_sharded(spec)
    trainer = shardlib.Trainer(model, lambda params: torch.optim.SGD(params, lr=0.0), precision=spec["precision"],
                               microbatches=spec["layout"].get("pp", 1))
    evaluated = trainer.eval_step(batch)
    return {"reference": want.item(), "reference_dtype": str(want.dtype), "train_step": trainer.train_step(batch),
            "eval": [(float(out["loss"]), str(out["loss"].dtype)) for out in evaluated]}


def pipelined_gradients_against_unpipelined(spec: dict, unpipelined: dict, zero: int) -> float:
    """The largest relative difference of a parameter's gradient (those of this rank's pipeline stages) between
    ``spec``'s pipelined layout at ``zero`` and ``unpipelined`` (zero=0) after one step's backward and dp sum, on the
    same global batch."""
    def gradients(run: dict, stage: int) -> dict:
        mesh, model = build_sharded(run)
        trainer = shardlib.Trainer(model, adamw, microbatches=run["microbatches"], max_grad_norm=None,
                                   zero=stage, **run.get("trainer", {}))
        samples, _ = dataset(run, run["samples"])
        batch = {k: torch.stack([s[k] for s in samples[:run["batch_size"]]]) for k in samples[0]}
        trainer.forward_backward(shardlib.dp_shard(batch, mesh))
        trainer.reduce_gradients()
        return shardlib.full_state_dict(model, grads=True)

    reference, got = gradients(unpipelined, 0), gradients(spec, zero)
    return max((float((got[k] - reference[k]).norm() / reference[k].norm()) for k in got), default=0.0)
