"""lab.bench.attention_grid: errors against float64, the grid's rows (medians with spread and count, TFLOP/s, rows
for what did not run) and the bookkeeping of CUDA-graph timing."""

import math
import warnings

import pytest
import torch

from lab.bench import attention_grid as ag
from lab.bench.attention import attention_impl
from lab.measure.verdicts import summarize
from lab.model.attention import naive_attention


def test_errors_vs_float64():
    def off_by_one_percent(q, k, v, causal):
        return naive_attention(q, k, v, causal) * 1.01

    impls = {"sdpa": attention_impl("sdpa", "cpu"), "scaled": off_by_one_percent}
    errs = ag.errors_vs_float64(impls, batch=2, seq=32, d=16, device="cpu").set_index("impl")
    assert (errs.loc["sdpa", ["out", "dq", "dk", "dv"]] < 1e-5).all()
    # a 1% scaled output: the output error is 1% of the largest |output|, and dV (linear in the output scale)
    # is off by 1% of the largest |dV|
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 32, 16, generator=gen).double() for _ in range(4))
    v.requires_grad_()
    ref = naive_attention(q, k, v, True)
    (dv,) = torch.autograd.grad(ref, (v,), do)
    assert errs.loc["scaled", "out"] == pytest.approx(0.01 * ref.abs().max().item(), rel=1e-3)
    assert errs.loc["scaled", "dv"] == pytest.approx(0.01 * dv.abs().max().item(), rel=1e-3)
    assert (errs["status"] == "ok").all() and (errs["d"] == 16).all() and (errs["seq_len"] == 32).all()


def test_errors_vs_float64_records_what_cannot_run():
    def no_kernel(q, k, v, causal):
        warnings.warn("Flash attention kernel not used because:")  # what SDPA says before it gives up
        raise RuntimeError("No available kernel. Aborting execution.")

    def works_and_warns(q, k, v, causal):
        warnings.warn("something the reader should see")
        return q + k + v

    def bug(q, k, v, causal):
        raise ValueError("shapes do not match")

    with pytest.warns(UserWarning) as seen:
        errs = ag.errors_vs_float64({"cudnn": no_kernel, "ok": works_and_warns}, batch=1, seq=16, d=16,
                                    device="cpu").set_index("impl")
    assert [str(w.message) for w in seen] == ["something the reader should see"]  # the decline's chatter is not
    assert errs.loc["cudnn", "status"] == "unsupported" and "No available kernel" in errs.loc["cudnn", "note"]
    assert errs.loc["cudnn", ["out", "dq", "dk", "dv"]].isna().all()
    with pytest.raises(ValueError, match="do not match"):  # any other error is a bug, not a row
        ag.errors_vs_float64({"bug": bug}, batch=1, seq=16, d=16, device="cpu")


def test_unsupported_reason():
    assert ag.unsupported_reason(RuntimeError("No viable backend for scaled_dot_product_attention was found."))
    assert ag.unsupported_reason(TypeError("dtype torch.float64 is not supported by the Triton kernels"))
    assert ag.unsupported_reason(RuntimeError("CUDA error: an illegal memory access")) is None
    assert ag.unsupported_reason(KeyError("not supported")) is None


def test_correctness_grid_rows():
    df = ag.correctness_grid(["pytorch_naive", "sdpa"], ds=(16, 24), dtypes=("fp32", "bf16"), batch=1, seq=16,
                             device="cpu", progress=False)
    assert len(df) == 8 and (df["status"] == "ok").all()
    assert list(zip(df["dtype"], df["d"]))[::2] == [("fp32", 16), ("fp32", 24), ("bf16", 16), ("bf16", 24)]
    assert df[df["dtype"] == "fp32"]["out"].max() < 1e-5 < df[df["dtype"] == "bf16"]["out"].max() < 0.1


def test_grid_rows_are_medians_with_spread_count_and_tflops():
    impls = {"pytorch_naive": naive_attention, "sdpa": attention_impl("sdpa", "cpu")}
    shapes = [ag.Shape(1, 2, s, 16) for s in (32, 64)]
    df = ag.time_attention_grid(impls, shapes, dtypes=("fp32",), cpu_steps=5, device="cpu", progress=False)
    assert len(df) == 4 and (df["status"] == "ok").all() and (df["timing"] == "eager").all()
    assert (df["heads"] == 2).all() and df["causal"].all() and (df["gpu"] == "cpu").all() and (df["kernel"] == "").all()
    for p in ag.PASSES:
        assert (df[f"{p}_ms"] > 0).all() and (df[f"{p}_n"] == 5).all() and (df[f"{p}_spread_ms"] >= 0).all()
    r = df.iloc[0]
    assert r["fwd_tflops"] == pytest.approx(4 * 2 * (32 * 33 / 2) * 16 / (r["fwd_ms"] * 1e-3) / 1e12)
    assert r["e2e_tflops"] == pytest.approx(14 * 2 * (32 * 33 / 2) * 16 / (r["e2e_ms"] * 1e-3) / 1e12)


def test_summarized_is_the_one_statistic():
    samples = [1.0, 1.1, 1.2, 5.0, 1.05]
    s = summarize(samples)
    assert ag.summarized("fwd", samples) == {"fwd_ms": s.median, "fwd_spread_ms": s.spread, "fwd_n": 5}
    assert math.isnan(ag.summarized("e2e", [])["e2e_ms"]) and ag.summarized("e2e", [])["e2e_n"] == 0


