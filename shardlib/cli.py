"""The ``shardlib`` command line: a thin layer over one function per command.

``shardlib convert SRC DST --tp N [--to hf|sharded]``, ``shardlib inspect DIR``, ``shardlib verify DIR``: sharded
checkpoints (``shardlib.checkpoint``), no process group needed.

``shardlib run --nproc N script.py [args...]`` starts N ranks of ``script.py`` on this machine through torch's
elastic launcher (torchrun), which sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT for
:func:`shardlib.init_mesh`, tears every rank down when one fails and reports the failing rank with its
traceback (:mod:`shardlib.train.launch`). On one node the rendezvous store listens on 127.0.0.1 only. Multi-node: pass
``--nnodes`` / ``--node-rank`` / ``--rdzv-endpoint``; anything else before the script goes to torchrun unchanged.

``shardlib plan SOURCE --tp N [--pp N] [--dp N] [--sp ...] [--json]``: a dry run of a layout with no ranks and its
predicted peak memory and step time; ``--world N --memory M``: the layout search; ``--auto [--write-policy FILE]``:
the plan inferred from the model's graph, with its evidence. ``shardlib calibrate``: measure this machine's profile
for the cost model (:mod:`shardlib.analysis.commands`, docs/planning.md).

``shardlib plot RUN [-o OUT]``: the loss curve of a ``fit`` log and, for a mixture of experts, its auxiliary losses
and each MoE layer's load beside it (:mod:`shardlib.train.plots`, matplotlib).

``shardlib --version``: the installed version.

Building the parser imports neither torch nor transformers (``--help`` and ``--version`` answer at once); each
command imports what it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
from pathlib import Path


def version() -> str:
    """The installed distribution's version, or the package's own when it runs from a source tree."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as distribution_version

    try:
        return distribution_version("shardlib")
    except PackageNotFoundError:
        from . import __version__

        return __version__


# ------------------------------------------------------------------------------------------------ convert
def _source_bytes(src: Path) -> int:
    """The tensor bytes of a shardlib (``shardlib.json``) or HF (safetensors headers) checkpoint: the total
    that ``convert`` reports progress against. Reads metadata and headers only."""
    from .checkpoint import METADATA, ShardedCheckpoint
    from .checkpoint.format import OPTIMIZER_PREFIX
    from .safetensors_io import SafetensorsFiles

    if (src / METADATA).exists():
        reader = ShardedCheckpoint(src, verify=False)
        keys = [k for k in reader.tensors if not k.startswith(OPTIMIZER_PREFIX)]  # convert copies no optimizer state
    else:
        reader = SafetensorsFiles(src)
        keys = list(reader.weight_map)
    with reader:
        return sum(math.prod(reader.shape(k)) * reader.dtype(k).itemsize for k in keys)


@contextlib.contextmanager
def _progress(total_bytes: int | None, desc: str, show: bool):
    """A ``progress(name, nbytes)`` callback drawing a tqdm bar on stderr (rate, and with ``total_bytes`` the
    percentage and the time left), or None when not ``show``."""
    if not show:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
              dynamic_ncols=True) as bar:
        yield lambda name, nbytes: bar.update(nbytes)


def convert(src: str, dst: str, tp: int, pp: int, to: str, overwrite: bool, progress: bool | None = None) -> int:
    """HF -> sharded, sharded -> sharded (reshard to --tp / --pp), sharded -> HF; no process group needed.
    ``progress``: draw a progress bar on stderr (None: when stderr is a terminal)."""
    from .checkpoint import METADATA
    from .checkpoint import convert as convert_checkpoint
    from .checkpoint import export_hf

    show = sys.stderr.isatty() if progress is None else progress
    total = _source_bytes(Path(src)) if show else None  # known up front: the bar shows a percentage and an ETA
    with _progress(total, f"{Path(src).name} -> {Path(dst).name}", show) as tick:
        if to == "hf":
            if (tp, pp) != (1, 1):
                raise ValueError(f"--tp {tp} --pp {pp}: an HF checkpoint is unsharded (--tp / --pp set the layout of "
                                 "--to sharded); drop them, or convert to sharded")
            if not (Path(src) / METADATA).exists():
                raise ValueError(f"{src}: --to hf needs a shardlib checkpoint as the source")
            export_hf(src, dst, overwrite=overwrite, progress=tick)
        else:
            convert_checkpoint(src, dst, tp=tp, pp=pp, overwrite=overwrite, progress=tick)
    print(f"wrote {dst}")
    return 0


