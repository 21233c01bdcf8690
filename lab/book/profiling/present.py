"""What notebook 01 (profiling) shows of its end-to-end timings: its settings, the sweep's tables and plots,
and its answers as claims (:mod:`lab.book.claims`): the train step's time, the backward against the forward
(paired by round, since the sweep times the modes in turns), and bf16 autocast against fp32 at every size and
context, every comparison under the one rule from the timed samples. A row whose GPU waited for the host's
launches is named as host-bound; what a CPU render cannot tell about GPUs is said.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import matplotlib.pyplot as plt
import pandas as pd

from lab.accounting import parameter_count
from lab.bench.lm import rows_shown
from lab.book import claims as cl
from lab.book import report
from lab.measure.device import resolve_device
from lab.measure.results import measured_on
from lab.measure.step import MODES
from lab.model import MODEL_SIZES, config_for

# two warm-up rounds: the quick render's comparisons see no cold start; five cold processes: the first step
# has the samples a verdict needs
QUICK = dict(sizes=("tiny", "mini"), contexts=(32, 64), default_context=64, warmup=2, steps=6, warmup_size="tiny",
             cold_runs=5, profile_size="mini", profile_context=64)
FULL = dict(sizes=tuple(MODEL_SIZES), contexts=(128, 256, 512, 1024), default_context=512, warmup=2, steps=5,
            warmup_size="large", cold_runs=5, profile_size="2.7B", profile_context=512)


@dataclass(frozen=True)
class ProfilingSettings:
    """Every knob of notebook 01. A knob left ``None`` takes the quick profile's value (``tiny``/``mini`` at
    contexts 32 and 64 on the CPU) or the full profile's (every spec size at 128-1024, the train step at 512,
    which must be one of the contexts)."""

    quick: bool = True
    device: str = "auto"
    sizes: tuple[str, ...] | None = None
    contexts: tuple[int, ...] | None = None
    default_context: int | None = None
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    batch: int = 4
    warmup: int | None = None
    steps: int | None = None
    warmup_size: str | None = None
    warmups: tuple[int, ...] = (0, 1, 2, 5)
    cold_runs: int | None = None
    profile_size: str | None = None
    profile_context: int | None = None
    profile_steps: int = 3

    def __post_init__(self):
        knobs = report.with_profile_defaults({k: getattr(self, k) for k in (*QUICK, "dtypes", "warmups")},
                                            QUICK if self.quick else FULL)
        for k, v in {**knobs, "device": str(resolve_device(self.device))}.items():
            object.__setattr__(self, k, v)
        if self.default_context not in self.contexts:
            raise ValueError(f"default_context={self.default_context} is not one of contexts={self.contexts}: the "
                             "train step is timed at the default context")

    def modes_for(self, size: str, context: int) -> tuple[str, ...]:
        """Forward and forward+backward everywhere, the full train step at the default context only."""
        return MODES if context == self.default_context else ("forward", "forward_backward")

    @property
    def warmup_runs(self) -> tuple[int, ...]:
        """Warm-up counts of the study, one fresh process each: extra cold (0) processes first, so that the
        first step has ``cold_runs`` samples, then every count once."""
        return (0,) * max(self.cold_runs - self.warmups.count(0), 0) + self.warmups

    def params(self) -> dict:
        return report.settings_params(self)


def show_device_caveat(on: str) -> None:
    """On a CPU render, a warning at the top: which findings do not carry over to GPUs."""
    if on == "cpu":
        report.warn("This render ran on a CPU with toy models. Its times are CPU times: there are no GPU kernels, "
                    "no tensor cores and no CUDA setup, so the matmul shares, the bf16 speedups and the cost of the "
                    "first step do not carry over to GPUs (`reports/01_profiling.ipynb` is the GPU reference). On "
                    "a CPU shared with other work a burst of load can slow every sample of one configuration.")


def size_table(sizes: Sequence[str]) -> pd.DataFrame:
    """Architecture of each size and its parameter count in millions (:func:`lab.accounting.parameter_count`)."""
    return pd.DataFrame([dict(size=size, d_model=c.d_model, d_ff=c.d_ff, num_layers=c.num_layers,
                              num_heads=c.num_heads, vocab_size=c.vocab_size, params_M=parameter_count(c) / 1e6)
                         for size, c in ((size, config_for(size)) for size in sizes)])


# ----------------------------------------------------------------------------------------------------------
# the sweep

PHASES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward", "step": "train step"}
SHOWN = ["size", "context", "dtype", "status", "params", *(f"{p}_{c}" for p in PHASES for c in ("ms", "spread_ms")),
         "fwd_n", "fwd_peak_gib", "fwdbwd_peak_gib", "step_peak_gib", "fwd_gpu_ms", "fwdbwd_gpu_ms", "step_gpu_ms",
         "gpu_busy", "host_bound"]


timing_table = partial(rows_shown, columns=SHOWN)  # the rows as shown: ms, GiB, params in millions


def name(r) -> str:
    return f"{r['size']} at context {int(r['context'])}, {r['dtype']}"


measured = cl.Measured.from_row  # a mode of a row: its median where it ran, out of memory where it did not


def _by_size(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values("params", kind="stable")


def host_bound_findings(lm: pd.DataFrame) -> list[cl.Finding]:
    """For a GPU's rows: the GPU's busy share of each host-bound row, or that none was."""
    on_gpu = measured_on(lm) != "cpu" and "host_bound" in lm
    return cl.host_bound_shares((r for _, r in lm.iterrows()), name) if on_gpu else []


def step_claim(lm: pd.DataFrame, default_context: int) -> cl.Claim:
    """The train step's median at the default context per dtype and size (smallest first)."""
    at = _by_size(lm[lm["context"] == default_context])
    findings, inverted = [], False
    for dtype in dict.fromkeys(at["dtype"]):
        rows = at[at["dtype"] == dtype]
        findings += [cl.Value(measured(f"{r['size']}, {dtype}", r, "step_ms")) for _, r in rows.iterrows()]
        times = rows["step_ms"].dropna().tolist()
        inverted |= any(a > b for a, b in zip(times, times[1:]))
    return cl.Claim(f"How long does a train step take (AdamW, context {default_context}, batch "
                    f"{int(lm['batch'].iloc[0])})?", findings + host_bound_findings(at), because=(
                        "Where a smaller model measured slower than a larger one, the host set the time (its "
                        "launches or its load), not the model." if inverted else ""))


