"""A plan is plain data: what a policy produces for one model and what the sharder applies.

Module-path patterns are dotted paths relative to the model root where ``*`` matches exactly one path atom
(``bert.encoder.layer.*.attention.self``) and ``**`` matches any number of atoms (zero or more).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from .styles import Style


class PlanError(ValueError):
    """A plan that does not fit the model or the mesh; raised before the model is changed."""


@dataclass(frozen=True, kw_only=True)
class LossSpec:
    """How the sharded model computes its training loss from vocab-sharded logits instead of HF's own loss.

    ``kind``: a loss registered in :mod:`shardlib.losses` ("masked_lm", "causal_lm", "pretraining").
    ``head``: module path of the vocab-parallel output head (its layout says which vocab columns are local).
    ``logits``: the output field holding the head's logits. ``labels``: the forward arguments that carry labels.
    """

    kind: str
    head: str
    logits: str = "logits"
    labels: tuple[str, ...] = ("labels",)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """``styles``: pattern -> style or tuple of styles. ``divide_by_tp``: pattern -> integer attributes that become
    their per-rank value (head counts, widths). ``trunk``: the repeated layer stacks (ModuleLists), in forward
    order, for pipeline and sequence parallelism. ``loss``: vocab-parallel loss, if the model has a vocab head."""

    styles: dict[str, Style | tuple[Style, ...]]
    divide_by_tp: dict[str, tuple[str, ...]] = field(default_factory=dict)
    trunk: tuple[str, ...] = ()
    loss: LossSpec | None = None


@lru_cache(maxsize=None)
def compile_pattern(pattern: str) -> re.Pattern:
    atoms = pattern.split(".")
    regex = ""
    for i, atom in enumerate(atoms):
        if atom == "**":
            if i == len(atoms) - 1:
                regex += r"(?:\.[^.]+)*" if i else r".*"
            else:
                regex += (r"\." if i else "") + r"(?:[^.]+\.)*"
            continue
        if i and atoms[i - 1] != "**":
            regex += r"\."
        regex += re.escape(atom).replace(r"\*", r"[^.]+")
    return re.compile(regex)


def match_modules(pattern: str, paths) -> list[str]:
    rx = compile_pattern(pattern)
    return [p for p in paths if rx.fullmatch(p)]
