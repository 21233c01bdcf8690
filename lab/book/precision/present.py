"""What notebook 02 (mixed precision) shows: its settings, the toy model of the autocast exercise, and its
answers as claims (:mod:`lab.book.claims`) read from the tables of :mod:`lab.measure.numerics` and of the
``lm_step`` sweep, with the tables and the plot beside them. bf16 against fp32 is judged by the one rule on
every timed sample; an explanation that holds on a GPU only is given only for a GPU's rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import matplotlib.pyplot as plt
import pandas as pd
from torch import nn

from lab.bench.lm import rows_shown
from lab.book import claims as cl
from lab.book import report
from lab.measure.device import resolve_device
from lab.measure.numerics import half_ulp
from lab.measure.results import measured_on
from lab.model import MODEL_SIZES

QUICK = dict(sizes=("tiny", "mini"), context=64, warmup=2, steps=7)
FULL = dict(sizes=tuple(MODEL_SIZES), context=512, warmup=2, steps=5)


@dataclass(frozen=True)
class PrecisionSettings:
    """Every knob of notebook 02. A knob left ``None`` takes the quick profile's value (``tiny`` and ``mini``
    at context 64 on the CPU, two warm-up rounds so that no cold start is timed) or the full profile's (every
    spec size at context 512)."""

    quick: bool = True
    device: str = "auto"
    sizes: tuple[str, ...] | None = None
    context: int | None = None
    batch: int = 4
    warmup: int | None = None
    steps: int | None = None
    accumulation_value: float = 0.01
    accumulation_count: int = 1000
    norm_width: int = 1024

    def __post_init__(self):
        knobs = report.with_profile_defaults({k: getattr(self, k) for k in QUICK}, QUICK if self.quick else FULL)
        for k, v in {**knobs, "device": str(resolve_device(self.device))}.items():
            object.__setattr__(self, k, v)

    def params(self) -> dict:
        return report.settings_params(self)



class ToyModel(nn.Module):
    """Linear -> ReLU -> LayerNorm -> Linear, the model of the classic autocast exercise."""

    def __init__(self, in_features: int = 10, out_features: int = 5, hidden: int = 10):
        super().__init__()
        self.fc1, self.relu = nn.Linear(in_features, hidden, bias=False), nn.ReLU()
        self.ln, self.fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, out_features, bias=False)

    def forward(self, x):
        return self.fc2(self.ln(self.relu(self.fc1(x))))


def _value(label: str, value: float, unit: str = "") -> cl.Value:
    return cl.Value(cl.Measured.value(label, value, unit))


# ----------------------------------------------------------------------------------------------------------
# 1. accumulation


def accumulation_claim(acc: pd.DataFrame) -> cl.Claim:
    """Each accumulator's result and error on the same addends, what storing the addend costs, where bf16 stops
    growing, and whether an explicit upcast of the addend changes anything."""
    row = acc.set_index(["accumulator", "addend", "upcast"])
    fp16, fp32_16 = row.loc[("fp16", "fp16", False)], row.loc[("fp32", "fp16", True)]
    bf16 = row.loc[("bf16", "bf16", False)]
    implicit, half = row.loc[("fp32", "fp16", False), "result"], half_ulp(bf16["result"], "bf16")
    stalled = bf16["addend_value"] < half
    findings = [_value("exact sum", acc["exact"].iloc[0]), _value("fp16 accumulator", fp16["result"]),
                _value("its error", fp16["abs_error"]), _value("fp32 accumulator of the same fp16 addends",
                                                               fp32_16["result"]),
                _value("its error", fp32_16["abs_error"]),
                _value("of which storing the addend in fp16", abs(fp32_16["representation_error"])),
                _value("bf16 accumulator", bf16["result"]), cl.Share("its error", bf16["abs_error"], bf16["exact"])]
    if stalled:
        findings.append(_value("half a unit in the last place of bf16 at that sum", half))
    findings += [_value("fp32 accumulator of fp32 addends: error", row.loc[("fp32", "fp32", False), "abs_error"]),
                 cl.Observed("an explicit upcast of the fp16 addends", "the same result as the implicit promotion"
                             if implicit == fp32_16["result"] else "a different result from the implicit promotion")]
    return cl.Claim("What goes wrong when a sum accumulates in 16 bits?", findings, because=(
        ("bf16 keeps 8 significant bits, so once the addend is below half a unit in the last place of the sum, "
         "adding it changes nothing. " if stalled else "")
        + "What matters is the accumulator's dtype: matmul kernels accumulate in fp32 even when their inputs are "
          "fp16 or bf16."))


# ----------------------------------------------------------------------------------------------------------
# 2. what autocast does to each tensor

PROBED = {"param fc1.weight": "parameters", "fc1 output": "first Linear's output", "ln output": "LayerNorm output",
          "logits": "logits", "loss": "loss", "grad logits": "gradient arriving at the logits",
          "grad fc1.weight": "parameter gradients"}


def autocast_tables(probe: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The probe split by device (the measured device first), tensor by tensor."""
    return {d: g.drop(columns="device").reset_index(drop=True) for d, g in probe.groupby("device", sort=False)}


