"""Megatron-style sequence parallelism on the tensor-parallel group (``shard(..., sequence_parallel=True)``).

Between the tensor-parallel regions of a layer stack, activations are sharded along the sequence (dim 1): each
TP rank holds ``ceil(L / tp)`` positions, so LayerNorms, dropout and residual adds run on 1/tp of the tokens. The
regions change their entry and exit collectives:

=====================================  ==========================================  ==================================
where                                  tensor parallel only                        with sequence parallelism
=====================================  ==========================================  ==================================
first layer of a stack (input)         (replicated)                                keep this rank's chunk (scatter)
entering attention / MLP (CopyInputs,  ``copy_to_tp``: fwd identity, bwd            ``all_gather_from_tp``: fwd all-
column-parallel ``copy_input``)        all-reduce                                  gather, bwd reduce-scatter
leaving them (row-parallel)            ``reduce_from_tp``: fwd all-reduce          ``reduce_scatter_to_tp``: fwd
                                                                                   reduce-scatter, bwd all-gather
last layer of a stack (output)         (replicated)                                all-gather (bwd: keep own chunk)
=====================================  ==========================================  ==================================

Sequence lengths that tp does not divide are padded internally: the scatter at the stack entry and every
reduce-scatter pad the sequence with zero rows up to a multiple of tp, every all-gather strips them again before
the module sees the sequence (so attention masks and T5's position bias see the true length and the padding
never enters a result). The true length of each stack is recorded at its entry (``lengths``).

Dropout on sequence-sharded activations must draw different masks per rank: the policies list those dropout
modules (``Plan.sequence_dropout``) and they run on the per-rank RNG stream. Replicated parameters inside the
layers (LayerNorm weights, row-parallel biases) now see only this rank's tokens, so their gradients are partial
sums: they are all-reduced over the TP group in one bucket per layer, started as soon as the layer's last one is
ready, while backward goes on (:mod:`shardlib.parallel.gradsync`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..parallel.collectives import (
    Group, all_gather, all_gather_from_tp, gather_from_tp, reduce_scatter_to_tp, scatter_to_tp,
)
from ..parallel.gradsync import ReplicatedGradSync
from ..parallel.styles import class_path

SEQ_DIM = 1
#: set on a key/value cache object that a sequence-split forward filled
SPLIT_CACHE = "_shardlib_split_sequence"


@dataclass
class SequenceParallel:
    """The sequence-parallel state of one sharded model: the group that shares each sequence (TP for Megatron, sp
    for all-to-all) and the true length of each stack's sequence in the current forward (recorded at the stack's
    entry, read by every all-gather / all-to-all inside it)."""

    group: Group
    size: int  # ranks sharing one sequence
    lengths: dict[int, int] = field(default_factory=dict)
    _gathered: dict = field(default_factory=dict)  # storage address of a gathered sequence -> _Regather
    #: pipeline stages hold the saving_shards context for their whole forward (a stage may stop mid-stack)
    saving_managed_outside: bool = False
    #: while ``generate()`` runs (sp-dimension modes): stacks that get a key/value cache run unsplit
    decoding: bool = False
    #: stack -> whether its current forward runs unsplit (every rank the whole sequence, no communication)
    unsplit: dict[int, bool] = field(default_factory=dict)
    #: which positions each rank holds (ring attention's zigzag, :class:`shardlib.kernels.ring_blocks.RingLayout`);
    #: None: rank r holds the r-th contiguous chunk
    layout: object = None

    def stream(self, stack: int) -> "SequenceStream":
        return SequenceStream(self, stack)

    def saving_shards(self):
        """While active (a stack's forward), a gathered sequence that a layer saves for backward (the input of q,
        k, v and of the first MLP linear) is saved as this rank's shard and all-gathered again when backward needs
        it, as Megatron does: saved activations stay 1/tp of the sequence (likewise all-to-all attention's output,
        exchanged again from the attention's own saved output). Hooks already active (activation
        offloading, a memory counter) still see every saved tensor: they get the shard instead of the full one."""
        outer = _active_saved_tensor_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t):
            # matched by storage: the layer may save a view of the gathered tensor (linear saves a 2-D view)
            regather = self._gathered.get(_storage_key(t))
            # detached: a pack hook that returns a node's own output keeps the node alive through that output (a
            # reference cycle through C++ that gc cannot see), leaking the graph of a forward never backpropagated
            stored = regather.shard if regather is not None else t.detach()
            view = (tuple(t.shape), t.stride(), t.storage_offset()) if regather is not None else None
            return regather, view, outer_pack(stored) if outer_pack is not None else stored

        def unpack(packed):
            regather, view, stored = packed
            stored = outer_unpack(stored) if outer_unpack is not None else stored
            return regather.materialize(stored).as_strided(*view) if regather is not None else stored

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def recomputable(self, full: torch.Tensor, source: torch.Tensor, recompute) -> None:
        """Remember that ``full`` (fresh, contiguous) is ``recompute(source)`` (a collective over this group), until
        ``full`` is collected (its address cannot be reused before): a layer that saves ``full`` for backward then
        keeps ``source`` instead (see :meth:`saving_shards`). Eager mode only: compiled code has no storages to
        match (its partitioner decides what backward keeps), so there nothing is recorded."""
        if torch.compiler.is_compiling():
            return
        key = _storage_key(full)
        self._gathered[key] = _Regather(source.detach(), recompute)
        weakref.finalize(full, self._gathered.pop, key, None)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with zero rows appended along the sequence up to a multiple of the group size (the layout's padded
        length where it has one)."""
        length = x.shape[SEQ_DIM]
        extra = (self.layout.padded(length) - length) if self.layout is not None else -length % self.size
        if not extra:
            return x
        pad = [0, 0] * (x.dim() - SEQ_DIM - 1) + [0, extra]
        return F.pad(x, pad)


