"""Communication hidden behind computation (Megatron's async tensor-parallel all-reduce, and the forward
all-reduce of a row-parallel linear overlapped with its own GEMM in row blocks).

A column-parallel linear that enters the TP region itself (``copy_input=True``: BERT's and ViT's first MLP linear,
the vocab head) is one autograd Function, :func:`column_linear`, instead of ``copy_to_tp`` followed by
``F.linear``. Its backward computes the input gradient ``dx = g W`` first, starts its all-reduce over the TP group
without waiting (``async_op=True``), computes the weight and bias gradients ``dW = g^T x``, ``db = sum g`` while the
all-reduce runs, and only then waits. Gloo runs the all-reduce on its own threads, which spend most of it waiting on
the loopback socket, so the GEMM hides it: on the project's 2-core machine a 3 MiB all-reduce (4.6 ms alone) next to
the weight-gradient GEMM of BERT-base's q/k/v shard (36 ms) added nothing measurable (docs/architecture.md,
"Design decisions"). The arithmetic is the same as the unfused pair's: the same GEMMs on the same operands, the same
all-reduce of the same tensor.

A row-parallel linear (attention output, second MLP linear) ends with an all-reduce of its output that the next
op waits for. :func:`row_linear` computes the GEMM in ``ROW_BLOCKS`` blocks of rows and starts each block's
all-reduce as soon as its GEMM is done, so the all-reduce of block i runs during the GEMM of block i + 1 (the
decomposition of Wang et al., "Overlap communication with dependent computation via decomposition", ASPLOS 2023).
Each output element is the same dot product (up to the GEMM library's blocking) and the same sum over ranks. Measured on BERT-base
at tp=2 on the 2-core machine: the forward collectives' wait halved (docs/architecture.md, "Design decisions").

Used in eager mode only: under ``torch.compile`` the model keeps ``copy_to_tp`` + ``F.linear`` (functional
collectives, which Inductor reorders and overlaps itself). Under autocast the operands are cast to the autocast
dtype outside the Function, as ``F.linear`` would cast them, so the GEMMs run in that dtype forward and backward.
"""

from __future__ import annotations

import contextlib

import torch

from .casting import autocast_dtype, autocast_off, cast_for_linear
from .collectives import Group, start_all_reduce


class _ColumnLinear(torch.autograd.Function):
    """forward: ``x W^T + b`` (x replicated over the group); backward: ``dx = all_reduce(g W)``, overlapped with
    ``dW = g^T x`` and ``db = sum g``."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = work = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight)  # a fresh tensor: reduced in place
            work = start_all_reduce(grad_x, ctx.group)
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_w = g2.t().mm(x2) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()  # bounded by the process group's timeout
        return grad_x, grad_w, grad_b, None


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group) -> torch.Tensor:
    """``copy_to_tp(x)`` then ``F.linear(x, weight, bias)``, with the backward all-reduce of the input gradient
    overlapped with the weight-gradient GEMM (module docstring). Eager mode, a group of more than one rank."""
    dtype = autocast_dtype(x.device.type)
    if dtype is None:
        return _ColumnLinear.apply(x, weight, bias, group)
    with autocast_off(x.device.type):  # the operands cast as F.linear would, autograd records it
        return _ColumnLinear.apply(cast_for_linear(x, dtype), cast_for_linear(weight, dtype),
                                   cast_for_linear(bias, dtype), group)


class _RowLinear(torch.autograd.Function):
    """forward: ``y = all_reduce(x_r W_r^T)`` computed in row blocks, each block's all-reduce started while the next
    block's GEMM runs; backward: ``dx = g W_r``, ``dW_r = g^T x_r`` (no communication: the all-reduce's backward
    is the identity)."""

    @staticmethod
    def forward(ctx, x, weight, group, blocks):
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        out = x2.new_empty((x2.shape[0], weight.shape[0]))
        works, rows = [], x2.shape[0]
        bounds = [rows * i // blocks for i in range(blocks + 1)]
        for start, stop in zip(bounds, bounds[1:]):
            if stop > start:
                block = out[start:stop]  # contiguous rows: reduced in place
                torch.mm(x2[start:stop], weight.t(), out=block)
                works.append(start_all_reduce(block, group))
        for work in works:
            work.wait()  # bounded by the process group's timeout
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = g2.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


#: Row blocks of :func:`row_linear`'s forward: the second block's GEMM hides the first block's all-reduce (the last
#: one waits for no GEMM; more blocks hide more of it but make smaller GEMMs and pay gloo's per-message cost more)
ROW_BLOCKS = 2
#: An output smaller than this per block is reduced in one piece: a message's fixed cost beats the overlap (BERT-base
#: at 8 x 128 tokens: 1.5 MiB per block, split)
MIN_BLOCK_BYTES = 2**20


def row_linear(x: torch.Tensor, weight: torch.Tensor, group: Group) -> torch.Tensor:
    """``reduce_from_tp(F.linear(x, weight))`` with the all-reduce of each row block overlapped with the GEMM of
    the next (module docstring). Eager mode, a group of more than one rank."""
    dtype = autocast_dtype(x.device.type)
    if dtype is not None:
        x, weight = cast_for_linear(x, dtype), cast_for_linear(weight, dtype)
    out_bytes = x.numel() // x.shape[-1] * weight.shape[0] * x.element_size()
    blocks = ROW_BLOCKS if out_bytes >= ROW_BLOCKS * MIN_BLOCK_BYTES else 1
    # cast, the operands run as F.linear would run them (autograd recorded the casts)
    with autocast_off(x.device.type) if dtype is not None else contextlib.nullcontext():
        return _RowLinear.apply(x, weight, group, blocks)
