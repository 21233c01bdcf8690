"""Notebook 08's presentation: the sharding benchmark as tables, plots and sentences generated from it.

The input is the ``sharding_benchmark`` table of :meth:`lab.book.sharding.bench.ShardingRun.measure`: per (size,
impl) the peaks by phase and the state bytes, measured in fresh processes, and the step time of the
interleaved rounds (median, and every round in ``step_samples_ms``). Time comparisons and time goals are
verdicts of :mod:`lab.measure.verdicts` on the per-round samples, paired by round
(:func:`lab.bench.interleaved.compare_rounds`). Memory is compared directly: the
allocator's peaks and the tensors' bytes repeat to the byte from run to run, so
they have no noise to judge against; on the CPU there are no allocator peaks at all, and the sentences say
so.
"""

from __future__ import annotations

import math

import pandas as pd

from lab.bench.interleaved import compare_rounds, goal_rounds, samples
from lab.book.plots import save_figure
from lab.book.report import pct
from lab.book.sharding.bench import REFERENCE
from lab.measure.traces import existing_trace, overlap_summary, plot_timeline, read_trace
from lab.measure.verdicts import CONFIDENCE, Comparison

PEAKS = ["peak_init_gib", "peak_before_step_gib", "peak_after_step_gib"]
PARTS = ["parameters", "gradients", "optimizer state", "activations + transients"]


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"]


def _get(df: pd.DataFrame, size: str, impl: str) -> pd.Series | None:
    ok = _ok(df)
    rows = ok[(ok["size"] == size) & (ok["impl"] == impl)]
    return rows.iloc[0] if len(rows) else None


def gib(x: float) -> str:
    """``"19.0 GiB"``, or ``"n/a (no GPU)"`` for a peak the CPU cannot measure."""
    return "n/a (no GPU)" if x is None or pd.isna(x) else f"{x:.3g} GiB"


def has_peaks(df: pd.DataFrame) -> bool:
    """True when the table holds allocator peaks (measured on GPUs)."""
    return bool(_ok(df)["peak_after_step_gib"].notna().any()) if "peak_after_step_gib" in df else False


# ----------------------------------------------------------------------------------------------------------
# closed forms


def state_sentence(expected: pd.DataFrame, world_size: int) -> str:
    """What the closed form says for the largest size: DDP's state per rank and what ZeRO-1 and FSDP leave."""
    e = expected.set_index(["size", "impl"])
    size = expected["size"].iloc[-1]
    ddp, zero1, fsdp = (e.loc[(size, i), "total_gib"] for i in ("ddp", "zero1", "fsdp"))
    return (f"For the {size} model ({e.loc[(size, 'ddp'), 'params_M']:.4g} M parameters) on {world_size} ranks, DDP "
            f"holds {ddp:.3g} GiB of state per rank; sharding the optimizer state cuts that to {zero1:.3g} GiB "
            f"({1 - zero1 / ddp:.0%} less) and FSDP to {fsdp:.3g} GiB ({1 - fsdp / ddp:.0%} less), before "
            "activations.")


def _times(ratio: float) -> str:
    """``"1.50x"``, or ``"n/a"`` for a schedule whose traffic run failed (NaN)."""
    return f"{ratio:.2f}x" if ratio == ratio else "n/a"


def traffic_sentences(closed: pd.DataFrame, traffic: pd.DataFrame) -> str:
    """Whether the collectives the code issued match the closed form, and what each schedule sends."""
    matches = traffic.dropna(subset=["expected_bytes"])
    agree = bool((matches["measured_bytes"] == matches["expected_bytes"]).all())
    ct = closed.set_index("impl")
    tt = traffic.groupby("impl")["measured_ratio_to_ddp"].first()
    size = closed["size"].iloc[0]
    return (f"The recorded collectives {'match' if agree else '**do not match**'} the closed form for DDP, the sharded "
            f"optimizer and ZeRO-1 byte for byte. Per step on the {size} model, DDP sends "
            f"{ct.loc['ddp', 'total_gib']:.3g} GiB per rank. The simple sharded optimizer adds a broadcast of every "
            f"parameter: {ct.loc['sharded_optimizer', 'total_gib']:.3g} GiB "
            f"({ct.loc['sharded_optimizer', 'ratio_to_ddp']:.2f}x DDP). ZeRO-1 replaces the all-reduce by a "
            f"reduce-scatter and an all-gather and sends {ct.loc['zero1', 'total_gib']:.3g} GiB "
            f"({ct.loc['zero1', 'ratio_to_ddp']:.2f}x). Measured on the tiny model: {_times(tt['sharded_optimizer'])} "
            f"and {_times(tt['zero1'])} DDP; FSDP (fp32, parameters gathered in forward and again in backward) "
            f"{_times(tt['fsdp'])}.")


