"""Padding-free training (shardlib/train/packing.py, shardlib/sharding/documents.py): packed rows compute what the
padded batches of the same samples compute.

* The packer and the collator: every sample placed once and whole, rows within the budget, a pure function of the
  lengths (hypothesis); document ids, in-document positions, per-document labels and decoder inputs; bad input
  named (a sample longer than a row, a padded sample, a key that is neither tokens nor a label, a model or a batch
  that cannot pack).
* Training: ``fit(packing=16)`` for three AdamW steps (clipped by the global norm) against the unsharded model
  trained by hand on the padded batches, for BERT masked LM and sequence classification, T5 conditional generation
  and Llama (inferred plan), at a world of one (SDPA and eager), tp=2, tp=2 + SP, ring sp=2 and pp=2 x dp=2; for
  BERT under ZeRO-1 with activation checkpointing (dp=2 x tp=2), ZeRO-3 (dp=4), compiled at a world of one (CI
  profile), from an iterable dataset at dp=4 and accumulating over two packed batches; at a world of one for BERT
  token classification and causal LM, RoBERTa (positions from ``padding_idx + 1``) and GPT-2
  (tests/packing_tasks.py); a sharded model's own forward in a hand loop; a forward through flex_attention's block
  masks (CI profile); which key/value blocks ring attention skips for a packed row.

Tolerances: float64, rtol 1e-10 on every step's loss and on every weight after the last step (relative to the
largest weight). A causal LM's loss is computed in float32 by transformers (``logits.float()``) and by shardlib's
vocab-parallel loss, which matches it: their losses and weights are compared at 1e-6 (Llama's differ by ~2e-7 and
~1e-9: the float32 loss of a packed microbatch sums its tokens in another order), and Llama's float64 logits of
every real token at 1e-10. A control breaks the positions and must fail that.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import bert_cases
import inference_cases
import packing_tasks
import shardlib
from profiles import ci_only, examples
from shardlib.sharding.documents import document_positions, document_starts
from shardlib.train.packing import PackingCollator, pack_rows

SPEC = dict(seed=3, samples=24, budget=16, batch_size=8, steps=3, microbatches=2)
#: causal LMs' losses are float32 (see the module docstring): their losses and the weights their gradients step
FLOAT32_LOSS = {"llama": 1e-6, "gpt2": 1e-6, "bert_lm": 1e-6}


def _check(result: dict, kind: str) -> None:
    assert result["loss_error"] < FLOAT32_LOSS.get(kind, 1e-10), result
    assert result["weight_error"] < FLOAT32_LOSS.get(kind, 1e-10), result


# -- the packer and the collator -------------------------------------------------------------------------------
@settings(max_examples=examples(60, 300), deadline=None)
@given(st.lists(st.integers(1, 16), min_size=1, max_size=40), st.integers(16, 40))
def test_pack_rows_places_every_sample_once_within_the_budget(lengths, budget):
    rows = pack_rows([(n,) for n in lengths], (budget,))
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= budget for row in rows)
    assert all(row == sorted(row) for row in rows)
    assert pack_rows([(n,) for n in lengths], (budget,)) == rows  # a function of the lengths
    # first fit: a sample went to a later row only because it fit in no earlier one (whose load only grew)
    loads = [sum(lengths[i] for i in row) for row in rows]
    assert all(loads[a] + lengths[i] > budget for b, row in enumerate(rows) for i in row for a in range(b))


def test_collator_rows_documents_positions_and_labels():
    samples = [{"input_ids": [5, 6, 7], "token_type_ids": [0, 0, 1], "labels": 2},
               {"input_ids": [8], "token_type_ids": [1], "labels": 0},
               {"input_ids": [10, 11, 12, 13, 14], "token_type_ids": [0] * 5, "labels": 1}]
    batch = PackingCollator(5, rows_multiple=4)(samples)
    assert list(batch) == ["input_ids", "token_type_ids", "document_ids", "labels"]  # input_ids first (pipelines)
    # first-fit decreasing: [10..14] opens row 0, [5, 6, 7] row 1, [8] joins row 1 (rows as long as the longest);
    # two empty rows make 4
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 14], [5, 6, 7, 8, 0], [0] * 5, [0] * 5]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, 1, -1], [-1] * 5, [-1] * 5]
    assert batch["token_type_ids"][1].tolist() == [0, 0, 1, 1, 0]
    assert batch["labels"].tolist() == [[1, -100], [2, 0], [-100, -100], [-100, -100]]
    assert document_positions(batch["document_ids"])[:2].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]
    assert document_starts(batch["document_ids"], 2)[:2].tolist() == [[0, 0], [0, 3]]


def test_collator_shifts_causal_labels_and_builds_decoder_inputs():
    causal = PackingCollator(8, label_shift=1)([{"input_ids": [3, 4, 5], "labels": [3, 4, 5]},
                                                {"input_ids": [6, 7], "labels": [6, 7]}])
    assert causal["labels"].tolist() == [[-100, 4, 5, -100, 7]]  # no document predicts the next one's first token
    seq2seq = PackingCollator(8, target_length=4, decoder_start_token_id=0)(
        [{"input_ids": [3, 4, 5], "labels": [7, 8]}, {"input_ids": [6], "labels": [9, -100]}])
    assert seq2seq["labels"].tolist() == [[7, 8, 9, -100]]
    assert seq2seq["decoder_input_ids"].tolist() == [[0, 7, 0, 9]]  # shifted right per document
    assert seq2seq["decoder_document_ids"].tolist() == [[0, 0, 1, 1]]
    fixed = PackingCollator(8, fixed_length=True)([{"input_ids": [3, 4]}])
    assert fixed["input_ids"].shape == (1, 8)


def test_collator_names_bad_input(caplog):
    collate = PackingCollator(4)
    cases = [([{"input_ids": [1, 2, 3, 4, 5]}], "sample 0 of the batch has 5 tokens, more than a row's 4"),
             ([{"input_ids": [1]}, {"text": "a"}], "sample 1 of the batch has no input_ids"),
             ([{"input_ids": [1, 2], "attention_mask": [1, 0]}], "sample 0 is padded"),
             ([{"input_ids": [1, 2], "idx": 7}], "sample 0's 'idx' (shape ()) is neither a token sequence"),
             ([{"input_ids": [1], "labels": 1}, {"input_ids": [2]}], "sample 1 has keys ['input_ids'], sample 0"),
             ([], "the batch has no samples")]
    for samples, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            collate(samples)
    with pytest.raises(ValueError, match="too_long must be"):
        PackingCollator(4, too_long="split")
    cut = PackingCollator(4, too_long="truncate")
    with caplog.at_level(logging.WARNING, logger="shardlib.train"):
        batch = cut([{"input_ids": [1, 2, 3, 4, 5, 6], "labels": [1, 2, 3, 4, 5, 6]}, {"input_ids": [7] * 9,
                                                                                        "labels": [7] * 9}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [7, 7, 7, 7]] and cut.truncated == 2
    assert len([r for r in caplog.records if "cut to the row's 4" in r.getMessage()]) == 1  # said once


# -- training at a world of one --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world_of_one():
    mesh = shardlib.init_mesh()
    yield mesh
    dist.destroy_process_group()


@pytest.mark.parametrize("attention", ["sdpa", "eager", "blocks"])
@pytest.mark.parametrize("kind", list(packing_tasks.CLASSES))
def test_packed_training_equals_padded_at_a_world_of_one(world_of_one, kind, attention):
    result = packing_tasks.packed_fit({**SPEC, "model": kind, "attention": attention})
    _check(result, kind)
    _masks_as_data(result, kind, attention == "blocks")


@pytest.mark.parametrize("kind", [*packing_tasks.INFERRED, *packing_tasks.MORE_BERT])
def test_packed_training_of_inferred_plans_and_other_heads(world_of_one, kind):
    _check(packing_tasks.packed_fit({**SPEC, "model": kind}), kind)


def test_llama_logits_of_every_real_token_and_the_control(world_of_one, monkeypatch):
    spec = {**SPEC, "model": "llama"}
    assert packing_tasks.packed_logits(spec) < 1e-10
    import shardlib.sharding.documents as documents

    monkeypatch.setattr(documents, "document_positions", lambda ids: torch.arange(ids.shape[1]).expand_as(ids))
    assert packing_tasks.packed_logits(spec) > 1e-8  # positions that run on across documents are caught


@ci_only("flex_attention compiles its kernel on a CPU (17 s); SDPA's and eager's masks run in dev")
def test_flex_attention_block_masks(world_of_one):
    """flex_attention gets a block mask from transformers' mask interface (forward only: flex has no backward on a
    CPU, nor float64; float32, so 1e-5)."""
    spec = {**SPEC, "model": "bert_mlm", "attention": "flex_attention", "dtype": "float32"}
    assert packing_tasks.packed_logits(spec) < 1e-5


@pytest.mark.parametrize("family,cls,message", [
    ("bert", "BertForQuestionAnswering", "BertForQuestionAnswering's loss reads whole sequences"),
    ("llama", "LlamaForSequenceClassification", "LlamaForSequenceClassification's loss reads whole sequences"),
    ("bart", "BartForConditionalGeneration", "BartForConditionalGeneration computes absolute positions itself "
                                             r"\(model.encoder.embed_positions\) and takes no position_ids")])
def test_models_that_cannot_pack_are_refused_before_training(world_of_one, family, cls, message):
    model = shardlib.shard(inference_cases.make_model(cls, family) if family != "bert" else
                           bert_cases.make_model({"cls": cls, "seed": 0, "seq": 8, "config": packing_tasks.BERT}),
                           world_of_one)
    trainer = shardlib.Trainer(model, packing_tasks.adamw)
    with pytest.raises(ValueError, match=message):
        trainer.fit([{"input_ids": [3, 4]}], batch_size=1, max_steps=1, packing=8, progress=False)


# -- training across layouts on the pool ----------------------------------------------------------------------
BLOCKS = shardlib.Kernels(attention="blocks")
LAYOUTS = {"tp2": ({"tp": 2}, {}), "tp2_sp": ({"tp": 2}, {"sequence_parallel": True}),
           "ring_sp2": ({"sp": 2}, {"sequence_parallel": "ring"}), "pp2_dp2": ({"pp": 2, "dp": 2}, {}),
           "ring_sp4": ({"sp": 4}, {"sequence_parallel": "ring"}),
           "tp2_sp_blocks": ({"tp": 2}, {"sequence_parallel": True, "kernels": BLOCKS}),
           "a2a_sp2_blocks": ({"sp": 2}, {"sequence_parallel": "all_to_all", "kernels": BLOCKS})}
@pytest.mark.parametrize("kind", list(packing_tasks.CLASSES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_training_equals_padded_across_layouts(pool, layout, kind):
    mesh, options = LAYOUTS[layout]
    spec = {**SPEC, "model": kind, "layout": mesh, "shard": options}
    for result in pool.run(packing_tasks.packed_fit, spec):
        _check(result, kind)
        _masks_as_data(result, kind, "ring" in layout or "blocks" in layout, ring="ring" in layout)


def _masks_as_data(result: dict, kind: str, as_data: bool, ring: bool = False) -> None:
    """Ring and block attention take packed documents as data, never as a dense mask, except where T5's own
    [h, L, L] position bias goes to the attention (block attention without the ring: the inner implementation
    takes it, with the dense mask); every other layout builds none of shardlib's masks."""
    masks = result["masks"]
    if not as_data:
        assert not masks, masks
        return
    dense = {key for key in masks if key.startswith("dense")}
    assert masks.get("data") and dense <= ({"dense: position_bias"} if kind == "t5" and not ring else set()), masks


