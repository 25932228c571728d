"""Ring attention (``sequence_parallel="ring"``, context parallelism) on the mesh's sp dimension: equality with the
unsharded model (outputs, every gradient, weights after AdamW) for BERT (padding masks, cross-attention decoder),
ViT and T5 / UMT5 (relative position bias per block, causal decoder, cross-attention), alone and with tensor
parallelism, lengths sp does and does not divide, past the head count."""

import pytest
import torch

import rank_tasks
import ring_tasks
from harness import RankPool
from profiles import ci_only
from test_all_to_all import BERT, BERT_CROSS, T5, UMT5, VIT, VIT_MIM
from test_vit_t5_equivalence import FIXED_T5

CASES = [BERT, BERT_CROSS, VIT, VIT_MIM, T5, UMT5]


def _spec(case, tp, sp, seq=7, **extra):
    return {"tp": tp, "sp": "ring", "sp_size": sp, "seq": seq, "batch": 2, "padding": True,
            "dtype": "float64", "seed": 11, **case, **extra}


@pytest.mark.parametrize("tp,sp", [(1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("case", CASES, ids=[c["cls"] for c in CASES])
def test_ring_matches_unsharded(pool, case, tp, sp):
    results = pool.run(rank_tasks.equivalence, _spec(case, tp, sp))
    assert all(r["grads"] > 10 for r in results)


ROBERTA = {"family": "inferred", "model": "roberta", "cls": "RobertaForMaskedLM", "config": {}}
LLAMA = {"family": "inferred", "model": "llama", "cls": "LlamaForCausalLM", "config": {"num_key_value_heads": 2}}
THREE_STEPS = [BERT, VIT, T5, UMT5, ROBERTA, LLAMA]


@pytest.mark.parametrize("tp,sp,ulysses", [(1, 2, 1), (1, 4, 1), (2, 2, 1), (1, 4, 2)])
@pytest.mark.parametrize("case", THREE_STEPS, ids=[c["cls"] for c in THREE_STEPS])
def test_ring_trains_three_steps_exactly(pool, case, tp, sp, ulysses):
    """Three Trainer steps on new padded batches (dp = 4 / (tp * sp)): losses, gradients and weights to 1e-10, for
    a ring of sp, and for Ulysses x ring 2 x 2."""
    spec = {**_spec(case, tp, sp, ulysses=ulysses), "dec_seq": 5}
    results = pool.run(ring_tasks.training_steps, spec)
    assert all(r["compared"] > 30 for r in results)


def _three_layers(case: dict) -> dict:
    """The case with three layers (two stages of unequal length) where its config counts them so."""
    if case.get("family") == "inferred":
        return {**case, "config": {**case["config"], "num_hidden_layers": 3}}
    return case if case.get("family") == "t5" else {**case, "config": {**case["config"], "layers": 3}}


@pytest.mark.parametrize("case", THREE_STEPS, ids=[c["cls"] for c in THREE_STEPS])
def test_ring_pipeline(pool, case):
    """pp=2 x ring sp=2: the stages exchange sequence chunks (T5: and the relative bias per distance), two
    microbatches, a length sp does not divide, three exact steps."""
    spec = {**_spec(_three_layers(case), 1, 2), "pp": 2, "microbatches": 2, "dec_seq": 5, "batch": 4}
    results = pool.run(ring_tasks.training_steps, spec)
    assert sum(r["compared"] for r in results) > 30


def test_ring_past_the_head_count(pool):
    """Two heads over four sp ranks: all-to-all refuses (each rank needs whole heads), the ring trains exactly."""
    case = {**BERT, "config": {**BERT["config"], "heads": 2}}
    assert "not divisible by tp(1) * sp(4)" in pool.run(ring_tasks.refusal, {**_spec(case, 1, 4), "sp": "all_to_all"})[0]
    pool.run(ring_tasks.training_steps, _spec(case, 1, 4, seq=13))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_ring_both_attention_implementations(pool, attention):
    """The ring keeps the inner implementation's mask semantics (eager: additive masks, SDPA: boolean or causal) and
    computes the softmax in the input's precision: against ViT's eager reference, whose softmax runs in float32,
    the float64 reference is SDPA."""
    pool.run(rank_tasks.equivalence, _spec(T5, 1, 4, seq=8, kernels={"attention": attention}))
    pool.run(rank_tasks.equivalence, _spec(VIT, 2, 2, kernels={"attention": attention}, reference_attention="sdpa"))


@pytest.mark.parametrize("case", [BERT, T5], ids=["bert", "t5"])
def test_ring_dropout_keeps_replicas_identical(pool, case):
    spec = _spec({**case, "config": {**case["config"], "dropout": 0.1}}, 1, 2, dtype="float32")
    results = pool.run(rank_tasks.dropout_training_keeps_replicas_identical, spec)
    assert all(r["replicated_checked"] > 5 for r in results)


@pytest.mark.parametrize("case", CASES, ids=[c["cls"] for c in CASES])
def test_ulysses_by_ring(pool, case):
    """Ulysses x ring, 2 x 2: heads exchanged within pairs of consecutive chunks, the pairs' joint chunks around a
    ring of two."""
    results = pool.run(rank_tasks.equivalence, _spec(case, 1, 4, ulysses=2))
    assert all(r["grads"] > 10 for r in results)


@pytest.mark.parametrize("mode,ulysses,tp", [("ring", 1, 1), ("ring", 2, 1), ("all_to_all", 1, 1), (True, 1, 2)])
def test_generate_under_sequence_parallelism(pool, mode, ulysses, tp):
    """T5 generate() (greedy and beam search, KV cache on) gives the unsharded tokens at sp=4: the encoder runs
    split, the decoding steps, which fill and reuse a key/value cache, run unsplit on every rank. Megatron SP
    (tp=2), whose attention sees the whole sequence, decodes split with whole caches."""
    spec = {"family": "t5", "cls": "T5ForConditionalGeneration", "tp": tp, "sp": mode, "sp_size": 4,
            "ulysses": ulysses, "seq": 6, "batch": 3, "padding": True, "dtype": "float32", "seed": 4, "new_tokens": 8,
            "config": {**FIXED_T5, "vocab": 41, "d_model": 64, "d_kv": 8, "d_ff": 64, "heads": 4, "ffn": "gated-gelu",
                       "init": 10.0}}
    distinct = pool.run(rank_tasks.generation_matches, spec)[0]
    assert distinct[1] >= 8 and distinct[3] >= 8, f"degenerate generations, the test would prove little: {distinct}"


def test_ranks_with_different_lengths_are_told(pool):
    messages = pool.run(ring_tasks.disagreeing_lengths, _spec(BERT, 1, 2, seq=7))
    for message in messages:
        assert "inputs to bert.encoder.layer differ" in message and "length 7" in message and "length 8" in message


@pytest.fixture(scope="module")
def pool8():
    p = RankPool(world_size=8)
    p.start()
    yield p
    p.stop()


@ci_only("eight ranks on two cores; the dev profile covers tp2 x sp2 and pp2 x sp2 on four")
@pytest.mark.parametrize("case", THREE_STEPS, ids=[c["cls"] for c in THREE_STEPS])
def test_ring_with_tensor_and_pipeline_parallelism(pool8, case):
    """tp=2 x pp=2 x ring sp=2 on eight ranks: three exact Trainer steps with two microbatches."""
    spec = {**_spec(_three_layers(case), 2, 2), "pp": 2, "microbatches": 2, "dec_seq": 5, "batch": 2}
    results = pool8.run(ring_tasks.training_steps, spec, timeout_s=300)
    assert sum(r["compared"] for r in results) > 30


@pytest.mark.parametrize("trainer", [{"zero": 1}, {"zero": 2}, {"zero": 3}, {"activation_checkpointing": True},
                                     pytest.param({"compile": {"backend": "aot_eager"}}, marks=ci_only("about 60 s"))],
                         ids=str)
def test_ring_composes_with_the_trainer(pool, trainer):
    """dp=2 x ring sp=2 under ZeRO 1/2/3, activation checkpointing (the ring runs again in the recompute) and
    compile (the ring's autograd function runs eagerly between compiled graphs): three exact steps."""
    results = pool.run(ring_tasks.training_steps, {**_spec(T5, 1, 2), "dec_seq": 5, "trainer": trainer},
                       timeout_s=300)
    assert all(r["compared"] > 0 for r in results) or trainer.get("zero") == 3


WITHIN_RANKS = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 + [3] * 4 + [2] * 4 + [1] * 4 + [0] * 4  # rank p: segments p, 7 - p


@pytest.mark.parametrize("ids, causal, transfers", [
    (WITHIN_RANKS, False, 0),
    (WITHIN_RANKS, True, 0),
    ([i // 12 for i in range(30)] + [-1, -1], True, None),  # documents across ranks, padding
    ([0] * 32, False, 4 * 3 * 3),  # one document: every block to every rank (forward, backward), every dK/dV back
], ids=["within-ranks", "within-ranks-causal", "spanning-causal", "whole"])
def test_blocks_travel_only_where_a_query_sees_them(pool, ids, causal, transfers):
    """Ring attention under a mask spec on 4 gloo ranks: exact against dense attention (output, dq, and dK / dV
    summed over every rank's queries), sending each K/V block only to the ranks whose queries see it and each dK/dV
    only back from them (documents within each rank's two zigzag segments: nothing at all)."""
    results = pool.run(ring_tasks.spec_wire, {"ids": ids, "causal": causal, "length": len(ids)})
    for name in ("dk", "dv"):
        total = sum(r[name] for r in results)
        for r in results:
            real = r["positions"] < len(ids)
            torch.testing.assert_close(r[f"mine_{name}"][:, :, real], total[:, :, r["positions"][real]],
                                       **ring_tasks.EXACT)
    sent = sum(r["sent"] for r in results)
    assert sent == transfers if transfers is not None else 0 < sent < 4 * 3 * 3
