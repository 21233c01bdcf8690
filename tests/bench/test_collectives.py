"""Collective benchmark: bandwidth arithmetic against nccl-tests' formulas, and a small gloo run."""

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
    rows = collectives.aggregate_over_ranks([mk(0, [0.001, 0.004]), mk(1, [0.003, 0.002])], 2, "gloo")
    (row,) = rows
    assert row["time_ms"] == pytest.approx(3.5)  # mean of max(1,3)=3 and max(4,2)=4
    assert row["time_ms_rank_mean"] == pytest.approx(2.5)
    assert row["busbw_gbps"] == pytest.approx(8 * 2**20 / 0.0035 / 1e9 * 0.5)


def test_plan_world_sizes_skips_what_does_not_fit():
    run, msg = collectives.plan_world_sizes([2, 4, 6], "cpu")
    assert run == [2, 4, 6] and msg == ""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    run, msg = collectives.plan_world_sizes([2, 4, 6], "cuda")
    assert run == [w for w in (2, 4, 6) if w <= gpus]
    assert (msg != "") == (gpus < 6)


def test_gloo_run_rows_and_values():
    df = collectives.benchmark_collectives(sizes_mb=[0.25, 1], world_sizes=[2, 3], device="cpu", warmup=1, iters=2,
                                           progress=False)
    assert len(df) == 3 * 2 * 2
    assert set(df["op"]) == set(collectives.OPS)
    assert (df["status"] == "ok").all() and df["correct"].all()
    assert set(df["world_size"]) == {2, 3} and (df["backend"] == "gloo").all()
    assert (df["time_ms"] > 0).all() and (df["time_ms"] >= df["time_ms_rank_mean"] - 1e-9).all()
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


@pytest.mark.gpu
def test_nccl_run_values_on_two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    df = collectives.benchmark_collectives(sizes_mb=[1, 8], world_sizes=[2], device="cuda", warmup=2, iters=3,
                                           progress=False)
    assert (df["backend"] == "nccl").all() and (df["status"] == "ok").all() and df["correct"].all()
