"""The chaos tests' training script (test_failures.py): train_script.py's small BERT (dropout on) trained by ``fit``,
with failures injected from a plan, for runs under ``shardlib run --max-restarts N`` (and ``--nnodes MIN:MAX``).

``--faults PATH``: a JSON list of ``{"attempt", "rank", "where", "step"}``: in launcher attempt ``attempt``
(``TORCHELASTIC_RESTART_COUNT``), global rank ``rank`` SIGKILLs itself inside the forward of global step ``step``
(``where="step"``), inside the writer of the checkpoint of step ``step`` after its first tensor (``"save"``), or inside
the evaluation after step ``step`` (``"eval"``). Each kill is first appended to ``SAVE_DIR/kills.jsonl`` with its
wall time; rank 0 appends every finished step to ``SAVE_DIR/steps.jsonl`` (attempt, step, world size, wall time).
At the end rank 0 prints ``FINAL <json>``: every rank's SHA-256 of its local parameters and optimizer state (in name
order), the world size, and the step.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification

import shardlib
from shardlib.train import mesh_from_args, parse_args
from train_script import dataset, kill_mid_save, kill_self


@dataclass
class ChaosArgs:
    samples: int = 256
    faults: str = ""
    dropout: float = 0.1
    step_seconds: float = 0.0  # the least wall time of a step (sleeping the rest): time for a node to rejoin


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def global_step(trainer) -> int:
    """Optimizer steps done so far, restored by a resume: AdamW's step count of any parameter with state."""
    for state in trainer.optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def arm(trainer, fault: dict, save_dir: Path) -> None:
    """Make this rank SIGKILL itself where ``fault`` says."""
    def die():
        _append(save_dir / "kills.jsonl", {**fault, "time": time.time()})
        kill_self()

    where, step = fault["where"], fault["step"]
    if where == "save":
        kill_mid_save(trainer, step, die)
        return
    layer = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.ModuleList) and len(m))[0]

    def hook(module, *_):
        done = global_step(trainer)
        if where == "step" and module.training and done == step - 1:
            die()
        if where == "eval" and not module.training and done == step:
            die()

    layer.register_forward_hook(hook)


def record_steps(trainer, save_dir: Path, step_seconds: float) -> None:
    """Rank 0 appends each finished step to steps.jsonl; every rank's step lasts at least ``step_seconds``."""
    original = trainer.train_step

    def train_step(batch):
        start = time.monotonic()
        loss = original(batch)
        time.sleep(max(step_seconds - (time.monotonic() - start), 0))
        if dist.get_rank() == 0:
            _append(save_dir / "steps.jsonl", {"attempt": attempt(), "step": global_step(trainer),
                                               "world": dist.get_world_size(), "time": time.time(), "loss": loss})
        return loss

    trainer.train_step = train_step


def digest(trainer) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(trainer.model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for group in trainer.optimizer.state_dict()["state"].values():
        for key in sorted(group):
            value = group[key]
            if torch.is_tensor(value):
                h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main():
    args, mine = parse_args(ChaosArgs)
    mesh = mesh_from_args(args)
    save_dir = Path(args.save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    config = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, hidden_dropout_prob=mine.dropout,
                        attention_probs_dropout_prob=mine.dropout,
                        max_position_embeddings=16)
    model = BertForSequenceClassification(config)
    if mesh.device_type == "cuda":  # NCCL: on this rank's GPU (the device machine's check)
        model = model.cuda()
    model = shardlib.shard(model, mesh, **args.shard_options())
    trainer = shardlib.Trainer(model, lambda p: torch.optim.AdamW(p, lr=args.lr), **args.trainer_options())
    for fault in json.loads(Path(mine.faults).read_text()) if mine.faults else []:
        if fault["attempt"] == attempt() and fault["rank"] == dist.get_rank():
            arm(trainer, fault, save_dir)
    record_steps(trainer, save_dir, mine.step_seconds)
    data = dataset(mine.samples)
    result = trainer.fit(data, eval_data=data[:16], **args.fit_options())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(trainer))
    if dist.get_rank() == 0:
        print("FINAL " + json.dumps({"digests": digests, "world": dist.get_world_size(), "step": result.step}),
              flush=True)
    # as every example does: a rank that left its process group to the interpreter's exit aborted once ("terminate
    # called without an active exception", exit code -6) after its last step, failing a finished job
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
