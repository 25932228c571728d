"""The dry run's autocast (shardlib.analysis.meta_autocast): on meta tensors, a bf16 / fp16 forward saves for
backward exactly the bytes a real CPU autocast forward saves, model by model; and it changes nothing in float32."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardlib.analysis.counting import AttentionAsOn, SavedCounter
from shardlib.analysis.meta_autocast import AutocastOnMeta, autocast_on_meta
from shardlib.analysis.metarun import meta_model
from shardlib.sharding.examples import example_batch

CONFIGS = {
    "BertForMaskedLM": transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=32,
                                               max_position_embeddings=32),
    "T5ForConditionalGeneration": transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                                        num_heads=2, decoder_start_token_id=0),
    "ViTForImageClassification": transformers.ViTConfig(image_size=8, patch_size=4, hidden_size=16,
                                                        num_hidden_layers=2, num_attention_heads=2,
                                                        intermediate_size=32, num_labels=3),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _loss(out) -> torch.Tensor:
    return out["loss"]


def _saved_real(cls: str, precision: str) -> int:
    torch.manual_seed(0)
    model = getattr(transformers, cls)(CONFIGS[cls]).train()
    batch = example_batch(model, 2, 8, device="cpu", generator=torch.Generator().manual_seed(0))
    with SavedCounter(model) as counter:
        with torch.autocast("cpu", dtype=DTYPES[precision]) if precision != "fp32" else torch.enable_grad():
            loss = _loss(model(**batch))
    assert loss.dtype == torch.float32  # the loss: autocast's float32 list, or the model's own cast
    return counter.total


def _saved_meta(cls: str, precision: str) -> int:
    model = meta_model(CONFIGS[cls], cls)
    batch = example_batch(model, 2, 8)
    with SavedCounter(model) as counter, AttentionAsOn("cpu"), autocast_on_meta(precision, "cpu"):
        _loss(model(**batch))
    return counter.total


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("cls", sorted(CONFIGS))
def test_a_meta_forward_saves_what_cpu_autocast_saves(cls, precision):
    real = _saved_real(cls, precision)
    assert _saved_meta(cls, precision) == real
    if precision != "fp32":
        # the precision changes what is saved (tiny models: more, the weights' low-precision copies; real ones: less)
        assert real != _saved_real(cls, "fp32")


def test_weights_are_cast_once_per_region_and_real_tensors_left_alone():
    layer = torch.nn.Linear(4, 4, device="meta")
    x = torch.empty(2, 4, device="meta")
    with AutocastOnMeta(torch.bfloat16, "cuda") as mode:
        a, b = layer(x), layer(x)
        assert a.dtype == b.dtype == torch.bfloat16 and len(mode.cache) == 2  # weight and bias, once each
        assert torch.softmax(a, -1).dtype == torch.float32  # CUDA's float32 list
        assert torch.nn.functional.linear(torch.ones(2, 4), torch.ones(4, 4)).dtype == torch.float32  # real: untouched
    with AutocastOnMeta(torch.bfloat16, "cpu"):
        assert torch.softmax(layer(x), -1).dtype == torch.bfloat16  # not on the CPU's list
    with pytest.raises(ValueError, match="device types"):
        AutocastOnMeta(torch.bfloat16, "tpu")
