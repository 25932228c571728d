"""BERT model cases shared by the driver-side tests and the rank-side tasks: which classes, what inputs and labels
each takes, and how a spec (plain, picklable data) becomes a config, a model and a batch."""

from __future__ import annotations

import torch
import transformers
from transformers import BertConfig

CLASSES = (
    "BertModel", "BertForPreTraining", "BertForMaskedLM", "BertLMHeadModel", "BertForNextSentencePrediction",
    "BertForSequenceClassification", "BertForMultipleChoice", "BertForTokenClassification",
    "BertForQuestionAnswering",
)


def make_config(spec: dict) -> BertConfig:
    c = spec["config"]
    is_decoder = spec["cls"] == "BertLMHeadModel"
    return BertConfig(
        vocab_size=c["vocab"], hidden_size=c["heads"] * c["head_dim"], num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"], intermediate_size=c["intermediate"], hidden_act=c.get("act", "gelu"),
        max_position_embeddings=max(16, spec["seq"]), type_vocab_size=2,
        num_labels=2 if spec["cls"] == "BertForQuestionAnswering" else c.get("num_labels", 3),
        hidden_dropout_prob=c.get("dropout", 0.0), attention_probs_dropout_prob=c.get("dropout", 0.0),
        classifier_dropout=None, tie_word_embeddings=c.get("tie", True), is_decoder=is_decoder,
        add_cross_attention=is_decoder and c.get("cross_attention", False), pad_token_id=0,
    )


def make_model(spec: dict) -> torch.nn.Module:
    torch.manual_seed(spec["seed"])
    model = getattr(transformers, spec["cls"])(make_config(spec))
    return model.to(getattr(torch, spec.get("dtype", "float32")))


def make_batch(spec: dict, config: BertConfig) -> dict:
    """Inputs and labels for the spec's class, drawn from a generator seeded by the spec (same on every rank)."""
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    b, s, v = spec["batch"], spec["seq"], config.vocab_size
    shape = (b, spec.get("choices", 2), s) if spec["cls"] == "BertForMultipleChoice" else (b, s)
    ids = torch.randint(0, v, shape, generator=g)
    lengths = torch.randint(1, s + 1, shape[:-1], generator=g) if spec.get("padding", True) else torch.full(shape[:-1], s)
    mask = (torch.arange(s) < lengths.unsqueeze(-1)).long()
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.randint(0, 2, shape, generator=g)}
    if spec["cls"] == "BertLMHeadModel" and config.add_cross_attention:
        enc_len = spec.get("enc_seq", s)
        batch["encoder_hidden_states"] = torch.randn(b, enc_len, config.hidden_size, generator=g)
        batch["encoder_attention_mask"] = (torch.arange(enc_len) < torch.randint(1, enc_len + 1, (b, 1), generator=g)).long()
    if not spec.get("labels", True):
        return batch
    ignored = torch.rand(shape, generator=g) < (0.0 if spec.get("all_targets") else 0.3)
    token_labels = torch.where(ignored, torch.full(shape, -100), ids)
    token_labels[..., :2] = ids[..., :2]  # a target per row even after the causal shift: the mean is defined
    cls = spec["cls"]
    if cls in ("BertForMaskedLM", "BertLMHeadModel"):
        batch["labels"] = token_labels
    elif cls == "BertForPreTraining":
        batch["labels"] = token_labels
        batch["next_sentence_label"] = torch.randint(0, 2, (b,), generator=g)
    elif cls == "BertForNextSentencePrediction":
        batch["labels"] = torch.randint(0, 2, (b,), generator=g)
    elif cls == "BertForSequenceClassification":
        batch["labels"] = torch.randint(0, config.num_labels, (b,), generator=g)
    elif cls == "BertForMultipleChoice":
        batch["labels"] = torch.randint(0, shape[1], (b,), generator=g)
    elif cls == "BertForTokenClassification":
        batch["labels"] = torch.where(token_labels == -100, -100, torch.randint(0, config.num_labels, shape, generator=g))
    elif cls == "BertForQuestionAnswering":
        batch["start_positions"] = torch.randint(0, s, (b,), generator=g)
        batch["end_positions"] = torch.randint(0, s, (b,), generator=g)
    return batch
