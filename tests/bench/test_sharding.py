"""lab.bench.sharding: the closed forms, memory in fresh processes over several steps and interleaved step times on
gloo (and NCCL where there are GPUs)."""

import json
import math
import statistics

import pytest
import torch

from lab.bench import sharding
from lab.bench.interleaved import Interleaving, samples
from lab.measure import traces


def test_expected_state_bytes_closed_form():
    p, n = 1000, 4
    assert sharding.expected_state_bytes("ddp", p, n) == {"params": 4000, "grads": 4000, "optimizer_state": 8000,
                                                          "total": 16000}
    for impl in ("sharded_optimizer", "zero1", "torch_zero"):
        assert sharding.expected_state_bytes(impl, p, n)["optimizer_state"] == 2000
        assert sharding.expected_state_bytes(impl, p, n)["grads"] == 4000
    for impl in ("fsdp", "torch_fsdp2"):
        assert sharding.expected_state_bytes(impl, p, n)["total"] == 4000
    with pytest.raises(ValueError, match="unknown impl"):
        sharding.expected_state_bytes("zero3", p, n)


def test_step_times_interleaved_on_gloo():
    """Our ZeRO-1 and FSDP next to torch's FSDP2, in the same two processes, every one with its rounds."""
    df = sharding.step_times(("zero1", "fsdp", "torch_fsdp2"), "tiny", context=32, dtype="fp32", device="cpu",
                             interleaving=Interleaving(rounds=3, warmup=1, schedule="resident"))
    assert list(df["impl"]) == ["zero1", "fsdp", "torch_fsdp2"]
    assert (df["status"] == "ok").all() and (df["step_n"] == 3).all() and (df["schedule"] == "resident").all()
    for r in df.itertuples():
        xs = samples(r.step_samples_ms)
        assert len(xs) == 3 and r.step_ms == pytest.approx(statistics.median(xs), rel=1e-4) and r.step_spread_ms >= 0


def test_an_implementation_failing_in_step_times_is_a_row_and_the_others_are_timed():
    # fp8-ish is no reduce dtype: only FSDP's build reads it, on every rank
    df = sharding.step_times(("ddp", "fsdp", "zero1"), "tiny", context=32, dtype="fp32", device="cpu",
                             interleaving=Interleaving(rounds=2, warmup=1, schedule="resident"),
                             fsdp_reduce_dtype="fp8-ish").set_index("impl")
    assert list(df.index) == ["ddp", "fsdp", "zero1"]
    assert df.loc["fsdp", "status"] == "failed" and "fp8-ish" in df.loc["fsdp", "error"]
    assert df.loc["fsdp", "step_n"] == 0 and math.isnan(df.loc["fsdp", "step_ms"])
    others = df.drop(index="fsdp")
    assert (others["status"] == "ok").all() and (others["step_n"] == 2).all() and (others["step_ms"] > 0).all()


@pytest.mark.slow
def test_step_times_rebuilt_each_turn():
    """Every implementation built, stepped and closed in turn (close() clears AdamW's state and the
    gradients, and removes the wrappers' hooks)."""
    df = sharding.step_times(sharding.IMPLS, "tiny", context=32, dtype="fp32",
                             device="cpu", interleaving=Interleaving(rounds=2, steps_per_round=2, schedule="rebuild"))
    assert (df["status"] == "ok").all() and (df["step_n"] == 2).all() and (df["schedule"] == "rebuild").all()


