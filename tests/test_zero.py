"""ZeRO-1/2 over flat buckets (shardlib.train.zero): equal to zero=0 at every layout, exact 1/dp partitions, the
gradient memory of ZeRO-2, refusals. Tasks in zero_tasks.py.

Tolerances. float64: the pieces step the same numbers as zero=0's whole parameters (AdamW is per element), and the
dp sums are the same sums (a reduce-scatter instead of an all-reduce; the order of a sum of dp terms may differ):
1e-12 relative on losses, gradient norms, every parameter and every optimizer state after the steps.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zero_tasks
from harness import RankPool
from profiles import ci_only
from test_train import BERT, RUN, T5, VIT

LAYOUTS = {"dp4": {"dp": 4}, "dp2_tp2": {"dp": 2, "tp": 2}, "pp2_dp2": {"dp": 2, "pp": 2},
           "dp2_sp2": {"dp": 2, "sp": 2}}  # beside an all-to-all sequence group every layer parameter is late


def _check(result: dict, stages, what: str, rtol: float = 1e-12) -> None:
    for stage in stages:
        worst = {k: v for k, v in result[stage].items() if k in ("losses", "norms", "params", "states")}
        assert max(worst.values()) < rtol, f"zero={stage} {what}: {worst}"


@pytest.mark.parametrize("layout", ["dp4", "dp2_tp2", "pp2_dp2"])
def test_every_zero_stage_equals_zero0_in_float64(pool, layout):
    """BERT, 3 steps of 2 microbatches with clipping, buckets of 4 KiB (several per rank, so the hooks reduce some
    during backward and the rest after): zero 1, 2 and 3 equal zero=0 (losses, gradient norms, every parameter and
    optimizer state); each rank holds 1/dp of the state (AdamW's two moments; its step counts are per piece)."""
    stages = (1, 2, 3)
    spec = {**BERT, **RUN, "dtype": "float64", "steps": 3, "layout": LAYOUTS[layout], "stages": list(stages),
            "bucket_mb": 4 / 1024}
    ranks = pool.run(zero_tasks.zero_equivalence, spec)
    dp = LAYOUTS[layout]["dp"]
    for rank in ranks:
        _check(rank, stages, layout)
        assert rank[2]["buckets"] > 2, rank[2]
        assert rank[2]["held"] <= rank["full"] / dp * 1.01 + 64 * rank[2]["buckets"], (rank["full"], rank[2])


@pytest.mark.parametrize("family, layout, shard", [
    ("t5", "pp2_dp2", {}), ("vit", "dp2_tp2", {"sequence_parallel": "megatron"}),
    ("bert", "dp2_sp2", {"sequence_parallel": "all_to_all"})], ids=["t5-pp2-dp2", "vit-megatron-sp", "bert-all-to-all"])
def test_zero_composes_with_tied_stages_and_sequence_parallelism(pool, family, layout, shard):
    """Parameters completed after backward (T5's embeddings tied across pipeline stages; Megatron SP's norms and
    biases; every layer parameter under all-to-all SP) are reduced after backward, the rest in it: equal to zero=0."""
    spec = {**{"t5": T5, "vit": VIT, "bert": BERT}[family], **RUN, "dtype": "float64", "steps": 2,
            "layout": LAYOUTS[layout], "shard": shard, "stages": [1, 2], "bucket_mb": 4 / 1024}
    for rank in pool.run(zero_tasks.zero_equivalence, spec):
        _check(rank, (1, 2), f"{family} {layout} {shard}")


@pytest.mark.parametrize("family, layout", [("bert", "dp4"), ("t5", "pp2_dp2"), ("vit", "dp2_tp2")])
def test_overlapped_parameter_gathers_equal_zero0(pool, family, layout):
    """``overlap_param_gather``: each bucket's all-gather runs on after the step and is waited for by the forward
    pre-hooks of the modules holding its parameters (T5: the tied embedding's three holders, across pipeline
    stages). zero 1 and 2 equal zero=0 in float64 after 3 steps, read back through ``state_dict()`` (its hooks
    wait); a missed wait would run a forward on the previous step's values of the other ranks' elements."""
    spec = {**{"bert": BERT, "t5": T5, "vit": VIT}[family], **RUN, "dtype": "float64", "steps": 3,
            "layout": LAYOUTS[layout], "stages": [1, 2], "bucket_mb": 4 / 1024,
            "zero_options": {"overlap_param_gather": True}}
    for rank in pool.run(zero_tasks.zero_equivalence, spec):
        _check(rank, (1, 2), f"overlapped {family} {layout}")


@pytest.mark.parametrize("family, schedule, options", [
    ("t5", "gpipe", {}), ("bert_mlm", "1f1b", {"activation_checkpointing": True}),
    ("bert4", "interleaved_1f1b", {}), ("vit", "1f1b", {"precision": "bf16"}),
    pytest.param("bert", "1f1b", {"compile": {"backend": "aot_eager"}}, marks=ci_only("about 30 s: two compiles"))],
    ids=["t5-tied-gpipe", "bert-mlm-tied-1f1b-checkpointing", "bert-interleaved", "vit-bf16", "bert-compiled"])
def test_zero3_with_pipeline_stages(pool, family, schedule, options):
    """zero=3 at pp=2 x dp=2, 3 steps of 2 microbatches (interleaved: 4) with clipping, against zero=0 at the same
    layout: T5 and BERT's MLM head tie weights across the two stages (their gradients summed over pp as dp shards),
    activation checkpointing re-gathers each layer in its recompute, the interleaved schedule runs two stages per
    rank, compiled stage layers are sharded after compiling (torchtitan's order). float64 (bf16 and compiled: float32
    weights, both sides rounding alike, 1e-5). Between steps each rank holds at most 0.6 of its stages' parameter
    bytes (1/dp = 0.5 and FSDP2's padding of uneven rows)."""
    base = {"t5": T5, "bert": BERT, "bert_mlm": {**BERT, "cls": "BertForMaskedLM"}, "vit": VIT,
            "bert4": {**BERT, "config": {**BERT["config"], "layers": 4}}}[family]
    bf16 = options.get("precision") == "bf16" or "compile" in options
    spec = {**base, **RUN, "dtype": "float32" if bf16 else "float64", "steps": 3, "layout": LAYOUTS["pp2_dp2"],
            "stages": [3], "trainer": {"schedule": schedule, **options},
            "shard": {"stages_per_rank": 2} if schedule == "interleaved_1f1b" else {},
            "microbatches": 4 if schedule == "interleaved_1f1b" else 2}
    for rank in pool.run(zero_tasks.zero_equivalence, spec, timeout_s=300):
        _check(rank, (3,), f"{family} {schedule} {options}", rtol=1e-5 if bf16 else 1e-12)
        assert rank[3]["param_bytes"] <= 0.6 * rank["param_bytes"], (rank[3]["param_bytes"], rank["param_bytes"])


@pytest.mark.parametrize("options, stages", [({"precision": "bf16"}, (2,)), ({"activation_checkpointing": True}, (2,)),
                                             pytest.param({"compile": {"backend": "aot_eager"}}, (2, 3),
                                                          marks=ci_only("about 40 s: three compiles"))],
                         ids=["bf16", "checkpointing", "compile"])
def test_zero_composes_with_precision_checkpointing_and_compile(pool, options, stages):
    """zero=2 (and zero=3 compiled) against zero=0 under the same option (float32 weights; compile and bf16 round
    alike on both, the dp sums run in another order: 1e-5 relative). Compiled zero=2: AOT autograd's backward
    still accumulates into the parameters' ``.grad`` outside the graph, so the post-accumulate hooks fire;
    compiled zero=3: compiled first, then fully_shard, as torchtitan orders them."""
    spec = {**BERT, **RUN, "dtype": "float32", "steps": 2, "layout": LAYOUTS["dp2_tp2"], "stages": list(stages),
            "trainer": options, "bucket_mb": 4 / 1024}
    for rank in pool.run(zero_tasks.zero_equivalence, spec, timeout_s=400):
        _check(rank, stages, str(options), rtol=1e-5)


@pytest.fixture(scope="module")
def pools():
    """Pools of other world sizes than the session's 4, started on first use: 2 (dp=2 alone), 8 (pp x dp x tp)."""
    started: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in started:
            started[world] = RankPool(world_size=world)
            started[world].start()
        return started[world]

    yield get
    for p in started.values():
        p.stop()


@pytest.mark.parametrize("layout, stages", [
    ({"dp": 2}, (1, 2, 3)),
    pytest.param({"dp": 2, "pp": 2, "tp": 2}, (1, 2, 3), marks=ci_only("about 90 s: eight ranks on two cores; pp=2 x "
                                                                       "dp=2 and dp=2 x tp=2 run in the dev profile"))],
    ids=["dp2", "pp2_dp2_tp2_sp"])
def test_zero_at_dp2_alone_and_on_the_full_mesh(pools, layout, stages):
    """dp=2 on two ranks (zero 1, 2, 3) and pp=2 x dp=2 x tp=2 with Megatron sequence parallelism inside each stage
    on eight (zero 1, 2, 3), 3 steps of 2 microbatches with clipping: equal to zero=0 in float64; at zero=3 each
    rank holds at most 0.6 of its stage's parameter bytes between steps."""
    spec = {**BERT, **RUN, "dtype": "float64", "steps": 3, "layout": layout, "stages": list(stages),
            "bucket_mb": 4 / 1024, "shard": {"sequence_parallel": "megatron"} if "tp" in layout else {}}
    world = layout["dp"] * layout.get("pp", 1) * layout.get("tp", 1)
    for rank in pools(world).run(zero_tasks.zero_equivalence, spec, timeout_s=400):
        _check(rank, stages, str(layout))
        assert rank[3]["param_bytes"] <= 0.6 * rank["param_bytes"], (rank[3]["param_bytes"], rank["param_bytes"])


@ci_only("about 60 s: eight ranks on two cores; pp=2 x dp=2 covers the tied weights in the dev profile")
def test_zero3_ties_over_four_stages(pools):
    """BertForMaskedLM at pp=4 x dp=2 with zero=3: the word embeddings (stage 0) and the tied decoder (stage 3) are
    summed over a pp group whose middle ranks do not hold them (they send zeros shaped like the dp shard,
    ``fsdp.local_shape``): equal to zero=0 in float64."""
    spec = {**BERT, "cls": "BertForMaskedLM", "config": {**BERT["config"], "layers": 4}, **RUN, "dtype": "float64",
            "steps": 2, "layout": {"dp": 2, "pp": 4}, "stages": [3], "microbatches": 4}
    for rank in pools(8).run(zero_tasks.zero_equivalence, spec, timeout_s=400):
        _check(rank, (3,), "pp4 dp2")


def test_zero2_gradient_peak_is_a_shard_and_two_buckets(pool):
    """One step of 2 microbatches at dp=4, BERT in buckets of 2 KiB: the most gradient bytes a rank holds at once
    under zero=2 is at most full / dp + 2 buckets; zero=1 holds the full gradients."""
    spec = {**BERT, **RUN, "dtype": "float32", "layout": {"dp": 4}, "bucket_mb": 2 / 1024}
    zero2 = pool.run(zero_tasks.gradient_peak, {**spec, "stage": 2})
    zero1 = pool.run(zero_tasks.gradient_peak, {**spec, "stage": 1})
    for two, one in zip(zero2, zero1):
        assert two["buckets"] >= 6, two
        assert two["peak"] <= two["shards"] + 2 * two["bucket"], two
        assert two["peak"] < 0.7 * one["peak"] and one["peak"] >= one["full"], (two, one)


def test_inf_on_one_rank_skips_the_zero2_step_everywhere(pool):
    """fp16 at pp=2 x dp=2 with zero=2: an inf gradient on one rank (pp 1, dp 0) skips the step on every rank;
    parameters and (gathered) optimizer state bitwise unchanged."""
    import train_tasks

    spec = {**BERT, **RUN, "dtype": "float32", "layout": {"dp": 2, "pp": 2}, "trainer": {"zero": 2},
            "inject": [{"pp": 1, "dp": 0}, {"pp": 0, "dp": 1}]}
    ranks = pool.run(train_tasks.inject_inf, spec)
    assert [sum(r["injected"][step] for r in ranks) for step in range(2)] == [1, 1], ranks
    for r in ranks:
        assert r["unchanged"], r
        assert r["scales"] == [(2.0 ** 16, True, 1), (2.0 ** 15, True, 2)], r


# ------------------------------------------------------------------------------------------- partitions
BERT_SHAPES = {"tiny": (2, 128, 2, 512), "base": (12, 768, 12, 3072), "large": (24, 1024, 16, 4096)}


@pytest.mark.parametrize("size", BERT_SHAPES)
@pytest.mark.parametrize("dp", [2, 3, 4, 8])
def test_largest_rank_holds_at_most_1_01_of_full_over_dp(size, dp):
    """BERT-tiny to BERT-large shapes on the meta device, the Trainer's 25 MiB buckets: the largest dp rank's
    elements (padding included) are at most 1.01x of the full count / dp (exact up to dp - 1 elements per
    bucket)."""
    from transformers import BertConfig, BertForMaskedLM

    from shardlib.parallel.flat import DEFAULT_BUCKET_BYTES, flat_buckets

    layers, hidden, heads, ffn = BERT_SHAPES[size]
    with torch.device("meta"):
        model = BertForMaskedLM(BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                           intermediate_size=ffn))
    params = list(model.parameters())
    buckets = flat_buckets(params, dp, DEFAULT_BUCKET_BYTES, order=params)
    full = sum(p.numel() for p in {id(p): p for p in params}.values())
    per_rank = [sum(b.owned(r, dp)[1] - b.owned(r, dp)[0] for b in buckets) for r in range(dp)]
    assert sum(b.numel for b in buckets) - full < dp * len(buckets)
    assert max(per_rank) <= 1.01 * full / dp, (per_rank, full)


