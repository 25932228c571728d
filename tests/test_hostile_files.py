"""Hostile files: safetensors files, HF indexes and ``shardlib.json`` made to break the readers.

Each is refused with a :class:`~shardlib.safetensors_io.CheckpointError` (that type exactly) whose message is one line
and names the file; no read ever asks for a byte outside its file (every ``os.preadv`` is checked against the
file's size) and nothing is ever unpickled (``pickle`` and ``torch.load`` are booby-trapped for the whole module).
Two hypothesis properties mutate valid safetensors headers and valid ``shardlib.json`` documents (bytes, numbers,
keys deleted, renamed or duplicated, types changed): every mutation is read correctly or refused with
CheckpointError, never another exception, never a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from hypothesis import event, given, settings, strategies as st
from safetensors.torch import save as safetensors_bytes
from transformers import BertConfig

from shardlib import checkpoint as ckpt
from shardlib import cli as shardlib_cli
from shardlib.checkpoint import format as fmt
from shardlib.safetensors_io import CheckpointError, SafetensorsFile, SafetensorsFiles, base as sio_base

from checkpoint_helpers import CONFIG
from profiles import examples


# ------------------------------------------------------------------------------------------------- guards
@pytest.fixture(scope="module", autouse=True)
def never_unpickled():
    """Any unpickling in this module fails the test that caused it."""
    def trap(*args, **kwargs):
        raise AssertionError("a checkpoint reader unpickled something")

    with pytest.MonkeyPatch.context() as patch:
        for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
            patch.setattr(module, name, trap)
        yield


@contextlib.contextmanager
def reads_in_bounds():
    """Within the block every ``os.preadv`` (the readers' only read) asks for bytes inside its file; yields the
    list of ``(offset, nbytes)`` asked for."""
    real, asked = os.preadv, []

    def checked(fd, buffers, offset, *flags):
        nbytes, size = sum(memoryview(b).nbytes for b in buffers), os.fstat(fd).st_size
        assert 0 <= offset and offset + nbytes <= size, f"read of {nbytes} bytes at {offset} in a {size}-byte file"
        asked.append((offset, nbytes))
        return real(fd, buffers, offset, *flags)

    os.preadv = checked
    try:
        yield asked
    finally:
        os.preadv = real


def refused(call, *names: str) -> str:
    """``call()`` raises a CheckpointError (exactly), one line, naming each of ``names``; its message."""
    with reads_in_bounds(), pytest.raises(CheckpointError) as info:
        call()
    message = str(info.value)
    assert type(info.value) is CheckpointError, type(info.value)
    assert len(message.splitlines()) == 1, message
    assert all(name in message for name in names), message
    return message


def cli_refuses(*args: str, names: tuple[str, ...], capsys) -> None:
    """``shardlib <args>`` exits 1 with one line on stderr per problem, each naming ``names``."""
    capsys.readouterr()
    assert shardlib_cli.main(list(args)) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith(f"shardlib {args[0]}: ") for line in lines), lines
    assert all(name in line for line in lines for name in names), lines


def _hf_config(directory: Path) -> None:
    directory.mkdir(exist_ok=True)
    BertConfig(**CONFIG, architectures=["BertForMaskedLM"]).save_pretrained(directory)


# ------------------------------------------------------------------------------------------ safetensors
GOOD = {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "v": {"dtype": "I8", "shape": [8], "data_offsets": [24, 32]}}
DATA = bytes(range(32))


def _entry(name, **changes):
    return {**GOOD, name: {**GOOD[name], **changes}}


SAFETENSORS_CASES = {  # id: (header: dict, str or bytes; data; header length or None; expected)
    "header longer than the file": (GOOD, DATA, 10 ** 4, "header length 10000 is impossible for a file of"),
    "header length of 2**64 - 1": (GOOD, DATA, 2 ** 64 - 1, "header length 18446744073709551615 is impossible"),
    "overlapping data_offsets": (_entry("v", data_offsets=[16, 24]), DATA[:24], None,
                                 "tensor 'v': data_offsets start at 16, expected 24 (overlapping"),
    "a gap between tensors": (_entry("v", data_offsets=[28, 36]), DATA + bytes(4), None,
                              "tensor 'v': data_offsets start at 28, expected 24"),
    "out-of-range data_offsets": (GOOD, DATA[:28], None,
                                  "tensor 'v': data_offsets [24, 32] lie outside the data area of 28 bytes"),
    "negative data_offsets": (_entry("w", data_offsets=[-8, 16]), DATA, None, "tensor 'w': bad data_offsets"),
    "data_offsets beyond 2**64": (_entry("v", data_offsets=[2 ** 64 + 24, 2 ** 64 + 32]), DATA, None,
                                  "lie outside the data area of 32 bytes"),
    "a dtype that disagrees with the offsets": (_entry("w", dtype="F64"), DATA, None,
                                                "tensor 'w': data_offsets [0, 24] hold 24 bytes, shape [2, 3] of "
                                                "F64 needs 48"),
    "a shape that disagrees with the offsets": (_entry("w", shape=[2, 4]), DATA, None,
                                                "shape [2, 4] of F32 needs 32"),
    "a shape of 2**40 x 2**40": (_entry("w", shape=[2 ** 40, 2 ** 40]), DATA, None, "needs 4835703278458516698824704"),
    "a dtype that is not a string": (_entry("w", dtype=["F32"]), DATA, None, "tensor 'w': unknown dtype ['F32']"),
    "an entry without data_offsets": ({"w": {"dtype": "F32", "shape": [2, 3]}}, DATA[:24], None,
                                      "tensor 'w': entry needs dtype, shape and data_offsets"),
    "non-UTF-8 header bytes": (json.dumps(GOOD).encode().replace(b'"w"', b'"\xff\xfe"'), DATA, None,
                               "header is not UTF-8"),
    "duplicate keys": ('{"w": {"dtype": "I8", "shape": [8], "data_offsets": [0, 8]}, '
                       '"w": {"dtype": "I8", "shape": [8], "data_offsets": [0, 8]}}', DATA[:8], None,
                       "header has a duplicate key 'w'"),
    "duplicate keys inside an entry": ('{"v": {"dtype": "I8", "dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}',
                                       DATA[:8], None, "header has a duplicate key 'dtype'"),
    "NaN in the header": ('{"v": {"dtype": "I8", "shape": [8], "data_offsets": [0, NaN]}}', DATA[:8], None,
                          "NaN is not a JSON number"),
    "JSON nested 100000 deep": ("[" * 100000 + "]" * 100000, b"", None, "header is nested too deeply"),
    "a header that is a JSON list": ("[1, 2]", b"", None, "header is not a JSON object"),
    "__metadata__ with a number": ({"__metadata__": {"format": 1}, **GOOD}, DATA, None,
                                   "__metadata__ is not an object of strings"),
}


def _write_raw(path: Path, header, data: bytes, length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_hostile_safetensors_file_is_refused(tmp_path, capsys, case):
    """Refused when opened (``SafetensorsFile``), and by ``shardlib convert`` of an HF directory holding it."""
    header, data, length, expected = SAFETENSORS_CASES[case]
    path = _write_raw(tmp_path / "hostile.safetensors", header, data, length)
    assert expected in refused(lambda: SafetensorsFile(path).read("w"), "hostile.safetensors")
    _hf_config(tmp_path / "hf")
    shutil.copy(path, tmp_path / "hf" / "model.safetensors")
    cli_refuses("convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--tp", "2", names=("model.safetensors",),
                capsys=capsys)
    assert not (tmp_path / "out").exists()


def test_header_over_the_100_mib_limit_is_refused_before_it_is_read(tmp_path):
    """A (sparse) file of 101 MiB whose header claims 100 MiB + 1 byte: refused after reading the 8-byte length,
    nothing allocated for the header."""
    path = _write_raw(tmp_path / "huge.safetensors", b"{", b"", sio_base.MAX_HEADER + 1)
    os.truncate(path, sio_base.MAX_HEADER + (1 << 20))
    with reads_in_bounds() as asked:
        message = refused(lambda: SafetensorsFile(path), "huge.safetensors")
    assert f"header length {sio_base.MAX_HEADER + 1} exceeds the limit of {sio_base.MAX_HEADER} bytes" in message
    assert asked == [(0, 8)]


def test_hf_directory_with_only_a_pickle_is_refused_without_unpickling(tmp_path, capsys):
    """``pytorch_model.bin`` is a pickle (it would run code when loaded): never opened."""
    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(tmp_path / "pwned"),)

    _hf_config(tmp_path / "hf")
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    assert "no model.safetensors or model.safetensors.index.json" in refused(
        lambda: SafetensorsFiles(tmp_path / "hf"), str(tmp_path / "hf"))
    cli_refuses("convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--tp", "1", names=(str(tmp_path / "hf"),),
                capsys=capsys)
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------------------------------------- HF index
INDEX = "model.safetensors.index.json"
INDEX_CASES = {  # id: (index content, expected)
    "a shard outside the directory": ({"weight_map": {"w": "../model-00001-of-00001.safetensors"}},
                                      "points outside the checkpoint directory"),
    "an absolute shard path": ({"weight_map": {"w": "/etc/hostname"}}, "points outside the checkpoint directory"),
    "a missing shard": ({"weight_map": {"w": "model-00001-of-00001.safetensors", "v": "model-00002.safetensors"}},
                        "names shard 'model-00002.safetensors', which is missing"),
    "an index that is a JSON list": ([{"weight_map": {}}], "a JSON list, expected an object with a 'weight_map'"),
    "no weight_map": ({"metadata": {}}, "'weight_map' missing or not an object"),
    "a weight_map that is a list": ({"weight_map": ["w", "model-00001-of-00001.safetensors"]},
                                    "'weight_map' missing or not an object"),
    "a null file": ({"weight_map": {"w": None}}, "weight_map['w'] is None, expected a file name"),
    "a file name that is a number": ({"weight_map": {"w": 7}}, "weight_map['w'] is 7, expected a file name"),
    "an empty file name": ({"weight_map": {"w": ""}}, "weight_map['w'] is '', expected a file name"),
    "a NUL byte in a file name": ({"weight_map": {"w": "model\u0000.safetensors"}}, "is not a file name"),
    "a key twice": ('{"weight_map": {"w": "model-00001-of-00001.safetensors", "w": "other.safetensors"}}',
                    "has a duplicate key 'w'"),
    "not JSON": ("{weight_map", "is not JSON"),
    "not UTF-8": (b'{"weight_map": {"\xff": "x"}}', "is not UTF-8"),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_hostile_hf_index_is_refused_naming_it(tmp_path, capsys, case):
    content, expected = INDEX_CASES[case]
    directory = tmp_path / "hf"
    _hf_config(directory)
    (directory / "model-00001-of-00001.safetensors").write_bytes(safetensors_bytes({"w": torch.zeros(2)}))
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(safetensors_bytes({"w": torch.ones(2)}))
    raw = content if isinstance(content, bytes) else (content if isinstance(content, str) else json.dumps(content))
    (directory / INDEX).write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    assert expected in refused(lambda: SafetensorsFiles(directory), str(directory / INDEX))
    cli_refuses("convert", str(directory), str(tmp_path / "out"), "--tp", "2", names=(INDEX,), capsys=capsys)


# ------------------------------------------------------------------------------------------ shardlib.json
@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tp=2 sharded checkpoint of the small BERT (converted from an HF one), and every tensor read from it."""
    from transformers import BertForMaskedLM

    root = tmp_path_factory.mktemp("hostile")
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(**CONFIG)).save_pretrained(root / "hf")
    directory = ckpt.convert(root / "hf", root / "sharded", tp=2)
    with ckpt.ShardedCheckpoint(directory) as reader:
        tensors = _Tensors({name: reader.read(name, None, 0, None) for name in reader.tensors})
    return directory, tensors


