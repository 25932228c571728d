"""Rank-pool tasks of tests/test_moe.py: mixture-of-experts models sharded at a layout against the unsharded model
built under the same seed (outputs, every gradient, the weights after AdamW)."""

from __future__ import annotations

import copy

import torch

import shardlib
from harness import mesh as pool_mesh
from moe_cases import build_batch, build_model, routed_tokens
from rank_tasks import compare_training_step

SEQUENCE = {"none": False, "megatron": True, "all_to_all": "all_to_all", "ring": "ring"}


def moe_equivalence(family: str, tp: int = 2, sequence: str = "none", sp: int = 1, *, labels: bool = False,
                    dtype: str = "float64", seq: int = 9, **model_options) -> dict:
    """``family`` sharded at tp (and sequence parallelism: Megatron on tp, or ``sp`` ranks all-to-all / ring) ==
    unsharded, in ``dtype``. Compared at float64 tolerances where the model computes in float64 throughout (Switch
    with a float64 router); the decoders route in float32 whatever the model's dtype (transformers' upcast before
    the softmax, rounding the routing weights to float32), so they are compared at float32 tolerances."""
    dtype = getattr(torch, dtype)
    ref = build_model(family, dtype=dtype, **model_options)
    model = shardlib.shard(copy.deepcopy(ref), pool_mesh(tp=tp, sp=sp), gather_logits=True,
                           sequence_parallel=SEQUENCE[sequence])
    batch = build_batch(family, labels=labels, seq=seq)
    kept, routed = routed_tokens(ref, batch) if family == "switch" else (0, 0)
    exact = dtype == torch.float64 and family == "switch" and model_options.get("router_dtype", "float64") == "float64"
    compared = compare_training_step(ref, model, batch, torch.float64 if exact else torch.float32)
    report = shardlib.report(model)
    return {**compared, "kept": kept, "routed": routed, "local_fraction": report.local_bytes / report.unsharded_bytes,
            "policy": report.policy}


def shard_refusal(family: str, tp: int = 1, sequence: str = "none", sp: int = 1, ep: int = 1,
                  expert_capacity: float | None = None, **model_options) -> str:
    """The PlanError of sharding ``family`` at this layout ("no error" if none), the model left untouched."""
    model = build_model(family, **model_options)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        shardlib.shard(model, pool_mesh(tp=tp, sp=sp, ep=ep), sequence_parallel=SEQUENCE[sequence],
                       expert_capacity=expert_capacity)
        return "no error"
    except shardlib.PlanError as exc:
        after = model.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        return str(exc)


def trainer_equivalence(family: str, tp: int = 1, pp: int = 1, *, zero: int = 0, checkpointing: bool = False,
                        microbatches: int = 2, steps: int = 2, per_rank: int = 4, seq: int = 9, ep: int = 1,
                        expert_capacity: float | None = None, max_grad_norm: float | None = None,
                        sequence: str = "none", sp: int = 1, **model_options) -> dict:
    """``steps`` Trainer steps (AdamW) of ``family`` at dp x pp x tp (dp: the rest of the pool) with ZeRO ``zero``
    and activation checkpointing, each dp rank training on its share of the global batch, against the unsharded
    model's steps on the whole batch: every weight afterwards, and the losses (float32 tolerances where the model
    computes its loss in float32: the causal LMs)."""
    from shardlib.train import Trainer, dp_shard

    from rank_tasks import TOL, _adamw

    mesh = pool_mesh(tp=tp, pp=pp, sp=sp, ep=ep)
    ref = build_model(family, **model_options)
    model = shardlib.shard(copy.deepcopy(ref), mesh, expert_capacity=expert_capacity,
                           sequence_parallel=SEQUENCE[sequence])
    trainer = Trainer(model, _adamw, microbatches=microbatches, zero=zero, activation_checkpointing=checkpointing,
                      max_grad_norm=max_grad_norm)
    ref_optimizer = _adamw(ref.parameters())
    tol = TOL[torch.float64 if family == "switch" else torch.float32]
    losses = []
    for step in range(steps):
        batch = build_batch(family, batch=per_rank * mesh.dp, seq=seq, seed=10 + step)
        loss = trainer.train_step(dp_shard(batch, mesh))
        ref_optimizer.zero_grad()
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        ref_optimizer.step()
        torch.testing.assert_close(torch.tensor(loss, dtype=torch.float64), ref_loss.detach().double(), **tol)
        losses.append(loss)
    weights = shardlib.full_state_dict(model)
    reference = dict(ref.named_parameters())
    for name, w in weights.items():
        torch.testing.assert_close(w, reference[name].detach(), **tol, msg=lambda m, n=name: f"weight {n}: {m}")
    # experts no token of any rank reached in the last step: no gradient, as in the unsharded model
    idle = [name for name, p in model.named_parameters() if ".experts." in name and p.grad is None]
    # ZeRO-3: the parameters FSDP2 shards over the expert-data-parallel ranks (experts under ep) and over dp
    meshes = [p.device_mesh.mesh_dim_names[0] for p in model.parameters() if hasattr(p, "device_mesh")]
    # ZeRO-1/2: the flat buckets of expert weights, partitioned over the expert-data-parallel ranks
    expert_buckets = sum(b.experts for b in getattr(trainer.optimizer, "buckets", []))
    return {"losses": losses, "weights": len(weights), "idle_expert_params": len(idle),
            "sharded_over": {name: meshes.count(name) for name in set(meshes)}, "expert_buckets": expert_buckets}


