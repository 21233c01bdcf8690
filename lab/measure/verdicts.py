"""Noise-aware verdicts: the one place that decides whether a comparison may say "faster", "slower", "goal
met" or "no extra cost".

A claim is made only when the difference exceeds the measured spread. From the samples of two
measurements (or, when only summaries are stored, their mean, standard deviation and count) we form the
ratio of the subject's typical value to the reference's and a confidence interval for it:

* samples: the ratio of medians, with a bootstrap interval (each side resampled independently);
* summaries: the ratio of means, with the delta-method normal interval.

For times (lower is better) an interval entirely below 1 says "faster", entirely above 1 "slower", and an
interval that contains 1 says "within noise". A goal ("at most 0.8x the baseline") is met only when the
whole interval is within the goal, missed when the whole interval is outside it, and otherwise undecided.
A measurement with fewer than two samples has no measured spread, so no claim can rest on it, and a
difference no wider than either side's own scatter (its standard deviation; for samples the robust one
from the median absolute deviation, so one outlier does not hide a clear gap) is "within noise" whatever
the interval says: a spread as wide as the effect decides nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Comparison:
    """Subject against reference: ``ratio`` = subject / reference (of medians or means), its interval
    ``[low, high]``, and ``verdict``: ``"faster"``, ``"slower"``, ``"within noise"`` (for a quantity where
    lower is better, like time) or ``"higher"``, ``"lower"``, ``"within noise"`` otherwise."""

    ratio: float
    low: float
    high: float
    verdict: str
    lower_is_better: bool = True

    @property
    def decided(self) -> bool:
        """True when the difference exceeds the noise."""
        return self.verdict != "within noise"

    @property
    def spread_measured(self) -> bool:
        """False when either side had fewer than two samples: the interval is infinite, nothing is decided."""
        return math.isfinite(self.low) and math.isfinite(self.high)

    @property
    def label(self) -> str:
        """The verdict for a table cell (:func:`label`)."""
        return label(self.verdict, self.low, self.high)

    @property
    def speedup(self) -> float:
        """reference / subject: how many times faster the subject is (for times)."""
        return 1.0 / self.ratio if self.ratio else math.nan

    def describe(self, subject: str, reference: str) -> str:
        """A clause for generated prose, e.g. ``"Triton is 1.23x faster than SDPA (time ratio 0.81, 95%
        interval 0.79-0.83)"`` or ``"Triton is within noise of SDPA (...)"``."""
        interval = f"ratio {self.ratio:.3g}, {CONFIDENCE:.0%} interval {span(self.low, self.high)}"
        if not math.isfinite(self.low) or not math.isfinite(self.high):
            return f"{subject} cannot be told apart from {reference}: no spread was measured (ratio {self.ratio:.3g})"
        if self.verdict == "within noise":
            return f"{subject} is within noise of {reference} ({interval}{scatter_note(self.low, self.high)})"
        if self.lower_is_better:
            if self.verdict == "faster":
                return f"{subject} is {self.speedup:.3g}x faster than {reference} ({interval})"
            return f"{subject} is {self.ratio:.3g}x slower than {reference} ({interval})"
        word = "higher" if self.verdict == "higher" else "lower"
        return f"{subject} is {self.ratio:.3g}x the value of {reference}, {word} beyond noise ({interval})"


def scatter_note(low: float, high: float) -> str:
    """For a "within noise" verdict whose interval excludes 1: why it is not decided (the gap between the two
    is no wider than either side's own scatter; see the module docstring), as a clause to append; else ""."""
    if math.isfinite(low) and math.isfinite(high) and (low > 1.0 or high < 1.0):
        return ": the gap is no wider than either side's own scatter"
    return ""


def label(verdict: str, low: float, high: float) -> str:
    """A verdict for a table cell, from a comparison's stored columns: ``"no spread"`` where no interval could
    be measured (one sample on a side: infinite bounds), since "within noise" would claim a noise that was
    never seen; the verdict otherwise."""
    return verdict if math.isfinite(low) and math.isfinite(high) else "no spread"


def _verdict(low: float, high: float, lower_is_better: bool) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return "within noise"
    if high < 1.0:
        return "faster" if lower_is_better else "lower"
    if low > 1.0:
        return "slower" if lower_is_better else "higher"
    return "within noise"


def spread_covers_effect(typical: float, ref_typical: float, spread: float, ref_spread: float) -> bool:
    """True when the gap between the two typical values is no wider than either side's own scatter (standard
    deviation): such a gap decides nothing, however narrow the interval of the ratio (a bootstrap over a
    handful of samples can exclude 1 while each side scatters by more than the gap)."""
    return abs(typical - ref_typical) <= max(spread, ref_spread)


def _robust_spread(x: np.ndarray) -> float:
    """A standard deviation that one outlier cannot inflate: 1.4826 x the median absolute deviation (equal to
    the standard deviation for normal samples), to go with the medians :func:`compare` compares."""
    return float(1.4826 * np.median(np.abs(x - np.median(x))))


