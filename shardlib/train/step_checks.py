"""What the Trainer checks of its step options and of each loss a forward gives, before anything changes: one line
naming the value and what was expected."""

from __future__ import annotations

import math
import numbers

import torch


def as_loss(result, where: str) -> torch.Tensor:
    """The scalar loss in ``result`` (a tensor, or a mapping / model output with ``"loss"``); a clear error else."""
    loss = result.get("loss") if hasattr(result, "get") and not torch.is_tensor(result) else result
    if not torch.is_tensor(loss):
        raise TypeError(f"{where} returned {type(result).__name__}"
                        f"{' without a loss' if hasattr(result, 'get') else ''}; expected a scalar loss tensor "
                        "or a dict with 'loss' (pass labels, or give forward_step=... / loss_fn=...)")
    if loss.dim() != 0:
        raise ValueError(f"{where} returned a loss of shape {tuple(loss.shape)}; expected a scalar (a model without "
                         "a loss needs forward_step=... or loss_fn=...)")
    return loss


def _positive(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0 and math.isfinite(value)


def check_step_options(microbatches, max_grad_norm, optimizer, forward_step, loss_fn, bucket_mb) -> None:
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if max_grad_norm is not None and not _positive(max_grad_norm):
        raise ValueError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}")
    if not _positive(bucket_mb):
        raise ValueError(f"bucket_mb must be a positive finite number (MiB per gradient bucket), got {bucket_mb!r}")
    for name, value in (("optimizer", optimizer), ("forward_step", forward_step), ("loss_fn", loss_fn)):
        if value is not None and not callable(value):
            what = {"optimizer": "a function from parameters to an optimizer (lambda params: torch.optim.AdamW("
                                 "params, lr=...))",
                    "forward_step": "a function (model, batch) -> loss or {'loss': ...}",
                    "loss_fn": "a function from the model's first output to a loss"}[name]
            raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    if forward_step is not None and loss_fn is not None:
        raise ValueError("give forward_step or loss_fn, not both")
