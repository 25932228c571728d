"""The rank tasks' case interface (``make_model(spec)``, ``make_batch(spec, config)``; ``cases(spec)`` finds it by
``spec["family"] == "inferred"``) for models without a policy, sharded by their inferred plan: ``spec["model"]``
names the family of tests/inference_cases.py, ``spec["cls"]`` the class, ``spec["config"]`` overrides of its small
config. Batches are right-padded (random lengths); masked LMs get labels, causal LMs none (their objective is a
weighted sum of the float64 logits: transformers computes the causal-LM loss in float32)."""

from __future__ import annotations

import torch

import inference_cases
from rank_tasks import DTYPES


def make_model(spec: dict) -> torch.nn.Module:
    return inference_cases.make_model(spec["cls"], spec["model"], DTYPES[spec["dtype"]], spec["seed"],
                                      **spec.get("config", {}))


def make_batch(spec: dict, config) -> dict:
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    b, s = spec["batch"], spec["seq"]
    ids = torch.randint(3, config.vocab_size, (b, s), generator=g)
    lengths = torch.randint(max(1, s // 2), s + 1, (b, 1), generator=g)
    mask = (torch.arange(s) < lengths).long()
    ids = torch.where(mask.bool(), ids, config.pad_token_id if config.pad_token_id is not None else 0)
    batch = {"input_ids": ids, "attention_mask": mask}
    if spec["cls"].endswith("MaskedLM"):
        labels = torch.where((torch.rand(ids.shape, generator=g) < 0.5) & mask.bool(), ids, -100)
        labels[:, 0] = ids[:, 0]  # a target in every row
        batch["labels"] = labels
    return batch
