"""Every collective names a stalled rank: ``fit``'s evaluation, ``shard()``'s proof of an inferred plan and a sharded
checkpoint load, each with one rank of two stalled inside it (real gloo, forked ranks, ``init_mesh(timeout_s=2)``).

The waiting rank raises ``CollectiveFailure`` saying what it was doing and naming the stalled rank; the stalled rank,
when it comes back, finds its peer gone and says so. A load that fails on one rank only (its file is damaged) is
raised on both, naming the rank. The worlds run side by side (their ranks mostly sleep), so the module costs one
stall. How gloo's errors are told apart (:func:`shardlib.parallel.timeouts.failure_kind`) is tested without
processes.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

import shardlib
from shardlib import checkpoint as ckpt
from shardlib.parallel import shm
from shardlib.parallel.timeouts import CollectiveFailure, failure_kind
from shardlib.sharding.plan import PlanError

from checkpoint_helpers import CONFIG
from test_checkpoint_faults import _fork, _wait

TIMEOUT_S = 2.0  # the ranks' collective timeout
GRACE_S = 2.0    # min(timeout, 5 s): how long a timed-out rank waits for the others to time out too
STALL_S = 6.0    # the stalled rank sleeps this long inside the operation: more than timeout + grace
SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)


# ------------------------------------------------------------------------------------------ in the ranks
def _outcome(rank: int, out: Path, run) -> None:
    """Run ``run()`` and write what came of it to ``out/rank{rank}.json`` (then re-raise, so the rank exits 1)."""
    try:
        run()
        result = {"ok": True}
    except BaseException as exc:
        result = {"type": type(exc).__name__, "message": str(exc), "stalled": getattr(exc, "stalled", None),
                  "at": time.time(), "trace": traceback.format_exc()[-3000:]}
        raise
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(result))


def _stall_once(rank: int, out: Path, real):
    """``real``, made to sleep ``STALL_S`` at its first call on rank 1 (which notes when)."""
    calls = []

    def stalled(*args, **kwargs):
        if rank == 1 and not calls:
            calls.append(1)
            (out / "stalled-at").write_text(repr(time.time()))
            time.sleep(STALL_S)
        return real(*args, **kwargs)

    return stalled


def _evaluating(rank: int, out: Path) -> None:
    """dp=2: one training step, then ``fit``'s final evaluation; rank 1 stalls in a metric, so rank 0 waits in the
    all-reduce of the sums."""
    mesh = shardlib.init_mesh(timeout_s=TIMEOUT_S)
    torch.manual_seed(0)
    model = shardlib.shard(BertForSequenceClassification(BertConfig(**SMALL)), mesh)
    trainer = shardlib.Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    data = [{"input_ids": torch.randint(0, 40, (6,)), "labels": torch.tensor(i % 2)} for i in range(8)]
    metric = _stall_once(rank, out, lambda output, batch: torch.zeros(batch["labels"].shape[0]))
    _outcome(rank, out, lambda: trainer.fit(data, batch_size=4, max_steps=1, eval_data=data,
                                            metrics={"slow": metric}, progress=False))


def _sharding(rank: int, out: Path) -> None:
    """tp=2, ``policy="auto"``: rank 1 stalls while building the example batch of the plan's proof, so rank 0 waits
    in the proof's first tensor-parallel all-reduce."""
    from shardlib.sharding.inference import verify

    mesh = shardlib.init_mesh(tp=2, timeout_s=TIMEOUT_S)
    verify.example_batch = _stall_once(rank, out, verify.example_batch)
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**SMALL))
    _outcome(rank, out, lambda: shardlib.shard(model, mesh, policy="auto"))


def _loading(rank: int, out: Path, directory: Path, stall: bool) -> None:
    """tp=2 ``from_sharded``: rank 1 stalls in its first read (``stall``), so rank 0 waits at the load's end; or
    rank 1 finds its own file damaged."""
    mesh = shardlib.init_mesh(tp=2, timeout_s=TIMEOUT_S)
    if stall:
        ckpt.ShardedCheckpoint.read_into = _stall_once(rank, out, ckpt.ShardedCheckpoint.read_into)
    _outcome(rank, out, lambda: ckpt.from_sharded(BertForMaskedLM, directory, mesh))


