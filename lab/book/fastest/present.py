"""Notebook 10's plan, tables, plots and claims besides the timed comparisons (:mod:`lab.book.fastest.compare`):
which recipes a render measures, where a profiled step's time goes, memory by category, MFU, the leaderboard's
ten-minute rule, and the fused loss against the materialized one and its peers.

A profiled step is one step: its phases say where the time goes, not which step is faster (the timed steps do,
under the rule). The fused loss's comparisons are the rule's, on ``do_bench`` samples per implementation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from lab.accounting import parameter_count
from lab.bench.fastest import PROFILED_ABLATIONS
from lab.book.claims import Claim, Measured, Observed, Share, Value, Versus
from lab.book.fastest.compare import CPU_NOTE
from lab.measure.profiling import PHASE_COLUMNS
from lab.measure.results import measured_on
from lab.recipes.fastest_step import CONFIGS, model_flops_per_step

PHASES = PHASE_COLUMNS
#: The phases where a step whose recomputation has no profiler range of its own (compiled blocks) counts it.
MERGED_WITH_RECOMPUTE = ("recompute", "attention", "matmul", "other kernels")
MEMORY = ["params_gib", "grads_gib", "optimizer_gib", "activations_and_other_gib"]


def _label(column: str) -> str:
    """A phase or memory column as the tables and plots name it: ``other_kernels_ms`` -> ``other kernels``."""
    return column.removesuffix("_ms").removesuffix("_gib").replace("_", " ")


def config_table(names) -> pd.DataFrame:
    """What each configuration trains: model shape, tokens per step, ranks, parameters, model TFLOP per step."""

    rows = []
    for name in names:
        c = CONFIGS[name]
        m = c.model
        rows.append(dict(config=name, d_model=m.d_model, d_ff=m.d_ff, layers=m.num_layers, heads=m.num_heads,
                         vocab=m.vocab_size, context=c.context, batch=c.batch_per_rank * c.world_size,
                         world_size=c.world_size, params_B=parameter_count(m) / 1e9,
                         model_tflop_per_step=model_flops_per_step(c) / 1e12))
    return pd.DataFrame(rows)


def measured_on_gpu(df: pd.DataFrame, default: bool) -> bool:
    """Whether ``df``'s rows were measured on GPUs (:func:`lab.measure.results.measured_on`), so that a replay
    on a laptop still judges the GPU's numbers; ``default`` (this render's device) when the rows do not say."""
    return measured_on(df, default="cuda" if default else "cpu") == "cuda"


def plot_phases(df: pd.DataFrame, title: str = "", ax=None):
    """Stacked horizontal bars: each profiled recipe's step time by phase (ms)."""
    import matplotlib.pyplot as plt

    data = df[df[PHASES].notna().any(axis=1)].set_index("impl")[PHASES]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.8 + 0.6 * max(len(data), 1)))
    if data.empty:
        ax.set_title(f"{title}: no GPU kernels were profiled")
        return ax
    return _stacked_bars(data, ax, "ms per step", title)


def _stacked_bars(data: pd.DataFrame, ax, xlabel: str, title: str):
    """``data``'s columns stacked as horizontal bars, one bar per row, the legend outside on the right."""
    data.rename(columns=_label).plot.barh(stacked=True, ax=ax, width=0.7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return ax


def plot_memory(df: pd.DataFrame, title: str = "", ax=None):
    """Stacked bars: peak memory per GPU by category (GiB) for each recipe that ran."""
    import matplotlib.pyplot as plt

    data = df[df["status"] == "ok"].set_index("impl")[MEMORY]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.8 + 0.5 * max(len(data), 1)))
    return _stacked_bars(data, ax, "GiB per GPU at the step's peak", title)


def gap_table(df: pd.DataFrame, impl: str = "project", reference: str = "stock_compiled") -> pd.DataFrame:
    """Phase by phase, ``impl``'s profiled step against ``reference``'s: ms each and the difference (positive:
    ``impl`` spends more there). Where the goal is missed, this says which phases hold the gap."""
    rows = df.set_index("impl")
    if impl not in rows.index or reference not in rows.index:
        return pd.DataFrame()
    a, b = rows.loc[impl, PHASES], rows.loc[reference, PHASES]
    if a.isna().all() or b.isna().all():
        return pd.DataFrame()
    out = pd.DataFrame({"phase": [_label(p) for p in PHASES],
                        impl: a.to_numpy(float), reference: b.to_numpy(float)})
    out["difference_ms"] = out[impl] - out[reference]
    total = pd.DataFrame([{"phase": "total (profiled step)", impl: out[impl].sum(), reference: out[reference].sum(),
                           "difference_ms": out["difference_ms"].sum()}])
    return pd.concat([out, total], ignore_index=True)


def moved_phases(gap: pd.DataFrame, reference: str) -> pd.DataFrame:
    """The phase rows of a :func:`gap_table` whose difference is at least 1% of ``reference``'s profiled step:
    what a sentence names (smaller moves are within a profile's own variation)."""
    phases = gap.iloc[:-1]
    return phases[phases["difference_ms"].abs() >= 0.01 * gap[reference].iloc[-1]]


