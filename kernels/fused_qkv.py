"""Fused QKV: one GEMM computes the outputs of a group of linears that read the same input.

Attention blocks call their projections one after another on the very same tensor object ``x`` (BERT / ViT
self-attention: q, k, v; T5 self-attention: q, k, v; T5 cross-attention: k, v on the encoder states). Under
tensor parallelism these are :class:`~shardlib.parallel.layers.ColumnParallelLinear` local shards with
``copy_input=False`` (the enclosing ``CopyInputs`` hook entered the TP region once) and ``gather_output=False``, i.e.
plain local linears. :func:`fuse_linears` makes the group share one GEMM without moving any parameter.

The GEMM, its shapes and its backward: :class:`~shardlib.kernels.fused_linear.FusedLinear`.

``W`` is concatenated afresh at every forward (and again in backward instead of being saved): a copy of ``N x in``
elements (3 x 768 x 768 float32 = 7 MB, ~0.3 ms on this project's CPU machine) against ``6 M N in`` GEMM flops. So
the parameters stay exactly where HF puts them (same ``Parameter`` objects, same ``q.weight`` / ``k.weight`` /
``v.weight`` state-dict keys and layouts): checkpoints load and save the separate HF keys, optimizers and gradient
hooks see the usual leaves, and parameters replaced later (materialized from the meta device, loaded by
``shardlib.checkpoint``) are read at the next call. Nothing caches a parameter across calls. Storing q/k/v as views
of one fused buffer would save the copy but makes the parameters share storage, which safetensors refuses to save.

Hand-off. A member called with no slice pending for it computes the GEMM, returns its slice and stashes the
others (with a weak reference to ``x`` and the weight / bias objects used and their versions). With a graph, the
stash hangs on the returned output itself and the group keeps only a weak reference to it: the model keeps a view
of that output while it calls the other members (autograd views keep their base alive), and the stash dies with
it, so a member that is never called keeps no graph alive across steps. Without a graph (no_grad, inference mode)
the group holds the stash until ``x`` dies. Either way it is released as soon as the last member has taken its
slice. A member with a pending slice returns it only if it is called with the very same tensor object ``x``
(identity, and unchanged ``x._version``), under the same grad / inference / autocast mode, with the same weight
and bias objects at the same versions; in every other case (another input, parameters swapped or updated in
between, an unsupported dtype or device, flags changed on a ColumnParallelLinear, ``torch.compile`` tracing) it
computes its own output with its class' ``forward``, which is always correct. If the first output is released
before a pending member is called (a model that does ``self.q(x) * s`` before calling k), fusion would only add
work: the group logs a warning on the ``shardlib`` logger and computes each projection separately from then on.
Under autocast the inputs are cast to the autocast dtype once, outside the Function (autograd records the casts).
Activation checkpointing recomputes by calling the members again, which computes the GEMM again.

Counters on each :class:`FusedGroup` (``fused_gemms``, ``handed_out``, ``own_calls``, flag ``disabled``) make
silent non-fusion visible to tests.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping

import torch
from torch import nn

from shardlib.parallel.casting import autocast_dtype, autocast_off, cast_for_linear
from shardlib.parallel.layers import ColumnParallelLinear

from .fused_linear import FusedLinear

log = logging.getLogger("shardlib")
_PENDING_ATTR = "_shardlib_fused_pending"
_SUPPORTED_FORWARDS = (nn.Linear.forward, ColumnParallelLinear.forward)


class _Pending:
    """The other members' outputs and what they were computed from (``x`` weakly: see FusedGroup._stash)."""

    __slots__ = ("x_ref", "x_version", "mode", "outputs")

    def __init__(self, x, mode, outputs):
        self.x_ref, self.x_version, self.mode, self.outputs = weakref.ref(x), _version(x), mode, outputs


def _version(t):
    # inference tensors have no version counter (and cannot be modified in place outside inference mode)
    return None if t is None or t.is_inference() else t._version


