"""``shard()`` as a transaction: a failed ``shard()`` leaves the model exactly as it was.

Two halves make the promise. Every pass's checks (``problems``) run before the first install and change nothing;
whatever they find is one ``PlanError``. Then the installs run inside :func:`restoring`, which snapshots the model
first and, if anything raises (a bug, a check an install makes of its own, a KeyboardInterrupt), puts the snapshot
back and re-raises.

Why a snapshot of the module tree rather than an undo record per install: the snapshot is complete by construction
for everything an install may do to a module, whoever writes the install, where an undo log is only as complete as
each author's memory. An install changes a model only through the objects the tree reaches:

* a module's ``__dict__``: its parameters, buffers and children (``_parameters``, ``_buffers``, ``_modules``),
  every hook dict, ``training``, plain attributes (head counts, ``config``, a ``forward`` set on the instance);
* a module's class (the loss wrapper and the fused epilogues swap classes);
* a config's ``__dict__`` (switching the attention implementation writes ``_attn_implementation``);
* a parameter or buffer object: its data (replaced with ``.data =`` or written in place), ``requires_grad``,
  ``grad``, its autograd hooks (sequence parallelism hooks the gradients of replicated parameters), its ``__dict__``;
* the attention registries, where wrappers are registered by name (:func:`shardlib.kernels.attention.registries`).

All are recorded one level deep: each ``__dict__`` is copied, and each dict, set or list it holds is recorded as
that same object plus a copy of its contents, restored in place (a hook handle the caller kept still removes its
hook afterwards). Nothing is deep-copied: installs replace tensors and modules rather than change them, so restoring
the references restores the values. The one thing a reference cannot restore, tensor data written in place, is
outside the installs' contract (docs/policy-authoring.md); the snapshot checks each tensor's version counter and
raises naming the tensor if it moved. Cost: the original parameters stay alive until ``shard()`` returns, so peak
memory while sharding is the unsharded model plus this rank's shards (shard a meta-device model and load a
checkpoint where that matters).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import PreTrainedConfig

from ..kernels.attention import registries

_CONTAINERS = (dict, set, list)
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _contents(container):
    return container.copy() if not isinstance(container, list) else list(container)


def _put_back(container, contents) -> None:
    if isinstance(container, list):
        container[:] = contents
    else:
        container.clear()
        container.update(contents)


class _ObjectState:
    """An object's class and ``__dict__``, and the contents of the containers its ``__dict__`` holds."""

    def __init__(self, obj):
        self.obj, self.cls, self.attrs = obj, type(obj), dict(obj.__dict__)
        self.containers = [(v, _contents(v)) for v in self.attrs.values() if isinstance(v, _CONTAINERS)]

    def restore(self) -> None:
        for container, contents in self.containers:
            _put_back(container, contents)
        if type(self.obj) is not self.cls:
            object.__setattr__(self.obj, "__class__", self.cls)
        self.obj.__dict__.clear()
        self.obj.__dict__.update(self.attrs)


class _TensorState:
    """What an install could change on a parameter or buffer object (module docstring)."""

    def __init__(self, name: str, t: torch.Tensor):
        self.name, self.t, self.alias = name, t, t.detach()  # the alias keeps the original data, copying nothing
        self.version, self.requires_grad = t._version, t.requires_grad
        self.grad = t.grad if t.is_leaf else None  # (a non-leaf buffer has no .grad of its own)
        self.attrs = dict(t.__dict__)
        self.hooks = {h: getattr(t, h, None) for h in _TENSOR_HOOKS}
        self.hook_contents = {h: _contents(d) for h, d in self.hooks.items() if d is not None}

    def restore(self) -> str | None:
        """Put the object back; a problem when its data was written in place (that cannot be undone)."""
        t = self.t
        if self.alias._version != self.version:
            return f"{self.name} (a {tuple(t.shape)} tensor) was written in place"
        if not _same_data(t, self.alias):
            with torch.no_grad():
                t.data = self.alias
        if t.requires_grad != self.requires_grad:
            t.requires_grad_(self.requires_grad)
        if t.is_leaf and t.grad is not self.grad:
            t.grad = self.grad
        for h, before in self.hooks.items():
            now = getattr(t, h, None)
            if now is not None and now is not before:
                now.clear()  # the C++ side may hold on to it: emptied, it calls nothing
            if before is not None:
                _put_back(before, self.hook_contents[h])
            if now is not before:
                setattr(t, h, before)
        t.__dict__.clear()
        t.__dict__.update(self.attrs)
        return None


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.shape == b.shape
            and a.stride() == b.stride() and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype)


def _configs(modules) -> list:
    """Every config object the modules hold, and the configs nested in them (composite models)."""
    found: dict[int, object] = {}
    todo = [v for m in modules for v in m.__dict__.values() if isinstance(v, PreTrainedConfig)]
    while todo:
        config = todo.pop()
        if id(config) not in found:
            found[id(config)] = config
            todo += [v for v in config.__dict__.values() if isinstance(v, PreTrainedConfig)]
    return list(found.values())


class ModelSnapshot:
    """Everything an install can change on ``model`` and its registries (module docstring), restorable."""

    def __init__(self, model: nn.Module):
        modules = list(model.modules())
        self.objects = [_ObjectState(m) for m in modules] + [_ObjectState(c) for c in _configs(modules)]
        tensors: dict[int, _TensorState] = {}
        for path, m in model.named_modules(remove_duplicate=False):
            for kind in ("_parameters", "_buffers"):
                for name, t in m.__dict__[kind].items():
                    if t is not None and id(t) not in tensors:
                        tensors[id(t)] = _TensorState(f"{path + '.' if path else ''}{name}", t)
        self.tensors = list(tensors.values())
        self.registries = [(mapping, mapping.copy()) for mapping in registries()]

    def restore(self) -> list[str]:
        """Put everything back; the tensors whose data was written in place (restored as far as possible)."""
        for mapping, contents in self.registries:
            _put_back(mapping, contents)
        for state in self.objects:
            state.restore()
        return [problem for t in self.tensors if (problem := t.restore()) is not None]


@contextlib.contextmanager
def restoring(model: nn.Module, what: str):
    """Run the block as a transaction on ``model`` (``what`` names it in messages): on any exception the model and
    the attention registries are restored from a :class:`ModelSnapshot` and the exception goes on, with a note
    saying so."""
    snapshot = ModelSnapshot(model)
    try:
        yield
    except BaseException as exc:
        problems = snapshot.restore()
        if problems:
            raise RuntimeError(f"shard() of {what} failed ({type(exc).__name__}: {exc}) and could not restore "
                               f"the model: {'; '.join(problems)}") from exc
        exc.add_note(f"shard() of {what} failed; the model is as it was before the call")
        raise


__all__ = ["ModelSnapshot", "restoring"]
