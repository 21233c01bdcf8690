"""Memory snapshots: record them around any region, and read them offline without a browser.

On a GPU, :func:`record_memory_snapshot` uses PyTorch's own allocator history
(``torch.cuda.memory._record_memory_history`` / ``_snapshot``) and writes the pickle that
https://pytorch.org/memory_viz opens. On a CPU (the quick lab book) the same context manager records the
region with ``torch.profiler(profile_memory=True)`` and converts the profiler's memory timeline into the
same snapshot format, so every function below works on either.

The snapshot format (see ``torch.cuda.memory._snapshot`` and ``torch/cuda/_memory_viz.py``) is a dict::

    {"segments": [{"address", "total_size", "stream", "blocks": [{"address", "size", "state", "frames"}]}],
     "device_traces": [[{"action", "addr", "size", "stream", "time_us", "frames": [{"filename", "line",
                         "name"}]}, ...] per device]}

with actions ``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``, ``oom``
and ``snapshot``. Offline readers here: :func:`snapshot_events` (a DataFrame of the trace),
:func:`active_memory_timeline` (active bytes after every event, as memory_viz's "Active Memory Timeline"
computes them), :func:`allocation_lifetimes`, :func:`largest_allocations` (with the first frames of user
code that made them), :func:`plot_active_memory_timeline` and :func:`export_memory_viz_html`.

:func:`peak_memory_by_phase` measures peak memory of init / forward / backward / optimizer step.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import pickle
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
import torch
from torch import nn

from lab.bench.lm import next_token_loss
from lab.measure.device import resolve_device, synchronize

MiB = 2**20
GiB = 2**30

# ----------------------------------------------------------------------------------------------------------
# Recording


@dataclass
class MemoryRecording:
    """What :func:`record_memory_snapshot` yields: call :meth:`mark` at phase boundaries; after the
    ``with`` block ``snapshot`` holds the snapshot dict and ``path`` the pickle."""

    path: Path
    device: torch.device
    marks: list[tuple[str, int]] = field(default_factory=list)
    snapshot: dict | None = None
    detail_marks: list[tuple[str, int]] = field(default_factory=list)

    def mark(self, phase: str) -> None:
        """Start phase ``phase`` now (host wall clock in microseconds, the clock of the trace's ``time_us``).

        Allocator events are recorded on the host when an operation is launched, so no synchronisation
        is needed for the mark to fall between the right events.
        """
        self.marks.append((phase, time.time_ns() // 1000))

    @property
    def phases_path(self) -> Path:
        return phases_path_for(self.path)


def phases_path_for(snapshot_path: str | os.PathLike) -> Path:
    """The JSON sidecar holding the phase marks of a snapshot pickle (kept out of the pickle itself so that
    memory_viz sees exactly the format it expects)."""
    p = Path(snapshot_path)
    return p.with_name(p.stem + ".phases.json")


@contextlib.contextmanager
def record_memory_snapshot(path: str | os.PathLike, max_entries: int = 1_000_000, device: str | torch.device = "auto",
                           stacks: str = "python") -> Iterator[MemoryRecording]:
    """Record every allocation and free inside the ``with`` block and save a memory_viz snapshot pickle.

    On CUDA this enables ``torch.cuda.memory._record_memory_history`` (``max_entries`` events kept, ring
    buffer; ``stacks="python"`` records Python frames only, which is much cheaper than C++ unwinding) and
    dumps ``torch.cuda.memory._snapshot()`` at the end. On the CPU it runs the block under
    ``torch.profiler.profile(profile_memory=True, with_stack=True)`` and converts the profiler's memory
    timeline (:func:`snapshot_from_profile`). Phase marks (``rec.mark("forward")``) are saved in a JSON
    sidecar (:func:`phases_path_for`). Yields a :class:`MemoryRecording`.
    """
    dev = resolve_device(device) if isinstance(device, str) else torch.device(device)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = MemoryRecording(path=path, device=dev)
    if dev.type == "cuda":
        synchronize(dev)
        kwargs = dict(enabled="all", context="all", stacks=stacks, max_entries=max_entries)
        if "clear_history" in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
            kwargs["clear_history"] = True  # start from an empty trace, not the previous recording's
        torch.cuda.memory._record_memory_history(**kwargs)
        try:
            yield rec
            synchronize(dev)
            rec.snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    elif dev.type == "cpu":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            yield rec
        rec.snapshot = snapshot_from_profile(prof)
    else:
        raise ValueError(f"memory snapshots need a CUDA or CPU device, got {dev}")
    with open(path, "wb") as f:
        pickle.dump(rec.snapshot, f)
    rec.phases_path.write_text(json.dumps({"marks": rec.marks}) + "\n")


def load_snapshot(path: str | os.PathLike) -> dict:
    """Read a snapshot pickle written by :func:`record_memory_snapshot` or ``torch.cuda.memory._dump_snapshot``."""
    with open(path, "rb") as f:
        data = pickle.load(f)
    if isinstance(data, list):  # very old format: segments only
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "device_traces" not in data or "segments" not in data:
        raise ValueError(f"{path} is not a memory snapshot (a dict with 'segments' and 'device_traces')")
    return data


def load_marks(snapshot_path: str | os.PathLike, key: str = "marks") -> list[tuple[str, int]]:
    """The phase marks saved beside a snapshot pickle (``key="detail_marks"`` for per-block backward marks);
    empty if there are none."""
    p = phases_path_for(snapshot_path)
    return [tuple(m) for m in json.loads(p.read_text()).get(key, [])] if p.exists() else []


_PY_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<name>.+)$")


def snapshot_from_profile(prof) -> dict:
    """Convert a ``torch.profiler.profile(profile_memory=True, with_stack=True)`` run into the snapshot
    format (one device trace with ``time_us`` on every event and Python frames innermost first).

    The profiler's memory timeline lists tensor creations and destructions with timestamps (Unix ns) and a
    category (parameter, activation, gradient, optimizer state, ...), kept as an extra ``category`` key.
    Returns the snapshot dict.
    """
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import Action, TensorKey

    mp = prof._memory_profile()
    stacks: dict[Any, list[dict]] = {}
    for event in mp._op_tree.sorted_nodes:
        if event.tag != _EventType.Allocation:
            continue
        frames, parent = [], event.parent
        while parent is not None:
            if parent.tag == _EventType.PyCall:
                m = _PY_FRAME.match(parent.name)
                if m:
                    frames.append({"filename": m["file"], "line": int(m["line"]), "name": m["name"]})
            parent = parent.parent
        key = TensorKey.from_allocation(event.extra_fields)
        if key is not None and event.extra_fields.alloc_size > 0:
            stacks[key] = frames

    trace: list[dict] = []
    live: dict[tuple, dict] = {}

    def category(key, version) -> str:
        c = mp._categories.get(key, version)
        return c.name.lower() if c is not None else "unknown"

    def alloc(t_ns, key, version, size, record=True):
        e = {"action": "alloc", "addr": key.storage.ptr, "size": size, "stream": 0,
             "time_us": t_ns // 1000 if t_ns >= 0 else 0, "frames": stacks.get(key, []),
             "category": category(key, version)}
        if record:
            trace.append(e)
        live[(key, version)] = e

    def free(t_ns, key, version):
        e = live.pop((key, version), None)
        if e is None:
            return
        for action in ("free_requested", "free_completed"):
            trace.append({"action": action, "addr": e["addr"], "size": e["size"], "stream": 0,
                          "time_us": t_ns // 1000, "frames": e["frames"]})

    for t_ns, action, (key, version), size in mp.timeline:
        if not isinstance(key, TensorKey):
            continue
        if action == Action.PREEXISTING:
            alloc(t_ns, key, version, size, record=False)
        elif action == Action.CREATE:
            alloc(t_ns, key, version, size)
        elif action == Action.DESTROY:
            free(t_ns, key, version)
        elif action == Action.INCREMENT_VERSION:
            # an in-place update: the profiler treats the new version as a new tensor in the same storage
            e = live.pop((key, version), None)
            if e is not None:
                live[(key, version + 1)] = dict(e, category=category(key, version + 1))

    blocks = [{"address": e["addr"], "size": e["size"], "requested_size": e["size"], "state": "active_allocated",
               "frames": e["frames"]} for e in sorted(live.values(), key=lambda e: e["addr"])]
    seg = {"device": 0, "address": blocks[0]["address"] if blocks else 0, "stream": 0,
           "total_size": sum(b["size"] for b in blocks), "allocated_size": sum(b["size"] for b in blocks),
           "active_size": sum(b["size"] for b in blocks), "segment_type": "large", "blocks": blocks}
    return {"segments": [seg] if blocks else [], "device_traces": [trace]}


# ----------------------------------------------------------------------------------------------------------
# Offline reading


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
    if filename.endswith("/lab/memory.py"):  # the measuring harness itself is not an origin (its loss,
        return False                          # lab.bench.lm.next_token_loss, is)
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


# ----------------------------------------------------------------------------------------------------------
# Plots and memory_viz export


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


def export_memory_viz_html(snapshot: dict | str | os.PathLike, html_path: str | os.PathLike,
                           kind: str = "active") -> Path:
    """Write memory_viz's HTML page for a snapshot, viewable offline in a browser.

    ``kind="active"`` is the "Active Memory Timeline" (``torch.cuda._memory_viz.trace_plot``),
    ``"segments"`` the "Allocator State History" (``segment_plot``). The snapshot is embedded in the page;
    the viewer's JavaScript (MemoryViz.js) is loaded from the jsDelivr CDN, which torch's page references
    (torch does not ship the script). Returns the HTML path.
    """
    from torch.cuda import _memory_viz

    data = load_snapshot(snapshot) if not isinstance(snapshot, dict) else snapshot
    if kind == "active":
        html = _memory_viz.trace_plot(data)
    elif kind == "segments":
        html = _memory_viz.segment_plot(data)
    else:
        raise ValueError(f"kind must be 'active' or 'segments', got {kind!r}")
    out = Path(html_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html)
    return out


# ----------------------------------------------------------------------------------------------------------
# Peak memory by phase


class MemoryCounter(Protocol):
    """Where :func:`peak_memory_by_phase` reads memory: bytes allocated now, the peak since the last reset."""

    def allocated(self) -> int: ...

    def peak(self) -> int: ...

    def reset_peak(self) -> None: ...


class CudaMemoryCounter:
    """The CUDA caching allocator's statistics (``memory_allocated`` / ``max_memory_allocated``)."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


PHASES = ("forward", "backward", "optimizer_step")


default_loss = next_token_loss  # mean cross-entropy over all positions


def peak_memory_by_phase(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], optimizer: torch.optim.Optimizer,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = default_loss,
                         steps: int = 1, autocast_dtype: torch.dtype | None = None,
                         counter: MemoryCounter | None = None, device: str | torch.device | None = None,
                         snapshot_path: str | os.PathLike | None = None) -> pd.DataFrame:
    """Peak memory of each phase of ``steps`` training steps: init, forward, backward, optimizer step.

    ``batch`` is ``(inputs, targets)``; the loss is ``loss_fn(model(inputs), targets)``, under autocast to
    ``autocast_dtype`` if given. Before each phase the peak statistic is reset, so a phase's peak is the
    most memory allocated at any moment during it (the first optimizer step includes creating its state).

    Where memory is read: ``counter`` if given (any :class:`MemoryCounter`, e.g. a fake in tests); else, on
    CUDA, the caching allocator's statistics. The CPU has no allocator statistics, so there the step runs
    under :func:`record_memory_snapshot` (the profiler's memory timeline) and each phase's peak is read off
    the reconstructed timeline (``snapshot_path`` names the pickle; a temporary file otherwise). Returns
    columns ``step``, ``phase`` (``init`` first), ``peak_bytes``, ``allocated_bytes`` (at the phase's end),
    ``peak_gib``, ``allocated_gib``.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if device is None:
        device = next(model.parameters()).device
    device = resolve_device(device) if isinstance(device, str) else torch.device(device)
    inputs, targets = batch

    def run(on_phase: Callable[[int, str], None]) -> None:
        for step in range(steps):
            on_phase(step, "forward")
            ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model(inputs), targets)
            on_phase(step, "backward")
            loss.backward()
            del loss
            on_phase(step, "optimizer_step")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            on_phase(step, "end")

    rows: list[dict] = []
    if counter is None and device.type == "cuda":
        counter = CudaMemoryCounter(device)
    if counter is not None:
        counter.reset_peak()
        rows.append(dict(step=0, phase="init", peak_bytes=counter.peak(), allocated_bytes=counter.allocated()))
        current: list = []

        def on_phase(step: int, phase: str) -> None:
            if current and current[1] != "end":
                synchronize(device)
                rows.append(dict(step=current[0], phase=current[1], peak_bytes=counter.peak(),
                                 allocated_bytes=counter.allocated()))
            current[:] = [step, phase]
            counter.reset_peak()

        run(on_phase)
    else:
        import tempfile

        with contextlib.ExitStack() as stack:
            path = snapshot_path or Path(stack.enter_context(tempfile.TemporaryDirectory())) / "phases.pickle"
            with record_memory_snapshot(path, device=device) as rec:
                rec.mark("0|init")
                run(lambda step, phase: rec.mark(f"{step}|{phase}"))
            timeline = active_memory_timeline(rec.snapshot, marks=rec.marks)
        rows.extend(_phase_rows_from_timeline(timeline, rec.marks))
    df = pd.DataFrame(rows)
    df["peak_gib"] = df["peak_bytes"] / GiB
    df["allocated_gib"] = df["allocated_bytes"] / GiB
    return df


def _phase_rows_from_timeline(timeline: pd.DataFrame, marks: Sequence[tuple[str, int]]) -> list[dict]:
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


# ----------------------------------------------------------------------------------------------------------
# Language-model experiments (the 03 notebook)


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


def record_training_snapshot(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], path: str | os.PathLike,
                             optimizer: torch.optim.Optimizer | None = None, steps: int = 2,
                             forward_only: bool = False, autocast_dtype: torch.dtype | None = None,
                             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = default_loss,
                             blocks: Sequence[nn.Module] | None = None,
                             max_entries: int = 1_000_000) -> MemoryRecording:
    """Record a memory snapshot of ``steps`` training steps (or one forward with ``forward_only``), with each
    phase marked: ``forward 1``, ``backward 1``, ``optimizer step 1`` (where AdamW creates its state), ...

    With ``blocks`` (the model's block list), a full backward pre-hook on each block also marks where its
    backward starts (``backward 1 block 31`` ...) in ``rec.detail_marks``, for
    :func:`gradient_memory_per_block`. The device is that of the model's parameters. Returns the
    :class:`MemoryRecording` (the pickle is at ``path``, the marks in its JSON sidecar).
    """
    device = next(model.parameters()).device
    if not forward_only and optimizer is None:
        raise ValueError("a training-step recording needs an optimizer (or forward_only=True)")
    inputs, targets = batch
    detail: list[tuple[str, int]] = []
    current = {"step": 0}
    handles = []
    def block_mark(i: int):
        def hook(module, grad_output) -> None:
            detail.append((f"backward {current['step']} block {i}", time.time_ns() // 1000))
        return hook

    if blocks is not None and not forward_only:
        for i, block in enumerate(blocks):
            handles.append(block.register_full_backward_pre_hook(block_mark(i)))
    model.zero_grad(set_to_none=True)
    try:
        with record_memory_snapshot(path, max_entries=max_entries, device=device) as rec:
            for step in range(1, (1 if forward_only else steps) + 1):
                current["step"] = step
                rec.mark(f"forward {step}")
                ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
                with ctx:
                    loss = loss_fn(model(inputs), targets)
                if forward_only:
                    rec.mark("after forward")
                    del loss
                    break
                rec.mark(f"backward {step}")
                loss.backward()
                del loss
                rec.mark(f"optimizer step {step}")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            rec.mark("end")
    finally:
        for h in handles:
            h.remove()
    rec.detail_marks = detail
    rec.phases_path.write_text(json.dumps({"marks": rec.marks, "detail_marks": detail}) + "\n")
    return rec


def gradient_memory_per_block(snapshot: dict, marks: Sequence[tuple[str, int]],
                              detail_marks: Sequence[tuple[str, int]], blocks: Sequence[nn.Module],
                              step: int = 1) -> pd.DataFrame:
    """Gradient memory of each block inferred from the backward timeline of a :func:`record_training_snapshot`
    recording, against the expectation (the bytes of the block's trainable parameters, one gradient each).

    A block's window runs from its backward pre-hook to the next block's; what is allocated there and is
    still alive when ``optimizer step <step>`` begins is that block's gradients (block 0's window also
    holds the embedding's gradient, made after it). Returns ``block``, ``measured_bytes``,
    ``expected_bytes``, ``measured_mib``, ``expected_mib``, ``ratio``.
    """
    prefix = f"backward {step} block "
    windows = [m[0] for m in sorted(detail_marks, key=lambda m: m[1]) if m[0].startswith(prefix)]
    if not windows:
        raise ValueError(f"no block marks for step {step}; record with blocks=")
    all_marks = sorted(list(marks) + list(detail_marks), key=lambda m: m[1])
    got = gradient_bytes_by_window(snapshot, all_marks, windows, end_phase=f"optimizer step {step}")
    got["block"] = got["window"].str.removeprefix(prefix).astype(int)
    expected = {i: sum(p.numel() * p.element_size() for p in b.parameters() if p.requires_grad)
                for i, b in enumerate(blocks)}
    got["expected_bytes"] = got["block"].map(expected)
    got = got.rename(columns={"surviving_bytes": "measured_bytes"}).sort_values("block")
    got["measured_mib"] = got["measured_bytes"] / MiB
    got["expected_mib"] = got["expected_bytes"] / MiB
    got["ratio"] = got["measured_bytes"] / got["expected_bytes"]
    return got[["block", "measured_bytes", "expected_bytes", "measured_mib", "expected_mib", "ratio"]].reset_index(
        drop=True)


def peak_memory_table(model: nn.Module, contexts: Sequence[int], dtypes: Sequence[str] = ("fp32", "bf16"),
                      batch: int = 4, vocab_size: int | None = None, progress: bool = True,
                      make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None) -> pd.DataFrame:
    """Peak memory of a forward pass and of a full AdamW training step for each context length and dtype.

    The forward rows are measured first, for every configuration, before any optimizer state or gradient
    exists. Then the AdamW state is created by one unmeasured step at the smallest context, and each
    training-step row is one steady-state step (parameters, gradients, optimizer state and activations;
    its peak is at least the first step's, whose state appears only after the activations are freed).
    Out-of-memory is a row (``status="oom"``). ``dtypes`` are ``"fp32"`` or ``"bf16"``/``"fp16"`` autocast.
    Returns columns ``context``, ``batch``, ``dtype``, ``mode`` (``forward``, ``train_step``), ``peak_gib``,
    ``status``, ``error``.
    """
    from tqdm import tqdm  # plain text bars: they render in papermill reports

    from lab.measure.device import empty_cache, error_summary, is_oom

    device = next(model.parameters()).device
    vocab = vocab_size or model.lm_head.out_features
    casts = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    for d in dtypes:
        if d not in casts:
            raise ValueError(f"unknown dtype {d!r}; choose from {', '.join(casts)}")
    make_optimizer = make_optimizer or (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4,
                                                                    fused=device.type == "cuda"))
    optimizer = None

    def create_state():
        """One untimed step at the smallest context so that every measured step carries the AdamW state."""
        nonlocal optimizer
        opt = make_optimizer(model)
        tokens = torch.zeros(batch, min(contexts) + 1, dtype=torch.long, device=device)
        default_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        optimizer = opt  # only once the state exists completely

    grid = [(mode, c, d) for mode in ("forward", "train_step") for c in contexts for d in dtypes]
    rows = []
    for mode, context, dt in tqdm(grid, desc="peak memory", disable=not progress):
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (batch, context + 1), generator=gen).to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        cast = casts[dt]

        def forward(inputs=inputs, targets=targets, cast=cast):
            ctx = torch.autocast(device.type, dtype=cast) if cast else contextlib.nullcontext()
            with ctx:
                return default_loss(model(inputs), targets)

        def run(mode=mode, forward=forward):
            if mode == "forward":
                loss = forward()
                del loss
                return
            if optimizer is None:
                create_state()
            forward().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        row = dict(context=context, batch=batch, dtype=dt, mode=mode, peak_gib=math.nan, status="ok", error="")
        try:
            row["peak_gib"] = measure_peak_bytes(run, device) / GiB
        except Exception as exc:
            if not is_oom(exc):
                raise
            row.update(status="oom", error=error_summary(exc))
        model.zero_grad(set_to_none=True)
        empty_cache()
        rows.append(row)
    return pd.DataFrame(rows)
