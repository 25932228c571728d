"""The measurement half of ``benchmarks/plan_accuracy.py``: one training layout of one model on 4 gloo ranks, its
peak memory growth per rank and its step time, to compare with what the cost model predicts.

``measure(model_name, layout)`` starts the ranks (gloo on loopback, ``fn(rank, world, port, *args)`` as in
``_harness.spawn_ranks``, a deadline after which every rank is killed, collectives time out at the same bound) and
returns one dict (``measure``'s docstring). Per rank, in this order:

* **Baseline** ``baseline``: VmRSS (and RssAnon, RssFile) after every module the run uses is imported
  (``PRELOAD``; ``late_imports`` lists any loaded later) and the process group is up, after ``gc.collect()`` and
  ``malloc_trim``, before anything of the model exists. The cost model predicts the growth above it.
* **Loading straight into shards**: the driver writes the model once (random weights, seed 0, transformers'
  ``save_pretrained``, cached under ``ckpt_root``); each rank builds it on the meta device and reads only its
  shards (``shardlib.from_pretrained``): no rank ever holds the whole model, the baseline needs no correction.
  Then the Trainer (AdamW, foreach default; ``param_bytes``: this rank's parameters, ``opt_state_bytes``).
* **Memory** (malloc with a 64 KiB mmap threshold, below): ``warmup`` steps (the first creates AdamW's state;
  DDP, ZeRO and the pipeline schedules settle), VmHWM reset to the current RSS (``reset_peak_rss``),
  ``mem_steps`` steps: ``peak_growth = hwm - baseline.total`` (weights, optimizer state, gradients, the step's
  transient peak), ``peak_growth_anon``: the same less ``file_growth`` (library code pages first touched after the
  baseline: 18-32 MiB a rank, depending on how the rank was started; not the model's). The peak is deterministic:
  the same MiB in every repeat (measured), so one memory step is enough. ``hwm_lifetime``: loading and warm-up too.
* **Time** (malloc as its defaults settle, below): one untimed step, then ``steps`` steps each between two
  barriers (``gc.collect()`` before, outside the clock); a step's time is the slowest rank's. ``foreign_cores``:
  other processes' CPU use over the timed window (the machine's busy time less the ranks'); ``hwm_timed``.

**Malloc.** During the memory steps blocks of 64 KiB or more get their own mmap (``mallopt(M_MMAP_THRESHOLD,
mmap_threshold)``, what ``MALLOC_MMAP_THRESHOLD_=65536`` sets for a spawned rank) and go back to the OS when freed,
so RSS follows the live tensors: the peak is the same in every repeat. Under glibc's defaults freed activations
stay in the heap: the peak is 10-20% higher and moves by 5-9% between repeats (BERT-256 dp4: 257-275 MiB
against 223 MiB every time; sp4: 330-361 against 302). But mmap'ing every block page-faults fresh pages on every
step: up to 30% slower steps. So the timed steps run with the thresholds where glibc's dynamic ones settle (mmap
from 32 MiB, trim from 64 MiB); their times are within the run-to-run spread of runs under the defaults (dp4
0.63-0.64 s against 0.61-0.73 s). ``mmap_threshold=None``: the defaults throughout.

**Starting the ranks.** By default they are forked from a forkserver that imported ``PRELOAD`` once
(``forkserver_ranks``; it lives as long as the calling process): 0.7-0.9 s from the call to a rank's baseline,
against ~7-14 s for ``start_method="spawn"`` (4 interpreters importing torch, transformers and shardlib on 2 cores)
plus ~8 s for them to exit. Both re-import the caller's ``__main__`` module in every rank (multiprocessing's
rule): keep the calling script's top level cheap and its work under ``if __name__ == "__main__"``.

Every rank runs one intra-op thread (4 ranks on this 2-core machine); the batches are
``_plan_accuracy_layouts.make_batch`` (the same global batch on every rank; ``dp_shard`` takes this rank's share).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import loopback_ifname, median_spread, reset_peak_rss, spawn_ranks  # noqa: E402
from _harness import machine_busy_s, status_kib  # noqa: E402
from _plan_accuracy_layouts import GLOBAL_BATCH, MODELS, SEQ, Layout, layouts, make_batch  # noqa: E402

WORLD = 4
WARMUP = 1  # with the untimed step before the timed ones: the peak equals that after 2 (measured, 5 layouts)
MMAP_THRESHOLD = 65536
CKPT_ROOT = Path(tempfile.gettempdir()) / "shardlib-plan-accuracy"
MIB = 2 ** 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
# every module a rank imports, loaded before its baseline (a rank's record lists any it still loaded later,
# ``late_imports``: their memory would count as the model's)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.pipelining", "torch.utils.checkpoint",
           "torch.profiler._cupti_monitor", "transformers", "transformers.models.bert.modeling_bert",
           "transformers.models.t5.modeling_t5", "transformers.models.vit.modeling_vit",
           "transformers.models.llama.modeling_llama", "shardlib", "shardlib.sharding.inference.cuts",
           "shardlib.sharding.inference.verify",
           "shardlib.checkpoint.loading", "shardlib.sharding.sharder", "shardlib.sharding.sequence",
           "shardlib.sharding.all_to_all", "shardlib.policies.bert", "shardlib.policies.t5", "shardlib.pipeline",
           "shardlib.kernels.attention", "shardlib.kernels.epilogues", "shardlib.kernels.fused_qkv",
           "shardlib.train.trainer", "shardlib.train.zero", "shardlib.train.fsdp", "shardlib.train.optim",
           "_plan_accuracy_layouts"]
__all__ = ["MODELS", "layouts", "measure", "ensure_checkpoint", "Layout", "WORLD"]


# ================================================================================================ driver side
def ensure_checkpoint(model_name: str, layers: int | None = None, root: str | Path | None = None) -> Path:
    """The HF checkpoint (random weights, seed 0) the ranks load, written once per model and layer count: built
    whole in this process, ``save_pretrained`` into a scratch folder renamed into place (a torn write is never
    reused); the folder name carries a hash of the config, so a changed config writes a new one."""
    spec = MODELS[model_name]
    config = spec.config(layers)
    digest = hashlib.sha1(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:10]
    path = Path(root or CKPT_ROOT) / f"{model_name}-L{layers or spec.layers}-{digest}"
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, spec.cls)(config)  # whole, in this process only
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent if path.parent.exists() else None))
    model.save_pretrained(scratch)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(scratch, path)
    except OSError:  # another process wrote it first
        shutil.rmtree(scratch, ignore_errors=True)
    del model
    gc.collect()
    return path


def measure(model_name: str, layout: Layout, steps: int = 5, deadline_s: float = 300.0, *, warmup: int = WARMUP,
            mem_steps: int = 1, layers: int | None = None, ckpt_root: str | Path | None = None,
            mmap_threshold: int | None = MMAP_THRESHOLD, start_method: str = "forkserver",
            where: bool = False) -> dict:
    """Train ``layout`` of ``model_name`` (``layers`` layers per stack) on ``layout.world`` ranks for
    ``warmup + mem_steps + 1 + steps`` steps (module docstring) and return ``{per_rank: [...],
    peak_growth_bytes, peak_growth_anon_bytes (max over ranks), step_s (per timed step, the slowest rank),
    step_s_median, step_s_min, step_s_max, foreign_cores, wall_s, error, ...}`` and the run's settings.
    ``error``: why the run gave no numbers (a rank's exception, or ``deadline_s`` passed and every rank was
    killed); the numbers are then None. ``start_method``: "forkserver" (ranks forked from a server that imported
    everything once) or "spawn" (``_harness.spawn_ranks``: fresh interpreters, ~15 s more per call here).
    ``where``: each rank's record also lists the storages its memory steps created that were alive at their peak
    (``peak_storages``: MiB, the op that made it, its serial number among the step's ops; :class:`PeakStorages`)."""
    started = time.perf_counter()
    spec = MODELS[model_name]
    ckpt = ensure_checkpoint(model_name, layers, ckpt_root)
    out = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
    job = dict(model=model_name, layers=layers, layout=layout.to_dict(), steps=steps, warmup=warmup,
               mem_steps=mem_steps, ckpt=str(ckpt), out=str(out), timeout_s=max(30.0, deadline_s),
               t_spawn=time.time(), mmap_threshold=mmap_threshold, where=where,
               ifname=os.environ.get("GLOO_SOCKET_IFNAME") or loopback_ifname())
    # spawned ranks read MALLOC_MMAP_THRESHOLD_ at startup; forked ones call mallopt (the server keeps its env)
    env = {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold) if mmap_threshold and start_method == "spawn" else None,
           "OMP_NUM_THREADS": "1"}
    saved = {k: os.environ.pop(k, None) for k in env}
    os.environ.update({k: v for k, v in env.items() if v is not None})
    try:
        launch = spawn_ranks if start_method == "spawn" else forkserver_ranks
        error = launch(_rank, layout.world, (job,), deadline_s)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    per_rank = [_read(out / f"rank{r}.json") for r in range(layout.world)]
    shutil.rmtree(out, ignore_errors=True)
    if error is None and None in per_rank:
        error = "a rank wrote no result"
    result = dict(model=model_name, layers=layers or spec.layers, layout=layout.to_dict(), name=layout.name(),
                  global_batch=layout.global_batch, seq=layout.seq, dec_seq=spec.dec_seq, steps=steps,
                  warmup=warmup, mem_steps=mem_steps, mmap_threshold=mmap_threshold, start_method=start_method,
                  error=error, wall_s=time.perf_counter() - started)
    return dict(result, **_summary(per_rank if error is None else None))


