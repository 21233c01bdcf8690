"""What the 03 memory notebook says and plots about its result tables: the residual stream, the phase peaks
of the timelines, the largest allocations, peak memory by context and dtype, what a block saves for the
backward, gradients per block and activation checkpointing. The timelines drawn from snapshot pickles and
the snapshot pages are :mod:`lab.book.memory.snapshot_pages`.

Every sentence is generated from a table (measured now or replayed from ``results/``), so it stays true on
another machine. ``setup`` arguments are a :class:`lab.book.memory.workload.MemorySetup` (only its sizes are
read).
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from lab.book.memory.snapshot_pages import phase_label
from lab.measure.memory_timeline import format_bytes
from lab.units import GiB, MiB

# ----------------------------------------------------------------------------------------------------------
# the residual stream and the timelines


def residual_sentence(residual: pd.DataFrame, setup, context: int | None = None) -> str:
    """The residual stream's size at ``context`` (default: the checkpointing context), derived in words."""
    context = context or setup.checkpoint_context
    row = residual.set_index("context").loc[context]
    b = row["residual_bytes"]
    exact = "" if format_bytes(b) == f"{b / MiB:,.4g} MiB" else f" ({b / MiB:,.4g} MiB)"
    return (f"For the {setup.size} model (d_model {int(row['d_model'])}) at batch {int(row['batch'])} and context "
            f"{context}, one residual-stream activation is {int(row['batch'])} × {context} × {int(row['d_model'])} × "
            f"4 bytes = **{format_bytes(b)}**{exact}; the {int(row['num_layers'])} block inputs "
            f"alone are {format_bytes(b * row['num_layers'])}.")


def _phases(phases: pd.DataFrame, recording: str) -> pd.DataFrame:
    return phases[phases["recording"] == recording].set_index("phase")


def timeline_sentences(phases: pd.DataFrame, parameter_bytes: float) -> str:
    """Which phase each peak of the forward and train-step recordings is in, what the forward builds up,
    and where AdamW's state appears (against 2 x ``parameter_bytes``), from the phase table of
    :meth:`lab.book.memory.bench.MemoryExperiment.record_timelines`."""
    out = []
    fwd = _phases(phases, "forward")
    if "forward 1" in fwd.index:
        f = fwd.loc["forward 1"]
        out.append(f"The forward pass alone peaks at **{format_bytes(f['peak_gib'] * GiB)}** in its own phase "
                   f"(`forward 1`), having built up {format_bytes((f['end_gib'] - f['start_gib']) * GiB)} of "
                   f"activations saved for the backward on top of the "
                   f"{format_bytes(f['start_gib'] * GiB)} that existed before it.")
    st = _phases(phases, "train_step")
    if not st.empty:
        def g(phase: str, col: str) -> float:
            return st.loc[phase, col] * GiB if phase in st.index else math.nan

        top = st["peak_gib"].idxmax()
        out.append(f"In the two training steps the highest peak is in **{phase_label(top)}** "
                   f"({format_bytes(g(top, 'peak_gib'))}).")
        if {"forward 1", "backward 1", "optimizer_step 1"} <= set(st.index):
            state = g("optimizer_step 1", "end_gib") - g("forward 1", "start_gib")
            out.append(f"In step 1 the backward peaks at {format_bytes(g('backward 1', 'peak_gib'))} (forward "
                       f"{format_bytes(g('forward 1', 'peak_gib'))}) as it frees activations while it allocates "
                       f"gradients. After the first optimizer step (and `zero_grad`), memory is "
                       f"{format_bytes(state)} above where step 1 started: AdamW's state, created on first use "
                       f"(two moments, expected {format_bytes(2 * parameter_bytes)}, 2 × the parameters).")
        if {"forward 2", "backward 2", "optimizer_step 2"} <= set(st.index):
            second = g("optimizer_step 2", "end_gib") - g("optimizer_step 1", "end_gib")
            out.append(f"After step 2 memory is {format_bytes(abs(second))} "
                       f"{'higher' if second >= 0 else 'lower'} than after step 1, and step 2's peaks (forward "
                       f"{format_bytes(g('forward 2', 'peak_gib'))}, backward "
                       f"{format_bytes(g('backward 2', 'peak_gib'))}) "
                       f"are {format_bytes(g('backward 2', 'peak_gib') - g('backward 1', 'peak_gib'))} above step 1's "
                       "backward: the optimizer state now lives through the whole step.")
    return " ".join(out)