def other_kernels_table(df: pd.DataFrame, impls: Sequence[str] = ("project", "stock_compiled")) -> pd.DataFrame:
    """The largest kernels of each recipe's ``other kernels`` phase (its ``other_kernels_top``, ms per profiled
    step), side by side: which copies, norms and elementwise kernels hold that phase."""
    rows = df.set_index("impl")
    parts = {}
    for impl in impls:
        text = rows.loc[impl, "other_kernels_top"] if impl in rows.index and "other_kernels_top" in rows else ""
        if isinstance(text, str) and text:
            parts[impl] = {name: float(ms) for name, ms in (item.rsplit("=", 1) for item in text.split("; "))}
    if not parts:
        return pd.DataFrame()
    out = pd.DataFrame(parts).rename_axis("kernel").reset_index()
    return out.sort_values(list(parts)[0], ascending=False, na_position="last", ignore_index=True)


#: What the offload, CUDA-graph and sharding choices did in each row (:func:`choices_table`).
CHOICE_COLUMNS = ["nodes", "within_node_bytes", "across_node_bytes", "offload_bytes", "offload_wait_ms", "cuda_graphs",
                  "note"]


def choices_table(df: pd.DataFrame) -> pd.DataFrame:
    """The rows where a recipe offloads, is captured in CUDA graphs (or asked to be), or sends bytes between
    ranks: ``impl``, the offloaded GiB per step and rank with the time waited for copies back (ms per step),
    and the GiB each rank sends per step within its node and across nodes. Empty when no row has any (or the
    rows predate these columns)."""
    if not set(CHOICE_COLUMNS) <= set(df.columns):
        return pd.DataFrame()
    used = (df["offload_bytes"].notna() | df["within_node_bytes"].notna() | df["cuda_graphs"].astype(bool)
            | df["note"].fillna("").astype(str).ne(""))
    out = df.loc[used, ["impl", *CHOICE_COLUMNS]].copy()
    for column in ("within_node_bytes", "across_node_bytes", "offload_bytes"):
        out[column.replace("_bytes", "_gib")] = out.pop(column) / 2**30
    out["note"] = out["note"].fillna("")
    return out.reset_index(drop=True)


# ----------------------------------------------------------------------------------------------------------
# claims


def phase_claim(df: pd.DataFrame, impl: str = "project") -> Claim:
    """Where one profiled step of ``impl`` spends its time: each phase's share of the step, largest first."""
    question = f"Where does {'the book' if impl == 'project' else impl}'s {df['config'].iloc[0]} step spend its time?"
    row = df.set_index("impl").loc[impl] if impl in set(df["impl"]) else None
    if row is None or row[PHASES].isna().all():
        return Claim(question, [Observed(f"a GPU profile of {impl}", "none (on a CPU there are no kernels)")])
    parts = row[PHASES].dropna().sort_values(ascending=False)
    total = parts.sum()
    return Claim(question, [Value(Measured.value("one profiled step", total, "ms"))]
                 + [Share(_label(p), ms, total) for p, ms in parts.items() if ms > 0.005 * total])


def gap_claim(df: pd.DataFrame, impl: str = "project", reference: str = "stock_compiled") -> Claim | None:
    """Phase by phase, where ``impl``'s profiled step spends more or less than ``reference``'s (the phases that
    moved by 1% of the step or more); None without both profiles."""
    gap = gap_table(df, impl, reference)
    if gap.empty:
        return None
    findings = [Value(Measured.value(f"{r.phase}, {impl} against {reference}", r.difference_ms, "ms"))
                for r in moved_phases(gap, reference).itertuples()]
    by = gap.iloc[:-1].set_index("phase")
    because = ""
    if by.loc["recompute", reference] == 0 < by.loc["recompute", impl]:
        merged = by.loc[list(MERGED_WITH_RECOMPUTE)].sum()
        findings.append(Value(Measured.value("recomputation with the phases it hides in ("
                                             + " + ".join(MERGED_WITH_RECOMPUTE) + ")", merged[impl]
                                             - merged[reference], "ms")))
        because = (f"{reference} recomputes inside its compiled blocks, without a profiler range of its own, so its "
                   "recomputation is counted among its other phases: compare them together.")
    return Claim(f"Where does {impl}'s profiled step gain and lose against {reference}'s?",
                 findings or [Observed("every phase", "within 1% of the step")],
                 because=because + " One profiled step each: where the time goes, not which step is faster.")


def ablation_phase_claim(df: pd.DataFrame, base: str = "project") -> Claim | None:
    """For each profiled ablation (:data:`lab.bench.fastest.PROFILED_ABLATIONS`), its profiled step against the
    book's: the whole difference and the phases that moved by 1% of the step or more."""
    findings = []
    for impl in [i for i in df["impl"] if i in PROFILED_ABLATIONS]:
        gap = gap_table(df, impl, base)
        if not gap.empty:
            findings.append(Value(Measured.value(f"{impl} in all", gap["difference_ms"].iloc[-1], "ms")))
            findings += [Value(Measured.value(f"{impl}, {r.phase}", r.difference_ms, "ms"))
                         for r in moved_phases(gap, base).itertuples()]
    if not findings:
        return None
    return Claim("Where does each profiled ablation's step move time against the book's?", findings,
                 because="One profiled step each: where the time goes, not a timing.")


