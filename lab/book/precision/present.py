"""What notebook 02 (mixed precision) shows: its settings, its tables and plots, and the prose and answers
generated from its result tables.

Each function takes a table the notebook measured (or replayed from ``results/``) and returns a table, a
figure or a string, so the notebook itself holds parameters and calls only. Timing comparisons use the
speedup table of :func:`lab.book.precision.bench.speedup_table`, whose verdicts come from
:mod:`lab.measure.verdicts` (ratio of medians with a bootstrap interval): a sentence says "faster" only
when that verdict says so, and "within noise" otherwise. What a CPU render cannot tell about GPUs is said.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd

from lab.book import report
from lab.measure.device import resolve_device
from lab.measure.results import measured_on
from lab.measure.verdicts import span
from lab.model import MODEL_SIZES

# ----------------------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class PrecisionSettings:
    """Every knob of notebook 02, resolved for the quick (CPU) or the full (GPU) profile."""

    quick: bool
    device: str
    sizes: tuple[str, ...]
    context: int
    batch: int
    warmup: int
    steps: int
    accumulation_value: float
    accumulation_count: int
    norm_width: int

    def params(self) -> dict:
        """The settings as the notebook's parameters (for the provenance banner and the results' sidecars)."""
        return report.settings_params(self)


# 7 or more timed steps, so that one wild sample cannot decide a bootstrap verdict (see lab.book.profiling.present)
QUICK = dict(sizes=("tiny", "mini"), context=64, warmup=1, steps=7)
FULL = dict(context=512, warmup=2, steps=8)


def settings(quick: bool = True, device: str = "auto", sizes: Sequence[str] | None = None, context: int | None = None,
             batch: int = 4, warmup: int | None = None, steps: int | None = None, accumulation_value: float = 0.01,
             accumulation_count: int = 1000, norm_width: int = 1024) -> PrecisionSettings:
    """Notebook 02's settings: a knob left ``None`` takes the quick profile's value (toy sizes ``tiny`` and
    ``mini`` at context 64 on the CPU) or the full profile's (every spec size at context 512)."""
    defaults = QUICK if quick else {**FULL, "sizes": tuple(MODEL_SIZES)}
    k = report.with_profile_defaults(dict(sizes=sizes, context=context, warmup=warmup, steps=steps), defaults)
    return PrecisionSettings(quick=quick, device=str(resolve_device(device)), sizes=tuple(k["sizes"]),
                             context=k["context"], batch=batch, warmup=k["warmup"],
                             steps=k["steps"], accumulation_value=accumulation_value,
                             accumulation_count=accumulation_count, norm_width=norm_width)


def num(x: float, digits: int = 3) -> str:
    """A number for prose: ``digits`` significant digits, no exponent above 1000, ``n/a`` for NaN."""
    if x is None or not math.isfinite(float(x)):
        return "n/a" if x is None or math.isnan(float(x)) else str(float(x))
    if abs(x) >= 10**digits:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


# ----------------------------------------------------------------------------------------------------------
# 1. accumulation