def backward_claim(lm: pd.DataFrame) -> cl.Claim:
    """The backward against the forward of every configuration, paired by round; the range of the ratios."""
    pairs = [cl.Versus(measured(f"backward, {name(r)}", r, "bwd_ms"), measured("forward", r, "fwd_ms"), paired=True)
             for _, r in lm.iterrows() if math.isfinite(r.get("bwd_ms", math.nan))]
    ratios = sorted(f.subject.median / f.reference.median for f in pairs if f.comparison)
    ends = ([cl.Value(cl.Measured.value(f"{what} ratio of medians", v, "x")) for what, v in
             (("smallest", ratios[0]), ("median", statistics.median(ratios)), ("largest", ratios[-1]))]
            if ratios else [])
    return cl.Claim("What does the backward cost next to the forward?", [
        cl.Tally("the backward against the forward", tuple(pairs)), *ends], because=(
        "The FLOPs predict about 2x: for every matrix product of the forward, the backward computes two (the "
        "gradients of the inputs and of the weights)."))


def timing_findings(lm: pd.DataFrame, default_context: int, noisy_above: float = 0.05) -> list[cl.Finding]:
    """The forward of the smallest and the largest size at the default context, how many configurations have
    a spread above ``noisy_above`` of their median (and the worst), and every row that ran out of memory."""
    at = _by_size(lm[(lm["context"] == default_context) & lm["fwd_ms"].notna()])
    at = at[at["dtype"] == at["dtype"].iloc[0]] if len(at) else at
    out = [cl.Value(measured(f"forward, {name(r)}", r, "fwd_ms")) for _, r in at.iloc[[0, -1]].iterrows()] \
        if len(at) > 1 else []
    cv = [(r[f"{p}_spread_ms"] / r[f"{p}_ms"], name(r), PHASES[p]) for _, r in lm.iterrows() for p in PHASES
          if r.get(f"{p}_ms", 0) > 0 and math.isfinite(r.get(f"{p}_spread_ms", math.nan))]
    noisy = {n for c, n, _ in cv if c > noisy_above}
    out.append(cl.Share(f"configurations whose spread exceeds {cl.percent(noisy_above)} of their median", len(noisy),
                        len({n for _, n, _ in cv})))
    if noisy:
        worst = max(cv)
        out.append(cl.Share(f"the largest, {worst[1]}, {worst[2]}: spread over median", worst[0], 1.0))
    for _, r in lm[lm["status"] != "ok"].iterrows():
        modes = [PHASES[p] for p in ("fwd", "fwdbwd", "step") if not math.isfinite(r.get(f"{p}_ms", math.nan))]
        out.append(cl.Value(cl.Measured.out_of_memory(f"{name(r)} ({', '.join(modes)})", r.get("limit_gib"))))
    return out


