"""The ``shardlib`` command line in this process: --version, help and examples, convert's progress, inspect's bytes
per rank, and the arguments ``run`` hands torchrun (the real single-node launch on loopback is in
test_launcher.py)."""

import argparse
import importlib.metadata
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig, BertForMaskedLM

from shardlib import cli
from shardlib.checkpoint import ShardedCheckpoint
from shardlib.train import launch

CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An HF checkpoint of a small BERT and its conversion to tp=2 x pp=2 (quietly: stderr is no terminal)."""
    root = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(**CONFIG)).save_pretrained(root / "hf")
    assert cli.main(["convert", str(root / "hf"), str(root / "tp2pp2"), "--tp", "2", "--pp", "2"]) == 0
    return root


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_version_in_process(capsys):
    """(The installed entry point itself runs every launch of test_launcher.py.)"""
    expected = f"shardlib {importlib.metadata.version('shardlib')}"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == expected


def test_version_without_installed_metadata_is_the_package_version(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    import shardlib

    assert cli.version() == shardlib.__version__


def test_every_option_has_help_and_every_subcommand_an_example():
    parser = cli.build_parser()
    commands = _subcommands(parser)
    assert set(commands) == {"run", "convert", "inspect", "verify", "plan", "calibrate", "plot"}
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)
        assert sub.epilog.startswith("example") and f"\n  shardlib {name} " in sub.epilog, name
        assert f"\n  shardlib {name} " in sub.format_help(), name  # the example's line breaks survive formatting


def _bar_lines(err: str) -> list[str]:
    return [line for line in re.split(r"[\r\n]", err) if "%|" in line]


def test_convert_progress_has_totals_and_time_left(checkpoints, tmp_path, capsys):
    total = cli._source_bytes(checkpoints / "hf")
    state = BertForMaskedLM.from_pretrained(checkpoints / "hf").state_dict()
    stored = {t.data_ptr(): t.numel() * t.element_size() for t in state.values()}  # tied weights once
    assert total == sum(stored.values()) == cli._source_bytes(checkpoints / "tp2pp2")
    capsys.readouterr()
    assert cli.main(["convert", str(checkpoints / "hf"), str(tmp_path / "a"), "--tp", "2", "--progress"]) == 0
    assert cli.main(["convert", str(tmp_path / "a"), str(tmp_path / "b"), "--to", "hf", "--progress"]) == 0
    bars = _bar_lines(capsys.readouterr().err)
    finished = [line for line in bars if re.match(r"\S+ -> \S+: 100%\|", line)]
    assert len(finished) == 2, bars  # each run ends at 100% of a total known from the start
    for line in bars:  # every update, the first included, shows done/total and elapsed<remaining
        assert re.search(r"\d+(\.\d+)?k?/\d+(\.\d+)?k \[\d\d:\d\d<(\d\d:\d\d|\?)", line), line


def test_convert_progress_only_on_a_terminal_unless_asked(checkpoints, tmp_path, capsys, monkeypatch):
    src = str(checkpoints / "hf")
    assert cli.main(["convert", src, str(tmp_path / "quiet"), "--tp", "2"]) == 0
    assert _bar_lines(capsys.readouterr().err) == []  # stderr is no terminal here
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main(["convert", src, str(tmp_path / "tty"), "--tp", "2"]) == 0
    assert _bar_lines(capsys.readouterr().err)
    assert cli.main(["convert", src, str(tmp_path / "off"), "--tp", "2", "--no-progress"]) == 0
    assert _bar_lines(capsys.readouterr().err) == []


def test_convert_with_progress_of_a_missing_source_is_one_line(tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path / "absent"), str(tmp_path / "out"), "--progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardlib convert: ") and "absent" in err[0]


def _stored_bytes(path: Path) -> int:
    return sum(t.numel() * t.element_size() for t in load_file(path).values())


def test_inspect_bytes_per_rank_and_per_file(checkpoints, capsys):
    directory = checkpoints / "tp2pp2"
    ckpt = ShardedCheckpoint(directory, verify=False)
    per_file = cli.data_bytes_by_file(ckpt)
    # the pieces' arithmetic agrees with the tensors the files really hold
    assert per_file == {f.name: _stored_bytes(f) for f in directory.glob("*.safetensors")}
    ranks = cli.bytes_by_rank(2, per_file)
    assert set(ranks) == {(stage, tp, None) for stage in (0, 1) for tp in (0, 1)}
    for (stage, tp, _), (sharded, replicated) in ranks.items():
        assert sharded == per_file[f"model-pp{stage:02d}-tp{tp:02d}-of-02.safetensors"] > 0
        assert replicated == per_file[f"model-pp{stage:02d}-replicated.safetensors"] > 0
    capsys.readouterr()
    assert cli.main(["inspect", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "tp=2  pp=2" in out.splitlines()[0]
    rows = re.findall(r"^  (pp=\d tp=\d)\s+\S+ \w+\s+\S+ \w+\s+\S+ \w+$", out, re.M)
    assert rows == ["pp=0 tp=0", "pp=0 tp=1", "pp=1 tp=0", "pp=1 tp=1"], out
    for name in per_file:
        assert re.search(rf"^{re.escape(name)}\s+\S+ \w+\s+\S+ \w+  xxh3_128 [0-9a-f]{{16}}$", out, re.M), name


def test_inspect_without_a_pipeline_lists_tp_ranks(checkpoints, tmp_path, capsys):
    assert cli.main(["convert", str(checkpoints / "tp2pp2"), str(tmp_path / "tp4"), "--tp", "4"]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "tp4")]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^  (tp=\d) ", out, re.M) == ["tp=0", "tp=1", "tp=2", "tp=3"]
    assert "pp=" not in out


def test_bytes_by_rank_with_optimizer_state_partitioned_over_dp():
    per_file = {"model-tp00-of-02.safetensors": 10, "model-tp01-of-02.safetensors": 11,
                "model-replicated.safetensors": 5, "model-tp00-of-02-dp00.safetensors": 100,
                "model-tp00-of-02-dp01.safetensors": 200, "model-tp01-of-02-dp01.safetensors": 300,
                "model-replicated-dp01.safetensors": 7, "trainer-state-rank0.pt": 1000}
    assert cli.bytes_by_rank(2, per_file) == {(None, 0, 0): (110, 5), (None, 1, 0): (11, 5),
                                              (None, 0, 1): (210, 12), (None, 1, 1): (311, 12)}


def _torchrun_arguments(monkeypatch, **kwargs) -> tuple[list[str], dict]:
    import torch.distributed.run

    seen = {}

    def fake_torchrun(args):
        seen["args"], seen["env"] = list(args), dict(os.environ)

    monkeypatch.setattr(torch.distributed.run, "main", fake_torchrun)
    assert launch.run(2, "train.py", ["--tp", "2"], **kwargs) == 0
    return seen["args"], seen["env"]


def test_single_node_run_rendezvous_on_loopback_and_environment_restored(monkeypatch):
    for name in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    args, env = _torchrun_arguments(monkeypatch)
    assert args[args.index("--rdzv-backend") + 1] == launch.LOOPBACK_RENDEZVOUS
    assert args[args.index("--rdzv-endpoint") + 1] == "127.0.0.1:0" and "--standalone" not in args
    assert args[-3:] == ["train.py", "--tp", "2"] and env["OMP_NUM_THREADS"] == "1"
    if Path("/sys/class/net/lo").exists():
        assert env["GLOO_SOCKET_IFNAME"] == "lo"
    assert "OMP_NUM_THREADS" not in os.environ and "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's own setting wins
    assert _torchrun_arguments(monkeypatch)[1]["GLOO_SOCKET_IFNAME"] == "eth7"


def test_multi_node_run_uses_the_c10d_rendezvous_with_a_store_per_round(monkeypatch):
    """torch's c10d rendezvous behind shardlib's wrapper (a new ranks' store every round; unshared, so a node that
    joins later learns each round's address)."""
    args, env = _torchrun_arguments(monkeypatch, nnodes="2", node_rank=1, rdzv_endpoint="node0:29400")
    assert args[args.index("--rdzv-backend") + 1] == launch.ELASTIC_RENDEZVOUS
    assert env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"
    assert args[args.index("--rdzv-endpoint") + 1] == "node0:29400"
    assert args[args.index("--node-rank") + 1] == "1"
    assert env.get("GLOO_SOCKET_IFNAME") == os.environ.get("GLOO_SOCKET_IFNAME")  # gloo left on the network


def test_max_restarts_reaches_torchrun_from_both_launch_paths(monkeypatch, capsys):
    """``shardlib run --max-restarts 3`` and ``python train.py --nproc 2 --max-restarts 3`` hand torchrun 3;
    a negative count is refused before anything starts."""
    import shardlib.train.args as train_args

    args, _ = _torchrun_arguments(monkeypatch, max_restarts=3)
    assert args[args.index("--max-restarts") + 1] == "3"
    seen = {}
    monkeypatch.setattr(launch, "run", lambda nproc, script, argv, **kw: seen.update(kw) or 0)
    with pytest.raises(SystemExit):
        train_args.parse_args(args=["--nproc", "2", "--max-restarts", "3"])
    assert seen == {"max_restarts": 3}
    with pytest.raises(SystemExit) as stop:  # a bad value on the command line ends as argparse ends: one line
        train_args.parse_args(args=["--max-restarts", "-1"], launch=False)
    assert stop.value.code == 2 and "--max-restarts must be >= 0, got -1" in capsys.readouterr().err
    # under a launcher started without restarts (`shardlib run --nproc 2 train.py --max-restarts 3`): refused
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="give it to the launcher, before the script"):
        train_args.parse_args(args=["--max-restarts", "3"])
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")  # what a self-launched rank sees: fine
    assert train_args.parse_args(args=["--max-restarts", "3"]).max_restarts == 3


