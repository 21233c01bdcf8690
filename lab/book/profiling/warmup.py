"""Notebook 01's warm-up study: the first and second timed steps of cold processes against the steady state
(every step after the most warm-up), as a claim under the one rule, with the explanation that holds on the
device that measured them; its table and plot."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from lab.book import claims as cl
from lab.measure.verdicts import robust_spread

GPU_FIRST_STEP = ("On a GPU the first step pays once per process for creating the CUDA context, loading the "
                  "kernels into it, creating the cuBLAS handle and choosing its algorithms for each new shape, and "
                  "growing the caching allocator's pool with cudaMalloc; none of that is the model's steady-state "
                  "cost, which is why benchmarks warm up first.")
CPU_FIRST_STEP = ("On a CPU there is no CUDA context, kernel loading or cuBLAS handle: a cold process pays instead "
                  "for one-time work such as first touches of freshly allocated memory (page faults), the math "
                  "libraries choosing kernels for each new shape, and starting the thread pool (likely causes; "
                  "this render does not measure them separately). The GPU causes (CUDA context, cuBLAS) show on "
                  "GPU renders only.")


def _ok(wu: pd.DataFrame) -> pd.DataFrame:
    """The timed steps of the runs that did not fail (a failed run is one row without a time)."""
    if "fwdbwd_ms" not in wu:
        return pd.DataFrame(columns=["warmup", "step", "fwdbwd_ms", "status"])
    return wu[(wu["status"] == "ok") & wu["fwdbwd_ms"].notna()]


def cold_start(wu: pd.DataFrame) -> tuple[cl.Versus, cl.Versus] | None:
    """The first and the second timed step of the processes without warm-up (one sample per process) against
    every step of the run after the largest warm-up count; None without both."""
    ok = _ok(wu)
    steady_w = int(ok["warmup"].max()) if len(ok) else 0
    steady = cl.Measured.of(f"the steady state after {steady_w} warm-up steps",
                            ok.loc[ok["warmup"] == steady_w, "fwdbwd_ms"])
    cold = ok[ok["warmup"] == 0]
    first, second = (cl.Measured.of(f"the {nth} timed step of a cold process", cold.loc[cold["step"] == i, "fwdbwd_ms"])
                     for i, nth in enumerate(("first", "second")))
    if steady_w == 0 or not first.ok or not steady.ok:
        return None
    return cl.Versus(first, steady), cl.Versus(second, steady)


def cold_start_claim(wu: pd.DataFrame, on: str) -> cl.Claim:
    """Is the first step slow beyond noise, and why (the cause that fits the device, claimed only then)?"""
    question = "Why is the first step slow?"
    found = cold_start(wu)
    if found is None:
        return cl.Claim(question, [cl.Observed("the warm-up study", "no cold first step and steady state to compare "
                                               "(a run failed, or no warm-up count above 0 ran)")])
    first = found[0].verdict
    because = (GPU_FIRST_STEP if on == "cuda" else CPU_FIRST_STEP) if first == "slower" else (
        "With too few cold processes for a verdict, no cause is claimed." if first == "not decided" else
        "This render shows no first-step cost beyond its noise, so it claims no cause for one.")
    return cl.Claim(question, [f for f in found if f.comparison is not None], because)


def warmup_summary(wu: pd.DataFrame) -> pd.DataFrame:
    """Per warm-up count: fresh processes, timed steps, their median, spread and largest time, and the median
    first timed step (ms)."""
    ok = _ok(wu)
    g = ok.groupby("warmup")["fwdbwd_ms"]
    out = pd.DataFrame({"processes": ok[ok["step"] == 0].groupby("warmup").size(), "steps": g.size(),
                        "median_ms": g.median(), "spread_ms": g.agg(robust_spread), "max_ms": g.max(),
                        "first_step_ms": ok[ok["step"] == 0].groupby("warmup")["fwdbwd_ms"].median()})
    return out.reset_index()


def plot_warmup(wu: pd.DataFrame, size: str):
    """Forward+backward time of each timed step after each warm-up count: every process as points, the
    median over processes as a line (log scale). Returns the figure."""
    ok = _ok(wu)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    counts = sorted(ok["warmup"].unique())
    for i, (w, g) in enumerate(ok.groupby("warmup")):
        color = plt.get_cmap("viridis")(i / max(len(counts) - 1, 1))
        ax.scatter(g["step"], g["fwdbwd_ms"], color=color, alpha=0.4, s=14)
        med = g.groupby("step")["fwdbwd_ms"].median()
        ax.plot(med.index, med.values, marker="o", color=color, label=str(w))
    ax.set(yscale="log", xlabel="timed step index", ylabel="forward+backward ms",
           title=f"{size}: timed steps after {', '.join(str(c) for c in counts)} warm-up steps (fresh processes)")
    if ax.lines:
        ax.legend(title="warm-up steps")
    return fig
