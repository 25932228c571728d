"""Rank tasks of tests/test_zero.py: ZeRO-1/2 over flat buckets against zero=0 at the same layout, and the gradient
memory a rank holds during backward."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardlib
from shardlib.train.fsdp import local, whole
from shardlib.train.optim import held_state_bytes, param_state
from shardlib.train.zero import FlatZero

from train_tasks import MAX_GRAD_NORM, adamw, build_sharded, dataset


def _batches(spec: dict, mesh) -> list[dict]:
    """``spec["steps"]`` global batches of ``batch_size``, this dp rank's share of each."""
    size = spec["batch_size"]
    train, _ = dataset(spec, size * spec["steps"])
    return [shardlib.dp_shard(torch.utils.data.default_collate(train[i * size:(i + 1) * size]), mesh)
            for i in range(spec["steps"])]


def _train(spec: dict, options: dict) -> dict:
    """``steps`` train_steps at ``spec["layout"]`` with Trainer ``options``: losses, gradient norms, and every
    (tp-local) parameter and optimizer state tensor of this rank's stage afterwards, by parameter name."""
    mesh, model = build_sharded(spec)
    trainer = shardlib.Trainer(model, adamw, microbatches=spec["microbatches"], max_grad_norm=MAX_GRAD_NORM,
                               **spec.get("trainer", {}), **options)
    trainer.track_grad_norm = True
    losses, norms = [], []
    for batch in _batches(spec, mesh):
        losses.append(trainer.train_step(batch))
        norms.append(trainer.last_grad_norm)
    model.state_dict()  # a reader outside a forward: with overlap_param_gather, its hooks wait for the gathers
    names = {id(p): name for name, p in model.named_parameters()}
    params = {names[id(p)]: whole(p).clone() for p in trainer.params}  # zero=3: gathered over dp
    states = {f"{key}.{names[id(p)]}": whole(v).clone() for p in trainer.params
              for key, v in param_state(trainer.optimizer, p).items() if torch.is_tensor(v)}
    held = held_state_bytes(trainer.optimizer, trainer.params)
    buckets = len(trainer.optimizer.buckets) if isinstance(trainer.optimizer, FlatZero) else 0
    # what the model's parameters hold between steps on this rank (zero=3: each one's dp shard, unless left gathered)
    param_bytes = sum(local(p).numel() * p.element_size() for p in trainer.params)
    return {"losses": losses, "norms": norms, "params": params, "states": states, "held": held, "buckets": buckets,
            "param_bytes": param_bytes}


