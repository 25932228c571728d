"""The cost model: from what a dry run counted (a :class:`~shardlib.analysis.dryrun_report.PlanReport`), a machine
:class:`~shardlib.analysis.profile.Profile` and a :class:`~shardlib.analysis.layout.Layout`, the peak memory per rank
and the step time, each with its breakdown. It counts nothing itself (the dry run does) and enumerates nothing (the
search does); docs/planning.md explains every term.

Memory, on the rank of each stage that holds the most (the worst dp rank), is the largest of these moments:

* backward: parameters + optimizer state + the gradients that persist through backward (DDP's buckets; the
  gradients of earlier microbatches; ZeRO-2's shards) + the activations of the
  microbatches the schedule keeps in flight, less one, + the peak the running microbatch adds (counted on the
  dry run: its activations, transients like logits, and its gradients where none persisted before);
* optimizer step: parameters + optimizer state + gradients + the optimizer's temporaries (counted on a meta AdamW
  step; a 1/dp share under ZeRO);
* under GPipe the backward moment is the first backward's (no gradient of the step yet) or the second's; ZeRO-1
  under a pipeline adds the reduce-scatter after the schedule (whole gradients + one flat bucket); ZeRO-2 (and
  ZeRO-1 with one microbatch) the end of backward (its shards + two flat buckets: one filling, one in flight).

Time: a microbatch on a stage costs its GEMMs (each priced at its size by the profile), the memory traffic of its
other ops and the fixed cost of dispatching every op (on a CPU added to the work; on a GPU, which runs kernels while
the host queues the next ones, only where dispatching takes longer than the work: "host dispatch"), its tensor /
sequence-parallel collectives (ring attention's transfers only where they outlast the block compute they run
under) and its pipeline sends; the schedule chains them (``m``
microbatches on ``pp`` stages: ``sum(stage times) + (m - 1) * max(stage times)``, the bubble being the first term
less one stage); then the data-parallel gradient sync (exposed: it overlaps backward only on GPUs, where compute
does not share the cores that run the collective) and the optimizer step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..parallel.collectives import FLAT_BUCKET_BYTES  # all_reduce_flat's bucket, DDP's too
from ..parallel.flat import DEFAULT_BUCKET_BYTES
from .dryrun_report import PlanReport, StageInfo
from .expert_cost import check_expert_parallel, expert_parallel_report, expert_summary, expert_sync_bytes
from .layout import Layout
from .profile import Profile

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class Prediction:
    """What one layout costs: ``peak_bytes`` on the rank of stage ``peak_stage`` that holds the most, with its terms
    (``memory``: name -> bytes, summing to it), and ``step_s`` with its terms (``time``: name -> seconds, summing to
    it); ``bottleneck``: the largest time term."""

    layout: Layout
    peak_bytes: int
    peak_stage: int
    memory: dict[str, int]
    step_s: float
    time: dict[str, float]
    bottleneck: str
    notes: list[str] = field(default_factory=list)
    #: a model with MoE layers: its experts on the peak stage (:func:`~.expert_cost.expert_summary`: ``ep``, the
    #: bytes of their parameters, gradients and AdamW state per rank, the all-to-all bytes leaving a rank per step)
    experts: dict = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.layout.global_batch / self.step_s

    @property
    def dominant_memory(self) -> str:
        return max(self.memory, key=self.memory.get)

    def to_dict(self) -> dict:
        data = asdict(self) | {"layout": self.layout.to_dict(), "samples_per_s": self.samples_per_s,
                               "layout_name": self.layout.name()}
        if not self.experts:
            del data["experts"]
        return data

    def __str__(self) -> str:
        from .dryrun_report import size_text

        memory = " + ".join(f"{k} {size_text(v)}" for k, v in self.memory.items() if v)
        time = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(self.time.items(), key=lambda kv: -kv[1]))
        lines = [f"predicted for {self.layout.name()} (batch {self.layout.batch} per microbatch and dp rank):",
                 f"  peak memory per rank: {size_text(self.peak_bytes)} (stage {self.peak_stage}) = {memory}",
                 f"  step time: {self.step_s * 1e3:.1f} ms, {self.samples_per_s:.1f} samples/s; bottleneck: "
                 f"{self.bottleneck} ({self.time[self.bottleneck] / self.step_s:.0%})",
                 f"  time terms: {time}"]
        if self.experts:
            e = self.experts
            lines.append(f"  experts: ep={e['ep']}, {e['moe_layers']} MoE layer(s) on the stage; their parameters + "
                         f"gradients + AdamW state {size_text(e['expert_bytes'])} per rank (before ZeRO); all-to-all "
                         f"{size_text(e['all_to_all_bytes'])} leaving the rank per step"
                         + (f"; static capacity {e['expert_capacity']:g}: {e['rows_per_microbatch']} rows sent per "
                            f"microbatch for {e['pairs_per_microbatch']} (token, expert) pairs"
                            if e["expert_capacity"] is not None else ""))
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


# ------------------------------------------------------------------------------------------------------ memory
def _in_flight(layout: Layout, stage: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at its peak (1F1B: up to pp - stage; GPipe and looped
    BFS: all of them; without a pipeline, one: accumulation runs them one after another)."""
    if layout.pp == 1:
        return 1
    if layout.schedule in ("gpipe", "looped_bfs"):
        return layout.microbatches
    return min(layout.microbatches, layout.pp - stage)


