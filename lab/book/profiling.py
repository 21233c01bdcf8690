"""What notebook 01 (profiling) shows: its settings, its tables and plots, and the prose and answers generated
from its result tables.

The notebook measures four things and saves each through :class:`lab.book.report.Chapter` (so it can be
replayed): the ``lm_step`` sweep with its every timed sample (``01_lm_samples``), the warm-up study
(``01_warmup``), and the kernel profiles (``01_kernels``, ``01_profile_steps``, ``01_attention_ranges``,
taken by :class:`KernelProfiles`). Each function here takes those tables and returns a table, a figure or
a string. Comparisons (backward against forward, bf16 against fp32, the first step against the steady
state) use :func:`lab.measure.verdicts.compare` on the samples: the ratio of medians with a bootstrap
interval, so one noisy sample cannot flip a claim, and "within noise" where the interval contains 1.
Explanations that hold on a GPU only (CUDA context, cuBLAS, memory-bound kernels) are given only when the
data was measured on a GPU; a CPU render says what does not carry over.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

from lab.book import report
from lab.book.precision import (
    SHARED_CPU_NOTE,
    counts_phrase,
    measured_on,  # noqa: F401 - notebook 01 calls profiling.measured_on
    num,
    speedup_clause,
    verdict_counts,
)
from lab.measure import profiling as prof_tables
from lab.measure.device import resolve_device
from lab.measure.step import MODES
from lab.measure.verdicts import CONFIDENCE, Comparison, compare

# ----------------------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class ProfilingSettings:
    """Every knob of notebook 01, resolved for the quick (CPU) or the full (GPU) profile."""

    quick: bool
    device: str
    sizes: tuple[str, ...]
    contexts: tuple[int, ...]
    default_context: int
    dtypes: tuple[str, ...]
    batch: int
    warmup: int
    steps: int
    warmup_size: str
    warmups: tuple[int, ...]
    cold_runs: int
    profile_size: str
    profile_context: int
    profile_steps: int

    def modes_for(self, size: str, context: int) -> tuple[str, ...]:
        """The modes the sweep times at ``context``: forward and forward+backward everywhere, the full train
        step at the default context only (a callable for :func:`lab.bench.lm.sweep_lm`'s ``modes``)."""
        return MODES if context == self.default_context else ("forward", "forward_backward")

    @property
    def warmup_runs(self) -> tuple[int, ...]:
        """Warm-up counts for :func:`lab.bench.lm.warmup_study`, one fresh process each: extra cold (0)
        processes first, so that the first step has ``cold_runs`` samples, then every count once."""
        return (0,) * max(self.cold_runs - self.warmups.count(0), 0) + self.warmups

    def params(self) -> dict:
        """The settings as the notebook's parameters (for the banner and the results' sidecars)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


QUICK = dict(sizes=("tiny", "mini"), contexts=(32, 64), default_context=64, warmup=1, steps=7, warmup_size="tiny",
             cold_runs=2, profile_size="mini", profile_context=64)
# 7 or more timed steps: with 5, one wild sample lands in over 2.5% of the bootstrap's resampled medians and can
# widen a verdict's interval to "within noise" on its own; with 7 it does so in 1%.
FULL = dict(contexts=(128, 256, 512, 1024), default_context=512, warmup=3, steps=8, warmup_size="large",
            cold_runs=3, profile_size="2.7B", profile_context=512)


def settings(quick: bool = True, device: str = "auto", sizes: Sequence[str] | None = None,
             contexts: Sequence[int] | None = None, default_context: int | None = None,
             dtypes: Sequence[str] = ("fp32", "bf16"), batch: int = 4, warmup: int | None = None,
             steps: int | None = None, warmup_size: str | None = None, warmups: Sequence[int] = (0, 1, 2, 5),
             cold_runs: int | None = None, profile_size: str | None = None, profile_context: int | None = None,
             profile_steps: int = 3) -> ProfilingSettings:
    """Notebook 01's settings: a knob left ``None`` takes the quick profile's value (``tiny``/``mini`` at
    contexts 32 and 64 on the CPU) or the full profile's (every spec size at 128-1024, the train step at 512).
    The default context must be one of the contexts (the train step is timed there)."""
    from lab.model import MODEL_SIZES

    defaults = QUICK if quick else {**FULL, "sizes": tuple(MODEL_SIZES)}
    given = dict(sizes=sizes, contexts=contexts, default_context=default_context, warmup=warmup, steps=steps,
                 warmup_size=warmup_size, cold_runs=cold_runs, profile_size=profile_size,
                 profile_context=profile_context)
    knobs = {k: defaults[k] if v is None else v for k, v in given.items()}
    knobs["sizes"], knobs["contexts"] = tuple(knobs["sizes"]), tuple(int(c) for c in knobs["contexts"])
    if knobs["default_context"] not in knobs["contexts"]:
        raise ValueError(f"default_context={knobs['default_context']} is not one of contexts={knobs['contexts']}: "
                         "the train step is timed at the default context")
    return ProfilingSettings(quick=quick, device=str(resolve_device(device)), dtypes=tuple(dtypes), batch=batch,
                             warmups=tuple(warmups), profile_steps=profile_steps, **knobs)


def device_caveat(on: str) -> str | None:
    """The warning a CPU render shows at its top (None for a GPU render)."""
    if on != "cpu":
        return None
    return ("This render ran on a CPU with toy models. Its times are CPU times: there are no GPU kernels, no "
            "tensor cores and no CUDA setup, so the matmul shares, the bf16 speedups and the cost of the first "
            "step do not carry over to GPUs; the sentences below say which claims hold here. The GPU render "
            "(`reports/01_profiling.ipynb`) is the reference for GPUs. " + SHARED_CPU_NOTE)


def show_device_caveat(on: str) -> None:
    """Display :func:`device_caveat` as a warning box when there is one."""
    text = device_caveat(on)
    if text:
        report.warn(text)


# ----------------------------------------------------------------------------------------------------------
# the models


def size_table(sizes: Sequence[str]) -> pd.DataFrame:
    """Architecture of each size (d_model, d_ff, layers, heads, vocabulary) and its parameter count in
    millions, counted on the meta device (no memory is allocated)."""
    import torch

    from lab.model import TransformerLM, config_for

    rows = []
    for size in sizes:
        cfg = config_for(size)
        with torch.device("meta"):
            n = TransformerLM(cfg).num_parameters()
        rows.append(dict(size=size, d_model=cfg.d_model, d_ff=cfg.d_ff, num_layers=cfg.num_layers,
                         num_heads=cfg.num_heads, vocab_size=cfg.vocab_size, params_M=n / 1e6))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------------------
# end-to-end timing


TIMING_COLUMNS = ["size", "context", "dtype", "status", "params", "fwd_median_ms", "fwd_std_ms", "bwd_median_ms",
                  "bwd_std_ms", "step_median_ms", "step_std_ms", "fwd_peak_gib", "fwdbwd_peak_gib", "step_peak_gib"]


def timing_table(lm: pd.DataFrame) -> pd.DataFrame:
    """The sweep as shown: forward, backward and train-step medians with standard deviations (ms), parameters
    in millions, each mode's peak memory (GiB); columns nobody measured (peaks on the CPU) are left out."""
    df = lm[[c for c in TIMING_COLUMNS if c in lm.columns]].copy()
    if "params" in df:
        df = df.assign(params=df["params"] / 1e6).rename(columns={"params": "params_M"})
    return df.dropna(axis=1, how="all")


def backward_ratios(samples: pd.DataFrame, keys: Sequence[str] = ("size", "context", "dtype")) -> pd.DataFrame:
    """Backward time over forward time per configuration, from the samples (:func:`lab.bench.lm.samples_long`):
    ``ratio`` of medians with its 95% ``low``-``high`` interval and ``verdict`` (``higher``: the backward costs
    more than the forward beyond noise; ``lower``; ``within noise``). Configurations without both are left out."""
    rows = []
    for config, g in samples.groupby(list(keys), sort=False):
        fwd = g.loc[g["phase"] == "fwd", "ms"].dropna().tolist()
        bwd = g.loc[g["phase"] == "bwd", "ms"].dropna().tolist()
        if not fwd or not bwd:
            continue
        c = compare(bwd, fwd, lower_is_better=False)
        rows.append({**dict(zip(keys, config)), "fwd_median_ms": statistics.median(fwd),
                     "bwd_median_ms": statistics.median(bwd), "ratio": c.ratio, "low": c.low, "high": c.high,
                     "verdict": c.verdict})
    return pd.DataFrame(rows, columns=[*keys, "fwd_median_ms", "bwd_median_ms", "ratio", "low", "high", "verdict"])


def _int(x) -> str:
    """A context or batch for prose: ``512``, also when a CSV read it back as ``512.0``."""
    return str(int(x)) if isinstance(x, (int, float)) and float(x).is_integer() else str(x)


def _by_params(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values("params", kind="stable") if "params" in df and df["params"].notna().all() else df


def _failed_modes(error) -> str:
    """``"forward_backward: CUDA out of memory ...; train_step: ..."`` -> ``"forward_backward/train_step"``."""
    if error is None or (isinstance(error, float) and math.isnan(error)) or not str(error):
        return "no detail"
    return "/".join(part.split(":")[0].strip() for part in str(error).split("; "))


def _oom_phrase(lm: pd.DataFrame) -> str:
    oom = lm[lm["status"] != "ok"] if "status" in lm else lm.iloc[:0]
    if oom.empty:
        return ""
    where = ", ".join(f"{r['size']} at context {_int(r['context'])} {r['dtype']} ({_failed_modes(r.get('error'))})"
                      for _, r in oom.iterrows())
    return f"Out of memory (recorded as rows, not measured): {where}."


def variability(lm: pd.DataFrame, threshold: float = 0.05) -> pd.DataFrame:
    """Configurations whose forward, backward or train-step standard deviation exceeds ``threshold`` of its
    mean: ``size``, ``context``, ``dtype``, ``phase`` and ``cv`` (std / mean), worst first."""
    rows = []
    for _, r in lm.iterrows():
        for phase in ("fwd", "bwd", "step"):
            mean, std = r.get(f"{phase}_ms", math.nan), r.get(f"{phase}_std_ms", math.nan)
            if mean == mean and std == std and mean > 0 and std / mean > threshold:
                rows.append(dict(size=r["size"], context=r["context"], dtype=r["dtype"], phase=phase, cv=std / mean))
    return pd.DataFrame(rows, columns=["size", "context", "dtype", "phase", "cv"]).sort_values("cv", ascending=False)


def backward_sentence(ratios: pd.DataFrame) -> str:
    """The backward's cost against the forward's over every configuration, with verdict counts."""
    if ratios.empty:
        return "No configuration measured both the forward and the backward."
    counts = ratios["verdict"].value_counts()
    n = len(ratios)
    text = (f"The backward takes **{num(ratios['ratio'].min(), 2)}x to {num(ratios['ratio'].max(), 2)}x** the "
            f"forward (ratio of medians; {num(ratios['ratio'].median(), 2)}x across the {n} configurations): more "
            f"than the forward beyond noise in {int(counts.get('higher', 0))} of {n}")
    if counts.get("within noise", 0):
        text += f", within noise in {int(counts['within noise'])}"
    if counts.get("lower", 0):
        text += f", less beyond noise in {int(counts['lower'])}"
    return text + (". The FLOPs predict about 2x: for every matrix product of the forward, the backward computes "
                   "two (the gradients of the inputs and of the weights).")


def timing_paragraph(lm: pd.DataFrame, ratios: pd.DataFrame, default_context: int) -> str:
    """The sweep in prose: backward against forward, the range of forward times, where the spread is large,
    and what ran out of memory. Markdown."""
    parts = [backward_sentence(ratios)]
    at = _by_params(lm[(lm["context"] == default_context) & lm["fwd_median_ms"].notna()])
    first = at[at["dtype"] == at["dtype"].iloc[0]] if len(at) else at
    if len(first) >= 2:
        small, big = first.iloc[0], first.iloc[-1]
        parts.append(f"At context {default_context} ({small['dtype']}) the forward takes {num(small['fwd_median_ms'])} "
                     f"ms for {small['size']} and {num(big['fwd_median_ms'])} ms for {big['size']} (medians).")
    noisy = variability(lm)
    configs = noisy[["size", "context", "dtype"]].drop_duplicates()
    if len(configs):
        worst = noisy.iloc[0]
        parts.append(f"The spread is large (standard deviation above 5% of the mean) in {len(configs)} of {len(lm)} "
                     f"configurations, worst for {worst['size']} at context {_int(worst['context'])} {worst['dtype']} "
                     f"({worst['phase']} std {worst['cv']:.0%} of the mean): there a mean alone misleads, which is "
                     "why the comparisons here use medians and intervals.")
    else:
        parts.append("Every standard deviation is below 5% of its mean.")
    oom = _oom_phrase(lm)
    return " ".join(parts + ([oom] if oom else []))


def step_answer(lm: pd.DataFrame, default_context: int) -> str:
    """One line: the train step's median time at the default context, smallest to largest size, per dtype."""
    at = _by_params(lm[(lm["context"] == default_context) & lm["step_median_ms"].notna()])
    if at.empty:
        return f"No train step was measured at context {default_context} (out of memory)."
    parts = []
    for dtype, g in at.groupby("dtype", sort=False):
        span = (f"{num(g['step_median_ms'].iloc[0])} ms ({g['size'].iloc[0]}) to "
                f"{num(g['step_median_ms'].iloc[-1])} ms ({g['size'].iloc[-1]})" if len(g) > 1
                else f"{num(g['step_median_ms'].iloc[0])} ms ({g['size'].iloc[0]})")
        parts.append(f"{span} in {dtype}")
    batch = f", batch {int(at['batch'].iloc[0])}" if "batch" in at else ""
    return f"At context {default_context}{batch}, an AdamW step takes " + "; ".join(parts) + " (medians)."


def backward_answer(ratios: pd.DataFrame) -> str:
    """One line: the backward-over-forward ratio and how often it exceeds the noise."""
    if ratios.empty:
        return "Not measured."
    n, higher = len(ratios), int((ratios["verdict"] == "higher").sum())
    return (f"{num(ratios['ratio'].median(), 2)}x the forward (range {num(ratios['ratio'].min(), 2)}-"
            f"{num(ratios['ratio'].max(), 2)}x; more than the forward beyond noise in {higher} of {n} configurations).")


def plot_timings(lm: pd.DataFrame):
    """Forward and backward time (median, bars ±1 std) against context, one colour per size and one line
    style per dtype, log-log. Returns the figure."""
    ok = lm[lm["fwd_median_ms"].notna()]
    sizes = list(dict.fromkeys(ok["size"]))
    dtypes = list(dict.fromkeys(ok["dtype"]))
    colors = dict(zip(sizes, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    styles = dict(zip(dtypes, ["-", "--", ":", "-."]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (phase, title) in zip(axes, (("fwd", "forward"), ("bwd", "backward"))):
        for (size, dtype), g in ok.groupby(["size", "dtype"], sort=False):
            g = g.sort_values("context")
            ax.errorbar(g["context"], g[f"{phase}_median_ms"], yerr=g[f"{phase}_std_ms"], marker="o", capsize=3,
                        color=colors[size], linestyle=styles[dtype], label=f"{size} {dtype}")
        contexts = sorted(ok["context"].unique())
        ax.set(xscale="log", yscale="log", xlabel="context length", ylabel="ms per step (median ± std)", title=title)
        ax.set_xticks(contexts, [_int(c) for c in contexts])
        ax.minorticks_off()
    axes[1].legend(title="size, dtype", fontsize=8)
    return fig


# ----------------------------------------------------------------------------------------------------------
# bf16 autocast at every context


def plot_speedup_by_context(speed: pd.DataFrame):
    """bf16 speedup over fp32 against context (95% intervals as bars), one panel per mode, one line per size,
    with a line at 1 (no change). ``speed`` is :func:`lab.bench.precision.speedup_table` by size and context.
    Returns the figure."""
    modes = list(dict.fromkeys(speed["mode"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for size, g in speed[(speed["mode"] == mode) & speed["speedup"].notna()].groupby("size", sort=False):
            g = g.sort_values("context")
            err = [(g["speedup"] - g["speedup_low"]).clip(lower=0).fillna(0),
                   (g["speedup_high"] - g["speedup"]).clip(lower=0).fillna(0)]
            ax.errorbar(g["context"], g["speedup"], yerr=err, marker="o", capsize=3, label=size)
        ax.axhline(1.0, color="grey", linestyle=":")
        contexts = sorted(speed["context"].unique())
        ax.set(xscale="log", xlabel="context length", ylabel="speedup over fp32 (×)", title=f"bf16 autocast, {mode}")
        ax.set_xticks(contexts, [_int(c) for c in contexts])
        ax.minorticks_off()
        ax.legend(title="size", fontsize=8)
    return fig


def dtype_paragraph(speed: pd.DataFrame, on: str) -> str:
    """bf16 autocast against fp32 at every size and context: verdict counts per mode, the best and worst
    speedups (each with its verdict), and (on the CPU) that none of it carries over to GPUs. Markdown."""
    modes = [m for m in ("forward", "forward+backward") if m in set(speed["mode"])]
    if not modes or speed["speedup"].notna().sum() == 0:
        return "bf16 autocast and fp32 were not both measured in any configuration."
    text = " ".join(f"{m.capitalize()}: bf16 autocast is {counts_phrase(verdict_counts(speed, m))}." for m in modes)
    fb = speed[(speed["mode"] == modes[-1]) & speed["speedup"].notna()]
    best, worst = fb.loc[fb["speedup"].idxmax()], fb.loc[fb["speedup"].idxmin()]
    text += (f" In {modes[-1]}, the largest speedup estimate is for {best['size']} at context {_int(best['context'])}: "
             f"{speedup_clause(best)}; the smallest for {worst['size']} at context {_int(worst['context'])}: "
             f"{speedup_clause(worst)}.")
    if on == "cpu":
        text += (" On a CPU, bf16 speed depends on the CPU's bf16 instructions and library kernels, and at toy "
                 "sizes on per-operator overhead and the casts autocast inserts; a GPU runs bf16 matmuls on tensor "
                 "cores, so these CPU speedups say nothing about GPU ones (notebook 02 compares every size).")
    return text


def dtype_answer(speed: pd.DataFrame, on: str) -> str:
    """One line: how often bf16 autocast is faster beyond noise, forward+backward."""
    mode = "forward+backward" if "forward+backward" in set(speed["mode"]) else "forward"
    fb = speed[(speed["mode"] == mode) & speed["speedup"].notna()]
    if fb.empty:
        return "Not measured."
    return (f"{mode.capitalize()} on {on}: {counts_phrase(verdict_counts(speed, mode))} (speedups "
            f"{num(fb['speedup'].min())}-{num(fb['speedup'].max())}x){' — CPU numbers' if on == 'cpu' else ''}.")


# ----------------------------------------------------------------------------------------------------------
# warm-up


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
    return (f"{CONFIDENCE:.0%} interval {num(c.low)}-{num(c.high)}x" if math.isfinite(c.low)
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


# ----------------------------------------------------------------------------------------------------------
# kernel profiles


def _size_label(size) -> str:
    return size if isinstance(size, str) else f"d{size.d_model}_L{size.num_layers}"


class KernelProfiles:
    """The ``torch.profiler`` profiles of one configuration, one per mode, taken on first use.

    Profiling happens only when a table is asked for, so a notebook that replays its tables from
    ``results/`` never profiles. ``profile`` is :func:`lab.bench.lm.profile_lm` with the device and the
    warm-up and step counts bound (``functools.partial``); it is passed in because ``lab.book`` does not
    import the benchmarks. Each profile is also exported as a Chrome/Perfetto trace into ``trace_dir``.
    """

    def __init__(self, profile: Callable[..., Any], size, context: int, batch: int, trace_dir: str | Path,
                 modes: Sequence[str] = MODES, attention: str = "naive"):
        self.profile, self.size, self.context, self.batch = profile, size, context, batch
        self.trace_dir, self.modes, self.attention = Path(trace_dir), tuple(modes), attention
        self._profiles: dict[str, Any] = {}

    def trace_path(self, mode: str) -> Path:
        """Where the Chrome/Perfetto trace of ``mode`` is written."""
        return self.trace_dir / f"01_{_size_label(self.size)}_{mode}.json"

    def profiler(self, mode: str):
        """The profiler of ``mode`` (profiled now if not yet)."""
        if mode not in self._profiles:
            self._profiles[mode] = self.profile(self.size, mode=mode, context=self.context, batch=self.batch,
                                                attention=self.attention, trace_path=self.trace_path(mode))
        return self._profiles[mode]

    def kernels(self) -> pd.DataFrame:
        """Every kernel (GPU) or aten operator (CPU) of every mode: :func:`lab.measure.profiling.kernel_table`
        rows with a ``mode`` column."""
        return pd.concat([prof_tables.kernel_table(self.profiler(m), top=None).assign(mode=m) for m in self.modes],
                         ignore_index=True)

    def step_times(self) -> pd.DataFrame:
        """Per mode: the profiled step's wall time (ms), the kernels' busy time (ms; 0 on the CPU), the number of
        profiled steps, and the configuration."""
        return pd.DataFrame([dict(mode=m, wall_ms=prof_tables.step_wall_ms(self.profiler(m)),
                                  busy_ms=prof_tables.gpu_busy_ms(self.profiler(m)),
                                  profiled_steps=getattr(self.profiler(m), "lab_steps", 1),
                                  size=_size_label(self.size), context=self.context, batch=self.batch,
                                  attention=self.attention) for m in self.modes])

    def attention_ranges(self) -> pd.DataFrame:
        """The naive attention's three ranges in the forward profile: calls and ms per step, GFLOP per step
        (:func:`lab.measure.profiling.attention_phase_flops`) and the TFLOP/s achieved."""
        from lab.model import config_for

        cfg = config_for(self.size) if isinstance(self.size, str) else self.size
        flops = prof_tables.attention_phase_flops(self.batch, cfg.num_heads, self.context, cfg.head_dim,
                                                  cfg.num_layers)
        ranges = prof_tables.range_times(self.profiler("forward"))
        ranges["gflop_per_step"] = ranges["range"].map(flops) / 1e9
        ranges["tflop_per_s"] = ranges["gflop_per_step"] / ranges["ms_per_step"]
        return ranges


def time_unit(kernels: pd.DataFrame) -> tuple[str, str]:
    """(``"kernel"``, ``"GPU kernel time"``) or (``"operator"``, ``"CPU operator time"``): what the profile's
    times are, from its ``source`` column."""
    gpu = "source" in kernels and (kernels["source"] == "gpu kernel").any()
    return ("kernel", "GPU kernel time") if gpu else ("operator", "CPU operator time (self time of aten operators)")


def top_kernels(kernels: pd.DataFrame, mode: str, n: int = 8, width: int = 90) -> pd.DataFrame:
    """The ``n`` kernels (operators) of ``mode`` with the most time per step, names cut to ``width``."""
    top = kernels[kernels["mode"] == mode].sort_values("ms_per_step", ascending=False).head(n)
    return top.assign(name=top["name"].str.slice(0, width))[["name", "class", "calls_per_step", "ms_per_step",
                                                              "share"]].reset_index(drop=True)


def show_top_kernels(kernels: pd.DataFrame, n: int = 8) -> None:
    """Display :func:`top_kernels` for each profiled mode."""
    noun, _ = time_unit(kernels)
    for mode in dict.fromkeys(kernels["mode"]):
        report.say(f"**Top {noun}s, {mode}** (per step)")
        report.show_table(top_kernels(kernels, mode, n), floatfmt=".3g")


def class_shares(kernels: pd.DataFrame) -> pd.DataFrame:
    """Time per step by kernel class (matmul, fused attention, other) and mode, with each class's share."""
    g = kernels.groupby(["mode", "class"], sort=False)["ms_per_step"].sum().reset_index()
    g["share"] = g["ms_per_step"] / g.groupby("mode")["ms_per_step"].transform("sum")
    return g


def plot_class_shares(kernels: pd.DataFrame, size: str):
    """Stacked bars: the share of each kernel class in each mode. Returns the figure."""
    shares = class_shares(kernels)
    modes = list(dict.fromkeys(kernels["mode"]))
    pivot = shares.pivot(index="mode", columns="class", values="share").reindex(modes).fillna(0)
    fig, ax = plt.subplots(figsize=(8, 4))
    pivot.plot.barh(stacked=True, ax=ax, colormap="tab10")
    ax.set(xlabel=f"share of {time_unit(kernels)[1].split(' (')[0]}", ylabel="", title=f"{size}: matmul vs other")
    ax.legend(loc="lower right")
    return fig


def matmul_paragraph(kernels: pd.DataFrame) -> str:
    """The matmul share in each mode and the largest non-matmul kernel of the forward, with the explanation
    that fits the device the profile ran on. Markdown."""
    noun, unit = time_unit(kernels)
    mm = class_shares(kernels).query("`class` == 'matmul'").set_index("mode")["share"]
    get = lambda m: mm.get(m, 0.0)
    text = (f"Matrix multiplications take **{get('forward'):.0%}** of the {unit} in the forward pass, "
            f"{get('forward_backward'):.0%} in forward+backward and {get('train_step'):.0%} in the full train step")
    if "train_step" in mm and "forward_backward" in mm and get("train_step") < get("forward_backward"):
        text += f" (the optimizer adds elementwise {noun}s)"
    others = kernels[(kernels["class"] != "matmul") & (kernels["mode"] == "forward")]
    if len(others):
        top = others.sort_values("ms_per_step", ascending=False).iloc[0]
        text += (f". The largest non-matmul {noun} in the forward is `{str(top['name'])[:70]}` "
                 f"({top['share']:.1%} of forward time, {num(top['calls_per_step'])} calls per step)")
    if noun == "kernel":
        text += (". Elementwise and reduction kernels move much data for few FLOPs (they are memory-bound), so "
                 "their share of the time is far above their share of the FLOPs.")
    else:
        text += (". These are CPU operator times at a toy size, per-operator overhead included: they do not "
                 "predict a GPU's kernel mix.")
    return text


def matmul_answer(kernels: pd.DataFrame) -> str:
    """One line: the matmul share per mode."""
    _, unit = time_unit(kernels)
    mm = class_shares(kernels).query("`class` == 'matmul'").set_index("mode")["share"]
    parts = [f"{mm.get(m, 0.0):.0%} of {m.replace('_', '+' if m == 'forward_backward' else ' ')}"
             for m in dict.fromkeys(kernels["mode"])]
    return f"{', '.join(parts)} ({unit.split(' (')[0]})."


def profile_caption(steps: pd.DataFrame, kernels: pd.DataFrame, trace_dir: str | Path) -> str:
    """What was profiled and where the traces are."""
    from lab import paths

    r = steps.iloc[0]
    trace_dir = Path(trace_dir)
    shown = trace_dir.relative_to(paths.REPO_ROOT) if trace_dir.is_relative_to(paths.REPO_ROOT) else trace_dir
    return (f"Profiled **{r['size']}** at context {_int(r['context'])}, batch {_int(r['batch'])}, fp32, "
            f"{r['attention']} attention, {int(r['profiled_steps'])} steps per mode; times are "
            f"{time_unit(kernels)[1]}; traces in `{shown}` (open them at ui.perfetto.dev).")


def profile_timer_sentence(steps: pd.DataFrame, lm: pd.DataFrame) -> str:
    """The profiled forward step against the Python timer's forward of the same size and context (fp32)."""
    fwd = steps.set_index("mode").loc["forward"]
    text = f"The profiler sees a forward step of **{num(fwd['wall_ms'])} ms** wall time"
    if fwd["busy_ms"] > 0:
        text += f", of which kernels are busy {num(fwd['busy_ms'])} ms ({fwd['busy_ms'] / fwd['wall_ms']:.0%})"
    same = lm[(lm["size"] == fwd["size"]) & (lm["context"] == fwd["context"]) & (lm["dtype"] == "fp32")]
    if len(same) and same["fwd_median_ms"].notna().any():
        attention = same["attention"].iloc[0] if "attention" in same else "its"
        text += (f"; the Python timer measured {num(same['fwd_median_ms'].iloc[0])} ms (median) for the same size "
                 f"and context in the sweep, with {attention} attention instead of {fwd['attention']} and without "
                 "the profiler's overhead")
    return text + "."


def attention_table(ranges: pd.DataFrame) -> pd.DataFrame:
    """The attention ranges as shown."""
    return ranges[["range", "calls_per_step", "ms_per_step", "gflop_per_step", "tflop_per_s"]]


def softmax_ratios(ranges: pd.DataFrame) -> dict[str, float]:
    """``runtime``: softmax time over the two attention matmuls' time; ``flops``: the same for FLOPs;
    ``per_flop``: their quotient; ``softmax_tflops`` and ``matmul_tflops``: the rates achieved."""
    r = ranges.set_index("range")
    mm_ms = r.loc["attention/scores", "ms_per_step"] + r.loc["attention/final_matmul", "ms_per_step"]
    mm_gf = r.loc["attention/scores", "gflop_per_step"] + r.loc["attention/final_matmul", "gflop_per_step"]
    runtime = r.loc["attention/softmax", "ms_per_step"] / mm_ms
    flops = r.loc["attention/softmax", "gflop_per_step"] / mm_gf
    return dict(runtime=runtime, flops=flops, per_flop=runtime / flops,
                softmax_tflops=r.loc["attention/softmax", "tflop_per_s"], matmul_tflops=mm_gf / mm_ms)


def softmax_paragraph(ranges: pd.DataFrame, on: str) -> str:
    """Softmax against the two attention matmuls: time ratio, FLOP ratio, cost per FLOP, and the explanation
    that fits the device. Markdown."""
    s = softmax_ratios(ranges)
    direction = "more" if s["per_flop"] >= 1 else "less"
    per_flop = s["per_flop"] if s["per_flop"] >= 1 else 1 / s["per_flop"]
    text = (f"Softmax takes **{num(s['runtime'], 2)}x** the time of the two attention matmuls together for "
            f"**{num(s['flops'], 2)}x** their FLOPs: per FLOP it is {num(per_flop, 2)}x {direction} expensive "
            f"({num(s['softmax_tflops'])} TFLOP/s against {num(s['matmul_tflops'])} TFLOP/s for the matmuls).")
    if on == "cuda":
        text += (" Softmax does a handful of operations per score but reads and writes the whole b·h·s² score "
                 "matrix, so it is bound by memory bandwidth, not arithmetic; fusing it with the matmuls "
                 "(FlashAttention, notebook 05) removes those round trips.")
    else:
        text += (" These are CPU times of a toy configuration, where per-operator overhead weighs as much as "
                 "memory traffic; the GPU explanation (softmax bound by memory bandwidth, removed by fusing it "
                 "with the matmuls, notebook 05) is for GPU renders.")
    return text


def softmax_answer(ranges: pd.DataFrame) -> str:
    """One line: the softmax's time and FLOP ratios to the attention matmuls."""
    s = softmax_ratios(ranges)
    return (f"{num(s['runtime'], 2)}x the time of the two attention matmuls for {num(s['flops'], 2)}x their FLOPs "
            f"({num(s['per_flop'], 2)}x their cost per FLOP).")
