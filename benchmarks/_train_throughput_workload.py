"""The workload of ``benchmarks/train_throughput.py``: modes, data, model, the eager / DDP loop, ``fit``, ranks."""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import _checkout  # noqa: E402,F401  (shardlib importable from a plain checkout, as on the GPU machine)
from _harness import machine_busy_s, run_rank  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256, vocab_size=1000),
    "small": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                  vocab_size=30522),
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                 vocab_size=30522),
}
DEFAULT_STEPS = {"tiny": 30, "small": 40, "base": 40}
DEFAULT_LR = {"tiny": 3e-3, "small": 3e-4, "base": 5e-5}
SEED, DATA_SEED = 1234, 7
PAD, CLS, SEP = 0, 101, 102
NEGATIVE, POSITIVE, FILLER_START = range(30, 40), range(40, 50), 200
LAST_K = 5  # the "final loss" is the mean of the last LAST_K steps
#: Per-step loss agreement with the baseline (dropout off) over ``CHECKED_STEPS``: fp32 differs only by summation
#: order, every step; AMP rounds split matmuls differently and training amplifies it, so the first 5 steps only.
TOLERANCE = {"fp32": 1e-3, "bf16": 0.02, "fp16": 0.02}
CHECKED_STEPS = {"fp32": None, "bf16": 5, "fp16": 5}
#: GradScaler's rule as a shardlib loss scaler: back off on every overflow, grow after 2000 clean steps.
GRADSCALER_RULE = dict(initial_scale=2.0 ** 16, hysteresis=1, growth_interval=2000, growth_factor=2.0,
                       backoff_factor=0.5)


@dataclass(frozen=True)
class Mode:
    name: str
    title: str
    kind: str  # "eager" (a hand-written loop, DDP when world > 1) or "shardlib" (shard + Trainer.fit)
    world: int
    mesh: dict = field(default_factory=dict)
    sequence_parallel: bool = False
    compile: bool = False
    kernels: bool = False


_CPU = [Mode("eager", "eager, 1 process (reference)", "eager", 1),
        Mode("ddp", "eager + DDP (baseline)", "eager", 2),
        Mode("tp2", "shardlib tp=2", "shardlib", 2, dict(tp=2)),
        Mode("tp2_sp", "shardlib tp=2 + SP", "shardlib", 2, dict(tp=2), sequence_parallel=True),
        Mode("dp2", "shardlib dp=2", "shardlib", 2, dict(dp=2)),
        Mode("dp2_tp2", "shardlib dp=2 x tp=2 (4 ranks: oversubscribed)", "shardlib", 4, dict(dp=2, tp=2)),
        Mode("pp2", "shardlib pp=2", "shardlib", 2, dict(pp=2)),
        Mode("ddp4", "eager + DDP, 4 ranks (oversubscribed)", "eager", 4),
        Mode("dp4", "shardlib dp=4 (4 ranks: oversubscribed)", "shardlib", 4, dict(dp=4))]
_GPU = [Mode("eager", "eager (baseline)", "eager", 1),
        Mode("shardlib", "shardlib tp=1", "shardlib", 1),
        Mode("shardlib_compiled", "shardlib tp=1 compiled", "shardlib", 1, compile=True),
        Mode("shardlib_kernels_compiled", "shardlib tp=1 + kernels, compiled", "shardlib", 1, compile=True,
             kernels=True)]
MODES = {"cpu": {m.name: m for m in _CPU}, "cuda": {m.name: m for m in _GPU}}
BASELINE = {"cpu": "ddp", "cuda": "eager"}
DEFAULT_MODES = {"cpu": ("eager", "ddp", "tp2", "tp2_sp", "dp2", "dp2_tp2", "pp2", "tp2_compiled"),
                 "cuda": tuple(m.name for m in _GPU)}
QUICK_MODES = ("eager", "ddp", "tp2", "tp2_sp", "dp2", "pp2")
DEFAULT_PRECISIONS = {"cpu": "fp32,bf16", "cuda": "fp32,bf16,fp16"}


def mode_spec(device: str, name: str) -> Mode:
    """The mode called ``name``; ``<shardlib mode>_compiled`` is that mode under ``Trainer(compile=True)``."""
    modes = MODES[device]
    if name in modes:
        return modes[name]
    base = modes.get(name.removesuffix("_compiled"))
    if name.endswith("_compiled") and base is not None and base.kind == "shardlib" and not base.compile:
        return Mode(name, base.title + " compiled", base.kind, base.world, base.mesh, base.sequence_parallel,
                    compile=True, kernels=base.kernels)
    raise KeyError(name)


