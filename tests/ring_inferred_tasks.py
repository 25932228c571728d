"""Rank-pool tasks of test_ring_inferred.py: models without a policy (RoBERTa, Llama with grouped key/value heads),
sharded by their inferred plan with sequence parallelism over sp (ring attention or all-to-all), against the
unsharded model built under the same seed, on right-padded batches."""

from __future__ import annotations

import collections
import copy
import dataclasses

import torch
import transformers

import shardlib
from shardlib.kernels.mask_spec import MASKS_BUILT
from harness import mesh as pool_mesh
from inference_cases import FAMILIES, FLOAT32_INSIDE
from rank_tasks import compare_training_step

LENGTH = 7  # neither sp=2 nor sp=4 divides it: the stack entry pads, the attention sees the true length


def make_model(family: str, cls: str, **config) -> torch.nn.Module:
    """``cls`` of ``family`` at the family's small config (``tests/inference_cases.py``) changed by ``config``,
    float64, dropout off."""
    config_cls, kwargs, _ = FAMILIES[family]
    torch.manual_seed(0)
    return getattr(transformers, cls)(getattr(transformers, config_cls)(**{**kwargs, **config})).double()


def padded_batch(model: torch.nn.Module, padded: bool = True, seed: int = 1) -> dict:
    """Token ids of 2 x LENGTH, the second row right-padded by 2 when ``padded``; masked-LM labels on about half of
    the real tokens (none for a causal LM: the objective is then a weighted sum of the float64 logits, where HF's
    causal-LM loss would run in float32)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, -2:] = 0
        ids[1, -2:] = model.config.pad_token_id
    batch = {"input_ids": ids, "attention_mask": mask}
    if "MaskedLM" in type(model).__name__:
        labels = torch.where((torch.rand(ids.shape, generator=g) < 0.5) & mask.bool(), ids, -100)
        labels[:, 0] = ids[:, 0]
        batch["labels"] = labels
    return batch


def sp_equivalence(family: str, cls: str, mode: str, tp: int, sp: int, padded: bool = True, **config) -> dict:
    """Outputs, every gradient and the weights after AdamW: sharded by the inferred plan with ``mode`` ("ring" or
    "all_to_all"; or True: Megatron's) at tp x sp == unsharded, in float64 (at float32 tolerances for a family that
    computes in float32 inside); the plan was proven over the tp x sp groups first."""
    ref = make_model(family, cls, **config)
    model = shardlib.shard(copy.deepcopy(ref), pool_mesh(tp=tp, sp=sp), gather_logits=True, sequence_parallel=mode)
    report = shardlib.report(model)
    assert report.policy == "inferred" and report.verified_s is not None, report
    dtype = torch.float32 if family in FLOAT32_INSIDE else torch.float64
    before = collections.Counter(MASKS_BUILT)
    compared = compare_training_step(ref, model, padded_batch(ref, padded), dtype)
    compared["verified_s"], compared["masks"] = report.verified_s, dict(MASKS_BUILT - before)
    return compared


def refusal(family: str, cls: str, mode: str, tp: int, sp: int, **config) -> str:
    """The PlanError of ``shard()``, or "no error"."""
    try:
        shardlib.shard(make_model(family, cls, **config), pool_mesh(tp=tp, sp=sp), sequence_parallel=mode)
        return "no error"
    except shardlib.PlanError as exc:
        return str(exc)


def positions_dropped_is_refused(mode: str, tp: int, sp: int) -> dict:
    """Llama's inferred sites without their rotary ``position_embeddings``: the proof over the tp x sp groups
    refuses the plan (cos and sin of the whole sequence meet one rank's chunk of q), and the model is untouched."""
    from shardlib.sharding.inference import infer

    model = make_model("llama", "LlamaForCausalLM")
    inferred = infer(model)
    original = inferred.plan
    sites = {p: dataclasses.replace(s, positions=()) for p, s in original.attention.items()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inferred.plan = dataclasses.replace(original, attention=sites)
    try:
        shardlib.shard(model, pool_mesh(tp=tp, sp=sp), sequence_parallel=mode)
        message = "no error"
    except shardlib.PlanError as exc:
        message = str(exc)
    finally:
        inferred.plan = original
    after = model.state_dict()
    untouched = all(torch.equal(before[k], after[k]) for k in before) and shardlib.shard_state(model, required=False) \
        is None
    return {"message": message, "untouched": untouched}
