"""The ``shardlib plan`` and ``shardlib calibrate`` commands (wired into :mod:`shardlib.cli`).

``shardlib plan SOURCE --tp N [--pp N] [--dp N] [--sp ...] [--ep N]``: the dry run of one layout, then what the cost
model predicts for it (peak memory per rank, step time, with their terms; ``--zero``, ``--schedule``,
``--activation-checkpointing``, ``--profile`` refine it). ``shardlib plan SOURCE --world N [--memory 16GiB]
[--profile P] [--global-batch B] [--seq S]``: the layout search (:mod:`shardlib.analysis.search`), a ranked
table. ``--auto``: the plan inferred from the model's graph. ``--json``: for programs.

Building the parser imports no torch; each command imports what it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .calibrate import add_calibrate_parser, calibrate_command  # noqa: F401  (the CLI's calibrate command)
from .layout import parse_bytes

def add_plan_parser(sub) -> None:
    """The ``shardlib plan`` subcommand's arguments (``sub``: the CLI's subparsers)."""
    description = ("Dry run of a layout, no ranks needed: every rewrite, bytes per rank of each pipeline stage\n"
                   "(parameters, gradients, AdamW, ZeRO), stage boundaries, the collectives of one training step\n"
                   "per layer, and the predicted peak memory per rank and step time. With --world N: search every\n"
                   "layout of N ranks and rank those that fit --memory by predicted step time.\n"
                   "Exit 2 when shard() refuses the layout, 1 on bad input.")
    examples = ("examples:\n  shardlib plan ./bert-base --tp 4 --pp 2 --dp 2\n"
                "  shardlib plan t5-small/config.json --tp 2 --sp all_to_all 2 --seq 512 --json\n"
                "  shardlib plan ./llama-1b --sp ring 4 --seq 16384\n"
                "  shardlib plan ./llama-1b --sp ring 8 --ulysses 2 --seq 16384\n"
                "  shardlib plan ./mixtral --dp 4 --ep 4 --expert-capacity 1.25\n"
                "  shardlib plan ./bert-large --world 64 --memory 16GiB --profile h100.json --global-batch 512\n"
                "  shardlib plan ./bert-base --world 4 --global-batch 32 --seq 128 --packing 13.3   # packed SST-2")
    p = sub.add_parser("plan", help="dry run of a layout, or a search of every layout", description=description,
                       epilog=examples, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="model directory (with config.json) or a config.json file")
    for dim in ("tp", "pp", "dp"):
        p.add_argument(f"--{dim}", type=int, default=1, help=f"{dim} size (default 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallelism: each mixture-of-experts layer's experts split over ep of the dp ranks "
                        "(ep divides dp and every layer's expert count; default 1)")
    p.add_argument("--expert-capacity", type=float, metavar="C",
                   help="with --ep: the static-capacity exchange, C x the even load per expert (default: dropless)")
    p.add_argument("--sp", nargs="+", metavar=("MODE", "N"),
                   help="sequence parallelism: 'megatron' (on the tp group), 'all_to_all N' or 'ring N' (N ranks per "
                        "sequence)")
    p.add_argument("--ulysses", type=int, default=1, metavar="U",
                   help="with --sp ring N: Ulysses x ring, rings of N / U positions, each position U ranks exchanging "
                        "sequence for heads (U divides N, and tp x U the heads; default 1: the plain ring)")
    p.add_argument("--class", dest="cls", help="model class in transformers (default: the config's architectures[0])")
    p.add_argument("--batch", type=int, default=8, help="examples per microbatch and dp rank (default 8)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128; image models: the config's)")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per step (default 1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="parameter dtype (default float32)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage to predict (default 0)")
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"), help="pipeline schedule (default 1f1b)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each layer in backward")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="the Trainer's precision (bf16 / fp16: autocast; default fp32)")
    p.add_argument("--device-type", default=None, choices=("cpu", "cuda"),
                   help="whose autocast to count (default: the --profile's device, else cpu)")
    p.add_argument("--profile", help="machine profile JSON (shardlib calibrate; default: a nominal built-in one)")
    p.add_argument("--world", type=int, help="search every layout of this many ranks instead of one dry run")
    p.add_argument("--memory", help="with --world: the memory budget per rank (16GiB, 80GB, ...)")
    p.add_argument("--global-batch", type=int, default=32, help="with --world: sequences per step (default 32)")
    p.add_argument("--packing", type=float, metavar="MEAN_TOKENS",
                   help="with --world: the samples average this many tokens and train packed into rows of --seq "
                        "(fit(packing=SEQ)): layouts are priced on the rows packing makes, ranked by real tokens/s")
    p.add_argument("--top", type=int, default=15, help="with --world: rows of the ranked table (default 15)")
    p.add_argument("--jobs", type=int, metavar="J",
                   help="with --world: processes dry-running the layer tables, the same answer with any J (default: "
                        "one per CPU core this process may use)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--auto", action="store_true",
                   help="print the plan inferred from the model's graph, with its evidence, instead of a dry run")
    p.add_argument("--write-policy", metavar="FILE", help="with --auto: write the inferred plan as a policy module")
def _sequence_args(values: list[str] | None) -> tuple[object, int]:
    """``--sp`` as (sequence_parallel, sp size)."""
    from .metarun import PlanInputError
    from ..sharding.sequence import ALL_TO_ALL, MEGATRON, RING, SP_MODES

    if not values:
        return False, 1
    if values[0] == MEGATRON and len(values) == 1:
        return True, 1
    if values[0] in SP_MODES and len(values) == 2 and values[1].isdigit():
        return values[0], int(values[1])
    raise PlanInputError(f"--sp {' '.join(values)}: expected '--sp {MEGATRON}' (on the tp group), "
                         f"'--sp {ALL_TO_ALL} N' or '--sp {RING} N' (N ranks per sequence)")


def _planning(run) -> tuple[int, object]:
    """``(0, run())``, or the exit status of a refusal (2: a ``PlanError``) or of bad input (1), its message printed in
    one line."""
    from .metarun import PlanInputError
    from ..sharding.plan import PlanError

    try:
        return 0, run()
    except PlanError as exc:
        print(f"shardlib plan: {exc}", file=sys.stderr)
        return 2, None
    except PlanInputError as exc:
        print(f"shardlib plan: {exc}", file=sys.stderr)
        return 1, None


def plan_command(args: argparse.Namespace) -> int:
    """``shardlib plan``: print the report and its prediction, or the search (text or JSON); 2 when the layout is
    refused, 1 on bad input."""
    from .dryrun import plan

    if args.auto or args.write_policy:
        return _auto_plan_command(args)
    if args.world is not None:
        return _search_command(args)
    if args.packing is not None:
        print("shardlib plan: --packing prices the rows of packed samples in the layout search: it needs --world N",
              file=sys.stderr)
        return 1

    def dry_run():
        sequence_parallel, sp = _sequence_args(args.sp)
        if args.zero and args.dp == 1:
            raise _input_error(f"--zero {args.zero} partitions over dp: it needs --dp > 1")
        profile = _profile(args)
        report = plan(args.source, tp=args.tp, pp=args.pp, dp=args.dp, sp=sp, sequence_parallel=sequence_parallel,
                      cls=args.cls, batch=args.batch, seq=args.seq, microbatches=args.microbatches, dtype=args.dtype,
                      activation_checkpointing=args.activation_checkpointing, precision=args.precision,
                      device_type=args.device_type or profile.device, ep=args.ep,
                      expert_capacity=args.expert_capacity, ulysses=args.ulysses)
        return report, _predict(report, profile, args)

    status, found = _planning(dry_run)
    if not status:
        report, prediction = found
        if args.json:
            print(json.dumps(report.to_dict() | {"prediction": prediction.to_dict()}, indent=1))
        else:
            print(f"{report}\n\n{prediction}")
    return status


def _input_error(message: str):
    from .metarun import PlanInputError

    return PlanInputError(message)


def _profile(args):
    """The ``--profile`` (checked against the layout's world), or the built-in one."""
    from .profile import ProfileError, default_profile, load_profile

    if not args.profile:
        return default_profile()
    world = args.world or args.dp * args.pp * args.tp * _sequence_args(args.sp)[1]
    try:
        return load_profile(args.profile, world_size=world)
    except ProfileError as exc:
        raise _input_error(str(exc)) from None


def _predict(report, profile, args):
    from .costmodel import predict
    from .layout import Layout

    sp = report.mesh["sp"]
    layout = Layout(dp=args.dp, pp=args.pp, tp=args.tp, sp=sp, sequence_parallel=report.sequence_parallel,
                    zero=args.zero, microbatches=args.microbatches, schedule=args.schedule,
                    activation_checkpointing=args.activation_checkpointing, precision=args.precision,
                    batch=args.batch, seq=args.seq, ep=args.ep, expert_capacity=args.expert_capacity,
                    ulysses=report.mesh.get("ulysses", 1))
    return predict(report, profile, layout)


def _search_command(args: argparse.Namespace) -> int:
    """``shardlib plan --world N``: the ranked layouts; 1 on bad input, 3 when none fits the budget."""
    from .search import render, search

    def run():
        memory = parse_bytes(args.memory) if args.memory else None
        if args.world < 1:
            raise _input_error(f"--world must be >= 1, got {args.world}")
        if args.jobs is not None and args.jobs < 1:
            raise _input_error(f"--jobs must be >= 1, got {args.jobs}")
        if args.ep != 1 or args.expert_capacity is not None or args.ulysses != 1:
            raise _input_error("--ep, --expert-capacity and --ulysses price one layout; with --world the search "
                               "enumerates ep (dropless) and Ulysses x ring itself")
        return search(args.source, args.world, memory_bytes=memory, profile=_profile(args),
                      global_batch=args.global_batch, seq=args.seq, cls=args.cls, precision=args.precision,
                      mean_tokens=args.packing, ulysses=True, workers=args.jobs or _cores())

    try:
        status, result = _planning(run)
    except ValueError as exc:
        print(f"shardlib plan: {exc}", file=sys.stderr)
        return 1
    if status:
        return status
    print(json.dumps(result.to_dict(), indent=1) if args.json else render(result, args.top))
    return 0 if result.ranked else 3


def _cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _auto_plan_command(args: argparse.Namespace) -> int:
    """``shardlib plan --auto``: the inferred plan and its evidence; ``--write-policy``: as a policy module."""
    from pathlib import Path

    from .metarun import meta_model
    from ..sharding.inference import infer
    from ..sharding.inference.policy_source import policy_source

    status, model = _planning(lambda: meta_model(args.source, cls=args.cls))
    status, inferred = _planning(lambda: infer(model)) if not status else (status, None)
    if status:
        return status
    print(inferred.describe())
    if args.write_policy:
        Path(args.write_policy).write_text(policy_source(inferred, type(model)))
        print(f"policy module written to {args.write_policy}")
    return 0


