"""The models, generated batches and layouts ``benchmarks/plan_accuracy.py`` measures."""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardlib.analysis.layout import Layout  # noqa: E402  (no torch import)

GLOBAL_BATCH = 16  # sequences per optimizer step, every layout alike
SEQ = 128  # encoder tokens per sequence
MLM_PROB = 0.15  # share of the MLM positions that carry a label (the rest are -100)


@dataclass(frozen=True)
class ModelSpec:
    """A transformers class and config, its task, the heads tp x sp must divide, whether all-to-all SP applies."""

    cls: str
    config_cls: str
    config_kwargs: dict
    task: str
    heads: int
    layers: int
    layers_keys: tuple[str, ...] = ("num_hidden_layers",)
    dec_seq: int = 0
    all_to_all: bool = True
    experts: int = 0  # experts per mixture-of-experts layer (0: a dense model)

    def config(self, layers: int | None = None):
        import transformers

        n = self.layers if layers is None else layers
        return getattr(transformers, self.config_cls)(**dict(self.config_kwargs, **{k: n for k in self.layers_keys}))


_BERT = dict(max_position_embeddings=512, type_vocab_size=2)
_T5 = dict(d_kv=64, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
MODELS: dict[str, ModelSpec] = {
    # BERT at hidden 256 (the "small" BERT of tp_throughput.py) and at BERT-base widths, 4 layers each, MLM heads
    "bert-256": ModelSpec("BertForMaskedLM", "BertConfig", dict(_BERT, hidden_size=256, num_attention_heads=4,
                          intermediate_size=1024, vocab_size=8192), "mlm", heads=4, layers=4),
    "bert-768": ModelSpec("BertForMaskedLM", "BertConfig", dict(_BERT, hidden_size=768, num_attention_heads=12,
                          intermediate_size=3072, vocab_size=30522), "mlm", heads=12, layers=4),
    # T5-small widths, 2 + 2 layers (4 + 4 takes too long on 2 cores), the decoder as long as the encoder
    "t5-small": ModelSpec("T5ForConditionalGeneration", "T5Config", dict(_T5, d_model=512, d_ff=2048, num_heads=8,
                          vocab_size=8192), "seq2seq", heads=8, layers=2,
                          layers_keys=("num_layers", "num_decoder_layers"), dec_seq=SEQ),
    # a small Llama sharded by its inferred plan: 4 query heads over 2 key/value heads (tp x sp must divide 2)
    "llama-256": ModelSpec("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2, vocab_size=8192,
        max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0), "causal", heads=2, layers=4,
        all_to_all=False),
    # a small Mixtral (inferred plan): 8 experts of intermediate 512, top-2, in each of its 4 layers (its experts
    # are 12.6 M of its 17.6 M parameters); what --ep measures at dp=4 with the experts split over 1, 2 and 4 ranks
    "mixtral-256": ModelSpec("MixtralForCausalLM", "MixtralConfig", dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, vocab_size=8192, max_position_embeddings=512, pad_token_id=0), "causal", heads=2,
        layers=4, all_to_all=False, experts=8),
    # the one-GPU models (--world 1): ViT-base (224 px, 1000 classes), BERT-large widths, T5-base (12 + 12)
    "vit-base": ModelSpec("ViTForImageClassification", "ViTConfig", dict(num_labels=1000), "image", heads=12,
                          layers=12),
    "bert-large": ModelSpec("BertForMaskedLM", "BertConfig", dict(_BERT, hidden_size=1024, num_attention_heads=16,
                            intermediate_size=4096, vocab_size=30522), "mlm", heads=16, layers=24),
    "t5-base": ModelSpec("T5ForConditionalGeneration", "T5Config", dict(_T5, d_model=768, d_ff=3072, num_heads=12,
                         vocab_size=32128), "seq2seq", heads=12, layers=12,
                         layers_keys=("num_layers", "num_decoder_layers")),
}