def _worst(a, b) -> float:
    """The largest difference between two tensors (or lists of floats), relative to max(|b|)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale else (a - b).abs().max().item()


def _worst_of_kind(got: dict, base: dict, by_key: bool) -> float:
    """The largest difference over tensors of one kind (all parameters; with ``by_key``, the optimizer states of
    one key: ``exp_avg.<param>``), relative to the largest value of that kind: a parameter whose true gradient is 0
    (an attention key bias: softmax ignores it) gets rounding noise of 1e-23, whose own relative difference means
    nothing."""
    kinds: dict = {}
    for name in base:
        kinds.setdefault(name.split(".")[0] if by_key else "", []).append(name)
    worst = 0.0
    for names in kinds.values():
        scale = max(base[n].abs().max().item() for n in names) or 1.0
        worst = max(worst, max((got[n].double() - base[n].double()).abs().max().item() for n in names) / scale)
    return worst


def zero_equivalence(spec: dict) -> dict:
    """Each ZeRO stage in ``spec["stages"]`` against zero=0 at the same layout, same seed and batches: the worst
    relative difference of the step losses, the gradient norms, every parameter and every optimizer state tensor
    (gathered whole over dp: the checkpoint path) after the steps; the optimizer and parameter bytes each rank
    holds after them."""
    base = _train(spec, {})
    result = {"full": base["held"], "param_bytes": base["param_bytes"]}
    for stage in spec["stages"]:
        got = _train(spec, {"zero": stage, "bucket_mb": spec.get("bucket_mb", 25.0), **spec.get("zero_options", {})})
        assert got["params"].keys() == base["params"].keys() and got["states"].keys() == base["states"].keys(), \
            (sorted(set(got["states"]) ^ set(base["states"])))
        result[stage] = {"losses": _worst(got["losses"], base["losses"]), "norms": _worst(got["norms"], base["norms"]),
                         "params": _worst_of_kind(got["params"], base["params"], False),
                         "states": _worst_of_kind(got["states"], base["states"], True),
                         "held": got["held"], "buckets": got["buckets"], "param_bytes": got["param_bytes"]}
    return result


def gradient_peak(spec: dict) -> dict:
    """The most gradient bytes this rank held at once during one train_step of ``spec`` with zero ``stage``: every
    parameter's ``.grad``, the buckets' gradient shards and the flat buffer in flight, sampled after every
    parameter's gradient arrives and at the moment each bucket's flat buffer is allocated (the full gradients of the
    bucket still alive); with the full gradient bytes and the largest bucket."""
    mesh, model = build_sharded(spec)
    trainer = shardlib.Trainer(model, adamw, microbatches=spec["microbatches"], zero=spec["stage"],
                               bucket_mb=spec["bucket_mb"])
    zero = trainer.optimizer
    params = [p for b in zero.buckets for p in b.params]

    def live(extra: int = 0) -> int:
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        shards = sum(b.grad_shard.numel() * b.grad_shard.element_size() for b in zero.buckets
                     if b.grad_shard is not None)
        flight = zero._inflight[1].numel() * zero._inflight[1].element_size() if zero._inflight else 0
        return grads + shards + flight + extra

    peak = [0]
    original = zero._reduce_scatter

    def reduce_scatter(bucket):
        zero._settle()  # what the original does first; then the new flat buffer is allocated beside the gradients
        peak[0] = max(peak[0], live(bucket.numel * bucket.data.element_size()))
        original(bucket)

    zero._reduce_scatter = reduce_scatter
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: peak.__setitem__(0, max(peak[0], live())))
    trainer.train_step(_batches({**spec, "steps": 1}, mesh)[0])
    full = sum(p.numel() * p.element_size() for p in params)
    bucket = max(b.numel * b.data.element_size() for b in zero.buckets)
    dist.barrier()
    return {"peak": peak[0], "full": full, "bucket": bucket, "buckets": len(zero.buckets),
            "shards": sum(b.numel // zero.dp * b.data.element_size() for b in zero.buckets)}


def refused_optimizers(spec: dict) -> dict:
    """zero=2 with optimizers whose state is not per element: {class name: the error}; the model must be untouched."""
    mesh, model = build_sharded(spec)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    storages = {name: p.data_ptr() for name, p in model.named_parameters()}
    messages = {}
    for cls in (torch.optim.Adafactor, torch.optim.LBFGS):
        try:
            shardlib.Trainer(model, lambda params: cls(params), zero=2)
            messages[cls.__name__] = "no error"
        except ValueError as exc:
            messages[cls.__name__] = str(exc)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.data_ptr() == storages[name], name
    return messages


def full_state_after_zero3(spec: dict) -> dict:
    """One ``train_step`` with ``zero=3`` at ``spec["layout"]`` and the unsharded model's step on the same global
    batch (same seed, same clipping, AdamW): ``shardlib.full_state_dict`` of the parameters and of the gradients,
    each value's type and its worst difference from the unsharded model's; then ``load_full_state_dict`` of new
    full tensors (without a pipeline), read back through ``full_state_dict``."""
    from rank_tasks import cases

    mesh, model = build_sharded(spec)
    trainer = shardlib.Trainer(model, adamw, microbatches=spec["microbatches"], max_grad_norm=MAX_GRAD_NORM, zero=3)
    train, _ = dataset(spec, spec["batch_size"])
    batch = torch.utils.data.default_collate(train)
    trainer.train_step(shardlib.dp_shard(batch, mesh))
    got = {"params": shardlib.full_state_dict(model), "grads": shardlib.full_state_dict(model, grads=True)}

    reference = cases(spec).make_model(spec)
    optimizer = adamw(reference.parameters())
    reference(**batch).loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
    grads = {name: p.grad.clone() for name, p in reference.named_parameters() if p.grad is not None}
    optimizer.step()
    expected = {"params": {name: p.detach() for name, p in reference.named_parameters()}, "grads": grads}

    result = {"layout": str(mesh), "all": sorted(expected["params"])}
    for kind, values in got.items():
        result[kind] = {"names": sorted(values), "types": sorted({type(v).__name__ for v in values.values()}),
                        "shapes": [n for n, v in values.items() if v.shape != expected[kind][n].shape],
                        "worst": _worst_of_kind(values, {n: expected[kind][n] for n in values}, False)}
    if mesh.pp == 1:
        generator = torch.Generator().manual_seed(7)  # the same new values on every rank
        new = {name: torch.randn(p.shape, generator=generator, dtype=p.dtype)
               for name, p in reference.named_parameters()}
        shardlib.load_full_state_dict(model, new)
        back = shardlib.full_state_dict(model)
        result["reloaded"] = back.keys() == new.keys() and all(torch.equal(back[n], new[n]) for n in new)
    return result
