"""Notebook 01's kernel profiles: taken lazily (:class:`KernelProfiles`, never when replaying), then top
kernels, matmul share, and softmax against the two attention matmuls in runtime and in FLOPs."""


from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

from lab import paths
from lab.book import report
from lab.book.precision.present import num
from lab.book.profiling.present import int_text
from lab.measure import profiling as prof_tables
from lab.measure.results import measured_on
from lab.measure.step import MODES
from lab.model import config_for


def _size_label(size) -> str:
    return size if isinstance(size, str) else f"d{size.d_model}_L{size.num_layers}"


class KernelProfiles:
    """The ``torch.profiler`` profiles of one configuration, one per mode, taken on first use.

    Profiling happens only when a table is asked for, so a notebook that replays its tables from
    ``results/`` never profiles. ``profile`` is :func:`lab.bench.lm.profile_lm` with the device and the
    warm-up and step counts bound (``functools.partial``); it is passed in because ``lab.book`` does not
    import the benchmarks. Each profile is also exported as a Chrome/Perfetto trace into ``trace_dir``.
    """

    def __init__(self, profile: Callable[..., Any], size, context: int, batch: int, trace_dir: str | Path,
                 modes: Sequence[str] = MODES, attention: str = "naive"):
        self.profile, self.size, self.context, self.batch = profile, size, context, batch
        self.trace_dir, self.modes, self.attention = Path(trace_dir), tuple(modes), attention
        self._profiles: dict[str, Any] = {}

    def trace_path(self, mode: str) -> Path:
        """Where the Chrome/Perfetto trace of ``mode`` is written."""
        return self.trace_dir / f"01_{_size_label(self.size)}_{mode}.json"

    def profiler(self, mode: str):
        """The profiler of ``mode`` (profiled now if not yet)."""
        if mode not in self._profiles:
            self._profiles[mode] = self.profile(self.size, mode=mode, context=self.context, batch=self.batch,
                                                attention=self.attention, trace_path=self.trace_path(mode))
        return self._profiles[mode]

    def kernels(self) -> pd.DataFrame:
        """Every kernel (GPU) or aten operator (CPU) of every mode: :func:`lab.measure.profiling.kernel_table`
        rows with a ``mode`` column."""
        return pd.concat([prof_tables.kernel_table(self.profiler(m), top=None).assign(mode=m) for m in self.modes],
                         ignore_index=True)

    def step_times(self) -> pd.DataFrame:
        """Per mode: the profiled step's wall time (ms), the kernels' busy time (ms; 0 on the CPU), the number of
        profiled steps, and the configuration."""
        return pd.DataFrame([dict(mode=m, wall_ms=prof_tables.step_wall_ms(self.profiler(m)),
                                  busy_ms=prof_tables.gpu_busy_ms(self.profiler(m)),
                                  profiled_steps=getattr(self.profiler(m), "lab_steps", 1),
                                  size=_size_label(self.size), context=self.context, batch=self.batch,
                                  attention=self.attention) for m in self.modes])

    def attention_ranges(self) -> pd.DataFrame:
        """The naive attention's three ranges in the forward profile: calls and ms per step, GFLOP per step
        (:func:`lab.measure.profiling.attention_phase_flops`) and the TFLOP/s achieved."""
        cfg = config_for(self.size) if isinstance(self.size, str) else self.size
        flops = prof_tables.attention_phase_flops(self.batch, cfg.num_heads, self.context, cfg.head_dim,
                                                  cfg.num_layers)
        ranges = prof_tables.range_times(self.profiler("forward"))
        ranges["gflop_per_step"] = ranges["range"].map(flops) / 1e9
        ranges["tflop_per_s"] = ranges["gflop_per_step"] / ranges["ms_per_step"]
        return ranges


def time_unit(kernels: pd.DataFrame) -> tuple[str, str]:
    """(``"kernel"``, ``"GPU kernel time"``) or (``"operator"``, ``"CPU operator time"``): what the profile's
    times are, from its ``timeline`` column (tables saved before it existed: from the GPU that measured them)."""
    if "timeline" in kernels:
        gpu = (kernels["timeline"] == "gpu kernel").any()
    else:
        gpu = measured_on(kernels) != "cpu"
    return ("kernel", "GPU kernel time") if gpu else ("operator", "CPU operator time (self time of aten operators)")


