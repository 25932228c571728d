"""Rank tasks of tests/test_search.py: what a real training step saves for backward, counted on real tensors
over gloo, for the dry run's prediction to be compared with."""

from __future__ import annotations

import torch

import shardlib
from shardlib.analysis.counting import SavedCounter
from shardlib.sharding.examples import example_batch
from shardlib.sharding.sharded import shard_state

from train_tasks import adamw, build_sharded


def saved_in_a_step(spec: dict) -> dict:
    """One ``Trainer.train_step`` of ``spec["microbatches"]`` microbatches of ``spec["batch"]`` x ``spec["seq"]``
    (the dry run's microbatch, random values) at ``spec["layout"]``, after a first one: the bytes this rank saved
    for backward, and
    its pipeline stage. Pipelines run GPipe: every forward before any backward, so no storage a backward frees is
    reused by a later saved tensor (each would be counted once)."""
    mesh, model = build_sharded(spec)
    trainer = shardlib.Trainer(model, adamw, microbatches=spec["microbatches"], schedule="gpipe",
                               precision=spec.get("precision", "fp32"))
    generator = torch.Generator().manual_seed(7)
    batch = example_batch(model, spec["batch"] * spec["microbatches"], spec["seq"], device="cpu",
                          generator=generator)
    trainer.train_step(batch)  # the first step of a pipeline schedule also infers its shapes
    counter = SavedCounter(model)
    with counter:
        trainer.train_step(batch)
    split = shard_state(model).pipeline
    return {"stage": 0 if split is None else split.stage_modules[0].index, "saved": counter.total}


def step_layout(spec: dict) -> dict:
    """Build the model at a layout the search returned (``spec["layout"]``, ``spec["shard"]``, Trainer options in
    ``spec["trainer"]``) and take one training step of a generated global batch: its loss."""
    mesh, model = build_sharded(spec)
    options = spec["trainer"]
    generator = torch.Generator().manual_seed(11)  # (the batch first: zero=3 swaps the model's class for FSDP's)
    batch = example_batch(model, spec["batch"] * options["microbatches"], spec["seq"], device="cpu",
                          generator=generator)
    trainer = shardlib.Trainer(model, adamw, **options)
    return {"loss": float(trainer.train_step(batch))}
