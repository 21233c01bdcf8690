"""Notebook 07's presentation: the data-parallel benchmark as tables, plots and claims (:mod:`lab.book.claims`).

The input is the ``ddp_benchmark`` table of :meth:`lab.book.ddp.bench.DDPRun.measure`: one row per (config,
impl, bucket size) with the median step time over interleaved rounds and every round in order
(``step_samples_ms``). The rounds were interleaved, so every comparison is paired by round (a slow round slows
both sides and cancels in their ratio). Overlap shares and communication times come from one profiled step
each: values without spread, never a verdict.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.accounting import bucket_overhead_model, bucket_overhead_points
from lab.bench.interleaved import samples
from lab.book import claims as cl
from lab.book import ledger, report
from lab.book.plots import save_figure
from lab.measure.profiling import phase_gaps
from lab.measure.step import OPTIMIZER
from lab.measure.traces import existing_trace, plot_timeline, read_trace, step_overlap
from lab.measure.verdicts import FASTER, SLOWER, WITHIN_NOISE

HOOKED = ("individual", "bucketed")
NAMES = {"torch_ddp": "torch DDP", "single_gpu": "one device"}


def label(impl: str, bucket_mb: float) -> str:
    """``"bucketed 10 MB"`` for a bucketed row, ``"torch DDP"``, ``"one device"``, or the impl's name."""
    return f"bucketed {cl.number(bucket_mb)} MB" if impl == "bucketed" else NAMES.get(impl, impl)


def _labelled(bench: pd.DataFrame) -> pd.DataFrame:
    config = bench["config"] if "config" in bench else bench["size"].astype(str) + " " + bench["dtype"].astype(str)
    return bench.assign(config=config, label=[label(i, b) for i, b in zip(bench["impl"], bench["bucket_mb"])])


def _ok(bench: pd.DataFrame, config: str | None = None) -> pd.DataFrame:
    b = _labelled(bench)
    return b[(b["status"] == "ok") & ((b["config"] == config) if config is not None else True)]


def configs(bench: pd.DataFrame) -> list[str]:
    """The configs of a table, in order ("xl fp32", "2.7B bf16")."""
    return list(dict.fromkeys(_labelled(bench)["config"]))


def _row(ok: pd.DataFrame, impl: str) -> pd.Series | None:
    rows = ok[ok["impl"] == impl]
    return rows.iloc[0] if len(rows) else None


def best(ok: pd.DataFrame, impls=("bucketed",)) -> pd.Series | None:
    """The row of ``impls`` (None: every data-parallel one) with the lowest median step time (None if none ran)."""
    rows = ok[ok["impl"].isin(impls) if impls else ok["impl"] != "single_gpu"].sort_values("step_ms")
    return rows.iloc[0] if len(rows) else None


def step_table(bench: pd.DataFrame) -> pd.DataFrame:
    """What to read in the benchmark: per config and wrapper the median step time over rounds, its spread and
    count, the profiled step's GPU times (some kernel running, and the collectives left out), communication
    time and overlap, all-reduce calls, status; a column nobody measured is left out."""
    cols = ["config", "label", "step_ms", "step_spread_ms", "step_n", "step_gpu_ms", "step_compute_gpu_ms",
            "comm_ms", "overlap_frac", "n_buckets", "status"]
    b = _labelled(bench)
    return b[[c for c in cols if c in b]].dropna(axis=1, how="all")


def phase_gap_table(bench: pd.DataFrame) -> pd.DataFrame:
    """Per config, each wrapper's profiled step against one device's, phase by phase
    (:func:`lab.measure.profiling.phase_gaps`; empty where no GPU kernels were profiled)."""
    return phase_gaps(_ok(bench), label("single_gpu", 0), key="label").dropna(axis=1, how="all")


def measured(row) -> cl.Measured:
    """A row's step time with every round, labelled by wrapper and config."""
    return cl.Measured.from_row(f"{row['label']} ({row['config']})", row, "step_ms")


def versus(a, b, goal: float | None = None) -> cl.Versus:
    """Row ``a`` against row ``b``, paired by round."""
    return cl.Versus(measured(a), measured(b), goal=goal, paired=True)


