"""lab.book.sharding.bench: the closed forms, the plan, memory in fresh processes and interleaved step times on gloo
(and NCCL where there are GPUs). Moved here from tests/parallel, where the wrappers themselves are tested."""

import math
import statistics

import pandas as pd
import pytest
import torch

from lab.bench.interleaved import Interleaving, samples
from lab.book.sharding import bench as sharding
from lab.book.sharding import traffic as sharding_traffic
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


def test_expected_state_and_traffic_tables():
    table = sharding.expected_state_table(["tiny"], ("ddp", "fsdp"), world_size=2).set_index("impl")
    assert table.loc["ddp", "params_M"] == pytest.approx(1.411392)
    assert table.loc["fsdp", "total_gib"] == pytest.approx(table.loc["ddp", "total_gib"] / 2)
    closed = sharding_traffic.closed_form_traffic("tiny", 2).set_index("impl")
    assert closed.loc["zero1", "ratio_to_ddp"] == pytest.approx(1.0, abs=1e-4)
    assert closed.loc["sharded_optimizer", "ratio_to_ddp"] == pytest.approx(1.5)
    assert closed.loc["ddp", "total_gib"] == pytest.approx(closed.loc["ddp", "total_bytes"] / 2**30)


def test_plan_run_profiles():
    quick = sharding.plan_run(True)
    assert quick.device == "cpu" and quick.sizes == ("tiny",) and quick.context == 64 and "Quick" in quick.note
    assert quick.interleaving.steps_per_round == 1 and quick.impls == sharding.IMPLS
    assert quick.params()["rounds"] == quick.interleaving.rounds
    custom = sharding.plan_run(True, sizes=["small"], context=128, rounds=3, warmup=0, schedule="rebuild")
    assert (custom.sizes, custom.context, custom.interleaving.rounds, custom.warmup) == (("small",), 128, 3, 0)
    if torch.cuda.device_count() < 2:
        assert "needs 2 GPUs" in sharding.plan_run(False).note


def test_memory_breakdown_long_table():
    row = dict(impl="ddp", size="tiny", status="ok", param_gib=1.0, grad_gib=1.0, optimizer_state_gib=2.0,
               activations_gib=0.5, expected_param_gib=1.0, expected_grad_gib=1.0, expected_optimizer_state_gib=2.5)
    b = sharding.memory_breakdown(pd.DataFrame([row, {**row, "impl": "fsdp", "status": "oom"}]))
    assert list(b["part"]) == ["parameters", "gradients", "optimizer state", "activations + transients"]
    assert b.set_index("part").loc["optimizer state", "ratio"] == pytest.approx(0.8)
    assert math.isnan(b.set_index("part").loc["activations + transients", "ratio"])


def test_step_times_interleaved_on_gloo():
    """Our ZeRO-1 and FSDP next to torch's FSDP2, in the same two processes, every one with its rounds."""
    df = sharding.step_times(("zero1", "fsdp", "torch_fsdp2"), "tiny", context=32, dtype="fp32", device="cpu",
                             interleaving=Interleaving(rounds=3, warmup=1, schedule="resident"))
    assert list(df["impl"]) == ["zero1", "fsdp", "torch_fsdp2"]
    assert (df["status"] == "ok").all() and (df["rounds"] == 3).all() and (df["schedule"] == "resident").all()
    for r in df.itertuples():
        xs = samples(r.step_samples_ms)
        assert len(xs) == 3 and r.step_ms == pytest.approx(statistics.median(xs), rel=1e-4) and r.step_iqr_ms >= 0


