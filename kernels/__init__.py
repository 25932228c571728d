"""Fused kernels (installed as ``shardlib.kernels``), each with a reference implementation it is tested against
and a switch in :class:`Kernels`, passed as ``shard(model, mesh, kernels=Kernels(...))``.

* :mod:`.attention`: the attention implementation through transformers' attention interface (PyTorch SDPA or the
  model's eager reference) and the all-to-all sequence-parallel attention that wraps either.
* :mod:`.fused_qkv`: one GEMM for the q, k and v projections (k and v of cross-attention), parameters unchanged.
* :mod:`.epilogues`: bias + GELU after the first MLP linear, dropout + residual add (torch.compile'd).

Where each kernel applies is the policy's data (``Plan.attention``, ``Plan.fused_projections``,
``Plan.epilogues``); this package installs them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Kernels:
    """Which kernels :func:`shardlib.shard` installs. Every choice computes the same function (tested against its
    reference); the defaults are the ones measured not slower on CPU (``benchmarks/kernels.py``,
    docs/kernels.md).

    ``attention``: None (default): the model's own implementation, as ``from_pretrained(attn_implementation=...)``
    or transformers' default (SDPA) set it; "sdpa" (``torch.nn.functional.scaled_dot_product_attention`` through
    HF's attention interface, T5's position bias as its additive mask) or "eager" (the model's own
    matmul-softmax-matmul reference). Neither is faster everywhere on CPU: SDPA wins from a few hundred tokens
    without dropout, eager at 128 tokens and with dropout (docs/kernels.md).
    ``fused_qkv``: q, k and v (cross-attention: k and v) from one GEMM.
    ``bias_gelu``: the first MLP linear's bias added inside a compiled GELU.
    ``dropout_add``: each residual dropout + add as one compiled op (mask stored as 1 byte per element).
    """

    attention: str | None = None
    fused_qkv: bool = False
    bias_gelu: bool = False
    dropout_add: bool = False

    def problems(self, sites) -> list[str]:
        """Everything that stops these kernels at ``sites``, checked before anything changes. ``sites``: (kind, path,
        module, child linear names or None) of every module a switched-on kernel goes to (the sharder finds them
        from the plan: ``shardlib.sharding.passes.kernel_sites``)."""
        from .attention import attention_problems
        from .epilogues import epilogue_problems
        from .fused_qkv import fused_qkv_problems

        problems = attention_problems(self.attention)
        for kind, path, module, names in sites:
            if kind == "fused_qkv":
                problems += fused_qkv_problems(path, {n: getattr(module, n) for n in names})
            else:
                problems += epilogue_problems(kind, path, module)
        return problems

    def install(self, sites) -> dict[str, list[str]]:
        """Install the fused-QKV and epilogue kernels at ``sites`` (as for :meth:`problems`) of the already sharded
        model; returns the paths per kernel."""
        from .epilogues import INSTALLERS
        from .fused_qkv import fuse_linears

        installed: dict[str, list[str]] = {}
        for kind, path, module, names in sites:
            if kind == "fused_qkv":
                fuse_linears([getattr(module, n) for n in names], names=[f"{path}.{n}" for n in names])
            else:
                INSTALLERS[kind](path, module)
            installed.setdefault(kind, []).append(path)
        return installed


__all__ = ["Kernels"]
