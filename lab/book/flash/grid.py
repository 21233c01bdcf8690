"""Notebook 05's FlashAttention grid, presented: latency and status tables, Triton's speedup over each
reference (table, heatmap, sentence), TFLOP/s, the performance goals and the fp32 sweep, all from the
``flash_benchmark`` rows of this render.

As in :mod:`lab.book.flash.present` (the settings, correctness, the course's timing test and the model), every
"faster"/"slower", "goal met"/"missed" comes from :mod:`lab.measure.verdicts` on the measured spread, and
times measured on the CPU (Triton interpreted) make no claim.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.accounting.attention import PASSES
from lab.book.flash import bench as fl
from lab.book.flash import goals as gl
from lab.book.flash.present import INTERPRETED_SHORT
from lab.book.report import fmt
from lab.measure.verdicts import label as verdict_label


def shape_label(batch: int, heads: int, seq: int, d: int, causal: bool) -> str:
    """``"1x16x16384 d64 causal"``: batch x heads x tokens, head dim, mask."""
    return f"{int(batch)}x{int(heads)}x{int(seq)} d{int(d)} {'causal' if bool(causal) else 'full'}"


def _labelled(df: pd.DataFrame) -> pd.DataFrame:
    return df.assign(shape=[shape_label(r.batch, r.heads, r.seq_len, r.d, r.causal) for r in df.itertuples()])


# ----------------------------------------------------------------------------------------------------------
# The grid: latency, status, speedups, TFLOP/s


def latency_table(bench: pd.DataFrame, sweep: str = "lm") -> pd.DataFrame:
    """One row per (shape, dtype), one column per implementation: ``"fwd / bwd / e2e"`` median ms, or the
    row's status (``skipped``, ``unsupported``, ``oom``); times from CUDA-graph replays end in ``(graph)``."""
    df = _labelled(bench[bench["sweep"] == sweep])
    if df.empty:
        return pd.DataFrame()
    graph = df["timing"].eq("graph") if "timing" in df.columns else pd.Series(False, index=df.index)
    cell = [f"{r.fwd_ms:.3g} / {r.bwd_ms:.3g} / {r.e2e_ms:.3g}{' (graph)' if g else ''}" if r.status == "ok"
            else r.status for r, g in zip(df.itertuples(), graph)]
    table = df.assign(cell=cell).pivot_table(index=["shape", "dtype"], columns="impl", values="cell",
                                             aggfunc="first", sort=False)
    return table[[i for i in dict.fromkeys(df["impl"]) if i in table.columns]].reset_index()


def status_table(bench: pd.DataFrame) -> pd.DataFrame:
    """The rows that did not run (skipped, unsupported, out of memory) with the reason."""
    df = _labelled(bench[bench["status"] != "ok"])
    return df[["sweep", "impl", "dtype", "shape", "status", "note"]].reset_index(drop=True)


def status_sentence(bench: pd.DataFrame) -> str:
    """How many configurations ran, and why the others did not (counted by implementation and status)."""
    ok = int((bench["status"] == "ok").sum())
    text = f"{ok} of {len(bench)} configurations ran."
    others = bench[bench["status"] != "ok"]
    if len(others):
        counts = others.groupby(["impl", "status"], sort=False).size()
        text += " The rest: " + "; ".join(f"{impl} {status} ×{n}" for (impl, status), n in counts.items()) + \
            " (the table gives each reason)."
    return text


def host_table(bench: pd.DataFrame, sweep: str = "lm") -> pd.DataFrame:
    """The CUDA-graph-timed shapes (``timing == "graph"``) of ``sweep``: per implementation the forward and
    forward+backward medians replayed from a graph (the device's time) and called eagerly (the host's launches
    included), and the host's share of the eager call (``1 - graph / eager``)."""
    cols = ["shape", "impl", "fwd_graph_ms", "fwd_eager_ms", "e2e_graph_ms", "e2e_eager_ms", "e2e_host_share"]
    if "timing" not in bench.columns:
        return pd.DataFrame(columns=cols)
    df = _labelled(bench[(bench["sweep"] == sweep) & (bench["timing"] == "graph") & (bench["status"] == "ok")])
    out = df.assign(fwd_graph_ms=df["fwd_ms"], e2e_graph_ms=df["e2e_ms"], e2e_host_share=1 - df["e2e_ms"] / df[
        "e2e_eager_ms"]) if len(df) else pd.DataFrame(columns=cols)
    return out[cols].reset_index(drop=True)


