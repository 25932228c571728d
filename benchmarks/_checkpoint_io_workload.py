"""The ranks of ``benchmarks/checkpoint_io.py`` (loads, saves, DCP's reshard); light: spawned ranks import it."""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from _harness import reset_peak_rss, status_kib

CONFIGS = {
    "bert-large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                       vocab_size=30522, max_position_embeddings=512),
    "bert-base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                      vocab_size=30522, max_position_embeddings=512),
    "quick": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512,
                  vocab_size=1000, max_position_embeddings=128),
}
MiB = 2**20
#: transformers' tp_plan of the HF variant: Megatron's for the encoder layers; embeddings, LayerNorms, the pooler and
#: the tied MLM decoder stay replicated
HF_TP_PLAN = {f"bert.encoder.layer.*.{name}": style for name, style in (
    ("attention.self.query", "colwise"), ("attention.self.key", "colwise"), ("attention.self.value", "colwise"),
    ("attention.output.dense", "rowwise"), ("intermediate.dense", "colwise"), ("output.dense", "rowwise"))}


def status() -> dict[str, int]:
    return {k: status_kib(k) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def results(work: Path, prefix: str, n: int) -> list[dict] | None:
    paths = [work / f"result_{prefix}_{r}.json" for r in range(n)]
    return [json.loads(p.read_text()) for p in paths] if all(p.exists() for p in paths) else None


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")


def _load(variant: str, hf_dir: str, mesh):
    """shardlib's sharded load, a full load then ``shard``, or transformers' own TP load (``HF_TP_PLAN``)."""
    from transformers import BertForMaskedLM

    import shardlib
    from shardlib import checkpoint

    if variant == "shardlib":
        return checkpoint.from_pretrained(BertForMaskedLM, hf_dir, mesh)
    if variant == "full":
        return shardlib.shard(BertForMaskedLM.from_pretrained(hf_dir, dtype=torch.float32), mesh)
    from transformers.distributed import DistributedConfig

    return BertForMaskedLM.from_pretrained(hf_dir, dtype=torch.float32,
                                           distributed_config=DistributedConfig(tp_plan=HF_TP_PLAN))


def _dcp_state_dict(model) -> dict:
    """Every persistent tensor once, the sharded ones as DTensors over the tp mesh (plain local tensors under the
    global names would be de-duplicated by DCP's planner as if replicated)."""
    from torch.distributed.tensor import DTensor, Shard

    import shardlib

    state = shardlib.shard_state(model)
    out, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            layout, t = shardlib.layout_of(model, name), t.detach()
            if not layout.is_sharded:
                out[name] = t
                continue
            start, stop = layout.valid_range(state.mesh.tp_rank)
            shape = torch.Size(layout.global_shape)
            out[name] = DTensor.from_local(t.narrow(layout.shard_dim, 0, max(stop - start, 0)),
                                           state.mesh.device_mesh["tp"], [Shard(layout.shard_dim)], run_check=False,
                                           shape=shape, stride=torch.empty(shape, device="meta").stride())
    return out


def _saves(model, work: Path, repeats: int) -> dict:
    """``checkpoint.save`` against ``dcp.save``, alternating, each into a new folder (the last pair kept)."""
    import torch.distributed.checkpoint as dcp

    from shardlib import checkpoint

    sd, times, sizes = _dcp_state_dict(model), {"shardlib": [], "dcp": []}, {}
    for i in range(repeats):
        keep = i == repeats - 1
        for kind, save in (("shardlib", lambda to: checkpoint.save(model, to)),
                           ("dcp", lambda to: dcp.save(sd, checkpoint_id=str(to)))):
            target = work / (f"{kind}_tp2" if keep else f"{kind}_tmp{i}")
            dist.barrier()
            t0 = time.perf_counter()
            save(target)
            dist.barrier()  # a save is done when every rank is done
            times[kind].append(time.perf_counter() - t0)
            if dist.get_rank() == 0:
                sizes[kind] = dir_bytes(target)
                if not keep:
                    shutil.rmtree(target)
            dist.barrier()
    return {"save_s": times, "save_bytes": sizes}


def load_worker(rank: int, world: int, port: int, variant: str, hf_dir: str, work: str, opts: dict) -> None:
    """One rank of a variant: baseline RSS (VmHWM reset), the first load, a forward check, more loads, the saves."""
    _init(rank, world, port)
    import datetime

    import transformers  # noqa: F401  (imports are part of the baseline)

    import shardlib
    from shardlib import checkpoint  # noqa: F401

    if variant == "hf":
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=opts["timeout"]))
    mesh = None if variant == "hf" else shardlib.init_mesh(tp=world)
    dist.barrier()
    gc.collect()
    res = {"rank": rank, "variant": variant, "baseline": status(), "peak_reset": reset_peak_rss()}
    dist.barrier()
    try:
        t0 = time.perf_counter()
        model = _load(variant, hf_dir, mesh)
        res["load_s"], res["after"] = [time.perf_counter() - t0], status()
        params = list({id(p): p for p in model.parameters()}.values())
        res["local_bytes"] = shardlib.report(model).local_bytes if variant != "hf" else sum(
            (p.to_local() if hasattr(p, "to_local") else p).nbytes for p in params)
        res["dtensor_params"] = f"{sum(hasattr(p, 'to_local') for p in params)}/{len(params)}"
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(5, model.config.vocab_size, (2, 16), generator=g)
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = ids[:, ::3]
        with torch.no_grad():
            loss = model(input_ids=torch.where(labels != -100, torch.full_like(ids, 4), ids), labels=labels).loss
        res["check_loss"] = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        del params, loss
        for _ in range(opts["load_repeats"] - 1):
            del model
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            model = _load(variant, hf_dir, mesh)
            res["load_s"].append(time.perf_counter() - t0)
        if variant == "shardlib" and opts["save_repeats"]:
            res |= _saves(model, Path(work), opts["save_repeats"])
    except Exception as exc:  # noqa: BLE001  (reported as n/a with the reason)
        res.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    Path(work, f"result_{variant}_{rank}.json").write_text(json.dumps(res))
    if "error" not in res:
        dist.barrier()
    dist.destroy_process_group()


