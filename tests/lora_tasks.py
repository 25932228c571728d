"""Rank-pool tasks of test_lora.py: LoRA adapters (peft) on sharded BERT, ViT and T5, against the unsharded peft
model built under the same seed."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model

import shardlib
from harness import mesh as pool_mesh
from rank_tasks import DTYPES, cases, cast_batch, compare_training_step, reference_sgd_losses

#: LoRA targets per family: column-parallel bases (q/k/v, the first MLP linear), row-parallel ones (the attention
#: output, the second MLP linear) and replicated ones (BERT's pooler and head transform)
TARGETS = {"bert": ["query", "key", "value", "dense"], "vit": ["q_proj", "v_proj", "o_proj", "fc1", "fc2"],
           "t5": ["q", "k", "v", "o", "wi", "wo", "wi_0", "wi_1"]}
#: small configs of each family (4 heads: tp in {1, 2, 4} divides them)
CONFIGS = {"bert": {"vocab": 40, "heads": 4, "head_dim": 4, "layers": 2, "intermediate": 32},
           "vit": {"image": 8, "patch": 4, "heads": 4, "head_dim": 4, "layers": 2, "intermediate": 32},
           "t5": {"vocab": 40, "d_model": 16, "d_kv": 4, "d_ff": 32, "layers": 2, "heads": 4}}
#: the head each task keeps trainable beside the adapters (peft's modules_to_save), where the class has one
HEADS = {"BertForSequenceClassification": ["classifier"], "BertForTokenClassification": ["classifier"],
         "ViTForImageClassification": ["classifier"], "T5ForSequenceClassification": ["classification_head"]}


def lora_model(spec: dict, base: torch.nn.Module | None = None):
    """The family's model for ``spec`` wrapped by peft (random B, so that every adapter gradient is nonzero)."""
    torch.manual_seed(spec.get("seed", 0))
    base = base if base is not None else cases(spec).make_model(spec)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[spec.get("family", "bert")],
                        lora_dropout=spec.get("lora_dropout", 0.0), init_lora_weights=False,
                        modules_to_save=HEADS.get(spec["cls"]))
    return get_peft_model(base, config)


def lora_equivalence(spec: dict) -> dict:
    """Outputs, every trainable gradient (adapters and head) and every weight after one AdamW step: the sharded peft
    model == the unsharded one; only the adapters and the head train."""
    mesh = pool_mesh(tp=spec["tp"])
    ref = lora_model(spec)
    model = shardlib.shard(copy.deepcopy(ref), mesh, gather_logits=True, sequence_parallel=spec.get("sp", False))
    dtype = DTYPES[spec["dtype"]]
    batch = cast_batch(cases(spec).make_batch(spec, ref.config), dtype)
    compared = compare_training_step(ref, model, batch, dtype)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable), sorted(trainable)
    report = shardlib.report(model)
    # LoRA layers whose base and adapter were both split (a row of the report lists the layer's tensors)
    compared["adapted"] = sum(1 for row in report.rows if any("lora_" in t[0] and t[1] != t[2] for t in row.tensors)
                              and any("base_layer" in t[0] and t[1] != t[2] for t in row.tensors))
    return compared


def lora_dropout_streams(tp: int) -> dict:
    """Adapter dropout on a column-parallel q inside the attention block (whose attention dropout draws per rank)
    draws the shared mask: the sharded output equals the unsharded one drawn from the same default generator, which
    both leave in the same state. On a row-parallel base it draws from the per-rank stream: the default generator
    is left as it was, and the tp ranks' masks differ."""
    spec = {"family": "bert", "cls": "BertModel", "tp": tp, "dtype": "float64", "batch": 2, "seq": 6, "seed": 3,
            "lora_dropout": 0.5, "config": CONFIGS["bert"]}
    result = {}
    for target in ("query", "attention.output.dense"):
        ref = lora_model(spec, cases(spec).make_model(spec))
        for name, module in ref.named_modules():
            if name.endswith(("lora_A", "lora_B")) or not hasattr(module, "lora_A"):
                continue
            if not name.endswith(target):
                module.lora_dropout["default"] = torch.nn.Identity()
        model = shardlib.shard(copy.deepcopy(ref), pool_mesh(tp=tp))
        ref.train(), model.train()
        batch = cases(spec).make_batch(spec, ref.config)
        outputs, states = [], []
        for m in (ref, model):
            torch.manual_seed(7)
            outputs.append(m(**batch).last_hidden_state)
            states.append(torch.get_rng_state())
        untouched = torch.manual_seed(7).get_state()
        if target == "query":
            torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-9, atol=1e-11)
            assert torch.equal(states[0], states[1])
        else:
            assert torch.equal(states[1], untouched) and not torch.equal(states[0], untouched)
            # the per-rank masks differ: the same input, sharded by features, dropped differently on each rank
            layer = model.base_model.model.encoder.layer[0].attention.output.dense
            x = torch.ones(1, 64, layer.lora_A["default"].in_features, dtype=torch.float64)
            tracker = shardlib.shard_state(model).rng_tracker
            with tracker.fork():
                kept = (layer.lora_dropout["default"](x) != 0).flatten().double()
            gathered = [torch.empty_like(kept) for _ in range(tp)]
            dist.all_gather(gathered, kept, group=shardlib.shard_state(model).mesh.tp_group)
            assert not all(torch.equal(g, gathered[0]) for g in gathered[1:])
        result[target] = True
    return result


