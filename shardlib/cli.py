"""The ``shardlib`` command line: a thin layer over one function per command.

``shardlib run --nproc N script.py [args...]`` starts N ranks of ``script.py`` on this machine through torch's
elastic launcher (torchrun), which sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT for
:func:`shardlib.init_mesh`, tears every rank down when one fails and reports the failing rank with its
traceback. Multi-node: pass ``--nnodes`` / ``--node-rank`` / ``--rdzv-endpoint``; anything else before the
script goes to torchrun unchanged.
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
    args, launcher_args = parser.parse_known_args(argv)
    if args.command == "run":
        if args.nproc < 1:
            parser.error(f"--nproc must be >= 1, got {args.nproc}")
        return run(args.nproc, args.script, args.script_args, args.nnodes, args.node_rank, args.rdzv_endpoint,
                   launcher_args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
