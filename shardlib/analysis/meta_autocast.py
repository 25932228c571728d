"""``torch.autocast`` on meta tensors, for the dry run of a bf16 / fp16 training step.

Autocast is a dispatch key of the device (``AutocastCPU``, ``AutocastCUDA``); meta tensors pass none, so a dry run
under ``torch.autocast`` computes everything in float32 and would count a float32 step's activations. What autocast
changes for memory is which dtype each op computes in, and so which tensors are saved in which dtype:
:class:`AutocastOnMeta` applies its casts above autograd (a torch-function mode), as autocast does:

* ops of the *lower-precision* list run in the autocast dtype: their floating-point inputs (not float64) are cast
  to it, and the casts of parameters (leaf tensors that require grad) are cached for the region, as autocast caches
  them: a weight used twice is cast once, and its low-precision copy is what the op saves for backward;
* ops of the *float32* list run in float32: their low-precision inputs are cast up (a loss over bf16 logits makes a
  float32 copy of them);
* everything else runs in the dtype its inputs have (type promotion: a bf16 output added to a float32 residual is
  float32).

The lists are torch's (``aten/src/ATen/autocast_mode.cpp``), at the level of the Python functions the models call,
per device type: CUDA runs more ops in float32 (layer norm, softmax, exp, pow, ...) than the CPU does, and its
cross-entropy differs (:func:`_cuda_cross_entropy`). Ops no transformer calls are left out. The CPU lists are checked
against a real CPU autocast step, byte for byte (tests/test_meta_autocast.py); the CUDA ones against the tensors a
GPU saved and its measured peaks (docs/benchmarks/planner-accuracy.md, "One GPU").
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..parallel.casting import autocast_dtype, meta_autocast

Tensor = torch.Tensor

#: lower precision on every device: matrix multiplies, convolutions, attention
_LOWER = {F.linear, torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.mm, Tensor.mm,
          torch.bmm, Tensor.bmm, torch.baddbmm, Tensor.baddbmm, torch.addmm, Tensor.addmm, torch.addbmm,
          Tensor.addbmm, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
          F.prelu, F.scaled_dot_product_attention}
#: float32 on every device: the losses
_FLOAT32 = {F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
            F.binary_cross_entropy_with_logits, F.poisson_nll_loss, F.cosine_embedding_loss, F.hinge_embedding_loss,
            F.margin_ranking_loss, F.multilabel_margin_loss, F.soft_margin_loss, F.triplet_margin_loss,
            F.multi_margin_loss}
LOWER = {"cpu": _LOWER,
         "cuda": _LOWER | {torch.einsum, torch.mv, Tensor.mv, torch.addmv, Tensor.addmv, torch.addr, Tensor.addr,
                           torch.chain_matmul, torch.linalg.multi_dot}}
FLOAT32 = {"cpu": _FLOAT32,
           "cuda": (_FLOAT32 - {F.cross_entropy}) | {  # cross-entropy: its decomposition is (_cuda_cross_entropy)
               F.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.softmax, Tensor.softmax, torch.log_softmax,
               Tensor.log_softmax, torch.exp, Tensor.exp, torch.log, Tensor.log, torch.pow, Tensor.pow, torch.rsqrt,
               Tensor.rsqrt, torch.logsumexp, Tensor.logsumexp, torch.cumsum, Tensor.cumsum, F.softplus,
               torch.cosine_similarity, torch.cdist}}
_LOW = (torch.float16, torch.bfloat16)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class AutocastOnMeta(TorchFunctionMode):
    """The casts of ``torch.autocast(device_type, dtype)`` applied to meta tensors (module docstring)."""

    def __init__(self, dtype: torch.dtype, device_type: str = "cpu"):
        super().__init__()
        if device_type not in LOWER:
            raise ValueError(f"autocast on meta tensors knows the device types {sorted(LOWER)}, got {device_type!r}")
        self.dtype, self.device_type = dtype, device_type
        self.lower, self.float32 = LOWER[device_type], FLOAT32[device_type]
        self.cache: dict[int, Tensor] = {}  # id(parameter) -> its cast, for the region (autocast's weight cache)
        self._says = None

    def __enter__(self):
        # code that computes a linear itself asks autocast's dtype (shardlib.parallel.casting): tell it
        self._says = meta_autocast(self.dtype)
        self._says.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._says.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if autocast_dtype("meta") is None:  # inside shardlib.parallel.casting.autocast_off: autocast is off
            return func(*args, **kwargs)
        if func is F.cross_entropy and self.device_type == "cuda":
            return _cuda_cross_entropy(*args, **kwargs)
        if func in self.lower:
            args, kwargs = self._cast(args, kwargs, self.dtype, lambda t: t.dtype != torch.float64)
        elif func in self.float32:
            args, kwargs = self._cast(args, kwargs, torch.float32, lambda t: t.dtype in _LOW)
        return func(*args, **kwargs)

    def _cast(self, args, kwargs, dtype: torch.dtype, eligible):
        def cast(t):
            if not isinstance(t, Tensor) or not t.is_floating_point() or t.dtype == dtype or not eligible(t):
                return t
            if t.device.type != "meta":
                return t  # a real tensor: real autocast (or none) decides
            if t.is_leaf and t.requires_grad:
                cached = self.cache.get(id(t))
                if cached is None or cached.dtype != dtype:
                    cached = self.cache[id(t)] = t.to(dtype)
                return cached
            return t.to(dtype)

        def each(a):  # a list or tuple of tensors (torch.cat's) cast element-wise
            return type(a)(map(cast, a)) if type(a) in (list, tuple) else cast(a)

        return tuple(map(each, args)), {k: each(v) for k, v in kwargs.items()}


def _cuda_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0):
    """``F.cross_entropy`` as CUDA autocast runs it on low-precision logits (measured on torch 2.11, H200: the loss
    is not on CUDA's float32 list, its decomposition is): the log-softmax in the logits' dtype (its result saved),
    then ``nll_loss``, which is on the list, on a float32 copy of it (saved too)."""
    if input.dtype not in _LOW or label_smoothing:
        return F.cross_entropy(input.float() if input.dtype in _LOW else input, target, weight, size_average,
                               ignore_index, reduce, reduction, label_smoothing)
    logp = torch.log_softmax(input, 1)
    return F.nll_loss(logp.float(), target, weight, size_average, ignore_index, reduce, reduction)


def autocast_on_meta(precision: str, device_type: str = "cpu"):
    """A context for the forward of a dry run at ``precision`` ("fp32": nothing; "bf16", "fp16": autocast's casts
    as on ``device_type``)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of fp32, bf16, fp16, got {precision!r}")
    return AutocastOnMeta(DTYPES[precision], device_type)