def static_capacity_drops(ep: int, factor: float) -> dict:
    """Mixtral at ep with the static capacity ``factor``: the pairs each rank's exchange dropped, as counted by
    shard() (``expert_load``), and as counted here from the router's own choices: per expert, what exceeds
    ``ceil(factor * pairs / experts)`` in its token order."""
    import math

    import torch.distributed as dist

    from shardlib.sharding.experts import expert_load

    mesh = pool_mesh(ep=ep)
    ref = build_model("mixtral", experts=4, top_k=2)
    model = shardlib.shard(copy.deepcopy(ref), mesh, expert_capacity=factor)
    batch = build_batch("mixtral", batch=2, seq=9, labels=False, seed=20 + dist.get_rank())
    chosen = []
    handles = [m.register_forward_hook(lambda mod, args, out: chosen.append(out[2]))
               for m in model.modules() if type(m).__name__ == "MixtralTopKRouter"]
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    expected = 0
    for index in chosen:
        capacity = max(1, math.ceil(factor * index.numel() / 4))
        expected += int((torch.bincount(index.reshape(-1), minlength=4) - capacity).clamp(min=0).sum())
    load = expert_load(model)
    return {"counted": int(sum(d for _, d in load.values())), "expected": expected,
            "routed": int(sum(r for r, _ in load.values())), "layers": len(load)}


def full_state_round_trip_at_ep(family: str, ep: int) -> dict:
    """A full state dict loaded into ep shards (``load_full_state_dict``: each rank keeps its experts) and gathered
    back (``full_state_dict``): bitwise the same, with E/ep experts per rank (Mixtral's 3-D weights split, Switch's
    expert modules kept under their own names)."""
    ref = build_model(family, experts=4)
    model = shardlib.shard(build_model(family, experts=4, seed=5), pool_mesh(ep=ep))
    shardlib.load_full_state_dict(model, ref.state_dict())
    if family == "switch":
        local = len(model.encoder.block[1].layer[1].mlp.experts._modules)
    else:
        local = model.model.layers[0].mlp.experts.gate_up_proj.shape[0]
    full, expected = shardlib.full_state_dict(model), ref.state_dict()
    differing = [name for name, tensor in full.items() if not torch.equal(tensor, expected[name])]
    return {"local_experts": local, "differing": differing, "compared": len(full)}


def hf_checkpoint_into_shards(workdir: str, tp: int = 1, ep: int = 1) -> dict:
    """A Switch HF checkpoint (transformers' save_pretrained) read straight into shards (``shardlib.from_pretrained``:
    each rank reads its slices, its own experts under ep) and written back by ``shardlib.save_pretrained``: the
    gathered weights are the checkpoint's, bitwise, and so is the file written back."""
    import torch.distributed as dist
    import transformers

    from safetensors.torch import load_file

    ref = build_model("switch", experts=4, dtype=torch.float32)
    source, back = f"{workdir}/hf", f"{workdir}/back"
    if dist.get_rank() == 0:
        ref.save_pretrained(source)
    dist.barrier()
    mesh = pool_mesh(tp=tp, ep=ep)
    model = shardlib.from_pretrained(transformers.SwitchTransformersForConditionalGeneration, source, mesh)
    full, expected = shardlib.full_state_dict(model), ref.state_dict()
    differing = [name for name, tensor in full.items() if not torch.equal(tensor, expected[name])]
    written = []
    shardlib.save_pretrained(model, back)
    if dist.get_rank() == 0:
        saved, original = load_file(f"{back}/model.safetensors"), load_file(f"{source}/model.safetensors")
        written = [k for k in original if k not in saved or not torch.equal(saved[k], original[k])]
    return {"differing": differing, "compared": len(full), "written_differing": written}


