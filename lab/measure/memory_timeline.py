"""Reading memory snapshots offline, without a browser: allocator events as tables, the active-memory
timeline (as memory_viz computes it), allocation lifetimes, the largest allocations with the user code
that made them, phase peaks, and an inline plot.

Snapshots come from :mod:`lab.measure.memory_snapshot` (or ``torch.cuda.memory._dump_snapshot``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from lab.measure.device import resolve_device, synchronize
from lab.measure.memory_snapshot import record_memory_snapshot
from lab.units import GiB, MiB


def _trace(snapshot: dict, device: int | None) -> list[dict]:
    traces = snapshot.get("device_traces", [])
    if device is None:
        non_empty = [i for i, t in enumerate(traces) if t]
        if len(non_empty) > 1:
            raise ValueError(f"the snapshot has traces for devices {non_empty}; pass device=")
        return traces[non_empty[0]] if non_empty else []
    if device >= len(traces):
        raise ValueError(f"the snapshot has no trace for device {device} (it has {len(traces)})")
    return traces[device]


_INTERNAL = ("/torch/", "/site-packages/", "/dist-packages/", "<frozen", "/lib/python3",
             "/contextlib.py", "/threading.py", "/IPython/", "/ipykernel/", "/papermill/", "/tornado/",
             "/asyncio/", "/traitlets/", "/runpy.py")


def is_user_frame(frame: dict) -> bool:
    """True for a Python frame from user or ``lab`` code; False for torch internals, the standard library,
    the notebook machinery and C++ frames."""
    # the profiler reports paths relative to sys.path entries ("torch/nn/modules/linear.py")
    filename = "/" + str(frame.get("filename", "")).replace("\\", "/").lstrip("/")
    if not filename.endswith(".py") and "ipykernel_" not in filename:
        return False
    if any(h in filename for h in ("/lab/measure/", "/lab/bench/")):  # the measuring harness is not an origin
        return False                                                    # (the model code it calls is)
    if "/lab/" in filename:  # the lab package is user code even when installed in site-packages
        return True
    return not any(s in filename for s in _INTERNAL)


def format_bytes(n: float) -> str:
    """``"1.5 GiB"``, ``"320 MiB"``, ``"12 KiB"``, ``"96 B"``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.3g} {unit}" if abs(v) < 1000 else f"{v:,.0f} {unit}"
    return f"{n:.0f} B"


def format_frame(frame: dict) -> str:
    """``file.py:123:function`` (the file's base name)."""
    return f"{Path(frame.get('filename', '?')).name}:{frame.get('line', 0)}:{frame.get('name', '?')}"


def origin(frames: Sequence[dict], depth: int = 2) -> str:
    """The first ``depth`` user frames (innermost first, joined by ``" < "``), or the innermost frame if no
    user frame is present, or ``"?"`` for an empty stack."""
    user = [format_frame(f) for f in frames if is_user_frame(f)][:depth]
    if user:
        return " < ".join(user)
    py = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    return f"[torch] {format_frame(py[0])}" if py else (format_frame(frames[0]) if frames else "?")


def phase_at(times_us: np.ndarray, marks: Sequence[tuple[str, int]] | None, default: str = "") -> np.ndarray:
    """The phase of each timestamp: the last mark at or before it (``default`` before the first mark)."""
    times_us = np.asarray(times_us, dtype=np.int64)
    if not marks:
        return np.full(len(times_us), default, dtype=object)
    marks = sorted(marks, key=lambda m: m[1])
    names = np.array([default] + [m[0] for m in marks], dtype=object)
    idx = np.searchsorted(np.array([m[1] for m in marks], dtype=np.int64), times_us, side="right")
    return names[idx]


