"""Checkpoints of blocked layouts (a fused projection: GPT-2's ``c_attn``, q, k and v side by side, each split by
head): each rank stores its rows of every block as one tensor, and any reader layout (blocked or not, any tp) reads
them back, as does an HF file of whole tensors; conversion writes the same files.

No process group: each rank's model is sharded offline (``tp_size``, ``tp_rank``, ``group=None``), and the save and
load code is called for that rank (:func:`saving._rank_file_tensors` and :func:`saving._publish` as ``save`` calls
them, :func:`loading._read_local` as ``load`` reads a tensor).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

from shardlib.checkpoint import ShardedCheckpoint
from shardlib.checkpoint.conversion import _write_stage
from shardlib.checkpoint.format import METADATA, document_problems, tensor_entry, write_document
from shardlib.checkpoint.loading import _read_local
from shardlib.checkpoint.saving import _publish, _rank_file_tensors, _write_files
from shardlib.checkpoint.tensors import fill_local
from shardlib.parallel.layers import ColumnParallelLinear
from shardlib.parallel.layout import Layout, layout_of
from shardlib.safetensors_io import SafetensorsFiles, Writer, base as sio_base, copy_rows

HIDDEN, BLOCKS = 4, 3  # q, k, v of 4 features each: tp 1, 2 and 4 divide every block


class Fused(nn.Module):
    """A fused q/k/v projection and a replicated norm."""

    def __init__(self, conv1d: bool):
        super().__init__()
        self.proj = Conv1D(BLOCKS * HIDDEN, HIDDEN) if conv1d else nn.Linear(HIDDEN, BLOCKS * HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)


@pytest.fixture(params=[False, True], ids=["linear", "conv1d"])
def full(request):
    """The unsharded model, every tensor distinct (a misplaced row cannot go unnoticed)."""
    torch.manual_seed(0)
    model = Fused(conv1d=request.param)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    return model


def sharded(full: Fused, tp: int, rank: int, blocks: int = BLOCKS) -> Fused:
    """Rank ``rank``'s model at ``tp``: the projection column-parallel in ``blocks`` blocks."""
    model = copy.deepcopy(full)
    model.proj = ColumnParallelLinear(full.proj, None, blocks=blocks, tp_size=tp, tp_rank=rank)
    return model


def layouts(model: nn.Module) -> dict[str, Layout]:
    return {name: layout_of(model, name) for name, _ in model.named_parameters()}


def save_ranks(full: Fused, tp: int, directory, blocks: int = BLOCKS):
    """What ``save`` writes at ``tp``: each rank's files, then rank 0's ``shardlib.json`` and the atomic rename."""
    tmp = directory.with_name(f".{directory.name}.tmp")
    tmp.mkdir()
    gathered = []
    for rank in range(tp):
        files, meta = _rank_file_tensors(sharded(full, tp, rank, blocks), rank)
        gathered.append((_write_files(tmp, files) if files else {}, meta, None))
    document = {"model_class": "Fused", "config": {}, "tp": tp, "optimizer": None}
    assert _publish(tmp, directory, gathered, document) == ""
    return directory


def assert_reads_back(directory, full: Fused, reader_layouts: dict[str, Layout], tp: int) -> None:
    """Every rank of a ``reader_layouts`` model at ``tp`` reads exactly its shard of every unsharded tensor."""
    whole = dict(full.named_parameters())
    with ShardedCheckpoint(directory) as ckpt:
        for name, layout in reader_layouts.items():
            for rank in range(tp):
                got = _read_local(ckpt, name, layout, rank, torch.float32)
                assert torch.equal(got, layout.shard(whole[name].detach(), rank)), (name, tp, rank)


