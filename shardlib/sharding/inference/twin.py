"""Shrunk twins: the same model class (so the same code) with 2 layers and small widths, built from a copy of the
model's config. A plan depends on the architecture, not the size, so the graph is read, and the plan proven, on a
twin: a BERT-large-sized model is analysed and verified in the time of a tiny one.

Two kinds. The **analysis twin** gets sizes that tell roles apart by value alone (12 query heads, 4 key/value heads,
head dim 8 (partial rotary takes a half or a quarter), hidden 70 where the config lets it differ from heads x head dim, 101 tokens,
FFN 74): a reshape to 12, an attribute holding 96, an embedding of 101 rows each say what they are. The **verification twin** gets sizes that
the tensor-parallel degree divides (2 tp query heads, tp key/value heads, FFN 16 tp) and a vocabulary it does not
(padding exercised), dropout off.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

#: config attributes by role, as transformers' families spell them (``attribute_map`` aliases resolve through
#: setattr, so the canonical name comes first)
ROLES: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers",
               "n_layer", "n_layers"),
    "heads": ("num_attention_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads", "n_head",
              "n_heads"),
    "kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim", "d_kv", "attention_head_size"),
    "hidden": ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "pooler_hidden_size"),
    "ffn": ("intermediate_size", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_dim", "n_inner", "hidden_dim",
            "moe_intermediate_size", "shared_expert_intermediate_size"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "vocab": ("vocab_size", "decoder_vocab_size"),
    "embedding": ("embedding_size",),
}


#: a twin's experts per mixture-of-experts layer (where the model has them)
TWIN_EXPERTS = 8


@dataclass(frozen=True)
class Sizes:
    """The twin's sizes by role (``head_dim`` None where the config derives it from hidden / heads)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int

    @property
    def widths(self) -> set[int]:
        """Values of attributes that are head counts or head widths (divided by tp where an attention module holds
        them), except the hidden size itself, which a module may hold for other uses."""
        return {self.heads, self.kv_heads, self.heads * self.head_dim, self.kv_heads * self.head_dim} - {self.hidden}


def _has(config, name: str) -> bool:
    return name in config.to_dict() or name in getattr(config, "attribute_map", {})


def _set_role(config, role: str, value: int) -> None:
    for name in ROLES[role]:
        if _has(config, name) and getattr(config, name, None) is not None:
            setattr(config, name, value)


def _free_head_dim(config) -> bool:
    """Whether the config sets the head dim itself (Llama's ``head_dim``, T5's ``d_kv``) rather than deriving it."""
    return any(_has(config, name) and getattr(config, name, None) is not None for name in ROLES["head_dim"])


def twin_config(config, *, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int, distinct_hidden: int | None,
                dropout_off: bool) -> tuple[object, Sizes]:
    """A copy of ``config`` with 2 layers and these sizes; ``distinct_hidden``: the hidden size where the config
    lets it differ from heads x head_dim."""
    config = copy.deepcopy(config)
    free = _free_head_dim(config)
    hidden = distinct_hidden if (free and distinct_hidden) else heads * head_dim
    grouped = any(_has(config, n) and getattr(config, n, None) not in (None, getattr(config, "num_attention_heads", 0))
                  for n in ROLES["kv_heads"])
    kv = kv_heads if grouped else heads
    for role, value in (("layers", 2), ("heads", heads), ("kv_heads", kv), ("hidden", hidden), ("ffn", ffn),
                        ("vocab", vocab), ("embedding", hidden), ("experts", TWIN_EXPERTS)):
        _set_role(config, role, value)
    if isinstance(getattr(config, "num_experts_per_tok", None), int):  # top-k within the twin's experts
        config.num_experts_per_tok = min(config.num_experts_per_tok, TWIN_EXPERTS)
    if free:
        _set_role(config, "head_dim", head_dim)
    if dropout_off:  # dropout, and the other random drops: stochastic depth (BEiT's drop_path_rate), layerdrop
        for name, value in config.to_dict().items():
            if "drop" in name and isinstance(value, float):
                setattr(config, name, 0.0)
    for name in ("max_position_embeddings", "n_positions"):
        if _has(config, name) and isinstance(getattr(config, name, None), int):
            setattr(config, name, min(getattr(config, name), 64))
    if hasattr(config, "use_cache"):
        config.use_cache = False
    for name, value in config.to_dict().items():  # special tokens past the small vocabulary (GPT-2's 50256)
        if name.endswith("_token_id") and isinstance(value, int) and value >= vocab:
            setattr(config, name, vocab - 1)
    if _has(config, "pad_token_id") and config.pad_token_id is None:  # sequence classifiers need one past batch 1
        config.pad_token_id = vocab - 1
    return config, Sizes(layers=2, heads=heads, kv_heads=kv, head_dim=head_dim, hidden=hidden, ffn=ffn, vocab=vocab)


def analysis_twin(model: nn.Module) -> tuple[nn.Module, Sizes]:
    """The twin the graph is read on (module docstring), float32, in eval mode."""
    config, sizes = twin_config(model.config, heads=12, kv_heads=4, head_dim=8, ffn=74, vocab=101,
                                distinct_hidden=70, dropout_off=False)
    return experts_running(build(type(model), config), "batched_mm").eval(), sizes


def verification_twin(model: nn.Module, tp: int) -> tuple[nn.Module, Sizes]:
    """The twin a plan is proven on at tensor-parallel degree ``tp`` (module docstring), float64, dropout off."""
    config, sizes = twin_config(model.config, heads=2 * tp, kv_heads=tp, head_dim=4, ffn=16 * tp, vocab=13 * tp + 3,
                                distinct_hidden=None, dropout_off=True)
    return experts_running(build(type(model), config), "eager").double(), sizes


def experts_running(model: nn.Module, implementation: str) -> nn.Module:
    """``model`` with its fused experts (transformers' ``@use_experts_implementation`` modules) run by
    ``implementation``: the analysis twin exports ``batched_mm`` (no data-dependent loop over experts, which
    torch.export cannot trace), the verification twin runs ``eager`` (``grouped_mm`` has no float64 and needs
    16-byte strides). Every implementation computes the same function of the same weights."""
    if getattr(model.config, "_experts_implementation", None) not in (None, implementation):
        model.set_experts_implementation(implementation)
    return model


def build(cls: type, config) -> nn.Module:
    """``cls`` from ``config`` with transformers' initializer, on the CPU."""
    import torch

    with torch.device("cpu"):
        return cls(config)


__all__ = ["Sizes", "ROLES", "twin_config", "analysis_twin", "verification_twin", "build"]
