"""What the 03 memory notebook states (as :class:`~lab.book.claims.Claim` of its tables' numbers) and draws: the
residual stream, the timelines' phases, the snapshot pages, the largest allocations, gradients per block, peak
memory by context and dtype (and its ledger entries), saved tensors, and activation checkpointing.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from urllib.parse import urlparse

import matplotlib.pyplot as plt
import pandas as pd

from lab.book.claims import Claim, Measured, Observed, Share, Value, Versus
from lab.book.ledger import entry
from lab.book.report import say
from lab.measure.memory_pages import phase_label
from lab.measure.memory_snapshot import load_marks, load_snapshot
from lab.measure.memory_timeline import plot_active_memory_timeline
from lab.measure.verdicts import summarize
from lab.units import GiB, MiB


def value(label: str, x: float, unit: str = "B") -> Value:
    """A computed or once-measured quantity as a finding: bytes (written in KiB, MiB or GiB) by default."""
    return Value(Measured.value(label, x, unit))


def residual_claim(residual: pd.DataFrame, setup) -> Claim:
    """The residual stream's size at the checkpointing context, and of all the block inputs together."""
    r = residual.set_index("context").loc[setup.checkpoint_context]
    return Claim("How large is the residual stream?", [
        value(f"one residual-stream activation of the {setup.size} model, batch {int(r['batch'])} × context "
             f"{setup.checkpoint_context} × d_model {int(r['d_model'])} × 4 bytes", r["residual_bytes"]),
        value(f"the {int(r['num_layers'])} block inputs", r["residual_bytes"] * r["num_layers"])])


def _phases(phases: pd.DataFrame, recording: str) -> pd.DataFrame:
    return phases[phases["recording"] == recording].set_index("phase")


def phase_peaks_display(phases: pd.DataFrame, recording: str) -> pd.DataFrame:
    """The phase table of one recording, for display (phase, peak, start and end GiB)."""
    r = phases[phases["recording"] == recording]
    return r.assign(phase=r["phase"].map(phase_label))[["phase", "peak_gib", "start_gib", "end_gib"]]


def timeline_claim(phases: pd.DataFrame) -> Claim:
    """The phase of each recording's highest peak, and that peak."""
    findings = []
    for recording, label in (("forward", "a forward pass peaks in"), ("train_step", "two AdamW steps peak in")):
        r = _phases(phases, recording)
        if len(r):
            top = r["peak_gib"].idxmax()
            findings += [Observed(label, f"`{phase_label(top)}`"), value("at", r.loc[top, "peak_gib"] * GiB)]
    return Claim("Which phase is each timeline's peak?", findings)


def phases_claim(phases: pd.DataFrame, parameter_bytes: float) -> Claim:
    """What the forward builds up, step 1's peaks, AdamW's state appearing (against 2 x ``parameter_bytes``),
    and what step 2 adds."""
    f, st = _phases(phases, "forward"), _phases(phases, "train_step")
    g = lambda phase, col: st.loc[phase, col] * GiB if phase in st.index else math.nan  # noqa: E731
    findings = []
    if "forward 1" in f.index:
        start, end = f.loc["forward 1", "start_gib"] * GiB, f.loc["forward 1", "end_gib"] * GiB
        findings += [value("the forward builds up", end - start), value("over what existed before it", start)]
    if {"forward 1", "backward 1", "optimizer_step 1"} <= set(st.index):
        findings += [value("step 1's forward peaks at", g("forward 1", "peak_gib")),
                     value("its backward at", g("backward 1", "peak_gib")),
                     value("after its optimizer step memory is higher by",
                          g("optimizer_step 1", "end_gib") - g("forward 1", "start_gib")),
                     value("AdamW's two moments, 2 × the parameters", 2 * parameter_bytes)]
    if {"backward 2", "optimizer_step 2"} <= set(st.index):
        grown = g("optimizer_step 2", "end_gib") - g("optimizer_step 1", "end_gib")
        findings += [value("after step 2, memory is above its level after step 1 by", grown) if grown else
                     Observed("after step 2, memory is back at its level after step 1", "to the byte"),
                     value("step 2's backward peaks above step 1's by", g("backward 2", "peak_gib") -
                          g("backward 1", "peak_gib"))]
    return Claim("What does each phase hold?", findings, "The backward frees activations while it allocates "
                 "gradients; AdamW creates its state on first use, and from step 2 on it lives through the whole step.")


