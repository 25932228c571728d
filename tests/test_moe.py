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
import packing_tasks
import pipeline_tasks
from profiles import ci_only, examples

#: a case the dev profile leaves to CI (each a few seconds; the dev profile keeps one case of each kind)
CI = ci_only("a few seconds each: the dev profile runs another case of the same kind")


def _equal(compared: dict, grads: int) -> None:
    assert compared["outputs"] and compared["grads"] >= grads and compared["weights"] >= grads, compared


@pytest.mark.parametrize("tp,sequence,sp", [(2, "none", 1), (2, "megatron", 1), pytest.param(4, "none", 1, marks=CI)])
def test_switch_with_dropped_tokens_and_router_losses_equals_unsharded(pool, tp, sequence, sp):
    for compared in pool.run(moe_tasks.moe_equivalence, "switch", tp, sequence, sp, capacity=2):
        _equal(compared, 100)
        assert compared["kept"] < compared["routed"], compared  # the capacity dropped tokens
        assert compared["policy"] == "switch_transformers" and compared["local_fraction"] < 0.6, compared


@pytest.mark.parametrize("family,tp,sequence,sp", [
    ("qwen2moe", 2, "none", 1), pytest.param("qwen2moe", 2, "megatron", 1, marks=CI),
    pytest.param("mixtral", 1, "all_to_all", 2, marks=CI), ("mixtral", 2, "ring", 2), pytest.param("mixtral", 2, "none", 1, marks=CI),
    pytest.param("mixtral", 2, "megatron", 1, marks=CI), pytest.param("qwen2moe", 1, "all_to_all", 2, marks=CI),
    pytest.param("qwen2moe", 2, "ring", 2, marks=CI), pytest.param("qwen3moe", 2, "ring", 2, marks=CI),
    pytest.param("qwen3moe", 2, "megatron", 1, marks=CI)])
def test_decoder_moe_equals_unsharded(pool, family, tp, sequence, sp):
    for compared in pool.run(moe_tasks.moe_equivalence, family, tp, sequence, sp, seq=10):
        _equal(compared, 20)
        assert compared["policy"] == "inferred", compared


@pytest.mark.parametrize("family", [pytest.param("mixtral", marks=CI), pytest.param("qwen2moe", marks=CI)])
def test_decoder_router_losses_enter_the_loss(pool, family):
    """The load-balancing loss (output_router_logits) added to the vocab-parallel loss as transformers adds it."""
    for compared in pool.run(moe_tasks.moe_equivalence, family, 2, labels=True, router_losses=True):
        _equal(compared, 20)
        assert compared["outputs"] == 3, compared  # loss, logits, aux_loss


@pytest.mark.parametrize("implementation", [pytest.param("batched_mm", marks=CI), "grouped_mm"])
def test_every_experts_implementation_runs_sharded(pool, implementation):
    """transformers' batched and grouped GEMM experts on the local expert shards (float32: grouped_mm has no
    float64)."""
    for compared in pool.run(moe_tasks.moe_equivalence, "qwen2moe", 2, labels=True, dtype="float32",
                             implementation=implementation):
        _equal(compared, 20)


@settings(max_examples=examples(dev=3, ci=40))
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


@pytest.mark.parametrize("family,tp,zero,checkpointing", [
    pytest.param("switch", 1, 3, False, marks=CI), pytest.param("switch", 2, 1, True, marks=CI), ("mixtral", 2, 3, True),
    pytest.param("qwen2moe", 1, 2, False, marks=CI)])
def test_training_steps_at_dp_with_zero_and_checkpointing_equal_unsharded(pool, family, tp, zero, checkpointing):
    """Two Trainer steps at dp x tp (the pool's 4 ranks) with ZeRO and activation checkpointing == two AdamW
    steps of the unsharded model on the whole batch."""
    options = {"router_dtype": "float64", "capacity": 2} if family == "switch" else {}
    for result in pool.run(moe_tasks.trainer_equivalence, family, tp, zero=zero, checkpointing=checkpointing,
                           **options):
        assert result["weights"] >= 20, result


