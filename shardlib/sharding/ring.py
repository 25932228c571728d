"""The shard pass of ``sequence_parallel="ring"`` (context parallelism): every activation inside the layer stacks
holds 1/sp of the sequence, as under all-to-all, but attention keeps all of this rank's heads and passes K/V blocks
around the sp ranks instead of exchanging sequence for heads, so sp need not divide the head count. The attention
math, its ring and its backward are in :mod:`shardlib.kernels.ring_attention`; this module checks a plan against it
and installs it on the model's attention modules."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from ..kernels.attention import base_implementation, set_attention
from ..kernels.ring_attention import (
    CONTEXT_ATTR, MaskCache, RingContext, UlyssesGroup, relative_bias_vector, ring_name,
)
from ..kernels.ring_blocks import RingLayout
from ..parallel.collectives import all_gather
from ..parallel.mesh import FAKE_BACKEND
from ..parallel.styles import CopyInputs, ShardContext
from .all_to_all import head_problems, sp_mode_problems
from .sequence import SequenceParallel, install_sequence_parallel, sequence_parallel_problems

#: the inner implementations whose mask semantics the ring reproduces (it computes the attention itself)
RING_IMPLEMENTATIONS = ("sdpa", "eager")


class RingSequenceParallel:
    """The pass of ``sequence_parallel="ring"`` (module docstring)."""

    def problems(self, r) -> list[str]:
        return sequence_parallel_problems(r) + _ring_problems(r)

    def install(self, r) -> None:
        ulysses = r.options.get("ulysses", 1)
        r.sequence = SequenceParallel(r.mesh.group("sp"), r.mesh.sp)
        r.sequence.layout = RingLayout(ranks=r.mesh.sp, ring=r.mesh.sp // ulysses)
        for stack in r.plan.trunk:  # before the stack entry's scatter (hooks run in the order registered)
            layers = list(r.model.get_submodule(stack.layers)._modules.values())
            if layers:
                layers[0].register_forward_pre_hook(_agreement_check(r.sequence.group, stack.layers), with_kwargs=True)
        install_sequence_parallel(r, r.sequence, sp_dimension=True)
        if ulysses > 1:
            ulysses_group, ring_group = r.mesh.split_sp(ulysses)
            ring = (ring_group, dist.get_rank(ring_group), r.mesh.sp // ulysses)
            inner = UlyssesGroup(ulysses_group, dist.get_rank(ulysses_group), ulysses)
        else:
            ring, inner = (r.sequence.group, dist.get_rank(r.sequence.group), r.mesh.sp), None
        _install_ring_attention(r, r.sequence, ring, inner, r.model.config._attn_implementation)


def _ring_problems(r) -> list[str]:
    sp, ulysses = getattr(r.mesh, "sp", 1), r.options.get("ulysses", 1)
    if sp > 1 and (ulysses < 1 or sp % ulysses):
        return [f"ulysses={ulysses} does not divide sp={sp} (Ulysses x ring: sp = ulysses * ring positions)"]
    chosen = r.options["kernels"].attention if r.options.get("kernels") is not None else None
    chosen = None if chosen == "blocks" else chosen  # blocks keep the model's own implementation's masks
    implementation = base_implementation(chosen or getattr(r.model.config, "_attn_implementation", None))
    problems = []
    if sp > 1 and r.plan.attention and implementation not in RING_IMPLEMENTATIONS:
        problems.append(f"{r.name}: ring attention computes attention itself with the mask semantics of "
                        f"{' or '.join(RING_IMPLEMENTATIONS)}; the model runs {implementation!r} "
                        "(shard(..., kernels=Kernels(attention='sdpa')) to switch)")

    def site_problems(path, module, site) -> list[str]:
        found = head_problems(path, module, site, r.tp, ulysses, "ulysses") if ulysses > 1 else []
        method = getattr(module, site.bias_method, None) if site.bias_method is not None else None
        if callable(method) and "past_seen_tokens" not in inspect.signature(method).parameters:
            found.append(f"{path}: {type(module).__name__}.{site.bias_method} takes no past_seen_tokens: ring "
                         "attention computes a relative bias per distance through it")
        return found

    return sp_mode_problems(r, "ring", "ring attention", site_problems) + problems


def _agreement_check(group, where: str):
    """A pre-hook for a stack's first layer: the sp ranks' inputs agree in batch size, length and content (a sum),
    else every rank raises naming the ranks and their shapes. Ranks that disagree would otherwise pass K/V blocks of
    different sequences around the ring, which fails late or, where the padded chunks have the same size, computes
    silently wrong attention. One all-gather of three numbers per stack and forward."""

    def check(module, args, kwargs):
        x = args[0]
        if x.is_meta or torch.compiler.is_compiling() or dist.get_backend(group) == FAKE_BACKEND:
            return None
        mine = torch.tensor([[x.shape[0], x.shape[1], float(x.detach().double().sum())]], dtype=torch.float64)
        everyone = all_gather(mine, 0, group)
        same = (everyone == everyone[0]) | (everyone.isnan() & everyone[0].isnan())
        if not bool(same.all()):
            ranks = dist.get_process_group_ranks(group)
            seen = "; ".join(f"rank {rank}: batch {int(b)} x length {int(n)}, sum {s:.6g}"
                             for rank, (b, n, s) in zip(ranks, everyone.tolist()))
            raise RuntimeError(f"ring attention: the sp ranks' inputs to {where} differ ({seen}); every rank of an sp "
                               "group must get the same batch (the runtime's dp_shard gives it)")
        return None

    return check


def _install_ring_attention(r, sp: SequenceParallel, ring: tuple, ulysses, implementation: str) -> None:
    """Each attention module calls ring attention with its stack's stream over ``ring`` (group, rank, size), with
    ``ulysses`` inside each ring position or None; cross-attention inputs enter the sp region (backward: their
    gradient, from this rank's queries only, is summed); relative position biases are computed per distance."""
    masks: dict[int, MaskCache] = {}
    for pattern, site in r.plan.attention.items():
        for path in r.match(pattern):
            module, stack = r.modules[path], r.stack_of(path)
            stream = sp.stream(stack)
            module.__dict__[CONTEXT_ATTR] = RingContext(
                *ring, stream, implementation, base_implementation(implementation), cross=site.kv_input is not None,
                relative=site.bias_method is not None, masks=masks.setdefault(stack, MaskCache()), ulysses=ulysses,
                layout=sp.layout)
            if site.kv_input is not None:
                CopyInputs(site.kv_input).apply(path, module, ShardContext(group=sp.group, tp=sp.size))
            if site.bias_method is not None:
                setattr(module, site.bias_method, relative_bias_vector(getattr(module, site.bias_method), stream))
    set_attention(r.model, ring_name(implementation))