def show_timeline(snapshot_path: str | os.PathLike, title: str | None = None, top: int = 8):
    """Draw a snapshot's active-memory timeline, each phase's peak marked, or say why not (a replayed render)."""
    path = Path(snapshot_path)
    if not path.exists():
        say(f"No snapshot at `{path}` on this machine (snapshots are regenerable artifacts, not committed), so no "
            "timeline is drawn: render with `replay=False` to record it. The phase table comes from the results.")
        return None
    fig, ax = plt.subplots(figsize=(11, 4.5))
    plot_active_memory_timeline(load_snapshot(path), load_marks(path), top=top, ax=ax, title=title)
    return fig


def pages_claim(pages: pd.DataFrame) -> Claim:
    """Which snapshot pages (:func:`lab.measure.memory_pages.export_snapshot_pages`) open offline."""
    offline, online = pages[pages["works_offline"]], pages[~pages["works_offline"]]
    hosts = sorted({urlparse(u.strip()).netloc for e in online["external"] for u in e.split(",")})
    findings = [Observed("open without a network", ", ".join(f"`{p}`" for p in offline["path"]))][:len(offline)]
    if len(online):
        findings.append(Observed(f"load their viewer from {', '.join(f'`{h}`' for h in hosts)} and show nothing "
                                 "offline", ", ".join(f"`{p}`" for p in online["path"])))
    return Claim("Which snapshot page works offline?", findings,
                 "The pickles also open in https://pytorch.org/memory_viz." if len(pages) else
                 "No snapshot pickle is on this machine: render with `replay=False` to record them.")


def allocations_claim(largest: pd.DataFrame, origins: pd.DataFrame, setup) -> Claim:
    """The largest forward allocation and the line that allocates the most, beside the logits and one FFN hidden
    activation at the timeline context."""
    if largest.empty:
        return Claim("What are the largest allocations of a forward pass, and where do they come from?", [],
                     "The forward recording holds no allocation.")
    tokens, top, o = setup.batch * setup.timeline_context, largest.iloc[0], origins.iloc[0]
    return Claim("What are the largest allocations of a forward pass, and where do they come from?", [
        value("the largest", top["size_mib"] * MiB), Observed("made by", f"`{top['origin']}`"),
        value("the logits, batch × context × vocabulary × 4 bytes", tokens * setup.model.vocab_size * 4),
        value("one FFN hidden activation, batch × context × d_ff × 4 bytes", tokens * setup.model.d_ff * 4),
        Observed("the line that allocates the most", f"`{o['origin']}`"),
        value("its allocations", o["count"], ""), value("in all", o["total_mib"] * MiB),
        Share("of the forward's allocations", o["share"], 1.0)])


def gradients_figure(grads: pd.DataFrame):
    """Bar chart of each block's gradient memory read off the backward timeline, with the expectation."""
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.bar(grads["block"], grads["measured_mib"], label="measured (survives the backward)")
    ax.plot(grads["block"], grads["expected_mib"], "k_", markersize=14, label="expected: parameter bytes")
    ax.set(xlabel="block", ylabel="gradient memory (MiB)", title="Gradient memory per block, from the backward")
    ax.legend(loc="lower right")
    return fig


def gradients_claim(grads: pd.DataFrame, setup) -> Claim:
    """The blocks' median gradient memory against their parameters; block 0's extra against the embedding's."""
    inner, b0 = grads[grads["block"] > 0] if (grads["block"] > 0).any() else grads, grads[grads["block"] == 0].iloc[0]
    return Claim("How much gradient memory does each block leave?", [
        value("per block, median", inner["measured_bytes"].median()),
        value("expected from its parameters", inner["expected_bytes"].median()),
        value("measured over expected, median", inner["ratio"].median(), "x"),
        value("block 0, beyond its parameters", b0["measured_bytes"] - b0["expected_bytes"]),
        value("the embedding's gradient", 4 * setup.model.vocab_size * setup.model.d_model)],
        "One fp32 gradient per parameter; block 0's window also computes the embedding's gradient.")


