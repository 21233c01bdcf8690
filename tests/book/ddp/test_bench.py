"""lab.book.ddp.bench: the bucket overhead model, the plan, and small interleaved runs on gloo (and NCCL where there
are GPUs)."""

import math
import statistics
from pathlib import Path

import pytest
import torch

from lab.bench.interleaved import Interleaving, samples
from lab.book.ddp import bench as ddp_bench
from lab.measure import traces


def test_optimal_bucket_is_the_minimum_of_the_model():
    s, o, w = 10 * 2**30, 0.05, 150.0  # 10 GiB of gradients, 50 us per call, 150 GB/s
    best = ddp_bench.optimal_bucket(s, o, w)
    grid = [ddp_bench.bucket_overhead_ms(n, s, o, w) for n in range(1, 2000)]
    n_grid = 1 + min(range(len(grid)), key=grid.__getitem__)
    assert abs(best["n_buckets"] - n_grid) <= 1
    assert best["overhead_ms"] == pytest.approx(min(grid), rel=1e-3)
    assert best["bucket_mb"] == pytest.approx((s * w * 1e6 * o) ** 0.5 / 2**20)  # sqrt(s w o), w in B/ms
    # one bucket of everything: a full transfer after backward plus one call
    assert ddp_bench.bucket_overhead_ms(1, s, o, w) == pytest.approx(o + s / (w * 1e9) * 1e3)


def test_fit_recovers_the_model_parameters():
    s, o, w = 6e9, 0.08, 90.0
    n = [6, 60, 200, 600]
    y = [ddp_bench.bucket_overhead_ms(k, s, o, w) for k in n]
    fit = ddp_bench.fit_bucket_overhead(n, y, s)
    assert fit["o_ms"] == pytest.approx(o, rel=1e-6)
    assert fit["w_gbps"] == pytest.approx(w, rel=1e-6)
    # bandwidth-free data (overhead grows with n only) falls back to a latency-only fit
    flat = ddp_bench.fit_bucket_overhead(n, [0.1 * k for k in n], s)
    assert flat["o_ms"] == pytest.approx(0.1) and math.isnan(flat["w_gbps"])


def test_plan_keys_and_schedules():
    plan = ddp_bench.benchmark_plan((0.5, 4), ("naive", "bucketed", "torch_ddp", "single_gpu"))
    assert plan == [("naive", 0.0), ("bucketed", 0.5), ("bucketed", 4.0), ("torch_ddp", 25.0), ("single_gpu", 0.0)]
    assert [ddp_bench.entry_key(i, b) for i, b in plan] == ["naive", "bucketed_0.5", "bucketed_4", "torch_ddp",
                                                            "single_gpu"]
    with pytest.raises(ValueError, match="unknown impl"):
        ddp_bench.benchmark_plan(impls=("zero3",))
    fits = Interleaving(schedule="auto")
    assert ddp_bench.resolve_schedule(fits, 1e3, 8, "cpu", 2).schedule == "resident"
    assert ddp_bench.resolve_schedule(fits, 1e15, 8, "cpu", 2).schedule == "rebuild"
    assert ddp_bench.resolve_schedule(Interleaving(schedule="rebuild"), 1, 1, "cpu", 2).schedule == "rebuild"


def test_plan_run_profiles():
    quick = ddp_bench.plan_run(True)
    assert quick.device == "cpu" and quick.backend == "gloo" and quick.configs[0]["size"] == "tiny"
    assert quick.bucket_sizes_mb == (0.1, 1, 10) and quick.interleaving.steps_per_round == 1
    assert quick.note == "Quick profile: a tiny model on 2 CPU processes with gloo."
    custom = ddp_bench.plan_run(True, rounds=3, warmup=0, schedule="rebuild", bucket_sizes_mb=[2])
    assert (custom.interleaving.rounds, custom.interleaving.warmup, custom.bucket_sizes_mb) == (3, 0, (2.0,))
    if torch.cuda.device_count() < 2:  # the full profile falls back to the CPU, and says so
        full = ddp_bench.plan_run(False)
        assert full.device == "cpu" and "needs 2 GPUs" in full.note
    assert ddp_bench.where_to_run(False, "auto", 2, gpus=2) == (True, "Full profile: 2 GPUs with NCCL.")
    on_gpu, note = ddp_bench.where_to_run(False, "cpu", 2, gpus=8)
    assert not on_gpu and "device='cpu' was asked for" in note
    params = quick.params()
    assert params["run_device"] == "cpu" and params["rounds"] == quick.interleaving.rounds