def test_loopback_rendezvous_refuses_several_nodes():
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    params = RendezvousParameters(launch.LOOPBACK_RENDEZVOUS, "127.0.0.1:0", "run", 1, 2)
    with pytest.raises(ValueError, match="is for one node"):
        launch._loopback_rendezvous(params)


def test_convert_to_hf_refuses_a_layout_it_would_ignore(checkpoints, tmp_path, capsys):
    """``--to hf --tp 4`` once wrote an unsharded checkpoint silently ignoring --tp: now one line, nothing written."""
    assert cli.main(["convert", str(checkpoints / "tp2pp2"), str(tmp_path / "hf"), "--to", "hf", "--tp", "4"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tp 4 --pp 1: an HF checkpoint is unsharded" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("damage, field", [
    (lambda doc: doc.pop("tensors"), "field 'tensors' missing"),
    (lambda doc: doc["files"].popitem(), "is not listed in 'files'"),
    (lambda doc: doc.update(tp="two"), "field 'tp' missing or not a int"),
])
def test_malformed_metadata_is_one_line_naming_the_file_and_field(checkpoints, tmp_path, capsys, damage, field):
    import json
    import shutil

    from shardlib.checkpoint.format import document_text

    directory = tmp_path / "ck"
    shutil.copytree(checkpoints / "tp2pp2", directory)
    document = json.loads((directory / "shardlib.json").read_text())
    damage(document)
    (directory / "shardlib.json").write_text(document_text({k: v for k, v in document.items()
                                                            if k != "metadata_checksum"}))
    for command in ("inspect", "verify"):
        assert cli.main([command, str(directory)]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "shardlib.json" in err and field in err, err
    (directory / "shardlib.json").write_text("[1, 2]")
    assert cli.main(["inspect", str(directory)]) == 1
    assert "a JSON list, expected an object" in capsys.readouterr().err
