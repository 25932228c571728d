"""``convert``'s fast paths: in-kernel copies (``copy_file_range``) of contiguous pieces, hashed from the source, and
column shards read with one scattering ``preadv`` per block; single process, small BERT and T5 models."""

import errno
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

import shardlib
from shardlib import checkpoint as ckpt
from shardlib import safetensors_io as sio
from shardlib.parallel.layout import Layout
from shardlib.parallel.mesh import OfflineMesh
from shardlib.safetensors_io import base as sio_base
from shardlib.safetensors_io import stream as sio_stream
from shardlib.safetensors_io import writer as sio_writer

from checkpoint_helpers import CONFIG, cli, hf_dir  # noqa: E402,F401  (hf_dir: a fixture)


@pytest.fixture
def kernel_copies(monkeypatch):
    """Counts the bytes ``os.copy_file_range`` copied (the real call underneath)."""
    if not hasattr(os, "copy_file_range"):
        pytest.skip("no os.copy_file_range on this platform")
    monkeypatch.setattr(sio_writer, "_kernel_copy_works", True)
    copied = []
    real = os.copy_file_range

    def counting(*args):
        n = real(*args)
        copied.append(n)
        return n

    monkeypatch.setattr(sio_writer.os, "copy_file_range", counting)
    return copied


def _load_every_rank(directory, tp, model_class=BertForMaskedLM, config=None):
    """The state dicts of a model loaded from ``directory`` at every tp rank (tp=1: the whole model)."""
    out = []
    for rank in range(tp):
        model = model_class(config or BertConfig(**CONFIG))
        shardlib.shard(model, OfflineMesh(tp=tp, tp_rank=rank))
        ckpt.load(model, directory)
        out.append(model)
    return out


def _assert_pieces_equal(directory, state):
    """Every stored piece of every tensor is bitwise the slice of the source tensor it claims to hold."""
    document = json.loads((directory / "shardlib.json").read_text())
    files = {name: load_file(str(directory / name)) for name in document["files"]}
    for name, entry in document["tensors"].items():
        full = next(state[n] for n in [name, *entry["aliases"]] if n in state)
        for piece in entry["pieces"]:
            expected = full if piece["dim"] is None else full.narrow(piece["dim"], piece["start"],
                                                                     piece["stop"] - piece["start"])
            assert torch.equal(files[piece["file"]][name], expected), (name, piece)


@pytest.mark.parametrize("tp", [2, 4])  # tp=1 is the same path with one piece per tensor (12 s of the suite)
def test_kernel_copy_convert_loads_bitwise_equal_and_verifies(hf_dir, tmp_path, kernel_copies, tp):
    src, original = hf_dir
    out = ckpt.convert(src, tmp_path / "out", tp=tp)
    assert sum(kernel_copies) > 0  # the in-kernel path really ran
    assert cli("verify", str(out)).returncode == 0
    _assert_pieces_equal(out, original.state_dict())
    full = _load_every_rank(out, 1)[0]
    for name, value in original.state_dict().items():
        assert torch.equal(full.state_dict()[name], value), name
    # sharded -> sharded: pieces of the tp checkpoint copied again (dim-0 pieces re-cut, whole pieces copied)
    again = ckpt.convert(out, tmp_path / "again", tp=2)
    assert cli("verify", str(again)).returncode == 0
    _assert_pieces_equal(again, original.state_dict())


def test_fallback_without_kernel_copy_writes_identical_files(hf_dir, tmp_path, kernel_copies, monkeypatch):
    """copy_file_range refused (EXDEV: e.g. another file system): the pread + pwrite fallback writes the same
    bytes, and the refusal is remembered (one failed call, not one per copy)."""
    src, _ = hf_dir
    reference = ckpt.convert(src, tmp_path / "reference", tp=2)
    calls = []

    def refusing(*args):
        calls.append(args)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(sio_writer.os, "copy_file_range", refusing)
    fallback = ckpt.convert(src, tmp_path / "fallback", tp=2)
    assert len(calls) == 1 and sio_writer._kernel_copy_works is False
    for name in json.loads((reference / "shardlib.json").read_text())["files"]:
        assert (fallback / name).read_bytes() == (reference / name).read_bytes(), name
    assert (fallback / "shardlib.json").read_text().count("xxh3_128") == 4  # 3 files + the metadata itself


