"""lab.measure.memory: snapshot parsing, timeline reconstruction and peak-by-phase logic, on the CPU."""

import importlib.util
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lab.measure import memory_snapshot, memory_timeline
from lab.measure.step import TrainStep, peak_memory_by_phase

KiB, MiB = 1024, 1024 * 1024
FIXTURES = Path(__file__).parent.parent / "fixtures"


def _fixture_module():
    spec = importlib.util.spec_from_file_location("make_snapshot_fixture", FIXTURES / "make_snapshot_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FIX = _fixture_module()


@pytest.fixture
def snapshot():
    return memory_snapshot.load_snapshot(FIXTURES / "synthetic_snapshot.pickle")


def test_fixture_is_current_and_readable_by_torch_memory_viz(snapshot):
    assert snapshot == FIX.build()  # the committed pickle matches its generator
    from torch.cuda import _memory_viz

    # torch's own readers of the format accept it; segsum checks that the block sizes add up
    summary = _memory_viz.segsum(snapshot)
    assert "total_reserved: 4.0MiB" in summary and "total_allocated: 260.0KiB" in summary
    text = _memory_viz.trace(snapshot)
    assert "cudaMalloc(1048576, 2.0MiB)" in text and "raise OutOfMemoryError" in text


def test_snapshot_events_parse_actions_sizes_and_user_origin(snapshot):
    ev = memory_timeline.snapshot_events(snapshot, marks=FIX.MARKS)
    assert list(ev["action"]) == ["free_requested", "free_completed", "segment_alloc", "alloc", "alloc",
                                  "free_requested", "free_completed", "alloc", "free_requested",
                                  "free_completed", "oom"]
    assert ev.loc[3, "size"] == 512 * KiB and ev.loc[3, "addr"] == 0x100000 and ev.loc[3, "time_us"] == 210
    # torch internals and C++ frames are skipped: the first two user frames remain, innermost first
    assert ev.loc[3, "origin"] == "model.py:208:forward < train.py:12:step"
    assert ev.loc[4, "origin"] == "train.py:12:step"
    assert list(ev["phase"]) == [""] * 2 + ["forward"] * 5 + ["backward"] * 3 + ["optimizer_step"]


def test_active_memory_timeline_values(snapshot):
    tl = memory_timeline.active_memory_timeline(snapshot, marks=FIX.MARKS)
    before = 1 * KiB + 4 * KiB  # A (freed in the trace) and B (alive, no event) existed before recording
    expected = [before, 4 * KiB, 4 * KiB, 4 * KiB + 512 * KiB, 4 * KiB + 512 * KiB + MiB, 4 * KiB + 512 * KiB + MiB,
                4 * KiB + MiB, 4 * KiB + MiB + 256 * KiB, 4 * KiB + MiB + 256 * KiB, 4 * KiB + 256 * KiB,
                4 * KiB + 256 * KiB]
    assert tl["active_bytes"].tolist() == expected
    # the end of the timeline agrees with the active blocks of the final segments
    end_state = sum(b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert tl["active_bytes"].iloc[-1] == end_state
    assert tl["reserved_bytes"].tolist() == [2 * MiB] * 2 + [4 * MiB] * 9


def test_allocation_lifetimes_and_largest_allocations(snapshot):
    life = memory_timeline.allocation_lifetimes(snapshot, marks=FIX.MARKS)
    rows = {(r.addr, r.alloc_index): (r.size, r.free_index, r.before) for r in life.itertuples()}
    assert rows[(0x1000, -1)] == (1 * KiB, 1, True)
    assert rows[(0x9000, -1)] == (4 * KiB, 11, True)
    assert rows[(0x100000, 3)] == (512 * KiB, 6, False)
    assert rows[(0x180000, 4)] == (MiB, 9, False)
    assert rows[(0x100000, 7)] == (256 * KiB, 11, False)
    top = memory_timeline.largest_allocations(snapshot, n=2, marks=FIX.MARKS)
    assert top["size_mib"].tolist() == [1.0, 0.5]
    assert top["origin"].tolist() == ["train.py:12:step", "model.py:208:forward < train.py:12:step"]
    assert top["phase"].tolist() == ["forward", "forward"]
    backward = memory_timeline.largest_allocations(snapshot, marks=FIX.MARKS, phase="backward")
    assert backward["size_mib"].tolist() == [0.25]


def test_allocations_by_origin(snapshot):
    by = memory_timeline.allocations_by_origin(snapshot, marks=FIX.MARKS, phase="forward")
    assert by["origin"].tolist() == ["train.py:12:step", "model.py:208:forward"]
    assert by["total_mib"].tolist() == [1.0, 0.5] and by["count"].tolist() == [1, 1]
    every = memory_timeline.allocations_by_origin(snapshot).set_index("origin")
    assert every.loc["model.py:208:forward", "count"] == 2  # X (forward) and Z (backward)
    assert every.loc["model.py:208:forward", "total_mib"] == 0.75
    assert every["share"].sum() == 1.0


def test_peaks_by_phase_on_fixture(snapshot):
    timeline = memory_timeline.active_memory_timeline(snapshot, marks=FIX.MARKS)
    peaks = memory_timeline.peaks_by_phase(timeline).set_index("phase")
    assert peaks.loc["forward", "peak_index"] == 4
    assert peaks.loc["forward", "peak_gib"] * 2**30 == 4 * KiB + 512 * KiB + MiB
    assert peaks.loc["backward", "peak_gib"] * 2**30 == 4 * KiB + MiB + 256 * KiB
    assert peaks.loc["backward", "start_gib"] * 2**30 == 4 * KiB + MiB
    assert peaks.loc["optimizer_step", "end_gib"] * 2**30 == 4 * KiB + 256 * KiB


def test_marks_after_all_events_and_phase_lookup():
    phases = memory_timeline.phase_at(np.array([5, 10, 11, 30]), [("b", 20), ("a", 10)], default="-")
    assert phases.tolist() == ["-", "a", "a", "b"]


def test_user_frame_filter():
    assert memory_timeline.is_user_frame({"filename": "/x/site-packages/lab/model.py", "line": 1, "name": "f"})
    assert memory_timeline.is_user_frame({"filename": "/tmp/ipykernel_123/456.py", "line": 1, "name": "f"})
    assert not memory_timeline.is_user_frame({"filename": "torch/nn/modules/linear.py", "line": 1, "name": "f"})
    assert not memory_timeline.is_user_frame({"filename": "??", "line": 0, "name": "c10::malloc"})
    assert memory_timeline.origin([]) == "?"


def test_export_memory_viz_html_embeds_the_snapshot(snapshot, tmp_path):
    import base64
    import json
    import re

    out = memory_snapshot.export_memory_viz_html(snapshot, tmp_path / "viz.html")
    html = out.read_text()
    payload = json.loads(re.search(r"const local_files = (\[.*?\])\n", html).group(1))[0]["base64"]
    assert pickle.loads(base64.b64decode(payload)) == snapshot  # trailing zero padding is ignored by pickle
    with pytest.raises(ValueError):
        memory_snapshot.export_memory_viz_html(snapshot, tmp_path / "x.html", kind="nope")


def test_load_snapshot_rejects_other_pickles(tmp_path):
    p = tmp_path / "bad.pickle"
    p.write_bytes(pickle.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a memory snapshot"):
        memory_snapshot.load_snapshot(p)


# ---------------------------------------------------------------------------------------------------------
# peak_memory_by_phase with an injected counter


class FakeCounter:
    """A scripted allocator: the model and optimizer below call alloc/free with known sizes."""

    def __init__(self, start: int):
        self.current = self.peak_ = start

    def alloc(self, n):
        self.current += n
        self.peak_ = max(self.peak_, self.current)

    def free(self, n):
        self.current -= n

    def allocated(self):
        return self.current

    def peak(self):
        return self.peak_

    def reset_peak(self):
        self.peak_ = self.current


class _Scripted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counter):
        counter.alloc(1000)  # activations saved for backward
        counter.alloc(200)   # a temporary
        counter.free(200)
        ctx.counter = counter
        return x * w

    @staticmethod
    def backward(ctx, g):
        ctx.counter.alloc(500)  # a backward temporary
        ctx.counter.free(500)
        ctx.counter.free(1000)  # the saved activations die
        return None, g.sum().reshape(1), None


class ScriptedModel(nn.Module):
    def __init__(self, counter):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.counter = counter

    def forward(self, x):
        return _Scripted.apply(x, self.w, self.counter)


class ScriptedSGD(torch.optim.SGD):
    def __init__(self, params, counter):
        super().__init__(params, lr=0.1)
        self.counter, self.first = counter, True

    def step(self, closure=None):
        if self.first:  # state created at the first step, kept
            self.counter.alloc(300)
            self.first = False
        self.counter.alloc(50)
        self.counter.free(50)
        return super().step(closure)


def test_peak_memory_by_phase_resets_between_phases():
    counter = FakeCounter(start=100)
    model = ScriptedModel(counter)
    opt = ScriptedSGD(model.parameters(), counter)
    step = TrainStep(model, opt, torch.ones(3), None, loss_fn=lambda m, x, _: m(x).sum())
    df = peak_memory_by_phase(step, steps=2, counter=counter)
    got = [(r.step, r.phase, r.peak_bytes, r.allocated_bytes) for r in df.itertuples()]
    assert got == [(0, "init", 100, 100),
                   (0, "forward", 1300, 1100), (0, "backward", 1600, 100), (0, "optimizer_step", 450, 400),
                   (1, "forward", 1600, 1400), (1, "backward", 1900, 400), (1, "optimizer_step", 450, 400)]
    assert df["peak_gib"].iloc[1] == 1300 / 2**30


def test_peak_memory_by_phase_cpu_fallback_sees_adam_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randint(0, 8, (64,))
    step = TrainStep(model, opt, x, y, loss_fn=lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y))
    df = peak_memory_by_phase(step, steps=2).set_index(["step", "phase"])
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    # the first step creates exp_avg and exp_avg_sq (2 x parameter bytes) and a 4-byte step counter each
    created = df.loc[(0, "optimizer_step"), "allocated_bytes"] - df.loc[(0, "init"), "allocated_bytes"]
    assert created == 2 * param_bytes + 4 * n_tensors
    # the forward keeps at least the hidden activation (64 x 512 fp32) until the backward
    assert df.loc[(0, "forward"), "allocated_bytes"] - df.loc[(0, "init"), "allocated_bytes"] >= 64 * 512 * 4
    # the second step creates no state: it ends where the first ended
    assert df.loc[(1, "optimizer_step"), "allocated_bytes"] == df.loc[(0, "optimizer_step"), "allocated_bytes"]
    # backward allocates the gradients (1 x parameter bytes) on top of what the forward left
    assert df.loc[(0, "backward"), "peak_bytes"] >= df.loc[(0, "init"), "allocated_bytes"] + param_bytes


def test_cpu_recording_round_trip(tmp_path):
    model = nn.Linear(128, 64)
    x = torch.randn(32, 128)
    with memory_snapshot.record_memory_snapshot(tmp_path / "s.pickle", device="cpu") as rec:
        rec.mark("forward")
        y = model(x)
        rec.mark("backward")
        y.sum().backward()
    snap = memory_snapshot.load_snapshot(tmp_path / "s.pickle")
    assert memory_snapshot.load_marks(tmp_path / "s.pickle") == rec.marks
    top = memory_timeline.largest_allocations(snap, n=1, marks=rec.marks, phase="forward")
    assert top["size_mib"].iloc[0] * MiB == 32 * 64 * 4  # the output of the Linear
    assert "test_memory.py" in top["origin"].iloc[0]
    grads = memory_timeline.largest_allocations(snap, n=10, marks=rec.marks, phase="backward")
    assert 64 * 128 * 4 in (grads["size_mib"] * MiB).round().astype(int).tolist()  # the weight's gradient


def test_plot_active_memory_timeline_draws_bands(snapshot):
    import matplotlib

    matplotlib.use("Agg")
    ax = memory_timeline.plot_active_memory_timeline(snapshot, marks=FIX.MARKS, top=2)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    # groups are (innermost user frame, phase kind); A and B existed before the trace (5 KiB at the start);
    # by bytes x events Y (1 MiB x 5) and X (512 KiB x 3) beat Z (256 KiB x 4, made in the backward)
    assert labels == ["before trace (max 5 KiB)", "model.py:208:forward · forward (max 512 KiB)",
                      "train.py:12:step · forward (max 1 MiB)", "other"]
    # the stacked bands add up to the reconstructed total (the first polygon is the bottom band)
    top_line = ax.lines[0].get_ydata()
    assert top_line[4] * 2**20 == 4 * KiB + 512 * KiB + MiB


@pytest.mark.gpu
def test_cuda_recording_round_trip(tmp_path):
    x = torch.randn(1024, 1024, device="cuda")
    with memory_snapshot.record_memory_snapshot(tmp_path / "g.pickle", device="cuda") as rec:
        rec.mark("work")
        y = x @ x
        del y
    snap = memory_snapshot.load_snapshot(tmp_path / "g.pickle")
    top = memory_timeline.largest_allocations(snap, n=10, marks=rec.marks)
    assert (top["phase"] == "work").all()  # the trace's time_us and the marks share the host clock
    # the 4 MiB product, made by this test (cuBLAS may also allocate its workspace here)
    product = top[top["size_mib"] == 4.0]
    assert len(product) == 1 and "test_memory.py" in product["origin"].iloc[0]
    tl = memory_timeline.active_memory_timeline(snap, marks=rec.marks)
    assert tl["active_bytes"].iloc[-1] == torch.cuda.memory_allocated()
