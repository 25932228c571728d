"""Ring attention (context parallelism): exact attention over a sequence split across the n ranks of a ring,
without any rank holding the whole sequence's keys, values or scores.

Layout (:class:`RingLayout`): the sequence is padded to a multiple of 2n and cut into 2n equal segments; ring
position p holds segments p and 2n - 1 - p (zigzag), so under a causal mask every position does the same work
(contiguous chunks would give the last rank n blocks and the first one). Each rank holds q [b, hq, c, d] and k, v
[b, hk, c, d] of its ``c`` positions (``hq`` a multiple of ``hk``: grouped K/V heads).

Forward: n steps; at step i this rank holds the K/V block of ring position ``src = (p - i) mod n`` and computes its
queries against it, piece by piece (a piece: a run of consecutive query positions against the runs of key positions
it may see; under a causal mask a block of another rank is two of its four segment pairs), each piece's output and
log-sum-exp (``s = q k^T * scale + bias + mask``, ``lse_b = logsumexp(s)``, ``o_b = softmax(s) v``) merged into the
running result in fp32 (fp64 for fp64 inputs): ``lse = logaddexp(lse, lse_b)``, ``o = o e^(lse_old - lse) + o_b
e^(lse_b - lse)``. The next step's block travels (one send, one receive per step) while this rank computes with the
one it holds, so the transfer runs under the block's compute: relayed around the ring (the block travels to position
``p + 1``), or, under a mask spec, sent straight from its owner to each position whose queries see it and to no
other (:class:`_Ring`). Backward (the flash-attention recurrence, recomputing each piece's probabilities from the
saved global ``lse``): ``p = e^(s - lse)``, ``dv += p^T dO``, ``dp = dO v^T``, ``ds = p (dp - rowsum(dO o))``,
``dq += ds k scale``, ``dk += ds^T q scale``; the K/V blocks travel again and each block's dK/dV returns to its
owner: relayed, an accumulator one step behind the block, home after n hops; direct, each position's share sent
straight back.

What a piece's scores see, each from global positions (exact for any length and any split): the model's mask (the
caller gives this rank's rows over all columns in ring order), causality, padding (keys at positions >= L are -inf),
and a relative position bias given per distance (T5), ``[1, h, 1, 2L - 1]`` (entry ``L - 1 + k - q``), whose piece of
``[h, rows, cols]`` is gathered from it and whose gradient is scattered back. Attention dropout: each piece's mask is
drawn from a generator seeded by a per-forward seed and the piece, and drawn again in backward.

Piece kernels: on CPU, without a bias gradient or dropout, ATen's flash-attention CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp, and its backward, which takes the
global output and log-sum-exp); otherwise the explicit math above (float64-exact, any device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .ring_geometry import CrossGeometry, RingGeometry, RingLayout

ACC_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
KV, GRADIENTS = 0, 1  # message tags


@dataclass
class Piece:
    """One piece of a block: query rows ``rows`` (one of this rank's two segments, or a run of them) against key
    columns ``cols`` (one or both of the block's segments, or a run of them), of the batch rows ``batch``, what their
    scores add (an additive mask without gradient, the relative bias's index), whether key j > query i is hidden
    counting both from the piece's corner (``causal``), and the dropout seed offset."""

    rows: slice
    cols: slice
    mask: torch.Tensor | None
    bias_index: torch.Tensor | None
    tag: int
    batch: slice = field(default_factory=lambda: slice(None))
    causal: bool = False


# -------------------------------------------------------------------------------------------------- piece kernels
def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, hk, c, d] -> [b, hk * groups, c, d], query head i reading K/V head i // groups (HF's ``repeat_kv``)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold_kv(grad: torch.Tensor, groups: int) -> torch.Tensor:
    return grad if groups == 1 else grad.unflatten(1, (-1, groups)).sum(2)


def _scores(q, k, scale, piece: Piece, relative, softcap: float = 0.0):
    """The piece's scores, and tanh of the scaled scores over ``softcap`` where one caps them (Gemma2:
    softcap * tanh(s / softcap), before bias and mask), for the backward's chain rule."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    capped = None
    if softcap:
        capped = torch.tanh(s / softcap)
        s = capped * softcap
    if piece.bias_index is not None:
        s = s + relative[0, :, 0][:, piece.bias_index]  # [h, rows, cols]
    if piece.mask is not None:
        s = s + piece.mask
    if piece.causal:
        rows, cols = s.shape[-2:]
        s = s.masked_fill(torch.ones(rows, cols, dtype=torch.bool, device=s.device).triu_(1), -math.inf)
    return s, capped


def _dropout_keep(shape, p: float, seed: int, device) -> torch.Tensor:
    device = torch.device(device)
    gen = torch.Generator(device="cpu" if device.type == "meta" else device).manual_seed(seed)  # meta: the dry run
    return torch.rand(shape, generator=gen, device=device) >= p


def _dropout_scale(p: torch.Tensor, dropout: float, seed: int) -> torch.Tensor:
    """The piece's keep mask as 0 or 1 / (1 - dropout) in ``p``'s dtype (the same in forward and backward)."""
    return _dropout_keep(p.shape, dropout, seed, p.device).to(p.dtype) / (1 - dropout)


def _kernel_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The piece's additive mask in the kernel's input dtype; finite where the accumulation dtype's ``finfo.min``
    would overflow (fp16), so a row still sums over what its mask hides, as in the accumulation dtype."""
    if mask is None or mask.dtype == dtype:
        return mask
    return mask.clamp(min=torch.finfo(dtype).min).to(dtype)


def _use_flash(q, piece: Piece, dropout: float, softcap: float) -> bool:
    """ATen's CPU flash kernel where it computes the piece: on CPU (and on the meta device, where the dry run
    predicts a CPU step), without a bias gradient, dropout or capped scores."""
    return q.device.type in ("cpu", "meta") and piece.bias_index is None and not dropout and not softcap


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that see no key at all (-inf) at 0, so that their weights are exp(-inf) = 0, not NaN."""
    return lse.masked_fill(lse == -math.inf, 0)


def piece_forward(q, k, v, scale, piece: Piece, relative, dropout: float, seed: int, softcap: float = 0.0):
    """One piece's (output [b, h, rows, d] in the accumulation dtype, log-sum-exp [b, h, rows] fp32/fp64)."""
    acc = ACC_DTYPES.get(q.dtype, q.dtype)
    if _use_flash(q, piece, dropout, softcap):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, piece.causal, attn_mask=_kernel_mask(piece.mask, q.dtype), scale=scale)
        return out.to(acc), lse.to(acc)
    s, _ = _scores(q.to(acc), k.to(acc), scale, piece, relative, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    if dropout:
        p = p * _dropout_scale(p, dropout, seed)
    return torch.matmul(p, v.to(acc)), lse


def piece_backward(grad_out, q, k, v, out, lse, scale, piece: Piece, relative, dropout: float, seed: int,
                   softcap: float = 0.0):
    """Gradients of one piece's contribution given the global output and log-sum-exp of its rows: (dq, dk, dv,
    d relative or None), in the accumulation dtype."""
    acc = ACC_DTYPES.get(q.dtype, q.dtype)
    if _use_flash(q, piece, dropout, softcap):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse.float() if q.dtype in ACC_DTYPES else lse,
            0.0, piece.causal, attn_mask=_kernel_mask(piece.mask, q.dtype), scale=scale)
        return dq.to(acc), dk.to(acc), dv.to(acc), None
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    s, capped = _scores(q, k, scale, piece, relative, softcap)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    dp = torch.matmul(grad_out, v.transpose(-1, -2))
    if dropout:
        keep = _dropout_scale(p, dropout, seed)
        dv = torch.matmul((p * keep).transpose(-1, -2), grad_out)
        dp = dp * keep
    else:
        dv = torch.matmul(p.transpose(-1, -2), grad_out)
    ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
    drel = None
    if piece.bias_index is not None:
        drel = torch.zeros_like(relative, dtype=acc)
        drel[0, :, 0].index_add_(1, piece.bias_index.flatten(), ds.sum(0).flatten(1))  # the batch shares the bias
    if capped is not None:
        ds = ds * (1 - capped * capped)  # through softcap * tanh(s / softcap)
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv, drel


# ------------------------------------------------------------------------------------------------------ the problem
@dataclass
class RingProblem:
    """Everything but the tensors: the group and geometry, the scale, what the pieces' scores see, the dropout."""

    group: object
    geometry: RingGeometry
    scale: float
    acc: torch.dtype  # the accumulation dtype (fp32 for half inputs)
    mask: torch.Tensor | None = None  # this rank's rows (or one row for all) x all padded columns, additive, or None
    spec: object = None  # a MaskSpec (shardlib.kernels.mask_spec) instead of ``mask`` and ``causal``
    visible: list[bool] | None = None  # per block: whether the mask lets any row of this rank see any of its keys
    causal: bool = False
    relative_length: int = 0  # L when a relative bias vector [1, h, 1, 2L - 1] is given
    softcap: float = 0.0  # scores capped to softcap * tanh(s / softcap) (Gemma2), or 0
    dropout: float = 0.0
    seed: int = 0

    def pieces(self, src: int) -> list[Piece]:
        """The pieces of block ``src`` (none where the block contributes nothing)."""
        g = self.geometry
        if self.spec is not None:
            # a relative bias's index is [rows, cols] per piece: made when needed, never kept across layers
            cache = None if self.relative_length else (self.acc, str(g.device))
            return self.spec.pieces(g, src, self._spec_piece, cache)
        if self.visible is not None and not self.visible[src]:
            return []
        keys = [run for run in g.runs(src) if run[2] < g.length]  # runs of padding only contribute nothing
        if not keys:
            return []
        if not self.causal:  # every query sees the same keys: one piece of the whole chunk
            first, last = g.runs(g.rank)[0], g.runs(g.rank)[-1]
            return [self._piece(src, (first[0], last[1], first[2], last[3]), keys, tag=src * 1024)]
        pieces = []
        for row_run in g.runs(g.rank):  # causal: a query segment sees the key segments that start before its end
            seen = [run for run in keys if run[2] <= row_run[3]]
            if seen:
                pieces.append(self._piece(src, row_run, seen, tag=src * 1024 + len(pieces)))
        return pieces

    def sees(self, position: int, src: int) -> bool:
        """Whether ring position ``position``'s queries see any key of block ``src``: under a mask spec as it says
        (both ends of a transfer ask it alike), else taken as yes."""
        return self.spec is None or self.spec.sees(self.geometry, src, position)

    def _piece(self, src: int, row_run, col_runs, tag: int) -> Piece:
        g, device = self.geometry, self.geometry.order.device
        rows, cols = slice(row_run[0], row_run[1]), slice(col_runs[0][0], col_runs[-1][1])  # one or both segments
        qpos, kpos = g.positions(g.rank)[rows], g.positions(src)[cols]
        mask = None
        if self.mask is not None:  # the key segments' columns (in position order); one row broadcasts
            parts = [self.mask[..., run[2]:run[3] + 1] for run in col_runs]
            mask = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
            mask = mask if mask.shape[-2] == 1 else mask[..., rows, :]
        padded = any(run[3] >= g.length for run in col_runs)
        future = self.causal and max(run[3] for run in col_runs) > row_run[2]
        if padded or future:  # from the runs' positions: no device sync (and the same on the meta device)
            hidden = (kpos >= g.length)[None, :].expand(len(qpos), -1)
            if self.causal:
                hidden = hidden | (kpos[None, :] > qpos[:, None])
            extra = torch.zeros(hidden.shape, dtype=self.acc, device=device).masked_fill_(hidden, -math.inf)
            mask = extra if mask is None else mask + extra
        return Piece(rows, cols, mask, self._bias_index(qpos, kpos), tag)

    def _spec_piece(self, batch: slice, rows: slice, cols: slice, queries, keys, causal: bool, tag: int,
                    real: torch.Tensor | None, window: int | None) -> Piece:
        """A piece the mask spec cut (positions ``queries`` and ``keys``: [start, stop) or a tensor of them): no
        mask, or where rows of different lengths share it, a key row [b, 1, 1, cols] hiding each row's padding
        (``real``: [b, cols]), and at a sliding window's edge, the window's [rows, cols] (at most a tile square).
        Hidden entries are finfo.min, not -inf: a row that sees none of the piece's keys gets weight 0, not NaN."""
        device = self.geometry.device
        qpos, kpos = (torch.arange(*x, device=device) if isinstance(x, tuple) else x for x in (queries, keys))
        hidden = None
        if real is not None:
            hidden = ~real[:, None, None, :]
        if window is not None:
            outside = kpos[None, :] <= qpos[:, None] - window
            hidden = outside if hidden is None else hidden | outside
        mask = None if hidden is None else \
            torch.zeros(hidden.shape, dtype=self.acc, device=device).masked_fill_(hidden, torch.finfo(self.acc).min)
        return Piece(rows, cols, mask, self._bias_index(qpos, kpos), tag, batch, causal)

    def _bias_index(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor | None:
        """Where each (query, key) entry of a relative bias given per distance is (None without one)."""
        if not self.relative_length:
            return None
        L = self.relative_length
        return (kpos[None, :] - qpos[:, None] + L - 1).clamp_(0, 2 * L - 2)


# ------------------------------------------------------------------------------------------------ the ring's wire
class _Ring:
    """The ring's transfers, started and waited on later (each wait bounded by the process group's timeout).

    Relayed (no mask spec): at every step each position sends the block it holds to position + 1 and receives
    position - 1's, so every block passes every position; the dK/dV accumulators follow one step behind. Direct
    (a mask spec, :meth:`RingProblem.sees`): at step i each position sends its own block straight to position + i
    and receives position - i's, and only where the receiver's queries see it; each dK/dV goes straight back to its
    block's owner, who sums them. Both move the same bytes when every block is seen; the direct exchange skips
    what no query needs (packed documents within a position's segments: no transfer at all)."""

    @classmethod
    def of(cls, problem: "RingProblem") -> "_Ring | None":
        """The wire of ``problem``'s ring (None for a ring of one, which sends nothing)."""
        return cls(problem) if problem.geometry.size > 1 else None

    def __init__(self, problem: "RingProblem"):
        g = problem.geometry
        self.group, self.rank, self.size, self.sees = problem.group, g.rank, g.size, problem.sees
        self.direct = problem.spec is not None
        self.peers = [dist.get_global_rank(self.group, position) for position in range(g.size)]

    def start(self, send: torch.Tensor, tag: int, hop: int = 1, outgoing: bool = True, incoming: bool = True):
        """Send ``send`` to position + ``hop`` and receive position - ``hop``'s tensor of the same shape (either
        left out where not ``outgoing`` / ``incoming``: ``send`` then only gives the shape). ``tag``: K/V blocks (0)
        and gradient blocks (1) travel at once in backward. On the meta device (the dry run's fake process group,
        which has no backend for it to coalesce) the two are issued one by one."""
        received = torch.empty_like(send) if incoming else None
        ops = ([(dist.isend, send, self.peers[(self.rank + hop) % self.size])] if outgoing else []) + \
            ([(dist.irecv, received, self.peers[(self.rank - hop) % self.size])] if incoming else [])
        if send.is_meta:
            works = [op(tensor, peer, self.group, tag) for op, tensor, peer in ops]
            return [w for w in works if w is not None], received
        works = dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, self.group, tag)
                                        for op, tensor, peer in ops]) if ops else []
        return works, received

    @staticmethod
    def wait(pending) -> torch.Tensor | None:
        works, received = pending
        for work in works:
            work.wait()
        return received

    def next_block(self, step: int, held: torch.Tensor, own: torch.Tensor):
        """Start bringing the K/V block of step + 1 (position rank - step - 1's): relayed, pass ``held`` on;
        direct, ``own`` to the position that sees it, and the block only if this position sees it."""
        if not self.direct:
            return self.start(held, KV)
        hop = step + 1
        return self.start(own, KV, hop, self.sees((self.rank + hop) % self.size, self.rank),
                          self.sees(self.rank, (self.rank - hop) % self.size))

    def return_gradient(self, step: int, local: torch.Tensor | None, like: torch.Tensor, pending, total):
        """Send the dK/dV of step ``step``'s block (``local``, None where this position saw none of it) on its
        way, having settled the previous step's transfer. Relayed: added to the accumulator arriving from
        position - 1 and passed on; direct: to the block's owner, while the gradient of this position's own block
        computed at position + step arrives. Returns (the pending transfer, the own block's gradient so far)."""
        if not self.direct:
            local = like.new_zeros(like.shape) if local is None else local
            return self.start(local if pending is None else self.wait(pending) + local, GRADIENTS), None
        if step == 0:
            return None, like.new_zeros(like.shape) if local is None else local
        total = self.settle(pending, total)
        holder = (self.rank + step) % self.size  # where this position's block was at this step
        return self.start(like if local is None else local, GRADIENTS, -step, local is not None,
                          self.sees(holder, self.rank)), total

    def settle(self, pending, total):
        """The own block's gradient once the last transfer is in: relayed, what arrives (the accumulator home from
        its round); direct, ``total`` plus what arrives."""
        received = self.wait(pending) if pending is not None else None
        if not self.direct:
            return received
        return total if received is None else total + received


