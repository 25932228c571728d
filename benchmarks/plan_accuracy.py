"""How right is `shardlib plan`? The cost model's predicted peak memory and step time against ``Trainer.train_step``'s
measured ones, every layout, in one run. Docs: docs/benchmarks/planner-accuracy.md; the search's own time
(--search-time): docs/planning.md, "The search itself".

    python benchmarks/plan_accuracy.py                       # calibrate 4 ranks; bert-256, bert-768, t5-small
    python benchmarks/plan_accuracy.py --models bert-256 --only pp2 --profile prof.json   # the pipeline layouts
    python benchmarks/plan_accuracy.py --reprice JSON [--profile P]   # an earlier run priced again (CPU or GPU)
    python benchmarks/plan_accuracy.py --device cuda --models bert-768 --layers 12   # one GPU (BERT-base)
    .venv/bin/python benchmarks/plan_accuracy.py --quick     # smoke run: quick calibration, bert-256 dp4, 1 round
    python benchmarks/plan_accuracy.py --ep --rounds 5       # expert parallelism: mixtral-256, dp4 at ep 1, 2, 4
    python benchmarks/plan_accuracy.py --search-time --baseline /tmp/base --jobs 1   # the search's own time, 64 ranks
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _checkout  # noqa: E402,F401  (shardlib from this checkout, or SHARDLIB_CHECKOUT's: --search-time's baseline)
import shardlib  # noqa: E402,F401  (bound now: _plan_accuracy_layouts puts this checkout first on sys.path)
from _harness import fmt_cores, interleaved, machine_busy_s, median_spread, paired_ratio, print_table  # noqa: E402
from _harness import wait_idle, write_json  # noqa: E402
from _plan_accuracy_layouts import EP_LAYOUTS, MODELS, Layout, layouts, make_batch, one_device_layouts  # noqa: E402
from _plan_accuracy_report import plot, summarize  # noqa: E402

MIB = 2 ** 20


def price_of(name: str, chosen, profile, layers):
    from shardlib.analysis.search import price

    return price(MODELS[name].config(layers), chosen, profile, cls=MODELS[name].cls)


def measure_all(args, name: str, chosen, predicted) -> dict:
    """Measure ``chosen`` in ``args.rounds`` interleaved rounds; the summary of the model."""
    from _plan_accuracy_workload import measure

    runs: list[list[dict]] = [[] for _ in chosen]
    for r in range(args.rounds):
        for i, layout in enumerate(chosen):
            if args.world == 4:
                m = measure(name, layout, steps=args.steps, layers=args.layers, warmup=args.warmup)
                shown = m["error"] or f"{m['peak_growth_anon_bytes'] / MIB:.0f} MiB, {m['step_s_median']:.3f} s"
            else:
                try:
                    m = measure_one(MODELS[name], layout, args.layers, args.torch_device, args.mesh, args.steps)
                    shown = f"{(m['peak'] or 0) / MIB:.0f} MiB, {m['step_s'] * 1e3:.1f} ms"
                except Exception as exc:  # noqa: BLE001 - one layout failing must not hide the others
                    m = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    shown = m["error"]
            runs[i].append(m)
            print(f"  [{name} round {r + 1}/{args.rounds}] {layout.name():<40} batch {layout.batch:>2}: {shown}",
                  flush=True)
    return summarize(name, args.layers or MODELS[name].layers, chosen, predicted, runs, args.world)


def reprice(path: str, profile_path: str | None) -> tuple[dict, list[dict]]:
    """An earlier run's measurements (also docs/data's older formats) priced again with ``profile_path`` or its own."""
    from shardlib.analysis.profile import Profile, load_profile

    earlier = json.loads(open(path).read())
    results = earlier.get("results") or [dict(earlier, world=1)]  # the one-GPU script wrote one model, no "results"
    world = results[0].get("world", 4)
    profile = load_profile(profile_path, world_size=world) if profile_path else \
        Profile.from_dict(earlier["profile"], source=path)
    print(f"re-pricing {path} ({earlier.get('device', '?')}) with {profile.summary()}", flush=True)
    out = []
    for res in results:
        if "measured" in res:
            chosen = [Layout(**m["layout"]) for m in res["measured"]]
            runs = [m["runs"] for m in res["measured"]]
        else:  # points only: per-round step medians (or min, median, max of 3 rounds), the peak of every round
            by_name = {la.name(): la for la in layouts(res["model"], layers=res.get("layers"))}
            chosen = [by_name[pt["layout"]] for pt in res["points"]]
            runs = [[{"peak_growth_anon_bytes": pt["measured_peak"], "step_s_median": s} for s in pt.get(
                "round_steps") or [pt["step_spread"][0], pt["measured_step"], pt["step_spread"][1]]]
                for pt in res["points"]]
        layers = res.get("layers")
        predicted = price_of(res["model"], chosen, profile, layers)
        out.append(summarize(res["model"], layers, chosen, predicted, runs, world))
    return profile, out


def measure_one(spec, layout: Layout, layers: int, device, mesh, steps: int) -> dict:
    """One layout at a world of one: the CUDA peak over a step, what stays between steps, the median step."""
    import torch
    import transformers

    import shardlib

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
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
    return {"peak": peak, "static": static, "warmup_steps": warm + 1, "step_s": statistics.median(times)}


# ------------------------------------------------------------------------------------------------ --search-time
#: the models `shardlib plan --world 64` is timed on, built from their configs (transformers' defaults otherwise)
SEARCH_MODELS = {
    "bert-large": ("BertForMaskedLM", "BertConfig", dict(hidden_size=1024, num_hidden_layers=24,
                                                          num_attention_heads=16, intermediate_size=4096)),
    "t5-large": ("T5ForConditionalGeneration", "T5Config", dict(d_model=1024, d_ff=4096, num_layers=24,
                                                                  num_decoder_layers=24, num_heads=16, d_kv=64)),
}
#: `shardlib plan MODEL --world 64 --memory 16GiB --global-batch 512 --seq 512`
SEARCH = dict(world=64, memory_bytes=16 * 2 ** 30, global_batch=512, seq=512, precision="fp32")
CHILD_MARK = "SEARCH_TIME_RESULT "


def cores() -> int:
    """The cores this process may run on (what `shardlib plan --world` takes as its --jobs default)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def search_child(model: str, workers: int) -> int:
    """In a fresh process (imports and meta-kernel caches cold): one search of ``model`` as `shardlib plan --world`
    runs it, with the arguments this checkout's ``search()`` takes; its result on one line of stdout."""
    started = time.perf_counter()
    import transformers

    from shardlib.analysis.search import search

    cls, config_cls, fields = SEARCH_MODELS[model]
    config = getattr(transformers, config_cls)(**fields)
    accepted = inspect.signature(search).parameters
    kwargs = dict(SEARCH, cls=cls) | {k: v for k, v in dict(ulysses=True, workers=workers).items() if k in accepted}
    world = kwargs.pop("world")
    imported_s = time.perf_counter() - started
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    t0 = time.perf_counter()
    result = search(config, world, **kwargs)
    search_s = time.perf_counter() - t0
    cpu_s = sum(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime for before, after in zip(
        usage, [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]))
    priced = result.ranked + result.over_budget

    def shown(p):
        return p and dict(layout=p.layout.name(), step_s=p.step_s, peak_bytes=p.peak_bytes)

    plain = [p for p in result.ranked if getattr(p.layout, "ulysses", 1) == 1]  # what the baseline enumerates too
    print(CHILD_MARK + json.dumps(dict(
        search_s=search_s, result_seconds=result.seconds, imported_s=imported_s, search_cpu_s=cpu_s,
        arguments=sorted(kwargs), priced=len(priced), ranked=len(result.ranked), over_budget=len(result.over_budget),
        ulysses_priced=sum(getattr(p.layout, "ulysses", 1) > 1 for p in priced), refused=len(result.refused),
        dominated=result.dominated, best=shown(result.best), best_without_ulysses=shown(plain[0] if plain else None),
        shardlib=os.path.dirname(shardlib.__file__))), flush=True)
    return 0


