"""T5 learns to sort short token sequences (generated data), trained by ``Trainer.fit`` through a custom
``forward_step``: label-smoothed cross-entropy on the full-vocabulary logits instead of the model's own loss.

    python examples/t5_seq2seq.py                          # one process (a world of one)
    python examples/t5_seq2seq.py --nproc 4 --tp 2         # the script starts 4 ranks: dp=2 x tp=2
    shardlib run --nproc 4 examples/t5_seq2seq.py --tp 2   # the same, started by the launcher

All three print the same ``first losses`` (dropout is 0, the global batches do not depend on the mesh). The
training data is an endless stream (an IterableDataset every rank reads in the same order); the evaluation
measures exact sorts under teacher forcing; greedy generations are printed at the end when there is no pipeline.
Script defaults (any TrainingArguments option overrides them, ``--help`` lists all):

    --batch-size 64 --lr 3e-3 --max-steps 400 --warmup-ratio 0.05 --eval-interval 100 --log-interval 50
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import T5Config, T5ForConditionalGeneration

import shardlib
from shardlib.train import mesh_from_args, parse_args

DEFAULTS = {"batch_size": 64, "lr": 3e-3, "max_steps": 400, "warmup_ratio": 0.05, "eval_interval": "100",
            "log_interval": 50}
PAD, EOS, FIRST = 0, 1, 2  # token ids: padding (also T5's decoder start), end of sequence, first symbol


@dataclass
class TaskArgs:
    length: int = 6  # symbols per sequence
    symbols: int = 20  # the vocabulary is PAD, EOS and this many symbols
    d_model: int = 64
    layers: int = 2
    label_smoothing: float = 0.1


def example(g: torch.Generator, a: TaskArgs) -> dict:
    """input: symbols then EOS; target: the same symbols sorted, then EOS (fixed lengths: no padding)."""
    symbols = torch.randint(FIRST, FIRST + a.symbols, (a.length,), generator=g)
    eos = torch.tensor([EOS])
    return {"input_ids": torch.cat([symbols, eos]), "attention_mask": torch.ones(a.length + 1, dtype=torch.long),
            "labels": torch.cat([symbols.sort().values, eos])}


class SortingStream(torch.utils.data.IterableDataset):
    """An endless stream of examples drawn from one seed: every rank reads the same stream and fit hands each
    data-parallel rank its share of every global batch."""

    def __init__(self, task: TaskArgs, seed: int):
        self.task, self.seed = task, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield example(g, self.task)


def label_smoothed(smoothing: float):
    def forward_step(model, batch):
        out = model(**batch)  # every batch entry goes to the model (required under a pipeline)
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), batch["labels"].flatten(), label_smoothing=smoothing)
        return {"loss": loss, "logits": out.logits}

    return forward_step


def exact(out, mb):
    """Per example: every target token predicted (teacher forcing)."""
    return (out["logits"].argmax(-1) == mb["labels"]).all(-1).float()


def text(ids) -> str:
    return " ".join(str(int(t) - FIRST) for t in ids if t >= FIRST)


def main() -> int:
    args, task = parse_args(TaskArgs, defaults=DEFAULTS)
    mesh = mesh_from_args(args)
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    config = T5Config(vocab_size=FIRST + task.symbols, d_model=task.d_model, d_kv=task.d_model // 4,
                      d_ff=2 * task.d_model, num_layers=task.layers, num_decoder_layers=task.layers, num_heads=4,
                      dropout_rate=0.0, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD)
    # gather_logits: the sharded model returns full-vocabulary logits even with labels (forward_step's loss needs them)
    model = shardlib.shard(T5ForConditionalGeneration(config), mesh, gather_logits=True, **args.shard_options())
    trainer = shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=args.lr),
                               forward_step=label_smoothed(task.label_smoothing), **args.trainer_options())
    g = torch.Generator().manual_seed(args.seed + 1)
    held_out = [example(g, task) for _ in range(256)]
    if rank == 0:
        print(mesh, flush=True)
    result = trainer.fit(SortingStream(task, args.seed), eval_data=held_out, metrics={"exact": exact},
                         **args.fit_options())
    if rank == 0:
        print(f"first losses: [{', '.join(f'{x:.6f}' for x in result.losses[:3])}]")
        print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {result.step} steps; held-out exact sorts "
              f"(teacher forcing) {result.evals[-1]['exact']:.1%}")
    if mesh.pp == 1:  # generate runs the tensor-parallel model on every rank (its collectives need the whole group)
        batch = torch.utils.data.default_collate(held_out[:4])
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 max_new_tokens=task.length + 1, do_sample=False)
        if rank == 0:
            for source, target, generated in zip(batch["input_ids"], batch["labels"], out):
                verdict = "ok" if text(generated) == text(target) else f"expected {text(target)}"
                print(f"  sort({text(source)}) -> {text(generated)}  ({verdict})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