def test_a_rank_whose_experts_get_no_tokens_neither_hangs_nor_computes_wrong_gradients(pool):
    """Switch at dp=4 under ZeRO-3 with 6 experts and one 3-token sample per rank: most experts get no token on a
    rank (FSDP2 needs their gradient all the same: it reduce-scatters a layer's gradients as one buffer)."""
    results = pool.run(moe_tasks.trainer_equivalence, "switch", zero=3, experts=6, capacity=3, per_rank=1, seq=3,
                       microbatches=1, router_dtype="float64")
    assert all(r["weights"] >= 100 and r["idle_expert_params"] for r in results), results


@pytest.mark.parametrize("family,cls,tp", [("switch", "SwitchTransformersForConditionalGeneration", 1),
                                           pytest.param("mixtral", "MixtralForCausalLM", 2, marks=CI),
                                           pytest.param("qwen2moe", "Qwen2MoeForCausalLM", 1, marks=CI)])
def test_pipelined_moe_equals_unsharded(pool, family, cls, tp):
    """pp=2 (encoder / decoder stages for Switch) x tp, 1F1B over 2 microbatches: the loss, every gradient of
    each rank's stage and the weights after AdamW."""
    spec = {"family": "moe", "model": family, "cls": cls, "pp": 2, "tp": tp, "schedule": "1f1b", "microbatches": 2,
            "dtype": "float64", "options": {"router_dtype": "float64"} if family == "switch" else {}}
    for result in pool.run(pipeline_tasks.pipeline_equivalence, spec):
        assert result["grads"] >= 10, result


# ------------------------------------------------------------------------------------------ expert parallelism
@pytest.mark.parametrize("family,ep,capacity,clip", [
    ("mixtral", 2, None, 1.0), pytest.param("qwen2moe", 4, None, None, marks=CI),
    pytest.param("mixtral", 2, 8.0, None, marks=CI), pytest.param("qwen2moe", 2, 4.0, 0.5, marks=CI),
    pytest.param("switch", 2, None, 0.5, marks=CI),
    ("switch", 4, None, None), pytest.param("switch", 2, 4.0, None, marks=CI),
    pytest.param("qwen3moe", 2, None, None, marks=CI)])
def test_expert_parallel_training_equals_unsharded(pool, family, ep, capacity, clip):
    """Two Trainer steps at dp=4 with each MoE layer's experts split over ep ranks (ep=2: two expert-data-parallel
    replicas), dropless or with a static capacity large enough to drop nothing beyond the model's own rule, gradient
    clipping over the whole model == the unsharded model's steps on the whole batch. Switch's router keeps 2 tokens
    per expert and sequence (it drops some): the same tokens drop at every ep."""
    options = {"router_dtype": "float64", "capacity": 2} if family == "switch" else {}
    for result in pool.run(moe_tasks.trainer_equivalence, family, ep=ep, expert_capacity=capacity,
                           max_grad_norm=clip, experts=4, **options):
        assert result["weights"] >= 20, result


@settings(max_examples=examples(dev=2, ci=16))
@given(family=st.sampled_from(["switch", "mixtral", "qwen2moe"]), ep=st.sampled_from([2, 4]),
       per_rank=st.integers(1, 2), top_k=st.integers(1, 3), capacity=st.integers(1, 6), static=st.booleans(),
       tp=st.sampled_from([1, 2]), seq=st.integers(3, 9))
def test_drawn_expert_parallel_layouts_train_as_unsharded(pool, family, ep, per_rank, top_k, capacity, static, tp,
                                                          seq):
    """Hypothesis draws the family, ep (with tp=2 where the 4 ranks allow), the experts per ep rank, top-k, Switch's
    own capacity, the sequence length and the exchange: dropless, or static with a capacity factor of E (no expert
    can receive more than every pair: nothing beyond the model's own rule drops). One Trainer step == the unsharded
    model's."""
    experts, tp = ep * per_rank, tp if ep * tp <= 4 else 1
    options = ({"router_dtype": "float64", "capacity": capacity} if family == "switch"
               else {"top_k": min(top_k, experts), "num_key_value_heads": 2})
    for result in pool.run(moe_tasks.trainer_equivalence, family, tp=tp, ep=ep, experts=experts, steps=1, seq=seq,
                           expert_capacity=float(experts) if static else None, **options):
        assert result["weights"] >= 10, result


