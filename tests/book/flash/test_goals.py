"""The comparisons and goals of notebook 05 from known times (:mod:`lab.book.flash.goals`)."""

import math

import pandas as pd
import pytest

from lab.book.flash import goals as gl
from lab.book.flash.bench import Shape


def _timed(impl, heads, d, fwd, bwd, e2e, dtype="bf16", std=0.01, n=50):
    """A grid row whose passes have a mean, a relative spread ``std`` and ``n`` samples."""
    row = dict(impl=impl, dtype=dtype, batch=1, heads=heads, seq_len=4096, d=d, causal=True, status="ok")
    for p, ms in (("fwd", fwd), ("bwd", bwd), ("e2e", e2e)):
        row.update({f"{p}_ms": ms, f"{p}_mean_ms": ms, f"{p}_std_ms": std * ms, f"{p}_n": n})
    return row


def test_flash_goals_from_known_times():
    df = pd.DataFrame([
        _timed("sdpa", 16, 64, 1.0, 2.0, 3.0), _timed("triton", 16, 64, 0.9, 2.2, 3.1),  # all goals met
        _timed("sdpa", 32, 128, 4.0, 8.0, 12.0), _timed("triton", 32, 128, 5.0, 8.0, 12.0),  # fwd too slow
        _timed("sdpa", 1, 64, 1.0, 1.0, 1.0), _timed("triton", 1, 64, 9.0, 9.0, 9.0),  # one head: not LM-like, ignored
        _timed("sdpa", 16, 64, 1.0, 1.0, 1.0, "fp32"), _timed("triton", 16, 64, 9.0, 9.0, 9.0, "fp32"),  # fp32 ignored
    ])
    g = gl.flash_goals(df).sort_values("heads")
    assert g["heads"].tolist() == [16, 32]
    assert g["fwd_ratio"].tolist() == pytest.approx([1 / 0.9, 0.8])
    assert g["fwd_goal"].tolist() == ["met", "missed"] and g["fwd_ok"].tolist() == [True, False]
    assert g["bwd_goal"].tolist() == ["met", "met"] and g["e2e_goal"].tolist() == ["met", "met"]
    assert (g["fwd_low"] < g["fwd_ratio"]).all() and (g["fwd_ratio"] < g["fwd_high"]).all()
    s = gl.summarize_goals(g)
    assert s["configs"] == 2 and s["fwd"]["met"] == 1 and s["fwd"]["missed"] == 1
    assert s["fwd"]["worst"] == pytest.approx(0.8) and s["fwd"]["worst_config"]["heads"] == 32
    assert not s["all_met"]
    empty = gl.summarize_goals(gl.flash_goals(df[df["heads"] < 16]))
    assert empty["configs"] == 0 and not empty["all_met"] and math.isnan(empty["e2e"]["worst"])


def test_flash_goals_undecided_within_the_noise():
    """A speed ratio of 0.98 against a goal of 1.0 is "missed" with a tight spread, "undecided" with a wide one,
    and "undecided" when a pass was timed once (no spread)."""
    tight = pd.DataFrame([_timed("sdpa", 16, 64, 1.0, 1.0, 1.0), _timed("triton", 16, 64, 1 / 0.98, 0.5, 0.5)])
    assert gl.flash_goals(tight)["fwd_goal"].tolist() == ["missed"]
    wide = pd.DataFrame([_timed("sdpa", 16, 64, 1.0, 1.0, 1.0, std=0.3, n=5),
                         _timed("triton", 16, 64, 1 / 0.98, 0.5, 0.5, std=0.3, n=5)])
    assert gl.flash_goals(wide)["fwd_goal"].tolist() == ["undecided"]
    # a narrow interval, but one side scatters by more than the gap to the goal: "undecided", as in the verdicts
    scattered = pd.DataFrame([_timed("sdpa", 16, 64, 1.0, 1.0, 1.0, std=0.001, n=400),
                              _timed("triton", 16, 64, 1 / 0.9, 0.5, 0.5, std=0.12, n=400)])
    assert gl.flash_goals(scattered)["fwd_goal"].tolist() == ["undecided"]
    once = pd.DataFrame([_timed("sdpa", 16, 64, 1.0, 1.0, 1.0, n=1), _timed("triton", 16, 64, 0.5, 0.5, 0.5, n=1)])
    g = gl.flash_goals(once)
    assert g["fwd_goal"].tolist() == ["undecided"] and g["fwd_ratio"].tolist() == pytest.approx([2.0])
    assert not gl.summarize_goals(g)["all_met"]