def generation_matches(family: str, tp: int = 2, ep: int = 1) -> list[list[int]]:
    """Greedy ``generate()`` of the sharded model: the unsharded model's tokens. Under ep each dp rank decodes its
    own prompts for its own number of steps (the ranks of an ep group stop at different steps)."""
    ref = build_model(family, experts=4, dtype=torch.float32, use_cache=True).eval()
    model = shardlib.shard(copy.deepcopy(ref), pool_mesh(tp=tp, ep=ep)).eval()
    rank = pool_mesh(tp=tp, ep=ep).local_rank("dp") if ep > 1 else 0
    ids = build_batch(family, batch=2, seq=5, labels=False, seed=1 + rank)["input_ids"]
    options = dict(max_new_tokens=6 - 2 * (rank % 2), do_sample=False, pad_token_id=0)
    expected = ref.generate(ids, **options)
    got = model.generate(ids, **options)
    assert torch.equal(got, expected), (got, expected)
    return got.tolist()


def packed_refusal() -> str:
    """Switch refuses packed rows (its capacity counts along the whole row), naming why."""
    model = shardlib.shard(build_model("switch", experts=4), pool_mesh())
    batch = {"input_ids": torch.randint(2, 50, (1, 8)), "document_ids": torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]]),
             "labels": torch.randint(2, 50, (1, 4))}
    try:
        model(**batch)
        return "no error"
    except ValueError as exc:
        return str(exc)


def runtime_refusals(workdir: str) -> dict:
    """The refusals that need ranks: an ep that does not divide dp, the static capacity with batches of different
    shapes across the ep group, router losses asked of a pipelined model."""
    import torch.distributed as dist

    messages = {}
    try:
        shardlib.init_mesh(ep=3)
    except shardlib.MeshError as exc:
        messages["mesh"] = str(exc)
    model = shardlib.shard(build_model("mixtral", experts=4), pool_mesh(ep=2), expert_capacity=1.0)
    batch = build_batch("mixtral", batch=1 + dist.get_rank() % 2, labels=False)
    try:
        model(**batch)
    except ValueError as exc:
        messages["shapes"] = str(exc)
    piped = shardlib.shard(build_model("mixtral", experts=4), pool_mesh(pp=2))
    try:
        piped(**build_batch("mixtral"), output_router_logits=True)
    except ValueError as exc:
        messages["pipeline"] = str(exc)
    return messages


def fused_hf_checkpoint(workdir: str, family: str, tp: int = 1, ep: int = 1) -> dict:
    """A decoder's HF checkpoint as transformers writes it (one tensor per expert, Mixtral's under
    ``block_sparse_moe``) read straight into tp or ep shards through transformers' conversion mapping: the gathered
    weights are the model's, bitwise; written back by ``shardlib.save_pretrained`` (fused tensors), which
    transformers' ``from_pretrained`` loads to the same weights."""
    import torch.distributed as dist
    import transformers

    ref = build_model(family, experts=4, dtype=torch.float32, implementation="grouped_mm")
    source, back = f"{workdir}/{family}", f"{workdir}/{family}-back"
    if dist.get_rank() == 0:
        ref.save_pretrained(source)
    dist.barrier()
    cls = getattr(transformers, type(ref).__name__)
    model = shardlib.from_pretrained(cls, source, pool_mesh(tp=tp, ep=ep))
    full, expected = shardlib.full_state_dict(model), ref.state_dict()
    differing = [name for name, tensor in full.items() if not torch.equal(tensor, expected[name])]
    shardlib.save_pretrained(model, back)
    again = cls.from_pretrained(back).state_dict()
    reloaded = [name for name, tensor in expected.items() if not torch.equal(again[name], tensor)]
    return {"differing": differing, "compared": len(full), "reloaded_differing": reloaded}


def static_capacity_compiles(ep: int = 2) -> dict:
    """Mixtral (batched_mm experts) at ep with the static capacity under torch.compile: one graph, no break
    (``torch._dynamo.explain``), and a compiled forward + backward (aot_eager) gives the eager loss and gradients."""
    import torch.distributed as dist

    ref = build_model("mixtral", experts=4, dtype=torch.float32, implementation="batched_mm")
    model = shardlib.shard(copy.deepcopy(ref), pool_mesh(ep=ep), expert_capacity=2.0)
    batch = build_batch("mixtral", batch=2, seed=4 + dist.get_rank())
    explained = torch._dynamo.explain(model)(**batch)
    torch._dynamo.reset()
    eager = model(**batch).loss
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager")(**batch).loss
    compiled.backward()
    worst = max(float((p.grad - grads[n]).abs().max()) for n, p in model.named_parameters())
    torch._dynamo.reset()
    return {"graphs": explained.graph_count, "breaks": len(explained.break_reasons),
            "loss": abs(float(compiled) - float(eager)), "grads": worst}


