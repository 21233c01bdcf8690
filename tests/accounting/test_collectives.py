"""lab.accounting.collectives: the bucketed all-reduce overhead model, its optimum and its fit."""

import math

import pytest

from lab.accounting import collectives


def test_optimal_bucket_is_the_minimum_of_the_model():
    s, o, w = 10 * 2**30, 0.05, 150.0  # 10 GiB of gradients, 50 us per call, 150 GB/s
    best = collectives.optimal_bucket(s, o, w)
    grid = [collectives.bucket_overhead_ms(n, s, o, w) for n in range(1, 2000)]
    n_grid = 1 + min(range(len(grid)), key=grid.__getitem__)
    assert abs(best["n_buckets"] - n_grid) <= 1
    assert best["overhead_ms"] == pytest.approx(min(grid), rel=1e-3)
    assert best["bucket_mb"] == pytest.approx((s * w * 1e6 * o) ** 0.5 / 2**20)  # sqrt(s w o), w in B/ms
    # one bucket of everything: a full transfer after backward plus one call
    assert collectives.bucket_overhead_ms(1, s, o, w) == pytest.approx(o + s / (w * 1e9) * 1e3)


def test_fit_recovers_the_model_parameters():
    s, o, w = 6e9, 0.08, 90.0
    n = [6, 60, 200, 600]
    y = [collectives.bucket_overhead_ms(k, s, o, w) for k in n]
    fit = collectives.fit_bucket_overhead(n, y, s)
    assert fit["o_ms"] == pytest.approx(o, rel=1e-6)
    assert fit["w_gbps"] == pytest.approx(w, rel=1e-6)
    # bandwidth-free data (overhead grows with n only) falls back to a latency-only fit
    flat = collectives.fit_bucket_overhead(n, [0.1 * k for k in n], s)
    assert flat["o_ms"] == pytest.approx(0.1) and math.isnan(flat["w_gbps"])