def forkserver_ranks(fn, nprocs: int, args: tuple, deadline_s: float) -> str | None:
    """:func:`_harness.spawn_ranks` with the ranks forked from a forkserver that imported ``PRELOAD`` once (the
    first call starts it; it lives as long as this process): a rank starts in a fraction of a second instead of
    re-importing torch, transformers and shardlib (~5 s of CPU each, 4 ranks on 2 cores). Same contract:
    ``fn(rank, nprocs, port, *args)``, None when all finished, else why not (the others killed)."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(PRELOAD + [__name__])
    return spawn_ranks(fn, nprocs, args, deadline_s, start_method="forkserver", poll_s=0.2)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _summary(per_rank: list[dict] | None) -> dict:
    """The figures over ranks: peak growth (max over ranks), step time (per step the slowest rank; median and
    range over the timed steps); None where no run finished."""
    if per_rank is None:
        keys = ("per_rank", "peak_growth_bytes", "peak_growth_anon_bytes", "step_s", "step_s_median", "step_s_min",
                "step_s_max", "loss", "foreign_cores")
        return dict.fromkeys(keys)
    step_s = [max(r["step_s"][i] for r in per_rank) for i in range(len(per_rank[0]["step_s"]))]
    median, lo, hi = median_spread(step_s)
    own = sum(r["cpu_s"] for r in per_rank)  # every rank's CPU time over the timed steps, against the machine's
    foreign = max(0.0, (per_rank[0]["busy_s"] - own) / per_rank[0]["window_s"])
    return dict(per_rank=per_rank, peak_growth_bytes=max(r["peak_growth"] for r in per_rank),
                peak_growth_anon_bytes=max(r["peak_growth_anon"] for r in per_rank), step_s=step_s,
                step_s_median=median, step_s_min=lo, step_s_max=hi, loss=per_rank[0]["losses"][-1],
                foreign_cores=foreign)


# ================================================================================================== rank side
def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _rss() -> dict:
    """This process's resident bytes now: ``total`` (VmRSS), ``anon`` (RssAnon), ``file`` (RssFile: code and
    read-only data of the libraries, which a forked rank faults in on first use) and ``peak`` (VmHWM)."""
    return {k: status_kib(f) * 1024 for k, f in (("total", "VmRSS"), ("anon", "RssAnon"), ("file", "RssFile"),
                                                 ("peak", "VmHWM"))}


def _settled_rss() -> dict:
    """:func:`_rss` after a full collection and ``malloc_trim`` (what is live, not what malloc keeps)."""
    gc.collect()
    _malloc_trim()
    return _rss()


def _preload() -> None:
    """Import everything a rank uses before its baseline (module memory is not the model's): ``PRELOAD``, which
    the forkserver also imports once for all ranks."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)


def _resolve_plan(spec, job: dict) -> None:
    """Resolve the model's plan before the baseline, as ``shard()`` will (``resolve_policy``; inferred once per
    class and config structure, then cached). For a family without a hand policy the inference imports torch.export,
    AOT autograd and networkx (~400 modules, 20-27 MiB of RSS once per process, measured for llama-256): runtime,
    not the model's memory, and what ``late_imports`` exists to keep out of the peak."""
    from shardlib.analysis.metarun import meta_model
    from shardlib.sharding.sharder import resolve_policy

    resolve_policy(meta_model(spec.config(job.get("layers")), spec.cls))


def _mallopt(param: int, value: int) -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt(param, int(value))
    except (OSError, AttributeError):
        pass


def _mallopt_mmap(threshold: int | None) -> None:
    """``mallopt(M_MMAP_THRESHOLD, threshold)``: what ``MALLOC_MMAP_THRESHOLD_`` sets at startup, for a rank forked
    from the forkserver (started once, with the environment of its time)."""
    if threshold is not None:
        _mallopt(M_MMAP_THRESHOLD, threshold)


def _mallopt_heap() -> None:
    """Where glibc's dynamic thresholds settle once tensors have been freed: blocks under 32 MiB from the heap
    (reused, no page faults), the heap's top trimmed beyond 64 MiB (the dynamic mode cannot be switched back on)."""
    _mallopt(M_MMAP_THRESHOLD, 32 * MIB)
    _mallopt(M_TRIM_THRESHOLD, 64 * MIB)


def _rank(rank: int, world: int, port: int, job: dict) -> None:
    """One rank of :func:`measure`: the baseline, the model loaded into its shards, the Trainer, the memory steps
    and the timed steps; its record goes to ``job['out']/rank{rank}.json``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME=job["ifname"],
                      OMP_NUM_THREADS="1")
    import warnings

    import torch

    for message in ("`gradient_checkpointing_enable` is deprecated", ".*returned a view tensor"):
        warnings.filterwarnings("ignore", message=message)  # printed by every rank, about code not ours
    torch.set_num_threads(1)
    _mallopt_mmap(job["mmap_threshold"])
    _preload()
    import torch.distributed as dist

    import shardlib

    layout, spec = Layout(**job["layout"]), MODELS[job["model"]]
    mesh = shardlib.init_mesh(dp=layout.dp, pp=layout.pp, tp=layout.tp, sp=layout.sp, timeout_s=job["timeout_s"])
    _resolve_plan(spec, job)
    modules = set(sys.modules)
    rec = dict(rank=rank, baseline=_settled_rss(), timeline={})
    gc.freeze()  # what exists now is never garbage: the collections before the steps scan the new objects only
    mark = lambda phase: rec["timeline"].__setitem__(phase, round(time.time() - job["t_spawn"], 2))  # noqa: E731
    mark("baseline")
    tr, batches = _build(job, layout, spec, mesh, rec)
    mark("built")
    rec["losses"] = _memory_steps(tr, batches, job, rec, mark) + _timed_steps(tr, batches, job, rec, mark)
    rec["late_imports"] = sorted(set(sys.modules) - modules)  # their memory counts as the model's: keep it empty
    base, after = rec["baseline"], rec["after_steps"]
    rec["peak_growth"] = rec["hwm"] - base["total"]
    rec["file_growth"] = after["file"] - base["file"]  # code pages first touched after the baseline
    rec["peak_growth_anon"] = rec["peak_growth"] - rec["file_growth"]
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(rec))
    dist.barrier()
    dist.destroy_process_group()


def _memory_steps(tr, batches: list, job: dict, rec: dict, mark) -> list[float]:
    """``job['warmup']`` steps, the peak reset, ``job['mem_steps']`` steps under the small mmap threshold; into
    ``rec``: the peak (VmHWM) over those steps, the lifetime peak before the reset (loading, warm-up), the
    optimizer state this rank holds, the RSS before and after. Returns the losses."""
    from shardlib.train.optim import held_state_bytes

    losses = [float(tr.train_step(batches[i % len(batches)])) for i in range(job["warmup"])]
    mark("warm")
    rec["hwm_lifetime"] = status_kib("VmHWM") * 1024
    rec["opt_state_bytes"] = held_state_bytes(tr.optimizer, tr.params)
    rec["before_steps"] = _settled_rss()
    rec["reset_ok"] = reset_peak_rss()
    probe = PeakStorages() if job.get("where") else contextlib.nullcontext()
    with probe:
        losses += [float(tr.train_step(batches[i % len(batches)])) for i in range(job["mem_steps"])]
    if job.get("where"):
        rec["peak_storages"] = probe.at_peak
    mark("memory")
    rec["after_steps"] = _rss()
    rec["hwm"] = rec["after_steps"]["peak"]
    rec["hwm_lifetime"] = max(rec["hwm_lifetime"], rec["hwm"])
    return losses


class PeakStorages:
    """Where a step's peak comes from: a dispatch mode that follows every storage of 64 KiB or more the ops inside
    it create (not views, not an op's own inputs: in-place ops; freed when the storage dies, by a weak reference)
    and keeps the list of those alive when their sum peaked: ``at_peak`` = [(MiB, op, serial number of the op)],
    largest first. What ``benchmarks/plan_accuracy.py --where`` prints (it found the gloo reduce-scatter's scratch
    buffer and the sequence-parallel buckets held to backward's end). Tensors made outside it (the parameters, the
    optimizer state) are not counted."""

    SMALLEST = 65536
    KEEP = 30

    def __init__(self):
        import weakref

        import torch
        from torch.utils._pytree import tree_leaves
        from torch.utils._python_dispatch import TorchDispatchMode

        self._weakref, self._tensor, self._leaves = weakref.ref, torch.Tensor, tree_leaves
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.ops += 1
                if not func.is_view:
                    outer.created(func, args, kwargs or {}, out)
                return out

        self.mode, self.live, self.total, self.peak, self.ops, self.at_peak = Mode(), {}, 0, 0, 0, []

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def created(self, func, args, kwargs, out) -> None:
        inputs = {t.untyped_storage()._cdata for t in self._leaves((args, kwargs)) if isinstance(t, self._tensor)}
        for t in self._leaves(out):
            if not isinstance(t, self._tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            if key in self.live or key in inputs or nbytes < self.SMALLEST:
                continue
            self.live[key] = (nbytes, str(func), self.ops, self._weakref(storage, self._freed(key)))
            self.total += nbytes
            if self.total > self.peak:
                self.peak = self.total
                self.at_peak = sorted(((round(v[0] / MIB, 2), v[1], v[2]) for v in self.live.values()),
                                      reverse=True)[:self.KEEP]

    def _freed(self, key: int):
        def callback(_ref):
            entry = self.live.pop(key, None)
            if entry is not None:
                self.total -= entry[0]

        return callback


def _timed_steps(tr, batches: list, job: dict, rec: dict, mark) -> list[float]:
    """With malloc back to what its default settles at (``_mallopt_heap``), one untimed step that grows the heap,
    then ``job['steps']`` steps each between barriers; into ``rec``: the step times, the CPU time of this rank
    and of the machine over the timed window (other processes' load), the peak over the timed steps
    (``hwm_timed``: what a user sees, malloc's cached heap included). Returns the losses."""
    import torch.distributed as dist

    if job["mmap_threshold"] is not None:
        _mallopt_heap()
    losses = [float(tr.train_step(batches[0]))]
    rec["reset_ok"] = reset_peak_rss() and rec["reset_ok"]
    step_s, busy0, cpu0, wall0 = [], machine_busy_s(), time.process_time(), time.perf_counter()
    for i in range(job["steps"]):
        gc.collect()
        dist.barrier()
        start = time.perf_counter()
        losses.append(float(tr.train_step(batches[(i + 1) % len(batches)])))
        dist.barrier()
        step_s.append(time.perf_counter() - start)
    rec.update(window_s=time.perf_counter() - wall0, cpu_s=time.process_time() - cpu0,
               busy_s=machine_busy_s() - busy0, step_s=step_s, hwm_timed=status_kib("VmHWM") * 1024)
    mark("timed")
    return losses


def _build(job: dict, layout: Layout, spec, mesh, rec: dict):
    """This rank's shards read from the checkpoint, the Trainer (AdamW, foreach default) and the generated
    batches (two distinct global batches, this dp rank's share); notes the static bytes in ``rec``."""
    import torch
    import transformers

    import shardlib
    from shardlib.sharding.sharded import shard_state
    from shardlib.train.fsdp import local

    torch.manual_seed(0)  # the same default generator on every rank (the Trainer checks it)
    model = shardlib.from_pretrained(getattr(transformers, spec.cls), job["ckpt"], mesh,
                                     config=spec.config(job["layers"]), sequence_parallel=layout.shard_mode())
    rec["loaded"] = _settled_rss()
    tr = shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=1e-4),
                          microbatches=layout.microbatches, schedule=layout.schedule, zero=layout.zero,
                          activation_checkpointing=layout.activation_checkpointing, precision=layout.precision)
    state = shard_state(model)
    rec["param_bytes"] = sum(local(p).numel() * p.element_size() for p in tr.params)
    rec["stages"] = len(state.pipeline.local_stages) if state.pipeline else 0
    batches = [shardlib.dp_shard(make_batch(spec, layout.global_batch, layout.seq, seed=s), mesh) for s in (0, 1)]
    rec["trainer"] = _settled_rss()
    return tr, batches


def _main() -> int:
    layout = layouts("bert-256")[0]
    print(f"bert-256, {layout.name()}: global batch {GLOBAL_BATCH} x {SEQ} tokens, {WORLD} ranks", flush=True)
    result = measure("bert-256", layout, steps=5, deadline_s=300)
    print(json.dumps(result, indent=1))
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(_main())