@pytest.mark.parametrize("family,layout", [
    ("mixtral", {"tp": 2}), pytest.param("switch", {"tp": 2}, marks=CI),
    ("switch", {"pp": 2}), pytest.param("mixtral", {"pp": 2}, marks=CI),
    ("mixtral", {"sp": 2, "sequence": "ring"}), pytest.param("qwen2moe", {"sp": 2, "sequence": "all_to_all"}, marks=CI),
    pytest.param("qwen3moe", {"tp": 2, "sequence": "megatron"}, marks=CI)])
def test_expert_parallelism_composes_with_tp_pp_and_sp(pool, family, layout):
    """ep=2 of dp=2 beside tp=2 (expert tensor parallelism within each ep rank's experts, Megatron SP too), pp=2
    (each stage's layers exchange within the stage) or sp=2 (each rank exchanges its own positions): two Trainer
    steps == the unsharded model's on the whole batch, every weight gathered back over ep and tp."""
    options = {"router_dtype": "float64", "capacity": 2} if family == "switch" else {}
    for result in pool.run(moe_tasks.trainer_equivalence, family, ep=2, experts=4, **layout, **options):
        assert result["weights"] >= 10, result


@pytest.mark.parametrize("family,zero,layout", [
    ("mixtral", 3, {"ep": 2}), ("switch", 3, {"ep": 4}), ("switch", 2, {"ep": 2}), ("mixtral", 1, {"ep": 2, "tp": 2}),
    pytest.param("switch", 3, {"ep": 2}, marks=CI), pytest.param("mixtral", 3, {"ep": 4}, marks=CI),
    pytest.param("qwen2moe", 3, {"ep": 2, "tp": 2}, marks=CI), pytest.param("switch", 3, {"ep": 2, "pp": 2}, marks=CI),
    pytest.param("mixtral", 2, {"ep": 4}, marks=CI), pytest.param("qwen2moe", 2, {"ep": 2, "tp": 2}, marks=CI),
    pytest.param("switch", 1, {"ep": 2, "pp": 2}, marks=CI), pytest.param("mixtral", 1, {"ep": 2}, marks=CI)])
def test_zero_partitions_each_ep_ranks_experts_over_the_ranks_holding_them(pool, family, zero, layout):
    """ZeRO with expert parallelism: each ep rank's experts partitioned over the expert-data-parallel ranks (those
    holding the same experts; ep=4 of dp=4: a group of one), the rest over dp: ZeRO-3's experts modules FSDP2
    groups of their own, ZeRO-1/2's expert weights in flat buckets of their own. Two steps with gradient clipping
    == the unsharded model's."""
    options = {"router_dtype": "float64", "capacity": 2} if family == "switch" else {}
    for result in pool.run(moe_tasks.trainer_equivalence, family, zero=zero, experts=4, max_grad_norm=0.5, **layout,
                           **options):
        if zero == 3:
            assert result["sharded_over"].get("edp", 0) >= 2 and result["sharded_over"].get("dp", 0) >= 4, result
        else:
            assert result["expert_buckets"] >= 1, result


@pytest.mark.parametrize("expert_capacity", [None, pytest.param(8.0, marks=CI)])
def test_an_ep_rank_whose_experts_get_no_token_neither_hangs_nor_computes_wrong_gradients(pool, expert_capacity):
    """Switch at ep=2 whose routers send every token to experts 0 and 1: ep rank 1 (experts 2 and 3) receives no row
    (dropless) or only padding (static capacity) in any layer, yet takes part in every exchange of forward and
    backward, and the steps equal the unsharded model's (its idle experts keep no gradient, as there: eager, the
    static exchange computes only the filled slots)."""
    results = pool.run(moe_tasks.trainer_equivalence, "switch", ep=2, experts=4, capacity=3, router_dtype="float64",
                       starve=True, expert_capacity=expert_capacity)
    assert all(r["weights"] >= 100 for r in results), results
    assert [bool(r["idle_expert_params"]) for r in results] == [False, True, False, True], results


