"""Machine profiles: what one rank of this machine computes and sends per second, for the step-time cost model.

The dry run (:mod:`.dryrun`) counts exactly what a rank computes and sends; a :class:`Profile` turns those counts
into seconds. It holds three kinds of measurement, each taken with all ``world_size`` ranks busy at once (that is
how training runs: four ranks sharing two cores each get less than one rank alone):

* ``gemm``: matmul throughput per dtype at several GEMM sizes (a small GEMM runs far below peak);
* ``memory_bytes_per_s``: elementwise bandwidth (bytes read + written per second); ``optimizer_bytes_per_s``
  (optional): an AdamW step's, by the bytes the dry run counts for it;
* ``collectives``: per op and group size, ``time(bytes) = latency_s + bytes / bytes_per_s``, where bytes are what
  this rank puts in (the collective's input tensor); ``shared_memory`` (optional, CPU profiles): the same fits for
  the all-reduce, all-gather and reduce-scatter of the tp and sp groups over the shared-memory transport, which a
  mesh uses on one host by default (``init_mesh(transport="auto")``), for messages up to ``shared_memory_slot_bytes``.

``shardlib calibrate`` (:mod:`.calibrate`) measures a profile and writes it as JSON (version 1; the schema is in
docs and in :meth:`Profile.to_dict`); :func:`load_profile` reads one back and refuses anything malformed with one
line naming the file and the field. Without ``--profile`` the cost model uses :func:`default_profile`, nominal
numbers for a small CPU machine under gloo. JSON only: a profile is data, never code (no pickle).

This module imports no torch: reading a profile and pricing counts is plain arithmetic.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

VERSION = 1
BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")
GEMM_DTYPES = ("float32", "bfloat16", "float16")
#: the collectives a profile measures, each with the names the cost model may pass for it (torch's functional
#: collectives' names among them). A broadcast is priced as an all-reduce of the same bytes; ``send_recv`` is a rank
#: sending a message while it receives one (a pipeline boundary, a step of ring attention).
COLLECTIVES = {
    "all_reduce": ("all_reduce", "broadcast"),
    "all_gather": ("all_gather", "all_gather_into_tensor"),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter_tensor"),
    "all_to_all": ("all_to_all", "all_to_all_single"),
    "send_recv": ("send_recv",),
}
_OP_NAMES = {alias: op for op, aliases in COLLECTIVES.items() for alias in aliases}
_FIELDS = ("shardlib_profile", "machine", "backend", "device", "world_size", "gemm", "memory_bytes_per_s",
           "collectives")
#: older profiles lack them: 0 s per op, the optimizer at the element-wise bandwidth, cores unknown, the tp and sp
#: groups' collectives priced as the backend's
_OPTIONAL = ("op_seconds", "optimizer_bytes_per_s", "cores", "shared_memory", "shared_memory_slot_bytes")
#: the mesh dims whose groups may use the shared-memory transport, and the collectives it serves
SHARED_MEMORY_DIMS = ("tp", "sp")
SHARED_MEMORY_OPS = ("all_reduce", "all_gather", "reduce_scatter")
_MAX_FILE_BYTES = 16 << 20  # a profile is a few KiB; anything this large is not one


class ProfileError(ValueError):
    """A profile that cannot be used: the message is one line naming the file (or source) and the field."""


class LinkFit(NamedTuple):
    """One collective at one group size: ``seconds(nbytes) = latency_s + nbytes / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    @classmethod
    def fit(cls, samples: list[tuple[float, float]]) -> LinkFit:
        """The fit to measured (bytes, seconds) samples: least squares of the relative error (a 4 KiB message's
        time counts as much as a 16 MiB one's). Clamped positive: a fitted latency <= 0 becomes 1 us; a slope
        <= 0 (time not growing with bytes) becomes the largest sample's bytes / seconds."""
        weights = [1.0 / t ** 2 for _, t in samples]
        sw = sum(weights)
        sx = sum(w * x for w, (x, _) in zip(weights, samples))
        sxx = sum(w * x * x for w, (x, _) in zip(weights, samples))
        st = sum(w * t for w, (_, t) in zip(weights, samples))
        sxt = sum(w * x * t for w, (x, t) in zip(weights, samples))
        det = sw * sxx - sx * sx
        latency, slope = ((sxx * st - sx * sxt) / det, (sw * sxt - sx * st) / det) if det > 0 else (0.0, 0.0)
        largest = max(samples)
        return cls(latency_s=max(latency, 1e-6), bytes_per_s=1.0 / slope if slope > 0 else largest[0] / largest[1])


