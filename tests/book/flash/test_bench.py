"""lab.book.flash.bench: the FlashAttention grid's rows, TFLOP/s and graph timing; errors against float64."""

import math

import pytest
import torch

from lab.book.attention import bench as ab
from lab.book.flash import bench as fl
from lab.book.flash import goals as gl
from lab.measure.timing import Timing
from lab.model.attention import naive_attention as model_naive_attention


def test_errors_vs_float64():
    def off_by_one_percent(q, k, v, causal):
        return model_naive_attention(q, k, v, causal) * 1.01

    impls = {"sdpa": ab.attention_impl("sdpa", "cpu"), "scaled": off_by_one_percent}
    errs = fl.errors_vs_float64(impls, batch=2, seq=32, d=16, device="cpu").set_index("impl")
    assert (errs.loc["sdpa", ["out", "dq", "dk", "dv"]] < 1e-5).all()
    # a 1% scaled output: the output error is 1% of the largest |output|, and dV (linear in the output
    # scale) is off by 1% of the largest |dV|
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 32, 16, generator=gen).double() for _ in range(4))
    v.requires_grad_()
    ref = model_naive_attention(q, k, v, True)
    (dv,) = torch.autograd.grad(ref, (v,), do)
    assert errs.loc["scaled", "out"] == pytest.approx(0.01 * ref.abs().max().item(), rel=1e-3)
    assert errs.loc["scaled", "dv"] == pytest.approx(0.01 * dv.abs().max().item(), rel=1e-3)
    assert (errs["status"] == "ok").all() and (errs["d"] == 16).all() and (errs["seq_len"] == 32).all()


def test_errors_vs_float64_records_what_cannot_run():
    def no_kernel(q, k, v, causal):
        raise RuntimeError("No available kernel. Aborting execution.")

    def small_head_dims_only(q, k, v, causal):
        raise ValueError(f"head dimension d={q.shape[-1]} is not supported by the Triton kernels")

    def bug(q, k, v, causal):
        raise ValueError("shapes do not match")

    errs = fl.errors_vs_float64({"cudnn": no_kernel, "tri": small_head_dims_only}, batch=1, seq=16, d=80,
                                device="cpu").set_index("impl")
    assert errs["status"].tolist() == ["unsupported", "unsupported"]
    assert "No available kernel" in errs.loc["cudnn", "note"] and "d=80" in errs.loc["tri", "note"]
    assert errs[["out", "dq", "dk", "dv"]].isna().all().all()
    def declines_loudly(q, k, v, causal):
        import warnings

        warnings.warn("Flash attention kernel not used because:")  # what SDPA says before it gives up
        raise RuntimeError("No available kernel. Aborting execution.")

    def works_and_warns(q, k, v, causal):
        import warnings

        warnings.warn("something the reader should see")
        return q + k + v

    with pytest.warns(UserWarning) as seen:
        fl.errors_vs_float64({"loud": declines_loudly, "ok": works_and_warns}, batch=1, seq=16, d=16, device="cpu")
    assert [str(w.message) for w in seen] == ["something the reader should see"]  # the decline's chatter is not
    with pytest.raises(ValueError, match="do not match"):  # any other error is a bug, not a row
        fl.errors_vs_float64({"bug": bug}, batch=1, seq=16, d=16, device="cpu")


def test_unsupported_reason():
    assert fl.unsupported_reason(RuntimeError("No viable backend for scaled_dot_product_attention was found."))
    assert fl.unsupported_reason(TypeError("dtype torch.float64 is not supported by the Triton kernels"))
    assert fl.unsupported_reason(RuntimeError("CUDA error: an illegal memory access")) is None
    assert fl.unsupported_reason(KeyError("not supported")) is None


def test_correctness_grid_rows():
    df = fl.correctness_grid(["pytorch_naive", "sdpa"], ds=(16, 24), dtypes=("fp32", "bf16"), batch=1, seq=16,
                             device="cpu", progress=False)
    assert len(df) == 8 and (df["status"] == "ok").all()
    assert list(zip(df["dtype"], df["d"]))[::2] == [("fp32", 16), ("fp32", 24), ("bf16", 16), ("bf16", 24)]
    fp32, bf16 = df[df["dtype"] == "fp32"], df[df["dtype"] == "bf16"]
    assert fp32["out"].max() < 1e-5 < bf16["out"].max() < 0.1