def show_autocast_tables(probe: pd.DataFrame) -> None:
    for device, table in autocast_tables(probe).items():
        report.say(f"**Observed dtypes on {device}**")
        report.show_table(table)


def autocast_claim(probe: pd.DataFrame) -> cl.Claim:
    """The dtype of each probed tensor under fp16 and bf16 autocast on the measured device, and, where the CPU
    was probed beside a GPU, the LayerNorm output on the CPU."""
    tables = autocast_tables(probe)
    device = next(iter(tables))
    t = tables[device].set_index("tensor")
    findings = [cl.Observed("probed", f"on {device}, under fp16 / bf16 autocast"),
                *(cl.Observed(name, f"{t.loc[tensor, 'autocast fp16']} / {t.loc[tensor, 'autocast bf16']}")
                  for tensor, name in PROBED.items())]
    because = ("Autocast casts a copy of the weights for each op and never the weights themselves, and a gradient "
               "takes its parameter's dtype.")
    if "cpu" in tables and device != "cpu":
        cpu = tables["cpu"].set_index("tensor").loc["ln output", "autocast bf16"]
        findings.append(cl.Observed("LayerNorm output under bf16 autocast on the CPU", cpu))
        if cpu != t.loc["ln output", "autocast bf16"]:
            because += " Each device has its own list of the ops autocast runs in fp32 (CUDA's includes `layer_norm`)."
    elif device == "cpu":
        because += (" These are the CPU's rules; CUDA's autocast runs `layer_norm` in fp32, so the LayerNorm row does "
                    "not carry over to GPUs.")
    return cl.Claim("What does autocast do to each tensor?", findings, because)


# ----------------------------------------------------------------------------------------------------------
# 3. why normalisation statistics stay in fp32


def norm_error_table(norm: pd.DataFrame) -> pd.DataFrame:
    """Relative error of each statistic, one column per dtype."""
    return norm.pivot_table(index=["input", "statistic"], columns="dtype", values="rel_error",
                            aggfunc="first").reset_index()


def norm_claim(norm: pd.DataFrame) -> cl.Claim:
    """Overflow in fp16 (the mean of squares of large activations) and cancellation in bf16 (the variance of
    activations with a large mean), each against fp64."""
    def stat(inp, dtype, statistic, col="value"):
        sel = norm[(norm["input"] == inp) & (norm["dtype"] == dtype) & (norm["statistic"] == statistic)]
        return float(sel[col].iloc[0])

    inputs = list(dict.fromkeys(norm["input"]))
    big = max((i for i in inputs if i.startswith("N(0,")), key=lambda i: stat(i, "fp32", "mean_square", "reference"))
    shift = next(i for i in inputs if not i.startswith("N(0,"))
    overflow = not math.isfinite(stat(big, "fp16", "mean_square"))
    mean_square = stat(shift, "fp32", "mean_square", "reference")
    findings = [_value(f"mean of squares of {big} activations", stat(big, "fp32", "mean_square", "reference")),
                _value("in fp16", stat(big, "fp16", "mean_square"))]
    if overflow:
        findings.append(_value("largest error of fp16's normalised output", stat(big, "fp16", "rms_output_max_error")))
    findings += [cl.Share("bf16's relative error", stat(big, "bf16", "mean_square", "rel_error"), 1.0),
                 _value(f"variance E[x²] − E[x]² of {shift} activations", stat(shift, "bf16", "variance", "reference")),
                 *(_value(f"in {d}", stat(shift, d, "variance")) for d in ("bf16", "fp16", "fp32")),
                 _value("E[x²] there", mean_square),
                 _value("one bf16 step at that size", 2 * half_ulp(mean_square, "bf16"))]
    return cl.Claim("Why do normalisation statistics stay in fp32?", findings, because=(
        ("Squares above fp16's largest finite value (65504) overflow, so x·rsqrt(mean of squares) collapses to zero; "
         if overflow else "") + "bf16 has fp32's exponent range but 8 significant bits, so the difference of two "
        "terms near E[x²] is mostly rounding (catastrophic cancellation). Hence `lab.model.RMSNorm` computes its "
        "statistic in fp32, and CUDA autocast runs `layer_norm` in fp32."))


# ----------------------------------------------------------------------------------------------------------
# 4. fp32 against bf16 autocast

MODES = (("fwd_ms", "forward"), ("fwdbwd_ms", "forward+backward"))
#: The modes the sweep times together: those notebook 01 times at its default context, so that the two reports
#: measure these rows alike (the ledger compares them); the train step itself is not compared here.
TIMED_MODES = ("forward", "forward_backward", "train_step")
SHOWN = ["size", "context", "dtype", "status", "params", "fwd_ms", "fwd_spread_ms", "fwdbwd_ms", "fwdbwd_spread_ms",
         "bwd_ms", "bwd_spread_ms", "fwdbwd_n", "fwd_peak_gib", "fwdbwd_peak_gib", "fwd_gpu_ms", "fwdbwd_gpu_ms",
         "gpu_busy", "host_bound"]