def wrapper_findings(bench: pd.DataFrame) -> list:
    """Per config, the wrappers' story: the single-device step, one flat all-reduce against naive's many calls,
    starting the all-reduces during backward (the best hook-based wrapper against flat), the best bucketed
    wrapper against torch DDP, and the fastest data-parallel step against one device."""
    out = []
    for config in configs(bench):
        ok = _ok(bench, config)
        single, naive, flat = _row(ok, "single_gpu"), _row(ok, "naive"), _row(ok, "flat")
        pairs = [(flat, naive), (best(ok, HOOKED), flat), (best(ok), _row(ok, "torch_ddp")), (best(ok, None), single)]
        if single is not None:
            out.append(cl.Value(measured(single)))
        if naive is not None:
            out.append(cl.Value(cl.Measured.value(f"naive's all-reduce calls per step ({config})", naive["n_buckets"])))
        out += [versus(a, b) for a, b in pairs if a is not None and b is not None]
    return out


def cost_claim(bench: pd.DataFrame) -> cl.Claim:
    """Per config, the fastest data-parallel wrapper against one device (the last of :func:`wrapper_findings`)."""
    return cl.Claim("What does data parallelism cost over one device?", [
        f for f in wrapper_findings(bench) if isinstance(f, cl.Versus) and f.reference.label.startswith(
            NAMES["single_gpu"])])


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
            ax.axvline(single["step_ms"], color="k", ls="--", lw=1, label="one device")
        ax.set_yticks(y, ok["label"])
        ax.invert_yaxis()
        ax.set(title=config, xlabel="ms per AdamW step (dots: one per round)")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def ledger_entries(bench: pd.DataFrame) -> list[dict]:
    """The torch DDP rows as ``ddp_step`` entries of the ledger (notebook 08 times torch DDP too)."""
    return ledger.ddp_step_entries(_labelled(bench), "torch_ddp", lambda r: f"torch DDP, {r['config']}", OPTIMIZER)


# ----------------------------------------------------------------------------------------------------------
# timelines


def shown_timelines(bench: pd.DataFrame) -> tuple[str | None, dict[str, pd.DataFrame]]:
    """The last config with profiled traces on this machine (None when none are here, e.g. when replaying a
    table measured elsewhere) and ``{label: timeline}`` of those worth drawing: naive, flat, individual, the best
    bucket size and torch DDP (:func:`lab.measure.traces.read_trace`)."""
    found = [c for c in configs(bench) if any(existing_trace(t) for t in _ok(bench, c)["trace"])]
    if not found:
        return None, {}
    ok = _ok(bench, found[-1])
    wanted = ["naive", "flat", "individual", *([] if best(ok) is None else [best(ok)["label"]]), NAMES["torch_ddp"]]
    traces = {r.label: read_trace(p) for r in ok.itertuples() if (p := existing_trace(r.trace)) is not None}
    return found[-1], {k: traces[k] for k in wanted if k in traces}


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
    rows = [dict(wrapper=name, **step_overlap(tl)) for name, tl in shown.items()]
    df = pd.DataFrame(rows, columns=["wrapper", "communication_ms", "overlapped_ms", "overlap_share"])
    return df.assign(exposed_ms=df["communication_ms"] - df["overlapped_ms"])


OVERLAP_MEANS = {FASTER: "The overlap saves time.", SLOWER: "Here the overlap does not pay for its extra calls.",
                 WITHIN_NOISE: "Whether the overlap saves time cannot be told from the noise."}


def overlap_claim(overlap: pd.DataFrame, bench: pd.DataFrame, config: str | None) -> cl.Claim:
    """The share of communication beside compute in each profiled step, and whether overlap saves time: the best
    hook-based wrapper against flat, which sends the same bytes in one call without overlap."""
    question = "Does the all-reduce overlap the backward pass, and does that save time?"
    if config is None or overlap.empty:
        return cl.Claim(question, (), "No profiler traces of this table are on this machine (they are regenerated "
                                      "by measuring, not by replaying), so the timelines are not drawn.")
    findings = [cl.Share(f"{r.wrapper}'s communication beside compute in its profiled step ({config})",
                         r.overlapped_ms, r.communication_ms) for r in overlap.itertuples()]
    ok = _ok(bench, config)
    hooked, flat = best(ok, HOOKED), _row(ok, "flat")
    if hooked is None or flat is None:
        return cl.Claim(question, findings)
    f = versus(hooked, flat)
    because = OVERLAP_MEANS.get(f.verdict, "")
    findings.append(f)
    if f.verdict == FASTER and flat["comm_ms"] < flat["step_ms"] - hooked["step_ms"]:
        findings.append(cl.Value(cl.Measured.value(f"flat's whole communication in its profiled step ({config})",
                                                   flat["comm_ms"], "ms")))
        because = ("Hiding communication saves at most all of it, and flat's whole communication took less than "
                   "the time saved: the rest is the rounds' noise or another difference between the two.")
    return cl.Claim(question, findings, because)


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
    return dict(o_ms=float(row["latency_ms"].iloc[0]), w_gbps=float(row["bandwidth_gbps"].iloc[0]))


