"""Generated workloads shared by the training benchmarks."""

from __future__ import annotations

import torch


def classification_samples(n: int, seq: int, vocab: int) -> list[dict]:
    """``n`` SST-2-shaped samples (random token ids, full attention mask, 2 labels), the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    mask = torch.ones(seq, dtype=torch.long)
    return [{"input_ids": ids[i], "attention_mask": mask, "labels": labels[i]} for i in range(n)]