def test_benchmark_ddp_interleaved_on_gloo(tmp_path):
    df = ddp_bench.benchmark_ddp("tiny", context=16, batch=2, device="cpu",
                                 impls=("naive", "bucketed", "torch_ddp", "single_gpu"), bucket_sizes_mb=(0.05,),
                                 interleaving=Interleaving(rounds=3, warmup=1, schedule="resident"),
                                 artifacts_dir=str(tmp_path))
    assert list(df["impl"]) == ["naive", "bucketed", "torch_ddp", "single_gpu"]
    assert (df["status"] == "ok").all() and (df["schedule"] == "resident").all()
    # every implementation, the torch baseline included, has its median and spread over 3 rounds
    assert (df["rounds"] == 3).all() and (df["step_ms"] > 0).all() and (df["step_iqr_ms"] >= 0).all()
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
    df = ddp_bench.benchmark_ddp("tiny", context=16, batch=2, device="cpu",
                                 impls=("torch_ddp", "individual", "bucketed", "single_gpu"), bucket_sizes_mb=(0.05,),
                                 interleaving=Interleaving(rounds=2, steps_per_round=2, warmup=1, schedule="rebuild"),
                                 profile_steps=0, artifacts_dir=str(tmp_path))
    assert (df["status"] == "ok").all() and (df["schedule"] == "rebuild").all() and (df["rounds"] == 2).all()
    assert df["trace"].isna().all() and df.loc[df["impl"] != "single_gpu", "comm_ms"].isna().all()


def test_an_entry_failing_on_its_ranks_is_a_row_and_the_others_are_timed(tmp_path):
    # a bucket of -1 MiB: DDPBucketed refuses it when the entry is built, on every rank
    df = ddp_bench.benchmark_ddp("tiny", context=16, batch=2, device="cpu", impls=("naive", "bucketed", "single_gpu"),
                                 bucket_sizes_mb=(0.05, -1.0),
                                 interleaving=Interleaving(rounds=2, warmup=1, schedule="resident"),
                                 profile_steps=0, artifacts_dir=str(tmp_path))
    assert list(zip(df["impl"], df["bucket_mb"])) == [("naive", 0), ("bucketed", 0.05), ("bucketed", -1),
                                                      ("single_gpu", 0)]
    bad = df.iloc[2]
    assert bad["status"] == "failed" and "bucket_size_mb must be positive" in bad["error"]
    assert bad["rounds"] == 0 and math.isnan(bad["step_ms"])
    good = df.drop(index=2)
    assert (good["status"] == "ok").all() and (good["rounds"] == 2).all() and (good["step_ms"] > 0).all()
    assert df.loc[1, "n_buckets"] > 1


@pytest.mark.gpu
def test_benchmark_ddp_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    df = ddp_bench.benchmark_ddp("tiny", context=64, batch=2, dtype="bf16", device="cuda",
                                 bucket_sizes_mb=(0.5, 100), interleaving=Interleaving(rounds=2),
                                 artifacts_dir=str(tmp_path))
    assert (df["status"] == "ok").all() and (df["step_ms"] > 0).all()
    assert (df.loc[df["impl"] != "single_gpu", "comm_ms"] > 0).all()
    for r in df.itertuples():
        tl = traces.read_trace(r.trace)
        assert {"compute", "phase"} <= set(tl["kind"]), r.impl
        assert "backward" in set(tl.loc[tl["kind"] == "phase", "name"]), r.impl