# ------------------------------------------------------------------------------------------------ inspect
# the data files of the sharded format (docs/checkpoint-format.md): whose rank's tensors each holds
MODEL_FILE = re.compile(r"model(?:-pp(?P<pp>\d+))?-(?:tp(?P<tp>\d+)-of-\d+|replicated)(?:-dp(?P<dp>\d+))?"
                        r"\.safetensors")


def data_bytes_by_file(ckpt) -> dict[str, int]:
    """Tensor bytes each file of a :class:`~shardlib.checkpoint.ShardedCheckpoint` holds, from its pieces (rows
    ``[start, stop)`` of ``dim``) and the tensors' shapes and dtypes."""
    from .checkpoint.format import piece_shape

    out: dict[str, int] = {}
    for name, t in ckpt.tensors.items():
        itemsize = ckpt.dtype(name).itemsize
        for p in t["pieces"]:
            nbytes = math.prod(piece_shape(t["shape"], p["dim"], p["start"], p["stop"], p.get("blocks", 1))) * itemsize
            out[p["file"]] = out.get(p["file"], 0) + nbytes
    return out


def bytes_by_rank(tp: int, per_file: dict[str, int]) -> dict[tuple[int | None, int, int | None], tuple[int, int]]:
    """(pipeline stage or None, tp rank, dp rank or None) -> (sharded bytes, replicated bytes) each rank of the
    writing layout stores: its tp rank's file and the replicated file of its stage (and, for an optimizer
    partitioned over dp, its dp rank's files). A tensor that several stages use (tied embeddings) counts once, in
    the stage that stores it."""
    files = {name: m.groupdict() for name in per_file if (m := MODEL_FILE.fullmatch(name))}
    stages = sorted({int(f["pp"]) for f in files.values() if f["pp"] is not None}) or [None]
    dps = sorted({int(f["dp"]) for f in files.values() if f["dp"] is not None}) or [None]
    out = {}
    for stage in stages:
        for dp in dps:
            for rank in range(tp):
                held = [(name, f) for name, f in files.items()
                        if all(f[k] is None or int(f[k]) == v for k, v in (("pp", stage), ("tp", rank), ("dp", dp)))]
                out[stage, rank, dp] = (sum(per_file[n] for n, f in held if f["tp"] is not None),
                                        sum(per_file[n] for n, f in held if f["tp"] is None))
    return out


def inspect(directory: str) -> int:
    """The tensors of a sharded checkpoint (shape, dtype, layout, files), the bytes each rank stores, and its
    files (size, tensor bytes, checksum)."""
    from .analysis.dryrun_report import size_text
    from .checkpoint import ShardedCheckpoint
    from .safetensors_io import file_checksum

    ckpt = ShardedCheckpoint(directory, verify=False)
    meta = ckpt.meta
    per_file = data_bytes_by_file(ckpt)
    pp = f"  pp={meta['pp']}" if "pp" in meta else ""
    print(f"{meta['model_class']}  tp={meta['tp']}{pp}  {len(ckpt.tensors)} tensors  {len(meta['files'])} files  "
          f"{size_text(sum(per_file.values()))} of tensors")
    print(f"{'tensor':<60} {'shape':>14} {'dtype':>9}  {'layout':<34} files")
    for name, t in ckpt.tensors.items():
        shape = "x".join(map(str, t["shape"]))
        lay = t["layout"]
        layout = "carried (not a model tensor)" if t.get("carried") else \
            "replicated" if lay["shard_dim"] is None or lay["num_shards"] == 1 else \
            f"dim {lay['shard_dim']} / {lay['num_shards']}" + (
                f" in {lay['blocks']} blocks" if lay.get("blocks", 1) > 1 else "") + (
                f" (padded to {lay['padded_size']})" if lay["padded_size"] != t["shape"][lay["shard_dim"]] else "")
        files = sorted({p["file"].replace(".safetensors", "") for p in t["pieces"]})
        print(f"{name:<60} {shape:>14} {t['dtype']:>9}  {layout:<34} {', '.join(files) if len(files) < 3 else files[0] + ' ... ' + files[-1]}")
    of_stage = " of its pipeline stage" if "pp" in meta else ""
    print(f"\nbytes per rank (the tensors in its tp rank's file and in the replicated file{of_stage}):")
    print(f"  {'rank':<16} {'sharded':>12} {'replicated':>12} {'total':>12}")
    for (stage, rank, dp), (sharded, replicated) in bytes_by_rank(meta["tp"], per_file).items():
        label = " ".join(f"{dim}={i}" for dim, i in (("pp", stage), ("tp", rank), ("dp", dp)) if i is not None)
        sizes = (size_text(n) for n in (sharded, replicated, sharded + replicated))
        print(f"  {label:<16} " + " ".join(f"{n:>12}" for n in sizes))
    print(f"\n{'file':<44} {'bytes':>12} {'tensors':>12}  checksum")
    for name, info in sorted(meta["files"].items()):
        algorithm, value = file_checksum(info)
        tensors = size_text(per_file[name]) if name in per_file else "-"
        print(f"{name:<44} {size_text(info['bytes']):>12} {tensors:>12}  {algorithm} {value[:16]}")
    return 0