def convert_ranks(source, layouts_at: dict[str, Layout], tp: int, directory):
    """What ``convert`` writes for these layouts from ``source`` (an HF directory or a sharded checkpoint)."""
    tmp = directory.with_name(f".{directory.name}.tmp")
    tmp.mkdir()
    entries = [([name], layout, source.dtype(name), None, name) for name, layout in layouts_at.items()]
    with Writer(tmp) as writer:
        _write_stage(writer, source, entries, None, tp, None)
        written = writer.finish()
    tensors = {name: tensor_entry(layout, source.dtype(name), []) for name, layout in layouts_at.items()}
    write_document(tmp, {"model_class": "Fused", "config": {}, "tp": tp, "tensors": tensors, "files": written})
    tmp.rename(directory)
    return directory


def hf_file(full: Fused, directory):
    directory.mkdir()
    save_file({n: p.detach().contiguous() for n, p in full.named_parameters()}, str(directory / "model.safetensors"))
    return directory


# --------------------------------------------------------------------------------------------------- saving
def test_a_rank_stores_its_rows_of_every_block_as_one_tensor(full, tmp_path):
    directory = save_ranks(full, 2, tmp_path / "ck")
    meta = json.loads((directory / METADATA).read_text())["tensors"]
    weight, bias = meta["proj.weight"], meta["proj.bias"]
    dim = 1 if isinstance(full.proj, Conv1D) else 0
    assert weight["layout"]["blocks"] == 3 and weight["pieces"] == [
        {"file": "model-tp00-of-02.safetensors", "dim": dim, "start": 0, "stop": 2, "blocks": 3},
        {"file": "model-tp01-of-02.safetensors", "dim": dim, "start": 2, "stop": 4, "blocks": 3}]
    assert bias["pieces"][1] == {"file": "model-tp01-of-02.safetensors", "dim": 0, "start": 2, "stop": 4, "blocks": 3}
    assert "blocks" not in meta["norm.weight"]["layout"]
    stored = load_file(str(directory / "model-tp01-of-02.safetensors"))["proj.weight"]
    rows = torch.cat([full.proj.weight.detach().narrow(dim, a, 2) for a in (2, 6, 10)], dim)  # k's, v's rows too
    assert torch.equal(stored, rows)


# --------------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("tp_saved", [1, 2, 4])
@pytest.mark.parametrize("tp_read", [1, 2, 4])
def test_blocked_checkpoint_reads_back_at_any_tp(full, tmp_path, tp_saved, tp_read):
    directory = save_ranks(full, tp_saved, tmp_path / "ck")
    assert_reads_back(directory, full, layouts(sharded(full, tp_read, 0)), tp_read)