@pytest.mark.parametrize("ep,factor", [pytest.param(2, 0.5, marks=CI), pytest.param(4, 0.75, marks=CI)])
def test_static_capacity_counts_every_pair_it_drops(pool, ep, factor):
    for result in pool.run(moe_tasks.static_capacity_drops, ep, factor):
        assert result["layers"] == 2 and result["routed"] == 2 * 18 * 2, result
        assert result["counted"] == result["expected"] > 0, result


@pytest.mark.parametrize("family", [pytest.param("mixtral", marks=CI), pytest.param("switch", marks=CI)])
def test_full_state_loads_into_expert_shards_and_gathers_back_bitwise(pool, family):
    for result in pool.run(moe_tasks.full_state_round_trip_at_ep, family, 4):
        assert result["local_experts"] == 1 and not result["differing"] and result["compared"] >= 20, result


def test_expert_parallel_refusals_name_the_problem(pool):
    odd = pool.run(moe_tasks.shard_refusal, "mixtral", ep=4, experts=6)[0]
    assert "6 experts are not divisible by ep=4" in odd, odd
    capacity = pool.run(moe_tasks.shard_refusal, "mixtral", expert_capacity=1.0)[0]
    assert "needs a mesh with ep > 1" in capacity, capacity


# -------------------------------------------------------------------------------- checkpoints, generate, packing
@pytest.mark.parametrize("tp,ep", [(2, 1), pytest.param(1, 2, marks=CI)])
def test_hf_checkpoints_read_into_expert_shards_and_written_back_bitwise(pool, tmp_path, tp, ep):
    """Switch's HF checkpoint (per-expert tensors under the model's own names) read straight into tp shards or
    into each ep rank's own experts: bitwise the checkpoint's; written back by save_pretrained, bitwise."""
    for result in pool.run(moe_tasks.hf_checkpoint_into_shards, str(tmp_path), tp, ep):
        assert not result["differing"] and result["compared"] >= 100 and not result["written_differing"], result


@pytest.mark.parametrize("family", ["mixtral", pytest.param("switch", marks=CI)])
def test_checkpoints_at_ep_reshard_to_another_ep_and_export_bitwise(pool, tmp_path, family):
    """HF -> read at ep=2 x tp=2 -> saved sharded -> read at ep=4 -> saved -> exported to HF: bitwise the first
    checkpoint (Mixtral's fused experts, Switch's expert modules); a step at ep=2 with ZeRO-2, saved with its
    optimizer, resumed at ep=4 for a second step == the unsharded model's two steps."""
    for result in pool.run(moe_tasks.checkpoint_at_ep, str(tmp_path), family):
        assert not result["differing"] and result["compared"] >= 20 and result["resumed"] >= 20, result


@pytest.mark.parametrize("family,tp,ep", [("mixtral", 2, 1), pytest.param("qwen2moe", 1, 4, marks=CI),
                                          pytest.param("mixtral", 1, 2, marks=CI),
                                          pytest.param("qwen2moe", 2, 1, marks=CI)])
def test_per_expert_hf_checkpoints_read_into_fused_shards_and_written_back(pool, tmp_path, family, tp, ep):
    """Mixtral's and Qwen2-MoE's HF checkpoints (one tensor per expert, as transformers writes them) read straight
    into the 3-D experts' tp or ep shards (transformers' conversion mapping applied by shardlib's reader): the
    model's weights, bitwise; written back, transformers loads the same weights."""
    for result in pool.run(moe_tasks.fused_hf_checkpoint, str(tmp_path), family, tp, ep):
        assert not result["differing"] and result["compared"] >= 20 and not result["reloaded_differing"], result


