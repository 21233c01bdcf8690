"""Notebook 01's kernel profiles (taken by :class:`lab.bench.profiles.KernelProfiles`), presented: the top
kernels per mode, the matrix products' share of the time, the profiled step against the Python timer, and
softmax against the two attention matmuls in time and in FLOPs, as claims with the explanation that holds on
the device that measured them."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from lab import paths
from lab.book import claims as cl
from lab.book import report
from lab.measure.profiling import class_shares
from lab.measure.results import measured_on


def time_unit(kernels: pd.DataFrame) -> tuple[str, str]:
    """(``"kernel"``, ``"GPU kernel time"``) or (``"operator"``, ``"CPU operator time"``): what the profile's
    times are, from its ``timeline`` column (tables saved before it existed: from the GPU that measured them)."""
    gpu = (kernels["timeline"] == "gpu kernel").any() if "timeline" in kernels else measured_on(kernels) != "cpu"
    return ("kernel", "GPU kernel time") if gpu else ("operator", "CPU operator time (self time of aten operators)")


def show_top_kernels(kernels: pd.DataFrame, n: int = 8, width: int = 90) -> None:
    """For each mode, the ``n`` kernels (operators) with the most time per step, names cut to ``width``."""
    noun, _ = time_unit(kernels)
    for mode, g in kernels.groupby("mode", sort=False):
        top = g.sort_values("ms_per_step", ascending=False).head(n)
        report.say(f"**Top {noun}s, {mode}** (per step)")
        report.show_table(top.assign(name=top["name"].str.slice(0, width))[["name", "class", "calls_per_step",
                                                                            "ms_per_step", "share"]])


def plot_class_shares(kernels: pd.DataFrame, size: str):
    """Stacked bars: the share of each kernel class in each mode. Returns the figure."""
    modes = list(dict.fromkeys(kernels["mode"]))
    shares = class_shares(kernels, by=("mode",))
    pivot = shares.pivot(index="mode", columns="class", values="share").reindex(modes).fillna(0)
    fig, ax = plt.subplots(figsize=(8, 4))
    pivot.plot.barh(stacked=True, ax=ax, colormap="tab10")
    ax.set(xlabel=f"share of {time_unit(kernels)[1].split(' (')[0]}", ylabel="", title=f"{size}: matmul vs other")
    ax.legend(loc="lower right")
    return fig


MODE_NAMES = {"forward": "forward", "forward_backward": "forward+backward", "train_step": "train step"}


def matmul_claim(kernels: pd.DataFrame) -> cl.Claim:
    """The matrix products' share of each mode's time and the forward's largest other kernel."""
    noun, unit = time_unit(kernels)
    g = class_shares(kernels, by=("mode",))
    totals = g.groupby("mode", sort=False)["ms_per_step"].sum()
    mm = g[g["class"] == "matmul"].set_index("mode")["ms_per_step"]
    findings = [cl.Share(f"matrix products, {MODE_NAMES.get(m, m)} ({unit.split(' (')[0]})", mm.get(m, 0.0), total)
                for m, total in totals.items()]
    others = kernels[(kernels["class"] != "matmul") & (kernels["mode"] == "forward")]
    if len(others):
        top = others.sort_values("ms_per_step", ascending=False).iloc[0]
        findings += [cl.Observed(f"the forward's largest other {noun}", f"`{str(top['name'])[:70]}`"),
                     cl.Share("its share of the forward", top["share"], 1.0),
                     cl.Value(cl.Measured.value("its calls per step", top["calls_per_step"]))]
    share = {m: mm.get(m, 0.0) / t for m, t in totals.items()}
    optimizer = share.get("train_step", 1) < share.get("forward_backward", 0)
    return cl.Claim("How much of the time is matrix multiplication?", findings, because=(
        (f"The optimizer adds elementwise {noun}s to the train step. " if optimizer else "")
        + ("Elementwise and reduction kernels move much data for few FLOPs (they are memory-bound), so their share "
           "of the time is far above their share of the FLOPs." if noun == "kernel" else
           "These are CPU operator times at a toy size, per-operator overhead included: they do not predict a "
           "GPU's kernel mix.")))


