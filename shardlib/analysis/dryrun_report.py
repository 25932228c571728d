"""The report of a dry run (:func:`shardlib.plan`): plain dataclasses, JSON-able, rendered as text by ``str()``.

It is meant as the input of a layout search, so every number has one home: bytes per rank in each
:class:`StageInfo`, collectives per microbatch per trunk layer in ``StageInfo.collectives``, once-per-step
collectives in ``StageInfo.step``, boundary tensors in ``StageInfo.sends``, and per-step totals derived from them
(:meth:`PlanReport.totals`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field

from ..sharding.shard_report import ShardReport

PHASES = ("forward", "backward", "step")


# ------------------------------------------------------------------------------------------------- the report
@dataclass
class Collective:
    """One collective on one rank: ``op`` (torch's functional name: all_reduce, all_gather_into_tensor,
    reduce_scatter_tensor, all_to_all_single, ...), ``dim`` (the mesh dim of its group: dp / pp / sp / tp),
    ``group_size``, ``bytes`` this rank puts in (its input tensor), ``phase`` (forward / backward / step) and
    ``module``: the path of the innermost module running it ("" for the model itself)."""

    op: str
    dim: str
    group_size: int
    bytes: int
    phase: str
    module: str


@dataclass
class LayerCollectives:
    """The collectives of one trunk layer (``layer``: its path), or with ``layer == ""`` of everything a stage runs
    outside its layers (embeddings, heads, the loss), per microbatch."""

    layer: str
    collectives: list[Collective] = field(default_factory=list)


@dataclass
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    requires_grad: bool


@dataclass
class ZeroBytes:
    """Bytes per dp rank (index = dp rank) of one stage's ranks under ZeRO stage ``zero``."""

    zero: int
    parameters: list[int]
    gradients: list[int]
    optimizer: list[int]


@dataclass
class LayerWork:
    """The compute of one trunk layer (``layer``: its path; "" for the rest of the stage) in one microbatch,
    forward and backward: ``gemms`` (FLOPs of one matrix multiply or attention call, calls), ``traffic`` (bytes the
    other ops read and write), ``saved`` (bytes saved for backward), ``ops`` (every op run); ``ring``: the calls
    among ``gemms`` that ring attention's blocks run (``sequence_parallel="ring"``), the compute its K/V transfers
    overlap."""

    layer: str
    gemms: list[tuple[int, int]]
    traffic: int
    saved: int
    ops: int = 0
    ring: list[tuple[int, int]] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return sum(f * n for f, n in self.gemms)


@dataclass
class MemoryCounts:
    """What one microbatch adds on one rank of a stage, counted on the dry run (:mod:`shardlib.analysis.counting`):
    ``activation_bytes`` saved for backward at the end of its forward; ``peak_bytes``: the peak of the live bytes it
    creates over forward and backward, gradients left out, and ``peak_with_gradients`` with them (the gradients
    allocated so far); ``optimizer_peak_bytes`` / ``optimizer_traffic``: the temporaries and the memory traffic of
    one AdamW step of the stage's parameters (no ZeRO)."""

    activation_bytes: int
    peak_bytes: int
    peak_with_gradients: int
    optimizer_peak_bytes: int
    optimizer_traffic: int


@dataclass
class MoELayer:
    """One mixture-of-experts layer of a stage, as the dry run ran it (on the meta device, its tokens spread evenly
    over the experts: :mod:`shardlib.analysis.meta_experts`): ``path`` of its experts module, ``experts`` (E, the
    model's count), ``top_k`` experts per token, ``tokens`` entering it per microbatch on this rank, ``row_bytes`` of
    one token's hidden state (what expert parallelism exchanges), this rank's ``parameter_bytes`` and
    ``gradient_bytes`` of its experts, and ``saved``: the bytes its experts save for backward per microbatch."""

    path: str
    experts: int
    top_k: int
    tokens: int
    row_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    saved: int

    @property
    def pairs(self) -> int:
        """(token, expert) pairs per microbatch: the rows its experts compute."""
        return self.tokens * self.top_k


@dataclass
class StageInfo:
    """One pipeline stage (the whole model when pp = 1) and the bytes each of its ranks holds."""

    index: int
    layers: list[str]  # trunk layer paths, in forward order
    modules: list[str]  # every module path the stage runs (its layers, embeddings / norms / heads it owns)
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    zero: list[ZeroBytes] = field(default_factory=list)
    collectives: list[LayerCollectives] = field(default_factory=list)  # per microbatch, layers then ""
    step: list[Collective] = field(default_factory=list)  # once per step, after the last backward
    sends: list[TensorSpec] = field(default_factory=list)  # to the next stage, per microbatch
    work: list[LayerWork] = field(default_factory=list)  # per microbatch, layers then ""
    memory: MemoryCounts | None = None  # per microbatch
    late_gradient_bytes: int = 0  # gradients the Trainer reduces after backward (tied across stages, SP buckets)
    moe: list[MoELayer] = field(default_factory=list)  # its mixture-of-experts layers

    @property
    def send_bytes(self) -> tuple[int, int]:
        """(forward, backward) bytes across the boundary after this stage, per microbatch."""
        return (sum(t.bytes for t in self.sends), sum(t.bytes for t in self.sends if t.requires_grad))


