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
    reference); the defaults are the ones measured not slower on CPU (``benchmarks/kernel_*.py``,
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

    def _sites(self, plan, model):
        """(kind, path, module, child linear names or None) of every module a switched-on kernel goes to."""
        from shardlib.plan import match_modules

        modules = dict(model.named_modules())
        if self.fused_qkv:
            for pattern, names in plan.fused_projections.items():
                for path in match_modules(pattern, modules):
                    yield "fused_qkv", path, modules[path], names
        for kind in ("bias_gelu", "dropout_add"):
            if getattr(self, kind):
                for pattern in plan.epilogues.get(kind, ()):
                    for path in match_modules(pattern, modules):
                        yield kind, path, modules[path], None

    def problems(self, plan, model) -> list[str]:
        """Everything that stops these kernels on ``model`` under ``plan``, checked before anything changes."""
        from .attention import attention_problems
        from .epilogues import epilogue_problems
        from .fused_qkv import fused_qkv_problems

        problems = attention_problems(self.attention)
        for kind, path, module, names in self._sites(plan, model):
            if kind == "fused_qkv":
                problems += fused_qkv_problems(path, {n: getattr(module, n) for n in names})
            else:
                problems += epilogue_problems(kind, path, module)
        return problems

    def install(self, plan, model) -> dict[str, list[str]]:
        """Install the fused-QKV and epilogue kernels on the (already sharded) model; returns the paths per kernel."""
        from .epilogues import INSTALLERS
        from .fused_qkv import fuse_linears

        installed: dict[str, list[str]] = {}
        for kind, path, module, names in list(self._sites(plan, model)):
            if kind == "fused_qkv":
                fuse_linears([getattr(module, n) for n in names], names=[f"{path}.{n}" for n in names])
            else:
                INSTALLERS[kind](path, module)
            installed.setdefault(kind, []).append(path)
        return installed


__all__ = ["Kernels"]
