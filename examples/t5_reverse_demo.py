"""A T5 example: learn to reverse digit strings (generated data) with tensor x pipeline parallelism, then decode
greedily through the pipeline and print example generations.

    shardlib run --nproc 4 examples/t5_reverse_demo.py [--tp 2 --pp 2 --steps 300]

The encoder and decoder layers are spread over the stages by the cost model (decoder layers, with
cross-attention, weigh more); the encoder output travels to the decoder stages and its gradient comes back.
Greedy decoding runs the whole pipelined model once per generated token (no KV cache across stages).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from transformers import T5Config, T5ForConditionalGeneration

import shardlib
from shardlib.train import Trainer

PAD, EOS, FIRST_DIGIT = 0, 1, 2


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--length", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def examples(batch: int, length: int, g: torch.Generator) -> dict:
    """input: digits then EOS; target: the digits reversed then EOS."""
    digits = torch.randint(FIRST_DIGIT, FIRST_DIGIT + 10, (batch, length), generator=g)
    eos = torch.full((batch, 1), EOS)
    return {"input_ids": torch.cat([digits, eos], 1), "attention_mask": torch.ones(batch, length + 1, dtype=torch.long),
            "labels": torch.cat([digits.flip(1), eos], 1)}


def text(ids) -> str:
    return "".join(str(int(t) - FIRST_DIGIT) if t >= FIRST_DIGIT else ("" if t == EOS else "_") for t in ids)


def greedy(trainer: Trainer, mesh, input_ids, attention_mask, steps: int) -> torch.Tensor:
    """Greedy decoding through the pipeline: each step runs every stage once; the last stage's choice is
    shared with the other stages of its pipeline (a sum over the pp group, zeros elsewhere)."""
    decoder = torch.full((input_ids.shape[0], 1), PAD)
    for _ in range(steps):
        outputs = trainer.eval_step({"input_ids": input_ids, "attention_mask": attention_mask,
                                     "decoder_input_ids": decoder})
        chosen = torch.zeros(input_ids.shape[0], dtype=torch.long)
        if outputs:
            chosen = torch.cat([o["logits"][:, -1].argmax(-1) for o in outputs])
        if mesh.pp > 1:
            dist.all_reduce(chosen, group=mesh.group("pp"))
        decoder = torch.cat([decoder, chosen[:, None]], 1)
    return decoder[:, 1:]


def main() -> int:
    args = parse_args()
    mesh = shardlib.init_mesh(pp=args.pp, tp=args.tp)
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    config = T5Config(vocab_size=FIRST_DIGIT + 10, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD)
    model = shardlib.shard(T5ForConditionalGeneration(config), mesh)
    trainer = Trainer(model, lambda params: torch.optim.AdamW(params, lr=args.lr), microbatches=args.microbatches,
                      schedule=args.schedule, max_grad_norm=1.0)
    if rank == 0:
        print(f"{mesh}; stages: {shardlib.shard_state(model).pipeline.plan.layers if shardlib.shard_state(model).pipeline else 'one'}")
    g = torch.Generator().manual_seed(args.seed + 1)
    start, losses = time.perf_counter(), []
    for step in range(args.steps):
        losses.append(trainer.train_step(examples(args.batch, args.length, g)))
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {(step + 1) * args.batch / (time.perf_counter() - start):.0f}"
                  " sequences/s", flush=True)
    test = examples(8, args.length, torch.Generator().manual_seed(12345))
    generated = greedy(trainer, mesh, test["input_ids"], test["attention_mask"], args.length + 1)
    exact = (generated == test["labels"]).all(1).float().mean().item()
    if rank == 0:
        for source, output in zip(test["input_ids"][:4], generated[:4]):
            print(f"  {text(source)} -> {text(output)}")
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; exact reversals {exact:.0%} of {len(generated)}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
