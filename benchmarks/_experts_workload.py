"""The ranks' side of ``benchmarks/experts.py``: a Switch Transformers model (fp32, AdamW by ``Trainer.train_step``) in
one layout of :data:`LAYOUTS`, kept alive in a ``_rank_pool.RankPool``, and what a rank measures on command
(:func:`serve`): ``bytes`` (parameters and AdamW state per rank, the experts' apart), ``time`` (a window of steps),
``anatomy`` (a step's collectives timed where the step waits for them, then each replayed alone), ``routing`` (what
the routers kept and the static capacity dropped)."""

from __future__ import annotations

import gc
import math
import threading
import time

import _checkout  # noqa: F401  (shardlib from this checkout)
import torch
import torch.distributed as dist
from _harness import machine_busy_s, status_kib

#: name: (ranks, ep, static capacity: the layout runs shard(expert_capacity=<--capacity>))
LAYOUTS = {"dp2": (2, 1, False), "ep2": (2, 2, False), "ep2_static": (2, 2, True),
           "dp4": (4, 1, False), "ep4": (4, 4, False)}
TITLES = {"dp2": "dp=2, experts replicated", "ep2": "ep=2 (dp=2), dropless",
          "ep2_static": "ep=2 (dp=2), static capacity", "dp4": "dp=4, experts replicated",
          "ep4": "ep=4 (dp=4), dropless"}
#: Switch-base-8's widths, 2 + 2 layers, one MoE layer in each stack; --quick: tiny widths
MODEL = dict(d_model=768, d_ff=3072, d_kv=64, num_heads=12, num_experts=8, num_layers=2, num_decoder_layers=2,
             encoder_sparse_step=2, decoder_sparse_step=2, vocab_size=32128, expert_capacity=64)
