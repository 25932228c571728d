"""Mixture-of-experts models sharded exactly (issue 52): Switch Transformers by its policy (top-1 routing with a
capacity small enough that tokens are dropped, the router z-loss and load-balancing loss in the loss), Mixtral and
Qwen2-MoE (with its shared expert and gate) by inferred plans, against the unsharded model under the same seed:
outputs, every parameter's gradient, the weights after AdamW; at tp=2 and 4, with Megatron sequence parallelism,
all-to-all and ring sequence parallelism (also with tp), whatever experts implementation transformers runs
(eager, batched_mm, grouped_mm); a hypothesis property draws experts, top-k, capacities and layouts. What cannot
be honoured is refused before the model changes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_tasks
from profiles import examples


def _equal(compared: dict, grads: int) -> None:
    assert compared["outputs"] and compared["grads"] >= grads and compared["weights"] >= grads, compared


@pytest.mark.parametrize("tp,sequence,sp", [(2, "none", 1), (2, "megatron", 1), (4, "none", 1)])
def test_switch_with_dropped_tokens_and_router_losses_equals_unsharded(pool, tp, sequence, sp):
    for compared in pool.run(moe_tasks.moe_equivalence, "switch", tp, sequence, sp, capacity=2):
        _equal(compared, 100)
        assert compared["kept"] < compared["routed"], compared  # the capacity dropped tokens
        assert compared["policy"] == "switch_transformers" and compared["local_fraction"] < 0.6, compared


@pytest.mark.parametrize("family", ["mixtral", "qwen2moe"])
@pytest.mark.parametrize("tp,sequence,sp", [(2, "none", 1), (2, "megatron", 1), (1, "all_to_all", 2),
                                            (2, "ring", 2)])
def test_decoder_moe_equals_unsharded(pool, family, tp, sequence, sp):
    for compared in pool.run(moe_tasks.moe_equivalence, family, tp, sequence, sp, seq=10):
        _equal(compared, 20)
        assert compared["policy"] == "inferred", compared


@pytest.mark.parametrize("family", ["mixtral", "qwen2moe"])
def test_decoder_router_losses_enter_the_loss(pool, family):
    """The load-balancing loss (output_router_logits) added to the vocab-parallel loss as transformers adds it."""
    for compared in pool.run(moe_tasks.moe_equivalence, family, 2, labels=True, router_losses=True):
        _equal(compared, 20)
        assert compared["outputs"] == 3, compared  # loss, logits, aux_loss


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_every_experts_implementation_runs_sharded(pool, implementation):
    """transformers' batched and grouped GEMM experts on the local expert shards (float32: grouped_mm has no
    float64)."""
    for compared in pool.run(moe_tasks.moe_equivalence, "qwen2moe", 2, labels=True, dtype="float32",
                             implementation=implementation):
        _equal(compared, 20)


@settings(max_examples=examples(dev=6, ci=40))
@given(family=st.sampled_from(["switch", "mixtral", "qwen2moe"]), experts=st.integers(1, 6), top_k=st.integers(1, 3),
       capacity=st.integers(1, 6), layout=st.sampled_from([(1, "none", 1), (2, "none", 1), (4, "none", 1),
                                                           (2, "megatron", 1), (2, "ring", 2)]),
       seq=st.integers(3, 11))
def test_drawn_experts_top_k_capacities_and_layouts_equal_unsharded(pool, family, experts, top_k, capacity, layout,
                                                                    seq):
    tp, sequence, sp = layout
    if family == "switch" and sequence == "ring":
        sequence, sp = "megatron", 1  # refused there (per-sequence capacity): test_refusals
    heads = {} if family == "switch" else {"num_key_value_heads": max(2, tp)}  # whole key/value heads per rank
    for compared in pool.run(moe_tasks.moe_equivalence, family, tp, sequence, sp, experts=experts,
                             top_k=min(top_k, experts), capacity=capacity, seq=seq, **heads):
        _equal(compared, 10)


def test_refusals_name_the_module_and_the_fix(pool):
    switch_ring = pool.run(moe_tasks.shard_refusal, "switch", 1, "all_to_all", 2)[0]
    assert "capacity counted along the whole sequence" in switch_ring and "sequence_parallel=True" in switch_ring
    assert "encoder.block.1.layer.1.mlp" in switch_ring
    losses_ring = pool.run(moe_tasks.shard_refusal, "mixtral", 1, "ring", 2, router_losses=True)[0]
    assert "output_router_logits=True" in losses_ring, losses_ring
    width = pool.run(moe_tasks.shard_refusal, "qwen2moe", 4, moe_intermediate_size=6)[0]
    assert "gate_up_proj: intermediate width 6 of 4 experts is not divisible by tp=4" in width, width