class FusedGroup:
    """The linears of one fused group (see the module docstring); installed by :func:`fuse_linears`.

    Counters: ``fused_gemms`` (fused GEMMs computed), ``handed_out`` (stashed outputs returned to later members),
    ``own_calls`` (members that computed their own output).
    """

    def __init__(self, modules: list[nn.Linear], names: list[str]):
        self.modules, self.names = list(modules), list(names)
        self.fused_gemms = self.handed_out = self.own_calls = 0
        self.disabled = False  # set if the model drops the first output before calling the others (see call)
        self._ref = None  # weakref: to the first output (it carries the _Pending), or to x (then _held has it)
        self._held: _Pending | None = None
        self._expected: frozenset[int] = frozenset()  # members with a pending output

    # weak references are not picklable / copyable; a copy starts with nothing pending
    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_ref=None, _held=None, _expected=frozenset())
        return state

    def reset_counters(self) -> None:
        self.fused_gemms = self.handed_out = self.own_calls = 0

    def __repr__(self) -> str:
        return (f"FusedGroup({', '.join(self.names)}; fused_gemms={self.fused_gemms}, handed_out={self.handed_out}, "
                f"own_calls={self.own_calls})")

    # -- the call path -----------------------------------------------------------------------------------------
    def _own(self, index, *args, **kwargs):
        if not torch.compiler.is_compiling():  # a counter bumped inside a graph is a guard: a recompile every step
            self.own_calls += 1
        module = self.modules[index]
        return type(module).forward(module, *args, **kwargs)

    def _release(self) -> None:
        obj = self._ref() if self._ref is not None else None
        if obj is not None and self._held is None:
            obj.__dict__.pop(_PENDING_ATTR, None)
        self._ref, self._held, self._expected = None, None, frozenset()

    def _stash(self, x, mine, pending) -> None:
        """Keep ``pending`` for the other members, released when consumed or when nothing can consume it.

        With a graph (``mine.grad_fn``) the pending outputs reference ``x`` and the whole graph below, so they hang
        on ``mine``, the output returned to the first member (the model keeps a view of it while it calls the
        others; autograd views keep their base alive): they die with it. Without a graph (no_grad, inference mode;
        inference tensors do not keep view bases alive) they reference nothing but their own buffer, so the group
        holds them while ``x`` lives: a member can only consume them by being called with ``x``.
        """
        self._expected = frozenset(pending.outputs)
        if mine.grad_fn is not None:
            setattr(mine, _PENDING_ATTR, pending)
            self._ref, self._held = weakref.ref(mine), None
            return
        group_ref = weakref.ref(self)

        def x_died(ref):
            group = group_ref()
            if group is not None and group._ref is ref:
                group._ref, group._held, group._expected = None, None, frozenset()

        self._ref, self._held = weakref.ref(x, x_died), pending

    def _pending(self) -> tuple[_Pending | None, bool]:
        """The pending outputs, and whether they were lost: the first output died before all were consumed."""
        if self._ref is None:
            return None, False
        obj = self._ref()
        if obj is None:
            lost = self._held is None
            self._ref, self._held = None, None
            return None, lost
        return (self._held if self._held is not None else obj.__dict__.get(_PENDING_ATTR)), False

    @staticmethod
    def _mode(x):
        dtype = autocast_dtype(x.device.type)
        return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), dtype is not None, dtype

    def _params(self, x, mode):
        """The members' (weight, bias) if the fused GEMM computes exactly what each member's forward would, else
        None."""
        autocast = mode[2]
        params = []
        for module in self.modules:
            if type(module).forward not in _SUPPORTED_FORWARDS:
                return None
            if isinstance(module, ColumnParallelLinear):
                if module.copy_input or module.gather_output or (module.group is None and module.tp_size > 1):
                    return None
            w, b = module.weight, module.bias
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != x.shape[-1]:
                return None
            if b is not None and (not isinstance(b, torch.Tensor) or b.shape != (w.shape[0],)
                                  or b.dtype != w.dtype or b.device != w.device):
                return None
            params.append((w, b))
        w0 = params[0][0]
        for w, _ in params:
            if w.dtype != w0.dtype or w.device != w0.device or w.layout != torch.strided:
                return None
        if x.device != w0.device or x.layout != torch.strided or x.dim() == 0:
            return None
        if not autocast and x.dtype != w0.dtype:
            return None
        return params

    def _compute(self, x, params, mode):
        weights = [w for w, _ in params]
        biases = [b for _, b in params]
        if mode[2]:  # autocast: cast as F.linear would (floating, non-float64 inputs), then compute in that dtype
            dtype, device = mode[3], x.device.type
            x_c = cast_for_linear(x, dtype)
            weights, biases = [cast_for_linear(w, dtype) for w in weights], [cast_for_linear(b, dtype) for b in biases]
            if x_c.dtype != weights[0].dtype or any(b is not None and b.dtype != x_c.dtype for b in biases):
                return None
            with autocast_off(device):
                return FusedLinear.apply(x_c, len(weights), *weights, *biases)
        return FusedLinear.apply(x, len(weights), *weights, *biases)

    def call(self, index: int, x):
        if not isinstance(x, torch.Tensor) or self.disabled or torch.compiler.is_compiling():
            return self._own(index, x)
        pending, lost = self._pending()
        if lost and index in self._expected:
            # the first output (and the slices hanging on it) died before this member was called: the model does
            # not keep the first projection alive while it calls the others, so fusing would only add work
            self.disabled = True
            log.warning("fused QKV disabled for %s: the output of the member called first was released before %s "
                        "was called; computing each projection separately", ", ".join(self.names), self.names[index])
            return self._own(index, x)
        if pending is None:
            self._expected = frozenset()
        elif index in pending.outputs:
            out, w, b, versions = pending.outputs.pop(index)
            self._expected = frozenset(pending.outputs)
            if not pending.outputs:
                self._release()
            module = self.modules[index]
            if (pending.x_ref() is x and pending.x_version == _version(x) and pending.mode == self._mode(x)
                    and module.weight is w and module.bias is b and versions == (_version(w), _version(b))):
                self.handed_out += 1
                return out
            return self._own(index, x)  # another input, or something changed since the GEMM: compute it anew
        mode = self._mode(x)
        params = self._params(x, mode)
        outs = self._compute(x, params, mode) if params is not None else None
        if outs is None:
            return self._own(index, x)
        self.fused_gemms += 1
        self._release()
        mine = outs[index]
        others = {j: (out, w, b, (_version(w), _version(b)))
                  for j, (out, (w, b)) in enumerate(zip(outs, params)) if j != index}
        if others:
            self._stash(x, mine, _Pending(x, mode, others))
        return mine


