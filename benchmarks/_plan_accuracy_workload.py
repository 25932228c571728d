"""The 4-rank measurement of ``benchmarks/plan_accuracy.py`` (:func:`measure`): per rank the peak RSS growth over a
baseline taken once everything is imported, then timed steps; ranks forked from a forkserver that imported
``PRELOAD`` once."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import libc, loopback_ifname, machine_busy_s, median_spread, reset_peak_rss, spawn_ranks  # noqa: E402
from _harness import status_kib  # noqa: E402
from _plan_accuracy_layouts import MODELS, Layout, make_batch  # noqa: E402

WARMUP = 1  # with the untimed step before the timed ones: the peak equals that after 2 (measured, 5 layouts)
MMAP_THRESHOLD = 65536  # glibc's while the peak is measured: large blocks unmapped when freed, the peak repeats
CKPT_ROOT = Path(tempfile.gettempdir()) / "shardlib-plan-accuracy"
MIB = 2 ** 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
#: every module a rank imports, loaded before its baseline (``late_imports``: any loaded later, counted as the model's)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.pipelining", "torch.utils.checkpoint",
           "torch.profiler._cupti_monitor", "transformers", "transformers.models.bert.modeling_bert",
           "transformers.models.t5.modeling_t5", "transformers.models.vit.modeling_vit",
           "transformers.models.llama.modeling_llama", "transformers.models.mixtral.modeling_mixtral",
           "transformers.integrations.moe", "shardlib", "shardlib.sharding.inference.cuts",
           "shardlib.sharding.inference.verify", "shardlib.checkpoint.loading", "shardlib.sharding.sharder",
           "shardlib.sharding.sequence", "shardlib.sharding.all_to_all", "shardlib.sharding.experts",
           "shardlib.parallel.expert_parallel", "shardlib.policies.bert",
           "shardlib.policies.t5", "shardlib.pipeline", "shardlib.kernels.attention", "shardlib.kernels.epilogues",
           "shardlib.kernels.fused_qkv", "shardlib.train.trainer", "shardlib.train.zero", "shardlib.train.fsdp",
           "shardlib.train.optim", "_plan_accuracy_layouts"]


def ensure_checkpoint(model_name: str, layers: int | None = None) -> Path:
    """The HF checkpoint (random weights, seed 0) the ranks load, written once per config."""
    spec = MODELS[model_name]
    config = spec.config(layers)
    digest = hashlib.sha1(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:10]
    path = CKPT_ROOT / f"{model_name}-L{layers or spec.layers}-{digest}"
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, spec.cls)(config)  # whole, in this process only
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    model.save_pretrained(scratch)
    try:
        os.replace(scratch, path)
    except OSError:  # another process wrote it first
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def measure(model_name: str, layout: Layout, steps: int = 5, deadline_s: float = 300.0, *, warmup: int = WARMUP,
            mem_steps: int = 1, layers: int | None = None) -> dict:
    """``{per_rank, peak_growth[_anon]_bytes, step_s (slowest rank's), step_s_median, ..., error}`` of ``layout``."""
    import multiprocessing

    started, spec = time.perf_counter(), MODELS[model_name]
    out = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
    job = dict(model=model_name, layers=layers, layout=layout.to_dict(), steps=steps, warmup=warmup,
               mem_steps=mem_steps, ckpt=str(ensure_checkpoint(model_name, layers)), out=str(out),
               timeout_s=max(30.0, deadline_s), ifname=os.environ.get("GLOO_SOCKET_IFNAME") or loopback_ifname())
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the forkserver starts with the environment of its first call
    try:
        multiprocessing.set_forkserver_preload(PRELOAD + [__name__])
        error = spawn_ranks(_rank, layout.world, (job,), deadline_s, start_method="forkserver", poll_s=0.2)
    finally:
        os.environ.pop("OMP_NUM_THREADS") if threads is None else os.environ.update(OMP_NUM_THREADS=threads)
    per_rank = []
    for r in range(layout.world):
        with contextlib.suppress(OSError, ValueError):
            per_rank.append(json.loads((out / f"rank{r}.json").read_text()))
    shutil.rmtree(out, ignore_errors=True)
    if error is None and len(per_rank) < layout.world:
        error = "a rank wrote no result"
    result = dict(model=model_name, layers=layers or spec.layers, layout=layout.to_dict(), name=layout.name(),
                  global_batch=layout.global_batch, seq=layout.seq, dec_seq=spec.dec_seq, steps=steps, warmup=warmup,
                  mem_steps=mem_steps, mmap_threshold=MMAP_THRESHOLD, error=error,
                  wall_s=time.perf_counter() - started)
    keys = ("per_rank", "peak_growth_bytes", "peak_growth_anon_bytes", "step_s", "step_s_median", "step_s_min",
            "step_s_max", "loss", "foreign_cores")
    if error is not None:
        return dict(result, **dict.fromkeys(keys))
    step_s = [max(r["step_s"][i] for r in per_rank) for i in range(len(per_rank[0]["step_s"]))]
    own = sum(r["cpu_s"] for r in per_rank)  # every rank's CPU time over the timed steps, against the machine's
    return dict(result, **dict(zip(keys, (
        per_rank, max(r["peak_growth"] for r in per_rank), max(r["peak_growth_anon"] for r in per_rank), step_s,
        *median_spread(step_s), per_rank[0]["losses"][-1],
        max(0.0, (per_rank[0]["busy_s"] - own) / per_rank[0]["window_s"])))))


# ================================================================================================== rank side
def _rss(settle: bool = False) -> dict:
    """Resident bytes (VmRSS, RssAnon, RssFile, VmHWM); ``settle``: after a collection and ``malloc_trim``."""
    if settle:
        gc.collect()
        libc("malloc_trim", 0)
    return {k: status_kib(f) * 1024 for k, f in (("total", "VmRSS"), ("anon", "RssAnon"), ("file", "RssFile"),
                                                 ("peak", "VmHWM"))}


def _rank(rank: int, world: int, port: int, job: dict) -> None:
    """One rank of :func:`measure`; its record goes to ``job['out']/rank{rank}.json``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME=job["ifname"],
                      OMP_NUM_THREADS="1")
    import importlib
    import warnings

    import torch

    for message in ("`gradient_checkpointing_enable` is deprecated", ".*returned a view tensor"):
        warnings.filterwarnings("ignore", message=message)  # printed by every rank, about code not ours
    torch.set_num_threads(1)
    libc("mallopt", M_MMAP_THRESHOLD, MMAP_THRESHOLD)  # what MALLOC_MMAP_THRESHOLD_ sets at a process' start
    for name in PRELOAD:
        importlib.import_module(name)
    import torch.distributed as dist
    import transformers

    import shardlib
    from shardlib.analysis.metarun import meta_model
    from shardlib.sharding.sharder import resolve_policy
    from shardlib.sharding.sharded import shard_state
    from shardlib.train.fsdp import local
    from shardlib.train.optim import held_state_bytes

    layout, spec = Layout(**job["layout"]), MODELS[job["model"]]
    mesh = shardlib.init_mesh(dp=layout.dp, pp=layout.pp, tp=layout.tp, sp=layout.sp, ep=layout.ep,
                              timeout_s=job["timeout_s"])
    # the plan resolved before the baseline, as shard() will (cached): inferring one imports torch.export and more
    # (20-27 MiB of RSS once per process for llama-256), runtime, not the model's memory
    resolve_policy(meta_model(spec.config(job.get("layers")), spec.cls))
    modules = set(sys.modules)
    rec = dict(rank=rank, baseline=_rss(settle=True))
    gc.freeze()  # what exists now is never garbage: the collections before the steps scan the new objects only
    torch.manual_seed(0)  # the same default generator on every rank (the Trainer checks it)
    model = shardlib.from_pretrained(getattr(transformers, spec.cls), job["ckpt"], mesh,
                                     config=spec.config(job["layers"]), sequence_parallel=layout.shard_mode(),
                                     expert_capacity=layout.expert_capacity)
    rec["loaded"] = _rss(settle=True)
    tr = shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=1e-4), microbatches=layout.microbatches,
                          schedule=layout.schedule, zero=layout.zero, precision=layout.precision,
                          activation_checkpointing=layout.activation_checkpointing)
    state = shard_state(model)
    rec["param_bytes"] = sum(local(p).numel() * p.element_size() for p in tr.params)
    rec["stages"] = len(state.pipeline.local_stages) if state.pipeline else 0
    batches = [shardlib.dp_shard(make_batch(spec, layout.global_batch, layout.seq, seed=s), mesh) for s in (0, 1)]
    rec["trainer"] = _rss(settle=True)
    step = lambda i: float(tr.train_step(batches[i % len(batches)]))  # noqa: E731
    # memory: warm-up steps (the first creates AdamW's state), the peak reset, the memory steps
    losses = [step(i) for i in range(job["warmup"])]
    rec["hwm_lifetime"] = status_kib("VmHWM") * 1024
    rec["opt_state_bytes"] = held_state_bytes(tr.optimizer, tr.params)
    rec["before_steps"], rec["reset_ok"] = _rss(settle=True), reset_peak_rss()
    losses += [step(i) for i in range(job["mem_steps"])]
    rec["after_steps"] = after = _rss()
    rec["hwm"] = after["peak"]
    rec["hwm_lifetime"] = max(rec["hwm_lifetime"], rec["hwm"])
    # time: malloc where its defaults settle, one untimed step that grows the heap, the timed steps between barriers
    libc("mallopt", M_MMAP_THRESHOLD, 32 * MIB)
    libc("mallopt", M_TRIM_THRESHOLD, 64 * MIB)
    losses.append(step(0))
    rec["reset_ok"] = reset_peak_rss() and rec["reset_ok"]
    step_s, busy0, cpu0, wall0 = [], machine_busy_s(), time.process_time(), time.perf_counter()
    for i in range(job["steps"]):
        gc.collect()
        dist.barrier()
        start = time.perf_counter()
        losses.append(step(i + 1))
        dist.barrier()
        step_s.append(time.perf_counter() - start)
    rec.update(window_s=time.perf_counter() - wall0, cpu_s=time.process_time() - cpu0, busy_s=machine_busy_s() - busy0,
               step_s=step_s, hwm_timed=status_kib("VmHWM") * 1024, losses=losses)
    rec["late_imports"] = sorted(set(sys.modules) - modules)  # their memory counts as the model's: keep it empty
    rec["peak_growth"] = rec["hwm"] - rec["baseline"]["total"]
    rec["file_growth"] = after["file"] - rec["baseline"]["file"]  # code pages first touched after the baseline
    rec["peak_growth_anon"] = rec["peak_growth"] - rec["file_growth"]
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(rec))
    dist.barrier()
    dist.destroy_process_group()
