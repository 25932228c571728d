"""Real multi-process runs through the `shardlib` command: the demo end to end, and a failing rank."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARDLIB = [sys.executable, "-m", "shardlib.cli"]


def _run(args, timeout=240):
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([*SHARDLIB, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_demo_losses_match_on_two_ranks():
    result = _run(["run", "--nproc", "2", "examples/bert_tp_demo.py", "--layers", "2", "--hidden", "64",
                   "--heads", "4", "--vocab", "1001", "--steps", "3", "--seq", "16"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MATCH" in result.stdout and "tp=2 loss" in result.stdout


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


def test_help_and_bad_arguments():
    assert _run(["run", "--help"]).returncode == 0
    bad = _run(["run", "--nproc", "0", "x.py"])
    assert bad.returncode != 0 and "--nproc must be >= 1" in bad.stderr
