"""Example inputs of a model's task, built from its config: what a dry run traces on the meta device and what an
inferred plan is exported and verified on."""

from __future__ import annotations

import inspect

import torch
from torch import nn


class PlanInputError(ValueError):
    """Bad input to a dry run (a config that cannot be read, an unknown class, a size that is not positive)."""


def task_of(model: nn.Module) -> str:
    """The transformers task (auto-class mapping) that lists the model's class, or "" for base models."""
    from transformers.models.auto import modeling_auto as auto

    name = type(model).__name__
    for task in ("MASKED_LM", "CAUSAL_LM", "SEQ_TO_SEQ_CAUSAL_LM", "TOKEN_CLASSIFICATION", "PRETRAINING",
                 "SEQUENCE_CLASSIFICATION", "MULTIPLE_CHOICE", "NEXT_SENTENCE_PREDICTION", "IMAGE_CLASSIFICATION",
                 "QUESTION_ANSWERING", "MASKED_IMAGE_MODELING"):
        for names in getattr(auto, f"MODEL_FOR_{task}_MAPPING_NAMES").values():
            if name in ((names,) if isinstance(names, str) else names):  # DeiT lists two classes under one key
                return task
    return ""


def example_batch(model: nn.Module, batch: int, seq: int, device="meta", *,
                  generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """A training batch for ``model`` as its forward takes it (zeros; on the meta device only shapes matter):
    ``pixel_values`` for image models, else ``input_ids`` of ``batch`` x ``seq`` (x 2 choices), and the labels of
    the model's task found from transformers' auto-class mappings (token labels, one per example, answer spans,
    masked patches; a causal LM's are its inputs); base models get no labels. ``generator``: random values in each
    input's valid range instead of zeros (a real run: verifying a plan)."""
    config, task = model.config, task_of(model)
    forward = inspect.signature(model.forward).parameters
    dtype = next(model.parameters()).dtype

    def ints(*shape, high: int = 2):
        if generator is None:
            return torch.zeros(shape, dtype=torch.long, device=device)
        return torch.randint(0, high, shape, generator=generator).to(device)

    if "pixel_values" in forward:
        side = config.image_size
        pixels = (batch, config.num_channels, side, side)
        inputs = {"pixel_values": torch.zeros(pixels, dtype=dtype, device=device) if generator is None
                  else torch.randn(pixels, generator=generator).to(device=device, dtype=dtype)}
        if task == "MASKED_IMAGE_MODELING":
            patches = (side // config.patch_size) ** 2
            inputs["bool_masked_pos"] = ints(batch, patches).bool()
        if task == "IMAGE_CLASSIFICATION":
            inputs["labels"] = ints(batch, high=config.num_labels)
        return inputs
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise PlanInputError(f"seq={seq} is longer than the model's max_position_embeddings={limit}")
    shape = (batch, 2, seq) if task == "MULTIPLE_CHOICE" else (batch, seq)
    vocab = config.get_text_config().vocab_size
    inputs = {"input_ids": ints(*shape, high=vocab)}
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, int) and eos < vocab:  # one per row: sequence classifiers pool there (BART, T5)
        ids = inputs["input_ids"]
        if generator is not None and vocab > 1:  # exactly one: BART refuses rows with different eos counts
            ids.masked_fill_(ids == eos, (eos + 1) % vocab)
        ids[..., -1] = eos
    if "decoder_input_ids" in forward and task in ("", "SEQ_TO_SEQ_CAUSAL_LM", "PRETRAINING"):
        inputs["decoder_input_ids"] = ints(batch, seq, high=vocab)
    if task == "CAUSAL_LM":  # next-token prediction: the labels are the inputs (the model shifts them)
        inputs["labels"] = inputs["input_ids"].clone()
        if device == "meta" and "attention_mask" in forward:
            # without a mask transformers looks for packed sequences in the position ids, a check of values that
            # meta tensors cannot answer
            inputs["attention_mask"] = torch.ones(shape, dtype=torch.long, device=device)
    elif task in ("MASKED_LM", "SEQ_TO_SEQ_CAUSAL_LM", "PRETRAINING"):
        inputs["labels"] = ints(*shape, high=vocab)
    if task == "TOKEN_CLASSIFICATION":
        inputs["labels"] = ints(*shape, high=config.num_labels)
    if task == "SEQUENCE_CLASSIFICATION":
        inputs["labels"] = ints(batch, high=config.num_labels)
    if task in ("MULTIPLE_CHOICE", "NEXT_SENTENCE_PREDICTION"):  # 2 choices; is-next or not
        inputs["labels"] = ints(batch)
    if "next_sentence_label" in forward:
        inputs["next_sentence_label"] = ints(batch)
    if task == "QUESTION_ANSWERING":
        inputs["start_positions"], inputs["end_positions"] = ints(batch, high=seq), ints(batch, high=seq)
    return inputs


__all__ = ["PlanInputError", "task_of", "example_batch"]