def test_blocked_checkpoint_reads_into_an_unsharded_model_and_other_layouts(full, tmp_path):
    directory = save_ranks(full, 2, tmp_path / "ck")
    assert_reads_back(directory, full, layouts(full), 1)  # plain module: replicated layouts, whole tensors
    assert_reads_back(directory, full, layouts(sharded(full, 4, 0, blocks=1)), 4)  # unblocked column split
    shape = tuple(full.proj.weight.shape)
    across = 1 - (1 if isinstance(full.proj, Conv1D) else 0)  # the other dim than the stored pieces'
    assert_reads_back(directory, full, {"proj.weight": Layout(shape, shard_dim=across, num_shards=2)}, 2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_unblocked_checkpoint_reads_into_blocked_shards(full, tmp_path, tp):
    directory = save_ranks(full, 2, tmp_path / "ck", blocks=1)
    assert_reads_back(directory, full, layouts(sharded(full, tp, 0)), tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hf_file_of_whole_tensors_reads_into_blocked_shards(full, tmp_path, tp):
    layout_at = layouts(sharded(full, tp, 0))
    whole = dict(full.named_parameters())
    with SafetensorsFiles(hf_file(full, tmp_path / "hf")) as files:
        for name, layout in layout_at.items():
            for rank in range(tp):
                out = torch.empty(layout.local_shape)
                fill_local(lambda d, a, b, view: files.read_into(name, view, d, a, b), layout, rank, out, name)
                assert torch.equal(out, layout.shard(whole[name].detach(), rank)), (name, rank)


@pytest.mark.parametrize("tp", [2, 4])
def test_unblocked_metadata_is_unchanged_and_still_loads(full, tmp_path, tp):
    """Without blocks nothing new is written (checkpoints of earlier versions look the same) and it all reads."""
    directory = save_ranks(full, tp, tmp_path / "ck", blocks=1)
    assert "blocks" not in (directory / METADATA).read_text()
    for tp_read in (1, 2, 4):
        assert_reads_back(directory, full, layouts(sharded(full, tp_read, 0, blocks=1)), tp_read)


# --------------------------------------------------------------------------------------------------- convert
@pytest.mark.parametrize("block", [None, 100], ids=["one-block", "small-blocks"])
@pytest.mark.parametrize("tp", [2, 4])
def test_convert_writes_the_files_save_writes(full, tmp_path, monkeypatch, tp, block):
    """HF -> blocked shards, and those -> blocked shards at another tp and -> an HF tensor (as ``export_hf`` copies
    it): the rank files hold exactly what a live save stores; in small blocks too (several rows per block)."""
    if block is not None:
        monkeypatch.setattr(sio_base, "BLOCK", block)
    saved = save_ranks(full, tp, tmp_path / "saved")
    layout_at = layouts(sharded(full, tp, 0))
    with SafetensorsFiles(hf_file(full, tmp_path / "hf")) as hf:
        converted = convert_ranks(hf, layout_at, tp, tmp_path / "converted")
    for rank in range(tp):
        file = f"model-tp{rank:02d}-of-{tp:02d}.safetensors"
        ours, theirs = load_file(str(saved / file)), load_file(str(converted / file))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), rank
    other = 6 - tp  # 2 <-> 4
    with ShardedCheckpoint(converted) as ckpt:
        resharded = convert_ranks(ckpt, layouts(sharded(full, other, 0)), other, tmp_path / "resharded")
    assert_reads_back(resharded, full, layouts(sharded(full, other, 0)), other)
    assert_exports_whole(converted, full, tmp_path)


def assert_exports_whole(directory, full: Fused, tmp_path) -> None:
    whole = dict(full.named_parameters())
    (tmp_path / "hf-out").mkdir()
    with ShardedCheckpoint(directory) as ckpt, Writer(tmp_path / "hf-out") as writer:
        shapes = {name: ckpt.shape(name) for name in whole}
        out = writer.open("model.safetensors", [(n, torch.float32, s) for n, s in shapes.items()], {"format": "pt"})
        for name in out.order:
            copy_rows(writer, ckpt, name, shapes[name], torch.float32, 0, shapes[name][0], out)
        writer.finish()
    exported = load_file(str(tmp_path / "hf-out" / "model.safetensors"))
    assert all(torch.equal(exported[n], p.detach()) for n, p in whole.items())


# --------------------------------------------------------------------------------------------------- refusals
def _with_piece(document: dict, **change) -> dict:
    document = copy.deepcopy(document)
    document["tensors"]["proj.weight"]["pieces"][1].update(change)
    return document


@pytest.mark.parametrize("change, message", [
    (dict(blocks=1), "'blocks' must be an integer >= 2"),
    (dict(blocks=True), "'blocks' must be an integer >= 2"),
    (dict(blocks="3"), "'blocks' must be an integer >= 2"),
    (dict(blocks=4), "do not fit dim"),  # blocks of 3 rows: rows [2, 4) cross into the next
    (dict(blocks=5), "do not fit dim"),
    (dict(start=2, stop=5), "do not fit dim"),
    (dict(start=1, stop=3), "overlap"),
    (dict(dim=None), "'blocks' must be an integer >= 2, on a piece with a dim"),
])
def test_malformed_blocked_pieces_are_refused(tmp_path, change, message):
    torch.manual_seed(0)
    directory = save_ranks(Fused(conv1d=False), 2, tmp_path / "ck")
    document = json.loads((directory / METADATA).read_text())
    assert document_problems(document) == []
    problems = document_problems(_with_piece(document, **change))
    assert any(message in p for p in problems), problems
