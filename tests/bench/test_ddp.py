"""lab.bench.ddp: the bucket overhead model, and a small benchmark run on gloo (and NCCL where there are GPUs)."""

import math
from pathlib import Path

import pytest
import torch

from lab.bench import ddp as ddp_bench
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


@pytest.mark.slow
def test_benchmark_ddp_small_run(tmp_path):
    df, timelines = ddp_bench.benchmark_ddp("tiny", context=16, batch=2, device="cpu",
                                            impls=("naive", "bucketed", "torch_ddp", "single_gpu"),
                                            bucket_sizes_mb=(0.05, 1), warmup=1, steps=2,
                                            artifacts_dir=str(tmp_path))
    assert list(df["impl"]) == ["naive", "bucketed", "bucketed", "single_gpu", "torch_ddp"]
    assert (df["status"] == "ok").all() and (df["step_ms"] > 0).all()
    assert df.set_index("impl").loc["single_gpu", "world_size"] == 1
    assert (df.loc[df["impl"] != "single_gpu", "comm_ms"] > 0).all()
    assert list(df.loc[df["impl"] == "bucketed", "n_buckets"]) != [1, 1]
    assert set(timelines) == {"naive", "bucketed_0.05", "bucketed_1", "single_gpu", "torch_ddp"}
    assert all(Path(p).exists() for p in df["trace"])
    # naive blocks in each all-reduce after backward: the main thread computes nothing while gloo works
    naive = df.set_index("impl").loc["naive"]
    assert naive["overlap_frac"] < 0.05
    assert traces.step_overlap(timelines["naive"])["communication_ms"] == pytest.approx(naive["comm_ms"])


@pytest.mark.gpu
def test_benchmark_ddp_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    df, timelines = ddp_bench.benchmark_ddp("tiny", context=64, batch=2, dtype="bf16", device="cuda",
                                            bucket_sizes_mb=(0.5, 100), warmup=1, steps=2,
                                            artifacts_dir=str(tmp_path))
    assert (df["status"] == "ok").all() and (df["step_ms"] > 0).all()
    assert (df.loc[df["impl"] != "single_gpu", "comm_ms"] > 0).all()
    for name, tl in timelines.items():
        assert {"compute", "phase"} <= set(tl["kind"]), name
        assert "backward" in set(tl.loc[tl["kind"] == "phase", "name"]), name