QUICK = dict(MODEL, d_model=64, d_ff=256, d_kv=16, num_heads=4, vocab_size=1000, expert_capacity=16)
FIXED = dict(dropout_rate=0.0, router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
MIB = 2 ** 20


def is_expert(name: str) -> bool:
    return ".experts." in name


class Run:
    """One rank of a layout: the sharded model, its Trainer, the global batches (this rank's share), the counts."""

    def __init__(self, rank, world, layout, model, batch, input_len, label_len, capacity, lr, batches, warmup):
        import transformers

        import shardlib
        from shardlib.sharding import experts as sharding_experts

        torch.set_num_threads(1)
        _, ep, static = LAYOUTS[layout]
        self.rank, self.world, self.layout, self.ep = rank, world, layout, ep
        self.mesh = shardlib.init_mesh(dp=world, ep=ep)
        self.config = transformers.SwitchTransformersConfig(**model, **FIXED)
        torch.manual_seed(0)
        net = transformers.SwitchTransformersForConditionalGeneration(self.config)
        self.model = shardlib.shard(net, self.mesh, expert_capacity=capacity if static else None)
        self.trainer = shardlib.Trainer(self.model, lambda params: torch.optim.AdamW(params, lr=lr))
        g = torch.Generator().manual_seed(1)
        vocab = self.config.vocab_size
        self.batches = [shardlib.dp_shard({"input_ids": torch.randint(2, vocab, (batch, input_len), generator=g),
                                           "labels": torch.randint(2, vocab, (batch, label_len), generator=g)},
                                          self.mesh) for _ in range(batches)]
        self.i = 0
        # what Switch's routers keep (their per-sequence capacity) and what the static capacity drops
        self.kept = self.routed = self.pairs = self.dropped = 0
        self.needed = 0.0  # the static capacity factor that would drop nothing so far (largest expert's share x E)
        for router in (m for m in self.model.modules() if type(m).__name__ == "SwitchTransformersTop1Router"):
            router.register_forward_hook(self._count_router)
        take = sharding_experts.take_counts  # the Trainer reads and resets the exchange's counts every step

        def counted(module):
            routed, dropped = take(module)
            self.pairs, self.dropped = self.pairs + routed, self.dropped + dropped
            return routed, dropped

        sharding_experts.take_counts = counted
        for _ in range(warmup):
            self.step()

    def _count_router(self, module, args, out) -> None:
        tokens = args[0].shape[0] * args[0].shape[1]
        per_expert = out[0].reshape(tokens, -1).sum(0)
        self.kept += int(per_expert.sum())
        self.routed += tokens
        self.needed = max(self.needed, float(per_expert.max()) * per_expert.numel() / tokens)

    def step(self) -> float:
        loss = self.trainer.train_step(self.batches[self.i % len(self.batches)])
        self.i += 1
        return loss


def setup(rank: int, world: int, **options) -> Run:
    return Run(rank, world, **options)


def serve(run: Run, command: str, **kwargs):
    gc.collect()
    return {"time": time_window, "bytes": held_bytes, "anatomy": anatomy, "routing": routing}[command](run, **kwargs)


def _max_sum(values: list[float], ops: list) -> list[float]:
    """Each value reduced over the ranks with its op (a float64 all-reduce per op)."""
    out = []
    for value, op in zip(values, ops):
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        out.append(t.item())
    return out


def time_window(run: Run, steps: int) -> dict:
    """``steps`` train_steps behind a barrier: the slowest rank's wall seconds per step, all ranks' CPU seconds, and
    the cores other processes used meanwhile (the machine's busy time less this layout's ranks')."""
    dist.barrier()
    busy0, cpu0, t0 = machine_busy_s(), time.process_time(), time.perf_counter()
    for _ in range(steps):
        run.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    busy = machine_busy_s() - busy0
    wall, cpu = _max_sum([wall, cpu], [dist.ReduceOp.MAX, dist.ReduceOp.SUM])
    return {"step_s": wall / steps, "cpu_s": cpu / steps, "foreign_cores": max(0.0, (busy - cpu) / wall)}


def held_bytes(run: Run) -> dict:
    """This rank's parameter and AdamW-state bytes (after a step: the state exists), the experts' apart; peak RSS."""
    from shardlib.train.optim import param_state

    out = dict.fromkeys(("expert_param", "expert_opt", "param", "opt"), 0)
    for name, p in run.model.named_parameters():
        state = sum(v.numel() * v.element_size() for v in param_state(run.trainer.optimizer, p).values()
                    if torch.is_tensor(v))
        for prefix in ("expert_", "") if is_expert(name) else ("",):
            out[prefix + "param"] += p.numel() * p.element_size()
            out[prefix + "opt"] += state
    out["expert_tensors"] = sum(is_expert(n) for n, _ in run.model.named_parameters())
    out["peak_rss"] = status_kib("VmHWM") * 1024
    return out


def routing(run: Run) -> dict:
    """Since setup (warm-up included), this rank's tokens: routed and kept by Switch's routers, (token, expert)
    pairs handed to the exchange and dropped by the static capacity."""
    return {"router_tokens": run.routed, "router_kept": run.kept, "exchange_pairs": run.pairs,
            "capacity_dropped": run.dropped, "steps": run.i, "factor_dropping_nothing": run.needed}


class Collectives:
    """Inside the ``with`` block, every ``all_to_all_single`` and ``all_reduce`` this process issues, timed: a blocking
    call from its start to its return (what the step waits), an asynchronous one (DDP's buckets) from its launch to
    its completion (in flight beside backward); and each backward's tail after its last asynchronous launch (DDP's
    wait for its last buckets). ``calls``: (kind, seconds, bytes sent to other ranks, replay args)."""

    def __init__(self, rank: int):
        self.rank, self.calls, self.lock = rank, [], threading.Lock()
        self.last_launch = None

    def _note(self, kind, seconds, nbytes, replay):
        with self.lock:
            self.calls.append((kind, seconds, nbytes, replay))

    def __enter__(self):
        self.saved = (dist.all_to_all_single, dist.all_reduce, torch.autograd.backward)
        a2a, all_reduce, backward = self.saved

        def all_to_all_single(out, x, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            start = time.perf_counter()
            work = a2a(out, x, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                       group=group, async_op=async_op)
            seconds = time.perf_counter() - start
            if x.is_floating_point():
                kind = "a2a rows bwd" if torch._C._current_graph_task_id() != -1 else "a2a rows fwd"
            else:
                kind = "a2a counts" if input_split_sizes is None else "a2a expert index"
            send = input_split_sizes or [x.shape[0] // dist.get_world_size(group)] * dist.get_world_size(group)
            me = dist.get_rank(group)
            row = x[0].numel() * x.element_size() if x.shape[0] else 0
            self._note(kind, seconds, row * (sum(send) - send[me]),
                       (tuple(out.shape), tuple(x.shape), x.dtype, output_split_sizes, input_split_sizes, group))
            return work

        def all_reduce_timed(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
            start = time.perf_counter()
            work = all_reduce(t, op=op, group=group, async_op=async_op)
            nbytes = t.numel() * t.element_size()
            kind = "all-reduce gradients" if async_op or (t.dtype == torch.float32 and t.numel() > 1024) \
                else "all-reduce small"
            if not async_op:
                self._note(kind + " (blocking)", time.perf_counter() - start, nbytes, (nbytes, group))
                return work
            self.last_launch = time.perf_counter()
            work.get_future().then(lambda _: self._note(kind + " (DDP, in flight)", time.perf_counter() - start,
                                                        nbytes, (nbytes, group)))
            return work

        def backward_timed(*args, **kwargs):
            self.last_launch = None
            out = backward(*args, **kwargs)
            if self.last_launch is not None:
                self._note("DDP wait after its last bucket", time.perf_counter() - self.last_launch, 0, None)
            return out

        dist.all_to_all_single, dist.all_reduce, torch.autograd.backward = (all_to_all_single, all_reduce_timed,
                                                                            backward_timed)
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.all_reduce, torch.autograd.backward = self.saved

    def replay(self) -> dict:
        """Each recorded exchange and gradient all-reduce again, alone: behind a barrier, nothing else running; the
        seconds per kind (every rank replays its own sequence, which pairs with the others' as the step's did)."""
        a2a, all_reduce, _ = self.saved
        alone: dict[str, float] = {}
        for kind, _, _, args in self.calls:
            if args is None or kind.startswith("all-reduce small"):
                continue
            if kind.startswith("a2a"):
                out_shape, x_shape, dtype, recv, send, group = args
                x, out = torch.ones(x_shape, dtype=dtype), torch.empty(out_shape, dtype=dtype)
                dist.barrier()
                start = time.perf_counter()
                a2a(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
            else:
                nbytes, group = args
                x = torch.ones(nbytes // 4)
                dist.barrier()
                start = time.perf_counter()
                all_reduce(x, group=group)
            key = "all-reduce gradients" if kind.startswith("all-reduce") else kind
            alone[key] = alone.get(key, 0.0) + time.perf_counter() - start
        return alone


def anatomy(run: Run, steps: int) -> dict:
    """``steps`` train_steps under :class:`Collectives`: per step, the slowest rank's wall and, per kind of
    collective, this rank's seconds, calls and MiB sent; the same collectives replayed alone; the rows this rank's
    experts computed (the dropless exchange's load)."""
    probe = Collectives(run.rank)
    walls = []
    optimizer_step = run.trainer.optimizer_step

    def timed_optimizer_step():  # not a collective: what AdamW costs beside them
        start = time.perf_counter()
        optimizer_step()
        probe._note("AdamW step (no collective)", time.perf_counter() - start, 0, None)

    run.trainer.optimizer_step = timed_optimizer_step
    try:
        with probe:
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                run.step()
                walls.append(time.perf_counter() - start)
    finally:
        del run.trainer.optimizer_step
    time.sleep(0.05)  # the last futures' callbacks
    wall = _max_sum([sum(walls)], [dist.ReduceOp.MAX])[0]
    kinds: dict[str, dict] = {}
    for kind, seconds, nbytes, _ in probe.calls:
        k = kinds.setdefault(kind, {"ms": 0.0, "calls": 0, "mib_sent": 0.0})
        k["ms"] += seconds * 1e3 / steps
        k["calls"] += 1 / steps
        k["mib_sent"] += nbytes / MIB / steps
    forward = [args for kind, _, _, args in probe.calls if kind == "a2a rows fwd"]
    rows = sum(args[0][0] for args in forward[::2])  # per MoE layer: dispatch, then combine; a dispatch's output rows
    alone = {k: v * 1e3 / steps for k, v in probe.replay().items()}
    return {"step_ms": wall * 1e3 / steps, "kinds": kinds, "alone_ms": alone,
            "rows_received_fwd": rows / steps, "steps": steps}


def layout_parameters(layout: str, model: dict) -> dict:
    """Parameter counts of ``model`` at ``layout`` (meta device): total and experts, per rank."""
    import transformers

    with torch.device("meta"):
        net = transformers.SwitchTransformersForConditionalGeneration(
            transformers.SwitchTransformersConfig(**model, **FIXED))
    experts = sum(p.numel() for n, p in net.named_parameters() if is_expert(n))
    total = sum(p.numel() for p in net.parameters())
    ep = LAYOUTS[layout][1]
    return {"total": total, "experts": experts, "per_rank": total - experts + math.ceil(experts / ep)}
