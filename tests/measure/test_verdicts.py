"""The one rule: a verdict only beyond the interval and both spreads, none from fewer than MIN_SAMPLES samples."""

import math
import statistics

import numpy as np
import pytest

from lab.measure import verdicts
from lab.measure.verdicts import Summary, check_goal, compare, compare_medians, compare_paired, summarize


def _samples(center, spread, n=12, seed=0):
    return list(center + spread * np.random.default_rng(seed).standard_normal(n))


def test_summary_is_median_and_robust_spread():
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0, float("nan")])
    assert s.median == 3.0 and s.n == 5 and s.samples == (1.0, 2.0, 3.0, 4.0, 100.0)
    # median absolute deviation: |x - 3| = 2, 1, 0, 1, 97 -> median 1
    assert s.spread == pytest.approx(1.4826)
    normal = summarize(_samples(0.0, 1.0, n=20000))
    assert normal.spread == pytest.approx(1.0, rel=0.03)
    assert summarize([]).n == 0 and math.isnan(summarize([]).median)


def test_clear_difference_is_claimed_both_ways():
    fast, slow = _samples(10.0, 0.1), _samples(20.0, 0.2, seed=1)
    c = compare(fast, slow)
    assert c.verdict == "faster" and c.ratio == pytest.approx(0.5, rel=0.02) and c.high < 1
    assert c.speedup == pytest.approx(2.0, rel=0.02) and c.decided
    assert c.subject.median == pytest.approx(statistics.median(fast))
    assert compare(slow, fast).verdict == "slower"


def test_difference_inside_the_noise_is_not_claimed():
    a, b = _samples(10.0, 2.0, seed=2), _samples(10.3, 2.0, seed=3)
    c = compare(a, b)
    assert c.verdict == "within noise" and c.low < 1 < c.high and not c.decided


@pytest.mark.parametrize("n", [1, 2, verdicts.MIN_SAMPLES - 1])
def test_fewer_than_min_samples_decide_nothing(n):
    c = compare([10.0 + 0.01 * i for i in range(n)], _samples(20.0, 0.1))
    assert c.verdict == "not decided" and not c.decided and not c.spread_measured
    assert c.ratio == pytest.approx(10.0 / 20.0, rel=0.01)
    assert check_goal([10.0] * n, [20.0] * 8, 0.9).met is None
    with pytest.raises(ValueError):
        compare([], [1.0])
    derived = compare(Summary(3.0, math.nan, 0), Summary(4.0, 0.1, 9))  # a difference of medians, no samples
    assert derived.verdict == "not decided" and derived.ratio == 0.75


def test_five_samples_are_enough():
    c = compare([10.0, 10.1, 10.2, 10.05, 10.15], [20.0, 20.1, 20.2, 20.05, 20.15])
    assert c.verdict == "faster"


def test_higher_is_better_words():
    assert compare(_samples(300, 1), _samples(200, 1, seed=4), lower_is_better=False).verdict == "higher"
    assert compare(_samples(100, 1), _samples(200, 1, seed=4), lower_is_better=False).verdict == "lower"


def test_medians_from_summaries():
    """The log-ratio interval with the median's standard error 1.2533 x spread / sqrt(n)."""
    c = compare_medians(Summary(10.0, 0.1, 10), Summary(20.0, 0.2, 10))
    assert c.verdict == "faster" and c.ratio == 0.5
    se = 1.2533 * math.sqrt(2 * 1e-4 / 10)
    assert c.high == pytest.approx(0.5 * math.exp(1.959964 * se), rel=1e-6)
    assert c.low == pytest.approx(0.5 * math.exp(-1.959964 * se), rel=1e-6)
    assert compare_medians(Summary(10.0, 3.0, 5), Summary(10.5, 3.0, 5)).verdict == "within noise"
    assert compare_medians(Summary(10.0, 0.1, 3), Summary(20.0, 0.1, 30)).verdict == "not decided"
    # a summary without samples is compared the same way through compare()
    assert compare(Summary(10.0, 0.1, 10), Summary(20.0, 0.2, 10)).low == pytest.approx(c.low)


def test_a_spread_as_wide_as_the_effect_is_within_noise():
    # the bootstrap interval of the ratio excludes 1, but the reference scatters by more (robust std 1.4826 x
    # 40 = 59) than the gap between the medians (48.5)
    subject, reference = [100.0, 101.0, 102.0, 103.0, 101.5], [110.0, 150.0, 300.0, 400.0, 120.0]
    c = compare(subject, reference)
    assert c.high < 1 and c.verdict == "within noise"
    assert compare(subject, [200.0, 201.0, 202.0, 203.0, 201.5]).verdict == "faster"
    outlier = compare(subject, [200.0, 201.0, 202.0, 900.0, 201.5])  # one wild sample does not hide the gap
    assert outlier.verdict == "faster"
    wide = compare_medians(Summary(100.0, 10.0, 50), Summary(130.0, 40.0, 50))  # gap 30 < the reference's 40
    assert wide.high < 1 and wide.verdict == "within noise"
    assert compare_medians(Summary(100.0, 10.0, 50), Summary(130.0, 20.0, 50)).verdict == "faster"


def test_goals_met_missed_undecided():
    ours, stock = _samples(7.0, 0.05), _samples(10.0, 0.05, seed=5)
    assert check_goal(ours, stock, 0.8).met is True and check_goal(ours, stock, 0.8).word == "met"
    assert check_goal(ours, stock, 0.6).met is False
    assert check_goal(_samples(8.0, 0.8, seed=6), _samples(10.0, 0.8, seed=7), 0.8).met is None
    # the interval sits beyond the goal, but the subject's spread covers the gap to the time the goal allows
    noisy = check_goal([9.0, 9.1, 7.5, 10.5, 9.05, 8.2, 9.9], [10.0] * 7, 0.8)
    assert noisy.comparison.low > 0.8 and noisy.met is None


def test_paired_rounds_cancel_a_slow_round():
    """Interleaved rounds: the host slows both implementations in one round; the paired ratio ignores it."""
    ref = [10.0, 10.0, 30.0, 10.0, 10.0, 10.0]
    sub = [9.0, 9.0, 27.0, 9.0, 9.0, 9.0]
    c = compare_paired(sub, ref)
    assert c.verdict == "faster" and c.ratio == pytest.approx(0.9)
    assert c.subject.median == pytest.approx(0.9) and c.reference.median == 1.0  # the per-round ratios
    assert compare_paired([1.0] * 3, [2.0] * 3).verdict == "not decided"
    assert verdicts.GoalCheck(c, 0.95).met is True