def snapshot_events(snapshot: dict, device: int | None = None, marks: Sequence[tuple[str, int]] | None = None,
                    depth: int = 2) -> pd.DataFrame:
    """The allocator trace as a DataFrame, one row per event.

    Columns: ``index`` (position in the trace), ``action``, ``addr``, ``size`` (bytes), ``stream``,
    ``time_us``, ``phase`` (from ``marks``), ``origin`` (first user frames, see :func:`origin`), ``category``
    (CPU recordings only) and ``frames`` (the raw frame list, innermost first).
    """
    trace = _trace(snapshot, device)
    df = pd.DataFrame({
        "index": np.arange(len(trace)),
        "action": [e["action"] for e in trace],
        "addr": [e.get("addr", -1) for e in trace],
        "size": np.array([e.get("size", 0) for e in trace], dtype=np.int64),
        "stream": [e.get("stream", 0) for e in trace],
        "time_us": np.array([e.get("time_us", 0) for e in trace], dtype=np.int64),
        "origin": [origin(e.get("frames", []), depth) for e in trace],
        "category": [e.get("category", "") for e in trace],
        "frames": [e.get("frames", []) for e in trace],
    })
    df.insert(6, "phase", phase_at(df["time_us"].to_numpy(), marks))
    return df


def allocation_lifetimes(snapshot: dict, device: int | None = None,
                         marks: Sequence[tuple[str, int]] | None = None, depth: int = 2) -> pd.DataFrame:
    """One row per allocation seen in the trace: when it was made and freed (trace indices).

    Allocations freed in the trace without an ``alloc`` event existed before recording began
    (``alloc_index`` = -1, ``origin`` "before trace"); those still active in the final segments without an
    event too. ``free_index`` is the trace length for allocations alive at the end. Frees count when
    *completed* (the memory is reusable), as memory_viz does. Columns: ``addr``, ``size``, ``alloc_index``,
    ``free_index``, ``alloc_time_us``, ``phase`` (of the allocation), ``origin``, ``category``, ``frames``.
    """
    trace = _trace(snapshot, device)
    n = len(trace)
    live: dict[int, dict] = {}
    done: list[dict] = []
    for i, e in enumerate(trace):
        action = e["action"]
        if action == "alloc":
            live[e["addr"]] = dict(addr=e["addr"], size=e["size"], alloc_index=i, free_index=n,
                                   alloc_time_us=e.get("time_us", 0), frames=e.get("frames", []),
                                   category=e.get("category", ""))
        elif action == "free_completed":
            a = live.pop(e["addr"], None)
            if a is None:  # allocated before the trace began (or before the ring buffer wrapped)
                a = dict(addr=e["addr"], size=e["size"], alloc_index=-1, alloc_time_us=0,
                         frames=e.get("frames", []), category=e.get("category", ""), before=True)
            a["free_index"] = i
            done.append(a)
    for seg in snapshot.get("segments", []):
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated" and b.get("address") is not None and b["address"] not in live:
                done.append(dict(addr=b["address"], size=b["size"], alloc_index=-1, free_index=n, alloc_time_us=0,
                                 frames=b.get("frames", []), category="", before=True))
    rows = done + list(live.values())
    df = pd.DataFrame(rows, columns=["addr", "size", "alloc_index", "free_index", "alloc_time_us", "frames",
                                     "category", "before"])
    df["before"] = df["before"].fillna(False).astype(bool)
    df["origin"] = [("before trace" if b else origin(f, depth)) for f, b in zip(df["frames"], df["before"])]
    df["phase"] = phase_at(df["alloc_time_us"].to_numpy(), marks)
    df.loc[df["before"], "phase"] = "before trace"
    df["size"] = df["size"].astype(np.int64)
    return df.sort_values(["alloc_index", "addr"]).reset_index(drop=True)


