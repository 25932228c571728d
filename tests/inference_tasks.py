"""Rank-pool tasks of test_inference.py: models of families without a policy, sharded by an inferred (and
verified) plan, against the unsharded model built under the same seed."""

from __future__ import annotations

import copy
import dataclasses

import torch

import shardlib
from harness import mesh as pool_mesh
import inference_cases
from inference_cases import make_batch, make_model, random_model
from rank_tasks import compare_training_step, reference_sgd_losses


def inferred_equivalence(family: str, cls: str, tp: int, sp: bool = False, sizes: dict | None = None) -> dict:
    """Outputs, every gradient and the weights after AdamW: sharded by the inferred plan == unsharded (float64);
    the plan really shards (parameter bytes per rank), and was verified (tp > 1). ``sizes``: drawn sizes
    (``inference_cases.random_model``) instead of the family's small config."""
    ref = make_model(cls, family) if sizes is None else random_model(family, cls, sizes)
    model = shardlib.shard(copy.deepcopy(ref), pool_mesh(tp=tp), gather_logits=True, sequence_parallel=sp)
    report = shardlib.report(model)
    assert report.policy == "inferred" and (report.verified_s is not None or tp == 1), report
    # transformers computes a causal-LM loss, and Gemma its RMSNorms, in float32 whatever the model's dtype: float32
    # tolerances there (sequence parallelism reorders the norms' sums: 2e-7 relative in Gemma's norm weights)
    float32_inside = inference_cases.causal_lm(ref) or family in inference_cases.FLOAT32_INSIDE
    dtype = torch.float32 if float32_inside else torch.float64
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


def generation_matches(family: str, cls: str, tp: int = 2) -> list[list[int]]:
    """Greedy ``generate()`` of the inferred, sharded model: the same tokens as the unsharded one."""
    ref = make_model(cls, family).eval()
    model = shardlib.shard(copy.deepcopy(ref), pool_mesh(tp=tp)).eval()
    ids = make_batch(ref)["input_ids"]
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=ref.config.pad_token_id or 0)
    expected, actual = ref.generate(ids, **options), model.generate(ids, **options)
    assert torch.equal(actual, expected), (actual, expected)
    return actual.tolist()


def fit_matches(family: str, cls: str, layout: dict, steps: int = 3) -> dict:
    """``fit`` at ``layout`` (tp x pp x dp, microbatches) of the inferred plan: every step's loss equal to the
    unsharded model's SGD steps on the same global batches (float64, no dropout)."""
    ref = make_model(cls, family)
    samples = [{k: v[i] for k, v in make_batch(ref, batch=8).items()} for i in range(8)]
    mesh = pool_mesh(dp=layout.get("dp"), pp=layout.get("pp", 1), tp=layout.get("tp", 1))
    model = shardlib.shard(copy.deepcopy(ref), mesh)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    losses = shardlib.Trainer(model, sgd, microbatches=layout.get("microbatches", 1)).fit(
        samples, batch_size=4, max_steps=steps, shuffle=False, progress=False).losses
    expected = reference_sgd_losses(ref, samples, 4, steps, sgd)
    tol = dict(rtol=1e-4, atol=1e-6) if inference_cases.causal_lm(ref) else dict(rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **tol)
    state = shardlib.shard_state(model)
    return {"losses": losses, "verified_s": state.report.verified_s,
            "stages": [list(s) for s in state.pipeline.plan.layers] if state.pipeline else None}


def cuts_proven(cases: list[tuple[str, str]]) -> list[str]:
    """For each (family, class): its inferred trunk's pipeline cuts proven on the verification twin
    (:mod:`shardlib.sharding.inference.cuts`), or the refusal's message (inference is cached per class in a rank)."""
    from shardlib.sharding.inference import infer
    from shardlib.sharding.inference.cuts import verify_cuts

    results = []
    for family, cls in cases:
        model = make_model(cls, family)
        try:
            verify_cuts(model, infer(model).plan)
            results.append("proven")
        except shardlib.PlanError as exc:
            results.append(str(exc))
    return results


def auto_on_a_hand_policy_class() -> dict:
    """``policy="auto"`` on BERT, which has a hand policy: the inferred plan is used (and proven), equal to unsharded."""
    import bert_cases

    spec = {"cls": "BertForSequenceClassification", "seed": 0, "seq": 6, "batch": 2, "dtype": "float64",
            "config": {"vocab": 40, "heads": 4, "head_dim": 4, "layers": 2, "intermediate": 32}}
    ref = bert_cases.make_model(spec)
    model = shardlib.shard(copy.deepcopy(ref), pool_mesh(tp=2), policy="auto")
    compared = compare_training_step(ref, model, bert_cases.make_batch(spec, ref.config), torch.float64)
    return {**compared, "policy": shardlib.report(model).policy, "verified": shardlib.report(model).verified_s}


def checkpoint_round_trip(family: str, cls: str, workdir: str, **config) -> int:
    """HF checkpoint -> sharded at tp=2 by the inferred plan (read straight into shards) -> sharded save -> load at
    tp=4 -> HF export and the live model's save_pretrained: weights bitwise equal to the original at every step
    (GPT-2: the fused c_attn's blocked shards, docs/checkpoint-format.md). ``config``: overrides of the family's."""
    from pathlib import Path

    import torch.distributed as dist
    import transformers

    from shardlib import checkpoint as ckpt

    work, original = Path(workdir), make_model(cls, family, **config)
    expected = original.state_dict()
    if dist.get_rank() == 0:
        original.save_pretrained(work / "hf")
    dist.barrier()
    model_class = getattr(transformers, cls)

    def check_bitwise(model, stage):
        full = shardlib.full_state_dict(model)
        for name, value in full.items():
            assert torch.equal(value.to(expected[name].dtype), expected[name]), f"{stage}: {name} differs"
        return len(full)

    tensors = check_bitwise(ckpt.from_pretrained(model_class, work / "hf", pool_mesh(tp=2), torch_dtype=torch.float64),
                            "HF -> tp=2")
    ckpt.save(ckpt.from_pretrained(model_class, work / "hf", pool_mesh(tp=2), torch_dtype=torch.float64),
              work / "sharded", overwrite=True)
    model = ckpt.from_sharded(model_class, work / "sharded", pool_mesh(tp=4))
    check_bitwise(model, "sharded tp=2 -> tp=4")
    shardlib.save_pretrained(model, work / "live", overwrite=True)
    if dist.get_rank() == 0:
        ckpt.export_hf(work / "sharded", work / "export", overwrite=True)
        for directory in (work / "export", work / "live"):
            for name, value in model_class.from_pretrained(directory).state_dict().items():
                assert torch.equal(value.to(expected[name].dtype), expected[name]), f"{directory.name}: {name}"
    dist.barrier()
    return tensors