@dataclass(frozen=True)
class Profile:
    """A machine profile (module docstring). Build one with :func:`load_profile`, :meth:`from_dict`,
    :func:`default_profile` or :func:`~.calibrate.calibrate`, which validate it.

    ``gemm``: dtype name -> ((flops_per_gemm, flops_per_s), ...), sorted by flops, float32 always present.
    ``collectives``: op (a key of :data:`COLLECTIVES`) -> {group size: :class:`LinkFit`}, every op present.
    ``world_size``: the ranks that ran concurrently when it was measured; None for a profile meant for any world."""

    machine: str
    backend: str
    device: str
    world_size: int | None
    gemm: dict[str, tuple[tuple[float, float], ...]]
    memory_bytes_per_s: float
    collectives: dict[str, dict[int, LinkFit]]
    op_seconds: float = 0.0  # optional: the fixed cost of one eager op (dispatch, Python), all ranks busy
    cores: int | None = None  # optional: the CPU cores the ranks shared (CPU profiles): idle ranks free them
    optimizer_bytes_per_s: float = 0.0  # optional: an AdamW step's counted traffic per second (0: element-wise's)
    #: optional: op (of SHARED_MEMORY_OPS) -> {group size: LinkFit} over the shared-memory transport, for messages
    #: up to ``shared_memory_slot_bytes`` of the SHARED_MEMORY_DIMS groups (empty: priced as ``collectives``)
    shared_memory: dict[str, dict[int, LinkFit]] = field(default_factory=dict)
    shared_memory_slot_bytes: int = 0

    # ---------------------------------------------------------------------------------------------- lookups
    def gemm_seconds(self, flops: float, dtype: str = "float32") -> float:
        """Seconds of one GEMM of ``flops`` flops (2*m*k*n) in ``dtype`` ("bfloat16" or "torch.bfloat16").
        Throughput is interpolated linearly in log(flops) between the measured sizes and clamped at the smallest
        and largest; a dtype the profile has not measured (float16 on a CPU profile, float64, int8) is priced as
        float32."""
        if flops <= 0:
            return 0.0
        points = self.gemm.get(str(dtype).removeprefix("torch.")) or self.gemm["float32"]
        logs = [math.log(f) for f, _ in points]
        x = math.log(flops)
        i = bisect.bisect_left(logs, x)
        if i == 0:
            rate = points[0][1]
        elif i == len(points):
            rate = points[-1][1]
        else:
            t = (x - logs[i - 1]) / (logs[i] - logs[i - 1])
            rate = points[i - 1][1] + t * (points[i][1] - points[i - 1][1])
        return flops / rate

    def elementwise_seconds(self, nbytes: float) -> float:
        """Seconds of elementwise work that reads and writes ``nbytes`` bytes in all."""
        return max(nbytes, 0.0) / self.memory_bytes_per_s

    def optimizer_seconds(self, nbytes: float) -> float:
        """Seconds of an optimizer step that moves ``nbytes`` (its counted traffic): at the AdamW rate calibrated,
        else (older profiles) at the element-wise bandwidth."""
        return max(nbytes, 0.0) / (self.optimizer_bytes_per_s or self.memory_bytes_per_s)

    def collective_seconds(self, op: str, group_size: int, nbytes: float, dim: str | None = None) -> float:
        """Seconds of collective ``op`` (a name of :data:`COLLECTIVES`, e.g. ``all_gather_into_tensor``) over a
        group of ``group_size`` ranks, ``nbytes`` being this rank's input; ``dim``: the mesh dim of the group (its
        tp and sp groups go through shared memory where the profile measured it, for the messages that fit a slot).
        A group of one costs nothing. A group size the profile has not measured is priced as the nearest measured
        size above it (a larger group is never faster), else as the largest measured size below it."""
        if op not in _OP_NAMES:
            raise ValueError(f"unknown collective {op!r}: known are {', '.join(sorted(_OP_NAMES))}")
        if group_size <= 1:
            return 0.0
        fits = self.collectives[_OP_NAMES[op]]
        if self.over_shared_memory(op, dim, nbytes):
            fits = self.shared_memory[_OP_NAMES[op]]
        if not fits:
            raise ProfileError(f"{self.machine}: measured on one rank, this profile prices no {op} (groups of "
                               f"{group_size}): calibrate with --world 2 or more")
        above = [n for n in fits if n >= group_size]
        return fits[min(above) if above else max(fits)].seconds(max(nbytes, 0.0))

    def over_shared_memory(self, op: str, dim: str | None, nbytes: float) -> bool:
        """Whether collective ``op`` of ``nbytes`` on a group of mesh dim ``dim`` runs over the shared-memory
        transport (measured by this profile, a tp or sp group, a message that fits a slot)."""
        return (dim in SHARED_MEMORY_DIMS and nbytes <= self.shared_memory_slot_bytes
                and _OP_NAMES.get(op) in self.shared_memory)

    def summary(self) -> str:
        """A few lines for people: GEMM rate range per dtype, bandwidth, each collective per group size."""
        ranks = f"{self.world_size} ranks" if self.world_size else "any number of ranks"
        lines = [f"{self.machine}: {ranks}, {self.backend}, {self.device}"]
        for dtype, points in self.gemm.items():
            rates = [rate / 1e9 for _, rate in points]
            lines.append(f"  gemm {dtype:<9} {min(rates):7.1f} - {max(rates):.1f} GFLOP/s per rank "
                         f"({points[0][0] / 1e6:.0f} - {points[-1][0] / 1e6:.0f} MFLOP GEMMs)")
        lines.append(f"  elementwise    {self.memory_bytes_per_s / 1e9:7.2f} GB/s per rank")
        if self.optimizer_bytes_per_s:
            lines.append(f"  AdamW step     {self.optimizer_bytes_per_s / 1e9:7.2f} GB/s per rank")
        if self.op_seconds:
            lines.append(f"  eager op       {self.op_seconds * 1e6:7.1f} us each" +
                         (f" ({self.cores} cores shared)" if self.cores else ""))
        if not any(self.collectives.values()):
            lines.append("  collectives    none (measured on one rank)")
        for op, fits in filter(lambda item: item[1], self.collectives.items()):
            lines.append(f"  {op:<14} " + _fits_line(fits))
        for op, fits in self.shared_memory.items():
            lines.append(f"  {op:<14} " + _fits_line(fits) + " (tp/sp over shared memory)")
        return "\n".join(lines)

    # ------------------------------------------------------------------------------------------ reading, writing
    def to_dict(self) -> dict:
        """The profile as JSON data (schema version :data:`VERSION`)."""
        return {
            "shardlib_profile": VERSION, "machine": self.machine, "backend": self.backend, "device": self.device,
            "world_size": self.world_size,
            "gemm": {dtype: [list(p) for p in points] for dtype, points in self.gemm.items()},
            "memory_bytes_per_s": self.memory_bytes_per_s,
            "collectives": {op: {str(n): fit._asdict() for n, fit in sorted(fits.items())}
                            for op, fits in self.collectives.items()},
            "op_seconds": self.op_seconds, "cores": self.cores, "optimizer_bytes_per_s": self.optimizer_bytes_per_s,
            "shared_memory": {op: {str(n): fit._asdict() for n, fit in sorted(fits.items())}
                              for op, fits in self.shared_memory.items()},
            "shared_memory_slot_bytes": self.shared_memory_slot_bytes,
        }

    @classmethod
    def from_dict(cls, data, source: str = "profile") -> Profile:
        """A validated profile from JSON data; :class:`ProfileError` ("SOURCE: field 'x.y' ...") otherwise."""
        return _Reader(source).profile(data)

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON, atomically (a temporary file next to it, then renamed over it)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def load_profile(path: str | os.PathLike, world_size: int | None = None) -> Profile:
    """Read and validate the profile at ``path``. With ``world_size`` (the plan's), a profile measured on another
    number of concurrent ranks is refused: per-rank throughput depends on how many ranks share the machine."""
    name = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ProfileError(f"{name}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > _MAX_FILE_BYTES:
        raise ProfileError(f"{name}: not a profile (larger than {_MAX_FILE_BYTES >> 20} MiB)")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{name}: not JSON (not UTF-8 text: byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{name}: not JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise ProfileError(f"{name}: not JSON (nested too deeply)") from None
    profile = Profile.from_dict(data, source=name)
    if world_size is not None and profile.world_size is not None and profile.world_size != world_size:
        raise ProfileError(f"{name}: measured on {profile.world_size} ranks (field 'world_size'), this plan has "
                           f"{world_size}: run shardlib calibrate --world {world_size} there")
    return profile


class _Reader:
    """Validates profile JSON data field by field; every refusal names the source and the field's dotted path."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, message: str):
        raise ProfileError(f"{self.source}: {message}")

    def field(self, data: dict, key: str, path: str):
        if key not in data:
            self.fail(f"missing field '{path}'")
        return data[key]

    def positive(self, value, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            self.fail(f"field '{path}' must be a positive number, got {_shown(value)}")
        return float(value)

    def mapping(self, value, path: str, what: str = "an object") -> dict:
        if not isinstance(value, dict):
            self.fail(f"field '{path}' must be {what}, got {_shown(value)}")
        return value

    def choice(self, value, path: str, allowed: tuple[str, ...]) -> str:
        if value not in allowed:
            self.fail(f"field '{path}' must be one of {', '.join(map(repr, allowed))}, got {_shown(value)}")
        return value

    def profile(self, data) -> Profile:
        if not isinstance(data, dict):
            self.fail(f"not a shardlib profile (a JSON object), got {_shown(data)}")
        version = self.field(data, "shardlib_profile", "shardlib_profile")
        if version != VERSION:
            self.fail(f"unknown profile version {_shown(version)} in field 'shardlib_profile' (this shardlib reads "
                      f"version {VERSION})")
        unknown = sorted(set(data) - set(_FIELDS) - set(_OPTIONAL))
        if unknown:
            self.fail(f"unknown field '{unknown[0]}' (a profile has {', '.join(_FIELDS)})")
        values = {key: self.field(data, key, key) for key in _FIELDS}
        if not isinstance(values["machine"], str):
            self.fail(f"field 'machine' must be a string, got {_shown(values['machine'])}")
        world = values["world_size"]
        if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
            self.fail(f"field 'world_size' must be a positive integer or null, got {_shown(world)}")
        op_seconds = data.get("op_seconds", 0.0)
        if op_seconds != 0:
            op_seconds = self.positive(op_seconds, "op_seconds")
        optimizer = data.get("optimizer_bytes_per_s", 0.0)
        if optimizer != 0:
            optimizer = self.positive(optimizer, "optimizer_bytes_per_s")
        cores = data.get("cores")
        if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
            self.fail(f"field 'cores' must be a positive integer or null, got {_shown(cores)}")
        shared, slot = self.shared_memory(data.get("shared_memory", {}), data.get("shared_memory_slot_bytes", 0))
        return Profile(op_seconds=float(op_seconds), cores=cores, optimizer_bytes_per_s=float(optimizer),
                       shared_memory=shared, shared_memory_slot_bytes=slot,
                       machine=values["machine"], backend=self.choice(values["backend"], "backend", BACKENDS),
                       device=self.choice(values["device"], "device", DEVICES), world_size=world,
                       gemm=self.gemm(values["gemm"]),
                       memory_bytes_per_s=self.positive(values["memory_bytes_per_s"], "memory_bytes_per_s"),
                       collectives=self.collectives(values["collectives"], one_rank=world == 1))

    def gemm(self, value) -> dict[str, tuple[tuple[float, float], ...]]:
        out = {}
        for dtype, points in self.mapping(value, "gemm").items():
            path = f"gemm.{dtype}"
            self.choice(dtype, path, GEMM_DTYPES)
            if not isinstance(points, list) or not points:
                self.fail(f"field '{path}' must be a non-empty list of [flops_per_gemm, flops_per_s], "
                          f"got {_shown(points)}")
            parsed = []
            for i, point in enumerate(points):
                if not isinstance(point, list) or len(point) != 2:
                    self.fail(f"field '{path}.{i}' must be [flops_per_gemm, flops_per_s], got {_shown(point)}")
                parsed.append((self.positive(point[0], f"{path}.{i}.0"), self.positive(point[1], f"{path}.{i}.1")))
            if any(a[0] >= b[0] for a, b in zip(parsed, parsed[1:])):
                self.fail(f"field '{path}' must be sorted by flops_per_gemm, each size once")
            out[dtype] = tuple(parsed)
        if "float32" not in out:
            self.fail("missing field 'gemm.float32'")
        return out

    def collectives(self, value, one_rank: bool) -> dict[str, dict[int, LinkFit]]:
        """``one_rank``: the profile was measured on one rank, which measures no collective."""
        value = self.mapping(value, "collectives")
        unknown = sorted(set(value) - set(COLLECTIVES))
        if unknown:
            self.fail(f"unknown field 'collectives.{unknown[0]}' (collectives are {', '.join(COLLECTIVES)})")
        out = {}
        for op in COLLECTIVES:
            sizes = self.mapping(self.field(value, op, f"collectives.{op}"), f"collectives.{op}",
                                 "an object of group sizes")
            if not sizes and not one_rank:
                self.fail(f"field 'collectives.{op}' has no group size")
            out[op] = {self.group_size(n, f"collectives.{op}"): self.link(fit, f"collectives.{op}.{n}")
                       for n, fit in sizes.items()}
        return out

    def shared_memory(self, value, slot) -> tuple[dict[str, dict[int, LinkFit]], int]:
        value = self.mapping(value, "shared_memory")
        unknown = sorted(set(value) - set(SHARED_MEMORY_OPS))
        if unknown:
            self.fail(f"unknown field 'shared_memory.{unknown[0]}' (the transport serves "
                      f"{', '.join(SHARED_MEMORY_OPS)})")
        fits = {op: {self.group_size(n, f"shared_memory.{op}"): self.link(fit, f"shared_memory.{op}.{n}")
                     for n, fit in self.mapping(sizes, f"shared_memory.{op}", "an object of group sizes").items()}
                for op, sizes in value.items()}
        if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0 or (fits and slot == 0):
            self.fail(f"field 'shared_memory_slot_bytes' must be a positive integer where 'shared_memory' is "
                      f"measured, got {_shown(slot)}")
        return {op: f for op, f in fits.items() if f}, slot

    def group_size(self, key: str, path: str) -> int:
        if not (key.isascii() and key.isdigit() and key == str(int(key)) and int(key) >= 2):
            self.fail(f"field '{path}' has key {_shown(key)}: group sizes are integers >= 2")
        return int(key)

    def link(self, value, path: str) -> LinkFit:
        value = self.mapping(value, path, 'an object {"latency_s": ..., "bytes_per_s": ...}')
        return LinkFit(*(self.positive(self.field(value, key, f"{path}.{key}"), f"{path}.{key}")
                         for key in LinkFit._fields))


def _fits_line(fits: dict[int, LinkFit]) -> str:
    return "   ".join(f"n={n}: {fit.latency_s * 1e6:6.0f} us + {fit.bytes_per_s / 1e9:5.2f} GB/s"
                      for n, fit in sorted(fits.items()))


def _shown(value) -> str:
    """A value as one short line of JSON-like text, for error messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."


def default_profile() -> Profile:
    """The profile the cost model uses when given none: nominal numbers for a small x86 CPU machine (two cores,
    AVX-512) running gloo over loopback with one thread per rank and a few ranks sharing it, close to what
    ``shardlib calibrate --world 4`` measures on the project's 2-core test machine (world_size None: for any
    world). Collectives follow ring algorithms over links of 0.5 GB/s with 0.4 ms per step (:func:`_ring`).
    Good for comparing layouts with each other; for absolute step times, measure the machine."""
    return Profile(
        machine="built-in nominal (uncalibrated)", backend="gloo", device="cpu", world_size=None,
        gemm={"float32": ((3.4e7, 3.0e10), (5.4e8, 4.0e10), (8.6e9, 4.0e10)),
              "bfloat16": ((3.4e7, 1.5e10), (5.4e8, 2.0e10), (8.6e9, 2.0e10))},
        memory_bytes_per_s=4.0e9, op_seconds=2e-5,
        collectives={op: {n: _ring(op, n, step_s=4e-4, link_bytes_per_s=5e8) for n in (2, 4, 8, 16)}
                     for op in COLLECTIVES if op != "send_recv"} | {"send_recv": {2: LinkFit(4e-4, 5e8)}},
    )


def _ring(op: str, n: int, step_s: float, link_bytes_per_s: float) -> LinkFit:
    """A collective over a ring of ``n`` ranks, in the profile's terms (bytes: this rank's input): an all-reduce
    takes 2(n-1) steps and moves 2(n-1)/n of its input per link; an all-gather n-1 steps moving (n-1) times its
    input; a reduce-scatter or an all-to-all n-1 steps moving (n-1)/n of it."""
    steps, moved = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n), "all_gather": (n - 1, n - 1)}.get(
        op, (n - 1, (n - 1) / n))
    return LinkFit(steps * step_s, link_bytes_per_s / moved)
