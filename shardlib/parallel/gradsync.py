"""Bucketed gradient all-reduce of the parameters a sequence-parallel group replicates.

Under sequence parallelism each rank of the group sees only its share of the tokens, so a parameter the group
replicates (Megatron SP: LayerNorm weights and biases, row-parallel biases; all-to-all SP: every parameter of the
layer) gets a partial gradient on each rank, and the full gradient is their sum. Before, every such parameter had a
gradient hook with its own blocking all-reduce: 16 small messages per BERT layer, each paying gloo's latency.

Now the parameters of one layer form a **bucket**. Each parameter's gradient hook (which runs before the gradient
is accumulated into ``.grad``) stashes its partial gradient and hands autograd a zero to accumulate instead (an
expanded scalar: nothing allocated); when the last parameter of the bucket has reported, the bucket's partial
gradients are flattened into one buffer whose all-reduce starts at once, without waiting (``async_op=True``), so it
runs while backward goes on through the earlier layers. When the next bucket starts, the one before it is waited
for and each of its reduced gradients added into its ``.grad``, so one flat buffer is in flight at a time (holding
every layer's until backward ends made the end of a stage's backward hold its gradients twice: a T5 stage under
all-to-all SP, 40 MiB). A callback queued on the autograd engine runs when that backward finishes: it finishes the
last bucket (and any whose member got no gradient). So after ``loss.backward()`` returns every ``.grad`` is
complete, as before (gradient accumulation over several backwards included: each backward reduces only its own
contribution), with one message per layer. A parameter that got no gradient in a backward on every rank of the
group keeps its ``.grad`` untouched (the ranks of a sequence group run the same graph, so they agree on which).

Limits. ``torch.autograd.grad(loss, params)`` returns zeros for these parameters (their gradient reaches ``.grad``
in the callback, not the returned tuple); torch's DDP has the same restriction. Hooks that read ``.grad`` right
after accumulation (torch's DDP) must not own these parameters: the Trainer keeps them out of DDP and sums them
over data-parallel ranks itself once backward is done (:mod:`shardlib.train.dataparallel`). FSDP2 (``zero=3``)
reduce-scatters each layer's gradients right after the layer's backward, so under it every gradient is reduced
alone in its hook, as it arrives (:func:`unbucket`).
"""

from __future__ import annotations

import functools
import weakref

import torch

from .collectives import Group, all_reduce, start_all_reduce


class _Bucket:
    """The replicated parameters of one layer and the partial gradients of the backward in progress."""

    def __init__(self, sync: "ReplicatedGradSync"):
        self.sync = sync
        self.params: list[weakref.ref] = []  # in registration order: the same on every rank of the group
        self.task = None  # the autograd graph task (one backward call) whose gradients it collects
        self._reset()

    def _reset(self) -> None:
        self.partial: dict[int, torch.Tensor] = {}  # member index -> this backward's partial gradient
        self.late: list[tuple[int, torch.Tensor]] = []  # a member reporting again after the bucket started
        self.work = self.flat = self.order = None

    def report(self, param_ref: weakref.ref, grad: torch.Tensor) -> torch.Tensor:
        """A member's partial gradient arrived (its gradient hook): stash it, start the bucket's all-reduce once
        every member reported, and give autograd zeros to accumulate."""
        index = self._index(param_ref())
        if index is None or not self.sync.bucketed:  # replaced since, or FSDP2: reduce it alone, now
            return all_reduce(grad, self.sync.group)
        task = torch._C._current_graph_task_id()
        if task != self.task:  # a new backward (one that raised midway never finished this bucket: drop its state)
            self._reset()
            self.task = task
        self.sync.pending(self, task)
        if self.order is not None:
            self.late.append((index, grad))
        elif index in self.partial:
            self.partial[index] = self.partial[index] + grad
        else:
            self.partial[index] = grad
            if len(self.partial) == len(self.params):
                self.start()
        return grad.new_zeros(()).expand(grad.shape)  # what autograd accumulates: nothing, and nothing allocated

    def _index(self, param) -> int | None:
        return next((i for i, r in enumerate(self.params) if param is not None and r() is param), None)

    def start(self) -> None:
        """All-reduce the stashed partial gradients as one flat buffer (per dtype: one buffer, usually), async."""
        self.order = sorted(self.partial)
        grads = [self.partial[i] for i in self.order]
        if len({g.dtype for g in grads}) > 1:  # mixed dtypes (rare): one blocking all-reduce each
            self.flat = [all_reduce(g, self.sync.group) for g in grads]
            return
        self.sync.settle_before(self)
        self.flat = torch.cat([g.reshape(-1) for g in grads])
        self.work = start_all_reduce(self.flat, self.sync.group)
        self.sync.in_flight = self

    def finish(self) -> None:
        """Wait for the bucket's all-reduce and add each reduced gradient into its parameter's ``.grad``."""
        if self.order is None:
            self.start()  # some member got no gradient in this backward (on every rank alike)
        if self.work is not None:
            self.work.wait()  # bounded by the process group's timeout
        sizes = [self.partial[i].numel() for i in self.order]
        reduced = self.flat if isinstance(self.flat, list) else self.flat.split(sizes)
        for i, r in zip(self.order, reduced):
            self._add(i, r.view_as(self.partial[i]))
        for i, grad in self.late:  # a member that reported again after the bucket started (a layer run twice)
            self._add(i, all_reduce(grad, self.sync.group))
        self._reset()

    def _add(self, index: int, grad: torch.Tensor) -> None:
        p = self.params[index]()
        if p is None:
            return
        if p.grad is None:
            p.grad = grad.clone()
        else:
            p.grad.add_(grad)


