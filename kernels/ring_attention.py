"""Ring attention (context parallelism): exact attention over a sequence split into ``n`` chunks across the sp
ranks, without any rank holding the whole sequence's keys, values or scores.

Shapes: rank ``r`` holds the queries, keys and values of positions ``[r*c, (r+1)*c)`` of the padded sequence
(``c = ceil(L / n)``; positions >= L are padding the stack entry added): q [b, hq, c, d], k and v [b, hk, c, d]
(``hq`` a multiple of ``hk``: grouped KV heads). Forward: n steps; at step i this rank holds the K/V block of rank
``src = (r - i) mod n`` and computes, for its queries against that block, the block's output and log-sum-exp
(scores ``s = q k^T * scale + bias + mask``, ``lse_b = logsumexp(s)``, ``o_b = softmax(s) v``), merging them into the
running result in fp32 (fp64 for fp64 inputs): ``lse = logaddexp(lse, lse_b)``, ``o = o e^(lse_old - lse) + o_b
e^(lse_b - lse)``. The K/V block travels to rank ``r + 1`` (one send, one receive per step) while this rank computes
with it, so the transfer runs under the block's compute. Backward (the flash-attention recurrence, recomputing each
block's probabilities from the saved global ``lse``): ``p = e^(s - lse)``, ``dv += p^T dO``, ``dp = dO v^T``, ``ds =
p (dp - rowsum(dO o))``, ``dq += ds k scale``, ``dk += ds^T q scale``; the K/V blocks circulate again, and each
block's dK/dV accumulator travels with it one step behind, arriving back at its owner after n hops.

What a block's scores see, each from global positions (exact for any length and any split):

* the model's mask as HF built it for the full sequence ([b, 1, L | 1, L], boolean or additive): this rank's rows,
  the block's columns; padding columns are -inf, padding rows see every real key (their output is cut off later);
* causality (``is_causal`` with no mask, HF's SDPA rule): key position > query position is -inf; blocks entirely in
  the future are skipped, as are blocks every row of which the mask hides and blocks of padding only;
* a relative position bias (T5) given as one value per head and relative distance, ``[1, h, 1, 2L - 1]`` (entry
  ``L - 1 + (k - q)``): the block's ``[h, c, c]`` bias is gathered from it and its gradient scattered back, so no
  rank ever holds an ``[h, L, L]`` slab;
* attention dropout: the block's mask is drawn from a generator seeded by a per-forward seed (drawn from the
  default generator, which is this rank's stream inside the module) and the block index, and drawn again in
  backward. Same law as the unsharded model's dropout, not the same masks (like the other sequence-parallel modes).

Block kernels: on CPU, without a bias gradient or dropout, ATen's flash-attention CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp, and its backward, which takes the
global output and log-sum-exp); otherwise the explicit math above (float64-exact, any device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardlib.parallel.collectives import all_to_all

from .attention import _register_wrapper, inner_attention, to_heads

ACC_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
KV, GRADIENTS = 0, 1  # message tags


@dataclass
class RingGeometry:
    """Where this rank's chunk and every K/V block lie in the padded sequence of true length ``length``."""

    rank: int
    size: int
    chunk: int  # c: positions per rank (the padded sequence is size * chunk long)
    length: int  # L: the true length

    def positions(self, block: int, device) -> torch.Tensor:
        return torch.arange(block * self.chunk, (block + 1) * self.chunk, device=device)

    def padding_only(self, block: int) -> bool:
        return block * self.chunk >= self.length


@dataclass
class BlockScores:
    """What the scores of (this rank's queries, K/V block ``src``) add to ``q k^T * scale``: the additive mask
    (no gradient) and the relative bias (gradient to ``relative``)."""

    mask: torch.Tensor | None  # [b | 1, 1 | h, c, c] additive, in the accumulation dtype
    bias_index: torch.Tensor | None  # [c, c] long: entry of ``relative`` for each (query, key)