timing_table = partial(rows_shown, columns=SHOWN)  # the rows as shown: ms, GiB, params in millions


measured = cl.Measured.from_row  # a mode of a row: its median where it ran, out of memory where it did not


def dtype_comparisons(lm: pd.DataFrame) -> list[tuple[dict, cl.Versus]]:
    """bf16 autocast against fp32, per size (smallest first) and mode: ``(keys, Versus)``."""
    out = []
    order = lm.groupby("size", sort=False)["params"].max().sort_values(kind="stable").index
    for size in order:
        by = {r["dtype"]: r for _, r in lm[lm["size"] == size].iterrows()}
        if {"fp32", "bf16"} <= set(by):
            out += [(dict(size=size, mode=mode), cl.Versus(measured(f"bf16 autocast, {size}, {mode}", by["bf16"], col),
                                                          measured("fp32", by["fp32"], col))) for col, mode in MODES]
    return out


def speedup_table(pairs: list[tuple[dict, cl.Versus]]) -> pd.DataFrame:
    """The comparisons as a table: both medians, the ratio bf16 / fp32 with its interval, and the verdict."""
    return pd.DataFrame(cl.verdict_table(pairs)).rename(columns={"subject": "bf16", "against": "fp32"})


def host_bound_findings(lm: pd.DataFrame) -> list[cl.Finding]:
    """For a GPU's rows: the GPU's busy share of each host-bound row, or that none was."""
    on_gpu = measured_on(lm) != "cpu" and "host_bound" in lm
    label = lambda r: f"{r['size']} at context {int(r['context'])}, {r['dtype']}"  # noqa: E731
    return cl.host_bound_shares((r for _, r in lm.iterrows()), label) if on_gpu else []


def speedup_claim(pairs: list[tuple[dict, cl.Versus]], lm: pd.DataFrame) -> cl.Claim:
    """Verdicts of bf16 against fp32 counted per mode, the smallest and the largest size's forward+backward,
    and the host-bound rows."""
    fb = [f for keys, f in pairs if keys["mode"] == "forward+backward" and f.comparison is not None]
    ends = fb[:1] + fb[-1:] if len(fb) > 1 else fb
    on = measured_on(lm)
    grows = len(ends) == 2 and all(f.verdict == "faster" for f in ends) and \
        ends[1].comparison.ratio < ends[0].comparison.ratio
    because = ("Larger models spend a larger share of the step in matrix products, which bf16 runs on tensor cores, "
               "and less in elementwise kernels and the casts autocast adds." if on == "cuda" and grows else
               CPU_CAVEAT if on == "cpu" else "")
    return cl.Claim("How much faster is bf16 autocast?", [
        *(cl.Tally(f"{mode}, bf16 autocast against fp32", tuple(f for keys, f in pairs if keys["mode"] == mode))
          for _, mode in reversed(MODES)), *ends, *host_bound_findings(lm)], because)


def plot_speedup(pairs: list[tuple[dict, cl.Versus]], lm: pd.DataFrame, title: str):
    """Speedup (fp32 median / bf16 median) against parameters, one line per mode, the 95% intervals as bars and
    a line at 1 (no change). Returns the figure."""
    params = lm.groupby("size")["params"].max()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for _, mode in MODES:
        done = [(keys["size"], f.comparison) for keys, f in pairs if keys["mode"] == mode and f.comparison]
        x, y = [params[s] for s, _ in done], [1 / c.ratio for _, c in done]
        err = [[max(v - 1 / c.high, 0) if math.isfinite(c.high) else 0 for v, (_, c) in zip(y, done)],
               [max(1 / c.low - v, 0) if math.isfinite(c.low) and c.low > 0 else 0 for v, (_, c) in zip(y, done)]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=mode)
        for s, xv, yv in zip((s for s, _ in done), x, y):
            ax.annotate(str(s), (xv, yv), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set(xscale="log", xlabel="parameters", ylabel="speedup over fp32 (×)", title=title)
    ax.legend(title="mode")
    return fig


CPU_CAVEAT = ("On a CPU, whether bf16 autocast helps depends on the CPU's bf16 instructions and library kernels, and "
              "at toy sizes per-operator overhead and the casts autocast inserts weigh as much as the matmuls; none "
              "of it predicts a GPU, whose matmuls run bf16 on tensor cores.")


def show_device_caveat(on: str) -> None:
    """On a CPU render, a warning above the timings: what holds anywhere and what does not carry over."""
    if on == "cpu":
        report.warn("This render ran on a CPU with toy models. Its numerical results (accumulation, norm statistics) "
                    "hold anywhere and its autocast probe shows the CPU's rules; its timings do not carry over to GPUs "
                    "(see `reports/02_mixed_precision.ipynb`). On a CPU shared with other work a burst of load can "
                    "slow every sample of one configuration, which no interval from its own samples can reveal.")