def test_flash_grid_rows_tflops_and_speedups():
    impls = {"pytorch_naive": ab.naive_attention, "sdpa": ab.attention_impl("sdpa", "cpu")}
    df = fl.run_flash_grid(impls, fl.grid_shapes((32, 64), (16,), heads=2), dtypes=("fp32",), cpu_steps=2,
                           device="cpu", progress=False)
    assert len(df) == 4 and (df["status"] == "ok").all()
    assert set(df["impl"]) == {"pytorch_naive", "sdpa"} and (df["heads"] == 2).all() and df["causal"].all()
    for p in fl.PASSES:
        assert (df[f"{p}_ms"] > 0).all()
    r = df.iloc[0]
    assert r["fwd_tflops"] == pytest.approx(4 * 2 * (32 * 33 / 2) * 16 / (r["fwd_ms"] * 1e-3) / 1e12)
    assert r["e2e_tflops"] == pytest.approx(14 * 2 * (32 * 33 / 2) * 16 / (r["e2e_ms"] * 1e-3) / 1e12)
    sp = gl.add_speedups(df)
    sdpa = sp[sp["impl"] == "sdpa"]
    assert sdpa["e2e_speedup_vs_sdpa"].tolist() == [1.0, 1.0]
    naive = sp[sp["impl"] == "pytorch_naive"].iloc[0]
    assert naive["fwd_speedup_vs_sdpa"] == pytest.approx(sdpa.iloc[0]["fwd_ms"] / naive["fwd_ms"])
    assert (df["timing"] == "eager").all()  # no CUDA graphs on the CPU
    # every pass keeps what a verdict needs: mean, spread and the number of samples
    assert (df["fwd_n"] == 2).all() and (df["e2e_std_ms"] >= 0).all() and (df["bwd_mean_ms"] > 0).all()
    assert (df["gpu"] == "cpu").all() and (df["sweep"] == "").all()


def test_flash_benchmark_labels_its_sweeps():
    impls = {"sdpa": ab.attention_impl("sdpa", "cpu")}
    df = fl.run_flash_benchmark({"lm": dict(shapes=fl.grid_shapes((16,), (8,), heads=2), dtypes=("bf16",)),
                                 "fp32": dict(shapes=fl.grid_shapes((16, 32), (8,)), dtypes=("fp32",))},
                                impls=impls, cpu_steps=1, device="cpu", progress=False)
    assert df["sweep"].tolist() == ["lm", "fp32", "fp32"] and df["dtype"].tolist() == ["bf16", "fp32", "fp32"]


def test_skip_pytorch_flash_rule():
    skip = fl.skip_pytorch_flash(max_seq=2048, dtypes=("bf16",))
    assert skip("pytorch_flash", fl.Shape(1, 16, 2048, 64), "bf16") is None
    reason = skip("pytorch_flash", fl.Shape(1, 16, 4096, 64), "bf16")
    assert "beyond 2048 tokens" in reason and "2,080 tile pairs" in reason  # 64 tiles: 64 * 65 / 2 causal
    assert "4,096 tile pairs" in skip("pytorch_flash", fl.Shape(1, 16, 4096, 64, False), "bf16")
    assert "fp16" in skip("pytorch_flash", fl.Shape(1, 16, 1024, 64), "fp16")
    assert skip("triton", fl.Shape(1, 16, 65536, 64), "fp16") is None


def test_flash_grid_oom_rows():
    def oom(q, k, v, causal):
        raise torch.OutOfMemoryError("CUDA out of memory")

    df = fl.run_flash_grid({"broken": oom, "pytorch_naive": ab.naive_attention}, fl.grid_shapes((16,), (16,)),
                           dtypes=("fp32",), cpu_steps=1, device="cpu", progress=False)
    broken = df[df["impl"] == "broken"].iloc[0]
    assert broken["status"] == "oom" and "forward" in broken["note"] and math.isnan(broken["fwd_tflops"])
    assert df[df["impl"] == "pytorch_naive"].iloc[0]["status"] == "ok"
    # a memory limit below the naive requirement: recorded as OOM without being attempted
    df = fl.run_flash_grid({"pytorch_naive": ab.naive_attention}, fl.grid_shapes((64,), (16,)), dtypes=("fp32",),
                           cpu_steps=1, device="cpu", memory_limit_gib=1e-6, progress=False)
    assert df.loc[0, "status"] == "oom" and "not attempted" in df.loc[0, "note"]
    # a configuration skipped on purpose is a row that says why
    df = fl.run_flash_grid({"pytorch_naive": ab.naive_attention}, fl.grid_shapes((64,), (16,)), dtypes=("fp32",),
                           cpu_steps=1, device="cpu", skip=lambda impl, shape, dt: "too slow", progress=False)
    assert df.loc[0, "status"] == "skipped" and df.loc[0, "note"] == "too slow"
    # an implementation that cannot run this input is a row that says so
    df = fl.run_flash_grid(("sdpa_cudnn",), fl.grid_shapes((16,), (16,)), dtypes=("fp32",), cpu_steps=1,
                           device="cpu", progress=False)
    assert df.loc[0, "status"] == "unsupported" and "not supported" in df.loc[0, "note"]
    assert math.isnan(df.loc[0, "fwd_ms"]) and df.loc[0, "fwd_n"] == 0