def overhead_points(bench: pd.DataFrame) -> pd.DataFrame:
    """The bucketed overhead model's data (:func:`lab.accounting.bucket_overhead_points`), rows labelled."""
    return bucket_overhead_points(_labelled(bench))


def overhead_model(bench: pd.DataFrame, alpha_beta: dict | None) -> pd.DataFrame:
    """Per config the fitted and notebook 06's optimal bucket, and the best measured
    (:func:`lab.accounting.bucket_overhead_model`)."""
    return bucket_overhead_model(_labelled(bench), alpha_beta)


def bucket_comparisons(bench: pd.DataFrame) -> list[tuple[dict, cl.Versus]]:
    """Per config, every other bucket size against the best one (paired by round): the table's rows."""
    out = []
    for config in configs(bench):
        ok = _ok(bench, config)
        b = best(ok)
        out += [(dict(config=config, bucket_mb=r["bucket_mb"]), versus(r, b)) for _, r in ok.iterrows()
                if b is not None and r["impl"] == "bucketed" and r["bucket_mb"] != b["bucket_mb"]]
    return out


def overhead_claim(model: pd.DataFrame, bench: pd.DataFrame) -> cl.Claim:
    """Per config: the best bucket size measured and how the others compare with it; the fit's o, w and
    optimal bucket; the optimum with notebook 06's lone all-reduce."""
    findings, comparisons = [], bucket_comparisons(bench)
    for r in model.itertuples():
        c = r.config
        findings += [cl.Value(cl.Measured.value(f"best bucket size measured ({c})", r.measured_best_bucket_mb, "MB")),
                     cl.Tally(f"the other bucket sizes against it ({c})",
                              tuple(f for keys, f in comparisons if keys["config"] == c))]
        for name, source in (("fit", "the fit to these steps"), ("nb06", "notebook 06's lone all-reduce")):
            o, get = getattr(r, f"{name}_o_ms", math.nan), lambda col: getattr(r, col, math.nan)
            if math.isfinite(get(f"{name}_best_bucket_mb")):
                findings += [cl.Value(cl.Measured.value(f"{what} ({c})", value, unit)) for what, value, unit in (
                    (f"{source}: overhead per call o", *((o * 1e3, "µs") if o < 1 else (o, "ms"))),
                    ("bandwidth w", get(f"{name}_w_gbps"), "GB/s"),
                    ("the optimal bucket", get(f"{name}_best_bucket_mb"), "MB"),
                    ("the overhead at that bucket", get(f"{name}_best_overhead_ms"), "ms")) if math.isfinite(value)]
    because = ("Where the fit gives no optimum, the measured overheads do not support both terms of the model (a "
               "fitted coefficient is not positive: overlap hides more, or the noise is larger, than the model "
               "assumes).") if model["fit_best_bucket_mb"].isna().any() else ""
    return cl.Claim("Which bucket size is best, and does the overhead model predict it?", findings, because)


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
            ax.annotate(f"{cl.number(r.bucket_mb)} MB", (r.n_buckets, r.overhead_ms), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set(xscale="log", title=config, xlabel="number of all-reduce calls (buckets)",
               ylabel="median step − single-device median (ms)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------
# the performance goal


def goal_config(bench: pd.DataFrame) -> str:
    """The config the goal is set for: the first 2.7B one, else the last."""
    names = configs(bench)
    return next((c for c in names if c.startswith("2.7B")), names[-1])


def goal_comparisons(bench: pd.DataFrame, config: str, vs_torch_ddp: float = 1.0,
                     vs_single: float = 1.1) -> list[tuple[dict, cl.Versus]]:
    """The best bucketed step against torch DDP (at most ``vs_torch_ddp`` times its time) and against one
    device (at most ``vs_single`` times), paired by round: the goal table's rows."""
    ok = _ok(bench, config)
    b = best(ok)
    out = []
    for impl, target in (("torch_ddp", vs_torch_ddp), ("single_gpu", vs_single)):
        ref = _row(ok, impl)
        if b is not None and ref is not None:
            out.append((dict(config=config, check=f"best bucketed <= {target:g}x {NAMES[impl]}"),
                        versus(b, ref, goal=target)))
    return out


def goal_claim(goals: list[tuple[dict, cl.Versus]], config: str) -> cl.Claim:
    """The goal's two checks (:func:`goal_comparisons`), or "not measured" where a side did not run."""
    return cl.Claim("Is the goal met?", [f for _, f in goals] or [cl.Observed(config, "not measured")])



# hiding more: the backward's bucket order, bf16 communication, the optimizer inside the backward, a busy host


HIDE_NAMES = {"single_gpu": "one device", "torch_ddp": "torch DDP", "torch_ddp_bf16": "torch DDP (bf16 gradients)",
              "ddp_reverse": "ours (reverse order)", "ddp_ready": "ours (the backward's order)",
              "ddp_ready_bf16": "ours (bf16 gradients)",
              "ddp_ready_bf16_in_backward": "ours (optimizer in the backward)"}


def _entry(row) -> cl.Measured:
    return cl.Measured.from_row(HIDE_NAMES.get(row["entry"], row["entry"]) + (" with the host busy" if row.get(
        "busy_host", 0) else ""), row, "step_ms")


def hide_comparisons(table: pd.DataFrame) -> list[tuple[dict, cl.Versus]]:
    """Each entry of :meth:`lab.book.ddp.bench.DDPRun.hide_more`'s table against the entry one choice away,
    paired by round; ``host``: whether neighbours kept the host's cores busy."""
    ok = table[table["status"] == "ok"].set_index("entry", drop=False)
    return [(dict(entry=e, reference=r["reference"], host="busy" if r.get("busy_host", 0) else "alone"),
             cl.Versus(_entry(r), _entry(ok.loc[r["reference"]]), paired=True))
            for e, r in ok.iterrows() if r["reference"] in ok.index]


def hide_claim(alone: pd.DataFrame, busy: pd.DataFrame | None, vs_torch_ddp: float = 1.0,
               vs_single: float = 1.1) -> cl.Claim:
    """Each choice against the one a choice away, and with the host busy whether its verdict holds; the fastest
    of ours against torch DDP and one device under the goal; what bf16 communication does to the loss."""
    quiet = hide_comparisons(alone)
    said = {d["entry"]: f.verdict for d, f in quiet}
    findings: list = [f for _, f in quiet] + [cl.Observed(
        f"{f.subject.label} against {f.reference.label}", f.verdict + ("" if f.verdict == said.get(
            d["entry"]) else f", {said.get(d['entry'], 'not measured')} alone: the verdict depends on the host"))
        for d, f in (hide_comparisons(busy) if busy is not None else [])]
    ok = alone[alone["status"] == "ok"].set_index("entry", drop=False)
    ours = ok[ok["entry"].str.startswith("ddp_")].sort_values("step_ms")
    findings += [cl.Versus(_entry(ours.iloc[0]), _entry(ok.loc[ref]), goal=goal, paired=True) for ref, goal in
                 (("torch_ddp", vs_torch_ddp), ("single_gpu", vs_single)) if len(ours) and ref in ok.index]
    loss = {e: np.array(samples(c)) for e, c in ok.get("loss_curve", {}).items() if samples(c)}
    if {"ddp_ready", "ddp_ready_bf16"} <= set(loss):
        gap = float(np.max(np.abs(loss["ddp_ready_bf16"] / loss["ddp_ready"] - 1)))
        findings.append(cl.Value(cl.Measured.value(f"the loss's largest relative change in {len(loss['ddp_ready'])} "
                                                   "steps, bf16 against fp32 gradients", gap)))
    return cl.Claim("Does hiding more of the step pay: buckets in the backward's order, bf16 communication, the "
                    "optimizer inside the backward?", findings)
