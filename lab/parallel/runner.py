"""The one runner of multi-process benchmarks: a list of items (recipes, implementations, collective sizes)
measured on the ranks of a launch, robust to one item failing.

A benchmark of several items in one launch loses everything when one item fails: one rank out of memory
leaves its peers waiting in that item's collectives, one hung rank holds the launch until its deadline, and
the rows finished before are gone with the processes. :func:`run` owns that, for every distributed
benchmark::

    rows = runner.run(worker, items, world_size, blank=lambda item, status, error: {...}, deadline_s=600)

* **rank side**: ``worker`` (launched on every rank, with the launch's items and a :class:`Progress`)
  records each item's row as it finishes (:meth:`Progress.finish`; a file per rank), and the item it starts
  (:meth:`Progress.start`). :func:`each` is the usual loop: one item after the other, an out-of-memory error
  made a row of ``status="oom"``, after which the rank ends the launch (:class:`StoppedAfterOOM`): its peers
  may be waiting in that item's collectives.
* **host side**: when a launch fails, the rows every rank finished are salvaged from the progress files, the
  item it failed in is found (the failing rank's current item; a hung launch's earliest), and the launch's
  cause (the failing rank's error, one line) is kept. An out-of-memory item becomes an ``oom`` row and the
  next items run in a new launch. Any other failure re-raises, unless ``skip_failed`` (the item becomes a
  ``failed`` row and the next run in a new launch) or a ``deadline_s`` is given (every item not finished
  becomes a ``failed`` row with the cause).

A row is a dict with ``status`` (``ok``, ``oom``, ``failed``, or the benchmark's own) and ``error``; rows
travel through the progress files as JSON. Jobs that each need GPUs of their own run side by side through
:func:`lab.parallel.gpu_pool.run_on_gpus`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.measure.device import error_summary, is_oom
from lab.parallel import launcher

#: ``blank(item, status, error)``: an item's row when its ranks produced none (``failed``, or out of memory
#: outside the item's own handling).
Blank = Callable[[Any, str, str], dict]


class StoppedAfterOOM(RuntimeError):
    """Raised by a rank of several after an item ran out of memory on it: its peers may be waiting in that
    item's collectives, so the launch ends and :func:`run` resumes with the next item in new processes."""


# --------------------------------------------------------------------------------------------------------
# inside each rank


@dataclass
class Progress:
    """Where the ranks of one launch record their items: ``folder/rank<r>.jsonl``, one JSON line per event
    (``{"start": i}``, ``{"done": i, "row": row}``), ``i`` the item's index in the launch. ``launch`` counts
    the launches of one :func:`run` (0 for the first)."""

    folder: str
    launch: int = 0
    _done: int = field(default=0, repr=False)
    _current: int | None = field(default=None, repr=False)

    def _write(self, event: dict) -> None:
        if not self.folder:
            return
        with open(os.path.join(self.folder, f"rank{launcher.rank()}.jsonl"), "a") as f:
            f.write(json.dumps(event, default=str) + "\n")

    def start(self, index: int) -> None:
        """This rank begins item ``index`` (the item a failure is charged to, until it finishes)."""
        self._current = index
        self._write({"start": index})

    def enter(self, index: int) -> None:
        """This rank is in item ``index`` now, noted in memory only (cheap enough for a timed region, where
        items take turns): written by :meth:`charging` if an error leaves the block."""
        self._current = index

    @contextlib.contextmanager
    def charging(self):
        """A block whose error is charged to the item last entered (:meth:`enter`), then re-raised."""
        try:
            yield
        except BaseException:
            if self._current is not None:
                self.start(self._current)
            raise

    def finish(self, row: dict, index: int | None = None) -> dict:
        """This rank's ``row`` of item ``index`` (default: the item after the last one finished here),
        recorded at once so that it survives the launch; returns the row."""
        index = self._done if index is None else index
        self._write({"done": index, "row": row})
        self._done = index + 1
        return row

    def read(self, world_size: int) -> list[tuple[dict[int, dict], int | None]]:
        """Per rank: the rows it finished (index -> row) and the item it was in (started, not finished;
        None). A line cut off mid-write is ignored."""
        out = []
        for r in range(world_size):
            path = Path(self.folder) / f"rank{r}.jsonl"
            lines = path.read_text().splitlines(keepends=True) if path.exists() else []
            done, current = {}, None
            for line in lines:
                if not line.endswith("\n"):
                    continue
                event = json.loads(line)
                if "start" in event:
                    current = event["start"]
                else:
                    done[event["done"]] = event["row"]
                    current = None if current == event["done"] else current
            out.append((done, current))
        return out


