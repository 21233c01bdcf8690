"""The one trace reader: a ``torch.profiler`` Chrome trace as compute, communication and phase intervals,
how much communication overlapped compute in each phase, and one timeline plot.

On GPUs every kernel is an interval on its CUDA stream's lane, NCCL kernels are communication. On the CPU
(gloo) gloo's collective spans on its own threads are communication and the ATen operators of the thread
that ran the step are compute. Phases are the :class:`lab.measure.step.TrainStep` ranges (``forward``,
``backward``, ``optimizer_step``); on GPUs a phase is drawn where its kernels ran, found by launch
correlation (:func:`kernel_phase_spans`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from lab import paths
from lab.measure.step import PHASES

KINDS = ("compute", "communication", "phase")


# ----------------------------------------------------------------------------------------------------------
# interval arithmetic



def existing_trace(value) -> Path | None:
    """A results table's ``trace`` cell as a path that exists on this machine (None when it was not written,
    or not kept: traces stay out of git, so a replay elsewhere has none)."""
    if not isinstance(value, str) or not value:
        return None
    path = paths.resolve(value)
    return path if path.exists() else None

def union_intervals(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted, disjoint pairs (nested or concurrent ones counted once)."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def intervals_length(intervals) -> float:
    """Total length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


def intersect_intervals(a, b) -> list[tuple[float, float]]:
    """The intersection of two sorted lists of disjoint intervals."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip_intervals(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of ``intervals`` inside ``[lo, hi]``."""
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


# ----------------------------------------------------------------------------------------------------------
# reading a trace


def _complete_events(trace: str | Path | dict) -> list[dict]:
    """The complete ("X") events of a Chrome trace given as a path or as the loaded dict."""
    data = trace if isinstance(trace, dict) else json.loads(Path(trace).read_text())
    return [e for e in data["traceEvents"] if e.get("ph") == "X"]


def _launch_times(events: list[dict]) -> dict:
    """Correlation id -> host timestamp of the CUDA runtime/driver call that launched it."""
    return {e["args"]["correlation"]: e["ts"] for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {})}


def kernel_phase_spans(events: list[dict], kernels: list[dict], ranges: list[dict]) -> list[tuple[str, float, float]]:
    """GPU extent of CPU ranges in a Chrome trace: (name, start_us, dur_us) for each range, the span of the
    kernels *launched* while it was open. Empty when the trace has no launch correlation data.

    A CPU range says when work was launched; the GPU runs it later. The profiler's own ``gpu_user_annotation``
    counts only kernels launched by the thread that opened the range, but backward kernels (and collectives
    issued from autograd hooks) are launched by autograd's device thread; matching each kernel to its
    runtime/driver launch call by correlation id catches them.
    """
    launch_ts = _launch_times(events)
    ranges = sorted(ranges, key=lambda e: e["ts"])
    if not launch_ts or not ranges:
        return []
    spans: dict[int, list[float]] = {}
    for k in kernels:
        t = launch_ts.get((k.get("args") or {}).get("correlation"))
        if t is None:
            continue
        for i, r in enumerate(ranges):
            if r["ts"] <= t <= r["ts"] + r["dur"]:
                lo, hi = spans.get(i, [math.inf, -math.inf])
                spans[i] = [min(lo, k["ts"]), max(hi, k["ts"] + k["dur"])]
                break
    return [(ranges[i]["name"], lo, hi - lo) for i, (lo, hi) in sorted(spans.items())]


