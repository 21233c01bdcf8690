"""The one trace reader: intervals from synthetic Kineto-shaped traces, phases by launch correlation,
overlap per phase, interval arithmetic."""

import json

import pandas as pd
import pytest

from lab.measure import traces
from tests.kineto import write_trace


def test_interval_arithmetic():
    a = traces.union_intervals([(5, 7), (0, 2), (1, 3), (6, 6.5)])
    assert a == [(0, 3), (5, 7)] and traces.intervals_length(a) == 5
    b = traces.union_intervals([(2, 6)])
    assert traces.intersect_intervals(a, b) == [(2, 3), (5, 6)]
    assert traces.intersect_intervals(a, []) == []


def test_kernel_phase_spans_follow_launches_not_threads():
    # backward's kernel is launched from another thread (autograd's) while the CPU range is open
    events = [
        {"cat": "user_annotation", "name": "forward", "ts": 0, "dur": 10, "tid": 1},
        {"cat": "user_annotation", "name": "backward", "ts": 10, "dur": 10, "tid": 1},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2, "dur": 1, "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 12, "dur": 1, "tid": 2, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 15, "dur": 1, "tid": 2, "args": {"correlation": 3}},
    ]
    kernels = [{"cat": "kernel", "name": "k1", "ts": 20, "dur": 5, "args": {"correlation": 1}},
               {"cat": "kernel", "name": "k2", "ts": 26, "dur": 4, "args": {"correlation": 2}},
               {"cat": "kernel", "name": "k3", "ts": 31, "dur": 9, "args": {"correlation": 3}}]
    spans = traces.kernel_phase_spans(events + kernels, kernels, events[:2])
    assert spans == [("forward", 20, 5), ("backward", 26, 14)]
    assert traces.kernel_phase_spans(events[:2] + kernels, kernels, events[:2]) == []  # no launch records


def test_overlap_summary_on_a_synthetic_timeline():
    # forward 0..10 ms: compute 0-4 and 6-10 (idle 4-6); communication 3-7: overlaps 3-4 and 6-7
    tl = pd.DataFrame([("stream 7", "compute", "gemm", 0.0, 4.0), ("stream 7", "compute", "gemm", 6.0, 4.0),
                       ("stream 7", "compute", "gemm", 1.0, 1.0),  # nested inside the first: counted once
                       ("stream 20", "communication", "ncclAllGather", 3.0, 4.0),
                       ("phase", "phase", "forward", 0.0, 10.0)],
                      columns=["lane", "kind", "name", "start_ms", "dur_ms"])
    fwd = traces.overlap_summary(tl).set_index("phase").loc["forward"]
    assert fwd["compute_ms"] == pytest.approx(8.0)
    assert fwd["communication_ms"] == pytest.approx(4.0)
    assert fwd["overlapped_ms"] == pytest.approx(2.0)
    assert fwd["exposed_communication_ms"] == pytest.approx(2.0)
    assert fwd["compute_idle_ms"] == pytest.approx(2.0)
    assert fwd["overlap_share"] == pytest.approx(0.5)
    assert fwd["busy_ms"] == pytest.approx(10.0)  # compute 8 and communication 4, 2 of it at once


