"""Fine-tune a classification head from a base checkpoint, as a transformers user would, at any layout:

1. the base: an HF ``BertModel`` checkpoint with no head (``--base DIR``; without one the script writes a randomly
   initialized BertModel there with transformers' own ``save_pretrained``, standing in for a pre-trained encoder
   such as all-MiniLM-L6-v2);
2. ``shardlib.from_pretrained(BertForSequenceClassification, base, mesh, strict=False, num_labels=2, ...)``: each
   rank reads its slices of the base, the head is new (named once in a warning), the config overrides are
   transformers' own keyword arguments;
3. ``Trainer.fit`` on SST-2-shaped generated sentences (``bert_sst2.py``), then ``shardlib.save_pretrained`` to
   ``--export DIR``;
4. plain transformers reloads the export in one process and its predictions are compared with the sharded model's.

    shardlib run --nproc 2 examples/finetune_head.py --tp 2      # tensor parallel over 2 ranks
    python examples/finetune_head.py                             # one process
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification, BertModel

import shardlib
from bert_sst2 import VOCAB, accuracy, sentences
from shardlib.train import mesh_from_args, parse_args

DEFAULTS = {"batch_size": 32, "lr": 1e-3, "max_steps": 60, "warmup_ratio": 0.1, "eval_batch_size": 100}
WORKDIR = os.path.join(tempfile.gettempdir(), "shardlib-finetune-head")


@dataclass
class FinetuneArgs:
    base: str = os.path.join(WORKDIR, "base")
    export: str = os.path.join(WORKDIR, "export")
    hidden: int = 128
    layers: int = 2
    seq: int = 64
    train_samples: int = 2000
    eval_samples: int = 300


def write_base(directory: str, m: FinetuneArgs) -> None:
    """A headless BertModel checkpoint, written by transformers (rank 0; the others wait)."""
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(directory, "config.json")):
        torch.manual_seed(1234)
        config = BertConfig(vocab_size=VOCAB, hidden_size=m.hidden, num_hidden_layers=m.layers,
                            num_attention_heads=max(m.hidden // 64, 1), intermediate_size=4 * m.hidden,
                            max_position_embeddings=512)
        BertModel(config).save_pretrained(directory)
        print(f"wrote a randomly initialized BertModel to {directory} (the base checkpoint)", flush=True)
    dist.barrier()


def predictions(model, samples: list[dict]) -> torch.Tensor:
    batch = {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        return model.eval()(**batch).logits


def main() -> int:
    args, m = parse_args(FinetuneArgs, defaults=DEFAULTS)
    mesh = mesh_from_args(args)
    rank = dist.get_rank()
    write_base(m.base, m)
    torch.manual_seed(args.seed)  # every rank alike: the new head's init, and replicated dropout masks
    model = shardlib.from_pretrained(BertForSequenceClassification, m.base, mesh, strict=False, num_labels=2,
                                     id2label={0: "negative", 1: "positive"}, **args.shard_options())
    trainer = shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=args.lr), **args.trainer_options())
    train, held_out = sentences(m.train_samples, m.seq, args.seed), sentences(m.eval_samples, m.seq, args.seed + 1)
    result = trainer.fit(train, eval_data=held_out, metrics={"accuracy": accuracy}, **args.fit_options())
    shardlib.save_pretrained(model, m.export)  # replaces an earlier export, atomically
    sharded = predictions(model, held_out[:50])  # every rank: the tensor-parallel forward needs its peers
    if rank == 0:
        print(f"{mesh}: {result.step} steps, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, held-out "
              f"accuracy {result.evals[-1]['accuracy']:.1%}; exported to {m.export}")
        reloaded = BertForSequenceClassification.from_pretrained(m.export)  # plain transformers, one process
        plain = predictions(reloaded, held_out[:50])
        agree = (plain.argmax(-1) == sharded.argmax(-1)).float().mean()
        print(f"transformers reload: {reloaded.config.id2label}, predictions agree on {agree:.0%} of 50 sentences, "
              f"max |logit difference| {(plain - sharded).abs().max():.1e}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
