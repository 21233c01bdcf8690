"""lab.book.flash.goals: the goals under the one rule, the gap by head dimension, the products against the matmul
ceiling, the product waits and the bounds of missed goals, from synthetic rows (values and verdicts)."""

import math

import pandas as pd
import pytest

from lab.accounting.attention import attention_flops
from lab.bench.attention_grid import Shape
from lab.book.claims import Share, Tally, Versus
from lab.book.flash import goals
from lab.book.flash.bench import SHAPE_2_7B
from tests.book.flash.rows import grid_row, table

A, B = Shape(1, 16, 4096, 64), Shape(2, 16, 4096, 128)


def _words(pairs):
    return {(k["shape"], k["pass"]): f.goal_word for k, f in pairs}


def test_goals_are_versus_findings_with_the_goal_as_a_time_ratio():
    bench = table(grid_row("sdpa", A, ms=1.0), grid_row("triton", A, ms=0.9),  # all met
                  grid_row("sdpa", B, ms=4.0), grid_row("triton", B, ms=5.0, factors=(1.0, 1.5, 2.3)),  # fwd missed
                  grid_row("sdpa", Shape(1, 1, 4096, 64), ms=1.0), grid_row("triton", Shape(1, 1, 4096, 64), ms=9.0),
                  grid_row("sdpa", A, "fp32", 1.0), grid_row("triton", A, "fp32", 9.0))  # one head, fp32: no goal
    pairs = goals.goal_comparisons(bench)
    assert all(isinstance(f, Versus) for _, f in pairs) and len(pairs) == 6
    assert {k["pass"]: f.goal for k, f in pairs if k["shape"] == A.label} == pytest.approx(
        {"fwd": 1 / 1.05, "bwd": 1.0, "e2e": 1.0})
    assert _words(pairs) == {(A.label, "fwd"): "met", (A.label, "bwd"): "met", (A.label, "e2e"): "met",
                             (B.label, "fwd"): "missed", (B.label, "bwd"): "met", (B.label, "e2e"): "met"}
    claim = goals.goals_claim(("SDPA", pairs))
    tallies = [f for f in claim.findings if isinstance(f, Tally)]
    assert [t.goal_counts() for t in tallies] == [{"met": 1, "missed": 1}, {"met": 2}, {"met": 2}]
    furthest = claim.findings[-1]
    assert isinstance(furthest, Versus) and furthest.comparison.ratio == pytest.approx(1.25)
    empty = goals.goals_claim(("SDPA", goals.goal_comparisons(bench[bench["heads"] < 16])))
    assert empty.findings == () and empty.because


def test_goals_within_the_noise_are_undecided():
    """A time ratio 2% past the forward's goal is missed with a tight spread, undecided with a wide one or a
    spread that covers the gap, and undecided with fewer than 5 samples."""
    def word(spread, n, ratio=1.02 / goals.GOAL_SPEED["fwd"]):
        bench = table(grid_row("sdpa", A, ms=1.0, spread=spread, n=n), grid_row("triton", A, ms=ratio, spread=spread,
                                                                                n=n))
        return _words(goals.goal_comparisons(bench))[A.label, "fwd"]

    assert word(0.001, 400) == "missed" and word(0.3, 5) == "undecided" and word(0.001, 4) == "undecided"
    assert word(0.05, 400) == "undecided"  # a narrow interval, but each side scatters by more than the gap


def test_the_2_7b_shape_and_flex_goals():
    short = SHAPE_2_7B
    bench = table(grid_row("sdpa", short, timing="graph"), grid_row("triton", short, factors=(2.0, 1.0, 3 * 0.98),
                                                                    timing="graph", bwd_n=0),
                  grid_row("flex", A, ms=1.2), grid_row("triton", A, ms=1.0, factors=(1.0, 2.5, 3.0)))
    pairs = goals.goal_comparisons(bench)
    assert [(k["shape"], k["pass"]) for k, _ in pairs] == [(short.label, "e2e")]  # its one goal, SDPA's time
    assert pairs[0][1].goal == pytest.approx(1.0) and pairs[0][1].goal_word == "met"
    flex = goals.goal_comparisons(bench, "flex", goals.FLEX_GOAL_SPEED, shape_speeds={})
    assert _words(flex) == {(A.label, "fwd"): "met", (A.label, "bwd"): "missed"}


