"""Notebook 01's warm-up study, presented: why the first steps are slow, from several cold processes
compared with the steady state (:func:`lab.measure.verdicts.compare`), with explanations that hold on the
device that measured them."""


from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd

from lab.book.precision.present import num
from lab.measure.verdicts import CONFIDENCE, Comparison, compare, span


@dataclass(frozen=True)
class ColdStart:
    """The first (and second) timed step of cold processes against the steady state (every step after the
    largest warm-up count): medians and verdicts (None where a side has no sample)."""

    first_ms: list[float]
    second_ms: list[float]
    steady_ms: list[float]
    steady_warmup: int
    first: Comparison | None
    second: Comparison | None


def _ok_steps(wu: pd.DataFrame) -> pd.DataFrame:
    """The timed steps of the warm-up study's runs that did not fail (a failed run is one row without a time)."""
    if "fwdbwd_ms" not in wu:
        return pd.DataFrame(columns=["warmup", "step", "fwdbwd_ms", "status"])
    return wu[(wu["status"] == "ok") & wu["fwdbwd_ms"].notna()]


def cold_start(wu: pd.DataFrame) -> ColdStart:
    """Compare the first steps of the processes that did no warm-up (step 0 of each ``warmup == 0`` run) with
    every step of the runs after the largest warm-up count, by :func:`lab.measure.verdicts.compare`."""
    ok = _ok_steps(wu)
    steady_w = int(ok["warmup"].max()) if len(ok) else 0
    steady = ok.loc[ok["warmup"] == steady_w, "fwdbwd_ms"].tolist() if steady_w > 0 else []
    first = ok.loc[(ok["warmup"] == 0) & (ok["step"] == 0), "fwdbwd_ms"].tolist()
    second = ok.loc[(ok["warmup"] == 0) & (ok["step"] == 1), "fwdbwd_ms"].tolist()
    return ColdStart(first, second, steady, steady_w, compare(first, steady) if first and steady else None,
                     compare(second, steady) if second and steady else None)


def warmup_summary(wu: pd.DataFrame) -> pd.DataFrame:
    """Per warm-up count: fresh processes, timed steps, median, mean, std and max of the forward+backward
    time, and the median first timed step (ms)."""
    ok = _ok_steps(wu)
    g = ok.groupby("warmup")
    out = g["fwdbwd_ms"].agg(["median", "mean", "std", "max"])
    out.insert(0, "steps", g.size())
    out.insert(0, "processes", ok[ok["step"] == 0].groupby("warmup").size())
    out["first_step"] = ok[ok["step"] == 0].groupby("warmup")["fwdbwd_ms"].median()
    return out.reset_index()


def plot_warmup(wu: pd.DataFrame, size: str):
    """Forward+backward time of each timed step after 0, 1, 2, 5 warm-up steps: every process as points, the
    median over processes as a line (log scale). Returns the figure."""
    ok = _ok_steps(wu)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = plt.get_cmap("viridis")
    counts = sorted(ok["warmup"].unique())
    for i, (w, g) in enumerate(ok.groupby("warmup")):
        color = colors(i / max(len(counts) - 1, 1))
        ax.scatter(g["step"], g["fwdbwd_ms"], color=color, alpha=0.4, s=14)
        med = g.groupby("step")["fwdbwd_ms"].median()
        ax.plot(med.index, med.values, marker="o", color=color, label=str(w))
    ax.set(yscale="log", xlabel="timed step index", ylabel="forward+backward ms",
           title=f"{size}: timed steps after {', '.join(str(c) for c in counts)} warm-up steps (fresh processes)")
    if ax.lines:
        ax.legend(title="warm-up steps")
    return fig


GPU_FIRST_STEP = ("On a GPU the first step pays once per process for creating the CUDA context, loading the "
                  "kernels into it, creating the cuBLAS handle and choosing its algorithms for each new shape, and "
                  "growing the caching allocator's pool with cudaMalloc; none of that is the model's steady-state "
                  "cost, which is why benchmarks warm up first.")
