"""Per-position inputs of attention modules under sequence parallelism over sp (``"all_to_all"``, ``"ring"``).

Inside a layer stack, each sp rank holds its chunk of the padded sequence (all-to-all: consecutive positions; the
ring: its layout's segments). A model may hand its attention modules tensors computed for the whole sequence before
the stack (Llama's rotary ``position_embeddings``: cos and sin, [b | 1, L, d]), which the module combines with its
own chunk's q and k. :attr:`AttentionSite.positions` names those forward arguments; this pass cuts each tensor in
them along dim 1 to this rank's positions, exactly as the stack's entry cuts the hidden states
(:meth:`SequenceStream.chunk`; forward: keep this rank's positions, backward: all-gather). Masks are not cut here:
the attention functions read the rows they need.
"""

from __future__ import annotations

import inspect

import torch

from .sequence import SEQ_DIM


class SequencePositions:
    """The pass that cuts each attention site's ``positions`` arguments to this rank's chunk (module docstring). It
    runs after the sequence-parallel pass, whose state (``r.sequence``) it reads."""

    def problems(self, r) -> list[str]:
        problems = []
        for pattern, site in r.plan.attention.items():
            if not site.positions:
                continue
            for path in r.match(pattern, "attention"):
                params = inspect.signature(r.modules[path].forward).parameters
                problems += [f"{path}: forward has no argument {name!r} (AttentionSite.positions)"
                             for name in site.positions if name not in params]
        return problems

    def install(self, r) -> None:
        for pattern, site in r.plan.attention.items():
            if site.positions:
                for path in r.match(pattern):
                    module = r.modules[path]
                    cut = _Cut(site.positions, list(inspect.signature(module.forward).parameters),
                               r.sequence.stream(r.stack_of(path)), type(module).__name__)
                    module.register_forward_pre_hook(cut, with_kwargs=True)


class _Cut:
    """Forward pre-hook: the named arguments (tensors, or tuples / lists of them) cut to this rank's chunk."""

    def __init__(self, names: tuple[str, ...], params: list[str], stream, owner: str):
        self.names, self.params, self.stream, self.owner = names, params, stream, owner

    def __call__(self, module, args, kwargs):
        if getattr(self.stream, "unsplit", False):  # incremental decoding: every rank runs the whole sequence
            return None
        args = list(args)
        for name in self.names:
            if name in kwargs:
                kwargs[name] = self._cut(kwargs[name], name)
            elif name in self.params and self.params.index(name) < len(args):
                i = self.params.index(name)
                args[i] = self._cut(args[i], name)
        return tuple(args), kwargs

    def _cut(self, value, name: str):
        if value is None:
            return None
        if isinstance(value, (tuple, list)):
            return type(value)(self._cut(v, name) for v in value)
        length = self.stream.length
        if not torch.is_tensor(value) or value.dim() <= SEQ_DIM or value.shape[SEQ_DIM] != length:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise RuntimeError(f"{self.owner}: argument {name!r} (AttentionSite.positions) is {shape}, not one value "
                               f"per position of the {length}-token sequence along dim {SEQ_DIM} (a key/value cache "
                               "is not supported under sequence parallelism over sp)")
        return self.stream.chunk(value)


__all__ = ["SequencePositions"]
