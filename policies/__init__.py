"""Per-architecture policies (installed as ``shardlib.policies``) and the registry that finds them.

A policy turns one model (its class and config) into a :class:`shardlib.plan.Plan`: plain data mapping
module-path patterns to parallel styles, plus attribute rewrites, the layer trunk and the loss. See
``docs/policy-authoring.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from shardlib.plan import Plan, PlanError


@dataclass(frozen=True)
class Policy:
    """``make_plan(model, tp) -> Plan`` for every class in ``model_classes``.

    ``checkpoint_keys``: ordered (in-memory fragment, on-disk fragment) pairs that turn a parameter name of the
    model as transformers builds it in memory into the key its Hub checkpoints use, and back (applied in the same
    order both ways; each side must be unambiguous). Empty when the names agree.
    """

    name: str
    model_classes: tuple[type, ...]
    make_plan: Callable[[nn.Module, int], Plan]
    checkpoint_keys: tuple[tuple[str, str], ...] = ()

    def plan(self, model: nn.Module, tp: int) -> Plan:
        return self.make_plan(model, tp)

    def to_hub_key(self, name: str) -> str:
        for memory, hub in self.checkpoint_keys:
            name = name.replace(memory, hub)
        return name

    def to_memory_key(self, key: str) -> str:
        for memory, hub in self.checkpoint_keys:
            key = key.replace(hub, memory)
        return key


_REGISTRY: dict[type, Policy] = {}


def register_policy(policy: Policy) -> Policy:
    for cls in policy.model_classes:
        _REGISTRY[cls] = policy
    return policy


def policy_for(model: nn.Module) -> Policy:
    """The policy registered for ``type(model)`` (or its nearest registered base class)."""
    for cls in type(model).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    supported = ", ".join(sorted(c.__name__ for c in _REGISTRY))
    raise PlanError(
        f"no shardlib policy for model class {type(model).__name__}; supported: {supported}. "
        "Pass policy=... to shard() for another architecture (docs/policy-authoring.md)."
    )


def policy_for_class_name(name: str) -> Policy:
    """The policy registered for the model class called ``name`` (checkpoints record class names)."""
    for cls, policy in _REGISTRY.items():
        if cls.__name__ == name:
            return policy
    raise PlanError(f"no shardlib policy for model class {name}")


def registered_classes() -> list[type]:
    return list(_REGISTRY)


from . import bert, t5, vit  # noqa: E402,F401  (each module registers its policy)
