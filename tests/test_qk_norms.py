"""Norms on the query and key heads under tensor parallelism (shardlib/parallel/norms.py), found by inference
(shardlib/sharding/inference/norms.py): Qwen3's per-head q/k norms (replicated, gradient summed over tp) and OLMo-2's
over the whole projected width (split with the heads, statistic all-reduced over tp) equal the unsharded model in
float64 (outputs, every gradient, weights after AdamW) with Megatron sequence parallelism at tp=2, and with ring and
all-to-all sequence parallelism at tp=2 x sp=2 (where a per-head norm's gradient needs both sums); OLMo-2's split
norm weights survive a checkpoint resharded from tp=2 to tp=4. Both families at tp=2, and their pipeline cuts, are
tested with the other inferred families (test_inference.py, inference_cases.FAMILIES)."""

import json

import pytest
import torch
from torch import nn

import inference_cases
import inference_tasks
import ring_inferred_tasks
from shardlib.parallel.norms import ColwiseNorm, PartialGrads
from shardlib.sharding.inference import infer

QWEN3 = ("qwen3", "Qwen3ForCausalLM")
OLMO2 = ("olmo2", "Olmo2ForCausalLM")
#: 8 query and 4 key/value heads: all-to-all at tp=2 x sp=2 splits both over 4 ranks, tp=4 divides both
WIDE = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=2)


def test_inference_tells_per_head_norms_from_whole_width_ones():
    for (family, cls), style in ((QWEN3, PartialGrads()), (OLMO2, ColwiseNorm())):
        inferred = infer(inference_cases.make_model(cls, family, dtype=torch.float32))
        for role in ("q_norm", "k_norm"):
            assert inferred.plan.styles[f"model.layers.*.self_attn.{role}"] == style, (cls, inferred.describe())
        assert not inferred.unplaced, inferred.unplaced


@pytest.mark.parametrize("case,mode,tp,sp,config", [
    (QWEN3, True, 2, 1, {}), (OLMO2, True, 2, 1, {}),
    (QWEN3, "ring", 2, 2, {}), (OLMO2, "ring", 2, 2, {}),
    (QWEN3, "all_to_all", 2, 2, WIDE),
], ids=["qwen3-megatron-sp", "olmo2-megatron-sp", "qwen3-ring-2x2", "olmo2-ring-2x2", "qwen3-all-to-all-2x2"])
def test_sharded_equals_unsharded(pool, case, mode, tp, sp, config):
    for result in pool.run(ring_inferred_tasks.sp_equivalence, *case, mode, tp, sp, **config):
        assert result["outputs"] and result["grads"] >= 20 and result["weights"] == result["grads"], result


def test_split_norm_weights_reshard_through_checkpoints(pool, tmp_path):
    """OLMo-2 (8 query, 4 key/value heads): HF -> tp=2 (its q/k norm weights read straight into their shards) ->
    sharded save -> tp=4 -> HF export, bitwise; the saved q norm is split in two with the heads."""
    assert pool.run(inference_tasks.checkpoint_round_trip, *OLMO2, str(tmp_path), **WIDE)[0] >= 20
    saved = json.loads((tmp_path / "sharded" / "shardlib.json").read_text())["tensors"]
    layout = saved["model.layers.0.self_attn.q_norm.weight"]["layout"]
    assert (layout["global_shape"], layout["shard_dim"], layout["num_shards"]) == ([16], 0, 2), layout


def test_styles_refuse_modules_they_cannot_shard():
    assert PartialGrads().check("m.act", nn.GELU(), 2) == [
        "m.act: PartialGrads applies to a module holding parameters of its own, torch.nn.GELU holds none"]
    assert "ColwiseNorm applies to an RMSNorm" in ColwiseNorm().check("m.norm", nn.LayerNorm(8), 2)[0]
    rms = inference_cases.make_model(*reversed(OLMO2)).model.layers[0].self_attn.q_norm
    assert ColwiseNorm().check("q_norm", rms, 2) == []
    assert ColwiseNorm().check("q_norm", rms, 3) == ["q_norm: norm width 16 is not divisible by tp=3"]