def active_memory_timeline(snapshot: dict, device: int | None = None,
                           marks: Sequence[tuple[str, int]] | None = None) -> pd.DataFrame:
    """Active (allocated) bytes after every trace event, and reserved bytes from segment events.

    Reconstructed as memory_viz does: start from the allocations that existed before the trace (those freed
    without being allocated in it, plus blocks active at the end without an event), add ``alloc`` sizes,
    subtract ``free_completed`` sizes. Returns columns ``index``, ``time_us``, ``action``, ``delta_bytes``,
    ``active_bytes``, ``reserved_bytes`` (NaN where the snapshot has no segment information), ``phase``.
    """
    trace = _trace(snapshot, device)
    lifetimes = allocation_lifetimes(snapshot, device)
    baseline = int(lifetimes.loc[lifetimes["before"], "size"].sum())
    delta = np.zeros(len(trace), dtype=np.int64)
    seg_delta = np.zeros(len(trace), dtype=np.int64)
    sizes: dict[int, int] = {}
    for i, e in enumerate(trace):
        action = e["action"]
        if action == "alloc":
            sizes[e["addr"]] = e["size"]
            delta[i] = e["size"]
        elif action == "free_completed":
            delta[i] = -sizes.pop(e["addr"], e["size"])
        elif action == "segment_alloc":
            seg_delta[i] = e["size"]
        elif action == "segment_free":
            seg_delta[i] = -e["size"]
    times = np.array([e.get("time_us", 0) for e in trace], dtype=np.int64)
    reserved_end = sum(s.get("total_size", 0) for s in snapshot.get("segments", []))
    # CUDA snapshots describe the allocator's segments (with a pool id); a converted CPU profile does not
    has_segments = any(e["action"].startswith("segment_") for e in trace) or any(
        "segment_pool_id" in s for s in snapshot.get("segments", []))
    reserved = (reserved_end - seg_delta.sum() + np.cumsum(seg_delta)).astype(float) if has_segments \
        else np.full(len(trace), math.nan)
    return pd.DataFrame({"index": np.arange(len(trace)), "time_us": times,
                         "action": [e["action"] for e in trace], "delta_bytes": delta,
                         "active_bytes": baseline + np.cumsum(delta), "reserved_bytes": reserved,
                         "phase": phase_at(times, marks)})


def peaks_by_phase(timeline: pd.DataFrame) -> pd.DataFrame:
    """Peak active memory of each phase of a timeline (from :func:`active_memory_timeline` with marks).

    Returns columns ``phase`` (in order of appearance), ``start_index``, ``end_index``, ``peak_index``,
    ``peak_gib``, ``start_gib`` (active memory just before the phase) and ``end_gib``.
    """
    if timeline.empty:
        return pd.DataFrame(columns=["phase", "start_index", "end_index", "peak_index", "peak_gib", "start_gib",
                                     "end_gib"])
    rows = []
    active = timeline["active_bytes"].to_numpy()
    start_active = active[0] - timeline["delta_bytes"].iloc[0]
    # consecutive runs of the same phase label
    change = np.r_[True, timeline["phase"].to_numpy()[1:] != timeline["phase"].to_numpy()[:-1]]
    starts = np.flatnonzero(change)
    ends = np.r_[starts[1:], len(timeline)]
    for s, e in zip(starts, ends):
        seg = active[s:e]
        k = int(np.argmax(seg))
        before = active[s - 1] if s > 0 else start_active
        rows.append(dict(phase=timeline["phase"].iloc[s], start_index=int(s), end_index=int(e - 1),
                         peak_index=int(s + k), peak_gib=seg[k] / GiB, start_gib=before / GiB,
                         end_gib=seg[-1] / GiB))
    return pd.DataFrame(rows)


def largest_allocations(snapshot: dict, n: int = 10, device: int | None = None,
                        marks: Sequence[tuple[str, int]] | None = None, phase: str | None = None,
                        depth: int = 2) -> pd.DataFrame:
    """The ``n`` largest allocations made in the trace (optionally only in ``phase``), with their origin.

    ``origin`` is the first ``depth`` user frames (torch internals filtered out, see :func:`is_user_frame`).
    Returns columns ``size_mib``, ``phase``, ``alloc_index``, ``free_index``, ``lifetime_events``,
    ``origin``, ``category`` (CPU recordings), ``shape_hint`` (the size as a multiple of 4-byte words).
    """
    life = allocation_lifetimes(snapshot, device, marks, depth)
    life = life[~life["before"]]
    if phase is not None:
        life = life[life["phase"] == phase]
    top = life.sort_values(["size", "alloc_index"], ascending=[False, True]).head(n)
    return pd.DataFrame({"size_mib": top["size"] / MiB, "phase": top["phase"], "alloc_index": top["alloc_index"],
                         "free_index": top["free_index"], "lifetime_events": top["free_index"] - top["alloc_index"],
                         "origin": top["origin"], "category": top["category"]}).reset_index(drop=True)


