"""HF-faithful checkpoints (single process): exports that are what ``save_pretrained`` writes, source tensors the
model does not own carried through bitwise, loads that refuse to do less than asked, ``shardlib.save_pretrained``
/ ``from_pretrained`` at the top level, and the recovery of what a killed writer left."""

import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel, T5Config, T5ForConditionalGeneration,
)

import shardlib
from shardlib import checkpoint as ckpt
from shardlib import cli
from shardlib.checkpoint import atomic
from shardlib.parallel.mesh import OfflineMesh

from checkpoint_helpers import CONFIG, hf_dir  # noqa: F401  (hf_dir: a fixture)

T5_CONFIG = dict(vocab_size=45, d_model=12, d_kv=4, num_heads=4, d_ff=16, num_layers=2, decoder_start_token_id=0)


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_hf_sharded_hf_round_trip_carries_tensors_the_model_does_not_own(hf_dir, tmp_path, capsys):  # noqa: F811
    """An HF checkpoint with a tensor BERT no longer has (an old ``embeddings.position_ids``): carried through
    convert (tp=2), a reshard (tp=1) and the export, every source tensor back bitwise; inspect lists it."""
    src, _ = hf_dir
    state = load_file(str(src / "model.safetensors"))
    state["bert.embeddings.position_ids"] = torch.arange(32).unsqueeze(0)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    sharded = ckpt.convert(src, tmp_path / "tp2", tp=2)
    entry = json.loads((sharded / "shardlib.json").read_text())["tensors"]["bert.embeddings.position_ids"]
    assert entry["carried"] is True and entry["pieces"][0]["dim"] is None
    assert cli.main(["inspect", str(sharded)]) == 0
    assert re.search(r"bert\.embeddings\.position_ids .* carried \(not a model tensor\)", capsys.readouterr().out)
    resharded = ckpt.convert(sharded, tmp_path / "tp1", tp=1)
    out = ckpt.export_hf(resharded, tmp_path / "hf-again")
    _assert_same_tensors(_tensors(out), state)
    model = BertForMaskedLM(BertConfig(**CONFIG))
    shardlib.shard(model, OfflineMesh(tp=2, tp_rank=1))
    ckpt.load(model, sharded)  # a carried tensor is not an extra one


def test_export_is_what_save_pretrained_writes(tmp_path):
    """A config-built T5 (tied, generating), exported in several files: config.json by transformers (architectures,
    transformers_version), generation_config.json, an index with metadata.total_size; transformers loads it, and
    converting the export again works."""
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(**T5_CONFIG))
    model.save_pretrained(tmp_path / "hf", max_shard_size="4KB")
    reference = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    sharded = ckpt.convert(tmp_path / "hf", tmp_path / "sharded", tp=2)
    out = ckpt.export_hf(sharded, tmp_path / "export", max_shard_bytes=4096)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["T5ForConditionalGeneration"] and "transformers_version" in config
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == reference["metadata"]["total_size"]
    assert set(index["weight_map"]) == set(reference["weight_map"])
    _assert_same_tensors(_tensors(out), _tensors(tmp_path / "hf"))
    reloaded = T5ForConditionalGeneration.from_pretrained(out)
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    ckpt.convert(out, tmp_path / "again", tp=4)  # an export converts again (it names its class)


