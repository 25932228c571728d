"""The ``shardlib`` command line: a thin layer over one function per command.

``shardlib convert SRC DST --tp N [--to hf|sharded]``, ``shardlib inspect DIR``, ``shardlib verify DIR``: sharded
checkpoints (``shardlib.checkpoint``), no process group needed.

``shardlib run --nproc N script.py [args...]`` starts N ranks of ``script.py`` on this machine through torch's
elastic launcher (torchrun), which sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT for
:func:`shardlib.init_mesh`, tears every rank down when one fails and reports the failing rank with its
traceback. Multi-node: pass ``--nnodes`` / ``--node-rank`` / ``--rdzv-endpoint``; anything else before the
script goes to torchrun unchanged.

``shardlib plan SOURCE --tp N [--pp N] [--dp N] [--sp ...] [--json]``: a dry run of a layout with no ranks
(:mod:`shardlib.dryrun`).
"""

from __future__ import annotations

import argparse
import os
import sys


def run(nproc: int, script: str, script_args: list[str], nnodes: str = "1", node_rank: int = 0,
        rdzv_endpoint: str | None = None, launcher_args: list[str] | None = None) -> int:
    """Launch ``script`` on ``nproc`` local ranks; return 0 on success, 1 when any rank failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank unless told otherwise
    args = ["--nproc-per-node", str(nproc), "--nnodes", nnodes, "--max-restarts", "0"]
    if nnodes == "1" and rdzv_endpoint is None:
        args.append("--standalone")
    else:
        args += ["--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint or ""]
    args += list(launcher_args or [])
    try:
        torchrun([*args, script, *script_args])
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"shardlib run: rank {rank} of {script} failed (exit code {failure.exitcode}); all ranks stopped",
              file=sys.stderr)
        return 1
    return 0


def _progress(total_bytes: int | None, desc: str):
    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False)
    return bar, (lambda name, nbytes: bar.update(nbytes))


def convert(src: str, dst: str, tp: int, pp: int, to: str, overwrite: bool) -> int:
    """HF -> sharded, sharded -> sharded (reshard to --tp / --pp), sharded -> HF; no process group needed."""
    from pathlib import Path

    from .checkpoint import METADATA, convert as convert_checkpoint, export_hf

    bar, tick = _progress(None, f"{Path(src).name} -> {Path(dst).name}")
    try:
        if to == "hf":
            if not (Path(src) / METADATA).exists():
                raise ValueError(f"{src}: --to hf needs a shardlib checkpoint as the source")
            export_hf(src, dst, overwrite=overwrite, progress=tick)
        else:
            convert_checkpoint(src, dst, tp=tp, pp=pp, overwrite=overwrite, progress=tick)
    finally:
        bar.close()
    print(f"wrote {dst}")
    return 0


def inspect(directory: str) -> int:
    """A table of the tensors of a sharded checkpoint: shape, dtype, layout, files, bytes per rank."""
    from .checkpoint import ShardedCheckpoint, file_checksum

    ckpt = ShardedCheckpoint(directory, verify=False)
    meta = ckpt.meta
    print(f"{meta['model_class']}  tp={meta['tp']}  {len(ckpt.tensors)} tensors  {len(meta['files'])} files")
    print(f"{'tensor':<60} {'shape':>14} {'dtype':>9}  {'layout':<34} files")
    per_file: dict[str, int] = {}
    for name, t in ckpt.tensors.items():
        shape = "x".join(map(str, t["shape"]))
        lay = t["layout"]
        layout = "replicated" if lay["shard_dim"] is None or lay["num_shards"] == 1 else \
            f"dim {lay['shard_dim']} / {lay['num_shards']}" + (
                f" (padded to {lay['padded_size']})" if lay["padded_size"] != t["shape"][lay["shard_dim"]] else "")
        files = sorted({p["file"].replace(".safetensors", "") for p in t["pieces"]})
        print(f"{name:<60} {shape:>14} {t['dtype']:>9}  {layout:<34} {', '.join(files) if len(files) < 3 else files[0] + ' ... ' + files[-1]}")
    print()
    for name, info in sorted(meta["files"].items()):
        algorithm, value = file_checksum(info)
        print(f"{name:<40} {info['bytes'] / 2**20:10.2f} MiB  {algorithm} {value[:16]}")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlib", description="Shard HuggingFace models over a device mesh.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="launch a script on N ranks (gloo on CPU, NCCL on GPU)",
                           description=run.__doc__)
    p_run.add_argument("--nproc", type=int, required=True, help="ranks to start on this node")
    p_run.add_argument("--nnodes", default="1", help="number of nodes (or MIN:MAX)")
    p_run.add_argument("--node-rank", type=int, default=0)
    p_run.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous (multi-node)")
    p_run.add_argument("script", help="the Python script every rank runs")
    p_run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p_convert = sub.add_parser("convert", help=convert.__doc__, description=convert.__doc__)
    p_convert.add_argument("src", help="HF checkpoint directory (config.json + safetensors) or shardlib checkpoint")
    p_convert.add_argument("dst", help="destination directory (must not exist unless --overwrite)")
    p_convert.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the sharded output")
    p_convert.add_argument("--pp", type=int, default=1,
                           help="pipeline stages: each stage's tensors in its own files (any layout loads any file set)")
    p_convert.add_argument("--to", choices=["sharded", "hf"], default="sharded")
    p_convert.add_argument("--overwrite", action="store_true")
    p_inspect = sub.add_parser("inspect", help=inspect.__doc__, description=inspect.__doc__)
    p_inspect.add_argument("directory")
    p_verify = sub.add_parser("verify", help=verify.__doc__, description=verify.__doc__)
    p_verify.add_argument("directory")
    from .dryrun import add_plan_parser, plan_command

    add_plan_parser(sub)
    args, launcher_args = parser.parse_known_args(argv)
    if args.command != "run" and launcher_args:
        parser.error(f"unrecognized arguments: {' '.join(launcher_args)}")
    if args.command in ("convert", "inspect", "verify"):
        from .checkpoint import CheckpointError
        from .plan import PlanError

        try:
            if args.command == "convert":
                if args.tp < 1 or args.pp < 1:
                    raise ValueError(f"--tp and --pp must be >= 1, got --tp {args.tp} --pp {args.pp}")
                return convert(args.src, args.dst, args.tp, args.pp, args.to, args.overwrite)
            return inspect(args.directory) if args.command == "inspect" else verify(args.directory)
        except (CheckpointError, PlanError, ValueError, OSError) as exc:
            lines = str(exc).splitlines()
            if len(lines) > 4:
                lines = lines[:4] + [f"... and {len(lines) - 4} more"]
            message = " ".join(" ".join(lines).split())
            print(f"shardlib {args.command}: {message}", file=sys.stderr)
            return 1
    if args.command == "plan":
        return plan_command(args)
    if args.command == "run":
        if args.nproc < 1:
            parser.error(f"--nproc must be >= 1, got {args.nproc}")
        return run(args.nproc, args.script, args.script_args, args.nnodes, args.node_rank, args.rdzv_endpoint,
                   launcher_args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
