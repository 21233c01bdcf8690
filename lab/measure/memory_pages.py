"""A memory snapshot's pages and phases, for any snapshot pickle of :mod:`lab.measure.memory_snapshot`: the peak
of each marked phase, a self-contained HTML page (the active-memory timeline as an embedded PNG, the peak of each
phase and the largest allocations with the code that made them: it opens offline, unlike memory_viz's page,
whose viewer script comes from a CDN), and what a page loads from the web.
"""

from __future__ import annotations

import base64
import html
import io
import os
import re
from pathlib import Path

import pandas as pd

from lab import paths
from lab.measure.memory_snapshot import export_memory_viz_html, load_marks, load_snapshot
from lab.measure.memory_timeline import (
    active_memory_timeline,
    largest_allocations,
    peaks_by_phase,
    plot_active_memory_timeline,
)


def phase_label(phase: str) -> str:
    """A phase name as the figures and tables print it: ``optimizer_step`` -> ``optimizer step``."""
    return str(phase).replace("optimizer_step", "optimizer step")


def marked_phase_peaks(snapshot: dict, marks) -> pd.DataFrame:
    """Peak, start and end active memory (GiB) of each marked phase of a snapshot, without the unmarked stretch
    before the first mark and the ``end`` mark's tail (:func:`lab.measure.memory_timeline.peaks_by_phase`)."""
    peaks = peaks_by_phase(active_memory_timeline(snapshot, marks=marks))
    return peaks[~peaks["phase"].isin(["", "end"])].reset_index(drop=True)


def external_resources(page: str) -> list[str]:
    """The URLs an HTML page loads from elsewhere (``src``/``href`` attributes, ES module imports, CSS
    ``@import``/``url()``): a page that lists none shows the same thing without a network."""
    found = re.findall(r"""(?:src|href)\s*=\s*["']((?:https?:)?//[^"']+)""", page, flags=re.I)
    found += re.findall(r"""\b(?:from|import)\s*\(?\s*["']((?:https?:)?//[^"']+)["']""", page)
    found += re.findall(r"""(?:@import\s+|url\(\s*)["']?((?:https?:)?//[^"')\s]+)""", page, flags=re.I)
    return sorted(set(found))


def offline_snapshot_html(snapshot_path: str | os.PathLike, title: str | None = None, top: int = 10) -> str:
    """A self-contained HTML page for a snapshot pickle: the active-memory timeline as an embedded PNG, the
    peak of each phase and the ``top`` largest allocations with the code that made them. No script and no
    external resource: it opens offline (unlike memory_viz's page, whose viewer script comes from a CDN)."""
    import matplotlib.pyplot as plt  # drawn only when a page is written

    path = Path(snapshot_path)
    snapshot, marks = load_snapshot(path), load_marks(path)
    title = title or path.stem
    fig, ax = plt.subplots(figsize=(11, 4.5))
    plot_active_memory_timeline(snapshot, marks, ax=ax, title=title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    png = base64.b64encode(buf.getvalue()).decode("ascii")
    peaks = marked_phase_peaks(snapshot, marks)
    peaks = peaks.assign(phase=peaks["phase"].map(phase_label))[["phase", "peak_gib", "start_gib", "end_gib"]]
    largest = largest_allocations(snapshot, n=top, marks=marks)
    style = ("body{font-family:sans-serif;margin:2em;max-width:75em} table{border-collapse:collapse;font-size:0.9em}"
             " td,th{border:1px solid #ccc;padding:0.2em 0.6em;text-align:right} img{max-width:100%}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n<h1>{html.escape(title)}</h1>\n"
            f"<p>Snapshot <code>{html.escape(path.name)}</code>: active memory after each allocator event "
            "(bands: the largest groups of allocations; black line: all active memory).</p>\n"
            f"<img alt=\"active memory timeline\" src=\"data:image/png;base64,{png}\">\n"
            f"<h2>Peak by phase (GiB)</h2>\n{peaks.to_html(index=False, float_format='{:.4g}'.format)}\n"
            f"<h2>The {top} largest allocations</h2>\n"
            f"{largest.to_html(index=False, float_format='{:.4g}'.format)}\n</body></html>\n")


def export_snapshot_pages(folder: str | os.PathLike, names, titles: dict | None = None) -> pd.DataFrame:
    """Write two HTML pages for each snapshot ``<folder>/<name>.pickle``: ``<name>.offline.html``
    (:func:`offline_snapshot_html`) and ``<name>.memory_viz.html`` (torch's memory_viz page, the snapshot
    embedded). Returns one row per page: ``snapshot``, ``page``, ``path``, ``external`` (what it loads
    from the web) and ``works_offline``; empty if no snapshot is there."""
    folder = Path(folder)
    rows = []
    for name in names:
        pickle_path = folder / f"{name}.pickle"
        if not pickle_path.exists():
            continue
        offline = folder / f"{name}.offline.html"
        offline.write_text(offline_snapshot_html(pickle_path, (titles or {}).get(name)), encoding="utf-8")
        viz = export_memory_viz_html(pickle_path, folder / f"{name}.memory_viz.html")
        for kind, page in (("offline (PNG + tables)", offline), ("memory_viz", viz)):
            ext = external_resources(Path(page).read_text(encoding="utf-8"))
            rows.append(dict(snapshot=name, page=kind, path=paths.repo_relative(page),
                             external=", ".join(ext) or "none", works_offline=not ext))
    return pd.DataFrame(rows, columns=["snapshot", "page", "path", "external", "works_offline"])