def kernels_by_range(trace: str | Path | dict, range_names: tuple[str, ...]) -> pd.DataFrame:
    """Every GPU kernel of a trace with the innermost of ``range_names`` (CPU ``record_function`` ranges, on
    any thread) that was open when the kernel was *launched* (matched by correlation id; ``""`` if none).

    Returns columns ``name``, ``stream``, ``start_ms`` (from the first kernel), ``dur_ms``, ``range``; empty
    without kernels (a CPU trace).
    """
    events = _complete_events(trace)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return pd.DataFrame(columns=["name", "stream", "start_ms", "dur_ms", "range"])
    launch_ts = _launch_times(events)
    ranges = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("name") in range_names),
                    key=lambda e: e["dur"])  # innermost (shortest) first
    t0 = min(k["ts"] for k in kernels)
    rows = []
    for k in kernels:
        t = launch_ts.get((k.get("args") or {}).get("correlation"))
        where = next((r["name"] for r in ranges if t is not None and r["ts"] <= t <= r["ts"] + r["dur"]), "")
        rows.append(((k["name"]), (k.get("args") or {}).get("stream"), (k["ts"] - t0) / 1e3, k["dur"] / 1e3, where))
    return pd.DataFrame(rows, columns=["name", "stream", "start_ms", "dur_ms", "range"])


def is_communication(name: str) -> bool:
    """NCCL kernels (GPU) and gloo collective spans (CPU)."""
    n = name.lower()
    return "nccl" in n or n.startswith("gloo:")


def read_trace(trace: str | Path | dict, phases: tuple[str, ...] = PHASES) -> pd.DataFrame:
    """Compute, communication and phase intervals of a ``torch.profiler`` Chrome trace (a path or the
    loaded dict), in ms from the first interval.

    Returns columns ``lane`` (``stream 7``, ``gloo thread 12``, ``main thread``, ``phase``), ``kind``
    (``compute``, ``communication`` or ``phase``), ``name``, ``start_ms``, ``dur_ms``, sorted by start.
    """
    events = _complete_events(trace)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    cpu_ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in phases]
    rows = []
    if kernels:
        for e in kernels:
            stream = (e.get("args") or {}).get("stream", e.get("tid"))
            kind = "communication" if is_communication(e["name"]) else "compute"
            rows.append((f"stream {stream}", kind, e["name"], e["ts"], e["dur"]))
        spans = kernel_phase_spans(events, kernels, cpu_ranges)
        if spans:
            rows += [("phase", "phase", name, start, dur) for name, start, dur in spans]
        else:  # no correlation data: the profiler's own (incomplete) GPU-side ranges
            rows += [("phase", "phase", e["name"], e["ts"], e["dur"]) for e in events
                     if e.get("cat") == "gpu_user_annotation" and e.get("name") in phases]
    else:
        main_tid = cpu_ranges[0]["tid"] if cpu_ranges else None
        for e in events:
            name = e.get("name", "")
            if is_communication(name) and e.get("cat") == "user_annotation":
                rows.append((f"gloo thread {e['tid']}", "communication", name, e["ts"], e["dur"]))
            elif e.get("cat") == "cpu_op" and e.get("tid") == main_tid and name.startswith("aten::"):
                rows.append(("main thread", "compute", name, e["ts"], e["dur"]))
        rows += [("phase", "phase", e["name"], e["ts"], e["dur"]) for e in cpu_ranges]
    df = pd.DataFrame(rows, columns=["lane", "kind", "name", "start_us", "dur_us"])
    if df.empty:
        return pd.DataFrame(columns=["lane", "kind", "name", "start_ms", "dur_ms"])
    df["start_ms"] = (df["start_us"] - df["start_us"].min()) / 1e3
    df["dur_ms"] = df["dur_us"] / 1e3
    return df.drop(columns=["start_us", "dur_us"]).sort_values("start_ms", ignore_index=True)


# ----------------------------------------------------------------------------------------------------------
# what overlapped


def _union_of(timeline: pd.DataFrame, kind: str) -> list[tuple[float, float]]:
    part = timeline[timeline["kind"] == kind]
    return union_intervals(zip(part["start_ms"], part["start_ms"] + part["dur_ms"]))