@dataclass
class SequenceStream:
    """The sequence of stack ``stack`` (T5's encoder and decoder have different lengths)."""

    sp: SequenceParallel
    stack: int

    @property
    def length(self) -> int:
        return self.sp.lengths[self.stack]

    @property
    def unsplit(self) -> bool:
        """Whether the stack's current forward runs on the whole sequence on every rank: incremental decoding,
        whose key/value cache must hold the whole sequence's keys (parameters are replicated over the group)."""
        return self.sp.unsplit.get(self.stack, False)

    def runs_unsplit(self, kwargs: dict) -> bool:
        """Decide (at the stack's first layer) whether this forward runs unsplit: any key/value cache while
        ``generate()`` runs (it will be reused). A cache that a split forward filled holds each rank's chunk only:
        reusing it is refused."""
        cache = kwargs.get("past_key_values")
        unsplit = cache is not None and self.sp.decoding
        if cache is not None and not unsplit:
            if cache.__dict__.get(SPLIT_CACHE) and cache.get_seq_length() > 0:
                raise RuntimeError(f"sequence parallelism over sp: this key/value cache was filled by a forward that "
                                   f"split the sequence ({cache.get_seq_length()} tokens, each rank holding its chunk "
                                   "only) and cannot be reused; decode with generate(), whose decoding steps run "
                                   "unsplit")
            cache.__dict__[SPLIT_CACHE] = True
        self.sp.unsplit[self.stack] = unsplit
        return unsplit

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Replicated [b, L, ...] -> this rank's [b, ceil(L / tp), ...] (padded; in the layout's order where it
        has one). fwd split, bwd all-gather."""
        self.sp.lengths[self.stack] = x.shape[SEQ_DIM]
        return self.chunk(x)

    def chunk(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a replicated per-position tensor [b, L, ...] of this stack, padded as the
        sequence is: the stack entry's cut, also for tensors that enter the stack beside the hidden states
        (rotary position embeddings). fwd split, bwd all-gather."""
        x = self.sp.pad(x)
        if self.sp.layout is not None:
            x = x.index_select(SEQ_DIM, self.sp.layout.order(self.length, x.device))
        return scatter_to_tp(x, self.sp.group, SEQ_DIM)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk -> replicated [b, L, ...]. fwd all-gather, bwd keep this rank's chunk."""
        x = gather_from_tp(x, self.sp.group, SEQ_DIM)
        if self.sp.layout is not None:
            x = x.index_select(SEQ_DIM, self.sp.layout.inverse(self.length, x.device))
        return x.narrow(SEQ_DIM, 0, self.length)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Enter a tensor-parallel region. fwd all-gather (padding stripped), bwd reduce-scatter. If a layer saves
        the result for backward, only ``x`` is kept (see :meth:`SequenceParallel.saving_shards`)."""
        full = all_gather_from_tp(x, self.sp.group, SEQ_DIM)
        if full.shape[SEQ_DIM] != self.length:
            full = full.narrow(SEQ_DIM, 0, self.length).contiguous()
        group, length = self.sp.group, self.length
        self.sp.recomputable(full, x, lambda shard: all_gather(shard, SEQ_DIM, group).narrow(SEQ_DIM, 0, length))
        return full

    def reduce_scatter(self, y: torch.Tensor) -> torch.Tensor:
        """Leave a tensor-parallel region with partial sums. fwd reduce-scatter (padded), bwd all-gather."""
        return reduce_scatter_to_tp(self.sp.pad(y), self.sp.group, SEQ_DIM)


def _storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, shared by its views: the storage object's address, which unlike its data
    pointer also tells meta tensors apart (all of theirs are 0), so a dry run on meta records what a real run does."""
    return t.untyped_storage()._cdata


