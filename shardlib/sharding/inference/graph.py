"""The exported graph of an analysis twin and the walks the plan inference makes over it.

``torch.export`` (non-strict: the model's Python runs as is, on fake tensors) gives the ATen graph of one forward
and backward-free training step; every node carries ``nn_module_stack``, the modules it ran inside. A node is named
here by the module that ran it (the innermost entry): ``aten.linear`` inside ``...attention.self.query`` is that
linear's call, ``aten.scaled_dot_product_attention`` inside ``...attention.self`` is that block's attention.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from ...parallel.layers import is_conv1d
from ..plan import PlanError

aten = torch.ops.aten

#: ops that move or relabel values without mixing features: a walk from an attention input back to its projection
#: (or from its output on to the output projection) passes them. mul/add/cat/neg/slice cover rotary embeddings,
#: expand/reshape grouped-KV repetition, split/getitem a fused projection's parts.
SHAPE_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.contiguous.default, aten.clone.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.default, aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.detach.default,
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.add.Tensor, aten.sub.Tensor,
    aten.neg.default, aten.cat.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.chunk.default, aten.unbind.int, aten.type_as.default, aten.to.dtype_layout, aten.to.device,
}
#: element-wise ops: a region of them between a column- and a row-parallel linear keeps features apart
ELEMENTWISE_OPS = {
    aten.gelu.default, aten.relu.default, aten.silu.default, aten.tanh.default, aten.sigmoid.default,
    aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.div.Tensor,
    aten.div.Scalar, aten.pow.Tensor_Scalar, aten.dropout.default, aten.to.dtype, aten._to_copy.default,
    aten.erf.default, aten.neg.default, aten.clone.default, aten.contiguous.default, aten.rsub.Scalar,
    aten.clamp.default, aten.maximum.default, aten.minimum.default, aten.square.default, aten.hardtanh.default,
    aten.leaky_relu.default, aten.elu.default, aten.mish.default, aten.softplus.default, aten.alias.default,
    aten.detach.default, aten.type_as.default, aten.masked_fill.Scalar, aten.masked_fill_.Scalar,
    aten.masked_fill.Tensor, aten.where.self, aten.where.ScalarOther,
}
#: checks export leaves in the graph (a dtype assertion before a cast): users that compute nothing
CHECK_OPS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}
ATTENTION_OPS = {aten.scaled_dot_product_attention.default}
SOFTMAX_OPS = {aten._softmax.default, aten.softmax.int}
MATMUL_OPS = {aten.matmul.default, aten.bmm.default}
SPLIT_OPS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}


class ExportError(PlanError):
    """The analysis twin could not be exported; the message names the module that raised."""


@dataclass
class Graph:
    """An exported forward: its nodes, and for each the module that ran it."""

    graph: fx.Graph
    modules: dict[str, nn.Module]
    names: dict[fx.Node, str] = field(default_factory=dict)

    def __post_init__(self):
        for node in self.graph.nodes:
            stack = node.meta.get("nn_module_stack") or {}
            self.names[node] = _clean(list(stack.values())[-1][0]) if stack else ""
        self._fold_conv1d_calls()

    def _fold_conv1d_calls(self) -> None:
        """transformers' ``Conv1D`` (GPT-2) runs ``view -> addmm -> view``: each such call becomes one
        ``aten.linear`` node of that module (its weight argument stays the ``[in, out]`` parameter; the analysis
        reads activations only), so that every site walk sees it as the linear it is."""
        flatten = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target is not aten.addmm.default \
                    or not is_conv1d(self.modules.get(self.names[node])):
                continue
            bias, flat, weight = node.args[:3]
            users = list(node.users)
            if getattr(flat, "target", None) not in flatten or len(users) != 1 or users[0].target not in flatten:
                continue
            (out,) = users
            with self.graph.inserting_after(out):
                linear = self.graph.call_function(aten.linear.default, (flat.args[0], weight, bias))
            linear.meta = dict(out.meta)
            self.names[linear] = self.names[node]
            out.replace_all_uses_with(linear)
            for dead in (out, node, flat):
                if not dead.users:
                    self.graph.erase_node(dead)
                    del self.names[dead]

    def module_of(self, node: fx.Node) -> str:
        return self.names.get(node, "")

    def calls(self, ops) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "call_function" and n.target in ops]

    def linear_calls(self) -> list[fx.Node]:
        """``aten.linear`` nodes run by an ``nn.Linear`` or ``Conv1D`` module (a functional linear elsewhere is not a
        module's)."""
        return [n for n in self.calls({aten.linear.default})
                if isinstance(m := self.modules.get(self.module_of(n)), nn.Linear) or is_conv1d(m)]

    def embedding_calls(self) -> list[fx.Node]:
        return [n for n in self.calls({aten.embedding.default})
                if isinstance(self.modules.get(self.module_of(n)), nn.Embedding)]


def out_features(module: nn.Module) -> int:
    """The output width of a Linear or of transformers' Conv1D (``nf``)."""
    return module.nf if is_conv1d(module) else module.out_features


def _clean(path: str) -> str:
    """nn_module_stack paths as module paths (``L['self'].bert.encoder`` or ``bert.encoder`` -> ``bert.encoder``)."""
    for prefix in ("L['self'].", "L['fn'].", "self."):
        path = path.removeprefix(prefix)
    return "" if path in ("L['self']", "self") else path


def op_name(node: fx.Node) -> str:
    """``view`` for ``aten.view.default``, ``getitem`` for ``operator.getitem``."""
    text = str(node.target)
    return text.split(".")[1] if text.startswith("aten.") else getattr(node.target, "__name__", text)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def shape(node: fx.Node) -> tuple[int, ...]:
    value = node.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def users_through(start: fx.Node, through):
    """Yield ``(node, user)`` for every use reached from ``start``, going on past a user only when
    ``through(user)``."""
    todo, seen = [start], set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            yield node, user
            if through(user):
                todo.append(user)


def inputs_through(start: fx.Node, through):
    """Yield every node ``start`` is computed from, going on past a node only when ``through(node)`` (a getitem
    goes on to the tuple it picks from)."""
    todo, seen = [start], set()
    while todo:
        node = todo.pop()
        if node in seen or not isinstance(node, fx.Node):
            continue
        seen.add(node)
        yield node
        if through(node):
            todo += [node.args[0]] if _is_getitem(node) else tensor_args(node)


def _shape_op(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in SHAPE_OPS or _is_getitem(node))


def back_to_linears(g: Graph, start: fx.Node, linears: set[fx.Node]) -> tuple[set[fx.Node], list[fx.Node]]:
    """The linear calls ``start`` is computed from through :data:`SHAPE_OPS` only, and the shape ops passed."""
    reached = list(inputs_through(start, lambda n: n not in linears and _shape_op(n)))
    return {n for n in reached if n in linears}, [n for n in reached if n not in linears and _shape_op(n)]


def on_to_linears(g: Graph, start: fx.Node, linears: set[fx.Node]) -> set[fx.Node]:
    """The linear calls that take ``start`` (through :data:`SHAPE_OPS` only) as their input."""
    return {user for node, user in users_through(start, lambda u: u not in linears and _shape_op(u))
            if user in linears and user.args[0] is node}


def _is_getitem(node: fx.Node) -> bool:
    import operator

    return node.op == "call_function" and node.target is operator.getitem


def export_twin(model: nn.Module, inputs: dict) -> Graph:
    """``torch.export`` (non-strict) of ``model`` on ``inputs``; an error names the module that raised."""
    stack: list[str] = []
    names = {id(m): name for name, m in model.named_modules()}

    def enter(module, args):
        stack.append(names.get(id(module), type(module).__name__))

    def leave(module, args, out):
        if stack:
            stack.pop()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave, always_call=True) for m in model.modules()]
    kwargs = dict(inputs)
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False
    unlabelled = {k: v for k, v in kwargs.items() if k not in LABELS}
    try:
        program = _export(model, kwargs, stack)
    except ExportError as first:
        if unlabelled == kwargs:
            raise
        try:  # a loss with data-dependent control flow (DeBERTa's): the plan does not need the loss's ops
            program = _export(model, unlabelled, stack)
        except ExportError:
            raise first from None
    finally:
        for h in handles:
            h.remove()
    return Graph(program.graph, dict(model.named_modules()))


#: the forward arguments that only feed a loss
LABELS = ("labels", "start_positions", "end_positions", "next_sentence_label")


def _export(model: nn.Module, kwargs: dict, stack: list[str]):
    stack.clear()
    try:
        return torch.export.export(model, args=(), kwargs=kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - reported with the module that raised, and what to do
        where = stack[-1] if stack else "(before any module)"
        raise ExportError(f"{type(model).__name__} does not export (torch.export, non-strict), so its plan cannot "
                          f"be inferred: {type(exc).__name__} in module {where!r}: {str(exc).splitlines()[0]}. "
                          "Write a policy for it (docs/policy-authoring.md).") from exc


__all__ = ["Graph", "ExportError", "export_twin", "out_features", "op_name", "back_to_linears", "on_to_linears", "users_through",
           "inputs_through", "tensor_args", "shape",
           "SHAPE_OPS", "ELEMENTWISE_OPS", "CHECK_OPS", "ATTENTION_OPS", "SOFTMAX_OPS", "MATMUL_OPS", "SPLIT_OPS"]
