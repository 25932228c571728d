"""HF checkpoints that store a fused experts module one tensor per expert, read straight into its shards.

transformers keeps Mixtral's, Qwen2-MoE's and Qwen3-MoE's experts in memory as 3-D tensors (``gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I]) but on the Hub one tensor per expert (``experts.<e>.w1.weight`` /
``gate_proj``, ``w3`` / ``up_proj``, ``w2`` / ``down_proj``, under Mixtral's older ``block_sparse_moe`` name), and
merges them on load by its conversion mapping (``transformers.conversion_mapping``). This module reads that mapping
(its renamings, and the converters that stack per-expert tensors, ``MergeModulelist(dim=0)``, optionally then
concatenate the stacks, ``Concatenate(dim=1)``) and fills each rank's local piece of the 3-D tensor from only the
bytes it holds: its experts under expert parallelism, its rows of each expert's gate and up (or columns of its down
projection) under tensor parallelism. Other conversions transformers knows are not applied: such a checkpoint's
tensors are reported missing / unexpected, by name, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.layout import Layout


@dataclass(frozen=True)
class MergedExperts:
    """The checkpoint keys a fused expert parameter is made of: ``parts[k][e]`` is expert e's tensor of the k-th
    concatenated part (gate, up), each ``rows`` long along the parameter's dim 1."""

    parts: tuple[tuple[str, ...], ...]
    rows: int

    def keys(self) -> set[str]:
        return {key for part in self.parts for key in part}


def _conversions(model: nn.Module) -> tuple[list[tuple[str, str]], list]:
    """(renamings as (checkpoint fragment, memory fragment), the stacking converters) of ``model``'s class."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    try:
        mapping = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # noqa: BLE001 - a class transformers has no mapping for
        return [], []
    renamings, converters = [], []
    for conversion in mapping:
        operations = [type(op).__name__ for op in getattr(conversion, "operations", [])]
        if type(conversion).__name__ == "WeightRenaming":
            renamings += list(zip(conversion.source_patterns, conversion.target_patterns))
        elif operations in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]) \
                and len(conversion.target_patterns) == 1 and "*" not in conversion.target_patterns[0] \
                and all(p.count("*") == 1 for p in conversion.source_patterns):
            converters.append(conversion)
    return renamings, converters


def renamed_keys(model: nn.Module):
    """``name -> the key transformers' renamings give it on the Hub`` (Mixtral's ``.mlp.`` -> ``.block_sparse_moe.``):
    what a checkpoint of a renaming class is read by, name by name where the model's own is absent."""
    renamings, _ = _conversions(model)

    def to_checkpoint(name: str) -> str:
        for source, target in renamings:
            name = name.replace(target, source)
        return name

    return to_checkpoint


def merged_experts(model: nn.Module, names, files) -> dict[str, MergedExperts]:
    """For each of ``names`` (parameters of ``model``) that transformers merges from per-expert tensors which
    ``files`` hold: where they are. ``files``: a mapping of checkpoint keys (``in`` works)."""
    renamings, converters = _conversions(model)
    to_checkpoint = renamed_keys(model)
    found = {}
    for name in names:
        for conversion in converters:
            target = conversion.target_patterns[0]
            if not name.endswith(target):
                continue
            base = name[: len(name) - len(target)]
            count = _experts_of(model, name)
            parts = tuple(tuple(to_checkpoint(base + pattern.replace("*", str(e))) for e in range(count))
                          for pattern in conversion.source_patterns)
            if count and all(key in files for part in parts for key in part):
                first = files.shape(parts[0][0]) if hasattr(files, "shape") else None
                found[name] = MergedExperts(parts=parts, rows=first[0] if first else 0)
    return found


def expert_keys(model: nn.Module):
    """A predicate: whether a checkpoint key is a per-expert tensor that transformers merges into a fused parameter of
    ``model``'s class (any expert, any layer: the keys of other pipeline ranks' layers too)."""
    import re

    renamings, converters = _conversions(model)
    to_checkpoint = renamed_keys(model)
    patterns = [re.compile(".*" + re.escape(to_checkpoint(p)).replace(r"\*", r"\d+") + "$")
                for conversion in converters for p in conversion.source_patterns]
    return lambda key: any(p.match(key) for p in patterns)


def check_shapes(files, name: str, merged: MergedExperts, layout: Layout) -> None:
    """The per-expert tensors stack and concatenate into ``layout``'s global shape, or a CheckpointError naming
    them."""
    from ..safetensors_io import CheckpointError

    experts, width, depth = layout.global_shape
    shapes = {tuple(files.shape(key)) for part in merged.parts for key in part}
    if len(merged.parts[0]) != experts or shapes != {(merged.rows, depth)} or merged.rows * len(merged.parts) != width:
        raise CheckpointError(f"{name}: the checkpoint's per-expert tensors ({merged.parts[0][0]}, ...: "
                              f"{len(merged.parts[0])} experts of shapes {sorted(shapes)} in {len(merged.parts)} "
                              f"part(s)) do not make the model's {layout.global_shape}")


def _experts_of(model: nn.Module, name: str) -> int:
    """The global expert count of the fused module holding parameter ``name``."""
    owner = model.get_submodule(name.rpartition(".")[0])
    return int(getattr(owner, "_shardlib_global_experts", getattr(owner, "num_experts", 0)))


def read_merged(files, merged: MergedExperts, layout: Layout, rank: int, ep_rank: int, out: torch.Tensor) -> None:
    """Fill ``out`` (this rank's piece of the 3-D parameter laid out by ``layout``) from the per-expert tensors:
    only its experts (those of ep rank ``ep_rank``), only its rows of dim 1 (split in blocks: gate and up) or its
    columns of dim 2 (tp rank ``rank``'s)."""
    experts = range(*layout.ep_range(ep_rank))
    within = layout.within_ep()
    rows = within.ranges(rank) if within.shard_dim == 1 and within.is_sharded else [(0, layout.global_shape[1])]
    columns = within.ranges(rank)[0] if within.shard_dim == 2 and within.is_sharded else None
    for i, e in enumerate(experts):
        filled = 0
        for a, b in rows:
            while a < b:  # a range of dim 1 may span several concatenated parts (unsplit: gate then up)
                k, offset = divmod(a, merged.rows)
                stop = min(b, (k + 1) * merged.rows)
                view = out[i].narrow(0, filled, stop - a)
                if columns is None:
                    files.read_into(merged.parts[k][e], view, 0, offset, offset + stop - a)
                else:  # a slice of each row (a row-parallel down projection): the rows whole, the columns split
                    files.read_into(merged.parts[k][e], view, 1, *columns)
                filled += stop - a
                a = stop


__all__ = ["MergedExperts", "merged_experts", "read_merged", "renamed_keys", "expert_keys", "check_shapes"]
