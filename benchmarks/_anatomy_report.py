"""The tables of ``benchmarks/step_anatomy.py``."""

from __future__ import annotations

import math
import statistics

from _anatomy_measure import ORDER
from _anatomy_workload import base_mode, title
from _harness import median_spread, print_table


def spread(values, scale: float = 1.0, fmt: str = ".0f") -> str:
    """``median [min-max]`` of ``values`` times ``scale``."""
    med, lo, hi = median_spread(values)
    return f"{med * scale:{fmt}} [{lo * scale:{fmt}}-{hi * scale:{fmt}}]"


def name(mode: str) -> str:
    layout, _, baseline = mode.partition("@")
    return title(layout) + (f" ({baseline})" if baseline else "")


def layouts(modes: list[str], rec: dict, base: str, tokens: int, heading: str) -> None:
    """Step time per layout (with the paired ratios to ``base``), then the profiled anatomy and the ring's waits."""
    seconds, cpu, faults, anatomy = rec["seconds"], rec["cpu_seconds"], rec["minor_faults"], rec["anatomy_ms"]
    ref, ref_cpu = seconds.get(base), cpu.get(base)
    rows = []
    for m in modes if any(seconds.values()) else ():
        row = [name(m), spread(seconds[m], 1e3), spread([tokens / s for s in seconds[m]]), spread(cpu[m], 1e3),
               spread(faults[m], 1e-3, ".1f")]
        if ref:
            row += [spread([b / s for b, s in zip(ref, seconds[m])], 1, ".3f"),
                    spread([b / s for b, s in zip(ref_cpu, cpu[m])], 1, ".3f")]
        rows.append(row)
    header = ["layout", "wall ms / step", "tokens / s", "CPU ms / step (all ranks)", "k page faults / step (all ranks)"]
    if rows:
        print_table(f"{heading}: step time (median of rounds [range])", header + (
            [f"{base} / layout, wall (paired)", f"{base} / layout, CPU (paired)"] if ref else []), rows)
    if rec.get("started_s"):
        print("started (spawn, build, --warmup steps: the compile of a _compiled mode), s: "
              + ", ".join(f"{m} {s:.0f}" for m, s in rec["started_s"].items()))
    if not anatomy:
        return
    rows = [[c] + [f"{anatomy[m][c]:.0f}" for m in modes] for c in ORDER]
    rows.append(["**profiled wall**"] + [f"**{anatomy[m]['wall_ms']:.0f}**" for m in modes])
    print_table(f"{heading}: anatomy (torch.profiler, self time per category, rank 0)",
                ["ms / step (profiled)"] + [name(m) for m in modes], rows)
    ring_rows(modes, anatomy)


def ring_rows(modes: list[str], anatomy: dict) -> None:
    """Every ring layout's probe (rank 0): compute, waits, and the wire's cost had nothing hidden it (the exchanges
    of blocks in flight, all but each backward's last hop home, times one exchange alone)."""
    rows = []
    for m in modes:
        r = anatomy[m].get("ring") or {}
        if "exchange alone ms" not in r:
            continue
        home, calls = r.get("wait home ms", 0.0), r.get("wait home calls", 0.0)
        in_flight = r.get("wait forward ms", 0.0) + r.get("wait backward ms", 0.0) - home
        wire = r["exchange alone ms"] * (r.get("start forward calls", 0) + r.get("start backward calls", 0) - calls)
        posted = [r.get(f"start {phase} {what}", 0) for what in ("ms", "calls") for phase in ("forward", "backward")]
        rows.append([name(m), f"{r.get('pieces forward ms', 0):.0f}", f"{r.get('pieces backward ms', 0):.0f}",
                     f"{in_flight:.1f}", f"{home:.1f}", f"{posted[0] + posted[1]:.1f}",
                     f"{posted[2] + posted[3]:.0f} x {r['block MiB']:.1f} MiB",
                     f"{r['exchange alone ms']:.1f}", f"{wire:.0f}", f"{1 - min(1.0, in_flight / max(wire, 1e-9)):.0%}",
                     f"{(in_flight + home) / anatomy[m]['wall_ms']:.1%}"])
    if rows:
        print_table("Ring attention per step (profiled steps, rank 0)",
                    ["layout", "pieces fwd ms", "pieces bwd ms", "waits for blocks in flight ms",
                     "waits for dK/dV home ms", "posting ms", "exchanges", "one alone ms", "wire alone ms",
                     "wire hidden", "waits / step"], rows)


def peak_rows(modes: list[str], peaks: dict, base: str = "unsharded") -> None:
    """Per layout: the largest rank's peak of live tensors, every rank's, the ratio to ``base``'s, what makes it."""
    rows = []
    for m in modes:
        per_rank = [p["peak_mib"] for p in peaks[m]]
        top = max(peaks[m], key=lambda p: p["peak_mib"])
        ratio = f"{max(per_rank) / max(p['peak_mib'] for p in peaks[base]):.3f}" if base in peaks else "-"
        largest = ", ".join(f"{mib:.0f} {op.removeprefix('aten.')}" for mib, op, _ in top["at_peak"][:4])
        rows.append([name(m), f"{max(per_rank):.0f}", " / ".join(f"{v:.0f}" for v in per_rank), ratio, largest])
    print_table("Peak of live tensors in one step, MiB (parameters and their gradients excluded)",
                ["layout", "largest rank", "per rank", f"/ {base}", "largest storages at the peak (MiB op)"], rows)


def unpacked(mode: str) -> str | None:
    """The mode whose rows a ``_docs`` mode packs as documents (None for any other mode)."""
    layout, at, baseline = mode.partition("@")
    return layout.removesuffix("_docs") + at + baseline if layout.endswith("_docs") else None


