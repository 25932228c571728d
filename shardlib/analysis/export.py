"""``torch.export`` of a sharded model's forward, and the collectives in the exported fx graph.

:func:`export` is a thin wrapper over :func:`torch.export.export` (non-strict by default) for a model sharded by
:func:`shardlib.shard`. Tracing runs the model's forward on fake tensors; ``torch.compiler.is_compiling()`` is
True meanwhile, so every shardlib collective is captured as a *functional* collective node
(``torch.ops._c10d_functional.all_reduce`` and friends, each followed by ``wait_tensor``) in the exported
program's ``graph_module``, an ordinary ``torch.fx.GraphModule`` that tools can walk. No data moves while
exporting, so a process can export as rank ``r`` of a world of ``N`` without the other ranks::

    with shardlib.parallel.mesh.fake_world(2, rank=0):
        model = shardlib.shard(model, shardlib.init_mesh(tp=2)).eval()
        ep = shardlib.export.export(model, kwargs=batch)
        shardlib.export.collective_counts(ep)      # {'all_reduce': 5, 'all_gather_into_tensor': 1}

:func:`collective_nodes` lists the collective nodes with the module they come from (``nn_module_stack``) and their
message sizes (``meta["val"]``); :func:`collective_counts` counts them by op (or any other key).

A forward that cannot be traced (a hook that branches on a tensor's value, ``.numpy()``, ...) raises
:class:`ExportError` naming the module whose call failed (and the hook, when it was one) with the original reason
chained. A model split into pipeline stages (mesh ``pp > 1``) is refused: a stage's forward takes the activations
of the stage before it, which the model's forward signature does not describe.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
import torch.fx.experimental.proxy_tensor  # noqa: F401  (_AttrProxy, see _called_module)
from torch import nn
from torch.nn.modules import module as module_py

from ..sharding.sharded import shard_state

#: op namespaces whose ops are collectives. ``c10d`` holds the in-place (non-functional) ops, which an export
#: should not contain: they are listed with ``functional=False`` so a walk shows them rather than missing them.
FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
INPLACE_NAMESPACE = "c10d"
WAIT = "wait_tensor"
_NOT_NODES = ("_wrap_tensor_autograd",)  # bookkeeping ops of the functional namespace, not communication
#: the in-place c10d ops under the name of their functional counterpart (as tests/rank_tasks.CollectiveCounter)
_SAME_AS = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather_into_tensor",
            "_reduce_scatter_base_": "reduce_scatter_tensor", "alltoall_base_": "all_to_all_single"}


class ExportError(RuntimeError):
    """An export that failed or was refused. ``module``: the path of the module whose call failed ("" for the
    root, None when no module was running); ``reason``: the original error in one line (chained as
    ``__cause__``)."""

    def __init__(self, message: str, *, module: str | None = None, reason: str = ""):
        super().__init__(message)
        self.module, self.reason = module, reason


@dataclass(frozen=True)
class CollectiveNode:
    """One collective (or ``wait_tensor``) node of an exported graph.

    ``op``: the op name (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
    ``all_to_all_single``, ``wait_tensor``, ...). ``module`` / ``module_type``: the innermost module that was
    running when the node was traced ("" is the root model). ``group``: the process group's name.
    ``shape`` / ``dtype`` / ``bytes``: of the node's result (all-reduce: the message; all-gather: the gathered
    tensor, group size x each rank's part; reduce-scatter: this rank's part); ``input_bytes``: of its input. Byte
    counts are None for symbolic (dynamic) shapes. ``functional``: False for an in-place c10d op.
    """

    name: str
    op: str
    module: str | None
    module_type: str | None
    group: str | None
    reduce_op: str | None
    shape: tuple | None
    dtype: torch.dtype | None
    bytes: int | None
    input_bytes: int | None
    functional: bool
    node: fx.Node

    @property
    def is_wait(self) -> bool:
        return self.op == WAIT


# ------------------------------------------------------------------------------------------------------ export
def export(model: nn.Module, args: tuple = (), kwargs: dict | None = None, *, strict: bool = False,
           dynamic_shapes=None) -> torch.export.ExportedProgram:
    """``torch.export.export(model, args, kwargs, strict=strict, dynamic_shapes=dynamic_shapes)`` for a sharded
    (or plain) model, on a real rank or under :func:`shardlib.parallel.mesh.fake_world`.

    Call ``model.eval()`` first for an inference graph. HF models that return a KV cache object (T5) need
    ``use_cache=False`` in ``kwargs``: the cache is not a pytree. Raises :class:`ExportError` for a model split into
    pipeline stages and for a forward that cannot be traced (naming the module, see the module docstring).
    """
    _refuse_pipeline(model)
    try:
        return torch.export.export(model, tuple(args), kwargs, strict=strict, dynamic_shapes=dynamic_shapes)
    except Exception as exc:  # noqa: BLE001 - every tracing failure is reported with the module that raised it
        raise _export_error(model, exc) from exc


def _refuse_pipeline(model: nn.Module) -> None:
    state = shard_state(model, required=False)
    if state is not None and state.pipeline is not None:
        mesh = state.mesh
        raise ExportError(
            f"cannot export {type(model).__name__}: it is split into pipeline stages (pp={mesh.pp}) and this rank "
            "holds only some of its layers, whose inputs are the previous stage's activations; export a model "
            "sharded on a mesh with pp=1 (tensor and sequence parallelism are supported)")


# --------------------------------------------------------------------------------------- naming a failed module
_HINTS = (
    ("data-dependent", "the forward branches on (or sizes by) a tensor's value (.item(), bool(tensor), .tolist(), "
                       "nonzero()); move that code out of the exported forward or express it with torch.cond"),
    ("data pointer", "the code reads a tensor's storage (data_ptr, .numpy()), which fake tensors do not have; skip "
                     "it while torch.compiler.is_compiling()"),
    (".numpy()", "the code converts a tensor to numpy, which fake tensors cannot; skip it while "
                 "torch.compiler.is_compiling()"),
    ("not a known type", "the forward returns an object that is not a pytree (an HF cache): pass use_cache=False"),
)


@dataclass(frozen=True)
class _Failure:
    """Where tracing failed: the module's path in the model, the module, and what of its call raised."""

    path: str
    module: nn.Module
    inside: str | None  # "its forward hook 'name' (file:line in name)", or a location, or None