def _goal_grid():
    rows = []
    for shape, ratios in ((Shape(1, 16, 4096, 64), (0.96, 0.85, 0.87)), (Shape(4, 32, 2048, 80), (0.70, 0.65, 0.66)),
                          (Shape(1, 32, 4096, 80), (0.68, 0.63, 0.66)), (Shape(8, 16, 2048, 128), (0.73, 0.73, 0.74))):
        rows.append(grid_row("sdpa", shape))  # speed ratios: SDPA's time / Triton's
        rows.append(grid_row("triton", shape, factors=tuple(f / r for f, r in zip((1.0, 2.0, 3.0), ratios)),
                             gpu="cpu"))  # measured by the interpreter: d 80 in one masked 128-wide tile
    return table(*rows)


def test_by_head_dim_and_why_claim():
    bench = _goal_grid()
    t = goals.by_head_dim(goals.goal_comparisons(bench), bench).set_index("d")
    assert t.loc[80, "shapes"] == 2 and t.loc[80, "fwd_median"] == pytest.approx((1 / 0.70 + 1 / 0.68) / 2)
    assert t.loc[80, "useful_columns"] == 0.625 and t.loc[128, "useful_columns"] == 1.0
    findings = goals.why_claim(t.reset_index()).findings
    assert findings[0].seen == "the backward at d 80"  # 1/0.64 x 1.0 beyond 1/0.69 x 1.05
    values = {getattr(f, "measured", None) and f.measured.label: f for f in findings}
    powers = values["the forward's median time ratio at powers of two"].measured.median
    assert powers == pytest.approx((1 / 0.96 + 1 / 0.73) / 2)
    share = next(f for f in findings if isinstance(f, Share))
    assert share.fraction == 0.625
    assert values["head dimensions where the backward trails the forward"].measured.median == 2
    assert values[next(k for k in values if k and "equal efficiency" in k)].measured.median == pytest.approx(7 / 5)


CEILING = pd.DataFrame([{"dtype": "bf16", "n": 8192, "tflops": 700.0}])


def test_backward_and_forward_against_the_ceiling():
    bench = table(grid_row("triton", SHAPE_2_7B, ms=0.1, bwd_mode="fused", fwd_columns=80, bwd_columns=128),
                  grid_row("sdpa", SHAPE_2_7B, ms=0.05),
                  grid_row("triton", B, ms=1.0, bwd_mode="two_pass"), grid_row("triton", A, "fp32", ms=1.0))
    back = goals.backward_table(bench, CEILING)
    assert back["shape"].tolist() == [SHAPE_2_7B.label, B.label] and back["products"].tolist() == [7, 7]
    useful = attention_flops(4, 512, 80, True, "bwd", heads=32) / 0.2e-3 / 1e12
    assert back.loc[0, "useful_tflops"] == pytest.approx(useful)
    assert back.loc[0, "executed_tflops"] == pytest.approx(useful * 7 / 5 * 128 / 80)
    assert back.loc[0, "of_ceiling"] == pytest.approx(back.loc[0, "executed_tflops"] / 700)
    fwd = goals.forward_table(bench, CEILING)
    assert fwd["shape"].tolist() == [SHAPE_2_7B.label]  # the others have no SDPA row
    work = attention_flops(4, 512, 80, True, "fwd", heads=32) / 1e12
    assert fwd.loc[0, "triton_of_ceiling"] == pytest.approx(work / 0.1e-3 / 700)
    assert fwd.loc[0, "reference_of_ceiling"] == pytest.approx(work / 0.05e-3 / 700)
    shares = [f.fraction for f in goals.ceiling_claim(back, fwd).findings if isinstance(f, Share)]
    assert shares == pytest.approx([back["of_ceiling"].min(), back["of_ceiling"].max(),
                                    fwd.loc[0, "triton_of_ceiling"], fwd.loc[0, "reference_of_ceiling"]])
    assert goals.backward_table(bench, CEILING.iloc[:0])["of_ceiling"].isna().all()


