"""Verdicts claim a difference only beyond the measured spread."""

import math

import numpy as np
import pytest

from lab.measure import verdicts
from lab.measure.verdicts import check_goal, compare, compare_summaries


def _samples(center, spread, n=12, seed=0):
    return list(center + spread * np.random.default_rng(seed).standard_normal(n))


def test_clear_difference_is_claimed_both_ways():
    fast, slow = _samples(10.0, 0.1), _samples(20.0, 0.2, seed=1)
    c = compare(fast, slow)
    assert c.verdict == "faster" and c.ratio == pytest.approx(0.5, rel=0.02) and c.high < 1
    assert "2" in c.describe("A", "B") and "faster than B" in c.describe("A", "B")
    assert compare(slow, fast).verdict == "slower"


def test_difference_inside_the_noise_is_not_claimed():
    # 3% apart but with 20% spread: no claim
    a, b = _samples(10.0, 2.0, seed=2), _samples(10.3, 2.0, seed=3)
    c = compare(a, b)
    assert c.verdict == "within noise" and c.low < 1 < c.high and not c.decided
    assert "within noise of" in c.describe("A", "B")


def test_one_sample_has_no_spread():
    c = compare([10.0], [20.0])
    assert c.verdict == "within noise" and math.isinf(c.high)
    assert "no spread" in c.describe("A", "B")
    assert c.label == "no spread" and not c.spread_measured
    assert compare([10.0, 10.1], [20.0, 20.2]).label == "faster"
    with pytest.raises(ValueError):
        compare([], [1.0])


def test_higher_is_better_words():
    assert compare(_samples(300, 1), _samples(200, 1, seed=4), lower_is_better=False).verdict == "higher"


def test_summaries_delta_method():
    c = compare_summaries(10.0, 0.1, 10, 20.0, 0.2, 10)
    assert c.verdict == "faster" and c.ratio == 0.5
    # se of the log ratio = sqrt(2 * 0.01^2 / 10) = 0.004472; the interval is 0.5 * exp(+-1.96 * 0.004472)
    se = math.sqrt(2 * 1e-4 / 10)
    assert c.high == pytest.approx(0.5 * math.exp(1.959964 * se), rel=1e-6)
    assert c.low == pytest.approx(0.5 * math.exp(-1.959964 * se), rel=1e-6)
    huge = compare_summaries(10.0, 30.0, 3, 10.0, 30.0, 3)
    assert huge.low > 0 and huge.verdict == "within noise"
    assert compare_summaries(10.0, 3.0, 5, 10.5, 3.0, 5).verdict == "within noise"
    assert compare_summaries(10.0, 0.0, 1, 20.0, 0.0, 1).verdict == "within noise"


def test_goals_met_missed_undecided():
    ours, stock = _samples(7.0, 0.05), _samples(10.0, 0.05, seed=5)
    assert check_goal(ours, stock, 0.8).met is True
    assert check_goal(ours, stock, 0.6).met is False
    undecided = check_goal(_samples(8.0, 0.8, seed=6), _samples(10.0, 0.8, seed=7), 0.8)
    assert undecided.met is None and "undecided" in undecided.describe("ours", "stock")
    assert check_goal([8.0], [10.0], 0.9).met is None


def test_a_spread_as_wide_as_the_effect_is_within_noise():
    # four samples each: the bootstrap interval of the ratio excludes 1, but the reference scatters by more
    # (robust std 1.4826 x 95 = 141 ms) than the gap between the medians (123.5 ms)
    subject, reference = [100.0, 101.0, 102.0, 103.0], [110.0, 150.0, 300.0, 400.0]
    c = verdicts.compare(subject, reference)
    assert c.high < 1 and c.verdict == "within noise"
    clear = verdicts.compare(subject, [200.0, 201.0, 202.0, 203.0])
    assert clear.verdict == "faster"
    outlier = verdicts.compare(subject, [200.0, 201.0, 202.0, 900.0])  # one wild sample does not hide the gap
    assert outlier.verdict == "faster"
    s = verdicts.compare_summaries(100.0, 10.0, 50, 130.0, 40.0, 50)  # gap 30 < the reference's std 40
    assert s.high < 1 and s.verdict == "within noise"
    assert verdicts.compare_summaries(100.0, 10.0, 50, 130.0, 20.0, 50).verdict == "faster"


def test_span_prints_one_number_when_the_ends_agree():
    assert verdicts.span(2.0, 2.0004, lambda v: f"{v:.3f}") == "2.000"
    assert verdicts.span(1.5, 2.25) == "1.5-2.25"


def test_a_value_smaller_than_its_spread_is_not_quotable():
    assert verdicts.quotable(354.0, 286.0)
    assert not verdicts.quotable(30.0, 45.0)
    assert verdicts.quotable(30.0, float("nan"))
    assert not verdicts.quotable(float("nan"), 1.0)


def test_within_noise_says_why_when_the_interval_excludes_one():
    """Each side scattering by more than the gap is "within noise" even with an interval off 1; the clause
    says so instead of leaving an interval above 1 next to "within noise"."""
    c = compare_summaries(117.0, 30.0, 40, 100.0, 30.0, 40)
    assert c.verdict == "within noise" and c.low > 1.0
    assert "scatter" in c.describe("zero1", "ddp")
    plain = compare_summaries(101.0, 30.0, 40, 100.0, 30.0, 40)
    assert plain.low < 1.0 < plain.high and "scatter" not in plain.describe("a", "b")