def plot_timings(lm: pd.DataFrame):
    """Forward and backward medians (bars: their spread) against context, a colour per size and a line style
    per dtype, log-log. Returns the figure."""
    ok = lm[lm["fwd_ms"].notna()]
    colors = dict(zip(dict.fromkeys(ok["size"]), plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    styles = dict(zip(dict.fromkeys(ok["dtype"]), ["-", "--", ":", "-."]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, phase in zip(axes, ("fwd", "bwd")):
        for (size, dtype), g in ok.groupby(["size", "dtype"], sort=False):
            g = g.sort_values("context")
            ax.errorbar(g["context"], g[f"{phase}_ms"], yerr=g[f"{phase}_spread_ms"], marker="o", capsize=3,
                        color=colors[size], linestyle=styles[dtype], label=f"{size} {dtype}")
        contexts = sorted(ok["context"].unique())
        ax.set(xscale="log", yscale="log", xlabel="context length", ylabel="ms per step (median ± spread)",
               title=PHASES[phase])
        ax.set_xticks(contexts, [str(int(c)) for c in contexts])
        ax.minorticks_off()
    axes[1].legend(title="size, dtype", fontsize=8)
    return fig


# ----------------------------------------------------------------------------------------------------------
# bf16 autocast at every context

DTYPE_MODES = (("fwd_ms", "forward"), ("fwdbwd_ms", "forward+backward"))


def dtype_comparisons(lm: pd.DataFrame) -> list[tuple[dict, cl.Versus]]:
    """bf16 autocast against fp32 per size (smallest first), context and mode: ``(keys, Versus)``."""
    out = []
    for (size, context), g in _by_size(lm).groupby(["size", "context"], sort=False):
        by = {r["dtype"]: r for _, r in g.iterrows()}
        if {"fp32", "bf16"} <= set(by):
            out += [(dict(size=size, context=int(context), mode=mode),
                     cl.Versus(measured(f"bf16 autocast, {size} at context {int(context)}, {mode}", by["bf16"], col),
                               measured("fp32", by["fp32"], col))) for col, mode in DTYPE_MODES]
    return out


def speedup_table(pairs: list[tuple[dict, cl.Versus]]) -> pd.DataFrame:
    """The comparisons as a table: both medians, the ratio bf16 / fp32 with its interval, and the verdict."""
    return pd.DataFrame(cl.verdict_table(pairs)).rename(columns={"subject": "bf16", "against": "fp32"})


def dtype_claim(pairs: list[tuple[dict, cl.Versus]], lm: pd.DataFrame) -> cl.Claim:
    """Verdicts counted per mode, the largest and the smallest forward+backward speedup, host-bound rows."""
    fb = sorted((f for k, f in pairs if k["mode"] == "forward+backward" and f.comparison),
                key=lambda f: f.comparison.ratio)
    return cl.Claim("Does bf16 autocast speed up every size and context?", [
        *(cl.Tally(f"{mode}, bf16 autocast against fp32", tuple(f for k, f in pairs if k["mode"] == mode))
          for _, mode in reversed(DTYPE_MODES)), *(fb[:1] + fb[-1:] if len(fb) > 1 else fb),
        *host_bound_findings(lm)], because=(
        "On a CPU, bf16 speed depends on the CPU's bf16 instructions and library kernels, and at toy sizes on "
        "per-operator overhead and the casts autocast inserts; a GPU runs bf16 matmuls on tensor cores, so these "
        "CPU verdicts say nothing about GPUs." if measured_on(lm) == "cpu" else ""))


def plot_speedup_by_context(pairs: list[tuple[dict, cl.Versus]]):
    """bf16 speedup over fp32 against context (95% intervals as bars), a panel per mode, a line per size, a
    line at 1 (no change). Returns the figure."""
    fig, axes = plt.subplots(1, len(DTYPE_MODES), figsize=(12, 4.5), squeeze=False)
    for ax, (_, mode) in zip(axes[0], DTYPE_MODES):
        done = [(k, f.comparison) for k, f in pairs if k["mode"] == mode and f.comparison]
        for size in dict.fromkeys(k["size"] for k, _ in done):
            line = [(k["context"], c) for k, c in done if k["size"] == size]
            y = [1 / c.ratio for _, c in line]
            err = [[max(v - 1 / c.high, 0) if math.isfinite(c.high) else 0 for v, (_, c) in zip(y, line)],
                   [max(1 / c.low - v, 0) if math.isfinite(c.low) and c.low > 0 else 0 for v, (_, c) in zip(y, line)]]
            ax.errorbar([x for x, _ in line], y, yerr=err, marker="o", capsize=3, label=size)
        contexts = sorted({k["context"] for k, _ in pairs})
        ax.axhline(1.0, color="grey", linestyle=":")
        ax.set(xscale="log", xlabel="context length", ylabel="speedup over fp32 (×)", title=f"bf16 autocast, {mode}")
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.legend(title="size", fontsize=8)
    return fig
