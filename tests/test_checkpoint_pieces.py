"""Data files that say which pieces they hold, and checkpoints this shardlib cannot read.

Each data file of a sharded checkpoint records in its own safetensors header (``__metadata__["pieces"]``) the global
shape and the rows of every tensor it holds; a load checks that against ``shardlib.json``. Swapping two same-size
piece files, with ``shardlib.json``'s file sizes, file checksums and own checksum recomputed, leaves nothing but
that record to notice: it is refused, naming the file, the tensor and both ranges. Files without the record (written
before it existed) still load bitwise. A checkpoint or train state of a newer format is refused naming both versions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

import shardlib
from shardlib import checkpoint as ckpt
from shardlib.checkpoint import format as fmt
from shardlib.parallel.mesh import OfflineMesh
from shardlib.train.checkpoints import TRAIN_STATE_FORMAT, foreign_reason

from checkpoint_helpers import CONFIG, hf_dir  # noqa: F401  (hf_dir: a fixture)


def _header(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (parsed) and its data bytes."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    """The file rewritten with ``header``, laid out as safetensors writes it (JSON padded with spaces to 8 bytes)."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def _reseal(directory: Path, **changes) -> None:
    """``shardlib.json`` with every file's size and checksum recomputed from the files as they are now and its own
    checksum too (``changes``: top-level fields to set first): only what the files themselves say can tell."""
    document = json.loads((directory / fmt.METADATA).read_text())
    for name in document["files"]:
        document["files"][name] = {"bytes": (directory / name).stat().st_size,
                                   "checksum": {"algorithm": "xxh3_128", "value": ckpt.checksum_of(directory / name)}}
    document.update(changes)
    (directory / fmt.METADATA).write_text(fmt.document_text(document))


def _loaded(directory: Path, config: dict = CONFIG) -> dict:
    model = shardlib.shard(BertForMaskedLM(BertConfig(**config)), OfflineMesh())
    ckpt.load(model, directory)
    return model.state_dict()


EVEN = {**CONFIG, "vocab_size": 64}  # every tensor splits evenly at tp=2: both rank files have the same size


@pytest.fixture
def even_hf_dir(tmp_path) -> Path:
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(**EVEN)).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize("pp", [1, 2], ids=["tp=2", "pp=2 x tp=2"])
def test_every_data_file_records_the_pieces_it_holds(hf_dir, tmp_path, pp):  # noqa: F811
    """Per file: each tensor's global shape and its piece (dim, start, stop) exactly as shardlib.json places it."""
    directory = ckpt.convert(hf_dir[0], tmp_path / "ck", tp=2, pp=pp)
    document = json.loads((directory / fmt.METADATA).read_text())
    for name in document["files"]:
        held = json.loads(_header(directory / name)[0]["__metadata__"]["pieces"])
        expected = {tensor: {"shape": entry["shape"], **{k: v for k, v in p.items() if k != "file"}}
                    for tensor, entry in document["tensors"].items() for p in entry["pieces"] if p["file"] == name}
        assert held == expected and held, name


def test_a_save_records_its_pieces_too(tmp_path):
    model = shardlib.shard(BertForMaskedLM(BertConfig(**CONFIG)), OfflineMesh())
    directory = ckpt.save(model, tmp_path / "ck")
    held = json.loads(_header(directory / fmt.REPLICATED_FILE)[0]["__metadata__"]["pieces"])
    assert held["bert.embeddings.word_embeddings.weight"] == {"shape": [61, 16], "dim": None, "start": 0, "stop": 0}


