"""Tasks that run on every rank of the test pool (see harness.py). Each builds the unsharded model and its sharded
copy under the same seed on every rank, runs both, and checks them against each other here, so a failure
reaches the driver as the failing rank's traceback. Each returns counts of what it compared so the driver can
check that the comparison was not empty.

Tolerances. float32: the sharded model sums the same products in a different order (row-parallel partial sums
are all-reduced; the vocab-parallel softmax normalizes per shard), so results differ by rounding that grows
with depth: rtol 2e-4 / atol 2e-5 on outputs and gradients. float64: the same reorderings at 1e-16 unit
roundoff: rtol 1e-9 / atol 1e-11. Weights after one AdamW step: AdamW's first update is about
lr * g / (|g| + eps), so a gradient that is pure rounding noise in both models (the attention key bias, whose
true gradient is zero because softmax ignores a constant shift; anything before a LayerNorm over 2 features)
would move by up to lr in either direction with the default eps = 1e-8. eps = 1e-3 keeps such a noise update
below lr * 1e-3 (under atol at lr = 1e-3) while real gradients (>> 1e-3 here) still move weights by ~lr, far
above atol, so a wrong update cannot pass.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import shardlib
from shardlib.kernels.attention import set_attention
from harness import mesh as pool_mesh

DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: sequence-parallel modes on the mesh's own sp dimension
SP_DIM_MODES = ("all_to_all", "ring")
TOL = {torch.float32: dict(rtol=2e-4, atol=2e-5), torch.float64: dict(rtol=1e-9, atol=1e-11)}


def cast_batch(batch: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}


def scalar_objective(out) -> torch.Tensor:
    """The loss when the model computed one, else a fixed function of every floating output (nonzero grads)."""
    if getattr(out, "loss", None) is not None:
        return out.loss
    total = 0.0
    for value in out.values():
        if torch.is_tensor(value) and value.is_floating_point():
            total = total + (value.double() * torch.linspace(-1, 1, value.shape[-1], dtype=torch.float64)).sum()
    return total


def _close(name, actual, expected, dtype):
    torch.testing.assert_close(actual, expected, **TOL[dtype], msg=lambda m: f"{name}: {m}")


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-3, weight_decay=0.01)


def cases(spec: dict):
    """The case module of the spec's model family: bert_cases, vit_cases or t5_cases."""
    return importlib.import_module(f"{spec.get('family', 'bert')}_cases")


def spec_mesh(spec: dict):
    """The pool mesh of a spec: ``tp``, and ``sp_size`` ranks per sequence under all-to-all or ring sequence
    parallelism."""
    return pool_mesh(tp=spec["tp"], sp=spec.get("sp_size", 1) if spec.get("sp") in SP_DIM_MODES else 1)


def shard_options(spec: dict) -> dict:
    options = {"sequence_parallel": spec.get("sp", False),
               "kernels": shardlib.kernels.Kernels(**spec.get("kernels", {}))}
    return options | ({"ulysses": spec["ulysses"]} if spec.get("ulysses", 1) > 1 else {})


@contextlib.contextmanager
def transport(spec: dict, mesh):
    """``spec["transport"] == "shm"``: the mesh's tp and sp groups exchange through shared memory inside the block
    (attached on every rank of each group, detached after, so the pool's cached meshes stay as they were)."""
    groups = [mesh.group(d) for d in ("sp", "tp") if mesh.size(d) > 1] if spec.get("transport") == "shm" else []
    from shardlib.parallel import shm

    for group in groups:
        shm.attach(group, timeout_s=60)
    try:
        yield
    finally:
        for group in groups:
            shm.detach(group)


def equivalence(spec: dict) -> dict:
    """Outputs, every gradient and the weights after one AdamW step: sharded == unsharded (over the spec's
    transport)."""
    mesh = spec_mesh(spec)
    with transport(spec, mesh):
        return _equivalence(spec, mesh)


