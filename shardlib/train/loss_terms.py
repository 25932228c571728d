"""The parts of a training step's loss: a mixture of experts' auxiliary router losses apart from the main loss they
are added to (:func:`shardlib.sharding.experts.router_loss_terms`: Switch's ``router_z_loss`` and
``router_aux_loss``, the decoders' ``router_aux_loss``, each as weighted and added by the model).

Each term is weighted over the step's microbatches and batches as the loss is (by its share of the step's loss
items) and travels in the loss's own all-reduce over dp: the loss tensor of a batch becomes ``[loss, *terms]``, so a
step costs no extra collective and no extra device sync. The main loss is the step's loss less its terms. A model
without MoE layers, or a Trainer with ``loss_fn``, adds nothing: the loss tensor stays ``[loss]``.
"""

from __future__ import annotations

import torch

from ..sharding.experts import router_loss_terms


class LossTerms:
    """One Trainer's auxiliary loss terms: gathered per microbatch (:meth:`add`), appended to each batch's loss
    before its all-reduce (:meth:`append_to`), read once per step (:meth:`read`) into :attr:`last`:
    ``{"main_loss": ..., "router_aux_loss": ..., ...}``, or None when the step's loss had no auxiliary term."""

    def __init__(self, model, enabled: bool):
        self.model, self.enabled = model, enabled
        self.last: dict[str, float] | None = None
        self._sums: dict[str, torch.Tensor] = {}
        self._names: list[tuple[str, ...]] = []  # per appended batch loss, the names of its terms

    def start_batch(self) -> None:
        """Forget terms added by a batch that raised before its loss was appended."""
        self._sums = {}

    def add(self, out, share: float) -> None:
        """The auxiliary terms of a microbatch's output (a model output, or a mapping ``forward_step`` returned),
        weighted by ``share``, the microbatch's share of the step's loss items."""
        if not self.enabled or torch.is_tensor(out) or not hasattr(out, "get"):
            return
        for name, value in router_loss_terms(self.model, out).items():
            value = torch.as_tensor(value).detach().to(torch.float64) * share
            self._sums[name] = self._sums[name] + value if name in self._sums else value

    def append_to(self, loss: torch.Tensor) -> torch.Tensor:
        """``[loss, *terms]`` (float64, on ``loss``'s device) for the terms added since the last call, which are
        cleared; ``loss`` itself (shape [1]) when there were none."""
        sums, self._sums = self._sums, {}
        self._names.append(tuple(sums))
        if not sums:
            return loss
        return torch.cat([loss, torch.stack([v.reshape(()).to(loss.device) for v in sums.values()])])

    def read(self, vectors: list[torch.Tensor]) -> float:
        """The step's loss from its batches' reduced vectors (:meth:`append_to`), read from the device once; the
        terms summed over the batches into :attr:`last`."""
        values = (vectors[0] if len(vectors) == 1 else torch.cat(vectors)).tolist()
        names, self._names = self._names[-len(vectors):], []
        loss, terms, at = 0.0, {}, 0
        for part in names:
            loss += values[at]
            for i, name in enumerate(part):
                terms[name] = terms.get(name, 0.0) + values[at + 1 + i]
            at += 1 + len(part)
        self.last = {"main_loss": loss - sum(terms.values()), **terms} if terms else None
        return loss


def mean_terms(steps: list[dict | None]) -> dict[str, float]:
    """Each term of ``steps`` (:attr:`LossTerms.last` of each step of a log interval) averaged over the steps that
    carry it; empty when none does."""
    sums: dict[str, list[float]] = {}
    for terms in steps:
        for name, value in (terms or {}).items():
            sums.setdefault(name, []).append(value)
    return {name: sum(values) / len(values) for name, values in sums.items()}
