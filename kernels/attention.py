"""Attention through transformers' attention interface: the implementation switch and all-to-all (Ulysses)
sequence-parallel attention. No HF forward is copied: HF's attention modules compute q, k and v and call the
function registered under ``config._attn_implementation``; shardlib only chooses or wraps that function.

Implementations (``shard(..., kernels=Kernels(attention=...))``; the default None keeps the model's own setting,
which transformers makes SDPA unless ``attn_implementation`` said otherwise):

* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` (HF's ``sdpa_attention_forward``). For T5 HF
  folds the relative position bias into the additive mask, passes ``scale=1.0`` (T5 does not scale q.k) and
  dropout only in training. Under tensor parallelism each rank runs it on its local heads.
* ``"eager"``: the model's own ``eager_attention_forward`` (matmul, softmax, dropout, matmul): the reference.

A model may also come with any other function registered in transformers' ``AttentionInterface`` (a custom function,
one from a kernels package): shardlib keeps it and wraps it like the two above. HF builds each implementation's
mask with the function registered under the same name in ``AttentionMaskInterface``, and gives an implementation
with none registered no mask at all; a wrapper's name gets exactly the inner implementation's mask entry (or none),
so the wrapped function receives the mask it would receive unsharded.

Global registries: HF dispatches by name through the config, so a wrapper must be registered under a name
(``shardlib_local_rng_<inner>``, ``shardlib_all_to_all_<inner>``). Those names are the one change a successful
``shard()`` makes outside the model: only shardlib's own prefixes, added and never overwriting a name someone else
registered, each name's function a pure function of the name (it reads its state from the module it is called
for), so one registration serves every model and no other model's behaviour changes; a failed ``shard()`` removes
what it added (:func:`registries`, :mod:`shardlib.sharding.transaction`).

All-to-all sequence parallelism (``sequence_parallel="all_to_all"``, DeepSpeed-Ulysses): inside the layer stacks
every activation is sharded along the sequence over the mesh's ``sp`` dimension (n ranks): q, k, v arrive as
[b, h, L/n, d] for this rank's L/n positions and all h local heads. One all-to-all (q, k and v in one message,
received as three tensors) turns them into [b, h/n, L, d]: all positions, 1/n of the heads, so attention itself
is exact. The output [b, L, h/n, d] goes back with a second all-to-all to [b, L/n, h, d]. Backward: the two
inverse all-to-alls, and the output exchanged again for the output projection's saved input (see
``shardlib.sharding.sequence.SequenceParallel.recomputable``).
Sequences n does not divide are padded at the stack entry (``shardlib.sharding.sequence``); the padding is cut off after
the first all-to-all, so attention and the mask see exactly the true length, and restored before the second.
Cross-attention (BERT decoders, T5's decoder): keys and values come from the replicated encoder sequence, so only
q and the output are exchanged and each rank keeps its h/n heads of k and v; the encoder states enter the sp
region through ``copy_to_tp`` on the sp group (backward: their gradient, from h/n heads per rank, is summed).
T5's relative position bias is computed for the whole sequence ([1, h, L, L], each rank uses its heads' slice).
"""

from __future__ import annotations

import copy
import functools
import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from shardlib.parallel.collectives import all_to_all, all_to_all_single
from shardlib.parallel.random import LOCAL_STREAM_ATTR, local_dropout

from .mask_spec import dense_builder, spec_builder

IMPLEMENTATIONS = ("sdpa", "eager")
#: ``Kernels(attention=...)``: an implementation, or "blocks" (masks as data, :mod:`.mask_spec`, around either)
CHOICES = (*IMPLEMENTATIONS, "blocks")
ALL_TO_ALL_PREFIX = "shardlib_all_to_all_"
LOCAL_RNG_PREFIX = "shardlib_local_rng_"
BLOCKS_PREFIX = "shardlib_blocks_"
CONTEXT_ATTR = "_shardlib_all_to_all"


def attention_problems(implementation: str | None) -> list[str]:
    if implementation is not None and implementation not in CHOICES:
        return [f"attention implementation {implementation!r} is not one of {', '.join(CHOICES)}"]
    return []


