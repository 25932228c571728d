"""Per-architecture policies (installed as ``shardlib.policies``) and the registry that finds them.

A policy turns one model (its class and config) into a :class:`shardlib.sharding.plan.Plan`: plain data mapping
module-path patterns to parallel styles, plus attribute rewrites, the layer trunk and the loss. See
``docs/policy-authoring.md``.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from shardlib.sharding.plan import Plan, PlanError

if TYPE_CHECKING:
    from torch import nn


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

#: the built-in policies by the names of the transformers classes they cover, imported on first lookup so that
#: ``import shardlib`` loads no model code; each module registers the classes themselves (tests/test_architecture.py
#: checks that the names here are exactly those)
BUILTIN: dict[str, tuple[str, ...]] = {
    "bert": ("BertModel", "BertForPreTraining", "BertForMaskedLM", "BertLMHeadModel", "BertForNextSentencePrediction",
             "BertForSequenceClassification", "BertForMultipleChoice", "BertForTokenClassification",
             "BertForQuestionAnswering"),
    "vit": ("ViTModel", "ViTForImageClassification", "ViTForMaskedImageModeling"),
    "t5": tuple(f"{family}{head}" for family in ("T5", "MT5", "UMT5")
                for head in ("Model", "ForConditionalGeneration", "EncoderModel", "ForSequenceClassification",
                             "ForTokenClassification", "ForQuestionAnswering")),
    "switch_transformers": ("SwitchTransformersModel", "SwitchTransformersForConditionalGeneration",
                            "SwitchTransformersEncoderModel"),
}
_BUILTIN_MODULE = {name: module for module, names in BUILTIN.items() for name in names}


def register_policy(policy: Policy) -> Policy:
    for cls in policy.model_classes:
        _REGISTRY[cls] = policy
    return policy


def _load_builtin(class_name: str) -> None:
    """Import the built-in policy module that covers a class of this name (it registers its classes)."""
    if class_name in _BUILTIN_MODULE:
        importlib.import_module(f"{__name__}.{_BUILTIN_MODULE[class_name]}")


def _registered(model: nn.Module) -> Policy | None:
    """The policy registered for ``type(model)`` or its nearest registered base class, built-ins imported first."""
    for cls in type(model).__mro__:
        if cls not in _REGISTRY:
            _load_builtin(cls.__name__)  # registers the transformers class of that name, not a look-alike
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    return None


def missing_policy(model: nn.Module) -> str:
    """That ``model``'s class has no policy, and which classes have one."""
    supported = ", ".join(sorted(set(_BUILTIN_MODULE) | {c.__name__ for c in _REGISTRY}))
    return f"no shardlib policy for model class {type(model).__name__}; supported: {supported}"


def policy_for(model: nn.Module) -> Policy:
    """The policy registered for ``type(model)`` (or its nearest registered base class)."""
    policy = _registered(model)
    if policy is None:
        raise PlanError(f"{missing_policy(model)}. Pass policy=... to shard() for another architecture "
                        "(docs/policy-authoring.md).")
    return policy


def has_policy(model: nn.Module) -> bool:
    """Whether a policy is registered for ``type(model)`` or one of its base classes."""
    return _registered(model) is not None


def policy_for_class_name(name: str) -> Policy:
    """The policy registered for the model class called ``name`` (checkpoints record class names)."""
    _load_builtin(name)
    for cls, policy in _REGISTRY.items():
        if cls.__name__ == name:
            return policy
    raise PlanError(f"no shardlib policy for model class {name}")


def hub_key_mapping(class_name: str) -> Callable[[str], str]:
    """How the in-memory parameter names of the model class called ``class_name`` map to its Hub checkpoint keys:
    its policy's :meth:`Policy.to_hub_key`. A class without a policy (sharded by an inferred plan) keeps its names,
    unless transformers renames its weights between checkpoint and memory (DeiT, BEiT): that mapping is
    transformers' own, which shardlib's checkpoint code does not apply, so it is refused by name."""
    _load_builtin(class_name)
    for cls, policy in _REGISTRY.items():
        if cls.__name__ == class_name:
            return policy.to_hub_key
    if _transformers_renames(class_name):
        raise PlanError(f"{class_name} has no shardlib policy and transformers renames its weights between its "
                        "checkpoints and memory (transformers.conversion_mapping); shardlib's checkpoint code does not "
                        "apply that mapping: write a policy with checkpoint_keys for it (docs/policy-authoring.md)")
    return lambda name: name


@functools.lru_cache(maxsize=None)
def _transformers_renames(class_name: str) -> bool:
    """Whether transformers maps any weight name of ``class_name`` on load (built on the meta device with its
    config class's defaults: the mapping is per class and model type, not per size)."""
    import torch
    import transformers
    from transformers.conversion_mapping import get_model_conversion_mapping

    cls = getattr(transformers, class_name, None)
    if cls is None:
        return False
    with torch.device("meta"):
        model = cls(cls.config_class())
    mapping = get_model_conversion_mapping(model, add_legacy=False)
    # per-expert tensors stacked into fused experts (Mixtral, Qwen-MoE), with renamings beside them: shardlib's
    # reader applies those (shardlib.checkpoint.experts), and transformers loads the in-memory names it writes
    stacking = [c for c in mapping
                if [type(op).__name__ for op in getattr(c, "operations", [])][:1] == ["MergeModulelist"]]
    renaming = [c for c in mapping if type(c).__name__ == "WeightRenaming"]
    return bool(mapping) and not (stacking and len(stacking) + len(renaming) == len(mapping))


def registered_classes() -> list[type]:
    """Every class with a policy: the built-in ones (all imported by this call) and those registered since."""
    for module in BUILTIN:
        importlib.import_module(f"{__name__}.{module}")
    return list(_REGISTRY)
