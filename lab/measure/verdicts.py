"""The one statistic and the one rule: every comparison and goal of the book is decided here.

**The statistic.** A timing is the median of its samples with its spread, a standard deviation that one
outlier cannot inflate (1.4826 x the median absolute deviation, equal to the standard deviation for normal
samples): :func:`summarize`.

**The rule** (:data:`RULE`, stated at the top of every report). Two measurements compare by the ratio of their
medians, subject / reference, with a 95% interval: a bootstrap over the samples (:func:`compare`), or, where a
table kept only medians, spreads and counts, the normal interval of the log ratio with the median's standard
error, 1.2533 x spread / sqrt(n) (:func:`compare_medians`). Then:

* "faster" or "slower" (for a quantity where higher is better, "higher" or "lower") only where the interval
  excludes 1 *and* the gap between the medians exceeds both sides' spread; otherwise "within noise" (a
  bootstrap over a handful of samples can exclude 1 while each side scatters by more than the gap);
* a side with fewer than :data:`MIN_SAMPLES` samples decides nothing: "not decided";
* a time whose GPU waited for the host's launches for much of it decides nothing either, unless the ratio
  lies beyond :data:`HOST_VARIATION` either way: "host-bound" (:data:`HOST_BOUND`; the book then gives the
  GPU's own times, which the host does not move);
* a goal ("at most 0.85x the baseline") is met where the whole interval lies within it, missed where the
  whole interval lies beyond it, and undecided otherwise, or where either side's spread covers the gap
  between the subject and the value the goal allows.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
#: Fewer samples than this on either side of a comparison decide nothing.
MIN_SAMPLES = 5
#: The standard error of a median is about this many times the standard error of a mean (normal samples).
MEDIAN_SE_FACTOR = 1.2533

#: A comparison of times where a side's GPU waited for the host's launches for much of it: the host's pace and
#: load set that time, which moves from one run to the next, so it decides neither faster nor slower.
HOST_BOUND = "host-bound"
#: A time whose GPU ran kernels for less than this share of it was paced by the host's launches: host-bound.
HOST_BOUND_BELOW = 0.8
#: How far the host's pace and load can move a host-bound time: the same eager step, host-bound, has measured
#: twofold apart on two hosts of one GPU model. A ratio beyond it either way still decides a comparison.
HOST_VARIATION = 2.0


def host_bound(gpu_ms: float, wall_ms: float) -> bool | None:
    """Whether a time was host-bound: its GPU time fills less than :data:`HOST_BOUND_BELOW` of its wall time;
    None where either is unknown."""
    return gpu_ms / wall_ms < HOST_BOUND_BELOW if gpu_ms > 0 and wall_ms > 0 else None

RULE = (f"A timing is the median of its samples, with its spread (1.4826 x the median absolute deviation, a "
        f"standard deviation that one outlier cannot inflate). Two timings compare by the ratio of their medians "
        f"with a {CONFIDENCE:.0%} interval: *faster* or *slower* only where the interval excludes 1 and the gap "
        f"between the medians exceeds both sides' spread, *within noise* otherwise, and *not decided* where a "
        f"side has fewer than {MIN_SAMPLES} samples; *host-bound* where a side's GPU sat idle, waiting for the "
        f"host's launches, for more than {1 - HOST_BOUND_BELOW:.0%} of its time (a step of several GPUs counts "
        f"its kernels other than the collectives', which also run while they wait for the other ranks' hosts) "
        f"and the interval does not lie "
        f"wholly beyond {HOST_VARIATION:g}x either way (the host's pace and load set such a time, and move it "
        f"from run to run and host to host by up to that much: the GPU times are given instead). A goal is *met* "
        f"where the whole interval lies within it, *missed* where the whole interval lies beyond it and the gap "
        f"exceeds both spreads, *undecided* otherwise.")

#: Verdict words: times (lower is better) and other quantities (higher is better).
FASTER, SLOWER, HIGHER, LOWER = "faster", "slower", "higher", "lower"
WITHIN_NOISE, NOT_DECIDED = "within noise", "not decided"


@dataclass(frozen=True)
class Summary:
    """A measurement as the rule reads it: ``median``, ``spread`` (robust standard deviation) and ``n``
    samples; ``samples`` when they were kept (a comparison then bootstraps them)."""

    median: float
    spread: float
    n: int
    samples: tuple[float, ...] = ()

    @property
    def enough(self) -> bool:
        """Whether it has the :data:`MIN_SAMPLES` a verdict needs."""
        return self.n >= MIN_SAMPLES and math.isfinite(self.median)


def robust_spread(samples: Sequence[float]) -> float:
    """1.4826 x the median absolute deviation (the standard deviation for normal samples); NaN for none."""
    x = np.asarray(samples, dtype=float)
    if len(x) == 0:
        return math.nan
    return float(1.4826 * np.median(np.abs(x - np.median(x))))


def summarize(samples: Sequence[float]) -> Summary:
    """The median, spread and count of the finite ``samples`` (which it keeps)."""
    xs = tuple(float(x) for x in samples if x is not None and math.isfinite(float(x)))
    if not xs:
        return Summary(math.nan, math.nan, 0)
    return Summary(statistics.median(xs), robust_spread(xs), len(xs), xs)


@dataclass(frozen=True)
class Comparison:
    """Subject against reference: ``ratio`` = subject / reference (of medians), its interval ``[low, high]``
    (infinite where nothing was decided for lack of samples), ``verdict`` (:data:`FASTER`, :data:`SLOWER`,
    :data:`WITHIN_NOISE` or :data:`NOT_DECIDED` for times; :data:`HIGHER` or :data:`LOWER` where higher is
    better), and the two sides' summaries."""

    ratio: float
    low: float
    high: float
    verdict: str
    lower_is_better: bool = True
    subject: Summary | None = None
    reference: Summary | None = None

    @property
    def decided(self) -> bool:
        """True when the difference exceeds the noise (a verdict other than within noise / not decided)."""
        return self.verdict not in (WITHIN_NOISE, NOT_DECIDED)

    @property
    def spread_measured(self) -> bool:
        """False where a side had too few samples for a verdict."""
        return math.isfinite(self.low) and math.isfinite(self.high)

    @property
    def speedup(self) -> float:
        """reference / subject: how many times faster the subject is (for times)."""
        return 1.0 / self.ratio if self.ratio else math.nan


