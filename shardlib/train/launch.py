"""Starting the ranks: ``shardlib run`` and ``python train.py --nproc N`` launch a script on N local ranks (or a
node's share of a multi-node job) through torch's elastic launcher (torchrun), which sets RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT for :func:`shardlib.init_mesh`, tears every rank down when one fails and reports the
failing rank with its traceback. On one node nothing listens beyond this machine (:func:`run`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

LOOPBACK = "127.0.0.1"
LOOPBACK_RENDEZVOUS = "shardlib-loopback"  # torchrun rendezvous backend of a single-node `shardlib run`


def _loopback_store(timeout):
    """A TCPStore server listening on 127.0.0.1 only, and its port. torch's TCPStore binds its server to every
    interface whatever host it is given; handed a socket already bound to loopback (``master_listen_fd``), it
    listens on that one."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))  # port 0: the kernel picks a free one, no race with another job
        sock.listen()
        port = sock.getsockname()[1]
        store = TCPStore(LOOPBACK, port, 1, True, timeout, multi_tenant=True, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store, port


def _loopback_rendezvous(params):
    """torchrun's rendezvous handler for :data:`LOOPBACK_RENDEZVOUS`: torch's static TCP rendezvous of one node,
    its store (which the ranks use as their own: MASTER_ADDR / MASTER_PORT) on a loopback socket."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LoopbackRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return LOOPBACK_RENDEZVOUS

        def next_rendezvous(self):
            if self._store is None:
                self._store, self.master_port = _loopback_store(self.timeout)
            return super().next_rendezvous()

    if params.max_nodes != 1:
        raise ValueError(f"the {LOOPBACK_RENDEZVOUS} rendezvous is for one node, got --nnodes {params.max_nodes}")
    return LoopbackRendezvous(LOOPBACK, 0, 0, 1, params.run_id, int(params.config.get("timeout", 600)))


def _loopback_interface() -> str | None:
    """The name of the loopback network interface (Linux: the one whose flags have IFF_LOOPBACK), or None."""
    for flags in sorted(Path("/sys/class/net").glob("*/flags")):
        with contextlib.suppress(OSError, ValueError):
            if int(flags.read_text(), 16) & 0x8:
                return flags.parent.name
    return None


@contextlib.contextmanager
def _environment(defaults: dict[str, str | None]):
    """Set the environment variables of ``defaults`` the caller has not set (None: leave unset), then restore."""
    added = [k for k, v in defaults.items() if v is not None and k not in os.environ]
    os.environ.update({k: defaults[k] for k in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def run(nproc: int, script: str, script_args: list[str], nnodes: str = "1", node_rank: int = 0,
        rdzv_endpoint: str | None = None, launcher_args: list[str] | None = None) -> int:
    """Launch ``script`` on ``nproc`` local ranks; return 0 on success, 1 when any rank failed. On one node (no
    ``rdzv_endpoint``) nothing listens beyond this machine: the rendezvous store, which the ranks share as their
    MASTER_ADDR:MASTER_PORT store, is bound to 127.0.0.1, and gloo to the loopback interface (GLOO_SOCKET_IFNAME,
    unless set). Multi-node: torch's c10d rendezvous at ``rdzv_endpoint``, whose store has no authentication
    (docs/cli.md, "Network exposure")."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.run import main as torchrun

    args = ["--nproc-per-node", str(nproc), "--nnodes", nnodes, "--max-restarts", "0"]
    environment: dict[str, str | None] = {"OMP_NUM_THREADS": "1"}  # one thread per rank unless told otherwise
    if nnodes == "1" and rdzv_endpoint is None:
        rendezvous_handler_registry.register(LOOPBACK_RENDEZVOUS, _loopback_rendezvous)  # again: a no-op
        args += ["--rdzv-backend", LOOPBACK_RENDEZVOUS, "--rdzv-endpoint", f"{LOOPBACK}:0"]
        environment["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    else:
        args += ["--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint or ""]
    args += list(launcher_args or [])
    try:
        with _environment(environment):
            torchrun([*args, script, *script_args])
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"shardlib run: rank {rank} of {script} failed (exit code {failure.exitcode}); all ranks stopped",
              file=sys.stderr)
        return 1
    return 0
