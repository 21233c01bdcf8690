"""What the 09 accounting notebook shows: sympy derivations displayed as equations, and the tables, plots
and sentences built from its result tables (formulas evaluated by :mod:`lab.book.accounting.bench`, and other
notebooks' measurements read back with their provenance).

Every sentence is generated from a table, so it stays true when a formula or a measurement changes. The
XXL questions of section 2 are presented by :mod:`lab.book.accounting.xxl`.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import sympy as sp

from lab import accounting as acc
from lab import paths
from lab.book.report import Chapter, fmt, say, show_table
from lab.measure import results as store

# ----------------------------------------------------------------------------------------------------------
# equations


def equation_latex(lhs: str, rhs) -> str:
    """``lhs = rhs`` in LaTeX, ``rhs`` a sympy expression (or anything sympy can print)."""
    return f"{lhs} = {sp.latex(rhs)}"


def show_equation(lhs: str, rhs) -> str:
    """Display ``lhs = rhs`` as an equation (plain text outside a notebook); returns its LaTeX."""
    latex = equation_latex(lhs, rhs)
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
    out.append(show_equation(r"\frac{T_{\text{alternate}}}{T_{\text{all-reduce}}}\Big|_{\alpha=0}", ratio))
    return out


def show_max_device_equations(matrices: int = 3) -> list[str]:
    """The largest device count before communication dominates one FFN's training step, per strategy."""
    out = [show_equation(rf"N_{{\max}}^{{\mathrm{{{s.upper()}}}}}", acc.max_devices(s, "train", matrices=matrices))
           for s in ("dp", "fsdp", "tp")]
    over = acc.max_devices("fsdp_tp", "train", "overlapped", matrices=matrices)
    shared = acc.max_devices("fsdp_tp", "train", "shared", matrices=matrices)
    out.append(show_equation(r"X_{\max},\ Y_{\max}\ \text{(overlapped)}", sp.Tuple(over["X"], over["Y"])))
    out.append(show_equation(r"(X, Y)^{*}\ \text{(shared link)}", sp.Tuple(shared["X"], shared["Y"])))
    out.append(show_equation(r"N_{\max}^{\mathrm{2D,\,shared}}", sp.factor(shared["N"])))
    return out


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


# ----------------------------------------------------------------------------------------------------------
# 1 · the language model


