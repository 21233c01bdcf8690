"""Notebook 06: the collective grid it measures (:class:`CollectiveGrid`, run by :mod:`lab.bench.collectives`)
and what it shows of it: tables, plots, and its answers as claims (:mod:`lab.book.claims`), every comparison
drawn from the timed calls' samples under the one rule.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch

from lab.bench.collectives import OPS, benchmark_collectives, bus_bandwidth_factor, plan_world_sizes
from lab.bench.interleaved import samples
from lab.book import claims as cl
from lab.measure.results import load_provenance
from lab.units import MiB

OP_NAMES = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}


@dataclass(frozen=True)
class CollectiveGrid:
    """What notebook 06 measures: ``ops`` over gloo with ``cpu_world_sizes`` CPU processes at ``cpu_sizes_mb``,
    and over NCCL with ``gpu_world_sizes`` GPUs at ``gpu_sizes_mb`` (empty: no NCCL part); ``warmup`` untimed
    and ``iters`` timed calls each. ``note`` says which requested world sizes NCCL cannot run, and why."""

    ops: tuple[str, ...] = OPS
    cpu_world_sizes: tuple[int, ...] = (2, 4, 6)
    cpu_sizes_mb: tuple[float, ...] = (1, 10, 100)
    gpu_world_sizes: tuple[int, ...] = ()
    gpu_sizes_mb: tuple[float, ...] = (1, 10, 100, 1024)
    warmup: int = 5
    iters: int = 20
    note: str = ""

    def params(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k != "note"}

    def measure(self, progress: bool = True) -> pd.DataFrame:
        """The gloo grid, then the NCCL grid, as one table (:func:`lab.bench.collectives.benchmark_collectives`)."""
        parts = [("cpu", self.cpu_sizes_mb, self.cpu_world_sizes), ("cuda", self.gpu_sizes_mb, self.gpu_world_sizes)]
        return pd.concat([benchmark_collectives(self.ops, sizes, ranks, device, self.warmup, self.iters,
                                                progress=progress) for device, sizes, ranks in parts if ranks],
                         ignore_index=True)


def plan_grid(quick: bool, device: str = "auto", world_sizes: Sequence[int] = (2, 4, 6), ops: Sequence[str] = OPS,
              gpu_sizes_mb: Sequence[float] = (1, 10, 100, 1024), cpu_sizes_mb: Sequence[float] | None = None,
              warmup: int = 5, iters: int = 20, gpus: int | None = None) -> CollectiveGrid:
    """The notebook's grid made concrete. gloo always runs every world size as CPU processes, at
    ``cpu_sizes_mb`` (default 1, 10, 100 MiB; quick: 1/16, 1/2, 4 MiB and at most 3 warm-up and 10 timed
    calls: gloo is slow and a 2-core CPU runs 6 processes). NCCL runs, unless ``quick`` or ``device="cpu"``,
    the world sizes the GPUs allow at ``gpu_sizes_mb``; ``note`` explains the others."""
    for op in ops:
        bus_bandwidth_factor(op, 2)  # validates the name
    if cpu_sizes_mb is None:
        cpu_sizes_mb = (1 / 16, 1 / 2, 4) if quick else (1, 10, 100)
    if quick:
        warmup, iters = min(warmup, 3), min(iters, 10)
    gpu_world_sizes, note = [], ""
    if quick:
        note = "The quick profile measures gloo only (CPU processes); the full render adds NCCL on the GPUs."
    elif device == "cpu":
        note = "device='cpu': only gloo (CPU processes) is measured."
    else:
        gpu_world_sizes, note = plan_world_sizes(world_sizes, "cuda", gpus)
        note = note or f"NCCL runs every requested world size ({', '.join(map(str, gpu_world_sizes))} GPUs)."
    return CollectiveGrid(tuple(ops), tuple(world_sizes), tuple(float(s) for s in cpu_sizes_mb),
                          tuple(gpu_world_sizes), tuple(float(s) for s in gpu_sizes_mb), warmup, iters, note)


def measuring_machine(results_dir: str, replay) -> dict:
    """GPU count and CPU cores of the machine whose collectives the notebook shows: this one when it
    measures, the one named in the table's provenance when it replays (``cores`` None where an older table
    did not record them)."""
    if replay is True or (replay and "collectives" in replay):
        meta = load_provenance("collectives", results_dir, "06_communication")
        return dict(gpus=int(meta.get("gpu_count") or 0), cores=meta.get("host_cores"))
    return dict(gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0, cores=os.cpu_count() or 1)


# ----------------------------------------------------------------------------------------------------------
# the grid

GRID_COLUMNS = ["backend", "op", "world_size", "size_mb", "time_ms", "time_spread_ms", "time_n", "algbw_gbps",
                "busbw_gbps", "correct", "status"]


def _ok(grid: pd.DataFrame) -> pd.DataFrame:
    """The rows that ran, their sizes as asked for (whole KiB: older tables kept the size a world size trims)."""
    ok = grid[grid["status"] == "ok"]
    return ok.assign(size_mb=(ok["size_mb"] * 1024).round() / 1024)


def grid_table(grid: pd.DataFrame) -> pd.DataFrame:
    return grid[[c for c in GRID_COLUMNS if c in grid.columns]].sort_values(
        ["backend", "op", "world_size", "size_mb"], ignore_index=True)


def size(mb: float) -> str:
    return cl.number(mb * MiB, "B")


def label(r, op: str | None = None) -> str:
    return f"{r.backend} {OP_NAMES[op or r.op]}, {r.world_size} ranks, {size(r.size_mb)}"


def measured(r, what: str | None = None) -> cl.Measured:
    """A row's time per call from its timed calls (the slowest rank of each)."""
    return cl.Measured.of(what or label(r), samples(r.samples_ms))