@dataclass
class Total:
    """Per step on each rank of ``stage``: ``count`` collectives ``op`` on ``dim`` in ``phase``, ``bytes`` in all."""

    stage: int
    phase: str
    op: str
    dim: str
    count: int
    bytes: int


@dataclass
class PlanReport:
    """The dry run of one layout (module docstring). JSON-able: ``to_dict()`` / ``from_dict()``."""

    model_class: str
    policy: str
    mesh: dict[str, int]  # dp, pp, sp, tp; ulysses (> 1: Ulysses x ring over sp); ep (> 1: expert parallelism)
    sequence_parallel: str  # "off", "megatron", "all_to_all" or "ring"
    microbatches: int
    inputs: dict[str, TensorSpec]  # one microbatch of one dp rank
    sharding: ShardReport
    stages: list[StageInfo]
    activation_checkpointing: bool = False
    precision: str = "fp32"  # "bf16" / "fp16": the forward counted under autocast's casts (meta_autocast)
    device_type: str = "cpu"  # whose autocast lists: "cpu" or "cuda"

    @property
    def world_size(self) -> int:
        return self.mesh["dp"] * self.mesh["pp"] * self.mesh["sp"] * self.mesh["tp"]

    def totals(self) -> list[Total]:
        """Collectives per step by stage, phase, op and dim: microbatches x (forward + backward), then the step."""
        found: dict[tuple, list[int]] = {}
        for stage in self.stages:
            per_mb = [c for entry in stage.collectives for c in entry.collectives]
            for c, times in [(c, self.microbatches) for c in per_mb] + [(c, 1) for c in stage.step]:
                entry = found.setdefault((stage.index, PHASES.index(c.phase), c.op, c.dim), [0, 0])
                entry[0] += times
                entry[1] += times * c.bytes
        return [Total(s, PHASES[p], op, dim, n, b) for (s, p, op, dim), (n, b) in sorted(found.items())]

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for stage in data["stages"]:  # a dense model's stages as before MoE layers were recorded
            if not stage["moe"]:
                del stage["moe"]
        data["totals"] = [dataclasses.asdict(t) for t in self.totals()]  # derived, for readers of the JSON
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "PlanReport":
        return _build(cls, data)

    def __str__(self) -> str:
        return render(self)


