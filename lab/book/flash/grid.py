"""Notebook 05's grid (``flash_benchmark``), presented: latency and status, Triton against each reference as
:class:`~lab.book.claims.Versus` findings (tables, heatmap, tallies), whether forward and backward timed apart
add up to forward + backward timed together, the host's share of a short sequence, TFLOP/s and the fp32 sweep.

Rows compare only when timed alike (``timing``: both replayed from CUDA graphs or both eager); a configuration
measured twice counts once (its last row).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.accounting.attention import PASSES
from lab.bench.attention_grid import Shape
from lab.book.claims import Claim, Finding, Measured, Tally, Value, Versus, number, verdict_table
from lab.measure.verdicts import NOT_DECIDED, WITHIN_NOISE

CONFIG_KEY = ["dtype", "batch", "heads", "seq_len", "d", "causal"]
PASS_NAMES = {"fwd": "forward", "bwd": "backward", "e2e": "forward + backward"}


def ran(bench: pd.DataFrame, sweep: str | None = "lm") -> pd.DataFrame:
    """The rows of ``sweep`` (None: all) that ran, one per implementation and configuration (the last)."""
    df = bench[(bench["status"] == "ok") & ((bench["sweep"] == sweep) if sweep else True)]
    return df.drop_duplicates(["impl", *CONFIG_KEY], keep="last")


def sampled(row, column: str) -> bool:
    """Whether ``row``'s timing ``column`` (``"e2e"``, ``"e2e_eager"``) has samples: a replay's backward, derived
    from two others, has none and decides no verdict."""
    n = row.get(f"{column}_n", 0)
    return bool(n == n and n and n > 0)


def _key(row) -> tuple:
    timing = row.get("timing")
    return (*(row[k] for k in CONFIG_KEY), timing if isinstance(timing, str) else "")


def versus(bench: pd.DataFrame, impl: str = "triton", references=None, passes=PASSES, sweep: str | None = "lm",
           goals=None) -> list[tuple[dict, Versus]]:
    """``impl`` against each reference (default: every other implementation that ran) on every configuration both
    ran, timed alike: ``(keys, Versus)`` pairs, keys ``shape``, ``dtype``, ``d``, ``reference_impl``, ``pass``. With
    ``goals(shape, pass)`` (a time ratio ``impl / reference`` to stay under, or None for no goal), only the
    passes with a goal, each Versus carrying it."""
    df = ran(bench, sweep)
    references = references or [i for i in dict.fromkeys(df["impl"]) if i != impl]
    mine = df[df["impl"] == impl]
    out = []
    for ref in references:
        theirs = {_key(r): r for _, r in df[df["impl"] == ref].iterrows()}
        for _, r in mine.iterrows():
            other, shape = theirs.get(_key(r)), Shape.of(r)
            for p in passes if other is not None else ():
                goal = goals(shape, p) if goals else None
                if (goals and goal is None) or not (sampled(r, p) and sampled(other, p)):
                    continue
                keys = {"shape": shape.label, "dtype": r["dtype"], "d": shape.d, "reference_impl": ref, "pass": p}
                out.append((keys, Versus(Measured.from_row(f"{impl} on {shape.label} {r['dtype']}, {PASS_NAMES[p]}",
                                                           r, f"{p}_ms"),
                                         Measured.from_row(ref, other, f"{p}_ms"), goal=goal)))
    return out


def comparison_table(pairs: list[tuple[dict, Versus]], pass_: str | None = None) -> pd.DataFrame:
    """The comparisons (of one pass, or all) as rows: keys, both medians, ratio, interval, verdict (and goal)."""
    return pd.DataFrame(verdict_table([(k, f) for k, f in pairs if pass_ in (None, k.get("pass"))]))


def tallies(pairs: list[tuple[dict, Versus]], passes=PASSES, label: str = "{impl} {pass_} against {against}"
            ) -> list[Tally]:
    """The comparisons counted by verdict (and goal), one :class:`Tally` per reference and pass."""
    groups: dict[tuple, list] = {}
    for k, f in pairs:
        if k["pass"] in passes:
            groups.setdefault((k["reference_impl"], k["pass"]), []).append(f)
    return [Tally(label.format(impl="Triton", pass_=PASS_NAMES[p], against=ref), tuple(fs))
            for (ref, p), fs in groups.items()]


# ----------------------------------------------------------------------------------------------------------
# Tables


def latency_table(bench: pd.DataFrame, sweep: str = "lm") -> pd.DataFrame:
    """One row per (shape, dtype, implementation): which kernels ran (``kernel`` the forward, ``bwd_kernel`` the
    backward), how it was timed, its status, each pass's median and spread (ms), and the fewest samples among its
    passes (``n``)."""
    df = bench[bench["sweep"] == sweep]
    out = df.assign(shape=[Shape.of(r).label for _, r in df.iterrows()],
                    n=df[[f"{p}_n" for p in PASSES]].min(axis=1))
    cols = ["shape", "dtype", "impl", "kernel", "bwd_kernel", "timing", "status",
            *[f"{p}_{c}" for p in PASSES for c in ("ms", "spread_ms")], "n"]
    return out[[c for c in cols if c in out.columns]].reset_index(drop=True)


def status_findings(bench: pd.DataFrame) -> list[Finding]:
    """How many configurations ran, and the others counted by implementation and status (their reasons are in the
    table of :func:`latency_table`'s rows that did not run)."""
    others = bench[bench["status"] != "ok"].groupby(["impl", "status"], sort=False).size()
    return [Value(Measured.value("configurations measured", int((bench["status"] == "ok").sum()))),
            Value(Measured.value("configurations in the grid", len(bench))),
            *[Value(Measured.value(f"rows of {impl} {status}", int(n))) for (impl, status), n in others.items()]]


def plot_speedup_heatmap(pairs: list[tuple[dict, Versus]], impl: str = "triton"):
    """Heatmaps of ``impl``'s speed (reference time / its time) against each reference (columns) per shape and
    dtype (rows), one panel per pass; colour on a log2 scale centred on 1, ``≈`` within noise, ``?`` not decided.
    Returns the figure (None without comparisons)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    cells = pd.DataFrame([dict(row=f"{k['shape']} {k['dtype']}", against=k["reference_impl"], pass_=k["pass"],
                               speed=1 / f.comparison.ratio, verdict=f.verdict) for k, f in pairs])
    if cells.empty:
        return None
    passes = [p for p in PASSES if p in set(cells["pass_"])]
    fig, axes = plt.subplots(1, len(passes), figsize=(4.2 * len(passes), 0.45 * cells["row"].nunique() + 1.5),
                             squeeze=False, sharey=True)
    marks = {WITHIN_NOISE: "≈", NOT_DECIDED: "?"}
    for ax, p in zip(axes[0], passes):
        d = cells[cells["pass_"] == p]
        value = d.pivot_table(index="row", columns="against", values="speed", sort=False)
        text = d.assign(text=[number(s, digits=2) + marks.get(v, "") for s, v in zip(d["speed"], d["verdict"])]
                        ).pivot_table(index="row", columns="against", values="text", aggfunc="first", sort=False)
        sns.heatmap(np.log2(value), annot=text.reindex_like(value), fmt="", cmap="RdBu", center=0, cbar=False, ax=ax,
                    annot_kws=dict(size=8))
        ax.set(title=f"{impl} {PASS_NAMES[p]}: reference time / its time", xlabel="reference", ylabel="")
    fig.tight_layout()
    return fig


def tflops_table(bench: pd.DataFrame, sweep: str = "lm", pass_: str = "e2e") -> pd.DataFrame:
    """TFLOP/s of one pass (causal FLOPs counted pair by pair) per (shape, dtype) and implementation."""
    df = ran(bench, sweep)
    df = df.assign(shape=[Shape.of(r).label for _, r in df.iterrows()])
    return df.pivot_table(index=["shape", "dtype"], columns="impl", values=f"{pass_}_tflops", sort=False).reset_index()


def host_table(bench: pd.DataFrame, sweep: str = "lm") -> pd.DataFrame:
    """The shapes replayed from CUDA graphs: per implementation the forward and forward + backward medians
    replayed (the device's time) and called eagerly (the host's launches included)."""
    cols = ["shape", "impl", "fwd_ms", "fwd_eager_ms", "e2e_ms", "e2e_eager_ms"]
    df = ran(bench, sweep)
    df = df[df["timing"] == "graph"] if "timing" in df.columns else df.iloc[:0]
    return df.assign(shape=[Shape.of(r).label for _, r in df.iterrows()]).reindex(columns=cols)


# ----------------------------------------------------------------------------------------------------------
# Claims


def speed_claim(pairs: list[tuple[dict, Versus]], because: str = "") -> Claim:
    """Triton end to end against each reference on the LM-like shapes, counted by verdict."""
    return Claim("How fast is the Triton kernel against SDPA's backends on LM-like shapes?",
                 tuple(tallies(pairs, ("e2e",))), because)


def parts_against_whole(bench: pd.DataFrame, sweep: str = "lm") -> list[tuple[dict, Versus]]:
    """Every eagerly timed row's forward and backward, timed apart and summed (medians added, spreads in
    quadrature, the fewer samples), against its forward + backward timed as one call."""
    df = ran(bench, sweep)
    out = []
    for _, r in df[df.get("timing", pd.Series("eager", index=df.index)).fillna("eager") == "eager"].iterrows():
        label = f"{r['impl']} on {Shape.of(r).label} {r['dtype']}: forward and backward timed apart, summed"
        summed = Measured.summarized(label, r["fwd_ms"] + r["bwd_ms"], math.hypot(r["fwd_spread_ms"],
                                                                                  r["bwd_spread_ms"]),
                                     min(r["fwd_n"], r["bwd_n"]))
        out.append(({"shape": Shape.of(r).label, "dtype": r["dtype"], "impl": r["impl"]},
                    Versus(summed, Measured.from_row("forward + backward in one call", r, "e2e_ms"))))
    return out


def parts_claim(pairs: list[tuple[dict, Versus]], impl: str = "triton") -> Claim:
    """Whether forward and backward timed apart add up to forward + backward timed together, for ``impl`` and for
    the other implementations."""
    mine = tuple(f for k, f in pairs if k["impl"] == impl)
    others = tuple(f for k, f in pairs if k["impl"] != impl)
    over = any(f.verdict == "slower" for f in mine)
    because = ("Where the sum is slower than the one call, the backward timed alone (on a retained forward graph) "
               "costs more than inside forward + backward, so its own comparisons overstate its time: the "
               "end-to-end ones are the measure of the two together." if over else "")
    return Claim("Do forward and backward timed apart add up to forward + backward timed together?",
                 (Tally(f"{impl}: the sum against the one call", mine),
                  Tally("the other implementations: the sum against the one call", others)), because)


def host_claim(bench: pd.DataFrame, impls=("triton", "sdpa"), sweep: str = "lm") -> Claim:
    """On the shapes replayed from CUDA graphs: each of ``impls``' forward + backward called eagerly against its
    replay."""
    df = ran(bench, sweep)
    df = df[(df["timing"] == "graph") & df["impl"].isin(impls)] if "timing" in df.columns else df.iloc[:0]
    df = df[[sampled(r, "e2e_eager") for _, r in df.iterrows()]]
    return Claim("How much of a short sequence's time is the host's?", tuple(
        Versus(Measured.from_row(f"{r['impl']} on {Shape.of(r).label} {r['dtype']}, forward + backward called "
                                 "eagerly", r, "e2e_eager_ms"),
               Measured.from_row("replayed from a CUDA graph", r, "e2e_ms"))
        for _, r in df.iterrows()), "Eagerly, short shapes time the host's launches; the grid compares the replays "
        "(the kernels). Under torch.compile the Triton kernels are launched by the compiled code itself "
        "(`FlashConfig.compile_inline`), which the 2.7B step below measures.")


def tflops_claim(bench: pd.DataFrame, because: str = "", impl: str = "triton", sweep: str = "lm") -> Claim:
    """Per dtype: ``impl``'s best forward, backward and end-to-end TFLOP/s (each on its own best shape), and the
    best end to end of any other implementation."""
    df = ran(bench, sweep)
    out = []
    for dt, g in df.groupby("dtype", sort=False):
        mine, others = g[g["impl"] == impl], g[g["impl"] != impl]
        out += [Value(Measured.value(f"{impl}'s best {PASS_NAMES[p]} in {dt}", mine[f"{p}_tflops"].max(), "TFLOP/s"))
                for p in PASSES if len(mine)]
        if len(others) and others["e2e_tflops"].notna().any():
            best = others.loc[others["e2e_tflops"].idxmax()]
            out.append(Value(Measured.value(f"the best other forward + backward in {dt} ({best['impl']})",
                                            best["e2e_tflops"], "TFLOP/s")))
    return Claim("How many TFLOP/s does each reach?", tuple(out), because)


def fp32_claim(pairs: list[tuple[dict, Versus]], because: str = "") -> Claim:
    """Is fp32 Triton ever slower than naive PyTorch or SDPA: its comparisons counted per reference and pass."""
    return Claim("Is fp32 Triton ever slower than naive PyTorch or SDPA?", tuple(tallies(pairs)), because)
