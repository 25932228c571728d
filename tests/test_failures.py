"""Failures handled without a person: real processes under ``shardlib run --max-restarts N`` (torchrun's elastic
agent) running tests/chaos_script.py, with ranks SIGKILLed by a seeded schedule (mid-step, mid-save, mid-eval),
and a two-"node" loopback job (``--nnodes 1:2``) that loses a node, continues at half dp, and grows back.

Time lost per failure (from the kill to the first step of the restarted attempt) is printed (``-s``) and measured
against a fresh start in docs/benchmarks/training-runs.md ("Restarts: time lost per failure")."""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from profiles import ci_only

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "chaos_script.py"


def _env():
    return {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_job(nproc: int, save_dir: Path, args: list[str], *, max_restarts: int = 0, faults: list[dict] = (),
            timeout: float = 600, self_launch: bool = False) -> dict:
    """``shardlib run`` of the chaos script (``self_launch``: ``python chaos_script.py --nproc N``); its FINAL
    record (digests per rank, world, step)."""
    extra = []
    if faults:
        (save_dir / "faults.json").parent.mkdir(parents=True, exist_ok=True)
        (save_dir / "faults.json").write_text(json.dumps(list(faults)))
        extra = ["--faults", str(save_dir / "faults.json")]
    restarts = ["--max-restarts", str(max_restarts)]  # shardlib run's options come before the script
    launch = [SCRIPT, "--nproc", str(nproc), *restarts] if self_launch else \
        ["-m", "shardlib.cli", "run", "--nproc", str(nproc), *restarts, SCRIPT]
    result = subprocess.run([sys.executable, *launch, *args, "--save-dir", str(save_dir), *extra],
                            capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT / "tests")
    assert result.returncode == 0, _story(result.stderr)
    return final_record(result.stdout, result.stderr)


def _story(log: str) -> str:
    """What a failed job's log says about its attempts (the launcher's and fit's lines), then its last lines."""
    marks = ("restart", "resum", "exitcode", "failed", "Error:", "no complete checkpoint")
    lines = [line[:300] for line in log.splitlines() if any(m in line for m in marks)]
    return "\n".join(lines[-40:]) + "\n--- last lines ---\n" + log[-2500:]


def final_record(stdout: str, log: str = "") -> dict:
    line = next((line for line in stdout.splitlines() if line.startswith("FINAL ")), None)
    assert line is not None, log[-3000:]
    return json.loads(line[len("FINAL "):])


def records(save_dir: Path, name: str) -> list[dict]:
    path = save_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def seconds_lost(save_dir: Path) -> list[float]:
    """Per kill: from the kill to the first step the next attempt finished."""
    kills, steps = records(save_dir, "kills.jsonl"), records(save_dir, "steps.jsonl")
    return [min(s["time"] for s in steps if s["attempt"] == k["attempt"] + 1) - k["time"] for k in kills]


def assert_replays_equal(save_dir: Path) -> dict[int, float]:
    """Every step trained more than once (an attempt's steps after its checkpoint, replayed by the next attempt)
    has bitwise the same loss each time; the losses by step."""
    by_step: dict[int, float] = {}
    for record in records(save_dir, "steps.jsonl"):
        seen = by_step.setdefault(record["step"], record["loss"])
        assert seen == record["loss"], f"step {record['step']}: {seen} before the restart, {record['loss']} after"
    return by_step


def chaos_schedule(seed: int, nproc: int, steps: int, save_interval: int, eval_interval: int) -> list[dict]:
    """Three kills in attempts 0, 1, 2 of a random rank each, at increasing steps: one mid-step, one mid-save (a
    checkpoint step), one mid-eval (an evaluation step), in a random order."""
    rng = random.Random(seed)
    wheres = rng.sample(["step", "save", "eval"], 3)
    third = steps // 3
    faults = []
    for attempt, where in enumerate(wheres):
        low, high = attempt * third + 2, (attempt + 1) * third - 1
        every = {"step": 1, "save": save_interval, "eval": eval_interval}[where]
        choices = [s for s in range(low, high + 1) if s % every == 0]
        faults.append({"attempt": attempt, "rank": rng.randrange(nproc), "where": where, "step": rng.choice(choices)})
    return faults


def test_a_killed_rank_is_restarted_and_the_replayed_steps_are_bitwise_equal(tmp_path):
    """The dev profile's short chaos: 2 ranks (dp=2, dropout on) that the script starts itself (``python
    chaos_script.py --nproc 2 --max-restarts 1``), one SIGKILL mid-step after the first checkpoint: the job
    finishes by itself, the restarted attempt resumes from the checkpoint and trains
    the replayed steps to bitwise the same losses, and the log names checkpoint, step and replayed samples."""
    args = ["--dp", "2", "--max-steps", "8", "--batch-size", "8", "--save-interval", "3", "--log-interval", "1",
            "--no-progress", "--samples", "64", "--no-async-save"]  # step 3's checkpoint is complete before step 4
    final = run_job(2, tmp_path, args, max_restarts=1, faults=[{"attempt": 0, "rank": 1, "where": "step", "step": 5}],
                    self_launch=True)
    assert final["step"] == 8 and final["digests"][0] == final["digests"][1]
    steps = records(tmp_path, "steps.jsonl")
    assert [s["step"] for s in steps if s["attempt"] == 1] == [4, 5, 6, 7, 8], "resumed from the step-3 checkpoint"
    assert_replays_equal(tmp_path)
    print(f"\nseconds lost per failure: {[round(s, 1) for s in seconds_lost(tmp_path)]}")


@ci_only("about 4-5 minutes: a 60-step run with three restarts and its uninterrupted reference on 4 ranks")
def test_chaos_three_kills_end_bitwise_equal_to_the_uninterrupted_run(tmp_path):
    """60 steps of BERT at dp=2 x tp=2 (dropout on), a checkpoint every 5 steps, an evaluation every 10: a seeded
    schedule SIGKILLs a random rank 3 times (mid-step, mid-save, mid-eval, random order); under ``--max-restarts 3``
    the job finishes with every rank's parameters and optimizer state bitwise equal to the uninterrupted run."""
    args = ["--dp", "2", "--tp", "2", "--max-steps", "60", "--batch-size", "8", "--save-interval", "5",
            "--eval-interval", "10", "--log-interval", "1", "--no-progress"]
    faults = chaos_schedule(seed=27, nproc=4, steps=60, save_interval=5, eval_interval=10)
    chaos = run_job(4, tmp_path / "chaos", args, max_restarts=3, faults=faults, timeout=900)
    clean = run_job(4, tmp_path / "clean", args, timeout=600)
    kills = records(tmp_path / "chaos", "kills.jsonl")
    assert [(k["attempt"], k["where"]) for k in kills] == [(f["attempt"], f["where"]) for f in faults], kills
    assert chaos == clean, "final parameters or optimizer state differ from the uninterrupted run"
    losses = assert_replays_equal(tmp_path / "chaos")
    assert losses == assert_replays_equal(tmp_path / "clean")
    print(f"\nfaults {faults}; seconds lost per failure: {[round(s, 1) for s in seconds_lost(tmp_path / 'chaos')]}")


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc): a "node" is its agent and the workers it started."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def _wait_for_step(save_dir: Path, step: int, world: int, nodes, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(s["step"] >= step and s["world"] == world for s in records(save_dir, "steps.jsonl")):
        assert time.monotonic() < deadline, f"no step {step} at world {world} within {timeout} s"
        assert all(n.poll() is None for n in nodes), "a node exited early"
        time.sleep(0.2)


