"""The workload of ``benchmarks/checkpoint_io.py`` (its models, inputs, ranks and measurements); the script keeps its command line
and its report. Checkpoint I/O on CPU at tp=2: shardlib's sharded load/save/convert vs full loads, transformers' TP and DCP."""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _harness import machine_busy_s, reset_peak_rss, timed  # noqa: E402

# Keep the module light at import: spawned workers re-import it, and the DCP tp=4 workers need torch only.
BENCH_DIR = Path(__file__).resolve().parent
CONFIGS = {
    "bert-large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                       vocab_size=30522, max_position_embeddings=512),
    "bert-base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                      vocab_size=30522, max_position_embeddings=512),
    "quick": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512,
                  vocab_size=1000, max_position_embeddings=128),
}
MiB = 2**20
VARIANTS = ("shardlib", "full", "hf")
TITLES = {"shardlib": "shardlib", "full": "full load + shard", "hf": "HF tp_plan", "dcp": "DCP", "raw": "raw I/O"}


# ------------------------------------------------------------------------------------------------------ helpers
def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


class _PeakSampler:
    """Samples /proc/self/status every ~2 ms in a thread: the peaks of RssAnon (private memory) and RssFile
    (mapped file pages) separately, which VmHWM (their peak sum) cannot tell apart."""

    def __init__(self, interval_s: float = 0.002):
        import threading

        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._done = threading.Event()
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            s = _status()
            for k in self.peak:
                self.peak[k] = max(self.peak[k], s[k])
            self._done.wait(self._interval)

    def stop(self) -> dict[str, int]:
        self._done.set()
        self._thread.join()
        return self.peak


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _bert_config(size: str):
    from transformers import BertConfig

    return BertConfig(**CONFIGS[size], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _check_batch(vocab: int):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(5, vocab, (2, 16), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    ids = torch.where(labels != -100, torch.full_like(ids, 4), ids)
    return ids, labels


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------------------------------------------ workers
def _init_env(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")


def _hf_tp_plan() -> dict[str, str]:
    sys.path.insert(0, str(BENCH_DIR))
    from _hf_dtensor_tp import BERT_TP_PLAN  # noqa: PLC0415

    return {"bert." + k: v for k, v in BERT_TP_PLAN.items()}


def _load(variant: str, hf_dir: str, mesh):
    from transformers import BertForMaskedLM

    import shardlib
    from shardlib import checkpoint

    if variant == "shardlib":
        return checkpoint.from_pretrained(BertForMaskedLM, hf_dir, mesh)
    if variant == "full":
        model = BertForMaskedLM.from_pretrained(hf_dir, dtype=torch.float32)
        return shardlib.shard(model, mesh)
    from transformers.distributed import DistributedConfig

    return BertForMaskedLM.from_pretrained(hf_dir, dtype=torch.float32,
                                           distributed_config=DistributedConfig(tp_plan=_hf_tp_plan()))


def _local_param_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            t = _local(p)
            total += t.numel() * t.element_size()
    return total


def _dcp_state_dict(model) -> dict:
    """Every persistent tensor once (ties once, first name), sharded ones as DTensors over the tp mesh."""
    from torch.distributed.tensor import DTensor, Shard

    import shardlib

    tp_mesh = shardlib.shard_state(model).mesh.device_mesh["tp"]
    rank = shardlib.shard_state(model).mesh.tp_rank
    out, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        layout = shardlib.layout_of(model, name)
        t = t.detach()
        if not layout.is_sharded:
            out[name] = t
            continue
        start, stop = layout.valid_range(rank)
        local = t.narrow(layout.shard_dim, 0, max(stop - start, 0))
        shape = torch.Size(layout.global_shape)
        out[name] = DTensor.from_local(local, tp_mesh, [Shard(layout.shard_dim)], run_check=False, shape=shape,
                                       stride=torch.empty(shape, device="meta").stride())
    return out


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()  # a save is done when every rank is done
    return time.perf_counter() - t0


def _save_benchmarks(model, work: Path, repeats: int) -> dict:
    import torch.distributed.checkpoint as dcp

    from shardlib import checkpoint

    rank = dist.get_rank()
    sd = _dcp_state_dict(model)
    times = {"shardlib": [], "dcp": []}
    sizes = {}
    for i in range(repeats):
        keep = i == repeats - 1  # the last ones stay for the resharding step
        for kind in ("shardlib", "dcp"):
            target = work / f"{kind}_tp2" if keep else work / f"{kind}_tmp{i}"
            if kind == "shardlib":
                times[kind].append(_timed(lambda: checkpoint.save(model, target)))
            else:
                times[kind].append(_timed(lambda: dcp.save(sd, checkpoint_id=str(target))))
            if rank == 0:
                sizes[kind] = _dir_bytes(target)
                if not keep:
                    shutil.rmtree(target)
            dist.barrier()
    return {"save_s": times, "save_bytes": sizes}


def _load_worker(rank: int, world: int, port: int, variant: str, hf_dir: str, work: str, opts: dict) -> None:
    torch.set_num_threads(1)
    _init_env(rank, world, port)
    import transformers  # noqa: F401  (imports are part of the baseline)
    from transformers import BertForMaskedLM  # noqa: F401

    import shardlib
    from shardlib import checkpoint  # noqa: F401

    mesh = None
    if variant in ("shardlib", "full"):
        mesh = shardlib.init_mesh(tp=world)
    else:
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=opts["timeout"]))
    dist.barrier()
    gc.collect()
    base = _status()
    reset = reset_peak_rss()
    dist.barrier()
    res = {"rank": rank, "variant": variant, "baseline": base, "peak_reset": reset}
    try:
        sampler = _PeakSampler()
        t0 = time.perf_counter()
        model = _load(variant, hf_dir, mesh)
        res["load_s"] = [time.perf_counter() - t0]
        res["after"] = _status()
        res["sampled_peak"] = sampler.stop()
        res["local_bytes"] = (shardlib.report(model).local_bytes if variant != "hf" else _local_param_bytes(model))
        if variant == "hf":
            from torch.distributed.tensor import DTensor

            params = list(model.parameters())
            res["dtensor_params"] = f"{sum(isinstance(p, DTensor) for p in params)}/{len(params)}"
        ids, labels = _check_batch(model.config.vocab_size)
        with torch.no_grad():
            loss = model(input_ids=ids, labels=labels).loss
        if hasattr(loss, "full_tensor"):
            loss = loss.full_tensor()
        res["check_loss"] = float(loss)
        for _ in range(opts["load_repeats"] - 1):
            del model, loss
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            model = _load(variant, hf_dir, mesh)
            res["load_s"].append(time.perf_counter() - t0)
            loss = None
        if variant == "shardlib" and opts["save_repeats"]:
            res |= _save_benchmarks(model, Path(work), opts["save_repeats"])
    except Exception as exc:  # noqa: BLE001  (reported as n/a with the reason)
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()
    with open(os.path.join(work, f"result_{variant}_{rank}.json"), "w") as f:
        json.dump(res, f)
    if "error" not in res:
        dist.barrier()
    dist.destroy_process_group()


def _dcp_reshard_worker(rank: int, world: int, port: int, dcp_dir: str, layouts_json: str, ref_dir: str,
                        work: str, timeout: float) -> None:
    """DCP-load a tp=2 DTensor checkpoint into tp=4 DTensors; compare with shardlib's tp=4 files afterwards."""
    import datetime

    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    _init_env(rank, world, port)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    meta = json.loads(Path(layouts_json).read_text())["tensors"]
    shard_dim = {}
    for name, entry in meta.items():
        for n in [name, *entry["aliases"]]:
            shard_dim[n] = entry["layout"]["shard_dim"]
    stored = dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata
    sd = {}
    for name, md in stored.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        shape, d = md.size, shard_dim.get(name)
        if d is None:
            sd[name] = torch.empty(shape, dtype=md.properties.dtype)
            continue
        chunk = math.ceil(shape[d] / world)
        start, stop = min(rank * chunk, shape[d]), min((rank + 1) * chunk, shape[d])
        local_shape = list(shape)
        local_shape[d] = stop - start
        sd[name] = DTensor.from_local(torch.empty(local_shape, dtype=md.properties.dtype), mesh, [Shard(d)],
                                      run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride())
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(sd, checkpoint_id=dcp_dir)
    seconds = time.perf_counter() - t0
    dist.barrier()
    # Verify against shardlib's converted tp=4 checkpoint (real rows of this rank's file, replicated file).
    mismatches, compared = [], 0
    with safe_open(os.path.join(ref_dir, f"model-tp{rank:02d}-of-{world:02d}.safetensors"), "pt") as mine, \
            safe_open(os.path.join(ref_dir, "model-replicated.safetensors"), "pt") as rep:
        mine_keys, rep_keys = set(mine.keys()), set(rep.keys())
        for name, t in sd.items():
            local = _local(t)
            if name in mine_keys:
                ref = mine.get_tensor(name)
            elif name in rep_keys:
                ref = rep.get_tensor(name)
            elif local.numel() == 0:
                continue
            else:
                mismatches.append(f"{name}: not in shardlib tp=4 files")
                continue
            compared += 1
            if ref.shape != local.shape or not torch.equal(ref, local):
                mismatches.append(name)
    with open(os.path.join(work, f"result_dcp4_{rank}.json"), "w") as f:
        json.dump({"rank": rank, "load_s": seconds, "compared": compared, "mismatches": mismatches[:5],
                   "n_mismatches": len(mismatches)}, f)
    dist.barrier()
    dist.destroy_process_group()


def _results(work: Path, prefix: str, n: int) -> list[dict] | None:
    out = []
    for r in range(n):
        path = work / f"result_{prefix}_{r}.json"
        if not path.exists():
            return None
        out.append(json.loads(path.read_text()))
    return out


# ------------------------------------------------------------------------------------------------------ parent
def _raw_read(path: Path, view: memoryview) -> int:
    """Read ``path`` to its end into ``view`` (a reused buffer) with plain unbuffered ``readinto`` calls."""
    total = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                return total
            total += n


def _raw_write(path: Path, nbytes: int, block: memoryview, fsync: bool) -> None:
    """Write ``nbytes`` to a new file from ``block`` in ``len(block)``-byte ``write`` calls, then (``fsync``) fsync:
    the page cache's / the disk's write throughput for the bytes a convert writes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, block[:min(left, len(block))])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


class _no_durability:
    """Within: ``os.fsync`` and shardlib's early-writeback call do nothing (this process only; diagnostic)."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint

    def __enter__(self):
        from shardlib.safetensors_io import writer  # where the writes look the early-writeback call up
        self.io = writer
        self.saved = os.fsync, writer._start_writeback
        os.fsync, self.io._start_writeback = (lambda fd: None), None

    def __exit__(self, *exc):
        os.fsync, self.io._start_writeback = self.saved


def _fmt_s(times: list[float]) -> str:
    if not times:
        return "n/a"
    med = statistics.median(times)
    return f"{med:.2f}" if len(times) == 1 else f"{med:.2f} (median of {len(times)})"


def _convert_benchmark(checkpoint, hf_dir: Path, hf_files: list[Path], hf_bytes: int, root: Path,
                       repeats: int) -> dict:
    """Part 3: raw read, xxh3-128 and write references, then HF -> sharded tp=2 with and without durability; the
    lists of seconds, the bytes written and the machine's load (cores busy, this process included) meanwhile."""
    busy0, wall0 = machine_busy_s(), time.perf_counter()
    buf = memoryview(bytearray(64 * MiB))  # allocated once, outside the timed reads
    raw = timed(lambda: [_raw_read(f, buf) for f in hf_files], 3)
    xxh = timed(lambda: [checkpoint.checksum_of(f) for f in hf_files], 1)
    scratch = root / "durable_write.bin"
    durable = timed(lambda: _raw_write(scratch, hf_bytes, buf[:16 * MiB], True), 3,
                           before=lambda: scratch.unlink(missing_ok=True))
    cached = timed(lambda: _raw_write(scratch, hf_bytes, buf[:16 * MiB], False), 3,
                          before=lambda: scratch.unlink(missing_ok=True))
    scratch.unlink(missing_ok=True)
    out2 = root / "convert_tp2"
    conv2 = timed(lambda: checkpoint.convert(hf_dir, out2, tp=2), repeats,
                         before=lambda: shutil.rmtree(out2, ignore_errors=True))
    conv2_bytes = _dir_bytes(out2)
    with _no_durability(checkpoint):
        conv2_cache = timed(lambda: checkpoint.convert(hf_dir, out2, tp=2), repeats,
                                   before=lambda: shutil.rmtree(out2, ignore_errors=True))
    shutil.rmtree(out2, ignore_errors=True)
    busy = (machine_busy_s() - busy0) / (time.perf_counter() - wall0)
    print(f"raw read {_fmt_s(raw)} s, xxh3-128 {_fmt_s(xxh)} s, write+fsync {_fmt_s(durable)} s, write "
          f"{_fmt_s(cached)} s, convert HF -> "
          f"tp=2 {_fmt_s(conv2)} s (without fsync: {_fmt_s(conv2_cache)} s); all convert runs: "
          f"{' '.join(f'{t:.2f}' for t in conv2)} s; machine busy {busy:.2f} cores (this process included)",
          flush=True)
    return dict(raw=raw, xxh=xxh, durable=durable, cached=cached, conv2=conv2, conv2_cache=conv2_cache,
                conv2_bytes=conv2_bytes, busy=busy)