def _verdict(low: float, high: float, lower_is_better: bool) -> str:
    if high < 1.0:
        return FASTER if lower_is_better else LOWER
    if low > 1.0:
        return SLOWER if lower_is_better else HIGHER
    return WITHIN_NOISE


def spread_covers_effect(typical: float, ref_typical: float, spread: float, ref_spread: float) -> bool:
    """True when the gap between the two typical values is no wider than either side's spread: such a gap
    decides nothing, however narrow the interval of the ratio."""
    return abs(typical - ref_typical) <= max(spread, ref_spread)


def _undecided(ratio: float, a: Summary, b: Summary, lower_is_better: bool) -> Comparison:
    return Comparison(ratio, -math.inf, math.inf, NOT_DECIDED, lower_is_better, a, b)


def _decide(ratio: float, low: float, high: float, a: Summary, b: Summary, lower_is_better: bool) -> Comparison:
    verdict = _verdict(low, high, lower_is_better)
    if spread_covers_effect(a.median, b.median, a.spread, b.spread):
        verdict = WITHIN_NOISE
    return Comparison(ratio, low, high, verdict, lower_is_better, a, b)


def compare(subject: Sequence[float] | Summary, reference: Sequence[float] | Summary, lower_is_better: bool = True,
            confidence: float = CONFIDENCE, n_boot: int = 4000, seed: int = 0) -> Comparison:
    """Two measurements under the rule (module docstring): samples are bootstrapped (each side resampled
    independently); a :class:`Summary` without samples goes through :func:`compare_medians`."""
    a = subject if isinstance(subject, Summary) else summarize(subject)
    b = reference if isinstance(reference, Summary) else summarize(reference)
    if not (math.isfinite(a.median) and math.isfinite(b.median)):
        raise ValueError("compare needs at least one finite sample (or a median) on each side")
    if a.n == 0 or b.n == 0:  # a derived median (a difference of two timings) with no samples of its own
        return _undecided(a.median / b.median if b.median else math.nan, a, b, lower_is_better)
    if not (a.samples and b.samples):
        return compare_medians(a, b, lower_is_better, confidence)
    ratio = a.median / b.median
    if not (a.enough and b.enough):
        return _undecided(ratio, a, b, lower_is_better)
    rng = np.random.default_rng(seed)
    x, y = np.asarray(a.samples), np.asarray(b.samples)
    ra = np.median(rng.choice(x, size=(n_boot, len(x))), axis=1)
    rb = np.median(rng.choice(y, size=(n_boot, len(y))), axis=1)
    tail = (1 - confidence) / 2
    low, high = (float(v) for v in np.quantile(ra / rb, [tail, 1 - tail]))
    return _decide(ratio, low, high, a, b, lower_is_better)