def entering(progress: Progress, index: int, fn: Callable) -> Callable:
    """``fn`` that notes item ``index`` as entered (:meth:`Progress.enter`) at each call: the step of one
    implementation among several taking turns, so that an error in it is charged to it."""
    def call(*args, **kwargs):
        progress.enter(index)
        return fn(*args, **kwargs)
    return call


def each(items: Sequence, measure: Callable[[Any], dict], progress: Progress,
         announce: Callable[[dict], Any] | None = None) -> list[dict]:
    """``measure(item)`` of each item in turn on this rank, each row recorded as it comes (and passed to
    ``announce``); an out-of-memory error becomes a row ``{"status": "oom", "error": ...}``. On a rank of
    several spawned processes, a row of status ``oom`` ends the launch (:class:`StoppedAfterOOM`)."""
    rows = []
    for i, item in enumerate(items):
        progress.start(i)
        try:
            row = measure(item)
        except Exception as exc:  # noqa: BLE001 - out of memory is a result
            if not is_oom(exc):
                raise
            row = {"status": "oom", "error": error_summary(exc)}
        rows.append(progress.finish(row, i))
        if announce is not None:
            announce(row)
        if row.get("status") == "oom" and launcher.world_size() > 1 and launcher.is_spawned():
            raise StoppedAfterOOM(f"item {i} ran out of memory on rank {launcher.rank()}")
    return rows


def each_item(measure: Callable, items: Sequence, progress: Progress, *args) -> list[dict]:
    """A launched worker for :func:`run` whose items need no setup: ``measure(item, *args)`` of each
    (:func:`each`); ``run(each_item, items, n, lambda todo, progress: (measure, todo, progress, *args))``.
    ``measure`` must be a module-level function (it travels to the ranks by reference)."""
    return each(items, lambda item: measure(item, *args), progress)


# --------------------------------------------------------------------------------------------------------
# the host


