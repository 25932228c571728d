"""``shardlib.plan`` / ``shardlib plan``: what a layout costs on every rank, without starting any ranks.

The model is built on the meta device from its config and sharded by :func:`shardlib.shard` inside
:func:`shardlib.parallel.mesh.fake_world` (torch's fake process group: collectives return at once), so the numbers come
from the code a real rank runs, not from a model of it:

* rewrites: the :class:`~shardlib.sharding.shard_report.ShardReport` of the sharded model (pipeline rank 0's; the
  rewrites are the same on every rank);
* bytes per rank of each pipeline stage (every dp, sp and tp rank of a stage holds as many: tp shards are padded
  to equal shapes): parameters (``ShardReport.local_bytes``), gradients (the parameters requiring grad), AdamW
  state (``torch.optim.AdamW`` stepped once on the meta gradients of the Trainer's parameter list: exp_avg,
  exp_avg_sq and the step tensor of every parameter that got a gradient, as a real step allocates them); with
  dp > 1 also under ZeRO 1 and 2 (the Trainer's flat buckets, an exact 1/dp of every bucket's elements per rank;
  zero-2 gradients: the rank's gradient shards, which persist over the step) and 3
  (FSDP2's local shards: dim 0 of every tensor cut like ``torch.chunk``; computed from that rule, not run);
* collectives: one forward and backward of a generated batch (meta tensors, :func:`~shardlib.analysis.metarun.
  example_batch`) per pipeline stage, each stage on its own rank's sharded model, run by its
  :class:`~shardlib.pipeline.StageModule` as in a real step (the previous stage's outputs as its inputs, meta
  gradients for its outputs): exact per stage, and no stage is inferred from another. Every collective is
  recorded with its op, mesh dim, and the bytes this rank puts in, and attributed to the innermost module whose
  forward ran it or created the autograd node whose backward runs it
  (:class:`~shardlib.analysis.metarun.CollectiveRecorder`), hence to a trunk layer. Then the step's collectives run the
  same way: the pipeline's tied-gradient sum and the Trainer's dp all-reduce of the gradients (``all_reduce_flat``,
  without ZeRO, in 25 MiB buckets; where the Trainer uses torch's DDP the same bytes go in DDP's buckets, during
  backward); the Trainer's scalar all-reduces (loss, item counts, used flags) are left out;
* pipeline boundaries: the tensors a stage sends on per microbatch (forward) and the gradients it gets back.

Under sequence parallelism a real backward all-gathers each saved sequence again (Megatron; all-to-all exchanges
its saved attention output again, ``SequenceParallel.saving_shards``); those are matched by storage identity, which
meta tensors have too, so the dry run records them as a real run does (tests/test_plan.py compares them). Ring
attention's K/V blocks travel by point-to-point sends (recorded as ``send_recv``, one per block and hop; the
ring's kernel runs on meta tensors as on a CPU); the work of its blocks is kept apart per layer
(``LayerWork.ring``), the compute its transfers run under.

When torch.distributed is already initialized (a real run), ``fake_world`` cannot be used in this process and the
dry run is done by ``python -m shardlib.cli plan ... --json`` in a subprocess, rebuilt from its JSON.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..kernels import ring_geometry
from ..kernels.ring_attention import CONTEXT_ATTR as RING_CONTEXT
from ..parallel.collectives import all_reduce_flat
from ..parallel.flat import DEFAULT_BUCKET_BYTES, flat_buckets
from ..parallel.gradsync import late_gradients
from ..parallel.mesh import fake_world, init_mesh
from ..sharding.plan import PlanError
from ..sharding.sequence import ALL_TO_ALL, MEGATRON, RING, SP_MODES  # shard(sequence_parallel=...)'s modes
from ..sharding.sharded import shard_state
from ..sharding.sharder import shard
from .counting import KernelsAsOn, WorkRecorder, by_layer, storage_key
from .expert_cost import expert_parallel_report
from .meta_experts import install as balanced_experts, moe_layers
from .meta_autocast import autocast_on_meta
from .dryrun_report import (  # noqa: F401  (the report's types, importable from here)
    Collective, LayerCollectives, LayerWork, MemoryCounts, PlanReport, StageInfo, TensorSpec, Total, ZeroBytes,
)
from .metarun import (
    CollectiveRecorder, PlanInputError, example_batch, group_dims, meta_model, planned_policy, tensor_spec,
)


# ------------------------------------------------------------------------------------------- running a stage
def _objective(out) -> torch.Tensor:
    """What backward starts from: the model's loss, else the sum of its first output (a Trainer ``loss_fn``)."""
    if not torch.is_tensor(out):
        out = out["loss"] if out.get("loss") is not None else out[0]
    return out if out.dim() == 0 else out.float().sum()