def test_waits_claim_reads_the_compiled_kernels():
    waits = pd.DataFrame([("forward", 64, 4, 4), ("backward dK/dV", 64, 8, 6), ("backward dQ", 64, 6, 6)],
                         columns=["kernel", "d", "products", "waited_at_once"])
    waits["in_flight"] = waits["products"] - waits["waited_at_once"]
    claim = goals.waits_claim(waits)
    assert [(f.part, f.whole) for f in claim.findings] == [(4, 4), (6, 8), (6, 6)] and claim.because
    overlapped = waits.assign(waited_at_once=[2, 6, 6], in_flight=[2, 2, 0])
    assert goals.waits_claim(overlapped).because == ""
    noted = goals.waits_claim(pd.DataFrame({"note": ["no ptxas"], "products": [math.nan]}))
    assert "no ptxas" in noted.findings[0].seen


def _bound_row(impl, seq, fwd, bwd, e2e, d=64):
    return grid_row(impl, Shape(1, 16, seq, d), ms=fwd, spread=0.001, n=100, factors=(1.0, bwd / fwd, e2e / fwd),
                    bwd_mode="two_pass" if impl == "triton" else None, fwd_columns=d, bwd_columns=d)


def _tflop(seq, pass_):
    return attention_flops(1, seq, 64, True, pass_, heads=16) / 1e12


WAITS = pd.DataFrame([dict(kernel="forward", d=64, products=4, waited_at_once=4),
                      dict(kernel="backward dK/dV", d=64, products=8, waited_at_once=6),
                      dict(kernel="backward dQ", d=64, products=6, waited_at_once=6)])


def test_each_missed_goal_gets_the_share_of_the_ceiling_it_needs():
    # 8192 tokens: our forward, backward and the two take 1.25x SDPA's time, past every goal; 4096: every goal met
    bench = table(_bound_row("sdpa", 8192, 1.0, 2.0, 3.0), _bound_row("triton", 8192, 1.25, 2.5, 3.75),
                  _bound_row("sdpa", 4096, 1.0, 1.0, 1.0), _bound_row("triton", 4096, 0.5, 0.5, 0.5))
    t = goals.missed_goal_bounds(bench, goals.goal_comparisons(bench), pd.DataFrame([{"dtype": "bf16", "tflops": 1e3}]),
                                 WAITS).set_index("pass")
    assert sorted(t.index) == ["bwd", "e2e", "fwd"] and (t["shape"] == "1x16x8192x64").all()
    speed = goals.GOAL_SPEED
    fwd = t.loc["fwd"]  # it must take 1.0 / 1.05 ms for its two products: that rate against 1000 TFLOP/s
    assert fwd["needs_of_ceiling"] == pytest.approx(_tflop(8192, "fwd") / (1e-3 / speed["fwd"]) / 1e3)
    assert fwd["of_ceiling"] == pytest.approx(_tflop(8192, "fwd") / 1.25e-3 / 1e3)
    assert fwd["best_of_ceiling"] == pytest.approx(max(_tflop(4096, "fwd") / 0.5e-3, _tflop(8192, "fwd") / 1.25e-3)
                                                   / 1e3)
    assert (fwd["waited_at_once"], fwd["products"]) == (4, 4)
    bwd = t.loc["bwd"]  # 7/5 of the useful FLOPs, in 2.0 / 1.0 ms
    assert bwd["needs_of_ceiling"] == pytest.approx(_tflop(8192, "bwd") * 7 / 5 / (2.0e-3 / speed["bwd"]) / 1e3)
    assert bwd["needs_with_5"] == pytest.approx(bwd["needs_of_ceiling"] * 5 / 7)
    assert (bwd["waited_at_once"], bwd["products"]) == (12, 14)
    both = _tflop(8192, "fwd") + _tflop(8192, "bwd") * 7 / 5
    assert t.loc["e2e", "needs_of_ceiling"] == pytest.approx(both / (3.0e-3 / speed["e2e"]) / 1e3)