def _export_error(model: nn.Module, exc: BaseException) -> ExportError:
    reason = _one_line(exc)
    failure = _failed_call(model, exc) or _failed_hook_in_user_stack(model, exc)
    message = f"cannot export {type(model).__name__}"
    if failure is None:
        message += f": {reason}"
    else:
        shown = repr(failure.path) if failure.path else "(the root model)"
        message += f": module {shown} ({type(failure.module).__name__}) cannot be traced"
        message += f", in {failure.inside}: {reason}" if failure.inside else f": {reason}"
    raised_at = _deepest_user_location(exc)
    if raised_at is not None:
        message += f"\n  raised at {raised_at}"
    hint = next((h for key, h in _HINTS if key in str(exc)), None)
    if hint:
        message += f"\n  hint: {hint}"
    return ExportError(message, module=None if failure is None else failure.path, reason=reason)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    first = first if len(first) <= limit else first[:limit] + "..."
    return f"{type(exc).__name__}: {first}"


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (or while handling), outermost first."""
    chain: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in chain):
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _frames(exc: BaseException) -> list[types.FrameType]:
    """The traceback frames (outermost first) of the exception in ``exc``'s chain that ran module calls, else of
    ``exc`` itself."""
    by_exception = []
    for e in _chain(exc):
        frames, tb = [], e.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        by_exception.append(frames)
    return next((f for f in by_exception if any(map(_is_module_call, f))), by_exception[0])


def _is_module_call(frame: types.FrameType) -> bool:
    return frame.f_code is nn.Module._call_impl.__code__ and isinstance(frame.f_locals.get("self"), nn.Module)


def _called_module(frame: types.FrameType) -> nn.Module:
    """The module of a ``Module._call_impl`` frame. Non-strict export calls submodules through proxies that track
    their path (``_AttrProxy``, a subclass sharing the module's ``__dict__``): those are unwrapped."""
    module = frame.f_locals["self"]
    proxy_type = getattr(torch.fx.experimental.proxy_tensor, "_AttrProxy", None)
    return module.get_base() if proxy_type is not None and isinstance(module, proxy_type) else module


def _path_in(root: nn.Module, module: nn.Module) -> str | None:
    return next((p for p, m in root.named_modules() if m is module), None)


def _failed_call(model: nn.Module, exc: BaseException) -> _Failure | None:
    """The innermost module of ``model`` whose call (forward or hooks) raised, from the live traceback frames of
    ``Module._call_impl`` (non-strict export runs the real Python code). The path follows the call chain, so a
    module registered under two names (a shared embedding) is named by the parent that called it."""
    frames = _frames(exc)
    calls = [(i, _called_module(f)) for i, f in enumerate(frames) if _is_module_call(f)]
    start = next((k for k, (_, m) in enumerate(calls) if m is model), None)
    if start is None:
        return None
    path, parent, index = "", model, calls[start][0]
    for i, module in calls[start + 1:]:
        relative = _path_in(parent, module)
        if relative is not None:
            path = f"{path}.{relative}" if path else relative
        else:  # called by a module that does not contain it: its own path in the model, if it has one
            absolute = _path_in(model, module)
            if absolute is None:
                break
            path = absolute
        parent, index = module, i
    inside = next((f for f in frames[index + 1:] if f.f_code.co_filename != module_py.__file__), None)
    return _Failure(path, parent, None if inside is None else _describe_frame(parent, inside))


def _failed_hook_in_user_stack(model: nn.Module, exc: BaseException) -> _Failure | None:
    """Strict export (dynamo) leaves no live frames, only the user stack it traced (``real_stack``): name the
    module whose hook is the innermost user function, when exactly one module has that hook."""
    stack = next((e.real_stack for e in _chain(exc) if getattr(e, "real_stack", None)), None)
    if not stack:
        return None
    last = stack[-1]
    owners = [(path, m, kind) for path, m in model.named_modules()
              for code, kind in _hook_kinds(m, global_hooks=False).items()
              if code.co_filename == last.filename and code.co_name == last.name]
    if len(owners) != 1:
        return None
    path, module, kind = owners[0]
    return _Failure(path, module, f"its {kind} {last.name!r} ({_short_path(last.filename)}:{last.lineno})")


def _hook_kinds(module: nn.Module, *, global_hooks: bool = True) -> dict:
    """code object -> 'forward hook' / 'forward pre-hook' for the hooks of ``module`` (and the global ones)."""
    tables = [("forward pre-hook", module._forward_pre_hooks), ("forward hook", module._forward_hooks)]
    if global_hooks:
        tables += [("forward pre-hook", module_py._global_forward_pre_hooks),
                   ("forward hook", module_py._global_forward_hooks)]
    kinds = {}
    for kind, hooks in tables:
        for hook in hooks.values():
            function = getattr(hook, "__func__", getattr(hook, "func", hook))  # bound method, partial
            code = getattr(function, "__code__", None)
            if code is not None:
                kinds[code] = kind
    return kinds


def _describe_frame(module: nn.Module, frame: types.FrameType) -> str:
    kind = _hook_kinds(module).get(frame.f_code)
    if kind is None:
        return _frame_location(frame)
    return f"its {kind} {frame.f_code.co_name!r} ({_frame_location(frame)})"


def _frame_location(frame: types.FrameType) -> str:
    return f"{_short_path(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _short_path(filename: str) -> str:
    marker = "site-packages" + os.sep
    if marker in filename:
        return filename.split(marker, 1)[1]
    return os.path.relpath(filename) if filename.startswith(os.getcwd() + os.sep) else filename


def _deepest_user_location(exc: BaseException) -> str | None:
    """The innermost line of the failure outside torch, below :func:`export` (the code that could not be traced):
    from the user stack strict export traced, else from the live frames."""
    stack = next((e.real_stack for e in _chain(exc) if getattr(e, "real_stack", None)), None)
    if stack:
        return f"{_short_path(stack[-1].filename)}:{stack[-1].lineno} in {stack[-1].name}"
    frames = _frames(exc)
    below = max((i for i, f in enumerate(frames) if f.f_code is export.__code__), default=-1)
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    user = [f for f in frames[below + 1:]
            if not f.f_code.co_filename.startswith((torch_dir, "<"))]  # "<string>": code torch generated
    return _frame_location(user[-1]) if user else None


# ------------------------------------------------------------------------------------------- walking the graph
def _graph_module(obj) -> fx.GraphModule:
    if isinstance(obj, torch.export.ExportedProgram):
        return obj.graph_module
    if isinstance(obj, fx.GraphModule):
        return obj
    raise TypeError(f"expected a torch.export.ExportedProgram or a torch.fx.GraphModule, got {type(obj).__name__}")


def _walk(gm: fx.GraphModule):
    """Every node of ``gm`` in graph order, descending into the subgraphs of higher-order ops where they are called
    (strict export puts the body of an autograd Function in ``wrap_with_set_grad_enabled`` subgraphs)."""
    for node in gm.graph.nodes:
        yield node
        if node.op != "call_function":
            continue
        for arg in node.args:
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                sub = getattr(gm, arg.target, None)
                if isinstance(sub, fx.GraphModule):
                    yield from _walk(sub)


def _op_of(node: fx.Node) -> tuple[str, bool] | None:
    """(op name, functional) of a collective node, else None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    namespace, name = target.namespace, target._schema.name.split("::")[-1]
    if namespace in FUNCTIONAL_NAMESPACES and name not in _NOT_NODES:
        return name, True
    if namespace == INPLACE_NAMESPACE:
        return _SAME_AS.get(name, name), False
    return None


def _tensor_bytes(value) -> int | None:
    if isinstance(value, (list, tuple)):
        parts = [_tensor_bytes(v) for v in value]
        return None if not parts or any(p is None for p in parts) else sum(parts)
    if not isinstance(value, torch.Tensor):
        return None
    numel = value.numel()
    return int(numel) * value.element_size() if isinstance(numel, int) else None


def _innermost_module(node: fx.Node) -> tuple[str | None, str | None]:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None, None
    path, module_type = list(stack.values())[-1]
    for prefix in ("_export_root.", "L['self']."):
        path = path[len(prefix):] if path.startswith(prefix) else path
    path = "" if path in ("_export_root", "L['self']") else path
    name = module_type if isinstance(module_type, str) else f"{module_type.__module__}.{module_type.__qualname__}"
    return path, name


def _collective(node: fx.Node, op: str, functional: bool) -> CollectiveNode:
    bound = dict(zip((a.name for a in node.target._schema.arguments), node.args)) | dict(node.kwargs)
    val = node.meta.get("val")
    first = node.args[0] if node.args else None
    module, module_type = _innermost_module(node)
    group = bound.get("group_name", bound.get("tag"))
    return CollectiveNode(
        name=node.name, op=op, module=module, module_type=module_type,
        group=None if group is None else str(group), reduce_op=bound.get("reduce_op"),
        shape=tuple(val.shape) if isinstance(val, torch.Tensor) else None,
        dtype=val.dtype if isinstance(val, torch.Tensor) else None, bytes=_tensor_bytes(val),
        input_bytes=_tensor_bytes(first.meta.get("val")) if isinstance(first, fx.Node) else None,
        functional=functional, node=node)


def collective_nodes(exported, *, waits: bool = True) -> list[CollectiveNode]:
    """The collective nodes of an exported program (or fx GraphModule) in graph order, with ``wait_tensor`` nodes
    unless ``waits=False``. Each shardlib collective appears as the collective and two waits (funcol waits once
    when traced, shardlib once more; the second wait of a waited tensor is a no-op)."""
    found = []
    for node in _walk(_graph_module(exported)):
        kind = _op_of(node)
        if kind is not None and (waits or kind[0] != WAIT):
            found.append(_collective(node, *kind))
    return found


def collective_counts(exported, *, by: Callable[[CollectiveNode], str | None] | None = None,
                      waits: bool = False) -> dict[str, int]:
    """How many collectives the graph holds, by op name (``{"all_reduce": 5, ...}``) or by ``by(node)``, e.g.
    ``by=lambda c: f"{c.module}: {c.op}"``; nodes for which ``by`` returns None are skipped. ``wait_tensor`` nodes
    are not counted unless ``waits=True``."""
    key = by or (lambda c: c.op)
    counts: dict[str, int] = {}
    for collective in collective_nodes(exported, waits=waits):
        name = key(collective)
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
    return counts


__all__ = ["export", "collective_nodes", "collective_counts", "CollectiveNode", "ExportError"]
