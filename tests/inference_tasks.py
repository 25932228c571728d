"""Rank-pool tasks of test_inference.py: models of families without a policy, sharded by an inferred (and
verified) plan, against the unsharded model built under the same seed."""

from __future__ import annotations

import copy

import torch

import shardlib
from harness import mesh as pool_mesh
from inference_cases import make_batch, make_model
from rank_tasks import compare_training_step


def inferred_equivalence(family: str, cls: str, tp: int, sp: bool = False) -> dict:
    """Outputs, every gradient and the weights after AdamW: sharded by the inferred plan == unsharded (float64);
    the plan really shards (parameter bytes per rank), and was verified."""
    ref = make_model(cls, family)
    model = shardlib.shard(copy.deepcopy(ref), pool_mesh(tp=tp), gather_logits=True, sequence_parallel=sp)
    report = shardlib.report(model)
    assert report.policy == "inferred" and report.verified_s is not None, report
    # transformers computes a causal-LM loss in float32 whatever the model's dtype: float32 tolerances there
    dtype = torch.float32 if cls.endswith("CausalLM") else torch.float64
    compared = compare_training_step(ref, model, make_batch(ref), dtype)
    compared["local_fraction"] = report.local_bytes / report.unsharded_bytes
    compared["verified_s"] = report.verified_s
    return compared
