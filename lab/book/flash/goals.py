"""Notebook 05's performance goals and what bounds them: each goal a :class:`~lab.book.claims.Versus` with its
goal (the one rule decides met, missed or undecided), the gap by head dimension, the matrix products' rate against
a measured matmul ceiling, how the compiled kernels wait for their products, and each missed goal against a
measured bound (:func:`missed_goal_bounds`)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.bench import flash_variants as fv
from lab.bench.attention_grid import Shape
from lab.bench.flash_variants import BACKWARD_PRODUCTS, PRODUCTS, USEFUL_PRODUCTS, backward_breakdown, executed_flops
from lab.book.claims import Claim, Measured, Observed, Share, Tally, Value
from lab.book.flash import bench as fl
from lab.book.flash.grid import CONFIG_KEY, PASS_NAMES, ran, versus

#: The goals as speeds (reference time / ours, at least), against the default SDPA backend (cuDNN on Hopper): what
#: FlashAttention-3's schedule reaches against it on an H100, forward a little ahead, backward and the two at par.
GOAL_SPEED = {"fwd": 1.05, "bwd": 1.0, "e2e": 1.0}
#: Shapes with goals of their own (a pass not named has none): the 2.7B model's attention, whose kernels are short
#: enough that only forward + backward together is asked of it, at no more than SDPA's time.
SHAPE_GOAL_SPEED = {fl.SHAPE_2_7B: {"e2e": 1.0}}
#: Against FlexAttention (compiled ``flex_attention``, a peer rather than the stock default): faster on every shape.
FLEX_GOAL_SPEED = {"fwd": 1.0, "bwd": 1.0}
#: What each bound points to, by pass.
NEXT_STEPS = {
    ("fwd", "in-flight products"): "overlap each tile's softmax with the next tile's products: explicit warp-group "
                                   "MMA waits and ping-pong warp groups, as FlashAttention-3 does (Gluon)",
    ("bwd", "in-flight products"): "5 products per tile pair with a dQ accumulation that costs less than the two "
                                   "products it saves, and products kept in flight",
    ("e2e", "in-flight products"): "both passes' steps: products in flight in the forward, 5 in the backward",
    **{(p, "this shape"): "tiles and scheduling for this shape (shapes of its head dimension reach the share it "
                          "needs)" for p in PASS_NAMES},
}
FIVE_PRODUCTS = "5 products per tile pair at today's time per product would meet it"


def goal_comparisons(bench: pd.DataFrame, reference: str = "sdpa", speeds: dict = GOAL_SPEED,
                     shape_speeds: dict = SHAPE_GOAL_SPEED, dtypes=("bf16", "fp16"), min_heads: int = 16) -> list:
    """Triton against ``reference`` on the qualifying configurations (``dtype`` in ``dtypes``, batch x heads >=
    ``min_heads``), one Versus per pass with a goal, its goal the time ratio ``1 / speed``."""
    sel = bench[bench["dtype"].isin(dtypes) & (bench["batch"] * bench["heads"] >= min_heads)]

    def goal(shape: Shape, p: str):
        speed = shape_speeds.get(shape, speeds).get(p)
        return None if speed is None else 1 / speed

    return versus(sel, "triton", [reference], tuple(speeds), goals=goal)


def goals_claim(*sets: tuple[str, list]) -> Claim:
    """The goals against each reference (``(name, goal_comparisons)`` pairs): per pass, the comparisons counted by
    verdict and goal, and the one furthest beyond its goal."""
    findings = []
    for name, pairs in sets:
        for p in PASS_NAMES:
            fs = tuple(f for k, f in pairs if k["pass"] == p)
            if fs:
                findings.append(Tally(f"Triton's {PASS_NAMES[p]} against {name}", fs))
        missed = [f for _, f in pairs if f.goal_word == "missed"]
        if missed:
            findings.append(max(missed, key=lambda f: f.comparison.ratio / f.goal))
    because = "" if findings else ("No configuration qualifies: the goals need bf16 or fp16 with batch x heads of at "
                                   "least 16, measured for Triton and the reference alike.")
    return Claim("Are the performance goals met?", tuple(findings), because)


# ----------------------------------------------------------------------------------------------------------
# Why: the gap by head dimension, and the matrix products against the ceiling


WHERE = "Where are the goals missed?"


def by_head_dim(pairs: list, bench: pd.DataFrame) -> pd.DataFrame:
    """The goals' time ratios (Triton / reference) by head dimension and pass: the median over the shapes and
    dtypes, with the share of the forward tiles' columns that are the head's (``useful_columns``, the median of d
    / :func:`lab.bench.flash_variants.kernel_columns`: below 1 where a head dimension runs in one masked power-of-two
    tile, 1 where it is cut into power-of-two chunks)."""
    ratios = pd.DataFrame([dict(d=k["d"], pass_=k["pass"], ratio=f.comparison.ratio) for k, f in pairs
                           if f.comparison is not None])
    if ratios.empty:
        return pd.DataFrame(columns=["d", "shapes", "useful_columns"])
    mine = ran(bench)
    mine = mine[(mine["impl"] == "triton") & mine["d"].isin(ratios["d"])]
    table = ratios.pivot_table(index="d", columns="pass_", values="ratio", aggfunc="median").add_suffix("_median")
    table["shapes"] = ratios[ratios["pass_"] == "e2e"].groupby("d").size()
    useful = {d: float(np.median([d / fv.kernel_columns(r, "fwd") for _, r in g.iterrows()]))
              for d, g in mine.groupby("d")}
    table["useful_columns"] = table.index.map(useful)
    return table.reset_index()


def why_claim(table: pd.DataFrame) -> Claim:
    """What :func:`by_head_dim` says: the pass and head dimension furthest from its goal, a head dimension that is
    not a power of two (masked or split) against the powers of two, and how often the backward trails the forward."""
    t = table.set_index("d")
    passes = [p for p in PASS_NAMES if f"{p}_median" in t]
    if t.empty or not passes:
        return Claim(WHERE, (), "No configuration qualified for a goal.")
    worst = max(((p, d) for p in passes for d in t.index if t.loc[d, f"{p}_median"] == t.loc[d, f"{p}_median"]),
                key=lambda pd_: t.loc[pd_[1], f"{pd_[0]}_median"] * GOAL_SPEED[pd_[0]])
    out = [Observed("furthest from its goal", f"the {PASS_NAMES[worst[0]]} at d {worst[1]}")]
    powers = [d for d in t.index if d & (d - 1) == 0]
    if powers and "fwd_median" in t:
        out.append(Value(Measured.value("the forward's median time ratio at powers of two", t.loc[powers, "fwd_median"]
                                        .median(), "x")))
        for d in [d for d in t.index if d not in powers]:
            if t.loc[d, "useful_columns"] < 1:
                out.append(Share(f"the head's columns among each masked tile's at d {d}", t.loc[d, "useful_columns"],
                                 1))
            out.append(Value(Measured.value(f"the forward's median time ratio at d {d}", t.loc[d, "fwd_median"], "x")))
    if {"fwd_median", "bwd_median"} <= set(t.columns):
        out.append(Value(Measured.value("head dimensions where the backward trails the forward",
                                        int((t["bwd_median"] > t["fwd_median"]).sum()))))
    out.append(Value(Measured.value(f"the backward's time at {PRODUCTS['two_pass']} products per tile pair against "
                                    f"{USEFUL_PRODUCTS}, at equal efficiency", PRODUCTS["two_pass"] / USEFUL_PRODUCTS,
                                    "x")))
    return Claim(WHERE, tuple(out))


def _ceiling(ceilings: pd.DataFrame) -> dict:
    return ceilings.set_index("dtype")["tflops"].to_dict() if len(ceilings) and "tflops" in ceilings else {}


def backward_table(bench: pd.DataFrame, ceilings: pd.DataFrame) -> pd.DataFrame:
    """Our backward on each shape of the grid: the launch that ran (``gluon``: the Gluon kernel), products per tile
    pair, the useful and executed rates and the executed rate's share of the dtype's matmul ceiling
    (:func:`lab.bench.flash_variants.backward_breakdown`)."""
    ceiling, rows = _ceiling(ceilings), []
    for _, r in ran(bench).query("impl == 'triton'").iterrows():
        mode = r.get("bwd_mode")
        if mode in BACKWARD_PRODUCTS and r["bwd_ms"] > 0:
            top = ceiling.get(r["dtype"], math.nan)
            rows.append(dict(shape=Shape.of(r).label, dtype=r["dtype"], bwd_mode=mode, bwd_ms=r["bwd_ms"],
                             ceiling_tflops=top, **backward_breakdown(Shape.of(r), float(r["bwd_ms"]), mode, top,
                                                                      fv.kernel_columns(r, "bwd"))))
    return pd.DataFrame(rows, columns=["shape", "dtype", "bwd_mode", "products", "bwd_ms", "useful_tflops",
                                       "executed_tflops", "ceiling_tflops", "of_ceiling"])


def forward_table(bench: pd.DataFrame, ceilings: pd.DataFrame, reference: str = "sdpa") -> pd.DataFrame:
    """Triton's forward and ``reference``'s on each shape both ran: the useful rate (the two products on the d
    columns), Triton's executed rate (on the columns its tiles compute) and each one's share of the ceiling."""
    ceiling, df = _ceiling(ceilings), ran(bench)
    theirs = df[df["impl"] == reference].set_index(CONFIG_KEY)
    rows = []
    for _, r in df[df["impl"] == "triton"].iterrows():
        key = tuple(r[k] for k in CONFIG_KEY)
        if key in theirs.index:
            ref, top = theirs.loc[key], ceiling.get(r["dtype"], math.nan)
            rows.append(dict(shape=Shape.of(r).label, dtype=r["dtype"], d=int(r["d"]), triton_ms=r["fwd_ms"],
                             reference_ms=ref["fwd_ms"], triton_tflops=r["fwd_tflops"],
                             reference_tflops=ref["fwd_tflops"], ceiling_tflops=top,
                             triton_executed_tflops=r["fwd_tflops"] * fv.kernel_columns(r, "fwd") / r["d"],
                             triton_of_ceiling=r["fwd_tflops"] / top, reference_of_ceiling=ref["fwd_tflops"] / top))
    return pd.DataFrame(rows, columns=["shape", "dtype", "d", "triton_ms", "reference_ms", "triton_tflops",
                                       "reference_tflops", "triton_executed_tflops", "ceiling_tflops",
                                       "triton_of_ceiling", "reference_of_ceiling"])


def ceiling_claim(backward: pd.DataFrame, forward: pd.DataFrame, because: str = "", reference: str = "sdpa") -> Claim:
    """The backward's lowest and highest share of the ceiling (with its launch modes), and per head dimension the
    forward's median share, Triton's and ``reference``'s, on the same useful work."""
    out = []
    b = backward.dropna(subset=["of_ceiling"])
    if len(b):
        for r in (b.loc[b["of_ceiling"].idxmin()], b.loc[b["of_ceiling"].idxmax()]):
            out.append(Share(f"the backward's products on {r['shape']} {r['dtype']}, of the matmul ceiling",
                             r["of_ceiling"], 1))
        out.append(Observed("its launches", ", ".join(f"{m} ({BACKWARD_PRODUCTS[m]} products per tile pair)"
                                                      for m in b["bwd_mode"].unique())))
    for d, g in forward.dropna(subset=["triton_of_ceiling", "reference_of_ceiling"]).groupby("d"):
        out += [Share(f"Triton's forward at d {d}, median share of the ceiling", g["triton_of_ceiling"].median(), 1),
                Share(f"{reference}'s", g["reference_of_ceiling"].median(), 1)]
    return Claim("How close do the matrix products come to the matmul ceiling?", tuple(out), because or (
        "Where the reference reaches a larger share on the same useful work, the card is not the bound: the gap is "
        "how the kernel keeps the tensor cores fed (the softmax between its two products, its loads)."))


