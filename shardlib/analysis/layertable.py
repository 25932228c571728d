"""What each module of a model costs under one tensor / sequence-parallel layout, counted once on a shallow copy
of the model, and the plan reports of every pipeline split and microbatch size assembled from it: the cache that
lets the layout search (:mod:`shardlib.analysis.search`) price hundreds of layouts in seconds.

A :class:`LayerTable` is built for one (tp, sp, sequence-parallel mode, activation checkpointing). It dry-runs
(:func:`shardlib.analysis.dryrun._plan_stage`, the code :func:`shardlib.plan` runs) the model with at most two
layers per stack, unpipelined, at two microbatch sizes, and keeps per *root* (a trunk layer, or a module
outside the trunk as the pipeline splitter names them: embeddings, heads) its GEMMs, memory traffic, saved bytes,
collectives, parameters and the tensors its forward takes. Every count is affine in the microbatch size (exact for
these models: the position bias of T5 is the only term that does not scale, and it is the constant), so two sizes
give all. Layer ``i`` of a stack costs what layer ``min(i, 1)`` of the shallow copy does: the first layer of a stack
may differ (T5's holds the relative position bias), the others are alike.

:meth:`LayerTable.report` assembles the :class:`PlanReport` of a layout from the table: the stages of the full
model as the pipeline splitter cuts them, each the sum of its roots. Exact where nothing depends on the cut (the
parameter, gradient, optimizer and ZeRO bytes, GEMMs, traffic, collectives and saved activations per stage);
estimated where it does: a stage's transient peak (the last stage's is the shallow run's, which the head and loss
make; another stage's, its largest layer's saved bytes, without checkpointing: what a recompute re-materializes,
and checkpointed the partial gradients held beside that recompute: ``_stage_params``),
the tensors sent between stages (the next stage's first
layer's inputs) and the tied-weight sums (one all-reduce of each weight shared across stages). tests/test_search.py
compares both with :func:`shardlib.plan`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from ..pipeline.stages import _held, stage_plan
from .dryrun import _plan_stage, _zero, late_gradient_bytes
from .dryrun_report import (
    Collective, LayerCollectives, LayerWork, MemoryCounts, MoELayer, PlanReport, StageInfo, TensorSpec,
)
from .metarun import example_batch
from .counting import ModuleWork

DEPTH_FIELDS = ("num_hidden_layers", "num_layers", "num_decoder_layers", "n_layer", "n_layers", "encoder_layers",
                "decoder_layers")
SHALLOW = 2  # layers per stack in the shallow copy
#: the microbatch sizes the shallow copy runs at. Sums (bytes saved, FLOPs, traffic, collectives) are affine in the
#: microbatch, so any two sizes give them exactly; the transient peak is a maximum of such terms, which a constant
#: one (a position bias, a mask) can lead at tiny sizes: sizes of the order a run uses keep the per-token terms
#: (logits, the loss) in the lead, as in the run. Meta tensors cost the same at any size.
BATCHES = (4, 16)


@dataclass
class Root:
    """One root of the shallow model at one microbatch size (module docstring)."""

    work: ModuleWork = field(default_factory=ModuleWork)
    ring: ModuleWork = field(default_factory=ModuleWork)  # the part of ``work`` ring attention's blocks run
    collectives: list[Collective] = field(default_factory=list)
    inputs: list[TensorSpec] = field(default_factory=list)
    moe: list[MoELayer] = field(default_factory=list)  # its mixture-of-experts layers


@dataclass
class Param:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    late: bool
    state: tuple[int, int] | None  # AdamW bytes (shaped like it, other), None: no gradient, no state
    key: int  # the same for every alias of one tensor


def shallow_config(config):
    """A copy of ``config`` with at most :data:`SHALLOW` layers in every stack."""
    config = copy.deepcopy(config)
    for name in DEPTH_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > SHALLOW:
            setattr(config, name, SHALLOW)
    if getattr(config, "num_decoder_layers", 0) is None:  # T5: None means as many as num_layers
        config.num_decoder_layers = config.num_layers
    return config


def _root_of(path: str, roots: list[str]) -> str:
    """The root holding module ``path`` (the longest prefix), "" for none (the model's own forward: the loss)."""
    best = ""
    for root in roots:
        if (path == root or path.startswith(root + ".")) and len(root) > len(best):
            best = root
    return best


def _param_bytes(p: Param) -> int:
    return torch.Size(p.shape).numel() * p.dtype.itemsize


def _shallow_path(path: str, depth: dict[str, int]) -> str:
    """A root of the full model as its root in the shallow copy (``stack.17`` -> ``stack.1``)."""
    stack, _, index = path.rpartition(".")
    if stack in depth and index.isdigit():
        return f"{stack}.{min(int(index), depth[stack] - 1)}"
    return path


def _affine(v1: float, v2: float, b: int) -> int:
    """The value at microbatch ``b`` of a count that is ``v1`` and ``v2`` at the table's two sizes."""
    (b1, b2) = BATCHES
    return max(0, int(round(v1 + (b - b1) * (v2 - v1) / (b2 - b1))))


def _gemms_at(g1: dict[int, int], g2: dict[int, int], b: int) -> list[tuple[int, int]]:
    """The GEMM calls at microbatch ``b`` from those at the two sizes, paired in order of size."""
    calls1 = sorted(f for f, n in g1.items() for _ in range(n))
    calls2 = sorted(f for f, n in g2.items() for _ in range(n))
    if len(calls1) != len(calls2):  # not the same calls: scale the larger microbatch's
        calls1, calls2 = [f * BATCHES[0] // BATCHES[1] for f in calls2], calls2
    found: dict[int, int] = {}
    for f1, f2 in zip(calls1, calls2):
        f = _affine(f1, f2, b)
        found[f] = found.get(f, 0) + 1
    return sorted(found.items())


def _collectives_at(c1: list[Collective], c2: list[Collective], b: int) -> list[Collective]:
    if len(c1) != len(c2):
        c1 = [Collective(c.op, c.dim, c.group_size, c.bytes * BATCHES[0] // BATCHES[1], c.phase, c.module)
              for c in c2]
    return [Collective(y.op, y.dim, y.group_size, _affine(x.bytes, y.bytes, b), y.phase, y.module)
            for x, y in zip(c1, c2)]


def _tensor_specs(args, kwargs) -> list[TensorSpec]:
    seen, specs = set(), []
    for t in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
            seen.add(t.untyped_storage()._cdata)
            specs.append(TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                    t.numel() * t.element_size(), t.requires_grad))
    return specs


class _Run:
    """The shallow model dry-run at one microbatch size: its roots, parameters and memory counts."""

    def __init__(self, base: nn.Module, policy, trunk, sizes: dict, mode, checkpointing: bool, batch: int,
                 seq: int, stepped: "_Run | None" = None, precision: str = "fp32", device_type: str = "cpu",
                 ulysses: int = 1):
        model = copy.deepcopy(base)
        self.roots = list(stage_plan(model, trunk, 1).modules[0])
        self.by_root: dict[str, Root] = {r: Root() for r in [*self.roots, ""]}
        hooks = [model.get_submodule(r).register_forward_pre_hook(self._inputs(r), with_kwargs=True)
                 for r in self.roots if r in dict(model.named_modules())]
        keep: dict = {}
        inputs = example_batch(model, batch, seq)
        with torch.random.fork_rng(devices=[]):
            options = dict(policy=policy, sequence_parallel=mode) | ({"ulysses": ulysses} if ulysses > 1 else {})
            info, _, self.sharding = _plan_stage(model, 0, sizes, options, inputs, (), checkpointing, keep,
                                                 optimizer=batch == BATCHES[0] and stepped is None,
                                                 precision=precision, device_type=device_type)
        for h in hooks:
            h.remove()
        self.inputs, self.memory = inputs, info.memory
        self.parameter_bytes = info.parameter_bytes
        for path, work in keep["work"].items():
            root = self.by_root[_root_of(path, self.roots)]
            root.work.add(work)
            if path in keep["ring"]:
                root.ring.add(work)
        for entry in info.collectives:
            for c in entry.collectives:
                self.by_root[_root_of(c.module, self.roots)].collectives.append(c)
        for layer in info.moe:
            self.by_root[_root_of(layer.path, self.roots)].moe.append(layer)
        late, state = keep["late"], keep["state"]
        self.params = {root: [Param(name, tuple(t.shape), t.dtype, t.requires_grad, id(t) in late, state.get(id(t)),
                                    id(t)) for name, t in _held(model, root) if isinstance(t, nn.Parameter)]
                       for root in self.roots}
        if stepped is not None:
            self.adopt(stepped)

    def adopt(self, stepped: "_Run") -> None:
        """Take the AdamW step of the same parameters from another table's run (``stepped``), which counted it."""
        self.params = stepped.params
        self.memory = dataclasses.replace(self.memory, optimizer_peak_bytes=stepped.memory.optimizer_peak_bytes,
                                          optimizer_traffic=stepped.memory.optimizer_traffic)

    def _inputs(self, root: str):
        def hook(module, args, kwargs):
            if not self.by_root[root].inputs:  # the first call (activation checkpointing calls again in backward)
                self.by_root[root].inputs = _tensor_specs(args, kwargs)

        return hook


class LayerTable:
    """The costs of every root of ``full`` (the unsharded model on the meta device) under one tensor / sequence
    parallel layout (module docstring). ``mode``: :func:`shardlib.shard`'s ``sequence_parallel`` (``ulysses``: its
    Ulysses x ring, :func:`shardlib.shard`'s argument). ``like``: a table of the same model and tp, sp and mode
    (another checkpointing, another Ulysses group): its AdamW counts, pipeline cuts and ZeRO bytes are reused, not
    counted again. ``runs``: the table's dry runs, made elsewhere (a worker process of the search: a
    :class:`LayerTable` of the same arguments without ``like``), instead of running them here."""

    def __init__(self, full: nn.Module, policy, *, tp: int, sp: int, mode, mode_name: str,
                 activation_checkpointing: bool, seq: int, like: "LayerTable | None" = None,
                 precision: str = "fp32", device_type: str = "cpu", plain: "LayerTable | None" = None,
                 ulysses: int = 1, runs: "list[_Run] | None" = None):
        from .metarun import meta_model

        #: under activation checkpointing, the same mesh's table without it: a checkpointed layer's backward first
        #: re-materializes what that table's layer saves (a non-last stage's transient)
        self.plain = plain
        self.full, self.policy, self.mode_name = full, policy, mode_name
        self.checkpointing, self.seq = activation_checkpointing, seq
        self.precision, self.device_type, self.ulysses = precision, device_type, ulysses
        self.trunk = policy.plan(full, tp).trunk
        dtype = next(full.parameters()).dtype
        base = meta_model(shallow_config(full.config), type(full), dtype)
        shallow_trunk = policy.plan(base, tp).trunk
        self.depth = {s.layers: len(base.get_submodule(s.layers)._modules) for s in shallow_trunk}
        sizes = dict(dp=1, pp=1, sp=sp, tp=tp)
        stepped = like.runs[0] if like is not None else None
        if runs is None:
            runs = [_Run(base, policy, shallow_trunk, sizes, mode, activation_checkpointing, b, seq,
                         stepped if b == BATCHES[0] else None, precision, device_type, ulysses) for b in BATCHES]
        elif stepped is not None:  # as a run made here with ``like`` would have it
            runs[0].adopt(stepped)
        self.runs = runs
        self._plans: dict[int, object] = like._plans if like is not None else {}  # pipeline cuts: by pp only
        #: (pp, dp, stage) -> _stage_states: of the parameters, which a table shares with its ``like``
        self._states: dict[tuple, dict] = like._states if like is not None else {}
        self._at: dict[tuple[str, int], tuple] = {}  # (shallow root, microbatch) -> _root_at's counts
        self._order = {name: i for i, (name, _) in enumerate(full.named_parameters())}  # registration order

    def stage_plan(self, pp: int):
        if pp not in self._plans:
            self._plans[pp] = stage_plan(self.full, self.trunk, pp)
        return self._plans[pp]

    def report(self, layout) -> PlanReport:
        """The plan report of ``layout`` (its tp, sp and mode must be the table's) from the table."""
        plan = self.stage_plan(layout.pp)
        owners: dict[tuple, set[int]] = {}
        for i, roots in enumerate(plan.modules):
            for root in roots:
                for p in self._params(root):
                    owners.setdefault(self._key(root, p), set()).add(i)
        stages = [self._stage(i, plan, layout, owners) for i in range(layout.pp)]
        b = layout.batch
        inputs = {k: TensorSpec((b, *t.shape[1:]), str(t.dtype).removeprefix("torch."),
                                t.numel() * t.element_size() // t.shape[0] * b, False)
                  for k, t in example_batch(self.full, b, self.seq).items()}
        return PlanReport(model_class=type(self.full).__name__, policy=self.policy.name,
                          mesh={"dp": layout.dp, "pp": layout.pp, "sp": layout.sp, "tp": layout.tp}
                          | ({"ulysses": self.ulysses} if self.ulysses > 1 else {}),
                          sequence_parallel=self.mode_name, microbatches=layout.microbatches, inputs=inputs,
                          sharding=self.runs[1].sharding, stages=stages, activation_checkpointing=self.checkpointing,
                          precision=self.precision, device_type=self.device_type)

    def _params(self, root: str) -> list[Param]:
        return self.runs[0].params.get(_shallow_path(root, self.depth), [])

    def _key(self, root: str, p: Param) -> tuple:
        """One key per tensor of the full model: layer ``i`` has tensors of its own, though it maps to a shallow
        layer another maps to too."""
        return (root if root.rpartition(".")[0] in self.depth else "", p.key)

    def _root_at(self, root: str, b: int) -> tuple[LayerWork, list[Collective], list[TensorSpec]]:
        """The work, collectives and forward inputs of a root of the full model at microbatch ``b`` (new lists each
        call; their counts computed once per root of the shallow copy and microbatch)."""
        shallow = _shallow_path(root, self.depth)
        found = self._at.get((shallow, b))
        if found is None:
            one, two = (run.by_root[shallow] for run in self.runs)
            work = (_gemms_at(one.work.gemms, two.work.gemms, b), _affine(one.work.traffic, two.work.traffic, b),
                    _affine(one.work.saved, two.work.saved, b), two.work.ops,
                    _gemms_at(one.ring.gemms, two.ring.gemms, b))
            found = self._at[shallow, b] = (
                work,
                _collectives_at(one.collectives, two.collectives, b),
                [TensorSpec(y.shape, y.dtype, _affine(x.bytes, y.bytes, b), y.requires_grad)
                 for x, y in zip(one.inputs, two.inputs)])
        (gemms, traffic, saved, ops, ring), collectives, inputs = found
        return LayerWork(root, list(gemms), traffic, saved, ops, list(ring)), list(collectives), list(inputs)

    def _moe_at(self, root: str, b: int) -> list[MoELayer]:
        """The mixture-of-experts layers of a root of the full model at microbatch ``b``."""
        shallow = _shallow_path(root, self.depth)
        one, two = (run.by_root[shallow].moe for run in self.runs)
        return [dataclasses.replace(y, path=root + y.path[len(shallow):], tokens=_affine(x.tokens, y.tokens, b),
                                    saved=_affine(x.saved, y.saved, b)) for x, y in zip(one, two)]

    def _stage(self, index: int, plan, layout, owners: dict[tuple, set[int]]) -> StageInfo:
        b, last = layout.batch, index == layout.pp - 1
        roots = list(plan.modules[index]) + ([""] if last else [])
        layers = list(plan.layers[index])
        outside = LayerWork("", [], 0, 0, 0)
        work, collectives = [], []
        for root in roots:
            w, c, _ = self._root_at(root, b)
            if root in layers:
                work.append(w)
                collectives.append(LayerCollectives(root, c))
            else:
                outside.gemms += w.gemms
                outside.traffic += w.traffic
                outside.saved += w.saved
                outside.ops += w.ops
                outside.ring += w.ring
                collectives.append(LayerCollectives("", c))
        work.append(outside)
        merged = [c for entry in collectives if not entry.layer for c in entry.collectives]
        collectives = [e for e in collectives if e.layer] + ([LayerCollectives("", merged)] if merged else [])
        key = (layout.pp, layout.dp, index)
        if key not in self._states:  # what does not depend on the microbatch
            params, step, beside_recompute = self._stage_params(index, plan, owners)
            self._states[key] = (self._stage_states(layout, params, step), beside_recompute)
        states, beside_recompute = self._states[key]
        info = self._stage_info(index, plan, layout, layers, work, collectives, states, beside_recompute)
        info.moe = [m for root in roots for m in self._moe_at(root, b)]
        return info

    def _stage_params(self, index: int, plan, owners) -> tuple[dict[tuple, Param], list[Collective], int]:
        """The stage's tensors (one per key, in order), the sums of those tied to other stages, and the gradient
        bytes a checkpointed backward holds beside a layer's recompute: the largest gradient of a tensor two or more
        of its roots use (T5's embedding in the stage with the encoder's and the decoder's first layers) and two
        layers' sequence-parallel buckets."""
        found: dict[tuple, tuple[int, Param]] = {}
        uses: dict[tuple, int] = {}
        for root in plan.modules[index]:
            shallow = _shallow_path(root, self.depth)
            for p in self._params(root):
                full_name = root + p.name[len(shallow):]
                order = self._order.get(full_name, len(self._order))
                key = self._key(root, p)
                uses[key] = uses.get(key, 0) + 1
                if key not in found or order < found[key][0]:
                    found[key] = (order, p)
        params = {key: p for key, (_, p) in sorted(found.items(), key=lambda kv: kv[1][0])}  # the Trainer's order
        step = []
        for key, p in params.items():
            if len(owners[key]) > 1 and p.requires_grad:
                step.append(Collective("all_reduce", "pp", len(owners[key]), _param_bytes(p), "step", p.name))
        shared = max((_param_bytes(p) for key, p in params.items() if uses[key] > 1 and p.requires_grad), default=0)
        # a sequence-parallel bucket (shardlib.parallel.gradsync): a layer's partial gradients stashed while the one
        # before it is all-reduced from its flat copy
        bucketed = max((sum(_param_bytes(p) for p in self._params(root) if p.late and p.requires_grad)
                        for root in plan.layers[index]), default=0)
        return params, step, shared + 2 * bucketed

    def _stage_states(self, layout, params: dict[tuple, Param], step: list[Collective]) -> dict:
        """The stage's parameter, gradient, AdamW and ZeRO bytes and its tied-weight sums."""
        tied = {key for key in params if step and any(c.module == params[key].name for c in step)}
        tensors, state, late = [], {}, set()
        for key, p in params.items():
            t = torch.empty(p.shape, dtype=p.dtype, device="meta", requires_grad=p.requires_grad)
            tensors.append(t)
            if p.state is not None:
                state[id(t)] = p.state
            if p.late or key in tied:
                late.add(id(t))
        mesh = type("Mesh", (), {"dp": layout.dp, "pp": layout.pp})
        return dict(parameter_bytes=sum(t.numel() * t.element_size() for t in tensors),
                    gradient_bytes=sum(t.numel() * t.element_size() for t in tensors if t.requires_grad),
                    optimizer_bytes=sum(a + c for a, c in state.values()), zero=_zero(tensors, state, mesh, late),
                    step=step, late_gradient_bytes=late_gradient_bytes(tensors, late))

    def _stage_info(self, index, plan, layout, layers, work, collectives, states: dict,
                    beside_recompute: int) -> StageInfo:
        last = index == layout.pp - 1
        nbytes = states["parameter_bytes"]
        saved = sum(w.saved for w in work)
        if last:  # the transient of the head and the loss, as the shallow copy has it
            peak = saved + _affine(*(r.memory.peak_bytes - r.memory.activation_bytes for r in self.runs), layout.batch)
            with_gradients = peak + _affine(*(r.memory.peak_with_gradients - r.memory.peak_bytes for r in self.runs),
                                            layout.batch)
        else:  # a layer's backward: about its saved bytes again, as activation gradients; under checkpointing what
            # its recompute re-materializes (the layer's saved bytes without checkpointing). That recompute recurs
            # through the whole backward, so it meets the partial gradients held there (``_stage_params``; measured
            # on T5 stages); without checkpointing the peak is backward's start, before they exist
            source = self.plain or self
            largest = max((source._root_at(w.layer, layout.batch)[0].saved for w in work if w.layer), default=0)
            peak = with_gradients = saved + largest + (beside_recompute if self.checkpointing else 0)
        stepped = self.runs[0]  # the run that stepped AdamW: its temporaries and traffic scale with the parameters
        scale = nbytes / max(1, stepped.parameter_bytes)
        memory = MemoryCounts(saved, peak, with_gradients, int(stepped.memory.optimizer_peak_bytes * scale),
                              int(stepped.memory.optimizer_traffic * scale))
        sends = []
        if not last:
            _, _, sends = self._root_at(plan.layers[index + 1][0], layout.batch)
        return StageInfo(index=index, layers=layers, modules=list(plan.modules[index]), collectives=collectives,
                         sends=sends, work=work, memory=memory, **states)
