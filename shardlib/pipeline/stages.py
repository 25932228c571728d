"""Pipeline stage assignment, pure functions of a model's trunk.

:func:`assign_stages` splits a list of per-layer costs into contiguous, non-empty ranges that minimize the most
expensive stage; :func:`stage_plan` applies it to a model's trunk and returns the module paths of every stage.
Embeddings live with the first layer of their stack, final norms with its last layer, heads and everything else
outside the trunk with the last stage, and each one's cost is charged to that layer, so "embeddings and LM heads
are not free".
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..sharding.plan import PlanError, Stack


def assign_stages(costs: list[float], num_stages: int, layers_per_stage: list[int] | None = None) -> list[range]:
    """Split layers ``0..len(costs)-1`` into ``num_stages`` contiguous non-empty ranges.

    Without ``layers_per_stage`` the split minimizes the largest stage cost (sum of its layers' costs); among
    equally good splits it takes the one whose earlier stages are largest. With it, the counts are used as given.
    """
    n = len(costs)
    if num_stages < 1:
        raise PlanError(f"the number of pipeline stages must be >= 1, got {num_stages}")
    if num_stages > n:
        raise PlanError(f"{num_stages} pipeline stages but only {n} layers: every stage needs at least one layer")
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != num_stages or any(c < 1 for c in counts) or sum(counts) != n:
            raise PlanError(f"layers_per_stage {counts} must be {num_stages} positive counts summing to {n} layers")
    else:
        counts = _balanced_counts([float(c) for c in costs], num_stages)
    stages, start = [], 0
    for c in counts:
        stages.append(range(start, start + c))
        start += c
    return stages


def _balanced_counts(costs: list[float], num_stages: int) -> list[int]:
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible largest-stage cost of layers [0, i) in k stages; cut[k][i] its last cut
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):  # last stage = layers [j, i)
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] or (value == best[k][i] and j > cut[k][i]):
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(num_stages, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def module_cost(modules) -> float:
    """Forward FLOPs per token of the matmuls (2 x weight size for each Linear / Conv) plus one per parameter
    element (memory, optimizer and gradient traffic), each parameter counted once."""
    seen, total = set(), 0.0
    for module in modules:
        for sub in module.modules():
            for p in sub._parameters.values():
                if p is None:
                    continue
                if isinstance(sub, (nn.Linear, nn.Conv1d, nn.Conv2d)) and p is sub.weight:
                    total += 2 * p.numel()
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
    return total


@dataclass(frozen=True)
class StagePlan:
    """``layers[s]``: the layer paths of stage s in forward order (over all stacks); ``modules[s]``: every
    module path stage s runs (its layers, embeddings and final norms of its stacks, and on the last stage every
    module outside the trunk); ``costs[s]``: the cost-model total of stage s."""

    layers: tuple[tuple[str, ...], ...]
    modules: tuple[tuple[str, ...], ...]
    costs: tuple[float, ...]


def _trunk_layers(model: nn.Module, trunk: tuple[Stack, ...]) -> list[tuple[int, str]]:
    layers = []
    for k, stack in enumerate(trunk):
        module_list = model.get_submodule(stack.layers)
        layers += [(k, f"{stack.layers}.{key}") for key in module_list._modules]
    return layers


def _outside_trunk(model: nn.Module, trunk: tuple[Stack, ...]) -> list[str]:
    """The outermost modules holding parameters or buffers that no stack path covers (heads, poolers, ...). A
    module that also holds parts of the trunk (BART's root, with its ``final_logits_bias`` buffer) is given by the
    paths of its own tensors instead, so that the trunk's parameters are not claimed by the last stage."""
    covered = [s.layers for s in trunk] + [p for s in trunk for p in (*s.before, *s.after)]

    def inside(path, roots):
        return any(path == r or path.startswith(r + ".") or not r for r in roots)

    found: list[str] = []
    for path, module in model.named_modules():
        if inside(path, covered) or inside(path, found):
            continue
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if own and any(not path or c.startswith(path + ".") for c in covered):
            found += [f"{path}.{name}" if path else name for name, _ in own]
        elif own:
            found.append(path)
    return found


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:  # a tensor's path
        return None


def _cost(model: nn.Module, paths) -> float:
    """:func:`module_cost` of the modules at ``paths`` plus the size of the parameters some paths name alone."""
    modules, alone = [], []
    for path in paths:
        module = _module_at(model, path)
        if module is not None:
            modules.append(module)
        else:
            alone += [t for _, t in _held(model, path)]
    return module_cost(modules) + sum(t.numel() for t in alone if isinstance(t, nn.Parameter))


def _held(model: nn.Module, path: str) -> list[tuple[str, object]]:
    """(name, tensor) of every parameter and buffer (each alias) a stage's module path holds; a path may also name
    a single tensor (:func:`_outside_trunk`)."""
    module = _module_at(model, path)
    if module is None:
        owner, _, name = path.rpartition(".")
        return [(path, getattr(model.get_submodule(owner), name))]
    prefix = f"{path}." if path else ""
    return [(prefix + name, t) for name, t in [*module.named_parameters(remove_duplicate=False),
                                                *module.named_buffers(remove_duplicate=False)]]


def stage_plan(model: nn.Module, trunk: tuple[Stack, ...], num_stages: int,
               layers_per_stage: list[int] | None = None) -> StagePlan:
    """Module paths per pipeline stage for ``model`` (pure: reads the model, changes nothing)."""
    if not trunk:
        raise PlanError(f"{type(model).__name__}: the policy declares no layer trunk, so it cannot be pipelined")
    for stack in trunk[:-1]:
        if not (stack.end and stack.output_arg):
            raise PlanError(f"stack {stack.layers} is followed by another stack but names no end module and "
                            "output_arg, so stages after it could not receive its output")
    layers = _trunk_layers(model, trunk)
    if not layers:
        raise PlanError(f"{type(model).__name__}: the trunk has no layers")
    attached: dict[int, list[str]] = {i: [] for i in range(len(layers))}
    for k, stack in enumerate(trunk):
        indices = [i for i, (kk, _) in enumerate(layers) if kk == k]
        if indices:
            attached[indices[0]] += [p for p in stack.before if _exists(model, p)]
            attached[indices[-1]] += [p for p in stack.after if _exists(model, p)]
    attached[len(layers) - 1] += _outside_trunk(model, trunk)
    costs = [_cost(model, [path, *attached[i]]) for i, (_, path) in enumerate(layers)]
    ranges = assign_stages(costs, num_stages, layers_per_stage)
    return StagePlan(
        layers=tuple(tuple(layers[i][1] for i in r) for r in ranges),
        modules=tuple(tuple(p for i in r for p in (layers[i][1], *attached[i])) for r in ranges),
        costs=tuple(sum(costs[i] for i in r) for r in ranges),
    )


def _exists(model, path) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def tensor_owners(model: nn.Module, plan: StagePlan) -> dict[str, set[int]]:
    """Parameter / buffer name (every alias) -> the stages whose modules use it under that name (pure)."""
    result: dict[str, set[int]] = {}
    for s, roots in enumerate(plan.modules):
        for root in roots:
            for name, _ in _held(model, root):
                result.setdefault(name, set()).add(s)
    return result


