"""Render-time consistency: the same configuration measured by two notebooks must agree within its noise,
and a train step cannot be faster than its own forward+backward (nor that faster than its forward).

``lm_step.csv`` holds rows from several notebooks (its ``source`` column). Where two sources measured the
same configuration (size, context, batch, dtype, attention, compile, fused loss, world size) on the same
GPU, their times are compared with :func:`lab.measure.verdicts.compare_summaries` mode by mode. Each
notebook's spread is within one process, while the two were measured in different processes minutes apart,
which alone moves a GPU time by a percent or two (clocks, memory placement, cuBLAS's choice of algorithm).
So a difference beyond the noise *and* larger than ``RUN_TO_RUN`` (the ratio of the two times off 1 by more
than 5%) fails the render, as does a row whose modes are impossible beyond the noise (:func:`impossible_rows`):
:func:`consistency_report` raises :class:`InconsistentTimings` with a one-line reason naming the rows. Rows
measured on a CPU (``gpu`` ``cpu``: a shared host, whose times say nothing about GPUs) are warned about
instead. Smaller differences beyond the noise are counted in one sentence.
"""

from __future__ import annotations

import itertools

import pandas as pd

from lab.measure.verdicts import compare_summaries

#: What two rows must share to be compared: the configuration, the card and the way the modes were timed
#: (``timer``; rows that predate the column are compared only with each other).
CONFIG = ["size", "context", "batch", "dtype", "attention", "compile", "fused_loss", "world_size", "gpu", "timer"]
MODES = ("fwd", "fwdbwd", "step")
RUN_TO_RUN = 0.05


def disagreements(table: pd.DataFrame, config: list[str] = CONFIG, modes=MODES,
                  tolerance: float = RUN_TO_RUN) -> pd.DataFrame:
    """One row per (configuration, mode, pair of sources) whose times differ beyond the noise: the two
    sources, their mean times (ms), the ratio with its interval, and ``beyond_tolerance`` (the ratio lies
    outside [1/(1 + tolerance), 1 + tolerance]). Rows without a ``source``, a time, a standard
    deviation or a sample count are skipped (no spread, no claim)."""
    if "source" not in table.columns:
        return pd.DataFrame()
    keys = [c for c in config if c in table.columns]
    ok = table[table.get("status", "ok") == "ok"] if "status" in table.columns else table
    rows = []
    for key, group in ok.groupby(keys, dropna=False):
        if group["source"].nunique() < 2:
            continue
        for (_, a), (_, b) in itertools.combinations(group.iterrows(), 2):
            if a["source"] == b["source"]:
                continue
            for m in modes:
                need = [f"{m}_ms", f"{m}_std_ms"]
                if not all(c in group.columns for c in need) or a[need].isna().any() or b[need].isna().any():
                    continue
                n_a, n_b = int(a.get("steps", 0) or 0), int(b.get("steps", 0) or 0)
                c = compare_summaries(a[f"{m}_ms"], a[f"{m}_std_ms"], n_a, b[f"{m}_ms"], b[f"{m}_std_ms"], n_b)
                if c.decided:
                    rows.append({**dict(zip(keys, key)), "mode": m, "source_a": a["source"], "source_b": b["source"],
                                 "ms_a": a[f"{m}_ms"], "ms_b": b[f"{m}_ms"], "ratio": c.ratio, "low": c.low,
                                 "high": c.high,
                                 "beyond_tolerance": not 1 / (1 + tolerance) <= c.ratio <= 1 + tolerance})
    return pd.DataFrame(rows)


#: Pairs of modes (faster, slower) of one row: the second runs the first and more.
NESTED = (("fwd", "fwdbwd"), ("fwdbwd", "step"))


class InconsistentTimings(ValueError):
    """Timings that cannot all be right: the render stops rather than print them."""


def impossible_rows(table: pd.DataFrame, config: list[str] = CONFIG) -> pd.DataFrame:
    """One row per (table row, pair of :data:`NESTED` modes) where the mode that does more work is faster
    beyond the noise: a train step faster than its own forward+backward, or a forward+backward faster than
    its forward. Columns: the configuration, ``source``, ``faster`` and ``slower`` (the modes that should be
    in the other order), their mean times (ms), the ratio with its interval. Rows without both times, their
    standard deviations and a sample count (``steps``) are skipped."""
    keys = [c for c in [*config, "source"] if c in table.columns]
    ok = table[table["status"] == "ok"] if "status" in table.columns else table
    rows = []
    for _, r in ok.iterrows():
        for less, more in NESTED:
            need = [f"{less}_ms", f"{less}_std_ms", f"{more}_ms", f"{more}_std_ms"]
            if not all(c in r.index for c in need) or r[need].isna().any():
                continue
            n = int(r.get("steps", 0) or 0)
            c = compare_summaries(r[f"{more}_ms"], r[f"{more}_std_ms"], n, r[f"{less}_ms"], r[f"{less}_std_ms"], n)
            if c.verdict == "faster":
                rows.append({**{k: r[k] for k in keys}, "faster": more, "slower": less, "ms_faster": r[f"{more}_ms"],
                             "ms_slower": r[f"{less}_ms"], "ratio": c.ratio, "low": c.low, "high": c.high})
    return pd.DataFrame(rows)