class _Tensors(dict):
    def __repr__(self):  # hypothesis prints the arguments of a failing example
        return f"<{len(self)} tensors>"


EMBEDDING = "bert.embeddings.word_embeddings.weight"  # rows [0, 31) in tp00, [31, 61) in tp01
TP00 = "model-tp00-of-02.safetensors"


def _pieces(doc):
    return doc["tensors"][EMBEDDING]["pieces"]


def _set(doc, path, value):
    *parents, last = path
    for key in parents:
        doc = doc[key]
    doc[last] = value


def _fresh(doc) -> str:
    """Rewritten by a writer: a v3 document with the checksum of its (edited) content."""
    return fmt.document_text({k: v for k, v in doc.items() if k != "metadata_checksum"})


def _stale(doc) -> str:
    """Edited after it was written: the stored checksum no longer matches (or is gone)."""
    return json.dumps(doc, indent=1)


def _v2(doc) -> str:
    """Declared v2: no checksum of its own, only the schema checks stand."""
    return json.dumps({**{k: v for k, v in doc.items() if k != "metadata_checksum"}, "format": "shardlib-sharded-v2"})


def _keep(doc) -> None:
    return None


METADATA_CASES = {  # id: (edit of the parsed document, how it is written, expected)
    "a wrong world size (tp=1, 2 pieces)": (lambda d: _set(d, ["tp"], 1), _fresh, "2 pieces for tp=1"),
    "tp=0": (lambda d: _set(d, ["tp"], 0), _fresh, "field 'tp' is 0, expected an integer >= 1"),
    "a missing piece": (lambda d: _pieces(d).pop(), _fresh, "pieces cover rows [0, 31) of dim 0, the tensor has 61"),
    "overlapping pieces": (lambda d: _set(_pieces(d)[1], ["start"], 20), _fresh,
                           "pieces do not tile dim 0: overlap at row 20"),
    "a gap between pieces": (lambda d: _set(_pieces(d)[1], ["start"], 33), _fresh,
                             "pieces do not tile dim 0: gap at row 31"),
    "two pieces in one file": (lambda d: _set(_pieces(d)[1], ["file"], TP00), _fresh, "two pieces in one file"),
    "pieces along two dims": (lambda d: _set(_pieces(d)[1], ["dim"], 1), _fresh,
                              "pieces split along several dims [0, 1]"),
    "a piece in an unlisted file": (lambda d: _set(_pieces(d)[1], ["file"], "x.safetensors"), _fresh,
                                    "piece file 'x.safetensors' is not listed in 'files'"),
    "a hash of the wrong length": (lambda d: _set(d, ["files", TP00, "checksum", "value"], "9f0c" * 7), _fresh,
                                   "xxh3_128 value '9f0c9f0c9f0c9f0c9f0c9f0c9f0c' is not 32 lowercase hex digits"),
    "an unknown checksum algorithm": (lambda d: _set(d, ["files", TP00, "checksum", "algorithm"], ["md5"]), _fresh,
                                      "checksum {'algorithm': ['md5']"),
    "a missing key (files)": (lambda d: d.pop("files"), _fresh, "field 'files' missing or not a dict"),
    "a missing key (a tensor's shape)": (lambda d: d["tensors"][EMBEDDING].pop("shape"), _fresh,
                                         "shape None is not a list of non-negative integers"),
    "a dtype that is not a string": (lambda d: _set(d, ["tensors", EMBEDDING, "dtype"], ["float32"]), _fresh,
                                     "dtype ['float32'] is not one of"),
    "a layout that disagrees with the shape": (
        lambda d: _set(d, ["tensors", EMBEDDING, "layout", "global_shape"], [62, 16]), _fresh,
        "layout {'global_shape': [62, 16]"),
    "an optimizer that is not a list": (lambda d: _set(d, ["optimizer"], 3), _fresh, "field 'optimizer' is 3"),
    "a JSON list": (_keep, lambda d: "[1, 2, 3]", "a JSON list, expected an object"),
    "an unknown format": (lambda d: _set(d, ["format"], "shardlib-sharded-v9"), _stale,
                          "format 'shardlib-sharded-v9'"),
    "a damaged document (edited, checksum kept)": (lambda d: _set(d, ["tp"], 4), _stale, "metadata checksum mismatch"),
    "a v3 document without its checksum": (lambda d: d.pop("metadata_checksum"), _stale,
                                           "'metadata_checksum' missing or malformed"),
    "a v2 document (no checksum) with overlapping pieces": (lambda d: _set(_pieces(d)[1], ["start"], 20), _v2,
                                                            "pieces do not tile dim 0: overlap at row 20"),
    "duplicate keys": (_keep, lambda d: _fresh(d).replace('"tp": 2', '"tp": 2, "tp": 2'), "duplicate key 'tp'"),
    "not UTF-8": (_keep, lambda d: b'{"format": "\xff"}', "is not UTF-8"),
    "NaN for a number": (_keep, lambda d: _fresh(d).replace('"tp": 2', '"tp": NaN'), "NaN is not a JSON number"),
}


