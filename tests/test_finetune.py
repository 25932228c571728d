"""What a fine-tuning user coming from transformers expects (issue 28): ``from_pretrained`` with config overrides,
``config=``, shard options told apart by name, Auto classes; the missing / extra tensor warning once, on rank 0,
through the ``shardlib.checkpoint`` logger; a final checkpoint from every ``fit`` with a ``save_dir``; one line when
``resume="auto"`` finds nothing; ``save_pretrained`` replacing an existing export as transformers does."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from transformers import (
    AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification, BertModel,
)

import finetune_tasks
import shardlib
from shardlib.parallel.mesh import OfflineMesh

BASE = finetune_tasks.BASE


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    """A BertModel checkpoint written by transformers (a base model: no head)."""
    path = tmp_path_factory.mktemp("finetune") / "base"
    torch.manual_seed(0)
    BertModel(BertConfig(**BASE)).save_pretrained(path)
    return path


def test_config_overrides_build_the_head_they_name(base_checkpoint):
    """``num_labels`` (transformers' setter rebuilds id2label), ``problem_type`` and a dropout, as HF takes them;
    the checkpoint's config.json on disk is not touched."""
    before = (base_checkpoint / "config.json").read_text()
    model = shardlib.from_pretrained(BertForSequenceClassification, base_checkpoint, OfflineMesh(), strict=False,
                                     num_labels=5, problem_type="multi_label_classification",
                                     hidden_dropout_prob=0.0)
    assert model.classifier.weight.shape == (5, BASE["hidden_size"]) and len(model.config.id2label) == 5
    assert model.config.problem_type == "multi_label_classification" and model.config.hidden_dropout_prob == 0.0
    assert (base_checkpoint / "config.json").read_text() == before
    reference = BertModel.from_pretrained(base_checkpoint).state_dict()
    for name, value in model.bert.state_dict().items():
        assert torch.equal(value, reference[name]), name


def test_config_argument_replaces_the_checkpoints_and_is_not_modified(base_checkpoint):
    config = BertConfig(**BASE, num_labels=3)
    model = shardlib.from_pretrained(BertForSequenceClassification, base_checkpoint, OfflineMesh(), config=config,
                                     strict=False, classifier_dropout=0.25)
    assert model.classifier.weight.shape[0] == 3 and model.config.classifier_dropout == 0.25
    assert config.classifier_dropout is None  # the caller's config object is left as it was


def test_an_auto_class_with_an_override(base_checkpoint):
    model = shardlib.from_pretrained(AutoModelForSequenceClassification, base_checkpoint, OfflineMesh(),
                                     strict=False, num_labels=4)
    assert type(model) is BertForSequenceClassification and model.classifier.out_features == 4


def test_shard_options_by_name_or_in_shard_and_unknown_keywords_refused(base_checkpoint):
    by_name = shardlib.from_pretrained(BertForSequenceClassification, base_checkpoint, OfflineMesh(), strict=False,
                                       gather_logits=True, num_labels=2)
    in_dict = shardlib.from_pretrained(BertForSequenceClassification, base_checkpoint, OfflineMesh(), strict=False,
                                       shard=dict(gather_logits=True), num_labels=2)
    assert shardlib.shard_state(by_name).report.policy == shardlib.shard_state(in_dict).report.policy == "bert"
    with pytest.raises(TypeError, match=r"'num_lables' is neither an attribute of BertConfig nor a shard option "
                                        r"\(.*sequence_parallel"):
        shardlib.from_pretrained(BertForSequenceClassification, base_checkpoint, OfflineMesh(), num_lables=2)
    with pytest.raises(TypeError, match="shard option 'gather_logits' given twice"):
        shardlib.from_pretrained(BertForSequenceClassification, base_checkpoint, OfflineMesh(), gather_logits=True,
                                 shard=dict(gather_logits=False))


def test_missing_tensors_are_logged_once_on_rank_zero_only_and_initialized_alike(pool, tmp_path):
    """tp=2 x dp=2: the same names on every rank, so one record on rank 0's ``shardlib.checkpoint`` logger, no
    ``warnings`` (whose prefix and source line every rank printed before) and nothing on the other ranks. The new
    head is the same on every rank although the dp replicas' generators were seeded differently (before, each rank
    drew its own replicated classifier and the copies trained apart: 0.05 apart after one step, found by
    examples/finetune_head.py)."""
    results = pool.run(finetune_tasks.head_from_base_checkpoint, str(tmp_path))
    first, *others = results
    missing = [m for m in first["logged"] if "missing from" in m]
    assert len(missing) == 1 and missing[0].startswith("shardlib.checkpoint WARNING: 2 tensor(s) of "
                                                       "BertForSequenceClassification missing")
    assert "classifier.weight" in missing[0] and "classifier.bias" in missing[0]
    assert all(not [m for m in r["logged"] if "tensor(s)" in m] for r in others)
    assert all(not [w for w in r["warned"] if "tensor(s)" in w] for r in results)
    assert all(r["classifier"] == first["classifier"] and r["num_labels"] == 5 for r in results)
    assert len(first["classifier"]) == 5 + 1  # 5 labels' weight rows, then the bias


def test_training_tp_ranks_whose_generators_differ_is_refused(pool):
    """Unseeded ranks (or ranks seeded apart) would draw different replicated dropout masks and train apart: the
    Trainer refuses them (``shard`` does not: loading for inference needs no common seed)."""
    messages = pool.run(finetune_tasks.trainer_with_generators_apart)
    assert all("default generator is not in the same state on every rank of the tp group" in m and
               "torch.manual_seed(seed)" in m for m in messages), messages


# ---------------------------------------------------------------------------------------------------------- fit
@pytest.fixture
def trainer():
    """A tiny BERT classifier on a world of one (an in-process gloo group, destroyed afterwards)."""
    mesh = shardlib.init_mesh()
    torch.manual_seed(0)
    model = shardlib.shard(BertForSequenceClassification(BertConfig(**BASE, num_labels=2)), mesh)
    try:
        yield shardlib.Trainer(model, lambda params: torch.optim.SGD(params, lr=0.1))
    finally:
        dist.destroy_process_group()


def samples(n: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, BASE["vocab_size"], (6,), generator=g),
             "labels": torch.randint(0, 2, (), generator=g)} for _ in range(n)]