def test_packed_training_under_zero_and_activation_checkpointing(pool):
    spec = {**SPEC, "model": "bert_mlm", "layout": {"tp": 2}, "trainer": {"zero": 1, "activation_checkpointing": True}}
    for result in pool.run(packing_tasks.packed_fit, spec):
        _check(result, "bert_mlm")


def test_packed_training_from_an_iterable_at_dp4(pool):
    spec = {**SPEC, "model": "bert_mlm", "layout": {"dp": 4}, "iterable": True}
    for result in pool.run(packing_tasks.packed_fit, spec):
        _check(result, "bert_mlm")


def test_packed_training_under_zero3(pool):
    spec = {**SPEC, "model": "bert_cls", "layout": {"dp": 4}, "trainer": {"zero": 3}}
    for result in pool.run(packing_tasks.packed_fit, spec):
        _check(result, "bert_cls")


@ci_only("compiles BERT (5 s); the hook runs outside the graph either way, and every layout runs packed in dev")
def test_packed_training_compiled(world_of_one):
    """``Trainer(compile=True)``: the masks are built eagerly before the compiled forward (no graph break inside)."""
    spec = {**SPEC, "model": "bert_cls", "trainer": {"compile": True}}
    _check(packing_tasks.packed_fit(spec), "bert_cls")