def base_implementation(implementation: str | None) -> str:
    """The implementation under shardlib's per-rank dropout and block wrappers (None: transformers' default,
    SDPA), whose mask semantics apply."""
    implementation = implementation or "sdpa"
    for prefix in (LOCAL_RNG_PREFIX, BLOCKS_PREFIX):  # the per-rank dropout wrapper goes around the blocks one
        implementation = implementation.removeprefix(prefix)
    return implementation


def registered_problems(where: str, implementation: str | None) -> list[str]:
    """Why the attention implementation a model runs (``where`` names the model) cannot be wrapped: it must be
    "eager" or a name registered in transformers' ``AttentionInterface``."""
    if implementation is None or implementation == "eager" or implementation in ALL_ATTENTION_FUNCTIONS:
        return []
    return [f"{where}: attention implementation {implementation!r} is not registered in transformers' "
            "AttentionInterface (AttentionInterface.register(name, function) before shard())"]


def registries() -> tuple[dict, ...]:
    """The global name -> function mappings that wrapping an implementation may add shardlib's names to (the
    attention functions and the mask functions, class-wide and of the shared instances)."""
    return (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping,
            ALL_ATTENTION_FUNCTIONS._local_mapping, ALL_MASK_ATTENTION_FUNCTIONS._local_mapping)


def _register_wrapper(name: str, function, implementation: str, *, masks_as_data: bool = False) -> str:
    """Register ``function`` as attention implementation ``name`` wrapping ``implementation`` (once: the function is
    a pure function of the name), its mask entry mirroring the inner one's: the same mask function, or none where
    the inner implementation has none (HF then passes no mask, to the inner function and to the wrapper alike).
    ``masks_as_data``: ``function`` takes :class:`~shardlib.kernels.mask_spec.MaskSpec` masks: its entry describes
    masks as data where it can and builds the inner one's dense mask elsewhere."""
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, function)
    mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(implementation)
    if mask is not None and masks_as_data:
        mask = spec_builder(dense_builder(mask))
    if mask is not None and ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name) is not mask:
        AttentionMaskInterface.register(name, mask)
    return name


def own_configs(model: nn.Module) -> None:
    """Give ``model`` its own copy of every config object its modules hold. Switching the attention implementation
    writes to the config (``set_attn_implementation``), and a config is often shared: two models built from one
    config object, or the caller's. A sharded model must change nothing outside itself."""
    copies: dict[int, object] = {}
    for module in model.modules():
        config = module.__dict__.get("config")
        if isinstance(config, PreTrainedConfig):
            if id(config) not in copies:
                copies[id(config)] = copy.deepcopy(config)
            module.config = copies[id(config)]


def set_attention(model: nn.Module, implementation: str | None) -> None:
    """Make every attention module of ``model`` call ``implementation`` (HF's own switch; None: leave it)."""
    if implementation is not None and model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)


def inner_attention(module: nn.Module, implementation: str):
    """The function HF would call for ``implementation`` in ``module`` (eager: the model file's own)."""
    if implementation == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


# ------------------------------------------------------------------------------ per-rank dropout under compile
def call_attention(module: nn.Module, implementation: str, query, key, value, attention_mask, **kwargs):
    """``implementation``'s attention for ``module``. One case differs: compiled training with attention dropout on
    a module whose heads are sharded (``LocalRNG`` left its stream on it): the probabilities are computed
    explicitly and dropped with this rank's mask (:func:`_stream_dropout_attention`), since compiled code cannot
    swap in the per-rank generator as eager mode does around the fused kernel. A custom registered function is
    called as it is (its math is its own): compiled, its dropout draws from the default generator, the same on every
    TP rank."""
    stream = module.__dict__.get(LOCAL_STREAM_ATTR)
    if kwargs.get("dropout") and stream is not None and implementation in IMPLEMENTATIONS \
            and torch.compiler.is_compiling():
        tracker, name = stream
        return _stream_dropout_attention(module, implementation, query, key, value, attention_mask,
                                         ranks=tracker.ranks[name], **kwargs)
    return inner_attention(module, implementation)(module, query, key, value, attention_mask, **kwargs)


