"""Notebook 04's settings, tables, plots and prose: naive attention, its memory, and ``torch.compile``.

Every sentence is built from the rows of this render's tables (``attention_naive_grid`` and ``lm_step``);
every "faster"/"slower" comes from :mod:`lab.measure.verdicts` on the measured spread (a claim only beyond
the noise).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import pandas as pd

from lab.accounting import attention as costs
from lab.book.attention import bench as ab
from lab.book.report import fmt, with_profile_defaults
from lab.measure.verdicts import compare_summaries, span

# ----------------------------------------------------------------------------------------------------------
# Settings: the parameters cell's knobs with each profile's defaults filled in


#: Head dims, lengths, passes and models of each profile: the course's grid on a GPU, a few seconds on a CPU.
FULL = dict(ds=(16, 32, 64, 128), seqs=(256, 1024, 4096, 8192, 16384), passes=100, warmup=5,
            lm_sizes=("small", "medium", "large", "xl", "2.7B", "10B"), lm_context=512, lm_dtype="bf16",
            lm_warmup=2, lm_steps=5)
QUICK = dict(ds=(16, 32), seqs=(64, 128), passes=3, warmup=1, lm_sizes=("tiny",), lm_context=64, lm_dtype="fp32",
             lm_warmup=1, lm_steps=3)


@dataclass(frozen=True)
class Settings:
    """Notebook 04's knobs after the profile's defaults are filled in (see :func:`settings`)."""

    quick: bool
    device: str
    ds: tuple
    seqs: tuple
    batch: int
    dtype: str
    causal: bool
    passes: int
    warmup: int
    compile_grid: bool
    lm_sizes: tuple
    lm_context: int
    lm_batch: int
    lm_dtype: str
    lm_warmup: int
    lm_steps: int

    @property
    def compile_modes(self) -> tuple[bool, ...]:
        """What the grid measures side by side: eager, and compiled when ``compile_grid``."""
        return (False, True) if self.compile_grid else (False,)

    def params(self) -> dict:
        """The knobs as a plain dict (the banner and the results' provenance)."""
        return asdict(self)


def settings(quick: bool, device, **knobs) -> Settings:
    """The notebook's :class:`Settings`: ``knobs`` as given, None filled from :data:`QUICK` or :data:`FULL`.
    On the CPU the quick profile's whole model runs in fp32 (bf16 matmuls on a CPU say nothing and are slow)."""
    return Settings(quick=quick, device=str(device), **with_profile_defaults(knobs, QUICK if quick else FULL))


# ----------------------------------------------------------------------------------------------------------
# The naive grid


GRID_COLUMNS = ["d", "seq_len", "fwd_ms", "fwd_std_ms", "bwd_ms", "bwd_std_ms", "mem_baseline_mib",
                "mem_before_bwd_mib", "peak_mib", "saved_mib", "predicted_saved_mib", "status"]


def eager_rows(grid: pd.DataFrame) -> pd.DataFrame:
    """The grid's eager rows (the ``compile`` column False), in grid order."""
    return grid[~grid["compile"].astype(bool)].reset_index(drop=True)


def compiled_rows(grid: pd.DataFrame) -> pd.DataFrame:
    """The grid's compiled rows (empty when the grid was measured eagerly only)."""
    return grid[grid["compile"].astype(bool)].reset_index(drop=True)


def grid_table(grid: pd.DataFrame) -> pd.DataFrame:
    """The columns of the grid a reader compares: times (ms) and memory (MiB), predicted beside measured."""
    return grid[[c for c in GRID_COLUMNS if c in grid.columns]]


def size_text(mib: float) -> str:
    """A memory size for prose: ``"512 MiB"`` below 1 GiB, ``"8 GiB"`` above, ``"n/a"`` for NaN."""
    if mib is None or not math.isfinite(mib):
        return "n/a"
    return f"{fmt(mib / 1024)} GiB" if mib >= 1024 else f"{fmt(mib)} MiB"


def _oom_phase(note) -> str:
    """``"out of memory in backward: ..."`` -> ``"backward"``."""
    text = str(note) if isinstance(note, str) else ""
    if text.startswith("out of memory in "):
        return text[len("out of memory in "):].split(":")[0]
    return "unknown"


def _device_name(grid: pd.DataFrame) -> str:
    gpu = grid["gpu"].iloc[0] if "gpu" in grid.columns and len(grid) else None
    return "this CPU" if gpu in (None, "cpu") or (isinstance(gpu, float) and math.isnan(gpu)) else str(gpu)


def fit_sentence(grid: pd.DataFrame) -> str:
    """Which configurations ran out of memory (the shortest that did, and from which length per d), or that
    all fit and where."""
    if grid.empty:
        return "The grid has no rows."
    oom = grid[grid["status"] == "oom"]
    b, dtype = int(grid["batch"].iloc[0]), grid["dtype"].iloc[0]
    if oom.empty:
        return (f"All {len(grid)} configurations fit on {_device_name(grid)} (longest: {int(grid['seq_len'].max())} "
                f"tokens, batch {b}, {dtype}).")
    first = oom.sort_values(["seq_len", "d"]).iloc[0]
    per_d = ", ".join(f"d={int(d)} from {int(g['seq_len'].min())}" for d, g in oom.groupby("d"))
    return (f"{len(oom)} of {len(grid)} configurations ran out of memory on {_device_name(grid)}; the shortest "
            f"sequence that did not fit is {int(first['seq_len'])} tokens (d={int(first['d'])}), in the "
            f"{_oom_phase(first['note'])} pass. By head dimension: {per_d} tokens.")


def _range(values: pd.Series, digits: int = 3) -> str:  # "10–12", or "10" when both ends print the same
    return span(values.min(), values.max(), lambda v: fmt(v, digits), "–")


def d_growth(grid: pd.DataFrame) -> dict | None:
    """The forward at the longest length, largest d against smallest: ``d_low``, ``d_high``, ``time_ratio`` (of
    means), ``flop_ratio`` (d_high / d_low) and ``verdict`` (``compare_summaries``). None below two d's."""
    ok = grid[grid["status"] == "ok"].dropna(subset=["fwd_ms", "bwd_ms"])
    longest = ok[ok["seq_len"] == ok["seq_len"].max()].sort_values("d") if len(ok) else ok
    if len(longest) < 2:
        return None
    lo, hi = longest.iloc[0], longest.iloc[-1]
    c = compare_summaries(*(r.get(k, math.nan) for r in (hi, lo) for k in ("fwd_ms", "fwd_std_ms", "passes")))
    return dict(d_low=int(lo["d"]), d_high=int(hi["d"]), time_ratio=float(hi["fwd_ms"] / lo["fwd_ms"]),
                flop_ratio=float(hi["d"] / lo["d"]), verdict=c.verdict)


def timing_sentence(grid: pd.DataFrame) -> str:
    """At the longest length that ran: forward and backward times over d, backward / forward, and how the
    forward time grows with d against the FLOPs, read only beyond the noise (:func:`d_growth`)."""
    ok = grid[grid["status"] == "ok"].dropna(subset=["fwd_ms", "bwd_ms"])
    if ok.empty:
        return "No configuration ran, so there are no times."
    longest = ok[ok["seq_len"] == ok["seq_len"].max()].sort_values("d")
    seq = int(longest["seq_len"].iloc[0])
    ds = ", ".join(str(int(d)) for d in longest["d"])
    text = (f"At {seq} tokens a forward pass takes {_range(longest['fwd_ms'])} ms "
            f"and a backward pass {_range(longest['bwd_ms'])} ms over d = {ds}: "
            f"the backward is {fmt((longest['bwd_ms'] / longest['fwd_ms']).median(), 2)}x the forward (median).")
    g = d_growth(grid)
    if g is None:
        return text
    step = f"Going from d={g['d_low']} to d={g['d_high']} (the FLOPs grow {fmt(g['flop_ratio'], 2)}x)"
    ratio, scores = fmt(g["time_ratio"], 2), ("the time goes mostly to the seq × seq scores and softmax, whose "
                                              "memory traffic does not depend on d")
    if g["verdict"] == "within noise":
        return text + f" {step} leaves the forward time within noise ({ratio}x): at this length {scores}."
    if g["verdict"] == "faster":
        return (text + f" {step} the forward measured faster ({ratio}x the time): more work cannot take less time, "
                "so this gap is the machine's load or a different kernel choice, not d.")
    if g["time_ratio"] < g["flop_ratio"] / 2:
        why = f"far less than the FLOPs: at this length {scores}"
    elif g["time_ratio"] <= 2 * g["flop_ratio"]:
        why = "roughly in step with the FLOPs: the matmuls dominate here"
    else:  # more than twice the extra work: something besides the arithmetic changed between the two
        why = ("far more than the FLOPs, which no change of arithmetic explains: the two were timed under "
               "different conditions (the machine's load, caches, a different kernel choice), not set by d")
    return text + f" {step} multiplies the forward time by {ratio}x, {why}."


# ----------------------------------------------------------------------------------------------------------
# Memory accounting


def memory_terms(row: pd.Series) -> pd.DataFrame:
    """:func:`lab.accounting.attention.naive_attention_memory` of one grid row, with a ``MiB`` column."""
    terms = costs.naive_attention_memory(int(row["batch"]), int(row["seq_len"]), int(row["d"]), row["dtype"],
                                      bool(row["causal"]))
    terms["MiB"] = terms["bytes"] / 2**20
    return terms[["term", "formula", "when", "MiB"]]


def accounting_sentence(row: pd.Series, kind: str, check: pd.DataFrame) -> str:
    """The accounted configuration in numbers: P alone, what should be allocated when backward starts, the
    backward's peak lower bound, the measurements against them and, for an out-of-memory, whether the
    prediction alone exceeds the GPU."""
    b, seq, d, dtype = int(row["batch"]), int(row["seq_len"]), int(row["d"]), row["dtype"]
    p_mib = b * seq * seq * costs.dtype_bytes(dtype) / 2**20
    what = ("the smallest configuration that ran out of memory" if kind == "oom"
            else "the largest configuration that fit")
    text = (f"For {what} (batch {b}, seq {seq}, d {d}, {dtype}) the probability matrix alone is {b} × {seq}² × "
            f"{costs.dtype_bytes(dtype)} B = {size_text(p_mib)}; when the backward starts "
            f"{size_text(row['predicted_before_bwd_mib'])} should be allocated and the backward's peak needs "
            f"at least {size_text(row['predicted_peak_mib'])}.")
    measured = check.dropna(subset=["measured_mib"])
    if len(measured):
        text += " Measured against predicted: " + "; ".join(
            f"{r.quantity}: {r.measured_mib:,.0f} MiB measured vs {r.predicted_mib:,.0f} MiB predicted "
            f"({r.measured_over_predicted:.3f}x)" for r in measured.itertuples()) + "."
    if len(measured) < len(check):
        text += " (This device has no allocator statistics, so only what autograd saved could be measured.)"
    total = row.get("gpu_memory_gib", math.nan)
    if kind == "oom" and total is not None and math.isfinite(total):
        need = row["predicted_peak_mib"] / 1024
        if need > total:
            text += (f" This GPU has {fmt(total)} GiB, so the predicted {fmt(need)} GiB cannot fit: the score-sized "
                     "tensors alone explain the out-of-memory.")
        else:
            text += (f" The predicted {fmt(need)} GiB is below this GPU's {fmt(total)} GiB: the rest of the shortfall "
                     "is what the closed form leaves out (allocator rounding and fragmentation, workspaces).")
    return text


# ----------------------------------------------------------------------------------------------------------
# How saved memory scales


def saved_memory_curves(grid: pd.DataFrame) -> pd.DataFrame:
    """Memory kept for backward, q, k and v included, per ``(d, seq_len)``: naive attention as measured
    (autograd's saved tensors) and FlashAttention from its closed form (Q, K, V, O and the logsumexp), in MiB."""
    rows = []
    for r in grid.dropna(subset=["saved_mib"]).itertuples():
        inputs = 3 * r.batch * r.seq_len * r.d * costs.dtype_bytes(r.dtype) / 2**20  # both methods keep q, k, v
        rows.append(dict(d=r.d, seq_len=r.seq_len, method="naive (measured)", MiB=r.saved_mib + inputs))
        rows.append(dict(d=r.d, seq_len=r.seq_len, method="FlashAttention (closed form)",
                         MiB=costs.flash_attention_saved_bytes(r.batch, r.seq_len, r.d, r.dtype) / 2**20))
    return pd.DataFrame(rows, columns=["d", "seq_len", "method", "MiB"])


def plot_saved_memory(curves: pd.DataFrame, title: str):
    """Log-log lines of :func:`saved_memory_curves`, one colour per d, one style per method; the figure."""
    import seaborn as sns

    if curves.empty:
        return None
    g = sns.relplot(data=curves, x="seq_len", y="MiB", hue="d", style="method", kind="line", markers=True,
                    palette="viridis", height=4, aspect=1.6)
    g.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="kept for backward incl. q, k, v (MiB)")
    g.figure.suptitle(title, y=1.03)
    return g.figure


