"""``Trainer.fit`` on one GPU (the CUDA path of ``shardlib.train``; CI has none): samples/s per precision, fit vs a
bare ``train_step`` loop vs a plain PyTorch loop (interleaved rounds, paired ratios), checkpoint + bitwise resume.
Docs: docs/benchmarks/one-gpu.md.

    python benchmarks/gpu_fit.py [--json out.json]           # CUDA: BERT-base, ~2 minutes on an H100
    .venv/bin/python benchmarks/gpu_fit.py --small --cpu     # the same logic on CPU, tiny BERT
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

# CUBLAS_WORKSPACE_CONFIG left alone: ":4096:8" made a plain bf16 BERT-base step ~40% slower on an H100
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _checkout  # noqa: E402,F401  (shardlib importable from a plain checkout)
from _harness import write_json  # noqa: E402

FULL = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
BATCH = 32
FAILURES: list[str] = []


def section(name: str, fn) -> None:  # a failure prints its traceback, counts (exit status 1), and the run goes on
    print(f"\n== {name}", flush=True)
    try:
        fn()
    except Exception:  # noqa: BLE001 - reported, and the exit status says so
        FAILURES.append(name)
        print(f"FAILED: {name}\n{traceback.format_exc()}", flush=True)


def sst2_like(n: int, seq: int, vocab: int, seed: int) -> list[dict]:
    """[CLS] sentence [SEP] padded to ``seq``, 2 labels, a quarter of the tokens from the label's "sentiment" set."""
    g = torch.Generator().manual_seed(seed)
    marks = max(vocab // 100, 4)  # class 0 marks: [200, 200 + marks), class 1: [200 + marks, 200 + 2 marks)
    samples = []
    for _ in range(n):
        length = int(torch.randint(8, seq + 1, (1,), generator=g))
        label = int(torch.randint(0, 2, (1,), generator=g))
        ids = torch.zeros(seq, dtype=torch.long)
        ids[:length] = torch.randint(200 + 2 * marks, vocab, (length,), generator=g)
        ids[0], ids[length - 1] = 101 % vocab, 102 % vocab
        k = max(length // 4, 2)  # a quarter of the words carry the sentiment
        where = torch.randint(1, length - 1, (k,), generator=g)
        ids[where] = 200 + label * marks + torch.randint(0, marks, (k,), generator=g)
        mask = torch.zeros(seq, dtype=torch.long)
        mask[:length] = 1
        samples.append({"input_ids": ids, "token_type_ids": torch.zeros(seq, dtype=torch.long),
                        "attention_mask": mask, "labels": torch.tensor(label)})
    return samples


def build(opts, seed: int, precision: str | None = "fp32"):
    """BertForSequenceClassification (dropout 0.1) under ``seed``, sharded, in a Trainer (``precision`` None: plain)."""
    import transformers

    import shardlib

    config = transformers.BertConfig(**opts["model"], max_position_embeddings=512, num_labels=2,
                                     hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    torch.manual_seed(seed)
    with torch.device(opts["device"]):
        model = transformers.BertForSequenceClassification(config)
    return model if precision is None else shardlib.Trainer(
        shardlib.shard(model, opts["mesh"]), lambda params: torch.optim.AdamW(params, lr=opts["lr"]),
        max_grad_norm=1.0, precision=precision)


def sync(opts, free: bool = False) -> None:
    if free:
        gc.collect()
    if opts["device"] == "cuda":
        torch.cuda.synchronize()
        if free:
            torch.cuda.empty_cache()


def read_log(save_dir: Path) -> list[dict]:
    path = save_dir / "log.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def plain_loop(opts, dtype: str, batches: list):
    """Plain PyTorch: the same model unsharded, autocast, backward, ``clip_grad_norm_``, AdamW, ``float(loss)``."""
    m = build(opts, 0, None).train()
    optimizer = torch.optim.AdamW(m.parameters(), lr=opts["lr"])
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)  # fp32 / tf32: no autocast

    def run():
        for b in batches:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(opts["device"], dtype=autocast) if autocast else contextlib.nullcontext():
                loss = m(**b).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            optimizer.step()
            float(loss.detach())

    return run


def throughput(opts, name: str, results: dict) -> None:
    """One precision on one fresh model: fit with eval, then fit / bare / plain in interleaved rounds."""
    from torch.utils.data import default_collate

    from shardlib.train import warmup_cosine
    from shardlib.train.batches import to_device

    dtype, tf32 = ("fp32", True) if name == "tf32" else (name, False)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    row, trainer = results.setdefault("precisions", {}).setdefault(name, {}), build(opts, 0, dtype)
    tmp = Path(tempfile.mkdtemp(prefix=f"gpu_fit_{name}_"))

    def fit():
        t0 = time.perf_counter()
        result = trainer.fit(opts["train"], batch_size=BATCH, max_steps=opts["steps"], log_interval=5,
                             eval_data=opts["eval"], save_dir=tmp, lr_scheduler=warmup_cosine(0.1), progress=False,
                             metrics={"accuracy": lambda out, mb: (out["logits"].argmax(-1) == mb["labels"]).float()})
        sync(opts)
        wall, records = time.perf_counter() - t0, [r for r in read_log(tmp) if not r.get("eval")]
        rates, ev = [r["samples_per_s"] for r in records[1:] or records], result.evals[-1]  # first: warm-up
        row.update(fit_samples_per_s=statistics.median(rates), fit_rates=rates, fit_wall_s=wall,
                   first_loss=result.losses[0], last_loss=result.losses[-1], eval_loss=ev["loss"],
                   eval_accuracy=ev["accuracy"], eval_samples=ev["samples"],
                   grad_norm_last=records[-1].get("grad_norm"))
        print(f"{name}: {row['fit_samples_per_s']:.1f} samples/s (median of {len(rates)} log records; min "
              f"{min(rates):.1f}, max {max(rates):.1f}); loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; "
              f"eval loss {ev['loss']:.4f}, accuracy {ev['accuracy']:.3f} over {ev['samples']} samples; fit wall "
              f"{wall:.1f} s")

    def overhead():
        n = opts["overhead_steps"]
        device = torch.device(opts["device"])
        batches = [to_device(default_collate(opts["train"][i * BATCH:(i + 1) * BATCH]), device) for i in range(n)]
        variants = {"fit": lambda: trainer.fit(opts["train"], batch_size=BATCH, max_steps=n, log_interval=10,
                                               progress=False),
                    "bare": lambda: [trainer.train_step(b) for b in batches], "plain": plain_loop(opts, dtype, batches)}

        def window(variant: str) -> float:
            sync(opts)
            t0 = time.perf_counter()
            variants[variant]()
            sync(opts)
            return n * BATCH / (time.perf_counter() - t0)

        window("bare"), window("plain")  # warm-up (the fit above warmed the rest)
        rates = {v: [] for v in variants}
        for r in range(opts["rounds"]):
            for variant in list(variants)[:: 1 if r % 2 == 0 else -1]:
                rates[variant].append(window(variant))
        med = {v: statistics.median(x) for v, x in rates.items()}
        paired = {f"{a}_over_{b}": statistics.median(x / y for x, y in zip(rates[a], rates[b]))
                  for a, b in (("fit", "bare"), ("bare", "plain"))}
        row.update(overhead_fit_samples_per_s=med["fit"], overhead_bare_samples_per_s=med["bare"],
                   plain_samples_per_s=med["plain"], overhead_rates=rates, bare_step_ms=1000 * BATCH / med["bare"],
                   plain_step_ms=1000 * BATCH / med["plain"], **paired)
        print(f"{name}: fit {med['fit']:.1f}, bare train_step {med['bare']:.1f}, plain PyTorch {med['plain']:.1f} "
              f"samples/s over {opts['rounds']} rounds of {n} steps: fit/bare {paired['fit_over_bare']:.3f}, "
              f"bare/plain {paired['bare_over_plain']:.3f} (medians of paired ratios); step "
              f"{row['bare_step_ms']:.1f} ms (plain {row['plain_step_ms']:.1f} ms)", flush=True)

    try:
        section(f"{name}: fit {opts['steps']} steps + eval", fit)
        section(f"{name}: fit vs bare train_step loop", overhead)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True  # torch's defaults
        del trainer
        sync(opts, free=True)


def resume_check(opts, results: dict) -> None:
    """A saves at steps 3 and 6, B (another seed) resumes from 3: PASS when B's losses equal A's bitwise."""
    row, tmp = results.setdefault("resume", {}), Path(tempfile.mkdtemp(prefix="gpu_fit_resume_"))

    def run(tag: str, seed: int, **options):
        trainer = build(opts, seed)
        try:
            result = trainer.fit(opts["train"], batch_size=BATCH, max_steps=6, log_interval=1, save_dir=tmp / tag,
                                 progress=False, **options)
            sync(opts)
            return result, read_log(tmp / tag)
        finally:
            del trainer
            sync(opts, free=True)

    def attempt(label: str) -> bool:
        a, log_a = run(f"a{label}", 0, save_interval=3)
        ckpt = tmp / f"a{label}" / "checkpoints" / "step-00000003"
        b, _ = run(f"b{label}", 1, resume=ckpt)
        same = a.losses[3:] == b.losses and b.first_step == 3 and b.resumed_from == ckpt
        step_s = statistics.median(BATCH / r["samples_per_s"] for r in log_a[1:])
        size = sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file())
        row.update({f"losses_a{label}": a.losses, f"losses_b{label}": b.losses, f"pass{label}": same,
                    f"save_blocked_s{label}": a.save_blocked_s, f"step_s{label}": step_s, "checkpoint_bytes": size})
        print(f"run A{label} losses 1-6: {[f'{x:.6f}' for x in a.losses]}\nrun B{label} resumed from {ckpt.name}, "
              f"losses 4-6: {[f'{x:.6f}' for x in b.losses]}")
        if not same:
            print("\n".join(f"  {k} bits {[struct.pack('>d', x).hex() for x in v]}" for k, v in (("A", a.losses[3:]),
                                                                                              ("B", b.losses))))
        print(f"save blocked {', '.join(f'{1000 * s:.1f}' for s in a.save_blocked_s)} ms (steps 3, 6) vs median step "
              f"{1000 * step_s:.1f} ms; checkpoint {size / 2 ** 20:.0f} MiB\nresume bitwise (steps 4-6){label}: "
              f"{'PASS' if same else 'FAIL'}", flush=True)
        return same

    try:
        row["pass"] = attempt("")
        if not row["pass"]:
            row["control_deterministic"] = run("c", 0)[0].losses == row["losses_a"]
            print(f"control run C (= A without saves) {'equals' if row['control_deterministic'] else 'DIFFERS from'} "
                  "A bitwise", flush=True)
            if not row["control_deterministic"]:
                torch.use_deterministic_algorithms(True, warn_only=True)
                try:
                    row["pass_deterministic"] = attempt(" (deterministic algorithms)")
                finally:
                    torch.use_deterministic_algorithms(False)
        if not row["pass"] and not row.get("pass_deterministic"):
            raise AssertionError("resume did not reproduce the losses of steps 4-6 bitwise")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny BERT (hidden 64, 2 layers, 32 tokens)")
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even where CUDA is available")
    p.add_argument("--steps", type=int, help="fit steps per precision, logged every 5 (default 150; --small 20)")
    p.add_argument("--overhead-steps", type=int, help="steps per fit / bare / plain window (default 20; --small 10)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved fit / bare / plain rounds")
    p.add_argument("--precisions", default="fp32,tf32,bf16,fp16", help="tf32: fp32 with TF32 matmuls allowed")
    p.add_argument("--lr", type=float, default=2e-4, help="AdamW peak learning rate")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_fit: skipped, no CUDA device (pass --cpu to run the same logic on CPU)")
        return 0
    import torch.distributed as dist
    import transformers

    import shardlib

    device, seq, spec = "cpu" if args.cpu else "cuda", 32 if args.small else 128, SMALL if args.small else FULL
    steps, overhead_steps = args.steps or (20 if args.small else 150), args.overhead_steps or (10 if args.small else 20)
    mesh, cuda = shardlib.init_mesh(backend="gloo" if args.cpu else None), device == "cuda"
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device, "small": args.small,
            "backend": dist.get_backend(), "world": dist.get_world_size(),
            "gpu": torch.cuda.get_device_name() if cuda else None, "cuda": torch.version.cuda if cuda else None}
    print(f"gpu_fit: {info}", flush=True)
    opts = {"model": spec, "device": device, "mesh": mesh, "steps": steps, "lr": args.lr, "rounds": args.rounds,
            "overhead_steps": overhead_steps, "eval": sst2_like(16 * BATCH, seq, spec["vocab_size"], 2),
            "train": sst2_like(max(steps, overhead_steps) * BATCH + BATCH, seq, spec["vocab_size"], 1)}
    results, t0 = {"info": info, "batch": BATCH, "seq": seq, "model": spec}, time.perf_counter()
    for name in args.precisions.split(","):
        throughput(opts, name, results)
    section("checkpoint + resume (fp32, dropout 0.1)", lambda: resume_check(opts, results))
    results.update(wall_s=time.perf_counter() - t0, failures=FAILURES,
                   max_memory_allocated_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None)
    print("\n== summary\n| precision | fit samples/s | eval accuracy | bare train_step samples/s | fit / bare | bare "
          "step ms | plain PyTorch samples/s | bare / plain |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    keys = dict(fit_samples_per_s=1, eval_accuracy=3, overhead_bare_samples_per_s=1, fit_over_bare=3, bare_step_ms=1,
                plain_samples_per_s=1, bare_over_plain=3)  # -> decimals
    for name, row in results.get("precisions", {}).items():
        print(f"| {name} | " + " | ".join("-" if row.get(k) is None else f"{row[k]:.{d}f}" for k, d in keys.items())
              + " |")
    r = results.get("resume", {})
    if "save_blocked_s" in r:
        print(f"save blocked (steps 3, 6): {', '.join(f'{1000 * s:.1f} ms' for s in r['save_blocked_s'])}; "
              f"median fp32 step {1000 * r['step_s']:.1f} ms; checkpoint {r['checkpoint_bytes'] / 2 ** 20:.0f} MiB")
    verdict = "PASS" if r.get("pass") else "PASS (deterministic algorithms)" if r.get("pass_deterministic") else "FAIL"
    print(f"resume bitwise: {verdict}")
    print((f"max GPU memory allocated: {results['max_memory_allocated_gib']:.2f} GiB; " if cuda else "")
          + f"wall {results['wall_s']:.0f} s; failures: {FAILURES or 'none'}", flush=True)
    if args.json:
        write_json(args.json, results)
    dist.destroy_process_group()
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
