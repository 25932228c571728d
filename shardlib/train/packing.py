"""Padding-free batches: variable-length samples packed into rows of a token budget.

    collate = PackingCollator(max_length=128)        # or PackingCollator.for_model(model, 128)
    batch = collate(samples)                          # input_ids, document_ids, labels, ... [rows, length]
    trainer.train_step(batch)                         # or trainer.fit(data, batch_size=32, packing=128)

Each sample (a dict: ``input_ids`` and, token by token, any other id sequence such as ``token_type_ids`` or token
``labels``; or one ``labels`` value per sample, for sequence classification) becomes a *document*; documents are
placed whole into rows of at most ``max_length`` tokens by first-fit decreasing over the batch, a pure function of
the samples and their order, so the same global batch packs into the same rows on every rank and at every dp. Each
row says which document every token belongs to (``document_ids``: 0, 1, ... in the row, -1 for padding); a sharded
model keeps documents apart from that (:mod:`shardlib.sharding.documents`, installed by ``shard()``). Per-sample
labels become ``labels`` [rows, documents per row], -100 where a row has fewer documents.

Seq2seq (``target_length``): a sample's ``labels`` are its target sequence. Rows hold documents whose inputs fit
``max_length`` and whose targets fit ``target_length``; ``decoder_input_ids`` are each target shifted right behind
``decoder_start_token_id``, one document at a time, and ``decoder_document_ids`` say which target is whose.

Causal LMs (``label_shift=1``, what :meth:`PackingCollator.for_model` reads off the plan): the first label of every
document is -100, so no document's last token learns to predict the next document's first.

A sample longer than a row is refused (``too_long="error"``, naming the sample) or cut to the row
(``too_long="truncate"``, said once in the log); never split over two documents.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

IGNORE = -100


def pack_rows(lengths: Sequence[Sequence[int]], budgets: Sequence[int]) -> list[list[int]]:
    """The rows of a first-fit-decreasing packing: ``lengths[i]`` are sample i's lengths (one per budget), each
    row's sums stay within ``budgets``; rows in order of their first (longest) sample, each row's samples in their
    original order. Ties keep sample order, so the packing is a function of the lengths alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i][0], i))
    rows: list[list[int]] = []
    room: list[list[int]] = []
    for i in order:
        need = lengths[i]
        for r, free in enumerate(room):
            if all(n <= f for n, f in zip(need, free)):
                rows[r].append(i)
                room[r] = [f - n for f, n in zip(free, need)]
                break
        else:
            rows.append([i])
            room.append([b - n for b, n in zip(budgets, need)])
    return [sorted(row) for row in rows]