def _equivalence(spec: dict, mesh) -> dict:
    dtype = DTYPES[spec["dtype"]]
    family = cases(spec)
    ref = family.make_model(spec)
    # the same attention implementation in both unless the spec asks for another reference (ViT's eager attention
    # runs its softmax in float32, SDPA in the input dtype: in float64 they differ by ~1e-9)
    set_attention(ref, spec.get("reference_attention", shard_options(spec)["kernels"].attention))
    if spec.get("meta"):
        with torch.device("meta"):
            model = family.make_model(spec)
        shardlib.shard(model, mesh, gather_logits=True, **shard_options(spec))
        assert all(p.device.type == "meta" for p in model.parameters())
        shardlib.load_full_state_dict(model, ref.state_dict())
    else:
        model = shardlib.shard(copy.deepcopy(ref), mesh, gather_logits=True, **shard_options(spec))
    batch = cast_batch(family.make_batch(spec, ref.config), dtype)
    if spec["cls"] == "BertLMHeadModel":
        dtype = torch.float32  # HF's causal-LM loss runs in float32 (logits.float()), so gradients have fp32 noise
    check_kernels_installed(model, shard_options(spec)["kernels"])
    compared = compare_training_step(ref, model, batch, dtype)
    check_fused_gemms_ran(model, shard_options(spec)["kernels"])
    return compared


def accumulated_gradients(spec: dict) -> tuple[int, int, int]:
    """Two forward + ``loss.backward()`` calls without zeroing: every gradient equals the unsharded model's sum of
    both (sequence parallelism's bucketed gradients complete each backward's own contribution). Returns how many
    gradients were compared, how many buckets started, and the most flat copies alive when one started (the one
    before it is settled first: 0)."""
    mesh, family, dtype = spec_mesh(spec), cases(spec), DTYPES[spec["dtype"]]
    ref = family.make_model(spec)
    set_attention(ref, shard_options(spec)["kernels"].attention)
    model = shardlib.shard(copy.deepcopy(ref), mesh, gather_logits=True, **shard_options(spec))
    batch = cast_batch(family.make_batch(spec, ref.config), dtype)
    starts, alive = _count_bucket_starts(model)
    for _ in range(2):
        for m in (ref, model):
            scalar_objective(m(**batch)).backward()
    grads = shardlib.full_state_dict(model, grads=True)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys(), set(grads) ^ set(ref_grads)
    for name, g in ref_grads.items():
        _close(f"accumulated grad {name}", grads[name], g, dtype)
    return len(ref_grads), len(starts), max(alive, default=0)


def _count_bucket_starts(model) -> tuple[list, list[int]]:
    """Record each start of a sequence-parallel gradient bucket of ``model`` (its sync's ``settle_before``, on the
    instances) and how many of the sync's buckets hold a flat copy right after it settled."""
    from shardlib.parallel.gradsync import ReplicatedGradSync

    starts, alive = [], []
    syncs = {id(h): h for m in model.modules() for h in m._forward_pre_hooks.values()
             if isinstance(h, ReplicatedGradSync)}
    for sync in syncs.values():
        def settle_before(bucket, sync=sync, original=sync.settle_before):
            original(bucket)
            starts.append(bucket)
            alive.append(sum(b.flat is not None for s in syncs.values() for b in s.buckets.values()))
        sync.settle_before = settle_before
    return starts, alive


def check_fused_gemms_ran(model, kernels) -> None:
    """With fused QKV on, the fused GEMMs really ran on the sharded linears (installed before the styles replaced
    the linears, they would silently never run)."""
    from shardlib.kernels.fused_qkv import fused_group

    if kernels.fused_qkv and dict(shardlib.shard_state(model).report.kernels).get("fused_qkv"):
        groups = {id(g): g for m in model.modules() if (g := fused_group(m)) is not None}
        assert groups and any(g.fused_gemms for g in groups.values()), list(groups.values())


def check_kernels_installed(model, kernels) -> None:
    """Each kernel switched on is installed wherever the policy lists a site for it (none silently skipped)."""
    installed, plan = dict(shardlib.shard_state(model).report.kernels), shardlib.shard_state(model).plan
    wanted = {"fused_qkv": kernels.fused_qkv and bool(plan.fused_projections)}
    wanted |= {kind: getattr(kernels, kind) and bool(plan.epilogues.get(kind)) for kind in ("bias_gelu", "dropout_add")}
    for kind, expected in wanted.items():
        assert bool(installed.get(kind)) == expected, (kind, installed, kernels)


