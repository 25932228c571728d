"""An inferred plan as a policy module a person can review, edit and commit (``shardlib plan --auto MODEL
--write-policy FILE``): the same plan, written as the hand policies are (docs/policy-authoring.md), with the
evidence for each decision as comments. Registering it (importing the file) makes ``shard()`` use it instead of
inferring."""

from __future__ import annotations

from ...parallel.experts import ExpertsTensorParallel
from ...parallel.norms import ColwiseNorm, PartialGrads
from ...parallel.styles import as_tuple
from . import Inferred


#: the styles of :mod:`shardlib.parallel.norms` a written policy imports from there
NORM_STYLES = (PartialGrads, ColwiseNorm)


def _style_source(style) -> str:
    from ...parallel.styles import CopyInputs

    if isinstance(style, CopyInputs):
        names = ", ".join(repr(n) for n in style.names)
        extra = "" if style.sequence_inputs == ("hidden_states",) else f", sequence_inputs={style.sequence_inputs!r}"
        return f"CopyInputs({names}{extra})"
    fields = {k: v for k, v in vars(style).items() if v != getattr(type(style), k, object())}
    return f"{type(style).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


def policy_source(inferred: Inferred, model_class: type) -> str:
    """Python source of a policy module registering ``inferred``'s plan for ``model_class``."""
    plan = inferred.plan
    styles = "\n".join(f"            {pattern!r}: "
                       + (_style_source(s[0]) if len(s := as_tuple(styles)) == 1
                          else "(" + ", ".join(_style_source(x) for x in s) + ")") + ","
                       for pattern, styles in plan.styles.items())
    divide = "\n".join(f"            {p!r}: {names!r}," for p, names in plan.divide_by_tp.items())
    trunk = "\n".join(f"            Stack(layers={s.layers!r}, before={s.before!r}, after={s.after!r}, carry={s.carry!r}, "
                      f"end={s.end!r}, output_arg={s.output_arg!r})," for s in plan.trunk)
    loss = (f"LossSpec(kind={plan.loss.kind!r}, head={plan.loss.head!r})" if plan.loss is not None else "None")
    attention = "\n".join(f"            {pattern!r}: {site!r}," for pattern, site in plan.attention.items())
    evidence = "\n".join(f"#   {site}: {item}" for site, items in inferred.evidence.items() for item in items)
    unplaced = "\n".join(f"#   {u.module}: {u.why}" for u in inferred.unplaced) or "#   (none)"
    name = model_class.__name__
    norms = sorted({type(x).__name__ for s in plan.styles.values() for x in as_tuple(s) if isinstance(x, NORM_STYLES)})
    norms = f"from shardlib.parallel.norms import {', '.join(norms)}\n" if norms else ""
    if any(isinstance(x, ExpertsTensorParallel) for s in plan.styles.values() for x in as_tuple(s)):
        norms += "from shardlib.parallel.experts import ExpertsTensorParallel\n"
    moe = "\n".join(f"            {pattern!r}: {site!r}," for pattern, site in plan.moe.items())
    return f'''"""Tensor-parallel policy for {name}, written by `shardlib plan --auto` from the model's exported graph.
Review it, then import this module before shard() to use it instead of inference (docs/inferred-plans.md)."""

from transformers import {name}

{norms}from shardlib.parallel.styles import ColwiseParallel, CopyInputs, LocalRNG, RowwiseParallel, VocabParallel
from shardlib.policies import Policy, register_policy
from shardlib.sharding.plan import AttentionSite, HeadsOf, LossItems, LossSpec, MoESite, Plan, Stack

# Evidence (graph nodes of a 2-layer twin):
{evidence}
# Left replicated:
{unplaced}


def make_plan(model, tp: int) -> Plan:
    return Plan(
        styles={{
{styles}
        }},
        divide_by_tp={{
{divide}
        }},
        trunk=(
{trunk}
        ),
        loss={loss},
        sequence_dropout={plan.sequence_dropout!r},
        attention={{
{attention}
        }},
        loss_items={plan.loss_items!r},
        moe={{
{moe}
        }},
    )


POLICY = register_policy(Policy(name={name.lower()!r}, model_classes=({name},), make_plan=make_plan))
'''


__all__ = ["policy_source"]
