"""Keeping native chatter out of notebooks: the CPU build's profiler prints a line at every start and stop
from C++, straight to file descriptor 2, where ``contextlib.redirect_stderr`` cannot reach.

Its own module because both the kernel profiles (:mod:`lab.measure.profiling`) and the memory snapshots
(:mod:`lab.measure.memory_snapshot`) start profilers, and the step they profile imports the snapshots.
"""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def silenced_native_stderr(enabled: bool = True):
    """Silence file descriptor 2 (C++ writes there directly: the CPU build's profiler prints a line at
    every start and stop). Python exceptions are unaffected."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def quiet_profile(profiler):
    """Run ``with profiler:`` with the profiler's own start/stop chatter on stderr silenced (only around
    its start and stop, so that warnings raised by the profiled code still show). Yields the profiler."""
    with silenced_native_stderr():
        profiler.__enter__()
    try:
        yield profiler
    except BaseException:
        with silenced_native_stderr():
            profiler.__exit__(*sys.exc_info())
        raise
    with silenced_native_stderr():
        profiler.__exit__(None, None, None)
