"""Notebook 04's settings, and what it states about the naive attention grid (``attention_naive_grid``): which
configurations fit and how long they take, where the memory goes, how the saved memory scales with the length,
and what ``torch.compile`` does to the attention function. Each answer is a :class:`~lab.book.claims.Claim`
built from the grid's rows (medians, spreads and counts), so every verdict follows the book's one rule.
"""

from __future__ import annotations

import math

import pandas as pd
import seaborn as sns

from lab.accounting import attention as costs
from lab.book.claims import Claim, Measured, Observed, Tally, Value, Versus
from lab.units import GiB, MiB

#: Each profile's defaults of the knobs a notebook leaves None (:func:`lab.book.report.with_profile_defaults`):
#: the course's grid and every size on a GPU; seconds on a CPU, with five samples a side (the fewest a verdict
#: takes) and the whole model in fp32 (bf16 matmuls on a CPU say nothing and are slow).
FULL = dict(ds=(16, 32, 64, 128), seqs=(256, 1024, 4096, 8192, 16384), passes=100, warmup=5,
            lm_sizes=("small", "medium", "large", "xl", "2.7B", "10B"), lm_context=512, lm_dtype="bf16",
            lm_warmup=2, lm_steps=5)
QUICK = dict(ds=(16, 32), seqs=(64, 128), passes=5, warmup=1, lm_sizes=("tiny",), lm_context=64, lm_dtype="fp32",
             lm_warmup=1, lm_steps=5)


GRID_COLUMNS = ["d", "seq_len", "fwd_ms", "fwd_spread_ms", "fwd_n", "bwd_ms", "bwd_spread_ms", "mem_baseline_mib",
                "mem_before_bwd_mib", "peak_mib", "saved_mib", "predicted_saved_mib", "status", "oom_phase"]


def rows(grid: pd.DataFrame, compiled: bool = False) -> pd.DataFrame:
    """The grid's eager rows (or its compiled ones, none when it was measured eagerly only), in grid order."""
    return grid[grid["compile"].astype(bool) == compiled].reset_index(drop=True)


def grid_table(grid: pd.DataFrame) -> pd.DataFrame:
    """The columns of the grid a reader compares: median times with their spread (ms), memory (MiB)."""
    return grid[[c for c in GRID_COLUMNS if c in grid.columns]]


measured = Measured.from_row  # a part of a row: its median where it ran, out of memory where it did not


def _where(r) -> str:
    return f"d={int(r['d'])}, {int(r['seq_len'])} tokens"


def timed(r, pass_: str, what: str = "") -> Measured:
    """One pass (``fwd``, ``bwd``) of a grid row as a claim reads it."""
    return measured(f"{what or {'fwd': 'forward', 'bwd': 'backward'}[pass_]} at {_where(r)}", r, f"{pass_}_ms")


# ----------------------------------------------------------------------------------------------------------
# which configurations fit, and how long they take


def fit_and_time_claim(grid: pd.DataFrame) -> Claim:
    """How many configurations ran out of memory (the shortest length that did per d, the first one with the
    memory it had and the pass it was in), then at the longest length that ran: the backward against the
    forward at the largest d, and the forward at the largest d against the smallest beside their FLOP ratio."""
    oom = grid[grid["status"] == "oom"]
    findings = [Value(Measured.value("configurations measured", len(grid))),
                Value(Measured.value("out of memory", len(oom)))]
    if len(oom):
        first = oom.sort_values(["seq_len", "d"]).iloc[0]
        findings += [Value(Measured.out_of_memory(f"the first, {_where(first)}", first.get("limit_gib", math.nan))),
                     Observed("in the pass", str(first.get("oom_phase") or "unknown"))]
        findings += [Value(Measured.value(f"shortest length out of memory at d={int(d)}", g["seq_len"].min(),
                                          "tokens")) for d, g in oom.groupby("d")]
    ok = grid[(grid["status"] == "ok") & grid["fwd_ms"].notna() & grid["bwd_ms"].notna()]
    longest = ok[ok["seq_len"] == ok["seq_len"].max()].sort_values("d")
    because = "" if len(ok) else "No configuration ran."
    if len(longest):
        lo, hi = longest.iloc[0], longest.iloc[-1]
        findings.append(Versus(timed(hi, "bwd"), timed(hi, "fwd")))
    if len(longest) > 1:
        growth, flops = Versus(timed(hi, "fwd"), timed(lo, "fwd")), hi["d"] / lo["d"]
        findings += [growth, Value(Measured.value("the FLOP ratio of the two", flops, "x"))]
        because = _growth_because(growth, flops)
    return Claim("Which configurations fit, and how long do they take?", findings, because)


