"""One results store: every table is a CSV with a JSON sidecar of provenance.

Each saved row is one measurement and says where it ran and from which code: ``gpu`` (the model),
``gpu_count``, ``host_cpu`` (an eager step can be paced by the host's launches), ``torch``, ``commit`` (the
full hash) and ``status``, so that a table read on its own still says where it came from; the sidecar holds the
rest (driver, CUDA, Triton, date, parameters, and what else ran on the machine when the render started).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from lab import paths
from lab.measure import machine

#: What a render writes: changes there do not make the measuring code "dirty" (a render that saves its
#: first table must not see its own output as an uncommitted change when it saves the second).
OUTPUT_DIRS = ("results", "reports", "artifacts")


def git_commit(root: str | os.PathLike | None = None) -> str:
    """The commit the code came from, as its full hash: ``$LAB_COMMIT`` if set (a copied tree has no .git),
    else git's HEAD, with ``+dirty`` when tracked files outside :data:`OUTPUT_DIRS` have uncommitted changes."""
    if os.environ.get("LAB_COMMIT"):
        return os.environ["LAB_COMMIT"]
    root = root or paths.REPO_ROOT
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        code = ["--", ".", *(f":(exclude){d}" for d in OUTPUT_DIRS)]
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", *code], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _triton_version() -> str | None:
    """Triton's version from its package metadata (importing it here would fix Triton's interpreter switch
    before lab sets it)."""
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_label() -> str:
    """The GPU model (``"NVIDIA H100 80GB HBM3"``; the count is a column of its own), or ``"cpu"``."""
    return machine.gpu_model()


def measured_on(table: pd.DataFrame, default: str = "cpu") -> str:
    """``"cuda"`` or ``"cpu"``: where a table's rows were measured, read from the rows (their ``device``
    column, else their ``gpu`` provenance, :func:`gpu_label`), not from the machine reading them, so a replay
    on a laptop still knows it holds GPU numbers. ``"cpu"`` if any row ran on the CPU; ``default`` when the
    rows say nothing."""
    for col, on_cpu in (("device", lambda v: v.startswith("cpu")), ("gpu", lambda v: v.lower() == "cpu")):
        if col in table.columns:
            values = [str(v) for v in table[col].dropna() if str(v) not in ("", "nan")]
            if values:
                return "cpu" if any(on_cpu(v) for v in values) else "cuda"
    return default


