"""Reading generated prose in tests by its numbers, units and structure, so its wording is free to change."""

import re

NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
# longest first, so "GB/s" is not read as "GB" and "ms" not as "s"
UNITS = ("GiB", "MiB", "KiB", "GB/s", "GB", "MB", "TFLOP/s", "ms", "µs", "s", "%")
# bytes ("4 B") take a space, so a model size ("2.7B", "10B") is not read as bytes; a ratio's "x" (or "×")
# follows its number without one, so "8 × 16384" is a product, not a ratio
AMOUNT = re.compile("(" + NUMBER.pattern + r")(?:\s?(" + "|".join(re.escape(u) for u in UNITS) + r")|\s(B)|([x×]))"
                    r"(?![\w/])")


def numbers(text: str) -> list[float]:
    """Every number in ``text`` in order of appearance (thousands separators dropped; a ``%`` sign ignored)."""
    return [float(m.group().replace(",", "")) for m in NUMBER.finditer(text)]


def amounts(text: str) -> list[tuple[float, str]]:
    """Every number directly followed by a unit of :data:`UNITS`, bytes (``B``) or a ratio's ``x`` (``110 ms``,
    ``**11x**``, ``40 GiB``, ``60%``), as ``(value, unit)`` in order of appearance; ``×`` is read as ``x``."""
    return [(float(m.group(1).replace(",", "")), m.group(2) or m.group(3) or "x") for m in AMOUNT.finditer(text)]


def has_amount(text: str, value: float, unit: str, rel: float = 1e-9) -> bool:
    """True when ``text`` holds ``value`` followed by ``unit`` (to relative tolerance ``rel``: pass the
    rounding the text prints with, e.g. ``rel=5e-3`` for three significant digits)."""
    return any(u == unit and abs(v - value) <= rel * max(abs(value), 1e-12) for v, u in amounts(text))


def sentences(text: str) -> list[str]:
    """``text`` split into sentences after '.' or ';' (a decimal point does not split: it has no space)."""
    return [s for s in re.split(r"(?<=[.;])\s+", text) if s]


def sentence_with(text: str, *words: str) -> str:
    """The first sentence (split after '.' or ';') of ``text`` holding every one of ``words``; AssertionError
    if none does."""
    for part in sentences(text):
        if all(w in part for w in words):
            return part
    raise AssertionError(f"no sentence holds {words}: {text}")


def sentence_of(text: str, value: float, unit: str, rel: float = 1e-9) -> str:
    """The first sentence of ``text`` holding the amount ``value`` ``unit``; AssertionError if none does."""
    for part in sentences(text):
        if has_amount(part, value, unit, rel):
            return part
    raise AssertionError(f"no sentence holds {value} {unit}: {text}")


def clause_of(text: str, name: str) -> str:
    """The clause of ``text`` that starts at ``name`` (a configuration's or implementation's label), up to the next
    ';' or end of sentence; AssertionError if ``text`` does not name it."""
    if name not in text:
        raise AssertionError(f"{name!r} is not named: {text}")
    return re.split(r"(?<=[.;])\s", text[text.index(name):])[0]


def bold(text: str) -> list[str]:
    """The ``**bold**`` spans of ``text`` (the values a sentence stresses: a result, a verdict), in order."""
    return re.findall(r"\*\*(.+?)\*\*", text)


def counts(text: str) -> list[tuple[int, int]]:
    """The ``k of n`` counts in ``text``, in order."""
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+) of (\d+)", text)]


def in_order(text: str, expected: list[float], rel: float = 1e-9) -> bool:
    """True when the numbers ``expected`` appear in ``text`` in this order (others may stand between them)."""
    found = iter(numbers(text))
    return all(any(abs(n - e) <= rel * max(abs(e), 1e-12) for n in found) for e in expected)


def amounts_in_order(text: str, expected: list[tuple[float, str]], rel: float = 1e-9) -> bool:
    """True when the amounts ``expected`` (``(value, unit)``) appear in ``text`` in this order (others may
    stand between them)."""
    found = iter(amounts(text))
    return all(any(u == unit and abs(v - value) <= rel * max(abs(value), 1e-12) for v, u in found)
               for value, unit in expected)