def allocations_by_origin(snapshot: dict, marks: Sequence[tuple[str, int]] | None = None, phase: str | None = None,
                          depth: int = 1, device: int | None = None) -> pd.DataFrame:
    """Allocations made in the trace (optionally only in ``phase``) grouped by where they come from (the first
    ``depth`` user frames). Returns ``origin``, ``count``, ``total_mib`` (sum of their sizes), ``largest_mib``
    and ``share`` (of all bytes allocated in the selection), largest total first."""
    life = allocation_lifetimes(snapshot, device, marks, depth)
    life = life[~life["before"]]
    if phase is not None:
        life = life[life["phase"] == phase]
    g = life.groupby("origin")["size"].agg(count="count", total="sum", largest="max").reset_index()
    g = g.sort_values(["total", "origin"], ascending=[False, True]).reset_index(drop=True)
    total = g["total"].sum()
    return pd.DataFrame({"origin": g["origin"], "count": g["count"], "total_mib": g["total"] / MiB,
                         "largest_mib": g["largest"] / MiB, "share": g["total"] / total if total else 0.0})


def gradient_bytes_by_window(snapshot: dict, marks: Sequence[tuple[str, int]], windows: Sequence[str],
                             end_phase: str, device: int | None = None) -> pd.DataFrame:
    """Memory allocated in each phase window of ``windows`` that is still alive when ``end_phase`` begins.

    In a training step whose backward is marked per block (``"backward block 31"``, ... by full backward
    pre-hooks), the allocations of a block's window that survive the whole backward are that block's
    gradients (activation temporaries are freed before the backward ends). Returns ``window`` and
    ``surviving_bytes`` columns.
    """
    life = allocation_lifetimes(snapshot, device, marks)
    events = snapshot_events(snapshot, device, marks)
    starts = events.index[events["phase"] == end_phase]
    end_index = int(starts[0]) if len(starts) else len(events)
    rows = []
    for w in windows:
        sel = life[(life["phase"] == w) & (life["free_index"] >= end_index)]
        rows.append(dict(window=w, surviving_bytes=int(sel["size"].sum())))
    return pd.DataFrame(rows)