class _MemberForward:
    """Installed as ``module.forward`` (an instance attribute, so the class, ``isinstance`` checks, repr and
    state-dict keys stay as they were). Picklable and deep-copyable: a copy is bound to the copied group."""

    def __init__(self, group: FusedGroup, index: int):
        self.group, self.index = group, index

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs:
            return self.group.call(self.index, args[0])
        if not args and list(kwargs) == ["input"]:
            return self.group.call(self.index, kwargs["input"])
        return self.group._own(self.index, *args, **kwargs)


def _members(path: str, linears) -> list[tuple[str, object]]:
    def join(name):
        return f"{path}.{name}" if path and name else (path or name)

    if isinstance(linears, Mapping):
        return [(join(str(name)), module) for name, module in linears.items()]
    out = []
    for i, item in enumerate(linears):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append((join(item[0]), item[1]))
        else:
            out.append((join(str(i)) if path else f"[{i}]", item))
    return out


def fused_qkv_problems(path: str, linears) -> list[str]:
    """What prevents fusing ``linears`` into one GEMM, one sentence per problem naming the module's path.

    ``linears``: a mapping name -> module, a sequence of (name, module) pairs or a sequence of modules (named by
    index); each member's path is ``f"{path}.{name}"`` (just ``name`` when ``path`` is empty).
    """
    members = _members(path, linears)
    problems = []
    if len(members) < 2:
        problems.append(f"{path or '<group>'}: fusing needs at least 2 linears, got {len(members)}")
    seen: dict[int, str] = {}
    usable = []
    for p, module in members:
        if id(module) in seen:
            problems.append(f"{p}: the same module is also member {seen[id(module)]}")
            continue
        seen[id(module)] = p
        if not isinstance(module, nn.Linear):
            problems.append(f"{p}: expected nn.Linear or ColumnParallelLinear, found {type(module).__name__}")
            continue
        if type(module).forward not in _SUPPORTED_FORWARDS:
            problems.append(f"{p}: {type(module).__name__} has its own forward; only nn.Linear and "
                            "ColumnParallelLinear can be fused")
            continue
        if isinstance(module, ColumnParallelLinear):
            if module.copy_input:
                problems.append(f"{p}: ColumnParallelLinear has copy_input=True (it enters the TP region itself); "
                                "fuse only linears whose enclosing block copies the input once (copy_input=False)")
            if module.gather_output:
                problems.append(f"{p}: ColumnParallelLinear has gather_output=True; the fused GEMM returns local "
                                "slices only (gather_output=False)")
        installed = module.__dict__.get("forward")
        if isinstance(installed, _MemberForward):
            problems.append(f"{p}: already fused in group ({', '.join(installed.group.names)})")
        elif installed is not None:
            problems.append(f"{p}: forward is overridden on the instance ({installed!r}); refusing to replace it")
        w = module.weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            found = f"shape {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
            problems.append(f"{p}: weight is not a 2-D tensor ({found})")
            continue
        b = module.bias
        if b is not None and (b.dtype != w.dtype or b.device != w.device):
            problems.append(f"{p}: bias is {b.dtype} on {b.device} but weight is {w.dtype} on {w.device}")
        if w.layout != torch.strided:
            problems.append(f"{p}: weight layout {w.layout} is not strided")
        usable.append((p, w))
    if usable:
        ref_path, ref = usable[0]
        for p, w in usable[1:]:
            if w.shape[1] != ref.shape[1]:
                problems.append(f"{p}: in_features {w.shape[1]} != {ref.shape[1]} of {ref_path}")
            if w.dtype != ref.dtype:
                problems.append(f"{p}: weight dtype {w.dtype} != {ref.dtype} of {ref_path}")
            if w.device != ref.device:
                problems.append(f"{p}: weight device {w.device} != {ref.device} of {ref_path}")
    return problems


