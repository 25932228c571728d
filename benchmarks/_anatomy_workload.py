"""The workload of ``benchmarks/step_anatomy.py``: one BERT step per layout (an MLM training step, or the encoder's
forward and backward: :class:`Step`), kept alive in a :class:`_rank_pool.RankPool` per layout, timed and profiled on
command.

Layouts (``MODES``): ``unsharded`` (one process, both cores: a hand loop, what a user writes without shardlib),
``world1`` (the same model through ``shardlib.shard`` at a world of one and ``Trainer.train_step``), ``tp2`` and
``tp2_sp`` (two ranks of one thread each: ``shard`` at tp=2, without and with Megatron sequence parallelism, trained
by ``Trainer.train_step``, over the default transport: shared memory on one host), ``tp2_c10d`` and ``tp2_sp_c10d``
(the same over gloo's sockets), ``sp{2,4}_a2a`` and ``sp{2,4}_ring`` (sp ranks of one thread each at tp=1: Ulysses
all-to-all and ring attention). Every layout starts from the same weights (``torch.manual_seed(0)``) and the same
batches, and runs AdamW. ``layers`` overrides the size's depth, ``padding`` masks the last fraction of every row
(a padding attention mask), ``peak_step`` measures a step's peak of live tensors (long-sequence memory).

A profiled step is split into categories by each op's *self* time (``CATEGORIES``, first match wins; an op inside
the optimizer's step counts as optimizer, one inside the vocab-parallel cross-entropy as loss); what no op accounts for (Python, autograd bookkeeping, hooks, the
profiler's own cost) is ``host``.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import _checkout  # noqa: E402,F401  (shardlib from this checkout)
import _long_sequence  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODES = {  # name: (world, threads per rank, shard() options or None for the hand loop)
    "unsharded": (1, 2, None),
    "world1": (1, 2, {}),
    "tp2": (2, 1, {}),
    "tp2_sp": (2, 1, {"sequence_parallel": True}),
    "tp2_c10d": (2, 1, {}),
    "tp2_sp_c10d": (2, 1, {"sequence_parallel": True}),
    # data parallel (each rank the whole model on the same batch): ZeRO-1 with its parameter all-gathers waited for
    # in the step, or overlapped with the next forward (issue 35), against zero=0 (DDP)
    **{f"dp{n}{suffix}": (n, 1, {}) for n in (2, 4) for suffix in ("_zero0", "_zero1", "_zero1_overlap")},
    # sequence parallelism on an sp dimension (tp=1): Ulysses all-to-all against ring attention
    **{f"sp{n}_{kind}": (n, 1, {"sequence_parallel": option}) for n in (2, 4)
       for kind, option in (("a2a", "all_to_all"), ("ring", "ring"))},
}
#: what ``step_anatomy.py`` runs without ``--modes``
DEFAULT_MODES = ("unsharded", "world1", "tp2", "tp2_sp", "tp2_c10d", "tp2_sp_c10d")
#: init_mesh options of a layout (default: tp over its ranks, the default transport): the ``_c10d`` layouts move
#: tensors through gloo's sockets, the ``dp`` ones are data parallel
MESH_OPTIONS = {"tp2_c10d": {"tp": 2, "transport": "c10d"}, "tp2_sp_c10d": {"tp": 2, "transport": "c10d"},
                **{m: {"dp": MODES[m][0]} for m in MODES if m.startswith("dp")},
                **{m: {"tp": 1, "sp": MODES[m][0]} for m in MODES if m.startswith("sp")}}
#: Trainer options of a layout (default: none)
TRAINER_OPTIONS = {**{m: {"zero": 1} for m in MODES if m.endswith("_zero1")},
                   **{m: {"zero": 1, "overlap_param_gather": True} for m in MODES if m.endswith("_overlap")}}
TITLES = {"unsharded": "unsharded (hand loop)", "world1": "shardlib world of one", "tp2": "shardlib tp=2",
          "tp2_sp": "shardlib tp=2 + SP", "tp2_c10d": "shardlib tp=2, gloo transport",
          "tp2_sp_c10d": "shardlib tp=2 + SP, gloo transport",
          **{f"dp{n}_zero0": f"shardlib dp={n}, zero=0" for n in (2, 4)},
          **{f"dp{n}_zero1": f"shardlib dp={n}, zero=1" for n in (2, 4)},
          **{f"dp{n}_zero1_overlap": f"shardlib dp={n}, zero=1, overlapped gathers" for n in (2, 4)},
          **{f"sp{n}_a2a": f"shardlib sp={n} all-to-all" for n in (2, 4)},
          **{f"sp{n}_ring": f"shardlib sp={n} ring" for n in (2, 4)}}
SIZES = {
    "bert-base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "bert-small": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
    "bert-tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256),
    #: host-bound: each op's dispatch costs about what its arithmetic does (the Trainer's per-step work shows)
    "bert-host": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                      vocab_size=1000),
}

#: (category, substrings of an op's name): the first category with a match takes the op's self time
CATEGORIES = (
    ("ring p2p wait", ("ring wait",)),  # _long_sequence.RingProbe's marks: the ring's waits for K/V and dK/dV blocks
    ("collectives", ("c10d::", "gloo", "nccl", "_ReduceFromTP", "_CopyToTP", "_GatherFromTP", "_ScatterToTP",
                     "_ReduceScatterToTP", "_AllGatherFromTP", "_AllToAll", "_ColumnLinearBackward",
                     "all_reduce", "all_gather", "reduce_scatter")),
    ("GEMMs", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy")),
    ("attention", ("scaled_dot_product", "aten::_softmax", "aten::softmax", "_softmax_backward")),
    ("norms", ("layer_norm",)),
    ("casts/copies", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::stack",
                      "aten::contiguous")),
    ("element-wise", ("aten::",)),
)
ORDER = ("GEMMs", "attention", "loss", "element-wise", "norms", "casts/copies", "collectives", "ring p2p wait",
         "optimizer", "host")


def config(size: str, dropout: float, seq: int = 512, layers: int | None = None):
    import transformers

    fields = {"vocab_size": 30522, **SIZES[size], **({"num_hidden_layers": layers} if layers else {})}
    return transformers.BertConfig(**fields, max_position_embeddings=max(512, seq), hidden_dropout_prob=dropout,
                                   attention_probs_dropout_prob=dropout)


def batches(n: int, batch: int, seq: int, vocab: int = 30522, padding: float = 0.0) -> list[dict]:
    """MLM batches: random ids, 15% of positions labelled (the rest -100), the same on every rank; the attention
    mask hides the last ``padding`` fraction of every row."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = torch.where(torch.rand(batch, seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        mask = torch.ones_like(ids)
        mask[:, seq - int(seq * padding):] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


