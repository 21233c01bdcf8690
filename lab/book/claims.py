"""Claims as data, and the one module that says them.

A chapter states each answer as a :class:`Claim`: its question, its findings (data, not words) and, where a
reader needs it, a fixed explanation chosen from the data. The findings are:

* :class:`Versus`: one measured row against another (the statistic: ratio of medians under the rule of
  :mod:`lab.measure.verdicts`), with a goal if there is one;
* :class:`Tally`: many such comparisons counted by verdict (the counts always add up to the whole);
* :class:`Value`: one measured or derived quantity with its unit (and its spread, where it was timed);
* :class:`Share`: a part of a whole;
* :class:`Observed`: a named outcome that is not a number (a dtype, an implementation's name).

Each finding reads its numbers from a :class:`Measured` row. This module alone turns them into sentences and
table cells: numbers as a person writes them (:func:`number`: units, thousands separators, no exponent
notation), "out of memory at 79 GiB" rather than an allocator's message, and verdicts in the words of the rule
that every report states once at its top (:data:`lab.measure.verdicts.RULE`). Chapters never word their own
findings, so the same comparison reads the same way in every report.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from lab.measure import verdicts as v

_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


# ----------------------------------------------------------------------------------------------------------
# numbers


def number(value: float | None, unit: str = "", digits: int = 3) -> str:
    """``value`` as a person writes it: ``digits`` significant digits, whole numbers from 1,000 on with
    thousands separators (``12,510 ms``), tiny ones as powers of ten (``4 × 10⁻⁸``), never ``1.2e+04``;
    ``"n/a"`` for a missing value. ``unit`` follows after a space (``"x"`` and ``"%"`` without one); bytes
    (``"B"``) are written in KiB, MiB or GiB, below 1 KiB in bytes (``0 bytes``, never ``0 B``)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    value = float(value)
    if unit == "B":
        value, unit = _binary(value)
    if math.isinf(value):
        text = "infinite" if value > 0 else "minus infinite"
    elif value == 0:
        text = "0"
    else:
        rounded = float(f"{value:.{digits}g}")  # 999.6 rounds to four digits before it has three
        exponent = math.floor(math.log10(abs(rounded)))
        if exponent >= 3:
            text = f"{round(value):,}"
        elif exponent < -4:
            text = f"{rounded / 10**exponent:.{max(digits - 1, 0)}g} × 10{str(exponent).translate(_SUPERSCRIPT)}"
        else:
            text = f"{rounded:.{max(digits - 1 - exponent, 0)}f}"
            text = text.rstrip("0").rstrip(".") if "." in text else text
    if not unit:
        return text
    return f"{text}{unit}" if unit in ("x", "%") else f"{text} {unit}"


def _binary(n_bytes: float) -> tuple[float, str]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if round(abs(n_bytes)) >= size:
            return n_bytes / size, unit
    return n_bytes, "byte" if round(abs(n_bytes)) == 1 else "bytes"


def percent(fraction: float, digits: int = 2) -> str:
    """A share as a percentage: ``0.234`` -> ``"23%"`` (``digits`` significant digits, ``"n/a"`` if missing)."""
    if fraction is None or not math.isfinite(fraction):
        return "n/a"
    return number(100 * fraction, "%", digits)


def interval(low: float, high: float, digits: int = 3) -> str:
    """A 95% interval for prose or a cell: ``"0.79-0.83"``; ends that print alike at ``digits`` significant
    digits get more (up to 6), so a narrow interval still shows two ends (``"1.521-1.522"``); ends alike even
    then read ``"1 at both ends"``; ``"none"`` where none was measured (infinite ends). An end near 1 that is
    not 1 gets digits (up to 6) until it shows on which side it lies (``"1.003-1.45"`` rather than
    ``"1-1.45"``: a ratio's interval excludes 1 or not)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "none"
    for d in range(digits, 7):
        a, b = number(low, digits=d), number(high, digits=d)
        if a != b and (a != "1" or low == 1) and (b != "1" or high == 1):
            return f"{a}-{b}"
    return f"{a}-{b}" if a != b else f"{a} at both ends"


def plural(count: int, noun: str) -> str:
    """``"1 sample"``, ``"3 samples"``, with the count written as :func:`number` writes it."""
    return f"{number(count)} {noun}{'' if count == 1 else 's'}"


# ----------------------------------------------------------------------------------------------------------
# measured rows

OOM = "oom"


def as_float(x) -> float:
    """``x`` as a float, NaN where it is missing or not a number."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan
#: Units of a time: a comparison of times says faster or slower, of anything else lower or higher.
TIME_UNITS = ("ms", "s", "µs", "us", "ns")


@dataclass(frozen=True)
class Measured:
    """One row as a claim reads it: a label naming what was measured, its samples (or its median, spread and
    count where a table kept only those), the unit, and its status: ``ok``, or ``oom`` with the memory
    ``limit_gib`` the process had when it ran out (NaN where unknown), or another failure."""

    label: str
    summary: v.Summary = field(default_factory=lambda: v.Summary(math.nan, math.nan, 0))
    unit: str = "ms"
    status: str = "ok"
    limit_gib: float = math.nan
    #: the GPU waited for the host's launches for much of this time (:data:`lab.measure.verdicts.HOST_BOUND`)
    host_bound: bool = False
    #: how long the GPU ran kernels within it, where profiled (NaN otherwise)
    gpu_ms: float = math.nan

    @classmethod
    def of(cls, label: str, samples: Iterable[float], unit: str = "ms") -> Measured:
        """From every sample."""
        return cls(label, v.summarize(list(samples)), unit)

    @classmethod
    def summarized(cls, label: str, median: float, spread: float, n: int, unit: str = "ms") -> Measured:
        """From a median, its spread and the number of samples behind it."""
        return cls(label, v.Summary(float(median), float(spread), int(n)), unit)

    @classmethod
    def value(cls, label: str, value: float, unit: str = "") -> Measured:
        """A value that was computed, not sampled (a closed form, a count): no spread, decides no verdict."""
        return cls(label, v.Summary(float(value), math.nan, 1), unit)

    @classmethod
    def fixed(cls, label: str, value: float, unit: str = "ms") -> Measured:
        """A target known exactly (a goal's time, a limit): no spread, and as many samples as a verdict needs,
        so that a measurement can be set against it under the rule."""
        return cls(label, v.Summary(float(value), 0.0, v.MIN_SAMPLES, (float(value),) * v.MIN_SAMPLES), unit)

    @classmethod
    def out_of_memory(cls, label: str, limit_gib: float = math.nan, unit: str = "ms") -> Measured:
        """A row that ran out of memory, with the memory the process had (GiB) where known."""
        return cls(label, unit=unit, status=OOM, limit_gib=float(limit_gib))

    @classmethod
    def from_row(cls, label: str, row, column: str, unit: str = "ms") -> Measured:
        """From a table row: its ``column`` (a median), the spread beside it (``<column stem>_spread<unit
        suffix>``, e.g. ``fwd_ms`` -> ``fwd_spread_ms``) and its count (``<stem>_n``, else ``n``); the
        samples where the row keeps them (``<stem>_samples<suffix>``, a list or its JSON text). A row whose
        ``status`` is not ``ok`` is out of memory (``oom``, with ``limit_gib`` if the row has it) or failed."""
        get = row.get if hasattr(row, "get") else (lambda k, d=None: getattr(row, k, d))
        status = str(get("status", "ok") or "ok")
        value = get(column)
        measured = isinstance(value, (int, float)) and math.isfinite(value)
        if status != "ok" and not measured:  # an OOM row keeps the modes that fit: only the others ran out
            limit = get("limit_gib", math.nan)
            return cls(label, unit=unit, status=status, limit_gib=float(limit) if limit is not None else math.nan)
        stem, _, suffix = column.rpartition("_") if column.endswith(("_ms", "_gib", "_s")) else (column, "", "")
        samples = get(f"{stem}_samples_{suffix}" if suffix else f"{stem}_samples")
        if isinstance(samples, str) and samples.startswith("["):  # a list kept through a CSV file as JSON
            samples = json.loads(samples)
        if isinstance(samples, (list, tuple)) and samples:
            m = cls.of(label, samples, unit)
        else:
            spread = get(f"{stem}_spread_{suffix}" if suffix else f"{stem}_spread", math.nan)
            n = get(f"{stem}_n", None)
            n = get("n", 0) if n is None else n
            m = cls.summarized(label, get(column), math.nan if spread is None else spread, n or 0, unit)
        # host-bound by its GPU share where profiled, collectives left out (NCCL kernels also wait for the peers)
        gpu = as_float(get(f"{stem}_compute_gpu_{suffix}" if suffix else f"{stem}_compute_gpu"))
        gpu = gpu if math.isfinite(gpu) else as_float(get(f"{stem}_gpu_{suffix}" if suffix else f"{stem}_gpu"))
        bound = v.host_bound(gpu, m.median)
        return replace(m, host_bound=str(get("host_bound", False)) == "True" if bound is None else bound, gpu_ms=gpu)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and math.isfinite(self.summary.median)

    @property
    def median(self) -> float:
        return self.summary.median

    def text(self, digits: int = 3) -> str:
        """``"12.3 ms"``, ``"out of memory at 79 GiB"``, or the failure's status."""
        if self.status == OOM:
            return "out of memory" + (f" at {number(self.limit_gib, 'GiB', 2)}" if math.isfinite(self.limit_gib)
                                      else "")
        if self.status != "ok":
            return self.status
        return number(self.median, self.unit, digits)


