"""Checkpoints: HF -> shards, sharded save, reshard, export to HF, on 4 gloo ranks; bad input, single process."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import rank_tasks
from strategies import bert_specs, t5_specs, vit_specs

BERT = {"family": "bert", "cls": "BertForMaskedLM", "seq": 6, "batch": 2, "dtype": "float32", "seed": 1,
        "config": {"heads": 4, "head_dim": 4, "layers": 2, "intermediate": 32, "vocab": 51}}
VIT = {"family": "vit", "cls": "ViTForImageClassification", "batch": 2, "dtype": "float32", "seed": 2,
       "config": {"image": 8, "patch": 2, "heads": 4, "head_dim": 4, "layers": 2, "intermediate": 32}}
T5 = {"family": "t5", "cls": "T5ForConditionalGeneration", "seq": 6, "dec_seq": 4, "batch": 2, "dtype": "float32",
      "seed": 3, "config": {"vocab": 45, "d_model": 12, "d_kv": 4, "heads": 4, "d_ff": 16, "layers": 2,
                             "ffn": "gated-gelu"}}


@pytest.mark.parametrize("base", [BERT, VIT, T5], ids=["bert", "vit", "t5"])
@pytest.mark.parametrize("tp_a, tp_b", [(2, 4), (4, 2), (1, 4), (2, 1)])
def test_round_trip_reshard_export(pool, tmp_path, base, tp_a, tp_b):
    results = pool.run(rank_tasks.checkpoint_round_trip, {**base, "tp_a": tp_a, "tp_b": tp_b}, str(tmp_path))
    assert results[0]["tensors"] > 10


def test_export_in_several_shards(pool, tmp_path):
    pool.run(rank_tasks.checkpoint_round_trip, {**BERT, "tp_a": 2, "tp_b": 2, "max_shard_bytes": 4096},
             str(tmp_path))
    assert len(list((tmp_path / "export").glob("model-0000*-of-*.safetensors"))) > 3
    assert (tmp_path / "export" / "model.safetensors.index.json").exists()


# ------------------------------------------------------------------------------- single process: bad input
import json  # noqa: E402

import torch  # noqa: E402
from transformers import BertConfig, BertForMaskedLM, ViTConfig, ViTModel  # noqa: E402

import shardlib  # noqa: E402
from shardlib import checkpoint as ckpt  # noqa: E402
from shardlib import cli as shardlib_cli  # noqa: E402
from shardlib import safetensors_io as sio  # noqa: E402
from shardlib.checkpoint import saving as ckpt_save  # noqa: E402
from shardlib.parallel.mesh import OfflineMesh  # noqa: E402
from shardlib.safetensors_io import base as sio_base  # noqa: E402
from shardlib.safetensors_io import reader as sio_reader

from checkpoint_helpers import CONFIG, cli, hf_dir  # noqa: E402,F401  (hf_dir: a fixture)


@pytest.fixture
def sharded_dir(hf_dir, tmp_path):
    return ckpt.convert(hf_dir[0], tmp_path / "sharded", tp=2), hf_dir[1]


def test_cli_convert_inspect_verify_round_trip(hf_dir, tmp_path, capsys):
    src, original = hf_dir
    # in this process (each subprocess costs seconds); the installed entry point runs once, for verify
    assert shardlib_cli.main(["convert", str(src), str(tmp_path / "s4"), "--tp", "4"]) == 0
    assert shardlib_cli.main(["convert", str(tmp_path / "s4"), str(tmp_path / "s2"), "--tp", "2"]) == 0
    capsys.readouterr()
    assert shardlib_cli.main(["inspect", str(tmp_path / "s2")]) == 0
    assert "dim 0 / 2 (padded to 62)" in capsys.readouterr().out
    assert cli("verify", str(tmp_path / "s2")).returncode == 0
    assert shardlib_cli.main(["convert", str(tmp_path / "s2"), str(tmp_path / "back"), "--to", "hf"]) == 0
    back = BertForMaskedLM.from_pretrained(tmp_path / "back")
    for name, value in original.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    for command in ("convert", "inspect", "verify", "run"):  # in this process: each subprocess costs seconds
        with pytest.raises(SystemExit) as exit_info:
            shardlib_cli.main([command, "--help"])
        assert exit_info.value.code == 0, command


def test_from_pretrained_single_rank_equals_hf(hf_dir):
    src, original = hf_dir
    model = ckpt.from_pretrained(BertForMaskedLM, src, OfflineMesh())
    ids = torch.randint(0, 61, (2, 5))
    torch.testing.assert_close(model(input_ids=ids).logits, original.eval()(input_ids=ids).logits)


def test_auto_class_is_accepted(hf_dir):
    from transformers import AutoModelForMaskedLM

    model = ckpt.from_pretrained(AutoModelForMaskedLM, hf_dir[0], OfflineMesh())
    assert type(model) is BertForMaskedLM  # the class Auto resolved; tp=1 keeps it (no vocab-parallel loss wrapper)


def test_truncated_hf_file_is_named(hf_dir, tmp_path):
    src, _ = hf_dir
    path = src / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors"):
        ckpt.from_pretrained(BertForMaskedLM, src, OfflineMesh())
    result = cli("convert", str(src), str(tmp_path / "out"), "--tp", "2")
    assert result.returncode == 1 and "model.safetensors" in result.stderr and not (tmp_path / "out").exists()


def test_corrupted_sharded_file_fails_verify_and_load(sharded_dir):
    directory, _ = sharded_dir
    victim = directory / "model-tp01-of-02.safetensors"
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = cli("verify", str(directory))
    assert result.returncode == 1 and "model-tp01-of-02.safetensors: checksum mismatch" in result.stderr
    model = BertForMaskedLM(BertConfig(**CONFIG))
    shardlib.shard(model, OfflineMesh(tp=2, tp_rank=1))
    with pytest.raises(ckpt.CheckpointError, match="checksum mismatch"):
        ckpt.load(model, directory)


def test_missing_shard_file(sharded_dir):
    directory, _ = sharded_dir
    (directory / "model-tp00-of-02.safetensors").unlink()
    result = cli("verify", str(directory))
    assert result.returncode == 1 and "missing checkpoint file" in result.stderr and "tp00" in result.stderr


def test_index_pointing_outside_the_directory(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text(BertConfig(**CONFIG).to_json_string())
    (tmp_path / "ck" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"bert.embeddings.word_embeddings.weight": "../../etc/passwd"}}))
    with pytest.raises(ckpt.CheckpointError, match="points outside the checkpoint directory"):
        ckpt.from_pretrained(BertForMaskedLM, tmp_path / "ck", OfflineMesh())


def test_shape_mismatch_names_the_tensor(hf_dir):
    src, _ = hf_dir
    with pytest.raises(ckpt.CheckpointError, match=r"word_embeddings.weight.*shape \(61, 16\).*expects \(61, 32\)"):
        model = BertForMaskedLM(BertConfig(**{**CONFIG, "hidden_size": 32}))
        shardlib.shard(model, OfflineMesh())
        ckpt.load_hf_weights(model, ckpt.SafetensorsFiles(src))


def test_checkpoint_of_another_architecture(sharded_dir):
    directory, _ = sharded_dir
    model = ViTModel(ViTConfig(image_size=8, patch_size=4, hidden_size=8, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=8))
    shardlib.shard(model, OfflineMesh())
    with pytest.raises(ckpt.CheckpointError, match="holds a BertForMaskedLM, not a ViTModel"):
        ckpt.load(model, directory)


def test_layout_the_model_cannot_take(sharded_dir, tmp_path):
    result = cli("convert", str(sharded_dir[0]), str(tmp_path / "t3"), "--tp", "3")
    errors = [line for line in result.stderr.splitlines() if line.startswith("shardlib convert:")]
    assert result.returncode == 1 and len(errors) == 1 and "is not divisible by tp=3" in errors[0]
    assert not (tmp_path / "t3").exists()


def test_existing_destination_is_refused_unless_overwrite(sharded_dir, hf_dir, capsys):
    directory, _ = sharded_dir
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    # the CLI in this process (a subprocess costs seconds; test_cli_convert_inspect_verify_round_trip runs them)
    assert shardlib_cli.main(["convert", str(hf_dir[0]), str(directory), "--tp", "4"]) == 1
    assert "exists" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert shardlib_cli.main(["convert", str(hf_dir[0]), str(directory), "--tp", "4", "--overwrite"]) == 0
    assert json.loads((directory / "shardlib.json").read_text())["tp"] == 4


def test_crash_mid_save_keeps_the_previous_checkpoint(sharded_dir, monkeypatch):
    """A writer dying in the middle of a file: the old checkpoint stays whole under its name, nothing half-written
    appears there."""
    directory, original = sharded_dir
    model = ckpt.from_pretrained(BertForMaskedLM, directory.parent / "hf", OfflineMesh())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_write = sio.OutFile.write

    def dying_write(self, view, offset):
        if offset:  # after the header: write part of a block, then the process dies
            real_write(self, view[: len(view) // 2], offset)
            raise RuntimeError("rank died")
        real_write(self, view, offset)

    monkeypatch.setattr(sio.OutFile, "write", dying_write)
    with pytest.raises(ckpt.CheckpointError, match="rank 0: RuntimeError: rank died"):
        ckpt.save(model, directory, overwrite=True)
    assert cli("verify", str(directory)).returncode == 0
    reloaded = BertForMaskedLM(BertConfig(**CONFIG))
    shardlib.shard(reloaded, OfflineMesh())
    ckpt.load(reloaded, directory)
    for name, value in original.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


@pytest.mark.parametrize("tp_a, tp_b", [(2, 2), (2, 4)])
def test_training_resumes_exactly_with_optimizer_state(pool, tmp_path, tp_a, tp_b):
    results = pool.run(rank_tasks.training_resumes_exactly, {**BERT, "tp_a": tp_a, "tp_b": tp_b}, str(tmp_path))
    assert results[0]["continued"][0] != results[0]["continued"][1]


@st.composite
def layout_pair_specs(draw):
    tp_a, tp_b = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    lcm_tp = max(tp_a, tp_b)  # tp in {1, 2, 4}: the larger is a multiple of the smaller
    strategy = draw(st.sampled_from([
        bert_specs(classes=("BertForMaskedLM", "BertForPreTraining", "BertModel"), tp=(lcm_tp,), all_to_all=False),
        vit_specs(tp=(lcm_tp,), all_to_all=False),
        t5_specs(tp=(lcm_tp,), classes=("T5ForConditionalGeneration", "UMT5ForConditionalGeneration", "T5EncoderModel")),
    ]))
    spec = draw(strategy)
    if "untie_head" in spec["config"]:
        # transformers 5 always ties T5's lm_head to the embedding, so an HF checkpoint cannot carry an untied one
        spec["config"]["untie_head"] = False
    return {**spec, "family": spec.get("family", "bert"), "dtype": "float32", "tp_a": tp_a, "tp_b": tp_b}


@settings(max_examples=15, deadline=None)
@given(spec=layout_pair_specs())
def test_random_configs_and_layout_pairs_round_trip(pool, tmp_path_factory, spec):
    """Save under layout A, load under layout B, export to HF: bitwise equal at every step; forward equal."""
    pool.run(rank_tasks.checkpoint_round_trip, spec, str(tmp_path_factory.mktemp("ck")))


# --------------------------------------------------------------- the safetensors reader and the streamed writer
import math  # noqa: E402
import os  # noqa: E402
import struct  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from safetensors.torch import load_file, save_file  # noqa: E402 (the reference implementation, as an oracle)

DTYPE_CHOICES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
                 torch.uint8, torch.bool]


def _random_tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)


def _split(raw: bytes):
    """(header length, header as a dict, data area) of a safetensors file's bytes (safetensors orders the
    ``__metadata__`` keys at random: compare the header parsed)."""
    length = struct.unpack("<Q", raw[:8])[0]
    return length, json.loads(raw[8:8 + length]), raw[8 + length:]


def _raw_file(path, header: dict, data: bytes, length: int | None = None):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@st.composite
def slice_cases(draw):
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=4)))
    dim = draw(st.integers(0, len(shape) - 1))
    start = draw(st.integers(0, shape[dim]))
    stop = draw(st.integers(start, shape[dim]))
    return shape, draw(st.sampled_from(DTYPE_CHOICES)), dim, start, stop, draw(st.integers(0, 2**16))


@settings(deadline=None)
@given(case=slice_cases(), small_blocks=st.booleans())
@example(case=((2, 7, 4), torch.float32, 1, 0, 3, 0), small_blocks=True)  # runs of 48 bytes: read one by one
@example(case=((6, 5, 1), torch.float32, 1, 1, 2, 0), small_blocks=True)  # 4-byte runs: 64-byte row blocks
def test_reader_slice_equals_slice_of_the_full_tensor(case, small_blocks):
    """Any dim, any rows, any dtype (bfloat16 included): the bytes read equal the full tensor's slice, into a fresh
    tensor and into a strided view of a bigger one; with tiny blocks (64-byte blocks, runs of 16 bytes read one by
    one) the row-block path and the run-by-run path run too: a strided slice of several rows then takes more than
    one read, where the default 4 MiB block reads it at once."""
    shape, dtype, dim, start, stop, seed = case
    full = _random_tensor(shape, dtype, seed)
    reads = []
    real_pread = sio_reader.pread_into

    def counting(fd, view, offset, path):
        reads.append(len(view))
        return real_pread(fd, view, offset, path)

    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        path = Path(d) / "t.safetensors"
        save_file({"x": full, "other": torch.ones(3)}, str(path))
        if small_blocks:
            mp.setattr(sio_base, "BLOCK", 64)
            mp.setattr(sio_base, "DIRECT_ROW", 16)
        with sio.SafetensorsFile(path) as f:
            assert torch.equal(f.read("x"), full)
            expected = full.narrow(dim, start, stop - start)
            mp.setattr(sio_reader, "pread_into", counting)
            assert torch.equal(f.read("x", dim, start, stop), expected)
            mp.setattr(sio_reader, "pread_into", real_pread)
            inner = math.prod(shape[dim + 1:]) * dtype.itemsize
            rows, run, stride = math.prod(shape[:dim]), (stop - start) * inner, shape[dim] * inner
            if dim > 0 and rows > 1 and 0 < stop - start < shape[dim] and run:  # a strided read
                if not small_blocks:
                    assert len(reads) == 1, reads
                elif run >= 16 or stride > 64 or rows > 64 // stride:
                    assert len(reads) > 1, reads  # the patched limits really reached the reader
            padded = list(expected.shape)
            padded[dim] += 2
            holder = torch.zeros(padded, dtype=dtype)
            f.read_into("x", holder.narrow(dim, 1, stop - start), dim, start, stop)
            assert torch.equal(holder.narrow(dim, 1, stop - start), expected)
            assert not holder.narrow(dim, 0, 1).any() and not holder.narrow(dim, padded[dim] - 1, 1).any()
            # a contiguous byte range (all of dim 0's rows [start, stop) when dim is 0, else the whole tensor)
            # into a view strided in its last dim: scattered straight into the rows
            if len(shape) >= 2:
                rows = (start, stop) if dim == 0 else (0, shape[0])
                wide = torch.zeros(*shape[:-1], shape[-1] + 3, dtype=dtype)
                view = wide.narrow(-1, 2, shape[-1]).narrow(0, rows[0], rows[1] - rows[0])
                f.read_into("x", view, 0, *rows)
                assert torch.equal(view, full.narrow(0, rows[0], rows[1] - rows[0]))


@settings(deadline=None, max_examples=50)
@given(shapes=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=3), st.sampled_from(DTYPE_CHOICES)),
                       min_size=1, max_size=5),
       transpose=st.booleans())
def test_streamed_writer_matches_safetensors_bytes(shapes, transpose):
    """The streamed writer's files are safetensors' ``save_file`` files of the same tensors (strided inputs
    included): same header length, header, tensor order and data bytes; the recorded checksum is the file's."""
    tensors = {f"t{i}": _random_tensor(tuple(s), dt, i) for i, (s, dt) in enumerate(shapes)}
    if transpose:
        tensors = {k: (v.t() if v.dim() == 2 else v) for k, v in tensors.items()}
    with tempfile.TemporaryDirectory() as d:
        written = ckpt_save._write_files(Path(d), {"mine.safetensors": tensors})
        save_file({k: v.contiguous() for k, v in tensors.items()}, f"{d}/ref.safetensors",
                  metadata={"format": "pt", "writer": ckpt.FORMAT})
        mine = Path(d, "mine.safetensors").read_bytes()
        assert _split(mine) == _split(Path(d, "ref.safetensors").read_bytes())
        info = written["mine.safetensors"]
        assert info["bytes"] == len(mine) and info["checksum"]["algorithm"] == "xxh3_128"
        assert info["checksum"]["value"] == ckpt.checksum_of(Path(d, "mine.safetensors"))