def scaling_sentence(scaling: pd.DataFrame, curves: pd.DataFrame) -> str:
    """The fitted exponent of saved memory against length (all lengths and the two longest), and how much
    less FlashAttention would keep at the longest length."""
    if scaling.empty:
        return "Fewer than two lengths ran per head dimension, so no exponent could be fitted."
    p_last = scaling["p_longest"]
    quadratic = p_last.min() > 1.9 and p_last.max() < 2.1
    shape = "quadratic" if quadratic else f"not quadratic (exponent {fmt(p_last.min())})"
    exponents = span(scaling["p_all"].min(), scaling["p_all"].max(), lambda v: f"seq^{v:.2f}", "–")
    text = (f"Fitted over all lengths the saved memory grows as {exponents} across d; between the two longest "
            f"lengths the exponent is {span(p_last.min(), p_last.max(), lambda v: f'{v:.3f}', '–')}, i.e. {shape}, "
            "and the same for every d because P has no d axis.")
    longest = curves[curves["seq_len"] == curves["seq_len"].max()]
    big = longest.pivot_table(index="d", columns="method", values="MiB").dropna()
    if {"naive (measured)", "FlashAttention (closed form)"} <= set(big.columns) and len(big):
        naive, flash = big["naive (measured)"], big["FlashAttention (closed form)"]
        ratio = naive / flash
        text += (f" At {int(curves['seq_len'].max())} tokens naive attention keeps {_range(naive, 4)} "
                 f"MiB for the backward (q, k and v included); FlashAttention would keep {_range(flash, 4)} MiB, "
                 f"{_range(ratio)}x less, because it never stores P and recomputes it from "
                 "one logsumexp per query row.")
    return text


