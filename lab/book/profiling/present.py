"""What notebook 01 (profiling) shows: its settings, its tables and plots, and the prose and answers generated
from its result tables.

The notebook measures four things and saves each through :class:`lab.book.report.Chapter` (so it can be
replayed): the ``lm_step`` sweep with its every timed sample (``01_lm_samples``), the warm-up study
(``01_warmup``, presented by :mod:`lab.book.profiling.warmup`), and the kernel profiles (``01_kernels``,
``01_profile_steps``, ``01_attention_ranges``, taken and presented by :mod:`lab.book.profiling.kernels`). Each
function here takes those tables and returns a table, a figure or a string. Comparisons (backward against
forward, bf16 against fp32, the first step against the steady state) use :func:`lab.measure.verdicts.compare`
on the samples: the ratio of medians with a bootstrap interval, so one noisy sample cannot flip a claim, and
"within noise" where the interval contains 1. Explanations that hold on a GPU only (CUDA context, cuBLAS,
memory-bound kernels) are given only when the data was measured on a GPU; a CPU render says what does not
carry over.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd

from lab.book import report
from lab.book.precision.present import (
    SHARED_CPU_NOTE,
    counts_phrase,
    num,
    speedup_clause,
    verdict_counts,
)
from lab.measure.device import resolve_device
from lab.measure.results import measured_on  # noqa: F401 - notebook 01 calls profiling.measured_on
from lab.measure.step import MODES
from lab.measure.verdicts import compare, quotable, span
from lab.model import MODEL_SIZES, TransformerLM, config_for

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
        return report.settings_params(self)


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
    defaults = QUICK if quick else {**FULL, "sizes": tuple(MODEL_SIZES)}
    given = dict(sizes=sizes, contexts=contexts, default_context=default_context, warmup=warmup, steps=steps,
                 warmup_size=warmup_size, cold_runs=cold_runs, profile_size=profile_size,
                 profile_context=profile_context)
    knobs = report.with_profile_defaults(given, defaults)
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


def int_text(x) -> str:
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
    where = ", ".join(f"{r['size']} at context {int_text(r['context'])} {r['dtype']} ({_failed_modes(r.get('error'))})"
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
    spread = span(ratios["ratio"].min(), ratios["ratio"].max(), lambda v: num(v, 2), " to ")
    text = (f"The backward takes **{spread}x** the "
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
        quoted = [f"{num(r['fwd_median_ms'])} ms for {r['size']}"
                  if quotable(r["fwd_median_ms"], r.get("fwd_std_ms", math.nan))
                  else f"too noisy a time to quote for {r['size']} (std {num(r['fwd_std_ms'])} ms)"
                  for r in (small, big)]
        parts.append(f"At context {default_context} ({small['dtype']}) the forward takes {quoted[0]} and {quoted[1]} "
                     "(medians).")
    noisy = variability(lm)
    configs = noisy[["size", "context", "dtype"]].drop_duplicates()
    if len(configs):
        worst = noisy.iloc[0]
        parts.append(f"The spread is large (standard deviation above 5% of the mean) in {len(configs)} of {len(lm)} "
                     f"configurations, worst for {worst['size']} at context {int_text(worst['context'])} "
                     f"{worst['dtype']} "
                     f"({worst['phase']} std {worst['cv']:.0%} of the mean): there a mean alone misleads, which is "
                     "why the comparisons here use medians and intervals.")
    else:
        parts.append("Every standard deviation is below 5% of its mean.")
    oom = _oom_phrase(lm)
    return " ".join(parts + ([oom] if oom else []))


def step_parts(lm: pd.DataFrame, default_context: int) -> list[dict]:
    """The train step at the default context per dtype and size, smallest size first: ``dtype``, ``size``,
    ``median_ms``, ``std_ms`` and ``quotable`` (the median exceeds its spread:
    :func:`lab.measure.verdicts.quotable`)."""
    at = _by_params(lm[(lm["context"] == default_context) & lm["step_median_ms"].notna()])
    rows = [dict(dtype=r["dtype"], size=r["size"], median_ms=float(r["step_median_ms"]),
                 std_ms=float(r.get("step_std_ms", math.nan)),
                 quotable=quotable(float(r["step_median_ms"]), float(r.get("step_std_ms", math.nan))))
            for _, r in at.iterrows()]
    order = list(dict.fromkeys(r["dtype"] for r in rows))
    return sorted(rows, key=lambda r: order.index(r["dtype"]))


def step_answer(lm: pd.DataFrame, default_context: int) -> str:
    """One line: the train step's median time at the default context per size and dtype (smallest size first),
    leaving out as "too noisy" a median no larger than its standard deviation, and saying when a smaller model
    measured slower than a larger one (a sign of a contended machine, not of the model)."""
    parts_ = step_parts(lm, default_context)
    if not parts_:
        return f"No train step was measured at context {default_context} (out of memory)."
    parts = []
    for dtype in dict.fromkeys(p["dtype"] for p in parts_):
        rows = [p for p in parts_ if p["dtype"] == dtype]
        shown = [f"{num(p['median_ms'])} ms ({p['size']})" if p["quotable"] else
                 f"too noisy to quote for {p['size']} (std {num(p['std_ms'])} ms over a median of "
                 f"{num(p['median_ms'])} ms)" for p in rows]
        text = f"{', '.join(shown)} in {dtype}"
        if any(a["median_ms"] > b["median_ms"] for a, b in zip(rows, rows[1:])):
            text += " (a smaller model measured slower than a larger one: this machine's load, not the model)"
        parts.append(text)
    batch = f", batch {int(lm['batch'].iloc[0])}" if "batch" in lm and len(lm) else ""
    return f"At context {default_context}{batch}, an AdamW step takes " + "; ".join(parts) + " (medians)."


def backward_answer(ratios: pd.DataFrame) -> str:
    """One line: the backward-over-forward ratio and how often it exceeds the noise."""
    if ratios.empty:
        return "Not measured."
    n, higher = len(ratios), int((ratios["verdict"] == "higher").sum())
    return (f"{num(ratios['ratio'].median(), 2)}x the forward (range "
            f"{span(ratios['ratio'].min(), ratios['ratio'].max(), lambda v: num(v, 2))}x; more than the forward "
            f"beyond noise in {higher} of {n} configurations).")


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
        ax.set_xticks(contexts, [int_text(c) for c in contexts])
        ax.minorticks_off()
    axes[1].legend(title="size, dtype", fontsize=8)
    return fig


# ----------------------------------------------------------------------------------------------------------
# bf16 autocast at every context


def plot_speedup_by_context(speed: pd.DataFrame):
    """bf16 speedup over fp32 against context (95% intervals as bars), one panel per mode, one line per size,
    with a line at 1 (no change). ``speed`` is :func:`lab.book.precision.bench.speedup_table` by size and context.
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
        ax.set_xticks(contexts, [int_text(c) for c in contexts])
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
    text += (f" In {modes[-1]}, the largest speedup estimate is for {best['size']} at context "
             f"{int_text(best['context'])}: "
             f"{speedup_clause(best)}; the smallest for {worst['size']} at context {int_text(worst['context'])}: "
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
    return (f"{mode.capitalize()} on {on}: {counts_phrase(verdict_counts(speed, mode))} (speedup estimates "
            f"{span(fb['speedup'].min(), fb['speedup'].max(), num)}x){' — CPU numbers' if on == 'cpu' else ''}.")