def documents_rows(modes: list[str], rec: dict) -> None:
    """Each ``_docs`` layout's step against the same rows unpacked (its mode without ``_docs``), paired by round."""
    seconds, cpu, rows = rec["seconds"], rec["cpu_seconds"], []
    for m in modes:
        plain = unpacked(m)
        if plain in modes and seconds[m]:
            rows.append([name(m), spread(seconds[m], 1e3), spread(seconds[plain], 1e3),
                         f"**{spread([d / u for d, u in zip(seconds[m], seconds[plain])], 1, '.3f')}**",
                         spread([d / u for d, u in zip(cpu[m], cpu[plain])], 1, ".3f")])
    if rows:
        print_table("Packed documents against the same rows unpacked (median of rounds [range])",
                    ["layout", "wall ms / step, packed", "wall ms / step, unpacked", "packed / unpacked, wall (paired)",
                     "packed / unpacked, CPU (paired)"], rows)


def sweep_peaks(modes: list[str], points: list[dict], documents: int) -> None:
    """A sweep's peaks (largest rank, MiB) per layout and mask at each length, with the ratio to the same layout
    unmasked (padding 0, no documents) at that length, and the growth exponent log(peak2 / peak1) / log(L2 / L1)
    between consecutive lengths."""
    seqs = sorted({p["seq"] for p in points})
    peak = {(p["size"], p["seq"], p["padding"], m): max(r["peak_mib"] for r in p["peaks"][m])
            for p in points for m in p["peaks"]}
    rows = []
    for size, padding, m in dict.fromkeys((p["size"], p["padding"], m) for p in points for m in modes
                                          if m in p["peaks"]):
        mine = [peak.get((size, n, padding, m)) for n in seqs]
        plain = [peak.get((size, n, 0.0, unpacked(m) or m)) for n in seqs]
        cells = [f"{v:.0f}" + (f" ({v / u:.2f}x)" if u and v and (padding or unpacked(m)) else "")
                 for v, u in zip(mine, plain)]
        growth = [f"{math.log(b / a) / math.log(n2 / n1):.2f}" if a and b else "-"
                  for (n1, a), (n2, b) in zip(zip(seqs, mine), zip(seqs[1:], mine[1:]))]
        mask = ", ".join([f"{documents} documents"] * bool(unpacked(m)) + [f"padding {padding:g}"] * bool(padding))
        rows.append([name(m) + (f" ({size})" if len({p["size"] for p in points}) > 1 else ""), mask or "none",
                     *cells, *growth])
    print_table("Peak of live tensors per rank by length, MiB (largest rank; in brackets: / the same layout unmasked)",
                ["layout", "mask", *(f"{n} tokens" for n in seqs),
                 *(f"exponent {a}-{b}" for a, b in zip(seqs, seqs[1:]))], rows)


def forms(modes: list[str], rec: dict, real_tokens: float, slots: dict) -> dict:
    """``--lengths``: per layout and batch form, token positions and real tokens / s, packed / that form (real tokens
    / s, paired by round: the same samples on both sides), and peak KiB per real token (largest rank) with packed /
    that form (paired by batch). Returns {mode: per-round ratios packed / mode}."""
    seconds, peaks, ratios, rows = rec["seconds"], rec.get("peaks") or {}, {}, []

    def per_token(mode):  # each batch's peak per real token, the largest rank's
        return [max(v) for v in zip(*(rank["kib_per_real_token"] for rank in peaks[mode]))]

    for m in modes:
        packed = base_mode(m) + "_packed"
        row = [name(m), f"{slots[m]:.0f} ({1 - real_tokens / slots[m]:.0%})",
               spread([real_tokens / s for s in seconds[m]])]
        if packed in seconds and m != packed:
            ratios[m] = [s / p for s, p in zip(seconds[m], seconds[packed])]
            row.append(f"**{spread(ratios[m], 1, '.2f')}**")
        else:
            row.append("-")
        if peaks:
            row.append(spread(per_token(m)))
            row.append(spread([p / s for p, s in zip(per_token(packed), per_token(m))], 1, ".3f")
                       if packed in peaks and m != packed else "-")
        rows.append(row)
    print_table(f"Real tokens / s by batch form ({real_tokens:.0f} real tokens / step; median of rounds [range])",
                ["layout, batch form", "token positions / step (padding)", "real tokens / s",
                 "packed / this, real tokens / s (paired)"]
                + (["peak KiB / real token (fwd + bwd, median of batches [range])", "packed / this, peak per real "
                    "token (paired by batch)"] if peaks else []), rows)
    return ratios


def switched(seconds: dict) -> None:
    """Each variant's median step and the median over pairs of variant / first variant with its quartiles."""
    names = list(seconds)
    rows = []
    for variant in names:
        ratios = [a / b for a, b in zip(seconds[variant], seconds[names[0]])]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        rows.append([variant, spread(seconds[variant], 1e3),
                     f"{statistics.median(ratios):.3f} [{quartiles[0]:.3f}-{quartiles[2]:.3f}]"])
    print_table(None, ["variant", "wall ms / step [range]", f"/ {names[0]}, per pair: median [quartiles]"], rows)


def in_process(seconds: dict, cpu: dict, titles: dict, heading: str) -> None:
    rows = []
    for m in seconds:
        diff = [(s - b) * 1e3 for s, b in zip(seconds[m], seconds["unsharded"])]
        rows.append([titles[m], spread(seconds[m], 1e3, ".1f"), spread(cpu[m], 1e3, ".1f"),
                     spread([b / s for b, s in zip(seconds["unsharded"], seconds[m])], 1, ".3f"),
                     spread(diff, 1, "+.2f")])
    print_table(heading, ["variant", "wall ms / step", "CPU ms / step", "unsharded / variant (paired)",
                          "ms / step more than unsharded (paired)"], rows)