def timeline_answer(phases: pd.DataFrame) -> str:
    """One line: the phase of each recording's highest peak."""
    parts = []
    for recording, label in (("forward", "a forward pass peaks"), ("train_step", "two AdamW steps peak")):
        r = _phases(phases, recording)
        if not r.empty:
            top = r["peak_gib"].idxmax()
            parts.append(f"{label} in `{phase_label(top)}` at {format_bytes(r.loc[top, 'peak_gib'] * GiB)}")
    return "; ".join(parts) + "." if parts else "no timeline was recorded."


def phase_peaks_display(phases: pd.DataFrame, recording: str) -> pd.DataFrame:
    """The phase table of one recording, for display (phase, peak, start and end GiB)."""
    r = phases[phases["recording"] == recording]
    return r.assign(phase=r["phase"].map(phase_label))[["phase", "peak_gib", "start_gib", "end_gib"]]


# ----------------------------------------------------------------------------------------------------------
# largest allocations


def largest_allocations_sentence(largest: pd.DataFrame, origins: pd.DataFrame, setup,
                                 context: int | None = None) -> str:
    """The largest forward allocation and the top origin, next to the logits and one FFN hidden activation."""
    if largest.empty:
        return "The forward recording holds no allocation."
    context = context or setup.timeline_context
    cfg = setup.model
    logits = setup.batch * context * cfg.vocab_size * 4
    ffn = setup.batch * context * cfg.d_ff * 4
    top = largest.iloc[0]
    o = origins.iloc[0]
    return (f"The largest forward allocation (context {context}) is {top['size_mib']:,.4g} MiB, from "
            f"`{top['origin']}`. For comparison, at this context the logits are batch × context × vocab × 4 bytes = "
            f"{logits / MiB:,.4g} MiB and one FFN hidden activation batch × context × d_ff × 4 bytes = "
            f"{ffn / MiB:,.4g} MiB ({cfg.d_ff / cfg.d_model:.3g}× the residual stream at the same context). By "
            f"origin, `{o['origin']}` allocates the most in the forward pass: {int(o['count'])} "
            f"allocations, {o['total_mib']:,.4g} MiB in all ({o['share']:.0%} of the forward's allocations).")


def largest_allocations_answer(largest: pd.DataFrame, origins: pd.DataFrame) -> str:
    if largest.empty:
        return "no allocation was recorded."
    return (f"{largest['size_mib'].iloc[0]:,.4g} MiB from `{largest['origin'].iloc[0]}`; the line that allocates "
            f"the most in all is `{origins['origin'].iloc[0]}` ({origins['share'].iloc[0]:.0%}).")


# ----------------------------------------------------------------------------------------------------------
# peak memory by context and dtype


def peak_pivot(peaks: pd.DataFrame) -> pd.DataFrame:
    """Peak memory (GiB, 4 significant digits, ``OOM`` where it did not fit) by mode and context x dtype."""
    cell = np.where(peaks["status"] == "ok", peaks["peak_gib"].map(lambda v: f"{v:.4g}"), "OOM")
    table = peaks.assign(peak=cell).pivot_table(index=["mode", "context"], columns="dtype", values="peak",
                                                aggfunc="first")
    table.columns.name = None
    return table.reset_index()


def _bf16_changes(peaks: pd.DataFrame) -> pd.DataFrame:
    ok = peaks[peaks["status"] == "ok"].pivot_table(index=["mode", "context"], columns="dtype", values="peak_gib")
    if not {"fp32", "bf16"} <= set(ok.columns):
        return pd.DataFrame()
    both = ok.dropna(subset=["fp32", "bf16"])
    return both.assign(change=both["bf16"] / both["fp32"] - 1)


