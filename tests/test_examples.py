"""The example scripts end to end, in real processes (``python -m shardlib.cli run`` and self-launch through
``--nproc``), with a few steps each: the ViT demo at tp=2 x pp=2 follows the unsharded model, the T5 example prints
the same first losses in one process and on dp=2 x tp=2, the BERT example runs a short fit with evaluation."""

from __future__ import annotations

import os
import re
import subprocess

from profiles import ci_only
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["--progress", "false"]


def _run(args, timeout=240):
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def _first_losses(stdout: str) -> list[float]:
    match = re.search(r"first losses: \[([^\]]*)\]", stdout)
    assert match, stdout[-2000:]
    return [float(x) for x in match.group(1).split(",")]


def test_vit_digits_demo_tp2_pp2_matches_unsharded_loss():
    out = _run(["-m", "shardlib.cli", "run", "--nproc", "4", "examples/vit_digits_demo.py", "--max-steps", "3",
                *QUIET])
    assert "Mesh(dp=1, pp=2, tp=2" in out
    assert "MATCH: the sharded model follows the unsharded one" in out, out
    assert re.search(r"final test accuracy \d+\.\d%", out), out


@ci_only("about 28 s; one script from one process to a mesh: with test_train_processes' world-of-one test, "
         "the two CI-profile checks of it")
def test_t5_seq2seq_same_first_losses_in_one_process_and_on_dp2_tp2():
    options = ["examples/t5_seq2seq.py", "--max-steps", "3", "--eval-interval", "3", *QUIET]
    alone = _run(options)
    launched = _run([*options, "--nproc", "4", "--tp", "2"])  # the script starts its own 4 ranks
    assert "Mesh(dp=1, pp=1, tp=1" in alone and "Mesh(dp=2, pp=1, tp=2" in launched
    one, four = _first_losses(alone), _first_losses(launched)
    assert len(one) == 3 and all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(one, four)), (one, four)
    for out in (alone, launched):  # greedy generations through generate(), tensor-parallel in the second run
        assert out.count("  sort(") == 4, out


@ci_only("about 15 s; Trainer.fit at tp=2 is covered by the demo test and test_train.py on the rank pool")
def test_bert_sst2_short_fit_at_tp2():
    out = _run(["-m", "shardlib.cli", "run", "--nproc", "2", "examples/bert_sst2.py", "--tp", "2", "--max-steps", "4",
                "--train-samples", "128", "--eval-samples", "50", "--eval-interval", "2", *QUIET])
    assert "Mesh(dp=1, pp=1, tp=2" in out
    assert re.search(r"held-out accuracy by step: 2: \d+\.\d% 4: \d+\.\d%", out), out
    assert re.search(r"trained 4 steps .* final accuracy \d+\.\d%", out), out


@ci_only("about 20 s; from_pretrained's overrides, the warning and the new head's agreement are test_finetune's")
def test_finetune_head_reloads_with_plain_transformers(tmp_path):
    out = _run(["-m", "shardlib.cli", "run", "--nproc", "2", "examples/finetune_head.py", "--tp", "2",
                "--max-steps", "6", "--train-samples", "256", "--eval-samples", "60", "--base", str(tmp_path / "base"),
                "--export", str(tmp_path / "export"), *QUIET])
    assert "Mesh(dp=1, pp=1, tp=2" in out and "wrote a randomly initialized BertModel" in out
    match = re.search(r"predictions agree on (\d+)% of 50 sentences, max \|logit difference\| ([0-9.e+-]+)", out)
    assert match and match.group(1) == "100" and float(match.group(2)) < 1e-5, out
