"""The Trainer: one training step over the dp x pp x sp x tp mesh.

    trainer = Trainer(model, lambda params: torch.optim.AdamW(params, lr=1e-4), microbatches=4, schedule="1f1b")
    loss = trainer.train_step(batch)      # batch: this data-parallel rank's share, identical across its pp x tp ranks

A step's loss is the model's own loss over the whole global batch: each microbatch's loss is weighted by its share
of the loss items (what the policy's :class:`shardlib.sharding.plan.LossItems` says the loss averages over:
targets that are not -100, masked patches, examples), counted over every data-parallel rank, so the gradient equals
the unsharded model's gradient on the global batch whatever the microbatch and data-parallel split. Gradients are
then summed over dp, clipped by the norm of the whole model and the optimizer steps.

Precision (``"fp32" | "bf16" | "fp16"``, the fp16 loss scaler, master weights) is :mod:`shardlib.train.precision`;
the optimizer over master weights and partitioned over dp (``zero=1, 2``) is :mod:`shardlib.train.optim` and
:mod:`shardlib.train.zero`; ``zero=3`` is torch's FSDP2 (:mod:`shardlib.train.fsdp`); how gradients meet over dp (DDP,
the flat ZeRO buckets, FSDP2) is one interface, :mod:`shardlib.train.dataparallel`.

The pipeline schedule belongs to :class:`shardlib.pipeline.PipelineRunner`; the data loop, evaluation, logging and
checkpoints to :meth:`Trainer.fit` (:mod:`shardlib.train.loop`). Each layer can be used alone.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..analysis.compiling import compile_model
from ..parallel.experts import release_idle_experts
from ..parallel.layout import named_layouts
from ..parallel.random import generator_disagreement
from ..parallel.timeouts import names_stalled_ranks
from ..pipeline import PipelineRunner, check_schedule
from ..sharding.documents import accept_documents
from ..sharding.experts import report_dropped_pairs
from ..sharding.recompute import rng_safe_checkpointing
from ..sharding.sharded import shard_state
from .batches import check_batch, first_tensor, microbatch_count, split_batch
from ..parallel.gradsync import late_gradients
from .dataparallel import data_parallel
from .fsdp import apply_fsdp, complete_root_forward, local_shape
from .gradients import StepGradients
from .loss_terms import LossTerms
from .nonfinite import check_skip_options, make_guard
from .optim import base_optimizer, build_optimizer, check_zero, copy_grads
from .precision import AUTOCAST_DTYPES, autocast, check_precision, make_scaler
from .step_checks import as_loss, check_step_options
from .zero import install_gather_waits


class Trainer:
    """Runs training steps of a model sharded by :func:`shardlib.shard` over its mesh.

    ``optimizer``: a function from this rank's parameters to an optimizer. ``microbatches``: per step (the
    pipeline schedule's microbatches; without a pipeline, gradient accumulation over that many slices).
    ``schedule``: one of :data:`shardlib.pipeline.SCHEDULES` (the interleaved ones need
    ``shard(..., stages_per_rank > 1)``). ``max_grad_norm``: clip by the norm over every parameter of the whole
    model (each counted once across the mesh). ``activation_checkpointing``: recompute each layer in backward.

    ``precision``: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast and a dynamic loss scaler:
    ``loss_scaler=DynamicLossScaler(...)`` or a dict of its settings; a step with an inf/nan gradient anywhere in
    the mesh is skipped everywhere, ``last_step_skipped``). ``skip_nonfinite``: skip (and count) any step whose
    gradients hold an inf/nan anywhere in the mesh, in any precision, and stop with FloatingPointError naming the
    parameters after ``max_consecutive_skips`` (default 20) in a row (:mod:`shardlib.train.nonfinite`; without it a
    non-finite gradient norm when clipping raises, and without clipping nothing is checked). ``master_weights``:
    the optimizer steps fp32 copies of fp16/bf16 weights. ``zero``: 1 partitions the optimizer state over dp, 2 the
    gradients too (both by elements of flat buckets of ``bucket_mb`` MiB, :mod:`shardlib.train.zero`), 3 the
    parameters too (FSDP2); ``offload``: keep zero=3's parameters and optimizer state in CPU memory (CUDA only);
    ``overlap_param_gather``: zero=1/2's parameter all-gathers run on into the next forward, each bucket waited for
    by its first reader (:mod:`shardlib.train.zero`).
    ``compile``: ``torch.compile`` the model in place (True, or a dict of ``torch.compile`` options; pipeline stages
    compile their layers; see :mod:`shardlib.analysis.compiling` and docs/compile.md).
    ``find_unused_parameters``: torch DDP's setting where zero=0 sums over dp with DDP; None (the default) lets the
    first step decide from the gradients it produced (:mod:`shardlib.train.dataparallel`); True for a model whose
    set of parameters its loss reaches changes from step to step (layer drop, mixtures of experts).

    Models whose outputs carry no loss: ``forward_step(model, batch) -> loss | {"loss": ...}`` (an argument, or a
    subclass method) replaces ``model(**batch)``; its loss is taken as a mean over the microbatch's examples. Under
    a pipeline it runs on every stage and must pass every batch entry to the model (see
    :class:`shardlib.pipeline.StageModule`). A loss of its own on a vocab-parallel head's logits needs
    ``shard(..., gather_logits=True)``: with labels in the batch the logits are otherwise this rank's vocab slice.
    ``loss_fn`` maps the model's first output of a microbatch (e.g. ``last_hidden_state``) to an objective that is
    *summed* over microbatches.
    """

    def __init__(self, model: nn.Module, optimizer: Callable | None = None, *, microbatches: int = 1,
                 schedule: str = "1f1b", max_grad_norm: float | None = None,
                 precision: str = "fp32", loss_scaler=None, master_weights: bool = False, zero: int = 0,
                 offload: bool = False, bucket_mb: float = 25.0, activation_checkpointing: bool = False,
                 compile: bool | dict = False, overlap_param_gather: bool = False, skip_nonfinite: bool = False,
                 max_consecutive_skips: int | None = None, find_unused_parameters: bool | None = None,
                 loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 forward_step: Callable | None = None):
        state = shard_state(model)
        params = state.pipeline.local_parameters() if state.pipeline else list(model.parameters())
        check_precision(precision, params, master_weights, loss_scaler)
        # the user's optimizer is built first (torch optimizers allocate their state lazily): zero checks its class
        base = base_optimizer(optimizer, params) if optimizer is not None and zero != 3 else None
        check_zero(zero, offload, state.mesh, optimizer, master_weights, base, overlap=overlap_param_gather,
                   compiled=bool(compile))
        check_step_options(microbatches, max_grad_norm, optimizer, forward_step, loss_fn, bucket_mb)
        check_skip_options(skip_nonfinite, max_consecutive_skips)
        if find_unused_parameters is not None and not isinstance(find_unused_parameters, bool):
            raise TypeError(f"find_unused_parameters must be None, True or False, got {find_unused_parameters!r}")
        self.model, self.mesh, self.split = model, state.mesh, state.pipeline
        apart = generator_disagreement(state.mesh)  # before anything changes the model
        if apart:
            raise ValueError(f"torch's default generator is not in the same state on every rank of the "
                             f"{' and '.join(apart)} group: replicated dropout would draw different masks there and "
                             "the copies of every replicated parameter would train apart. Seed every rank alike "
                             "before training: torch.manual_seed(seed) or shardlib.manual_seed(seed, mesh)")
        check_schedule(schedule, self.split)
        self.microbatches, self.schedule_name = microbatches, schedule
        self.max_grad_norm, self.loss_fn = max_grad_norm, loss_fn
        self.precision, self.zero = precision, zero
        self.scaler = make_scaler(precision, loss_scaler)
        self.nonfinite = make_guard(skip_nonfinite, max_consecutive_skips)  # None: the option is off
        if forward_step is not None:
            self.forward_step = forward_step  # the instance attribute shadows the method
        self.custom_forward = forward_step is not None or type(self).forward_step is not Trainer.forward_step
        if activation_checkpointing:
            rng_safe_checkpointing(model)
        if compile:  # after checkpointing, before FSDP, as torchtitan orders them
            compile_model(model, **(compile if isinstance(compile, dict) else {}))
        if zero == 3:
            apply_fsdp(model, offload=offload)
            # dp-sharded DTensors now (a pipeline's other stages: meta tensors FSDP2 ignores)
            params = self.split.local_parameters() if self.split else list(model.parameters())
        self.params = params
        self.optimizer = None
        if optimizer is not None:  # zero=3: over FSDP2's sharded parameters
            self.optimizer = build_optimizer(base or base_optimizer(optimizer, params), master_weights=master_weights,
                                             zero=zero, dp_group=self.mesh.group("dp") if zero else None,
                                             **self._zero_options(model, bucket_mb, overlap_param_gather))
            if overlap_param_gather:
                install_gather_waits(model, self.optimizer)
        self.data_parallel = data_parallel(model, self.mesh, self.split, zero, self.optimizer, params,
                                           self.custom_forward, find_unused_parameters)
        self.gradients = StepGradients(model, self.mesh, self.split, params, self.optimizer, zero)
        self.runner = None
        if self.split is not None:
            self.runner = PipelineRunner(self.split, schedule, autocast_dtype=AUTOCAST_DTYPES[precision],
                                         forward_step=self._stage_forward_step if self.custom_forward else None,
                                         rng_tracker=state.rng_tracker,
                                         after_cut=complete_root_forward if zero == 3 else None)
        self.track_grad_norm = False  # compute the norm on steps without clipping too (fit's logs)
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False  # the last step had an inf/nan gradient somewhere and was skipped
        self.loss_terms = LossTerms(model, enabled=bool(state.plan.moe) and loss_fn is None)
        self._total = 1.0

    def _zero_options(self, model: nn.Module, bucket_mb: float, overlap_param_gather: bool) -> dict:
        """:class:`~shardlib.train.zero.FlatZero`'s options under zero=1/2."""
        if self.zero not in (1, 2):
            return {}
        experts = {}
        if getattr(self.mesh, "ep", 1) > 1:  # expert weights: partitioned over the ranks holding the same experts
            experts = {"experts": {id(p) for _, p, layout in named_layouts(model) if layout.ep > 1},
                       "expert_group": self.mesh.group("edp")}
        return {"late": late_gradients(model, self.split), "order": list(model.parameters()),
                "bucket_bytes": int(bucket_mb * 2**20), "overlap_param_gather": overlap_param_gather, **experts}

    # -- overridable ------------------------------------------------------------------------------------------
    def forward_step(self, model: nn.Module, batch: dict):
        """One microbatch's forward: the model's output (with ``loss``), or a loss tensor. Override it (or pass
        ``forward_step=``) for models whose outputs carry no loss."""
        return model(**batch)

    def loss_items(self, batch: dict) -> torch.Tensor:
        """Per example of ``batch``, how many items the loss averages over (float64 [batch])."""
        if self.custom_forward or self.loss_fn is not None:
            return torch.ones(first_tensor(batch).shape[0], dtype=torch.float64)
        return shard_state(self.model).plan.loss_items.per_example(batch)

    # -- one step ---------------------------------------------------------------------------------------------
    @names_stalled_ranks
    def train_step(self, batch: dict | list[dict]) -> float:
        """zero grads, forward + backward over all microbatches, reduce and clip gradients, optimizer step.

        A list of batches accumulates gradients over all of them before the one optimizer step (gradient
        accumulation): the loss is normalized over the items of every batch together, so the step equals one
        step on their concatenation."""
        if self.optimizer is None:
            raise ValueError("this Trainer has no optimizer: pass Trainer(model, optimizer=lambda params: ...)")
        batches = batch if isinstance(batch, list) else [batch]
        if not batches:
            raise ValueError("train_step got an empty list of batches")
        for i, b in enumerate(batches):  # before any gradient is touched
            check_batch(b, "the batch" if len(batches) == 1 else f"batch {i} of {len(batches)}")
            self._accept_packed(b)
        self.zero_grad()
        total = self._global_items(batches) if self._weighted(len(batches)) else None
        losses = [self._forward_backward_tensor(b, total, sync=i == len(batches) - 1) for i, b in enumerate(batches)]
        self.reduce_gradients()
        copy_grads(self.optimizer)  # onto the master weights, where unscaling and clipping act
        self.last_step_skipped = self._check_and_clip()
        if self.last_step_skipped:
            self.zero_grad()
        else:
            self.optimizer_step()
        value = self.loss_terms.read(losses)  # read once, after the step's work is issued (a device sync)
        report_dropped_pairs(self.model)
        return value

    @property
    def last_loss_terms(self) -> dict[str, float] | None:
        """The last step's loss apart (:mod:`shardlib.train.loss_terms`): ``main_loss`` and each auxiliary router
        loss of a mixture of experts as the model added it (``router_z_loss``, ``router_aux_loss``), weighted and
        summed over dp as the returned loss; None when the loss had no auxiliary term."""
        return self.loss_terms.last

    def _weighted(self, batches: int) -> bool:
        """Whether microbatch losses need weights: with one batch, one microbatch and one dp rank the step's loss
        is the model's own (weight 1), and counting its items would cost a device sync before the forward."""
        return batches > 1 or self.microbatches > 1 or self.mesh.dp > 1 or self.split is not None

    def _check_and_clip(self) -> bool:
        """Unscale (fp16), check and clip the step's gradients; True when the step is to be skipped, the same on
        every rank of the mesh: an fp16 overflow, or with ``skip_nonfinite`` an inf/nan gradient anywhere or a
        non-finite clipping norm (:mod:`shardlib.train.nonfinite`). Raises FloatingPointError on a non-finite
        clipping norm without ``skip_nonfinite``, and on its ``max_consecutive_skips``-th skip in a row."""
        self.last_grad_norm = None
        skip = by_scaler = False
        if self.scaler is not None:
            skip = by_scaler = self.scaler.unscale_and_check(self.gradients.stepped())
            self.scaler.update(skip)
        elif self.nonfinite is not None:
            skip = self.gradients.any_non_finite()
        if not skip and self.max_grad_norm is not None:
            norm = self.clip_grad_norm(self.max_grad_norm) if self.nonfinite is None else \
                self.gradients.clip(self.max_grad_norm, raise_non_finite=False)  # a non-finite norm: returned
            skip = not math.isfinite(norm)
            self.last_grad_norm = None if skip else norm
        elif not skip and self.track_grad_norm:
            self.last_grad_norm = float(self.grad_norm())
        if self.nonfinite is not None:
            self.nonfinite.record(skip, by_scaler=by_scaler, names=self.gradients.non_finite_everywhere)
        return skip

    @property
    def skipped_steps(self) -> int | None:
        """Steps skipped for inf/nan gradients so far: the fp16 loss scaler's plus ``skip_nonfinite``'s, each step
        counted once; None when neither is on."""
        if self.scaler is None and self.nonfinite is None:
            return None
        return (self.scaler.skipped if self.scaler is not None else 0) + \
            (self.nonfinite.skipped if self.nonfinite is not None else 0)

    def optimizer_step(self) -> None:
        """The optimizer's step, once the gradients are reduced, unscaled and clipped (override to wrap it)."""
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.data_parallel.zero_grad()
        for p in self.params:
            p.grad = None
        for _, stepped in self.gradients.pairs():
            stepped.grad = None

    @names_stalled_ranks
    def forward_backward(self, batch: dict, *, total_items: float | None = None) -> float:
        """Accumulate the gradients of ``batch`` (call again before :meth:`reduce_gradients` to accumulate more,
        passing the ``total_items`` of all of them, see :meth:`train_step`). Returns the loss of ``batch`` over
        every data-parallel rank (same value on every rank). The gradients are summed over dp by
        :meth:`reduce_gradients`, after backward (:meth:`train_step` sums them during its last backward)."""
        check_batch(batch)
        self._accept_packed(batch)
        return self.loss_terms.read([self._forward_backward_tensor(batch, total_items, sync=False)])

    def _forward_backward_tensor(self, batch: dict, total_items: float | None, *, sync: bool) -> torch.Tensor:
        """``forward_backward``, its loss as a float64 tensor not read yet (reading it syncs a device), followed by
        its auxiliary loss terms where the model has some (:meth:`LossTerms.append_to
        <shardlib.train.loss_terms.LossTerms.append_to>`); ``sync``:
        the last backward before the optimizer step, whose DDP sums the gradients over dp while it runs.
        ``total_items`` None (:meth:`_weighted` false): the batch's loss is the model's own, unweighted."""
        if not self.model.training:  # train() walks every module: only when eval_step (or the user) left eval mode
            self.model.train()
        self.loss_terms.start_batch()
        weights = None
        if total_items is not None or self._weighted(1):
            self._total = total_items if total_items is not None else self._global_items([batch])
            weights = self.loss_items(batch)
        if self.split is None:
            loss = self._run_plain(batch, weights, sync)
        else:
            loss = self.runner.step(batch, self.microbatches, self._pipeline_loss, weights)
        loss = torch.as_tensor(loss, dtype=torch.float64)  # the pipeline's: a Python float (float64 already)
        loss = loss.to(device=self.mesh.device_type).reshape(1)  # NCCL: CUDA tensors only
        if self.scaler is not None:
            loss = loss / self.scaler.scale  # what backward saw was scaled
        loss = self.loss_terms.append_to(loss)
        for dim in ("dp", "pp"):
            if self.mesh.size(dim) > 1:
                dist.all_reduce(loss, group=self.mesh.group(dim))
        return loss

    def _global_items(self, batches: list[dict]) -> float:
        """The loss items of ``batches`` summed over data-parallel ranks (1 with a user ``loss_fn``: summed)."""
        if self.loss_fn is not None:
            return 1.0
        total = sum(self.loss_items(b).sum() for b in batches)
        if self.mesh.dp > 1:
            total = total.to(self.mesh.device_type)
            dist.all_reduce(total, group=self.mesh.group("dp"))
        return float(total)

    def reduce_gradients(self) -> None:
        """Sum the gradients over tied pipeline stages, then over data-parallel replicas (under zero=1/2 into the
        pieces each dp rank steps): :class:`~shardlib.train.dataparallel.DataParallel` ``.finish_grads``."""
        if self.split is not None:
            shard = functools.partial(local_shape, dp=self.mesh.dp, dp_rank=self.mesh.local_rank("dp"))
            self.split.sync_tied_grads(shard if self.zero == 3 else None)
        self.data_parallel.finish_grads()
        if self.zero == 3:  # experts no rank holding them ran: no gradient, as in the unsharded model
            holders = "edp" if getattr(self.mesh, "ep", 1) > 1 else "dp"
            release_idle_experts(self.model, self.mesh.group(holders) if self.mesh.size(holders) > 1 else None)

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradient of the whole (unsharded) model, a float64 scalar tensor
        (:meth:`StepGradients.norm <shardlib.train.gradients.StepGradients.norm>`)."""
        return self.gradients.norm()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale every gradient so that the global norm is at most ``max_norm``; returns the norm before. A
        non-finite norm raises FloatingPointError naming the parameters, and nothing is stepped
        (:meth:`StepGradients.clip <shardlib.train.gradients.StepGradients.clip>`)."""
        return self.gradients.clip(max_norm)

    @names_stalled_ranks
    def eval_step(self, batch: dict) -> list[dict]:
        """Forward only. On the rank holding the last stage (or every rank without a pipeline) returns each
        microbatch's output (detached; ``microbatch_count(len, microbatches)`` microbatches, so any batch size
        runs); elsewhere an empty list."""
        self.model.eval()
        parts = microbatch_count(check_batch(batch), self.microbatches)
        self._accept_packed(batch)
        with torch.no_grad():
            if self.split is not None:
                outputs = self.runner.eval(batch, parts)
                self.data_parallel.after_eval()
                return outputs
            outputs = []
            for mb in split_batch(batch, parts):
                with self._autocast(mb):
                    out = self.forward_step(self.model, mb)
                outputs.append({"loss": out} if torch.is_tensor(out) else dict(out.items()))
            self.data_parallel.after_eval()
            return outputs

    # -- internals ------------------------------------------------------------------------------------------
    def _accept_packed(self, batch: dict) -> None:
        """A packed batch (``document_ids``, :mod:`shardlib.train.packing`): the model keeps its documents apart
        from now on (:func:`shardlib.sharding.documents.accept_documents`; a model that cannot is refused here)."""
        if "document_ids" in batch:
            accept_documents(self.model)

    def _autocast(self, batch):
        return autocast(self.precision, first_tensor(batch).device.type)

    def _run_plain(self, batch: dict, weights: torch.Tensor | None, sync: bool) -> torch.Tensor:
        loss_sum = None
        microbatches = split_batch(batch, self.microbatches) if self.microbatches > 1 else [batch]
        chunks = weights.chunk(self.microbatches) if weights is not None else [None]
        parts = list(zip(microbatches, chunks))
        for i, (mb, w) in enumerate(parts):
            with self.data_parallel.backward(last=sync and i == len(parts) - 1):
                with self._autocast(mb):
                    out = self.forward_step(self.data_parallel.module, mb)
                    if self.loss_fn is not None:
                        loss = self.loss_fn(out[next(iter(out.keys()))])
                    else:
                        loss = as_loss(out, "forward_step" if self.custom_forward else type(self.model).__name__)
                        self.loss_terms.add(out, self._share(w))
                    del out  # the other outputs (an LM's logits: batch x vocabulary) would live through backward
                scaled = self._scale(loss, w)
                scaled.backward()
            loss_sum = scaled.detach() if loss_sum is None else loss_sum + scaled.detach()
        return loss_sum  # times the fp16 loss scale, which forward_backward divides out

    def _stage_forward_step(self, model, batch):
        result = self.forward_step(model, batch)
        as_loss(result, "forward_step")  # checked on the last stage, where the model's forward returns
        return result

    def _scale(self, loss: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """The microbatch loss as backward sees it: weighted by its share of the loss items (``weights`` None: the
        step's only microbatch, weight 1), times the fp16 loss scale."""
        factor = self.scaler.scale if self.scaler is not None else 1.0
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()  # an autocast loss times 2**16 would overflow fp16 (backward then starts in fp32)
        if self.loss_fn is not None or weights is None:
            return loss * factor if factor != 1.0 else loss
        share = self._share(weights)
        if share == 0.0:  # no loss items here: HF's mean over none is NaN (its gradient is 0); it adds nothing
            return loss.nan_to_num(0.0) * 0.0
        return loss * (share * factor)

    def _share(self, weights: torch.Tensor | None) -> float:
        """A microbatch's share of the step's loss items (``weights`` None: the step's only microbatch, 1). A global
        batch with no loss items at all (masked image modeling with no masked patch): 0 for every microbatch, whose
        loss is 0 (HF divides by items + eps), and so is the weighted sum, not 0 / 0."""
        if weights is None:
            return 1.0
        return float(weights.sum() / self._total) if self._total else 0.0

    def _pipeline_loss(self, output, weights):
        loss = output[0] if isinstance(output, (tuple, list)) else output
        if self.loss_fn is not None:
            return self._scale(self.loss_fn(loss), weights)
        return self._scale(as_loss(loss, type(self.model).__name__), weights)

    def fit(self, train_data, **options):
        """The training loop: data, evaluation, logging, checkpoints and exact resume
        (:func:`shardlib.train.loop.fit`, which documents every option)."""
        from .loop import fit

        return fit(self, train_data, **options)