def lora_fit(workdir: str) -> dict:
    """``fit`` at dp=2 x tp=2 of a LoRA BERT classifier (float64, no dropout) against the unsharded peft model
    trained on the same global batches, straight, resumed half-way from its checkpoint, and at pp=2 x tp=2; then the adapter saved in peft's format, read by plain peft, and loaded back
    into a freshly sharded model."""
    spec = {"family": "bert", "cls": "BertForSequenceClassification", "tp": 2, "dtype": "float64", "batch": 16,
            "seq": 6, "seed": 0, "config": CONFIGS["bert"]}
    pristine = cases(spec).make_model(spec)  # the base weights, never wrapped
    ref = lora_model(spec, copy.deepcopy(pristine))
    model = shardlib.shard(copy.deepcopy(ref), pool_mesh(dp=2, tp=2))
    data = cast_batch(cases(spec).make_batch(spec, ref.config), torch.float64)
    samples = [{k: v[i] for k, v in data.items()} for i in range(spec["batch"])]
    sgd = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
    losses = shardlib.Trainer(model, sgd).fit(samples, batch_size=8, max_steps=4, shuffle=False,
                                              progress=False).losses
    expected = reference_sgd_losses(ref, samples, 8, 4, sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-9, atol=1e-11)
    resumed = []  # two steps saved, then resumed to four: the same losses (the checkpoint holds adapter and head)
    for steps, resume in ((2, None), (4, "auto")):
        again = shardlib.shard(lora_model(spec, copy.deepcopy(pristine)), pool_mesh(dp=2, tp=2))
        resumed += shardlib.Trainer(again, sgd).fit(samples, batch_size=8, max_steps=steps, shuffle=False,
                                                    progress=False, save_dir=f"{workdir}/run", resume=resume).losses
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(expected), rtol=1e-9, atol=1e-11)
    piped = shardlib.shard(lora_model(spec, copy.deepcopy(pristine)), pool_mesh(dp=1, pp=2, tp=2))
    pipelined = shardlib.Trainer(piped, sgd, microbatches=2).fit(samples, batch_size=8, max_steps=4, shuffle=False,
                                                                 progress=False).losses
    torch.testing.assert_close(torch.tensor(pipelined), torch.tensor(expected), rtol=1e-9, atol=1e-11)

    saved = Path(workdir) / "adapter"
    shardlib.save_pretrained(model, saved)
    dist.barrier()
    reloaded = PeftModel.from_pretrained(copy.deepcopy(pristine), saved)
    reloaded.eval(), ref.eval()
    batch = torch.utils.data.default_collate(samples)
    torch.testing.assert_close(reloaded(**batch).logits, ref(**batch).logits, rtol=1e-9, atol=1e-11)

    resharded = shardlib.shard(lora_model({**spec, "seed": 5}, copy.deepcopy(pristine)), pool_mesh(tp=2),
                               gather_logits=True)
    shardlib.load_adapter(resharded, saved)
    resharded.eval()
    torch.testing.assert_close(resharded(**batch).logits, ref(**batch).logits, rtol=1e-9, atol=1e-11)
    wider = get_peft_model(copy.deepcopy(pristine), LoraConfig(r=8, target_modules=TARGETS["bert"],
                                                              modules_to_save=HEADS[spec["cls"]]))
    wider = shardlib.shard(wider, pool_mesh(tp=2))
    try:
        shardlib.load_adapter(wider, saved)
        refused = "no error"
    except shardlib.checkpoint.CheckpointError as exc:
        refused = str(exc)
    return {"steps": len(losses), "files": sorted(p.name for p in saved.iterdir()), "refused": refused}


def lora_refusals() -> list[str]:
    """What shard() says to LoRA layouts it cannot shard; each model is left untouched."""
    from peft import LoraConfig as Config

    spec = {"family": "bert", "cls": "BertModel", "tp": 2, "dtype": "float64", "batch": 2, "seq": 6, "seed": 0,
            "config": CONFIGS["bert"]}
    messages = []
    for config in (Config(r=4, target_modules=["query"], use_dora=True),
                   Config(r=4, target_modules=["word_embeddings"]),
                   Config(r=4, target_modules=["output.dense"], lora_bias=True)):
        model = get_peft_model(cases(spec).make_model(spec), config)
        before = {n: p.clone() for n, p in model.state_dict().items()}
        try:
            shardlib.shard(model, pool_mesh(tp=2))
            messages.append("no error")
        except shardlib.PlanError as exc:
            messages.append(str(exc))
        after = model.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        assert shardlib.shard_state(model, required=False) is None
    return messages


def lora_on_an_inferred_plan() -> dict:
    """LoRA on Llama, a family without a policy: the inferred plan (proven first) shards the adapters with their
    bases; equal to the unsharded peft model (float32 tolerances: transformers computes the causal-LM loss in
    float32)."""
    import inference_cases

    base = inference_cases.make_model("LlamaForCausalLM", "llama")
    ref = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                          target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    model = shardlib.shard(copy.deepcopy(ref), pool_mesh(tp=2), gather_logits=True)
    compared = compare_training_step(ref, model, inference_cases.make_batch(base), torch.float32)
    return {**compared, "policy": shardlib.report(model).policy}
