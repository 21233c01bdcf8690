"""Notebook 06's presentation: the collective grid as tables, plots and sentences generated from it.

Every function takes the tables of :mod:`lab.book.communication.collectives` (``collectives``: one row per backend, op,
world size and size, with every iteration's time in ``samples_ms``; ``collectives_latency_bandwidth``: the
alpha-beta fit) and returns a table, a figure or Markdown text. A sentence that says "faster", "slower" or
"no extra cost" gets the word from :mod:`lab.measure.verdicts` on the iteration samples.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pandas as pd
import torch

from lab.bench.interleaved import samples
from lab.book.communication.collectives import bus_bandwidth_factor
from lab.measure.results import load_provenance
from lab.measure.verdicts import Comparison, compare

OP_NAMES = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}
GRID_COLUMNS = ["backend", "op", "world_size", "size_mb", "time_ms", "time_ms_std", "algbw_gbps", "busbw_gbps",
                "correct", "status"]


def duration(ms: float) -> str:
    """``"143 µs"`` below a millisecond, ``"3.38 ms"`` above, ``"n/a"`` for NaN."""
    if ms is None or not math.isfinite(ms):
        return "n/a"
    return f"{ms * 1e3:.3g} µs" if ms < 1 else f"{ms:.3g} ms"


def nominal_mb(mb: float) -> float:
    """A size rounded to whole KiB: the size asked for, where the benchmark trimmed a tensor by a few elements
    to a multiple of the world size (0.999985 MiB on 6 ranks is the 1 MiB row)."""
    return round(mb * 1024) / 1024 if mb >= 1 / 1024 else mb


def size_text(mb: float) -> str:
    """``"64 KiB"``, ``"10 MiB"``, ``"1 GiB"`` (of the nominal size)."""
    mb = nominal_mb(mb)
    value, unit = (mb / 1024, "GiB") if mb >= 1024 else (mb, "MiB") if mb >= 1 else (mb * 1024, "KiB")
    return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"


def _ok(grid: pd.DataFrame) -> pd.DataFrame:
    return grid[grid["status"] == "ok"]


def grid_table(grid: pd.DataFrame) -> pd.DataFrame:
    """The grid's columns worth reading, sorted by backend, op, world size and size."""
    cols = [c for c in GRID_COLUMNS if c in grid.columns]
    return grid[cols].sort_values(["backend", "op", "world_size", "size_mb"], ignore_index=True)


def correctness_sentence(grid: pd.DataFrame) -> str:
    """Whether every measured collective returned the values its inputs imply."""
    ok = _ok(grid)
    wrong = ok[~ok["correct"].astype(bool)]
    if wrong.empty:
        return (f"All {len(ok)} measured collectives returned the values expected from their inputs (checked "
                "element by element against closed forms before timing).")
    cases = "; ".join(f"{r.backend} {OP_NAMES.get(r.op, r.op)} on {r.world_size} ranks at {size_text(r.size_mb)}"
                      for r in wrong.itertuples())
    return f"**Wrong values** in {len(wrong)} of {len(ok)} collectives: {cases}. Their times mean nothing."


