"""What expert parallelism costs (``ep``: each mixture-of-experts layer's experts split over ep of the data-parallel
ranks, tokens exchanged by all-to-all: :mod:`shardlib.parallel.expert_parallel`), priced from the dry run of the same
layout without it, whose :class:`~shardlib.analysis.dryrun_report.MoELayer` records say, per stage, what each layer's
experts hold and save and how many tokens reach them (spread evenly over the experts:
:mod:`shardlib.analysis.meta_experts`). :func:`expert_parallel_report` turns that report into the one of the ep
layout, which the cost model then prices as any other:

* memory: a rank holds E/ep of every layer's experts (on top of tp's split), so their parameters, gradients and AdamW
  state fall to 1/ep, the optimizer step's temporaries and traffic with them. Under ZeRO the experts' shards are
  taken over the dp / ep ranks holding the same experts (edp), so a rank's shards of their gradients and AdamW state
  (ZeRO-1/2) and of everything (ZeRO-3) are 1/dp of the experts either way: what falls is ZeRO-1/2's whole
  parameters (and ZeRO-1's whole gradients). The exchange saves nothing for backward beyond what the experts save
  without it (the combine keeps the rows that come back where the experts kept their weighted output). The static
  capacity ``c`` sends every expert ``C = max(1, ceil(c x pairs / E))`` rows from each ep rank, ``E x C`` rows where
  dropless sends ``pairs`` (tokens x top-k), and computes only the filled ones (eager): the padding is four buffers
  of ``E x C`` rows live while a layer exchanges (the rows sent, received, computed and returned), in the peak;
* time: per layer and microbatch, the dispatch and the combine in forward and again in backward, four all-to-alls of
  ``pairs`` rows of the hidden size (static: ``E x C`` rows) over the ep group, (ep - 1) / ep of each leaving the
  rank, and a small one in forward (dropless: the split sizes and each row's local expert; static: the filled
  counts). The experts' gradients are summed (ZeRO: reduce-scattered, gathered) over edp, not over dp
  (:func:`expert_sync_bytes`).

Refused, each in one line with its fix: ep not dividing dp, ep not dividing a layer's expert count, ep on a model
without MoE layers, a capacity without ep > 1.
"""

from __future__ import annotations

import dataclasses
import math

from ..sharding.plan import PlanError
from .dryrun_report import Collective, LayerCollectives, MoELayer, PlanReport, StageInfo
from .meta_experts import expert_count, experts_modules

#: an int64: per row its local expert and per rank its split size (dropless), per expert its filled count (static)
_INDEX_BYTES = 8


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ep_sizes(dp: int, experts: list[int]) -> list[int]:
    """The ep a mesh of ``dp`` data-parallel ranks can take for layers of ``experts`` experts each: the divisors
    of dp that divide every count (just 1 without MoE layers)."""
    return [e for e in _divisors(dp) if all(n % e == 0 for n in experts)] if experts else [1]