def traffic_answer(closed: pd.DataFrame, traffic: pd.DataFrame) -> str:
    """The answers-box line: bytes per rank per step relative to DDP, closed form and measured."""
    ct = closed.set_index("impl")["ratio_to_ddp"]
    tt = traffic.groupby("impl")["measured_ratio_to_ddp"].first()
    return (f"relative to DDP's all-reduce: sharded optimizer {ct['sharded_optimizer']:.2f}x, ZeRO-1 "
            f"{ct['zero1']:.2f}x (closed form, matched by the recorded collectives), FSDP {_times(tt['fsdp'])} "
            "(measured, fp32).")


def difference_sentence(closed: pd.DataFrame, world_size: int) -> str:
    """How the simple sharded optimizer differs from ZeRO stage 1, with the traffic ratios of the table."""
    ct = closed.set_index("impl")["ratio_to_ddp"]
    return (
        "How the simple sharded optimizer differs from ZeRO stage 1: both keep the optimizer state of "
        f"1/{world_size} of the parameters per rank, but the sharded optimizer keeps DDP's all-reduce and then "
        f"broadcasts every parameter from its owner, {ct['sharded_optimizer']:.2f}x DDP's traffic, while ZeRO-1 "
        "reduce-scatters the gradients into the slice each rank updates and all-gathers the result, "
        f"{ct['zero1']:.2f}x. ZeRO-1 needs no DDP wrapper: its gradients live in bucketed flat buffers, and each "
        "bucket's reduce-scatter starts during backward as soon as the bucket's gradients exist (as DDP's bucketed "
        "all-reduce does). Both then update chunk by chunk and launch each chunk's broadcast (sharded optimizer) "
        "or all-gather (ZeRO-1) while the next chunk is being updated, which also keeps a foreach AdamW's "
        "temporaries to one chunk instead of the whole share; torch's ZeroRedundancyOptimizer steps its whole "
        "share first and broadcasts after.")


# ----------------------------------------------------------------------------------------------------------
# the benchmark


def benchmark_table(df: pd.DataFrame) -> pd.DataFrame:
    """What to read in the benchmark: per size and impl the median step over rounds and its spread, the
    peaks by phase, the reduce dtype and the status."""
    cols = ["size", "impl", "status", "step_ms", "step_iqr_ms", "rounds", *PEAKS, "reduce_dtype"]
    return df[[c for c in cols if c in df]]


def failures(df: pd.DataFrame) -> str:
    """The rows that did not run (out of memory, or an error) as a Markdown table with their messages, or a
    sentence saying that every configuration ran."""
    failed = df.loc[df["status"] != "ok", ["size", "impl", "status", "error"]]
    return "Every configuration ran." if failed.empty else failed.to_markdown(index=False)


