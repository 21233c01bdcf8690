"""Notebook 07's presentation: the data-parallel benchmark as tables, plots and sentences generated from it.

The input is the ``ddp_benchmark`` table of :meth:`lab.book.ddp.bench.DDPRun.measure`: one row per (config,
impl, bucket size) with the median step time over interleaved rounds and every round's sample
(``step_samples_ms``). Every "faster", "slower", "within noise" and "goal met" comes from
:mod:`lab.measure.verdicts` on those samples, paired by round (:func:`lab.bench.interleaved.compare_rounds`);
overlap percentages are measured numbers of one profiled step (no spread), never a verdict.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.bench.interleaved import compare_rounds, goal_rounds, samples
from lab.book import report
from lab.book.communication.present import duration
from lab.book.ddp.bench import fit_bucket_overhead, optimal_bucket
from lab.book.plots import save_figure
from lab.book.report import pct
from lab.measure.traces import existing_trace, plot_timeline, read_trace, step_overlap
from lab.measure.verdicts import CONFIDENCE, span

HOOKED = ("individual", "bucketed")


def label(impl: str, bucket_mb: float) -> str:
    """``"bucketed 10 MB"`` for a bucketed row, the impl's name otherwise."""
    return f"bucketed {bucket_mb:g} MB" if impl == "bucketed" else impl


def _labelled(bench: pd.DataFrame) -> pd.DataFrame:
    bench = bench.copy()
    if "config" not in bench:
        bench["config"] = bench["size"].astype(str) + " " + bench["dtype"].astype(str)
    bench["label"] = [label(i, b) for i, b in zip(bench["impl"], bench["bucket_mb"])]
    return bench


def _ok(bench: pd.DataFrame, config: str | None = None) -> pd.DataFrame:
    b = _labelled(bench)
    b = b[b["status"] == "ok"]
    return b if config is None else b[b["config"] == config]


def configs(bench: pd.DataFrame) -> list[str]:
    """The configs of a table, in order ("xl fp32", "2.7B bf16")."""
    return list(dict.fromkeys(_labelled(bench)["config"]))


def step_table(bench: pd.DataFrame) -> pd.DataFrame:
    """What to read in the benchmark: per config and wrapper the median step time over rounds, the spread
    (interquartile range), rounds, communication time and overlap of the profiled step, calls, status."""
    cols = ["config", "label", "step_ms", "step_iqr_ms", "rounds", "comm_ms", "overlap_frac", "n_buckets", "status"]
    b = _labelled(bench)
    return b[[c for c in cols if c in b]]


def _row(ok: pd.DataFrame, impl: str) -> pd.Series | None:
    rows = ok[ok["impl"] == impl]
    return rows.iloc[0] if len(rows) else None


def best(ok: pd.DataFrame, impls=("bucketed",)) -> pd.Series | None:
    """The row of ``impls`` with the lowest median step time (None if none ran)."""
    rows = ok[ok["impl"].isin(impls)].sort_values("step_ms")
    return rows.iloc[0] if len(rows) else None


def _cmp(a, b):
    """The verdict of row ``a`` against row ``b`` (Series or itertuples rows) on their per-round samples,
    paired by round (:func:`lab.bench.interleaved.compare_rounds`)."""
    return compare_rounds(samples(a.step_samples_ms), samples(b.step_samples_ms))