def _bf16_half_ulp(x: float) -> float:
    """Half a unit in the last place of ``x`` in bf16 (8 significant bits): below it, an addition is lost."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 8) if x else 0.0


def accumulation_paragraph(acc: pd.DataFrame) -> str:
    """What the accumulation table shows (:func:`lab.book.precision.bench.accumulation_experiment`), as Markdown."""
    row = acc.set_index(["accumulator", "addend", "upcast"])
    fp16, fp32_16 = row.loc[("fp16", "fp16", False)], row.loc[("fp32", "fp16", True)]
    bf16, fp32 = row.loc[("bf16", "bf16", False)], row.loc[("fp32", "fp32", False)]
    implicit = row.loc[("fp32", "fp16", False), "result"]
    text = (f"Accumulating in fp16 ends at **{num(fp16['result'], 6)}** (error {num(fp16['abs_error'])}); keeping the "
            f"same fp16 addends but accumulating in fp32 ends at **{num(fp32_16['result'], 6)}** (error "
            f"{num(fp32_16['abs_error'])}), of which {num(abs(fp32_16['representation_error']))} comes from storing "
            f"the addend itself as {num(fp32_16['addend_value'], 8)} in fp16. ")
    half = _bf16_half_ulp(bf16["result"])
    stuck = (f" once the addend ({num(bf16['addend_value'])}) is below half a unit in the last place of the sum "
             f"({num(half)})" if bf16["addend_value"] < half else "")
    text += (f"bf16, with 8 significant bits, is the extreme case: its accumulator {'stops' if stuck else 'ends'} at "
             f"**{num(bf16['result'], 6)}** ({bf16['rel_error']:.0%} error){stuck}. Even fp32 accumulation is off by "
             f"{num(fp32['abs_error'], 2)}. ")
    same = implicit == fp32_16["result"]
    text += (f"An explicit upcast of the fp16 addend {'makes no difference' if same else 'changes the result'} "
             f"({num(implicit, 8)} implicit, {num(fp32_16['result'], 8)} explicit): what matters is the "
             "accumulator's dtype. This is why matmul kernels accumulate in fp32 even when their inputs are "
             "fp16 or bf16.")
    return text


def accumulation_answer(acc: pd.DataFrame) -> str:
    """One line: the error of each accumulator dtype on the same addends."""
    row = acc.set_index(["accumulator", "addend", "upcast"])
    exact = acc["exact"].iloc[0]
    fp16 = row.loc[("fp16", "fp16", False), "result"]
    return (f"Summing to {num(exact)}: an fp16 accumulator ends at {num(fp16, 6)}, "
            f"a bf16 one at {num(row.loc[('bf16', 'bf16', False), 'result'], 6)}, an fp32 one fed the same fp16 "
            f"addends at {num(row.loc[('fp32', 'fp16', True), 'result'], 6)}: accumulate in fp32.")


# ----------------------------------------------------------------------------------------------------------
# 2. what autocast does to each tensor


def autocast_tables(probe: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The probe of :func:`lab.book.precision.bench.autocast_dtype_tables` split by device (the measured device
    first): one wide table each, tensor by tensor."""
    return {d: g.drop(columns="device").reset_index(drop=True) for d, g in probe.groupby("device", sort=False)}


def show_autocast_tables(probe: pd.DataFrame) -> None:
    """Display the observed dtypes, one table per device."""
    for device, table in autocast_tables(probe).items():
        report.say(f"**Observed dtypes on {device}**")
        report.show_table(table)


def autocast_paragraph(probe: pd.DataFrame) -> str:
    """What the probe observed under fp16 and bf16 autocast on the measured device (and, where a GPU and the
    CPU were both probed, where they differ), as Markdown."""
    tables = autocast_tables(probe)
    device = next(iter(tables))
    t = tables[device].set_index("tensor")
    f16, b16 = "autocast fp16", "autocast bf16"
    text = (f"On {device}, under fp16 autocast the parameters stay **{t.loc['param fc1.weight', f16]}** (autocast "
            f"casts a copy for each op, never the weights), the first Linear's output is "
            f"**{t.loc['fc1 output', f16]}**, the LayerNorm output **{t.loc['ln output', f16]}**, the logits "
            f"**{t.loc['logits', f16]}**, the loss **{t.loc['loss', f16]}** and the parameter gradients "
            f"**{t.loc['grad fc1.weight', f16]}** (a gradient takes its parameter's dtype; the gradient arriving "
            f"at the logits is {t.loc['grad logits', f16]}). bf16 autocast gives {t.loc['fc1 output', b16]} "
            f"matmul outputs and a {t.loc['ln output', b16]} LayerNorm output.")
    if len(tables) > 1:
        cpu = tables["cpu"].set_index("tensor") if "cpu" in tables else None
        if cpu is not None and cpu.loc["ln output", b16] != t.loc["ln output", b16]:
            text += (f" The LayerNorm output differs between devices: **{t.loc['ln output', b16]}** on {device}, "
                     f"**{cpu.loc['ln output', b16]}** on the CPU: each device has its own list of the ops autocast "
                     "runs in fp32 (CUDA's includes `layer_norm`).")
    elif device == "cpu":
        text += (" These are the CPU's autocast rules; CUDA's differ (its autocast runs `layer_norm` in fp32), so "
                 "the LayerNorm row does not carry over to GPUs.")
    return text


def autocast_answer(probe: pd.DataFrame) -> str:
    """One line: which tensors autocast makes low precision on the measured device."""
    tables = autocast_tables(probe)
    device = next(iter(tables))
    t = tables[device].set_index("tensor")
    col = "autocast bf16"
    return (f"On {device}: matmul outputs and logits become {t.loc['logits', col]}; parameters, loss and parameter "
            f"gradients stay {t.loc['grad fc1.weight', col]}; the LayerNorm output is {t.loc['ln output', col]}.")


# ----------------------------------------------------------------------------------------------------------
# 3. why normalisation statistics stay in fp32