def peak(r, label: str = "") -> Measured:
    """A peak-memory row (of the peak table, or of the checkpointing sweep with ``label``): its peak, or the
    out-of-memory it ran into with the memory the device had."""
    label = label or f"{r['mode'].replace('_', ' ')} at context {int(r['context'])} in {r['dtype']}"
    if r["status"] != "ok":
        return Measured.out_of_memory(label, r.get("limit_gib", math.nan), unit="B")
    return Measured.value(label, r["peak_gib"] * GiB, "B")


def peak_pivot(peaks: pd.DataFrame) -> pd.DataFrame:
    """Peak memory by mode and context (rows) and dtype (columns), or the out-of-memory it ran into."""
    table = peaks.assign(peak=[peak(r).text() for _, r in peaks.iterrows()]).pivot_table(
        index=["mode", "context"], columns="dtype", values="peak", aggfunc="first")
    table.columns.name = None
    return table.reset_index()


def mixed_precision_claim(peaks: pd.DataFrame) -> Claim:
    """Per mode, bf16 autocast's peak over fp32's at the shortest and longest context both fit; the out-of-memory
    rows; why it is far from half, and whether the saving grows with the context."""
    ok = peaks[peaks["status"] == "ok"].pivot_table(index=["mode", "context"], columns="dtype", values="peak_gib")
    both = ok.dropna(subset=["fp32", "bf16"]) if {"fp32", "bf16"} <= set(ok.columns) else ok.iloc[0:0]
    ratio = both["bf16"] / both["fp32"] if len(both) else pd.Series(dtype=float)
    findings = [value(f"{mode.replace('_', ' ')} at context {c}, bf16 peak over fp32", ratio[mode, c], "x")
                for mode in dict.fromkeys(ratio.index.get_level_values(0))
                for c in sorted({ratio[mode].index.min(), ratio[mode].index.max()})]
    findings += [Value(peak(r)) for _, r in peaks[peaks["status"] != "ok"].iterrows()]
    if ratio.empty:
        return Claim("Does mixed precision change peak memory, and why?", findings,
                     "No configuration has both an fp32 and a bf16 measurement.")
    grows = all(g.is_monotonic_decreasing for _, g in ratio.groupby(level=0))
    return Claim("Does mixed precision change peak memory, and why?", findings, (
        "Far from halving it: autocast saves the matrix products' outputs in bf16, but parameters, gradients and "
        "AdamW's moments stay fp32, autocast keeps a bf16 copy of every weight while the forward runs, and the "
        "norms, softmax and loss still make fp32 tensors. ")
        + ("The saving grows with the context, i.e. with the activations' share of memory" if grows
           else "The saving does not grow steadily with the context")
        + ("; where activations are small the weight copies make bf16 use more memory." if ratio.max() > 1 else "."))


def ledger_entries(peaks: pd.DataFrame, sweep: pd.DataFrame | None = None) -> list[dict]:
    """The ledger's ``peak_memory`` entries: every peak that fit, and each checkpointed train step's."""
    rows = [(r, "none") for _, r in peaks.iterrows()]
    if sweep is not None:
        rows += [(dict(r, mode="train_step"), "nested" if r["strategy"] == "nested" else f"k={int(r['group_size'])}")
                 for _, r in sweep.iterrows() if r["strategy"] != "none"]
    return [entry("peak_memory", summarize([r["peak_gib"]]), "GiB", f"{r['size']} peak, {r['mode']} at context "
                  f"{int(r['context'])}, {r['dtype']}, checkpoint {ck}", size=r["size"], context=r["context"],
                  batch=r["batch"], dtype=r["dtype"], mode=r["mode"], checkpoint=ck)
            for r, ck in rows if r["status"] == "ok"]


def saved_claim(ops: pd.DataFrame, norm: pd.DataFrame, top: int = 5) -> Claim:
    """What one block saves (and over its input), the ``top`` operations' shares, and RMSNorm eager and compiled."""
    total, n = ops["bytes"].sum(), norm.set_index("rmsnorm")
    findings = [value("one block saves", total), value("over its input", total / ops["input_bytes"].iloc[0], "x")]
    findings += [Share(f"from `{r.op}`", r.bytes, total) for r in ops.head(top).itertuples()]
    findings += [value(f"RMSNorm {k} saves, over its input", n.loc[k, "saved_inputs"], "x") for k in n.index]
    because = ("" if "compiled" not in n.index else
               "Fused, RMSNorm keeps its input and the per-row statistic and recomputes the rest in the backward."
               if n.loc["compiled", "saved_bytes"] < n.loc["eager", "saved_bytes"]
               else "Compiling RMSNorm does not reduce what it saves here.")
    return Claim("What does a block save for the backward, and what does fusing RMSNorm change?", findings, because)


