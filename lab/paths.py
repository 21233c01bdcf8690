"""Where things live: the repository root, results, reports and (git-ignored) artifacts."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve(path: str | os.PathLike) -> Path:
    """An absolute path; relative paths are taken from the repository root (not the notebook's folder)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


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