def plot_active_memory_timeline(snapshot: dict, marks: Sequence[tuple[str, int]] | None = None, top: int = 8,
                                device: int | None = None, ax=None, title: str | None = None,
                                annotate_peaks: bool = True):
    """Draw the active-memory timeline inline (matplotlib), no browser needed.

    The black line is all active memory after each allocator event. Under it, memory is stacked in bands
    as memory_viz stacks allocations, but grouped so that a static plot stays readable: one band for what
    was allocated before the recording (parameters, ...), then the ``top`` groups (innermost user frame of
    :func:`origin` and kind of phase) whose allocations cover the most bytes x events, in order of first
    allocation, and the rest in grey. Phases from ``marks`` are drawn as dotted lines with each phase's
    peak marked. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt

    timeline = active_memory_timeline(snapshot, device, marks)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 4.5))
    if timeline.empty:
        ax.set_title(title or "empty trace")
        return ax
    n = len(timeline)
    x = timeline["index"].to_numpy()
    scale, unit = (GiB, "GiB") if timeline["active_bytes"].max() >= GiB / 2 else (MiB, "MiB")
    total = timeline["active_bytes"].to_numpy() / scale
    life = allocation_lifetimes(snapshot, device, marks)
    # group by the innermost user frame and the kind of phase (backward allocations on CUDA run on the
    # autograd thread without a Python stack, so the phase is what tells gradients from activations)
    kind = life["phase"].astype(str).str.replace(r"\s*\d+$", "", regex=True)
    frame = life["origin"].str.split(" < ").str[0].replace("?", "no Python frames")
    life["group"] = np.where(life["before"], "before trace",
                             np.where(kind != "", frame + " · " + kind, frame))
    life["area"] = life["size"] * (life["free_index"] - life["alloc_index"].clip(lower=0))
    made = life[~life["before"]]
    groups = made.groupby("group")["area"].sum().sort_values(ascending=False).head(top).index
    order = made[made["group"].isin(groups)].groupby("group")["alloc_index"].min().sort_values().index
    bands, labels = [], []
    for g in (["before trace"] if life["before"].any() else []) + list(order):
        members = life[life["group"] == g]
        delta = np.zeros(n + 1)
        np.add.at(delta, members["alloc_index"].clip(lower=0).to_numpy(), members["size"].to_numpy())
        np.add.at(delta, members["free_index"].to_numpy(), -members["size"].to_numpy())
        band = np.cumsum(delta)[:n]
        if g == "before trace":  # allocations freed during the trace were live from the start
            band = np.maximum(band, 0)
        bands.append(band / scale)
        labels.append(f"{g} (max {format_bytes(band.max())})")
    rest = np.maximum(total - (np.sum(bands, axis=0) if bands else 0), 0)
    colours = list(plt.get_cmap("tab10")(np.arange(len(bands)) % 10))
    ax.stackplot(x, *bands, rest, colors=colours + ["#cccccc"], step="post", labels=labels + ["other"],
                 linewidth=0)
    ax.plot(x, total, color="black", linewidth=0.8, drawstyle="steps-post")
    ax.set_ylabel(f"active memory ({unit})")
    ax.set_xlabel("allocator event")
    ax.set_xlim(x[0], x[-1])
    ax.set_ylim(0, total.max() * 1.2)
    if marks:
        peaks = peaks_by_phase(timeline)
        peaks = peaks[peaks["phase"] != ""].reset_index(drop=True)
        for i, row in peaks.iterrows():
            ax.axvline(row["start_index"], color="black", linestyle=":", linewidth=0.8)
            # alternate heights so that the names of short neighbouring phases do not overlap
            ax.text(row["start_index"], 0.99 - 0.06 * (i % 2), f" {row['phase']}", fontsize=8, va="top",
                    transform=ax.get_xaxis_transform())
        if annotate_peaks:
            # label each phase's peak, except where a higher peak of a neighbouring phase sits right beside it
            span, height = x[-1] - x[0] + 1, total.max()
            ys = peaks["peak_gib"].to_numpy() * GiB / scale
            for i, row in peaks.iterrows():
                near = (np.abs(peaks["peak_index"] - row["peak_index"]) < 0.03 * span) & \
                       (np.abs(ys - ys[i]) < 0.05 * height)
                if (ys[near.to_numpy()] > ys[i]).any() or (near.to_numpy()[:i] & (ys[:i] == ys[i])).any():
                    continue
                ax.plot(row["peak_index"], ys[i], "v", color="crimson", markersize=5)
                ax.annotate(f"{ys[i]:.3g}", (row["peak_index"], ys[i]), textcoords="offset points",
                            xytext=(0, 3), ha="center", fontsize=7, color="crimson")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    if title:
        ax.set_title(title)
    return ax


def phase_rows_from_timeline(timeline: pd.DataFrame, marks: Sequence[tuple[str, int]]) -> list[dict]:
    """Per-phase peak and end-of-phase allocated bytes from a timeline whose marks are ``"step|phase"``.

    A phase in which no allocator event happened keeps the level it started with.
    """
    active = timeline["active_bytes"].to_numpy()
    before_first = int(active[0] - timeline["delta_bytes"].iloc[0]) if len(active) else 0
    phase = timeline["phase"].to_numpy()
    rows, level = [], before_first
    for name, _ in sorted(marks, key=lambda m: m[1]):
        step, ph = name.split("|")
        sel = active[phase == name]
        start = level
        if len(sel):
            level = int(sel[-1])
        if ph == "end":
            continue
        peak = max(start, int(sel.max())) if len(sel) else start
        rows.append(dict(step=int(step), phase=ph, peak_bytes=peak, allocated_bytes=level))
    return rows



def measure_peak_bytes(fn: Callable[[], Any], device: str | torch.device) -> int:
    """Peak bytes allocated while ``fn()`` runs (including what was allocated before it started).

    CUDA: the caching allocator's ``max_memory_allocated`` after a reset. CPU: the maximum of the active
    memory timeline of a profiler recording (:func:`record_memory_snapshot`), which sees every tensor
    the region touches or creates.
    """
    device = resolve_device(device) if isinstance(device, str) else torch.device(device)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with record_memory_snapshot(Path(tmp) / "peak.pickle", device=device) as rec:
            fn()
        tl = active_memory_timeline(rec.snapshot)
    if tl.empty:
        return 0
    return int(max(tl["active_bytes"].max(), tl["active_bytes"].iloc[0] - tl["delta_bytes"].iloc[0]))

