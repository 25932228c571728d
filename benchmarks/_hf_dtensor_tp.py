"""Reference: BERT and ViT tensor-parallelized by transformers' *own* DTensor TP machinery (and why T5 cannot be).

This module builds models that are sharded over 2 ranks by transformers 5.x's native tensor parallelism
(``transformers.distributed``), to serve as a baseline for shardlib benchmarks:

* ``build_hf_tp_bert``: ``transformers.BertModel`` (the bare encoder with pooler, NOT ``BertForMaskedLM``);
* ``build_hf_tp_vit``:  ``transformers.ViTModel`` (or ``ViTForImageClassification`` / ``ViTForMaskedImageModeling``);
* ``build_hf_tp_t5``:   ``transformers.T5Model`` with the equivalent Megatron plan. It *loads*, but its forward
  fails (see "T5" below): transformers' TP cannot run T5 with its attention heads split. Kept so that the
  benchmark and the self-check can show the failure instead of asserting it.

How it works
------------
* None of these models ships a ``base_model_tp_plan``, so we pass hand-written Megatron-style plans (keys are
  module FQNs relative to the loaded class; EVERY numeric path component must be written ``*``, since
  transformers matches the keys against module names with all ``.<digits>.`` replaced by ``.*.``: T5's
  ``block.0.layer.1`` is ``block.*.layer.*``, and a key naming a concrete index matches nothing)::

      BERT (BERT_TP_PLAN)                              ViT (VIT_TP_PLAN, in-memory names of transformers 5)
      encoder.layer.*.attention.self.query   colwise   layers.*.attention.q_proj  colwise
      encoder.layer.*.attention.self.key     colwise   layers.*.attention.k_proj  colwise
      encoder.layer.*.attention.self.value   colwise   layers.*.attention.v_proj  colwise
      encoder.layer.*.attention.output.dense rowwise   layers.*.attention.o_proj  rowwise
      encoder.layer.*.intermediate.dense     colwise   layers.*.mlp.fc1           colwise
      encoder.layer.*.output.dense           rowwise   layers.*.mlp.fc2           rowwise

  Embeddings (ViT: patch-embedding convolution, CLS token, position embeddings), LayerNorms and the pooler are
  left replicated (plain tensors). For ViT the plan uses the in-memory module names (``layers.N.attention.q_proj``)
  although ``save_pretrained`` writes the Hub names (``encoder.layer.N.attention.attention.query``): the
  checkpoint conversion renames on load and the plan is applied to the in-memory model (verified: 12 of 16
  parameters per layer become DTensors and the outputs match the unsharded model).
* Rank 0 writes a random-weight checkpoint with ``save_pretrained`` (safetensors) into ``tmpdir``; all ranks
  then call the public API

      Model.from_pretrained(path, distributed_config=DistributedConfig(tp_plan=PLAN))

  ``from_pretrained`` builds a ``(pp, dp_replicate, fsdp, tp)`` = ``(1, 1, 1, 2)`` DeviceMesh itself
  (``initialize_distributed_mesh``; it reuses the already-initialized gloo process group, on CPU the mesh device
  type is "cpu"), replaces the planned ``nn.Linear`` weights by DTensors (colwise: weight/bias ``Shard(0)``;
  rowwise: weight ``Shard(1)``, bias ``Replicate()``), wraps those modules' ``forward`` with redistribution
  logic, and each rank then loads only its shard from the checkpoint. The model must therefore be loaded from
  disk: there is no public "shard this already-built in-memory model" entry point (``apply_tensor_parallelism``
  is internal and expects meta/placeholder params).
  The deprecated spelling ``from_pretrained(path, tp_plan=<dict>)`` is equivalent (it just wraps it in a
  DistributedConfig and emits a FutureWarning); ``tp_plan="auto"`` also works if ``config.base_model_tp_plan``
  is set on the config object passed to ``from_pretrained`` (it is a ClassVar and is not serialized).
* Attention heads: BERT's and ViT's attention reshape q/k/v with ``view(*shape, -1, head_dim)`` and the attention
  output with ``reshape(*shape, -1)``, so each rank just sees ``num_attention_heads / tp`` heads; the
  ``num_attention_heads`` attributes are not used in forward and need no patching. Heads must be divisible by
  the TP size.

T5 (why ``build_hf_tp_t5``'s model cannot run)
----------------------------------------------
T5's attention reshapes q/k/v by ``d_kv`` too, so q/k/v colwise + o rowwise split the heads like BERT's. But the
scores get a position bias of shape ``[1, n_heads, q, k]`` that is NOT produced by the planned Linears:

* the first block's ``relative_attention_bias`` (an ``nn.Embedding(buckets, n_heads)``) yields all ``n_heads``;
  the only embedding styles, ``embedding_rowwise`` / ``embedding_colwise``, always all-gather/all-reduce the
  lookup back to ``Replicate()`` (there is no style that keeps an Embedding's output sharded on its last dim),
  so even a head-sharded table gives every rank the full ``n_heads`` bias;
* attention modules without a table (cross-attention, and every layer when the bias is not passed along) build a
  zero bias ``torch.zeros(1, self.n_heads, q, k)`` from the module attribute ``n_heads``, which a plan cannot
  change (no plan style rescales module attributes).

So the local scores have ``n_heads / tp`` heads and the bias ``n_heads``; the first forward (grad or no-grad, SDPA
or eager attention) fails in the encoder's first attention with ``RuntimeError: The size of tensor a (6) must
match the size of tensor b (12) at non-singleton dimension 1`` (T5-base sizes; observed with transformers 5.23,
torch 2.13). A plan that leaves attention replicated and shards only the feed-forward (``DenseReluDense.wi``
colwise, ``wo`` rowwise) runs and matches, but it is not Megatron TP (every rank computes every head), so the
benchmark does not report it. shardlib handles T5 by sharding the bias table by head without a gather and
dividing ``n_heads`` / ``inner_dim`` per rank.

Caveats
-------
* torch.distributed must already be initialized (gloo) with WORLD_SIZE == 2 (torchrun); the TP degree is
  derived from WORLD_SIZE. transformers creates its own DeviceMesh; the model's ``_device_mesh`` /
  ``_mesh_manager`` attributes hold it.
* accelerate IS required, even on CPU: the mesh setup returns an implicit ``device_map=torch.device("cpu")`` and
  ``from_pretrained`` -> ``check_and_set_device_map`` raises "Using a `device_map`, `tp_plan`, ... requires
  `accelerate`" without it (verified). Do not pass your own ``device_map`` (TP and device_map are exclusive).
* Outputs are plain ``torch.Tensor``s, not DTensors: every planned layer uses ``use_local_output=True``, and the
  rowwise layers all-reduce to ``Replicate()``, so ``last_hidden_state`` is the full, identical tensor on every
  rank.
* With grad enabled the sharded Linears run through DTensor ops (from_local / redistribute, all-reduce in forward
  after each rowwise layer, all-reduce of input grads in backward after each colwise layer). Under
  ``torch.no_grad()`` a local fast path is used (plain matmuls + ``dist.all_reduce``). Both give the same numbers.
* Backward works: the sharded parameters' ``.grad`` are DTensors (Shard placements), the replicated parameters'
  grads are plain tensors identical on every rank. An optimizer must handle DTensor params (torch.optim does).
* ``from_pretrained`` returns the model in ``eval()`` mode (dropout off); call ``.train()`` if wanted.

Self-check (2 ranks; output and gradient equality with the unsharded model, and the T5 failure)::

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 benchmarks/_hf_dtensor_tp.py [bert|vit|t5|all]
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import transformers
from transformers import BertModel, T5Model, ViTModel
from transformers.distributed import DistributedConfig

BERT_TP_PLAN: dict[str, str] = {
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}

VIT_TP_PLAN: dict[str, str] = {
    "layers.*.attention.q_proj": "colwise",
    "layers.*.attention.k_proj": "colwise",
    "layers.*.attention.v_proj": "colwise",
    "layers.*.attention.o_proj": "rowwise",
    "layers.*.mlp.fc1": "colwise",
    "layers.*.mlp.fc2": "rowwise",
}

#: One line for tables: why the HF DTensor path has no T5 number.
T5_UNSUPPORTED = ("transformers' DTensor TP cannot split T5's heads: the relative position bias (and the zero bias "
                  "of layers without a table) keeps all n_heads on every rank, so the local scores (n_heads/2 heads) "
                  "and the bias do not broadcast")


def vit_tp_plan(model_cls: type = ViTModel) -> dict[str, str]:
    """The ViT plan for ``model_cls`` (the heads nest the encoder under ``vit.``)."""
    prefix = "" if model_cls is ViTModel else "vit."
    return {prefix + k: v for k, v in VIT_TP_PLAN.items()}


def t5_tp_plan(config: transformers.T5Config, *, attention: bool = True,
               bias_style: str | None = None) -> dict[str, str]:
    """Megatron plan for ``T5Model``: q/k/v colwise, o rowwise (self- and cross-attention), wi (or wi_0 and wi_1 of
    the gated FFN) colwise, wo rowwise. ``attention=False``: feed-forward only (attention replicated).
    ``bias_style``: a style for the first block's ``relative_attention_bias`` (e.g. ``"embedding_colwise"``,
    which shards the table by head but gathers the lookup); None leaves it replicated."""
    plan: dict[str, str] = {}
    for stack in ("encoder", "decoder"):
        block = f"{stack}.block.*.layer.*"  # every numeric component is a wildcard (see the module docstring)
        if attention:
            for att in ("SelfAttention", "EncDecAttention") if stack == "decoder" else ("SelfAttention",):
                plan |= {f"{block}.{att}.{p}": "colwise" for p in ("q", "k", "v")}
                plan[f"{block}.{att}.o"] = "rowwise"
            if bias_style:
                plan[f"{block}.SelfAttention.relative_attention_bias"] = bias_style
        for wi in ("wi_0", "wi_1") if config.is_gated_act else ("wi",):
            plan[f"{block}.DenseReluDense.{wi}"] = "colwise"
        plan[f"{block}.DenseReluDense.wo"] = "rowwise"
    return plan


def _save_reference_checkpoint(model_cls: type, config, path: str, seed: int) -> None:
    """Rank 0 writes a random-init ``model_cls(config)`` checkpoint to ``path``; everybody waits for it.

    ``torch.manual_seed(seed); model_cls(config)`` is exactly how the benchmark builds the unsharded model, so the
    sharded model loads the same weights."""
    if dist.get_rank() == 0:
        torch.manual_seed(seed)
        ref = model_cls(config)
        ref.save_pretrained(path)
        del ref
    dist.barrier()


def build_hf_tp_model(model_cls: type, config, tmpdir: str, seed: int, tp_plan: dict[str, str],
                      divisible: dict[str, int] | None = None) -> torch.nn.Module:
    """Return ``model_cls`` tensor-parallelized by transformers' own DTensor TP with ``tp_plan``.

    Must be called on every rank after ``torch.distributed.init_process_group("gloo")``. Weights are random
    (seeded by ``seed``), written once by rank 0 to ``tmpdir/hf_<class>_ckpt`` and loaded sharded on every rank.
    ``divisible``: sizes that must divide by the world size (name -> value, for the error message).
    The returned model is in eval mode.
    """
    if not dist.is_initialized():
        raise RuntimeError(f"torch.distributed must be initialized before building a TP {model_cls.__name__}")
    world = dist.get_world_size()
    bad = {k: v for k, v in (divisible or {}).items() if v % world}
    if bad:
        raise ValueError(f"{', '.join(bad)} ({bad}) must be divisible by the world size {world}")

    path = os.path.join(tmpdir, f"hf_{model_cls.__name__.lower()}_ckpt")
    _save_reference_checkpoint(model_cls, config, path, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = model_cls.from_pretrained(
            path,
            distributed_config=DistributedConfig(tp_plan=dict(tp_plan)),
            dtype=torch.float32,
        )
    return model


def build_hf_tp_bert(config: transformers.BertConfig, tmpdir: str, seed: int) -> torch.nn.Module:
    """A ``BertModel`` tensor-parallelized by transformers' own DTensor TP (see ``build_hf_tp_model``)."""
    return build_hf_tp_model(
        BertModel, config, tmpdir, seed, BERT_TP_PLAN,
        divisible=dict(num_attention_heads=config.num_attention_heads, intermediate_size=config.intermediate_size),
    )


