"""The one progress bar of the benchmarks' sweeps.

``progress=False`` switches it off; otherwise ``disable`` is left unset so that ``TQDM_DISABLE=1`` (which the
book's renderer sets) keeps bars out of rendered reports. Passing ``disable=not progress`` instead would
override the environment and draw the bar anyway.
"""

from __future__ import annotations

from collections.abc import Iterable


def progress_bar(iterable: Iterable, desc: str, progress: bool = True):
    """A tqdm bar over ``iterable`` when ``progress``; otherwise none."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc) if progress else tqdm(iterable, desc=desc, disable=True)
