"""Training checkpoints: the sharded model checkpoint plus the train state, saved in the background, resumed exactly.

``save_dir/checkpoints/step-00000040/`` is an ordinary sharded checkpoint (``shardlib.checkpoint``: model and
optimizer state, atomic, checksummed, loadable at any layout) whose ``shardlib.json`` also holds ``"train"``: the
step, epoch and data position, the LR scheduler's state, the mesh it was saved at, and the files ``rng-rank{r}``
with every rank's RNG streams (torch's default generator and the per-rank dropout tracker's), checksummed like the
model files. A checkpoint is complete exactly when its ``shardlib.json`` exists (written last, after every file is
fsynced), so a run killed mid-save leaves only a hidden temporary directory, which the next run removes.

Saving does not stall training: the loop blocks only while this rank's local shards are copied to memory; a
background thread writes them and commits the checkpoint on a process group of its own (collectives of the
training groups are never issued from two threads). The next save, or the end of ``fit``, waits for it.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import checkpoint
from ..parallel.mesh import DEFAULT_TIMEOUT_S
from ..parallel.random import rng_streams
from ..parallel.timeouts import stalled_ranks_named
from ..safetensors_io import CheckpointError, SafetensorsFile
from ..sharding.sharded import shard_state
from .restarts import restart_count

log = logging.getLogger("shardlib.train")

TRAIN_STATE_FORMAT = "shardlib-train-state-v1"
_STEP_DIR = re.compile(r"^step-(\d+)$")
#: config entries that may differ between two runs of the same model (bookkeeping, not architecture)
_VOLATILE_CONFIG = {"transformers_version", "dtype", "torch_dtype", "architectures", "name_or_path",
                    "problem_type"}  # HF sets problem_type in the first forward


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.safetensors"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def layout_of_mesh(mesh) -> dict:
    layout = {"dp": mesh.dp, "pp": mesh.pp, "sp": mesh.sp, "tp": mesh.tp, "world": _world()}
    return layout | ({"ep": mesh.ep} if getattr(mesh, "ep", 1) > 1 else {})


def rng_state_tensors(tracker) -> dict[str, torch.Tensor]:
    """Every RNG stream of this rank as uint8 tensors: torch's default generator (CPU, and CUDA when in use) and
    each named stream of the dropout tracker."""
    out = {"default.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["default.cuda"] = torch.cuda.get_rng_state()
    for name, (cpu, cuda) in (tracker.get_states() if tracker is not None else {}).items():
        out[f"tracker.{name}.cpu"] = cpu
        if cuda is not None:
            out[f"tracker.{name}.cuda"] = cuda
    return {k: v.clone() for k, v in out.items()}


def restore_rng(tensors: dict[str, torch.Tensor], tracker, *, tracker_too: bool) -> None:
    torch.set_rng_state(tensors["default.cpu"])
    if "default.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["default.cuda"])
    if tracker_too and tracker is not None:
        names = {k.split(".")[1] for k in tensors if k.startswith("tracker.")}
        tracker.set_states({n: (tensors[f"tracker.{n}.cpu"], tensors.get(f"tracker.{n}.cuda")) for n in names})


def architecture(config_dict: dict) -> dict:
    return {k: v for k, v in config_dict.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG}


def foreign_reason(meta: dict, model) -> str | None:
    """Why a checkpoint's metadata does not belong to ``model`` (another class or config), or None."""
    expected = checkpoint.hf_class_name(model)
    if meta.get("model_class") != expected:
        return f"it holds a {meta.get('model_class')}, this run trains a {expected}"
    saved, ours = architecture(meta.get("config", {})), architecture(json.loads(json.dumps(model.config.to_dict(), default=str)))
    differing = sorted(k for k in saved.keys() | ours.keys() if saved.get(k) != ours.get(k))
    if differing:
        k = differing[0]
        return (f"its config differs in {len(differing)} field(s), e.g. {k}: saved {saved.get(k)!r}, "
                f"this model {ours.get(k)!r}")
    found = meta["train"].get("format") if isinstance(meta.get("train"), dict) else None
    newer = checkpoint.format.newer_format(found, TRAIN_STATE_FORMAT)
    if newer:
        return f"its train state's {newer}"
    if found != TRAIN_STATE_FORMAT:
        return "it has no train state (a model checkpoint, not a training checkpoint)"
    return None