def test_course_timing_test_on_the_cpu():
    """The course's test runs interpreted on a tiny shape and says where it ran (its goal is an H100's)."""
    t = fl.course_timing_table((False,), batch=1, seq=32, d=16, device="cpu", cpu_steps=2)
    row = t.iloc[0]
    assert row["gpu"] == "cpu" and row["n"] == 2 and row["ms"] > 0 and not row["compiled"]
    assert row["goal_ms"] == fl.COURSE_GOAL_MS == 4.6


@pytest.mark.slow
def test_flash_grid_runs_interpreted_triton():
    df = fl.run_flash_grid(("triton", "pytorch_flash", "sdpa"), fl.grid_shapes((32,), (16, 80)), dtypes=("fp32",),
                           cpu_steps=1,
                           device="cpu", progress=False)
    assert (df["status"] == "ok").all() and (df["e2e_ms"] > 0).all()


def test_graph_times_derive_the_backward_from_two_replays():
    """The backward of a CUDA-graph-timed row is forward+backward minus forward: medians and means subtract,
    standard deviations add in quadrature, the samples are the fewer of the two."""
    fwd, e2e = Timing([1.0, 1.2, 1.1]), Timing([3.0, 3.4, 3.2, 3.3])
    row = fl.graph_times(fwd, e2e)
    assert row["fwd_ms"] == pytest.approx(1.1) and row["e2e_ms"] == pytest.approx(3.25) and row["e2e_n"] == 4
    assert row["bwd_ms"] == pytest.approx(3.25 - 1.1) and row["bwd_mean_ms"] == pytest.approx(3.225 - 1.1)
    assert row["bwd_std_ms"] == pytest.approx(math.hypot(e2e.std_ms, fwd.std_ms)) and row["bwd_n"] == 3


def test_the_goal_grid_holds_the_leaderboard_and_2_7b_shapes():
    assert fl.Shape(1, 32, 32768, 128) in fl.LM_SHAPES and fl.Shape(4, 32, 512, 80) in fl.LM_SHAPES
    assert set(gl.SHAPE_GOALS) <= set(fl.LM_SHAPES)
    # only the 2.7B shape is short enough to be timed as CUDA-graph replays
    assert [s for s in fl.LM_SHAPES if s.seq <= fl.GRAPH_MAX_SEQ] == [fl.Shape(4, 32, 512, 80)]


def test_graph_timing_replaces_the_eager_times(monkeypatch):
    """Where a shape is CUDA-graph timed, the replays' times replace the eager ones (kept as ``*_eager_ms``); a
    step that cannot be captured keeps its eager times and says why. (No CUDA here: the capture is stubbed, the
    bookkeeping is what is checked.)"""
    impl = ab.attention_impl("sdpa", "cpu")
    calls = []
    monkeypatch.setattr(fl, "graph_replay", lambda step: calls.append(step) or step)
    row = {}
    fl._measure_flash(impl, 2, 16, 8, "fp32", True, torch.device("cpu"), dict(cpu_steps=2), row, graph=True)
    assert len(calls) == 2 and row["timing"] == "graph" and row["fwd_n"] == 2
    assert {"fwd_eager_ms", "bwd_eager_ms", "e2e_eager_ms"} <= set(row)
    assert row["bwd_ms"] == pytest.approx(row["e2e_ms"] - row["fwd_ms"])

    def uncapturable(step):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(fl, "graph_replay", uncapturable)
    row = {}
    fl._measure_flash(impl, 2, 16, 8, "fp32", True, torch.device("cpu"), dict(cpu_steps=2), row, graph=True)
    assert row["timing"] == "eager" and "capture failed" in row["note"] and "fwd_eager_ms" not in row