def mfu_claim(df: pd.DataFrame, on_gpu: bool) -> Claim:
    """The book's step's tokens/s and model-FLOP utilisation against the matmul ceiling measured on this card."""
    ok = df[(df["status"] == "ok") & (df["impl"] == "project")]
    question = f"How close does the book's {df['config'].iloc[0]} step come to the card's matmul ceiling?"
    if not on_gpu or ok.empty or not math.isfinite(ok["mfu"].iloc[0]):
        return Claim(question, [Observed("model-FLOP utilisation", "measured only on a GPU")])
    r = ok.iloc[0]
    per_gpu = r["mfu"] * r["matmul_ceiling_tflops"]
    return Claim(question, [Value(Measured.value("model work per step", r["model_tflop_per_step"], "TFLOP")),
                            Value(Measured.value("throughput", r["tokens_per_s"], "tokens/s")),
                            Share("share of the bf16 matmul ceiling measured on this card, per GPU", per_gpu,
                                  r["matmul_ceiling_tflops"]),
                            Share("share of the 989 TFLOP/s datasheet rate", per_gpu, 989.0)])


def compile_claim(df: pd.DataFrame, config: str, on_gpu: bool, limit_s: float = 600) -> Claim:
    """The leaderboard's rule: building the step, its first step (compilation and autotuning from empty caches)
    and the timing finish within ``limit_s``."""
    question = f"Does the {config} benchmark finish within {limit_s / 60:g} minutes from an empty compile cache?"
    row = df[(df["impl"] == "project") & (df["status"] == "ok")]
    if not on_gpu or row.empty or not row["wall_s"].notna().iloc[0]:
        return Claim(question, [Observed("from an empty cache", "measured only in a GPU render")])
    r = row.iloc[0]
    return Claim(question, [Value(Measured.value("the first step, compilation and autotuning included",
                                                 r["first_step_s"], "s")),
                            Value(Measured.value("build, first step and timing", r["wall_s"], "s")),
                            Observed("the limit", "kept" if r["wall_s"] <= limit_s else "exceeded")])


#: The peers the fused loss is set against besides the materialized loss: impl -> name.
LOSS_PEERS = {"torch_compiled": "compiled PyTorch", "liger": "Liger's fused linear cross-entropy",
              "cce": "Cut Cross-Entropy"}


def _loss(row: pd.Series, name: str) -> Measured:
    return Measured.from_row(name, row, "fwdbwd_ms")


def fused_loss_claim(losses: pd.DataFrame, on_gpu: bool, memory_goal: float = 0.05, time_goal: float = 1.0) -> Claim:
    """At each shape: the fused loss's forward+backward against compiled PyTorch (goal <= ``time_goal``) and the
    peers, and its memory beyond inputs and outputs as a share of the eager materialized loss's (goal <=
    ``memory_goal``)."""
    findings: list = []
    for (vocab, d, tokens), shape in losses.groupby(["vocab", "d_model", "tokens"]):
        by = shape.set_index("impl")
        if "fused" not in by.index:
            continue
        at = f"at vocabulary {vocab:,}, width {d:,}, {tokens:,} tokens"
        fused = _loss(by.loc["fused"], f"the fused loss {at}")
        for peer, name in LOSS_PEERS.items():
            if peer in by.index and by.loc[peer, "status"] in ("ok", "oom"):
                findings.append(Versus(fused, _loss(by.loc[peer], name),
                                       goal=time_goal if peer == "torch_compiled" else None))
        eager = by.loc["torch"] if "torch" in by.index else None
        if eager is not None and eager["status"] == "ok" and eager["peak_extra_gib"] > 0:
            share = Share(f"extra memory {at}, of the eager materialized loss's", by.loc["fused", "peak_extra_gib"],
                          eager["peak_extra_gib"])
            findings += [share, Observed("memory goal", "met" if share.fraction <= memory_goal else "missed")]
        elif eager is not None and eager["status"] == "oom":
            findings.append(Observed(f"the materialized loss {at}", _loss(eager, "").text()))
    untimed = losses[losses["status"] == "not timed"]
    if len(untimed):
        names = ", ".join(dict.fromkeys(untimed["impl"]))
        findings.append(Observed("checked against fp32 but not timed (Triton interpreted)", names))
    return Claim("Does the fused loss remove the logits' memory without costing time?",
                 findings or [Observed("the fused loss", "no row ran")], because="" if on_gpu else CPU_NOTE)


#: The columns of a configuration's runs as shown: what ran, its median step with spread and samples, memory,
#: throughput, MFU and the compile cost.
RUN_COLUMNS = ["impl", "precision", "status", "step_ms", "step_spread_ms", "step_n", "timer", "step_gpu_ms",
               "step_compute_gpu_ms", "peak_gib", "tokens_per_s", "mfu", "first_step_s"]
