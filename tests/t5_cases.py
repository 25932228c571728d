"""T5-family model cases (same interface as bert_cases): T5, MT5 and UMT5, every head, both FFN kinds."""

from __future__ import annotations

import torch
import transformers

HEADS = ("Model", "ForConditionalGeneration", "EncoderModel", "ForSequenceClassification",
         "ForTokenClassification", "ForQuestionAnswering")
CLASSES = tuple(f"T5{h}" for h in HEADS) + ("MT5ForConditionalGeneration", "MT5Model", "UMT5ForConditionalGeneration",
                                          "UMT5Model", "UMT5EncoderModel", "MT5ForSequenceClassification")
PAD, EOS = 0, 1


def make_config(spec: dict):
    c = spec["config"]
    family = spec["cls"].split("For")[0].replace("EncoderModel", "").replace("Model", "")
    return getattr(transformers, f"{family}Config")(
        vocab_size=c["vocab"], d_model=c["d_model"], d_kv=c["d_kv"], d_ff=c["d_ff"], num_layers=c["layers"],
        num_decoder_layers=c.get("decoder_layers", c["layers"]), num_heads=c["heads"],
        relative_attention_num_buckets=c.get("buckets", 8), relative_attention_max_distance=c.get("max_distance", 16),
        dropout_rate=c.get("dropout", 0.0), feed_forward_proj=c.get("ffn", "relu"), classifier_dropout=0.0,
        num_labels=2 if spec["cls"].endswith("QuestionAnswering") else c.get("num_labels", 3),
        tie_word_embeddings=c.get("tie", True), initializer_factor=c.get("init", 1.0),
        pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD,
    )


def make_model(spec: dict) -> torch.nn.Module:
    torch.manual_seed(spec["seed"])
    model = getattr(transformers, spec["cls"])(make_config(spec))
    if spec["config"].get("untie_head") and hasattr(model, "lm_head"):
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
    return model.to(getattr(torch, spec.get("dtype", "float32")))


def make_batch(spec: dict, config) -> dict:
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    b, s, t, v = spec["batch"], spec["seq"], spec.get("dec_seq", spec["seq"]), config.vocab_size
    ids = torch.randint(2, v, (b, s), generator=g)
    ids[:, -1] = EOS  # one EOS per row: the sequence classifier reads the hidden state there
    lengths = torch.randint(1, s + 1, (b, 1), generator=g) if spec.get("padding", True) else torch.full((b, 1), s)
    mask = (torch.arange(s) < lengths).long()
    if spec["cls"].endswith("ForSequenceClassification"):
        mask[:, -1] = 1  # the EOS position must be attended
    batch = {"input_ids": ids, "attention_mask": mask}
    cls, labels = spec["cls"], spec.get("labels", True)
    if cls.endswith("Model") and not cls.endswith("EncoderModel"):
        batch["decoder_input_ids"] = torch.randint(0, v, (b, t), generator=g)
        batch["decoder_attention_mask"] = (torch.arange(t) < torch.randint(1, t + 1, (b, 1), generator=g)).long()
    if not labels:
        return batch
    if cls.endswith("ForConditionalGeneration"):
        lm = torch.randint(2, v, (b, t), generator=g)
        lm[torch.rand(b, t, generator=g) < 0.3] = -100
        lm[:, 0] = 2
        batch["labels"] = lm
    elif cls.endswith("ForSequenceClassification"):
        batch["labels"] = torch.randint(0, config.num_labels, (b,), generator=g)
    elif cls.endswith("ForTokenClassification"):
        tok = torch.randint(0, config.num_labels, (b, s), generator=g)
        tok[torch.rand(b, s, generator=g) < 0.3] = -100
        tok[:, 0] = 0
        batch["labels"] = tok
    elif cls.endswith("ForQuestionAnswering"):
        batch["start_positions"] = torch.randint(0, s, (b,), generator=g)
        batch["end_positions"] = torch.randint(0, s, (b,), generator=g)
    return batch