def host_sentence(table: pd.DataFrame, impl: str = "triton", reference: str = "sdpa") -> str:
    """How much longer ``impl``'s and ``reference``'s eager calls take than their graph replays on the
    graph-timed shapes (empty when none was graph-timed)."""
    parts = []
    for shape, g in table.groupby("shape", sort=False):
        r = g.set_index("impl")
        if not {impl, reference} <= set(r.index):
            continue
        mine, ref = r.loc[impl], r.loc[reference]
        parts.append(f"on {shape}, forward + backward took {impl} {fmt(mine['e2e_eager_ms'] * 1e3)} µs eagerly against "
                     f"{fmt(mine['e2e_graph_ms'] * 1e3)} µs replayed from a CUDA graph, {reference} "
                     f"{fmt(ref['e2e_eager_ms'] * 1e3)} against {fmt(ref['e2e_graph_ms'] * 1e3)} µs")
    if not parts:
        return ""
    return ("Timed eagerly, short shapes measure the host: " + "; ".join(parts) + ". The goals compare the replays "
            "(the kernels); under torch.compile the Triton kernels are launched by the compiled code itself "
            "(`FlashConfig.compile_inline`), which the 2.7B step below measures.")


def speedup_table(bench: pd.DataFrame, sweep: str = "lm", impl: str = "triton", references=None) -> pd.DataFrame:
    """:func:`lab.book.flash.goals.versus` of ``impl`` against each reference on one sweep (default: every other
    implementation measured), with a ``shape`` label: speedup = reference / impl (> 1: ``impl`` faster)."""
    df = bench[bench["sweep"] == sweep]
    references = references or [i for i in dict.fromkeys(df["impl"]) if i != impl]
    return _labelled(gl.versus(df, impl, references))


def speedup_display(speedups: pd.DataFrame, pass_: str = "e2e", interpreted_: bool = False) -> pd.DataFrame:
    """One pass of :func:`speedup_table`, one row per (shape, dtype), one column per reference:
    ``"1.23x faster"`` / ``"0.8x slower"`` / ``"0.98x ≈"`` (within noise); the bare ratio, with no verdict,
    for interpreted times."""
    df = speedups[speedups["pass"] == pass_]
    if df.empty:
        return pd.DataFrame()
    mark = {"faster": " faster", "slower": " slower", "within noise": " ≈", "no spread": " (1 sample)"}
    cell = [f"{r.speedup:.3g}x{'' if interpreted_ else mark.get(verdict_label(r.verdict, r.low, r.high), '')}"
            for r in df.itertuples()]
    table = df.assign(cell=cell).pivot_table(index=["shape", "dtype"], columns="reference", values="cell",
                                             aggfunc="first", sort=False)
    return table.reset_index()


