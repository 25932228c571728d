"""Fused epilogues: bias + GELU after a linear, and dropout + residual add, each with the reference it must equal.

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

Installation (:func:`install_bias_gelu`, :func:`install_dropout_add`) swaps the class of the HF module for a
subclass here whose forward calls the fused op (``shardlib.losses`` swaps classes the same way): no parameter,
buffer or state-dict key changes, ``isinstance`` still holds, models still pickle and deepcopy.

* bias_gelu (BertIntermediate: ``dense``/``intermediate_act_fn``; ViTMLP: ``fc1``/``activation_fn``): the linear
  gets an ``epilogue`` attribute, a :class:`BiasGELU` called as ``epilogue(F.linear(x, W), b)`` instead of adding
  the bias. ``shardlib.layers.ColumnParallelLinear`` honours ``epilogue`` itself (and copies it from the
  ``nn.Linear`` it shards, so installing before or after sharding both work); a plain ``nn.Linear`` becomes an
  :class:`EpilogueLinear` (class swap, same parameters). The owner's forward then skips its activation; if its
  linear was replaced by one without the epilogue it runs the stock activation (correct, unfused, warned).
* dropout_add (BertSelfOutput, BertOutput, ViTLayer [both residuals], T5LayerFF, T5LayerSelfAttention,
  T5LayerCrossAttention): the ``dropout`` module becomes a :class:`DropoutAdd` (class swap of the same
  ``nn.Dropout`` object, so forward hooks registered before or after, e.g. ``styles.LocalRNG``'s RNG-stream
  switch, stay and fire) whose ``forward(x, residual)`` runs the fused op; the owner's forward calls
  ``self.dropout(x, residual)``. The fused forwards restate HF's; they are installed only on the exact HF class
  whose forward source matches the one they restate (transformers 5.23), else :func:`epilogue_problems` says so.

Transformers 5 has no ViTIntermediate / ViTOutput: ViT's MLP is ``ViTMLP`` (fc1, act, fc2) and both residual
dropout-adds live in ``ViTLayer`` (one dropout module, called twice).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import inspect
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation, GELUTanh
from transformers.models.bert.modeling_bert import BertIntermediate, BertOutput, BertSelfOutput
from transformers.models.t5.modeling_t5 import T5LayerCrossAttention, T5LayerFF, T5LayerSelfAttention
from transformers.models.vit.modeling_vit import ViTLayer, ViTMLP

from shardlib.layers import ColumnParallelLinear

KINDS = ("bias_gelu", "dropout_add")

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


# ------------------------------------------------------------------------------------------- modules
class BiasGELU:
    """An ``epilogue`` for a linear: ``epilogue(F.linear(x, W), b) = GELU(x W^T + b)`` fused."""

    def __init__(self, approximate: str = "none"):
        if approximate not in ("none", "tanh"):
            raise ValueError(f"BiasGELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def __call__(self, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return bias_gelu(y, bias, self.approximate)

    def __repr__(self) -> str:
        return f"BiasGELU(approximate={self.approximate!r})"


class EpilogueLinear(nn.Linear):
    """``nn.Linear`` with the ``epilogue`` contract of ``ColumnParallelLinear``: if set, ``forward(x) =
    epilogue(F.linear(x, W), b)``. A plain nn.Linear's class is swapped to this one (same object, same params)."""

    epilogue = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.epilogue is None:
            return F.linear(x, self.weight, self.bias)
        return self.epilogue(F.linear(x, self.weight), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, epilogue={self.epilogue!r}"


class DropoutAdd(nn.Dropout):
    """``nn.Dropout`` whose forward optionally takes the residual: ``forward(x)`` = ``F.dropout(x)``,
    ``forward(x, residual)`` = :func:`dropout_add` (fused). Hooks on the module fire around either call."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None:
            return F.dropout(x, self.p, self.training, self.inplace)
        return dropout_add(x, residual, self.p, self.training)


def _act_then(module, linear: nn.Module, act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``act(linear(x))``, with the activation fused into the linear when its BiasGELU epilogue is still there."""
    if isinstance(getattr(linear, "epilogue", None), BiasGELU):
        return linear(x)
    warnings.warn(f"{type(module).__name__}: its linear ({type(linear).__name__}) lost the bias_gelu epilogue "
                  "(replaced after install?); running the stock activation", RuntimeWarning, stacklevel=3)
    return act(linear(x))


class FusedBertIntermediate(BertIntermediate):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _act_then(self, self.dense, self.intermediate_act_fn, hidden_states)


class FusedViTMLP(ViTMLP):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(_act_then(self, self.fc1, self.activation_fn, hidden_states))


class FusedBertSelfOutput(BertSelfOutput):
    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden_states), input_tensor))