# ------------------------------------------------------------------------------------------------ the ring's wire
class _Ring:
    """Point-to-point sends to rank + 1 and receives from rank - 1 of the sp group, started and waited on later
    (each wait bounded by the process group's timeout)."""

    def __init__(self, group, geometry: RingGeometry):
        self.group, self.g = group, geometry
        self.next = dist.get_global_rank(group, (geometry.rank + 1) % geometry.size)
        self.prev = dist.get_global_rank(group, (geometry.rank - 1) % geometry.size)

    def start(self, send: torch.Tensor, tag: int):
        """Send ``send`` on and receive the previous rank's tensor of the same shape. ``tag``: K/V blocks (0) and
        gradient blocks (1) travel at once in backward."""
        received = torch.empty_like(send)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, received, self.prev, self.group, tag)])
        return works, received

    @staticmethod
    def wait(pending) -> torch.Tensor:
        works, received = pending
        for work in works:
            work.wait()
        return received


# ------------------------------------------------------------------------------------------------- block kernels
def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, hk, c, d] -> [b, hk * groups, c, d], query head i reading K/V head i // groups (HF's ``repeat_kv``)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold_kv(grad: torch.Tensor, groups: int) -> torch.Tensor:
    return grad if groups == 1 else grad.unflatten(1, (-1, groups)).sum(2)


def _block_scores(q, k, scale, extra: BlockScores, relative):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if extra.bias_index is not None:
        s = s + relative[0, :, 0][:, extra.bias_index]  # [h, c, c]
    if extra.mask is not None:
        s = s + extra.mask
    return s


def _dropout_keep(shape, p: float, seed: int, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device) >= p


def _dropout_scale(p: torch.Tensor, dropout: float, seed: int) -> torch.Tensor:
    """The block's keep mask as 0 or 1 / (1 - dropout) in ``p``'s dtype (the same in forward and backward)."""
    return _dropout_keep(p.shape, dropout, seed, p.device).to(p.dtype) / (1 - dropout)


def _kernel_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The block's additive mask in the kernel's input dtype; finite where the accumulation dtype's ``finfo.min``
    would overflow (fp16), so a row still sums over what its mask hides, as in the accumulation dtype."""
    if mask is None or mask.dtype == dtype:
        return mask
    return mask.clamp(min=torch.finfo(dtype).min).to(dtype)


def _use_flash(q, extra: BlockScores, dropout: float) -> bool:
    return q.device.type == "cpu" and extra.bias_index is None and not dropout


def block_forward(q, k, v, scale, extra: BlockScores, relative, dropout: float, seed: int):
    """One block's (output [b, h, c, d] in the accumulation dtype, log-sum-exp [b, h, c] fp32/fp64)."""
    acc = ACC_DTYPES.get(q.dtype, q.dtype)
    if _use_flash(q, extra, dropout):
        mask = _kernel_mask(extra.mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                               scale=scale)
        return out.to(acc), lse.to(acc)
    s = _block_scores(q.to(acc), k.to(acc), scale, extra, relative)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    if dropout:
        p = p * _dropout_scale(p, dropout, seed)
    return torch.matmul(p, v.to(acc)), lse


