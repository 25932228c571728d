"""The one-GPU half of ``benchmarks/step_anatomy.py --gpu``: shardlib at a world of one against the hand loop a user
writes without it, eager and compiled, one case of ``CASES`` per process (``python _gpu_anatomy.py CASE JSON [rounds
steps] [--cpu-test]``): the first step alone, interleaved rounds, profiled steps, a host probe."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import _checkout  # noqa: E402,F401  (shardlib from this checkout)

#: name: (family, batch, precision, variants, device); the CUDA ones in the order a time-limited device run reaches them
EAGER = ("hand_eager", "trainer_eager")
ALL = EAGER + ("hand_compiled", "trainer_compiled")
CASES = {
    "bert-b32-bf16": ("bert", 32, "bf16", ALL, "cuda"),
    "bert-b128-bf16": ("bert", 128, "bf16", ALL, "cuda"),
    "bert-b32-fp16": ("bert", 32, "fp16", EAGER, "cuda"),
    "vit-b32-bf16": ("vit", 32, "bf16", EAGER, "cuda"),
    "t5-b16-bf16": ("t5", 16, "bf16", EAGER, "cuda"),
    "bert-b32-fp16-compiled": ("bert", 32, "fp16", ALL, "cuda"),
    "vit-b32-bf16-compiled": ("vit", 32, "bf16", ALL, "cuda"),
    "bert-small-b8-fp32-cpu": ("bert-small", 8, "fp32", ALL, "cpu"),  # BERT-small MLM, fp32, 8 x 128, every core
}
OPS = ("aten::bmm", "aten::scaled_dot_product", "aten::sum", "aten::mm", "aten::addmm", "aten::_to_copy")
SUMMARY_HEADER = ["case", "mode", "hand ms/step", "Trainer ms/step", "hand / Trainer (paired, median [range])",
                  "first step s (hand / Trainer)", "kernel ms/step (hand / Trainer)", "Trainer / hand kernel time"]


def build(family: str, batch: int, tiny: bool, device: str):
    """(model, 4 batches on ``device``): HF's base sizes (``tiny``: 2 layers of 64), random weights, dropout on."""
    import transformers

    from _anatomy_workload import SIZES, batches  # the CPU anatomy's sizes and MLM batches (15% labelled)

    g = torch.Generator().manual_seed(1)
    if family.startswith("bert"):
        cfg = transformers.BertConfig(**(dict(SIZES["bert-tiny"], vocab_size=1000) if tiny else SIZES["bert-small"]
                                         if family == "bert-small" else {}))
        model, data = transformers.BertForMaskedLM(cfg), batches(4, batch, 32 if tiny else 128, cfg.vocab_size)
    elif family == "vit":
        cfg = transformers.ViTConfig(num_labels=1000, **(SIZES["vit-tiny"] if tiny else {}))
        model = transformers.ViTForImageClassification(cfg)
        data = [{"pixel_values": torch.randn(batch, 3, cfg.image_size, cfg.image_size, generator=g),
                 "labels": torch.randint(0, 1000, (batch,), generator=g)} for _ in range(4)]
    else:  # t5-base
        cfg = transformers.T5Config(**SIZES["t5-tiny" if tiny else "t5-base"], decoder_start_token_id=0)
        model, (src, tgt) = transformers.T5ForConditionalGeneration(cfg), ((32, 16) if tiny else (256, 64))
        data = [{"input_ids": torch.randint(1, cfg.vocab_size, (batch, src), generator=g),
                 "attention_mask": torch.ones(batch, src, dtype=torch.long),
                 "labels": torch.randint(1, cfg.vocab_size, (batch, tgt), generator=g)} for _ in range(4)]
    return model.to(device), [{k: v.to(device) for k, v in b.items()} for b in data]


class Variant:
    """One way of training the case's model: a hand loop or ``Trainer.train_step``, eager or compiled."""

    def __init__(self, name: str, family: str, batch: int, precision: str, tiny: bool, device: str, mesh):
        import shardlib

        torch.manual_seed(0)
        model, self.data = build(family, batch, tiny, device)
        self.i, self.device, self.trainer = 0, device, None
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
        optimizer = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
        compiled = name.endswith("compiled")
        if name.startswith("trainer"):
            self.trainer = shardlib.Trainer(shardlib.shard(model, mesh), optimizer, precision=precision,
                                            compile=compiled)
        else:
            self.model, self.optimizer = torch.compile(model) if compiled else model, optimizer(model.parameters())
            self.scaler = torch.amp.GradScaler(device) if precision == "fp16" else None

    def step(self) -> float:
        batch = self.data[self.i % len(self.data)]
        self.i += 1
        if self.trainer is not None:
            return self.trainer.train_step(batch)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device, dtype=self.dtype) if self.dtype else contextlib.nullcontext():
            loss = self.model(**batch).loss
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return loss.detach().item()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def window(self, steps: int) -> float:
        """Seconds per step over ``steps`` steps, synchronized at both ends."""
        self.sync()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.sync()
        return (time.perf_counter() - start) / steps


