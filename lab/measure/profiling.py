"""Kernel profiles with ``torch.profiler``: top kernels, matmul share, and the cost inside attention.

Nsight Systems may not be installed, so profiles use ``torch.profiler`` with CUDA activities. The model's
naive attention marks its three phases with ``record_function`` + NVTX ranges, so the same code can be run
under ``nsys profile`` by a user who has it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from lab.measure.device import synchronize
from lab.measure.quiet import quiet_profile
from lab.measure.step import MODES, TrainStep
from lab.measure.traces import (
    intervals_length,
    is_communication,
    kernels_by_range,
    read_trace,
    step_overlap,
    union_intervals,
)

# cuBLAS / CUTLASS / Triton matmul kernel names on Hopper and Ampere, and the aten ops on the CPU.
_MATMUL = re.compile(r"gemm|nvjet|xmma|cutlass|wgmma|cublas|matmul|^aten::(mm|addmm|bmm|baddbmm|linear)$", re.I)
# Fused attention: FlashAttention (PyTorch's, cuDNN's, the book's Triton kernels), memory-efficient attention.
_ATTENTION = re.compile(r"flash|fmha|attn|attention|sdpa|cudnn.*mha", re.I)
#: Kernel names of the loss: PyTorch's log-softmax (``cunn_SoftMaxForward<..LogSoftMaxForwardEpilogue>``) and
#: NLL kernels, and the fused loss's own (:mod:`lab.kernels.fused_cross_entropy_kernels`): by default its
#: row-wise ``_lce_rows_kernel`` (its three products are cuBLAS matmuls, as the materialized loss's), in its
#: recompute mode the tiles that also compute the LM head's logits (``_lse_kernel``, ``_dlogits_kernel``; the
#: gradient products of its ``_matmul_kernel`` count as matmuls).
LOSS_KERNELS = ("lce", "cross_entropy", "log_softmax", "logsoftmax", "nll_loss", "_lse_kernel", "_dlogits_kernel")
#: What :func:`kernel_class` returns, in the order it decides.
KERNEL_CLASSES = ("communication", "loss", "fused attention", "matmul", "other")
ATTENTION_RANGES = ("attention/scores", "attention/softmax", "attention/final_matmul")


def kernel_class(name: str) -> str:
    """The class of a kernel (or CPU op) by its name, one of :data:`KERNEL_CLASSES`: ``"communication"``
    (NCCL), ``"loss"`` (:data:`LOSS_KERNELS`), ``"fused attention"``, ``"matmul"`` or ``"other"``. The one
    classification of kernels in lab: profiles' class shares and the fastest step's phases both use it."""
    lower = name.lower()
    if "nccl" in lower:
        return "communication"
    if any(k in lower for k in LOSS_KERNELS):
        return "loss"
    if _ATTENTION.search(name):
        return "fused attention"
    return "matmul" if _MATMUL.search(name) else "other"


def profile_step(step: TrainStep, mode: str = "forward", warmup: int = 3, steps: int = 3,
                 trace_path: str | Path | None = None):
    """Profile ``steps`` steps of ``mode`` (``forward`` / ``forward_backward`` / ``train_step``) of a
    :class:`~lab.measure.step.TrainStep` after ``warmup`` unprofiled ones, with CPU and (on a GPU) CUDA
    activities. Each profiled step sits in a ``step i`` range; its phases carry their own ranges.

    Returns the ``torch.profiler.profile`` object; if ``trace_path`` is given a Chrome/Perfetto trace is
    written there (open it in ui.perfetto.dev or chrome://tracing).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    for _ in range(warmup):
        step.run(mode)
    synchronize(step.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if step.device.type == "cuda" else [])
    try:  # keep events across the (single) profiling cycle without a warning; older torch lacks the flag
        profiler = profile(activities=activities, acc_events=True)
    except TypeError:
        profiler = profile(activities=activities)
    with quiet_profile(profiler) as prof:
        for i in range(steps):
            with record_function(f"step {i}"):
                step.run(mode)
                synchronize(step.device)  # inside the range: it ends when the GPU has finished the step
    if trace_path is not None:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    prof.lab_steps = steps  # remembered so tables can report per-step numbers
    return prof


def _annotation_names(prof) -> set[str]:
    """Names of ``record_function`` ranges: the profiler mirrors them onto the GPU timeline, where they must
    not be mistaken for kernels."""
    names = {e.name for e in prof.events() if getattr(e, "is_user_annotation", False)}
    return names | {e.name for e in prof.events() if e.name.startswith("step ") or e.name in ATTENTION_RANGES}


def _device_events(prof) -> list:
    """Kernels, memcpys and memsets on the GPU (not the mirrored annotation ranges)."""
    skip = _annotation_names(prof)
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.name not in skip]


