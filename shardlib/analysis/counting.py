"""Counting the work and memory of one microbatch, exactly, on meta tensors or real ones: what the cost model
(:mod:`shardlib.analysis.costmodel`) prices.

:class:`WorkRecorder` is a dispatch mode that sees every op of a forward and backward. It records, per module path
(the innermost module running the op, forward or backward, as :class:`~shardlib.analysis.metarun.CollectiveRecorder`
attributes collectives):

* the FLOPs of every matrix multiply and attention (torch's own formulas, ``torch.utils.flop_counter``; the CPU's
  fused flash attention, which torch's table lacks, by the formula of the other fused kernels), by size, so a
  profile's GEMM throughput can be looked up at the sizes the model uses;
* the memory traffic of every other op that computes something (bytes of its tensor inputs and outputs; views
  move nothing);
* the bytes saved for backward (``torch.autograd.graph.saved_tensors_hooks``; each storage once, parameters and
  buffers left out: they are counted as states). Under non-reentrant activation checkpointing a layer saves only
  its inputs (the region's own hooks take the rest), which is what it keeps;
* the live bytes of the storages the microbatch creates, as a timeline of allocations and frees (weak references
  on the storages), from which :meth:`WorkRecorder.peaks` reads the peak with and without the gradients.

Meta tensors have storages of their own size (and no data), so a dry run counts what a real run holds.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def storage_key(t: torch.Tensor) -> int:
    """One number per storage while it lives (its C++ object's address): views of a tensor share it."""
    return t.untyped_storage()._cdata


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclass
class ModuleWork:
    """The work one module path did in one microbatch: ``gemms`` {FLOPs of one call: calls}, ``traffic`` bytes of
    the other ops, ``saved`` bytes it saved for backward."""

    gemms: dict[int, int] = field(default_factory=dict)
    traffic: int = 0
    saved: int = 0
    ops: int = 0  # every op dispatched (each has a fixed cost in eager mode)

    @property
    def flops(self) -> int:
        return sum(f * n for f, n in self.gemms.items())

    def add(self, other: "ModuleWork", times: int = 1) -> None:
        for f, n in other.gemms.items():
            self.gemms[f] = self.gemms.get(f, 0) + n * times
        self.traffic += other.traffic * times
        self.saved += other.saved * times
        self.ops += other.ops * times


class SavedCounter:
    """Counts the bytes autograd saves for backward inside the block (each storage once; the parameters and buffers
    of ``model`` left out: they are states, not activations), by module path (``where()``). A context manager; the
    count is ``total``. What :class:`WorkRecorder` counts as ``saved``, usable alone on a real run."""

    def __init__(self, model: nn.Module, where=lambda: ""):
        self.where = where
        self.states = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
        self.saved: set[int] = set()
        self.by_module: dict[str, int] = defaultdict(int)
        self.counting = True  # off once backward starts: a checkpointed recompute saves again

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.counting and t.numel():
            key = storage_key(t)
            if key not in self.states and key not in self.saved:
                self.saved.add(key)
                self.by_module[self.where()] += storage_bytes(t)
        return t

    @property
    def total(self) -> int:
        return sum(self.by_module.values())


class WorkRecorder(TorchDispatchMode):
    """Records the work of the ops run inside the block (module docstring). ``model``: its parameters and buffers
    are states, not activations. ``where``: a function giving the module path the current op belongs to.
    ``kernel``: what runs an op, ``kernel(func, args, kwargs)`` (default: ``func`` itself; the dry run's:
    :meth:`~shardlib.analysis.metarun.CollectiveRecorder.dispatch`, which records the collectives)."""

    def __init__(self, model: nn.Module, where, kernel=None):
        super().__init__()
        self.where, self.kernel = where, kernel
        self.work: dict[str, ModuleWork] = defaultdict(ModuleWork)
        self.saved = SavedCounter(model, where)
        self.states = self.saved.states
        self.events: list[tuple[int, int, int]] = []  # (tick, +/- bytes, serial number of the storage)
        self.tick = 0
        self._refs: dict[int, weakref.ref] = {}  # storage key -> weak reference, while it lives
        self._serials: dict[int, int] = {}  # storage key -> serial number, while it lives (keys are reused)

    def __enter__(self):
        self.saved.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.saved.__exit__(*exc)
        for path, nbytes in self.saved.by_module.items():
            self.work[path].saved = nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs) if self.kernel is None else self.kernel(func, args, kwargs)
        self.tick += 1
        given = _tensors(args) + _tensors(kwargs.values()) if kwargs else _tensors(args)
        inputs = {t.untyped_storage()._cdata for t in given}  # storage_key
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = ("collective" if func.namespace in _COLLECTIVE_NAMESPACES else
                                   "gemm" if func._overloadpacket in _FLOPS else
                                   "view" if func.is_view else "other")
        work = self.work[self.where()]
        work.ops += 1
        if kind == "gemm":
            flops = int(_FLOPS[func._overloadpacket](*args, **kwargs, out_val=out))
            work.gemms[flops] = work.gemms.get(flops, 0) + 1
        elif kind == "other":
            tensors = given + _tensors((out,))
            work.traffic += sum(t.numel() * t.element_size() for t in tensors)
        self._track(out, inputs)
        return out

    def _track(self, out, inputs: set[int]) -> None:
        """Start following the storages ``out`` creates (not those of the op's inputs: in-place ops, views)."""
        for t in _tensors((out,)):
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._refs or key in self.states or key in inputs:
                continue
            nbytes, serial = storage.nbytes(), len(self.events)
            self.events.append((self.tick, nbytes, serial))
            self._refs[key] = weakref.ref(storage, self._freed(key, nbytes, serial))
            self._serials[key] = serial

    def _freed(self, key: int, nbytes: int, serial: int):
        def callback(_ref):
            self.events.append((self.tick, -nbytes, serial))
            self._refs.pop(key, None)
            self._serials.pop(key, None)

        return callback

    def peaks(self, gradients: list[torch.Tensor]) -> tuple[int, int]:
        """(peak live bytes the microbatch created, gradients left out; the same with them) over the block."""
        grads = {self._serials.get(storage_key(g)) for g in gradients}
        live = [0, 0]  # (other, gradients)
        peak = [0, 0]
        for _, nbytes, serial in self.events:
            live[serial in grads] += nbytes
            peak[0] = max(peak[0], live[0])
            peak[1] = max(peak[1], live[0] + live[1])
        return peak[0], peak[1]

    def saved_bytes(self) -> int:
        return self.saved.total


