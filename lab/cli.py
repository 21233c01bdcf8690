"""What every command line of the book shares: a mistake costs one line, not a traceback.

``run(main, argv)`` calls ``main(argv)`` and turns an :class:`UsageError` (bad input: exit 2) or any other
exception (exit 1) into one line on stderr, ``<prog>: error: <what was wrong>``. ``--debug`` anywhere on
the command line shows the full traceback instead. argparse's own errors already print a usage line and
exit 2.

Leaf module: imports nothing from ``lab``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


class UsageError(ValueError):
    """Bad input from the user: what was wrong and what is accepted, in one line."""


def first_line(exc: BaseException) -> str:
    """``"<Type>: <first line of the message>"`` (the type dropped for the book's own usage errors)."""
    text = str(exc).strip().splitlines()
    message = text[0] if text else ""
    if isinstance(exc, (UsageError, SystemExit)):
        return message
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


class Parser(argparse.ArgumentParser):
    """argparse with a ``--debug`` flag (show tracebacks) and one-line errors."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", help="show the full traceback of an error")

    def error(self, message: str):  # argparse's default prints the whole usage block first
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_at_least(text: str, minimum: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def run(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None,
        prog: str = "lab") -> int:
    """Run a CLI's ``main(argv)``; return its exit code, printing one line for any error (see the module)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        code = main(args)
    except SystemExit as exc:  # argparse, --help
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the point: one line, not a traceback
        if debug:
            raise
        print(f"{prog}: error: {first_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    return int(code or 0)
