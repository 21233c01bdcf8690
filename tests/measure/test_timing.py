"""The one timer: every sample kept, warm-up not timed, bad arguments refused."""

import pytest

from lab.measure.timing import Timing, time_callable, time_kernel


def test_time_callable_counts_calls_and_samples():
    calls = []
    t = time_callable(lambda: calls.append(1), warmup=3, steps=5, device="cpu")
    assert len(calls) == 8 and len(t.samples_ms) == 5
    assert all(s >= 0 for s in t.samples_ms)
    assert t.mean_ms == pytest.approx(sum(t.samples_ms) / 5)


def test_timing_statistics():
    t = Timing([1.0, 2.0, 3.0])
    assert t.mean_ms == 2.0 and t.median_ms == 2.0 and t.std_ms == pytest.approx(1.0)
    assert t.cv == pytest.approx(0.5)


def test_requests_that_do_no_work_are_errors():
    with pytest.raises(ValueError, match="steps must be at least 1"):
        time_callable(lambda: None, warmup=0, steps=0, device="cpu")
    with pytest.raises(ValueError, match="warmup"):
        time_callable(lambda: None, warmup=-1, steps=1, device="cpu")


def test_time_kernel_on_the_cpu_uses_the_host_timer():
    calls = []
    t = time_kernel(lambda: calls.append(1), device="cpu", cpu_warmup=2, cpu_steps=4)
    assert len(calls) == 6 and len(t.samples_ms) == 4


def test_time_kernel_asks_do_bench_again_for_too_few_samples(monkeypatch):
    """A call longer than do_bench's budget comes back as one sample: time_kernel runs it again with a budget
    sized from that sample, so that at least ``min_samples`` return (here a fake 200 ms call)."""
    import torch
    import triton.testing

    calls = []

    def fake_do_bench(fn, warmup, rep, return_mode):
        calls.append(rep)
        return [200.0] * max(1, int(rep / 200.0))

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    cuda = torch.device("cuda")
    assert len(time_kernel(lambda: None, cuda, rep_ms=100).samples_ms) == 1  # the default asks nothing more
    timing = time_kernel(lambda: None, cuda, rep_ms=100, min_samples=5)
    assert len(timing.samples_ms) >= 5 and calls[-1] >= 5 * 200.0
    calls.clear()
    time_kernel(lambda: None, cuda, rep_ms=2000, min_samples=5)  # ten samples already: one call
    assert calls == [2000]
    with pytest.raises(ValueError, match="min_samples"):
        time_kernel(lambda: None, cuda, min_samples=0)
