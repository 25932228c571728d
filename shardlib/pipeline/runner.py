"""The pipeline runner: this rank's ``PipelineStage`` objects and the ``torch.distributed.pipelining`` schedule
over them, one per input signature (boundary shapes are fixed at a schedule's first step).

It knows nothing of losses or optimizers: :meth:`PipelineRunner.step` runs forward and backward of one local batch
over ``microbatches`` with the caller's loss function on the last stage, :meth:`PipelineRunner.eval` runs forward
only and returns the last stage's outputs. The Trainer (``shardlib.train``) weighs, reduces, clips and steps.
"""

from __future__ import annotations

from typing import Callable

import torch

from .split import PipelineSplit

#: zero-bubble schedules are left out: they split backward into input and weight passes over the stage module's
#: ``parameters()``, and a stage module here does not own the HF model's parameters (it runs the whole model)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")
MULTI_STAGE = ("interleaved_1f1b", "looped_bfs")
_CACHED = 8  # schedules kept (one per input signature): eval tails and odd batch shapes


def _schedule_class(name: str):
    from torch.distributed.pipelining import schedules as s

    return {"gpipe": s.ScheduleGPipe, "1f1b": s.Schedule1F1B, "interleaved_1f1b": s.ScheduleInterleaved1F1B,
            "looped_bfs": s.ScheduleLoopedBFS}[name]


def check_schedule(name: str, split: PipelineSplit | None) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if split is not None and (name in MULTI_STAGE) != (len(split.local_stages) > 1):
        raise ValueError(f"schedule {name!r} with {len(split.local_stages)} stage(s) per rank: interleaved "
                         "schedules need shard(..., stages_per_rank >= 2), the others exactly 1")


class PipelineRunner:
    """Runs the stages of ``split`` with schedule ``schedule`` (one of :data:`SCHEDULES`).

    ``forward_step(model, batch)``, when given, replaces ``model(**batch)`` on every stage (see
    :class:`shardlib.pipeline.split.StageModule`). ``autocast_dtype``: autocast around every stage's forward.
    ``rng_tracker``: the model's dropout streams, left untouched by torch's shape-inference forward.
    ``after_cut``: see :class:`shardlib.pipeline.split.StageModule`.
    """

    def __init__(self, split: PipelineSplit, schedule: str = "1f1b", *, autocast_dtype: torch.dtype | None = None,
                 forward_step: Callable | None = None, rng_tracker=None, after_cut: Callable | None = None):
        check_schedule(schedule, split)
        self.split, self.schedule_name = split, schedule
        self._schedules: dict = {}
        self._loss_fn: Callable | None = None  # the current step's (a cached schedule calls it through _loss)
        for stage in split.stage_modules:
            stage.autocast_dtype = autocast_dtype
            stage.forward_step = forward_step
            stage.rng_tracker = rng_tracker
            stage.after_cut = after_cut

    @property
    def last_stage(self):
        return next((m for m in self.split.stage_modules if m.route.is_last), None)

    def step(self, batch: dict, microbatches: int, loss_fn: Callable, target: torch.Tensor) -> float:
        """Forward and backward of ``batch`` in ``microbatches``; ``loss_fn(output, target_chunk)`` gives each
        microbatch's loss on the last stage (``target`` is chunked along dim 0 like the batch). Returns the sum of
        the microbatch losses on the rank holding the last stage, 0.0 elsewhere."""
        self._loss_fn = loss_fn
        schedule = self._schedule(batch, microbatches, training=True)
        losses: list = []
        schedule.step(*self._first_stage_args(batch), target=target, losses=losses, return_outputs=False,
                      **self._stage_kwargs(batch))
        return float(sum(float(loss.detach()) for loss in losses)) if losses else 0.0

    def eval(self, batch: dict, microbatches: int) -> list:
        """Forward only; on the rank holding the last stage each microbatch's output (detached), else []."""
        schedule = self._schedule(batch, microbatches, training=False)
        last = self.last_stage
        self._clear_outputs()
        # return_outputs=False: torch would merge the last stage's outputs over microbatches, and a loss is a 0-dim
        # tensor that cannot be concatenated; the outputs come from the stage module's record instead
        if last is not None:
            last.record_outputs = True
        try:
            schedule.eval(*self._first_stage_args(batch), return_outputs=False, **self._stage_kwargs(batch))
        finally:
            if last is not None:
                last.record_outputs = False
        if last is None:
            return []
        # the schedule's first run on a new input shape adds one metadata-inference forward: keep the real ones
        outputs = list(last.outputs[-microbatches:])
        self._clear_outputs()
        return outputs

    # -- internals ------------------------------------------------------------------------------------------
    def _loss(self, output, target):
        return self._loss_fn(output, target)

    def _clear_outputs(self) -> None:
        for stage in self.split.stage_modules:
            stage.outputs.clear()

    @staticmethod
    def _input_name(batch: dict) -> str:
        return next(k for k, v in batch.items() if torch.is_tensor(v))

    def _first_stage_args(self, batch: dict) -> tuple:
        """The first stage takes the batch's first tensor positionally (torch's schedules need one)."""
        return (batch[self._input_name(batch)],) if 0 in self.split.local_stages else ()

    @staticmethod
    def _stage_kwargs(batch: dict) -> dict:
        return {k: v for k, v in batch.items() if torch.is_tensor(v)}

    def _schedule(self, batch: dict, microbatches: int, training: bool):
        from torch.distributed.pipelining import PipelineStage

        key = (training, microbatches,
               tuple((k, tuple(v.shape), v.dtype) for k, v in batch.items() if torch.is_tensor(v)))
        if key in self._schedules:
            return self._schedules[key]
        if len(self._schedules) >= _CACHED:
            self._schedules.pop(next(iter(self._schedules)))
        device = next(v for v in batch.values() if torch.is_tensor(v)).device
        name = self._input_name(batch)
        static = {k: v for k, v in batch.items() if not torch.is_tensor(v)}
        stages = []
        for module in self.split.stage_modules:
            module.input_name = name if module.index == 0 else None
            module.static_kwargs = static
            module.shape_inference_pending = True
            stages.append(PipelineStage(module, module.index, self.split.num_stages, device, group=self.split.group))
        # forward-only: every single-stage schedule runs the same forwards, and GPipe takes any microbatch count
        name = self.schedule_name if training or self.schedule_name in MULTI_STAGE else "gpipe"
        try:
            schedule = _schedule_class(name)(stages if name in MULTI_STAGE else stages[0], microbatches,
                                             loss_fn=self._loss if training else None, scale_grads=False)
        except ValueError as e:
            raise ValueError(f"pipeline schedule {name!r} with {microbatches} microbatches over "
                             f"{self.split.num_stages} stages: {e}") from None
        self._schedules[key] = schedule
        return schedule
