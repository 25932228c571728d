"""How right is `shardlib plan` on one GPU? (issue 25, item 4.) Calibrate the device (``calibrate(1, backend="nccl")``:
GEMM rates per dtype, bandwidth, the fixed cost of an eager op; no collectives on one rank), then for every one-GPU
layout of a BERT (precision fp32 / bf16 / fp16, activation checkpointing off / on, microbatch 8 / 32; sequence 128)
print the cost model's prediction (the layout search's own pricing, ``shardlib.analysis.search.price``) beside:

* the measured peak: ``torch.cuda.max_memory_allocated()`` over one training step after the warm-up steps (at least
  two, and until AdamW has state: fp16's first steps overflow and the scaler skips them), less what was allocated
  before the model was built (what the caching allocator hands out to tensors; not its cached-but-free blocks, not
  the CUDA context); ``static``: what is allocated between steps (parameters, AdamW state), the rest of the peak
  being the step's own (activations, gradients, temporaries);
* the measured step: the median of ``--steps`` calls of ``Trainer.train_step`` on a batch already on the device,
  each between two ``torch.cuda.synchronize()``; rounds interleave the layouts, the figure is the median over rounds.

``--terms`` adds what each step is made of (``_gpu_time_terms.py``: kernel time by class, the host-bound step at a
tiny batch, the fixed costs); ``--model vit-base|bert-large|t5-base`` with ``--seq``, ``--batches``,
``--precisions`` and ``--checkpointing`` measure the other models of issue 36 (``benchmarks/gpu_time_check.sh``).

    python benchmarks/plan_accuracy_gpu.py                       # BERT-base (12 layers, MLM), 3 rounds
    python benchmarks/plan_accuracy_gpu.py --json out.json --profile-out gpu.json
    .venv/bin/python benchmarks/plan_accuracy_gpu.py --cpu --layers 2 --rounds 1   # the logic on CPU (no peaks)
    .venv/bin/python benchmarks/plan_accuracy_gpu.py --reprice out.json   # price a GPU run's measurements again

The model is built on the device under ``torch.manual_seed(0)`` and sharded on a world of one
(``shardlib.init_mesh()`` without a launcher). Without CUDA (and without ``--cpu``) it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import print_table, write_json  # noqa: E402
from _plan_accuracy_layouts import MODELS, Layout, make_batch  # noqa: E402
from plan_accuracy import TARGET_BEST, TARGET_MEMORY, TARGET_RHO, spearman  # noqa: E402

MIB = 2 ** 20
SEQ = 128


def one_gpu_layouts(batches=(8, 32), seq=SEQ, precisions=("fp32", "bf16", "fp16"), checkpointing=(False, True)):
    return [Layout(batch=b, seq=seq, precision=p, activation_checkpointing=c)
            for b, p, c in itertools.product(batches, precisions, checkpointing)]


def measure(spec, layout: Layout, layers: int, device, mesh, steps: int, terms: bool = False) -> dict:
    import torch
    import transformers

    import shardlib

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(0)
    with device:
        model = getattr(transformers, spec.cls)(spec.config(layers))
    model = shardlib.shard(model, mesh)
    trainer = shardlib.Trainer(model, lambda params: torch.optim.AdamW(params, lr=1e-4), precision=layout.precision,
                               activation_checkpointing=layout.activation_checkpointing)
    batch = {k: v.to(device) for k, v in make_batch(spec, layout.global_batch, layout.seq).items()}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for warm in range(20):
        trainer.train_step(batch)
        if warm >= 1 and trainer.optimizer.state:
            break
    sync()
    static = torch.cuda.memory_allocated() - before if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train_step(batch)
    sync()
    peak = torch.cuda.max_memory_allocated() - before if cuda else None
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        trainer.train_step(batch)
        sync()
        times.append(time.perf_counter() - start)
    out = {"peak": peak, "static": static, "warmup_steps": warm + 1, "step_s": statistics.median(times)}
    if terms and cuda:  # what the step is made of (benchmarks/_gpu_time_terms.py), and the host-bound tiny step
        from _gpu_time_terms import host_step_s, kernel_terms

        out["terms"] = kernel_terms(lambda: trainer.train_step(batch))
        tiny = {k: v.to(device) for k, v in make_batch(spec, 1, min(16, layout.seq)).items()}
        out["host_step_s"] = host_step_s(lambda: trainer.train_step(tiny))
    del trainer, model, batch
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bert-768", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--batches", default="8,32", help="microbatch sizes, comma-separated")
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--checkpointing", default="off,on", help="activation checkpointing: off, on or both")
    parser.add_argument("--terms", action="store_true", help="also profile each layout's kernels by class and time "
                        "it at a tiny batch in the first round, and time the fixed costs (_gpu_time_terms.py)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (gloo): checks the logic, no peaks")
    parser.add_argument("--profile", help="a one-rank profile JSON (default: calibrate this device first)")
    parser.add_argument("--profile-out", help="where to write the calibrated profile")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--reprice", metavar="JSON", help="price the measurements of an earlier run (its --json) "
                                                          "again with the current cost model, measuring nothing")
    args = parser.parse_args()
    if args.reprice:
        return reprice(args)

    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("plan_accuracy_gpu: no CUDA device here (use --cpu to check the logic); nothing measured")
        return 0
    import shardlib
    from shardlib.analysis.calibrate import calibrate
    from shardlib.analysis.profile import load_profile
    from shardlib.analysis.search import price

    device = torch.device("cpu" if args.cpu else "cuda")
    if args.profile:
        profile = load_profile(args.profile, world_size=1)
    else:
        started = time.perf_counter()
        profile = calibrate(1, backend="gloo" if args.cpu else "nccl")
        print(f"calibrated in {time.perf_counter() - started:.0f} s", flush=True)
        if args.profile_out:
            profile.save(args.profile_out)
    print(profile.summary(), flush=True)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    spec, chosen = MODELS[args.model], layouts_of(args)
    if args.terms and device.type == "cuda":
        from _gpu_time_terms import micro_costs

        args.micro = micro_costs(device)
        print("fixed costs: " + ", ".join(f"{k} {v * 1e6:.2f} us" for k, v in args.micro.items()), flush=True)
    started = time.perf_counter()
    predicted = price(spec.config(args.layers), chosen, profile, cls=spec.cls)
    print(f"{len(chosen)} layouts priced in {time.perf_counter() - started:.1f} s", flush=True)
    mesh = shardlib.init_mesh()
    runs: list[list[dict]] = [[] for _ in chosen]
    for r in range(args.rounds):
        for i, layout in enumerate(chosen):
            try:
                runs[i].append(measure(spec, layout, args.layers, device, mesh, args.steps, args.terms and r == 0))
            except Exception as exc:  # noqa: BLE001 - one layout failing must not hide the others
                runs[i].append({"error": f"{type(exc).__name__}: {exc}"[:300]})
            last = runs[i][-1]
            shown = last.get("error") or (f"{(last['peak'] or 0) / MIB:.0f} MiB, {last['step_s'] * 1e3:.1f} ms")
            print(f"  [round {r + 1}/{args.rounds}] {layout.name():<28} batch {layout.batch:>2}: {shown}", flush=True)
    return report(args, chosen, predicted, runs, profile)


def layouts_of(args) -> list[Layout]:
    checkpointing = {"off": (False,), "on": (True,), "off,on": (False, True)}[args.checkpointing]
    return one_gpu_layouts(tuple(int(b) for b in args.batches.split(",")), args.seq, tuple(args.precisions.split(",")),
                           checkpointing)


def reprice(args) -> int:
    import json

    from shardlib.analysis.profile import Profile, load_profile
    from shardlib.analysis.search import price

    earlier = json.loads(open(args.reprice).read())
    profile = load_profile(args.profile, world_size=1) if args.profile else Profile.from_dict(earlier["profile"])
    for key in ("model", "layers", "rounds", "steps", "micro"):
        setattr(args, key, earlier.get(key))
    chosen = [Layout(**m["layout"]) for m in earlier["measured"]]
    spec = MODELS[args.model]
    predicted = price(spec.config(args.layers), chosen, profile, cls=spec.cls)
    print(f"re-priced {args.reprice} ({earlier.get('device', '?')}), profile {profile.machine}")
    return report(args, chosen, predicted, [m["runs"] for m in earlier["measured"]], profile)


def report(args, chosen, predicted, runs, profile) -> int:
    rows, points = [], []
    for layout, p, found in zip(chosen, predicted, runs):
        ok = [m for m in found if "error" not in m]
        if isinstance(p, str) or not ok:
            rows.append([layout.name(), str(layout.batch), p if isinstance(p, str) else "-",
                         found[-1].get("error", "-")])
            continue
        step = statistics.median(m["step_s"] for m in ok)
        peak = statistics.median(m["peak"] for m in ok) if ok[0]["peak"] is not None else None
        static = statistics.median(m["static"] for m in ok) if ok[0].get("static") is not None else None
        static_predicted = p.memory.get("parameters", 0) + p.memory.get("optimizer state", 0)
        points.append(dict(layout=layout.name(), batch=layout.batch, predicted_peak=p.peak_bytes, measured_peak=peak,
                           predicted_step=p.step_s, measured_step=step, round_steps=[m["step_s"] for m in ok],
                           predicted_static=static_predicted, measured_static=static,
                           memory_terms=p.memory, time_terms=p.time, bottleneck=p.bottleneck))
        rows.append([layout.name(), str(layout.batch), f"{p.peak_bytes / MIB:.0f}",
                     "-" if peak is None else f"{peak / MIB:.0f}",
                     "-" if peak is None else f"{(p.peak_bytes - peak) / peak:+.1%}",
                     f"{static_predicted / MIB:.0f} / " + ("-" if static is None else f"{static / MIB:.0f}"),
                     f"{p.step_s * 1e3:.1f}", f"{step * 1e3:.1f} ({min(points[-1]['round_steps']) * 1e3:.1f}-"
                     f"{max(points[-1]['round_steps']) * 1e3:.1f})", p.bottleneck])
    print_table(f"{args.model}, {args.layers} layers, one device: predicted vs measured (peak MiB, step ms; "
                f"{args.rounds} rounds)",
                ["layout", "batch", "pred peak", "meas peak", "error", "static pred / meas", "pred step",
                 "meas step (range)", "bottleneck"], rows)
    summary = {}
    if len(points) >= 2:  # ranked by time per sample (the batches differ): what the search maximizes, samples/s
        predicted = [pt["predicted_step"] / pt["batch"] for pt in points]
        measured = [pt["measured_step"] / pt["batch"] for pt in points]
        rho = spearman(predicted, measured)
        picked = min(range(len(points)), key=predicted.__getitem__)
        fastest = min(range(len(points)), key=measured.__getitem__)
        gap = measured[picked] / measured[fastest] - 1
        picked, fastest = points[picked], points[fastest]
        summary = dict(rho=rho, picked=f"{picked['layout']} b{picked['batch']}",
                       fastest=f"{fastest['layout']} b{fastest['batch']}", best_gap=gap)
        line = (f"time-per-sample Spearman rho {rho:.2f} (target >= {TARGET_RHO}); predicted fastest "
                f"{summary['picked']} is {gap:+.1%} from the measured fastest {summary['fastest']} (target <= "
                f"{TARGET_BEST:.0%})")
        if points[0]["measured_peak"] is not None:
            errors = [abs(pt["predicted_peak"] - pt["measured_peak"]) / pt["measured_peak"] for pt in points]
            within = sum(e <= TARGET_MEMORY for e in errors)
            summary.update(memory_error_max=max(errors), memory_error_median=statistics.median(errors),
                           memory_within=within)
            line = (f"memory error max {max(errors):.1%}, median {statistics.median(errors):.1%} ({within}/"
                    f"{len(errors)} within {TARGET_MEMORY:.0%}); " + line)
        print(line, flush=True)
    if args.json:
        write_json(args.json, dict(profile=profile.to_dict(), points=points, summary=summary, model=args.model,
                                   layers=args.layers, rounds=args.rounds, steps=args.steps, device=_device_name(),
                                   micro=getattr(args, "micro", None),
                                   measured=[{"layout": la.to_dict(), "runs": r} for la, r in zip(chosen, runs)]))
    return 0


def _device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"cpu, torch {torch.__version__}"


if __name__ == "__main__":
    sys.exit(main())
