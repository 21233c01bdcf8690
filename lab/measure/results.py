"""One results store: every table is a CSV with a JSON sidecar of provenance.

Each saved row carries ``gpu``, ``torch``, ``commit`` and ``status`` columns so that a table read on its
own still says where it came from; the sidecar holds the rest (driver, CUDA, Triton, date, parameters).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import torch

from lab import paths

# Headline tables named in the spec, with the columns that identify one measurement. Rows written again
# with the same key (on the same GPU) replace the old ones; others are appended.
HEADLINE_KEYS: dict[str, list[str]] = {
    "flash_benchmark": ["impl", "dtype", "batch", "heads", "seq_len", "d", "causal"],
    "lm_step": ["size", "context", "batch", "dtype", "attention", "compile", "world_size"],
    "ddp_benchmark": ["impl", "bucket_mb", "world_size", "size", "context", "batch", "dtype"],
    "sharding_benchmark": ["impl", "world_size", "size", "context", "batch", "dtype"],
}


def git_commit() -> str:
    """The commit the code came from: ``$LAB_COMMIT`` if set (a copied tree has no .git), else git's HEAD."""
    if os.environ.get("LAB_COMMIT"):
        return os.environ["LAB_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=paths.REPO_ROOT,
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=paths.REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_label() -> str:
    """``"NVIDIA H100 80GB HBM3"`` (with ``" x2"`` for several GPUs), or ``"cpu"``."""
    if not torch.cuda.is_available():
        return "cpu"
    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    return name if n == 1 else f"{name} x{n}"


def provenance(params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where a result came from: GPU name and count, driver, CUDA, torch, triton, commit, date, parameters."""
    cuda = torch.cuda.is_available()
    return {
        "gpu": gpu_label(),
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver": _driver_version() if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "host_cpu": platform.processor() or platform.machine(),
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
    return str(obj)


def with_provenance_columns(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``df`` with ``gpu``, ``torch``, ``commit`` and ``status`` columns filled where missing."""
    df = df.copy()
    prov = None
    for col in ("gpu", "torch", "commit"):
        if col not in df.columns:
            prov = prov or provenance()
            df[col] = prov[col]
    if "status" not in df.columns:
        df["status"] = "ok"
    df["status"] = df["status"].fillna("ok")
    return df


def save_results(df: pd.DataFrame, name: str, results_dir: str | os.PathLike = "results",
                 params: dict[str, Any] | None = None) -> Path:
    """Write ``df`` to ``<results_dir>/<name>.csv`` and its provenance to ``<name>.json``; returns the CSV path.

    Headline tables (see ``HEADLINE_KEYS``) are merged with what is already there rather than overwritten,
    so several notebooks can contribute rows to ``lm_step.csv``.
    """
    out = paths.results_dir(results_dir)
    df = with_provenance_columns(df)
    csv = out / f"{name}.csv"
    if name in HEADLINE_KEYS and csv.exists():
        df = merge_rows(pd.read_csv(csv), df, HEADLINE_KEYS[name] + ["gpu"])
    df.to_csv(csv, index=False)
    meta = provenance(params)
    meta["table"] = name
    meta["rows"] = int(len(df))
    meta_path = out / f"{name}.json"
    (meta_path).write_text(json.dumps(meta, indent=2) + "\n")
    return csv


def merge_rows(old: pd.DataFrame, new: pd.DataFrame, key: Iterable[str]) -> pd.DataFrame:
    """``old`` with the rows whose key matches a row of ``new`` replaced by ``new``'s rows.

    A replacing row keeps the old row's values in the columns it leaves empty, so a notebook that measures
    only the forward does not erase the train-step time another notebook measured for the same configuration
    on the same GPU.
    """
    key = [k for k in key if k in old.columns and k in new.columns]
    if old.empty or not key:
        return pd.concat([old, new], ignore_index=True)

    def text(value) -> str:
        # 512 and 512.0 are the same key (a column read back from CSV with a missing value becomes float)
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value)

    def norm(frame: pd.DataFrame) -> pd.Series:
        # map rather than astype(str): pandas 3 keeps NaN as NaN under astype, and join would fail
        return frame[key].apply(lambda col: col.map(text)).agg("|".join, axis=1)

    old_keys, new_keys = norm(old), norm(new)
    replaced = old_keys.isin(set(new_keys))
    if replaced.any():
        previous = old[replaced].set_axis(old_keys[replaced]).loc[lambda f: ~f.index.duplicated(keep="last")]
        filled = new.set_axis(new_keys).combine_first(previous.reindex(new_keys.unique()))
        filled = filled.loc[new_keys]  # back to new's row order
        if "status" in filled.columns and "status" in previous.columns:
            # a mode that ran out of memory before and was not re-measured is still out of memory
            was_oom = previous["status"].reindex(filled.index).eq("oom").to_numpy()
            filled.loc[was_oom, "status"] = "oom"
            if "error" in previous.columns:
                old_err = previous["error"].reindex(filled.index).fillna("").astype(str).to_numpy()
                new_err = (filled["error"].fillna("").astype(str).to_numpy() if "error" in filled.columns
                           else [""] * len(filled))
                filled["error"] = ["; ".join(dict.fromkeys(e for e in (a, b) if e)) for a, b in zip(new_err, old_err)]
        columns = list(new.columns) + [c for c in old.columns if c not in new.columns]
        new = filled[columns].reset_index(drop=True)
    return pd.concat([old[~replaced], new], ignore_index=True)


def combine_results(sources: Iterable[str | os.PathLike], destination: str | os.PathLike = "results") -> list[Path]:
    """Copy the tables of several result folders (e.g. renders on different machines) into one.

    Headline tables are merged row by row (later sources win for the same key); their sidecar lists the
    provenance of every contributing source under ``"sources"``. Other tables, their sidecars and figures
    are copied, later sources replacing earlier ones. Returns the files written.
    """
    import shutil

    dst = paths.results_dir(destination)
    written = []
    for src in map(paths.resolve, sources):
        for csv in sorted(src.glob("*.csv")):
            name = csv.stem
            meta_src = csv.with_suffix(".json")
            meta = json.loads(meta_src.read_text()) if meta_src.exists() else {}
            if name in HEADLINE_KEYS and (dst / csv.name).exists():
                merged = merge_rows(pd.read_csv(dst / csv.name), pd.read_csv(csv), HEADLINE_KEYS[name] + ["gpu"])
                merged.to_csv(dst / csv.name, index=False)
                old = json.loads((dst / f"{name}.json").read_text()) if (dst / f"{name}.json").exists() else {}
                meta = {"table": name, "rows": int(len(merged)), "sources": old.get("sources", [old]) + [meta]}
            else:
                shutil.copyfile(csv, dst / csv.name)
                if name in HEADLINE_KEYS:
                    meta = {"table": name, "rows": meta.get("rows"), "sources": [meta]}
            (dst / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n")
            written.append(dst / csv.name)
        if (src / "figures").is_dir():
            (dst / "figures").mkdir(exist_ok=True)
            for fig in (src / "figures").iterdir():
                shutil.copyfile(fig, dst / "figures" / fig.name)
                written.append(dst / "figures" / fig.name)
    return written


def load_results(name: str, results_dir: str | os.PathLike = "results") -> pd.DataFrame:
    """Read a saved table back (so a plot can be redrawn without re-running the measurement)."""
    csv = paths.resolve(results_dir) / f"{name}.csv"
    if not csv.exists():
        raise FileNotFoundError(f"no results table {name!r} in {paths.resolve(results_dir)}; run the notebook "
                                "that measures it first")
    return pd.read_csv(csv)


def load_metadata(name: str, results_dir: str | os.PathLike = "results") -> dict[str, Any]:
    """The provenance sidecar of a saved table."""
    return json.loads((paths.resolve(results_dir) / f"{name}.json").read_text())