def _stream_dropout_attention(module, implementation, query, key, value, attention_mask, *, ranks,
                              dropout: float, scaling: float | None = None, position_bias=None,
                              is_causal: bool | None = None, **kwargs):
    """softmax(q k^T * scaling + position bias + mask) with this rank's dropout mask (``ranks`` = (index, count),
    :func:`shardlib.parallel.random.local_dropout`), times v: the math of the
    model files' ``eager_attention_forward`` (BERT, ViT, T5 share it), taking the mask as the implementation built
    it (SDPA's: boolean, or None for a causal module, which SDPA then masks by ``is_causal``)."""
    scores = torch.matmul(query, key.transpose(2, 3)) * (query.size(-1) ** -0.5 if scaling is None else scaling)
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is None and implementation != "eager" and query.shape[2] > 1:
        if is_causal if is_causal is not None else getattr(module, "is_causal", True):
            q, k = query.shape[2], key.shape[2]
            attention_mask = torch.arange(q, device=query.device)[:, None] >= torch.arange(k, device=query.device)
    if attention_mask is not None:
        scores = (scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
                  if attention_mask.dtype == torch.bool else scores + attention_mask)
    probs = local_dropout(torch.softmax(scores, dim=-1), dropout, *ranks)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def local_rng_name(implementation: str) -> str:
    """Register (once) and return the attention-interface name of ``implementation`` (sdpa, eager or any registered
    function) run through :func:`call_attention` (masks built as HF builds them for the implementation)."""
    if implementation.startswith(LOCAL_RNG_PREFIX):
        return implementation
    return _register_wrapper(LOCAL_RNG_PREFIX + implementation,
                             functools.partial(_local_rng_attention, implementation=implementation), implementation)


def _local_rng_attention(module, query, key, value, attention_mask, *, implementation: str, **kwargs):
    return call_attention(module, implementation, query, key, value, attention_mask, **kwargs)


@dataclass
class AllToAllContext:
    """What the all-to-all attention of one attention module needs: the sp group and this rank in it, the sequence
    stream of its stack (whose ``length`` is the true, unpadded sequence length of the current forward), the inner
    implementation, and whether keys and values come from another, replicated sequence (cross-attention)."""

    group: object
    rank: int
    stream: object  # shardlib.sharding.sequence.SequenceStream
    implementation: str
    cross: bool = False


def all_to_all_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask, **kwargs):
    """Ulysses attention (see module docstring). q: [b, h, L/n, d] (L/n = this rank's padded chunk); k, v the same
    for self-attention (or fewer, grouped heads [b, hk, L/n, d]: each rank takes hk/n of them), [b, hk, Lk, d] of a
    replicated sequence for cross-attention (no exchange: this rank keeps its hk/n heads). Returns ([b, L/n, h, d],
    None) like HF's attention functions (weights are not gathered)."""
    ctx: AllToAllContext = module.__dict__[CONTEXT_ATTR]
    if ctx.stream.unsplit:  # incremental decoding: the whole sequence on every rank
        return inner_attention(module, ctx.implementation)(module, query, key, value, attention_mask, **kwargs)
    length, heads = ctx.stream.length, query.shape[1]
    share = heads // ctx.stream.sp.size
    if ctx.cross:
        query = to_heads(query, ctx.group, length)
        kv_share = key.shape[1] // ctx.stream.sp.size  # grouped K/V heads: this rank's queries' share of them
        key, value = (t.narrow(1, ctx.rank * kv_share, kv_share) for t in (key, value))
    else:
        if key.shape[2] != query.shape[2]:  # grouped K/V heads may be fewer; each rank takes 1/n of both
            raise RuntimeError(f"{type(module).__name__}: all-to-all self-attention got query {tuple(query.shape)} "
                               f"and key {tuple(key.shape)} (a key/value cache is not supported)")
        query, key, value = to_heads((query, key, value), ctx.group, length)
    bias = kwargs.get("position_bias")
    if bias is not None:
        # T5: the self-attention bias covers the whole sequence (``whole_sequence_bias``): keep this rank's heads;
        # cross-attention has no relative bias (T5 passes zeros shaped by the local query chunk): drop it
        kwargs["position_bias"] = None if ctx.cross else (
            bias.narrow(1, ctx.rank * share, share) if bias.shape[1] == heads else bias)
    # ctx.implementation is the local-rng wrapper when the heads have a per-rank stream (it handles compiled dropout)
    out, _ = inner_attention(module, ctx.implementation)(module, query, key, value, attention_mask, **kwargs)
    sp = ctx.stream.sp
    exchanged = all_to_all((sp.pad(out),), ctx.group, scatter_dim=1, gather_dim=2)[0]  # [b, L, h/n, d] padded
    # the output projection saves ``exchanged``; keep ``out`` (which SDPA's fused kernel saves anyway) instead
    group = ctx.group
    sp.recomputable(exchanged, out, lambda o: all_to_all_single((sp.pad(o),), 1, 2, group)[0])
    return exchanged, None