def provenance(params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where a result came from: GPU name and count, driver, CUDA, torch, triton, commit, date, parameters."""
    cuda = torch.cuda.is_available()
    return {
        "gpu": gpu_label(),
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": machine.gpu_count(),
        "driver": _driver_version() if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "host_cpu": machine.host_cpu(),
        "host_cores": os.cpu_count(),
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "params": _jsonable(params or {}),
    }


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:  # a numpy or torch scalar
        return obj.item()
    return str(obj)


def with_provenance_columns(df: pd.DataFrame, source: str | None = None) -> pd.DataFrame:
    """A copy of ``df`` with ``gpu``, ``gpu_count``, ``host_cpu``, ``torch``, ``commit``, ``status`` (and
    ``source`` if given) filled where missing: in every row without a value of its own (rows read back from an
    earlier run keep theirs)."""
    df = df.copy()
    prov = None
    for col in ("gpu", "gpu_count", "host_cpu", "torch", "commit"):
        if col not in df.columns or df[col].isna().any():
            prov = prov or provenance()
            df[col] = df[col].fillna(prov[col]) if col in df.columns else prov[col]
    if "status" not in df.columns:
        df["status"] = "ok"
    df["status"] = df["status"].fillna("ok")
    if source is not None:
        df["source"] = source
    return df


def save_results(df: pd.DataFrame, name: str, results_dir: str | os.PathLike = "results",
                 params: dict[str, Any] | None = None, source: str | None = None) -> Path:
    """Write ``df`` to ``<results_dir>/<name>.csv`` with its provenance in ``<name>.json``; returns the CSV path.

    One row is one measurement: rows are never merged or filled from another run. Without ``source`` the
    table is replaced. With ``source`` (the notebook or command that measured the rows, e.g.
    ``"01_profiling"``) only that source's earlier rows are replaced and other sources' rows are kept, so
    several notebooks can keep their rows in one table (``lm_step.csv``); every row then says in its
    ``source`` column who measured it, and the sidecar keeps each source's provenance under ``"sources"``.
    """
    if source is not None and "source" in df.columns and not (df["source"].dropna() == source).all():
        own = sorted(set(df["source"].dropna().astype(str)))[:3]
        raise ValueError(f"{name}: the table has a column 'source' of its own (values {own}); the results store "
                         f"writes there the notebook that measured each row ({source!r}). Rename the column.")
    out = paths.results_dir(results_dir)
    df = with_provenance_columns(df, source)
    csv = out / f"{name}.csv"
    meta_path = out / f"{name}.json"
    meta = provenance(params)
    if source is None:
        sidecar = {"table": name, **meta}
    else:
        old_meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        sources = dict(old_meta.get("sources", {})) if isinstance(old_meta.get("sources"), dict) else {}
        if csv.exists():
            old = pd.read_csv(csv)
            if "source" in old.columns:  # a table of rows without a source is replaced whole
                kept = old[old["source"] != source]
                sources = {s: v for s, v in sources.items() if s in set(kept["source"])}
                df = pd.concat([kept, df], ignore_index=True)
        sources[source] = meta
        sidecar = {"table": name, "sources": sources}
    df.to_csv(csv, index=False)
    sidecar["rows"] = int(len(df))
    meta_path.write_text(json.dumps(sidecar, indent=2) + "\n")
    return csv


def load_results(name: str, results_dir: str | os.PathLike = "results", source: str | None = None) -> pd.DataFrame:
    """Read a saved table back (so a plot can be redrawn without re-running the measurement); only the rows
    of ``source`` if given."""
    csv = paths.resolve(results_dir) / f"{name}.csv"
    if not csv.exists():
        raise FileNotFoundError(f"no results table {name!r} in {paths.resolve(results_dir)}; run the notebook "
                                "that measures it first")
    df = pd.read_csv(csv)
    if source is not None:
        if "source" not in df.columns or not (df["source"] == source).any():
            raise FileNotFoundError(f"results table {name!r} in {paths.resolve(results_dir)} has no rows from "
                                    f"{source!r}; run it first")
        df = df[df["source"] == source].reset_index(drop=True)
    return df


def clean_commit(commit) -> bool:
    """Whether ``commit`` names a commit (40 hex digits): not a dirty tree's (``+dirty``) nor an unknown one."""
    return bool(re.fullmatch(r"[0-9a-f]{40}", str(commit or "")))


def measured_by(source: str, commit: str, results_dir: str | os.PathLike = "results",
                here: dict | None = None) -> list[str]:
    """The tables whose rows from ``source`` were measured by ``commit`` on this machine's kind (GPU model and
    count, from ``here``, this machine's :func:`provenance` by default): what a render cut short by a time limit
    reads back, rather than measuring again, when it continues at the same commit. None for a dirty commit."""
    if not clean_commit(commit):  # a dirty tree's or an unknown commit measured nothing
        return []
    here = here or provenance()
    return [name for name, meta in tables_of(source, results_dir).items()
            if (meta.get("commit") == commit and meta.get("gpu_name") == here.get("gpu_name")
                and meta.get("gpu_count") == here.get("gpu_count"))]


def load_provenance(name: str, results_dir: str | os.PathLike = "results", source: str | None = None) -> dict:
    """The provenance of a saved table (of one ``source``'s rows in a shared table): GPU, versions, commit,
    date and parameters of the run that measured it."""
    meta = json.loads((paths.resolve(results_dir) / f"{name}.json").read_text())
    if "sources" in meta and isinstance(meta["sources"], dict):
        if source is None:
            if len(meta["sources"]) != 1:
                raise ValueError(f"table {name!r} has rows from {sorted(meta['sources'])}; pass source=")
            return next(iter(meta["sources"].values()))
        return meta["sources"][source]
    return meta


def tables_of(source: str, results_dir: str | os.PathLike = "results") -> dict[str, dict]:
    """Every saved table holding rows of ``source`` (a notebook), with the provenance of those rows."""
    found = {}
    for sidecar in sorted(paths.resolve(results_dir).glob("*.json")):
        try:
            found[sidecar.stem] = load_provenance(sidecar.stem, results_dir, source)
        except (KeyError, ValueError, json.JSONDecodeError):
            continue
    return found


def provenance_line(meta: dict) -> str:
    """``"<count> x <GPU name>, torch <version>, commit <12 hex digits>, <date>"``: who measured a table."""
    gpu = f"{meta.get('gpu_count')} x {meta.get('gpu_name')}" if meta.get("gpu_count") else "CPU"
    return (f"{gpu}, torch {meta.get('torch')}, triton {meta.get('triton')}, commit {meta.get('commit')}, "
            f"{str(meta.get('date', ''))[:10]}")


class RowLog:
    """The rows of a sweep measured so far, one JSON line each, so that a render stopped by a time limit in the
    middle of a long sweep continues at the next row rather than at the first.

    A row is kept with its key (what the sweep measured: size, context, ...) and a stamp of who measured it: the
    commit and this machine's kind (GPU model and count). :meth:`get` returns a row only to a log opened with
    ``reuse`` (a resumed render) and only where the commit is clean and the stamp is this machine's; a log
    opened without it starts empty. The table, once saved, makes the log unnecessary: :meth:`close` removes it.
    """

    def __init__(self, path: str | os.PathLike, reuse: bool = False, here: dict | None = None):
        self.path = Path(path)
        here = here or provenance()
        self.stamp = {"commit": here.get("commit"), "gpu_name": here.get("gpu_name"),
                      "gpu_count": here.get("gpu_count")}
        self._kept: dict[str, dict] = {}
        if reuse and clean_commit(self.stamp["commit"]) and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:  # a line cut short when the render was stopped
                    continue
                if entry.get("stamp") == self.stamp:
                    self._kept[entry["key"]] = entry["row"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps({"key": k, "stamp": self.stamp, "row": r}) + "\n"
                                     for k, r in self._kept.items()))
        #: how many rows :meth:`get` handed back (said beside the table)
        self.reused = 0

    @staticmethod
    def _key(key: dict) -> str:
        return json.dumps(_jsonable(key), sort_keys=True)

    def get(self, key: dict) -> dict | None:
        """The row measured earlier for ``key`` by this commit on this kind of machine, or None."""
        row = self._kept.get(self._key(key))
        if row is not None:
            self.reused += 1
        return row

    def put(self, key: dict, row: dict) -> None:
        """Log one measured row (appended at once: a stop after it keeps it)."""
        k = self._key(key)
        self._kept[k] = _jsonable(row)
        with self.path.open("a") as f:
            f.write(json.dumps({"key": k, "stamp": self.stamp, "row": self._kept[k]}) + "\n")

    def close(self) -> None:
        """Remove the log (its table is saved), and its folders where they are left empty."""
        self.path.unlink(missing_ok=True)
        for folder in (self.path.parent, self.path.parent.parent):
            try:
                folder.rmdir()
            except OSError:  # another log is still there
                break