def _on_cpu(rows: pd.DataFrame) -> pd.Series:
    if "gpu" not in rows.columns:
        return pd.Series(False, index=rows.index)
    return rows["gpu"].astype(str).str.lower().eq("cpu")


def _name(r) -> str:
    return (f"{r['size']}@{r['context']} ({r['dtype']}, {r['attention']}{', compiled' if r.get('compile') else ''}"
            f"{', fused loss' if r.get('fused_loss') else ''})")


def _involving(table: pd.DataFrame, notebook: str) -> pd.DataFrame:
    d = disagreements(table)
    return d if d.empty else d[(d["source_a"] == notebook) | (d["source_b"] == notebook)]


def consistency_report(table: pd.DataFrame, notebook: str) -> tuple[list[str], str]:
    """``notebook``'s rows checked: its own rows' modes (:func:`impossible_rows`) and its rows against the
    other notebooks' (:func:`disagreements` beyond noise and beyond ``RUN_TO_RUN``). Any such row measured on
    a GPU raises :class:`InconsistentTimings` (one line naming every such row); on a CPU each is a warning.
    Returns the warnings, one sentence each, and one sentence counting the differences beyond the noise but
    within ``RUN_TO_RUN`` ('' if none)."""
    own = table[table["source"] == notebook] if "source" in table.columns else table.iloc[:0]
    bad = impossible_rows(own)
    d = _involving(table, notebook)
    far = d[d["beyond_tolerance"]] if not d.empty else d
    gpu_bad = bad[~_on_cpu(bad)] if not bad.empty else bad
    gpu_far = far[~_on_cpu(far)] if not far.empty else far
    if len(gpu_bad) or len(gpu_far):
        reasons = [f"{_name(r)} in {r['source']}: {r['faster']} {r['ms_faster']:.4g} ms is faster than its own "
                   f"{r['slower']} {r['ms_slower']:.4g} ms (ratio {r['ratio']:.3g}, interval {r['low']:.3g}-"
                   f"{r['high']:.3g})" for _, r in gpu_bad.iterrows()]
        reasons += [f"{_name(r)} {r['mode']}: {r['ms_a']:.4g} ms in {r['source_a']} against {r['ms_b']:.4g} ms in "
                    f"{r['source_b']} (ratio {r['ratio']:.3g}, interval {r['low']:.3g}-{r['high']:.3g}, beyond "
                    f"the noise and the {RUN_TO_RUN:.0%} between runs)" for _, r in gpu_far.iterrows()]
        raise InconsistentTimings("inconsistent timings in lm_step: " + "; ".join(reasons))
    warnings = [f"{_name(r)} in {r['source']} (on a CPU): {r['faster']} {r['ms_faster']:.4g} ms is faster than "
                f"its own {r['slower']} {r['ms_slower']:.4g} ms beyond the noise." for _, r in bad.iterrows()]
    return warnings + _warnings(d), _small_differences(d, notebook)


def _warnings(d: pd.DataFrame) -> list[str]:
    if d.empty:
        return []
    d = d[d["beyond_tolerance"]]
    return [f"{r['size']} at context {r['context']} ({r['dtype']}, {r['attention']}"
            f"{', compiled' if r.get('compile') else ''}): {r['mode']} took {r['ms_a']:.4g} ms in {r['source_a']} "
            f"and {r['ms_b']:.4g} ms in {r['source_b']} (ratio {r['ratio']:.3g}, interval {r['low']:.3g}-"
            f"{r['high']:.3g}): the two notebooks disagree beyond their noise and beyond the "
            f"{RUN_TO_RUN:.0%} that separate runs differ by." for _, r in d.iterrows()]


def _small_differences(d: pd.DataFrame, notebook: str) -> str:
    if d.empty or d["beyond_tolerance"].all():
        return ""
    small = d[~d["beyond_tolerance"]]
    worst = (small["ratio"].where(small["ratio"] >= 1, 1 / small["ratio"]) - 1).max()
    others = sorted((set(small["source_a"]) | set(small["source_b"])) - {notebook})
    return (f"{len(small)} more time{'s' if len(small) > 1 else ''} measured again in {', '.join(others)} "
            f"differ{'s' if len(small) == 1 else ''} beyond the within-run noise, by at most {worst:.1%}: no more "
            f"than the {RUN_TO_RUN:.0%} by which separate processes differ, so not counted as disagreement.")