def overlap_summary(timeline: pd.DataFrame) -> pd.DataFrame:
    """Per phase, and for the whole ``step``: its length, compute busy time, communication time, how much of
    it overlapped compute, the exposed (non-overlapped) communication, the compute lanes' idle time, the time
    some kernel ran (``busy_ms``: compute or communication; all ms) and ``overlap_share`` (overlapped /
    communication; NaN without communication)."""
    comp, comm = _union_of(timeline, "compute"), _union_of(timeline, "communication")
    phases = timeline[timeline["kind"] == "phase"]
    windows = [(n, s, s + d) for n, s, d in zip(phases["name"], phases["start_ms"], phases["dur_ms"])]
    if comp or comm:
        windows.append(("step", min(s for s, _ in comp + comm), max(e for _, e in comp + comm)))
    rows = []
    for name, lo, hi in windows:
        c, m = clip_intervals(comp, lo, hi), clip_intervals(comm, lo, hi)
        overlap = intervals_length(intersect_intervals(c, m))
        compute_ms, comm_ms = intervals_length(c), intervals_length(m)
        rows.append(dict(phase=name, window_ms=hi - lo, compute_ms=compute_ms, communication_ms=comm_ms,
                         overlapped_ms=overlap, exposed_communication_ms=comm_ms - overlap,
                         compute_idle_ms=(hi - lo) - compute_ms, busy_ms=compute_ms + comm_ms - overlap,
                         overlap_share=overlap / comm_ms if comm_ms else math.nan))
    return pd.DataFrame(rows, columns=["phase", "window_ms", "compute_ms", "communication_ms", "overlapped_ms",
                                       "exposed_communication_ms", "compute_idle_ms", "busy_ms", "overlap_share"])


def step_overlap(timeline: pd.DataFrame) -> dict:
    """The whole step's row of :func:`overlap_summary` as a dict (``communication_ms``, ``overlap_share``,
    ...); zeros and NaN for an empty timeline."""
    summary = overlap_summary(timeline)
    step = summary[summary["phase"] == "step"]
    if step.empty:
        return dict(communication_ms=0.0, compute_ms=0.0, overlapped_ms=0.0, overlap_share=math.nan)
    return step.iloc[0].to_dict()


# ----------------------------------------------------------------------------------------------------------
# the plot

_COLORS = {"compute": "tab:blue", "communication": "tab:orange"}
_PHASE_SHADES = {"forward": "tab:green", "backward": "tab:red", "optimizer_step": "tab:purple"}


def plot_timeline(timeline: pd.DataFrame, title: str = "", ax=None, merge_lanes: bool = False):
    """Compute and communication as horizontal bars over time, one lane per stream/thread (or, with
    ``merge_lanes``, one compute and one communication lane), the phases shaded; returns the axes."""
    import matplotlib.pyplot as plt

    busy = timeline[timeline["kind"] != "phase"]
    if merge_lanes:
        busy = busy.assign(lane=busy["kind"])
    lanes = list(dict.fromkeys(busy["lane"]))
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.6 + 0.5 * max(len(lanes), 2)))
    for y, lane in enumerate(lanes):
        for kind, part in busy[busy["lane"] == lane].groupby("kind"):
            spans = union_intervals(zip(part["start_ms"], part["start_ms"] + part["dur_ms"]))
            ax.broken_barh([(s, e - s) for s, e in spans], (y - 0.4, 0.8), color=_COLORS[kind], label=kind)
    for _, ph in timeline[timeline["kind"] == "phase"].iterrows():
        ax.axvspan(ph["start_ms"], ph["start_ms"] + ph["dur_ms"], color=_PHASE_SHADES.get(ph["name"], "grey"),
                   alpha=0.08, label=ph["name"])
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        ax.legend(unique.values(), unique.keys(), loc="upper right", fontsize=8, ncol=len(unique))
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.6, max(len(lanes), 1) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time since the profiled step started (ms)")
    if title:
        ax.set_title(title)
    return ax
