"""Tensor-parallel BERT in a few lines: train a sharded BertForMaskedLM and its unsharded twin side by side.

Run with 2 ranks:

    shardlib run --nproc 2 examples/bert_tp_demo.py [--steps 8] [--layers 4] [--hidden 256]

Long sequences: ``--sp N`` shares each sequence between N ranks with all-to-all (Ulysses) sequence parallelism
(tensor parallelism over the other ranks), e.g. 4 ranks as tp=2 x sp=2 on 250-token sequences:

    shardlib run --nproc 4 examples/bert_tp_demo.py --sp 2 --seq 250

``--ring`` passes K/V blocks around the sp ranks instead (ring attention: sp need not divide the heads), e.g. four
ranks sharing each 1000-token sequence of a 2-head model:

    shardlib run --nproc 4 examples/bert_tp_demo.py --sp 4 --ring --heads 2 --seq 1000

Every rank builds the same unsharded model under one seed, keeps a copy as the reference, shards the other over
tp=2 and trains both on the same synthetic masked-LM batches with AdamW (dropout off so the two must agree).
Rank 0 prints both losses per step, then the largest weight difference after training.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import BertConfig, BertForMaskedLM

import shardlib


def synthetic_mlm_batch(step: int, batch: int, seq: int, vocab: int, seed: int):
    """Arithmetic token sequences (start + stride * position over 200 token ids) with 15% of positions masked as
    targets: learnable from the neighbours. Same on every rank (seeded by step)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    start = torch.randint(0, 200, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    ids = 5 + (start + stride * torch.arange(seq)) % min(200, vocab - 5)
    targets = torch.rand(batch, seq, generator=g) < 0.15
    targets[:, 0] = True
    labels = torch.where(targets, ids, torch.full_like(ids, -100))
    ids = torch.where(targets, torch.full_like(ids, 4), ids)  # id 4 plays [MASK]
    return ids, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sp", type=int, default=1, help="ranks per sequence (all-to-all sequence parallelism)")
    parser.add_argument("--ring", action="store_true", help="with --sp: ring attention instead of all-to-all")
    args = parser.parse_args()

    torch.set_num_threads(1)
    shardlib.parallel.mesh.init_distributed()
    mesh = shardlib.init_mesh(tp=torch.distributed.get_world_size() // args.sp, sp=args.sp)
    rank0 = torch.distributed.get_rank() == 0
    config = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        max_position_embeddings=max(512, args.seq))
    torch.manual_seed(args.seed)
    reference = BertForMaskedLM(config)
    mode = ("ring" if args.ring else "all_to_all") if args.sp > 1 else False
    model = shardlib.shard(copy.deepcopy(reference), mesh, sequence_parallel=mode)
    if rank0:
        r = shardlib.report(model)
        print(f"{mesh}\nparameters per rank: {r.local_bytes / 2**20:.1f} MiB sharded vs "
              f"{r.unsharded_bytes / 2**20:.1f} MiB unsharded ({r.local_bytes / r.unsharded_bytes:.2f}x)")
        layout = f"tp={mesh.tp}" + (f" sp={mesh.sp}" if mesh.sp > 1 else "")
        print(f"{'step':>4}  {'unsharded loss':>14}  {layout + ' loss':>14}  {'|diff|':>9}  {'step s':>9}")
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    worst = 0.0
    for step in range(args.steps):
        ids, labels = synthetic_mlm_batch(step, args.batch, args.seq, args.vocab, args.seed)
        loss_ref = reference(input_ids=ids, labels=labels).loss
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        diff = abs(loss.item() - loss_ref.item())
        worst = max(worst, diff)
        if rank0:
            print(f"{step:>4}  {loss_ref.item():>14.6f}  {loss.item():>14.6f}  {diff:>9.2e}  {elapsed:>9.3f}")
    weights = shardlib.full_state_dict(model)
    max_w = max((weights[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    if rank0:
        verdict = "MATCH" if worst < 1e-4 and max_w < 1e-4 else "MISMATCH"
        print(f"{verdict}: largest loss difference {worst:.2e}, largest weight difference after "
              f"{args.steps} AdamW steps {max_w:.2e} (fp32 rounding from a different summation order)")
    torch.distributed.destroy_process_group()
    if worst >= 1e-4 or max_w >= 1e-4:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
