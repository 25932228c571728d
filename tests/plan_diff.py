"""Differences between two plans of one model, module by module (tests/test_inference.py: hand policies against the
inferred plans)."""

from __future__ import annotations

from shardlib.parallel.styles import as_tuple, style_name
from shardlib.sharding.plan import match_modules


def per_module(plan, model) -> dict[str, str]:
    """{module path: its styles} and {module path: divided attributes}, patterns resolved against ``model``."""
    modules = list(dict(model.named_modules()))
    out: dict[str, str] = {}
    for pattern, styles in plan.styles.items():
        for path in match_modules(pattern, modules):
            out[f"style {path}"] = " + ".join(sorted(style_name(s) for s in as_tuple(styles)))
    for pattern, names in plan.divide_by_tp.items():
        for path in match_modules(pattern, modules):
            out[f"divide {path}"] = ", ".join(sorted(names))
    for stack in plan.trunk:
        out[f"trunk {stack.layers}"] = (f"before={sorted(stack.before)} after={sorted(stack.after)} "
                                        f"carry={list(stack.carry)} end={stack.end} output_arg={stack.output_arg}")
    for pattern in plan.sequence_dropout:
        for path in match_modules(pattern, modules):
            out[f"sequence_dropout {path}"] = "yes"
    out["loss"] = f"{plan.loss.kind} on {plan.loss.head}" if plan.loss is not None else "none"
    out["loss_items"] = repr(plan.loss_items)
    return out


def differences(hand, inferred, model) -> list[str]:
    a, b = per_module(hand, model), per_module(inferred, model)
    return [f"{key}: hand {a.get(key, '-')} | inferred {b.get(key, '-')}" for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key)]