def _forward_backward(model: nn.Module, inputs: dict, received: tuple, before_backward=lambda: None,
                      forward_context=contextlib.nullcontext) -> tuple:
    """One microbatch through this rank's stage (the whole model when pp = 1), forward and backward as a training
    step runs it (:class:`~shardlib.pipeline.StageModule` with the runner's arguments; meta gradients for what the
    stage sends); ``before_backward()`` is called between them; the forward (and the loss) runs inside
    ``forward_context()`` (the Trainer's autocast). Returns the tensors the stage sends on (none from the last
    stage)."""
    split = shard_state(model).pipeline
    if split is None:
        with forward_context():
            loss = _objective(model(**inputs))
        before_backward()
        loss.backward()
        return ()
    stage = split.stage_modules[0]
    if stage.index == 0:
        stage.input_name = next(iter(inputs))
        received = (inputs[stage.input_name],)
    with forward_context():
        out = stage(*received, **inputs)
        loss = _objective(out[0]) if stage.route.is_last else None
    if stage.route.is_last:
        before_backward()
        loss.backward()
        return ()
    before_backward()
    needs = [t for t in out if t.requires_grad]
    torch.autograd.backward(needs, [torch.empty_like(t) for t in needs])
    return out


def _device_view(precision: str, device_type: str):
    """A context factory: a forward on the meta device as it runs on ``device_type`` at ``precision`` (its attention
    kernel, :class:`~.counting.KernelsAsOn`, and autocast's casts, :mod:`.meta_autocast`)."""

    @contextlib.contextmanager
    def view():
        with KernelsAsOn(device_type), autocast_on_meta(precision, device_type):
            yield

    return view


def _checkpointing(model: nn.Module, forward_context) -> None:
    """The Trainer's activation checkpointing on this (meta, own) model, without transformers' notices about it.
    The recompute runs in backward, where torch.utils.checkpoint re-enters the forward's autocast: here
    ``forward_context()`` (:func:`_device_view`) is entered around it."""
    from ..sharding.recompute import rng_safe_checkpointing

    model.config.use_cache = False  # what transformers would set, saying so
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated name the Trainer calls
        rng_safe_checkpointing(model, forward_context)


#: the parameters' signature (:func:`_adamw_state`) -> (AdamW state bytes of each parameter or None, the second
#: step's peak and traffic): the step depends on nothing else, and tables of one tp share it
_ADAMW: dict[tuple, tuple[list, int, int]] = {}


