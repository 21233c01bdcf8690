"""Each missed performance goal of notebook 05 against a measured bound, and the next step the bound points to.

A goal asks Triton's pass to take at most the reference's time divided by the target. At the products the
kernel really issues (the forward's two per tile pair, the backward's 7 or 5, on the head-dimension columns its
tiles compute), that time is a rate, and the rate a share of the dtype's measured matmul ceiling
(``needs_of_ceiling``). Set beside what the kernel reaches on this shape (``of_ceiling``) and the most any
Triton kernel of that pass reaches on a shape of the same head dimension in the same render
(``best_of_ceiling``; a smaller head dimension does less matrix work per exponential, so it is compared only
with its own), the share says which bound holds the goal back:

* ``"ceiling"``: more than the card's matmul rate: no schedule meets it with these products;
* ``"in-flight products"``: more than any of these kernels reaches anywhere: their compiled code waits for its
  matrix products before the softmax (:mod:`lab.book.flash.schedule`), so the share they reach is capped;
* ``"this shape"``: other shapes of its head dimension already reach the share it needs: its tiles, occupancy
  or causal balance.

For the backward (and forward + backward) ``needs_with_5`` is the same share if the backward issued 5 products
per tile pair instead of 7 (atomic dQ, FlashAttention-2's and -3's count) at the same time per product.
"""

from __future__ import annotations

import math

import pandas as pd

from lab.book.flash import bench as fl
from lab.book.flash import goals as gl
from lab.book.flash.sweep import PRODUCTS, executed_flops
from lab.book.report import fmt

PASS_NAMES = {"fwd": "forward", "bwd": "backward", "e2e": "forward + backward"}
#: What each bound points to, by pass.
NEXT_STEPS = {
    ("fwd", "in-flight products"): "overlap each tile's softmax with the next tile's products: explicit "
                                   "warp-group MMA waits (Gluon), or two warp groups in ping-pong as in "
                                   "FlashAttention-3",
    ("bwd", "in-flight products"): "issue 5 products per tile pair (atomic dQ) with dQ's accumulation cheaper "
                                   "than the two products it saves, and keep products in flight",
    ("e2e", "in-flight products"): "both passes' steps: products in flight in the forward, 5 products in the "
                                   "backward",
    **{(p, "this shape"): "tiles and scheduling for this shape (shapes of its head dimension reach the share it "
                          "needs)" for p in ("fwd", "bwd", "e2e")},
}
FIVE_PRODUCTS = ("5 products per tile pair at today's time per product would meet it: a dQ accumulation that costs "
                 "less than the two products it saves")
COLUMNS = ["shape", "dtype", "against", "pass", "ratio", "target", "products", "of_ceiling", "needs_of_ceiling",
           "needs_with_5", "best_of_ceiling", "waited_at_once", "bound", "next_step"]


def executed_tflop(row, pass_: str) -> float:
    """TFLOP a Triton row's ``pass_`` really issues (:func:`lab.book.flash.sweep.executed_flops` on the
    head-dimension columns its tiles compute, :func:`lab.book.flash.bench.kernel_columns`, and its launch
    mode; a row without a known mode counts the default 7 backward products)."""
    shape, mode = fl.Shape.of(row), row.get("bwd_mode")
    fwd = executed_flops(shape, "fwd", columns=fl.kernel_columns(row, "fwd"))
    bwd = executed_flops(shape, "bwd", mode if mode in PRODUCTS else "two_pass", fl.kernel_columns(row, "bwd"))
    return {"fwd": fwd, "bwd": bwd, "e2e": fwd + bwd}[pass_] / 1e12


def _products(row, pass_: str) -> int:
    bwd = PRODUCTS.get(row.get("bwd_mode"), 7)
    return {"fwd": 2, "bwd": bwd, "e2e": 2 + bwd}[pass_]


def _waits(waits: pd.DataFrame, d: int, pass_: str) -> str:
    """``"waited of products"`` of the compiled kernels of ``pass_`` at head dimension ``d`` (the forward, or the
    backward's two programs summed), or ``"n/a"`` where the table has no kernel of that d (or holds only a note:
    this Triton could not compile for sm_90a here)."""
    if waits is None or waits.empty or "d" not in waits.columns:
        return "n/a"
    at_d = waits[waits["d"] == d]
    kernels = {"fwd": ["forward"], "bwd": ["backward dK/dV", "backward dQ"],
               "e2e": ["forward", "backward dK/dV", "backward dQ"]}[pass_]
    sel = at_d[at_d["kernel"].isin(kernels)]
    if sel.empty:
        return "n/a"
    return f"{int(sel['waited_at_once'].sum())} of {int(sel['products'].sum())}"