def compare_medians(subject: Summary, reference: Summary, lower_is_better: bool = True,
                    confidence: float = CONFIDENCE) -> Comparison:
    """:func:`compare` from medians, spreads and counts alone: the normal interval of the log ratio of the
    medians, each median's standard error taken as ``1.2533 * spread / sqrt(n)``."""
    a, b = subject, reference
    ratio = a.median / b.median if b.median else math.nan
    if not (a.enough and b.enough) or not (math.isfinite(a.spread) and math.isfinite(b.spread)) or not ratio > 0:
        return _undecided(ratio, a, b, lower_is_better)
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    se = MEDIAN_SE_FACTOR * math.sqrt((a.spread / a.median) ** 2 / a.n + (b.spread / b.median) ** 2 / b.n)
    return _decide(ratio, ratio * math.exp(-z * se), ratio * math.exp(z * se), a, b, lower_is_better)


def compare_paired(subject: Sequence[float], reference: Sequence[float], lower_is_better: bool = True) -> Comparison:
    """Two measurements taken side by side, round by round (interleaved): the rule applied to the per-round
    ratios subject / reference against 1 (their interval and their spread), so a slow round (the host busy)
    slows both sides and cancels in their ratio. The comparison's ``subject`` is then the summary of those
    ratios and its ``reference`` 1. Unequal rounds: the unpaired :func:`compare`."""
    a, b = [float(x) for x in subject], [float(x) for x in reference]
    if len(a) != len(b) or not a or any(x <= 0 for x in b):
        return compare(a, b, lower_is_better)
    return compare([x / y for x, y in zip(a, b)], [1.0] * len(a), lower_is_better)


@dataclass(frozen=True)
class GoalCheck:
    """A goal on a ratio ("subject / reference <= target" for times, ">= target" where higher is better):
    ``met`` is True, False, or None (undecided: the interval straddles the target, a side lacks samples, or a
    spread covers the gap to the value the goal allows)."""

    comparison: Comparison
    target: float

    @property
    def met(self) -> bool | None:
        c = self.comparison
        if not c.spread_measured:
            return None
        a, b = c.subject, c.reference
        if a is not None and b is not None and spread_covers_effect(a.median, self.target * b.median, a.spread,
                                                                    self.target * b.spread):
            return None
        at_most = c.lower_is_better
        if (c.high <= self.target) if at_most else (c.low >= self.target):
            return True
        if (c.low > self.target) if at_most else (c.high < self.target):
            return False
        return None

    @property
    def word(self) -> str:
        """``"met"``, ``"missed"`` or ``"undecided"``."""
        return {True: "met", False: "missed", None: "undecided"}[self.met]


def check_goal(subject: Sequence[float] | Summary, reference: Sequence[float] | Summary, target: float,
               lower_is_better: bool = True, **kwargs) -> GoalCheck:
    """Is ``median(subject) / median(reference)`` within ``target`` beyond the noise? (:class:`GoalCheck`)."""
    return GoalCheck(compare(subject, reference, lower_is_better, **kwargs), target)
