"""Notebook 10's comparisons, like for like, as claims: the book's step against the fastest stock step of equal
precision, each ablation against the book's step, and a step on several nodes against one node.

A comparison holds fixed what it does not measure: the configuration (model, context, batch, ranks), the
precision (bf16 parameters, or fp32 master weights under bf16 autocast), the timer (``do_bench`` of the
headline recipes, or the host clock where an ablation is involved) and the cards. The verdicts are the rule's
(:mod:`lab.measure.verdicts`) on the rows' samples; where the book's step differs from the stock step,
:func:`lab.recipes.fastest_step.differences` says which differences any PyTorch user can make.
"""

from __future__ import annotations

import math

import pandas as pd

from lab.book.claims import Claim, Measured, Observed, Tally, Versus
from lab.book.ledger import entry
from lab.measure.verdicts import summarize
from lab.model.transformer import MODEL_SIZES, QUICK_SIZES, config_for
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
CPU_NOTE = ("On a CPU the Triton kernels run interpreted and nothing is compiled: these verdicts are about the CPU, "
            "not about GPUs.")


def with_fixed_columns(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``precision`` and ``batch`` filled where older rows lack them (the recipe's default precision,
    the configuration's batch)."""
    out = df.copy()
    if "precision" not in out.columns:
        out["precision"] = math.nan
    out["precision"] = out["precision"].astype(object).fillna(Recipe().precision)
    known = out["config"].map(lambda c: CONFIGS[c].batch_per_rank * CONFIGS[c].world_size if c in CONFIGS else math.nan)
    out["batch"] = out["batch"].fillna(known) if "batch" in out.columns else known
    return out


def _host_timed(row: pd.Series) -> bool:
    n = row.get("host_step_n")
    return pd.notna(n) and n > 0


def common_timer(a: pd.Series, b: pd.Series, same_cards: bool = True) -> str | None:
    """The column prefix under which two rows were timed the same way on the same cards: ``""`` (``step_*``)
    where both used the same timer, ``"host_"`` where both have host-clock steps; None where they ran on other
    GPUs (``gpus`` differ; not asked with ``same_cards=False``) or share no timer."""
    ga, gb = a.get("gpus"), b.get("gpus")
    if same_cards and isinstance(ga, str) and isinstance(gb, str) and ga and gb and ga != gb:
        return None
    ta, tb = a.get("timer"), b.get("timer")
    same = not (isinstance(ta, str) and isinstance(tb, str)) or ta == tb
    if same and pd.notna(a.get("step_ms")) and pd.notna(b.get("step_ms")):
        return ""
    return "host_" if _host_timed(a) and _host_timed(b) else None


def measured(row: pd.Series, prefix: str = "") -> Measured:
    """A row's step time under the timer ``prefix`` as a claim reads it, named as the book calls the recipe."""
    name = {"project": "the book's step", ABLATION_BASE: "the book's step beside its ablations"}.get(row["impl"],
                                                                                                     row["impl"])
    return Measured.from_row(f"{name} ({row['precision']})", row, f"{prefix}step_ms")


def best_stock(df: pd.DataFrame, row: pd.Series, same_precision: bool = True) -> tuple[pd.Series | None, str | None]:
    """The fastest stock step with ``row``'s configuration and batch (and precision) timed as ``row`` was, with
    that timer's column prefix; ``(None, None)`` if none ran."""
    ok = with_fixed_columns(df)
    ok = ok[(ok["status"] == "ok") & ok["impl"].map(is_stock) & (ok["config"] == row["config"])
            & (ok["batch"] == row["batch"])]
    ok = ok[(ok["precision"] == row["precision"]) == same_precision]
    best, best_prefix = None, None
    for _, cand in ok.iterrows():
        prefix = common_timer(row, cand)
        if prefix is not None and (best is None or cand[f"{prefix}step_ms"] < best[f"{best_prefix}step_ms"]):
            best, best_prefix = cand, prefix
    return best, best_prefix


def _recipe(config: str, impl: str):
    known = recipes_for(CONFIGS[config])
    known = {**known, **{r.name: r for r in ablations(known["project"])}, ABLATION_BASE: known["project"]}
    return known.get(impl)


def ledger_entries(df: pd.DataFrame) -> list[dict]:
    """What other reports measure too: a stock step on one GPU of a model size at its context (SDPA, bf16
    autocast, the model's loss, nothing recomputed; eager or compiled as a whole) as an ``lm_step`` train step
    (:mod:`lab.bench.lm`'s), and the eager one's peak as a ``peak_memory`` (03's); GPU time without collectives."""
    out, stock = [], ("bf16_autocast", "sdpa", False, "none")
    for _, r in df[(df["status"] == "ok") & (df["world_size"] == 1)].iterrows():
        rec, cfg = _recipe(r["config"], r["impl"]), CONFIGS.get(r["config"])
        if (rec is None or cfg is None or cfg.name not in {**MODEL_SIZES, **QUICK_SIZES}
                or cfg.model != config_for(cfg.name, context_length=cfg.context)
                or (rec.precision, rec.attention, rec.fused_loss, rec.checkpoint) != stock
                or rec.compile not in ("none", "model")):
            continue
        m, what = measured(r), dict(size=cfg.name, context=cfg.context, batch=r["batch"], dtype="bf16")
        out.append(entry("lm_step", m.summary, "ms", m.label, m.host_bound, m.gpu_ms,
                         attention="sdpa", compile=rec.compile == "model", fused_loss=False, mode="step", **what))
        if rec.compile == "none":
            out.append(entry("peak_memory", summarize([r["peak_gib"]]), "GiB", f"{m.label}, peak", mode="train_step",
                             checkpoint="none", **what))
    return out


def split_differences(config: str, impl: str, stock: str) -> tuple[list[str], list[str]]:
    """``impl``'s differences from ``stock`` as they run on the configuration's ranks, ``"field ours, not
    theirs"`` each: ``(stock PyTorch options, the book's own parts)``; empty where a recipe is unknown."""
    if config not in CONFIGS or _recipe(config, impl) is None or _recipe(config, stock) is None:
        return [], []
    world = CONFIGS[config].world_size
    diff = differences(_recipe(config, impl).for_world(world), _recipe(config, stock).for_world(world))
    said = [(f"{f} {a}, not {b}", option) for f, a, b, option in diff]
    return [s for s, option in said if option], [s for s, option in said if not option]


def versus_stock(df: pd.DataFrame, impls=BOOK_STEPS,
                 same_precision: bool = True) -> list[tuple[pd.Series, pd.Series, Versus]]:
    """Each ok row of ``impls`` against the fastest stock step of equal (or, ``same_precision=False``, other)
    precision timed the same way: ``(row, stock row, Versus)``."""
    full = with_fixed_columns(df)
    out = []
    for _, row in full[(full["status"] == "ok") & full["impl"].isin(impls)].iterrows():
        stock, prefix = best_stock(full, row, same_precision)
        if stock is not None:
            out.append((row, stock, Versus(measured(row, prefix), measured(stock, prefix))))
    return out


def like_for_like_table(df: pd.DataFrame) -> pd.DataFrame:
    """Each copy of the book's step against the fastest stock step of equal precision, configuration, batch,
    timer and cards: both times, the comparison's cells, and the differences split into stock PyTorch options
    and the book's own parts."""
    rows = []
    for row, stock_row, f in versus_stock(df):
        stock = stock_row["impl"]
        options, own = split_differences(row["config"], row["impl"], stock)
        rows.append(dict(book=row["impl"], precision=row["precision"], stock=stock, book_ms=f.subject.median,
                         stock_ms=f.reference.median, **f.cells(), stock_options="; ".join(options),
                         own_parts="; ".join(own)))
    return pd.DataFrame(rows)


def goal_claim(df: pd.DataFrame, config: str, target: float, on_gpu: bool = True) -> Claim:
    """Is the book's step at most ``target`` x the fastest stock step of equal precision (all else fixed)?"""
    question = f"Is the book's {config} step at most {target}x the fastest stock step of equal precision?"
    pairs = versus_stock(df, ("project",))
    if not pairs:
        failed = df[(df["impl"] == "project") & (df["status"] != "ok")]
        book = (Measured.out_of_memory("the book's step", failed["limit_gib"].iloc[0] if "limit_gib" in failed else
                                       math.nan) if len(failed) and failed["status"].iloc[0] == "oom" else None)
        return Claim(question, [Observed("the book's step", book.text() if book else "no stock step of equal "
                                         "precision, configuration and timer ran beside it")])
    row, stock, f = pairs[0]
    options, own = split_differences(config, "project", stock["impl"])
    findings = [Versus(f.subject, f.reference, goal=target),
                Observed("held fixed", f"precision {row['precision']}, batch {int(row['batch'])}, the {config} model, "
                                       f"timer {row.get('timer', 'do_bench')}")]
    if options:
        findings.append(Observed("differences any PyTorch user can set (a gain from them is stock PyTorch's too)",
                                 "; ".join(options)))
    if own:
        findings.append(Observed("the book's own parts", "; ".join(own)))
    return Claim(question, findings, because="" if on_gpu else CPU_NOTE)


def other_precision_claims(df: pd.DataFrame) -> list[Versus | Observed]:
    """The book's step against the fastest stock step at each other precision, with the differences that make
    it so (the precision among them is a stock option: that comparison does not measure the book's parts)."""
    out = []
    for row, stock, f in versus_stock(df, ("project",), same_precision=False):
        out.append(f)
        options, _ = split_differences(row["config"], "project", stock["impl"])
        if options:
            out.append(Observed("stock options among the differences", "; ".join(options)))
    return out


def ablation_versus(df: pd.DataFrame) -> list[tuple[str, pd.Series, Versus | None]]:
    """Each change to the book's step against the book's step timed the same way on the same cards (the copy
    measured beside the ablations, :data:`ABLATION_BASE`, where there is one): ``(change, row, Versus)``, the
    verdict read in one direction (slower: the change slows the step, so the recipe keeps its choice)."""
    base_name = ABLATION_BASE if ABLATION_BASE in set(df["impl"]) else "project"
    base = df[df["impl"] == base_name]
    ref = base.iloc[0] if len(base) else None
    out = []
    for _, row in df[~df["impl"].isin(("project", ABLATION_BASE)) & ~df["impl"].map(is_stock)].iterrows():
        change = change_label(row["impl"])
        prefix = "host_" if ref is not None and _host_timed(row) and _host_timed(ref) else ""
        reference = (Measured.from_row("the book's step", ref, f"{prefix}step_ms") if ref is not None
                     else Measured("the book's step", status="did not run"))
        out.append((change, row, Versus(Measured.from_row(change, row, f"{prefix}step_ms"), reference)))
    return out


def ablation_table(df: pd.DataFrame) -> pd.DataFrame:
    """What each change does to the book's step: both times, the time it adds, the comparison's cells and the
    peak memory with the change."""
    return pd.DataFrame([dict(change=change, ablation=row["impl"], step_ms=f.subject.median,
                              base_ms=f.reference.median, added_ms=f.subject.median - f.reference.median,
                              **f.cells(), peak_gib=row.get("peak_gib", math.nan))
                         for change, row, f in ablation_versus(df)])


def ablation_claim(df: pd.DataFrame, config: str, on_gpu: bool = True, fits_gib: float = FITS_GIB) -> Claim:
    """What each optimization of the book's step is worth, counted by verdict, and for a change that makes the
    step faster whether its peak still fits an 80 GB card."""
    rows = ablation_versus(df)
    findings: list = [Tally(f"each change alone against the book's {config} step", tuple(f for _, _, f in rows))]
    for change, row, f in rows:
        if f.verdict == "faster":
            peak = row.get("peak_gib", math.nan)
            fits = "not measured" if not peak == peak else "fits" if peak <= fits_gib else "does not fit"
            findings += [f, Observed("its peak on an 80 GB card", fits)]
    return Claim(f"What is each optimization of the {config} step worth?", findings,
                 because="" if on_gpu else CPU_NOTE)


def host_claim(alone: pd.DataFrame, busy: pd.DataFrame, config: str, on_gpu: bool = True) -> Claim:
    """Each change to ``config``'s step timed again beside processes that kept the host's cores busy
    (``busy``'s rows): its verdict then, and where it differs from the quiet run's, that it depends on the host."""
    said = {change: f.verdict for change, _, f in ablation_versus(alone)}
    again = ablation_versus(busy)
    findings: list = [Tally(f"each change alone against the book's {config} step, the host busy",
                            tuple(f for _, _, f in again))]
    moved = [Observed(f"{change}, the host busy", f"{f.verdict}, {said.get(change, 'not measured')} alone: the "
                      "verdict depends on the host") for change, _, f in again if f.verdict != said.get(change)]
    findings += moved or [Observed("verdicts that depend on the host", "none")]
    return Claim(f"Do the {config} step's ablation verdicts hold with the host busy?", findings,
                 because="" if on_gpu else CPU_NOTE)


def _single_node_base(name: str, configs) -> str | None:
    """The configuration among ``configs`` that trains ``name``'s model at its context and batch per rank on one
    node of its size; None for a one-node ``name``."""
    c = CONFIGS.get(name)
    if c is None or not 0 < c.gpus_per_node < c.world_size:
        return None
    return next((b for b in configs if b in CONFIGS and CONFIGS[b].model == c.model and CONFIGS[b].context == c.context
                 and CONFIGS[b].batch_per_rank == c.batch_per_rank and CONFIGS[b].world_size == c.gpus_per_node
                 and not 0 < CONFIGS[b].gpus_per_node < CONFIGS[b].world_size), None)


def _tokens_per_gpu(row: pd.Series, prefix: str, config) -> Measured:
    step = Measured.from_row("", row, f"{prefix}step_ms")
    per_gpu = config.tokens_per_step / config.world_size
    label = f"{row['impl']} on {config.world_size // max(config.gpus_per_node, 1) if config.gpus_per_node else 1} " \
            f"node(s) of {config.gpus_per_node or config.world_size} GPUs"
    if step.summary.samples:
        return Measured.of(label, [per_gpu / (ms * 1e-3) for ms in step.summary.samples], "tokens/s")
    s = step.summary
    return Measured.summarized(label, per_gpu / (s.median * 1e-3), per_gpu * s.spread / (s.median ** 2 * 1e-3), s.n,
                               "tokens/s")


def scaling_claim(df: pd.DataFrame, target: float = 0.95, on_gpu: bool = True) -> Claim | None:
    """On several nodes, each step's tokens per second per GPU against the same recipe on one node (equal tokens
    per GPU), with the goal ``>= target`` for the book's step; None where no configuration spans nodes."""
    names = list(dict.fromkeys(df["config"]))
    findings = []
    for name in names:
        base = _single_node_base(name, names)
        for impl in ("project", "stock_compiled") if base else ():
            a = df[(df["config"] == name) & (df["impl"] == impl) & (df["status"] == "ok")]
            b = df[(df["config"] == base) & (df["impl"] == impl) & (df["status"] == "ok")]
            prefix = common_timer(a.iloc[0], b.iloc[0], same_cards=False) if len(a) and len(b) else None
            if prefix is not None:
                findings.append(Versus(_tokens_per_gpu(a.iloc[0], prefix, CONFIGS[name]),
                                       _tokens_per_gpu(b.iloc[0], prefix, CONFIGS[base]), higher_is_better=True,
                                       goal=target if impl == "project" else None))
    if not findings:
        return None
    return Claim(f"On several nodes, does the book's step keep {target:.0%} of one node's tokens/s per GPU?",
                 findings, because="" if on_gpu else CPU_NOTE)


def stocks_like(df: pd.DataFrame, impl: str = "project") -> list[str]:
    """The stock steps that ran with ``impl``'s precision, configuration and batch, fastest first: those its
    profile may be set against phase by phase."""
    full = with_fixed_columns(df)
    mine = full[(full["impl"] == impl) & (full["status"] == "ok")]
    if mine.empty:
        return []
    r = mine.iloc[0]
    same = full[full["impl"].map(is_stock) & (full["status"] == "ok") & (full["config"] == r["config"])
                & (full["precision"] == r["precision"]) & (full["batch"] == r["batch"])]
    return list(same.sort_values("step_ms")["impl"])