def memory_figure(memory: pd.DataFrame, batch: int, context: int):
    """Stacked bars of predicted training memory by kind, one panel per precision policy."""
    parts = ["params_gib", "grads_gib", "optimizer_gib", "weight_copies_gib", "activations_gib"]
    precisions = list(dict.fromkeys(memory["precision"]))
    fig, axes = plt.subplots(1, len(precisions), figsize=(14, 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, prec in zip(axes, precisions):
        sub = memory[memory["precision"] == prec].set_index("size")[parts]
        sub.columns = [c.removesuffix("_gib") for c in sub.columns]
        sub.plot.bar(stacked=True, ax=ax, legend=ax is axes[-1])
        ax.set_title(prec)
        ax.set_ylabel("GiB (predicted)")
    axes[-1].legend(bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.suptitle(f"Training memory by kind, batch {batch} x context {context}")
    return fig


def memory_sentence(memory: pd.DataFrame, batch: int, context: int) -> str:
    """The largest model's predicted AdamW step under the three precision policies."""
    size = memory["size"].iloc[-1]
    big = memory[memory["size"] == size].set_index("precision")
    f, a, p = big.loc["fp32"], big.loc["bf16_autocast"], big.loc["bf16"]
    return (f"For the {size} model at batch {batch} and context {context}, an fp32 AdamW step needs "
            f"**{f['total_gib']:.1f} GiB**, of which {f['activations_gib'] / f['total_gib']:.0%} are saved "
            f"activations. Autocast changes the total to {a['total_gib']:.1f} GiB: it saves "
            f"{f['activations_gib'] - a['activations_gib']:.1f} GiB of activations but adds "
            f"{a['weight_copies_gib']:.1f} GiB of bf16 weight copies and keeps the fp32 state; only pure bf16 "
            f"halves the state ({p['total_gib']:.1f} GiB in total).")


def flops_sentence(flops: pd.DataFrame, context: int) -> str:
    """Where attention's score matmuls matter in the forward FLOPs."""
    hi, lo = flops["attention_share"].idxmax(), flops["attention_share"].idxmin()
    return (f"At context {context}, attention's score matmuls are {flops.loc[hi, 'attention_share']:.1%} of the "
            f"forward FLOPs for the {flops.loc[hi, 'size']} model and {flops.loc[lo, 'attention_share']:.1%} for the "
            f"{flops.loc[lo, 'size']} model: the matrices grow with $D^2$, the scores only with $D$.")


# ----------------------------------------------------------------------------------------------------------
# 3 · ring collectives


def collectives_pivot(coll: pd.DataFrame, devices=(2, 4, 8, 16, 64)) -> pd.DataFrame:
    """Time (ms) of each collective (columns) at a few device counts (rows)."""
    sel = coll[coll["devices"].isin(devices)]
    out = sel.assign(time_ms=sel["time_s"] * 1e3).pivot(index="devices", columns="collective", values="time_ms")
    out.columns.name = None
    return out.reset_index().astype({"devices": str})


def collectives_figure(coll: pd.DataFrame):
    """Time of each ring collective against the device count (log scale)."""
    fig, ax = plt.subplots()
    data = coll.assign(time_ms=coll["time_s"] * 1e3)
    # all-gather and reduce-scatter cost the same: dashes keep both visible
    sns.lineplot(data=data, x="devices", y="time_ms", hue="collective", style="collective", ax=ax)
    ax.set_yscale("log")
    ax.set_xlabel("devices N")
    ax.set_ylabel("time (ms)")
    s, w = coll["size_bytes"].iloc[0], coll["bandwidth"].iloc[0]
    ax.set_title(f"Ring collectives, S = {s / 1e9:g} GB, W = {w / 1e9:g} GB/s")
    return fig


def collectives_sentence(coll: pd.DataFrame) -> str:
    """The all-reduce's saturation at 2S/W against the alternate ring's linear growth."""
    t = coll.assign(time_ms=coll["time_s"] * 1e3).set_index(["collective", "devices"])["time_ms"]
    s, w = coll["size_bytes"].iloc[0], coll["bandwidth"].iloc[0]
    n_lo, n_hi = int(coll["devices"].min()), int(coll["devices"].max())
    return (f"For S = {s / 1e9:g} GB and W = {w / 1e9:g} GB/s, the ring all-reduce takes "
            f"{t['all_reduce', n_lo]:.2f} ms on {n_lo} devices and {t['all_reduce', n_hi]:.2f} ms on {n_hi}: it "
            f"saturates at $2S/W$ = {2 * s / w * 1e3:.2f} ms. The alternate one grows linearly, to "
            f"{t['alternate_all_reduce', n_hi]:.1f} ms ({t['alternate_all_reduce', n_hi] / t['all_reduce', n_hi]:.0f}x)"
            f" at N = {n_hi}.")


def simulator_sentence(sim: pd.DataFrame) -> str:
    """How many simulated cases agree with the closed forms."""
    return (f"The simulator agrees with the closed forms in **{int(sim['match'].sum())} of {len(sim)}** cases "
            f"(bytes exactly, time to 1e-12), for N in {sorted(set(sim['devices']))} and S in "
            f"{sorted(set(sim['size_bytes']))} bytes; every device ended with the right values.")


# ----------------------------------------------------------------------------------------------------------
# 4 · one FFN under DP, FSDP, TP and 2-D


def limits_sentence(limits: pd.DataFrame, tokens: int, flops: float, bandwidth: float) -> str:
    """The largest device count before communication dominates training, per strategy."""
    lim = limits.set_index(["strategy", "phase", "network"])["max_devices"]
    return (f"With B = {tokens:,} tokens, C = {flops / 1e12:.0f} TFLOP/s and W = {bandwidth / 1e9:.0f} GB/s, training "
            f"stays compute bound up to {lim['dp', 'train', 'either']:.0f} devices with DP, "
            f"{lim['fsdp', 'train', 'either']:.0f} with FSDP, {lim['tp', 'train', 'either']:.0f} with TP, and "
            f"{lim['fsdp_tp', 'train', 'overlapped']:,.0f} with FSDP x TP on separate links "
            f"({lim['fsdp_tp', 'train', 'shared']:,.0f} if both share one link).")


def ffn_sweep_figure(sweep: pd.DataFrame, tokens: int):
    """Compute and communication time per device against the device count, one panel per strategy."""
    long = sweep.melt(id_vars=["strategy", "devices"], value_vars=["compute_s", "comm_s"], var_name="time",
                      value_name="seconds")
    g = sns.relplot(data=long, x="devices", y="seconds", hue="time", col="strategy", kind="line", marker="o",
                    height=3.5, aspect=1.1)
    g.set(xscale="log", yscale="log")
    g.figure.suptitle(f"One FFN training step, B = {tokens:,} tokens", y=1.04)
    return g.figure


def ffn_sweep_sentence(sweep: pd.DataFrame, devices: int = 64) -> str:
    """Efficiency at ``devices`` (or the largest count) with communication overlapped and not."""
    at = sweep.set_index(["strategy", "devices"])
    n = devices if devices in set(sweep["devices"]) else int(sweep["devices"].max())
    return (f"Where communication cannot overlap compute its time adds to every step, not only beyond the "
            f"crossover: at {n} devices FSDP runs at {at.loc[('fsdp', n), 'efficiency_overlapped']:.0%} of peak "
            f"with the gathers overlapped and {at.loc[('fsdp', n), 'efficiency_serial']:.0%} without; TP at "
            f"{at.loc[('tp', n), 'efficiency_overlapped']:.0%} and {at.loc[('tp', n), 'efficiency_serial']:.0%}.")


def limits_answer(limits: pd.DataFrame) -> str:
    lim = limits.set_index(["strategy", "phase", "network"])["max_devices"]
    return (f"training stays compute bound up to {lim['dp', 'train', 'either']:.0f} devices with DP, "
            f"{lim['fsdp', 'train', 'either']:.0f} with FSDP, {lim['tp', 'train', 'either']:.0f} with TP, "
            f"{lim['fsdp_tp', 'train', 'overlapped']:,.0f} with FSDP x TP (separate links).")


# ----------------------------------------------------------------------------------------------------------
# 6 · predicted vs measured


def saved_check_sentence(check: pd.DataFrame, model: dict) -> str:
    """How many saved-activation predictions match autograd to the byte."""
    r = check.iloc[0]
    return (f"The formula predicts the saved bytes exactly in **{int(check['match'].sum())} of {len(check)}** cases "
            f"(d_model {model['d_model']}, d_ff {model['d_ff']}, {model['num_layers']} blocks, batch "
            f"{int(r['batch'])} x context {int(r['context'])}).")


PEAK_COLUMNS = {"lm_step": ["fwd_peak_gib", "fwdbwd_peak_gib", "step_peak_gib"],
                "sharding_benchmark": ["peak_init_gib", "peak_before_step_gib", "peak_after_step_gib"]}


def _sidecar_line(name: str, results_dir: str) -> str:
    """Provenance of a table written before rows carried their source: its sidecar's machine(s) and commit(s)."""
    try:
        meta = store.load_provenance(name, results_dir)
    except (FileNotFoundError, ValueError):
        return "unknown machine"
    runs = meta["sources"] if isinstance(meta.get("sources"), list) else [meta]
    return "; ".join(dict.fromkeys(store.provenance_line(m) for m in runs if isinstance(m, dict)))


def measured_results(book: Chapter, name: str, source: str, columns: list[str] | None = None) -> pd.DataFrame | None:
    """Another notebook's current ``name`` table (its ``source``'s rows) with a line of provenance, or None with
    a sentence saying why there is nothing to compare: the table is absent, has no rows from ``source``, or
    lacks the peak ``columns`` (default :data:`PEAK_COLUMNS`). A table written before rows carried a
    ``source`` is read whole, and said so."""
    columns = columns if columns is not None else PEAK_COLUMNS.get(name, [])
    path = f"`{book.results_dir}/{name}.csv`"
    try:
        raw = store.load_results(name, book.results_dir)
    except FileNotFoundError:
        say(f"No {path}: run {source} to measure it, then re-render this notebook.")
        return None
    if "source" in raw.columns:
        if not (raw["source"] == source).any():
            say(f"{path} has no rows from {source}: run {source} to measure them, then re-render this notebook.")
            return None
        df = book.other(name, source=source)
    else:
        df = raw
        say(f"*`{name}`: {len(df)} rows written before rows carried a `source` column, so {source}'s rows cannot "
            f"be told from other notebooks' and all are read; measured on {_sidecar_line(name, book.results_dir)}.*")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        say(f"{path} has no {', '.join(f'`{c}`' for c in missing)} column: it predates each mode's own peak "
            "memory, so its rows are not compared. Re-run " + source + " to measure them.")
        return None
    return df


def save_memory_check(book: Chapter, check: pd.DataFrame, name: str = "accounting_memory_check") -> None:
    """Save the predicted-vs-measured rows as this notebook's ``name`` table (also when empty, so an older
    comparison does not linger); nothing when replaying. The comparison itself is always made afresh from
    the other notebooks' current results, which is what a replay of this notebook should show."""
    if book.replays(name):
        return
    csv = paths.resolve(book.results_dir) / f"{name}.csv"
    if csv.exists():
        header = pd.read_csv(csv, nrows=0).columns
        if "source" in header and "table" not in header:
            # written before rows carried their provenance, when `source` named the compared table: that
            # column would be taken for the notebook that wrote the rows, so the old table goes whole
            csv.unlink()
            csv.with_suffix(".json").unlink(missing_ok=True)
    store.save_results(check, name, book.results_dir, book.params, source=book.notebook)


def memory_check_display(check: pd.DataFrame) -> pd.DataFrame:
    """The predicted-vs-measured rows, sorted, with the columns worth reading."""
    if check.empty:
        return check
    cols = ["table", "impl", "size", "context", "batch", "dtype", "attention", "compile", "world_size",
            "predicted_gib", "measured_gib", "ratio", "params_gib", "grads_gib", "optimizer_gib",
            "weight_copies_gib", "activations_gib"]
    return check[[c for c in cols if c in check.columns]].sort_values(["table", "size", "context", "impl"])


def memory_check_figure(check: pd.DataFrame, tolerance: float):
    """Measured against predicted peak (log-log) with the line of agreement and the tolerance band; None
    when there is nothing to plot."""
    if check.empty:
        return None
    fig, ax = plt.subplots(figsize=(6, 6))
    sns.scatterplot(data=check, x="predicted_gib", y="measured_gib", hue="dtype", style="table", ax=ax)
    lo = float(min(check["predicted_gib"].min(), check["measured_gib"].min())) * 0.8
    hi = float(max(check["predicted_gib"].max(), check["measured_gib"].max())) * 1.25
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1, ls="--", label="measured = predicted")
    band = [lo, hi]
    ax.fill_between(band, [v * (1 - tolerance) for v in band], [v * (1 + tolerance) for v in band], color="gray",
                    alpha=0.15, label=f"±{tolerance:.0%}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted peak (GiB)")
    ax.set_ylabel("measured peak (GiB)")
    ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left")
    return fig


def disagreements(check: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """The rows whose measured peak is off the prediction by more than ``tolerance`` (relative)."""
    if check.empty:
        return check
    return check[(check["ratio"] - 1).abs() > tolerance]


def memory_check_sentence(check: pd.DataFrame, tolerance: float, tables_read: int = 1) -> str:
    """Per table, how many comparisons agree within ``tolerance`` and the range of measured / predicted; the
    rows that do not agree are :func:`disagreements` (shown as a table). ``tables_read`` is how many measured
    tables could be read at all."""
    if check.empty:
        if not tables_read:
            return "So there is no measured peak memory to compare with the prediction in this render."
        return ("No measured peak to compare with: the tables read above hold no successful row with a measured "
                "peak memory (the CPU measures none).")
    out = []
    for table, rows in check.groupby("table", sort=True):
        bad = disagreements(rows, tolerance)
        out.append(f"`{table}`: {len(rows) - len(bad)} of {len(rows)} comparisons agree within ±{tolerance:.0%} "
                   f"(measured / predicted from {fmt(rows['ratio'].min())} to {fmt(rows['ratio'].max())}, median "
                   f"{fmt(rows['ratio'].median())})" + (f"; {len(bad)} do not" if len(bad) else "") + ".")
    n_bad = len(disagreements(check, tolerance))
    return " ".join(out) + (f" The {n_bad} rows beyond ±{tolerance:.0%}, as measured:" if n_bad else "")


def show_memory_check(check: pd.DataFrame, tolerance: float, tables=()) -> pd.DataFrame:
    """Say how many comparisons agree within ``tolerance`` and show every row that does not, as measured.
    ``tables`` are the measured tables compared (None for one that could not be read). Returns those rows."""
    bad = disagreements(check, tolerance)
    say(memory_check_sentence(check, tolerance, tables_read=sum(t is not None for t in tables)))
    if len(bad):
        show_table(memory_check_display(bad), floatfmt=".3g")
    return bad


def show_comparisons(check: pd.DataFrame, tolerance: float):
    """Every comparison as a table and a plot (nothing when there is none); returns the figure or None."""
    if check.empty:
        return None
    show_table(memory_check_display(check), floatfmt=".3g")
    return memory_check_figure(check, tolerance)


def memory_check_answer(check: pd.DataFrame, tolerance: float,
                        compared=("lm_step", "sharding_benchmark")) -> str:
    """Per table of ``compared``: how many measured peaks are within ``tolerance`` of the prediction, or that
    none was compared."""
    parts = []
    for table in compared:
        rows = check[check["table"] == table] if not check.empty else check
        if rows.empty:
            parts.append(f"`{table}`: no measured peak compared")
            continue
        bad = disagreements(rows, tolerance)
        parts.append(f"`{table}`: {len(rows) - len(bad)} of {len(rows)} measured peaks within ±{tolerance:.0%} of "
                     "the prediction" + (f", {len(bad)} not (listed in the section)" if len(bad) else ""))
    return "; ".join(parts) + "."