def fit_logs_expert_load(workdir: str) -> list[dict]:
    """``fit`` of Switch at dp=4 with a JSONL log: each record carries every MoE layer's tokens per expert and the
    share its capacity dropped, summed over the data-parallel ranks."""
    import json

    from shardlib.train import Trainer

    from rank_tasks import _adamw

    model = shardlib.shard(build_model("switch", experts=4, capacity=2), pool_mesh())
    samples = [{k: v[0] for k, v in build_batch("switch", batch=1, seed=i).items()} for i in range(16)]
    Trainer(model, _adamw).fit(samples, batch_size=8, max_steps=2, log_interval=1, save_dir=workdir, progress=False,
                               shuffle=False)
    import torch.distributed as dist

    dist.barrier()
    lines = open(f"{workdir}/log.jsonl").read().splitlines()
    return [json.loads(line) for line in lines if '"experts"' in line]


def checkpoint_at_ep(workdir: str, family: str) -> dict:
    """An HF checkpoint read at ep=2 x tp=2, saved sharded, read at ep=4, saved again and exported to HF: bitwise the
    first checkpoint. Then training resumes across expert layouts: one AdamW step at ep=2 of dp=4 with ZeRO-2 (the
    experts' state partitioned over the two ranks holding them, gathered on save), model and optimizer saved,
    loaded at ep=4, a second step there == the unsharded model's two steps."""
    import torch.distributed as dist
    import transformers
    from safetensors.torch import load_file

    from shardlib.train import Trainer, dp_shard

    from rank_tasks import TOL, _adamw

    options = {"router_dtype": "float64", "capacity": 2} if family == "switch" else {}
    ref = build_model(family, experts=4, dtype=torch.float32, **options)
    cls = getattr(transformers, type(ref).__name__)
    hf, at2, at4, back = (f"{workdir}/{name}" for name in ("hf", "ep2", "ep4", "back"))
    if dist.get_rank() == 0:
        ref.save_pretrained(hf)
    dist.barrier()
    model = shardlib.from_pretrained(cls, hf, pool_mesh(tp=2, ep=2))
    shardlib.checkpoint.save(model, at2)
    again = shardlib.checkpoint.from_sharded(cls, at2, pool_mesh(ep=4))
    shardlib.checkpoint.save(again, at4)
    shardlib.checkpoint.export_hf(at4, back) if dist.get_rank() == 0 else None
    dist.barrier()
    # the export holds the fused tensors (Mixtral), which transformers' from_pretrained loads to the same weights;
    # a model whose checkpoint has no conversion (Switch) gets the very same file
    original, exported = load_file(f"{hf}/model.safetensors"), load_file(f"{back}/model.safetensors")
    differing = sorted(k for k in original if k in exported and not torch.equal(original[k], exported[k]))
    if family == "switch":
        differing += sorted(set(original) ^ set(exported))
    loaded, expected = cls.from_pretrained(back).state_dict(), ref.state_dict()
    differing += sorted(k for k in expected if not torch.equal(loaded[k], expected[k]))

    ref = build_model(family, experts=4, dtype=torch.float64, **options)
    mesh2, mesh4 = pool_mesh(ep=2), pool_mesh(ep=4)
    first = Trainer(shardlib.shard(copy.deepcopy(ref), mesh2), _adamw, zero=2)
    ref_optimizer = _adamw(ref.parameters())
    batches = [build_batch(family, batch=8, seed=20 + step) for step in range(2)]
    for batch in batches:
        ref_optimizer.zero_grad()
        ref(**batch).loss.backward()
        ref_optimizer.step()
    first.train_step(dp_shard(batches[0], mesh2))
    shardlib.checkpoint.save(first.model, f"{workdir}/resume", optimizer=first.optimizer)
    second = Trainer(shardlib.shard(build_model(family, experts=4, dtype=torch.float64, **options), mesh4), _adamw)
    shardlib.checkpoint.load(second.model, f"{workdir}/resume", optimizer=second.optimizer)
    second.train_step(dp_shard(batches[1], mesh4))
    weights, reference = shardlib.full_state_dict(second.model), dict(ref.named_parameters())
    tol = TOL[torch.float64 if family == "switch" else torch.float32]
    for name, w in weights.items():
        torch.testing.assert_close(w, reference[name].detach(), **tol, msg=lambda m, n=name: f"weight {n}: {m}")
    return {"differing": differing, "compared": len(original), "resumed": len(weights)}