def top_kernels(kernels: pd.DataFrame, mode: str, n: int = 8, width: int = 90) -> pd.DataFrame:
    """The ``n`` kernels (operators) of ``mode`` with the most time per step, names cut to ``width``."""
    top = kernels[kernels["mode"] == mode].sort_values("ms_per_step", ascending=False).head(n)
    return top.assign(name=top["name"].str.slice(0, width))[["name", "class", "calls_per_step", "ms_per_step",
                                                              "share"]].reset_index(drop=True)


def show_top_kernels(kernels: pd.DataFrame, n: int = 8) -> None:
    """Display :func:`top_kernels` for each profiled mode."""
    noun, _ = time_unit(kernels)
    for mode in dict.fromkeys(kernels["mode"]):
        report.say(f"**Top {noun}s, {mode}** (per step)")
        report.show_table(top_kernels(kernels, mode, n), floatfmt=".3g")


def class_shares(kernels: pd.DataFrame) -> pd.DataFrame:
    """Time per step by kernel class (:func:`lab.measure.profiling.kernel_class`) and mode, with each class's
    share."""
    g = kernels.groupby(["mode", "class"], sort=False)["ms_per_step"].sum().reset_index()
    g["share"] = g["ms_per_step"] / g.groupby("mode")["ms_per_step"].transform("sum")
    return g


def plot_class_shares(kernels: pd.DataFrame, size: str):
    """Stacked bars: the share of each kernel class in each mode. Returns the figure."""
    shares = class_shares(kernels)
    modes = list(dict.fromkeys(kernels["mode"]))
    pivot = shares.pivot(index="mode", columns="class", values="share").reindex(modes).fillna(0)
    fig, ax = plt.subplots(figsize=(8, 4))
    pivot.plot.barh(stacked=True, ax=ax, colormap="tab10")
    ax.set(xlabel=f"share of {time_unit(kernels)[1].split(' (')[0]}", ylabel="", title=f"{size}: matmul vs other")
    ax.legend(loc="lower right")
    return fig


def matmul_paragraph(kernels: pd.DataFrame) -> str:
    """The matmul share in each mode and the largest non-matmul kernel of the forward, with the explanation
    that fits the device the profile ran on. Markdown."""
    noun, unit = time_unit(kernels)
    mm = class_shares(kernels).query("`class` == 'matmul'").set_index("mode")["share"]
    get = lambda m: mm.get(m, 0.0)
    text = (f"Matrix multiplications take **{get('forward'):.0%}** of the {unit} in the forward pass, "
            f"{get('forward_backward'):.0%} in forward+backward and {get('train_step'):.0%} in the full train step")
    if "train_step" in mm and "forward_backward" in mm and get("train_step") < get("forward_backward"):
        text += f" (the optimizer adds elementwise {noun}s)"
    others = kernels[(kernels["class"] != "matmul") & (kernels["mode"] == "forward")]
    if len(others):
        top = others.sort_values("ms_per_step", ascending=False).iloc[0]
        text += (f". The largest non-matmul {noun} in the forward is `{str(top['name'])[:70]}` "
                 f"({top['share']:.1%} of forward time, {num(top['calls_per_step'])} calls per step)")
    if noun == "kernel":
        text += (". Elementwise and reduction kernels move much data for few FLOPs (they are memory-bound), so "
                 "their share of the time is far above their share of the FLOPs.")
    else:
        text += (". These are CPU operator times at a toy size, per-operator overhead included: they do not "
                 "predict a GPU's kernel mix.")
    return text


def matmul_answer(kernels: pd.DataFrame) -> str:
    """One line: the matmul share per mode."""
    _, unit = time_unit(kernels)
    mm = class_shares(kernels).query("`class` == 'matmul'").set_index("mode")["share"]
    parts = [f"{mm.get(m, 0.0):.0%} of {m.replace('_', '+' if m == 'forward_backward' else ' ')}"
             for m in dict.fromkeys(kernels["mode"])]
    return f"{', '.join(parts)} ({unit.split(' (')[0]})."


def profile_caption(steps: pd.DataFrame, kernels: pd.DataFrame, trace_dir: str | Path) -> str:
    """What was profiled and where the traces are."""
    r = steps.iloc[0]
    shown = paths.repo_relative(trace_dir)
    return (f"Profiled **{r['size']}** at context {int_text(r['context'])}, batch {int_text(r['batch'])}, fp32, "
            f"{r['attention']} attention, {int(r['profiled_steps'])} steps per mode; times are "
            f"{time_unit(kernels)[1]}; traces in `{shown}` (open them at ui.perfetto.dev).")


