"""Variants of shardlib's code that ``step_anatomy.py --switch SET`` alternates between consecutive steps of the same
ranks (``_anatomy_measure.switched_steps``). Each set maps a variant's name to a function that installs it in the
running process (the first is the baseline); a variant leaves what a layout computes unchanged or names its trade."""

from __future__ import annotations

import gc
import warnings


def _alive(cls) -> list:
    with warnings.catch_warnings():  # isinstance on some library's lazy module objects warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, cls)]


def _reduce_scatter_by_gloo():
    """Sequence parallelism's reduce-scatter as gloo runs it (the code before 2026-11-27)."""
    import torch.distributed as dist

    from shardlib.parallel import collectives as C

    def start(x, dim, group):
        n = C.group_size(group)
        x = C.to_rank_major(x, dim, n)
        out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
        work = C.REDUCE_SCATTER_SINGLE(out, x, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return C.Pending(work, lambda: out)

    return start


def _switch_reduce_scatter(use_gloo: bool):
    from shardlib.parallel import collectives as C

    original = _ORIGINALS.setdefault("start_reduce_scatter", C.start_reduce_scatter)
    C.start_reduce_scatter = _reduce_scatter_by_gloo() if use_gloo else original


def _save_gathered_inputs(full: bool):
    """``full``: layers save the gathered sequence entering q/k/v and the MLP (tp x the bytes), not the rank's shard."""
    from shardlib.sharding.sequence import SequenceParallel

    for sp in _alive(SequenceParallel):
        sp.saving_managed_outside = full


def _switch_transport(use_shm: bool):
    """The tp group's tensors through shared memory (where the mesh attached it) or through gloo."""
    from shardlib.parallel import shm

    stashed = _ORIGINALS.setdefault("shm_groups", dict(shm._GROUPS))
    shm._GROUPS.clear()
    if use_shm:
        shm._GROUPS.update(stashed)


def _overlap_param_gathers(overlap: bool):
    """ZeRO-1/2's parameter all-gathers waited for at the step's end, or left to each bucket's first reader."""
    from shardlib.train.zero import FlatZero

    for optimizer in _alive(FlatZero):
        optimizer.wait_params()
        optimizer.overlap_param_gather = overlap


_ORIGINALS: dict = {}

SETS = {
    # gloo's reduce-scatter (an all-reduce's cost) against shardlib's all-to-all + local sum
    "reduce-scatter": {"gloo": lambda: _switch_reduce_scatter(True), "all-to-all": lambda: _switch_reduce_scatter(False)},
    # gloo's loopback sockets against the shared-memory transport (layouts tp2, tp2_sp)
    "transport": {"gloo": lambda: _switch_transport(False), "shm": lambda: _switch_transport(True)},
    # ZeRO's parameter all-gathers waited for in the step against overlapped with the next forward
    "param-gather": {"in-step": lambda: _overlap_param_gathers(False), "overlapped": lambda: _overlap_param_gathers(True)},
    # Megatron's saved shards gathered again in backward against saving the gathered inputs whole
    "sp-saved-inputs": {"shards": lambda: _save_gathered_inputs(False), "whole": lambda: _save_gathered_inputs(True)},
}