def to_heads(xs, group, length: int | None):
    """[b, h, L/n, d] views of [b, L/n, h, d] projections (as HF makes them) -> [b, h/n, L, d] views of fresh
    [b, L, h/n, d] tensors, cut to the true length (``length``; None: keep the padded length). Exchanged in HF's memory layout so that SDPA's fused kernel
    writes its output in the [b, L, h, d] layout HF's reshape wants (no copy; the output exchange can then be
    recomputed from what SDPA saves)."""
    single = isinstance(xs, torch.Tensor)
    out = all_to_all(tuple(x.transpose(1, 2) for x in ((xs,) if single else xs)), group, scatter_dim=2, gather_dim=1)
    out = tuple((t if length is None else t.narrow(1, 0, length)).transpose(1, 2) for t in out)
    return out[0] if single else out


def sequence_bias(compute_bias, stream, mode: str, arguments):
    """Wrap a module's ``compute_bias(query_length, key_length, ..., past_seen_tokens=0)`` (T5's relative position
    bias, which the model calls with the local chunk's lengths) to call it with ``arguments(L)`` = (query_length,
    key_length, past_seen_tokens) of the stack's whole sequence instead; unchanged while the stack runs unsplit
    (incremental decoding); a cache that already holds tokens is refused, naming ``mode``."""

    def whole(query_length, key_length, *args, past_seen_tokens=0, **kwargs):
        if stream.unsplit:
            return compute_bias(query_length, key_length, *args, past_seen_tokens=past_seen_tokens, **kwargs)
        if past_seen_tokens:
            owner = getattr(compute_bias, "__self__", None)
            where = f"{type(owner).__name__}: " if owner is not None else ""
            raise RuntimeError(f"{where}{mode} does not support incremental decoding (KV cache): "
                               f"{int(past_seen_tokens)} tokens already seen")
        query_length, key_length, past = arguments(stream.length)
        return compute_bias(query_length, key_length, *args, past_seen_tokens=past, **kwargs)

    return whole


def whole_sequence_bias(compute_bias, stream):
    """T5's relative position bias of the whole sequence, [1, h, L, L], which then travels to every later layer as
    T5 passes it on (all-to-all attention slices its heads)."""
    return sequence_bias(compute_bias, stream, "all-to-all sequence parallelism", lambda length: (length, length, 0))


def all_to_all_name(implementation: str) -> str:
    """Register (once) and return the attention-interface name of all-to-all attention around
    ``implementation``; its mask function is the inner implementation's, so masks are built as HF builds them."""
    return _register_wrapper(ALL_TO_ALL_PREFIX + implementation, all_to_all_attention, implementation)


__all__ = ["IMPLEMENTATIONS", "set_attention", "all_to_all_attention", "all_to_all_name", "AllToAllContext",
           "attention_problems", "registered_problems", "registries", "whole_sequence_bias", "sequence_bias",
           "call_attention", "local_rng_name", "to_heads"]
