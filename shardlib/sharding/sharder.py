"""The generic sharder: validate a plan against a model and a mesh, then rewrite the model in place.

Everything is checked before anything changes: a pattern that matches no module, a style on the wrong module
type, a width or head count that tp does not divide, tied parameters that would get different layouts. All
problems are reported together in one :class:`PlanError`, and the model is left untouched.

A failed ``shard()`` changes nothing, by construction: every pass's checks run before the first install
(:func:`_check`), and the whole call runs inside :func:`shardlib.sharding.transaction.restoring`, so an exception
raised anyway (by an install, or an interrupt) restores the model (parameters, modules, attributes, hooks, classes,
configs) and the attention registries before it propagates.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..kernels import Kernels
from ..parallel.mesh import Mesh
from ..parallel.random import RNGStatesTracker, rng_streams
from .adapters import peft_inner_model
from .documents import attach_document_hooks
from .passes import Resolved, passes_for
from .plan import INFERRED, PlanError
from .sequence import SP_MODES, sequence_mode
from .shard_report import ShardReport
from .sharded import ShardState, shard_state
from .transaction import restoring

log = logging.getLogger("shardlib")


def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values())


def shard(
    model: nn.Module,
    mesh: Mesh,
    policy=None,
    *,
    gather_logits: bool | None = None,
    rng_tracker: RNGStatesTracker | None = None,
    check_replicated_inputs: bool = False,
    stages_per_rank: int = 1,
    layers_per_stage: list[int] | None = None,
    sequence_parallel: bool | str = False,
    ulysses: int = 1,
    kernels: Kernels | None = None,
    verify_plan: bool = True,
    expert_capacity: float | None = None,
) -> nn.Module:
    """Shard ``model`` in place over ``mesh``'s tensor-parallel dim and return it.

    ``model``: a transformers model, or a peft model (``peft.get_peft_model``): its LoRA adapters are sharded with
    the linears they wrap (:mod:`shardlib.sharding.adapters`).

    ``policy``: defaults to the registered policy for the model class (``shardlib.policies``); for a class without
    one, or with ``policy="auto"``, a plan inferred from the model's own graph (:mod:`shardlib.sharding.inference`),
    proven on a small twin of the model before anything changes (``verify_plan=False`` skips the proof).
    ``gather_logits``: see :mod:`shardlib.sharding.losses` (None: gather only when no labels are passed).
    ``rng_tracker``: the per-rank dropout stream for sharded activations (default: seeded from the current default
    generator state, which must be identical on all ranks: call ``torch.manual_seed`` first).
    ``check_replicated_inputs``: verify at every forward that the tensor inputs are identical across the TP group
    (one small all-reduce; catches silently wrong results from divergent inputs).

    ``sequence_parallel``: ``True``: Megatron sequence parallelism on the TP group inside the policy's layer stacks
    (:mod:`shardlib.sharding.sequence`): norms, dropout and residuals on 1/tp of the sequence; any sequence length.
    ``"all_to_all"``: Ulysses sequence parallelism over the mesh's ``sp`` dimension: every activation inside the
    stacks holds 1/sp of the sequence, attention exchanges sequence for heads (:mod:`shardlib.kernels.attention`).
    ``"ring"``: ring attention (context parallelism) over ``sp``: the same 1/sp activations, attention keeps this
    rank's heads and passes K/V blocks around the sp ranks, so sp need not divide the head count
    (:mod:`shardlib.kernels.ring_attention`). ``ulysses``: with ``"ring"``, that many ranks around each ring position
    exchange sequence for heads first (Ulysses x ring: sp = ulysses * ring positions; 1: a plain ring).

    ``kernels``: which fused kernels to use (:class:`shardlib.kernels.Kernels`; default: the fastest measured).

    Mixture-of-experts layers (:mod:`shardlib.sharding.experts`): under tp their experts split like MLPs; with a mesh
    of ``ep > 1`` each rank holds E/ep whole experts and tokens travel to them, dropless by default, or with
    ``expert_capacity=c`` (a capacity factor) in equal splits of ``ceil(c * tokens * top_k / experts)`` rows per
    expert (no host synchronisation; what overflows is dropped and counted).

    Pipeline (``mesh.pp > 1``): the model is cut into ``mesh.pp * stages_per_rank`` stages from the policy's trunk
    (:mod:`shardlib.pipeline`; balanced by a cost model unless ``layers_per_stage`` gives the layer counts), this
    rank keeps its stages (``shard_state(model).pipeline``) and frees the rest; run it with
    :class:`shardlib.Trainer`.

    The report of every rewrite is ``shard_state(model).report`` (also ``shardlib.report(model)``).
    """
    if shard_state(model, required=False) is not None:
        raise PlanError(f"{type(model).__name__} is already sharded")
    with restoring(model, type(model).__name__):
        return _shard(model, mesh, policy, verify_plan, dict(
            gather_logits=gather_logits, check_replicated_inputs=check_replicated_inputs,
            stages_per_rank=stages_per_rank, layers_per_stage=layers_per_stage, kernels=kernels,
            sequence_parallel=sequence_parallel, ulysses=ulysses, rng_tracker=rng_tracker,
            expert_capacity=expert_capacity))


def _shard(wrapper: nn.Module, mesh: Mesh, policy, verify_plan: bool, options: dict) -> nn.Module:
    """:func:`shard`'s body: resolve, check everything, then install (inside the caller's transaction)."""
    model = peft_inner_model(wrapper) or wrapper  # a peft model: its transformers model is sharded
    policy = resolve_policy(model, policy)
    inferred = is_inferred(policy)
    report = ShardReport(policy=policy.name, model_class=type(model).__name__, mesh=str(mesh))
    if inferred:
        from .inference import infer

        report.unplaced = [(u.module, u.why) for u in infer(model).unplaced]
    r = Resolved(model, mesh, policy.plan(model, mesh.tp), options, report)
    options["sequence_mode"] = sequence_mode(options["sequence_parallel"], r.problems)
    passes = passes_for(r)
    _check(r, passes, policy, _inferred_problems(model, mesh) if inferred else [])

    if inferred and verify_plan:
        report.verified_s = _verify_inferred(model, policy, r.plan, mesh, options["sequence_parallel"],
                                             options.get("ulysses", 1))
    if options["rng_tracker"] is None:
        options["rng_tracker"] = rng_streams(RNGStatesTracker(), torch.initial_seed(), mesh)
    report.unsharded_bytes = _param_bytes(model.parameters())
    _install(r, passes)
    report.local_bytes = _param_bytes(r.split.local_parameters() if r.split else model.parameters())
    state = ShardState(mesh=mesh, policy=policy, plan=r.plan, report=report, rng_tracker=options["rng_tracker"],
                       pipeline=r.split)
    for holder in {id(wrapper): wrapper, id(model): model}.values():
        state.attach(holder)
    attach_document_hooks(wrapper, model)
    log.info("%s", report)
    return wrapper


def _check(r: Resolved, passes: list, policy, extra: list[str]) -> None:
    """Every pass's problems, and those found resolving the plan (``extra``: more of the caller's), in one
    PlanError. Checks read the model and change nothing; they all run before the first install."""
    problems = [problem for p in passes for problem in p.problems(r)] + extra
    if r.problems or problems:
        mesh, sp = r.mesh, getattr(r.mesh, "sp", 1)
        raise PlanError(
            f"cannot shard {r.name} with policy '{policy.name}' at tp={mesh.tp}, "
            f"pp={getattr(mesh, 'pp', 1)}" + (f", sp={sp}" if sp > 1 else "") + ":\n  "
            + "\n  ".join(r.problems + problems)
        )


def _install(r: Resolved, passes: list) -> None:
    """The rewrite: every pass's ``prepare`` (state later installs read), then every ``install``, in pass order."""
    for p in passes:
        if hasattr(p, "prepare"):
            p.prepare(r)
    for p in passes:
        p.install(r)


