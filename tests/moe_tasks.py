"""Rank-pool tasks of tests/test_moe.py: mixture-of-experts models sharded at a layout against the unsharded model
built under the same seed (outputs, every gradient, the weights after AdamW)."""

from __future__ import annotations

import copy

import torch

import shardlib
from harness import mesh as pool_mesh
from moe_cases import make_batch, make_model, routed_tokens
from rank_tasks import compare_training_step

SEQUENCE = {"none": False, "megatron": True, "all_to_all": "all_to_all", "ring": "ring"}


def moe_equivalence(family: str, tp: int = 2, sequence: str = "none", sp: int = 1, *, labels: bool = False,
                    dtype: str = "float64", seq: int = 9, **model_options) -> dict:
    """``family`` sharded at tp (and sequence parallelism: Megatron on tp, or ``sp`` ranks all-to-all / ring) ==
    unsharded, in ``dtype``. Compared at float64 tolerances where the model computes in float64 throughout (Switch
    with a float64 router); the decoders route in float32 whatever the model's dtype (transformers' upcast before
    the softmax, rounding the routing weights to float32), so they are compared at float32 tolerances."""
    dtype = getattr(torch, dtype)
    ref = make_model(family, dtype=dtype, **model_options)
    model = shardlib.shard(copy.deepcopy(ref), pool_mesh(tp=tp, sp=sp), gather_logits=True,
                           sequence_parallel=SEQUENCE[sequence])
    batch = make_batch(family, labels=labels, seq=seq)
    kept, routed = routed_tokens(ref, batch) if family == "switch" else (0, 0)
    exact = dtype == torch.float64 and family == "switch" and model_options.get("router_dtype", "float64") == "float64"
    compared = compare_training_step(ref, model, batch, torch.float64 if exact else torch.float32)
    report = shardlib.report(model)
    return {**compared, "kept": kept, "routed": routed, "local_fraction": report.local_bytes / report.unsharded_bytes,
            "policy": report.policy}


def shard_refusal(family: str, tp: int = 1, sequence: str = "none", sp: int = 1, **model_options) -> str:
    """The PlanError of sharding ``family`` at this layout ("no error" if none), the model left untouched."""
    model = make_model(family, **model_options)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        shardlib.shard(model, pool_mesh(tp=tp, sp=sp), sequence_parallel=SEQUENCE[sequence])
        return "no error"
    except shardlib.PlanError as exc:
        after = model.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        return str(exc)
