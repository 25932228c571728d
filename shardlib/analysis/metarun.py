"""Running a model without ranks or memory: built on the meta device from its config, fed a batch of its task,
its collectives recorded by module. What :func:`shardlib.plan` (:mod:`shardlib.analysis.dryrun`) is made of; usable for
tracing or exporting a sharded model under :func:`shardlib.parallel.mesh.fake_world` too.
"""

from __future__ import annotations

import contextlib
import inspect
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..sharding.examples import PlanInputError, example_batch, task_of  # noqa: F401 (re-exported)
from ..sharding.sharded import shard_state
from . import meta_kernels
from .dryrun_report import Collective, TensorSpec
from .meta_experts import meta_op


# ------------------------------------------------------------------------------------------------- recording
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")
_SAME_AS = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather_into_tensor",
            "_reduce_scatter_base_": "reduce_scatter_tensor", "alltoall_base_": "all_to_all_single",
            "send": "send_recv"}  # a point-to-point pair is recorded once, at its send (what the profile prices)
_RECEIVES = ("recv_", "recv_any_source_")  # the other half of a pair: not recorded
_INPUT_ARGS = ("input", "input_tensor", "input_tensors", "inputs", "tensors")  # what this rank puts in
_GROUP_ARGS = ("group_name", "process_group")
_IS_COLLECTIVE: dict = {}  # op overload -> whether it is a collective (looked up once: every op of a run passes)


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective dispatched inside the block as a :class:`Collective` in ``records``: c10d's ops
    (eager ``dist.*``) and the functional ones, named as torch's functional collectives (what the project's
    ``CollectiveCounter`` counts), with the path in ``model`` of the innermost module it belongs to.

    Forward: the module running (global module hooks keep the stack). Backward: the module whose forward created
    the autograd node running it: each module call spans a range of autograd sequence numbers (read from a probe
    node at entry and exit), the innermost range holding the node's number wins; a gradient hook on a parameter
    belongs to the module holding the parameter. (torch's ModTracker tells backward modules apart by gradient
    hooks on module inputs and outputs, which keeps a T5 layer "running" until the position bias it shares with
    the other layers has its whole gradient, so the collectives of later layers land in it.)

    Point-to-point transfers (ring attention's K/V blocks) are recorded at their send as ``send_recv``.

    ``dims``: process-group name -> (mesh dim, size). ``phase``: None (forward / backward as they happen) or the
    phase to record instead ("step"). ``remember``: answer repeated calls on meta tensors from
    :mod:`~shardlib.analysis.meta_kernels` (the recorder being the last mode before the kernels: a dry run's).

    A mode of its own (``with recorder:``), or, inside :meth:`watching` (the module hooks alone), the kernel another
    mode calls (:meth:`dispatch`; the dry run's :class:`~shardlib.analysis.counting.WorkRecorder`): one mode per op
    instead of two."""

    def __init__(self, model: nn.Module, dims: dict[str, tuple[str, int]], remember: bool = False):
        super().__init__()
        self.dims, self.phase, self.records = dims, None, []
        self.kernel = meta_kernels.run if remember and meta_kernels.enabled() else None
        self.paths: dict[nn.Module, list[str]] = {}
        self.owner: dict[int, str] = {}  # id(parameter) -> path of the (first) module holding it
        for path, module in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(module, []).append(path)
            for p in module._parameters.values():
                if p is not None:
                    self.owner.setdefault(id(p), path)
        self.stack: list[tuple[str, int | None]] = [("", None)]  # (path, first sequence number) of running modules
        self.spans: list[tuple[int, int, str]] = []  # (first, last sequence number, path) of finished module calls
        self._probe = torch.empty(0, device="meta", requires_grad=True)
        self._found: dict[int, str] = {}  # sequence number -> module path, in backward (spans are final by then)

    def __enter__(self):
        self._watching = self.watching()
        self._watching.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._watching.__exit__(*exc)

    @contextlib.contextmanager
    def watching(self):
        """The module hooks that follow which module runs, without the dispatch mode."""
        hooks = [register_module_forward_pre_hook(self._enter),
                 register_module_forward_hook(self._leave, always_call=True)]
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()

    def _sequence_nr(self) -> int | None:
        node = self._probe.view(0).grad_fn  # None where grad mode is off
        return None if node is None else node._sequence_nr()

    def _enter(self, module, args) -> None:
        top = self.stack[-1][0]
        paths = self.paths.get(module, [top])  # a module outside the model (a stage's stand-in) counts as its caller
        path = next((p for p in paths if not top or p.startswith(top + ".")), paths[0])  # a shared module: by caller
        self.stack.append((path, self._sequence_nr()))

    def _leave(self, module, args, output) -> None:
        path, first = self.stack.pop()
        last = self._sequence_nr()
        if first is not None and last is not None:
            self.spans.append((first, last, path))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.dispatch(func, args, kwargs or {})

    def dispatch(self, func, args, kwargs):
        """Record ``func`` if it is a collective, then run it (module docstring)."""
        collective = _IS_COLLECTIVE.get(func)
        if collective is None:
            collective = _IS_COLLECTIVE[func] = func.namespace in _NAMESPACES and func._opname not in _NOT_COLLECTIVES
        if collective and func._opname not in _RECEIVES:
            self.records.append(self._describe(func, args, kwargs))
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return _meta_value(args[0])
        substitute = meta_op(func, args, kwargs)  # ops of mixture-of-experts layers the meta device lacks
        if substitute is not None:
            return substitute
        return func(*args, **kwargs) if self.kernel is None else self.kernel(func, args, kwargs)

    def _describe(self, func, args, kwargs) -> Collective:
        named = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
        sent = next((named[n] for n in _INPUT_ARGS if n in named), ())
        nbytes = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(sent) if torch.is_tensor(t))
        group = next(named[n] for n in _GROUP_ARGS if n in named)
        name = group if isinstance(group, str) else dist.ProcessGroup.unbox(group).group_name
        dim, size = self.dims.get(name) or ("?", dist.distributed_c10d._resolve_process_group(name).size())
        node = torch._C._current_autograd_node()
        phase = self.phase or ("forward" if node is None else "backward")
        module = self.stack[-1][0] if phase == "forward" or node is None else self._backward_module(node)
        return Collective(_SAME_AS.get(func._opname, func._opname), dim, size, nbytes, phase, module)

    def module_now(self) -> str:
        """The path of the module the op running now belongs to (forward: the innermost running; backward: the
        one whose forward created the autograd node running)."""
        node = torch._C._current_autograd_node()
        return self.stack[-1][0] if node is None else self._backward_module(node)

    def _backward_module(self, node) -> str:
        variable = getattr(node, "variable", None)  # AccumulateGrad: a hook on a parameter's gradient
        if variable is not None:
            return self.owner.get(id(variable), "")
        seq = node._sequence_nr()
        found = self._found.get(seq)
        if found is None:
            best = (-1, "")
            for first, last, path in self.spans:
                if first <= seq <= last and first > best[0]:
                    best = (first, path)
            found = self._found[seq] = best[1]
        return found


def _meta_value(t: torch.Tensor) -> bool:
    """What a model reading a meta tensor's value (``.item()``, ``if t.all():``) gets: True for a boolean, as an
    unpadded, unpacked training batch answers transformers' checks (``attention_mask.all()``: no padding; no packed
    sequences), so the dry run follows that path. Any other value is refused: the dry run cannot know it."""
    if t.dtype == torch.bool:
        return True
    raise PlanInputError(f"the model's forward reads the value of a {t.dtype} tensor of shape {tuple(t.shape)} "
                         "(.item() or a Python condition on a tensor): the dry run runs on the meta device, where "
                         "values do not exist")


def group_dims(mesh, ulysses: int = 1) -> dict[str, tuple[str, int]]:
    """Process-group name -> (mesh dim, size) for the mesh's dims of more than one rank, and the world; under Ulysses
    x ring (``ulysses`` > 1) the sp dimension's two parts too, each on the dim "sp" at its own size (the
    all-to-all's group of ``ulysses`` ranks, the ring's of sp / ulysses)."""
    dims = {dist.group.WORLD.group_name: ("world", dist.get_world_size())}
    for dim in ("dp", "pp", "sp", "tp"):
        if mesh.size(dim) > 1:
            dims[mesh.group(dim).group_name] = (dim, mesh.size(dim))
    if ulysses > 1:
        inner, ring = mesh.split_sp(ulysses)
        dims |= {inner.group_name: ("sp", ulysses), ring.group_name: ("sp", mesh.sp // ulysses)}
    return dims


def tensor_spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size(),
                      t.requires_grad)


# ------------------------------------------------------------------------------------------------ the model
def _config(source):
    """A transformers config from a config object, a model directory or a config.json file."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    path = os.fspath(source)
    if not os.path.exists(path):
        raise PlanInputError(f"{path}: no such file or directory")
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:  # json errors are ValueErrors
        raise PlanInputError(f"{path}: cannot read a model config ({' '.join(str(exc).split())})") from None


def _model_class(config, cls):
    if cls is None:
        names = getattr(config, "architectures", None) or []
        if not names:
            raise PlanInputError(f"the {type(config).__name__} names no model class (architectures): pass the class "
                                 "(cls= / --class)")
        cls = names[0]
    if isinstance(cls, str):
        import transformers

        found = getattr(transformers, cls, None)
        if not (isinstance(found, type) and issubclass(found, nn.Module)):
            raise PlanInputError(f"transformers has no model class {cls!r}")
        cls = found
    return cls


def meta_model(model_or_config, cls=None, dtype=None) -> nn.Module:
    """The unsharded model on the meta device, in training mode: built from the config of ``model_or_config`` (a
    model, a config, a model directory or a config.json file), of class ``cls`` (a class or its name in
    transformers; default: the model's class or the config's ``architectures[0]``) and ``dtype`` (default: the
    model's, else torch's default dtype)."""
    if isinstance(model_or_config, nn.Module):
        if shard_state(model_or_config, required=False) is not None:
            raise PlanInputError(f"this {type(model_or_config).__name__} is sharded already: plan its config")
        config, cls = model_or_config.config, cls or type(model_or_config)
        dtype = dtype or next(model_or_config.parameters()).dtype
    else:
        config = _config(model_or_config)
    cls = _model_class(config, cls)
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:  # noqa: BLE001 - any failure of HF's constructor is bad input here
        raise PlanInputError(f"cannot build {cls.__name__} from a {type(config).__name__}: "
                             f"{' '.join(str(exc).split())}") from None
    if dtype is not None:
        model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return model.train()


def planned_policy(model: nn.Module, policy=None):
    """The policy ``shard()`` would use for ``model`` (:func:`shardlib.sharding.sharder.resolve_policy`: the registered
    one, else the plan inferred from its graph), its refusal a :class:`PlanInputError` in ``shard()``'s words."""
    from ..sharding.plan import PlanError
    from ..sharding.sharder import resolve_policy

    try:
        return resolve_policy(model, policy)
    except PlanError as exc:
        raise PlanInputError(str(exc)) from None