def build_hf_tp_vit(config: transformers.ViTConfig, tmpdir: str, seed: int,
                    model_cls: type = ViTModel) -> torch.nn.Module:
    """A ``ViTModel`` (or another ViT class) tensor-parallelized by transformers' own DTensor TP."""
    return build_hf_tp_model(
        model_cls, config, tmpdir, seed, vit_tp_plan(model_cls),
        divisible=dict(num_attention_heads=config.num_attention_heads, intermediate_size=config.intermediate_size),
    )


def build_hf_tp_t5(config: transformers.T5Config, tmpdir: str, seed: int, **plan_kwargs) -> torch.nn.Module:
    """A ``T5Model`` with the Megatron plan ``t5_tp_plan(config, **plan_kwargs)`` applied by transformers' DTensor
    TP. It builds and loads, but with the (default) attention plan its forward raises a RuntimeError (shape
    mismatch between the per-rank scores and the full-head position bias): see the module docstring."""
    return build_hf_tp_model(
        T5Model, config, tmpdir, seed, t5_tp_plan(config, **plan_kwargs),
        divisible=dict(num_heads=config.num_heads, d_ff=config.d_ff),
    )


def is_t5_head_mismatch(exc: BaseException) -> bool:
    """Is ``exc`` the T5 failure described in the module docstring (scores vs position bias, heads dim)?"""
    return isinstance(exc, RuntimeError) and "at non-singleton dimension 1" in str(exc) and "must match" in str(exc)