# ----------------------------------------------------------------------------------------------------------
# Eager against compiled: the attention function


COMPILE_COLUMNS = ["d", "seq_len", "fwd_ms_eager", "fwd_ms_compiled", "fwd_speedup", "fwd_verdict", "bwd_ms_eager",
                   "bwd_ms_compiled", "bwd_speedup", "bwd_verdict", "mem_above_baseline_mib_eager",
                   "mem_above_baseline_mib_compiled", "compile_s", "status_eager", "status_compiled"]


def compile_table(grid: pd.DataFrame) -> pd.DataFrame:
    """:func:`lab.book.attention.bench.eager_vs_compiled` of the grid's own eager and compiled rows (measured side
    by side in this render); empty when the grid was measured eagerly only."""
    compiled = compiled_rows(grid)
    if compiled.empty:
        return pd.DataFrame(columns=COMPILE_COLUMNS)
    return ab.eager_vs_compiled(eager_rows(grid), compiled)


def compile_display(versus: pd.DataFrame) -> pd.DataFrame:
    """The columns of :func:`compile_table` a reader compares (speedup > 1: compiled is faster)."""
    return versus[[c for c in COMPILE_COLUMNS if c in versus.columns]]


def _verdict_counts(verdicts: pd.Series) -> str:
    n = len(verdicts)
    faster, slower = int((verdicts == "faster").sum()), int((verdicts == "slower").sum())
    return (f"faster beyond the noise in {faster} of {n} configurations, slower in {slower}, within noise in "
            f"{n - faster - slower}")


