"""The meta device's kernels, remembered: a dry run (:mod:`shardlib.analysis.dryrun`) dispatches hundreds of thousands
of ops on meta tensors, and torch computes the output of most elementwise ones in Python (``torch._refs`` and its
prims: 0.1-1.5 ms an op, the bulk of a layer table's time), though the output of an op on meta tensors depends on
nothing but the op, its inputs' shapes, strides, offsets and dtypes, and its other arguments. Ring attention's
blocks, the batch sizes of a table and the recompute of a checkpointed layer repeat the same calls many times.

:func:`run` answers a call whose key it has seen with fresh meta tensors of the outputs it recorded (shape, stride,
offset, dtype, storage size, which outputs share a storage): what the kernel would give, without running it; an
in-place op that changes no metadata (``clamp_``, ``masked_fill_``, ``copy_``) with its argument, as the kernel
does. Only where that is sure: ATen's own ops, not random, not a view, their outputs new plain meta tensors (an op
found aliasing its input is never remembered), every tensor argument a plain strided meta tensor; ``index.Tensor``
only with integer indices. Anything else runs the kernel, every time. The key holds every argument (tensors by their
metadata and which of them share a storage, scalars by type and value) and the default dtype.
``SHARDLIB_PLAN_META_CACHE=0`` turns it off (tests/test_plan_speed.py compares answers with it on and off).
"""

from __future__ import annotations

import os

import torch

#: (op, arguments' key) -> the outputs' record (True: an in-place op's argument), or None where it cannot be remade
_SEEN: dict = {}
_LIMIT = 100_000  # entries before the memory is cleared (a 64-rank search of T5-large keeps about 6,400)
_OPS: dict = {}  # op overload -> "new", "in place" or None (:func:`_kind`)
_INDEX = torch.ops.aten.index.Tensor  # data-dependent only with boolean indices
_INTEGERS = (torch.int64, torch.int32)
_FILLS = ("fill_", "zero_", "copy_", "masked_fill_")  # in place, not tagged pointwise
_SCALARS = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format))


def enabled() -> bool:
    return os.environ.get("SHARDLIB_PLAN_META_CACHE", "1") != "0"


def _kind(func) -> str | None:
    """"new": a functional op (its outputs new tensors); "in place": a pointwise op (or fill, zero, copy, masked
    fill) writing its first argument and returning it (``clamp_``, ``masked_fill_``: no metadata changes); None: any
    other (views, random ops, ops writing other arguments or changing a tensor's shape, ops whose outputs depend on
    values; ``index.Tensor`` is "new" and :func:`run` keeps only its calls with integer indices, whose output's
    shape the indices' shapes give, not their values)."""
    if func in _OPS:
        return _OPS[func]
    schema, tags = func._schema, set(func.tags) - ({torch.Tag.dynamic_output_shape} if func is _INDEX else set())
    kind = None
    if func.namespace == "aten" and not func.is_view and not {torch.Tag.nondeterministic_seeded,
                                                               torch.Tag.data_dependent_output,
                                                               torch.Tag.dynamic_output_shape} & tags:
        written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if not schema.is_mutable and all(r.alias_info is None for r in schema.returns):
            kind = "new"
        elif (torch.Tag.pointwise in tags or func._opname in _FILLS) and torch.Tag.inplace_view not in tags \
                and len(written) == 1 and written[0] is schema.arguments[0] \
                and len(schema.returns) == 1 and schema.returns[0].alias_info is not None \
                and schema.returns[0].alias_info.before_set == schema.arguments[0].alias_info.before_set:
            kind = "in place"
    _OPS[func] = kind
    return kind


class _Unkeyable(Exception):
    pass


_ALIASES = "aliases"  # _record's answer for an op whose output shares an input's storage


