"""The workload of ``benchmarks/gpu_fit.py`` (its models, inputs, ranks and measurements); the script keeps its command line
and its report. ``Trainer.fit`` on one GPU: fp32 vs bf16 throughput, fit vs a bare ``train_step`` loop, checkpoint + exact resume."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import struct
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# CUBLAS_WORKSPACE_CONFIG is left alone: it is needed for determinism across streams only (one stream here), and
# ":4096:8" made a plain bf16 BERT-base step ~40% slower on an H100 (64-68 ms against 42-50 ms)


import torch  # noqa: E402

import _checkout  # noqa: E402,F401  (shardlib importable from a plain checkout)

FULL = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
BATCH = 32
FAILURES: list[str] = []


def section(name: str):
    """Run the decorated function now; a failure prints its traceback and is counted, the script goes on."""

    def run(fn):
        print(f"\n== {name}", flush=True)
        try:
            return fn()
        except Exception:  # noqa: BLE001 - reported, and the exit status says so
            FAILURES.append(name)
            print(f"FAILED: {name}\n{traceback.format_exc()}", flush=True)
            return None

    return run


# ------------------------------------------------------------------------------------------------------ data
def sst2_like(n: int, seq: int, vocab: int, seed: int) -> list[dict]:
    """SST-2-shaped samples: [CLS] sentence [SEP] padded to ``seq``, 2 labels; a quarter of the tokens are drawn
    from the label's own small set of "sentiment" tokens (learnable from scratch in a few dozen steps)."""
    g = torch.Generator().manual_seed(seed)
    marks = max(vocab // 100, 4)  # class 0 marks: [200, 200 + marks), class 1: [200 + marks, 200 + 2 marks)
    low = 200 + 2 * marks
    samples = []
    for _ in range(n):
        length = int(torch.randint(8, seq + 1, (1,), generator=g))
        label = int(torch.randint(0, 2, (1,), generator=g))
        ids = torch.zeros(seq, dtype=torch.long)
        ids[:length] = torch.randint(low, vocab, (length,), generator=g)
        ids[0], ids[length - 1] = 101 % vocab, 102 % vocab
        k = max(length // 4, 2)  # a quarter of the words carry the sentiment
        where = torch.randint(1, length - 1, (k,), generator=g)
        ids[where] = 200 + label * marks + torch.randint(0, marks, (k,), generator=g)
        mask = torch.zeros(seq, dtype=torch.long)
        mask[:length] = 1
        samples.append({"input_ids": ids, "token_type_ids": torch.zeros(seq, dtype=torch.long),
                        "attention_mask": mask, "labels": torch.tensor(label)})
    return samples


def accuracy(out, mb):
    return (out["logits"].argmax(-1) == mb["labels"]).float()


# ----------------------------------------------------------------------------------------------------- model
def build(opts, seed: int, precision: str = "fp32"):
    import transformers

    import shardlib

    config = transformers.BertConfig(**opts["model"], max_position_embeddings=512, num_labels=2,
                                     hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    torch.manual_seed(seed)
    with torch.device(opts["device"]):
        model = transformers.BertForSequenceClassification(config)
    model = shardlib.shard(model, opts["mesh"])
    trainer = shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=opts["lr"]), max_grad_norm=1.0,
                               precision=precision)
    return model, trainer


def sync(opts):
    if opts["device"] == "cuda":
        torch.cuda.synchronize()


def free(opts):
    import gc

    gc.collect()
    if opts["device"] == "cuda":
        torch.cuda.empty_cache()


def read_log(save_dir: Path) -> list[dict]:
    path = save_dir / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# -------------------------------------------------------------------------------------------------- sections
PRECISIONS = {"fp32": ("fp32", False), "tf32": ("fp32", True), "bf16": ("bf16", False), "fp16": ("fp16", False)}


def throughput(opts, name: str, results: dict) -> None:
    """Sections 1 and 2 for one precision, on one fresh model."""
    dtype, tf32 = PRECISIONS[name]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    row = results.setdefault("precisions", {}).setdefault(name, {})
    model, trainer = build(opts, seed=0, precision=dtype)
    tmp = Path(tempfile.mkdtemp(prefix=f"gpu_fit_{name}_"))
    try:
        @section(f"{name}: fit {opts['steps']} steps + eval")
        def _fit():
            t0 = time.perf_counter()
            from shardlib.train import warmup_cosine

            result = trainer.fit(opts["train"], batch_size=BATCH, max_steps=opts["steps"], log_interval=5,
                                 eval_data=opts["eval"], metrics={"accuracy": accuracy}, save_dir=tmp,
                                 lr_scheduler=warmup_cosine(0.1), progress=False)
            sync(opts)
            wall = time.perf_counter() - t0
            records = [r for r in read_log(tmp) if not r.get("eval")]
            rates = [r["samples_per_s"] for r in records[1:] or records]  # fewer than 10 steps: keep the first
            ev = result.evals[-1]
            row.update(fit_samples_per_s=statistics.median(rates), fit_rates=rates, fit_wall_s=wall,
                       first_loss=result.losses[0], last_loss=result.losses[-1], eval_loss=ev["loss"],
                       eval_accuracy=ev["accuracy"], eval_samples=ev["samples"],
                       grad_norm_last=records[-1].get("grad_norm"))
            print(f"{name}: {statistics.median(rates):.1f} samples/s (median of {len(rates)} log records; "
                  f"min {min(rates):.1f}, max {max(rates):.1f}); loss {result.losses[0]:.4f} -> "
                  f"{result.losses[-1]:.4f}; eval loss {ev['loss']:.4f}, accuracy {ev['accuracy']:.3f} over "
                  f"{ev['samples']} samples; fit wall {wall:.1f} s", flush=True)

        @section(f"{name}: fit vs bare train_step loop")
        def _overhead():
            from torch.utils.data import default_collate

            from shardlib.train.batches import to_device

            n = opts["overhead_steps"]
            device = torch.device(opts["device"])
            batches = [to_device(default_collate(opts["train"][i * BATCH:(i + 1) * BATCH]), device) for i in range(n)]
            sync(opts)

            plain = plain_loop(opts, dtype, batches)
            variants = {"fit": lambda: trainer.fit(opts["train"], batch_size=BATCH, max_steps=n, log_interval=10,
                                                   progress=False),
                        "bare": lambda: [trainer.train_step(b) for b in batches],
                        "plain": plain}

            def window(variant: str) -> float:
                sync(opts)
                t0 = time.perf_counter()
                variants[variant]()
                sync(opts)
                return n * BATCH / (time.perf_counter() - t0)

            window("bare"), window("plain")  # warm-up (the fit above warmed the rest)
            rates = {v: [] for v in variants}
            for r in range(opts["rounds"]):
                for variant in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                    rates[variant].append(window(variant))
            med = {v: statistics.median(x) for v, x in rates.items()}
            paired = statistics.median(f / b for f, b in zip(rates["fit"], rates["bare"]))
            bare_plain = statistics.median(b / p for b, p in zip(rates["bare"], rates["plain"]))
            row.update(overhead_fit_samples_per_s=med["fit"], overhead_bare_samples_per_s=med["bare"],
                       plain_samples_per_s=med["plain"], fit_over_bare=paired, bare_over_plain=bare_plain,
                       overhead_rates=rates, bare_step_ms=1000 * BATCH / med["bare"],
                       plain_step_ms=1000 * BATCH / med["plain"])
            print(f"{name}: fit {med['fit']:.1f}, bare train_step {med['bare']:.1f}, plain PyTorch {med['plain']:.1f} "
                  f"samples/s over {opts['rounds']} rounds of {n} steps: fit/bare {paired:.3f}, bare/plain "
                  f"{bare_plain:.3f} (medians of paired ratios); step {1000 * BATCH / med['bare']:.1f} ms "
                  f"(plain {1000 * BATCH / med['plain']:.1f} ms)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True  # torch's default
        del model, trainer
        free(opts)


def plain_loop(opts, dtype, batches):
    """The reference: the same model unsharded, a hand-written step (autocast, backward, torch's
    ``clip_grad_norm_``, AdamW, the loss read back as a float like ``train_step``)."""
    import contextlib

    import transformers

    config = transformers.BertConfig(**opts["model"], max_position_embeddings=512, num_labels=2,
                                     hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    torch.manual_seed(0)
    with torch.device(opts["device"]):
        model = transformers.BertForSequenceClassification(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts["lr"])
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)  # fp32 / tf32: no autocast
    autocast = (lambda: torch.autocast(opts["device"], dtype=autocast_dtype)) if autocast_dtype \
        else contextlib.nullcontext

    def run():
        for b in batches:
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = model(**b).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            float(loss.detach())

    return run


def anatomy(opts, results: dict, steps: int = 8) -> None:
    """Where a bf16 ``train_step`` spends its time: each phase timed between device synchronizations, then the
    top operators of a torch.profiler trace by self CPU time (is the step bound by the host?)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.data import default_collate

    from shardlib.train.batches import to_device

    model, trainer = build(opts, seed=0, precision="bf16")
    batch = to_device(default_collate(opts["train"][:BATCH]), torch.device(opts["device"]))
    for _ in range(3):
        trainer.train_step(batch)
    phases: dict[str, list[float]] = {}

    def timed(name, fn):
        sync(opts)
        t0 = time.perf_counter()
        out = fn()
        sync(opts)
        phases.setdefault(name, []).append(1000 * (time.perf_counter() - t0))
        return out

    for _ in range(steps):
        timed("zero_grad", trainer.zero_grad)
        total = timed("global loss items", lambda: trainer._global_items([batch]))
        timed("forward + backward", lambda: trainer.forward_backward(batch, total_items=total))
        timed("reduce_gradients", trainer.reduce_gradients)
        timed("clip_grad_norm", lambda: trainer.clip_grad_norm(1.0))
        timed("optimizer step", trainer.optimizer_step)
    row = {k: statistics.median(v) for k, v in phases.items()}
    results["anatomy_bf16_ms"] = row
    print("bf16 train_step phases (ms, median of %d, synchronized): %s" % (
        steps, ", ".join(f"{k} {v:.2f}" for k, v in row.items())), flush=True)
    # a prototype of a cheaper gradient norm + clip (valid at tp = pp = 1 only): per-tensor norms in one foreach
    # call and one host sync, the scale applied by one foreach multiply; against the current per-parameter loop
    def foreach_norm():
        grads = [p.grad for p in trainer.params if p.grad is not None]
        return math.sqrt(float(torch.stack(torch._foreach_norm(grads)).double().square().sum()))

    def foreach_clip(max_norm):
        norm = foreach_norm()
        if not math.isfinite(norm):
            raise FloatingPointError(f"the gradient norm is {norm}")
        scale = max_norm / (norm + 1e-6)
        if scale < 1:
            torch._foreach_mul_([p.grad for p in trainer.params if p.grad is not None], scale)
        return norm

    n, rounds = opts["overhead_steps"], max(opts["rounds"] - 1, 2)
    for label in ("fp32", "bf16"):
        trainer.precision = label
        rates: dict[str, list[float]] = {"current": [], "foreach": []}
        for r in range(rounds + 1):
            for variant in (("current", "foreach") if r % 2 == 0 else ("foreach", "current")):
                if variant == "foreach":
                    trainer.clip_grad_norm = foreach_clip
                sync(opts)
                t0 = time.perf_counter()
                for _ in range(n):
                    trainer.train_step(batch)
                sync(opts)
                trainer.__dict__.pop("clip_grad_norm", None)
                if r:  # round 0 warms up
                    rates[variant].append(n * BATCH / (time.perf_counter() - t0))
        cur, fe = statistics.median(rates["current"]), statistics.median(rates["foreach"])
        results[f"anatomy_{label}_grad_norm"] = {"current_samples_per_s": cur, "foreach_samples_per_s": fe}
        print(f"{label} train_step with the current grad norm {cur:.1f} samples/s ({1000 * BATCH / cur:.1f} ms), with "
              f"a foreach norm + clip {fe:.1f} samples/s ({1000 * BATCH / fe:.1f} ms): {fe / cur:.3f}x", flush=True)
    trainer.precision = "bf16"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if opts["device"] == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            trainer.train_step(batch)
        sync(opts)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48),
          flush=True)
    del model, trainer
    free(opts)


def bits(values: list[float]) -> list[str]:
    return [struct.pack(">d", v).hex() for v in values]


def resume_check(opts, results: dict) -> None:
    row = results.setdefault("resume", {})
    steps = 6
    tmp = Path(tempfile.mkdtemp(prefix="gpu_fit_resume_"))
    try:
        def run(tag: str, seed: int, **options):
            model, trainer = build(opts, seed=seed)
            try:
                result = trainer.fit(opts["train"], batch_size=BATCH, max_steps=steps, log_interval=1,
                                     save_dir=tmp / tag, progress=False, **options)
                sync(opts)
                return result, read_log(tmp / tag)
            finally:
                del model, trainer
                free(opts)

        def attempt(label: str) -> bool:
            a, log_a = run(f"a{label}", 0, save_interval=3)
            ckpt = tmp / f"a{label}" / "checkpoints" / "step-00000003"
            b, _ = run(f"b{label}", 1, resume=ckpt)
            same = a.losses[3:] == b.losses and b.first_step == 3 and b.resumed_from == ckpt
            step_s = statistics.median(BATCH / r["samples_per_s"] for r in log_a[1:])
            size = sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file())
            row.update({f"losses_a{label}": a.losses, f"losses_b{label}": b.losses, f"pass{label}": same,
                        f"save_blocked_s{label}": a.save_blocked_s, f"step_s{label}": step_s,
                        "checkpoint_bytes": size})
            print(f"run A{label} losses 1-6: {[f'{x:.6f}' for x in a.losses]}")
            print(f"run B{label} resumed from {ckpt.name}, losses 4-6: {[f'{x:.6f}' for x in b.losses]}")
            if not same:
                print(f"  A bits {bits(a.losses[3:])}\n  B bits {bits(b.losses)}")
            print(f"save blocked {', '.join(f'{1000 * s:.1f}' for s in a.save_blocked_s)} ms (steps 3, 6) vs median "
                  f"step {1000 * step_s:.1f} ms; checkpoint {size / 2 ** 20:.0f} MiB")
            print(f"resume bitwise (steps 4-6){label}: {'PASS' if same else 'FAIL'}", flush=True)
            return same

        same = attempt("")
        row["pass"] = same
        if not same:
            c, _ = run("c", 0)
            deterministic = c.losses == row["losses_a"]
            row["control_deterministic"] = deterministic
            print(f"control run C (= A without saves) {'equals' if deterministic else 'DIFFERS from'} A bitwise",
                  flush=True)
            if not deterministic:
                torch.use_deterministic_algorithms(True, warn_only=True)
                try:
                    row["pass_deterministic"] = attempt(" (deterministic algorithms)")
                finally:
                    torch.use_deterministic_algorithms(False)
        if not row["pass"] and not row.get("pass_deterministic"):
            raise AssertionError("resume did not reproduce the losses of steps 4-6 bitwise")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