def _zero_bytes(stage: StageInfo, zero: int):
    return next((z for z in stage.zero if z.zero == zero), None)


def _largest_bucket(stage: StageInfo, dp: int) -> int:
    return min(stage.gradient_bytes, DEFAULT_BUCKET_BYTES) if dp > 1 else 0


def stage_memory(report: PlanReport, layout: Layout, stage: StageInfo) -> dict[str, int]:
    """The peak memory terms of one rank of ``stage`` (module docstring)."""
    counts, zero, dp = stage.memory, layout.zero, layout.dp
    z = _zero_bytes(stage, zero) if zero else None
    params = max(z.parameters) if z else stage.parameter_bytes
    optimizer = max(z.optimizer) if z else stage.optimizer_bytes
    gradients = max(z.gradients) if z else stage.gradient_bytes
    in_flight = _in_flight(layout, stage.index)
    ddp = zero == 0 and dp > 1 and layout.pp == 1
    pipelined = layout.pp > 1
    fresh = zero == 0 and not ddp and layout.pp == 1 and layout.microbatches == 1
    # ZeRO-1 reduce-scatters in the last backward of the step: with one microbatch per stage, that is ZeRO-2
    scatters_in_backward = zero == 2 or (zero == 1 and layout.microbatches == 1)
    late_whole = 0  # a late parameter's gradient (reduced after backward) is whole in place of its shard until then
    if scatters_in_backward:  # what persists: the shards
        gradients = max(_zero_bytes(stage, 2).gradients)
        late_whole = stage.late_gradient_bytes - stage.late_gradient_bytes // dp
    # a checkpointed stage before the last peaks in a layer's recompute, which recurs through backward: with ZeRO's
    # bucket in flight (the last stage peaks in its head's and loss's backward, an unrecomputed stage at backward's
    # start: before any bucket is complete)
    recomputing = layout.activation_checkpointing and stage.index < layout.pp - 1
    terms = {"parameters": params, "optimizer state": optimizer}
    if zero == 3:  # FSDP2 gathers a layer's parameters (and the next one's, prefetched) and its gradients
        per_layer = stage.parameter_bytes // max(1, len(stage.layers))
        terms["gathered parameters"] = 2 * per_layer
        terms["gradients"] = gradients + per_layer
    elif scatters_in_backward:  # the shards; the late gradients of earlier microbatches; where the stage has more
        # than one bucket, the one in flight while backward goes on (the last one's: a moment below)
        several = stage.gradient_bytes - stage.late_gradient_bytes > DEFAULT_BUCKET_BYTES
        in_flight_bucket = _largest_bucket(stage, dp) if recomputing and several else 0
        terms["gradients"] = gradients + (late_whole if layout.microbatches > 1 else 0) + in_flight_bucket
    elif not fresh:  # whole gradients through backward (and ZeRO-1's flat bucket in its last backward; under a
        # pipeline it reduce-scatters after the schedule instead, when no activation is left: a moment below)
        terms["gradients"] = stage.gradient_bytes + (_largest_bucket(stage, dp) if zero == 1 and not pipelined else 0)
    terms["activations"] = (in_flight - 1) * counts.activation_bytes
    running = counts.peak_with_gradients if fresh else counts.peak_bytes
    terms["running microbatch"] = running
    backward = [terms]
    if pipelined and layout.schedule in ("gpipe", "looped_bfs") and zero in (0, 1):
        # every forward first, then every backward: the first backward starts before any gradient of the step
        # exists (zero_grad freed them); the second, with the first's gradients and one microbatch fewer
        backward = [dict(terms, gradients=0)]
        if in_flight > 1:
            backward.append(dict(terms, activations=(in_flight - 2) * counts.activation_bytes))
    temporaries = counts.optimizer_peak_bytes // (dp if zero else 1)
    step = {"parameters": params, "optimizer state": optimizer, "gradients": gradients,
            "optimizer temporaries": temporaries + terms.get("gathered parameters", 0)}
    moments = backward + [step]  # backward's, the optimizer step's (the first of equal ones)
    if scatters_in_backward:  # backward's end: the last bucket filling, the one before it in flight, no activation
        moments.append({"parameters": params, "optimizer state": optimizer,
                        "gradients": gradients + late_whole + 2 * _largest_bucket(stage, dp)})
    if zero == 1 and pipelined and not scatters_in_backward:  # the reduce-scatter after the schedule
        moments.append({"parameters": params, "optimizer state": optimizer,
                        "gradients": stage.gradient_bytes + _largest_bucket(stage, dp)})
    return max(moments, key=lambda t: sum(t.values()))


