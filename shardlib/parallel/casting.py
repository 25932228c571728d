"""Autocast's rule for a linear, for code that computes a linear itself (a custom autograd Function runs with
autocast off): ``F.linear`` under autocast casts its floating operands other than float64 to the autocast dtype.
One rule for the column-parallel linear (:mod:`.overlap`) and the fused QKV GEMM (``shardlib.kernels.fused_qkv``),
so the two cannot drift apart."""

from __future__ import annotations

import torch

#: device types whose autocast state torch can be asked for
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs a linear in on ``device_type`` now, or None where autocast is off."""
    if device_type not in AUTOCAST_DEVICES or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_for_linear(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` as autocast hands it to a linear: floating tensors other than float64 in ``dtype``, the rest (None,
    integer, float64) unchanged."""
    return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