class Step:
    """One layout's model, optimizer and batches; ``run()`` is one step of ``workload``:

    * ``mlm``: a training step of ``BertForMaskedLM`` with AdamW: a hand loop for the unsharded model,
      ``Trainer.train_step`` for shardlib's layouts (what a user runs);
    * ``encoder``: forward and backward of ``BertModel`` with the loss ``last_hidden_state.pow(2).mean()``, no
      optimizer, a hand loop for every layout (``benchmarks/tp_throughput.py``'s workload: the layers alone).

    ``hand_loop``: a sharded model stepped by the hand loop instead of the Trainer (what the Trainer adds).
    """

    def __init__(self, mode: str, size: str, batch: int, seq: int, dropout: float, workload: str = "mlm",
                 hand_loop: bool = False, layers: int | None = None, padding: float = 0.0):
        import transformers

        import shardlib

        world, threads, options = MODES[mode]
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        cls = transformers.BertForMaskedLM if workload == "mlm" else transformers.BertModel
        model = cls(config(size, dropout, seq, layers))
        vocab = model.config.vocab_size
        self.data, self.i, self.world, self.workload = batches(4, batch, seq, vocab, padding), 0, world, workload
        self.ring = options is not None and options.get("sequence_parallel") == "ring"
        if workload == "encoder":
            self.data = [{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]} for b in self.data]
        make_optimizer = lambda params: torch.optim.AdamW(params, lr=1e-5)  # noqa: E731
        self.trainer = self.optimizer = None
        if options is None:
            self.model = model
            if workload == "mlm":
                self.optimizer = make_optimizer(model.parameters())
        else:
            mesh = shardlib.init_mesh(**MESH_OPTIONS.get(mode, {"tp": world}))
            self.model = shardlib.shard(model, mesh, **options)
            if workload == "mlm" and not hand_loop:
                self.trainer = shardlib.Trainer(self.model, make_optimizer, **TRAINER_OPTIONS.get(mode, {}))
            elif workload == "mlm":  # the sharded model in the unsharded model's hand loop
                self.optimizer = make_optimizer(self.model.parameters())

    def run(self, keep_grads: bool = False) -> float:
        batch = self.data[self.i % len(self.data)]
        self.i += 1
        if self.trainer is not None:
            return self.trainer.train_step(batch)
        if self.workload == "encoder":
            self.model.zero_grad(set_to_none=not keep_grads)
            loss = self.model(**batch).last_hidden_state.float().pow(2).mean()
            loss.backward()
            return loss.item()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(**batch).loss
        loss.backward()
        self.optimizer.step()
        return loss.item()