# ------------------------------------------------------------------------------------------ the worlds
@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[str, list[dict]]:
    """Every scenario's two ranks, started at once; each rank's outcome, by scenario."""
    root = tmp_path_factory.mktemp("stalls")
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(**CONFIG)).save_pretrained(root / "hf")
    sharded = ckpt.convert(root / "hf", root / "ck", tp=2)
    damaged = ckpt.convert(root / "hf", root / "damaged", tp=2)
    data = bytearray((damaged / "model-tp01-of-02.safetensors").read_bytes())
    data[-1] ^= 0xFF  # rank 1's file only (rank 0 reads tp00 and the replicated file)
    (damaged / "model-tp01-of-02.safetensors").write_bytes(bytes(data))
    scenarios = {"evaluate": (_evaluating,), "shard": (_sharding,), "load": (_loading, sharded, True),
                 "damaged": (_loading, damaged, False)}
    started = {}
    for name, (target, *args) in scenarios.items():
        (root / f"run-{name}").mkdir()
        started[name] = _fork(target, root / f"run-{name}", *args, world=2)
    for procs in started.values():
        _wait(procs, timeout_s=120)
    return {name: [json.loads((root / f"run-{name}" / f"rank{r}.json").read_text()) | {"dir": str(root / f"run-{name}")}
                   for r in range(2)] for name in scenarios}


@pytest.mark.parametrize("scenario, what", [
    ("evaluate", "evaluate (the all-reduce of the loss and metric sums)"),
    ("shard", "shard() (proving the inferred plan on the tensor-parallel group)"),
    ("load", "loading {ck}"),
], ids=["fit's evaluation", "shard()", "sharded checkpoint load"])
def test_the_stalled_rank_is_named_by_the_rank_that_waited(worlds, scenario, what):
    waiting, stalled = worlds[scenario]
    what = what.format(ck=Path(waiting["dir"]).parent / "ck")
    assert waiting.get("type") == "CollectiveFailure", waiting
    assert waiting["message"].startswith(
        f"rank 0: a collective in {what} did not complete within the 2 s timeout (init_mesh(timeout_s=...) or "
        "SHARDLIB_TIMEOUT); stalled: rank 1 (never reached it"), waiting["message"]
    assert waiting["stalled"] == [1]
    took = waiting["at"] - float((Path(waiting["dir"]) / "stalled-at").read_text())
    assert TIMEOUT_S <= took < TIMEOUT_S + GRACE_S + 3, f"rank 0 raised {took:.1f} s after rank 1 stalled"
    assert stalled.get("type") == "CollectiveFailure", stalled
    assert stalled["message"].startswith(f"rank 1: a collective in {what} failed: a peer rank closed its "
                                         "connection"), stalled["message"]


def test_a_load_that_fails_on_one_rank_is_raised_on_every_rank_naming_it(worlds):
    other, failed = worlds["damaged"]
    file = Path(failed["dir"]).parent / "damaged" / "model-tp01-of-02.safetensors"
    assert failed["type"] == "CheckpointError" and failed["message"] == f"{file}: checksum mismatch (corrupted; " \
        "xxh3_128)", failed
    assert other["type"] == "CheckpointError", other
    assert other["message"] == (f"loading {file.parent} failed on rank 1 (rank 1: CheckpointError: {file}: checksum "
                                "mismatch (corrupted; xxh3_128))")


# ------------------------------------------------------------------------------ which error is which
GLOO_TIMEOUT = "[/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete"
GLOO_PEER = ("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234. This is typically "
             "caused by a remote worker crashing.")


def _raised_from(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as exc:
            raise outer from exc
    except Exception as exc:  # noqa: BLE001
        return exc


@pytest.mark.parametrize("error, kind", [
    (RuntimeError(GLOO_TIMEOUT), "timeout"),  # gloo (torch 2.13): a plain RuntimeError, told by its message
    (RuntimeError("Application timeout caused pair closure"), "closed"),
    (RuntimeError(GLOO_PEER), "peer"),
    (dist.DistStoreError("wait timeout after 2000ms, keys: /default_pg/0//x"), "timeout"),  # by type
    (dist.DistNetworkError("Broken pipe"), "peer"),  # by type: the store's host is gone
    (dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)"), "timeout"),
    (dist.DistBackendError("NCCL error: unhandled system error"), None),
    # the shared-memory transport (the tp / sp groups' default on one host), by type
    (shm.SharedMemoryTimeout("shared-memory collective 3: ranks [1] of the group did not arrive within 2 s"),
     "timeout"),
    (shm.PeerGone("shared-memory collective 3: the process of rank(s) [1] of the group is gone"), "peer"),
    (shm.Unsuitable("transport='shm' needs every rank of a group on one host"), None),
    (RuntimeError("DataLoader timed out after 5 seconds"), None),  # not a collective's
    (ValueError("timed out waiting"), None),
    (CollectiveFailure("rank 0: a collective in x did not complete", [1]), None),  # reported already
    (_raised_from(PlanError("the inferred plan does not run"), RuntimeError(GLOO_TIMEOUT)), "timeout"),
], ids=lambda value: value if isinstance(value, str) or value is None else type(value).__name__)
def test_failure_kind(error, kind):
    assert failure_kind(error) == kind
