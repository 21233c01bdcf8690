"""Memory snapshots: record the allocator's history around any region, on a GPU or a CPU, and save it.

On a GPU, :func:`record_memory_snapshot` uses PyTorch's own allocator history
(``torch.cuda.memory._record_memory_history`` / ``_snapshot``) and writes the pickle that
https://pytorch.org/memory_viz opens. On a CPU (the quick lab book) the same context manager records the
region with ``torch.profiler(profile_memory=True)`` and converts the profiler's memory timeline into the
same snapshot format (:func:`snapshot_from_profile`), so every reader in :mod:`lab.measure.memory_timeline`
works on either.

The snapshot format (see ``torch.cuda.memory._snapshot`` and ``torch/cuda/_memory_viz.py``) is a dict::

    {"segments": [{"address", "total_size", "stream", "blocks": [{"address", "size", "state", "frames"}]}],
     "device_traces": [[{"action", "addr", "size", "stream", "time_us", "frames": [{"filename", "line",
                         "name"}]}, ...] per device]}

with actions ``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``, ``oom``
and ``snapshot``. Phase marks (``rec.mark("forward")``) go to a JSON sidecar beside the pickle.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pickle
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from lab.measure.device import resolve_device, synchronize
from lab.measure.quiet import quiet_profile


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
        with quiet_profile(profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                   with_stack=True)) as prof:
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



def export_memory_viz_html(snapshot: dict | str | os.PathLike, html_path: str | os.PathLike,
                           kind: str = "active") -> Path:
    """Write memory_viz's HTML page for a snapshot. It is NOT fully offline: the page embeds the snapshot but
    loads the viewer's script from the web (see below); :mod:`lab.measure.memory_pages` has a self-contained page.

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

