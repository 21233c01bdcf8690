"""Missed goals against measured bounds (:mod:`lab.book.flash.bounds`), from known times."""

import pandas as pd
import pytest

from lab.book.flash import bounds
from lab.book.flash import goals as gl


def _row(impl, seq, fwd, bwd, e2e, mode="two_pass", d=64):
    row = dict(sweep="lm", impl=impl, dtype="bf16", batch=1, heads=16, seq_len=seq, d=d, causal=True, status="ok",
               gpu="NVIDIA H100 80GB HBM3", bwd_mode=mode if impl == "triton" else None, fwd_columns=d,
               bwd_columns=d)
    for p, ms in (("fwd", fwd), ("bwd", bwd), ("e2e", e2e)):
        row.update({f"{p}_ms": ms, f"{p}_mean_ms": ms, f"{p}_std_ms": 0.001 * ms, f"{p}_n": 100})
    return row


def _tflop(seq, pass_):
    """Useful TFLOP of 1 x 16 x seq x 64, causal: the forward's 4 x heads x seq(seq+1)/2 x d, the backward 2.5x."""
    fwd = 4 * 16 * seq * (seq + 1) / 2 * 64 / 1e12
    return {"fwd": fwd, "bwd": 2.5 * fwd}[pass_]


CEILING = pd.DataFrame([{"dtype": "bf16", "tflops": 1000.0}])
WAITS = pd.DataFrame([dict(kernel="forward", d=64, products=4, waited_at_once=4),
                      dict(kernel="backward dK/dV", d=64, products=8, waited_at_once=6),
                      dict(kernel="backward dQ", d=64, products=6, waited_at_once=6)])


def test_each_missed_goal_gets_the_share_of_the_ceiling_it_needs():
    # 8192 tokens: Triton's forward misses 1.0x (0.8x), its backward misses 0.9x (0.8x); 4096: every goal met
    bench = pd.DataFrame([_row("sdpa", 8192, 1.0, 2.0, 3.0), _row("triton", 8192, 1.25, 2.5, 3.75),
                          _row("sdpa", 4096, 1.0, 1.0, 1.0), _row("triton", 4096, 0.5, 0.5, 0.5)])
    goals = gl.flash_goals(bench)
    t = bounds.missed_goal_bounds(bench, goals, CEILING, WAITS).set_index("pass")
    assert sorted(t.index) == ["bwd", "e2e", "fwd"] and (t["shape"] == "1x16x8192x64").all()
    # the forward must take 1.0 ms / 1.0 = 1.0 ms for its two products: that rate against 1000 TFLOP/s
    fwd = t.loc["fwd"]
    assert fwd["needs_of_ceiling"] == pytest.approx(_tflop(8192, "fwd") / 1e-3 / 1000)
    assert fwd["of_ceiling"] == pytest.approx(_tflop(8192, "fwd") / 1.25e-3 / 1000)
    # the best forward of the render: here this shape's own (the 4096-token one reaches less)
    assert fwd["best_of_ceiling"] == pytest.approx(max(_tflop(4096, "fwd") / 0.5e-3, _tflop(8192, "fwd") / 1.25e-3)
                                                   / 1000)
    assert fwd["products"] == 2 and fwd["waited_at_once"] == "4 of 4"
    # the backward issues 7/5 of its useful FLOPs and must take 2.0 / 0.9 ms
    bwd = t.loc["bwd"]
    executed = _tflop(8192, "bwd") * 7 / 5
    assert bwd["needs_of_ceiling"] == pytest.approx(executed / (2.0e-3 / 0.9) / 1000)
    assert bwd["needs_with_5"] == pytest.approx(bwd["needs_of_ceiling"] * 5 / 7)
    assert bwd["products"] == 7 and bwd["waited_at_once"] == "12 of 14"
    e2e = t.loc["e2e"]
    both = _tflop(8192, "fwd") + executed
    assert e2e["needs_of_ceiling"] == pytest.approx(both / (3.0e-3 / 0.95) / 1000)
    assert e2e["needs_with_5"] == pytest.approx(e2e["needs_of_ceiling"] * (both - executed * 2 / 7) / both)
    assert e2e["products"] == 9 and e2e["waited_at_once"] == "16 of 18"
    # a render whose Triton could not compile for sm_90a has a waits table holding only a note
    noted = bounds.missed_goal_bounds(bench, goals, CEILING, pd.DataFrame({"note": ["ptxas failed"]}))
    assert set(noted["waited_at_once"]) == {"n/a"} and len(noted) == 3


