"""Rank tasks of tests/test_ddp_unused.py (see harness.py): torch's DDP under the Trainer at dp=2, built from the
first step's gradients (``shardlib/train/dataparallel.py``), against the unsharded model in one process."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch import nn

import shardlib
import train_tasks
from harness import mesh as pool_mesh
from rank_tasks import TOL, cases

WARNING = "find_unused_parameters=True was specified in DDP constructor"


@contextlib.contextmanager
def captured(logger: str = "shardlib.train"):
    """What this rank writes to its stderr file descriptor (torch's C++ warnings go there, not through Python), its
    Python warnings and the records of ``logger`` (INFO and up), all in the dict yielded (filled on exit)."""
    got: dict = {}
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    log, handler = logging.getLogger(logger), Keep(logging.INFO)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        os.dup2(f.fileno(), 2)
        try:
            yield got
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            log.removeHandler(handler)
            log.setLevel(level)
            f.seek(0)
            got["stderr"] = f.read().decode(errors="replace")
            got["warnings"] = [str(w.message) for w in caught]
            got["log"] = [r.getMessage() for r in records]


def ddp_state(trainer) -> dict:
    """How the Trainer's data-parallel layer built DDP."""
    data_parallel = trainer.data_parallel
    ddp = data_parallel.ddp
    return {"ddp": ddp is not None, "find_unused": ddp.find_unused_parameters if ddp is not None else None,
            "ignored": sorted(ddp.parameters_to_ignore) if ddp is not None else None,
            "left_out": len(data_parallel.left_out_of_ddp), "in_ddp": len(data_parallel.in_ddp)}


def classifier_fit(spec: dict) -> dict:
    """``fit`` of a BERT classifier at dp=2 with stderr, warnings and the ``shardlib.train`` log captured; then a
    control: a throwaway DDP with ``find_unused_parameters=True`` over the same group, captured the same way, must
    print torch's warning, which proves the capture sees it and that the fit had not printed it (torch prints it
    once per process: TORCH_WARN_ONCE)."""
    with captured() as fit_out:
        result = train_tasks.fit_run(spec)
    with captured() as control:
        torch.manual_seed(0)
        probe = nn.parallel.DistributedDataParallel(nn.Linear(2, 2), process_group=pool_mesh(dp=2).group("dp"),
                                                    find_unused_parameters=True)
        probe(torch.ones(1, 2)).sum().backward()
        del probe
    dist.barrier()
    return {**result, "fit": fit_out, "control": control}


class GradientsAtStep(shardlib.Trainer):
    """Keeps each step's gradients (summed over dp, before the optimizer steps) and weights after the step."""

    def optimizer_step(self) -> None:
        self.kept_grads.append({n: None if p.grad is None else p.grad.detach().clone()
                                for n, p in self.model.named_parameters()})
        super().optimizer_step()
        self.kept_weights.append({n: p.detach().clone() for n, p in self.model.named_parameters()})


def objective(hidden: torch.Tensor) -> torch.Tensor:
    """A loss of BertModel's ``last_hidden_state`` only (the pooler's output is returned, never used), summed over
    examples so that the sum over microbatches and dp ranks is the loss of the global batch."""
    weights = torch.linspace(-1, 1, hidden.shape[-1], dtype=hidden.dtype)
    return (hidden * weights).sum() + 1e-2 * hidden.pow(2).sum()


def unused_pooler_steps(spec: dict) -> dict:
    """``spec["steps"]`` Trainer steps of a BertModel (pooler included) at dp=2 whose loss leaves the pooler out
    (``loss_fn``), ``spec["microbatches"]`` microbatches per rank, against the unsharded model in this process on the
    global batch: every gradient (the pooler's None in both) and every weight after each AdamW step. Step 1 runs
    without DDP (it decides), step 2 is DDP's first iteration (one bucket), step 3 on its rebuilt buckets."""
    dtype = getattr(torch, spec["dtype"])
    family = cases(spec)
    ref = family.make_model(spec).to(dtype)
    mesh = pool_mesh(dp=2)
    model = shardlib.shard(copy.deepcopy(ref), mesh)
    trainer = GradientsAtStep(model, train_tasks.adamw, microbatches=spec["microbatches"], loss_fn=objective,
                              find_unused_parameters=spec.get("find_unused"))
    trainer.kept_grads, trainer.kept_weights = [], []
    opt = train_tasks.adamw(ref.parameters())
    rank, compared, states = mesh.local_rank("dp"), 0, []
    with captured() as out:
        for step in range(spec["steps"]):
            batch = family.make_batch({**spec, "seed": spec["seed"] + step, "labels": False}, ref.config)
            half = len(batch["input_ids"]) // 2
            trainer.train_step({k: v[rank * half:(rank + 1) * half] for k, v in batch.items()})
            states.append(ddp_state(trainer))
            opt.zero_grad()
            objective(ref(**batch).last_hidden_state).backward()
            got_grads, got_weights = trainer.kept_grads[step], trainer.kept_weights[step]
            opt.step()
            for name, p in ref.named_parameters():
                assert (got_grads[name] is None) == (p.grad is None), (step, name, got_grads[name], p.grad)
                if p.grad is not None:
                    torch.testing.assert_close(got_grads[name], p.grad, **TOL[dtype],
                                               msg=lambda m: f"step {step} grad {name}: {m}")
                torch.testing.assert_close(got_weights[name], p.detach(), **TOL[dtype],
                                           msg=lambda m: f"step {step} weight {name}: {m}")
                compared += 1
    dist.barrier()
    return {"compared": compared, "states": states, "out": out,
            "unused": [n for n, p in ref.named_parameters() if p.grad is None]}


def forced_off_with_unused_pooler(spec: dict) -> str:
    """``find_unused_parameters=False`` given for a loss that leaves the pooler out: the error the Trainer raises
    after the first backward, on every rank (each misses the pooler's gradients, so no rank waits in an all-reduce)."""
    mesh = pool_mesh(dp=2)
    model = shardlib.shard(cases(spec).make_model(spec), mesh)
    trainer = shardlib.Trainer(model, train_tasks.adamw, loss_fn=objective, find_unused_parameters=False)
    batch = cases(spec).make_batch({**spec, "labels": False}, model.config)
    try:
        trainer.train_step(batch)
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        dist.barrier()