def _adamw_state(params: list[nn.Parameter]) -> tuple[dict[int, tuple[int, int]], int, int]:
    """id(parameter) -> bytes of its AdamW state after one step (only parameters with a gradient get state), as
    (tensors shaped like the parameter: exp_avg and exp_avg_sq, the others: the step); and the second step's peak
    (its temporaries) and memory traffic (the first also allocates the state). Counted once per signature of the
    parameters (shape, stride, dtype, device, gradient and shared storage of each, in order)."""
    storages: dict[int, int] = {}
    signature = tuple((tuple(p.shape), p.stride(), p.dtype, p.device, p.requires_grad, p.grad is not None,
                       storages.setdefault(storage_key(p), len(storages))) for p in params)
    if signature not in _ADAMW:
        optimizer = torch.optim.AdamW(params, foreach=True)  # the default on CPU and CUDA with every tensor alike
        optimizer.step()
        recorder = WorkRecorder(nn.ParameterList(params), lambda: "")
        with recorder:
            optimizer.step()
        per_parameter = []
        for p in params:
            tensors = [t for t in optimizer.state[p].values() if torch.is_tensor(t)] if p in optimizer.state else None
            shaped = _nbytes(t for t in tensors if t.shape == p.shape) if tensors is not None else 0
            per_parameter.append((shaped, _nbytes(tensors) - shaped) if tensors is not None else None)
        _ADAMW[signature] = (per_parameter, recorder.peaks([])[0], sum(w.traffic for w in recorder.work.values()))
    per_parameter, peak, traffic = _ADAMW[signature]
    return {id(p): s for p, s in zip(params, per_parameter) if s is not None}, peak, traffic


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _fsdp_local(sized, dp: int) -> list[int]:
    """Of each ``(nbytes, p)`` of ``sized`` (bytes laid out like ``p``), what each dp rank holds under FSDP2, summed
    per rank: dim 0 cut like ``torch.chunk`` (``ceil(n / dp)`` rows per rank, the last ranks fewer or none; FSDP2 pads
    every rank's memory to the first's). The ranks before ``n // per`` hold ``per`` rows, the next the rest."""
    steps = [0] * (dp + 2)  # what each rank holds more than the one before it
    for nbytes, p in sized:
        n = p.shape[0] if p.dim() else 1
        per, row = -(-n // dp), nbytes // n
        full, rest = n // per, n % per
        steps[0] += per * row
        steps[full] += (rest - per) * row
        steps[full + 1] -= rest * row
    totals, held = [], 0
    for step in steps[:dp]:
        held += step
        totals.append(held)
    return totals


def _zero(params: list[nn.Parameter], state: dict[int, tuple[int, int]], mesh, late: set[int]) -> list[ZeroBytes]:
    """Bytes per dp rank under ZeRO 1 and 2 (the Trainer's flat buckets, :func:`shardlib.parallel.flat.flat_buckets`:
    each rank owns an exact 1/dp of every bucket's elements, and the AdamW state of those elements; zero-2
    gradients: the rank's shards of the buckets, which persist over the step) and, without a pipeline, 3 (FSDP2's
    local shards of parameters, gradients and AdamW state). ``late``: the parameters the Trainer buckets apart
    (:func:`shardlib.parallel.gradsync.late_gradients`)."""
    dp = mesh.dp
    if dp == 1:
        return []
    trainable = [p for p in params if p.requires_grad]
    ranks = range(dp)
    optimizer, gradients = [0] * dp, [0] * dp
    for bucket in flat_buckets(params, dp, DEFAULT_BUCKET_BYTES, late):
        for r in ranks:
            lo, hi = bucket.owned(r, dp)
            gradients[r] += (hi - lo) * bucket.params[0].element_size()
            for i, p in enumerate(bucket.params):
                a, b = bucket.span(i)
                overlap = min(b, hi) - max(a, lo)
                if overlap > 0 and id(p) in state:
                    shaped, other = state[id(p)]
                    optimizer[r] += shaped * overlap // p.numel() + other
    zero = [ZeroBytes(1, [_nbytes(params)] * dp, [_nbytes(trainable)] * dp, optimizer),
            ZeroBytes(2, [_nbytes(params)] * dp, gradients, optimizer)]
    stepped = [p for p in params if id(p) in state]
    other = sum(state[id(p)][1] for p in stepped)  # the step tensors: whole on every rank
    zero.append(ZeroBytes(  # under a pipeline: FSDP2 over the stage's parameters (shardlib.train.fsdp)
        3, _fsdp_local([(_nbytes([p]), p) for p in params], dp),
        _fsdp_local([(_nbytes([p]), p) for p in trainable], dp),
        [held + other for held in _fsdp_local([(state[id(p)][0], p) for p in stepped], dp)]))
    return zero


def late_gradient_bytes(params: list[nn.Parameter], late: set[int]) -> int:
    """The gradient bytes of the parameters among ``params`` whose ids are in ``late`` (StageInfo's field)."""
    return _nbytes(p for p in params if p.requires_grad and id(p) in late)


def _forget_ring_indices() -> None:
    """Empty the ring's caches of its zigzag index tensors (kept per length and ring size for the process), so that
    every dry run counts building them, whatever ran before it in the process: a dry run that found them built (an
    earlier table's) counted fewer ops and bytes, which made a layer table's two microbatch sizes disagree and the
    search's answers depend on its history."""
    for cached in (ring_geometry._zigzag, ring_geometry._inverse):
        cached.cache_clear()


def _stage_paths(model: nn.Module, index: int) -> tuple[list[str], list[str]]:
    """(trunk layers, module paths) of pipeline stage ``index``; without a pipeline, of the whole model."""
    from ..pipeline import stage_plan

    state = shard_state(model)
    if state.pipeline is not None:
        plan = state.pipeline.plan
    else:
        try:
            plan = stage_plan(model, state.plan.trunk, 1)
        except PlanError:  # no trunk: one stage of no layers
            return [], [""]
    return list(plan.layers[index]), list(plan.modules[index])


def ring_paths(model: nn.Module) -> set[str]:
    """The paths of the modules whose own ops are ring attention's blocks (self-attention under
    ``sequence_parallel="ring"``; cross-attention runs the inner implementation, under no transfer)."""
    contexts = {path: m.__dict__.get(RING_CONTEXT) for path, m in model.named_modules()}
    return {path for path, context in contexts.items() if context is not None and not context.cross}


def _layer_work(work: dict, layers: list[str], blocks: set[str]) -> list[LayerWork]:
    """Per trunk layer (then the rest of the stage) the work of ``work`` (module path -> ModuleWork), the GEMMs of
    ring attention's blocks (the modules ``blocks``) apart too."""
    ring = by_layer({path: w for path, w in work.items() if path in blocks}, layers)
    return [LayerWork(layer, sorted(w.gemms.items()), w.traffic, w.saved, w.ops, sorted(ring[layer].gemms.items()))
            for layer, w in by_layer(work, layers).items()]


def _by_layer(records: list[Collective], layers: list[str]) -> list[LayerCollectives]:
    """Per-microbatch collectives by trunk layer (the layer whose path prefixes the module), then the rest."""
    entries = {layer: LayerCollectives(layer) for layer in layers}
    outside = LayerCollectives("")
    for c in records:
        layer = next((la for la in layers if c.module == la or c.module.startswith(la + ".")), None)
        (entries[layer] if layer is not None else outside).collectives.append(c)
    return list(entries.values()) + ([outside] if outside.collectives else [])


def _plan_stage(model, index: int, sizes: dict[str, int], shard_options: dict, inputs: dict, received: tuple,
                activation_checkpointing: bool = False, keep: dict | None = None, optimizer: bool = True,
                precision: str = "fp32", device_type: str = "cpu"):
    """Shard ``model`` as the ranks of pipeline stage ``index`` do (fake rank (dp, pp, sp, tp) = (0, index, 0, 0);
    under ring attention (0, index, sp - 1, 0): the zigzag layout gives every ring rank the same work, the last one
    holds the most padding), run one microbatch through it (counting its
    work and memory) and the step's collectives. Returns (StageInfo, sent tensors, ShardReport). ``keep``: a dict
    given the raw counts too (``work`` by module path, ``ring``: the paths of the modules running ring attention's
    blocks, ``params``, AdamW ``state`` by id, ``late`` ids), for :mod:`shardlib.analysis.layertable`;
    ``optimizer=False``: leave the AdamW step out (its counts are zeros; the layer table counts it once);
    ``precision`` and ``device_type``: the forward as it runs there (:func:`_device_view`)."""
    forward_context = _device_view(precision, device_type)
    dp, pp, sp, tp = (sizes[d] for d in ("dp", "pp", "sp", "tp"))
    ring = shard_options.get("sequence_parallel") == RING
    with fake_world(dp * pp * sp * tp, rank=(index * sp + (sp - 1 if ring else 0)) * tp):
        mesh = init_mesh(dp, pp, tp, sp=sp)
        # verify_plan=False: an inferred plan cannot be proven in a fake world (its collectives compute nothing);
        # the shard() of a real run proves it before anything changes
        shard(model, mesh, verify_plan=False, **shard_options)
        state = shard_state(model)
        params = state.pipeline.local_parameters() if state.pipeline else list(model.parameters())  # the Trainer's
        moe = balanced_experts(model, state.plan)  # its tokens spread evenly over each layer's experts
        if activation_checkpointing:
            _checkpointing(model, forward_context)
        recorder = CollectiveRecorder(model, group_dims(mesh, shard_options.get("ulysses", 1)), remember=True)
        work = WorkRecorder(model, recorder.module_now, kernel=recorder.dispatch)  # one dispatch mode: both record
        _forget_ring_indices()
        try:
            with recorder.watching(), work:
                sent = _forward_backward(model, inputs, received, lambda: setattr(work.saved, "counting", False),
                                         forward_context)
        except NotImplementedError as exc:  # an op that needs values (T5ForSequenceClassification counts EOS)
            raise PlanInputError(f"{type(model).__name__} cannot run on the meta device, so it cannot be planned: "
                                 f"{str(exc).splitlines()[0]}") from None
        except (AttributeError, ValueError, TypeError) as exc:  # the model's own forward refused its config
            raise PlanInputError(f"{type(model).__name__}'s forward failed on the planning batch (a config it "
                                 f"cannot run with?): {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        with recorder:  # the step's collectives
            recorder.phase = "step"
            if state.pipeline is not None:
                state.pipeline.sync_tied_grads()
            if dp > 1:  # the Trainer's reduce_gradients without ZeRO: flat all-reduces per dtype
                all_reduce_flat([p.grad for p in params if p.grad is not None], mesh.group("dp"))
        optimizer, step_peak, step_traffic = _adamw_state(params) if optimizer else ({}, 0, 0)
        late = late_gradients(model, state.pipeline)
        zero = _zero(params, optimizer, mesh, late)
    layers, modules = _stage_paths(model, index)
    peak, peak_with_gradients = work.peaks([p.grad for p in params if p.grad is not None])
    memory = MemoryCounts(work.saved_bytes(), peak, peak_with_gradients, step_peak, step_traffic)
    blocks = ring_paths(model)
    per_layer = _layer_work(work.work, layers, blocks)
    per_microbatch = [c for c in recorder.records if c.phase != "step"]
    info = StageInfo(index=index, layers=layers, modules=modules, parameter_bytes=state.report.local_bytes,
                     gradient_bytes=_nbytes(p for p in params if p.requires_grad),
                     optimizer_bytes=sum(a + b for a, b in optimizer.values()), zero=zero,
                     collectives=_by_layer(per_microbatch, layers),
                     step=[c for c in recorder.records if c.phase == "step"], sends=[tensor_spec(t) for t in sent],
                     work=per_layer, memory=memory, late_gradient_bytes=late_gradient_bytes(params, late),
                     moe=moe_layers(model, moe, work.work))
    if keep is not None:
        keep.update(work=work.work, ring=blocks, params=params, state=optimizer, late=late)
    return info, sent, state.report


# -------------------------------------------------------------------------------------------------- the API
def _check_sizes(**sizes) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanInputError(f"{name} must be a positive integer, got {value!r}")


def _mode(sequence_parallel, sp: int):
    """shard()'s ``sequence_parallel`` (None: all-to-all when sp > 1, else off) and its name in the report."""
    if sequence_parallel is None:
        sequence_parallel = ALL_TO_ALL if sp > 1 else False
    name = {False: "off", True: MEGATRON, MEGATRON: MEGATRON, ALL_TO_ALL: ALL_TO_ALL, RING: RING}.get(
        sequence_parallel)
    return sequence_parallel, name or str(sequence_parallel)


def plan(model_or_config, *, tp: int = 1, pp: int = 1, dp: int = 1, sp: int = 1, sequence_parallel=None, cls=None,
         batch: int = 8, seq: int = 128, microbatches: int = 1, dtype=None, policy=None,
         activation_checkpointing: bool = False, precision: str = "fp32", device_type: str = "cpu", ep: int = 1,
         expert_capacity: float | None = None, ulysses: int = 1) -> PlanReport:
    """Dry run of sharding ``model_or_config`` over dp x pp x sp x tp ranks, with no ranks: a :class:`PlanReport`
    of the rewrites, bytes per rank of every pipeline stage (parameters, gradients, AdamW state, ZeRO), what
    crosses each stage boundary, and every collective of a training step, per layer (module docstring).

    ``model_or_config``: a model (only its class, config and dtype are used), a transformers config, a model
    directory or a config.json file. ``cls``: the model class or its name in transformers (default: the model's,
    else the config's ``architectures[0]``). ``sequence_parallel``, ``policy``, ``ulysses``: as :func:`shardlib.shard`
    (default: all-to-all when ``sp > 1``; ``"ring"``: ring attention; ``ulysses=N`` with it: Ulysses x ring).
    ``batch`` x ``seq``: one microbatch of one dp rank (the inputs and labels of the model's task,
    :func:`example_batch`); ``microbatches`` per step. ``dtype``: of the
    parameters (default: the model's, else torch's default dtype). ``precision``: the Trainer's ("fp32", or "bf16" /
    "fp16": the forward under autocast's casts as on ``device_type``, "cpu" or "cuda"). ``ep``: expert parallelism
    over ep of the dp ranks, ``expert_capacity`` its static capacity factor (None: dropless), priced from the dry
    run without it (:func:`~shardlib.analysis.expert_cost.expert_parallel_report`).

    Raises :class:`~shardlib.PlanError` (the one :func:`shardlib.shard` raises) for a refused layout and
    :class:`PlanInputError` for bad input. Run from a process where torch.distributed is initialized, the dry run
    happens in a ``python -m shardlib.cli plan`` subprocess (then ``policy`` must be None).
    """
    _check_sizes(tp=tp, pp=pp, dp=dp, sp=sp, batch=batch, seq=seq, microbatches=microbatches, ulysses=ulysses)
    options = dict(tp=tp, pp=pp, dp=dp, sp=sp, sequence_parallel=sequence_parallel, batch=batch, seq=seq,
                   microbatches=microbatches, precision=precision, device_type=device_type,
                   activation_checkpointing=activation_checkpointing, ulysses=ulysses)
    report = (_plan_in_subprocess(model_or_config, cls, dtype, policy, options) if dist.is_initialized()
              else _plan_here(model_or_config, cls, dtype, policy, **options))
    return expert_parallel_report(report, ep, expert_capacity)


def _plan_here(model_or_config, cls, dtype, policy, *, tp, pp, dp, sp, sequence_parallel, batch, seq, microbatches,
               precision, device_type, activation_checkpointing, ulysses) -> PlanReport:
    """:func:`plan` in this process, without expert parallelism."""
    base = meta_model(model_or_config, cls, dtype)
    policy = planned_policy(base, policy)
    inputs = example_batch(base, batch, seq)
    mode, mode_name = _mode(sequence_parallel, sp)
    sizes, stages, received, sharding = dict(dp=dp, pp=pp, sp=sp, tp=tp), [], (), None
    options = dict(policy=policy, sequence_parallel=mode) | ({"ulysses": ulysses} if ulysses > 1 else {})
    with torch.random.fork_rng(devices=[]):  # shard() seeds its dropout streams; the caller's RNG is left alone
        for index in range(pp):
            model = base if pp == 1 else copy.deepcopy(base)
            info, sent, report = _plan_stage(model, index, sizes, options, inputs, received, activation_checkpointing,
                                             precision=precision, device_type=device_type)
            stages.append(info)
            sharding = sharding or report
            received = tuple(t.detach().requires_grad_(t.requires_grad) for t in sent)
    mesh = sizes | ({"ulysses": ulysses} if ulysses > 1 else {})
    return PlanReport(model_class=type(base).__name__, policy=policy.name, mesh=mesh, sequence_parallel=mode_name,
                      microbatches=microbatches, inputs={k: tensor_spec(v) for k, v in inputs.items()},
                      sharding=sharding, stages=stages, activation_checkpointing=activation_checkpointing,
                      precision=precision, device_type=device_type)


def _plan_in_subprocess(model_or_config, cls, dtype, policy, options: dict) -> PlanReport:
    """The dry run in ``python -m shardlib.cli plan ... --json`` (this process is a real rank: fake_world refuses)."""
    if policy is not None:
        raise PlanInputError("torch.distributed is initialized here, so the dry run goes to a subprocess, which cannot "
                             "take a policy object: call shardlib.plan(..., policy=...) before init_mesh")
    if isinstance(model_or_config, nn.Module):
        cls = cls or type(model_or_config)
        dtype = dtype or next(model_or_config.parameters()).dtype
    sequence_parallel, sp, ulysses = options.pop("sequence_parallel"), options.pop("sp"), options.pop("ulysses", 1)
    flags = ["--activation-checkpointing"] if options.pop("activation_checkpointing", False) else []
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()] + flags
    if sequence_parallel in (True, MEGATRON):
        argv += ["--sp", MEGATRON]
    elif sp > 1 or sequence_parallel in SP_MODES:
        argv += ["--sp", sequence_parallel if sequence_parallel in SP_MODES else ALL_TO_ALL, str(sp)]
    argv += [f"--ulysses={ulysses}"] if ulysses > 1 else []
    argv += [f"--class={cls if isinstance(cls, str) else cls.__name__}"] if cls is not None else []
    argv += [f"--dtype={str(dtype).removeprefix('torch.')}"] if dtype is not None else []
    with tempfile.TemporaryDirectory() as tmp:
        source = model_or_config
        if not isinstance(source, (str, os.PathLike)):
            config = source.config if isinstance(source, nn.Module) else source
            config.to_json_file(os.path.join(tmp, "config.json"))
            source = tmp
        done = subprocess.run([sys.executable, "-m", "shardlib.cli", "plan", os.fspath(source), *argv, "--json"],
                              capture_output=True, text=True)
    if done.returncode:
        message = done.stderr.rpartition("shardlib plan: ")[2].strip() or done.stderr.strip()
        raise (PlanError if done.returncode == 2 else PlanInputError)(message)
    return PlanReport.from_dict(json.loads(done.stdout))