def test_other_copy_errors_are_not_swallowed(hf_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sio_writer, "_kernel_copy_works", True)

    def failing(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sio_writer.os, "copy_file_range", failing)
    with pytest.raises(ckpt.CheckpointError, match="Input/output error"):
        ckpt.convert(hf_dir[0], tmp_path / "out", tp=2)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_corrupted_kernel_copy_is_caught_by_the_checksum(hf_dir, tmp_path, kernel_copies, monkeypatch):
    """The checksum is computed from the source bytes, not from what the copy wrote: a copy that writes wrong bytes
    gives a checkpoint that ``verify`` and ``load`` refuse (never silently wrong weights)."""
    real = sio_writer._copy_range
    corrupted = []

    def corrupting(src_fd, dst_fd, count, src_offset, dst_offset):
        n = real(src_fd, dst_fd, count, src_offset, dst_offset)
        if not corrupted and n > 64:
            byte = os.pread(src_fd, 1, src_offset + n // 2)
            os.pwrite(dst_fd, bytes([byte[0] ^ 0x5A]), dst_offset + n // 2)
            corrupted.append(os.readlink(f"/proc/self/fd/{dst_fd}"))
        return n

    monkeypatch.setattr(sio_writer, "_copy_range", corrupting)
    out = ckpt.convert(hf_dir[0], tmp_path / "out", tp=2)
    victim = os.path.basename(corrupted[0])
    result = cli("verify", str(out))
    assert result.returncode == 1 and f"{victim}: checksum mismatch" in result.stderr
    with pytest.raises(ckpt.CheckpointError, match="checksum mismatch"):
        _load_every_rank(out, 2)


def test_small_copy_chunks_and_blocks_give_identical_files(hf_dir, tmp_path, kernel_copies, monkeypatch):
    """Copies cut into many 100-byte jobs, hashed through a 64-byte buffer, columns in 64-byte blocks: the same
    bytes as one big copy per piece."""
    src, original = hf_dir
    reference = ckpt.convert(src, tmp_path / "reference", tp=2)
    monkeypatch.setattr(sio_base, "COPY_CHUNK", 100)
    monkeypatch.setattr(sio_base, "HASH_BLOCK", 64)
    monkeypatch.setattr(sio_base, "BLOCK", 64)
    small = ckpt.convert(src, tmp_path / "small", tp=2)
    assert len(kernel_copies) > 100
    for name in json.loads((reference / "shardlib.json").read_text())["files"]:
        assert (small / name).read_bytes() == (reference / name).read_bytes(), name
    _assert_pieces_equal(small, original.state_dict())


def test_source_truncated_during_convert_is_an_error(hf_dir, tmp_path, kernel_copies, monkeypatch):
    """The source shrinks after its header was checked: a clear error naming it, and no destination."""
    src, _ = hf_dir
    source = src / "model.safetensors"
    real_copy = sio.Writer.copy
    seen = []

    def shrinking(self, out, file, offset, nbytes):
        if not seen:
            os.truncate(source, source.stat().st_size // 2)
        seen.append(nbytes)
        return real_copy(self, out, file, offset, nbytes)

    monkeypatch.setattr(sio.Writer, "copy", shrinking)
    with pytest.raises(ckpt.CheckpointError, match=r"model\.safetensors: unexpected end of file"):
        ckpt.convert(src, tmp_path / "out", tp=2)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("shape, dim, tp", [((5, 7, 3), 1, 3), ((4, 3, 10), 2, 4), ((3, 6), 1, 2), ((2, 9), 1, 4)])
def test_column_scatter_matches_slices(tmp_path, shape, dim, tp, monkeypatch):
    """Tensors split along dim 1 or 2 at tps that do not divide them (uneven and empty ranks): each rank's file
    holds exactly ``narrow(dim, start, stop - start)``, in small blocks (several super-rows each) and large."""
    torch.manual_seed(0)
    full = torch.randn(shape)
    save_file({"t": full}, str(tmp_path / "src.safetensors"))
    layout = Layout(tuple(shape), shard_dim=dim, num_shards=tp)
    for block in (sio_base.BLOCK, 2 * full[0].numel() * 4 + 4):
        monkeypatch.setattr(sio_base, "BLOCK", block)
        directory = tmp_path / f"out{block}"
        directory.mkdir()
        ranges = [(r, *layout.valid_range(r)) for r in range(tp)]
        ranges = [(r, a, b) for r, a, b in ranges if b > a]
        with sio.SafetensorsFiles(tmp_path, {"t": "src.safetensors"}) as source, sio.Writer(directory) as writer:
            outs = {}
            for r, a, b in ranges:
                local = list(shape)
                local[dim] = b - a
                outs[r] = writer.open(f"r{r}.safetensors", [("t", torch.float32, tuple(local))])
            assert sio_stream._copy_columns(writer, source, "t", tuple(shape), torch.float32, dim, ranges, outs)
            info = writer.finish()
        for r, a, b in ranges:
            stored = load_file(str(directory / f"r{r}.safetensors"))["t"]
            assert torch.equal(stored, full.narrow(dim, a, b - a)), (r, a, b)
            assert info[f"r{r}.safetensors"]["checksum"]["value"] == \
                sio.checksum_of(directory / f"r{r}.safetensors")


def test_t5_head_sharded_bias_and_gated_mlp_round_trip(tmp_path, kernel_copies):
    """T5: the relative attention bias is split along its heads (dim 1: the column scatter path), the gated MLP's
    output along dim 1, embeddings tied: a tp=2 convert loads bitwise at tp=1 and tp=2."""
    torch.manual_seed(0)
    config = T5Config(vocab_size=45, d_model=12, d_kv=4, num_heads=4, d_ff=16, num_layers=2,
                      feed_forward_proj="gated-gelu")
    model = T5ForConditionalGeneration(config)
    model.save_pretrained(tmp_path / "hf")
    out = ckpt.convert(tmp_path / "hf", tmp_path / "out", tp=2)
    assert cli("verify", str(out)).returncode == 0
    document = json.loads((out / "shardlib.json").read_text())
    assert any(p["dim"] == 1 for t in document["tensors"].values() for p in t["pieces"])
    full = _load_every_rank(out, 1, T5ForConditionalGeneration, config)[0]
    for name, value in model.state_dict().items():
        assert torch.equal(full.state_dict()[name], value), name