def plot_step_times(bench: pd.DataFrame):
    """Per config: every round's step time (points) and the median (bar) of each wrapper, the profiled
    step's communication time (orange) and the single-device median (dashed); returns the figure."""
    import matplotlib.pyplot as plt

    names = configs(bench)
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 0.5 + 0.45 * len(bench) / len(names)),
                             squeeze=False)
    for ax, config in zip(axes[0], names):
        ok = _ok(bench, config).sort_values("step_ms")
        y = np.arange(len(ok))
        ax.barh(y, ok["step_ms"], color="tab:blue", alpha=0.35, label="median step")
        ax.barh(y, ok["comm_ms"].fillna(0), height=0.35, color="tab:orange", label="communication (profiled step)")
        for yi, s in zip(y, ok["step_samples_ms"]):
            xs = samples(s)
            ax.plot(xs, np.full(len(xs), yi), "k.", ms=3, alpha=0.6)
        single = _row(ok, "single_gpu")
        if single is not None:
            ax.axvline(single["step_ms"], color="k", ls="--", lw=1, label="single device")
        ax.set_yticks(y, ok["label"])
        ax.invert_yaxis()
        ax.set(title=config, xlabel="ms per AdamW step (dots: one per round)")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def wrapper_sentences(bench: pd.DataFrame) -> str:
    """Per config, what each step of the wrappers' story costs or saves, each claim from the verdicts."""
    paragraphs = []
    for config in configs(bench):
        ok = _ok(bench, config)
        single, naive, flat = _row(ok, "single_gpu"), _row(ok, "naive"), _row(ok, "flat")
        hooked, bucketed, torch_ddp = best(ok, HOOKED), best(ok), _row(ok, "torch_ddp")
        rounds = int(ok["rounds"].max()) if len(ok) else 0
        text = [f"**{config}** (medians over {rounds} interleaved rounds):"]
        if single is not None:
            text.append(f"the single-device step takes {single.step_ms:.3g} ms.")
        if naive is not None and flat is not None:
            text.append(f"One flat all-reduce instead of {naive.n_buckets:.0f} calls: "
                        f"{_cmp(flat, naive).describe('flat', 'naive')}.")
        if hooked is not None and flat is not None:
            text.append(f"Starting the all-reduces during backward: "
                        f"{_cmp(hooked, flat).describe(hooked.label, 'flat')}.")
        if bucketed is not None and torch_ddp is not None:
            text.append(f"Against PyTorch's DistributedDataParallel: "
                        f"{_cmp(bucketed, torch_ddp).describe(bucketed.label, 'torch DDP')}.")
        fastest = best(ok, tuple(i for i in ok["impl"].unique() if i != "single_gpu"))
        if fastest is not None and single is not None:
            text.append("The fastest data-parallel step: "
                        f"{_cmp(fastest, single).describe(fastest.label, 'one device')}.")
        paragraphs.append(" ".join(text))
    return "\n\n".join(paragraphs) or "No configuration ran."


def cost_answer(bench: pd.DataFrame) -> str:
    """The answers-box line: per config, the fastest data-parallel wrapper against one device."""
    parts = []
    for config in configs(bench):
        ok = _ok(bench, config)
        single = _row(ok, "single_gpu")
        fastest = best(ok, tuple(i for i in ok["impl"].unique() if i != "single_gpu"))
        if fastest is None or single is None:
            parts.append(f"{config}: not measured")
            continue
        c = _cmp(fastest, single)
        parts.append(f"{config}: the fastest wrapper, {fastest.label}, takes {fastest.step_ms:.3g} ms against "
                     f"{single.step_ms:.3g} ms on one device (medians); paired by round it is {c.verdict} "
                     f"(median per-round ratio {c.ratio:.3g})")
    return "; ".join(parts) + "."


# ----------------------------------------------------------------------------------------------------------
# timelines


def timelines(bench: pd.DataFrame, config: str) -> dict[str, pd.DataFrame]:
    """``{label: timeline}`` of the config's profiled steps whose traces exist here
    (:func:`lab.measure.traces.read_trace`)."""
    ok = _ok(bench, config)
    return {r.label: read_trace(p) for r in ok.itertuples() if (p := existing_trace(r.trace)) is not None}


def timeline_config(bench: pd.DataFrame) -> str | None:
    """The last config with profiled traces on this machine (None when none are here, e.g. when replaying
    a table measured elsewhere)."""
    found = [c for c in configs(bench) if any(existing_trace(t) for t in _ok(bench, c)["trace"])]
    return found[-1] if found else None


def shown_timelines(bench: pd.DataFrame, config: str | None) -> dict[str, pd.DataFrame]:
    """The timelines worth drawing: naive, flat, individual, the best bucket size and torch DDP."""
    if config is None:
        return {}
    ok = _ok(bench, config)
    b = best(ok)
    wanted = ["naive", "flat", "individual"] + ([b.label] if b is not None else []) + ["torch_ddp"]
    found = timelines(bench, config)
    return {k: found[k] for k in wanted if k in found}


def plot_timelines(shown: dict[str, pd.DataFrame], config: str | None, results_dir: str | None = None):
    """One timeline per wrapper (compute blue, communication orange, phases shaded), saved as
    ``<results_dir>/figures/ddp_timelines.png`` when ``results_dir`` is given; None without traces."""
    import matplotlib.pyplot as plt


    if not shown:
        return None
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 1.9 * len(shown)), squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], shown.items()):
        plot_timeline(tl, title=f"{config}: {name}", ax=ax, merge_lanes=True)
    fig.tight_layout()
    if results_dir is not None:
        save_figure(fig, "ddp_timelines", results_dir)
    return fig


