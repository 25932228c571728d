"""ViT model cases (same interface as bert_cases): every class, pixel batches, other resolutions."""

from __future__ import annotations

import torch
import transformers
from transformers import ViTConfig

CLASSES = ("ViTModel", "ViTForImageClassification", "ViTForMaskedImageModeling")


def make_config(spec: dict) -> ViTConfig:
    c = spec["config"]
    return ViTConfig(
        image_size=c["image"], patch_size=c["patch"], encoder_stride=c["patch"], num_channels=3,
        hidden_size=c["heads"] * c["head_dim"], num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        intermediate_size=c["intermediate"], hidden_act=c.get("act", "gelu"), num_labels=c.get("num_labels", 3),
        hidden_dropout_prob=c.get("dropout", 0.0), attention_probs_dropout_prob=c.get("dropout", 0.0),
        qkv_bias=c.get("qkv_bias", True),
    )


def make_model(spec: dict) -> torch.nn.Module:
    torch.manual_seed(spec["seed"])
    return getattr(transformers, spec["cls"])(make_config(spec)).to(getattr(torch, spec.get("dtype", "float32")))


def make_batch(spec: dict, config: ViTConfig) -> dict:
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    b = spec["batch"]
    # another resolution (one more patch per side) through interpolate_pos_encoding, except for MIM whose
    # reconstruction target is tied to the configured size
    interpolate = spec.get("interpolate", False) and spec["cls"] != "ViTForMaskedImageModeling"
    side = config.image_size + (config.patch_size if interpolate else 0)
    batch = {"pixel_values": torch.randn(b, 3, side, side, generator=g)}
    if interpolate:
        batch["interpolate_pos_encoding"] = True
    if spec["cls"] == "ViTForImageClassification" and spec.get("labels", True):
        batch["labels"] = torch.randint(0, config.num_labels, (b,), generator=g)
    if spec["cls"] == "ViTForMaskedImageModeling":
        patches = (config.image_size // config.patch_size) ** 2
        batch["bool_masked_pos"] = torch.rand(b, patches, generator=g) < 0.5
    return batch