def mixed_precision_sentence(peaks: pd.DataFrame) -> str:
    """How bf16 autocast changes peak memory (fp32 vs bf16 rows of the peak table) and what in the step does
    not shrink; plus any out-of-memory rows."""
    both = _bf16_changes(peaks)
    out = []
    if not both.empty:
        lines = []
        for mode, label in (("forward", "the forward pass"), ("train_step", "a training step")):
            if mode not in both.index.get_level_values(0):
                continue
            m = both.loc[mode]
            parts = [f"{m.loc[c, 'change']:+.1%} at context {c} ({m.loc[c, 'fp32']:.3g} → {m.loc[c, 'bf16']:.3g} GiB)"
                     for c in sorted({m.index.min(), m.index.max()})]
            lines.append(f"{label}: " + ", ".join(parts))
        changes = both["change"]
        # steady: the saving never shrinks from one context to the next (the change never rises)
        grows = all(g["change"].is_monotonic_decreasing for _, g in both.groupby(level=0))
        out.append(
            "bf16 autocast changes peak memory by "
            + (f"{changes.min():+.1%}" if f"{changes.min():+.1%}" == f"{changes.max():+.1%}"
               else f"between {changes.min():+.1%} and {changes.max():+.1%}") + " — "
            + "; ".join(lines) + ". Far from halving it: autocast saves the matmul outputs for the backward in "
            "bf16, but parameters, gradients and AdamW's two moments stay fp32, autocast keeps a bf16 copy of "
            "every weight while the forward runs, and the norms, softmax and loss still make fp32 tensors. "
            + ("The saving grows with the context length, i.e. with the activations' share of memory"
               if grows else "Here the saving does not grow steadily with the context length")
            + (", and where activations are small the weight copies make bf16 use *more* memory."
               if changes.max() > 0 else "."))
    oom = peaks[peaks["status"] != "ok"]
    if len(oom):
        out.append("Out of memory: " + ", ".join(f"{r.mode} at context {r.context} in {r.dtype}"
                                                 for r in oom.itertuples()) + ".")
    return " ".join(out) or "No configuration has both an fp32 and a bf16 measurement."


def mixed_precision_answer(peaks: pd.DataFrame) -> str:
    both = _bf16_changes(peaks)
    if both.empty:
        return "not measured (no fp32/bf16 pair fits)."
    lo, hi = both["change"].idxmin(), both["change"].idxmax()
    return (f"by {both.loc[lo, 'change']:+.1%} ({lo[0]}, context {lo[1]}) to "
            f"{both.loc[hi, 'change']:+.1%} ({hi[0]}, context {hi[1]}), far from halving it: activations shrink but "
            "the fp32 state, the bf16 weight copies and the fp32 norms/softmax/loss do not.")


# ----------------------------------------------------------------------------------------------------------
# saved tensors


def block_saved_sentence(ops: pd.DataFrame, top: int = 5) -> str:
    """What one block saves (total, as a multiple of its fp32 input) and the ``top`` largest operations,
    from :meth:`lab.book.memory.bench.MemoryExperiment.block_saved_by_op`."""
    total = ops["bytes"].sum()
    first = ops.iloc[0]
    head = ops.head(top)
    return (f"One block at batch {int(first['batch'])}, context {int(first['context'])} ({first['dtype']}) saves "
            f"**{format_bytes(total)}** for the backward ({total / first['input_bytes']:.1f}× its input). The "
            f"{len(head)} largest contributors: "
            + ", ".join(f"`{r.op}` {format_bytes(r.bytes)} ({r.share:.0%})" for r in head.itertuples())
            + f" — together {head['share'].sum():.0%}.")


def rmsnorm_sentence(norm: pd.DataFrame) -> str:
    """Eager vs compiled RMSNorm: what each saves, from
    :meth:`~lab.book.memory.bench.MemoryExperiment.rmsnorm_saved`."""
    n = norm.set_index("rmsnorm")
    eager = (f"Eager RMSNorm saves {format_bytes(n.loc['eager', 'saved_bytes'])} "
             f"({n.loc['eager', 'saved_inputs']:.2f}× its input)")
    if "compiled" not in n.index:
        return eager + "; the compiled variant was not measured (`compile_rmsnorm=False`)."
    c = n.loc["compiled"]
    verdict = ("fusion keeps the input and the per-row statistic and recomputes the normalised activations in "
               "the backward" if c["saved_bytes"] < n.loc["eager", "saved_bytes"]
               else "compiling does not reduce what it saves here")
    return (eager + f"; compiled, {format_bytes(c['saved_bytes'])} ({c['saved_inputs']:.2f}×): " + verdict + ".")