def _build(hint, value):
    """``value`` (JSON data) as an instance of type ``hint``: dataclasses, lists, tuples, dicts, optionals."""
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: _build(hints[f.name], value[f.name]) for f in dataclasses.fields(hint)
                       if f.init and f.name in value})
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return [_build(args[0], v) for v in value]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        return tuple(_build(a, v) for a, v in zip(args, value))
    if origin is dict:
        return {k: _build(args[1], v) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        return None if value is None else _build(next(a for a in args if a is not type(None)), value)
    return value


# ------------------------------------------------------------------------------------------------------- text
def size_text(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches: ``1.50 MiB``, ``512 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _span(paths: list[str]) -> str:
    """Layer paths as ranges per stack: ``encoder.block.0..13, decoder.block.0..2``."""
    groups: list[tuple[str, list[str]]] = []
    for path in paths:
        stack, _, key = path.rpartition(".")
        if groups and groups[-1][0] == stack:
            groups[-1][1].append(key)
        else:
            groups.append((stack, [key]))
    return ", ".join(f"{s}.{k[0]}" + (f"..{k[-1]}" if len(k) > 1 else "") for s, k in groups) or "-"


def _shape(spec: TensorSpec) -> str:
    return "x".join(map(str, spec.shape)) or "scalar"


def _header(r: PlanReport) -> list[str]:
    m = r.mesh
    inputs = ", ".join(f"{name} {_shape(t)} {t.dtype}" for name, t in r.inputs.items())
    ulysses = m.get("ulysses", 1)
    return [f"shardlib plan: {r.model_class} with policy '{r.policy}' on dp={m['dp']} x pp={m['pp']} x sp={m['sp']}"
            f" x tp={m['tp']} ({r.world_size} ranks)" + (f", ep={m['ep']} within dp" if m.get("ep", 1) > 1 else "")
            + f", sequence parallel: {r.sequence_parallel}"
            + (f" (Ulysses x ring: {ulysses} ranks per position x {m['sp'] // ulysses} ring positions)"
               if ulysses > 1 else ""),
            f"one microbatch per dp rank: {inputs}; {r.microbatches} microbatch(es) per step", ""]


def _stage_lines(r: PlanReport) -> list[str]:
    lines = [f"bytes per rank (unsharded parameters {size_text(r.sharding.unsharded_bytes)}):",
             f"  {'stage':<6} {'parameters':>12} {'gradients':>12} {'AdamW state':>12}  layers"]
    for s in r.stages:
        extra = [m or "(the model)" for m in s.modules if m not in s.layers]
        lines.append(f"  {s.index:<6} {size_text(s.parameter_bytes):>12} {size_text(s.gradient_bytes):>12} "
                     f"{size_text(s.optimizer_bytes):>12}  {' + '.join([_span(s.layers)] + extra)}")
        for z in s.zero:
            lines.append(f"  {'zero-' + str(z.zero):<6} {size_text(max(z.parameters)):>12} "
                         f"{size_text(max(z.gradients)):>12} {size_text(max(z.optimizer)):>12}  (largest dp rank)")
    sends = [s for s in r.stages if s.sends]
    if sends:
        lines += ["", "pipeline boundaries (per microbatch):"]
    for s in sends:
        fwd, bwd = s.send_bytes
        tensors = ", ".join(f"{_shape(t)} {t.dtype}" for t in s.sends)
        lines.append(f"  stage {s.index} -> {s.index + 1}: {tensors}; forward {size_text(fwd)}, "
                     f"backward {size_text(bwd)}")
    return lines


def _signature(entry: LayerCollectives) -> tuple:
    cut = len(entry.layer) + 1 if entry.layer else 0
    return tuple((c.phase, c.op, c.dim, c.bytes, c.module[cut:]) for c in entry.collectives)


def _layer_lines(r: PlanReport) -> list[str]:
    lines = ["", "collectives per microbatch (bytes this rank sends in), by layer:"]
    for s in r.stages:
        groups: list[tuple[tuple, str, list[str]]] = []  # (signature, stack, layers)
        for entry in s.collectives:
            sig, stack = _signature(entry), entry.layer.rpartition(".")[0]
            if groups and entry.layer and groups[-1][:2] == (sig, stack):
                groups[-1][2].append(entry.layer)
            else:
                groups.append((sig, stack, [entry.layer]))
        for sig, _, layers in groups:
            where = f"{_span(layers)}" + (", each" if len(layers) > 1 else "") if layers[0] else "outside the layers"
            lines.append(f"  stage {s.index}, {where}:" + ("" if sig else " none"))
            itself = "(the layer)" if layers[0] else "(the model)"
            lines += [f"      {phase:<9} {op:<24} {dim:<3} {size_text(n):>11}  {module or itself}"
                      for phase, op, dim, n, module in sig]
    return lines


def _total_lines(r: PlanReport) -> list[str]:
    lines = ["", f"collectives per step, per rank ({r.microbatches} microbatch(es)):",
             f"  {'stage':<6} {'phase':<9} {'op':<24} {'dim':<4} {'count':>6} {'bytes':>11}"]
    lines += [f"  {t.stage:<6} {t.phase:<9} {t.op:<24} {t.dim:<4} {t.count:>6} {size_text(t.bytes):>11}"
              for t in r.totals()]
    return lines


def _in_layer(path: str, layers: set[str]) -> tuple[str, str]:
    """(trunk layer, path inside it) of a module path, or ("", path) outside the layers."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in layers:
            return ".".join(parts[:i]), ".".join(parts[i:])
    return "", path


def _rewrite_lines(r: PlanReport) -> list[str]:
    """The sharder's rewrites, those of identical consecutive layers once (``layer.0..23, each``)."""
    layers = {layer for s in r.stages for layer in s.layers}
    items = [(row.module, row.style, [f"{n:<7} {_dims(g):>14} {_dims(loc):>14}" for n, g, loc, _ in row.tensors])
             for row in r.sharding.rows]
    items += [(module, f"attribute {attr}", [f"{before} -> {after}"])
              for module, attr, before, after in r.sharding.attributes]
    blocks: list[list] = []  # [layer, [(path inside, style, tensor lines)], [layers]]
    for path, style, tensors in items:
        layer, inner = _in_layer(path, layers)
        if blocks and layer and blocks[-1][0] == layer:
            blocks[-1][1].append((inner, style, tensors))
        else:
            blocks.append([layer, [(inner, style, tensors)], [layer]])
    merged: list[list] = []
    for block in blocks:
        prev = merged[-1] if merged else None
        if prev and block[0] and prev[0] and prev[1] == block[1] and \
                prev[0].rpartition(".")[0] == block[0].rpartition(".")[0]:
            prev[2].append(block[0])
        else:
            merged.append(block)
    lines = ["rewrites (global and local shapes of each tensor, on every rank):"]
    for layer, entries, span in merged:
        indent = "  "
        if layer:
            lines.append(f"  {_span(span)}" + (", each:" if len(span) > 1 else ":"))
            indent = "    "
        for inner, style, tensors in entries:
            for i, text in enumerate(tensors or [""]):
                head = f"{indent}{inner:<{54 - len(indent)}} {style:<44}" if i == 0 else " " * 99
                lines.append((head + " " + text).rstrip())
    lines += [f"  kernel {kind} on {count} modules" for kind, count in r.sharding.kernels]
    return lines + [""]


def _dims(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def render(r: PlanReport) -> str:
    return "\n".join(_header(r) + _rewrite_lines(r) + _stage_lines(r) + _layer_lines(r) + _total_lines(r))