def search_once(model: str, workers: int, checkout: str | None) -> dict:
    """One timed search in a fresh process importing shardlib from ``checkout`` (None: this one): the child's
    figures, the process's wall time (interpreter start and imports included) and other processes' CPU use."""
    wait_idle(20, 0.3)
    env = dict(os.environ, SHARDLIB_CHECKOUT=checkout or "")
    command = [sys.executable, os.path.abspath(__file__), "--search-child", model, "--search-workers", str(workers)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, t0 = machine_busy_s(), time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own_cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    lines = [line for line in done.stdout.splitlines() if line.startswith(CHILD_MARK)]
    if done.returncode or not lines:
        raise RuntimeError(f"the search of {model} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(CHILD_MARK):]) | dict(
        process_wall_s=wall_s, others_cores=max(0.0, (machine_busy_s() - busy0 - own_cpu) / wall_s))


def search_time(args) -> int:
    """``--search-time``: each side's searches in interleaved rounds, a table per model, the JSON."""
    started = time.perf_counter()
    sides = {f"this, --jobs {cores()}": (cores(), None)}
    if args.jobs is not None and args.jobs != cores():
        sides[f"this, --jobs {args.jobs}"] = (args.jobs, None)
    if args.baseline:
        base = os.path.abspath(args.baseline)
        commit = subprocess.run(["git", "-C", base, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "?"
        sides[f"baseline {commit}"] = (cores(), base)  # --jobs where its search() takes workers, as its CLI
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=root).stdout.strip()
    edited = subprocess.run(["git", "status", "--porcelain", "--", "shardlib", "kernels", "policies"],
                            capture_output=True, text=True, cwd=root).stdout.splitlines()  # measured, not committed
    print(f"timing the search of {', '.join(args.search_models)} ({SEARCH}) at {head}: sides {list(sides)}, "
          f"{args.rounds} interleaved rounds, each search in a fresh process"
          + (f"; not committed: {', '.join(edited)}" if edited else ""), flush=True)

    def one(model, side):
        def run():
            m = search_once(model, *sides[side])
            print(f"  {model:<10} {side:<22} search {m['search_s']:6.1f} s (process {m['process_wall_s']:5.1f} s, "
                  f"{m['priced']} priced, best {m['best'] and m['best']['layout']}; others "
                  f"{fmt_cores(m['others_cores'])})", flush=True)
            return m
        return run

    samples = interleaved({(model, side): one(model, side) for model in args.search_models for side in sides},
                          args.rounds)
    results, summary = [], []
    for model in args.search_models:
        runs = {side: samples[model, side] for side in sides}
        rows, sides_out = [], {}
        base_side = next((s for s in sides if s.startswith("baseline")), None)
        for side, ms in runs.items():
            search_s = [m["search_s"] for m in ms]
            med, lo, hi = median_spread(search_s)
            wall = median_spread(m["process_wall_s"] for m in ms)
            first = ms[0]
            ratio = paired_ratio([runs[base_side][i]["search_s"] for i in range(len(ms))], search_s) \
                if base_side and side != base_side else None
            rows.append([side, f"**{med:.1f}** [{lo:.1f}-{hi:.1f}]", f"{wall[0]:.1f} [{wall[1]:.1f}-{wall[2]:.1f}]",
                         f"{statistics.median(m['search_cpu_s'] for m in ms):.0f}",
                         f"{first['priced']:,} ({first['ulysses_priced']} Ulysses x ring)", first["refused"],
                         first["dominated"], f"{statistics.median(m['others_cores'] for m in ms):.2f}",
                         f"{ratio[0]:.2f}x [{ratio[1]:.2f}-{ratio[2]:.2f}]" if ratio else "-"])
            sides_out[side] = dict(workers=sides[side][0], checkout=sides[side][1] or "this", runs=ms,
                                   search_s_median=med, search_s_spread=[lo, hi], process_wall_s_median=wall[0],
                                   process_wall_s_spread=list(wall[1:]), speedup_vs_baseline=ratio)
            if len({m["priced"] for m in ms}) > 1 or len({json.dumps(m["best"]) for m in ms}) > 1:
                summary.append(f"WARNING: {model} {side}: rounds differ in layouts priced or best layout")
        print_table(f"{model}: `shardlib plan` search, world {SEARCH['world']} ({args.rounds} rounds)",
                    ["side", "search s, median [min-max]", "process s (with imports)", "CPU s", "layouts priced",
                     "refused meshes", "dominated", "others' cores", "baseline / side (paired)"], rows)
        for side, ms in runs.items():
            print(f"  {side}: best {ms[0]['best']}; best without Ulysses x ring {ms[0]['best_without_ulysses']}")
        if base_side:
            same = {json.dumps(runs[s][0]["best_without_ulysses"]) for s in runs}
            summary.append(f"{model}: the best layout outside Ulysses x ring is "
                           f"{'the same on every side' if len(same) == 1 else 'NOT the same on every side'}")
        results.append(dict(model=model, cls=SEARCH_MODELS[model][0], config=SEARCH_MODELS[model][2], sides=sides_out))
    write_json(args.out, dict(search=SEARCH, commit=head, uncommitted=edited, cores=cores(), rounds=args.rounds,
                              results=results,
                              command=" ".join(["benchmarks/plan_accuracy.py"] + sys.argv[1:])))
    print(*summary, sep="\n")
    print(f"done in {(time.perf_counter() - started) / 60:.1f} min; results in {args.out}")
    return 0


def arguments() -> argparse.Namespace:
    """The command line, its defaults resolved."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world", type=int, choices=[1, 4], help="4 gloo ranks, or 1 device (default with --device cuda)")
    p.add_argument("--models", help="default bert-256,bert-768,t5-small (4 ranks), bert-768 (one device)")
    p.add_argument("--layers", type=int, help="layers per stack (default: each model's; one device: 12)")
    p.add_argument("--rounds", type=int, help="default 3; --search-time: 5")
    p.add_argument("--steps", type=int, help="timed steps per measurement (default 3; one device 10)")
    p.add_argument("--only", metavar="WORDS", help="only the layouts whose name holds every word ('zero3 pp2')")
    p.add_argument("--reprice", metavar="JSON", help="price an earlier run's measurements again, measuring nothing")
    p.add_argument("--profile", help="a profile JSON (default: calibrate first; with --reprice, the run's own)")
    p.add_argument("--seq", type=int, default=128, help="one device: tokens per sequence")
    p.add_argument("--batches", default="8,32", help="one device: microbatch sizes")
    p.add_argument("--precisions", default="fp32,bf16,fp16", help="one device")
    p.add_argument("--checkpointing", default="off,on", choices=["off", "on", "off,on"], help="one device")
    p.add_argument("--quick", action="store_true", help="smoke run: quick calibration, bert-256 at 2 layers, its dp=4 "
                                                        "layouts, 1 round of 1 step")
    p.add_argument("--ep", action="store_true", help="expert parallelism: mixtral-256 (or --models) at dp=4 with "
                                                     "ep 1, 2, 4 and ep 4 with a static capacity of 2")
    p.add_argument("--warmup", type=int, help="4 ranks: steps before the one whose peak is measured (default 1; "
                                              "--ep: 3, DDP's steady state: the Trainer builds DDP in step 2 and "
                                              "DDP rebuilds its buckets in step 3, whose pages fill as they are "
                                              "written)")
    p.add_argument("--search-time", action="store_true",
                   help="time `shardlib plan --world 64`'s layout search of BERT-large and T5-large (each search in a "
                        "fresh process, this checkout's at --jobs = the cores), measuring no step")
    p.add_argument("--baseline", metavar="PATH", help="--search-time: also time the checkout at PATH (a `git worktree "
                                                      "add` of an earlier commit), rounds interleaved")
    p.add_argument("--jobs", type=int, metavar="J", help="--search-time: also time this checkout at --jobs J")
    p.add_argument("--search-child", help=argparse.SUPPRESS)  # one timed search (MODEL) in its own process
    p.add_argument("--search-workers", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help="results JSON (default benchmarks/results/plan_accuracy[_gpu|_ep].json; "
                                 "--search-time: docs/data/plan_search_time.json); a calibrated profile goes beside "
                                 "it (_profile.json)")
    p.add_argument("--plot", help="4 ranks: the scatter plot (default docs/img/plan_accuracy.png; --quick: none)")
    args = p.parse_args()
    args.world = args.world or (1 if args.device == "cuda" else 4)
    one = args.world == 1
    if args.device == "cuda" and not one:
        p.error("--device cuda measures one device (--world 1)")
    if args.ep and one:
        p.error("--ep measures expert parallelism on 4 ranks (--world 4)")
    if args.search_time or args.search_child:
        args.rounds = 1 if args.quick else args.rounds or 5
        args.search_models = (args.models or ",".join(SEARCH_MODELS)).split(",")
        if unknown := [m for m in args.search_models if m not in SEARCH_MODELS]:
            p.error(f"--search-time times {', '.join(SEARCH_MODELS)}, not {', '.join(unknown)}")
        args.out = args.out or ("benchmarks/results/plan_search_time_quick.json" if args.quick else
                                "docs/data/plan_search_time.json")
        return args
    args.rounds = args.rounds or 3
    if args.quick:
        args.models, args.layers, args.only, args.rounds, args.steps = "bert-256", 2, args.only or "dp4", 1, 1
    args.plot = args.plot if args.plot is not None else "" if args.quick or args.ep else "docs/img/plan_accuracy.png"
    args.models = (args.models or ("bert-768" if one else "mixtral-256" if args.ep else
                                   "bert-256,bert-768,t5-small")).split(",")
    args.layers = args.layers or (12 if one else None)
    args.steps = args.steps or (10 if one else 3)
    args.warmup = args.warmup or (3 if args.ep else 1)
    args.out = args.out or f"benchmarks/results/plan_accuracy{'_gpu' if one else '_ep' if args.ep else ''}.json"
    return args


def machine_profile(args):
    """The ``--profile``, or this machine calibrated (saved beside ``--out``)."""
    from shardlib.analysis.calibrate import calibrate
    from shardlib.analysis.profile import load_profile

    started = time.perf_counter()
    if args.profile:
        profile = load_profile(args.profile, world_size=args.world)
    else:
        print(f"calibrating this machine ({args.world} rank(s))...", flush=True)
        profile = calibrate(args.world, backend="nccl" if args.device == "cuda" else "gloo", quick=args.quick)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        profile.save(os.path.splitext(args.out)[0] + "_profile.json")
        print(f"calibrated in {time.perf_counter() - started:.0f} s", flush=True)
    print(profile.summary(), flush=True)
    return profile


def price_models(args, profile) -> dict:
    """Model name -> (its layouts, their predictions); every model priced first: the dry run refuses a process whose
    process group is up."""
    one, priced = args.world == 1, {}
    for name in args.models:
        chosen = one_device_layouts(tuple(int(b) for b in args.batches.split(",")), args.seq, tuple(
            args.precisions.split(",")), {"off": (False,), "on": (True,)}.get(args.checkpointing, (False, True))) \
            if one else [lay for lay in (EP_LAYOUTS if args.ep else layouts(name, layers=args.layers))
                         if all(word in lay.name().split() for word in (args.only or "").split())]
        t0 = time.perf_counter()
        priced[name] = chosen, price_of(name, chosen, profile, args.layers)
        print(f"{name}: {len(chosen)} layouts priced in {time.perf_counter() - t0:.1f} s", flush=True)
    return priced


def main() -> int:
    args = arguments()
    if args.search_child:
        return search_child(args.search_child, args.search_workers)
    if args.search_time:
        return search_time(args)
    one = args.world == 1
    if args.reprice:
        profile, results = reprice(args.reprice, args.profile)
        write_json(args.out, dict(profile=profile.to_dict(), results=results, repriced=args.reprice))
        if results[0]["world"] == 4 and args.plot:
            plot(results, args.plot)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("plan_accuracy: no CUDA device here (--device cpu --world 1 checks that logic); nothing measured")
        return 0
    started = time.perf_counter()
    profile = machine_profile(args)
    priced = price_models(args, profile)
    device = f"cpu, torch {torch.__version__}"
    if one:
        import shardlib

        args.torch_device, args.mesh = torch.device(args.device), shardlib.init_mesh()
        if args.device == "cuda":
            torch.cuda.set_device(0)
            device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
        print(f"device: {device}", flush=True)
    results = [measure_all(args, name, *priced[name]) for name in args.models]
    write_json(args.out, dict(profile=profile.to_dict(), device=device, world=args.world, rounds=args.rounds,
                              steps=args.steps, warmup=args.warmup, results=results))
    if not one and args.plot:
        plot(results, args.plot)
    print(f"done in {(time.perf_counter() - started) / 60:.1f} min; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
