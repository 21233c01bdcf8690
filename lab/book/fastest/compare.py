"""Notebook 10's comparisons of step times, like for like: the book's step against the stock steps, and each
ablation against the book's step.

A comparison holds fixed what it does not measure: the configuration (model, context, batch, ranks), the
precision (bf16 parameters, or fp32 master weights under bf16 autocast) and the timer (``do_bench`` of the
headline recipes, or the host clock where an ablation is involved). The book's step is set against the
fastest stock step at its own precision only; every verdict is :mod:`lab.measure.verdicts`' on the measured
spread, and on a CPU (Triton interpreted) none is given. Where the book's step differs from that stock step,
:func:`lab.recipes.fastest_step.stock_options` says which differences any PyTorch user can make.
"""

from __future__ import annotations

import math

import pandas as pd

from lab.book.report import fmt
from lab.measure.verdicts import Comparison, GoalCheck, compare_summaries, scatter_note
from lab.recipes.fastest_step import (
    ABLATION_BASE,
    CONFIGS,
    Recipe,
    ablations,
    change_label,
    differences,
    is_stock,
    recipes_for,
)

#: The book's step under the names it runs as: itself, again beside its ablations, and at fp32 master weights
#: (the precision ablation), so that it meets a stock step at each precision the stock steps ran at.
BOOK_STEPS = ("project", ABLATION_BASE, "fp32_master_weights")
#: The most a step may allocate to fit an 80 GB H100 (79.6 GiB of device memory, less the CUDA context's).
FITS_GIB = 78.0
#: A verdict's place when the rows come from a CPU: the Triton kernels ran interpreted.
NOT_JUDGED = "not judged (CPU)"


#: A goal's verdict in the sentences (:attr:`lab.measure.verdicts.GoalCheck.met`).
_GOAL_WORD = {True: "met", False: "missed", None: "undecided within the noise"}


