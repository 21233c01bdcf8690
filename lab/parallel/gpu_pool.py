"""Jobs that each need some GPUs of one host, run side by side on disjoint GPUs as they come free.

    run_on_gpus([(2, lambda first: launch(..., first_gpu=first)), (1, ...)], gpus=4)

Each job is ``(width, fn)``: ``fn(first)`` runs on GPUs ``first .. first + width - 1``. Jobs start in the
order given, each on the lowest free block of GPUs wide enough, and a job waits (with every job behind it)
until one is free, so the order says what runs first. The results come back in the jobs' order. Once a job
has failed no further job starts, and its exception (of the failed jobs, the first in the list) is raised
here once every started job has ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def _first_free(free: list[bool], width: int) -> int | None:
    for first in range(len(free) - width + 1):
        if all(free[first:first + width]):
            return first
    return None


def run_on_gpus(jobs: Sequence[tuple[int, Callable[[int], Any]]], gpus: int) -> list:
    """Run every ``fn(first_gpu)`` of ``jobs`` (see the module docstring); returns their results in order."""
    for width, _ in jobs:
        if not 1 <= width <= gpus:
            raise ValueError(f"a job needs {width} GPUs; this machine has {gpus}")
    free = [True] * gpus
    changed = threading.Condition()

    def run(fn, first, width):
        try:
            return fn(first)
        except BaseException:
            failures.append(first)
            raise
        finally:
            with changed:
                free[first:first + width] = [True] * width
                changed.notify_all()

    futures, failures = [], []

    with ThreadPoolExecutor(max(len(jobs), 1)) as pool:
        for width, fn in jobs:
            with changed:
                while not failures and (first := _first_free(free, width)) is None:
                    changed.wait()
                if failures:
                    break
                free[first:first + width] = [False] * width
            futures.append(pool.submit(run, fn, first, width))
    return [f.result() for f in futures]
