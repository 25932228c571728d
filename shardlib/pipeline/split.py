"""Running the pipeline stages of one model on this rank (the stages come from :mod:`.stages`).

Running a stage re-uses the HF forward unchanged. A stage is the whole model's forward with three things in place:
its layer lists hold only the stage's layers (the ModuleLists keep their original keys, so parameter names do not
change); a stage that starts inside a stack replaces the stack's embeddings by a stand-in and injects the received
tensors (hidden state, T5's position bias: ``Stack.carry``) into its first layer's arguments; a stage that ends
before the last layer stops the forward at its last layer (or at the stack's end) and returns what crosses the cut.
So masks, heads, losses (and the vocab-parallel loss wrapper) are HF's own code on every stage; a stage after
T5's encoder gets the encoder output as ``encoder_outputs`` and sends it on, so its gradient flows back from every
decoder stage to the encoder. Batch tensors (masks, labels, token types) are given to every stage as keyword
arguments: they are not sent between stages.

Parameters used by several stages (tied embeddings and LM heads) are held by each of them; their gradients are
summed over the pipeline group after backward (:meth:`PipelineSplit.sync_tied_grads`), so they stay identical.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..parallel.collectives import all_reduce_flat
from ..parallel.random import preserved_rng
from ..sharding.plan import PlanError, Stack
from .stages import StagePlan, _exists, tensor_owners


@functools.cache
def _stack_output_class():
    from transformers.modeling_outputs import BaseModelOutput

    class StackOutput(BaseModelOutput):
        """A stack's output handed to a later stage (``Stack.output_arg``): its last hidden state; every other
        field the model may read of it (Switch Transformers' ``router_logits``, which no later stage has) is None."""

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)
            return None

    return StackOutput


class StageExit(Exception):
    """Raised by a hook at a stage's last module to stop the HF forward there; carries the boundary tensors."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        super().__init__("pipeline stage boundary")
        self.tensors = tensors


class _Received(nn.Module):
    """Stands in for embeddings a stage does not own: returns the received hidden state. Other attribute reads
    (ViT reads its patch projection's dtype) go to the module it replaces."""

    def __init__(self, hidden: torch.Tensor, replaced: nn.Module):
        super().__init__()
        object.__setattr__(self, "hidden", hidden)
        object.__setattr__(self, "replaced", replaced)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "replaced"), name)

    def forward(self, *args, **kwargs):
        return self.hidden


def _pick(value, index: int, layer: str = "the layer"):
    if isinstance(value, torch.Tensor):
        if index:
            raise PlanError(f"a pipeline carry (Stack.carry) asks for output {index} of {layer}, which returns one "
                            "tensor")
        return value
    return value[index]


@dataclass(frozen=True)
class _Route:
    """Where stage ``index`` starts and ends in the trunk, and what it receives and sends."""

    index: int
    first: tuple[int, int]  # (stack, position in stack) of its first layer
    last: tuple[int, int]
    receives_outputs: tuple[int, ...]  # stacks whose output arrives first in the received tuple (output_arg)
    receives_carry: bool  # then the carry of stack first[0] (the stage starts inside it)
    sends_outputs: tuple[int, ...]
    sends_carry: bool
    is_last: bool


