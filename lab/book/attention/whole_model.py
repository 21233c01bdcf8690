"""Notebook 04's whole model, eager against compiled: this render's ``lm_step`` rows measured size by size
(:func:`lab.bench.lm.compare_variants`), per size and mode the compiled median against the eager one under
the book's rule, as a table, a claim and a plot."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from lab.bench.lm import compare_variants
from lab.book.attention.present import measured
from lab.book.claims import Claim, Tally, Versus
from lab.book.ledger import LM_MODES


def lm_eager_vs_compiled(sizes: Sequence[str], attention: str = "sdpa", **kwargs) -> pd.DataFrame:
    """:func:`lab.bench.lm.compare_variants` of each size eagerly and under ``torch.compile(model)``, one right
    after the other in this process (``kwargs``: its context, batch, dtype, warmup, steps, device)."""
    variants = [dict(attention=attention), dict(attention=attention, compile=True)]
    return pd.concat([compare_variants(size, variants, **kwargs) for size in sizes], ignore_index=True)


def _pairs(lm: pd.DataFrame):
    """``(size, column stem, mode, eager row, compiled row)`` for every size measured both ways and every mode
    that ran on either side, or that a side out of memory lacks."""
    for size, g in lm.groupby("size", sort=False):
        eager, compiled = g[~g["compile"].astype(bool)], g[g["compile"].astype(bool)]
        if len(eager) and len(compiled):
            e, c, oom = eager.iloc[0], compiled.iloc[0], "oom" in set(g["status"])
            yield from ((size, m, mode, e, c) for m, mode in LM_MODES.items()
                        if f"{m}_ms" in g and (oom or pd.notna(e[f"{m}_ms"]) or pd.notna(c[f"{m}_ms"])))


def lm_versus(lm: pd.DataFrame) -> list[tuple[str, str, Versus]]:
    """``(size, mode, compiled against eager)`` for every size measured both ways and every mode that ran on
    either side (a side out of memory says so)."""
    return [(size, mode, Versus(measured(f"{size} {mode} compiled", c, f"{m}_ms"),
                                measured(f"{size} {mode} eager", e, f"{m}_ms"))) for size, m, mode, e, c in _pairs(lm)]


def lm_table(lm: pd.DataFrame) -> pd.DataFrame:
    """Per size and mode: both medians, the ratio compiled / eager with its interval, the verdict, both peaks."""
    return pd.DataFrame([dict(size=size, mode=mode, eager=v.reference.text(), compiled=v.subject.text(), **v.cells(),
                              eager_peak_gib=e.get(f"{m}_peak_gib", np.nan),
                              compiled_peak_gib=c.get(f"{m}_peak_gib", np.nan))
                         for (size, m, mode, e, c), (_, _, v) in zip(_pairs(lm), lm_versus(lm))])


def lm_claim(lm: pd.DataFrame) -> Claim:
    """Per size, the compiled train step (or the longest mode that ran) against eager; then every size and
    mode counted by verdict."""
    pairs = lm_versus(lm)
    headline = []
    for size in dict.fromkeys(s for s, _, _ in pairs):
        modes = {mode: v for s, mode, v in pairs if s == size}
        headline.append(next(modes[m] for m in ("train step", "forward+backward", "forward") if m in modes))
    findings = headline + [Tally("every size and mode, compiled against eager", tuple(v for _, _, v in pairs))]
    return Claim("How much does torch.compile speed up the whole model, size by size?", findings,
                 "" if pairs else "No size was measured both eagerly and compiled.")


def plot_lm_compile(lm: pd.DataFrame, title: str = "Whole model: compiled / eager median time"):
    """Bars of the ratio compiled / eager per size and mode with its 95% interval, a line at 1 (below it
    compiling helps); the figure, None when nothing ran both ways."""
    data = pd.DataFrame([dict(size=s, mode=mode, ratio=c.ratio, low=c.low, high=c.high)
                         for s, mode, v in lm_versus(lm) if (c := v.comparison) is not None])
    if data.empty:
        return None
    sizes, modes = list(dict.fromkeys(data["size"])), list(dict.fromkeys(data["mode"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(sizes) * len(modes)), 3.8))
    for i, mode in enumerate(modes):
        d = data[data["mode"] == mode].set_index("size").reindex(sizes)
        errors = [(e.replace([np.inf, -np.inf], np.nan).fillna(0).clip(lower=0)) for e in
                  (d["ratio"] - d["low"], d["high"] - d["ratio"])]
        ax.bar(np.arange(len(sizes)) + (i - (len(modes) - 1) / 2) * 0.8 / len(modes), d["ratio"], 0.8 / len(modes),
               label=mode, yerr=errors, capsize=3)
    ax.axhline(1, color="black", lw=1)
    ax.set(xticks=np.arange(len(sizes)), xticklabels=sizes, ylabel="compiled / eager", title=title)
    ax.legend()
    return fig