def compare_training_step(ref, model, batch, dtype) -> dict:
    """Run both models on ``batch``; check outputs, every gathered gradient and every weight after AdamW."""
    out_ref, out = ref(**batch), model(**batch)
    compared = {"outputs": 0, "grads": 0, "weights": 0}
    assert set(out_ref.keys()) == set(out.keys()), (out_ref.keys(), out.keys())
    for key, value in out_ref.items():
        if torch.is_tensor(value):
            _close(f"output {key}", out[key], value, dtype)
            compared["outputs"] += 1
    scalar_objective(out_ref).backward()
    scalar_objective(out).backward()
    grads = shardlib.full_state_dict(model, grads=True)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys(), set(grads) ^ set(ref_grads)
    for name, g in ref_grads.items():
        _close(f"grad {name}", grads[name], g, dtype)
        compared["grads"] += 1
    for m in (ref, model):
        _adamw(m.parameters()).step()
    weights = shardlib.full_state_dict(model)
    for name, p in ref.named_parameters():
        _close(f"weight after AdamW {name}", weights[name], p.detach(), dtype)
        compared["weights"] += 1
    return compared


def roberta_example_equivalence(spec: dict) -> dict:
    """The RoBERTa policy of examples/roberta_policy.py (the policy-authoring guide's worked example)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import roberta_policy
    from transformers import RobertaConfig, RobertaForMaskedLM

    mesh = pool_mesh(tp=spec["tp"])
    config = RobertaConfig(vocab_size=spec["vocab"], hidden_size=8 * spec["tp"], num_hidden_layers=2,
                           num_attention_heads=2 * spec["tp"], intermediate_size=12 * spec["tp"],
                           max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(spec["seed"])
    ref = RobertaForMaskedLM(config)
    model = shardlib.shard(copy.deepcopy(ref), mesh, policy=roberta_policy.POLICY, gather_logits=True)
    g = torch.Generator().manual_seed(spec["seed"])
    ids = torch.randint(3, spec["vocab"], (2, 7), generator=g)
    labels = torch.where(torch.rand(2, 7, generator=g) < 0.5, ids, -100)
    labels[:, 0] = ids[:, 0]
    return compare_training_step(ref, model, {"input_ids": ids, "labels": labels}, torch.float32)


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives dispatched inside the block, by kind (what torch's CommDebugMode counts, without its
    module tracker, which breaks on T5). c10d's in-place ``allreduce_`` (eager) and the functional
    ``all_reduce`` count as one kind."""

    NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
    NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")
    SAME = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather_into_tensor",
            "_reduce_scatter_base_": "reduce_scatter_tensor", "alltoall_base_": "all_to_all_single"}

    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in self.NAMESPACES and func._opname not in self.NOT_COLLECTIVES:
            name = func._opname
            name = self.SAME.get(name, name)
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def collective_counts(spec: dict) -> dict:
    """Collectives per forward and per backward, by op name."""
    model = shardlib.shard(cases(spec).make_model(spec), spec_mesh(spec), **shard_options(spec))
    batch = cases(spec).make_batch(spec, model.config)
    with CollectiveCounter() as fwd:
        out = model(**batch)
    with CollectiveCounter() as bwd:
        scalar_objective(out).backward()
    return {"forward": fwd.counts, "backward": bwd.counts,
            "logits_last_dim": out.logits.shape[-1] if "logits" in out else None}


def _gathered_copies(t: torch.Tensor, group) -> list[torch.Tensor]:
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, t.contiguous(), group=group)
    return copies


