"""``--layout auto``: the layout search (:mod:`shardlib.analysis.search`) picks the mesh (expert parallelism's ep
included, for a model with mixture-of-experts layers), ZeRO stage, microbatches, schedule and activation
checkpointing of a run, under ``--memory`` per rank, and the arguments take them.

:func:`shardlib.train.parse_args` calls :func:`choose_layout` once: in the process that starts the ranks
(``--nproc``), whose ranks then get the choice as explicit flags (:func:`explicit_flags`), so they do not search
again; under torchrun / ``shardlib run`` in every rank, which all reach the same choice (the search is
deterministic arithmetic on the dry run's counts) and rank 0 prints it.
"""

from __future__ import annotations

import os

from ..analysis.layout import Layout, parse_bytes

#: the TrainingArguments fields the choice sets (the global batch size stays the user's)
CHOSEN = ("dp", "pp", "tp", "sp", "sequence_parallel", "zero", "microbatches", "schedule", "activation_checkpointing",
          "ep")


def check_auto(args) -> None:
    """``--layout auto`` needs ``--memory``; ``--memory`` and ``--profile`` only mean something with it."""
    if args.layout not in (None, "auto"):
        raise ValueError(f"--layout must be 'auto' (or left out), got {args.layout!r}")
    if args.layout == "auto" and not args.memory:
        raise ValueError("--layout auto needs --memory: the memory per rank the layout must fit (16GiB, 80GB, ...)")
    if args.layout != "auto" and (args.memory or args.profile):
        raise ValueError("--memory and --profile are for --layout auto")
    if args.memory:
        parse_bytes(args.memory)


def choose_layout(args, model, world: int, seq: int):
    """Search every layout of ``model`` (a model, config or model directory) on ``world`` ranks for the global
    batch ``args.batch_size``; set the fastest that fits ``args.memory`` on ``args``. Returns its
    :class:`~shardlib.analysis.costmodel.Prediction` and the :class:`~shardlib.analysis.search.SearchResult`;
    ValueError (what is smallest, and what dominates it) when none fits."""
    from ..analysis.metarun import PlanInputError
    from ..analysis.profile import ProfileError, load_profile
    from ..analysis.search import no_fit_message, search

    if model is None:
        raise ValueError("--layout auto needs the model to search layouts for: parse_args(..., model=config_or_path)")
    try:
        profile = load_profile(args.profile, world_size=world) if args.profile else None
        result = search(model, world, memory_bytes=parse_bytes(args.memory), profile=profile,
                        global_batch=args.batch_size, seq=seq, precision=args.precision)
    except (PlanInputError, ProfileError) as exc:
        raise ValueError(f"--layout auto: {exc}") from None
    if result.best is None:
        raise ValueError(f"--layout auto: {no_fit_message(result)}")
    for name, value in result.best.layout.training_args().items():
        if name in CHOSEN:
            setattr(args, name, value)
    return result.best, result


def explain(best, result) -> str:
    """What ``--layout auto`` chose and why, in two lines."""
    from ..analysis.dryrun_report import size_text

    p = best
    return (f"--layout auto chose {p.layout.name()}: predicted peak {size_text(p.peak_bytes)} per rank (budget "
            f"{size_text(result.memory_bytes)}), {p.step_s:.3g} s per step, bottleneck {p.bottleneck}\n"
            f"  the fastest of {len(result.ranked)} layouts that fit ({len(result.over_budget)} over budget, "
            f"profile: {result.profile}); `shardlib plan MODEL --world {result.world} --memory ...` lists them")


def explicit_flags(layout: Layout) -> list[str]:
    """The command-line flags that set ``layout`` (what the launched ranks get instead of ``--layout auto``)."""
    flags = []
    for name, value in layout.training_args().items():
        if name in CHOSEN and value is not None:
            flags += [f"--{name}", str(value)]
    return flags


def without_auto(argv: list[str]) -> list[str]:
    """``argv`` less ``--layout auto``, ``--memory X`` and ``--profile X`` (either spelling, ``=`` or not)."""
    out, skip = [], False
    names = {"--layout", "--memory", "--profile"}
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif arg.split("=", 1)[0] not in names:
            out.append(arg)
    return out


def world_size(args) -> int:
    """The ranks the run will have: ``--nproc`` before the launch, else the launcher's WORLD_SIZE, else 1."""
    if args.nproc is not None and "WORLD_SIZE" not in os.environ:
        return args.nproc
    return int(os.environ.get("WORLD_SIZE", "1"))
