"""The shard pass of ``sequence_parallel="all_to_all"`` (DeepSpeed-Ulysses): every activation inside the layer
stacks holds 1/sp of the sequence, and each attention module exchanges sequence for heads around its attention
function. The attention math, its all-to-alls and their backward are in :mod:`shardlib.kernels.attention`; this
module checks a plan against it and installs it on the model's attention modules."""

from __future__ import annotations

import inspect

import torch

from ..kernels.attention import CONTEXT_ATTR, AllToAllContext, all_to_all_name, set_attention, whole_sequence_bias
from ..parallel.styles import CopyInputs, ShardContext
from .sequence import SequenceParallel, install_sequence_parallel, sequence_parallel_problems


class AllToAllSequenceParallel:
    """The pass of ``sequence_parallel="all_to_all"``: every activation in the stacks on 1/sp of the sequence, the
    attention modules exchanging sequence for heads (module docstring)."""

    def problems(self, r) -> list[str]:
        return sequence_parallel_problems(r) + _all_to_all_problems(r)

    def install(self, r) -> None:
        r.sequence = SequenceParallel(r.mesh.group("sp"), r.mesh.sp)
        install_sequence_parallel(r, r.sequence, sp_dimension=True)
        _install_all_to_all_attention(r, r.sequence, r.model.config._attn_implementation)


def sp_mode_problems(r, mode: str, what: str, site_problems) -> list[str]:
    """What stops sequence parallelism ``mode`` (``what``: its name in a sentence) on the mesh's sp dimension: an sp
    of one, a plan without attention sites, a site whose module lacks the argument or method it names; then
    ``site_problems(path, module, site)`` of every site."""
    if getattr(r.mesh, "sp", 1) < 2:
        return [f"sequence_parallel={mode!r} needs a mesh with sp > 1 ranks per sequence (init_mesh(..., sp=N)); "
                "this mesh has sp=1"]
    if not r.plan.attention:
        return [f"the policy of {r.name} lists no attention modules (Plan.attention) that {what} can wrap "
                "(docs/sequence-parallel.md says which models support it)"]
    problems = []
    for pattern, site in r.plan.attention.items():
        for path in r.match(pattern, "attention"):
            module = r.modules[path]
            if site.kv_input and site.kv_input not in inspect.signature(module.forward).parameters:
                problems.append(f"{path}: forward has no argument {site.kv_input!r} (AttentionSite.kv_input)")
            if site.bias_method is not None and not callable(getattr(module, site.bias_method, None)):
                problems.append(f"{path}: {type(module).__name__} has no method {site.bias_method!r} "
                                "(AttentionSite.bias_method)")
            problems += site_problems(path, module, site)
    return problems


def _all_to_all_problems(r) -> list[str]:
    return sp_mode_problems(r, "all_to_all", "all-to-all sequence parallelism",
                            lambda path, module, site: head_problems(path, module, site, r.tp, r.mesh.sp))


def head_problems(path: str, module, site, tp: int, n: int, dim: str = "sp") -> list[str]:
    """Query heads, and grouped key/value heads, of attention module ``module`` (its :class:`AttentionSite` ``site``)
    that ``tp * n`` does not divide, where ``n`` ranks of dimension ``dim`` exchange sequence for heads (all-to-all:
    sp; Ulysses inside a ring: ulysses): each takes whole heads of both (query head i reads key/value head
    i // groups, so equal contiguous shares keep each rank's pairs)."""
    problems = []
    for role, heads in site.head_counts(module).items():
        spec = site.heads if role == "query" else site.kv_heads
        where = f"{path}.{spec} = {heads}" if isinstance(spec, str) else f"{path}: {heads} {role} heads ({spec})"
        if heads % (tp * n):
            problems.append(f"{where} is not divisible by tp({tp}) * {dim}({n}) = {tp * n}: each rank exchanging "
                            "sequence for heads takes whole heads")
    return problems


def _install_all_to_all_attention(r, sp, implementation: str) -> None:
    """Each attention module calls all-to-all attention around ``implementation`` with its stack's stream;
    cross-attention inputs enter the sp region (backward: their gradient, from this rank's heads only, is summed);
    relative position biases are computed for the whole sequence."""
    rank = torch.distributed.get_rank(sp.group)
    for pattern, site in r.plan.attention.items():
        for path in r.match(pattern):
            module, stream = r.modules[path], sp.stream(r.stack_of(path))
            module.__dict__[CONTEXT_ATTR] = AllToAllContext(sp.group, rank, stream, implementation,
                                                            cross=site.kv_input is not None)
            if site.kv_input is not None:
                CopyInputs(site.kv_input).apply(path, module, ShardContext(group=sp.group, tp=sp.size))
            if site.bias_method is not None:
                setattr(module, site.bias_method, whole_sequence_bias(getattr(module, site.bias_method), stream))
    set_attention(r.model, all_to_all_name(implementation))