def train_steps(model, forward, spec: dict, steps: int) -> list[float]:
    """``steps`` AdamW steps of ``forward`` (the model, or its compiled form) on the spec's batches (seeds + step)."""
    opt = _adamw(model.parameters())
    losses = []
    for step in range(steps):
        batch = cases(spec).make_batch({**spec, "seed": spec["seed"] + step}, model.config)
        loss = scalar_objective(forward(**batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def check_replicas_identical(model, group, sp_dimension: bool) -> int:
    """Every parameter the group replicates (all of them on the sp dimension: all-to-all or ring) is bitwise equal
    across its ranks; returns how many were checked."""
    checked = 0
    for name, p, layout in shardlib.named_layouts(model):
        if layout.is_sharded and not sp_dimension:
            continue
        copies = _gathered_copies(p.detach(), group)
        assert all(torch.equal(copies[0], c) for c in copies[1:]), f"replicated {name} diverged across ranks"
        checked += 1
    return checked


def dropout_training_keeps_replicas_identical(spec: dict, steps: int = 4) -> dict:
    """Train with dropout; replicated parameters stay bitwise identical across the TP group, sharded-activation
    dropout draws differ across TP ranks, replicated-activation dropout draws agree. Under all-to-all sequence
    parallelism on the sp dimension (all-to-all, ring) the group is sp (which replicates every parameter) and the
    per-rank stream the sequence one."""
    mesh = spec_mesh(spec)
    sp_dimension = spec.get("sp") in SP_DIM_MODES
    group, stream = (mesh.group("sp"), "sequence-parallel") if sp_dimension else (mesh.tp_group, "tensor-parallel")
    torch.manual_seed(spec["seed"])
    model = cases(spec).make_model(spec)
    tracker = shardlib.manual_seed(spec["seed"], mesh)
    shardlib.shard(model, mesh, rng_tracker=tracker, **shard_options(spec))
    model.train()
    losses = train_steps(model, model, spec, steps)
    checked = check_replicas_identical(model, group, sp_dimension)
    with tracker.fork(stream):
        sharded_draw = torch.rand(64)
    replicated_draw = torch.rand(64)
    sharded_copies = _gathered_copies(sharded_draw, group)
    replicated_copies = _gathered_copies(replicated_draw, group)
    assert all(not torch.equal(sharded_copies[0], c) for c in sharded_copies[1:]), f"{stream} stream identical"
    assert all(torch.equal(replicated_copies[0], c) for c in replicated_copies[1:]), "default stream differs"
    return {"replicated_checked": checked, "losses": losses}


def divergent_inputs_are_caught(spec: dict) -> str:
    mesh = pool_mesh(tp=spec["tp"])
    model = shardlib.shard(cases(spec).make_model(spec), mesh, check_replicated_inputs=True)
    batch = cases(spec).make_batch(spec, model.config)
    model(**batch)  # identical inputs pass
    batch["input_ids"] = (batch["input_ids"] + mesh.tp_rank) % model.config.vocab_size
    try:
        model(**batch)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("divergent inputs were not detected")


def sharded_logits_with_labels(spec: dict) -> dict:
    """With labels and default gather_logits, logits stay vocab-sharded and the loss equals the unsharded one."""
    mesh = pool_mesh(tp=spec["tp"])
    ref = cases(spec).make_model(spec)
    model = shardlib.shard(copy.deepcopy(ref), mesh)
    batch = cases(spec).make_batch(spec, ref.config)
    out, out_ref = model(**batch), ref(**batch)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=2e-5, atol=2e-6)
    head = model.get_submodule(shardlib.shard_state(model).plan.loss.head)
    local = out.logits[..., : head.valid_out_features]
    expected = out_ref.logits[..., head.vocab_start : head.vocab_start + head.valid_out_features]
    torch.testing.assert_close(local, expected, rtol=2e-5, atol=2e-6)
    return {"local_vocab": out.logits.shape[-1], "valid": head.valid_out_features}


def collective_mappings(spec: dict) -> int:
    """Each Megatron mapping's forward and backward against the math in its docstring, on random data."""
    from shardlib.parallel import collectives as C

    mesh = pool_mesh(tp=spec["tp"])
    group, n, r = mesh.tp_group, mesh.tp, mesh.tp_rank
    g = torch.Generator().manual_seed(spec["seed"])
    shape = (2, 4 * n, 3)
    # per-rank inputs and upstream gradients: rank k's tensors are the k-th of these, every rank knows them all
    xs = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(n)]
    gs = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(n)]
    chunk = lambda t, k, dim=1: t.chunk(n, dim=dim)[k]  # noqa: E731
    checked = 0

    def check(fn, grad_shape_from, expect_out, expect_grad):
        nonlocal checked
        x = xs[r].clone().requires_grad_(True)
        y = fn(x)
        torch.testing.assert_close(y, expect_out, msg=lambda m: f"{fn}: forward {m}")
        y.backward(grad_shape_from[r] if grad_shape_from[r].shape == y.shape else chunk(grad_shape_from[r], r))
        torch.testing.assert_close(x.grad, expect_grad, msg=lambda m: f"{fn}: backward {m}")
        checked += 1

    total = lambda ts: sum(ts)  # noqa: E731
    check(lambda x: C.copy_to_tp(x, group), gs, xs[r], total(gs))
    check(lambda x: C.reduce_from_tp(x, group), gs, total(xs), gs[r])
    small_gs = [chunk(t, k) for k, t in enumerate(gs)]
    check(lambda x: C.scatter_to_tp(x, group, 1), small_gs, chunk(xs[r], r),
          torch.cat(small_gs, dim=1))
    full_gs = [torch.cat([t] * n, dim=1) for t in gs]
    check(lambda x: C.gather_from_tp(x, group, 1), full_gs, torch.cat(xs, dim=1), chunk(full_gs[r], r))
    check(lambda x: C.reduce_scatter_to_tp(x, group, 1), small_gs, chunk(total(xs), r), torch.cat(small_gs, dim=1))
    check(lambda x: C.all_gather_from_tp(x, group, 1), full_gs, torch.cat(xs, dim=1), chunk(total(full_gs), r))
    return checked


