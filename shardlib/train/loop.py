"""``Trainer.fit``: the training loop over the dp x pp x sp x tp mesh, with evaluation, logging, checkpoints and
exact resume. See docs/training.md.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ..sharding.experts import router_load
from ..sharding.sharded import shard_state
from .batches import first_tensor, split_batch
from .checkpoints import TrainCheckpoints
from .data import EpochData
from .logs import TrainLog
from .loss_terms import mean_terms
from .restarts import Progress, announce, default_resume
from .termination import EXIT_STATUS, SigtermStop


@dataclass
class FitResult:
    """What a ``fit`` call did: the last step and epoch, every step's global-batch loss (``losses[i]`` is step
    ``first_step + i + 1``), every evaluation record, and the checkpoints it committed."""

    step: int
    epoch: int
    first_step: int
    losses: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)
    save_blocked_s: list[float] = field(default_factory=list)
    resumed_from: Path | None = None


def warmup_cosine(warmup_ratio: float = 0.1):
    """Linear warmup over ``warmup_ratio`` of the steps, then cosine decay to 0 (transformers' ``get_scheduler``
    "cosine", the seeds' ``CosineAnnealingWarmupLR``): ``fit(..., lr_scheduler=warmup_cosine(0.1))``."""
    if not 0 <= warmup_ratio < 1:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")

    def build(optimizer, total_steps: int):
        from transformers import get_scheduler

        return get_scheduler("cosine", optimizer, num_warmup_steps=round(warmup_ratio * total_steps),
                             num_training_steps=total_steps)

    return build


def build_scheduler(lr_scheduler, optimizer, total_steps: int | None):
    """A scheduler from ``lr_scheduler``: an instance built on ``optimizer``, or a function of ``(optimizer)`` or
    ``(optimizer, total_steps)``; TypeError when it is not a torch LR scheduler."""
    if lr_scheduler is None:
        return None
    scheduler = lr_scheduler
    if not hasattr(lr_scheduler, "state_dict"):
        if not callable(lr_scheduler):
            raise TypeError(f"lr_scheduler must be a scheduler or a function of the optimizer, got "
                            f"{type(lr_scheduler).__name__}")
        positional = [p for p in inspect.signature(lr_scheduler).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) >= 2:
            if total_steps is None:
                raise ValueError("lr_scheduler needs the number of steps, which an iterable dataset without a "
                                 "length does not give: pass max_steps")
            scheduler = lr_scheduler(optimizer, total_steps)
        else:
            scheduler = lr_scheduler(optimizer)
    if not all(hasattr(scheduler, a) for a in ("step", "state_dict", "load_state_dict", "get_last_lr")):
        raise TypeError(f"lr_scheduler gave a {type(scheduler).__name__}, not a torch.optim.lr_scheduler.LRScheduler")
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("lr_scheduler was built on another optimizer than this Trainer's (trainer.optimizer)")
    return scheduler


def _check_global_batch(batch_size, mesh, microbatches: int, what: str, packed: bool = False) -> None:
    """``packed``: any number of samples, since the packer pads the rows to dp x microbatches."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{what} must be a positive integer, got {batch_size!r}")
    if not packed and batch_size % (mesh.dp * microbatches):
        raise ValueError(f"global {what} {batch_size} is not divisible by dp({mesh.dp}) x "
                         f"microbatches({microbatches}) = {mesh.dp * microbatches}")


def _tokens(model, batch: dict) -> int | None:
    """The real tokens of ``batch`` when its main model input holds token ids, else None: padding is left out where
    the batch marks it (``document_ids`` of packed rows, an ``attention_mask``)."""
    value = batch.get(getattr(model, "main_input_name", None))
    if not torch.is_tensor(value) or value.is_floating_point():
        return None
    for key, real in (("document_ids", lambda t: t >= 0), ("attention_mask", lambda t: t != 0)):
        mask = batch.get(key)
        if torch.is_tensor(mask) and mask.shape == value.shape:
            return int(real(mask).sum())
    return value.numel()


def evaluate(trainer, data: EpochData, metrics: dict[str, Callable] | None = None) -> dict:
    """Loss and metrics over every sample of ``data`` exactly once, summed over the whole mesh: the loss weighted
    by each microbatch's loss items, each metric ``fn(output, microbatch) -> [n]`` per-example values averaged over
    examples. Identical at any dp, pp, tp."""
    metrics = metrics or {}
    state = shard_state(trainer.model)
    mesh = state.mesh
    counts_here = all(mesh.size(d) == 1 or mesh.local_rank(d) == 0 for d in ("tp", "sp"))
    names = ["examples", "loss_items", "loss", *metrics]
    sums = torch.zeros(len(names), dtype=torch.float64)
    for batch in data.batches(0):
        outputs = trainer.eval_step(batch)
        if not outputs or not counts_here:
            continue
        for out, mb in zip(outputs, split_batch(batch, len(outputs))):
            items = trainer.loss_items(mb).sum()
            sums[0] += first_tensor(mb).shape[0]
            if torch.is_tensor(out.get("loss")):
                sums[1] += items
                sums[2] += float(out["loss"]) * items
            for i, fn in enumerate(metrics.values()):
                sums[3 + i] += float(torch.as_tensor(fn(out, mb)).double().sum())  # a CUDA metric too
    if dist.is_initialized():
        from ..parallel.mesh import DEFAULT_TIMEOUT_S
        from ..parallel.timeouts import stalled_ranks_named

        reduced = sums.to(mesh.device_type)  # NCCL reduces CUDA tensors only
        with stalled_ranks_named("evaluate (the all-reduce of the loss and metric sums)",
                                 getattr(mesh, "timeout_s", DEFAULT_TIMEOUT_S)):
            dist.all_reduce(reduced)
        sums = reduced.cpu()
    result = {"samples": int(sums[0]), "loss": float(sums[2] / sums[1]) if sums[1] else None}
    result |= {name: float(sums[3 + i] / sums[0]) if sums[0] else None for i, name in enumerate(metrics)}
    return result


def _packer(trainer, packing, rows_multiple: int):
    """fit's collator for ``packing`` (None, a row length or a PackingCollator), padding the rows of a global batch
    to a multiple of dp x microbatches; the model accepts packed rows from here on (or is refused now)."""
    if packing is None:
        return None
    from ..sharding.documents import accept_documents
    from .packing import PackingCollator

    accept_documents(trainer.model)
    if isinstance(packing, PackingCollator):  # the caller's collator, its own rows_multiple kept
        return functools.partial(packing, rows_multiple=math.lcm(packing.rows_multiple, rows_multiple))
    if isinstance(packing, bool) or not isinstance(packing, int):
        raise TypeError(f"packing must be a row length in tokens or a PackingCollator, got {packing!r}")
    return PackingCollator.for_model(trainer.model, packing, rows_multiple=rows_multiple)


def _check_options(trainer, mesh, batch_size, epochs, max_steps, eval_interval, log_interval, save_dir,
                   save_interval, resume, packed: bool) -> None:
    if epochs is None and max_steps is None:
        raise ValueError("fit needs epochs or max_steps (both are missing)")
    for name, value in (("epochs", epochs), ("max_steps", max_steps), ("log_interval", log_interval),
                        ("save_interval", save_interval)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if eval_interval not in (None, "epoch") and not (isinstance(eval_interval, int) and eval_interval >= 1):
        raise ValueError(f"eval_interval must be a positive integer or 'epoch', got {eval_interval!r}")
    if save_dir is None and (save_interval is not None or resume == "auto"):
        raise ValueError(f"{'save_interval' if save_interval is not None else 'resume=auto'} needs a save_dir")
    if trainer.optimizer is None:
        raise ValueError("fit needs a Trainer with an optimizer: Trainer(model, optimizer=lambda params: ...)")
    _check_global_batch(batch_size, mesh, trainer.microbatches, "batch_size", packed)


def fit(trainer, train_data, *, batch_size: int, epochs: int | None = None, max_steps: int | None = None,
        eval_data=None, eval_batch_size: int | None = None, collate_fn: Callable | None = None, lr_scheduler=None,
        eval_interval: int | str | None = None, log_interval: int = 10, save_dir: str | Path | None = None,
        save_interval: int | None = None, keep_last: int = 2, resume: str | Path | None = None,
        metrics: dict[str, Callable] | None = None, seed: int = 0, shuffle: bool = True, num_workers: int = 0,
        prefetch_factor: int | None = None, progress: bool = True, async_save: bool = True,
        packing=None) -> FitResult:
    """Train ``trainer``'s model on ``train_data``: a map-style dataset of dict samples (a list of dicts, a torch
    ``Dataset``, a ``datasets.Dataset`` with ``with_format("torch")``) in a seeded global order, or an iterable of
    them (a ``datasets.IterableDataset``, a generator) read in its own order.

    ``batch_size``: the global batch (dp x microbatches must divide it). Stops after ``epochs`` epochs or
    ``max_steps`` optimizer steps, whichever comes first (one is required). ``eval_data`` is evaluated every
    ``eval_interval`` steps (``"epoch"``: after each epoch) and at the end; ``metrics``: name ->
    ``fn(output, microbatch)`` giving per-example values (accuracy: ``(out["logits"].argmax(-1) ==
    mb["labels"]).float()``). ``lr_scheduler``: a scheduler on ``trainer.optimizer`` or a function of
    ``(optimizer)`` / ``(optimizer, total_steps)`` (:func:`warmup_cosine`), stepped after every optimizer step.
    ``save_dir``: logs (``log.jsonl``, TensorBoard) and checkpoints in ``save_dir/checkpoints`` (the newest
    ``keep_last`` kept): at the end of the run, and every ``save_interval`` steps when given. ``resume``:
    ``"auto"`` (the newest complete checkpoint in ``save_dir``; without one the run starts at step 0 and says so)
    or a checkpoint directory. ``seed`` fixes the sample order.
    ``async_save``: write checkpoints in a background thread (the loop blocks only to copy the shards); False
    writes them in the loop, which costs less where training already uses every CPU core (docs/training.md).
    With a ``save_dir``, SIGTERM saves the step in progress and then raises ``SystemExit``
    (:mod:`shardlib.train.termination`).
    ``packing``: train padding-free: each global batch of ``batch_size`` samples is packed into rows of ``packing``
    tokens (an int: :meth:`PackingCollator.for_model <shardlib.train.packing.PackingCollator.for_model>`), or by a
    :class:`~shardlib.train.packing.PackingCollator` given here; ``collate_fn`` then serves ``eval_data`` only. The
    steps compute what the padded batches of the same samples compute (docs/packing.md).
    Everything is checked before anything is written; see docs/training.md.
    """
    mesh = shard_state(trainer.model).mesh
    _check_options(trainer, mesh, batch_size, epochs, max_steps, eval_interval, log_interval, save_dir,
                   save_interval, resume, packed=packing is not None)
    packer = _packer(trainer, packing, mesh.dp * trainer.microbatches)
    device = next((p.device for p in trainer.params if p.device.type != "meta"), torch.device("cpu"))
    loader = dict(collate_fn=collate_fn, num_workers=num_workers, prefetch_factor=prefetch_factor, device=device)
    data = EpochData(train_data, batch_size, mesh, seed=seed, shuffle=shuffle, packing=packer, **loader)
    evals = None
    if eval_data is not None:
        evals = EpochData(eval_data, eval_batch_size or batch_size, mesh, shuffle=False, drop_last=False,
                          what="eval_data", **loader)
    per_epoch = data.steps_per_epoch()
    totals = [x for x in (max_steps, epochs * per_epoch if epochs and per_epoch else None) if x is not None]
    total = min(totals) if totals else None
    scheduler = build_scheduler(lr_scheduler, trainer.optimizer, total)
    save_dir = Path(save_dir) if save_dir is not None else None
    checkpoints = TrainCheckpoints(save_dir / "checkpoints" if save_dir else None, trainer, keep_last=keep_last,
                                   async_save=async_save)
    loop = FitLoop(trainer, data, evals, scheduler, checkpoints, metrics=metrics, epochs=epochs,
                   max_steps=max_steps, eval_interval=eval_interval, log_interval=log_interval,
                   save_interval=save_interval if save_dir is not None else None, seed=seed, batch_size=batch_size)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    loop.progress = Progress(save_dir, enabled=rank0)
    resume_from = checkpoints.find(default_resume(resume, save_dir))  # validates; writes nothing
    if resume_from is not None:
        loop.resume(resume_from)
        if rank0:
            logging.getLogger("shardlib.train").warning(
                announce(resume_from, loop.step, batch_size, loop.progress.previous))
    checkpoints.remove_unfinished()
    log = TrainLog(save_dir, enabled=rank0, total_steps=total, start_step=loop.step, progress=progress)
    with SigtermStop(save_dir is not None, mesh.device_type) as loop.sigterm:
        return loop.run(log)


class FitLoop:
    """Where one ``fit`` call is (step, epoch, global batch within the epoch) and what it drives each step: the
    Trainer, the LR scheduler, logs, evaluation and checkpoints."""

    def __init__(self, trainer, data: EpochData, evals: EpochData | None, scheduler, checkpoints: TrainCheckpoints,
                 *, metrics, epochs, max_steps, eval_interval, log_interval, save_interval, seed, batch_size):
        self.trainer, self.data, self.evals, self.scheduler = trainer, data, evals, scheduler
        self.checkpoints, self.metrics = checkpoints, metrics
        self.epochs, self.max_steps, self.eval_interval = epochs, max_steps, eval_interval
        self.log_interval, self.save_interval, self.seed, self.batch_size = log_interval, save_interval, seed, batch_size
        self.step = self.epoch = self.position = 0
        self.result = FitResult(step=0, epoch=0, first_step=0)
        self.last_saved: int | None = None
        self.log: TrainLog | None = None
        self.sigterm = SigtermStop(False)  # fit() installs the real one around run()
        self.progress = Progress(None, enabled=False)  # fit() sets rank 0's
        self._window: list[float] = []
        self._window_terms: list[dict | None] = []  # each step's loss apart (Trainer.last_loss_terms)
        self._window_start, self._window_tokens = time.perf_counter(), 0

    def resume(self, directory: Path) -> None:
        train = self.checkpoints.load(directory)
        for key, value in (("batch_size", self.batch_size), ("seed", self.seed)):
            if train[key] != value:
                raise ValueError(f"resume: {directory} was trained with {key}={train[key]}, this run has "
                                 f"{key}={value}; the sample order would not continue")
        self.step, self.epoch, self.position = train["step"], train["epoch"], train["batch_in_epoch"]
        if self.scheduler is not None and train["scheduler"] is not None:
            self.scheduler.load_state_dict(train["scheduler"])
        scaler, guard = self.trainer.scaler, self.trainer.nonfinite
        if scaler is not None and train.get("scaler") is not None:
            scaler.load_state_dict(train["scaler"])
        if guard is not None and train.get("nonfinite") is not None:
            guard.load_state_dict(train["nonfinite"])
        self.result = FitResult(step=self.step, epoch=self.epoch, first_step=self.step, resumed_from=directory)

    def run(self, log: TrainLog) -> FitResult:
        self.log = log
        try:
            while (self.epochs is None or self.epoch < self.epochs) and not self._train_epoch():
                if self.evals is not None and self.eval_interval == "epoch":
                    self._evaluate()
            if self.evals is not None and (not self.result.evals or self.result.evals[-1]["step"] != self.step):
                self._evaluate()
            if self.checkpoints.root is not None and self.last_saved != self.step \
                    and self.step > self.result.first_step:
                self._save()  # the end of every run with a save_dir, save_interval or not
            self.checkpoints.wait()
        finally:
            log.close()
            self.trainer.track_grad_norm = False  # fit's setting, not the caller's
        self.result.step, self.result.epoch = self.step, self.epoch
        self.result.checkpoints = list(self.checkpoints.saved)
        self.result.save_blocked_s = list(self.checkpoints.blocked_s)
        return self.result

    def _done(self) -> bool:
        return self.max_steps is not None and self.step >= self.max_steps

    def _train_epoch(self) -> bool:
        """Train the rest of the current epoch; True when ``max_steps`` was reached (the epoch may go on later)."""
        stepped = False
        for batch in self.data.batches(self.epoch, self.position):
            self.trainer.track_grad_norm = (self.step + 1) % self.log_interval == 0  # logged: compute it
            try:
                loss = self.trainer.train_step(batch)
            except FloatingPointError as e:  # a non-finite clipping norm, or max_consecutive_skips: say where
                raise FloatingPointError(f"step {self.step + 1} (epoch {self.epoch}): {e}") from e
            if self.scheduler is not None and not self.trainer.last_step_skipped:
                self.scheduler.step()  # a skipped step (fp16 overflow, skip_nonfinite) does not advance the schedule
            self.step, self.position, stepped = self.step + 1, self.position + 1, True
            self._after_step(loss, batch)
            if self.sigterm.requested():
                self._stop_on_sigterm()
            if self._done():
                return True
        if not stepped and self.position == 0:
            raise ValueError("train_data gave no batch in an epoch (an empty iterable?)")
        self.epoch, self.position = self.epoch + 1, 0
        return self._done()

    def _after_step(self, loss: float, batch: dict) -> None:
        self.result.losses.append(loss)
        self.progress.step(self.step)
        self._window.append(loss)
        self._window_terms.append(self.trainer.last_loss_terms)
        self._window_tokens += (_tokens(self.trainer.model, batch) or 0) * self.data.mesh_dp
        self.log.step()
        if self.step % self.log_interval == 0:
            self._log_window()
        if self.evals is not None and isinstance(self.eval_interval, int) and self.step % self.eval_interval == 0:
            self._evaluate()
        if self.save_interval and self.step % self.save_interval == 0:
            self._save()

    def _log_window(self) -> None:
        elapsed = time.perf_counter() - self._window_start
        window, tokens = self._window, self._window_tokens
        self.log.record({"step": self.step, "epoch": self.epoch, "loss": sum(window) / len(window),
                         **mean_terms(self._window_terms),
                         "lr": self.trainer.optimizer.param_groups[0]["lr"], "grad_norm": self.trainer.last_grad_norm,
                         **self._scaler_record(),
                         "samples_per_s": len(window) * self.batch_size / elapsed,
                         "tokens_per_s": tokens / elapsed if tokens else None, **self._experts_record()})
        self._window, self._window_start, self._window_tokens = [], time.perf_counter(), 0
        self._window_terms = []

    def _experts_record(self) -> dict:
        """A mixture of experts' load since the last record: tokens per expert and the dropped share of each MoE
        layer, summed over the data-parallel ranks and the ranks sharing each sequence over sp
        (:func:`shardlib.sharding.experts.router_load`)."""
        mesh = self.trainer.mesh
        load = router_load(self.trainer.model, [mesh.group(d) for d in ("dp", "sp") if mesh.size(d) > 1])
        return {"experts": load} if load else {}

    def _scaler_record(self) -> dict:
        """fp16: the loss scale; fp16 or ``skip_nonfinite``: the steps skipped so far (inf/nan gradients, each
        counted once: :attr:`Trainer.skipped_steps <shardlib.train.trainer.Trainer.skipped_steps>`)."""
        scaler, skipped = self.trainer.scaler, self.trainer.skipped_steps
        return ({"loss_scale": scaler.scale} if scaler is not None else {}) | \
            ({"skipped_steps": skipped} if skipped is not None else {})

    def _evaluate(self) -> None:
        record = {"step": self.step, "epoch": self.epoch, "eval": True,
                  **evaluate(self.trainer, self.evals, self.metrics)}
        self.result.evals.append(record)
        self.log.record(record)

    def _stop_on_sigterm(self) -> None:
        """Save this step (unless just saved), wait for the write, and leave fit with SIGTERM's exit status."""
        if self.last_saved != self.step:
            self._save()
        self.checkpoints.wait()
        if not dist.is_initialized() or dist.get_rank() == 0:
            logging.getLogger("shardlib.train").warning("SIGTERM: stopped at step %d, saved %s", self.step,
                                                        self.checkpoints.saved[-1])
        raise SystemExit(EXIT_STATUS)

    def _save(self) -> None:
        scaler, guard = self.trainer.scaler, self.trainer.nonfinite
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        json.dumps(scheduler)  # a scheduler state that JSON cannot hold fails here, before anything is written
        self.last_saved = self.step
        self.checkpoints.save(self.step, {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.position,
                                          "seed": self.seed, "batch_size": self.batch_size, "scheduler": scheduler,
                                          "scaler": scaler.state_dict() if scaler is not None else None,
                                          "nonfinite": guard.state_dict() if guard is not None else None})