def test_rows_for_what_did_not_run():
    def oom(q, k, v, causal):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    shape = [ag.Shape(1, 1, 16, 16)]
    df = ag.time_attention_grid({"broken": oom, "pytorch_naive": naive_attention}, shape, dtypes=("fp32",),
                                cpu_steps=1, device="cpu", progress=False).set_index("impl")
    broken = df.loc["broken"]
    assert broken["status"] == "oom" and broken["limit_gib"] > 0 and math.isnan(broken["fwd_tflops"])
    assert "Tried to allocate" not in broken["note"] and broken["fwd_n"] == 0  # no allocator message, no samples
    assert df.loc["pytorch_naive", "status"] == "ok"
    # a memory limit below the naive requirement: recorded as out of memory without being attempted
    df = ag.time_attention_grid({"pytorch_naive": naive_attention}, [ag.Shape(1, 1, 64, 16)], dtypes=("fp32",),
                                cpu_steps=1, device="cpu", memory_limit_gib=1e-6, progress=False)
    assert df.loc[0, "status"] == "oom" and df.loc[0, "need_gib"] > 1e-6
    df = ag.time_attention_grid({"pytorch_naive": naive_attention}, shape, dtypes=("fp32",), cpu_steps=1,
                                device="cpu", skip=lambda impl, s, dt: "too slow", progress=False)
    assert df.loc[0, "status"] == "skipped" and df.loc[0, "note"] == "too slow"
    df = ag.time_attention_grid(("sdpa_cudnn",), shape, dtypes=("fp32",), cpu_steps=1, device="cpu", progress=False)
    assert df.loc[0, "status"] == "unsupported" and "not supported" in df.loc[0, "note"]
    assert math.isnan(df.loc[0, "fwd_ms"]) and df.loc[0, "fwd_n"] == 0
    with pytest.raises(ValueError, match="unknown dtype"):
        ag.time_attention_grid(("sdpa",), shape, dtypes=("fp8",), device="cpu", progress=False)


def test_our_kernels_name_the_kernel_that_ran():
    """A row of our implementation says which kernel ran: the implementation's own dispatch where it carries one,
    else the Triton kernels; a peer's row names none."""
    def ours(q, k, v, causal):
        return naive_attention(q, k, v, causal)

    q = torch.zeros(1, 8, 64)
    assert ag.kernel_of("triton", ours, q, q, q, True) == "triton"
    ours.kernel = lambda q, k, v, causal: "gluon" if q.shape[-1] == 64 else "triton"
    assert ag.kernel_of("triton", ours, q, q, q, True) == "gluon"
    assert ag.kernel_of("sdpa", ours, q, q, q, True) == ""
    df = ag.time_attention_grid({"triton": ours}, [ag.Shape(1, 1, 16, 64)], dtypes=("fp32",), cpu_steps=1,
                                device="cpu", progress=False)
    assert df.loc[0, "kernel"] == "gluon" and df.loc[0, "bwd_mode"] in ("fused", "two_pass")


def test_graph_timing_replaces_the_eager_times(monkeypatch):
    """Where a shape is replayed from CUDA graphs, the replays become its times and the eager ones stay as
    ``<pass>_eager_*``; the replay's backward is derived (no samples); a step that cannot be captured keeps its
    eager times and says why. (No CUDA here: the capture is stubbed, the bookkeeping is what is checked.)"""
    calls = []
    monkeypatch.setattr(ag, "graph_replay", lambda step: calls.append(step) or step)
    timer = dict(cpu_steps=5)
    row = ag._measure(attention_impl("sdpa", "cpu"), "sdpa", ag.Shape(1, 2, 16, 8), "fp32", torch.device("cpu"),
                      timer, graph=True, limit_gib=1.0)
    assert len(calls) == 2 and row["timing"] == "graph" and row["fwd_n"] == 5 and row["fwd_eager_n"] == 5
    assert {"fwd_eager_ms", "bwd_eager_ms", "e2e_eager_ms", "e2e_eager_spread_ms"} <= set(row)
    assert row["bwd_ms"] == pytest.approx(row["e2e_ms"] - row["fwd_ms"]) and row["bwd_n"] == 0
    assert math.isnan(row["bwd_spread_ms"])

    def uncapturable(step):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(ag, "graph_replay", uncapturable)
    row = ag._measure(attention_impl("sdpa", "cpu"), "sdpa", ag.Shape(1, 2, 16, 8), "fp32", torch.device("cpu"),
                      timer, graph=True, limit_gib=1.0)
    assert "timing" not in row and "CUDA graph" in row["note"] and "fwd_eager_ms" not in row


def test_time_passes_times_only_the_passes_asked():
    fn = attention_impl("sdpa", "cpu")
    q, k, v, dout = (torch.randn(2, 16, 8, requires_grad=i < 3) for i in range(4))
    row = ag.time_passes(fn, q, k, v, dout, True, torch.device("cpu"), dict(cpu_steps=5), passes=("bwd",))
    assert set(row) == {"bwd_ms", "bwd_spread_ms", "bwd_n"} and row["bwd_n"] == 5


def test_shape_label_and_row():
    assert ag.Shape(8, 16, 2048, 128, False).label == "8x16x2048x128 full"
    assert ag.Shape.of(dict(batch=4, heads=32, seq_len=512, d=80, causal=True)) == ag.Shape(4, 32, 512, 80)


@pytest.mark.slow
def test_grid_runs_interpreted_triton():
    df = ag.time_attention_grid(("triton", "pytorch_flash", "sdpa"), [ag.Shape(1, 1, 32, d) for d in (16, 80)],
                                dtypes=("fp32",), cpu_steps=1, device="cpu", progress=False)
    assert (df["status"] == "ok").all() and (df["e2e_ms"] > 0).all()
    assert (df.loc[df["impl"] == "triton", "kernel"] == "triton").all()