def measuring_machine(results_dir: str, replay) -> dict:
    """GPU count and CPU cores of the machine whose collectives the notebook shows: this one when it
    measures, the one named in the table's provenance when it replays (``cores`` None where an older table
    did not record them)."""
    if replay is True or (replay and "collectives" in replay):
        meta = load_provenance("collectives", results_dir, "06_communication")
        return dict(gpus=int(meta.get("gpu_count") or 0), cores=meta.get("host_cores"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return dict(gpus=gpus, cores=os.cpu_count() or 1)


def cpu_sharing_sentence(grid: pd.DataFrame, cores: int | None) -> str:
    """A caution when gloo ran more processes than the measuring machine has ``cores`` (empty without gloo
    rows; a plain statement when the core count was not recorded)."""
    gloo = grid[grid["backend"] == "gloo"]
    if gloo.empty:
        return ""
    if not cores:
        return ("The measuring machine's core count was not recorded with this table: whether its gloo processes "
                "shared cores is not known here.")
    if gloo["world_size"].max() <= cores:
        return f"Every gloo process had a CPU core of its own ({cores} cores)."
    crowded = sorted(int(n) for n in gloo["world_size"].unique() if n > cores)
    return (f"This machine has {cores} CPU core(s), so with {', '.join(map(str, crowded))} gloo processes they take "
            "turns on the cores: a rank waits for its peers to be scheduled, and those times measure the OS "
            "scheduler as much as the transport. Read them as what an oversubscribed host does, not as gloo's "
            "speed.")


def plot_bandwidth(grid: pd.DataFrame):
    """Bus bandwidth against message size, one panel per backend (hue: op, style: world size); returns the
    seaborn grid."""
    import seaborn as sns

    g = sns.relplot(data=_ok(grid), x="size_mb", y="busbw_gbps", hue="op", style="world_size", col="backend",
                    kind="line", markers=True, facet_kws=dict(sharey=False, sharex=False), height=3.8, aspect=1.2)
    g.set(xscale="log", xlabel="tensor size (MiB)", ylabel="bus bandwidth (GB/s)")
    return g


def plot_times_with_fit(grid: pd.DataFrame, fits: pd.DataFrame, op: str = "all_reduce"):
    """Measured time per call of ``op`` against size (points, with the middle half of the iterations as a
    bar) and the fitted latency + size / bandwidth (lines), one panel per backend; returns the figure."""
    import matplotlib.pyplot as plt

    ok = _ok(grid)
    ok = ok[ok["op"] == op]
    backends = list(dict.fromkeys(ok["backend"]))
    fig, axes = plt.subplots(1, max(len(backends), 1), figsize=(6 * max(len(backends), 1), 4), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        part = ok[ok["backend"] == backend]
        for i, (n, rows) in enumerate(part.groupby("world_size")):
            color = f"C{i}"
            q = np.array([np.percentile(samples(s), [25, 75]) for s in rows["samples_ms"]]) \
                if "samples_ms" in rows else None
            yerr = None if q is None else np.abs(q.T - rows["time_ms"].to_numpy())
            ax.errorbar(rows["size_mb"], rows["time_ms"], yerr=yerr, fmt="o", color=color, label=f"{n} ranks")
            f = fits[(fits["backend"] == backend) & (fits["op"] == op) & (fits["world_size"] == n)]
            if len(f) and math.isfinite(f["bandwidth_gbps"].item()):
                x = np.logspace(np.log10(rows["size_mb"].min()), np.log10(rows["size_mb"].max()), 50)
                ax.plot(x, f["latency_ms"].item() + x * 2**20 / (f["bandwidth_gbps"].item() * 1e6), "--",
                        color=color, lw=1)
        ax.set(xscale="log", yscale="log", title=f"{backend}: {OP_NAMES.get(op, op)}", xlabel="tensor size (MiB)",
               ylabel="time per call (ms, slowest rank)")
        ax.legend(fontsize=8, title="points: median; dashes: fit", title_fontsize=8)
    fig.tight_layout()
    return fig


def latency_bandwidth_sentences(fits: pd.DataFrame, op: str = "all_reduce") -> str:
    """What the alpha-beta fit says for ``op`` per backend and world size: latency, bandwidth, and the size
    below which a call is latency-bound (or why the fit says nothing)."""
    part = fits[fits["op"] == op].sort_values(["backend", "world_size"])
    if part.empty:
        return f"No {OP_NAMES.get(op, op)} fit (fewer than two sizes measured)."
    lines = []
    for r in part.itertuples():
        head = f"**{r.backend}, {r.world_size} ranks:** "
        if not math.isfinite(r.bandwidth_gbps):
            lines.append(head + f"times do not grow with size over the {r.sizes} sizes measured, so the fit finds "
                                "no bandwidth; the calls are all latency (and scheduling) at these sizes.")
            continue
        latency = "an intercept too small to resolve" if r.latency_ms <= 0 else f"{duration(r.latency_ms)} per call"
        fit = "" if r.max_residual <= 0.5 else (f" The model misses a measured time by up to {r.max_residual:.0%}: "
                                                "treat the two numbers as rough.")
        bound = (f"; a call is latency-bound below about {size_text(r.half_latency_mb)}"
                 if r.latency_ms > 0 else "")
        lines.append(head + f"latency {latency}, bandwidth {r.bandwidth_gbps:.3g} GB/s{bound}.{fit}")
    return "\n\n".join(lines)


def latency_bandwidth_answer(fits: pd.DataFrame, op: str = "all_reduce") -> str:
    """One line per backend for the answers box: the smallest world size's fitted latency and bandwidth."""
    part = fits[fits["op"] == op].sort_values(["backend", "world_size"]).groupby("backend").head(1)
    if part.empty:
        return "not measured."
    bits = []
    for r in part.itertuples():
        bw = f"{r.bandwidth_gbps:.3g} GB/s" if math.isfinite(r.bandwidth_gbps) else "no resolvable bandwidth"
        bits.append(f"{r.backend} with {r.world_size} ranks: {duration(r.latency_ms)} + size / {bw}")
    return f"{OP_NAMES.get(op, op).capitalize()}: " + "; ".join(bits) + "."


# ----------------------------------------------------------------------------------------------------------
# comparisons drawn from the iteration samples


def _samples_at(grid: pd.DataFrame, backend: str, op: str, world_size: int, size_mb: float) -> list[float]:
    ok = _ok(grid)
    row = ok[(ok["backend"] == backend) & (ok["op"] == op) & (ok["world_size"] == world_size)
             & (ok["size_mb"].map(nominal_mb) == nominal_mb(size_mb))]
    return samples(row["samples_ms"].iloc[0]) if len(row) else []


def split_allreduce(grid: pd.DataFrame) -> pd.DataFrame:
    """Per backend and world size, at the largest size measured for all three ops: the all-reduce against a
    reduce-scatter followed by an all-gather (what ZeRO-1 and FSDP issue instead). Columns backend,
    world_size, size_mb, all_reduce_ms, split_ms (medians), ratio (split / all-reduce), low, high (its 95 %
    interval) and verdict (of the split against the all-reduce: faster, slower or within noise)."""
    rows = []
    ok = _ok(grid).assign(size_mb=lambda d: d["size_mb"].map(nominal_mb))
    for (backend, n), part in ok.groupby(["backend", "world_size"]):
        sizes = [s for s, ops in part.groupby("size_mb")["op"] if {"all_reduce", "all_gather", "reduce_scatter"}
                 <= set(ops)]
        if not sizes:
            continue
        s = max(sizes)
        ar = _samples_at(grid, backend, "all_reduce", n, s)
        rs, ag = _samples_at(grid, backend, "reduce_scatter", n, s), _samples_at(grid, backend, "all_gather", n, s)
        split = [a + b for a, b in zip(rs, ag)]
        if not ar or not split:
            continue
        c = compare(split, ar)
        rows.append(dict(backend=backend, world_size=int(n), size_mb=s, all_reduce_ms=float(np.median(ar)),
                         split_ms=float(np.median(split)), ratio=c.ratio, low=c.low, high=c.high, verdict=c.verdict))
    return pd.DataFrame(rows, columns=["backend", "world_size", "size_mb", "all_reduce_ms", "split_ms", "ratio", "low",
                                       "high", "verdict"])


def split_allreduce_sentences(split: pd.DataFrame) -> str:
    """What splitting an all-reduce into reduce-scatter + all-gather costs, per backend and world size, in the
    words of the verdict (never "no extra cost" unless the interval says the split is not slower)."""
    if split.empty:
        return "The grid has no size at which all three collectives were measured."
    lines = []
    for r in split.itertuples():
        c = compare_row(r)
        clause = c.describe("reduce-scatter + all-gather", "the all-reduce")
        meaning = {"slower": "splitting the all-reduce (as ZeRO-1 and FSDP do) costs extra communication time here",
                   "faster": "splitting it costs no extra time here; this backend's all-reduce is the slower path",
                   "within noise": "no difference between the two is measurable beyond the noise"}[r.verdict]
        lines.append(f"**{r.backend}, {r.world_size} ranks, {size_text(r.size_mb)}:** {duration(r.split_ms)} against "
                     f"{duration(r.all_reduce_ms)}: {clause}, so {meaning}.")
    return "\n\n".join(lines)


def compare_row(r):
    """A :class:`~lab.measure.verdicts.Comparison` rebuilt from a table row's ratio, low, high and verdict."""
    return Comparison(r.ratio, r.low, r.high, r.verdict)


def bus_bandwidth_by_ranks(grid: pd.DataFrame, op: str = "all_reduce") -> pd.DataFrame:
    """Per backend, at the largest size measured for every world size: the bus bandwidth of ``op`` per world
    size (median over iterations), compared with the smallest world size's (higher, lower or within noise;
    ratio with its interval)."""
    rows = []
    ok = _ok(grid).assign(size_mb=lambda d: d["size_mb"].map(nominal_mb))
    ok = ok[ok["op"] == op]
    for backend, part in ok.groupby("backend"):
        common = set.intersection(*(set(p["size_mb"]) for _, p in part.groupby("world_size")))
        if not common:
            continue
        s = max(common)
        at = part[part["size_mb"] == s].sort_values("world_size")
        factor = (at["busbw_gbps"] * at["time_ms"]).to_numpy()  # busbw * time: the bytes one link carries
        bw = {int(n): [f / t for t in samples(x)] for n, f, x in zip(at["world_size"], factor, at["samples_ms"])}
        base = min(bw)
        for n, values in bw.items():
            c = compare(values, bw[base], lower_is_better=False) if n != base else None
            rows.append(dict(backend=backend, size_mb=s, world_size=n, busbw_gbps=float(np.median(values)),
                             algbw_gbps=float(np.median(values)) / bus_bandwidth_factor(op, n),
                             ratio_to_smallest=c.ratio if c else 1.0, low=c.low if c else math.nan,
                             high=c.high if c else math.nan, verdict=c.verdict if c else "reference"))
    return pd.DataFrame(rows, columns=["backend", "size_mb", "world_size", "busbw_gbps", "algbw_gbps",
                                       "ratio_to_smallest", "low", "high", "verdict"])


def bus_bandwidth_sentences(by_ranks: pd.DataFrame) -> str:
    """Does the bus bandwidth hold as ranks are added? One sentence per backend, from the verdicts."""
    lines = []
    for backend, part in by_ranks.groupby("backend"):
        if len(part) < 2:
            continue
        base = part[part["verdict"] == "reference"].iloc[0]
        others = part[part["verdict"] != "reference"]
        held = others[others["verdict"] == "within noise"]
        words = "; ".join(f"{r.world_size} ranks {r.busbw_gbps:.3g} GB/s ({r.verdict}, ratio "
                          f"{r.ratio_to_smallest:.3g}, interval {r.low:.3g}-{r.high:.3g})" for r in others.itertuples())
        if len(held) == len(others):
            meaning = ("the bus bandwidth holds within the noise while the algorithm bandwidth falls: each link "
                       "carries 2(n-1)/n of the data, which is what the bus-bandwidth convention normalizes away")
        elif (others["verdict"] == "lower").any():
            meaning = ("the bus bandwidth does not hold: adding ranks costs more than the ring's 2(n-1)/n traffic "
                       "per link explains (more hops of latency, shared links, or, for CPU processes, shared cores)")
        elif not (others["verdict"] == "higher").all():
            meaning = ("the bus bandwidth holds or rises with the ranks: adding ranks costs no more than the ring's "
                       "2(n-1)/n traffic per link explains")
        else:
            meaning = ("the bus bandwidth rises with the ranks, which the ring's 2(n-1)/n traffic per link does not "
                       "predict: the ranks' links are not the bottleneck at the fewest ranks"
                       + (" (gloo copies through host memory and TCP, and more processes overlap more of those "
                          "copies)" if backend == "gloo" else ""))
        lines.append(f"**{backend}, {size_text(base.size_mb)}:** {base.world_size} ranks reach {base.busbw_gbps:.3g} "
                     f"GB/s of bus bandwidth; {words}. So {meaning}.")
    return "\n\n".join(lines) or "Only one world size was measured: nothing to compare."


def backend_sentence(grid: pd.DataFrame, op: str = "all_reduce", world_size: int = 2) -> str:
    """NCCL against gloo for ``op`` at the largest size both measured with ``world_size`` ranks (or a sentence
    saying they cannot be compared)."""
    ok = _ok(grid).assign(size_mb=lambda d: d["size_mb"].map(nominal_mb))
    ok = ok[(ok["op"] == op) & (ok["world_size"] == world_size)]
    sizes = set(ok.loc[ok["backend"] == "gloo", "size_mb"]) & set(ok.loc[ok["backend"] == "nccl", "size_mb"])
    if not sizes:
        return f"No size was measured with {world_size} ranks on both gloo and NCCL, so the two are not compared."
    s = max(sizes)
    c = compare(_samples_at(grid, "nccl", op, world_size, s), _samples_at(grid, "gloo", op, world_size, s))
    return (f"At {size_text(s)} with {world_size} ranks, {c.describe('NCCL', 'gloo')}: GPU-to-GPU links against "
            "copies through host memory and TCP.")


def split_allreduce_answer(split: pd.DataFrame) -> str:
    """The answers-box line: per backend and world size, the split's verdict against the all-reduce."""
    if split.empty:
        return "not measured."
    return "; ".join(f"{r.backend} with {r.world_size} ranks at {size_text(r.size_mb)}: the split is {r.verdict} "
                     f"(time ratio {r.ratio:.3g}, interval {r.low:.3g}-{r.high:.3g})" for r in split.itertuples()) + "."


def bus_bandwidth_answer(by_ranks: pd.DataFrame) -> str:
    """The answers-box line: per backend, the bus bandwidth at each world size and its verdict."""
    if by_ranks.empty or by_ranks.groupby("backend").size().max() < 2:
        return "only one world size was measured."
    parts = []
    for backend, part in by_ranks.groupby("backend"):
        values = ", ".join(f"{r.busbw_gbps:.3g} GB/s on {r.world_size} ranks"
                           + ("" if r.verdict == "reference" else f" ({r.verdict})") for r in part.itertuples())
        parts.append(f"{backend}: {values}")
    return "; ".join(parts) + " (verdicts against the fewest ranks)."