@pytest.mark.parametrize("case, message", [
    ("short", "too short for a header"),
    ("huge_length", "header length 18446744073709551615 is impossible"),
    ("zero_length", "header length 0 is impossible"),
    ("not_json", "header is not JSON"),
    ("unknown_dtype", "tensor 'w': unknown dtype 'F33'"),
    ("offsets_vs_shape", r"tensor 'w': data_offsets \[0, 20\] hold 20 bytes, shape \[2, 3\] of F32 needs 24"),
    ("outside", r"tensor 'w': data_offsets \[0, 24\] lie outside the data area of 16 bytes \(truncated\?\)"),
    ("overlap", "tensor 'v': data_offsets start at 8, expected 24"),
    ("trailing", "trailing bytes"),
    ("bad_shape", "tensor 'w': bad shape"),
])
def test_reader_rejects_corrupt_headers_naming_file_and_tensor(tmp_path, case, message):
    good = {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    data = bytes(24)
    path = tmp_path / "bad.safetensors"
    if case == "short":
        path.write_bytes(b"\x01\x02")
    elif case == "huge_length":
        _raw_file(path, good, data, length=2**64 - 1)
    elif case == "zero_length":
        _raw_file(path, good, data, length=0)
    elif case == "not_json":
        path.write_bytes(struct.pack("<Q", 8) + b"{not js}" + data)
    elif case == "unknown_dtype":
        _raw_file(path, {"w": {**good["w"], "dtype": "F33"}}, data)
    elif case == "offsets_vs_shape":
        _raw_file(path, {"w": {**good["w"], "data_offsets": [0, 20]}}, data[:20])
    elif case == "outside":
        _raw_file(path, good, data[:16])  # truncated data area
    elif case == "overlap":
        _raw_file(path, {**good, "v": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, data)
    elif case == "trailing":
        _raw_file(path, good, data + bytes(8))
    elif case == "bad_shape":
        _raw_file(path, {"w": {**good["w"], "shape": [2, -3]}}, data)
    with pytest.raises(ckpt.CheckpointError, match=message) as info:
        ckpt.SafetensorsFile(path).read("w")
    assert "bad.safetensors" in str(info.value)


def test_reader_errors_on_a_file_shrunk_after_opening(tmp_path):
    """Truncated between header check and read (another process): the short read is an error, not zeros."""
    path = tmp_path / "t.safetensors"
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(path))
    f = ckpt.SafetensorsFile(path)
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(ckpt.CheckpointError, match=r"t.safetensors: unexpected end of file .*truncated"):
        f.read("w")
    with pytest.raises(ckpt.CheckpointError, match=r"no tensor 'nope'"):
        f.read("nope")


def test_save_fsyncs_every_data_file_before_the_metadata(hf_dir, tmp_path, monkeypatch):
    model = ckpt.from_pretrained(BertForMaskedLM, hf_dir[0], OfflineMesh())
    order = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        order.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    ckpt.save(model, tmp_path / "saved")
    data = [n for n in order if n.endswith(".safetensors")]
    assert data and order.index("shardlib.json") > max(order.index(n) for n in data)
    document = json.loads((tmp_path / "saved" / "shardlib.json").read_text())
    assert set(data) == set(document["files"]) and document["format"] == "shardlib-sharded-v3"
    assert {f["checksum"]["algorithm"] for f in document["files"].values()} == {"xxh3_128"}


def test_v1_checkpoint_with_sha256_checksums_still_loads_and_verifies(sharded_dir):
    directory, original = sharded_dir
    meta_path = directory / "shardlib.json"
    document = json.loads(meta_path.read_text())
    document["format"] = "shardlib-sharded-v1"
    for name, info in document["files"].items():
        document["files"][name] = {"bytes": info["bytes"], "sha256": sio.sha256_of(directory / name)}
    meta_path.write_text(json.dumps(document))
    assert ckpt.ShardedCheckpoint(directory).problems() == []
    model = BertForMaskedLM(BertConfig(**CONFIG))
    shardlib.shard(model, OfflineMesh(tp=2, tp_rank=1))
    ckpt.load(model, directory)
    victim = directory / "model-tp00-of-02.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x01
    victim.write_bytes(bytes(data))
    assert any("checksum mismatch" in p for p in ckpt.ShardedCheckpoint(directory).problems())


@pytest.mark.parametrize("tp", [2, 4])
def test_convert_streams_in_small_blocks_to_identical_files(hf_dir, tmp_path, monkeypatch, tp):
    """Blocks far smaller than the tensors (many blocks per tensor, a pool that runs dry, columns staged block by
    block): the files are byte-identical to a convert in one block, and hold exactly the original slices."""
    src, original = hf_dir
    reference = ckpt.convert(src, tmp_path / "big", tp=tp)
    monkeypatch.setattr(sio_base, "BLOCK", 256)
    monkeypatch.setattr(sio_base, "DIRECT_ROW", 64)
    small = ckpt.convert(src, tmp_path / "small", tp=tp)
    again = ckpt.convert(small, tmp_path / "resharded", tp=tp)  # sharded -> sharded, small blocks too
    for directory in (small, again):
        for name in json.loads((reference / "shardlib.json").read_text())["files"]:
            assert (directory / name).read_bytes() == (reference / name).read_bytes(), name
    document = json.loads((reference / "shardlib.json").read_text())
    state = original.state_dict()
    for name, entry in document["tensors"].items():
        for piece in entry["pieces"]:
            stored = load_file(str(reference / piece["file"]))[name]
            full = state[name]
            expected = full if piece["dim"] is None else full.narrow(piece["dim"], piece["start"],
                                                                     piece["stop"] - piece["start"])
            assert torch.equal(stored, expected), (name, piece)
    assert math.prod(state["bert.embeddings.word_embeddings.weight"].shape) > 256  # really many blocks