def saved_tensors_answer(ops: pd.DataFrame, norm: pd.DataFrame) -> str:
    n = norm.set_index("rmsnorm")
    total = ops["bytes"].sum()
    text = (f"{format_bytes(total)} per block ({total / ops['input_bytes'].iloc[0]:.1f}× its input), "
            f"{ops['share'].iloc[0]:.0%} of it from `{ops['op'].iloc[0]}`")
    if "compiled" in n.index:
        text += (f"; RMSNorm saves {n.loc['eager', 'saved_inputs']:.2f}× its input eager and "
                 f"{n.loc['compiled', 'saved_inputs']:.2f}× compiled")
    return text + "."


# ----------------------------------------------------------------------------------------------------------
# gradients per block


def gradients_figure(grads: pd.DataFrame):
    """Bar chart of each block's gradient memory read off the backward timeline, with the expectation."""
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.bar(grads["block"], grads["measured_mib"], label="measured (survives the backward)")
    ax.plot(grads["block"], grads["expected_mib"], "k_", markersize=14, label="expected: parameter bytes")
    ax.set_xlabel("block")
    ax.set_ylabel("gradient memory (MiB)")
    ax.set_title("Gradient memory per block, from the backward timeline")
    ax.legend(loc="lower right")
    return fig


def gradients_sentence(grads: pd.DataFrame, embedding_bytes: float) -> str:
    """Inner blocks' measured vs expected gradient memory; block 0's extra against the embedding's gradient."""
    inner = grads[grads["block"] > 0]
    b0 = grads[grads["block"] == 0].iloc[0]
    extra = b0["measured_bytes"] - b0["expected_bytes"]
    text = ""
    if len(inner):
        text = (f"Blocks 1–{int(inner['block'].max())} each leave {inner['measured_mib'].median():,.4g} MiB of "
                f"gradients (min {inner['measured_mib'].min():,.4g}, max {inner['measured_mib'].max():,.4g}) against "
                f"{inner['expected_mib'].median():,.4g} MiB expected from their parameters (median ratio "
                f"{inner['ratio'].median():.3f}); ")
    return text + (f"block 0 leaves {b0['measured_mib']:,.4g} MiB, {extra / MiB:,.4g} MiB more than its parameters: "
                   f"its window also computes the embedding's gradient ({embedding_bytes / MiB:,.4g} MiB).")


def gradients_answer(grads: pd.DataFrame) -> str:
    inner = grads[grads["block"] > 0]
    sel = inner if len(inner) else grads
    return (f"{sel['measured_mib'].median():,.4g} MiB per block, {sel['ratio'].median():.3f}× its parameter bytes "
            "(one fp32 gradient per parameter).")


# ----------------------------------------------------------------------------------------------------------
# activation checkpointing


def checkpoint_model_sentence(model: pd.DataFrame, num_blocks: int, context: int) -> str:
    """The modelled optimum of single-level checkpointing and the modelled nested strategy."""
    r, a, k_star = model["boundary_bytes"].iloc[0], model["block_bytes"].iloc[0], model["k_star"].iloc[0]
    single = model[model["strategy"] == "single"]
    best = single.loc[single["modelled_bytes"].idxmin()]
    none = model.loc[model["strategy"] == "none", "modelled_bytes"].item()
    nested = model.loc[model["strategy"] == "nested"].iloc[0]
    return (f"With r = {format_bytes(r)} and A = {format_bytes(a)} per block at context {context}, the optimum is "
            f"k* = √(N·r/A) = {k_star:.2f}, so among divisors of N = {num_blocks} the model predicts "
            f"k = {int(best['group_size'])} ({format_bytes(best['modelled_bytes'])} of activations, vs "
            f"{format_bytes(none)} without checkpointing). Nested checkpointing is the memory-optimal strategy: "
            f"{format_bytes(nested['modelled_bytes'])}, for {nested['extra_forwards']:.3g} extra forwards per block "
            f"on average instead of 1.")


