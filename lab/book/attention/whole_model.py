"""Notebook 04's whole model, eager against compiled: per size and mode the speedup of ``torch.compile`` with
its interval, the table, one sentence and one plot, from this render's ``lm_step`` rows (a claim only beyond
the noise, :mod:`lab.measure.verdicts`)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.book.report import fmt
from lab.measure.verdicts import compare_summaries

LM_MODES = {"fwd": "forward", "fwdbwd": "forward+backward", "step": "train step"}


def lm_compile_speedups(lm: pd.DataFrame) -> pd.DataFrame:
    """Per size and mode, this render's compiled row against its eager row (measured one after the other):
    both mean times, ``speedup`` = eager / compiled with its 95% interval (``compare_summaries`` over the
    timed steps), the verdict on the compiled time, and both peaks (GiB). A mode that did not run on one
    side is a row with ``verdict`` saying which side has no time."""
    rows = []
    for size, g in lm.groupby("size", sort=False):
        eager, compiled = g[~g["compile"].astype(bool)], g[g["compile"].astype(bool)]
        if eager.empty or compiled.empty:
            continue
        e, c = eager.iloc[0], compiled.iloc[0]
        for m, mode in LM_MODES.items():
            if f"{m}_ms" not in g.columns or (pd.isna(e[f"{m}_ms"]) and pd.isna(c[f"{m}_ms"])):
                continue
            row = dict(size=size, mode=mode, eager_ms=e[f"{m}_ms"], compiled_ms=c[f"{m}_ms"], speedup=math.nan,
                       low=math.nan, high=math.nan, verdict="", eager_peak_gib=e.get(f"{m}_peak_gib", math.nan),
                       compiled_peak_gib=c.get(f"{m}_peak_gib", math.nan))
            if pd.isna(e[f"{m}_ms"]) or pd.isna(c[f"{m}_ms"]):
                row["verdict"] = "eager did not run" if pd.isna(e[f"{m}_ms"]) else "compiled did not run"
            else:
                cmp = compare_summaries(c[f"{m}_ms"], c[f"{m}_std_ms"], int(c["steps"]), e[f"{m}_ms"],
                                        e[f"{m}_std_ms"], int(e["steps"]))
                row.update(speedup=cmp.speedup, low=1 / cmp.high if cmp.high else math.inf,
                           high=1 / cmp.low if cmp.low > 0 else math.inf, verdict=cmp.verdict)
            rows.append(row)
    return pd.DataFrame(rows, columns=["size", "mode", "eager_ms", "compiled_ms", "speedup", "low", "high", "verdict",
                                       "eager_peak_gib", "compiled_peak_gib"])


def lm_table(lm: pd.DataFrame) -> pd.DataFrame:
    """The ``lm_step`` columns a reader compares (``error`` says which mode ran out of memory)."""
    cols = ["size", "compile", "fwd_ms", "fwdbwd_ms", "step_ms", "fwd_peak_gib", "fwdbwd_peak_gib", "step_peak_gib",
            "status", "error"]
    return lm[[c for c in cols if c in lm.columns]]


def lm_compile_sentence(speedups: pd.DataFrame, lm: pd.DataFrame) -> str:
    """Size by size, what compiling the whole model did to the train step (or the longest mode that ran
    both ways), with verdicts; which sizes did not fit."""
    if lm.empty:
        return "No model was measured."
    r0 = lm.iloc[0]
    where = f"context {int(r0['context'])}, batch {int(r0['batch'])}, {r0['dtype']}"
    decided = speedups[speedups["verdict"].isin(["faster", "slower", "within noise"])]
    clauses = []
    for size, g in decided.groupby("size", sort=False):
        g = g.set_index("mode")
        mode = next(m for m in ("train step", "forward+backward", "forward") if m in g.index)
        r = g.loc[mode]
        verdict = {"faster": "faster", "slower": "slower", "within noise": "within noise of eager"}[r["verdict"]]
        clauses.append(f"{size} {mode} {fmt(r['eager_ms'])} → {fmt(r['compiled_ms'])} ms ({fmt(r['speedup'])}x, "
                       f"interval {fmt(r['low'])}–{fmt(r['high'])}: compiled {verdict})")
    text = (f"Whole model ({where}), eager and compiled measured one after the other: " + "; ".join(clauses) + "."
            if clauses else f"No size ran both eagerly and compiled ({where}).")
    if len(decided):
        n, faster = len(decided), int((decided["verdict"] == "faster").sum())
        slower = int((decided["verdict"] == "slower").sum())
        text += (f" Over every size and mode that ran both ways, compiling is faster beyond the noise in {faster} of "
                 f"{n} and slower in {slower}.")
    failed = lm[lm["status"] != "ok"]
    if len(failed):
        text += " Did not fit (every mode or some): " + ", ".join(
            f"{r['size']}{' compiled' if bool(r['compile']) else ' eager'}" for _, r in failed.iterrows()) + \
            " (see `error` in the table; the modes that fit keep their numbers)."
    return text


def plot_lm_compile(speedups: pd.DataFrame, title: str = "Whole-model torch.compile speedup (eager / compiled)"):
    """Bars of the speedup per size and mode with the 95% interval as error bars, a line at 1; the figure."""
    import matplotlib.pyplot as plt

    data = speedups.dropna(subset=["speedup"])
    if data.empty:
        return None
    sizes, modes = list(dict.fromkeys(data["size"])), list(dict.fromkeys(data["mode"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(sizes) * len(modes) / 2), 3.8))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        d = data[data["mode"] == mode].set_index("size").reindex(sizes)
        x = np.arange(len(sizes)) + (i - (len(modes) - 1) / 2) * width
        low = (d["speedup"] - d["low"]).clip(lower=0).fillna(0).replace(np.inf, 0)
        high = (d["high"] - d["speedup"]).clip(lower=0).fillna(0).replace(np.inf, 0)
        ax.bar(x, d["speedup"], width, label=mode, yerr=[low, high], capsize=3)
    ax.axhline(1, color="black", lw=1)
    ax.set_xticks(np.arange(len(sizes)), sizes)
    ax.set_ylabel("speedup (eager / compiled)")
    ax.set_title(title)
    ax.legend()
    return fig
