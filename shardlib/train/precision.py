"""Mixed precision for the Trainer: ``precision="fp32" | "bf16" | "fp16"``, the dynamic loss scaler, master weights.

* ``bf16`` / ``fp16``: every forward runs under ``torch.autocast`` with that dtype (the weights keep their dtype).
* ``fp16`` adds :class:`DynamicLossScaler`: the loss is multiplied by the scale before backward, the gradients are
  divided by it (and checked for inf/nan) before clipping, and a step with an inf/nan gradient on *any* rank of
  the mesh is skipped on *every* rank: one all-reduce of one flag over the whole world per step
  (:func:`found_non_finite`, which ``Trainer(skip_nonfinite=True)`` runs in the other precisions,
  :mod:`shardlib.train.nonfinite`).
* ``master_weights=True`` (for weights already in fp16/bf16): the optimizer steps fp32 copies of the parameters
  (:class:`shardlib.train.optim.MasterWeightsOptimizer`), as Megatron's and ColossalAI's mixed-precision
  optimizers do; the model's low-precision weights are refreshed from them after every step.

Why not ``torch.amp.GradScaler``: its growth/backoff (``torch._amp_update_scale_``) has no hysteresis, no minimum
and no maximum scale, which ColossalAI's knobs need, and its inf check is per device: a skipped step must be agreed
over the whole mesh before the optimizer (possibly partitioned over dp) runs. The unscale-and-check kernel is
torch's own (``torch._amp_foreach_non_finite_check_and_unscale_``, what GradScaler calls).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist

PRECISIONS = ("fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class DynamicLossScaler:
    """ColossalAI's / Megatron's dynamic loss scale. After ``hysteresis`` overflowing steps (not necessarily in a
    row) the scale is multiplied by ``backoff_factor`` (not below ``min_scale``), and again on every overflow
    until it grows; after ``growth_interval`` steps in a row without overflow it is multiplied by
    ``growth_factor`` (not above ``max_scale``) and the hysteresis count restarts. Every overflowing step is
    skipped."""

    initial_scale: float = 2.0 ** 16
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: float = 2.0 ** 32
    scale: float = field(default=None, init=False)
    good_steps: int = field(default=0, init=False)       # steps without overflow since the last change
    overflows: int = field(default=0, init=False)         # overflowing steps counted toward hysteresis
    skipped: int = field(default=0, init=False)           # steps skipped in all

    def __post_init__(self):
        problems = []
        if not (math.isfinite(self.min_scale) and self.min_scale > 0):
            problems.append(f"min_scale must be a positive finite number, got {self.min_scale!r}")
        if not (math.isfinite(self.max_scale) and self.max_scale >= self.min_scale):
            problems.append(f"min_scale ({self.min_scale!r}) must not exceed max_scale ({self.max_scale!r})")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            problems.append(f"initial_scale {self.initial_scale!r} must lie in [min_scale, max_scale] = "
                            f"[{self.min_scale!r}, {self.max_scale!r}]")
        if not (math.isfinite(self.growth_factor) and self.growth_factor > 1):
            problems.append(f"growth_factor must be > 1, got {self.growth_factor!r}")
        if not 0 < self.backoff_factor < 1:
            problems.append(f"backoff_factor must lie in (0, 1), got {self.backoff_factor!r}")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if problems:
            raise ValueError("DynamicLossScaler: " + "; ".join(problems))
        self.scale = float(self.initial_scale)

    def unscale_and_check(self, grads: list[torch.Tensor], group=None) -> bool:
        """Divide ``grads`` by the scale in place; True when any gradient on any rank of ``group`` (default: the
        whole world) is inf or nan. One all-reduce of one flag (:func:`found_non_finite`)."""
        return found_non_finite(grads, inverse_scale=1.0 / self.scale, group=group)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped += 1
            self.good_steps = 0
            self.overflows += 1
            if self.overflows >= self.hysteresis:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.good_steps, self.overflows = 0, 0
            self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict:
        """Settings and state as JSON-able numbers (the scale is a float: powers of two round-trip exactly)."""
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        restored = DynamicLossScaler(**{f.name: state[f.name] for f in fields(self) if f.init})  # validated
        restored.scale = float(state["scale"])
        for key in ("good_steps", "overflows", "skipped"):
            setattr(restored, key, int(state[key]))
        self.__dict__.update(restored.__dict__)


def found_non_finite(grads: list[torch.Tensor], *, inverse_scale: float = 1.0, group=None) -> bool:
    """True when any of ``grads`` on any rank of ``group`` (default: the whole world) holds an inf or nan, the same
    answer on every rank: torch's fused check (``torch._amp_foreach_non_finite_check_and_unscale_``, what
    ``GradScaler`` calls) per device and dtype, then one all-reduce (MAX) of one flag. ``grads`` are multiplied by
    ``inverse_scale`` in place (the loss scaler's unscaling; 1.0 leaves every value as it is). Every rank of
    ``group`` must call it, with its own gradients (an empty list too)."""
    found = torch.zeros(1, dtype=torch.float32, device=_flag_device())
    by_kind: dict = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), same in by_kind.items():
        here = torch.zeros(1, dtype=torch.float32, device=device)
        inverse = torch.full((1,), inverse_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(same, here, inverse)
        found += here.to(found.device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item())


def _flag_device() -> str:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def low_precision_dtypes(params) -> set[torch.dtype]:
    return {p.dtype for p in params if p.is_floating_point() and p.dtype in (torch.float16, torch.bfloat16)}


def check_precision(precision: str, params: list, master_weights: bool, loss_scaler) -> None:
    """The precision options against the model's weights, before anything is built (one-line errors)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if loss_scaler is not None and precision != "fp16":
        raise ValueError(f"loss_scaler is for precision='fp16' (this Trainer has precision={precision!r})")
    if loss_scaler is not None and not isinstance(loss_scaler, (DynamicLossScaler, dict)):
        raise TypeError(f"loss_scaler must be a DynamicLossScaler or a dict of its settings, got "
                        f"{type(loss_scaler).__name__}")
    low = low_precision_dtypes(params)
    if precision == "fp16" and torch.float16 in low and not master_weights:
        raise ValueError("precision='fp16' on a model whose weights are already float16 needs master_weights=True "
                         "(fp32 copies for the optimizer; fp16 weights would lose small updates), or fp32 weights")
    if master_weights and not low:
        raise ValueError("master_weights=True keeps fp32 copies of fp16/bf16 weights, but this model's weights are "
                         "already fp32: leave it off")


def make_scaler(precision: str, loss_scaler) -> DynamicLossScaler | None:
    if precision != "fp16":
        return None
    if isinstance(loss_scaler, DynamicLossScaler):
        return loss_scaler
    return DynamicLossScaler(**(loss_scaler or {}))


def autocast(precision: str, device_type: str):
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