def test_fit_with_a_save_dir_ends_with_a_checkpoint_without_save_interval(trainer, tmp_path):
    result = trainer.fit(samples(), batch_size=4, max_steps=3, save_dir=tmp_path, progress=False)
    assert [p.name for p in result.checkpoints] == ["step-00000003"]
    again = trainer.fit(samples(), batch_size=4, max_steps=5, save_dir=tmp_path, resume="auto", progress=False)
    assert again.first_step == 3 and again.resumed_from == result.checkpoints[0]


def test_sigterm_on_one_rank_saves_the_step_on_all_and_exits_143(pool, tmp_path):
    """A launcher's SIGTERM reaching rank 0 during step 3: every rank finishes the step, step 3 is saved, every rank
    leaves fit with SystemExit(143), and fit's handler is gone again."""
    results = pool.run(finetune_tasks.fit_until_sigterm, str(tmp_path))
    assert all(r == {"status": 143, "handler_restored": True, "checkpoints": ["step-00000003"]} for r in results), \
        results


def test_resume_auto_without_a_checkpoint_says_it_starts_fresh(trainer, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="shardlib.train"):
        result = trainer.fit(samples(), batch_size=4, max_steps=1, save_dir=tmp_path, resume="auto",
                             progress=False)
    lines = [r.getMessage() for r in caplog.records if "resume='auto'" in r.getMessage()]
    assert result.first_step == 0 and lines == [f"resume='auto': no complete checkpoint in "
                                                f"{tmp_path / 'checkpoints'}; starting at step 0"]


@pytest.mark.parametrize("kind, shuffle", [("dataset", True), ("iterable", False)])
def test_fit_takes_hf_datasets_in_the_same_global_order_as_a_list(pool, kind, shuffle):
    """A ``datasets.Dataset`` (``with_format("torch")``) is map-style: the same seeded global order as a list of
    the same samples; an ``IterableDataset`` is read in its own order (as every iterable is), so it equals the
    list without shuffling. dp=2 x tp=2, float64: identical losses over 5 steps (24 samples: into a second
    epoch)."""
    pytest.importorskip("datasets")  # the test extra installs it
    expected = pool.run(finetune_tasks.fit_on, "list", shuffle)[0]
    got = pool.run(finetune_tasks.fit_on, kind, shuffle)
    assert all(r == expected for r in got) and len(expected) == 5
