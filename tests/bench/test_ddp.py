"""lab.bench.ddp: the plan of entries and small interleaved runs on gloo (and NCCL where there are GPUs)."""

import math
import statistics
from pathlib import Path

import pytest
import torch

from lab.bench import ddp, distributed
from lab.bench.interleaved import Interleaving, samples
from lab.measure import traces


def test_plan_keys_and_schedules():
    plan = ddp.benchmark_plan((0.5, 4), ("naive", "bucketed", "torch_ddp", "single_gpu"))
    assert plan == [("naive", 0.0), ("bucketed", 0.5), ("bucketed", 4.0), ("torch_ddp", 25.0), ("single_gpu", 0.0)]
    assert [ddp.entry_key(i, b) for i, b in plan] == ["naive", "bucketed_0.5", "bucketed_4", "torch_ddp",
                                                      "single_gpu"]
    with pytest.raises(ValueError, match="unknown impl"):
        ddp.benchmark_plan(impls=("zero3",))
    fits = Interleaving(schedule="auto")
    assert distributed.resolve_schedule(fits, 1e3, 8, "cpu", 2).schedule == "resident"
    assert distributed.resolve_schedule(fits, 1e15, 8, "cpu", 2).schedule == "rebuild"
    assert distributed.resolve_schedule(Interleaving(schedule="rebuild"), 1, 1, "cpu", 2).schedule == "rebuild"


def test_benchmark_ddp_interleaved_on_gloo(tmp_path):
    df = ddp.benchmark_ddp("tiny", context=16, batch=2, device="cpu",
                           impls=("naive", "bucketed", "torch_ddp", "single_gpu"), bucket_sizes_mb=(0.05,),
                           interleaving=Interleaving(rounds=3, warmup=1, schedule="resident"),
                           artifacts_dir=str(tmp_path))
    assert list(df["impl"]) == ["naive", "bucketed", "torch_ddp", "single_gpu"]
    assert (df["status"] == "ok").all() and (df["schedule"] == "resident").all()
    # every implementation, the torch baseline included, has its median and spread over 3 rounds
    assert (df["step_n"] == 3).all() and (df["step_ms"] > 0).all() and (df["step_spread_ms"] >= 0).all()
    for r in df.itertuples():
        xs = samples(r.step_samples_ms)
        assert len(xs) == 3 and r.step_ms == pytest.approx(statistics.median(xs), rel=1e-4)
    assert df.set_index("impl").loc["single_gpu", "world_size"] == 1
    assert (df.loc[df["impl"] != "single_gpu", "comm_ms"] > 0).all()
    assert df.set_index("impl").loc["bucketed", "n_buckets"] > 1
    assert all(Path(p).exists() for p in df["trace"])
    # naive blocks in each all-reduce after backward: the main thread computes nothing while gloo works
    naive = df.set_index("impl").loc["naive"]
    assert naive["overlap_frac"] < 0.05
    timeline = traces.read_trace(naive["trace"])
    assert traces.step_overlap(timeline)["communication_ms"] == pytest.approx(naive["comm_ms"])


def test_benchmark_ddp_rebuilt_each_turn(tmp_path):
    df = ddp.benchmark_ddp("tiny", context=16, batch=2, device="cpu",
                           impls=("torch_ddp", "individual", "bucketed", "single_gpu"), bucket_sizes_mb=(0.05,),
                           interleaving=Interleaving(rounds=2, steps_per_round=2, warmup=1, schedule="rebuild"),
                           profile_steps=0, artifacts_dir=str(tmp_path))
    assert (df["status"] == "ok").all() and (df["schedule"] == "rebuild").all() and (df["step_n"] == 2).all()
    assert df["trace"].isna().all() and df.loc[df["impl"] != "single_gpu", "comm_ms"].isna().all()


def test_an_entry_failing_on_its_ranks_is_a_row_and_the_others_are_timed(tmp_path):
    # a bucket of -1 MiB: DDPBucketed refuses it when the entry is built, on every rank
    df = ddp.benchmark_ddp("tiny", context=16, batch=2, device="cpu", impls=("naive", "bucketed", "single_gpu"),
                           bucket_sizes_mb=(0.05, -1.0),
                           interleaving=Interleaving(rounds=2, warmup=1, schedule="resident"),
                           profile_steps=0, artifacts_dir=str(tmp_path))
    assert list(zip(df["impl"], df["bucket_mb"])) == [("naive", 0), ("bucketed", 0.05), ("bucketed", -1),
                                                      ("single_gpu", 0)]
    bad = df.iloc[2]
    assert bad["status"] == "failed" and "bucket_size_mb must be positive" in bad["error"]
    assert bad["step_n"] == 0 and math.isnan(bad["step_ms"])
    good = df.drop(index=2)
    assert (good["status"] == "ok").all() and (good["step_n"] == 2).all() and (good["step_ms"] > 0).all()
    assert df.loc[1, "n_buckets"] > 1


@pytest.mark.gpu
def test_benchmark_ddp_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    df = ddp.benchmark_ddp("tiny", context=64, batch=2, dtype="bf16", device="cuda",
                           bucket_sizes_mb=(0.5, 100), interleaving=Interleaving(rounds=2),
                           artifacts_dir=str(tmp_path))
    assert (df["status"] == "ok").all() and (df["step_ms"] > 0).all()
    assert (df.loc[df["impl"] != "single_gpu", "comm_ms"] > 0).all()
    for r in df.itertuples():
        tl = traces.read_trace(r.trace)
        assert {"compute", "phase"} <= set(tl["kind"]), r.impl
        assert "backward" in set(tl.loc[tl["kind"] == "phase", "name"]), r.impl
