"""Packed rows: several documents in one row of a batch, kept apart inside the model.

A packed batch (:class:`shardlib.train.packing.PackingCollator`) carries ``document_ids`` [rows, length] (0, 1, ...
per row for its documents, -1 for padding) beside ``input_ids``, and for a seq2seq model ``decoder_document_ids``
for its targets. ``shard()`` installs one forward pre-hook on every model it shards (:func:`attach_document_hooks`)
that turns them into what the unmodified HF forward already takes (a batch without them passes untouched):

* ``attention_mask``: a 4-D mask in which a token sees only its own document, bidirectional in an encoder and
  causal in a decoder, built by transformers' own mask function for the model's attention implementation
  (``AttentionMaskInterface``: a boolean mask for SDPA, an additive one for eager, a block mask for
  flex_attention, which then skips the blocks no document reaches). A padding token sees only padding, so no row
  of the mask is empty.
* ``position_ids``: positions that restart at every document (absolute position embeddings, rotary), counted from
  where the model counts (RoBERTa-style embeddings from ``padding_idx + 1``). Relative position biases (T5) need
  nothing: within a document distances are unchanged. A model with absolute positions whose forward takes no
  ``position_ids`` (BART and its kin) is refused.
* seq2seq: ``decoder_attention_mask`` (block-causal over the targets) and the cross mask (decoder document i sees
  encoder document i), swapped in by a pre-hook on the decoder, since HF passes the encoder's mask there.
* sequence classification: a pre-hook on the plan's ``document_pool`` module (BERT's pooler) hands it each
  document's first token, ``[rows * slots, 1, hidden]``, so the head gives one logit row per document slot and
  the labels ``[rows, slots]`` (-100 for empty slots) line up with them.

Everything downstream (tensor, sequence and ring parallelism, pipeline stages, ZeRO, checkpointing) sees an
ordinary 4-D mask, so every layout runs packed rows unchanged. A model that cannot pack (:func:`packing_problems`:
a loss that reads whole sequences, absolute positions it computes itself, images) refuses a packed batch at its
forward, and :func:`accept_documents` (``fit(packing=...)``, the Trainer's first packed batch) before anything runs;
transformers would otherwise take ``document_ids`` into its ``**kwargs`` and attend across documents silently.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn

from ..kernels.mask_spec import enter_documents, is_spec_builder, leave_documents
from .sharded import shard_state

DOCUMENT_KEYS = ("document_ids", "decoder_document_ids")
_HOOK_ATTR = "_shardlib_documents"


def packing_problems(model: nn.Module) -> list[str]:
    """Why ``model`` cannot train on packed rows (empty when it can): its loss must be per token, or its head must
    pool per document (the plan's ``document_pool``), or it is a base model whose outputs are per token."""
    plan = shard_state(model).plan
    name = type(model).__name__
    config = model.config
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        return [f"{name} reads {model.main_input_name}, not token ids: only token sequences pack"]
    absolute = _absolute_positions(model)
    if absolute and "position_ids" not in inspect.signature(model.forward).parameters:
        return [f"{name} computes absolute positions itself ({absolute[0]}) and takes no "
                "position_ids: in a packed row they would run on across documents"]
    if config._attn_implementation not in _mask_functions():
        return [f"{name}: attention implementation {config._attn_implementation!r} has no 4-D mask in transformers' "
                "AttentionMaskInterface to keep documents apart (use sdpa, eager or flex_attention)"]
    capacity = [pattern for pattern, site in plan.moe.items() if site.capacity]
    if capacity:
        return [f"{name}'s routers drop tokens past each expert's capacity counted along the whole row "
                f"({capacity[0]}): packed documents would compete for one row's capacity, and other tokens would "
                "drop than in the padded batch; train it padded"]
    if plan.document_pool is not None or plan.loss_items.key is not None or getattr(model, "base_model", None) is model:
        return []
    return [f"{name}'s loss reads whole sequences (one label per row), and its policy names no module that pools "
            "per document (Plan.document_pool): it cannot train on packed rows; train it padded"]


def accept_documents(model: nn.Module) -> None:
    """Let ``model`` (sharded by :func:`shardlib.shard`) take packed batches: ``document_ids`` (and
    ``decoder_document_ids``) become masks, positions and per-document pooling (see the module docstring). Batches
    without them run as before. Idempotent; a ValueError naming the model when it cannot (:func:`packing_problems`),
    before anything runs."""
    hooks = install_document_hooks(model)
    if hooks.problems:
        raise ValueError("packing: " + "; ".join(hooks.problems))


def attach_document_hooks(wrapper: nn.Module, model: nn.Module) -> None:
    """``shard()``'s last step: the document hooks on ``model``, reachable from its ``wrapper`` (a peft model) too."""
    setattr(wrapper, _HOOK_ATTR, install_document_hooks(model))


def install_document_hooks(model: nn.Module) -> "_DocumentHooks":
    """The document hooks of ``model``, installed once (``shard()`` installs them on every model it shards, so that
    a packed batch is never silently taken for a padded one: a model that cannot pack refuses it at its forward)."""
    hooks = getattr(model, _HOOK_ATTR, None)
    if hooks is None:
        hooks = _DocumentHooks(model, packing_problems(model))
        setattr(model, _HOOK_ATTR, hooks)
    return hooks


def _absolute_positions(model: nn.Module) -> list[str]:
    """The model's absolute position embeddings (by the names transformers gives them)."""
    return [name for name, _ in model.named_modules()
            if name.rsplit(".", 1)[-1] in ("position_embeddings", "embed_positions", "wpe")]


def position_offset(model: nn.Module) -> int:
    """The first position id the model gives a sequence: RoBERTa-style embeddings count from ``padding_idx + 1``
    (their position embedding has a ``padding_idx``); 0 elsewhere."""
    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, nn.Embedding) and module.padding_idx is not None:
            return module.padding_idx + 1
    return 0