def threads_for(world: int) -> int:
    """Intra-op threads per rank: the cores shared out over the ranks (on CUDA: the host side's)."""
    return max(1, (os.cpu_count() or 1) // world)


# -------------------------------------------------------------------------------------------------- data, model
def sst2_like(n: int, seq: int, vocab: int, seed: int = DATA_SEED) -> list[dict]:
    """``n`` SST-2-shaped samples: [CLS] words [SEP] [PAD]...; the label is the sentiment set in the majority."""
    g = torch.Generator().manual_seed(seed)
    sets, samples = (NEGATIVE, POSITIVE), []
    for _ in range(n):
        length = int(torch.randint(min(32, seq - 3), seq - 1, (), generator=g))  # words; + [CLS], [SEP] <= seq
        words = torch.randint(FILLER_START, vocab, (length,), generator=g)
        label = int(torch.randint(0, 2, (), generator=g))
        k = max(3, length // 2)  # sentiment words
        minority = int(torch.randint(0, max(1, k // 4), (), generator=g))  # < k / 4: a clear majority
        slots = torch.randperm(length, generator=g)[:k]
        major, minor = sets[label], sets[1 - label]
        words[slots[minority:]] = torch.randint(major.start, major.stop, (k - minority,), generator=g)
        words[slots[:minority]] = torch.randint(minor.start, minor.stop, (minority,), generator=g)
        ids = torch.full((seq,), PAD)
        ids[0], ids[1:length + 1], ids[length + 1] = CLS, words, SEP
        samples.append({"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": torch.tensor(label)})
    return samples


def build_model(opts: dict):
    """BertForSequenceClassification from the size's config, the same weights in every mode and on every rank."""
    import transformers

    # problem_type: what the first forward would set (2 labels, integer labels); set before it, a compiled model's
    # guard on it does not fail after the first step, which would compile everything a second time
    config = transformers.BertConfig(**SIZES[opts["size"]], max_position_embeddings=512, num_labels=2,
                                     hidden_dropout_prob=opts["dropout"], attention_probs_dropout_prob=opts["dropout"],
                                     problem_type="single_label_classification")
    torch.manual_seed(SEED)
    with torch.device(opts["device"]):
        model = transformers.BertForSequenceClassification(config)
    return model.train()


# --------------------------------------------------------------------------------------------- eager / DDP loop
class StepLog:
    """``fit``'s JSONL record format for the hand-written loop, written on rank 0: one record per step."""

    def __init__(self, path: Path | None, batch: int, tokens: int):
        self.path, self.batch, self.tokens = path, batch, tokens
        self.start = time.perf_counter()

    def record(self, step: int, loss: float, lr: float, extra: dict) -> None:
        elapsed = time.perf_counter() - self.start
        if self.path is not None:
            values = {"step": step, "epoch": 0, "loss": loss, "lr": lr, **extra,
                      "samples_per_s": self.batch / elapsed, "tokens_per_s": self.tokens / elapsed}
            with open(self.path, "a") as f:
                f.write(json.dumps(values) + "\n")
        self.start = time.perf_counter()


def _eager_step(net, optimizer, scaler, batch: dict, precision: str, device: str) -> tuple[torch.Tensor, float]:
    """One step of the plain loop: the loss and the (unscaled) gradient norm (``fit`` logs one every step)."""
    from torch.nn.utils import get_total_norm

    optimizer.zero_grad(set_to_none=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = net(**batch).loss
    grads = lambda: [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if scaler is None:
        loss.backward()
        norm = float(get_total_norm(grads()))
        optimizer.step()
    else:  # GradScaler skips the step on inf/nan gradients and backs the scale off
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = float(get_total_norm(grads()))
        scaler.step(optimizer)
        scaler.update()
    return loss.detach(), norm


def train_eager(rank: int, world: int, spec: Mode, precision: str, data: list[dict], opts: dict,
                run_dir: Path) -> None:
    """The baseline: DDP over ``world`` ranks (1: none), each rank its contiguous share of a global batch, as in fit."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import default_collate

    device, batch, lr = opts["device"], opts["batch"], opts["lr"]
    model = build_model(opts)
    net = DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    share = slice(rank * batch // world, (rank + 1) * batch // world)
    log = StepLog(run_dir / "log.jsonl" if rank == 0 else None, batch, batch * opts["seq"])
    skipped = 0
    for step in range(opts["steps"]):
        samples = data[step * batch:(step + 1) * batch][share]
        mb = {k: v.to(device, non_blocking=True) for k, v in default_collate(samples).items()}
        scale = scaler.get_scale() if scaler is not None else None
        loss, norm = _eager_step(net, optimizer, scaler, mb, precision, device)
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        extra = {"grad_norm": norm if math.isfinite(norm) else str(norm)}  # JSON has no inf / nan (as fit's log)
        if scaler is not None:
            skipped += scaler.get_scale() < scale
            extra.update(loss_scale=scaler.get_scale(), skipped_steps=int(skipped))
        log.record(step + 1, float(loss), lr, extra)


# ------------------------------------------------------------------------------------------- shardlib + fit
def train_shardlib(mesh, spec: Mode, precision: str, data: list[dict], opts: dict, run_dir: Path) -> None:
    """``shard`` + ``Trainer`` + ``fit`` on ``mesh``, logging every step to ``run_dir/log.jsonl``."""
    import shardlib

    kernels = shardlib.Kernels(fused_qkv=True, bias_gelu=True, dropout_add=True) if spec.kernels else None
    model = shardlib.shard(build_model(opts), mesh, sequence_parallel=spec.sequence_parallel, kernels=kernels)
    lr = opts["lr"]
    trainer = shardlib.Trainer(model, optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
                               precision=precision, compile=spec.compile,
                               microbatches=opts["microbatches"] if mesh.pp > 1 else 1,
                               loss_scaler=dict(GRADSCALER_RULE) if precision == "fp16" else None)
    trainer.fit(data, batch_size=opts["batch"], max_steps=opts["steps"], log_interval=1, save_dir=run_dir,
                shuffle=False, progress=False, seed=SEED)


# ----------------------------------------------------------------------------------------------- the worker
def _init_group(rank: int, world: int, tmpdir: str) -> None:
    import datetime

    # transformers reads LOCAL_RANK; the rendezvous itself is a FileStore (no TCP store is started)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmpdir, 'store')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=900))


def _worker(rank: int, mode: str, precisions: list[str], opts: dict, tmpdir: str) -> None:
    """One rank of one mode: every precision in turn, a fresh model each; rank 0 writes what each run took."""
    import gc

    spec = mode_spec(opts["device"], mode)
    torch.set_num_threads(threads_for(spec.world))
    if spec.world > 1:
        _init_group(rank, spec.world, tmpdir)
    mesh = None
    if spec.kind == "shardlib":
        import shardlib

        mesh = shardlib.init_mesh(**spec.mesh, timeout_s=900)  # a world of one on NCCL with --device cuda
    data = sst2_like(opts["steps"] * opts["batch"], opts["seq"], SIZES[opts["size"]]["vocab_size"])
    for precision in precisions:
        run_dir = Path(opts["out"]) / f"{mode}-{precision}"
        if rank == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        if spec.kind == "shardlib":
            train_shardlib(mesh, spec, precision, data, opts, run_dir)
        else:
            train_eager(rank, spec.world, spec, precision, data, opts, run_dir)
        if rank == 0:
            Path(tmpdir, f"done-{precision}.json").write_text(json.dumps({"wall_s": time.perf_counter() - t0}))
        gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_mode(mode: str, precisions: list[str], opts: dict) -> dict[str, dict]:
    """Run ``mode`` in fresh processes; per precision ``{"wall_s"}`` or ``{"error"}``, and ``foreign_cores``."""
    spec = mode_spec(opts["device"], mode)
    tmpdir = tempfile.mkdtemp(prefix=f"train_bench_{mode}_")
    busy0, t0 = machine_busy_s(), time.perf_counter()
    own0 = _children_cpu_s()
    error = None
    try:
        mp.start_processes(run_rank, args=(_worker, mode, precisions, opts, tmpdir), nprocs=spec.world,
                           join=True, start_method="spawn")
    except Exception as e:  # noqa: BLE001 - a failed mode is reported in the table, the others still run
        error = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    wall = time.perf_counter() - t0
    foreign = max(0.0, (machine_busy_s() - busy0 - (_children_cpu_s() - own0)) / wall)
    results = {}
    for precision in precisions:
        done = Path(tmpdir, f"done-{precision}.json")
        results[precision] = json.loads(done.read_text()) if done.exists() else {"error": error or "no result"}
        results[precision]["foreign_cores"] = foreign
    shutil.rmtree(tmpdir, ignore_errors=True)
    return results


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime + time.process_time()