def test_gpu_timeline_phases_include_kernels_launched_by_autograd_threads(tmp_path):
    # Kineto-shaped trace: CPU phase ranges on the main thread (tid 1); the backward's kernels (a GEMM and an
    # NCCL reduce-scatter) are launched by autograd's device thread (tid 2), so the profiler's own
    # gpu_user_annotation "backward" covers only the fill kernel launched from the main thread.
    kernels = [("gemm", 10, 20, 7, 5, 1), ("ncclDevKernel_AllGather_RING_LL", 5, 4, 20, 2, 1),
               ("fill", 151, 1, 7, 101, 1), ("gemm_bwd", 160, 30, 7, 110, 2),
               ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 195, 40, 20, 150, 2),
               ("multi_tensor_apply_kernel", 360, 10, 7, 310, 1)]
    ranges = (("forward", 0, 100), ("backward", 100, 200), ("optimizer_step", 300, 50))
    annotation = dict(ph="X", cat="gpu_user_annotation", name="backward", ts=151, dur=1, tid=7)
    path = write_trace(tmp_path / "trace.json", ranges, kernels, extra=[annotation])
    tl = traces.read_trace(path)
    comm = tl[tl["kind"] == "communication"]
    assert sorted(comm["name"]) == ["ncclDevKernel_AllGather_RING_LL", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"]
    assert set(tl.loc[tl["kind"] == "compute", "lane"]) == {"stream 7"}
    phases = tl[tl["kind"] == "phase"].set_index("name")
    assert len(phases) == 3
    # times are relative to the first row (the all-gather at 5 us)
    assert phases.loc["forward", "start_ms"] == pytest.approx(0.0)
    assert phases.loc["forward", "dur_ms"] == pytest.approx(0.025)  # 5 .. 30 us
    assert phases.loc["backward", "start_ms"] == pytest.approx(0.146)  # fill at 151 us
    assert phases.loc["backward", "dur_ms"] == pytest.approx(0.084)  # .. reduce-scatter end at 235 us
    assert phases.loc["optimizer_step", "dur_ms"] == pytest.approx(0.010)


def test_timeline_from_a_gpu_trace(tmp_path):
    # kernels launched (cudaLaunchKernel, matched by correlation id) while the CPU was in backward
    # (sgemm from autograd's thread, NCCL from a hook) and in optimizer_step (elementwise)
    events = [
        {"ph": "X", "cat": "kernel", "name": "ampere_sgemm", "ts": 1000, "dur": 100,
         "args": {"stream": 7, "correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32", "ts": 1050, "dur": 100,
         "args": {"stream": 20, "correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "elementwise", "ts": 1200, "dur": 20,
         "args": {"stream": 7, "correlation": 3}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 910, "dur": 5, "tid": 2,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 920, "dur": 5, "tid": 2,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 960, "dur": 5, "tid": 1,
         "args": {"correlation": 3}},
        {"ph": "X", "cat": "user_annotation", "name": "backward", "ts": 900, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "optimizer_step", "ts": 955, "dur": 20, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 900, "dur": 10},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    tl = traces.read_trace(path)
    assert sorted(tl["kind"]) == ["communication", "compute", "compute", "phase", "phase"]
    assert tl.loc[tl["kind"] == "communication", "lane"].item() == "stream 20"
    phases = tl[tl["kind"] == "phase"].set_index("name")
    # GPU-side spans: backward from the sgemm's start to the NCCL kernel's end; the optimizer's kernel
    assert phases.loc["backward", "start_ms"] == 0.0  # the timeline starts at its first kernel
    assert phases.loc["optimizer_step", "start_ms"] == pytest.approx(0.2)
    assert phases.loc["backward", "dur_ms"] == pytest.approx(0.15)
    assert phases.loc["optimizer_step", "dur_ms"] == pytest.approx(0.02)
    summary = traces.step_overlap(tl)
    assert summary["communication_ms"] == pytest.approx(0.1)
    assert summary["compute_ms"] == pytest.approx(0.12)
    assert summary["overlap_share"] == pytest.approx(0.5)  # 50 of the 100 us of NCCL ran beside the sgemm


def test_cpu_trace_gloo_threads_are_communication(tmp_path):
    ev = [dict(ph="X", cat="user_annotation", name="forward", ts=0, dur=100, tid=1),
          dict(ph="X", cat="user_annotation", name="backward", ts=100, dur=100, tid=1),
          dict(ph="X", cat="cpu_op", name="aten::mm", ts=10, dur=50, tid=1),
          dict(ph="X", cat="cpu_op", name="aten::mm", ts=120, dur=60, tid=1),
          dict(ph="X", cat="cpu_op", name="aten::mm", ts=10, dur=50, tid=9),  # another thread: not the step's
          dict(ph="X", cat="user_annotation", name="gloo:all_reduce", ts=150, dur=40, tid=5)]
    tl = traces.read_trace({"traceEvents": ev})
    assert set(tl.loc[tl["kind"] == "communication", "lane"]) == {"gloo thread 5"}
    assert (tl.loc[tl["kind"] == "compute", "lane"] == "main thread").all() and (tl["kind"] == "compute").sum() == 2
    back = traces.overlap_summary(tl).set_index("phase").loc["backward"]
    assert back["communication_ms"] == pytest.approx(0.04) and back["overlapped_ms"] == pytest.approx(0.03)
    assert traces.plot_timeline(tl, title="cpu").get_title() == "cpu"


def test_kernels_by_range_picks_the_innermost_range_open_at_launch():
    ev = [dict(ph="X", cat="user_annotation", name="backward", ts=0, dur=100, tid=1),
          dict(ph="X", cat="user_annotation", name="recompute", ts=10, dur=20, tid=2),
          dict(ph="X", cat="user_annotation", name="optimizer_step", ts=100, dur=10, tid=1)]
    for c, (launch, name) in enumerate(((15, "gemm_recomputed"), (50, "gemm_backward"), (105, "adam"), (200, "late"))):
        ev.append(dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=launch, dur=1, args={"correlation": c}))
        ev.append(dict(ph="X", cat="kernel", name=name, ts=launch + 100, dur=5, args={"stream": 7, "correlation": c}))
    k = traces.kernels_by_range({"traceEvents": ev}, ("backward", "recompute", "optimizer_step")).set_index("name")
    assert k.loc["gemm_recomputed", "range"] == "recompute" and k.loc["gemm_backward", "range"] == "backward"
    assert k.loc["adam", "range"] == "optimizer_step" and k.loc["late", "range"] == ""
    assert k.loc["gemm_recomputed", "start_ms"] == 0 and k.loc["adam", "dur_ms"] == pytest.approx(0.005)
    assert traces.kernels_by_range({"traceEvents": ev[:3]}, ("backward",)).empty
