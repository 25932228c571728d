"""Reference: BERT tensor-parallelized by transformers' *own* DTensor TP machinery.

This module builds a ``transformers.BertModel`` (the bare encoder with pooler, NOT
``BertForMaskedLM``) that is sharded over 2 ranks by transformers 5.x's native tensor
parallelism (``transformers.distributed``), to serve as a baseline for shardlib benchmarks.

How it works
------------
* BERT ships no ``base_model_tp_plan``, so we pass a hand-written Megatron-style plan
  (keys are module FQNs relative to ``BertModel``, layer index replaced by ``*``)::

      encoder.layer.*.attention.self.query   -> "colwise"
      encoder.layer.*.attention.self.key     -> "colwise"
      encoder.layer.*.attention.self.value   -> "colwise"
      encoder.layer.*.attention.output.dense -> "rowwise"
      encoder.layer.*.intermediate.dense     -> "colwise"
      encoder.layer.*.output.dense           -> "rowwise"

  Embeddings, LayerNorms and the pooler are left replicated (plain tensors).
* Rank 0 writes a random-weight checkpoint with ``save_pretrained`` (safetensors) into
  ``tmpdir``; all ranks then call the public API

      BertModel.from_pretrained(path, distributed_config=DistributedConfig(tp_plan=BERT_TP_PLAN))

  ``from_pretrained`` builds a ``(pp, dp_replicate, fsdp, tp)`` = ``(1, 1, 1, 2)`` DeviceMesh
  itself (``initialize_distributed_mesh``; it reuses the already-initialized gloo process group,
  on CPU the mesh device type is "cpu"), replaces the planned ``nn.Linear`` weights by DTensors
  (colwise: weight/bias ``Shard(0)``; rowwise: weight ``Shard(1)``, bias ``Replicate()``), wraps
  those modules' ``forward`` with redistribution logic, and each rank then loads only its shard
  from the checkpoint. The model must therefore be loaded from disk: there is no public
  "shard this already-built in-memory model" entry point (``apply_tensor_parallelism`` is
  internal and expects meta/placeholder params).
  The deprecated spelling ``from_pretrained(path, tp_plan=<dict>)`` is equivalent (it just wraps
  it in a DistributedConfig and emits a FutureWarning); ``tp_plan="auto"`` also works if
  ``config.base_model_tp_plan`` is set on the config object passed to ``from_pretrained``
  (it is a ClassVar and is not serialized to config.json).
* Attention heads: ``BertSelfAttention`` reshapes q/k/v with ``view(*shape, -1, head_dim)`` and
  the attention output with ``reshape(*shape, -1)``, so each rank just sees
  ``num_attention_heads / tp`` heads; ``num_attention_heads`` / ``all_head_size`` attributes are
  not used in forward and need no patching. Heads must be divisible by the TP size.

Caveats
-------
* torch.distributed must already be initialized (gloo) with WORLD_SIZE == 2 (torchrun); the
  TP degree is derived from WORLD_SIZE. transformers creates its own DeviceMesh; the model's
  ``_device_mesh`` / ``_mesh_manager`` attributes hold it.
* accelerate IS required, even on CPU: the mesh setup returns an implicit
  ``device_map=torch.device("cpu")`` and ``from_pretrained`` -> ``check_and_set_device_map``
  raises "Using a `device_map`, `tp_plan`, ... requires `accelerate`" without it (verified).
  Do not pass your own ``device_map`` (TP and device_map are mutually exclusive).
* Outputs are plain ``torch.Tensor``s, not DTensors: every planned layer uses
  ``use_local_output=True``, and the rowwise layers all-reduce to ``Replicate()``, so
  ``last_hidden_state`` is the full, identical tensor on every rank.
* With grad enabled the sharded Linears run through DTensor ops (from_local / redistribute,
  all-reduce in forward after each rowwise layer, all-reduce of input grads in backward after
  each colwise layer). Under ``torch.no_grad()`` a local fast path is used (plain matmuls +
  ``dist.all_reduce``). Both give the same numbers.
* Backward works: the sharded parameters' ``.grad`` are DTensors (Shard placements), the
  replicated parameters' grads are plain tensors identical on every rank. An optimizer must
  handle DTensor params (torch.optim does).
* ``from_pretrained`` returns the model in ``eval()`` mode (dropout off); call ``.train()`` if
  wanted.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import transformers
from transformers import BertModel
from transformers.distributed import DistributedConfig

BERT_TP_PLAN: dict[str, str] = {
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}


def _save_reference_checkpoint(config: transformers.BertConfig, path: str, seed: int) -> None:
    """Rank 0 writes a random-init BertModel checkpoint to ``path``; everybody waits for it."""
    if dist.get_rank() == 0:
        torch.manual_seed(seed)
        ref = BertModel(config)
        ref.save_pretrained(path)
        del ref
    dist.barrier()


def build_hf_tp_bert(config: transformers.BertConfig, tmpdir: str, seed: int) -> torch.nn.Module:
    """Return a ``BertModel`` tensor-parallelized by transformers' own DTensor TP.

    Must be called on every rank after ``torch.distributed.init_process_group("gloo")``.
    Weights are random (seeded by ``seed``), written once by rank 0 to ``tmpdir/hf_bert_ckpt``
    and loaded sharded on every rank. The returned model is in eval mode.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before build_hf_tp_bert")
    world = dist.get_world_size()
    if config.num_attention_heads % world or config.intermediate_size % world:
        raise ValueError("num_attention_heads and intermediate_size must be divisible by the world size")

    path = os.path.join(tmpdir, "hf_bert_ckpt")
    _save_reference_checkpoint(config, path, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = BertModel.from_pretrained(
            path,
            distributed_config=DistributedConfig(tp_plan=dict(BERT_TP_PLAN)),
            dtype=torch.float32,
        )
    return model


# --------------------------------------------------------------------------------------
# Self-check:  python -m torch.distributed.run --nproc-per-node 2 benchmarks/_hf_dtensor_tp.py
# --------------------------------------------------------------------------------------
def _self_check() -> None:
    import tempfile
    import time

    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    def log(*a):
        if rank == 0:
            print(*a, flush=True)

    config = transformers.BertConfig(
        vocab_size=1000,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=512,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    # A shared temp dir: rank 0 creates it and broadcasts the name.
    holder = [tempfile.mkdtemp(prefix="hf_tp_bert_") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    tmpdir = holder[0]

    tp_model = build_hf_tp_bert(config, tmpdir, seed=1234)
    ref_model = BertModel.from_pretrained(os.path.join(tmpdir, "hf_bert_ckpt"), dtype=torch.float32)

    n_dt = sum(isinstance(p, DTensor) for p in tp_model.parameters())
    q = tp_model.encoder.layer[0].attention.self.query.weight
    o = tp_model.encoder.layer[0].attention.output.dense
    log(f"DTensor params: {n_dt}/{len(list(tp_model.parameters()))}; "
        f"query.weight {type(q).__name__} {tuple(q.shape)} local {tuple(q.to_local().shape)} {q.placements}; "
        f"attn.output.dense.weight {o.weight.placements} bias {o.bias.placements}")

    # Same inputs on every rank.
    g = torch.Generator().manual_seed(0)
    B, S = 8, 128
    input_ids = torch.randint(0, config.vocab_size, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[1, 100:] = 0
    attention_mask[5, 64:] = 0
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask)

    # Forward, no-grad (local fast path) and grad-enabled (DTensor path).
    with torch.no_grad():
        ref_out = ref_model(**inputs).last_hidden_state
        tp_out_ng = tp_model(**inputs).last_hidden_state
    out = tp_model(**inputs)
    tp_out = out.last_hidden_state
    log(f"last_hidden_state type: {type(tp_out).__name__}")
    d_ng = (full(tp_out_ng) - ref_out).abs().max().item()
    d_g = (full(tp_out).detach() - ref_out).abs().max().item()
    log(f"max |TP - ref| last_hidden_state: no_grad={d_ng:.3e} grad={d_g:.3e}")
    assert d_ng < 1e-5 and d_g < 1e-5, (d_ng, d_g)

    # Backward: compare gradients with the unsharded reference.
    loss = full(tp_out).float().pow(2).mean() + full(out.pooler_output).sum()
    loss.backward()
    ref_o = ref_model(**inputs)
    ref_loss = ref_o.last_hidden_state.pow(2).mean() + ref_o.pooler_output.sum()
    ref_loss.backward()
    ref_params = dict(ref_model.named_parameters())
    max_gd = 0.0
    for name, p in tp_model.named_parameters():
        assert p.grad is not None, name
        gd = (full(p.grad) - ref_params[name].grad).abs().max().item()
        max_gd = max(max_gd, gd)
    log(f"loss TP={loss.item():.6f} ref={ref_loss.item():.6f}; max |grad diff| over all params = {max_gd:.3e}")
    assert abs(loss.item() - ref_loss.item()) < 1e-5 and max_gd < 1e-4

    # Timing: fwd+bwd per step.
    def step(m):
        m.zero_grad(set_to_none=True)
        o = m(**inputs).last_hidden_state
        full(o).float().pow(2).mean().backward()

    for name, m in (("hf-dtensor-tp", tp_model), ("unsharded (per rank)", ref_model)):
        for _ in range(2):
            step(m)
        dist.barrier()
        n = 5
        t0 = time.perf_counter()
        for _ in range(n):
            step(m)
        dist.barrier()
        log(f"{name}: {(time.perf_counter() - t0) / n * 1e3:.1f} ms / fwd+bwd step "
            f"(B={B}, S={S}, hidden 256, 4 layers, 1 thread/rank)")

    log("SELF-CHECK OK")
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(tmpdir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _self_check()