class FusedBertOutput(BertOutput):
    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden_states), input_tensor))


class FusedViTLayer(ViTLayer):
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.attention(self.layernorm_before(hidden_states), attention_mask, **kwargs)
        hidden_states = self.dropout(hidden_states, residual)
        return self.dropout(self.mlp(self.layernorm_after(hidden_states)), hidden_states)


class FusedT5LayerFF(T5LayerFF):
    def forward(self, hidden_states):
        return self.dropout(self.DenseReluDense(self.layer_norm(hidden_states)), hidden_states)


class FusedT5LayerSelfAttention(T5LayerSelfAttention):
    def forward(self, hidden_states, attention_mask=None, position_bias=None, past_key_values=None, **kwargs):
        attention_output, position_bias, attn_weights = self.SelfAttention(
            self.layer_norm(hidden_states), mask=attention_mask, position_bias=position_bias,
            past_key_values=past_key_values, **kwargs)
        return self.dropout(attention_output, hidden_states), position_bias, attn_weights


class FusedT5LayerCrossAttention(T5LayerCrossAttention):
    def forward(self, hidden_states, key_value_states, attention_mask=None, position_bias=None,
                past_key_values=None, **kwargs):
        attention_output, position_bias, attn_weights = self.EncDecAttention(
            self.layer_norm(hidden_states), mask=attention_mask, key_value_states=key_value_states,
            position_bias=position_bias, past_key_values=past_key_values, **kwargs)
        return self.dropout(attention_output, hidden_states), position_bias, attn_weights


# (stock class, fused class, sha256[:16] of the stock forward's source that the fused forward restates)
_BIAS_GELU = {
    BertIntermediate: (FusedBertIntermediate, "889c3eb8cb652e6c", "dense", "intermediate_act_fn"),
    ViTMLP: (FusedViTMLP, "6c0b0fa491ab2844", "fc1", "activation_fn"),
}
_DROPOUT_ADD = {
    BertSelfOutput: (FusedBertSelfOutput, "0650f56bc438ef17"),
    BertOutput: (FusedBertOutput, "0650f56bc438ef17"),
    ViTLayer: (FusedViTLayer, "33a0d8fea42bee15"),
    T5LayerFF: (FusedT5LayerFF, "b7f2c285f08b51b0"),
    T5LayerSelfAttention: (FusedT5LayerSelfAttention, "fce4997b3576493f"),
    T5LayerCrossAttention: (FusedT5LayerCrossAttention, "ab21facfc696ed3a"),
}
SUPPORTED = {"bias_gelu": tuple(_BIAS_GELU), "dropout_add": tuple(_DROPOUT_ADD)}


@functools.cache
def _source_digest(cls) -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(cls.forward).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def _gelu_approximate(act) -> str | None:
    """"none" / "tanh" if ``act`` is F.gelu exactly as a fused kernel computes it, else None."""
    if act is F.gelu:
        return "none"
    if type(act) is GELUActivation and act.act is F.gelu:
        return "none"
    if type(act) is GELUTanh and isinstance(act.act, functools.partial) and act.act.func is F.gelu \
            and act.act.keywords == {"approximate": "tanh"} and not act.act.args:
        return "tanh"
    return None


def _stock_class(kind: str, module: nn.Module):
    """The stock HF class this module is (or was, before installation), or None."""
    table = _BIAS_GELU if kind == "bias_gelu" else _DROPOUT_ADD
    for stock, (fused, *_rest) in table.items():
        if type(module) in (stock, fused):
            return stock
    return None