def verify(directory: str) -> int:
    """Completeness and checksums of a sharded checkpoint; exit 1 on any problem."""
    from .checkpoint import ShardedCheckpoint

    problems = ShardedCheckpoint(directory).problems()
    for problem in problems:
        print(f"shardlib verify: {problem}", file=sys.stderr)
    if not problems:
        print(f"{directory}: OK")
    return 1 if problems else 0


def plot(run: str, out: str | None) -> int:
    """Draw a fit log (:func:`shardlib.train.plots.plot_log`); one line on stderr and exit 1 when it cannot."""
    from .train.plots import plot_log

    try:
        print(f"wrote {plot_log(run, out)}")
    except (OSError, ValueError, ImportError) as exc:
        print(f"shardlib plot: {exc}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------------- main
RUN_HELP = """\
Start N ranks of SCRIPT on this node through torch's elastic launcher (torchrun), which sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT for shardlib.init_mesh. When a rank fails, every rank is stopped and the
failing one is named (exit status 1), or, with --max-restarts N, every rank is started again (up to N times) and
fit resumes from its newest complete checkpoint. Options not listed here go to torchrun unchanged; all of them come
before SCRIPT.

One node: the rendezvous store and gloo listen on 127.0.0.1 only. Several nodes (--nnodes, --node-rank,
--rdzv-endpoint): torch's c10d store has no authentication, anyone reaching its port can join or corrupt the job;
run on a trusted network and firewall the port (docs/cli.md, "Network exposure")."""
CONVERT_HELP = """\
Convert a checkpoint, no process group needed: HF -> sharded, sharded -> sharded (reshard to --tp / --pp), or
sharded -> HF (--to hf). Written atomically. Progress (bytes, rate, time left) on stderr when it is a terminal,
or with --progress."""
INSPECT_HELP = """\
Print a sharded checkpoint's tensors (shape, dtype, layout, files), the bytes each rank stores (per tp rank, and
per pipeline stage and dp rank where the checkpoint has them), and its files (size, tensor bytes, checksum)."""
PLOT_HELP = """\
Draw a fit log (save_dir/log.jsonl): the training loss (with the main loss and the eval loss where logged) and,
beside it for a mixture-of-experts model, the auxiliary router losses and each MoE layer's imbalance (max / mean
tokens per expert) and dropped share over the steps. Needs matplotlib (pip install "shardlib[plot]")."""
VERIFY_HELP = """\
Check that every file shardlib.json names exists with the recorded size and checksum. Prints "DIR: OK" (exit
status 0) or one line per problem (exit status 1)."""


def _examples(*lines: str) -> str:
    return "example" + ("s" if len(lines) > 1 else "") + ":\n" + "\n".join(f"  {line}" for line in lines)


def _subcommand(sub, name: str, help: str, description: str, *examples: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description, epilog=_examples(*examples),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    """The ``shardlib`` argument parser: every subcommand, every option with its help and examples."""
    parser = argparse.ArgumentParser(
        prog="shardlib", description="Shard HuggingFace models over a device mesh.",
        epilog=_examples("shardlib run --nproc 4 train.py --tp 2", "shardlib convert ./bert-hf ./bert-tp4 --tp 4",
                         "shardlib plan ./bert-hf --tp 4 --pp 2"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"shardlib {version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _subcommand(sub, "run", "launch a script on N ranks (gloo on CPU, NCCL on GPU)", RUN_HELP,
                    "shardlib run --nproc 4 examples/bert_tp_demo.py --sp 2",
                    "shardlib run --nproc 8 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 train.py  "
                    "# trusted network only")
    p.add_argument("--nproc", type=int, required=True, help="ranks to start on this node")
    p.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank among the nodes (default 0)")
    p.add_argument("--rdzv-endpoint", default=None,
                   help="host:port of the multi-node rendezvous store (unauthenticated: a trusted network only); "
                        "without it the run is single-node, on loopback")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart every rank this many times after a failure (default 0); the script's fit resumes "
                        "from its newest complete checkpoint (docs/training.md, \"Failures\")")
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    p = _subcommand(sub, "convert", "convert or reshard a checkpoint (HF <-> sharded)", CONVERT_HELP,
                    "shardlib convert ./bert-hf ./bert-tp4 --tp 4", "shardlib convert ./bert-tp4 ./bert-tp2x2 "
                    "--tp 2 --pp 2", "shardlib convert ./bert-tp4 ./bert-hf-again --to hf")
    p.add_argument("src", help="HF checkpoint directory (config.json + safetensors) or shardlib checkpoint")
    p.add_argument("dst", help="destination directory (must not exist unless --overwrite)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the sharded output (default 1)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages: each stage's tensors in its own files (any layout loads any file set)")
    p.add_argument("--to", choices=["sharded", "hf"], default="sharded",
                   help="output format: shardlib's sharded format (default) or a plain HF checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination (atomically)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr with bytes, rate and time left (default: when stderr is a terminal)")

    p = _subcommand(sub, "inspect", "tensors, layouts and bytes per rank of a sharded checkpoint", INSPECT_HELP,
                    "shardlib inspect ./bert-tp4")
    p.add_argument("directory", help="a shardlib checkpoint directory (with shardlib.json)")

    p = _subcommand(sub, "verify", "check a sharded checkpoint's files: complete, sizes, checksums", VERIFY_HELP,
                    "shardlib verify ./bert-tp4 && echo intact")
    p.add_argument("directory", help="a shardlib checkpoint directory (with shardlib.json)")

    p = _subcommand(sub, "plot", "draw a fit log: the loss curve and each MoE layer's load", PLOT_HELP,
                    "shardlib plot run/  # run/log.jsonl -> run/log.png", "shardlib plot run/log.jsonl -o loss.svg")
    p.add_argument("run", help="a fit save_dir or its log.jsonl")
    p.add_argument("-o", "--out", default=None, help="the picture (default: the log's path with .png; the format "
                                                    "follows the suffix: png, svg, pdf)")

    from .analysis.commands import add_calibrate_parser, add_plan_parser

    add_plan_parser(sub)
    add_calibrate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, launcher_args = parser.parse_known_args(argv)
    if args.command != "run" and launcher_args:
        parser.error(f"unrecognized arguments: {' '.join(launcher_args)}")
    if args.command in ("convert", "inspect", "verify"):
        from .checkpoint import CheckpointError
        from .sharding.plan import PlanError

        try:
            if args.command == "convert":
                if args.tp < 1 or args.pp < 1:
                    raise ValueError(f"--tp and --pp must be >= 1, got --tp {args.tp} --pp {args.pp}")
                return convert(args.src, args.dst, args.tp, args.pp, args.to, args.overwrite, args.progress)
            return inspect(args.directory) if args.command == "inspect" else verify(args.directory)
        except (CheckpointError, PlanError, ValueError, OSError) as exc:
            lines = str(exc).splitlines()
            if len(lines) > 4:
                lines = lines[:4] + [f"... and {len(lines) - 4} more"]
            message = " ".join(" ".join(lines).split())
            print(f"shardlib {args.command}: {message}", file=sys.stderr)
            return 1
    if args.command == "plot":
        return plot(args.run, args.out)
    if args.command in ("plan", "calibrate"):
        from .analysis.commands import calibrate_command, plan_command

        return (plan_command if args.command == "plan" else calibrate_command)(args)
    if args.command == "run":
        if args.nproc < 1:
            parser.error(f"--nproc must be >= 1, got {args.nproc}")
        from .train.launch import run

        if args.max_restarts < 0:
            parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
        return run(args.nproc, args.script, args.script_args, args.nnodes, args.node_rank, args.rdzv_endpoint,
                   launcher_args, max_restarts=args.max_restarts)
    return 2


if __name__ == "__main__":
    sys.exit(main())
