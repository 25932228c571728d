"""Rank-pool tasks of test_finetune.py: what a fine-tuning user coming from transformers sees on every rank."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification, BertModel

import shardlib
from harness import mesh

BASE = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.name} {record.levelname}: {record.getMessage()}")


def head_from_base_checkpoint(workdir: str) -> dict:
    """A BertModel checkpoint (written by transformers on rank 0) into BertForSequenceClassification at tp=2 with a
    config override, each dp replica's generator seeded differently: what each rank logged and warned, and the
    classifier it initialized."""
    base = Path(workdir) / "base"
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        BertModel(BertConfig(**BASE)).save_pretrained(base)
    dist.barrier()
    torch.manual_seed(mesh(tp=2).local_rank("dp"))  # dp replicas seeded apart: the new head must still be one
    handler, logger = _Records(), logging.getLogger("shardlib")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = shardlib.from_pretrained(BertForSequenceClassification, base, mesh(tp=2), strict=False,
                                             num_labels=5, problem_type="single_label_classification")
    finally:
        logger.removeHandler(handler)
    return {"logged": handler.messages, "warned": [str(w.message) for w in caught],
            "classifier": model.classifier.weight.tolist() + [model.classifier.bias.tolist()],
            "num_labels": model.config.num_labels}


def samples_as(kind: str, n: int = 24, seed: int = 1):
    """The same samples as a list of dicts, a ``datasets.Dataset`` (map-style, torch format) or its
    ``IterableDataset``: built locally from a dict, nothing downloaded."""
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(0, BASE["vocab_size"], (n, 6), generator=g), torch.randint(0, 2, (n,), generator=g)
    if kind == "list":
        return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]
    import datasets

    table = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return (table if kind == "dataset" else table.to_iterable_dataset()).with_format("torch")


def fit_on(kind: str, shuffle: bool) -> list[float]:
    """``fit`` at dp=2 x tp=2 on the samples as ``kind``: every step's loss (float64, dropout off)."""
    torch.manual_seed(0)
    config = BertConfig(**BASE, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = shardlib.shard(BertForSequenceClassification(config).double(), mesh(dp=2, tp=2))
    trainer = shardlib.Trainer(model, lambda params: torch.optim.SGD(params, lr=0.5))
    return trainer.fit(samples_as(kind), batch_size=8, max_steps=5, shuffle=shuffle, progress=False).losses


def trainer_with_generators_apart() -> str:
    """A Trainer at tp=2 when the tp ranks' default generators differ (each rank seeded with its own rank)."""
    torch.manual_seed(dist.get_rank())
    model = shardlib.shard(BertForSequenceClassification(BertConfig(**BASE)), mesh(tp=2))
    try:
        shardlib.Trainer(model, lambda params: torch.optim.SGD(params, lr=0.1))
    except ValueError as exc:
        return str(exc)
    return "no error"


def fit_until_sigterm(workdir: str) -> dict:
    """``fit`` at dp=2 x tp=2 with a save_dir; rank 0 alone receives SIGTERM while its 3rd batch is collated."""
    import os
    import signal

    torch.manual_seed(0)
    model = shardlib.shard(BertForSequenceClassification(BertConfig(**BASE, num_labels=2)), mesh(dp=2, tp=2))
    trainer = shardlib.Trainer(model, lambda params: torch.optim.SGD(params, lr=0.1))
    calls = []

    def collate(samples):
        calls.append(1)
        if len(calls) == 3 and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return torch.utils.data.default_collate(samples)

    before = signal.getsignal(signal.SIGTERM)
    try:
        trainer.fit(samples_as("list"), batch_size=8, max_steps=10, save_dir=str(Path(workdir) / "run"),
                    collate_fn=collate, progress=False)
        status = "returned"
    except SystemExit as exc:
        status = exc.code
    return {"status": status, "handler_restored": signal.getsignal(signal.SIGTERM) is before,
            "checkpoints": sorted(p.name for p in (Path(workdir) / "run" / "checkpoints").iterdir())}