def profiled(variant: Variant, steps: int = 3) -> dict:
    """Per step: GPU kernel ms and kernels (annotations' spans, which hold idle time, left out), ``OPS`` counts."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if variant.device == "cuda" else [])) \
            as prof:
        wall = variant.window(steps)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA
               and not (getattr(e, "is_user_annotation", False) or e.name.startswith("Optimizer."))]
    by_name: dict = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0) + getattr(e, "device_time_total", 0)
    kernel_us = sum(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0) for e in kernels)
    counts = {op: sum(row.count for row in prof.key_averages() if row.key == op or (
        op.endswith("dot_product") and row.key.startswith(op))) for op in OPS}
    return {"kernel_ms": kernel_us / 1e3 / steps, "kernels": len(kernels) / steps, "wall_ms": wall * 1e3,
            "ops": {k: v / steps for k, v in counts.items()},
            "top_kernels_ms": {k[:90]: v / 1e3 / steps for k, v in sorted(by_name.items(), key=lambda x: -x[1])[:12]}}


def host_probe(variant: Variant, steps: int = 10) -> dict:
    """Where host time goes: one step's synchronizing CUDA calls, and the top 20 functions of a cProfile (ms/step)."""
    import cProfile
    import pstats
    import warnings

    syncs: dict[str, int] = {}
    if variant.device == "cuda":
        variant.sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                variant.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                where = f"{os.path.basename(w.filename)}:{w.lineno}"
                syncs[where] = syncs.get(where, 0) + 1
    profiler = cProfile.Profile()
    variant.sync()
    profiler.enable()
    variant.window(steps)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, ...)
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:20]
    return {"syncs": syncs, "total_ms": sum(v[2] for v in stats.values()) * 1e3 / steps,
            "top_own_ms": {f"{os.path.basename(k[0])}:{k[1]}({k[2]})": v[2] * 1e3 / steps for k, v in top}}


def run_case(case: str, tiny: bool, rounds: int, steps: int) -> dict:
    import shardlib

    family, batch, precision, names, device = CASES[case]
    device = "cpu" if tiny else device
    mesh = shardlib.init_mesh(backend="gloo" if device == "cpu" else None)
    result = {"case": case, "family": family, "batch": batch, "precision": precision, "device": device,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
              "first_step_s": {}, "seconds": {n: [] for n in names}, "profile": {}, "host_probe": {}}
    variants = {}
    for name in names:
        variants[name] = Variant(name, family, batch, precision, tiny, device, mesh)
        result["first_step_s"][name] = variants[name].window(1)  # the compile, for a compiled variant
        variants[name].window(3)  # warm-up: allocator, optimizer state, cuBLAS / autotuning
        print(f"  {case} {name}: first step {result['first_step_s'][name]:.1f} s", flush=True)
    for r in range(rounds):
        for name in names[:: 1 if r % 2 == 0 else -1]:
            result["seconds"][name].append(variants[name].window(steps))
        print(f"  {case} round {r + 1}: " + ", ".join(f"{n} {result['seconds'][n][-1] * 1e3:.2f} ms" for n in names),
              flush=True)
    for name in names:
        result["profile"][name] = profiled(variants[name])
        if not name.endswith("compiled"):
            result["host_probe"][name] = host_probe(variants[name])
    if device == "cuda":
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def summary_rows(results: list[dict]) -> list[list[str]]:
    """One row per (case, eager or compiled): step times, hand / trainer paired per round, first steps, kernels."""
    rows = []
    for res in results:
        for kind in ("eager", "compiled"):
            hand, trainer = f"hand_{kind}", f"trainer_{kind}"
            if hand not in res["seconds"]:
                continue
            ratio = [h / t for h, t in zip(res["seconds"][hand], res["seconds"][trainer])]
            ph, pt = res["profile"][hand], res["profile"][trainer]
            rows.append([res["case"], kind, f"{1e3 * statistics.median(res['seconds'][hand]):.2f}",
                         f"{1e3 * statistics.median(res['seconds'][trainer]):.2f}",
                         f"{statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}]",
                         f"{res['first_step_s'][hand]:.1f} / {res['first_step_s'][trainer]:.1f}",
                         f"{ph['kernel_ms']:.2f} / {pt['kernel_ms']:.2f}",
                         f"{pt['kernel_ms'] / ph['kernel_ms']:.3f}" if ph["kernel_ms"] else "-"])
    return rows


if __name__ == "__main__":  # one case in this process: python _gpu_anatomy.py CASE JSON [rounds steps] [--cpu-test]
    args = [a for a in sys.argv[1:] if a != "--cpu-test"]
    out = run_case(args[0], "--cpu-test" in sys.argv, int(args[2]) if len(args) > 2 else 7,
                   int(args[3]) if len(args) > 3 else 10)
    with open(args[1], "w") as f:
        json.dump(out, f, indent=1)
    torch.distributed.destroy_process_group()
