"""Expert parallelism: a mixture-of-experts layer's experts split over the ``ep`` group, each rank holding E/ep whole
experts, and the tokens sent to the ranks of their experts and back.

An experts module is called as ``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])`` after the
block's router chose each token's K experts (the router is replicated and routes this rank's own tokens: the ranks
of an ep group are data-parallel ranks, with different tokens). Under expert parallelism that call becomes:

1. **dispatch**: the T*K (token, expert) pairs sorted by expert (stable: in token order within an expert); each
   pair's hidden state goes to the rank holding its expert by one all-to-all over the ep group, with its local
   expert index;
2. the rank's own experts run on what they received, through the module's own implementation (transformers'
   ``eager``, ``batched_mm`` or ``grouped_mm``, on the module's E/ep local experts, weight 1 per row);
3. **combine**: the outputs go back by the inverse all-to-all and are added into each token's output, weighted by
   its routing weight, in the order the unsharded eager loop adds them (ascending expert).

Backward is the same exchange reversed (:class:`_AllToAllRows`), so a rank's expert gradients hold the contributions
of every token of the ep group that reached them. Two modes:

* **dropless** (``capacity_factor=None``, the default): variable splits, exactly the unsharded model's computation;
  the split sizes are exchanged first (a host synchronisation per layer);
* **static capacity** (``capacity_factor=c``): every rank sends each expert exactly ``C = ceil(c * T * K / E)`` rows
  (padding with zeros; pairs past C in an expert's token order are dropped: their contribution is 0), so every
  exchange has equal splits fixed by the shapes: no host synchronisation, one graph for torch.compile and CUDA
  graphs. What is dropped is counted on the module (:data:`DROPPED_ATTR`, a tensor: reading it synchronises) and
  reported by :func:`shardlib.sharding.experts.expert_load`. In eager mode the local experts compute only the filled
  slots (:func:`_filled_slots`), so the padding costs no expert work; a compiled graph computes every slot.

A rank whose experts receive no token still takes part in every exchange (empty splits, or padding only), so nothing
waits for it, and its experts get no gradient, as in the unsharded model (under torch.compile's static exchange, a
zero one: they computed their padding).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import torch.distributed._functional_collectives as funcol

from .collectives import Group, _traced, _waited, group_rank, group_size
from .experts import with_zero_gradients

#: set on an experts module running under expert parallelism: pairs dropped by the static capacity (a tensor)
DROPPED_ATTR = "_shardlib_dropped_pairs"
#: the (token, expert) pairs it was asked to route (a tensor), beside the dropped ones
ROUTED_ATTR = "_shardlib_routed_pairs"
#: on a ModuleDict of expert modules split over ep: (every expert's key, in order; ep). Rank r of the ep group holds
#: the r-th E/ep of them under their own keys
EP_KEYS_ATTR = "_shardlib_ep_keys"


class _AllToAllRows(torch.autograd.Function):
    """forward: all-to-all of rows over ``group``, ``send[i]`` rows to rank i and ``recv[i]`` rows from it;
    backward: the inverse exchange of the gradient (``recv[i]`` rows to rank i, ``send[i]`` from it)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    if _traced():  # torch.compile / export: the functional collective (split sizes fixed by the shapes: static mode)
        return _waited(funcol.all_to_all_single(x.contiguous(), recv, send, group))
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    """Rows of ``x`` to the ranks of ``group`` (``send[i]`` to rank i, ``recv[i]`` from it), with autograd."""
    return _AllToAllRows.apply(x, send, recv, group)


