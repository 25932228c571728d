"""Time lost per failure under ``shardlib run --max-restarts N``, beside a fresh start of the same job.

Each round runs tests/chaos_script.py (small BERT, dropout on) twice on this machine: once uninterrupted, once with
a rank SIGKILLed mid-step at two points (``--max-restarts 2``). Printed per round and as the median (and spread) over
the rounds:

* kill to first new step: torchrun noticing the death, stopping the other ranks, starting new ones, imports, shard,
  resume, the first step;
* lost in all: that, plus re-training the other steps done between the resumed checkpoint and the kill (at the
  run's median step time);
* the baseline: a fresh job's time from launch to its first finished step (what any restart costs at least).

    python benchmarks/failure_recovery.py [--nproc 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--max-steps", "24", "--batch-size", "8", "--save-interval", "4", "--log-interval", "1", "--no-progress"]
FAULTS = [{"attempt": 0, "rank": 1, "where": "step", "step": 7}, {"attempt": 1, "rank": 0, "where": "step", "step": 18}]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def job(nproc: int, save_dir: Path, faults: list[dict] | None) -> float:
    """Run the job; return the seconds from launch to its first finished step."""
    extra = []
    if faults:
        save_dir.mkdir(parents=True)
        (save_dir / "faults.json").write_text(json.dumps(faults))
        extra = ["--faults", str(save_dir / "faults.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "shardlib.cli", "run", "--nproc", str(nproc), "--max-restarts",
                           str(len(faults or [])), "chaos_script.py", *ARGS, "--dp", str(nproc), "--save-dir",
                           str(save_dir), *extra], cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                          timeout=900)
    if done.returncode:
        sys.exit(f"the job in {save_dir} failed:\n{done.stderr[-3000:]}")
    return _records(save_dir / "steps.jsonl")[0]["time"] - start


def losses(save_dir: Path) -> list[tuple[float, float]]:
    """Per kill: (seconds from the kill to the first new step, seconds lost in all: that plus re-training the rest of
    the steps done since the resumed checkpoint, at the run's median step time)."""
    kills, steps = _records(save_dir / "kills.jsonl"), _records(save_dir / "steps.jsonl")
    out = []
    for kill in kills:
        before = [s for s in steps if s["attempt"] == kill["attempt"]]
        after = [s for s in steps if s["attempt"] == kill["attempt"] + 1]
        step_s = statistics.median(b["time"] - a["time"] for a, b in zip(before, before[1:]))
        replayed = kill["step"] - after[0]["step"]  # steps done before the kill that the new attempt redoes
        restart = after[0]["time"] - kill["time"]
        out.append((restart, restart + max(replayed - 1, 0) * step_s))
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s (min {min(values):.1f}, max {max(values):.1f}, n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    fresh, restart, lost = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(options.rounds):
            fresh.append(job(options.nproc, Path(tmp) / f"clean{r}", None))
            job(options.nproc, Path(tmp) / f"chaos{r}", FAULTS)
            measured = losses(Path(tmp) / f"chaos{r}")
            restart += [m[0] for m in measured]
            lost += [m[1] for m in measured]
            print(f"round {r + 1}: fresh start to first step {fresh[-1]:.1f} s; per failure: kill to first new "
                  f"step, lost in all: {', '.join(f'{m[0]:.1f} s, {m[1]:.1f} s' for m in measured)}", flush=True)
    print(f"\n{options.nproc} ranks, {options.rounds} rounds (interleaved: fresh, then chaos)")
    print(f"  fresh job, launch to first step (baseline): {spread(fresh)}")
    print(f"  per failure, kill to first new step:        {spread(restart)}")
    print(f"  per failure, lost in all (+ the replay):    {spread(lost)}")


if __name__ == "__main__":
    main()