def norm_error_table(norm: pd.DataFrame) -> pd.DataFrame:
    """Relative error of each statistic, one column per dtype (of
    :func:`lab.book.precision.bench.norm_statistics_demo`)."""
    return norm.pivot_table(index=["input", "statistic"], columns="dtype", values="rel_error",
                            aggfunc="first").reset_index()


def _stat(norm: pd.DataFrame, inp: str, dtype: str, statistic: str, col: str = "value") -> float:
    sel = norm[(norm["input"] == inp) & (norm["dtype"] == dtype) & (norm["statistic"] == statistic)]
    return float(sel[col].iloc[0])


def _inputs(norm: pd.DataFrame) -> tuple[str, str]:
    """(the largest-scale zero-mean input, the shifted input) of the norm demo, by their labels."""
    inputs = list(dict.fromkeys(norm["input"]))
    shifted = [i for i in inputs if not i.startswith("N(0,")]
    scaled = [i for i in inputs if i.startswith("N(0,")]
    big = max(scaled, key=lambda i: _stat(norm, i, "fp32", "mean_square", "reference"))
    return big, shifted[0]


def norm_paragraph(norm: pd.DataFrame) -> str:
    """Overflow in fp16 and cancellation in bf16, from the norm statistics table, as Markdown."""
    big, shift = _inputs(norm)
    f16_ms = _stat(norm, big, "fp16", "mean_square")
    overflow = not math.isfinite(f16_ms)
    text = (f"For {big} activations the squares reach {num(_stat(norm, big, 'fp32', 'mean_square', 'reference'))} "
            f"on average: the fp16 mean of squares is **{num(f16_ms)}**")
    text += (" (fp16's largest finite value is 65504), so x·rsqrt(mean of squares) collapses to zero and the "
             f"normalised output is wrong by up to {num(_stat(norm, big, 'fp16', 'rms_output_max_error'))}"
             if overflow else f", {_stat(norm, big, 'fp16', 'mean_square', 'rel_error'):.2%} off")
    text += (f", while bf16, which has fp32's exponent range, is within "
             f"{_stat(norm, big, 'bf16', 'mean_square', 'rel_error'):.2%}. ")
    ref_var = _stat(norm, shift, "bf16", "variance", "reference")
    mean_sq = _stat(norm, shift, "fp32", "mean_square", "reference")
    text += (f"bf16 pays for that range with resolution: for {shift} activations the variance E[x²] − E[x]² should "
             f"be {num(ref_var)}, but bf16 gives **{num(_stat(norm, shift, 'bf16', 'variance'))}** and fp16 "
             f"{num(_stat(norm, shift, 'fp16', 'variance'))}, against fp32's "
             f"{num(_stat(norm, shift, 'fp32', 'variance'), 4)}: both terms are near {num(mean_sq)}, where one bf16 "
             f"step is {num(2 * _bf16_half_ulp(mean_sq))}, so their difference is mostly rounding (catastrophic "
             "cancellation). Hence `lab.model.RMSNorm` computes its statistic in fp32, and CUDA autocast runs "
             "`layer_norm` in fp32.")
    return text


def norm_answer(norm: pd.DataFrame) -> str:
    """One line: fp16 overflows, bf16 cancels."""
    big, shift = _inputs(norm)
    return (f"fp16's mean of squares of {big} values is {num(_stat(norm, big, 'fp16', 'mean_square'))}; bf16's "
            f"variance of {shift} values is off by {_stat(norm, shift, 'bf16', 'variance', 'rel_error'):.0%}; fp32's "
            f"relative errors there are {num(_stat(norm, big, 'fp32', 'mean_square', 'rel_error'), 2)} and "
            f"{num(_stat(norm, shift, 'fp32', 'variance', 'rel_error'), 2)}.")


# ----------------------------------------------------------------------------------------------------------
# 4. fp32 against bf16 autocast


TIMING_COLUMNS = ["size", "context", "dtype", "status", "params", "fwd_median_ms", "fwd_std_ms", "fwdbwd_median_ms",
                  "fwdbwd_std_ms", "bwd_median_ms", "step_median_ms", "step_std_ms", "fwd_peak_gib",
                  "fwdbwd_peak_gib", "step_peak_gib"]


def timing_table(lm: pd.DataFrame) -> pd.DataFrame:
    """The ``lm_step`` rows as shown: medians and standard deviations (ms), parameters in millions, each mode's
    peak memory (GiB); columns nobody measured (peaks on the CPU, a mode not run) are left out."""
    df = lm[[c for c in TIMING_COLUMNS if c in lm.columns]].copy()
    if "params" in df:
        df["params"] = df["params"] / 1e6
        df = df.rename(columns={"params": "params_M"})
    return df.dropna(axis=1, how="all")