@settings(max_examples=30)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12), dp=st.integers(1, 9),
       bucket=st.integers(1, 2000))
def test_flat_buckets_tile_every_parameter_once(sizes, dp, bucket):
    """Any parameter sizes, dp and bucket size: every parameter lies in one bucket, the spans tile each bucket's
    front without overlap, and the dp ranks' ranges tile the padded bucket."""
    from shardlib.parallel.flat import flat_buckets

    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    buckets = flat_buckets(params, dp, bucket * 4)
    assert sorted(id(p) for b in buckets for p in b.params) == sorted(id(p) for p in params)
    for b in buckets:
        spans = [b.span(i) for i in range(len(b.params))]
        assert spans[0][0] == 0 and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
        assert b.numel % dp == 0 and 0 <= b.numel - spans[-1][1] < dp
        assert [b.owned(r, dp) for r in range(dp)] == [(r * b.numel // dp, (r + 1) * b.numel // dp)
                                                        for r in range(dp)]


def test_an_optimizer_that_is_not_per_element_is_refused_before_anything_changes(pool):
    """Adafactor (factored moments) and LBFGS under zero=1/2: refused naming the class, the model untouched."""
    for rank in pool.run(zero_tasks.refused_optimizers, {**BERT, **RUN, "dtype": "float32", "layout": {"dp": 4}}):
        for name, message in rank.items():
            assert f"{name} is not one of them" in message and "zero=2" in message, (name, message)


@pytest.mark.parametrize("layout", [{"dp": 2}, {"dp": 2, "tp": 2}, {"dp": 2, "pp": 2}],
                         ids=["dp2", "dp2_tp2", "pp2_dp2"])
def test_full_state_dict_after_zero3_is_the_unsharded_models(pool, pools, layout):
    """``shardlib.full_state_dict`` after one zero=3 step (FSDP2 DTensors over dp, BertForMaskedLM: a vocabulary of
    41 rows, uneven over dp and padded over tp, its decoder tied to the embeddings across pipeline stages): plain
    tensors of the full shape, parameters and gradients equal to the unsharded model's after the same step, each
    pipeline rank its stages' (together every parameter); new full tensors loaded by ``load_full_state_dict`` read
    back bitwise. float64: the dp and tp sums run in another order than the unsharded model's (1e-12 relative)."""
    spec = {**BERT, "cls": "BertForMaskedLM", **RUN, "dtype": "float64", "layout": layout}
    world = layout["dp"] * layout.get("pp", 1) * layout.get("tp", 1)
    ranks = (pool if world == pool.world_size else pools(world)).run(zero_tasks.full_state_after_zero3, spec,
                                                                      timeout_s=300)
    for rank in ranks:
        for kind in ("params", "grads"):
            got = rank[kind]
            assert got["types"] == ["Tensor"] and not got["shapes"], (rank["layout"], kind, got)
            assert got["worst"] < 1e-12, (rank["layout"], kind, got["worst"])
        assert rank.get("reloaded", True), rank["layout"]
        if "pp" not in layout:
            assert rank["params"]["names"] == rank["all"], rank["layout"]
    assert set().union(*(rank["params"]["names"] for rank in ranks)) == set(ranks[0]["all"])
