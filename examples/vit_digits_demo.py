"""The main job (`make demo`): train a ViT classifier on scikit-learn's handwritten digits with tensor x pipeline
parallelism (tp=2 x pp=2 on 4 local gloo ranks), evaluating test accuracy after every epoch.

    shardlib run --nproc 4 examples/vit_digits_demo.py            # or: python examples/vit_digits_demo.py

Every ``TrainingArguments`` option works (``--help`` lists them); this script's defaults differ from the library's:

    --nproc 4 --tp 2 --pp 2 --microbatches 4 --schedule 1f1b --batch-size 64 --lr 3e-3 --weight-decay 0.01
    --epochs 12 --warmup-ratio 0.1 --eval-interval epoch --eval-batch-size 120

(``--nproc`` only matters for a plain ``python`` start: the script then launches its own ranks.) Mixed precision
as in ColossalAI's hybrid-parallel ViT tutorial: ``--precision fp16`` (autocast and the dynamic loss scaler) or
``--precision bf16``; ``--dp 2 --zero 1`` partitions the optimizer over data parallelism instead of using pp.

Check: rank 0 also runs the unsharded model (same seed, same initial weights) on the first global batch of the run;
the sharded run's first loss must match it to float32 rounding, or the script prints MISMATCH and exits with 1.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from transformers import ViTConfig, ViTForImageClassification

import shardlib
from shardlib.train import epoch_order, mesh_from_args, parse_args
from shardlib.train.precision import autocast

DEFAULTS = {"nproc": 4, "tp": 2, "pp": 2, "microbatches": 4, "schedule": "1f1b", "batch_size": 64, "lr": 3e-3,
            "weight_decay": 0.01, "epochs": 12, "warmup_ratio": 0.1, "eval_interval": "epoch", "eval_batch_size": 120}


@dataclass
class ModelArgs:
    hidden: int = 64
    layers: int = 4
    heads: int = 4


def digits(seed: int):
    """scikit-learn's 1797 8x8 digits (shipped with the package), scaled to [-1, 1], 1 channel; 80/20 split into
    lists of samples {"pixel_values": [1, 8, 8], "labels": []}."""
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    samples = [{"pixel_values": images[i], "labels": labels[i]} for i in order.tolist()]
    cut = int(0.8 * len(samples))
    return samples[:cut], samples[cut:]


def vit(m: ModelArgs) -> ViTForImageClassification:
    config = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=m.hidden, num_hidden_layers=m.layers,
                       num_attention_heads=m.heads, intermediate_size=2 * m.hidden, num_labels=10,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(config)


#: how close the first loss must be to the unsharded model's under the same autocast: float32 rounding, or the
#: rounding of fp16 (unit roundoff 4.9e-4) / bf16 (3.9e-3) in sums taken in another order by the sharded layers
FIRST_LOSS_RTOL = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 4e-2}


def first_batch_loss(model, train, batch_size: int, seed: int, precision: str) -> float:
    """The unsharded model's loss on the run's first global batch (fit's order depends only on seed and epoch)."""
    batch = torch.utils.data.default_collate([train[i] for i in epoch_order(len(train), seed, 0)[:batch_size]])
    with torch.no_grad(), autocast(precision, "cpu"):
        return model(**batch).loss.item()


def accuracy(out, mb):
    return (out["logits"].argmax(-1) == mb["labels"]).float()


def main() -> int:
    args, m = parse_args(ModelArgs, defaults=DEFAULTS)
    mesh = mesh_from_args(args)
    rank = dist.get_rank()
    train, test = digits(args.seed)

    torch.manual_seed(args.seed)  # the same initial weights on every rank, and in the unsharded check
    model = vit(m)
    expected = first_batch_loss(model, train, args.batch_size, args.seed, args.precision) if rank == 0 else None
    parameters = sum(p.numel() for p in model.parameters())
    model = shardlib.shard(model, mesh, **args.shard_options())
    trainer = shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=args.lr,
                                                                       weight_decay=args.weight_decay),
                               **args.trainer_options())
    if rank == 0:
        pipeline = shardlib.shard_state(model).pipeline
        print(f"{mesh}; stages: {pipeline.plan.layers if pipeline else 'one'}")
        print(f"train {len(train)} / test {len(test)} digit images; {parameters / 1e3:.0f}k parameters", flush=True)

    start = time.perf_counter()
    result = trainer.fit(train, eval_data=test, metrics={"accuracy": accuracy}, **args.fit_options())
    elapsed = time.perf_counter() - start

    status = 0
    if rank == 0:
        curve = " ".join(f"{e['accuracy']:.0%}" for e in result.evals)
        print(f"test accuracy after each epoch: {curve}")
        print(f"trained {result.step} steps ({result.epoch} epochs) in {elapsed:.1f} s "
              f"({result.step * args.batch_size / elapsed:.0f} images/s); loss {result.losses[0]:.3f} -> "
              f"{result.losses[-1]:.3f}; final test accuracy {result.evals[-1]['accuracy']:.1%}")
        got = result.losses[0]
        ok = abs(got - expected) <= FIRST_LOSS_RTOL[args.precision] * abs(expected)
        print(f"first loss: tp={mesh.tp} x pp={mesh.pp} x dp={mesh.dp} {got:.6f}, unsharded {expected:.6f}")
        print("MATCH: the sharded model follows the unsharded one" if ok else "MISMATCH")
        status = 0 if ok else 1
    flag = torch.tensor([status])
    dist.broadcast(flag, src=0)
    dist.destroy_process_group()
    return int(flag)


if __name__ == "__main__":
    sys.exit(main())
