"""Persistent rank pools: a layout's ranks start once and wait on a pipe while another layout runs."""

from __future__ import annotations

import contextlib
import os
import traceback

from _harness import free_port, loopback_ifname


def _pool_rank(rank: int, conns, world: int, port: int, setup, serve) -> None:
    """One rank of a :class:`RankPool`: ``state = setup(rank, world)``, then ``serve(state, name, **kwargs)``."""
    import torch.distributed as dist

    conn = conns[rank]
    try:
        if world > 1:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        state = setup(rank, world)
        conn.send(("ready", None))
        while (command := conn.recv()) is not None:
            name, kwargs = command
            conn.send(("ok", serve(state, name, **kwargs)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


class RankPool:
    """``world`` spawned ranks alive between measurements; ``setup`` and ``serve`` must be importable (spawn)."""

    def __init__(self, world: int, setup, serve, timeout_s: float = 600.0):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(world)]
        self.conns = [parent for parent, _ in pipes]
        self.timeout_s = timeout_s
        self.context = mp.start_processes(_pool_rank, args=([child for _, child in pipes], world, free_port(), setup,
                                                            serve), nprocs=world, join=False, start_method="spawn")
        self._answers()

    def _answers(self) -> list:
        answers = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(self.timeout_s):
                self.close()
                raise TimeoutError(f"rank {rank} of the pool did not answer within {self.timeout_s:.0f} s")
            kind, value = conn.recv()
            if kind == "error":
                self.close()
                raise RuntimeError(f"rank {rank} of the pool failed:\n{value}")
            answers.append(value)
        return answers

    def call(self, name: str, **kwargs) -> list:
        for conn in self.conns:
            conn.send((name, kwargs))
        return self._answers()

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # BrokenPipeError included
                conn.send(None)
        for p in self.context.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