def block_backward(grad_out, q, k, v, out, lse, scale, extra: BlockScores, relative, dropout: float, seed: int):
    """Gradients of one block's contribution given the global output and log-sum-exp: (dq, dk, dv, d relative or
    None), in the accumulation dtype."""
    acc = ACC_DTYPES.get(q.dtype, q.dtype)
    if _use_flash(q, extra, dropout):
        mask = _kernel_mask(extra.mask, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse.float() if q.dtype in ACC_DTYPES else lse,
            0.0, False, attn_mask=mask, scale=scale)
        return dq.to(acc), dk.to(acc), dv.to(acc), None
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    p = torch.exp(_block_scores(q, k, scale, extra, relative) - _finite(lse).unsqueeze(-1))
    dp = torch.matmul(grad_out, v.transpose(-1, -2))
    if dropout:
        keep = _dropout_scale(p, dropout, seed)
        dv = torch.matmul((p * keep).transpose(-1, -2), grad_out)
        dp = dp * keep
    else:
        dv = torch.matmul(p.transpose(-1, -2), grad_out)
    ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
    drel = None
    if extra.bias_index is not None:
        per_head = ds.sum(0)  # [h, c, c]: the bias is shared by the batch
        drel = torch.zeros_like(relative, dtype=acc)
        drel[0, :, 0].index_add_(1, extra.bias_index.flatten(), per_head.flatten(1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv, drel


# -------------------------------------------------------------------------------------------------- the function
@dataclass
class RingProblem:
    """Everything but the tensors: the group and geometry, the scale, what the blocks' scores see, the dropout."""

    group: object
    geometry: RingGeometry
    scale: float
    acc: torch.dtype  # the accumulation dtype (fp32 for half inputs)
    mask: torch.Tensor | None = None  # this rank's rows x all padded columns, additive (acc dtype), or None
    visible: list[bool] | None = None  # per block: whether the mask lets any row of this rank see any of its keys
    causal: bool = False
    relative_length: int = 0  # L when a relative bias vector [1, h, 1, 2L - 1] is given
    dropout: float = 0.0
    seed: int = 0

    def block(self, src: int, device) -> BlockScores | None:
        """The extra scores of block ``src``, or None where the block contributes nothing (skipped)."""
        g = self.geometry
        if g.padding_only(src) or (self.causal and src > g.rank) or (self.visible is not None
                                                                       and not self.visible[src]):
            return None
        cols = g.positions(src, device)
        mask = None if self.mask is None else self.mask[..., src * g.chunk:(src + 1) * g.chunk]
        padded, diagonal = bool(cols[-1] >= g.length), self.causal and src == g.rank
        if padded or diagonal:
            hidden = (cols >= g.length)[None, :].expand(g.chunk, -1)
            if diagonal:
                hidden = hidden | (cols[None, :] > g.positions(g.rank, device)[:, None])
            extra = torch.zeros(hidden.shape, dtype=self.acc, device=device).masked_fill_(hidden, -math.inf)
            mask = extra if mask is None else mask + extra
        index = None
        if self.relative_length:
            distance = cols[None, :] - g.positions(g.rank, device)[:, None] + self.relative_length - 1
            index = distance.clamp_(0, 2 * self.relative_length - 2)
        return BlockScores(mask=mask, bias_index=index)


class _RingAttention(torch.autograd.Function):
    """forward: ring attention of this rank's queries over every rank's K/V (module docstring); backward: the K/V
    circulate again and each block's dK/dV returns to its owner."""

    @staticmethod
    def forward(ctx, problem: RingProblem, q, k, v, relative):
        groups = q.shape[1] // k.shape[1]
        ring = _Ring(problem.group, problem.geometry)
        kv = torch.stack((k, v)).contiguous()
        out = lse = None
        n, r = problem.geometry.size, problem.geometry.rank
        for step in range(n):
            pending = ring.start(kv, KV) if step < n - 1 else None
            src = (r - step) % n
            extra = problem.block(src, q.device)
            if extra is not None:
                o_b, lse_b = block_forward(q, _expand_kv(kv[0], groups), _expand_kv(kv[1], groups), problem.scale,
                                           extra, relative, problem.dropout, problem.seed + src)
                out, lse = _merge(out, lse, o_b, lse_b)
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
        ring = _Ring(problem.group, problem.geometry)
        n, r = problem.geometry.size, problem.geometry.rank
        kv = torch.stack((k, v)).contiguous()
        dq = torch.zeros_like(q, dtype=acc)
        drel = None if relative is None else torch.zeros_like(relative, dtype=acc)
        dkv_pending = None
        for step in range(n):
            pending = ring.start(kv, KV) if step < n - 1 else None
            src = (r - step) % n
            extra = problem.block(src, q.device)
            local = None
            if extra is not None:
                dq_b, dk_b, dv_b, drel_b = block_backward(
                    grad_out, q, _expand_kv(kv[0], groups), _expand_kv(kv[1], groups), out, lse, problem.scale,
                    extra, relative, problem.dropout, problem.seed + src)
                dq += dq_b
                local = torch.stack((_fold_kv(dk_b, groups), _fold_kv(dv_b, groups)))
                if drel_b is not None:
                    drel += drel_b
            dkv = ring.wait(dkv_pending) if dkv_pending is not None else None
            dkv = local if dkv is None else (dkv if local is None else dkv + local)
            if dkv is None:
                dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
            if n > 1:  # on to the next holder of this block (at the last step: its owner)
                dkv_pending = ring.start(dkv.contiguous(), GRADIENTS)
            if pending is not None:
                kv = ring.wait(pending)
        dkv = ring.wait(dkv_pending) if n > 1 else dkv
        return (None, dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None if drel is None else drel.to(relative.dtype))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that see no key at all (-inf) at 0, so that their weights are exp(-inf) = 0, not NaN."""
    return lse.masked_fill(lse == -math.inf, 0)


def _merge(out, lse, o_b, lse_b):
    """The running (output, log-sum-exp) merged with a block's; a row no block lets see any key stays 0."""
    if out is None:
        return o_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    base = _finite(new)
    out = out * torch.exp(lse - base).unsqueeze(-1) + o_b * torch.exp(lse_b - base).unsqueeze(-1)
    return out, new


def ring_attention(problem: RingProblem, q, k, v, relative=None) -> torch.Tensor:
    """Exact attention of this rank's queries q [b, hq, c, d] over the whole ring's keys and values k, v
    [b, hk, c, d]; ``relative``: a relative position bias [1, hq, 1, 2L - 1] or None. Returns [b, hq, c, d]."""
    return _RingAttention.apply(problem, q, k, v, relative)


# ------------------------------------------------------------------------- transformers' attention interface
RING_PREFIX = "shardlib_ring_"
CONTEXT_ATTR = "_shardlib_ring"
#: keyword arguments of HF attention functions that change the math in ways the ring does not compute
UNSUPPORTED = ("sliding_window", "softcap", "s_aux")


@dataclass
class UlyssesGroup:
    """Ulysses x ring: the ranks that exchange sequence for heads around each ring position (consecutive chunks)."""

    group: object
    rank: int
    size: int


@dataclass
class RingContext:
    """What the ring attention of one attention module needs: the sp group, this rank and the group size, the
    sequence stream of its stack (``length``: the true length of the current forward), the inner implementation
    (``base``: "sdpa" or "eager", whose mask semantics apply), whether keys and values come from another,
    replicated sequence (cross-attention), whether ``position_bias`` is a relative bias vector (T5), and the
    stack's mask cache (every layer of a forward gets the same mask). Ulysses x ring: ``group``, ``rank`` and
    ``size`` are the ring's, ``ulysses`` the Ulysses group inside each ring position."""

    group: object
    rank: int
    size: int
    stream: object  # shardlib.sharding.sequence.SequenceStream
    implementation: str
    base: str
    cross: bool = False
    relative: bool = False
    masks: "MaskCache | None" = None
    ulysses: UlyssesGroup | None = None


class MaskCache:
    """The last mask converted for a stack: (the HF mask it came from, the true length) -> (rows, visible)."""

    def __init__(self):
        self.key, self.value = None, None

    def get(self, mask, length, make):
        key = (id(mask), mask.shape, length)
        if self.key != key or self.value[0] is not mask:
            self.key, self.value = key, (mask, make())
        return self.value[1]


def _rows(mask: torch.Tensor, g: RingGeometry) -> torch.Tensor:
    """The rows of this rank's queries of a mask [..., L | 1, Lk] (padding rows see every key)."""
    if mask.shape[-2] == 1:
        return mask
    rows = mask[..., g.rank * g.chunk:(g.rank + 1) * g.chunk, :]
    missing = g.chunk - rows.shape[-2]
    if missing:
        fill = rows.new_ones if rows.dtype == torch.bool else rows.new_zeros
        rows = torch.cat((rows, fill((*rows.shape[:-2], missing, rows.shape[-1]))), dim=-2)
    return rows


def _self_mask(mask: torch.Tensor, g: RingGeometry, acc: torch.dtype):
    """This rank's rows of a self-attention mask over all padded columns, additive in ``acc`` (a hidden entry of
    a boolean mask is ``finfo.min``, as HF's eager masks; padding columns -inf), and per block whether any row sees
    any key through it (None when some row sees no key at all: then no block is skipped, as the reference averages
    over every key of such a row)."""
    rows = _rows(mask, g)
    if rows.dtype == torch.bool:
        seen = rows
        rows = torch.zeros(rows.shape, dtype=acc, device=rows.device).masked_fill_(~seen, torch.finfo(acc).min)
    else:
        seen = rows > torch.finfo(rows.dtype).min / 2
        rows = rows.clamp(min=torch.finfo(acc).min).to(acc)  # finite: HF's float64 finfo.min would be -inf in fp32
    extra = g.size * g.chunk - rows.shape[-1]
    if extra:
        rows = torch.nn.functional.pad(rows, (0, extra), value=-math.inf)
        seen = torch.nn.functional.pad(seen, (0, extra), value=False)
    if not bool(seen.any(-1).all()):
        return rows, None
    per_block = seen.unflatten(-1, (g.size, g.chunk)).any(-1)  # [..., rows, n]
    return rows, per_block.flatten(0, -2).any(0).tolist()


def ring_attention_forward(module, query, key, value, attention_mask, *, position_bias=None, **kwargs):
    """HF attention function (registered as ``shardlib_ring_<inner>``): q [b, h, c, d] of this rank's chunk;
    self-attention k, v the same chunk's (the ring brings the others), cross-attention k, v of the whole replicated
    other sequence. Ulysses x ring: q, k, v first exchange sequence for heads within the rank's Ulysses group, the
    ring then runs over the group's joint chunk for its share of the heads, and the output is exchanged back.
    Returns ([b, c, h, d], None); attention weights are never materialised."""
    ctx: RingContext = module.__dict__[CONTEXT_ATTR]
    if ctx.stream.unsplit:  # incremental decoding: the whole sequence on every rank
        return inner_attention(module, ctx.implementation)(module, query, key, value, attention_mask,
                                                           position_bias=position_bias, **kwargs)
    unsupported = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported:
        raise RuntimeError(f"{type(module).__name__}: ring attention does not compute {', '.join(unsupported)}")
    if not ctx.cross and key.shape[2] != query.shape[2]:
        raise RuntimeError(f"{type(module).__name__}: ring self-attention got query {tuple(query.shape)} and key "
                           f"{tuple(key.shape)} (a key/value cache is not supported)")
    u = ctx.ulysses
    if u is not None:
        query, key, value, position_bias = _ulysses_in(module, u, ctx.cross, query, key, value, position_bias)
    g = RingGeometry(ctx.rank, ctx.size, query.shape[2], ctx.stream.length)
    attend = _cross_attention if ctx.cross else _self_attention
    out = attend(module, ctx, g, query, key, value, attention_mask, position_bias=position_bias, **kwargs)
    if u is not None:  # [b, u*c, h/u, d] -> [b, c, h, d]
        out = all_to_all((out,), u.group, scatter_dim=1, gather_dim=2)[0]
    return out, None


def _ulysses_in(module, u: "UlyssesGroup", cross: bool, query, key, value, position_bias):
    """Sequence for heads within the Ulysses group: q (self-attention: k and v too) [b, h, c, d] -> [b, h/u, u*c,
    d]; cross-attention keeps its share of the replicated k and v heads; a relative bias its share of the heads."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % u.size or kv_heads % u.size:
        raise RuntimeError(f"{type(module).__name__}: {heads} query and {kv_heads} key/value heads do not split over "
                           f"the {u.size} ranks of a Ulysses group")
    if cross:
        share = kv_heads // u.size
        key, value = (t.narrow(1, u.rank * share, share) for t in (key, value))
        return to_heads(query, u.group, None), key, value, None  # T5's cross-attention bias is zeros
    if kv_heads == heads:
        query, key, value = to_heads((query, key, value), u.group, None)
    else:
        query, (key, value) = to_heads(query, u.group, None), to_heads((key, value), u.group, None)
    if position_bias is not None:
        share = heads // u.size
        position_bias = position_bias.narrow(1, u.rank * share, share)
    return query, key, value, position_bias


def _self_attention(module, ctx: RingContext, g: RingGeometry, query, key, value, attention_mask, *,
                    dropout: float = 0.0, scaling: float | None = None, position_bias=None,
                    is_causal: bool | None = None, **kwargs):
    acc = ACC_DTYPES.get(query.dtype, query.dtype)
    problem = RingProblem(ctx.group, g, query.shape[-1] ** -0.5 if scaling is None else scaling, acc)
    if attention_mask is not None:
        problem.mask, problem.visible = ctx.masks.get(attention_mask, g.length,
                                                      lambda: _self_mask(attention_mask, g, acc))
    elif ctx.base != "eager" and g.length > 1:  # HF's SDPA rule: no mask means causal unless the module says not
        problem.causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    relative = None
    if position_bias is not None:
        if not ctx.relative or position_bias.shape[-1] != 2 * g.length - 1:
            raise RuntimeError(f"{type(module).__name__}: ring attention got a position bias "
                               f"{tuple(position_bias.shape)}; it computes only relative biases given per distance "
                               f"([1, h, 1, {2 * g.length - 1}], AttentionSite.bias_method)")
        relative, problem.relative_length = position_bias, g.length
    if dropout and module.training:
        problem.dropout, problem.seed = dropout, int(torch.randint(2 ** 62, ()))
    return ring_attention(problem, query, key, value, relative).transpose(1, 2).contiguous()


def _cross_attention(module, ctx: RingContext, g: RingGeometry, query, key, value, attention_mask, **kwargs):
    """Cross-attention: this rank's queries against the whole other sequence (replicated, entered into the sp
    region once so that its gradient, from this rank's queries only, is summed): the inner implementation with the
    mask's rows of this chunk."""
    mask = None if attention_mask is None else _rows(attention_mask, g)
    return inner_attention(module, ctx.implementation)(module, query, key, value, mask, **kwargs)[0]


def relative_bias_vector(compute_bias, stream):
    """Wrap a module's ``compute_bias(query_length, key_length, ..., past_seen_tokens=0)`` (T5's relative position
    bias, called with the local chunk's lengths) to return the bias of every relative distance of the whole
    sequence instead, [1, h, 1, 2L - 1] (entry ``L - 1 + k - q``): the model's own lookup, asked for one query at
    position L - 1 against keys 0 .. 2L - 2. It travels to the later layers as T5 passes its bias on."""

    def per_distance(query_length, key_length, *args, past_seen_tokens=0, **kwargs):
        if stream.unsplit:
            return compute_bias(query_length, key_length, *args, past_seen_tokens=past_seen_tokens, **kwargs)
        if past_seen_tokens:
            owner = getattr(compute_bias, "__self__", None)
            where = f"{type(owner).__name__}: " if owner is not None else ""
            raise RuntimeError(f"{where}ring attention does not support incremental decoding (KV cache): "
                               f"{int(past_seen_tokens)} tokens already seen")
        length = stream.length
        return compute_bias(1, 2 * length - 1, *args, past_seen_tokens=length - 1, **kwargs)

    return per_distance


def ring_name(implementation: str) -> str:
    """Register (once) and return the attention-interface name of ring attention around ``implementation``; its
    mask function is the inner implementation's, so masks are built as HF builds them."""
    return _register_wrapper(RING_PREFIX + implementation, ring_attention_forward, implementation)


__all__ = ["ring_attention", "ring_attention_forward", "ring_name", "relative_bias_vector", "RingContext", "UlyssesGroup",
           "RingProblem", "RingGeometry", "MaskCache", "CONTEXT_ATTR", "RING_PREFIX"]
