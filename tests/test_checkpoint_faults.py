"""Checkpoint writers killed with real signals, and full disks.

Each killed writer is a real process that gets a real ``SIGKILL`` (from itself, in the middle of a write, or from
this process while it is stalled in one): no ``except``, ``finally`` or ``atexit`` of the writer runs. The processes
are forked from this one (they start in milliseconds with shardlib already imported, instead of seconds for a
fresh interpreter), and ranks of a multi-rank save rendezvous over gloo on 127.0.0.1 as launched ranks do; nothing
else (no launcher) ends a rank whose peer died: only shardlib's own collective timeout (``init_mesh(timeout_s=)``).
After every kill: the checkpoint under its name is the previous one or the new one, whole (never a partial one),
and the next save, load or convert finishes or removes what the killed writer left. Disk-full errors are injected
in this process (``ENOSPC`` from ``pwrite`` / ``copy_file_range`` once a byte budget is used up; mounting a small
tmpfs needs privileges the test cannot count on).
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

import shardlib
from shardlib import checkpoint as ckpt
from shardlib import cli as shardlib_cli
from shardlib.checkpoint import atomic
from shardlib.parallel.mesh import OfflineMesh
from shardlib.safetensors_io import writer as sio_writer

from checkpoint_helpers import CONFIG, hf_dir  # noqa: F401  (hf_dir: a fixture)
from harness import _free_port

TIMEOUT_S = 5.0  # the ranks' collective timeout (init_mesh(timeout_s=...))


# ---------------------------------------------------------------------------------------------- helpers
def _bert(delta: float = 0.0) -> BertForMaskedLM:
    """The test model: seed 0, every parameter plus ``delta`` (the same on every rank and in this process)."""
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)
    return model


def _assert_holds(directory: Path, delta: float) -> None:
    """``directory`` is a whole checkpoint (every file's size and checksum) of ``_bert(delta)``, loaded bitwise."""
    assert ckpt.ShardedCheckpoint(directory).problems() == []
    model = shardlib.shard(BertForMaskedLM(BertConfig(**CONFIG)), OfflineMesh())
    ckpt.load(model, directory)
    expected = _bert(delta).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def _debris(directory: Path) -> list[Path]:
    return sorted(directory.parent.glob(f".{directory.name}.*"))


def _die() -> None:
    """SIGKILL this process (from any thread: the whole process dies, no handler or finally runs)."""
    os.kill(os.getpid(), signal.SIGKILL)


def _break_writes(at_half) -> None:
    """From now on, this process's first write of tensor data (past a file's header) writes half its block, then
    calls ``at_half()`` (which kills the process, or stalls it until it is killed)."""
    real = sio_writer.OutFile.write

    def write(self, view, offset):
        if offset:
            real(self, view[: len(view) // 2], offset)
            at_half()
        real(self, view, offset)

    sio_writer.OutFile.write = write


def _die_once_moved_aside() -> None:
    """From now on, this process dies right after a rename to ``.X.old-*``: between the two renames of a publish."""
    real = Path.rename

    def rename(self, target):
        out = real(self, target)
        if ".old-" in Path(target).name:
            _die()
        return out

    Path.rename = rename


def _child(target, args, rank: int | None, world: int, port: int) -> None:
    """In a forked process: become rank ``rank`` of a gloo world (env as a launcher sets it), run ``target``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if dist.is_initialized():  # inherited from this process (a world of one): not ours
        dist.destroy_process_group()
    if rank is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
    code = 0
    try:
        target(*args)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)  # no pytest teardown, no atexit in the child


def _fork(target, *args, world: int | None = None) -> list:
    """Start ``target(*args)`` in ``world`` forked ranks (None: one plain process); the processes."""
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(target, (r, *args) if world else args, r if world else None,
                                              world or 1, port), daemon=True)
             for r in range(world or 1)]
    for p in procs:
        p.start()
    return procs


def _wait(procs, timeout_s: float = 60) -> list[float]:
    """Wait for every process to end; the monotonic time each ended (fails on a hang, killing the rest)."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if i not in ended and p.exitcode is not None:
                ended[i] = time.monotonic()
        time.sleep(0.01)
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert len(ended) == len(procs), f"process(es) {sorted(set(range(len(procs))) - set(ended))} hung"
    return [ended[i] for i in range(len(procs))]


# ------------------------------------------------------------------------------ SIGKILL of one rank mid-save
def _two_rank_save(rank: int, directory: Path, deltas: list[float], kill_rank: int | None, stamp: Path) -> None:
    """Save ``_bert(delta)`` for each delta at tp=2 (overwrite); in the last save, rank ``kill_rank`` SIGKILLs
    itself half-way through the first data block of its file (``stamp``: when, in monotonic time)."""
    mesh = shardlib.init_mesh(tp=2, timeout_s=TIMEOUT_S)
    for i, delta in enumerate(deltas):
        model = shardlib.shard(_bert(delta), mesh)
        if i == len(deltas) - 1 and rank == kill_rank:
            _break_writes(lambda: (stamp.write_text(repr(time.monotonic())), _die()))
        ckpt.save(model, directory, overwrite=True)


@pytest.mark.parametrize("killed", [1, 0], ids=["rank 1 killed", "rank 0 (the leader) killed"])
def test_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, capfd, killed):
    """tp=2: both ranks save a checkpoint, then save another over it and one rank is SIGKILLed half-way through
    its file. The previous checkpoint stays whole under the name and loads bitwise; a staging directory left behind
    is never taken for a checkpoint (no shardlib.json); the other rank does not hang but fails within the
    collective timeout, saying why (rank 0, the leader, also removes the staging directory); the next save (2
    ranks again) succeeds and removes any debris."""
    directory, stamp = tmp_path / "ck", tmp_path / "killed-at"
    ranks = _fork(_two_rank_save, directory, [1.0, 2.0], killed, stamp, world=2)
    ended = _wait(ranks)
    survivor = 1 - killed
    assert ranks[killed].exitcode == -signal.SIGKILL and ranks[survivor].exitcode == 1
    waited = ended[survivor] - float(stamp.read_text())
    assert waited < TIMEOUT_S + 5, f"rank {survivor} took {waited:.1f} s to give up"  # the grace of the timeouts
    err = capfd.readouterr().err
    print(f"rank {survivor} gave up {waited:.2f} s after rank {killed} was killed")
    assert f"CollectiveFailure: rank {survivor}: a collective in saving {directory} failed" in err, err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["ck", "killed-at"]
    debris = _debris(directory)
    assert len(debris) == (killed == 0)  # the staging directory, when the leader (which removes it) was killed
    for staged in debris:  # what the kill left: never a checkpoint
        assert not (staged / "shardlib.json").exists(), staged
        with pytest.raises(ckpt.CheckpointError, match="no shardlib.json"):
            ckpt.ShardedCheckpoint(staged)
    _assert_holds(directory, 1.0)

    ranks = _fork(_two_rank_save, directory, [3.0], None, stamp, world=2)
    _wait(ranks)
    assert [p.exitcode for p in ranks] == [0, 0]
    assert _debris(directory) == []
    _assert_holds(directory, 3.0)


# ------------------------------------------------------------------------- SIGKILL between the two renames
def _save_killed_between_renames(directory: Path) -> None:
    """Save ``_bert(1)``, then ``_bert(2)`` over it, SIGKILLed right after the old one was renamed aside."""
    model = shardlib.shard(_bert(1.0), OfflineMesh())
    ckpt.save(model, directory)
    _die_once_moved_aside()
    ckpt.save(shardlib.shard(_bert(2.0), OfflineMesh()), directory, overwrite=True)


@pytest.fixture(scope="module")
def killed_between_renames(tmp_path_factory):
    """A folder with what the kill left: no ``ck``, ``.ck.old-*`` (delta 1), ``.ck.tmp-*`` complete (delta 2)."""
    root = tmp_path_factory.mktemp("renames")
    (proc,) = _fork(_save_killed_between_renames, root / "ck")
    _wait([proc])
    assert proc.exitcode == -signal.SIGKILL
    staged, old, scratch = atomic.debris(root / "ck")
    assert not (root / "ck").exists() and len(staged) == len(old) == 1 and not scratch
    assert (staged[0] / "shardlib.json").exists()
    return root


def _open(directory: Path) -> None:
    ckpt.ShardedCheckpoint(directory)


def _load(directory: Path) -> None:
    ckpt.load(shardlib.shard(BertForMaskedLM(BertConfig(**CONFIG)), OfflineMesh()), directory)


def _save(directory: Path) -> None:
    """A save without overwrite: refused because it finds the checkpoint (after recovering it)."""
    with pytest.raises(ckpt.CheckpointError, match="exists; pass overwrite=True"):
        ckpt.save(shardlib.shard(_bert(9.0), OfflineMesh()), directory)


@pytest.mark.parametrize("entry", [_open, _load, _save], ids=["ShardedCheckpoint", "load", "save"])
@pytest.mark.parametrize("case, delta", [("complete staging", 2.0), ("only .old left", 1.0)],
                         ids=["complete staging", "only .old left"])
def test_save_killed_between_renames_is_found_by_the_next_open_load_or_save(killed_between_renames, tmp_path,
                                                                             entry, case, delta):
    """The newest whole copy wins: the complete staging directory (the new checkpoint); with it incomplete (its
    shardlib.json gone, as if the kill had come before it was written), the old copy. Nothing else is left."""
    root = tmp_path / "copy"
    shutil.copytree(killed_between_renames, root)
    directory = root / "ck"
    if case == "only .old left":
        (atomic.debris(directory)[0][0] / "shardlib.json").unlink()
    entry(directory)
    assert _debris(directory) == []
    _assert_holds(directory, delta)


# ---------------------------------------------------------------------------------- SIGKILL during convert
def _convert_killed(src: Path, dst: Path, where: str, signal_file: Path) -> None:
    """``shardlib convert src dst --tp 2`` (the CLI's own entry point) killed at ``where``."""
    if where == "data write":  # the writer thread dies half-way through a block of column shards
        _break_writes(_die)
    elif where == "in-kernel copy":  # after the first copy job of a contiguous piece (copy_file_range or its fallback)
        real_copy = sio_writer._copy_range

        def dying_copy(*args):
            n = real_copy(*args)
            _die()
            return n

        sio_writer._copy_range = dying_copy
    elif where == "killed from outside":  # stalls in a write until this test's process sends SIGKILL
        _break_writes(lambda: (signal_file.touch(), time.sleep(60)))
    elif where == "before publishing":  # every file and shardlib.json written, nothing renamed
        atomic.publish = lambda *args, **kwargs: _die()
    elif where == "between renames":  # over an existing destination: killed after it was moved aside
        _die_once_moved_aside()
    shardlib_cli.main(["convert", str(src), str(dst), "--tp", "2", "--overwrite"])
    raise AssertionError("the convert was not killed")


@pytest.mark.parametrize("where, existing", [
    ("data write", False), ("in-kernel copy", False), ("killed from outside", False), ("before publishing", False),
    ("between renames", True), ("data write", True)],
    ids=lambda value: value if isinstance(value, str) else "over an old one" if value else "new")
def test_convert_killed_leaves_the_destination_absent_or_complete(hf_dir, tmp_path, where, existing):  # noqa: F811
    """After the kill the destination is absent (a new one) or a whole checkpoint (if present, every file checks
    out: the old one, or the new one recovered from its complete staging directory); a rerun succeeds and leaves
    nothing behind."""
    src, original = hf_dir
    dst, signal_file = tmp_path / "out", tmp_path / "stalled"
    if existing:
        ckpt.convert(src, dst, tp=4)
    (proc,) = _fork(_convert_killed, src, dst, where, signal_file)
    if where == "killed from outside":
        deadline = time.monotonic() + 60
        while not signal_file.exists() and proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert signal_file.exists(), "the convert never reached its write"
        os.kill(proc.pid, signal.SIGKILL)
    _wait([proc])
    assert proc.exitcode == -signal.SIGKILL
    new = where in ("before publishing", "between renames")  # killed after the new checkpoint was complete
    assert all(new or not (staged / "shardlib.json").exists() for staged in atomic.debris(dst)[0])
    if dst.exists():  # as the kill left it: the old checkpoint, whole
        assert existing and ckpt.ShardedCheckpoint(dst).problems() == []
    try:  # opened: the new one (recovered from its complete staging directory), the old one, or none
        with ckpt.ShardedCheckpoint(dst) as opened:
            assert opened.problems() == [] and opened.meta["tp"] == (2 if new else 4)
    except ckpt.CheckpointError as exc:
        assert "no shardlib.json" in str(exc) and not existing and not new
    assert shardlib_cli.main(["convert", str(src), str(dst), "--tp", "2", "--overwrite"]) == 0
    assert _debris(dst) == [] and ckpt.ShardedCheckpoint(dst).meta["tp"] == 2
    model = shardlib.shard(BertForMaskedLM(BertConfig(**CONFIG)), OfflineMesh())
    ckpt.load(model, dst)
    for name, value in original.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


# ------------------------------------------------------------------------------------------------ disk full
@pytest.fixture
def disk_fills_up(monkeypatch):
    """``disk_fills_up(n)``: from now on the disk takes ``n`` more bytes through ``pwrite`` / ``copy_file_range``
    (the writer's calls), a short write at the edge, then ``ENOSPC`` as a real file system answers."""
    budget = []

    def fill(nbytes):
        budget[:] = [nbytes]
        real_pwrite, real_copy = os.pwrite, getattr(os, "copy_file_range", None)

        def room(n):
            if budget[0] <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = min(n, budget[0])
            budget[0] -= n
            return n

        def pwrite(fd, data, offset):
            return real_pwrite(fd, memoryview(data)[:room(len(data))], offset)

        def copy_file_range(src, dst, count, offset_src=None, offset_dst=None):
            return real_copy(src, dst, room(count), offset_src, offset_dst)

        monkeypatch.setattr(os, "pwrite", pwrite)
        if real_copy is not None:
            monkeypatch.setattr(sio_writer, "_kernel_copy_works", True)
            monkeypatch.setattr(os, "copy_file_range", copy_file_range)

    return fill


def _snapshot(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _assert_disk_full_error(info, directory: Path) -> None:
    message = str(info.value)
    assert type(info.value) is ckpt.CheckpointError and "No space left on device" in message, message
    assert len(message.splitlines()) == 1 and str(directory) in message, message


@pytest.mark.parametrize("room", [0, 5000], ids=["no room", "5000 bytes of room"])
def test_disk_full_during_save_keeps_the_old_checkpoint(tmp_path, disk_fills_up, room):
    """``room`` bytes left: nothing at all, or part of the first file."""
    directory = ckpt.save(shardlib.shard(_bert(1.0), OfflineMesh()), tmp_path / "ck")
    before = _snapshot(directory)
    disk_fills_up(room)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save(shardlib.shard(_bert(2.0), OfflineMesh()), directory, overwrite=True)
    _assert_disk_full_error(info, directory)
    assert _snapshot(directory) == before and _debris(directory) == []
    _assert_holds(directory, 1.0)


def test_disk_full_during_convert_keeps_the_old_checkpoint(hf_dir, tmp_path, disk_fills_up):  # noqa: F811
    src, original = hf_dir
    dst = ckpt.convert(src, tmp_path / "out", tp=4)
    before = _snapshot(dst)
    disk_fills_up(20000)  # part of the files
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.convert(src, dst, tp=2, overwrite=True)
    _assert_disk_full_error(info, dst)
    assert _snapshot(dst) == before and _debris(dst) == []
    assert ckpt.ShardedCheckpoint(dst).problems() == []


def test_disk_full_during_export_keeps_the_old_export(hf_dir, tmp_path, disk_fills_up):  # noqa: F811
    src, original = hf_dir
    sharded = ckpt.convert(src, tmp_path / "sharded", tp=2)
    export = ckpt.export_hf(sharded, tmp_path / "export")
    before = _snapshot(export)
    disk_fills_up(20000)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.export_hf(sharded, export, overwrite=True)
    _assert_disk_full_error(info, export)
    assert _snapshot(export) == before and _debris(export) == []
    reloaded = BertForMaskedLM.from_pretrained(export)
    for name, value in original.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
