"""One GEMM for ``k`` linears that read the same input (the op behind :mod:`shardlib.kernels.fused_qkv`).

Shapes: ``x`` [*, in] (``M`` = prod(*) rows); member ``i`` has ``W_i`` [n_i, in] and optional ``b_i`` [n_i] (local
shard sizes under TP); ``N = sum_i n_i``; ``W`` = [W_1; ...; W_k] [N, in], ``b`` = [b_1; ...; b_k] [N] (zeros
for members without bias).

* forward (one GEMM):  ``y = x W^T + b`` [M, N];  member ``i`` returns ``y[:, o_i : o_i + n_i]`` viewed as
  [*, n_i] (``o_i`` = sum of the earlier ``n_j``): strided (row stride N) on one shared storage, but not autograd
  views of each other (each output is its own base; in-place ops on one do not touch the others).
* backward (two GEMMs): ``g = [g_1, ..., g_k]`` [M, N] (missing member gradients are zeros);
  ``dx = g W`` [M, in] (one GEMM);  ``dW = g^T x`` [N, in] (one GEMM), handed out as row views ``dW_i =
  dW[o_i : o_i + n_i]``;  ``db_i = sum_rows g_i``.

The GEMMs run in one ``torch.autograd.Function`` rather than ``torch.cat`` + ``F.linear`` + ``split`` under
autograd: both do one GEMM forward and one each for dx and dW and measured within noise of each other (BERT-base
q/k/v fwd+bwd, 2 threads, 0.98-1.04 x stock; ``benchmarks/kernels.py``). MKL already runs the n = 384 / 768
GEMMs at the speed of the fused N = 3n one on CPU, so fusing saves little there and the copies (``W`` in forward,
``g`` in backward) can cost a few percent. The Function saves no concatenated weight for backward (7 MB per
BERT-base layer), saves ``x`` once instead of once per member (three autocast copies of it under stock bf16
autocast), and returns outputs that are not autograd views of one tensor, which the hand-off of
:mod:`shardlib.kernels.fused_qkv` needs. Gradient ``dW_i`` row views share one buffer; ``dx`` sums over all N
features in one GEMM, so it differs from the sum of three separate GEMMs in float32 rounding (the forward is bitwise
equal on MKL).
"""

from __future__ import annotations

import torch


class FusedLinear(torch.autograd.Function):
    """``k`` linears on one input as one GEMM.

    forward: ``y = x [W_1; ..; W_k]^T + [b_1; ..; b_k]``, returns the ``k`` column blocks of ``y`` [*, n_i];
    backward: ``g = [g_1, .., g_k]``, ``dx = g [W_1; ..; W_k]``, ``[dW_1; ..; dW_k] = g^T x``, ``db_i = sum g_i``.
    """

    @staticmethod
    def forward(ctx, x, count, *params):
        weights, biases = params[:count], params[count:]
        sizes = [w.shape[0] for w in weights]
        in_features = x.shape[-1]
        lead = x.shape[:-1]
        w = torch.cat(weights) if count > 1 else weights[0]
        x2 = x.reshape(-1, in_features)
        if any(b is not None for b in biases):
            b = torch.cat([bi if bi is not None else w.new_zeros(n) for bi, n in zip(biases, sizes)])
            y = torch.addmm(b, x2, w.t())
        else:
            y = torch.mm(x2, w.t())
        y = y.view(*lead, sum(sizes))
        outs, offset = [], 0
        for n in sizes:
            # detach(): a tensor on the same storage that is not an autograd view of y, so each output is its own
            # base and HF's later .view() keeps *it* (and what is attached to it) alive
            outs.append(y.narrow(-1, offset, n).detach())
            offset += n
        ctx.save_for_backward(x, *weights)
        ctx.sizes, ctx.count = sizes, count
        ctx.has_bias = [b is not None for b in biases]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        sizes, count = ctx.sizes, ctx.count
        x2 = x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        g = torch.cat([gi.reshape(rows, n) if gi is not None else x2.new_zeros(rows, n)
                       for gi, n in zip(grads, sizes)], dim=1)
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = torch.cat(weights) if count > 1 else weights[0]
            grad_x = torch.mm(g, w).view(x.shape)
        grad_w = [None] * count
        if any(ctx.needs_input_grad[2:2 + count]):
            grad_w = list(torch.mm(g.t(), x2).split(sizes, 0))
        grad_b = [None] * count
        if any(ctx.needs_input_grad[2 + count:]):
            grad_b = [s if has else None for s, has in zip(g.sum(0).split(sizes), ctx.has_bias)]
        return (grad_x, None, *grad_w, *grad_b)


__all__ = ["FusedLinear"]
