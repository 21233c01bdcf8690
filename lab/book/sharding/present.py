"""Notebook 08's presentation: the sharding benchmark as tables, plots and claims (:mod:`lab.book.claims`).

The input is the ``sharding_benchmark`` table of :meth:`lab.book.sharding.bench.ShardingRun.measure`: per (size,
impl) the peaks by phase of several steady-state steps and the state bytes, measured in fresh processes, and the
step time of the interleaved rounds (median, and every round in order in ``step_samples_ms``). Times compare
round by round (paired); peaks compare step against step, and a memory verdict reads "lower" or "higher". On
the CPU there are no allocator peaks, and the claims say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pandas as pd

from lab.bench.interleaved import samples
from lab.bench.sharding import OPTIMIZER
from lab.book import claims as cl
from lab.book import ledger
from lab.book.plots import save_figure
from lab.measure.traces import existing_trace, overlap_summary, plot_timeline, read_trace
from lab.measure.verdicts import FASTER, HIGHER, LOWER, SLOWER

NAMES = {"ddp": "DDP", "sharded_optimizer": "sharded optimizer", "zero1": "ZeRO-1", "fsdp": "FSDP",
         "torch_zero": "torch ZeroRedundancyOptimizer", "torch_fsdp2": "FSDP2"}
#: The implementation each one is judged against (the performance goals of notebook 08).
REFERENCE = {"sharded_optimizer": "torch_zero", "zero1": "torch_zero", "fsdp": "torch_fsdp2"}
PEAKS = ["peak_init_gib", "peak_before_step_gib", "peak_after_step_gib"]
PARTS = ["parameters", "gradients", "optimizer state", "activations + transients"]
MEASURES = {"step_ms": "step time", "peak_after_step_gib": "peak after the step", "peak_gib": "overall peak"}


@dataclass(frozen=True)
class PeakVersus(cl.Versus):
    """:class:`lab.book.claims.Versus` of a memory peak: lower is better, and the verdict says "lower" or
    "higher" (not "faster" or "slower")."""

    @property
    def comparison(self):
        c = super().comparison
        return c if c is None else replace(c, verdict={FASTER: LOWER, SLOWER: HIGHER}.get(c.verdict, c.verdict))


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"]


def _get(df: pd.DataFrame, size: str, impl: str, ok: bool = True) -> pd.Series | None:
    rows = (_ok(df) if ok else df)
    rows = rows[(rows["size"] == size) & (rows["impl"] == impl)]
    return rows.iloc[0] if len(rows) else None


def sizes(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["size"]))


def has_peaks(df: pd.DataFrame) -> bool:
    """True when the table holds allocator peaks (measured on GPUs)."""
    return bool(_ok(df)["peak_after_step_gib"].notna().any()) if "peak_after_step_gib" in df else False


def measured(row: pd.Series, column: str = "step_ms") -> cl.Measured:
    """A row's step time (every round) or, for a ``*_gib`` column, its peak (every step; a table that kept no
    steps decides nothing), labelled; a row that did not run is out of memory (at the memory its ranks had) or
    failed (:meth:`lab.book.claims.Measured.from_row`)."""
    return cl.Measured.from_row(f"{NAMES[row['impl']]}'s {MEASURES[column]} ({row['size']})", row, column,
                                "ms" if column == "step_ms" else "GiB")


def failures(df: pd.DataFrame) -> list[cl.Observed]:
    """The rows that did not run: out of memory (at the memory the ranks had) or the failure's first line."""
    if (df["status"] == "ok").all():
        return [cl.Observed("every configuration", "ran to the end")]
    return [cl.Observed(f"{NAMES[r['impl']]} ({r['size']})", measured(r).text() if r["status"] == "oom" else
                        f"{r['status']}: {str(r['error']).splitlines()[0] if r['error'] else ''}")
            for _, r in df[df["status"] != "ok"].iterrows()]


def ledger_entries(df: pd.DataFrame) -> list[dict]:
    """The DDP rows (torch DDP, default buckets) as ``ddp_step`` entries of the ledger (notebook 07 times it too)."""
    return ledger.ddp_step_entries(df, "ddp", lambda r: f"torch DDP, {r['size']} {r['dtype']}", OPTIMIZER)


# ----------------------------------------------------------------------------------------------------------
# closed forms and traffic


def _value(label: str, value: float, unit: str = "") -> cl.Value:
    return cl.Value(cl.Measured.value(label, value, unit))