def _growth_because(growth: Versus, flops: float) -> str:
    """Why the forward time grew with d as it did (the verdict of ``growth`` and its ratio against ``flops``)."""
    c, scores = growth.comparison, "the seq × seq scores and softmax, whose traffic does not depend on d, dominate."
    if c is None or c.verdict == "not decided":
        return ""
    if c.verdict in ("within noise", "faster"):
        return ("A larger d leaves the forward time within noise: " + scores if c.verdict == "within noise" else
                "More work cannot take less time: the gap is the machine's load or a kernel choice, not d.")
    if c.ratio < flops / 2 or c.ratio <= 2 * flops:
        return ("The time grows far less than the FLOPs: " + scores if c.ratio < flops / 2 else
                "The time grows roughly in step with the FLOPs: the matrix products dominate.")
    return ("The time grows far more than the FLOPs, which no arithmetic explains: the two were timed under "
            "different conditions (the machine's load, caches, a kernel choice).")


# ----------------------------------------------------------------------------------------------------------
# memory accounting


def accounting_config(grid: pd.DataFrame) -> tuple[pd.Series, str]:
    """The configuration to account for: the smallest (by predicted peak memory) that ran out of memory,
    else the largest that fit. Returns ``(row, "oom" | "largest_fit")``."""
    oom = grid[grid["status"] == "oom"].sort_values("predicted_peak_mib")
    return (oom.iloc[0], "oom") if len(oom) else (grid.sort_values("predicted_peak_mib").iloc[-1], "largest_fit")


def memory_terms(row: pd.Series) -> pd.DataFrame:
    """:func:`lab.accounting.attention.naive_attention_memory` of one grid row, with a ``MiB`` column."""
    terms = costs.naive_attention_memory(int(row["batch"]), int(row["seq_len"]), int(row["d"]), row["dtype"],
                                         bool(row["causal"]))
    terms["MiB"] = terms["bytes"] / MiB
    return terms[["term", "formula", "when", "MiB"]]


def naive_memory_check(row: pd.Series) -> pd.DataFrame:
    """Predicted against measured memory (MiB) of one grid row: what autograd saved beyond the inputs
    (saved-tensor hooks, any device), what was allocated when the backward started and the peak (above the
    configuration's baseline, i.e. without cuBLAS's workspace; NaN on the CPU or when out of memory)."""
    base = row.get("mem_baseline_mib", math.nan)
    checks = [("saved for backward beyond q, k, v", row["predicted_saved_mib"], row["saved_mib"]),
              ("allocated when backward starts", row["predicted_before_bwd_mib"], row["mem_before_bwd_mib"] - base),
              ("peak (lower bound)", row["predicted_peak_mib"], row["peak_mib"] - base)]
    out = pd.DataFrame([dict(quantity=q, predicted_mib=p, measured_mib=m) for q, p, m in checks])
    out["measured_over_predicted"] = out["measured_mib"] / out["predicted_mib"]
    return out


def accounting_claim(grid: pd.DataFrame) -> Claim:
    """The accounted configuration (:func:`accounting_config`): the probability matrix alone, what should be
    allocated when the backward starts and the backward's peak, each measurement over its prediction, and,
    for an out-of-memory, the GPU's memory against the prediction."""
    row, kind = accounting_config(grid)
    b, seq, d, dtype = int(row["batch"]), int(row["seq_len"]), int(row["d"]), row["dtype"]
    which = "the smallest configuration that ran out of memory" if kind == "oom" else "the largest that fit"
    findings = [Observed("accounted for", f"{which} (batch {b}, {seq} tokens, d {d}, {dtype})")] + [
        Value(Measured.value(label, x, "B")) for label, x in (
            ("the probability matrix alone, batch × seq² × element size", b * seq * seq * costs.dtype_bytes(dtype)),
            ("predicted allocated when the backward starts", row["predicted_before_bwd_mib"] * MiB),
            ("predicted backward peak, at least", row["predicted_peak_mib"] * MiB))]
    check = naive_memory_check(row).dropna(subset=["measured_mib"])
    findings += [Value(Measured.value(f"{r.quantity}, measured over predicted", r.measured_over_predicted, "x"))
                 for r in check.itertuples()]
    because = "" if len(check) == 3 else "The CPU keeps no allocator statistics: only what autograd saved is measured."
    limit = row.get("limit_gib", math.nan)
    if kind == "oom" and math.isfinite(limit):
        findings.append(Value(Measured.value("the GPU's memory", limit * GiB, "B")))
        because = ("The predicted peak exceeds the GPU's memory: the score-sized tensors alone explain the "
                   "out-of-memory." if row["predicted_peak_mib"] / 1024 > limit else
                   "The predicted peak is below the GPU's memory: the rest of the shortfall is what the closed form "
                   "leaves out (allocator rounding and fragmentation, workspaces).")
    return Claim("Where does the memory go in the configuration that does not fit (or the largest that does)?",
                 findings, because)