def speedup_display(speed: pd.DataFrame) -> pd.DataFrame:
    """The speedup table as shown: medians, speedup with its 95% interval, verdict."""
    keys = [k for k in ("size", "context") if k in speed.columns]
    ms = [c for c in speed.columns if c.endswith("_median_ms")]
    out = speed[keys + ["mode"] + ms + ["speedup"]].copy()
    out["95% interval"] = [span(lo, hi, num) if math.isfinite(lo) and math.isfinite(hi) else "n/a"
                           for lo, hi in zip(speed["speedup_low"], speed["speedup_high"])]
    out["verdict (bf16)"] = speed["verdict"]
    return out


def speedup_clause(row: pd.Series, subject: str = "bf16 autocast", reference: str = "fp32") -> str:
    """``"bf16 autocast is 1.9x faster than fp32 (95% interval 1.7-2.1x)"``, or within noise, or slower; the
    word comes from the row's verdict (:func:`lab.book.precision.bench.speedup_table`)."""
    interval = (f"95% interval {span(row['speedup_low'], row['speedup_high'], num)}x"
                if math.isfinite(row["speedup_low"]) and math.isfinite(row["speedup_high"]) else "no spread measured")
    verdict = row["verdict"]
    if verdict == "faster":
        return f"{subject} is {num(row['speedup'])}x faster than {reference} ({interval})"
    if verdict == "slower":
        return f"{subject} is slower than {reference}: {num(row['speedup'])}x its speed ({interval})"
    if verdict == "not measured":
        return f"{subject} against {reference} was not measured (out of memory)"
    return f"{subject} is within noise of {reference} (speedup {num(row['speedup'])}x, {interval})"


def verdict_counts(speed: pd.DataFrame, mode: str) -> dict[str, int]:
    """How many configurations of ``mode`` each verdict has (``faster``, ``within noise``, ``slower``,
    ``not measured``)."""
    counts = speed.loc[speed["mode"] == mode, "verdict"].value_counts()
    return {v: int(counts.get(v, 0)) for v in ("faster", "within noise", "slower", "not measured")}


def counts_phrase(counts: dict[str, int]) -> str:
    """``"faster beyond noise in 3 of 4 configurations, within noise in 1"``."""
    measured = counts["faster"] + counts["within noise"] + counts["slower"]
    parts = [f"faster beyond noise in {counts['faster']} of {measured} configurations"]
    parts += [f"{word} in {counts[v]}" for v, word in (("within noise", "within noise"),
                                                        ("slower", "slower beyond noise")) if counts[v]]
    if counts["not measured"]:
        parts.append(f"not measured (out of memory) in {counts['not measured']}")
    return ", ".join(parts)


CPU_BF16_CAVEAT = ("This render ran on a CPU: whether bf16 autocast helps there depends on the CPU's bf16 "
                   "instructions and its library kernels, and at toy sizes per-operator overhead and the casts "
                   "autocast inserts weigh as much as the matmuls. None of this predicts a GPU, whose matmuls run "
                   "bf16 on tensor cores at several times their fp32 rate.")


def _ordered_by_size(speed: pd.DataFrame, lm: pd.DataFrame) -> pd.DataFrame:
    params = lm.groupby("size", sort=False)["params"].max() if "params" in lm else pd.Series(dtype=float)
    out = speed.assign(params=speed["size"].map(params))
    return out.sort_values("params", kind="stable") if out["params"].notna().all() else out


def size_trend(speed: pd.DataFrame, lm: pd.DataFrame, mode: str = "forward+backward") -> str:
    """``"grows"``, ``"shrinks"`` or ``"no trend beyond noise"``: the speedup of the largest measured size
    against the smallest's, decided only where their 95% intervals do not overlap."""
    ok = _ordered_by_size(speed[(speed["mode"] == mode) & speed["speedup"].notna()], lm)
    if len(ok) < 2:
        return "no trend beyond noise"
    small, large = ok.iloc[0], ok.iloc[-1]
    if large["speedup_low"] > small["speedup_high"]:
        return "grows"
    if large["speedup_high"] < small["speedup_low"]:
        return "shrinks"
    return "no trend beyond noise"