def checkpoint_model_claim(model: pd.DataFrame) -> Claim:
    """The modelled optimum of single-level checkpointing and the modelled nested strategy."""
    single = model[model["strategy"] == "single"]
    best, nested = single.loc[single["modelled_bytes"].idxmin()], model[model["strategy"] == "nested"].iloc[0]
    return Claim("What does the model predict?", [
        value("one block input, r", model["boundary_bytes"].iloc[0]),
        value("what one block saves, A", model["block_bytes"].iloc[0]),
        value("the optimum k* = √(N·r/A)", model["k_star"].iloc[0], ""),
        value("the best group size k", best["group_size"], ""),
        value("its activations", best["modelled_bytes"]),
        value("without checkpointing", model.loc[model["strategy"] == "none", "modelled_bytes"].item()),
        value("nested", nested["modelled_bytes"]), value("for extra forwards per block", nested["extra_forwards"], "")],
        "Nested checkpointing is the memory-optimal strategy, at the price of more recomputation.")


def checkpoint_figure(sweep: pd.DataFrame, title: str | None = None):
    """Measured (and modelled) peak of a step against the group size; no checkpointing and nested as lines."""
    single = sweep[(sweep["strategy"] == "single") & (sweep["status"] == "ok")].sort_values("group_size")
    fig, ax = plt.subplots()
    ax.plot(single["group_size"], single["peak_gib"], "o-", label="measured peak")
    if "modelled_peak_gib" in single:
        ax.plot(single["group_size"], single["modelled_peak_gib"], "s--", label="model: 4×params + (N/k)·r + k·A")
    for row, style in zip(sweep[sweep["strategy"].isin(["none", "nested"]) & (sweep["status"] == "ok")].itertuples(),
                          (":", "-.")):
        ax.axhline(row.peak_gib, linestyle=style, color="grey", label=row.strategy)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="blocks per checkpointed group (k)", ylabel="peak memory of a train step (GiB)", title=title or "")
    ax.legend()
    return fig


def _label(r) -> str:
    s = r["strategy"]
    return f"k = {int(r['group_size'])}" if s == "single" else "no checkpointing" if s == "none" else s


def checkpoint_claim(sweep: pd.DataFrame, parameter_bytes: float) -> Claim:
    """The best single-level group size measured, its peak and its neighbours' (out of memory or not), no
    checkpointing's and nested's peaks and step times against it, and the share of its peak that no
    checkpointing shrinks (4 x the fp32 parameters)."""
    single = sweep[sweep["strategy"] == "single"].sort_values("group_size").reset_index(drop=True)
    fits = single[single["status"] == "ok"]
    question = "Which checkpointing is memory-optimal, and which block size is best measured?"
    if fits.empty:
        return Claim(question, [], "No single-level checkpointing configuration fit in memory.")
    i = int(fits["peak_gib"].idxmin())
    best = single.iloc[i]
    step = lambda r: Measured.from_row(f"a step with {_label(r)}", r, "step_ms")  # noqa: E731
    findings = [value("the best single-level group size k", best["group_size"], ""),
                value("its peak", best["peak_gib"] * GiB)]
    for r in [single.iloc[j] for j in (i - 1, i + 1) if 0 <= j < len(single)] + \
             [r for _, r in sweep[sweep["strategy"].isin(["none", "nested"])].iterrows()]:
        findings.append(Value(peak(r, _label(r))))
        if r["strategy"] in ("none", "nested") and r["status"] == "ok":
            findings.append(Versus(step(r), step(best)))
    findings.append(Share("of the best peak, parameters, gradients and AdamW's moments", 4 * parameter_bytes,
                          best["peak_gib"] * GiB))
    return Claim(question, findings, "Nested checkpoints are memory-optimal in the model (O(log N) boundaries); the "
                 "fp32 parameters, gradients and AdamW's moments are a floor that no checkpointing shrinks.")
