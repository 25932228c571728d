"""Starting the ranks: ``shardlib run`` and ``python train.py --nproc N`` launch a script on N local ranks (or a
node's share of a multi-node job) through torch's elastic launcher (torchrun), which sets RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT for :func:`shardlib.init_mesh`, tears every rank down when one fails and reports the
failing rank with its traceback, or restarts them all (``max_restarts``; a new ranks' store per rendezvous round:
:class:`_FreshStorePerRound`). On one node nothing listens beyond this machine (:func:`run`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousHandler

LOOPBACK = "127.0.0.1"
LOOPBACK_RENDEZVOUS = "shardlib-loopback"  # torchrun rendezvous backend of a single-node `shardlib run`
ELASTIC_RENDEZVOUS = "shardlib-c10d"  # ... and of a multi-node one


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


class _FreshStorePerRound(RendezvousHandler):
    """torch's rendezvous handler ``inner``, except that every rendezvous round gets its workers a new TCPStore
    (MASTER_ADDR / MASTER_PORT), hosted by the round's rank-0 agent.

    Why: torchrun hands the workers its rendezvous store (``TORCHELASTIC_USE_AGENT_STORE``) and torch's
    ``init_process_group`` then assumes a new store per retry ("no need to add prefix for each attempt"), but the
    static and c10d handlers of torch 2.13 keep one store for every round. After a restart the new workers read the
    previous round's keys (gloo's peer addresses): measured here, the second restart of a 2-rank job failed with
    "Gloo connectFullMesh failed ... Connection refused" to a dead worker's port, or hung. The agents still use
    ``inner``'s own (round-prefixed) store among themselves; the address of a round's worker store is published
    there by the rank-0 agent. ``loopback``: the worker store listens on 127.0.0.1 only."""

    KEY = "shardlib/worker-store"

    def __init__(self, inner: RendezvousHandler, backend: str, loopback: bool, timeout_s: float):
        self.inner, self.backend, self.loopback, self.timeout_s = inner, backend, loopback, timeout_s
        self._server = None  # this round's worker store, when this agent hosts it

    def next_rendezvous(self):
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        info = self.inner.next_rendezvous()
        if info.rank == 0:
            self._server = None  # the previous round's store closes: its workers are gone
            host, port = self._new_worker_store()
            info.store.set(self.KEY, f"{host} {port}")
        host, port = info.store.get(self.KEY).decode().split()
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(host, int(port)))

    def _new_worker_store(self) -> tuple[str, int]:
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.loopback:
            self._server, port = _loopback_store(timeout)
            return LOOPBACK, port
        host = socket.getfqdn()  # as torch's own handler does; TCPStore listens on every interface
        self._server = TCPStore(host, 0, None, True, timeout, multi_tenant=True, wait_for_workers=False)
        return host, self._server.port

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers get MASTER_ADDR / MASTER_PORT of this round's store

    def get_backend(self) -> str:
        return self.backend

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self):
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        self._server = None
        return self.inner.shutdown()


def _loopback_rendezvous(params):
    """torchrun's rendezvous handler for :data:`LOOPBACK_RENDEZVOUS`: torch's static TCP rendezvous of one node on
    a loopback store, each round's workers on a new loopback store (:class:`_FreshStorePerRound`)."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LoopbackRendezvous(StaticTCPRendezvous):
        def next_rendezvous(self):
            if self._store is None:
                self._store, self.master_port = _loopback_store(self.timeout)
            return super().next_rendezvous()

    if params.max_nodes != 1:
        raise ValueError(f"the {LOOPBACK_RENDEZVOUS} rendezvous is for one node, got --nnodes {params.max_nodes}")
    timeout_s = int(params.config.get("timeout", 600))
    inner = LoopbackRendezvous(LOOPBACK, 0, 0, 1, params.run_id, timeout_s)
    return _FreshStorePerRound(inner, LOOPBACK_RENDEZVOUS, loopback=True, timeout_s=timeout_s)


def _elastic_rendezvous(params):
    """torchrun's rendezvous handler for :data:`ELASTIC_RENDEZVOUS`: torch's c10d rendezvous (nodes may leave and
    join between ``--nnodes MIN:MAX``), each round's workers on a new store (:class:`_FreshStorePerRound`), on
    loopback when the rendezvous endpoint is a loopback address."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    inner_params = RendezvousParameters("c10d", params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
                                        params.local_addr, **params.config)
    inner = rendezvous_handler_registry.create_handler(inner_params)
    host = params.endpoint.rsplit(":", 1)[0]
    timeout_s = float(params.config.get("timeout", 900))
    return _FreshStorePerRound(inner, ELASTIC_RENDEZVOUS, loopback=host in (LOOPBACK, "localhost"),
                               timeout_s=timeout_s)


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
        rdzv_endpoint: str | None = None, launcher_args: list[str] | None = None, max_restarts: int = 0) -> int:
    """Launch ``script`` on ``nproc`` local ranks; return 0 on success, 1 when any rank failed. On one node (no
    ``rdzv_endpoint``) nothing listens beyond this machine: the rendezvous store, which the ranks share as their
    MASTER_ADDR:MASTER_PORT store, is bound to 127.0.0.1, and gloo to the loopback interface (GLOO_SOCKET_IFNAME,
    unless set). Multi-node: torch's c10d rendezvous at ``rdzv_endpoint``, whose store has no authentication
    (docs/cli.md, "Network exposure")."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.run import main as torchrun

    args = ["--nproc-per-node", str(nproc), "--nnodes", nnodes, "--max-restarts", str(max_restarts)]
    environment: dict[str, str | None] = {"OMP_NUM_THREADS": "1"}  # one thread per rank unless told otherwise
    rendezvous_handler_registry.register(LOOPBACK_RENDEZVOUS, _loopback_rendezvous)  # again: a no-op
    rendezvous_handler_registry.register(ELASTIC_RENDEZVOUS, _elastic_rendezvous)
    if nnodes == "1" and rdzv_endpoint is None:
        args += ["--rdzv-backend", LOOPBACK_RENDEZVOUS, "--rdzv-endpoint", f"{LOOPBACK}:0"]
        environment["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    else:
        args += ["--node-rank", str(node_rank), "--rdzv-backend", ELASTIC_RENDEZVOUS,
                 "--rdzv-endpoint", rdzv_endpoint or ""]
        # torch's c10d handler, when it shares its store with the ranks, publishes the ranks' store address once
        # per agent: a node that joins later waits for the address of its first round forever (measured: a
        # returning node's agent timed out on ".../torch.rendezvous.<id>.2/MASTER_ADDR"). Unshared, every round
        # publishes it; the ranks' store is _FreshStorePerRound's either way.
        environment["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if rdzv_endpoint and rdzv_endpoint.rsplit(":", 1)[0] in (LOOPBACK, "localhost"):
            environment["GLOO_SOCKET_IFNAME"] = _loopback_interface()  # "nodes" on this machine (tests)
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
