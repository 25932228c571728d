"""Rank tasks for torch.compile of sharded models (tests/test_compile.py): graph breaks and their origin, compiled
training against eager, compiled dropout streams, compiled T5 generation, compiled pipeline stages."""

from __future__ import annotations

import os

import torch

import shardlib

from rank_tasks import (
    SP_DIM_MODES, _gathered_copies, cases, check_replicas_identical, scalar_objective, shard_options, spec_mesh,
    train_steps,
)

#: Source folders whose code must cause no graph break: shardlib's own (the package and its policies and kernels).
_OWN = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
             for d in ("shardlib", "kernels", "policies"))


def _origin(frames) -> str:
    """Where a graph break happened: the innermost frame in shardlib's code ("shardlib:<file>:<line> <fn>"), else
    the innermost frame outside torch ("<module path>:<fn>" of transformers or the test)."""
    for frame in reversed(frames):
        if frame.filename.startswith(_OWN):
            return f"shardlib:{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    outside = [f for f in frames if f"{os.sep}torch{os.sep}" not in f.filename]
    frame = (outside or frames)[-1]
    return f"{frame.filename.rpartition('site-packages' + os.sep)[2]}:{frame.name}"


def graph_breaks(spec: dict) -> dict:
    """Shard, then count the graph breaks dynamo meets in one forward (training mode unless spec["eval"]), each
    with its origin and reason. ``torch._dynamo.explain`` traces only (nothing is compiled)."""
    torch._dynamo.reset()
    model = shardlib.shard(cases(spec).make_model(spec), spec_mesh(spec), **shard_options(spec))
    model.train(not spec.get("eval"))
    batch = cases(spec).make_batch(spec, model.config)
    explained = torch._dynamo.explain(model)(**batch)
    breaks = [{"origin": _origin(b.user_stack), "reason": str(b.reason).splitlines()[0][:200]}
              for b in explained.break_reasons]
    return {"graphs": explained.graph_count, "breaks": breaks}


def compiles_once(spec: dict, calls: int = 3) -> int:
    """Frames dynamo compiles over ``calls`` training forwards of the compiled sharded model after the first (0:
    nothing in shardlib's modules, kernels' counters included, changes a guard between steps)."""
    torch._dynamo.reset()
    model = shardlib.shard(cases(spec).make_model(spec), spec_mesh(spec), **shard_options(spec))
    compiled = torch.compile(model, backend="eager")
    batch = cases(spec).make_batch(spec, model.config)
    compiled(**batch)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(calls):
        compiled(**batch)
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


def compiled_matches_eager(spec: dict) -> dict:
    """The sharded model compiled (``spec["compile"]``: the backend) against the same sharded model in eager mode:
    outputs, every gradient and the weights after one AdamW step. Dropout off (compiled RNG differs by design)."""
    torch._dynamo.reset()
    mesh = spec_mesh(spec)
    eager, model = (shardlib.shard(cases(spec).make_model(spec), mesh, **shard_options(spec)) for _ in range(2))
    compiled = torch.compile(model, backend=spec["compile"])
    batch = cases(spec).make_batch(spec, eager.config)
    out_eager, out = eager(**batch), compiled(**batch)
    tol = dict(rtol=1e-4, atol=1e-5)
    compared = 0
    for key, value in out_eager.items():
        if torch.is_tensor(value):
            torch.testing.assert_close(out[key], value, **tol, msg=lambda m: f"output {key}: {m}")
            compared += 1
    scalar_objective(out_eager).backward()
    scalar_objective(out).backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, **tol, msg=lambda m: f"grad {name}: {m}")
    for m in (eager, model):
        torch.optim.AdamW(m.parameters(), lr=1e-3).step()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, **tol, msg=lambda m: f"weight {name}: {m}")
    return {"outputs": compared, "params": sum(1 for _ in model.parameters())}


def compiled_dropout_streams(spec: dict, steps: int = 1) -> dict:
    """Compiled training with dropout: replicated parameters stay bitwise identical across the group that shares
    them (the default generator stays in step), and the sharded-activation dropout masks differ across ranks (the
    per-rank share of :func:`shardlib.parallel.random.local_dropout`), shown by a dropout-only forward of equal
    inputs."""
    torch._dynamo.reset()
    mesh = spec_mesh(spec)
    sp_dimension = spec.get("sp") in SP_DIM_MODES
    group = mesh.group("sp") if sp_dimension else mesh.tp_group
    torch.manual_seed(spec["seed"])
    model = shardlib.shard(cases(spec).make_model(spec), mesh, **shard_options(spec))
    model.train()
    losses = train_steps(model, torch.compile(model, backend=spec["compile"]), spec, steps)
    checked = check_replicas_identical(model, group, sp_dimension)
    tracker = shardlib.shard_state(model).rng_tracker
    stream = "sequence-parallel" if sp_dimension else "tensor-parallel"
    masks = torch.compile(lambda x: shardlib.parallel.random.local_dropout(x, 0.5, *tracker.ranks[stream]),
                          backend=spec["compile"])(torch.ones(256))
    copies = _gathered_copies(masks, group)
    assert all(not torch.equal(copies[0], c) for c in copies[1:]), "compiled per-rank masks are identical"
    return {"losses": losses, "replicated_checked": checked}


def compiled_generate(spec: dict) -> list:
    """T5 ``generate()`` with a compiled sharded model equals eager greedy generation."""
    torch._dynamo.reset()
    model = shardlib.shard(cases(spec).make_model(spec), spec_mesh(spec), **shard_options(spec)).eval()
    batch = cases({**spec}).make_batch({**spec, "labels": False}, model.config)
    batch.pop("decoder_input_ids", None)
    batch.pop("decoder_attention_mask", None)
    eager = model.generate(**batch, max_new_tokens=4, do_sample=False)
    model.forward = torch.compile(model.forward, backend=spec["compile"])
    compiled = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert torch.equal(compiled, eager), (compiled, eager)
    return compiled.tolist()