def grid_findings(grid: pd.DataFrame, cores: int | None) -> list[cl.Finding]:
    """Whether every collective returned the values its inputs imply, and whether gloo's processes shared the
    measuring machine's CPU cores (then their times measure the scheduler as much as the transport)."""
    ok = _ok(grid)
    wrong = [label(r) for r in ok.itertuples() if not r.correct]
    out = [cl.Value(cl.Measured.value("collectives checked element by element against closed forms", len(ok))),
           cl.Observed("of which returned wrong values (their times mean nothing)", "; ".join(wrong) or "none")]
    gloo = sorted(int(n) for n in grid.loc[grid["backend"] == "gloo", "world_size"].unique())
    if gloo and not cores:
        out.append(cl.Observed("CPU cores of the measuring machine", "not recorded with this table"))
    elif gloo:
        crowded = ", ".join(str(n) for n in gloo if n > cores) or "none"
        out += [cl.Value(cl.Measured.value("CPU cores of the measuring machine", cores)),
                cl.Observed("gloo world sizes with more processes than cores (ranks take turns on the cores, so "
                            "those times measure the operating system's scheduler as much as gloo)", crowded)]
    return out


def plot_bandwidth(grid: pd.DataFrame):
    """Bus bandwidth against message size, a panel per backend (hue: op, style: world size)."""
    import seaborn as sns

    g = sns.relplot(data=_ok(grid), x="size_mb", y="busbw_gbps", hue="op", style="world_size", col="backend",
                    kind="line", markers=True, facet_kws=dict(sharey=False, sharex=False), height=3.8, aspect=1.2)
    g.set(xscale="log", xlabel="tensor size (MiB)", ylabel="bus bandwidth (GB/s)")
    return g


# ----------------------------------------------------------------------------------------------------------
# the alpha-beta model