def compile_sentence(versus: pd.DataFrame, grid: pd.DataFrame) -> str:
    """What compiling the attention function did, from this render's side-by-side rows: per pass how many
    configurations got faster or slower beyond the noise and the speedup range; the memory in use before
    backward and saved for it; whether the saved memory is still quadratic; the compile cost."""
    if versus.empty:
        return "The grid was measured eagerly only (`compile_grid=False`), so there is no compiled comparison."
    both = versus.dropna(subset=["fwd_speedup", "bwd_speedup"])
    if both.empty:
        return "No configuration ran both eagerly and compiled."
    parts = []
    for p, name in (("fwd", "forward"), ("bwd", "backward")):
        s = both[f"{p}_speedup"]
        parts.append(f"the compiled {name} is {_verdict_counts(both[f'{p}_verdict'])} (speedup estimates "
                     f"{_range(s)}x, median {fmt(s.median())}x)")
    text = "Measured side by side, " + "; ".join(parts) + ". Speedup = eager time / compiled time."
    wins = both[both["fwd_verdict"] == "faster"]
    if len(wins):
        best = wins.loc[wins["fwd_speedup"].idxmax()]
        text += (f" The forward gains most at seq {int(best['seq_len'])}, d {int(best['d'])} "
                 f"({fmt(best['fwd_speedup'])}x).")
    if "compile_s" in versus.columns and versus["compile_s"].notna().any():
        text += (f" Compiling cost {fmt(versus['compile_s'].sum())} s for {int(versus['compile_s'].notna().sum())} "
                 "shapes (the first forward+backward of each).")
    mem = versus.dropna(subset=["mem_above_baseline_mib_eager", "mem_above_baseline_mib_compiled"]) \
        if "mem_above_baseline_mib_eager" in versus.columns else versus.iloc[0:0]
    if len(mem):
        r = mem["mem_above_baseline_mib_compiled"] / mem["mem_above_baseline_mib_eager"]
        text += (" Memory in use before the backward (above the baseline), compiled over eager: "
                 f"{span(r.min(), r.max(), lambda v: f'{v:.3f}', '–')}x.")
    saved = versus.dropna(subset=["saved_mib_eager", "saved_mib_compiled"])
    scaling = ab.saved_memory_scaling(compiled_rows(grid))
    if len(saved) and len(scaling):
        r = saved["saved_mib_compiled"] / saved["saved_mib_eager"]
        quadratic = scaling["p_longest"].min() > 1.8
        growth = span(scaling["p_longest"].min(), scaling["p_longest"].max(), lambda v: f"seq^{v:.2f}", "–")
        ratio = span(r.min(), r.max(), lambda v: f"{v:.3f}", "–")
        why = ("fusing the scale, softmax and matmuls does not remove the seq × seq tensor kept for the backward; "
               "only recomputing it (FlashAttention) does." if quadratic
               else "the compiled graph no longer keeps a quadratic tensor.")
        text += (f" What the compiled graph saves for the backward is {ratio}x what eager saves, growing as "
                 f"{growth} between the two longest lengths: {why}")
    newly = versus[(versus["status_eager"] == "oom") & (versus["status_compiled"] == "ok")]
    if len(newly):
        text += f" {len(newly)} configuration(s) that ran out of memory eagerly fit once compiled."
    return text


def plot_compile_speedups(versus: pd.DataFrame, title: str = "torch.compile speedup over eager (naive attention)"):
    """Bars of the forward and backward speedups per length and d, a line at 1; the figure (None if empty)."""
    import seaborn as sns

    both = versus.dropna(subset=["fwd_speedup", "bwd_speedup"]) if len(versus) else versus
    if both.empty:
        return None
    data = both.melt(id_vars=["d", "seq_len"], value_vars=["fwd_speedup", "bwd_speedup"], var_name="pass",
                     value_name="speedup")
    g = sns.catplot(data=data, x="seq_len", y="speedup", hue="d", col="pass", kind="bar", palette="viridis",
                    height=3.5, aspect=1.3)
    for ax in g.axes.flat:
        ax.axhline(1, color="black", lw=1)
    g.figure.suptitle(title, y=1.04)
    return g.figure
