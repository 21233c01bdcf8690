"""Triton's FlashAttention against a reference on the grid of :mod:`lab.book.flash.bench` (notebook 05): speedups,
noise-aware comparisons and the performance goals, each from the measured spread (:mod:`lab.measure.verdicts`).

Rows compare only when timed alike (``timing``: both as CUDA-graph replays or both eagerly); a configuration
measured in two sweeps counts once (its last row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from lab.accounting.attention import PASSES
from lab.book.flash.bench import Shape
from lab.measure.verdicts import GoalCheck, compare_summaries, spread_covers_effect

#: The goals on the grid's shapes (:data:`lab.book.flash.bench.LM_SHAPES`), as speed ratios reference ms / triton ms
#: (the default SDPA backend, cuDNN on Hopper).
GOALS = {"fwd": 1.0, "bwd": 0.9, "e2e": 0.95}
#: Shapes with goals of their own instead (a pass not named has none): the 2.7B model's attention, whose
#: kernels are short enough that only forward + backward together is asked of it.
SHAPE_GOALS = {Shape(4, 32, 512, 80): {"e2e": 0.9}}

#: The goals against FlexAttention (compiled ``flex_attention``, a peer rather than the stock default): faster on
#: every shape, forward and backward.
FLEX_GOALS = {"fwd": 1.0, "bwd": 1.0}

CONFIG_KEY = ["dtype", "batch", "heads", "seq_len", "d", "causal"]


def add_speedups(df: pd.DataFrame, baselines: Sequence[str] = ("pytorch_naive", "sdpa")) -> pd.DataFrame:
    """Add ``{pass}_speedup_vs_{baseline}`` = baseline ms / this row's ms (medians) for the same configuration
    (> 1: this implementation is faster). NaN where either side has no time (e.g. out of memory) or the two
    were timed differently (``timing``: one as a CUDA-graph replay, the other eagerly)."""
    df = df.copy()
    timing = df["timing"] if "timing" in df.columns else pd.Series("", index=df.index)
    for base in baselines:
        ref = df[df["impl"] == base].assign(timing=timing).set_index(CONFIG_KEY)
        ref = ref[[f"{p}_ms" for p in PASSES] + ["timing"]].add_suffix("_ref")
        joined = df.assign(timing=timing).join(ref, on=CONFIG_KEY)
        alike = [_alike(a, b) for a, b in zip(joined["timing"], joined["timing_ref"])]
        for p in PASSES:
            df[f"{p}_speedup_vs_{base}"] = np.where(alike, joined[f"{p}_ms_ref"] / joined[f"{p}_ms"], math.nan)
    return df


def _alike(a, b) -> bool:
    """Two rows' ``timing`` allow a comparison: the same, or unrecorded (tables from before graph timing)."""
    missing = [t is None or t != t or t == "" for t in (a, b)]
    return any(missing) or a == b