@pytest.mark.parametrize("pp", [1, 2], ids=["tp=2", "pp=2 x tp=2"])
def test_two_swapped_pieces_are_refused_naming_the_file_the_tensor_and_both_ranges(even_hf_dir, tmp_path, pp):
    directory = ckpt.convert(even_hf_dir, tmp_path / "ck", tp=2, pp=pp)
    stage = "" if pp == 1 else "-pp00"
    first, second = (directory / f"model{stage}-tp{r:02d}-of-02.safetensors" for r in (0, 1))
    shapes = [{k: v["shape"] for k, v in _header(f)[0].items() if k != "__metadata__"} for f in (first, second)]
    assert shapes[0] == shapes[1]  # same-size pieces: only the rows they hold differ (and the headers' digits)
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    _reseal(directory)
    refusal = (r"(?P<file>\S+): holds rows \[(?P<a>\d+), (?P<b>\d+)\) of dim 0 of shape \[(?P<shape>[\d, ]+)\] of "
               r"tensor '(?P<tensor>[^']+)' \(its header\), but shardlib.json places rows \[(?P<c>\d+), (?P<d>\d+)\) "
               r"of dim 0 of shape \[(?P=shape)\] of it in this file \(files swapped or renamed\?\)$")
    with pytest.raises(ckpt.CheckpointError) as info:
        _loaded(directory, EVEN)
    found = re.match(refusal, str(info.value))
    assert found and found["file"] in (str(first), str(second)), str(info.value)
    rows = int(found["shape"].split(",")[0]) // 2
    swapped = {found["file"]: ((found["a"], found["b"]), (found["c"], found["d"]))}
    half, other = ("0", str(rows)), (str(rows), str(2 * rows))
    assert swapped in ({str(first): (other, half)}, {str(second): (half, other)}), str(info.value)
    problems = ckpt.ShardedCheckpoint(directory).problems()  # `shardlib verify` says it too, for both files
    assert {re.match(refusal, p)["file"] for p in problems if re.match(refusal, p)} == {str(first), str(second)}


def test_files_without_the_record_still_load_bitwise(hf_dir, tmp_path):  # noqa: F811
    """Files as written before they recorded their pieces (no ``pieces`` in the header), under a v3 document and
    under a v2 one (no document checksum): both load bitwise, and verify finds nothing wrong."""
    src, original = hf_dir
    directory = ckpt.convert(src, tmp_path / "ck", tp=2)
    for path in directory.glob("*.safetensors"):
        header, data = _header(path)
        del header["__metadata__"]["pieces"]
        _write_header(path, header, data)
    _reseal(directory)
    for version in ("v3", "v2"):
        if version == "v2":
            document = json.loads((directory / fmt.METADATA).read_text())
            del document["metadata_checksum"]
            (directory / fmt.METADATA).write_text(json.dumps({**document, "format": "shardlib-sharded-v2"}))
        assert ckpt.ShardedCheckpoint(directory).problems() == [], version
        loaded = _loaded(directory)
        for name, value in original.state_dict().items():
            assert torch.equal(loaded[name], value), (version, name)


def test_a_newer_format_is_refused_naming_both_versions(hf_dir, tmp_path):  # noqa: F811
    directory = ckpt.convert(hf_dir[0], tmp_path / "ck", tp=1)
    _reseal(directory)
    text = (directory / fmt.METADATA).read_text().replace('"shardlib-sharded-v3"', '"shardlib-sharded-v4"')
    (directory / fmt.METADATA).write_text(text)
    expected = (r"shardlib.json: format 'shardlib-sharded-v4' was written by a newer shardlib; this one reads "
                r"shardlib-sharded up to 'shardlib-sharded-v3' \(upgrade shardlib to read it\)")
    with pytest.raises(ckpt.CheckpointError, match=expected):
        _loaded(directory)
    with pytest.raises(ckpt.CheckpointError, match=expected):
        ckpt.from_sharded(BertForMaskedLM, directory, OfflineMesh())
    text = text.replace('"shardlib-sharded-v4"', '"shardlib-sharded-v0"')  # not newer: the list of those it reads
    (directory / fmt.METADATA).write_text(text)
    with pytest.raises(ckpt.CheckpointError, match="format 'shardlib-sharded-v0', expected one of shardlib-sharded-v1"):
        _loaded(directory)


def test_a_newer_train_state_is_refused_naming_both_versions():
    model = BertForMaskedLM(BertConfig(**CONFIG))
    meta = {"model_class": "BertForMaskedLM", "config": json.loads(json.dumps(model.config.to_dict(), default=str))}
    assert foreign_reason({**meta, "train": {"format": TRAIN_STATE_FORMAT}}, model) is None
    reason = foreign_reason({**meta, "train": {"format": "shardlib-train-state-v2"}}, model)
    assert reason == ("its train state's format 'shardlib-train-state-v2' was written by a newer shardlib; this one "
                      "reads shardlib-train-state up to 'shardlib-train-state-v1' (upgrade shardlib to read it)")
    assert "no train state" in foreign_reason(meta, model)