def waits_claim(waits: pd.DataFrame) -> Claim:
    """How many of each compiled kernel's matrix products are waited for at once, and, where the forward keeps
    none in flight, what that leaves the tensor cores during the softmax."""
    question = "Do the compiled kernels overlap the softmax with their matrix products?"
    if "products" not in waits or waits["products"].isna().all():  # only a note (read back: NaN columns too)
        note = waits["note"].iloc[0] if "note" in waits and len(waits) else "no kernel compiled"
        return Claim(question, (Observed("compiled for sm_90a", f"not here ({note})"),))
    findings = tuple(Share(f"{r.kernel} at d {int(r.d)}: products waited for at once", r.waited_at_once, r.products)
                     for r in waits.itertuples())
    forward = waits[waits["kernel"] == "forward"]
    because = ("So a warp group of the forward issues no matrix product while it computes a tile's exponentials; only "
               "the SM's other warp groups use the tensor cores meanwhile. Issuing the next tile's scores before the "
               "softmax does not change that: `tl.dot` gives no control over when a product is waited for. "
               "FlashAttention-3 overlaps them within a warp group, with explicit waits (the Gluon kernels)."
               if len(forward) and (forward["in_flight"] == 0).all() else "")
    return Claim(question, findings, because)


# ----------------------------------------------------------------------------------------------------------
# Each missed goal against its bound


