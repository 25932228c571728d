"""The main job (`make demo`): train a ViT classifier on scikit-learn's handwritten digits with tensor x pipeline
parallelism (tp=2 x pp=2 on 4 local gloo ranks by default), then report test accuracy.

    shardlib run --nproc 4 examples/vit_digits_demo.py [--tp 2 --pp 2 --steps 150 --schedule 1f1b]

Before training, rank 0 trains an unsharded copy of the same model (same seed, same batches) for the first
``--check-steps`` steps in this process; the sharded run's losses for those steps must match it (float32
rounding), and the script fails if they do not.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from transformers import ViTConfig, ViTForImageClassification

import shardlib
from shardlib.runtime import Trainer


MAX_GRAD_NORM = 1.0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def digits(seed: int):
    """scikit-learn's 1797 8x8 digits (shipped with the package), scaled to [-1, 1], 1 channel; 80/20 split."""
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    return (images[order[:cut]], labels[order[:cut]]), (images[order[cut:]], labels[order[cut:]])


def batches(train, batch: int, seed: int):
    """An endless stream of shuffled training batches, identical on every rank."""
    images, labels = train
    g = torch.Generator().manual_seed(seed + 1)
    while True:
        order = torch.randperm(len(labels), generator=g)
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i:i + batch]
            yield {"pixel_values": images[idx], "labels": labels[idx]}


def make_model(args) -> ViTForImageClassification:
    torch.manual_seed(args.seed)
    config = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       intermediate_size=2 * args.hidden, num_labels=10, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(config)


def optimizer(args):
    return lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)


def reference_losses(model, args, train) -> list[float]:
    """The unsharded model's losses for the first steps (one process, same seed and batches)."""
    reference = copy.deepcopy(model)
    opt = optimizer(args)(reference.parameters())
    losses = []
    stream = batches(train, args.batch, args.seed)
    for _ in range(args.check_steps):
        batch = next(stream)
        opt.zero_grad()
        loss = reference(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    args = parse_args()
    mesh = shardlib.init_mesh(pp=args.pp, tp=args.tp)
    rank = dist.get_rank()
    train, test = digits(args.seed)
    model = make_model(args)
    expected = reference_losses(model, args, train) if rank == 0 else None
    model = shardlib.shard(model, mesh)
    stages = shardlib.shard_state(model).pipeline.plan.layers if shardlib.shard_state(model).pipeline else None
    trainer = Trainer(model, optimizer(args), microbatches=args.microbatches, schedule=args.schedule,
                      max_grad_norm=MAX_GRAD_NORM)
    if rank == 0:
        print(f"{mesh}; stages: {stages}", flush=True)
        print(f"train {len(train[1])} / test {len(test[1])} digit images; "
              f"{sum(p.numel() for p in make_model(args).parameters()) / 1e3:.0f}k parameters", flush=True)

    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="train", file=sys.stdout, dynamic_ncols=True, mininterval=1.0)
    losses, stream, start = [], batches(train, args.batch, args.seed), time.perf_counter()
    for step in range(args.steps):
        losses.append(trainer.train_step(next(stream)))
        if bar is not None:
            rate = (step + 1) * args.batch / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", img_s=f"{rate:.0f}")
            bar.update()
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - start

    correct = torch.zeros(2, dtype=torch.float64)
    images, labels = test
    for i in range(0, len(labels) - args.microbatches + 1, 120):
        chunk = slice(i, min(i + 120, len(labels)))
        n = (chunk.stop - chunk.start) // args.microbatches * args.microbatches
        chunk = slice(chunk.start, chunk.start + n)
        outputs = trainer.eval_step({"pixel_values": images[chunk]})
        if outputs:  # the ranks holding the last stage
            predicted = torch.cat([o["logits"].argmax(-1) for o in outputs])
            correct += torch.tensor([(predicted == labels[chunk]).sum().item(), n], dtype=torch.float64)
    dist.all_reduce(correct)  # each last-stage rank counted the same: divide by their number below
    accuracy = correct[0] / correct[1]

    status = 0
    if rank == 0:
        print(f"trained {args.steps} steps in {elapsed:.1f} s ({args.steps * args.batch / elapsed:.0f} images/s); "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; test accuracy {accuracy:.1%}")
        got = losses[: args.check_steps]
        ok = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(got, expected))
        print(f"first {args.check_steps} losses, tp={args.tp} x pp={args.pp}: {[f'{x:.6f}' for x in got]}")
        print(f"first {args.check_steps} losses, unsharded:  {[f'{x:.6f}' for x in expected]}")
        print("MATCH: sharded training follows the unsharded model" if ok else "MISMATCH")
        status = 0 if ok else 1
    flag = torch.tensor([status])
    dist.broadcast(flag, src=0)
    dist.destroy_process_group()
    return int(flag)


if __name__ == "__main__":
    sys.exit(main())