def test_an_implementation_failing_in_step_times_is_a_row_and_the_others_are_timed():
    # fp8-ish is no reduce dtype: only FSDP's build reads it, on every rank
    df = sharding.step_times(("ddp", "fsdp", "zero1"), "tiny", context=32, dtype="fp32", device="cpu",
                             interleaving=Interleaving(rounds=2, warmup=1, schedule="resident"),
                             fsdp_reduce_dtype="fp8-ish").set_index("impl")
    assert list(df.index) == ["ddp", "fsdp", "zero1"]
    assert df.loc["fsdp", "status"] == "failed" and "fp8-ish" in df.loc["fsdp", "error"]
    assert df.loc["fsdp", "rounds"] == 0 and math.isnan(df.loc["fsdp", "step_ms"])
    others = df.drop(index="fsdp")
    assert (others["status"] == "ok").all() and (others["rounds"] == 2).all() and (others["step_ms"] > 0).all()


@pytest.mark.slow
def test_step_times_rebuilt_each_turn():
    """Every implementation built, stepped and closed in turn (close() clears AdamW's state and the
    gradients, and removes the wrappers' hooks)."""
    df = sharding.step_times(sharding.IMPLS, "tiny", context=32, dtype="fp32",
                             device="cpu", interleaving=Interleaving(rounds=2, steps_per_round=2, schedule="rebuild"))
    assert (df["status"] == "ok").all() and (df["rounds"] == 2).all() and (df["schedule"] == "rebuild").all()


@pytest.mark.slow
def test_memory_row_on_cpu(tmp_path):
    """One configuration's memory run end to end (gloo, tiny model): the state bytes match the closed form and
    the profiled FSDP step shows compute and gloo communication on the timeline."""
    row = sharding.memory_row("fsdp", "tiny", world_size=2, context=32, batch=2, dtype="fp32", warmup=1,
                              device="cpu", trace_path=str(tmp_path / "trace.json"))
    assert row["status"] == "ok", row["error"]
    assert row["reduce_dtype"] == "fp32" and math.isnan(row["peak_gib"])  # no allocator peaks on the CPU
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
    assert row["peak_after_step_gib"] > 0
    assert row["optimizer_state_gib"] == pytest.approx(row["expected_optimizer_state_gib"], rel=0.05)


@pytest.mark.gpu
def test_step_times_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    df = sharding.step_times(sharding.IMPLS, "tiny", context=64, device="cuda", interleaving=Interleaving(rounds=2))
    assert (df["status"] == "ok").all() and (df["step_ms"] > 0).all()


def _zero1_fails_on_rank_one(impl, cfg):
    from lab.parallel import launcher

    if impl == "zero1" and launcher.rank() == 1:
        raise RuntimeError("injected failure in zero1")
    return sharding_traffic.traffic_row(impl, cfg)  # (the ranks' own module: not monkeypatched there)


def test_traffic_matches_the_closed_form_and_a_failing_schedule_is_a_row(monkeypatch):
    monkeypatch.setattr(sharding_traffic, "traffic_row", _zero1_fails_on_rank_one)
    df = sharding_traffic.measure_traffic("tiny", 2, 16, "cpu")
    assert list(dict.fromkeys(df["impl"])) == list(sharding_traffic.IMPLS)
    zero1 = df[df["impl"] == "zero1"]
    assert len(zero1) == 1 and zero1["status"].iloc[0] == "failed" and math.isnan(zero1["measured_bytes"].iloc[0])
    assert zero1["error"].iloc[0].startswith("rank 1 failed: RuntimeError: injected failure in zero1")
    rest = df[df["impl"] != "zero1"]
    assert (rest["status"] == "ok").all() and (rest["measured_bytes"] > 0).all()
    matched = rest.dropna(subset=["expected_bytes"])  # fsdp (measured after the failure, anew) has no closed form
    assert set(matched["impl"]) == {"ddp", "sharded_optimizer"} and set(rest["impl"]) == {"ddp", "sharded_optimizer",
                                                                                         "fsdp"}
    assert (matched["measured_bytes"] == matched["expected_bytes"]).all()
    assert rest.loc[rest["impl"] == "ddp", "measured_ratio_to_ddp"].iloc[0] == 1.0
