"""What the 09 accounting notebook shows: sympy derivations displayed as equations, figures and tables of its
result tables (closed forms of :mod:`lab.accounting`), and its answers as claims (:mod:`lab.book.claims`):
the language model's memory and FLOPs, the ring collectives and their simulator, one FFN under DP, FSDP, TP
and 2-D, and the predicted peak memory against what other notebooks measured (read back with the commit and
GPU that measured them). The XXL questions are :mod:`lab.book.accounting.xxl`.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import sympy as sp

from lab import accounting as acc
from lab.book.claims import Claim, Measured, Observed, Share, Value, number
from lab.book.report import Chapter, say, show_table
from lab.measure import results as store
from lab.units import GiB


def value(label: str, x: float, unit: str = "") -> Value:
    """A computed quantity as a finding (no spread: a closed form decides no verdict)."""
    return Value(Measured.value(label, x, unit))


# ----------------------------------------------------------------------------------------------------------
# equations


def show_equation(lhs: str, rhs) -> str:
    """Display ``lhs = rhs`` (``rhs`` a sympy expression) as an equation, plain text outside a notebook;
    returns its LaTeX."""
    latex = f"{lhs} = {sp.latex(rhs)}"
    try:
        from IPython import get_ipython
        from IPython.display import Math, display

        if get_ipython() is None:
            raise ImportError
        display(Math(latex))
    except ImportError:
        print(f"$${latex}$$")
    return latex


def show_parameter_count() -> list[str]:
    """The model's parameter count ``P`` and its forward matmul FLOPs, in closed form."""
    return [show_equation("P", sp.expand(acc.parameter_count_expr())),
            show_equation(r"\mathrm{FLOPs}_{\mathrm{fwd}}", acc.forward_flops_expr())]


def show_collective_equations() -> list[str]:
    """Time of each ring collective in S, N, W and the per-step latency alpha, and the alternate all-reduce's
    ratio to the bandwidth-optimal one."""
    out = [show_equation(rf"T_{{\text{{{name.replace('_', '-')}}}}}", acc.collective_time(name, alpha=acc.alpha))
           for name in acc.COLLECTIVES]
    ratio = sp.simplify(acc.alternate_ring_all_reduce_time() / acc.ring_all_reduce_time())
    return out + [show_equation(r"\frac{T_{\text{alternate}}}{T_{\text{all-reduce}}}\Big|_{\alpha=0}", ratio)]


def show_max_device_equations(matrices: int = 3) -> list[str]:
    """The largest device count before communication dominates one FFN's training step, per strategy."""
    out = [show_equation(rf"N_{{\max}}^{{\mathrm{{{s.upper()}}}}}", acc.max_devices(s, "train", matrices=matrices))
           for s in ("dp", "fsdp", "tp")]
    over = acc.max_devices("fsdp_tp", "train", "overlapped", matrices=matrices)
    shared = acc.max_devices("fsdp_tp", "train", "shared", matrices=matrices)
    return out + [show_equation(r"X_{\max},\ Y_{\max}\ \text{(overlapped)}", sp.Tuple(over["X"], over["Y"])),
                  show_equation(r"(X, Y)^{*}\ \text{(shared link)}", sp.Tuple(shared["X"], shared["Y"])),
                  show_equation(r"N_{\max}^{\mathrm{2D,\,shared}}", sp.factor(shared["N"]))]


def ffn_cost_table(matrices: int = 3) -> pd.DataFrame:
    """FLOPs and communication time per device of one FFN under each strategy and phase, as LaTeX."""
    rows = []
    for strategy in acc.STRATEGIES:
        for phase in acc.PHASES:
            c = acc.ffn_costs(strategy, phase, matrices=matrices)
            comm = " + ".join(sp.latex(sp.factor(v)) for v in c["comm_time"].values())
            rows.append(dict(strategy=strategy, phase=phase, flops_per_device=f"${sp.latex(c['flops'])}$",
                             comm_time=f"${comm}$"))
    return pd.DataFrame(rows)