def check_expert_parallel(report: PlanReport, ep: int, capacity: float | None = None) -> None:
    """Raise :class:`PlanError` (one line, naming the value and the fix) where ``ep`` / ``capacity`` cannot run on the
    layout of ``report`` (module docstring)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise PlanError(f"ep={ep!r}: expected a positive integer")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, float))
                                 or not math.isfinite(capacity) or capacity <= 0):
        raise PlanError(f"expert capacity {capacity!r}: expected a capacity factor > 0 (or none: dropless)")
    if ep == 1:
        if capacity is not None:
            raise PlanError(f"expert capacity {capacity:g} sets the static exchange of expert parallelism: give ep > 1 "
                            "too (--ep N)")
        return
    layers = [m for s in report.stages for m in s.moe]
    dp = report.mesh["dp"]
    if not layers:
        raise PlanError(f"ep={ep}: {report.model_class} has no mixture-of-experts layer to split; leave ep out")
    if dp % ep:
        raise PlanError(f"ep={ep} does not divide dp={dp}: the ep ranks are drawn from the data-parallel ones; "
                        f"use ep in {_choices(dp, layers)} or a dp that ep divides")
    uneven = next((m for m in layers if m.experts % ep), None)
    if uneven is not None:
        raise PlanError(f"ep={ep} does not divide the {uneven.experts} experts of {uneven.path}: each rank holds "
                        f"whole experts; use ep in {_choices(dp, layers)}")


def _choices(dp: int, layers: list[MoELayer]) -> str:
    return ", ".join(map(str, ep_sizes(dp, [m.experts for m in layers])))


def capacity_rows(layer: MoELayer, capacity: float | None) -> int:
    """The rows of one MoE layer a rank sends per exchange: its pairs (dropless, tokens spread evenly), or E x C under
    the static capacity factor ``capacity`` (C as :func:`~shardlib.parallel.expert_parallel.expert_parallel_forward`
    sizes it)."""
    if capacity is None:
        return layer.pairs
    return layer.experts * max(1, math.ceil(capacity * layer.pairs / layer.experts))


def expert_parallel_report(report: PlanReport, ep: int, capacity: float | None = None) -> PlanReport:
    """``report`` (a dry run without expert parallelism) as the ranks of the same layout at ``ep`` hold and exchange
    (module docstring); ``report`` itself where ep is 1. Raises :class:`PlanError` where it is refused."""
    check_expert_parallel(report, ep, capacity)
    if ep == 1:
        return report
    return dataclasses.replace(report, mesh={**report.mesh, "ep": ep},
                               stages=[_stage_at(s, ep, capacity, report.mesh["dp"]) for s in report.stages])


def _stage_at(stage: StageInfo, ep: int, capacity: float | None, dp: int) -> StageInfo:
    """One stage of the report at ep (module docstring)."""
    params = sum(m.parameter_bytes for m in stage.moe)
    grads = sum(m.gradient_bytes for m in stage.moe)
    state = _expert_state(stage)
    cut = {"parameters": params - params // ep, "gradients": grads - grads // ep}
    padding = max((4 * (capacity_rows(m, capacity) - m.pairs) * m.row_bytes for m in stage.moe), default=0)
    parameter_bytes = stage.parameter_bytes - cut["parameters"]
    scale = parameter_bytes / max(1, stage.parameter_bytes)
    memory = stage.memory and dataclasses.replace(
        stage.memory, peak_bytes=stage.memory.peak_bytes + padding,
        peak_with_gradients=stage.memory.peak_with_gradients + padding - cut["gradients"],
        optimizer_peak_bytes=int(stage.memory.optimizer_peak_bytes * scale),
        optimizer_traffic=int(stage.memory.optimizer_traffic * scale))
    moe = [dataclasses.replace(m, parameter_bytes=m.parameter_bytes // ep, gradient_bytes=m.gradient_bytes // ep)
           for m in stage.moe]
    zero = [dataclasses.replace(z, parameters=[b - cut["parameters"] for b in z.parameters],
                                gradients=[b - cut["gradients"] for b in z.gradients] if z.zero == 1 else z.gradients)
            if z.zero in (1, 2) else z for z in stage.zero]
    return dataclasses.replace(stage, parameter_bytes=parameter_bytes,
                               gradient_bytes=stage.gradient_bytes - cut["gradients"],
                               optimizer_bytes=stage.optimizer_bytes - state + state // ep, zero=zero,
                               collectives=_with_exchanges(stage, ep, capacity), memory=memory, moe=moe,
                               step=_step_at(stage, ep, dp, grads))


def _expert_state(stage: StageInfo) -> int:
    """The experts' share of the stage's AdamW state: their share of its gradients (the state is shaped like the
    parameters that get a gradient)."""
    grads = sum(m.gradient_bytes for m in stage.moe)
    return stage.optimizer_bytes * grads // stage.gradient_bytes if stage.gradient_bytes else 0


def _exchanges(layer: MoELayer, ep: int, capacity: float | None) -> list[Collective]:
    """The all-to-alls of one MoE layer in one microbatch (module docstring)."""
    rows = capacity_rows(layer, capacity) * layer.row_bytes
    small = [layer.experts * _INDEX_BYTES] if capacity is not None else [ep * _INDEX_BYTES,
                                                                         layer.pairs * _INDEX_BYTES]
    return ([Collective("all_to_all_single", "ep", ep, n, "forward", layer.path) for n in (*small, rows, rows)]
            + [Collective("all_to_all_single", "ep", ep, rows, "backward", layer.path) for _ in range(2)])


def _with_exchanges(stage: StageInfo, ep: int, capacity: float | None) -> list[LayerCollectives]:
    """The stage's collectives per layer with each MoE layer's exchanges added to the trunk layer holding it."""
    entries = [LayerCollectives(e.layer, list(e.collectives)) for e in stage.collectives]
    for m in stage.moe:
        entry = next((e for e in entries if e.layer and m.path.startswith(e.layer + ".")), None)
        if entry is None:
            entry = next((e for e in entries if not e.layer), None) or LayerCollectives("")
            if entry not in entries:
                entries.append(entry)
        entry.collectives += _exchanges(m, ep, capacity)
    return entries


def _step_at(stage: StageInfo, ep: int, dp: int, expert_grads: int) -> list[Collective]:
    """The stage's once-per-step collectives at ep: the Trainer's dp all-reduce of the gradients without the
    experts', which go over the dp / ep ranks holding the same experts (the mesh's "edp" group), if more than one."""
    step = [c for c in stage.step if not (c.dim == "dp" and c.op == "all_reduce")]
    if len(step) == len(stage.step):  # no dp sum (dp = 1)
        return step
    step.append(Collective("all_reduce", "dp", dp, stage.gradient_bytes - expert_grads, "step", ""))
    if dp > ep:
        step.append(Collective("all_reduce", "edp", dp // ep, expert_grads // ep, "step", ""))
    return step


def exchange_bytes(stage: StageInfo, ep: int, capacity: float | None, microbatches: int) -> int:
    """Bytes of token rows a rank of ``stage`` sends to the other ranks of its ep group per step: dispatch and
    combine, forward and backward, (ep - 1) / ep of each exchange (0 at ep = 1)."""
    rows = sum(4 * capacity_rows(m, capacity) * m.row_bytes for m in stage.moe)
    return rows * microbatches * (ep - 1) // ep


def expert_sync_bytes(stage: StageInfo, ep: int) -> tuple[int, int]:
    """(gradient, parameter) bytes of a rank's experts split over ``ep``, which the data-parallel sync takes over the
    dp / ep ranks holding the same experts instead of over dp; (0, 0) at ep = 1."""
    if ep == 1:
        return 0, 0
    return sum(m.gradient_bytes for m in stage.moe), sum(m.parameter_bytes for m in stage.moe)


def expert_summary(report: PlanReport, stage: StageInfo, layout) -> dict:
    """What a prediction says of the experts of ``stage`` (a stage of ``report``, priced at ``layout``): empty for a
    model without MoE layers."""
    if not stage.moe:
        return {}
    ep = report.mesh.get("ep", 1)
    params = sum(m.parameter_bytes for m in stage.moe)
    grads = sum(m.gradient_bytes for m in stage.moe)
    state = _expert_state(stage)
    return {"ep": ep, "expert_capacity": layout.expert_capacity, "moe_layers": len(stage.moe),
            "expert_bytes": params + grads + state,
            "all_to_all_bytes": exchange_bytes(stage, ep, layout.expert_capacity, layout.microbatches),
            "rows_per_microbatch": sum(capacity_rows(m, layout.expert_capacity) for m in stage.moe),
            "pairs_per_microbatch": sum(m.pairs for m in stage.moe)}


def expert_counts(model, plan) -> list[int]:
    """The expert count of every mixture-of-experts layer of ``model`` (the blocks of ``plan.moe``)."""
    return [expert_count(m) for m in experts_modules(model, plan).values()]