class PackingCollator:
    """Packs a list of samples into rows (see the module docstring).

    ``max_length``: tokens per row. ``target_length``: a seq2seq model's target tokens per row (None: not
    seq2seq). ``too_long``: ``"error"`` or ``"truncate"``. ``label_shift``: leading labels of each document that
    are no targets (1 for a causal LM's shifted labels). ``pad_token_id``: the input padding;
    ``decoder_start_token_id``: what starts each decoder document. ``fixed_length``: every row ``max_length``
    tokens long (one shape for every batch, as compiled or pipelined steps like); else rows are as long as the
    longest. ``rows_multiple``: empty rows are added until the row count is a multiple of it (``fit`` sets dp x
    microbatches)."""

    def __init__(self, max_length: int, *, target_length: int | None = None, too_long: str = "error",
                 label_shift: int = 0, pad_token_id: int = 0, decoder_start_token_id: int | None = None,
                 fixed_length: bool = False, rows_multiple: int = 1):
        for name, value in (("max_length", max_length), ("rows_multiple", rows_multiple)) + \
                ((("target_length", target_length),) if target_length is not None else ()):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PackingCollator: {name} must be a positive integer, got {value!r}")
        if too_long not in ("error", "truncate"):
            raise ValueError(f"PackingCollator: too_long must be 'error' or 'truncate', got {too_long!r}")
        if target_length is not None and decoder_start_token_id is None:
            raise ValueError("PackingCollator: a seq2seq packing (target_length) needs decoder_start_token_id")
        self.max_length, self.target_length, self.too_long = max_length, target_length, too_long
        self.label_shift, self.pad_token_id, self.decoder_start = label_shift, pad_token_id, decoder_start_token_id
        self.fixed_length, self.rows_multiple = fixed_length, rows_multiple
        self.truncated = 0  # samples cut to a row so far

    @classmethod
    def for_model(cls, model, max_length: int, **options) -> "PackingCollator":
        """A collator for ``model`` (sharded by :func:`shardlib.shard`): seq2seq targets of up to ``max_length``
        tokens (unless ``target_length`` is given), a causal LM's label shift, and the config's padding and decoder
        start ids; ``options`` override any of them."""
        from ..sharding.sharded import shard_state

        config = model.config
        seq2seq = bool(getattr(config, "is_encoder_decoder", False))
        derived = {"label_shift": shard_state(model).plan.loss_items.shift,
                   "pad_token_id": config.pad_token_id if config.pad_token_id is not None else 0}
        if seq2seq:
            start = getattr(config, "decoder_start_token_id", None)
            derived |= {"target_length": max_length, "decoder_start_token_id": start if start is not None else 0}
        return cls(max_length, **(derived | options))

    # -- samples -----------------------------------------------------------------------------------------------
    def _document(self, sample, index: int) -> dict:
        """Sample ``index`` as 1-D long tensors: its input ``tokens`` (name -> sequence, input_ids first), its
        ``target`` (seq2seq) or its ``label`` (one per sample), cut or refused where too long."""
        if not isinstance(sample, Mapping) or "input_ids" not in sample:
            keys = sorted(map(str, sample)) if isinstance(sample, Mapping) else type(sample).__name__
            raise ValueError(f"packing: sample {index} of the batch has no input_ids (it has {keys}); only token "
                             "sequences pack")
        ids = _ids(sample["input_ids"], "input_ids", index)
        tokens, label, target = {"input_ids": ids}, None, None
        for key, value in sample.items():
            if key == "input_ids":
                continue
            if key == "labels" and self.target_length is not None:
                target = _ids(value, "labels", index)
                continue
            value = torch.as_tensor(value) if not isinstance(value, str) else value
            if key == "attention_mask" and torch.is_tensor(value) and value.dim() == 1 and len(value) == len(ids):
                if not bool(value.bool().all()):
                    raise ValueError(f"packing: sample {index} is padded (its attention_mask has zeros); give "
                                     "samples unpadded")
                continue
            if key == "labels" and torch.is_tensor(value) and value.dim() == 0:
                label = value.long()
            elif _token_sequence(value, len(ids)):
                tokens[key] = value.long()
            else:
                what = f"shape {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__
                raise ValueError(f"packing: sample {index}'s {key!r} ({what}) is neither a token sequence as long as "
                                 f"its input_ids ({len(ids)}) nor one label; drop it (dataset.remove_columns)")
        if self.target_length is not None and target is None:
            raise ValueError(f"packing: sample {index} has no labels, the target sequence a seq2seq row needs")
        tokens = self._fit(tokens, self.max_length, index, "tokens")
        if target is not None:
            target = self._fit({"labels": target}, self.target_length, index, "target tokens")["labels"]
        return {"tokens": tokens, "label": label, "target": target}

    def _fit(self, sequences: dict, budget: int, index: int, what: str) -> dict:
        length = len(next(iter(sequences.values())))
        if length <= budget:
            return sequences
        if self.too_long == "error":
            raise ValueError(f"packing: sample {index} of the batch has {length} {what}, more than a row's {budget} "
                             "(PackingCollator(too_long='truncate') cuts such samples to the row)")
        if self.truncated == 0:
            logging.getLogger("shardlib.train").warning(
                "packing: sample %d of the batch has %d %s, cut to the row's %d (too_long='truncate'; later cuts are "
                "counted in PackingCollator.truncated)", index, length, what, budget)
        self.truncated += 1
        return {k: v[:budget] for k, v in sequences.items()}

    # -- rows --------------------------------------------------------------------------------------------------
    def __call__(self, samples: Sequence, rows_multiple: int | None = None) -> dict:
        """The rows of ``samples``; ``rows_multiple`` (default: the collator's) for this call."""
        if not len(samples):
            raise ValueError("packing: the batch has no samples")
        documents = [self._document(s, i) for i, s in enumerate(samples)]
        keys = list(documents[0]["tokens"])
        for i, doc in enumerate(documents):
            if list(doc["tokens"]) != keys or (doc["label"] is None) != (documents[0]["label"] is None):
                raise ValueError(f"packing: sample {i} has keys {sorted(doc['tokens'])}"
                                 f"{' and one label' if doc['label'] is not None else ''}, sample 0 "
                                 f"{sorted(keys)}{' and one label' if documents[0]['label'] is not None else ''}")
        seq2seq = self.target_length is not None
        lengths = [(len(d["tokens"]["input_ids"]),) + ((len(d["target"]),) if seq2seq else ()) for d in documents]
        budgets = (self.max_length,) + ((self.target_length,) if seq2seq else ())
        rows = pack_rows(lengths, budgets)
        rows += [[] for _ in range(-len(rows) % (rows_multiple or self.rows_multiple))]
        batch = self._inputs(documents, rows, keys)
        if documents[0]["label"] is not None:
            slots = max(len(row) for row in rows)
            labels = torch.full((len(rows), slots), IGNORE, dtype=torch.long)
            for r, row in enumerate(rows):
                for j, i in enumerate(row):
                    labels[r, j] = documents[i]["label"]
            batch["labels"] = labels
        if seq2seq:
            batch |= self._targets(documents, rows)
        return batch

    def _width(self, rows: list[list[int]], length_of, budget: int) -> int:
        return budget if self.fixed_length else max([sum(length_of(i) for i in row) for row in rows] + [1])

    def _inputs(self, documents: list[dict], rows: list[list[int]], keys: list[str]) -> dict:
        width = self._width(rows, lambda i: len(documents[i]["tokens"]["input_ids"]), self.max_length)
        pads = {"input_ids": self.pad_token_id, "labels": IGNORE}
        out = {k: torch.full((len(rows), width), pads.get(k, 0), dtype=torch.long) for k in keys}
        ids = torch.full((len(rows), width), -1, dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for j, i in enumerate(row):
                tokens = documents[i]["tokens"]
                n = len(tokens["input_ids"])
                for k in keys:
                    out[k][r, at:at + n] = tokens[k]
                if "labels" in out and self.label_shift:
                    out["labels"][r, at:at + min(self.label_shift, n)] = IGNORE
                ids[r, at:at + n] = j
                at += n
        return {"input_ids": out.pop("input_ids"), **out, "document_ids": ids}

    def _targets(self, documents: list[dict], rows: list[list[int]]) -> dict:
        width = self._width(rows, lambda i: len(documents[i]["target"]), self.target_length)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        inputs = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        ids = torch.full((len(rows), width), -1, dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for j, i in enumerate(row):
                target = documents[i]["target"]
                n = len(target)
                labels[r, at:at + n] = target
                shifted = torch.cat([torch.tensor([self.decoder_start]), target[:-1]])  # HF's shift_right, per document
                inputs[r, at:at + n] = shifted.masked_fill(shifted == IGNORE, self.pad_token_id)
                ids[r, at:at + n] = j
                at += n
        return {"labels": labels, "decoder_input_ids": inputs, "decoder_document_ids": ids}


def _token_sequence(value, length: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and len(value) == length and not value.is_floating_point()


def _ids(value, key: str, index: int) -> torch.Tensor:
    ids = torch.as_tensor(value)
    if ids.dim() != 1 or ids.is_floating_point() or len(ids) == 0:
        got = f"shape {tuple(ids.shape)}" if ids.dim() != 1 else "an empty one" if not len(ids) else str(ids.dtype)
        raise ValueError(f"packing: sample {index}'s {key} must be a non-empty 1-D sequence of token ids, got {got}")
    return ids.long()
