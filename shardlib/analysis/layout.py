"""A training layout as one value: the mesh, sequence parallelism, ZeRO, the schedule, recomputation, precision
and the batch. What the layout search enumerates (:mod:`shardlib.analysis.search`), the cost model prices
(:mod:`shardlib.analysis.costmodel`) and ``--layout auto`` hands to the Trainer (:meth:`Layout.training_args`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

#: each sequence-parallel mode's :func:`shardlib.shard` argument (``sequence_parallel=``)
SHARD_MODES = {"off": False, "megatron": "megatron", "all_to_all": "all_to_all", "ring": "ring"}
SEQUENCE_MODES = tuple(SHARD_MODES)
#: the short name of each mode on the sp dimension in :meth:`Layout.name` (``sp4-a2a``, ``sp4-ring``)
_SP_NAMES = {"all_to_all": "a2a", "ring": "ring"}
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Layout:
    """One way to train a model on ``world`` ranks. ``batch``: examples per microbatch on one dp rank (so the global
    batch is ``batch * microbatches * dp``); ``sequence_parallel``: "off", "megatron" (on the tp group),
    "all_to_all" or "ring" (over ``sp`` ranks); ``ulysses``: under "ring", Ulysses x ring (``shard(...,
    ulysses=N)``): rings of ``sp / ulysses`` positions, each position ``ulysses`` ranks exchanging sequence for heads
    (1: the plain ring); ``ep``: expert parallelism, each mixture-of-experts layer's experts
    split over ``ep`` of the dp ranks (ep divides dp); ``expert_capacity``: its static-capacity exchange with this
    capacity factor (None: dropless)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    sp: int = 1
    sequence_parallel: str = "off"
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    activation_checkpointing: bool = False
    precision: str = "fp32"
    batch: int = 8
    seq: int = 128
    ep: int = 1
    expert_capacity: float | None = None
    ulysses: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.sp * self.tp

    @property
    def global_batch(self) -> int:
        return self.batch * self.microbatches * self.dp

    def shard_mode(self):
        """:func:`shardlib.shard`'s ``sequence_parallel`` argument."""
        return SHARD_MODES[self.sequence_parallel]

    def shard_options(self) -> dict:
        """:func:`shardlib.shard`'s sequence-parallel arguments: ``sequence_parallel``, and ``ulysses`` where set."""
        return {"sequence_parallel": self.shard_mode()} | ({"ulysses": self.ulysses} if self.ulysses > 1 else {})

    def training_args(self) -> dict:
        """The :class:`shardlib.train.TrainingArguments` fields this layout sets (``batch_size`` is global);
        ``ulysses`` only where set (a field the Trainer does not have yet)."""
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "sp": self.sp,
                "sequence_parallel": None if self.sequence_parallel == "off" else self.sequence_parallel,
                "zero": self.zero, "microbatches": self.microbatches, "schedule": self.schedule,
                "activation_checkpointing": self.activation_checkpointing, "precision": self.precision,
                "batch_size": self.global_batch, "ep": self.ep, "expert_capacity": self.expert_capacity} | (
            {"ulysses": self.ulysses} if self.ulysses > 1 else {})

    def name(self) -> str:
        """Short text: ``dp2 pp2 tp1 zero1 mb4 1f1b``, with ``sp`` (``sp8-ring ulysses2``: Ulysses x ring, as
        ``--sp ring 8 --ulysses 2`` asks for it) / ``ep`` (``ep2``, ``ep2-cap1.25``: static capacity) / ``ckpt`` /
        precision where they are set."""
        parts = [f"dp{self.dp}", f"pp{self.pp}", f"tp{self.tp}"]
        if self.sequence_parallel == "megatron":
            parts.append("sp-megatron")
        elif self.sequence_parallel in _SP_NAMES:
            parts.append(f"sp{self.sp}-{_SP_NAMES[self.sequence_parallel]}")
        if self.ulysses > 1:
            parts.append(f"ulysses{self.ulysses}")
        if self.ep > 1 or self.expert_capacity is not None:
            parts.append(f"ep{self.ep}" + (f"-cap{self.expert_capacity:g}" if self.expert_capacity is not None else ""))
        parts += [f"zero{self.zero}", f"mb{self.microbatches}"]
        if self.pp > 1:
            parts.append(self.schedule)
        if self.activation_checkpointing:
            parts.append("ckpt")
        if self.precision != "fp32":
            parts.append(self.precision)
        return " ".join(parts)

    def to_dict(self) -> dict:
        """The fields; ``ep`` and ``expert_capacity`` only where expert parallelism is set, ``ulysses`` only where
        Ulysses x ring is."""
        data = asdict(self)
        if self.ep == 1 and self.expert_capacity is None:
            del data["ep"], data["expert_capacity"]
        if self.ulysses == 1:
            del data["ulysses"]
        return data


_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``16GiB``, ``16G`` (binary), ``16GB`` (decimal), ``512MiB``, ``1.5T`` -> bytes; ValueError otherwise."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = found.group(2).lower() if found else None
    if not found or unit not in _UNITS or float(found.group(1)) <= 0:
        raise ValueError(f"memory {text!r}: expected a positive size like 16GiB, 512MiB or 80GB")
    return int(float(found.group(1)) * _UNITS[unit])