_PAGE = 4096


def transport_pages(stage: StageInfo, layout: Layout, profile: Profile) -> dict[str, int]:
    """The shared-memory transport's pages a rank of ``stage`` maps, where the profile says its tp and sp groups use
    it: per group of n ranks, both parities of every rank's slot as far as the largest message through it reaches
    (a rank writes its own slot and reads the others'). Resident in every rank of the group: what its RSS shows."""
    if not profile.shared_memory or layout.tp == layout.sp == 1:  # the search's common case: no walk
        return {}
    total = 0
    for dim, n in (("tp", layout.tp), ("sp", layout.sp)):
        sizes = [c.bytes for c in (*(c for e in stage.collectives for c in e.collectives), *stage.step)
                 if c.dim == dim and profile.over_shared_memory(c.op, dim, c.bytes)]
        if n > 1 and sizes:
            total += 2 * n * -(-max(sizes) // _PAGE) * _PAGE
    return {"shared-memory transport": total} if total else {}


# -------------------------------------------------------------------------------------------------------- time
class _Prices:
    """The profile's seconds of each GEMM size and collective, each asked once (a search prices thousands of stages
    made of a few sizes)."""

    def __init__(self, profile: Profile):
        self.profile, self._gemms, self._collectives = profile, {}, {}

    def gemm(self, flops: int, dtype: str) -> float:
        found = self._gemms.get((flops, dtype))
        if found is None:
            found = self._gemms[flops, dtype] = self.profile.gemm_seconds(flops, dtype)
        return found

    def collective(self, op: str, group_size: int, nbytes: int, dim: str | None = None) -> float:
        key = (op, group_size, nbytes, dim)
        found = self._collectives.get(key)
        if found is None:
            found = self._collectives[key] = self.profile.collective_seconds(op, group_size, nbytes, dim)
        return found


def _microbatch_time(report: PlanReport, stage: StageInfo, profile: Profile, dtype: str,
                     prices: _Prices | None = None) -> dict[str, float]:
    """Seconds of one microbatch (forward and backward) on a rank of ``stage``, by term."""
    prices = prices or _Prices(profile)
    compute = sum(n * prices.gemm(f, dtype) for w in stage.work for f, n in w.gemms)
    compute += profile.elementwise_seconds(sum(w.traffic for w in stage.work))
    host = profile.op_seconds * sum(w.ops for w in stage.work)
    if profile.device == "cpu":  # the cores that dispatch an op also run it
        terms = {"compute": compute + host}
    else:  # the host queues kernels while the device runs earlier ones: the slower of the two sets the pace
        terms = {"compute": compute, "host dispatch": max(0.0, host - compute)}
    for entry in stage.collectives:
        for c in entry.collectives:
            if not _is_ring(c):
                key = f"{c.dim} {c.op}"
                terms[key] = terms.get(key, 0.0) + prices.collective(c.op, c.group_size, c.bytes, c.dim)
    ring = _ring_exposed(stage, prices, dtype)
    if ring is not None:
        terms["sp ring send_recv"] = ring
    forward, backward = stage.send_bytes
    if stage.sends:
        terms["pipeline sends"] = (profile.collective_seconds("send_recv", 2, forward)
                                   + profile.collective_seconds("send_recv", 2, backward))
    return terms


def _is_ring(c) -> bool:
    return c.op == "send_recv" and c.dim == "sp"  # ring attention's K/V blocks and their gradients


def _ring_exposed(stage: StageInfo, prices: _Prices, dtype: str) -> float | None:
    """Seconds of ring attention's transfers that its block compute does not hide (None: no ring). Each step of the
    ring sends a block on while it computes with the one it holds, so a step costs max(block compute, transfer), not
    their sum; with the steps of a layer alike, the transfers add max(0, transfers - block compute) to the compute,
    per layer. A transfer is priced as the send/recv pair the profile measured (each rank sends one block and
    receives one)."""
    transfers = {e.layer: sum(prices.collective("send_recv", 2, c.bytes, c.dim)
                              for c in e.collectives if _is_ring(c)) for e in stage.collectives}
    if not any(transfers.values()):
        return None
    compute = {w.layer: sum(n * prices.gemm(f, dtype) for f, n in w.ring) for w in stage.work}
    return sum(max(0.0, seconds - compute.get(layer, 0.0)) for layer, seconds in transfers.items())


def _buckets(nbytes: int, limit: int) -> int:
    return max(1, -(-nbytes // limit)) if nbytes else 0


def _dp_sync(stage: StageInfo, layout: Layout, profile: Profile) -> dict[str, float]:
    """Seconds of the data-parallel gradient sync (and ZeRO's parameter gathers) of one step on a rank of
    ``stage``, and of the once-per-step collectives of other dims (tied-weight sums). Experts split over ep sync
    over the dp / ep ranks holding them ("edp"), the rest over dp."""
    terms = {}
    for c in stage.step:
        if c.dim not in ("dp", "edp"):  # the pipeline's tied-gradient sum
            key = f"{c.dim} {c.op} (step)"
            terms[key] = terms.get(key, 0.0) + profile.collective_seconds(c.op, c.group_size, c.bytes, c.dim)
    grads, params = expert_sync_bytes(stage, layout.ep)
    _sync(terms, "dp", layout.dp, stage.gradient_bytes - grads, stage.parameter_bytes - params,
          len(stage.layers) + 1, layout, profile)
    _sync(terms, "edp", layout.dp // layout.ep, grads, params, len(stage.moe), layout, profile)
    return terms


def _sync(terms: dict, dim: str, n: int, grads: int, params: int, units: int, layout: Layout,
          profile: Profile) -> None:
    """The sync of ``grads`` / ``params`` bytes over a group of ``n`` ranks (``units``: FSDP2's groups)."""
    if n == 1 or not grads + params:
        return
    if layout.zero == 0:
        k = _buckets(grads, FLAT_BUCKET_BYTES)
        terms[f"{dim} gradient all_reduce"] = k * profile.collective_seconds("all_reduce", n, grads / k)
    elif layout.zero in (1, 2):
        k = _buckets(grads, DEFAULT_BUCKET_BYTES)
        terms[f"{dim} gradient reduce_scatter"] = k * profile.collective_seconds("reduce_scatter", n, grads / k)
        terms[f"{dim} parameter all_gather"] = k * profile.collective_seconds("all_gather", n, params / k / n)
    else:  # FSDP2: per microbatch, each group's parameters gathered in forward and backward, gradients scattered
        per = layout.microbatches * units
        terms[f"{dim} parameter all_gather"] = 2 * per * profile.collective_seconds("all_gather", n, params / units / n)
        terms[f"{dim} gradient reduce_scatter"] = per * profile.collective_seconds("reduce_scatter", n, grads / units)


def _bubble_share(layout: Layout, profile: Profile) -> float:
    """The share of the pipeline bubble that costs time: all of it, except where more ranks share a CPU's cores than
    it has (a profile with ``cores``): there a rank waiting in the bubble leaves its share of the cores to the
    ranks that work, which the profile measured at their all-busy speed, so only cores / ranks of it is lost."""
    if profile.device != "cpu" or not profile.cores or layout.world <= profile.cores:
        return 1.0
    return profile.cores / layout.world


def _schedule(per_stage: list[dict[str, float]], layout: Layout, profile: Profile) -> dict[str, float]:
    """Seconds of the forward and backward of ``m`` microbatches over the stages (microbatch times by term).

    Ranks with a core each: the slowest stage ``m`` times, plus the rest of the first microbatch's way through the
    other stages (the bubble). More ranks than cores (a CPU profile with ``cores``), where the profile measured
    every rank at its all-busy speed: a rank that waits lends its share of the cores to the ranks that work, so a
    pipeline is bound by its total work rather than by its slowest stage: ``m`` times the *mean* stage, or by the
    schedule's critical path run at the speed of a rank that has a core to itself (``cores / ranks`` of the
    all-busy times), whichever is longer; the excess over the mean is the bubble."""
    totals = [sum(t.values()) for t in per_stage]
    m = layout.microbatches
    share = _bubble_share(layout, profile)
    if len(totals) == 1 or share == 1.0:
        slowest = max(range(len(totals)), key=totals.__getitem__)
        terms = {k: v * m for k, v in per_stage[slowest].items()}
        if len(totals) > 1:
            terms["pipeline bubble"] = (sum(totals) - totals[slowest]) * share
        return terms
    terms: dict[str, float] = {}
    for stage in per_stage:  # the mean stage, by term
        for k, v in stage.items():
            terms[k] = terms.get(k, 0.0) + v * m / len(per_stage)
    critical = (sum(totals) + (m - 1) * max(totals)) * share
    terms["pipeline bubble"] = max(0.0, critical - m * sum(totals) / len(totals))
    return terms


def step_time(report: PlanReport, layout: Layout, profile: Profile, cache: dict | None = None) -> dict[str, float]:
    """Seconds of one training step by term (module docstring); the slowest stage's dp sync and optimizer step.
    ``cache``: a dict kept across calls for the same profile (the search's), holding each stage's microbatch time."""
    dtype = _DTYPES[layout.precision]
    cache = {} if cache is None else cache
    prices = cache.setdefault("prices", _Prices(profile))
    per_stage = []
    for s in report.stages:
        key = (id(s), dtype)
        if key not in cache:
            cache[key] = (s, _microbatch_time(report, s, profile, dtype, prices))  # (s: keeps its id unique)
        per_stage.append(cache[key][1])
    terms = _schedule(per_stage, layout, profile)
    tail = []
    for s in report.stages:
        sync = _dp_sync(s, layout, profile)
        traffic = s.memory.optimizer_traffic / (layout.dp if layout.zero else 1)
        tail.append(sync | {"optimizer step": profile.optimizer_seconds(traffic)})
    worst = max(tail, key=lambda t: sum(t.values()))
    for k, v in worst.items():
        terms[k] = terms.get(k, 0.0) + v
    return terms


# ---------------------------------------------------------------------------------------------------- predict
def check_matches(report: PlanReport, layout: Layout) -> None:
    """The report must be the dry run of the layout's mesh and microbatch."""
    mesh = {"dp": layout.dp, "pp": layout.pp, "sp": layout.sp, "tp": layout.tp} | (
        {"ulysses": layout.ulysses} if layout.ulysses > 1 else {}) | ({"ep": layout.ep} if layout.ep > 1 else {})
    if (report.mesh != mesh or report.activation_checkpointing != layout.activation_checkpointing
            or report.precision != layout.precision):
        raise ValueError(f"the plan report is of mesh {report.mesh} (activation checkpointing "
                         f"{report.activation_checkpointing}, precision {report.precision}), the layout is "
                         f"{layout.name()}")
    if any(s.memory is None for s in report.stages):
        raise ValueError("the plan report has no memory counts (a report from an older shardlib?): plan again")


def predict(report: PlanReport, profile: Profile, layout: Layout, cache: dict | None = None) -> Prediction:
    """The peak memory per rank and the step time of ``layout``, from its dry run ``report`` and ``profile``
    (``cache``: see :func:`step_time`). A report without expert parallelism is priced at the layout's ``ep``
    (:func:`~.expert_cost.expert_parallel_report`)."""
    if "ep" not in report.mesh:
        report = expert_parallel_report(report, layout.ep, layout.expert_capacity)
    else:
        check_expert_parallel(report, layout.ep, layout.expert_capacity)
    check_matches(report, layout)
    memories = [stage_memory(report, layout, s) | transport_pages(s, layout, profile) for s in report.stages]
    peak_stage = max(range(len(memories)), key=lambda i: sum(memories[i].values()))
    time = step_time(report, layout, profile, cache)
    notes = [] if profile.world_size in (None, layout.world) else [
        f"profile measured on {profile.world_size} ranks, layout has {layout.world}"]
    return Prediction(layout=layout, peak_bytes=sum(memories[peak_stage].values()), peak_stage=peak_stage,
                      memory=memories[peak_stage], step_s=sum(time.values()), time=time,
                      bottleneck=max(time, key=time.get), notes=notes,
                      experts=expert_summary(report, report.stages[peak_stage], layout))
