"""Fused kernels (installed as ``shardlib.kernels``), each with a reference implementation it is tested against
and a switch in :class:`Kernels`, passed as ``shard(model, mesh, kernels=Kernels(...))``.

* :mod:`.attention`: the attention implementation through transformers' attention interface (PyTorch SDPA or the
  model's eager reference) and the all-to-all sequence-parallel attention that wraps either.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Kernels:
    """Which kernels :func:`shardlib.shard` installs. The defaults are the fastest measured on CPU
    (``benchmarks/kernels.py``, docs/benchmarks.md); every choice computes the same function.

    ``attention``: "sdpa" (``torch.nn.functional.scaled_dot_product_attention`` through HF's attention interface,
    T5's position bias as its additive mask) or "eager" (the model's own matmul-softmax-matmul reference).
    """

    attention: str = "sdpa"

    def problems(self) -> list[str]:
        from .attention import attention_problems

        return attention_problems(self.attention)


__all__ = ["Kernels"]