def check_resumable(directory: Path, model) -> dict:
    """The metadata of a complete training checkpoint of ``model`` at ``directory``; CheckpointError naming the
    directory and the reason otherwise (missing, torn, corrupted, foreign)."""
    if not directory.is_dir():
        raise CheckpointError(f"resume: {directory} is not a directory")
    ckpt = checkpoint.ShardedCheckpoint(directory)
    with ckpt:
        problems = ckpt.problems()
    if problems:
        raise CheckpointError(f"resume: {directory} is damaged: {problems[0]}"
                              + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    reason = foreign_reason(ckpt.meta, model)
    if reason:
        raise CheckpointError(f"resume: {directory} is not a checkpoint of this run: {reason}")
    return ckpt.meta


class TrainCheckpoints:
    """The checkpoints of one run under ``root`` (``save_dir/checkpoints``): background saves, rotation to the
    newest ``keep_last``, and finding and loading the newest complete one."""

    def __init__(self, root: str | Path | None, trainer, *, keep_last: int = 2, async_save: bool = True,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root) if root is not None else None
        self.trainer, self.keep_last, self.async_save, self.timeout_s = trainer, keep_last, async_save, timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group = None
        self.blocked_s: list[float] = []  # time the loop waited per save (copying shards), for benchmarks
        self._buffers: dict = {}  # host copies, reused by every save (each waits for the previous commit)
        self.saved: list[Path] = []

    # -- saving ---------------------------------------------------------------------------------------------
    def _commit_group(self):
        if self._group is None and dist.is_initialized():
            # a gloo group of its own for the background commit (in a world of one too): collectives of one group
            # from two threads could interleave; on GPUs too, the commit moves only small objects
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._group

    def save(self, step: int, train_state: dict) -> None:
        """Stage this rank's shards (the only blocking part) and write them in the background; with
        ``async_save=False``, write them from the live tensors before returning (no copy, no thread)."""
        start = time.perf_counter()  # blocked time: waiting for the previous write counts too
        self.wait()
        group = self._commit_group()
        model, trainer = self.trainer.model, self.trainer
        state = shard_state(model)
        rank_file = {rng_file(_rank()): rng_state_tensors(state.rng_tracker)}
        staged = checkpoint.stage(model, optimizer=trainer.optimizer, copy=self.async_save, extra_files=rank_file,
                                  buffers=self._buffers)
        train = {"format": TRAIN_STATE_FORMAT, **train_state, "layout": layout_of_mesh(state.mesh)}
        directory = self.root / f"step-{step:08d}"

        def write():
            try:
                checkpoint.commit(staged, directory, overwrite=True, group=group, metadata={"train": train})
                if _rank() == 0:
                    self._rotate()
                self.saved.append(directory)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread by wait()
                self._error = exc

        if not self.async_save:
            write()
            self.blocked_s.append(time.perf_counter() - start)
            self.wait()
            return
        self.blocked_s.append(time.perf_counter() - start)
        self._thread = threading.Thread(target=write, name=f"shardlib-save-step-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the background save is committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join(self.timeout_s * 4)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint save did not finish within {self.timeout_s * 4:.0f} s")
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def complete(self) -> list[Path]:
        """Complete checkpoints (``shardlib.json`` present), oldest first."""
        if self.root is None or not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name))]
        return [p for _, p in sorted(found) if (p / checkpoint.METADATA).exists()]

    def _rotate(self) -> None:
        for old in self.complete()[:-self.keep_last] if self.keep_last else []:
            shutil.rmtree(old, ignore_errors=True)

    def remove_unfinished(self) -> None:
        """Rank 0 removes temporary directories that a killed save left (call before any save starts)."""
        if _rank() == 0 and self.root is not None and self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith(".step-") and (".tmp-" in p.name or ".old-" in p.name):
                    shutil.rmtree(p, ignore_errors=True)

    # -- resuming -------------------------------------------------------------------------------------------
    def find(self, resume) -> Path | None:
        """The checkpoint to resume from: ``"auto"``: the newest complete one of this run (torn or foreign ones
        skipped with a warning; None when there is none), a path: that one (an error if it is not resumable).
        Rank 0 decides and every rank gets its answer."""
        if resume is None:
            return None
        chosen, error = None, None
        if _rank() == 0:
            if resume == "auto":
                for candidate in reversed(self.complete()):
                    try:
                        check_resumable(candidate, self.trainer.model)
                        chosen = str(candidate)
                        break
                    except CheckpointError as exc:
                        log.warning("skipping %s", exc)
                if chosen is None:
                    log.warning("%sresume='auto': no complete checkpoint in %s; starting at step 0",
                                f"restart {restart_count()}: " if restart_count() else "", self.root)
            else:
                try:
                    check_resumable(Path(resume), self.trainer.model)
                    chosen = str(resume)
                except CheckpointError as exc:
                    error = str(exc)
        holder = [(chosen, error)]
        if dist.is_initialized():
            mesh = shard_state(self.trainer.model).mesh
            with stalled_ranks_named(f"resuming from {resume} (rank 0 chooses the checkpoint)",
                                     getattr(mesh, "timeout_s", DEFAULT_TIMEOUT_S)):
                dist.broadcast_object_list(holder, src=0)
        chosen, error = holder[0]
        if error:
            raise CheckpointError(error)
        return Path(chosen) if chosen else None

    def load(self, directory: Path) -> dict:
        """Load model, optimizer and RNG streams from ``directory``; returns its train state. At the layout it was
        saved at every rank gets its own streams back (bitwise resume); at another layout the model and optimizer
        are resharded, torch's generator continues from rank 0's and the dropout streams restart (a warning)."""
        model, trainer = self.trainer.model, self.trainer
        checkpoint.load(model, directory, optimizer=trainer.optimizer)
        with checkpoint.ShardedCheckpoint(directory) as ckpt:
            train = ckpt.meta["train"]
            same_layout = train["layout"] == layout_of_mesh(shard_state(model).mesh)
            reader = SafetensorsFile(ckpt.verified_file(rng_file(_rank() if same_layout else 0)))
            try:
                tensors = {k: reader.read(k) for k in reader.keys()}
            finally:
                reader.close()
        tracker = shard_state(model).rng_tracker
        restore_rng(tensors, tracker, tracker_too=same_layout)
        if not same_layout and _rank() == 0:
            log.warning("resuming at another layout (%s, saved at %s): model and optimizer resharded, the per-rank "
                        "dropout streams restart", layout_of_mesh(shard_state(model).mesh), train["layout"])
        if not same_layout:
            if tracker is not None:
                tracker.set_states({})
                rng_streams(tracker, train["seed"], shard_state(model).mesh)
        return train