def expert_parallel_forward(module, local_forward, group: Group, num_experts: int,
                            capacity_factor: float | None, hidden: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, pairs: int | None = None) -> torch.Tensor:
    """The experts module's forward under expert parallelism (module docstring). ``local_forward(rows, index,
    weights)``: the module's own forward over its local experts; ``num_experts``: the global count; ``pairs``: the
    (token, expert) pairs the static capacity is sized for (default: every entry of ``top_k_index``)."""
    ep, rank = group_size(group), group_rank(group)
    local = num_experts // ep
    k = top_k_index.shape[-1]
    expert = top_k_index.reshape(-1)
    order = torch.argsort(expert, stable=True)
    expert = expert[order]
    token = order // k
    weight = top_k_weights.reshape(-1)[order]
    rows = hidden[token]
    routed = torch.tensor(float(expert.numel()))
    if capacity_factor is None:
        send = torch.bincount(expert // local, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send, recv = send.tolist(), recv.tolist()
        index = exchange_rows((expert % local).unsqueeze(1), send, recv, group)
        received = exchange_rows(rows, send, recv, group)
        back = exchange_rows(_connected(local_forward(received, index, _ones(index, hidden)), received), recv, send,
                             group)
        dropped = torch.zeros(())
    else:
        capacity = max(1, math.ceil(capacity_factor * (pairs or expert.numel()) / num_experts))
        _check_same_capacity(module, capacity, group)
        back, kept = _static_capacity(local_forward, rows, expert, num_experts, local, ep, capacity, group, hidden)
        weight = weight * kept
        dropped = (~kept).sum().float()
    _count(module, routed, dropped)
    combined = torch.zeros_like(hidden)
    return combined.index_add(0, token, (back * weight.unsqueeze(1)).to(hidden.dtype))


def modules_expert_parallel_forward(experts, group: Group, num_experts: int, capacity_factor: float | None,
                                    hidden: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor):
    """The forward of a ModuleDict of experts under expert parallelism, called as Switch Transformers calls its
    experts: ``hidden`` [T, H], ``selected`` [T, 1, E] (one-hot, all zero for a token the router's capacity
    dropped), ``weights`` [T, 1]. The routed tokens go through :func:`expert_parallel_forward`; dropped ones get
    zeros, as in the model."""
    routed = selected.reshape(selected.shape[0], -1).any(-1).nonzero().squeeze(1)
    index = selected.reshape(selected.shape[0], -1)[routed].argmax(-1, keepdim=True)
    local = list(experts.children())

    def local_forward(rows, local_index, ones):
        out = rows.new_zeros(rows.shape)
        for j, expert in enumerate(local):
            at = (local_index[:, 0] == j).nonzero().squeeze(1)
            if at.numel():
                out = out.index_add(0, at, expert(rows[at]).to(out.dtype))
        return out

    part = expert_parallel_forward(experts, local_forward, group, num_experts, capacity_factor, hidden[routed],
                                   index, weights.reshape(weights.shape[0], -1)[routed], pairs=hidden.shape[0])
    return torch.zeros_like(hidden).index_add(0, routed, part)


def _connected(out: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """``out``, with a backward path to ``received`` even where the local experts computed nothing from it (a rank
    that received no row returns constant zeros): every rank of the ep group then runs both reverse exchanges in its
    backward, or its peers would wait in theirs."""
    if received.requires_grad and not out.requires_grad:
        return with_zero_gradients(out, received)
    return out


def _ones(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.ones(index.shape, dtype=like.dtype, device=like.device)


def _check_same_capacity(module, capacity: int, group: Group) -> None:
    """The static capacity follows from the batch's shape, which must be the same on every rank of the ep group
    (equal splits): checked once per capacity, in eager mode (one small all-reduce), so a rank with another batch
    shape is an error naming both rather than a collective that fails."""
    seen = module.__dict__.setdefault("_shardlib_capacities_checked", set())
    if capacity in seen or torch.compiler.is_compiling():
        return
    both = torch.tensor([capacity, -capacity], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if both[0] != -both[1]:
        raise ValueError(f"expert parallelism with a static capacity needs the same tokens per batch on every rank of "
                         f"the ep group: capacities {int(-both[1])} to {int(both[0])} rows per expert; give every "
                         "rank batches of one shape, or use the dropless exchange (expert_capacity=None)")
    seen.add(capacity)


def _static_capacity(local_forward, rows, expert, num_experts, local, ep, capacity, group, hidden):
    """Equal splits: ``capacity`` rows per expert from every rank (module docstring). Returns each pair's output row
    (zeros where dropped) and which pairs were kept."""
    pairs, width = expert.numel(), rows.shape[1]
    starts = torch.searchsorted(expert, torch.arange(num_experts, device=expert.device))
    position = torch.arange(pairs, device=expert.device) - starts[expert]  # the pair's place in its expert's queue
    kept = position < capacity
    # a dropped pair goes to a spare last row that is never sent: no data-dependent shape anywhere (compile)
    slot = torch.where(kept, expert * capacity + position, num_experts * capacity)
    slots = rows.new_zeros(num_experts * capacity + 1, width).index_add(0, slot, rows)[:-1]  # rank i's experts: block i
    split = [local * capacity] * ep
    received = exchange_rows(slots, split, split, group)  # [ep * local * C, H]: from rank j, its rows for my experts
    index = (torch.arange(local * capacity, device=rows.device) // capacity).repeat(ep).unsqueeze(1)
    if torch.compiler.is_compiling():  # one graph: every slot computed, padding too
        computed = local_forward(received, index, _ones(index, hidden))
    else:
        filled = _filled_slots(expert, num_experts, local, ep, capacity, group)
        computed = received.new_zeros(received.shape).index_copy(
            0, filled, local_forward(received[filled], index[filled], _ones(index[filled], hidden)).to(received.dtype))
    out = exchange_rows(_connected(computed, received), split, split, group)
    return out[slot.clamp(max=num_experts * capacity - 1)] * kept.unsqueeze(1).to(out.dtype), kept


def _filled_slots(expert, num_experts: int, local: int, ep: int, capacity: int, group: Group) -> torch.Tensor:
    """The received slots that hold a pair (not padding), in eager mode: each rank fills an expert's slots from the
    first, so one small all-to-all of the filled counts (equal splits: no host synchronisation for the exchange)
    tells which slots the local experts need to compute. The padding is skipped, so the step costs what dropless
    costs, and an expert that received only padding gets no gradient, as in the unsharded model."""
    counts = torch.bincount(expert, minlength=num_experts).clamp(max=capacity)  # this rank's, per global expert
    received = _exchange(counts.unsqueeze(1), [local] * ep, [local] * ep, group).squeeze(1)  # per (source, expert)
    position = torch.arange(capacity, device=expert.device).repeat(ep * local)
    return (position < received.repeat_interleave(capacity)).nonzero().squeeze(1)


def _count(module, routed: torch.Tensor, dropped: torch.Tensor) -> None:
    """Accumulate what the module routed and dropped since the last read (:func:`take_counts`): eager forwards
    only (a compiled graph keeps no Python state)."""
    if torch.compiler.is_compiling():
        return
    d = module.__dict__
    d[ROUTED_ATTR] = d.get(ROUTED_ATTR, 0) + routed.detach()
    d[DROPPED_ATTR] = d.get(DROPPED_ATTR, 0) + dropped.detach()


def take_counts(module) -> tuple[float, float]:
    """(pairs routed, pairs dropped) by ``module`` since the last call; resets them."""
    d = module.__dict__
    routed, dropped = d.pop(ROUTED_ATTR, 0), d.pop(DROPPED_ATTR, 0)
    return float(routed), float(dropped)


__all__ = ["exchange_rows", "expert_parallel_forward", "modules_expert_parallel_forward", "take_counts",
           "DROPPED_ATTR", "ROUTED_ATTR", "EP_KEYS_ATTR"]