CPU_FIRST_STEP = ("On a CPU there is no CUDA context, kernel loading or cuBLAS handle: a cold process pays instead "
                  "for one-time work such as first touches of freshly allocated memory (page faults), the math "
                  "libraries choosing kernels for each new shape, and starting the thread pool (likely causes; "
                  "this render does not measure them separately). The GPU explanation (CUDA context, cuBLAS) is "
                  "for GPU renders.")


def _interval(c: Comparison) -> str:
    return (f"{CONFIDENCE:.0%} interval {span(c.low, c.high, num)}x" if math.isfinite(c.low)
            and math.isfinite(c.high) else "no spread measured")


def warmup_paragraph(wu: pd.DataFrame, on: str) -> str:
    """The warm-up study in prose: the first and second step against the steady state (verdicts), how one
    cold step distorts the mean and std, and the explanation that fits the measured device. Markdown."""
    cs = cold_start(wu)
    if cs.first is None:
        return ("The warm-up study has no cold first step and steady-state steps to compare (a run failed, or "
                "no warm-up count above 0 was run).")
    first, steady = statistics.median(cs.first_ms), statistics.median(cs.steady_ms)
    runs = f"median of {len(cs.first_ms)} cold processes" if len(cs.first_ms) > 1 else "one cold process"
    text = (f"Without warm-up the first timed step takes **{num(first)} ms** ({runs}), **{num(cs.first.ratio)}x** "
            f"the steady-state median of {num(steady)} ms after {cs.steady_warmup} warm-up steps: ")
    if len(cs.first_ms) < 2:
        text += "one sample has no spread, so no claim is made (run at least two cold processes). "
    elif cs.first.verdict == "slower":
        text += f"slower beyond noise ({_interval(cs.first)}). "
    elif cs.first.verdict == "faster":
        text += f"faster beyond noise ({_interval(cs.first)}). "
    else:
        text += f"within noise ({_interval(cs.first)}). "
    if cs.second is not None:
        word = {"slower": "still slower beyond noise", "faster": "faster beyond noise"}.get(cs.second.verdict,
                                                                                           "within noise of it")
        text += f"The second step takes {num(cs.second.ratio)}x the steady state: {word}. "
    summary = warmup_summary(wu).set_index("warmup")
    if 0 in summary.index and cs.steady_warmup in summary.index:
        cold, warm = summary.loc[0], summary.loc[cs.steady_warmup]
        text += (f"With no warm-up the timed steps average {num(cold['mean'])} ± {num(cold['std'])} ms, against "
                 f"{num(warm['mean'])} ± {num(warm['std'])} ms after {cs.steady_warmup}; medians "
                 f"{num(cold['median'])} and {num(warm['median'])} ms. ")
    if cs.first.verdict == "slower" and len(cs.first_ms) > 1:
        text += GPU_FIRST_STEP if on == "cuda" else CPU_FIRST_STEP
    elif len(cs.first_ms) < 2:
        text += "With one cold process this render cannot tell, so it claims no cause."
    else:
        text += "This render shows no first-step cost beyond its noise, so it claims no cause for one."
        if on == "cpu":
            text += (" On a GPU the first step also pays for CUDA context creation, kernel loading and cuBLAS "
                     "setup; a CPU render cannot show that.")
    return text


def warmup_answer(wu: pd.DataFrame, on: str) -> str:
    """One line: how slow the first step is, the verdict, and the cause that fits the device."""
    cs = cold_start(wu)
    if cs.first is None:
        return "Not measured."
    ratio = f"{num(cs.first.ratio)}x the steady state"
    if len(cs.first_ms) < 2:
        return f"Undecided: one cold process, no spread ({ratio})."
    if cs.first.verdict != "slower":
        return f"Here it is not, beyond noise ({ratio}, {_interval(cs.first)})."
    cause = ("one-time CUDA setup: context, kernel loading, cuBLAS handles and algorithm choice, allocator growth"
             if on == "cuda" else "one-time CPU-side setup (memory first touched, kernel selection, thread pool; "
             "not measured separately); CUDA setup costs appear on GPUs only")
    return f"It takes {ratio} (slower beyond noise, {_interval(cs.first)}): {cause}."


