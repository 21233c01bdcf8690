"""Notebook 10's tables, plots and prose: the book's fastest step against stock PyTorch.

Every verdict on step times comes from :mod:`lab.measure.verdicts` on their measured spread (a claim only
beyond the noise), like for like (:mod:`lab.book.fastest.compare`: equal precision, configuration, batch and
timer); every number from the rows of this render's tables. A profiled step's phases are one step each, with
no spread: they say where time goes, not which step is faster. The fused loss's goals are read from
``do_bench`` samples per implementation (median, spread and count): a verdict beyond the noise where both
sides have two samples or more, "one timed sample: no verdict" where not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import pandas as pd

from lab.accounting import parameter_count
from lab.book.fastest.bench import PHASE_COLUMNS, PROFILED_ABLATIONS
from lab.book.fastest.compare import (  # noqa: F401 - the notebook reads the comparisons through this module
    FITS_GIB,
    ablation_sentence,
    ablation_table,
    goal_sentence,
    like_for_like_table,
    other_precision_sentence,
    scaling_sentence,
    stocks_like,
    versus_table,
)
from lab.book.report import fmt
from lab.measure.results import measured_on
from lab.measure.verdicts import compare_summaries, label
from lab.recipes.fastest_step import (
    CONFIGS,
    HEADLINE,
    StepConfig,
    ablation_base,
    ablations,
    model_flops_per_step,
    recipes_for,
)

#: The ablations the quick (CPU) book runs: interpreted Triton takes seconds a step.
QUICK_ABLATIONS = ("flash_triton_attention", "no_fused_loss")
#: The phases of a profiled step, as the bench assigns them (one list: lab.book.fastest.bench.PHASE_COLUMNS).
PHASES = PHASE_COLUMNS
#: The phases where a step whose recomputation has no profiler range of its own (compiled blocks) counts it.
MERGED_WITH_RECOMPUTE = ("recompute", "attention", "matmul", "other kernels")
MEMORY = ["params_gib", "grads_gib", "optimizer_gib", "activations_and_other_gib"]


def _label(column: str) -> str:
    """A phase or memory column as the tables and plots name it: ``other_kernels_ms`` -> ``other kernels``."""
    return column.removesuffix("_ms").removesuffix("_gib").replace("_", " ")


def recipes(config: StepConfig, quick: bool, ablate: bool | Sequence[str] | Mapping = True) -> list:
    """The book's recipe, both stock steps and each optimization switched off alone where ``ablate`` says so:
    True or False for every configuration, a list of the configurations to ablate, or a mapping from
    configuration to True or the names of its ablations (``{"leaderboard": ["no_fused_loss"]}``). On the
    CPU (``quick``) nothing is compiled (inductor's C++ compile would take longer than the whole quick book), so
    the stock compiled steps, which would run eagerly under their name, are left out, and only the attention's
    and the loss's ablations run."""
    every = ablations(recipes_for(config)["project"])
    if isinstance(ablate, str) or not isinstance(ablate, (bool, Sequence, Mapping)):
        raise ValueError(f"ablate must be True, False, a list of configuration names or a mapping, got {ablate!r}")
    names = ablate if isinstance(ablate, (bool, Mapping)) else dict.fromkeys(ablate, True)
    if isinstance(names, Mapping):
        unknown = sorted(set(names) - set(CONFIGS))
        if unknown:
            raise ValueError(f"ablate names unknown configurations {unknown}; known: {sorted(CONFIGS)}")
        names = names.get(config.name, False)
    if isinstance(names, bool):
        chosen = every if names else []
    else:
        known = [r.name for r in every]
        if isinstance(names, str) or set(names) - set(known):
            raise ValueError(f"ablations of {config.name} are among {known}, got {names!r}")
        chosen = [r for r in every if r.name in names]
    out = list(recipes_for(config).values()) + chosen
    if quick:  # interpreted Triton takes seconds a step: the three headline steps and the Triton attention
        out = [dataclasses.replace(r, compile="none") for r in out
               if (r.name in HEADLINE and r.compile == "none") or r.name in QUICK_ABLATIONS
               or r.name == "project"]
    return out


def _carry_entries(configs: Sequence[str], carry: Sequence[str]) -> dict[str, str]:
    """``carry``'s entries as configuration -> ``"all"`` (``"name"``) or ``"headline"`` (``"name:headline"``)."""
    if isinstance(carry, str):
        raise ValueError(f"carry must be a list of configuration names, got {carry!r}")
    out = {}
    for entry in carry:
        name, _, part = entry.partition(":")
        if name not in configs or part not in ("", "headline"):
            raise ValueError(f"carry entries are a configuration of this render ({', '.join(configs)}), alone or "
                             f"with ':headline', got {entry!r}")
        out[name] = part or "all"
    return out


def measured_recipes(configs: Sequence[str], carry: Sequence[str], quick: bool,
                     ablate: bool | Sequence[str] | Mapping = True) -> dict[str, list]:
    """What this render measures, per configuration (:func:`recipes`), given what it carries from the last
    render: nothing of a configuration carried whole (``"leaderboard"``); of one whose headline rows are
    carried (``"leaderboard:headline"``), its ablations with the book's step measured again beside them
    (``ablation_base``), so that a machine too small for a configuration's every recipe in one call measures
    them in two."""
    parts = _carry_entries(configs, carry)
    out = {}
    for name in configs:
        chosen = recipes(CONFIGS[name], quick, ablate)
        if parts.get(name) == "headline":
            rest = [r for r in chosen if r.name not in HEADLINE]
            project = next(r for r in chosen if r.name == "project")
            chosen = [ablation_base(project), *rest] if rest else []
        if parts.get(name) != "all" and chosen:
            out[name] = chosen
    return out


def carried_rows(saved: pd.DataFrame, configs: Sequence[str], carry: Sequence[str]) -> pd.DataFrame:
    """The rows of the last render that ``carry`` keeps (see :func:`measured_recipes`)."""
    parts = _carry_entries(configs, carry)
    whole = saved["config"].map(parts).eq("all")
    headline = saved["config"].map(parts).eq("headline") & saved["impl"].isin(HEADLINE)
    return saved[whole | headline]


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


def phase_sentence(df: pd.DataFrame, impl: str = "project") -> str:
    """Where the step's time goes, largest phases first (profiled step, ms per step)."""
    row = df.set_index("impl").loc[impl] if impl in set(df["impl"]) else None
    if row is None or row[PHASES].isna().all():
        return f"No GPU profile of {impl} (on the CPU there are no kernels to attribute)."
    parts = row[PHASES].dropna().sort_values(ascending=False)
    total = parts.sum()
    text = ", ".join(f"{_label(name)} {ms:,.0f} ms ({ms / total:.0%})" if ms >= 100 else
                     f"{_label(name)} {fmt(ms, 3)} ms ({ms / total:.0%})"
                     for name, ms in parts.items() if ms > 0.005 * total)
    config = f"**{row['config']}**: one" if isinstance(row.get("config"), str) else "One"
    return f"{config} profiled step of {impl}: {text}."


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


def gap_sentence(df: pd.DataFrame, impl: str = "project", reference: str = "stock_compiled") -> str:
    """Where ``impl`` gains and loses against ``reference`` (from :func:`gap_table`); which ablation would be
    faster is :func:`ablation_sentence`'s (timed the same way as the book's step)."""
    gap = gap_table(df, impl, reference)
    if gap.empty:
        return f"No GPU profile of both {impl} and {reference}: the gap cannot be split by phase here."
    phases, moved = gap.iloc[:-1], moved_phases(gap, reference)
    behind = moved[moved["difference_ms"] > 0].sort_values("difference_ms", ascending=False)
    ahead = moved[moved["difference_ms"] < 0].sort_values("difference_ms")
    ref = reference.replace("_", " ")

    def listed(part, sign):
        return ", ".join(f"{r.phase} ({sign}{abs(r.difference_ms):.4g} ms)" for r in part.itertuples())

    less, more = listed(ahead, "-"), listed(behind, "+")
    if less and more:
        said = f"spends less on {less}, and more on {more}"
    elif less or more:
        said = (f"spends less on {less}; no phase takes more by 1% of the step or more" if less else
                f"spends more on {more}; no phase takes less by 1% of the step or more")
    else:
        said = "spends within 1% of the step on every phase"
    text = (f"Against {ref}, the book's step {said} (one profiled step each, {gap[impl].iloc[-1]:.4g} ms against "
            f"{gap[reference].iloc[-1]:.4g} ms: where the time goes, not a verdict on which step is faster; that "
            "is the timed steps').")
    by = phases.set_index("phase")
    if by.loc["recompute", reference] == 0 < by.loc["recompute", impl]:
        merged = by.loc[list(MERGED_WITH_RECOMPUTE)].sum()
        text += (f" {ref[0].upper() + ref[1:]} recomputes without a profiler range of its own (a compiled block's "
                 f"recomputation is part of its graph), so its recomputation is counted in its other phases, "
                 f"attention included: compare {', '.join(MERGED_WITH_RECOMPUTE)} together, {merged[impl]:.4g} ms "
                 f"against {merged[reference]:.4g} ms ({merged[impl] - merged[reference]:+.4g}).")
    return text


def ablation_phase_sentence(df: pd.DataFrame, base: str = "project") -> str:
    """For each profiled ablation (:data:`lab.book.fastest.bench.PROFILED_ABLATIONS`): where its profiled step
    spends more or less than the book's, the phases that moved by 1% of the step or more (one profiled step
    each: where the time goes, not a timing); "" where none was profiled."""
    parts = []
    for impl in [i for i in df["impl"] if i in PROFILED_ABLATIONS]:
        gap = gap_table(df, impl, base)
        if gap.empty:
            continue
        where = (", ".join(f"{r.phase} {r.difference_ms:+.4g} ms" for r in moved_phases(gap, base).itertuples())
                 or "no phase moved by 1% of the step or more")
        parts.append(f"{impl} {gap['difference_ms'].iloc[-1]:+.4g} ms in all ({where})")
    if not parts:
        return ""
    return ("Profiled once each against the book's step (one step each: where the time goes, not a timing): "
            + "; ".join(parts) + ".")


def mfu_sentence(df: pd.DataFrame, on_gpu: bool) -> str:
    """MFU of the book's step against the matmul ceiling measured on this card and the datasheet."""
    ok = df[(df["status"] == "ok") & (df["impl"] == "project")]
    if not on_gpu or ok.empty or not math.isfinite(ok["mfu"].iloc[0]):
        return "Model-FLOP utilisation is only meaningful on a GPU; this render has none."
    r = ok.iloc[0]
    world = int(r.get("world_size", 1) or 1)  # the MFU is per GPU: a total over several GPUs says so
    work = (f"{fmt(r['model_tflop_per_step'], 4)} TFLOP of model FLOPs per step over {world} GPUs, "
            f"{fmt(r['mfu'] * r['matmul_ceiling_tflops'], 3)} TFLOP/s per GPU" if world > 1 else
            f"{fmt(r['model_tflop_per_step'], 4)} TFLOP of model FLOPs per step")
    return (f"The book's step does {work}: "
            f"{fmt(r['tokens_per_s'], 4)} tokens/s, {r['mfu']:.1%} of the {r['matmul_ceiling_tflops']:.0f} TFLOP/s "
            f"bf16 matmul ceiling measured on this card ({r['mfu_datasheet']:.1%} of the 989 TFLOP/s datasheet); "
            f"the gap to the ceiling is {1 - r['mfu']:.0%} of the step.")


#: Matmul work of the fused loss's recompute mode (``fused_recompute``: 8 N D V, forward, recompute,
#: d_weight, d_hidden) over the 6 N D V of the materialized loss, which every row's ``tflops`` is credited
#: with (lab.book.fastest.fused_loss); the default (gradients in the forward) does the same 6 N D V.
FUSED_WORK = {"fused": 1.0, "fused_recompute": 8 / 6}
#: The peers the fused loss is set against besides the materialized loss: (impl, name in the text).
LOSS_PEERS = (("liger", "Liger's fused linear cross-entropy"), ("cce", "Cut Cross-Entropy"))


def loss_verdict(by: pd.DataFrame, impl: str, reference: str) -> tuple[float, str]:
    """``(time ratio, verdict)`` of ``impl`` against ``reference`` at one shape: the noise-aware verdict where
    both rows carry a spread (``fwdbwd_std_ms``, ``fwdbwd_n``), else the bare ratio with no verdict."""
    a, b = by.loc[impl], by.loc[reference]
    if all(c in by.columns for c in ("fwdbwd_std_ms", "fwdbwd_n")) and a[["fwdbwd_std_ms", "fwdbwd_n"]].notna().all() \
            and b[["fwdbwd_std_ms", "fwdbwd_n"]].notna().all():
        c = compare_summaries(a["fwdbwd_ms"], a["fwdbwd_std_ms"], int(a["fwdbwd_n"]), b["fwdbwd_ms"],
                              b["fwdbwd_std_ms"], int(b["fwdbwd_n"]))
        return c.ratio, label(c.verdict, c.low, c.high)
    return a["fwdbwd_ms"] / b["fwdbwd_ms"], "unjudged"


def fused_loss_sentence(losses: pd.DataFrame, on_gpu: bool, memory_goal: float = 0.05, time_goal: float = 1.0) -> str:
    """The fused loss's goals at each benchmarked shape: extra memory <= ``memory_goal`` x the materialized
    eager loss's, forward+backward time <= ``time_goal`` x ``torch.compile`` of the materialized loss (and
    whether that lies beyond the noise), and its time and memory against the peers of :data:`LOSS_PEERS` that
    ran."""
    if not on_gpu:
        return ("This render has no GPU: the loss ran through the Triton interpreter, so its times and the memory "
                "goals are not measured here (the GPU render reports them).")
    ok = losses[losses["status"] == "ok"]
    parts = []
    for (vocab, d, tokens), shape in ok.groupby(["vocab", "d_model", "tokens"]):
        by = shape.set_index("impl")
        if "fused" not in by.index:
            continue
        f = by.loc["fused"]
        text = f"At vocabulary {vocab:,}, width {d:,}, {tokens:,} tokens: fused {f['fwdbwd_ms']:.4g} ms"
        if "torch_compiled" in by.index:
            ratio, verdict = loss_verdict(by, "fused", "torch_compiled")
            goal = ("undecided" if verdict == "no spread" else "met" if ratio <= time_goal else "missed")
            noise = {"faster": ", faster beyond the noise", "slower": ", slower beyond the noise",
                     "within noise": ", within noise", "no spread": ": one timed sample, no spread"}.get(verdict, "")
            text += f", {ratio:.3g}x the compiled materialized loss (time goal {goal}{noise}"
            c = by.loc["torch_compiled"]
            rates = (f.get("tflops", math.nan), c.get("tflops", math.nan))
            if ratio > time_goal and all(math.isfinite(r) for r in rates):
                # `tflops` credits everyone with 6 N D V; scale by the work the default design really does
                work = FUSED_WORK["fused"]
                done = f["tflops"] * work
                amount = "the same matmul work as" if work == 1 else f"{work:.3g}x the matmul work of"
                text += f": {amount} the compiled loss, at {done:.0f} TFLOP/s against its {c['tflops']:.0f}"
            text += ")"
        if "torch" in by.index and by.loc["torch", "peak_extra_gib"] > 0:
            share = f["peak_extra_gib"] / by.loc["torch", "peak_extra_gib"]
            text += (f"; {f['peak_extra_gib']:.3g} GiB beyond inputs and outputs, {share:.1%} of the eager "
                     f"materialized loss's {by.loc['torch', 'peak_extra_gib']:.3g} GiB (memory goal "
                     f"{'met' if share <= memory_goal else 'missed'})")
            if "torch_compiled" in by.index and by.loc["torch_compiled", "peak_extra_gib"] > 0:
                compiled = by.loc["torch_compiled", "peak_extra_gib"]
                text += f" and {f['peak_extra_gib'] / compiled:.0%} of the compiled one's {compiled:.3g} GiB"
        elif "torch" not in by.index:
            text += "; the materialized loss ran out of memory at this shape"
        for peer, name in LOSS_PEERS:
            if peer not in by.index:
                continue
            ratio, verdict = loss_verdict(by, "fused", peer)
            said = {"faster": "faster than", "slower": "slower than", "within noise": "within noise of"}.get(
                verdict, "set against")
            blind = "; one timed sample: no verdict" if verdict == "no spread" else ""
            theirs = by.loc[peer, "peak_extra_gib"]
            memory = ("about the same" if abs(f["peak_extra_gib"] - theirs) <= 0.01 * max(theirs, f["peak_extra_gib"])
                      else "less" if f["peak_extra_gib"] < theirs else "more")
            text += (f"; {said} {name} ({ratio:.3g}x its {by.loc[peer, 'fwdbwd_ms']:.4g} ms{blind}) with {memory} "
                     f"extra memory ({f['peak_extra_gib']:.3g} against {by.loc[peer, 'peak_extra_gib']:.3g} GiB)")
        parts.append(text)
    oom = losses[losses["status"] == "oom"]
    if len(oom):
        parts.append("Out of memory: " + ", ".join(f"{r.impl} at vocabulary {r.vocab:,}" for r in oom.itertuples()))
    return (". ".join(parts) + ".") if parts else "No fused-loss row ran."  # a sentence per shape


def compile_sentence(df: pd.DataFrame, config: str, on_gpu: bool, limit_s: float = 600) -> str:
    """The leaderboard's rule that the whole benchmark, compilation and autotuning included, finishes within
    ``limit_s`` from an empty cache: the book's step's ``wall_s`` (build, first step, timing) and
    ``first_step_s``, where its processes compiled from empty caches (the first recipe of a render on GPUs)."""
    row = df[(df["impl"] == "project") & (df["status"] == "ok")]
    if not on_gpu or row.empty or "wall_s" not in row or not row["wall_s"].notna().iloc[0]:
        return f"The {config} step's time from an empty compile cache is measured only in a GPU render."
    r = row.iloc[0]
    verdict = "within" if r["wall_s"] <= limit_s else "beyond"
    return (f"**{config}**: from empty Inductor and Triton caches, building the book's step, its first step "
            f"({r['first_step_s']:.3g} s: compilation and autotuning included) and the do_bench timing took "
            f"{r['wall_s']:.3g} s, {verdict} the {limit_s / 60:.3g}-minute limit.")


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