def missed_goal_bounds(bench: pd.DataFrame, goals: pd.DataFrame, ceilings: pd.DataFrame,
                       waits: pd.DataFrame | None = None, sweep: str = "lm") -> pd.DataFrame:
    """One row per missed goal (:func:`lab.book.flash.goals.flash_goals`' ``"missed"``; ``goals`` may hold the
    tables of several references, named in ``against``) with the share of the
    matmul ceiling (``ceilings``: ``dtype``, ``tflops``) meeting it would need, the share reached, the best share
    of that pass over the render's shapes of the same head dimension, the compiled kernels' product waits
    (``waits``, the table of :func:`lab.book.flash.schedule.product_wait_table`), the bound and the next step
    (see the module's doc)."""
    ceiling = ceilings.set_index("dtype")["tflops"].to_dict() if len(ceilings) else {}
    mine = bench[(bench["sweep"] == sweep) & (bench["impl"] == "triton") & (bench["status"] == "ok")]
    mine = mine.drop_duplicates(gl.CONFIG_KEY, keep="last").set_index(gl.CONFIG_KEY, drop=False)
    shares = {p: {} for p in PASS_NAMES}
    for key, r in mine.iterrows():
        for p in PASS_NAMES:
            if r[f"{p}_ms"] > 0:
                shares[p][key] = executed_tflop(r, p) / (r[f"{p}_ms"] * 1e-3) / ceiling.get(r["dtype"], math.nan)
    rows = []
    for _, g in goals.iterrows():
        key = tuple(g[k] for k in gl.CONFIG_KEY)
        if key not in mine.index:
            continue
        r = mine.loc[key]
        for p in PASS_NAMES:
            if g.get(f"{p}_goal") != "missed" or key not in shares[p]:
                continue
            reach, target, ratio = shares[p][key], float(g[f"{p}_target"]), float(g[f"{p}_ratio"])
            needs = reach * target / ratio
            best = max((s for k, s in shares[p].items() if s == s and k[4] == key[4]), default=math.nan)
            bwd_products = PRODUCTS.get(r.get("bwd_mode"), 7)
            with_5 = math.nan
            if p != "fwd":  # the same time per product, 5 of them in the backward
                cut = executed_tflop(r, "bwd") * (1 - 5 / bwd_products)
                with_5 = needs * (executed_tflop(r, p) - cut) / executed_tflop(r, p)
            bound = "ceiling" if needs > 1 else "in-flight products" if needs > best else "this shape"
            step = NEXT_STEPS.get((p, bound), "fewer products: no schedule reaches this share")
            if bound == "in-flight products" and p == "bwd" and with_5 <= best:
                step = FIVE_PRODUCTS
            rows.append(dict(shape=fl.Shape.of(r).label, dtype=r["dtype"], against=g.get("reference", "sdpa"),
                             **{"pass": p}, ratio=ratio, target=target, products=_products(r, p), of_ceiling=reach,
                             needs_of_ceiling=needs, needs_with_5=with_5, best_of_ceiling=best,
                             waited_at_once=_waits(waits, int(r["d"]), p), bound=bound, next_step=step))
    return pd.DataFrame(rows, columns=COLUMNS)


def bounds_sentence(table: pd.DataFrame, interpreted_: bool = False) -> str:
    """How many missed goals each bound holds, with the share of the ceiling the furthest one needs against the
    best any kernel reaches (on the CPU or without missed goals: no claim)."""
    if interpreted_:
        return "The bounds are about GPU speed; they are not read from interpreted Triton."
    if table.empty:
        return "No goal was missed, so no bound is needed."
    counts = table["bound"].value_counts()
    parts = [f"{n} by {bound}" for bound, n in counts.items()]
    against = table["against"].value_counts()
    whom = f" ({', '.join(f'{n} against {ref}' for ref, n in against.items())})" if len(against) > 1 else ""
    worst = table.loc[(table["needs_of_ceiling"] - table["best_of_ceiling"]).idxmax()]
    text = (f"{len(table)} missed goals{whom}, held {', '.join(parts)}. Furthest: the {PASS_NAMES[worst['pass']]} "
            f"against {worst['against']} on {worst['shape']} would need {fmt(100 * worst['needs_of_ceiling'], 2)}% "
            f"of the matmul ceiling with {worst['products']} products per tile pair, where it reaches "
            f"{fmt(100 * worst['of_ceiling'], 2)}% and the best {PASS_NAMES[worst['pass']]} at its head dimension in "
            f"this render {fmt(100 * worst['best_of_ceiling'], 2)}%.")
    # per shape, the most demanding of its missed backward goals (one per reference)
    five = (table[table["pass"] == "bwd"].dropna(subset=["needs_with_5"])
            .sort_values("needs_with_5", ascending=False).drop_duplicates(["shape", "dtype"]))
    if len(five):
        within = int((five["needs_with_5"] <= five["best_of_ceiling"]).sum())
        text += (f" With 5 products per tile pair at the same time per product, the backward would need no more than "
                 f"the best backward's share at its head dimension on {within} of the {len(five)} shapes whose "
                 f"backward misses a goal.")
    return text


def course_bound_sentence(course: pd.DataFrame, bench: pd.DataFrame, goal_ms: float = fl.COURSE_GOAL_MS,
                          sweep: str = "lm") -> str:
    """The course test's goal against the reference on the same work in the grid: the course's batch x seq x d
    causal bf16 is the grid's ``1 x batch x seq x d`` shape, whose forward + backward the default SDPA backend
    ran in this render, so the goal is a speed ratio against it (empty when the grid has no such shape)."""
    if course.empty:
        return ""
    c = course.iloc[0]
    ok = bench[(bench["sweep"] == sweep) & (bench["status"] == "ok") & (bench["dtype"] == "bf16") & bench["causal"]
               & (bench["batch"] * bench["heads"] == int(c["batch"])) & (bench["seq_len"] == int(c["seq_len"]))
               & (bench["d"] == int(c["d"]))].drop_duplicates("impl", keep="last").set_index("impl")
    if not {"sdpa", "triton"} <= set(ok.index):
        return ""
    ref, mine = (float(ok.loc[i].get("e2e_mean_ms", ok.loc[i]["e2e_ms"])) for i in ("sdpa", "triton"))
    return (f"The grid timed the same work ({int(c['batch'])} sequences of {int(c['seq_len'])} tokens, d "
            f"{int(c['d'])}, causal, bf16, forward + backward) in this render: SDPA's default backend "
            f"{fmt(ref)} ms and Triton {fmt(mine)} ms. So the {goal_ms:g} ms goal asks for {fmt(ref / goal_ms)}x "
            f"the default backend's speed, where Triton ran at {fmt(ref / mine)}x.")