def test_export_of_a_config_built_model_converts_again(tmp_path):
    model = BertForMaskedLM(BertConfig(**CONFIG))
    shardlib.shard(model, OfflineMesh())
    ckpt.save(model, tmp_path / "sharded")
    out = ckpt.export_hf(tmp_path / "sharded", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    assert not (out / "generation_config.json").exists()  # BERT does not generate
    ckpt.convert(out, tmp_path / "tp2", tp=2)


def _deeper_checkpoint(tmp_path):
    """A sharded checkpoint of a 4-layer BERT, and a 2-layer model to load it into."""
    deep = BertForMaskedLM(BertConfig(**{**CONFIG, "num_hidden_layers": 4}))
    shardlib.shard(deep, OfflineMesh())
    ckpt.save(deep, tmp_path / "deep")
    shallow = BertForMaskedLM(BertConfig(**CONFIG))
    shardlib.shard(shallow, OfflineMesh())
    return tmp_path / "deep", shallow, deep


def _warned(caplog, pattern: str) -> list[str]:
    """The warnings of the ``shardlib.checkpoint`` logger matching ``pattern`` (one line each, no warnings prefix)."""
    return [r.getMessage() for r in caplog.records
            if r.name == "shardlib.checkpoint" and r.levelno == logging.WARNING and re.search(pattern, r.getMessage())]


def test_load_refuses_a_checkpoint_with_tensors_the_model_lacks(tmp_path, caplog):
    directory, shallow, deep = _deeper_checkpoint(tmp_path)
    before = {k: v.clone() for k, v in shallow.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match=r"32 tensor\(s\) in .*deep that BertForMaskedLM does not have: "
                                                   r"bert\.encoder\.layer\.2\..*strict=False"):
        ckpt.load(shallow, directory)
    for k, v in shallow.state_dict().items():  # refused before any read
        assert torch.equal(v, before[k]), k
    with caplog.at_level(logging.WARNING, logger="shardlib.checkpoint"):
        ckpt.load(shallow, directory, strict=False)
    assert _warned(caplog, r"32 tensor\(s\) .* \(skipped\): bert\.encoder\.layer\.2\.")
    deep_state = deep.state_dict()
    for k, v in shallow.state_dict().items():
        assert torch.equal(v, deep_state[k]), k


def test_load_strict_false_names_missing_tensors(tmp_path, caplog):
    shallow = BertForMaskedLM(BertConfig(**CONFIG))
    shardlib.shard(shallow, OfflineMesh())
    ckpt.save(shallow, tmp_path / "shallow")
    deep = BertForMaskedLM(BertConfig(**{**CONFIG, "num_hidden_layers": 4}))
    shardlib.shard(deep, OfflineMesh())
    with pytest.raises(ckpt.CheckpointError, match=r"missing from .*shallow: bert\.encoder\.layer\.2\."):
        ckpt.load(deep, tmp_path / "shallow")
    with caplog.at_level(logging.WARNING, logger="shardlib.checkpoint"):
        ckpt.load(deep, tmp_path / "shallow", strict=False)
    assert _warned(caplog, r"missing from .*shallow \(left as initialized\)")


def test_from_pretrained_fine_tunes_a_head_from_a_base_checkpoint_only_when_asked(tmp_path, caplog):
    """A BertModel checkpoint into BertForSequenceClassification: refused by default (the classifier is missing,
    the checkpoint has tensors the class names otherwise), with ``strict=False`` loaded with a warning that names
    the classifier, which keeps HF's initialization (finite, not zero-filled memory)."""
    torch.manual_seed(0)
    BertModel(BertConfig(**CONFIG)).save_pretrained(tmp_path / "base")
    with pytest.raises(ckpt.CheckpointError, match=r"missing from .*classifier\.weight"):
        shardlib.from_pretrained(BertForSequenceClassification, tmp_path / "base", OfflineMesh())
    with caplog.at_level(logging.WARNING, logger="shardlib.checkpoint"):
        model = shardlib.from_pretrained(BertForSequenceClassification, tmp_path / "base", OfflineMesh(),
                                         strict=False)
    assert [r.name for r in caplog.records if "classifier.weight" in r.getMessage()] == ["shardlib.checkpoint"]
    assert torch.isfinite(model.classifier.weight).all() and model.classifier.weight.abs().sum() > 0
    base = BertModel.from_pretrained(tmp_path / "base").state_dict()
    for name, value in base.items():
        assert torch.equal(model.bert.state_dict()[name], value), name


def test_top_level_from_pretrained_with_torch_dtype_and_save_pretrained(hf_dir, tmp_path):  # noqa: F811
    src, original = hf_dir
    model = shardlib.from_pretrained(BertForMaskedLM, src, OfflineMesh(), torch_dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    expected = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in original.state_dict().items()}
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    out = shardlib.save_pretrained(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = BertForMaskedLM.from_pretrained(out, dtype=torch.bfloat16)
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, expected[k]), k
    with pytest.raises(ckpt.CheckpointError, match="exists; pass overwrite=True"):
        shardlib.save_pretrained(model, out, overwrite=False)
    (out / "stale.txt").write_text("from an older save")
    assert shardlib.save_pretrained(model, out) == out  # replaced by default, as transformers does: atomically
    assert not (out / "stale.txt").exists() and BertForMaskedLM.from_pretrained(out, dtype=torch.bfloat16)
    assert not list(tmp_path.glob(".bf16.*"))  # neither staging nor scratch left behind


# ------------------------------------------------------------------------------ what a killed writer leaves
def _checkpoint(tmp_path, name="ck", scale=1.0):
    model = BertForMaskedLM(BertConfig(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(scale)
    shardlib.shard(model, OfflineMesh())
    return ckpt.save(model, tmp_path / name, overwrite=True), model


def test_a_save_killed_between_its_renames_is_finished_by_the_next_load(tmp_path):
    """The old checkpoint moved aside, the new one complete in its staging directory, nothing under the name:
    opening it renames the complete staging directory into place (the newer copy) and removes the old one."""
    directory, _ = _checkpoint(tmp_path, scale=1.0)
    staged, _ = _checkpoint(tmp_path, "staged", scale=2.0)
    directory.rename(tmp_path / ".ck.old-1234abcd")
    staged.rename(tmp_path / ".ck.tmp-5678")
    assert ckpt.ShardedCheckpoint(directory).problems() == []
    model = BertForMaskedLM(BertConfig(**CONFIG))
    shardlib.shard(model, OfflineMesh())
    ckpt.load(model, directory)
    assert all((p == 2.0).all() for p in model.parameters())
    ckpt.save(model, directory, overwrite=True)  # the next save cleans the rest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_only_the_old_copy_left_is_restored_and_an_incomplete_staging_never_taken(tmp_path):
    directory, _ = _checkpoint(tmp_path, scale=3.0)
    directory.rename(tmp_path / ".ck.old-00000000")
    partial = tmp_path / ".ck.tmp-deadbeef"
    partial.mkdir()
    (partial / "model-replicated.safetensors").write_bytes(b"\0" * 100)  # no shardlib.json: incomplete
    assert atomic.recover(directory) == ["restored %s from .ck.old-00000000" % directory,
                                         "removed .ck.tmp-deadbeef"]
    model = BertForMaskedLM(BertConfig(**CONFIG))
    shardlib.shard(model, OfflineMesh())
    ckpt.load(model, directory)
    assert all((p == 3.0).all() for p in model.parameters())


def test_a_partial_directory_is_never_a_checkpoint(tmp_path):
    partial = tmp_path / ".ck.tmp-deadbeef"
    partial.mkdir()
    with pytest.raises(ckpt.CheckpointError, match="no shardlib.json"):
        ckpt.ShardedCheckpoint(partial)
    with pytest.raises(ckpt.CheckpointError, match="no shardlib.json"):
        ckpt.ShardedCheckpoint(tmp_path / "ck")
    assert not partial.exists()  # opening ck found and removed its incomplete staging directory


def test_export_and_convert_clean_what_a_killed_run_left(hf_dir, tmp_path):  # noqa: F811
    src, _ = hf_dir
    for name in (".out.tmp-1", ".out.scratch", "..out.scratch.tmp-3"):  # incomplete staging, a writer's scratch
        (tmp_path / name).mkdir()
    ckpt.convert(src, tmp_path / "out", tp=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]
    (tmp_path / ".hf2.tmp-1").mkdir()
    (tmp_path / ".hf2.tmp-1" / ".complete").touch()  # a finished export killed before its rename
    (tmp_path / ".hf2.tmp-1" / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    assert atomic.recover(tmp_path / "hf2") == [f"restored {tmp_path / 'hf2'} from .hf2.tmp-1"]


def test_a_refused_hf_load_reads_nothing_into_the_model(tmp_path):
    """An HF checkpoint with extra tensors (4 layers into 2): refused before the first read, the model as it was."""
    BertForMaskedLM(BertConfig(**{**CONFIG, "num_hidden_layers": 4})).save_pretrained(tmp_path / "deep")
    model = BertForMaskedLM(BertConfig(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(5.0)
    shardlib.shard(model, OfflineMesh())
    with ckpt.SafetensorsFiles(tmp_path / "deep") as files, \
            pytest.raises(ckpt.CheckpointError, match=r"that BertForMaskedLM does not have: bert\.encoder\.layer\.2"):
        ckpt.load_hf_weights(model, files)
    assert all((p == 5.0).all() for p in model.parameters())