def kernel_table(prof, top: int | None = 15) -> pd.DataFrame:
    """Kernels by total GPU time: name, class, calls per step, ms per step, share of GPU time (0..1).

    On the CPU (no kernels) the same table is built from the self CPU time of aten operators.
    """
    steps = getattr(prof, "lab_steps", 1)
    kernels = _device_events(prof)
    if kernels:
        rows = [(e.name, e.time_range.elapsed_us()) for e in kernels]
        timeline = "gpu kernel"
    else:
        rows = [(e.name, e.self_cpu_time_total) for e in prof.events()
                if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
        timeline = "cpu op"
    df = pd.DataFrame(rows, columns=["name", "us"])
    if df.empty:
        return pd.DataFrame(columns=["name", "class", "calls_per_step", "ms_per_step", "share", "timeline"])
    g = df.groupby("name")["us"].agg(["count", "sum"]).reset_index()
    g["class"] = g["name"].map(kernel_class)
    g["calls_per_step"] = g["count"] / steps
    g["ms_per_step"] = g["sum"] / 1e3 / steps
    g["share"] = g["sum"] / g["sum"].sum()
    g["timeline"] = timeline  # not "source": the results store's column for the notebook that measured a row
    g = g.sort_values("ms_per_step", ascending=False)[["name", "class", "calls_per_step", "ms_per_step", "share",
                                                        "timeline"]]
    return (g.head(top) if top else g).reset_index(drop=True)


def class_shares(kernels, by: Sequence[str] = ()) -> pd.DataFrame:
    """GPU (or CPU-op) time and calls per step by kernel class, with each class's share of its ``by`` group's
    total (e.g. ``("mode",)`` for a table of several profiles; groups in the order they first appear), largest
    first without ``by``. ``kernels``: a :func:`kernel_table` of every kernel, or a profiler."""
    table = kernels if isinstance(kernels, pd.DataFrame) else kernel_table(kernels, top=None)
    g = table.groupby([*by, "class"], sort=False)[["ms_per_step", "calls_per_step"]].sum().reset_index()
    total = g.groupby(list(by), sort=False)["ms_per_step"].transform("sum") if by else g["ms_per_step"].sum()
    g = g.assign(share=g["ms_per_step"] / total)
    return g if by else g.sort_values("ms_per_step", ascending=False).reset_index(drop=True)


def range_times(prof, names=ATTENTION_RANGES) -> pd.DataFrame:
    """Time per step inside each named ``record_function`` range: GPU time of the kernels launched in it
    (CUDA) or CPU time of the range (CPU)."""
    steps = getattr(prof, "lab_steps", 1)
    on_gpu = bool(_device_events(prof))
    rows = []
    for name in names:
        evts = [e for e in prof.events() if e.name == name and e.device_type == DeviceType.CPU]
        total_us = sum(e.device_time_total if on_gpu else e.cpu_time_total for e in evts)
        rows.append(dict(range=name, calls_per_step=len(evts) / steps, ms_per_step=total_us / 1e3 / steps))
    return pd.DataFrame(rows)


def step_wall_ms(prof) -> float:
    """Mean wall time of a profiled step, in ms: compare with the Python timer.

    The CPU side of each ``step i`` range: :func:`profile_step` synchronizes inside the range, so it ends
    when the device has finished the step. (The range's mirror on the GPU timeline is no measure of the
    step: the profiler may cut it into several pieces, and it misses the time before the first kernel.)
    """
    evts = [e for e in prof.events() if e.name.startswith("step ") and e.device_type == DeviceType.CPU]
    return sum(e.time_range.elapsed_us() for e in evts) / 1e3 / max(len(evts), 1)


def gpu_kernel_times(run, device) -> dict[str, float]:
    """How long the GPU ran kernels (memcpys and memsets included) during one ``run()``, in ms, profiled with
    CUDA activity alone: ``gpu_ms``, the union of their intervals, and ``compute_ms``, the same without the
    collectives' kernels (NCCL), whose length is set partly by when the peers arrive, that is by their hosts.
    Without the host's operators the profile holds only a step's kernels, so it costs about a second where a
    full profile of a large model's step takes many; NaN off CUDA, and where the profile saw no kernel."""
    nan = {"gpu_ms": float("nan"), "compute_ms": float("nan")}
    if getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return nan
    synchronize(device)
    with quiet_profile(profile(activities=[ProfilerActivity.CUDA])) as prof:
        run()
        synchronize(device)
    events = prof.profiler.kineto_results.events()
    return kernel_times([(e.start_ns(), e.end_ns(), e.name()) for e in events
                         if e.device_type() == DeviceType.CUDA and not e.is_user_annotation()]) or nan


def kernel_times(spans) -> dict[str, float] | None:
    """:func:`gpu_kernel_times` of ``(start_ns, end_ns, name)`` kernel spans; None where there are none (a
    profile that saw no kernel failed: the GPU did not sit idle)."""
    if not spans:
        return None
    compute = [(s, e) for s, e, name in spans if not is_communication(name)]
    return {"gpu_ms": intervals_length(union_intervals((s, e) for s, e, _ in spans)) / 1e6,  # concurrent once
            "compute_ms": intervals_length(union_intervals(compute)) / 1e6}


def gpu_kernel_ms(run, device) -> float:
    """:func:`gpu_kernel_times`' ``gpu_ms``: how long the GPU ran kernels during one ``run()``."""
    return gpu_kernel_times(run, device)["gpu_ms"]


def gpu_busy_ms(prof) -> float:
    """Sum of kernel durations per step, in ms (0 on the CPU)."""
    steps = getattr(prof, "lab_steps", 1)
    return sum(e.time_range.elapsed_us() for e in _device_events(prof)) / 1e3 / steps


def attention_phase_flops(batch: int, heads: int, seq: int, head_dim: int, layers: int = 1) -> dict[str, float]:
    """FLOPs of the three naive-attention phases (forward), summed over ``layers``.

    QK^T and PV each cost 2·b·h·s²·d; softmax costs about 5 operations per score (max, subtract, exp, sum,
    divide), the causal mask one more. The ratio softmax/matmul is therefore ~3/(2d): tiny, yet softmax is
    memory-bound and takes a visible share of the time.
    """
    scores = batch * heads * seq * seq
    return {"attention/scores": 2.0 * scores * head_dim * layers + scores * layers,
            "attention/softmax": 5.0 * scores * layers,
            "attention/final_matmul": 2.0 * scores * head_dim * layers}


# ----------------------------------------------------------------------------------------------------------
# a profiled step's time by phase

#: Kernel classes of a step's time, in the order they are assigned (a kernel launched inside ``recompute``
#: counts as recomputation whatever it computes).
PHASE_COLUMNS = ["recompute_ms", "optimizer_ms", "attention_ms", "matmul_ms", "loss_ms", "other_kernels_ms",
                 "exposed_communication_ms", "idle_ms"]

#: How many of the ``other kernels`` (by time) a row names in ``other_kernels_top``.
OTHER_TOP = 8


def kernel_phase(name: str, launched_in: str) -> str:
    """The phase a kernel's time belongs to: ``recompute`` or ``optimizer`` by where it was launched (an Adam
    update launched inside the backward, by an optimizer stepped there, is ``optimizer`` too), else
    ``attention``, ``matmul``, ``loss``, ``communication`` or ``other`` by its name."""
    kind = kernel_class(name)
    if kind == "communication":
        return "communication"
    if launched_in == "recompute":
        return "recompute"
    if launched_in == "optimizer_step" or "adam" in name.lower():
        return "optimizer"
    return {"fused attention": "attention", "other": "other_kernels"}.get(kind, kind)


def phase_breakdown(trace: str | Path | dict, steps: int = 1, overlap: dict | None = None) -> dict[str, float | str]:
    """Milliseconds per step by phase (:data:`PHASE_COLUMNS`) from a profiled step's Chrome trace (a path, or
    the dict a caller that reads the trace too has loaded): kernel
    time by :func:`kernel_phase`, the communication that overlapped no compute, and the time no kernel ran
    (``idle_ms``: launch gaps; with the exposed communication and the compute kernels' union it fills the
    profiled window); ``other_kernels_top`` names the :data:`OTHER_TOP` largest
    kernels of ``other kernels`` (``"name=ms; ..."``; names cut to 80 characters, and kernels whose names
    agree that far counted as one). ``overlap``: the trace's :func:`lab.measure.traces.step_overlap`, where the
    caller has it already (the trace's timeline is then not read again)."""

    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())  # read once, for both readers
    kernels = kernels_by_range(trace, ("forward", "backward", "optimizer_step", "recompute"))
    out = dict.fromkeys(PHASE_COLUMNS, 0.0)
    if kernels.empty:
        return {**{k: math.nan for k in out}, "other_kernels_top": ""}
    phases = [kernel_phase(n, r) for n, r in zip(kernels["name"], kernels["range"])]
    for phase, dur in zip(phases, kernels["dur_ms"]):
        if phase != "communication":
            out[f"{phase}_ms"] += dur / steps
    other = kernels.assign(phase=phases, short=kernels["name"].str.slice(0, 80)).query("phase == 'other_kernels'")
    top = other.groupby("short")["dur_ms"].sum().sort_values(ascending=False).head(OTHER_TOP) / steps
    out["other_kernels_top"] = "; ".join(f"{name}={ms:.4g}" for name, ms in top.items())
    overlap = overlap or step_overlap(read_trace(trace))
    out["exposed_communication_ms"] = (overlap["communication_ms"] - overlap["overlapped_ms"]) / steps
    window = overlap.get("window_ms", math.nan)
    out["idle_ms"] = (window - overlap["busy_ms"]) / steps if window == window else math.nan
    return out