def fuse_linears(linears: list[nn.Linear], *, names: list[str]) -> None:
    """Make ``linears`` (called one after another on the same input tensor) share one GEMM; see the module
    docstring. ``names``: their module paths, used in errors and in :class:`FusedGroup`. Raises ``ValueError``
    listing every problem (see :func:`fused_qkv_problems`) and changes nothing if the group cannot be fused."""
    linears, names = list(linears), list(names)
    if len(names) != len(linears):
        raise ValueError(f"fuse_linears: {len(linears)} linears but {len(names)} names")
    problems = fused_qkv_problems("", list(zip(names, linears)))
    if problems:
        raise ValueError("cannot fuse these linears into one GEMM:\n  " + "\n  ".join(problems))
    group = FusedGroup(linears, names)
    for i, module in enumerate(linears):
        module.forward = _MemberForward(group, i)


def fused_group(module: nn.Module) -> FusedGroup | None:
    """The group ``module`` belongs to, or None if it is not fused."""
    installed = module.__dict__.get("forward")
    return installed.group if isinstance(installed, _MemberForward) else None


def unfuse_linears(linears) -> None:
    """Undo :func:`fuse_linears` for the groups of ``linears`` (every member of each group)."""
    for module in list(linears):
        group = fused_group(module)
        if group is None:
            continue
        group._release()
        for member in group.modules:
            if isinstance(member.__dict__.get("forward"), _MemberForward):
                del member.__dict__["forward"]


__all__ = ["FusedGroup", "fuse_linears", "fused_group", "fused_qkv_problems", "unfuse_linears"]
