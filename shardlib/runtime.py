"""Training over the dp x pp x tp mesh: microbatches, pipeline schedules, data-parallel gradient reduction,
gradient clipping over the whole mesh, bf16 autocast, activation checkpointing and gradient accumulation.

    trainer = Trainer(model, lambda params: torch.optim.AdamW(params, lr=1e-4), microbatches=4, schedule="1f1b")
    loss = trainer.train_step(batch)      # batch: this data-parallel rank's share, identical across its pp x tp ranks

The loss of a step is the model's own loss over the whole global batch: each microbatch's loss is weighted by its
share of the loss items (targets that are not -100 for token losses, masked patches for masked image modeling,
examples otherwise), counted over every data-parallel rank, so the gradient equals the unsharded model's gradient
on the global batch whatever the microbatch and data-parallel split. Gradients are then summed over dp.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_reduce_flat
from .layout import named_layouts
from .losses import IGNORE_INDEX

#: zero-bubble schedules are left out: they split backward into input and weight passes over the stage module's
#: ``parameters()``, and a stage module here does not own the HF model's parameters (it runs the whole model)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")
_MULTI_STAGE = ("interleaved_1f1b", "looped_bfs")


def _schedule_class(name: str):
    from torch.distributed.pipelining import schedules as s

    return {"gpipe": s.ScheduleGPipe, "1f1b": s.Schedule1F1B, "interleaved_1f1b": s.ScheduleInterleaved1F1B,
            "looped_bfs": s.ScheduleLoopedBFS}[name]


def loss_items(model: nn.Module, batch: dict) -> torch.Tensor:
    """Per example of ``batch``, how many items the model's loss averages over (float64, shape [batch])."""
    state = getattr(model, "_shardlib", None)
    kind = state.plan.loss.kind if state is not None and state.plan.loss is not None else None
    first = next(v for v in batch.values() if torch.is_tensor(v))
    n = first.shape[0]
    if "bool_masked_pos" in batch and batch["bool_masked_pos"] is not None:  # ViT masked image modeling
        return batch["bool_masked_pos"].reshape(n, -1).sum(1).double()
    labels = batch.get("labels")
    if kind != "pretraining" and torch.is_tensor(labels) and not labels.is_floating_point() and labels.dim() >= 2:
        if kind == "causal_lm":
            labels = labels[..., 1:]
        return (labels != IGNORE_INDEX).reshape(n, -1).sum(1).double()
    return torch.ones(n, dtype=torch.float64)


def split_batch(batch: dict, parts: int) -> list[dict]:
    """``parts`` equal slices along dim 0 of every tensor (other values are shared)."""
    sizes = {v.shape[0] for v in batch.values() if torch.is_tensor(v)}
    if len(sizes) != 1:
        raise ValueError(f"batch tensors disagree on the batch size: {sorted(sizes)}")
    (size,) = sizes
    if size % parts:
        raise ValueError(f"batch size {size} is not divisible by {parts} microbatches")
    step = size // parts
    return [{k: v[i * step:(i + 1) * step] if torch.is_tensor(v) else v for k, v in batch.items()}
            for i in range(parts)]


def dp_shard(batch: dict, mesh) -> dict:
    """This data-parallel rank's contiguous share of a global batch (the same on its pp x tp ranks)."""
    if mesh.dp == 1:
        return batch
    return split_batch(batch, mesh.dp)[mesh.local_rank("dp")]


def rng_safe_checkpointing(model: nn.Module) -> None:
    """HF activation checkpointing per layer (non-reentrant) whose recomputation replays the per-rank dropout
    stream too: the tracker's state at the forward is restored for the recompute, then put back."""
    tracker = model._shardlib.rng_tracker

    def context_fn():
        snapshot = tracker.get_states()

        @contextlib.contextmanager
        def recompute():
            current = tracker.get_states()
            tracker.set_states(snapshot)
            try:
                yield
            finally:
                tracker.set_states(current)

        return contextlib.nullcontext(), recompute()

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                       "context_fn": context_fn})