def test_memory_row_takes_each_step_at_its_largest_rank(monkeypatch):
    """The steps are a peak's samples: each step at the rank that needed the most, then their median."""
    rank = dict(num_params=1000, peak_init_gib=1.0, param_bytes=2**30, grad_bytes=2**30, optimizer_state_bytes=2**30)
    ranks = [dict(rank, rank=1, before_gib=[3.0, 3.5, 3.0, 3.0, 3.0], after_gib=[2.0, 2.0, 2.0, 2.0, 2.0],
                  step_gpu_ms=11.0, step_compute_gpu_ms=8.0),
             dict(rank, rank=0, before_gib=[3.2, 3.2, 3.2, 3.2, 3.2], after_gib=[1.0, 1.0, 5.0, 1.0, 1.0],
                  step_gpu_ms=10.0, step_compute_gpu_ms=7.0)]
    monkeypatch.setattr(sharding.runner, "run", lambda *args, **kwargs: [ranks])
    row = sharding.memory_row("ddp", "tiny", world_size=2, context=16, device="cpu")
    assert json.loads(row["peak_before_step_samples_gib"]) == [3.2, 3.5, 3.2, 3.2, 3.2]
    assert (row["peak_before_step_gib"], row["peak_before_step_n"]) == (3.2, 5)
    assert json.loads(row["peak_after_step_samples_gib"]) == [2.0, 2.0, 5.0, 2.0, 2.0]
    assert json.loads(row["peak_samples_gib"]) == [3.2, 3.5, 5.0, 3.2, 3.2] and row["peak_gib"] == 3.2
    assert row["activations_gib"] == pytest.approx(0.2) and row["limit_gib"] > 0
    assert (row["step_gpu_ms"], row["step_compute_gpu_ms"]) == (10.0, 7.0)  # rank 0's profiled step


@pytest.mark.slow
def test_memory_row_on_cpu(tmp_path):
    """One configuration's memory run end to end (gloo, tiny model): the state bytes match the closed form and
    the profiled FSDP step shows compute and gloo communication on the timeline."""
    row = sharding.memory_row("fsdp", "tiny", world_size=2, context=32, batch=2, dtype="fp32", warmup=1,
                              device="cpu", trace_path=str(tmp_path / "trace.json"))
    assert row["status"] == "ok", row["error"]
    assert row["reduce_dtype"] == "fp32" and math.isnan(row["peak_gib"])  # no allocator peaks on the CPU
    assert row["peak_n"] == 0 and json.loads(row["peak_samples_gib"]) == []
    for part in ("param", "grad", "optimizer_state"):  # sharded: half of the closed-form full size, + padding
        assert row[f"{part}_gib"] == pytest.approx(row[f"expected_{part}_gib"], rel=1e-3)
    tl = traces.read_trace(row["trace"])
    assert {"compute", "communication", "phase"} <= set(tl["kind"])
    summary = traces.overlap_summary(tl).set_index("phase")
    assert {"forward", "backward", "optimizer_step", "step"} <= set(summary.index)
    assert summary.loc["backward", "communication_ms"] > 0


def test_a_failed_configuration_is_a_row():
    row = sharding.memory_row("fsdp", "tiny", world_size=2, context=32, batch=2, dtype="fp32", device="cpu",
                              timeout_s=30, fsdp_reduce_dtype="fp8-ish")  # fails inside the workers
    assert row["status"] == "failed" and "fp8-ish" in row["error"] and math.isnan(row["peak_gib"])
    assert row["error"].startswith("rank ") and "\n" not in row["error"]  # the failing rank's cause, one line
    with pytest.raises(ValueError):
        sharding.memory_row("zero3", "tiny", device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", sharding.IMPLS)
def test_memory_row_on_two_gpus(impl, tmp_path):
    """Every implementation runs under NCCL on two GPUs, and the sharded state matches the closed form."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    row = sharding.memory_row(impl, "tiny", world_size=2, context=64, batch=2, dtype="bf16", warmup=1,
                              device="cuda", trace_path=str(tmp_path / "trace.json") if impl == "fsdp" else None)
    assert row["status"] == "ok", row["error"]
    assert row["peak_after_step_gib"] > 0 and row["peak_after_step_n"] == 5  # five steady-state steps
    assert row["optimizer_state_gib"] == pytest.approx(row["expected_optimizer_state_gib"], rel=0.05)


@pytest.mark.gpu
def test_step_times_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    df = sharding.step_times(sharding.IMPLS, "tiny", context=64, device="cuda", interleaving=Interleaving(rounds=2))
    assert (df["status"] == "ok").all() and (df["step_ms"] > 0).all()