def test_versus_gives_speedups_and_verdicts():
    df = pd.DataFrame([_timed("triton", 16, 64, 1.0, 2.0, 3.0), _timed("sdpa", 16, 64, 2.0, 2.0, 2.0),
                       _timed("pytorch_naive", 16, 64, 1.0, 1.0, 1.0),
                       {**_timed("sdpa_cudnn", 16, 64, 1.0, 1.0, 1.0), "status": "unsupported"}])
    vs = gl.versus(df, "triton", ["sdpa", "pytorch_naive", "sdpa_cudnn"]).set_index(["reference", "pass"])
    assert vs.loc[("sdpa", "fwd"), "speedup"] == pytest.approx(2.0) and vs.loc[("sdpa", "fwd"), "verdict"] == "faster"
    assert vs.loc[("sdpa", "bwd"), "verdict"] == "within noise"
    assert vs.loc[("sdpa", "e2e"), "verdict"] == "slower" and vs.loc[("sdpa", "e2e"), "speedup"] == pytest.approx(2 / 3)
    low, high = vs.loc[("sdpa", "e2e"), ["low", "high"]]
    assert low < 2 / 3 < high
    assert "sdpa_cudnn" not in vs.index.get_level_values("reference")  # did not run: nothing to compare
    assert len(vs) == 6



def test_a_shape_with_goals_of_its_own():
    """The 2.7B shape is asked only forward + backward >= 0.9x: its other passes are "n/a" and count for nothing,
    and the worst configuration is the one furthest below its own target."""
    short = dict(batch=4, heads=32, seq_len=512, d=80)
    df = pd.DataFrame([{**_timed("sdpa", 16, 64, 1.0, 1.0, 1.0), **short},
                       {**_timed("triton", 16, 64, 2.0, 1.0, 1 / 0.92), **short},  # fwd 0.5x, e2e 0.92x
                       _timed("sdpa", 16, 64, 1.0, 1.0, 1.0), _timed("triton", 16, 64, 1.0, 1.0, 1 / 0.93)])
    g = gl.flash_goals(df).set_index("seq_len")
    assert g.loc[512, "fwd_goal"] == "n/a" and not g.loc[512, "fwd_ok"] and math.isnan(g.loc[512, "fwd_target"])
    assert g.loc[512, "fwd_ratio"] == pytest.approx(0.5)  # measured all the same
    assert g.loc[512, "e2e_goal"] == "met" and g.loc[512, "e2e_target"] == 0.9
    assert g.loc[4096, "e2e_goal"] == "missed" and g.loc[4096, "e2e_target"] == 0.95
    s = gl.summarize_goals(g.reset_index())
    assert s["fwd"]["checked"] == 1 and s["e2e"]["checked"] == 2 and s["e2e"]["met"] == 1
    assert s["e2e"]["worst_config"]["seq_len"] == 4096 and s["e2e"]["worst_target"] == 0.95
    met = gl.summarize_goals(g.reset_index().iloc[[0]])
    assert met["all_met"]  # the 2.7B row alone: its one goal is met, the passes without one do not count
    assert gl.SHAPE_GOALS[Shape(4, 32, 512, 80)] == {"e2e": 0.9}


def test_rows_timed_differently_are_not_compared():
    """A CUDA-graph replay (the device's time) is never compared with an eager time (the host's launches in it)."""
    graph = {**_timed("triton", 16, 64, 1.0, 1.0, 1.0), "timing": "graph"}
    eager = {**_timed("sdpa", 16, 64, 2.0, 2.0, 2.0), "timing": "eager"}
    df = pd.DataFrame([graph, eager])
    assert gl.flash_goals(df).empty and gl.versus(df, "triton", ["sdpa"]).empty
    mine, theirs = gl.add_speedups(df, ("sdpa",))["fwd_speedup_vs_sdpa"]
    assert math.isnan(mine) and theirs == 1.0  # SDPA's own row is 1 against itself
    alike = pd.DataFrame([graph, {**eager, "timing": "graph"}])
    assert gl.flash_goals(alike)["fwd_ratio"].tolist() == pytest.approx([2.0])
    assert gl.add_speedups(alike, ("sdpa",))["fwd_speedup_vs_sdpa"].tolist() == pytest.approx([2.0, 1.0])
    old = pd.DataFrame([_timed("triton", 16, 64, 1.0, 1.0, 1.0), _timed("sdpa", 16, 64, 2.0, 2.0, 2.0)])
    assert len(gl.flash_goals(old)) == 1  # tables from before graph timing have no timing column