def missed_goal_bounds(bench: pd.DataFrame, pairs: list, ceilings: pd.DataFrame,
                       waits: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per missed goal of ``pairs`` (:func:`goal_comparisons`, the reference named in ``against``). At the
    products the kernel issues (the forward's two per tile pair, the backward's 7, or 5 where the Gluon backward
    ran, on the columns its tiles compute) the time a goal allows is a rate, a share of the dtype's matmul ceiling
    (``needs_of_ceiling``); set beside the share reached on the shape (``of_ceiling``) and the most any of our
    kernels of that pass reaches on a shape of the same head dimension (``best_of_ceiling``), it names the bound:
    ``"ceiling"`` (no schedule meets it with these products), ``"in-flight products"`` (more than any of these
    kernels reaches: their compiled code waits for its products before the softmax) or ``"this shape"``, and the
    next step (:data:`NEXT_STEPS`). ``needs_with_5``: the need at 5 backward products a tile pair, today's time per
    product; the compiled kernels' product waits beside."""
    ceiling = _ceiling(ceilings)
    mine = ran(bench).query("impl == 'triton'")
    tflop = {}  # (shape label, dtype, pass) -> TFLOP issued, and the share of the ceiling reached
    for _, r in mine.iterrows():
        s = Shape.of(r)
        mode, fwd = r["bwd_mode"] if r.get("bwd_mode") in BACKWARD_PRODUCTS else "two_pass", executed_flops(
            s, "fwd", columns=fv.kernel_columns(r, "fwd")) / 1e12
        bwd = executed_flops(s, "bwd", mode, fv.kernel_columns(r, "bwd")) / 1e12
        for p, t in (("fwd", fwd), ("bwd", bwd), ("e2e", fwd + bwd)):
            reach = t / (r[f"{p}_ms"] * 1e-3) / ceiling.get(r["dtype"], math.nan)
            tflop[s.label, r["dtype"], p] = (t, bwd, reach, s.d, BACKWARD_PRODUCTS[mode])
    kernels = {"fwd": ["forward"], "bwd": ["backward dK/dV", "backward dQ"]}
    kernels["e2e"] = kernels["fwd"] + kernels["bwd"]
    rows = []
    for k, f in pairs:
        if f.goal_word != "missed" or (k["shape"], k["dtype"], k["pass"]) not in tflop:
            continue
        p = k["pass"]
        t, bwd, reach, d, products = tflop[k["shape"], k["dtype"], p]
        needs = reach * f.comparison.ratio / f.goal
        best = max((v[2] for key, v in tflop.items() if key[2] == p and v[3] == d and v[2] == v[2]), default=math.nan)
        with_5 = needs * (t - bwd * (1 - USEFUL_PRODUCTS / products)) / t if p != "fwd" else math.nan
        bound = "ceiling" if needs > 1 else "in-flight products" if needs > best else "this shape"
        step = NEXT_STEPS.get((p, bound), "fewer products: no schedule reaches this share")
        if bound == "in-flight products" and p == "bwd" and with_5 <= best:
            step = FIVE_PRODUCTS
        sel = waits[(waits["d"] == d) & waits["kernel"].isin(kernels[p])] if waits is not None and "d" in waits else []
        rows.append(dict(shape=k["shape"], dtype=k["dtype"], against=k["reference_impl"], **{"pass": p},
                         ratio=f.comparison.ratio, goal=f.goal, of_ceiling=reach, needs_of_ceiling=needs,
                         needs_with_5=with_5, best_of_ceiling=best, bound=bound, next_step=step,
                         tile_products=products if p != "fwd" else math.nan,
                         waited_at_once=int(sel["waited_at_once"].sum()) if len(sel) else math.nan,
                         products=int(sel["products"].sum()) if len(sel) else math.nan))
    return pd.DataFrame(rows, columns=["shape", "dtype", "against", "pass", "ratio", "goal", "of_ceiling",
                                       "needs_of_ceiling", "needs_with_5", "best_of_ceiling", "waited_at_once",
                                       "products", "tile_products", "bound", "next_step"])


def bounds_claim(table: pd.DataFrame) -> Claim:
    """How many missed goals each bound holds, the furthest one's needed share against the share reached and the
    best at its head dimension, and on how many shapes 5 backward products at today's time per product would do."""
    question = "What bounds each missed goal, and where does it point?"
    if table.empty:
        return Claim(question, (), "No goal was missed, so no bound is needed.")
    findings = [Value(Measured.value("missed goals", len(table)))]
    findings += [Value(Measured.value(f"held by {b}", int(n))) for b, n in table["bound"].value_counts().items()]
    w = table.loc[(table["needs_of_ceiling"] - table["best_of_ceiling"]).idxmax()]
    where = f"the {PASS_NAMES[w['pass']]} against {w['against']} on {w['shape']}"
    findings += [Share(f"{where}: the share of the matmul ceiling it would need", w["needs_of_ceiling"], 1),
                 Share("the share it reaches", w["of_ceiling"], 1),
                 Share("the best at its head dimension", w["best_of_ceiling"], 1)]
    missed = (table[table["pass"] == "bwd"].dropna(subset=["needs_with_5"])
              .sort_values("needs_with_5", ascending=False).drop_duplicates(["shape", "dtype"]))
    # the Gluon backward already issues the five useful products a tile pair; the portable one seven
    seven = missed[missed["tile_products"] > USEFUL_PRODUCTS]
    if len(missed):
        findings.append(Value(Measured.value("shapes whose backward misses a goal", len(missed))))
    if len(missed) > len(seven):
        findings.append(Value(Measured.value(f"of them, already at {USEFUL_PRODUCTS} products per tile pair (the "
                                             "Gluon kernel)", len(missed) - len(seven))))
    if len(seven):
        findings.append(Value(Measured.value(
            f"of the {len(seven)} at {PRODUCTS['two_pass']}, met by {USEFUL_PRODUCTS} per tile pair at today's time "
            "per product", int((seven["needs_with_5"] <= seven["best_of_ceiling"]).sum()))))
    because = ("A five-product portable backward with dQ added atomically was measured slower than the default: its dQ "
               "reduction cost more than the two products it saved (`results/flash_atomic_check`)."
               if len(seven) else "")
    return Claim(question, tuple(findings), because)
