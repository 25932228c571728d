"""Rank-pool tasks of tests/test_masks_linear.py: which tensors of L x L (or L x L / sp per rank) size a sharded
attention allocates, forward and backward, at a sequence length where such a tensor is the largest by far."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import shardlib
from harness import mesh as pool_mesh


class SquareProbe(TorchDispatchMode):
    """Records every op output (forward and backward: CPU autograd runs on this thread) with more than ``limit``
    elements, as ``(op, shape)``; views are not allocations and are left out."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.found = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # an expand or a slice allocates nothing
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.limit:
                self.found.append((str(func), tuple(t.shape)))
        return out


def square_tensors(length: int, sp: int, sequence: str | bool, padding: float = 0.0, documents: int = 0,
                   attention: str | None = None) -> list:
    """A one-layer, one-head BERT (hidden 32: every activation is at most L x 64) sharded at ``sp`` ranks of
    ``sequence`` parallelism (sp=1: each rank runs the whole row), one row of ``length`` tokens, its last ``padding``
    share padding or ``documents`` packed documents of equal length: the ops whose outputs exceed L * L / (2 sp)
    elements in a forward and backward. ``attention``: ``Kernels(attention=...)``."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                        intermediate_size=64, max_position_embeddings=length, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = shardlib.shard(BertForMaskedLM(config), pool_mesh(sp=sp), sequence_parallel=sequence,
                           kernels=shardlib.Kernels(attention=attention))
    ids = torch.randint(1, 64, (1, length), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padding:
        batch["attention_mask"] = (torch.arange(length) < int(length * (1 - padding))).long().unsqueeze(0)
    if documents:
        from shardlib.sharding.documents import accept_documents

        accept_documents(model)
        batch["document_ids"] = (torch.arange(length) * documents // length).unsqueeze(0)
    with SquareProbe(length * length // (2 * sp)) as probe:
        model(**batch).loss.backward()
    return sorted(set(probe.found))