def test_packed_batches_the_model_cannot_read_are_refused(world_of_one):
    def sharded(kind, **config):
        model = packing_tasks.make_model({"model": kind, "seed": 0})
        model.config.update(config)
        return shardlib.shard(model, world_of_one)

    rows = PackingCollator(8)([{"input_ids": [3, 4, 5], "labels": 1}, {"input_ids": [6, 7], "labels": 0}])
    trainer = shardlib.Trainer(sharded("bert_cls"), packing_tasks.adamw)
    with pytest.raises(ValueError, match="takes no attention_mask: the documents are the mask"):
        trainer.train_step({**rows, "attention_mask": torch.ones_like(rows["input_ids"])})
    with pytest.raises(ValueError, match="got torch.float32 labels for num_labels=3"):
        trainer.train_step({**rows, "labels": rows["labels"].float()})
    regression = shardlib.Trainer(sharded("bert_cls", num_labels=1), packing_tasks.adamw)
    with pytest.raises(ValueError, match="num_labels=1, problem_type=None"):
        regression.train_step(rows)
    t5 = shardlib.Trainer(sharded("t5"), packing_tasks.adamw)
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is a seq2seq model: a packed batch needs "
                                         "decoder_document_ids"):
        t5.train_step({"input_ids": rows["input_ids"], "document_ids": rows["document_ids"],
                       "labels": rows["input_ids"]})
    with pytest.raises(TypeError, match="packing must be a row length in tokens or a PackingCollator, got '128'"):
        trainer.fit([{"input_ids": [3]}], batch_size=1, max_steps=1, packing="128", progress=False)


