"""A training script for the real multi-process tests (test_train_processes.py): a small BERT, ViT or T5 trained
by ``Trainer.fit`` from the command line (``shardlib.train.parse_args``), with dropout on.

``--kill-at-step N --kill-in step|save``: SIGKILL this process (``--kill-rank``) in the middle of step N's forward, or
in the middle of writing the checkpoint that step N starts (after the first tensor is written), to test resume.
Prints one line ``LOSSES <json>`` on rank 0 at the end: {step: loss} of the steps this run trained.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification

import shardlib
from shardlib.train import parse_args, mesh_from_args


@dataclass
class ScriptArgs:
    samples: int = 96
    dropout: float = 0.1
    kill_at_step: int = 0
    kill_in: str = "step"
    kill_rank: int = 1


def dataset(n: int):
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 97, (n, 12), generator=g)
    return [{"input_ids": ids[i], "labels": (ids[i, 0] > 48).long()} for i in range(n)]


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def kill_mid_step(trainer, step: int, save_dir: str) -> None:
    """SIGKILL inside the forward of the first layer during optimizer step ``step`` of this run, once a checkpoint
    is complete (saves are committed in the background: a kill before that would leave none to resume from)."""
    original, calls = trainer.train_step, [0]

    def train_step(batch):
        calls[0] += 1
        if calls[0] == step:
            deadline = time.monotonic() + 60
            while not list(Path(save_dir).glob("checkpoints/step-*/shardlib.json")) and time.monotonic() < deadline:
                time.sleep(0.05)
            for module in trainer.model.modules():
                if isinstance(module, torch.nn.ModuleList) and len(module):
                    next(iter(module._modules.values())).register_forward_hook(lambda *_: kill_self())
                    break
        return original(batch)

    trainer.train_step = train_step


def kill_mid_save(trainer, step: int, die=kill_self) -> None:
    """SIGKILL (``die``) in the background writer of the checkpoint of step ``step``, after its first tensor is
    written."""
    import shardlib.checkpoint.saving as checkpoint_save

    original = checkpoint_save._write_files

    def write_files(directory, files, *args, **kwargs):
        if files and f"step-{step:08d}" in str(directory):
            name, tensors = next(iter(files.items()))
            original(directory, {name: dict([next(iter(tensors.items()))])}, *args, **kwargs)
            die()
        return original(directory, files, *args, **kwargs)

    checkpoint_save._write_files = write_files


def main():
    args, mine = parse_args(ScriptArgs)
    mesh = mesh_from_args(args)
    if mesh.transport != "c10d":
        from shardlib.parallel import shm

        print(f"TRANSPORT {mesh.transport}: {shm.for_group(mesh.tp_group) is not None}", flush=True)
    torch.manual_seed(args.seed)
    config = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=64, hidden_dropout_prob=mine.dropout,
                        attention_probs_dropout_prob=mine.dropout, max_position_embeddings=16)
    model = shardlib.shard(BertForSequenceClassification(config), mesh, **args.shard_options())
    trainer = shardlib.Trainer(model, lambda p: torch.optim.AdamW(p, lr=args.lr), **args.trainer_options())
    if mine.kill_at_step and dist.get_rank() == mine.kill_rank:
        if mine.kill_in == "step":
            kill_mid_step(trainer, mine.kill_at_step, args.save_dir)
        else:
            kill_mid_save(trainer, mine.kill_at_step)
    result = trainer.fit(dataset(mine.samples), eval_data=dataset(mine.samples)[:30], **args.fit_options())
    if dist.get_rank() == 0:
        first = result.first_step
        print("LOSSES " + json.dumps({first + i + 1: loss for i, loss in enumerate(result.losses)}), flush=True)
        print("EVAL " + json.dumps(result.evals[-1] if result.evals else None), flush=True)


if __name__ == "__main__":
    main()