def memory_figure(memory: pd.DataFrame, batch: int, context: int):
    """Stacked bars of predicted training memory by kind, one panel per precision policy."""
    parts = ["params_gib", "grads_gib", "optimizer_gib", "weight_copies_gib", "activations_gib"]
    precisions = list(dict.fromkeys(memory["precision"]))
    fig, axes = plt.subplots(1, len(precisions), figsize=(14, 4), sharey=True, squeeze=False)
    for ax, prec in zip(axes[0], precisions):
        sub = memory[memory["precision"] == prec].set_index("size")[parts]
        sub.columns = [c.removesuffix("_gib") for c in sub.columns]
        sub.plot.bar(stacked=True, ax=ax, legend=ax is axes[0][-1], title=prec, ylabel="GiB (predicted)")
    axes[0][-1].legend(bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.suptitle(f"Training memory by kind, batch {batch} x context {context}")
    return fig


def memory_claim(memory: pd.DataFrame) -> Claim:
    """The largest model's predicted AdamW step under the three precision policies."""
    size = memory["size"].iloc[-1]
    f, a, p = (memory[(memory["size"] == size) & (memory["precision"] == prec)].iloc[0]
               for prec in ("fp32", "bf16_autocast", "bf16"))
    return Claim("How much memory does an AdamW step of the largest model take?", [
        value(f"the {size} model's fp32 AdamW step", f["total_gib"] * GiB, "B"),
        Share("of it saved activations", f["activations_gib"], f["total_gib"]),
        value("under bf16 autocast", a["total_gib"] * GiB, "B"),
        value("activations autocast saves", (f["activations_gib"] - a["activations_gib"]) * GiB, "B"),
        value("bf16 weight copies it adds", a["weight_copies_gib"] * GiB, "B"),
        value("in pure bf16", p["total_gib"] * GiB, "B")],
        "Autocast keeps the fp32 state and adds a bf16 copy of every matrix; only pure bf16 halves the state.")


def flops_claim(flops: pd.DataFrame) -> Claim:
    """Where attention's score matmuls matter in the forward FLOPs: the largest and smallest share."""
    hi, lo = flops.loc[flops["attention_share"].idxmax()], flops.loc[flops["attention_share"].idxmin()]
    return Claim("How much of the forward are attention's score matmuls?", [
        Share(f"{r['size']} model", r["attention_share"], 1.0) for r in (hi, lo)],
        "The matrices grow with D², the scores only with D.")


def collectives_pivot(coll: pd.DataFrame, devices=(2, 4, 8, 16, 64)) -> pd.DataFrame:
    """Time (ms) of each collective (columns) at a few device counts (rows)."""
    sel = coll[coll["devices"].isin(devices)]
    out = sel.assign(time_ms=sel["time_s"] * 1e3).pivot(index="devices", columns="collective", values="time_ms")
    out.columns.name = None
    return out.reset_index().astype({"devices": str})


def collectives_figure(coll: pd.DataFrame):
    """Time of each ring collective against the device count (log scale)."""
    fig, ax = plt.subplots()
    # all-gather and reduce-scatter cost the same: dashes keep both visible
    sns.lineplot(data=coll.assign(time_ms=coll["time_s"] * 1e3), x="devices", y="time_ms", hue="collective",
                 style="collective", ax=ax)
    s, w = coll["size_bytes"].iloc[0], coll["bandwidth"].iloc[0]
    ax.set(yscale="log", xlabel="devices N", ylabel="time (ms)",
           title=f"Ring collectives, S = {number(s / 1e9, 'GB')}, W = {number(w / 1e9, 'GB/s')}")
    return fig


def collectives_claim(coll: pd.DataFrame) -> Claim:
    """The all-reduce on the fewest and most devices against its saturation at 2S/W, and the alternate ring's
    linear growth."""
    t = coll.set_index(["collective", "devices"])["time_s"]
    s, w = coll["size_bytes"].iloc[0], coll["bandwidth"].iloc[0]
    lo, hi = int(coll["devices"].min()), int(coll["devices"].max())
    return Claim("How long do the ring collectives take?", [
        value(f"all-reduce on {lo} devices", t["all_reduce", lo] * 1e3, "ms"),
        value(f"on {hi}", t["all_reduce", hi] * 1e3, "ms"), value("its limit 2S/W", 2 * s / w * 1e3, "ms"),
        value(f"the alternate ring on {hi}", t["alternate_all_reduce", hi] * 1e3, "ms"),
        value("over the all-reduce", t["alternate_all_reduce", hi] / t["all_reduce", hi], "x")],
        "The ring all-reduce saturates at 2S/W; the alternate one grows linearly with N.")


def simulator_claim(sim: pd.DataFrame) -> Claim:
    """How many simulated cases agree with the closed forms (bytes exactly, time to 10⁻¹² relative)."""
    return Claim("Does a step-by-step simulation agree with the closed forms?", [
        value("cases simulated", len(sim)), value("agreeing in bytes and in time", sim["match"].sum())],
        "Every device ended with the right values (checked on the way)." if sim["match"].all() else "")


def ffn_sweep_figure(sweep: pd.DataFrame, tokens: int):
    """Compute and communication time per device against the device count, one panel per strategy."""
    long = sweep.melt(id_vars=["strategy", "devices"], value_vars=["compute_s", "comm_s"], var_name="time",
                      value_name="seconds")
    g = sns.relplot(data=long, x="devices", y="seconds", hue="time", col="strategy", kind="line", marker="o",
                    height=3.5, aspect=1.1)
    g.set(xscale="log", yscale="log")
    g.figure.suptitle(f"One FFN training step, B = {number(tokens)} tokens", y=1.04)
    return g.figure


def limits_claim(limits: pd.DataFrame) -> Claim:
    """The largest device count before communication dominates training, per strategy."""
    lim = limits.set_index(["strategy", "phase", "network"])["max_devices"]
    return Claim("How far do DP, FSDP, TP and 2-D scale one SwiGLU FFN?", [
        value(label, np.floor(lim[key]), "devices") for label, key in (
            ("DP", ("dp", "train", "either")), ("FSDP", ("fsdp", "train", "either")), ("TP", ("tp", "train", "either")),
            ("FSDP x TP on separate links", ("fsdp_tp", "train", "overlapped")),
            ("FSDP x TP on one shared link", ("fsdp_tp", "train", "shared")))],
        "Each is the largest device count at which a training step stays compute bound.")


def ffn_sweep_claim(sweep: pd.DataFrame, devices: int = 64) -> Claim:
    """FSDP's and TP's share of peak FLOP/s at ``devices`` (or the largest count), overlapped and not."""
    n = devices if devices in set(sweep["devices"]) else int(sweep["devices"].max())
    at = sweep.set_index(["strategy", "devices"])
    return Claim(f"What does communication that cannot overlap cost at {n} devices?", [
        Share(f"{s.upper()} with communication {way}", at.loc[(s, n), f"efficiency_{col}"], 1.0)
        for s in ("fsdp", "tp") for way, col in (("overlapped", "overlapped"), ("not overlapped", "serial"))],
        "Where communication cannot overlap compute its time adds to every step, not only beyond the crossover.")


# ----------------------------------------------------------------------------------------------------------
# 5 · predicted against measured memory


def saved_check_claim(check: pd.DataFrame) -> Claim:
    """How many saved-activation predictions match autograd to the byte."""
    return Claim("Does the formula predict what autograd saves?",
                 [value("cases counted", len(check)), value("predicted to the byte", check["match"].sum())])


PEAK_COLUMNS = {"lm_step": ["fwd_peak_gib", "fwdbwd_peak_gib", "step_peak_gib"],
                "sharding_benchmark": ["peak_init_gib", "peak_before_step_gib", "peak_after_step_gib"]}


def measured_results(book: Chapter, name: str, source: str) -> pd.DataFrame | None:
    """Another notebook's current ``name`` rows (its ``source``'s), shown with the machine and commit that
    measured them (:meth:`~lab.book.report.Chapter.other`), or None with a sentence saying why there is
    nothing to compare: no table, no rows from ``source``, or no peak columns (:data:`PEAK_COLUMNS`)."""
    try:
        df = book.other(name, source=source)
    except (FileNotFoundError, KeyError):
        say(f"No rows of `{name}` from {source} in `{book.results_dir}`: run {source}, then re-render this notebook.")
        return None
    if any(c not in df.columns for c in PEAK_COLUMNS.get(name, [])):
        say(f"`{name}` from {source} predates each mode's own peak memory: re-run {source} to compare them.")
        return None
    return df


def save_memory_check(book: Chapter, check: pd.DataFrame, name: str = "accounting_memory_check") -> None:
    """Save the predicted-against-measured rows as this notebook's ``name`` table (also when empty, so an older
    comparison does not linger; each row keeps the GPU and commit that measured it); nothing when replaying.
    The comparison itself is always made afresh from the other notebooks' current results."""
    if not book.replays(name):
        store.save_results(check, name, book.results_dir, book.params, source=book.notebook)


def measured_on(rows: pd.DataFrame) -> str:
    """The GPUs and commits that measured ``rows`` (their ``gpu`` and ``commit`` columns), one phrase."""
    pairs = dict.fromkeys(f"{g} at commit {str(c)[:12]}" for g, c in zip(rows.get("gpu", []), rows.get("commit", []))
                          if isinstance(g, str))
    return "; ".join(pairs) or "an unrecorded machine"


def memory_check_claim(check: pd.DataFrame) -> Claim:
    """Per measured table: how many peaks were compared, which GPU and commit measured them, and the lowest,
    median and highest measured / predicted."""
    findings = []
    for table, rows in check.groupby("table", sort=True) if len(check) else ():
        findings += [Observed(f"`{table}`, measured on", measured_on(rows)), value("peaks compared", len(rows))]
        findings += [value(f"measured / predicted, {w}", f(rows["ratio"]), "x")
                     for w, f in (("lowest", np.min), ("median", np.median), ("highest", np.max))]
    return Claim("Does the predicted peak memory match the GPU measurements?", findings,
                 "" if findings else "No measured peak to compare with (a CPU measures none).")


def memory_check_display(check: pd.DataFrame, furthest: int | None = None) -> pd.DataFrame:
    """The predicted-against-measured rows with the columns worth reading; with ``furthest``, only that many
    rows furthest from their prediction (by the log of measured / predicted)."""
    cols = ["table", "impl", "size", "context", "batch", "dtype", "attention", "compile", "world_size",
            "predicted_gib", "measured_gib", "ratio", "params_gib", "grads_gib", "optimizer_gib",
            "weight_copies_gib", "activations_gib"]
    out = check[[c for c in cols if c in check.columns]]
    if out.empty:
        return out
    if furthest:
        return out.iloc[np.argsort(-np.abs(np.log(out["ratio"].to_numpy())))[:furthest]]
    return out.sort_values(["table", "size", "context", "impl"])


def show_memory_check(check: pd.DataFrame, furthest: int | None = None) -> None:
    """Show :func:`memory_check_display` (nothing when no peak was compared)."""
    if len(check):
        show_table(memory_check_display(check, furthest))


def memory_check_figure(check: pd.DataFrame):
    """Measured against predicted peak (log-log) with the line of agreement; None with nothing to plot."""
    if check.empty:
        return None
    fig, ax = plt.subplots(figsize=(6, 6))
    sns.scatterplot(data=check, x="predicted_gib", y="measured_gib", hue="dtype", style="table", ax=ax)
    lo = float(check[["predicted_gib", "measured_gib"]].min().min()) * 0.8
    hi = float(check[["predicted_gib", "measured_gib"]].max().max()) * 1.25
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1, ls="--", label="measured = predicted")
    ax.set(xscale="log", yscale="log", xlabel="predicted peak (GiB)", ylabel="measured peak (GiB)")
    ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left")
    return fig