@pytest.mark.parametrize("family,tp,ep", [pytest.param("switch", 2, 1, marks=CI), pytest.param("mixtral", 2, 1, marks=CI),
                                          ("qwen2moe", 1, 2), pytest.param("switch", 1, 4, marks=CI),
                                          pytest.param("mixtral", 2, 2, marks=CI)])
def test_generate_gives_the_unsharded_tokens(pool, family, tp, ep):
    results = pool.run(moe_tasks.generation_matches, family, tp, ep)
    assert ep > 1 or all(r == results[0] for r in results)


def test_packing_a_capacity_limited_router_is_refused(pool):
    message = pool.run(moe_tasks.packed_refusal)[0]
    assert "capacity counted along the whole row" in message and "train it padded" in message, message


@pytest.mark.parametrize("layout", [pytest.param({"tp": 2}, marks=CI), pytest.param({"dp": 4, "ep": 2}, marks=CI)])
def test_packed_rows_train_as_the_padded_batches(pool, layout):
    """Mixtral routes each token alone, so packed documents are routed as in the padded batch: fit(packing=16)
    at tp=2 and at ep=2 == the unsharded model on the padded batches (float32 tolerances: the router's softmax)."""
    spec = dict(seed=3, samples=24, budget=16, batch_size=8, steps=3, microbatches=2, model="mixtral", layout=layout)
    for result in pool.run(packing_tasks.packed_fit, spec):
        assert result["loss_error"] < 1e-6 and result["weight_error"] < 1e-6, result


def test_a_written_policy_keeps_the_experts(tmp_path):
    """``shardlib plan --auto --write-policy``'s module for Qwen2-MoE gives back the inferred plan, experts and MoE
    blocks included."""
    import importlib.util

    from moe_cases import build_model
    from shardlib.sharding.inference import infer
    from shardlib.policies import _REGISTRY
    from shardlib.sharding.inference.policy_source import policy_source

    model = build_model("qwen2moe")
    path = tmp_path / "qwen2moe_policy.py"
    path.write_text(policy_source(infer(model), type(model)))
    spec = importlib.util.spec_from_file_location("qwen2moe_policy", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)  # registers the policy: taken out again below
        plan, inferred = module.make_plan(model, 2), infer(model).plan
    finally:
        _REGISTRY.pop(type(model), None)
    assert plan.moe == inferred.moe and plan.styles == inferred.styles and plan.moe


def test_runtime_refusals_of_expert_parallelism_and_router_losses(pool, tmp_path):
    for messages in pool.run(moe_tasks.runtime_refusals, str(tmp_path)):
        assert "ep=3 must be a positive integer dividing dp=4" in messages["mesh"], messages
        assert "the same tokens per batch on every rank of the ep group" in messages["shapes"], messages
        assert "a pipeline stage holds only some of them" in messages["pipeline"], messages


@CI
def test_the_static_capacity_compiles_to_one_graph_equal_to_eager(pool):
    for result in pool.run(moe_tasks.static_capacity_compiles, 2):
        assert result["graphs"] == 1 and result["breaks"] == 0, result
        assert result["loss"] < 1e-6 and result["grads"] < 1e-6, result


def test_fit_logs_each_moe_layers_load(pool, tmp_path):
    records = pool.run(moe_tasks.fit_logs_expert_load, str(tmp_path))[0]
    assert len(records) == 2, records
    for record in records:
        layers = record["experts"]
        assert len(layers) == 4 and all(len(layer["tokens_per_expert"]) == 4 for layer in layers.values()), record
        encoder = next(v for k, v in layers.items() if k.startswith("encoder."))
        # 8 sequences of 9 tokens a step over dp=4; a capacity of 2 per expert and sequence keeps at most 8 of 9
        assert sum(encoder["tokens_per_expert"]) <= 8 * 8 and encoder["dropped_share"] > 0, record
        assert sum(encoder["tokens_per_expert"]) + round(encoder["dropped_share"] * 72) == 72, record