def plot_speedup_heatmap(speedups: pd.DataFrame, impl: str = "triton", interpreted_: bool = False):
    """Heatmaps of ``impl``'s speedup over each reference (columns) per shape and dtype (rows), one panel
    per pass; colour on a log2 scale centred on 1, "≈" where within noise. Interpreted times are titled as
    meaningless for a GPU. Returns the figure (None if empty)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    if speedups.empty:
        return None
    passes = [p for p in PASSES if p in set(speedups["pass"])]
    height = 0.45 * speedups.groupby(["shape", "dtype"]).ngroups + 1.5
    fig, axes = plt.subplots(1, len(passes), figsize=(4.2 * len(passes), height), squeeze=False, sharey=True)
    for ax, p in zip(axes[0], passes):
        d = speedups[speedups["pass"] == p].assign(row=lambda x: x["shape"] + " " + x["dtype"])
        value = d.pivot_table(index="row", columns="reference", values="speedup", sort=False)
        marks = {"within noise": "≈", "no spread": "?"}
        noted = d.assign(text=[f"{s:.2g}" + marks.get(verdict_label(v, lo, hi), "") for s, v, lo, hi in
                               zip(d["speedup"], d["verdict"], d["low"], d["high"])])
        text = noted.pivot_table(index="row", columns="reference", values="text", aggfunc="first", sort=False)
        sns.heatmap(np.log2(value), annot=text.reindex_like(value), fmt="", cmap="RdBu", center=0, cbar=False,
                    ax=ax, annot_kws=dict(size=8))
        ax.set_title(f"{impl} {p} speedup{' (interpreted: not a GPU speed)' if interpreted_ else ''}")
        ax.set_xlabel("reference")
        ax.set_ylabel("")
    fig.tight_layout()
    return fig


def speed_sentence(speedups: pd.DataFrame, impl: str = "triton", pass_: str = "e2e", interpreted_: bool = False) -> str:
    """Against each reference: on how many (shape, dtype) ``impl`` is faster, slower or within noise
    (end to end by default) and the range of speedups; on the CPU, the interpreter caveat instead."""
    if interpreted_:
        return INTERPRETED_SHORT
    df = speedups[speedups["pass"] == pass_]
    if df.empty:
        return f"No configuration was measured for both {impl} and a reference."
    parts = []
    for ref, g in df.groupby("reference", sort=False):
        labels = [verdict_label(v, lo, hi) for v, lo, hi in zip(g["verdict"], g["low"], g["high"])]
        faster, slower, blind = (labels.count(w) for w in ("faster", "slower", "no spread"))
        if blind == len(g):  # nothing to count: every comparison rests on one sample
            parts.append(f"against {ref} no verdict, one sample (no spread) on {blind} of {len(g)} (speedup "
                         f"estimates {fmt(g['speedup'].min())}–{fmt(g['speedup'].max())}x)")
            continue
        unmeasured = f", one sample (no spread) on {blind}" if blind else ""
        parts.append(f"against {ref} faster on {faster}, slower on {slower}, within noise on "
                     f"{len(g) - faster - slower - blind}{unmeasured} of {len(g)} (speedup of the mean times "
                     f"{fmt(g['speedup'].min())}–{fmt(g['speedup'].max())}x)")
    name = {"e2e": "end to end (forward + backward)", "fwd": "forward", "bwd": "backward"}[pass_]
    return f"{impl.capitalize()}, {name}: " + "; ".join(parts) + "."


def tflops_table(bench: pd.DataFrame, sweep: str = "lm", pass_: str = "e2e") -> pd.DataFrame:
    """TFLOP/s of one pass (causal FLOPs counted pair by pair) per (shape, dtype) and implementation."""
    df = _labelled(bench[(bench["sweep"] == sweep) & (bench["status"] == "ok")])
    if df.empty:
        return pd.DataFrame()
    table = df.pivot_table(index=["shape", "dtype"], columns="impl", values=f"{pass_}_tflops", sort=False)
    return table.reset_index()


def tflops_sentence(bench: pd.DataFrame, impl: str = "triton", sweep: str = "lm", interpreted_: bool = False) -> str:
    """``impl``'s best forward, backward and end-to-end TFLOP/s per dtype, beside the best reference's."""
    df = bench[(bench["sweep"] == sweep) & (bench["status"] == "ok")]
    mine = df[df["impl"] == impl]
    if mine.empty:
        return f"{impl} has no measured configuration in this sweep."
    parts = []
    for dt, g in mine.groupby("dtype", sort=False):
        others = df[(df["dtype"] == dt) & (df["impl"] != impl)]
        best_other = (others.loc[others["e2e_tflops"].idxmax()] if len(others) and others["e2e_tflops"].notna().any()
                      else None)
        text = (f"in {dt}, {impl.capitalize()} reaches at best {fmt(g['fwd_tflops'].max())} TFLOP/s forward, "
                f"{fmt(g['bwd_tflops'].max())} backward and {fmt(g['e2e_tflops'].max())} end to end")
        if best_other is not None:
            text += f" (best other end to end: {best_other['impl']} {fmt(best_other['e2e_tflops'])})"
        parts.append(text)
    out = "; ".join(parts)
    out = out[0].upper() + out[1:] + ", each pass on its own best shape."
    return out + (" " + INTERPRETED_SHORT if interpreted_ else "")


# ----------------------------------------------------------------------------------------------------------
# The goals


GOAL_COLUMNS = ["shape", "dtype", "targets", "fwd_ratio", "fwd_goal", "bwd_ratio", "bwd_goal", "e2e_ratio", "e2e_goal"]


def goals_display(goals: pd.DataFrame) -> pd.DataFrame:
    """The goals table with a shape label and each shape's targets: speed ratio (SDPA ms / Triton ms) and
    met/missed/undecided (or n/a, a pass its shape has no goal for) per pass."""
    if goals.empty:
        return pd.DataFrame(columns=GOAL_COLUMNS)
    out = _labelled(goals)
    out["targets"] = [", ".join(f"{p} ≥ {r[f'{p}_target']:g}" for p in gl.GOALS
                                if f"{p}_target" in r and r[f"{p}_target"] == r[f"{p}_target"])
                      for _, r in out.iterrows()]
    return out[[c for c in GOAL_COLUMNS if c in out.columns]]


def goals_sentence(goals: pd.DataFrame, goal_targets: dict = gl.GOALS, interpreted_: bool = False,
                   reference: str = "the default SDPA backend") -> str:
    """The verdict on the goals (:func:`lab.book.flash.goals.flash_goals`' table) against ``reference``: all met,
    or for each pass how many configurations meet, miss or cannot be decided, and the shape furthest from its
    goal."""
    if interpreted_:
        return "The goals are about GPU speed; they are not evaluated on interpreted Triton. " + INTERPRETED_SHORT
    summary = gl.summarize_goals(goals, goal_targets)
    if summary["configs"] == 0:
        return ("No configuration qualifies for the performance goals here (they need bf16 or fp16 with batch × heads "
                f"≥ 16, measured for both Triton and {reference}), so they are not evaluated in this run.")
    n = summary["configs"]
    goals_text = ", ".join(f"{p} ≥ {t:g}x" for p, t in goal_targets.items())
    if summary["all_met"]:
        return (f"All goals met on all {n} configurations ({goals_text} {reference}'s speed, each "
                f"beyond the noise); the closest is {_worst_clause(summary, goal_targets)}.")
    parts = []
    for p, t in goal_targets.items():
        s = summary[p]
        parts.append(f"{p}: {s['met']} met, {s['missed']} missed, {s['undecided']} undecided of {s['checked']}")
    return (f"The goals ({goals_text} {reference}'s speed, where a shape has no goals of its own) do not all hold: "
            + "; ".join(parts) + f". Furthest from its goal: {_worst_clause(summary, goal_targets)}.")


def _worst_clause(summary: dict, goal_targets: dict) -> str:
    gaps = {p: summary[p]["worst"] / summary[p]["worst_target"] for p in goal_targets
            if math.isfinite(summary[p]["worst"])}
    if not gaps:
        return "n/a"
    p = min(gaps, key=gaps.get)
    c = summary[p]["worst_config"]
    label = shape_label(c["batch"], c["heads"], c["seq_len"], c["d"], c["causal"]) + f" {c['dtype']}"
    return (f"{p} on {label} at {fmt(summary[p]['worst'])}x against a goal of {summary[p]['worst_target']:g}x "
            f"({fmt(100 * abs(gaps[p] - 1), 2)}% {'above' if gaps[p] >= 1 else 'below'} it)")


def why_missed_table(goals: pd.DataFrame) -> pd.DataFrame:
    """The goals' speed ratios (SDPA ms / Triton ms) by head dimension and pass: median and range over the
    grid's shapes and dtypes, with the share of the forward tiles' columns that are the head's
    (``useful_columns``, the median of d / :func:`lab.book.flash.bench.kernel_columns`: below 1 where a head
    dimension that is not a power of two runs in one masked power-of-two tile, 1 where it is cut into two
    power-of-two chunks)."""
    rows = []
    for d, part in goals.groupby("d"):
        useful = [d / fl.kernel_columns(r, "fwd") for _, r in part.iterrows()]
        row = dict(d=int(d), shapes=len(part), useful_columns=float(np.median(useful)))
        for p in gl.GOALS:
            r = part[f"{p}_ratio"].dropna()
            row.update({f"{p}_median": r.median(), f"{p}_min": r.min(), f"{p}_max": r.max()})
        rows.append(row)
    return pd.DataFrame(rows)


def why_missed_sentence(goals: pd.DataFrame, interpreted_: bool = False) -> str:
    """Which passes and head dimensions hold the gap, read from :func:`why_missed_table`, with the two causes
    the kernels' structure accounts for: masked columns at head dimensions that are not powers of two, and the
    backward's 7 matrix products per tile pair (5 with atomic dQ) at equal efficiency 5/7."""
    if interpreted_ or goals.empty:
        return "The goals are about GPU speed; they are not examined on interpreted Triton or without rows."
    t = why_missed_table(goals).set_index("d")
    worst_pass = min(gl.GOALS, key=lambda p: t[f"{p}_median"].min() / gl.GOALS[p])
    worst_d = int(t[f"{worst_pass}_median"].idxmin())
    parts = [f"d {d}: forward {fmt(r.fwd_median)}x, backward {fmt(r.bwd_median)}x, end to end {fmt(r.e2e_median)}x"
             for d, r in t.iterrows()]
    text = (f"Median speed against SDPA by head dimension — {'; '.join(parts)}. Furthest from its goal: the "
            f"{ {'fwd': 'forward', 'bwd': 'backward', 'e2e': 'end to end'}[worst_pass] } at d {worst_d}.")
    powers = [d for d in t.index if d & (d - 1) == 0]
    power_fwd = fmt(goals[goals["d"].isin(powers)]["fwd_ratio"].median())  # over the shapes, not the dims' medians
    padded = t[t["useful_columns"] < 1]
    if len(padded):
        d = int(padded.index[0])
        if powers:
            share, width = fmt(100 * padded.loc[d, "useful_columns"], 3), 2 ** math.ceil(math.log2(d))
            text += (f" At d {d} only {share}% of each tile's columns are the head's (masked {width}-wide tiles), "
                     f"and its forward is {fmt(padded.loc[d, 'fwd_median'])}x against {power_fwd}x, the median "
                     f"of the power-of-two shapes.")
    split = [d for d in t.index if d not in powers and t.loc[d, "useful_columns"] == 1]
    if split and powers:
        d = int(split[0])
        text += (f" At d {d} the kernels compute no masked column (two power-of-two chunks), and its forward is "
                 f"{fmt(t.loc[d, 'fwd_median'])}x against {power_fwd}x, the median of the power-of-two shapes.")
    slower_bwd = (t["bwd_median"] < t["fwd_median"]).sum()
    text += (f" The backward trails the forward at {slower_bwd} of {len(t)} head dimensions: without atomics it "
             f"computes 7 matrix products per tile pair where a kernel that adds dQ atomically (FlashAttention-2's "
             f"and -3's design) computes 5, so at equal efficiency it would reach {fmt(5 / 7)}x.")
    return text


# ----------------------------------------------------------------------------------------------------------
# The fp32 sweep


def fp32_sentence(bench: pd.DataFrame, impl: str = "triton", sweep: str = "fp32", interpreted_: bool = False) -> str:
    """Is fp32 ``impl`` ever slower than naive PyTorch or SDPA in fp32? From the sweep's verdicts, per
    reference and pass: where it is slower beyond the noise (shapes listed for end to end)."""
    if interpreted_:
        return "Whether fp32 Triton is ever slower than naive PyTorch or SDPA is a GPU question. " + INTERPRETED_SHORT
    vs = speedup_table(bench, sweep, impl)
    if vs.empty:
        return f"No fp32 configuration was measured for both {impl} and a reference."
    names = {"fwd": "forward", "bwd": "backward", "e2e": "end-to-end"}
    parts = []
    for ref, g in vs.groupby("reference", sort=False):
        slower = g[g["verdict"] == "slower"]
        e2e = slower[slower["pass"] == "e2e"]
        counts = [f"{int((slower['pass'] == p).sum())} of {int((g['pass'] == p).sum())} {names[p]}" for p in PASSES]
        shapes = ", ".join(f"{r.shape} at {fmt(r.speedup, 2)}x its speed" for r in e2e.itertuples())
        where = f" (end to end on {shapes}, from the mean times)" if len(e2e) else ""
        parts.append(f"{impl} is slower than {ref} beyond the noise in {', '.join(counts[:-1])} and {counts[-1]} "
                     f"configurations{where}" if len(slower) else f"{impl} is never slower than {ref} beyond the noise")
    ever = (vs["verdict"] == "slower").any()
    return f"{'Yes' if ever else 'No'}: in fp32 (batch 1, one head), " + "; ".join(parts) + "."