def speedup_paragraph(speed: pd.DataFrame, lm: pd.DataFrame) -> str:
    """bf16 autocast against fp32 for every size: verdict counts, the range of speedups, the trend with size,
    and (on the CPU) what does not carry over to GPUs. Markdown."""
    on = measured_on(lm)
    mode = "forward+backward"
    fb = _ordered_by_size(speed[(speed["mode"] == mode) & speed["speedup"].notna()], lm)
    if fb.empty:
        return "No size measured forward+backward in both precisions (out of memory): no speedup to report."
    text = f"Forward+backward with bf16 autocast on {on}: {counts_phrase(verdict_counts(speed, mode))}. "
    small, large = fb.iloc[0], fb.iloc[-1]
    text += f"For {small['size']}, {speedup_clause(small)}"
    text += f"; for {large['size']}, {speedup_clause(large)}. " if len(fb) > 1 else ". "
    fwd = verdict_counts(speed, "forward")
    text += f"The forward alone: {counts_phrase(fwd)}. "
    trend = size_trend(speed, lm)
    if trend == "grows":
        text += (f"The speedup grows with size beyond noise ({num(small['speedup'])}x for {small['size']} to "
                 f"{num(large['speedup'])}x for {large['size']})")
        text += (": larger models spend a larger share of the step in matmuls, which bf16 speeds up, and less in "
                 "elementwise kernels and the casts autocast adds." if on == "cuda" else ".")
    elif trend == "shrinks":
        text += "The speedup shrinks with size beyond noise between the smallest and the largest size."
    else:
        text += "Between the smallest and the largest size the speedup shows no trend beyond noise."
    if on == "cpu":
        text += " " + CPU_BF16_CAVEAT
    return text


def speedup_answer(speed: pd.DataFrame, lm: pd.DataFrame) -> str:
    """One line: the bf16 forward+backward speedup of the smallest and the largest size, with verdicts."""
    fb = _ordered_by_size(speed[(speed["mode"] == "forward+backward") & speed["speedup"].notna()], lm)
    if fb.empty:
        return "Not measured (out of memory in one of the precisions)."
    on = measured_on(lm)
    ends = [fb.iloc[0]] + ([fb.iloc[-1]] if len(fb) > 1 else [])
    parts = [f"{r['size']}: {num(r['speedup'])}x ({r['verdict']})" for r in ends]
    return (f"Forward+backward speedup of bf16 autocast over fp32 on {on}, " + "; ".join(parts)
            + f" — {counts_phrase(verdict_counts(speed, 'forward+backward'))}"
            + (" (CPU numbers: they do not carry over to GPUs)." if on == "cpu" else "."))


def plot_speedup(speed: pd.DataFrame, lm: pd.DataFrame, title: str = "bf16 autocast speedup over fp32"):
    """Speedup (fp32 median / bf16 median) against model size, one line per mode, with 95% intervals as error
    bars and a line at 1 (no change). Returns the figure."""
    df = _ordered_by_size(speed, lm)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x_is_params = df["params"].notna().all() if "params" in df else False
    for mode, g in df.groupby("mode", sort=False):
        g = g[g["speedup"].notna()]
        x = g["params"] if x_is_params else g["size"]
        err = [(g["speedup"] - g["speedup_low"]).clip(lower=0).fillna(0),
               (g["speedup_high"] - g["speedup"]).clip(lower=0).fillna(0)]
        ax.errorbar(x, g["speedup"], yerr=err, marker="o", capsize=3, label=mode)
        if x_is_params and mode == df["mode"].iloc[0]:
            for _, r in g.iterrows():
                ax.annotate(str(r["size"]), (r["params"], r["speedup"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="grey", linestyle=":")
    if x_is_params:
        ax.set_xscale("log")
    ax.set(xlabel="parameters" if x_is_params else "size", ylabel="speedup over fp32 (×)", title=title)
    ax.legend(title="mode")
    return fig


#: Why intervals from each configuration's own samples cannot see everything on a shared CPU.
SHARED_CPU_NOTE = ("On a CPU shared with other work, the load changes over time, and configurations are measured "
                   "one after the other: a burst of load can slow every sample of one configuration, which no "
                   "interval computed from its own samples can reveal. Treat single CPU verdicts with suspicion.")


def device_caveat(on: str, notebook: str = "02_mixed_precision") -> str | None:
    """The warning a CPU render shows above its timings (None on a GPU)."""
    if on != "cpu":
        return None
    return (f"This render ran on a CPU with toy models. Its numerical results (accumulation, norm statistics) hold "
            f"anywhere, and its autocast probe shows the CPU's rules; its timings do not carry over to GPUs (see the "
            f"GPU report `reports/{notebook}.ipynb` for those). {SHARED_CPU_NOTE}")


def show_device_caveat(on: str) -> None:
    """Display :func:`device_caveat` as a warning box when there is one."""
    text = device_caveat(on)
    if text:
        report.warn(text)
