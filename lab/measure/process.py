"""Fresh Python processes for measurements that must start cold, and what to say when one dies.

A measurement child that is killed (by the out-of-memory killer, a segfault in a kernel, a timeout)
leaves no Python traceback; :func:`describe_exit` turns its exit status into a sentence, and
:class:`ProcessFailed` carries that sentence with the last lines the child wrote to stderr.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence

from lab.paths import REPO_ROOT


class ProcessFailed(RuntimeError):
    """A child process failed: how it ended, and the end of its stderr."""


def describe_exit(returncode: int | None) -> str:
    """``"exited with code 3"``, ``"was killed by SIGSEGV"``, ``"was killed by SIGKILL (likely out of memory:
    the kernel's OOM killer sends it)"``; negative codes are signals (``subprocess``/``multiprocessing``)."""
    if returncode is None:
        return "is still running"
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = " (likely out of memory: the kernel's OOM killer sends it)" if -returncode == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


def tail(text: str, lines: int = 5) -> str:
    """The last non-empty ``lines`` lines of ``text``, joined with `` | `` (for one-line error messages)."""
    kept = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)


def run_python_module(module: str, args: Sequence[str], what: str, timeout_s: float | None = None) -> str:
    """Run ``python -m module args...`` from the repository root; return its stdout.

    Raises :class:`ProcessFailed` naming ``what`` ran, how the process ended (:func:`describe_exit`) and
    its last stderr lines when it does not exit with 0.
    """
    cmd = [sys.executable, "-m", module, *args]
    try:
        out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ProcessFailed(f"{what} did not finish within {timeout_s:.0f} s") from None
    if out.returncode != 0:
        last = tail(out.stderr) or "(no stderr output)"
        raise ProcessFailed(f"{what} {describe_exit(out.returncode)}; its last stderr lines: {last}")
    return out.stdout
