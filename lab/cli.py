"""What every command line of the book shares: a mistake costs one line, not a traceback.

``run(main, argv)`` calls ``main(argv)`` and turns an :class:`UsageError` (bad input: exit 2) or any other
exception (exit 1) into one line on stderr, ``<prog>: error: <what was wrong>``. ``--debug`` anywhere on
the command line shows the full traceback instead. argparse's own errors already print a usage line and
exit 2. On a machine without a GPU a command runs the book's Triton kernels in Triton's interpreter
(:func:`lab.use_triton_interpreter`, unless ``TRITON_INTERPRET`` is set) and says so in one line when it ends.

Leaf module: imports nothing from ``lab`` but the root package (which imports nothing from ``lab`` itself).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import lab


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


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def writable_dir(path: str | os.PathLike, flag: str = "--results-dir") -> Path:
    """Make sure ``path`` is a directory this process can write (creating it), before any work starts, so an
    unwritable output fails at once instead of after the whole run. Returns the path; raises
    :class:`UsageError` saying why not."""
    target = Path(path)
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write to {flag} {str(path)!r}: {exc.strerror or exc}") from None
    return target


def check_ranks(world_sizes: Sequence[int], device: str, gpus: int, cores: int | None = None,
                flag: str = "--world-size") -> None:
    """Refuse world sizes this machine cannot run: on CUDA more ranks than GPUs (one rank per GPU); on the CPU
    more ranks than cores (the ranks would share cores and time each other's waits, not the collective)."""
    cores = cores or os.cpu_count() or 1
    if device.startswith("cuda") and gpus == 0:
        raise UsageError("--device cuda needs a CUDA GPU; this machine has none (use --device cpu)")
    limit, what = (gpus, f"{gpus} GPU(s), one per rank") if device.startswith("cuda") else (cores, f"{cores} cores")
    too_many = [w for w in world_sizes if w > limit]
    if too_many:
        raise UsageError(f"{flag} {max(too_many)} needs {max(too_many)} ranks but this machine has {what}; "
                         f"use {flag} {limit} or fewer")


def _tell_torchrun(line: str) -> None:
    """Under torchrun, leave the error where its failure report reads a rank's error (the file named by
    ``TORCHELASTIC_ERROR_FILE``), so that the report's root cause is this line rather than "To enable
    traceback see ..." below it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)  # a plain message, shown as it is
    except OSError:
        pass


def run(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None,
        prog: str = "lab") -> int:
    """Run a CLI's ``main(argv)``; return its exit code, printing one line for any error (see the module)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    # A command may have imported Triton already (torch.compile's machinery does); the ranks it starts have not.
    interpreted = lab.COMMAND_INTERPRETED or ("TRITON_INTERPRET" not in os.environ and lab.use_triton_interpreter(
        announce=False, this_process=False))
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
        line = f"{prog}: error: {first_line(exc)}"
        _tell_torchrun(line)
        # Under torchrun every rank checks the same arguments: rank 0 says a usage error, once.
        if not (isinstance(exc, UsageError) and os.environ.get("RANK", "0") != "0"):
            print(line, file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    if interpreted and not code and "triton" in sys.modules:  # said once, where it explains the times above
        print(f"{prog}: {lab.INTERPRETER_NOTICE.removeprefix('lab: ')}", file=sys.stderr)
    return int(code or 0)