def compare(subject: Sequence[float], reference: Sequence[float], lower_is_better: bool = True,
            confidence: float = CONFIDENCE, n_boot: int = 4000, seed: int = 0) -> Comparison:
    """Compare two sets of samples (e.g. step times in ms) by the ratio of their medians, with a bootstrap
    confidence interval. Fewer than two samples on either side: no spread, verdict "within noise"."""
    a = np.asarray([x for x in subject if x is not None and math.isfinite(x)], dtype=float)
    b = np.asarray([x for x in reference if x is not None and math.isfinite(x)], dtype=float)
    if len(a) == 0 or len(b) == 0:
        raise ValueError("compare needs at least one finite sample on each side")
    ratio = float(np.median(a) / np.median(b))
    if len(a) < 2 or len(b) < 2:
        return Comparison(ratio, -math.inf, math.inf, "within noise", lower_is_better)
    rng = np.random.default_rng(seed)
    ra = np.median(rng.choice(a, size=(n_boot, len(a))), axis=1)
    rb = np.median(rng.choice(b, size=(n_boot, len(b))), axis=1)
    tail = (1 - confidence) / 2
    low, high = (float(v) for v in np.quantile(ra / rb, [tail, 1 - tail]))
    verdict = _verdict(low, high, lower_is_better)
    if spread_covers_effect(np.median(a), np.median(b), _robust_spread(a), _robust_spread(b)):
        verdict = "within noise"
    return Comparison(ratio, low, high, verdict, lower_is_better)


def compare_summaries(mean: float, std: float, n: int, ref_mean: float, ref_std: float, ref_n: int,
                      lower_is_better: bool = True, confidence: float = CONFIDENCE) -> Comparison:
    """:func:`compare` for tables that keep only mean, standard deviation and sample count: the ratio of
    means with a delta-method interval on the log scale (``ratio * exp(+-z * se)``, ``se`` the standard error
    of the log ratio: always positive, and symmetric in relative terms). ``n < 2`` on either side: no spread,
    "within noise"."""
    ratio = mean / ref_mean
    if n < 2 or ref_n < 2 or not all(math.isfinite(v) for v in (std, ref_std)) or ratio <= 0:
        return Comparison(ratio, -math.inf, math.inf, "within noise", lower_is_better)
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    se = math.sqrt((std / mean) ** 2 / n + (ref_std / ref_mean) ** 2 / ref_n)
    low, high = ratio * math.exp(-z * se), ratio * math.exp(z * se)
    verdict = "within noise" if spread_covers_effect(mean, ref_mean, std, ref_std) else _verdict(low, high,
                                                                                                   lower_is_better)
    return Comparison(ratio, low, high, verdict, lower_is_better)


@dataclass(frozen=True)
class GoalCheck:
    """A goal on a ratio ("subject / reference <= target" for times): ``met`` is True, False, or None when the
    interval straddles the target (undecided within the noise)."""

    comparison: Comparison
    target: float

    @property
    def met(self) -> bool | None:
        c = self.comparison
        at_most = c.lower_is_better
        if not (math.isfinite(c.low) and math.isfinite(c.high)):
            return None
        if (c.high <= self.target) if at_most else (c.low >= self.target):
            return True
        if (c.low > self.target) if at_most else (c.high < self.target):
            return False
        return None

    @property
    def word(self) -> str:
        """``"met"``, ``"missed"`` or ``"undecided (within noise)"``."""
        return {True: "met", False: "missed", None: "undecided (within noise)"}[self.met]

    def describe(self, subject: str, reference: str) -> str:
        """``"goal <= 0.8x torch DDP: met (ratio 0.73, 95% interval 0.70-0.76)"``."""
        c = self.comparison
        sign = "<=" if c.lower_is_better else ">="
        interval = (f"{CONFIDENCE:.0%} interval {span(c.low, c.high)}" if math.isfinite(c.low)
                    else "no spread measured")
        return f"goal {subject} {sign} {self.target:g}x {reference}: {self.word} (ratio {c.ratio:.3g}, {interval})"


def check_goal(subject: Sequence[float], reference: Sequence[float], target: float, lower_is_better: bool = True,
               **kwargs) -> GoalCheck:
    """Is ``median(subject) / median(reference)`` within ``target`` beyond the noise? (see :class:`GoalCheck`)."""
    return GoalCheck(compare(subject, reference, lower_is_better, **kwargs), target)


def span(low: float, high: float, fmt=lambda v: f"{v:.3g}", sep: str = "-") -> str:
    """A range for prose or a table: ``"1.2-3.4"``, or one number when both ends print the same (a range
    whose ends are equal is one value, not a spread)."""
    a, b = fmt(low), fmt(high)
    return a if a == b else f"{a}{sep}{b}"


def quotable(value: float, spread: float) -> bool:
    """True when ``value`` may be quoted as a finding: finite and larger than its measured ``spread`` (a
    standard deviation, or an interval's half-width). A value smaller than its own spread is noise; a value
    with no measured spread (NaN) may still be quoted, labelled as a single measurement by its caller."""
    if value is None or not math.isfinite(value):
        return False
    return not (spread is not None and math.isfinite(spread) and spread >= abs(value))