@ci_only("about 2-3 minutes: two 2-rank nodes, a lost node's rendezvous, and a rejoin")
def test_a_lost_node_shrinks_dp_and_a_returning_node_grows_it_back(tmp_path):
    """Two "nodes" of 2 ranks (tp=2 each, dp=2 across) on loopback, ``--nnodes 1:2 --max-restarts 3``, dropout off:
    node 1 (agent and ranks) is SIGKILLed after step 10; node 0 continues alone at dp=1 from the newest checkpoint;
    node 1 starts again and the job grows back to dp=2. ``--microbatch-size 2`` keeps each rank's microbatch: 2
    microbatches per step at dp=2, 4 at dp=1. Every step's loss equals the uninterrupted dp=2 run's
    within float32 rounding (the cross-layout resume tolerance); the global batch and sample order are unchanged."""
    from shardlib.train.launch import _loopback_store

    store, port = _loopback_store(datetime.timedelta(seconds=300))  # the rendezvous store, on 127.0.0.1 only
    args = ["--tp", "2", "--dropout", "0", "--max-steps", "48", "--batch-size", "8", "--microbatch-size", "2",
            "--save-interval", "4", "--log-interval", "1", "--no-progress"]
    slow = ["--step-seconds", "0.5"]  # node 0 alone must not finish before node 1 is back
    save_dir = tmp_path / "elastic"
    save_dir.mkdir()

    def node(rank: int):
        return subprocess.Popen(
            [sys.executable, "-m", "shardlib.cli", "run", "--nproc", "2", "--nnodes", "1:2", "--node-rank", str(rank),
             "--max-restarts", "3", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf",
             "is_host=false,last_call_timeout=5", SCRIPT, *args, *slow, "--save-dir", str(save_dir)],
            cwd=ROOT / "tests", env=_env(), stdout=open(save_dir / f"node{rank}.out", "a"), stderr=subprocess.STDOUT)

    nodes = [node(0), node(1)]
    try:
        _wait_for_step(save_dir, 10, 4, nodes)
        for pid in _descendants(nodes[1].pid):
            os.kill(pid, signal.SIGKILL)
        nodes[1].wait()
        lost_at = time.time()
        _wait_for_step(save_dir, 1, 2, nodes[:1])
        nodes[1] = node(1)
        back_at = time.time()
        assert nodes[0].wait(timeout=400) == 0, (save_dir / "node0.out").read_text()[-3000:]
        assert nodes[1].wait(timeout=60) == 0, (save_dir / "node1.out").read_text()[-3000:]
    finally:
        for n in nodes:
            if n.poll() is None:
                for pid in _descendants(n.pid):
                    os.kill(pid, signal.SIGKILL)
        del store
    steps = records(save_dir, "steps.jsonl")
    worlds = [s["world"] for s in steps]
    assert worlds[0] == 4 and 2 in worlds and worlds[-1] == 4 and steps[-1]["step"] == 48, worlds
    elastic = {s["step"]: s["loss"] for s in steps}  # the last time each step was trained
    clean_dir = tmp_path / "clean"
    run_job(4, clean_dir, args)
    clean = {s["step"]: s["loss"] for s in records(clean_dir, "steps.jsonl")}
    assert elastic.keys() == clean.keys()
    for step in clean:
        assert abs(elastic[step] - clean[step]) <= 1e-5 * abs(clean[step]), (step, elastic[step], clean[step])
    shrunk = min(s["time"] for s in steps if s["world"] == 2)
    grown = min(s["time"] for s in steps if s["world"] == 4 and s["time"] > back_at)
    print(f"\nnode lost -> first step at dp=1: {shrunk - lost_at:.1f} s; node started again -> first step at dp=2: "
          f"{grown - back_at:.1f} s")