# ----------------------------------------------------------------------------------------------------------
# how the saved memory scales


def saved_memory_scaling(grid: pd.DataFrame, column: str = "saved_mib") -> pd.DataFrame:
    """Per head dimension ``d``, the exponent ``p`` of ``column ~ seq^p`` fitted over the measured rows
    (``p_all``) and between the two longest measured lengths (``p_longest``)."""
    out = []
    for d, g in grid[grid["status"] == "ok"].groupby("d"):
        g = g.dropna(subset=[column]).sort_values("seq_len")
        if len(g) >= 2:
            out.append(dict(d=d, points=len(g), p_all=costs.fit_power_law(g["seq_len"], g[column])[0],
                            p_longest=costs.fit_power_law(g["seq_len"].iloc[-2:], g[column].iloc[-2:])[0]))
    return pd.DataFrame(out, columns=["d", "points", "p_all", "p_longest"])


def saved_memory_curves(grid: pd.DataFrame) -> pd.DataFrame:
    """Memory kept for backward, q, k and v included, per ``(d, seq_len)``: naive attention as measured
    (autograd's saved tensors) and FlashAttention from its closed form (Q, K, V, O and the logsumexp), in MiB."""
    out = []
    for r in grid.dropna(subset=["saved_mib"]).itertuples():
        inputs = 3 * r.batch * r.seq_len * r.d * costs.dtype_bytes(r.dtype) / MiB  # both methods keep q, k, v
        out.append(dict(d=r.d, seq_len=r.seq_len, method="naive (measured)", MiB=r.saved_mib + inputs))
        out.append(dict(d=r.d, seq_len=r.seq_len, method="FlashAttention (closed form)",
                        MiB=costs.flash_attention_saved_bytes(r.batch, r.seq_len, r.d, r.dtype) / MiB))
    return pd.DataFrame(out, columns=["d", "seq_len", "method", "MiB"])


def _extremes(label: str, values: pd.Series, unit: str = "") -> list[Value]:
    """The lowest and highest of ``values`` (one finding where they are equal)."""
    lo, hi = float(values.min()), float(values.max())
    if lo == hi:
        return [Value(Measured.value(label, lo, unit))]
    return [Value(Measured.value(f"{label}, lowest", lo, unit)), Value(Measured.value(f"{label}, highest", hi, unit))]


def scaling_claim(grid: pd.DataFrame) -> Claim:
    """The exponent of the saved memory against the length between the two longest lengths (over d), and at
    the longest length what naive attention keeps against what FlashAttention would."""
    question = "How does the saved memory scale with length, and what removes it?"
    scaling, curves = saved_memory_scaling(grid), saved_memory_curves(grid)
    if scaling.empty:
        return Claim(question, [], "Fewer than two lengths ran per head dimension: no exponent was fitted.")
    findings = _extremes("exponent p of saved memory ∝ seqᵖ between the two longest lengths", scaling["p_longest"])
    longest = curves[curves["seq_len"] == curves["seq_len"].max()]
    kept = longest.pivot_table(index="d", columns="method", values="MiB").dropna()
    if len(kept.columns) == 2 and len(kept):
        naive, flash = kept["naive (measured)"] * MiB, kept["FlashAttention (closed form)"] * MiB
        findings += _extremes("kept by naive attention at the longest length, q, k, v included", naive, "B")
        findings += _extremes("kept by FlashAttention (closed form)", flash, "B")
        findings += _extremes("naive over FlashAttention", naive / flash, "x")
    quadratic = scaling["p_longest"].between(1.9, 2.1).all()
    because = ("Quadratic for every d, since the probability matrix P has no d axis; FlashAttention never stores P "
               "and recomputes it from one logsumexp per query row." if quadratic else
               "Not yet quadratic at these lengths: the inputs, linear in the length, still weigh as much as P.")
    return Claim(question, findings, because)


# ----------------------------------------------------------------------------------------------------------
# eager against compiled: the attention function


def compile_pairs(grid: pd.DataFrame) -> list[tuple[pd.Series, pd.Series]]:
    """``(eager, compiled)`` rows of each configuration measured both ways, in grid order."""
    compiled = {(c["d"], c["seq_len"]): c for _, c in rows(grid, compiled=True).iterrows()}
    return [(e, compiled[k]) for _, e in rows(grid).iterrows() if (k := (e["d"], e["seq_len"])) in compiled]


