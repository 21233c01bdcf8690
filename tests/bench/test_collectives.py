"""Collective benchmark: bandwidth arithmetic against nccl-tests' formulas, the grid plan, and a small gloo run."""

import json
import math

import pytest

from lab.bench import collectives


@pytest.mark.parametrize("n", [1, 2, 4, 6, 8])
def test_bus_bandwidth_factors(n):
    assert collectives.bus_bandwidth_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert collectives.bus_bandwidth_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert collectives.bus_bandwidth_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)


def test_bandwidths_in_gb_per_second():
    # 1 GiB in 10 ms: 107.37 GB/s algorithm bandwidth; all-reduce on 4 ranks moves 1.5x that per link
    size = 2**30
    assert collectives.algorithm_bandwidth_gbps(size, 0.01) == pytest.approx(2**30 / 0.01 / 1e9)
    assert collectives.bus_bandwidth_gbps("all_reduce", size, 0.01, 4) == pytest.approx(2**30 / 0.01 / 1e9 * 1.5)
    assert collectives.bus_bandwidth_gbps("all_gather", size, 0.01, 4) == pytest.approx(2**30 / 0.01 / 1e9 * 0.75)
    with pytest.raises(ValueError):
        collectives.bus_bandwidth_factor("broadcast", 2)
    with pytest.raises(ValueError):
        collectives.algorithm_bandwidth_gbps(size, 0.0)


def test_aggregate_takes_the_slowest_rank_per_iteration():
    mk = lambda r, s: [{"op": "all_gather", "size_bytes": 8 * 2**20, "rank": r, "samples_s": s,
                        "correct": True, "status": "ok"}]
    rows = collectives.aggregate_over_ranks([mk(0, [0.001, 0.004, 0.001]), mk(1, [0.003, 0.002, 0.020])], 2, "gloo")
    (row,) = rows
    assert json.loads(row["samples_ms"]) == pytest.approx([3.0, 4.0, 20.0])  # per call: the slowest rank
    assert row["time_ms"] == pytest.approx(4.0)  # their median: the preempted call (20 ms) does not set it
    assert row["time_spread_ms"] == pytest.approx(1.4826) and row["time_n"] == 3  # 1.4826 x MAD, MAD = 1 ms
    assert row["busbw_gbps"] == pytest.approx(8 * 2**20 / 0.004 / 1e9 * 0.5)


def test_plan_world_sizes_skips_what_does_not_fit():
    run, msg = collectives.plan_world_sizes([2, 4, 6], "cpu")
    assert run == [2, 4, 6] and msg == ""
    run, msg = collectives.plan_world_sizes([2, 4, 6], "cuda", gpus=4)
    assert run == [2, 4] and msg.startswith("NCCL cannot run 6 ranks here: this machine has 4 GPU(s)")
    assert "stops at 4 ranks" in msg
    run, msg = collectives.plan_world_sizes([2, 4, 6], "cuda", gpus=0)
    assert run == [] and "only gloo" in msg
    assert collectives.plan_world_sizes([2, 4], "cuda", gpus=8) == ([2, 4], "")


def test_gloo_run_rows_and_values():
    df = collectives.benchmark_collectives(sizes_mb=[0.25], world_sizes=[2], device="cpu", warmup=1, iters=3,
                                           progress=False)
    assert len(df) == 3 and set(df["op"]) == set(collectives.OPS)
    assert (df["status"] == "ok").all() and df["correct"].all() and (df["backend"] == "gloo").all()
    assert all(len(json.loads(s)) == 3 for s in df["samples_ms"])
    assert (df["time_ms"] > 0).all() and (df["time_n"] == 3).all() and (df["time_spread_ms"] >= 0).all()
    assert (df["size_mb"] == 0.25).all()
    for _, row in df.iterrows():
        expected = row["size_bytes"] / (row["time_ms"] / 1e3) / 1e9
        assert math.isclose(row["algbw_gbps"], expected, rel_tol=1e-9)


def _all_gather_fails_on_rank_one(item, warmup, iters):
    from lab.parallel import launcher

    if item[0] == "all_gather" and launcher.rank() == 1:
        raise RuntimeError("injected failure in all_gather")
    return collectives.collective_row(item, warmup, iters)  # (the ranks' own module: not monkeypatched there)


def test_a_failing_collective_is_a_row_and_the_others_are_measured(monkeypatch):
    monkeypatch.setattr(collectives, "collective_row", _all_gather_fails_on_rank_one)
    df = collectives.benchmark_collectives(sizes_mb=[0.25], world_sizes=[2], device="cpu", warmup=1, iters=2,
                                           progress=False).set_index("op")
    assert list(df.index) == list(collectives.OPS)
    assert df.loc["all_gather", "status"] == "failed" and math.isnan(df.loc["all_gather", "time_ms"])
    assert df.loc["all_gather", "error"].startswith("rank 1 failed: RuntimeError: injected failure")
    others = df.drop(index="all_gather")
    assert (others["status"] == "ok").all() and others["correct"].all() and (others["time_ms"] > 0).all()
    assert (others["size_bytes"] == 2**18).all() and df.loc["all_gather", "size_bytes"] == 2**18


@pytest.mark.slow
def test_gloo_run_with_three_ranks():
    df = collectives.benchmark_collectives(sizes_mb=[0.25, 1], world_sizes=[2, 3], device="cpu", warmup=1, iters=2,
                                           progress=False)
    assert len(df) == 3 * 2 * 2
    assert (df["status"] == "ok").all() and df["correct"].all()
    assert set(df["world_size"]) == {2, 3} and (df["backend"] == "gloo").all()
    for _, row in df.iterrows():
        expected = row["size_bytes"] / (row["time_ms"] / 1e3) / 1e9
        assert math.isclose(row["algbw_gbps"], expected, rel_tol=1e-9)
        factor = collectives.bus_bandwidth_factor(row["op"], row["world_size"])
        assert math.isclose(row["busbw_gbps"], expected * factor, rel_tol=1e-9)


def test_latency_bandwidth_fit_recovers_alpha_beta():
    import pandas as pd

    sizes = [2**20, 10 * 2**20, 100 * 2**20]
    rows = [{"backend": "nccl", "op": "all_reduce", "world_size": 2, "size_bytes": s, "status": "ok",
             "time_ms": 0.02 + s / (150e9) * 1e3} for s in sizes]
    fit = collectives.latency_bandwidth_fit(pd.DataFrame(rows))
    assert fit["latency_ms"].item() == pytest.approx(0.02, rel=1e-6)
    assert fit["bandwidth_gbps"].item() == pytest.approx(150.0, rel=1e-6)
    assert fit["sizes"].item() == 3 and fit["max_residual"].item() == pytest.approx(0, abs=1e-9)
    # the size at which latency = size / bandwidth: 20 us * 150 GB/s = 3 MB
    assert fit["half_latency_mb"].item() == pytest.approx(0.02e-3 * 150e9 / 2**20)
    # times that do not grow with size: no bandwidth, all latency
    flat = pd.DataFrame([{**r, "time_ms": 5.0 - i * 0.1} for i, r in enumerate(rows)])
    assert math.isnan(collectives.latency_bandwidth_fit(flat)["bandwidth_gbps"].item())


@pytest.mark.gpu
def test_nccl_run_values_on_two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    df = collectives.benchmark_collectives(sizes_mb=[1, 8], world_sizes=[2], device="cuda", warmup=2, iters=3,
                                           progress=False)
    assert (df["backend"] == "nccl").all() and (df["status"] == "ok").all() and df["correct"].all()
