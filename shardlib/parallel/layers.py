"""Tensor-parallel layers on local tensors with explicit collectives.

Each layer subclasses the torch module it replaces (``nn.Linear`` / ``nn.Embedding``), so ``isinstance`` checks in
HF code and state-dict key names keep working; ``in_features`` / ``out_features`` / ``num_embeddings`` are the
*local* sizes. Each layer records the layout of its parameters (``shardlib.parallel.layout``) where they are sharded.

Shapes below: ``n`` = TP group size, ``r`` = this rank, ``*`` = any leading dims.

* :class:`ColumnParallelLinear`: ``W`` [out, in] split along out -> ``W_r`` [out/n, in]. ``y_r = x W_r^T + b_r``;
  optionally all-gathers ``y`` [*, out]. Output dims that ``n`` does not divide are zero-padded (vocab heads).
  ``blocks``: a fused projection (q, k, v side by side) split in each block (:class:`~.layout.Layout`).
  Both linears also take transformers' ``Conv1D`` (GPT-2; weight ``[in, out]``), whose weight keeps its shape.
* :class:`RowParallelLinear`: ``W`` split along in -> ``W_r`` [out, in/n]. ``y = sum_r x_r W_r^T + b`` (one
  all-reduce), bias replicated and added once after the reduction.
* :class:`VocabParallelEmbedding`: table [V, H] split along V (padded) -> rows ``[r V/n, (r+1) V/n)``. Ids outside
  the range look up zeros, then one all-reduce sums the rows.
* :class:`ColumnParallelEmbedding`: table [V, D] split along D -> this rank's D/n columns, no communication.
* :func:`vocab_parallel_cross_entropy`: cross-entropy on vocab-sharded logits without gathering them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import Group, all_reduce, copy_to_tp, gather_from_tp, group_rank, group_size, reduce_from_tp
from .layout import Layout, set_layout
from .overlap import column_linear, row_linear

#: ``nn.Embedding`` options the sharded embeddings cannot honour: ``max_norm`` renormalizes the rows it looks up, in
#: place (a vocab shard looks up its row 0 for every id of another shard; a column shard holds part of each row, so
#: no rank sees a row's norm); ``scale_grad_by_freq`` would count those stand-in lookups of row 0 too; ``sparse``
#: gives sparse gradients, which the flat gradient reductions do not take.
UNSUPPORTED_EMBEDDING_OPTIONS = ("max_norm", "scale_grad_by_freq", "sparse")


def unsupported_embedding_options(embedding: nn.Embedding) -> list[str]:
    """The options of ``embedding`` that a sharded embedding cannot honour, as ``name=value`` (those set)."""
    return [f"{attr}={getattr(embedding, attr)!r}" for attr in UNSUPPORTED_EMBEDDING_OPTIONS
            if getattr(embedding, attr)]


def _refuse_unsupported_options(cls: type, embedding: nn.Embedding) -> None:
    """The layers' own guard (for direct use; ``shard()`` finds these before any change, in the styles' checks)."""
    found = unsupported_embedding_options(embedding)
    if found:
        raise ValueError(f"{cls.__name__} does not support {', '.join(found)}")


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2's linear with a transposed ``[in, out]`` weight: ``nx``
    inputs, ``nf`` outputs), recognized by its attributes so that this layer imports no transformers."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def _linear_weight(layer: nn.Module) -> torch.Tensor:
    """The layer's weight as ``F.linear`` takes it (``[out, in]``): a transposed view of a Conv1D's ``[in, out]``
    parameter, which keeps its checkpoint shape."""
    return layer.weight.t() if layer.transposed else layer.weight


def _local_param(layout: Layout, param: nn.Parameter, rank: int) -> nn.Parameter:
    """This rank's piece of ``param`` as a new Parameter; unsplit (one shard) the very same Parameter: a world of one
    copies nothing and keeps the objects an optimizer or a tie already holds."""
    if layout.num_shards == 1:
        return param
    return nn.Parameter(layout.shard(param.detach(), rank), requires_grad=param.requires_grad)


class _TPModule:
    """Shared by the parallel layers: the group, and this rank's place in it.

    ``tp_size`` / ``tp_rank`` default to the group's. Passing them with ``group=None`` shards *offline* (plans,
    meta-device inspection, checkpoint conversion): such a module has the right local shapes but refuses to run.
    """

    def _init_tp(self, group: Group | None, tp_size: int | None, tp_rank: int | None) -> tuple[int, int]:
        self.group = group
        self.tp_size = group_size(group) if tp_size is None else tp_size
        self.tp_rank = group_rank(group) if tp_rank is None else tp_rank
        return self.tp_size, self.tp_rank

    def _check_runnable(self) -> None:
        if self.group is None and self.tp_size > 1:
            raise RuntimeError(f"{type(self).__name__} was sharded {self.tp_size}-way without a process group; "
                               "it can be inspected and loaded but not run")


class ColumnParallelLinear(_TPModule, nn.Linear):
    """Linear with its output features split over the TP group (see module docstring for the math).

    ``copy_input``: enter the TP region here (forward identity, backward all-reduce of the input gradient). Turn it
    off when an enclosing module already copied the input once for several column linears (q, k, v).
    ``gather_output``: all-gather the output features (padding stripped), else return this rank's slice.
    ``epilogue``: optional callable ``(y, bias) -> y`` applied to ``F.linear(x, W_r)`` instead of adding the bias
    (e.g. ``shardlib.kernels.epilogues.BiasGELU``), before any gather; copied from the sharded linear's own
    ``epilogue`` attribute if it has one. None: the plain ``x W_r^T + b_r``.
    """

    def __init__(self, linear: nn.Linear, group: Group | None, *, copy_input=True, gather_output=False, pad=False,
                 blocks: int = 1, tp_size: int | None = None, tp_rank: int | None = None, sequence=None):
        nn.Module.__init__(self)
        n, r = self._init_tp(group, tp_size, tp_rank)
        self.transposed = is_conv1d(linear)
        out_dim = 1 if self.transposed else 0
        out_features = linear.weight.shape[out_dim]
        if out_features % (n * blocks) and (blocks > 1 or not pad):
            raise ValueError(f"out_features {out_features} is not divisible by tp={n}"
                             + (f" in each of {blocks} blocks" if blocks > 1 else ""))
        if blocks > 1 and gather_output:
            raise ValueError("a blocked (fused) projection keeps its output sharded: gather_output is not supported")
        self.copy_input, self.gather_output = copy_input, gather_output
        self.sequence = sequence  # shardlib.sharding.sequence.SequenceStream: the input arrives sequence-sharded
        self.epilogue = getattr(linear, "epilogue", None)  # (y, bias) -> y instead of y + bias
        self.global_out_features = out_features
        w_layout = Layout(tuple(linear.weight.shape), shard_dim=out_dim, num_shards=n, blocks=blocks)
        self.weight = _local_param(w_layout, linear.weight, r)
        set_layout(self, "weight", w_layout)
        if linear.bias is not None:
            b_layout = Layout(tuple(linear.bias.shape), shard_dim=0, num_shards=n, blocks=blocks)
            self.bias = _local_param(b_layout, linear.bias, r)
            set_layout(self, "bias", b_layout)
        else:
            self.register_parameter("bias", None)
        self.out_features, self.in_features = _linear_weight(self).shape
        if blocks == 1:
            self.vocab_start, vocab_stop = w_layout.valid_range(r)
            self.valid_out_features = vocab_stop - self.vocab_start  # real (non-padding) output features here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 and self.epilogue is None and self.sequence is None:
            return F.linear(x, _linear_weight(self), self.bias)  # a world of one: exactly nn.Linear's forward
        self._check_runnable()
        weight = _linear_weight(self)
        if self._overlaps_copy():
            y = column_linear(x, weight, self.bias, self.group)  # backward of the copy overlapped (overlap.py)
        else:
            if self.copy_input:
                x = self.sequence.gather(x) if self.sequence is not None else copy_to_tp(x, self.group)
            if self.epilogue is None:
                y = F.linear(x, weight, self.bias)
            else:
                y = self.epilogue(F.linear(x, weight), self.bias)
        if self.gather_output:
            y = gather_from_tp(y, self.group, -1)[..., : self.global_out_features]
        return y

    def _overlaps_copy(self) -> bool:
        """Whether this forward enters the TP region with :func:`shardlib.parallel.overlap.column_linear` (eager, a
        replicated
        input copied here, no epilogue)."""
        return (self.copy_input and self.sequence is None and self.epilogue is None and self.tp_size > 1
                and not torch.compiler.is_compiling())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (global {self.global_out_features}), "
            f"bias={self.bias is not None}, copy_input={self.copy_input}, gather_output={self.gather_output}"
        )


class RowParallelLinear(_TPModule, nn.Linear):
    """Linear with its input features split over the TP group; the output is all-reduced (bias added after).

    ``reduce_output=False``: return this rank's partial sum ``x_r W_r^T`` alone, neither reduced nor biased: the
    caller adds more partial sums (a LoRA adapter's) and then reduces once and adds ``bias`` itself."""

    def __init__(self, linear: nn.Linear, group: Group | None, *, tp_size: int | None = None,
                 tp_rank: int | None = None, sequence=None, reduce_output: bool = True):
        nn.Module.__init__(self)
        self.reduce_output = reduce_output
        n, r = self._init_tp(group, tp_size, tp_rank)
        self.transposed = is_conv1d(linear)
        in_dim = 0 if self.transposed else 1
        in_features = linear.weight.shape[in_dim]
        if in_features % n:
            raise ValueError(f"in_features {in_features} is not divisible by tp={n}")
        self.sequence = sequence  # shardlib.sharding.sequence.SequenceStream: reduce-scatter along the sequence
        w_layout = Layout(tuple(linear.weight.shape), shard_dim=in_dim, num_shards=n)
        self.weight = _local_param(w_layout, linear.weight, r)
        set_layout(self, "weight", w_layout)
        if linear.bias is not None:
            self.bias = linear.bias  # replicated, added once after the reduction
        else:
            self.register_parameter("bias", None)
        self.out_features, self.in_features = _linear_weight(self).shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 and self.reduce_output and self.sequence is None:
            return F.linear(x, _linear_weight(self), self.bias)  # a world of one: exactly nn.Linear's forward
        self._check_runnable()
        if self.reduce_output and self.sequence is None and self.tp_size > 1 and not torch.compiler.is_compiling():
            y = row_linear(x, _linear_weight(self), self.group)  # all-reduce overlapped with the GEMM (overlap.py)
            return y if self.bias is None else y + self.bias
        partial = F.linear(x, _linear_weight(self))
        if not self.reduce_output:
            return partial
        if self.sequence is not None:
            y = self.sequence.reduce_scatter(partial)
        else:
            y = reduce_from_tp(partial, self.group, inplace=True)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (global {self.in_features * self.tp_size}), " \
               f"out_features={self.out_features}, bias={self.bias is not None}"


class VocabParallelEmbedding(_TPModule, nn.Embedding):
    """Embedding table split along the vocabulary (padded to a multiple of the TP size)."""

    def __init__(self, embedding: nn.Embedding, group: Group | None, *, tp_size: int | None = None,
                 tp_rank: int | None = None):
        nn.Module.__init__(self)
        _refuse_unsupported_options(type(self), embedding)
        n, r = self._init_tp(group, tp_size, tp_rank)
        layout = Layout(tuple(embedding.weight.shape), shard_dim=0, num_shards=n)
        self.weight = _local_param(layout, embedding.weight, r)
        set_layout(self, "weight", layout)
        self.num_embeddings, self.embedding_dim = self.weight.shape
        self.global_num_embeddings = embedding.num_embeddings
        self.vocab_start, self.vocab_stop = layout.valid_range(r)
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, 2.0, False, False
        pad = embedding.padding_idx
        self.global_padding_idx = pad
        self.padding_idx = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_stop else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_runnable()
        if self.tp_size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group, inplace=True)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, vocab rows [{self.vocab_start}, {self.vocab_stop}) "
            f"of {self.global_num_embeddings}, padding_idx={self.global_padding_idx}"
        )


