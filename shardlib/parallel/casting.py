"""Autocast's rule for a linear, for code that computes a linear itself (a custom autograd Function runs with
autocast off): ``F.linear`` under autocast casts its floating operands other than float64 to the autocast dtype.
One rule for the column-parallel linear (:mod:`.overlap`) and the fused QKV GEMM (``shardlib.kernels.fused_qkv``),
so the two cannot drift apart.

On the meta device torch has no autocast; the dry run emulates it (``shardlib.analysis.meta_autocast``) and says so
through :func:`meta_autocast`, so that this code casts there as it would on a real device."""

from __future__ import annotations

import contextlib
import contextvars

import torch

#: device types whose autocast state torch can be asked for
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


_META_AUTOCAST: contextvars.ContextVar = contextvars.ContextVar("shardlib_meta_autocast", default=None)


@contextlib.contextmanager
def meta_autocast(dtype: torch.dtype | None):
    """Within the block, :func:`autocast_dtype` of the meta device is ``dtype`` (the dry run's emulated autocast)."""
    token = _META_AUTOCAST.set(dtype)
    try:
        yield
    finally:
        _META_AUTOCAST.reset(token)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs a linear in on ``device_type`` now, or None where autocast is off."""
    if device_type == "meta":
        return _META_AUTOCAST.get()
    if device_type not in AUTOCAST_DEVICES or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_off(device_type: str):
    """``torch.autocast(device_type, enabled=False)``: what a linear computed by hand runs under once its operands
    are cast (with :func:`cast_for_linear`); the meta device has no autocast to turn off."""
    if device_type == "meta":
        return meta_autocast(None)
    return torch.autocast(device_type, enabled=False)


def cast_for_linear(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` as autocast hands it to a linear: floating tensors other than float64 in ``dtype``, the rest (None,
    integer, float64) unchanged."""
    return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