@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_hostile_metadata_is_refused_naming_it(sharded, tmp_path, capsys, case):
    """Refused when the checkpoint is opened (so by every load) and by ``shardlib verify``. An edit to a v3 document
    is caught by its checksum first: the schema checks are reached by documents rewritten with a fresh checksum
    (``document_text``) or declared v2 (no checksum)."""
    edit, write, expected = METADATA_CASES[case]
    directory = shutil.copytree(sharded[0], tmp_path / "ck")
    doc = json.loads((directory / "shardlib.json").read_text())
    edit(doc)
    text = write(doc)
    (directory / "shardlib.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    assert expected in refused(lambda: ckpt.ShardedCheckpoint(directory), str(directory / "shardlib.json"))
    cli_refuses("verify", str(directory), names=("shardlib.json",), capsys=capsys)


@pytest.mark.parametrize("field, value, expected", [
    ("dtype", "float64", "tensor 'bert.embeddings.word_embeddings.weight' is float32 [31, 16], shardlib.json records "
                         "float64 [31, 16] for this piece"),
    ("shape", [61, 17], "is float32 [31, 16], shardlib.json records float32 [31, 17] for this piece")],
    ids=["dtype", "shape"])
def test_metadata_that_disagrees_with_a_file_is_refused(sharded, tmp_path, capsys, field, value, expected):
    """A well-formed document (fresh checksum) whose dtype or shape is not what the files store: ``verify`` names
    the file and the tensor, and no read takes the bytes for something else."""
    directory = shutil.copytree(sharded[0], tmp_path / "ck")
    doc = json.loads((directory / "shardlib.json").read_text())
    doc["tensors"][EMBEDDING][field] = value
    doc["tensors"][EMBEDDING]["layout"]["global_shape"] = doc["tensors"][EMBEDDING]["shape"]
    (directory / "shardlib.json").write_text(fmt.document_text(doc))

    def read():
        with ckpt.ShardedCheckpoint(directory) as reader:
            reader.read(EMBEDDING, None, 0, None)

    assert expected in refused(read, TP00)
    assert any(expected in p for p in ckpt.ShardedCheckpoint(directory).problems())
    cli_refuses("verify", str(directory), names=(EMBEDDING, "shardlib.json records"), capsys=capsys)  # each piece


# ----------------------------------------------------------------------------------------------- fuzzing
class Obj(list):
    """A JSON object as its ``[key, value]`` members, in order: duplicate keys can be written."""


def _members(value):
    if isinstance(value, dict):
        return Obj([k, _members(v)] for k, v in value.items())
    if isinstance(value, list):
        return [_members(v) for v in value]
    return value


def _text(value) -> str:
    if isinstance(value, Obj):
        return "{" + ",".join(f"{json.dumps(k)}:{_text(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_text(v) for v in value) + "]"
    return json.dumps(value)


def _slots(value, path=()):
    """Every place in the document: ``(path to the container, index in it)``."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            yield path, i
            yield from _slots(item[1] if isinstance(value, Obj) else item, (*path, i))


def _container(value, path):
    for i in path:
        value = value[i][1] if isinstance(value, Obj) else value[i]
    return value


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70) | st.integers(-2 ** 70, 2 ** 70) | st.floats()
    | st.sampled_from(["F32", "I8", "U8", "BF16", "float32", "int64", "bool", TP00, "model-replicated.safetensors"])
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5)


def _edit_structure(data, document) -> str:
    """One structural edit of ``document`` (a dict): a value replaced (any JSON type), a number nudged, a member
    deleted, renamed (to a new name) or duplicated; the JSON text."""
    root = _members(document)
    path, i = data.draw(st.sampled_from(list(_slots(root))))
    container = _container(root, path)
    is_object = isinstance(container, Obj)
    current = container[i][1] if is_object else container[i]
    ops = ["replace", "delete", "duplicate"] + (["rename"] if is_object else []) + \
        (["nudge"] if type(current) is int else [])
    op = data.draw(st.sampled_from(ops))
    if op == "replace":
        new = _members(data.draw(JSON_VALUES))
        if is_object:
            container[i][1] = new
        else:
            container[i] = new
    elif op == "nudge":
        new = current + data.draw(st.sampled_from([-1, 1, -8, 8, 2 ** 32, 2 ** 63, -2 ** 63]))
        if is_object:
            container[i][1] = new
        else:
            container[i] = new
    elif op == "delete":
        del container[i]
    elif op == "duplicate":
        container.insert(i + 1, list(container[i]) if is_object else container[i])
    else:  # a name no member has: a renamed member, not a swap of two
        container[i][0] = container[i][0] + "~" + data.draw(st.text(max_size=3))
    return _text(root)


def _edit_bytes(data, raw: bytes, start: int, stop: int) -> bytes:
    """1 to 4 byte edits (one byte changed, inserted or a span deleted) inside ``raw[start:stop]``."""
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(start, max(start, stop - 1)))
        op = data.draw(st.sampled_from(["change", "insert", "delete"]))
        if op == "change" and at < len(raw):
            raw[at] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            raw[at:at] = bytes([data.draw(st.integers(0, 255))])
            stop += 1
        elif op == "delete":
            n = data.draw(st.integers(1, 16))
            del raw[at:at + n]
            stop = max(start, stop - n)
    return bytes(raw)


# distinct byte sizes: no two tensors' offsets can be exchanged by an edit that keeps the file consistent
FUZZ_TENSORS = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([[1.5, -2.0]] * 3,
                dtype=torch.bfloat16), "c": torch.tensor([-3, 7], dtype=torch.int64),
                "d": torch.tensor([True, False, True]), "e": torch.tensor(2.5, dtype=torch.float16),
                "f": torch.arange(5, dtype=torch.uint8)}
FUZZ_FILE = safetensors_bytes(FUZZ_TENSORS, metadata={"format": "pt"})


def _raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


@settings(max_examples=examples(dev=1000, ci=10000))
@given(data=st.data())
def test_fuzzed_safetensors_headers_are_read_correctly_or_refused(tmp_path_factory, data):
    """A safetensors file carries no checksum, so "read correctly" is: every tensor that reads gives exactly its
    original bytes (a header that renames a dtype to another of its size, F32 -> I32, or reshapes a tensor keeping
    its byte count describes other valid tensors over the same bytes; nothing tells them apart). Everything else
    must be a CheckpointError: no other exception, no read outside the file, no hang."""
    length = struct.unpack("<Q", FUZZ_FILE[:8])[0]
    if data.draw(st.booleans(), label="structural"):
        text = _edit_structure(data, json.loads(FUZZ_FILE[8:8 + length])).encode()
        text += b" " * (-len(text) % 8)
        raw = struct.pack("<Q", len(text)) + text + FUZZ_FILE[8 + length:]
    else:
        raw = _edit_bytes(data, FUZZ_FILE, 0, 8 + length)
    path = tmp_path_factory.getbasetemp() / "fuzzed.safetensors"
    path.write_bytes(raw)
    start = time.monotonic()
    with reads_in_bounds():
        try:
            reader = SafetensorsFile(path)
        except CheckpointError as exc:
            assert "fuzzed.safetensors" in str(exc) and len(str(exc).splitlines()) == 1
            event("refused")
            return
        event("read")
        with reader:
            for key in reader.keys():
                try:
                    tensor = reader.read(key)
                except CheckpointError:
                    event("a tensor refused")
                    continue
                if key in FUZZ_TENSORS:
                    assert _raw_bytes(tensor) == _raw_bytes(FUZZ_TENSORS[key]), key
                    assert tensor.dtype.itemsize == FUZZ_TENSORS[key].dtype.itemsize, key
    assert time.monotonic() - start < 10


@settings(max_examples=examples(dev=600, ci=6000))
@given(data=st.data())
def test_fuzzed_metadata_is_read_correctly_or_refused(sharded, tmp_path_factory, data):
    """``shardlib.json`` edited: its bytes (v3: the checksum catches them; v2: no checksum, the schema checks
    must), or its structure with a fresh checksum (v3, one edit: several consistent edits make another valid
    document, e.g. two pieces' files exchanged). Opening, ``problems()`` (verify) and reading every tensor either
    give the original tensors bitwise (same dtype and shape) or raise CheckpointError."""
    directory, originals = sharded
    work = tmp_path_factory.getbasetemp() / "fuzzed-metadata"
    if not work.exists():
        work.mkdir()
        for file in directory.iterdir():
            if file.name != "shardlib.json":
                os.link(file, work / file.name)
    document = json.loads((directory / "shardlib.json").read_text())
    document.pop("metadata_checksum")
    mode = data.draw(st.sampled_from(["v3 structure", "v2 bytes", "v3 bytes"]))
    if mode == "v3 structure":
        raw = _edit_structure(data, document).encode()
        if not _has_duplicates(raw):  # (a document with two members of one name is written as it is)
            raw = fmt.document_text(json.loads(raw)).encode()
    else:
        text = fmt.document_text(document) if mode == "v3 bytes" else json.dumps(
            {**document, "format": "shardlib-sharded-v2"}, indent=1)
        raw = _edit_bytes(data, text.encode(), 0, len(text))
    (work / "shardlib.json").write_bytes(raw)
    start = time.monotonic()
    with reads_in_bounds():
        try:
            reader = ckpt.ShardedCheckpoint(work)
        except CheckpointError as exc:
            assert len(str(exc).splitlines()) == 1
            event(f"{mode}: refused")
            return
        event(f"{mode}: opened")
        with reader:
            for problem in reader.problems():
                assert "\n" not in problem
            for name in reader.tensors:
                try:
                    tensor = reader.read(name, None, 0, None)
                except CheckpointError:
                    event(f"{mode}: a tensor refused")
                    continue
                assert name in originals, f"{name}: a tensor the checkpoint does not hold was read"
                assert tensor.dtype == originals[name].dtype and tensor.shape == originals[name].shape, name
                assert _raw_bytes(tensor) == _raw_bytes(originals[name]), name
    assert time.monotonic() - start < 10


def _has_duplicates(raw: bytes) -> bool:
    found = []

    def hook(pairs):
        found.append(len({k for k, _ in pairs}) != len(pairs))
        return dict(pairs)

    json.loads(raw, object_pairs_hook=hook)
    return any(found)
