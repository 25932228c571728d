"""Proof before use: an inferred plan is run, sharded and unsharded, on one small random batch before ``shard()``
returns, and must give the same loss (or outputs) and every parameter's gradient.

It runs on a verification twin (:func:`.twin.verification_twin`: same class, 2 layers, widths tp divides, float64,
dropout off) on the mesh's tensor-parallel group, so every tp rank takes part, and with sequence parallelism over sp
(all-to-all, ring) on its tp x sp groups, with heads tp * sp divides under all-to-all. It never touches the model
being sharded: a mismatch refuses with the first module whose output diverges, and the model is left as it was.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

import torch
from torch import nn

from ...parallel.random import preserved_rng
from ..examples import example_batch
from ..plan import PlanError
from ..sequence import ALL_TO_ALL, SP_MODES
from ..state import full_state_dict
from .twin import verification_twin

#: float64 on 2 layers: reorderings of sums at 1e-16 unit roundoff; a wrong plan is off by O(1)
RTOL, ATOL = 1e-7, 1e-9
#: a causal-LM loss transformers computes in float32 whatever the model's dtype (``logits.float()``): its
#: gradients carry float32 rounding in the reference itself
LOSS_TOLERANCE = {"causal_lm": (1e-4, 1e-6)}


@dataclass(frozen=True)
class ProofMesh:
    """The tensor-parallel group of a mesh, and its sequence-parallel group when the proof covers sequence
    parallelism over sp (no pipeline, no data parallelism): what the twin is sharded over."""

    tp: int
    tp_rank: int
    tp_group: object
    device_type: str = "cpu"
    sp: int = 1
    sp_rank: int = 0
    sp_group: object = None
    source: object = None  # the mesh these groups are of (its sp dimension splits for Ulysses x ring)
    dp: int = 1
    pp: int = 1

    def size(self, dim: str) -> int:
        return {"tp": self.tp, "sp": self.sp}.get(dim, 1)

    def group(self, dim: str):
        return self.sp_group if dim == "sp" else self.tp_group

    def split_sp(self, ulysses: int):
        return self.source.split_sp(ulysses)

    def __str__(self) -> str:
        return f"tp={self.tp}" + (f", sp={self.sp}" if self.sp > 1 else "")


def proof_mesh(mesh, sequence_parallel, ulysses: int = 1) -> tuple[ProofMesh, int]:
    """The groups of ``mesh`` the proof runs on, and the degree the verification twin's heads are multiples of:
    tp, and with sequence parallelism over sp the sp group too (all-to-all splits the heads over tp * sp, Ulysses
    inside a ring over tp * ulysses)."""
    device = getattr(mesh, "device_type", "cpu")
    if sequence_parallel in SP_MODES and getattr(mesh, "sp", 1) > 1:
        view = ProofMesh(mesh.tp, mesh.tp_rank, mesh.tp_group, device, mesh.sp, mesh.sp_rank, mesh.group("sp"), mesh)
        return view, mesh.tp * (mesh.sp if sequence_parallel == ALL_TO_ALL else ulysses)
    return ProofMesh(mesh.tp, mesh.tp_rank, mesh.tp_group, device), mesh.tp


def weighted_sum(value: torch.Tensor) -> torch.Tensor:
    """A fixed, non-symmetric scalar function of an output (every feature weighted differently), in float64."""
    return (value.double() * torch.linspace(-1, 1, value.shape[-1], dtype=torch.float64)).sum()


def _objective(out) -> torch.Tensor:
    """The loss when the model computed one, else a fixed function of every floating output."""
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    total = torch.zeros((), dtype=torch.float64)
    for value in out.values():
        if torch.is_tensor(value) and value.is_floating_point():
            total = total + weighted_sum(value)
    return total


def verify(model: nn.Module, policy, mesh, shard, **options) -> float:
    """Prove ``policy``'s plan for ``model``'s class at ``mesh.tp`` (and ``mesh.sp`` under sequence parallelism over
    sp) with ``shard()``'s ``options`` (sequence parallelism; module docstring); returns the seconds it took. Raises
    :class:`PlanError` naming the first diverging module, or the module that raised when the sharded twin does not run
    at all.

    ``shard``: the function that shards the twin, :func:`shardlib.sharding.sharder.shard` (its caller passes it: the
    proof sits below the sharder, which runs it)."""
    start = time.perf_counter()
    view, degree = proof_mesh(mesh, options.get("sequence_parallel"), options.get("ulysses", 1))
    with preserved_rng():
        torch.manual_seed(0)  # every rank of the groups builds the same twin and batch
        twin, _ = verification_twin(model, degree)
        twin.eval()  # no dropout anywhere (some heads' rates are constants, not config fields); gradients still flow
        sharded = shard(copy.deepcopy(twin), view, policy=policy, gather_logits=True, verify_plan=False, **options)
        batch = example_batch(twin, 2, 6, device="cpu", generator=torch.Generator().manual_seed(1))
        batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
        expected = _objective(twin(**batch))
        expected.backward()
        with _running(sharded) as where:
            try:
                actual = _objective(sharded(**batch))
                actual.backward()
            except Exception as exc:  # noqa: BLE001 - the plan does not even run: say where, refuse
                raise PlanError(f"the inferred plan for {type(model).__name__} does not run at {view}"
                                f"{' with ' + repr(options) if any(options.values()) else ''} (verified on a 2-layer "
                                f"twin): {type(exc).__name__} in module {where[-1] if where else '(the model)'!r}: "
                                f"{str(exc).splitlines()[0]}. The model was not changed; write a policy for it "
                                "(docs/policy-authoring.md)") from exc
        grads = full_state_dict(sharded, grads=True)
    plan = policy.plan(twin, view.tp)
    rtol, atol = LOSS_TOLERANCE.get(plan.loss.kind if plan.loss is not None else "", (RTOL, ATOL))
    problems = []
    if not torch.allclose(actual.detach(), expected.detach(), rtol=rtol, atol=atol):
        problems.append(f"loss {actual.item():.12g} != unsharded {expected.item():.12g}")
    for name, p in twin.named_parameters():
        if p.grad is None:
            continue
        if name not in grads or not torch.allclose(grads[name], p.grad, rtol=rtol, atol=atol):
            problems.append(f"gradient of {name}")
    if problems:
        where = first_divergence(twin, sharded, batch)
        raise PlanError(f"the inferred plan for {type(model).__name__} does not compute what the model computes at "
                        f"{view} (verified on a 2-layer float64 twin): first diverging module: {where}; "
                        f"{'; '.join(problems[:4])}{' ...' if len(problems) > 4 else ''}. The model was not changed; "
                        "write a policy for it (docs/policy-authoring.md) or report the model")
    return time.perf_counter() - start


@contextlib.contextmanager
def _running(model: nn.Module):
    """Yields the stack of module paths running now (the innermost last): where an error was raised."""
    stack: list[str] = []
    names = {id(m): name for name, m in model.named_modules()}

    def enter(mod, args):
        stack.append(names[id(mod)])

    def leave(mod, args, out):  # not always_call: a module that raised stays on the stack
        stack.pop()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def first_divergence(reference: nn.Module, sharded: nn.Module, batch: dict) -> str:
    """The first module, in forward order, whose output differs between the two models (outputs compared where
    the sharded one has the full shape, i.e. is replicated)."""
    records: dict[str, list] = {"ref": [], "shard": []}

    def hooks(model, key):
        handles = []
        for name, module in model.named_modules():
            def hook(mod, args, out, name=name):
                value = out[0] if isinstance(out, (tuple, list)) and out else out
                if torch.is_tensor(value) and value.is_floating_point():
                    records[key].append((name, value.detach().clone()))
            handles.append(module.register_forward_hook(hook))
        return handles

    handles = hooks(reference, "ref") + hooks(sharded, "shard")
    try:
        reference(**batch)
        sharded(**batch)
    finally:
        for h in handles:
            h.remove()
    theirs = dict(records["shard"])
    for name, value in records["ref"]:
        other = theirs.get(name)
        if other is not None and other.shape == value.shape \
                and not torch.allclose(other, value, rtol=RTOL, atol=ATOL):
            return f"{name} ({type(reference.get_submodule(name)).__name__})" if name else "the model's output"
    return "none found module by module (the loss or a gradient differs)"


__all__ = ["verify", "first_divergence", "ProofMesh", "proof_mesh"]