def epilogue_problems(kind: str, path: str, module: nn.Module) -> list[str]:
    """Why ``module`` (at ``path``) cannot take the ``kind`` kernel; [] if it can (or already has it)."""
    if kind not in KINDS:
        return [f"{path}: unknown epilogue kind {kind!r}; known: {', '.join(KINDS)}"]
    stock = _stock_class(kind, module)
    if stock is None:
        names = ", ".join(c.__name__ for c in SUPPORTED[kind])
        return [f"{path}: {kind} applies to {names}; found {type(module).__name__}"]
    table = _BIAS_GELU if kind == "bias_gelu" else _DROPOUT_ADD
    fused, digest, *attrs = table[stock]
    if type(module) is fused:
        return []  # installed already; installing again is a no-op
    problems = []
    if _source_digest(stock) != digest:
        problems.append(f"{path}: {stock.__name__}.forward is not the transformers 5.23 forward the fused "
                        f"{kind} restates (source changed or unavailable)")
    if kind == "bias_gelu":
        linear_attr, act_attr = attrs
        linear, act = getattr(module, linear_attr, None), getattr(module, act_attr, None)
        if type(linear) is nn.Linear or isinstance(linear, ColumnParallelLinear):
            if getattr(linear, "epilogue", None) is not None:
                problems.append(f"{path}.{linear_attr}: already has an epilogue ({linear.epilogue!r})")
        else:
            problems.append(f"{path}.{linear_attr}: bias_gelu needs an nn.Linear or ColumnParallelLinear, "
                            f"found {type(linear).__name__}")
        if _gelu_approximate(act) is None:
            problems.append(f"{path}.{act_attr}: activation {type(act).__name__} is not GELU as F.gelu computes it "
                            "(supported: HF 'gelu', 'gelu_pytorch_tanh'; 'gelu_new'/'gelu_python' round op by "
                            "op and are not fused)")
    else:
        drop = getattr(module, "dropout", None)
        if type(drop) not in (nn.Dropout, DropoutAdd):
            problems.append(f"{path}.dropout: dropout_add needs an nn.Dropout, found {type(drop).__name__}")
    return problems


def _check(kind: str, path: str, module: nn.Module) -> None:
    problems = epilogue_problems(kind, path, module)
    if problems:
        raise ValueError(f"cannot install {kind}:\n  " + "\n  ".join(problems))


def install_bias_gelu(path: str, module: nn.Module) -> nn.Module:
    """Fuse the bias add into GELU in ``module`` (BertIntermediate / ViTMLP), in place; returns ``module``."""
    _check("bias_gelu", path, module)
    fused, _digest, linear_attr, act_attr = _BIAS_GELU[_stock_class("bias_gelu", module)]
    if type(module) is fused:
        return module
    linear = getattr(module, linear_attr)
    if type(linear) is nn.Linear:
        linear.__class__ = EpilogueLinear
    linear.epilogue = BiasGELU(_gelu_approximate(getattr(module, act_attr)))
    module.__class__ = fused
    return module


def install_dropout_add(path: str, module: nn.Module) -> nn.Module:
    """Fuse the residual dropout-add of ``module`` (BertSelfOutput / BertOutput / ViTLayer / T5LayerFF /
    T5LayerSelfAttention / T5LayerCrossAttention), in place; the same dropout object, now a DropoutAdd."""
    _check("dropout_add", path, module)
    fused, _digest = _DROPOUT_ADD[_stock_class("dropout_add", module)]
    if type(module) is fused:
        return module
    if type(module.dropout) is nn.Dropout:
        module.dropout.__class__ = DropoutAdd  # same object: its hooks (LocalRNG) stay
    module.__class__ = fused
    return module


INSTALLERS = {"bias_gelu": install_bias_gelu, "dropout_add": install_dropout_add}


def install_epilogues(model: nn.Module, kinds=KINDS) -> dict[str, list[str]]:
    """Install each kind on every module of ``model`` it applies to; returns the paths per kind. Modules of a
    supported class that cannot take the kernel (another activation, ...) are left alone."""
    installed: dict[str, list[str]] = {k: [] for k in kinds}
    for path, module in list(model.named_modules()):
        for kind in kinds:
            if _stock_class(kind, module) is not None and not epilogue_problems(kind, path, module):
                INSTALLERS[kind](path, module)
                installed[kind].append(path)
    return installed


__all__ = [
    "bias_gelu", "bias_gelu_reference", "dropout_add", "dropout_add_reference", "install_bias_gelu",
    "install_dropout_add", "install_epilogues", "epilogue_problems", "BiasGELU", "EpilogueLinear", "DropoutAdd",
    "set_compile", "implementation", "CALLS", "KINDS",
]