def _inferred_problems(model: nn.Module, mesh) -> list[str]:
    """What stops an inferred plan beyond what the passes check: heads tp does not divide, counted on the model
    itself."""
    from .inference import infer

    return infer(model).head_problems(model, mesh.tp)


def _verify_inferred(model: nn.Module, policy, plan, mesh, sequence_parallel, ulysses: int = 1) -> float | None:
    """Prove an inferred plan before use (:mod:`.inference.verify`) on the mesh's tp group (and sp group, under
    sequence parallelism over sp), and its pipeline cuts (:mod:`.inference.cuts`) when the model is pipelined; the
    seconds it took, None when there was nothing to prove (tp=1 without sp, no pipeline)."""
    from ..parallel.mesh import DEFAULT_TIMEOUT_S
    from ..parallel.timeouts import stalled_ranks_named
    from .inference.cuts import verify_cuts
    from .inference.verify import verify

    seconds = None
    over_sp = sequence_parallel in SP_MODES and getattr(mesh, "sp", 1) > 1
    if (mesh.tp > 1 or over_sp) and getattr(mesh, "tp_group", None) is not None:
        groups = "tensor- and sequence-parallel groups" if over_sp else "tensor-parallel group"
        with stalled_ranks_named(f"shard() (proving the inferred plan on the {groups})",
                                 getattr(mesh, "timeout_s", DEFAULT_TIMEOUT_S)):
            seconds = verify(model, policy, mesh, shard, sequence_parallel=sequence_parallel,
                             **({"ulysses": ulysses} if ulysses > 1 else {}))
    if getattr(mesh, "pp", 1) > 1:
        seconds = (seconds or 0.0) + verify_cuts(model, plan)
    return seconds


def resolve_policy(model: nn.Module, policy=None):
    """The policy ``shard(model, policy=policy)`` uses, and the one way every caller finds it (the dry run, the
    search, ``--layout auto``, checkpoint conversion): ``policy`` itself when it is a Policy; for None the policy
    registered for the model's class, else the plan inferred from its graph (cached per class and config
    structure); for ``"auto"`` the inferred plan whatever is registered. When inference was not asked for but is
    the only way, its refusal says both: which classes have policies, and why no plan could be inferred."""
    from shardlib.policies import has_policy, missing_policy

    from .inference import inferred_policy

    if policy is not None and policy != "auto":
        return policy
    if policy is None and has_policy(model):
        from shardlib.policies import policy_for

        return policy_for(model)
    try:
        return inferred_policy(model)
    except PlanError as exc:
        if policy == "auto":
            raise
        raise PlanError(f"{missing_policy(model)}; and its plan cannot be inferred from its graph: {exc}") from None


def is_inferred(policy) -> bool:
    """Whether ``policy`` is an inferred plan's (:func:`shardlib.sharding.inference.inferred_policy`): ``shard()``
    then checks its heads on the model and proves it before use, whoever resolved it."""
    return getattr(policy, "name", None) == INFERRED




def report(model: nn.Module) -> ShardReport:
    """The :class:`ShardReport` of a sharded model."""
    return shard_state(model).report


__all__ = ["shard", "report"]