def _by_config(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows indexed by configuration; a configuration measured twice (in two sweeps) keeps its last row."""
    return rows.drop_duplicates(CONFIG_KEY, keep="last").set_index(CONFIG_KEY)


def _comparison(mine: pd.Series, ref: pd.Series, p: str):
    """Time of ``mine`` against ``ref`` for pass ``p`` (compare_summaries of means; a row without a spread,
    e.g. one sample, gives an interval of infinities and the verdict "within noise")."""
    mean = mine.get(f"{p}_mean_ms", mine[f"{p}_ms"])
    ref_mean = ref.get(f"{p}_mean_ms", ref[f"{p}_ms"])
    return compare_summaries(mean, mine.get(f"{p}_std_ms", math.nan), int(mine.get(f"{p}_n", 0) or 0), ref_mean,
                             ref.get(f"{p}_std_ms", math.nan), int(ref.get(f"{p}_n", 0) or 0))


def versus(df: pd.DataFrame, impl: str = "triton", references: Sequence[str] = ("sdpa",),
           passes: Sequence[str] = PASSES) -> pd.DataFrame:
    """``impl`` against each reference on every configuration both measured: one row per (configuration,
    reference, pass) with both mean times, ``speedup`` = reference / impl (of the means, > 1: ``impl`` is
    faster), its 95% interval ``[low, high]`` and the verdict on ``impl``'s time (``"faster"``, ``"slower"``
    or ``"within noise"``, :func:`lab.measure.verdicts.compare_summaries`)."""
    ok = df[df["status"] == "ok"]
    mine = _by_config(ok[ok["impl"] == impl])
    rows = []
    for reference in references:
        ref = _by_config(ok[ok["impl"] == reference])
        for key in mine.index.intersection(ref.index):
            if not _alike(mine.loc[key].get("timing"), ref.loc[key].get("timing")):
                continue
            for p in passes:
                c = _comparison(mine.loc[key], ref.loc[key], p)
                rows.append({**dict(zip(CONFIG_KEY, key)), "reference": reference, "pass": p,
                             "ms": mine.loc[key].get(f"{p}_mean_ms", mine.loc[key][f"{p}_ms"]),
                             "reference_ms": ref.loc[key].get(f"{p}_mean_ms", ref.loc[key][f"{p}_ms"]),
                             "speedup": c.speedup, "low": 1 / c.high if c.high else math.inf,
                             "high": 1 / c.low if c.low > 0 else math.inf, "verdict": c.verdict})
    columns = CONFIG_KEY + ["reference", "pass", "ms", "reference_ms", "speedup", "low", "high", "verdict"]
    return pd.DataFrame(rows, columns=columns)


def flash_goals(df: pd.DataFrame, impl: str = "triton", reference: str = "sdpa",
                dtypes: Sequence[str] = ("bf16", "fp16"), min_heads: int = 16, goals: dict[str, float] = GOALS,
                shape_goals: dict[Shape, dict[str, float]] = SHAPE_GOALS) -> pd.DataFrame:
    """Per qualifying configuration (``dtype`` in ``dtypes``, batch x heads >= ``min_heads``; both ``impl``
    and ``reference`` measured, and timed alike): for fwd, bwd, e2e the speed ratio ``{p}_ratio`` = reference /
    impl (of the means), its 95% interval ``{p}_low``-``{p}_high``, the target ``{p}_target`` (``goals``, or the
    shape's own in ``shape_goals``), ``{p}_goal`` (``"met"`` when the whole interval is at or above the target,
    ``"missed"`` when it is wholly below, ``"undecided"`` when the target lies inside the noise (the interval,
    or either side's standard deviation around the time the target allows) or no spread was measured,
    ``"n/a"`` for a pass the shape's own goals leave out) and ``{p}_ok`` (True only when met). Empty when no
    configuration qualifies (e.g. the CPU quick book)."""
    sel = df[(df["dtype"].isin(dtypes)) & (df["batch"] * df["heads"] >= min_heads)]
    mine = _by_config(sel[(sel["impl"] == impl) & (sel["status"] == "ok")])
    ref = _by_config(sel[(sel["impl"] == reference) & (sel["status"] == "ok")])
    rows = []
    for key in mine.index.intersection(ref.index):
        if not _alike(mine.loc[key].get("timing"), ref.loc[key].get("timing")):
            continue
        row = {**dict(zip(CONFIG_KEY, key)), "reference": reference}
        targets = shape_goals.get(Shape.of(row), goals)
        for p in goals:
            c = _comparison(mine.loc[key], ref.loc[key], p)
            row.update({f"{p}_ratio": c.speedup, f"{p}_low": 1 / c.high if c.high else math.inf,
                        f"{p}_high": 1 / c.low if c.low > 0 else math.inf, f"{p}_target": targets.get(p, math.nan)})
            met = GoalCheck(c, 1 / targets[p]).met if p in targets else "n/a"  # time ratio <= 1/goal
            if met in (True, False) and _scatter_covers(mine.loc[key], ref.loc[key], p, targets[p]):
                met = None
            row.update({f"{p}_goal": {True: "met", False: "missed", None: "undecided"}.get(met, "n/a"),
                        f"{p}_ok": met is True})
        rows.append(row)
    columns = CONFIG_KEY + ["reference"] + [f"{p}_{c}" for p in goals
                                            for c in ("ratio", "low", "high", "target", "goal", "ok")]
    return pd.DataFrame(rows, columns=columns)


def _scatter_covers(mine: pd.Series, ref: pd.Series, p: str, target: float) -> bool:
    """:func:`lab.measure.verdicts.spread_covers_effect` for a target: Triton's mean time against the time the
    goal allows it (the reference's / target)."""
    mean, ref_mean = mine.get(f"{p}_mean_ms", mine[f"{p}_ms"]), ref.get(f"{p}_mean_ms", ref[f"{p}_ms"])
    return spread_covers_effect(mean, ref_mean / target, mine.get(f"{p}_std_ms", math.nan),
                                ref.get(f"{p}_std_ms", math.nan))


def summarize_goals(goals_table: pd.DataFrame, goals: dict[str, float] = GOALS) -> dict:
    """For each pass: the default target, configurations with a goal for it (``checked``), how many meet it,
    miss it or are undecided within the noise, and the configuration furthest below its own target (lowest
    ratio / target): its ratio (``worst``), target (``worst_target``) and configuration (``worst_config``, a dict
    of :data:`CONFIG_KEY`, or None). ``all_met``: every goal met on every configuration (False when none was
    checked)."""
    summary = {"configs": len(goals_table)}
    for p, target in goals.items():
        word = goals_table.get(f"{p}_goal", pd.Series(dtype=str))
        has = goals_table[word.isin(["met", "missed", "undecided"])] if len(goals_table) else goals_table
        gap = has[f"{p}_ratio"] / has.get(f"{p}_target", target) if len(has) else pd.Series(dtype=float)
        worst = has.loc[gap.idxmin()] if len(gap) and gap.notna().any() else None
        summary[p] = dict(target=target, checked=len(has), met=int((word == "met").sum()),
                          missed=int((word == "missed").sum()), undecided=int((word == "undecided").sum()),
                          worst=math.nan if worst is None else float(worst[f"{p}_ratio"]),
                          worst_target=math.nan if worst is None else float(worst.get(f"{p}_target", target)),
                          worst_config=None if worst is None else {k: worst[k] for k in CONFIG_KEY})
    checked = sum(summary[p]["checked"] for p in goals)
    summary["all_met"] = bool(checked) and all(summary[p]["met"] == summary[p]["checked"] for p in goals)
    return summary