def plot_times_with_fit(grid: pd.DataFrame, fits: pd.DataFrame, op: str = "all_reduce"):
    """Median time per call of ``op`` against size (bars: its spread) and the fitted latency + size /
    bandwidth (dashes), a panel per backend. Returns the figure."""
    import matplotlib.pyplot as plt

    ok = _ok(grid)[lambda d: d["op"] == op]
    backends = list(dict.fromkeys(ok["backend"])) or [""]
    fig, axes = plt.subplots(1, len(backends), figsize=(6 * len(backends), 4), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        for i, (n, rows) in enumerate(ok[ok["backend"] == backend].groupby("world_size")):
            ax.errorbar(rows["size_mb"], rows["time_ms"], yerr=rows.get("time_spread_ms"), fmt="o", color=f"C{i}",
                        label=f"{n} ranks")
            f = fits[(fits["backend"] == backend) & (fits["op"] == op) & (fits["world_size"] == n)]
            if len(f) and np.isfinite(f["bandwidth_gbps"].item()):
                x = np.logspace(np.log10(rows["size_mb"].min()), np.log10(rows["size_mb"].max()), 50)
                ax.plot(x, f["latency_ms"].item() + x * MiB / (f["bandwidth_gbps"].item() * 1e6), "--",
                        color=f"C{i}", lw=1)
        ax.set(xscale="log", yscale="log", title=f"{backend}: {OP_NAMES[op]}", xlabel="tensor size (MiB)",
               ylabel="time per call (ms, slowest rank)")
        ax.legend(fontsize=8, title="points: median; dashes: fit", title_fontsize=8)
    fig.tight_layout()
    return fig


def fit_findings(r) -> list[cl.Finding]:
    """One fit (a row of :func:`lab.bench.collectives.latency_bandwidth_fit`): latency, bandwidth, the size below
    which a call is latency-bound, and how far the model misses a measured time."""
    head = f"{r.backend}, {r.world_size} ranks: "
    if not np.isfinite(r.bandwidth_gbps):
        return [cl.Observed(head + "bandwidth", f"none resolvable: times do not grow with size over the {r.sizes} "
                                                "sizes measured, so these calls are all latency (and scheduling)")]
    latency = (r.latency_ms * 1e3, "µs") if r.latency_ms < 1 else (r.latency_ms, "ms")
    out = [cl.Value(cl.Measured.value(head + "latency per call", *latency)) if r.latency_ms > 0
           else cl.Observed(head + "latency per call", "too small to resolve"),
           cl.Value(cl.Measured.value("bandwidth", r.bandwidth_gbps, "GB/s"))]
    if r.latency_ms > 0:
        out.append(cl.Value(cl.Measured.value("latency-bound below", r.half_latency_mb * MiB, "B")))
    return out + [cl.Share("the model's largest miss of a measured time", r.max_residual, 1.0)]


def fits_findings(fits: pd.DataFrame, op: str = "all_reduce") -> list[cl.Finding]:
    return [f for r in fits[fits["op"] == op].sort_values(["backend", "world_size"]).itertuples()
            for f in fit_findings(r)]


def latency_claim(fits: pd.DataFrame, op: str = "all_reduce") -> cl.Claim:
    """Per backend, the smallest world size's fitted latency and bandwidth."""
    first = fits[fits["op"] == op].sort_values(["backend", "world_size"]).groupby("backend").head(1)
    findings = [f for r in first.itertuples() for f in fit_findings(r)[:2]]
    return cl.Claim(f"What does one {OP_NAMES[op]} call cost?", findings or [
        cl.Observed("the fit", "not made: fewer than two sizes measured")], because=(
        "A call costs a fixed latency plus size / bandwidth: small messages pay the latency, large ones the "
        "bandwidth."))


def backend_findings(grid: pd.DataFrame, op: str = "all_reduce", world_size: int = 2) -> list[cl.Finding]:
    """NCCL against gloo at the largest size both measured with ``world_size`` ranks."""
    ok = _ok(grid)
    ok = ok[(ok["op"] == op) & (ok["world_size"] == world_size)]
    both = set(ok.loc[ok["backend"] == "gloo", "size_mb"]) & set(ok.loc[ok["backend"] == "nccl", "size_mb"])
    if not both:
        return [cl.Observed(f"NCCL against gloo with {world_size} ranks", "not compared: no size measured on both")]
    at = {r.backend: r for r in ok[ok["size_mb"] == max(both)].itertuples()}
    return [cl.Versus(measured(at["nccl"]), measured(at["gloo"]))]


# ----------------------------------------------------------------------------------------------------------
# reduce-scatter + all-gather against all-reduce; more ranks


def split_comparisons(grid: pd.DataFrame) -> list[tuple[dict, cl.Versus]]:
    """Per backend and world size, at the largest size measured for all three ops: each timed reduce-scatter
    plus all-gather against the all-reduce (what ZeRO-1 and FSDP issue instead of it)."""
    out = []
    for (backend, n), part in _ok(grid).groupby(["backend", "world_size"]):
        sizes = [s for s, ops in part.groupby("size_mb")["op"] if set(OPS) <= set(ops)]
        if sizes:
            at = {r.op: r for r in part[part["size_mb"] == max(sizes)].itertuples()}
            rs, ag = samples(at["reduce_scatter"].samples_ms), samples(at["all_gather"].samples_ms)
            split = cl.Measured.of(f"{backend} reduce-scatter + all-gather, {n} ranks, {size(max(sizes))}",
                                   [a + b for a, b in zip(rs, ag)])
            out.append((dict(backend=backend, world_size=int(n), size=size(max(sizes))),
                        cl.Versus(split, measured(at["all_reduce"], "the all-reduce"))))
    return out


def split_claim(pairs: list[tuple[dict, cl.Versus]]) -> cl.Claim:
    return cl.Claim("Does splitting an all-reduce into reduce-scatter + all-gather cost extra time?",
                    [f for _, f in pairs] or [cl.Observed("the grid", "has no size measured for all three ops")],
                    because="On a ring an all-reduce is a reduce-scatter followed by an all-gather, so the two should "
                            "take the same time; where the split is slower, ZeRO-1 and FSDP pay that much more "
                            "communication than DDP's all-reduce.")


def rank_comparisons(grid: pd.DataFrame, op: str = "all_reduce") -> list[tuple[dict, cl.Versus]]:
    """Per backend, at the largest size every world size measured: the bus bandwidth of ``op`` per timed call
    at each world size against the fewest ranks' (higher is better)."""
    out = []
    ok = _ok(grid)[lambda d: d["op"] == op]
    for backend, part in ok.groupby("backend"):
        common = set.intersection(*(set(p["size_mb"]) for _, p in part.groupby("world_size")))
        if not common:
            continue
        rows = list(part[part["size_mb"] == max(common)].sort_values("world_size").itertuples())
        bw = [cl.Measured.of(f"the bus bandwidth of {label(r)}" if i else f"that of {r.world_size} ranks",
                             [r.size_bytes * bus_bandwidth_factor(op, r.world_size) / t / 1e6 for t in
                              samples(r.samples_ms)], "GB/s") for i, r in enumerate(rows)]
        out += [(dict(backend=backend, size=size(r.size_mb), world_size=int(r.world_size)),
                 cl.Versus(m, bw[0], higher_is_better=True)) for r, m in zip(rows[1:], bw[1:])]
    return out


def ranks_claim(pairs: list[tuple[dict, cl.Versus]]) -> cl.Claim:
    """Bus bandwidth with more ranks against the fewest, and what the verdicts mean."""
    verdicts = {f.verdict for _, f in pairs}
    because = ("Each link carries 2(n-1)/n of the data on a ring, which the bus-bandwidth convention divides out, so "
               "it should hold as ranks are added. " + (
                   "It holds within the noise here." if verdicts == {"within noise"} else
                   "Where it is lower, adding ranks costs more than that traffic explains (more hops of latency, "
                   "shared links, or, for CPU processes, shared cores)." if "lower" in verdicts else
                   "It rises here, which that traffic does not predict: at the fewest ranks the links are not the "
                   "bottleneck (gloo copies through host memory and TCP, and more processes overlap more of those "
                   "copies)." if verdicts == {"higher"} else "It holds or rises here."))
    return cl.Claim("Does the bus bandwidth hold as ranks are added?", [f for _, f in pairs] or [
        cl.Observed("world sizes", "one per backend: nothing to compare")], because=because if pairs else "")


def comparison_table(pairs: list[tuple[dict, cl.Versus]], subject: str, reference: str) -> pd.DataFrame:
    """Comparisons as a table: both medians, their ratio with its interval, the verdict."""
    return pd.DataFrame(cl.verdict_table(pairs)).rename(columns={"subject": subject, "against": reference})