def checkpoint_figure(sweep: pd.DataFrame, title: str | None = None):
    """Measured (and modelled) peak of a training step against the single-level group size, with the
    no-checkpointing and nested peaks as horizontal lines."""
    single = sweep[(sweep["strategy"] == "single") & (sweep["status"] == "ok")].sort_values("group_size")
    fig, ax = plt.subplots()
    ax.plot(single["group_size"], single["peak_gib"], "o-", label="measured peak")
    if "modelled_peak_gib" in single:
        ax.plot(single["group_size"], single["modelled_peak_gib"], "s--", label="model: 4×params + (N/k)·r + k·A")
    others = sweep[sweep["strategy"].isin(["none", "nested"]) & (sweep["status"] == "ok")]
    for row in others.itertuples():
        ax.axhline(row.peak_gib, linestyle=":", color="grey")
        ax.text(single["group_size"].max() if len(single) else 1, row.peak_gib, f" {row.strategy}", va="bottom",
                ha="right", fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("blocks per checkpointed group (k)")
    ax.set_ylabel("peak memory of a train step (GiB)")
    if title:
        ax.set_title(title)
    ax.legend()
    return fig


def _describe(row) -> str:
    if row["status"] != "ok":
        return f"k = {int(row['group_size'])}: out of memory"
    return f"k = {int(row['group_size'])}: {format_bytes(row['peak_gib'] * GiB)} ({row['step_ms'] / 1e3:.3g} s)"


def best_group(sweep: pd.DataFrame) -> dict:
    """The measured best single-level group size and its neighbours (the next smaller and larger sizes
    measured, whether they fit or not): ``best``, ``smaller``, ``larger`` rows (None where there is none)."""
    single = sweep[sweep["strategy"] == "single"].sort_values("group_size").reset_index(drop=True)
    ok = single[single["status"] == "ok"]
    if ok.empty:
        return dict(best=None, smaller=None, larger=None)
    i = int(ok["peak_gib"].idxmin())
    return dict(best=single.iloc[i], smaller=single.iloc[i - 1] if i > 0 else None,
                larger=single.iloc[i + 1] if i + 1 < len(single) else None)


def checkpoint_sentence(sweep: pd.DataFrame, parameter_bytes: float, tolerance: float = 0.02) -> str:
    """The measured best single-level group size against its neighbours, no checkpointing and nested."""
    b = best_group(sweep)
    best = b["best"]
    if best is None:
        return "No single-level checkpointing configuration fit in memory."
    neighbours = [_describe(b[k]) for k in ("smaller", "larger") if b[k] is not None]
    out = [f"The best single-level group size is **k = {int(best['group_size'])}**, peaking at "
           f"**{format_bytes(best['peak_gib'] * GiB)}** ({best['step_ms'] / 1e3:.3g} s per step); "
           + ("its neighbours: " + "; ".join(neighbours) if neighbours else "no other group size was measured")
           + "."]
    for strategy, label in (("none", "Without checkpointing the step"),
                            ("nested", "With nested checkpointing the step")):
        rows = sweep[sweep["strategy"] == strategy]
        if rows.empty:
            continue
        r = rows.iloc[0]
        if r["status"] != "ok":
            out.append(f"{label} does not fit (out of memory).")
            continue
        out.append(f"{label} peaks at {format_bytes(r['peak_gib'] * GiB)} ({r['step_ms'] / 1e3:.3g} s, "
                   f"{r['step_ms'] / best['step_ms']:.2f}× the time of k = {int(best['group_size'])}).")
        if strategy == "nested" and abs(r["peak_gib"] / best["peak_gib"] - 1) <= tolerance:
            out.append(f"Nesting saves no measurable memory over k = {int(best['group_size'])} (within "
                       f"{tolerance:.0%}): {format_bytes(4 * parameter_bytes)} of that peak are parameters, "
                       "gradients and AdamW's moments, which no checkpointing shrinks.")
    return " ".join(out)


def checkpoint_answer(sweep: pd.DataFrame) -> str:
    b = best_group(sweep)
    if b["best"] is None:
        return "no single-level configuration fit."
    best = b["best"]
    nested = sweep[(sweep["strategy"] == "nested") & (sweep["status"] == "ok")]
    neighbours = [_describe(b[k]) for k in ("smaller", "larger") if b[k] is not None]
    text = (f"nested checkpoints are memory-optimal in the model (O(log N) boundaries); measured, the best single "
            f"level is k = {int(best['group_size'])} at {format_bytes(best['peak_gib'] * GiB)}"
            + (" (neighbours " + ", ".join(neighbours) + ")" if neighbours else ""))
    if len(nested):
        text += f"; nested peaks at {format_bytes(nested['peak_gib'].iloc[0] * GiB)}"
    return text + "."
