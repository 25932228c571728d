"""What ``shard()`` did on this rank: one row per rewritten module, the attributes it changed, the kernels it
installed and the parameter bytes before and after (``shardlib.report(model)``). Its own module so that the passes
that fill it and the analysis tools that read it need not import the sharder."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReportRow:
    module: str
    style: str
    tensors: list[tuple[str, tuple[int, ...], tuple[int, ...], str]]  # name, global shape, local shape, layout


@dataclass
class ShardReport:
    """Every rewrite the sharder made on this rank, and the parameter bytes per rank before and after."""

    policy: str
    model_class: str
    mesh: str
    rows: list[ReportRow] = field(default_factory=list)
    attributes: list[tuple[str, str, int, int]] = field(default_factory=list)  # module, attr, before, after
    kernels: list[tuple[str, int]] = field(default_factory=list)  # fused kernel, modules it was installed on
    unsharded_bytes: int = 0
    local_bytes: int = 0
    #: an inferred plan: what stays replicated and why, and the seconds its proof took (None: not verified)
    unplaced: list[tuple[str, str]] = field(default_factory=list)
    verified_s: float | None = None
    #: options that change nothing on this mesh and why (e.g. sequence parallelism at tp=1), said once here
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"shardlib: {self.model_class} with policy '{self.policy}' on {self.mesh}"]
        lines.append(f"{'module':<56} {'style':<44} {'tensor':<7} {'global':>14} {'local':>14}")
        for row in self.rows:
            if not row.tensors:
                lines.append(f"{row.module:<56} {row.style:<44}")
            for i, (name, glob, loc, _) in enumerate(row.tensors):
                mod, sty = (row.module, row.style) if i == 0 else ("", "")
                lines.append(f"{mod:<56} {sty:<44} {name:<7} {_shape(glob):>14} {_shape(loc):>14}")
        for module, attr, before, after in self.attributes:
            lines.append(f"{module:<56} {'attribute ' + attr:<44} {before:>7} -> {after}")
        for kind, count in self.kernels:
            lines.append(f"{'kernel ' + kind:<56} installed on {count} modules")
        for module, why in self.unplaced:
            lines.append(f"{module:<56} left replicated: {why}")
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.verified_s is not None:
            lines.append(f"inferred plan verified on a 2-layer float64 twin in {self.verified_s:.2f} s")
        ratio = self.local_bytes / self.unsharded_bytes if self.unsharded_bytes else 1.0
        lines.append(
            f"parameter bytes per rank: {_mib(self.local_bytes)} (unsharded {_mib(self.unsharded_bytes)}, "
            f"{ratio:.3f}x)"
        )
        return "\n".join(lines)


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


__all__ = ["ReportRow", "ShardReport"]