def dcp_reshard_worker(rank: int, world: int, port: int, dcp_dir: str, layouts_json: str, ref_dir: str, work: str,
                       timeout: float) -> None:
    """DCP-load the tp=2 DTensor checkpoint into tp=4 DTensors (timed), then compare with shardlib's tp=4 files."""
    import datetime

    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    _init(rank, world, port)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tensors = json.loads(Path(layouts_json).read_text())["tensors"]
    shard_dim = {n: e["layout"]["shard_dim"] for name, e in tensors.items() for n in [name, *e["aliases"]]}
    sd = {}
    for name, md in dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        shape, d, dtype = md.size, shard_dim.get(name), md.properties.dtype
        if d is None:
            sd[name] = torch.empty(shape, dtype=dtype)
            continue
        chunk = math.ceil(shape[d] / world)
        local_shape = list(shape)
        local_shape[d] = min((rank + 1) * chunk, shape[d]) - min(rank * chunk, shape[d])
        sd[name] = DTensor.from_local(torch.empty(local_shape, dtype=dtype), mesh, [Shard(d)], run_check=False,
                                      shape=shape, stride=torch.empty(shape, device="meta").stride())
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(sd, checkpoint_id=dcp_dir)
    seconds = time.perf_counter() - t0
    dist.barrier()
    mismatches, compared = [], 0
    with safe_open(os.path.join(ref_dir, f"model-tp{rank:02d}-of-{world:02d}.safetensors"), "pt") as mine, \
            safe_open(os.path.join(ref_dir, "model-replicated.safetensors"), "pt") as rep:
        for name, t in sd.items():
            local = t.to_local() if isinstance(t, DTensor) else t
            ref = next((f.get_tensor(name) for f in (mine, rep) if name in f.keys()), None)
            if ref is None and local.numel():
                mismatches.append(f"{name}: not in shardlib tp=4 files")
            elif ref is not None:
                compared += 1
                if ref.shape != local.shape or not torch.equal(ref, local):
                    mismatches.append(name)
    Path(work, f"result_dcp4_{rank}.json").write_text(json.dumps(
        {"rank": rank, "load_s": seconds, "compared": compared, "mismatches": mismatches[:5],
         "n_mismatches": len(mismatches)}))
    dist.barrier()
    dist.destroy_process_group()
