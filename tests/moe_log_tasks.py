"""Rank-pool tasks of tests/test_moe_logs.py: ``fit``'s log records of a mixture of experts carry the auxiliary router
losses apart, equal to what the unsharded HF model's outputs give for the same batches; a dense model's carry none."""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist

import shardlib
from harness import mesh as pool_mesh
from moe_cases import build_batch, build_model


def _samples(batch: dict) -> list[dict]:
    return [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]


def _read_log(workdir: str) -> list[dict]:
    dist.barrier()  # rank 0 writes the log
    with open(f"{workdir}/log.jsonl") as f:
        return [json.loads(line) for line in f]


def _expected_terms(ref, family: str, batch: dict, pieces: int) -> dict[str, float]:
    """The unsharded model's loss and auxiliary terms on ``batch``, as a step over ``pieces`` contiguous pieces (dp
    ranks x microbatches) weighs them: each piece by its share of the labels. Switch: its coefficients times the
    z-losses and load-balancing losses of encoder and decoder; the decoders: the coefficient times ``aux_loss``."""
    shifted = 1 if family != "switch" else 0  # a causal LM's last position has no target
    items = [float((labels[:, shifted:] != -100).sum()) for labels in batch["labels"].chunk(pieces)]
    expected = {"loss": 0.0, "router_aux_loss": 0.0} | ({"router_z_loss": 0.0} if family == "switch" else {})
    with torch.no_grad():
        for piece, n in zip(zip(*(v.chunk(pieces) for v in batch.values())), items):
            out = ref(**dict(zip(batch, piece)), output_router_logits=True)
            share = n / sum(items)
            expected["loss"] += share * float(out.loss)
            if family == "switch":
                expected["router_z_loss"] += share * ref.router_z_loss_coef * float(out.encoder_z_loss
                                                                                    + out.decoder_z_loss)
                expected["router_aux_loss"] += share * ref.router_aux_loss_coef * float(out.encoder_aux_loss
                                                                                        + out.decoder_aux_loss)
            else:
                expected["router_aux_loss"] += share * ref.router_aux_loss_coef * float(out.aux_loss)
    return expected


def fit_logs_router_losses(workdir: str, family: str, tp: int = 2, microbatches: int = 2, steps: int = 2) -> dict:
    """``fit`` of ``family`` at dp x tp (dp: the rest of the pool) with its router losses, one record per step: the
    records, what the unsharded model gives for the first global batch, and ``Trainer.last_loss_terms``."""
    from shardlib.train import Trainer

    from rank_tasks import _adamw

    mesh, per_step = pool_mesh(tp=tp), 8
    options = {"capacity": 2} if family == "switch" else {"router_losses": True}
    ref = build_model(family, experts=4, **options)
    model = shardlib.shard(copy.deepcopy(ref), mesh)
    batch = build_batch(family, batch=per_step * steps, seed=3)
    trainer = Trainer(model, _adamw, microbatches=microbatches,
                      forward_step=(lambda m, b: m(**b, output_router_logits=True)) if family == "switch" else None)
    trainer.fit(_samples(batch), batch_size=per_step, max_steps=steps, log_interval=1, save_dir=workdir,
                progress=False, shuffle=False)
    first = {k: v[:per_step] for k, v in batch.items()}
    return {"records": _read_log(workdir), "last_terms": trainer.last_loss_terms,
            "expected": _expected_terms(ref, family, first, mesh.dp * microbatches)}


def fit_logs_of_a_dense_model(workdir: str) -> list[dict]:
    """``fit`` of a dense BERT masked LM at dp x tp=2: its records."""
    import transformers

    from shardlib.train import Trainer

    from rank_tasks import _adamw

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    model = shardlib.shard(transformers.BertForMaskedLM(config), pool_mesh(tp=2))
    ids = torch.randint(2, 50, (8, 6), generator=torch.Generator().manual_seed(1))
    trainer = Trainer(model, _adamw)
    trainer.fit(_samples({"input_ids": ids, "labels": ids.clone()}), batch_size=4, max_steps=2, log_interval=1,
                save_dir=workdir, progress=False)
    records = _read_log(workdir)
    assert trainer.last_loss_terms is None and not trainer.loss_terms.enabled
    return records
