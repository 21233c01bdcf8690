"""Reading generated prose in tests by its numbers and structure, so its wording is free to change."""

import re

NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def numbers(text: str) -> list[float]:
    """Every number in ``text`` in order of appearance (thousands separators dropped; a ``%`` sign ignored)."""
    return [float(m.group().replace(",", "")) for m in NUMBER.finditer(text)]


def sentence_with(text: str, *words: str) -> str:
    """The first sentence (split after '.' or ';') of ``text`` holding every one of ``words``; AssertionError
    if none does."""
    for part in re.split(r"(?<=[.;])\s+", text):
        if all(w in part for w in words):
            return part
    raise AssertionError(f"no sentence holds {words}: {text}")


def counts(text: str) -> list[tuple[int, int]]:
    """The ``k of n`` counts in ``text``, in order."""
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+) of (\d+)", text)]


def in_order(text: str, expected: list[float], rel: float = 1e-9) -> bool:
    """True when the numbers ``expected`` appear in ``text`` in this order (others may stand between them)."""
    found = iter(numbers(text))
    return all(any(abs(n - e) <= rel * max(abs(e), 1e-12) for n in found) for e in expected)