def plot_step_times(df: pd.DataFrame):
    """Per size: every round's step time (points) and the median (bar) of each implementation."""
    import matplotlib.pyplot as plt
    import numpy as np

    ok = _ok(df)
    sizes = list(dict.fromkeys(ok["size"]))
    fig, axes = plt.subplots(1, max(len(sizes), 1), figsize=(6.5 * max(len(sizes), 1), 3.8), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        part = ok[ok["size"] == size]
        x = np.arange(len(part))
        ax.bar(x, part["step_ms"], color="tab:blue", alpha=0.35, label="median over rounds")
        for xi, s in zip(x, part["step_samples_ms"]):
            ys = samples(s)
            ax.plot(np.full(len(ys), xi), ys, "k.", ms=3, alpha=0.6)
        ax.set_xticks(x, part["impl"], rotation=30, ha="right")
        ax.set(title=size, ylabel="step time (ms; dots: one per round)")
    fig.tight_layout()
    return fig


def plot_peaks(df: pd.DataFrame, results_dir: str | None = None):
    """Peak memory per rank by phase (init, before the step, after it) per implementation and size; saved as
    ``<results_dir>/figures/sharding_peak_memory.png`` when given. None without allocator peaks."""
    import seaborn as sns

    if not has_peaks(df):
        return None
    long = _ok(df).melt(id_vars=["impl", "size"], value_vars=PEAKS, var_name="phase", value_name="gib")
    long["phase"] = long["phase"].str.replace("peak_", "").str.replace("_gib", "")
    g = sns.catplot(long, x="impl", y="gib", hue="phase", col="size", kind="bar", height=3.8, aspect=1.5,
                    errorbar=None)
    g.set_xticklabels(rotation=30)
    g.set_axis_labels("", "peak memory per rank (GiB)")
    if results_dir is not None:
        save_figure(g.figure, "sharding_peak_memory", results_dir)
    return g


def peaks_sentence(df: pd.DataFrame) -> str:
    """A sentence when there are no peaks to draw (the CPU, or nothing ran); empty otherwise."""
    if has_peaks(df):
        return ""
    if _ok(df).empty:
        return "No configuration ran to the end (see the status and error columns above): there are no peaks to draw."
    return ("No CUDA allocator statistics on the CPU: the peak columns stay empty in this render, and only the "
            "tensors' bytes below are measured.")


def breakdown_sentence(breakdown: pd.DataFrame, world_size: int) -> str:
    """How close the state tensors' bytes are to the closed form, over every configuration that ran."""
    states = breakdown[breakdown["part"] != "activations + transients"]
    if states.empty:
        return "No configuration ran."
    worst = (states["ratio"] - 1).abs().max()
    n = states.groupby(["size", "impl"]).ngroups
    return (f"Across {n} configurations the measured parameter, gradient and optimizer-state bytes are within "
            f"{worst:.2%} of the closed form (4 + 4 + 8 bytes per parameter, divided by {world_size} where "
            "sharded); the small excess is padding to a multiple of the world size and the size balance of the "
            "sharded optimizer.")


def plot_breakdown(breakdown: pd.DataFrame):
    """Stacked bars of parameters, gradients, optimizer state and activations at the peak before the step; None
    without allocator peaks (the activations are the peak minus the rest)."""
    import matplotlib.pyplot as plt

    pivot = breakdown.pivot_table(index=["size", "impl"], columns="part", values="measured_gib", sort=False)
    if "activations + transients" not in pivot or pivot["activations + transients"].isna().all():
        return None
    pivot = pivot.reset_index()
    fig, ax = plt.subplots(figsize=(11, 4))
    bottom = 0
    labels = pivot["impl"] + " / " + pivot["size"]
    for part in PARTS:
        ax.bar(labels, pivot[part], bottom=bottom, label=part)
        bottom = bottom + pivot[part]
    ax.set_ylabel("GiB per rank at the peak before the step")
    ax.tick_params(axis="x", rotation=40)
    ax.legend()
    return fig


def memory_answer(df: pd.DataFrame) -> str:
    """The answers-box line: per size, the state bytes per rank (and the overall peak on GPUs) of each
    implementation next to DDP's."""
    parts = []
    for size, part in _ok(df).groupby("size", sort=False):
        state = part.set_index("impl")[["param_gib", "grad_gib", "optimizer_state_gib"]].sum(axis=1)
        if "ddp" not in state:
            continue
        bits = ", ".join(f"{impl} {v / state['ddp']:.2f}x" for impl, v in state.items() if impl != "ddp")
        peak = part.set_index("impl")["peak_gib"]
        peaks = "" if peak.isna().all() else "; overall peak " + ", ".join(f"{i} {gib(v)}" for i, v in peak.items())
        parts.append(f"{size}: state per rank relative to DDP's {state['ddp']:.3g} GiB: {bits}{peaks}")
    return "; ".join(parts) + "." if parts else "nothing ran."


# ----------------------------------------------------------------------------------------------------------
# time, from the interleaved rounds


def time_comparisons(df: pd.DataFrame) -> pd.DataFrame:
    """Per size and implementation: its median step against DDP's and against its reference (torch's
    ZeroRedundancyOptimizer for the sharded optimizer and ZeRO-1, FSDP2 for FSDP), as ratio, 95 % interval
    and verdict on the per-round samples."""
    rows = []
    ok = _ok(df)
    for size in dict.fromkeys(ok["size"]):
        for impl in ok.loc[ok["size"] == size, "impl"]:
            r = _get(df, size, impl)
            for ref_impl in ("ddp", REFERENCE.get(impl)):
                ref = _get(df, size, ref_impl) if ref_impl else None
                if ref_impl is None or ref_impl == impl or ref is None:
                    continue
                c = compare_rounds(samples(r["step_samples_ms"]), samples(ref["step_samples_ms"]))
                rows.append(dict(size=size, impl=impl, reference=ref_impl, step_ms=r["step_ms"],
                                 reference_ms=ref["step_ms"], ratio=c.ratio, low=c.low, high=c.high,
                                 verdict=c.verdict))
    return pd.DataFrame(rows, columns=["size", "impl", "reference", "step_ms", "reference_ms", "ratio", "low", "high",
                                       "verdict"])


def time_sentences(comparisons: pd.DataFrame) -> str:
    """Per size, one clause per comparison, worded by its verdict."""
    lines = []
    for size, part in comparisons.groupby("size", sort=False):
        clauses = [Comparison(r.ratio, r.low, r.high, r.verdict).describe(r.impl, r.reference)
                   for r in part.itertuples()]
        lines.append(f"**{size}:** " + "; ".join(clauses) + ".")
    return "\n\n".join(lines) or "Nothing to compare."


def time_answer(comparisons: pd.DataFrame) -> str:
    """The answers-box line: each implementation's verdict against DDP."""
    vs = comparisons[comparisons["reference"] == "ddp"]
    if vs.empty:
        return "not measured."
    per_size = [f"{size}: " + ", ".join(f"{r.impl} {r.verdict} (ratio {r.ratio:.3g})" for r in part.itertuples())
                for size, part in vs.groupby("size", sort=False)]
    return "; ".join(per_size) + " (against DDP; ratio: the median per-round time ratio)."


def memory_sentences(df: pd.DataFrame) -> str:
    """Per size, each implementation's peak during the optimizer step (and FSDP's overall peak)."""
    lines = []
    for size in dict.fromkeys(df["size"]):
        def peak(impl, col="peak_after_step_gib"):
            r = _get(df, size, impl)
            if r is None:
                rows = df[(df["size"] == size) & (df["impl"] == impl)]
                return f"n/a ({rows['status'].iloc[0]})" if len(rows) else "n/a (not run)"
            return gib(r[col])

        lines.append(f"**{size}**, peak during the optimizer step: DDP {peak('ddp')}, sharded optimizer "
                     f"{peak('sharded_optimizer')}, ZeRO-1 {peak('zero1')}, torch's ZeroRedundancyOptimizer "
                     f"{peak('torch_zero')}; overall peak of FSDP {peak('fsdp', 'peak_gib')} and FSDP2 "
                     f"{peak('torch_fsdp2', 'peak_gib')}.")
    return "\n\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# the performance goals


def goals(df: pd.DataFrame, fsdp_memory_factor: float = 1.1) -> pd.DataFrame:
    """The goals of notebook 08 per size: the sharded optimizer and ZeRO-1 use no more memory after the step
    than ``torch_zero`` and step no slower; FSDP steps no slower than FSDP2 with at most
    ``fsdp_memory_factor`` times its peak memory. Step-time goals are :func:`lab.measure.verdicts.check_goal`
    on the per-round samples, paired by round (met, missed, or undecided within noise); memory goals compare the peaks
    directly (deterministic), "not measured" without peaks (the CPU) or a missing row. Columns size, goal,
    impl, reference_impl, value, reference, ratio, low, high, result."""
    rows = []

    def add(size, goal, impl, ref_impl, column, target, kind):
        r, ref = _get(df, size, impl), _get(df, size, ref_impl)
        row = dict(size=size, goal=goal, impl=impl, reference_impl=ref_impl, value=math.nan, reference=math.nan,
                   ratio=math.nan, low=math.nan, high=math.nan, result="not measured")
        if r is not None and ref is not None:
            row.update(value=r[column], reference=ref[column])
            if kind == "time":
                g = goal_rounds(samples(r["step_samples_ms"]), samples(ref["step_samples_ms"]), target)
                row.update(ratio=g.comparison.ratio, low=g.comparison.low, high=g.comparison.high, result=g.word)
            elif not (pd.isna(r[column]) or pd.isna(ref[column])):
                ratio = r[column] / ref[column]
                row.update(ratio=ratio, result="met" if ratio <= target else "missed")
        rows.append(row)

    for size in dict.fromkeys(df["size"]):
        for impl in ("sharded_optimizer", "zero1"):
            add(size, "peak after step <= torch_zero", impl, "torch_zero", "peak_after_step_gib", 1.0, "memory")
            add(size, "step time <= torch_zero", impl, "torch_zero", "step_ms", 1.0, "time")
        add(size, "step time <= torch_fsdp2", "fsdp", "torch_fsdp2", "step_ms", 1.0, "time")
        add(size, f"peak memory <= {fsdp_memory_factor:g} x torch_fsdp2", "fsdp", "torch_fsdp2", "peak_gib",
            fsdp_memory_factor, "memory")
    return pd.DataFrame(rows)


def goals_answer(goal_table: pd.DataFrame) -> str:
    """The answers-box line: how many goals are met, missed and undecided, and which are not met."""
    counts = goal_table["result"].value_counts()
    head = ", ".join(f"{counts[k]} {k}" for k in ("met", "missed", "undecided (within noise)", "not measured")
                     if k in counts)
    missed = goal_table[goal_table["result"] == "missed"]
    tail = "" if missed.empty else "; missed: " + "; ".join(
        f"{r.impl} {r.goal} on {r.size} (ratio {r.ratio:.3g}"
        + (f", {CONFIDENCE:.0%} interval {r.low:.3g}-{r.high:.3g})" if math.isfinite(r.low) else ")")
        for r in missed.itertuples())
    return f"of {len(goal_table)} checks: {head}{tail}."


# ----------------------------------------------------------------------------------------------------------
# FSDP's timeline


def profiled_timelines(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """``{size: timeline}`` of the profiled implementation's traces that exist on this machine."""
    out = {}
    if "trace" not in df:
        return out
    for r in _ok(df).itertuples():
        path = existing_trace(r.trace)
        if path is not None:
            out[r.size] = read_trace(path)
    return out


def plot_profiled_timeline(timeline: pd.DataFrame, size: str, impl: str, results_dir: str | None = None):
    """One profiled training step on rank 0 (saved as ``sharding_timeline_<impl>_<size>.png`` when
    ``results_dir`` is given)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 3.4))
    plot_timeline(timeline, title=f"{impl}, {size}: one training step on rank 0", ax=ax)
    if results_dir is not None:
        save_figure(fig, f"sharding_timeline_{impl}_{size}", results_dir)
    return fig


def forward_sentence(summary: pd.DataFrame, size: str, timed_step_ms: float | None = None) -> str:
    """What kept the compute lane idle in the profiled step's forward: late all-gathers, or the host not
    launching kernels fast enough. Numbers of one profiled step (no spread), so the wording says "in the
    profiled step"."""
    s = summary.set_index("phase")
    if "forward" not in s.index:
        return f"{size}: the profiled step has no forward range."
    f = s.loc["forward"]
    idle, exposed, window = f["compute_idle_ms"], f["exposed_communication_ms"], f["window_ms"]
    text = (f"{size}, in the profiled step: the forward ({window:.3g} ms) kept the compute lane busy "
            f"{f['compute_ms']:.3g} ms and idle {idle:.3g} ms ({idle / window:.0%}); "
            f"{pct(f['overlap_share'])} of its {f['communication_ms']:.3g} ms of communication ran beside compute, "
            f"{exposed:.3g} ms did not. ")
    text += forward_reading(f)
    step = s["window_ms"].get("step")
    if timed_step_ms is not None and step is not None and math.isfinite(timed_step_ms):
        text += (f" The profiler adds host work of its own: this profiled step took {step:.3g} ms, the median "
                 f"timed step {timed_step_ms:.3g} ms.")
    return text


def forward_reading(forward: pd.Series) -> str:
    """The reading of a forward's row of :func:`lab.measure.traces.overlap_summary`: no gaps (the gathers
    arrive in time), gaps that are mostly exposed communication (the gathers are late), or gaps that are
    mostly the host (the gathers arrive in time; the host does not launch work fast enough)."""
    idle, exposed, window = forward["compute_idle_ms"], forward["exposed_communication_ms"], forward["window_ms"]
    if idle <= 0.1 * window:
        return "The compute lane has no gaps to speak of: the all-gathers arrived before the layers needed them."
    if exposed >= 0.5 * idle:
        return "Most of the idle time is exposed communication: the gathers are on the critical path at this size."
    return (f"Exposed communication accounts for only {exposed / idle:.0%} of the compute lane's idle time: most "
            "of the gap is time with neither compute nor communication on the device, which is what a host that "
            "launches work slower than the device runs it looks like (a host-bound step at this batch size); the "
            "gathers that were exposed cost the rest.")


def forward_answer(overlap: pd.DataFrame) -> str:
    """The answers-box line: per size, the reading of the profiled forward (or why there is none)."""
    if overlap.empty:
        return "no profiled trace here to tell."
    fwd = overlap[overlap["phase"] == "forward"]
    def lower(text):
        return text[0].lower() + text[1:]

    return " ".join(f"{r['size']} (one profiled step): {lower(forward_reading(r))}" for _, r in fwd.iterrows())


def fsdp_overlap(df: pd.DataFrame, impl: str, results_dir: str | None = None) -> tuple[pd.DataFrame, str]:
    """For every size with a profiled trace of ``impl`` here: draw the timeline, and return the per-phase
    overlap tables (one long table with a ``size`` column) and the sentences."""
    tables, lines = [], []
    for size, tl in profiled_timelines(df[df["impl"] == impl]).items():
        plot_profiled_timeline(tl, size, impl, results_dir)
        summary = overlap_summary(tl)
        tables.append(summary.assign(size=size))
        r = _get(df, size, impl)
        lines.append(forward_sentence(summary, size, r["step_ms"] if r is not None else None))
    if not tables:
        return pd.DataFrame(), (f"No profiler trace of {impl} is on this machine (traces are regenerated by "
                                "measuring, not by replaying).")
    return pd.concat(tables, ignore_index=True), "\n\n".join(lines)


def fsdp_saving(df: pd.DataFrame, expected: pd.DataFrame) -> pd.DataFrame:
    """Per size: FSDP's state saving over DDP from the closed form and from the state tensors, and the
    saving of the overall peak (NaN without peaks)."""
    e = expected.set_index(["size", "impl"])["total_gib"]
    rows = []
    for size in dict.fromkeys(df["size"]):
        d, f = _get(df, size, "ddp"), _get(df, size, "fsdp")
        if d is None or f is None:
            continue
        state = [r["param_gib"] + r["grad_gib"] + r["optimizer_state_gib"] for r in (d, f)]
        rows.append(dict(size=size, expected_saving_gib=e[(size, "ddp")] - e[(size, "fsdp")],
                         measured_state_saving_gib=state[0] - state[1],
                         measured_peak_saving_gib=d["peak_gib"] - f["peak_gib"]))
    return pd.DataFrame(rows, columns=["size", "expected_saving_gib", "measured_state_saving_gib",
                                       "measured_peak_saving_gib"])


def fsdp_saving_sentences(saving: pd.DataFrame) -> str:
    """Per size: the closed-form saving, the measured state saving, and the peak's (or why it is missing)."""
    lines = []
    for r in saving.itertuples():
        peak = ("the peak is not measured on the CPU" if pd.isna(r.measured_peak_saving_gib) else
                f"the peak is {r.measured_peak_saving_gib:.3g} GiB lower (the peak also moves with activations and "
                "transient buffers: autocast's weight copies in DDP, gathered weights in FSDP)")
        lines.append(f"{r.size}: the closed form says FSDP saves {r.expected_saving_gib:.3g} GiB of state per rank "
                     f"over DDP; the state tensors measure {r.measured_state_saving_gib:.3g} GiB less, and {peak}.")
    return "\n\n".join(lines) or "DDP or FSDP did not run."
