"""Rank-pool tasks of test_inference.py: models of families without a policy, sharded by an inferred (and
verified) plan, against the unsharded model built under the same seed."""

from __future__ import annotations

import copy
import dataclasses

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


def wrong_plan_is_refused() -> dict:
    """Inferred plans broken on purpose are refused by the proof before use, and the model is left untouched: one
    that does not run (an MLP's up projection left whole before its row-parallel down projection: the module that
    raised is named), one that runs but computes otherwise (the attention block's input copy dropped: forward equal,
    the gradients below it not summed over tp)."""
    from shardlib.parallel.styles import LocalRNG
    from shardlib.sharding.inference import infer

    model = make_model("RobertaForSequenceClassification", "roberta")
    inferred = infer(model)
    original, styles = inferred.plan, dict(inferred.plan.styles)
    block = "roberta.encoder.layer.*.attention.self"
    broken = {"does not run": {k: v for k, v in styles.items() if k != "roberta.encoder.layer.*.intermediate.dense"},
              "computes otherwise": {**styles, block: LocalRNG()}}
    results = {}
    for name, wrong in broken.items():
        before = {k: v.clone() for k, v in model.state_dict().items()}
        inferred.plan = dataclasses.replace(original, styles=wrong)
        try:
            shardlib.shard(model, pool_mesh(tp=2))
            message = "no error"
        except shardlib.PlanError as exc:
            message = str(exc)
        finally:
            inferred.plan = original
        after = model.state_dict()
        untouched = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        results[name] = {"message": message,
                         "untouched": untouched and shardlib.shard_state(model, required=False) is None}
    return results


def indivisible_heads(family: str, cls: str, tp: int) -> str:
    model = make_model(cls, family)
    try:
        shardlib.shard(model, pool_mesh(tp=tp))
        return "no error"
    except shardlib.PlanError as exc:
        return str(exc)
