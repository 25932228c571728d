"""Faults with real processes: a rank that stalls inside a training step's collective.

The ranks are started here as plain processes (no launcher, so no launcher's teardown bounds them): whatever ends
each one is shardlib's own timeout (``init_mesh(timeout_s=...)``) and its error (:mod:`shardlib.parallel.timeouts`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from profiles import ci_only

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 3.0   # the mesh's collective timeout in the ranks
GRACE_S = 3.0     # shardlib.parallel.timeouts: min(timeout, 5 s) to let the other ranks time out too
STALL_S = 7.0     # the stalled rank sleeps this long inside step 2's forward: longer than timeout + grace
EXIT_S = 6.0      # from raising to the end of the process

STALLING_RANKS = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    import shardlib
    from shardlib.parallel.timeouts import CollectiveFailure

    rank, shared, stalled = int(os.environ["RANK"]), Path(sys.argv[1]), int(sys.argv[4])

    def together(name):  # a barrier on files, not bound by the short timeout: busy cores may hold one rank back
        (shared / f"{name}{rank}").touch()
        while not all((shared / f"{name}{r}").exists() for r in range(2)):
            time.sleep(0.02)

    together("imported")
    mesh = shardlib.init_mesh(tp=2, timeout_s=float(sys.argv[2]))
    torch.manual_seed(0)
    model = shardlib.shard(BertForSequenceClassification(BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)), mesh)
    trainer = shardlib.Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    calls = []

    def stall(module, args):
        calls.append(1)
        if rank == stalled and len(calls) == 2:  # step 2: the other waits in the attention output's all-reduce
            print("STALL", json.dumps(time.time()), flush=True)
            time.sleep(float(sys.argv[3]))

    model.bert.encoder.layer[0].register_forward_pre_hook(stall)
    batch = {"input_ids": torch.randint(0, 40, (4, 6)), "labels": torch.randint(0, 2, (4,))}
    together("built")
    try:
        for step in range(3):
            trainer.train_step(batch)
            print("STEP", step + 1, flush=True)
    except CollectiveFailure as e:
        print("FAILED", json.dumps({"stalled": e.stalled, "at": time.time()}), flush=True)
        raise
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stalled", [1, pytest.param(0, marks=ci_only(
    "about 20 s; the same path as rank 1 stalling, with the store's host (rank 0) as the stalled rank"))])
def test_a_stalled_rank_is_named_and_every_rank_exits_within_the_timeout(tmp_path, stalled):
    """One rank stalls in step 2's forward, so the other waits in a tensor-parallel all-reduce: the waiting rank
    gives up after the timeout, names the stalled one, and exits; the stalled rank, when it comes back, finds its
    peer gone and exits at once. (Rank 0 hosts the ranks' store: stalled, its Python asleep, it still serves it.)"""
    script = tmp_path / "stall.py"
    script.write_text(STALLING_RANKS)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ranks = [subprocess.Popen([sys.executable, str(script), str(tmp_path), str(TIMEOUT_S), str(STALL_S), str(stalled)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    exited: dict[int, float] = {}
    deadline = time.time() + 90
    while len(exited) < 2 and time.time() < deadline:
        for r, p in enumerate(ranks):
            if r not in exited and p.poll() is not None:
                exited[r] = time.time()
        time.sleep(0.02)
    for p in ranks:
        if p.poll() is None:
            p.kill()
    out = [p.communicate() for p in ranks]
    assert len(exited) == 2, f"a rank hung: {[err[-2000:] for _, err in out]}"
    waiting = 1 - stalled
    assert [p.returncode for p in ranks] == [1, 1], [err[-2000:] for _, err in out]
    assert all("STEP 1" in o and "STEP 2" not in o for o, _ in out), [o for o, _ in out]
    stalled_at = _printed(out[stalled][0], "STALL")
    failed = [_printed(o, "FAILED") for o, _ in out]

    assert (f"rank {waiting}: a collective in Trainer.train_step did not complete within the 3 s timeout (init_mesh("
            f"timeout_s=...) or SHARDLIB_TIMEOUT); stalled: rank {stalled} (never reached it") in out[waiting][1]
    assert failed[waiting]["stalled"] == [stalled]  # CollectiveFailure.stalled
    took = failed[waiting]["at"] - stalled_at
    assert TIMEOUT_S <= took < TIMEOUT_S + GRACE_S + 1.5, f"the waiting rank raised after {took:.1f} s"

    assert (f"rank {stalled}: a collective in Trainer.train_step failed: a peer rank closed its connection"
            in out[stalled][1])
    took = failed[stalled]["at"] - (stalled_at + STALL_S)
    assert took < 1.5, f"the stalled rank raised {took:.1f} s after its stall"
    for r in (0, 1):  # and then the process ends (interpreter teardown: seconds when the 2 cores are busy)
        took = exited[r] - failed[r]["at"]
        assert took < EXIT_S, f"rank {r} exited {took:.1f} s after raising"


def _printed(stdout: str, tag: str):
    return json.loads(next(line for line in stdout.splitlines() if line.startswith(tag + " "))[len(tag) + 1:])