def setup(rank: int, world: int, mode: str, size: str, batch: int, seq: int, dropout: float, workload: str,
          layers: int | None = None, padding: float = 0.0) -> Step:
    step = Step(mode, size, batch, seq, dropout, workload, layers=layers, padding=padding)
    for _ in range(2):  # warm-up: allocator, optimizer state, first-call paths
        step.run()
    return step


def _over_ranks(wall: float, cpu: float, faults: int, world: int) -> tuple[float, float, float]:
    """(the slowest rank's wall seconds, the CPU seconds and minor page faults of all ranks together)."""
    if world == 1:
        return wall, cpu, float(faults)
    t = torch.tensor([wall], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    c = torch.tensor([cpu, faults], dtype=torch.float64)
    dist.all_reduce(c)
    return float(t[0]), float(c[0]), float(c[1])


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def serve(step: Step, command: str, steps: int = 1, variants: str = ""):
    if command == "time":  # the median step of ``steps``: (slowest rank's wall, all ranks' CPU time, page faults)
        times = []
        for _ in range(steps):
            if step.world > 1:
                dist.barrier()
            start, cpu, faults = time.perf_counter(), time.process_time(), _minor_faults()
            step.run()
            times.append(_over_ranks(time.perf_counter() - start, time.process_time() - cpu,
                                     _minor_faults() - faults, step.world))
        return sorted(times)[len(times) // 2]
    if command == "profile":
        return profile_steps(step, steps)
    if command == "peak":
        return _long_sequence.peak_step(step)
    if command == "switch":
        return switched_steps(step, variants, steps)
    raise ValueError(command)


def switched_steps(step: Step, variants: str, pairs: int) -> dict[str, list[float]]:
    """``pairs`` steps of each variant of ``_step_variants.SETS[variants]``, switched between consecutive steps
    (order reversed every other pair, two warm-up steps each): {variant: [slowest rank's wall seconds]}."""
    import _step_variants

    chosen = _step_variants.SETS[variants]
    names = list(chosen)
    for name in names * 2:
        chosen[name]()
        step.run()
    seconds = {name: [] for name in names}
    for i in range(pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            chosen[name]()
            if step.world > 1:
                dist.barrier()
            start = time.perf_counter()
            step.run()
            seconds[name].append(_over_ranks(time.perf_counter() - start, 0.0, 0, step.world)[0])
    chosen[names[0]]()
    return seconds


def profile_steps(step: Step, steps: int) -> dict:
    """Milliseconds per step by category over ``steps`` profiled steps (this rank's), and the profiled wall."""
    from torch.profiler import ProfilerActivity, profile

    if step.world > 1:
        dist.barrier()
    with _long_sequence.RingProbe() if step.ring else contextlib.nullcontext() as ring, \
            profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step.run()
        wall = time.perf_counter() - start
    totals = dict.fromkeys(ORDER, 0.0)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        totals[_category(event)] += event.self_cpu_time_total / 1e3
    accounted = sum(totals.values())
    totals["host"] = max(0.0, wall * 1e3 - accounted + totals["host"])
    return {"wall_ms": wall * 1e3 / steps, **{k: v / steps for k, v in totals.items()},
            **({"ring": ring.summary(steps)} if ring else {})}


def _category(event) -> str:
    parent = event
    while parent is not None:
        if parent.name.startswith("Optimizer.step") or parent.name.startswith("Optimizer.zero_grad"):
            return "optimizer"
        if "CrossEntropy" in parent.name:  # shardlib's vocab-parallel cross-entropy (an autograd Function)
            return "loss"
        parent = parent.cpu_parent
    for category, needles in CATEGORIES:
        if any(n in event.name for n in needles):
            return category
    return "host"


IN_PROCESS = {  # name: (shardlib at a world of one?, hand loop?)
    "unsharded": (False, True), "world1_hand": (True, True), "world1": (True, False)}
IN_PROCESS_TITLES = {"unsharded": "unsharded, hand loop", "world1_hand": "shardlib world of one, hand loop",
                     "world1": "shardlib world of one, Trainer.train_step"}


def in_process_steps(size: str, batch: int, seq: int, dropout: float) -> dict[str, Step]:
    """The three world-of-one variants in this one process (same weights, same batches): what sharding adds to the
    model, and what the Trainer adds to a hand loop, free of the per-process differences (memory placement, page
    faults) that move separate processes by +-20% on the shared machine."""
    steps = {}
    for name, (sharded, hand) in IN_PROCESS.items():
        steps[name] = Step("world1" if sharded else "unsharded", size, batch, seq, dropout, "mlm", hand_loop=hand)
        for _ in range(2):
            steps[name].run()
    return steps
