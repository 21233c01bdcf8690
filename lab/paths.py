"""Where things live: the repository root, results, reports and (git-ignored) artifacts."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve(path: str | os.PathLike) -> Path:
    """An absolute path; relative paths are taken from the repository root (not the notebook's folder)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def repo_relative(path) -> str | None:
    """``path`` relative to the repository root when it lies inside it, else as given (tables that name a
    trace travel between machines); None for anything that is not a path (None, a table's missing value)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def results_dir(path: str | os.PathLike = "results") -> Path:
    """The results folder (created if missing)."""
    p = resolve(path)
    p.mkdir(parents=True, exist_ok=True)
    return p


def artifacts_dir(path: str | os.PathLike = "artifacts") -> Path:
    """The git-ignored folder for regenerable large files: profiler traces, memory snapshots."""
    p = resolve(path)
    p.mkdir(parents=True, exist_ok=True)
    return p
