"""Fused epilogues in HF models: bias + GELU after a linear and dropout + residual add, installed into BERT, ViT and
T5 modules. The ops, their references and their math are :mod:`shardlib.kernels.epilogue_ops` (re-exported here).

Installation (:func:`install_bias_gelu`, :func:`install_dropout_add`) swaps the class of the HF module for a
subclass here whose forward calls the fused op (``shardlib.sharding.losses`` swaps classes the same way): no parameter,
buffer or state-dict key changes, ``isinstance`` still holds, models still pickle and deepcopy.

* bias_gelu (BertIntermediate: ``dense``/``intermediate_act_fn``; ViTMLP: ``fc1``/``activation_fn``): the linear
  gets an ``epilogue`` attribute, a :class:`BiasGELU` called as ``epilogue(F.linear(x, W), b)`` instead of adding
  the bias. ``shardlib.parallel.layers.ColumnParallelLinear`` honours ``epilogue`` itself (and copies it from the
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

import functools
import hashlib
import inspect
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation, GELUTanh
from transformers.models.bert.modeling_bert import BertIntermediate, BertOutput, BertSelfOutput
from transformers.models.t5.modeling_t5 import T5LayerCrossAttention, T5LayerFF, T5LayerSelfAttention
from transformers.models.vit.modeling_vit import ViTLayer, ViTMLP

from shardlib.parallel.layers import ColumnParallelLinear

from .epilogue_ops import (  # noqa: F401  (the ops are part of this module's API)
    CALLS, bias_gelu, bias_gelu_reference, dropout_add, dropout_add_reference, implementation, set_compile,
)

KINDS = ("bias_gelu", "dropout_add")


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