def test_the_bound_is_read_from_the_shares():
    """Needing more than the ceiling, more than any kernel reaches, or what another shape already reaches."""
    slow = [_row("sdpa", 8192, 1.0, 2.0, 3.0), _row("triton", 8192, 1.25, 2.5, 3.75)]
    # 4096 tokens, 5x faster per FLOP than 8192 needs: "this shape" bounds the 8192 misses
    fast = [_row("sdpa", 4096, 1.0, 1.0, 1.0), _row("triton", 4096, 0.05, 0.1, 0.15)]
    bench = pd.DataFrame(slow + fast)
    t = bounds.missed_goal_bounds(bench, gl.flash_goals(bench), pd.DataFrame([{"dtype": "bf16", "tflops": 1e4}]))
    assert set(t["bound"]) == {"this shape"} and set(t["waited_at_once"]) == {"n/a"}
    # a fast shape of another head dimension says nothing about this one's (less matrix work per exponential)
    other_d = [_row("sdpa", 4096, 1.0, 1.0, 1.0, d=128), _row("triton", 4096, 0.05, 0.1, 0.15, d=128)]
    mixed = pd.DataFrame(slow + other_d)
    t = bounds.missed_goal_bounds(mixed, gl.flash_goals(mixed), pd.DataFrame([{"dtype": "bf16", "tflops": 1e4}]))
    assert set(t["bound"]) == {"in-flight products"} and set(t["shape"]) == {"1x16x8192x64"}
    # alone, the slow shape needs more than it reaches anywhere: its products' waits bound it
    alone = pd.DataFrame(slow)
    t = bounds.missed_goal_bounds(alone, gl.flash_goals(alone), pd.DataFrame([{"dtype": "bf16", "tflops": 1e4}]))
    assert set(t["bound"]) == {"in-flight products"}
    assert t.set_index("pass").loc["bwd", "next_step"] == bounds.FIVE_PRODUCTS  # 5/7 of 0.9/0.8 < 1
    # a ceiling below the rate the goal needs: no schedule meets it with these products
    t = bounds.missed_goal_bounds(alone, gl.flash_goals(alone), pd.DataFrame([{"dtype": "bf16", "tflops": 1.0}]))
    assert set(t["bound"]) == {"ceiling"}


def test_the_sentence_counts_bounds_and_names_the_furthest():
    bench = pd.DataFrame([_row("sdpa", 8192, 1.0, 2.0, 3.0), _row("triton", 8192, 1.25, 2.5, 3.75)])
    t = bounds.missed_goal_bounds(bench, gl.flash_goals(bench), CEILING, WAITS)
    text = bounds.bounds_sentence(t)
    assert text.startswith("3 missed goals") and "1x16x8192x64" in text
    assert "on 1 of the 1 shapes whose backward misses a goal" in text and "against sdpa" in text
    assert bounds.bounds_sentence(t.iloc[:0]).startswith("No goal was missed")
    assert "interpreted" in bounds.bounds_sentence(t, interpreted_=True)


def test_goals_against_several_references_in_one_table():
    """FlexAttention's goals (fwd and bwd >= 1x) beside SDPA's: each missed goal names its reference, and a shape
    whose backward misses both counts once in the 5-product sentence."""
    bench = pd.DataFrame([_row("sdpa", 8192, 1.0, 2.0, 3.0), _row("triton", 8192, 1.25, 2.5, 3.75),
                          _row("flex", 8192, 1.2, 2.4, 3.6)])
    both = pd.concat([gl.flash_goals(bench), gl.flash_goals(bench, reference="flex", goals=gl.FLEX_GOALS,
                                                            shape_goals={})])
    t = bounds.missed_goal_bounds(bench, both, CEILING, WAITS)
    assert sorted(zip(t["against"], t["pass"])) == [("flex", "bwd"), ("flex", "fwd"), ("sdpa", "bwd"), ("sdpa", "e2e"),
                                                    ("sdpa", "fwd")]
    flex_bwd = t[(t["against"] == "flex") & (t["pass"] == "bwd")].iloc[0]
    assert flex_bwd["target"] == 1.0 and flex_bwd["ratio"] == pytest.approx(2.4 / 2.5)
    text = bounds.bounds_sentence(t)
    assert text.startswith("5 missed goals (3 against sdpa, 2 against flex)") and "of the 1 shapes" in text