def state_findings(expected: pd.DataFrame) -> list:
    """For the largest size: DDP's state per rank and what sharding the optimizer state and FSDP leave."""
    e = expected.set_index(["size", "impl"])["total_gib"]
    size = expected["size"].iloc[-1]
    ddp = e[(size, "ddp")]
    out = [_value(f"parameters of {size}", expected.loc[expected["size"] == size, "params_M"].iloc[0] * 1e6),
           _value(f"DDP's state per rank ({size}, closed form)", ddp, "GiB")]
    for impl, what in (("zero1", "sharding the optimizer state"), ("fsdp", "FSDP")):
        out += [_value(f"{what}: state per rank", e[(size, impl)], "GiB"),
                cl.Share(f"{what}: saved against DDP", ddp - e[(size, impl)], ddp)]
    return out


def traffic_claim(closed: pd.DataFrame, traffic: pd.DataFrame) -> cl.Claim:
    """Bytes per rank per step of each scheme against DDP's: the closed form for the model, and the bytes the
    code issued in a step of the tiny model (which must equal the closed form where there is one)."""
    matched = traffic.dropna(subset=["expected_bytes"])
    ct, size = closed.set_index("impl"), closed["size"].iloc[0]
    counted = traffic.groupby("impl", sort=False)["measured_ratio_to_ddp"].first()
    findings = [cl.Observed("the collectives the code issued, against the closed form", "equal byte for byte" if (
        matched["measured_bytes"] == matched["expected_bytes"]).all() else "**not equal**")]
    for impl in ("ddp", "sharded_optimizer", "zero1"):
        findings.append(_value(f"{NAMES[impl]}: bytes per rank per step ({size}, closed form)",
                               ct.loc[impl, "total_bytes"], "B"))
        if impl != "ddp":
            findings.append(_value("against DDP's", ct.loc[impl, "ratio_to_ddp"], "x"))
    findings += [_value(f"{NAMES[impl]}: bytes against DDP's, counted in a step of the tiny model (fp32)",
                        counted.get(impl, math.nan), "x") for impl in ("sharded_optimizer", "zero1", "fsdp")]
    return cl.Claim("What does each scheme communicate?", findings)


# ----------------------------------------------------------------------------------------------------------
# memory


def benchmark_table(df: pd.DataFrame) -> pd.DataFrame:
    """What to read in the benchmark: per size and impl the median step over rounds with its spread and count,
    one more step's GPU times (some kernel running, and the collectives left out), the peaks by phase (medians
    over steps), the reduce dtype and the status; a column nobody measured is left out."""
    cols = ["size", "impl", "status", "step_ms", "step_spread_ms", "step_n", "step_gpu_ms", "step_compute_gpu_ms",
            *PEAKS, "reduce_dtype"]
    return df[[c for c in cols if c in df]].dropna(axis=1, how="all")


def memory_breakdown(df: pd.DataFrame) -> pd.DataFrame:
    """Long table of measured vs closed-form GiB per rank for parameters, gradients and optimizer state,
    plus the measured activations (and transient buffers) at the peak before the step."""
    rows = []
    for _, r in _ok(df).iterrows():
        for part, name in zip(("param", "grad", "optimizer_state", "activations"), PARTS):
            rows.append(dict(impl=r["impl"], size=r["size"], part=name, measured_gib=r[f"{part}_gib"],
                             expected_gib=r.get(f"expected_{part}_gib", math.nan)))
    out = pd.DataFrame(rows, columns=["impl", "size", "part", "measured_gib", "expected_gib"])
    return out.assign(ratio=out["measured_gib"] / out["expected_gib"])


def breakdown_claim(breakdown: pd.DataFrame) -> cl.Claim:
    """How close the state tensors' bytes are to the closed form, over every configuration that ran."""
    states = breakdown.dropna(subset=["expected_gib"])
    worst = (states["ratio"] - 1).abs().max() if len(states) else math.nan
    because = ("The closed form is 4 + 4 + 8 bytes per parameter, divided by the world size where sharded; a "
               "small excess is padding to a multiple of the world size and the size balance of the sharded "
               "optimizer." if worst < 0.01 else "More than padding: see the breakdown table.")
    return cl.Claim("Do the state tensors hold the bytes the closed form predicts?", [
        _value("configurations compared", states.groupby(["size", "impl"]).ngroups),
        _value("largest departure from the closed form", 100 * worst, "%")], because if len(states) else "")


def memory_claim(df: pd.DataFrame) -> cl.Claim:
    """Per size: DDP's state per rank, each implementation's against it, and on GPUs every overall peak."""
    findings = []
    for size in sizes(df):
        part = _ok(df)[_ok(df)["size"] == size].set_index("impl")
        state = part[["param_gib", "grad_gib", "optimizer_state_gib"]].sum(axis=1)
        if "ddp" in state:
            findings += [_value(f"DDP's state per rank ({size})", state["ddp"], "GiB")] + [
                _value(f"{NAMES[i]}'s against it", v / state["ddp"], "x") for i, v in state.items() if i != "ddp"]
        if has_peaks(df):
            findings += [cl.Value(measured(r, "peak_gib")) for _, r in df[df["size"] == size].iterrows()]
    because = "" if has_peaks(df) else ("No CUDA allocator statistics on the CPU: the peaks are not measured in "
                                        "this render, only the tensors' bytes.")
    return cl.Claim("How much memory does each scheme save per rank?", findings, because)