_KINDS: dict = {}  # op overload -> "collective", "gemm", "view" or "other" (looked up once per op)
#: torch's FLOP formulas and the CPU flash attention's (forward and backward), counted like the CUDA kernels'
_FLOPS = flop_registry | {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_val=None, **kwargs: sdpa_flop_count(q.shape, k.shape, v.shape),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *args, out_val=None, **kwargs: sdpa_backward_flop_count(grad.shape, q.shape, k.shape,
                                                                                        v.shape),
    # the experts' grouped GEMM: each row of ``a`` meets one group's [K, N] (or each group its own rows)
    torch.ops.aten._grouped_mm: lambda a, b, *args, out_val=None, **kwargs: 2 * a.numel() * b.shape[-1],
}


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among ``values`` and in the lists / tuples among them (an op's arguments or results; faster than
    a pytree walk, which this runs for every op of a dry run)."""
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += [t for t in v if isinstance(t, torch.Tensor)]
    return found


def by_layer(work: dict[str, ModuleWork], layers: list[str]) -> dict[str, ModuleWork]:
    """Module work summed per trunk layer (the layer whose path prefixes the module's), the rest under ""."""
    out: dict[str, ModuleWork] = {layer: ModuleWork() for layer in layers}
    out[""] = ModuleWork()
    for path, w in work.items():
        layer = next((la for la in layers if path == la or path.startswith(la + ".")), "")
        out[layer].add(w)
    return out


def _on_cpu(t):
    """A CPU stand-in with ``t``'s shape and dtype and no memory (stride 0 but along the last dim)."""
    if not isinstance(t, torch.Tensor):
        return t
    strides = (0,) * (t.dim() - 1) + (1,)
    stand_in = torch.empty(t.shape[-1] if t.dim() else 1, dtype=t.dtype).as_strided(t.shape, strides)
    return stand_in.requires_grad_(t.requires_grad)  # torch chooses by that too (a trainable bias: math)


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


_MATH, _FLASH, _EFFICIENT = 0, 1, 2  # torch's SDPBackend values (what aten._fused_sdp_choice returns)


def _cuda_dropout(input, p=0.5, training=True, inplace=False):
    if input.device.type != "meta" or not training or not 0 < p < 1 or inplace:
        return F.dropout(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def _cuda_choice(query, key, value, mask, is_causal) -> int:
    """The kernel torch's CUDA SDPA takes (sm80 or newer, its default order: flash, then memory-efficient, then
    math), from the conditions its dispatcher checks (``sdp_utils.cpp``) that a transformer's call can meet: flash
    for fp16 / bf16 without a mask and head dims up to 256; memory-efficient for fp32 / fp16 / bf16 with or without
    an additive mask, head dims a multiple of 8 (4 in fp32); else math. A mask that needs a gradient (T5's learned
    position bias) took the math path in every attention measured (torch 2.11, H200)."""
    head_dim, dtype = query.shape[-1], query.dtype
    if mask is not None and mask.requires_grad:
        return _MATH
    same = key.shape[-1] == head_dim and value.shape[-1] == head_dim and query.dim() == 4
    if same and dtype in (torch.float16, torch.bfloat16) and mask is None and head_dim <= 256 and head_dim % 8 == 0:
        return _FLASH
    if query.dim() == 4 and dtype in (torch.float32, torch.float16, torch.bfloat16) \
            and head_dim % (4 if dtype == torch.float32 else 8) == 0 and value.shape[-1] % 8 == 0 \
            and not (is_causal and mask is not None):
        return _EFFICIENT
    return _MATH


class KernelsAsOn(TorchFunctionMode):
    """The kernels ``device_type`` ("cpu" or "cuda") runs where the meta device would run others that save
    different tensors for backward. Without this the dry run would count a different backward than a real run keeps.

    * ``scaled_dot_product_attention``: on the meta device torch always takes the math path (matmuls and a softmax,
      saving the attention probabilities, and their dropout mask); a CPU takes the fused flash kernel wherever
      torch's own choice (``aten._fused_sdp_choice``, asked with CPU stand-ins of the same shapes) says so (not with
      dropout), a GPU its flash or memory-efficient kernel (:func:`_cuda_choice`, dropout included); both save the
      inputs, output and log-sum-exp instead.
    * ``dropout`` (training, 0 < p < 1): the meta device and a CPU multiply by a mask of the input's dtype, which
      backward keeps; a GPU runs the fused ``native_dropout``, which keeps a bool mask (measured, H200)."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout and self.device_type == "cuda":
            return _cuda_dropout(*args, **kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
        if query.device.type != "meta" or gqa:
            return func(*args, **kwargs)
        if self.device_type == "cuda":
            choice = _cuda_choice(query, key, value, mask, is_causal)
        else:
            choice = torch.ops.aten._fused_sdp_choice(*map(_on_cpu, (query, key, value)), attn_mask=_on_cpu(mask),
                                                      dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        if choice == _MATH or (choice == _EFFICIENT and self.device_type != "cuda"):
            return func(*args, **kwargs)
        if mask is not None and mask.dtype == torch.bool:  # as torch does first: a float mask, -inf where False
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
        if self.device_type != "cuda":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
        if choice == _FLASH:
            return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                      False, scale=scale)[0]
        bias = None if mask is None else mask.to(query.dtype).expand(*query.shape[:-1], key.shape[-2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p,
                                                                      is_causal, scale=scale)[0]
