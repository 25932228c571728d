"""The gradients of a training step once summed (:class:`StepGradients`, one per
:class:`~shardlib.train.trainer.Trainer`): their global norm over the whole mesh, clipping, whether any is not
finite anywhere on the mesh, and the names of the non-finite ones (this rank's, or every rank's when a run stops on
them). Split from the Trainer, which owns the step's order and delegates to this; the sums over pipeline stages and
dp are :mod:`shardlib.train.dataparallel`'s."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import get_total_norm

from ..parallel.layout import named_layouts
from .fsdp import local
from .optim import param_pairs
from .precision import found_non_finite


class StepGradients:
    """``params``: what this rank's model holds; ``optimizer``: what steps them (None: no step, each parameter is
    its own stepped tensor); ``zero``: the ZeRO stage (above 0 each dp rank steps its own share)."""

    def __init__(self, model: nn.Module, mesh, split, params: list, optimizer, zero: int):
        self.model, self.mesh, self.split, self.params = model, mesh, split, params
        self.optimizer, self.zero = optimizer, zero
        self._counted: list | None = None
        self._over_ep: set[int] | None = None

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, the tensor whose gradient the optimizer step reads) for what this rank steps."""
        return param_pairs(self.optimizer) if self.optimizer is not None else [(p, p) for p in self.params]

    def stepped(self) -> list[torch.Tensor]:
        """The gradients the optimizer step reads, as this rank's local tensors."""
        return [local(t.grad) for _, t in self.pairs() if t.grad is not None]

    def _norm_tensors(self) -> list[torch.Tensor]:
        """The tensors (stepped by this rank) whose gradients count toward the global gradient norm (fixed by the
        layouts, computed once): tensor-parallel shards on every tp rank, replicated parameters on tp rank 0,
        tied ones on the first pp rank holding them; under zero, each on the dp rank stepping it."""
        if self._counted is None:
            layouts = {id(t): layout for _, t, layout in named_layouts(self.model)}
            tp_rank = self.mesh.tp_rank if self.mesh.tp > 1 else 0
            first_holder = self._first_pp_holder()
            self._counted = [t for p, t in self.pairs()
                             if (tp_rank == 0 or (id(p) in layouts and layouts[id(p)].is_sharded))
                             and first_holder.get(id(p), True)]
        return self._counted

    def _first_pp_holder(self) -> dict[int, bool]:
        """id(param) -> whether this pp rank is the lowest one holding it (tied parameters count once)."""
        if self.split is None:
            return {}
        result = {}
        for name, _, _, ranks in self.split.tied:
            if self.split.pp_rank in ranks:
                result[id(self.model.get_parameter(name))] = self.split.pp_rank == min(ranks)
        return result

    def norm(self) -> torch.Tensor:
        """The global L2 norm of the gradient of the whole (unsharded) model (a float64 scalar tensor on the
        parameters' device): tensor-parallel shards summed, replicated and tied parameters counted once. The local
        part is torch's fused ``get_total_norm`` (what ``clip_grad_norm_`` uses); squares are summed over tp and pp,
        and those of experts split over ep (expert parallelism) over ep too."""
        device = self.params[0].device if self.params else torch.device("cpu")
        split = self._split_over_ep()
        parts = [[local(t.grad) for t in self._norm_tensors() if t.grad is not None and (id(t) in split) == over_ep]
                 for over_ep in (False, True)]
        squares = torch.stack([(get_total_norm(grads, 2.0, foreach=True) if grads else torch.zeros((), device=device))
                               .double().square() for grads in parts])
        for dim in ("tp", "pp") + (("dp",) if self.zero else ()):  # under zero each dp rank holds its own share
            if self.mesh.size(dim) > 1:
                dist.all_reduce(squares, group=self.mesh.group(dim))
        if split and getattr(self.mesh, "ep", 1) > 1 and not self.zero:  # under zero: summed over dp = ep x edp
            dist.all_reduce(squares[1:], group=self.mesh.group("ep"))
        return squares.sum().sqrt()

    def _split_over_ep(self) -> set[int]:
        """Ids of the stepped tensors whose parameter is split over ep (each ep rank holds other experts): fixed by
        the layouts, computed once, as :meth:`_norm_tensors`."""
        if self._over_ep is None:
            layouts = {id(t): layout for _, t, layout in named_layouts(self.model)}
            self._over_ep = {id(t) for p, t in self.pairs() if id(p) in layouts and layouts[id(p)].ep > 1}
        return self._over_ep

    def clip(self, max_norm: float, *, raise_non_finite: bool = True) -> float:
        """Scale every gradient so that the global norm is at most ``max_norm`` (torch's ``clip_grads_with_norm_``
        rule: by ``max_norm / (norm + 1e-6)`` when that is below 1, applied here to local tensors, which FSDP2's
        DTensor gradients need); returns the norm before.

        A non-finite norm is an error, on every rank alike (the norm is global), naming the parameters whose
        gradients hold inf/nan on this rank: clipping cannot bound it, and scaling by ``max_norm / nan`` would write
        nan into every parameter. Nothing is stepped. (Skipping the step instead is the fp16 loss scaler's answer
        to an overflow that its scale caused, and ``Trainer(skip_nonfinite=True)``'s, which passes
        ``raise_non_finite=False``: the non-finite norm is returned and nothing is scaled. In fp32 / bf16 a
        non-finite gradient is otherwise a diverged run, which Megatron also stops on.)"""
        norm = self.norm()
        value = float(norm)
        if not math.isfinite(value):
            if not raise_non_finite:
                return value
            raise FloatingPointError(f"the gradient norm is {value} (max_grad_norm={max_norm}); the optimizer did "
                                     f"not step. Non-finite gradients on this rank: {self.non_finite()}. "
                                     "Lower the learning rate, or look for an overflowing loss or input")
        grads = self.stepped()
        if grads:
            coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coefficient.to(grads[0].device))
        return value

    def any_non_finite(self) -> bool:
        """Whether any gradient the optimizer step would read, on any rank of the whole mesh, holds an inf or nan:
        the loss scaler's check (:func:`shardlib.train.precision.found_non_finite`: one fused pass over this
        rank's gradients, one all-reduce of one flag over the world). The same answer on every rank."""
        return found_non_finite(self.stepped())

    def non_finite_names(self) -> list[str]:
        """This rank's parameters whose (stepped) gradient holds an inf or nan, in model order."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        return [names.get(id(p), "?") for p, t in self.pairs()
                if t.grad is not None and not bool(torch.isfinite(local(t.grad)).all())]

    def non_finite(self) -> str:
        """The names of this rank's parameters whose (stepped) gradient holds an inf or nan, for error messages."""
        bad = self.non_finite_names()
        if not bad:
            return "none (they are on another rank)"
        return ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")

    def non_finite_everywhere(self, limit: int = 8) -> str:
        """The parameters whose gradient holds an inf or nan on any rank, each with the ranks (and their mesh
        coordinates) where it does: one ``all_gather_object`` of every rank's :meth:`non_finite_names` over the
        world. A collective: for the failure path only, called by every rank (the skip decision is global)."""
        mine = (dist.get_rank() if dist.is_initialized() else 0, self._coordinates(), self.non_finite_names())
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        where: dict[str, list[str]] = {}
        for rank, coordinates, names in everyone:
            for name in names:
                where.setdefault(name, []).append(f"rank {rank}" + (f" ({coordinates})" if coordinates else ""))
        if not where:
            return "none: every gradient is finite; their norm is not (a square overflowed)"
        parts = [f"{name} on {', '.join(ranks)}" for name, ranks in where.items()]
        return "; ".join(parts[:limit]) + (f"; and {len(parts) - limit} more" if len(parts) > limit else "")

    def _coordinates(self) -> str:
        """This rank's place on the mesh's dimensions of more than one rank (``"dp=1, tp=0"``)."""
        return ", ".join(f"{dim}={self.mesh.local_rank(dim)}" for dim in ("dp", "pp", "sp", "tp")
                         if self.mesh.size(dim) > 1)
