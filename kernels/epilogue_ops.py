"""The fused epilogue ops: bias + GELU after a linear, and dropout + residual add, each with the reference it must
equal.

Shapes: ``*`` = any leading dims (batch, sequence), ``H`` = the linear's (local) output features.

==========================  ====================================================  =====================================
op                          forward                                               backward
==========================  ====================================================  =====================================
``bias_gelu(y, b)``         ``z = y + b``, ``out = GELU(z)``; y [*, H], b [H]      ``dz = g * GELU'(z)``, ``dy = dz``,
                                                                                  ``db = sum over * of dz``
``dropout_add(x, r, p, t)`` ``out = r + x * m * s``; x, r [*] (same shape)         ``dx = g * m * s``, ``dr = g``
==========================  ====================================================  =====================================

GELU is exact, ``GELU(z) = z/2 (1 + erf(z / sqrt 2))`` (HF "gelu"), or its tanh approximation ``z/2 (1 + tanh(
sqrt(2/pi) (z + 0.044715 z^3)))`` as ``F.gelu(approximate="tanh")`` computes it (HF "gelu_pytorch_tanh").
HF "gelu_new" / "gelu_python" evaluate a formula op by op (one rounding per op), which no fused kernel reproduces
bit for bit, so they are refused rather than silently changed.

Dropout (training, ``0 < p < 1``): ``m ~ Bernoulli(1 - p)`` in {0, 1}, drawn exactly as ``F.dropout`` draws it
on CPU: one ``bernoulli_(1 - p)`` over a tensor laid out like ``x`` (``torch.empty_like``), which consumes the
default generator identically for every dtype (a bool mask here, 1 byte per element instead of F.dropout's
``x.dtype`` noise tensor), so the same RNG state gives the same mask and leaves the same state behind.
``s = fl(1 / (1 - p))`` in ``x.dtype``, computed by the same ``div_`` F.dropout uses for its noise; ``x * m * s``
rounds once, like F.dropout's ``x * noise``. In eval or with ``p = 0``: ``out = r + x``; ``p = 1``: the reference.
On non-CPU devices (where F.dropout uses another RNG scheme) ``dropout_add`` runs the reference.

Implementation: each op is a ``torch.autograd.Function`` with one forward and one backward kernel, each a
``torch.compile`` (inductor) function compiled on first use with ``dynamic=True`` on flattened, contiguous,
detached inputs, so no shape change recompiles (one compile per kernel and dtype; dims of size 0 or 1, which
dynamic shapes would specialize, run the math eagerly). Backward is not differentiable again (no double backward).
``emulate_precision_casts`` makes inductor round every bf16/fp16 intermediate like eager does, so
``dropout_add`` is bit-identical to its reference in every dtype; ``bias_gelu`` differs from ATen's GELU kernel by
a few ulp (inductor's erf/tanh, and the order of the bias-gradient sum). If compilation is unavailable or fails
(no C++ compiler, ``SHARDLIB_EPILOGUE_COMPILE=0``, :func:`set_compile`), the same math runs in eager mode (then
both forwards equal their references bit for bit); a compiler failure is reported once with ``warnings.warn``.

The HF modules these ops are installed into: :mod:`shardlib.kernels.epilogues`.
"""

from __future__ import annotations

import collections
import functools
import os
import warnings

import torch
import torch.nn.functional as F

#: Calls of the public fused ops ("bias_gelu", "dropout_add"); of them, ":reference" ran the reference (eval, p=0,
#: p=1, non-CPU, mismatched residual). ":eager" counts kernels (forward; ".backward" for backward) whose math ran
#: eagerly (compilation off or failed, a dimension of size <= 1, inside an outer torch.compile trace). Tests use
#: it to prove the kernels ran.
CALLS: collections.Counter = collections.Counter()