def peak_claim(df: pd.DataFrame) -> cl.Claim:
    """Per size on GPUs: the peak during the optimizer step of DDP and the optimizer-sharding schemes."""
    findings = [cl.Value(measured(r, "peak_after_step_gib")) for size in sizes(df)
                for impl in ("ddp", "sharded_optimizer", "zero1", "torch_zero")
                if (r := _get(df, size, impl, ok=False)) is not None] if has_peaks(df) else []
    return cl.Claim("How high does memory peak during the optimizer step?", findings,
                    "" if findings else "No CUDA allocator statistics on the CPU: the peaks are not measured here.")


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
    for part in PARTS:
        ax.bar(pivot["impl"] + " / " + pivot["size"], pivot[part], bottom=bottom, label=part)
        bottom = bottom + pivot[part]
    ax.set_ylabel("GiB per rank at the peak before the step")
    ax.tick_params(axis="x", rotation=40)
    ax.legend()
    return fig


def plot_step_times(df: pd.DataFrame):
    """Per size: every round's step time (points) and the median (bar) of each implementation."""
    import matplotlib.pyplot as plt
    import numpy as np

    ok = _ok(df)
    names = sizes(ok)
    fig, axes = plt.subplots(1, max(len(names), 1), figsize=(6.5 * max(len(names), 1), 3.8), squeeze=False)
    for ax, size in zip(axes[0], names):
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


# ----------------------------------------------------------------------------------------------------------
# time and goals


def time_comparisons(df: pd.DataFrame) -> list[tuple[dict, cl.Versus]]:
    """Per size and implementation: its step time against DDP's and against its reference (torch's
    ZeroRedundancyOptimizer for the sharded optimizer and ZeRO-1, FSDP2 for FSDP), paired by round."""
    out = []
    for size in sizes(_ok(df)):
        for _, r in _ok(df)[_ok(df)["size"] == size].iterrows():
            for ref in ("ddp", REFERENCE.get(r["impl"])):
                if ref not in (None, r["impl"]) and (b := _get(df, size, ref)) is not None:
                    out.append((dict(size=size, impl=r["impl"], reference=ref),
                                cl.Versus(measured(r), measured(b), paired=True)))
    return out


def time_claim(df: pd.DataFrame) -> cl.Claim:
    """Each implementation's step time against DDP's; where some reduce gradients in another dtype than DDP,
    which (their step times then differ in the bytes each reduction sends too)."""
    findings = [f for keys, f in time_comparisons(df) if keys["reference"] == "ddp"]
    ok = _ok(df)
    theirs = ok.loc[ok["impl"] == "ddp", "reduce_dtype"].dropna() if "reduce_dtype" in ok else pd.Series()
    other = ok[ok["reduce_dtype"] != theirs.iloc[0]] if len(theirs) else ok.iloc[:0]
    if len(other):
        by = {d: ", ".join(NAMES[i] for i in dict.fromkeys(g["impl"])) for d, g in other.groupby("reduce_dtype")}
        findings.append(cl.Observed("gradients reduced in", "; ".join([f"DDP {theirs.iloc[0]}", *(
            f"{names} {d}" for d, names in by.items())])))
    because = ("Not like for like in one respect: their step times against DDP also differ in the bytes each "
               "reduction sends.") if len(other) else ""
    return cl.Claim("What does sharding cost in step time?", findings, because)


def goal_comparisons(df: pd.DataFrame, fsdp_memory_factor: float = 1.1) -> list[tuple[dict, cl.Versus]]:
    """The goals of notebook 08 per size: the sharded optimizer and ZeRO-1 step no slower than
    ``torch_zero`` and (on GPUs) peak no higher after the step; FSDP steps no slower than FSDP2 and (on GPUs)
    peaks at most ``fsdp_memory_factor`` times as high. Times paired by round, peaks step against step."""
    checks = []
    for size in sizes(df):
        for impl in ("sharded_optimizer", "zero1"):
            checks += [(size, impl, "torch_zero", column, 1.0) for column in ("peak_after_step_gib", "step_ms")]
        checks += [(size, "fsdp", "torch_fsdp2", "step_ms", 1.0),
                   (size, "fsdp", "torch_fsdp2", "peak_gib", fsdp_memory_factor)]
    out = []
    for size, impl, ref, column, target in checks:
        a, b = _get(df, size, impl, ok=False), _get(df, size, ref, ok=False)
        if a is None or b is None or (column != "step_ms" and not has_peaks(df)):
            continue
        kind = cl.Versus if column == "step_ms" else PeakVersus
        out.append((dict(size=size, impl=impl, reference=ref, measure=MEASURES[column]),
                    kind(measured(a, column), measured(b, column), goal=target, paired=column == "step_ms")))
    return out


