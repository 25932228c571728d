"""Eager vs torch.compile (Inductor), unsharded and shardlib tp=2, forward + backward; and on one GPU, eager vs
compiled vs shardlib's hand-fused kernels.

CPU (default): the workloads and timing of ``tp_throughput.py`` (BERT-base, ViT-base, T5-base; batch 8 x 128
tokens / 8 images; fp32, dropout 0, no optimizer; median step of the timed steps, each the slowest rank's), run in
four modes one after another: ``unsharded`` (one process, 2 threads), ``unsharded_compiled``, ``shardlib`` (tp=2,
two processes of one thread) and ``shardlib_compiled`` (``shardlib.compile_model``). The first warm-up step
compiles; compile time is reported apart. Output checksums must agree across the modes.

GPU (``--device cuda``): one process, BERT-base / ViT-base / T5-base at batch 32, fp32 and bf16 autocast, each
as HF eager, shardlib tp=1 with the hand kernels (fused QKV, bias+GELU epilogue), HF compiled and shardlib tp=1
compiled; CUDA-event timing, median of the timed steps.

    .venv/bin/python benchmarks/compile_speed.py                 # CPU, ~15 minutes on 2 cores
    .venv/bin/python benchmarks/compile_speed.py --quick         # tiny models, a smoke check
    python benchmarks/compile_speed.py --device cuda             # one GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import _checkout  # noqa: E402,F401  (shardlib importable from a plain checkout, as on the GPU machine)
import _tp_throughput_workload as tpw  # noqa: E402  (the models and inputs of tp_throughput)
import tp_throughput as tpb  # noqa: E402  (sets the offline environment before transformers is imported)

CPU_MODES = ("unsharded", "unsharded_compiled", "shardlib", "shardlib_compiled")


def cpu_main(sizes: list[str], steps: int | None, batch: int, seq: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", tpb.loopback_ifname())
    os.environ.setdefault("SHARDLIB_TIMEOUT", "900")
    rows = []
    for size in sizes:
        n = steps or tpb.DEFAULT_STEPS[size]
        ms, compile_s, sums = {}, {}, {}
        for mode in CPU_MODES:
            tpb.wait_idle(60, tpb.IDLE_CORES)
            r = tpb.run_mode(mode, [size], batch, seq, seq, 2, {size: n})[size]
            ms[mode] = statistics.median(r["times"]) * 1e3
            sums[mode] = r["checksum"]
            compile_s[mode] = r["wall_s"] - sum(r["times"]) - r["build_s"]
            print(f"  {size:<10} {tpb.MODE_TITLES[mode]:<28} {ms[mode]:9.1f} ms/step  (warm-up + start-up "
                  f"{compile_s[mode]:.0f} s, checksum {tpb._fmt_checksum(r['checksum'])})", flush=True)
        agree = all(max(abs(a - b) for a, b in zip(sums[m], sums["unsharded"])) < 1e-3 for m in CPU_MODES)
        rows.append((size, ms, compile_s, agree))
    print("\n| model | unsharded eager | unsharded compiled | speed-up | tp=2 eager | tp=2 compiled | speed-up | "
          "compiled tp=2 / compiled unsharded | outputs agree |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size, ms, _, agree in rows:
        print(f"| {size} | {ms['unsharded']:.0f} ms | {ms['unsharded_compiled']:.0f} ms | "
              f"{ms['unsharded'] / ms['unsharded_compiled']:.2f}x | {ms['shardlib']:.0f} ms | "
              f"{ms['shardlib_compiled']:.0f} ms | {ms['shardlib'] / ms['shardlib_compiled']:.2f}x | "
              f"{ms['unsharded_compiled'] / ms['shardlib_compiled']:.2f}x | {'yes' if agree else 'NO'} |")


# ------------------------------------------------------------------------------------------------------------ GPU
GPU_VARIANTS = ("eager", "kernels", "compiled", "kernels_compiled")


def _gpu_model(size: str, variant: str):
    import transformers

    import shardlib

    torch.manual_seed(tpw.SEED)
    model = getattr(transformers, tpw.MODEL_CLASS[tpb.family(size)])(tpw.model_config(size)).cuda()
    if variant.startswith("kernels"):
        kernels = shardlib.Kernels(fused_qkv=True, bias_gelu=tpb.family(size) != "t5", dropout_add=True)
        model = shardlib.shard(model, shardlib.init_mesh(), kernels=kernels)
    if variant.endswith("compiled"):
        shardlib.compile_model(model) if variant != "compiled" else model.compile()
    return model.train()


def _gpu_time(size: str, variant: str, dtype, batch: int, seq: int, steps: int) -> tuple[float, float]:
    model = _gpu_model(size, variant)
    inputs = {k: v.cuda() if torch.is_tensor(v) else v
              for k, v in tpw._make_inputs(size, model.config, batch, seq, seq).items()}

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            hs = tpw._final_states(size, model(**inputs))
        sum(h.float().pow(2).mean() for h in hs).backward()

    t0 = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del model
    torch.cuda.empty_cache()
    return statistics.median(times), warm_s


def gpu_main(sizes: list[str], steps: int, batch: int, seq: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, batch {batch}, seq {seq}, TF32 matmuls")
    print("| model | precision | HF eager | shardlib kernels (eager) | HF compiled | shardlib kernels compiled | "
          "compiled / eager | kernels eager / HF eager |")
    print("|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            ms = {v: _gpu_time(size, v, dtype, batch, seq, steps)[0] for v in GPU_VARIANTS}
            torch._dynamo.reset()
            print(f"| {size} | {name} | {ms['eager']:.1f} ms | {ms['kernels']:.1f} ms | {ms['compiled']:.1f} ms | "
                  f"{ms['kernels_compiled']:.1f} ms | {ms['eager'] / ms['compiled']:.2f}x | "
                  f"{ms['eager'] / ms['kernels']:.2f}x |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--sizes", default=None, help="comma-separated sizes of tp_throughput.py (default: bert-base, "
                                                 "vit-base, t5-base; --quick: the tiny ones)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (CPU default: tp_throughput's; GPU 20)")
    p.add_argument("--batch", type=int, default=None, help="default 8 on CPU, 32 on GPU")
    p.add_argument("--seq", type=int, default=None, help="default 128 (--quick 32)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    sizes = args.sizes.split(",") if args.sizes else (
        list(tpb.QUICK_SIZES) if args.quick else ["bert-base", "vit-base", "t5-base"])
    seq = args.seq or (32 if args.quick else 128)
    if args.device == "cuda":
        gpu_main(sizes, args.steps or 20, args.batch or 32, seq)
    else:
        cpu_main(sizes, args.steps or (3 if args.quick else None), args.batch or 8, seq)
    return 0


if __name__ == "__main__":
    sys.exit(main())