@pytest.mark.parametrize("documents,visible", [
    ([16, 16, 16, 16], [True, False]),   # each quarter a document: rank 0 (quarters 0 and 3) never sees rank 1's
    ([24, 16, 24], [True, True]),         # a document across a segment boundary: both blocks
    ([64], [True, True])])                # one document: all of it
def test_the_ring_skips_blocks_of_other_documents(documents, visible):
    """Ring attention (sp=2, zigzag: rank 0 holds the first and last quarter) reads a packed row's mask and skips the
    key/value blocks none of its queries sees, so a document spanning ranks is computed and other documents are
    not."""
    from transformers import BertConfig

    from shardlib.kernels.mask_spec import MaskSpec
    from shardlib.kernels.ring_attention import _self_mask
    from shardlib.kernels.ring_blocks import RingGeometry, RingLayout, RingProblem
    from shardlib.sharding.documents import document_mask

    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(documents)])[None]
    mask = document_mask(BertConfig(attn_implementation="sdpa"), ids, ids, causal=False, dtype=torch.float32)
    layout, length = RingLayout(ranks=2, ring=2), ids.shape[1]
    geometry = RingGeometry(0, 2, layout.padded(length) // 2, length, layout.order(length, "cpu"))
    assert _self_mask(mask, geometry, torch.float32)[1] == visible  # a dense mask (transformers' fallback)
    problem = RingProblem(None, geometry, 1.0, torch.float32, spec=MaskSpec(ids, ids))  # the documents as data
    assert [bool(problem.pieces(src)) for src in range(2)] == visible


def test_gradient_accumulation_over_packed_batches(world_of_one):
    """``train_step([packed, packed])``: two packed batches of one global batch's samples (rows of different
    counts and widths) step as the padded global batch does, the loss normalized over both batches' items."""
    spec = {**SPEC, "model": "bert_mlm", "steps": 1}
    expected = packing_tasks.reference(spec)
    model = shardlib.shard(packing_tasks.make_model(spec), world_of_one)
    trainer = shardlib.Trainer(model, packing_tasks.adamw, max_grad_norm=packing_tasks.MAX_GRAD_NORM)
    data, collate = packing_tasks.samples(spec)[:spec["batch_size"]], PackingCollator(spec["budget"])
    loss = trainer.train_step([collate(data[:3]), collate(data[3:])])
    assert loss == pytest.approx(expected["losses"][0], rel=1e-12)
    state = shardlib.full_state_dict(model)
    for name, weight in expected["state"].items():
        if name in state and weight.is_floating_point():
            torch.testing.assert_close(state[name], weight, rtol=1e-10, atol=1e-12)


def test_a_sharded_model_takes_packed_rows_in_a_hand_loop(world_of_one):
    """``shard()`` installs the document hook, so ``model(**packed)`` is exact without the Trainer (transformers
    would otherwise take ``document_ids`` into its ``**kwargs`` silently and attend across documents), a padded batch
    after a packed one pools as HF does, and a model that cannot pack refuses the batch at its forward."""
    spec = {**SPEC, "model": "bert_cls"}
    data = packing_tasks.samples(spec)[:8]
    ref = packing_tasks.make_model(spec)
    model = shardlib.shard(packing_tasks.make_model(spec), world_of_one)
    padded = packing_tasks.padded(data, "bert_cls")
    with torch.no_grad():
        expected = float(ref(**padded).loss)
        assert float(model(**PackingCollator(16)(data)).loss) == pytest.approx(expected, rel=1e-12)
        assert float(model(**padded).loss) == pytest.approx(expected, rel=1e-12)
    qa = bert_cases.make_model({"cls": "BertForQuestionAnswering", "seed": 0, "seq": 8, "config": packing_tasks.BERT})
    qa = shardlib.shard(qa, world_of_one)
    with pytest.raises(ValueError, match="BertForQuestionAnswering's loss reads whole sequences"):
        qa(**PackingCollator(16)([{"input_ids": [3, 4]}]))


def test_the_document_hook_keeps_no_reference_cycle(world_of_one):
    """The model holds its document hooks; they hold it weakly, so a sharded model is freed when its last reference
    goes (a cycle kept it, with the threads its modules reach, alive into interpreter shutdown, where a rank of a
    finished run aborted: "terminate called without an active exception")."""
    import gc
    import weakref

    model = shardlib.shard(packing_tasks.make_model({**SPEC, "model": "bert_cls"}), world_of_one)
    freed = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert freed() is None
    finally:
        gc.enable()
