"""Tasks of tests/test_packing.py (on the pool's ranks, or in one process at a world of one): ``fit(packing=...)``
at a layout against the unsharded model trained by hand on the padded batches of the same samples in the same
order: every step's loss and every weight after the last of its AdamW steps (gradients clipped by the global norm).

Models (``spec["model"]``): BERT masked LM and sequence classification (one label per document, pooled per
document), T5 conditional generation (documents in the encoder and their targets in the decoder), and Llama
(causal LM by its inferred plan). Samples have random lengths up to the row budget, token types and labels.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence

import bert_cases
import inference_cases
import moe_cases
import shardlib
import t5_cases
from harness import mesh as pool_mesh
from shardlib.kernels.attention import set_attention
from shardlib.kernels.block_attention import blocks_name
from shardlib.kernels.mask_spec import MASKS_BUILT
from train_tasks import MAX_GRAD_NORM, adamw

CLASSES = {"bert_mlm": "BertForMaskedLM", "bert_cls": "BertForSequenceClassification",
           "t5": "T5ForConditionalGeneration", "llama": "LlamaForCausalLM"}
#: inferred plans beyond Llama, at a world of one: positions counted from padding_idx + 1, and a fused-QKV decoder
INFERRED = {"roberta_mlm": ("roberta", "RobertaForMaskedLM"), "gpt2": ("gpt2", "GPT2LMHeadModel")}
#: BERT's other token heads, at a world of one
MORE_BERT = {"bert_tokens": "BertForTokenClassification", "bert_lm": "BertLMHeadModel"}
#: mixtures of experts: Mixtral (top-2 of 4 experts, by its inferred plan), routing each token alone
MOE = {"mixtral": "MixtralForCausalLM"}
CAUSAL = ("llama", "gpt2", "bert_lm", "mixtral")
BERT = dict(vocab=41, heads=4, head_dim=4, layers=2, intermediate=24, num_labels=3)
T5 = dict(vocab=37, d_model=16, d_kv=4, d_ff=20, layers=2, heads=4)


def make_model(spec: dict) -> torch.nn.Module:
    kind, seed = spec["model"], spec["seed"]
    if kind.startswith("bert"):
        model = bert_cases.make_model({"cls": {**CLASSES, **MORE_BERT}[kind], "seed": seed, "seq": 32, "dtype": "float64",
                                       "config": BERT})
    elif kind == "t5":
        model = t5_cases.make_model({"cls": CLASSES[kind], "seed": seed, "dtype": "float64", "config": T5})
    elif kind == "llama":
        model = inference_cases.make_model(CLASSES[kind], "llama", torch.float64, seed, initializer_range=0.5)
    elif kind in MOE:
        model = moe_cases.build_model(kind, experts=4, seed=seed, vocab_size=41, initializer_range=0.5)
    else:
        model = inference_cases.make_model(INFERRED[kind][1], INFERRED[kind][0], torch.float64, seed)
    attention = spec.get("attention", "sdpa")
    set_attention(model, blocks_name("sdpa") if attention == "blocks" else attention)
    return model


def samples(spec: dict) -> list[dict]:
    """``spec["samples"]`` documents of 1 to ``spec["budget"]`` tokens (drawn from the spec's seed)."""
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    kind, budget = spec["model"], spec["budget"]
    out = []
    for _ in range(spec["samples"]):
        n = int(torch.randint(1, budget + 1, (), generator=g))
        ids = torch.randint(3, 37, (n,), generator=g)
        if kind in CAUSAL:
            out.append({"input_ids": ids, "labels": ids.clone()})
        elif kind == "t5":
            target = torch.randint(3, 37, (int(torch.randint(1, budget + 1, (), generator=g)),), generator=g)
            out.append({"input_ids": ids, "labels": target})
        else:
            sample = {"input_ids": ids}
            if kind.startswith("bert"):
                sample["token_type_ids"] = torch.randint(0, 2, (n,), generator=g)
            if kind == "bert_tokens":
                sample["labels"] = torch.randint(0, 3, (n,), generator=g)
            elif kind.endswith("mlm"):
                labels = torch.where(torch.rand(n, generator=g) < 0.4, ids, -100)
                labels[0] = ids[0]  # a target in every document
                sample["labels"] = labels
            else:
                sample["labels"] = int(torch.randint(0, 3, (), generator=g))
            out.append(sample)
    return out


def padded(batch: list[dict], kind: str) -> dict:
    """The samples right-padded to the longest (what the unsharded reference trains on)."""
    def pad(key, value):
        return pad_sequence([torch.as_tensor(s[key]) for s in batch], batch_first=True, padding_value=value)

    out = {"input_ids": pad("input_ids", 0),
           "attention_mask": pad_sequence([torch.ones(len(s["input_ids"]), dtype=torch.long) for s in batch],
                                          batch_first=True)}
    if "token_type_ids" in batch[0]:
        out["token_type_ids"] = pad("token_type_ids", 0)
    out["labels"] = torch.tensor([s["labels"] for s in batch]) if kind == "bert_cls" else pad("labels", -100)
    return out


def reference(spec: dict) -> dict:
    """The unsharded model, one process, trained on the padded global batches in order (transformers' own attention:
    SDPA where the sharded model runs block attention)."""
    model = make_model({**spec, "attention": "sdpa" if spec.get("attention") == "blocks" else spec.get("attention")})
    optimizer = adamw(model.parameters())
    data, size = samples(spec), spec["batch_size"]
    losses = []
    for step in range(spec["steps"]):
        optimizer.zero_grad()
        loss = model(**padded(data[step * size:(step + 1) * size], spec["model"])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, items: list[dict]):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def _mesh(layout: dict):
    if not layout:
        return shardlib.init_mesh() if not dist.is_initialized() else pool_mesh(dp=1)
    return pool_mesh(dp=layout.get("dp"), pp=layout.get("pp", 1), tp=layout.get("tp", 1), sp=layout.get("sp", 1),
                     ep=layout.get("ep", 1))


def packed_fit(spec: dict) -> dict:
    """``fit(packing=spec["budget"])`` at ``spec["layout"]`` (+ ``spec["shard"]`` options), compared on this rank
    with :func:`reference`: the largest relative error of the step losses and of the weights after the last step, and
    the masks shardlib's mask builders made meanwhile (``MASKS_BUILT``: "data" or "dense: <reason>")."""
    before = collections.Counter(MASKS_BUILT)
    model = shardlib.shard(make_model(spec), _mesh(spec.get("layout", {})), **spec.get("shard", {}))
    trainer = shardlib.Trainer(model, adamw, microbatches=spec.get("microbatches", 1), max_grad_norm=MAX_GRAD_NORM,
                               **spec.get("trainer", {}))
    data = samples(spec)
    if spec.get("iterable"):  # read in its own order; every rank packs each whole global batch
        data = _Stream(data)
    result = trainer.fit(data, batch_size=spec["batch_size"], max_steps=spec["steps"], shuffle=False,
                         packing=spec["budget"], progress=False, log_interval=1)
    state = shardlib.full_state_dict(model)
    masks = dict(MASKS_BUILT - before)
    expected = reference(spec)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(result.losses, expected["losses"]))
    scale = max(float(t.abs().max()) for t in expected["state"].values() if t.is_floating_point())
    weight_error = {name: float((state[name] - t).abs().max()) / scale  # tied copies are saved once
                    for name, t in expected["state"].items() if t.is_floating_point() and name in state}
    worst = max(weight_error, key=weight_error.get)
    return {"losses": result.losses, "expected": expected["losses"], "loss_error": loss_error,
            "weight_error": weight_error[worst], "worst": worst, "masks": masks}