def goals_claim(goals: list[tuple[dict, cl.Versus]], has_gpu_peaks: bool = True) -> cl.Claim:
    """How many goals are met, missed and undecided, and the ones missed."""
    missed = [f for _, f in goals if f.goal_word == "missed"]
    because = "" if has_gpu_peaks else "The memory goals need the GPU's allocator peaks, which the CPU does not have."
    return cl.Claim("Are the performance goals met?", [cl.Tally("the goals", tuple(f for _, f in goals)), *missed],
                    because)


# ----------------------------------------------------------------------------------------------------------
# FSDP: its profiled step and its saving


def fsdp_overlap(df: pd.DataFrame, impl: str, results_dir: str | None = None) -> tuple[pd.DataFrame, cl.Claim]:
    """For every size with a profiled trace of ``impl`` here: draw the timeline (saved as
    ``sharding_timeline_<impl>_<size>.png``) and return the per-phase overlap table (one long table with a
    ``size`` column) and what kept the compute lane idle in the forward."""
    import matplotlib.pyplot as plt

    tables, findings, readings = [], [], []
    for _, r in _ok(df)[_ok(df)["impl"] == impl].iterrows():
        if "trace" not in r or (path := existing_trace(r["trace"])) is None:
            continue
        tl, size = read_trace(path), r["size"]
        fig, ax = plt.subplots(figsize=(12, 3.4))
        plot_timeline(tl, title=f"{impl}, {size}: one training step on rank 0", ax=ax)
        if results_dir is not None:
            save_figure(fig, f"sharding_timeline_{impl}_{size}", results_dir)
        summary = overlap_summary(tl)
        tables.append(summary.assign(size=size))
        f, step = summary.set_index("phase").loc["forward"], summary.set_index("phase")["window_ms"].get("step")
        idle, exposed = f["compute_idle_ms"], f["exposed_communication_ms"]
        findings += [_value(f"the profiled forward ({size})", f["window_ms"], "ms"),
                     cl.Share("the compute lane idle in it", idle, f["window_ms"]),
                     cl.Share("its communication beside compute", f["overlapped_ms"], f["communication_ms"]),
                     _value("exposed communication", exposed, "ms"),
                     cl.Share("its share of the idle time", exposed, idle),
                     _value("the profiled step", step, "ms"), cl.Value(measured(r))]
        readings.append(f"In the {size} forward, " + (
            "the compute lane has no gaps to speak of: the all-gathers arrived before the layers needed them."
            if idle <= 0.1 * f["window_ms"] else
            "most of the idle time is exposed communication: the gathers are on the critical path at this size."
            if exposed >= 0.5 * idle else
            "most of the gap is time with neither compute nor communication on the device, which is what a host "
            "that launches work slower than the device runs it looks like (a host-bound step at this batch "
            "size); the gathers that were exposed cost the rest.") + (
            " The profiler adds host work of its own: the profiled step is longer than the timed one."
            if step > r["step_ms"] else ""))
    because = " ".join(readings)
    claim = cl.Claim("Do FSDP's all-gathers finish before the forward needs them?", findings, because or (
        f"No profiler trace of {impl} is on this machine (traces are regenerated by measuring, not by replaying)."))
    return (pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()), claim


def saving_claim(df: pd.DataFrame) -> cl.Claim:
    """Per size: FSDP's state saving over DDP from the closed form and from the state tensors, and on GPUs the
    saving of the overall peak (medians over steps)."""
    findings = []
    for size in sizes(df):
        d, f = _get(df, size, "ddp"), _get(df, size, "fsdp")
        if d is None or f is None:
            continue
        state = [sum(r[f"{kind}{part}_gib"] for part in ("param", "grad", "optimizer_state"))
                 for kind in ("expected_", "") for r in (d, f)]
        findings += [_value(f"FSDP's state saving over DDP per rank ({size}, closed form)", state[0] - state[1], "GiB"),
                     _value("measured in the state tensors", state[2] - state[3], "GiB")]
        if has_peaks(df):
            findings.append(_value("its overall peak's saving", d["peak_gib"] - f["peak_gib"], "GiB"))
    because = ("The peak also moves with activations and transient buffers: autocast's weight copies in DDP, "
               "gathered weights in FSDP." if has_peaks(df) else "The peak is not measured on the CPU.")
    return cl.Claim("What does FSDP save, expected against measured?", findings, because if findings else "")
