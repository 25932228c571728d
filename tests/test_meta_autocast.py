"""The dry run's autocast (shardlib.analysis.meta_autocast): on meta tensors, a bf16 / fp16 forward saves for
backward exactly the bytes a real CPU autocast forward saves, model by model; and it changes nothing in float32."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardlib.analysis.counting import KernelsAsOn, SavedCounter
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
    with SavedCounter(model) as counter, KernelsAsOn("cpu"), autocast_on_meta(precision, "cpu"):
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


# ---------------------------------------------------------------------- as on a GPU (the rules measured on an H200)
def _saved(fn, *modes) -> int:
    holder = torch.nn.Linear(1, 1, device="meta")  # SavedCounter leaves a model's parameters out: none used here
    with SavedCounter(holder) as counter:
        for mode in modes:
            mode.__enter__()
        try:
            fn()
        finally:
            for mode in reversed(modes):
                mode.__exit__(None, None, None)
    return counter.total


def test_on_a_gpu_dropout_keeps_a_bool_mask_and_attention_its_fused_kernel():
    x = torch.empty(4, 8, 64, 32, device="meta", requires_grad=True)
    n = x.numel()
    assert _saved(lambda: torch.nn.functional.dropout(x, 0.1), KernelsAsOn("cuda")) == n  # bool: 1 byte each
    assert _saved(lambda: torch.nn.functional.dropout(x, 0.1), KernelsAsOn("cpu")) == 4 * n  # the float mask
    q = torch.empty(4, 8, 64, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    fused = _saved(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1),
                   KernelsAsOn("cuda"))
    assert 2 * q.numel() * 2 <= fused < 2 * q.numel() * 2 + 4 * 8 * 64 * 4 + 64  # q (= k = v), output, log-sum-exp
    bias = torch.empty(1, 8, 64, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)  # T5's learned bias
    math = _saved(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias),
                  KernelsAsOn("cuda"))
    assert math >= 4 * 8 * 64 * 64 * 2  # the math path: the attention probabilities (S x S per head) are kept


def test_on_a_gpu_cross_entropy_keeps_low_precision_log_probabilities_and_a_float32_copy():
    logits = torch.empty(16, 100, device="meta", requires_grad=True)
    target = torch.zeros(16, dtype=torch.long, device="meta")
    layer = torch.nn.Linear(100, 100, device="meta")

    def loss():
        torch.nn.functional.cross_entropy(layer(logits), target)

    n = 16 * 100
    on_gpu = _saved(loss, KernelsAsOn("cuda"), AutocastOnMeta(torch.bfloat16, "cuda"))
    on_cpu = _saved(loss, KernelsAsOn("cpu"), AutocastOnMeta(torch.bfloat16, "cpu"))
    # either way: the linear's bf16 input and weight copies; nll_loss's target (int64) and total weight (a scalar)
    common = 2 * n + 2 * 100 * 100 + 16 * 8 + 4
    assert on_gpu - common == 2 * n + 4 * n  # bf16 log-probabilities, and nll_loss's float32 copy of them
    assert on_cpu - common == 4 * n  # the CPU's float32 log-probabilities (which nll_loss reads)