def with_fixed_columns(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``precision`` and ``batch`` filled where older rows lack them: the precision from the row's
    ``recipe`` (its repr; the :class:`Recipe` default where none is named), the batch from its configuration
    (:data:`CONFIGS`)."""
    out = df.copy()
    if "recipe" in out.columns:
        parsed = out["recipe"].astype(str).str.extract(r"precision='(\w+)'")[0]
        out["precision"] = out["precision"].fillna(parsed) if "precision" in out.columns else parsed
    elif "precision" not in out.columns:
        out["precision"] = math.nan
    out["precision"] = out["precision"].astype(object).fillna(Recipe().precision)  # none named: the default
    if "batch" not in out.columns:
        out["batch"] = math.nan
    known = out["config"].map(lambda c: CONFIGS[c].batch_per_rank * CONFIGS[c].world_size if c in CONFIGS else math.nan)
    out["batch"] = out["batch"].fillna(known)
    return out


def _host_timed(row: pd.Series) -> bool:
    n = row.get("host_step_n")
    return pd.notna(n) and n > 0


def common_timer(a: pd.Series, b: pd.Series, same_cards: bool = True) -> str | None:
    """The column prefix under which two rows were timed the same way on the same cards: ``""``
    (``step_*``) where both used the same timer (or the rows do not say), ``"host_"`` where both have
    host-clock steps; None where they ran on different GPUs (their ``gpus`` columns differ; not asked with
    ``same_cards=False``, for steps of different rank counts) or share no timer."""
    ga, gb = a.get("gpus"), b.get("gpus")
    if same_cards and isinstance(ga, str) and isinstance(gb, str) and ga and gb and ga != gb:
        return None
    ta, tb = a.get("timer"), b.get("timer")
    same = not (isinstance(ta, str) and isinstance(tb, str)) or ta == tb
    if same and pd.notna(a.get("step_ms")) and pd.notna(b.get("step_ms")):
        return ""
    return "host_" if _host_timed(a) and _host_timed(b) else None


def comparison(row: pd.Series, ref: pd.Series, prefix: str = ""):
    """:func:`lab.measure.verdicts.compare_summaries` of two rows' ``{prefix}step_*`` columns."""
    return compare_summaries(row[f"{prefix}step_ms"], row[f"{prefix}step_std_ms"], int(row[f"{prefix}step_n"]),
                             ref[f"{prefix}step_ms"], ref[f"{prefix}step_std_ms"], int(ref[f"{prefix}step_n"]))


def best_stock(df: pd.DataFrame, row: pd.Series) -> tuple[pd.Series | None, str | None]:
    """The fastest stock step with ``row``'s configuration, batch and precision that was timed as ``row``
    was (:func:`common_timer`), and the prefix of that timer's columns; ``(None, None)`` if none ran."""
    ok = with_fixed_columns(df)
    ok = ok[(ok["status"] == "ok") & ok["impl"].map(is_stock) & (ok["config"] == row["config"])
            & (ok["precision"] == row["precision"]) & (ok["batch"] == row["batch"])]
    best, best_prefix = None, None
    for _, cand in ok.iterrows():
        prefix = common_timer(row, cand)
        if prefix is not None and (best is None or cand[f"{prefix}step_ms"] < best[f"{best_prefix}step_ms"]):
            best, best_prefix = cand, prefix
    return best, best_prefix


def _recipe(config: str, impl: str):
    if config not in CONFIGS:
        return None
    known = recipes_for(CONFIGS[config])
    known = {**known, **{r.name: r for r in ablations(known["project"])}}
    known[ABLATION_BASE] = known["project"]
    return known.get(impl)


def recipe_differences(config: str | None, impl: str, stock: str) -> list[tuple[str, object, object, bool]]:
    """:func:`lab.recipes.fastest_step.differences` of ``impl``'s recipe from ``stock``'s as they run on the
    configuration's ranks; empty where the configuration or a recipe is unknown."""
    ours, theirs = (_recipe(config, impl), _recipe(config, stock)) if config in CONFIGS else (None, None)
    if ours is None or theirs is None:
        return []
    world = CONFIGS[config].world_size
    return differences(ours.for_world(world), theirs.for_world(world))


def split_differences(config: str, impl: str, stock: str) -> tuple[list[str], list[str]]:
    """``impl``'s differences from ``stock`` (recipe fields, :func:`recipe_differences`) as ``(stock PyTorch
    options, the book's own parts)``; both empty where a recipe is unknown."""
    diff = recipe_differences(config, impl, stock)
    return [f for f, _, _, option in diff if option], [f for f, _, _, option in diff if not option]


def like_for_like_table(df: pd.DataFrame, on_gpu: bool = True) -> pd.DataFrame:
    """Each copy of the book's step (:data:`BOOK_STEPS`) against the fastest stock step of equal precision,
    configuration and batch, timed the same way: both times, the ratio with its interval, the verdict, and the
    book's differences from that stock step split into stock PyTorch options and the book's own parts."""
    rows = []
    full = with_fixed_columns(df)
    for _, row in full[(full["status"] == "ok") & full["impl"].isin(BOOK_STEPS)].iterrows():
        out = dict(book=row["impl"], precision=row["precision"], batch=row["batch"])
        stock, prefix = best_stock(full, row)
        if stock is None:
            same = full[full["impl"].map(is_stock) & (full["status"] == "ok") & (full["config"] == row["config"])
                        & (full["precision"] == row["precision"])]
            why = "none timed the same way on the same cards" if len(same) else f"none at {row['precision']}"
            rows.append({**out, "stock": why, "verdict": "not compared"})
            continue
        c = comparison(row, stock, prefix)
        options, own = split_differences(row["config"], row["impl"], stock["impl"])
        rows.append({**out, "stock": stock["impl"], "timer": "host" if prefix else row.get("timer", "do_bench"),
                     "book_ms": row[f"{prefix}step_ms"], "stock_ms": stock[f"{prefix}step_ms"],
                     "book_n": int(row[f"{prefix}step_n"]), "stock_n": int(stock[f"{prefix}step_n"]), "ratio": c.ratio,
                     "low": c.low, "high": c.high, "verdict": c.label if on_gpu else NOT_JUDGED,
                     "stock_options": ", ".join(options), "own_parts": ", ".join(own)})
    return pd.DataFrame(rows)


def versus_table(df: pd.DataFrame, on_gpu: bool = True) -> pd.DataFrame:
    """Each headline recipe's step (those timed with do_bench; ablations are :func:`ablation_table`'s) against
    the fastest stock step of its own precision: time ratio with its interval and the verdict (none on a
    CPU). Recipes that did not run say why."""
    full = with_fixed_columns(df)
    headline = full[~full["impl"].isin(BOOK_STEPS[1:]) & (full["impl"].map(is_stock) | (full["impl"] == "project"))]
    rows = []
    for _, row in headline[headline["status"] == "ok"].iterrows():
        ref, prefix = best_stock(full, row)
        out = dict(impl=row["impl"], precision=row["precision"], step_ms=row["step_ms"])
        if ref is None:
            rows.append({**out, "reference": f"no stock step at {row['precision']}", "verdict": "not compared"})
            continue
        c = comparison(row, ref, prefix)
        verdict = "reference" if ref["impl"] == row["impl"] else c.label if on_gpu else NOT_JUDGED
        rows.append({**out, "reference": ref["impl"], "ratio_to_reference": c.ratio, "low": c.low, "high": c.high,
                     "verdict": verdict})
    for impl, status in headline.loc[headline["status"] != "ok", ["impl", "status"]].itertuples(index=False):
        rows.append(dict(impl=impl, step_ms=math.nan, verdict="out of memory" if status == "oom" else status))
    return pd.DataFrame(rows)


def _held_fixed(row: pd.Series, config: str, timer: str) -> str:
    c = CONFIGS.get(config)
    gpus = f"{c.world_size} GPU{'s' if c and c.world_size > 1 else ''}" if c else ""
    shape = f"{int(row['batch'])} x {c.context:,} tokens on {gpus}" if c else f"batch {row['batch']}"
    return f"precision {row['precision']}, the {config} model at {shape}, timer {timer}"


def goal_sentence(df: pd.DataFrame, config: str, target: float, on_gpu: bool = True) -> str:
    """The goal "the book's step <= target x the fastest stock step of equal precision, configuration and
    batch", decided within the noise, with the numbers, what was held fixed, and which of the book's
    differences from that stock step are stock PyTorch options."""
    table = like_for_like_table(df, on_gpu)
    mine = table[table["book"] == "project"] if len(table) else table
    if mine.empty:
        return f"The {config} goal cannot be checked: the book's step has no time (see the table)."
    r = mine.iloc[0]
    if pd.isna(r.get("ratio")):
        ran = with_fixed_columns(df)
        ran = ran[ran["impl"].map(is_stock) & (ran["status"] == "ok")]
        others = ", ".join(f"{i} at {p}" for i, p in zip(ran["impl"], ran["precision"])) or "none"
        return (f"The {config} goal cannot be checked at equal precision: no stock step ran at "
                f"{r['precision']} (stock steps that ran: {others}).")
    if not on_gpu:
        return (f"**{config}**: the book's step took {fmt(r['book_ms'], 4)} ms and {r['stock']} "
                f"{fmt(r['stock_ms'], 4)} ms at equal precision ({r['precision']}), but on a CPU, with the Triton "
                "kernels interpreted, these times say nothing about GPUs: the goal is not evaluated here.")
    c = comparison_of(r)
    met = _GOAL_WORD[GoalCheck(c, target).met]
    if not c.spread_measured:
        met = "undecided (fewer than two timed steps, no spread)"
    text = (f"**{config}** ({_held_fixed(r, config, r['timer'])}, all held fixed): the book's step takes "
            f"{fmt(r['book_ms'], 4)} ms against {fmt(r['stock_ms'], 4)} ms for {r['stock']}, the fastest stock "
            f"step measured at that precision, a ratio of {c.ratio:.3f} (95% interval {c.low:.3f}-{c.high:.3f}"
            f"{_samples(r)}); the goal (<= {target}x) is **{met}**.")
    return text + " " + options_sentence(r, config)


def _samples(r: pd.Series) -> str:
    """``", from 2 and 3 timed steps"`` where a side has fewer than ten samples (an interval from so few is
    rough), else ``""``."""
    counts = [r.get("book_n"), r.get("stock_n")]
    if any(pd.isna(n) for n in counts) or min(counts) >= 10:  # older rows carry no counts
        return ""
    return f", from {int(counts[0])} and {int(counts[1])} timed steps"


def comparison_of(r: pd.Series):
    """The :class:`lab.measure.verdicts.Comparison` stored in a :func:`like_for_like_table` row."""
    return Comparison(r["ratio"], r["low"], r["high"], r["verdict"] if r["verdict"] != "no spread" else
                      "within noise")


def options_sentence(r: pd.Series, config: str | None = None) -> str:
    """Which of the book's differences from the stock step of a :func:`like_for_like_table` row are options of
    stock PyTorch (any gain they bring is a PyTorch user's too) and which are the book's own parts; with the
    ``config``, each with the two values (``checkpoint save_outputs, not block``)."""
    options = [o for o in str(r.get("stock_options") or "").split(", ") if o]
    own = [o for o in str(r.get("own_parts") or "").split(", ") if o]
    if not options and not own:
        return f"The book's step and {r['stock']} are the same recipe."
    values = {f: f"{f} {a}, not {b}" for f, a, b, _ in recipe_differences(config, r["book"], r["stock"])}

    def named(fields):
        return "; ".join(values.get(f, f) for f in fields) if values else ", ".join(fields)

    parts = []
    if options:
        parts.append(f"{named(options)}: {'an option' if len(options) == 1 else 'options'} any PyTorch user can "
                     "set (any time they save, stock PyTorch saves too)")
    if own:
        parts.append(f"{named(own)}: the book's own")
    return f"The book's step differs from {r['stock']} in " + "; and in ".join(parts) + "."


def ablation_table(df: pd.DataFrame, base: str = "project", on_gpu: bool = True) -> pd.DataFrame:
    """What each change to the book's step does, read in one direction: the step with the change (``change``,
    in words; ``ablation``, its recipe name) against the book's step, the time it adds (ms and x, negative:
    the change is faster) and the verdict on the change itself (``slower``, ``faster``, ``within noise``; none
    on a CPU). Each is compared with the book's step timed the same way: host-clock steps of both where the
    rows have them (``host_step_*``), else their ``step_ms``. Where the ablations ran on GPUs of their own,
    the book's step measured there (:data:`ABLATION_BASE`) is the base, so every comparison is on the same
    cards."""
    ok = df[df["status"] == "ok"].set_index("impl")
    ablated = df[~df["impl"].isin((base, "project", ABLATION_BASE)) & ~df["impl"].map(is_stock)]
    base = ABLATION_BASE if ABLATION_BASE in set(df["impl"]) else base
    if base not in ok.index:  # the book's step itself failed there: nothing to compare with
        status = df.loc[df["impl"] == base, "status"]
        why = f"not compared: {base} {status.iloc[0] if len(status) else 'did not run'}"
        return pd.DataFrame([dict(change=change_label(r.impl), ablation=r.impl, verdict=why)
                             for r in ablated.itertuples()])
    ref = ok.loc[base]
    rows = []
    for impl, row in ok.loc[ok.index.isin(ablated["impl"])].iterrows():
        prefix = "host_" if _host_timed(row) and _host_timed(ref) else ""
        c = comparison(row, ref, prefix)
        rows.append(dict(change=change_label(impl), ablation=impl, step_ms=row[f"{prefix}step_ms"],
                         base_ms=ref[f"{prefix}step_ms"], added_ms=row[f"{prefix}step_ms"] - ref[f"{prefix}step_ms"],
                         ratio=c.ratio, low=c.low, high=c.high, verdict=c.label if on_gpu else NOT_JUDGED,
                         peak_gib=row.get("peak_gib", math.nan)))
    for r in ablated[ablated["status"] != "ok"].itertuples(index=False):
        error = getattr(r, "error", "")
        rows.append(dict(change=change_label(r.impl), ablation=r.impl, verdict="out of memory" if r.status == "oom"
                         else f"{r.status}: {error[:120]}" if isinstance(error, str) and error else r.status))
    return pd.DataFrame(rows)


def ablation_sentence(df: pd.DataFrame, on_gpu: bool = True, fits_gib: float = FITS_GIB) -> str:
    """Each change to the book's step in words with what it does to the step (``+865 ms (slower)``, ``out of
    memory``), and, for a change that is faster beyond the noise, whether its peak still fits an 80 GB card
    (``fits_gib``). On a CPU no change is judged."""
    table = ablation_table(df, on_gpu=on_gpu)
    if table.empty:
        return "No ablation of the book's step ran."
    if "ratio" not in table:
        return ("No ablation of the book's step was measured: "
                + "; ".join(f"{r.change}: {r.verdict}" for r in table.itertuples()) + ".")
    if not on_gpu:
        return ("On a CPU, with the Triton kernels interpreted, the ablations' times say nothing about GPUs: "
                "the recipe's choices are not judged here.")
    parts = [f"{r.change}: {r.added_ms:+.4g} ms ({r.verdict}"
             f"{scatter_note(r.low, r.high) if r.verdict == 'within noise' else ''})"
             if r.ratio == r.ratio else f"{r.change}: {r.verdict}" for r in table.itertuples()]
    text = "Each change alone, against the book's step timed the same way: " + "; ".join(parts) + "."
    for r in table[table["verdict"] == "faster"].itertuples():
        fits = r.peak_gib <= fits_gib if r.peak_gib == r.peak_gib else None
        why = {True: f"its peak of {r.peak_gib:.3g} GiB fits an 80 GB card: a better recipe, to adopt once a "
                     "render has measured it as the book's step",
               False: f"its peak of {r.peak_gib:.3g} GiB does not fit an 80 GB card (the recipe must fit one), "
                      "so the recipe does not adopt it",
               None: "its peak memory was not measured"}[fits]
        text += f" \"{r.change}\" makes the step faster (ratio {r.ratio:.3g}), and {why}."
    return text


def stocks_like(df: pd.DataFrame, impl: str = "project") -> list[str]:
    """The stock steps that ran with ``impl``'s precision, configuration and batch, fastest first (by
    ``step_ms``): those its profile may be set against phase by phase."""
    full = with_fixed_columns(df)
    mine = full[(full["impl"] == impl) & (full["status"] == "ok")]
    if mine.empty:
        return []
    r = mine.iloc[0]
    same = full[full["impl"].map(is_stock) & (full["status"] == "ok") & (full["config"] == r["config"])
                & (full["precision"] == r["precision"]) & (full["batch"] == r["batch"])]
    return list(same.sort_values("step_ms")["impl"])


def other_precision_sentence(df: pd.DataFrame, on_gpu: bool = True) -> str:
    """The book's step against the fastest stock step at each *other* precision (the course's fp32-master
    reference on one GPU), within the noise, with the differences that make it so: where the precision is
    among them, any gain is a stock PyTorch option, not the book's parts ('' where no such stock step ran)."""
    full = with_fixed_columns(df)
    mine = full[(full["impl"] == "project") & (full["status"] == "ok")]
    if mine.empty:
        return ""
    row = mine.iloc[0]
    parts = []
    stocks = full[full["impl"].map(is_stock) & (full["status"] == "ok") & (full["config"] == row["config"])
                  & (full["batch"] == row["batch"]) & (full["precision"] != row["precision"])]
    for precision, group in stocks.groupby("precision"):
        timed = [(common_timer(row, r), r) for _, r in group.iterrows()]
        timed = [(p, r) for p, r in timed if p is not None]
        if not timed:
            continue
        prefix, stock = min(timed, key=lambda pr: pr[1][f"{pr[0]}step_ms"])
        options, own = split_differences(row["config"], "project", stock["impl"])
        if on_gpu:
            said = comparison(row, stock, prefix).describe("the book's step", f"{stock['impl']} ({precision})")
        else:
            said = (f"the book's step took {fmt(row[f'{prefix}step_ms'], 4)} ms and {stock['impl']} ({precision}) "
                    f"{fmt(stock[f'{prefix}step_ms'], 4)} ms on a CPU (not judged)")
        text = f"At a different precision, {said}"
        if options:
            text += (f"; but the two differ in {', '.join(options)}, which any PyTorch user can set, so that "
                     "comparison does not measure the book's parts (the goal holds precision fixed)")
        parts.append(text + ".")
    return " ".join(parts)


def _single_node_base(name: str, configs) -> str | None:
    """The configuration among ``configs`` that trains ``name``'s model at its context and batch per rank on one
    node of its size (the leaderboard for the leaderboard on two nodes); None for a one-node ``name``."""
    c = CONFIGS.get(name)
    if c is None or not 0 < c.gpus_per_node < c.world_size:
        return None
    return next((b for b in configs if b in CONFIGS and CONFIGS[b].model == c.model and CONFIGS[b].context == c.context
                 and CONFIGS[b].batch_per_rank == c.batch_per_rank and CONFIGS[b].world_size == c.gpus_per_node
                 and not 0 < CONFIGS[b].gpus_per_node < CONFIGS[b].world_size), None)


def scaling_sentence(df: pd.DataFrame, target: float = 0.95, on_gpu: bool = True) -> str:
    """For each configuration on several nodes, each step's tokens per second per GPU against the same recipe's
    on one node of that size (the same model, context and sequences per rank): the ratio with its interval
    (both steps timed the same way) and, for the book's step, the goal ``>= target``. ``""`` where no
    configuration spans nodes or its one-node base did not run."""
    names = list(dict.fromkeys(df["config"]))
    out = []
    for name in names:
        base = _single_node_base(name, names)
        if base is None:
            continue
        many, one = CONFIGS[name], CONFIGS[base]
        parts = []
        for impl in ("project", "stock_compiled"):
            a = df[(df["config"] == name) & (df["impl"] == impl) & (df["status"] == "ok")]
            b = df[(df["config"] == base) & (df["impl"] == impl) & (df["status"] == "ok")]
            if a.empty or b.empty:
                continue
            a, b = a.iloc[0], b.iloc[0]
            prefix = common_timer(a, b, same_cards=False)
            if prefix is None:
                continue
            per_gpu = (many.tokens_per_step / many.world_size) / (one.tokens_per_step / one.world_size)
            c = comparison(b, a, prefix)  # one node's time / several nodes': the throughput ratio at equal tokens
            c = Comparison(c.ratio * per_gpu, c.low * per_gpu, c.high * per_gpu,
                           {"faster": "lower", "slower": "higher"}.get(c.verdict, c.verdict), lower_is_better=False)
            interval = (f"95% interval {c.low:.1%}-{c.high:.1%}" if c.spread_measured else "no spread measured")
            who = "the book's step" if impl == "project" else "the stock compiled step"
            clause = (f"{who} moves {fmt(a['tokens_per_s'] / many.world_size, 4)} tokens/s per GPU on "
                      f"{many.world_size // many.gpus_per_node} nodes of {many.gpus_per_node} GPUs against "
                      f"{fmt(b['tokens_per_s'] / one.world_size, 4)} on one node ({base}): {c.ratio:.1%} ({interval})")
            if impl == "project" and on_gpu:
                clause += f"; the goal (>= {target:.0%}) is **{_GOAL_WORD[GoalCheck(c, target).met]}**"
            parts.append(clause)
        if parts:
            tail = "" if on_gpu else " On a CPU these rates say nothing about GPUs: the goal is not evaluated."
            out.append(f"**{name}**, per GPU: " + "; ".join(parts) + "." + tail)
    return " ".join(out)