class Trainer:
    """Runs training steps of a model sharded by :func:`shardlib.shard` over its mesh.

    ``optimizer``: a function from this rank's parameters to an optimizer. ``microbatches``: per step (the
    pipeline schedule's microbatches; without a pipeline, gradient accumulation over that many slices).
    ``schedule``: one of :data:`SCHEDULES` (the interleaved ones need ``shard(..., stages_per_rank > 1)``).
    ``max_grad_norm``: clip by the norm over every parameter of the whole model (each counted once across the
    mesh). ``autocast_dtype``: e.g. ``torch.bfloat16``. ``activation_checkpointing``: recompute each layer in
    backward. ``loss_fn``: for models that compute no loss (base models): maps the last stage's first output
    (e.g. ``last_hidden_state``) of a microbatch to its loss; microbatch losses are summed.
    """

    def __init__(self, model: nn.Module, optimizer: Callable | None = None, *, microbatches: int = 1,
                 schedule: str = "1f1b", max_grad_norm: float | None = None,
                 autocast_dtype: torch.dtype | None = None, activation_checkpointing: bool = False,
                 loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if not hasattr(model, "_shardlib"):
            raise ValueError(f"{type(model).__name__} is not sharded: call shardlib.shard(model, mesh) first")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
        self.model, self.mesh = model, model._shardlib.mesh
        self.split = model._shardlib.pipeline
        if self.split is not None and (schedule in _MULTI_STAGE) != (len(self.split.local_stages) > 1):
            raise ValueError(f"schedule {schedule!r} with {len(self.split.local_stages)} stage(s) per rank: "
                             "interleaved schedules need shard(..., stages_per_rank >= 2), the others exactly 1")
        self.microbatches, self.schedule_name = microbatches, schedule
        self.max_grad_norm, self.autocast_dtype, self.loss_fn = max_grad_norm, autocast_dtype, loss_fn
        if activation_checkpointing:
            rng_safe_checkpointing(model)
        self.params = self.split.local_parameters() if self.split else [p for p in model.parameters()]
        self.optimizer = optimizer(self.params) if optimizer is not None else None
        self._schedules: dict = {}
        self._total = 1.0
        if self.split is not None:
            for stage in self.split.stage_modules:
                stage.autocast_dtype = autocast_dtype

    # -- public ---------------------------------------------------------------------------------------------
    def train_step(self, batch: dict | list[dict]) -> float:
        """zero grads, forward + backward over all microbatches, reduce and clip gradients, optimizer step.

        A list of batches accumulates gradients over all of them before the one optimizer step (gradient
        accumulation): the loss is normalized over the items of every batch together, so the step equals one
        step on their concatenation."""
        batches = batch if isinstance(batch, list) else [batch]
        self.zero_grad()
        total = self._global_items(batches)
        loss = sum(self.forward_backward(b, total_items=total) for b in batches)
        self.reduce_gradients()
        if self.max_grad_norm is not None:
            self.clip_grad_norm(self.max_grad_norm)
        self.optimizer.step()
        return loss

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def forward_backward(self, batch: dict, *, total_items: float | None = None) -> float:
        """Accumulate the gradients of ``batch`` (call again before :meth:`reduce_gradients` to accumulate more,
        passing the ``total_items`` of all of them, see :meth:`train_step`). Returns the loss of ``batch`` over
        every data-parallel rank (same value on every rank)."""
        self.model.train()
        self._total = total_items if total_items is not None else self._global_items([batch])
        weights = self._weights(batch)
        if self.split is None:
            loss = self._run_plain(batch, weights)
        else:
            loss = self._run_pipeline(batch, weights)
        loss = torch.tensor([loss], dtype=torch.float64)
        for dim in ("dp", "pp"):
            if self.mesh.size(dim) > 1:
                dist.all_reduce(loss, group=self.mesh.group(dim))
        return float(loss)

    def _weights(self, batch: dict) -> torch.Tensor:
        return loss_items(self.model, batch) if self.loss_fn is None else torch.ones(_batch_size(batch))

    def _global_items(self, batches: list[dict]) -> float:
        """The loss items of ``batches`` summed over data-parallel ranks (1 with a user ``loss_fn``: summed)."""
        if self.loss_fn is not None:
            return 1.0
        total = sum(self._weights(b).sum() for b in batches)
        if self.mesh.dp > 1:
            dist.all_reduce(total, group=self.mesh.group("dp"))
        return float(total)

    def reduce_gradients(self) -> None:
        """Tied parameters across pipeline stages get the sum of their stages' gradients; then gradients are
        summed over data-parallel replicas (one flat all-reduce per dtype)."""
        if self.split is not None:
            self.split.sync_tied_grads()
        if self.mesh.dp > 1:
            group = self.mesh.group("dp")
            # a parameter no replica used keeps grad None (AdamW then leaves it alone, as without dp)
            used = torch.tensor([p.grad is not None for p in self.params], dtype=torch.uint8)
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group)
            params = [p for p, u in zip(self.params, used.tolist()) if u]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_flat([p.grad for p in params], group)

    def grad_norm(self) -> float:
        """The global L2 norm of the gradient of the whole (unsharded) model: tensor-parallel shards summed,
        replicated parameters and parameters tied across stages counted once."""
        layouts = {id(t): layout for _, t, layout in named_layouts(self.model)}
        tp_rank = self.mesh.tp_rank if self.mesh.tp > 1 else 0
        first_holder = self._first_pp_holder()
        total = torch.zeros(1, dtype=torch.float64)
        for p in self.params:
            if p.grad is None:
                continue
            layout = layouts.get(id(p))
            if (layout is None or not layout.is_sharded) and tp_rank != 0:
                continue
            if not first_holder.get(id(p), True):
                continue
            total += p.grad.detach().double().square().sum()
        for dim in ("tp", "pp"):
            if self.mesh.size(dim) > 1:
                dist.all_reduce(total, group=self.mesh.group(dim))
        return math.sqrt(float(total))

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = self.grad_norm()
        scale = max_norm / (norm + 1e-6)
        if scale < 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def eval_step(self, batch: dict) -> list[dict]:
        """Forward only. On the rank holding the last stage (or every rank without a pipeline) returns each
        microbatch's model output (detached); elsewhere an empty list."""
        self.model.eval()
        with torch.no_grad():
            if self.split is None:
                with self._autocast(batch):
                    return [{k: v for k, v in self.model(**mb).items()} for mb in split_batch(batch, self.microbatches)]
            schedule, last = self._schedule(batch, eval=True)
            last.outputs.clear() if last is not None else None
            schedule.eval(*self._first_stage_args(batch), **self._stage_kwargs(batch))
            # the schedule's first run on a new input shape adds one metadata-inference forward: keep the real ones
            return list(last.outputs[-self.microbatches:]) if last is not None else []

    # -- internals ------------------------------------------------------------------------------------------
    def _autocast(self, batch):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=_first_tensor(batch).device.type, dtype=self.autocast_dtype)

    def _run_plain(self, batch: dict, weights: torch.Tensor) -> float:
        loss_sum = 0.0
        for mb, w in zip(split_batch(batch, self.microbatches), weights.chunk(self.microbatches)):
            with self._autocast(mb):
                out = self.model(**mb)
                loss = self.loss_fn(out[next(iter(out.keys()))]) if self.loss_fn else out.loss
            scaled = self._scale(loss, w)
            scaled.backward()
            loss_sum += float(scaled.detach())
        return loss_sum

    def _scale(self, loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if loss is None:
            raise ValueError(f"{type(self.model).__name__} computed no loss: pass labels, or Trainer(loss_fn=...)")
        if self.loss_fn is not None:
            return loss
        # a global batch with no loss items at all (masked image modeling with no masked patch): every microbatch
        # loss is 0 (HF divides by items + eps), and so is the weighted sum, not 0 / 0
        return loss * (float(weights.sum() / self._total) if self._total else 0.0)

    def _run_pipeline(self, batch: dict, weights: torch.Tensor) -> float:
        schedule, last = self._schedule(batch, eval=False)
        losses: list = []
        schedule.step(*self._first_stage_args(batch), target=weights, losses=losses, return_outputs=False, **self._stage_kwargs(batch))
        if last is not None:
            last.outputs.clear()
        return float(sum(float(l.detach()) for l in losses)) if losses else 0.0

    def _input_name(self, batch: dict) -> str:
        return next(k for k, v in batch.items() if torch.is_tensor(v))

    def _first_stage_args(self, batch: dict) -> tuple:
        """The first stage takes the batch's first tensor positionally (torch's schedules need one)."""
        return (batch[self._input_name(batch)],) if 0 in self.split.local_stages else ()

    def _stage_kwargs(self, batch: dict) -> dict:
        return {k: v for k, v in batch.items() if torch.is_tensor(v)}

    def _schedule(self, batch: dict, eval: bool):
        """A PipelineStage per local stage and the schedule over them, one per input signature (boundary shapes
        are fixed at a schedule's first step)."""
        from torch.distributed.pipelining import PipelineStage

        key = (eval, tuple((k, tuple(v.shape), v.dtype) for k, v in batch.items() if torch.is_tensor(v)))
        if key not in self._schedules:
            if len(self._schedules) >= 8:
                self._schedules.pop(next(iter(self._schedules)))
            device = _first_tensor(batch).device
            name = self._input_name(batch)
            static = {k: v for k, v in batch.items() if not torch.is_tensor(v)}
            stages = []
            for module in self.split.stage_modules:
                module.input_name = name if module.index == 0 else None
                module.static_kwargs = static
                stages.append(PipelineStage(module, module.index, self.split.num_stages, device,
                                            group=self.split.group))
            cls = _schedule_class(self.schedule_name)
            loss_fn = None if eval else self._pipeline_loss
            try:
                sched = cls(stages if self.schedule_name in _MULTI_STAGE else stages[0], self.microbatches,
                            loss_fn=loss_fn, scale_grads=False)
            except ValueError as e:
                raise ValueError(f"pipeline schedule {self.schedule_name!r} with {self.microbatches} microbatches "
                                 f"over {self.split.num_stages} stages: {e}") from None
            last = next((m for m in self.split.stage_modules if m.route.is_last), None)
            self._schedules[key] = (sched, last)
        return self._schedules[key]

    def _pipeline_loss(self, output, weights):
        loss = output[0] if isinstance(output, (tuple, list)) else output
        if self.loss_fn is not None:
            return self.loss_fn(loss)
        return self._scale(loss, weights)

    def _first_pp_holder(self) -> dict[int, bool]:
        """id(param) -> whether this pp rank is the lowest one holding it (tied parameters count once)."""
        if self.split is None:
            return {}
        result = {}
        for name, _, _, ranks in self.split.tied:
            if self.split.pp_rank in ranks:
                result[id(self.model.get_parameter(name))] = self.split.pp_rank == min(ranks)
        return result


def _first_tensor(batch: dict) -> torch.Tensor:
    return next(v for v in batch.values() if torch.is_tensor(v))


def _batch_size(batch: dict) -> int:
    return _first_tensor(batch).shape[0]