class ColumnParallelEmbedding(_TPModule, nn.Embedding):
    """Embedding table split along the embedding dim: rank r looks up columns ``[r D/n, (r+1) D/n)`` and returns
    them (no communication), optionally all-gathered. T5's relative attention bias table ([buckets, heads]) is
    sharded this way: each rank gets the bias of its own heads."""

    def __init__(self, embedding: nn.Embedding, group: Group | None, *, gather_output=False,
                 tp_size: int | None = None, tp_rank: int | None = None):
        nn.Module.__init__(self)
        _refuse_unsupported_options(type(self), embedding)
        n, r = self._init_tp(group, tp_size, tp_rank)
        if embedding.embedding_dim % n:
            raise ValueError(f"embedding_dim {embedding.embedding_dim} is not divisible by tp={n}")
        layout = Layout(tuple(embedding.weight.shape), shard_dim=1, num_shards=n)
        self.weight = _local_param(layout, embedding.weight, r)
        set_layout(self, "weight", layout)
        self.num_embeddings, self.embedding_dim = self.weight.shape
        self.padding_idx, self.gather_output = embedding.padding_idx, gather_output
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, 2.0, False, False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_runnable()
        out = F.embedding(ids, self.weight, self.padding_idx)
        return gather_from_tp(out, self.group, -1) if self.gather_output else out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits.

    forward: two all-reduces (max; then [target logit, sum exp] stacked), loss_i = log(sum_j e^{z_ij - m_i}) -
    (z_{i,t_i} - m_i). backward: local, dz_i = (softmax_i - onehot(t_i)) * dloss_i; no communication.
    Padding columns (``valid`` <= j < local vocab) are excluded; ``ignore_index`` targets get loss 0 and no gradient.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, valid, group, ignore_index, dtype):
        z = logits.to(dtype)
        if valid < z.shape[-1]:
            z = z.clone()
            z[:, valid:] = float("-inf")
        local_max = z.max(dim=-1).values
        global_max = all_reduce(local_max, group, "max") if group_size(group) > 1 else local_max
        z = z - global_max.unsqueeze(-1)
        in_shard = (target >= vocab_start) & (target < vocab_start + valid)
        local_t = (target - vocab_start).masked_fill(~in_shard, 0)
        target_logit = z.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~in_shard, 0.0)
        exp = z.exp_()
        sum_exp = exp.sum(dim=-1)
        if group_size(group) > 1:
            target_logit, sum_exp = all_reduce(torch.stack([target_logit, sum_exp]), group, inplace=True).unbind(0)
        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, in_shard & ~ignored, local_t, ignored)
        ctx.logits_dtype, ctx.consumed = logits.dtype, False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.consumed:
            raise RuntimeError("vocab_parallel_cross_entropy reuses its saved softmax; it cannot backward twice")
        ctx.consumed = True
        softmax, hit, local_t, ignored = ctx.saved_tensors
        grad = softmax  # reuse the saved [N, V_local] buffer instead of allocating another
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= hit.to(grad.dtype)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    valid: int,
    group: Group | None,
    ignore_index: int = -100,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-token loss (shape of ``target``) of logits [*, V_local] holding global vocab columns
    ``[vocab_start, vocab_start + valid)`` in their first ``valid`` columns. Ignored targets give 0.
    Computed in ``dtype`` (default: the logits' dtype promoted to at least float32).

    Eager on the CPU only the rows with a target are computed (an MLM batch labels ~15% of its tokens): an ignored
    row adds 0 to the loss and 0 to the gradient, and each kept row's max, exponentials and sum are the same row
    reductions as on the whole matrix, so the result is the same. Every rank of the group holds the same targets,
    hence the same rows. Elsewhere every row: traced (torch.compile / export) the shapes stay static, the meta device
    (the dry run) has no values to select by, and on a GPU selecting them (``nonzero``) would stop the host until the
    device caught up, where the passes it saves are cheap."""
    dtype = dtype or torch.promote_types(logits.dtype, torch.float32)
    flat, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    args = (vocab_start, valid, group, ignore_index, dtype)
    if torch.compiler.is_compiling() or flat.device.type != "cpu":
        return _VocabParallelCrossEntropy.apply(flat, flat_target, *args).view(target.shape)
    rows = (flat_target != ignore_index).nonzero().squeeze(1)
    if rows.numel() == flat_target.numel():
        return _VocabParallelCrossEntropy.apply(flat, flat_target, *args).view(target.shape)
    picked = _VocabParallelCrossEntropy.apply(flat.index_select(0, rows), flat_target[rows], *args)
    return picked.new_zeros(flat_target.shape).index_copy(0, rows, picked).view(target.shape)