def _key(values, storages: dict[int, int]) -> tuple:
    """A hashable description of a sequence of arguments: a tensor by its metadata and which argument storage it reads
    (aliasing between arguments is part of the key), a scalar by its type and value, lists and tuples item by item."""
    out = []
    for value in values:
        kind = type(value)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if not value.is_meta or value.layout is not torch.strided or value.is_conj() or value.is_neg():
                raise _Unkeyable
            storage = storages.setdefault(value.untyped_storage()._cdata, len(storages))
            out.append((value.shape, value.stride(), value.storage_offset(), value.dtype, storage))
        elif kind in _SCALARS:
            out.append((kind, value))
        elif kind is list or kind is tuple or kind is torch.Size:
            out.append((kind, _key(value, storages)))
        else:  # another tensor subclass, a process group, a generator...
            raise _Unkeyable
    return tuple(out)


def _record(out, inputs: dict[int, int]):
    """How to make ``out`` again (None: it cannot be: not new plain meta tensors)."""
    single = isinstance(out, torch.Tensor)
    if not single and not (isinstance(out, (tuple, list)) and out
                           and all(t is None or isinstance(t, torch.Tensor) for t in out)):
        return None
    shared: dict[int, int] = {}
    entries = []
    for t in [out] if single else out:
        if t is None:
            entries.append(None)
            continue
        if type(t) is not torch.Tensor or t.device.type != "meta" or t.layout != torch.strided or t.requires_grad \
                or t.is_conj() or t.is_neg():
            return None
        storage = t.untyped_storage()
        if storage._cdata in inputs:  # an input's storage: the op aliases (``_unsafe_view``)
            return _ALIASES
        index = shared.setdefault(storage._cdata, len(shared))
        shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
        plain = offset == 0 and storage.nbytes() == torch.empty_strided(
            shape, stride, dtype=t.dtype, device="meta").untyped_storage().nbytes()
        entries.append((shape, stride, offset, t.dtype, index, storage.nbytes(), plain))
    plain = all(e is None or e[6] for e in entries) and len(shared) == sum(e is not None for e in entries)
    return ("tensor" if single else type(out), entries, plain)


def _remake(record):
    kind, entries, plain = record
    if plain:
        outs = [None if e is None else torch.empty_strided(e[0], e[1], dtype=e[3], device="meta") for e in entries]
    else:
        storages: dict[int, torch.UntypedStorage] = {}
        outs = []
        for e in entries:
            if e is None:
                outs.append(None)
                continue
            shape, stride, offset, dtype, index, nbytes, _ = e
            if index not in storages:
                storages[index] = torch.UntypedStorage(nbytes, device="meta")
            outs.append(torch.empty(0, dtype=dtype, device="meta").set_(storages[index], offset, shape, stride))
    return outs[0] if kind == "tensor" else kind(outs)


def run(func, args, kwargs):
    """``func(*args, **kwargs)``, from memory where the same call on meta tensors was seen (module docstring)."""
    kind = _kind(func)
    if kind is None or (func is _INDEX and any(i is not None and i.dtype not in _INTEGERS
                                                for i in (args[1] if len(args) > 1 else kwargs["indices"]))):
        return func(*args, **kwargs)
    storages: dict[int, int] = {}
    try:
        key = (func, _key(args, storages), _key(kwargs.values(), storages) if kwargs else (), tuple(kwargs),
               torch.get_default_dtype())
    except _Unkeyable:
        return func(*args, **kwargs)
    if not storages:  # no tensor argument: a factory op (its device may be another's)
        return func(*args, **kwargs)
    record = _SEEN.get(key, False)
    if record:
        return args[0] if kind == "in place" else _remake(record)
    out = func(*args, **kwargs)
    if record is False:
        if len(_SEEN) >= _LIMIT:
            _SEEN.clear()
        record = (True if out is args[0] else None) if kind == "in place" else _record(out, storages)
        if record is _ALIASES:
            _OPS[func], record = None, None  # never remade, and not keyed again
        _SEEN[key] = record
    return out
