"""Training losses computed on vocab-sharded logits, replacing the loss an HF model computes in its forward.

The sharded model's forward takes the label arguments (``LossSpec.labels``) out of the call, runs the HF forward
without them (so HF never sees the vocab-sharded logits), then computes the loss with
:func:`shardlib.parallel.layers.vocab_parallel_cross_entropy` exactly as HF defines it for that head:

* ``masked_lm``: mean cross-entropy over targets != -100 (``nn.CrossEntropyLoss()``), as in BertForMaskedLM,
  computed and returned in at least float32 (what autocast's float32 ``log_softmax`` / ``nll_loss`` give
  transformers under bf16 / fp16);
* ``causal_lm``: labels shifted left by one, then the mean over targets != -100, or the sum divided by
  ``num_items_in_batch`` when that keyword is given, in float32 (transformers' ``ForCausalLMLoss``);
* ``pretraining``: ``masked_lm`` + the next-sentence cross-entropy, only when both label sets are given;
* ``seq2seq_lm``: ``masked_lm`` on the decoder logits; labels shifted right become the decoder inputs when none
  are given (T5ForConditionalGeneration).

A mixture-of-experts model asked for its router logits adds its auxiliary router losses to each of these as its
own forward does (:func:`shardlib.sharding.experts.router_losses`).

Logits in the returned output: with ``gather_logits=None`` (default) they are gathered to the full vocabulary
(padding stripped) when no labels were passed (inference, generation) and left vocab-sharded, [..., V_pad/tp],
when labels were passed (training: full logits are never gathered for the loss). True / False force either.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from ..parallel.collectives import gather_from_tp
from ..parallel.layers import vocab_parallel_cross_entropy
from .experts import router_losses

IGNORE_INDEX = -100


def _token_losses(logits, labels, head, dtype=None):
    return vocab_parallel_cross_entropy(
        logits, labels.to(logits.device), vocab_start=head.vocab_start, valid=head.valid_out_features,
        group=head.group, ignore_index=IGNORE_INDEX, dtype=dtype,
    )


def _mean_over_targets(per_token, labels):
    return per_token.sum() / (labels != IGNORE_INDEX).sum()


def masked_lm_loss(out, spec, labels, head, extra):
    lm_labels = labels["labels"]
    if lm_labels is None:
        return None
    logits = out[spec.logits]
    return _mean_over_targets(_token_losses(logits, lm_labels, head), lm_labels)


def causal_lm_loss(out, spec, labels, head, extra):
    lm_labels = labels["labels"]
    if lm_labels is None:
        return None
    shifted = F.pad(lm_labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    per_token = _token_losses(out[spec.logits], shifted, head, dtype=torch.float32)  # HF upcasts with .float()
    num_items = extra.get("num_items_in_batch")
    if num_items is None:
        return _mean_over_targets(per_token, shifted)
    if torch.is_tensor(num_items):
        num_items = num_items.to(per_token.device)
    return per_token.sum() / num_items


def pretraining_loss(out, spec, labels, head, extra):
    lm_labels, nsp_labels = labels["labels"], labels["next_sentence_label"]
    if lm_labels is None or nsp_labels is None:
        return None
    logits = out[spec.logits]
    mlm = _mean_over_targets(_token_losses(logits, lm_labels, head), lm_labels)
    nsp_logits = out["seq_relationship_logits"]
    return mlm + F.cross_entropy(nsp_logits.view(-1, nsp_logits.shape[-1]), nsp_labels.view(-1))


def no_cache_with_labels(model, arguments: dict, labels: dict) -> None:
    """As HF's causal-LM forward does: no KV cache when training on labels."""
    if labels["labels"] is not None:
        arguments["use_cache"] = False


def shift_labels_into_decoder_inputs(model, arguments: dict, labels: dict) -> None:
    """What a seq2seq HF forward does with labels besides the loss: decoder inputs = labels shifted right."""
    lm_labels = labels["labels"]
    if lm_labels is not None and arguments.get("decoder_input_ids") is None \
            and arguments.get("decoder_inputs_embeds") is None:
        arguments["decoder_input_ids"] = model._shift_right(lm_labels)


LOSSES = {"masked_lm": masked_lm_loss, "causal_lm": causal_lm_loss, "pretraining": pretraining_loss,
          "seq2seq_lm": masked_lm_loss}
#: what a kind's HF forward derives from the labels before it runs (the wrapper removes the labels)
PREPARE = {"causal_lm": no_cache_with_labels, "seq2seq_lm": shift_labels_into_decoder_inputs}


def install_vocab_parallel_loss(model, spec, gather_logits: bool | None) -> None:
    """Swap ``model``'s class for a subclass whose forward computes ``spec``'s loss on vocab-sharded logits."""
    if spec.kind not in LOSSES:
        raise ValueError(f"unknown loss kind {spec.kind!r}; known: {sorted(LOSSES)}")
    loss_fn = LOSSES[spec.kind]
    base = type(model)
    hf_forward = base.forward
    signature = inspect.signature(hf_forward)

    @functools.wraps(hf_forward)
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        labels = {name: bound.arguments.pop(name, None) for name in spec.labels}
        has_labels = any(v is not None for v in labels.values())
        if spec.kind in PREPARE:
            PREPARE[spec.kind](self, bound.arguments, labels)
        extra = dict(bound.arguments.get("kwargs", {}))
        return_dict = extra.pop("return_dict", None)
        if "kwargs" in bound.arguments:
            bound.arguments["kwargs"] = {**extra, "return_dict": True}
        out = hf_forward(*bound.args, **bound.kwargs)
        head = self.get_submodule(spec.head)
        loss = loss_fn(out, spec, labels, head, extra)
        if loss is not None and (router := router_losses(self, out)) is not None:
            loss = loss + router  # a mixture of experts' auxiliary losses, added as its own forward adds them
        fields = {k: v for k, v in out.items() if k != "loss"}
        if gather_logits or (gather_logits is None and not has_labels):
            fields[spec.logits] = gather_from_tp(fields[spec.logits], head.group, -1)[..., : head.global_out_features]
        result = type(out)(loss=loss, **fields)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return result if return_dict else result.to_tuple()

    sharded_cls = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                                "_shardlib_base_class": base})
    sharded_cls.__qualname__ = f"Sharded{base.__qualname__}"
    model.__class__ = sharded_cls