def test_the_bound_is_read_from_the_shares():
    slow = [_bound_row("sdpa", 8192, 1.0, 2.0, 3.0), _bound_row("triton", 8192, 1.25, 2.5, 3.75)]
    fast = [_bound_row("sdpa", 4096, 1.0, 1.0, 1.0), _bound_row("triton", 4096, 0.05, 0.1, 0.15)]
    other_d = [_bound_row("sdpa", 4096, 1.0, 1.0, 1.0, d=128), _bound_row("triton", 4096, 0.05, 0.1, 0.15, d=128)]
    high = pd.DataFrame([{"dtype": "bf16", "tflops": 1e4}])

    def bounds(rows, ceiling=high):
        bench = table(*rows)
        return goals.missed_goal_bounds(bench, goals.goal_comparisons(bench), ceiling)

    assert set(bounds(slow + fast)["bound"]) == {"this shape"}  # another shape of d 64 reaches the share
    assert set(bounds(slow + other_d)["bound"]) == {"in-flight products"}  # d 128 says nothing about d 64
    alone = bounds(slow)
    assert set(alone["bound"]) == {"in-flight products"}
    assert alone.set_index("pass").loc["bwd", "next_step"] == goals.FIVE_PRODUCTS  # 5/7 of its need is reached
    assert set(bounds(slow, pd.DataFrame([{"dtype": "bf16", "tflops": 1.0}]))["bound"]) == {"ceiling"}
    claim = goals.bounds_claim(alone)
    values = {f.measured.label: f.measured.median for f in claim.findings if hasattr(f, "measured")}
    assert values["missed goals"] == 3 and values["held by in-flight products"] == 3
    assert values["shapes whose backward misses a goal"] == 1
    assert values["of the 1 at 7, met by 5 per tile pair at today's time per product"] == 1
    gluon = goals.bounds_claim(alone.assign(tile_products=5))  # the Gluon backward: already at five products
    labels = {f.measured.label: f.measured.median for f in gluon.findings if hasattr(f, "measured")}
    assert labels["of them, already at 5 products per tile pair (the Gluon kernel)"] == 1
    assert not any("met by 5" in label for label in labels) and gluon.because == ""
    assert goals.bounds_claim(alone.iloc[:0]).findings == ()


def test_a_gluon_backward_is_counted_at_five_products():
    """Where the Gluon backward ran (bwd_mode "gluon"), its executed FLOPs are the useful ones: five products a
    tile pair, not the portable kernel's seven."""
    shape = Shape(1, 16, 8192, 128)
    bench = table(grid_row("triton", shape, ms=1.0, bwd_mode="gluon"), grid_row("triton", B, ms=1.0, bwd_mode="fused"))
    back = goals.backward_table(bench, CEILING).set_index("bwd_mode")
    assert back.loc["gluon", "products"] == 5 and back.loc["fused", "products"] == 7
    useful = attention_flops(1, 8192, 128, True, "bwd", heads=16) / 2e-3 / 1e12  # grid_row: bwd 2 ms at ms=1
    assert back.loc["gluon", "executed_tflops"] == pytest.approx(back.loc["gluon", "useful_tflops"])
    assert back.loc["gluon", "useful_tflops"] == pytest.approx(useful)