def overlap_table(shown: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per drawn timeline: the profiled step's communication, how much of it ran beside compute, and the
    exposed rest (ms), from :func:`lab.measure.traces.step_overlap`."""
    rows = []
    for name, tl in shown.items():
        s = step_overlap(tl)
        rows.append(dict(wrapper=name, communication_ms=s["communication_ms"], overlapped_ms=s["overlapped_ms"],
                         exposed_ms=s["communication_ms"] - s["overlapped_ms"], overlap_share=s["overlap_share"]))
    return pd.DataFrame(rows, columns=["wrapper", "communication_ms", "overlapped_ms", "exposed_ms", "overlap_share"])


def overlap_sentences(overlap: pd.DataFrame, bench: pd.DataFrame, config: str | None) -> str:
    """What the timelines show (numbers of one profiled step) and whether overlap saves time (the verdict of
    the fastest hook-based wrapper against flat, which sends the same bytes without overlap)."""
    if config is None or overlap.empty:
        return ("No profiler traces of this table are on this machine (they are regenerated by measuring, not "
                "by replaying), so the timelines are not drawn.")
    o = overlap.set_index("wrapper")["overlap_share"]
    hooked = o[[k for k in o.index if k.startswith(HOOKED)]].dropna()
    text = [f"In {config}'s profiled steps (one step each, so these shares have no spread),"]
    if "naive" in o:
        text.append(f"{pct(o['naive'])} of naive DDP's communication time ran beside compute,")
    if len(hooked):
        text.append(f"against {span(hooked.min(), hooked.max(), pct, '–')} for the hook-based wrappers.")
    ok = _ok(bench, config)
    h, flat = best(ok, HOOKED), _row(ok, "flat")
    if h is not None and flat is not None:
        c = _cmp(h, flat)
        meaning = {"faster": "the overlap saves time", "slower": "here the overlap does not pay for its extra calls",
                   "within noise": "whether the overlap saves time cannot be told from the noise"}[c.verdict]
        saved, comm = flat["step_ms"] - h["step_ms"], flat.get("comm_ms", math.nan)
        if c.verdict == "faster" and comm == comm and saved > comm:  # hiding communication saves at most all of it
            meaning = (f"but it is {saved:.3g} ms faster where flat's whole communication took {comm:.3g} ms in its "
                       "profiled step, so hiding communication cannot account for all of it (the rest is the "
                       "rounds' noise or another difference between the two)")
        text.append(f"Over the timed rounds, {c.describe(h.label, 'flat')}: {meaning}.")
    return " ".join(text)


def overlap_answer(overlap: pd.DataFrame, bench: pd.DataFrame, config: str | None) -> str:
    """The answers-box line: the overlap shares of the profiled steps and the verdict on time."""
    if config is None or overlap.empty:
        return "no traces here to tell."
    o = overlap.set_index("wrapper")["overlap_share"]
    shares = ", ".join(f"{k} {pct(v)}" for k, v in o.items())
    ok = _ok(bench, config)
    h, flat = best(ok, HOOKED), _row(ok, "flat")
    verdict = "" if h is None or flat is None else f"; {h.label} against flat over the rounds: {_cmp(h, flat).verdict}"
    return f"{config}, share of communication beside compute in one profiled step: {shares}{verdict}."


# ----------------------------------------------------------------------------------------------------------
# the bucketed overhead model


def cite_alpha_beta(book, backend: str, world_size: int) -> dict | None:
    """This render's all-reduce latency and bandwidth from notebook 06 (``collectives_latency_bandwidth``,
    read through ``book.other``, which prints who measured it) for ``backend`` and ``world_size``; a visible
    warning and None when 06 has not saved them in this results folder."""
    try:
        fits = book.other("collectives_latency_bandwidth", source="06_communication")
    except FileNotFoundError:
        report.warn(f"Notebook 06 has not saved `collectives_latency_bandwidth` in `{book.results_dir}`: render 06 "
                    "first to compare the bucket model with a lone all-reduce.")
        return None
    row = fits[(fits["backend"] == backend) & (fits["op"] == "all_reduce") & (fits["world_size"] == world_size)]
    if row.empty:
        report.warn(f"Notebook 06's fit has no {backend} all-reduce with {world_size} ranks.")
        return None
    r = row.iloc[0]
    return dict(backend=backend, world_size=world_size, o_ms=float(r["latency_ms"]), w_gbps=float(r["bandwidth_gbps"]))


def overhead_points(bench: pd.DataFrame) -> pd.DataFrame:
    """The model's data: per config, every flat, individual and bucketed row with its number of all-reduce
    calls and overhead_ms = its median step minus the single-device median."""
    rows = []
    for config in configs(bench):
        ok = _ok(bench, config)
        single = _row(ok, "single_gpu")
        if single is None:
            continue
        points = ok[ok["impl"].isin(["flat", "individual", "bucketed"])]
        rows += [dict(config=config, label=r.label, impl=r.impl, bucket_mb=r.bucket_mb, n_buckets=r.n_buckets,
                      grad_mb=r.grad_mb, overhead_ms=r.step_ms - single.step_ms) for r in points.itertuples()]
    return pd.DataFrame(rows, columns=["config", "label", "impl", "bucket_mb", "n_buckets", "grad_mb", "overhead_ms"])


def overhead_model(bench: pd.DataFrame, alpha_beta: dict | None) -> pd.DataFrame:
    """Per config: the fitted per-call overhead ``o`` and bandwidth ``w`` of ``n*o + s/(n*w)`` and the bucket
    size they make optimal; the same optimum from notebook 06's lone all-reduce (``alpha_beta``, may be
    None); the best bucket size measured and the bucket sizes within noise of it."""
    points = overhead_points(bench)
    rows = []
    for config, part in points.groupby("config", sort=False):
        total = part["grad_mb"].iloc[0] * 2**20
        row = dict(config=config, grad_mb=part["grad_mb"].iloc[0], fit_o_ms=math.nan, fit_w_gbps=math.nan,
                   fit_best_bucket_mb=math.nan, fit_best_overhead_ms=math.nan)
        if len(part) >= 2:
            fit = fit_bucket_overhead(part["n_buckets"], part["overhead_ms"], total)
            row.update(fit_o_ms=fit["o_ms"], fit_w_gbps=fit["w_gbps"])
            if fit["o_ms"] > 0 and fit["w_gbps"] > 0:
                opt = optimal_bucket(total, fit["o_ms"], fit["w_gbps"])
                row.update(fit_best_bucket_mb=opt["bucket_mb"], fit_best_overhead_ms=opt["overhead_ms"])
        if alpha_beta is not None:
            row.update(nb06_o_ms=alpha_beta["o_ms"], nb06_w_gbps=alpha_beta["w_gbps"], nb06_best_bucket_mb=math.nan)
            o, w = alpha_beta["o_ms"], alpha_beta["w_gbps"]
            if o > 0 and w > 0:
                row["nb06_best_bucket_mb"] = optimal_bucket(total, o, w)["bucket_mb"]
        ok = _ok(bench, config)
        b = best(ok)
        row["measured_best_bucket_mb"] = b.bucket_mb if b is not None else math.nan
        tied = [r.bucket_mb for r in ok[ok["impl"] == "bucketed"].itertuples()
                if b is not None and r.bucket_mb != b.bucket_mb and _cmp(r, b).verdict == "within noise"]
        row["within_noise_of_best_mb"] = ", ".join(f"{x:g}" for x in tied)
        rows.append(row)
    return pd.DataFrame(rows)


def plot_overhead_model(bench: pd.DataFrame, model: pd.DataFrame):
    """Measured overhead against the number of all-reduce calls, with the fitted curve, one panel per config."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    points = overhead_points(bench)
    names = list(dict.fromkeys(points["config"]))
    if not names:
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, config in zip(axes[0], names):
        part = points[points["config"] == config]
        m = model.set_index("config").loc[config]
        sns.scatterplot(data=part, x="n_buckets", y="overhead_ms", hue="impl", s=60, ax=ax)
        grid = np.logspace(0, np.log10(max(part["n_buckets"].max(), 2) * 1.5), 100)
        o = 0.0 if math.isnan(m["fit_o_ms"]) else m["fit_o_ms"]
        bw = 0 * grid if math.isnan(m["fit_w_gbps"]) else m["grad_mb"] * 2**20 / grid / (m["fit_w_gbps"] * 1e6)
        ax.plot(grid, o * grid + bw, "k--", lw=1, label="fitted n·o + s/(n·w)")
        for r in part[part["impl"] == "bucketed"].itertuples():
            ax.annotate(f"{r.bucket_mb:g} MB", (r.n_buckets, r.overhead_ms), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set(xscale="log", title=config, xlabel="number of all-reduce calls (buckets)",
               ylabel="median step − single-device median (ms)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def overhead_model_sentences(model: pd.DataFrame) -> str:
    """Per config: what the fit says, the best bucket measured (and those tied with it), and what notebook
    06's lone all-reduce predicts."""
    lines = []
    for r in model.itertuples():
        text = f"**{r.config}** ({report.fmt(r.grad_mb)} MiB of gradients): "
        if math.isfinite(r.fit_o_ms) and math.isfinite(r.fit_w_gbps):
            text += (f"the fit gives o = {duration(r.fit_o_ms)} per call and w = {report.fmt(r.fit_w_gbps)} GB/s, "
                     f"so the model's optimal bucket is {report.fmt(r.fit_best_bucket_mb)} MB (overhead "
                     f"{report.fmt(r.fit_best_overhead_ms)} ms); ")
        else:
            text += ("the measured overheads do not support both terms of the model (a fitted coefficient is not "
                     "positive: overlap hides more, or the noise is larger, than the model assumes); ")
        tied = f" ({r.within_noise_of_best_mb} MB within noise of it)" if r.within_noise_of_best_mb else ""
        text += f"the best bucket size measured is {r.measured_best_bucket_mb:g} MB{tied}."
        if math.isfinite(getattr(r, "nb06_best_bucket_mb", math.nan)):
            text += (f" Notebook 06 measured {duration(r.nb06_o_ms)} latency and {report.fmt(r.nb06_w_gbps)} GB/s "
                     f"for a lone all-reduce, which would put the optimum at {report.fmt(r.nb06_best_bucket_mb)} MB.")
        elif hasattr(r, "nb06_o_ms"):
            text += " Notebook 06's fit has no usable latency and bandwidth for this backend (see its table)."
        lines.append(text)
    return "\n\n".join(lines) or "Not enough rows to fit the model."


def overhead_answer(model: pd.DataFrame) -> str:
    """The answers-box line: best bucket measured against the model's (fit and notebook 06) per config."""
    parts = []
    for r in model.itertuples():
        fit = f"{r.fit_best_bucket_mb:.3g} MB" if math.isfinite(r.fit_best_bucket_mb) else "no optimum"
        nb06 = getattr(r, "nb06_best_bucket_mb", math.nan)
        nb06 = (f", and 06's lone all-reduce latency and bandwidth would put it at {nb06:.3g} MB"
                if math.isfinite(nb06) else "")
        parts.append(f"{r.config}: measured best {r.measured_best_bucket_mb:g} MB; the fitted model says {fit}{nb06}")
    return "; ".join(parts) + "." if parts else "not enough rows."


# ----------------------------------------------------------------------------------------------------------
# the performance goal


def goal_config(bench: pd.DataFrame) -> str:
    """The config the goal is set for: the first 2.7B one, else the last."""
    names = configs(bench)
    return next((c for c in names if c.startswith("2.7B")), names[-1])


def goal_checks(bench: pd.DataFrame, config: str, vs_torch_ddp: float = 1.0, vs_single: float = 1.1) -> pd.DataFrame:
    """The best bucketed step against torch DDP (at most ``vs_torch_ddp`` times its time) and against one device
    (at most ``vs_single`` times), each from :func:`lab.measure.verdicts.check_goal` on the per-round samples
    (paired by round, :func:`lab.bench.interleaved.goal_rounds`).
    Columns goal, subject, reference, target, ratio, low, high, result (met, missed, or undecided within
    noise, or "not measured")."""
    ok = _ok(bench, config)
    b = best(ok)
    rows = []
    for ref_impl, name, target in (("torch_ddp", "torch DDP", vs_torch_ddp), ("single_gpu", "one device", vs_single)):
        ref = _row(ok, ref_impl)
        goal = f"best bucketed <= {target:g}x {name}"
        if b is None or ref is None:
            rows.append(dict(goal=goal, subject=None, reference=name, target=target, ratio=math.nan, low=math.nan,
                             high=math.nan, result="not measured"))
            continue
        g = goal_rounds(samples(b.step_samples_ms), samples(ref.step_samples_ms), target)
        c = g.comparison
        rows.append(dict(goal=goal, subject=b.label, reference=name, target=target, ratio=c.ratio, low=c.low,
                         high=c.high, result=g.word))
    return pd.DataFrame(rows)


def goal_answer(goals: pd.DataFrame, config: str) -> str:
    """The answers-box line for the goal, one clause per check."""
    clauses = [f"{r.goal}: {r.result}" + (f" (ratio {r.ratio:.3g}, {CONFIDENCE:.0%} interval {r.low:.3g}-{r.high:.3g})"
                                          if math.isfinite(r.ratio) and math.isfinite(r.low) else "")
               for r in goals.itertuples()]
    return f"{config}: " + "; ".join(clauses) + "."