def packed_logits(spec: dict) -> float:
    """A forward of one packed batch (eval_step, at the layout) against the unsharded model on the padded batch:
    the largest relative error of the logits of every real token (float64: no loss, which transformers computes in
    float32 for a causal LM; ``spec["dtype"]`` float32 for flex_attention, which takes no float64 on a CPU)."""
    from shardlib.train.packing import PackingCollator

    dtype = getattr(torch, spec.get("dtype", "float64"))
    ref = make_model({**spec, "attention": "sdpa"}).to(dtype).eval()
    model = shardlib.shard(make_model(spec).to(dtype), _mesh(spec.get("layout", {})), **spec.get("shard", {}))
    trainer = shardlib.Trainer(model, microbatches=spec.get("microbatches", 1))
    data = [{k: v for k, v in s.items() if k != "labels"} for s in samples(spec)[:spec["batch_size"]]]
    rows = PackingCollator(spec["budget"], rows_multiple=2)(data)
    outputs = trainer.eval_step(rows)
    if not outputs:
        return 0.0  # not the last pipeline stage
    logits = torch.cat([o["logits"] for o in outputs])
    with torch.no_grad():
        inputs = padded([{**s, "labels": s["input_ids"]} for s in data], spec["model"])
        expected = ref(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    worst = 0.0
    for r in range(rows["input_ids"].shape[0]):
        for d in rows["document_ids"][r].unique().tolist():
            if d < 0:
                continue
            got = logits[r, rows["document_ids"][r] == d]
            want = expected[_sample_of(rows, r, d, data), :got.shape[0]]
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


def _sample_of(rows: dict, r: int, d: int, data: list[dict]) -> int:
    """Which sample document ``d`` of row ``r`` is (by its tokens; samples are distinct at these lengths)."""
    tokens = rows["input_ids"][r, rows["document_ids"][r] == d]
    return next(i for i, s in enumerate(data) if len(s["input_ids"]) == len(tokens)
                and bool((torch.as_tensor(s["input_ids"]) == tokens).all()))