# ----------------------------------------------------------------------------------------------------------
# findings


@dataclass(frozen=True)
class Versus:
    """``subject`` against ``reference`` under the rule: the ratio of medians, its interval and the verdict;
    with ``goal`` (a ratio: "at most" where lower is better, "at least" otherwise), whether it is met."""

    subject: Measured
    reference: Measured
    goal: float | None = None
    higher_is_better: bool = False
    paired: bool = False

    @property
    def comparison(self) -> v.Comparison | None:
        """The comparison, or None where a side did not run (out of memory, failed)."""
        if not (self.subject.ok and self.reference.ok):
            return None
        a, b = self.subject.summary, self.reference.summary
        if self.paired and a.samples and b.samples:
            return v.compare_paired(a.samples, b.samples, not self.higher_is_better)
        return v.compare(a, b, not self.higher_is_better)

    @property
    def host_bound(self) -> bool:
        """A comparison of times with a host-bound side, its interval not wholly beyond the host's reach
        (:data:`lab.measure.verdicts.HOST_VARIATION` either way): the rule decides nothing from it."""
        if self.subject.unit not in TIME_UNITS or not (self.subject.host_bound or self.reference.host_bound):
            return False
        c = self.comparison
        return c is None or not (c.high < 1 / v.HOST_VARIATION or c.low > v.HOST_VARIATION)

    @property
    def verdict(self) -> str:
        """The rule's word (``faster``/``slower`` for times, ``lower``/``higher`` for other quantities), or
        ``"host-bound"``, or ``"out of memory"`` / the failure where a side did not run."""
        c = self.comparison
        if c is None:
            return next(m.text() for m in (self.subject, self.reference) if not m.ok)
        if self.host_bound and c.verdict != v.NOT_DECIDED:
            return v.HOST_BOUND
        if self.subject.unit not in TIME_UNITS:
            return {v.FASTER: v.LOWER, v.SLOWER: v.HIGHER}.get(c.verdict, c.verdict)
        return c.verdict

    @property
    def goal_word(self) -> str:
        """``"met"``, ``"missed"``, ``"undecided"`` (a host-bound side's time decides no goal either), or ``""``
        without a goal."""
        if self.goal is None:
            return ""
        if self.comparison is None:
            return "missed" if not self.subject.ok else "undecided"
        return "undecided" if self.host_bound else v.GoalCheck(self.comparison, self.goal).word

    @property
    def gpu_ratio(self) -> float:
        """The ratio of the two sides' GPU times, where both were profiled (NaN otherwise)."""
        a, b = self.subject.gpu_ms, self.reference.gpu_ms
        return a / b if a > 0 and b > 0 else math.nan

    def cells(self) -> dict:
        """The comparison as table columns: ``ratio``, ``interval``, ``verdict`` (and ``goal``, ``goal_met``)."""
        c = self.comparison
        out = {"ratio": c.ratio if c else math.nan, "interval": interval(c.low, c.high) if c else "none",
               "verdict": self.verdict}
        if self.host_bound:
            out["gpu_ratio"] = self.gpu_ratio
        if self.goal is not None:
            out.update(goal=self.goal, goal_met=self.goal_word)
        return out


