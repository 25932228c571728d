"""Real processes: one training script (tests/train_script.py) run as plain ``python`` (a world of one), starting its
own ranks (``--nproc``), under ``shardlib run`` on two "nodes" over loopback, and SIGKILLed mid-step and mid-save then
resumed with ``--resume auto``: the resumed run logs the uninterrupted run's losses bitwise, dropout on.

The killed runs train at dp=2 with ZeRO-2 (partitioned optimizer state and gradients) in fp16 with a loss scale
that starts too high (2**24, backing off 8x per overflow, growing every 4 clean steps): steps 1-2 overflow and are
skipped, so the checkpoint of step 3 holds a non-trivial scaler state that the resumed run must continue."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from profiles import ci_only

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "tests/train_script.py"
RUN = ["--dp", "2", "--zero", "2", "--precision", "fp16", "--initial-scale", str(2 ** 24), "--hysteresis", "1",
       "--backoff-factor", "0.125", "--growth-interval", "4", "--max-steps", "6", "--batch-size", "8", "--microbatches", "2", "--save-interval", "3",
       "--log-interval", "1", "--no-progress"]


def _env():
    return {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def python(*args, timeout=240):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=ROOT)


def launch(nproc, *args, timeout=240):
    return python("-m", "shardlib.cli", "run", "--nproc", str(nproc), SCRIPT, *args, timeout=timeout)


def losses(result) -> dict[int, float]:
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("LOSSES "))
    return {int(k): v for k, v in json.loads(line[len("LOSSES "):]).items()}


def logged_losses(save_dir: Path) -> dict[int, tuple]:
    """step -> (loss, loss scale, steps skipped so far) from the run's log.jsonl."""
    records = [json.loads(line) for line in (save_dir / "log.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["loss_scale"], r["skipped_steps"]) for r in records if not r.get("eval")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """6 steps at dp=2 (RUN) on 2 ranks that the script starts itself (``python train_script.py --nproc 2``)."""
    save_dir = tmp_path_factory.mktemp("straight")
    result = python(SCRIPT, "--nproc", "2", *RUN, "--save-dir", str(save_dir))
    logged = logged_losses(save_dir)
    assert logged[3][2] == 2 and logged[3][1] == 2 ** 18, logged  # two overflows skipped before the checkpoint
    return losses(result), logged


@ci_only("about 55 s with its uninterrupted reference run; in the dev profile a rank SIGKILLed mid-save is "
         "test_checkpoint_faults', the bitwise resume test_train's on the rank pool")
@pytest.mark.parametrize("where", ["step", "save"])
def test_killed_rank_resumes_bitwise(uninterrupted, tmp_path, where):
    """Rank 1 is SIGKILLed inside step 5's forward (resume from step 3), or while writing step 6's checkpoint (that
    checkpoint, the last, is torn: resume from step 3 again, and its temporary directory is cleaned up)."""
    uninterrupted, logged = uninterrupted
    assert sorted(uninterrupted) == list(range(1, 7))
    kill_at = {"step": 5, "save": 6}[where]
    killed = launch(2, *RUN, "--save-dir", str(tmp_path), "--kill-at-step", str(kill_at), "--kill-in", where)
    # the launcher names the first rank to fail: the killed one (exit code -9), or rank 0 when its collective with
    # the dead rank failed first; torchrun's own log names the SIGKILL either way
    assert killed.returncode != 0 and re.search(r"exit ?code:? -9", killed.stderr), killed.stderr[-2000:]
    complete = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith("."))
    assert complete == ["step-00000003"], complete
    resumed = losses(launch(2, *RUN, "--save-dir", str(tmp_path), "--resume", "auto"))
    assert min(resumed) == 4, "the run did not resume from step 3"
    assert resumed == {s: uninterrupted[s] for s in range(4, 7)}, "resumed losses differ from the uninterrupted run"
    assert logged_losses(tmp_path) == logged  # the log continues the killed run's, bitwise, loss scale too
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ci_only("about 28 s (two launches); the multi-rank launch is the demo test's and the kill tests', the world of one "
         "is test_trainer_args' (a Trainer without a mesh)")
def test_world_of_one_and_two_nodes_train_the_same_model(tmp_path):
    """``python train_script.py`` (no launcher: a world of one, tp=1) and tp=2 across two nodes on loopback
    (``shardlib run --nnodes 2 --node-rank K --rdzv-endpoint``) give the same first losses (float32 rounding)."""
    args = ["--max-steps", "2", "--batch-size", "4", "--dropout", "0", "--no-progress"]
    single = losses(python(SCRIPT, *args))
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "shardlib.cli", "run", "--nproc", "1", "--nnodes", "2",
                               "--node-rank", str(k), "--rdzv-endpoint", endpoint, SCRIPT, "--tp", "2", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
             for k in (0, 1)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    printed = [out for out, _ in outputs if "LOSSES" in out]
    assert len(printed) == 1, "exactly one rank (global rank 0) prints"
    two_nodes = losses(subprocess.CompletedProcess([], 0, printed[0], ""))
    assert two_nodes.keys() == single.keys()
    for step in single:
        assert abs(two_nodes[step] - single[step]) <= 1e-5 * abs(single[step]), (step, two_nodes, single)


@pytest.mark.parametrize("args, message", [
    (["--nproc", "3", "--tp", "2"], "--nproc 3 is not a multiple of pp(1) x sp(1) x tp(2) = 2"),
    (["--nproc", "4", "--tp", "2", "--dp", "1"], "--nproc 4 is more ranks than the mesh needs: dp(1) x pp(1) x sp(1) x "
                                                 "tp(2) = 2"),
    (["--nproc", "2", "--pp", "2", "--dp", "2"], "--nproc 2 is fewer ranks than the mesh needs"),
])
def test_bad_nproc_is_refused_before_any_rank_starts(monkeypatch, args, message):
    """Checked in this process before the launcher is called (which would start ranks)."""
    from shardlib import MeshError
    from shardlib.train import launch, parse_args

    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("ranks were started"))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(MeshError, match=re.escape(message)):
        parse_args(args=[*args, "--max-steps", "1"])


def test_launched_sequence_parallel_job_over_shared_memory_trains_the_same_model(tmp_path):
    """``shardlib run --nproc 2 train_script.py --tp 2 --sequence-parallel megatron``: on one host the tp group
    goes through shared memory by default, with the same first losses as the world of one, and nothing is left in
    /dev/shm."""
    args = ["--max-steps", "2", "--batch-size", "4", "--dropout", "0", "--no-progress"]
    single = losses(python(SCRIPT, *args))
    before = {p for p in os.listdir("/dev/shm") if p.startswith("shardlib-")}
    result = launch(2, "--tp", "2", "--sequence-parallel", "megatron", *args)
    assert "TRANSPORT shm: True" in result.stdout, result.stdout[-2000:]
    shm = losses(result)
    assert {p for p in os.listdir("/dev/shm") if p.startswith("shardlib-")} == before
    assert shm.keys() == single.keys()
    for step in single:
        assert abs(shm[step] - single[step]) <= 1e-5 * abs(single[step]), (step, shm, single)
