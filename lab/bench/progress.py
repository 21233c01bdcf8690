"""The one progress bar of the benchmarks' sweeps, and the progress line of their launched processes.

``progress=False`` switches it off; otherwise ``disable`` is left unset so that ``TQDM_DISABLE=1`` (which the
book's renderer sets) keeps bars out of rendered reports. Passing ``disable=not progress`` instead would
override the environment and draw the bar anyway.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

#: What starts a progress line (:func:`progress_line`); the book's renderer drops such lines from reports.
PREFIX = "[progress] "


def progress_bar(iterable: Iterable, desc: str, progress: bool = True):
    """A tqdm bar over ``iterable`` when ``progress``; otherwise none."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc) if progress else tqdm(iterable, desc=desc, disable=True)


def progress_line(text: str) -> None:
    """One line of a long run's progress on stderr, where a bar cannot go (a launched rank's process, whose
    output interleaves with its peers'): the terminal and a render's log keep it, and the book's renderer
    drops it from the report's stored outputs, as it does bars (``lab.render.strip_progress_bars``)."""
    print(PREFIX + text, file=sys.stderr, flush=True)