def compile_versus(grid: pd.DataFrame, pass_: str) -> list[Versus]:
    """Per configuration, the compiled ``pass_`` against the eager one."""
    return [Versus(timed(c, pass_, "compiled"), timed(e, pass_, "eager")) for e, c in compile_pairs(grid)]


def compile_table(grid: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration measured both ways: per pass both medians, the ratio compiled / eager with
    its interval and the verdict; memory in use before the backward (above the baseline) both ways, and the
    compile time."""
    out = []
    for (e, c), f, b in zip(compile_pairs(grid), compile_versus(grid, "fwd"), compile_versus(grid, "bwd")):
        row = dict(d=int(e["d"]), seq_len=int(e["seq_len"]))
        for name, v in (("fwd", f), ("bwd", b)):
            row.update({f"{name}_eager": v.reference.text(), f"{name}_compiled": v.subject.text(),
                        **{f"{name}_{k}": x for k, x in v.cells().items()}})
        out.append(dict(row, mem_eager_mib=e["mem_before_bwd_mib"] - e["mem_baseline_mib"],
                        mem_compiled_mib=c["mem_before_bwd_mib"] - c["mem_baseline_mib"], compile_s=c["compile_s"]))
    return pd.DataFrame(out)


def compile_claim(grid: pd.DataFrame) -> Claim:
    """What compiling the attention function did: the compiled forward and backward against eager counted by
    verdict, the largest decided gain, the compile time; memory in use before the backward and saved for it,
    compiled over eager, and whether what the compiled graph saves is still quadratic."""
    question = "Does torch.compile speed up naive attention, and does it remove the seq² memory?"
    pairs = compile_pairs(grid)
    if not pairs:
        return Claim(question, [], "The grid was measured eagerly only (`compile_grid=False`).")
    forward = compile_versus(grid, "fwd")
    findings = [Tally("compiled forward against eager", tuple(forward)),
                Tally("compiled backward against eager", tuple(compile_versus(grid, "bwd")))]
    faster = [v for v in forward if v.verdict == "faster"]
    if faster:
        findings.append(max(faster, key=lambda v: v.comparison.speedup))
    table = compile_table(grid)
    if table["compile_s"].notna().any():
        findings.append(Value(Measured.value("compile time, every shape together", table["compile_s"].sum(), "s")))
    memory = (table["mem_compiled_mib"] / table["mem_eager_mib"]).dropna()
    if len(memory):
        findings += _extremes("memory in use before the backward, compiled over eager", memory, "x")
    saved = pd.Series([c["saved_mib"] / e["saved_mib"] for e, c in pairs]).dropna()
    scaling = saved_memory_scaling(rows(grid, compiled=True))
    because = ""
    if len(saved) and len(scaling):
        findings += _extremes("saved for the backward, compiled over eager", saved, "x")
        findings += _extremes("exponent of the compiled graph's saved memory", scaling["p_longest"])
        because = ("Fusing the scale, softmax and matrix products does not remove the seq × seq tensor kept for the "
                   "backward; only recomputing it (FlashAttention) does." if scaling["p_longest"].min() > 1.8 else
                   "The compiled graph no longer keeps a quadratic tensor.")
    newly = sum(e["status"] == "oom" and c["status"] == "ok" for e, c in pairs)
    if newly:
        findings.append(Value(Measured.value("configurations out of memory eagerly that fit compiled", newly)))
    return Claim(question, findings, because)


# ----------------------------------------------------------------------------------------------------------
# plots


def plot_saved_memory(curves: pd.DataFrame, title: str):
    """Log-log lines of :func:`saved_memory_curves`, one colour per d, one style per method; the figure."""
    if curves.empty:
        return None
    g = sns.relplot(data=curves, x="seq_len", y="MiB", hue="d", style="method", kind="line", markers=True,
                    palette="viridis", height=4, aspect=1.6)
    g.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="kept for backward incl. q, k, v (MiB)")
    g.figure.suptitle(title, y=1.03)
    return g.figure


def plot_compile_ratios(table: pd.DataFrame, title: str = "torch.compile: compiled / eager time (naive attention)"):
    """Bars of the compiled / eager ratio of the median times per length and d, forward and backward, with a
    line at 1 (below it compiling helps); the figure (None if empty)."""
    if table.empty:
        return None
    data = table.melt(id_vars=["d", "seq_len"], value_vars=["fwd_ratio", "bwd_ratio"], var_name="pass",
                      value_name="compiled / eager")
    g = sns.catplot(data=data, x="seq_len", y="compiled / eager", hue="d", col="pass", kind="bar", palette="viridis",
                    height=3.5, aspect=1.3)
    for ax in g.axes.flat:
        ax.axhline(1, color="black", lw=1)
    g.figure.suptitle(title, y=1.04)
    return g.figure