# ------------------------------------------------------------------------------------------------ references
def bias_gelu_reference(y: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(y + bias)``: what HF computes after a linear with bias (``addmm``, then the activation)."""
    return F.gelu(y if bias is None else y + bias, approximate=approximate)


def dropout_add_reference(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``residual + F.dropout(x, p, training)``."""
    return residual + F.dropout(x, p, training)


# ------------------------------------------------------------------------------ the math, compiled or eager
# One function (one code object, so one compile cache) per kernel and GELU flavour. Inputs are 1-D / 2-D,
# contiguous and detached (not views: dynamo guards on a view's base), so shapes never cause a recompile; each
# kernel compiles once per dtype.
def _bias_gelu_fwd_erf(y, bias):
    return F.gelu(y + bias)


def _bias_gelu_fwd_tanh(y, bias):
    return F.gelu(y + bias, approximate="tanh")


def _bias_gelu_bwd_erf(g, y, bias):
    dz = torch.ops.aten.gelu_backward(g, y + bias)
    return dz, dz.sum(0)


def _bias_gelu_bwd_tanh(g, y, bias):
    dz = torch.ops.aten.gelu_backward(g, y + bias, approximate="tanh")
    return dz, dz.sum(0)


_BIAS_GELU_KERNELS = {"none": (_bias_gelu_fwd_erf, _bias_gelu_bwd_erf),
                      "tanh": (_bias_gelu_fwd_tanh, _bias_gelu_bwd_tanh)}


def _dropout_add_fwd(x, mask, residual, scale):
    # x * m is exact (m in {0, 1}; x * 0 keeps signed zeros and NaNs as F.dropout's x * noise does); * scale rounds
    # once, as x * noise does; + residual rounds once.
    return residual + x * mask.to(x.dtype) * scale


def _dropout_add_bwd(g, mask, scale):
    return g * mask.to(g.dtype) * scale  # = g * noise, F.dropout's backward, with the same single rounding


_COMPILE_OPTIONS = {"emulate_precision_casts": True}  # round bf16/fp16 intermediates like eager
_state = {"enabled": os.environ.get("SHARDLIB_EPILOGUE_COMPILE", "1") != "0", "failure": None}


def set_compile(enabled: bool) -> None:
    """Turn the torch.compile path on or off (off: the same math in eager mode). Clears a recorded failure."""
    _state["enabled"], _state["failure"] = bool(enabled), None


def implementation() -> str:
    """"inductor" when the fused ops run compiled, else "eager (<why>)"."""
    if _state["failure"] is not None:
        return f"eager (torch.compile failed: {_state['failure']})"
    return "inductor" if _state["enabled"] else "eager (disabled)"


@functools.cache
def _compiled(fn):
    return torch.compile(fn, fullgraph=True, dynamic=True, options=_COMPILE_OPTIONS)


def _run(name: str, fn, *args):
    """``fn(*args)`` compiled if possible, else eagerly (same math)."""
    args = tuple(a.detach().contiguous() for a in args)
    # size-0/1 dims would be specialized (a recompile each); such tensors are too small to gain from fusion
    tiny = any(d <= 1 for a in args if a.dim() for d in a.shape)
    if tiny or not _state["enabled"] or _state["failure"] is not None or torch.compiler.is_compiling():
        CALLS[f"{name}:eager"] += 1
        return fn(*args)  # inside an outer torch.compile, the outer compiler traces the math itself
    try:
        return _compiled(fn)(*args)
    except Exception as exc:  # noqa: BLE001 - decide below whether the compiler or the inputs are at fault
        out = fn(*args)  # raises (the caller's error, compilation left on) if the inputs are at fault
        CALLS[f"{name}:eager"] += 1
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        if "RecompileLimit" not in type(exc).__name__:  # a broken compiler: stop trying; else only this variant
            _state["failure"] = reason
        warnings.warn(f"shardlib.kernels.epilogues: torch.compile failed, running {name} eagerly (same results, "
                      f"no fusion): {reason}", RuntimeWarning, stacklevel=3)
        return out


# ------------------------------------------------------------------------------------------------ fused ops
class _BiasGELU(torch.autograd.Function):
    """forward: GELU(y + b) (one kernel); backward: dz = gelu'(y + b) * g, db = sum_rows dz (one kernel)."""

    @staticmethod
    def forward(ctx, y2d, bias, approximate):
        ctx.save_for_backward(y2d, bias)
        ctx.approximate = approximate
        return _run("bias_gelu", _BIAS_GELU_KERNELS[approximate][0], y2d, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        y2d, bias = ctx.saved_tensors
        dz, db = _run("bias_gelu.backward", _BIAS_GELU_KERNELS[ctx.approximate][1], g, y2d, bias)
        return dz, db if ctx.needs_input_grad[1] else None, None


class _DropoutAdd(torch.autograd.Function):
    """forward: r + x * m * s (one kernel); backward: dx = g * m * s (one kernel), dr = g. Saves the bool mask."""

    @staticmethod
    def forward(ctx, x, residual, mask, scale):
        ctx.save_for_backward(mask, scale)
        return _run("dropout_add", _dropout_add_fwd, x, mask, residual, scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        mask, scale = ctx.saved_tensors
        dx = _run("dropout_add.backward", _dropout_add_bwd, g, mask, scale) if ctx.needs_input_grad[0] else None
        return dx, g if ctx.needs_input_grad[1] else None, None, None


def bias_gelu(y: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """``GELU(y + bias)`` in one pass (forward and backward); y [*, H], bias [H] or None."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if torch.compiler.is_compiling():
        return bias_gelu_reference(y, bias, approximate)  # an outer torch.compile fuses the plain ops itself
    CALLS["bias_gelu"] += 1
    if bias is None or bias.dim() != 1 or y.dim() == 0 or y.shape[-1] != bias.shape[0] or y.dtype != bias.dtype:
        CALLS["bias_gelu:reference"] += 1
        return bias_gelu_reference(y, bias, approximate)
    # one kernel signature for any number of leading dims
    return _BiasGELU.apply(y.reshape(-1, y.shape[-1]), bias, approximate).view(y.shape)


_scales: dict = {}


def _dropout_scale(p: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``1 / (1 - p)`` rounded to ``dtype`` exactly as F.dropout's ``noise.div_(1 - p)`` rounds it (0-dim)."""
    key = (p, dtype, device)
    if key not in _scales:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor, saved by autograd for backward
            _scales[key] = torch.ones(1, dtype=dtype, device=device).div_(1 - p)[0].clone()
    return _scales[key]


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``residual + dropout(x)`` in one pass, equal to :func:`dropout_add_reference` bit for bit (same RNG use)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if torch.compiler.is_compiling():
        return dropout_add_reference(x, residual, p, training)  # an outer torch.compile fuses the plain ops itself
    CALLS["dropout_add"] += 1
    if not training or p == 0.0:
        CALLS["dropout_add:reference"] += 1
        return residual + x  # F.dropout returns x itself here
    if (p == 1.0 or x.device.type != "cpu" or x.shape != residual.shape or x.dtype != residual.dtype
            or not x.dtype.is_floating_point):
        CALLS["dropout_add:reference"] += 1
        return dropout_add_reference(x, residual, p, training)
    mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1 - p)  # F.dropout's draw, 1 byte per element
    scale = _dropout_scale(p, x.dtype, x.device)
    out = _DropoutAdd.apply(x.reshape(-1), residual.reshape(-1), mask.reshape(-1), scale)
    return out.view(x.shape)


__all__ = ["bias_gelu", "bias_gelu_reference", "dropout_add", "dropout_add_reference", "set_compile", "implementation",
           "CALLS"]
