"""The layout search: every layout of a model on ``world`` ranks that the Trainer accepts, priced by the cost model
(:mod:`shardlib.analysis.costmodel`) and ranked by predicted step time among those that fit a memory budget.

Enumeration (:func:`candidate_layouts`): dp x pp x sp x tp = world; sequence parallelism off, Megatron (tp > 1), or
all-to-all and ring attention (sp > 1), and where asked (``ulysses=True``: ``shardlib plan --world``) Ulysses x ring
at every Ulysses group size that divides sp and leaves a ring of two positions or more (shard() refuses those whose
tp x ulysses does not divide the heads); ZeRO 0 (and 1, 2, 3 with dp > 1); for a model with mixture-of-experts
layers, expert parallelism over every ep that divides dp and each layer's expert count (dropless); microbatches
dividing the global batch's share of a dp rank (1, 2, 4, 8 without a pipeline; pp, 2 pp, 4 pp with one); the 1F1B
and GPipe schedules; activation checkpointing off and on. What ``shard()`` refuses (heads or a vocabulary that tp
does not divide, heads that all-to-all cannot split over tp x sp (ring attention keeps every head of its rank, so
any sp; ring layouts, Ulysses x ring included, are priced only there), more stages than layers) is dropped with its
reason, as is every layout over the budget.

Pricing is cached: one :class:`~shardlib.analysis.layertable.LayerTable` per (tp, sp, mode, ulysses, checkpointing,
precision) (a
dry run of a two-layers-per-stack copy of the model, at two microbatch sizes), one report per (table, pp, dp,
microbatch size); ZeRO stage, schedule, microbatch count and ep only change the arithmetic (ep: the report at ep
priced from the one without it, :mod:`shardlib.analysis.expert_cost`).

Packed training (``mean_tokens``: the global batch's samples average that many tokens and are packed into rows of
``seq``, as ``fit(packing=seq)`` does): each layout is priced on the rows packing makes, ``ceil(global_batch x
mean_tokens / seq)`` padded up to a multiple of dp x microbatches (the packer's empty rows), so any dp and microbatch
count is a candidate; the table then reports real tokens per second, ``global_batch x mean_tokens / step``. Ring
layouts carry the documents as data and compute each only against itself: their attention FLOPs are priced at
``seq x mean_tokens`` a row instead of ``seq^2`` (:func:`packed_attention`); the others build a dense document mask
and compute the whole row.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace

from ..sharding.plan import PlanError
from .costmodel import Prediction, predict
from .expert_cost import ep_sizes, expert_counts, expert_parallel_report
from .dryrun_report import LayerWork, PlanReport, size_text
from .layertable import LayerTable
from .layout import SHARD_MODES as MODES, Layout
from .metarun import PlanInputError, meta_model, planned_policy
from .profile import Profile, default_profile
from .search_workers import Makers, workers_for


@dataclass
class SearchResult:
    """``ranked``: the layouts that fit, fastest first; ``over_budget``: those that do not (smallest peak first);
    ``refused``: (what, why) of what shard() or the Trainer refuses; ``dominated``: layouts left unpriced because
    they are slower than one that fits (activation checkpointing where the layout fits without it);
    ``seconds``: the search's own time."""

    world: int
    memory_bytes: int | None
    profile: str
    ranked: list[Prediction] = field(default_factory=list)
    over_budget: list[Prediction] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    dominated: int = 0  # checkpointed layouts not priced: the same layout without checkpointing fits
    seconds: float = 0.0
    real_tokens: float | None = None  # packed: the real tokens of a global batch

    def real_tokens_per_s(self, prediction: Prediction) -> float | None:
        """Packed: the real tokens a layout trains per second (None unpacked)."""
        return self.real_tokens / prediction.step_s if self.real_tokens is not None else None

    @property
    def best(self) -> Prediction | None:
        return self.ranked[0] if self.ranked else None

    def to_dict(self) -> dict:
        return {"world": self.world, "memory_bytes": self.memory_bytes, "profile": self.profile,
                "seconds": self.seconds, "dominated": self.dominated, "real_tokens": self.real_tokens,
                "ranked": [p.to_dict() | ({"real_tokens_per_s": self.real_tokens_per_s(p)} if self.real_tokens
                                          else {}) for p in self.ranked],
                "over_budget": [p.to_dict() for p in self.over_budget],
                "refused": [{"what": w, "why": y} for w, y in self.refused]}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shapes(world: int) -> list[tuple[int, int, int, int, str]]:
    """(dp, pp, sp, tp, sequence-parallel mode) of every mesh of ``world`` ranks."""
    shapes = []
    for tp in _divisors(world):
        for sp in _divisors(world // tp):
            for pp in _divisors(world // (tp * sp)):
                dp = world // (tp * sp * pp)
                modes = ["all_to_all", "ring"] if sp > 1 else (["off", "megatron"] if tp > 1 else ["off"])
                shapes += [(dp, pp, sp, tp, mode) for mode in modes]
    return shapes


def _microbatch_counts(per_dp: int, pp: int, packed: bool = False) -> list[int]:
    wanted = [pp, 2 * pp, 4 * pp] if pp > 1 else [1, 2, 4, 8]
    return [m for m in wanted if (m <= per_dp if packed else per_dp % m == 0)]


def ulysses_sizes(sp: int) -> list[int]:
    """The Ulysses group sizes of Ulysses x ring over ``sp`` ranks: every divisor of sp above 1 that leaves a ring of
    at least 2 positions (whether tp x ulysses divides the heads is shard()'s to say)."""
    return [u for u in _divisors(sp) if 1 < u < sp]


def candidate_layouts(world: int, global_batch: int, seq: int, *, checkpointing=(False, True),
                      precision: str = "fp32", packed_rows: int | None = None, experts=(),
                      ulysses: bool = False) -> list[Layout]:
    """Every layout of the enumeration (module docstring), before shard() and the budget have their say.
    ``packed_rows``: the rows of a packed global batch, which any dp x microbatches takes (padded with empty rows);
    ``experts``: the expert count of each MoE layer (none: a dense model, no ep); ``ulysses``: Ulysses x ring too,
    after each ring mesh's plain ring."""
    layouts = []
    rows = packed_rows or global_batch
    for dp, pp, sp, tp, mode in mesh_shapes(world):
        if packed_rows is None and global_batch % dp:
            continue
        for u in [1] + (ulysses_sizes(sp) if ulysses and mode == "ring" else []):
            for m, ep in itertools.product(_microbatch_counts(math.ceil(rows / dp), pp,
                                                              packed=packed_rows is not None), ep_sizes(dp, experts)):
                for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                    for schedule in ("1f1b", "gpipe") if pp > 1 else ("1f1b",):
                        for ckpt in checkpointing:
                            layouts.append(Layout(dp=dp, pp=pp, tp=tp, sp=sp, sequence_parallel=mode, zero=zero,
                                                  microbatches=m, schedule=schedule, activation_checkpointing=ckpt,
                                                  precision=precision, batch=math.ceil(rows / (dp * m)), seq=seq,
                                                  ep=ep, ulysses=u))
    return layouts


class _Pricer:
    """Layer tables and reports, cached (module docstring). ``mean_tokens``: rows packed with documents of that mean
    length (None: unpacked), whose attention ring layouts price as :func:`packed_attention` does."""

    def __init__(self, full, policy, device_type: str = "cpu", mean_tokens: float | None = None):
        self.full, self.policy, self.device_type, self.mean_tokens = full, policy, device_type, mean_tokens
        self.tables: dict[tuple, LayerTable | str] = {}
        self.reports: dict[tuple, object] = {}
        self.times: dict = {}  # the cost model's cache of microbatch times per stage
        self.makers: Makers | None = None  # worker processes dry-running tables ahead (search(workers=...))

    @staticmethod
    def key(layout: Layout) -> tuple:
        return (layout.tp, layout.sp, layout.sequence_parallel, layout.activation_checkpointing, layout.seq,
                layout.precision, layout.ulysses)

    def table(self, layout: Layout) -> LayerTable:
        key = self.key(layout)
        plain = self.tables.get(key[:3] + (False,) + key[4:])
        if isinstance(plain, str):  # shard() refused the mesh: checkpointing does not change that
            self.tables[key] = plain
        if key not in self.tables and layout.sequence_parallel == "ring":
            self._ring_only_past_the_heads(layout, key)
        if key not in self.tables:
            like = next((t for k, t in self.tables.items() if k[:3] == key[:3] and isinstance(t, LayerTable)), None)
            try:
                plain = self.table(replace(layout, activation_checkpointing=False)) \
                    if layout.activation_checkpointing else None
                made = self.makers.take(key) if self.makers is not None else None
                if isinstance(made, str):
                    raise PlanError(made)
                self.tables[key] = LayerTable(self.full, self.policy, tp=layout.tp, sp=layout.sp,
                                              mode=MODES[layout.sequence_parallel], mode_name=layout.sequence_parallel,
                                              activation_checkpointing=layout.activation_checkpointing,
                                              seq=layout.seq, like=like, precision=layout.precision,
                                              device_type=self.device_type, plain=plain, ulysses=layout.ulysses,
                                              runs=made)
            except (PlanError, PlanInputError) as exc:
                self.tables[key] = " ".join(str(exc).split())
        found = self.tables[key]
        if isinstance(found, str):
            raise PlanError(found)
        return found

    def _ring_only_past_the_heads(self, layout: Layout, key: tuple) -> None:
        """A ring layout is priced only where all-to-all cannot split the heads over tp x sp: at the same sp both
        keep 1/sp of every activation, and a ring table's dry run runs sp blocks per attention (at 64 ranks it made
        the search several times slower)."""
        try:  # without checkpointing, which changes no refusal: a checkpointed table is not built only to ask
            self.table(replace(layout, sequence_parallel="all_to_all", ulysses=1, activation_checkpointing=False))
        except PlanError:
            return
        self.tables[key] = (f"all-to-all splits the heads at tp={layout.tp} x sp={layout.sp}: ring layouts are "
                            "searched where it cannot (shardlib plan --sp ring N [--ulysses U] prices one)")

    def ask(self, layout: Layout) -> None:
        """Have the worker processes (``makers``) dry-run the table :meth:`table` will want for ``layout``: a ring
        layout's only once its mesh's all-to-all table shows that all-to-all cannot split the heads."""
        key = self.key(layout)
        if key in self.tables or isinstance(self.tables.get(key[:3] + (False,) + key[4:]), str):
            return
        probe = None
        if layout.sequence_parallel == "ring":
            probe = self.key(replace(layout, sequence_parallel="all_to_all", ulysses=1, activation_checkpointing=False))
            if probe in self.tables:
                if not isinstance(self.tables[probe], str):
                    return  # all-to-all splits the heads: no ring table
                probe = None
        self.makers.ask(key, probe)

    def report(self, layout: Layout):
        """The layout's report; at ep > 1 that of its mesh without ep, priced at ep
        (:func:`~shardlib.analysis.expert_cost.expert_parallel_report`)."""
        table = self.table(layout)
        key = (id(table), layout.pp, layout.dp, layout.batch)
        if self.mean_tokens is not None and layout.sequence_parallel == "ring":
            self._cached(key, lambda: packed_attention(table.report(layout), self.mean_tokens / layout.seq))
        else:
            self._cached(key, lambda: table.report(layout))
        if (layout.ep > 1 or layout.expert_capacity is not None) and not isinstance(self.reports[key], str):
            base, key = self.reports[key], key + (layout.ep, layout.expert_capacity)
            self._cached(key, lambda: expert_parallel_report(base, layout.ep, layout.expert_capacity))
        found = self.reports[key]
        if isinstance(found, str):
            raise PlanError(found)
        return found

    def _cached(self, key: tuple, make) -> None:
        """``reports[key] = make()``, or the one line of its refusal, once."""
        if key not in self.reports:
            try:
                self.reports[key] = make()
            except PlanError as exc:
                self.reports[key] = " ".join(str(exc).split())


def search(model_or_config, world: int, *, memory_bytes: int | None = None, profile: Profile | None = None,
           global_batch: int = 32, seq: int = 128, cls=None, policy=None, checkpointing=(False, True),
           precision: str = "fp32", mean_tokens: float | None = None, ulysses: bool = False,
           workers: int = 1) -> SearchResult:
    """Every layout of ``model_or_config`` on ``world`` ranks, priced (module docstring). ``memory_bytes``: the
    budget per rank (None: no budget). ``profile``: the machine (default: the built-in nominal one).
    ``mean_tokens``: the samples' mean length, packed into rows of ``seq`` (module docstring). ``ulysses``: Ulysses x
    ring layouts too (``shardlib plan --world`` searches them; the Trainer takes no ``ulysses`` yet, so ``--layout
    auto`` does not). ``workers``: processes forked to dry-run the layer tables (the same answer as one; ``shardlib
    plan --world`` takes a core each). Raises :class:`PlanInputError` for bad input and when no layout exists at all
    (saying which worlds would work)."""
    for name, value in (("world", world), ("global_batch", global_batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanInputError(f"{name} must be a positive integer, got {value!r}")
    if mean_tokens is not None and not 0 < mean_tokens <= seq:
        raise PlanInputError(f"packed samples' mean length must be in (0, seq={seq}] tokens, got {mean_tokens!r}")
    real_tokens = global_batch * mean_tokens if mean_tokens is not None else None
    started = time.perf_counter()
    full = meta_model(model_or_config, cls)
    profile = profile or default_profile()
    pricer = _Pricer(full, planned_policy(full, policy), profile.device, mean_tokens)
    experts = expert_counts(full, pricer.policy.plan(full, 1))
    result = SearchResult(world=world, memory_bytes=memory_bytes, profile=profile.machine, real_tokens=real_tokens)
    refused: dict[str, str] = {}
    fitting: set[Layout] = set()  # without checkpointing: their checkpointed twins are slower, never priced
    layouts = candidate_layouts(world, global_batch, seq, checkpointing=checkpointing, precision=precision,
                                packed_rows=math.ceil(real_tokens / seq) if real_tokens is not None else None,
                                experts=experts, ulysses=ulysses)
    plain = [la for la in layouts if not la.activation_checkpointing]
    checkpointed = [la for la in layouts if la.activation_checkpointing]
    twins: dict[tuple, list[Layout]] = {}  # a plain table's key -> the checkpointed layouts of its mesh
    for layout in checkpointed:
        twins.setdefault(_Pricer.key(replace(layout, activation_checkpointing=False)), []).append(layout)
    last = {_Pricer.key(layout): i for i, layout in enumerate(plain)}
    with workers_for(pricer, workers):
        for layout in plain if pricer.makers is not None else ():
            pricer.ask(layout)
        for i, layout in enumerate(plain + checkpointed):  # a checkpointed layout after its twin, which may dominate it
            if layout.activation_checkpointing and replace(layout, activation_checkpointing=False) in fitting:
                result.dominated += 1
                continue
            try:
                prediction = predict(pricer.report(layout), profile, layout, pricer.times)
            except PlanError as exc:
                refused.setdefault(_mesh_name(layout), str(exc).splitlines()[0])
            else:
                fits = memory_bytes is None or prediction.peak_bytes <= memory_bytes
                (result.ranked if fits else result.over_budget).append(prediction)
                if fits and not layout.activation_checkpointing:
                    fitting.add(layout)
            key = _Pricer.key(layout)
            if pricer.makers is not None and last.get(key) == i:  # the mesh's plain layouts are priced: its
                for twin in twins.get(key, ()):  # checkpointed ones that they do not dominate will be
                    if replace(twin, activation_checkpointing=False) not in fitting:
                        pricer.ask(twin)
    result.ranked.sort(key=lambda p: (p.step_s, p.peak_bytes))
    result.over_budget.sort(key=lambda p: p.peak_bytes)
    result.refused = sorted(refused.items())
    result.seconds = time.perf_counter() - started
    if not result.ranked and not result.over_budget:
        raise PlanInputError(_no_layout(world, global_batch, refused))
    return result


def price(model_or_config, layouts: list[Layout], profile: Profile | None = None, *, cls=None,
          policy=None, mean_tokens: float | None = None) -> list[Prediction | str]:
    """The search's prediction of each of ``layouts`` (the same tables and reports), or why it is refused;
    ``mean_tokens``: their rows packed with documents of that mean length (:func:`search`)."""
    full = meta_model(model_or_config, cls)
    profile = profile or default_profile()
    pricer = _Pricer(full, planned_policy(full, policy), profile.device, mean_tokens)
    out: list[Prediction | str] = []
    for layout in layouts:
        try:
            out.append(predict(pricer.report(layout), profile, layout, pricer.times))
        except PlanError as exc:
            out.append(str(exc).splitlines()[0])
    return out


def packed_attention(report: PlanReport, share: float) -> PlanReport:
    """``report`` (a ring layout's dry run, unmasked rows) with rows packed with documents: ring attention computes
    only each document against itself (masks as data, docs/masks.md), so a row of seq tokens in documents of mean
    length d costs about seq x d of its attention FLOPs, not seq^2: every call of the ring's blocks (``LayerWork.ring``,
    forward and backward, in ``gemms`` too) at ``share`` = d / seq of its FLOPs. Nothing else changes: the K/V blocks
    are priced as travelling the whole ring (an upper bound: the ring sends a block only to the ranks whose queries
    see it), and memory is linear in the length either way."""
    def packed(w: LayerWork) -> LayerWork:
        gemms = dict(w.gemms)
        for flops, calls in w.ring:
            gemms[flops] -= calls
        ring = [(round(flops * share), calls) for flops, calls in w.ring]
        for flops, calls in ring:
            gemms[flops] = gemms.get(flops, 0) + calls
        return replace(w, gemms=sorted((f, n) for f, n in gemms.items() if n), ring=ring)

    return replace(report, stages=[replace(s, work=[packed(w) for w in s.work]) for s in report.stages])


def _mesh_name(layout: Layout) -> str:
    return " ".join(layout.name().split()[:(4 if layout.sequence_parallel != "off" else 3) + (layout.ulysses > 1)])


def _no_layout(world: int, global_batch: int, refused: dict[str, str]) -> str:
    """Why ``world`` has no layout, and the world sizes near it that have one."""
    usable = [w for w in range(1, 2 * world + 1) if global_batch % w == 0]
    reasons = "; ".join(f"{k}: {v}" for k, v in list(refused.items())[:3])
    return (f"no layout of {world} ranks works (the global batch {global_batch} must split over dp"
            + (f"; {reasons}" if reasons else "") + f"). World sizes where pure data parallelism works: "
            + ", ".join(map(str, usable)))


# ------------------------------------------------------------------------------------------------------- text
def render(result: SearchResult, top: int = 15) -> str:
    budget = size_text(result.memory_bytes) if result.memory_bytes else "none"
    lines = [f"shardlib plan: {len(result.ranked)} layouts fit (budget {budget} per rank), "
             f"{len(result.over_budget)} over budget, {len(result.refused)} meshes refused, {result.dominated} "
             "dominated (checkpointing where the layout fits without it); "
             f"profile: {result.profile}; searched in {result.seconds:.1f} s", ""]
    rate = "tokens/s" if result.real_tokens is not None else "samples/s"
    width = max([44] + [len(p.layout.name()) for p in result.ranked[:top]])
    header = f"  {'#':>3} {'layout':<{width}} {'peak/rank':>11} {'step':>9} {rate:>10}  bottleneck"
    lines.append(header)
    for i, p in enumerate(result.ranked[:top], 1):
        per_s = result.real_tokens_per_s(p) if result.real_tokens is not None else p.samples_per_s
        lines.append(f"  {i:>3} {p.layout.name():<{width}} {size_text(p.peak_bytes):>11} {p.step_s * 1e3:>7.1f}ms "
                     f"{per_s:>10.1f}  {p.bottleneck} ({p.time[p.bottleneck] / p.step_s:.0%})")
    if not result.ranked and result.over_budget:
        lines.append(f"  {no_fit_message(result)}")
    if result.refused:
        lines += ["", "refused:"] + [f"  {what}: {why}" for what, why in result.refused[:8]]
        if len(result.refused) > 8:
            lines.append(f"  ... and {len(result.refused) - 8} more")
    return "\n".join(lines)


def no_fit_message(result: SearchResult) -> str:
    """Why nothing fits: the smallest peak found, its layout, and the term that dominates it."""
    small = result.over_budget[0]
    term = small.dominant_memory
    return (f"no layout fits {size_text(result.memory_bytes)} per rank: the smallest peak is "
            f"{size_text(small.peak_bytes)} ({small.layout.name()}), mostly {term} ({size_text(small.memory[term])})")