# -------------------------------------------------------------------------------------------------- the function
class _RingAttention(torch.autograd.Function):
    """forward: ring attention of this rank's queries over every rank's K/V (module docstring); backward: the K/V
    travel again and each block's dK/dV returns to its owner."""

    @staticmethod
    def forward(ctx, problem: RingProblem, q, k, v, relative):
        groups, acc = q.shape[1] // k.shape[1], problem.acc
        ring, n, r = _Ring.of(problem), problem.geometry.size, problem.geometry.rank
        out = q.new_zeros(q.shape, dtype=acc)
        lse = q.new_full(q.shape[:-1], -math.inf, dtype=acc)
        own = kv = torch.stack((k, v)).contiguous()
        for step in range(n):
            pending = ring.next_block(step, kv, own) if step < n - 1 else None
            src = (r - step) % n
            for piece in problem.pieces(src):
                at = (piece.batch, slice(None), piece.rows)
                kb, vb = (_expand_kv(t[piece.batch, :, piece.cols], groups) for t in kv)
                o_b, lse_b = piece_forward(q[at], kb, vb, problem.scale, piece, relative,
                                           problem.dropout, problem.seed + piece.tag, problem.softcap)
                out[at], lse[at] = _merge(out[at], lse[at], o_b, lse_b)
            if pending is not None:
                kv = ring.wait(pending)
        ctx.problem, ctx.groups = problem, groups
        ctx.save_for_backward(q, k, v, out, lse, relative)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        problem, groups = ctx.problem, ctx.groups
        q, k, v, out, lse, relative = ctx.saved_tensors
        acc = out.dtype
        grad_out = grad_out.to(acc)
        ring, n, r = _Ring.of(problem), problem.geometry.size, problem.geometry.rank
        own = kv = torch.stack((k, v)).contiguous()
        like = torch.empty((2, *k.shape), dtype=acc, device=k.device)  # a dK/dV block's shape
        dq = torch.zeros_like(q, dtype=acc)
        drel = None if relative is None else torch.zeros_like(relative, dtype=acc)
        dkv_pending = dkv = None
        for step in range(n):
            pending = ring.next_block(step, kv, own) if step < n - 1 else None
            src = (r - step) % n
            local = None
            for piece in problem.pieces(src):
                at, cols = (piece.batch, slice(None), piece.rows), (piece.batch, slice(None), piece.cols)
                dq_b, dk_b, dv_b, drel_b = piece_backward(
                    grad_out[at], q[at], _expand_kv(kv[0][cols], groups), _expand_kv(kv[1][cols], groups), out[at],
                    lse[at], problem.scale, piece, relative, problem.dropout, problem.seed + piece.tag, problem.softcap)
                dq[at] += dq_b
                local = torch.zeros_like(like) if local is None else local
                local[0][cols] += _fold_kv(dk_b, groups)
                local[1][cols] += _fold_kv(dv_b, groups)
                if drel_b is not None:
                    drel += drel_b
            if ring is None:
                dkv = torch.zeros_like(like) if local is None else local
            else:  # on to the block's next holder (relayed) or straight to its owner (direct)
                dkv_pending, dkv = ring.return_gradient(step, local, like, dkv_pending, dkv)
            if pending is not None:
                kv = ring.wait(pending)
        dkv = ring.settle(dkv_pending, dkv) if ring is not None else dkv
        return (None, dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None if drel is None else drel.to(relative.dtype))


def _merge(out, lse, o_b, lse_b):
    """The running (output, log-sum-exp) merged with a piece's; a row no piece lets see any key stays 0."""
    new = torch.logaddexp(lse, lse_b)
    base = _finite(new)
    return out * torch.exp(lse - base).unsqueeze(-1) + o_b * torch.exp(lse_b - base).unsqueeze(-1), new


def ring_attention(problem: RingProblem, q, k, v, relative=None) -> torch.Tensor:
    """Exact attention of this rank's queries q [b, hq, c, d] over the whole ring's keys and values k, v
    [b, hk, c, d]; ``relative``: a relative position bias [1, hq, 1, 2L - 1] or None. Returns [b, hq, c, d]."""
    return _RingAttention.apply(problem, q, k, v, relative)


__all__ = ["RingLayout", "RingGeometry", "CrossGeometry", "RingProblem", "Piece", "ring_attention", "piece_forward", "piece_backward",
           "ACC_DTYPES"]
