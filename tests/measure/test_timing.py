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