def _cause(exc: BaseException) -> str:
    """The failing rank's error in one line."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _out_of_memory(exc: BaseException) -> bool:
    return is_oom(exc) or "OutOfMemoryError" in _cause(exc)


def salvage(ranks: list[tuple[dict[int, dict], int | None]], count: int, failing_rank: int | None,
            hung: bool) -> tuple[dict[int, tuple[dict, ...]], int | None]:
    """What a failed launch of ``count`` items leaves (``ranks`` from :meth:`Progress.read`): the rows of the
    items every rank finished, an item one rank ran out of memory in as that rank's row (its ``error``
    prefixed with the rank; its peers may never have finished it), and the index of the item the launch
    failed in: the failing rank's current item, or where the launch hung (``hung``) or the rank was in
    none, the earliest item a rank was in (else the first not finished), None if every item finished."""
    rows: dict[int, tuple[dict, ...]] = {}
    for i in range(count):
        finished = [(r, done[i]) for r, (done, _) in enumerate(ranks) if i in done]
        oom = [(r, row) for r, row in finished if row.get("status") == "oom"]
        if len(finished) == len(ranks):
            rows[i] = tuple(row for _, row in finished)
        elif oom:
            r, row = oom[0]
            rows[i] = ({**row, "error": f"rank {r}: {row.get('error', '')}"},)
    left = [i for i in range(count) if i not in rows]
    if not left:
        return rows, None
    current = ranks[failing_rank][1] if failing_rank is not None and not hung else None
    if current is None or current in rows:
        started = [c for _, c in ranks if c is not None and c not in rows]
        current = min(started) if started else left[0]
    return rows, current


def run(worker: Callable, items: Sequence, world_size: int,
        args: Callable[[list, Progress], tuple] | None = None, *, blank: Blank,
        deadline_s: float | None = None, skip_failed: bool = False, items_per_launch: int | None = None,
        **launch_kwargs) -> list[tuple[dict, ...]]:
    """Every item of ``items`` measured by ``worker`` on ``world_size`` ranks (:func:`launcher.launch`);
    returns, in the items' order, each item's rows: one per rank, or one row where the item failed.

    ``worker(*args(launch_items, progress))`` (default ``worker(launch_items, progress)``) runs on every rank
    and returns one row per item of its launch, recording each as it finishes (:func:`each`).
    ``items_per_launch``: at most that many items in one launch (1: each item in fresh processes).

    When a launch fails, its finished rows are kept (:func:`salvage`) and the item it failed in becomes a row
    ``blank(item, status, cause)``, ``cause`` the failing rank's error in one line. Then:

    * the item ran out of memory (``oom``): the next items run in a new launch;
    * otherwise (``failed``) with ``skip_failed``, where the failure was inside an item (not in the launch's
      setup): the next items run in a new launch;
    * otherwise with ``deadline_s``: every item left becomes a ``failed`` row with the cause;
    * otherwise the launch's :class:`launcher.WorkerError` is raised.

    ``deadline_s`` counts seconds for the whole run; past it every item left becomes ``failed``.
    ``launch_kwargs`` go to :func:`launcher.launch` (device, timeout_s, first_gpu, env...)."""
    if items_per_launch is not None and items_per_launch < 1:
        raise ValueError(f"items_per_launch must be a positive int or None, got {items_per_launch!r}")
    args = args or (lambda batch, progress: (batch, progress))
    items = list(items)
    out: dict[int, tuple[dict, ...]] = {}
    todo, started, launches, cause = list(range(len(items))), time.monotonic(), 0, ""
    while todo:
        left = None if deadline_s is None else deadline_s - (time.monotonic() - started)
        if left is not None and left <= 0:
            cause = cause or f"not run: the {deadline_s:g} s deadline had passed"
            break
        batch = todo[:items_per_launch] if items_per_launch else list(todo)
        with tempfile.TemporaryDirectory(prefix="lab_runner_") as folder:
            progress = Progress(folder, launches)
            launched = time.monotonic()
            launches += 1
            try:
                per_rank = launcher.launch(worker, world_size, *args([items[i] for i in batch], progress),
                                           deadline_s=left, **launch_kwargs)
            except launcher.WorkerError as exc:
                hung = left is not None and time.monotonic() - launched >= left
                ranks = progress.read(world_size)
                rows, failed = salvage(ranks, len(batch), exc.rank, hung)
                # a launch that failed before any rank began an item (its setup) is no item's failure
                began = any(done or current is not None for done, current in ranks)
                error = exc
            else:
                for ranks in per_rank:
                    if len(ranks) != len(batch):
                        raise ValueError(f"{getattr(worker, '__name__', worker)} returned {len(ranks)} rows for "
                                         f"{len(batch)} items")
                out.update({batch[j]: rows for j, rows in enumerate(zip(*per_rank))})
                todo = todo[len(batch):]
                continue
        before = len(out)
        out.update({batch[j]: r for j, r in rows.items()})
        cause = _cause(error)
        # a rank that stopped after an item's out-of-memory row (:func:`each`) failed in no item
        stopped = StoppedAfterOOM.__name__ in cause or any(
            len(rs) < world_size and rs[0].get("status") == "oom" for rs in rows.values())
        resumable = stopped
        if failed is not None and not stopped:
            oom = _out_of_memory(error)
            out[batch[failed]] = (blank(items[batch[failed]], "oom" if oom else "failed", cause),)
            resumable = resumable or oom or (skip_failed and began)
        todo = [i for i in todo if i not in out]
        if todo and not (resumable and len(out) > before):  # a launch that settled no item is not retried
            if deadline_s is None:
                raise error
            break
    for i in todo:
        out[i] = (blank(items[i], "failed", cause),)
    return [out[i] for i in range(len(items))]