def _mask_functions():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return {name for name in ALL_MASK_ATTENTION_FUNCTIONS if not name.startswith("flash_attention")}


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (``documents`` [rows, length]: a document's tokens are
    contiguous); padding continues from its row's last document."""
    length = documents.shape[-1]
    index = torch.arange(length, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def document_starts(documents: torch.Tensor, slots: int) -> torch.Tensor:
    """[rows, slots]: the index of document j's first token in each row (0 where a row has no document j)."""
    rows, length = documents.shape
    index = torch.arange(length, device=documents.device).expand_as(documents)
    found = torch.full((rows, slots + 1), length, dtype=index.dtype, device=documents.device)
    slot = torch.where((documents >= 0) & (documents < slots), documents, slots)
    found.scatter_reduce_(1, slot, index, reduce="amin")
    starts = found[:, :slots]
    return torch.where(starts == length, 0, starts)


def document_mask(config, queries: torch.Tensor, keys: torch.Tensor, *, causal: bool, dtype: torch.dtype):
    """The 4-D mask (in the format of ``config``'s attention implementation) in which query i of a row sees key j
    when both belong to the same document (and j <= i when ``causal``); a padding query (-1) sees what is padding
    among the keys, or every key when the keys hold no padding (a cross mask), so that no row is empty."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, and_masks, causal_mask_function

    # a padding query sees the keys' padding (itself, in a self mask); where the keys hold none, every key
    sees_all = queries is not keys and not bool((keys < 0).any())

    def same_document(batch, head, q, kv):
        mine = queries[batch, q]
        return (mine == keys[batch, kv]) | ((mine < 0) & sees_all)

    function = and_masks(causal_mask_function, same_document) if causal else same_document
    mask = ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation](
        batch_size=queries.shape[0], q_length=queries.shape[1], kv_length=keys.shape[1], mask_function=function,
        attention_mask=None, allow_is_causal_skip=False, allow_is_bidirectional_skip=False, dtype=dtype,
        config=config, use_vmap=False, device=queries.device)
    if mask is None:
        raise ValueError(f"packing: attention implementation {config._attn_implementation!r} gave no mask")
    return mask


class _DocumentHooks:
    """The pre-hooks :func:`accept_documents` installs, and what one forward's hook hands the later ones (the
    decoder's cross mask, the pooled positions), cleared at the next forward."""

    def __init__(self, model: nn.Module, problems: list[str]):
        plan = shard_state(model).plan
        self.problems = problems
        # held weakly: the model holds these hooks, and a cycle would keep it (and the process groups and threads
        # its modules reach) alive into interpreter shutdown
        self.model, self.config = weakref.ref(model), model.config
        self.seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))
        self.causal = not self.seq2seq and any(getattr(m, "is_causal", False) for m in model.modules())
        accepted = inspect.signature(model.forward).parameters
        self.takes_positions = "position_ids" in accepted
        self.first_position = position_offset(model)
        self.takes_cache = "use_cache" in accepted
        self.cross_mask = self.starts = self.stack_documents = None
        self.documents_tokens: list = []
        self.pools = plan.document_pool is not None
        self.cross_attention = bool(getattr(model.config, "add_cross_attention", False))
        model.register_forward_pre_hook(self.before_model, with_kwargs=True)
        model.register_forward_hook(self.after_model, always_call=True)
        if problems:
            return
        if self.seq2seq:
            model.get_decoder().register_forward_pre_hook(self.before_decoder, with_kwargs=True)
            for name, stack in (("encoder", model.get_encoder()), ("decoder", model.get_decoder())):
                stack.register_forward_pre_hook(self._stack_entry(name))
                stack.register_forward_hook(self.after_model, always_call=True)
        if self.pools:
            model.get_submodule(plan.document_pool).register_forward_pre_hook(self.before_pool)

    def _dtype(self) -> torch.dtype:
        return next((p.dtype for p in self.model().parameters() if p.is_floating_point()), torch.float32)

    def before_model(self, module, args, kwargs):
        if "document_ids" not in kwargs and "decoder_document_ids" not in kwargs:
            if self.starts is not None or self.cross_mask is not None:
                self.cross_mask = self.starts = None  # a padded batch after a packed one: pool and mask as HF does
            return None  # nothing for torch.compile to trace
        return self._packed(module, args, kwargs)

    @torch.compiler.disable  # masks are built eagerly; a compiled model's graph starts after this hook
    def _packed(self, module, args, kwargs):
        if self.problems:
            raise ValueError("packing: " + "; ".join(self.problems))
        documents = kwargs.pop("document_ids", None)
        targets = kwargs.pop("decoder_document_ids", None)
        self.cross_mask = self.starts = None
        if documents is None:
            if targets is not None:
                raise ValueError("packing: the batch has decoder_document_ids but no document_ids")
            return None
        if kwargs.get("attention_mask") is not None:
            raise ValueError("packing: a packed batch (document_ids) takes no attention_mask: the documents are the "
                             "mask")
        dtype = self._dtype()
        as_data = self._masks_as_data()
        if as_data:  # the attention's mask builder reads the documents themselves: O(L), no 4-D mask
            kwargs["attention_mask"] = (documents >= 0).long()
            pair = (documents, documents)
            # seq2seq: the encoder's and decoder's own hooks say which ids each mask takes; none outside them
            self.documents_tokens.append(enter_documents() if self.seq2seq else enter_documents(pair, pair))
        else:
            kwargs["attention_mask"] = document_mask(self.config, documents, documents,
                                                     causal=self.causal, dtype=dtype)
        if self.takes_positions and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = document_positions(documents) + self.first_position
        if self.takes_cache and kwargs.get("use_cache") is None:
            kwargs["use_cache"] = False  # a training forward; HF's default cache would only hold memory
        if self.seq2seq:
            if targets is None:
                raise ValueError(f"packing: {type(module).__name__} is a seq2seq model: a packed batch needs "
                                 "decoder_document_ids for its targets (PackingCollator(target_length=...))")
            if as_data:  # the encoder's self-attention, the decoder's (causal) and its cross-attention
                kwargs["decoder_attention_mask"] = (targets >= 0).long()
                self.stack_documents = {"encoder": {"bidirectional": (documents, documents)},
                                        "decoder": {"causal": (targets, targets), "bidirectional": (targets, documents)}}
            else:
                kwargs["decoder_attention_mask"] = document_mask(self.config, targets, targets, causal=True,
                                                                 dtype=dtype)
                self.cross_mask = document_mask(self.config, targets, documents, causal=False, dtype=dtype)
        if self.pools:
            self._pool_positions(documents, kwargs.get("labels"))
        return args, kwargs

    def _masks_as_data(self) -> bool:
        """Whether the model's attention takes masks described as data (:mod:`shardlib.kernels.mask_spec`): ring
        attention, ``Kernels(attention="blocks")``. A decoder with cross-attention beside its own encoder (BERT's
        ``add_cross_attention``) keeps the 4-D masks: its encoder states come from outside the packed forward."""
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        builder = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(self.config._attn_implementation)
        return is_spec_builder(builder) and not self.cross_attention

    def _stack_entry(self, name: str):
        def enter(module, args):
            if self.documents_tokens and self.stack_documents is not None:
                self.documents_tokens.append(enter_documents(**self.stack_documents[name]))
            return None

        return enter

    def after_model(self, module, args, output):
        """After the model and after each seq2seq stack: leave the documents their pre-hook entered."""
        if self.documents_tokens:
            leave_documents(self.documents_tokens.pop())
            if not self.documents_tokens:
                self.stack_documents = None
        return None

    def _pool_positions(self, documents: torch.Tensor, labels) -> None:
        """Where the pooler reads each document: as many slots per row as the labels have (``[rows, slots]``), or
        as the fullest row has documents (no labels: inference)."""
        if not torch.is_tensor(labels) or labels.dim() != 2:
            slots = int(documents.max()) + 1 if documents.numel() else 1
        else:
            if labels.is_floating_point() or self.config.num_labels < 2 or \
                    self.config.problem_type not in (None, "single_label_classification"):
                raise ValueError("packing: per-document labels must be class indices of a single-label classifier; "
                                 f"got {labels.dtype} labels for num_labels={self.config.num_labels}, problem_type="
                                 f"{self.config.problem_type!r} (regression and multi-label heads do not pack)")
            slots = labels.shape[1]
        self.starts = document_starts(documents, max(slots, 1))

    def before_decoder(self, module, args, kwargs):
        if self.cross_mask is not None:
            kwargs["encoder_attention_mask"] = self.cross_mask
            return args, kwargs
        return None

    def before_pool(self, module, args):
        if self.starts is None:
            return None
        hidden = args[0]
        rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]
        pooled = hidden[rows, self.starts.to(hidden.device)]  # [rows, slots, hidden]
        return (pooled.reshape(-1, 1, hidden.shape[-1]), *args[1:])