@dataclass(frozen=True)
class Tally:
    """Comparisons counted by verdict, e.g. "faster in 12 of 20, within noise in 7, slower in 1"."""

    label: str
    comparisons: tuple[Versus, ...]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.comparisons:
            out[c.verdict] = out.get(c.verdict, 0) + 1
        return out

    def goal_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.comparisons:
            if c.goal is not None:
                out[c.goal_word] = out.get(c.goal_word, 0) + 1
        return out


@dataclass(frozen=True)
class Value:
    """One quantity: a measured row (its median, with spread and samples) or a computed value."""

    measured: Measured


@dataclass(frozen=True)
class Share:
    """``part`` as a share of ``whole`` (same unit), e.g. the matrix products' share of a step's GPU time."""

    label: str
    part: float
    whole: float

    @property
    def fraction(self) -> float:
        return self.part / self.whole if self.whole else math.nan


@dataclass(frozen=True)
class Observed:
    """An outcome that is not a number: ``label`` and what was seen (a dtype, a name, a kernel)."""

    label: str
    seen: str


Finding = Versus | Tally | Value | Share | Observed


@dataclass(frozen=True)
class Claim:
    """One answer of a chapter: the ``question``, its ``findings``, and ``because``, a fixed explanation the
    chapter chooses from the data (it holds no measured number: those are findings)."""

    question: str
    findings: tuple[Finding, ...]
    because: str = ""

    def __post_init__(self):
        if isinstance(self.findings, list):
            object.__setattr__(self, "findings", tuple(self.findings))


# ----------------------------------------------------------------------------------------------------------
# saying them

_VERDICT_ORDER = (v.FASTER, v.HIGHER, v.WITHIN_NOISE, v.SLOWER, v.LOWER, v.HOST_BOUND, v.NOT_DECIDED)


def host_bound_shares(rows: Iterable, label: Callable[..., str]) -> list[Finding]:
    """Of a GPU's rows (each with ``host_bound`` and ``gpu_busy``): the GPU's busy share of each host-bound one
    (the host's launches set its time, so another run or host gives another), or that none was."""
    return [Share(f"GPU busy during {label(r)} (host-bound)", r["gpu_busy"], 1.0) for r in rows
            if str(r["host_bound"]) == "True"] or [
        Observed(f"rows whose GPU was busy less than {percent(v.HOST_BOUND_BELOW)} of the step", "none")]


def say_versus(f: Versus) -> str:
    """One comparison in words (see the module docstring)."""
    a, b = f.subject, f.reference
    if f.comparison is None:
        text = f"{a.label}: {a.text()}; {b.label}: {b.text()}"
    else:
        c = f.comparison
        medians = f"{a.text()} against {b.text()}"
        ratio = (f"median per-round ratio {number(c.ratio)}" if f.paired else f"ratio {number(c.ratio)}") + \
            f", {v.CONFIDENCE:.0%} interval {interval(c.low, c.high)}"
        if c.verdict == v.NOT_DECIDED and min(a.summary.n, b.summary.n) >= v.MIN_SAMPLES:
            text = f"{a.label} against {b.label}: not decided, no spread was kept ({medians})"
        elif c.verdict == v.NOT_DECIDED:
            text = (f"{a.label} against {b.label}: not decided, {plural(a.summary.n, 'sample')} and "
                    f"{number(b.summary.n)} ({number(v.MIN_SAMPLES)} needed; {medians})")
        elif f.verdict == v.HOST_BOUND:
            gpu = (f"; GPU time {number(a.gpu_ms, 'ms')} against {number(b.gpu_ms, 'ms')}, ratio "
                   f"{number(f.gpu_ratio)}" if math.isfinite(f.gpu_ratio) else "")
            text = (f"{a.label} against {b.label}: host-bound, no verdict ({medians}; {ratio}{gpu})")
        elif c.verdict == v.WITHIN_NOISE:
            text = f"{a.label} and {b.label} are within noise ({medians}; {ratio})"
        elif f.verdict == v.FASTER:
            text = f"{a.label} is **{number(c.speedup)}x faster** than {b.label} ({medians}; {ratio})"
        elif f.verdict == v.SLOWER:
            text = f"{a.label} is **{number(c.ratio)}x slower** than {b.label} ({medians}; {ratio})"
        else:
            text = f"{a.label} is **{number(c.ratio)}x** {b.label}, {f.verdict} ({medians}; {ratio})"
    if f.goal is not None:
        bound = "at most" if not f.higher_is_better else "at least"
        text += f"; goal {bound} {number(f.goal)}x: **{f.goal_word}**"
    return text