def row_linear_blocks(spec: dict) -> list[int]:
    """The row-parallel linear whose forward all-reduce overlaps its GEMM in row blocks
    (:func:`shardlib.parallel.overlap.row_linear`), in 1, 2 and 3 blocks (5 rows: unequal ones), against its math:
    forward ``y = sum_k x_k W_k^T`` over the ranks, backward ``dx_r = g W_r``, ``dW_r = g^T x_r`` (g replicated)."""
    from shardlib.parallel.overlap import _RowLinear

    mesh = pool_mesh(tp=spec["tp"])
    group, n, r = mesh.tp_group, mesh.tp, mesh.tp_rank
    g = torch.Generator().manual_seed(spec["seed"])
    xs = [torch.randn(5, 6, dtype=torch.float64, generator=g) for _ in range(n)]
    ws = [torch.randn(7, 6, dtype=torch.float64, generator=g) for _ in range(n)]
    upstream = torch.randn(5, 7, dtype=torch.float64, generator=g)
    checked = []
    for blocks in (1, 2, 3):
        x, w = xs[r].clone().requires_grad_(True), ws[r].clone().requires_grad_(True)
        y = _RowLinear.apply(x, w, group, blocks)
        torch.testing.assert_close(y, sum(xk @ wk.T for xk, wk in zip(xs, ws)), rtol=1e-12, atol=1e-12)
        y.backward(upstream)
        torch.testing.assert_close(x.grad, upstream @ ws[r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w.grad, upstream.T @ xs[r], rtol=1e-12, atol=1e-12)
        checked.append(blocks)
    return checked


def generation_matches(spec: dict) -> dict:
    """generate() on the sharded seq2seq model (greedy and beam search, KV cache on) returns exactly the tokens
    of the unsharded model."""
    mesh = spec_mesh(spec)
    family = cases(spec)
    ref = family.make_model(spec).eval()
    model = shardlib.shard(copy.deepcopy(ref), mesh, **shard_options(spec))
    batch = family.make_batch({**spec, "labels": False}, ref.config)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    distinct = {}
    for beams in (1, 3):
        options = dict(max_new_tokens=spec.get("new_tokens", 8), do_sample=False, num_beams=beams, use_cache=True,
                       min_new_tokens=spec.get("new_tokens", 8))
        expected = ref.generate(**inputs, **options)
        actual = model.generate(**inputs, **options)
        assert torch.equal(actual, expected), f"num_beams={beams}:\nsharded   {actual.tolist()}\nunsharded {expected.tolist()}"
        distinct[beams] = len(set(expected.flatten().tolist()))
    return distinct


def checkpoint_round_trip(spec: dict, workdir: str) -> dict:
    """HF checkpoint -> sharded at tp_a (slices only) -> sharded save -> load at tp_b (reshard) -> HF export:
    weights bitwise equal to the original at every step, and a forward pass equal after the round trip."""
    from shardlib import checkpoint as ckpt
    import transformers

    family = cases(spec)
    rank = dist.get_rank()
    work = Path(workdir)
    original = family.make_model(spec).eval()
    hf_dir, sharded_dir, export_dir = work / "hf", work / "sharded", work / "export"
    if rank == 0:
        original.save_pretrained(hf_dir)
    dist.barrier()
    cls = getattr(transformers, spec["cls"])
    expected = original.state_dict()

    def check_bitwise(model, stage):
        full = shardlib.full_state_dict(model)
        for name, value in full.items():
            assert torch.equal(value, expected[name]), f"{stage}: {name} differs"
        return len(full)

    def layout(which: str):  # a mesh (all-to-all sequence parallel when sp_<which> > 1) and its shard options
        sp = spec.get(f"sp_{which}", 1)
        return pool_mesh(tp=spec[f"tp_{which}"], sp=sp), ({"sequence_parallel": "all_to_all"} if sp > 1 else {})

    mesh_a, options_a = layout("a")
    model_a = ckpt.from_pretrained(cls, hf_dir, mesh_a, **options_a)
    n = check_bitwise(model_a, f"HF -> {mesh_a}")
    from shardlib.checkpoint import saving as ckpt_save

    write_files, wrote = ckpt_save._write_files, []
    ckpt_save._write_files = lambda *args: wrote.append(True) or write_files(*args)  # which ranks write data files
    try:
        ckpt.save(model_a, sharded_dir, overwrite=True)
    finally:
        ckpt_save._write_files = write_files
    mesh_b, options_b = layout("b")
    model_b = ckpt.from_sharded(cls, sharded_dir, mesh_b, **options_b)
    check_bitwise(model_b, f"sharded {mesh_a} -> {mesh_b}")
    batch = family.make_batch({**spec, "labels": False}, original.config)
    if spec["cls"].endswith("ForConditionalGeneration"):
        batch["decoder_input_ids"] = batch["input_ids"][:, :3]
    out_ref, out = original(**batch), model_b(**batch)
    key = next(k for k, v in out_ref.items() if torch.is_tensor(v))
    torch.testing.assert_close(out[key], out_ref[key], rtol=1e-4, atol=1e-5)
    if rank == 0:
        ckpt.export_hf(sharded_dir, export_dir, overwrite=True, max_shard_bytes=spec.get("max_shard_bytes", 2 << 30))
    # the live model at layout b straight to HF files (collective)
    shardlib.save_pretrained(model_b, work / "live", overwrite=True, max_shard_bytes=spec.get("max_shard_bytes", 2 << 30))
    if rank == 0:
        for directory in (export_dir, work / "live"):
            reloaded = cls.from_pretrained(directory)
            for name, value in reloaded.state_dict().items():
                assert torch.equal(value, expected[name]), f"{directory.name}: {name} differs"
    dist.barrier()
    return {"tensors": n, "wrote": bool(wrote)}


def training_resumes_exactly(spec: dict, workdir: str) -> dict:
    """Train 2 steps at tp_a, save model + AdamW, train 2 more; a fresh model at tp_b loads the checkpoint and
    trains the same 2 steps: the losses agree (bitwise when tp_a == tp_b)."""
    from shardlib import checkpoint as ckpt
    import transformers

    family = cases(spec)
    directory = Path(workdir) / "resume"

    def steps(model, opt, first, count):
        losses = []
        for step in range(first, first + count):
            loss = model(**family.make_batch({**spec, "seed": spec["seed"] + step}, model.config)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    model = shardlib.shard(family.make_model(spec), pool_mesh(tp=spec["tp_a"]))
    opt = _adamw(model.parameters())
    steps(model, opt, 0, 2)
    ckpt.save(model, directory, optimizer=opt, overwrite=True)
    continued = steps(model, opt, 2, 2)
    resumed_model = ckpt.from_sharded(getattr(transformers, spec["cls"]), directory, pool_mesh(tp=spec["tp_b"]))
    resumed_model.train()
    resumed_opt = _adamw(resumed_model.parameters())
    ckpt.load(resumed_model, directory, optimizer=resumed_opt)
    resumed = steps(resumed_model, resumed_opt, 2, 2)
    if spec["tp_a"] == spec["tp_b"]:
        assert resumed == continued, (resumed, continued)
    else:
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(continued), rtol=1e-5, atol=1e-6)
    return {"continued": continued, "resumed": resumed}


def forward_without_backward_frees_graph(spec: dict) -> bool:
    """A training-mode forward whose graph is dropped without backward (e.g. evaluation without no_grad) frees it:
    the saved-tensor hooks of sequence parallelism must not keep a node's own saved output alive."""
    import gc

    def live_tensors() -> int:
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    model = shardlib.shard(cases(spec).make_model(spec), spec_mesh(spec), **shard_options(spec))
    model.train()
    batch = cases(spec).make_batch(spec, model.config)
    before = live_tensors()
    out = model(**batch)
    del out
    return live_tensors() <= before


def reference_sgd_losses(model, samples: list[dict], batch_size: int, steps: int, make_optimizer) -> list[float]:
    """The unsharded ``model`` trained by ``make_optimizer(trainable parameters)`` on ``samples`` in order, in global
    batches of ``batch_size`` (wrapping around): each step's loss, what an unshuffled ``fit`` must reproduce."""
    opt, losses = make_optimizer([p for p in model.parameters() if p.requires_grad]), []
    batches = len(samples) // batch_size
    for step in range(steps):
        start = (step % batches) * batch_size
        batch = torch.utils.data.default_collate(samples[start:start + batch_size])
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