#: set on a module (a mixture-of-experts block under Megatron sequence parallelism) that computes on the whole
#: sequence on every rank of the group: its replicated parameters get their whole gradient on every rank, so the
#: group's sum leaves them out
WHOLE_SEQUENCE_ATTR = "_shardlib_whole_sequence"


def _whole_sequence_params(layer: torch.nn.Module) -> set[int]:
    return {id(p) for m in layer.modules() if m.__dict__.get(WHOLE_SEQUENCE_ATTR) for p in m.parameters()}


class ReplicatedGradSync:
    """Forward pre-hook for a layer of a sequence-parallel stack that buckets the gradients of the layer's
    parameters replicated over ``group`` (module docstring). Megatron style (``group`` = TP): the LayerNorms and
    row-parallel biases (``tp_sharded_too=False``); all-to-all (``group`` = sp, which shards no parameter): every
    parameter. Hooks are attached at the layer's first forward and again to any parameter object that replaced one
    since (materializing a meta model or loading a checkpoint creates new parameters)."""

    def __init__(self, group: Group, *, tp_sharded_too: bool = False):
        self.group, self.tp_sharded_too = group, tp_sharded_too
        self.bucketed = True  # False: each gradient all-reduced alone in its hook (see unbucket)
        self.hooked = weakref.WeakValueDictionary()  # id -> parameter (tensors compare elementwise: no WeakSet)
        self.buckets: "weakref.WeakKeyDictionary[torch.nn.Module, _Bucket]" = weakref.WeakKeyDictionary()
        #: per backward in progress (autograd graph task id), its buckets in first-report order
        self._waiting: dict[int, list[_Bucket]] = {}
        self.in_flight: _Bucket | None = None  # the bucket whose all-reduce was started last

    def __call__(self, layer: torch.nn.Module, args=()) -> None:
        """Hook what is not hooked yet (called once at install, then before every eager forward; compiled code
        skips it: tensor hooks cannot be registered from inside a graph, and those attached eagerly still fire)."""
        from .layout import layout_of

        if torch.compiler.is_compiling():
            return
        params = [(name, p) for name, p in layer.named_parameters() if p.requires_grad]
        if all(self.hooked.get(id(p)) is p for _, p in params):
            return
        whole = _whole_sequence_params(layer)
        members = [p for name, p in params if id(p) not in whole
                   and (self.tp_sharded_too or not layout_of(layer, name).is_sharded)]
        bucket = self.buckets.get(layer)
        if bucket is None:
            bucket = self.buckets[layer] = _Bucket(self)
        bucket.params = [weakref.ref(p) for p in members]
        for p in members:
            if self.hooked.get(id(p)) is not p:
                p.register_hook(functools.partial(bucket.report, weakref.ref(p)))
                self.hooked[id(p)] = p
        for _, p in params:  # sharded parameters need no hook: remember them as seen
            self.hooked.setdefault(id(p), p)

    def pending(self, bucket: _Bucket, task: int) -> None:
        """``bucket`` has a gradient in backward ``task``: make sure that backward's end-of-backward callback will
        finish it. Per task: a reentrant checkpoint runs a nested backward inside the outer one."""
        waiting = self._waiting.get(task)
        if waiting is None:
            # tasks whose every bucket moved on to another backward raised midway: forget them
            self._waiting = {t: w for t, w in self._waiting.items() if any(b.task == t for b in w)}
            waiting = self._waiting[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._finish_all, task))
        if bucket not in waiting:
            waiting.append(bucket)

    def settle_before(self, bucket: _Bucket) -> None:
        """Before ``bucket`` starts its all-reduce, finish the one in flight of the same backward (its members'
        accumulations ran in their own autograd nodes, before this bucket's last member reported): at most one
        bucket's flat copy lives besides the gradients, not one per layer until backward ends. Every rank of the
        group runs the same graph, so every rank settles the same buckets at the same point."""
        previous, self.in_flight = self.in_flight, None
        if previous is not None and previous is not bucket and previous.task == bucket.task \
                and previous.order is not None:
            previous.finish()
            previous.task = None  # finished: the end-of-backward callback skips it (a later report starts anew)

    def _finish_all(self, task: int) -> None:
        if self.in_flight is not None and self.in_flight.task == task:
            self.in_flight = None
        for bucket in self._waiting.pop(task, []):
            if bucket.task == task:
                bucket.finish()


def unbucket(model: torch.nn.Module) -> None:
    """Reduce each replicated gradient alone, in its hook, as it arrives (no buckets): for FSDP2, which
    reduce-scatters a layer's gradients right after the layer's backward, before a bucket's end-of-backward
    callback would have completed them."""
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, ReplicatedGradSync):
                hook.bucketed = False


def sequence_bucketed(model: torch.nn.Module) -> set[int]:
    """ids of the parameters whose gradients :mod:`shardlib.parallel.gradsync` buckets (over a sequence-parallel
    group)."""
    ids = set()
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, ReplicatedGradSync):
                bucket = hook.buckets.get(module)
                ids |= {id(r()) for r in (bucket.params if bucket is not None else ()) if r() is not None}
    return ids


def late_gradients(model: torch.nn.Module, split) -> set[int]:
    """ids of the parameters whose gradient is complete only after backward: those a sequence-parallel bucket
    completes (:func:`sequence_bucketed`) and, under a pipeline, weights tied across stages (summed over their
    stages after the schedule)."""
    late = sequence_bucketed(model)
    if split is not None:
        late |= {id(model.get_parameter(name)) for name, _, _, ranks in split.tied if split.pp_rank in ranks}
    return late
