"""How long an inferred tensor-parallel plan takes: the inference (``infer``) and its verification at tp=2, on CPU.

What is measured
----------------
1. Cold inference per family: the first model class of each entry of ``tests/inference_cases.py``'s ``FAMILIES``,
   built from its small config (float32). One call: ``shardlib.sharding.inference._CACHE.clear()``, then
   ``infer(model)`` (a 2-layer analysis twin of the class, exported with ``torch.export``, read into a plan), timed
   with ``perf_counter`` after a ``gc.collect()``. One untimed warm-up call per model (the process' one-time costs),
   then ``--rounds`` rounds, each calling every model once in ABBA order (``_harness.interleaved``): drift spreads
   evenly. Median (min-max).
2. Verification at tp=2: two spawned gloo ranks on loopback (``_harness.spawn_ranks``, one torch thread each,
   ``shardlib.init_mesh(tp=2)``). One call builds the model, clears ``_CACHE`` and runs
   ``shardlib.shard(model, mesh, policy="auto")``, which infers the plan and then proves it on a float64 twin over the
   tp group; the time is ``shardlib.report(model).verified_s`` (verification only), the slower rank's. Warm-up
   round, then ``--rounds`` interleaved rounds, as in 1. The wall time of the whole ``shard()`` call goes to the JSON.
3. The pipeline-cut proof, in the rounds of 1: ``verify_cuts(model, plan)`` (the verification twin cut into one
   stage per layer, run stage after stage in this process, against the uncut twin); its own time (the inference it
   needs is cached or untimed). ALBERT's is a refusal (nested, shared layer stacks).
4. Size independence, in the rounds of 1: cold ``infer`` on a BERT-large-sized ``BertForMaskedLM`` and a
   T5-large-sized ``T5ForConditionalGeneration`` built on the meta device, next to the same classes at 2 layers and
   width 16: inference works on the twin, so its time should not follow the model's size (both classes have hand
   policies; ``infer`` ignores them, as ``policy="auto"`` does).

One torch thread everywhere (``OMP_NUM_THREADS=1``); the cores other processes kept busy are reported.

How to run
----------
    .venv/bin/python benchmarks/inference_time.py            # all families, 5 rounds (~4 minutes on 2 cores)
    .venv/bin/python benchmarks/inference_time.py --quick    # 4 families, 3 rounds (smoke run, < 1 minute)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _harness import (  # noqa: E402
    interleaved, loopback_ifname, machine_busy_s, median_spread, print_closing, print_table, spawn_ranks, wait_idle,
    write_json,
)
from inference_cases import FAMILIES, make_model  # noqa: E402

QUICK = ("roberta", "bart", "llama", "deit")  # encoder, encoder-decoder, decoder (GQA, rotary), vision
BERT, T5 = ("BertConfig", "BertForMaskedLM"), ("T5Config", "T5ForConditionalGeneration")
#: name -> (config class, config kwargs, model class); built on the meta device
SIZED = {
    "bert-large": (BERT[0], dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                 intermediate_size=4096), BERT[1]),
    "bert-tiny": (BERT[0], dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32),
                  BERT[1]),
    "t5-large": (T5[0], dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16, d_kv=64), T5[1]),
    "t5-tiny": (T5[0], dict(d_model=16, d_ff=32, num_layers=2, num_heads=4, d_kv=4), T5[1]),
}


def _others_busy(fn):
    """``fn()`` and the cores other processes kept busy meanwhile (the machine's busy time less this process' and
    its reaped children's CPU time, per wall second)."""
    b0, c0, t0 = machine_busy_s(), sum(os.times()[:4]), time.perf_counter()
    result = fn()
    return result, max(0.0, machine_busy_s() - b0 - (sum(os.times()[:4]) - c0)) / (time.perf_counter() - t0)


def _warm_then_rounds(calls: dict, rounds: int) -> tuple[dict, dict, dict]:
    """One untimed call of each (failures dropped, with why), then ``rounds`` interleaved rounds:
    (samples per name, warm-up value per name, errors per name)."""
    first, errors = {}, {}
    for name, fn in calls.items():
        try:
            first[name] = fn()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            errors[name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    return interleaved({n: fn for n, fn in calls.items() if n not in errors}, rounds), first, errors


def _cold_infer(model) -> float:
    from shardlib.sharding import inference

    inference._CACHE.clear()
    gc.collect()  # not inside the timing (as in _harness.timed)
    start = time.perf_counter()
    inference.infer(model)
    return time.perf_counter() - start


def _cut_proof(model) -> float:
    from shardlib.sharding.inference import infer
    from shardlib.sharding.inference.cuts import verify_cuts

    plan = infer(model).plan  # cached, or inferred here outside the timing
    gc.collect()
    return verify_cuts(model, plan)


def _verify_worker(rank: int, world: int, port: int, families: list[str], rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    import shardlib
    from shardlib.sharding import inference

    mesh = shardlib.init_mesh(tp=world)

    def once(family: str) -> tuple[float, float]:
        model = make_model(FAMILIES[family][2][0], family, torch.float32)
        inference._CACHE.clear()
        gc.collect()
        dist.barrier()
        start = time.perf_counter()
        shardlib.shard(model, mesh, policy="auto")
        return shardlib.report(model).verified_s, time.perf_counter() - start

    samples, _, errors = _warm_then_rounds({f: (lambda f=f: once(f)) for f in families}, rounds)
    gathered = [None] * world
    dist.all_gather_object(gathered, samples)
    if rank == 0:  # per round, the slower rank
        res = {f: {"verify_s": [max(r[f][i][0] for r in gathered) for i in range(rounds)],
                   "shard_s": [max(r[f][i][1] for r in gathered) for i in range(rounds)]} for f in samples}
        Path(out).write_text(json.dumps({"results": res, "errors": errors}))
    dist.destroy_process_group()


def _cell(values) -> str:
    return "{:.3f} ({:.3f}-{:.3f})".format(*median_spread(values))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"smoke run: {', '.join(QUICK)}; 3 rounds")
    p.add_argument("--rounds", type=int, default=None, help="timed interleaved rounds (default 5; --quick 3)")
    p.add_argument("--families", default=None, help="comma-separated FAMILIES keys (default all; --quick 4)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results (default benchmarks/results/inference_time[_quick].json)")
    p.add_argument("--wait-idle", type=float, default=60.0, help="wait up to this long for an idle machine first")
    args = p.parse_args(argv)
    families = args.families.split(",") if args.families else list(QUICK if args.quick else FAMILIES)
    if unknown := [f for f in families if f not in FAMILIES]:
        p.error(f"unknown families {unknown}; from: {', '.join(FAMILIES)}")
    rounds = args.rounds or (3 if args.quick else 5)
    out = args.out or ROOT / "benchmarks" / "results" / f"inference_time{'_quick' if args.quick else ''}.json"
    started = time.perf_counter()
    warnings: list[str] = []
    torch.set_num_threads(1)
    if args.wait_idle > 0 and (busy := wait_idle(args.wait_idle, 0.2)) > 0.2:
        warnings.append(f"the machine was busy at the start ({busy:.2f} cores used by others): timings suffer")

    # ---- 1 + 3: cold inference, in this process
    import transformers

    models = {f: make_model(FAMILIES[f][2][0], f, torch.float32) for f in families}
    params = {}
    for name, (config_cls, kwargs, cls) in SIZED.items():
        with torch.device("meta"):
            models[name] = getattr(transformers, cls)(getattr(transformers, config_cls)(**kwargs))
        params[name] = sum(p.numel() for p in models[name].parameters())
    t0 = time.perf_counter()
    calls = {n: (lambda m=m: _cold_infer(m)) for n, m in models.items()}
    calls |= {f"{f} cuts": (lambda m=models[f]: _cut_proof(m)) for f in families}
    (infer_s, infer_first, errors), busy_infer = _others_busy(lambda: _warm_then_rounds(calls, rounds))
    print(f"inference: {len(models)} models x {rounds} rounds in {time.perf_counter() - t0:.0f} s", flush=True)

    # ---- 2: verification at tp=2, in two spawned ranks
    t0 = time.perf_counter()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
    with tempfile.TemporaryDirectory(prefix="inference_time_") as tmp:
        res_path = Path(tmp) / "verify.json"
        failure, busy_verify = _others_busy(lambda: spawn_ranks(
            _verify_worker, 2, (families, rounds, str(res_path)), deadline_s=120 + 30 * len(families) * (rounds + 1)))
        verify = json.loads(res_path.read_text()) if res_path.exists() else {"results": {}, "errors": {}}
    warnings += [f"verification ranks: {failure}"] if failure else []
    print(f"verification: {len(families)} families x {rounds} rounds in {time.perf_counter() - t0:.0f} s", flush=True)

    # ---- report
    def infer_cell(name):
        return _cell(infer_s[name]) if name in infer_s else f"failed: {errors.get(name, '?')}"

    rows = [[f, FAMILIES[f][2][0], infer_cell(f), _cell(verify["results"][f]["verify_s"])
             if f in verify["results"] else f"failed: {verify['errors'].get(f, failure or '?')}",
             _cell(infer_s[f"{f} cuts"]) if f"{f} cuts" in infer_s else "refused (see the warnings)"]
            for f in families]
    rows += [[name, f"{cls} ({params[name] / 1e6:,.1f} M params, meta)", infer_cell(name), "n/a (meta)", "n/a"]
             for name, (_, _, cls) in SIZED.items()]
    print_table(f"Plan inference and verification time: {rounds} rounds after a warm-up, 1 torch thread, "
                f"{os.cpu_count()} CPU cores, verification at tp=2 (2 gloo ranks)",
                ["family", "class", "infer median s (min-max)", "verify tp=2 median s (min-max)",
                 "cut proof median s (min-max)"], rows)

    summary = []
    for what, meds in (("infer", [median_spread(infer_s[f])[0] for f in families if f in infer_s]),
                       ("verify at tp=2", [median_spread(v["verify_s"])[0] for v in verify["results"].values()]),
                       ("pipeline-cut proof", [median_spread(infer_s[f"{f} cuts"])[0] for f in families
                                               if f"{f} cuts" in infer_s])):
        if meds:
            summary.append(f"{what}, median over {len(meds)} families: {median_spread(meds)[0]:.3f} s "
                           f"(family medians {min(meds):.3f}-{max(meds):.3f} s)")
    for big, tiny in (("bert-large", "bert-tiny"), ("t5-large", "t5-tiny")):
        if big in infer_s and tiny in infer_s:
            b, t = median_spread(infer_s[big])[0], median_spread(infer_s[tiny])[0]
            summary.append(f"{big} ({params[big] / 1e6:,.0f} M params) vs {tiny} ({params[tiny] / 1e6:,.2f} M): "
                           f"infer {b:.3f} s vs {t:.3f} s ({b / t:.2f}x)")
    summary.append(f"other processes kept {busy_infer:.2f} cores busy during the inference timings, "
                   f"{busy_verify:.2f} during the verification (of {os.cpu_count()})")
    warnings += [f"other processes were busy during the {what} ({b:.2f} cores): its timings suffer"
                 for what, b in (("inference", busy_infer), ("verification", busy_verify)) if b > 0.2]
    warnings += [f"{n}: {'refused' if n.endswith(' cuts') else 'inference failed'}: {e}" for n, e in errors.items()]
    warnings += [f"{n}: verification failed: {e}" for n, e in verify["errors"].items()]
    write_json(out, dict(
        args=vars(args), families=families, rounds=rounds, torch=torch.__version__,
        transformers=transformers.__version__, cpus=os.cpu_count(), threads=1, others_busy_cores=dict(
            infer=busy_infer, verify=busy_verify), summary=summary, warnings=warnings,
        infer={n: dict(cls=FAMILIES[n][2][0] if n in FAMILIES else SIZED[n][2], params=params.get(n),
                       seconds=infer_s.get(n), warmup_s=infer_first.get(n), error=errors.get(n)) for n in models},
        cuts={f: dict(seconds=infer_s.get(f"{f} cuts"), error=errors.get(f"{f} cuts")) for f in families},
        verify=verify))
    summary.append(f"results: {out}")
    print_closing(summary, warnings, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