class PipelineSplit:
    """The stages of one pipelined model on this rank. Built by :func:`shardlib.shard` when ``mesh.pp > 1``."""

    def __init__(self, model: nn.Module, trunk: tuple[Stack, ...], plan: StagePlan, mesh, stages_per_rank: int = 1):
        self.model, self.trunk, self.plan = model, trunk, plan
        self.pp, self.pp_rank, self.group = mesh.pp, mesh.local_rank("pp"), mesh.group("pp")
        self.num_stages = len(plan.layers)
        if self.num_stages != self.pp * stages_per_rank:
            raise PlanError(f"{self.num_stages} stages planned for pp({self.pp}) x stages_per_rank({stages_per_rank})")
        # stage s runs on pp rank s % pp ("loop" placement, what the interleaved schedules expect)
        self.local_stages = [self.pp_rank + i * self.pp for i in range(stages_per_rank)]
        self.active: int | None = None
        num_stages = self.num_stages
        stack_sizes = [len(model.get_submodule(s.layers)._modules) for s in trunk]
        position = {}
        for k, stack in enumerate(trunk):
            for pos, key in enumerate(model.get_submodule(stack.layers)._modules):
                position[f"{stack.layers}.{key}"] = (k, pos)
        self.routes = []
        for s, layers in enumerate(plan.layers):
            first, last = position[layers[0]], position[layers[-1]]
            is_last = s == num_stages - 1
            ends_stack = last[1] == stack_sizes[last[0]] - 1
            self.routes.append(_Route(
                index=s, first=first, last=last, is_last=is_last,
                receives_outputs=tuple(k for k in range(first[0]) if trunk[k].output_arg),
                receives_carry=first[1] > 0,
                sends_outputs=() if is_last else tuple(
                    k for k in range(last[0] + (1 if ends_stack else 0)) if trunk[k].output_arg),
                sends_carry=not is_last and not ends_stack,
            ))
        self.layers: dict[str, dict[str, nn.Module]] = {}  # local layers by stack path, original keys
        self.stage_modules = [StageModule(self, s) for s in self.local_stages]
        self.sequence = None  # shardlib.sharding.sequence.SequenceParallel, when the model is also sequence-parallel
        self.owners = self._owners()
        self._release_unused()
        self.tied = self._tied_parameters()

    # -- ownership (by name: tensor objects change when meta tensors are materialized) -------------------
    def _owners(self) -> dict[str, set[int]]:
        return tensor_owners(self.model, self.plan)

    def stages_of(self) -> dict[int, set[int]]:
        """id(parameter or buffer) -> the stages that use it under any of its names."""
        result: dict[int, set[int]] = {}
        for name, t in [*self.model.named_parameters(remove_duplicate=False),
                        *self.model.named_buffers(remove_duplicate=False)]:
            result.setdefault(id(t), set()).update(self.owners.get(name, ()))
        return result

    def writer(self, names) -> bool:
        """Whether this rank's pipeline stage saves the tensor known by ``names``: the lowest pp rank using it."""
        stages = set().union(*(self.owners.get(n, set()) for n in names))
        return min((s % self.pp for s in stages), default=0) == self.pp_rank

    def _tied_parameters(self) -> list[tuple[str, torch.Size, torch.dtype, set[int]]]:
        """(name, shape, dtype, pp ranks) of parameters used on more than one pipeline rank, sorted by name."""
        stages = self.stages_of()
        tied = []
        for name, p in self.model.named_parameters():
            ranks = {s % self.pp for s in stages.get(id(p), ())}
            if len(ranks) > 1:
                tied.append((name, p.shape, p.dtype, ranks))
        return sorted(tied)

    def _release_unused(self) -> None:
        """Drop the layers of other ranks' stages and turn their other parameters into meta tensors."""
        local = set(self.local_stages)
        for k, stack in enumerate(self.trunk):
            module_list = self.model.get_submodule(stack.layers)
            keep = {key for s in local for path in self.plan.layers[s] for key in [path.rsplit(".", 1)[1]]
                    if path.rsplit(".", 1)[0] == stack.layers}
            self.layers[stack.layers] = {key: m for key, m in module_list._modules.items() if key in keep}
            module_list._modules = dict(self.layers[stack.layers])
        stages = self.stages_of()
        replaced: dict[int, nn.Parameter] = {}
        for module in self.model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or stages.get(id(p), set()) & local or p.is_meta:
                    continue
                if id(p) not in replaced:
                    replaced[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
                module._parameters[name] = replaced[id(p)]
        self.model.register_forward_pre_hook(self._refuse_outside_stage)

    def _refuse_outside_stage(self, module, args):
        if self.active is None:
            raise RuntimeError(
                f"{type(self.model).__name__} is split into {self.num_stages} pipeline stages; run it with "
                "shardlib.Trainer (train_step / eval_step), not by calling the model")

    def local_parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages (each once), in model order."""
        stages, local = self.stages_of(), set(self.local_stages)
        return [p for p in self.model.parameters() if stages.get(id(p), set()) & local]

    @torch.no_grad()
    def sync_tied_grads(self, local_shape=None) -> None:
        """Sum the gradients of parameters used on several pipeline ranks over the pp group (flattened per dtype;
        ranks that do not hold a parameter contribute zeros). Parameters sharded over dp by FSDP2 (zero=3) sum their
        local shards (every rank of a pp group has the same dp coordinate); ``local_shape(shape)`` is the shape of
        such a shard, for the zeros of the ranks that do not hold it."""
        grads = []
        device = next((p.device for p in self.local_parameters()), torch.device("cpu"))
        for name, shape, dtype, ranks in self.tied:
            p = self.model.get_parameter(name) if self.pp_rank in ranks else None
            if p is not None and p.grad is None:
                p.grad = torch.zeros_like(p)
            if p is not None:
                grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
            else:
                grads.append(torch.zeros(local_shape(shape) if local_shape else shape, dtype=dtype, device=device))
        all_reduce_flat(grads, self.group)

    # -- one stage's forward ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, route: _Route, received: tuple[torch.Tensor, ...], kwargs: dict):
        """Set the model up to run exactly stage ``route.index`` on ``received``; yields the forward kwargs."""
        received = list(received)
        outputs = {k: received.pop(0) for k in route.receives_outputs}
        carry = received
        sp = self.sequence
        placeholder = carry[0] if carry else None
        if route.receives_carry and sp is not None:
            # sequence parallel: the hidden state arrives sharded along the sequence, followed by a [1, L] tensor
            # whose shape carries the true length L (shapes survive torch's metadata inference, values do not)
            length = carry.pop().shape[1]
            sp.lengths[route.first[0]] = length
            hidden = carry[0]
            placeholder = hidden.new_zeros(()).expand(hidden.shape[0], length, *hidden.shape[2:])  # HF's masks
        handles, restore = [], []
        kwargs = dict(kwargs)
        for k in route.receives_outputs:
            # what the model's own stack returns (a ModelOutput indexes like the tuple older forwards take, and has
            # the attributes newer ones read: Switch Transformers reads encoder_outputs.last_hidden_state)
            kwargs[self.trunk[k].output_arg] = _stack_output_class()(last_hidden_state=outputs[k])
        stage_layers = set(self.plan.layers[route.index])
        for k, stack in enumerate(self.trunk):
            module_list = self.model.get_submodule(stack.layers)
            restore.append(lambda ml=module_list, kept=module_list._modules: setattr(ml, "_modules", kept))
            module_list._modules = {key: m for key, m in self.layers[stack.layers].items()
                                    if f"{stack.layers}.{key}" in stage_layers}
        start, stop = self.trunk[route.first[0]], self.trunk[route.last[0]]
        if route.receives_carry:
            first_layer = next(iter(self.model.get_submodule(start.layers)._modules.values()))
            for path in start.before:
                if _exists(self.model, path):
                    parent, _, name = path.rpartition(".")
                    holder = self.model.get_submodule(parent) if parent else self.model
                    restore.append(lambda h=holder, n=name, m=holder._modules[name]: h._modules.__setitem__(n, m))
                    holder._modules[name] = _Received(placeholder, holder._modules[name])

            def inject(module, args, kw, _carry=tuple(carry), _spec=start.carry):
                args = list(args)
                for (arg_index, _), value in zip(_spec, _carry):
                    args[arg_index] = value
                return tuple(args), kw

            handles.append(first_layer.register_forward_pre_hook(inject, with_kwargs=True))
        if route.sends_outputs or route.sends_carry:
            for k in route.sends_outputs:
                if k >= route.first[0]:
                    handles.append(self.model.get_submodule(self.trunk[k].end).register_forward_hook(
                        lambda m, a, out, _k=k: outputs.__setitem__(_k, _pick(out, 0))))
            boundary_outputs = lambda: [outputs[k] for k in route.sends_outputs]  # noqa: E731
            if route.sends_carry:
                last_key, last_layer = list(self.model.get_submodule(stop.layers)._modules.items())[-1]

                def leave(module, args, kw, out, _spec=stop.carry, _path=f"{stop.layers}.{last_key}"):
                    values = [_pick(out, o, _path) if o is not None else args[i] for i, o in _spec]
                    if sp is not None:
                        values.append(values[0].new_zeros(1, sp.lengths[route.last[0]]))
                    raise StageExit(tuple(t.contiguous() for t in (*boundary_outputs(), *values)))

                handles.append(last_layer.register_forward_hook(leave, with_kwargs=True))
            else:
                def leave_stack(module, args, out):
                    raise StageExit(tuple(t.contiguous() for t in boundary_outputs()))

                handles.append(self.model.get_submodule(stop.end).register_forward_hook(leave_stack))
        self.active = route.index
        try:
            yield kwargs
        finally:
            self.active = None
            for h in handles:
                h.remove()
            for undo in reversed(restore):
                undo()


class StageModule(nn.Module):
    """What a ``PipelineStage`` runs for one stage: ``forward(*received, **batch)`` returns the boundary tensors,
    or on the last stage ``(loss,)`` when the model computed one, else its first output. With ``record_outputs``
    (the runner's eval), the last stage keeps every microbatch's full model output in ``outputs`` (detached) for
    the caller; a training step does not (it would hold every microbatch's logits until the step ends: measured
    +71 MB on the last of 4 stages of a 4-microbatch BERT step, docs/planning.md).

    ``forward_step(model, batch)``, when set, runs instead of ``model(**batch)`` on every stage: it must call the
    model with every entry of ``batch`` (a later stage's batch carries what crossed the cut, T5's
    ``encoder_outputs`` say; the call stops at the stage's cut on earlier stages) and returns the loss, or a dict
    with ``"loss"``, from the model's output."""

    def __init__(self, split: PipelineSplit, index: int):
        super().__init__()
        object.__setattr__(self, "split", split)  # not a submodule: parameters() must not walk the whole model
        self.index = index
        self.route = split.routes[index]
        self.static_kwargs: dict = {}
        self.input_name: str | None = None  # the first stage gets this batch entry as its positional input
        self.autocast_dtype: torch.dtype | None = None
        self.forward_step = None
        self.outputs: list = []
        self.record_outputs = False
        # torch's schedules run one extra forward of the first microbatch when they meet a new input signature, to
        # infer the boundary shapes; the runner marks it so that it draws no dropout mask (a resumed run, whose
        # first step is such a step, then draws the masks the uninterrupted run drew)
        self.shape_inference_pending = False
        self.rng_tracker = None
        # ``after_cut(model, boundary_tensors) -> boundary_tensors``: what the model's own forward hooks would have
        # done after its forward, which the cut (an exception raised in a hook) skipped (FSDP2's root post-forward)
        self.after_cut = None

    def forward(self, *received, **batch):
        split = self.split
        # a received activation is a leaf that requires grad, which autocast would cache as it caches weights: one
        # half-precision copy shared by all its consumers, whose gradients then sum in half precision (the unsplit
        # model sums them in the activation's dtype); a view of it is not a leaf
        received = tuple(t.view_as(t) if torch.is_tensor(t) and t.is_leaf and t.requires_grad else t
                         for t in received)
        if self.input_name is not None:
            batch[self.input_name], received = received[0], ()
        autocast = (torch.autocast(device_type=_device_type(received, batch), dtype=self.autocast_dtype)
                    if self.autocast_dtype is not None else contextlib.nullcontext())
        saving = split.sequence.saving_shards() if split.sequence is not None else contextlib.nullcontext()
        neutral = contextlib.nullcontext()
        if self.shape_inference_pending:
            self.shape_inference_pending = False
            neutral = preserved_rng(self.rng_tracker)
        with split.running(self.route, received, {**batch, **self.static_kwargs}) as kwargs, autocast, saving, \
                neutral:
            try:
                out = split.model(**kwargs) if self.forward_step is None else self.forward_step(split.model, kwargs)
            except StageExit as stop:
                return stop.tensors if self.after_cut is None else self.after_cut(split.model, stop.tensors)
        if not self.route.is_last:
            raise RuntimeError(f"pipeline stage {self.index} ran to the end of the model without reaching its cut")
        if torch.is_tensor(out):
            out = {"loss": out}
        if self.record_outputs:
            self.outputs.append({k: v.detach() if torch.is_tensor(v) else v for k, v in out.items()})
        loss = out.get("loss")
        return (loss,) if loss is not None else (out[next(iter(out.keys()))],)


def _device_type(received, batch) -> str:
    for t in (*received, *batch.values()):
        if torch.is_tensor(t):
            return t.device.type
    return "cpu"