class _Regather:
    """A saved tensor kept as the smaller ``shard`` it was computed from by a collective (the all-gathered sequence
    entering q, k and v; all-to-all attention's exchanged output), recomputed once for all the layers that saved it
    when backward unpacks it."""

    def __init__(self, shard: torch.Tensor, recompute):
        self.shard, self.recompute, self.full = shard, recompute, None

    def materialize(self, shard: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.full = self.recompute(shard).contiguous()
        return self.full


def _active_saved_tensor_hooks():
    """The (pack, unpack) pair currently active, if any (torch has no public getter)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def rehook_replicated_grads(model: torch.nn.Module) -> None:
    """Attach the sequence-parallel gradient hooks to the parameters that replaced hooked ones (``materialize``),
    now rather than at the next eager forward: a model compiled right away would otherwise run without them."""
    for module in model.modules():
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, ReplicatedGradSync):
                hook(module)


# ------------------------------------------------------------------------------------------------ the shard pass
MEGATRON, ALL_TO_ALL, RING = "megatron", "all_to_all", "ring"
#: the modes on the mesh's own sp dimension
SP_MODES = (ALL_TO_ALL, RING)


def sequence_mode(value, problems: list[str]) -> str | None:
    """``shard(sequence_parallel=...)`` as None / MEGATRON / ALL_TO_ALL / RING (an unknown value is a problem)."""
    if value is False or value is None:
        return None
    if value is True or value == MEGATRON:
        return MEGATRON
    if value in SP_MODES:
        return value
    problems.append(f"sequence_parallel={value!r}: expected False, True (Megatron, on the TP group), "
                    f"'{ALL_TO_ALL}' (Ulysses) or '{RING}' (ring attention), both on the mesh's sp dimension")
    return None


def sequence_parallel_problems(r) -> list[str]:
    """What stops either kind of sequence parallelism on ``r`` (a :class:`shardlib.sharding.passes.Resolved`)."""
    problems = [] if r.plan.trunk else ["sequence_parallel needs the policy's layer trunk (Plan.trunk)"]
    for pattern in r.plan.sequence_dropout:
        problems += [f"{p}: sequence_dropout applies to torch.nn.Dropout, found {class_path(type(r.modules[p]))}"
                     for p in r.match(pattern, "sequence_dropout") if not isinstance(r.modules[p], torch.nn.Dropout)]
    return problems


class MegatronSequenceParallel:
    """The pass of ``sequence_parallel=True``: norms, dropout and residuals on 1/tp of the sequence (module
    docstring). ``prepare`` runs before the styles, which route their collectives through ``r.sequence``."""

    def problems(self, r) -> list[str]:
        return sequence_parallel_problems(r)

    def prepare(self, r) -> None:
        if r.tp > 1:
            r.sequence = SequenceParallel(r.group, r.tp)
        else:
            r.report.notes.append("sequence_parallel=True does nothing at tp=1 (Megatron sequence parallelism splits "
                                  "the sequence over the tensor-parallel group): the model runs unchanged")

    def install(self, r) -> None:
        if r.sequence is not None:
            install_sequence_parallel(r, r.sequence)


def install_sequence_parallel(r, sp: SequenceParallel, *, sp_dimension: bool = False) -> None:
    """Scatter the sequence at each stack's first layer and gather it after the last; per-rank dropout streams on
    sequence-sharded activations; one all-reduce over the sequence group of the gradient of every parameter in the
    layers that the group replicates (Megatron: the TP-replicated ones; on the sp dimension, all-to-all or ring:
    all)."""
    from ..parallel.styles import LocalRNG

    model, stream = r.model, "sequence-parallel" if sp_dimension else "tensor-parallel"
    for pattern in r.plan.sequence_dropout:
        for path in r.match(pattern):
            LocalRNG(stream=stream).apply(path, model.get_submodule(path), r.shard_context(""))
    grad_sync = ReplicatedGradSync(sp.group, tp_sharded_too=sp_dimension)
    for k, stack in enumerate(r.plan.trunk):
        layers = list(model.get_submodule(stack.layers)._modules.values())
        if not layers:
            continue
        owner = stack.layers.rpartition(".")[0]
        _hook_stack(sp, k, layers, model.get_submodule(owner) if owner else model, sp_dimension)
        for layer in layers:
            grad_sync(layer)
            layer.register_forward_pre_hook(grad_sync)
    if sp_dimension and callable(getattr(model, "generate", None)):
        model.generate = _decoding(model.generate, sp)


def _decoding(generate, sp: SequenceParallel):
    """``generate`` with ``sp.decoding`` set while it runs: the stacks that fill a key/value cache run unsplit
    (the encoder of a seq2seq model still runs split)."""

    def generate_unsplit(*args, **kwargs):
        sp.decoding = True
        try:
            return generate(*args, **kwargs)
        finally:
            sp.decoding = False

    return generate_unsplit


def _hook_stack(sp: SequenceParallel, k: int, layers: list, owner: torch.nn.Module, sp_dimension: bool) -> None:
    """Stack ``k``: scatter before its first layer, gather after its last; in eager mode saved activations are kept
    as shards (:meth:`SequenceParallel.saving_shards`) from the first layer until the stack's owner returns or
    raises, whichever layer raised. On the sp dimension a decoding step may run unsplit
    (:meth:`SequenceStream.runs_unsplit`); Megatron's attention sees the whole sequence, so its caches are whole."""
    seq, saving = sp.stream(k), []

    def enter(mod, args, kwargs):
        if sp_dimension and seq.runs_unsplit(kwargs):
            sp.lengths[k] = args[0].shape[SEQ_DIM]
            return None
        if not sp.saving_managed_outside and not torch.compiler.is_compiling():
            saving.append(sp.saving_shards())
            saving[-1].__enter__()
        return (seq.enter(args[0]), *args[1:]), kwargs

    def leave(mod, args, out):
        if saving:
            saving.pop().__exit__(None, None, None)
        if out is None or seq.unsplit:  # the layer raised (an always_call hook still runs): let its error through
            return None
        return seq.leave(out) if isinstance(out, torch.Tensor) else (seq.leave(out[0]), *out[1:])

    def close(mod, args, out):
        while saving:
            saving.pop().__exit__(None, None, None)

    layers[0].register_forward_pre_hook(enter, with_kwargs=True)
    layers[-1].register_forward_hook(leave, always_call=True)
    owner.register_forward_hook(close, always_call=True)
