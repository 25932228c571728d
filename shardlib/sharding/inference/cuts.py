"""Proof of an inferred trunk's pipeline cuts, before ``shard()`` pipelines a model by it.

A pipeline stage that starts inside a layer stack receives only what :attr:`Stack.carry` names (the hidden state),
runs stand-ins for the stack's embeddings (:attr:`Stack.before`), and a stage after an encoder receives its output
as ``encoder_outputs`` (:mod:`shardlib.pipeline.split`). Whether that is all a layer needs is a property of the
architecture's forward (a layer that takes a value its predecessor computed, like T5's position bias, needs more),
so it is proven, like the tensor-parallel plan, on a verification twin: the twin is cut into one stage per layer
(every cut the trunk has, inside and between stacks), its stages are run one after the other in this process, what
one returns handed to the next, and the loss (or output) and every gradient must equal the uncut twin's. No
communication is involved: the cut is what is proven here, the transport is the pipeline runner's own (tested).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn

from ...parallel.random import preserved_rng
from ..examples import example_batch
from ..plan import PlanError
from .twin import verification_twin
from .verify import ATOL, LOSS_TOLERANCE, RTOL, weighted_sum


@dataclass(frozen=True)
class _AllStagesHere:
    """The mesh view a single process runs every stage of a split on."""

    pp: int = 1

    def local_rank(self, dim: str) -> int:
        return 0

    def group(self, dim: str):
        return None


def _objective(out) -> torch.Tensor:
    """What the last stage returns, as a scalar: the loss, or a fixed weighting of the first output."""
    value = out[0] if isinstance(out, tuple) else (out.loss if getattr(out, "loss", None) is not None
                                                    else out[next(iter(out.keys()))])
    return value if value.dim() == 0 else weighted_sum(value)


def verify_cuts(model: nn.Module, plan) -> float:
    """Prove that ``plan.trunk`` may be cut between any two of ``model``'s layers (module docstring); returns the
    seconds it took. Raises :class:`PlanError` naming the stage that raised or the first stage whose result
    differs."""
    from ...pipeline import PipelineSplit, stage_plan

    start = time.perf_counter()
    name = type(model).__name__
    with preserved_rng():
        torch.manual_seed(0)
        twin, _ = verification_twin(model, 1)
        twin.eval()
        cut = copy.deepcopy(twin)
        batch = example_batch(twin, 2, 6, device="cpu", generator=torch.Generator().manual_seed(1))
        batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
        expected = _objective(twin(**batch))
        expected.backward()
        paths = [stack.layers for stack in plan.trunk]
        nested = [(a, b) for a in paths for b in paths if b.startswith(a + ".")]
        if nested:
            raise PlanError(f"the inferred layer trunk of {name} cannot be cut into pipeline stages: its layer "
                            f"stacks are nested ({nested[0][0]} holds {nested[0][1]}: shared layer groups that run "
                            "several times per forward, as ALBERT's). Use pp=1")
        layers = sum(len(cut.get_submodule(stack.layers)) for stack in plan.trunk)
        try:
            stages = stage_plan(cut, plan.trunk, layers)
        except PlanError as exc:
            raise PlanError(f"the inferred layer trunk of {name} cannot be cut into pipeline stages: {exc}. Use "
                            "pp=1, or write a policy for it (docs/policy-authoring.md)") from None
        split = PipelineSplit(cut, plan.trunk, stages, _AllStagesHere(), layers)
        first_input = next(k for k, v in batch.items() if torch.is_tensor(v))
        received: tuple = (batch[first_input],)
        for stage in split.stage_modules:
            stage.input_name = first_input if stage.index == 0 else None
            try:
                received = stage(*received, **batch)
            except Exception as exc:  # noqa: BLE001 - the cut does not even run: say where, refuse
                raise PlanError(
                    f"the inferred layer trunk of {name} cannot be cut into pipeline stages: stage {stage.index} "
                    f"({', '.join(split.plan.layers[stage.index])}, verified on a 2-layer twin) raised "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. Use pp=1, or write a "
                    "policy that names what crosses the cut (Stack.carry, docs/policy-authoring.md)") from exc
        actual = _objective(received)
        actual.backward()
    rtol, atol = LOSS_TOLERANCE.get(plan.loss.kind if plan.loss is not None else "", (RTOL, ATOL))
    problems = [] if torch.allclose(actual.detach(), expected.detach(), rtol=rtol, atol=atol) else [
        f"loss {actual.item():.12g} != uncut {expected.item():.12g}"]
    grads = dict(cut.named_parameters())
    problems += [f"gradient of {n}" for n, p in twin.named_parameters() if p.grad is not None and (
        grads[n].grad is None or not torch.allclose(grads[n].grad, p.grad, rtol=rtol, atol=atol))]
    if problems:
        raise PlanError(
            f"the inferred layer trunk of {name} does not compute what the model computes when cut into pipeline "
            f"stages ({' | '.join(', '.join(s) for s in split.plan.layers)}; verified on a 2-layer float64 twin): "
            f"{'; '.join(problems[:4])}{' ...' if len(problems) > 4 else ''}: a layer needs more than the hidden "
            "state from its predecessor. Use pp=1, or write a policy that names what crosses the cut (Stack.carry, "
            "docs/policy-authoring.md)")
    return time.perf_counter() - start


__all__ = ["verify_cuts"]