def phase_gaps(rows: pd.DataFrame, reference: str, key: str = "impl", by: Sequence[str] = ("config",),
               step_column: str = "step_ms") -> pd.DataFrame:
    """Where each row's time beyond ``reference``'s goes, phase by phase: per group of ``by``, every other row's
    :data:`PHASE_COLUMNS` (:func:`phase_breakdown` of its profiled step) minus the reference row's (the row
    whose ``key`` is ``reference``), their sum (``profiled_gap_ms``) and the timed gap beside it (``step_gap_ms``,
    the difference of ``step_column``'s medians). Kernels on two streams at once count in both classes, so a
    kernel that waits while another stream's kernels hold the GPU shows as more kernel time (matmuls slowed
    by a concurrent all-reduce, or the update beside the backward); the sum then exceeds the profiled window's
    growth. A group without its reference row, or a row without profiled phases, gives no row."""
    phases = [c for c in PHASE_COLUMNS if c in rows]
    out = []
    for _, group in rows.groupby(list(by), sort=False) if by else [(None, rows)]:
        base = group[group[key] == reference]
        if base.empty or not phases:
            continue
        ref = base.iloc[0]
        for _, row in group[group[key] != reference].iterrows():
            gaps = {c: float(row[c]) - float(ref[c]) for c in phases}
            if all(math.isnan(g) for g in gaps.values()):
                continue
            out.append({**{b: row[b] for b in by}, key: row[key], **gaps,
                        "profiled_gap_ms": sum(g for g in gaps.values() if not math.isnan(g)),
                        "step_gap_ms": float(row[step_column]) - float(ref[step_column])})
    return pd.DataFrame(out, columns=[*by, key, *phases, "profiled_gap_ms", "step_gap_ms"])
