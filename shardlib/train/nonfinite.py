"""Non-finite steps: ``Trainer(..., skip_nonfinite=True, max_consecutive_skips=K)``.

A step whose gradients hold an inf or nan on *any* rank of the mesh is skipped on *every* rank: no optimizer step
(parameters and optimizer state untouched, AdamW's step count included), ``trainer.last_step_skipped`` is True, so
``fit`` does not advance the LR scheduler, and the step is counted. After ``K`` skipped steps in a row the run
stops: ``FloatingPointError`` on every rank, naming the parameters whose gradients were not finite in the last one
and the ranks (with mesh coordinates) holding them.

The decision is the fp16 loss scaler's: every gradient the optimizer would read (after the sums over dp and tied
stages; master weights' and ZeRO pieces included) goes through torch's fused non-finite check and one all-reduce of
one flag over the whole world (:func:`shardlib.train.precision.found_non_finite`), so every rank of every dp, pp,
sp and tp group agrees. Under ``precision="fp16"`` the scaler's own check *is* that check (nothing runs twice) and
the scaler counts the steps it skips; ``skip_nonfinite`` adds the stop after ``K`` in a row (a scaler that keeps
overflowing at its minimum scale would otherwise skip forever) and the names. With clipping (``max_grad_norm``), a
global norm that is not finite although every gradient is (squares overflowing) also skips the step, where it
would raise without the option. Without the option nothing changes: fp32 / bf16 with clipping stop on a
non-finite norm (``FloatingPointError``); without clipping nothing checks the gradients (plain PyTorch's
behaviour: the optimizer writes inf/nan into the weights).

Counting: :attr:`NonFiniteSteps.skipped` counts the steps this option skipped that the loss scaler did not (the
scaler's ``skipped`` counts its own), so ``fit``'s ``skipped_steps`` is their sum and no step counts twice;
:attr:`NonFiniteSteps.consecutive` counts skipped steps in a row, whichever skipped them.
"""

from __future__ import annotations

from typing import Callable

#: ``max_consecutive_skips`` when not given. fp16's default scaler (2**16, hysteresis 2, min_scale 1) skips up to 17
#: steps in a row while it backs off to its minimum scale; 20 stops only after three more overflows there.
DEFAULT_MAX_CONSECUTIVE_SKIPS = 20


class NonFiniteSteps:
    """The counts of skipped steps and the stop after ``max_consecutive`` in a row (module docstring)."""

    def __init__(self, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE_SKIPS):
        self.max_consecutive = max_consecutive
        self.skipped = 0        # steps skipped by this option (not those the fp16 loss scaler skipped)
        self.consecutive = 0    # skipped steps in a row, whichever skipped them

    def record(self, skipped: bool, *, by_scaler: bool, names: Callable[[], str]) -> None:
        """Count one step (called on every rank with the same ``skipped``). On the ``max_consecutive``-th skip in a
        row, raise FloatingPointError with ``names()`` (a collective over the world: every rank reaches it)."""
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        if not by_scaler:
            self.skipped += 1
        if self.consecutive >= self.max_consecutive:
            raise FloatingPointError(
                f"{self.consecutive} steps in a row had inf/nan gradients and were skipped (skip_nonfinite=True, "
                f"max_consecutive_skips={self.max_consecutive}); the optimizer did not step. Non-finite gradients "
                f"in the last one: {names()}. Lower the learning rate, or look for an overflowing loss or input")

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.consecutive = int(state["skipped"]), int(state["consecutive"])


def check_skip_options(skip_nonfinite, max_consecutive_skips) -> None:
    """``Trainer``'s ``skip_nonfinite`` / ``max_consecutive_skips`` (one-line errors, before anything changes)."""
    if not isinstance(skip_nonfinite, bool):
        raise TypeError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}")
    if max_consecutive_skips is None:
        return
    if not skip_nonfinite:
        raise ValueError("max_consecutive_skips is for skip_nonfinite=True (this Trainer has skip_nonfinite=False)")
    if not isinstance(max_consecutive_skips, int) or isinstance(max_consecutive_skips, bool) \
            or max_consecutive_skips < 1:
        raise ValueError(f"max_consecutive_skips must be a positive integer, got {max_consecutive_skips!r}")


def make_guard(skip_nonfinite: bool, max_consecutive_skips: int | None) -> NonFiniteSteps | None:
    if not skip_nonfinite:
        return None
    return NonFiniteSteps(max_consecutive_skips or DEFAULT_MAX_CONSECUTIVE_SKIPS)
