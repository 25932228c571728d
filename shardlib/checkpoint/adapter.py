"""LoRA adapters of a sharded peft model in peft's own format: ``adapter_model.safetensors`` +
``adapter_config.json``, full tensors, what ``peft.PeftModel.from_pretrained`` reads and writes.

Saving gathers each adapter tensor (and each ``modules_to_save`` copy) over the TP group and lets peft write them
(``PeftModel.save_pretrained(state_dict=...)``) on rank 0, atomically. Loading reads the file (no pickle) and gives
each rank its slice by the parameter's layout. Which model parameter a saved key names is peft's rule
(``get_peft_model_state_dict``, which drops the adapter name); it is asked, not restated, so a future peft renaming
its keys keeps working. A pipelined (pp > 1) or FSDP2 (zero=3) model is not supported yet: save the adapter from a
model sharded without them, or use :func:`shardlib.checkpoint.save` for the whole model.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.layout import layout_of
from ..parallel.timeouts import stalled_ranks_named
from ..safetensors_io import CheckpointError, SafetensorsFile
from ..sharding.adapters import peft_inner_model
from ..sharding.sharded import shard_state
from ..sharding.state import gather_full, tp_group_of
from .atomic import AtomicDirectory
from .outcome import timeout_of
from .saving import _broadcast_str

ADAPTER_FILE = "adapter_model.safetensors"


def is_peft_model(model: nn.Module) -> bool:
    return peft_inner_model(model) is not None and hasattr(model, "peft_config")


def _saved_names(model: nn.Module, adapter: str) -> dict[str, str]:
    """{key in peft's adapter file: parameter name in ``model``} for ``adapter``, by peft's own rule."""
    from peft import get_peft_model_state_dict

    names = [name for name, _ in model.named_parameters()]
    placeholders = {name: torch.tensor(i) for i, name in enumerate(names)}  # each value says which name it was
    saved = get_peft_model_state_dict(model, state_dict=placeholders, adapter_name=adapter)
    return {key: names[int(index)] for key, index in saved.items()}


def _check_supported(model: nn.Module, what: str) -> None:
    if not is_peft_model(model):
        raise TypeError(f"{what} takes a peft model (peft.get_peft_model), got {type(model).__name__}")
    state = shard_state(model)
    if state.pipeline is not None:
        raise CheckpointError(f"{what}: the model is pipelined (pp={state.mesh.pp}); adapters of a pipelined model "
                              "are not supported yet: use shardlib.checkpoint.save for the whole model")
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise CheckpointError(f"{what}: the model's parameters are FSDP2 (zero=3) shards; adapters of such a model "
                              "are not supported yet: use shardlib.checkpoint.save")


def save_adapter(model: nn.Module, directory: str | Path, *, overwrite: bool = True) -> Path:
    """Write the adapters of sharded peft ``model`` to ``directory`` in peft's format (module docstring), as
    ``PeftModel.save_pretrained`` does. Every rank calls it; rank 0 writes. An existing ``directory`` is replaced
    atomically (``overwrite=False`` refuses it)."""
    _check_supported(model, "save_adapter")
    directory = Path(directory)
    with stalled_ranks_named(f"saving the adapter to {directory}", timeout_of(shard_state(model).mesh)):
        return _save_adapter(model, directory, overwrite)


def _save_adapter(model: nn.Module, directory: Path, overwrite: bool) -> Path:
    """:func:`save_adapter` after its checks: the gather over tp, then rank 0 writes."""
    group = tp_group_of(model)
    full: dict[str, torch.Tensor] = {}
    for adapter in model.peft_config:
        for name in _saved_names(model, adapter).values():
            if name not in full:
                full[name] = gather_full(model.get_parameter(name), layout_of(model, name), group)
    status = ""
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            with AtomicDirectory(directory, overwrite=overwrite) as tmp:
                model.save_pretrained(tmp, state_dict=full, safe_serialization=True)
        except BaseException as exc:  # every rank raises it, not only rank 0
            status = f"{type(exc).__name__}: {exc}"
    status = _broadcast_str(status)
    if status:
        raise CheckpointError(f"saving the adapter to {directory} failed: {status}")
    return directory


@torch.no_grad()
def load_adapter(model: nn.Module, directory: str | Path, *, adapter: str = "default") -> None:
    """Load adapter weights written by peft (or :func:`save_adapter`) from ``directory`` into sharded peft
    ``model``'s adapter ``adapter`` (created by ``get_peft_model`` with the same LoraConfig, before sharding):
    each rank reads and keeps its slice. Every tensor of the adapter must be in the file, with its full shape."""
    _check_supported(model, "load_adapter")
    path = Path(directory) / ADAPTER_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (an adapter directory written by peft holds {ADAPTER_FILE})")
    rank = shard_state(model).mesh.tp_rank
    names = _saved_names(model, adapter)
    with SafetensorsFile(path) as file:
        keys = set(file.keys())
        problems = [f"missing {key!r}" for key in names if key not in keys]
        problems += [f"unexpected {key!r}" for key in sorted(keys - set(names))]
        for key, name in names.items():
            if key in keys and tuple(file.entry(key).shape) != layout_of(model, name).global_shape:
                problems.append(f"{key}: shape {tuple(file.entry(key).shape)} != the model's "
                                f"{layout_of(model, name).global_shape} (another LoraConfig?)")
        if problems:
            raise CheckpointError(f"cannot load adapter {adapter!r} from {path}:\n  " + "\n  ".join(problems))
        for key, name in names.items():
            param = model.get_parameter(name)
            param.copy_(layout_of(model, name).shard(file.read(key).to(param.dtype), rank))


__all__ = ["save_adapter", "load_adapter", "is_peft_model", "ADAPTER_FILE"]