# --------------------------------------------------------------------------------------
# Self-check:  python -m torch.distributed.run --nproc-per-node 2 benchmarks/_hf_dtensor_tp.py [bert|vit|t5|all]
# --------------------------------------------------------------------------------------
def _self_check(which: str) -> None:
    import shutil
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

    # A shared temp dir: rank 0 creates it and broadcasts the name.
    holder = [tempfile.mkdtemp(prefix="hf_tp_check_") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    tmpdir = holder[0]
    g = torch.Generator().manual_seed(0)

    def compare(name, tp_model, ref_model, inputs, outputs, loss_fn):
        """Forward (no-grad and grad) and backward equality of ``tp_model`` and the unsharded ``ref_model``."""
        n_dt = sum(isinstance(p, DTensor) for p in tp_model.parameters())
        log(f"[{name}] DTensor params: {n_dt}/{len(list(tp_model.parameters()))}")
        with torch.no_grad():
            ref_outs = outputs(ref_model(**inputs))
            tp_outs_ng = outputs(tp_model(**inputs))
        out = tp_model(**inputs)
        tp_outs = outputs(out)
        d_ng = max((full(a) - b).abs().max().item() for a, b in zip(tp_outs_ng, ref_outs))
        d_g = max((full(a).detach() - b).abs().max().item() for a, b in zip(tp_outs, ref_outs))
        log(f"[{name}] output types {[type(t).__name__ for t in tp_outs]}; "
            f"max |TP - ref| outputs: no_grad={d_ng:.3e} grad={d_g:.3e}")
        assert d_ng < 1e-5 and d_g < 1e-5, (d_ng, d_g)

        loss = loss_fn(out, full)
        loss.backward()
        ref_loss = loss_fn(ref_model(**inputs), full)
        ref_loss.backward()
        ref_params = dict(ref_model.named_parameters())
        max_gd, max_g, n_grads = 0.0, 0.0, 0
        for pname, p in tp_model.named_parameters():
            r = ref_params[pname]
            assert (p.grad is None) == (r.grad is None), pname
            if p.grad is not None:
                n_grads += 1
                max_gd = max(max_gd, (full(p.grad) - r.grad).abs().max().item())
                max_g = max(max_g, r.grad.abs().max().item())
        log(f"[{name}] loss TP={loss.item():.6f} ref={ref_loss.item():.6f}; over the {n_grads} params with a grad: "
            f"max |grad diff| = {max_gd:.3e} (max |grad| {max_g:.3e})")
        assert abs(loss.item() - ref_loss.item()) < 1e-5 * max(1.0, abs(ref_loss.item()))
        assert max_g > 1e-3 and max_gd < 1e-4 * max_g, (max_gd, max_g)

    def load_ref(model_cls, subdir):
        return model_cls.from_pretrained(os.path.join(tmpdir, subdir), dtype=torch.float32)

    if which in ("bert", "all"):
        config = transformers.BertConfig(
            vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
            max_position_embeddings=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        tp_model = build_hf_tp_bert(config, tmpdir, seed=1234)
        ref_model = load_ref(BertModel, "hf_bertmodel_ckpt")
        q = tp_model.encoder.layer[0].attention.self.query.weight
        o = tp_model.encoder.layer[0].attention.output.dense
        log(f"[bert] query.weight {type(q).__name__} {tuple(q.shape)} local {tuple(q.to_local().shape)} "
            f"{q.placements}; attn.output.dense.weight {o.weight.placements} bias {o.bias.placements}")
        B, S = 8, 128
        attention_mask = torch.ones(B, S, dtype=torch.long)
        attention_mask[1, 100:] = 0
        attention_mask[5, 64:] = 0
        inputs = dict(input_ids=torch.randint(0, config.vocab_size, (B, S), generator=g),
                      attention_mask=attention_mask)
        compare("bert", tp_model, ref_model, inputs, lambda o: [o.last_hidden_state, o.pooler_output],
                lambda o, f: f(o.last_hidden_state).float().pow(2).mean() + f(o.pooler_output).sum())

        # Timing: fwd+bwd per step.
        def step(m):
            m.zero_grad(set_to_none=True)
            full(m(**inputs).last_hidden_state).float().pow(2).mean().backward()

        for name, m in (("hf-dtensor-tp", tp_model), ("unsharded (per rank)", ref_model)):
            for _ in range(2):
                step(m)
            dist.barrier()
            n = 5
            t0 = time.perf_counter()
            for _ in range(n):
                step(m)
            dist.barrier()
            log(f"[bert] {name}: {(time.perf_counter() - t0) / n * 1e3:.1f} ms / fwd+bwd step "
                f"(B={B}, S={S}, hidden 256, 4 layers, 1 thread/rank)")

    if which in ("vit", "all"):
        config = transformers.ViTConfig(
            image_size=64, patch_size=16, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
            intermediate_size=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        for cls in (ViTModel, transformers.ViTForImageClassification):
            tp_model = build_hf_tp_vit(config, tmpdir, seed=1234, model_cls=cls)
            ref_model = load_ref(cls, f"hf_{cls.__name__.lower()}_ckpt")
            q = tp_model.get_submodule(("" if cls is ViTModel else "vit.") + "layers.0.attention.q_proj").weight
            log(f"[{cls.__name__}] q_proj.weight {type(q).__name__} {tuple(q.shape)} local "
                f"{tuple(q.to_local().shape)} {q.placements}")
            inputs = dict(pixel_values=torch.randn(4, 3, 64, 64, generator=g))
            if cls is ViTModel:
                compare(cls.__name__, tp_model, ref_model, inputs,
                        lambda o: [o.last_hidden_state, o.pooler_output],
                        lambda o, f: f(o.last_hidden_state).pow(2).mean() + f(o.pooler_output).sum())
            else:
                compare(cls.__name__, tp_model, ref_model, inputs, lambda o: [o.logits],
                        lambda o, f: f(o.logits).pow(2).mean())

    if which in ("t5", "all"):
        config = transformers.T5Config(
            vocab_size=1000, d_model=128, d_kv=32, d_ff=512, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )
        inputs = dict(input_ids=torch.randint(0, config.vocab_size, (4, 24), generator=g),
                      decoder_input_ids=torch.randint(0, config.vocab_size, (4, 16), generator=g), use_cache=False)
        for label, kwargs in (("t5 megatron plan", {}),
                              ("t5 + embedding_colwise bias", dict(bias_style="embedding_colwise"))):
            tp_model = build_hf_tp_t5(config, tmpdir, seed=1234, **kwargs)
            for grad in (False, True):
                try:
                    with torch.set_grad_enabled(grad):
                        tp_model(**inputs)
                except RuntimeError as e:
                    assert is_t5_head_mismatch(e), e
                    log(f"[{label}] forward ({'grad' if grad else 'no_grad'}) fails as expected: "
                        f"RuntimeError: {e}")
                else:
                    raise AssertionError(f"[{label}] the forward ran: T5_UNSUPPORTED is out of date")
        # Feed-forward only (attention replicated): runs and matches, but is not Megatron TP.
        probe = torch.randn(config.d_model, generator=g)
        tp_model = build_hf_tp_t5(config, tmpdir, seed=1234, attention=False)
        ref_model = load_ref(T5Model, "hf_t5model_ckpt")
        compare("t5 FFN-only plan", tp_model, ref_model, inputs,
                lambda o: [o.last_hidden_state, o.encoder_last_hidden_state],
                # not mean(h^2): that is ~1 after T5's final RMSNorm whatever the weights, with ~0 gradients
                lambda o, f: (f(o.last_hidden_state) @ probe).sum() + (f(o.encoder_last_hidden_state) @ probe).sum())

    log("SELF-CHECK OK")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(tmpdir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    _self_check(sys.argv[1] if len(sys.argv) > 1 else "all")