def say_tally(f: Tally) -> str:
    counts, n = f.counts(), len(f.comparisons)
    parts = [f"{w} in {number(counts[w])}" for w in sorted(counts, key=lambda w: (
        _VERDICT_ORDER.index(w) if w in _VERDICT_ORDER else len(_VERDICT_ORDER), w))]
    text = f"{f.label}: {', '.join(parts)} of {plural(n, 'comparison')}" if n else f"{f.label}: nothing compared"
    goals = f.goal_counts()
    if goals:
        text += "; goal " + ", ".join(f"{w} in {number(k)}" for w, k in sorted(goals.items()))
    return text


def say_value(f: Value) -> str:
    m = f.measured
    text = f"{m.label}: **{m.text()}**"
    s = m.summary
    if m.ok and math.isfinite(s.spread) and s.n > 1:
        text += f" (spread {number(s.spread, m.unit, 2)}, {plural(s.n, 'sample')})"
    return text


def say(finding: Finding) -> str:
    """One finding as a clause of Markdown."""
    if isinstance(finding, Versus):
        return say_versus(finding)
    if isinstance(finding, Tally):
        return say_tally(finding)
    if isinstance(finding, Value):
        return say_value(finding)
    if isinstance(finding, Share):
        return f"{finding.label}: **{percent(finding.fraction)}**"
    if isinstance(finding, Observed):
        return f"{finding.label}: {finding.seen}"
    raise TypeError(f"not a finding: {finding!r}")


def sentence(claim: Claim, with_question: bool = True) -> str:
    """A claim as Markdown: the question in italics, then its findings and its explanation."""
    body = "; ".join(say(f) for f in claim.findings) or "nothing was measured"
    first = re.match(r"[a-z]+\b", body)  # a plain word starts the sentence; a name (stock_eager, fp32) stays as is
    text = (f"{body[0].upper()}{body[1:]}." if first and not re.match(r"[a-z]+[_\d]", body) else f"{body}.")
    if claim.because:
        text += f" {claim.because.strip()}"
    return f"*{claim.question}* {text}" if with_question else text


def verdict_table(rows: Sequence[tuple[dict, Versus]]) -> list[dict]:
    """Rows of a comparison table: each ``(keys, Versus)`` as its keys, both sides (``subject``, ``against``)
    and the comparison's cells (:meth:`Versus.cells`), so a table and the prose beside it read the same
    verdicts."""
    out = []
    for keys, f in rows:
        cells = {"subject": f.subject.text(), "against": f.reference.text(), **f.cells()}
        clash = sorted(set(keys) & set(cells))
        if clash:
            raise ValueError(f"verdict_table: the keys {clash} would hide the comparison's own columns; rename them")
        out.append({**keys, **cells})
    return out


# exponent notation, an allocator's message, a byte count as "0 B", nan, an interval with one end ("interval 1.52)")
_MACHINE_PHRASES = re.compile(r"\d[eE][+]\d|CUDA out of memory|Tried to allocate|\b\d+ B\b|nan\b"
                              r"|interval -?\d[\d.,]*(?: [a-zµ%]+)?(?=[);]|, |$)")


def machine_phrases(text: str) -> list[str]:
    """What a person would not write (exponent notation, an allocator's message, nan); ``$...$`` formulas left out."""
    return [m.group() for m in _MACHINE_PHRASES.finditer(re.sub(r"\$[^$\n]+\$", "", text))]
