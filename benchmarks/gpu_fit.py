"""``Trainer.fit`` on one GPU: fp32 vs bf16 throughput, fit vs a bare ``train_step`` loop, checkpoint + exact resume.

CI has no GPU, so this is the one place the CUDA path of the training system is exercised: ``init_mesh()`` without a
launcher (a world of one on NCCL with an in-process store), ``fit`` moving CPU batches to the model's device from
pinned memory, bf16 autocast, the global gradient norm and clipping on CUDA gradients, evaluation, background
checkpoints staged from GPU memory, and a resume that restores CUDA parameters, the AdamW moments and the CUDA RNG
streams (dropout on) bitwise.

What is measured
----------------
A ``BertForSequenceClassification`` (BERT-base: 12 layers, hidden 768, 12 heads, intermediate 3072, vocab 30522,
2 labels, dropout 0.1; ``--small``: 2 layers, hidden 64, 4 heads, vocab 1000, 32 tokens) built on the device under
``torch.manual_seed(0)``, ``shardlib.shard(model, shardlib.init_mesh())``, trained by
``shardlib.Trainer(model, AdamW(lr=2e-4), max_grad_norm=1.0, precision=...)`` on generated SST-2-shaped data:
dicts of CPU tensors ``input_ids`` / ``token_type_ids`` / ``attention_mask`` [128] (sentences of 8-128 tokens,
padded) and ``labels`` (2 classes; a quarter of each sentence's tokens come from its label's own small set of
"sentiment" tokens, so the task is learnable from scratch and the eval accuracy means something; 512 eval samples).
Global batch 32, one microbatch.

1. per precision (``fp32``: no autocast, torch's default fp32 matmuls; ``tf32``: the same with TF32 matmuls
   allowed; ``bf16``: ``precision="bf16"``, autocast; ``fp16``: autocast and the dynamic loss scaler), a fresh model: ``trainer.fit(train, batch_size=32,
   max_steps=150, log_interval=5, eval_data=eval, metrics={"accuracy": ...}, lr_scheduler=warmup_cosine(0.1))``;
   samples/s = the median of the log records' ``samples_per_s`` (the first record, with CUDA / cuBLAS warm-up,
   skipped); eval accuracy at the end;
2. on the same trainer, the fit overhead: interleaved rounds of ``trainer.fit(train, batch_size=32, max_steps=20,
   progress=False)`` (no eval, no save_dir) and of a bare loop ``for b in batches: trainer.train_step(b)`` over the
   same global batches collated beforehand and already on the GPU, each window timed between
   ``torch.cuda.synchronize()`` calls; ratio = median fit samples/s / median bare samples/s (fit also builds its
   DataLoader, collates, pins and copies every batch). A third variant, ``plain``, is the reference without
   shardlib: the same model unsharded (same seed), a hand-written step (autocast, ``loss.backward()``, torch's
   ``clip_grad_norm_(1.0)``, ``AdamW.step()``, ``float(loss)``) over the same GPU batches: bare / plain is what
   ``shard`` + ``Trainer.train_step`` cost over plain PyTorch on one GPU;
3. checkpoint + resume (fp32, dropout on): run A, a fresh model, ``fit(max_steps=6, save_interval=3,
   log_interval=1, save_dir=tmp/a)`` (saves after steps 3 and 6); run B, a fresh model built from *another* seed,
   ``fit(max_steps=6, save_dir=tmp/b, resume=tmp/a/checkpoints/step-00000003)``; PASS when B's losses for steps 4-6
   equal A's bitwise. Run C repeats A without saving (a control: if A and C differ, the GPU kernels themselves are
   not run-to-run deterministic, and A / B are repeated with ``torch.use_deterministic_algorithms(True)``).
   ``FitResult.save_blocked_s`` (the time the loop waits while the local shards and AdamW state are copied to
   host memory) is reported against the median step time of run A.
4. ``--anatomy``: the phases of a bf16 ``train_step`` (global loss items, forward + backward, gradient reduction,
   clipping, optimizer step), each timed between synchronizations; ``train_step`` (fp32 and bf16) with its
   per-parameter float64 gradient norm against a prototype that takes the per-tensor norms in one
   ``torch._foreach_norm`` and scales with one ``torch._foreach_mul_`` (valid at tp = pp = 1); and a torch.profiler
   table of the top operators by self CPU time.

How to run
----------
    python benchmarks/gpu_fit.py                        # on a CUDA machine; BERT-base, about 2 minutes on an H100
    python benchmarks/gpu_fit.py --json out.json --anatomy   # also write JSON; profile a bf16 step
    .venv/bin/python benchmarks/gpu_fit.py --small --cpu   # the same logic on CPU at a tiny size (~1 minute)

Without CUDA (and without ``--cpu``) it prints one line and exits 0. Nothing is downloaded. Every section runs
even when an earlier one failed; a failure prints its traceback and makes the exit status 1. It runs from a plain
checkout too (``PYTHONPATH=$PWD``, no ``pip install``): ``shardlib.kernels`` / ``shardlib.policies`` are mapped to
``kernels/`` / ``policies/`` as the package does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# CUBLAS_WORKSPACE_CONFIG is left alone: it is needed for determinism across streams only (one stream here), and
# ":4096:8" made a plain bf16 BERT-base step ~40% slower on an H100 (64-68 ms against 42-50 ms)


import torch  # noqa: E402

import _checkout  # noqa: E402,F401  (shardlib importable from a plain checkout)
from _harness import write_json  # noqa: E402
from _gpu_fit_workload import (  # noqa: E402
    BATCH, FAILURES, FULL, SMALL, anatomy, resume_check, section, sst2_like, throughput,
)


# ------------------------------------------------------------------------------------------------------ main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny BERT (hidden 64, 2 layers, 32 tokens)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even where CUDA is available")
    parser.add_argument("--steps", type=int, help="fit steps per precision, logged every 5 (default 150; --small 20)")
    parser.add_argument("--overhead-steps", type=int, help="steps per fit / bare window (default 20; --small 10)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved fit / bare / plain rounds")
    parser.add_argument("--precisions", default="fp32,tf32,bf16,fp16")
    parser.add_argument("--lr", type=float, default=2e-4, help="AdamW peak learning rate")
    parser.add_argument("--anatomy", action="store_true",
                        help="also time the phases of a bf16 train_step and print a profiler table")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_fit: skipped, no CUDA device (pass --cpu to run the same logic on CPU)")
        return 0

    import transformers

    import shardlib

    device = "cpu" if args.cpu else "cuda"
    args.steps = args.steps or (20 if args.small else 150)
    args.overhead_steps = args.overhead_steps or (10 if args.small else 20)
    mesh = shardlib.init_mesh(backend="gloo" if args.cpu else None)
    import torch.distributed as dist

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
            "backend": dist.get_backend(), "world": dist.get_world_size(), "small": args.small,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
            "cuda": torch.version.cuda if device == "cuda" else None}
    print(f"gpu_fit: {info}", flush=True)
    seq = 32 if args.small else 128
    model_opts = SMALL if args.small else FULL
    opts = {"model": model_opts, "device": device, "mesh": mesh, "steps": args.steps, "lr": args.lr,
            "overhead_steps": args.overhead_steps, "rounds": args.rounds,
            "train": sst2_like(max(args.steps, args.overhead_steps) * BATCH + BATCH, seq, model_opts["vocab_size"], 1),
            "eval": sst2_like(16 * BATCH, seq, model_opts["vocab_size"], 2)}
    results: dict = {"info": info, "batch": BATCH, "seq": seq, "model": model_opts}
    t0 = time.perf_counter()
    for name in args.precisions.split(","):
        throughput(opts, name, results)
    section("checkpoint + resume (fp32, dropout 0.1)")(lambda: resume_check(opts, results))
    if args.anatomy:
        section("anatomy of a bf16 train_step")(lambda: anatomy(opts, results))
    if device == "cuda":
        results["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    results["wall_s"] = time.perf_counter() - t0
    results["failures"] = FAILURES

    print("\n== summary")
    print("| precision | fit samples/s | eval accuracy | bare train_step samples/s | fit / bare | bare step ms | "
          "plain PyTorch samples/s | bare / plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in results.get("precisions", {}).items():
        cells = [row.get("fit_samples_per_s"), row.get("eval_accuracy"), row.get("overhead_bare_samples_per_s"),
                 row.get("fit_over_bare"), row.get("bare_step_ms"), row.get("plain_samples_per_s"),
                 row.get("bare_over_plain")]
        fmt = ["{:.1f}", "{:.3f}", "{:.1f}", "{:.3f}", "{:.1f}", "{:.1f}", "{:.3f}"]
        print(f"| {name} | " + " | ".join("-" if c is None else f.format(c) for c, f in zip(cells, fmt)) + " |")
    r = results.get("resume", {})
    if "save_blocked_s" in r:
        print(f"save blocked (steps 3, 6): {', '.join(f'{1000 * s:.1f} ms' for s in r['save_blocked_s'])}; "
              f"median fp32 step {1000 * r['step_s']:.1f} ms; checkpoint {r['checkpoint_bytes'] / 2 ** 20:.0f} MiB")
    verdict = "PASS" if r.get("pass") else "PASS (deterministic algorithms)" if r.get("pass_deterministic") else "FAIL"
    print(f"resume bitwise: {verdict}")
    if device == "cuda":
        print(f"max GPU memory allocated: {results['max_memory_allocated_gib']:.2f} GiB")
    print(f"wall {results['wall_s']:.0f} s; failures: {FAILURES or 'none'}", flush=True)
    if args.json:
        write_json(args.json, results)
    dist.destroy_process_group()
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