def profile_findings(steps: pd.DataFrame, kernels: pd.DataFrame, lm: pd.DataFrame, trace_dir: str | Path) -> list:
    """What was profiled and where its traces are; the profiled forward's wall time and the kernels' busy share
    of it; the Python timer's median forward of the same size and context (fp32) in the sweep."""
    f = steps.set_index("mode").loc["forward"]
    out = [cl.Observed("profiled", f"{f['size']} at context {int(f['context'])}, batch {int(f['batch'])}, fp32, "
                                   f"{f['attention']} attention, {int(f['profiled_steps'])} steps per mode; times are "
                                   f"{time_unit(kernels)[1]}; traces in `{paths.repo_relative(trace_dir)}` "
                                   "(open them at ui.perfetto.dev)"),
           cl.Value(cl.Measured.value("the profiled forward step's wall time", f["wall_ms"], "ms"))]
    if f["busy_ms"] > 1.01 * f["wall_ms"]:
        return out + [cl.Value(cl.Measured.value("its kernels' busy time", f["busy_ms"], "ms")),
                      cl.Observed("so that wall time", "shorter than its kernels' busy time, which kernels on one "
                                                       "stream cannot be: not measured right, and not compared")]
    if f["busy_ms"] > 0:
        out.append(cl.Share("kernels busy", f["busy_ms"], f["wall_ms"]))
    same = lm[(lm["size"] == f["size"]) & (lm["context"] == f["context"]) & (lm["dtype"] == "fp32")]
    if len(same) and math.isfinite(same["fwd_ms"].iloc[0]):
        r = same.iloc[0]
        out.append(cl.Value(cl.Measured.from_row(f"the Python timer's forward ({r['attention']} attention, no "
                                                 "profiler)", r, "fwd_ms")))
    return out


def attention_table(ranges: pd.DataFrame) -> pd.DataFrame:
    return ranges[["range", "calls_per_step", "ms_per_step", "gflop_per_step", "tflop_per_s"]]


def softmax_claim(ranges: pd.DataFrame, on: str) -> cl.Claim:
    """Softmax against the two attention matmuls: time ratio, FLOP ratio, cost per FLOP, the rates."""
    r = ranges.set_index("range")
    mm_ms, mm_gf = (r.loc["attention/scores", c] + r.loc["attention/final_matmul", c]
                    for c in ("ms_per_step", "gflop_per_step"))
    runtime = r.loc["attention/softmax", "ms_per_step"] / mm_ms
    flops = r.loc["attention/softmax", "gflop_per_step"] / mm_gf
    value = lambda label, v, unit="x": cl.Value(cl.Measured.value(label, v, unit))
    rate = lambda label, tflops: value(label, *((tflops, "TFLOP/s") if tflops >= 1 else (tflops * 1e3, "GFLOP/s")))
    return cl.Claim("What does softmax cost inside attention?", [
        value("softmax's time over the two attention matmuls'", runtime), value("its FLOPs over theirs", flops),
        value("its cost per FLOP over theirs", runtime / flops),
        rate("softmax's rate", r.loc["attention/softmax", "tflop_per_s"]), rate("the matmuls' rate", mm_gf / mm_ms)],
        because=(
        "Softmax does a handful of operations per score but reads and writes the whole b·h·s² score matrix, so it "
        "is bound by memory bandwidth, not arithmetic; fusing it with the matmuls (FlashAttention, notebook 05) "
        "removes those round trips." if on == "cuda" else
        "These are CPU times of a toy configuration, where per-operator overhead weighs as much as memory traffic; "
        "the GPU reading (softmax bound by memory bandwidth, removed by fusing it with the matmuls, notebook 05) "
        "is for GPU renders."))
