"""BERT sentence classification shaped like SST-2 (2 labels, up to 128 tokens, padded, attention mask) on generated
data with a learnable rule: a "sentence" is random filler words with a few positive and negative words mixed in,
and its label is positive when positive words outnumber negative ones. Trained by ``Trainer.fit``, evaluating the
held-out accuracy every 50 steps.

    python examples/bert_sst2.py                              # one process
    shardlib run --nproc 2 examples/bert_sst2.py --tp 2       # tensor parallel over 2 ranks
    python examples/bert_sst2.py --nproc 4 --tp 2             # dp=2 x tp=2, started by the script

The default model is a small BERT (hidden 128, 2 layers: about a minute on 2 CPU cores); ``--hidden 768 --layers 12``
is BERT-base (lower ``--lr`` to 5e-5 or so). Script defaults (any TrainingArguments option overrides them):

    --batch-size 32 --lr 1e-3 --epochs 2 --warmup-ratio 0.1 --eval-interval 50 --eval-batch-size 100
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification

import shardlib
from shardlib.train import mesh_from_args, parse_args

DEFAULTS = {"batch_size": 32, "lr": 1e-3, "epochs": 2, "warmup_ratio": 0.1, "eval_interval": "50",
            "eval_batch_size": 100}
VOCAB, PAD, CLS, SEP = 30522, 0, 101, 102  # bert-base-uncased's vocabulary size and special ids
POSITIVE, NEGATIVE, FILLER = range(1000, 1010), range(2000, 2010), range(3000, 5000)  # word ids


@dataclass
class ModelArgs:
    hidden: int = 128
    layers: int = 2
    seq: int = 128
    train_samples: int = 3200
    eval_samples: int = 500


def sentences(n: int, seq: int, seed: int) -> list[dict]:
    """``n`` padded examples: [CLS] words [SEP] [PAD]...; 1 to 6 sentiment words of each kind in unequal numbers."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = int(torch.randint(16, seq - 1, (), generator=g))
        words = torch.randint(FILLER.start, FILLER.stop, (length,), generator=g)
        positive, negative = torch.randint(0, 7, (2,), generator=g).tolist()
        if positive == negative:
            positive += 1
        slots = torch.randperm(length, generator=g)[:positive + negative]
        words[slots[:positive]] = torch.randint(POSITIVE.start, POSITIVE.stop, (positive,), generator=g)
        words[slots[positive:]] = torch.randint(NEGATIVE.start, NEGATIVE.stop, (negative,), generator=g)
        ids = torch.full((seq,), PAD)
        ids[:length + 2] = torch.cat([torch.tensor([CLS]), words, torch.tensor([SEP])])
        samples.append({"input_ids": ids, "attention_mask": (ids != PAD).long(),
                        "labels": torch.tensor(int(positive > negative))})
    return samples


def accuracy(out, mb):
    return (out["logits"].argmax(-1) == mb["labels"]).float()


def main() -> int:
    args, m = parse_args(ModelArgs, defaults=DEFAULTS)
    mesh = mesh_from_args(args)
    rank = dist.get_rank()
    train, held_out = sentences(m.train_samples, m.seq, args.seed), sentences(m.eval_samples, m.seq, args.seed + 1)

    torch.manual_seed(args.seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=m.hidden, num_hidden_layers=m.layers,
                        num_attention_heads=max(m.hidden // 64, 1), intermediate_size=4 * m.hidden,
                        max_position_embeddings=max(512, m.seq), num_labels=2)
    model = shardlib.shard(BertForSequenceClassification(config), mesh, **args.shard_options())
    trainer = shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=args.lr,
                                                                       weight_decay=args.weight_decay),
                               **args.trainer_options())
    if rank == 0:
        print(f"{mesh}; BERT hidden {m.hidden} x {m.layers} layers; {len(train)} train / {len(held_out)} held-out "
              f"sentences of up to {m.seq} tokens", flush=True)
    start = time.perf_counter()
    result = trainer.fit(train, eval_data=held_out, metrics={"accuracy": accuracy}, **args.fit_options())
    elapsed = time.perf_counter() - start
    if rank == 0:
        print("held-out accuracy by step: " + " ".join(f"{e['step']}: {e['accuracy']:.1%}" for e in result.evals))
        print(f"trained {result.step} steps in {elapsed:.1f} s ({result.step * args.batch_size / elapsed:.0f} "
              f"sentences/s); loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}; "
              f"final accuracy {result.evals[-1]['accuracy']:.1%}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