def profile_timer_sentence(steps: pd.DataFrame, lm: pd.DataFrame) -> str:
    """The profiled forward step against the Python timer's forward of the same size and context (fp32)."""
    fwd = steps.set_index("mode").loc["forward"]
    if fwd["busy_ms"] > 1.01 * fwd["wall_ms"]:
        return (f"The profile's kernels are busy {num(fwd['busy_ms'])} ms per forward step, more than the "
                f"{num(fwd['wall_ms'])} ms of wall time this table records for it, which kernels queued on one "
                "stream cannot do: that wall time was not measured right, and no comparison with the Python "
                "timer is made from it.")
    text = f"The profiler sees a forward step of **{num(fwd['wall_ms'])} ms** wall time"
    if fwd["busy_ms"] > 0:
        text += f", of which kernels are busy {num(fwd['busy_ms'])} ms ({fwd['busy_ms'] / fwd['wall_ms']:.0%})"
    same = lm[(lm["size"] == fwd["size"]) & (lm["context"] == fwd["context"]) & (lm["dtype"] == "fp32")]
    if len(same) and same["fwd_median_ms"].notna().any():
        attention = same["attention"].iloc[0] if "attention" in same else "its"
        text += (f"; the Python timer measured {num(same['fwd_median_ms'].iloc[0])} ms (median) for the same size "
                 f"and context in the sweep, with {attention} attention instead of {fwd['attention']} and without "
                 "the profiler's overhead")
    return text + "."


def attention_table(ranges: pd.DataFrame) -> pd.DataFrame:
    """The attention ranges as shown."""
    return ranges[["range", "calls_per_step", "ms_per_step", "gflop_per_step", "tflop_per_s"]]


def softmax_ratios(ranges: pd.DataFrame) -> dict[str, float]:
    """``runtime``: softmax time over the two attention matmuls' time; ``flops``: the same for FLOPs;
    ``per_flop``: their quotient; ``softmax_tflops`` and ``matmul_tflops``: the rates achieved."""
    r = ranges.set_index("range")
    mm_ms = r.loc["attention/scores", "ms_per_step"] + r.loc["attention/final_matmul", "ms_per_step"]
    mm_gf = r.loc["attention/scores", "gflop_per_step"] + r.loc["attention/final_matmul", "gflop_per_step"]
    runtime = r.loc["attention/softmax", "ms_per_step"] / mm_ms
    flops = r.loc["attention/softmax", "gflop_per_step"] / mm_gf
    return dict(runtime=runtime, flops=flops, per_flop=runtime / flops,
                softmax_tflops=r.loc["attention/softmax", "tflop_per_s"], matmul_tflops=mm_gf / mm_ms)


def softmax_paragraph(ranges: pd.DataFrame, on: str) -> str:
    """Softmax against the two attention matmuls: time ratio, FLOP ratio, cost per FLOP, and the explanation
    that fits the device. Markdown."""
    s = softmax_ratios(ranges)
    direction = "more" if s["per_flop"] >= 1 else "less"
    per_flop = s["per_flop"] if s["per_flop"] >= 1 else 1 / s["per_flop"]
    text = (f"Softmax takes **{num(s['runtime'], 2)}x** the time of the two attention matmuls together for "
            f"**{num(s['flops'], 2)}x** their FLOPs: per FLOP it is {num(per_flop, 2)}x {direction} expensive "
            f"({num(s['softmax_tflops'])} TFLOP/s against {num(s['matmul_tflops'])} TFLOP/s for the matmuls).")
    if on == "cuda":
        text += (" Softmax does a handful of operations per score but reads and writes the whole b·h·s² score "
                 "matrix, so it is bound by memory bandwidth, not arithmetic; fusing it with the matmuls "
                 "(FlashAttention, notebook 05) removes those round trips.")
    else:
        text += (" These are CPU times of a toy configuration, where per-operator overhead weighs as much as "
                 "memory traffic; the GPU explanation (softmax bound by memory bandwidth, removed by fusing it "
                 "with the matmuls, notebook 05) is for GPU renders.")
    return text


def softmax_answer(ranges: pd.DataFrame) -> str:
    """One line: the softmax's time and FLOP ratios to the attention matmuls."""
    s = softmax_ratios(ranges)
    return (f"{num(s['runtime'], 2)}x the time of the two attention matmuls for {num(s['flops'], 2)}x their FLOPs "
            f"({num(s['per_flop'], 2)}x their cost per FLOP).")
