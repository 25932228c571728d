"""Real multi-process runs through the `shardlib` command: the demo end to end, and a failing rank."""

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from profiles import ci_only

ROOT = Path(__file__).resolve().parents[1]
# the console script pip installed (every launch here also checks the entry point), else the module
_SCRIPT = Path(sys.executable).with_name("shardlib")
SHARDLIB = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "shardlib.cli"]


def _run(args, timeout=240):
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([*SHARDLIB, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@ci_only("about 15 s; the demo's tp x pp equivalence is test_examples' demo test, the launcher the kill tests here")
def test_demo_losses_match_on_two_ranks():
    result = _run(["run", "--nproc", "2", "examples/bert_tp_demo.py", "--layers", "2", "--hidden", "64",
                   "--heads", "4", "--vocab", "1001", "--steps", "3", "--seq", "16"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MATCH" in result.stdout and "tp=2 loss" in result.stdout


@ci_only("about 13 s; all-to-all equivalence runs on the rank pool in test_all_to_all.py")
def test_demo_all_to_all_sequence_parallel_matches_on_two_ranks():
    result = _run(["run", "--nproc", "2", "examples/bert_tp_demo.py", "--layers", "2", "--hidden", "64",
                   "--heads", "4", "--vocab", "1001", "--steps", "3", "--seq", "15", "--sp", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MATCH" in result.stdout and "tp=1 sp=2 loss" in result.stdout


@ci_only("about 21 s; T5 pipelines are checked on the rank pool in test_pipeline.py")
def test_t5_example_trains_and_generates_through_the_pipeline():
    result = _run(["run", "--nproc", "4", "examples/t5_reverse_demo.py", "--steps", "4", "--length", "3"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exact reversals" in result.stdout and " -> " in result.stdout


@ci_only("about 15 s; in the dev profile the launcher's teardown naming the failed rank is "
         "test_rank_killed_mid_pipeline_step_ends_the_job's")
def test_failing_rank_stops_the_job_with_its_rank(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import os, torch, shardlib
        mesh = shardlib.init_mesh(tp=2)
        if int(os.environ["RANK"]) == 1:
            raise RuntimeError("boom on purpose")
        torch.distributed.barrier()  # rank 0 would wait forever without the launcher's teardown
    """))
    result = _run(["run", "--nproc", "2", str(script)], timeout=120)
    assert result.returncode == 1
    assert "boom on purpose" in result.stderr
    assert "rank 1" in result.stderr and "failed" in result.stderr


def test_help_and_bad_arguments(capsys):
    """In this process (``shardlib.cli.main``): the launches below are the subprocesses."""
    from shardlib.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--help"])
    assert exit_info.value.code == 0 and "--nproc" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--nproc", "0", "x.py"])
    assert exit_info.value.code != 0 and "--nproc must be >= 1" in capsys.readouterr().err


def test_rank_killed_mid_pipeline_step_ends_the_job(tmp_path):
    """pp=2: rank 1 dies inside its stage's forward on the second step; rank 0 is then blocked in a pipeline
    send/recv. The job must end with an error naming the rank, well within a minute, not hang."""
    script = tmp_path / "kill.py"
    script.write_text(textwrap.dedent("""
        import os, torch, shardlib
        from transformers import BertConfig, BertForSequenceClassification
        from shardlib.train import Trainer
        mesh = shardlib.init_mesh(pp=2)
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                         num_attention_heads=2, intermediate_size=32))
        model = shardlib.shard(model, mesh)
        trainer = Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), microbatches=2)
        calls = []
        def die(*_):
            calls.append(1)
            if int(os.environ["RANK"]) == 1 and len(calls) > 3:
                os._exit(7)
        for layer in model.bert.encoder.layer:
            layer.register_forward_hook(die)
        batch = {"input_ids": torch.randint(0, 50, (4, 8)), "labels": torch.randint(0, 2, (4,))}
        for _ in range(5):
            trainer.train_step(batch)
    """))
    start = time.monotonic()
    result = _run(["run", "--nproc", "2", str(script)], timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-2000:]
    assert "rank 1" in result.stderr and "failed" in result.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s"


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from Linux's /proc/net")
def test_single_node_run_listens_on_loopback_only(tmp_path):
    """`shardlib run` on one node: MASTER_ADDR is 127.0.0.1, and every socket the launcher (the rendezvous store,
    which the ranks share as their MASTER_PORT store) and the ranks (gloo) listen on is bound to 127.0.0.1, not
    to every interface as torch's --standalone store is. About 5 s."""
    script = tmp_path / "listening.py"
    script.write_text(textwrap.dedent(r"""
        import os, torch.distributed as dist
        dist.init_process_group("gloo")
        def socket_inodes(pid):
            out = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:  # the listing's own descriptor is gone by now
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except FileNotFoundError:
                    continue
                if link.startswith("socket:["):
                    out.add(link[len("socket:["):-1])
            return out
        ours = socket_inodes(os.getpid()) | socket_inodes(os.getppid())  # this rank and the launcher
        listening = []  # local addresses (hex ip:port) in state LISTEN (0A)
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for row in open(table).read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in ours:
                    listening.append(fields[1])
        line = (f"rank {dist.get_rank()} MASTER_ADDR={os.environ['MASTER_ADDR']} "
                f"MASTER_PORT={os.environ['MASTER_PORT']} listening={','.join(sorted(listening))}\n")
        os.write(1, line.encode())  # one write: the ranks' lines do not interleave (python -u writes "\n" apart)
        dist.barrier()
    """))
    result = _run(["run", "--nproc", "2", str(script)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(r"^rank (\d) MASTER_ADDR=(\S+) MASTER_PORT=(\d+) listening=(\S*)$", result.stdout, re.M)
    assert sorted(rank for rank, *_ in lines) == ["0", "1"], result.stdout
    for _, address, port, listening in lines:
        assert address == "127.0.0.1"
        sockets = listening.split(",")
        assert f"0100007F:{int(port):04X}" in sockets  # the store, on 127.0.0.1:MASTER_PORT
        assert all(s.startswith("0100007F:") for s in sockets), sockets  # nothing on 0.0.0.0 / [::]


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "FutureWarning" in line or "DeprecationWarning" in line]


def test_the_planner_warns_nothing(tmp_path):
    """Every warning shown (PYTHONWARNINGS=default): the dry run and the search of `shardlib plan` print none of
    torch's deprecations (shardlib calls all_gather_single / reduce_scatter_single where torch has them)."""
    from transformers import BertConfig

    BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=64,
               architectures=["BertForMaskedLM"]).save_pretrained(tmp_path)
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "default"}
    for args in (["--tp", "2", "--pp", "2"], ["--world", "4", "--memory", "1GiB"]):
        done = subprocess.run([*SHARDLIB, "plan", str(tmp_path), *args], capture_output=True, text=True, timeout=240,
                              env=env, cwd=ROOT)
        assert done.returncode == 0 and not _warnings(done.stderr), done.stderr[-3000:]


@ci_only("about 15 s; the planner's half runs in the dev profile")
def test_a_launched_run_warns_nothing():
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "default"}
    done = subprocess.run([*SHARDLIB, "run", "--nproc", "2", "examples/bert_tp_demo.py", "--layers", "2", "--hidden",
                           "64", "--heads", "4", "--vocab", "1001", "--steps", "2", "--seq", "16"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0 and not _warnings(done.stderr), done.stderr[-3000:]