def make_batch(spec: ModelSpec, n: int, seq: int = SEQ, seed: int = 0) -> dict:
    """A global batch of ``n`` examples, the same on every rank for one ``seed``, labelled for the model's task."""
    import torch

    g = torch.Generator().manual_seed(1000 + seed)
    if spec.task == "image":
        size = spec.config(1).image_size
        return {"pixel_values": torch.randn(n, 3, size, size, generator=g),
                "labels": torch.randint(0, spec.config_kwargs["num_labels"], (n,), generator=g)}
    ids = torch.randint(2, vocab := spec.config_kwargs["vocab_size"], (n, seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones(n, seq, dtype=torch.long)}
    if spec.task == "mlm":
        labelled = torch.rand(n, seq, generator=g) < MLM_PROB
        labelled[:, 0] = True
        batch["labels"] = torch.where(labelled, ids, torch.full_like(ids, -100))
    elif spec.task == "causal":
        batch["labels"] = ids.clone()
    else:
        batch["labels"] = torch.randint(2, vocab, (n, spec.dec_seq or seq), generator=g)
    return batch


def _layout(dp=1, pp=1, tp=1, sp=1, mode="off", zero=0, mb=1, schedule="1f1b", ckpt=False, ep=1,
            cap=None) -> Layout:
    return Layout(dp=dp, pp=pp, tp=tp, sp=sp, sequence_parallel=mode, zero=zero, microbatches=mb,
                  schedule=schedule, activation_checkpointing=ckpt, batch=GLOBAL_BATCH // (dp * mb), seq=SEQ, ep=ep,
                  expert_capacity=cap)


# Every mesh of 4 ranks, each dimension alone and in pairs; ZeRO 0-3 where dp > 1, microbatches 4 under pp (both
# schedules; 1 under GPipe: 1F1B needs at least one microbatch per stage), activation checkpointing on a few.
_CANDIDATES = [
    _layout(dp=4), _layout(dp=4, zero=1), _layout(dp=4, zero=2), _layout(dp=4, zero=3), _layout(dp=4, ckpt=True),
    _layout(tp=4), _layout(tp=4, mode="megatron"),
    _layout(dp=2, tp=2), _layout(dp=2, tp=2, mode="megatron", zero=1), _layout(dp=2, tp=2, zero=3),
    _layout(pp=4, mb=4), _layout(pp=4, mb=4, schedule="gpipe"),
    _layout(dp=2, pp=2, schedule="gpipe"), _layout(dp=2, pp=2, mb=4, zero=1),
    _layout(dp=2, pp=2, mb=4, schedule="gpipe", zero=2, ckpt=True), _layout(dp=2, pp=2, mb=4, zero=3),
    _layout(pp=2, tp=2, mb=4, mode="megatron"),
    _layout(sp=4, mode="all_to_all"), _layout(dp=2, sp=2, mode="all_to_all", zero=1),
    _layout(tp=2, sp=2, mode="all_to_all"), _layout(pp=2, sp=2, mode="all_to_all", mb=4, ckpt=True),
]
#: expert parallelism (models with experts only): the experts of dp=4 split over 2 and 4 ranks (dp4 above is ep=1),
#: dropless, with a static capacity of twice the even load, and under ZeRO-1 and ZeRO-3
EP_LAYOUTS = [_layout(dp=4), _layout(dp=4, ep=2), _layout(dp=4, ep=4), _layout(dp=4, ep=4, cap=2.0),
              _layout(dp=4, ep=2, zero=1), _layout(dp=4, ep=2, zero=3)]
_CANDIDATES += EP_LAYOUTS[1:]


def refusal(layout: Layout, spec: ModelSpec, layers: int, world: int = 4) -> str | None:
    """Why ``layout`` cannot run ``spec`` at ``layers`` layers per stack on ``world`` ranks, else None."""
    checks = [
        (layout.world != world, f"{layout.world} ranks, not {world}"),
        (spec.heads % (layout.tp * layout.sp), f"{spec.heads} heads % (tp {layout.tp} x sp {layout.sp})"),
        (layout.sequence_parallel == "all_to_all" and not spec.all_to_all,
         "all-to-all SP wraps the attention modules a hand policy lists (an inferred plan lists none)"),
        ((layout.sp > 1) != (layout.sequence_parallel == "all_to_all"),
         "sp > 1 is all_to_all sequence parallelism, and all_to_all needs sp > 1"),
        (layout.sequence_parallel == "megatron" and layout.tp == 1,
         "megatron sequence parallelism runs on the tp group"),
        (layout.zero and layout.dp == 1, "zero needs dp > 1"),
        (layout.pp > 1 and layout.pp > layers * (2 if spec.task == "seq2seq" else 1),
         f"{layout.pp} stages from {layers} layers"),
        (layout.pp > 1 and layout.schedule != "gpipe" and layout.microbatches < layout.pp,
         f"{layout.schedule} needs microbatches >= stages (torch's schedule, at the first step)"),
        (GLOBAL_BATCH % (layout.dp * layout.microbatches), f"global batch {GLOBAL_BATCH} % (dp x microbatches)"),
        (layout.ep > 1 and not spec.experts, "expert parallelism needs mixture-of-experts layers"),
        (layout.ep > 1 and (layout.dp % layout.ep or spec.experts % layout.ep),
         f"ep {layout.ep} must divide dp {layout.dp} and {spec.experts} experts")]
    return next((why for failed, why in checks if failed), None)


def layouts(model_name: str, world: int = 4, layers: int | None = None) -> list[Layout]:
    """The candidates above that shardlib accepts for ``model_name`` on ``world`` ranks (21 for BERT and T5, 15 for
    llama-256, 20 for mixtral-256)."""
    spec = MODELS[model_name]
    return [lay for lay in _CANDIDATES if refusal(lay, spec, spec.layers if layers is None else layers, world) is None]


def one_device_layouts(batches=(8, 32), seq=SEQ, precisions=("fp32", "bf16", "fp16"), checkpointing=(False, True)):
    """The layouts of one device: microbatch size x precision x activation checkpointing."""
    return [Layout(batch=b, seq=seq, precision=p, activation_checkpointing=c)
            for b, p, c in itertools.product(batches, precisions, checkpointing)]
